/*
 * test_cuda_parity_attention.c — the CUDA kernels of rope and attention against the CPU ones,
 * forward and backward: rope at offset 0, at an offset, at position 70000 with theta 1e6, and
 * added twice into one gradient; attention with grouped-query heads (6 query / 2 kv heads),
 * multi-head, multi-query, Tk > Tq (the decode offset) down to a single query, head dims 13
 * (odd), 64, 128 and 200 (more than a block's threads), T = 300 and T = 1024, an explicit
 * scale, and k passed as v (both gradients into one buffer); plus bitwise reproducibility of
 * the attention backward.
 *
 * Tolerances (|cuda - cpu| <= atol + rtol * |cpu|): f32 atol 1e-5, rtol 1e-5; bf16 atol 1e-2,
 * rtol 1e-2, as in tests/test_cuda_parity.c. Both compute attention in f32 but sum in
 * different orders (the CPU in groups of 4 rows, CUDA per row by tiles of 32 keys); for the
 * long sequences (T >= 300), whose gradients sum hundreds of terms per element, atol is scaled
 * by 10 (1e-4). rope computes in f64 on both sides from f64 tables.
 * Every test but the coverage declarations skips when no CUDA device is visible.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "parity.h"

/* The ops of CASES below (tt_parity_run records them only inside the test's own process). */
TT_PARITY_COVERS("rope")
TT_PARITY_COVERS("attention")

/* iattr[0] pos_offset, iattr[1] theta (0: 10000). */
static tm_status f_rope(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_rope(c, in[0], a[0], a[1] ? (double)a[1] : 10000.0, o);
}
/* Two rotations of one x: the second backward adds into x's gradient. */
static tm_status f_rope_twice(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *y, *z;
    tm_status s = tm_rope(c, in[0], a[0], 10000.0, &y);
    if (!s) s = tm_rope(c, in[0], a[0] + 5, 10000.0, &z);
    return s ? s : tm_add(c, y, z, o);
}
static tm_status f_attention(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_attention(c, in[0], in[1], in[2], 0.0, o);
}
static tm_status f_attention_scale(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_attention(c, in[0], in[1], in[2], 0.3, o);
}
/* k doubles as v: dk and dv land in one gradient. */
static tm_status f_attention_kv_shared(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_attention(c, in[0], in[1], in[1], 0.0, o);
}

#define QKV(B, Tq, Tk, Hq, Hkv, D) {{B, Tq, Hq, D}, {B, Tk, Hkv, D}, {B, Tk, Hkv, D}}

static const tt_pcase CASES[] = {
    {"rope", "rope offset 0", f_rope, 1, {4}, {{2, 5, 3, 8}}, {0}, {0}, {0, 0}, 1, 0},
    {"rope", "rope offset 37, D 6", f_rope, 1, {4}, {{1, 7, 2, 6}}, {0}, {0}, {37, 0}, 1, 0},
    {"rope", "rope offset 70000, theta 1e6, D 66", f_rope, 1, {4}, {{2, 9, 3, 66}}, {0}, {0}, {70000, 1000000}, 1, 0},
    {"rope", "rope twice into one gradient, offset 11", f_rope_twice, 1, {4}, {{3, 4, 2, 10}}, {0}, {0}, {11, 0}, 1, 0},
    {"attention", "attention GQA 6/2 heads, T 300, D 64", f_attention, 3, {4, 4, 4}, QKV(1, 300, 300, 6, 2, 64), {0}, {0}, {0}, 10, 0},
    {"attention", "attention MHA, B 2, T 37, D 16", f_attention, 3, {4, 4, 4}, QKV(2, 37, 37, 3, 3, 16), {0}, {0}, {0}, 1, 0},
    {"attention", "attention Tk 23 > Tq 5, GQA 4/2, D 13, scale 0.3", f_attention_scale, 3, {4, 4, 4}, QKV(2, 5, 23, 4, 2, 13), {0}, {0}, {0}, 1, 0},
    {"attention", "attention one query, Tk 17, MQA, D 32", f_attention, 3, {4, 4, 4}, QKV(3, 1, 17, 4, 1, 32), {0}, {0}, {0}, 1, 0},
    {"attention", "attention D 128, T 70, GQA 2/1", f_attention, 3, {4, 4, 4}, QKV(1, 70, 70, 2, 1, 128), {0}, {0}, {0}, 1, 0},
    {"attention", "attention D 200, T 9", f_attention, 3, {4, 4, 4}, QKV(1, 9, 9, 2, 2, 200), {0}, {0}, {0}, 1, 0},
    {"attention", "attention T 1024, GQA 4/2, D 64", f_attention, 3, {4, 4, 4}, QKV(1, 1024, 1024, 4, 2, 64), {0}, {0}, {0}, 10, 0},
    {"attention", "attention k as v, Tk 40 > Tq 33, D 24", f_attention_kv_shared, 2, {4, 4}, {{2, 33, 4, 24}, {2, 40, 2, 24}}, {0}, {0}, {0}, 1, 0},
};
#define N_CASES ((int)(sizeof CASES / sizeof CASES[0]))

Test(cuda_parity_attention, ops_f32) {
    TT_SKIP_WITHOUT_CUDA();
    for (int k = 0; k < N_CASES; k++) tt_parity_run(&CASES[k], TM_F32, 1e-5, 1e-5);
}

Test(cuda_parity_attention, ops_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    for (int k = 0; k < N_CASES; k++) tt_parity_run(&CASES[k], TM_BF16, 1e-2, 1e-2);
}

/* Two backward passes with the same inputs give the same bits in dq, dk and dv. */
Test(cuda_parity_attention, backward_bitwise_reproducible) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t qs[4] = {2, 129, 6, 40}, ks[4] = {2, 131, 2, 40}, n[3] = {2 * 129 * 6 * 40, 2 * 131 * 2 * 40, 2 * 131 * 2 * 40};
    double *hq = tt_parity_uniform(n[0], 1), *hk = tt_parity_uniform(n[1], 2), *hv = tt_parity_uniform(n[1], 3);
    double *hg = tt_parity_uniform(n[0], 4);
    double *got[2][3];
    for (int run = 0; run < 2; run++) {
        tm_tensor *q, *k, *v, *o, *g;
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 4, qs, tm_cuda(0), TM_F64, hq, &q));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 4, ks, tm_cuda(0), TM_F64, hk, &k));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 4, ks, tm_cuda(0), TM_F64, hv, &v));
        tm_tensor *in[3] = {q, k, v};
        for (int i = 0; i < 3; i++) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, in[i], 1));
        TT_OK(ctx, tm_attention(ctx, q, k, v, 0.0, &o));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 4, qs, tm_cuda(0), TM_F64, hg, &g));
        TT_OK(ctx, tm_backward_with_grad(ctx, o, g));
        for (int i = 0; i < 3; i++) got[run][i] = tt_read(ctx, tm_tensor_grad(in[i]));
        tm_ctx_arena_reset(ctx);
    }
    const char *names[3] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; i++) {
        cr_assert(memcmp(got[0][i], got[1][i], sizeof(double) * (size_t)n[i]) == 0, "%s differs between two runs", names[i]);
        free(got[0][i]), free(got[1][i]);
    }
    free(hq), free(hk), free(hv), free(hg);
    tm_ctx_free(ctx);
}
