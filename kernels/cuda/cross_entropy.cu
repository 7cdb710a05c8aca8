/*
 * cross_entropy.cu — CUDA kernels of tm_cross_entropy, fused: probabilities are never
 * materialised in the forward pass; the backward recomputes them from the saved logsumexp.
 *
 * Layout, shared with kernels/cpu/cross_entropy.c:
 *   in[0] logits (N, V) f32/bf16, in[1] targets (N) i32/i64, iattr[0] ignore_index,
 *   iattr[1] 1: targets known valid (tm__cross_entropy_unchecked), the flag is not read back
 *   iattr[2] 1: the loss is f32 for bf16 logits (tm__cross_entropy_unchecked)
 *   out[0] loss () = mean over valid rows of lse[n] - logits[n, targets[n]]; 0 if none; the
 *          logits' dtype, or f32 (iattr[2])
 *   saved[0] lse (N) f32 (0 for ignored rows), saved[1] n_valid () i64
 * Backward, valid rows only: dlogits[n, v] += (exp(logits[n, v] - lse[n]) - [v == t]) * dloss / n_valid
 *
 * Memory: the logits are read where they are, in their dtype; the forward keeps only lse (4 N
 * bytes) beside them, and the backward recomputes each probability from the logits and lse and
 * adds it into dlogits in the logits' dtype (f32 arithmetic, one rounding). With bf16 logits
 * and an f32 loss (the model's LM head, iattr[2]) nothing of size (N, V) is ever f32: before,
 * the model cast the logits to an f32 copy (4 N V bytes, kept for the backward), whose f32
 * gradient (4 N V more) a cast backward then rounded to bf16. The results are the same bits:
 * bf16 -> f32 is exact, and rounding rn_f32(0 + g s) to bf16 in one store is what the cast
 * backward did with the f32 gradient. Both directions give one block to each row (the classes
 * in groups of 8, CE_G below, 16-byte accesses where the row is aligned), so no element pays a
 * 64-bit division by V to find its row.
 * Launches per step of a bf16 model (derived from the code): forward 3 -> 2 (the cast's copy
 * kernel, ce_forward_kernel, ce_total_kernel), backward 3 -> 1 (ce_backward_kernel, then the
 * cast's backward: a copy to a bf16 temporary and an accumulate kernel); (N, V) buffers beside
 * the bf16 logits and their gradient: f32 logits + f32 gradient + bf16 temporary -> none.
 *
 * Targets are validated on the device: a row whose target is outside [0, V) and is not
 * ignore_index lowers a flag (atomicMin of its row index); the flag is copied back once at the
 * end of the forward, which is the op's only synchronisation, and the first bad row is named
 * in the TM_ERR_INDEX message. A bad row never reads logits at its target. With iattr[1] set
 * (the caller validated the targets on the device already, as tm_model_forward does) the
 * flag is not read back and the forward does not synchronise.
 */
#include "common.cuh"
#include "vec.cuh"

#define CE_NO_BAD_ROW 0xffffffffffffffffull

/* The rows are read in groups of CE_G = 8 consecutive classes (thread i takes groups i, i +
 * blockDim.x, ..., each group in order; the classes past the last whole group one per thread):
 * the same order for f32 and bf16 logits, so that the bf16 path and the f32 cast it replaced
 * give the same bits (tests/test_cuda_parity_cross_entropy.c). A group is one 16-byte load
 * (bf16) or two (f32) when the row starts 16-byte aligned (V a multiple of 8 and an aligned
 * base: the model's rows), else eight element loads in the same order. */
#define CE_G 8

/* One block per row: lse[n], loss_rows[n] (0 for ignored or bad rows). */
template <typename T, typename I>
__global__ void ce_forward_kernel(float *loss_rows, float *lse, unsigned long long *bad, const void *logits_,
                                  const I *targets, int64_t V, int64_t ign) {
    __shared__ float sh[32];
    int64_t n = blockIdx.x;
    int64_t t = (int64_t)targets[n];
    if (t == ign || t < 0 || t >= V) {
        if (threadIdx.x == 0) {
            lse[n] = 0.0f;
            loss_rows[n] = 0.0f;
            if (t != ign) atomicMin(bad, (unsigned long long)n);
        }
        return;
    }
    const T *x = (const T *)logits_ + n * V;
    const bool vec = ((uintptr_t)x & 15u) == 0;
    const int64_t ng = V / CE_G;
    float mx = -INFINITY;
#pragma unroll 4
    for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) {
        float f[CE_G];
        tm__vld_group<CE_G>(x + j * CE_G, f, vec);
#pragma unroll
        for (int k = 0; k < CE_G; k++) mx = fmaxf(mx, f[k]);
    }
    for (int64_t v = ng * CE_G + threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, tm__ld(x + v));
    mx = tm__block_max(mx, sh);
    float sum = 0.0f;
