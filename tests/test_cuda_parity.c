/*
 * test_cuda_parity.c — every CUDA kernel against its CPU kernel, forward and backward: the same
 * op runs on CPU and CUDA tensors made from identical host data, backward with the same random
 * upstream gradient; outputs and input gradients must agree. Plus: the arena reaches a steady
 * state on CUDA (a second identical step makes no system allocation), reductions are bitwise
 * reproducible, and mixing devices or passing a bad target fails with a message.
 *
 * Tolerances (|cuda - cpu| <= atol + rtol * |cpu|):
 *   f32   atol 1e-5, rtol 1e-5: both compute in f32 (the CPU reductions in f64, cuBLASLt with
 *         CUBLAS_COMPUTE_32F, not TF32), so only the summation order differs.
 *   bf16  atol 1e-2, rtol 1e-2: both compute in f32 from the same bf16 inputs; a result
 *         that lands near a rounding boundary may round to neighbouring bf16 values (2^-8).
 * Every test skips when no CUDA device is visible.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"
#include "parity.h"

/* ---- cases ---------------------------------------------------------------------------------- */

static tm_status f_matmul(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_matmul(c, in[0], in[1], (int)a[0], (int)a[1], o);
}
/* a @ b + a @ c: a's gradient is written fresh by the second product's backward (it runs first,
 * call->gin_fresh, beta = 0) and added to by the first's (beta = 1) */
static tm_status f_matmul_two(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *p, *q;
    tm_status st = tm_matmul(c, in[0], in[1], (int)a[0], (int)a[1], &p);
    if (!st) st = tm_matmul(c, in[0], in[2], (int)a[0], (int)a[1], &q);
    return st ? st : tm_add(c, p, q, o);
}
static tm_status f_add(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) { return tm_add(c, in[0], in[1], o); }
static tm_status f_sub(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) { return tm_sub(c, in[0], in[1], o); }
static tm_status f_mul(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) { return tm_mul(c, in[0], in[1], o); }
static tm_status f_scale(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) { return tm_scale(c, in[0], -0.37, o); }
static tm_status f_scale_rows(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_scale_rows(c, in[0], in[1], o);
}
/* f32 weights whatever the rows' dtype (the MoE block's bf16 rows times f32 router weights);
 * the cast is differentiable, so the weights' gradient comes back through it. */
static tm_status f_scale_rows_f32w(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *w;
    tm_status st = tm_cast(c, in[1], TM_F32, &w);
    return st ? st : tm_scale_rows(c, in[0], w, o);
}
/* The router's gating GEMM with f32 w whatever the inputs' dtype (bf16 x: the mixed path); the
 * casts bring w's gradient back and give the f32 logits the harness's dtype. */
static tm_status f_moe_gating(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *w, *l;
    tm_status st = tm_cast(c, in[1], TM_F32, &w);
    if (!st) st = tm_moe_gating(c, in[0], w, &l);
    return st ? st : tm_cast(c, l, tm_tensor_dtype(in[0]), o);
}
/* gating(x, w) + gating(x, -w / 2): the first backward to run writes dx, the second adds to it */
static tm_status f_moe_gating_two(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *w, *w2, *p, *q, *s;
    tm_status st = tm_cast(c, in[1], TM_F32, &w);
    if (!st) st = tm_scale(c, w, -0.5, &w2);
    if (!st) st = tm_moe_gating(c, in[0], w, &p);
    if (!st) st = tm_moe_gating(c, in[0], w2, &q);
    if (!st) st = tm_add(c, p, q, &s);
    return st ? st : tm_cast(c, s, tm_tensor_dtype(in[0]), o);
}
/* gating(x1, w) + gating(x2, w), x2 = in[2]: the second backward to run adds into dw */
static tm_status f_moe_gating_shared_w(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *w, *p, *q, *s;
    tm_status st = tm_cast(c, in[1], TM_F32, &w);
    if (!st) st = tm_moe_gating(c, in[0], w, &p);
    if (!st) st = tm_moe_gating(c, in[2], w, &q);
    if (!st) st = tm_add(c, p, q, &s);
    return st ? st : tm_cast(c, s, tm_tensor_dtype(in[0]), o);
}
static tm_status f_sum(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_sum(c, in[0], (int)a[0], (int)a[1], o);
}
static tm_status f_mean(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_mean(c, in[0], (int)a[0], (int)a[1], o);
}
static tm_status f_sum_all(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) { return tm_sum_all(c, in[0], o); }
static tm_status f_mean_all(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) { return tm_mean_all(c, in[0], o); }
static tm_status f_silu(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) { return tm_silu(c, in[0], o); }
static tm_status f_swiglu(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_swiglu(c, in[0], in[1], o);
}
/* swiglu on dense views whose data start one element past an aligned address (x[1:] of a
 * 1-D tensor, reshaped): 64 elements, a multiple of 8, yet the kernels must take the
 * one-element path. */
static tm_status f_swiglu_misaligned(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    int64_t shape[2] = {8, 8};
    tm_tensor *v[2];
    for (int k = 0; k < 2; k++) {
        tm_tensor *t;
        tm_status st = tm_slice(c, in[k], 0, 1, 65, &t);
        if (!st) st = tm_reshape(c, t, 2, shape, &v[k]);
        if (st) return st;
    }
    return tm_swiglu(c, v[0], v[1], o);
}
/* swiglu(g, u) + swiglu(u, g): the second call's backward (run first) writes both gradients
 * fresh, the first's adds into them */
static tm_status f_swiglu_two(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *p, *q;
    tm_status st = tm_swiglu(c, in[0], in[1], &p);
    if (!st) st = tm_swiglu(c, in[1], in[0], &q);
    return st ? st : tm_add(c, p, q, o);
}
/* gate and up one tensor: the backward's dgate and dup are the same gradient buffer. */
static tm_status f_swiglu_same(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_swiglu(c, in[0], in[0], o);
}
/* Only one input of swiglu needs a gradient (a[0] = which): the other is a copy made with
 * grad mode off; the output adds the raw input back so the harness still finds a gradient
 * for it. */
static tm_status f_swiglu_one_grad(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    int k = (int)a[0];
    tm_tensor *frozen, *y;
    int prev = tm_ctx_set_grad_enabled(c, 0);
    tm_status st = tm_scale(c, in[1 - k], 1.0, &frozen);
    tm_ctx_set_grad_enabled(c, prev);
    if (!st) st = k == 0 ? tm_swiglu(c, in[0], frozen, &y) : tm_swiglu(c, frozen, in[1], &y);
    return st ? st : tm_add(c, y, in[1 - k], o);
}
/* grouped_swiglu over in[0] x [R,K], in[1] w_gate, in[2] w_up [G,K,F], with counts made here
 * (the harness's index inputs are uniform draws; counts must sum to R): a[0] picks the set. Both
 * sets have empty groups (first, middle, last) and a one-row group. */
