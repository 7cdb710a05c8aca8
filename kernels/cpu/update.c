/*
 * update.c — CPU kernels of the update ops (framework/ops/update.c has the attribute layout).
 *
 * Layout: every tensor is a contiguous 1-D range of n elements with the same element offsets
 * (a parameter, or a bucket range of parameters / gradients / f32 state / f32 master). The
 * loops are elementwise, so any thread split gives the same bits; only the sum of squares
 * reduces, in a fixed chunk order that depends on n alone. AdamW, the sum of squares and the
 * scaling work over the ranges of a segment table (framework/update_multi.h: raw pointers to
 * (n) ranges of one device's buckets; tm_adamw_update, tm_grad_sumsq and tm_grad_scale pass one):
 *   grad_sumsq_multi  -> partials (ranges) f64 = grad_sumsq of each range, factor () f64
 *   grad_scale_multi  in: factor () f64; every range *= factor unless factor == 1
 *
 * AdamW (Loshchilov & Hutter 2019, Alg. 2; bias correction of Kingma & Ba 2015):
 *   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
 *   p -= lr * ( (m / bc1) / (sqrt(v / bc2) + eps) + wd * p ),   bc_i = 1 - beta_i^t
 * SGD (torch.optim.SGD, dampening 0):  g' = g + wd p;  b = momentum b + g';
 *   p -= lr * (nesterov ? g' + momentum b : b)
 * Precision: f32 and bf16 parameters are updated in f32 arithmetic, f64 in f64; state is f32.
 * With an f32 master (bf16 parameters under mixed precision) the update reads and writes the
 * master and stores the parameter as the master rounded to nearest bf16, so updates smaller
 * than half a bf16 ulp accumulate instead of being lost. Without one, a bf16 parameter is
 * read, updated in f32 and rounded each step.
 */
#include <math.h>

#include "internal.h"
#include "update_multi.h"

enum { PAR_MIN = 1 << 14 };

#define ID(x) (x)
#define TO_F32(x) (x)

/* PT: parameter storage type; T: compute type; MT: the type the current value is read from
 * and written to (the parameter itself, or the f32 master). */
/* gs: the clip's factor (1: none), applied as scale_any would have stored it (the product
 * rounded to PT), so the update is the one that reads gradients scaled by grad_scale_multi. */
#define ADAMW_KERNEL(SFX, PT, T, SQRT, LOAD, STORE)                                                      \
    static void adamw_##SFX(PT *p, const PT *g, float *m, float *v, float *master, int64_t n, T lr, T b1, \
                            T omb1, T b2, T omb2, T eps, T wd, T bc1, T bc2, T gs, int nth) {            \
        _Pragma("omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)")                  \
        for (int64_t i = 0; i < n; i++) {                                                                \
            T gi = gs == (T)1 ? LOAD(g[i]) : LOAD(STORE(LOAD(g[i]) * gs)), pi = master ? (T)master[i] : LOAD(p[i]); \
            T mi = b1 * (T)m[i] + omb1 * gi;                                                             \
            T vi = b2 * (T)v[i] + omb2 * gi * gi;                                                        \
            m[i] = (float)mi;                                                                            \
            v[i] = (float)vi;                                                                            \
            pi -= lr * ((mi / bc1) / (SQRT(vi / bc2) + eps) + wd * pi);                                  \
            if (master) master[i] = (float)pi;                                                           \
            p[i] = STORE(pi);                                                                            \
        }                                                                                                \
    }
ADAMW_KERNEL(f32, float, float, sqrtf, ID, ID)
ADAMW_KERNEL(f64, double, double, sqrt, ID, ID)
ADAMW_KERNEL(bf16, uint16_t, float, sqrtf, tm__bf16_to_f32, tm__f32_to_bf16)

/* AdamW over n elements of dtype dt with the attributes f[TM__ADAMW_*] of adamw_update_multi
 * and the range's weight decay wd. */
