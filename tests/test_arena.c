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

/* ---- ragged shapes ---------------------------------------------------------------------------
 *
 * The sizes of an expert-parallel MoE step change every step: each layer's received rows R_l
 * follow the routing, early in training up to ~10x the mean on one rank (issue 19: the fine
 * preset's all-to-all ran a GPU out of its 80 GB while the arena had 17 GB in use). The workload
 * below allocates as such a step does, on any device of the context: per layer, in the forward,
 * a fixed activation, rows proportional to R_l that are saved for the backward, and scratch that
 * dies at once; in the backward, in reverse layer order, gradients proportional to R_l, the saved
 * rows given back, the gradients consumed. R_l is drawn per step and layer from a skewed
 * distribution (0.1x to 12x), and every step's in-use peak is different. The arena must keep
 * what it reserves from the device within 1.5x of the largest in-use peak over 200 steps. */
#include "internal.h"

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

enum { RL = 6 };

void tt_ragged_workload(tm_ctx *ctx, tm_device dev, size_t unit, int steps, size_t *max_peak, size_t *max_reserved) {
    uint64_t seed = 42;
    *max_peak = *max_reserved = 0;
    for (int s = 0; s < steps; s++) {
        void *act[RL], *saved[RL][2];
        size_t rows[RL];
        for (int l = 0; l < RL; l++) {
            double u = (double)(splitmix(&seed) >> 11) / 9007199254740992.0;
            double f = 0.1 * pow(120.0, u * u); /* 0.1x .. 12x of the mean, mostly small */
            rows[l] = (size_t)(f * (double)unit) + 64 * (l + 1);
        }
        for (int l = 0; l < RL; l++) {
            act[l] = tm__arena_alloc(ctx, dev, unit / 2);
            saved[l][0] = tm__arena_alloc(ctx, dev, rows[l]);
            saved[l][1] = tm__arena_alloc(ctx, dev, 3 * rows[l]);
            void *scratch = tm__arena_alloc(ctx, dev, 2 * rows[l] + 4096);
            cr_assert(act[l] && saved[l][0] && saved[l][1] && scratch, "step %d layer %d: %s", s, l, tm_ctx_errmsg(ctx));
            tm__arena_free(ctx, dev, scratch, 2 * rows[l] + 4096);
        }
        void *gy = tm__arena_alloc(ctx, dev, unit / 2);
        for (int l = RL - 1; l >= 0; l--) {
            void *g1 = tm__arena_alloc(ctx, dev, 3 * rows[l]);
            void *g0 = tm__arena_alloc(ctx, dev, rows[l]);
            cr_assert(g0 && g1, "step %d layer %d backward: %s", s, l, tm_ctx_errmsg(ctx));
            tm__arena_free(ctx, dev, saved[l][1], 3 * rows[l]);
            tm__arena_free(ctx, dev, g1, 3 * rows[l]);
            tm__arena_free(ctx, dev, saved[l][0], rows[l]);
            void *gx = tm__arena_alloc(ctx, dev, unit / 2);
            cr_assert(gx, "step %d layer %d backward: %s", s, l, tm_ctx_errmsg(ctx));
            tm__arena_free(ctx, dev, gy, unit / 2);
            tm__arena_free(ctx, dev, g0, rows[l]);
            gy = gx;
        }
        tm_memory_report mr;
        TT_OK(ctx, tm_ctx_memory_report(ctx, dev, &mr));
        if (mr.reserved > *max_reserved) *max_reserved = mr.reserved;
        tm_ctx_arena_reset(ctx);
        TT_OK(ctx, tm_ctx_memory_report(ctx, dev, &mr));
        if (mr.reserved_peak > *max_reserved) *max_reserved = mr.reserved_peak;
        (void)act;
    }
    *max_peak = tm_ctx_arena_peak(ctx, dev);
}

Test(arena, ragged_steps_reserve_within_1_5x_of_peak) {
    tm_ctx *ctx = tt_ctx(); /* 4 MiB chunks: the workload's blocks are up to ~40 MiB */
    size_t peak, reserved;
    tt_ragged_workload(ctx, tm_cpu(), (size_t)1 << 20, 200, &peak, &reserved);
    tm_memory_report mr;
    TT_OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &mr));
    cr_log_info("ragged: in-use peak %.1f MiB, reserved peak %.1f MiB (%.2fx), %llu trims", peak / 1048576.0,
                reserved / 1048576.0, (double)reserved / (double)peak, (unsigned long long)mr.arena_trims);
    cr_assert(peak > 0);
    cr_assert(reserved <= peak + peak / 2, "reserved %zu bytes for an in-use peak of %zu (%.2fx > 1.5x)", reserved, peak,
              (double)reserved / (double)peak);
    cr_assert_eq(mr.current[TM_MEM_TEMPORARIES], 0);
    tm_ctx_free(ctx);
}

/* A block given back merges with its free neighbours: three adjacent blocks freed in any order
 * serve one request of their summed size without a new chunk. */
Test(arena, freed_neighbours_coalesce) {
    tm_ctx *ctx = tt_ctx();
    const size_t k = (size_t)1 << 20;
    void *a = tm__arena_alloc(ctx, tm_cpu(), k), *b = tm__arena_alloc(ctx, tm_cpu(), k),
         *c = tm__arena_alloc(ctx, tm_cpu(), k), *d = tm__arena_alloc(ctx, tm_cpu(), k);
    cr_assert(a && b && c && d);
    cr_assert_eq((char *)b, (char *)a + k, "blocks not adjacent");
    cr_assert_eq((char *)c, (char *)b + k);
    uint64_t n0 = tm_ctx_alloc_count(ctx);
    tm__arena_free(ctx, tm_cpu(), c, k);
    tm__arena_free(ctx, tm_cpu(), a, k);
    tm__arena_free(ctx, tm_cpu(), b, k);
    void *big = tm__arena_alloc(ctx, tm_cpu(), 3 * k);
    cr_assert_eq(big, a, "the three freed blocks did not serve the merged request");
    cr_assert_eq(tm_ctx_alloc_count(ctx), n0, "a chunk was added");
    cr_assert_eq(tm_ctx_arena_used(ctx, tm_cpu()), 4 * k);
    tm_ctx_free(ctx);
}