static tm_status f_grouped_swiglu(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    static const int64_t sets[2][8] = {{0, 4, 0, 1, 6, 0, 3, 0}, {5, 0, 2, 0, 1, 0, 0, 6}};
    int64_t G = 8;
    tm_tensor *counts;
    tm_status st = tm_tensor_from_host(c, TM_I64, 1, &G, tm_tensor_device(in[0]), TM_I64, sets[a[0]], &counts);
    return st ? st : tm_grouped_swiglu(c, in[0], in[1], in[2], counts, o);
}
/* grouped_mlp over in[0] x [R,K], in[1] w_gate, in[2] w_up [G,K,F], in[3] w_down [G,F,N], with
 * f_grouped_swiglu's counts sets (a[0] picks) */
static tm_status f_grouped_mlp(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    static const int64_t sets[2][8] = {{0, 4, 0, 1, 6, 0, 3, 0}, {5, 0, 2, 0, 1, 0, 0, 6}};
    int64_t G = 8;
    tm_tensor *counts;
    tm_status st = tm_tensor_from_host(c, TM_I64, 1, &G, tm_tensor_device(in[0]), TM_I64, sets[a[0]], &counts);
    return st ? st : tm_grouped_mlp(c, in[0], in[1], in[2], in[3], counts, o);
}
static tm_status f_rmsnorm(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_rmsnorm(c, in[0], in[1], 1e-5, o);
}
static tm_status f_softmax(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) { return tm_softmax(c, in[0], o); }
static tm_status f_log_softmax(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_log_softmax(c, in[0], o);
}
static tm_status f_cross_entropy(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_cross_entropy(c, in[0], in[1], a[0], o);
}

/* Fresh gradients (call->gin_fresh, TM__OP_GRAD_WRITES), then added: in each case below a
 * tensor has several consumers; the one whose backward runs first writes its gradient without
 * reading it, the others add to it (the single-op cases above take the fresh path alone, their
 * inputs being leaves without a gradient). */
/* a * b + (0.5 a - b) + silu(a), b broadcast over a's rows: silu writes a's gradient, scale
 * and mul add; the sub writes b's (a fixed-order reduction with accumulate 0), mul adds */
static tm_status f_ew_two(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *p, *h, *q, *r, *t;
    tm_status st = tm_mul(c, in[0], in[1], &p);
    if (!st) st = tm_scale(c, in[0], 0.5, &h);
    if (!st) st = tm_sub(c, h, in[1], &q);
    if (!st) st = tm_add(c, p, q, &r);
    if (!st) st = tm_silu(c, in[0], &t);
    return st ? st : tm_add(c, r, t, o);
}
/* x + x and x * x: one tensor in both slots, never fresh (the second slot adds to the first) */
static tm_status f_add_same(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) { return tm_add(c, in[0], in[0], o); }
static tm_status f_mul_same(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) { return tm_mul(c, in[0], in[0], o); }
/* h1 = rmsnorm(x, w); (s, h2) = add_rmsnorm(x, h1, w); scale_rows(s, p) + h2: add_rmsnorm
 * writes x's, h1's and w's gradients, rmsnorm adds to x's and w's */
static tm_status f_norm_two(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *h1, *s, *h2, *r;
    tm_status st = tm_rmsnorm(c, in[0], in[1], 1e-5, &h1);
    if (!st) st = tm_add_rmsnorm(c, in[0], h1, in[1], 1e-5, &s, &h2);
    if (!st) st = tm_scale_rows(c, s, in[2], &r);
    return st ? st : tm_add(c, r, h2, o);
}
/* concat(softmax(x), log_softmax(x), contiguous(x^T) reshaped) along columns: softmax writes x's
 * gradient, log_softmax and the transpose add; concat writes its parts', contiguous its input's */
static tm_status f_softmax_concat_two(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    const int64_t R = tm_tensor_dim(in[0], 0), C = tm_tensor_dim(in[0], 1);
    int64_t shape[2] = {R, C};
    tm_tensor *t, *ct, *r, *ls, *sm;
    tm_status st = tm_transpose(c, in[0], 0, 1, &t);
    if (!st) st = tm_contiguous(c, t, &ct);
    if (!st) st = tm_reshape(c, ct, 2, shape, &r);
    if (!st) st = tm_log_softmax(c, in[0], &ls);
    if (!st) st = tm_softmax(c, in[0], &sm);
    tm_tensor *parts[3] = {sm, ls, r};
    return st ? st : tm_concat(c, 3, parts, 1, o);
}
/* cross_entropy(l + 0.5 l): cross-entropy writes its logits' gradient (zeros on the ignored
 * row), the add writes l's, the scale adds */
static tm_status f_ce_two(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *h, *l;
    tm_status st = tm_scale(c, in[0], 0.5, &h);
    if (!st) st = tm_add(c, in[0], h, &l);
    return st ? st : tm_cross_entropy(c, l, in[1], a[0], o);
}

/* Device-generic ops (views, concat, contiguous, cast, to_device) run through tm__assign /
 * tm__copy_into / tm__accumulate, which the CUDA backend implements with strided kernels. */
static tm_status f_view(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    int perm[3] = {2, 0, 1};
    tm_tensor *p, *s;
    int64_t shape[2] = {-1, 3};
    tm_status st = tm_permute(c, in[0], perm, &p); /* strided view: backward writes a strided dst */
    if (!st) st = tm_slice(c, p, 0, 1, 4, &s);
    if (!st) st = tm_reshape(c, s, 2, shape, o);
    return st;
}
static tm_status f_concat(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *t;
    tm_status st = tm_transpose(c, in[1], 0, 1, &t);
    tm_tensor *xs[2] = {in[0], t};
    return st ? st : tm_concat(c, 2, xs, 1, o);
}
static tm_status f_contiguous(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *t;
    tm_status st = tm_transpose(c, in[0], 0, 2, &t);
    return st ? st : tm_contiguous(c, t, o);
}
/* (B, S, H, D) -> (B, H, S, D), as attention lays out its heads: the last dimension keeps
 * stride 1, so with D a multiple of 8 the copy, the transpose's backward (a strided
 * accumulate) and contiguous's backward take the copy kernels' vector path. */
