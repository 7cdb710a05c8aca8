/*
 * moe_loss.c — the MoE auxiliary losses (tm_moe_aux_loss, tm_moe_seq_aux_loss, tm_moe_z_loss):
 * public entry points and checks; and the aux-loss-free expert-bias update
 * (tm_moe_expert_bias_update), which is a plain in-place update, not an op.
 * Kernels: kernels/cpu/moe_loss.c (attribute and saved-tensor layout documented there).
 *
 * All three losses return a 0-d tensor of the scores' / logits' float dtype. An empty batch
 * (T = 0) gives a loss of 0, not a 0/0.
 */
#include <math.h>

#include "internal.h"

/* scores [T,E] float with E >= 1, topk in [1, E], coeff finite: shared by both balance losses. */
static tm_status balance_common_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *scores = c->in[0];
    TM__TRY(tm__check_float(c, 0));
    if (scores->ndim != 2)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: scores must be [T,E], got %s", tm__opname(c), tm__tdesc(ctx, scores));
    int64_t E = scores->shape[1], k = c->iattr[0];
    if (E == 0)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: scores have no experts: scores %s", tm__opname(c),
                       tm__tdesc(ctx, scores));
    if (k < 1 || k > E)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: topk must be in [1, %lld] (E of scores %s), got %lld",
                       tm__opname(c), (long long)E, tm__tdesc(ctx, scores), (long long)k);
    if (!isfinite(c->fattr[0]))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: coeff must be finite, got %g", tm__opname(c), c->fattr[0]);
    return TM_OK;
}

static tm_status scalar_out(tm__call *c) {
    int64_t none[1] = {0};
    return tm__out_new(c, 0, c->in[0]->dtype, 0, none);
}

tm_status tm__moe_aux_loss_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *scores = c->in[0], *counts = c->in[1];
    TM__TRY(balance_common_check(c));
    int64_t T = scores->shape[0], E = scores->shape[1];
    if (counts->dtype != TM_I64)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_aux_loss: tokens_per_expert must be i64 [%lld], got %s",
                       (long long)E, tm__tdesc(ctx, counts));
    if (counts->ndim != 1 || counts->shape[0] != E)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_aux_loss: tokens_per_expert must be [%lld] (E of scores %s), got %s",
                       (long long)E, tm__tdesc(ctx, scores), tm__tdesc(ctx, counts));
    /* total_tokens is T summed over data-parallel ranks: it can only add to the local rows. */
    if (c->iattr[1] > 0 && c->iattr[1] < T)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_aux_loss: total_tokens %lld is less than the %lld rows of scores %s",
                       (long long)c->iattr[1], (long long)T, tm__tdesc(ctx, scores));
    return scalar_out(c);
}

tm_status tm__moe_seq_aux_loss_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *scores = c->in[0], *map = c->in[1];
    TM__TRY(balance_common_check(c));
    int64_t T = scores->shape[0], ns = c->iattr[1];
    if (map->dtype != TM_U8)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_seq_aux_loss: routing_map must be u8, got %s", tm__tdesc(ctx, map));
    if (map->ndim != 2 || map->shape[0] != T || map->shape[1] != scores->shape[1])
        return tm__err(ctx, TM_ERR_SHAPE, "moe_seq_aux_loss: routing_map must have the shape of scores %s, got %s",
                       tm__tdesc(ctx, scores), tm__tdesc(ctx, map));
    if (ns < 1 || T % ns != 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_seq_aux_loss: num_seqs %lld must be >= 1 and divide the %lld rows "
                       "of scores %s", (long long)ns, (long long)T, tm__tdesc(ctx, scores));
    return scalar_out(c);
}

tm_status tm__moe_z_loss_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *logits = c->in[0];
    TM__TRY(tm__check_float(c, 0));
    if (logits->ndim != 2)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_z_loss: logits must be [T,E], got %s", tm__tdesc(ctx, logits));
    if (logits->shape[1] == 0)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_z_loss: logits have no experts: logits %s", tm__tdesc(ctx, logits));
    if (!isfinite(c->fattr[0]))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_z_loss: coeff must be finite, got %g", c->fattr[0]);
    return scalar_out(c);
}

