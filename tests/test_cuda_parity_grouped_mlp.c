/*
 * test_cuda_parity_grouped_mlp.c — tm_grouped_mlp on CUDA against the composition it replaces
 * (tm_grouped_matmul of tm_grouped_swiglu) on CUDA. The parity against the CPU of the generic
 * harness is a CASES row of tests/test_cuda_parity.c; here:
 *  - on each grouped_gemm path (cuBLASLt, f32 and bf16; the device-scheduled bf16 kernel; the
 *    Hopper kernel), the op's output and the gradients of x, w_gate, w_up and w_down are the
 *    composition's bits (the same kernels, in the composition's order), with x's gradient written
 *    fresh and added to, and with only some gradients wanted;
 *  - with the fused backward on (tm__grouped_mlp_set_fused; off by default: slower), bf16 under
 *    TM_GROUPED_GEMM_HOPPER on an sm_90 device takes DX_SWIGLU (the down projection's dx with
 *    SwiGLU's backward in its epilogue) and must still give the composition's bits; it must not
 *    run where the shapes rule the Hopper kernel out, on the other paths, or with the flag off;
 *  - on every path the op waits for the device no more often than the composition
 *    (tm_ctx_sync_count), forward and backward, on counts without a host copy.
 * Every test skips when no CUDA device is visible.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"
#include "parity.h"

static const int64_t COUNTS[8] = {0, 37, 0, 1, 60, 0, 30, 0};
enum { G8 = 8, R128 = 128 };
enum { COMPOSITION = 0, OP = 1, OP_FUSED = 2 };

typedef struct {
    double *y, *dx, *dwg, *dwu, *dwd;
    uint64_t syncs;
    uint64_t fused; /* tm__grouped_mlp_fused_launches after the backward */
} run_out;

static tm_tensor *on_cuda(tm_ctx *ctx, tm_dtype dt, int nd, const int64_t *shape, uint64_t seed) {
    int64_t n = 1;
    for (int d = 0; d < nd; d++) n *= shape[d];
    double *v = tt_parity_uniform(n, seed);
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, nd, shape, tm_cuda(0), TM_F64, v, &t));
    free(v);
    return t;
}

/* y = op(x, w_gate, w_up, w_down) + x @ m (x's other use before or after the op: its gradient is
 * written by the op, or added to), backward with a fixed dy, in a fresh context on grouped_gemm
 * path mode; want: bit i, input i (x, w_gate, w_up, w_down) needs a gradient. */
