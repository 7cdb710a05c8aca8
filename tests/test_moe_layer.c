/* test_moe_layer.c — the whole MoE block: grouped path against the dense oracle, gradients of
 * every parameter against finite differences, aux-loss counts, capacity, statistics, the
 * expert-bias step, and config errors naming the field. apply_topk_weights_early: the same
 * three checks with the option on (grouped = dense, finite-difference gradients, with padding
 * rows, capacity drops and the dense strategy), and a hand-computed reference
 * sum_e FFN_e(p x) that the option-off block (sum_e p FFN_e(x)) does not meet. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static tm_moe *make_moe(tm_ctx *ctx, const tm_moe_config *cfg, tm_dtype dt) {
    tm_moe *m = NULL;
    TT_OK(ctx, tm_moe_new(ctx, "blk", cfg, dt, tm_cpu(), &m));
    TT_OK(ctx, tm_moe_init(m, 1234, 0.4, 0.3));
    return m;
}

/* Same seed and names in two contexts give identical parameters (the RNG contract), so the
 * grouped and the dense strategy are compared on the same weights. */
static void grouped_vs_dense(tm_moe_config cfg, tm_dtype dt, int64_t T, double rtol) {
    tm_ctx *a = tt_ctx(), *b = tt_ctx();
    cfg.strategy = TM_MOE_GROUPED;
    tm_moe *ma = make_moe(a, &cfg, dt);
    cfg.strategy = TM_MOE_DENSE;
    tm_moe *mb = make_moe(b, &cfg, dt);
    int64_t xs[3] = {2, T / 2, cfg.hidden_size};
    tm_tensor *xa = tt_randn(a, dt, 3, xs, 99), *xb = tt_randn(b, dt, 3, xs, 99), *ya, *yb;
    tm_moe_stats sa, sb;
    TT_OK(a, tm_moe_forward(ma, xa, 2, &ya, &sa));
    TT_OK(b, tm_moe_forward(mb, xb, 2, &yb, &sb));
    TT_OK(a, tm_moe_stats_read(ma, &sa));
    TT_OK(b, tm_moe_stats_read(mb, &sb));
    cr_assert_eq(tm_tensor_ndim(ya), 3);
    double *va = tt_read(a, ya), *vb = tt_read(b, yb);
    int64_t n = tm_tensor_numel(ya);
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += (va[i] - vb[i]) * (va[i] - vb[i]);
        den += vb[i] * vb[i];
    }
    cr_assert(den > 0, "dense output is all zero");
    cr_assert(sqrt(num / den) <= rtol, "grouped vs dense: relative error %g > %g (E=%d k=%d)", sqrt(num / den), rtol,
              cfg.router.num_experts, cfg.router.topk);
    cr_assert_eq(sa.dropped_tokens, sb.dropped_tokens);
    free(va), free(vb);
    tm_moe_free(ma), tm_moe_free(mb);
    tm_ctx_free(a), tm_ctx_free(b);
}

static tm_moe_config small_cfg(int E, int k) {
    tm_moe_config c = tm_moe_config_default();
    c.hidden_size = 12;
    c.ffn_size = 10;
    c.router.num_experts = E;
    c.router.topk = k;
    return c;
}

Test(moe_layer, grouped_equals_dense_softmax) {
    grouped_vs_dense(small_cfg(8, 2), TM_F32, 38, 1e-5);
    tm_moe_config c = small_cfg(4, 1);
    c.router.use_pre_softmax = 0;
    grouped_vs_dense(c, TM_F32, 38, 1e-5);
    c = small_cfg(8, 4);
    c.router.norm_topk_prob = 1;
    c.router.scaling_factor = 1.2;
    c.align_size = 16;
    c.shared_ffn_size = 7;
    grouped_vs_dense(c, TM_F32, 38, 1e-5);
}

Test(moe_layer, grouped_equals_dense_sigmoid_groups_bias) {
    tm_moe_config c = small_cfg(32, 8);
    c.router.score_function = TM_SCORE_SIGMOID;
    c.router.num_groups = 8;
    c.router.group_topk = 4;
    c.use_expert_bias = 1;
    c.aux_loss_coeff = 1e-2;
    c.z_loss_coeff = 1e-3;
    c.seq_aux_loss_coeff = 1e-3;
    grouped_vs_dense(c, TM_F32, 40, 1e-5);
}

