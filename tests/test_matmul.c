/*
 * test_matmul.c — tm_matmul: forward against a naive loop for every transpose combination with
 * a 2-D b, a shared b under batched a (the folded single-GEMM path and the per-batch trans_a
 * path) and a batched b (f64, f32, bf16); backward by finite differences for all of these;
 * accumulation into existing gradients; bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

typedef struct mm_case {
    int nd;                /* ndim of a (and of b when batched) */
    int64_t lead[2];       /* a's leading dims (nd - 2 of them) */
    int64_t M, N, K;
    int ta, tb, batched_b; /* batched_b: b has a's leading dims, else b is 2-D */
} mm_case;

static void shapes_of(const mm_case *m, int64_t *as, int64_t *bs, int *bnd) {
    int nl = m->nd - 2;
    for (int d = 0; d < nl; d++) as[d] = bs[d] = m->lead[d];
    as[nl] = m->ta ? m->K : m->M;
    as[nl + 1] = m->ta ? m->M : m->K;
    int off = m->batched_b ? nl : 0;
    bs[off] = m->tb ? m->N : m->K;
    bs[off + 1] = m->tb ? m->K : m->N;
    *bnd = off + 2;
}

static int64_t batch_of(const mm_case *m) {
    int64_t b = 1;
    for (int d = 0; d < m->nd - 2; d++) b *= m->lead[d];
    return b;
}

/* out (batch, M, N) from the host copies of a and b. */
static void mm_ref(const mm_case *m, const double *a, const double *b, double *out) {
    int64_t M = m->M, N = m->N, K = m->K;
    for (int64_t z = 0; z < batch_of(m); z++) {
        const double *az = a + z * M * K, *bz = b + (m->batched_b ? z * K * N : 0);
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double s = 0;
                for (int64_t p = 0; p < K; p++)
                    s += (m->ta ? az[p * M + i] : az[i * K + p]) * (m->tb ? bz[j * K + p] : bz[p * N + j]);
                out[(z * M + i) * N + j] = s;
            }
    }
}

