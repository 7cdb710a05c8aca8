/*
 * rmsnorm.c — CPU kernels of tm_rmsnorm: y = x * rstd * w, rstd = 1 / sqrt(mean_c(x^2) + eps),
 * and of tm_add_rmsnorm (the residual add fused with it; its layout at the end of this file).
 *
 * Layout (x viewed as (N, C), N = numel(x) / C), shared with kernels/cuda: the backward of
 * either backend reads exactly what its forward saved.
 *   in[0]     x      (N, C)
 *   in[1]     weight (C)
 *   fattr[0]  eps
 *   out[0]    y      (N, C)
 *   saved[0]  rstd   (N)     f32 when x is f32 or bf16, f64 when x is f64
 * Backward reads x, weight and rstd (not y). It writes every input gradient whole
 * (TM__OP_GRAD_WRITES): a fresh one (call->gin_fresh) is stored as 0 + x without being read.
 *
 * Backward, per row with r = rstd[n] and g = w * dy:
 *   dx = r * g - x * (r^3 / C) * sum_c(g * x)
 *   dw = sum_n dy * x * r
 * dw is a reduction over rows. For a result that is bit-identical for any thread count the rows
 * are cut into chunks whose size depends on N only, never on the thread count: each chunk sums
 * its rows into its own f64 scratch row, then the scratch rows are added in chunk order. A chunk
 * holds ceil(N / MIN_CHUNKS) rows, clamped to [1, MAX_CHUNK]: small batches still spread over
 * the threads, and the scratch stays near max(MIN_CHUNKS, N / MAX_CHUNK) * C f64.
 *
 * Row sums (sum of squares, sum of w * dy * x) accumulate in f64 whatever the storage, as
 * `omp simd` reductions so that they vectorise (a plain f64 loop would stay scalar: without
 * -ffast-math the compiler may not reorder the sum); the f32 kernels are also compiled for
 * AVX2 (TM__SIMD_CLONES).
 */
#include <math.h>

#include "internal.h"
#include "vecmath.h"

enum { PAR_MIN = 1 << 15, MIN_CHUNKS = 64, MAX_CHUNK = 64, COL_BLOCK = 256 };

static int64_t chunk_rows(int64_t N) {
    int64_t rows = (N + MIN_CHUNKS - 1) / MIN_CHUNKS;
    return rows < 1 ? 1 : rows > MAX_CHUNK ? MAX_CHUNK : rows;
}

#define RMSNORM_KERNELS(T, SFX, ATTR)                                                            \
    ATTR static void rmsnorm_forward_##SFX(T *y, T *rstd, const T *x, const T *w, int64_t N,         \
                                      int64_t C, double eps, int nth) {                          \
        _Pragma("omp parallel for num_threads(nth) if (N * C >= PAR_MIN) schedule(static)")      \
        for (int64_t n = 0; n < N; n++) {                                                        \
            const T *xr = x + n * C;                                                             \
            T *yr = y + n * C;                                                                   \
            double ss = 0.0;                                                                     \
            _Pragma("omp simd reduction(+ : ss)")                                                \
            for (int64_t i = 0; i < C; i++) ss += (double)xr[i] * xr[i];                         \
            double r = 1.0 / sqrt(ss / (double)C + eps);                                         \
            rstd[n] = (T)r;                                                                      \
            _Pragma("omp simd") for (int64_t i = 0; i < C; i++) yr[i] = (T)(xr[i] * r * w[i]);   \
        }                                                                                        \
    }                                                                                            \
    /* part: (nchunks, C) f64 scratch for dw; NULL when dw is not wanted. N > 0. fx / fw: dx / \
     * dw is fresh (written as 0 + x, not read). */                                              \
    ATTR static void rmsnorm_backward_##SFX(T *dx, T *dw, double *part, const T *dy, const T *x,     \
                                       const T *w, const T *rstd, int64_t N, int64_t C,          \
                                       int fx, int fw, int nth) {                                \
        int64_t rows = chunk_rows(N), nchunks = (N + rows - 1) / rows;                           \
        _Pragma("omp parallel for num_threads(nth) if (N * C >= PAR_MIN) schedule(static)")      \
        for (int64_t k = 0; k < nchunks; k++) {                                                  \
            double *pw = part ? part + k * C : NULL;                                             \
            if (pw) memset(pw, 0, (size_t)C * sizeof *pw);                                       \
            int64_t n1 = (k + 1) * rows < N ? (k + 1) * rows : N;                                \
            for (int64_t n = k * rows; n < n1; n++) {                                            \
                const T *xr = x + n * C, *dyr = dy + n * C;                                      \
                double r = rstd[n];                                                              \
                if (dx) {                                                                        \
                    double dot = 0.0;                                                            \
                    _Pragma("omp simd reduction(+ : dot)")                                       \
                    for (int64_t i = 0; i < C; i++) dot += (double)w[i] * dyr[i] * xr[i];        \
                    double coef = r * r * r * dot / (double)C;                                   \
                    T *dxr = dx + n * C;                                                         \
                    if (fx)                                                                      \
                        _Pragma("omp simd") for (int64_t i = 0; i < C; i++)                      \
                            dxr[i] = (T)(0.0 + r * w[i] * dyr[i] - coef * xr[i]);                \
                    else                                                                         \
                        _Pragma("omp simd") for (int64_t i = 0; i < C; i++)                      \
                            dxr[i] = (T)(dxr[i] + r * w[i] * dyr[i] - coef * xr[i]);             \
                }                                                                                \
                if (pw)                                                                          \
                    _Pragma("omp simd") for (int64_t i = 0; i < C; i++)                          \
                        pw[i] += (double)dyr[i] * xr[i] * r;                                     \
            }                                                                                    \
        }                                                                                        \
        if (!part) return;                                                                       \
        _Pragma("omp parallel for num_threads(nth) if (nchunks * C >= PAR_MIN) schedule(static)") \
        for (int64_t c0 = 0; c0 < C; c0 += COL_BLOCK) {                                          \
            int64_t c1 = c0 + COL_BLOCK < C ? c0 + COL_BLOCK : C;                                \
            for (int64_t k = 1; k < nchunks; k++)                                                \
                for (int64_t i = c0; i < c1; i++) part[i] += part[k * C + i];                    \
            for (int64_t i = c0; i < c1; i++) dw[i] = (T)((fw ? 0.0 : (double)dw[i]) + part[i]); \
        }                                                                                        \
    }

