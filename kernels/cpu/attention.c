/*
 * attention.c — CPU kernels of tm_attention: fused causal scaled-dot-product attention with
 * grouped-query heads, FlashAttention-style (Dao et al. 2022; backward after FlashAttention-2,
 * Dao 2023): the forward keeps only the per-row logsumexp, and the backward rebuilds each
 * probability as P_ij = exp(s_ij - lse_i) instead of storing the (Tq, Tk) matrix.
 *
 * Layout:
 *   in[0]    q    (B, Tq, Hq, D)
 *   in[1]    k    (B, Tk, Hkv, D)     query head h reads kv head h / G, G = Hq / Hkv
 *   in[2]    v    (B, Tk, Hkv, D)
 *   out[0]   o    (B, Tq, Hq, D)
 *   saved[0] lse  (B, Hq, Tq)         logsumexp of the scaled, masked scores of each query row
 * Query i sees keys j < n_i = i + (Tk - Tq) + 1 (the queries are the last Tq of Tk positions),
 * so every row sees at least key 0 and no row is empty.
 *
 * Backward for one query row, with dP_ij = dO_i . v_j and Delta_i = sum_j P_ij dP_ij
 * (= rowsum(dO_i * O_i); taken from the row itself, which needs no O and matches the P
 * being differentiated exactly, also when O was rounded to f32 or bf16):
 *   dS_ij = P_ij (dP_ij - Delta_i)
 *   dq_i += scale sum_j dS_ij k_j,   dk_j += scale dS_ij q_i,   dv_j += P_ij dO_i
 * The backward runs one task per (b, kv head): the task owns dk and dv of its kv head and dq of
 * the G query heads that read it, so the GQA reduction needs no atomics and its order (query
 * head, then row) is fixed, which makes the gradients bitwise reproducible for any thread count.
 *
 * All arithmetic is f64. f32 inputs are widened once into arena scratch, O(numel) work against
 * the O(Tq Tk D) core, so one kernel serves both dtypes and accumulates in f64. The D-long dot
 * products and axpys are `omp simd` loops so they vectorise without -ffast-math.
 */
#include <math.h>
#include <omp.h>

#include "internal.h"

enum { PAR_MIN = 1 << 15 };        /* below this many multiply-adds, stay serial */
enum { FWD_ROWS_PER_CHUNK = 16 };  /* consecutive rows share (b, h) and so their k / v */

typedef struct attn_dims {
    int64_t B, Tq, Tk, Hq, Hkv, D;
    int64_t G;   /* query heads per kv head */
    int64_t off; /* Tk - Tq */
    double scale;
} attn_dims;

static attn_dims attn_dims_of(const tm__call *c) {
    const tm_tensor *q = c->in[0], *k = c->in[1];
    attn_dims d;
    d.B = q->shape[0], d.Tq = q->shape[1], d.Hq = q->shape[2], d.D = q->shape[3];
    d.Tk = k->shape[1], d.Hkv = k->shape[2];
    d.G = d.Hq / d.Hkv;
    d.off = d.Tk - d.Tq;
    d.scale = c->fattr[0] > 0.0 ? c->fattr[0] : 1.0 / sqrt((double)d.D);
    return d;
}

static inline void axpy(double *y, double alpha, const double *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}

/* s[j] = a . b_j for the n rows b_j = b + j * stride (D long). Four rows per pass: four
 * independent reduction chains hide the add latency that a single dot product is bound by, and
 * each element of `a` is loaded once for four rows. */
static void dots(double *s, const double *a, const double *b, int64_t stride, int64_t n, int64_t D) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const double *b0 = b + j * stride, *b1 = b0 + stride, *b2 = b1 + stride, *b3 = b2 + stride;
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t x = 0; x < D; x++) {
            s0 += a[x] * b0[x];
            s1 += a[x] * b1[x];
            s2 += a[x] * b2[x];
            s3 += a[x] * b3[x];
        }
        s[j] = s0, s[j + 1] = s1, s[j + 2] = s2, s[j + 3] = s3;
    }
    for (; j < n; j++) {
        const double *bj = b + j * stride;
        double s0 = 0.0;
#pragma omp simd reduction(+ : s0)
        for (int64_t x = 0; x < D; x++) s0 += a[x] * bj[x];
        s[j] = s0;
    }
}

