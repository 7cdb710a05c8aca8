/*
 * test_cuda_parity_attention.c — the CUDA kernels of rope and attention against the CPU ones,
 * forward and backward: rope at offset 0, at an offset, at position 70000 with theta 1e6, and
 * added twice into one gradient; attention with grouped-query heads (6 query / 2 kv heads),
 * multi-head, multi-query, Tk > Tq (the decode offset) down to a single query, head dims 13
 * (odd), 64, 128 and 200 (more than a block's threads), T = 300 and T = 1024, an explicit
 * scale, and k passed as v (both gradients into one buffer); plus bitwise reproducibility of
 * the attention forward and backward.
 *
 * bf16 attention with head dim 64 or 128 runs on the tensor-core kernels (kernels/cuda/
 * attention.cu); TC_CASES aim at their edges: T = 100 (no multiple of the 64-row tiles), one
 * query and 37 queries against 130 keys (KV-cache shapes: the causal diagonal falls inside a
 * tile, off its corner), GQA 6/2 and Hq = Hkv, B = 2, k as v and an explicit scale, and
 * Tq 200 of Tk 330 with G = 3 (several 128-row query blocks and 128-key blocks, the diagonal
 * inside them);
 * tensor_core_one_gradient has q, k or v alone need a gradient (the others' are NULL).
 *
 * Tolerances (|cuda - cpu| <= atol + rtol * |cpu|): f32 atol 1e-5, rtol 1e-5; bf16 atol 1e-2,
 * rtol 1e-2, as in tests/test_cuda_parity.c. Both compute attention in f32 but sum in
 * different orders (the CPU in groups of 4 rows, CUDA per row by tiles of 32 keys); for the
 * long sequences (T >= 300), whose gradients sum hundreds of terms per element, atol is scaled
 * by 10 (1e-4). rope computes in f64 on both sides from f64 tables.
 * The bf16 tensor-core path: atol 3e-2, rtol 3e-2. It rounds P to bf16 before P V and dV = P^T dO,
 * dS to bf16 before dQ = dS K and dK = dS^T Q (the mma operands), and takes Delta_i = dO_i . O_i
 * from the bf16 output (FlashAttention-2's choice), where the CPU keeps all of these in f32:
 * relative RMS errors of ~3e-3 with tails of ~10 sigma in the gradients (measured on a host
 * emulation of the kernels, which matches a reference with those roundings to ~1e-7). The
 * forward takes P against a running max that may trail the row's max by up to 2^8 (rescaling
 * only when it passes that): bf16 rounding is relative, so P's error is the same, and the
 * exponentials come from ex2.approx (2 ulp); the kernels' outputs stayed within 1e-2 of the
 * max (max |diff|) and 4e-3 (RMS) of the earlier tensor-core kernels on the benchmark and
 * odd shapes (scratch harness, H100, 2026-11-27).
 * On an sm_90 GPU bf16 attention at D 64 and 128 takes the wgmma kernels (kernels/cuda/
 * attention_sm90.cu): tensor_core_bf16, tensor_core_one_gradient and
 * tensor_core_bitwise_reproducible run both those and, with the context switched to them
 * (tm__attn_set_sm80), the sm_80 kernels, against the CPU with the same tolerance (the Hopper
 * kernels make the same bf16 roundings of P, dS and Delta; only the order of the f32 sums
 * differs), and assert which path ran (tm__attn_sm90_launches).
 * Every test but the coverage declarations skips when no CUDA device is visible.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"
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
/* A milder explicit scale for the bf16 tensor-core path: at 0.3 and D 64 the scores spread over
 * ~+-10, the gradients grow with them and so do their bf16 rounding errors. */
static tm_status f_attention_scale_tc(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_attention(c, in[0], in[1], in[2], 0.2, o);
}
/* k doubles as v: dk and dv land in one gradient. */
static tm_status f_attention_kv_shared(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_attention(c, in[0], in[1], in[1], 0.0, o);
}

/* attention(q, k, v) + attention(q, v, k): the second call's backward writes dq, dk and dv fresh
 * (call->gin_fresh: stored, not read), the first's adds to them. */
