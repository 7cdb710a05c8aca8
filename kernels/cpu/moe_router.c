/*
 * moe_router.c — CPU kernels of the fused top-k router (tm_moe_router) and of the aux-loss
 * scores (tm_moe_aux_scores). Semantics: include/tinymoe.h and the MoE semantics note (sec. 2,
 * 3), after TE fused_topk_with_score_function and Megatron topk_routing_with_score_function.
 *
 * Op "moe_router", layout shared with kernels/cuda/moe_router.cu:
 *   in[0]     logits        (T, E) float
 *   in[1]     expert_bias   (E) float, optional (n_in = 2); selection only, never a gradient
 *   iattr[0]  num_experts E     iattr[1] topk k        iattr[2] score_function (tm_score_function)
 *   iattr[3]  use_pre_softmax   iattr[4] num_groups G (0 or 1: no groups)
 *   iattr[5]  group_topk        iattr[6] norm_topk_prob
 *   iattr[7]  force_load_balance (0 or 1)
 *   fattr[0]  scaling_factor
 *   out[0]    probs             (T, E) float: p at the routed (t, e), 0 elsewhere
 *   out[1]    routing_map       (T, E) u8
 *   out[2]    topk_idx          (T, k) i32, by descending selection score (forced: j order)
 *   out[3]    topk_weights      (T, k) float: p in the order of topk_idx
 *   out[4]    tokens_per_expert (E) i64
 * Nothing is saved: the backward recomputes the scores of each row from logits (O(E) per row,
 * the cost of the forward) and reads the selection from out[2].
 *
 * Per row, everything in double whatever the storage dtype:
 *   selection scores v:  softmax pre: s = softmax(l) over E, v = s (+ bias)
 *                        softmax post: v = l (+ bias)
 *                        sigmoid:      s = sigmoid(l), v = s (+ bias)
 *   A bias with softmax is allowed and, as with sigmoid, moves the selection only.
 *   groups (G > 1): group g scores the sum of its top (k / group_topk) values of v; the best
 *     group_topk groups are kept; the top-k then only looks at experts of kept groups (the same
 *     as masking the others to -inf, but it cannot pick a masked expert when v itself is -inf).
 *   idx = the k best of v, descending; ties (here and between groups) go to the lower index.
 *   force_load_balance replaces the selection (v, groups and bias unused):
 *     idx_j = (t k + j) % E, torchtitan's round robin; q below is computed from it as from any
 *     selection, and the backward, which only reads idx, is the same.
 *   q:  softmax pre:  q_j = s[idx_j]; norm_topk_prob: q /= sum(q)
 *       softmax post: q = softmax(l[idx]) over the k selected
 *       sigmoid:      q_j = s[idx_j]; k > 1: q /= (sum(q) + 1e-20)
 *   p = scaling_factor * q. norm_topk_prob has no effect outside softmax-pre.
 *
 * Backward, per row, with G_j = d probs[t, idx_j] + d topk_weights[t, j] (unselected entries of
 * probs are constant zeros and carry nothing) and dq = scaling_factor * G:
 *   softmax pre:   ds[idx_j] = dq_j, or with norm_topk_prob (dq_j - <dq, q>) / sum_S s; ds = 0
 *                  off the selection; then the full softmax Jacobian over E:
 *                  dl_e = s_e (ds_e - <ds, s>), so every expert of the row gets a gradient.
 *   softmax post:  dl[idx_j] = q_j (dq_j - <dq, q>)
 *   sigmoid:       ds_j = dq_j, or for k > 1 (dq_j - <dq, q>) / (sum_S s + 1e-20);
 *                  dl[idx_j] = ds_j s_j (1 - s_j)
 *
 * Op "moe_aux_scores": in[0] logits (T, E), iattr[0] score_function, out[0] scores (T, E):
 * softmax over E, or q = s / (sum_E s + 1e-20) with s = sigmoid(l). Backward as above with
 * the selection being all of E.
 */
#include <math.h>
#include <omp.h>

#include "internal.h"

enum { PAR_MIN = 1 << 14 };

static inline double ld(const void *p, tm_dtype dt, int64_t i) {
    return dt == TM_F64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}