static tm_status f_head_transpose(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *t;
    tm_status st = tm_transpose(c, in[0], 1, 2, &t);
    return st ? st : tm_contiguous(c, t, o);
}
/* Columns [a[0], a[0] + 16) of a (rows, 48) input, as a fused projection is split: a[0] = 16
 * is a 16-byte aligned strided view (vector path), a[0] = 1 is not (element path). */
static tm_status f_slice_cols(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *t;
    tm_status st = tm_slice(c, in[0], 1, a[0], a[0] + 16, &t);
    return st ? st : tm_contiguous(c, t, o);
}
static tm_status f_cast(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_dtype dt = tm_tensor_dtype(in[0]), other = dt == TM_F32 ? TM_BF16 : TM_F32;
    tm_tensor *t;
    tm_status st = tm_cast(c, in[0], other, &t);
    return st ? st : tm_cast(c, t, dt, o);
}
static tm_status f_to_device(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    tm_tensor *h, *t;
    tm_status st = tm_to_device(c, in[0], tm_cpu(), &h); /* device -> host -> device */
    if (!st) st = tm_transpose(c, h, 0, 1, &t);
    return st ? st : tm_to_device(c, t, tm_tensor_device(in[0]), o);
}

/* Shapes are awkward on purpose (no multiples of 4 or 32); the large ones take the split
 * (two-pass) paths of the CUDA reducer and the multi-pass row loops. */
