/*
 * test_rmsnorm.c — tm_rmsnorm: forward against a naive loop (f64, f32, bf16), backward by finite
 * differences and against the closed form on a size that takes the parallel, chunked path
 * (bit-identical for 1, 2 and 3 threads), bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* y[n] = x[n] / sqrt(mean(x[n]^2) + eps) * w over rows of C. */
static void rms_ref(double *y, double *rstd, const double *x, const double *w, int64_t N, int64_t C,
                    double eps) {
    for (int64_t n = 0; n < N; n++) {
        double ss = 0;
        for (int64_t i = 0; i < C; i++) ss += x[n * C + i] * x[n * C + i];
        double r = 1 / sqrt(ss / C + eps);
        if (rstd) rstd[n] = r;
        for (int64_t i = 0; i < C; i++) y[n * C + i] = x[n * C + i] * r * w[i];
    }
}

/* dx, dw of L = sum(y * g), written out independently of the kernel. */
static void rms_grad_ref(double *dx, double *dw, const double *x, const double *w, const double *g,
                         int64_t N, int64_t C, double eps) {
    for (int64_t i = 0; i < C; i++) dw[i] = 0;
    for (int64_t n = 0; n < N; n++) {
        const double *xr = x + n * C, *gr = g + n * C;
        double ss = 0, dot = 0;
        for (int64_t i = 0; i < C; i++) ss += xr[i] * xr[i];
        double r = 1 / sqrt(ss / C + eps);
        for (int64_t i = 0; i < C; i++) dot += gr[i] * w[i] * xr[i];
        for (int64_t i = 0; i < C; i++) {
            /* d/dx_i of sum_j g_j w_j x_j r, with dr/dx_i = -r^3 x_i / C */
            dx[n * C + i] = gr[i] * w[i] * r - dot * r * r * r * xr[i] / C;
            dw[i] += gr[i] * xr[i] * r;
        }
    }
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, "rmsnorm"), "message lacks the op name: %s", msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

static void check_forward(tm_dtype dt, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[3] = {3, 5, 13}, ws[1] = {13}, N = 15, C = 13;
    tm_tensor *x = tt_randn(ctx, dt, 3, xs, 1), *w = tt_randn(ctx, dt, 1, ws, 2), *y;
    TT_OK(ctx, tm_rmsnorm(ctx, x, w, 1e-5, &y));
    cr_assert_eq(tm_tensor_dtype(y), dt);
    cr_assert_eq(tm_tensor_ndim(y), 3);
    cr_assert_eq(tm_tensor_dim(y, 0), 3);
    cr_assert_eq(tm_tensor_dim(y, 2), 13);
    double *hx = tt_read(ctx, x), *hw = tt_read(ctx, w), *ref = malloc(sizeof(double) * N * C);
    rms_ref(ref, NULL, hx, hw, N, C, 1e-5); /* from the stored (possibly rounded) inputs */
    tt_assert_close_host(ctx, y, ref, atol, rtol);
    free(hx), free(hw), free(ref);
    tm_ctx_free(ctx);
}

Test(rmsnorm, forward_f64) { check_forward(TM_F64, 1e-13, 1e-12); }
/* f32: the kernel sums in f64; only the f32 rounding of rstd-scaled outputs remains. */
Test(rmsnorm, forward_f32) { check_forward(TM_F32, 1e-6, 1e-6); }
/* bf16: computed in f32, so the output's bf16 rounding (<= 2^-9 relative) dominates. */
Test(rmsnorm, forward_bf16) { check_forward(TM_BF16, 1e-3, 4e-3); }

Test(rmsnorm, eps_and_constant_rows) {
    /* A row of constant a has rms |a|: y = sign(a) * w (eps = 0); a zero row stays 0 with eps > 0. */
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {2, 3}, ws[1] = {3};
    double xv[6] = {-2, -2, -2, 0, 0, 0}, wv[3] = {1, 2, 3};
    tm_tensor *x = tt_from(ctx, TM_F64, 2, xs, xv), *w = tt_from(ctx, TM_F64, 1, ws, wv), *y;
    TT_OK(ctx, tm_rmsnorm(ctx, x, w, 0.0, &y));
    double want0[3] = {-1, -2, -3};
    double *got = tt_read(ctx, y);
    cr_assert(tt_close_ratio(got, want0, 3, 1e-15, 1e-15) <= 1);
    free(got);
    TT_OK(ctx, tm_rmsnorm(ctx, x, w, 1e-6, &y));
    got = tt_read(ctx, y);
    for (int i = 3; i < 6; i++) cr_assert_eq(got[i], 0.0);
    free(got);
    tm_ctx_free(ctx);
}

