/* test_sgd.c — SGD with momentum (tm_sgd_new) against hand-computed steps and against the
 * documented update rule, weight-decay placement, state buffers, config validation.
 *
 * As in test_optim.c, the gradients are written directly (tm_tensor_write on tm_tensor_grad)
 * so the optimizer is tested alone, with gradients known exactly at every step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* ---- three steps by hand --------------------------------------------------------------------
 * Two parameters starting at 1: w [1,1] (2-D: decayed) and b [1] (1-D: never decayed), the
 * same gradients 1, 2, -1 at steps 1-3, lr 1/8, momentum 1/2, weight_decay 1/4. Every number
 * is dyadic with a short mantissa, so f32 and f64 must both give these values exactly.
 * Worked example, momentum + decay on w (g' = g + wd p; b = mom b + g'; p -= lr b):
 *   t1: g' = 1 + 1/4 = 5/4            b = 5/4                   p = 1 - 5/32 = 27/32
 *   t2: g' = 2 + 27/128 = 283/128     b = 5/8 + 283/128 = 363/128  p = 27/32 - 363/1024 = 501/1024
 *   t3: g' = -1 + 501/4096 = -3595/4096  b = 363/256 - 3595/4096 = 2213/4096
 *                                     p = 501/1024 - 2213/32768 = 13819/32768
 * Nesterov steps by lr (g' + mom b) instead, e.g. without decay t1: b = 1, p = 1 - (1 + 1/2)/8
 * = 13/16; t2: b = 5/2, p = 13/16 - (2 + 5/4)/8 = 13/32; t3: b = 1/4, p = 13/32 - (-1 + 1/8)/8
 * = 33/64. torch.optim.SGD (1.13, f64) gives exactly these six sequences as well. */
typedef struct {
    const char *what;
    double momentum;
    int nesterov;
    double wd;
    double w[3], b[3]; /* parameter values after steps 1, 2, 3 */
    double b_state;    /* b's momentum buffer after step 3 (momentum > 0) */
} sgd_case;

static const double GRADS[3] = {1.0, 2.0, -1.0};

static const sgd_case CASES[] = {
    {"plain", 0.0, 0, 0.0, {7. / 8, 5. / 8, 3. / 4}, {7. / 8, 5. / 8, 3. / 4}, 0},
    {"plain + decay", 0.0, 0, 0.25, {27. / 32, 581. / 1024, 22107. / 32768}, {7. / 8, 5. / 8, 3. / 4}, 0},
    {"momentum", 0.5, 0, 0.0, {7. / 8, 9. / 16, 17. / 32}, {7. / 8, 9. / 16, 17. / 32}, 1. / 4},
    {"momentum + decay", 0.5, 0, 0.25, {27. / 32, 501. / 1024, 13819. / 32768}, {7. / 8, 9. / 16, 17. / 32}, 1. / 4},
    {"nesterov", 0.5, 1, 0.0, {13. / 16, 13. / 32, 33. / 64}, {13. / 16, 13. / 32, 33. / 64}, 1. / 4},
    {"nesterov + decay", 0.5, 1, 0.25, {49. / 64, 1293. / 4096, 104953. / 262144}, {13. / 16, 13. / 32, 33. / 64},
     1. / 4},
};

static void run_case(const sgd_case *k, tm_dtype dt) {
    tm_ctx *ctx = tt_ctx();
    int64_t s2[2] = {1, 1}, s1[1] = {1};
    tm_tensor *w = NULL, *b = NULL;
    TT_OK(ctx, tm_param_new(ctx, "w", dt, 2, s2, tm_cpu(), &w));
    TT_OK(ctx, tm_param_new(ctx, "b", dt, 1, s1, tm_cpu(), &b));
    TT_OK(ctx, tm_tensor_fill(ctx, w, 1.0));
    TT_OK(ctx, tm_tensor_fill(ctx, b, 1.0));
    tm_sgd_config cfg = {.lr = 0.125, .momentum = k->momentum, .nesterov = k->nesterov, .weight_decay = k->wd};
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_sgd_new(ctx, &cfg, &opt));
    for (int t = 0; t < 3; t++) {
        TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(w), GRADS[t]));
        TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(b), GRADS[t]));
        TT_OK(ctx, tm_optimizer_step(opt, -1.0));
        double gw, gb;
        TT_OK(ctx, tm_tensor_read(ctx, w, TM_F64, &gw, 1));
        TT_OK(ctx, tm_tensor_read(ctx, b, TM_F64, &gb, 1));
        cr_assert_eq(gw, k->w[t], "%s (%s) step %d: w = %.17g, want %.17g", k->what, tm_dtype_name(dt), t + 1, gw,
                     k->w[t]);
        cr_assert_eq(gb, k->b[t], "%s (%s) step %d: b = %.17g, want %.17g", k->what, tm_dtype_name(dt), t + 1, gb,
                     k->b[t]);
        cr_assert_eq(tm_optimizer_steps(opt), t + 1);
    }
    tm_tensor *state = tm_ctx_find(ctx, "b.sgd_b");
    if (k->momentum > 0) {
        cr_assert(state, "%s: no b.sgd_b", k->what);
        cr_assert_eq(tm_tensor_dtype(state), TM_F32);
        double got;
        TT_OK(ctx, tm_tensor_read(ctx, state, TM_F64, &got, 1));
        cr_assert_eq(got, k->b_state, "%s: momentum buffer %.17g, want %.17g", k->what, got, k->b_state);
    } else {
        cr_assert_null(state, "%s: momentum 0 must keep no state", k->what);
        cr_assert_null(tm_ctx_find(ctx, "w.sgd_b"));
    }
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

