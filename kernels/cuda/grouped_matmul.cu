/*
 * grouped_matmul.cu — CUDA kernels of tm_grouped_matmul: the experts' ragged GEMM as one
 * cuBLASLt GEMM per non-empty group (tm__gemm_cuda, f32 accumulation for f32 and bf16).
 *
 * Layout, as kernels/cpu/grouped_matmul.c:
 *   in[0]  x       (R, K)     rows of group g are [off_g, off_g + counts[g]), off_g = sum_{h<g} counts[h]
 *   in[1]  w       (G, K, N)
 *   in[2]  counts  (G) i64    each >= 0, sum = R
 *   out[0] y       (R, N)     y_g = x_g @ w[g]
 * Backward, accumulating (beta = 1) into gin:
 *   dx_g  += dy_g @ w[g]^T    (counts[g], K)
 *   dw[g] += x_g^T @ dy_g     (K, N); an empty group issues no GEMM, so dw[g] stays as it was
 *
 * The loop needs the group sizes on the host. tm__grouped_matmul_counts takes them from the
 * counts' host mirror (framework/internal.h) when they are a tm_moe_permute's
 * tokens_per_expert, which that forward brought back already: no synchronisation, forward or
 * backward. Other counts are read back once (one synchronisation, counted) and mirrored, so
 * the backward and later calls on the same tensor do not wait again. Either way the values are
 * validated on the host as the CPU does.
 */
#include "common.cuh"

static inline char *at(const void *p, int64_t i, size_t esz) { return (char *)p + i * (int64_t)esz; }

extern "C" tm_status tm__grouped_matmul_forward_cuda(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    const tm_dtype dt = x->dtype;
    const int64_t *cnt;
    TM__TRY(tm__grouped_matmul_counts(c, &cnt));
    const int64_t G = w->shape[0], K = w->shape[1], N = w->shape[2];
    const size_t esz = tm_dtype_size(dt);
    const void *X = tm__data(x), *W = tm__data(w);
    void *Y = tm__data(c->out[0]);
    for (int64_t g = 0, off = 0; g < G; off += cnt[g], g++) {
        if (cnt[g] == 0) continue;
        // (n_g, K) @ (K, N) -> (n_g, N)
        TM__TRY(tm__gemm_cuda(c->ctx, dt, 0, 0, cnt[g], N, K, 1.0, at(X, off * K, esz), K, 0, at(W, g * K * N, esz), N,
                              0, 0.0, at(Y, off * N, esz), N, 0, 1));
    }
    return TM_OK;
}

extern "C" tm_status tm__grouped_matmul_backward_cuda(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *gx = c->gin[0], *gw = c->gin[1];
    if (!gx && !gw) return TM_OK;
    const tm_dtype dt = x->dtype;
    const int64_t *cnt;
    TM__TRY(tm__grouped_matmul_counts(c, &cnt)); /* counts may have been rewritten since the forward */
    const int64_t G = w->shape[0], K = w->shape[1], N = w->shape[2];
    const size_t esz = tm_dtype_size(dt);
    const void *X = tm__data(x), *W = tm__data(w), *DY = tm__data(c->gout[0]);
    for (int64_t g = 0, off = 0; g < G; off += cnt[g], g++) {
        const int64_t n = cnt[g];
        if (n == 0) continue;
        const void *dy = at(DY, off * N, esz);
        if (gx) // (n, N) @ (K, N)^T -> (n, K)
            TM__TRY(tm__gemm_cuda(c->ctx, dt, 0, 1, n, K, N, 1.0, dy, N, 0, at(W, g * K * N, esz), N, 0, 1.0,
                                  at(tm__data(gx), off * K, esz), K, 0, 1));
        if (gw) // (n, K)^T @ (n, N) -> (K, N)
            TM__TRY(tm__gemm_cuda(c->ctx, dt, 1, 0, K, N, n, 1.0, at(X, off * K, esz), K, 0, dy, N, 0, 1.0,
                                  at(tm__data(gw), g * K * N, esz), N, 0, 1));
    }
    return TM_OK;
}
