/*
 * moe_gating.c — CPU kernels of tm_moe_gating: the router's gating GEMM.
 *
 * Layout:
 *   in[0]  x       (T, H)   f32 / f64 (bf16 arrives staged in f32 by the dispatcher: exact)
 *   in[1]  w       (H, E)   x's compute dtype
 *   out[0] logits  (T, E)   logits = x @ w
 * Backward (dx written whole when fresh, else added; dw added unless fresh):
 *   dx (T, H) = dlogits @ w^T,   dw (H, E) = x^T @ dlogits
 * One tm__gemm_cpu each; with bf16 x the dispatcher rounds dx back to bf16 once.
 */
#include "internal.h"

tm_status tm__moe_gating_forward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    const tm_dtype dt = w->dtype;
    if (x->dtype != dt)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "moe_gating: CPU kernel got x %s, w %s", tm__tdesc(c->ctx, x),
                       tm__tdesc(c->ctx, w));
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    // (T, H) @ (H, E) -> (T, E)
    tm__gemm_cpu(c->ctx, dt, 0, 0, T, E, H, 1.0, tm__data(x), H, tm__data(w), E, 0.0, tm__data(c->out[0]), E);
    return TM_OK;
}

tm_status tm__moe_gating_backward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *gx = c->gin[0], *gw = c->gin[1];
    const tm_dtype dt = w->dtype;
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    const void *G = tm__data(c->gout[0]);
    if (gx) // (T, E) @ (H, E)^T -> (T, H)
        tm__gemm_cpu(c->ctx, dt, 0, 1, T, H, E, 1.0, G, E, tm__data(w), E, c->gin_fresh[0] ? 0.0 : 1.0, tm__data(gx), H);
    if (gw) // (T, H)^T @ (T, E) -> (H, E)
        tm__gemm_cpu(c->ctx, dt, 1, 0, H, E, T, 1.0, tm__data(x), H, G, E, c->gin_fresh[1] ? 0.0 : 1.0, tm__data(gw), E);
    return TM_OK;
}