static const mm_case cases[] = {
    {2, {0, 0}, 5, 7, 3, 0, 0, 0},   {2, {0, 0}, 5, 7, 3, 1, 0, 0},
    {2, {0, 0}, 5, 7, 3, 0, 1, 0},   {2, {0, 0}, 5, 7, 3, 1, 1, 0},
    {3, {3, 0}, 5, 6, 7, 0, 0, 0},   {3, {3, 0}, 5, 6, 7, 0, 1, 0}, /* folded */
    {3, {3, 0}, 5, 6, 7, 1, 0, 0},   {4, {2, 3}, 5, 6, 7, 1, 1, 0}, /* shared b, per batch */
    {3, {3, 0}, 5, 6, 7, 0, 0, 1},   {3, {3, 0}, 5, 6, 7, 1, 0, 1},
    {4, {2, 3}, 5, 6, 7, 0, 1, 1},   {4, {2, 3}, 5, 6, 7, 1, 1, 1}, /* batched b */
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

static void check_forward(tm_dtype dt, double atol, double rtol) {
    for (int k = 0; k < NCASES; k++) {
        const mm_case *m = &cases[k];
        tm_ctx *ctx = tt_ctx();
        int64_t as[4], bs[4];
        int bnd;
        shapes_of(m, as, bs, &bnd);
        tm_tensor *a = tt_randn(ctx, dt, m->nd, as, 100 + k), *b = tt_randn(ctx, dt, bnd, bs, 200 + k), *c;
        TT_OK(ctx, tm_matmul(ctx, a, b, m->ta, m->tb, &c));
        cr_assert_eq(tm_tensor_dtype(c), dt);
        cr_assert_eq(tm_tensor_ndim(c), m->nd);
        for (int d = 0; d < m->nd - 2; d++) cr_assert_eq(tm_tensor_dim(c, d), m->lead[d]);
        cr_assert_eq(tm_tensor_dim(c, -2), m->M, "case %d", k);
        cr_assert_eq(tm_tensor_dim(c, -1), m->N, "case %d", k);
        double *ha = tt_read(ctx, a), *hb = tt_read(ctx, b);
        double *ref = malloc(sizeof(double) * (size_t)(batch_of(m) * m->M * m->N));
        mm_ref(m, ha, hb, ref);
        tt_assert_close_host(ctx, c, ref, atol, rtol);
        free(ha), free(hb), free(ref);
        tm_ctx_free(ctx);
    }
}

Test(matmul, forward_f64) { check_forward(TM_F64, 1e-13, 1e-12); }
/* f32: K = 7 products of N(0,1) values accumulated in f32. */
Test(matmul, forward_f32) { check_forward(TM_F32, 1e-5, 1e-5); }
/* bf16: computed in f32 from the stored inputs, then rounded to bf16 (<= 2^-9 relative). */
Test(matmul, forward_bf16) { check_forward(TM_BF16, 1e-2, 8e-3); }

/* A larger folded product (rows 3 * 70 = 210) that is parallel inside the GEMM. */
Test(matmul, forward_large_f32) {
    tm_ctx *ctx = tt_ctx();
    mm_case m = {3, {3, 0}, 70, 129, 131, 0, 1, 0};
    int64_t as[4], bs[4];
    int bnd;
    shapes_of(&m, as, bs, &bnd);
    tm_tensor *a = tt_randn(ctx, TM_F32, 3, as, 1), *b = tt_randn(ctx, TM_F32, bnd, bs, 2), *c;
    TT_OK(ctx, tm_matmul(ctx, a, b, m.ta, m.tb, &c));
    double *ha = tt_read(ctx, a), *hb = tt_read(ctx, b), *ref = malloc(sizeof(double) * 3 * 70 * 129);
    mm_ref(&m, ha, hb, ref);
    tt_assert_close_host(ctx, c, ref, 1e-4, 1e-5);
    free(ha), free(hb), free(ref);
    tm_ctx_free(ctx);
}

static tm_status mm_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    const mm_case *m = user;
    return tm_matmul(ctx, in[0], in[1], m->ta, m->tb, out);
}

static double gradcase(tm_ctx *ctx, const mm_case *m, uint64_t seed) {
    int64_t as[4], bs[4];
    int bnd;
    shapes_of(m, as, bs, &bnd);
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, m->nd, as, seed), tt_randn(ctx, TM_F64, bnd, bs, seed + 1)};
    int check[2] = {1, 1};
    return tt_gradcheck(ctx, mm_fn, (void *)m, 2, in, check, 1e-6, 1e-7, 1e-6);
}

/* The common case: activations (2, 3, 5) @ a shared weight (5, 7) (one folded GEMM); the
 * weight's gradient sums over all 6 rows. */
double tt_gradcase_matmul(tm_ctx *ctx) {
    static const mm_case m = {3, {2, 0}, 3, 7, 5, 0, 0, 0};
    return gradcase(ctx, &m, 31);
}