static tm_status rms_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_rmsnorm(ctx, in[0], in[1], *(const double *)user, out);
}

double tt_gradcase_rmsnorm(tm_ctx *ctx) {
    int64_t xs[3] = {2, 3, 7}, ws[1] = {7};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 3, xs, 11), tt_randn(ctx, TM_F64, 1, ws, 12)};
    int check[2] = {1, 1};
    double eps = 1e-5;
    return tt_gradcheck(ctx, rms_fn, &eps, 2, in, check, 1e-6, 1e-7, 1e-6);
}

Test(rmsnorm, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_rmsnorm(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

/* dx, dw (malloc'd) of sum(rmsnorm(x, w) * g) computed by tinymoe with nthreads threads. */
static void rms_grads(int nthreads, tm_dtype dt, int64_t N, int64_t C, const double *x, const double *w,
                      const double *g, double **dx, double **dw) {
    tm_ctx *ctx = tt_ctx_threads(nthreads);
    int64_t xs[2] = {N, C};
    tm_tensor *tx = tt_from(ctx, dt, 2, xs, x), *tw = tt_from(ctx, dt, 1, &C, w);
    tm_tensor *tg = tt_from(ctx, dt, 2, xs, g), *y;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, tx, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, tw, 1));
    TT_OK(ctx, tm_rmsnorm(ctx, tx, tw, 1e-5, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, tg));
    *dx = tt_read(ctx, tm_tensor_grad(tx));
    *dw = tt_read(ctx, tm_tensor_grad(tw));
    tm_ctx_free(ctx);
}

static void check_backward_large(tm_dtype dt, int64_t N, int64_t C, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {N, C};
    double *x = tt_read(ctx, tt_randn(ctx, dt, 2, xs, 21)), *g = tt_read(ctx, tt_randn(ctx, dt, 2, xs, 22));
    double *w = tt_read(ctx, tt_randn(ctx, dt, 1, &C, 23));
    tm_ctx_free(ctx);
    double *rdx = malloc(sizeof(double) * N * C), *rdw = malloc(sizeof(double) * C);
    rms_grad_ref(rdx, rdw, x, w, g, N, C, 1e-5);

    double *dx[3], *dw[3];
    for (int t = 0; t < 3; t++) rms_grads(t + 1, dt, N, C, x, w, g, &dx[t], &dw[t]);
    cr_assert_leq(tt_close_ratio(dx[1], rdx, N * C, atol, rtol), 1.0);
    cr_assert_leq(tt_close_ratio(dw[1], rdw, C, atol, rtol), 1.0);
    for (int t = 0; t < 3; t += 2) {
        cr_assert(memcmp(dx[t], dx[1], sizeof(double) * N * C) == 0, "dx differs with %d threads", t + 1);
        cr_assert(memcmp(dw[t], dw[1], sizeof(double) * C) == 0, "dw differs with %d threads", t + 1);
    }
    for (int t = 0; t < 3; t++) free(dx[t]), free(dw[t]);
    free(x), free(g), free(w), free(rdx), free(rdw);
}

/* 300 x 129 takes the OpenMP path and splits dw over 60 chunks of 5 rows; 4500 x 9 over 71
 * chunks of the maximal 64 rows. */
Test(rmsnorm, backward_large_f64) { check_backward_large(TM_F64, 300, 129, 1e-11, 1e-10); }
Test(rmsnorm, backward_large_f32) { check_backward_large(TM_F32, 300, 129, 1e-5, 1e-4); }
Test(rmsnorm, backward_tall_f64) { check_backward_large(TM_F64, 4500, 9, 1e-11, 1e-10); }

