/* test_shape.c — views (reshape, transpose, permute, slice), concat, contiguous, cast,
 * to_device: forward against index arithmetic, gradients against finite differences. */
#include <stdlib.h>
#include <string.h>

#include "common.h"

static tm_status view_case(tm_ctx *ctx, tm_tensor **in, void *u, tm_tensor **out) {
    /* (2,3,5) -permute(2,0,1)-> (5,2,3) -slice axis0 [1,4)-> (3,2,3) -reshape-> (6,3) (copy) */
    int perm[3] = {2, 0, 1};
    tm_tensor *a, *b;
    tm_status s = tm_permute(ctx, in[0], perm, &a);
    if (s == TM_OK) s = tm_slice(ctx, a, 0, 1, 4, &b);
    int64_t shape[2] = {6, -1};
    if (s == TM_OK) s = tm_reshape(ctx, b, 2, shape, out);
    return s;
}

double tt_gradcase_view(tm_ctx *ctx) {
    int64_t s[3] = {2, 3, 5};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 3, s, 11)};
    int chk[1] = {1};
    return tt_gradcheck(ctx, view_case, NULL, 1, in, chk, 1e-6, 1e-8, 1e-6);
}
Test(shape, view_gradcheck) {
    tm_ctx *ctx = tt_ctx();
    cr_assert_leq(tt_gradcase_view(ctx), 1.0);
    tm_ctx_free(ctx);
}

Test(shape, views_share_storage_and_index_correctly) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[3] = {2, 3, 4};
    double v[24];
    for (int i = 0; i < 24; i++) v[i] = i;
    tm_tensor *x = tt_from(ctx, TM_F32, 3, s, v), *t, *sl, *c;
    TT_OK(ctx, tm_transpose(ctx, x, 0, 2, &t)); /* (4,3,2): t[i][j][k] = x[k][j][i] */
    cr_assert_eq(tm_tensor_is_contiguous(t), 0);
    cr_assert_eq(tm_tensor_dim(t, 0), 4);
    double want[24];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++)
            for (int k = 0; k < 2; k++) want[(i * 3 + j) * 2 + k] = v[(k * 3 + j) * 4 + i];
    tt_assert_close_host(ctx, t, want, 0, 0);
    TT_OK(ctx, tm_slice(ctx, t, 1, -2, 3, &sl)); /* (4,2,2), j in {1,2} */
    double w2[16];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 2; j++)
            for (int k = 0; k < 2; k++) w2[(i * 2 + j) * 2 + k] = v[(k * 3 + j + 1) * 4 + i];
    tt_assert_close_host(ctx, sl, w2, 0, 0);
    TT_OK(ctx, tm_contiguous(ctx, sl, &c));
    cr_assert(tm_tensor_is_contiguous(c));
    tt_assert_close_host(ctx, c, w2, 0, 0);
    tm_tensor *same;
    TT_OK(ctx, tm_contiguous(ctx, x, &same));
    cr_assert_eq(same, x, "contiguous of a dense tensor is itself");
    tm_ctx_free(ctx);
}

Test(shape, reshape_errors) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {4, 6};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, s, 1), *y = NULL;
    int64_t bad[2] = {5, -1}, two[2] = {-1, -1}, ok[3] = {2, -1, 3};
    cr_assert_eq(tm_reshape(ctx, x, 2, bad, &y), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "reshape") && strstr(tm_ctx_errmsg(ctx), "f32[4,6]@cpu"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_reshape(ctx, x, 2, two, &y), TM_ERR_SHAPE);
    cr_assert_null(y);
    TT_OK(ctx, tm_reshape(ctx, x, 3, ok, &y));
    cr_assert_eq(tm_tensor_dim(y, 1), 4);
    int perm[2] = {0, 0};
    cr_assert_eq(tm_permute(ctx, x, perm, &y), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "permutation"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_slice(ctx, x, 1, 2, 7, &y), TM_ERR_INDEX);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "[2, 7)"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_transpose(ctx, x, 0, 2, &y), TM_ERR_INVALID_ARG);
    tm_ctx_free(ctx);
}

