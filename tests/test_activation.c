/*
 * test_activation.c — tm_silu and tm_swiglu: forward against the closed form in f64, f32 and
 * bf16, including |x| large enough to overflow a naive exp(-x); backward by finite
 * differences, at extreme inputs against the closed-form derivative, and in f32 (the vectorised
 * kernels) for each subset of wanted gradients; the f32 exponential they use (vecmath.h) over
 * its whole range; bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "../kernels/cpu/vecmath.h"

/* Reference in long double from the textbook formula (no overflow at these magnitudes). */
static double silu_ref(double x) { return (double)((long double)x / (1.0L + expl(-(long double)x))); }
static double dsilu_ref(double x) {
    long double s = 1.0L / (1.0L + expl(-(long double)x));
    return (double)(s * (1.0L + (long double)x * (1.0L - s)));
}

static const double extremes[8] = {-800.0, -100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 800.0};

static void check_forward(tm_dtype dt, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[3] = {3, 5, 7}, s8 = 8;
    tm_tensor *x = tt_randu(ctx, dt, 3, s, 1, -12.0, 12.0), *u = tt_randn(ctx, dt, 3, s, 2), *y, *z;
    TT_OK(ctx, tm_silu(ctx, x, &y));
    TT_OK(ctx, tm_swiglu(ctx, x, u, &z));
    cr_assert_eq(tm_tensor_dtype(y), dt);
    cr_assert_eq(tm_tensor_dim(z, 2), 7);
    double *hx = tt_read(ctx, x), *hu = tt_read(ctx, u), ry[105], rz[105];
    for (int i = 0; i < 105; i++) ry[i] = silu_ref(hx[i]), rz[i] = silu_ref(hx[i]) * hu[i];
    tt_assert_close_host(ctx, y, ry, atol, rtol);
    tt_assert_close_host(ctx, z, rz, atol, rtol);
    /* extremes: finite, silu(-800) = -0 (not NaN from inf * 0 or inf / inf), silu(800) = 800 */
    tm_tensor *xe = tt_from(ctx, dt, 1, &s8, extremes), *ye;
    TT_OK(ctx, tm_silu(ctx, xe, &ye));
    double *he = tt_read(ctx, xe), re[8];
    for (int i = 0; i < 8; i++) re[i] = silu_ref(he[i]);
    tt_assert_close_host(ctx, ye, re, atol, rtol);
    free(hx), free(hu), free(he);
    tm_ctx_free(ctx);
}

/* f64: a few ulp from exp. f32: expf in f32, a few ulp. bf16: the output rounding. */
Test(activation, forward_f64) { check_forward(TM_F64, 1e-300, 1e-14); }
Test(activation, forward_f32) { check_forward(TM_F32, 1e-30, 2e-6); }
Test(activation, forward_bf16) { check_forward(TM_BF16, 1e-30, 8e-3); }

/* The gradient at the extremes stays finite and matches the closed form (0 and 1 in the
 * limits; a finite-difference check would be meaningless at +-800). */
Test(activation, backward_extremes) {
    tm_ctx *ctx = tt_ctx();
    int64_t s8 = 8;
    tm_tensor *x = tt_from(ctx, TM_F64, 1, &s8, extremes), *y;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_silu(ctx, x, &y));
    double ones[8] = {1, 1, 1, 1, 1, 1, 1, 1}, want[8];
    TT_OK(ctx, tm_backward_with_grad(ctx, y, tt_from(ctx, TM_F64, 1, &s8, ones)));
    for (int i = 0; i < 8; i++) want[i] = dsilu_ref(extremes[i]);
    tt_assert_close_host(ctx, tm_tensor_grad(x), want, 1e-300, 1e-13);
    tm_ctx_free(ctx);
}

/* tm__exp_f32 against exp() in f64 on every 61st float of [-87.34, 88.38] (~37M values,
 * all binades): within 2 ulp (measured 1.01 over every float, with and without FMA), and
 * the documented limits: 0 below ln(FLT_MIN), +inf above 127.5 ln 2, NaN for NaN. */
Test(activation, exp_f32_range) {
    const float lo = -87.33654475f, hi = 88.3762626647949f;
    double worst = 0;
    for (uint32_t bits = 0; bits < 0xff800000u; bits += 61) {
        float x;
        memcpy(&x, &bits, sizeof x);
        if (!(x >= lo && x <= hi)) continue;
        const double want = exp((double)x);
        const float w = (float)want, ulp = nextafterf(w, INFINITY) - w;
        const double err = fabs((double)tm__exp_f32(x) - want) / ulp;
        worst = err > worst ? err : worst;
    }
    cr_assert(worst <= 2.0, "worst error %g ulp", worst);
    const float below[3] = {-INFINITY, -1000.0f, nextafterf(lo, -INFINITY)};
    const float above[3] = {INFINITY, 1000.0f, nextafterf(hi, INFINITY)};
    for (int i = 0; i < 3; i++) {
        cr_assert(tm__exp_f32(below[i]) == 0.0f, "exp(%g) = %g", below[i], tm__exp_f32(below[i]));
        cr_assert(isinf(tm__exp_f32(above[i])), "exp(%g) = %g", above[i], tm__exp_f32(above[i]));
    }
    cr_assert(isnan(tm__exp_f32(NAN)));
    cr_assert(tm__exp_f32(0.0f) == 1.0f);
}

/* The f32 backward (vectorised, one loop per subset of wanted gradients) against the closed
 * form, on random inputs and the extremes. Tolerance: a few f32 ulp of each factor, 1e-6
 * relative, plus 1e-6 absolute where silu'(x) = s (1 + x (1 - s)) cancels (x near -1.28). */