Test(rmsnorm, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {2, 5}, w4 = 4, w5 = 5;
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *out = NULL;
    tm_tensor *w_short = tt_randn(ctx, TM_F32, 1, &w4, 2), *w64 = tt_randn(ctx, TM_F64, 1, &w5, 3);
    tm_tensor *w = tt_randn(ctx, TM_F32, 1, &w5, 4), *xi = tt_randint(ctx, TM_I32, 2, xs, 5, 3);
    tm_tensor *w2d = tt_randn(ctx, TM_F32, 2, xs, 6);

    assert_err(ctx, tm_rmsnorm(ctx, x, w_short, 1e-5, &out), TM_ERR_SHAPE, "f32[4]", "f32[2,5]");
    assert_err(ctx, tm_rmsnorm(ctx, x, w64, 1e-5, &out), TM_ERR_DTYPE, "f64[5]", NULL);
    assert_err(ctx, tm_rmsnorm(ctx, xi, w, 1e-5, &out), TM_ERR_DTYPE, "i32[2,5]", NULL);
    assert_err(ctx, tm_rmsnorm(ctx, x, w2d, 1e-5, &out), TM_ERR_SHAPE, "f32[2,5]", NULL);
    assert_err(ctx, tm_rmsnorm(ctx, x, w, -1.0, &out), TM_ERR_INVALID_ARG, "eps", "-1");
    assert_err(ctx, tm_rmsnorm(ctx, x, w, NAN, &out), TM_ERR_INVALID_ARG, "eps", "nan");
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}

/* ---- add_rmsnorm ------------------------------------------------------------------------------ */

static tm_status add_rms_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *s, *h;
    tm_status st = tm_add_rmsnorm(ctx, in[0], in[1], in[2], *(const double *)user, &s, &h);
    /* both outputs feed the loss, with different weights: s * h */
    return st ? st : tm_mul(ctx, s, h, out);
}

double tt_gradcase_add_rmsnorm(tm_ctx *ctx) {
    int64_t xs[3] = {2, 3, 7}, ws[1] = {7};
    tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 3, xs, 31), tt_randn(ctx, TM_F64, 3, xs, 32),
                        tt_randn(ctx, TM_F64, 1, ws, 33)};
    int check[3] = {1, 1, 1};
    double eps = 1e-5;
    return tt_gradcheck(ctx, add_rms_fn, &eps, 3, in, check, 1e-6, 1e-7, 1e-6);
}

