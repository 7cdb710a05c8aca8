/*
 * test_moe_gating.c — tm_moe_gating (the router's gating GEMM): the gradient check, the forward
 * against sums in f64 for every dtype pair it takes, bf16 x against the cast + matmul it replaces
 * (forward and dw bit for bit on the CPU: the same GEMM on the same f32 values; dx bit for bit
 * when fresh, and when added to a gradient x already has within half a bf16 step of the exact
 * value: one rounding, where the cast's path rounds twice), and its error messages.
 * CUDA parity: tests/test_cuda_parity.c (the moe_gating rows).
 */
#include <math.h>
#include <string.h>

#include "common.h"

static tm_status gating_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_moe_gating(ctx, in[0], in[1], out);
}

double tt_gradcase_moe_gating(tm_ctx *ctx) {
    int64_t xs[2] = {7, 13}, ws[2] = {13, 5};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 2, xs, 301), tt_randn(ctx, TM_F64, 2, ws, 302)};
    int check[2] = {1, 1};
    return tt_gradcheck(ctx, gating_fn, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}

Test(moe_gating, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_gating(ctx);
    cr_assert_leq(r, 1.0, "moe_gating gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

/* logits against sum_h x w in f64 from the stored values: f64, f32, and bf16 x with f32 w
 * (f32 sums of 21 terms: 1e-6 relative to the terms' scale) */
Test(moe_gating, forward_matches_f64_sums) {
    const tm_dtype xdt[3] = {TM_F64, TM_F32, TM_BF16}, wdt[3] = {TM_F64, TM_F32, TM_F32};
    for (int k = 0; k < 3; k++) {
        tm_ctx *ctx = tt_ctx();
        const int64_t T = 9, H = 21, E = 6, xs[2] = {T, H}, ws[2] = {H, E};
        tm_tensor *x = tt_randn(ctx, xdt[k], 2, xs, 310 + k), *w = tt_randn(ctx, wdt[k], 2, ws, 320 + k), *y;
        TT_OK(ctx, tm_moe_gating(ctx, x, w, &y));
        cr_assert_eq(tm_tensor_dtype(y), wdt[k]);
        cr_assert(tm_tensor_dim(y, 0) == T && tm_tensor_dim(y, 1) == E);
        double *vx = tt_read(ctx, x), *vw = tt_read(ctx, w), want[9 * 6];
        for (int64_t t = 0; t < T; t++)
            for (int64_t e = 0; e < E; e++) {
                double s = 0;
                for (int64_t h = 0; h < H; h++) s += vx[t * H + h] * vw[h * E + e];
                want[t * E + e] = s;
            }
        const double tol = wdt[k] == TM_F64 ? 1e-13 : 1e-5;
        tt_assert_close_host(ctx, y, want, tol, tol);
        free(vx), free(vw);
        tm_ctx_free(ctx);
    }
}

/* loss = sum(logits * r) + (use_x_twice ? sum(x * q) : 0) through gating (which = 0) or through
 * cast + matmul (which = 1); returns the gradients of x and w and the logits. With x used twice
 * its gradient already holds the other term when one of the two backwards runs. */
static void run_path(int which, int use_x_twice, double **logits, double **gx, double **gw, double *dx_exact) {
    tm_ctx *ctx = tt_ctx();
    const int64_t T = 11, H = 24, E = 7, xs[2] = {T, H}, ws[2] = {H, E}, ls[2] = {T, E};
    tm_tensor *x = tt_randn(ctx, TM_BF16, 2, xs, 330), *w = tt_randn(ctx, TM_F32, 2, ws, 331);
    tm_tensor *r = tt_randn(ctx, TM_F32, 2, ls, 332), *q = tt_randn(ctx, TM_BF16, 2, xs, 333);
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    tm_tensor *y, *xf, *p, *loss, *p2, *l2, *l2f, *tot;
    if (which == 0) TT_OK(ctx, tm_moe_gating(ctx, x, w, &y));
    else {
        TT_OK(ctx, tm_cast(ctx, x, TM_F32, &xf));
        TT_OK(ctx, tm_matmul(ctx, xf, w, 0, 0, &y));
    }
    TT_OK(ctx, tm_mul(ctx, y, r, &p));
    TT_OK(ctx, tm_sum_all(ctx, p, &loss));
    tot = loss;
    if (use_x_twice) {
        TT_OK(ctx, tm_mul(ctx, x, q, &p2));
        TT_OK(ctx, tm_sum_all(ctx, p2, &l2));
        TT_OK(ctx, tm_cast(ctx, l2, TM_F32, &l2f));
        TT_OK(ctx, tm_add(ctx, loss, l2f, &tot));
    }
    TT_OK(ctx, tm_backward(ctx, tot));
    *logits = tt_read(ctx, y);
    double *vr = tt_read(ctx, r), *vw = tt_read(ctx, w), *vq = tt_read(ctx, q);
    for (int64_t t = 0; t < T; t++) /* dx = r w^T (+ q) in f64 from the stored values */
        for (int64_t h = 0; h < H; h++) {
            double v = use_x_twice ? vq[t * H + h] : 0.0;
            for (int64_t e = 0; e < E; e++) v += vr[t * E + e] * vw[h * E + e];
            dx_exact[t * H + h] = v;
        }
    free(vr), free(vw), free(vq);
    *gx = tt_read(ctx, tm_tensor_grad(x));
    *gw = tt_read(ctx, tm_tensor_grad(w));
    tm_ctx_free(ctx);
}

Test(moe_gating, bf16_equals_cast_matmul) {
    for (int twice = 0; twice < 2; twice++) {
        double *va, *vb, *gxa, *gwa, *gxb, *gwb, ex[11 * 24], ex2[11 * 24];
        run_path(0, twice, &va, &gxa, &gwa, ex);
        run_path(1, twice, &vb, &gxb, &gwb, ex2);
        for (int i = 0; i < 11 * 7; i++) cr_assert_eq(va[i], vb[i], "logits[%d]: %.9g vs %.9g", i, va[i], vb[i]);
        for (int i = 0; i < 24 * 7; i++) cr_assert_eq(gwa[i], gwb[i], "dw[%d]: %.9g vs %.9g", i, gwa[i], gwb[i]);
        /* dx: the f32 sum (plus the other use's term, added in f32) rounded once to bf16: within
         * half a bf16 step (at most 2^-8 relative) of the exact value, with 2^-16 for the f32 sums. The
         * cast + matmul path rounds the gating term to bf16 before adding the other term, so it
         * may be further off (not asserted: that is what this op removes). */
        for (int i = 0; i < 11 * 24; i++)
            cr_assert_leq(fabs(gxa[i] - ex[i]), ldexp(fabs(ex[i]), -8) + ldexp(fabs(ex[i]), -16) + 1e-30,
                          "dx[%d] (x used %s): %.9g, exact %.9g (cast + matmul: %.9g)", i, twice ? "twice" : "once",
                          gxa[i], ex[i], gxb[i]);
        if (!twice) /* fresh: both paths round the same f32 sum once */
            for (int i = 0; i < 11 * 24; i++) cr_assert_eq(gxa[i], gxb[i], "dx[%d]: %.9g vs %.9g", i, gxa[i], gxb[i]);
        free(va), free(vb), free(gxa), free(gwa), free(gxb), free(gwb);
    }
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, "moe_gating"), "message lacks the op name: %s", msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

Test(moe_gating, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {3, 5}, ws[2] = {5, 2}, wbad[2] = {4, 2}, x3[3] = {2, 3, 5};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *w = tt_randn(ctx, TM_F32, 2, ws, 2), *out = NULL;
    tm_tensor *wb = tt_randn(ctx, TM_BF16, 2, ws, 3), *xd = tt_randn(ctx, TM_F64, 2, xs, 4);
    tm_tensor *w4 = tt_randn(ctx, TM_F32, 2, wbad, 5), *xx = tt_randn(ctx, TM_F32, 3, x3, 6);
    assert_err(ctx, tm_moe_gating(ctx, x, wb, &out), TM_ERR_DTYPE, "bf16[5,2]", NULL);
    assert_err(ctx, tm_moe_gating(ctx, xd, w, &out), TM_ERR_DTYPE, "f64[3,5]", "f32[5,2]");
    assert_err(ctx, tm_moe_gating(ctx, x, w4, &out), TM_ERR_SHAPE, "f32[3,5]", "f32[4,2]");
    assert_err(ctx, tm_moe_gating(ctx, xx, w, &out), TM_ERR_SHAPE, "f32[2,3,5]", NULL);
    tm_ctx_free(ctx);
}