/* y += sum_j w[j] * b_j over the n rows b_j = b + j * stride (D long); four rows per pass over y. */
static void combine(double *y, const double *w, const double *b, int64_t stride, int64_t n, int64_t D) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const double *b0 = b + j * stride, *b1 = b0 + stride, *b2 = b1 + stride, *b3 = b2 + stride;
        const double w0 = w[j], w1 = w[j + 1], w2 = w[j + 2], w3 = w[j + 3];
#pragma omp simd
        for (int64_t x = 0; x < D; x++) y[x] += w0 * b0[x] + w1 * b1[x] + w2 * b2[x] + w3 * b3[x];
    }
    for (; j < n; j++) axpy(y, w[j], b + j * stride, D);
}

/* f64 view of a contiguous float tensor: its own data for f64, a widened arena copy for f32. */
static const double *as_f64(tm_ctx *ctx, const tm_tensor *t) {
    if (t->dtype == TM_F64) return tm__data(t);
    const int64_t n = tm__numel(t);
    double *w = tm__arena_alloc(ctx, tm_cpu(), (size_t)(n ? n : 1) * sizeof(double));
    if (!w) return NULL;
    const float *src = tm__data(t);
#pragma omp parallel for simd num_threads(tm__nthreads(ctx)) if (parallel : n >= PAR_MIN) schedule(static)
    for (int64_t i = 0; i < n; i++) w[i] = src[i];
    return w;
}

/* Where the backward accumulates the gradient of in[i]: gin itself for f64, zeroed f64 scratch
 * for f32 (added into gin by grad_flush). *dst is NULL when in[i] needs no gradient. */
static tm_status grad_target(tm__call *c, int i, double **dst) {
    tm_tensor *g = c->gin[i];
    *dst = NULL;
    if (!g) return TM_OK;
    if (g->dtype == TM_F64) {
        *dst = tm__data(g);
        return TM_OK;
    }
    const int64_t n = tm__numel(g);
    double *w = tm__arena_alloc(c->ctx, tm_cpu(), (size_t)(n ? n : 1) * sizeof(double));
    if (!w) return TM_ERR_NOMEM;
    memset(w, 0, (size_t)n * sizeof(double));
    *dst = w;
    return TM_OK;
}

static void grad_flush(tm__call *c, int i, const double *acc) {
    tm_tensor *g = c->gin[i];
    if (!g || g->dtype == TM_F64) return;
    float *dst = tm__data(g);
    const int64_t n = tm__numel(g);
#pragma omp parallel for simd num_threads(tm__nthreads(c->ctx)) if (parallel : n >= PAR_MIN) schedule(static)
    for (int64_t j = 0; j < n; j++) dst[j] = (float)(dst[j] + acc[j]);
}

tm_status tm__attention_forward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const attn_dims d = attn_dims_of(c);
    tm_tensor *o_t = c->out[0], *lse_t;
    const int64_t lse_shape[3] = {d.B, d.Hq, d.Tq};
    TM__TRY(tm__saved_new(c, o_t->dtype, 3, lse_shape, &lse_t));
    const int64_t rows = d.B * d.Hq * d.Tq;
    if (rows == 0) return TM_OK;

    const double *q = as_f64(ctx, c->in[0]), *k = as_f64(ctx, c->in[1]), *v = as_f64(ctx, c->in[2]);
    const int nth = tm__nthreads(ctx);
    const int64_t per_thread = d.Tk + d.D; /* scores / probabilities of one row, output accumulator */
    double *scratch = tm__arena_alloc(ctx, tm_cpu(), (size_t)(nth * per_thread) * sizeof(double));
    if (!q || !k || !v || !scratch) return TM_ERR_NOMEM;
    const int f64 = o_t->dtype == TM_F64;
    void *o_out = tm__data(o_t), *lse_out = tm__data(lse_t);
    const int64_t qs = d.Hq * d.D, ks = d.Hkv * d.D; /* row strides over time */

    /* Row r = (b * Hq + h) * Tq + i, the order of lse. Row i costs O(i), so rows are dealt in
     * small dynamic chunks to balance the causal triangle. */