Test(sgd, three_steps_by_hand_f64) {
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) run_case(&CASES[i], TM_F64);
}
Test(sgd, three_steps_by_hand_f32) {
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) run_case(&CASES[i], TM_F32);
}

/* ---- against the formula, awkward sizes ------------------------------------------------------
 * The reference is tinymoe.h's formula in f64 with b rounded to f32 after each step (the state
 * is f32; the update uses the unrounded b, as the kernel does); a bf16 parameter is updated on
 * its f32 master (p rounded to f32 after each step, never to bf16) and stored as the master
 * rounded to bf16. The third step passes an explicit lr. */
static double round_bf16(double x) {
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even (finite values only) */
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static void ref_step(double *p, double *b, const double *g, int64_t n, double lr, const tm_sgd_config *c,
                     int decay, int bf16) {
    for (int64_t i = 0; i < n; i++) {
        double gi = g[i] + (decay ? c->weight_decay * p[i] : 0.0), d = gi;
        if (c->momentum > 0) {
            double bi = c->momentum * b[i] + gi;
            b[i] = (float)bi;
            d = c->nesterov ? gi + c->momentum * bi : bi;
        }
        p[i] -= lr * d;
        if (bf16) p[i] = (float)p[i]; /* the f32 master */
    }
}

static void run_reference(tm_dtype dt, int nesterov, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    const int64_t sw[2] = {3, 5}, sb[1] = {7};
    enum { NW = 15, NB = 7 };
    tm_tensor *w = NULL, *b = NULL;
    TT_OK(ctx, tm_param_new(ctx, "w", dt, 2, sw, tm_cpu(), &w));
    TT_OK(ctx, tm_param_new(ctx, "b", dt, 1, sb, tm_cpu(), &b));
    TT_OK(ctx, tm_tensor_init_normal(ctx, w, 1, NULL, 0.0, 1.0));
    TT_OK(ctx, tm_tensor_init_normal(ctx, b, 1, NULL, 0.0, 1.0));
    tm_sgd_config cfg = {.lr = 0.1, .momentum = 0.9, .nesterov = nesterov, .weight_decay = 0.05};
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_sgd_new(ctx, &cfg, &opt));
    double pw[NW], pb[NB], bw[NW] = {0}, bb[NB] = {0};
    TT_OK(ctx, tm_tensor_read(ctx, w, TM_F64, pw, NW));
    TT_OK(ctx, tm_tensor_read(ctx, b, TM_F64, pb, NB));
    const double lrs[3] = {-1.0, -1.0, 0.03};
    for (int t = 0; t < 3; t++) {
        /* Random gradients, as stored (f32 / bf16 round them). */
        tm_tensor *rw = tt_randn(ctx, dt, 2, sw, 10 + (uint64_t)t), *rb = tt_randn(ctx, dt, 1, sb, 20 + (uint64_t)t);
        double *gw = tt_read(ctx, rw), *gb = tt_read(ctx, rb);
        TT_OK(ctx, tm_tensor_write(ctx, tm_tensor_grad(w), TM_F64, gw, NW));
        TT_OK(ctx, tm_tensor_write(ctx, tm_tensor_grad(b), TM_F64, gb, NB));
        TT_OK(ctx, tm_optimizer_step(opt, lrs[t]));
        double lr = lrs[t] < 0 ? cfg.lr : lrs[t];
        ref_step(pw, bw, gw, NW, lr, &cfg, 1, dt == TM_BF16);
        ref_step(pb, bb, gb, NB, lr, &cfg, 0, dt == TM_BF16);
        tt_assert_close_host(ctx, w, pw, atol, rtol);
        tt_assert_close_host(ctx, b, pb, atol, rtol);
        if (dt == TM_BF16) { /* the master holds the unrounded value; the parameter is it in bf16 */
            tt_assert_close_host(ctx, tm_ctx_find(ctx, "w.master"), pw, 1e-30, 1e-5);
            double q[NW], r[NW];
            TT_OK(ctx, tm_tensor_read(ctx, tm_ctx_find(ctx, "w.master"), TM_F64, q, NW));
            TT_OK(ctx, tm_tensor_read(ctx, w, TM_F64, r, NW));
            for (int i = 0; i < NW; i++) cr_assert_eq(r[i], round_bf16(q[i]), "w[%d] is not its master rounded", i);
        }
        free(gw);
        free(gb);
        tm_ctx_arena_reset(ctx);
    }
    tt_assert_close_host(ctx, tm_ctx_find(ctx, "w.sgd_b"), bw, 1e-30, 1e-6);
    tt_assert_close_host(ctx, tm_ctx_find(ctx, "b.sgd_b"), bb, 1e-30, 1e-6);
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

Test(sgd, reference_f64) { run_reference(TM_F64, 0, 1e-14, 1e-14); }
Test(sgd, reference_f64_nesterov) { run_reference(TM_F64, 1, 1e-14, 1e-14); }
Test(sgd, reference_f32) { run_reference(TM_F32, 0, 1e-6, 1e-6); }
Test(sgd, reference_f32_nesterov) { run_reference(TM_F32, 1, 1e-6, 1e-6); }
/* The parameter is its master rounded to bf16: within half a bf16 ulp of the reference. */
Test(sgd, reference_bf16) { run_reference(TM_BF16, 1, 1e-30, 8e-3); }

/* With zero gradients only the decay acts: the first step multiplies parameters of 2+ dims by
 * 1 - lr wd (b = wd p, momentum or not); 1-D and 0-D parameters must not move. */
static tm_optimizer *make_sgd(tm_ctx *ctx, double lr, double wd) {
    tm_sgd_config cfg = tm_sgd_config_default();
    cfg.lr = lr;
    cfg.weight_decay = wd;
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_sgd_new(ctx, &cfg, &opt));
    return opt;
}
Test(sgd, weight_decay_only_on_matrices) { tt_check_decay_only_on_matrices(make_sgd); }

