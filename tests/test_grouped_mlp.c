/*
 * test_grouped_mlp.c — tm_grouped_mlp: forward against a naive loop in f64; forward and every
 * gradient against the composition it replaces, tm_grouped_matmul(tm_grouped_swiglu(x, w_gate,
 * w_up), w_down), bit for bit in f64, f32 and bf16, with ragged counts and empty groups, x's
 * gradient fresh and added to, each subset of wanted gradients, one tensor as several weights;
 * grad mode off; finite differences; bad operands and counts, named in the messages.
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

Test(grouped_mlp, forward_f64_against_loop) {
    tm_ctx *ctx = tt_ctx();
    enum { K = 7, F = 5, N = 6 };
    int64_t xs[2] = {R14, K}, ws[3] = {G8, K, F}, ds[3] = {G8, F, N};
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, xs, 1), *wg = tt_randn(ctx, TM_F64, 3, ws, 2);
    tm_tensor *wu = tt_randn(ctx, TM_F64, 3, ws, 3), *wd = tt_randn(ctx, TM_F64, 3, ds, 4), *y;
    TT_OK(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts_tensor(ctx, G8, COUNTS), &y));
    cr_assert_eq(tm_tensor_dim(y, 0), R14);
    cr_assert_eq(tm_tensor_dim(y, 1), N);
    cr_assert_eq(tm_tensor_dtype(y), TM_F64);
    double *hx = tt_read(ctx, x), *hg = tt_read(ctx, wg), *hu = tt_read(ctx, wu), *hd = tt_read(ctx, wd);
    double ref[R14 * N];
    int64_t r = 0;
    for (int64_t g = 0; g < G8; g++)
        for (int64_t i = 0; i < COUNTS[g]; i++, r++) {
            double h[F];
            for (int64_t f = 0; f < F; f++) {
                double a = 0, b = 0;
                for (int64_t k = 0; k < K; k++) {
                    a += hx[r * K + k] * hg[(g * K + k) * F + f];
                    b += hx[r * K + k] * hu[(g * K + k) * F + f];
                }
                h[f] = a / (1 + exp(-a)) * b;
            }
            for (int64_t n = 0; n < N; n++) {
                double s = 0;
                for (int64_t f = 0; f < F; f++) s += h[f] * hd[(g * F + f) * N + n];
                ref[r * N + n] = s;
            }
        }
    tt_assert_close_host(ctx, y, ref, 1e-12, 1e-12);
    free(hx), free(hg), free(hu), free(hd);
    tm_ctx_free(ctx);
}

/* ---- against the composition ----------------------------------------------------------------- */

typedef struct {
    tm_dtype dt;
    int64_t K, F, N;
    int want;      /* bit i: input i (x, w_gate, w_up, w_down) needs a gradient */
    int x_first;   /* x's other use (x @ m) runs before the op: its backward runs after, so the
                    * op writes x's gradient fresh; 0: after, so the op adds to it */
    int shared;    /* 1: w_up is w_gate; 2: w_down is w_gate too (K = F = N) */
} gmlp_case;

typedef struct {
    double *y, *dx, *dwg, *dwu, *dwd;
} gmlp_result;

/* y = op(x, w_gate, w_up, w_down) + x @ m, backward with a random dy; fused: tm_grouped_mlp, else
 * the composition. Each run in its own context from the same seeds. */