RMSNORM_KERNELS(float, f32, TM__SIMD_CLONES)
RMSNORM_KERNELS(double, f64, )

tm_status tm__rmsnorm_forward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    if (x->dtype != TM_F32 && x->dtype != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "rmsnorm: CPU kernel got x %s", tm__tdesc(c->ctx, x));
    int64_t C = x->shape[x->ndim - 1], N = tm__numel(x) / C;
    tm_tensor *rstd;
    TM__TRY(tm__saved_new(c, x->dtype, 1, &N, &rstd));
    int nth = tm__nthreads(c->ctx);
    if (x->dtype == TM_F64)
        rmsnorm_forward_f64(tm__data(c->out[0]), tm__data(rstd), tm__data(x), tm__data(w), N, C,
                            c->fattr[0], nth);
    else
        rmsnorm_forward_f32(tm__data(c->out[0]), tm__data(rstd), tm__data(x), tm__data(w), N, C,
                            c->fattr[0], nth);
    return TM_OK;
}

tm_status tm__rmsnorm_backward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1], *dy = c->gout[0], *rstd = c->saved[0];
    tm_tensor *dx = c->gin[0], *dw = c->gin[1];
    int64_t C = x->shape[x->ndim - 1], N = tm__numel(x) / C;
    if (!dx && !dw) return TM_OK;
    if (N == 0) { /* no rows: dw = 0 (a fresh one gets the zeros) */
        TM__TRY(tm__gin_prepare(c, 1));
        return TM_OK;
    }
    double *part = NULL;
    if (dw) {
        int64_t rows = chunk_rows(N), nchunks = (N + rows - 1) / rows;
        part = tm__arena_alloc(c->ctx, tm_cpu(), (size_t)(nchunks * C) * sizeof(double));
        if (!part) return TM_ERR_NOMEM;
    }
    int nth = tm__nthreads(c->ctx);
    int fx = dx && c->gin_fresh[0], fw = dw && c->gin_fresh[1];
    if (x->dtype == TM_F64)
        rmsnorm_backward_f64(dx ? tm__data(dx) : NULL, dw ? tm__data(dw) : NULL, part, tm__data(dy),
                             tm__data(x), tm__data(w), tm__data(rstd), N, C, fx, fw, nth);
    else
        rmsnorm_backward_f32(dx ? tm__data(dx) : NULL, dw ? tm__data(dw) : NULL, part, tm__data(dy),
                             tm__data(x), tm__data(w), tm__data(rstd), N, C, fx, fw, nth);
    return TM_OK;
}

/* ---- add_rmsnorm: the residual add fused with the norm after it ----------------------------- */
/*
 * Layout (x, y viewed as (N, C)):
 *   in[0] x (N, C), in[1] y (N, C), in[2] weight (C), fattr[0] eps
 *   out[0] s = x + y (N, C), out[1] h = rmsnorm(s, weight) (N, C)
 *   saved[0] rstd (N) as rmsnorm's; saved[1] s (out[0] as this kernel sees it)
 * Backward, with ds and dh the upstream gradients of s and h:
 *   t = ds + rmsnorm's dx(s, weight, dh);  dx += t;  dy += t;  dw as rmsnorm's
 * Bit for bit tm_add then tm_rmsnorm (the golden losses depend on it): the sum is the add
 * kernel's float add, the norm is rmsnorm_forward/backward itself, and t is what the unfused
 * graph holds in s's gradient once rmsnorm's backward has added into it (s's other consumers
 * are newer than the norm, so their gradient is in ds already). For bf16 (the caller's tensors,
 * c->src: the dispatcher hands this kernel f32 copies) s and t are rounded to bf16 where the
 * unfused ops store them: the sum before the norm reads it, t before the add's backward reads it.
 */