static const tt_pcase CASES[] = {
    {"matmul", "matmul nn, a batched, b 2-D", f_matmul, 2, {3, 2}, {{3, 5, 7}, {7, 6}}, {0}, {0}, {0, 0}, 1, 0},
    {"matmul", "matmul tt, a batched, b 2-D", f_matmul, 2, {3, 2}, {{3, 7, 5}, {6, 7}}, {0}, {0}, {1, 1}, 1, 0},
    {"matmul", "matmul tn, batched b", f_matmul, 2, {3, 3}, {{2, 7, 5}, {2, 7, 9}}, {0}, {0}, {1, 0}, 1, 0},
    {"matmul", "matmul nt, 2-D", f_matmul, 2, {2, 2}, {{33, 19}, {21, 19}}, {0}, {0}, {0, 1}, 1, 0},
    {"matmul", "matmul nn, 4-D batched", f_matmul, 2, {4, 4}, {{2, 3, 5, 7}, {2, 3, 7, 3}}, {0}, {0}, {0, 0}, 1, 0},
    {"matmul", "a @ b + a @ c (fresh, then added)", f_matmul_two, 3, {2, 2, 2}, {{9, 7}, {7, 6}, {7, 6}}, {0}, {0}, {0, 0}, 1, 0},
    {"matmul", "a^T b + a^T c, a batched (fresh, then added)", f_matmul_two, 3, {3, 2, 2}, {{3, 7, 5}, {7, 6}, {7, 6}}, {0}, {0}, {1, 0}, 1, 0},
    {"add", "add same shape", f_add, 2, {2, 2}, {{3, 7}, {3, 7}}, {0}, {0}, {0}, 1, 0},
    {"add", "add [4,5,6] + [6]", f_add, 2, {3, 1}, {{4, 5, 6}, {6}}, {0}, {0}, {0}, 1, 0},
    {"add", "add [6] + [4,5,6]", f_add, 2, {1, 3}, {{6}, {4, 5, 6}}, {0}, {0}, {0}, 1, 0},
    {"sub", "sub [4,5,6] - [5,6]", f_sub, 2, {3, 2}, {{4, 5, 6}, {5, 6}}, {0}, {0}, {0}, 1, 0},
    {"sub", "sub [5,6] - [4,5,6]", f_sub, 2, {2, 3}, {{5, 6}, {4, 5, 6}}, {0}, {0}, {0}, 1, 0},
    {"mul", "mul same shape", f_mul, 2, {2, 2}, {{3, 7}, {3, 7}}, {0}, {0}, {0}, 1, 0},
    {"mul", "mul [5,6] * [4,5,6]", f_mul, 2, {2, 3}, {{5, 6}, {4, 5, 6}}, {0}, {0}, {0}, 1, 0},
    {"mul", "mul [3001,5] * [5] (split reduce)", f_mul, 2, {2, 1}, {{3001, 5}, {5}}, {0}, {0}, {0}, 100, 0},
    {"scale", "scale", f_scale, 1, {2}, {{5, 7}}, {0}, {0}, {0}, 1, 0},
    {"moe_gating", "moe_gating, T and H odd", f_moe_gating, 2, {2, 2}, {{37, 24}, {24, 5}}, {0}, {0}, {0}, 1, 0},
    {"moe_gating", "moe_gating, 300 tokens, 19 experts, H 70", f_moe_gating, 2, {2, 2}, {{300, 70}, {70, 19}}, {0}, {0}, {0}, 10, 0},
    {"moe_gating", "moe_gating twice on one x (dx added to)", f_moe_gating_two, 2, {2, 2}, {{130, 24}, {24, 6}}, {0}, {0}, {0}, 1, 0},
    {"moe_gating", "moe_gating, 45 experts", f_moe_gating, 2, {2, 2}, {{70, 40}, {40, 45}}, {0}, {0}, {0}, 10, 0},
    /* bf16 x with H a multiple of 8 runs the direct kernels (kernels/cuda/moe_gating.cu): several
     * forward stages and partial-sum chunks, a ragged last token tile; E <= 8 (more experts: cuBLASLt) */
    {"moe_gating", "moe_gating, 1000 tokens, H 264, 8 experts", f_moe_gating, 2, {2, 2}, {{1000, 264}, {264, 8}}, {0}, {0}, {0}, 10, 0},
    {"moe_gating", "moe_gating, 515 tokens, H 136, 70 experts", f_moe_gating, 2, {2, 2}, {{515, 136}, {136, 70}}, {0}, {0}, {0}, 10, 0},
    {"moe_gating", "moe_gating of two inputs, one w (dw added to)", f_moe_gating_shared_w, 3, {2, 2, 2}, {{300, 72}, {72, 5}, {300, 72}}, {0}, {0}, {0}, 10, 0},
    {"scale_rows", "scale_rows", f_scale_rows, 2, {2, 1}, {{13, 7}, {13}}, {0}, {0}, {0}, 1, 0},
    {"scale_rows", "scale_rows, rows longer than a warp", f_scale_rows, 2, {2, 1}, {{5, 300}, {5}}, {0}, {0}, {0}, 10, 0},
    {"scale_rows", "scale_rows, f32 weights", f_scale_rows_f32w, 2, {2, 1}, {{9, 40}, {9}}, {0}, {0}, {0}, 1, 0},
    {"sum", "sum axis 1", f_sum, 1, {3}, {{3, 5, 7}}, {0}, {0}, {1, 0}, 1, 0},
    {"sum", "sum axis -1 keepdim", f_sum, 1, {3}, {{3, 5, 7}}, {0}, {0}, {-1, 1}, 1, 0},
    {"sum", "sum axis 0 long (split)", f_sum, 1, {2}, {{3001, 5}}, {0}, {0}, {0, 0}, 100, 0},
    {"mean", "mean axis 0 keepdim", f_mean, 1, {3}, {{3, 5, 7}}, {0}, {0}, {0, 1}, 1, 0},
    {"mean", "mean axis 1 long row (split)", f_mean, 1, {2}, {{2, 5003}}, {0}, {0}, {1, 0}, 1, 0},
    {"sum_all", "sum_all", f_sum_all, 1, {3}, {{3, 5, 7}}, {0}, {0}, {0}, 1, 0},
    {"sum_all", "sum_all long (split)", f_sum_all, 1, {1}, {{70001}}, {0}, {0}, {0}, 100, 0},
    {"mean_all", "mean_all", f_mean_all, 1, {2}, {{13, 11}}, {0}, {0}, {0}, 1, 0},
    /* grouped_swiglu (R = 14, 8 groups, ragged with empty ones): K and F multiples of 8, so bf16
     * may take the one-launch Hopper path where the context's grouped_gemm mode allows it. In
     * bf16 the CPU and CUDA round the intermediates a, b (f32 sums in different orders) and da, db
     * (different exp) to bf16 each; one that lands on the neighbouring value moves by 2^-8 of
     * itself (|da| up to ~30 with these uniform [-2, 2) inputs) and so moves the dx and dw sums
     * it enters by up to ~0.25, which near a sum's zero no rtol covers: atol scale 50 (bf16 0.5;
     * f32 5e-4, above the f32 sums' O(1e-4) order differences at these magnitudes). */
    {"grouped_swiglu", "grouped_swiglu, ragged counts with empty groups", f_grouped_swiglu, 3, {2, 3, 3}, {{14, 16}, {8, 16, 24}, {8, 16, 24}}, {0}, {0}, {0}, 50, 0},
    {"grouped_swiglu", "grouped_swiglu, other counts, K 24 F 8", f_grouped_swiglu, 3, {2, 3, 3}, {{14, 24}, {8, 24, 8}, {8, 24, 8}}, {0}, {0}, {1}, 50, 0},
    /* grouped_mlp: grouped_swiglu's rows and then the down projection, whose sums take the
     * intermediates' bf16 differences (h as a and b, dh) once more, over F terms: the same scale
     * on smaller K and F (the values' magnitude grows with both) */
    {"grouped_mlp", "grouped_mlp, ragged counts with empty groups", f_grouped_mlp, 4, {2, 3, 3, 3}, {{14, 8}, {8, 8, 16}, {8, 8, 16}, {8, 16, 8}}, {0}, {0}, {0}, 50, 0},
    {"grouped_mlp", "grouped_mlp, other counts, K 16 F 8 N 24", f_grouped_mlp, 4, {2, 3, 3, 3}, {{14, 16}, {8, 16, 8}, {8, 16, 8}, {8, 8, 24}}, {0}, {0}, {1}, 50, 0},
    {"silu", "silu", f_silu, 1, {2}, {{5, 7}}, {0}, {0}, {0}, 1, 0},
    {"swiglu", "swiglu", f_swiglu, 2, {2, 2}, {{4, 9}, {4, 9}}, {0}, {0}, {0}, 1, 0},
    /* the elementwise kernels move 16 bytes per access when n is a multiple of 8 (bf16) or
     * 4 (f32) and every pointer is 16-byte aligned, else one element (kernels/cuda/activation.cu) */
    {"silu", "silu, 16-byte vectors", f_silu, 1, {3}, {{3, 8, 40}}, {0}, {0}, {0}, 1, 0},
    {"swiglu", "swiglu, 16-byte vectors", f_swiglu, 2, {3, 3}, {{3, 8, 40}, {3, 8, 40}}, {0}, {0}, {0}, 1, 0},
    {"swiglu", "swiglu, odd size (one element per access)", f_swiglu, 2, {2, 2}, {{5, 7}, {5, 7}}, {0}, {0}, {0}, 1, 0},
    {"swiglu", "swiglu, misaligned views (one element per access)", f_swiglu_misaligned, 2, {1, 1}, {{65}, {65}}, {0}, {0}, {0}, 1, 0},
    {"swiglu", "swiglu(x, x), 16-byte vectors", f_swiglu_same, 1, {2}, {{16, 24}}, {0}, {0}, {0}, 1, 0},
    {"swiglu", "swiglu(g, u) + swiglu(u, g) (fresh, then added), 16-byte vectors", f_swiglu_two, 2, {2, 2}, {{16, 24}, {16, 24}}, {0}, {0}, {0}, 1, 0},
    {"swiglu", "swiglu(g, u) + swiglu(u, g), odd size", f_swiglu_two, 2, {2, 2}, {{5, 7}, {5, 7}}, {0}, {0}, {0}, 1, 0},
    {"swiglu", "swiglu, gate gradient only, 16-byte vectors", f_swiglu_one_grad, 2, {2, 2}, {{16, 24}, {16, 24}}, {0}, {0}, {0}, 1, 0},
    {"swiglu", "swiglu, up gradient only, 16-byte vectors", f_swiglu_one_grad, 2, {2, 2}, {{16, 24}, {16, 24}}, {0}, {0}, {1}, 1, 0},
    {"swiglu", "swiglu, gate gradient only, odd size", f_swiglu_one_grad, 2, {2, 2}, {{5, 7}, {5, 7}}, {0}, {0}, {0}, 1, 0},
    {"rmsnorm", "rmsnorm", f_rmsnorm, 2, {3, 1}, {{3, 4, 37}, {37}}, {0}, {0}, {0}, 1, 0},
    {"rmsnorm", "rmsnorm many rows (split dw)", f_rmsnorm, 2, {2, 1}, {{1501, 9}, {9}}, {0}, {0}, {0}, 100, 0},
    {"rmsnorm", "rmsnorm wide row", f_rmsnorm, 2, {2, 1}, {{3, 1100}, {1100}}, {0}, {0}, {0}, 1, 0},
    /* N > 2048: the backward's blocks take 2 rows each and sum dw in registers, the last
     * block one row (kernels/cuda/rmsnorm.cu) */
    {"rmsnorm", "rmsnorm, dw summed over row ranges", f_rmsnorm, 2, {2, 1}, {{2049, 40}, {40}}, {0}, {0}, {0}, 100, 0},
    {"rmsnorm", "rmsnorm, dw over row ranges, odd C", f_rmsnorm, 2, {2, 1}, {{4101, 13}, {13}}, {0}, {0}, {0}, 100, 0},
    {"rmsnorm", "rmsnorm, rows of whole 16-byte groups", f_rmsnorm, 2, {2, 1}, {{6, 96}, {96}}, {0}, {0}, {0}, 1, 0},
    {"softmax", "softmax", f_softmax, 1, {2}, {{6, 17}}, {0}, {0}, {0}, 1, 0},
    {"softmax", "softmax wide row", f_softmax, 1, {2}, {{3, 1100}}, {0}, {0}, {0}, 1, 0},
    {"log_softmax", "log_softmax", f_log_softmax, 1, {3}, {{2, 3, 17}}, {0}, {0}, {0}, 1, 0},
    {"cross_entropy", "cross_entropy i64 targets", f_cross_entropy, 2, {2, 1}, {{7, 13}, {7}}, {0, TM_I64}, {0, 1}, {-100}, 1, 0},
    {"cross_entropy", "cross_entropy i32 targets, wide", f_cross_entropy, 2, {2, 1}, {{5, 1037}, {5}}, {0, TM_I32}, {0, 1}, {-100}, 1, 0},
    /* fresh gradients, then added (see f_ew_two and the cases after it) */
    {"add", "a * b + (0.5 a - b) + silu(a), b broadcast (fresh, then added)", f_ew_two, 2, {2, 1}, {{3, 7}, {7}}, {0}, {0}, {0}, 1, 0},
    {"add", "a * b + (0.5 a - b) + silu(a), 16-byte vectors (fresh, then added)", f_ew_two, 2, {2, 1}, {{8, 40}, {40}}, {0}, {0}, {0}, 1, 0},
    {"add", "x + x (not fresh)", f_add_same, 1, {2}, {{5, 7}}, {0}, {0}, {0}, 1, 0},
    {"mul", "x * x (not fresh)", f_mul_same, 1, {2}, {{5, 7}}, {0}, {0}, {0}, 1, 0},
    {"rmsnorm", "rmsnorm + add_rmsnorm + scale_rows (fresh, then added)", f_norm_two, 3, {2, 1, 1}, {{5, 37}, {37}, {5}}, {0}, {0}, {0}, 1, 0},
    {"rmsnorm", "rmsnorm + add_rmsnorm + scale_rows, 16-byte groups (fresh, then added)", f_norm_two, 3, {2, 1, 1}, {{6, 96}, {96}, {6}}, {0}, {0}, {0}, 1, 0},
    {"softmax", "concat(softmax(x), log_softmax(x), contiguous(x^T)) (fresh, then added)", f_softmax_concat_two, 1, {2}, {{6, 17}}, {0}, {0}, {0}, 1, 0},
    {"cross_entropy", "cross_entropy(l + 0.5 l), an ignored row (fresh, then added)", f_ce_two, 2, {2, 1}, {{7, 13}, {7}}, {0, TM_I64}, {0, 1}, {-100}, 1, 0},
    {"view", "view: permute, slice, reshape", f_view, 1, {3}, {{2, 3, 5}}, {0}, {0}, {0}, 1, 0},
    {"concat", "concat with a transposed input", f_concat, 2, {2, 2}, {{3, 2}, {5, 3}}, {0}, {0}, {0}, 1, 0},
    {"contiguous", "contiguous of a transpose", f_contiguous, 1, {3}, {{3, 2, 5}}, {0}, {0}, {0}, 1, 0},
    {"cast", "cast f32 <-> bf16", f_cast, 1, {2}, {{4, 7}}, {0}, {0}, {0}, 1, 0},
    /* the copy kernels' vector path (kernels/cuda/copy.cu: 16-byte accesses on strided views
     * whose last dimension has stride 1) and its element-path twins */
    {"contiguous", "contiguous of a head transpose, vector path", f_head_transpose, 1, {4}, {{2, 5, 3, 16}}, {0}, {0}, {0}, 1, 0},
    {"contiguous", "contiguous of a transpose with a unit dimension", f_contiguous, 1, {4}, {{3, 1, 4, 8}}, {0}, {0}, {0}, 1, 0},
    {"contiguous", "contiguous of a head transpose, D 12 (bf16: element path)", f_head_transpose, 1, {4}, {{2, 5, 3, 12}}, {0}, {0}, {0}, 1, 0},
    {"contiguous", "aligned column slice, vector path", f_slice_cols, 1, {2}, {{6, 48}}, {0}, {0}, {16}, 1, 0},
    {"contiguous", "misaligned column slice (element path)", f_slice_cols, 1, {2}, {{6, 48}}, {0}, {0}, {1}, 1, 0},
    {"cast", "cast f32 <-> bf16, vector path", f_cast, 1, {2}, {{4, 16}}, {0}, {0}, {0}, 1, 0},
    {"to_device", "to_device round trip", f_to_device, 1, {2}, {{4, 7}}, {0}, {0}, {0}, 1, 0},
};
#define N_CASES ((int)(sizeof CASES / sizeof CASES[0]))