static void expect_bad_config(tm_sgd_config cfg, const char *field, const char *value) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[1] = {3};
    tm_tensor *p = NULL;
    TT_OK(ctx, tm_param_new(ctx, "p", TM_F32, 1, s, tm_cpu(), &p));
    tm_optimizer *opt = (tm_optimizer *)0x1;
    cr_assert_eq(tm_sgd_new(ctx, &cfg, &opt), TM_ERR_INVALID_ARG, "%s accepted", field);
    cr_assert_eq(opt, (tm_optimizer *)0x1, "out written on failure");
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert(strstr(msg, "tm_sgd_new") && strstr(msg, field) && strstr(msg, value), "%s", msg);
    cr_assert_null(tm_ctx_find(ctx, "p.sgd_b"), "state made by a refused config");
    tm_sgd_config ok = tm_sgd_config_default();
    TT_OK(ctx, tm_sgd_new(ctx, &ok, &opt));
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

Test(sgd, bad_configs) {
    tm_sgd_config d = tm_sgd_config_default(), c;
    c = d; c.lr = -0.5;           expect_bad_config(c, "lr", "-0.5");
    c = d; c.lr = NAN;            expect_bad_config(c, "lr", "nan");
    c = d; c.lr = INFINITY;       expect_bad_config(c, "lr", "inf");
    c = d; c.momentum = 1.0;      expect_bad_config(c, "momentum", "1");
    c = d; c.momentum = -0.25;    expect_bad_config(c, "momentum", "-0.25");
    c = d; c.momentum = NAN;      expect_bad_config(c, "momentum", "nan");
    c = d; c.nesterov = 2;        expect_bad_config(c, "nesterov", "2");
    c = d; c.nesterov = 1; c.momentum = 0.0; expect_bad_config(c, "nesterov", "momentum 0");
    c = d; c.weight_decay = -1e-4; expect_bad_config(c, "weight_decay", "-0.0001");
    c = d; c.weight_decay = NAN;  expect_bad_config(c, "weight_decay", "nan");
}