static tm_status adamw_any(tm_ctx *ctx, const char *op, tm_dtype dt, void *p, const void *g, float *m, float *v,
                           float *master, int64_t n, const double *f, double wd, double gs) {
    int nth = tm__nthreads(ctx);
    switch (dt) {
    case TM_F32:
        adamw_f32(p, g, m, v, master, n, (float)f[TM__ADAMW_LR], (float)f[TM__ADAMW_BETA1], (float)f[TM__ADAMW_OMB1],
                  (float)f[TM__ADAMW_BETA2], (float)f[TM__ADAMW_OMB2], (float)f[TM__ADAMW_EPS], (float)wd,
                  (float)f[TM__ADAMW_BC1], (float)f[TM__ADAMW_BC2], (float)gs, nth);
        break;
    case TM_BF16:
        adamw_bf16(p, g, m, v, master, n, (float)f[TM__ADAMW_LR], (float)f[TM__ADAMW_BETA1], (float)f[TM__ADAMW_OMB1],
                   (float)f[TM__ADAMW_BETA2], (float)f[TM__ADAMW_OMB2], (float)f[TM__ADAMW_EPS], (float)wd,
                   (float)f[TM__ADAMW_BC1], (float)f[TM__ADAMW_BC2], (float)gs, nth);
        break;
    case TM_F64:
        adamw_f64(p, g, m, v, master, n, f[TM__ADAMW_LR], f[TM__ADAMW_BETA1], f[TM__ADAMW_OMB1], f[TM__ADAMW_BETA2],
                  f[TM__ADAMW_OMB2], f[TM__ADAMW_EPS], wd, f[TM__ADAMW_BC1], f[TM__ADAMW_BC2], gs, nth);
        break;
    default: return tm__err(ctx, TM_ERR_INTERNAL, "%s: dtype %s", op, tm_dtype_name(dt));
    }
    return TM_OK;
}

/* b NULL: plain SGD (momentum 0). The update uses the unrounded b, as AdamW uses the
 * unrounded moments. */
#define SGD_KERNEL(SFX, PT, T, LOAD, STORE)                                                                   \
    static void sgd_##SFX(PT *p, const PT *g, float *b, float *master, int64_t n, T lr, T mom, int nesterov, T wd, \
                          int nth) {                                                                          \
        _Pragma("omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)")                       \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            T pi = master ? (T)master[i] : LOAD(p[i]);                                                        \
            T gi = LOAD(g[i]) + wd * pi;                                                                      \
            T d = gi;                                                                                         \
            if (b) {                                                                                          \
                T bi = mom * (T)b[i] + gi;                                                                    \
                b[i] = (float)bi;                                                                             \
                d = nesterov ? gi + mom * bi : bi;                                                            \
            }                                                                                                 \
            pi = pi - lr * d;                                                                                 \
            if (master) master[i] = (float)pi;                                                                \
            p[i] = STORE(pi);                                                                                 \
        }                                                                                                     \
    }
SGD_KERNEL(f32, float, float, ID, ID)
SGD_KERNEL(f64, double, double, ID, ID)
SGD_KERNEL(bf16, uint16_t, float, tm__bf16_to_f32, tm__f32_to_bf16)

tm_status tm__sgd_update_forward_cpu(tm__call *c) {
    tm_tensor *p = c->in[0];
    int64_t n = tm__numel(p);
    int k = 2;
    float *b = c->iattr[0] ? tm__data(c->in[k++]) : NULL;
    float *master = c->iattr[1] ? tm__data(c->in[k++]) : NULL;
    const double *f = c->fattr;
    int nesterov = (int)c->iattr[2], nth = tm__nthreads(c->ctx);
    switch (p->dtype) {
    case TM_F32:
        sgd_f32(tm__data(p), tm__data(c->in[1]), b, master, n, (float)f[0], (float)f[1], nesterov, (float)f[2], nth);
        break;
    case TM_BF16:
        sgd_bf16(tm__data(p), tm__data(c->in[1]), b, master, n, (float)f[0], (float)f[1], nesterov, (float)f[2], nth);
        break;
    case TM_F64: sgd_f64(tm__data(p), tm__data(c->in[1]), b, master, n, f[0], f[1], nesterov, f[2], nth); break;
    default: return tm__err(c->ctx, TM_ERR_INTERNAL, "sgd_update: dtype %s", tm_dtype_name(p->dtype));
    }
    return TM_OK;
}

/* Sum of squares in f64 in a fixed order whatever the thread count: at most
 * TM__SUMSQ_MAX_CHUNKS chunks whose boundaries depend on n only (tm__sumsq_chunk), each summed
 * sequentially, then the partials in chunk order. (An OpenMP reduction(+) groups by thread, so
 * its last bits would change with the thread count.) */

static double sumsq_range(const void *g, tm_dtype dt, int64_t lo, int64_t hi) {
    double acc = 0.0;
    if (dt == TM_F32) {
        const float *x = g;
        for (int64_t i = lo; i < hi; i++) acc += (double)x[i] * x[i];
    } else if (dt == TM_F64) {
        const double *x = g;
        for (int64_t i = lo; i < hi; i++) acc += x[i] * x[i];
    } else {
        const uint16_t *x = g;
        for (int64_t i = lo; i < hi; i++) {
            double v = tm__bf16_to_f32(x[i]);
            acc += v * v;
        }
    }
    return acc;
}