static gmlp_result run_case(const gmlp_case *tc, int fused) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {R14, tc->K}, ws[3] = {G8, tc->K, tc->F}, ds[3] = {G8, tc->F, tc->N};
    int64_t ms[2] = {tc->K, tc->N}, ys[2] = {R14, tc->N};
    tm_tensor *x = tt_randn(ctx, tc->dt, 2, xs, 11), *wg = tt_randn(ctx, tc->dt, 3, ws, 12);
    tm_tensor *wu = tc->shared ? wg : tt_randn(ctx, tc->dt, 3, ws, 13);
    tm_tensor *wd = tc->shared == 2 ? wg : tt_randn(ctx, tc->dt, 3, ds, 16);
    tm_tensor *m = tt_randn(ctx, tc->dt, 2, ms, 14), *dy = tt_randn(ctx, tc->dt, 2, ys, 15);
    tm_tensor *counts = counts_tensor(ctx, G8, COUNTS), *y0, *p = NULL, *y;
    tm_tensor *in[4] = {x, wg, wu, wd};
    for (int i = 0; i < 4; i++)
        if (tc->want >> i & 1) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, in[i], 1));
    if (tc->x_first) TT_OK(ctx, tm_matmul(ctx, x, m, 0, 0, &p));
    if (fused) {
        TT_OK(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts, &y0));
    } else {
        tm_tensor *h;
        TT_OK(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts, &h));
        TT_OK(ctx, tm_grouped_matmul(ctx, h, wd, counts, &y0));
    }
    cr_assert_eq(tm_tensor_dtype(y0), tc->dt);
    /* allocations between the forward and the backward: saved tensors the op failed to keep
     * would be handed out again here and overwritten */
    if (!tc->x_first) TT_OK(ctx, tm_matmul(ctx, x, m, 0, 0, &p));
    TT_OK(ctx, tm_add(ctx, y0, p, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, dy));
    gmlp_result r = {tt_read(ctx, y0), NULL, NULL, NULL, NULL};
    if (tc->want & 1) r.dx = tt_read(ctx, tm_tensor_grad(x));
    if (tc->want & 2) r.dwg = tt_read(ctx, tm_tensor_grad(wg));
    if ((tc->want & 4) && !tc->shared) r.dwu = tt_read(ctx, tm_tensor_grad(wu));
    if ((tc->want & 8) && tc->shared != 2) r.dwd = tt_read(ctx, tm_tensor_grad(wd));
    tm_ctx_free(ctx);
    return r;
}

static void assert_same_bits(const double *got, const double *want, int64_t n, const char *what, const gmlp_case *tc) {
    cr_assert((got == NULL) == (want == NULL), "%s: present in one run only", what);
    if (!got) return;
    for (int64_t i = 0; i < n; i++)
        cr_assert(memcmp(&got[i], &want[i], sizeof *got) == 0,
                  "%s[%lld]: grouped_mlp %.17g, composition %.17g (%s, K %lld, F %lld, N %lld, want %d, x_first %d, "
                  "shared %d)", what, (long long)i, got[i], want[i], tm_dtype_name(tc->dt), (long long)tc->K,
                  (long long)tc->F, (long long)tc->N, tc->want, tc->x_first, tc->shared);
}

static double sum_abs(const double *v, int64_t n) {
    double s = 0;
    for (int64_t i = 0; v && i < n; i++) s += fabs(v[i]);
    return s;
}

/* The op runs the composition's kernels in its order, and on the CPU rounds bf16 at the points
 * where the composition stores bf16 tensors (a, b, h, dh, da, db, dx between the projections'
 * contributions, a weight gradient shared between them): every dtype, bf16 included, must give
 * the composition's bits, not merely close values. Values are read as f64 (exact for every
 * dtype), compared bit for bit, so a zero's sign counts too. */
