/*
 * softmax.c — tm_softmax and tm_log_softmax over the last axis: public entry points and check.
 * Kernels: kernels/cpu/softmax.c.
 */
#include "internal.h"

/* Shared by both ops; tm__opname(c) tells them apart in messages. */
static tm_status softmax_check(tm__call *c) {
    const tm_tensor *x = c->in[0];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_ndim(c, 0, 1, TM_MAX_DIMS));
    return tm__out_new(c, 0, x->dtype, x->ndim, x->shape);
}

tm_status tm__softmax_check(tm__call *c) { return softmax_check(c); }
tm_status tm__log_softmax_check(tm__call *c) { return softmax_check(c); }

tm_status tm_softmax(tm_ctx *ctx, tm_tensor *x, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_SOFTMAX);
    c.n_in = 1;
    c.in[0] = x;
    return tm__op_run1(&c, out);
}

tm_status tm_log_softmax(tm_ctx *ctx, tm_tensor *x, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_LOG_SOFTMAX);
    c.n_in = 1;
    c.in[0] = x;
    return tm__op_run1(&c, out);
}
