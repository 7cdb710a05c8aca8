/*
 * test_indexing.c — tm_embedding, tm_index_select, tm_gather, tm_scatter_add: forward against
 * naive loops (f64, f32, bf16; i32 and i64 indices), gradients by finite differences with
 * repeated indices, scatter-adds bit-identical for 1, 2 and 3 threads, bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static tm_tensor *ids_from(tm_ctx *ctx, tm_dtype it, int ndim, const int64_t *shape, const int64_t *vals) {
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, it, ndim, shape, tm_cpu(), TM_I64, vals, &t));
    return t;
}

/* Bit-exact comparison (the ops below are pure copies); tt_assert_close_host's ratio with a
 * denormal-free, vanishing atol. */
static void assert_exact(tm_ctx *ctx, const tm_tensor *got, const double *want) {
    tt_assert_close_host(ctx, got, want, 1e-300, 0);
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *op, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, op), "message lacks the op name \"%s\": %s", op, msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

/* ---- embedding ---------------------------------------------------------------------------- */

static void check_embedding_forward(tm_dtype dt, tm_dtype it) {
    tm_ctx *ctx = tt_ctx();
    int64_t ws[2] = {7, 5}, is[2] = {2, 3}, ids[6] = {6, 0, 3, 3, 6, 1};
    tm_tensor *w = tt_randn(ctx, dt, 2, ws, 1), *out;
    TT_OK(ctx, tm_embedding(ctx, w, ids_from(ctx, it, 2, is, ids), &out));
    cr_assert_eq(tm_tensor_ndim(out), 3);
    cr_assert_eq(tm_tensor_dim(out, 0), 2);
    cr_assert_eq(tm_tensor_dim(out, 1), 3);
    cr_assert_eq(tm_tensor_dim(out, 2), 5);
    cr_assert_eq(tm_tensor_dtype(out), dt);
    double *hw = tt_read(ctx, w), want[30];
    for (int s = 0; s < 6; s++)
        for (int c = 0; c < 5; c++) want[s * 5 + c] = hw[ids[s] * 5 + c];
    assert_exact(ctx, out, want); /* a copy: exact in every dtype */
    free(hw);
    tm_ctx_free(ctx);
}

Test(embedding, forward_f64_i64) { check_embedding_forward(TM_F64, TM_I64); }
Test(embedding, forward_f32_i32) { check_embedding_forward(TM_F32, TM_I32); }
Test(embedding, forward_bf16_i64) { check_embedding_forward(TM_BF16, TM_I64); }

Test(embedding, scalar_id) {
    tm_ctx *ctx = tt_ctx();
    int64_t ws[2] = {4, 3}, id = 2;
    tm_tensor *w = tt_randn(ctx, TM_F32, 2, ws, 2), *out;
    TT_OK(ctx, tm_embedding(ctx, w, ids_from(ctx, TM_I32, 0, NULL, &id), &out));
    cr_assert_eq(tm_tensor_ndim(out), 1);
    cr_assert_eq(tm_tensor_dim(out, 0), 3);
    double *hw = tt_read(ctx, w);
    assert_exact(ctx, out, hw + 6);
    free(hw);
    tm_ctx_free(ctx);
}

static tm_status embedding_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_embedding(ctx, in[0], in[1], out);
}

double tt_gradcase_embedding(tm_ctx *ctx) {
    int64_t ws[2] = {7, 5}, is[2] = {2, 5}, ids[10] = {3, 0, 6, 3, 3, 1, 6, 0, 5, 3};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 2, ws, 61), ids_from(ctx, TM_I64, 2, is, ids)};
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, embedding_fn, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}

