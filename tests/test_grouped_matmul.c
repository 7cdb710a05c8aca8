/*
 * test_grouped_matmul.c — tm_grouped_matmul: forward against a naive loop (f64, f32, bf16) with
 * empty groups first, in the middle and last and a one-row group; backward against the closed
 * form (an empty group's dw stays exactly 0); finite differences; bad counts.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* y[r] = x[r] @ w[g(r)] with the groups laid out by counts. */
static void gmm_ref(double *y, const double *x, const double *w, const int64_t *counts, int64_t G, int64_t K,
                    int64_t N) {
    int64_t r = 0;
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < counts[g]; i++, r++)
            for (int64_t n = 0; n < N; n++) {
                double acc = 0;
                for (int64_t k = 0; k < K; k++) acc += x[r * K + k] * w[(g * K + k) * N + n];
                y[r * N + n] = acc;
            }
}

/* dx, dw of sum(y * dy), written out independently of the kernel. */
static void gmm_grad_ref(double *dx, double *dw, const double *x, const double *w, const double *dy,
                         const int64_t *counts, int64_t G, int64_t K, int64_t N) {
    int64_t R = 0;
    for (int64_t g = 0; g < G; g++) R += counts[g];
    memset(dx, 0, sizeof(double) * R * K);
    memset(dw, 0, sizeof(double) * G * K * N);
    int64_t r = 0;
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < counts[g]; i++, r++)
            for (int64_t k = 0; k < K; k++)
                for (int64_t n = 0; n < N; n++) {
                    dx[r * K + k] += dy[r * N + n] * w[(g * K + k) * N + n];
                    dw[(g * K + k) * N + n] += x[r * K + k] * dy[r * N + n];
                }
}

static tm_tensor *counts_tensor(tm_ctx *ctx, tm_dtype dt, int64_t G, const int64_t *counts) {
    double v[64];
    for (int64_t g = 0; g < G; g++) v[g] = (double)counts[g];
    return tt_from(ctx, dt, 1, &G, v);
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, "grouped_matmul"), "message lacks the op name: %s", msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

/* Empty groups first (0), in the middle (2, 5) and last (7); group 3 has one row. */
static const int64_t COUNTS[8] = {0, 4, 0, 1, 6, 0, 3, 0};
enum { G8 = 8, R14 = 14 };

static void check_forward(tm_dtype dt, int64_t K, int64_t N, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {R14, K}, ws[3] = {G8, K, N};
    tm_tensor *x = tt_randn(ctx, dt, 2, xs, 1), *w = tt_randn(ctx, dt, 3, ws, 2), *y;
    tm_tensor *cnt = counts_tensor(ctx, TM_I64, G8, COUNTS);
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, cnt, &y));
    cr_assert_eq(tm_tensor_dtype(y), dt);
    cr_assert_eq(tm_tensor_ndim(y), 2);
    cr_assert_eq(tm_tensor_dim(y, 0), R14);
    cr_assert_eq(tm_tensor_dim(y, 1), N);
    double *hx = tt_read(ctx, x), *hw = tt_read(ctx, w), *ref = malloc(sizeof(double) * R14 * N);
    gmm_ref(ref, hx, hw, COUNTS, G8, K, N); /* from the stored (possibly rounded) inputs */
    tt_assert_close_host(ctx, y, ref, atol, rtol);
    free(hx), free(hw), free(ref);
    tm_ctx_free(ctx);
}

Test(grouped_matmul, forward_f64) { check_forward(TM_F64, 7, 5, 1e-13, 1e-12); }
/* f32: K = 37 products summed in f32 by BLAS; relative error ~ K * 2^-24. */
Test(grouped_matmul, forward_f32) { check_forward(TM_F32, 37, 11, 1e-5, 1e-5); }
/* bf16: computed in f32, the output's bf16 rounding (<= 2^-9 relative) dominates. */
Test(grouped_matmul, forward_bf16) { check_forward(TM_BF16, 13, 6, 2e-2, 8e-3); }

Test(grouped_matmul, single_group_is_matmul) {
    /* One group holding every row is a plain matmul. */
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {9, 6}, ws[3] = {1, 6, 4}, w2[2] = {6, 4}, one = 9;
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, xs, 3), *w = tt_randn(ctx, TM_F64, 3, ws, 4), *y, *ref, *wv;
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, counts_tensor(ctx, TM_I64, 1, &one), &y));
    TT_OK(ctx, tm_reshape(ctx, w, 2, w2, &wv));
    TT_OK(ctx, tm_matmul(ctx, x, wv, 0, 0, &ref));
    tt_assert_close(ctx, y, ref, 1e-14, 1e-13);
    tm_ctx_free(ctx);
}

