/* test_optim.c — AdamW against the documented update rule, weight-decay placement, config
 * validation, and tm_ctx_clip_grad_norm against closed forms.
 *
 * The AdamW cases write the gradients directly (tm_tensor_write on tm_tensor_grad) so the
 * optimizer is tested alone, with gradients known exactly at every step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* The reference: tinymoe.h's formula in f64, with m and v rounded to f32 after each step
 * because the optimizer's state is f32 (the update itself uses the unrounded m, v, as the
 * kernel does). */
typedef struct {
    double lr, b1, b2, eps, wd;
} ref_cfg;

static void ref_step(double *p, double *m, double *v, const double *g, int n, int t, double lr,
                     const ref_cfg *c, int decay) {
    double bc1 = 1.0 - pow(c->b1, t), bc2 = 1.0 - pow(c->b2, t);
    for (int i = 0; i < n; i++) {
        double mi = c->b1 * m[i] + (1.0 - c->b1) * g[i];
        double vi = c->b2 * v[i] + (1.0 - c->b2) * g[i] * g[i];
        m[i] = (float)mi;
        v[i] = (float)vi;
        p[i] -= lr * ((mi / bc1) / (sqrt(vi / bc2) + c->eps) + (decay ? c->wd : 0.0) * p[i]);
    }
}

/* Two parameters: W [2,2] (decayed) and b [3] (not decayed), three steps with fixed
 * gradients, the third with an explicitly scheduled lr. */
enum { NW = 4, NB = 3, NSTEPS = 3 };
static const double W0[NW] = {0.5, -1.25, 2.0, 0.0};
static const double B0[NB] = {0.5, 0.75, -0.3};
static const double GW[NSTEPS][NW] = {{2.0, -0.5, 1e-3, 4.0}, {-1.0, 0.25, 3.0, 4.0}, {0.5, 0.0, -2.0, -8.0}};
static const double GB[NSTEPS][NB] = {{-3.0, 0.125, 7.0}, {1.0, -0.125, -7.0}, {2.5, 0.0, 0.5}};
static const double LR_T[NSTEPS] = {-1.0, -1.0, 0.05}; /* -1: the configured lr */

static void run_three_steps(tm_dtype dt, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    int64_t sw[2] = {2, 2}, sb[1] = {NB};
    tm_tensor *w = NULL, *b = NULL;
    TT_OK(ctx, tm_param_new(ctx, "w", dt, 2, sw, tm_cpu(), &w));
    TT_OK(ctx, tm_param_new(ctx, "b", dt, 1, sb, tm_cpu(), &b));
    TT_OK(ctx, tm_tensor_write(ctx, w, TM_F64, W0, NW));
    TT_OK(ctx, tm_tensor_write(ctx, b, TM_F64, B0, NB));

    tm_adamw_config cfg = tm_adamw_config_default();
    cfg.lr = 0.1;
    cfg.beta1 = 0.8;
    cfg.beta2 = 0.95;
    cfg.eps = 1e-6;
    cfg.weight_decay = 0.1;
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_adamw_new(ctx, &cfg, &opt));
    cr_assert_eq(tm_optimizer_steps(opt), 0);

    ref_cfg rc = {cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay};
    double pw[NW], pb[NB], mw[NW] = {0}, vw[NW] = {0}, mb[NB] = {0}, vb[NB] = {0};
    /* The reference starts from the parameter's stored values (bf16 rounds W0/B0). */
    TT_OK(ctx, tm_tensor_read(ctx, w, TM_F64, pw, NW));
    TT_OK(ctx, tm_tensor_read(ctx, b, TM_F64, pb, NB));
    for (int t = 1; t <= NSTEPS; t++) {
        TT_OK(ctx, tm_tensor_write(ctx, tm_tensor_grad(w), TM_F64, GW[t - 1], NW));
        TT_OK(ctx, tm_tensor_write(ctx, tm_tensor_grad(b), TM_F64, GB[t - 1], NB));
        /* The gradients as stored (f32 / bf16 round them). */
        double gw[NW], gb[NB];
        TT_OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(w), TM_F64, gw, NW));
        TT_OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(b), TM_F64, gb, NB));
        TT_OK(ctx, tm_optimizer_step(opt, LR_T[t - 1]));
        double lr = LR_T[t - 1] < 0 ? cfg.lr : LR_T[t - 1];
        ref_step(pw, mw, vw, gw, NW, t, lr, &rc, 1);
        ref_step(pb, mb, vb, gb, NB, t, lr, &rc, 0);
        if (dt == TM_BF16) { /* bf16: updated on an f32 master, never rounded to bf16 */
            for (int i = 0; i < NW; i++) pw[i] = (float)pw[i];
            for (int i = 0; i < NB; i++) pb[i] = (float)pb[i];
            tt_assert_close_host(ctx, tm_ctx_find(ctx, "w.master"), pw, 1e-30, 1e-5);
            tt_assert_close_host(ctx, tm_ctx_find(ctx, "b.master"), pb, 1e-30, 1e-5);
        }
        tt_assert_close_host(ctx, w, pw, atol, rtol);
        tt_assert_close_host(ctx, b, pb, atol, rtol);
        cr_assert_eq(tm_optimizer_steps(opt), t);
    }
    /* The state is reachable by name and holds the reference's (f32-rounded) moments. */
    tm_tensor *m = tm_ctx_find(ctx, "w.adamw_m"), *v = tm_ctx_find(ctx, "b.adamw_v");
    cr_assert(m && v);
    cr_assert_eq(tm_tensor_dtype(m), TM_F32);
    tt_assert_close_host(ctx, m, mw, 1e-30, 1e-6);
    tt_assert_close_host(ctx, v, vb, 1e-30, 1e-6);
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

