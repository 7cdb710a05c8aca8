/*
 * reduce.c — CPU kernels of tm_sum, tm_mean (one axis) and tm_sum_all, tm_mean_all.
 * Sums accumulate in f64 whatever the dtype.
 *
 * Axis reductions view x as (outer, n, inner), n = x.shape[axis]:
 *   in[0]  x    (outer, n, inner)
 *   out[0] y    (outer, inner)      y[o, i] = s * sum_k x[o, k, i]
 * with s = 1 (sum) or 1/n (mean; an empty axis gives 0 * inf = NaN, the mean of nothing).
 * inner == 1 (the last axis): one contiguous row per output, rows split over threads.
 * inner > 1: tasks of (o, block of COL_BLOCK columns), each walking k with an f64 accumulator
 * row, so x is read in unit stride.
 * *_all: fixed chunks of ALL_CHUNK elements, each summed into its own f64 partial, then the
 * partials are added in chunk order.
 * Every output is thus summed in one fixed order: results are bit-identical for any thread
 * count.
 *
 * Backward: dx[o, k, i] += s * dy[o, i] (the *_all ops: dx[j] += s * dy).
 */
#include "internal.h"

enum { PAR_MIN = 1 << 15, COL_BLOCK = 256, ALL_CHUNK = 1 << 14 };

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#define REDUCE_KERNELS(T, SFX)                                                                   \
    static void axis_forward_##SFX(T *y, const T *x, int64_t outer, int64_t n, int64_t inner,   \
                                   double s, int nth) {                                         \
        int64_t total = outer * n * inner;                                                      \
        if (inner == 1) {                                                                       \
            _Pragma("omp parallel for num_threads(nth) if (total >= PAR_MIN) schedule(static)") \
            for (int64_t o = 0; o < outer; o++) {                                               \
                const T *xr = x + o * n;                                                        \
                double acc = 0.0;                                                               \
                for (int64_t k = 0; k < n; k++) acc += xr[k];                                   \
                y[o] = (T)(s * acc);                                                            \
            }                                                                                   \
            return;                                                                             \
        }                                                                                       \
        int64_t nblk = (inner + COL_BLOCK - 1) / COL_BLOCK;                                     \
        _Pragma("omp parallel for num_threads(nth) if (total >= PAR_MIN) schedule(static)")     \
        for (int64_t t = 0; t < outer * nblk; t++) {                                            \
            int64_t o = t / nblk, i0 = t % nblk * COL_BLOCK, w = min64(COL_BLOCK, inner - i0);  \
            double acc[COL_BLOCK];                                                              \
            for (int64_t i = 0; i < w; i++) acc[i] = 0.0;                                       \
            for (int64_t k = 0; k < n; k++) {                                                   \
                const T *xr = x + (o * n + k) * inner + i0;                                     \
                for (int64_t i = 0; i < w; i++) acc[i] += xr[i];                                \
            }                                                                                   \
            T *yr = y + o * inner + i0;                                                         \
            for (int64_t i = 0; i < w; i++) yr[i] = (T)(s * acc[i]);                            \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    static void axis_backward_##SFX(T *dx, const T *dy, int64_t outer, int64_t n, int64_t inner, \
                                    double s, int nth) {                                        \
        int64_t total = outer * n * inner;                                                      \
        _Pragma("omp parallel for num_threads(nth) if (total >= PAR_MIN) schedule(static)")     \
        for (int64_t r = 0; r < outer * n; r++) {                                               \
            const T *g = dy + r / n * inner;                                                    \
            T *d = dx + r * inner;                                                              \
            for (int64_t i = 0; i < inner; i++) d[i] = (T)(d[i] + s * g[i]);                    \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    /* part: one f64 per ALL_CHUNK chunk. */                                                    \
    static double all_forward_##SFX(const T *x, int64_t n, double *part, int nth) {             \
        int64_t nchunks = (n + ALL_CHUNK - 1) / ALL_CHUNK;                                      \
        _Pragma("omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)")         \
        for (int64_t k = 0; k < nchunks; k++) {                                                 \
            int64_t i1 = min64(n, (k + 1) * ALL_CHUNK);                                         \
            double acc = 0.0;                                                                   \
            for (int64_t i = k * ALL_CHUNK; i < i1; i++) acc += x[i];                           \
            part[k] = acc;                                                                      \
        }                                                                                       \
        double acc = 0.0;                                                                       \
        for (int64_t k = 0; k < nchunks; k++) acc += part[k];                                   \
        return acc;                                                                             \
    }                                                                                           \
                                                                                                \
    static void all_backward_##SFX(T *dx, double g, int64_t n, int nth) {                       \
        _Pragma("omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)")         \
        for (int64_t i = 0; i < n; i++) dx[i] = (T)(dx[i] + g);                                 \
    }

REDUCE_KERNELS(float, f32)
REDUCE_KERNELS(double, f64)

static tm_status check_cpu_dtype(tm__call *c) {
    if (c->in[0]->dtype != TM_F32 && c->in[0]->dtype != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "%s: CPU kernel got %s", tm__opname(c),
                       tm__tdesc(c->ctx, c->in[0]));
    return TM_OK;
}

/* (outer, n, inner) of x around the reduced axis iattr[0]. */
static void axis_dims(const tm__call *c, int64_t *outer, int64_t *n, int64_t *inner) {
    const tm_tensor *x = c->in[0];
    int axis = (int)c->iattr[0];
    *outer = tm__numel_of(axis, x->shape);
    *n = x->shape[axis];
    *inner = tm__numel_of(x->ndim - axis - 1, x->shape + axis + 1);
}

static tm_status axis_forward(tm__call *c, int mean) {
    TM__TRY(check_cpu_dtype(c));
    int64_t outer, n, inner;
    axis_dims(c, &outer, &n, &inner);
    double s = mean ? 1.0 / (double)n : 1.0;
    int nth = tm__nthreads(c->ctx);
    if (c->in[0]->dtype == TM_F32)
        axis_forward_f32(tm__data(c->out[0]), tm__data(c->in[0]), outer, n, inner, s, nth);
    else
        axis_forward_f64(tm__data(c->out[0]), tm__data(c->in[0]), outer, n, inner, s, nth);
    return TM_OK;
}

static tm_status axis_backward(tm__call *c, int mean) {
    TM__TRY(check_cpu_dtype(c));
    if (!c->gin[0]) return TM_OK;
    int64_t outer, n, inner;
    axis_dims(c, &outer, &n, &inner);
    double s = mean ? 1.0 / (double)n : 1.0;
    int nth = tm__nthreads(c->ctx);
    if (c->in[0]->dtype == TM_F32)
        axis_backward_f32(tm__data(c->gin[0]), tm__data(c->gout[0]), outer, n, inner, s, nth);
    else
        axis_backward_f64(tm__data(c->gin[0]), tm__data(c->gout[0]), outer, n, inner, s, nth);
    return TM_OK;
}

static tm_status all_forward(tm__call *c, int mean) {
    TM__TRY(check_cpu_dtype(c));
    const tm_tensor *x = c->in[0];
    int64_t n = tm__numel(x), nchunks = (n + ALL_CHUNK - 1) / ALL_CHUNK;
    double one, *part = &one;
    if (nchunks > 1) {
        part = tm__arena_alloc(c->ctx, tm_cpu(), (size_t)nchunks * sizeof(double));
        if (!part) return TM_ERR_NOMEM;
    }
    int nth = tm__nthreads(c->ctx);
    double sum = x->dtype == TM_F32 ? all_forward_f32(tm__data(x), n, part, nth)
                                    : all_forward_f64(tm__data(x), n, part, nth);
    double y = mean ? sum / (double)n : sum;
    if (x->dtype == TM_F32)
        *(float *)tm__data(c->out[0]) = (float)y;
    else
        *(double *)tm__data(c->out[0]) = y;
    return TM_OK;
}

static tm_status all_backward(tm__call *c, int mean) {
    TM__TRY(check_cpu_dtype(c));
    tm_tensor *gx = c->gin[0];
    if (!gx) return TM_OK;
    int64_t n = tm__numel(gx);
    const tm_tensor *gy = c->gout[0];
    double g = gy->dtype == TM_F32 ? *(const float *)tm__data(gy) : *(const double *)tm__data(gy);
    if (mean) g /= (double)n;
    int nth = tm__nthreads(c->ctx);
    if (gx->dtype == TM_F32)
        all_backward_f32(tm__data(gx), g, n, nth);
    else
        all_backward_f64(tm__data(gx), g, n, nth);
    return TM_OK;
}

tm_status tm__sum_forward_cpu(tm__call *c) { return axis_forward(c, 0); }
tm_status tm__sum_backward_cpu(tm__call *c) { return axis_backward(c, 0); }
tm_status tm__mean_forward_cpu(tm__call *c) { return axis_forward(c, 1); }
tm_status tm__mean_backward_cpu(tm__call *c) { return axis_backward(c, 1); }
tm_status tm__sum_all_forward_cpu(tm__call *c) { return all_forward(c, 0); }
tm_status tm__sum_all_backward_cpu(tm__call *c) { return all_backward(c, 0); }
tm_status tm__mean_all_forward_cpu(tm__call *c) { return all_forward(c, 1); }
tm_status tm__mean_all_backward_cpu(tm__call *c) { return all_backward(c, 1); }
