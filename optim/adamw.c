/*
 * adamw.c — the AdamW optimizer: tm_adamw_new. tm_optimizer_step (optimizer.c) updates every
 * run of a device at once with the adamw_update_multi op (kernels/cpu/update.c,
 * kernels/cuda/update.cu).
 *
 * Update of one parameter p with gradient g at step t (Loshchilov & Hutter 2019, Alg. 2; bias
 * correction of Kingma & Ba 2015), exactly as documented in tinymoe.h:
 *   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
 *   p -= lr * ( (m / bc1) / (sqrt(v / bc2) + eps) + wd * p ),   bc_i = 1 - beta_i^t
 * Weight decay is decoupled (it multiplies p, not g) and applied to parameters of 2 or more
 * dims only: decaying gains (RMSNorm weights) and biases towards 0 only hurts.
 *
 * State: m and v are flat f32 buffers per bucket, named per parameter "<param>.adamw_m" /
 * "<param>.adamw_v" (see optimizer.c for their lifetime).
 *
 * Precision: f32 and bf16 parameters are updated in f32 arithmetic, f64 parameters in f64
 * (state stays f32 either way). bf16 parameters are updated on their f32 master copy and
 * rounded from it (mixed precision), so small updates accumulate.
 */
#include <math.h>

#include "optimizer.h"

tm_adamw_config tm_adamw_config_default(void) {
    tm_adamw_config c = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0};
    return c;
}

/* Written as negated ranges so that NaN fails every test. */
static tm_status check_config(tm_ctx *ctx, const tm_adamw_config *c) {
    const char *fn = "tm_adamw_new";
    if (!(c->lr >= 0.0 && isfinite(c->lr)))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: lr must be finite and >= 0, got %g", fn, c->lr);
    if (!(c->beta1 >= 0.0 && c->beta1 < 1.0))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: beta1 must be in [0, 1), got %g", fn, c->beta1);
    if (!(c->beta2 >= 0.0 && c->beta2 < 1.0))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: beta2 must be in [0, 1), got %g", fn, c->beta2);
    if (!(c->eps > 0.0 && isfinite(c->eps)))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: eps must be finite and > 0, got %g", fn, c->eps);
    if (!(c->weight_decay >= 0.0 && isfinite(c->weight_decay)))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: weight_decay must be finite and >= 0, got %g", fn,
                       c->weight_decay);
    return TM_OK;
}

tm_status tm_adamw_new(tm_ctx *ctx, const tm_adamw_config *cfg, tm_optimizer **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_adamw_new: out is NULL");
    tm_adamw_config c = cfg ? *cfg : tm_adamw_config_default();
    TM__TRY(check_config(ctx, &c));
    static const char *const suffix[2] = {".adamw_m", ".adamw_v"};
    tm_optimizer *opt = NULL;
    TM__TRY(tm__optimizer_create(ctx, "tm_adamw_new", 2, suffix, "optim.adamw.steps", &opt));
    opt->kind = TM__OPT_ADAMW;
    opt->name = "AdamW";
    opt->op = "adamw_update_multi";
    opt->cfg.adamw = c;
    opt->lr = c.lr;
    *out = opt;
    return TM_OK;
}
