/*
 * test_cuda_parity_grouped_swiglu.c — tm_grouped_swiglu on CUDA against the composition it
 * replaces (tm_swiglu of two tm_grouped_matmul) on CUDA, and against the CPU op. The parity
 * against the CPU of the generic harness is a CASES row of tests/test_cuda_parity.c; here:
 *  - on each grouped_gemm path that runs the composition's kernels (cuBLASLt, f32 and bf16; the
 *    device-scheduled bf16 kernel), the op's output and the gradients of x, w_gate and w_up are
 *    the composition's bits (the same kernels, in the composition's order), with x's gradient
 *    written fresh and added to;
 *  - under TM_GROUPED_GEMM_HOPPER, where bf16 takes the one-launch kernel on an sm_90 device
 *    (FWD_SWIGLU: gate and up are FWD's sums, h swiglu.cuh's expression on their bf16 values),
 *    the same bits as the composition, which runs FWD twice and the elementwise swiglu;
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

typedef struct {
    double *h, *dx, *dwg, *dwu;
    uint64_t syncs;
    uint64_t fused; /* tm__gsw_fused_launches after the forward */
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

/* y = op(x, w_gate, w_up) + x @ m (x's other use before or after the op: its gradient is written
 * by the op, or added to), backward with a fixed dy, in a fresh context on grouped_gemm path
 * mode; fused: tm_grouped_swiglu, else the composition. */
static run_out run(tm_dtype dt, int mode, int64_t K, int64_t F, int x_first, int fused) {
    tm_ctx *ctx = tt_parity_ctx();
    tm__set_gmm_device_schedule(ctx, mode);
    int64_t xs[2] = {R128, K}, ws[3] = {G8, K, F}, ms[2] = {K, F}, ys[2] = {R128, F}, g = G8;
    tm_tensor *x = on_cuda(ctx, dt, 2, xs, 1), *wg = on_cuda(ctx, dt, 3, ws, 2), *wu = on_cuda(ctx, dt, 3, ws, 3);
    tm_tensor *m = on_cuda(ctx, dt, 2, ms, 4), *dy = on_cuda(ctx, dt, 2, ys, 5), *counts, *h, *p = NULL, *y;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &g, tm_cuda(0), TM_I64, COUNTS, &counts)); /* no host copy */
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, wg, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, wu, 1));
    if (x_first) TT_OK(ctx, tm_matmul(ctx, x, m, 0, 0, &p));
    uint64_t s0 = tm_ctx_sync_count(ctx);
    if (fused) {
        TT_OK(ctx, tm_grouped_swiglu(ctx, x, wg, wu, counts, &h));
    } else {
        tm_tensor *a, *b;
        TT_OK(ctx, tm_grouped_matmul(ctx, x, wg, counts, &a));
        TT_OK(ctx, tm_grouped_matmul(ctx, x, wu, counts, &b));
        TT_OK(ctx, tm_swiglu(ctx, a, b, &h));
    }
    run_out r;
    r.syncs = tm_ctx_sync_count(ctx) - s0;
    r.fused = tm__gsw_fused_launches(ctx);
    if (!x_first) TT_OK(ctx, tm_matmul(ctx, x, m, 0, 0, &p));
    TT_OK(ctx, tm_add(ctx, h, p, &y));
    /* the matmul and add wait for nothing: whatever the backward adds is the grouped GEMMs' */
    s0 = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_backward_with_grad(ctx, y, dy));
    r.syncs += tm_ctx_sync_count(ctx) - s0;
    r.h = tt_read(ctx, h);
    r.dx = tt_read(ctx, tm_tensor_grad(x));
    r.dwg = tt_read(ctx, tm_tensor_grad(wg));
    r.dwu = tt_read(ctx, tm_tensor_grad(wu));
    tm_ctx_free(ctx);
    return r;
}

static void compare(const double *got, const double *want, int64_t n, int bitwise, double atol, double rtol,
                    const char *what, tm_dtype dt, int mode) {
    if (bitwise) {
        for (int64_t i = 0; i < n; i++)
            cr_assert(memcmp(&got[i], &want[i], sizeof *got) == 0, "%s[%lld] (%s, mode %d): op %.17g, composition %.17g",
                      what, (long long)i, tm_dtype_name(dt), mode, got[i], want[i]);
    } else {
        double r = tt_close_ratio(got, want, n, atol, rtol);
        cr_assert(r <= 1.0, "%s (%s, mode %d): op and composition differ, ratio %g", what, tm_dtype_name(dt), mode, r);
    }
}

