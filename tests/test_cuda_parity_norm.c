/*
 * test_cuda_parity_norm.c — add_rmsnorm (the residual add fused with RMSNorm; two outputs, so
 * not in the generic CASES of tests/test_cuda_parity.c): CUDA against the CPU, forward (the sum
 * and the norm) and backward (dx, dy, dw) with random upstream gradients for both outputs, and
 * CUDA against the unfused CUDA ops (tm_add, then tm_rmsnorm).
 *
 * Tolerances (|cuda - cpu| <= atol + rtol * |cpu|): f32 atol 1e-5, rtol 1e-5 (dw, a sum over
 * the rows, atol 1e-4); bf16 atol 1e-2, rtol 1e-2 (values near a rounding boundary may round
 * to the neighbouring bf16; dw atol 5e-2). Skipped without a GPU.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "parity.h"

TT_PARITY_COVERS("add_rmsnorm")

enum { R_S, R_H, R_DX, R_DY, R_DW, R_N };

/* Outputs and gradients of loss = sum(h * g1 + s * g2) on dev (fused: tm_add_rmsnorm; else
 * tm_add then tm_rmsnorm), as f64 host arrays. */
static void run(tm_ctx *ctx, tm_device dev, tm_dtype dt, int fused, int64_t N, int64_t C, double **r) {
    int64_t xs[2] = {N, C}, n = N * C;
    double *hv[5];
    for (int k = 0; k < 5; k++) hv[k] = tt_parity_uniform(k == 2 ? C : n, 90 + (uint64_t)k);
    tm_tensor *x, *y, *w, *g1, *g2, *s, *h, *u, *v, *l;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, xs, dev, TM_F64, hv[0], &x));
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, xs, dev, TM_F64, hv[1], &y));
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 1, &C, dev, TM_F64, hv[2], &w));
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, xs, dev, TM_F64, hv[3], &g1));
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, xs, dev, TM_F64, hv[4], &g2));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, y, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    if (fused) {
        TT_OK(ctx, tm_add_rmsnorm(ctx, x, y, w, 1e-5, &s, &h));
    } else {
        TT_OK(ctx, tm_add(ctx, x, y, &s));
        TT_OK(ctx, tm_rmsnorm(ctx, s, w, 1e-5, &h));
    }
    cr_assert_eq(tm_tensor_device(h).type, dev.type);
    TT_OK(ctx, tm_mul(ctx, h, g1, &u));
    TT_OK(ctx, tm_mul(ctx, s, g2, &v));
    TT_OK(ctx, tm_add(ctx, u, v, &l));
    TT_OK(ctx, tm_sum_all(ctx, l, &l));
    TT_OK(ctx, tm_backward(ctx, l));
    r[R_S] = tt_read(ctx, s);
    r[R_H] = tt_read(ctx, h);
    r[R_DX] = tt_read(ctx, tm_tensor_grad(x));
    r[R_DY] = tt_read(ctx, tm_tensor_grad(y));
    r[R_DW] = tt_read(ctx, tm_tensor_grad(w));
    for (int k = 0; k < 5; k++) free(hv[k]);
}

static void compare(double **a, double **b, int64_t N, int64_t C, double tol, double dw_atol, const char *what) {
    static const char *names[R_N] = {"sum", "norm", "dx", "dy", "dw"};
    for (int k = 0; k < R_N; k++) {
        int64_t n = k == R_DW ? C : N * C;
        double r = tt_close_ratio(a[k], b[k], n, k == R_DW ? dw_atol : tol, tol);
        cr_assert(r <= 1.0, "add_rmsnorm %s [%lld, %lld]: %s differs, ratio %g", what, (long long)N, (long long)C,
                  names[k], r);
    }
}

static void check(tm_dtype dt, double tol, double dw_atol) {
    /* N > 2048: blocks of 2 (2501) and 3 rows (4099, C with a tail) summing dw in registers,
     * the last block shorter (kernels/cuda/rmsnorm.cu) */
    const int64_t shapes[][2] = {{37, 129}, {5, 2048}, {3, 7}, {64, 33}, {2501, 72}, {4099, 37}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        int64_t N = shapes[i][0], C = shapes[i][1];
        tm_ctx *ctx = tt_parity_ctx();
        double *cpu[R_N], *gpu[R_N], *unf[R_N];
        run(ctx, tm_cpu(), dt, 1, N, C, cpu);
        run(ctx, tm_cuda(0), dt, 1, N, C, gpu);
        run(ctx, tm_cuda(0), dt, 0, N, C, unf);
        compare(gpu, cpu, N, C, tol, dw_atol, dt == TM_BF16 ? "bf16, CUDA against the CPU" : "f32, CUDA against the CPU");
        compare(gpu, unf, N, C, tol, dw_atol, dt == TM_BF16 ? "bf16, fused against unfused CUDA" : "f32, fused against unfused CUDA");
        for (int k = 0; k < R_N; k++) free(cpu[k]), free(gpu[k]), free(unf[k]);
        tm_ctx_free(ctx);
    }
}

Test(cuda_parity_norm, add_rmsnorm_f32) {
    TT_SKIP_WITHOUT_CUDA();
    check(TM_F32, 1e-5, 1e-4);
}

Test(cuda_parity_norm, add_rmsnorm_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    check(TM_BF16, 1e-2, 5e-2);
}