static void round_bf16(float *v, int64_t n, int nth) {
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
    for (int64_t i = 0; i < n; i++) v[i] = tm__bf16_to_f32(tm__f32_to_bf16(v[i]));
}

#define ADD_RMSNORM_KERNELS(T, SFX)                                                                \
    /* out = a + b, or out += a (b NULL), or out = 0 + a (b NULL, fresh: out not read) */           \
    static void add_##SFX(T *out, const T *a, const T *b, int64_t n, int fresh, int nth) {         \
        _Pragma("omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)")            \
        for (int64_t i = 0; i < n; i++) out[i] = b ? a[i] + b[i] : (fresh ? (T)0 : out[i]) + a[i]; \
    }
ADD_RMSNORM_KERNELS(float, f32)
ADD_RMSNORM_KERNELS(double, f64)

tm_status tm__add_rmsnorm_forward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0], *y = c->in[1], *w = c->in[2];
    tm_tensor *s = c->out[0], *h = c->out[1];
    if (x->dtype != TM_F32 && x->dtype != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "add_rmsnorm: CPU kernel got x %s", tm__tdesc(c->ctx, x));
    int64_t C = x->shape[x->ndim - 1], N = tm__numel(x) / C, n = N * C;
    tm_tensor *rstd;
    TM__TRY(tm__saved_new(c, x->dtype, 1, &N, &rstd));
    c->saved[c->n_saved++] = s;
    int nth = tm__nthreads(c->ctx);
    if (x->dtype == TM_F64) {
        add_f64(tm__data(s), tm__data(x), tm__data(y), n, 0, nth);
        rmsnorm_forward_f64(tm__data(h), tm__data(rstd), tm__data(s), tm__data(w), N, C, c->fattr[0], nth);
    } else {
        add_f32(tm__data(s), tm__data(x), tm__data(y), n, 0, nth);
        if (c->src[0]->dtype == TM_BF16) round_bf16(tm__data(s), n, nth);
        rmsnorm_forward_f32(tm__data(h), tm__data(rstd), tm__data(s), tm__data(w), N, C, c->fattr[0], nth);
    }
    return TM_OK;
}

tm_status tm__add_rmsnorm_backward_cpu(tm__call *c) {
    const tm_tensor *w = c->in[2], *ds = c->gout[0], *dh = c->gout[1], *rstd = c->saved[0], *s = c->saved[1];
    tm_tensor *dx = c->gin[0], *dy = c->gin[1], *dw = c->gin[2];
    int64_t C = s->shape[s->ndim - 1], N = tm__numel(s) / C, n = N * C;
    if (N == 0) { /* no rows: dw = 0 (a fresh one gets the zeros) */
        TM__TRY(tm__gin_prepare(c, 2));
        return TM_OK;
    }
    if (!dx && !dy && !dw) return TM_OK;
    size_t es = tm_dtype_size(s->dtype);
    void *t = NULL;
    if (dx || dy) {
        t = tm__arena_alloc(c->ctx, tm_cpu(), (size_t)n * es);
        if (!t) return TM_ERR_NOMEM;
        memcpy(t, tm__data(ds), (size_t)n * es);
    }
    double *part = NULL;
    if (dw) {
        int64_t rows = chunk_rows(N), nchunks = (N + rows - 1) / rows;
        part = tm__arena_alloc(c->ctx, tm_cpu(), (size_t)(nchunks * C) * sizeof(double));
        if (!part) return TM_ERR_NOMEM;
    }
    int nth = tm__nthreads(c->ctx);
    const int fx = dx && c->gin_fresh[0], fy = dy && c->gin_fresh[1], fw = dw && c->gin_fresh[2];
    if (s->dtype == TM_F64)
        rmsnorm_backward_f64(t, dw ? tm__data(dw) : NULL, part, tm__data(dh), tm__data(s), tm__data(w),
                             tm__data(rstd), N, C, 0, fw, nth);
    else
        rmsnorm_backward_f32(t, dw ? tm__data(dw) : NULL, part, tm__data(dh), tm__data(s), tm__data(w),
                             tm__data(rstd), N, C, 0, fw, nth);
    if (!t) return TM_OK;
    if (s->dtype == TM_F32 && c->src[0]->dtype == TM_BF16) round_bf16(t, n, nth);
    /* (dx and dy may be one tensor, x + x: two additions, as the add's backward makes) */
    if (s->dtype == TM_F64) {
        if (dx) add_f64(tm__data(dx), t, NULL, n, fx, nth);
        if (dy) add_f64(tm__data(dy), t, NULL, n, fy, nth);
    } else {
        if (dx) add_f32(tm__data(dx), t, NULL, n, fx, nth);
        if (dy) add_f32(tm__data(dy), t, NULL, n, fy, nth);
    }
    return TM_OK;
}