tm_status tm_moe_aux_loss(tm_ctx *ctx, tm_tensor *scores, tm_tensor *tokens_per_expert, int topk, double coeff,
                          int64_t total_tokens, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_MOE_AUX_LOSS);
    c.n_in = 2;
    c.in[0] = scores;
    c.in[1] = tokens_per_expert;
    c.iattr[0] = topk;
    c.iattr[1] = total_tokens;
    c.fattr[0] = coeff;
    return tm__op_run1(&c, out);
}

tm_status tm_moe_seq_aux_loss(tm_ctx *ctx, tm_tensor *scores, tm_tensor *routing_map, int topk, double coeff,
                              int64_t num_seqs, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_MOE_SEQ_AUX_LOSS);
    c.n_in = 2;
    c.in[0] = scores;
    c.in[1] = routing_map;
    c.iattr[0] = topk;
    c.iattr[1] = num_seqs;
    c.fattr[0] = coeff;
    return tm__op_run1(&c, out);
}

tm_status tm_moe_z_loss(tm_ctx *ctx, tm_tensor *logits, double coeff, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_MOE_Z_LOSS);
    c.n_in = 1;
    c.in[0] = logits;
    c.fattr[0] = coeff;
    return tm__op_run1(&c, out);
}

/* Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2; Megatron get_updated_expert_bias): an
 * overloaded expert's bias goes down by `rate`, an underloaded one's up, a perfectly loaded one
 * stays. The mean is taken in f64: for counts below 2^53 / E it is exact whenever it is an
 * integer, so sign(0) = 0 holds exactly for a balanced expert. The new value is computed in f64
 * and rounded once to the bias dtype (f32; f64 for an f64 block's bias). */
tm_status tm_moe_expert_bias_update(tm_ctx *ctx, tm_tensor *expert_bias, tm_tensor *counts, double rate) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!expert_bias || !counts)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_expert_bias_update: %s is NULL",
                       expert_bias ? "counts" : "expert_bias");
    if (expert_bias->ctx != ctx || counts->ctx != ctx)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_expert_bias_update: %s belongs to another context",
                       expert_bias->ctx != ctx ? "expert_bias" : "counts");
    if (expert_bias->device.type != TM_DEVICE_CPU || counts->device.type != TM_DEVICE_CPU)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "moe_expert_bias_update: CPU only for now, got expert_bias %s, counts %s",
                       tm__tdesc(ctx, expert_bias), tm__tdesc(ctx, counts));
    if (expert_bias->dtype != TM_F32 && expert_bias->dtype != TM_F64)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_expert_bias_update: expert_bias must be f32 or f64 [E], got %s",
                       tm__tdesc(ctx, expert_bias));
    if (counts->dtype != TM_I64)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_expert_bias_update: counts must be i64 [E], got %s", tm__tdesc(ctx, counts));
    if (expert_bias->ndim != 1 || expert_bias->shape[0] == 0)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_expert_bias_update: expert_bias must be [E] with E >= 1, got %s",
                       tm__tdesc(ctx, expert_bias));
    if (counts->ndim != 1 || counts->shape[0] != expert_bias->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "moe_expert_bias_update: counts must be [%lld] like expert_bias %s, got %s",
                       (long long)expert_bias->shape[0], tm__tdesc(ctx, expert_bias), tm__tdesc(ctx, counts));
    if (!isfinite(rate))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_expert_bias_update: rate must be finite, got %g", rate);

    /* Both are 1-D; walk them by stride so views work too. */
    int64_t E = expert_bias->shape[0], sb = expert_bias->stride[0], sc = counts->stride[0];
    const int64_t *cnt = tm__data(counts);
    double mean = 0.0;
    for (int64_t e = 0; e < E; e++) mean += (double)cnt[e * sc];
    mean /= (double)E;
    for (int64_t e = 0; e < E; e++) {
        double d = mean - (double)cnt[e * sc];
        double sign = (d > 0) - (d < 0);
        if (expert_bias->dtype == TM_F64) {
            double *b = tm__data(expert_bias);
            b[e * sb] += rate * sign;
        } else {
            float *b = tm__data(expert_bias);
            b[e * sb] = (float)((double)b[e * sb] + rate * sign);
        }
    }
    return TM_OK;
}