Test(embedding, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_embedding(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

/* d weight of sum(embedding(w, ids) * g) with nthreads threads: V x C, ids [M]. */
static double *embedding_dw(int nthreads, tm_dtype dt, int64_t V, int64_t C, int64_t M, const int64_t *ids,
                            const double *g) {
    tm_ctx *ctx = tt_ctx_threads(nthreads);
    int64_t ws[2] = {V, C}, gs[2] = {M, C};
    tm_tensor *w = tt_randn(ctx, dt, 2, ws, 1), *out;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    TT_OK(ctx, tm_embedding(ctx, w, ids_from(ctx, TM_I64, 1, &M, ids), &out));
    TT_OK(ctx, tm_backward_with_grad(ctx, out, tt_from(ctx, dt, 2, gs, g)));
    double *dw = tt_read(ctx, tm_tensor_grad(w));
    tm_ctx_free(ctx);
    return dw;
}

/* Many repeats of few rows, large enough for the OpenMP path; rows 0 and V-1 are never hit. */
static void check_embedding_backward_large(tm_dtype dt, double atol, double rtol) {
    const int64_t V = 50, C = 37, M = 3001;
    int64_t *ids = malloc(sizeof(int64_t) * M);
    for (int64_t m = 0; m < M; m++) ids[m] = 1 + (m * m + 7 * m) % (V - 2);
    tm_ctx *ctx = tt_ctx();
    int64_t gs[2] = {M, C};
    double *g = tt_read(ctx, tt_randn(ctx, dt, 2, gs, 62));
    tm_ctx_free(ctx);
    double *want = calloc((size_t)(V * C), sizeof(double));
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < C; c++) want[ids[m] * C + c] += g[m * C + c];
    double *dw[3];
    for (int t = 0; t < 3; t++) dw[t] = embedding_dw(t + 1, dt, V, C, M, ids, g);
    cr_assert_leq(tt_close_ratio(dw[1], want, V * C, atol, rtol), 1.0);
    for (int c = 0; c < C; c++) cr_assert(dw[1][c] == 0 && dw[1][(V - 1) * C + c] == 0);
    for (int t = 0; t < 3; t += 2)
        cr_assert(memcmp(dw[t], dw[1], sizeof(double) * V * C) == 0, "d weight differs with %d threads", t + 1);
    for (int t = 0; t < 3; t++) free(dw[t]);
    free(ids), free(g), free(want);
}

Test(embedding, backward_large_f64) { check_embedding_backward_large(TM_F64, 1e-12, 1e-12); }
/* f32: sums of ~60 terms accumulated in f64 and rounded once. */
Test(embedding, backward_large_f32) { check_embedding_backward_large(TM_F32, 1e-6, 1e-6); }

Test(embedding, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t ws[2] = {10, 4}, w3[3] = {2, 5, 4}, is[2] = {2, 3}, i4[4] = {1, 1, 2, 3};
    int64_t over[6] = {0, 1, 2, 3, 9, 10}, neg[6] = {0, -3, 2, 3, 4, -1}, ok[6] = {0, 1, 2, 3, 4, 5};
    tm_tensor *w = tt_randn(ctx, TM_F32, 2, ws, 1), *out = NULL;

    assert_err(ctx, tm_embedding(ctx, w, ids_from(ctx, TM_I64, 2, is, over), &out), TM_ERR_INDEX, "embedding",
               "ids[1,2] = 10", "[0, 10)");
    assert_err(ctx, tm_embedding(ctx, w, ids_from(ctx, TM_I32, 2, is, neg), &out), TM_ERR_INDEX, "embedding",
               "ids[0,1] = -3", "f32[10,4]");
    assert_err(ctx, tm_embedding(ctx, tt_randn(ctx, TM_BF16, 2, ws, 5), ids_from(ctx, TM_I64, 2, is, over), &out),
               TM_ERR_INDEX, "embedding", "ids[1,2] = 10", "bf16[10,4]");
    assert_err(ctx, tm_embedding(ctx, w, tt_randn(ctx, TM_F32, 2, is, 2), &out), TM_ERR_DTYPE, "embedding",
               "f32[2,3]", NULL);
    assert_err(ctx, tm_embedding(ctx, tt_randn(ctx, TM_F32, 3, w3, 3), ids_from(ctx, TM_I64, 2, is, ok), &out),
               TM_ERR_SHAPE, "embedding", "f32[2,5,4]", NULL);
    assert_err(ctx, tm_embedding(ctx, w, tt_randint(ctx, TM_I64, 4, i4, 4, 10), &out), TM_ERR_SHAPE, "embedding",
               "i64[1,1,2,3]", NULL);
    assert_err(ctx, tm_embedding(ctx, ids_from(ctx, TM_I64, 2, is, ok), ids_from(ctx, TM_I64, 2, is, ok), &out),
               TM_ERR_DTYPE, "embedding", "i64[2,3]", NULL);
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}

/* ---- index_select ------------------------------------------------------------------------- */

Test(index_select, forward) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {6, 5}, M = 9, idx[9] = {5, 0, 0, 2, 5, 1, 3, 3, 4};
    for (int it = 0; it < 2; it++) {
        tm_tensor *x = tt_randn(ctx, it ? TM_F32 : TM_F64, 2, xs, 71), *out;
        TT_OK(ctx, tm_index_select(ctx, x, ids_from(ctx, it ? TM_I32 : TM_I64, 1, &M, idx), &out));
        cr_assert_eq(tm_tensor_dim(out, 0), 9);
        cr_assert_eq(tm_tensor_dim(out, 1), 5);
        double *hx = tt_read(ctx, x), want[45];
        for (int m = 0; m < 9; m++)
            for (int c = 0; c < 5; c++) want[m * 5 + c] = hx[idx[m] * 5 + c];
        assert_exact(ctx, out, want);
        free(hx);
    }
    tm_ctx_free(ctx);
}

