/*
 * test_attention.c — tm_attention: forward against a naive reference (explicit score matrix,
 * causal mask, softmax, weighted sum) for GQA, MHA, MQA, Tk > Tq and single-query decoding, in
 * f64 / f32 / bf16; gradients by finite differences (canonical case); the f32 kernel (which
 * computes and accumulates in f32) against the f64 one, also on a long sequence; bitwise
 * repeatability for 1, 2 and 3 threads; bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

typedef struct geom {
    int64_t B, Tq, Tk, Hq, Hkv, D;
    double scale; /* <= 0: 1/sqrt(D) */
} geom;

static void ref_attention(const geom *g, const double *q, const double *k, const double *v, double *out) {
    const int64_t B = g->B, Tq = g->Tq, Tk = g->Tk, Hq = g->Hq, Hkv = g->Hkv, D = g->D;
    const double scale = g->scale > 0 ? g->scale : 1.0 / sqrt((double)D);
    double *S = malloc((size_t)(Tq * Tk) * sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++) {
            int64_t hk = h / (Hq / Hkv);
            for (int64_t i = 0; i < Tq; i++)
                for (int64_t j = 0; j < Tk; j++) {
                    double s = 0;
                    for (int64_t x = 0; x < D; x++)
                        s += q[((b * Tq + i) * Hq + h) * D + x] * k[((b * Tk + j) * Hkv + hk) * D + x];
                    S[i * Tk + j] = j <= i + (Tk - Tq) ? s * scale : -INFINITY;
                }
            for (int64_t i = 0; i < Tq; i++) {
                double *row = S + i * Tk, mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j < Tk; j++) mx = fmax(mx, row[j]);
                for (int64_t j = 0; j < Tk; j++) sum += (row[j] = exp(row[j] - mx));
                for (int64_t j = 0; j < Tk; j++) row[j] /= sum;
                for (int64_t x = 0; x < D; x++) {
                    double o = 0;
                    for (int64_t j = 0; j < Tk; j++) o += row[j] * v[((b * Tk + j) * Hkv + hk) * D + x];
                    out[((b * Tq + i) * Hq + h) * D + x] = o;
                }
            }
        }
    free(S);
}

static void make_qkv(tm_ctx *ctx, const geom *g, tm_dtype dt, uint64_t seed, tm_tensor **q, tm_tensor **k,
                     tm_tensor **v) {
    int64_t qs[4] = {g->B, g->Tq, g->Hq, g->D}, ks[4] = {g->B, g->Tk, g->Hkv, g->D};
    *q = tt_randn(ctx, dt, 4, qs, seed);
    *k = tt_randn(ctx, dt, 4, ks, seed + 1);
    *v = tt_randn(ctx, dt, 4, ks, seed + 2);
}

static void check_forward(const geom *g, tm_dtype dt, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    tm_tensor *q, *k, *v, *o;
    make_qkv(ctx, g, dt, 100, &q, &k, &v);
    TT_OK(ctx, tm_attention(ctx, q, k, v, g->scale, &o));
    cr_assert_eq(tm_tensor_dtype(o), dt);
    int64_t want_shape[4] = {g->B, g->Tq, g->Hq, g->D};
    for (int a = 0; a < 4; a++) cr_assert_eq(tm_tensor_dim(o, a), want_shape[a]);
    /* The reference reads the inputs as stored (already rounded to f32 / bf16). */
    double *qv = tt_read(ctx, q), *kv = tt_read(ctx, k), *vv = tt_read(ctx, v);
    double *want = malloc((size_t)(g->B * g->Tq * g->Hq * g->D) * sizeof(double));
    ref_attention(g, qv, kv, vv, want);
    tt_assert_close_host(ctx, o, want, atol, rtol);
    free(qv), free(kv), free(vv), free(want);
    tm_ctx_free(ctx);
}

/* The geometries of the forward tests: sizes that are not multiples of the kernel's 4-row
 * groups, 16-key panels or vector widths. */
static const geom G_GQA = {2, 5, 5, 4, 2, 6, 0.0};       /* square causal, 2 query heads per kv head */
static const geom G_MHA_CROSS = {1, 3, 7, 3, 3, 5, 0.3}; /* Tk > Tq (KV cache), Hq == Hkv, explicit scale */
static const geom G_MQA = {2, 4, 6, 4, 1, 8, 0.0};       /* Tk > Tq, one kv head for all */
static const geom G_DECODE = {3, 1, 9, 6, 2, 7, 0.0};    /* one new token sees every key */
static const geom G_BIG = {2, 67, 67, 4, 2, 18, 0.0};    /* enough work for the threaded path */
static const geom G_BIG_CROSS = {3, 41, 70, 6, 3, 13, 0.0};