Test(sgd, defaults) {
    tm_sgd_config d = tm_sgd_config_default();
    cr_assert_eq(d.lr, 1e-2);
    cr_assert_eq(d.momentum, 0.9);
    cr_assert_eq(d.nesterov, 0);
    cr_assert_eq(d.weight_decay, 0.0);
    /* cfg NULL means the defaults: one momentum buffer per parameter. */
    tm_ctx *ctx = tt_ctx();
    int64_t s[1] = {2};
    tm_tensor *p = NULL;
    TT_OK(ctx, tm_param_new(ctx, "p", TM_F32, 1, s, tm_cpu(), &p));
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_sgd_new(ctx, NULL, &opt));
    cr_assert(tm_ctx_find(ctx, "p.sgd_b"));
    TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(p), 1.0));
    TT_OK(ctx, tm_optimizer_step(opt, -1.0));
    double want[2] = {-1e-2, -1e-2};
    tt_assert_close_host(ctx, p, want, 1e-30, 1e-7);
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

Test(sgd, bad_state) {
    tm_ctx *ctx = tt_ctx();
    tm_optimizer *opt = NULL;
    cr_assert_eq(tm_sgd_new(NULL, NULL, &opt), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_sgd_new(ctx, NULL, NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "tm_sgd_new") && strstr(tm_ctx_errmsg(ctx), "out"), "%s",
              tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_sgd_new(ctx, NULL, &opt), TM_ERR_STATE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "no parameters"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_null(opt);

    int64_t s[1] = {4};
    tm_tensor *p = NULL;
    TT_OK(ctx, tm_param_new(ctx, "p", TM_F32, 1, s, tm_cpu(), &p));
    TT_OK(ctx, tm_sgd_new(ctx, NULL, &opt));
    /* A second momentum SGD would share the first one's buffers: refused by name. */
    tm_optimizer *opt2 = NULL;
    cr_assert_eq(tm_sgd_new(ctx, NULL, &opt2), TM_ERR_STATE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "tm_sgd_new") && strstr(tm_ctx_errmsg(ctx), "p.sgd_b"), "%s",
              tm_ctx_errmsg(ctx));
    cr_assert_null(opt2);
    /* Even a stateless SGD would share the step counter (saved in checkpoints) ... */
    tm_sgd_config plain = tm_sgd_config_default();
    plain.momentum = 0.0;
    cr_assert_eq(tm_sgd_new(ctx, &plain, &opt2), TM_ERR_STATE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "optim.sgd.steps"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_null(opt2);
    /* ... while AdamW has buffers of its own and may coexist with it. */
    TT_OK(ctx, tm_adamw_new(ctx, NULL, &opt2));
    tm_optimizer_free(opt2);

    cr_assert_eq(tm_optimizer_step(opt, INFINITY), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "lr"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_optimizer_steps(opt), 0, "a refused step must not count");
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

/* A 127-byte parameter name is legal, its state name is not; plain SGD needs no state name. */
Test(sgd, state_name_too_long) {
    tm_ctx *ctx = tt_ctx();
    char name[128];
    memset(name, 'x', 127);
    name[127] = 0;
    int64_t s[1] = {2};
    tm_tensor *p = NULL;
    TT_OK(ctx, tm_param_new(ctx, name, TM_F32, 1, s, tm_cpu(), &p));
    tm_optimizer *opt = NULL;
    cr_assert_eq(tm_sgd_new(ctx, NULL, &opt), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), ".sgd_b") && strstr(tm_ctx_errmsg(ctx), "127"), "%s", tm_ctx_errmsg(ctx));
    tm_sgd_config plain = tm_sgd_config_default();
    plain.momentum = 0.0;
    TT_OK(ctx, tm_sgd_new(ctx, &plain, &opt));
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

/* CUDA parameters are updated on the device (parity with the CPU:
 * tests/test_cuda_parity_update.c). Skipped without a GPU. */
Test(sgd, cuda_params_step) {
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
    TT_OK(ctx, tm_sgd_new(ctx, NULL, &opt));
    TT_OK(ctx, tm_optimizer_step(opt, -1.0));
    cr_assert_eq(tm_optimizer_steps(opt), 1);
    float w[9];
    TT_OK(ctx, tm_tensor_read(ctx, p, TM_F32, w, 9));
    for (int i = 0; i < 9; i++) cr_assert_float_eq(w[i], -0.02f, 1e-7, "w[%d] = %g", i, w[i]); /* -lr * g */
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}
