/*
 * rope.c — tm_rope (rotary position embedding, rotate-half pairing): public entry point and
 * check. Kernels: kernels/cpu/rope.c, kernels/cuda/rope.cu.
 *
 * Call layout: in[0] x (B, T, H, D); iattr[0] pos_offset; fattr[0] theta; out[0] (B, T, H, D).
 */
#include <inttypes.h>
#include <math.h>

#include "internal.h"

tm_status tm__rope_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_ndim(c, 0, 4, 4));
    if (x->shape[3] % 2 != 0)
        return tm__err(ctx, TM_ERR_SHAPE, "rope: x [B,T,H,D] needs an even head dim D (pairs x[i], x[i+D/2]), got %s",
                       tm__tdesc(ctx, x));
    double theta = c->fattr[0];
    if (!(theta > 0.0) || !isfinite(theta))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "rope: theta must be finite and > 0, got %g (x %s)", theta,
                       tm__tdesc(ctx, x));
    /* Negative positions are well defined mathematically but only ever arise from a bad KV-cache
     * offset, so they are refused rather than silently rotated backwards. */
    if (c->iattr[0] < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "rope: pos_offset must be >= 0, got %" PRId64 " (x %s)", c->iattr[0],
                       tm__tdesc(ctx, x));
    return tm__out_new(c, 0, x->dtype, 4, x->shape);
}

tm_status tm_rope(tm_ctx *ctx, tm_tensor *x, int64_t pos_offset, double theta, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_ROPE);
    c.n_in = 1;
    c.in[0] = x;
    c.iattr[0] = pos_offset;
    c.fattr[0] = theta;
    return tm__op_run1(&c, out);
}
