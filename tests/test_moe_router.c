/*
 * test_moe_router.c — tm_moe_router and tm_moe_aux_scores: the forward against a naive router
 * written out below (double precision, explicit loops, its own sort) over every combination of
 * score function, norm_topk_prob, groups, bias, scaling, k and E; ties; the sigmoid bias rule;
 * gradients by finite differences through probs AND topk_weights in every mode; bad configs.
 * tm_moe_aux_counts (Megatron's clean top-k) against a rank-counting reference, with ties, the
 * ties that rounding puts into the scores, and its relation to tm_moe_aux_scores.
 * force_load_balance (benchmark routing): the selection against (t k + j) % E written out here,
 * a check that the data tell that formula from its near misses, the weights of every score
 * function by hand, exact balance, the bias and groups ignored, finite-difference gradients.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

double tt_gradcase_moe_router(tm_ctx *ctx);
double tt_gradcase_moe_aux_scores(tm_ctx *ctx);
double tt_gradcase_moe_router_forced(tm_ctx *ctx);

/* ---- the reference router ------------------------------------------------------------------- */

/* Sort the indices ord[0..n) by (key descending, index ascending): a plain insertion sort, kept
 * apart from the library's selection on purpose. */
static void ref_sort(int *ord, int n, const double *key) {
    for (int i = 1; i < n; i++) {
        int x = ord[i], j = i - 1;
        while (j >= 0 && (key[ord[j]] < key[x] || (key[ord[j]] == key[x] && ord[j] > x))) {
            ord[j + 1] = ord[j];
            j--;
        }
        ord[j + 1] = x;
    }
}

typedef struct ref_out {
    double *probs; /* T*E */
    unsigned char *map;
    int *idx;      /* T*k */
    double *w;     /* T*k */
    int64_t *counts;
} ref_out;

static void ref_free(ref_out *r) { free(r->probs), free(r->map), free(r->idx), free(r->w), free(r->counts); }

static ref_out ref_router(const double *logits, const double *bias, int T, const tm_router_config *cfg) {
    const int E = cfg->num_experts, k = cfg->topk;
    const int grouped = cfg->num_groups > 1;
    ref_out r;
    r.probs = calloc((size_t)T * E, sizeof(double));
    r.map = calloc((size_t)T * E, 1);
    r.idx = calloc((size_t)T * k, sizeof(int));
    r.w = calloc((size_t)T * k, sizeof(double));
    r.counts = calloc((size_t)E, sizeof(int64_t));
    double *s = malloc(sizeof(double) * E), *sel = malloc(sizeof(double) * E), *gsc = malloc(sizeof(double) * E);
    int *ord = malloc(sizeof(int) * E);
    for (int t = 0; t < T; t++) {
        const double *l = logits + (size_t)t * E;
        for (int e = 0; e < E; e++) s[e] = l[e];
        if (cfg->score_function == TM_SCORE_SIGMOID) {
            for (int e = 0; e < E; e++) s[e] = 1 / (1 + exp(-l[e]));
        } else if (cfg->use_pre_softmax) {
            double mx = l[0], z = 0;
            for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
            for (int e = 0; e < E; e++) z += exp(l[e] - mx);
            for (int e = 0; e < E; e++) s[e] = exp(l[e] - mx) / z;
        }
        for (int e = 0; e < E; e++) sel[e] = s[e] + (bias ? bias[e] : 0.0);
        if (cfg->force_load_balance) {
            /* torchtitan's round robin: arange(T k).reshape(T, k) % E, whatever the scores */
            for (int j = 0; j < k; j++) ord[j] = (t * k + j) % E;
        } else if (grouped) {
            const int G = cfg->num_groups, gs = E / G, m = k / cfg->group_topk;
            for (int g = 0; g < G; g++) {
                for (int i = 0; i < gs; i++) ord[i] = g * gs + i;
                ref_sort(ord, gs, sel);
                gsc[g] = 0;
                for (int i = 0; i < m; i++) gsc[g] += sel[ord[i]];
            }
            for (int g = 0; g < G; g++) ord[g] = g;
            ref_sort(ord, G, gsc);
            for (int i = cfg->group_topk; i < G; i++)
                for (int e = ord[i] * gs; e < (ord[i] + 1) * gs; e++) sel[e] = -INFINITY;
        }
        if (!cfg->force_load_balance) {
            for (int e = 0; e < E; e++) ord[e] = e;
            ref_sort(ord, E, sel);
        }
        double *w = r.w + (size_t)t * k;
        int *idx = r.idx + (size_t)t * k;
        double sum = 0;
        for (int j = 0; j < k; j++) {
            idx[j] = ord[j];
            w[j] = s[ord[j]];
        }
        if (cfg->score_function == TM_SCORE_SOFTMAX && !cfg->use_pre_softmax) {
            double mx = w[0], z = 0;
            for (int j = 1; j < k; j++) mx = w[j] > mx ? w[j] : mx;
            for (int j = 0; j < k; j++) z += exp(w[j] - mx);
            for (int j = 0; j < k; j++) w[j] = exp(w[j] - mx) / z;
        } else if (cfg->score_function == TM_SCORE_SIGMOID && k > 1) {
            for (int j = 0; j < k; j++) sum += w[j];
            for (int j = 0; j < k; j++) w[j] /= sum + 1e-20;
        } else if (cfg->score_function == TM_SCORE_SOFTMAX && cfg->norm_topk_prob) {
            for (int j = 0; j < k; j++) sum += w[j];
            for (int j = 0; j < k; j++) w[j] /= sum;
        }
        for (int j = 0; j < k; j++) {
            w[j] *= cfg->scaling_factor;
            r.probs[(size_t)t * E + idx[j]] = w[j];
            r.map[(size_t)t * E + idx[j]] = 1;
            r.counts[idx[j]]++;
        }
    }
    free(s), free(sel), free(gsc), free(ord);
    return r;
}

/* ---- inputs --------------------------------------------------------------------------------- */

static uint64_t lcg(uint64_t *st) {
    *st = *st * 6364136223846793005ull + 1442695040888963407ull;
    return *st >> 33;
}

/* Random [T, E] logits: N(0, 1) plus a per-expert popularity offset, with the expert columns
 * shuffled so that popular experts sit at random indices. */
static double *rand_logits(tm_ctx *ctx, int T, int E, uint64_t seed) {
    int64_t shape[2] = {T, E};
    double *base = tt_read(ctx, tt_randn(ctx, TM_F64, 2, shape, seed));
    int *perm = malloc(sizeof(int) * E);
    uint64_t st = seed * 7919 + 1;
    for (int e = 0; e < E; e++) perm[e] = e;
    for (int e = E - 1; e > 0; e--) {
        int j = (int)(lcg(&st) % (uint64_t)(e + 1)), x = perm[e];
        perm[e] = perm[j], perm[j] = x;
    }
    double *l = malloc(sizeof(double) * T * E);
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++) l[t * E + perm[e]] = base[t * E + e] + 1.5 * e / E;
    free(base), free(perm);
    return l;
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *op, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, op), "message lacks the op name: %s", msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

/* ---- forward against the reference ---------------------------------------------------------- */

/* Run one config on logits (f32 or f64) and compare every output with the reference computed from
 * the stored (possibly rounded) inputs. Returns 0 when the config is invalid (skipped). */