static tm_status index_select_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_index_select(ctx, in[0], in[1], out);
}

double tt_gradcase_index_select(tm_ctx *ctx) {
    int64_t xs[2] = {6, 5}, M = 9, idx[9] = {5, 0, 0, 2, 5, 1, 0, 3, 5};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 2, xs, 72), ids_from(ctx, TM_I32, 1, &M, idx)};
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, index_select_fn, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}

Test(index_select, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_index_select(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(index_select, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {7, 5}, M = 6, is2[2] = {2, 3}, bad[6] = {0, 1, 2, 3, -1, 7};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *out = NULL;
    assert_err(ctx, tm_index_select(ctx, x, ids_from(ctx, TM_I64, 1, &M, bad), &out), TM_ERR_INDEX,
               "index_select", "idx[4] = -1", "[0, 7)");
    assert_err(ctx, tm_index_select(ctx, x, tt_randint(ctx, TM_I64, 2, is2, 2, 7), &out), TM_ERR_SHAPE,
               "index_select", "i64[2,3]", NULL);
    assert_err(ctx, tm_index_select(ctx, x, tt_randn(ctx, TM_F64, 1, &M, 3), &out), TM_ERR_DTYPE,
               "index_select", "f64[6]", NULL);
    cr_assert_null(out);
    tm_ctx_free(ctx);
}

/* ---- gather ------------------------------------------------------------------------------- */

Test(gather, forward) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {4, 7}, is[2] = {4, 5};
    int64_t idx[20] = {6, 0, 6, 2, 3, 1, 1, 1, 5, 0, 0, 6, 4, 2, 2, 3, 5, 5, 0, 6};
    for (int it = 0; it < 2; it++) {
        tm_tensor *x = tt_randn(ctx, it ? TM_F32 : TM_F64, 2, xs, 81), *out;
        TT_OK(ctx, tm_gather(ctx, x, ids_from(ctx, it ? TM_I32 : TM_I64, 2, is, idx), &out));
        cr_assert_eq(tm_tensor_dim(out, 0), 4);
        cr_assert_eq(tm_tensor_dim(out, 1), 5);
        double *hx = tt_read(ctx, x), want[20];
        for (int n = 0; n < 4; n++)
            for (int k = 0; k < 5; k++) want[n * 5 + k] = hx[n * 7 + idx[n * 5 + k]];
        assert_exact(ctx, out, want);
        free(hx);
    }
    tm_ctx_free(ctx);
}

static tm_status gather_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_gather(ctx, in[0], in[1], out);
}

