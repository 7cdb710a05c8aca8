/*
 * test_grouped_swiglu.c — tm_grouped_swiglu: forward against a naive loop in f64; forward and
 * every gradient against the composition it replaces, tm_swiglu(tm_grouped_matmul(x, w_gate),
 * tm_grouped_matmul(x, w_up)), bit for bit in f64, f32 and bf16, with ragged counts and empty
 * groups, x's gradient fresh and added to, each subset of wanted gradients, one tensor as both
 * weights; finite differences; bad operands and counts, named in the messages.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static tm_tensor *counts_tensor(tm_ctx *ctx, int64_t G, const int64_t *counts) {
    double v[64];
    for (int64_t g = 0; g < G; g++) v[g] = (double)counts[g];
    return tt_from(ctx, TM_I64, 1, &G, v);
}

/* Empty groups first, in the middle and last; group 3 has one row. */
static const int64_t COUNTS[8] = {0, 4, 0, 1, 6, 0, 3, 0};
enum { G8 = 8, R14 = 14 };

/* ---- forward against a naive loop ------------------------------------------------------------ */

Test(grouped_swiglu, forward_f64_against_loop) {
    tm_ctx *ctx = tt_ctx();
    enum { K = 7, F = 5 };
    int64_t xs[2] = {R14, K}, ws[3] = {G8, K, F};
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, xs, 1), *wg = tt_randn(ctx, TM_F64, 3, ws, 2);
    tm_tensor *wu = tt_randn(ctx, TM_F64, 3, ws, 3), *h;
    TT_OK(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts_tensor(ctx, G8, COUNTS), &h));
    cr_assert_eq(tm_tensor_dim(h, 0), R14);
    cr_assert_eq(tm_tensor_dim(h, 1), F);
    double *hx = tt_read(ctx, x), *hg = tt_read(ctx, wg), *hu = tt_read(ctx, wu), ref[R14 * F];
    int64_t r = 0;
    for (int64_t g = 0; g < G8; g++)
        for (int64_t i = 0; i < COUNTS[g]; i++, r++)
            for (int64_t f = 0; f < F; f++) {
                double a = 0, b = 0;
                for (int64_t k = 0; k < K; k++) {
                    a += hx[r * K + k] * hg[(g * K + k) * F + f];
                    b += hx[r * K + k] * hu[(g * K + k) * F + f];
                }
                ref[r * F + f] = a / (1 + exp(-a)) * b;
            }
    tt_assert_close_host(ctx, h, ref, 1e-13, 1e-12);
    free(hx), free(hg), free(hu);
    tm_ctx_free(ctx);
}

/* ---- against the composition ----------------------------------------------------------------- */

typedef struct {
    tm_dtype dt;
    int64_t K, F;
    int want;      /* bit i: input i (x, w_gate, w_up) needs a gradient */
    int x_first;   /* x's other use (x @ m) runs before the op: its backward runs after, so the
                    * op writes x's gradient fresh; 0: after, so the op adds to it */
    int shared_w;  /* w_up is w_gate (one tensor as both weights) */
} gsw_case;

typedef struct {
    double *h, *dx, *dwg, *dwu;
} gsw_result;

/* y = op(x, w_gate, w_up) + x @ m, backward with a random dy; fused: tm_grouped_swiglu, else
 * the composition. Each run in its own context from the same seeds. */
