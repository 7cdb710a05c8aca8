/*
 * schedule.c — learning-rate schedules (tm_lr_at, tm_lr_schedule_check).
 *
 * With W = warmup_steps, S = total_steps, step counted from 0 (tinymoe.h has the contract):
 *   warmup   lr * (step + 1) / W for step < W (every kind but constant): the first step
 *            already moves (lr / W), the last warmup step reaches lr * W / W = lr;
 *   constant lr;
 *   cosine   min_lr + (lr - min_lr) (1 + cos(pi p)) / 2, p = (step - W) / (S - W)
 *            (Loshchilov & Hutter 2017, "SGDR", one cycle, no restarts);
 *   linear   lr + (min_lr - lr) p;
 *   wsd      warmup-stable-decay (Hu et al. 2024, "MiniCPM", sec. 4): lr until step
 *            S - D with D = decay_fraction * S, then linear to min_lr over those D steps:
 *            p = (step - (S - D)) / D.
 * p is clamped to [0, 1]: steps at or past S give min_lr; a decay of length 0 (S = W, or
 * D = 0) is a step down to min_lr at S. D is not rounded, so decay_fraction * S need not be
 * an integer. Where the wsd decay starts inside the warmup, warmup wins for step < W.
 * A negative step is a caller's bug: NaN, like an invalid schedule, so it cannot train quietly.
 */
#include <math.h>

#include "extend.h"

static int is_decaying(tm_lr_kind k) { return k == TM_LR_COSINE || k == TM_LR_LINEAR || k == TM_LR_WSD; }

/* Written as negated ranges so that NaN fails every test. Only the fields a kind reads are
 * checked (a constant schedule may leave min_lr, total_steps and decay_fraction zero). */
tm_status tm_lr_schedule_check(tm_ctx *ctx, const tm_lr_schedule *s) {
    const char *fn = "tm_lr_schedule";
    if (!s) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: schedule is NULL", fn);
    if (s->kind != TM_LR_CONSTANT && !is_decaying(s->kind))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: kind must be constant (0), cosine (1), linear (2) or wsd (3), got %d",
                       fn, (int)s->kind);
    if (!(s->lr >= 0.0 && isfinite(s->lr)))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: lr must be finite and >= 0, got %g", fn, s->lr);
    if (s->warmup_steps < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: warmup_steps must be >= 0, got %lld", fn,
                       (long long)s->warmup_steps);
    if (!is_decaying(s->kind)) return TM_OK;
    if (!(s->min_lr >= 0.0 && s->min_lr <= s->lr))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: min_lr must be in [0, lr = %g], got %g", fn, s->lr, s->min_lr);
    if (s->total_steps < s->warmup_steps)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: total_steps must be >= warmup_steps = %lld, got %lld", fn,
                       (long long)s->warmup_steps, (long long)s->total_steps);
    if (s->kind == TM_LR_WSD && !(s->decay_fraction > 0.0 && s->decay_fraction <= 1.0))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: decay_fraction must be in (0, 1], got %g", fn,
                       s->decay_fraction);
    return TM_OK;
}

/* (x - start) / len clamped to [0, 1]; a zero-length interval is a step at start. */
static double progress(double x, double start, double len) {
    if (len <= 0.0) return x >= start ? 1.0 : 0.0;
    double p = (x - start) / len;
    return p < 0.0 ? 0.0 : p > 1.0 ? 1.0 : p;
}

double tm_lr_at(const tm_lr_schedule *s, int64_t step) {
    if (step < 0 || tm_lr_schedule_check(NULL, s) != TM_OK) return NAN;
    if (s->kind == TM_LR_CONSTANT) return s->lr;
    if (step < s->warmup_steps) return s->lr * (double)(step + 1) / (double)s->warmup_steps;
    double x = (double)step, S = (double)s->total_steps, W = (double)s->warmup_steps;
    switch (s->kind) {
    case TM_LR_COSINE: {
        double p = progress(x, W, S - W);
        return s->min_lr + (s->lr - s->min_lr) * 0.5 * (1.0 + cos(M_PI * p));
    }
    case TM_LR_LINEAR: return s->lr + (s->min_lr - s->lr) * progress(x, W, S - W);
    case TM_LR_WSD: {
        double D = s->decay_fraction * S;
        return s->lr + (s->min_lr - s->lr) * progress(x, S - D, D);
    }
    default: return NAN; /* excluded by the check */
    }
}
