/*
 * moe_loss.c — CPU kernels of the MoE auxiliary losses. T tokens, E experts, k = topk.
 *
 * moe_aux_loss (Switch / GShard load balancing; TE fused_moe_aux_loss, Megatron
 * switch_load_balancing_loss_func):
 *   in[0]     scores             (T, E)
 *   in[1]     tokens_per_expert  (E) i64, no gradient
 *   iattr[0]  k;  iattr[1] total_tokens (<= 0: T);  fattr[0] coeff
 *   out[0]    aux  ()  = c * sum_e (sum_t scores[t,e]) * count[e],  c = E * coeff / (k * T^2)
 *   backward: dscores[t,e] += c * count[e] * dy
 *
 * moe_seq_aux_loss (DeepSeek-V3 sec. 2.1.2, complementary sequence-wise balance loss):
 *   in[0]     scores       (T, E)
 *   in[1]     routing_map  (T, E) u8 (nonzero = routed), no gradient
 *   iattr[0]  k;  iattr[1] num_seqs (n);  fattr[0] coeff
 *   out[0]    ()  = 1/n sum_s c_S * sum_e (sum_{t in s} scores[t,e]) * counts_s[e],
 *             c_S = E * coeff / (k * S^2), S = T / n, sequence s = rows [s S, (s+1) S)
 *   saved[0]  counts_s  (n, E) i64: per-sequence column sums of routing_map
 *   backward: dscores[t,e] += c_S / n * counts_{s(t)}[e] * dy
 *   DeepSeek-V3 eqs. 17-20 per sequence of S tokens: L = alpha sum_i f_i P_i with
 *   f_i = E / (k S) sum_t 1(i routed for t) = E / (k S) counts_s[i] and
 *   P_i = 1/S sum_t s'_{i,t}, s' the normalised affinities (the aux scores), so
 *   L = alpha E / (k S^2) sum_i counts_s[i] sum_t s'_{i,t}: the aux formula with T -> S and
 *   alpha = coeff. Megatron's sequence_load_balancing_loss_func averages it over sequences the
 *   same way (its rows are sequence-major; ours are contiguous per sequence, as tinymoe's x).
 *
 * moe_z_loss (ST-MoE, Zoph et al. 2022, eq. 5):
 *   in[0]     logits  (T, E);  fattr[0] coeff
 *   out[0]    z  ()  = coeff / T * sum_t lse_t^2,  lse_t = logsumexp_e logits[t,e] (max-shifted)
 *   saved[0]  lse  (T)  f32 for f32/bf16 logits, f64 for f64
 *   backward: dlogits[t,e] += dy * coeff * 2 lse_t / T * softmax(logits[t])[e]
 *
 * Every loss is 0 for T = 0. Sums: each row's contribution is computed in f64 (in parallel),
 * then the rows are added in order, so a loss does not depend on the thread count. The scaling
 * of a balance loss by c is applied once, to the total: that keeps coeff = 0 an exact 0 and
 * the perfectly balanced uniform case (scores 1/E, counts T k / E) an exact coeff.
 */
#include <math.h>

#include "internal.h"

enum { PAR_MIN = 1 << 15 };

#define MOE_LOSS_KERNELS(T, SFX, EXP)                                                            \
    /* rows[t] = sum_e s[t,e] * cnt[e] with the counts of t's sequence (seq_len rows each). */   \
    static void dot_rows_##SFX(double *rows, const T *s, const int64_t *cnt, int64_t seq_len,   \
                               int64_t Tn, int64_t E, int nth) {                                 \
        _Pragma("omp parallel for num_threads(nth) if (Tn * E >= PAR_MIN) schedule(static)")     \
        for (int64_t t = 0; t < Tn; t++) {                                                       \
            const T *sr = s + t * E;                                                             \
            const int64_t *cr = cnt + (t / seq_len) * E;                                         \
            double acc = 0.0;                                                                    \
            for (int64_t e = 0; e < E; e++) acc += (double)sr[e] * (double)cr[e];                \
            rows[t] = acc;                                                                       \
        }                                                                                        \
    }                                                                                            \
    /* ds[t,e] += a * cnt[e] over t's sequence. */                                               \
    static void add_counts_##SFX(T *ds, const int64_t *cnt, double a, int64_t seq_len,          \
                                 int64_t Tn, int64_t E, int nth) {                               \
        _Pragma("omp parallel for num_threads(nth) if (Tn * E >= PAR_MIN) schedule(static)")     \
        for (int64_t t = 0; t < Tn; t++) {                                                       \
            T *dr = ds + t * E;                                                                  \
            const int64_t *cr = cnt + (t / seq_len) * E;                                         \
            for (int64_t e = 0; e < E; e++) dr[e] = (T)(dr[e] + a * (double)cr[e]);              \
        }                                                                                        \
    }                                                                                            \
    /* rows[t] = lse_t^2; lse saved for backward. */                                             \
    static void z_forward_##SFX(double *rows, T *lse, const T *x, int64_t Tn, int64_t E,        \
                                int nth) {                                                       \
        _Pragma("omp parallel for num_threads(nth) if (Tn * E >= PAR_MIN) schedule(static)")     \
        for (int64_t t = 0; t < Tn; t++) {                                                       \
            const T *xr = x + t * E;                                                             \
            T mx = xr[0];                                                                        \
            for (int64_t e = 1; e < E; e++) mx = xr[e] > mx ? xr[e] : mx;                        \
            double sum = 0.0;                                                                    \
            for (int64_t e = 0; e < E; e++) sum += EXP(xr[e] - mx);                              \
            double l = (double)mx + log(sum);                                                    \
            lse[t] = (T)l;                                                                       \
            rows[t] = l * l;                                                                     \
        }                                                                                        \
    }                                                                                            \
    /* dx[t,e] += a * lse_t * exp(x[t,e] - lse_t), a = dy * coeff * 2 / T. */                    \
    static void z_backward_##SFX(T *dx, const T *x, const T *lse, double a, int64_t Tn,         \
                                 int64_t E, int nth) {                                           \
        _Pragma("omp parallel for num_threads(nth) if (Tn * E >= PAR_MIN) schedule(static)")     \
        for (int64_t t = 0; t < Tn; t++) {                                                       \
            const T *xr = x + t * E;                                                             \
            T *dr = dx + t * E, l = lse[t];                                                      \
            double g = a * (double)l;                                                            \
            for (int64_t e = 0; e < E; e++) dr[e] = (T)(dr[e] + g * EXP(xr[e] - l));             \
        }                                                                                        \
    }