static gsw_result run_case(const gsw_case *tc, int fused) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {R14, tc->K}, ws[3] = {G8, tc->K, tc->F}, ms[2] = {tc->K, tc->F}, ys[2] = {R14, tc->F};
    tm_tensor *x = tt_randn(ctx, tc->dt, 2, xs, 11), *wg = tt_randn(ctx, tc->dt, 3, ws, 12);
    tm_tensor *wu = tc->shared_w ? wg : tt_randn(ctx, tc->dt, 3, ws, 13);
    tm_tensor *m = tt_randn(ctx, tc->dt, 2, ms, 14), *dy = tt_randn(ctx, tc->dt, 2, ys, 15);
    tm_tensor *counts = counts_tensor(ctx, G8, COUNTS), *h, *p = NULL, *y;
    tm_tensor *in[3] = {x, wg, wu};
    for (int i = 0; i < 3; i++)
        if (tc->want >> i & 1) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, in[i], 1));
    if (tc->x_first) TT_OK(ctx, tm_matmul(ctx, x, m, 0, 0, &p));
    if (fused) {
        TT_OK(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts, &h));
    } else {
        tm_tensor *a, *b;
        TT_OK(ctx, tm_grouped_matmul(ctx, x, wg, counts, &a));
        TT_OK(ctx, tm_grouped_matmul(ctx, x, wu, counts, &b));
        TT_OK(ctx, tm_swiglu(ctx, a, b, &h));
    }
    cr_assert_eq(tm_tensor_dtype(h), tc->dt);
    if (!tc->x_first) TT_OK(ctx, tm_matmul(ctx, x, m, 0, 0, &p));
    TT_OK(ctx, tm_add(ctx, h, p, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, dy));
    gsw_result r = {tt_read(ctx, h), NULL, NULL, NULL};
    if (tc->want & 1) r.dx = tt_read(ctx, tm_tensor_grad(x));
    if (tc->want & 2) r.dwg = tt_read(ctx, tm_tensor_grad(wg));
    if ((tc->want & 4) && !tc->shared_w) r.dwu = tt_read(ctx, tm_tensor_grad(wu));
    tm_ctx_free(ctx);
    return r;
}

static void assert_same_bits(const double *got, const double *want, int64_t n, const char *what, const gsw_case *tc) {
    cr_assert((got == NULL) == (want == NULL), "%s: present in one run only", what);
    if (!got) return;
    for (int64_t i = 0; i < n; i++)
        cr_assert(memcmp(&got[i], &want[i], sizeof *got) == 0,
                  "%s[%lld]: grouped_swiglu %.17g, composition %.17g (%s, K %lld, F %lld, want %d, x_first %d, "
                  "shared_w %d)", what, (long long)i, got[i], want[i], tm_dtype_name(tc->dt), (long long)tc->K,
                  (long long)tc->F, tc->want, tc->x_first, tc->shared_w);
}

/* The op runs the composition's kernels in its order, and on the CPU rounds bf16 at the points
 * where the composition stores bf16 tensors (a, b, da, db, dx between the two projections'
 * contributions): every dtype, bf16 included, must give the composition's bits, not merely
 * close values. Values are read as f64 (exact for every dtype), compared bit for bit, so a
 * zero's sign counts too. */
static void check_against_composition(const gsw_case *tc) {
    gsw_result f = run_case(tc, 1), c = run_case(tc, 0);
    int64_t nh = R14 * tc->F, nx = R14 * tc->K, nw = G8 * tc->K * tc->F;
    assert_same_bits(f.h, c.h, nh, "h", tc);
    assert_same_bits(f.dx, c.dx, nx, "dx", tc);
    assert_same_bits(f.dwg, c.dwg, nw, "dw_gate", tc);
    assert_same_bits(f.dwu, c.dwu, nw, "dw_up", tc);
    /* the values are not all zero (a vacuous comparison): h and each wanted gradient */
    double s = 0;
    for (int64_t i = 0; i < nh; i++) s += fabs(f.h[i]);
    cr_assert_gt(s, 0.0);
    free(f.h), free(f.dx), free(f.dwg), free(f.dwu), free(c.h), free(c.dx), free(c.dwg), free(c.dwu);
}

static void check_dtype(tm_dtype dt, int64_t K, int64_t F) {
    for (int x_first = 0; x_first < 2; x_first++) {
        gsw_case tc = {dt, K, F, 7, x_first, 0};
        check_against_composition(&tc);
    }
    /* each subset of wanted gradients (x's other use keeps one always) */
    for (int want = 1; want < 7; want++) {
        gsw_case tc = {dt, K, F, want, 0, 0};
        check_against_composition(&tc);
    }
    gsw_case shared = {dt, K, F, 7, 1, 1};
    check_against_composition(&shared);
}

