/*
 * matmul.c — tm_matmul: public entry point and shape check.
 * Kernels: kernels/cpu/matmul.c (layout and gradient formulas documented there).
 *
 * Attributes: iattr[0] = trans_a, iattr[1] = trans_b, normalised to 0/1 here.
 */
#include "internal.h"

tm_status tm__matmul_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *a = c->in[0], *b = c->in[1];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_float(c, 1));
    TM__TRY(tm__check_same_dtype(c, 0, 1));
    TM__TRY(tm__check_ndim(c, 0, 2, TM_MAX_DIMS));
    TM__TRY(tm__check_ndim(c, 1, 2, TM_MAX_DIMS));
    int ta = c->iattr[0] != 0, tb = c->iattr[1] != 0;
    c->iattr[0] = ta;
    c->iattr[1] = tb;
    int nd = a->ndim;
    if (b->ndim != 2 && b->ndim != nd)
        return tm__err(ctx, TM_ERR_SHAPE,
                       "matmul: b must be 2-D or have a's leading (batch) dims, got a %s, b %s",
                       tm__tdesc(ctx, a), tm__tdesc(ctx, b));
    if (b->ndim > 2)
        for (int d = 0; d < nd - 2; d++)
            if (a->shape[d] != b->shape[d])
                return tm__err(ctx, TM_ERR_SHAPE,
                               "matmul: batch dim %d differs (%lld vs %lld): a %s, b %s", d,
                               (long long)a->shape[d], (long long)b->shape[d], tm__tdesc(ctx, a),
                               tm__tdesc(ctx, b));
    int64_t M = a->shape[nd - 2 + ta], Ka = a->shape[nd - 1 - ta];
    int64_t Kb = b->shape[b->ndim - 2 + tb], N = b->shape[b->ndim - 1 - tb];
    if (Ka != Kb)
        return tm__err(ctx, TM_ERR_SHAPE,
                       "matmul: inner dims differ: op(a) is [%lld,%lld] (trans_a=%d), op(b) is "
                       "[%lld,%lld] (trans_b=%d): a %s, b %s",
                       (long long)M, (long long)Ka, ta, (long long)Kb, (long long)N, tb,
                       tm__tdesc(ctx, a), tm__tdesc(ctx, b));
    int64_t shape[TM_MAX_DIMS];
    for (int d = 0; d < nd - 2; d++) shape[d] = a->shape[d];
    shape[nd - 2] = M;
    shape[nd - 1] = N;
    return tm__out_new(c, 0, a->dtype, nd, shape);
}

tm_status tm_matmul(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, int trans_a, int trans_b, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_MATMUL);
    c.n_in = 2;
    c.in[0] = a;
    c.in[1] = b;
    c.iattr[0] = trans_a;
    c.iattr[1] = trans_b;
    return tm__op_run1(&c, out);
}