Test(optim, adamw_three_steps_f64) { run_three_steps(TM_F64, 1e-13, 1e-13); }
Test(optim, adamw_three_steps_f32) { run_three_steps(TM_F32, 1e-6, 1e-6); }
/* bf16 parameters are their f32 master rounded to bf16: within half a bf16 ulp of the
 * reference, the master itself within f32 rounding. */
Test(optim, adamw_three_steps_bf16) { run_three_steps(TM_BF16, 1e-30, 8e-3); }

/* Step 1 by hand: m = (1-b1) g and v = (1-b2) g^2 make the bias-corrected ratio g / (|g| + eps),
 * so with lr 0.1, wd 0.1, eps 1e-8:
 *   2-D p = 0.5, g = 2:   0.5 - 0.1 * (2 / (2 + 1e-8) + 0.1 * 0.5) = 0.3950000005
 *   1-D p = 0.5, g = -3:  0.5 + 0.1 * 3 / (3 + 1e-8)               = 0.59999999966666...
 */
Test(optim, adamw_first_step_literal) {
    tm_ctx *ctx = tt_ctx();
    int64_t s2[2] = {1, 1}, s1[1] = {1};
    tm_tensor *w = NULL, *b = NULL;
    TT_OK(ctx, tm_param_new(ctx, "w", TM_F64, 2, s2, tm_cpu(), &w));
    TT_OK(ctx, tm_param_new(ctx, "b", TM_F64, 1, s1, tm_cpu(), &b));
    TT_OK(ctx, tm_tensor_fill(ctx, w, 0.5));
    TT_OK(ctx, tm_tensor_fill(ctx, b, 0.5));
    TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(w), 2.0));
    TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(b), -3.0));
    tm_adamw_config cfg = tm_adamw_config_default();
    cfg.lr = 0.1;
    cfg.weight_decay = 0.1;
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_adamw_new(ctx, &cfg, &opt));
    TT_OK(ctx, tm_optimizer_step(opt, -1.0));
    double got_w, got_b;
    TT_OK(ctx, tm_tensor_read(ctx, w, TM_F64, &got_w, 1));
    TT_OK(ctx, tm_tensor_read(ctx, b, TM_F64, &got_b, 1));
    cr_assert(fabs(got_w - 0.3950000005) < 1e-14, "w = %.17g", got_w);
    cr_assert(fabs(got_b - 0.5999999996666667) < 1e-14, "b = %.17g", got_b);
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

/* With zero gradients the Adam term is exactly 0, leaving only the decay: p *= 1 - lr * wd on
 * parameters of 2+ dims; 1-D and 0-D parameters must not move. */
