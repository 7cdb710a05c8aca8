/* test_model.c — the Mixtral-style language model (layers/model.c): config errors naming the
 * field, shapes and statistics of a forward, determinism of the initialisation, the loss at
 * initialisation, gradients of every parameter tensor against finite differences of the scalar
 * training loss (CE + aux + seq-aux + z), tied embeddings, a short training run, no system
 * allocation in steady state, and bad tokens / targets named by position and value. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h" /* tm__test_perturb_backward, the op table */

/* A small model of awkward sizes: 2 query heads sharing 1 kv head, a dense first layer. */
static tm_model_config tiny_cfg(void) {
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 7;
    c.d_model = 8;
    c.n_layers = 2;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.max_seq_len = 6;
    c.first_k_dense = 1;
    c.dense_ffn_size = 10;
    c.init_std = 0.5;
    c.moe.ffn_size = 6;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    c.moe.aux_loss_coeff = 0.1;
    c.moe.seq_aux_loss_coeff = 0.05;
    c.moe.z_loss_coeff = 0.02;
    return c;
}

/* A bit larger, still fast: 4 heads over 2 kv heads, every layer MoE. */
static tm_model_config small_cfg(void) {
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 29;
    c.d_model = 24;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.max_seq_len = 16;
    c.moe.ffn_size = 20;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    return c;
}

static tm_model *make(tm_ctx *ctx, const tm_model_config *cfg, tm_dtype dt, uint64_t seed) {
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, cfg, dt, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, seed));
    return m;
}

/* Deterministic pseudo-random ids in [0, hi). */
static void fill_ids(int32_t *v, int64_t n, int64_t hi, uint32_t seed) {
    uint32_t r = seed * 2654435761u + 1;
    for (int64_t i = 0; i < n; i++) {
        r = r * 1664525u + 1013904223u;
        v[i] = (int32_t)((r >> 8) % (uint32_t)hi);
    }
}

static tm_tensor *ids(tm_ctx *ctx, const int32_t *v, int64_t B, int64_t T) {
    int64_t s[2] = {B, T};
    tm_tensor *t = NULL;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, s, tm_cpu(), TM_I32, v, &t));
    return t;
}

static tm_model_out forward(tm_ctx *ctx, tm_model *m, const int32_t *tok, const int32_t *tgt, int64_t B, int64_t T) {
    tm_model_out o;
    TT_OK(ctx, tm_model_forward(m, ids(ctx, tok, B, T), tgt ? ids(ctx, tgt, B, T) : NULL, &o));
    return o;
}

/* ---- config ------------------------------------------------------------------------------ */

static void expect_bad(tm_model_config c, tm_status want, const char *field, const char *value) {
    tm_ctx *ctx = tt_ctx();
    cr_assert_eq(tm_model_config_check(ctx, &c), want, "%s: %s", field, tm_ctx_errmsg(ctx));
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert(strstr(msg, field), "message does not name %s: %s", field, msg);
    if (value) cr_assert(strstr(msg, value), "message does not give %s: %s", value, msg);
    tm_model *m = (tm_model *)0x1;
    cr_assert_eq(tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m), want);
    cr_assert_eq(m, (tm_model *)0x1, "out written on failure");
    tm_ctx_free(ctx);
}

Test(model, default_config_is_valid) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = tm_model_config_default();
    TT_OK(ctx, tm_model_config_check(ctx, &c));
    cr_assert_eq(c.vocab_size, 257);
    cr_assert_eq(c.d_model, 128);
    cr_assert_eq(c.dense_ffn_size, 0, "0 means 4 * d_model");
    cr_assert_eq(c.moe.router.num_experts, 4);
    cr_assert_eq(c.moe.router.topk, 2);
    cr_assert_eq(c.moe.ffn_size, 256);
    cr_assert_eq(c.moe.router.score_function, TM_SCORE_SOFTMAX);
    cr_assert_eq(c.moe.router.use_pre_softmax, 1);
    cr_assert_eq(c.moe.aux_loss_coeff, 1e-2);
    TT_OK(ctx, tm_model_config_check(NULL, &c));
    tm_ctx_free(ctx);
}

