/* test_arena.c — a steady-state training step performs no system allocation.
 *
 * One decoder block of a small transformer LM (embedding, rmsnorm, matmul, rope, grouped-query
 * attention, swiglu, add, cross_entropy), then backward, gradient clipping, an AdamW step and
 * tm_ctx_arena_reset. The first step may grow the arenas; the second and third, repeating the
 * same sequence of allocations, must reuse them: tm_ctx_alloc_count may not move. The same
 * batch is used every step, so AdamW must also lower its loss. */
#include <math.h>
#include <string.h>

#include "common.h"

enum { B = 2, T = 7, C = 24, HQ = 4, HKV = 2, D = C / HQ, FF = 20, V = 19 };

typedef struct {
    tm_tensor *wte, *norm1, *wq, *wk, *wv, *wo, *norm2, *wg, *wu, *wd, *normf, *lm_head;
} model;

static tm_tensor *param(tm_ctx *ctx, const char *name, int ndim, int64_t d0, int64_t d1, double std) {
    int64_t s[2] = {d0, d1};
    tm_tensor *p = NULL;
    TT_OK(ctx, tm_param_new(ctx, name, TM_F32, ndim, s, tm_cpu(), &p));
    if (std > 0)
        TT_OK(ctx, tm_tensor_init_normal(ctx, p, 1234, NULL, 0.0, std));
    else
        TT_OK(ctx, tm_tensor_fill(ctx, p, 1.0));
    return p;
}

static model build(tm_ctx *ctx) {
    model m;
    m.wte = param(ctx, "wte", 2, V, C, 0.5);
    m.norm1 = param(ctx, "norm1", 1, C, 0, 0);
    m.wq = param(ctx, "wq", 2, C, HQ * D, 0.3);
    m.wk = param(ctx, "wk", 2, C, HKV * D, 0.3);
    m.wv = param(ctx, "wv", 2, C, HKV * D, 0.3);
    m.wo = param(ctx, "wo", 2, HQ * D, C, 0.3);
    m.norm2 = param(ctx, "norm2", 1, C, 0, 0);
    m.wg = param(ctx, "wg", 2, C, FF, 0.3);
    m.wu = param(ctx, "wu", 2, C, FF, 0.3);
    m.wd = param(ctx, "wd", 2, FF, C, 0.3);
    m.normf = param(ctx, "normf", 1, C, 0, 0);
    m.lm_head = param(ctx, "lm_head", 2, C, V, 0.3);
    return m;
}

static tm_tensor *mm(tm_ctx *ctx, tm_tensor *a, tm_tensor *b) {
    tm_tensor *o = NULL;
    TT_OK(ctx, tm_matmul(ctx, a, b, 0, 0, &o));
    return o;
}
static tm_tensor *reshape(tm_ctx *ctx, tm_tensor *x, int ndim, const int64_t *s) {
    tm_tensor *o = NULL;
    TT_OK(ctx, tm_reshape(ctx, x, ndim, s, &o));
    return o;
}

