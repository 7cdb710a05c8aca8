/*
 * test_cuda_parity_moe_loss.c — the CUDA MoE auxiliary losses against the CPU ones, forward and
 * backward (a random upstream gradient, read by the CUDA backward on the device): moe_aux_loss
 * (with and without total_tokens), moe_seq_aux_loss, moe_z_loss, including no tokens; and their
 * determinism on CUDA: over 20000 tokens the losses and their gradients are bit-identical from
 * one run to the next (the two-pass fixed-order reductions of kernels/cuda/moe_loss.cu).
 *
 * Tolerances (|cuda - cpu| <= atol + rtol * |cpu|):
 *   f32   atol 1e-5, rtol 1e-5: CUDA sums the terms in f32 (per-thread runs, then fixed trees),
 *         the CPU in f64; a loss of n terms differs by about log2(n) f32 roundings.
 *   bf16  atol 1e-2, rtol 1e-2: the same bf16 inputs, both compute in f32 or better and round
 *         the loss and the gradients to bf16 once, so they may land one bf16 step apart.
 * Every test skips when no CUDA device is visible.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "parity.h"

TT_PARITY_COVERS("moe_aux_loss")
TT_PARITY_COVERS("moe_seq_aux_loss")
TT_PARITY_COVERS("moe_z_loss")

static double atol_of(tm_dtype dt) { return dt == TM_BF16 ? 1e-2 : 1e-5; }
static double rtol_of(tm_dtype dt) { return dt == TM_BF16 ? 1e-2 : 1e-5; }

static void assert_close(tm_ctx *ctx, const tm_tensor *gpu, const tm_tensor *cpu, tm_dtype dt, const char *what,
                         const char *name) {
    cr_assert_eq(tm_tensor_device(gpu).type, TM_DEVICE_CUDA, "%s: %s not on CUDA", name, what);
    cr_assert_eq(tm_tensor_numel(gpu), tm_tensor_numel(cpu), "%s: %s sizes differ", name, what);
    cr_assert_eq(tm_tensor_dtype(gpu), tm_tensor_dtype(cpu), "%s: %s dtypes differ", name, what);
    double *a = tt_read(ctx, gpu), *b = tt_read(ctx, cpu);
    int64_t n = tm_tensor_numel(cpu);
    double r = tt_close_ratio(a, b, n, atol_of(dt), rtol_of(dt));
    double a0 = n ? a[0] : 0, b0 = n ? b[0] : 0;
    free(a), free(b);
    cr_assert(r <= 1.0, "%s (%s): %s differs, ratio %g (first elements: cuda %.9g, cpu %.9g)", name, tm_dtype_name(dt),
              what, r, a0, b0);
}

/* The three losses as one kind of case: scores / logits (T, E) in dt, an index-like second
 * input made on both devices, the loss, and its backward with upstream gradient 0.7. */
typedef enum { AUX, SEQ, ZL } lkind;

typedef struct lcase {
    const char *name;
    lkind kind;
    int64_t T, E;
    int k;
    double coeff;
    int64_t extra; /* AUX: total_tokens; SEQ: num_seqs */
} lcase;

/* counts: i64 [E] of routed pairs (any non-negative values do); map: u8 [T, E] with about k
 * ones per row. */
static tm_tensor *second_input(tm_ctx *ctx, const lcase *lc, tm_device dev) {
    tm_tensor *t = NULL;
    if (lc->kind == AUX) {
        double *c = malloc(sizeof(double) * (size_t)lc->E);
        for (int64_t e = 0; e < lc->E; e++) c[e] = (double)((e * 37 + 11) % (lc->T * lc->k / lc->E + 3));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &lc->E, dev, TM_F64, c, &t));
        free(c);
    } else if (lc->kind == SEQ) {
        int64_t s[2] = {lc->T, lc->E}, n = lc->T * lc->E;
        double *u = tt_parity_uniform(n, 700);
        for (int64_t i = 0; i < n; i++) u[i] = (u[i] + 2.0) * 0.25 < (double)lc->k / (double)lc->E ? 1.0 : 0.0;
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_U8, 2, s, dev, TM_F64, u, &t));
        free(u);
    }
    return t;
}

