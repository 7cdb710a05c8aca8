/*
 * test_elementwise.c — tm_add, tm_sub, tm_mul, tm_scale: forward against a naive loop with and
 * without broadcasting (either operand the smaller, 0-d scalars), in f64, f32 and bf16;
 * backward by finite differences (broadcast gradients are sums over the leading dims); the
 * broadcast reduction on a size that takes the chunked parallel path (bit-identical for 1, 2
 * and 3 threads); bad inputs. tm_scale_rows: forward against the formula (bf16 rows with f32
 * weights rounded once), finite-difference gradients of both inputs (a zero weight included,
 * as the MoE padding rows have), gradients thread-count invariant, bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

enum { ADD, SUB, MUL };
static const char *names[3] = {"add", "sub", "mul"};

static tm_status binop(tm_ctx *ctx, int op, tm_tensor *a, tm_tensor *b, tm_tensor **out) {
    return op == ADD ? tm_add(ctx, a, b, out) : op == SUB ? tm_sub(ctx, a, b, out) : tm_mul(ctx, a, b, out);
}
static double apply(int op, double x, double y) { return op == ADD ? x + y : op == SUB ? x - y : x * y; }

typedef struct bcase {
    int and, bnd;
    int64_t as[4], bs[4];
} bcase;

/* Same shapes, b broadcast, a broadcast, scalars on either side, a [1,...] leading dim. */
static const bcase bcases[] = {
    {3, 3, {2, 3, 5}, {2, 3, 5}}, {3, 1, {2, 3, 5}, {5}},  {2, 4, {3, 5}, {2, 1, 3, 5}},
    {3, 0, {2, 3, 5}, {0}},       {0, 2, {0}, {3, 7}},     {2, 1, {1, 7}, {7}},
};
#define NB ((int)(sizeof bcases / sizeof bcases[0]))

static void check_forward(tm_dtype dt, double atol, double rtol) {
    for (int op = 0; op < 3; op++)
        for (int k = 0; k < NB; k++) {
            const bcase *bc = &bcases[k];
            tm_ctx *ctx = tt_ctx();
            tm_tensor *a = tt_randn(ctx, dt, bc->and, bc->as, 10 + k), *b = tt_randn(ctx, dt, bc->bnd, bc->bs, 20 + k), *y;
            TT_OK(ctx, binop(ctx, op, a, b, &y));
            const tm_tensor *big = bc->and >= bc->bnd ? a : b;
            cr_assert_eq(tm_tensor_ndim(y), tm_tensor_ndim(big), "%s case %d", names[op], k);
            for (int d = 0; d < tm_tensor_ndim(y); d++) cr_assert_eq(tm_tensor_dim(y, d), tm_tensor_dim(big, d));
            int64_t n = tm_tensor_numel(y), na = tm_tensor_numel(a), nb = tm_tensor_numel(b);
            double *ha = tt_read(ctx, a), *hb = tt_read(ctx, b), *ref = malloc(sizeof(double) * (size_t)n);
            for (int64_t i = 0; i < n; i++) ref[i] = apply(op, ha[i % na], hb[i % nb]);
            tt_assert_close_host(ctx, y, ref, atol, rtol);
            free(ha), free(hb), free(ref);
            tm_ctx_free(ctx);
        }
}

/* f64 / f32: one rounding of the exact result. bf16: computed in f32, rounded to bf16. */
Test(elementwise, forward_f64) { check_forward(TM_F64, 0, 1e-15); }
Test(elementwise, forward_f32) { check_forward(TM_F32, 1e-7, 1e-6); }
Test(elementwise, forward_bf16) { check_forward(TM_BF16, 1e-2, 4e-3); }

Test(elementwise, scale_forward) {
    tm_dtype dts[3] = {TM_F64, TM_F32, TM_BF16};
    double rt[3] = {1e-15, 1e-6, 4e-3};
    for (int d = 0; d < 3; d++) {
        tm_ctx *ctx = tt_ctx();
        int64_t s[2] = {3, 7};
        tm_tensor *x = tt_randn(ctx, dts[d], 2, s, 1), *y;
        TT_OK(ctx, tm_scale(ctx, x, -2.5, &y));
        cr_assert_eq(tm_tensor_dtype(y), dts[d]);
        double *hx = tt_read(ctx, x);
        for (int i = 0; i < 21; i++) hx[i] *= -2.5;
        tt_assert_close_host(ctx, y, hx, 0, rt[d]);
        free(hx);
        tm_ctx_free(ctx);
    }
}