double tt_gradcase_gather(tm_ctx *ctx) {
    /* repeats within a row (6, 6; 1, 1, 1) and columns never gathered */
    int64_t xs[2] = {4, 7}, is[2] = {4, 5};
    int64_t idx[20] = {6, 0, 6, 2, 3, 1, 1, 1, 5, 0, 0, 6, 4, 2, 2, 3, 5, 5, 0, 6};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 2, xs, 82), ids_from(ctx, TM_I64, 2, is, idx)};
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, gather_fn, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}

Test(gather, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_gather(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(gather, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {3, 5}, is[2] = {3, 2}, is_rows[2] = {4, 2}, bad[6] = {0, 1, 4, 2, 3, 9};
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, xs, 1), *out = NULL;
    assert_err(ctx, tm_gather(ctx, x, ids_from(ctx, TM_I32, 2, is, bad), &out), TM_ERR_INDEX, "gather",
               "idx[2,1] = 9", "[0, 5)");
    assert_err(ctx, tm_gather(ctx, x, tt_randint(ctx, TM_I64, 2, is_rows, 2, 5), &out), TM_ERR_SHAPE, "gather",
               "i64[4,2]", "f64[3,5]");
    assert_err(ctx, tm_gather(ctx, x, tt_randint(ctx, TM_I64, 1, is, 3, 5), &out), TM_ERR_SHAPE, "gather",
               "i64[3]", NULL);
    cr_assert_null(out);
    tm_ctx_free(ctx);
}

/* ---- scatter_add -------------------------------------------------------------------------- */

Test(scatter_add, forward) {
    tm_ctx *ctx = tt_ctx();
    int64_t ss[2] = {9, 5}, M = 9, idx[9] = {2, 0, 2, 5, 0, 2, 1, 3, 5}; /* row 4 never hit */
    for (int it = 0; it < 2; it++) {
        tm_tensor *src = tt_randn(ctx, it ? TM_F32 : TM_F64, 2, ss, 91), *out;
        TT_OK(ctx, tm_scatter_add(ctx, src, ids_from(ctx, it ? TM_I32 : TM_I64, 1, &M, idx), 6, &out));
        cr_assert_eq(tm_tensor_dim(out, 0), 6);
        cr_assert_eq(tm_tensor_dim(out, 1), 5);
        double *hs = tt_read(ctx, src), want[30] = {0};
        for (int m = 0; m < 9; m++)
            for (int c = 0; c < 5; c++) want[idx[m] * 5 + c] += hs[m * 5 + c];
        tt_assert_close_host(ctx, out, want, 1e-7, 1e-6);
        free(hs);
    }
    tm_ctx_free(ctx);
}

Test(scatter_add, empty_source) {
    tm_ctx *ctx = tt_ctx();
    int64_t ss[2] = {0, 3}, M = 0, none[1] = {0};
    tm_tensor *out;
    TT_OK(ctx, tm_scatter_add(ctx, tt_randn(ctx, TM_F32, 2, ss, 1), ids_from(ctx, TM_I64, 1, &M, none), 4, &out));
    double want[12] = {0};
    assert_exact(ctx, out, want);
    tm_ctx_free(ctx);
}

/* Forward of a large scatter with nthreads threads, as f64 values. */
static double *scatter_large(int nthreads, tm_dtype dt, int64_t M, int64_t C, int64_t R, const int64_t *idx) {
    tm_ctx *ctx = tt_ctx_threads(nthreads);
    int64_t ss[2] = {M, C};
    tm_tensor *out;
    TT_OK(ctx, tm_scatter_add(ctx, tt_randn(ctx, dt, 2, ss, 92), ids_from(ctx, TM_I32, 1, &M, idx), R, &out));
    double *v = tt_read(ctx, out);
    tm_ctx_free(ctx);
    return v;
}

Test(scatter_add, deterministic_across_threads) {
    const int64_t M = 4099, C = 33, R = 40;
    int64_t *idx = malloc(sizeof(int64_t) * M);
    for (int64_t m = 0; m < M; m++) idx[m] = (m * 31 + m / 7) % R;
    for (int d = 0; d < 2; d++) {
        tm_dtype dt = d ? TM_F32 : TM_F64;
        double *v[3];
        for (int t = 0; t < 3; t++) v[t] = scatter_large(t + 1, dt, M, C, R, idx);
        for (int t = 0; t < 3; t += 2)
            cr_assert(memcmp(v[t], v[1], sizeof(double) * R * C) == 0, "%s differs with %d threads",
                      tm_dtype_name(dt), t + 1);
        for (int t = 0; t < 3; t++) free(v[t]);
    }
    free(idx);
}

static tm_status scatter_add_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_scatter_add(ctx, in[0], in[1], 6, out);
}

