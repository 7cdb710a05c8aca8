/*
 * test_softmax.c — tm_softmax / tm_log_softmax over the last axis: forward against a naive loop
 * (f64, f32, bf16), invariance to a large shift (max subtraction), gradients by finite
 * differences, f32 backward against f64, bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

typedef tm_status (*softmax_op)(tm_ctx *, tm_tensor *, tm_tensor **);

static void softmax_ref(double *y, const double *x, int64_t N, int64_t C, int log_out) {
    for (int64_t n = 0; n < N; n++) {
        double mx = -INFINITY, s = 0;
        for (int64_t i = 0; i < C; i++) mx = fmax(mx, x[n * C + i]);
        for (int64_t i = 0; i < C; i++) s += exp(x[n * C + i] - mx);
        for (int64_t i = 0; i < C; i++)
            y[n * C + i] = log_out ? x[n * C + i] - mx - log(s) : exp(x[n * C + i] - mx) / s;
    }
}

static void check_forward(softmax_op op, int log_out, tm_dtype dt, double shift, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[3] = {2, 3, 17}, N = 6, C = 17;
    tm_tensor *x = tt_randu(ctx, dt, 3, xs, 7, shift - 4, shift + 4), *y;
    TT_OK(ctx, op(ctx, x, &y));
    cr_assert_eq(tm_tensor_dtype(y), dt);
    cr_assert_eq(tm_tensor_numel(y), N * C);
    cr_assert_eq(tm_tensor_dim(y, -1), C);
    double *hx = tt_read(ctx, x), *ref = malloc(sizeof(double) * N * C);
    softmax_ref(ref, hx, N, C, log_out);
    tt_assert_close_host(ctx, y, ref, atol, rtol);
    free(hx), free(ref);
    tm_ctx_free(ctx);
}

Test(softmax, forward_f64) { check_forward(tm_softmax, 0, TM_F64, 0, 1e-15, 1e-13); }
Test(softmax, forward_f32) { check_forward(tm_softmax, 0, TM_F32, 0, 1e-8, 1e-6); }
/* bf16: inputs exact in f32, computed in f32; the output rounding (<= 2^-9 relative) dominates. */
Test(softmax, forward_bf16) { check_forward(tm_softmax, 0, TM_BF16, 0, 1e-4, 4e-3); }
Test(log_softmax, forward_f64) { check_forward(tm_log_softmax, 1, TM_F64, 0, 1e-13, 1e-13); }
Test(log_softmax, forward_f32) { check_forward(tm_log_softmax, 1, TM_F32, 0, 1e-6, 1e-6); }
Test(log_softmax, forward_bf16) { check_forward(tm_log_softmax, 1, TM_BF16, 0, 1e-3, 4e-3); }

/* exp(1000) overflows f64 and exp(100) f32: only the max-subtracted form stays finite. */
Test(softmax, large_logits_f64) { check_forward(tm_softmax, 0, TM_F64, 1000, 1e-15, 1e-12); }
Test(softmax, large_logits_f32) { check_forward(tm_softmax, 0, TM_F32, 100, 1e-8, 1e-5); }
/* log_softmax(x + 1000): the f64 inputs themselves carry ~1e-13 of absolute rounding. */
Test(log_softmax, large_logits_f64) { check_forward(tm_log_softmax, 1, TM_F64, 1000, 1e-12, 1e-12); }

Test(softmax, rows_sum_to_one_and_1d) {
    tm_ctx *ctx = tt_ctx();
    int64_t C = 1001;
    tm_tensor *x = tt_randn(ctx, TM_F32, 1, &C, 3), *y;
    TT_OK(ctx, tm_softmax(ctx, x, &y));
    double *hy = tt_read(ctx, y), s = 0;
    for (int64_t i = 0; i < C; i++) {
        cr_assert(hy[i] > 0);
        s += hy[i];
    }
    cr_assert_float_eq(s, 1.0, 1e-5);
    free(hy);
    tm_ctx_free(ctx);
}

static tm_status softmax_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_softmax(ctx, in[0], out);
}
static tm_status log_softmax_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_log_softmax(ctx, in[0], out);
}

double tt_gradcase_softmax(tm_ctx *ctx) {
    int64_t xs[3] = {3, 2, 7};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 3, xs, 31)};
    int check[1] = {1};
    return tt_gradcheck(ctx, softmax_fn, NULL, 1, in, check, 1e-6, 1e-8, 1e-6);
}

double tt_gradcase_log_softmax(tm_ctx *ctx) {
    int64_t xs[2] = {5, 9};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 2, xs, 32)};
    int check[1] = {1};
    return tt_gradcheck(ctx, log_softmax_fn, NULL, 1, in, check, 1e-6, 1e-8, 1e-6);
}

Test(softmax, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_softmax(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(log_softmax, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_log_softmax(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

/* Gradient of sum(op(x) * g) for x and g given as f64 host arrays, computed in dtype dt. */
static double *grad_in(softmax_op op, tm_dtype dt, int64_t N, int64_t C, const double *x, const double *g) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {N, C};
    tm_tensor *tx = tt_from(ctx, dt, 2, xs, x), *tg = tt_from(ctx, dt, 2, xs, g), *y;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, tx, 1));
    TT_OK(ctx, op(ctx, tx, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, tg));
    double *d = tt_read(ctx, tm_tensor_grad(tx));
    tm_ctx_free(ctx);
    return d;
}

/* The f32 kernels against the (finite-difference checked) f64 ones, on a size that takes the
 * OpenMP path. The inputs are f32 values, so both see identical data. */
static void check_backward_f32(softmax_op op) {
    const int64_t N = 97, C = 345;
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {N, C};
    double *x = tt_read(ctx, tt_randn(ctx, TM_F32, 2, xs, 41)), *g = tt_read(ctx, tt_randn(ctx, TM_F32, 2, xs, 42));
    tm_ctx_free(ctx);
    double *d32 = grad_in(op, TM_F32, N, C, x, g), *d64 = grad_in(op, TM_F64, N, C, x, g);
    double r = tt_close_ratio(d32, d64, N * C, 1e-6, 1e-4);
    cr_assert_leq(r, 1.0, "f32 vs f64 gradient ratio %g", r);
    free(x), free(g), free(d32), free(d64);
}

Test(softmax, backward_f32) { check_backward_f32(tm_softmax); }
Test(log_softmax, backward_f32) { check_backward_f32(tm_log_softmax); }

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *op, const char *a) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, op), "message lacks the op name: %s", msg);
    cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
}

Test(softmax, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {3, 4};
    tm_tensor *xi = tt_randint(ctx, TM_I64, 2, xs, 1, 5), *s = tt_randn(ctx, TM_F32, 0, xs, 2), *out = NULL;
    assert_err(ctx, tm_softmax(ctx, xi, &out), TM_ERR_DTYPE, "softmax", "i64[3,4]");
    assert_err(ctx, tm_log_softmax(ctx, xi, &out), TM_ERR_DTYPE, "log_softmax", "i64[3,4]");
    assert_err(ctx, tm_softmax(ctx, s, &out), TM_ERR_SHAPE, "softmax", "f32[]");
    assert_err(ctx, tm_log_softmax(ctx, s, &out), TM_ERR_SHAPE, "log_softmax", "f32[]");
    cr_assert_null(out);
    tm_ctx_free(ctx);
}
