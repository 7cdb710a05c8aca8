/*
 * test_moe_loss.c — the MoE auxiliary losses (tm_moe_aux_loss, tm_moe_seq_aux_loss,
 * tm_moe_z_loss) against closed forms and naive loops, their gradients (closed form and finite
 * differences), tm_moe_expert_bias_update on a hand case, bad inputs.
 *
 * Routing maps are random: every row routes k distinct experts chosen by random keys, so the
 * routed columns are shuffled and counts differ between experts.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* ---- helpers ------------------------------------------------------------------------------ */

/* map[t,e] (malloc'd, 0/1 as double): k distinct experts per row, those of the k largest random keys. */
static double *random_map(tm_ctx *ctx, int64_t T, int64_t E, int k, uint64_t seed) {
    int64_t s[2] = {T, E};
    double *key = tt_read(ctx, tt_randu(ctx, TM_F64, 2, s, seed, 0.0, 1.0));
    double *map = calloc((size_t)(T * E), sizeof(double));
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!map[t * E + e] && (best < 0 || key[t * E + e] > key[t * E + best])) best = e;
            map[t * E + best] = 1;
        }
    free(key);
    return map;
}

/* Column sums of map over rows [t0, t1). */
static void col_counts(double *cnt, const double *map, int64_t t0, int64_t t1, int64_t E) {
    for (int64_t e = 0; e < E; e++) cnt[e] = 0;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t e = 0; e < E; e++) cnt[e] += map[t * E + e];
}

/* Router-like scores: softmax of random logits (rows sum to 1). */
static tm_tensor *random_scores(tm_ctx *ctx, tm_dtype dt, int64_t T, int64_t E, uint64_t seed) {
    int64_t s[2] = {T, E};
    tm_tensor *p;
    TT_OK(ctx, tm_softmax(ctx, tt_randn(ctx, dt, 2, s, seed), &p));
    return p;
}

/* Naive: E * coeff / (k * T^2) * sum_e (sum over rows [t0, t1) of scores[t,e]) * cnt[e], T = Tn. */
static double aux_ref(const double *s, const double *cnt, int64_t t0, int64_t t1, int64_t E, int k, double coeff,
                      int64_t Tn) {
    double tot = 0;
    for (int64_t e = 0; e < E; e++) {
        double col = 0;
        for (int64_t t = t0; t < t1; t++) col += s[t * E + e];
        tot += col * cnt[e];
    }
    return (double)E * coeff / ((double)k * (double)Tn * (double)Tn) * tot;
}

static double scalar(tm_ctx *ctx, const tm_tensor *t) {
    cr_assert_eq(tm_tensor_ndim(t), 0);
    double v;
    TT_OK(ctx, tm_tensor_read(ctx, t, TM_F64, &v, 1));
    return v;
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *op, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, op), "message lacks the op name %s: %s", op, msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

static int close_rel(double got, double want, double rtol) { return fabs(got - want) <= rtol * fabs(want) + 1e-300; }

/* ---- moe_aux_loss ------------------------------------------------------------------------- */

Test(moe_aux_loss, uniform_balanced_is_coeff) {
    /* scores 1/E, counts T k / E: sum_e (T / E) (T k / E) = T^2 k / E, so aux = coeff exactly. */
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {8, 4}, E = 4;
    double cnt[4] = {4, 4, 4, 4};
    tm_tensor *counts = tt_from(ctx, TM_I64, 1, &E, cnt), *out;
    tm_dtype dts[2] = {TM_F64, TM_F32};
    for (int i = 0; i < 2; i++) {
        tm_tensor *sc;
        TT_OK(ctx, tm_tensor_empty(ctx, dts[i], 2, s, tm_cpu(), &sc));
        TT_OK(ctx, tm_tensor_fill(ctx, sc, 0.25));
        TT_OK(ctx, tm_moe_aux_loss(ctx, sc, counts, 2, 0.01, 0, &out));
        cr_assert_eq(tm_tensor_dtype(out), dts[i]);
        double want = dts[i] == TM_F64 ? 0.01 : (double)0.01f;
        cr_assert_eq(scalar(ctx, out), want, "%s: aux %.17g", i ? "f32" : "f64", scalar(ctx, out));
    }
    tm_ctx_free(ctx);
}

