/*
 * rmsnorm.c — tm_rmsnorm and tm_add_rmsnorm (the residual add fused with the norm after it):
 * public entry points and shape/attribute checks. Kernels: kernels/cpu/rmsnorm.c (the
 * saved-tensor layouts are documented there), kernels/cuda/rmsnorm.cu.
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

/* add_rmsnorm: in x, y [..., C] (one shape and dtype), weight [C]; fattr[0] eps;
 * out[0] sum = x + y, out[1] rmsnorm(sum, weight) (kernels: kernels/cpu/rmsnorm.c). */
tm_status tm__add_rmsnorm_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *y = c->in[1], *w = c->in[2];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_same_dtype(c, 0, 1));
    TM__TRY(tm__check_same_dtype(c, 0, 2));
    TM__TRY(tm__check_ndim(c, 0, 1, TM_MAX_DIMS));
    TM__TRY(tm__check_ndim(c, 2, 1, 1));
    int same = x->ndim == y->ndim;
    for (int d = 0; same && d < x->ndim; d++) same = x->shape[d] == y->shape[d];
    if (!same)
        return tm__err(ctx, TM_ERR_SHAPE, "add_rmsnorm: x and y must have one shape (no broadcasting), got x %s, y %s",
                       tm__tdesc(ctx, x), tm__tdesc(ctx, y));
    int64_t C = x->shape[x->ndim - 1];
    if (C == 0)
        return tm__err(ctx, TM_ERR_SHAPE, "add_rmsnorm: the normalised (last) axis of x is empty: x %s", tm__tdesc(ctx, x));
    if (w->shape[0] != C)
        return tm__err(ctx, TM_ERR_SHAPE,
                       "add_rmsnorm: weight must be [%lld] to match the last axis of x, got x %s, weight %s",
                       (long long)C, tm__tdesc(ctx, x), tm__tdesc(ctx, w));
    double eps = c->fattr[0];
    if (!(eps >= 0.0) || isinf(eps))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "add_rmsnorm: eps must be finite and >= 0, got %g", eps);
    TM__TRY(tm__out_new(c, 0, x->dtype, x->ndim, x->shape));
    return tm__out_new(c, 1, x->dtype, x->ndim, x->shape);
}

tm_status tm_add_rmsnorm(tm_ctx *ctx, tm_tensor *x, tm_tensor *y, tm_tensor *weight, double eps, tm_tensor **sum,
                         tm_tensor **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!sum || !out) return tm__err(ctx, TM_ERR_INVALID_ARG, "add_rmsnorm: %s is NULL", sum ? "out" : "sum");
    tm__call c = tm__call_init(ctx, TM__OP_ADD_RMSNORM);
    c.n_in = 3;
    c.in[0] = x;
    c.in[1] = y;
    c.in[2] = weight;
    c.fattr[0] = eps;
    TM__TRY(tm__op_run(&c));
    *sum = c.out[0];
    *out = c.out[1];
    return TM_OK;
}
