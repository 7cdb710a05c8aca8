/*
 * moe_gating.cu — CUDA kernels of tm_moe_gating: the router's gating GEMM in f32.
 *
 * Layout (as kernels/cpu/moe_gating.c):
 *   in[0]    x       (T, H)   bf16 or f32
 *   in[1]    w       (H, E)   f32
 *   out[0]   logits  (T, E)   f32: logits = x @ w
 *   saved[0] xf      (T, H)   f32, bf16 x only: x widened (exact), which dw reads
 * Backward: dx = dlogits @ w^T, dw += x^T @ dlogits (dx written when fresh, else added).
 *
 * Every product is cuBLASLt's f32 GEMM (true f32, no TF32: tm__gemm_cuda), on x itself when it is
 * f32 and on its f32 copy when it is bf16: the same arithmetic as the tm_cast + tm_matmul the
 * MoE block used before, with one rounding of dx instead of two (the f32 dx is added to a
 * gradient x already has in f32 and rounded once: tm__accumulate; the cast's backward rounded it
 * to bf16 first).
 *
 * Not yet: kernels that read bf16 x directly. A first version (commit 8ecc57e: a thread per token
 * over shared-memory tiles of x and w, a thread per h for dx, token chunks for dw) was slower
 * than this path on an H200 (ncu over a coarse step: 148 + 106 + 78 us a layer against the
 * cuBLASLt path's total of about 165): its tiles were loaded by 2-byte loads a few at a time
 * between barriers, with 4 to 12 warps an SM, so each tile waited out the memory's latency. The
 * next version needs 16-byte loads issued together (or TMA), more warps, and, for dx and dw, the
 * register tiling of a GEMM.
 */
#include "common.cuh"

extern "C" tm_status tm__moe_gating_forward_cuda(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    const void *X = tm__data(x);
    if (x->dtype != w->dtype) { /* bf16 x: its f32 copy, kept for dw */
        tm_tensor *xf;
        TM__TRY(tm__saved_new(c, w->dtype, 2, x->shape, &xf));
        TM__TRY(tm__copy_into(c->ctx, xf, x));
        X = tm__data(xf);
    }
    return tm__gemm_cuda(c->ctx, w->dtype, 0, 0, T, E, H, 1.0, X, H, 0, tm__data(w), E, 0, 0.0, tm__data(c->out[0]),
                         E, 0, 1);
}

extern "C" tm_status tm__moe_gating_backward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *gx = c->gin[0], *gw = c->gin[1];
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    const void *G = tm__data(c->gout[0]);
    const bool widened = x->dtype != w->dtype;
    if (gx) {
        if (!widened) { /* a fresh gradient is written by beta = 0, which never reads it */
            TM__TRY(tm__gemm_cuda(ctx, w->dtype, 0, 1, T, H, E, 1.0, G, E, 0, tm__data(w), E, 0,
                                  c->gin_fresh[0] ? 0.0 : 1.0, tm__data(gx), H, 0, 1));
        } else { /* dx in f32, then written (rounded once) or added in f32 and rounded once */
            tm_tensor *dxf;
            TM__TRY(tm__tensor_new(ctx, w->dtype, 2, x->shape, x->device, &dxf));
            TM__TRY(tm__gemm_cuda(ctx, w->dtype, 0, 1, T, H, E, 1.0, G, E, 0, tm__data(w), E, 0, 0.0, tm__data(dxf), H,
                                  0, 1));
            TM__TRY(c->gin_fresh[0] ? tm__copy_into(ctx, gx, dxf) : tm__accumulate(ctx, gx, dxf, 1.0));
        }
    }
    if (gw) {
        const void *X = widened ? tm__data(c->saved[0]) : tm__data(x);
        TM__TRY(tm__gemm_cuda(ctx, w->dtype, 1, 0, H, E, T, 1.0, X, H, 0, G, E, 0, c->gin_fresh[1] ? 0.0 : 1.0,
                              tm__data(gw), E, 0, 1));
    }
    return TM_OK;
}