MOE_LOSS_KERNELS(float, f32, expf)
MOE_LOSS_KERNELS(double, f64, exp)

static int is_cpu_float(tm_dtype dt) { return dt == TM_F32 || dt == TM_F64; }

static double read_scalar(const tm_tensor *t) {
    return t->dtype == TM_F64 ? *(const double *)tm__data(t) : (double)*(const float *)tm__data(t);
}

static void write_scalar(tm_tensor *t, double v) {
    if (t->dtype == TM_F64) *(double *)tm__data(t) = v;
    else *(float *)tm__data(t) = (float)v;
}

/* sum of rows[lo..hi) in order. */
static double ordered_sum(const double *rows, int64_t lo, int64_t hi) {
    double s = 0.0;
    for (int64_t i = lo; i < hi; i++) s += rows[i];
    return s;
}

/* (T) f64 scratch; one element at least, so that T = 0 is not an allocation failure. */
static double *row_scratch(tm__call *c, int64_t T) {
    return tm__arena_alloc(c->ctx, tm_cpu(), (size_t)(T > 0 ? T : 1) * sizeof(double));
}

/* ---- moe_aux_loss ------------------------------------------------------------------------- */

/* c = E * coeff / (k * T^2), T the global token count; 0 when there are no tokens. */
static double aux_scale(const tm__call *c) {
    int64_t T = c->iattr[1] > 0 ? c->iattr[1] : c->in[0]->shape[0], E = c->in[0]->shape[1];
    if (T == 0) return 0.0;
    return (double)E * c->fattr[0] / ((double)c->iattr[0] * (double)T * (double)T);
}

tm_status tm__moe_aux_loss_forward_cpu(tm__call *c) {
    const tm_tensor *s = c->in[0];
    if (!is_cpu_float(s->dtype))
        return tm__err(c->ctx, TM_ERR_INTERNAL, "moe_aux_loss: CPU kernel got scores %s", tm__tdesc(c->ctx, s));
    int64_t T = s->shape[0], E = s->shape[1];
    double *rows = row_scratch(c, T);
    if (!rows) return TM_ERR_NOMEM;
    const int64_t *cnt = tm__data(c->in[1]);
    int nth = tm__nthreads(c->ctx);
    // all rows share one count vector: seq_len = max(T, 1)
    if (s->dtype == TM_F64) dot_rows_f64(rows, tm__data(s), cnt, T > 0 ? T : 1, T, E, nth);
    else dot_rows_f32(rows, tm__data(s), cnt, T > 0 ? T : 1, T, E, nth);
    write_scalar(c->out[0], aux_scale(c) * ordered_sum(rows, 0, T));
    return TM_OK;
}

tm_status tm__moe_aux_loss_backward_cpu(tm__call *c) {
    const tm_tensor *s = c->in[0];
    tm_tensor *ds = c->gin[0];
    if (!ds) return TM_OK;
    int64_t T = s->shape[0], E = s->shape[1];
    double a = aux_scale(c) * read_scalar(c->gout[0]);
    const int64_t *cnt = tm__data(c->in[1]);
    int nth = tm__nthreads(c->ctx);
    if (s->dtype == TM_F64) add_counts_f64(tm__data(ds), cnt, a, T > 0 ? T : 1, T, E, nth);
    else add_counts_f32(tm__data(ds), cnt, a, T > 0 ? T : 1, T, E, nth);
    return TM_OK;
}