static double sumsq_chunked(const void *x, tm_dtype dt, int64_t n, int nth) {
    if (n == 0) return 0.0;
    int64_t chunk = tm__sumsq_chunk(n);
    int nc = (int)((n + chunk - 1) / chunk);
    double part[TM__SUMSQ_MAX_CHUNKS];
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
    for (int k = 0; k < nc; k++) {
        int64_t lo = (int64_t)k * chunk, hi = lo + chunk < n ? lo + chunk : n;
        part[k] = sumsq_range(x, dt, lo, hi);
    }
    double acc = 0.0;
    for (int k = 0; k < nc; k++) acc += part[k];
    return acc;
}

/* x[0..n) *= s, in x's dtype (s rounded to f32 for f32 and bf16). */
static void scale_any(void *px, tm_dtype dt, int64_t n, double s, int nth) {
    if (dt == TM_F32) {
        float *x = px, sf = (float)s;
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
        for (int64_t i = 0; i < n; i++) x[i] *= sf;
    } else if (dt == TM_F64) {
        double *x = px;
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
        for (int64_t i = 0; i < n; i++) x[i] *= s;
    } else {
        uint16_t *x = px;
        float sf = (float)s;
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
        for (int64_t i = 0; i < n; i++) x[i] = tm__f32_to_bf16(tm__bf16_to_f32(x[i]) * sf);
    }
}

/* ---- fused updates over a segment table (framework/update_multi.h) ------------------------- */
/* Each range gets what it would get alone (a table of one range: tm_adamw_update,
 * tm_grad_sumsq, tm_grad_scale): AdamW per range with its weight decay; the partial of a range
 * is its sum of squares, the norm sqrt of the partials added in range order, as
 * tm_ctx_clip_grad_norm computes it on the host under a communicator, and the factor is
 * exactly 1 (no scaling at all) unless max_norm > 0 and norm > max_norm. */

tm_status tm__adamw_update_multi_forward_cpu(tm__call *c) {
    const tm__seg *sg = tm__data(c->in[0]);
    double gs = c->iattr[2] ? *(const double *)tm__data(c->in[1]) : 1.0; /* the clip's factor */
    for (int64_t k = 0; k < c->iattr[0]; k++)
        TM__TRY(adamw_any(c->ctx, "adamw_update_multi", (tm_dtype)sg[k].dtype, sg[k].p, sg[k].g, sg[k].m, sg[k].v,
                          sg[k].master, sg[k].n, c->fattr, sg[k].wd, gs));
    return TM_OK;
}

tm_status tm__grad_sumsq_multi_forward_cpu(tm__call *c) {
    const tm__seg *sg = tm__data(c->in[0]);
    double *part = tm__data(c->out[0]), ss = 0.0, max_norm = c->fattr[0];
    int nth = tm__nthreads(c->ctx);
    for (int64_t k = 0; k < c->iattr[0]; k++) {
        part[k] = sumsq_chunked(sg[k].p, (tm_dtype)sg[k].dtype, sg[k].n, nth);
        ss += part[k];
    }
    double norm = sqrt(ss);
    *(double *)tm__data(c->out[1]) = max_norm > 0.0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
    return TM_OK;
}

tm_status tm__grad_scale_multi_forward_cpu(tm__call *c) {
    const tm__seg *sg = tm__data(c->in[0]);
    double s = *(const double *)tm__data(c->in[1]);
    if (s == 1.0) return TM_OK; /* not clipping: the gradients stay as they are */
    int nth = tm__nthreads(c->ctx);
    for (int64_t k = 0; k < c->iattr[0]; k++) scale_any(sg[k].p, (tm_dtype)sg[k].dtype, sg[k].n, s, nth);
    return TM_OK;
}

/* Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2; Megatron get_updated_expert_bias):
 *   expert_bias[e] += rate * sign(mean(counts) - counts[e])   (sign(0) = 0)
 * Both 1-D, walked by stride (views work: the op is TM__OP_STRIDED). */
tm_status tm__moe_expert_bias_update_forward_cpu(tm__call *c) {
    tm_tensor *bias = c->in[0];
    const tm_tensor *counts = c->in[1];
    double rate = c->fattr[0];
    int64_t E = bias->shape[0], sb = bias->stride[0], sc = counts->stride[0];
    const int64_t *cnt = tm__data(counts);
    double mean = 0.0;
    for (int64_t e = 0; e < E; e++) mean += (double)cnt[e * sc];
    mean /= (double)E;
    for (int64_t e = 0; e < E; e++) {
        double d = mean - (double)cnt[e * sc];
        double sign = (d > 0) - (d < 0);
        if (bias->dtype == TM_F32) {
            float *b = tm__data(bias);
            b[e * sb] = (float)((double)b[e * sb] + rate * sign);
        } else {
            double *b = tm__data(bias);
            b[e * sb] += rate * sign;
        }
    }
    return TM_OK;
}