Test(moe_aux_loss, hand_2x2) {
    /* T = 2, E = 2, k = 1, coeff 1: column sums {1.1, 0.9}, counts {2, 0}:
     * aux = 2 / (1 * 4) * (1.1 * 2 + 0.9 * 0) = 1.1; with total_tokens 4: 2 / 16 * 2.2 = 0.275. */
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {2, 2}, E = 2;
    double sv[4] = {0.7, 0.3, 0.4, 0.6}, cv[2] = {2, 0};
    tm_tensor *sc = tt_from(ctx, TM_F64, 2, s, sv), *cnt = tt_from(ctx, TM_I64, 1, &E, cv), *out;
    TT_OK(ctx, tm_moe_aux_loss(ctx, sc, cnt, 1, 1.0, 0, &out));
    cr_assert(close_rel(scalar(ctx, out), 1.1, 1e-15), "aux %.17g", scalar(ctx, out));
    TT_OK(ctx, tm_moe_aux_loss(ctx, sc, cnt, 1, 1.0, 4, &out));
    cr_assert(close_rel(scalar(ctx, out), 0.275, 1e-15), "aux %.17g", scalar(ctx, out));
    tm_ctx_free(ctx);
}

static void check_aux_random(tm_dtype dt, int64_t T, int64_t E, int k, int64_t total, double rtol) {
    tm_ctx *ctx = tt_ctx();
    double *map = random_map(ctx, T, E, k, 41), *cnt = malloc(sizeof(double) * E);
    col_counts(cnt, map, 0, T, E);
    tm_tensor *sc = random_scores(ctx, dt, T, E, 42), *counts = tt_from(ctx, TM_I64, 1, &E, cnt), *out;
    TT_OK(ctx, tm_moe_aux_loss(ctx, sc, counts, k, 0.013, total, &out));
    double *hs = tt_read(ctx, sc);
    double want = aux_ref(hs, cnt, 0, T, E, k, 0.013, total > 0 ? total : T);
    cr_assert(close_rel(scalar(ctx, out), want, rtol), "aux %.17g, want %.17g", scalar(ctx, out), want);
    free(hs), free(map), free(cnt);
    tm_ctx_free(ctx);
}

Test(moe_aux_loss, random_f64) { check_aux_random(TM_F64, 37, 8, 2, 0, 1e-13); }
Test(moe_aux_loss, random_f64_total_tokens) { check_aux_random(TM_F64, 37, 8, 2, 111, 1e-13); }
/* f32: scores rounded to f32 before the read-back; the sum is in f64, so only the output's
 * f32 rounding remains. */
Test(moe_aux_loss, random_f32) { check_aux_random(TM_F32, 37, 8, 2, 0, 1e-6); }
/* Large enough for the OpenMP path (T * E >= 2^15). */
Test(moe_aux_loss, random_f64_parallel) { check_aux_random(TM_F64, 1031, 64, 6, 0, 1e-12); }

Test(moe_aux_loss, backward_closed_form) {
    /* d scores[t,e] = E coeff / (k T^2) count[e] dy, for a random dy; the counts get none. */
    tm_ctx *ctx = tt_ctx();
    int64_t T = 13, E = 6, s[2] = {T, E};
    int k = 3;
    double *map = random_map(ctx, T, E, k, 51), cnt[6];
    col_counts(cnt, map, 0, T, E);
    tm_tensor *sc = tt_randu(ctx, TM_F64, 2, s, 52, 0.0, 1.0), *counts = tt_from(ctx, TM_I64, 1, &E, cnt), *out;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, sc, 1));
    TT_OK(ctx, tm_moe_aux_loss(ctx, sc, counts, k, 0.7, 0, &out));
    double dyv = -1.37;
    TT_OK(ctx, tm_backward_with_grad(ctx, out, tt_from(ctx, TM_F64, 0, s, &dyv)));
    double want[13 * 6];
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) want[t * E + e] = (double)E * 0.7 / (k * (double)(T * T)) * cnt[e] * dyv;
    tt_assert_close_host(ctx, tm_tensor_grad(sc), want, 1e-15, 1e-14);
    free(map);
    tm_ctx_free(ctx);
}

static tm_status aux_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    const int64_t *total = user;
    return tm_moe_aux_loss(ctx, in[0], in[1], 2, 0.37, *total, out);
}