static tm_status run_loss(tm_ctx *ctx, const lcase *lc, tm_tensor *x, tm_tensor *second, tm_tensor **out) {
    switch (lc->kind) {
    case AUX: return tm_moe_aux_loss(ctx, x, second, lc->k, lc->coeff, lc->extra, out);
    case SEQ: return tm_moe_seq_aux_loss(ctx, x, second, lc->k, lc->coeff, lc->extra, out);
    default: return tm_moe_z_loss(ctx, x, lc->coeff, out);
    }
}

static void loss_parity(const lcase *lc, tm_dtype dt) {
    tm_ctx *ctx = tt_parity_ctx();
    int64_t s[2] = {lc->T, lc->E};
    double *h = tt_parity_uniform(lc->T * lc->E, 800 + (uint64_t)(lc->T * 3 + lc->E));
    if (lc->kind != ZL)
        for (int64_t i = 0; i < lc->T * lc->E; i++) h[i] = (h[i] + 2.0) * 0.25; /* scores in [0, 1) */
    const double g07 = 0.7;
    tm_tensor *x[2], *y[2], *g;
    tm_device dev[2] = {tm_cpu(), tm_cuda(0)};
    for (int d = 0; d < 2; d++) {
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, s, dev[d], TM_F64, h, &x[d]));
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x[d], 1));
        TT_OK(ctx, run_loss(ctx, lc, x[d], second_input(ctx, lc, dev[d]), &y[d]));
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 0, NULL, dev[d], TM_F64, &g07, &g));
        TT_OK(ctx, tm_backward_with_grad(ctx, y[d], g));
    }
    assert_close(ctx, y[1], y[0], dt, "loss", lc->name);
    assert_close(ctx, tm_tensor_grad(x[1]), tm_tensor_grad(x[0]), dt, "gradient", lc->name);
    if (lc->T == 0) {
        double v;
        TT_OK(ctx, tm_tensor_read(ctx, y[1], TM_F64, &v, 1));
        cr_assert_eq(v, 0.0, "%s: the loss of no tokens is %g on CUDA", lc->name, v);
    }
    free(h);
    tm_ctx_free(ctx);
}

static const lcase LCASES[] = {
    {"aux E 8 k 2", AUX, 64, 8, 2, 1e-2, 0},
    {"aux E 7 k 1, total_tokens 3T", AUX, 77, 7, 1, 0.5, 231},
    {"aux E 64 k 6", AUX, 301, 64, 6, 1e-3, 0},
    {"aux many terms (1024 partials)", AUX, 5003, 13, 2, 1.0, 0},
    {"aux coeff 0", AUX, 40, 8, 2, 0.0, 0},
    {"aux no tokens", AUX, 0, 8, 2, 1e-2, 0},
    {"aux no local tokens, total_tokens 100", AUX, 0, 8, 2, 1e-2, 100},
    {"seq aux 4 sequences, E 7 k 2", SEQ, 200, 7, 2, 1e-2, 4},
    {"seq aux 1 sequence, E 64 k 6", SEQ, 130, 64, 6, 1e-3, 1},
    {"seq aux 25 sequences, E 13 k 3", SEQ, 2500, 13, 3, 0.1, 25},
    {"seq aux no tokens", SEQ, 0, 8, 2, 1e-2, 2},
    {"z E 8", ZL, 64, 8, 0, 1e-3, 0},
    {"z E 13, coeff 0.5", ZL, 301, 13, 0, 0.5, 0},
    {"z E 512 (a wide row)", ZL, 9, 512, 0, 1e-2, 0},
    {"z many rows", ZL, 4099, 7, 0, 1e-3, 0},
    {"z no tokens", ZL, 0, 8, 0, 1e-3, 0},
};
#define N_LCASES ((int)(sizeof LCASES / sizeof LCASES[0]))

