/*
 * test_cross_entropy.c — tm_cross_entropy: forward against the closed form (uniform logits give
 * log V) and a naive loop with ignored rows (f64, f32, bf16), backward by finite differences and
 * against (softmax - onehot) / n_valid, all-ignored batches, bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "extend.h"

#define IGN (-100)

/* Mean over rows with t != ignore of logsumexp(x[n]) - x[n, t]; 0 when none. */
static double ce_ref(const double *x, const int64_t *t, int64_t N, int64_t V, int64_t ignore) {
    double total = 0;
    int64_t valid = 0;
    for (int64_t n = 0; n < N; n++) {
        if (t[n] == ignore) continue;
        double mx = -INFINITY, s = 0;
        for (int64_t v = 0; v < V; v++) mx = fmax(mx, x[n * V + v]);
        for (int64_t v = 0; v < V; v++) s += exp(x[n * V + v] - mx);
        total += mx + log(s) - x[n * V + t[n]];
        valid++;
    }
    return valid ? total / valid : 0;
}

static tm_tensor *targets_i64(tm_ctx *ctx, int64_t N, const int64_t *t) {
    tm_tensor *tt;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &N, tm_cpu(), TM_I64, t, &tt));
    return tt;
}

static double scalar(tm_ctx *ctx, tm_tensor *t) {
    double v;
    cr_assert_eq(tm_tensor_ndim(t), 0);
    TT_OK(ctx, tm_tensor_read(ctx, t, TM_F64, &v, 1));
    return v;
}

static void check_uniform(tm_dtype dt, double tol) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {5, 37};
    double *vals = malloc(sizeof(double) * 5 * 37);
    for (int i = 0; i < 5 * 37; i++) vals[i] = 2.5; /* any constant: the loss is log V */
    int64_t t[5] = {0, 36, 3, IGN, 17};
    tm_tensor *loss;
    TT_OK(ctx, tm_cross_entropy(ctx, tt_from(ctx, dt, 2, xs, vals), targets_i64(ctx, 5, t), IGN, &loss));
    cr_assert_eq(tm_tensor_dtype(loss), dt);
    double got = scalar(ctx, loss);
    cr_assert(fabs(got - log(37.0)) <= tol, "loss %.17g, want log 37 = %.17g", got, log(37.0));
    free(vals);
    tm_ctx_free(ctx);
}

Test(cross_entropy, uniform_is_log_v_f64) { check_uniform(TM_F64, 1e-14); }
Test(cross_entropy, uniform_is_log_v_f32) { check_uniform(TM_F32, 1e-6); }
Test(cross_entropy, uniform_is_log_v_bf16) { check_uniform(TM_BF16, 2e-2); } /* log 37 in bf16 */

static void check_forward(tm_dtype dt, tm_dtype it, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    const int64_t N = 9, V = 23;
    int64_t xs[2] = {N, V};
    int64_t t[9] = {4, IGN, 22, 0, 4, IGN, 13, 9, 1};
    tm_tensor *x = tt_randn(ctx, dt, 2, xs, 51), *tg, *loss;
    TT_OK(ctx, tm_tensor_from_host(ctx, it, 1, &xs[0], tm_cpu(), TM_I64, t, &tg));
    TT_OK(ctx, tm_cross_entropy(ctx, x, tg, IGN, &loss));
    double *hx = tt_read(ctx, x), want = ce_ref(hx, t, N, V, IGN), got = scalar(ctx, loss);
    cr_assert(fabs(got - want) <= atol + rtol * fabs(want), "loss %.17g, want %.17g", got, want);
    free(hx);
    tm_ctx_free(ctx);
}

Test(cross_entropy, forward_f64_i64) { check_forward(TM_F64, TM_I64, 1e-14, 1e-14); }
Test(cross_entropy, forward_f32_i32) { check_forward(TM_F32, TM_I32, 1e-6, 1e-6); }
Test(cross_entropy, forward_bf16_i64) { check_forward(TM_BF16, TM_I64, 1e-3, 4e-3); }

