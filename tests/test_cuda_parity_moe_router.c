/*
 * test_cuda_parity_moe_router.c — the CUDA router ops against the CPU ops, forward (every
 * output) and backward: moe_router, moe_aux_scores, moe_drop_tokens, and the device-side
 * statistics moe_accumulate_counts and moe_expert_bias_update. Also: none of them reads
 * anything back to the host (tm_ctx_sync_count does not move).
 *
 * Tolerances (|cuda - cpu| <= atol + rtol * |cpu|) for float outputs and gradients:
 *   f32   atol 1e-5, rtol 1e-5: the CUDA router computes in f32, the CPU in f64 and rounds once.
 *   bf16  atol 1e-2, rtol 1e-2: the same bf16 inputs; CUDA rounds its f32 results to bf16, the CPU
 *         its f64 results through f32, so a value near a rounding boundary may land one bf16
 *         step (2^-8 relative) away.
 * force_load_balance rows route round robin on both backends (integer arithmetic: exact).
 * Selections are compared exactly: routing_map, topk_idx, tokens_per_expert, map_kept, the
 * kept counts and dropped, and the expert bias after its update (bit for bit: both compute it
 * in f64 and round once).
 *
 * Test data: logits on a grid of 1/8 in [-2, 2] (exact in bf16), so rows are full of equal
 * values and the tie rule (lowest index) is exercised everywhere, while unequal values stay far
 * apart in f32 (a grid step changes a softmax or sigmoid score by over 1%). The CPU computes in
 * f64 and CUDA in f32, so only ties that come from equal inputs are ties on both: biases are
 * whole numbers (s + bias of unequal scores never ties, the scores being in (0, 1)), and a
 * group's score is a sum of several values only with softmax-post selection (sums of grid
 * values, exact in f32 and f64); with softmax-pre or sigmoid groups keep one expert each (the
 * group score is a single value).
 * Every test skips when no CUDA device is visible.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"
#include "parity.h"

TT_PARITY_COVERS("moe_router")
TT_PARITY_COVERS("moe_aux_scores")
TT_PARITY_COVERS("moe_drop_tokens")
TT_PARITY_COVERS("moe_accumulate_counts")
TT_PARITY_COVERS("moe_expert_bias_update")

#define ATOL_F32 1e-5
#define RTOL_F32 1e-5
#define ATOL_BF16 1e-2
#define RTOL_BF16 1e-2

static double atol_of(tm_dtype dt) { return dt == TM_BF16 ? ATOL_BF16 : ATOL_F32; }
static double rtol_of(tm_dtype dt) { return dt == TM_BF16 ? RTOL_BF16 : RTOL_F32; }

/* ---- helpers ---------------------------------------------------------------------------------- */

/* n values on the grid j / 8, j in [-16, 16] (deterministic in seed; free()). */
static double *grid_values(int64_t n, uint64_t seed) {
    double *v = tt_parity_uniform(n, seed);
    for (int64_t i = 0; i < n; i++) v[i] = round(v[i] * 8.0) / 8.0;
    return v;
}

static void assert_close(tm_ctx *ctx, const tm_tensor *gpu, const tm_tensor *cpu, double atol, double rtol,
                         const char *what, const char *name) {
    cr_assert_eq(tm_tensor_device(gpu).type, TM_DEVICE_CUDA, "%s: %s not on CUDA", name, what);
    cr_assert_eq(tm_tensor_numel(gpu), tm_tensor_numel(cpu), "%s: %s sizes differ", name, what);
    cr_assert_eq(tm_tensor_dtype(gpu), tm_tensor_dtype(cpu), "%s: %s dtypes differ", name, what);
    double *a = tt_read(ctx, gpu), *b = tt_read(ctx, cpu);
    double r = tt_close_ratio(a, b, tm_tensor_numel(cpu), atol, rtol);
    int64_t worst = -1;
    if (!(r <= 1.0))
        for (int64_t i = 0; i < tm_tensor_numel(cpu) && worst < 0; i++)
            if (!(fabs(a[i] - b[i]) <= atol + rtol * fabs(b[i]))) worst = i;
    double aw = worst >= 0 ? a[worst] : 0, bw = worst >= 0 ? b[worst] : 0;
    free(a), free(b);
    cr_assert(r <= 1.0, "%s: %s differs (ratio %g; first at %lld: cuda %.9g, cpu %.9g)", name, what, r,
              (long long)worst, aw, bw);
}

