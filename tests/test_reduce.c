/*
 * test_reduce.c — tm_sum, tm_mean (every axis, negative axes, keepdim) and tm_sum_all,
 * tm_mean_all: forward against a naive loop in f64, f32 and bf16; backward by finite
 * differences; the *_all chunked sum bit-identical for 1, 2 and 3 threads; empty inputs;
 * bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static const int64_t xs[4] = {2, 3, 5, 7};

/* sum (or mean) of x (shape xs) over axis, as (outer, inner). */
static void reduce_ref(const double *x, int axis, int mean, double *out) {
    int64_t outer = 1, inner = 1, n = xs[axis];
    for (int d = 0; d < axis; d++) outer *= xs[d];
    for (int d = axis + 1; d < 4; d++) inner *= xs[d];
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < inner; i++) {
            double s = 0;
            for (int64_t k = 0; k < n; k++) s += x[(o * n + k) * inner + i];
            out[o * inner + i] = mean ? s / (double)n : s;
        }
}

static void check_axis(tm_dtype dt, double atol, double rtol) {
    for (int mean = 0; mean < 2; mean++)
        for (int axis = -4; axis < 4; axis++)
            for (int keep = 0; keep < 2; keep++) {
                tm_ctx *ctx = tt_ctx();
                tm_tensor *x = tt_randn(ctx, dt, 4, xs, 7), *y;
                TT_OK(ctx, mean ? tm_mean(ctx, x, axis, keep, &y) : tm_sum(ctx, x, axis, keep, &y));
                int ax = axis < 0 ? axis + 4 : axis;
                cr_assert_eq(tm_tensor_dtype(y), dt);
                cr_assert_eq(tm_tensor_ndim(y), keep ? 4 : 3);
                for (int d = 0, e = 0; d < 4; d++) {
                    if (d == ax && !keep) continue;
                    cr_assert_eq(tm_tensor_dim(y, e), d == ax ? 1 : xs[d], "axis %d keep %d dim %d", axis, keep, e);
                    e++;
                }
                double *hx = tt_read(ctx, x), ref[2 * 3 * 5 * 7];
                reduce_ref(hx, ax, mean, ref);
                tt_assert_close_host(ctx, y, ref, atol, rtol);
                free(hx);
                tm_ctx_free(ctx);
            }
}

/* Sums are accumulated in f64: one rounding to the output dtype. */
Test(reduce, axis_f64) { check_axis(TM_F64, 1e-14, 1e-14); }
Test(reduce, axis_f32) { check_axis(TM_F32, 1e-6, 1e-6); }
Test(reduce, axis_bf16) { check_axis(TM_BF16, 1e-2, 4e-3); }

static void check_all(tm_dtype dt, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    tm_tensor *x = tt_randn(ctx, dt, 4, xs, 9), *s, *m;
    TT_OK(ctx, tm_sum_all(ctx, x, &s));
    TT_OK(ctx, tm_mean_all(ctx, x, &m));
    cr_assert_eq(tm_tensor_ndim(s), 0);
    cr_assert_eq(tm_tensor_numel(s), 1);
    cr_assert_eq(tm_tensor_ndim(m), 0);
    cr_assert_eq(tm_tensor_dtype(m), dt);
    double *hx = tt_read(ctx, x), want = 0;
    for (int i = 0; i < 210; i++) want += hx[i];
    tt_assert_close_host(ctx, s, &want, atol, rtol);
    want /= 210;
    tt_assert_close_host(ctx, m, &want, atol, rtol);
    free(hx);
    tm_ctx_free(ctx);
}

Test(reduce, all_f64) { check_all(TM_F64, 1e-13, 1e-14); }
Test(reduce, all_f32) { check_all(TM_F32, 1e-6, 1e-6); }
Test(reduce, all_bf16) { check_all(TM_BF16, 1e-2, 4e-3); }

/* The sum of an empty tensor is 0, its mean NaN (0 / 0). */
Test(reduce, empty) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {3, 0};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, s, 1), *y;
    double v[3];
    TT_OK(ctx, tm_sum_all(ctx, x, &y));
    TT_OK(ctx, tm_tensor_read(ctx, y, TM_F64, v, 1));
    cr_assert_eq(v[0], 0.0);
    TT_OK(ctx, tm_mean_all(ctx, x, &y));
    TT_OK(ctx, tm_tensor_read(ctx, y, TM_F64, v, 1));
    cr_assert(isnan(v[0]));
    TT_OK(ctx, tm_sum(ctx, x, 1, 0, &y));
    TT_OK(ctx, tm_tensor_read(ctx, y, TM_F64, v, 3));
    for (int i = 0; i < 3; i++) cr_assert_eq(v[i], 0.0);
    TT_OK(ctx, tm_mean(ctx, x, -1, 1, &y));
    cr_assert_eq(tm_tensor_dim(y, 1), 1);
    TT_OK(ctx, tm_tensor_read(ctx, y, TM_F64, v, 3));
    for (int i = 0; i < 3; i++) cr_assert(isnan(v[i]));
    tm_ctx_free(ctx);
}