Test(cross_entropy, custom_ignore_index) {
    /* ignore_index may be a valid class: rows targeting it are skipped. */
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {4, 6}, t[4] = {3, 1, 3, 5};
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, xs, 52), *loss;
    TT_OK(ctx, tm_cross_entropy(ctx, x, targets_i64(ctx, 4, t), 3, &loss));
    double *hx = tt_read(ctx, x);
    cr_assert_float_eq(scalar(ctx, loss), ce_ref(hx, t, 4, 6, 3), 1e-14);
    free(hx);
    tm_ctx_free(ctx);
}

Test(cross_entropy, all_ignored_is_zero_with_zero_grad) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {3, 5}, t[3] = {IGN, IGN, IGN};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 53), *loss;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_cross_entropy(ctx, x, targets_i64(ctx, 3, t), IGN, &loss));
    cr_assert_eq(scalar(ctx, loss), 0.0);
    TT_OK(ctx, tm_backward(ctx, loss));
    double *g = tt_read(ctx, tm_tensor_grad(x));
    for (int i = 0; i < 15; i++) cr_assert_eq(g[i], 0.0);
    free(g);
    tm_ctx_free(ctx);
}

/* d loss / d logits = (softmax(x[n]) - onehot(t[n])) / n_valid on valid rows, 0 on ignored
 * rows; f32 on a size that takes the OpenMP path. */
Test(cross_entropy, backward_closed_form_f32) {
    tm_ctx *ctx = tt_ctx();
    const int64_t N = 64, V = 601;
    int64_t xs[2] = {N, V}, t[64], valid = 0;
    for (int64_t n = 0; n < N; n++) t[n] = n % 5 == 2 ? IGN : (n * 37) % V;
    for (int64_t n = 0; n < N; n++) valid += t[n] != IGN;
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 54), *loss;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_cross_entropy(ctx, x, targets_i64(ctx, N, t), IGN, &loss));
    TT_OK(ctx, tm_backward(ctx, loss));
    double *hx = tt_read(ctx, x), *want = malloc(sizeof(double) * N * V);
    for (int64_t n = 0; n < N; n++) {
        double mx = -INFINITY, s = 0;
        for (int64_t v = 0; v < V; v++) mx = fmax(mx, hx[n * V + v]);
        for (int64_t v = 0; v < V; v++) s += exp(hx[n * V + v] - mx);
        for (int64_t v = 0; v < V; v++)
            want[n * V + v] = t[n] == IGN ? 0 : (exp(hx[n * V + v] - mx) / s - (v == t[n])) / valid;
    }
    tt_assert_close_host(ctx, tm_tensor_grad(x), want, 1e-9, 1e-5);
    free(hx), free(want);
    tm_ctx_free(ctx);
}

/* The model's path (tm__cross_entropy_unchecked) on bf16 logits: an f32 loss computed from the
 * bf16 logits directly and a bf16 gradient, the same bits as casting the logits to f32 first
 * (what tm_model_forward did before): bf16 -> f32 is exact, and the cast's backward rounded
 * the f32 gradient to bf16 once, as the bf16 gradient's own store does. */