#pragma omp parallel for num_threads(nth) if (rows * d.Tk * d.D >= PAR_MIN) schedule(dynamic, FWD_ROWS_PER_CHUNK)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r % d.Tq, h = (r / d.Tq) % d.Hq, b = r / (d.Tq * d.Hq);
        const int64_t n = i + d.off + 1;
        double *s = scratch + omp_get_thread_num() * per_thread, *acc = s + d.Tk;
        const double *qi = q + (b * d.Tq + i) * qs + h * d.D;  // (D)
        const double *kb = k + b * d.Tk * ks + (h / d.G) * d.D; // key j at kb + j * ks
        const double *vb = v + b * d.Tk * ks + (h / d.G) * d.D;

        dots(s, qi, kb, ks, n, d.D);
        double mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            s[j] *= d.scale;
            mx = s[j] > mx ? s[j] : mx;
        }
        double sum = 0.0;
        for (int64_t j = 0; j < n; j++) {
            s[j] = exp(s[j] - mx);
            sum += s[j];
        }
        memset(acc, 0, (size_t)d.D * sizeof(double));
        combine(acc, s, vb, ks, n, d.D);

        const double inv = 1.0 / sum, lse = mx + log(sum);
        const int64_t oi = (b * d.Tq + i) * qs + h * d.D;
        if (f64) {
            double *dst = (double *)o_out + oi;
            for (int64_t x = 0; x < d.D; x++) dst[x] = acc[x] * inv;
            ((double *)lse_out)[r] = lse;
        } else {
            float *dst = (float *)o_out + oi;
            for (int64_t x = 0; x < d.D; x++) dst[x] = (float)(acc[x] * inv);
            ((float *)lse_out)[r] = (float)lse;
        }
    }
    return TM_OK;
}

tm_status tm__attention_backward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    if (!c->gin[0] && !c->gin[1] && !c->gin[2]) return TM_OK;
    const attn_dims d = attn_dims_of(c);
    if (d.B * d.Hq * d.Tq == 0) return TM_OK;

    const double *q = as_f64(ctx, c->in[0]), *k = as_f64(ctx, c->in[1]), *v = as_f64(ctx, c->in[2]);
    const double *dout = as_f64(ctx, c->gout[0]), *lse = as_f64(ctx, c->saved[0]);
    double *dq, *dk, *dv;
    TM__TRY(grad_target(c, 0, &dq));
    TM__TRY(grad_target(c, 1, &dk));
    TM__TRY(grad_target(c, 2, &dv));
    const int nth = tm__nthreads(ctx);
    double *scratch = tm__arena_alloc(ctx, tm_cpu(), (size_t)(nth * 2 * d.Tk) * sizeof(double));
    if (!q || !k || !v || !dout || !lse || !scratch) return TM_ERR_NOMEM;
    const int64_t qs = d.Hq * d.D, ks = d.Hkv * d.D;
    const int64_t tasks = d.B * d.Hkv;

#pragma omp parallel for num_threads(nth) if (tasks > 1 && d.B * d.Hq * d.Tq * d.Tk * d.D >= PAR_MIN) \
    schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / d.Hkv, hk = task % d.Hkv;
        double *p = scratch + omp_get_thread_num() * 2 * d.Tk, *dp = p + d.Tk;
        const int64_t kvo = b * d.Tk * ks + hk * d.D; // key / value j at kvo + j * ks
        const double *kb = k + kvo, *vb = v + kvo;
        for (int64_t h = hk * d.G; h < (hk + 1) * d.G; h++) {
            for (int64_t i = 0; i < d.Tq; i++) {
                const int64_t n = i + d.off + 1, qi_o = (b * d.Tq + i) * qs + h * d.D;
                const double *qi = q + qi_o, *doi = dout + qi_o;
                const double lse_i = lse[(b * d.Hq + h) * d.Tq + i];
                dots(p, qi, kb, ks, n, d.D);
                dots(dp, doi, vb, ks, n, d.D);
                double delta = 0.0;
                for (int64_t j = 0; j < n; j++) {
                    p[j] = exp(d.scale * p[j] - lse_i);
                    delta += p[j] * dp[j];
                }
                /* dp becomes scale * dS (the scale of s = scale q.k folded in). */
                for (int64_t j = 0; j < n; j++) dp[j] = d.scale * p[j] * (dp[j] - delta);
                if (dq) combine(dq + qi_o, dp, kb, ks, n, d.D);
                for (int64_t j = 0; j < n; j++) {
                    if (dk) axpy(dk + kvo + j * ks, dp[j], qi, d.D);
                    if (dv) axpy(dv + kvo + j * ks, p[j], doi, d.D);
                }
            }
        }
    }
    if (dq) grad_flush(c, 0, dq);
    if (dk) grad_flush(c, 1, dk);
    if (dv) grad_flush(c, 2, dv);
    return TM_OK;
}
