/*
 * elementwise.c — CPU kernels of tm_add, tm_sub, tm_mul, tm_scale and tm_scale_rows.
 *
 * Layout of the binary ops:
 *   in[0] a, in[1] b   one of them "full" (n = numel(out) elements), the other either full
 *                      too or its trailing-dims suffix of m elements, read with period m:
 *                      out[i] = a[i or i % m] (op) b[i or i % m]
 *   out[0]             n elements
 * Element loops run over fixed chunks of EW_CHUNK outputs, cut further at period boundaries so
 * that the innermost loop is a plain unit-stride loop over both operands (vectorisable).
 *
 * Backward: the full operand's gradient is elementwise; the broadcast operand's is a sum over
 * the n / m rows of period m. For a result that is bit-identical for any thread count, rows
 * are cut into chunks of a fixed size (not one per thread): each chunk sums into its own f64
 * scratch row, and the scratch rows are then added in chunk order.
 *
 * scale_rows:
 *   in[0] x (R, C), in[1] w (R)   both f32 or both f64 here (bf16 is staged through f32)
 *   out[0] (R, C)                 out[r, c] = x[r, c] * w[r]
 *   Backward: dx[r, c] += dy[r, c] * w[r]; dw[r] += sum_c x[r, c] dy[r, c] (an f64 sum over
 *   c ascending). Rows are independent: one row per iteration, so any thread count gives the
 *   same bits.
 *
 * Every backward here writes each input gradient whole (TM__OP_GRAD_WRITES): a fresh one
 * (call->gin_fresh) is stored as 0 + x, the bits accumulating into zeros gives, without being
 * read. A broadcast operand's sum is written once per element after its reduction.
 */
#include "internal.h"

enum { PAR_MIN = 1 << 15, EW_CHUNK = 1 << 13, RED_MIN_ELEMS = 1 << 14, COL_BLOCK = 256 };

enum { EW_ADD, EW_SUB, EW_MUL };

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Run BODY(po, pa, pb, len) over out[0, n) in unit-stride segments; pa/pb point at the
 * matching elements of a/b (na, nb: their element counts, one of them n). */
#define EW_SEGMENTS(T, out, a, na, b, nb, n, nth, BODY)                                          \
    do {                                                                                        \
        int64_t n_ = (n), na_ = (na), nb_ = (nb);                                               \
        int nth_ = (nth);                                                                       \
        int64_t m_ = na_ < nb_ ? na_ : nb_, nchunks_ = (n_ + EW_CHUNK - 1) / EW_CHUNK;           \
        _Pragma("omp parallel for num_threads(nth_) if (n_ >= PAR_MIN) schedule(static)")        \
        for (int64_t ch_ = 0; ch_ < nchunks_; ch_++) {                                           \
            int64_t i_ = ch_ * EW_CHUNK, i1_ = min64(n_, i_ + EW_CHUNK);                         \
            while (i_ < i1_) {                                                                  \
                int64_t j_ = m_ == n_ ? i_ : i_ % m_;                                           \
                int64_t len = min64(i1_ - i_, m_ - j_);                                         \
                T *po = (out) + i_;                                                             \
                const T *pa = (a) + (na_ == n_ ? i_ : j_);                                      \
                const T *pb = (b) + (nb_ == n_ ? i_ : j_);                                      \
                BODY;                                                                           \
                i_ += len;                                                                      \
            }                                                                                   \
        }                                                                                       \
    } while (0)