static void assert_equal(tm_ctx *ctx, const tm_tensor *gpu, const tm_tensor *cpu, const char *what, const char *name) {
    cr_assert_eq(tm_tensor_device(gpu).type, TM_DEVICE_CUDA, "%s: %s not on CUDA", name, what);
    cr_assert_eq(tm_tensor_numel(gpu), tm_tensor_numel(cpu), "%s: %s sizes differ", name, what);
    cr_assert_eq(tm_tensor_dtype(gpu), tm_tensor_dtype(cpu), "%s: %s dtypes differ", name, what);
    int64_t n = tm_tensor_numel(cpu);
    double *a = tt_read(ctx, gpu), *b = tt_read(ctx, cpu);
    for (int64_t i = 0; i < n; i++)
        if (a[i] != b[i]) {
            double ai = a[i], bi = b[i];
            free(a), free(b);
            cr_assert_fail("%s: %s[%lld]: cuda %.17g, cpu %.17g", name, what, (long long)i, ai, bi);
        }
    free(a), free(b);
}

/* ---- moe_router ------------------------------------------------------------------------------- */

typedef struct rcase {
    const char *name;
    int T, E, k;
    tm_score_function score;
    int pre, groups, group_topk, norm, bias;
    double scaling;
    int force; /* force_load_balance */
} rcase;

/* Rows 1 and 2 repeat row 0 (identical rows); row 3 is constant (every expert ties). */
static double *router_logits(const rcase *rc) {
    int64_t T = rc->T, E = rc->E;
    double *l = grid_values(T * E, 4000 + (uint64_t)(T * 131 + E * 7 + rc->k));
    for (int64_t t = 1; t < 3 && t < T; t++) memcpy(l + t * E, l, sizeof(double) * (size_t)E);
    if (T > 3)
        for (int64_t e = 0; e < E; e++) l[3 * E + e] = 0.25;
    return l;
}

typedef struct rside {
    tm_tensor *logits;
    tm_router_out out;
} rside;

/* Forward, then backward of sum(probs * gp) + sum(topk_weights * gw): the router receives
 * random upstream gradients on both float outputs. */
static void router_side(tm_ctx *ctx, const rcase *rc, const tm_router_config *cfg, tm_dtype dt, tm_device dev,
                        const double *hl, const double *hb, const double *hgp, const double *hgw, rside *sd) {
    int64_t te[2] = {rc->T, rc->E}, tk[2] = {rc->T, rc->k}, E = rc->E;
    tm_tensor *bias = NULL, *gp, *gw, *a, *b, *sa, *sb, *loss;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, te, dev, TM_F64, hl, &sd->logits));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, sd->logits, 1));
    /* a bf16 run also takes its bias in bf16 (the kernel's second load path) */
    if (rc->bias) TT_OK(ctx, tm_tensor_from_host(ctx, dt == TM_BF16 ? TM_BF16 : TM_F32, 1, &E, dev, TM_F64, hb, &bias));
    TT_OK(ctx, tm_moe_router(ctx, sd->logits, bias, cfg, &sd->out));
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, te, dev, TM_F64, hgp, &gp));
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, tk, dev, TM_F64, hgw, &gw));
    if (rc->T == 0) { /* no rows: only the router's (empty) backward runs */
        TT_OK(ctx, tm_backward_with_grad(ctx, sd->out.probs, gp));
        return;
    }
    TT_OK(ctx, tm_mul(ctx, sd->out.probs, gp, &a));
    TT_OK(ctx, tm_mul(ctx, sd->out.topk_weights, gw, &b));
    TT_OK(ctx, tm_sum_all(ctx, a, &sa));
    TT_OK(ctx, tm_sum_all(ctx, b, &sb));
    TT_OK(ctx, tm_add(ctx, sa, sb, &loss));
    TT_OK(ctx, tm_backward(ctx, loss));
}

