/*
 * moe_router.c — tm_moe_router (fused top-k router) and tm_moe_aux_scores: public entry points,
 * configuration checks and output allocation; tm_moe_aux_counts, Megatron's clean top-k for the
 * balance losses, built on the router op.
 * Kernels: kernels/cpu/moe_router.c (the attribute packing and the math are documented there).
 */
#include <math.h>

#include "internal.h"

tm_router_config tm_router_config_default(void) {
    tm_router_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_experts = 8;
    cfg.topk = 2;
    cfg.score_function = TM_SCORE_SOFTMAX;
    cfg.use_pre_softmax = 1;
    cfg.num_groups = 0;
    cfg.group_topk = 0;
    cfg.scaling_factor = 1.0;
    cfg.norm_topk_prob = 0;
    cfg.force_load_balance = 0;
    return cfg;
}

static int valid_score_function(int64_t f) { return f == TM_SCORE_SOFTMAX || f == TM_SCORE_SIGMOID; }

/* logits must be a float [T, E] matrix with E >= 1 (shared by both ops). */
static tm_status check_logits(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *l = c->in[0];
    if (!tm__is_float(l->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "%s: logits must be f32, bf16 or f64, got %s", tm__opname(c),
                       tm__tdesc(ctx, l));
    if (l->ndim != 2 || l->shape[1] < 1)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: logits must be [T, E] with E >= 1, got %s", tm__opname(c),
                       tm__tdesc(ctx, l));
    return TM_OK;
}

/* Attribute layout: see the top of kernels/cpu/moe_router.c. The configuration is checked here,
 * not in tm_moe_router, so every caller of the op (the MoE block included) gets the same
 * messages; each names the offending field and its value. */
tm_status tm__moe_router_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const int64_t E = c->iattr[0], k = c->iattr[1], score = c->iattr[2];
    const int64_t G = c->iattr[4], gk = c->iattr[5], force = c->iattr[7];
    const double scaling = c->fattr[0];
    if (c->n_in != 1 && c->n_in != 2)
        return tm__err(ctx, TM_ERR_INTERNAL, "moe_router: %d inputs, expected logits and an optional expert_bias",
                       c->n_in);
    if (!valid_score_function(score))
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "moe_router: score_function = %lld is not TM_SCORE_SOFTMAX (0) or TM_SCORE_SIGMOID (1)",
                       (long long)score);
    if (force != 0 && force != 1)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: force_load_balance = %lld must be 0 or 1",
                       (long long)force);
    TM__TRY(check_logits(c));
    const tm_tensor *l = c->in[0];
    if (E < 1)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: num_experts = %lld must be >= 1", (long long)E);
    if (l->shape[1] != E)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_router: logits must be [T, num_experts = %lld], got %s",
                       (long long)E, tm__tdesc(ctx, l));
    if (k < 1)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: topk = %lld must be >= 1", (long long)k);
    if (k > E)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: topk = %lld exceeds num_experts = %lld",
                       (long long)k, (long long)E);
    if (G < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: num_groups = %lld must be >= 0 (0 or 1: no groups)",
                       (long long)G);
    if (G > 1) {
        if (E % G != 0)
            return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: num_experts = %lld is not a multiple of num_groups = %lld",
                           (long long)E, (long long)G);
        if (gk < 1 || gk > G)
            return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: group_topk = %lld outside [1, num_groups = %lld]",
                           (long long)gk, (long long)G);
        if (k % gk != 0)
            return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: topk = %lld is not a multiple of group_topk = %lld",
                           (long long)k, (long long)gk);
        if (k / gk > E / G)
            return tm__err(ctx, TM_ERR_INVALID_ARG,
                           "moe_router: topk / group_topk = %lld experts per kept group exceeds the %lld experts of a "
                           "group (num_experts %lld / num_groups %lld)",
                           (long long)(k / gk), (long long)(E / G), (long long)E, (long long)G);
    }
    if (!(scaling > 0.0) || isinf(scaling))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: scaling_factor = %g must be finite and > 0", scaling);
    if (c->n_in == 2) {
        const tm_tensor *b = c->in[1];
        if (!tm__is_float(b->dtype))
            return tm__err(ctx, TM_ERR_DTYPE, "moe_router: expert_bias must be f32, bf16 or f64, got %s",
                           tm__tdesc(ctx, b));
        if (b->ndim != 1 || b->shape[0] != E)
            return tm__err(ctx, TM_ERR_SHAPE, "moe_router: expert_bias must be [num_experts = %lld], got %s",
                           (long long)E, tm__tdesc(ctx, b));
    }
    const int64_t T = l->shape[0];
    const int64_t te[2] = {T, E}, tk[2] = {T, k};
    TM__TRY(tm__out_new(c, 0, l->dtype, 2, te)); /* probs */
    TM__TRY(tm__out_new(c, 1, TM_U8, 2, te));    /* routing_map */
    TM__TRY(tm__out_new(c, 2, TM_I32, 2, tk));   /* topk_idx */
    TM__TRY(tm__out_new(c, 3, l->dtype, 2, tk)); /* topk_weights */
    return tm__out_new(c, 4, TM_I64, 1, &E);    /* tokens_per_expert */
}