/* ---- moe_seq_aux_loss --------------------------------------------------------------------- */

/* c_S / n = E * coeff / (k * S^2 * n); 0 when the sequences are empty. */
static double seq_scale(const tm__call *c, int64_t *S_out) {
    int64_t T = c->in[0]->shape[0], E = c->in[0]->shape[1], n = c->iattr[1], S = T / n;
    *S_out = S;
    if (S == 0) return 0.0;
    return (double)E * c->fattr[0] / ((double)c->iattr[0] * (double)S * (double)S * (double)n);
}

tm_status tm__moe_seq_aux_loss_forward_cpu(tm__call *c) {
    const tm_tensor *s = c->in[0];
    if (!is_cpu_float(s->dtype))
        return tm__err(c->ctx, TM_ERR_INTERNAL, "moe_seq_aux_loss: CPU kernel got scores %s", tm__tdesc(c->ctx, s));
    int64_t T = s->shape[0], E = s->shape[1], n = c->iattr[1], S;
    double scale = seq_scale(c, &S);
    int64_t cshape[2] = {n, E};
    tm_tensor *counts;
    TM__TRY(tm__saved_new(c, TM_I64, 2, cshape, &counts));
    int64_t *cnt = tm__data(counts);
    const uint8_t *map = tm__data(c->in[1]);
    int nth = tm__nthreads(c->ctx);

    // counts_s[e] = number of routed (t, e) with t in sequence s
#pragma omp parallel for num_threads(nth) if (T * E >= PAR_MIN) schedule(static)
    for (int64_t q = 0; q < n; q++) {
        int64_t *cq = cnt + q * E;
        for (int64_t e = 0; e < E; e++) cq[e] = 0;
        for (int64_t t = q * S; t < (q + 1) * S; t++)
            for (int64_t e = 0; e < E; e++) cq[e] += map[t * E + e] != 0;
    }

    double *rows = row_scratch(c, T);
    if (!rows) return TM_ERR_NOMEM;
    int64_t seq_len = S > 0 ? S : 1;
    if (s->dtype == TM_F64) dot_rows_f64(rows, tm__data(s), cnt, seq_len, T, E, nth);
    else dot_rows_f32(rows, tm__data(s), cnt, seq_len, T, E, nth);
    // 1/n sum_s c_S L_s: every sequence has the same c_S, so one scaling of the ordered total
    write_scalar(c->out[0], scale * ordered_sum(rows, 0, T));
    return TM_OK;
}

tm_status tm__moe_seq_aux_loss_backward_cpu(tm__call *c) {
    const tm_tensor *s = c->in[0];
    tm_tensor *ds = c->gin[0];
    if (!ds) return TM_OK;
    int64_t T = s->shape[0], E = s->shape[1], S;
    double a = seq_scale(c, &S) * read_scalar(c->gout[0]);
    const int64_t *cnt = tm__data(c->saved[0]);
    int nth = tm__nthreads(c->ctx);
    int64_t seq_len = S > 0 ? S : 1;
    if (s->dtype == TM_F64) add_counts_f64(tm__data(ds), cnt, a, seq_len, T, E, nth);
    else add_counts_f32(tm__data(ds), cnt, a, seq_len, T, E, nth);
    return TM_OK;
}

/* ---- moe_z_loss --------------------------------------------------------------------------- */

tm_status tm__moe_z_loss_forward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0];
    if (!is_cpu_float(x->dtype))
        return tm__err(c->ctx, TM_ERR_INTERNAL, "moe_z_loss: CPU kernel got logits %s", tm__tdesc(c->ctx, x));
    int64_t T = x->shape[0], E = x->shape[1];
    tm_tensor *lse;
    TM__TRY(tm__saved_new(c, x->dtype, 1, &T, &lse));
    double *rows = row_scratch(c, T);
    if (!rows) return TM_ERR_NOMEM;
    int nth = tm__nthreads(c->ctx);
    if (x->dtype == TM_F64) z_forward_f64(rows, tm__data(lse), tm__data(x), T, E, nth);
    else z_forward_f32(rows, tm__data(lse), tm__data(x), T, E, nth);
    write_scalar(c->out[0], T > 0 ? c->fattr[0] * ordered_sum(rows, 0, T) / (double)T : 0.0);
    return TM_OK;
}

tm_status tm__moe_z_loss_backward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0];
    tm_tensor *dx = c->gin[0];
    int64_t T = x->shape[0], E = x->shape[1];
    if (!dx || T == 0) return TM_OK;
    double a = read_scalar(c->gout[0]) * c->fattr[0] * 2.0 / (double)T;
    int nth = tm__nthreads(c->ctx);
    if (x->dtype == TM_F64) z_backward_f64(tm__data(dx), tm__data(x), tm__data(c->saved[0]), a, T, E, nth);
    else z_backward_f32(tm__data(dx), tm__data(x), tm__data(c->saved[0]), a, T, E, nth);
    return TM_OK;
}