double tt_gradcase_moe_aux_loss(tm_ctx *ctx);
double tt_gradcase_moe_aux_loss(tm_ctx *ctx) {
    /* T = 11 of a global 29 tokens, E = 7, k = 2; expert 4 gets no token. */
    int64_t T = 11, E = 7;
    int64_t total = 29;
    double *map = random_map(ctx, T, E, 2, 61), cnt[7];
    col_counts(cnt, map, 0, T, E);
    cnt[4] = 0;
    free(map);
    tm_tensor *in[2] = {random_scores(ctx, TM_F64, T, E, 62), tt_from(ctx, TM_I64, 1, &E, cnt)};
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, aux_fn, &total, 2, in, check, 1e-6, 1e-9, 1e-6);
}

Test(moe_aux_loss, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_aux_loss(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(moe_aux_loss, empty_batch_is_zero) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {0, 4}, E = 4;
    double cv[4] = {0, 0, 0, 0};
    tm_tensor *sc = tt_randn(ctx, TM_F64, 2, s, 1), *out;
    TT_OK(ctx, tm_moe_aux_loss(ctx, sc, tt_from(ctx, TM_I64, 1, &E, cv), 2, 0.1, 0, &out));
    cr_assert_eq(scalar(ctx, out), 0.0);
    tm_ctx_free(ctx);
}

Test(moe_aux_loss, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {6, 5}, s3[3] = {2, 3, 5}, E = 5, E3 = 3, cs2[2] = {1, 5};
    double cv[5] = {2, 3, 1, 4, 2};
    tm_tensor *sc = tt_randu(ctx, TM_F32, 2, s, 1, 0, 1), *out = NULL;
    tm_tensor *cnt = tt_from(ctx, TM_I64, 1, &E, cv), *cnt3 = tt_from(ctx, TM_I64, 1, &E3, cv);
    tm_tensor *cnt32 = tt_from(ctx, TM_I32, 1, &E, cv), *cnt2d = tt_from(ctx, TM_I64, 2, cs2, cv);
    tm_tensor *sc3 = tt_randu(ctx, TM_F32, 3, s3, 2, 0, 1), *sci = tt_randint(ctx, TM_I64, 2, s, 3, 4);

    assert_err(ctx, tm_moe_aux_loss(ctx, sc, cnt3, 2, 0.1, 0, &out), TM_ERR_SHAPE, "moe_aux_loss", "i64[3]", "f32[6,5]");
    assert_err(ctx, tm_moe_aux_loss(ctx, sc, cnt2d, 2, 0.1, 0, &out), TM_ERR_SHAPE, "moe_aux_loss", "i64[1,5]", NULL);
    assert_err(ctx, tm_moe_aux_loss(ctx, sc, cnt32, 2, 0.1, 0, &out), TM_ERR_DTYPE, "moe_aux_loss", "i32[5]", NULL);
    assert_err(ctx, tm_moe_aux_loss(ctx, sc3, cnt, 2, 0.1, 0, &out), TM_ERR_SHAPE, "moe_aux_loss", "f32[2,3,5]", NULL);
    assert_err(ctx, tm_moe_aux_loss(ctx, sci, cnt, 2, 0.1, 0, &out), TM_ERR_DTYPE, "moe_aux_loss", "i64[6,5]", NULL);
    assert_err(ctx, tm_moe_aux_loss(ctx, sc, cnt, 0, 0.1, 0, &out), TM_ERR_INVALID_ARG, "moe_aux_loss", "topk", "got 0");
    assert_err(ctx, tm_moe_aux_loss(ctx, sc, cnt, 6, 0.1, 0, &out), TM_ERR_INVALID_ARG, "moe_aux_loss", "topk", "got 6");
    assert_err(ctx, tm_moe_aux_loss(ctx, sc, cnt, 2, NAN, 0, &out), TM_ERR_INVALID_ARG, "moe_aux_loss", "coeff", "nan");
    assert_err(ctx, tm_moe_aux_loss(ctx, sc, cnt, 2, 0.1, 4, &out), TM_ERR_INVALID_ARG, "moe_aux_loss",
               "total_tokens 4", "6 rows");
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}

/* ---- moe_seq_aux_loss --------------------------------------------------------------------- */

static void check_seq_random(tm_dtype dt, int64_t T, int64_t E, int k, int64_t ns, double rtol) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {T, E}, S = T / ns;
    double *map = random_map(ctx, T, E, k, 71), *cnt = malloc(sizeof(double) * E);
    tm_tensor *sc = random_scores(ctx, dt, T, E, 72), *m = tt_from(ctx, TM_U8, 2, s, map), *out;
    TT_OK(ctx, tm_moe_seq_aux_loss(ctx, sc, m, k, 0.02, ns, &out));
    cr_assert_eq(tm_tensor_dtype(out), dt);
    double *hs = tt_read(ctx, sc), want = 0;
    for (int64_t q = 0; q < ns; q++) {
        col_counts(cnt, map, q * S, (q + 1) * S, E);
        want += aux_ref(hs, cnt, q * S, (q + 1) * S, E, k, 0.02, S) / (double)ns;
    }
    cr_assert(close_rel(scalar(ctx, out), want, rtol), "seq aux %.17g, want %.17g", scalar(ctx, out), want);
    free(hs), free(map), free(cnt);
    tm_ctx_free(ctx);
}

