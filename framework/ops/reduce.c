/*
 * reduce.c — tm_sum, tm_mean (one axis) and tm_sum_all, tm_mean_all (every element, 0-d
 * result): public entry points and checks. Kernels: kernels/cpu/reduce.c.
 *
 * Attributes of sum / mean: iattr[0] = axis (normalised to [0, ndim)), iattr[1] = keepdim (0/1).
 */
#include "internal.h"

static tm_status axis_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0];
    TM__TRY(tm__check_float(c, 0));
    int64_t axis_in = c->iattr[0];
    int axis = (axis_in < -TM_MAX_DIMS || axis_in > TM_MAX_DIMS) ? -1 : tm__axis((int)axis_in, x->ndim);
    if (axis < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: axis %lld out of range for x %s", tm__opname(c),
                       (long long)axis_in, tm__tdesc(ctx, x));
    int keepdim = c->iattr[1] != 0;
    c->iattr[0] = axis;
    c->iattr[1] = keepdim;
    int64_t shape[TM_MAX_DIMS];
    int nd = 0;
    for (int d = 0; d < x->ndim; d++) {
        if (d != axis) shape[nd++] = x->shape[d];
        else if (keepdim) shape[nd++] = 1;
    }
    return tm__out_new(c, 0, x->dtype, nd, shape);
}

static tm_status all_check(tm__call *c) {
    TM__TRY(tm__check_float(c, 0));
    int64_t none[1] = {0};
    return tm__out_new(c, 0, c->in[0]->dtype, 0, none);
}

tm_status tm__sum_check(tm__call *c) { return axis_check(c); }
tm_status tm__mean_check(tm__call *c) { return axis_check(c); }
tm_status tm__sum_all_check(tm__call *c) { return all_check(c); }
tm_status tm__mean_all_check(tm__call *c) { return all_check(c); }

static tm_status reduce_axis(tm_ctx *ctx, int op, tm_tensor *x, int axis, int keepdim, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, op);
    c.n_in = 1;
    c.in[0] = x;
    c.iattr[0] = axis;
    c.iattr[1] = keepdim;
    return tm__op_run1(&c, out);
}

static tm_status reduce_all(tm_ctx *ctx, int op, tm_tensor *x, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, op);
    c.n_in = 1;
    c.in[0] = x;
    return tm__op_run1(&c, out);
}

tm_status tm_sum(tm_ctx *ctx, tm_tensor *x, int axis, int keepdim, tm_tensor **out) {
    return reduce_axis(ctx, TM__OP_SUM, x, axis, keepdim, out);
}
tm_status tm_mean(tm_ctx *ctx, tm_tensor *x, int axis, int keepdim, tm_tensor **out) {
    return reduce_axis(ctx, TM__OP_MEAN, x, axis, keepdim, out);
}
tm_status tm_sum_all(tm_ctx *ctx, tm_tensor *x, tm_tensor **out) { return reduce_all(ctx, TM__OP_SUM_ALL, x, out); }
tm_status tm_mean_all(tm_ctx *ctx, tm_tensor *x, tm_tensor **out) { return reduce_all(ctx, TM__OP_MEAN_ALL, x, out); }