static tm_status concat_case(tm_ctx *ctx, tm_tensor **in, void *u, tm_tensor **out) {
    tm_tensor *t;
    tm_status s = tm_transpose(ctx, in[1], 0, 1, &t); /* a strided input */
    tm_tensor *xs[3] = {in[0], t, in[2]};
    return s ? s : tm_concat(ctx, 3, xs, 1, out);
}

double tt_gradcase_concat(tm_ctx *ctx) {
    int64_t a[2] = {3, 2}, b[2] = {5, 3}, c[2] = {3, 1};
    tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 2, a, 1), tt_randn(ctx, TM_F64, 2, b, 2), tt_randn(ctx, TM_F64, 2, c, 3)};
    int chk[3] = {1, 1, 1};
    return tt_gradcheck(ctx, concat_case, NULL, 3, in, chk, 1e-6, 1e-8, 1e-6);
}
Test(shape, concat_gradcheck) {
    tm_ctx *ctx = tt_ctx();
    cr_assert_leq(tt_gradcase_concat(ctx), 1.0);
    tm_ctx_free(ctx);
}

Test(shape, concat_forward_and_errors) {
    tm_ctx *ctx = tt_ctx();
    int64_t a[2] = {2, 1}, b[2] = {2, 2};
    double va[2] = {1, 2}, vb[4] = {3, 4, 5, 6};
    tm_tensor *xs[2] = {tt_from(ctx, TM_BF16, 2, a, va), tt_from(ctx, TM_BF16, 2, b, vb)}, *y;
    TT_OK(ctx, tm_concat(ctx, 2, xs, -1, &y));
    double want[6] = {1, 3, 4, 2, 5, 6};
    tt_assert_close_host(ctx, y, want, 0, 0);
    TT_OK(ctx, tm_concat(ctx, 1, xs, 0, &y));
    xs[1] = tt_from(ctx, TM_F32, 2, b, vb);
    cr_assert_eq(tm_concat(ctx, 2, xs, 1, &y), TM_ERR_DTYPE);
    int64_t c[2] = {3, 2};
    xs[1] = tt_randn(ctx, TM_BF16, 2, c, 1);
    cr_assert_eq(tm_concat(ctx, 2, xs, 1, &y), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "concat") && strstr(tm_ctx_errmsg(ctx), "[3,2]"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_concat(ctx, 0, xs, 1, &y), TM_ERR_INVALID_ARG);
    tm_ctx_free(ctx);
}

static tm_status contiguous_case(tm_ctx *ctx, tm_tensor **in, void *u, tm_tensor **out) {
    tm_tensor *t;
    tm_status s = tm_transpose(ctx, in[0], 0, 2, &t);
    return s ? s : tm_contiguous(ctx, t, out);
}
double tt_gradcase_contiguous(tm_ctx *ctx) {
    int64_t s[3] = {3, 2, 5};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 3, s, 4)};
    int chk[1] = {1};
    return tt_gradcheck(ctx, contiguous_case, NULL, 1, in, chk, 1e-6, 1e-8, 1e-6);
}
Test(shape, contiguous_gradcheck) {
    tm_ctx *ctx = tt_ctx();
    cr_assert_leq(tt_gradcase_contiguous(ctx), 1.0);
    tm_ctx_free(ctx);
}

/* f64 -> f32 -> f64: the op is linear, so a large step keeps f32 rounding out of the
 * difference quotient (error ~ 1e-7 |x| / eps). */