static run_out run(tm_dtype dt, int mode, int64_t K, int64_t F, int64_t N, int want, int x_first, int variant) {
    tm_ctx *ctx = tt_parity_ctx();
    tm__set_gmm_device_schedule(ctx, mode);
    cr_assert_eq(tm__grouped_mlp_fused(ctx), 0, "the fused backward is on by default");
    tm__grouped_mlp_set_fused(ctx, variant == OP_FUSED);
    int64_t xs[2] = {R128, K}, ws[3] = {G8, K, F}, ds[3] = {G8, F, N}, ms[2] = {K, N}, ys[2] = {R128, N}, g = G8;
    tm_tensor *x = on_cuda(ctx, dt, 2, xs, 1), *wg = on_cuda(ctx, dt, 3, ws, 2), *wu = on_cuda(ctx, dt, 3, ws, 3);
    tm_tensor *wd = on_cuda(ctx, dt, 3, ds, 6);
    tm_tensor *m = on_cuda(ctx, dt, 2, ms, 4), *dy = on_cuda(ctx, dt, 2, ys, 5), *counts, *y0, *p = NULL, *y;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &g, tm_cuda(0), TM_I64, COUNTS, &counts)); /* no host copy */
    tm_tensor *in[4] = {x, wg, wu, wd};
    for (int i = 0; i < 4; i++)
        if (want >> i & 1) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, in[i], 1));
    if (x_first) TT_OK(ctx, tm_matmul(ctx, x, m, 0, 0, &p));
    uint64_t s0 = tm_ctx_sync_count(ctx);
    if (variant != COMPOSITION) {
        TT_OK(ctx, tm_grouped_mlp(ctx, x, wg, wu, wd, counts, &y0));
    } else {
        tm_tensor *h;
        TT_OK(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts, &h));
        TT_OK(ctx, tm_grouped_matmul(ctx, h, wd, counts, &y0));
    }
    run_out r;
    memset(&r, 0, sizeof r);
    r.syncs = tm_ctx_sync_count(ctx) - s0;
    if (!x_first) TT_OK(ctx, tm_matmul(ctx, x, m, 0, 0, &p));
    TT_OK(ctx, tm_add(ctx, y0, p, &y));
    /* the matmul and add wait for nothing: whatever the backward adds is the grouped GEMMs' */
    s0 = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_backward_with_grad(ctx, y, dy));
    r.syncs += tm_ctx_sync_count(ctx) - s0;
    r.fused = tm__grouped_mlp_fused_launches(ctx);
    tm_kernel_report kr; /* the public report counts the same launches */
    TT_OK(ctx, tm_ctx_kernel_report(ctx, &kr));
    cr_assert_eq(kr.grouped_mlp_fused, r.fused, "tm_ctx_kernel_report: %llu fused backwards, the context counted %llu",
                 (unsigned long long)kr.grouped_mlp_fused, (unsigned long long)r.fused);
    cr_assert_eq(kr.grouped_swiglu_fused, tm__gsw_fused_launches(ctx));
    cr_assert_eq(kr.grouped_gemm, mode);
    r.y = tt_read(ctx, y0);
    if (want & 1) r.dx = tt_read(ctx, tm_tensor_grad(x));
    if (want & 2) r.dwg = tt_read(ctx, tm_tensor_grad(wg));
    if (want & 4) r.dwu = tt_read(ctx, tm_tensor_grad(wu));
    if (want & 8) r.dwd = tt_read(ctx, tm_tensor_grad(wd));
    tm_ctx_free(ctx);
    return r;
}

static void same_bits(const double *got, const double *want, int64_t n, const char *what, tm_dtype dt, int mode,
                      int variant) {
    cr_assert((got == NULL) == (want == NULL), "%s: present in one run only", what);
    for (int64_t i = 0; got && i < n; i++)
        cr_assert(memcmp(&got[i], &want[i], sizeof *got) == 0,
                  "%s[%lld] (%s, mode %d, %s): op %.17g, composition %.17g", what, (long long)i, tm_dtype_name(dt),
                  mode, variant == OP_FUSED ? "fused backward" : "composition's backward", got[i], want[i]);
}

static void free_out(run_out *r) { free(r->y), free(r->dx), free(r->dwg), free(r->dwu), free(r->dwd); }

/* want_fused: the DX_SWIGLU launches the fused variant must have made (one per backward that
 * needs dh), -1 either */
static void check(tm_dtype dt, int mode, int64_t K, int64_t F, int64_t N, int want, int x_first, int want_fused) {
    run_out c = run(dt, mode, K, F, N, want, x_first, COMPOSITION);
    cr_assert_eq(c.fused, 0, "the composition launched the fused kernel");
    for (int variant = OP; variant <= OP_FUSED; variant++) {
        run_out f = run(dt, mode, K, F, N, want, x_first, variant);
        if (variant == OP)
            cr_assert_eq(f.fused, 0, "the fused backward ran with the flag off");
        else if (want_fused >= 0)
            cr_assert_eq(f.fused, (uint64_t)want_fused, "%s, mode %d, K %lld, F %lld, N %lld, want %d: %llu fused "
                         "launches, want %d", tm_dtype_name(dt), mode, (long long)K, (long long)F, (long long)N, want,
                         (unsigned long long)f.fused, want_fused);
        same_bits(f.y, c.y, R128 * N, "y", dt, mode, variant);
        same_bits(f.dx, c.dx, R128 * K, "dx", dt, mode, variant);
        same_bits(f.dwg, c.dwg, G8 * K * F, "dw_gate", dt, mode, variant);
        same_bits(f.dwu, c.dwu, G8 * K * F, "dw_up", dt, mode, variant);
        same_bits(f.dwd, c.dwd, G8 * F * N, "dw_down", dt, mode, variant);
        cr_assert(f.syncs <= c.syncs, "%s, mode %d: the op waited %llu times, the composition %llu", tm_dtype_name(dt),
                  mode, (unsigned long long)f.syncs, (unsigned long long)c.syncs);
        free_out(&f);
    }
    free_out(&c);
}

