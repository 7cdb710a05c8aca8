/*
 * cross_entropy.c — tm_cross_entropy (fused log-softmax + negative log-likelihood + mean):
 * public entry point and check. Kernels: kernels/cpu/cross_entropy.c (saved-tensor layout
 * documented there). Target values are validated by the forward kernel, which is where the
 * index data is readable (on the host for the CPU backend).
 */
#include "internal.h"

tm_status tm__cross_entropy_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *logits = c->in[0], *targets = c->in[1];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_index(c, 1));
    TM__TRY(tm__check_ndim(c, 0, 2, 2));
    TM__TRY(tm__check_ndim(c, 1, 1, 1));
    if (targets->shape[0] != logits->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "cross_entropy: targets must be [%lld] (one per row of logits), got logits %s, targets %s",
                       (long long)logits->shape[0], tm__tdesc(ctx, logits), tm__tdesc(ctx, targets));
    if (logits->shape[1] == 0)
        return tm__err(ctx, TM_ERR_SHAPE, "cross_entropy: logits have no classes: logits %s", tm__tdesc(ctx, logits));
    /* iattr[2]: an f32 loss for bf16 logits (the kernels compute in f32 either way). */
    tm_dtype dt = c->iattr[2] && logits->dtype == TM_BF16 ? TM_F32 : logits->dtype;
    return tm__out_new(c, 0, dt, 0, logits->shape);
}

static tm_status cross_entropy(tm_ctx *ctx, tm_tensor *logits, tm_tensor *targets, int64_t ignore_index,
                               int checked, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_CROSS_ENTROPY);
    c.n_in = 2;
    c.in[0] = logits;
    c.in[1] = targets;
    c.iattr[0] = ignore_index;
    c.iattr[1] = checked;
    c.iattr[2] = checked; /* the model's loss: f32 whatever the logits' dtype (extend.h) */
    return tm__op_run1(&c, out);
}

tm_status tm_cross_entropy(tm_ctx *ctx, tm_tensor *logits, tm_tensor *targets, int64_t ignore_index,
                           tm_tensor **out) {
    return cross_entropy(ctx, logits, targets, ignore_index, 0, out);
}

tm_status tm__cross_entropy_unchecked(tm_ctx *ctx, tm_tensor *logits, tm_tensor *targets, int64_t ignore_index,
                                    tm_tensor **out) {
    return cross_entropy(ctx, logits, targets, ignore_index, 1, out);
}