double tt_gradcase_scatter_add(tm_ctx *ctx) {
    int64_t ss[2] = {9, 5}, M = 9, idx[9] = {2, 0, 2, 5, 0, 2, 1, 3, 5};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 2, ss, 93), ids_from(ctx, TM_I64, 1, &M, idx)};
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, scatter_add_fn, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}

Test(scatter_add, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_scatter_add(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(scatter_add, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t ss[2] = {4, 3}, M = 4, five = 5, bad[4] = {0, 9, 10, 1}, ok[5] = {0, 1, 2, 3, 4};
    tm_tensor *src = tt_randn(ctx, TM_F32, 2, ss, 1), *out = NULL;
    assert_err(ctx, tm_scatter_add(ctx, src, ids_from(ctx, TM_I64, 1, &M, bad), 10, &out), TM_ERR_INDEX,
               "scatter_add", "idx[2] = 10", "[0, 10)");
    assert_err(ctx, tm_scatter_add(ctx, src, ids_from(ctx, TM_I64, 1, &five, ok), 10, &out), TM_ERR_SHAPE,
               "scatter_add", "i64[5]", "f32[4,3]");
    assert_err(ctx, tm_scatter_add(ctx, src, ids_from(ctx, TM_I64, 1, &M, ok), -2, &out), TM_ERR_INVALID_ARG,
               "scatter_add", "-2", NULL);
    cr_assert_null(out);
    tm_ctx_free(ctx);
}

/* ---- index_check -------------------------------------------------------------------------- */

static void check_index_check(tm_dtype it, int64_t hi, int64_t ign, const int64_t *vals, int64_t n,
                              const int64_t *want_safe, int64_t want_pos, int64_t want_val) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {2, n / 2};
    tm_tensor *safe, *fb;
    uint64_t before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_index_check(ctx, ids_from(ctx, it, 2, s, vals), hi, ign, &safe, &fb));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "index_check reads nothing back");
    cr_assert_eq(tm_tensor_dtype(safe), it);
    cr_assert_eq(tm_tensor_ndim(safe), 2);
    cr_assert_eq(tm_tensor_dim(safe, 1), n / 2);
    cr_assert_eq(tm_tensor_dtype(fb), TM_I64);
    cr_assert_eq(tm_tensor_numel(fb), 2);
    int64_t got[64], first[2];
    TT_OK(ctx, tm_tensor_read(ctx, safe, TM_I64, got, n));
    for (int64_t i = 0; i < n; i++) cr_assert_eq(got[i], want_safe[i], "safe[%lld] = %lld, want %lld", (long long)i,
                                                 (long long)got[i], (long long)want_safe[i]);
    TT_OK(ctx, tm_tensor_read(ctx, fb, TM_I64, first, 2));
    cr_assert(first[0] == want_pos && first[1] == want_val, "first_bad {%lld, %lld}, want {%lld, %lld}",
              (long long)first[0], (long long)first[1], (long long)want_pos, (long long)want_val);
    tm_ctx_free(ctx);
}