static tm_optimizer *make_adamw(tm_ctx *ctx, double lr, double wd) {
    tm_adamw_config cfg = tm_adamw_config_default();
    cfg.lr = lr;
    cfg.weight_decay = wd;
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_adamw_new(ctx, &cfg, &opt));
    return opt;
}
Test(optim, weight_decay_only_on_matrices) { tt_check_decay_only_on_matrices(make_adamw); }

static void expect_bad_config(tm_adamw_config cfg, const char *field, const char *value) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[1] = {3};
    tm_tensor *p = NULL;
    TT_OK(ctx, tm_param_new(ctx, "p", TM_F32, 1, s, tm_cpu(), &p));
    tm_optimizer *opt = (tm_optimizer *)0x1;
    cr_assert_eq(tm_adamw_new(ctx, &cfg, &opt), TM_ERR_INVALID_ARG, "%s accepted", field);
    cr_assert_eq(opt, (tm_optimizer *)0x1, "out written on failure");
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert(strstr(msg, "tm_adamw_new") && strstr(msg, field) && strstr(msg, value), "%s", msg);
    /* Nothing was created: a valid config still succeeds afterwards. */
    tm_adamw_config ok = tm_adamw_config_default();
    TT_OK(ctx, tm_adamw_new(ctx, &ok, &opt));
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

Test(optim, bad_configs) {
    tm_adamw_config d = tm_adamw_config_default(), c;
    c = d; c.lr = -1e-3;        expect_bad_config(c, "lr", "-0.001");
    c = d; c.lr = NAN;          expect_bad_config(c, "lr", "nan");
    c = d; c.lr = INFINITY;     expect_bad_config(c, "lr", "inf");
    c = d; c.beta1 = 1.0;       expect_bad_config(c, "beta1", "1");
    c = d; c.beta1 = -0.5;      expect_bad_config(c, "beta1", "-0.5");
    c = d; c.beta2 = 1.0;       expect_bad_config(c, "beta2", "1");
    c = d; c.beta2 = NAN;       expect_bad_config(c, "beta2", "nan");
    c = d; c.eps = 0.0;         expect_bad_config(c, "eps", "0");
    c = d; c.eps = -1e-8;       expect_bad_config(c, "eps", "-1e-08");
    c = d; c.weight_decay = -0.1; expect_bad_config(c, "weight_decay", "-0.1");
}

Test(optim, defaults) {
    tm_adamw_config d = tm_adamw_config_default();
    cr_assert_eq(d.lr, 1e-3);
    cr_assert_eq(d.beta1, 0.9);
    cr_assert_eq(d.beta2, 0.999);
    cr_assert_eq(d.eps, 1e-8);
    cr_assert_eq(d.weight_decay, 0.0);
}