#define EW_KERNELS(T, SFX)                                                                       \
    static void binary_forward_##SFX(int kind, T *out, const T *a, int64_t na, const T *b,      \
                                     int64_t nb, int64_t n, int nth) {                          \
        if (n == 0) return;                                                                     \
        if (kind == EW_ADD)                                                                     \
            EW_SEGMENTS(T, out, a, na, b, nb, n, nth,                                           \
                        for (int64_t t = 0; t < len; t++) po[t] = pa[t] + pb[t]);               \
        else if (kind == EW_SUB)                                                                \
            EW_SEGMENTS(T, out, a, na, b, nb, n, nth,                                           \
                        for (int64_t t = 0; t < len; t++) po[t] = pa[t] - pb[t]);               \
        else                                                                                    \
            EW_SEGMENTS(T, out, a, na, b, nb, n, nth,                                           \
                        for (int64_t t = 0; t < len; t++) po[t] = pa[t] * pb[t]);               \
    }                                                                                           \
                                                                                                \
    /* gx (full, n elements) += sign * g * other (other NULL: 1; no = numel(other)); fresh:     \
     * gx = 0 + ..., not read. */                                                               \
    static void grad_full_##SFX(T *gx, const T *g, const T *other, int64_t no, int64_t n,       \
                                T sign, int fresh, int nth) {                                   \
        if (!other && fresh)                                                                    \
            EW_SEGMENTS(T, gx, g, n, g, n, n, nth,                                              \
                        (void)pa; for (int64_t t = 0; t < len; t++) po[t] = (T)0 + sign * pb[t]); \
        else if (!other)                                                                        \
            EW_SEGMENTS(T, gx, gx, n, g, n, n, nth,                                             \
                        for (int64_t t = 0; t < len; t++) po[t] = pa[t] + sign * pb[t]);        \
        else if (fresh)                                                                         \
            EW_SEGMENTS(T, gx, g, n, other, no, n, nth,                                         \
                        for (int64_t t = 0; t < len; t++) po[t] = (T)0 + sign * pa[t] * pb[t]); \
        else                                                                                    \
            EW_SEGMENTS(T, gx, g, n, other, no, n, nth,                                         \
                        for (int64_t t = 0; t < len; t++) po[t] += sign * pa[t] * pb[t]);       \
    }                                                                                           \
                                                                                                \
    /* gx (m elements) += sign * sum_r g[r, :] * other[r, :] over rows r < n / m (other NULL:  \
     * 1; other is full when given). part: (nchunks, m) f64 scratch. */                         \
    static void grad_reduce_##SFX(T *gx, const T *g, const T *other, int64_t m, int64_t n,      \
                                  T sign, int64_t rows_per_chunk, double *part, int fresh,      \
                                  int nth) {                                                    \
        int64_t rows = n / m, nchunks = (rows + rows_per_chunk - 1) / rows_per_chunk;           \
        _Pragma("omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)")         \
        for (int64_t k = 0; k < nchunks; k++) {                                                 \
            double *p = part + k * m;                                                           \
            for (int64_t j = 0; j < m; j++) p[j] = 0.0;                                         \
            int64_t r1 = min64(rows, (k + 1) * rows_per_chunk);                                 \
            for (int64_t r = k * rows_per_chunk; r < r1; r++) {                                 \
                const T *gr = g + r * m;                                                        \
                if (other) {                                                                    \
                    const T *orow = other + r * m;                                              \
                    for (int64_t j = 0; j < m; j++) p[j] += (double)gr[j] * orow[j];            \
                } else {                                                                        \
                    for (int64_t j = 0; j < m; j++) p[j] += gr[j];                              \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        _Pragma("omp parallel for num_threads(nth) if (nchunks * m >= PAR_MIN) schedule(static)") \
        for (int64_t j0 = 0; j0 < m; j0 += COL_BLOCK) {                                         \
            int64_t j1 = min64(m, j0 + COL_BLOCK);                                              \
            for (int64_t k = 1; k < nchunks; k++)                                               \
                for (int64_t j = j0; j < j1; j++) part[j] += part[k * m + j];                   \
            for (int64_t j = j0; j < j1; j++)                                                   \
                gx[j] = (T)((fresh ? 0.0 : (double)gx[j]) + sign * part[j]);                    \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    static void scale_##SFX(T *out, const T *x, double alpha, int64_t n, int accumulate,        \
                            int nth) {                                                          \
        _Pragma("omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)")         \
        for (int64_t i = 0; i < n; i++) out[i] = (T)((accumulate ? out[i] : 0) + alpha * x[i]); \
    }

EW_KERNELS(float, f32)
EW_KERNELS(double, f64)

static tm_status check_cpu_dtype(tm__call *c) {
    if (c->in[0]->dtype != TM_F32 && c->in[0]->dtype != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "%s: CPU kernel got %s", tm__opname(c),
                       tm__tdesc(c->ctx, c->in[0]));
    return TM_OK;
}

static tm_status binary_forward(tm__call *c, int kind) {
    TM__TRY(check_cpu_dtype(c));
    const tm_tensor *a = c->in[0], *b = c->in[1];
    tm_tensor *out = c->out[0];
    int64_t n = tm__numel(out), na = tm__numel(a), nb = tm__numel(b);
    int nth = tm__nthreads(c->ctx);
    if (a->dtype == TM_F32)
        binary_forward_f32(kind, tm__data(out), tm__data(a), na, tm__data(b), nb, n, nth);
    else
        binary_forward_f64(kind, tm__data(out), tm__data(a), na, tm__data(b), nb, n, nth);
    return TM_OK;
}

/* gin[i] += sign * gout * other, reduced to in[i]'s shape; other: in[1 - i] for mul, else NULL.
 * A fresh gin[i] (call->gin_fresh) is written as 0 + that, without being read. */
static tm_status binary_grad(tm__call *c, int i, double sign, const tm_tensor *other) {
    tm_tensor *gx = c->gin[i];
    if (!gx) return TM_OK;
    const int fresh = c->gin_fresh[i];
    const tm_tensor *g = c->gout[0];
    int64_t n = tm__numel(g), m = tm__numel(gx), no = other ? tm__numel(other) : 0;
    if (n == 0) return tm__gin_prepare(c, i); /* m > 0 with n == 0: a broadcast operand gets zeros */
    int nth = tm__nthreads(c->ctx);
    int f32 = g->dtype == TM_F32;
    const void *po = other ? tm__data(other) : NULL;
    if (m == n) {
        if (f32)
            grad_full_f32(tm__data(gx), tm__data(g), po, no, n, (float)sign, fresh, nth);
        else
            grad_full_f64(tm__data(gx), tm__data(g), po, no, n, sign, fresh, nth);
        return TM_OK;
    }
    /* Enough rows per chunk that a chunk is worth a task, whatever the thread count. */
    int64_t rows = n / m, rpc = (RED_MIN_ELEMS + m - 1) / m;
    int64_t nchunks = (rows + rpc - 1) / rpc;
    double *part = tm__arena_alloc(c->ctx, tm_cpu(), (size_t)(nchunks * m) * sizeof(double));
    if (!part) return TM_ERR_NOMEM;
    if (f32)
        grad_reduce_f32(tm__data(gx), tm__data(g), po, m, n, (float)sign, rpc, part, fresh, nth);
    else
        grad_reduce_f64(tm__data(gx), tm__data(g), po, m, n, sign, rpc, part, fresh, nth);
    return TM_OK;
}

tm_status tm__add_forward_cpu(tm__call *c) { return binary_forward(c, EW_ADD); }
tm_status tm__sub_forward_cpu(tm__call *c) { return binary_forward(c, EW_SUB); }
tm_status tm__mul_forward_cpu(tm__call *c) { return binary_forward(c, EW_MUL); }

tm_status tm__add_backward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    TM__TRY(binary_grad(c, 0, 1.0, NULL));
    return binary_grad(c, 1, 1.0, NULL);
}

tm_status tm__sub_backward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    TM__TRY(binary_grad(c, 0, 1.0, NULL));
    return binary_grad(c, 1, -1.0, NULL);
}

tm_status tm__mul_backward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    TM__TRY(binary_grad(c, 0, 1.0, c->in[1]));
    return binary_grad(c, 1, 1.0, c->in[0]);
}

tm_status tm__scale_forward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    const tm_tensor *x = c->in[0];
    int64_t n = tm__numel(x);
    int nth = tm__nthreads(c->ctx);
    if (x->dtype == TM_F32)
        scale_f32(tm__data(c->out[0]), tm__data(x), c->fattr[0], n, 0, nth);
    else
        scale_f64(tm__data(c->out[0]), tm__data(x), c->fattr[0], n, 0, nth);
    return TM_OK;
}

