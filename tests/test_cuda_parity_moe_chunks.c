/*
 * test_cuda_parity_moe_chunks.c — tm_moe_sort_chunks on CUDA against the CPU: forward and
 * backward (a random upstream gradient, added into a gradient already there), f32 and bf16, rows of 1024
 * bf16 / 36 f32 elements (16-byte vectors), 21 (one element per access) and a row pointer off
 * 16-byte alignment; grids with empty chunks and an empty group, 2 x 32 (the fine model's
 * expert-parallel grid on 2 GPUs); sizes with a host copy (checked, the MoE block's case) and
 * without (read on the device: no synchronisation, tm_ctx_sync_count), and sizes that do not
 * sum to the rows, unchecked on the device: rows no chunk covers come out zero and nothing is
 * read or written out of bounds. Every value is compared bitwise: both sides move rows, and
 * the backward adds one term into each gradient element.
 * Every test skips when no CUDA device is visible.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"
#include "parity.h"

TT_PARITY_COVERS("moe_sort_chunks")

static tm_tensor *sizes_on(tm_ctx *ctx, tm_device dev, int64_t n, const int64_t *v, int mirror) {
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &n, dev, TM_I64, v, &t));
    if (mirror) TT_OK(ctx, tm__mirror_set(ctx, t, v));
    return t;
}

static tm_tensor *from(tm_ctx *ctx, tm_dtype dt, int64_t R, int64_t H, tm_device dev, const double *v, int misalign,
                       tm_tensor **base) {
    int64_t n = R * H + (misalign ? 1 : 0), shape[2] = {R, H};
    double *h = calloc((size_t)(n ? n : 1), sizeof *h);
    memcpy(h + (misalign ? 1 : 0), v, sizeof(double) * (size_t)(R * H));
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 1, &n, dev, TM_F64, h, base));
    free(h);
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, *base, 1));
    tm_tensor *s, *t;
    TT_OK(ctx, tm_slice(ctx, *base, 0, misalign ? 1 : 0, n, &s));
    TT_OK(ctx, tm_reshape(ctx, s, 2, shape, &t));
    return t;
}

static void assert_same(tm_ctx *ctx, const tm_tensor *got, const tm_tensor *want, const char *what) {
    int64_t n = tm_tensor_numel(want);
    cr_assert_eq(tm_tensor_numel(got), n, "%s: sizes differ", what);
    double *a = tt_read(ctx, got), *b = tt_read(ctx, want);
    for (int64_t i = 0; i < n; i++) cr_assert(a[i] == b[i], "%s[%lld]: CUDA %.9g, CPU %.9g", what, (long long)i, a[i], b[i]);
    free(a), free(b);
}

/* One case on both devices: y = sort_chunks(x), then backward of y with gy into a gradient
 * that already holds 1 (so the kernels must add). */
static void chunks_case(tm_dtype dt, int64_t G, int64_t K, const int64_t *sz, int64_t H, int misalign, int mirror) {
    tm_ctx *ctx = tt_parity_ctx();
    int64_t n = G * K, R = 0;
    for (int64_t i = 0; i < n; i++) R += sz[i];
    int64_t shape[2] = {R, H};
    double *vx = tt_parity_uniform(R * H, 11 + (uint64_t)H), *vg = tt_parity_uniform(R * H, 12 + (uint64_t)H);
    tm_tensor *y[2], *base[2], *g[2];
    const tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
    for (int d = 0; d < 2; d++) {
        tm_tensor *x = from(ctx, dt, R, H, devs[d], vx, misalign, &base[d]), *half, *sum;
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, shape, devs[d], TM_F64, vg, &g[d]));
        /* y + x / 2: the scale's backward runs first (reverse creation order), so the
         * regrouping's backward must add into a gradient that is already there */
        TT_OK(ctx, tm_moe_sort_chunks(ctx, x, sizes_on(ctx, devs[d], n, sz, mirror), G, &y[d]));
        TT_OK(ctx, tm_scale(ctx, x, 0.5, &half));
        TT_OK(ctx, tm_add(ctx, y[d], half, &sum));
        TT_OK(ctx, tm_backward_with_grad(ctx, sum, g[d]));
    }
    char what[160];
    snprintf(what, sizeof what, "%s G %lld K %lld H %lld misalign %d mirror %d: y", tm_dtype_name(dt), (long long)G,
             (long long)K, (long long)H, misalign, mirror);
    assert_same(ctx, y[1], y[0], what);
    strcat(what, " grad");
    assert_same(ctx, tm_tensor_grad(base[1]), tm_tensor_grad(base[0]), what);
    free(vx), free(vg);
    tm_ctx_free(ctx);
}

