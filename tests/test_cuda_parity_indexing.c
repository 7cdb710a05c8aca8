/*
 * test_cuda_parity_indexing.c — the CUDA kernels of embedding, index_select, gather,
 * scatter_add and index_check against the CPU ones: forward and backward parity (i32 and i64
 * indices, heavily repeated indices, wide rows, a 50257-row table, 65537 ids, a scalar id,
 * gradients accumulated twice), empty inputs, bitwise reproducible row scatter-adds,
 * index_check's outputs (several bad ids, ignore_index, a large input), bad indices
 * (TM_ERR_INDEX with the CPU's message, the context still usable), the host round trips each
 * op makes (tm_ctx_sync_count), and a dense model's training step on CUDA.
 *
 * Tolerances (|cuda - cpu| <= atol + rtol * |cpu|): f32 atol 1e-5, rtol 1e-5; bf16 atol 1e-2,
 * rtol 1e-2, as in tests/test_cuda_parity.c. Lookups are copies; the row scatter-adds and the
 * gather backward make the CPU's additions in the CPU's order (kernels/cuda/indexing.cu), so
 * the two should agree more closely than that; the test does not rely on it. The dense model
 * step compares loss and gradients after a whole network: atol 1e-5, rtol 1e-4 (f32).
 * Every test but the coverage declarations skips when no CUDA device is visible.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"
#include "parity.h"

/* The ops of CASES below (tt_parity_run records them only inside the test's own process). */
TT_PARITY_COVERS("embedding")
TT_PARITY_COVERS("index_select")
TT_PARITY_COVERS("gather")
TT_PARITY_COVERS("scatter_add")
TT_PARITY_COVERS("index_check")

/* ---- generic parity cases ------------------------------------------------------------------ */

static tm_status f_embedding(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_embedding(c, in[0], in[1], o);
}
/* Two lookups into one table: the second backward adds into a gradient that holds the first. */
static tm_status f_embedding_twice(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *x, *y;
    tm_status s = tm_embedding(c, in[0], in[1], &x);
    if (!s) s = tm_embedding(c, in[0], in[2], &y);
    return s ? s : tm_add(c, x, y, o);
}
static tm_status f_index_select(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_index_select(c, in[0], in[1], o);
}
static tm_status f_gather(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_gather(c, in[0], in[1], o);
}
static tm_status f_scatter_add(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_scatter_add(c, in[0], in[1], a[0], o);
}

/* Indices are uniform in [0, index_hi): with index_hi far below their count, rows repeat many
 * times (the deterministic scatter's hard case). */