/* One training step; returns the loss before the update. */
static double train_step(tm_ctx *ctx, const model *m, tm_optimizer *opt, const int32_t *tokens) {
    int64_t sbt[2] = {B, T}, sn[1] = {B * T};
    tm_tensor *ids, *tgt, *x, *h, *q, *k, *v, *a, *t1, *t2, *loss;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, sbt, tm_cpu(), TM_I32, tokens, &ids));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 1, sn, tm_cpu(), TM_I32, tokens + 1, &tgt));

    TT_OK(ctx, tm_embedding(ctx, m->wte, ids, &x));                     // (B, T, C)
    TT_OK(ctx, tm_rmsnorm(ctx, x, m->norm1, 1e-6, &h));
    int64_t sq[4] = {B, T, HQ, D}, skv[4] = {B, T, HKV, D}, sc[3] = {B, T, C};
    q = reshape(ctx, mm(ctx, h, m->wq), 4, sq);                         // (B, T, HQ, D)
    k = reshape(ctx, mm(ctx, h, m->wk), 4, skv);                        // (B, T, HKV, D)
    v = reshape(ctx, mm(ctx, h, m->wv), 4, skv);
    TT_OK(ctx, tm_rope(ctx, q, 0, 10000.0, &q));
    TT_OK(ctx, tm_rope(ctx, k, 0, 10000.0, &k));
    TT_OK(ctx, tm_attention(ctx, q, k, v, 0.0, &a));                   // (B, T, HQ, D)
    a = mm(ctx, reshape(ctx, a, 3, sc), m->wo);                         // (B, T, C)
    TT_OK(ctx, tm_add(ctx, x, a, &x));

    TT_OK(ctx, tm_rmsnorm(ctx, x, m->norm2, 1e-6, &h));
    TT_OK(ctx, tm_swiglu(ctx, mm(ctx, h, m->wg), mm(ctx, h, m->wu), &t1)); // (B, T, FF)
    TT_OK(ctx, tm_add(ctx, x, mm(ctx, t1, m->wd), &x));

    TT_OK(ctx, tm_rmsnorm(ctx, x, m->normf, 1e-6, &h));
    int64_t slog[2] = {B * T, V};
    t2 = reshape(ctx, mm(ctx, h, m->lm_head), 2, slog);                 // (B*T, V)
    TT_OK(ctx, tm_cross_entropy(ctx, t2, tgt, -1, &loss));
    float lv = 0;
    TT_OK(ctx, tm_tensor_read(ctx, loss, TM_F32, &lv, 1));

    TT_OK(ctx, tm_backward(ctx, loss));
    double norm = 0;
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, &norm));
    cr_assert(norm > 0 && isfinite(norm), "grad norm %g", norm);
    TT_OK(ctx, tm_optimizer_step(opt, -1.0));
    TT_OK(ctx, tm_ctx_zero_grad(ctx));
    tm_ctx_arena_reset(ctx);
    return lv;
}

Test(arena, steady_state_step_allocates_nothing) {
    tm_ctx *ctx = tt_ctx();
    model m = build(ctx);
    tm_adamw_config cfg = tm_adamw_config_default();
    cfg.lr = 1e-2;
    cfg.weight_decay = 0.1;
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_adamw_new(ctx, &cfg, &opt));

    int32_t tokens[B * T + 1];
    for (int i = 0; i < B * T + 1; i++) tokens[i] = (int32_t)((i * 7 + 3) % V);

    double l1 = train_step(ctx, &m, opt, tokens);
    uint64_t after1 = tm_ctx_alloc_count(ctx);
    cr_assert_eq(tm_ctx_arena_used(ctx, tm_cpu()), 0, "arena not rewound by reset");
    size_t peak = tm_ctx_arena_peak(ctx, tm_cpu());
    cr_assert_gt(peak, 0);

    double l2 = train_step(ctx, &m, opt, tokens);
    cr_assert_eq(tm_ctx_alloc_count(ctx), after1, "second step allocated: %llu -> %llu",
                 (unsigned long long)after1, (unsigned long long)tm_ctx_alloc_count(ctx));
    double l3 = train_step(ctx, &m, opt, tokens);
    cr_assert_eq(tm_ctx_alloc_count(ctx), after1, "third step allocated: %llu -> %llu",
                 (unsigned long long)after1, (unsigned long long)tm_ctx_alloc_count(ctx));

    cr_assert_eq(tm_ctx_arena_used(ctx, tm_cpu()), 0);
    cr_assert_eq(tm_ctx_arena_peak(ctx, tm_cpu()), peak, "identical steps, different peak");
    cr_assert_eq(tm_optimizer_steps(opt), 3);
    cr_assert(isfinite(l1) && l2 < l1 && l3 < l2, "loss did not decrease: %g %g %g", l1, l2, l3);
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}