Test(optim, bad_state) {
    tm_ctx *ctx = tt_ctx();
    tm_optimizer *opt = NULL;
    tm_adamw_config cfg = tm_adamw_config_default();
    cr_assert_eq(tm_adamw_new(NULL, &cfg, &opt), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_adamw_new(ctx, &cfg, NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "out"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_adamw_new(ctx, &cfg, &opt), TM_ERR_STATE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "no parameters"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_null(opt);

    int64_t s[1] = {4};
    tm_tensor *p = NULL;
    TT_OK(ctx, tm_param_new(ctx, "p", TM_F32, 1, s, tm_cpu(), &p));
    TT_OK(ctx, tm_adamw_new(ctx, &cfg, &opt));
    /* A second optimizer would share the first one's state buffers: refused by name. */
    tm_optimizer *opt2 = NULL;
    cr_assert_eq(tm_adamw_new(ctx, &cfg, &opt2), TM_ERR_STATE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "p.adamw_m"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_null(opt2);

    cr_assert_eq(tm_optimizer_step(NULL, 1e-3), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_optimizer_step(opt, NAN), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "lr"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_optimizer_steps(opt), 0, "a refused step must not count");
    cr_assert_eq(tm_optimizer_steps(NULL), 0);
    tm_optimizer_free(opt);
    tm_optimizer_free(NULL);
    tm_ctx_free(ctx);
}

/* A 127-byte parameter name is legal, its state names are not. */
Test(optim, state_name_too_long) {
    tm_ctx *ctx = tt_ctx();
    char name[128];
    memset(name, 'x', 127);
    name[127] = 0;
    int64_t s[1] = {2};
    tm_tensor *p = NULL;
    TT_OK(ctx, tm_param_new(ctx, name, TM_F32, 1, s, tm_cpu(), &p));
    tm_optimizer *opt = NULL;
    cr_assert_eq(tm_adamw_new(ctx, NULL, &opt), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), ".adamw_m") && strstr(tm_ctx_errmsg(ctx), "127"), "%s",
              tm_ctx_errmsg(ctx));
    tm_ctx_free(ctx);
}

/* Gradients written after the optimizer exists, and a parameter added afterwards (which moves
 * the parameter buffer): the optimizer must follow the moved data, and leave the newcomer
 * alone. */
Test(optim, param_buffer_growth_after_new) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[1] = {5}, big[1] = {1 << 19};
    tm_tensor *p = NULL, *q = NULL;
    TT_OK(ctx, tm_param_new(ctx, "p", TM_F32, 1, s, tm_cpu(), &p));
    TT_OK(ctx, tm_tensor_fill(ctx, p, 1.0));
    tm_optimizer *opt = NULL;
    tm_adamw_config cfg = tm_adamw_config_default();
    cfg.lr = 0.25;
    TT_OK(ctx, tm_adamw_new(ctx, &cfg, &opt));
    TT_OK(ctx, tm_param_new(ctx, "q", TM_F32, 1, big, tm_cpu(), &q)); /* > 1 MiB: regrows */
    TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(p), 1.0));
    TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(q), 1.0));
    TT_OK(ctx, tm_optimizer_step(opt, -1.0));
    double want[5];
    for (int i = 0; i < 5; i++) want[i] = 1.0 - 0.25 * (1.0 / (1.0 + 1e-8));
    tt_assert_close_host(ctx, p, want, 1e-30, 1e-6);
    double qsum = 0;
    double *qv = tt_read(ctx, q);
    for (int64_t i = 0; i < big[0]; i++) qsum += fabs(qv[i]);
    free(qv);
    cr_assert_eq(qsum, 0.0);
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

/* ---- clip_grad_norm ------------------------------------------------------------------------ */

static tm_ctx *two_scalar_grads(tm_dtype da, tm_dtype db, double ga, double gb, tm_tensor **a, tm_tensor **b) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[1] = {1};
    TT_OK(ctx, tm_param_new(ctx, "a", da, 1, s, tm_cpu(), a));
    TT_OK(ctx, tm_param_new(ctx, "b", db, 1, s, tm_cpu(), b));
    TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(*a), ga));
    TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(*b), gb));
    return ctx;
}

static void check_3_4_5(tm_dtype da, tm_dtype db, double rtol) {
    tm_tensor *a, *b;
    tm_ctx *ctx = two_scalar_grads(da, db, 3.0, -4.0, &a, &b);
    double norm = -1;
    /* max_norm above the norm, and max_norm <= 0: measure only. */
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 10.0, &norm));
    cr_assert(fabs(norm - 5.0) <= 5.0 * rtol, "norm %g", norm);
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 0.0, &norm));
    cr_assert(fabs(norm - 5.0) <= 5.0 * rtol, "norm %g", norm);
    double g3 = 3.0, g4 = -4.0;
    tt_assert_close_host(ctx, tm_tensor_grad(a), &g3, 1e-30, 1e-15);
    tt_assert_close_host(ctx, tm_tensor_grad(b), &g4, 1e-30, 1e-15);
    /* max_norm 1: scaled by 1 / (5 + 1e-6); the returned norm is the one before clipping. */
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, &norm));
    cr_assert(fabs(norm - 5.0) <= 5.0 * rtol, "norm %g", norm);
    g3 = 3.0 / (5.0 + 1e-6);
    g4 = -4.0 / (5.0 + 1e-6);
    tt_assert_close_host(ctx, tm_tensor_grad(a), &g3, 1e-30, rtol);
    tt_assert_close_host(ctx, tm_tensor_grad(b), &g4, 1e-30, rtol);
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 0.0, &norm));
    cr_assert(fabs(norm - 5.0 / (5.0 + 1e-6)) <= rtol, "norm after clipping %.17g", norm);
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, NULL)); /* norm_out may be NULL */
    tm_ctx_free(ctx);
}