Test(model, bad_configs_name_the_field) {
    tm_model_config c;
    c = tm_model_config_default(), c.n_heads = 4, c.n_kv_heads = 3;
    expect_bad(c, TM_ERR_INVALID_ARG, "n_kv_heads = 3 does not divide n_heads = 4", NULL);
    c = tm_model_config_default(), c.n_heads = 3;
    expect_bad(c, TM_ERR_INVALID_ARG, "n_heads = 3", "d_model = 128");
    c = tm_model_config_default(), c.d_model = 24, c.n_heads = 8; /* head dim 3: rope needs pairs */
    expect_bad(c, TM_ERR_INVALID_ARG, "d_model / n_heads", "even");
    c = tm_model_config_default(), c.vocab_size = 0;
    expect_bad(c, TM_ERR_INVALID_ARG, "vocab_size", "0");
    c = tm_model_config_default(), c.n_layers = -2;
    expect_bad(c, TM_ERR_INVALID_ARG, "n_layers", "-2");
    c = tm_model_config_default(), c.max_seq_len = 0;
    expect_bad(c, TM_ERR_INVALID_ARG, "max_seq_len", "0");
    c = tm_model_config_default(), c.rope_theta = -1;
    expect_bad(c, TM_ERR_INVALID_ARG, "rope_theta", "-1");
    c = tm_model_config_default(), c.norm_eps = NAN;
    expect_bad(c, TM_ERR_INVALID_ARG, "norm_eps", "nan");
    c = tm_model_config_default(), c.first_k_dense = 5;
    expect_bad(c, TM_ERR_INVALID_ARG, "first_k_dense = 5", "n_layers = 4");
    c = tm_model_config_default(), c.first_k_dense = 1, c.dense_ffn_size = -3;
    expect_bad(c, TM_ERR_INVALID_ARG, "dense_ffn_size", "-3");
    c = tm_model_config_default(), c.tie_embeddings = 2;
    expect_bad(c, TM_ERR_INVALID_ARG, "tie_embeddings", "2");
    c = tm_model_config_default(), c.init_std = -0.1;
    expect_bad(c, TM_ERR_INVALID_ARG, "init_std", "-0.1");
    /* MoE fields come back under the model's own key, "moe.<field>". */
    c = tm_model_config_default(), c.moe.router.topk = 5;
    expect_bad(c, TM_ERR_INVALID_ARG, "moe.topk = 5", "num_experts = 4");
    c = tm_model_config_default(), c.moe.ffn_size = 0;
    expect_bad(c, TM_ERR_INVALID_ARG, "moe.ffn_size", "0");
    c = tm_model_config_default(), c.moe.z_loss_coeff = -1;
    expect_bad(c, TM_ERR_INVALID_ARG, "moe.z_loss_coeff", "-1");
    /* moe.hidden_size is taken from d_model whatever it holds. */
    tm_ctx *ctx = tt_ctx();
    c = tm_model_config_default(), c.moe.hidden_size = 0;
    TT_OK(ctx, tm_model_config_check(ctx, &c));
    tm_model *m = make(ctx, &c, TM_F32, 1);
    cr_assert_eq(tm_model_get_config(m)->moe.hidden_size, 128);
    int64_t gs[2] = {tm_tensor_dim(tm_ctx_find(ctx, "layers.0.moe.gate.weight"), 0),
                     tm_tensor_dim(tm_ctx_find(ctx, "layers.0.moe.gate.weight"), 1)};
    cr_assert(gs[0] == 128 && gs[1] == 4);
    tm_model *m2 = NULL;
    cr_assert_eq(tm_model_new(ctx, &c, TM_I32, tm_cpu(), &m2), TM_ERR_DTYPE);
    cr_assert_eq(tm_model_new(ctx, NULL, TM_F32, tm_cpu(), &m2), TM_ERR_INVALID_ARG);
    tm_model_free(m);
    tm_model_free(NULL);
    tm_ctx_free(ctx);
}

/* ---- structure --------------------------------------------------------------------------- */