Test(grouped_matmul, all_groups_empty) {
    /* R = 0: nothing to compute, out [0,N]; the backward leaves dw exactly zero. */
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {0, 3}, ws[3] = {3, 3, 2}, zero[3] = {0, 0, 0}, ys[2] = {0, 2};
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, xs, 5), *w = tt_randn(ctx, TM_F64, 3, ws, 6), *y;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, counts_tensor(ctx, TM_I64, 3, zero), &y));
    cr_assert_eq(tm_tensor_dim(y, 0), 0);
    cr_assert_eq(tm_tensor_dim(y, 1), 2);
    TT_OK(ctx, tm_backward_with_grad(ctx, y, tt_randn(ctx, TM_F64, 2, ys, 7)));
    double *dw = tt_read(ctx, tm_tensor_grad(w));
    for (int i = 0; i < 18; i++) cr_assert_eq(dw[i], 0.0);
    free(dw);
    tm_ctx_free(ctx);
}

static void check_backward(tm_dtype dt, int64_t K, int64_t N, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {R14, K}, ws[3] = {G8, K, N}, ys[2] = {R14, N};
    tm_tensor *x = tt_randn(ctx, dt, 2, xs, 11), *w = tt_randn(ctx, dt, 3, ws, 12), *y;
    tm_tensor *dy = tt_randn(ctx, dt, 2, ys, 13);
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, counts_tensor(ctx, TM_I64, G8, COUNTS), &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, dy));
    double *hx = tt_read(ctx, x), *hw = tt_read(ctx, w), *hdy = tt_read(ctx, dy);
    double *rdx = malloc(sizeof(double) * R14 * K), *rdw = malloc(sizeof(double) * G8 * K * N);
    gmm_grad_ref(rdx, rdw, hx, hw, hdy, COUNTS, G8, K, N);
    tt_assert_close_host(ctx, tm_tensor_grad(x), rdx, atol, rtol);
    tt_assert_close_host(ctx, tm_tensor_grad(w), rdw, atol, rtol);
    /* The empty groups' dw is exactly zero: no GEMM touches it. */
    double *dw = tt_read(ctx, tm_tensor_grad(w));
    for (int64_t g = 0; g < G8; g++) {
        if (COUNTS[g]) continue;
        for (int64_t i = 0; i < K * N; i++)
            cr_assert_eq(dw[g * K * N + i], 0.0, "dw[%lld] of empty group %lld is %g", (long long)i, (long long)g,
                         dw[g * K * N + i]);
    }
    free(dw), free(hx), free(hw), free(hdy), free(rdx), free(rdw);
    tm_ctx_free(ctx);
}

Test(grouped_matmul, backward_f64) { check_backward(TM_F64, 7, 5, 1e-13, 1e-12); }
Test(grouped_matmul, backward_f32) { check_backward(TM_F32, 37, 11, 1e-5, 1e-5); }

Test(grouped_matmul, backward_accumulates_into_param_grad) {
    /* Two calls on one weight parameter: its gradient is the sum of both backward passes, and
     * the group that is empty in both calls stays zero. */
    tm_ctx *ctx = tt_ctx();
    int64_t ws[3] = {3, 4, 5}, xs[2] = {6, 4}, ys[2] = {6, 5};
    int64_t c1[3] = {2, 4, 0}, c2[3] = {5, 1, 0};
    tm_tensor *w, *y1, *y2, *s, *g;
    TT_OK(ctx, tm_param_new(ctx, "experts.w", TM_F64, 3, ws, tm_cpu(), &w));
    TT_OK(ctx, tm_tensor_init_normal(ctx, w, 7, NULL, 0.0, 1.0));
    tm_tensor *x1 = tt_randn(ctx, TM_F64, 2, xs, 21), *x2 = tt_randn(ctx, TM_F64, 2, xs, 22);
    tm_tensor *g1 = tt_randn(ctx, TM_F64, 2, ys, 23), *g2 = tt_randn(ctx, TM_F64, 2, ys, 24);
    TT_OK(ctx, tm_grouped_matmul(ctx, x1, w, counts_tensor(ctx, TM_I64, 3, c1), &y1));
    TT_OK(ctx, tm_grouped_matmul(ctx, x2, w, counts_tensor(ctx, TM_I64, 3, c2), &y2));
    /* L = sum(y1 * g1) + sum(y2 * g2) */
    TT_OK(ctx, tm_mul(ctx, y1, g1, &s));
    TT_OK(ctx, tm_mul(ctx, y2, g2, &g));
    TT_OK(ctx, tm_add(ctx, s, g, &s));
    TT_OK(ctx, tm_sum_all(ctx, s, &s));
    TT_OK(ctx, tm_backward(ctx, s));
    double *hw = tt_read(ctx, w), *hx1 = tt_read(ctx, x1), *hx2 = tt_read(ctx, x2);
    double *hg1 = tt_read(ctx, g1), *hg2 = tt_read(ctx, g2);
    double dx[24], dw1[60], dw2[60], want[60];
    gmm_grad_ref(dx, dw1, hx1, hw, hg1, c1, 3, 4, 5);
    gmm_grad_ref(dx, dw2, hx2, hw, hg2, c2, 3, 4, 5);
    for (int i = 0; i < 60; i++) want[i] = dw1[i] + dw2[i];
    tt_assert_close_host(ctx, tm_tensor_grad(w), want, 1e-13, 1e-12);
    double *dw = tt_read(ctx, tm_tensor_grad(w));
    for (int i = 40; i < 60; i++) cr_assert_eq(dw[i], 0.0);
    free(dw), free(hw), free(hx1), free(hx2), free(hg1), free(hg2);
    tm_ctx_free(ctx);
}