/* want_fused: 1 the op must have taken the one-launch kernel, 0 it must not have, -1 either */
static void check(tm_dtype dt, int mode, int64_t K, int64_t F, int bitwise, int want_fused) {
    for (int x_first = 0; x_first < 2; x_first++) {
        run_out f = run(dt, mode, K, F, x_first, 1), c = run(dt, mode, K, F, x_first, 0);
        if (want_fused >= 0)
            cr_assert_eq(f.fused, (uint64_t)want_fused, "%s, mode %d, K %lld, F %lld: %llu fused launches, want %d",
                         tm_dtype_name(dt), mode, (long long)K, (long long)F, (unsigned long long)f.fused, want_fused);
        cr_assert_eq(c.fused, 0, "the composition launched the fused kernel");
        /* the tolerances of the CASES rows (tests/test_cuda_parity.c) */
        double atol = dt == TM_BF16 ? 0.5 : 5e-4, rtol = dt == TM_BF16 ? 1e-2 : 1e-5;
        compare(f.h, c.h, R128 * F, bitwise, atol, rtol, "h", dt, mode);
        compare(f.dx, c.dx, R128 * K, bitwise, atol, rtol, "dx", dt, mode);
        compare(f.dwg, c.dwg, G8 * K * F, bitwise, atol, rtol, "dw_gate", dt, mode);
        compare(f.dwu, c.dwu, G8 * K * F, bitwise, atol, rtol, "dw_up", dt, mode);
        cr_assert(f.syncs <= c.syncs, "%s, mode %d: the op waited %llu times, the composition %llu", tm_dtype_name(dt),
                  mode, (unsigned long long)f.syncs, (unsigned long long)c.syncs);
        free(f.h), free(f.dx), free(f.dwg), free(f.dwu), free(c.h), free(c.dx), free(c.dwg), free(c.dwu);
    }
}

Test(cuda_parity_grouped_swiglu, composition_bits_cublaslt) {
    TT_SKIP_WITHOUT_CUDA();
    check(TM_F32, TM_GROUPED_GEMM_CUBLASLT, 64, 48, 1, 0);
    check(TM_BF16, TM_GROUPED_GEMM_CUBLASLT, 64, 48, 1, 0);
    check(TM_BF16, TM_GROUPED_GEMM_CUBLASLT, 13, 6, 1, 0);
}

Test(cuda_parity_grouped_swiglu, composition_bits_device_schedule) {
    TT_SKIP_WITHOUT_CUDA();
    check(TM_BF16, TM_GROUPED_GEMM_DEVICE, 64, 48, 1, 0);
    check(TM_BF16, TM_GROUPED_GEMM_DEVICE, 13, 6, 1, 0);
}

Test(cuda_parity_grouped_swiglu, hopper_fused_bits_equal_composition) {
    TT_SKIP_WITHOUT_CUDA();
    /* the fused kernel must run wherever grouped_matmul's Hopper kernel runs (an sm_90 device and
     * an sm_90a image: tm__gmm_note empty after a bf16 grouped GEMM of multiples of 8) */
    tm_ctx *probe = tt_parity_ctx();
    tm__set_gmm_device_schedule(probe, TM_GROUPED_GEMM_HOPPER);
    int64_t px[2] = {R128, 64}, pw[3] = {G8, 64, 48}, g = G8;
    tm_tensor *cnt, *y;
    TT_OK(probe, tm_tensor_from_host(probe, TM_I64, 1, &g, tm_cuda(0), TM_I64, COUNTS, &cnt));
    TT_OK(probe, tm_grouped_matmul(probe, on_cuda(probe, TM_BF16, 2, px, 7), on_cuda(probe, TM_BF16, 3, pw, 8), cnt, &y));
    const int hopper = tm__gmm_note(probe)[0] == 0;
    tm_ctx_free(probe);
    check(TM_BF16, TM_GROUPED_GEMM_HOPPER, 64, 48, 1, hopper);   /* 96 accumulator columns: 128-wide tiles */
    check(TM_BF16, TM_GROUPED_GEMM_HOPPER, 136, 200, 1, hopper); /* 400: 256-wide tiles, the last box clipped */
    check(TM_BF16, TM_GROUPED_GEMM_HOPPER, 13, 6, 1, 0);         /* K, F not multiples of 8: never the Hopper kernel */
}