Test(moe_seq_aux_loss, random_f64) { check_seq_random(TM_F64, 15, 7, 2, 3, 1e-13); }
Test(moe_seq_aux_loss, random_f32) { check_seq_random(TM_F32, 15, 7, 2, 5, 1e-6); }
Test(moe_seq_aux_loss, random_f64_parallel) { check_seq_random(TM_F64, 1030, 40, 4, 10, 1e-12); }

Test(moe_seq_aux_loss, one_sequence_is_aux_loss) {
    /* num_seqs = 1 with the routing map's column sums as counts: the two losses agree. */
    tm_ctx *ctx = tt_ctx();
    int64_t T = 19, E = 6, s[2] = {T, E};
    double *map = random_map(ctx, T, E, 3, 81), cnt[6];
    col_counts(cnt, map, 0, T, E);
    tm_tensor *sc = random_scores(ctx, TM_F64, T, E, 82), *a, *b;
    TT_OK(ctx, tm_moe_seq_aux_loss(ctx, sc, tt_from(ctx, TM_U8, 2, s, map), 3, 0.05, 1, &a));
    TT_OK(ctx, tm_moe_aux_loss(ctx, sc, tt_from(ctx, TM_I64, 1, &E, cnt), 3, 0.05, 0, &b));
    cr_assert(close_rel(scalar(ctx, a), scalar(ctx, b), 1e-15), "seq %.17g, aux %.17g", scalar(ctx, a),
              scalar(ctx, b));
    free(map);
    tm_ctx_free(ctx);
}

Test(moe_seq_aux_loss, backward_closed_form) {
    /* d scores[t,e] = E coeff / (k S^2 n) counts_{s(t)}[e] dy. */
    tm_ctx *ctx = tt_ctx();
    int64_t T = 12, E = 5, ns = 4, S = 3, s[2] = {T, E};
    int k = 2;
    double *map = random_map(ctx, T, E, k, 91), cnt[5];
    tm_tensor *sc = tt_randu(ctx, TM_F64, 2, s, 92, 0.0, 1.0), *out;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, sc, 1));
    TT_OK(ctx, tm_moe_seq_aux_loss(ctx, sc, tt_from(ctx, TM_U8, 2, s, map), k, 0.3, ns, &out));
    double dyv = 0.83, want[12 * 5];
    TT_OK(ctx, tm_backward_with_grad(ctx, out, tt_from(ctx, TM_F64, 0, s, &dyv)));
    for (int64_t q = 0; q < ns; q++) {
        col_counts(cnt, map, q * S, (q + 1) * S, E);
        for (int64_t t = q * S; t < (q + 1) * S; t++)
            for (int64_t e = 0; e < E; e++)
                want[t * E + e] = (double)E * 0.3 / ((double)k * S * S * ns) * cnt[e] * dyv;
    }
    tt_assert_close_host(ctx, tm_tensor_grad(sc), want, 1e-15, 1e-14);
    free(map);
    tm_ctx_free(ctx);
}

static tm_status seq_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_moe_seq_aux_loss(ctx, in[0], in[1], 3, 0.21, 3, out);
}