/* Tolerances: f64 to rounding. f32 computes in f32 (scores summed over D <= 18, softmax weights
 * over <= 70 keys, tm__exp_f32 within 1.01 ulp): a few ulp on outputs of magnitude <= ~3, i.e.
 * ~1e-7 absolute; 1e-6 leaves margin (the reference uses the rounded inputs, so input rounding
 * does not count). bf16: the output rounding, 2^-9 relative. */
Test(attention, forward_gqa_f64) { check_forward(&G_GQA, TM_F64, 1e-13, 1e-12); }
Test(attention, forward_mha_tk_gt_tq_f64) { check_forward(&G_MHA_CROSS, TM_F64, 1e-13, 1e-12); }
Test(attention, forward_mqa_f64) { check_forward(&G_MQA, TM_F64, 1e-13, 1e-12); }
Test(attention, forward_decode_f64) { check_forward(&G_DECODE, TM_F64, 1e-13, 1e-12); }
Test(attention, forward_large_f64) { check_forward(&G_BIG, TM_F64, 1e-13, 1e-12); }
Test(attention, forward_large_cross_f64) { check_forward(&G_BIG_CROSS, TM_F64, 1e-13, 1e-12); }
Test(attention, forward_gqa_f32) { check_forward(&G_GQA, TM_F32, 1e-6, 1e-6); }
Test(attention, forward_mqa_f32) { check_forward(&G_MQA, TM_F32, 1e-6, 1e-6); }
Test(attention, forward_large_f32) { check_forward(&G_BIG_CROSS, TM_F32, 1e-6, 1e-6); }
Test(attention, forward_mha_tk_gt_tq_bf16) { check_forward(&G_MHA_CROSS, TM_BF16, 1e-2, 1e-2); }

/* ---- gradients --------------------------------------------------------------------------- */

static tm_status attention_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_attention(ctx, in[0], in[1], in[2], *(const double *)user, out);
}

static double gradcase(tm_ctx *ctx, const geom *g, uint64_t seed) {
    tm_tensor *in[3];
    make_qkv(ctx, g, TM_F64, seed, &in[0], &in[1], &in[2]);
    int check[3] = {1, 1, 1};
    double scale = g->scale;
    return tt_gradcheck(ctx, attention_fn, &scale, 3, in, check, 1e-6, 1e-8, 1e-5);
}

/* GQA (Hq 4, Hkv 2) square causal with the default scale, and Tk > Tq with an explicit one. */
double tt_gradcase_attention(tm_ctx *ctx) {
    const geom square = {2, 5, 5, 4, 2, 6, 0.0}, cross = {2, 3, 7, 4, 2, 6, 0.45};
    return fmax(gradcase(ctx, &square, 200), gradcase(ctx, &cross, 300));
}

