/*
 * softmax.c — CPU kernels of tm_softmax and tm_log_softmax over the last axis.
 *
 * Layout (x viewed as (N, C), N = numel(x) / C), shared with kernels/cuda:
 *   in[0]   x  (N, C)
 *   out[0]  y  (N, C)   softmax(x) or log_softmax(x)
 *   saved   none: backward reads only y (out[0]) and dy, never x.
 * Backward:
 *   softmax      dx = y * (dy - sum_c(dy * y))
 *   log_softmax  dx = dy - exp(y) * sum_c(dy)
 * added into dx, or written as 0 + that into a fresh dx (call->gin_fresh, TM__OP_GRAD_WRITES).
 *
 * The row maximum is subtracted before exp so that no exp overflows; the row sums are
 * accumulated in f64. A row of all -inf has no defined softmax and yields NaN (as in PyTorch).
 */
#include <math.h>

#include "internal.h"

enum { PAR_MIN = 1 << 15 };

/* EXP is expf for f32 (cheap; its error is far below f32 resolution after the division), exp
 * for f64. */
#define SOFTMAX_KERNELS(T, SFX, EXP)                                                             \
    static void softmax_forward_##SFX(T *y, const T *x, int64_t N, int64_t C, int log_out,      \
                                      int nth) {                                                 \
        _Pragma("omp parallel for num_threads(nth) if (N * C >= PAR_MIN) schedule(static)")      \
        for (int64_t n = 0; n < N; n++) {                                                        \
            const T *xr = x + n * C;                                                             \
            T *yr = y + n * C;                                                                   \
            T mx = -INFINITY;                                                                    \
            for (int64_t i = 0; i < C; i++) mx = xr[i] > mx ? xr[i] : mx;                        \
            double sum = 0.0;                                                                    \
            if (log_out) {                                                                       \
                for (int64_t i = 0; i < C; i++) sum += EXP(xr[i] - mx);                          \
                double lse = mx + log(sum);                                                      \
                for (int64_t i = 0; i < C; i++) yr[i] = (T)(xr[i] - lse);                        \
            } else {                                                                             \
                for (int64_t i = 0; i < C; i++) {                                                \
                    T e = EXP(xr[i] - mx);                                                       \
                    yr[i] = e;                                                                   \
                    sum += e;                                                                    \
                }                                                                                \
                double inv = 1.0 / sum;                                                          \
                for (int64_t i = 0; i < C; i++) yr[i] = (T)(yr[i] * inv);                        \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    static void softmax_backward_##SFX(T *dx, const T *y, const T *dy, int64_t N, int64_t C,    \
                                       int log_out, int fresh, int nth) {                        \
        _Pragma("omp parallel for num_threads(nth) if (N * C >= PAR_MIN) schedule(static)")      \
        for (int64_t n = 0; n < N; n++) {                                                        \
            const T *yr = y + n * C, *dyr = dy + n * C;                                          \
            T *dxr = dx + n * C;                                                                 \
            double s = 0.0;                                                                      \
            if (log_out) {                                                                       \
                for (int64_t i = 0; i < C; i++) s += dyr[i];                                     \
                if (fresh) /* the accumulating expression with 0 for dxr[i], which is not read */ \
                    for (int64_t i = 0; i < C; i++) dxr[i] = (T)((T)0 + dyr[i] - EXP(yr[i]) * s); \
                else                                                                             \
                    for (int64_t i = 0; i < C; i++) dxr[i] = (T)(dxr[i] + dyr[i] - EXP(yr[i]) * s); \
            } else {                                                                             \
                for (int64_t i = 0; i < C; i++) s += (double)dyr[i] * yr[i];                     \
                if (fresh)                                                                       \
                    for (int64_t i = 0; i < C; i++) dxr[i] = (T)((T)0 + yr[i] * (dyr[i] - s));   \
                else                                                                             \
                    for (int64_t i = 0; i < C; i++) dxr[i] = (T)(dxr[i] + yr[i] * (dyr[i] - s)); \
            }                                                                                    \
        }                                                                                        \
    }

SOFTMAX_KERNELS(float, f32, expf)
SOFTMAX_KERNELS(double, f64, exp)

static tm_status softmax_forward(tm__call *c, int log_out) {
    const tm_tensor *x = c->in[0];
    int64_t C = x->shape[x->ndim - 1], N = C ? tm__numel(x) / C : 0;
    int nth = tm__nthreads(c->ctx);
    switch (x->dtype) {
    case TM_F32: softmax_forward_f32(tm__data(c->out[0]), tm__data(x), N, C, log_out, nth); return TM_OK;
    case TM_F64: softmax_forward_f64(tm__data(c->out[0]), tm__data(x), N, C, log_out, nth); return TM_OK;
    default:
        return tm__err(c->ctx, TM_ERR_INTERNAL, "%s: CPU kernel got x %s", tm__opname(c), tm__tdesc(c->ctx, x));
    }
}

static tm_status softmax_backward(tm__call *c, int log_out) {
    const tm_tensor *y = c->out[0], *dy = c->gout[0];
    tm_tensor *dx = c->gin[0];
    if (!dx) return TM_OK;
    int64_t C = y->shape[y->ndim - 1], N = C ? tm__numel(y) / C : 0;
    int nth = tm__nthreads(c->ctx);
    if (y->dtype == TM_F64)
        softmax_backward_f64(tm__data(dx), tm__data(y), tm__data(dy), N, C, log_out, c->gin_fresh[0], nth);
    else
        softmax_backward_f32(tm__data(dx), tm__data(y), tm__data(dy), N, C, log_out, c->gin_fresh[0], nth);
    return TM_OK;
}

tm_status tm__softmax_forward_cpu(tm__call *c) { return softmax_forward(c, 0); }
tm_status tm__softmax_backward_cpu(tm__call *c) { return softmax_backward(c, 0); }
tm_status tm__log_softmax_forward_cpu(tm__call *c) { return softmax_forward(c, 1); }
tm_status tm__log_softmax_backward_cpu(tm__call *c) { return softmax_backward(c, 1); }