double tt_gradcase_moe_seq_aux_loss(tm_ctx *ctx);
double tt_gradcase_moe_seq_aux_loss(tm_ctx *ctx) {
    /* T = 15 tokens in 3 sequences of 5, E = 7, k = 3. */
    int64_t T = 15, E = 7, s[2] = {T, E};
    double *map = random_map(ctx, T, E, 3, 101);
    tm_tensor *in[2] = {random_scores(ctx, TM_F64, T, E, 102), tt_from(ctx, TM_U8, 2, s, map)};
    free(map);
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, seq_fn, NULL, 2, in, check, 1e-6, 1e-9, 1e-6);
}

Test(moe_seq_aux_loss, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_seq_aux_loss(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(moe_seq_aux_loss, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {6, 5}, s4[2] = {6, 4}, s3[3] = {2, 3, 5};
    tm_tensor *sc = tt_randu(ctx, TM_F32, 2, s, 1, 0, 1), *out = NULL;
    double *mv = random_map(ctx, 6, 5, 2, 2);
    tm_tensor *m = tt_from(ctx, TM_U8, 2, s, mv), *mf = tt_from(ctx, TM_F32, 2, s, mv);
    tm_tensor *m4 = tt_randint(ctx, TM_U8, 2, s4, 3, 2), *sc3 = tt_randu(ctx, TM_F32, 3, s3, 4, 0, 1);
    free(mv);

    assert_err(ctx, tm_moe_seq_aux_loss(ctx, sc, m, 2, 0.1, 4, &out), TM_ERR_INVALID_ARG, "moe_seq_aux_loss",
               "num_seqs 4", "6 rows");
    assert_err(ctx, tm_moe_seq_aux_loss(ctx, sc, m, 2, 0.1, 0, &out), TM_ERR_INVALID_ARG, "moe_seq_aux_loss",
               "num_seqs 0", NULL);
    assert_err(ctx, tm_moe_seq_aux_loss(ctx, sc, mf, 2, 0.1, 2, &out), TM_ERR_DTYPE, "moe_seq_aux_loss",
               "routing_map", "f32[6,5]");
    assert_err(ctx, tm_moe_seq_aux_loss(ctx, sc, m4, 2, 0.1, 2, &out), TM_ERR_SHAPE, "moe_seq_aux_loss",
               "u8[6,4]", "f32[6,5]");
    assert_err(ctx, tm_moe_seq_aux_loss(ctx, sc3, m, 2, 0.1, 2, &out), TM_ERR_SHAPE, "moe_seq_aux_loss",
               "f32[2,3,5]", NULL);
    assert_err(ctx, tm_moe_seq_aux_loss(ctx, sc, m, 9, 0.1, 2, &out), TM_ERR_INVALID_ARG, "moe_seq_aux_loss",
               "topk", "got 9");
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}

/* ---- moe_z_loss --------------------------------------------------------------------------- */

Test(moe_z_loss, zero_logits) {
    /* lse of E zeros is log E: z = coeff (log E)^2. */
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {9, 6};
    tm_tensor *x, *out;
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F64, 2, s, tm_cpu(), &x));
    TT_OK(ctx, tm_moe_z_loss(ctx, x, 0.001, &out));
    double want = 0.001 * log(6.0) * log(6.0);
    cr_assert(close_rel(scalar(ctx, out), want, 1e-15), "z %.17g, want %.17g", scalar(ctx, out), want);
    tm_ctx_free(ctx);
}

static void check_z_random(tm_dtype dt, int64_t T, int64_t E, double shift, double rtol) {
    /* shift moves every logit far from 0: exp would overflow without the max subtraction. */
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {T, E};
    tm_tensor *x0 = tt_randn(ctx, TM_F64, 2, s, 111), *x, *out;
    double *hx = tt_read(ctx, x0);
    for (int64_t i = 0; i < T * E; i++) hx[i] = 4.0 * hx[i] + shift;
    x = tt_from(ctx, dt, 2, s, hx);
    free(hx);
    hx = tt_read(ctx, x);
    TT_OK(ctx, tm_moe_z_loss(ctx, x, 0.01, &out));
    double want = 0;
    for (int64_t t = 0; t < T; t++) {
        double mx = -INFINITY, sum = 0;
        for (int64_t e = 0; e < E; e++) mx = fmax(mx, hx[t * E + e]);
        for (int64_t e = 0; e < E; e++) sum += exp(hx[t * E + e] - mx);
        double lse = mx + log(sum);
        want += lse * lse;
    }
    want = 0.01 * want / (double)T;
    cr_assert(close_rel(scalar(ctx, out), want, rtol), "z %.17g, want %.17g", scalar(ctx, out), want);
    free(hx);
    tm_ctx_free(ctx);
}