static int compare_one(tm_ctx *ctx, tm_dtype dt, const tm_router_config *cfg, const double *l, int T, int use_bias,
                       double tol) {
    const int E = cfg->num_experts, k = cfg->topk;
    int64_t ls[2] = {T, E}, bs[1] = {E};
    tm_tensor *lt = tt_from(ctx, dt, 2, ls, l), *bt = NULL;
    double *bv = NULL;
    if (use_bias) {
        bv = malloc(sizeof(double) * E);
        for (int e = 0; e < E; e++) bv[e] = 0.1 * (E - 1 - e);
        bt = tt_from(ctx, TM_F32, 1, bs, bv);
        free(bv);
        bv = tt_read(ctx, bt);
    }
    double *lr = tt_read(ctx, lt);
    ref_out ref = ref_router(lr, bv, T, cfg);
    tm_router_out o;
    TT_OK(ctx, tm_moe_router(ctx, lt, bt, cfg, &o));
    cr_assert_eq(tm_tensor_dtype(o.probs), dt);
    cr_assert_eq(tm_tensor_dtype(o.topk_weights), dt);
    cr_assert_eq(tm_tensor_dtype(o.routing_map), TM_U8);
    cr_assert_eq(tm_tensor_dtype(o.topk_idx), TM_I32);
    cr_assert_eq(tm_tensor_dtype(o.tokens_per_expert), TM_I64);
    cr_assert_eq(tm_tensor_dim(o.topk_idx, 1), k);
    cr_assert_eq(tm_tensor_dim(o.tokens_per_expert, 0), E);

    int32_t *idx = malloc(sizeof(int32_t) * T * k);
    unsigned char *map = malloc((size_t)T * E);
    int64_t *cnt = malloc(sizeof(int64_t) * E);
    TT_OK(ctx, tm_tensor_read(ctx, o.topk_idx, TM_I32, idx, (int64_t)T * k));
    TT_OK(ctx, tm_tensor_read(ctx, o.routing_map, TM_U8, map, (int64_t)T * E));
    TT_OK(ctx, tm_tensor_read(ctx, o.tokens_per_expert, TM_I64, cnt, E));
#define CFG_FMT "score %d pre %d norm %d groups %d/%d bias %d scale %g k %d E %d dt %d"
#define CFG_ARGS                                                                                            \
    cfg->score_function, cfg->use_pre_softmax, cfg->norm_topk_prob, cfg->num_groups, cfg->group_topk, use_bias, \
        cfg->scaling_factor, k, E, dt
    for (int i = 0; i < T * k; i++)
        cr_assert_eq(idx[i], ref.idx[i], "topk_idx[%d] = %d, want %d; " CFG_FMT, i, idx[i], ref.idx[i], CFG_ARGS);
    for (int i = 0; i < T * E; i++)
        cr_assert_eq(map[i], ref.map[i], "routing_map[%d]; " CFG_FMT, i, CFG_ARGS);
    for (int e = 0; e < E; e++)
        cr_assert_eq(cnt[e], ref.counts[e], "tokens_per_expert[%d] = %lld, want %lld; " CFG_FMT, e,
                     (long long)cnt[e], (long long)ref.counts[e], CFG_ARGS);
    double *p = tt_read(ctx, o.probs), *w = tt_read(ctx, o.topk_weights);
    double rp = tt_close_ratio(p, ref.probs, (int64_t)T * E, tol, tol), rw = tt_close_ratio(w, ref.w, (int64_t)T * k, tol, tol);
    cr_assert_leq(rp, 1.0, "probs ratio %g; " CFG_FMT, rp, CFG_ARGS);
    cr_assert_leq(rw, 1.0, "topk_weights ratio %g; " CFG_FMT, rw, CFG_ARGS);
#undef CFG_FMT
#undef CFG_ARGS
    free(p), free(w), free(idx), free(map), free(cnt), free(lr), free(bv);
    ref_free(&ref);
    return 1;
}

static int valid(const tm_router_config *c) {
    if (c->topk > c->num_experts) return 0;
    if (c->num_groups > 1) {
        if (c->num_experts % c->num_groups) return 0;
        if (c->topk % c->group_topk) return 0;
        if (c->topk / c->group_topk > c->num_experts / c->num_groups) return 0;
    }
    return 1;
}

/* Every combination from the brief; tol covers the f32 rounding of the outputs (the kernel
 * computes in double) or the last bits of exp in f64. */
static void forward_all(tm_dtype dt, double tol) {
    static const int Es[4] = {4, 8, 32, 128}, ks[4] = {1, 2, 4, 8};
    static const double scales[2] = {1.0, 1.2};
    /* modes: softmax-pre, softmax-pre + norm, softmax-post, sigmoid */
    const int T = 37;
    int ran = 0, skipped = 0;
    for (int ei = 0; ei < 4; ei++) {
        tm_ctx *ctx = tt_ctx();
        double *l = rand_logits(ctx, T, Es[ei], 100 + ei);
        for (int mode = 0; mode < 4; mode++)
            for (int grp = 0; grp < 2; grp++)
                for (int bias = 0; bias < 2; bias++)
                    for (int si = 0; si < 2; si++)
                        for (int ki = 0; ki < 4; ki++) {
                            tm_router_config cfg = tm_router_config_default();
                            cfg.num_experts = Es[ei];
                            cfg.topk = ks[ki];
                            cfg.score_function = mode == 3 ? TM_SCORE_SIGMOID : TM_SCORE_SOFTMAX;
                            cfg.use_pre_softmax = mode <= 1;
                            cfg.norm_topk_prob = mode == 1;
                            cfg.num_groups = grp ? 8 : 0;
                            cfg.group_topk = grp ? 4 : 0;
                            cfg.scaling_factor = scales[si];
                            if (!valid(&cfg)) {
                                skipped++;
                                continue;
                            }
                            ran += compare_one(ctx, dt, &cfg, l, T, bias, tol);
                            tm_ctx_arena_reset(ctx);
                        }
        free(l);
        tm_ctx_free(ctx);
    }
    /* Valid (E, k) pairs: 15 without groups (k = 8 > E = 4 is out); 5 with groups, which need
     * E % 8 == 0, k % 4 == 0 and k / 4 <= E / 8: (8,4), (32,4), (32,8), (128,4), (128,8).
     * Each runs 4 modes x 2 biases x 2 scalings. */
    cr_assert_eq(ran + skipped, 4 * 4 * 2 * 2 * 2 * 4);
    cr_assert_eq(ran, (15 + 5) * 16, "ran %d combos", ran);
}

Test(moe_router, forward_vs_reference_f64) { forward_all(TM_F64, 1e-12); }
Test(moe_router, forward_vs_reference_f32) { forward_all(TM_F32, 1e-6); }

/* ---- specific semantics --------------------------------------------------------------------- */

static void route(tm_ctx *ctx, const double *l, int T, int E, const double *bias, const tm_router_config *cfg,
                  tm_router_out *o) {
    int64_t ls[2] = {T, E}, bs[1] = {E};
    tm_tensor *lt = tt_from(ctx, TM_F64, 2, ls, l);
    tm_tensor *bt = bias ? tt_from(ctx, TM_F64, 1, bs, bias) : NULL;
    TT_OK(ctx, tm_moe_router(ctx, lt, bt, cfg, o));
}

static void read_idx(tm_ctx *ctx, const tm_router_out *o, int32_t *idx, int64_t n) {
    TT_OK(ctx, tm_tensor_read(ctx, o->topk_idx, TM_I32, idx, n));
}

Test(moe_router, ties_go_to_the_lowest_index) {
    tm_ctx *ctx = tt_ctx();
    tm_router_config cfg = tm_router_config_default();
    int32_t idx[8];
    /* all equal: experts 0..k-1, in index order, in every score function */
    double flat[6] = {0.3, 0.3, 0.3, 0.3, 0.3, 0.3};
    for (int mode = 0; mode < 3; mode++) {
        cfg.num_experts = 6, cfg.topk = 3;
        cfg.score_function = mode == 2 ? TM_SCORE_SIGMOID : TM_SCORE_SOFTMAX;
        cfg.use_pre_softmax = mode == 0;
        tm_router_out o;
        route(ctx, flat, 1, 6, NULL, &cfg, &o);
        read_idx(ctx, &o, idx, 3);
        for (int j = 0; j < 3; j++) cr_assert_eq(idx[j], j, "mode %d: idx[%d] = %d", mode, j, idx[j]);
    }
    /* a tie at the top and one across the k boundary: [1, 3, 0, 3, 2, 2] k = 3 -> 1, 3, 4 */
    double l2[6] = {1, 3, 0, 3, 2, 2};
    cfg = tm_router_config_default();
    cfg.num_experts = 6, cfg.topk = 3;
    tm_router_out o;
    route(ctx, l2, 1, 6, NULL, &cfg, &o);
    read_idx(ctx, &o, idx, 3);
    cr_assert(idx[0] == 1 && idx[1] == 3 && idx[2] == 4, "got %d %d %d", idx[0], idx[1], idx[2]);
    /* Tied groups: 4 groups of 2, keep 2, top-4 (2 per group, group score = sum of its two).
     * Softmax-post selects on the logits themselves, so the sums are exact:
     * groups 1, 2, 3 all score 5; groups 1 and 2 win; then 3, 4 (value 5, tied), then 2, 5
     * (value 0, tied). Without the group rule the top-4 is 3, 4, 6, 0 (1 ties 7: 0 wins). */
    double l3[8] = {1, 0, 0, 5, 5, 0, 4, 1};
    cfg = tm_router_config_default();
    cfg.num_experts = 8, cfg.topk = 4, cfg.use_pre_softmax = 0, cfg.num_groups = 4, cfg.group_topk = 2;
    route(ctx, l3, 1, 8, NULL, &cfg, &o);
    read_idx(ctx, &o, idx, 4);
    cr_assert(idx[0] == 3 && idx[1] == 4 && idx[2] == 2 && idx[3] == 5, "got %d %d %d %d", idx[0], idx[1], idx[2],
              idx[3]);
    double *w = tt_read(ctx, o.topk_weights);
    double z = 2 * exp(5.0) + 2;
    double want[4] = {exp(5.0) / z, exp(5.0) / z, 1 / z, 1 / z};
    cr_assert_leq(tt_close_ratio(w, want, 4, 1e-15, 1e-14), 1.0);
    free(w);
    cfg.num_groups = 0;
    route(ctx, l3, 1, 8, NULL, &cfg, &o);
    read_idx(ctx, &o, idx, 4);
    cr_assert(idx[0] == 3 && idx[1] == 4 && idx[2] == 6 && idx[3] == 0, "got %d %d %d %d", idx[0], idx[1], idx[2],
              idx[3]);
    tm_ctx_free(ctx);
}