/* A large broadcast [300, 70] op [70] (f32) hits the parallel paths of forward and backward. */
Test(elementwise, forward_large_broadcast) {
    tm_ctx *ctx = tt_ctx();
    int64_t as[2] = {300, 70}, bs[1] = {70};
    tm_tensor *a = tt_randn(ctx, TM_F32, 2, as, 1), *b = tt_randn(ctx, TM_F32, 1, bs, 2), *y;
    TT_OK(ctx, tm_mul(ctx, b, a, &y));
    double *ha = tt_read(ctx, a), *hb = tt_read(ctx, b), *ref = malloc(sizeof(double) * 300 * 70);
    for (int64_t i = 0; i < 300 * 70; i++) ref[i] = hb[i % 70] * ha[i];
    tt_assert_close_host(ctx, y, ref, 0, 1e-6);
    free(ha), free(hb), free(ref);
    tm_ctx_free(ctx);
}

typedef struct gcase {
    int op;
    const bcase *bc;
} gcase;

static tm_status bin_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return binop(ctx, ((const gcase *)user)->op, in[0], in[1], out);
}

static double bin_gradcase(tm_ctx *ctx, int op, const bcase *bc, uint64_t seed) {
    gcase g = {op, bc};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, bc->and, bc->as, seed), tt_randn(ctx, TM_F64, bc->bnd, bc->bs, seed + 1)};
    int check[2] = {1, 1};
    return tt_gradcheck(ctx, bin_fn, &g, 2, in, check, 1e-6, 1e-8, 1e-6);
}

/* Canonical cases: [2, 3, 5] (op) [5] (the bias pattern), then the small operand first. */
double tt_gradcase_add(tm_ctx *ctx) { return bin_gradcase(ctx, ADD, &bcases[1], 41); }
double tt_gradcase_sub(tm_ctx *ctx) { return bin_gradcase(ctx, SUB, &bcases[2], 43); }
double tt_gradcase_mul(tm_ctx *ctx) { return bin_gradcase(ctx, MUL, &bcases[1], 45); }

static tm_status scale_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_scale(ctx, in[0], -1.75, out);
}

double tt_gradcase_scale(tm_ctx *ctx) {
    int64_t s[3] = {2, 3, 5};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 3, s, 47)};
    int check[1] = {1};
    return tt_gradcheck(ctx, scale_fn, NULL, 1, in, check, 1e-6, 1e-8, 1e-6);
}

#define GRADTEST(op)                                          \
    Test(elementwise, gradcheck_##op) {                       \
        tm_ctx *ctx = tt_ctx();                               \
        double r = tt_gradcase_##op(ctx);                     \
        cr_assert_leq(r, 1.0, #op " gradcheck ratio %g", r);  \
        tm_ctx_free(ctx);                                     \
    }
GRADTEST(add)
GRADTEST(sub)
GRADTEST(mul)
GRADTEST(scale)

Test(elementwise, gradcheck_all_broadcasts) {
    for (int op = 0; op < 3; op++)
        for (int k = 0; k < NB; k++) {
            tm_ctx *ctx = tt_ctx();
            double r = bin_gradcase(ctx, op, &bcases[k], 100 + 10 * op + 2 * k);
            cr_assert_leq(r, 1.0, "%s case %d: gradcheck ratio %g", names[op], k, r);
            tm_ctx_free(ctx);
        }
}

/* d b of sum(mul(a, b) * g) for a [N, C], b [C], with nthreads threads (malloc'd). */
static double *bias_grad(int nthreads, tm_dtype dt, int64_t N, int64_t C, const double *a, const double *b,
                         const double *g) {
    tm_ctx *ctx = tt_ctx_threads(nthreads);
    int64_t as[2] = {N, C};
    tm_tensor *ta = tt_from(ctx, dt, 2, as, a), *tb = tt_from(ctx, dt, 1, &C, b), *tg = tt_from(ctx, dt, 2, as, g), *y;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, tb, 1));
    TT_OK(ctx, tm_mul(ctx, ta, tb, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, tg));
    double *r = tt_read(ctx, tm_tensor_grad(tb));
    tm_ctx_free(ctx);
    return r;
}

/* 1000 x 37: several fixed-size row chunks, reduced in chunk order. */
Test(elementwise, broadcast_grad_large_thread_invariant) {
    const int64_t N = 1000, C = 37;
    tm_ctx *ctx = tt_ctx();
    int64_t as[2] = {N, C};
    double *a = tt_read(ctx, tt_randn(ctx, TM_F32, 2, as, 1)), *g = tt_read(ctx, tt_randn(ctx, TM_F32, 2, as, 2));
    double *b = tt_read(ctx, tt_randn(ctx, TM_F32, 1, &C, 3));
    tm_ctx_free(ctx);
    double ref[37];
    for (int64_t j = 0; j < C; j++) {
        ref[j] = 0;
        for (int64_t i = 0; i < N; i++) ref[j] += a[i * C + j] * g[i * C + j];
    }
    double *d[3];
    for (int t = 0; t < 3; t++) d[t] = bias_grad(t + 1, TM_F32, N, C, a, b, g);
    /* f64 accumulation, one f32 rounding at the end */
    cr_assert_leq(tt_close_ratio(d[0], ref, C, 1e-6, 1e-6), 1.0);
    cr_assert(memcmp(d[0], d[1], sizeof(double) * C) == 0, "differs with 2 threads");
    cr_assert(memcmp(d[0], d[2], sizeof(double) * C) == 0, "differs with 3 threads");
    for (int t = 0; t < 3; t++) free(d[t]);
    free(a), free(g), free(b);
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *op, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, op), "message lacks the op name %s: %s", op, msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