Test(model, parameter_names_shapes_and_counts) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = tiny_cfg();
    c.moe.shared_ffn_size = 3;
    tm_model *m = make(ctx, &c, TM_F32, 1);
    struct { const char *name; int64_t d0, d1, d2; } want[] = {
        {"embed.weight", 7, 8, 0},
        {"layers.0.attn_norm.weight", 8, 0, 0},
        {"layers.0.attn.wq", 8, 8, 0},
        {"layers.0.attn.wk", 8, 4, 0},
        {"layers.0.attn.wv", 8, 4, 0},
        {"layers.0.attn.wo", 8, 8, 0},
        {"layers.0.ffn_norm.weight", 8, 0, 0},
        {"layers.0.mlp.w0", 8, 10, 0},
        {"layers.0.mlp.w1", 8, 10, 0},
        {"layers.0.mlp.wo", 10, 8, 0},
        {"layers.1.attn.wk", 8, 4, 0},
        {"layers.1.moe.gate.weight", 8, 4, 0},
        {"layers.1.moe.experts.w0", 4, 8, 6},
        {"layers.1.moe.experts.wo", 4, 6, 8},
        {"layers.1.moe.shared.w1", 8, 3, 0},
        {"norm.weight", 8, 0, 0},
        {"lm_head.weight", 8, 7, 0},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        tm_tensor *p = tm_ctx_find(ctx, want[i].name);
        cr_assert(p, "no parameter %s", want[i].name);
        int64_t d[3] = {want[i].d0, want[i].d1, want[i].d2};
        int nd = d[2] ? 3 : d[1] ? 2 : 1;
        cr_assert_eq(tm_tensor_ndim(p), nd, "%s", want[i].name);
        for (int k = 0; k < nd; k++) cr_assert_eq(tm_tensor_dim(p, k), d[k], "%s dim %d", want[i].name, k);
    }
    cr_assert_null(tm_ctx_find(ctx, "layers.0.moe.gate.weight"));
    cr_assert_null(tm_ctx_find(ctx, "layers.1.mlp.w0"));

    /* Totals: every parameter of the context belongs to the model. */
    int64_t total = 0;
    for (int i = 0; i < tm_ctx_num_params(ctx); i++) total += tm_tensor_numel(tm_ctx_param(ctx, i));
    int64_t active = 0;
    cr_assert_eq(tm_model_num_params(m, &active), total);
    int64_t routed = 3 * 4 * 8 * 6; /* experts.w0, w1, wo of the one MoE layer */
    cr_assert_eq(active, total - routed + routed * 2 / 4);
    cr_assert_eq(tm_model_num_params(NULL, &active), 0);
    cr_assert_eq(active, 0);

    /* Init: norms are 1, residual output projections have std init_std / sqrt(2 n_layers). */
    double *g = tt_read(ctx, tm_ctx_find(ctx, "layers.1.ffn_norm.weight"));
    for (int i = 0; i < 8; i++) cr_assert_eq(g[i], 1.0);
    free(g);
    tm_tensor *wo = tm_ctx_find(ctx, "layers.0.attn.wo"), *wq = tm_ctx_find(ctx, "layers.0.attn.wq");
    double *vo = tt_read(ctx, wo), *vq = tt_read(ctx, wq), so = 0, sq = 0;
    for (int i = 0; i < 64; i++) so += vo[i] * vo[i], sq += vq[i] * vq[i];
    double ratio = sqrt(so / sq);
    cr_assert(ratio > 0.3 && ratio < 0.75, "std(wo)/std(wq) = %g, want about 1/sqrt(4) = 0.5", ratio);
    free(vo), free(vq);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(model, forward_shapes_and_statistics) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = small_cfg();
    c.moe.z_loss_coeff = 1e-3;
    c.moe.seq_aux_loss_coeff = 1e-3;
    tm_model *m = make(ctx, &c, TM_F32, 5);
    enum { B = 3, T = 11 };
    int32_t tok[B * T + 1];
    fill_ids(tok, B * T + 1, c.vocab_size, 3);
    tm_model_out o = forward(ctx, m, tok, tok + 1, B, T);
    cr_assert_eq(tm_tensor_ndim(o.logits), 3);
    cr_assert(tm_tensor_dim(o.logits, 0) == B && tm_tensor_dim(o.logits, 1) == T && tm_tensor_dim(o.logits, 2) == 29);
    cr_assert_eq(tm_tensor_ndim(o.loss), 0);
    cr_assert_eq(tm_tensor_ndim(o.ce_loss), 0);
    cr_assert_eq(o.n_moe_layers, 2);
    cr_assert(o.aux_value > 0 && o.seq_aux_value > 0 && o.z_value > 0, "aux %g seq %g z %g", o.aux_value,
              o.seq_aux_value, o.z_value);
    cr_assert(fabs(o.loss_value - (o.ce_value + o.aux_value + o.seq_aux_value + o.z_value)) < 1e-5,
              "loss %g != ce %g + aux %g + seq %g + z %g", o.loss_value, o.ce_value, o.aux_value, o.seq_aux_value,
              o.z_value);
    double mx = 0;
    for (int l = 0; l < 2; l++) {
        int64_t sum = 0, lmax = 0;
        for (int e = 0; e < 4; e++) sum += o.tokens_per_expert[l * 4 + e], lmax = o.tokens_per_expert[l * 4 + e] > lmax ? o.tokens_per_expert[l * 4 + e] : lmax;
        cr_assert_eq(sum, B * T * 2, "layer %d routed %lld pairs", l, (long long)sum);
        mx = fmax(mx, (double)lmax / (B * T * 2 / 4.0));
    }
    cr_assert(fabs(o.max_load_ratio - mx) < 1e-12, "max_load_ratio %g, want %g", o.max_load_ratio, mx);
    cr_assert(o.max_load_ratio >= 1.0);
    cr_assert_eq(o.dropped_tokens, 0);
    cr_assert_eq(o.tokens_per_expert, o.tokens_per_expert); /* owned by the model: stable pointer */
    const int64_t *p0 = o.tokens_per_expert;

    /* Without targets: logits only; a capacity drops tokens and reports them. */
    tm_ctx_arena_reset(ctx);
    tm_model_out o2 = forward(ctx, m, tok, NULL, B, T);
    cr_assert_null(o2.loss);
    cr_assert_null(o2.ce_loss);
    cr_assert_eq(o2.tokens_per_expert, p0);
    cr_assert_eq(o2.loss_value, 0);
    tm_model_free(m);

    tm_ctx *c2 = tt_ctx();
    c.moe.capacity_factor = 0.5;
    m = make(c2, &c, TM_F32, 5);
    o = forward(c2, m, tok, tok + 1, B, T);
    cr_assert_gt(o.dropped_tokens, 0);
    int64_t kept = 0;
    for (int i = 0; i < 8; i++) kept += o.tokens_per_expert[i];
    cr_assert_eq(kept + o.dropped_tokens, 2 * B * T * 2);
    tm_model_free(m);
    tm_ctx_free(c2);
    tm_ctx_free(ctx);
}