Test(moe_z_loss, random_f64) { check_z_random(TM_F64, 23, 9, 0.0, 1e-14); }
Test(moe_z_loss, large_logits_f64) { check_z_random(TM_F64, 23, 9, 1000.0, 1e-14); }
/* f32: per-element exp in f32 (relative error ~1e-7), sums in f64. */
Test(moe_z_loss, random_f32) { check_z_random(TM_F32, 23, 9, -3.0, 2e-6); }
Test(moe_z_loss, random_f64_parallel) { check_z_random(TM_F64, 1031, 64, 2.0, 1e-13); }

Test(moe_z_loss, backward_closed_form) {
    /* d logits[t,e] = dy coeff 2 lse_t / T softmax(logits[t])[e]. */
    tm_ctx *ctx = tt_ctx();
    int64_t T = 7, E = 5, s[2] = {T, E};
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, s, 121), *out;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_moe_z_loss(ctx, x, 0.2, &out));
    double dyv = -0.61, want[7 * 5], *hx = tt_read(ctx, x);
    TT_OK(ctx, tm_backward_with_grad(ctx, out, tt_from(ctx, TM_F64, 0, s, &dyv)));
    for (int64_t t = 0; t < T; t++) {
        double sum = 0;
        for (int64_t e = 0; e < E; e++) sum += exp(hx[t * E + e]);
        double lse = log(sum);
        for (int64_t e = 0; e < E; e++) want[t * E + e] = dyv * 0.2 * 2 * lse / T * exp(hx[t * E + e]) / sum;
    }
    tt_assert_close_host(ctx, tm_tensor_grad(x), want, 1e-15, 1e-13);
    free(hx);
    tm_ctx_free(ctx);
}

static tm_status z_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_moe_z_loss(ctx, in[0], 0.3, out);
}

double tt_gradcase_moe_z_loss(tm_ctx *ctx);
double tt_gradcase_moe_z_loss(tm_ctx *ctx) {
    int64_t s[2] = {9, 7};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 2, s, 131)};
    int check[1] = {1};
    return tt_gradcheck(ctx, z_fn, NULL, 1, in, check, 1e-6, 1e-9, 1e-6);
}