Test(elementwise, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t s235[3] = {2, 3, 5}, s3[1] = {3}, s35[2] = {3, 5}, s15[2] = {1, 5};
    tm_tensor *a = tt_randn(ctx, TM_F32, 3, s235, 1), *b3 = tt_randn(ctx, TM_F32, 1, s3, 2), *out = NULL;
    tm_tensor *b35d = tt_randn(ctx, TM_F64, 2, s35, 3), *b15 = tt_randn(ctx, TM_F32, 2, s15, 4);
    tm_tensor *ai = tt_randint(ctx, TM_I64, 3, s235, 5, 4);
    for (int op = 0; op < 3; op++) {
        /* [3] is not the trailing dims of [2,3,5]; nor is [1,5] (no size-1 stretching) */
        assert_err(ctx, binop(ctx, op, a, b3, &out), TM_ERR_SHAPE, names[op], "f32[2,3,5]", "f32[3]");
        assert_err(ctx, binop(ctx, op, b15, a, &out), TM_ERR_SHAPE, names[op], "f32[1,5]", "f32[2,3,5]");
        assert_err(ctx, binop(ctx, op, a, b35d, &out), TM_ERR_DTYPE, names[op], "f64[3,5]", NULL);
        assert_err(ctx, binop(ctx, op, ai, a, &out), TM_ERR_DTYPE, names[op], "i64[2,3,5]", NULL);
    }
    assert_err(ctx, tm_scale(ctx, ai, 2.0, &out), TM_ERR_DTYPE, "scale", "i64[2,3,5]", NULL);
    assert_err(ctx, tm_scale(ctx, a, INFINITY, &out), TM_ERR_INVALID_ARG, "scale", "alpha", "inf");
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}

/* ---- scale_rows ------------------------------------------------------------------------------- */

static tm_status scale_rows_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_scale_rows(ctx, in[0], in[1], out);
}

/* 7 rows of 5, one weight 0 (a padding row) and one negative. */
double tt_gradcase_scale_rows(tm_ctx *ctx) {
    int64_t xs[2] = {7, 5}, ws = 7;
    const double w[7] = {0.7, -1.3, 0.0, 2.1, 0.25, 1.0, -0.6};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 2, xs, 61), tt_from(ctx, TM_F64, 1, &ws, w)};
    int check[2] = {1, 1};
    return tt_gradcheck(ctx, scale_rows_fn, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}
GRADTEST(scale_rows)

/* out[r, c] = x[r, c] w[r] for f64, f32 and bf16 rows, with weights of the rows' dtype and,
 * for bf16 rows, f32 weights: the product is taken in f32 and rounded to bf16 once. */
Test(elementwise, scale_rows_forward) {
    const tm_dtype xdt[4] = {TM_F64, TM_F32, TM_BF16, TM_BF16}, wdt[4] = {TM_F64, TM_F32, TM_BF16, TM_F32};
    for (int k = 0; k < 4; k++) {
        tm_ctx *ctx = tt_ctx();
        int64_t xs[2] = {6, 9}, R = 6;
        tm_tensor *x = tt_randn(ctx, xdt[k], 2, xs, 70 + k), *w = tt_randu(ctx, wdt[k], 1, &R, 80 + k, -2, 2), *y;
        TT_OK(ctx, tm_scale_rows(ctx, x, w, &y));
        cr_assert_eq(tm_tensor_dtype(y), xdt[k]);
        cr_assert_eq(tm_tensor_dim(y, 0), 6);
        cr_assert_eq(tm_tensor_dim(y, 1), 9);
        double *vx = tt_read(ctx, x), *vw = tt_read(ctx, w), want[54];
        for (int64_t r = 0; r < 6; r++)
            for (int64_t c = 0; c < 9; c++) want[r * 9 + c] = vx[r * 9 + c] * vw[r];
        if (xdt[k] == TM_BF16) {
            /* the exact product rounded once to bf16: tm_cast of an f64 tensor rounds to nearest even */
            tm_tensor *t = tt_from(ctx, TM_F64, 2, xs, want), *tb;
            TT_OK(ctx, tm_cast(ctx, t, TM_BF16, &tb));
            double *vb = tt_read(ctx, tb);
            double *vy = tt_read(ctx, y);
            for (int i = 0; i < 54; i++)
                cr_assert_eq(vy[i], vb[i], "case %d element %d: %.9g, want %.9g rounded to bf16: %.9g", k, i, vy[i],
                             want[i], vb[i]);
            free(vb), free(vy);
        } else {
            tt_assert_close_host(ctx, y, want, 0, xdt[k] == TM_F64 ? 0 : 1e-7);
        }
        free(vx), free(vw);
        tm_ctx_free(ctx);
    }
}