static void router_parity(const rcase *rc, tm_dtype dt) {
    tm_ctx *ctx = tt_parity_ctx();
    tm_router_config cfg = tm_router_config_default();
    cfg.num_experts = rc->E;
    cfg.topk = rc->k;
    cfg.score_function = rc->score;
    cfg.use_pre_softmax = rc->pre;
    cfg.num_groups = rc->groups;
    cfg.group_topk = rc->group_topk;
    cfg.norm_topk_prob = rc->norm;
    cfg.scaling_factor = rc->scaling;
    cfg.force_load_balance = rc->force;
    int64_t T = rc->T, E = rc->E, k = rc->k;
    double *hl = router_logits(rc), *hb = malloc(sizeof(double) * (size_t)E);
    for (int64_t e = 0; e < E; e++) hb[e] = (double)((e * 7) % 5 - 2); /* whole numbers: see the top */
    double *hgp = tt_parity_uniform(T * E, 91), *hgw = tt_parity_uniform(T * k, 92);
    rside cpu, gpu;
    router_side(ctx, rc, &cfg, dt, tm_cpu(), hl, hb, hgp, hgw, &cpu);
    router_side(ctx, rc, &cfg, dt, tm_cuda(0), hl, hb, hgp, hgw, &gpu);
    const double atol = atol_of(dt), rtol = rtol_of(dt);
    char name[160];
    snprintf(name, sizeof name, "%s (%s)", rc->name, tm_dtype_name(dt));
    assert_equal(ctx, gpu.out.topk_idx, cpu.out.topk_idx, "topk_idx", name);
    assert_equal(ctx, gpu.out.routing_map, cpu.out.routing_map, "routing_map", name);
    assert_equal(ctx, gpu.out.tokens_per_expert, cpu.out.tokens_per_expert, "tokens_per_expert", name);
    assert_close(ctx, gpu.out.probs, cpu.out.probs, atol, rtol, "probs", name);
    assert_close(ctx, gpu.out.topk_weights, cpu.out.topk_weights, atol, rtol, "topk_weights", name);
    tm_tensor *gg = tm_tensor_grad(gpu.logits), *cg = tm_tensor_grad(cpu.logits);
    cr_assert(gg && cg, "%s: logits have no gradient (cuda %p, cpu %p)", name, (void *)gg, (void *)cg);
    assert_close(ctx, gg, cg, atol, rtol, "d logits", name);
    free(hl), free(hb), free(hgp), free(hgw);
    tm_ctx_free(ctx);
}