/* sum_all of 100003 f32 values: several fixed chunks, summed in chunk order. */
Test(reduce, all_large_thread_invariant) {
    const int64_t n = 100003;
    tm_ctx *ctx = tt_ctx();
    double *x = tt_read(ctx, tt_randn(ctx, TM_F32, 1, &n, 5));
    tm_ctx_free(ctx);
    double want = 0, got[3];
    for (int64_t i = 0; i < n; i++) want += x[i];
    for (int t = 0; t < 3; t++) {
        tm_ctx_options o = tm_ctx_options_default();
        o.num_threads = t + 1;
        cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK);
        tm_tensor *tx = tt_from(ctx, TM_F32, 1, &n, x), *y;
        TT_OK(ctx, tm_sum_all(ctx, tx, &y));
        TT_OK(ctx, tm_tensor_read(ctx, y, TM_F64, &got[t], 1));
        tm_ctx_free(ctx);
    }
    cr_assert(fabs(got[0] - want) <= 1e-6 * fabs(want) + 1e-5, "got %.9g want %.9g", got[0], want);
    cr_assert_eq(got[0], got[1]);
    cr_assert_eq(got[0], got[2]);
    free(x);
}

typedef struct rcase {
    int mean, axis, keep;
} rcase;

static tm_status axis_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    const rcase *r = user;
    return r->mean ? tm_mean(ctx, in[0], r->axis, r->keep, out) : tm_sum(ctx, in[0], r->axis, r->keep, out);
}

static double axis_gradcase(tm_ctx *ctx, const rcase *r, uint64_t seed) {
    int64_t s[3] = {3, 5, 7};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 3, s, seed)};
    int check[1] = {1};
    return tt_gradcheck(ctx, axis_fn, (void *)r, 1, in, check, 1e-6, 1e-8, 1e-6);
}

/* Canonical: a middle axis (outer and inner both > 1). */
double tt_gradcase_sum(tm_ctx *ctx) {
    static const rcase r = {0, 1, 0};
    return axis_gradcase(ctx, &r, 51);
}
double tt_gradcase_mean(tm_ctx *ctx) {
    static const rcase r = {1, -2, 1};
    return axis_gradcase(ctx, &r, 53);
}

static tm_status all_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return *(const int *)user ? tm_mean_all(ctx, in[0], out) : tm_sum_all(ctx, in[0], out);
}

static double all_gradcase(tm_ctx *ctx, int mean, uint64_t seed) {
    int64_t s[3] = {3, 5, 7};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 3, s, seed)};
    int check[1] = {1};
    return tt_gradcheck(ctx, all_fn, &mean, 1, in, check, 1e-6, 1e-8, 1e-6);
}

double tt_gradcase_sum_all(tm_ctx *ctx) { return all_gradcase(ctx, 0, 55); }
double tt_gradcase_mean_all(tm_ctx *ctx) { return all_gradcase(ctx, 1, 57); }

#define GRADTEST(op)                                          \
    Test(reduce, gradcheck_##op) {                            \
        tm_ctx *ctx = tt_ctx();                               \
        double r = tt_gradcase_##op(ctx);                     \
        cr_assert_leq(r, 1.0, #op " gradcheck ratio %g", r);  \
        tm_ctx_free(ctx);                                     \
    }
GRADTEST(sum)
GRADTEST(mean)
GRADTEST(sum_all)
GRADTEST(mean_all)

Test(reduce, gradcheck_every_axis) {
    for (int mean = 0; mean < 2; mean++)
        for (int axis = 0; axis < 3; axis++)
            for (int keep = 0; keep < 2; keep++) {
                tm_ctx *ctx = tt_ctx();
                rcase r = {mean, axis, keep};
                double q = axis_gradcase(ctx, &r, 60 + axis);
                cr_assert_leq(q, 1.0, "mean=%d axis=%d keep=%d: gradcheck ratio %g", mean, axis, keep, q);
                tm_ctx_free(ctx);
            }
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *op, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, op), "message lacks the op name %s: %s", op, msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

Test(reduce, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {3, 5};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, s, 1), *xi = tt_randint(ctx, TM_I32, 2, s, 2, 5), *out = NULL;
    tm_tensor *x0 = tt_randn(ctx, TM_F32, 0, s, 3);
    assert_err(ctx, tm_sum(ctx, x, 2, 0, &out), TM_ERR_INVALID_ARG, "sum", "axis 2", "f32[3,5]");
    assert_err(ctx, tm_mean(ctx, x, -3, 1, &out), TM_ERR_INVALID_ARG, "mean", "axis -3", "f32[3,5]");
    assert_err(ctx, tm_sum(ctx, x0, 0, 0, &out), TM_ERR_INVALID_ARG, "sum", "axis 0", "f32[]");
    assert_err(ctx, tm_sum(ctx, xi, 0, 0, &out), TM_ERR_DTYPE, "sum", "i32[3,5]", NULL);
    assert_err(ctx, tm_mean(ctx, xi, 0, 0, &out), TM_ERR_DTYPE, "mean", "i32[3,5]", NULL);
    assert_err(ctx, tm_sum_all(ctx, xi, &out), TM_ERR_DTYPE, "sum_all", "i32[3,5]", NULL);
    assert_err(ctx, tm_mean_all(ctx, xi, &out), TM_ERR_DTYPE, "mean_all", "i32[3,5]", NULL);
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}