Test(index_check, valid_ids_pass_through) {
    const int64_t v[6] = {0, 4, 2, 3, 1, 4};
    check_index_check(TM_I32, 5, 0, v, 6, v, -1, 0);
    check_index_check(TM_I64, 5, 0, v, 6, v, -1, 0);
}

Test(index_check, bad_ids_are_replaced_and_the_first_named) {
    /* tokens: nothing ignored (ignore_index 0 is a valid id), bad ones become 0 */
    const int64_t tok[8] = {1, 2, 7, 4, -3, 0, 9, 6}, tok_safe[8] = {1, 2, 0, 4, 0, 0, 0, 6};
    check_index_check(TM_I32, 7, 0, tok, 8, tok_safe, 2, 7);
    check_index_check(TM_I64, 7, 0, tok, 8, tok_safe, 2, 7);
    /* targets: -1 is ignored and stays; bad ones become -1 */
    const int64_t tgt[6] = {-1, 3, 0, -2, 11, 5}, tgt_safe[6] = {-1, 3, 0, -1, -1, 5};
    check_index_check(TM_I32, 6, -1, tgt, 6, tgt_safe, 3, -2);
    check_index_check(TM_I64, 6, -1, tgt, 6, tgt_safe, 3, -2);
}

Test(index_check, large_parallel_first_is_lowest) {
    tm_ctx *ctx = tt_ctx();
    enum { N = 1 << 17 };
    int64_t *v = malloc(sizeof(int64_t) * N), s[1] = {N}, fb[2];
    for (int64_t i = 0; i < N; i++) v[i] = i % 100;
    v[N - 5] = 100;
    v[70001] = -7;
    v[90000] = 1000;
    tm_tensor *safe, *first;
    TT_OK(ctx, tm_index_check(ctx, ids_from(ctx, TM_I64, 1, s, v), 100, 0, &safe, &first));
    TT_OK(ctx, tm_tensor_read(ctx, first, TM_I64, fb, 2));
    cr_assert(fb[0] == 70001 && fb[1] == -7, "first_bad {%lld, %lld}", (long long)fb[0], (long long)fb[1]);
    free(v);
    tm_ctx_free(ctx);
}

Test(index_check, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[1] = {3};
    const int64_t v[3] = {0, 1, 2};
    const double f[3] = {0, 1, 2};
    tm_tensor *i32 = ids_from(ctx, TM_I32, 1, s, v), *safe, *fb;
    assert_err(ctx, tm_index_check(ctx, tt_from(ctx, TM_F32, 1, s, f), 3, 0, &safe, &fb), TM_ERR_DTYPE, "index_check",
               "f32[3]", NULL);
    assert_err(ctx, tm_index_check(ctx, i32, -1, 0, &safe, &fb), TM_ERR_INVALID_ARG, "index_check", "hi = -1", NULL);
    assert_err(ctx, tm_index_check(ctx, i32, 3, (int64_t)1 << 40, &safe, &fb), TM_ERR_INVALID_ARG, "index_check",
               "ignore_index", "i32[3]");
    assert_err(ctx, tm_index_check(ctx, i32, 3, 0, NULL, &fb), TM_ERR_INVALID_ARG, "index_check", "safe", NULL);
    assert_err(ctx, tm_index_check(ctx, i32, 3, 0, &safe, NULL), TM_ERR_INVALID_ARG, "index_check", "first_bad", NULL);
    cr_assert_eq(tm_index_check(NULL, i32, 3, 0, &safe, &fb), TM_ERR_INVALID_ARG);
    tm_ctx_free(ctx);
}