/* Every op that the registry (framework/ops.def) gives a CUDA kernel has a parity test (a case
 * in CASES, or TT_PARITY_COVERS in a family's parity file), as tests/test_mutation.c demands a
 * gradient case of every differentiable op. Runs without a GPU. */
Test(cuda_parity, every_cuda_op_has_a_parity_case) {
    for (int i = 0; i < TM__NOPS; i++) {
        const tm__op_def *d = &tm__op_table[i];
        if (!(d->kernels & (TM__K_CUDA_FWD | TM__K_CUDA_BWD))) continue;
        int found = tt_parity_covered(d->name);
        for (int k = 0; k < N_CASES; k++) found |= strcmp(CASES[k].op, d->name) == 0;
        cr_assert(found, "op %s has CUDA kernels but no parity test: add a case to CASES in "
                         "tests/test_cuda_parity.c, or TT_PARITY_COVERS(\"%s\") beside its test", d->name, d->name);
    }
}

Test(cuda_parity, all_ops_f32) {
    TT_SKIP_WITHOUT_CUDA();
    for (int k = 0; k < N_CASES; k++) tt_parity_run(&CASES[k], TM_F32, 1e-5, 1e-5);
}

Test(cuda_parity, all_ops_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    for (int k = 0; k < N_CASES; k++) tt_parity_run(&CASES[k], TM_BF16, 1e-2, 1e-2);
}

