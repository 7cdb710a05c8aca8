/*
 * test_rope.c — tm_rope: forward against a naive rotate-half loop (f64 / f32 / bf16), closed
 * forms (position 0 is the identity, D = 2 rotates by the position itself, the backward is the
 * inverse rotation), the canonical gradient case and bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* Reference straight from the header: pairs (i, i + D/2), angle = pos * theta^(-2i/D). */
static void ref_rope(const double *x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t pos0, double theta,
                     double *y) {
    int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const double *xr = x + ((b * T + t) * H + h) * D;
                double *yr = y + ((b * T + t) * H + h) * D;
                for (int64_t i = 0; i < half; i++) {
                    double inv_freq = pow(theta, -(double)(2 * i) / (double)D);
                    double ang = (double)(pos0 + t) * inv_freq;
                    yr[i] = xr[i] * cos(ang) - xr[i + half] * sin(ang);
                    yr[i + half] = xr[i + half] * cos(ang) + xr[i] * sin(ang);
                }
            }
}

static void check_forward(tm_dtype dt, int64_t B, int64_t T, int64_t H, int64_t D, int64_t pos0, double theta,
                          double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    int64_t shape[4] = {B, T, H, D}, n = B * T * H * D;
    tm_tensor *x = tt_randn(ctx, dt, 4, shape, 11), *y;
    TT_OK(ctx, tm_rope(ctx, x, pos0, theta, &y));
    cr_assert_eq(tm_tensor_dtype(y), dt);
    for (int a = 0; a < 4; a++) cr_assert_eq(tm_tensor_dim(y, a), shape[a]);
    double *xv = tt_read(ctx, x), *want = malloc((size_t)n * sizeof(double));
    ref_rope(xv, B, T, H, D, pos0, theta, want);
    tt_assert_close_host(ctx, y, want, atol, rtol);
    free(xv);
    free(want);
    tm_ctx_free(ctx);
}

/* Tolerances: the kernel computes in f64 from f64 cos/sin tables, so f64 agrees to rounding;
 * f32 / bf16 only round the result (bf16: 8-bit significand, ~4e-3 relative). */
Test(rope, forward_f64) { check_forward(TM_F64, 2, 5, 3, 6, 11, 10000.0, 1e-13, 1e-12); }
Test(rope, forward_f32) { check_forward(TM_F32, 2, 7, 3, 10, 3, 500.0, 1e-6, 1e-6); }
Test(rope, forward_bf16) { check_forward(TM_BF16, 1, 5, 2, 6, 0, 10000.0, 1e-2, 1e-2); }
/* Large positions (a long KV cache) and enough rows for the threaded path. An angle near 7e4
 * carries ~1e-11 of rounding whichever way it is computed, hence the looser f64 atol. */
Test(rope, forward_large_f64) { check_forward(TM_F64, 3, 37, 5, 66, 70000, 10000.0, 1e-10, 1e-10); }
Test(rope, forward_large_f32) { check_forward(TM_F32, 3, 37, 5, 66, 70000, 1000000.0, 1e-6, 1e-6); }

Test(rope, position_zero_is_identity) {
    tm_ctx *ctx = tt_ctx();
    int64_t shape[4] = {2, 1, 3, 8};
    tm_tensor *x = tt_randn(ctx, TM_F64, 4, shape, 5), *y;
    TT_OK(ctx, tm_rope(ctx, x, 0, 10000.0, &y));
    double *xv = tt_read(ctx, x), *yv = tt_read(ctx, y);
    for (int i = 0; i < 2 * 3 * 8; i++) cr_assert_eq(yv[i], xv[i], "element %d: %.17g != %.17g", i, yv[i], xv[i]);
    free(xv);
    free(yv);
    tm_ctx_free(ctx);
}

/* D = 2: inv_freq = 1, so x = (1, 0) at position p becomes (cos p, sin p). Pins the sign. */
Test(rope, unit_vector_rotates_by_position) {
    tm_ctx *ctx = tt_ctx();
    int64_t shape[4] = {1, 4, 1, 2};
    double xv[8] = {1, 0, 1, 0, 1, 0, 1, 0}, want[8];
    for (int t = 0; t < 4; t++) want[2 * t] = cos(5.0 + t), want[2 * t + 1] = sin(5.0 + t);
    tm_tensor *x = tt_from(ctx, TM_F64, 4, shape, xv), *y;
    TT_OK(ctx, tm_rope(ctx, x, 5, 123.0, &y));
    tt_assert_close_host(ctx, y, want, 1e-15, 1e-14);
    tm_ctx_free(ctx);
}