static const tt_pcase CASES[] = {
    {"embedding", "embedding i32 ids [4,37] into [50,13]", f_embedding, 2, {2, 2}, {{50, 13}, {4, 37}}, {0, TM_I32}, {0, 1}, {0}, 1, 50},
    {"embedding", "embedding i64, 3001 ids into 7 rows", f_embedding, 2, {2, 1}, {{7, 33}, {3001}}, {0, TM_I64}, {0, 1}, {0}, 1, 7},
    {"embedding", "embedding i64 [2,300] into 50257 rows", f_embedding, 2, {2, 2}, {{50257, 5}, {2, 300}}, {0, TM_I64}, {0, 1}, {0}, 1, 50257},
    {"embedding", "embedding i32, 65537 ids into 50257 rows", f_embedding, 2, {2, 1}, {{50257, 3}, {65537}}, {0, TM_I32}, {0, 1}, {0}, 1, 50257},
    {"embedding", "embedding scalar id", f_embedding, 2, {2, 0}, {{9, 6}, {0}}, {0, TM_I64}, {0, 1}, {0}, 1, 9},
    {"embedding", "embedding twice into one gradient, wide rows", f_embedding_twice, 3, {2, 1, 1}, {{6, 600}, {40}, {40}}, {0, TM_I32, TM_I64}, {0, 1, 1}, {0}, 1, 6},
    {"index_select", "index_select i32 [101] from [40,9]", f_index_select, 2, {2, 1}, {{40, 9}, {101}}, {0, TM_I32}, {0, 1}, {0}, 1, 40},
    {"index_select", "index_select i64 [17] from [5,1100]", f_index_select, 2, {2, 1}, {{5, 1100}, {17}}, {0, TM_I64}, {0, 1}, {0}, 1, 5},
    {"gather", "gather i64 [6,9] from [6,50]", f_gather, 2, {2, 2}, {{6, 50}, {6, 9}}, {0, TM_I64}, {0, 1}, {0}, 1, 50},
    {"gather", "gather i32 [33,20] from [33,4] (repeated columns)", f_gather, 2, {2, 2}, {{33, 4}, {33, 20}}, {0, TM_I32}, {0, 1}, {0}, 1, 4},
    {"scatter_add", "scatter_add i64 300 rows into 11", f_scatter_add, 2, {2, 1}, {{300, 7}, {300}}, {0, TM_I64}, {0, 1}, {11}, 1, 11},
    {"scatter_add", "scatter_add i32 5 rows into 40 (empty rows)", f_scatter_add, 2, {2, 1}, {{5, 3}, {5}}, {0, TM_I32}, {0, 1}, {40}, 1, 40},
    {"scatter_add", "scatter_add i64 37 wide rows into 3", f_scatter_add, 2, {2, 1}, {{37, 700}, {37}}, {0, TM_I64}, {0, 1}, {3}, 1, 3},
};
#define N_CASES ((int)(sizeof CASES / sizeof CASES[0]))

Test(cuda_parity_indexing, ops_f32) {
    TT_SKIP_WITHOUT_CUDA();
    for (int k = 0; k < N_CASES; k++) tt_parity_run(&CASES[k], TM_F32, 1e-5, 1e-5);
}

Test(cuda_parity_indexing, ops_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    for (int k = 0; k < N_CASES; k++) tt_parity_run(&CASES[k], TM_BF16, 1e-2, 1e-2);
}

/* ---- helpers --------------------------------------------------------------------------------- */

static tm_tensor *ids_on(tm_ctx *ctx, tm_dtype it, int ndim, const int64_t *shape, const int64_t *vals, tm_device d) {
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, it, ndim, shape, d, TM_I64, vals, &t));
    return t;
}
static tm_tensor *floats_on(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, uint64_t seed, tm_device d) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    double *h = tt_parity_uniform(n, seed);
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, ndim, shape, d, TM_F64, h, &t));
    free(h);
    return t;
}
static void assert_same_values(tm_ctx *ctx, const tm_tensor *a, const tm_tensor *b, const char *what) {
    cr_assert_eq(tm_tensor_numel(a), tm_tensor_numel(b), "%s: sizes differ", what);
    double *x = tt_read(ctx, a), *y = tt_read(ctx, b);
    for (int64_t i = 0; i < tm_tensor_numel(a); i++)
        cr_assert(x[i] == y[i], "%s: element %lld is %.9g on CUDA, %.9g on the CPU", what, (long long)i, x[i], y[i]);
    free(x), free(y);
}

/* ---- empty inputs ------------------------------------------------------------------------------ */