Test(model, same_seed_gives_identical_parameters_and_logits) {
    tm_ctx *a = tt_ctx(), *b = tt_ctx();
    tm_model_config c = small_cfg();
    c.first_k_dense = 1;
    tm_model *ma = make(a, &c, TM_F32, 77), *mb = make(b, &c, TM_F32, 77);
    cr_assert_eq(tm_ctx_num_params(a), tm_ctx_num_params(b));
    for (int i = 0; i < tm_ctx_num_params(a); i++) {
        tm_tensor *pa = tm_ctx_param(a, i), *pb = tm_ctx_param(b, i);
        cr_assert_str_eq(tm_tensor_name(pa), tm_tensor_name(pb));
        int64_t n = tm_tensor_numel(pa);
        float *va = malloc(sizeof(float) * (size_t)n), *vb = malloc(sizeof(float) * (size_t)n);
        TT_OK(a, tm_tensor_read(a, pa, TM_F32, va, n));
        TT_OK(b, tm_tensor_read(b, pb, TM_F32, vb, n));
        cr_assert(memcmp(va, vb, sizeof(float) * (size_t)n) == 0, "%s differs", tm_tensor_name(pa));
        free(va), free(vb);
    }
    enum { B = 2, T = 13 };
    int32_t tok[B * T + 1];
    fill_ids(tok, B * T + 1, c.vocab_size, 9);
    tm_model_out oa = forward(a, ma, tok, tok + 1, B, T), ob = forward(b, mb, tok, tok + 1, B, T);
    int64_t n = tm_tensor_numel(oa.logits);
    float *la = malloc(sizeof(float) * (size_t)n), *lb = malloc(sizeof(float) * (size_t)n);
    TT_OK(a, tm_tensor_read(a, oa.logits, TM_F32, la, n));
    TT_OK(b, tm_tensor_read(b, ob.logits, TM_F32, lb, n));
    cr_assert(memcmp(la, lb, sizeof(float) * (size_t)n) == 0, "logits differ");
    cr_assert_eq(oa.loss_value, ob.loss_value);
    free(la), free(lb);

    /* Another seed gives other weights. */
    tm_ctx *d = tt_ctx();
    tm_model *md = make(d, &c, TM_F32, 78);
    double *w1 = tt_read(a, tm_ctx_find(a, "layers.1.moe.experts.w0")), *w2 = tt_read(d, tm_ctx_find(d, "layers.1.moe.experts.w0"));
    cr_assert(w1[0] != w2[0]);
    free(w1), free(w2);
    tm_model_free(ma), tm_model_free(mb), tm_model_free(md);
    tm_ctx_free(a), tm_ctx_free(b), tm_ctx_free(d);
}

Test(model, loss_at_init_is_log_vocab) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = tm_model_config_default();
    c.n_layers = 2;
    c.d_model = 64;
    c.moe.ffn_size = 64;
    c.max_seq_len = 32;
    tm_model *m = make(ctx, &c, TM_F32, 3);
    enum { B = 8, T = 32 };
    int32_t tok[B * T + 1];
    fill_ids(tok, B * T + 1, 257, 4);
    tm_model_out o = forward(ctx, m, tok, tok + 1, B, T);
    /* Logits are about N(0, s^2), s = init_std sqrt(d_model) = 0.16, so E[ce] = log V + s^2 / 2
     * = log V + 0.013, and the mean over 256 tokens has a standard deviation of about 0.01. */
    cr_assert(fabs(o.ce_value - log(257.0)) < 0.05, "ce %g, log V = %g", o.ce_value, log(257.0));
    /* Balanced routing at init: the aux loss is about coeff per layer (its minimum). */
    cr_assert(o.aux_value > 0.9 * 2e-2 && o.aux_value < 1.2 * 2e-2, "aux %g", o.aux_value);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* ---- gradients --------------------------------------------------------------------------- */