Test(moe_router, sigmoid_bias_selects_but_weights_use_s) {
    /* Expert 0 has the lowest logit, but its bias puts it first; the weights are s / sum(s) over
     * the selection, never s + bias. */
    tm_ctx *ctx = tt_ctx();
    double l[5] = {-2.0, 0.5, 1.5, -0.3, 1.0}, b[5] = {3.0, 0, 0, 0, 0};
    tm_router_config cfg = tm_router_config_default();
    cfg.num_experts = 5, cfg.topk = 2, cfg.score_function = TM_SCORE_SIGMOID, cfg.scaling_factor = 1.2;
    tm_router_out o;
    route(ctx, l, 1, 5, b, &cfg, &o);
    int32_t idx[2];
    read_idx(ctx, &o, idx, 2);
    cr_assert(idx[0] == 0 && idx[1] == 2, "got %d %d", idx[0], idx[1]);
    double s0 = 1 / (1 + exp(2.0)), s2 = 1 / (1 + exp(-1.5));
    double want[2] = {1.2 * s0 / (s0 + s2 + 1e-20), 1.2 * s2 / (s0 + s2 + 1e-20)};
    double *w = tt_read(ctx, o.topk_weights), *p = tt_read(ctx, o.probs);
    cr_assert_leq(tt_close_ratio(w, want, 2, 1e-15, 1e-14), 1.0, "weights %g %g", w[0], w[1]);
    cr_assert(p[0] == w[0] && p[2] == w[1] && p[1] == 0 && p[3] == 0 && p[4] == 0);
    free(w), free(p);
    /* k = 1: no renormalisation, p = s */
    cfg.topk = 1;
    route(ctx, l, 1, 5, b, &cfg, &o);
    w = tt_read(ctx, o.topk_weights);
    cr_assert_leq(fabs(w[0] - 1.2 * s0), 1e-15);
    free(w);
    tm_ctx_free(ctx);
}

Test(moe_router, softmax_bias_moves_selection_only) {
    tm_ctx *ctx = tt_ctx();
    double l[4] = {0.2, 1.0, -0.5, 0.4}, b[4] = {0, 0, 1.0, 0};
    tm_router_config cfg = tm_router_config_default();
    cfg.num_experts = 4, cfg.topk = 1;
    tm_router_out o;
    route(ctx, l, 1, 4, b, &cfg, &o);
    int32_t idx[1];
    read_idx(ctx, &o, idx, 1);
    cr_assert_eq(idx[0], 2);
    double z = exp(0.2) + exp(1.0) + exp(-0.5) + exp(0.4);
    double *w = tt_read(ctx, o.topk_weights);
    cr_assert_leq(fabs(w[0] - exp(-0.5) / z), 1e-15, "weight %g", w[0]);
    free(w);
    tm_ctx_free(ctx);
}

Test(moe_router, empty_batch_and_bf16) {
    tm_ctx *ctx = tt_ctx();
    tm_router_config cfg = tm_router_config_default();
    int64_t ls[2] = {0, 8};
    tm_tensor *lt;
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 2, ls, tm_cpu(), &lt));
    tm_router_out o;
    TT_OK(ctx, tm_moe_router(ctx, lt, NULL, &cfg, &o));
    int64_t cnt[8];
    TT_OK(ctx, tm_tensor_read(ctx, o.tokens_per_expert, TM_I64, cnt, 8));
    for (int e = 0; e < 8; e++) cr_assert_eq(cnt[e], 0);
    /* bf16 logits: staged through f32; probs and weights come back in bf16 */
    int T = 9;
    double *l = rand_logits(ctx, T, 8, 5);
    ls[0] = T;
    lt = tt_from(ctx, TM_BF16, 2, ls, l);
    TT_OK(ctx, tm_moe_router(ctx, lt, NULL, &cfg, &o));
    cr_assert_eq(tm_tensor_dtype(o.probs), TM_BF16);
    double *lr = tt_read(ctx, lt), *w = tt_read(ctx, o.topk_weights);
    ref_out ref = ref_router(lr, NULL, T, &cfg);
    cr_assert_leq(tt_close_ratio(w, ref.w, T * 2, 1e-3, 4e-3), 1.0);
    ref_free(&ref);
    free(l), free(lr), free(w);
    tm_ctx_free(ctx);
}

/* ---- gradients ------------------------------------------------------------------------------ */

typedef struct router_case {
    tm_router_config cfg;
    int use_bias; /* in[1] is the expert bias */
} router_case;

/* concat(probs as [T*E], topk_weights as [T*k]): one output whose random cotangent reaches the
 * router through both of its differentiable outputs. */
static tm_status router_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    const router_case *rc = user;
    tm_router_out o;
    tm_status s = tm_moe_router(ctx, in[0], rc->use_bias ? in[1] : NULL, &rc->cfg, &o);
    if (s != TM_OK) return s;
    int64_t np = tm_tensor_numel(o.probs), nw = tm_tensor_numel(o.topk_weights);
    tm_tensor *parts[2];
    if ((s = tm_reshape(ctx, o.probs, 1, &np, &parts[0])) != TM_OK) return s;
    if ((s = tm_reshape(ctx, o.topk_weights, 1, &nw, &parts[1])) != TM_OK) return s;
    return tm_concat(ctx, 2, parts, 0, out);
}

/* [T, E] f64 logits whose selection (and group choice) cannot change under a 1e-6 step: each row
 * is a random permutation of the levels 0.37 * i plus noise below 0.05, so neighbouring scores
 * differ by >= 0.32 in logit. */
static tm_tensor *separated_logits(tm_ctx *ctx, int T, int E, uint64_t seed) {
    int64_t ls[2] = {T, E};
    double *noise = tt_read(ctx, tt_randu(ctx, TM_F64, 2, ls, seed, 0.0, 0.05));
    double *l = malloc(sizeof(double) * T * E);
    uint64_t st = seed;
    for (int t = 0; t < T; t++) {
        int *perm = malloc(sizeof(int) * E);
        for (int e = 0; e < E; e++) perm[e] = e;
        for (int e = E - 1; e > 0; e--) {
            int j = (int)(lcg(&st) % (uint64_t)(e + 1)), x = perm[e];
            perm[e] = perm[j], perm[j] = x;
        }
        for (int e = 0; e < E; e++) l[t * E + perm[e]] = 0.37 * e - 2.0 + noise[t * E + e];
        free(perm);
    }
    tm_tensor *lt = tt_from(ctx, TM_F64, 2, ls, l);
    free(noise), free(l);
    return lt;
}

static double router_gradcheck(tm_ctx *ctx, const tm_router_config *cfg, int use_bias, int T, uint64_t seed) {
    router_case rc = {*cfg, use_bias};
    int64_t bs[1] = {cfg->num_experts};
    tm_tensor *in[2] = {separated_logits(ctx, T, cfg->num_experts, seed), NULL};
    if (use_bias) {
        /* small against the 0.37 spacing of the sigmoid/softmax-post scores, so selection stays
         * separated; large enough to change it */
        in[1] = tt_randu(ctx, TM_F64, 1, bs, seed + 1, 0.0, 0.02);
    }
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, router_fn, &rc, use_bias ? 2 : 1, in, check, 1e-6, 1e-8, 1e-6);
}