/* K = 37 > the blocked GEMM's inner block in no dtype, but over several SIMD widths; the bf16
 * shapes are the MoE's (multiples of 8). */
Test(grouped_swiglu, same_bits_as_composition_f64) { check_dtype(TM_F64, 7, 5); }
Test(grouped_swiglu, same_bits_as_composition_f32) { check_dtype(TM_F32, 37, 11); }
Test(grouped_swiglu, same_bits_as_composition_bf16) { check_dtype(TM_BF16, 16, 24); }
Test(grouped_swiglu, same_bits_as_composition_bf16_odd) { check_dtype(TM_BF16, 13, 6); }

/* The empty groups' weight gradients are exactly zero: no GEMM touches them. */
Test(grouped_swiglu, empty_groups_weight_grads_zero) {
    tm_ctx *ctx = tt_ctx();
    enum { K = 4, F = 3 };
    int64_t xs[2] = {R14, K}, ws[3] = {G8, K, F}, ys[2] = {R14, F};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *wg = tt_randn(ctx, TM_F32, 3, ws, 2);
    tm_tensor *wu = tt_randn(ctx, TM_F32, 3, ws, 3), *h;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, wg, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, wu, 1));
    TT_OK(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts_tensor(ctx, G8, COUNTS), &h));
    TT_OK(ctx, tm_backward_with_grad(ctx, h, tt_randn(ctx, TM_F32, 2, ys, 4)));
    double *dg = tt_read(ctx, tm_tensor_grad(wg)), *du = tt_read(ctx, tm_tensor_grad(wu));
    double sg = 0, su = 0;
    for (int64_t g = 0; g < G8; g++)
        for (int64_t i = 0; i < K * F; i++) {
            double vg = dg[g * K * F + i], vu = du[g * K * F + i];
            if (COUNTS[g]) {
                sg += fabs(vg), su += fabs(vu);
                continue;
            }
            cr_assert_eq(vg, 0.0, "dw_gate of empty group %lld", (long long)g);
            cr_assert_eq(vu, 0.0, "dw_up of empty group %lld", (long long)g);
        }
    cr_assert(sg > 0 && su > 0, "the non-empty groups got no gradient");
    free(dg), free(du);
    tm_ctx_free(ctx);
}

/* ---- finite differences ---------------------------------------------------------------------- */

static tm_status gsw_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_grouped_swiglu(ctx, in[0], in[1], in[2], in[3], out);
}

double tt_gradcase_grouped_swiglu(tm_ctx *ctx);
double tt_gradcase_grouped_swiglu(tm_ctx *ctx) {
    /* 4 groups of {3, 0, 5, 1} rows: an empty group in the middle, a one-row group last. */
    int64_t counts[4] = {3, 0, 5, 1};
    int64_t xs[2] = {9, 5}, ws[3] = {4, 5, 3};
    tm_tensor *in[4] = {tt_randn(ctx, TM_F64, 2, xs, 31), tt_randn(ctx, TM_F64, 3, ws, 32),
                        tt_randn(ctx, TM_F64, 3, ws, 33), counts_tensor(ctx, 4, counts)};
    int check[4] = {1, 1, 1, 0};
    return tt_gradcheck(ctx, gsw_fn, NULL, 4, in, check, 1e-6, 1e-7, 1e-6);
}