static void empty_inputs(tm_dtype dt) {
    tm_ctx *ctx = tt_parity_ctx();
    const tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
    tm_tensor *out[2][5];
    const int64_t ws[2] = {5, 4}, zero[1] = {0}, src0[2] = {0, 3}, xs[2] = {3, 5}, ks0[2] = {3, 0}, c0[2] = {4, 0},
                  three[1] = {3}, ok3[3] = {3, 0, 1}, none[1] = {0};
    for (int d = 0; d < 2; d++) {
        tm_tensor *w = floats_on(ctx, dt, 2, ws, 1, devs[d]), *g;
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
        /* no ids: out [0, 4], and a backward that adds nothing */
        TT_OK(ctx, tm_embedding(ctx, w, ids_on(ctx, TM_I64, 1, zero, none, devs[d]), &out[d][0]));
        cr_assert_eq(tm_tensor_numel(out[d][0]), 0);
        const int64_t os[2] = {0, 4};
        TT_OK(ctx, tm_tensor_zeros(ctx, dt, 2, os, devs[d], &g));
        TT_OK(ctx, tm_backward_with_grad(ctx, out[d][0], g));
        out[d][0] = tm_tensor_grad(w);
        cr_assert_not_null(out[d][0]);
        /* scatter_add of no rows: zeros [4, 3] */
        TT_OK(ctx, tm_scatter_add(ctx, floats_on(ctx, dt, 2, src0, 2, devs[d]), ids_on(ctx, TM_I32, 1, zero, none, devs[d]),
                                  4, &out[d][1]));
        /* gather of no columns: [3, 0] */
        TT_OK(ctx, tm_gather(ctx, floats_on(ctx, dt, 2, xs, 3, devs[d]), ids_on(ctx, TM_I64, 2, ks0, none, devs[d]),
                             &out[d][2]));
        cr_assert_eq(tm_tensor_numel(out[d][2]), 0);
        /* index_select from rows of no columns: [3, 0], the indices still checked */
        tm_tensor *x0 = floats_on(ctx, dt, 2, c0, 4, devs[d]);
        TT_OK(ctx, tm_index_select(ctx, x0, ids_on(ctx, TM_I64, 1, three, ok3, devs[d]), &out[d][3]));
        cr_assert_eq(tm_tensor_numel(out[d][3]), 0);
        const int64_t bad3[3] = {3, 4, 1};
        tm_tensor *o = NULL;
        cr_assert_eq(tm_index_select(ctx, x0, ids_on(ctx, TM_I64, 1, three, bad3, devs[d]), &o), TM_ERR_INDEX,
                     "%s", tm_ctx_errmsg(ctx));
        cr_assert(strstr(tm_ctx_errmsg(ctx), "idx[1] = 4"), "%s", tm_ctx_errmsg(ctx));
        /* index_check of no ids: first_bad {-1, 0} */
        tm_tensor *safe;
        TT_OK(ctx, tm_index_check(ctx, ids_on(ctx, TM_I32, 1, zero, none, devs[d]), 5, 0, &safe, &out[d][4]));
        cr_assert_eq(tm_tensor_numel(safe), 0);
    }
    const char *what[5] = {"embedding gradient after no ids", "scatter_add of no rows", "gather of no columns",
                           "index_select of no columns", "index_check first_bad of no ids"};
    for (int i = 0; i < 5; i++) assert_same_values(ctx, out[1][i], out[0][i], what[i]);
    int64_t fb[2];
    TT_OK(ctx, tm_tensor_read(ctx, out[1][4], TM_I64, fb, 2));
    cr_assert(fb[0] == -1 && fb[1] == 0, "first_bad {%lld, %lld}", (long long)fb[0], (long long)fb[1]);
    tm_ctx_free(ctx);
}

Test(cuda_parity_indexing, empty_inputs_f32) {
    TT_SKIP_WITHOUT_CUDA();
    empty_inputs(TM_F32);
}
Test(cuda_parity_indexing, empty_inputs_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    empty_inputs(TM_BF16);
}

/* ---- determinism -------------------------------------------------------------------------------- */

/* Embedding backward and scatter_add forward with heavy collisions (20011 rows into 13 hot
 * rows of 1000, plus a few spread ones), run twice: the same bits. The CPU's gradient is
 * compared within tolerance. */