tm_status tm__scale_backward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    tm_tensor *gx = c->gin[0];
    if (!gx) return TM_OK;
    const tm_tensor *g = c->gout[0];
    int64_t n = tm__numel(g);
    int nth = tm__nthreads(c->ctx);
    /* a fresh gx is written as 0 + alpha g: scale_*'s accumulate = 0 adds to an int 0 */
    int acc = !c->gin_fresh[0];
    if (g->dtype == TM_F32)
        scale_f32(tm__data(gx), tm__data(g), c->fattr[0], n, acc, nth);
    else
        scale_f64(tm__data(gx), tm__data(g), c->fattr[0], n, acc, nth);
    return TM_OK;
}

/* ---- scale_rows ------------------------------------------------------------------------------- */

#define SCALE_ROWS_KERNELS(T, SFX)                                                               \
    static void scale_rows_forward_##SFX(T *out, const T *x, const T *w, int64_t R, int64_t C,  \
                                         int nth) {                                              \
        _Pragma("omp parallel for num_threads(nth) if (R * C >= PAR_MIN) schedule(static)")      \
        for (int64_t r = 0; r < R; r++) {                                                        \
            const T wr = w[r], *xr = x + r * C;                                                  \
            T *o = out + r * C;                                                                  \
            for (int64_t c = 0; c < C; c++) o[c] = xr[c] * wr;                                   \
        }                                                                                        \
    }                                                                                            \
    /* fx / fw: dx / dw is fresh (call->gin_fresh): written as 0 + x, not read */               \
    static void scale_rows_backward_##SFX(T *dx, T *dw, const T *dy, const T *x, const T *w,     \
                                          int64_t R, int64_t C, int fx, int fw, int nth) {       \
        _Pragma("omp parallel for num_threads(nth) if (R * C >= PAR_MIN) schedule(static)")      \
        for (int64_t r = 0; r < R; r++) {                                                        \
            const T *g = dy + r * C;                                                             \
            if (dx) {                                                                            \
                const T wr = w[r];                                                               \
                T *d = dx + r * C;                                                               \
                if (fx)                                                                          \
                    for (int64_t c = 0; c < C; c++) d[c] = (T)0 + g[c] * wr;                     \
                else                                                                             \
                    for (int64_t c = 0; c < C; c++) d[c] += g[c] * wr;                           \
            }                                                                                    \
            if (dw) {                                                                            \
                const T *xr = x + r * C;                                                         \
                double s = 0.0;                                                                  \
                for (int64_t c = 0; c < C; c++) s += (double)xr[c] * g[c];                       \
                dw[r] = (T)((fw ? 0.0 : (double)dw[r]) + s);                                     \
            }                                                                                    \
        }                                                                                        \
    }