Test(grouped_swiglu, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_grouped_swiglu(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

/* ---- errors ---------------------------------------------------------------------------------- */

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, "grouped_swiglu"), "message lacks the op name: %s", msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

Test(grouped_swiglu, bad_operands) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {6, 4}, ws[3] = {3, 4, 5}, wk[3] = {3, 7, 5}, wf[3] = {3, 4, 6}, w2[2] = {4, 5};
    int64_t ok[3] = {1, 2, 3};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *cnt = counts_tensor(ctx, 3, ok), *out = NULL;
    tm_tensor *w = tt_randn(ctx, TM_F32, 3, ws, 2), *w64 = tt_randn(ctx, TM_F64, 3, ws, 3);
    tm_tensor *wbadk = tt_randn(ctx, TM_F32, 3, wk, 4), *wbadf = tt_randn(ctx, TM_F32, 3, wf, 5);
    tm_tensor *wflat = tt_randn(ctx, TM_F32, 2, w2, 6), *xi = tt_randint(ctx, TM_I32, 2, xs, 7, 3);
    tm_tensor *x3 = tt_randn(ctx, TM_F32, 3, ws, 8);

    assert_err(ctx, tm_grouped_swiglu(ctx, x, w64, w, cnt, &out), TM_ERR_DTYPE, "w_gate f64[3,4,5]", "x f32[6,4]");
    assert_err(ctx, tm_grouped_swiglu(ctx, x, w, w64, cnt, &out), TM_ERR_DTYPE, "w_up f64[3,4,5]", "x f32[6,4]");
    assert_err(ctx, tm_grouped_swiglu(ctx, x, w, wbadf, cnt, &out), TM_ERR_SHAPE, "w_gate f32[3,4,5]",
               "w_up f32[3,4,6]");
    assert_err(ctx, tm_grouped_swiglu(ctx, x, wbadk, wbadk, cnt, &out), TM_ERR_SHAPE, "f32[3,7,5]", "f32[6,4]");
    assert_err(ctx, tm_grouped_swiglu(ctx, x, wflat, w, cnt, &out), TM_ERR_SHAPE, "w_gate", "f32[4,5]");
    assert_err(ctx, tm_grouped_swiglu(ctx, x, w, wflat, cnt, &out), TM_ERR_SHAPE, "w_up f32[4,5]", NULL);
    assert_err(ctx, tm_grouped_swiglu(ctx, xi, w, w, cnt, &out), TM_ERR_DTYPE, "i32[6,4]", NULL);
    assert_err(ctx, tm_grouped_swiglu(ctx, x3, w, w, cnt, &out), TM_ERR_SHAPE, "x must be [R,K]", "f32[3,4,5]");
    cr_assert_null(out, "out was set by a failed call");
    tm_ctx_free(ctx);
}

Test(grouped_swiglu, bad_counts) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {6, 4}, ws[3] = {3, 4, 5};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *wg = tt_randn(ctx, TM_F32, 3, ws, 2);
    tm_tensor *wu = tt_randn(ctx, TM_F32, 3, ws, 3), *out = NULL;
    int64_t short_sum[3] = {2, 1, 2}, long_sum[3] = {2, 4, 3}, neg[3] = {4, -2, 4}, two[2] = {3, 3};
    int64_t ok[3] = {1, 2, 3};
    double okv[3] = {1, 2, 3};

    assert_err(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts_tensor(ctx, 3, short_sum), &out), TM_ERR_SHAPE,
               "counts sum to 5", "6 rows");
    assert_err(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts_tensor(ctx, 3, long_sum), &out), TM_ERR_SHAPE,
               "group 2", "counts[2] = 3");
    assert_err(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts_tensor(ctx, 3, neg), &out), TM_ERR_INVALID_ARG,
               "counts[1] = -2", "negative");
    assert_err(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts_tensor(ctx, 2, two), &out), TM_ERR_SHAPE, "i64[2]",
               "f32[3,4,5]");
    assert_err(ctx, tm_grouped_swiglu(ctx, x, wg, wu, tt_from(ctx, TM_I32, 1, (int64_t[]){3}, okv), &out),
               TM_ERR_DTYPE, "i32[3]", NULL);
    cr_assert_null(out, "out was set by a failed call");
    /* the same counts, valid, go through */
    TT_OK(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts_tensor(ctx, 3, ok), &out));
    tm_ctx_free(ctx);
}