/* The backward applies the inverse rotation: feeding y = R x as the upstream gradient of R x'
 * gives back R^T R x = x. */
Test(rope, backward_is_inverse_rotation) {
    tm_ctx *ctx = tt_ctx();
    int64_t shape[4] = {2, 6, 3, 10};
    tm_tensor *x = tt_randn(ctx, TM_F64, 4, shape, 21), *y, *z;
    tm_tensor *leaf = tt_randn(ctx, TM_F64, 4, shape, 22);
    int prev = tm_ctx_set_grad_enabled(ctx, 0);
    TT_OK(ctx, tm_rope(ctx, x, 9, 1000.0, &y));
    tm_ctx_set_grad_enabled(ctx, 1);
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, leaf, 1));
    TT_OK(ctx, tm_rope(ctx, leaf, 9, 1000.0, &z));
    TT_OK(ctx, tm_backward_with_grad(ctx, z, y));
    cr_assert_not_null(tm_tensor_grad(leaf));
    tt_assert_close(ctx, tm_tensor_grad(leaf), x, 1e-14, 1e-13);
    tm_ctx_set_grad_enabled(ctx, prev);
    tm_ctx_free(ctx);
}

static tm_status rope_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    (void)user;
    return tm_rope(ctx, in[0], 7, 500.0, out);
}

double tt_gradcase_rope(tm_ctx *ctx) {
    int64_t shape[4] = {2, 5, 3, 6};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 4, shape, 31)};
    int check[1] = {1};
    return tt_gradcheck(ctx, rope_fn, NULL, 1, in, check, 1e-6, 1e-8, 1e-6);
}

Test(rope, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_rope(ctx);
    cr_assert(r <= 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

/* ---- bad inputs ------------------------------------------------------------------------- */

static void expect_error(tm_ctx *ctx, tm_tensor *x, int64_t pos0, double theta, tm_status want, const char *frag) {
    tm_tensor *y = NULL;
    tm_status s = tm_rope(ctx, x, pos0, theta, &y);
    cr_assert_eq(s, want, "got %s: %s", tm_status_str(s), tm_ctx_errmsg(ctx));
    cr_assert_null(y);
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert(strstr(msg, "rope"), "message does not name the op: %s", msg);
    cr_assert(strstr(msg, frag), "message lacks '%s': %s", frag, msg);
}

Test(rope, odd_head_dim) {
    tm_ctx *ctx = tt_ctx();
    int64_t shape[4] = {2, 3, 4, 5};
    expect_error(ctx, tt_randn(ctx, TM_F32, 4, shape, 1), 0, 10000.0, TM_ERR_SHAPE, "[2,3,4,5]");
    tm_ctx_free(ctx);
}

Test(rope, wrong_rank) {
    tm_ctx *ctx = tt_ctx();
    int64_t shape[3] = {3, 4, 6};
    expect_error(ctx, tt_randn(ctx, TM_F32, 3, shape, 1), 0, 10000.0, TM_ERR_SHAPE, "[3,4,6]");
    tm_ctx_free(ctx);
}

Test(rope, bad_theta_and_offset) {
    tm_ctx *ctx = tt_ctx();
    int64_t shape[4] = {1, 3, 2, 4};
    tm_tensor *x = tt_randn(ctx, TM_F32, 4, shape, 1);
    expect_error(ctx, x, 0, 0.0, TM_ERR_INVALID_ARG, "theta");
    expect_error(ctx, x, 0, -5.0, TM_ERR_INVALID_ARG, "-5");
    expect_error(ctx, x, 0, NAN, TM_ERR_INVALID_ARG, "theta");
    expect_error(ctx, x, -3, 10000.0, TM_ERR_INVALID_ARG, "-3");
    tm_ctx_free(ctx);
}

Test(rope, integer_input) {
    tm_ctx *ctx = tt_ctx();
    int64_t shape[4] = {1, 3, 2, 4};
    expect_error(ctx, tt_randint(ctx, TM_I32, 4, shape, 1, 10), 0, 10000.0, TM_ERR_DTYPE, "i32");
    tm_ctx_free(ctx);
}

Test(rope, empty) {
    tm_ctx *ctx = tt_ctx();
    int64_t shape[4] = {2, 0, 3, 4};
    tm_tensor *x = tt_randn(ctx, TM_F32, 4, shape, 1), *y;
    TT_OK(ctx, tm_rope(ctx, x, 0, 10000.0, &y));
    cr_assert_eq(tm_tensor_numel(y), 0);
    tm_ctx_free(ctx);
}