typedef struct fd_case {
    tm_ctx *ctx;
    tm_model *m;
    const int32_t *tok, *tgt;
    int64_t B, T;
} fd_case;

static double loss_value(fd_case *f) {
    tm_ctx_arena_reset(f->ctx);
    tm_model_out o = forward(f->ctx, f->m, f->tok, f->tgt, f->B, f->T);
    return o.loss_value;
}

/* Central differences of the scalar training loss against tm_backward, on up to `per_tensor`
 * random elements of every parameter tensor. Returns the worst |a - n| / (atol + rtol |n|). */
static double model_gradcheck(fd_case *f, int per_tensor, double eps, double atol, double rtol, int verbose) {
    tm_ctx *ctx = f->ctx;
    TT_OK(ctx, tm_ctx_zero_grad(ctx));
    tm_ctx_arena_reset(ctx);
    tm_model_out o = forward(ctx, f->m, f->tok, f->tgt, f->B, f->T);
    TT_OK(ctx, tm_backward(ctx, o.loss));
    int prev = tm_ctx_set_grad_enabled(ctx, 0);
    double worst = 0;
    uint32_t r = 12345;
    for (int i = 0; i < tm_ctx_num_params(ctx); i++) {
        tm_tensor *p = tm_ctx_param(ctx, i);
        int64_t n = tm_tensor_numel(p);
        double *x = tt_read(ctx, p), *g = tt_read(ctx, tm_tensor_grad(p));
        double gmax = 0;
        for (int64_t j = 0; j < n; j++) gmax = fmax(gmax, fabs(g[j]));
        if (verbose) cr_assert(gmax > 0, "%s has no gradient at all", tm_tensor_name(p));
        int count = n < per_tensor ? (int)n : per_tensor;
        for (int s = 0; s < count; s++) {
            int64_t j = s;
            if (n > per_tensor) {
                r = r * 1664525u + 1013904223u;
                j = (int64_t)((r >> 4) % (uint32_t)n);
            }
            double x0 = x[j];
            x[j] = x0 + eps;
            TT_OK(ctx, tm_tensor_write(ctx, p, TM_F64, x, n));
            double lp = loss_value(f);
            x[j] = x0 - eps;
            TT_OK(ctx, tm_tensor_write(ctx, p, TM_F64, x, n));
            double lm = loss_value(f);
            x[j] = x0;
            TT_OK(ctx, tm_tensor_write(ctx, p, TM_F64, x, n));
            double num = (lp - lm) / (2 * eps), ratio = fabs(g[j] - num) / (atol + rtol * fabs(num));
            if (verbose && !(ratio <= 1))
                cr_log_warn("%s[%lld]: analytic %.10g numeric %.10g", tm_tensor_name(p), (long long)j, g[j], num);
            if (isnan(ratio)) ratio = INFINITY;
            worst = fmax(worst, ratio);
        }
        free(x), free(g);
    }
    tm_ctx_set_grad_enabled(ctx, prev);
    return worst;
}

Test(model, gradients_of_every_parameter_match_finite_differences) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = tiny_cfg();
    tm_model *m = make(ctx, &c, TM_F64, 2024);
    enum { B = 2, T = 5 };
    int32_t tok[B * T] = {1, 4, 6, 0, 2, 3, 3, 5, 1, 6}, tgt[B * T] = {4, 6, 0, 2, -1, 3, 5, 1, 6, 2};
    fd_case f = {ctx, m, tok, tgt, B, T};
    tm_ctx_arena_reset(ctx);
    tm_model_out o = forward(ctx, m, tok, tgt, B, T);
    /* Every part of the loss is on, so its gradient is checked too. */
    cr_assert(o.aux_value > 0 && o.seq_aux_value > 0 && o.z_value > 0);
    cr_assert_eq(tm_tensor_dtype(o.loss), TM_F64);
    double worst = model_gradcheck(&f, 30, 1e-6, 1e-8, 1e-5, 1);
    cr_assert(worst <= 1, "model gradient check: worst ratio %g", worst);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* The check above can fail: with any one op's backward deliberately wrong (its upstream
 * gradient scaled by 1.25), the same check reports a ratio > 1. So every op on the path, the
 * aux / seq-aux / z losses included, is covered by it. */