static inline void st(void *p, tm_dtype dt, int64_t i, double v) {
    if (dt == TM_F64) ((double *)p)[i] = v;
    else ((float *)p)[i] = (float)v;
}
static inline void add_to(void *p, tm_dtype dt, int64_t i, double v) {
    if (dt == TM_F64) ((double *)p)[i] += v;
    else ((float *)p)[i] = (float)(((float *)p)[i] + v);
}

static inline double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* In-place softmax of v[0..n), max-subtracted. */
static void softmax_inplace(double *v, int64_t n) {
    double mx = -INFINITY, sum = 0.0;
    for (int64_t i = 0; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    for (int64_t i = 0; i < n; i++) sum += v[i] = exp(v[i] - mx);
    for (int64_t i = 0; i < n; i++) v[i] /= sum;
}

/* The k best of v[0..n) (n >= k) into out[0..k), descending, ties to the lower index; when keep
 * is non-NULL only i with keep[i / group_size] count (at least k of them must). An insertion
 * over a list of k: the router's k is small, and visiting i in ascending order makes a later
 * equal value land after the earlier ones, which is the tie rule. A NaN never displaces an entry,
 * so out always holds k distinct indices. */
static void select_topk(const double *v, int64_t n, int64_t k, const unsigned char *keep, int64_t group_size,
                        int32_t *out) {
    int64_t cnt = 0;
    for (int64_t i = 0; i < n; i++) {
        if (keep && !keep[i / group_size]) continue;
        int64_t pos = cnt;
        while (pos > 0 && v[i] > v[out[pos - 1]]) pos--;
        if (pos >= k) continue;
        for (int64_t j = (cnt < k ? cnt : k - 1); j > pos; j--) out[j] = out[j - 1];
        out[pos] = (int32_t)i;
        if (cnt < k) cnt++;
    }
}

typedef struct router_attrs {
    int64_t E, k, G, gk, gsize; /* G = 1 without groups */
    int score, pre, norm, force;
    double scaling;
} router_attrs;

static router_attrs router_attrs_of(const tm__call *c) {
    router_attrs a;
    a.E = c->iattr[0];
    a.k = c->iattr[1];
    a.score = (int)c->iattr[2];
    a.pre = c->iattr[3] != 0;
    a.G = c->iattr[4] > 1 ? c->iattr[4] : 1;
    a.gk = a.G > 1 ? c->iattr[5] : 1;
    a.gsize = a.E / a.G;
    a.norm = c->iattr[6] != 0;
    a.force = c->iattr[7] != 0;
    a.scaling = c->fattr[0];
    return a;
}

/* Per-thread scratch of the forward: s, v (E each), group scores (G), q (k) in doubles; the
 * group kept flags (G bytes) and an index list of max(k, G) after them. */
static size_t fwd_scratch_bytes(const router_attrs *a) {
    int64_t nidx = a->k > a->G ? a->k : a->G;
    size_t b = (size_t)(2 * a->E + a->G + a->k) * sizeof(double) + (size_t)nidx * sizeof(int32_t) + (size_t)a->G;
    return (b + 63) & ~(size_t)63;
}

/* The score-based selection of one row: v = s (+ bias), groups, top-k into idx (k). */
static void select_row(const router_attrs *a, const double *s, double *v, double *gscore, unsigned char *keep,
                       int32_t *tmp, const double *bias, int32_t *idx) {
    const int64_t E = a->E, k = a->k;
    for (int64_t e = 0; e < E; e++) v[e] = bias ? s[e] + bias[e] : s[e];
    const unsigned char *kp = NULL;
    if (a->G > 1) {
        const int64_t m = k / a->gk;
        for (int64_t g = 0; g < a->G; g++) {
            select_topk(v + g * a->gsize, a->gsize, m, NULL, 1, tmp);
            double sum = 0.0;
            for (int64_t j = 0; j < m; j++) sum += v[g * a->gsize + tmp[j]];
            gscore[g] = sum;
        }
        select_topk(gscore, a->G, a->gk, NULL, 1, tmp);
        memset(keep, 0, (size_t)a->G);
        for (int64_t j = 0; j < a->gk; j++) keep[tmp[j]] = 1;
        kp = keep;
    }
    select_topk(v, E, k, kp, a->gsize, idx);
}

/* Row t: fills idx (k) and q (k, already scaled). l: the row's logits as doubles in s. */
static void route_row(const router_attrs *a, int64_t t, double *s, double *v, double *gscore, unsigned char *keep,
                      int32_t *tmp, const double *bias, int32_t *idx, double *q) {
    const int64_t E = a->E, k = a->k;
    /* s <- the score function of the logits (softmax post keeps the logits) */
    if (a->score == TM_SCORE_SIGMOID)
        for (int64_t e = 0; e < E; e++) s[e] = sigmoid(s[e]);
    else if (a->pre)
        softmax_inplace(s, E);
    if (a->force) /* t k + j < T E, the element count of logits: no overflow */
        for (int64_t j = 0; j < k; j++) idx[j] = (int32_t)((t * k + j) % E);
    else
        select_row(a, s, v, gscore, keep, tmp, bias, idx);

    for (int64_t j = 0; j < k; j++) q[j] = s[idx[j]];
    if (a->score == TM_SCORE_SOFTMAX && !a->pre) {
        softmax_inplace(q, k);
    } else if ((a->score == TM_SCORE_SOFTMAX && a->norm) || (a->score == TM_SCORE_SIGMOID && k > 1)) {
        double sum = 0.0;
        for (int64_t j = 0; j < k; j++) sum += q[j];
        if (a->score == TM_SCORE_SIGMOID) sum += 1e-20;
        for (int64_t j = 0; j < k; j++) q[j] /= sum;
    }
    for (int64_t j = 0; j < k; j++) q[j] *= a->scaling;
}

/* The bias as doubles (arena), or NULL. */
static tm_status bias_f64(tm__call *c, int64_t E, const double **out) {
    *out = NULL;
    if (c->n_in < 2) return TM_OK;
    double *b = tm__arena_alloc(c->ctx, tm_cpu(), (size_t)E * sizeof(double));
    if (!b) return TM_ERR_NOMEM;
    const tm_tensor *bt = c->in[1];
    for (int64_t e = 0; e < E; e++) b[e] = ld(tm__data(bt), bt->dtype, e);
    *out = b;
    return TM_OK;
}

tm_status tm__moe_router_forward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *lt = c->in[0];
    const tm_dtype dt = lt->dtype;
    if (dt != TM_F32 && dt != TM_F64)
        return tm__err(ctx, TM_ERR_INTERNAL, "moe_router: CPU kernel got logits %s", tm__tdesc(ctx, lt));
    const router_attrs a = router_attrs_of(c);
    const int64_t T = lt->shape[0], E = a.E, k = a.k;
    int64_t *counts = tm__data(c->out[4]); // (E)
    memset(counts, 0, (size_t)E * sizeof *counts);
    if (T == 0) return TM_OK;

    const double *bias;
    TM__TRY(bias_f64(c, E, &bias));
    const int nth = tm__nthreads(ctx);
    const size_t per_thread = fwd_scratch_bytes(&a);
    char *scratch = tm__arena_alloc(ctx, tm_cpu(), (size_t)nth * per_thread);
    if (!scratch) return TM_ERR_NOMEM;
    const void *logits = tm__data(lt);                     // (T, E)
    void *probs = tm__data(c->out[0]);                     // (T, E)
    unsigned char *map = tm__data(c->out[1]);              // (T, E)
    int32_t *topk_idx = tm__data(c->out[2]);               // (T, k)
    void *topk_w = tm__data(c->out[3]);                    // (T, k)

#pragma omp parallel for num_threads(nth) if (T * E >= PAR_MIN) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        char *base = scratch + (size_t)omp_get_thread_num() * per_thread;
        double *s = (double *)base, *v = s + E, *gscore = v + E, *q = gscore + a.G;
        int32_t *tmp = (int32_t *)(q + k);
        unsigned char *keep = (unsigned char *)(tmp + (k > a.G ? k : a.G));
        int32_t *idx = topk_idx + t * k;
        for (int64_t e = 0; e < E; e++) s[e] = ld(logits, dt, t * E + e);
        route_row(&a, t, s, v, gscore, keep, tmp, bias, idx, q);
        memset(map + t * E, 0, (size_t)E);
        for (int64_t e = 0; e < E; e++) st(probs, dt, t * E + e, 0.0);
        for (int64_t j = 0; j < k; j++) {
            st(probs, dt, t * E + idx[j], q[j]);
            st(topk_w, dt, t * k + j, q[j]);
            map[t * E + idx[j]] = 1;
        }
    }
    /* Serial: T * k increments, exact and independent of the thread count. */
    for (int64_t i = 0; i < T * k; i++) counts[topk_idx[i]]++;
    return TM_OK;
}

