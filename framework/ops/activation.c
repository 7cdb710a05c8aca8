/*
 * activation.c — tm_silu and the fused tm_swiglu: public entry points and checks.
 * Kernels: kernels/cpu/activation.c.
 */
#include "internal.h"

tm_status tm__silu_check(tm__call *c) {
    const tm_tensor *x = c->in[0];
    TM__TRY(tm__check_float(c, 0));
    return tm__out_new(c, 0, x->dtype, x->ndim, x->shape);
}

tm_status tm__swiglu_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *gate = c->in[0], *up = c->in[1];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_float(c, 1));
    TM__TRY(tm__check_same_dtype(c, 0, 1));
    int same = gate->ndim == up->ndim;
    for (int d = 0; same && d < gate->ndim; d++) same = gate->shape[d] == up->shape[d];
    if (!same)
        return tm__err(ctx, TM_ERR_SHAPE, "swiglu: gate and up must have one shape, got gate %s, up %s",
                       tm__tdesc(ctx, gate), tm__tdesc(ctx, up));
    return tm__out_new(c, 0, gate->dtype, gate->ndim, gate->shape);
}

tm_status tm_silu(tm_ctx *ctx, tm_tensor *x, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_SILU);
    c.n_in = 1;
    c.in[0] = x;
    return tm__op_run1(&c, out);
}

tm_status tm_swiglu(tm_ctx *ctx, tm_tensor *gate, tm_tensor *up, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_SWIGLU);
    c.n_in = 2;
    c.in[0] = gate;
    c.in[1] = up;
    return tm__op_run1(&c, out);
}