Test(moe_layer, grouped_equals_dense_with_capacity) {
    tm_moe_config c = small_cfg(8, 2);
    c.capacity_factor = 0.5;
    grouped_vs_dense(c, TM_F32, 64, 1e-5);
    c.drop_policy = TM_DROP_POSITION;
    c.pad_to_capacity = 1;
    grouped_vs_dense(c, TM_F32, 64, 1e-5);
}

Test(moe_layer, grouped_equals_dense_f64_many_experts) {
    tm_moe_config c = small_cfg(128, 8);
    grouped_vs_dense(c, TM_F64, 30, 1e-12); /* most experts get no token */
}

typedef struct {
    tm_moe *m;
} layer_case;

static tm_status layer_fn(tm_ctx *ctx, tm_tensor **in, void *u, tm_tensor **out) {
    layer_case *lc = u;
    tm_moe_stats st;
    tm_tensor *y;
    tm_status s = tm_moe_forward(lc->m, in[0], 1, &y, &st);
    if (s) return s;
    /* Fold the losses in so their gradients are checked too: y + aux + z (broadcast 0-d). */
    if (st.aux_loss) s = tm_add(ctx, y, st.aux_loss, &y);
    if (!s && st.z_loss) s = tm_add(ctx, y, st.z_loss, &y);
    *out = y;
    return s;
}

static double layer_gradcheck(tm_moe_config cfg) {
    tm_ctx *ctx = tt_ctx();
    layer_case lc = {make_moe(ctx, &cfg, TM_F64)};
    int64_t xs[2] = {9, cfg.hidden_size};
    const char *names[] = {"gate.weight", "experts.w0", "experts.w1", "experts.wo", "shared.w0", "shared.w1", "shared.wo"};
    tm_tensor *in[8] = {tt_randn(ctx, TM_F64, 2, xs, 5)};
    int chk[8] = {1};
    int n = 1;
    for (int i = 0; i < 7; i++) {
        tm_tensor *p = tm_moe_tensor(lc.m, names[i]);
        if (!p) continue;
        in[n] = p;
        chk[n++] = 1;
    }
    double r = tt_gradcheck(ctx, layer_fn, &lc, n, in, chk, 1e-6, 1e-7, 1e-5);
    tm_moe_free(lc.m);
    tm_ctx_free(ctx);
    return r;
}

Test(moe_layer, gradients_softmax_shared_aux_z) {
    tm_moe_config c = small_cfg(6, 2);
    c.hidden_size = 5;
    c.ffn_size = 4;
    c.shared_ffn_size = 3;
    c.aux_loss_coeff = 0.1;
    c.z_loss_coeff = 0.01;
    c.align_size = 4;
    double r = layer_gradcheck(c);
    cr_assert_leq(r, 1.0, "ratio %g", r);
}

Test(moe_layer, gradients_sigmoid_groups_bias_dense) {
    tm_moe_config c = small_cfg(8, 4);
    c.hidden_size = 5;
    c.ffn_size = 3;
    c.router.score_function = TM_SCORE_SIGMOID;
    c.router.num_groups = 4;
    c.router.group_topk = 2;
    c.router.scaling_factor = 2.5;
    c.use_expert_bias = 1;
    c.aux_loss_coeff = 0.1;
    double r = layer_gradcheck(c);
    cr_assert_leq(r, 1.0, "grouped ratio %g", r);
    c.strategy = TM_MOE_DENSE;
    r = layer_gradcheck(c);
    cr_assert_leq(r, 1.0, "dense ratio %g", r);
}

Test(moe_layer, gradients_with_capacity_drop) {
    tm_moe_config c = small_cfg(4, 2);
    c.hidden_size = 4;
    c.ffn_size = 3;
    c.capacity_factor = 0.75;
    double r = layer_gradcheck(c);
    cr_assert_leq(r, 1.0, "ratio %g", r);
}

/* Group-limited routing + aux loss: the loss must use the counts actually routed. The case is
 * chosen so that routed and clean counts differ, which makes the assertion meaningful. */
