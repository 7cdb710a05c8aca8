/*
 * update.c — the update ops: AdamW, SGD, the gradient sum of squares, gradient scaling and
 * the aux-loss-free expert-bias update, as non-differentiable rows of the op table that write
 * their first input in place (kernels: kernels/cpu/update.c; AdamW, SGD, sumsq and scale
 * also kernels/cuda/update.cu). optim/ builds tm_optimizer_step
 * and tm_ctx_clip_grad_norm from them over bucket ranges, so the optimizer has no device code.
 *
 * Attributes (kernels read them by these indices):
 *   adamw_update  in: param, grad, m, v [, master]   iattr[0] has_master
 *                 fattr: 0 lr, 1 beta1, 2 1-beta1, 3 beta2, 4 1-beta2, 5 eps, 6 wd, 7 bc1, 8 bc2
 *   sgd_update    in: param, grad [, b] [, master]   iattr[0] has_b, iattr[1] has_master
 *                 fattr: 0 lr, 1 momentum, 2 wd; iattr[2] nesterov
 *   grad_sumsq    in: grad -> out 0-d on grad's device: f64 on the CPU, f32 on CUDA
 *   grad_scale    in: grad; fattr[0] scale
 *   moe_expert_bias_update  in: expert_bias, counts; fattr[0] rate
 */
#include <math.h>

#include "internal.h"

static tm_status check_flat(tm__call *c, int i, const char *what, int64_t n, int want_f32) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *t = c->in[i];
    if (!tm__is_contiguous(t))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s %s must be contiguous (updates write in place)", tm__opname(c),
                       what, tm__tdesc(ctx, t));
    if (tm__numel(t) != n)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: %s %s must have %lld elements like the parameter %s", tm__opname(c), what,
                       tm__tdesc(ctx, t), (long long)n, tm__tdesc(ctx, c->in[0]));
    if (want_f32 && t->dtype != TM_F32)
        return tm__err(ctx, TM_ERR_DTYPE, "%s: %s must be f32, got %s", tm__opname(c), what, tm__tdesc(ctx, t));
    return TM_OK;
}

static tm_status check_param_grad(tm__call *c) {
    TM__TRY(tm__check_float(c, 0));
    int64_t n = tm__numel(c->in[0]);
    TM__TRY(check_flat(c, 0, "param", n, 0));
    TM__TRY(check_flat(c, 1, "grad", n, 0));
    return tm__check_same_dtype(c, 0, 1);
}

tm_status tm__adamw_update_check(tm__call *c) {
    if (c->n_in != 4 + (int)c->iattr[0])
        return tm__err(c->ctx, TM_ERR_INTERNAL, "adamw_update: %d inputs", c->n_in);
    TM__TRY(check_param_grad(c));
    int64_t n = tm__numel(c->in[0]);
    TM__TRY(check_flat(c, 2, "m", n, 1));
    TM__TRY(check_flat(c, 3, "v", n, 1));
    if (c->iattr[0]) TM__TRY(check_flat(c, 4, "master", n, 1));
    return TM_OK;
}

tm_status tm__sgd_update_check(tm__call *c) {
    if (c->n_in != 2 + (int)c->iattr[0] + (int)c->iattr[1])
        return tm__err(c->ctx, TM_ERR_INTERNAL, "sgd_update: %d inputs", c->n_in);
    TM__TRY(check_param_grad(c));
    int64_t n = tm__numel(c->in[0]);
    int k = 2;
    if (c->iattr[0]) TM__TRY(check_flat(c, k++, "momentum buffer b", n, 1));
    if (c->iattr[1]) TM__TRY(check_flat(c, k++, "master", n, 1));
    return TM_OK;
}

tm_status tm__grad_sumsq_check(tm__call *c) {
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(check_flat(c, 0, "grad", tm__numel(c->in[0]), 0));
    int64_t none[1] = {0};
    /* f64 cannot live on CUDA: there the f64 sum is stored rounded to f32 (still one value per
     * bucket on the device, so the clip reads all of them in one copy). */
    tm_dtype dt = c->in[0]->device.type == TM_DEVICE_CUDA ? TM_F32 : TM_F64;
    return tm__tensor_new(c->ctx, dt, 0, none, c->in[0]->device, &c->out[0]);
}

tm_status tm__grad_scale_check(tm__call *c) {
    TM__TRY(tm__check_float(c, 0));
    return check_flat(c, 0, "grad", tm__numel(c->in[0]), 0);
}

