/*
 * activation.c — CPU kernels of tm_silu and the fused tm_swiglu.
 *
 *   silu:   in[0] x (n)                       out[0] y = x * sigmoid(x)       (n)
 *   swiglu: in[0] gate (n), in[1] up (n)     out[0] y = silu(gate) * up      (n)
 * Nothing is saved: backward recomputes sigmoid from the inputs, which is cheaper than a
 * saved tensor's memory traffic.
 *   silu'(x) = s * (1 + x * (1 - s)), s = sigmoid(x)
 *   swiglu:  d gate = dy * up * silu'(gate),  d up = dy * silu(gate)
 * Both backwards write a fresh input gradient (call->gin_fresh: TM__OP_GRAD_WRITES) as
 * 0 + x, the bits accumulating into zeros gives, without reading it.
 * sigmoid(x) = 1 / (1 + e^-x), branchless. It is safe at both ends: for x -> -inf, e^-x
 * overflows to +inf and s = 1 / inf = 0 (silu = x * 0 = -0, silu' = 0); before that the
 * quotient keeps full relative precision (no 1 - s cancellation is ever formed for small s).
 * For x -> +inf, e^-x = 0 and s = 1.
 * f32 is computed in f32 with tm__exp_f32 (kernels/cpu/vecmath.h, <= 1.01 ulp), so the loops
 * vectorise (and run in AVX2 + FMA where the CPU has it); the error stays at a few ulp.
 * f64 uses libm's exp (scalar: f64 is the gradient-check dtype, not a training one).
 */
#include <math.h>

#include "internal.h"
#include "vecmath.h"

enum { PAR_MIN = 1 << 14 };

static inline float sigmoid_f32(float x) { return 1.0f / (1.0f + tm__exp_f32(-x)); }
static inline double sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }

/* The backward of swiglu splits on which gradients are wanted, and on whether each is fresh
 * (written as 0 + x) or accumulated, outside the loop: a conditional store inside it would keep
 * it from vectorising. OP is the store: `+=` or `= (T)0 +`. */
#define SWIGLU_BWD_BOTH(T, SFX, OPG, OPU)                                                       \
    do {                                                                                        \
        _Pragma("omp parallel for simd num_threads(nth) if (n >= PAR_MIN) schedule(static)")    \
        for (int64_t i = 0; i < n; i++) {                                                       \
            T s = sigmoid_##SFX(g[i]), gs = g[i] * s;                                           \
            dg[i] OPG dy[i] * u[i] * (s + gs * (1 - s));                                        \
            du[i] OPU dy[i] * gs;                                                               \
        }                                                                                       \
    } while (0)
#define SWIGLU_BWD_GATE(T, SFX, OPG)                                                            \
    do {                                                                                        \
        _Pragma("omp parallel for simd num_threads(nth) if (n >= PAR_MIN) schedule(static)")    \
        for (int64_t i = 0; i < n; i++) {                                                       \
            T s = sigmoid_##SFX(g[i]);                                                          \
            dg[i] OPG dy[i] * u[i] * (s + g[i] * s * (1 - s));                                  \
        }                                                                                       \
    } while (0)
#define SWIGLU_BWD_UP(T, SFX, OPU)                                                              \
    do {                                                                                        \
        _Pragma("omp parallel for simd num_threads(nth) if (n >= PAR_MIN) schedule(static)")    \
        for (int64_t i = 0; i < n; i++) du[i] OPU dy[i] * g[i] * sigmoid_##SFX(g[i]);           \
    } while (0)

#define SILU_BWD(T, SFX, OPX)                                                                   \
    do {                                                                                        \
        _Pragma("omp parallel for simd num_threads(nth) if (n >= PAR_MIN) schedule(static)")    \
        for (int64_t i = 0; i < n; i++) {                                                       \
            T s = sigmoid_##SFX(x[i]);                                                          \
            dx[i] OPX dy[i] * s * (1 + x[i] * (1 - s));                                         \
        }                                                                                       \
    } while (0)