/* tm_moe_gating's split path (kernels/cuda/moe_gating.cu: bf16 GEMMs on a three-term bf16 split of
 * w or of dlogits; on by default, but the parity context turns it off unless tt_parity_gating_split
 * says otherwise, so that all_ops_bf16 keeps checking the cuBLASLt path): the moe_gating cases in
 * bf16 with it on,
 * against the CPU, and proof that it ran (the cases with at most 8 experts and H a multiple of 8
 * take the direct kernels; three cases do not). */
Test(cuda_parity, moe_gating_split_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    tt_parity_gating_split = 1;
    tt_parity_gating_split_n = 0;
    for (int k = 0; k < N_CASES; k++)
        if (strcmp(CASES[k].op, "moe_gating") == 0) tt_parity_run(&CASES[k], TM_BF16, 1e-2, 1e-2);
    tt_parity_gating_split = 0;
    cr_assert_geq(tt_parity_gating_split_n, 3, "the split path ran %llu times, want >= 3",
                  (unsigned long long)tt_parity_gating_split_n);
}

/* The split path at f32 accuracy, where the bf16 parity above cannot see it (it compares logits
 * rounded to bf16): logits and dw against f64 sums of the same bf16 x, f32 w and f32 dlogits,
 * within n 2^-23 of the sum of the n terms' magnitudes (twice Higham's bound for an f32 sum of n
 * terms in any order, n u: room for tensor cores that truncate their f32 additions; the split's
 * dropped products are below 2^-24 of each term), dx (bf16) within a bf16 step (2^-8) of the f64
 * value plus that. An operand used at bf16 precision would be off by about 2^-9 of the terms' root
 * sum of squares, some 10 times the limit at n 136. The cuBLASLt f32 path (split off) is held to
 * the same bounds. */
/* got (M, N) against the f64 sums ref[i][j] = sum_k a[i ai + k ak] b[j bj + k bk] of K terms:
 * |got - ref| <= rel |ref| + K 2^-23 sum_k |a b|. */
static void gating_check(const char *what, int split, const double *got, int M, int N, int K, const double *a, int ai, int ak,
                         const double *b, int bj, int bk, double rel) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double ref = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                const double term = a[i * ai + k * ak] * b[j * bj + k * bk];
                ref += term, mag += fabs(term);
            }
            cr_assert_leq(fabs(got[i * N + j] - ref), rel * fabs(ref) + K * 0x1p-23 * mag + 1e-30,
                          "split %d: %s[%d][%d] %.9g, f64 %.9g (sum of |terms| %.3g)", split, what, i, j, got[i * N + j], ref, mag);
        }
}
static void gating_accuracy(int split) {
    enum { T = 300, H = 136, E = 40 };
    tm_ctx *ctx = tt_parity_ctx();
    tm__gating_set_split(ctx, split);
    double *xv = tt_parity_uniform(T * H, 11), *wv = tt_parity_uniform(H * E, 12), *gv = tt_parity_uniform(T * E, 13);
    for (int i = 0; i < T * H; i++) xv[i] = (double)(float)xv[i]; /* rounded to bf16 below: read back */
    for (int i = 0; i < H * E; i++) wv[i] = (double)(float)(wv[i] / 3.0); /* values with 24-bit mantissas */
    for (int i = 0; i < T * E; i++) gv[i] = (double)(float)(gv[i] / 7.0);
    const int64_t xs[2] = {T, H}, ws[2] = {H, E}, gs[2] = {T, E};
    tm_tensor *x, *w, *g, *y;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_BF16, 2, xs, tm_cuda(0), TM_F64, xv, &x));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, ws, tm_cuda(0), TM_F64, wv, &w));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, gs, tm_cuda(0), TM_F64, gv, &g));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    const uint64_t before = tm__gating_split_launches(ctx);
    TT_OK(ctx, tm_moe_gating(ctx, x, w, &y));
    cr_assert_eq(tm__gating_split_launches(ctx) - before, (uint64_t)(split ? 1 : 0), "split %d: the path that ran", split);
    TT_OK(ctx, tm_backward_with_grad(ctx, y, g));
    double *xb = tt_read(ctx, x), *yl = tt_read(ctx, y), *dx = tt_read(ctx, tm_tensor_grad(x)), *dw = tt_read(ctx, tm_tensor_grad(w));
    /* logits = x w, dw = x^T dlogits, dx = dlogits w^T */
    gating_check("logits", split, yl, T, E, H, xb, H, 1, wv, 1, E, 0.0);
    gating_check("dw", split, dw, H, E, T, xb, 1, H, gv, 1, E, 0.0);
    gating_check("dx", split, dx, T, H, E, gv, E, 1, wv, E, 1, 0x1p-8);
    free(xv), free(wv), free(gv), free(xb), free(yl), free(dx), free(dw);
    tm_ctx_free(ctx);
}
Test(cuda_parity, moe_gating_split_accuracy) {
    TT_SKIP_WITHOUT_CUDA();
    gating_accuracy(1);
    gating_accuracy(0);
}

/* ---- GEMM on misaligned data ---------------------------------------------------------------- */

/* x[1:] of a 1-D tensor, reshaped to (6, 9), is a dense view whose data starts one element
 * past an aligned address: 4-byte (f32) or 2-byte (bf16) alignment. cuBLASLt must be asked
 * for algorithms that accept that (the GEMM plan cache keys on pointer alignment). */