SCALE_ROWS_KERNELS(float, f32)
SCALE_ROWS_KERNELS(double, f64)

static tm_status scale_rows_dtypes(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    if (c->in[1]->dtype != c->in[0]->dtype)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "scale_rows: CPU kernel got x %s and w %s",
                       tm__tdesc(c->ctx, c->in[0]), tm__tdesc(c->ctx, c->in[1]));
    return TM_OK;
}

tm_status tm__scale_rows_forward_cpu(tm__call *c) {
    TM__TRY(scale_rows_dtypes(c));
    const tm_tensor *x = c->in[0], *w = c->in[1];
    int64_t R = x->shape[0], C = x->shape[1];
    int nth = tm__nthreads(c->ctx);
    if (x->dtype == TM_F32)
        scale_rows_forward_f32(tm__data(c->out[0]), tm__data(x), tm__data(w), R, C, nth);
    else
        scale_rows_forward_f64(tm__data(c->out[0]), tm__data(x), tm__data(w), R, C, nth);
    return TM_OK;
}

tm_status tm__scale_rows_backward_cpu(tm__call *c) {
    TM__TRY(scale_rows_dtypes(c));
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *dx = c->gin[0], *dw = c->gin[1];
    if (!dx && !dw) return TM_OK;
    int64_t R = x->shape[0], C = x->shape[1];
    int nth = tm__nthreads(c->ctx);
    int fx = dx && c->gin_fresh[0], fw = dw && c->gin_fresh[1];
    if (x->dtype == TM_F32)
        scale_rows_backward_f32(dx ? tm__data(dx) : NULL, dw ? tm__data(dw) : NULL, tm__data(c->gout[0]),
                                tm__data(x), tm__data(w), R, C, fx, fw, nth);
    else
        scale_rows_backward_f64(dx ? tm__data(dx) : NULL, dw ? tm__data(dw) : NULL, tm__data(c->gout[0]),
                                tm__data(x), tm__data(w), R, C, fx, fw, nth);
    return TM_OK;
}