/* The canonical case: softmax-pre with norm_topk_prob and scaling 1.2, E = 12, k = 3, T = 5. */
double tt_gradcase_moe_router(tm_ctx *ctx) {
    tm_router_config cfg = tm_router_config_default();
    cfg.num_experts = 12, cfg.topk = 3, cfg.norm_topk_prob = 1, cfg.scaling_factor = 1.2;
    return router_gradcheck(ctx, &cfg, 0, 5, 31);
}

Test(moe_router, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_router(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(moe_router, gradcheck_every_mode) {
    /* softmax-pre, softmax-pre + norm, softmax-post, sigmoid; x scaling {1, 1.2} x groups
     * {none, 4 groups keep 2} x bias {none, small}; k 4 on E 12 (3 per group), plus k 1. */
    for (int mode = 0; mode < 4; mode++)
        for (int si = 0; si < 2; si++)
            for (int grp = 0; grp < 2; grp++)
                for (int bias = 0; bias < 2; bias++)
                    for (int k1 = 0; k1 < 2; k1++) {
                        if (k1 && grp) continue;
                        tm_ctx *ctx = tt_ctx();
                        tm_router_config cfg = tm_router_config_default();
                        cfg.num_experts = 12, cfg.topk = k1 ? 1 : 4;
                        cfg.score_function = mode == 3 ? TM_SCORE_SIGMOID : TM_SCORE_SOFTMAX;
                        cfg.use_pre_softmax = mode <= 1;
                        cfg.norm_topk_prob = mode == 1;
                        cfg.scaling_factor = si ? 1.2 : 1.0;
                        cfg.num_groups = grp ? 4 : 0, cfg.group_topk = grp ? 2 : 0;
                        double r = router_gradcheck(ctx, &cfg, bias, 4, 40 + mode * 8 + si * 4 + grp * 2 + bias);
                        cr_assert_leq(r, 1.0, "mode %d scale %d groups %d bias %d k %d: ratio %g", mode, si, grp, bias,
                                      cfg.topk, r);
                        tm_ctx_free(ctx);
                    }
}

/* probs (f64, malloc'd) and d logits of sum(probs * gp) + sum(topk_weights * gw) with nthreads. */
static void router_run_threads(int nthreads, const tm_router_config *cfg, int T, const double *l, const double *b,
                               const double *gp, const double *gw, double **probs, double **dl) {
    tm_ctx *ctx = tt_ctx_threads(nthreads);
    int64_t ls[2] = {T, cfg->num_experts}, ws[2] = {T, cfg->topk}, bs[1] = {cfg->num_experts};
    tm_tensor *lt = tt_from(ctx, TM_F64, 2, ls, l), *bt = tt_from(ctx, TM_F64, 1, bs, b), *loss_p, *loss_w, *loss;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, lt, 1));
    tm_router_out o;
    TT_OK(ctx, tm_moe_router(ctx, lt, bt, cfg, &o));
    TT_OK(ctx, tm_mul(ctx, o.probs, tt_from(ctx, TM_F64, 2, ls, gp), &loss_p));
    TT_OK(ctx, tm_mul(ctx, o.topk_weights, tt_from(ctx, TM_F64, 2, ws, gw), &loss_w));
    TT_OK(ctx, tm_sum_all(ctx, loss_p, &loss_p));
    TT_OK(ctx, tm_sum_all(ctx, loss_w, &loss_w));
    TT_OK(ctx, tm_add(ctx, loss_p, loss_w, &loss));
    TT_OK(ctx, tm_backward(ctx, loss));
    *probs = tt_read(ctx, o.probs);
    *dl = tt_read(ctx, tm_tensor_grad(lt));
    tm_ctx_free(ctx);
}

Test(moe_router, parallel_rows_match_serial) {
    /* 300 x 64 takes the OpenMP path of both kernels; rows are independent, so the results must
     * be bit-identical for 1 and 3 threads, and the forward must match the reference. */
    const int T = 300, E = 64;
    tm_router_config cfg = tm_router_config_default();
    cfg.num_experts = E, cfg.topk = 8, cfg.score_function = TM_SCORE_SIGMOID, cfg.scaling_factor = 1.2;
    cfg.num_groups = 8, cfg.group_topk = 4;
    tm_ctx *ctx = tt_ctx();
    int64_t ps[2] = {T, E}, ws[2] = {T, 8};
    double *l = rand_logits(ctx, T, E, 77), *gp = tt_read(ctx, tt_randn(ctx, TM_F64, 2, ps, 78));
    double *gw = tt_read(ctx, tt_randn(ctx, TM_F64, 2, ws, 79)), b[64];
    tm_ctx_free(ctx);
    for (int e = 0; e < E; e++) b[e] = 0.1 * (E - 1 - e);
    double *p1, *d1, *p3, *d3;
    router_run_threads(1, &cfg, T, l, b, gp, gw, &p1, &d1);
    router_run_threads(3, &cfg, T, l, b, gp, gw, &p3, &d3);
    cr_assert(memcmp(p1, p3, sizeof(double) * T * E) == 0, "probs differ between 1 and 3 threads");
    cr_assert(memcmp(d1, d3, sizeof(double) * T * E) == 0, "d logits differ between 1 and 3 threads");
    ref_out ref = ref_router(l, b, T, &cfg);
    cr_assert_leq(tt_close_ratio(p3, ref.probs, (int64_t)T * E, 1e-12, 1e-12), 1.0);
    ref_free(&ref);
    free(l), free(gp), free(gw), free(p1), free(d1), free(p3), free(d3);
}

Test(moe_router, bias_gets_no_gradient) {
    tm_ctx *ctx = tt_ctx();
    int64_t ls[2] = {6, 8}, bs[1] = {8};
    tm_tensor *l = tt_randn(ctx, TM_F64, 2, ls, 3), *b = tt_randn(ctx, TM_F64, 1, bs, 4);
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, l, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, b, 1));
    tm_router_config cfg = tm_router_config_default();
    cfg.score_function = TM_SCORE_SIGMOID;
    tm_router_out o;
    TT_OK(ctx, tm_moe_router(ctx, l, b, &cfg, &o));
    TT_OK(ctx, tm_backward_with_grad(ctx, o.probs, tt_randn(ctx, TM_F64, 2, ls, 5)));
    cr_assert_not_null(tm_tensor_grad(l));
    if (tm_tensor_grad(b)) {
        double *g = tt_read(ctx, tm_tensor_grad(b));
        for (int e = 0; e < 8; e++) cr_assert_eq(g[e], 0.0);
        free(g);
    }
    tm_ctx_free(ctx);
}

/* ---- aux scores ----------------------------------------------------------------------------- */

static void aux_ref(double *out, const double *l, int T, int E, int sigm) {
    for (int t = 0; t < T; t++) {
        const double *r = l + t * E;
        double *o = out + t * E, z = 0;
        if (sigm) {
            for (int e = 0; e < E; e++) z += o[e] = 1 / (1 + exp(-r[e]));
            for (int e = 0; e < E; e++) o[e] /= z + 1e-20;
        } else {
            double mx = r[0];
            for (int e = 1; e < E; e++) mx = r[e] > mx ? r[e] : mx;
            for (int e = 0; e < E; e++) z += o[e] = exp(r[e] - mx);
            for (int e = 0; e < E; e++) o[e] /= z;
        }
    }
}

Test(moe_aux_scores, forward) {
    tm_ctx *ctx = tt_ctx();
    const int T = 37, E = 32;
    double *l = rand_logits(ctx, T, E, 9), *ref = malloc(sizeof(double) * T * E);
    int64_t ls[2] = {T, E};
    for (int sigm = 0; sigm < 2; sigm++)
        for (int d = 0; d < 2; d++) {
            tm_dtype dt = d ? TM_F32 : TM_F64;
            tm_tensor *lt = tt_from(ctx, dt, 2, ls, l), *y;
            double *lr = tt_read(ctx, lt);
            aux_ref(ref, lr, T, E, sigm);
            TT_OK(ctx, tm_moe_aux_scores(ctx, lt, sigm ? TM_SCORE_SIGMOID : TM_SCORE_SOFTMAX, &y));
            cr_assert_eq(tm_tensor_dtype(y), dt);
            tt_assert_close_host(ctx, y, ref, d ? 1e-7 : 1e-15, d ? 1e-6 : 1e-13);
            free(lr);
        }
    free(l), free(ref);
    tm_ctx_free(ctx);
}