static void scatter_reproducible(tm_dtype dt, double atol, double rtol) {
    tm_ctx *ctx = tt_parity_ctx();
    enum { M = 20011, V = 1000, C = 67 };
    int64_t *ids = malloc(sizeof(int64_t) * M), n = M, ws[2] = {V, C}, os[2] = {M, C};
    for (int64_t m = 0; m < M; m++) ids[m] = m % 97 == 0 ? (m * 31) % V : (m * 7 + m / 3) % 13;
    double *hg = tt_parity_uniform(M * C, 5);
    double *got[3][2];
    const tm_device devs[3] = {tm_cuda(0), tm_cuda(0), tm_cpu()};
    for (int run = 0; run < 3; run++) {
        tm_tensor *w = floats_on(ctx, dt, 2, ws, 4, devs[run]), *idx = ids_on(ctx, TM_I64, 1, &n, ids, devs[run]);
        tm_tensor *out, *g, *sc;
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
        TT_OK(ctx, tm_embedding(ctx, w, idx, &out));
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, os, devs[run], TM_F64, hg, &g));
        TT_OK(ctx, tm_backward_with_grad(ctx, out, g));
        TT_OK(ctx, tm_scatter_add(ctx, g, idx, V, &sc));
        got[run][0] = tt_read(ctx, tm_tensor_grad(w));
        got[run][1] = tt_read(ctx, sc);
        tm_ctx_arena_reset(ctx);
    }
    const char *what[2] = {"embedding backward", "scatter_add forward"};
    for (int k = 0; k < 2; k++) {
        cr_assert(memcmp(got[0][k], got[1][k], sizeof(double) * V * C) == 0, "%s (%s): two CUDA runs differ", what[k],
                  tm_dtype_name(dt));
        double r = tt_close_ratio(got[0][k], got[2][k], V * C, atol, rtol);
        cr_assert(r <= 1.0, "%s (%s): CUDA differs from the CPU, ratio %g", what[k], tm_dtype_name(dt), r);
        if (memcmp(got[0][k], got[2][k], sizeof(double) * V * C) != 0)
            cr_log_info("%s (%s): CUDA and CPU agree within tolerance but not bit for bit", what[k], tm_dtype_name(dt));
    }
    for (int run = 0; run < 3; run++) free(got[run][0]), free(got[run][1]);
    free(ids), free(hg);
    tm_ctx_free(ctx);
}

Test(cuda_parity_indexing, scatter_bitwise_reproducible_f32) {
    TT_SKIP_WITHOUT_CUDA();
    scatter_reproducible(TM_F32, 1e-5, 1e-5);
}
Test(cuda_parity_indexing, scatter_bitwise_reproducible_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    scatter_reproducible(TM_BF16, 1e-2, 1e-2);
}

/* tm__embedding_unique (the expert-parallel regrouping: ids a permutation of the rows): its CUDA
 * backward scatters without the sort; the gradient must equal, bit for bit, the sorted path's
 * (tm__embedding_unchecked on CUDA) and the CPU's, including a second lookup adding into the
 * gradient the first one left. */