static tm_status cast_case(tm_ctx *ctx, tm_tensor **in, void *u, tm_tensor **out) {
    tm_tensor *t;
    tm_status s = tm_cast(ctx, in[0], TM_F32, &t);
    return s ? s : tm_cast(ctx, t, TM_F64, out);
}
double tt_gradcase_cast(tm_ctx *ctx) {
    int64_t s[2] = {3, 7};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 2, s, 5)};
    int chk[1] = {1};
    return tt_gradcheck(ctx, cast_case, NULL, 1, in, chk, 1e-2, 1e-4, 1e-4);
}
Test(shape, cast_gradcheck) {
    tm_ctx *ctx = tt_ctx();
    cr_assert_leq(tt_gradcase_cast(ctx), 1.0);
    tm_ctx_free(ctx);
}

Test(shape, cast_rounds_and_truncates) {
    tm_ctx *ctx = tt_ctx();
    int64_t n = 4;
    double v[4] = {1.0 + 1.0 / 256, -3.75, 2.5, 1e10};
    tm_tensor *x = tt_from(ctx, TM_F64, 1, &n, v), *b, *i;
    TT_OK(ctx, tm_cast(ctx, x, TM_BF16, &b));
    double wb[4] = {1.0, -3.75, 2.5, 9999220736.0};
    tt_assert_close_host(ctx, b, wb, 0, 0);
    TT_OK(ctx, tm_cast(ctx, b, TM_I64, &i));
    double wi[4] = {1, -3, 2, 9999220736.0};
    tt_assert_close_host(ctx, i, wi, 0, 0);
    cr_assert_eq(tm_cast(ctx, x, (tm_dtype)9, &i), TM_ERR_DTYPE);
    tm_ctx_free(ctx);
}

Test(shape, to_device_cpu_roundtrip) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {2, 3};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, s, 9), *y;
    TT_OK(ctx, tm_to_device(ctx, x, tm_cpu(), &y));
    tt_assert_close(ctx, y, x, 0, 0);
    cr_assert_eq(tm_to_device(ctx, x, tm_cuda(0), &y), TM_ERR_DEVICE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "cuda:0"), "%s", tm_ctx_errmsg(ctx));
    tm_ctx_free(ctx);
}

/* A reshape of an op's output hands its gradient over to that output (autograd.c,
 * tm__view_grad_adopt) when nothing else has written the output's gradient yet; the other
 * readers of the same output, before and after the reshape on the tape, still add theirs. */
static tm_status adopt_case(tm_ctx *ctx, tm_tensor **in, void *u, tm_tensor **out) {
    int after = *(int *)u;
    tm_tensor *a, *p = NULL, *r, *q, *q2, *t, *r2;
    int64_t s26[2] = {2, 6}, s34[2] = {3, 4}, s12[1] = {12};
    tm_status s = tm_mul(ctx, in[0], in[0], &a); /* (3,4): an op's output */
    if (s == TM_OK && !after) s = tm_mul(ctx, a, in[1], &p); /* a reader before the reshape */
    if (s == TM_OK) s = tm_reshape(ctx, a, 2, s26, &r);
    if (s == TM_OK) s = tm_reshape(ctx, r, 1, s12, &r2); /* a reshape of a reshape: handed over twice */
    if (s == TM_OK) s = tm_reshape(ctx, r2, 2, s34, &t);
    if (s == TM_OK) s = tm_mul(ctx, t, in[2], &q);
    if (s == TM_OK && after) s = tm_mul(ctx, a, in[1], &p); /* a reader after it */
    if (s == TM_OK) s = tm_add(ctx, p, q, &q2);
    if (s == TM_OK) *out = q2;
    return s;
}

Test(shape, reshape_gradient_handed_over_gradcheck) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {3, 4};
    for (int after = 0; after < 2; after++) {
        tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 2, s, 21), tt_randn(ctx, TM_F64, 2, s, 22), tt_randn(ctx, TM_F64, 2, s, 23)};
        int chk[3] = {1, 1, 1};
        cr_assert_leq(tt_gradcheck(ctx, adopt_case, &after, 3, in, chk, 1e-6, 1e-8, 1e-6), 1.0, "reader %s the reshape",
                      after ? "after" : "before");
    }
    tm_ctx_free(ctx);
}