static tm_status aux_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_moe_aux_scores(ctx, in[0], *(const tm_score_function *)user, out);
}

static double aux_gradcheck(tm_ctx *ctx, tm_score_function f) {
    int64_t ls[2] = {7, 11};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 2, ls, 17)};
    int check[1] = {1};
    return tt_gradcheck(ctx, aux_fn, &f, 1, in, check, 1e-6, 1e-8, 1e-6);
}

double tt_gradcase_moe_aux_scores(tm_ctx *ctx) { return aux_gradcheck(ctx, TM_SCORE_SIGMOID); }

Test(moe_aux_scores, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_aux_scores(ctx);
    cr_assert_leq(r, 1.0, "sigmoid ratio %g", r);
    r = aux_gradcheck(ctx, TM_SCORE_SOFTMAX);
    cr_assert_leq(r, 1.0, "softmax ratio %g", r);
    tm_ctx_free(ctx);
}

Test(moe_aux_scores, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t s3[3] = {2, 3, 4}, s2[2] = {3, 4};
    tm_tensor *y;
    assert_err(ctx, tm_moe_aux_scores(ctx, tt_randn(ctx, TM_F32, 3, s3, 1), TM_SCORE_SOFTMAX, &y), TM_ERR_SHAPE,
               "moe_aux_scores", "logits", "[2,3,4]");
    assert_err(ctx, tm_moe_aux_scores(ctx, tt_randint(ctx, TM_I32, 2, s2, 1, 4), TM_SCORE_SOFTMAX, &y), TM_ERR_DTYPE,
               "moe_aux_scores", "logits", "i32");
    assert_err(ctx, tm_moe_aux_scores(ctx, tt_randn(ctx, TM_F32, 2, s2, 1), (tm_score_function)7, &y),
               TM_ERR_INVALID_ARG, "moe_aux_scores", "score_function", "7");
    tm_ctx_free(ctx);
}

/* ---- bad configurations ----------------------------------------------------------------------- */

Test(moe_router, bad_config) {
    tm_ctx *ctx = tt_ctx();
    int64_t ls[2] = {5, 8};
    tm_tensor *l = tt_randn(ctx, TM_F32, 2, ls, 1);
    tm_router_out o;
    tm_router_config c;
#define BAD(field_edit, status, a, b)                                                  \
    do {                                                                               \
        c = tm_router_config_default();                                                \
        field_edit;                                                                    \
        assert_err(ctx, tm_moe_router(ctx, l, NULL, &c, &o), status, "moe_router", a, b); \
        cr_assert_null(o.probs);                                                       \
    } while (0)
    BAD(c.topk = 9, TM_ERR_INVALID_ARG, "topk = 9", "num_experts = 8");
    BAD(c.topk = 0, TM_ERR_INVALID_ARG, "topk = 0", NULL);
    BAD((c.num_groups = 3, c.group_topk = 1), TM_ERR_INVALID_ARG, "num_groups = 3", "num_experts = 8");
    BAD((c.num_groups = 4, c.group_topk = 5), TM_ERR_INVALID_ARG, "group_topk = 5", "num_groups = 4");
    BAD((c.num_groups = 4, c.group_topk = 0), TM_ERR_INVALID_ARG, "group_topk = 0", NULL);
    BAD((c.topk = 3, c.num_groups = 4, c.group_topk = 2), TM_ERR_INVALID_ARG, "topk = 3", "group_topk = 2");
    BAD((c.topk = 6, c.num_groups = 4, c.group_topk = 2), TM_ERR_INVALID_ARG, "topk / group_topk = 3", NULL);
    BAD(c.num_groups = -1, TM_ERR_INVALID_ARG, "num_groups = -1", NULL);
    BAD(c.scaling_factor = 0.0, TM_ERR_INVALID_ARG, "scaling_factor = 0", NULL);
    BAD(c.scaling_factor = -1.5, TM_ERR_INVALID_ARG, "scaling_factor = -1.5", NULL);
    BAD(c.score_function = (tm_score_function)5, TM_ERR_INVALID_ARG, "score_function = 5", NULL);
    BAD(c.num_experts = 6, TM_ERR_SHAPE, "num_experts = 6", "[5,8]");
    BAD(c.num_experts = 0, TM_ERR_INVALID_ARG, "num_experts = 0", NULL);
    BAD(c.force_load_balance = 2, TM_ERR_INVALID_ARG, "force_load_balance = 2", NULL);
    BAD(c.force_load_balance = -1, TM_ERR_INVALID_ARG, "force_load_balance = -1", NULL);
#undef BAD
    tm_router_config d = tm_router_config_default();
    int64_t s3[3] = {1, 5, 8}, bs[1] = {7};
    assert_err(ctx, tm_moe_router(ctx, tt_randn(ctx, TM_F32, 3, s3, 1), NULL, &d, &o), TM_ERR_SHAPE, "moe_router",
               "logits", "[1,5,8]");
    assert_err(ctx, tm_moe_router(ctx, tt_randint(ctx, TM_I64, 2, ls, 1, 3), NULL, &d, &o), TM_ERR_DTYPE,
               "moe_router", "logits", "i64");
    assert_err(ctx, tm_moe_router(ctx, l, tt_randn(ctx, TM_F32, 1, bs, 2), &d, &o), TM_ERR_SHAPE, "moe_router",
               "expert_bias", "[7]");
    assert_err(ctx, tm_moe_router(ctx, l, NULL, NULL, &o), TM_ERR_INVALID_ARG, "moe_router", "cfg", NULL);
    assert_err(ctx, tm_moe_router(ctx, l, NULL, &d, NULL), TM_ERR_INVALID_ARG, "moe_router", "out", NULL);
    tm_ctx_free(ctx);
}

/* ---- force_load_balance -------------------------------------------------------------------- */

/* The forced selection written out: row t, slot j -> (t k + j) % E (torchtitan's
 * arange(T k).reshape(T, k) % E). Kept apart from ref_router's copy so that the checks below
 * do not share a line with the comparison of every output. */
static int forced_expert(int t, int j, int k, int E) { return (t * k + j) % E; }

/* Every output against ref_router (its forced branch) over score functions, norm, groups, bias,
 * scaling, k and E, with the OpenMP path of the kernel once (T E >= 2^14). */
static void forced_all(tm_dtype dt, double tol) {
    static const int Es[4] = {4, 7, 8, 32}, ks[4] = {1, 2, 3, 8};
    int ran = 0;
    for (int ei = 0; ei < 4; ei++) {
        tm_ctx *ctx = tt_ctx_threads(ei == 3 ? 3 : 1);
        const int T = ei == 3 ? 600 : 37; /* 600 x 32: the kernel's parallel rows */
        double *l = rand_logits(ctx, T, Es[ei], 300 + ei);
        for (int mode = 0; mode < 4; mode++)
            for (int grp = 0; grp < 2; grp++)
                for (int bias = 0; bias < 2; bias++)
                    for (int ki = 0; ki < 4; ki++) {
                        tm_router_config cfg = tm_router_config_default();
                        cfg.num_experts = Es[ei];
                        cfg.topk = ks[ki];
                        cfg.score_function = mode == 3 ? TM_SCORE_SIGMOID : TM_SCORE_SOFTMAX;
                        cfg.use_pre_softmax = mode <= 1;
                        cfg.norm_topk_prob = mode == 1;
                        cfg.num_groups = grp ? 4 : 0;
                        cfg.group_topk = grp ? 2 : 0;
                        cfg.scaling_factor = bias ? 1.2 : 1.0;
                        cfg.force_load_balance = 1;
                        if (!valid(&cfg)) continue;
                        ran += compare_one(ctx, dt, &cfg, l, T, bias, tol);
                        tm_ctx_arena_reset(ctx);
                    }
        free(l);
        tm_ctx_free(ctx);
    }
    /* (E, k) without groups: 2 of the 16 pairs have k > E ((4,8), (7,8)): 14 valid; with 4
     * groups keep 2 (E % 4 == 0, k even, k / 2 <= E / 4): (4,2), (8,2), (32,2), (32,8): 4.
     * Each x 4 modes x 2 biases. */
    cr_assert_eq(ran, (14 + 4) * 8, "ran %d combos", ran);
}