tm_status tm__moe_router_backward_cpu(tm__call *c) {
    tm_tensor *dlt = c->gin[0]; /* gin[1] (expert_bias) is left alone: the bias only selects */
    if (!dlt) return TM_OK;
    tm_ctx *ctx = c->ctx;
    const tm_tensor *lt = c->in[0];
    const tm_dtype dt = lt->dtype;
    const router_attrs a = router_attrs_of(c);
    const int64_t T = lt->shape[0], E = a.E, k = a.k;
    if (T == 0) return TM_OK;
    const int nth = tm__nthreads(ctx);
    const int64_t per_thread = E + 2 * k; /* s (E), q (k), dq (k) */
    double *scratch = tm__arena_alloc(ctx, tm_cpu(), (size_t)(nth * per_thread) * sizeof(double));
    if (!scratch) return TM_ERR_NOMEM;
    const void *logits = tm__data(lt);                 // (T, E)
    const int32_t *topk_idx = tm__data(c->out[2]);     // (T, k)
    const void *gp = tm__data(c->gout[0]);             // (T, E)
    const void *gw = tm__data(c->gout[3]);             // (T, k)
    const tm_dtype gpt = c->gout[0]->dtype, gwt = c->gout[3]->dtype;
    void *dl = tm__data(dlt);                          // (T, E)

#pragma omp parallel for num_threads(nth) if (T * E >= PAR_MIN) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        double *s = scratch + omp_get_thread_num() * per_thread, *q = s + E, *dq = q + k;
        const int32_t *idx = topk_idx + t * k;
        for (int64_t j = 0; j < k; j++)
            dq[j] = a.scaling * (ld(gp, gpt, t * E + idx[j]) + ld(gw, gwt, t * k + j));

        if (a.score == TM_SCORE_SOFTMAX && a.pre) {
            for (int64_t e = 0; e < E; e++) s[e] = ld(logits, dt, t * E + e);
            softmax_inplace(s, E);
            /* ds over the selection, stored in dq */
            if (a.norm) {
                double z = 0.0, dot = 0.0;
                for (int64_t j = 0; j < k; j++) z += s[idx[j]];
                for (int64_t j = 0; j < k; j++) dot += dq[j] * s[idx[j]] / z;
                for (int64_t j = 0; j < k; j++) dq[j] = (dq[j] - dot) / z;
            }
            double dot = 0.0;
            for (int64_t j = 0; j < k; j++) dot += dq[j] * s[idx[j]];
            for (int64_t e = 0; e < E; e++) add_to(dl, dt, t * E + e, -s[e] * dot);
            for (int64_t j = 0; j < k; j++) add_to(dl, dt, t * E + idx[j], s[idx[j]] * dq[j]);
        } else if (a.score == TM_SCORE_SOFTMAX) {
            for (int64_t j = 0; j < k; j++) q[j] = ld(logits, dt, t * E + idx[j]);
            softmax_inplace(q, k);
            double dot = 0.0;
            for (int64_t j = 0; j < k; j++) dot += dq[j] * q[j];
            for (int64_t j = 0; j < k; j++) add_to(dl, dt, t * E + idx[j], q[j] * (dq[j] - dot));
        } else {
            for (int64_t j = 0; j < k; j++) s[j] = sigmoid(ld(logits, dt, t * E + idx[j]));
            if (k > 1) {
                double d = 1e-20, dot = 0.0;
                for (int64_t j = 0; j < k; j++) d += s[j];
                for (int64_t j = 0; j < k; j++) dot += dq[j] * s[j] / d;
                for (int64_t j = 0; j < k; j++) dq[j] = (dq[j] - dot) / d;
            }
            for (int64_t j = 0; j < k; j++) add_to(dl, dt, t * E + idx[j], dq[j] * s[j] * (1.0 - s[j]));
        }
    }
    return TM_OK;
}