/* The gradients of bf16 rows with f32 weights (the MoE block's case) against f64 ones. */
Test(elementwise, scale_rows_backward_mixed_dtypes) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {5, 16}, R = 5;
    tm_tensor *x = tt_randn(ctx, TM_BF16, 2, xs, 90), *w = tt_randu(ctx, TM_F32, 1, &R, 91, -1, 1);
    tm_tensor *g = tt_randn(ctx, TM_BF16, 2, xs, 92), *y;
    double *vx = tt_read(ctx, x), *vw = tt_read(ctx, w), *vg = tt_read(ctx, g), dx[80], dw[5];
    for (int64_t r = 0; r < 5; r++) {
        dw[r] = 0;
        for (int64_t c = 0; c < 16; c++) dx[r * 16 + c] = vg[r * 16 + c] * vw[r], dw[r] += vx[r * 16 + c] * vg[r * 16 + c];
    }
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    TT_OK(ctx, tm_scale_rows(ctx, x, w, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, g));
    cr_assert_eq(tm_tensor_dtype(tm_tensor_grad(x)), TM_BF16);
    cr_assert_eq(tm_tensor_dtype(tm_tensor_grad(w)), TM_F32);
    tt_assert_close_host(ctx, tm_tensor_grad(x), dx, 1e-6, 1e-2);
    tt_assert_close_host(ctx, tm_tensor_grad(w), dw, 1e-5, 1e-6);
    free(vx), free(vw), free(vg);
    tm_ctx_free(ctx);
}

/* Rows are independent: 1, 2 and 3 threads give the same bits (a size past the parallel
 * threshold). */
Test(elementwise, scale_rows_thread_invariant) {
    double *d[3][2];
    for (int t = 0; t < 3; t++) {
        tm_ctx *ctx = tt_ctx_threads(t + 1);
        int64_t xs[2] = {700, 61}, R = 700;
        tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 93), *w = tt_randn(ctx, TM_F32, 1, &R, 94), *g = tt_randn(ctx, TM_F32, 2, xs, 95), *y;
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
        TT_OK(ctx, tm_scale_rows(ctx, x, w, &y));
        TT_OK(ctx, tm_backward_with_grad(ctx, y, g));
        d[t][0] = tt_read(ctx, tm_tensor_grad(x));
        d[t][1] = tt_read(ctx, tm_tensor_grad(w));
        tm_ctx_free(ctx);
    }
    for (int t = 1; t < 3; t++) {
        cr_assert(memcmp(d[0][0], d[t][0], sizeof(double) * 700 * 61) == 0, "dx differs with %d threads", t + 1);
        cr_assert(memcmp(d[0][1], d[t][1], sizeof(double) * 700) == 0, "dw differs with %d threads", t + 1);
    }
    for (int t = 0; t < 3; t++) free(d[t][0]), free(d[t][1]);
}

Test(elementwise, scale_rows_bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t s35[2] = {3, 5}, s3 = 3, s5 = 5, s235[3] = {2, 3, 5};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, s35, 1), *w = tt_randn(ctx, TM_F32, 1, &s3, 2), *out = NULL;
    assert_err(ctx, tm_scale_rows(ctx, x, tt_randn(ctx, TM_F32, 1, &s5, 3), &out), TM_ERR_SHAPE, "scale_rows", "f32[5]",
               "f32[3,5]");
    assert_err(ctx, tm_scale_rows(ctx, tt_randn(ctx, TM_F32, 3, s235, 4), w, &out), TM_ERR_SHAPE, "scale_rows",
               "f32[2,3,5]", NULL);
    assert_err(ctx, tm_scale_rows(ctx, x, tt_randn(ctx, TM_F64, 1, &s3, 5), &out), TM_ERR_DTYPE, "scale_rows", "f64[3]",
               NULL);
    assert_err(ctx, tm_scale_rows(ctx, x, tt_randint(ctx, TM_I64, 1, &s3, 6, 4), &out), TM_ERR_DTYPE, "scale_rows",
               "i64[3]", NULL);
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}
