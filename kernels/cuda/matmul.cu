/*
 * matmul.cu — CUDA kernels of tm_matmul: every product is one cuBLASLt call (tm__gemm_cuda),
 * f32 accumulation for f32 and bf16 alike.
 *
 * Layout (as kernels/cpu/matmul.c): iattr[0] = trans_a, iattr[1] = trans_b;
 *   a    (..., M, K), or (..., K, M) when trans_a; `batch` = product of the leading dims
 *   b    (K, N) shared by every batch, or (..., K, N) with a's leading dims; (N, K) when trans_b
 *   out  (..., M, N)
 * With C = op(A) op(B):
 *   dA = dC op(B)^T          stored transposed when trans_a: dA^T = op(B) dC^T
 *   dB = op(A)^T dC          stored transposed when trans_b: dB^T = dC^T op(A)
 * A 2-D b is broadcast over the batch (batch stride 0), and its gradient is summed over the
 * batch. Backward adds into gin with beta = 1, or writes it with beta = 0 where it is fresh
 * (call->gin_fresh, TM__OP_GRAD_WRITES: cuBLASLt never reads C then).
 */
#include "common.cuh"

typedef struct mm_dims {
    int64_t batch, M, N, K;
    int ta, tb, b_batched;
} mm_dims;

static mm_dims mm_dims_of(const tm__call *c) {
    const tm_tensor *a = c->in[0], *b = c->in[1];
    mm_dims d;
    d.ta = (int)c->iattr[0];
    d.tb = (int)c->iattr[1];
    int nd = a->ndim;
    d.batch = 1;
    for (int i = 0; i < nd - 2; i++) d.batch *= a->shape[i];
    d.M = a->shape[nd - 2 + d.ta];
    d.K = a->shape[nd - 1 - d.ta];
    d.N = b->shape[b->ndim - 1 - d.tb];
    d.b_batched = b->ndim > 2;
    return d;
}

extern "C" tm_status tm__matmul_forward_cuda(tm__call *c) {
    const tm_tensor *a = c->in[0], *b = c->in[1];
    mm_dims d = mm_dims_of(c);
    int64_t lda = d.ta ? d.M : d.K, ldb = d.tb ? d.K : d.N;
    void *C = tm__data(c->out[0]);
    if (!d.b_batched && !d.ta) /* (batch*M, K) @ (K, N): one plain GEMM */
        return tm__gemm_cuda(c->ctx, a->dtype, 0, d.tb, d.batch * d.M, d.N, d.K, 1.0, tm__data(a), lda, 0,
                             tm__data(b), ldb, 0, 0.0, C, d.N, 0, 1);
    return tm__gemm_cuda(c->ctx, a->dtype, d.ta, d.tb, d.M, d.N, d.K, 1.0, tm__data(a), lda, d.M * d.K,
                         tm__data(b), ldb, d.b_batched ? d.K * d.N : 0, 0.0, C, d.N, d.M * d.N, d.batch);
}

extern "C" tm_status tm__matmul_backward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *a = c->in[0], *b = c->in[1];
    tm_tensor *ga = c->gin[0], *gb = c->gin[1];
    mm_dims d = mm_dims_of(c);
    tm_dtype dt = a->dtype;
    const void *A = tm__data(a), *B = tm__data(b), *G = tm__data(c->gout[0]);
    int64_t lda = d.ta ? d.M : d.K, ldb = d.tb ? d.K : d.N;
    int64_t sa = d.M * d.K, sb = d.b_batched ? d.K * d.N : 0, sg = d.M * d.N;
    /* a fresh gradient (call->gin_fresh) is written by beta = 0, which never reads it */
    double ba = c->gin_fresh[0] ? 0.0 : 1.0, bb = c->gin_fresh[1] ? 0.0 : 1.0;

    if (ga) {
        void *GA = tm__data(ga);
        if (!d.ta) { /* dA (M, K) = dC (M, N) @ op(B)^T */
            if (!d.b_batched)
                TM__TRY(tm__gemm_cuda(ctx, dt, 0, !d.tb, d.batch * d.M, d.K, d.N, 1.0, G, d.N, 0, B, ldb, 0, ba,
                                      GA, d.K, 0, 1));
            else
                TM__TRY(tm__gemm_cuda(ctx, dt, 0, !d.tb, d.M, d.K, d.N, 1.0, G, d.N, sg, B, ldb, sb, ba, GA, d.K,
                                      sa, d.batch));
        } else { /* dA^T (K, M) = op(B) (K, N) @ dC^T (N, M) */
            TM__TRY(tm__gemm_cuda(ctx, dt, d.tb, 1, d.K, d.M, d.N, 1.0, B, ldb, sb, G, d.N, sg, ba, GA, d.M, sa,
                                  d.batch));
        }
    }
    if (gb) {
        void *GB = tm__data(gb);
        if (d.b_batched) {
            if (!d.tb) /* dB (K, N) = op(A)^T (K, M) @ dC (M, N) */
                TM__TRY(tm__gemm_cuda(ctx, dt, !d.ta, 0, d.K, d.N, d.M, 1.0, A, lda, sa, G, d.N, sg, bb, GB, d.N,
                                      sb, d.batch));
            else /* dB^T (N, K) = dC^T (N, M) @ op(A) (M, K) */
                TM__TRY(tm__gemm_cuda(ctx, dt, 1, d.ta, d.N, d.K, d.M, 1.0, G, d.N, sg, A, lda, sa, bb, GB, d.K,
                                      sb, d.batch));
        } else if (!d.ta) {
            /* a is (batch*M, K) contiguous: the batch sum is part of the GEMM's inner dim. */
            if (!d.tb)
                TM__TRY(tm__gemm_cuda(ctx, dt, 1, 0, d.K, d.N, d.batch * d.M, 1.0, A, d.K, 0, G, d.N, 0, bb, GB,
                                      d.N, 0, 1));
            else
                TM__TRY(tm__gemm_cuda(ctx, dt, 1, 0, d.N, d.K, d.batch * d.M, 1.0, G, d.N, 0, A, d.K, 0, bb, GB,
                                      d.K, 0, 1));
        } else {
            /* a transposed per batch: no single GEMM sums over the batch; accumulate one GEMM per
             * batch entry, in order (deterministic, no atomics). */
            for (int64_t i = 0; i < d.batch; i++) {
                const char *Ai = (const char *)A + (size_t)(i * sa) * tm_dtype_size(dt);
                const char *Gi = (const char *)G + (size_t)(i * sg) * tm_dtype_size(dt);
                double bi = i > 0 ? 1.0 : bb; /* the batch sum: only the first GEMM writes a fresh dB */
                if (!d.tb)
                    TM__TRY(tm__gemm_cuda(ctx, dt, 0, 0, d.K, d.N, d.M, 1.0, Ai, lda, 0, Gi, d.N, 0, bi, GB, d.N,
                                          0, 1));
                else
                    TM__TRY(tm__gemm_cuda(ctx, dt, 1, 1, d.N, d.K, d.M, 1.0, Gi, d.N, 0, Ai, lda, 0, bi, GB, d.K,
                                          0, 1));
            }
        }
    }
    return TM_OK;
}