Test(moe_router, forced_vs_reference_f64) { forced_all(TM_F64, 1e-12); }
Test(moe_router, forced_vs_reference_f32) { forced_all(TM_F32, 1e-6); }

/* The selection is the formula whatever the scores: logits that make expert 0 everyone's
 * first choice, a bias that makes expert E-1 everyone's first choice, groups that would keep
 * only some experts. And the data tell the formula from its near misses (a mutation check):
 * each wrong formula below disagrees with the output somewhere, so an implementation of it
 * would fail the first assertion. */
Test(moe_router, forced_selection_is_the_round_robin) {
    const int T = 23, E = 6, k = 3;
    tm_ctx *ctx = tt_ctx();
    double *l = rand_logits(ctx, T, E, 17), b[6] = {0, 0, 0, 0, 0, 50.0};
    for (int t = 0; t < T; t++) l[t * E] = 40.0;
    int32_t idx[23 * 3], scored[23 * 3];
    for (int variant = 0; variant < 4; variant++) {
        tm_router_config cfg = tm_router_config_default();
        cfg.num_experts = E, cfg.topk = k, cfg.force_load_balance = 1;
        if (variant == 1) cfg.score_function = TM_SCORE_SIGMOID;
        if (variant == 2) cfg.num_groups = 2, cfg.group_topk = 1, cfg.use_pre_softmax = 0;
        if (variant == 3) cfg.use_pre_softmax = 0, cfg.norm_topk_prob = 1;
        tm_router_out o;
        route(ctx, l, T, E, variant == 1 || variant == 3 ? b : NULL, &cfg, &o);
        read_idx(ctx, &o, idx, T * k);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++)
                cr_assert_eq(idx[t * k + j], forced_expert(t, j, k, E), "variant %d: topk_idx[%d][%d] = %d, want %d",
                             variant, t, j, idx[t * k + j], forced_expert(t, j, k, E));
    }
    /* near misses: a row's own index, an offset, the transposed arange, and the score-based
     * routing of the same logits */
    tm_router_config cfg = tm_router_config_default();
    cfg.num_experts = E, cfg.topk = k;
    tm_router_out o;
    route(ctx, l, T, E, NULL, &cfg, &o);
    read_idx(ctx, &o, scored, T * k);
    for (int m = 0; m < 4; m++) {
        int differs = 0;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++) {
                int wrong = m == 0 ? (t + j) % E : m == 1 ? (t * k + j + 1) % E : m == 2 ? (j * T + t) % E : scored[t * k + j];
                differs |= wrong != idx[t * k + j];
            }
        cr_assert(differs, "near miss %d of the formula gives the same selection: the test could not tell them apart", m);
    }
    free(l);
    tm_ctx_free(ctx);
}

/* tokens_per_expert is T k / E for every expert when T k % E == 0, and within one of it
 * otherwise; routing_map has k ones per row at the formula's experts. */
Test(moe_router, forced_counts_are_balanced) {
    static const int cases[][3] = {{24, 8, 2}, {16, 6, 3}, {5, 4, 4}, {12, 16, 4}, {320, 64, 8}, {37, 8, 2}, {9, 7, 3}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int T = cases[c][0], E = cases[c][1], k = cases[c][2];
        tm_ctx *ctx = tt_ctx_threads(3); /* 320 x 64 takes the parallel rows */
        double *l = rand_logits(ctx, T, E, 50 + c);
        tm_router_config cfg = tm_router_config_default();
        cfg.num_experts = E, cfg.topk = k, cfg.force_load_balance = 1;
        tm_router_out o;
        route(ctx, l, T, E, NULL, &cfg, &o);
        int64_t *cnt = malloc(sizeof(int64_t) * E), sum = 0;
        unsigned char *map = malloc((size_t)T * E);
        TT_OK(ctx, tm_tensor_read(ctx, o.tokens_per_expert, TM_I64, cnt, E));
        TT_OK(ctx, tm_tensor_read(ctx, o.routing_map, TM_U8, map, (int64_t)T * E));
        for (int e = 0; e < E; e++) {
            sum += cnt[e];
            if ((T * k) % E == 0)
                cr_assert_eq(cnt[e], T * k / E, "T %d E %d k %d: tokens_per_expert[%d] = %lld, want %d", T, E, k, e,
                             (long long)cnt[e], T * k / E);
            else
                cr_assert(cnt[e] == T * k / E || cnt[e] == T * k / E + 1, "T %d E %d k %d: tokens_per_expert[%d] = %lld",
                          T, E, k, e, (long long)cnt[e]);
        }
        cr_assert_eq(sum, (int64_t)T * k);
        for (int t = 0; t < T; t++) {
            int ones = 0;
            for (int e = 0; e < E; e++) ones += map[t * E + e];
            cr_assert_eq(ones, k, "row %d has %d routed experts", t, ones);
            for (int j = 0; j < k; j++) cr_assert_eq(map[t * E + forced_expert(t, j, k, E)], 1, "row %d slot %d", t, j);
        }
        free(cnt), free(map), free(l);
        tm_ctx_free(ctx);
    }
}

/* The weights from the logits, by hand, for each score function: T 2, E 4, k 2 forces row 0
 * onto experts 0, 1 and row 1 onto experts 2, 3 (neither row's own top 2). */
Test(moe_router, forced_weights_of_every_score_function) {
    const double l[8] = {0.1, -0.3, 2.0, 0.5, /* */ 1.5, 0.2, -1.0, 0.7};
    const int sel[2][2] = {{0, 1}, {2, 3}};
    tm_ctx *ctx = tt_ctx();
    for (int mode = 0; mode < 4; mode++) {
        tm_router_config cfg = tm_router_config_default();
        cfg.num_experts = 4, cfg.topk = 2, cfg.force_load_balance = 1, cfg.scaling_factor = 1.5;
        cfg.score_function = mode == 3 ? TM_SCORE_SIGMOID : TM_SCORE_SOFTMAX;
        cfg.use_pre_softmax = mode <= 1;
        cfg.norm_topk_prob = mode == 1;
        double want[2][2];
        for (int t = 0; t < 2; t++) {
            const double *r = l + 4 * t, a = r[sel[t][0]], b = r[sel[t][1]];
            const double z = exp(r[0]) + exp(r[1]) + exp(r[2]) + exp(r[3]);
            if (mode == 0) want[t][0] = exp(a) / z, want[t][1] = exp(b) / z;      /* softmax over E, gathered */
            if (mode == 1) want[t][0] = exp(a) / (exp(a) + exp(b)), want[t][1] = exp(b) / (exp(a) + exp(b));
            if (mode == 2) want[t][0] = 1 / (1 + exp(b - a)), want[t][1] = 1 / (1 + exp(a - b)); /* softmax of 2 */
            if (mode == 3) {
                const double sa = 1 / (1 + exp(-a)), sb = 1 / (1 + exp(-b));
                want[t][0] = sa / (sa + sb + 1e-20), want[t][1] = sb / (sa + sb + 1e-20);
            }
            want[t][0] *= 1.5, want[t][1] *= 1.5;
        }
        tm_router_out o;
        route(ctx, l, 2, 4, NULL, &cfg, &o);
        double *w = tt_read(ctx, o.topk_weights), *p = tt_read(ctx, o.probs);
        for (int t = 0; t < 2; t++)
            for (int j = 0; j < 2; j++) {
                cr_assert_leq(fabs(w[2 * t + j] - want[t][j]), 1e-14, "mode %d row %d slot %d: weight %.17g, want %.17g",
                              mode, t, j, w[2 * t + j], want[t][j]);
                cr_assert_eq(p[4 * t + sel[t][j]], w[2 * t + j], "mode %d: probs at the selection", mode);
                cr_assert_eq(p[4 * t + sel[1 - t][j]], 0.0, "mode %d: probs off the selection", mode);
            }
        free(w), free(p);
    }
    tm_ctx_free(ctx);
}

/* Forced routing's canonical gradient case (also broken on purpose in tests/test_mutation.c):
 * sigmoid, k 3 on E 12, T 5 (each row's experts are not its best three), scaling 1.2. */