Test(moe_layer, aux_loss_uses_routed_counts_under_groups) {
    tm_ctx *ctx = tt_ctx();
    tm_moe_config c = small_cfg(8, 2);
    c.router.num_groups = 4;
    c.router.group_topk = 1;
    c.aux_loss_coeff = 0.5;
    tm_moe *m = make_moe(ctx, &c, TM_F64);
    int64_t T = 40, xs[2] = {T, c.hidden_size};
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, xs, 17), *y, *logits;
    tm_moe_stats st;
    TT_OK(ctx, tm_moe_forward(m, x, 1, &y, &st));
    TT_OK(ctx, tm_moe_stats_read(m, &st));
    TT_OK(ctx, tm_matmul(ctx, x, tm_moe_tensor(m, "gate.weight"), 0, 0, &logits));
    double *l = tt_read(ctx, logits);
    int64_t routed[8];
    TT_OK(ctx, tm_tensor_read(ctx, st.tokens_per_expert, TM_I64, routed, 8));
    double col[8] = {0};
    int64_t clean[8] = {0};
    for (int64_t t = 0; t < T; t++) {
        double mx = -INFINITY, z = 0;
        for (int e = 0; e < 8; e++) mx = fmax(mx, l[t * 8 + e]);
        for (int e = 0; e < 8; e++) z += exp(l[t * 8 + e] - mx);
        int b1 = -1, b2 = -1;
        for (int e = 0; e < 8; e++) {
            col[e] += exp(l[t * 8 + e] - mx) / z;
            if (b1 < 0 || l[t * 8 + e] > l[t * 8 + b1]) b2 = b1, b1 = e;
            else if (b2 < 0 || l[t * 8 + e] > l[t * 8 + b2]) b2 = e;
        }
        clean[b1]++, clean[b2]++;
    }
    double want_routed = 0, want_clean = 0, k = 8 * 0.5 / (2.0 * T * T);
    int differ = 0;
    for (int e = 0; e < 8; e++) {
        want_routed += k * col[e] * (double)routed[e];
        want_clean += k * col[e] * (double)clean[e];
        differ |= routed[e] != clean[e];
    }
    cr_assert(differ, "test case does not separate routed from clean counts");
    cr_assert(fabs(st.aux_loss_value - want_routed) <= 1e-12 * fabs(want_routed), "aux %.17g want %.17g (clean %.17g)",
              st.aux_loss_value, want_routed, want_clean);
    int64_t sum = 0;
    for (int e = 0; e < 8; e++) sum += routed[e];
    cr_assert_eq(sum, T * 2, "dropless counts sum to T*k");
    free(l);
    tm_moe_free(m);
    tm_ctx_free(ctx);
}

Test(moe_layer, clean_counts_option_matches_megatron) {
    tm_ctx *ctx = tt_ctx();
    tm_moe_config c = small_cfg(8, 2);
    c.router.num_groups = 4;
    c.router.group_topk = 1;
    c.aux_loss_coeff = 0.5;
    c.aux_counts = TM_AUX_COUNTS_CLEAN;
    tm_moe *m = make_moe(ctx, &c, TM_F64);
    int64_t xs[2] = {40, c.hidden_size};
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, xs, 17), *y, *logits, *scores;
    tm_moe_stats st;
    TT_OK(ctx, tm_moe_forward(m, x, 1, &y, &st));
    TT_OK(ctx, tm_moe_stats_read(m, &st));
    /* Reference: the same loss through the public pieces with a plain top-k router. */
    TT_OK(ctx, tm_matmul(ctx, x, tm_moe_tensor(m, "gate.weight"), 0, 0, &logits));
    tm_router_config plain = c.router;
    plain.num_groups = 0;
    plain.group_topk = 0;
    tm_router_out ro;
    TT_OK(ctx, tm_moe_router(ctx, logits, NULL, &plain, &ro));
    TT_OK(ctx, tm_moe_aux_scores(ctx, logits, TM_SCORE_SOFTMAX, &scores));
    tm_tensor *aux;
    TT_OK(ctx, tm_moe_aux_loss(ctx, scores, ro.tokens_per_expert, 2, 0.5, 0, &aux));
    double want;
    TT_OK(ctx, tm_tensor_read(ctx, aux, TM_F64, &want, 1));
    cr_assert(fabs(st.aux_loss_value - want) <= 1e-14, "%.17g vs %.17g", st.aux_loss_value, want);
    tm_moe_free(m);
    tm_ctx_free(ctx);
}

