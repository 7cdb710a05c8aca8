/*
 * matmul.c — CPU kernels of tm_matmul: C = op(A) @ op(B), everything through tm__gemm_cpu.
 *
 * Layout (batch = product of a's leading dims):
 *   in[0]     a  (batch, M, K), or (batch, K, M) when trans_a
 *   in[1]     b  (K, N) or (N, K) when trans_b, shared by every batch;
 *                or (batch, K, N) / (batch, N, K): one matrix per batch
 *   iattr[0]  trans_a, iattr[1] trans_b (0/1)
 *   out[0]    c  (batch, M, N)
 *
 * With a shared b and no trans_a the batch folds into M: a is one (batch*M, K) matrix, so the
 * whole op is a single large GEMM (the common case: activations @ weights). Otherwise one GEMM
 * per batch; each is parallel inside (OpenBLAS threads or the blocked kernel's OpenMP), so the
 * loop stays serial and BLAS is never called from inside a parallel region.
 *
 * Backward, with op(A) (M,K), op(B) (K,N), dC (M,N), all accumulating (beta = 1) into gin, or
 * writing it (beta = 0) where it is fresh (call->gin_fresh, TM__OP_GRAD_WRITES):
 *   d op(A) = dC @ op(B)^T       ->  dA = dC @ op(B)^T        (trans_a = 0)
 *                                    dA = op(B) @ dC^T        (trans_a = 1: dA = (d op(A))^T)
 *   d op(B) = op(A)^T @ dC       ->  dB = op(A)^T @ dC        (trans_b = 0)
 *                                    dB = dC^T @ op(A)        (trans_b = 1)
 * A shared b receives the sum over the batch: the folded GEMM sums over batch*M directly,
 * the per-batch loop sums through beta = 1.
 */
#include "internal.h"

typedef struct mm_dims {
    int64_t batch, M, N, K;
    int64_t lda, ldb;       /* row strides of a and b as stored */
    int64_t sa, sb, sc;     /* elements between consecutive batch matrices (sb = 0: shared) */
    int ta, tb;
    size_t esz;
} mm_dims;

static mm_dims mm_dims_of(const tm__call *c) {
    const tm_tensor *a = c->in[0], *b = c->in[1];
    mm_dims d;
    int nd = a->ndim;
    d.ta = (int)c->iattr[0];
    d.tb = (int)c->iattr[1];
    d.M = a->shape[nd - 2 + d.ta];
    d.K = a->shape[nd - 1 - d.ta];
    d.N = b->shape[b->ndim - 1 - d.tb];
    d.batch = 1;
    for (int i = 0; i < nd - 2; i++) d.batch *= a->shape[i];
    d.lda = d.ta ? d.M : d.K;
    d.ldb = d.tb ? d.K : d.N;
    d.sa = d.M * d.K;
    d.sb = b->ndim > 2 ? d.K * d.N : 0;
    d.sc = d.M * d.N;
    d.esz = tm_dtype_size(a->dtype);
    return d;
}

/* Element offset i of a matrix array, as a byte pointer. */
static inline char *at(const void *p, int64_t i, size_t esz) { return (char *)p + i * (int64_t)esz; }

tm_status tm__matmul_forward_cpu(tm__call *c) {
    const tm_tensor *a = c->in[0], *b = c->in[1];
    tm_tensor *out = c->out[0];
    tm_dtype dt = a->dtype;
    if (dt != TM_F32 && dt != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "matmul: CPU kernel got %s", tm__tdesc(c->ctx, a));
    mm_dims d = mm_dims_of(c);
    const void *A = tm__data(a), *B = tm__data(b);
    void *C = tm__data(out);
    if (d.sb == 0 && !d.ta) {
        // (batch*M, K) @ op(B) -> (batch*M, N)
        tm__gemm_cpu(c->ctx, dt, 0, d.tb, d.batch * d.M, d.N, d.K, 1.0, A, d.lda, B, d.ldb, 0.0, C, d.N);
        return TM_OK;
    }
    for (int64_t i = 0; i < d.batch; i++)
        tm__gemm_cpu(c->ctx, dt, d.ta, d.tb, d.M, d.N, d.K, 1.0, at(A, i * d.sa, d.esz), d.lda,
                     at(B, i * d.sb, d.esz), d.ldb, 0.0, at(C, i * d.sc, d.esz), d.N);
    return TM_OK;
}