static void misaligned_gemm(tm_dtype dt, double atol, double rtol) {
    tm_ctx *ctx = tt_parity_ctx();
    int64_t n55 = 55, s69[2] = {6, 9}, sb[2] = {9, 5};
    double *ha = tt_parity_uniform(55, 3), *hb = tt_parity_uniform(45, 4);
    tm_tensor *base[2], *b[2], *a[2], *o[2];
    tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
    for (int k = 0; k < 2; k++) {
        tm_tensor *tail, *g;
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 1, &n55, devs[k], TM_F64, ha, &base[k]));
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, sb, devs[k], TM_F64, hb, &b[k]));
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, base[k], 1));
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, b[k], 1));
        TT_OK(ctx, tm_slice(ctx, base[k], 0, 1, 55, &tail));
        TT_OK(ctx, tm_reshape(ctx, tail, 2, s69, &a[k]));
        cr_assert(tm_tensor_is_contiguous(a[k]));
        TT_OK(ctx, tm_matmul(ctx, a[k], b[k], 0, 0, &o[k]));
        int64_t os[2] = {6, 5};
        double *hg = tt_parity_uniform(30, 6);
        TT_OK(ctx, tm_tensor_from_host(ctx, dt, 2, os, devs[k], TM_F64, hg, &g));
        TT_OK(ctx, tm_backward_with_grad(ctx, o[k], g));
        free(hg);
    }
    tt_assert_close(ctx, o[1], o[0], atol, rtol);
    tt_assert_close(ctx, tm_tensor_grad(base[1]), tm_tensor_grad(base[0]), atol, rtol);
    tt_assert_close(ctx, tm_tensor_grad(b[1]), tm_tensor_grad(b[0]), atol, rtol);
    free(ha), free(hb);
    tm_ctx_free(ctx);
}

Test(cuda_parity, matmul_misaligned_f32) {
    TT_SKIP_WITHOUT_CUDA();
    misaligned_gemm(TM_F32, 1e-5, 1e-5);
}
Test(cuda_parity, matmul_misaligned_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    misaligned_gemm(TM_BF16, 1e-2, 1e-2);
}

/* ---- determinism -------------------------------------------------------------------------- */

Test(cuda_parity, reductions_bitwise_reproducible) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t s[2] = {4001, 7};
    double *h = tt_parity_uniform(4001 * 7, 9);
    tm_tensor *x, *w, *y1, *y2, *l1, *l2;
    int64_t c7 = 7;
    double *hw = tt_parity_uniform(7, 10);
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, s, tm_cuda(0), TM_F64, h, &x));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 1, &c7, tm_cuda(0), TM_F64, hw, &w));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    float r1[7], r2[7], g1[7], g2[7];
    for (int rep = 0; rep < 2; rep++) {
        TT_OK(ctx, tm_sum(ctx, x, 0, 0, rep ? &y2 : &y1));
        TT_OK(ctx, tm_mul(ctx, x, w, rep ? &l2 : &l1));
        tm_tensor *loss;
        TT_OK(ctx, tm_sum_all(ctx, rep ? l2 : l1, &loss));
        TT_OK(ctx, tm_backward(ctx, loss));
        TT_OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(w), TM_F32, rep ? g2 : g1, 7));
        TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(w), 0.0));
    }
    TT_OK(ctx, tm_tensor_read(ctx, y1, TM_F32, r1, 7));
    TT_OK(ctx, tm_tensor_read(ctx, y2, TM_F32, r2, 7));
    cr_assert(memcmp(r1, r2, sizeof r1) == 0, "sum over 4001 rows differs between two runs");
    cr_assert(memcmp(g1, g2, sizeof g1) == 0, "broadcast mul gradient differs between two runs");
    free(h), free(hw);
    tm_ctx_free(ctx);
}

/* ---- arena steady state ------------------------------------------------------------------- */

/* One small training-like step on CUDA: embedding-free MLP with rmsnorm, swiglu, CE. */
static void cuda_step(tm_ctx *ctx, tm_tensor *w1, tm_tensor *w2, tm_tensor *wn, const double *hx, const double *ht) {
    int64_t xs[2] = {10, 12}, ts[1] = {10};
    tm_tensor *x, *t, *h, *n, *g, *u, *a, *logits, *loss;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, xs, tm_cuda(0), TM_F64, hx, &x));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, ts, tm_cuda(0), TM_F64, ht, &t));
    TT_OK(ctx, tm_rmsnorm(ctx, x, wn, 1e-5, &n));
    TT_OK(ctx, tm_matmul(ctx, n, w1, 0, 0, &h));        /* (10, 22) */
    TT_OK(ctx, tm_slice(ctx, h, 1, 0, 11, &g));
    TT_OK(ctx, tm_slice(ctx, h, 1, 11, 22, &u));
    TT_OK(ctx, tm_swiglu(ctx, g, u, &a));               /* (10, 11) */
    TT_OK(ctx, tm_matmul(ctx, a, w2, 0, 1, &logits));   /* w2 (13, 11) -> (10, 13) */
    TT_OK(ctx, tm_cross_entropy(ctx, logits, t, -1, &loss));
    TT_OK(ctx, tm_backward(ctx, loss));
    TT_OK(ctx, tm_ctx_sync(ctx));
    tm_ctx_arena_reset(ctx);
}

Test(cuda_parity, arena_steady_state) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t s1[2] = {12, 22}, s2[2] = {13, 11}, sn[1] = {12};
    tm_tensor *w1, *w2, *wn;
    TT_OK(ctx, tm_param_new(ctx, "w1", TM_F32, 2, s1, tm_cuda(0), &w1));
    TT_OK(ctx, tm_param_new(ctx, "w2", TM_F32, 2, s2, tm_cuda(0), &w2));
    TT_OK(ctx, tm_param_new(ctx, "wn", TM_F32, 1, sn, tm_cuda(0), &wn));
    TT_OK(ctx, tm_tensor_init_normal(ctx, w1, 1, NULL, 0.0, 0.3));
    TT_OK(ctx, tm_tensor_init_normal(ctx, w2, 1, NULL, 0.0, 0.3));
    TT_OK(ctx, tm_tensor_fill(ctx, wn, 1.0));
    double *hx = tt_parity_uniform(120, 5), ht[10];
    for (int i = 0; i < 10; i++) ht[i] = (double)((i * 7) % 13);
    cuda_step(ctx, w1, w2, wn, hx, ht);
    uint64_t n1 = tm_ctx_alloc_count(ctx);
    cuda_step(ctx, w1, w2, wn, hx, ht);
    uint64_t n2 = tm_ctx_alloc_count(ctx);
    cuda_step(ctx, w1, w2, wn, hx, ht);
    cr_assert_eq(tm_ctx_alloc_count(ctx), n2, "third step allocated (%llu -> %llu)", (unsigned long long)n2,
                 (unsigned long long)tm_ctx_alloc_count(ctx));
    cr_assert_eq(n2, n1, "second identical step allocated: %llu -> %llu", (unsigned long long)n1,
                 (unsigned long long)n2);
    cr_assert(tm_ctx_arena_peak(ctx, tm_cuda(0)) > 0, "no CUDA arena use recorded");
    free(hx);
    tm_ctx_free(ctx);
}