/* ---- aux scores ------------------------------------------------------------------------ */

tm_status tm__moe_aux_scores_forward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *lt = c->in[0];
    const tm_dtype dt = lt->dtype;
    if (dt != TM_F32 && dt != TM_F64)
        return tm__err(ctx, TM_ERR_INTERNAL, "moe_aux_scores: CPU kernel got logits %s", tm__tdesc(ctx, lt));
    const int64_t T = lt->shape[0], E = lt->shape[1];
    const int sigm = c->iattr[0] == TM_SCORE_SIGMOID;
    if (T == 0) return TM_OK;
    const int nth = tm__nthreads(ctx);
    double *scratch = tm__arena_alloc(ctx, tm_cpu(), (size_t)(nth * E) * sizeof(double));
    if (!scratch) return TM_ERR_NOMEM;
    const void *logits = tm__data(lt); // (T, E)
    void *out = tm__data(c->out[0]);   // (T, E)

#pragma omp parallel for num_threads(nth) if (T * E >= PAR_MIN) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        double *s = scratch + omp_get_thread_num() * E;
        for (int64_t e = 0; e < E; e++) s[e] = ld(logits, dt, t * E + e);
        if (sigm) {
            double d = 1e-20;
            for (int64_t e = 0; e < E; e++) d += s[e] = sigmoid(s[e]);
            for (int64_t e = 0; e < E; e++) s[e] /= d;
        } else {
            softmax_inplace(s, E);
        }
        for (int64_t e = 0; e < E; e++) st(out, dt, t * E + e, s[e]);
    }
    return TM_OK;
}