/* Every gradient wanted, x's written fresh and added to; then subsets: w_down's alone (no dh, so
 * no fused launch), and w_gate's with w_down's (dgate used, dup not). */
static void check_all(tm_dtype dt, int mode, int64_t K, int64_t F, int64_t N, int fused) {
    check(dt, mode, K, F, N, 15, 0, fused);
    check(dt, mode, K, F, N, 15, 1, fused);
    check(dt, mode, K, F, N, 8, 0, 0);
    check(dt, mode, K, F, N, 2 | 8, 0, fused);
}

Test(cuda_parity_grouped_mlp, composition_bits_cublaslt) {
    TT_SKIP_WITHOUT_CUDA();
    check_all(TM_F32, TM_GROUPED_GEMM_CUBLASLT, 64, 48, 40, 0);
    check_all(TM_BF16, TM_GROUPED_GEMM_CUBLASLT, 64, 48, 40, 0);
    check_all(TM_BF16, TM_GROUPED_GEMM_CUBLASLT, 13, 6, 5, 0);
}

Test(cuda_parity_grouped_mlp, composition_bits_device_schedule) {
    TT_SKIP_WITHOUT_CUDA();
    check_all(TM_BF16, TM_GROUPED_GEMM_DEVICE, 64, 48, 40, 0);
    check_all(TM_BF16, TM_GROUPED_GEMM_DEVICE, 13, 6, 5, 0);
}

Test(cuda_parity_grouped_mlp, hopper_fused_bits_equal_composition) {
    TT_SKIP_WITHOUT_CUDA();
    /* the fused backward must run wherever grouped_matmul's Hopper kernel runs (an sm_90 device
     * and an sm_90a image: tm__gmm_note empty after a bf16 grouped GEMM of multiples of 8) */
    tm_ctx *probe = tt_parity_ctx();
    tm__set_gmm_device_schedule(probe, TM_GROUPED_GEMM_HOPPER);
    int64_t px[2] = {R128, 64}, pw[3] = {G8, 64, 48}, g = G8;
    tm_tensor *cnt, *y;
    TT_OK(probe, tm_tensor_from_host(probe, TM_I64, 1, &g, tm_cuda(0), TM_I64, COUNTS, &cnt));
    TT_OK(probe,
          tm_grouped_matmul(probe, on_cuda(probe, TM_BF16, 2, px, 7), on_cuda(probe, TM_BF16, 3, pw, 8), cnt, &y));
    const int hopper = tm__gmm_note(probe)[0] == 0;
    tm_ctx_free(probe);
    check_all(TM_BF16, TM_GROUPED_GEMM_HOPPER, 64, 48, 40, hopper);
    check_all(TM_BF16, TM_GROUPED_GEMM_HOPPER, 136, 200, 264, hopper); /* several 128-wide column tiles, clipped */
    check_all(TM_BF16, TM_GROUPED_GEMM_HOPPER, 16, 12, 8, 0);   /* F not a multiple of 8: never DX_SWIGLU */
    check_all(TM_BF16, TM_GROUPED_GEMM_HOPPER, 13, 6, 5, 0);    /* nothing a multiple of 8 */
    check_all(TM_F32, TM_GROUPED_GEMM_HOPPER, 64, 48, 40, 0);   /* f32: cuBLASLt, never the Hopper kernel */
}