Test(attention, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_attention(ctx);
    cr_assert(r <= 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(attention, gradcheck_mqa_decode) {
    tm_ctx *ctx = tt_ctx();
    const geom mqa = {1, 4, 6, 3, 1, 5, 0.0}, decode = {2, 1, 5, 2, 2, 3, 0.0};
    double r = fmax(gradcase(ctx, &mqa, 400), gradcase(ctx, &decode, 500));
    cr_assert(r <= 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

/* Gradients of q, k, v (in that order, malloc'd f64) for a fixed upstream gradient, and the
 * output if o is not NULL, computed in dtype dt with nthreads threads. */
static void grads(const geom *g, tm_dtype dt, int nthreads, double *out[3], double **o_out) {
    tm_ctx *ctx = tt_ctx_threads(nthreads);
    tm_tensor *in[3], *o;
    make_qkv(ctx, g, TM_F64, 600, &in[0], &in[1], &in[2]);
    for (int i = 0; i < 3; i++) {
        tm_tensor *t;
        TT_OK(ctx, tm_cast(ctx, in[i], dt, &t));
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, t, 1));
        in[i] = t;
    }
    TT_OK(ctx, tm_attention(ctx, in[0], in[1], in[2], g->scale, &o));
    if (o_out) *o_out = tt_read(ctx, o);
    int64_t os[4] = {g->B, g->Tq, g->Hq, g->D};
    tm_tensor *dy;
    TT_OK(ctx, tm_cast(ctx, tt_randn(ctx, TM_F64, 4, os, 700), dt, &dy));
    TT_OK(ctx, tm_backward_with_grad(ctx, o, dy));
    for (int i = 0; i < 3; i++) {
        cr_assert_not_null(tm_tensor_grad(in[i]));
        out[i] = tt_read(ctx, tm_tensor_grad(in[i]));
    }
    tm_ctx_free(ctx);
}

/* The f32 kernel against the f64 one on the same f32-rounded inputs and upstream gradient, so
 * the differences are f32 arithmetic alone. */
static void check_f32_against_f64(const geom *g, double atol, double rtol) {
    double *g64[3], *g32[3], *o64, *o32;
    grads(g, TM_F64, 2, g64, &o64);
    grads(g, TM_F32, 2, g32, &o32);
    int64_t no = g->B * g->Tq * g->Hq * g->D, nkv = g->B * g->Tk * g->Hkv * g->D;
    int64_t n[3] = {no, nkv, nkv};
    double r = tt_close_ratio(o32, o64, no, atol, rtol);
    cr_assert(r <= 1.0, "output: ratio %g", r);
    for (int i = 0; i < 3; i++) {
        r = tt_close_ratio(g32[i], g64[i], n[i], atol, rtol);
        cr_assert(r <= 1.0, "gradient of input %d: ratio %g", i, r);
        free(g64[i]), free(g32[i]);
    }
    free(o64), free(o32);
}

/* A threaded, GQA, Tk > Tq case. Measured worst: 7e-7 absolute on values up to 2.5 (f32
 * rounding of the scores and of the sums over <= 53 keys and 111 rows, amplified a little by
 * the softmax); the bound leaves > 10x. */
Test(attention, f32_matches_f64) { check_f32_against_f64(&(geom){2, 37, 53, 6, 2, 16, 0.0}, 1e-5, 1e-4); }

/* The long-sequence bound for f32 accumulation: Tq = Tk = 1024, D = 64. The rounding errors
 * of the sums (over D for a score, over <= 1024 keys for o and dq, over 1024 rows for dk and
 * dv) are independent, so they grow like sqrt(#terms) ulp, not #terms. Measured worst: 6e-7
 * (o), 9e-7 (dq), 1.9e-6 (dk), 5.2e-6 (dv, values up to 5) absolute. The same bound as the
 * short case holds with 2x margin. */
Test(attention, f32_matches_f64_long_sequence) {
    check_f32_against_f64(&(geom){1, 1024, 1024, 2, 1, 64, 0.0}, 1e-5, 1e-4);
}

/* dk / dv sum over the query heads of a group in a fixed order, and every task is computed the
 * same way whatever thread runs it: 1, 2 and 3 threads agree bitwise, output and gradients. */
Test(attention, backward_is_deterministic) {
    const geom g = {3, 45, 45, 8, 2, 12, 0.0};
    double *a[3][3], *o[3];
    for (int t = 0; t < 3; t++) grads(&g, TM_F32, t + 1, a[t], &o[t]);
    int64_t n[3] = {g.B * g.Tq * g.Hq * g.D, g.B * g.Tk * g.Hkv * g.D, g.B * g.Tk * g.Hkv * g.D};
    for (int t = 1; t < 3; t++) {
        cr_assert(memcmp(o[t], o[0], (size_t)n[0] * sizeof(double)) == 0, "output differs with %d threads", t + 1);
        for (int i = 0; i < 3; i++)
            cr_assert(memcmp(a[t][i], a[0][i], (size_t)n[i] * sizeof(double)) == 0,
                      "gradient of input %d differs with %d threads", i, t + 1);
    }
    for (int t = 0; t < 3; t++) {
        for (int i = 0; i < 3; i++) free(a[t][i]);
        free(o[t]);
    }
}

/* ---- bad inputs ------------------------------------------------------------------------- */

static void expect_error(const int64_t qs[4], const int64_t ks[4], const int64_t vs[4], tm_dtype kdt, double scale,
                         tm_status want, const char *frag1, const char *frag2) {
    tm_ctx *ctx = tt_ctx();
    tm_tensor *q = tt_randn(ctx, TM_F32, 4, qs, 1), *k = tt_randn(ctx, kdt, 4, ks, 2);
    tm_tensor *v = tt_randn(ctx, TM_F32, 4, vs, 3), *o = NULL;
    tm_status s = tm_attention(ctx, q, k, v, scale, &o);
    cr_assert_eq(s, want, "got %s: %s", tm_status_str(s), tm_ctx_errmsg(ctx));
    cr_assert_null(o);
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert(strstr(msg, "attention"), "message does not name the op: %s", msg);
    cr_assert(strstr(msg, frag1), "message lacks '%s': %s", frag1, msg);
    cr_assert(strstr(msg, frag2), "message lacks '%s': %s", frag2, msg);
    tm_ctx_free(ctx);
}

Test(attention, heads_not_divisible) {
    int64_t qs[4] = {2, 5, 3, 6}, ks[4] = {2, 5, 2, 6};
    expect_error(qs, ks, ks, TM_F32, 0, TM_ERR_SHAPE, "[2,5,3,6]", "[2,5,2,6]");
}

Test(attention, fewer_keys_than_queries) {
    int64_t qs[4] = {2, 7, 4, 6}, ks[4] = {2, 5, 2, 6};
    expect_error(qs, ks, ks, TM_F32, 0, TM_ERR_SHAPE, "[2,7,4,6]", "[2,5,2,6]");
}

Test(attention, head_dim_mismatch) {
    int64_t qs[4] = {2, 5, 4, 6}, ks[4] = {2, 5, 2, 8};
    expect_error(qs, ks, ks, TM_F32, 0, TM_ERR_SHAPE, "[2,5,4,6]", "[2,5,2,8]");
}

Test(attention, batch_mismatch) {
    int64_t qs[4] = {2, 5, 4, 6}, ks[4] = {3, 5, 2, 6};
    expect_error(qs, ks, ks, TM_F32, 0, TM_ERR_SHAPE, "[2,5,4,6]", "[3,5,2,6]");
}

Test(attention, value_shape_differs_from_key) {
    int64_t qs[4] = {2, 5, 4, 6}, ks[4] = {2, 5, 2, 6}, vs[4] = {2, 4, 2, 6};
    expect_error(qs, ks, vs, TM_F32, 0, TM_ERR_SHAPE, "[2,5,2,6]", "[2,4,2,6]");
}

Test(attention, wrong_rank) {
    int64_t ks[4] = {2, 5, 2, 6};
    tm_ctx *ctx = tt_ctx();
    int64_t q3[3] = {5, 4, 6};
    tm_tensor *q = tt_randn(ctx, TM_F32, 3, q3, 1), *k = tt_randn(ctx, TM_F32, 4, ks, 2), *o = NULL;
    tm_status s = tm_attention(ctx, q, k, k, 0, &o);
    cr_assert_eq(s, TM_ERR_SHAPE, "got %s: %s", tm_status_str(s), tm_ctx_errmsg(ctx));
    cr_assert(strstr(tm_ctx_errmsg(ctx), "attention") && strstr(tm_ctx_errmsg(ctx), "[5,4,6]"), "%s",
              tm_ctx_errmsg(ctx));
    tm_ctx_free(ctx);
}

Test(attention, dtype_mismatch) {
    int64_t qs[4] = {2, 5, 4, 6}, ks[4] = {2, 5, 2, 6};
    expect_error(qs, ks, ks, TM_F64, 0, TM_ERR_DTYPE, "f32", "f64");
}

Test(attention, non_finite_scale) {
    int64_t qs[4] = {2, 5, 4, 6}, ks[4] = {2, 5, 2, 6};
    expect_error(qs, ks, ks, TM_F32, NAN, TM_ERR_INVALID_ARG, "scale", "[2,5,4,6]");
}

/* Empty batches and empty query blocks are valid and produce empty outputs. */
Test(attention, empty) {
    const geom cases[2] = {{2, 0, 3, 4, 2, 6, 0.0}, {0, 3, 3, 2, 1, 4, 0.0}};
    for (int c = 0; c < 2; c++) {
        tm_ctx *ctx = tt_ctx();
        tm_tensor *q, *k, *v, *o;
        make_qkv(ctx, &cases[c], TM_F32, 1, &q, &k, &v);
        TT_OK(ctx, tm_attention(ctx, q, k, v, 0, &o));
        cr_assert_eq(tm_tensor_numel(o), 0);
        tm_ctx_free(ctx);
    }
}
