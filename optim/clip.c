/*
 * clip.c — tm_ctx_clip_grad_norm: global L2 norm of all parameter gradients, and rescaling
 * when it exceeds max_norm (the rule of torch.nn.utils.clip_grad_norm_: scale by
 * max_norm / (norm + 1e-6), so a norm just above max_norm lands just below it).
 *
 * When every CPU parameter has one dtype, the gradients are one dense array — the context's
 * contiguous gradient buffer, whose padding between parameters is always zero (zeroed on
 * growth and by tm_ctx_zero_grad, never written by backward) — and each pass is a single
 * parallel loop over it. Mixed dtypes fall back to one loop per parameter.
 */
#include <math.h>

#include "ctx_internal.h"

enum { PAR_MIN = 1 << 14 };

/* Sum of squares in a fixed order whatever the thread count: at most MAX_CHUNKS chunks whose
 * boundaries depend on n only, each summed sequentially, then the partials in chunk order.
 * (An OpenMP reduction(+) groups by thread, so its last bits would change with the threads.) */
enum { MAX_CHUNKS = 256, MIN_CHUNK = 4096 };

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

static double sumsq(const void *g, tm_dtype dt, int64_t n, int nth) {
    int64_t chunk = (n + MAX_CHUNKS - 1) / MAX_CHUNKS;
    if (chunk < MIN_CHUNK) chunk = MIN_CHUNK;
    int nc = (int)((n + chunk - 1) / chunk);
    double part[MAX_CHUNKS];
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
    for (int c = 0; c < nc; c++) {
        int64_t lo = (int64_t)c * chunk, hi = lo + chunk < n ? lo + chunk : n;
        part[c] = sumsq_range(g, dt, lo, hi);
    }
    double acc = 0.0;
    for (int c = 0; c < nc; c++) acc += part[c];
    return acc;
}

static void scale(void *g, tm_dtype dt, int64_t n, double s, int nth) {
    if (dt == TM_F32) {
        float *x = g, sf = (float)s;
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
        for (int64_t i = 0; i < n; i++) x[i] *= sf;
    } else if (dt == TM_F64) {
        double *x = g;
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
        for (int64_t i = 0; i < n; i++) x[i] *= s;
    } else {
        uint16_t *x = g;
        float sf = (float)s;
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
        for (int64_t i = 0; i < n; i++) x[i] = tm__f32_to_bf16(tm__bf16_to_f32(x[i]) * sf);
    }
}

tm_status tm_ctx_clip_grad_norm(tm_ctx *ctx, double max_norm, double *norm_out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (isnan(max_norm)) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_ctx_clip_grad_norm: max_norm is NaN");
    int uniform = 1;
    tm_dtype dt = TM_F32;
    int first = 1;
    for (int k = 0; k < ctx->n_named; k++) {
        const tm_tensor *p = ctx->named[k];
        if (!p->is_param) continue;
        if (p->device.type != TM_DEVICE_CPU)
            return tm__err(ctx, TM_ERR_UNSUPPORTED,
                           "tm_ctx_clip_grad_norm: CUDA gradients are not supported yet (parameter "
                           "\"%s\" is %s)", p->name, tm__tdesc(ctx, p));
        if (first) dt = p->dtype;
        uniform &= p->dtype == dt;
        first = 0;
    }

    int nth = tm__nthreads(ctx);
    tm__pool *gp = &ctx->grads[TM__CPU];
    int64_t flat_n = uniform ? (int64_t)(gp->used / tm_dtype_size(dt)) : 0;
    double ss = 0.0;
    if (uniform) {
        if (flat_n) ss = sumsq(gp->st.data, dt, flat_n, nth);
    } else {
        for (int k = 0; k < ctx->n_named; k++) {
            const tm_tensor *p = ctx->named[k];
            if (p->is_param) ss += sumsq(tm__data(p->grad), p->dtype, tm__numel(p), nth);
        }
    }
    double norm = sqrt(ss);

    if (max_norm > 0.0 && norm > max_norm) {
        double s = max_norm / (norm + 1e-6);
        if (uniform) {
            scale(gp->st.data, dt, flat_n, s, nth);
        } else {
            for (int k = 0; k < ctx->n_named; k++) {
                tm_tensor *p = ctx->named[k];
                if (p->is_param) scale(tm__data(p->grad), p->dtype, tm__numel(p), s, nth);
            }
        }
    }
    if (norm_out) *norm_out = norm;
    return TM_OK;
}