Test(cross_entropy, checked_bf16_logits_give_an_f32_loss_bitwise_the_cast_path) {
    tm_ctx *ctx = tt_ctx();
    const int64_t N = 37, V = 1031; /* wide enough for the OpenMP path */
    int64_t xs[2] = {N, V}, t[37];
    for (int64_t n = 0; n < N; n++) t[n] = n % 6 == 4 ? -1 : (n * 211) % V;
    tm_tensor *x[2], *loss[2], *tg = targets_i64(ctx, N, t);
    for (int k = 0; k < 2; k++) {
        x[k] = tt_randn(ctx, TM_BF16, 2, xs, 56);
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x[k], 1));
        tm_tensor *lg = x[k], *l;
        if (k == 0) TT_OK(ctx, tm_cast(ctx, x[k], TM_F32, &lg));
        TT_OK(ctx, tm__cross_entropy_unchecked(ctx, lg, tg, -1, &loss[k]));
        cr_assert_eq(tm_tensor_dtype(loss[k]), TM_F32);
        TT_OK(ctx, tm_scale(ctx, loss[k], 0.37, &l)); /* an upstream gradient other than 1 */
        TT_OK(ctx, tm_backward(ctx, l));
    }
    float lv[2];
    for (int k = 0; k < 2; k++) TT_OK(ctx, tm_tensor_read(ctx, loss[k], TM_F32, &lv[k], 1));
    cr_assert(memcmp(&lv[0], &lv[1], sizeof lv[0]) == 0, "loss %.9g, through an f32 cast %.9g", lv[1], lv[0]);
    cr_assert_eq(tm_tensor_dtype(tm_tensor_grad(x[1])), TM_BF16);
    uint16_t *g[2];
    for (int k = 0; k < 2; k++) {
        g[k] = malloc(sizeof(uint16_t) * N * V);
        TT_OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(x[k]), TM_BF16, g[k], N * V));
    }
    cr_assert(memcmp(g[0], g[1], sizeof(uint16_t) * N * V) == 0, "the bf16 gradients differ from the cast path's");
    free(g[0]), free(g[1]);
    tm_ctx_free(ctx);
}

static tm_status ce_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_cross_entropy(ctx, in[0], in[1], IGN, out);
}

double tt_gradcase_cross_entropy(tm_ctx *ctx) {
    int64_t xs[2] = {7, 11}, t[7] = {3, IGN, 10, 0, 3, IGN, 6};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 2, xs, 55), targets_i64(ctx, 7, t)};
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, ce_fn, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}

Test(cross_entropy, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_cross_entropy(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, "cross_entropy"), "message lacks the op name: %s", msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

Test(cross_entropy, bad_inputs) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {4, 7}, x3[3] = {2, 2, 7}, five = 5;
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *out = NULL;
    int64_t over[4] = {1, IGN, 7, 2}, neg[4] = {1, -1, 2, 3}, ok[5] = {0, 1, 2, 3, 4};

    assert_err(ctx, tm_cross_entropy(ctx, x, targets_i64(ctx, 4, over), IGN, &out), TM_ERR_INDEX,
               "targets[2] = 7", "[0, 7)");
    assert_err(ctx, tm_cross_entropy(ctx, x, targets_i64(ctx, 4, neg), IGN, &out), TM_ERR_INDEX,
               "targets[1] = -1", "[0, 7)");
    /* bf16 logits run on an f32 staging copy; the message still names the caller's tensor */
    assert_err(ctx, tm_cross_entropy(ctx, tt_randn(ctx, TM_BF16, 2, xs, 5), targets_i64(ctx, 4, over), IGN, &out),
               TM_ERR_INDEX, "targets[2] = 7", "bf16[4,7]");
    assert_err(ctx, tm_cross_entropy(ctx, x, tt_randn(ctx, TM_F32, 1, &xs[0], 2), IGN, &out), TM_ERR_DTYPE,
               "f32[4]", NULL);
    assert_err(ctx, tm_cross_entropy(ctx, tt_randn(ctx, TM_F32, 3, x3, 3), targets_i64(ctx, 4, ok), IGN, &out),
               TM_ERR_SHAPE, "f32[2,2,7]", NULL);
    assert_err(ctx, tm_cross_entropy(ctx, x, targets_i64(ctx, five, ok), IGN, &out), TM_ERR_SHAPE, "i64[5]",
               "f32[4,7]");
    assert_err(ctx, tm_cross_entropy(ctx, x, tt_randint(ctx, TM_I32, 2, xs, 4, 7), IGN, &out), TM_ERR_SHAPE,
               "i32[4,7]", NULL);
    cr_assert_null(out, "out was set by a failed call");
    /* -1 is a valid target once it is the ignore_index. */
    TT_OK(ctx, tm_cross_entropy(ctx, x, targets_i64(ctx, 4, neg), -1, &out));
    tm_ctx_free(ctx);
}