Test(moe_layer, stats_capacity_and_bias_step) {
    tm_ctx *ctx = tt_ctx();
    tm_moe_config c = small_cfg(4, 2);
    c.capacity_factor = 0.5;
    c.use_expert_bias = 1;
    c.expert_bias_update_rate = 0.01;
    tm_moe *m = make_moe(ctx, &c, TM_F32);
    int64_t T = 32, xs[2] = {T, c.hidden_size};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 3), *y;
    tm_moe_stats st;
    TT_OK(ctx, tm_moe_forward(m, x, 1, &y, &st));
    TT_OK(ctx, tm_moe_stats_read(m, &st));
    int64_t cap = tm_moe_capacity(T, 2, 4, 0.5), counts[4], sum = 0;
    TT_OK(ctx, tm_tensor_read(ctx, st.tokens_per_expert, TM_I64, counts, 4));
    for (int e = 0; e < 4; e++) {
        cr_assert_leq(counts[e], cap);
        sum += counts[e];
    }
    cr_assert_eq(sum + st.dropped_tokens, T * 2, "kept + dropped = T*k");
    cr_assert_gt(st.dropped_tokens, 0);
    cr_assert_geq(st.max_load_ratio, 1.0);
    cr_assert_leq(st.min_load_ratio, 1.0);
    /* Two micro-batches, then one step: bias moves by rate * sign(mean - count) of the sum. */
    TT_OK(ctx, tm_moe_forward(m, x, 1, &y, &st));
    TT_OK(ctx, tm_moe_update_expert_bias(m));
    double bias[4], mean = (double)sum * 2 / 4;
    TT_OK(ctx, tm_tensor_read(ctx, tm_moe_tensor(m, "expert_bias"), TM_F64, bias, 4));
    for (int e = 0; e < 4; e++) {
        double d = mean - 2.0 * (double)counts[e];
        double want = d > 0 ? 0.01 : d < 0 ? -0.01 : 0.0;
        cr_assert(fabs(bias[e] - want) < 1e-9, "bias[%d] = %g want %g", e, bias[e], want);
    }
    int64_t zero[4];
    TT_OK(ctx, tm_tensor_read(ctx, tm_moe_tensor(m, "tokens_per_expert_sum"), TM_I64, zero, 4));
    for (int e = 0; e < 4; e++) cr_assert_eq(zero[e], 0, "running count cleared by the step");
    tm_moe_free(m);
    tm_ctx_free(ctx);
}

/* The statistics stay on the device until tm_moe_stats_read brings them back, in one read:
 * the same values as reading each tensor on its own. f32 and f64 blocks (the loss slots hold
 * the gate dtype's bits). */
static void check_stats_read(tm_dtype dt) {
    tm_ctx *ctx = tt_ctx();
    tm_moe_config c = small_cfg(4, 2);
    c.capacity_factor = 0.5;
    c.aux_loss_coeff = 0.3;
    c.seq_aux_loss_coeff = 0.2;
    c.z_loss_coeff = 0.1;
    tm_moe *m = make_moe(ctx, &c, dt);
    int64_t T = 32, xs[2] = {T, c.hidden_size};
    tm_tensor *y;
    tm_moe_stats st;
    TT_OK(ctx, tm_moe_forward(m, tt_randn(ctx, dt, 2, xs, 8), 2, &y, &st));
    cr_assert(st.dropped_tokens == 0 && st.max_load_ratio == 0 && st.aux_loss_value == 0 && st.z_loss_value == 0,
              "host fields are filled by tm_moe_stats_read only");
    cr_assert_not_null(st.packed);
    cr_assert_eq(tm_tensor_dtype(st.packed), TM_I64);
    cr_assert_eq(tm_tensor_numel(st.packed), 4 + 4);
    uint64_t before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_moe_stats_read(m, &st));
    cr_assert_eq(tm_ctx_sync_count(ctx) - before, 1, "one read");
    int64_t counts[4], dropped;
    double aux, seq, z, mean = 0, mx = 0, mn = INFINITY;
    TT_OK(ctx, tm_tensor_read(ctx, st.tokens_per_expert, TM_I64, counts, 4));
    TT_OK(ctx, tm_tensor_read(ctx, st.dropped, TM_I64, &dropped, 1));
    TT_OK(ctx, tm_tensor_read(ctx, st.aux_loss, TM_F64, &aux, 1));
    TT_OK(ctx, tm_tensor_read(ctx, st.seq_aux_loss, TM_F64, &seq, 1));
    TT_OK(ctx, tm_tensor_read(ctx, st.z_loss, TM_F64, &z, 1));
    for (int e = 0; e < 4; e++) {
        mean += (double)counts[e] / 4;
        mx = fmax(mx, (double)counts[e]);
        mn = fmin(mn, (double)counts[e]);
    }
    cr_assert_gt(dropped, 0);
    cr_assert_eq(st.dropped_tokens, dropped);
    cr_assert_eq(st.aux_loss_value, aux);
    cr_assert_eq(st.seq_aux_loss_value, seq);
    cr_assert_eq(st.z_loss_value, z);
    cr_assert(aux > 0 && seq > 0 && z > 0);
    cr_assert_eq(st.max_load_ratio, mx / mean);
    cr_assert_eq(st.min_load_ratio, mn / mean);
    /* Off losses read as 0; a dropless block has no dropped tensor. */
    c.capacity_factor = 0;
    c.seq_aux_loss_coeff = 0;
    tm_moe *m2 = NULL;
    TT_OK(ctx, tm_moe_new(ctx, "blk2", &c, dt, tm_cpu(), &m2));
    TT_OK(ctx, tm_moe_init(m2, 1, 0.4, 0.3));
    tm_moe_stats s2;
    TT_OK(ctx, tm_moe_forward(m2, tt_randn(ctx, dt, 2, xs, 9), 1, &y, &s2));
    cr_assert_null(s2.dropped);
    cr_assert_null(s2.seq_aux_loss);
    TT_OK(ctx, tm_moe_stats_read(m2, &s2));
    cr_assert_eq(s2.dropped_tokens, 0);
    cr_assert_eq(s2.seq_aux_loss_value, 0);
    cr_assert_gt(s2.aux_loss_value, 0);
    tm_moe_free(m2);
    tm_moe_free(m);
    tm_ctx_free(ctx);
}