tm_status tm__moe_aux_scores_backward_cpu(tm__call *c) {
    tm_tensor *dlt = c->gin[0];
    if (!dlt) return TM_OK;
    tm_ctx *ctx = c->ctx;
    const tm_tensor *lt = c->in[0];
    const tm_dtype dt = lt->dtype, gt = c->gout[0]->dtype;
    const int64_t T = lt->shape[0], E = lt->shape[1];
    const int sigm = c->iattr[0] == TM_SCORE_SIGMOID;
    if (T == 0) return TM_OK;
    const int nth = tm__nthreads(ctx);
    double *scratch = tm__arena_alloc(ctx, tm_cpu(), (size_t)(nth * E) * sizeof(double));
    if (!scratch) return TM_ERR_NOMEM;
    const void *logits = tm__data(lt);  // (T, E)
    const void *g = tm__data(c->gout[0]); // (T, E)
    void *dl = tm__data(dlt);           // (T, E)

#pragma omp parallel for num_threads(nth) if (T * E >= PAR_MIN) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        double *s = scratch + omp_get_thread_num() * E;
        for (int64_t e = 0; e < E; e++) s[e] = ld(logits, dt, t * E + e);
        if (sigm) {
            /* q = s / d: dq -> ds_e = (g_e - <g, q>) / d; dl_e = ds_e s_e (1 - s_e) */
            double d = 1e-20, dot = 0.0;
            for (int64_t e = 0; e < E; e++) d += s[e] = sigmoid(s[e]);
            for (int64_t e = 0; e < E; e++) dot += ld(g, gt, t * E + e) * s[e] / d;
            for (int64_t e = 0; e < E; e++)
                add_to(dl, dt, t * E + e, (ld(g, gt, t * E + e) - dot) / d * s[e] * (1.0 - s[e]));
        } else {
            softmax_inplace(s, E);
            double dot = 0.0;
            for (int64_t e = 0; e < E; e++) dot += ld(g, gt, t * E + e) * s[e];
            for (int64_t e = 0; e < E; e++) add_to(dl, dt, t * E + e, s[e] * (ld(g, gt, t * E + e) - dot));
        }
    }
    return TM_OK;
}