static void unique_scatter(tm_dtype dt) {
    tm_ctx *ctx = tt_parity_ctx();
    enum { R = 30011, C = 72 };
    int64_t *p1 = malloc(sizeof(int64_t) * R), *p2 = malloc(sizeof(int64_t) * R), n = R, ws[2] = {R, C};
    for (int64_t m = 0; m < R; m++) p1[m] = (m * 7919) % R, p2[m] = R - 1 - m; /* 7919 is prime, R too */
    double *hg = tt_parity_uniform(R * C, 8), *hg2 = tt_parity_uniform(R * C, 9), *got[3];
    const tm_device devs[3] = {tm_cuda(0), tm_cuda(0), tm_cpu()};
    for (int run = 0; run < 3; run++) {
        tm_tensor *w = floats_on(ctx, dt, 2, ws, 4, devs[run]);
        tm_tensor *i1 = ids_on(ctx, TM_I64, 1, &n, p1, devs[run]), *i2 = ids_on(ctx, TM_I32, 1, &n, p2, devs[run]);
        tm_tensor *a, *b, *g, *g2, *y;
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
        tm_status (*lookup)(tm_ctx *, tm_tensor *, tm_tensor *, tm_tensor **) =
            run == 1 ? tm__embedding_unchecked : tm__embedding_unique;
        TT_OK(ctx, lookup(ctx, w, i1, &a));
        TT_OK(ctx, lookup(ctx, w, i2, &b));
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, ws, devs[run], TM_F64, hg, &g));
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, ws, devs[run], TM_F64, hg2, &g2));
        TT_OK(ctx, tm_mul(ctx, a, g, &a));
        TT_OK(ctx, tm_mul(ctx, b, g2, &b));
        TT_OK(ctx, tm_add(ctx, a, b, &y));
        TT_OK(ctx, tm_backward_with_grad(ctx, y, g)); /* d a = g * g, d b = g2 * g: two scatters into w */
        got[run] = tt_read(ctx, tm_tensor_grad(w));
        double *fw = tt_read(ctx, a);
        cr_assert(isfinite(fw[0]));
        free(fw);
        tm_ctx_arena_reset(ctx);
    }
    cr_assert(memcmp(got[0], got[1], sizeof(double) * R * C) == 0, "%s: unique scatter differs from the sorted one",
              tm_dtype_name(dt));
    double tol = dt == TM_F32 ? 1e-6 : 1e-2, r = tt_close_ratio(got[0], got[2], (int64_t)R * C, tol, tol);
    cr_assert(r <= 1.0, "%s: CUDA differs from the CPU, ratio %g", tm_dtype_name(dt), r);
    for (int run = 0; run < 3; run++) free(got[run]);
    free(p1), free(p2), free(hg), free(hg2);
    tm_ctx_free(ctx);
}

Test(cuda_parity_indexing, unique_ids_scatter_as_the_sorted_path_f32) {
    TT_SKIP_WITHOUT_CUDA();
    unique_scatter(TM_F32);
}
Test(cuda_parity_indexing, unique_ids_scatter_as_the_sorted_path_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    unique_scatter(TM_BF16);
}

/* ---- index_check ------------------------------------------------------------------------------ */

/* safe and first_bad on CUDA equal the CPU's; the CUDA call reads nothing back. */
static void index_check_case(tm_dtype it, int64_t n, const int64_t *vals, int64_t hi, int64_t ign) {
    tm_ctx *ctx = tt_parity_ctx();
    tm_tensor *safe[2], *fb[2];
    const tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
    for (int d = 0; d < 2; d++) {
        tm_tensor *ids = ids_on(ctx, it, 1, &n, vals, devs[d]);
        uint64_t before = tm_ctx_sync_count(ctx);
        TT_OK(ctx, tm_index_check(ctx, ids, hi, ign, &safe[d], &fb[d]));
        cr_assert_eq(tm_ctx_sync_count(ctx), before, "index_check on %s synchronised", d ? "CUDA" : "the CPU");
        cr_assert_eq(tm_tensor_device(safe[d]).type, devs[d].type);
        cr_assert_eq(tm_tensor_dtype(safe[d]), it);
    }
    assert_same_values(ctx, safe[1], safe[0], "index_check safe");
    assert_same_values(ctx, fb[1], fb[0], "index_check first_bad");
    tm_ctx_free(ctx);
}

Test(cuda_parity_indexing, index_check_matches_the_cpu) {
    TT_SKIP_WITHOUT_CUDA();
    const int64_t ok[6] = {0, 4, 2, 3, 1, 4};
    const int64_t tok[8] = {1, 2, 7, 4, -3, 0, 9, 6};    /* several bad ids; the first at 2 */
    const int64_t tgt[7] = {-1, 3, 0, -2, 11, 5, -1};    /* -1 ignored; the first bad -2 at 3 */
    const int64_t big[3] = {(int64_t)1 << 40, 0, 1};     /* i64 only */
    for (int k = 0; k < 2; k++) {
        tm_dtype it = k ? TM_I64 : TM_I32;
        index_check_case(it, 6, ok, 5, 0);
        index_check_case(it, 8, tok, 7, 0);
        index_check_case(it, 7, tgt, 6, -1);
        index_check_case(it, 7, tgt, 6, 0); /* nothing ignored: -1 is bad too and comes first */
    }
    index_check_case(TM_I64, 3, big, 2, 0);
    /* Large: the lowest of several bad positions wins whatever the blocks' order. */
    enum { N = (1 << 17) + 3 };
    int64_t *v = malloc(sizeof(int64_t) * N);
    for (int64_t i = 0; i < N; i++) v[i] = i % 100;
    v[N - 5] = 100;
    v[90000] = 1000;
    v[70001] = -7;
    v[130000] = -1;
    index_check_case(TM_I32, N, v, 100, 0);
    index_check_case(TM_I64, N, v, 100, -1);
    free(v);
}