Test(optim, clip_3_4_5_f32) { check_3_4_5(TM_F32, TM_F32, 1e-7); }
Test(optim, clip_3_4_5_f64) { check_3_4_5(TM_F64, TM_F64, 1e-15); }
Test(optim, clip_3_4_5_mixed_dtypes) { check_3_4_5(TM_F64, TM_F32, 1e-7); }
Test(optim, clip_3_4_5_bf16) { check_3_4_5(TM_BF16, TM_BF16, 4e-3); }

/* Awkward sizes, several parameters (so the flat pass crosses the zero padding between them),
 * against a naive sum. */
Test(optim, clip_many_params_naive) {
    tm_ctx *ctx = tt_ctx();
    const int64_t shapes[4][2] = {{3, 7}, {1, 13}, {5, 1}, {123, 41}};
    tm_tensor *p[4];
    double ss = 0;
    double *g[4];
    for (int i = 0; i < 4; i++) {
        char nm[8] = {'p', (char)('0' + i), 0};
        TT_OK(ctx, tm_param_new(ctx, nm, TM_F32, 2, shapes[i], tm_cpu(), &p[i]));
        tm_tensor *r = tt_randn(ctx, TM_F32, 2, shapes[i], 100 + (uint64_t)i);
        g[i] = tt_read(ctx, r);
        TT_OK(ctx, tm_tensor_write(ctx, tm_tensor_grad(p[i]), TM_F64, g[i], tm_tensor_numel(r)));
        for (int64_t k = 0; k < tm_tensor_numel(r); k++) ss += g[i][k] * g[i][k];
    }
    double norm = 0, want = sqrt(ss);
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 0.5, &norm));
    cr_assert(fabs(norm - want) <= 1e-12 * want, "norm %.17g want %.17g", norm, want);
    double s = 0.5 / (want + 1e-6);
    for (int i = 0; i < 4; i++) {
        for (int64_t k = 0; k < tm_tensor_numel(p[i]); k++) g[i][k] *= s;
        tt_assert_close_host(ctx, tm_tensor_grad(p[i]), g[i], 1e-30, 1e-6);
        free(g[i]);
    }
    tm_ctx_free(ctx);
}

Test(optim, clip_bad_args) {
    cr_assert_eq(tm_ctx_clip_grad_norm(NULL, 1.0, NULL), TM_ERR_INVALID_ARG);
    tm_ctx *ctx = tt_ctx();
    double norm = -1;
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, &norm)); /* no parameters: norm 0 */
    cr_assert_eq(norm, 0.0);
    cr_assert_eq(tm_ctx_clip_grad_norm(ctx, NAN, &norm), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "tm_ctx_clip_grad_norm") && strstr(tm_ctx_errmsg(ctx), "max_norm"),
              "%s", tm_ctx_errmsg(ctx));
    tm_ctx_free(ctx);
}

/* CUDA parameters are updated and clipped on the device (the CUDA update kernels; their parity
 * with the CPU is tests/test_cuda_parity_update.c). Skipped without a GPU. */
Test(optim, cuda_params_step) {
    if (tm_cuda_device_count() == 0) cr_skip_test("no CUDA device");
    tm_ctx_options o = tm_ctx_options_default();
    o.cuda_device = 0;
    tm_ctx *ctx = NULL;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK, "%s", tm_last_create_error());
    int64_t s[2] = {3, 3};
    tm_tensor *p = NULL;
    TT_OK(ctx, tm_param_new(ctx, "wgpu", TM_F32, 2, s, tm_cuda(0), &p));
    TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(p), 2.0));
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_adamw_new(ctx, NULL, &opt));
    double norm = 0;
    uint64_t before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, &norm));
    cr_assert_eq(tm_ctx_sync_count(ctx) - before, 1, "the clip reads the norm once");
    cr_assert_float_eq(norm, 6.0, 1e-6);
    TT_OK(ctx, tm_optimizer_step(opt, -1.0));
    cr_assert_eq(tm_optimizer_steps(opt), 1);
    float w[9];
    TT_OK(ctx, tm_tensor_read(ctx, p, TM_F32, w, 9));
    for (int i = 0; i < 9; i++) cr_assert_float_eq(w[i], -1e-3f, 1e-6, "w[%d] = %g", i, w[i]); /* -lr * sign(g) */
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