Test(cuda_parity_moe, losses_f32) {
    TT_SKIP_WITHOUT_CUDA();
    for (int i = 0; i < N_LCASES; i++) loss_parity(&LCASES[i], TM_F32);
}

Test(cuda_parity_moe, losses_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    for (int i = 0; i < N_LCASES; i++) loss_parity(&LCASES[i], TM_BF16);
}

/* ---- determinism ------------------------------------------------------------------------------ */

/* Two runs of each loss over 20000 tokens on CUDA: the values and the gradients agree bit for
 * bit (no float atomics anywhere in the losses). */
Test(cuda_parity_moe, losses_bitwise_reproducible) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t T = 20000, E = 64, n = T * E;
    int64_t s[2] = {T, E};
    double *h = tt_parity_uniform(n, 900), *hs = malloc(sizeof(double) * (size_t)n), hc[64];
    for (int64_t i = 0; i < n; i++) hs[i] = (h[i] + 2.0) * 0.25;
    for (int e = 0; e < 64; e++) hc[e] = (double)(1000 + (e * 97) % 600);
    double *hm = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) hm[i] = hs[i] < 0.1 ? 1.0 : 0.0;
    tm_tensor *scores, *logits, *counts, *map;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, s, tm_cuda(0), TM_F64, hs, &scores));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, s, tm_cuda(0), TM_F64, h, &logits));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &s[1], tm_cuda(0), TM_F64, hc, &counts));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_U8, 2, s, tm_cuda(0), TM_F64, hm, &map));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, scores, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, logits, 1));
    float val[2][3];
    float *grad[2][2];
    for (int rep = 0; rep < 2; rep++) {
        tm_tensor *aux, *seq, *z, *a, *b, *g;
        const double w = 0.3;
        TT_OK(ctx, tm_moe_aux_loss(ctx, scores, counts, 6, 1e-2, 0, &aux));
        TT_OK(ctx, tm_moe_seq_aux_loss(ctx, scores, map, 6, 1e-2, 8, &seq));
        TT_OK(ctx, tm_moe_z_loss(ctx, logits, 1e-3, &z));
        TT_OK(ctx, tm_add(ctx, aux, seq, &a));
        TT_OK(ctx, tm_add(ctx, a, z, &b));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 0, NULL, tm_cuda(0), TM_F64, &w, &g));
        TT_OK(ctx, tm_backward_with_grad(ctx, b, g));
        TT_OK(ctx, tm_tensor_read(ctx, aux, TM_F32, &val[rep][0], 1));
        TT_OK(ctx, tm_tensor_read(ctx, seq, TM_F32, &val[rep][1], 1));
        TT_OK(ctx, tm_tensor_read(ctx, z, TM_F32, &val[rep][2], 1));
        grad[rep][0] = malloc(sizeof(float) * (size_t)n);
        grad[rep][1] = malloc(sizeof(float) * (size_t)n);
        TT_OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(scores), TM_F32, grad[rep][0], n));
        TT_OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(logits), TM_F32, grad[rep][1], n));
        TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(scores), 0.0));
        TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(logits), 0.0));
    }
    const char *names[3] = {"aux loss", "seq aux loss", "z loss"};
    for (int i = 0; i < 3; i++)
        cr_assert(memcmp(&val[0][i], &val[1][i], sizeof(float)) == 0, "%s differs between two runs: %.9g vs %.9g",
                  names[i], val[0][i], val[1][i]);
    cr_assert(val[0][0] != 0.0f && val[0][2] != 0.0f, "degenerate losses: %g %g", val[0][0], val[0][2]);
    cr_assert(memcmp(grad[0][0], grad[1][0], sizeof(float) * (size_t)n) == 0, "d scores differs between two runs");
    cr_assert(memcmp(grad[0][1], grad[1][1], sizeof(float) * (size_t)n) == 0, "d logits differs between two runs");
    for (int r = 0; r < 2; r++) free(grad[r][0]), free(grad[r][1]);
    free(h), free(hs), free(hm);
    tm_ctx_free(ctx);
}