/* ---- bad indices, messages, synchronisations ------------------------------------------------- */

/* The message with every "cuda:0" written "cpu" (tensor descriptions name their device). */
static char *as_cpu_message(const char *m) {
    size_t n = strlen(m);
    char *out = malloc(n + 1), *o = out;
    while (*m) {
        if (strncmp(m, "cuda:0", 6) == 0) {
            memcpy(o, "cpu", 3);
            o += 3, m += 6;
        } else {
            *o++ = *m++;
        }
    }
    *o = 0;
    return out;
}

typedef tm_status (*bad_fn)(tm_ctx *ctx, tm_device d);

static tm_status bad_embedding(tm_ctx *ctx, tm_device d) {
    const int64_t ws[2] = {10, 4}, is[2] = {2, 3}, ids[6] = {0, 1, 2, 3, 9, 10};
    tm_tensor *o;
    return tm_embedding(ctx, floats_on(ctx, TM_F32, 2, ws, 1, d), ids_on(ctx, TM_I64, 2, is, ids, d), &o);
}
static tm_status bad_embedding_bf16_i32(tm_ctx *ctx, tm_device d) {
    const int64_t ws[2] = {10, 4}, is[2] = {2, 3}, ids[6] = {0, -3, 2, 3, 4, -1};
    tm_tensor *o;
    return tm_embedding(ctx, floats_on(ctx, TM_BF16, 2, ws, 1, d), ids_on(ctx, TM_I32, 2, is, ids, d), &o);
}
static tm_status bad_index_select(tm_ctx *ctx, tm_device d) {
    const int64_t xs[2] = {5, 2}, n = 5, idx[5] = {0, 1, 12, -1, 3};
    tm_tensor *o;
    return tm_index_select(ctx, floats_on(ctx, TM_F32, 2, xs, 2, d), ids_on(ctx, TM_I32, 1, &n, idx, d), &o);
}
static tm_status bad_gather(tm_ctx *ctx, tm_device d) {
    const int64_t xs[2] = {2, 3}, is[2] = {2, 3}, idx[6] = {0, 1, 2, 3, -4, 9};
    tm_tensor *o;
    return tm_gather(ctx, floats_on(ctx, TM_F32, 2, xs, 3, d), ids_on(ctx, TM_I64, 2, is, idx, d), &o);
}
static tm_status bad_scatter_add(tm_ctx *ctx, tm_device d) {
    const int64_t ss[2] = {4, 3}, n = 4, idx[4] = {0, 9, 10, 1};
    tm_tensor *o;
    return tm_scatter_add(ctx, floats_on(ctx, TM_F32, 2, ss, 4, d), ids_on(ctx, TM_I64, 1, &n, idx, d), 10, &o);
}