Test(moe_layer, stats_read_f32) { check_stats_read(TM_F32); }
Test(moe_layer, stats_read_f64) { check_stats_read(TM_F64); }

Test(moe_layer, stats_read_bad_arguments) {
    tm_ctx *ctx = tt_ctx();
    tm_moe_config c = small_cfg(4, 2);
    tm_moe *m = make_moe(ctx, &c, TM_F32), *m8 = NULL;
    tm_moe_config c8 = small_cfg(8, 2);
    TT_OK(ctx, tm_moe_new(ctx, "blk8", &c8, TM_F32, tm_cpu(), &m8));
    int64_t xs[2] = {6, c.hidden_size};
    tm_tensor *y;
    tm_moe_stats st, none;
    memset(&none, 0, sizeof none);
    TT_OK(ctx, tm_moe_forward(m, tt_randn(ctx, TM_F32, 2, xs, 1), 1, &y, &st));
    cr_assert_eq(tm_moe_stats_read(m, NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "stats is NULL"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_moe_stats_read(m, &none), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "packed is NULL"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_moe_stats_read(m8, &st), TM_ERR_INVALID_ARG, "another block's statistics");
    cr_assert(strstr(tm_ctx_errmsg(ctx), "i64[8]") && strstr(tm_ctx_errmsg(ctx), "E = 8"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_moe_stats_read(NULL, &st), TM_ERR_INVALID_ARG);
    tm_moe_free(m8);
    tm_moe_free(m);
    tm_ctx_free(ctx);
}

/* An f64 block keeps expert_bias in f64 (its gate dtype); tm_moe_update_expert_bias updates it there. */
Test(moe_layer, f64_block_bias_step) {
    tm_ctx *ctx = tt_ctx();
    tm_moe_config c = small_cfg(4, 2);
    c.use_expert_bias = 1;
    c.expert_bias_update_rate = 0.01;
    tm_moe *m = make_moe(ctx, &c, TM_F64);
    cr_assert_eq(tm_tensor_dtype(tm_moe_tensor(m, "expert_bias")), TM_F64);
    int64_t T = 30, xs[2] = {T, c.hidden_size}, counts[4];
    tm_tensor *y;
    tm_moe_stats st;
    TT_OK(ctx, tm_moe_forward(m, tt_randn(ctx, TM_F64, 2, xs, 4), 1, &y, &st));
    TT_OK(ctx, tm_tensor_read(ctx, st.tokens_per_expert, TM_I64, counts, 4));
    TT_OK(ctx, tm_moe_update_expert_bias(m));
    double bias[4], mean = (double)T * 2 / 4;
    TT_OK(ctx, tm_tensor_read(ctx, tm_moe_tensor(m, "expert_bias"), TM_F64, bias, 4));
    for (int e = 0; e < 4; e++) {
        double d = mean - (double)counts[e];
        cr_assert_eq(bias[e], d > 0 ? 0.01 : d < 0 ? -0.01 : 0.0, "bias[%d] = %.17g", e, bias[e]);
    }
    tm_moe_free(m);
    tm_ctx_free(ctx);
}

static void bad_config(tm_moe_config c, const char *field) {
    tm_ctx *ctx = tt_ctx();
    tm_moe *m = NULL;
    cr_assert_eq(tm_moe_new(ctx, "blk", &c, TM_F32, tm_cpu(), &m), TM_ERR_INVALID_ARG, "config with bad %s accepted", field);
    cr_assert_null(m);
    cr_assert(strstr(tm_ctx_errmsg(ctx), field), "message \"%s\" does not name %s", tm_ctx_errmsg(ctx), field);
    cr_assert_eq(tm_moe_config_check(ctx, &c), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_ctx_num_params(ctx), 0, "nothing created");
    tm_ctx_free(ctx);
}

Test(moe_layer, bad_configs_name_the_field) {
    tm_moe_config c = small_cfg(8, 9);
    bad_config(c, "topk");
    c = small_cfg(8, 2);
    c.router.num_groups = 3;
    bad_config(c, "num_groups");
    c = small_cfg(8, 2);
    c.router.num_groups = 4;
    c.router.group_topk = 5;
    bad_config(c, "group_topk");
    c = small_cfg(8, 3);
    c.router.num_groups = 4;
    c.router.group_topk = 2;
    bad_config(c, "group_topk");
    c = small_cfg(8, 2);
    c.align_size = 0;
    bad_config(c, "align_size");
    c = small_cfg(8, 2);
    c.capacity_factor = -1;
    bad_config(c, "capacity_factor");
    c = small_cfg(8, 2);
    c.pad_to_capacity = 1; /* capacity requested but capacity_factor 0 */
    bad_config(c, "capacity_factor");
    c = small_cfg(8, 2);
    c.router.scaling_factor = 0;
    bad_config(c, "scaling_factor");
    c = small_cfg(8, 2);
    c.hidden_size = 0;
    bad_config(c, "hidden_size");
    c = small_cfg(8, 2);
    c.apply_topk_weights_early = 2;
    bad_config(c, "apply_topk_weights_early");
    c.apply_topk_weights_early = -1;
    bad_config(c, "apply_topk_weights_early");
    c = small_cfg(8, 2);
    c.router.force_load_balance = 2;
    bad_config(c, "force_load_balance");
}

Test(moe_layer, expert_bias_of_wrong_length_is_rejected) {
    tm_ctx *ctx = tt_ctx();
    int64_t ls[2] = {5, 8}, bs = 7;
    tm_tensor *logits = tt_randn(ctx, TM_F32, 2, ls, 1), *bias = tt_randn(ctx, TM_F32, 1, &bs, 2);
    tm_router_config rc = tm_router_config_default();
    tm_router_out ro;
    cr_assert_eq(tm_moe_router(ctx, logits, bias, &rc, &ro), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "expert_bias"), "%s", tm_ctx_errmsg(ctx));
    tm_ctx_free(ctx);
}

Test(moe_layer, forward_input_errors) {
    tm_ctx *ctx = tt_ctx();
    tm_moe_config c = small_cfg(4, 2);
    tm_moe *m = make_moe(ctx, &c, TM_F32);
    int64_t xs[2] = {3, 11};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *y = NULL;
    cr_assert_eq(tm_moe_forward(m, x, 1, &y, NULL), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "hidden_size"), "%s", tm_ctx_errmsg(ctx));
    xs[1] = 12;
    x = tt_randn(ctx, TM_BF16, 2, xs, 1);
    cr_assert_eq(tm_moe_forward(m, x, 1, &y, NULL), TM_ERR_DTYPE);
    cr_assert_null(y);
    tm_moe_free(m);
    tm_moe_free(NULL);
    tm_ctx_free(ctx);
}