Test(activation, backward_f32) {
    enum { N = 213 };
    for (int want_g = 0; want_g < 2; want_g++)
        for (int want_u = 0; want_u < 2; want_u++) {
            if (!want_g && !want_u) continue;
            tm_ctx *ctx = tt_ctx();
            int64_t n = N;
            double gv[N];
            tm_tensor *g0 = tt_randu(ctx, TM_F64, 1, &n, 81, -15.0, 15.0);
            TT_OK(ctx, tm_tensor_read(ctx, g0, TM_F64, gv, N));
            for (int i = 0; i < 8; i++) gv[i] = extremes[i];
            tm_tensor *g = tt_from(ctx, TM_F32, 1, &n, gv), *u = tt_randn(ctx, TM_F32, 1, &n, 82);
            tm_tensor *dy = tt_randn(ctx, TM_F32, 1, &n, 83), *x = tt_from(ctx, TM_F32, 1, &n, gv), *y, *z;
            TT_OK(ctx, tm_tensor_set_requires_grad(ctx, g, want_g));
            TT_OK(ctx, tm_tensor_set_requires_grad(ctx, u, want_u));
            TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
            TT_OK(ctx, tm_swiglu(ctx, g, u, &z));
            TT_OK(ctx, tm_backward_with_grad(ctx, z, dy));
            TT_OK(ctx, tm_silu(ctx, x, &y));
            TT_OK(ctx, tm_backward_with_grad(ctx, y, dy));
            double *hg = tt_read(ctx, g), *hu = tt_read(ctx, u), *hdy = tt_read(ctx, dy);
            double wg[N], wu[N], wx[N];
            for (int i = 0; i < N; i++) {
                wg[i] = hdy[i] * hu[i] * dsilu_ref(hg[i]);
                wu[i] = hdy[i] * silu_ref(hg[i]);
                wx[i] = hdy[i] * dsilu_ref(hg[i]);
            }
            if (want_g) tt_assert_close_host(ctx, tm_tensor_grad(g), wg, 1e-6, 1e-6);
            else cr_assert_null(tm_tensor_grad(g));
            if (want_u) tt_assert_close_host(ctx, tm_tensor_grad(u), wu, 1e-6, 1e-6);
            else cr_assert_null(tm_tensor_grad(u));
            tt_assert_close_host(ctx, tm_tensor_grad(x), wx, 1e-6, 1e-6);
            free(hg), free(hu), free(hdy);
            tm_ctx_free(ctx);
        }
}

static tm_status silu_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_silu(ctx, in[0], out);
}
static tm_status swiglu_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_swiglu(ctx, in[0], in[1], out);
}

/* Inputs over [-6, 6): both branches of the stable sigmoid and the curved region. */
double tt_gradcase_silu(tm_ctx *ctx) {
    int64_t s[3] = {2, 3, 7};
    tm_tensor *in[1] = {tt_randu(ctx, TM_F64, 3, s, 71, -6.0, 6.0)};
    int check[1] = {1};
    return tt_gradcheck(ctx, silu_fn, NULL, 1, in, check, 1e-6, 1e-8, 1e-6);
}

double tt_gradcase_swiglu(tm_ctx *ctx) {
    int64_t s[3] = {2, 3, 7};
    tm_tensor *in[2] = {tt_randu(ctx, TM_F64, 3, s, 73, -6.0, 6.0), tt_randn(ctx, TM_F64, 3, s, 74)};
    int check[2] = {1, 1};
    return tt_gradcheck(ctx, swiglu_fn, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}

Test(activation, gradcheck_silu) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_silu(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(activation, gradcheck_swiglu) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_swiglu(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

/* Only up needs a gradient: gate's slot is NULL in backward. */
Test(activation, swiglu_one_input_grad) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[1] = {5};
    tm_tensor *g = tt_randn(ctx, TM_F64, 1, s, 1), *u = tt_randn(ctx, TM_F64, 1, s, 2), *y;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, u, 1));
    TT_OK(ctx, tm_swiglu(ctx, g, u, &y));
    tm_tensor *dy = tt_randn(ctx, TM_F64, 1, s, 3);
    TT_OK(ctx, tm_backward_with_grad(ctx, y, dy));
    cr_assert_null(tm_tensor_grad(g));
    double *hg = tt_read(ctx, g), *hdy = tt_read(ctx, dy), want[5];
    for (int i = 0; i < 5; i++) want[i] = hdy[i] * silu_ref(hg[i]);
    tt_assert_close_host(ctx, tm_tensor_grad(u), want, 1e-15, 1e-14);
    free(hg), free(hdy);
    tm_ctx_free(ctx);
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *op, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, op), "message lacks the op name %s: %s", op, msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

Test(activation, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {3, 5}, t[2] = {5, 3};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, s, 1), *xt = tt_randn(ctx, TM_F32, 2, t, 2), *out = NULL;
    tm_tensor *xd = tt_randn(ctx, TM_F64, 2, s, 3), *xi = tt_randint(ctx, TM_I32, 2, s, 4, 3);
    assert_err(ctx, tm_silu(ctx, xi, &out), TM_ERR_DTYPE, "silu", "i32[3,5]", NULL);
    assert_err(ctx, tm_swiglu(ctx, x, xt, &out), TM_ERR_SHAPE, "swiglu", "f32[3,5]", "f32[5,3]");
    assert_err(ctx, tm_swiglu(ctx, x, xd, &out), TM_ERR_DTYPE, "swiglu", "f64[3,5]", NULL);
    assert_err(ctx, tm_swiglu(ctx, xi, xi, &out), TM_ERR_DTYPE, "swiglu", "i32[3,5]", NULL);
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}