#define ACT_KERNELS(T, SFX, ATTR)                                                                \
    ATTR static void silu_forward_##SFX(T *y, const T *x, int64_t n, int nth) {                 \
        _Pragma("omp parallel for simd num_threads(nth) if (n >= PAR_MIN) schedule(static)")    \
        for (int64_t i = 0; i < n; i++) y[i] = x[i] * sigmoid_##SFX(x[i]);                      \
    }                                                                                           \
    /* fx: dx is fresh (call->gin_fresh), stored as 0 + x */                                  \
    ATTR static void silu_backward_##SFX(T *dx, const T *dy, const T *x, int64_t n, int nth,   \
                                         int fx) {                                              \
        if (fx) SILU_BWD(T, SFX, = (T)0 +);                                                     \
        else SILU_BWD(T, SFX, +=);                                                              \
    }                                                                                           \
    ATTR static void swiglu_forward_##SFX(T *y, const T *g, const T *u, int64_t n, int nth) {   \
        _Pragma("omp parallel for simd num_threads(nth) if (n >= PAR_MIN) schedule(static)")    \
        for (int64_t i = 0; i < n; i++) y[i] = g[i] * sigmoid_##SFX(g[i]) * u[i];               \
    }                                                                                           \
    /* dg or du may be NULL (that input needs no gradient), not both. fg / fu: dg / du is fresh \
     * (call->gin_fresh): stored as 0 + x instead of added to (no read of the buffer). */       \
    ATTR static void swiglu_backward_##SFX(T *dg, T *du, const T *dy, const T *g, const T *u,   \
                                           int64_t n, int nth, int fg, int fu) {                \
        if (dg && du) {                                                                         \
            if (fg && fu) SWIGLU_BWD_BOTH(T, SFX, = (T)0 +, = (T)0 +);                          \
            else if (fg) SWIGLU_BWD_BOTH(T, SFX, = (T)0 +, +=);                                 \
            else if (fu) SWIGLU_BWD_BOTH(T, SFX, +=, = (T)0 +);                                 \
            else SWIGLU_BWD_BOTH(T, SFX, +=, +=);                                               \
        } else if (dg) {                                                                        \
            if (fg) SWIGLU_BWD_GATE(T, SFX, = (T)0 +);                                          \
            else SWIGLU_BWD_GATE(T, SFX, +=);                                                   \
        } else {                                                                                \
            if (fu) SWIGLU_BWD_UP(T, SFX, = (T)0 +);                                            \
            else SWIGLU_BWD_UP(T, SFX, +=);                                                     \
        }                                                                                       \
    }

ACT_KERNELS(float, f32, TM__SIMD_CLONES)
ACT_KERNELS(double, f64, )
static tm_status check_cpu_dtype(tm__call *c) {
    if (c->in[0]->dtype != TM_F32 && c->in[0]->dtype != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "%s: CPU kernel got %s", tm__opname(c),
                       tm__tdesc(c->ctx, c->in[0]));
    return TM_OK;
}

tm_status tm__silu_forward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    const tm_tensor *x = c->in[0];
    int64_t n = tm__numel(x);
    int nth = tm__nthreads(c->ctx);
    if (x->dtype == TM_F32)
        silu_forward_f32(tm__data(c->out[0]), tm__data(x), n, nth);
    else
        silu_forward_f64(tm__data(c->out[0]), tm__data(x), n, nth);
    return TM_OK;
}

tm_status tm__silu_backward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    if (!c->gin[0]) return TM_OK;
    const tm_tensor *x = c->in[0];
    int64_t n = tm__numel(x);
    int nth = tm__nthreads(c->ctx);
    if (x->dtype == TM_F32)
        silu_backward_f32(tm__data(c->gin[0]), tm__data(c->gout[0]), tm__data(x), n, nth, c->gin_fresh[0]);
    else
        silu_backward_f64(tm__data(c->gin[0]), tm__data(c->gout[0]), tm__data(x), n, nth, c->gin_fresh[0]);
    return TM_OK;
}

tm_status tm__swiglu_forward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    const tm_tensor *g = c->in[0], *u = c->in[1];
    int64_t n = tm__numel(g);
    int nth = tm__nthreads(c->ctx);
    if (g->dtype == TM_F32)
        swiglu_forward_f32(tm__data(c->out[0]), tm__data(g), tm__data(u), n, nth);
    else
        swiglu_forward_f64(tm__data(c->out[0]), tm__data(g), tm__data(u), n, nth);
    return TM_OK;
}

tm_status tm__swiglu_backward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    if (!c->gin[0] && !c->gin[1]) return TM_OK;
    const tm_tensor *g = c->in[0], *u = c->in[1];
    int64_t n = tm__numel(g);
    int nth = tm__nthreads(c->ctx);
    void *dg = c->gin[0] ? tm__data(c->gin[0]) : NULL, *du = c->gin[1] ? tm__data(c->gin[1]) : NULL;
    int fg = dg && c->gin_fresh[0], fu = du && c->gin_fresh[1];
    if (g->dtype == TM_F32)
        swiglu_backward_f32(dg, du, tm__data(c->gout[0]), tm__data(g), tm__data(u), n, nth, fg, fu);
    else
        swiglu_backward_f64(dg, du, tm__data(c->gout[0]), tm__data(g), tm__data(u), n, nth, fg, fu);
    return TM_OK;
}