static void check_against_composition(const gmlp_case *tc) {
    gmlp_result f = run_case(tc, 1), c = run_case(tc, 0);
    int64_t ny = R14 * tc->N, nx = R14 * tc->K, nw = G8 * tc->K * tc->F, nd = G8 * tc->F * tc->N;
    assert_same_bits(f.y, c.y, ny, "y", tc);
    assert_same_bits(f.dx, c.dx, nx, "dx", tc);
    assert_same_bits(f.dwg, c.dwg, tc->shared == 2 ? nd : nw, "dw_gate", tc);
    assert_same_bits(f.dwu, c.dwu, nw, "dw_up", tc);
    assert_same_bits(f.dwd, c.dwd, nd, "dw_down", tc);
    /* not a vacuous comparison: y and each gradient read are not all zero */
    cr_assert_gt(sum_abs(f.y, ny), 0.0);
    if (f.dx) cr_assert_gt(sum_abs(f.dx, nx), 0.0);
    if (f.dwg) cr_assert_gt(sum_abs(f.dwg, nw), 0.0);
    if (f.dwu) cr_assert_gt(sum_abs(f.dwu, nw), 0.0);
    if (f.dwd) cr_assert_gt(sum_abs(f.dwd, nd), 0.0);
    free(f.y), free(f.dx), free(f.dwg), free(f.dwu), free(f.dwd);
    free(c.y), free(c.dx), free(c.dwg), free(c.dwu), free(c.dwd);
}

static void check_dtype(tm_dtype dt, int64_t K, int64_t F, int64_t N) {
    for (int x_first = 0; x_first < 2; x_first++) {
        gmlp_case tc = {dt, K, F, N, 15, x_first, 0};
        check_against_composition(&tc);
    }
    /* each subset of wanted gradients: w_down's alone needs no dh, the others need it but not
     * dw_down (x's other use keeps the sum differentiable whatever the subset) */
    for (int want = 1; want < 15; want++) {
        gmlp_case tc = {dt, K, F, N, want, 0, 0};
        check_against_composition(&tc);
    }
    gmlp_case shared = {dt, K, F, N, 15, 1, 1};
    check_against_composition(&shared);
}

/* K = 37 > the blocked GEMM's inner block in no dtype, but over several SIMD widths; the bf16
 * shapes are the MoE's (multiples of 8), and odd ones. */
Test(grouped_mlp, same_bits_as_composition_f64) { check_dtype(TM_F64, 7, 5, 6); }
Test(grouped_mlp, same_bits_as_composition_f32) { check_dtype(TM_F32, 37, 11, 9); }
Test(grouped_mlp, same_bits_as_composition_bf16) { check_dtype(TM_BF16, 16, 24, 8); }
Test(grouped_mlp, same_bits_as_composition_bf16_odd) { check_dtype(TM_BF16, 13, 6, 5); }

/* One tensor as all three weights (K = F = N): w_down's gradient is w_gate's and w_up's, so the
 * down projection's contribution is stored (bf16: rounded) before the SwiGLU's add to it. */
Test(grouped_mlp, one_tensor_as_every_weight) {
    const tm_dtype dts[3] = {TM_F64, TM_F32, TM_BF16};
    for (int i = 0; i < 3; i++) {
        for (int want = 14; want <= 15; want++) {
            gmlp_case tc = {dts[i], 8, 8, 8, want, 1, 2};
            check_against_composition(&tc);
        }
    }
}

/* The empty groups' weight gradients are exactly zero: no GEMM touches them. */
Test(grouped_mlp, empty_groups_weight_grads_zero) {
    tm_ctx *ctx = tt_ctx();
    enum { K = 4, F = 3, N = 5 };
    int64_t xs[2] = {R14, K}, ws[3] = {G8, K, F}, ds[3] = {G8, F, N}, ys[2] = {R14, N};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *w[3] = {tt_randn(ctx, TM_F32, 3, ws, 2),
                                                            tt_randn(ctx, TM_F32, 3, ws, 3),
                                                            tt_randn(ctx, TM_F32, 3, ds, 4)};
    for (int i = 0; i < 3; i++) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w[i], 1));
    tm_tensor *y;
    TT_OK(ctx, tm_grouped_mlp(ctx, x, w[0], w[1], w[2], counts_tensor(ctx, G8, COUNTS), &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, tt_randn(ctx, TM_F32, 2, ys, 5)));
    for (int i = 0; i < 3; i++) {
        double *d = tt_read(ctx, tm_tensor_grad(w[i])), s = 0;
        int64_t per = tm_tensor_dim(w[i], 1) * tm_tensor_dim(w[i], 2);
        for (int64_t g = 0; g < G8; g++)
            for (int64_t e = 0; e < per; e++) {
                double v = d[g * per + e];
                if (COUNTS[g]) {
                    s += fabs(v);
                    continue;
                }
                cr_assert_eq(v, 0.0, "weight %d: gradient of empty group %lld", i, (long long)g);
            }
        cr_assert_gt(s, 0.0, "weight %d: the non-empty groups got no gradient", i);
        free(d);
    }
    tm_ctx_free(ctx);
}

