/*
 * test_elementwise.c — tm_add, tm_sub, tm_mul, tm_scale: forward against a naive loop with and
 * without broadcasting (either operand the smaller, 0-d scalars), in f64, f32 and bf16;
 * backward by finite differences (broadcast gradients are sums over the leading dims); the
 * broadcast reduction on a size that takes the chunked parallel path (bit-identical for 1, 2
 * and 3 threads); bad inputs.
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