static const int64_t SZ23[6] = {2, 0, 3, 1, 4, 0};
static const int64_t SZ43[12] = {1, 2, 0, 0, 0, 0, 3, 1, 1, 2, 2, 2};

Test(cuda_parity_moe_chunks, f32) {
    TT_SKIP_WITHOUT_CUDA();
    for (int mirror = 0; mirror < 2; mirror++) {
        chunks_case(TM_F32, 2, 3, SZ23, 36, 0, mirror);
        chunks_case(TM_F32, 4, 3, SZ43, 21, 0, mirror);
        chunks_case(TM_F32, 4, 3, SZ43, 36, 1, mirror);
    }
}

Test(cuda_parity_moe_chunks, bf16) {
    TT_SKIP_WITHOUT_CUDA();
    for (int mirror = 0; mirror < 2; mirror++) {
        chunks_case(TM_BF16, 2, 3, SZ23, 1024, 0, mirror);
        chunks_case(TM_BF16, 4, 3, SZ43, 21, 0, mirror);
        chunks_case(TM_BF16, 2, 3, SZ23, 1024, 1, mirror);
    }
}

/* The fine model's grid on 2 GPUs (2 source ranks x 32 local experts), ragged with empty
 * chunks, 1024-wide bf16 rows. */
Test(cuda_parity_moe_chunks, ep_grid_2x32) {
    TT_SKIP_WITHOUT_CUDA();
    int64_t sz[64];
    uint64_t s = 5;
    for (int i = 0; i < 64; i++) s = s * 6364136223846793005ull + 1442695040888963407ull, sz[i] = (int64_t)(s >> 60) % 9;
    sz[3] = sz[40] = 0;
    chunks_case(TM_BF16, 2, 32, sz, 1024, 0, 1);
}

/* Sizes read on the device: no synchronisation, forward or backward. */
Test(cuda_parity_moe_chunks, no_synchronisation) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t shape[2] = {10, 64};
    double *v = tt_parity_uniform(640, 3);
    tm_tensor *x, *y, *g;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_BF16, 2, shape, tm_cuda(0), TM_F64, v, &x));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_BF16, 2, shape, tm_cuda(0), TM_F64, v, &g));
    free(v);
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    tm_tensor *sz = sizes_on(ctx, tm_cuda(0), 6, SZ23, 0);
    TT_OK(ctx, tm_ctx_sync(ctx));
    uint64_t before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_moe_sort_chunks(ctx, x, sz, 2, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, g));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "sort_chunks synchronised %lld times",
                 (long long)(tm_ctx_sync_count(ctx) - before));
    tm_ctx_free(ctx);
}

/* Unchecked sizes on the device that cover fewer rows than x has: the rows past them come out
 * zero, the others as the CPU places them for the same chunks. */
Test(cuda_parity_moe_chunks, unchecked_sizes_stay_in_bounds) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t short_sz[6] = {2, 0, 1, 1, 2, 0}; /* 6 of 10 rows */
    int64_t shape[2] = {10, 8}, s6[2] = {6, 8};
    double *vx = tt_parity_uniform(80, 21);
    tm_tensor *x, *x6, *y, *y6;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, shape, tm_cuda(0), TM_F64, vx, &x));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, s6, tm_cpu(), TM_F64, vx, &x6));
    TT_OK(ctx, tm_moe_sort_chunks(ctx, x, sizes_on(ctx, tm_cuda(0), 6, short_sz, 0), 2, &y));
    TT_OK(ctx, tm_moe_sort_chunks(ctx, x6, sizes_on(ctx, tm_cpu(), 6, short_sz, 0), 2, &y6));
    double *a = tt_read(ctx, y), *b = tt_read(ctx, y6);
    for (int i = 0; i < 80; i++)
        cr_assert_eq(a[i], i < 48 ? b[i] : 0.0, "element %d: %g, want %g", i, a[i], i < 48 ? b[i] : 0.0);
    free(a), free(b), free(vx);
    tm_ctx_free(ctx);
}