Test(moe_layer, bf16_block_runs_and_matches_dense) {
    tm_moe_config c = small_cfg(8, 2);
    c.shared_ffn_size = 5;
    grouped_vs_dense(c, TM_BF16, 38, 2e-2);
}

/* ---- apply_topk_weights_early ------------------------------------------------------------- */

Test(moe_layer, early_weights_grouped_equals_dense) {
    tm_moe_config c = small_cfg(8, 2);
    c.apply_topk_weights_early = 1;
    grouped_vs_dense(c, TM_F32, 38, 1e-5);
    c = small_cfg(8, 4);
    c.apply_topk_weights_early = 1;
    c.router.scaling_factor = 1.2;
    c.align_size = 16; /* padding rows: weight 0 */
    c.shared_ffn_size = 7;
    grouped_vs_dense(c, TM_F32, 38, 1e-5);
    c = small_cfg(32, 8);
    c.apply_topk_weights_early = 1;
    c.router.score_function = TM_SCORE_SIGMOID;
    c.router.num_groups = 8;
    c.router.group_topk = 4;
    c.use_expert_bias = 1;
    c.aux_loss_coeff = 1e-2;
    grouped_vs_dense(c, TM_F32, 40, 1e-5);
    c = small_cfg(4, 1);
    c.apply_topk_weights_early = 1;
    c.router.score_function = TM_SCORE_SIGMOID; /* top-1 as Llama 4: the weight is not 1 */
    grouped_vs_dense(c, TM_F32, 38, 1e-5);
    grouped_vs_dense(small_cfg(128, 8), TM_F64, 30, 1e-12);
}