static const rcase RCASES[] = {
    /*  name                                     T    E   k  score             pre G  gk norm bias scaling force */
    {"softmax pre, E 8 k 2 (defaults)",          37,   8, 2, TM_SCORE_SOFTMAX, 1, 0, 0, 0, 0, 1.0, 0},
    {"softmax pre, k 1, E 7",                    29,   7, 1, TM_SCORE_SOFTMAX, 1, 0, 0, 0, 0, 1.0, 0},
    {"softmax pre, norm, scaling 2.5, E 13 k 3", 41,  13, 3, TM_SCORE_SOFTMAX, 1, 0, 0, 1, 0, 2.5, 0},
    {"softmax pre, norm, k 1 (p = scaling)",     17,   7, 1, TM_SCORE_SOFTMAX, 1, 0, 0, 1, 0, 1.5, 0},
    {"softmax pre, bias, E 64 k 6",              53,  64, 6, TM_SCORE_SOFTMAX, 1, 0, 0, 0, 1, 1.0, 0},
    {"softmax pre, E 64 k 6, norm",              53,  64, 6, TM_SCORE_SOFTMAX, 1, 0, 0, 1, 0, 1.0, 0},
    {"softmax post, E 13 k 4",                   41,  13, 4, TM_SCORE_SOFTMAX, 0, 0, 0, 0, 0, 1.0, 0},
    {"softmax post, k 1, E 7, scaling 0.5",      23,   7, 1, TM_SCORE_SOFTMAX, 0, 0, 0, 0, 0, 0.5, 0},
    {"softmax post, bias, E 64 k 6, norm (no-op)", 53, 64, 6, TM_SCORE_SOFTMAX, 0, 0, 0, 1, 1, 1.0, 0},
    {"sigmoid, E 7 k 2",                         37,   7, 2, TM_SCORE_SIGMOID, 0, 0, 0, 0, 0, 1.0, 0},
    {"sigmoid, k 1, E 13",                       31,  13, 1, TM_SCORE_SIGMOID, 0, 0, 0, 0, 0, 1.0, 0},
    {"sigmoid, bias, scaling 2.5, E 64 k 6",     53,  64, 6, TM_SCORE_SIGMOID, 0, 0, 0, 0, 1, 2.5, 0},
    {"groups: softmax pre, norm, 8 groups keep 3, k 3", 45, 64, 3, TM_SCORE_SOFTMAX, 1, 8, 3, 1, 0, 2.5, 0},
    {"groups: softmax post, bias, 8 groups keep 2, k 6", 45, 64, 6, TM_SCORE_SOFTMAX, 0, 8, 2, 0, 1, 1.0, 0},
    {"groups: softmax post, 4 groups keep 2, k 8, E 32", 45, 32, 8, TM_SCORE_SOFTMAX, 0, 4, 2, 0, 0, 1.0, 0},
    {"groups: sigmoid, bias, 4 groups keep 2, k 2", 45, 32, 2, TM_SCORE_SIGMOID, 0, 4, 2, 0, 1, 1.5, 0},
    {"groups: 1 group (no groups)",              19,   8, 2, TM_SCORE_SOFTMAX, 1, 1, 1, 0, 0, 1.0, 0},
    {"k = E = 7",                                11,   7, 7, TM_SCORE_SOFTMAX, 1, 0, 0, 1, 0, 1.0, 0},
    {"E 1 k 1",                                   9,   1, 1, TM_SCORE_SIGMOID, 0, 0, 0, 0, 0, 1.0, 0},
    {"wide: softmax pre, E 512 k 32",             9, 512, 32, TM_SCORE_SOFTMAX, 1, 0, 0, 1, 0, 1.0, 0},
    {"wide: sigmoid, bias, E 512 k 32",           9, 512, 32, TM_SCORE_SIGMOID, 0, 0, 0, 0, 1, 1.0, 0},
    {"wide: softmax post, E 300 k 20",            9, 300, 20, TM_SCORE_SOFTMAX, 0, 0, 0, 0, 0, 1.0, 0},
    {"many tokens",                           2100,  16, 4, TM_SCORE_SOFTMAX, 1, 0, 0, 0, 1, 1.0, 0},
    {"empty: 0 tokens",                           0,   8, 2, TM_SCORE_SOFTMAX, 1, 0, 0, 0, 1, 1.0, 0},
    {"empty: 0 tokens, sigmoid",                  0,  13, 3, TM_SCORE_SIGMOID, 0, 0, 0, 0, 0, 1.0, 0},
    /* force_load_balance: the round-robin selection (exact on both), then each weight rule */
    {"forced: softmax pre, E 8 k 2",             37,   8, 2, TM_SCORE_SOFTMAX, 1, 0, 0, 0, 0, 1.0, 1},
    {"forced: softmax pre, norm, E 13 k 3",      41,  13, 3, TM_SCORE_SOFTMAX, 1, 0, 0, 1, 0, 2.5, 1},
    {"forced: softmax post, bias, E 64 k 6",     53,  64, 6, TM_SCORE_SOFTMAX, 0, 0, 0, 0, 1, 1.0, 1},
    {"forced: sigmoid, bias, scaling 2.5, E 64 k 6", 53, 64, 6, TM_SCORE_SIGMOID, 0, 0, 0, 0, 1, 2.5, 1},
    {"forced: sigmoid, k 1, E 7",                31,   7, 1, TM_SCORE_SIGMOID, 0, 0, 0, 0, 0, 1.0, 1},
    {"forced: groups ignored, sigmoid, bias, 4 groups keep 2", 45, 32, 2, TM_SCORE_SIGMOID, 0, 4, 2, 0, 1, 1.5, 1},
    {"forced: k = E = 7",                        11,   7, 7, TM_SCORE_SOFTMAX, 1, 0, 0, 1, 0, 1.0, 1},
    {"forced: wide, E 512 k 32",                  9, 512, 32, TM_SCORE_SOFTMAX, 0, 0, 0, 0, 0, 1.0, 1},
    {"forced: many tokens",                    2100,  16, 4, TM_SCORE_SOFTMAX, 1, 0, 0, 0, 1, 1.0, 1},
    {"forced: empty: 0 tokens",                   0,   8, 2, TM_SCORE_SOFTMAX, 1, 0, 0, 0, 1, 1.0, 1},
};
#define N_RCASES ((int)(sizeof RCASES / sizeof RCASES[0]))

