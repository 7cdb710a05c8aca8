/*
 * grouped_matmul.c — tm_grouped_matmul (ragged GEMM over expert groups): public entry point and
 * shape/dtype check. Kernels: kernels/cpu/grouped_matmul.c (layout documented there).
 *
 * The values of counts (each >= 0, sum = rows of x) are validated by the forward kernel, where
 * they are readable: on the CPU they sit in host memory, on CUDA they would have to be copied
 * back first, which the check must not do behind the caller's back.
 */
#include "internal.h"

tm_status tm__grouped_matmul_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1], *counts = c->in[2];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_float(c, 1));
    TM__TRY(tm__check_same_dtype(c, 0, 1));
    if (counts->dtype != TM_I64)
        return tm__err(ctx, TM_ERR_DTYPE, "grouped_matmul: counts must be i64 [G], got %s", tm__tdesc(ctx, counts));
    if (x->ndim != 2)
        return tm__err(ctx, TM_ERR_SHAPE, "grouped_matmul: x must be [R,K], got %s", tm__tdesc(ctx, x));
    if (w->ndim != 3)
        return tm__err(ctx, TM_ERR_SHAPE, "grouped_matmul: w must be [G,K,N], got %s", tm__tdesc(ctx, w));
    if (counts->ndim != 1 || counts->shape[0] != w->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "grouped_matmul: counts must be [%lld] (one per group of w), got counts %s, w %s",
                       (long long)w->shape[0], tm__tdesc(ctx, counts), tm__tdesc(ctx, w));
    if (w->shape[1] != x->shape[1])
        return tm__err(ctx, TM_ERR_SHAPE, "grouped_matmul: inner dims differ: x %s, w %s (w must be [G,%lld,N])",
                       tm__tdesc(ctx, x), tm__tdesc(ctx, w), (long long)x->shape[1]);
    int64_t shape[2] = {x->shape[0], w->shape[2]};
    return tm__out_new(c, 0, x->dtype, 2, shape);
}

tm_status tm_grouped_matmul(tm_ctx *ctx, tm_tensor *x, tm_tensor *w, tm_tensor *counts, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_GROUPED_MATMUL);
    c.n_in = 3;
    c.in[0] = x;
    c.in[1] = w;
    c.in[2] = counts;
    return tm__op_run1(&c, out);
}