static tm_status f_attention_two(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *x, *y;
    tm_status s = tm_attention(c, in[0], in[1], in[2], 0.0, &x);
    if (!s) s = tm_attention(c, in[0], in[2], in[1], 0.0, &y);
    return s ? s : tm_add(c, x, y, o);
}

#define QKV(B, Tq, Tk, Hq, Hkv, D) {{B, Tq, Hq, D}, {B, Tk, Hkv, D}, {B, Tk, Hkv, D}}

static const tt_pcase CASES[] = {
    {"rope", "rope offset 0", f_rope, 1, {4}, {{2, 5, 3, 8}}, {0}, {0}, {0, 0}, 1, 0},
    {"rope", "rope offset 37, D 6", f_rope, 1, {4}, {{1, 7, 2, 6}}, {0}, {0}, {37, 0}, 1, 0},
    {"rope", "rope offset 70000, theta 1e6, D 66", f_rope, 1, {4}, {{2, 9, 3, 66}}, {0}, {0}, {70000, 1000000}, 1, 0},
    {"rope", "rope twice into one gradient, offset 11", f_rope_twice, 1, {4}, {{3, 4, 2, 10}}, {0}, {0}, {11, 0}, 1, 0},
    /* half 8: the 4-pair accesses (rope.cu), the second backward adding into the first's */
    {"rope", "rope twice into one gradient, D 16, offset 3", f_rope_twice, 1, {4}, {{2, 5, 3, 16}}, {0}, {0}, {3, 0}, 1, 0},
    {"attention", "attention GQA 6/2 heads, T 300, D 64", f_attention, 3, {4, 4, 4}, QKV(1, 300, 300, 6, 2, 64), {0}, {0}, {0}, 10, 0},
    {"attention", "attention MHA, B 2, T 37, D 16", f_attention, 3, {4, 4, 4}, QKV(2, 37, 37, 3, 3, 16), {0}, {0}, {0}, 1, 0},
    {"attention", "attention Tk 23 > Tq 5, GQA 4/2, D 13, scale 0.3", f_attention_scale, 3, {4, 4, 4}, QKV(2, 5, 23, 4, 2, 13), {0}, {0}, {0}, 1, 0},
    {"attention", "attention one query, Tk 17, MQA, D 32", f_attention, 3, {4, 4, 4}, QKV(3, 1, 17, 4, 1, 32), {0}, {0}, {0}, 1, 0},
    {"attention", "attention D 128, T 70, GQA 2/1", f_attention, 3, {4, 4, 4}, QKV(1, 70, 70, 2, 1, 128), {0}, {0}, {0}, 1, 0},
    {"attention", "attention D 200, T 9", f_attention, 3, {4, 4, 4}, QKV(1, 9, 9, 2, 2, 200), {0}, {0}, {0}, 1, 0},
    {"attention", "attention T 1024, GQA 4/2, D 64", f_attention, 3, {4, 4, 4}, QKV(1, 1024, 1024, 4, 2, 64), {0}, {0}, {0}, 10, 0},
    {"attention", "attention k as v, Tk 40 > Tq 33, D 24", f_attention_kv_shared, 2, {4, 4}, {{2, 33, 4, 24}, {2, 40, 2, 24}}, {0}, {0}, {0}, 1, 0},
    {"attention", "attention twice, k and v swapped (fresh, then added), Tk 23 > Tq 5, GQA 4/2, D 13", f_attention_two, 3, {4, 4, 4}, QKV(2, 5, 23, 4, 2, 13), {0}, {0}, {0}, 1, 0},
};
#define N_CASES ((int)(sizeof CASES / sizeof CASES[0]))