Test(moe_layer, early_weights_grouped_equals_dense_with_capacity) {
    tm_moe_config c = small_cfg(8, 2);
    c.apply_topk_weights_early = 1;
    c.capacity_factor = 0.5;
    grouped_vs_dense(c, TM_F32, 64, 1e-5);
    c.drop_policy = TM_DROP_POSITION;
    c.pad_to_capacity = 1; /* every expert padded to its capacity: padding rows of weight 0 */
    grouped_vs_dense(c, TM_F32, 64, 1e-5);
}

Test(moe_layer, early_weights_bf16_matches_dense) {
    tm_moe_config c = small_cfg(8, 2);
    c.apply_topk_weights_early = 1;
    c.shared_ffn_size = 5;
    grouped_vs_dense(c, TM_BF16, 38, 2e-2);
}

/* Finite differences in f64 over x and every parameter, the gate included (the weights p reach
 * it through the scaled rows). */
Test(moe_layer, early_weights_gradients) {
    tm_moe_config c = small_cfg(6, 2);
    c.apply_topk_weights_early = 1;
    c.hidden_size = 5;
    c.ffn_size = 4;
    c.shared_ffn_size = 3;
    c.aux_loss_coeff = 0.1;
    c.z_loss_coeff = 0.01;
    c.align_size = 4;
    double r = layer_gradcheck(c);
    cr_assert_leq(r, 1.0, "softmax, shared, align 4: ratio %g", r);
    c = small_cfg(8, 4);
    c.apply_topk_weights_early = 1;
    c.hidden_size = 5;
    c.ffn_size = 3;
    c.router.score_function = TM_SCORE_SIGMOID;
    c.router.num_groups = 4;
    c.router.group_topk = 2;
    c.router.scaling_factor = 2.5;
    r = layer_gradcheck(c);
    cr_assert_leq(r, 1.0, "sigmoid, groups, grouped: ratio %g", r);
    c.strategy = TM_MOE_DENSE;
    r = layer_gradcheck(c);
    cr_assert_leq(r, 1.0, "sigmoid, groups, dense: ratio %g", r);
    c = small_cfg(4, 2);
    c.apply_topk_weights_early = 1;
    c.hidden_size = 4;
    c.ffn_size = 3;
    c.capacity_factor = 0.75;
    c.pad_to_capacity = 1;
    r = layer_gradcheck(c);
    cr_assert_leq(r, 1.0, "capacity, padded: ratio %g", r);
}

/* The hand reference: an f64 block with weights written from the test, x of T tokens, and the
 * routing computed here from logits = x @ gate (softmax over E without renormalisation, or
 * sigmoid; top k, ties to the lower expert):
 *   early: y[t] = sum over the k selected e of FFN_e(p[t,e] x[t])
 *   late:  y[t] = sum over the k selected e of p[t,e] FFN_e(x[t])
 * with FFN_e(v) = (silu(v W0[e]) * (v W1[e])) Wo[e]. The block with the option on must give
 * `early`, with it off `late`, and the two must differ (so the test can fail). */
static double silu(double v) { return v / (1.0 + exp(-v)); }

static void ffn_ref(const double *w0, const double *w1, const double *wo, int e, int H, int F, const double *v,
                    double *out) {
    double h[8];
    for (int f = 0; f < F; f++) {
        double a = 0, b = 0;
        for (int i = 0; i < H; i++) a += v[i] * w0[(e * H + i) * F + f], b += v[i] * w1[(e * H + i) * F + f];
        h[f] = silu(a) * b;
    }
    for (int j = 0; j < H; j++) {
        out[j] = 0;
        for (int f = 0; f < F; f++) out[j] += h[f] * wo[(e * F + f) * H + j];
    }
}