/* The arena under ragged shapes on the device (tests/test_arena.c): 200 steps of MoE-like
 * sizes changing every step (64 MiB units: blocks up to ~2.5 GB), reserved within 1.5x of the
 * in-use peak. */
Test(cuda_parity, arena_ragged_steps_reserve_within_1_5x_of_peak) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    size_t peak, reserved;
    tt_ragged_workload(ctx, tm_cuda(0), (size_t)64 << 20, 200, &peak, &reserved);
    cr_log_info("cuda ragged: in-use peak %.1f MiB, reserved peak %.1f MiB (%.2fx)", peak / 1048576.0,
                reserved / 1048576.0, (double)reserved / (double)peak);
    cr_assert(reserved <= peak + peak / 2, "reserved %zu bytes for an in-use peak of %zu (%.2fx > 1.5x)", reserved, peak,
              (double)reserved / (double)peak);
    tm_ctx_free(ctx);
}

/* ---- errors ------------------------------------------------------------------------------- */

Test(cuda_parity, mixed_devices_rejected) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t s[2] = {2, 3};
    double h[6] = {1, 2, 3, 4, 5, 6};
    tm_tensor *a, *b, *o = NULL;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, s, tm_cpu(), TM_F64, h, &a));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, s, tm_cuda(0), TM_F64, h, &b));
    cr_assert_eq(tm_add(ctx, a, b, &o), TM_ERR_DEVICE);
    cr_assert_null(o);
    const char *m = tm_ctx_errmsg(ctx);
    cr_assert(strstr(m, "add"), "message does not name the op: %s", m);
    cr_assert(strstr(m, "@cpu") && strstr(m, "@cuda:0"), "message does not name both tensors: %s", m);
    tm_ctx_free(ctx);
}

Test(cuda_parity, cross_entropy_bad_target) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t ls[2] = {4, 5}, ts[1] = {4};
    double *hl = tt_parity_uniform(20, 8), ht[4] = {1, -100, 7, 9};
    tm_tensor *l, *t, *o = NULL;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, ls, tm_cuda(0), TM_F64, hl, &l));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, ts, tm_cuda(0), TM_F64, ht, &t));
    cr_assert_eq(tm_cross_entropy(ctx, l, t, -100, &o), TM_ERR_INDEX);
    const char *m = tm_ctx_errmsg(ctx);
    cr_assert(strstr(m, "cross_entropy"), "message does not name the op: %s", m);
    cr_assert(strstr(m, "targets[2] = 7"), "message does not name the first bad target: %s", m);
    /* The context stays usable after the error. */
    ht[2] = 4;
    ht[3] = 0;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, ts, tm_cuda(0), TM_F64, ht, &t));
    TT_OK(ctx, tm_cross_entropy(ctx, l, t, -100, &o));
    free(hl);
    tm_ctx_free(ctx);
}

Test(cuda_parity, f64_rejected_on_device) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t n = 3;
    tm_tensor *t = NULL, *x;
    cr_assert_eq(tm_tensor_empty(ctx, TM_F64, 1, &n, tm_cuda(0), &t), TM_ERR_DTYPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "f64") && strstr(tm_ctx_errmsg(ctx), "cuda:0"), "%s", tm_ctx_errmsg(ctx));
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 1, &n, tm_cuda(0), &x));
    cr_assert_eq(tm_cast(ctx, x, TM_F64, &t), TM_ERR_DTYPE);
    cr_assert_null(t);
    tm_ctx_free(ctx);
}

/* tm_ctx_sync_count: the CPU counts at the points where CUDA waits (tinymoe.h), so the same
 * sequence of calls counts the same on both devices. Each step's count is compared. */
static void sync_sequence(tm_ctx *ctx, tm_device dev, uint64_t *deltas) {
    int64_t ls[2] = {6, 9}, ts[1] = {6};
    double *hl = tt_parity_uniform(54, 12), ht[6] = {1, 8, -1, 0, 3, 5};
    tm_tensor *l, *t, *tr, *loss, *loss2;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, ls, dev, TM_F64, hl, &l));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, l, 1));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, ts, dev, TM_F64, ht, &t));
    float buf[54];
    int k = 0;
    uint64_t before = tm_ctx_sync_count(ctx);
#define STEP(expr) do { TT_OK(ctx, expr); deltas[k++] = tm_ctx_sync_count(ctx) - before; before = tm_ctx_sync_count(ctx); } while (0)
    STEP(tm_tensor_read(ctx, l, TM_F32, buf, 54));           /* 1 */
    STEP(tm_transpose(ctx, l, 0, 1, &tr));                   /* 0: a view */
    STEP(tm_tensor_read(ctx, tr, TM_F32, buf, 54));          /* 1: a strided read is one copy back */
    STEP(tm_cross_entropy(ctx, l, t, -1, &loss));            /* 1: the bad-target flag */
    STEP(tm__cross_entropy_unchecked(ctx, l, t, -1, &loss2));  /* 0: targets known valid */
    STEP(tm_backward(ctx, loss));                            /* 0 */
    STEP(tm_ctx_sync(ctx));                                  /* 1, not one per backend */
#undef STEP
    float a, b;
    TT_OK(ctx, tm_tensor_read(ctx, loss, TM_F32, &a, 1));
    TT_OK(ctx, tm_tensor_read(ctx, loss2, TM_F32, &b, 1));
    cr_assert_eq(a, b, "checked and unchecked cross-entropy differ: %.9g vs %.9g", a, b);
    free(hl);
}

Test(cuda_parity, sync_count_matches_the_cpu) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *cu = tt_parity_ctx(), *cpu = tt_ctx();
    uint64_t dc[7], dh[7];
    const uint64_t want[7] = {1, 0, 1, 1, 0, 0, 1};
    sync_sequence(cu, tm_cuda(0), dc);
    sync_sequence(cpu, tm_cpu(), dh);
    for (int i = 0; i < 7; i++) {
        cr_assert_eq(dc[i], want[i], "CUDA step %d: %llu synchronisations, want %llu", i, (unsigned long long)dc[i],
                     (unsigned long long)want[i]);
        cr_assert_eq(dh[i], want[i], "CPU step %d: %llu synchronisations, want %llu", i, (unsigned long long)dh[i],
                     (unsigned long long)want[i]);
    }
    tm_ctx_free(cu);
    tm_ctx_free(cpu);
}