tm_status tm_moe_router(tm_ctx *ctx, tm_tensor *logits, tm_tensor *expert_bias, const tm_router_config *cfg,
                        tm_router_out *out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: out is NULL");
    memset(out, 0, sizeof *out);
    if (!cfg) return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_router: cfg is NULL");
    tm__call c = tm__call_init(ctx, TM__OP_MOE_ROUTER);
    c.n_in = expert_bias ? 2 : 1;
    c.in[0] = logits;
    c.in[1] = expert_bias;
    c.iattr[0] = cfg->num_experts;
    c.iattr[1] = cfg->topk;
    c.iattr[2] = (int64_t)cfg->score_function;
    c.iattr[3] = cfg->use_pre_softmax != 0;
    c.iattr[4] = cfg->num_groups;
    c.iattr[5] = cfg->group_topk;
    c.iattr[6] = cfg->norm_topk_prob != 0;
    c.iattr[7] = cfg->force_load_balance; /* as given: the check refuses anything but 0 and 1 */
    c.fattr[0] = cfg->scaling_factor;
    TM__TRY(tm__op_run(&c));
    out->probs = c.out[0];
    out->routing_map = c.out[1];
    out->topk_idx = c.out[2];
    out->topk_weights = c.out[3];
    out->tokens_per_expert = c.out[4];
    return TM_OK;
}

tm_status tm__moe_aux_scores_check(tm__call *c) {
    const int64_t score = c->iattr[0];
    if (!valid_score_function(score))
        return tm__err(c->ctx, TM_ERR_INVALID_ARG,
                       "moe_aux_scores: score_function = %lld is not TM_SCORE_SOFTMAX (0) or TM_SCORE_SIGMOID (1)",
                       (long long)score);
    TM__TRY(check_logits(c));
    return tm__out_new(c, 0, c->in[0]->dtype, 2, c->in[0]->shape);
}

tm_status tm_moe_aux_scores(tm_ctx *ctx, tm_tensor *logits, tm_score_function score_function, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_MOE_AUX_SCORES);
    c.n_in = 1;
    c.in[0] = logits;
    c.iattr[0] = (int64_t)score_function;
    return tm__op_run1(&c, out);
}

/* Megatron's clean counts (include/tinymoe.h): a plain top-k of the logits, which is the top-k
 * of the aux scores of either score function since both keep a row's order. The router op
 * with softmax-post selection (v = logits), no groups and no bias computes exactly that with
 * the router's tie rule; selecting on softmax(l) instead would let two logits whose
 * probabilities round to the same double (underflow to 0) tie where the logits do not.
 * The arguments are checked here first so that the messages name this function and its
 * arguments, not a router config the caller never wrote. Grad mode is off around the op: the
 * result is a selection, and its float outputs (dropped) must not reach the tape. */
tm_status tm_moe_aux_counts(tm_ctx *ctx, tm_tensor *logits, int topk, tm_tensor **routing_map,
                            tm_tensor **tokens_per_expert) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!logits || !routing_map || !tokens_per_expert)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_aux_counts: %s is NULL",
                       !logits ? "logits" : !routing_map ? "routing_map" : "tokens_per_expert");
    if (logits->ctx != ctx)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_aux_counts: logits %s belongs to another context",
                       tm__tdesc(ctx, logits));
    if (!tm__is_float(logits->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "moe_aux_counts: logits must be f32, bf16 or f64, got %s",
                       tm__tdesc(ctx, logits));
    if (logits->ndim != 2 || logits->shape[1] < 1)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_aux_counts: logits must be [T, E] with E >= 1, got %s",
                       tm__tdesc(ctx, logits));
    const int64_t E = logits->shape[1];
    if (topk < 1 || topk > E)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_aux_counts: topk = %d must be in [1, E = %lld] (logits %s)", topk,
                       (long long)E, tm__tdesc(ctx, logits));
    tm__call c = tm__call_init(ctx, TM__OP_MOE_ROUTER);
    c.n_in = 1;
    c.in[0] = logits;
    c.iattr[0] = E;
    c.iattr[1] = topk;
    c.iattr[2] = TM_SCORE_SOFTMAX;
    c.iattr[3] = 0; /* softmax-post: select on the logits themselves */
    c.iattr[4] = 0; /* no groups */
    c.iattr[5] = 0;
    c.iattr[6] = 0;
    c.iattr[7] = 0; /* a top-k of the scores, never forced */
    c.fattr[0] = 1.0;
    const int prev = tm_ctx_set_grad_enabled(ctx, 0);
    const tm_status s = tm__op_run(&c);
    tm_ctx_set_grad_enabled(ctx, prev);
    TM__TRY(s);
    *routing_map = c.out[1];
    *tokens_per_expert = c.out[4];
    return TM_OK;
}