static void early_closed_form(tm_score_function sf, int k) {
    enum { T = 5, H = 3, F = 4, E = 3 };
    tm_moe_config c = small_cfg(E, k);
    c.hidden_size = H;
    c.ffn_size = F;
    c.router.score_function = sf;
    double gate[H * E], w0[E * H * F], w1[E * H * F], wo[E * F * H], x[T * H];
    uint64_t z = 12345;
    double *all[5] = {gate, w0, w1, wo, x};
    int n[5] = {H * E, E * H * F, E * H * F, E * F * H, T * H};
    for (int a = 0; a < 5; a++)
        for (int i = 0; i < n[a]; i++) {
            z = z * 6364136223846793005ull + 1442695040888963407ull;
            all[a][i] = ((double)(z >> 11) / 9007199254740992.0 - 0.5) * 2.4; /* uniform in [-1.2, 1.2) */
        }
    double want_early[T * H], want_late[T * H];
    for (int t = 0; t < T; t++) {
        double logit[E], s[E], mx = -INFINITY, sum = 0;
        for (int e = 0; e < E; e++) {
            logit[e] = 0;
            for (int i = 0; i < H; i++) logit[e] += x[t * H + i] * gate[i * E + e];
            mx = fmax(mx, logit[e]);
        }
        for (int e = 0; e < E; e++) s[e] = sf == TM_SCORE_SIGMOID ? 1.0 / (1.0 + exp(-logit[e])) : exp(logit[e] - mx);
        for (int e = 0; e < E; e++) sum += s[e];
        if (sf == TM_SCORE_SOFTMAX)
            for (int e = 0; e < E; e++) s[e] /= sum;
        int used[E] = {0};
        double p[E] = {0};
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!used[e] && (best < 0 || s[e] > s[best])) best = e;
            used[best] = 1, p[best] = s[best];
        }
        if (sf == TM_SCORE_SIGMOID && k > 1) { /* the router's renormalisation of sigmoid weights */
            double ps = 0;
            for (int e = 0; e < E; e++) ps += p[e];
            for (int e = 0; e < E; e++) p[e] /= ps + 1e-20;
        }
        for (int j = 0; j < H; j++) want_early[t * H + j] = want_late[t * H + j] = 0;
        for (int e = 0; e < E; e++) {
            if (!used[e]) continue;
            double v[H], o[H];
            for (int i = 0; i < H; i++) v[i] = p[e] * x[t * H + i];
            ffn_ref(w0, w1, wo, e, H, F, v, o);
            for (int j = 0; j < H; j++) want_early[t * H + j] += o[j];
            ffn_ref(w0, w1, wo, e, H, F, x + t * H, o);
            for (int j = 0; j < H; j++) want_late[t * H + j] += p[e] * o[j];
        }
    }
    double diff = 0;
    for (int i = 0; i < T * H; i++) diff = fmax(diff, fabs(want_early[i] - want_late[i]));
    cr_assert_gt(diff, 1e-3, "the reference does not tell early from late weighting (max difference %g)", diff);

    for (int early = 0; early < 2; early++) {
        for (int strategy = 0; strategy < 2; strategy++) {
            tm_ctx *ctx = tt_ctx();
            c.apply_topk_weights_early = early;
            c.strategy = strategy ? TM_MOE_DENSE : TM_MOE_GROUPED;
            tm_moe *m = NULL;
            TT_OK(ctx, tm_moe_new(ctx, "blk", &c, TM_F64, tm_cpu(), &m));
            const char *names[4] = {"gate.weight", "experts.w0", "experts.w1", "experts.wo"};
            for (int a = 0; a < 4; a++) TT_OK(ctx, tm_tensor_write(ctx, tm_moe_tensor(m, names[a]), TM_F64, all[a], n[a]));
            int64_t xs[2] = {T, H};
            tm_tensor *tx = tt_from(ctx, TM_F64, 2, xs, x), *y;
            TT_OK(ctx, tm_moe_forward(m, tx, 1, &y, NULL));
            tt_assert_close_host(ctx, y, early ? want_early : want_late, 1e-13, 1e-12);
            tm_moe_free(m);
            tm_ctx_free(ctx);
        }
    }
}

Test(moe_layer, early_weights_equal_the_hand_formula_top1_sigmoid) { early_closed_form(TM_SCORE_SIGMOID, 1); }
Test(moe_layer, early_weights_equal_the_hand_formula_top2_softmax) { early_closed_form(TM_SCORE_SOFTMAX, 2); }