Test(moe_z_loss, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_z_loss(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(moe_z_loss, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t s3[3] = {2, 3, 5}, s0[2] = {4, 0}, s[2] = {4, 3};
    tm_tensor *out = NULL;
    assert_err(ctx, tm_moe_z_loss(ctx, tt_randn(ctx, TM_F32, 3, s3, 1), 0.1, &out), TM_ERR_SHAPE, "moe_z_loss",
               "f32[2,3,5]", NULL);
    assert_err(ctx, tm_moe_z_loss(ctx, tt_randn(ctx, TM_F32, 2, s0, 2), 0.1, &out), TM_ERR_SHAPE, "moe_z_loss",
               "f32[4,0]", NULL);
    assert_err(ctx, tm_moe_z_loss(ctx, tt_randint(ctx, TM_I32, 2, s, 3, 5), 0.1, &out), TM_ERR_DTYPE,
               "moe_z_loss", "i32[4,3]", NULL);
    assert_err(ctx, tm_moe_z_loss(ctx, tt_randn(ctx, TM_F32, 2, s, 4), INFINITY, &out), TM_ERR_INVALID_ARG,
               "moe_z_loss", "coeff", "inf");
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}

/* ---- tm_moe_expert_bias_update ------------------------------------------------------------ */

Test(moe_expert_bias_update, hand_case) {
    /* counts {5, 1, 3, 3}: mean 3, signs of (mean - count) {-1, +1, 0, 0}. */
    tm_ctx *ctx = tt_ctx();
    int64_t E = 4;
    double cv[4] = {5, 1, 3, 3};
    float b0[4] = {0.1f, -0.2f, 0.3f, 0.0f}, got[4];
    tm_tensor *bias;
    TT_OK(ctx, tm_buffer_new(ctx, "moe.expert_bias", TM_F32, 1, &E, tm_cpu(), &bias));
    TT_OK(ctx, tm_tensor_write(ctx, bias, TM_F32, b0, 4));
    TT_OK(ctx, tm_moe_expert_bias_update(ctx, bias, tt_from(ctx, TM_I64, 1, &E, cv), 1e-3));
    TT_OK(ctx, tm_tensor_read(ctx, bias, TM_F32, got, 4));
    double sign[4] = {-1, 1, 0, 0};
    for (int e = 0; e < 4; e++) {
        float want = (float)((double)b0[e] + 1e-3 * sign[e]);
        cr_assert_eq(got[e], want, "bias[%d] = %.9g, want %.9g", e, got[e], want);
    }
    cr_assert_eq(got[2], b0[2]);
    cr_assert_eq(got[3], 0.0f);
    /* A second update with other counts and rate accumulates on top. */
    double cv2[4] = {0, 0, 0, 8}; /* mean 2: {+1, +1, +1, -1} */
    TT_OK(ctx, tm_moe_expert_bias_update(ctx, bias, tt_from(ctx, TM_I64, 1, &E, cv2), 0.5));
    float got2[4];
    TT_OK(ctx, tm_tensor_read(ctx, bias, TM_F32, got2, 4));
    double sign2[4] = {1, 1, 1, -1};
    for (int e = 0; e < 4; e++) cr_assert_eq(got2[e], (float)((double)got[e] + 0.5 * sign2[e]));
    tm_ctx_free(ctx);
}

/* An f64 block keeps its bias in f64 (the gate dtype): updated in f64, no rounding to f32. */
Test(moe_expert_bias_update, f64_bias) {
    tm_ctx *ctx = tt_ctx();
    int64_t E = 4;
    double cv[4] = {5, 1, 3, 3}, b0[4] = {0.1, -0.2, 0.3, 1e-9}, sign[4] = {-1, 1, 0, 0};
    tm_tensor *bias;
    TT_OK(ctx, tm_buffer_new(ctx, "moe.expert_bias", TM_F64, 1, &E, tm_cpu(), &bias));
    TT_OK(ctx, tm_tensor_write(ctx, bias, TM_F64, b0, 4));
    TT_OK(ctx, tm_moe_expert_bias_update(ctx, bias, tt_from(ctx, TM_I64, 1, &E, cv), 1e-3));
    double *got = tt_read(ctx, bias);
    for (int e = 0; e < 4; e++) cr_assert_eq(got[e], b0[e] + 1e-3 * sign[e], "bias[%d] = %.17g", e, got[e]);
    free(got);
    tm_ctx_free(ctx);
}

Test(moe_expert_bias_update, balanced_is_unchanged) {
    /* Equal counts (and a mean that is not an integer elsewhere) leave no sign(0) rounding slip. */
    tm_ctx *ctx = tt_ctx();
    int64_t E = 7;
    double cv[7] = {1234567, 1234567, 1234567, 1234567, 1234567, 1234567, 1234567};
    tm_tensor *bias;
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 1, &E, tm_cpu(), &bias));
    TT_OK(ctx, tm_moe_expert_bias_update(ctx, bias, tt_from(ctx, TM_I64, 1, &E, cv), 1e-3));
    double *b = tt_read(ctx, bias);
    for (int e = 0; e < 7; e++) cr_assert_eq(b[e], 0.0);
    free(b);
    tm_ctx_free(ctx);
}