/* The norm is the same to the last bit whatever the thread count (chunked fixed-order sum), so
 * clipping cannot make runs with different thread counts diverge. 3 * 2^17 + 5 gradients: many
 * chunks and a ragged last one. */
Test(optim, clip_norm_bitwise_across_thread_counts) {
    double norms[3];
    const int threads[3] = {1, 2, 3};
    for (int t = 0; t < 3; t++) {
        tm_ctx *ctx = tt_ctx_threads(threads[t]);
        int64_t s[1] = {3 * (1 << 17) + 5};
        tm_tensor *p;
        TT_OK(ctx, tm_param_new(ctx, "p", TM_F32, 1, s, tm_cpu(), &p));
        tm_tensor *r = tt_randn(ctx, TM_F32, 1, s, 7);
        float *g = malloc(sizeof *g * (size_t)s[0]);
        TT_OK(ctx, tm_tensor_read(ctx, r, TM_F32, g, s[0]));
        TT_OK(ctx, tm_tensor_write(ctx, tm_tensor_grad(p), TM_F32, g, s[0]));
        TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 0.0, &norms[t]));
        free(g);
        tm_ctx_free(ctx);
    }
    cr_assert_eq(norms[0], norms[1], "%.17g vs %.17g", norms[0], norms[1]);
    cr_assert_eq(norms[0], norms[2], "%.17g vs %.17g", norms[0], norms[2]);
}

/* ---- the clip's factor applied by the update (tm_ctx_clip_grad_norm_deferred) ------------- */

Test(optim, clip_deferred_adamw_f32) { tt_check_clip_deferred(tm_cpu(), TM_F32, 0); }
Test(optim, clip_deferred_adamw_bf16) { tt_check_clip_deferred(tm_cpu(), TM_BF16, 0); }
Test(optim, clip_deferred_adamw_f64) { tt_check_clip_deferred(tm_cpu(), TM_F64, 0); }
Test(optim, clip_deferred_sgd_f32) { tt_check_clip_deferred(tm_cpu(), TM_F32, 1); }
Test(optim, clip_deferred_sgd_bf16) { tt_check_clip_deferred(tm_cpu(), TM_BF16, 1); }

Test(optim, clip_deferred_bad_args) {
    tm_tensor *a, *b, *gs = NULL;
    tm_ctx *ctx = two_scalar_grads(TM_F32, TM_F32, 3.0, -4.0, &a, &b);
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_adamw_new(ctx, NULL, &opt));
    double norm = 0;
    cr_assert_eq(tm_ctx_clip_grad_norm_deferred(ctx, 1.0, &norm, NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "grad_scale"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_ctx_clip_grad_norm_deferred(ctx, NAN, &norm, &gs), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "tm_ctx_clip_grad_norm_deferred"), "%s", tm_ctx_errmsg(ctx));
    /* A factor must be the clip's: 0-d, f64 on the CPU; nothing is changed otherwise. */
    int64_t one[1] = {1};
    tm_tensor *vec = NULL, *f32 = NULL;
    double v = 0.5;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F64, 1, one, tm_cpu(), TM_F64, &v, &vec));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 0, one, tm_cpu(), TM_F64, &v, &f32));
    cr_assert_eq(tm_optimizer_step_scaled(opt, -1.0, vec), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "tm_optimizer_step_scaled"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_optimizer_step_scaled(opt, -1.0, f32), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_optimizer_steps(opt), 0);
    double w = 0;
    TT_OK(ctx, tm_tensor_read(ctx, a, TM_F64, &w, 1));
    cr_assert_eq(w, 0.0, "a failed step changed a parameter");
    /* max_norm 1 on norm 5: the gradients stay 3, -4 and the factor is 1 / (5 + 1e-6). */
    TT_OK(ctx, tm_ctx_clip_grad_norm_deferred(ctx, 1.0, &norm, &gs));
    double f = 0, g = 0;
    TT_OK(ctx, tm_tensor_read(ctx, gs, TM_F64, &f, 1));
    TT_OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(a), TM_F64, &g, 1));
    cr_assert(fabs(f - 1.0 / (5.0 + 1e-6)) <= 1e-15 && g == 3.0, "factor %.17g, grad %g", f, g);
    TT_OK(ctx, tm_optimizer_step_scaled(opt, -1.0, gs));
    cr_assert_eq(tm_optimizer_steps(opt), 1);
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}