/* Shapes for the tensor-core kernels (bf16, D 64 and 128); run in f32 as well, on the other path. */
static const tt_pcase TC_CASES[] = {
    {"attention", "tc GQA 6/2, B 2, T 100, D 64", f_attention, 3, {4, 4, 4}, QKV(2, 100, 100, 6, 2, 64), {0}, {0}, {0}, 1, 0},
    {"attention", "tc GQA 6/2, B 2, T 100, D 128", f_attention, 3, {4, 4, 4}, QKV(2, 100, 100, 6, 2, 128), {0}, {0}, {0}, 1, 0},
    {"attention", "tc one query, Tk 130, GQA 6/2, B 2, D 64", f_attention, 3, {4, 4, 4}, QKV(2, 1, 130, 6, 2, 64), {0}, {0}, {0}, 1, 0},
    {"attention", "tc one query, Tk 130, GQA 6/2, B 2, D 128", f_attention, 3, {4, 4, 4}, QKV(2, 1, 130, 6, 2, 128), {0}, {0}, {0}, 1, 0},
    {"attention", "tc Tq 37, Tk 130, MHA 4/4, B 2, D 64", f_attention, 3, {4, 4, 4}, QKV(2, 37, 130, 4, 4, 64), {0}, {0}, {0}, 1, 0},
    {"attention", "tc Tq 37, Tk 130, MHA 4/4, B 2, D 128", f_attention, 3, {4, 4, 4}, QKV(2, 37, 130, 4, 4, 128), {0}, {0}, {0}, 1, 0},
    {"attention", "tc Tq 37, Tk 130, GQA 6/2, B 2, D 128", f_attention, 3, {4, 4, 4}, QKV(2, 37, 130, 6, 2, 128), {0}, {0}, {0}, 1, 0},
    {"attention", "tc T 64 (whole tiles), MHA 2/2, D 64", f_attention, 3, {4, 4, 4}, QKV(1, 64, 64, 2, 2, 64), {0}, {0}, {0}, 1, 0},
    {"attention", "tc T 200, MQA 2/1, D 64, scale 0.2", f_attention_scale_tc, 3, {4, 4, 4}, QKV(1, 200, 200, 2, 1, 64), {0}, {0}, {0}, 1, 0},
    {"attention", "tc k as v, Tq 33, Tk 70, GQA 4/2, D 64", f_attention_kv_shared, 2, {4, 4}, {{1, 33, 4, 64}, {1, 70, 2, 64}}, {0}, {0}, {0}, 1, 0},
    {"attention", "tc k as v, T 129, D 128", f_attention_kv_shared, 2, {4, 4}, {{2, 129, 2, 128}, {2, 129, 1, 128}}, {0}, {0}, {0}, 1, 0},
    {"attention", "tc Tq 200, Tk 330, GQA 9/3, D 64", f_attention, 3, {4, 4, 4}, QKV(1, 200, 330, 9, 3, 64), {0}, {0}, {0}, 1, 0},
    {"attention", "tc Tq 200, Tk 330, GQA 9/3, D 128", f_attention, 3, {4, 4, 4}, QKV(1, 200, 330, 9, 3, 128), {0}, {0}, {0}, 1, 0},
    {"attention", "tc twice, k and v swapped (fresh, then added), Tq 37, Tk 130, GQA 6/2, D 64", f_attention_two, 3, {4, 4, 4}, QKV(2, 37, 130, 6, 2, 64), {0}, {0}, {0}, 1, 0},
    {"attention", "tc twice, k and v swapped (fresh, then added), T 100, GQA 6/2, D 128", f_attention_two, 3, {4, 4, 4}, QKV(1, 100, 100, 6, 2, 128), {0}, {0}, {0}, 1, 0},
};
#define N_TC_CASES ((int)(sizeof TC_CASES / sizeof TC_CASES[0]))

Test(cuda_parity_attention, ops_f32) {
    TT_SKIP_WITHOUT_CUDA();
    for (int k = 0; k < N_CASES; k++) tt_parity_run(&CASES[k], TM_F32, 1e-5, 1e-5);
}

/* bf16 attention with D 64 or 128 takes the tensor-core kernels and their tolerance. */
static int takes_tensor_cores(const tt_pcase *pc) {
    return strcmp(pc->op, "attention") == 0 && (pc->shape[0][3] == 64 || pc->shape[0][3] == 128);
}

Test(cuda_parity_attention, ops_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    for (int k = 0; k < N_CASES; k++) {
        const double tol = takes_tensor_cores(&CASES[k]) ? 3e-2 : 1e-2;
        tt_parity_run(&CASES[k], TM_BF16, tol, tol);
    }
}

/* 1 when this GPU runs the Hopper attention kernels: the same condition as grouped_matmul's
 * Hopper kernel (an sm_90 device and the sm_90a image that the Makefile builds for
 * grouped_matmul_sm90.cu and attention_sm90.cu alike), which tm_ctx_new's TM_GROUPED_GEMM_AUTO
 * resolves. */