/* With grad mode off nothing is recorded (the saved tensors go back at once): the same values. */
Test(grouped_mlp, grad_mode_off_same_values) {
    tm_ctx *ctx = tt_ctx();
    enum { K = 6, F = 4, N = 3 };
    int64_t xs[2] = {R14, K}, ws[3] = {G8, K, F}, ds[3] = {G8, F, N};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *wg = tt_randn(ctx, TM_F32, 3, ws, 2);
    tm_tensor *wu = tt_randn(ctx, TM_F32, 3, ws, 3), *wd = tt_randn(ctx, TM_F32, 3, ds, 4);
    tm_tensor *counts = counts_tensor(ctx, G8, COUNTS), *y1, *y2;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, wd, 1));
    TT_OK(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts, &y1));
    int prev = tm_ctx_set_grad_enabled(ctx, 0);
    TT_OK(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts, &y2));
    tm_ctx_set_grad_enabled(ctx, prev);
    double *a = tt_read(ctx, y1), *b = tt_read(ctx, y2);
    cr_assert(memcmp(a, b, sizeof(double) * R14 * N) == 0, "grad mode changed the values");
    free(a), free(b);
    tm_ctx_free(ctx);
}

/* ---- finite differences ---------------------------------------------------------------------- */

static tm_status gmlp_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_grouped_mlp(ctx, in[0], in[1], in[2], in[3], in[4], out);
}

double tt_gradcase_grouped_mlp(tm_ctx *ctx);
double tt_gradcase_grouped_mlp(tm_ctx *ctx) {
    /* 4 groups of {3, 0, 5, 1} rows: an empty group in the middle, a one-row group last. */
    int64_t counts[4] = {3, 0, 5, 1};
    int64_t xs[2] = {9, 5}, ws[3] = {4, 5, 3}, ds[3] = {4, 3, 4};
    tm_tensor *in[5] = {tt_randn(ctx, TM_F64, 2, xs, 31), tt_randn(ctx, TM_F64, 3, ws, 32),
                        tt_randn(ctx, TM_F64, 3, ws, 33), tt_randn(ctx, TM_F64, 3, ds, 34),
                        counts_tensor(ctx, 4, counts)};
    int check[5] = {1, 1, 1, 1, 0};
    return tt_gradcheck(ctx, gmlp_fn, NULL, 5, in, check, 1e-6, 1e-7, 1e-6);
}

Test(grouped_mlp, gradcheck) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_grouped_mlp(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

/* ---- errors ---------------------------------------------------------------------------------- */

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, "grouped_mlp"), "message lacks the op name: %s", msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

