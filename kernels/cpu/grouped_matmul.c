/*
 * grouped_matmul.c — CPU kernels of tm_grouped_matmul: the experts' ragged GEMM.
 *
 * Layout:
 *   in[0]  x       (R, K)     rows of group g are [off_g, off_g + counts[g]), off_g = sum_{h<g} counts[h]
 *   in[1]  w       (G, K, N)
 *   in[2]  counts  (G) i64    each >= 0, sum = R
 *   out[0] y       (R, N)     y_g = x_g @ w[g]
 *
 * Backward, all accumulating (beta = 1) into gin, except a fresh dx (call->gin_fresh,
 * TM__OP_GRAD_WRITES), which the groups' beta = 0 GEMMs write whole (they tile its rows):
 *   dx_g    += dy_g @ w[g]^T        (counts[g], K)
 *   dw[g]   += x_g^T @ dy_g         (K, N)
 * An empty group issues no GEMM at all: its dw[g] is never touched (stays whatever it was,
 * zero for a fresh gradient), rather than being "written" by a K x N GEMM over zero rows.
 *
 * The group sizes come from tm__grouped_matmul_counts (framework/ops/grouped_matmul.c), which
 * validates them and counts the synchronisation a device would make to read them when they
 * have no host mirror (counts that are not a tm_moe_permute's tokens_per_expert).
 *
 * One tm__gemm_cpu per non-empty group, serially: BLAS (or the blocked kernel's OpenMP) is
 * parallel inside each GEMM, and BLAS must not be called from inside a parallel region. With
 * dropless routing the groups are large (about R / G rows each), so this is the efficient order.
 */
#include "internal.h"

static inline char *at(const void *p, int64_t i, size_t esz) { return (char *)p + i * (int64_t)esz; }

tm_status tm__grouped_matmul_forward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_dtype dt = x->dtype;
    if (dt != TM_F32 && dt != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "grouped_matmul: CPU kernel got x %s", tm__tdesc(c->ctx, x));
    const int64_t *cnt;
    TM__TRY(tm__grouped_matmul_counts(c, &cnt));
    int64_t G = w->shape[0], K = w->shape[1], N = w->shape[2];
    size_t esz = tm_dtype_size(dt);
    const void *X = tm__data(x), *W = tm__data(w);
    void *Y = tm__data(c->out[0]);
    for (int64_t g = 0, off = 0; g < G; off += cnt[g], g++) {
        if (cnt[g] == 0) continue;
        // (n_g, K) @ (K, N) -> (n_g, N)
        tm__gemm_cpu(c->ctx, dt, 0, 0, cnt[g], N, K, 1.0, at(X, off * K, esz), K, at(W, g * K * N, esz), N,
                     0.0, at(Y, off * N, esz), N);
    }
    return TM_OK;
}

tm_status tm__grouped_matmul_backward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *gx = c->gin[0], *gw = c->gin[1];
    tm_dtype dt = x->dtype;
    if (dt != TM_F32 && dt != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "grouped_matmul: CPU kernel got x %s", tm__tdesc(c->ctx, x));
    if (!gx && !gw) return TM_OK;
    const int64_t *cnt;
    TM__TRY(tm__grouped_matmul_counts(c, &cnt)); /* counts may have been rewritten since the forward */
    /* the groups tile dx's rows (counts sum to R): a fresh dx is written by beta = 0; dw skips
     * empty groups, so a fresh dw is zero-filled first */
    TM__TRY(tm__gin_prepare(c, 1));
    double bx = c->gin_fresh[0] ? 0.0 : 1.0;
    int64_t G = w->shape[0], K = w->shape[1], N = w->shape[2];
    size_t esz = tm_dtype_size(dt);
    const void *X = tm__data(x), *W = tm__data(w), *DY = tm__data(c->gout[0]);
    for (int64_t g = 0, off = 0; g < G; off += cnt[g], g++) {
        int64_t n = cnt[g];
        if (n == 0) continue;
        const void *dy = at(DY, off * N, esz);
        if (gx) // (n, N) @ (K, N)^T -> (n, K)
            tm__gemm_cpu(c->ctx, dt, 0, 1, n, K, N, 1.0, dy, N, at(W, g * K * N, esz), N, bx,
                         at(tm__data(gx), off * K, esz), K);
        if (gw) // (n, K)^T @ (n, N) -> (K, N)
            tm__gemm_cpu(c->ctx, dt, 1, 0, K, N, n, 1.0, at(X, off * K, esz), K, dy, N, 1.0,
                         at(tm__data(gw), g * K * N, esz), N);
    }
    return TM_OK;
}