double tt_gradcase_moe_router_forced(tm_ctx *ctx) {
    tm_router_config cfg = tm_router_config_default();
    cfg.num_experts = 12, cfg.topk = 3, cfg.score_function = TM_SCORE_SIGMOID, cfg.scaling_factor = 1.2;
    cfg.force_load_balance = 1;
    return router_gradcheck(ctx, &cfg, 0, 5, 61);
}

Test(moe_router, forced_gradcheck_every_mode) {
    /* the gradient of the normal computation at the forced selection, by finite differences:
     * 4 modes x groups x bias x k {4, 1} */
    for (int mode = 0; mode < 4; mode++)
        for (int grp = 0; grp < 2; grp++)
            for (int bias = 0; bias < 2; bias++)
                for (int k1 = 0; k1 < 2; k1++) {
                    if (k1 && grp) continue;
                    tm_ctx *ctx = tt_ctx();
                    tm_router_config cfg = tm_router_config_default();
                    cfg.num_experts = 12, cfg.topk = k1 ? 1 : 4, cfg.force_load_balance = 1;
                    cfg.score_function = mode == 3 ? TM_SCORE_SIGMOID : TM_SCORE_SOFTMAX;
                    cfg.use_pre_softmax = mode <= 1;
                    cfg.norm_topk_prob = mode == 1;
                    cfg.scaling_factor = 1.2;
                    cfg.num_groups = grp ? 4 : 0, cfg.group_topk = grp ? 2 : 0;
                    double r = router_gradcheck(ctx, &cfg, bias, 5, 70 + mode * 8 + grp * 4 + bias * 2 + k1);
                    cr_assert_leq(r, 1.0, "mode %d groups %d bias %d k %d: ratio %g", mode, grp, bias, cfg.topk, r);
                    tm_ctx_free(ctx);
                }
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_router_forced(ctx);
    cr_assert_leq(r, 1.0, "canonical forced case: ratio %g", r);
    tm_ctx_free(ctx);
}

/* ---- aux counts: Megatron's clean top-k --------------------------------------------------------- */

/* The reference of tm_moe_aux_counts, by rank counting rather than sorting or selecting (it
 * shares nothing with the library's top-k or with ref_sort): expert e of row t is routed iff
 * fewer than k experts beat it, where f beats e when its logit is larger, or equal with a lower
 * index (the documented tie rule). */
static void ref_clean(const double *l, int T, int E, int k, unsigned char *map, int64_t *counts) {
    for (int e = 0; e < E; e++) counts[e] = 0;
    for (int t = 0; t < T; t++) {
        const double *r = l + (size_t)t * E;
        for (int e = 0; e < E; e++) {
            int beaten = 0;
            for (int f = 0; f < E; f++) beaten += r[f] > r[e] || (r[f] == r[e] && f < e);
            map[(size_t)t * E + e] = beaten < k;
            counts[e] += beaten < k;
        }
    }
}

/* tm_moe_aux_counts on lt against ref_clean of the values lt holds (rounded to its dtype). */
static void check_clean(tm_ctx *ctx, tm_tensor *lt, int k, const char *what) {
    const int T = (int)tm_tensor_dim(lt, 0), E = (int)tm_tensor_dim(lt, 1);
    double *l = tt_read(ctx, lt);
    unsigned char *want_map = malloc((size_t)T * E + 1), *map = malloc((size_t)T * E + 1);
    int64_t *want = malloc(sizeof(int64_t) * E), *cnt = malloc(sizeof(int64_t) * E);
    ref_clean(l, T, E, k, want_map, want);
    tm_tensor *rm, *tpe;
    TT_OK(ctx, tm_moe_aux_counts(ctx, lt, k, &rm, &tpe));
    cr_assert_eq(tm_tensor_dtype(rm), TM_U8, "%s", what);
    cr_assert_eq(tm_tensor_dtype(tpe), TM_I64, "%s", what);
    cr_assert(tm_tensor_ndim(rm) == 2 && tm_tensor_dim(rm, 0) == T && tm_tensor_dim(rm, 1) == E, "%s", what);
    cr_assert(tm_tensor_ndim(tpe) == 1 && tm_tensor_dim(tpe, 0) == E, "%s", what);
    TT_OK(ctx, tm_tensor_read(ctx, rm, TM_U8, map, (int64_t)T * E));
    TT_OK(ctx, tm_tensor_read(ctx, tpe, TM_I64, cnt, E));
    int64_t sum = 0;
    for (int i = 0; i < T * E; i++)
        cr_assert_eq(map[i], want_map[i], "%s: routing_map[%d, %d] = %d, want %d (k %d)", what, i / E, i % E, map[i],
                     want_map[i], k);
    for (int e = 0; e < E; e++) {
        cr_assert_eq(cnt[e], want[e], "%s: tokens_per_expert[%d] = %lld, want %lld (k %d)", what, e,
                     (long long)cnt[e], (long long)want[e], k);
        sum += cnt[e];
    }
    cr_assert_eq(sum, (int64_t)T * k, "%s: counts sum to T * k", what);
    free(l), free(want_map), free(map), free(want), free(cnt);
}

Test(moe_aux_counts, matches_an_independent_topk) {
    static const int Es[4] = {1, 4, 8, 32}, ks[4] = {1, 2, 4, 32};
    static const tm_dtype dts[3] = {TM_F64, TM_F32, TM_BF16};
    const int T = 37;
    tm_ctx *ctx = tt_ctx();
    int ran = 0;
    for (int ei = 0; ei < 4; ei++) {
        const int E = Es[ei];
        double *l = rand_logits(ctx, T, E, 40 + ei), *coarse = malloc(sizeof(double) * T * E);
        /* Logits on a grid of 0.5: many ties, inside a row and across the k boundary. */
        for (int i = 0; i < T * E; i++) coarse[i] = round(2.0 * l[i]) / 2.0;
        int64_t ls[2] = {T, E};
        for (int di = 0; di < 3; di++)
            for (int ki = 0; ki < 4; ki++) {
                if (ks[ki] > E) continue;
                char what[96];
                snprintf(what, sizeof what, "%s logits E %d", tm_dtype_name(dts[di]), E);
                check_clean(ctx, tt_from(ctx, dts[di], 2, ls, l), ks[ki], what);
                snprintf(what, sizeof what, "%s tied logits E %d", tm_dtype_name(dts[di]), E);
                check_clean(ctx, tt_from(ctx, dts[di], 2, ls, coarse), ks[ki], what);
                ran++;
                tm_ctx_arena_reset(ctx);
            }
        free(l), free(coarse);
    }
    cr_assert_eq(ran, 3 * (1 + 3 + 3 + 4), "ran %d", ran); /* (E, k) pairs with k <= E, per dtype */
    tm_ctx_free(ctx);
}

/* Routed experts of row t, in index order. */
static int routed_of(tm_ctx *ctx, tm_tensor *map, int t, int E, int *out) {
    int64_t n_all = tm_tensor_numel(map);
    unsigned char *m = malloc((size_t)n_all);
    TT_OK(ctx, tm_tensor_read(ctx, map, TM_U8, m, n_all));
    int n = 0;
    for (int e = 0; e < E; e++)
        if (m[(size_t)t * E + e]) out[n++] = e;
    free(m);
    return n;
}