Test(grouped_mlp, bad_operands) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {6, 4}, ws[3] = {3, 4, 5}, wk[3] = {3, 7, 5}, wf[3] = {3, 4, 6}, w2[2] = {4, 5};
    int64_t ds[3] = {3, 5, 2}, dsf[3] = {3, 4, 2}, dsg[3] = {2, 5, 2};
    int64_t ok[3] = {1, 2, 3};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *cnt = counts_tensor(ctx, 3, ok), *out = NULL;
    tm_tensor *w = tt_randn(ctx, TM_F32, 3, ws, 2), *w64 = tt_randn(ctx, TM_F64, 3, ws, 3);
    tm_tensor *wbadk = tt_randn(ctx, TM_F32, 3, wk, 4), *wbadf = tt_randn(ctx, TM_F32, 3, wf, 5);
    tm_tensor *wflat = tt_randn(ctx, TM_F32, 2, w2, 6), *xi = tt_randint(ctx, TM_I32, 2, xs, 7, 3);
    tm_tensor *x3 = tt_randn(ctx, TM_F32, 3, ws, 8), *wd = tt_randn(ctx, TM_F32, 3, ds, 9);
    tm_tensor *wd64 = tt_randn(ctx, TM_F64, 3, ds, 10), *wdbadf = tt_randn(ctx, TM_F32, 3, dsf, 11);
    tm_tensor *wdbadg = tt_randn(ctx, TM_F32, 3, dsg, 12), *wdflat = tt_randn(ctx, TM_F32, 2, w2, 13);
    tm_tensor *x64 = tt_randn(ctx, TM_F64, 2, xs, 14);

    assert_err(ctx, tm_grouped_mlp(ctx, x, w64, w, wd, cnt, &out), TM_ERR_DTYPE, "w_gate f64[3,4,5]", "x f32[6,4]");
    assert_err(ctx, tm_grouped_mlp(ctx, x, w, w64, wd, cnt, &out), TM_ERR_DTYPE, "w_up f64[3,4,5]", "x f32[6,4]");
    assert_err(ctx, tm_grouped_mlp(ctx, x, w, w, wd64, cnt, &out), TM_ERR_DTYPE, "w_down f64[3,5,2]", "x f32[6,4]");
    assert_err(ctx, tm_grouped_mlp(ctx, x64, w, w, wd, cnt, &out), TM_ERR_DTYPE, "x f64[6,4]", "w_down f32[3,5,2]");
    assert_err(ctx, tm_grouped_mlp(ctx, x, w, wbadf, wd, cnt, &out), TM_ERR_SHAPE, "w_gate f32[3,4,5]",
               "w_up f32[3,4,6]");
    assert_err(ctx, tm_grouped_mlp(ctx, x, wbadk, wbadk, wd, cnt, &out), TM_ERR_SHAPE, "f32[3,7,5]", "f32[6,4]");
    assert_err(ctx, tm_grouped_mlp(ctx, x, wflat, w, wd, cnt, &out), TM_ERR_SHAPE, "w_gate", "f32[4,5]");
    assert_err(ctx, tm_grouped_mlp(ctx, x, w, wflat, wd, cnt, &out), TM_ERR_SHAPE, "w_up f32[4,5]", NULL);
    /* w_down must be [G,F,N] with w_gate's G and F */
    assert_err(ctx, tm_grouped_mlp(ctx, x, w, w, wdbadf, cnt, &out), TM_ERR_SHAPE, "w_down f32[3,4,2]",
               "must be [3,5,N]");
    assert_err(ctx, tm_grouped_mlp(ctx, x, w, w, wdbadg, cnt, &out), TM_ERR_SHAPE, "w_down f32[2,5,2]",
               "w_gate f32[3,4,5]");
    assert_err(ctx, tm_grouped_mlp(ctx, x, w, w, wdflat, cnt, &out), TM_ERR_SHAPE, "w_down f32[4,5]", NULL);
    assert_err(ctx, tm_grouped_mlp(ctx, xi, w, w, wd, cnt, &out), TM_ERR_DTYPE, "i32[6,4]", NULL);
    assert_err(ctx, tm_grouped_mlp(ctx, x, w, w, xi, cnt, &out), TM_ERR_DTYPE, "i32[6,4]", NULL);
    assert_err(ctx, tm_grouped_mlp(ctx, x3, w, w, wd, cnt, &out), TM_ERR_SHAPE, "x must be [R,K]", "f32[3,4,5]");
    cr_assert_null(out, "out was set by a failed call");
    /* the same operands, valid, go through: y [R,N] */
    TT_OK(ctx, tm_grouped_mlp(ctx, x, w, w, wd, cnt, &out));
    cr_assert_eq(tm_tensor_dim(out, 0), 6);
    cr_assert_eq(tm_tensor_dim(out, 1), 2);
    tm_ctx_free(ctx);
}

