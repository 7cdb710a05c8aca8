/*
 * elementwise.c — tm_add, tm_sub, tm_mul (broadcasting over leading dims), tm_scale and
 * tm_scale_rows: public entry points and checks. Kernels: kernels/cpu/elementwise.c.
 *
 * Broadcasting: the operand with fewer dims (either one) must have exactly the trailing dims
 * of the other; out takes the larger shape. Attributes: scale has fattr[0] = alpha.
 * scale_rows: in[0] x [R, C], in[1] w [R] (a weight per row, the other axis than the
 * broadcasting above covers); out [R, C] of x's dtype.
 */
#include <math.h>

#include "internal.h"

static tm_status binary_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *a = c->in[0], *b = c->in[1];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_float(c, 1));
    TM__TRY(tm__check_same_dtype(c, 0, 1));
    const tm_tensor *big = a->ndim >= b->ndim ? a : b, *small = big == a ? b : a;
    int off = big->ndim - small->ndim;
    for (int d = 0; d < small->ndim; d++)
        if (small->shape[d] != big->shape[off + d])
            return tm__err(ctx, TM_ERR_SHAPE,
                           "%s: shapes do not broadcast (one must equal the trailing dims of the "
                           "other): a %s, b %s",
                           tm__opname(c), tm__tdesc(ctx, a), tm__tdesc(ctx, b));
    return tm__out_new(c, 0, a->dtype, big->ndim, big->shape);
}

tm_status tm__add_check(tm__call *c) { return binary_check(c); }
tm_status tm__sub_check(tm__call *c) { return binary_check(c); }
tm_status tm__mul_check(tm__call *c) { return binary_check(c); }

tm_status tm__scale_check(tm__call *c) {
    const tm_tensor *x = c->in[0];
    TM__TRY(tm__check_float(c, 0));
    if (!isfinite(c->fattr[0]))
        return tm__err(c->ctx, TM_ERR_INVALID_ARG, "scale: alpha must be finite, got %g (x %s)",
                       c->fattr[0], tm__tdesc(c->ctx, x));
    return tm__out_new(c, 0, x->dtype, x->ndim, x->shape);
}

static tm_status binary(tm_ctx *ctx, int op, tm_tensor *a, tm_tensor *b, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, op);
    c.n_in = 2;
    c.in[0] = a;
    c.in[1] = b;
    return tm__op_run1(&c, out);
}

tm_status tm_add(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, tm_tensor **out) {
    return binary(ctx, TM__OP_ADD, a, b, out);
}
tm_status tm_sub(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, tm_tensor **out) {
    return binary(ctx, TM__OP_SUB, a, b, out);
}
tm_status tm_mul(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, tm_tensor **out) {
    return binary(ctx, TM__OP_MUL, a, b, out);
}

tm_status tm_scale(tm_ctx *ctx, tm_tensor *x, double alpha, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_SCALE);
    c.n_in = 1;
    c.in[0] = x;
    c.fattr[0] = alpha;
    return tm__op_run1(&c, out);
}

/* The dtype a CPU kernel computes a float tensor in (bf16 is staged through f32). */
static tm_dtype compute_dtype(tm_dtype dt) { return dt == TM_BF16 ? TM_F32 : dt; }

tm_status tm__scale_rows_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_float(c, 1));
    if (compute_dtype(w->dtype) != compute_dtype(x->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "scale_rows: w must be %s (like x %s), got %s",
                       x->dtype == TM_F64 ? "f64" : "f32 or bf16", tm__tdesc(ctx, x), tm__tdesc(ctx, w));
    if (x->ndim != 2)
        return tm__err(ctx, TM_ERR_SHAPE, "scale_rows: x must be [R, C], got %s", tm__tdesc(ctx, x));
    if (w->ndim != 1 || w->shape[0] != x->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "scale_rows: w must be [R] with R = rows of x, got w %s, x %s",
                       tm__tdesc(ctx, w), tm__tdesc(ctx, x));
    return tm__out_new(c, 0, x->dtype, 2, x->shape);
}

tm_status tm_scale_rows(tm_ctx *ctx, tm_tensor *x, tm_tensor *w, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_SCALE_ROWS);
    c.n_in = 2;
    c.in[0] = x;
    c.in[1] = w;
    return tm__op_run1(&c, out);
}
