/*
 * cross_entropy.c — CPU kernels of tm_cross_entropy, fused: the probabilities are never
 * materialised in the forward pass, and the backward recomputes them from the saved row
 * logsumexp.
 *
 * Layout, shared with kernels/cuda (either backend's backward reads exactly what its forward
 * saved):
 *   in[0]     logits   (N, V)
 *   in[1]     targets  (N)     i32 or i64
 *   iattr[0]  ignore_index
 *   iattr[1]  1: the targets are known to be valid (tm__cross_entropy_unchecked): the CUDA
 *             forward skips reading its error flag back
 *   iattr[2]  1: the loss is f32 for bf16 logits (tm__cross_entropy_unchecked; the dispatcher
 *             stages bf16 to f32 on the CPU, so this kernel sees f32 logits and an f32 loss)
 *   out[0]    loss     ()      mean over valid rows of lse[n] - logits[n, targets[n]]; 0 if none;
 *                              the logits' dtype, or f32 (iattr[2])
 *   saved[0]  lse      (N)     logsumexp of each row; f32 for f32/bf16 logits, f64 for f64;
 *                              unspecified for ignored rows (the CPU writes 0)
 *   saved[1]  n_valid  ()      i64: number of rows whose target is not ignore_index
 * Backward, for valid rows only (ignored rows get no gradient):
 *   dlogits[n, v] = (exp(logits[n, v] - lse[n]) - [v == targets[n]]) * dloss / n_valid
 * A fresh dlogits (call->gin_fresh, TM__OP_GRAD_WRITES) is written whole without being read:
 * 0 + that for valid rows, zeros for ignored ones.
 *
 * Targets are checked before anything is written: the first one outside [0, V) that is not
 * ignore_index fails the op with TM_ERR_INDEX (the message describes the caller's tensors,
 * c->src, not the f32 staging copies of bf16 ones). The CUDA forward finds a bad target on the
 * device and reads a flag back, one synchronisation; the CPU forward counts one at the same
 * point (tm_ctx_sync_count), except where iattr[1] says the targets were checked already. The loss is summed in f64 in row order, so it
 * does not depend on the thread count.
 */
#include <math.h>

#include "internal.h"

enum { PAR_MIN = 1 << 15 };

#define CE_KERNELS(T, SFX, EXP)                                                                  \
    /* loss_rows: (N) f64 scratch, 0 for ignored rows. */                                       \
    static void ce_forward_##SFX(double *loss_rows, T *lse, const T *logits,                    \
                                 const tm_tensor *tg, int64_t ign, int64_t N, int64_t V,         \
                                 int nth) {                                                      \
        _Pragma("omp parallel for num_threads(nth) if (N * V >= PAR_MIN) schedule(static)")      \
        for (int64_t n = 0; n < N; n++) {                                                        \
            int64_t t = tm__idx(tg, n);                                                          \
            if (t == ign) {                                                                      \
                lse[n] = 0;                                                                      \
                loss_rows[n] = 0.0;                                                              \
                continue;                                                                        \
            }                                                                                    \
            const T *xr = logits + n * V;                                                        \
            T mx = -INFINITY;                                                                    \
            for (int64_t v = 0; v < V; v++) mx = xr[v] > mx ? xr[v] : mx;                        \
            double sum = 0.0;                                                                    \
            for (int64_t v = 0; v < V; v++) sum += EXP(xr[v] - mx);                              \
            double l = mx + log(sum);                                                            \
            lse[n] = (T)l;                                                                       \
            loss_rows[n] = l - xr[t];                                                            \
        }                                                                                        \
    }                                                                                            \
    static void ce_backward_##SFX(T *dlogits, const T *logits, const T *lse,                    \
                                  const tm_tensor *tg, int64_t ign, double scale, int64_t N,     \
                                  int64_t V, int fresh, int nth) {                               \
        _Pragma("omp parallel for num_threads(nth) if (N * V >= PAR_MIN) schedule(static)")      \
        for (int64_t n = 0; n < N; n++) {                                                        \
            int64_t t = tm__idx(tg, n);                                                          \
            T *dr = dlogits + n * V;                                                             \
            if (t == ign) {                                                                      \
                if (fresh) memset(dr, 0, (size_t)V * sizeof *dr);                                \
                continue;                                                                        \
            }                                                                                    \
            const T *xr = logits + n * V;                                                        \
            T l = lse[n];                                                                        \
            if (fresh)                                                                           \
                for (int64_t v = 0; v < V; v++) dr[v] = (T)(0.0 + EXP(xr[v] - l) * scale);      \
            else                                                                                 \
                for (int64_t v = 0; v < V; v++) dr[v] = (T)(dr[v] + EXP(xr[v] - l) * scale);    \
            dr[t] = (T)(dr[t] - scale);                                                          \
        }                                                                                        \
    }