Test(grouped_mlp, bad_counts) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {6, 4}, ws[3] = {3, 4, 5}, ds[3] = {3, 5, 2};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1), *wg = tt_randn(ctx, TM_F32, 3, ws, 2);
    tm_tensor *wu = tt_randn(ctx, TM_F32, 3, ws, 3), *wd = tt_randn(ctx, TM_F32, 3, ds, 4), *out = NULL;
    int64_t short_sum[3] = {2, 1, 2}, long_sum[3] = {2, 4, 3}, neg[3] = {4, -2, 4}, two[2] = {3, 3};
    int64_t ok[3] = {1, 2, 3};
    double okv[3] = {1, 2, 3};

    assert_err(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts_tensor(ctx, 3, short_sum), &out), TM_ERR_SHAPE,
               "counts sum to 5", "6 rows");
    assert_err(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts_tensor(ctx, 3, long_sum), &out), TM_ERR_SHAPE,
               "group 2", "counts[2] = 3");
    assert_err(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts_tensor(ctx, 3, neg), &out), TM_ERR_INVALID_ARG,
               "counts[1] = -2", "negative");
    assert_err(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts_tensor(ctx, 2, two), &out), TM_ERR_SHAPE, "i64[2]",
               "f32[3,4,5]");
    assert_err(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, tt_from(ctx, TM_I32, 1, (int64_t[]){3}, okv), &out),
               TM_ERR_DTYPE, "i32[3]", NULL);
    cr_assert_null(out, "out was set by a failed call");
    TT_OK(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts_tensor(ctx, 3, ok), &out));
    tm_ctx_free(ctx);
}

/* tm_ctx_kernel_report on a CPU context: every count 0 (no CUDA kernel ran) even with the Hopper
 * path asked for and the ops that would take it on CUDA run; NULL arguments are errors. (On
 * CUDA, tests/test_cuda_parity_grouped_mlp.c checks its counts against the launches.) */
Test(grouped_mlp, kernel_report_on_the_cpu) {
    tm_ctx_options o = tm_ctx_options_default();
    o.grouped_gemm = TM_GROUPED_GEMM_HOPPER;
    tm_ctx *ctx;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK);
    int64_t xs[2] = {R14, 16}, ws[3] = {G8, 16, 24}, ds[3] = {G8, 24, 8};
    tm_tensor *x = tt_randn(ctx, TM_BF16, 2, xs, 1), *wg = tt_randn(ctx, TM_BF16, 3, ws, 2);
    tm_tensor *wu = tt_randn(ctx, TM_BF16, 3, ws, 3), *wd = tt_randn(ctx, TM_BF16, 3, ds, 4), *y, *l;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts_tensor(ctx, G8, COUNTS), &y));
    TT_OK(ctx, tm_sum_all(ctx, y, &l));
    TT_OK(ctx, tm_backward(ctx, l));
    tm_kernel_report kr;
    memset(&kr, 0xab, sizeof kr);
    TT_OK(ctx, tm_ctx_kernel_report(ctx, &kr));
    cr_assert(kr.grouped_gemm == 0 && kr.grouped_swiglu_fused == 0 && kr.grouped_mlp_fused == 0 &&
              kr.attention_sm90 == 0 && kr.gating_split == 0 && kr.grouped_gemm_note[0] == 0,
              "a CPU context reported CUDA kernels");
    cr_assert_eq(tm_ctx_kernel_report(ctx, NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "tm_ctx_kernel_report"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_ctx_kernel_report(NULL, &kr), TM_ERR_INVALID_ARG);
    tm_ctx_free(ctx);
}