static tm_status gmm_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_grouped_matmul(ctx, in[0], in[1], in[2], out);
}

double tt_gradcase_grouped_matmul(tm_ctx *ctx);
double tt_gradcase_grouped_matmul(tm_ctx *ctx) {
    /* 4 groups of {3, 0, 5, 1} rows: an empty group in the middle, a one-row group last. */
    int64_t counts[4] = {3, 0, 5, 1};
    int64_t xs[2] = {9, 5}, ws[3] = {4, 5, 3};
    tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 2, xs, 31), tt_randn(ctx, TM_F64, 3, ws, 32),
                        counts_tensor(ctx, TM_I64, 4, counts)};
    int check[3] = {1, 1, 0};
    return tt_gradcheck(ctx, gmm_fn, NULL, 3, in, check, 1e-6, 1e-7, 1e-6);
}

Test(grouped_matmul, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_grouped_matmul(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(grouped_matmul, bad_counts) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {6, 4}, ws[3] = {3, 4, 5};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *w = tt_randn(ctx, TM_F32, 3, ws, 2), *out = NULL;
    int64_t short_sum[3] = {2, 1, 2}, long_sum[3] = {2, 4, 3}, neg[3] = {4, -2, 4}, two[2] = {3, 3};
    int64_t ok[3] = {1, 2, 3}, c2d_shape[2] = {1, 3};

    assert_err(ctx, tm_grouped_matmul(ctx, x, w, counts_tensor(ctx, TM_I64, 3, short_sum), &out), TM_ERR_SHAPE,
               "counts sum to 5", "6 rows");
    assert_err(ctx, tm_grouped_matmul(ctx, x, w, counts_tensor(ctx, TM_I64, 3, long_sum), &out), TM_ERR_SHAPE,
               "group 2", "counts[2] = 3");
    assert_err(ctx, tm_grouped_matmul(ctx, x, w, counts_tensor(ctx, TM_I64, 3, neg), &out), TM_ERR_INVALID_ARG,
               "counts[1] = -2", "negative");
    assert_err(ctx, tm_grouped_matmul(ctx, x, w, counts_tensor(ctx, TM_I64, 2, two), &out), TM_ERR_SHAPE,
               "i64[2]", "f32[3,4,5]");
    assert_err(ctx, tm_grouped_matmul(ctx, x, w, counts_tensor(ctx, TM_I32, 3, ok), &out), TM_ERR_DTYPE,
               "i32[3]", NULL);
    double okv[3] = {1, 2, 3};
    assert_err(ctx, tm_grouped_matmul(ctx, x, w, tt_from(ctx, TM_I64, 2, c2d_shape, okv), &out), TM_ERR_SHAPE,
               "i64[1,3]", NULL);
    cr_assert_null(out, "out was set by a failed call");
    /* The same counts, valid, go through. */
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, counts_tensor(ctx, TM_I64, 3, ok), &out));
    tm_ctx_free(ctx);
}

Test(grouped_matmul, bad_operands) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {6, 4}, ws[3] = {3, 4, 5}, wk[3] = {3, 7, 5}, w2[2] = {4, 5}, ok[3] = {1, 2, 3};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *cnt = counts_tensor(ctx, TM_I64, 3, ok), *out = NULL;
    tm_tensor *w64 = tt_randn(ctx, TM_F64, 3, ws, 2), *wbadk = tt_randn(ctx, TM_F32, 3, wk, 3);
    tm_tensor *wflat = tt_randn(ctx, TM_F32, 2, w2, 4), *xi = tt_randint(ctx, TM_I32, 2, xs, 5, 3);
    tm_tensor *w = tt_randn(ctx, TM_F32, 3, ws, 6), *x3 = tt_randn(ctx, TM_F32, 3, ws, 7);

    assert_err(ctx, tm_grouped_matmul(ctx, x, w64, cnt, &out), TM_ERR_DTYPE, "f64[3,4,5]", "f32[6,4]");
    assert_err(ctx, tm_grouped_matmul(ctx, x, wbadk, cnt, &out), TM_ERR_SHAPE, "f32[3,7,5]", "f32[6,4]");
    assert_err(ctx, tm_grouped_matmul(ctx, x, wflat, cnt, &out), TM_ERR_SHAPE, "f32[4,5]", NULL);
    assert_err(ctx, tm_grouped_matmul(ctx, xi, w, cnt, &out), TM_ERR_DTYPE, "i32[6,4]", NULL);
    assert_err(ctx, tm_grouped_matmul(ctx, x3, w, cnt, &out), TM_ERR_SHAPE, "f32[3,4,5]", NULL);
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}