CE_KERNELS(float, f32, expf)
CE_KERNELS(double, f64, exp)

tm_status tm__cross_entropy_forward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *logits = c->in[0], *tg = c->in[1];
    int64_t N = logits->shape[0], V = logits->shape[1], ign = c->iattr[0];
    if (logits->dtype != TM_F32 && logits->dtype != TM_F64)
        return tm__err(ctx, TM_ERR_INTERNAL, "cross_entropy: CPU kernel got logits %s", tm__tdesc(ctx, logits));
    if (N > 0 && !c->iattr[1]) tm__count_sync(ctx); /* the CUDA forward's error-flag read */

    int64_t n_valid = 0;
    for (int64_t n = 0; n < N; n++) {
        int64_t t = tm__idx(tg, n);
        if (t == ign) continue;
        if (t < 0 || t >= V)
            return tm__err(ctx, TM_ERR_INDEX,
                           "cross_entropy: targets[%lld] = %lld is outside [0, %lld) and is not ignore_index (%lld); logits %s, targets %s",
                           (long long)n, (long long)t, (long long)V, (long long)ign, tm__tdesc(ctx, c->src[0]),
                           tm__tdesc(ctx, c->src[1]));
        n_valid++;
    }

    tm_tensor *lse, *count;
    TM__TRY(tm__saved_new(c, logits->dtype, 1, &N, &lse));
    TM__TRY(tm__saved_new(c, TM_I64, 0, &N, &count));
    *(int64_t *)tm__data(count) = n_valid;

    double *loss_rows = tm__arena_alloc(ctx, tm_cpu(), (size_t)(N > 0 ? N : 1) * sizeof(double));
    if (!loss_rows) return TM_ERR_NOMEM;
    int nth = tm__nthreads(ctx);
    if (logits->dtype == TM_F64)
        ce_forward_f64(loss_rows, tm__data(lse), tm__data(logits), tg, ign, N, V, nth);
    else
        ce_forward_f32(loss_rows, tm__data(lse), tm__data(logits), tg, ign, N, V, nth);

    double total = 0.0;
    for (int64_t n = 0; n < N; n++) total += loss_rows[n];
    double loss = n_valid ? total / (double)n_valid : 0.0;
    if (logits->dtype == TM_F64)
        *(double *)tm__data(c->out[0]) = loss;
    else
        *(float *)tm__data(c->out[0]) = (float)loss;
    return TM_OK;
}

tm_status tm__cross_entropy_backward_cpu(tm__call *c) {
    const tm_tensor *logits = c->in[0], *tg = c->in[1], *dy = c->gout[0];
    const tm_tensor *lse = c->saved[0], *count = c->saved[1];
    tm_tensor *dlogits = c->gin[0];
    int64_t N = logits->shape[0], V = logits->shape[1], ign = c->iattr[0];
    int64_t n_valid = *(const int64_t *)tm__data(count);
    if (!dlogits) return TM_OK;
    if (n_valid == 0) return tm__gin_prepare(c, 0); /* every row ignored: zeros */
    int nth = tm__nthreads(c->ctx);
    int fresh = c->gin_fresh[0];
    if (logits->dtype == TM_F64) {
        double scale = *(const double *)tm__data(dy) / (double)n_valid;
        ce_backward_f64(tm__data(dlogits), tm__data(logits), tm__data(lse), tg, ign, scale, N, V, fresh, nth);
    } else {
        double scale = *(const float *)tm__data(dy) / (double)n_valid;
        ce_backward_f32(tm__data(dlogits), tm__data(logits), tm__data(lse), tg, ign, scale, N, V, fresh, nth);
    }
    return TM_OK;
}