Test(cuda_parity_moe, router_f32) {
    TT_SKIP_WITHOUT_CUDA();
    for (int i = 0; i < N_RCASES; i++) router_parity(&RCASES[i], TM_F32);
}

Test(cuda_parity_moe, router_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    for (int i = 0; i < N_RCASES; i++) router_parity(&RCASES[i], TM_BF16);
}

/* The selections themselves, spelled out: a constant row takes experts 0..k-1 on CUDA, and
 * a row with every pair tied takes the lower index of each pair. */
Test(cuda_parity_moe, router_tie_rule_on_cuda) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t s[2] = {2, 8};
    const double l[16] = {0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, /* constant */
                          1, 2, 3, 3, 2, 1, 4, 4};                 /* pairs */
    tm_tensor *x;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, s, tm_cuda(0), TM_F64, l, &x));
    tm_router_config cfg = tm_router_config_default();
    cfg.topk = 3;
    for (int pre = 0; pre < 2; pre++) {
        cfg.use_pre_softmax = pre;
        tm_router_out o;
        TT_OK(ctx, tm_moe_router(ctx, x, NULL, &cfg, &o));
        int32_t idx[6];
        TT_OK(ctx, tm_tensor_read(ctx, o.topk_idx, TM_I32, idx, 6));
        const int32_t want[6] = {0, 1, 2, 6, 7, 2};
        for (int i = 0; i < 6; i++)
            cr_assert_eq(idx[i], want[i], "pre %d: topk_idx[%d] = %d, want %d", pre, i, idx[i], want[i]);
    }
    tm_ctx_free(ctx);
}

/* Megatron's clean counts run the router op, so they now work on CUDA too. */
Test(cuda_parity_moe, aux_counts) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t s[2] = {61, 13};
    double *h = grid_values(61 * 13, 7);
    tm_tensor *x[2], *map[2], *cnt[2];
    tm_device dev[2] = {tm_cpu(), tm_cuda(0)};
    for (int d = 0; d < 2; d++) {
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, s, dev[d], TM_F64, h, &x[d]));
        TT_OK(ctx, tm_moe_aux_counts(ctx, x[d], 3, &map[d], &cnt[d]));
    }
    assert_equal(ctx, map[1], map[0], "routing_map", "aux_counts");
    assert_equal(ctx, cnt[1], cnt[0], "tokens_per_expert", "aux_counts");
    free(h);
    tm_ctx_free(ctx);
}

/* ---- moe_aux_scores --------------------------------------------------------------------------- */