tm_status tm__moe_expert_bias_update_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *bias = c->in[0], *counts = c->in[1];
    if (bias->dtype != TM_F32 && bias->dtype != TM_F64)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_expert_bias_update: expert_bias must be f32 or f64 [E], got %s",
                       tm__tdesc(ctx, bias));
    if (counts->dtype != TM_I64)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_expert_bias_update: counts must be i64 [E], got %s", tm__tdesc(ctx, counts));
    if (bias->ndim != 1 || bias->shape[0] == 0)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_expert_bias_update: expert_bias must be [E] with E >= 1, got %s",
                       tm__tdesc(ctx, bias));
    if (counts->ndim != 1 || counts->shape[0] != bias->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "moe_expert_bias_update: counts must be [%lld] like expert_bias %s, got %s",
                       (long long)bias->shape[0], tm__tdesc(ctx, bias), tm__tdesc(ctx, counts));
    if (!isfinite(c->fattr[0]))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_expert_bias_update: rate must be finite, got %g", c->fattr[0]);
    return TM_OK;
}

/* ---- public functions -------------------------------------------------------------------- */

tm_status tm_adamw_update(tm_ctx *ctx, tm_tensor *param, tm_tensor *grad, tm_tensor *m, tm_tensor *v,
                          tm_tensor *master, const tm_adamw_config *cfg, double lr, double weight_decay, int64_t step) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!cfg) return tm__err(ctx, TM_ERR_INVALID_ARG, "adamw_update: cfg is NULL");
    if (step < 1) return tm__err(ctx, TM_ERR_INVALID_ARG, "adamw_update: step must be >= 1, got %lld", (long long)step);
    if (!isfinite(lr) || !isfinite(weight_decay))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "adamw_update: lr %g and weight_decay %g must be finite", lr, weight_decay);
    tm__call c = tm__call_init(ctx, TM__OP_ADAMW_UPDATE);
    c.in[0] = param, c.in[1] = grad, c.in[2] = m, c.in[3] = v, c.in[4] = master;
    c.n_in = master ? 5 : 4;
    c.iattr[0] = master != NULL;
    /* 1 - beta and the bias corrections in f64: 1 - 0.999f in f32 is 0.00099998713, which
     * would leave (1 - beta2) / bc2 != 1 at step 1 (a 1e-5 error on every early update). */
    c.fattr[0] = lr;
    c.fattr[1] = cfg->beta1;
    c.fattr[2] = 1.0 - cfg->beta1;
    c.fattr[3] = cfg->beta2;
    c.fattr[4] = 1.0 - cfg->beta2;
    c.fattr[5] = cfg->eps;
    c.fattr[6] = weight_decay;
    c.fattr[7] = 1.0 - pow(cfg->beta1, (double)step);
    c.fattr[8] = 1.0 - pow(cfg->beta2, (double)step);
    return tm__op_run(&c);
}

tm_status tm_sgd_update(tm_ctx *ctx, tm_tensor *param, tm_tensor *grad, tm_tensor *b, tm_tensor *master,
                        const tm_sgd_config *cfg, double lr, double weight_decay) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!cfg) return tm__err(ctx, TM_ERR_INVALID_ARG, "sgd_update: cfg is NULL");
    if (!isfinite(lr) || !isfinite(weight_decay))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "sgd_update: lr %g and weight_decay %g must be finite", lr, weight_decay);
    if (!b && cfg->momentum > 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "sgd_update: momentum %g needs the buffer b", cfg->momentum);
    tm__call c = tm__call_init(ctx, TM__OP_SGD_UPDATE);
    int k = 0;
    c.in[k++] = param;
    c.in[k++] = grad;
    if (b) c.in[k++] = b;
    if (master) c.in[k++] = master;
    c.n_in = k;
    c.iattr[0] = b != NULL;
    c.iattr[1] = master != NULL;
    c.iattr[2] = cfg->nesterov;
    c.fattr[0] = lr;
    c.fattr[1] = cfg->momentum;
    c.fattr[2] = weight_decay;
    return tm__op_run(&c);
}

tm_status tm_grad_sumsq(tm_ctx *ctx, tm_tensor *grad, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_GRAD_SUMSQ);
    c.in[0] = grad;
    return tm__op_run1(&c, out);
}

tm_status tm_grad_scale(tm_ctx *ctx, tm_tensor *grad, double scale) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!isfinite(scale)) return tm__err(ctx, TM_ERR_INVALID_ARG, "grad_scale: scale must be finite, got %g", scale);
    tm__call c = tm__call_init(ctx, TM__OP_GRAD_SCALE);
    c.in[0] = grad;
    c.fattr[0] = scale;
    return tm__op_run(&c);
}

tm_status tm_moe_expert_bias_update(tm_ctx *ctx, tm_tensor *expert_bias, tm_tensor *counts, double rate) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!expert_bias || !counts)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_expert_bias_update: %s is NULL", expert_bias ? "counts" : "expert_bias");
    tm__call c = tm__call_init(ctx, TM__OP_MOE_EXPERT_BIAS_UPDATE);
    c.in[0] = expert_bias;
    c.in[1] = counts;
    c.fattr[0] = rate;
    return tm__op_run(&c);
}