Test(rmsnorm, add_rmsnorm_gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_add_rmsnorm(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

/* The same bits as tm_add then tm_rmsnorm, forward and backward, where s also feeds a later op
 * (as the residual stream does): loss = sum(h * g1 + s * g2). */
typedef struct add_rms_grads {
    double *s, *h, *dx, *dy, *dw;
} add_rms_grads;

static void add_rms_run(tm_dtype dt, int fused, int64_t N, int64_t C, add_rms_grads *o) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {N, C};
    tm_tensor *x = tt_randn(ctx, dt, 2, xs, 41), *y = tt_randn(ctx, dt, 2, xs, 42), *w = tt_randn(ctx, dt, 1, &C, 43);
    tm_tensor *g1 = tt_randn(ctx, dt, 2, xs, 44), *g2 = tt_randn(ctx, dt, 2, xs, 45), *s, *h, *u, *v, *l;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, y, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    if (fused) {
        TT_OK(ctx, tm_add_rmsnorm(ctx, x, y, w, 1e-5, &s, &h));
    } else {
        TT_OK(ctx, tm_add(ctx, x, y, &s));
        TT_OK(ctx, tm_rmsnorm(ctx, s, w, 1e-5, &h));
    }
    cr_assert_eq(tm_tensor_dtype(s), dt);
    cr_assert_eq(tm_tensor_dtype(h), dt);
    TT_OK(ctx, tm_mul(ctx, h, g1, &u));
    TT_OK(ctx, tm_mul(ctx, s, g2, &v));
    TT_OK(ctx, tm_add(ctx, u, v, &l));
    TT_OK(ctx, tm_sum_all(ctx, l, &l));
    TT_OK(ctx, tm_backward(ctx, l));
    o->s = tt_read(ctx, s), o->h = tt_read(ctx, h);
    o->dx = tt_read(ctx, tm_tensor_grad(x)), o->dy = tt_read(ctx, tm_tensor_grad(y)), o->dw = tt_read(ctx, tm_tensor_grad(w));
    tm_ctx_free(ctx);
}

static void add_rms_bitwise(tm_dtype dt, int64_t N, int64_t C) {
    add_rms_grads a, b;
    add_rms_run(dt, 0, N, C, &a);
    add_rms_run(dt, 1, N, C, &b);
    size_t nc = sizeof(double) * (size_t)(N * C);
    cr_assert(memcmp(a.s, b.s, nc) == 0, "%s: the sum differs from tm_add's", tm_dtype_name(dt));
    cr_assert(memcmp(a.h, b.h, nc) == 0, "%s: the norm differs from tm_rmsnorm's", tm_dtype_name(dt));
    cr_assert(memcmp(a.dx, b.dx, nc) == 0, "%s: dx differs", tm_dtype_name(dt));
    cr_assert(memcmp(a.dy, b.dy, nc) == 0, "%s: dy differs", tm_dtype_name(dt));
    cr_assert(memcmp(a.dw, b.dw, sizeof(double) * (size_t)C) == 0, "%s: dw differs", tm_dtype_name(dt));
    add_rms_grads *g[2] = {&a, &b};
    for (int k = 0; k < 2; k++) free(g[k]->s), free(g[k]->h), free(g[k]->dx), free(g[k]->dy), free(g[k]->dw);
}

/* 300 x 129 takes the OpenMP paths and rmsnorm's chunked dw. */
Test(rmsnorm, add_rmsnorm_is_bitwise_add_then_rmsnorm_f32) { add_rms_bitwise(TM_F32, 300, 129); }
Test(rmsnorm, add_rmsnorm_is_bitwise_add_then_rmsnorm_f64) { add_rms_bitwise(TM_F64, 7, 13); }
Test(rmsnorm, add_rmsnorm_is_bitwise_add_then_rmsnorm_bf16) { add_rms_bitwise(TM_BF16, 300, 129); }

/* x + x: one tensor as both inputs gets both gradients. */
Test(rmsnorm, add_rmsnorm_same_input_twice) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {4, 6}, ws[1] = {6};
    double *got[2];
    for (int fused = 0; fused < 2; fused++) {
        tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 51), *w = tt_randn(ctx, TM_F32, 1, ws, 52), *s, *h, *l;
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
        if (fused) TT_OK(ctx, tm_add_rmsnorm(ctx, x, x, w, 1e-5, &s, &h));
        else {
            TT_OK(ctx, tm_add(ctx, x, x, &s));
            TT_OK(ctx, tm_rmsnorm(ctx, s, w, 1e-5, &h));
        }
        TT_OK(ctx, tm_mul(ctx, h, s, &l));
        TT_OK(ctx, tm_sum_all(ctx, l, &l));
        TT_OK(ctx, tm_backward(ctx, l));
        got[fused] = tt_read(ctx, tm_tensor_grad(x));
    }
    cr_assert(memcmp(got[0], got[1], sizeof(double) * 24) == 0, "dx of x + x differs");
    free(got[0]), free(got[1]);
    tm_ctx_free(ctx);
}

Test(rmsnorm, add_rmsnorm_bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {2, 5}, ys[2] = {1, 5}, w4 = 4, w5 = 5;
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *s = NULL, *h = NULL;
    tm_tensor *y = tt_randn(ctx, TM_F32, 2, xs, 2), *y1 = tt_randn(ctx, TM_F32, 2, ys, 3);
    tm_tensor *y64 = tt_randn(ctx, TM_F64, 2, xs, 4), *w = tt_randn(ctx, TM_F32, 1, &w5, 5);
    tm_tensor *w_short = tt_randn(ctx, TM_F32, 1, &w4, 6);
    assert_err(ctx, tm_add_rmsnorm(ctx, x, y1, w, 1e-5, &s, &h), TM_ERR_SHAPE, "f32[1,5]", "broadcasting");
    assert_err(ctx, tm_add_rmsnorm(ctx, x, y64, w, 1e-5, &s, &h), TM_ERR_DTYPE, "f64[2,5]", NULL);
    assert_err(ctx, tm_add_rmsnorm(ctx, x, y, w_short, 1e-5, &s, &h), TM_ERR_SHAPE, "f32[4]", "f32[2,5]");
    assert_err(ctx, tm_add_rmsnorm(ctx, x, y, w, -1.0, &s, &h), TM_ERR_INVALID_ARG, "eps", "-1");
    assert_err(ctx, tm_add_rmsnorm(ctx, x, y, w, 1e-5, NULL, &h), TM_ERR_INVALID_ARG, "sum", NULL);
    cr_assert(s == NULL && h == NULL, "outputs were set by a failed call");
    tm_ctx_free(ctx);
}