static void aux_scores_parity(int64_t T, int64_t E, tm_score_function f, tm_dtype dt) {
    tm_ctx *ctx = tt_parity_ctx();
    int64_t s[2] = {T, E};
    double *h = tt_parity_uniform(T * E, 300 + (uint64_t)(T + E)), *hg = tt_parity_uniform(T * E, 301);
    tm_tensor *x[2], *y[2], *g;
    tm_device dev[2] = {tm_cpu(), tm_cuda(0)};
    for (int d = 0; d < 2; d++) {
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, s, dev[d], TM_F64, h, &x[d]));
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x[d], 1));
        TT_OK(ctx, tm_moe_aux_scores(ctx, x[d], f, &y[d]));
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, s, dev[d], TM_F64, hg, &g));
        TT_OK(ctx, tm_backward_with_grad(ctx, y[d], g));
    }
    char name[96];
    snprintf(name, sizeof name, "aux_scores %s T %lld E %lld (%s)", f == TM_SCORE_SIGMOID ? "sigmoid" : "softmax",
             (long long)T, (long long)E, tm_dtype_name(dt));
    assert_close(ctx, y[1], y[0], atol_of(dt), rtol_of(dt), "scores", name);
    assert_close(ctx, tm_tensor_grad(x[1]), tm_tensor_grad(x[0]), atol_of(dt), rtol_of(dt), "d logits", name);
    free(h), free(hg);
    tm_ctx_free(ctx);
}

static void aux_scores_all(tm_dtype dt) {
    for (int f = 0; f < 2; f++) {
        tm_score_function sf = f ? TM_SCORE_SIGMOID : TM_SCORE_SOFTMAX;
        aux_scores_parity(37, 7, sf, dt);
        aux_scores_parity(19, 64, sf, dt);
        aux_scores_parity(5, 1100, sf, dt); /* more experts than threads of a row */
        aux_scores_parity(0, 13, sf, dt);
    }
}

Test(cuda_parity_moe, aux_scores_f32) {
    TT_SKIP_WITHOUT_CUDA();
    aux_scores_all(TM_F32);
}

Test(cuda_parity_moe, aux_scores_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    aux_scores_all(TM_BF16);
}

/* ---- moe_drop_tokens -------------------------------------------------------------------------- */

/* routing_map: each token routes to k distinct experts, skewed towards expert 0 when skew
 * (so one column overflows by far); probs on the grid (many ties), 0 off the route. */
static void drop_inputs(int64_t T, int64_t E, int64_t k, int skew, uint64_t seed, double *map, double *probs) {
    double *u = tt_parity_uniform(T * (k + 1), seed), *p = grid_values(T * E, seed + 1);
    memset(map, 0, sizeof(double) * (size_t)(T * E));
    for (int64_t t = 0; t < T; t++) {
        int64_t first = skew && u[t * (k + 1)] < 1.0 ? 0 : (int64_t)((u[t * (k + 1)] + 2.0) * 0.25 * (double)E) % E;
        for (int64_t j = 0; j < k; j++) map[t * E + (first + j * 3) % E] = 1; /* distinct when gcd(3, E) = 1 */
    }
    for (int64_t i = 0; i < T * E; i++) probs[i] = map[i] ? fabs(p[i]) / 2.0 : 0.0;
    free(u), free(p);
}

static void drop_parity(const char *what, int64_t T, int64_t E, int64_t k, int skew, int64_t cap, tm_drop_policy pol,
                        tm_dtype dt) {
    tm_ctx *ctx = tt_parity_ctx();
    int64_t s[2] = {T, E};
    double *hm = malloc(sizeof(double) * (size_t)(T * E + 1)), *hp = malloc(sizeof(double) * (size_t)(T * E + 1));
    drop_inputs(T, E, k, skew, 500 + (uint64_t)(T + E), hm, hp);
    double *hg = tt_parity_uniform(T * E, 501);
    tm_tensor *p[2], *m[2], *g;
    tm_moe_drop_out o[2];
    tm_device dev[2] = {tm_cpu(), tm_cuda(0)};
    for (int d = 0; d < 2; d++) {
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, s, dev[d], TM_F64, hp, &p[d]));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_U8, 2, s, dev[d], TM_F64, hm, &m[d]));
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, p[d], 1));
        TT_OK(ctx, tm_moe_drop_tokens(ctx, p[d], m[d], cap, pol, &o[d]));
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, s, dev[d], TM_F64, hg, &g));
        TT_OK(ctx, tm_backward_with_grad(ctx, o[d].probs_kept, g));
    }
    char name[160];
    snprintf(name, sizeof name, "drop %s: T %lld E %lld k %lld cap %lld %s (%s)", what, (long long)T, (long long)E,
             (long long)k, (long long)cap, pol == TM_DROP_PROBS ? "probs" : "position", tm_dtype_name(dt));
    assert_equal(ctx, o[1].map_kept, o[0].map_kept, "map_kept", name);
    assert_equal(ctx, o[1].tokens_per_expert, o[0].tokens_per_expert, "tokens_per_expert", name);
    assert_equal(ctx, o[1].dropped, o[0].dropped, "dropped", name);
    assert_equal(ctx, o[1].probs_kept, o[0].probs_kept, "probs_kept", name); /* copied, not computed */
    assert_close(ctx, tm_tensor_grad(p[1]), tm_tensor_grad(p[0]), atol_of(dt), rtol_of(dt), "d probs", name);
    free(hm), free(hp), free(hg);
    tm_ctx_free(ctx);
}