Test(cuda_parity_indexing, bad_indices_fail_as_on_the_cpu) {
    TT_SKIP_WITHOUT_CUDA();
    const bad_fn fns[5] = {bad_embedding, bad_embedding_bf16_i32, bad_index_select, bad_gather, bad_scatter_add};
    const char *want[5] = {"ids[1,2] = 10", "ids[0,1] = -3", "idx[2] = 12", "idx[1,0] = 3", "idx[2] = 10"};
    tm_ctx *ctx = tt_parity_ctx();
    for (int k = 0; k < 5; k++) {
        char *msg[2];
        for (int d = 0; d < 2; d++) {
            tm_device dev = d ? tm_cuda(0) : tm_cpu();
            uint64_t before = tm_ctx_sync_count(ctx);
            cr_assert_eq(fns[k](ctx, dev), TM_ERR_INDEX, "case %d on %s: %s", k, d ? "CUDA" : "the CPU", tm_ctx_errmsg(ctx));
            cr_assert_eq(tm_ctx_sync_count(ctx) - before, 1, "case %d on %s: one synchronisation (the flag)", k,
                         d ? "CUDA" : "the CPU");
            msg[d] = d ? as_cpu_message(tm_ctx_errmsg(ctx)) : strdup(tm_ctx_errmsg(ctx));
            cr_assert(strstr(msg[d], want[k]), "case %d: message lacks \"%s\": %s", k, want[k], msg[d]);
        }
        cr_assert_str_eq(msg[1], msg[0], "case %d: the CUDA message differs from the CPU's", k);
        free(msg[0]), free(msg[1]);
    }
    /* The context stays usable. */
    const int64_t ws[2] = {10, 4}, n = 3, ids[3] = {9, 0, 9};
    tm_tensor *o;
    TT_OK(ctx, tm_embedding(ctx, floats_on(ctx, TM_F32, 2, ws, 1, tm_cuda(0)), ids_on(ctx, TM_I64, 1, &n, ids, tm_cuda(0)), &o));
    tm_ctx_free(ctx);
}

/* One synchronisation per forward that has indices (the flag read), none for the checked
 * embedding, none for empty indices, none in the backward; the CPU counts the same. */
static void sync_sequence(tm_ctx *ctx, tm_device d, uint64_t *deltas) {
    const int64_t ws[2] = {10, 4}, n = 3, ids[3] = {9, 0, 9}, zero[1] = {0}, none[1] = {0};
    tm_tensor *w = floats_on(ctx, TM_F32, 2, ws, 1, d), *idx = ids_on(ctx, TM_I64, 1, &n, ids, d);
    tm_tensor *empty = ids_on(ctx, TM_I32, 1, zero, none, d), *a, *b, *e, *sa, *s;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    int k = 0;
    uint64_t before = tm_ctx_sync_count(ctx);
#define STEP(expr) do { TT_OK(ctx, expr); deltas[k++] = tm_ctx_sync_count(ctx) - before; before = tm_ctx_sync_count(ctx); } while (0)
    STEP(tm_embedding(ctx, w, idx, &a));                  /* 1 */
    STEP(tm__embedding_unchecked(ctx, w, idx, &b));         /* 0 */
    STEP(tm_embedding(ctx, w, empty, &e));                /* 0: no ids */
    STEP(tm_scatter_add(ctx, a, idx, 10, &sa));           /* 1 */
    STEP(tm_add(ctx, sa, w, &s));                         /* 0 */
    STEP(tm_sum_all(ctx, s, &s));                         /* 0 */
    STEP(tm_backward(ctx, s));                            /* 0 */
#undef STEP
    assert_same_values(ctx, a, b, "checked and unchecked embedding");
}

Test(cuda_parity_indexing, sync_count_matches_the_cpu) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *cu = tt_parity_ctx(), *cpu = tt_ctx();
    uint64_t dc[7], dh[7];
    const uint64_t want[7] = {1, 0, 0, 1, 0, 0, 0};
    sync_sequence(cu, tm_cuda(0), dc);
    sync_sequence(cpu, tm_cpu(), dh);
    for (int i = 0; i < 7; i++) {
        cr_assert_eq(dc[i], want[i], "CUDA step %d: %llu synchronisations, want %llu", i, (unsigned long long)dc[i],
                     (unsigned long long)want[i]);
        cr_assert_eq(dh[i], want[i], "CPU step %d: %llu synchronisations, want %llu", i, (unsigned long long)dh[i],
                     (unsigned long long)want[i]);
    }
    tm_ctx_free(cu);
    tm_ctx_free(cpu);
}

