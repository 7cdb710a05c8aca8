/*
 * rmsnorm.c — tm_rmsnorm: public entry point and shape/attribute check.
 * Kernels: kernels/cpu/rmsnorm.c (the saved-tensor layout is documented there).
 */
#include <math.h>

#include "internal.h"

tm_status tm__rmsnorm_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_float(c, 1));
    TM__TRY(tm__check_same_dtype(c, 0, 1));
    TM__TRY(tm__check_ndim(c, 0, 1, TM_MAX_DIMS));
    TM__TRY(tm__check_ndim(c, 1, 1, 1));
    int64_t C = x->shape[x->ndim - 1];
    if (C == 0)
        return tm__err(ctx, TM_ERR_SHAPE, "rmsnorm: the normalised (last) axis of x is empty: x %s",
                       tm__tdesc(ctx, x));
    if (w->shape[0] != C)
        return tm__err(ctx, TM_ERR_SHAPE, "rmsnorm: weight must be [%lld] to match the last axis of x, got x %s, weight %s",
                       (long long)C, tm__tdesc(ctx, x), tm__tdesc(ctx, w));
    double eps = c->fattr[0];
    if (!(eps >= 0.0) || isinf(eps))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "rmsnorm: eps must be finite and >= 0, got %g", eps);
    return tm__out_new(c, 0, x->dtype, x->ndim, x->shape);
}

tm_status tm_rmsnorm(tm_ctx *ctx, tm_tensor *x, tm_tensor *weight, double eps, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_RMSNORM);
    c.n_in = 2;
    c.in[0] = x;
    c.in[1] = weight;
    c.fattr[0] = eps;
    return tm__op_run1(&c, out);
}
