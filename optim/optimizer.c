/*
 * optimizer.c — the algorithm-independent half of tm_optimizer: creation over the context's
 * parameters with per-parameter state buffers, and tm_optimizer_step / _steps / _free.
 *
 * State buffers are persistent context buffers ("<param>.adamw_m", "<param>.sgd_b", ..., and
 * the step counter "optim.adamw.steps" / "optim.sgd.steps"):
 * found by name (checkpoints) and freed with the context, not with the optimizer. Their names
 * also make a second optimizer of the same algorithm over the same parameters an error
 * instead of two optimizers silently sharing state.
 *
 * The optimizer never caches data pointers: growing the parameter buffer (tm_param_new after
 * the optimizer was made) moves it, so every step goes through tm__data().
 */
#include <math.h>
#include <stdio.h>

#include "optimizer.h"

/* "<param><suffix>" into buf (>= 128 + suffix bytes); INVALID_ARG when the result would not be
 * a legal name (<= 127 bytes), STATE when it exists, so that no state buffer is created before
 * every name is known to work. */
static tm_status state_name(tm_ctx *ctx, const char *fn, char *buf, size_t cap, const char *param,
                            const char *suffix) {
    int k = snprintf(buf, cap, "%s%s", param, suffix);
    if (k < 0 || k > 127)
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "%s: state buffer name \"%s%s\" would exceed 127 bytes; shorten parameter \"%s\"", fn,
                       param, suffix, param);
    if (tm_ctx_find(ctx, buf))
        return tm__err(ctx, TM_ERR_STATE,
                       "%s: \"%s\" already exists (one optimizer of a kind per context and parameter)", fn, buf);
    return TM_OK;
}

tm_status tm__optimizer_create(tm_ctx *ctx, const char *fn, int n_state, const char *const *suffix,
                               const char *counter, tm_optimizer **out) {
    int n = tm_ctx_num_params(ctx);
    if (n == 0) return tm__err(ctx, TM_ERR_STATE, "%s: the context has no parameters (tm_param_new)", fn);
    if (n_state < 0 || n_state > TM__OPT_MAX_STATE)
        return tm__err(ctx, TM_ERR_INTERNAL, "%s: %d state buffers per parameter", fn, n_state);

    char name[192];
    for (int k = 0; k < ctx->n_named; k++) {
        if (!ctx->named[k]->is_param) continue;
        for (int j = 0; j < n_state; j++)
            TM__TRY(state_name(ctx, fn, name, sizeof name, ctx->named[k]->name, suffix[j]));
    }
    TM__TRY(state_name(ctx, fn, name, sizeof name, counter, ""));

    tm_optimizer *opt = tm__host_alloc(ctx, sizeof *opt);
    tm_tensor **arr = tm__host_alloc(ctx, (size_t)(1 + n_state) * (size_t)n * sizeof *arr);
    if (!opt || !arr) {
        tm__host_free(ctx, opt);
        tm__host_free(ctx, arr);
        return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    }
    memset(opt, 0, sizeof *opt);
    memset(arr, 0, (size_t)(1 + n_state) * (size_t)n * sizeof *arr);
    opt->ctx = ctx;
    opt->n = n;
    opt->n_state = n_state;
    opt->param = arr;
    for (int j = 0; j < n_state; j++) opt->state[j] = arr + (size_t)(j + 1) * (size_t)n;
    /* Collect the parameters before creating buffers: tm_buffer_new may grow ctx->named. */
    for (int k = 0, i = 0; k < ctx->n_named; k++)
        if (ctx->named[k]->is_param) opt->param[i++] = ctx->named[k];
    /* The step count (AdamW's bias correction) lives in a host buffer, so a checkpoint of the
     * context restores it with the moments. */
    tm_status s = tm_buffer_new(ctx, counter, TM_I64, 0, NULL, (tm_device){TM_DEVICE_CPU, 0}, &opt->counter);
    if (s != TM_OK) {
        tm_optimizer_free(opt);
        return s;
    }
    for (int i = 0; i < n; i++) {
        const tm_tensor *p = opt->param[i];
        for (int j = 0; j < n_state; j++) {
            snprintf(name, sizeof name, "%s%s", p->name, suffix[j]);
            /* On failure the buffers made so far stay with the context (buffers cannot be
             * freed one by one); only NOMEM or a CUDA error can get here after the checks. */
            tm_status s = tm_buffer_new(ctx, name, TM_F32, p->ndim, p->shape, p->device, &opt->state[j][i]);
            if (s != TM_OK) {
                tm_optimizer_free(opt);
                return s;
            }
        }
    }
    *out = opt;
    return TM_OK;
}

tm_status tm_optimizer_step(tm_optimizer *opt, double lr) {
    if (!opt) return TM_ERR_INVALID_ARG;
    tm_ctx *ctx = opt->ctx;
    if (lr < 0.0) lr = opt->lr;
    if (!isfinite(lr)) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_optimizer_step: lr must be finite, got %g", lr);
    /* Refuse before touching anything, so a failed step leaves every parameter as it was. */
    for (int i = 0; i < opt->n; i++) {
        const tm_tensor *p = opt->param[i];
        if (p->device.type != TM_DEVICE_CPU)
            return tm__err(ctx, TM_ERR_UNSUPPORTED,
                           "tm_optimizer_step: %s on CUDA parameters is not implemented yet "
                           "(parameter \"%s\" is %s)", opt->name, p->name, tm__tdesc(ctx, p));
        if (!tm__is_float(p->dtype))
            return tm__err(ctx, TM_ERR_INTERNAL, "tm_optimizer_step: parameter \"%s\" has dtype %s", p->name,
                           tm_dtype_name(p->dtype));
    }
    int64_t *steps = tm__data(opt->counter);
    int64_t t = *steps + 1;
    for (int i = 0; i < opt->n; i++) {
        switch (opt->kind) {
        case TM__OPT_ADAMW: tm__adamw_update(opt, i, lr, t); break;
        case TM__OPT_SGD: tm__sgd_update(opt, i, lr, t); break;
        }
    }
    *steps = t;
    return TM_OK;
}

int64_t tm_optimizer_steps(const tm_optimizer *opt) { return opt ? *(const int64_t *)tm__data(opt->counter) : 0; }

void tm_optimizer_free(tm_optimizer *opt) {
    if (!opt) return;
    tm_ctx *ctx = opt->ctx;
    tm__host_free(ctx, opt->param);
    tm__host_free(ctx, opt);
}
