/*
 * moe_gating.c — tm_moe_gating (the router's gating GEMM, logits = x @ w in w's dtype): public
 * entry point and check. Kernels: kernels/cpu/moe_gating.c, kernels/cuda/moe_gating.cu (layout
 * and the order of the sums there).
 */
#include "internal.h"

tm_status tm__moe_gating_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_float(c, 1));
    if (w->dtype != TM_F32 && w->dtype != TM_F64)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_gating: w must be f32 or f64 (the router's precision), got %s",
                       tm__tdesc(ctx, w));
    if (x->dtype != w->dtype && !(x->dtype == TM_BF16 && w->dtype == TM_F32))
        return tm__err(ctx, TM_ERR_DTYPE, "moe_gating: x %s must be w's dtype, or bf16 with f32 w (w %s)",
                       tm__tdesc(ctx, x), tm__tdesc(ctx, w));
    if (x->ndim != 2 || w->ndim != 2)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_gating: x must be [T, H] and w [H, E], got x %s, w %s",
                       tm__tdesc(ctx, x), tm__tdesc(ctx, w));
    if (w->shape[0] != x->shape[1])
        return tm__err(ctx, TM_ERR_SHAPE, "moe_gating: w must be [%lld, E] for x %s, got w %s", (long long)x->shape[1],
                       tm__tdesc(ctx, x), tm__tdesc(ctx, w));
    int64_t shape[2] = {x->shape[0], w->shape[1]};
    return tm__out_new(c, 0, w->dtype, 2, shape);
}

tm_status tm_moe_gating(tm_ctx *ctx, tm_tensor *x, tm_tensor *w, tm_tensor **logits) {
    tm__call c = tm__call_init(ctx, TM__OP_MOE_GATING);
    c.n_in = 2;
    c.in[0] = x;
    c.in[1] = w;
    return tm__op_run1(&c, logits);
}