#pragma unroll 4
    for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) {
        float f[CE_G];
        tm__vld_group<CE_G>(x + j * CE_G, f, vec);
#pragma unroll
        for (int k = 0; k < CE_G; k++) sum += expf(f[k] - mx);
    }
    for (int64_t v = ng * CE_G + threadIdx.x; v < V; v += blockDim.x) sum += expf(tm__ld(x + v) - mx);
    sum = tm__block_sum(sum, sh);
    if (threadIdx.x == 0) {
        float l = mx + logf(sum);
        lse[n] = l;
        loss_rows[n] = l - tm__ld(x + t);
    }
}

/* One block: loss = sum(loss_rows) / n_valid (0 when no row is valid), stored in T, or in f32
 * when loss_f32; n_valid saved. */
template <typename T, typename I>
__global__ void ce_total_kernel(void *loss_, int64_t *n_valid, const float *loss_rows, const I *targets, int64_t N,
                                int64_t ign, int loss_f32) {
    __shared__ float sh[32];
    __shared__ long long shk[32];
    float s = 0.0f;
    long long k = 0;
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
        s += loss_rows[n];
        k += (int64_t)targets[n] != ign;
    }
    s = tm__block_sum(s, sh);
    k = tm__block_sum_ll(k, shk);
    if (threadIdx.x == 0) {
        *n_valid = k;
        float l = k ? s / (float)k : 0.0f;
        if (loss_f32) *(float *)loss_ = l;
        else tm__st((T *)loss_, l);
    }
}

/* One block per row n, in chunks of blockDim.x classes (no division per element); ignored rows
 * get nothing. dloss_ is T, or f32 when dloss_f32 (the loss of iattr[2]). fresh: dlogits is a
 * fresh gradient (call->gin_fresh, TM__OP_GRAD_WRITES), written whole without being read (0 +
 * the gradient; zeros in ignored rows, and everywhere when no row is valid). */
template <typename T, typename I>
__global__ void ce_backward_kernel(void *dlogits_, const void *logits_, const float *lse, const I *targets,
                                   const void *dloss_, int dloss_f32, const int64_t *n_valid, int64_t V, int64_t ign,
                                   int fresh) {
    int64_t k = *n_valid, n = blockIdx.x;
    int64_t t = (int64_t)targets[n];
    T *d = (T *)dlogits_ + n * V;
    if (k == 0 || t == ign) {
        if (fresh)
            for (int64_t v = threadIdx.x; v < V; v += blockDim.x) tm__st(d + v, 0.0f);
        return;
    }
    float scale = (dloss_f32 ? *(const float *)dloss_ : tm__ld((const T *)dloss_)) / (float)k, l = lse[n];
    const T *x = (const T *)logits_ + n * V;
    /* the forward's groups (each element's value does not depend on the order) */
    const bool vec = (((uintptr_t)x | (uintptr_t)d) & 15u) == 0;
    const int64_t ng = V / CE_G;
#pragma unroll 2
    for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) {
        const int64_t v0 = j * CE_G;
        float xf[CE_G], df[CE_G];
        tm__vld_group<CE_G>(x + v0, xf, vec);
        if (fresh) {
#pragma unroll
            for (int k = 0; k < CE_G; k++) df[k] = 0.0f;
        } else {
            tm__vld_group<CE_G>(d + v0, df, vec);
        }
#pragma unroll
        for (int k = 0; k < CE_G; k++) {
            float g = expf(xf[k] - l) - (v0 + k == t ? 1.0f : 0.0f);
            df[k] = df[k] + g * scale;
        }
        tm__vst_group<CE_G>(d + v0, df, vec);
    }
    for (int64_t v = ng * CE_G + threadIdx.x; v < V; v += blockDim.x) {
        float g = expf(tm__ld(x + v) - l) - (v == t ? 1.0f : 0.0f);
        tm__st(d + v, (fresh ? 0.0f : tm__ld(d + v)) + g * scale);
    }
}

template <typename I>
static void ce_forward_launch(tm_dtype dt, const tm__cuda *st, int64_t N, int threads, float *loss_rows, float *lse,
                              unsigned long long *bad, const void *logits, const void *tg, void *loss, int loss_f32,
                              int64_t *n_valid, int64_t V, int64_t ign) {
    const I *t = (const I *)tg;
    if (dt == TM_BF16) {
        ce_forward_kernel<tm__bf16, I><<<(unsigned)N, threads, 0, st->stream>>>(loss_rows, lse, bad, logits, t, V, ign);
        ce_total_kernel<tm__bf16, I><<<1, 1024, 0, st->stream>>>(loss, n_valid, loss_rows, t, N, ign, loss_f32);
    } else {
        ce_forward_kernel<float, I><<<(unsigned)N, threads, 0, st->stream>>>(loss_rows, lse, bad, logits, t, V, ign);
        ce_total_kernel<float, I><<<1, 1024, 0, st->stream>>>(loss, n_valid, loss_rows, t, N, ign, loss_f32);
    }
}