static int hopper(void) {
    tm_ctx *ctx = tt_parity_ctx();
    const int h = tm__gmm_mode(ctx) == TM_GROUPED_GEMM_HOPPER;
    tm_ctx_free(ctx);
    return h;
}

/* want90: ctx's attention calls (n of them, forwards and backwards) must all have taken the Hopper
 * kernels; else none of them. */
static void check_path(tm_ctx *ctx, int want90, uint64_t n, const char *what) {
    const uint64_t got = tm__attn_sm90_launches(ctx);
    cr_assert_eq(got, want90 ? n : 0, "%s: %llu of %llu attention calls took the Hopper kernels, want %s", what,
                 (unsigned long long)got, (unsigned long long)n, want90 ? "all" : "none");
}

/* The cases on the default path, then on the sm_80 kernels; on Hopper the first run must have
 * taken the wgmma kernels for every forward and backward (2 a case; k as v and the two-call
 * cases make more), the second none. */
Test(cuda_parity_attention, tensor_core_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    const int h = hopper();
    for (int sm80 = 0; sm80 < 2; sm80++) {
        tt_parity_attn_sm80 = sm80, tt_parity_attn_sm90 = 0;
        for (int k = 0; k < N_TC_CASES; k++) tt_parity_run(&TC_CASES[k], TM_BF16, 3e-2, 3e-2);
        if (sm80 || !h)
            cr_assert_eq(tt_parity_attn_sm90, 0, "%llu attention calls took the Hopper kernels (sm80 %d, hopper %d)",
                         (unsigned long long)tt_parity_attn_sm90, sm80, h);
        else
            cr_assert(tt_parity_attn_sm90 >= 2 * (uint64_t)N_TC_CASES, "only %llu of the %d cases' calls took the Hopper kernels",
                      (unsigned long long)tt_parity_attn_sm90, N_TC_CASES);
    }
    tt_parity_attn_sm80 = 0;
}

Test(cuda_parity_attention, tensor_core_shapes_f32) {
    TT_SKIP_WITHOUT_CUDA();
    for (int k = 0; k < N_TC_CASES; k++) tt_parity_run(&TC_CASES[k], TM_F32, 1e-5, 1e-5);
}

/* Only input `which` of q, k, v needs a gradient: the backward gets NULL for the other two. */
static void check_one_gradient(int which, const int64_t qs[4], const int64_t ks[4], int sm80, int want90) {
    tt_parity_attn_sm80 = sm80;
    tm_ctx *ctx = tt_parity_ctx();
    tt_parity_attn_sm80 = 0;
    const int64_t nq = qs[0] * qs[1] * qs[2] * qs[3], nk = ks[0] * ks[1] * ks[2] * ks[3];
    double *h[3] = {tt_parity_uniform(nq, 11), tt_parity_uniform(nk, 12), tt_parity_uniform(nk, 13)};
    double *hg = tt_parity_uniform(nq, 14), *got[2];
    const tm_device dev[2] = {tm_cpu(), tm_cuda(0)};
    for (int side = 0; side < 2; side++) {
        tm_tensor *in[3], *o, *g;
        for (int i = 0; i < 3; i++) {
            TT_OK(ctx, tm_tensor_from_host(ctx, TM_BF16, 4, i ? ks : qs, dev[side], TM_F64, h[i], &in[i]));
            if (i == which) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, in[i], 1));
        }
        TT_OK(ctx, tm_attention(ctx, in[0], in[1], in[2], 0.0, &o));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_BF16, 4, qs, dev[side], TM_F64, hg, &g));
        TT_OK(ctx, tm_backward_with_grad(ctx, o, g));
        cr_assert(tm_tensor_grad(in[which]), "input %d has no gradient", which);
        got[side] = tt_read(ctx, tm_tensor_grad(in[which]));
    }
    const double r = tt_close_ratio(got[1], got[0], which ? nk : nq, 3e-2, 3e-2);
    cr_assert(r <= 1.0, "gradient of input %d alone (D %lld, sm80 %d) differs, ratio %g", which, (long long)qs[3], sm80, r);
    check_path(ctx, want90, 2, "one gradient");
    for (int i = 0; i < 3; i++) free(h[i]);
    free(hg), free(got[0]), free(got[1]);
    tm_ctx_free(ctx);
}

