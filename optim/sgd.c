/*
 * sgd.c — SGD with momentum: tm_sgd_new and its update of one bucket run through the
 * sgd_update op (kernels/cpu/update.c; optimizer.c drives it).
 *
 * The update of tinymoe.h, which is torch.optim.SGD's with dampening 0: Polyak's heavy-ball
 * momentum and Nesterov's variant as Sutskever et al. 2013 ("On the importance of
 * initialization and momentum in deep learning") write them, except that lr multiplies the
 * whole step instead of being folded into b (the paper's v is -lr b: the same while lr is
 * constant; under a schedule the current lr scales the whole momentum, as in PyTorch):
 *   g' = g + wd * p                     (L2 decay, parameters of 2 or more dims only)
 *   b  = momentum * b + g'
 *   p -= lr * (nesterov ? g' + momentum * b : b)
 * PyTorch initialises b to g' at the first step; b starts as a zero buffer here, and
 * momentum * 0 + g' is exactly g', so the two agree bit for bit.
 * Unlike AdamW's decoupled decay, wd here is added to the gradient, so it passes through the
 * momentum (classic L2 regularisation). As for AdamW, gains and biases are not decayed.
 *
 * State: momentum > 0 gives one flat f32 buffer per bucket, named per parameter "<param>.sgd_b";
 * momentum 0 is plain SGD and has no state at all.
 *
 * Precision: as AdamW (f32 arithmetic for f32 and bf16 parameters, f64 for f64, state f32,
 * bf16 parameters updated on their f32 master copy).
 */
#include <math.h>

#include "optimizer.h"

tm_sgd_config tm_sgd_config_default(void) {
    tm_sgd_config c = {.lr = 1e-2, .momentum = 0.9, .nesterov = 0, .weight_decay = 0.0};
    return c;
}

/* Written as negated ranges so that NaN fails every test. */
static tm_status check_config(tm_ctx *ctx, const tm_sgd_config *c) {
    const char *fn = "tm_sgd_new";
    if (!(c->lr >= 0.0 && isfinite(c->lr)))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: lr must be finite and >= 0, got %g", fn, c->lr);
    if (!(c->momentum >= 0.0 && c->momentum < 1.0))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: momentum must be in [0, 1), got %g", fn, c->momentum);
    if (c->nesterov != 0 && c->nesterov != 1)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: nesterov must be 0 or 1, got %d", fn, c->nesterov);
    if (c->nesterov && c->momentum == 0.0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: nesterov = 1 needs momentum > 0, got momentum %g", fn,
                       c->momentum);
    if (!(c->weight_decay >= 0.0 && isfinite(c->weight_decay)))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: weight_decay must be finite and >= 0, got %g", fn,
                       c->weight_decay);
    return TM_OK;
}

tm_status tm_sgd_new(tm_ctx *ctx, const tm_sgd_config *cfg, tm_optimizer **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_sgd_new: out is NULL");
    tm_sgd_config c = cfg ? *cfg : tm_sgd_config_default();
    TM__TRY(check_config(ctx, &c));
    static const char *const suffix[1] = {".sgd_b"};
    tm_optimizer *opt = NULL;
    TM__TRY(tm__optimizer_create(ctx, "tm_sgd_new", c.momentum > 0.0 ? 1 : 0, suffix, "optim.sgd.steps", &opt));
    opt->kind = TM__OPT_SGD;
    opt->name = "SGD";
    opt->op = "sgd_update";
    opt->cfg.sgd = c;
    opt->lr = c.lr;
    *out = opt;
    return TM_OK;
}

tm_status tm__sgd_run(const tm_optimizer *opt, tm_tensor *p, tm_tensor *g, tm_tensor **state, tm_tensor *master,
                      int decay, double lr, int64_t t) {
    const tm_sgd_config *c = &opt->cfg.sgd;
    return tm_sgd_update(opt->ctx, p, g, opt->n_state ? state[0] : NULL, master, c, lr, decay ? c->weight_decay : 0.0);
}