/* ---- a dense model on CUDA ------------------------------------------------------------------- */

/* Every op of a model without MoE layers (index_check, embedding, rmsnorm, matmul, rope,
 * attention, swiglu, cross_entropy) now has a CUDA kernel: a training step runs on CUDA with
 * the one synchronisation of tm_model_forward's statistics read, and agrees with the CPU. */
Test(cuda_parity_indexing, dense_model_step_on_cuda) {
    TT_SKIP_WITHOUT_CUDA();
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 61;
    c.d_model = 32;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.max_seq_len = 16;
    c.first_k_dense = 2;
    c.dense_ffn_size = 40;
    enum { B = 2, T = 16 };
    int32_t tok[B * T + 1];
    for (int i = 0; i < B * T + 1; i++) tok[i] = (i * 13 + 5) % 61;
    const int64_t s[2] = {B, T};
    double loss[2];
    double *grad[2][2];
    const char *names[2] = {"embed.weight", "layers.1.attn.wk"};
    for (int d = 0; d < 2; d++) {
        tm_device dev = d ? tm_cuda(0) : tm_cpu();
        tm_ctx *ctx = d ? tt_parity_ctx() : tt_ctx();
        tm_model *m = NULL;
        TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, dev, &m));
        TT_OK(ctx, tm_model_init(m, 7));
        tm_tensor *tokens, *targets;
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, s, dev, TM_I32, tok, &tokens));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, s, dev, TM_I32, tok + 1, &targets));
        uint64_t before = tm_ctx_sync_count(ctx);
        tm_model_out o;
        TT_OK(ctx, tm_model_forward(m, tokens, targets, &o));
        TT_OK(ctx, tm_backward(ctx, o.loss));
        cr_assert_eq(tm_ctx_sync_count(ctx) - before, 1, "%s: forward + backward of a dense model: %llu synchronisations",
                     d ? "CUDA" : "CPU", (unsigned long long)(tm_ctx_sync_count(ctx) - before));
        loss[d] = o.loss_value;
        for (int p = 0; p < 2; p++) {
            tm_tensor *t = tm_ctx_find(ctx, names[p]);
            cr_assert(t && tm_tensor_grad(t), "%s has no gradient", names[p]);
            grad[d][p] = tt_read(ctx, tm_tensor_grad(t));
        }
        if (d) { /* a bad token is reported from the same single read */
            int32_t bad[B * T];
            memcpy(bad, tok, sizeof bad);
            bad[19] = 61;
            bad[25] = -2;
            TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, s, dev, TM_I32, bad, &tokens));
            before = tm_ctx_sync_count(ctx);
            cr_assert_eq(tm_model_forward(m, tokens, NULL, &o), TM_ERR_INDEX, "%s", tm_ctx_errmsg(ctx));
            cr_assert(strstr(tm_ctx_errmsg(ctx), "tokens[1, 3] = 61"), "%s", tm_ctx_errmsg(ctx));
            cr_assert_eq(tm_ctx_sync_count(ctx) - before, 1);
        }
        tm_model_free(m);
        tm_ctx_free(ctx);
    }
    cr_assert(loss[0] > 0 && fabs(loss[1] - loss[0]) <= 1e-4 * loss[0], "loss: CUDA %.9g, CPU %.9g", loss[1], loss[0]);
    int64_t n[2] = {61 * 32, 32 * 16};
    for (int p = 0; p < 2; p++) {
        double r = tt_close_ratio(grad[1][p], grad[0][p], n[p], 1e-5, 1e-4);
        cr_assert(r <= 1.0, "gradient of %s: CUDA differs from the CPU, ratio %g", names[p], r);
        free(grad[0][p]), free(grad[1][p]);
    }
}