extern "C" tm_status tm__cross_entropy_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "cross_entropy";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *logits = c->in[0], *tg = c->in[1];
    int64_t N = logits->shape[0], V = logits->shape[1], ign = c->iattr[0];
    tm_tensor *lse, *count;
    TM__TRY(tm__saved_new(c, TM_F32, 1, &N, &lse));
    TM__TRY(tm__saved_new(c, TM_I64, 0, &N, &count));
    if (N == 0) {
        TM__TRY(tm__cuda_memset0(ctx, tm__data(count), sizeof(int64_t)));
        return tm__cuda_fill(ctx, c->out[0], 0.0);
    }
    float *loss_rows;
    unsigned long long *bad;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)N * sizeof(float), (void **)&loss_rows));
    TM__TRY(tm__cu_scratch(ctx, st, sizeof *bad, (void **)&bad));
    TM__CU_CHECK(ctx, what, cudaMemsetAsync(bad, 0xff, sizeof *bad, st->stream)); /* CE_NO_BAD_ROW */
    int threads = tm__cu_row_threads(V);
    int loss_f32 = c->out[0]->dtype == TM_F32;
    if (tg->dtype == TM_I32)
        ce_forward_launch<int32_t>(logits->dtype, st, N, threads, loss_rows, (float *)tm__data(lse), bad,
                                   tm__data(logits), tm__data(tg), tm__data(c->out[0]), loss_f32,
                                   (int64_t *)tm__data(count), V, ign);
    else
        ce_forward_launch<int64_t>(logits->dtype, st, N, threads, loss_rows, (float *)tm__data(lse), bad,
                                   tm__data(logits), tm__data(tg), tm__data(c->out[0]), loss_f32,
                                   (int64_t *)tm__data(count), V, ign);
    TM__CU_LAUNCHED(ctx, what, "ce_forward_kernel / ce_total_kernel");
    if (c->iattr[1]) return TM_OK;

    unsigned long long first_bad;
    TM__TRY(tm__cuda_memcpy(ctx, &first_bad, bad, sizeof first_bad, TM__D2H));
    if (first_bad != CE_NO_BAD_ROW) {
        int64_t n = (int64_t)first_bad, t;
        if (tg->dtype == TM_I32) {
            int32_t t32;
            TM__TRY(tm__cuda_memcpy(ctx, &t32, (const int32_t *)tm__data(tg) + n, sizeof t32, TM__D2H));
            t = t32;
        } else {
            TM__TRY(tm__cuda_memcpy(ctx, &t, (const int64_t *)tm__data(tg) + n, sizeof t, TM__D2H));
        }
        return tm__err(ctx, TM_ERR_INDEX,
                       "cross_entropy: targets[%lld] = %lld is outside [0, %lld) and is not ignore_index (%lld); logits %s, targets %s",
                       (long long)n, (long long)t, (long long)V, (long long)ign, tm__tdesc(ctx, logits),
                       tm__tdesc(ctx, tg));
    }
    return TM_OK;
}

extern "C" tm_status tm__cross_entropy_backward_cuda(tm__call *c) {
    tm_tensor *dl = c->gin[0];
    if (!dl) return TM_OK;
    tm_ctx *ctx = c->ctx;
    const char *what = "cross_entropy";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *logits = c->in[0], *tg = c->in[1];
    int64_t N = logits->shape[0], V = logits->shape[1], ign = c->iattr[0];
    if (N * V == 0) return TM_OK;
    const float *lse = (const float *)tm__data(c->saved[0]);
    const int64_t *n_valid = (const int64_t *)tm__data(c->saved[1]);
    int dloss_f32 = c->gout[0]->dtype == TM_F32, fresh = c->gin_fresh[0];
    unsigned g = (unsigned)N;
    int threads = tm__cu_row_threads(V);
    if (tg->dtype == TM_I32) {
        const int32_t *t = (const int32_t *)tm__data(tg);
        if (logits->dtype == TM_BF16)
            ce_backward_kernel<tm__bf16, int32_t><<<g, threads, 0, st->stream>>>(
                tm__data(dl), tm__data(logits), lse, t, tm__data(c->gout[0]), dloss_f32, n_valid, V, ign, fresh);
        else
            ce_backward_kernel<float, int32_t><<<g, threads, 0, st->stream>>>(
                tm__data(dl), tm__data(logits), lse, t, tm__data(c->gout[0]), dloss_f32, n_valid, V, ign, fresh);
    } else {
        const int64_t *t = (const int64_t *)tm__data(tg);
        if (logits->dtype == TM_BF16)
            ce_backward_kernel<tm__bf16, int64_t><<<g, threads, 0, st->stream>>>(
                tm__data(dl), tm__data(logits), lse, t, tm__data(c->gout[0]), dloss_f32, n_valid, V, ign, fresh);
        else
            ce_backward_kernel<float, int64_t><<<g, threads, 0, st->stream>>>(
                tm__data(dl), tm__data(logits), lse, t, tm__data(c->gout[0]), dloss_f32, n_valid, V, ign, fresh);
    }
    TM__CU_LAUNCHED(ctx, what, "ce_backward_kernel");
    return TM_OK;
}