Test(matmul, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_matmul(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(matmul, gradcheck_all_layouts) {
    for (int k = 0; k < NCASES; k++) {
        tm_ctx *ctx = tt_ctx();
        double r = gradcase(ctx, &cases[k], 300 + 2 * k);
        cr_assert_leq(r, 1.0, "case %d (nd=%d ta=%d tb=%d batched_b=%d): gradcheck ratio %g", k, cases[k].nd,
                      cases[k].ta, cases[k].tb, cases[k].batched_b, r);
        tm_ctx_free(ctx);
    }
}

/* Using a weight twice accumulates both contributions: d/dW sum((x W) * g1 + (x W) * g2). */
Test(matmul, backward_accumulates) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {4, 3}, ws[2] = {3, 5};
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, xs, 1), *w = tt_randn(ctx, TM_F64, 2, ws, 2), *y1, *y2, *s;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    TT_OK(ctx, tm_matmul(ctx, x, w, 0, 0, &y1));
    TT_OK(ctx, tm_matmul(ctx, x, w, 0, 0, &y2));
    TT_OK(ctx, tm_add(ctx, y1, y2, &s));
    int64_t os[2] = {4, 5};
    tm_tensor *g = tt_randn(ctx, TM_F64, 2, os, 3);
    TT_OK(ctx, tm_backward_with_grad(ctx, s, g));
    double *hx = tt_read(ctx, x), *hg = tt_read(ctx, g), want[15];
    for (int k = 0; k < 3; k++)
        for (int j = 0; j < 5; j++) {
            want[k * 5 + j] = 0;
            for (int i = 0; i < 4; i++) want[k * 5 + j] += 2 * hx[i * 3 + k] * hg[i * 5 + j];
        }
    tt_assert_close_host(ctx, tm_tensor_grad(w), want, 1e-13, 1e-12);
    free(hx), free(hg);
    tm_ctx_free(ctx);
}

Test(matmul, empty_inner_dim) {
    tm_ctx *ctx = tt_ctx();
    int64_t as[2] = {2, 0}, bs[2] = {0, 3};
    tm_tensor *a = tt_randn(ctx, TM_F32, 2, as, 1), *b = tt_randn(ctx, TM_F32, 2, bs, 2), *c;
    TT_OK(ctx, tm_matmul(ctx, a, b, 0, 0, &c));
    double zeros[6] = {0};
    tt_assert_close_host(ctx, c, zeros, 0, 0);
    tm_ctx_free(ctx);
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, "matmul"), "message lacks the op name: %s", msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

Test(matmul, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t s23[2] = {2, 3}, s43[2] = {4, 3}, s3[1] = {3}, s234[3] = {2, 3, 4}, s534[3] = {5, 3, 4};
    int64_t s2234[4] = {2, 2, 3, 4};
    tm_tensor *a = tt_randn(ctx, TM_F32, 2, s23, 1), *b43 = tt_randn(ctx, TM_F32, 2, s43, 2), *out = NULL;
    tm_tensor *b43d = tt_randn(ctx, TM_F64, 2, s43, 3), *v3 = tt_randn(ctx, TM_F32, 1, s3, 4);
    tm_tensor *a3 = tt_randn(ctx, TM_F32, 3, s234, 5), *b534 = tt_randn(ctx, TM_F32, 3, s534, 6);
    tm_tensor *b2234 = tt_randn(ctx, TM_F32, 4, s2234, 7), *ai = tt_randint(ctx, TM_I32, 2, s23, 8, 3);

    /* (2,3) @ (4,3): K 3 vs 4 */
    assert_err(ctx, tm_matmul(ctx, a, b43, 0, 0, &out), TM_ERR_SHAPE, "f32[2,3]", "f32[4,3]");
    /* trans_a: (3,2) @ (4,3) */
    assert_err(ctx, tm_matmul(ctx, a, b43, 1, 1, &out), TM_ERR_SHAPE, "trans_a=1", "f32[4,3]");
    assert_err(ctx, tm_matmul(ctx, a, b43d, 0, 1, &out), TM_ERR_DTYPE, "f32[2,3]", "f64[4,3]");
    assert_err(ctx, tm_matmul(ctx, ai, b43, 0, 1, &out), TM_ERR_DTYPE, "i32[2,3]", NULL);
    assert_err(ctx, tm_matmul(ctx, v3, b43, 0, 1, &out), TM_ERR_SHAPE, "f32[3]", NULL);
    /* batch dims 2 vs 5 */
    assert_err(ctx, tm_matmul(ctx, a3, b534, 0, 1, &out), TM_ERR_SHAPE, "f32[2,3,4]", "f32[5,3,4]");
    /* b with more dims than a */
    assert_err(ctx, tm_matmul(ctx, a3, b2234, 0, 0, &out), TM_ERR_SHAPE, "f32[2,3,4]", "f32[2,2,3,4]");
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}