Test(model, gradient_check_catches_a_broken_backward_of_every_op_used) {
    const char *ops[] = {"embedding", "rmsnorm", "add_rmsnorm", "matmul", "view", "rope", "attention", "add", "swiglu",
                         "moe_router", "moe_aux_scores", "moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss",
                         "moe_permute", "moe_unpermute", "grouped_mlp", "cross_entropy"};
    enum { B = 2, T = 5 };
    int32_t tok[B * T] = {1, 4, 6, 0, 2, 3, 3, 5, 1, 6}, tgt[B * T] = {4, 6, 0, 2, -1, 3, 5, 1, 6, 2};
    for (size_t i = 0; i < sizeof ops / sizeof *ops; i++) {
        int id = -1;
        for (int k = 0; k < TM__NOPS; k++)
            if (strcmp(tm__op_table[k].name, ops[i]) == 0) id = k;
        cr_assert_geq(id, 0, "no op %s", ops[i]);
        tm_ctx *ctx = tt_ctx();
        tm_model_config c = tiny_cfg();
        tm_model *m = make(ctx, &c, TM_F64, 2024);
        tm__test_perturb_backward(ctx, id);
        fd_case f = {ctx, m, tok, tgt, B, T};
        double worst = model_gradcheck(&f, 10, 1e-6, 1e-8, 1e-5, 0);
        cr_assert_gt(worst, 1.0, "a broken backward of %s went unnoticed (ratio %g)", ops[i], worst);
        tm_model_free(m);
        tm_ctx_free(ctx);
    }
}

Test(model, tied_embeddings) {
    tm_ctx *ctx = tt_ctx(), *u = tt_ctx();
    tm_model_config c = tiny_cfg();
    c.tie_embeddings = 1;
    c.first_k_dense = 0;
    tm_model *m = make(ctx, &c, TM_F64, 7);
    cr_assert_null(tm_ctx_find(ctx, "lm_head.weight"));
    c.tie_embeddings = 0;
    tm_model *mu = make(u, &c, TM_F64, 7);
    int64_t tied = tm_model_num_params(m, NULL), untied = tm_model_num_params(mu, NULL);
    cr_assert_eq(untied - tied, 7 * 8);

    /* logits = rmsnorm(x) @ embed^T: put embed^T into the untied model's head (same seed, so
     * every other weight agrees) and the logits must match. */
    double *e = tt_read(ctx, tm_ctx_find(ctx, "embed.weight")), et[56];
    for (int v = 0; v < 7; v++)
        for (int h = 0; h < 8; h++) et[h * 7 + v] = e[v * 8 + h];
    TT_OK(u, tm_tensor_write(u, tm_ctx_find(u, "lm_head.weight"), TM_F64, et, 56));
    free(e);
    enum { B = 2, T = 6 };
    int32_t tok[B * T + 1];
    fill_ids(tok, B * T + 1, 7, 11);
    tm_model_out a = forward(ctx, m, tok, tok + 1, B, T), b = forward(u, mu, tok, tok + 1, B, T);
    tt_assert_close(ctx, a.logits, b.logits, 1e-12, 1e-12);

    /* The head's gradient reaches every row of the embedding, also rows of unused tokens. */
    int32_t few[B * T] = {0, 1, 0, 1, 0, 1, 1, 0, 1, 0, 1, 0};
    tm_ctx_arena_reset(ctx);
    TT_OK(ctx, tm_ctx_zero_grad(ctx));
    tm_model_out o = forward(ctx, m, few, few, B, T);
    TT_OK(ctx, tm_backward(ctx, o.loss));
    double *g = tt_read(ctx, tm_tensor_grad(tm_ctx_find(ctx, "embed.weight")));
    for (int v = 2; v < 7; v++) {
        double s = 0;
        for (int h = 0; h < 8; h++) s += fabs(g[v * 8 + h]);
        cr_assert(s > 0, "embedding row %d of an unused token got no gradient through the tied head", v);
    }
    free(g);
    int32_t tgt[B * T];
    fill_ids(tgt, B * T, 7, 12);
    fd_case f = {ctx, m, tok, tgt, B, T};
    double worst = model_gradcheck(&f, 20, 1e-6, 1e-8, 1e-5, 1);
    cr_assert(worst <= 1, "tied model gradient check: worst ratio %g", worst);
    tm_model_free(m), tm_model_free(mu);
    tm_ctx_free(ctx), tm_ctx_free(u);
}

/* ---- training ---------------------------------------------------------------------------- */