static void drop_all(tm_dtype dt) {
    for (int pol = 0; pol < 2; pol++) {
        tm_drop_policy dp = pol ? TM_DROP_POSITION : TM_DROP_PROBS;
        int64_t cap = tm_moe_capacity(200, 2, 7, 1.0); /* 58 */
        drop_parity("balanced", 200, 7, 2, 0, cap, dp, dt);
        drop_parity("tight", 200, 7, 2, 0, tm_moe_capacity(200, 2, 7, 0.5), dp, dt);
        drop_parity("skewed", 200, 7, 2, 1, cap, dp, dt);
        drop_parity("capacity 0", 50, 13, 3, 0, 0, dp, dt);
        drop_parity("no drops (capacity >= T)", 50, 13, 3, 1, 50, dp, dt);
        drop_parity("huge capacity", 50, 13, 3, 1, (int64_t)1 << 60, dp, dt);
        /* one expert receives most of 3000 tokens: several scan chunks, several rank tiles */
        drop_parity("many tokens, skewed", 3000, 13, 2, 1, tm_moe_capacity(3000, 2, 13, 1.25), dp, dt);
        drop_parity("E 64 k 6", 300, 64, 6, 0, tm_moe_capacity(300, 6, 64, 1.0), dp, dt);
        drop_parity("empty: 0 tokens", 0, 7, 2, 0, 3, dp, dt);
    }
}

Test(cuda_parity_moe, drop_tokens_f32) {
    TT_SKIP_WITHOUT_CUDA();
    drop_all(TM_F32);
}

Test(cuda_parity_moe, drop_tokens_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    drop_all(TM_BF16);
}

/* ---- moe_accumulate_counts, moe_expert_bias_update ------------------------------------------- */

Test(cuda_parity_moe, accumulate_counts) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t E = 13;
    double s0[13], c1[13], c2[13];
    for (int e = 0; e < 13; e++) {
        s0[e] = (double)(e * 1000003LL);
        c1[e] = (double)((e * 37) % 11);
        c2[e] = (double)(e == 5 ? 4000000000LL : e);
    }
    tm_tensor *sum[2], *a, *b;
    tm_device dev[2] = {tm_cpu(), tm_cuda(0)};
    for (int d = 0; d < 2; d++) {
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &E, dev[d], TM_F64, s0, &sum[d]));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &E, dev[d], TM_F64, c1, &a));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &E, dev[d], TM_F64, c2, &b));
        TT_OK(ctx, tm_moe_accumulate_counts(ctx, sum[d], a));
        TT_OK(ctx, tm_moe_accumulate_counts(ctx, sum[d], b));
    }
    assert_equal(ctx, sum[1], sum[0], "sum", "accumulate_counts");
    tm_ctx_free(ctx);
}

/* Bit for bit against the CPU, on a buffer and on a strided view (stride 2, offset 1) of one
 * with strided counts; a balanced expert keeps its bias exactly. */