Test(cuda_parity_attention, tensor_core_one_gradient) {
    TT_SKIP_WITHOUT_CUDA();
    const int64_t qs64[4] = {1, 37, 6, 64}, ks64[4] = {1, 130, 2, 64};
    const int64_t qs128[4] = {1, 37, 6, 128}, ks128[4] = {1, 130, 2, 128};
    const int h = hopper();
    for (int sm80 = 0; sm80 < 2; sm80++)
        for (int which = 0; which < 3; which++) {
            check_one_gradient(which, qs64, ks64, sm80, h && !sm80);
            check_one_gradient(which, qs128, ks128, sm80, h && !sm80);
        }
}

/* Two runs with the same inputs give the same bits in o, dq, dk and dv. */
static void check_reproducible(tm_dtype dt, const int64_t qs[4], const int64_t ks[4], int sm80, int want90) {
    tt_parity_attn_sm80 = sm80;
    tm_ctx *ctx = tt_parity_ctx();
    tt_parity_attn_sm80 = 0;
    const int64_t n[3] = {qs[0] * qs[1] * qs[2] * qs[3], ks[0] * ks[1] * ks[2] * ks[3], ks[0] * ks[1] * ks[2] * ks[3]};
    double *hq = tt_parity_uniform(n[0], 1), *hk = tt_parity_uniform(n[1], 2), *hv = tt_parity_uniform(n[1], 3);
    double *hg = tt_parity_uniform(n[0], 4);
    double *got[2][4];
    for (int run = 0; run < 2; run++) {
        tm_tensor *q, *k, *v, *o, *g;
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 4, qs, tm_cuda(0), TM_F64, hq, &q));
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 4, ks, tm_cuda(0), TM_F64, hk, &k));
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 4, ks, tm_cuda(0), TM_F64, hv, &v));
        tm_tensor *in[3] = {q, k, v};
        for (int i = 0; i < 3; i++) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, in[i], 1));
        TT_OK(ctx, tm_attention(ctx, q, k, v, 0.0, &o));
        got[run][3] = tt_read(ctx, o);
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 4, qs, tm_cuda(0), TM_F64, hg, &g));
        TT_OK(ctx, tm_backward_with_grad(ctx, o, g));
        for (int i = 0; i < 3; i++) got[run][i] = tt_read(ctx, tm_tensor_grad(in[i]));
        tm_ctx_arena_reset(ctx);
    }
    const char *names[4] = {"dq", "dk", "dv", "o"};
    const int64_t len[4] = {n[0], n[1], n[2], n[0]};
    for (int i = 0; i < 4; i++) {
        cr_assert(memcmp(got[0][i], got[1][i], sizeof(double) * (size_t)len[i]) == 0, "%s %s differs between two runs",
                  tm_dtype_name(dt), names[i]);
        free(got[0][i]), free(got[1][i]);
    }
    free(hq), free(hk), free(hv), free(hg);
    check_path(ctx, want90, 4, "reproducibility");
    tm_ctx_free(ctx);
}

Test(cuda_parity_attention, backward_bitwise_reproducible) {
    TT_SKIP_WITHOUT_CUDA();
    const int64_t qs[4] = {2, 129, 6, 40}, ks[4] = {2, 131, 2, 40};
    check_reproducible(TM_F32, qs, ks, 0, 0); /* f32: never the tensor-core kernels */
}

/* The tensor-core kernels, D 64 and 128, with several query and key blocks per head. */
Test(cuda_parity_attention, tensor_core_bitwise_reproducible) {
    TT_SKIP_WITHOUT_CUDA();
    const int64_t qs64[4] = {2, 200, 6, 64}, ks64[4] = {2, 230, 2, 64};
    const int64_t qs128[4] = {2, 150, 4, 128}, ks128[4] = {2, 150, 2, 128};
    const int h = hopper();
    for (int sm80 = 0; sm80 < 2; sm80++) {
        check_reproducible(TM_BF16, qs64, ks64, sm80, h && !sm80);
        check_reproducible(TM_BF16, qs128, ks128, sm80, h && !sm80);
    }
}