static double train_step(tm_ctx *ctx, tm_model *m, tm_optimizer *opt, const int32_t *tok, int64_t B, int64_t T) {
    tm_model_out o = forward(ctx, m, tok, tok + 1, B, T);
    TT_OK(ctx, tm_backward(ctx, o.loss));
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, NULL));
    TT_OK(ctx, tm_optimizer_step(opt, -1));
    TT_OK(ctx, tm_model_step(m));
    TT_OK(ctx, tm_ctx_zero_grad(ctx));
    tm_ctx_arena_reset(ctx);
    return o.ce_value;
}

Test(model, training_lowers_the_loss_without_allocating) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = small_cfg();
    c.first_k_dense = 1;
    c.moe.use_expert_bias = 1;
    c.moe.z_loss_coeff = 1e-3;
    tm_model *m = make(ctx, &c, TM_F32, 1);
    tm_adamw_config ac = tm_adamw_config_default();
    ac.lr = 1e-2;
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_adamw_new(ctx, &ac, &opt));
    enum { B = 4, T = 16 };
    int32_t tok[B * T + 1];
    fill_ids(tok, B * T + 1, c.vocab_size, 21);

    double first = train_step(ctx, m, opt, tok, B, T);
    uint64_t allocs = tm_ctx_alloc_count(ctx);
    double last = first;
    for (int s = 1; s < 30; s++) {
        last = train_step(ctx, m, opt, tok, B, T);
        if (s <= 3)
            cr_assert_eq(tm_ctx_alloc_count(ctx), allocs, "step %d allocated: %llu -> %llu", s + 1,
                         (unsigned long long)allocs, (unsigned long long)tm_ctx_alloc_count(ctx));
    }
    cr_assert(fabs(first - log(29.0)) < 0.05, "initial loss %g", first);
    cr_assert(last < 0.5 * first, "30 AdamW steps on one batch: loss %g -> %g", first, last);
    /* tm_model_step ran the expert-bias update of every MoE layer. */
    double *bias = tt_read(ctx, tm_ctx_find(ctx, "layers.1.moe.expert_bias"));
    double nz = 0;
    for (int e = 0; e < 4; e++) nz += fabs(bias[e]);
    cr_assert(nz > 0, "expert bias never updated");
    free(bias);
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(model, bf16_model_trains) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = small_cfg();
    tm_model *m = make(ctx, &c, TM_BF16, 1);
    tm_adamw_config ac = tm_adamw_config_default();
    ac.lr = 1e-2;
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_adamw_new(ctx, &ac, &opt));
    enum { B = 2, T = 16 };
    int32_t tok[B * T + 1];
    fill_ids(tok, B * T + 1, c.vocab_size, 5);
    tm_model_out o = forward(ctx, m, tok, tok + 1, B, T);
    cr_assert_eq(tm_tensor_dtype(o.logits), TM_BF16);
    cr_assert_eq(tm_tensor_dtype(o.loss), TM_F32, "the loss is taken in f32");
    tm_ctx_arena_reset(ctx);
    double first = train_step(ctx, m, opt, tok, B, T), last = first;
    for (int s = 0; s < 15; s++) last = train_step(ctx, m, opt, tok, B, T);
    cr_assert(isfinite(last) && last < first - 0.3, "bf16: loss %g -> %g", first, last);
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* ---- bad input --------------------------------------------------------------------------- */

