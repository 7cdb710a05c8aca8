/*
 * test_moe_chunks.c — tm_moe_sort_chunks on the CPU: the regrouping against the chunk grid
 * transposed by hand (f64, f32, bf16 bit-exact), empty chunks and the one-group and one-chunk-
 * per-group grids (identities), the inverse regrouping restoring x, finite-difference
 * gradients, and bad inputs naming the op, the argument and the shapes.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"

static tm_tensor *sizes_tensor(tm_ctx *ctx, int64_t n, const int64_t *v) {
    double d[64];
    for (int64_t i = 0; i < n; i++) d[i] = (double)v[i];
    return tt_from(ctx, TM_I64, 1, &n, d);
}

/* want[rows of y] by walking the [K, G] grid and copying chunk (g, k) of x row by row. */
static void reference(const double *x, const int64_t *sz, int64_t G, int64_t K, int64_t H, double *want) {
    int64_t d = 0;
    for (int64_t k = 0; k < K; k++)
        for (int64_t g = 0; g < G; g++) {
            int64_t s = 0;
            for (int64_t i = 0; i < g * K + k; i++) s += sz[i];
            for (int64_t r = 0; r < sz[g * K + k]; r++, d++) memcpy(want + d * H, x + (s + r) * H, sizeof(double) * (size_t)H);
        }
}

typedef struct {
    int64_t G;
} chunk_arg;

static tm_status sort_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_moe_sort_chunks(ctx, in[0], in[1], ((chunk_arg *)user)->G, out);
}

/* 2 source ranks x 3 local experts with empty chunks, 3 columns. */
double tt_gradcase_moe_sort_chunks(tm_ctx *ctx) {
    static const int64_t sz[6] = {2, 0, 3, 1, 4, 0};
    static chunk_arg arg = {2};
    int64_t xs[2] = {10, 3};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 2, xs, 41), sizes_tensor(ctx, 6, sz)};
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, sort_fn, &arg, 2, in, check, 1e-6, 1e-8, 1e-6);
}
Test(moe_chunks, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_sort_chunks(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(moe_chunks, forward_is_the_grid_transposed) {
    struct {
        int64_t G, K, H;
        int64_t sz[12];
    } cases[] = {
        {2, 3, 5, {2, 0, 3, 1, 4, 0}},             /* empty chunks in both groups */
        {4, 3, 3, {1, 2, 0, 0, 0, 0, 3, 1, 1, 2, 2, 2}}, /* an empty group */
        {1, 4, 2, {3, 1, 0, 2}},                   /* one group: the identity */
        {3, 1, 4, {2, 5, 1}},                      /* one chunk per group: the identity */
    };
    const tm_dtype dts[3] = {TM_F64, TM_F32, TM_BF16};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int k = 0; k < 3; k++) {
            tm_ctx *ctx = tt_ctx();
            int64_t n = cases[c].G * cases[c].K, R = 0, H = cases[c].H;
            for (int64_t i = 0; i < n; i++) R += cases[c].sz[i];
            int64_t xs[2] = {R, H};
            tm_tensor *x = tt_randn(ctx, dts[k], 2, xs, 100 + c), *y;
            TT_OK(ctx, tm_moe_sort_chunks(ctx, x, sizes_tensor(ctx, n, cases[c].sz), cases[c].G, &y));
            cr_assert_eq(tm_tensor_dtype(y), dts[k]);
            double *vx = tt_read(ctx, x), *vy = tt_read(ctx, y), *want = malloc(sizeof(double) * (size_t)(R * H));
            reference(vx, cases[c].sz, cases[c].G, cases[c].K, H, want);
            for (int64_t i = 0; i < R * H; i++)
                cr_assert_eq(vy[i], want[i], "case %zu dtype %s element %lld: %g, want %g", c, tm_dtype_name(dts[k]),
                             (long long)i, vy[i], want[i]);
            if (cases[c].G == 1 || cases[c].K == 1)
                cr_assert(memcmp(vx, vy, sizeof(double) * (size_t)(R * H)) == 0, "case %zu is not the identity", c);
            free(vx), free(vy), free(want);
            tm_ctx_free(ctx);
        }
}

/* Sorting [G, K] to [K, G] and then, with the sizes in [K, G] order, [K, G] back to [G, K]
 * restores x; the backward of a regrouping is that inverse (dx = inverse(dy)). */
Test(moe_chunks, inverse_restores_and_is_the_backward) {
    tm_ctx *ctx = tt_ctx();
    const int64_t G = 3, K = 2, H = 4, sz[6] = {1, 3, 0, 2, 2, 1};
    int64_t szT[6], R = 9, xs[2] = {R, H};
    for (int64_t g = 0; g < G; g++)
        for (int64_t k = 0; k < K; k++) szT[k * G + g] = sz[g * K + k];
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 7), *gy = tt_randn(ctx, TM_F32, 2, xs, 8), *y, *back, *ginv;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_moe_sort_chunks(ctx, x, sizes_tensor(ctx, 6, sz), G, &y));
    TT_OK(ctx, tm_moe_sort_chunks(ctx, y, sizes_tensor(ctx, 6, szT), K, &back));
    tt_assert_close(ctx, back, x, 0, 0);
    TT_OK(ctx, tm_backward_with_grad(ctx, y, gy));
    TT_OK(ctx, tm_moe_sort_chunks(ctx, gy, sizes_tensor(ctx, 6, szT), K, &ginv));
    tt_assert_close(ctx, tm_tensor_grad(x), ginv, 0, 0);
    tm_ctx_free(ctx);
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, "moe_sort_chunks"), "message lacks the op name: %s", msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

Test(moe_chunks, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {6, 4}, x3[3] = {1, 6, 4}, n4 = 4;
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *out = NULL;
    const int64_t ok[4] = {1, 2, 0, 3}, neg[4] = {4, -1, 2, 1}, past[4] = {2, 2, 5, 0}, short_sum[4] = {1, 1, 1, 1};
    assert_err(ctx, tm_moe_sort_chunks(ctx, x, sizes_tensor(ctx, 4, neg), 2, &out), TM_ERR_SHAPE, "split_sizes[1] = -1",
               "negative");
    assert_err(ctx, tm_moe_sort_chunks(ctx, x, sizes_tensor(ctx, 4, past), 2, &out), TM_ERR_SHAPE, "split_sizes[2] = 5",
               "f32[6,4]");
    assert_err(ctx, tm_moe_sort_chunks(ctx, x, sizes_tensor(ctx, 4, short_sum), 2, &out), TM_ERR_SHAPE, "sum to 4",
               "6 rows");
    assert_err(ctx, tm_moe_sort_chunks(ctx, x, sizes_tensor(ctx, 4, ok), 3, &out), TM_ERR_INVALID_ARG,
               "num_groups = 3", "i64[4]");
    assert_err(ctx, tm_moe_sort_chunks(ctx, x, sizes_tensor(ctx, 4, ok), 0, &out), TM_ERR_INVALID_ARG, "num_groups = 0",
               NULL);
    assert_err(ctx, tm_moe_sort_chunks(ctx, x, tt_randint(ctx, TM_I32, 1, &n4, 2, 2), 2, &out), TM_ERR_DTYPE, "i32[4]",
               NULL);
    assert_err(ctx, tm_moe_sort_chunks(ctx, tt_randn(ctx, TM_F32, 3, x3, 3), sizes_tensor(ctx, 4, ok), 2, &out),
               TM_ERR_SHAPE, "f32[1,6,4]", NULL);
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}