Test(moe_aux_counts, ties_go_to_the_lowest_index_and_rounding_makes_none) {
    tm_ctx *ctx = tt_ctx();
    /* Row 0: all equal -> the first k. Row 1: a tie at the top and one across the boundary:
     * [1, 3, 0, 3, 2, 2], k = 3 -> 1, 3, 4. */
    double l[12] = {0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 1, 3, 0, 3, 2, 2};
    int64_t ls[2] = {2, 6};
    tm_tensor *rm, *tpe;
    TT_OK(ctx, tm_moe_aux_counts(ctx, tt_from(ctx, TM_F64, 2, ls, l), 3, &rm, &tpe));
    int got[6], n = routed_of(ctx, rm, 0, 6, got);
    cr_assert(n == 3 && got[0] == 0 && got[1] == 1 && got[2] == 2, "row 0: %d routed", n);
    n = routed_of(ctx, rm, 1, 6, got);
    cr_assert(n == 3 && got[0] == 1 && got[1] == 3 && got[2] == 4, "row 1: %d routed", n);
    int64_t cnt[6];
    TT_OK(ctx, tm_tensor_read(ctx, tpe, TM_I64, cnt, 6));
    const int64_t want[6] = {1, 2, 1, 1, 1, 0};
    for (int e = 0; e < 6; e++) cr_assert_eq(cnt[e], want[e], "tokens_per_expert[%d] = %lld", e, (long long)cnt[e]);

    /* Scores that round to equal values where the logits differ. Row 0: softmax underflows,
     * exp(-2000) and exp(-1000) are both 0, so softmax ties experts 0 and 2; the logits put 2
     * first. Row 1: sigmoid saturates, sigmoid(40) = sigmoid(45) = sigmoid(50) = 1 in f64, so
     * s / sum(s) ties experts 0, 1 and 2; the logits put 1 and 2 first. */
    double r[8] = {-2000, 0, -1000, -3000, 40, 50, 45, 0};
    int64_t rs[2] = {2, 4};
    tm_tensor *rl = tt_from(ctx, TM_F64, 2, rs, r), *soft, *sig;
    TT_OK(ctx, tm_moe_aux_scores(ctx, rl, TM_SCORE_SOFTMAX, &soft));
    TT_OK(ctx, tm_moe_aux_scores(ctx, rl, TM_SCORE_SIGMOID, &sig));
    double *ps = tt_read(ctx, soft), *pg = tt_read(ctx, sig);
    cr_assert(ps[0] == ps[2], "softmax scores %g %g do not tie: the case tests nothing", ps[0], ps[2]);
    cr_assert(pg[4] == pg[5] && pg[5] == pg[6], "sigmoid scores %g %g %g do not tie", pg[4], pg[5], pg[6]);
    free(ps), free(pg);
    TT_OK(ctx, tm_moe_aux_counts(ctx, rl, 2, &rm, &tpe));
    n = routed_of(ctx, rm, 0, 4, got);
    cr_assert(n == 2 && got[0] == 1 && got[1] == 2, "underflow row: got %d, %d", got[0], got[1]);
    n = routed_of(ctx, rm, 1, 4, got);
    cr_assert(n == 2 && got[0] == 1 && got[1] == 2, "saturated row: got %d, %d", got[0], got[1]);
    tm_ctx_free(ctx);
}

/* Away from rounding ties the clean map is the top-k of tm_moe_aux_scores, for either score
 * function: softmax and s / sum(s) keep the order of a row's logits. */
Test(moe_aux_counts, equals_the_topk_of_the_aux_scores) {
    tm_ctx *ctx = tt_ctx();
    const int T = 29, E = 16, k = 4;
    double *l = rand_logits(ctx, T, E, 77);
    int64_t ls[2] = {T, E};
    tm_tensor *lt = tt_from(ctx, TM_F64, 2, ls, l), *rm, *tpe;
    TT_OK(ctx, tm_moe_aux_counts(ctx, lt, k, &rm, &tpe));
    unsigned char *map = malloc((size_t)T * E), *want = malloc((size_t)T * E);
    int64_t cnt[16];
    TT_OK(ctx, tm_tensor_read(ctx, rm, TM_U8, map, (int64_t)T * E));
    for (int f = 0; f < 2; f++) {
        tm_tensor *scores;
        TT_OK(ctx, tm_moe_aux_scores(ctx, lt, f ? TM_SCORE_SIGMOID : TM_SCORE_SOFTMAX, &scores));
        double *s = tt_read(ctx, scores);
        ref_clean(s, T, E, k, want, cnt);
        for (int i = 0; i < T * E; i++) cr_assert_eq(map[i], want[i], "score function %d, [%d, %d]", f, i / E, i % E);
        free(s);
    }
    free(l), free(map), free(want);
    tm_ctx_free(ctx);
}

Test(moe_aux_counts, never_on_the_tape_and_empty_batch) {
    tm_ctx *ctx = tt_ctx();
    int64_t ls[2] = {5, 6};
    tm_tensor *lt = tt_randn(ctx, TM_F64, 2, ls, 3), *rm, *tpe;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, lt, 1));
    for (int mode = 1; mode >= 0; mode--) {
        tm_ctx_set_grad_enabled(ctx, mode);
        TT_OK(ctx, tm_moe_aux_counts(ctx, lt, 2, &rm, &tpe));
        cr_assert_eq(tm_ctx_set_grad_enabled(ctx, 1), mode, "grad mode %d not restored", mode);
        cr_assert(!tm_tensor_requires_grad(rm) && !tm_tensor_requires_grad(tpe));
    }
    /* The gradient of a loss through the aux scores is that of constant counts: the clean
     * selection adds nothing to the graph. */
    tm_tensor *scores, *aux;
    TT_OK(ctx, tm_moe_aux_scores(ctx, lt, TM_SCORE_SOFTMAX, &scores));
    TT_OK(ctx, tm_moe_aux_counts(ctx, lt, 2, &rm, &tpe));
    TT_OK(ctx, tm_moe_aux_loss(ctx, scores, tpe, 2, 1.0, 0, &aux));
    TT_OK(ctx, tm_backward(ctx, aux));
    cr_assert_not_null(tm_tensor_grad(lt));
    /* T = 0: every count is 0. */
    int64_t es[2] = {0, 4};
    tm_tensor *empty;
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 2, es, tm_cpu(), &empty));
    TT_OK(ctx, tm_moe_aux_counts(ctx, empty, 3, &rm, &tpe));
    int64_t cnt[4];
    TT_OK(ctx, tm_tensor_read(ctx, tpe, TM_I64, cnt, 4));
    for (int e = 0; e < 4; e++) cr_assert_eq(cnt[e], 0);
    cr_assert_eq(tm_tensor_dim(rm, 0), 0);
    tm_ctx_free(ctx);
}

Test(moe_aux_counts, bad_inputs) {
    tm_ctx *ctx = tt_ctx(), *other = tt_ctx();
    int64_t ls[2] = {5, 8}, s3[3] = {1, 5, 8}, s0[2] = {5, 0};
    tm_tensor *l = tt_randn(ctx, TM_F32, 2, ls, 1);
    static char sentinel[2]; /* outputs must stay unwritten on failure */
    tm_tensor *const rm0 = (tm_tensor *)&sentinel[0], *const tpe0 = (tm_tensor *)&sentinel[1];
    tm_tensor *rm = rm0, *tpe = tpe0;
    assert_err(ctx, tm_moe_aux_counts(ctx, l, 0, &rm, &tpe), TM_ERR_INVALID_ARG, "moe_aux_counts", "topk = 0", "[5,8]");
    assert_err(ctx, tm_moe_aux_counts(ctx, l, 9, &rm, &tpe), TM_ERR_INVALID_ARG, "moe_aux_counts", "topk = 9",
               "E = 8");
    assert_err(ctx, tm_moe_aux_counts(ctx, tt_randn(ctx, TM_F32, 3, s3, 1), 2, &rm, &tpe), TM_ERR_SHAPE,
               "moe_aux_counts", "logits", "[1,5,8]");
    tm_tensor *z;
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 2, s0, tm_cpu(), &z));
    assert_err(ctx, tm_moe_aux_counts(ctx, z, 1, &rm, &tpe), TM_ERR_SHAPE, "moe_aux_counts", "logits", "[5,0]");
    assert_err(ctx, tm_moe_aux_counts(ctx, tt_randint(ctx, TM_I32, 2, ls, 1, 4), 2, &rm, &tpe), TM_ERR_DTYPE,
               "moe_aux_counts", "logits", "i32");
    assert_err(ctx, tm_moe_aux_counts(ctx, NULL, 2, &rm, &tpe), TM_ERR_INVALID_ARG, "moe_aux_counts", "logits", NULL);
    assert_err(ctx, tm_moe_aux_counts(ctx, l, 2, NULL, &tpe), TM_ERR_INVALID_ARG, "moe_aux_counts", "routing_map",
               NULL);
    assert_err(ctx, tm_moe_aux_counts(ctx, l, 2, &rm, NULL), TM_ERR_INVALID_ARG, "moe_aux_counts",
               "tokens_per_expert", NULL);
    assert_err(ctx, tm_moe_aux_counts(ctx, tt_randn(other, TM_F32, 2, ls, 1), 2, &rm, &tpe), TM_ERR_INVALID_ARG,
               "moe_aux_counts", "another context", NULL);
    cr_assert(rm == rm0 && tpe == tpe0, "an output was written on failure");
    cr_assert_eq(tm_moe_aux_counts(NULL, l, 2, &rm, &tpe), TM_ERR_INVALID_ARG);
    tm_ctx_free(other);
    tm_ctx_free(ctx);
}