Test(model, bad_tokens_and_targets_are_named) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = small_cfg();
    tm_model *m = make(ctx, &c, TM_F32, 1);
    enum { B = 2, T = 5 };
    int32_t tok[B * T] = {1, 2, 3, 4, 5, 6, 7, 29, 9, 10}, tgt[B * T] = {0, 1, 2, 3, 4, 5, -1, 7, 8, 9};
    tm_model_out o;
    memset(&o, 0x5a, sizeof o);
    tm_model_out before = o;
    cr_assert_eq(tm_model_forward(m, ids(ctx, tok, B, T), ids(ctx, tgt, B, T), &o), TM_ERR_INDEX);
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert(strstr(msg, "tokens[1, 2] = 29") && strstr(msg, "vocab_size = 29"), "%s", msg);
    cr_assert(memcmp(&o, &before, sizeof o) == 0, "out written on failure");

    tok[7] = -3;
    cr_assert_eq(tm_model_forward(m, ids(ctx, tok, B, T), NULL, &o), TM_ERR_INDEX);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "[1, 2] = -3"), "%s", tm_ctx_errmsg(ctx));
    tok[7] = 8;

    tgt[3] = 40; /* -1 is the ignore index and fine; 40 is not */
    cr_assert_eq(tm_model_forward(m, ids(ctx, tok, B, T), ids(ctx, tgt, B, T), &o), TM_ERR_INDEX);
    msg = tm_ctx_errmsg(ctx);
    cr_assert(strstr(msg, "targets[0, 3] = 40") && strstr(msg, "ignore index -1"), "%s", msg);
    /* Refused before anything ran: the MoE layers counted no tokens for the expert-bias step. */
    double *sum = tt_read(ctx, tm_ctx_find(ctx, "layers.0.moe.tokens_per_expert_sum"));
    for (int e = 0; e < 4; e++) cr_assert_eq(sum[e], 0, "a refused batch was counted");
    free(sum);
    tgt[3] = 3;
    TT_OK(ctx, tm_model_forward(m, ids(ctx, tok, B, T), ids(ctx, tgt, B, T), &o));
    /* A valid batch is counted, once, after its check. */
    sum = tt_read(ctx, tm_ctx_find(ctx, "layers.0.moe.tokens_per_expert_sum"));
    for (int e = 0; e < 4; e++) cr_assert_eq(sum[e], (double)o.tokens_per_expert[e], "expert %d", e);
    free(sum);

    /* Sequence longer than max_seq_len = 16. */
    int32_t longer[17] = {0};
    cr_assert_eq(tm_model_forward(m, ids(ctx, longer, 1, 17), NULL, &o), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "max_seq_len = 16") && strstr(tm_ctx_errmsg(ctx), "17"), "%s",
              tm_ctx_errmsg(ctx));
    /* Wrong dtype, rank, shape of targets, NULLs. */
    int64_t s2[2] = {B, T}, s1[1] = {B * T};
    tm_tensor *t64, *t1;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 2, s2, tm_cpu(), TM_I32, tok, &t64));
    cr_assert_eq(tm_model_forward(m, t64, NULL, &o), TM_ERR_DTYPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "tokens") && strstr(tm_ctx_errmsg(ctx), "i64"), "%s", tm_ctx_errmsg(ctx));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 1, s1, tm_cpu(), TM_I32, tok, &t1));
    cr_assert_eq(tm_model_forward(m, t1, NULL, &o), TM_ERR_SHAPE);
    cr_assert_eq(tm_model_forward(m, ids(ctx, tok, B, T), ids(ctx, tgt, 1, T), &o), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "targets"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_model_forward(m, NULL, NULL, &o), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_model_forward(m, ids(ctx, tok, B, T), NULL, NULL), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_model_forward(NULL, ids(ctx, tok, B, T), NULL, &o), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_model_init(NULL, 1), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_model_step(NULL), TM_ERR_INVALID_ARG);
    cr_assert_null(tm_model_get_config(NULL));
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(model, dense_ffn_size_zero_means_four_d_model) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = tm_model_config_default();
    c.d_model = 16;
    c.n_heads = 2;
    c.n_kv_heads = 2;
    c.n_layers = 2;
    c.first_k_dense = 1;
    c.dense_ffn_size = 0;
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    tm_tensor *w0 = tm_ctx_find(ctx, "layers.0.mlp.w0");
    cr_assert_not_null(w0);
    cr_assert_eq(tm_tensor_dim(w0, 1), 64);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(model, eval_forwards_do_not_move_the_expert_bias) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 11;
    c.d_model = 16;
    c.n_heads = 2;
    c.n_kv_heads = 2;
    c.n_layers = 1;
    c.moe.use_expert_bias = 1;
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, 3));
    int64_t s[2] = {2, 8};
    tm_tensor *tok = tt_randint(ctx, TM_I32, 2, s, 1, 11);
    tm_model_out out;
    int prev = tm_ctx_set_grad_enabled(ctx, 0);
    TT_OK(ctx, tm_model_forward(m, tok, NULL, &out));
    tm_ctx_set_grad_enabled(ctx, prev);
    TT_OK(ctx, tm_model_step(m));
    double bias[4];
    TT_OK(ctx, tm_tensor_read(ctx, tm_ctx_find(ctx, "layers.0.moe.expert_bias"), TM_F64, bias, 4));
    for (int e = 0; e < 4; e++) cr_assert_eq(bias[e], 0.0, "bias moved by an eval forward");
    TT_OK(ctx, tm_model_forward(m, tok, NULL, &out)); /* a training forward does count */
    TT_OK(ctx, tm_model_step(m));
    TT_OK(ctx, tm_tensor_read(ctx, tm_ctx_find(ctx, "layers.0.moe.expert_bias"), TM_F64, bias, 4));
    int moved = 0;
    for (int e = 0; e < 4; e++) moved |= bias[e] != 0.0;
    cr_assert(moved, "a training forward must feed the bias update");
    tm_model_free(m);
    tm_ctx_free(ctx);
}