tm_status tm__matmul_backward_cpu(tm__call *c) {
    const tm_tensor *a = c->in[0], *b = c->in[1];
    tm_tensor *ga = c->gin[0], *gb = c->gin[1];
    tm_dtype dt = a->dtype;
    if (dt != TM_F32 && dt != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "matmul: CPU kernel got %s", tm__tdesc(c->ctx, a));
    mm_dims d = mm_dims_of(c);
    const void *A = tm__data(a), *B = tm__data(b), *G = tm__data(c->gout[0]);
    int fold = d.sb == 0 && !d.ta;
    /* a fresh gradient (call->gin_fresh) is written by beta = 0, which never reads it */
    double ba = c->gin_fresh[0] ? 0.0 : 1.0, bb = c->gin_fresh[1] ? 0.0 : 1.0;

    if (ga) {
        void *GA = tm__data(ga);
        if (fold) {
            // (batch*M, N) @ op(B)^T -> (batch*M, K)
            tm__gemm_cpu(c->ctx, dt, 0, !d.tb, d.batch * d.M, d.K, d.N, 1.0, G, d.N, B, d.ldb,
                         ba, GA, d.K);
        } else {
            for (int64_t i = 0; i < d.batch; i++) {
                const void *Bi = at(B, i * d.sb, d.esz), *Gi = at(G, i * d.sc, d.esz);
                void *GAi = at(GA, i * d.sa, d.esz);
                if (!d.ta) // dA (M, K) = dC @ op(B)^T
                    tm__gemm_cpu(c->ctx, dt, 0, !d.tb, d.M, d.K, d.N, 1.0, Gi, d.N, Bi, d.ldb, ba,
                                 GAi, d.K);
                else // dA (K, M) = op(B) @ dC^T
                    tm__gemm_cpu(c->ctx, dt, d.tb, 1, d.K, d.M, d.N, 1.0, Bi, d.ldb, Gi, d.N, ba,
                                 GAi, d.M);
            }
        }
    }
    if (gb) {
        void *GB = tm__data(gb);
        if (fold) {
            int64_t R = d.batch * d.M; // rows of the folded A and dC
            if (!d.tb) // dB (K, N) = A^T @ dC over all R rows
                tm__gemm_cpu(c->ctx, dt, 1, 0, d.K, d.N, R, 1.0, A, d.K, G, d.N, bb, GB, d.N);
            else // dB (N, K) = dC^T @ A
                tm__gemm_cpu(c->ctx, dt, 1, 0, d.N, d.K, R, 1.0, G, d.N, A, d.K, bb, GB, d.K);
        } else {
            for (int64_t i = 0; i < d.batch; i++) {
                const void *Ai = at(A, i * d.sa, d.esz), *Gi = at(G, i * d.sc, d.esz);
                void *GBi = at(GB, i * d.sb, d.esz);
                /* a shared b sums over the batch: only its first GEMM writes a fresh dB */
                double bi = d.sb == 0 && i > 0 ? 1.0 : bb;
                if (!d.tb) // dB (K, N) = op(A)^T @ dC
                    tm__gemm_cpu(c->ctx, dt, !d.ta, 0, d.K, d.N, d.M, 1.0, Ai, d.lda, Gi, d.N, bi,
                                 GBi, d.N);
                else // dB (N, K) = dC^T @ op(A)
                    tm__gemm_cpu(c->ctx, dt, 1, d.ta, d.N, d.K, d.M, 1.0, Gi, d.N, Ai, d.lda, bi,
                                 GBi, d.K);
            }
        }
    }
    return TM_OK;
}