Test(moe_expert_bias_update, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t E = 4, E3 = 3, s2[2] = {2, 2};
    double cv[4] = {1, 2, 3, 4};
    tm_tensor *bias, *b64, *b2d;
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 1, &E, tm_cpu(), &bias));
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F64, 1, &E, tm_cpu(), &b64));
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 2, s2, tm_cpu(), &b2d));
    tm_tensor *cnt = tt_from(ctx, TM_I64, 1, &E, cv), *cnt3 = tt_from(ctx, TM_I64, 1, &E3, cv);
    tm_tensor *cnt32 = tt_from(ctx, TM_I32, 1, &E, cv);
    const char *op = "moe_expert_bias_update";
    assert_err(ctx, tm_moe_expert_bias_update(ctx, cnt32, cnt, 1e-3), TM_ERR_DTYPE, op, "expert_bias", "i32[4]");
    assert_err(ctx, tm_moe_expert_bias_update(ctx, bias, cnt32, 1e-3), TM_ERR_DTYPE, op, "counts", "i32[4]");
    assert_err(ctx, tm_moe_expert_bias_update(ctx, bias, cnt3, 1e-3), TM_ERR_SHAPE, op, "i64[3]", "f32[4]");
    assert_err(ctx, tm_moe_expert_bias_update(ctx, b2d, cnt, 1e-3), TM_ERR_SHAPE, op, "f32[2,2]", NULL);
    assert_err(ctx, tm_moe_expert_bias_update(ctx, bias, cnt, NAN), TM_ERR_INVALID_ARG, op, "rate", "nan");
    assert_err(ctx, tm_moe_expert_bias_update(ctx, bias, NULL, 1e-3), TM_ERR_INVALID_ARG, op, "counts", NULL);
    cr_assert_eq(tm_moe_expert_bias_update(NULL, bias, cnt, 1e-3), TM_ERR_INVALID_ARG);
    /* f64 (the gate dtype of an f64 block) is accepted: mean 2.5, so +rate, +rate, -rate, -rate. */
    TT_OK(ctx, tm_moe_expert_bias_update(ctx, b64, cnt, 0.25));
    double *h = tt_read(ctx, b64);
    cr_assert(h[0] == 0.25 && h[1] == 0.25 && h[2] == -0.25 && h[3] == -0.25, "%g %g %g %g", h[0], h[1], h[2], h[3]);
    free(h);
    double *b = tt_read(ctx, bias);
    for (int e = 0; e < 4; e++) cr_assert_eq(b[e], 0.0, "a failed call wrote bias[%d]", e);
    free(b);
    tm_ctx_free(ctx);
}

/* ---- thread-count independence ------------------------------------------------------------- */

/* The three losses and their gradients at a size that takes the OpenMP paths (T * E >= 2^15). */
static void losses_with_threads(int nthreads, const double *s, const double *map, double *vals, double *grads,
                                int64_t T, int64_t E) {
    tm_ctx *ctx = tt_ctx_threads(nthreads);
    int64_t sh[2] = {T, E};
    double *cnt = malloc(sizeof(double) * E);
    col_counts(cnt, map, 0, T, E);
    for (int i = 0; i < 3; i++) {
        tm_tensor *x = tt_from(ctx, TM_F32, 2, sh, s), *out;
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
        if (i == 0) TT_OK(ctx, tm_moe_aux_loss(ctx, x, tt_from(ctx, TM_I64, 1, &E, cnt), 4, 0.01, 0, &out));
        if (i == 1) TT_OK(ctx, tm_moe_seq_aux_loss(ctx, x, tt_from(ctx, TM_U8, 2, sh, map), 4, 0.01, 8, &out));
        if (i == 2) TT_OK(ctx, tm_moe_z_loss(ctx, x, 0.01, &out));
        TT_OK(ctx, tm_backward(ctx, out));
        vals[i] = scalar(ctx, out);
        TT_OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(x), TM_F64, grads + i * T * E, T * E));
    }
    free(cnt);
    tm_ctx_free(ctx);
}

Test(moe_loss_threads, bit_identical_for_1_2_3_threads) {
    int64_t T = 1032, E = 48;
    tm_ctx *ctx = tt_ctx();
    double *s = tt_read(ctx, random_scores(ctx, TM_F64, T, E, 141)), *map = random_map(ctx, T, E, 4, 142);
    tm_ctx_free(ctx);
    double vals[3][3], *grads[3];
    for (int t = 0; t < 3; t++) {
        grads[t] = malloc(sizeof(double) * 3 * T * E);
        losses_with_threads(t + 1, s, map, vals[t], grads[t], T, E);
    }
    for (int t = 1; t < 3; t++) {
        cr_assert(memcmp(vals[t], vals[0], sizeof vals[0]) == 0, "losses differ with %d threads", t + 1);
        cr_assert(memcmp(grads[t], grads[0], sizeof(double) * 3 * T * E) == 0, "gradients differ with %d threads",
                  t + 1);
    }
    for (int t = 0; t < 3; t++) free(grads[t]);
    free(s), free(map);
}
