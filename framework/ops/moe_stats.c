/*
 * moe_stats.c — the MoE block's running statistics kept on the device: tm_moe_accumulate_counts
 * (the running tokens-per-expert sum that the expert-bias update reads), public entry point and
 * check. Kernel: kernels/cpu/moe_stats.c.
 */
#include "internal.h"

/* sum i64 [E] contiguous (updated in place: the dispatcher would copy a strided view and update
 * the copy), counts i64 [E]. No outputs. */
tm_status tm__moe_accumulate_counts_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *sum = c->in[0], *counts = c->in[1];
    if (sum->dtype != TM_I64 || counts->dtype != TM_I64)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_accumulate_counts: sum and counts must be i64 [E], got sum %s, counts %s",
                       tm__tdesc(ctx, sum), tm__tdesc(ctx, counts));
    if (sum->ndim != 1 || counts->ndim != 1 || counts->shape[0] != sum->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "moe_accumulate_counts: sum and counts must both be [E], got sum %s, counts %s",
                       tm__tdesc(ctx, sum), tm__tdesc(ctx, counts));
    if (!tm__is_contiguous(sum))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_accumulate_counts: sum %s is a strided view; it is updated in "
                       "place and must be contiguous", tm__tdesc(ctx, sum));
    return TM_OK;
}

tm_status tm_moe_accumulate_counts(tm_ctx *ctx, tm_tensor *sum, tm_tensor *counts) {
    tm__call c = tm__call_init(ctx, TM__OP_MOE_ACCUMULATE_COUNTS);
    c.n_in = 2;
    c.in[0] = sum;
    c.in[1] = counts;
    return tm__op_run(&c);
}