Test(cuda_parity_moe, expert_bias_update) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t E = 13, E2 = 2 * E + 1;
    double *hb = tt_parity_uniform(E2, 600), hc[27];
    for (int i = 0; i < E2; i++) hc[i] = (double)((i * 29) % 17);
    /* the strided counts (odd elements): 0, 2, 4 four times each and a last 2, so the mean is
     * exactly 2 and five experts are balanced (sign 0: unchanged) */
    for (int j = 0; j < E; j++) hc[2 * j + 1] = j < 12 ? (double)(2 * (j % 3)) : 2.0;
    tm_tensor *bias[2], *cnt[2], *vb[2], *vc[2];
    tm_device dev[2] = {tm_cpu(), tm_cuda(0)};
    for (int d = 0; d < 2; d++) {
        tm_tensor *b;
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 1, &E2, dev[d], TM_F64, hb, &bias[d]));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &E2, dev[d], TM_F64, hc, &cnt[d]));
        /* contiguous: the first E */
        TT_OK(ctx, tm_slice(ctx, bias[d], 0, 0, E, &b));
        tm_tensor *c;
        TT_OK(ctx, tm_slice(ctx, cnt[d], 0, 0, E, &c));
        TT_OK(ctx, tm_moe_expert_bias_update(ctx, b, c, 1e-3));
        TT_OK(ctx, tm_moe_expert_bias_update(ctx, b, c, 0.37));
        /* strided: elements 1, 3, ..., 25 of both */
        int64_t st2 = 2;
        TT_OK(ctx, tm__tensor_view(ctx, bias[d], 1, &E, &st2, 1, &vb[d]));
        TT_OK(ctx, tm__tensor_view(ctx, cnt[d], 1, &E, &st2, 1, &vc[d]));
        TT_OK(ctx, tm_moe_expert_bias_update(ctx, vb[d], vc[d], 1e-3));
    }
    assert_equal(ctx, bias[1], bias[0], "expert_bias", "expert_bias_update");
    free(hb);
    tm_ctx_free(ctx);
}

/* ---- no host round trips ---------------------------------------------------------------------- */

Test(cuda_parity_moe, no_synchronisation) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t T = 64, E = 8, s[2] = {T, E};
    double *h = grid_values(T * E, 3);
    tm_tensor *x, *bias, *sum, *scores, *aux, *seq, *z, *loss, *l2, *l3;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, s, tm_cuda(0), TM_F64, h, &x));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 1, &E, tm_cuda(0), &bias));
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_I64, 1, &E, tm_cuda(0), &sum));
    TT_OK(ctx, tm_ctx_sync(ctx)); /* uploads done */
    uint64_t before = tm_ctx_sync_count(ctx);
    tm_router_config cfg = tm_router_config_default();
    tm_router_out r;
    tm_moe_drop_out d;
    TT_OK(ctx, tm_moe_router(ctx, x, bias, &cfg, &r));
    TT_OK(ctx, tm_moe_drop_tokens(ctx, r.probs, r.routing_map, tm_moe_capacity(T, 2, 8, 1.0), TM_DROP_PROBS, &d));
    TT_OK(ctx, tm_moe_accumulate_counts(ctx, sum, d.tokens_per_expert));
    TT_OK(ctx, tm_moe_expert_bias_update(ctx, bias, sum, 1e-3));
    TT_OK(ctx, tm_moe_aux_scores(ctx, x, TM_SCORE_SOFTMAX, &scores));
    TT_OK(ctx, tm_moe_aux_loss(ctx, scores, r.tokens_per_expert, 2, 1e-2, 0, &aux));
    TT_OK(ctx, tm_moe_seq_aux_loss(ctx, scores, r.routing_map, 2, 1e-2, 4, &seq));
    TT_OK(ctx, tm_moe_z_loss(ctx, x, 1e-3, &z));
    TT_OK(ctx, tm_add(ctx, aux, seq, &loss));
    TT_OK(ctx, tm_add(ctx, loss, z, &l2));
    tm_tensor *ps;
    TT_OK(ctx, tm_sum_all(ctx, d.probs_kept, &ps));
    TT_OK(ctx, tm_add(ctx, l2, ps, &l3));
    TT_OK(ctx, tm_backward(ctx, l3));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "the MoE router ops synchronised %llu times",
                 (unsigned long long)(tm_ctx_sync_count(ctx) - before));
    TT_OK(ctx, tm_ctx_sync(ctx)); /* and every kernel ran */
    free(h);
    tm_ctx_free(ctx);
}
