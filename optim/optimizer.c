/*
 * optimizer.c — the algorithm-independent half of tm_optimizer: creation over the context's
 * buckets with flat state, and tm_optimizer_step / _steps / _free.
 *
 * State is flat per bucket (the bucket's layout, so a step is one update op per run of
 * parameters sharing a decay setting, or for AdamW one fused op per device over all the runs,
 * and a later optimizer shard is a [lo, hi) range of it)
 * and named per parameter ("<param>.adamw_m", "<param>.sgd_b", "<param>.master", ..., and the
 * step counter "optim.adamw.steps" / "optim.sgd.steps"): found by name (checkpoints, which
 * keep storing per-parameter tensors) and freed with the context, not with the optimizer.
 * Their names also make a second optimizer of the same algorithm over the same parameters an
 * error instead of two optimizers silently sharing state.
 *
 * Only public calls and framework/extend.h: no device code, no context internals. Growing a
 * bucket (tm_param_new after the optimizer was made) moves its data; the optimizer holds
 * tensors, not pointers, and covers the bucket's first `numel` elements (those it was made
 * with).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

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

/* Decay runs of bucket bi: its parameters (in bucket order = creation order), each extended
 * over the padding that follows it, merged while the decay setting agrees. */
static tm_status make_runs(tm_ctx *ctx, const char *fn, tm__opt_bucket *ob) {
    int n = tm_ctx_num_params(ctx), k = 0;
    ob->runs = tm__host_alloc(ctx, sizeof *ob->runs * (size_t)(n ? n : 1));
    if (!ob->runs) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    for (int i = 0; i < n; i++) {
        tm_tensor *p = tm_ctx_param(ctx, i);
        tm_param_info pi;
        TM__TRY(tm_param_get_info(p, &pi));
        if (pi.bucket != ob->bucket) continue;
        int decay = tm_tensor_ndim(p) >= 2;
        if (k > 0 && ob->runs[k - 1].decay == decay) {
            ob->runs[k - 1].hi = ob->numel; /* provisional: cut by the next run */
            continue;
        }
        if (k > 0) ob->runs[k - 1].hi = pi.bucket_offset;
        ob->runs[k].lo = k == 0 ? 0 : pi.bucket_offset;
        ob->runs[k].hi = ob->numel;
        ob->runs[k].decay = decay;
        k++;
    }
    ob->n_runs = k;
    return TM_OK;
}

tm_status tm__optimizer_create(tm_ctx *ctx, const char *fn, int n_state, const char *const *suffix,
                               const char *counter, tm_optimizer **out) {
    int n = tm_ctx_num_params(ctx);
    if (n == 0) return tm__err(ctx, TM_ERR_STATE, "%s: the context has no parameters (tm_param_new)", fn);
    if (tm__ctx_no_grad_buffers(ctx))
        return tm__err(ctx, TM_ERR_STATE, "%s: this context was made with tm_ctx_options.no_grad_buffers = 1 (forwards "
                       "only: its parameters have no gradients to step on); make the context without it to train", fn);
    if (n_state < 0 || n_state > TM__OPT_MAX_STATE)
        return tm__err(ctx, TM_ERR_INTERNAL, "%s: %d state buffers per parameter", fn, n_state);
    int nb = tm_ctx_num_buckets(ctx);

    char name[192];
    for (int i = 0; i < n; i++) {
        tm_tensor *p = tm_ctx_param(ctx, i);
        for (int j = 0; j < n_state; j++) TM__TRY(state_name(ctx, fn, name, sizeof name, tm_tensor_name(p), suffix[j]));
        tm_param_info pinfo;
        tm_bucket_info binfo;
        TM__TRY(tm_param_get_info(p, &pinfo));
        TM__TRY(tm_ctx_bucket_info(ctx, pinfo.bucket, &binfo));
        if (tm_tensor_dtype(p) == TM_BF16 && !binfo.has_master)
            TM__TRY(state_name(ctx, fn, name, sizeof name, tm_tensor_name(p), ".master"));
    }
    TM__TRY(state_name(ctx, fn, name, sizeof name, counter, ""));

    tm_optimizer *opt = tm__host_alloc(ctx, sizeof *opt);
    tm__opt_bucket *b = tm__host_alloc(ctx, sizeof *b * (size_t)nb);
    if (!opt || !b) {
        tm__host_free(ctx, opt);
        tm__host_free(ctx, b);
        return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    }
    memset(opt, 0, sizeof *opt);
    memset(b, 0, sizeof *b * (size_t)nb);
    opt->ctx = ctx;
    opt->n_state = n_state;
    opt->n_buckets = nb;
    opt->b = b;
    /* The step count (AdamW's bias correction) lives in a host buffer, so a checkpoint of the
     * context restores it with the moments. On failure below, the buffers made so far stay
     * with the context (buffers cannot be freed one by one); only NOMEM or a CUDA error can
     * get there after the name checks. */
    tm_status s = tm_buffer_new(ctx, counter, TM_I64, 0, NULL, (tm_device){TM_DEVICE_CPU, 0}, &opt->counter);
    for (int k = 0; s == TM_OK && k < nb; k++) {
        tm_bucket_info bi;
        s = tm_ctx_bucket_info(ctx, k, &bi);
        b[k].bucket = k;
        b[k].numel = bi.numel;
        if (s == TM_OK) s = tm_ctx_grad_shard(ctx, k, &b[k].lo, &b[k].hi);
        if (s == TM_OK && bi.dtype == TM_BF16) s = tm__bucket_master_ensure(ctx, k);
        if (s == TM_OK) s = tm__bucket_grad_shard_ensure(ctx, k); /* ZeRO-2 */
        for (int j = 0; s == TM_OK && j < n_state; j++)
            s = tm__state_alloc_n(ctx, fn, k, b[k].hi - b[k].lo, &b[k].state[j]);
        if (s == TM_OK) s = make_runs(ctx, fn, &b[k]);
    }
    /* ZeRO-3: from here on this rank keeps its block of the parameters only (fsdp.c) */
    if (s == TM_OK) s = tm__zero3_shard_params(ctx);
    /* per-parameter names, in parameter order */
    for (int i = 0; s == TM_OK && i < n; i++) {
        tm_tensor *p = tm_ctx_param(ctx, i), *v;
        tm_param_info pi;
        s = tm_param_get_info(p, &pi);
        int64_t shape[TM_MAX_DIMS];
        int nd = tm_tensor_ndim(p);
        for (int d = 0; d < nd; d++) shape[d] = tm_tensor_dim(p, d);
        const tm__opt_bucket *ob = &b[pi.bucket];
        int zero = tm__zero_enabled(ctx), g = tm__bucket_comm_group(ctx, pi.bucket);
        int64_t blk = zero ? tm__zero_block(ctx, pi.bucket) : 0;
        for (int j = 0; s == TM_OK && j < n_state; j++) {
            snprintf(name, sizeof name, "%s%s", tm_tensor_name(p), suffix[j]);
            /* Under ZeRO-1 the name covers state spread over the group's blocks. */
            s = tm__named_alias(ctx, fn, name, ob->state[j], nd, shape, zero ? 0 : pi.bucket_offset, &v);
            if (s == TM_OK) tm__named_set_like(v, p);
            if (s == TM_OK && zero) s = tm__named_set_zero(ctx, v, g, pi.bucket_offset, blk, ob->lo, ob->hi);
        }
        tm_tensor *master = tm__param_master(p), *M = tm_ctx_bucket_tensor(ctx, pi.bucket, TM_BUCKET_MASTER);
        if (s == TM_OK && M && !tm_ctx_find(ctx, (snprintf(name, sizeof name, "%s.master", tm_tensor_name(p)), name))) {
            /* Under ZeRO-1 the bucket's master holds this rank's block only (param.c): the name
             * is gathered from the blocks' owners like the state. */
            if (zero) {
                s = tm__named_alias(ctx, fn, name, M, nd, shape, 0, &v);
                if (s == TM_OK) s = tm__named_set_zero(ctx, v, g, pi.bucket_offset, blk, ob->lo, ob->hi);
            } else {
                s = tm__named_alias(ctx, fn, name, master, nd, shape, 0, &v);
            }
            if (s == TM_OK) tm__named_set_like(v, p);
        }
    }
    if (s != TM_OK) {
        tm_optimizer_free(opt);
        return s;
    }
    *out = opt;
    return TM_OK;
}

/* A [lo, hi) slice of a flat bucket tensor (an arena header; no data moves). */
static tm_status range(tm_ctx *ctx, tm_tensor *flat, int64_t lo, int64_t hi, tm_tensor **out) {
    return tm_slice(ctx, flat, 0, lo, hi, out);
}

/* The part of run r of bucket ob in this rank's range [ob->lo, ob->hi) (all of it without
 * ZeRO-1); empty when a >= e. */
static void run_part(const tm__opt_bucket *ob, const tm__opt_run *run, int64_t *a, int64_t *e) {
    *a = run->lo > ob->lo ? run->lo : ob->lo;
    *e = run->hi < ob->hi ? run->hi : ob->hi;
}

/* The gradients a step reads: the bucket's, or under ZeRO-2 this rank's reduced shard (element
 * i = bucket element *goff + i), which exists once tm_comm_sync_grads made it. */
static tm_status reduced_grads(tm_ctx *ctx, int bucket, tm_tensor **G, int64_t *goff) {
    TM__TRY(tm__bucket_grads_settle(ctx, bucket));
    *G = tm__bucket_grads_reduced(ctx, bucket, goff);
    if (!*G)
        return tm__err(ctx, TM_ERR_STATE, "tm_optimizer_step: bucket %d (\"%s\", ...) has no reduced gradients: under "
                       "ZeRO-2 call tm_comm_sync_grads after the backward", bucket, tm__bucket_first_param(ctx, bucket));
    return TM_OK;
}

/* AdamW: one adamw_update_multi per device over every run of its buckets, each run with its
 * weight decay: the same bits as one adamw_update per run, in one CUDA launch. The ranges are
 * described afresh each step (no slices: offsets into the flat bucket tensors), and their table
 * goes to the device only when it changed (the first step, a bucket that moved). */
static tm_status adamw_step(tm_optimizer *opt, double lr, int64_t t, tm_tensor *grad_scale) {
    tm_ctx *ctx = opt->ctx;
    const tm_adamw_config *c = &opt->cfg.adamw;
    for (int d = 0; d < 2; d++) {
        int cap = 0;
        tm_device dev = tm_cpu();
        for (int k = 0; k < opt->n_buckets; k++) {
            tm_bucket_info bi;
            TM__TRY(tm_ctx_bucket_info(ctx, opt->b[k].bucket, &bi));
            if ((bi.device.type == TM_DEVICE_CUDA) != d) continue;
            cap += opt->b[k].n_runs;
            dev = bi.device;
        }
        if (cap == 0) continue;
        if (!opt->segs[d]) TM__TRY(tm__segs_new(ctx, "tm_optimizer_step", dev, cap, &opt->segs[d]));
        tm__segs *l = opt->segs[d];
        TM__TRY(tm__segs_begin(ctx, l, TM__SEGS_ADAMW, cap));
        for (int k = 0; k < opt->n_buckets; k++) {
            const tm__opt_bucket *ob = &opt->b[k];
            tm_bucket_info bi;
            TM__TRY(tm_ctx_bucket_info(ctx, ob->bucket, &bi));
            if ((bi.device.type == TM_DEVICE_CUDA) != d) continue;
            tm_tensor *P = tm_ctx_bucket_tensor(ctx, ob->bucket, TM_BUCKET_PARAMS);
            int64_t goff, poff = tm__bucket_params_offset(ctx, ob->bucket);
            tm_tensor *G;
            TM__TRY(reduced_grads(ctx, ob->bucket, &G, &goff));
            tm_tensor *M = tm_ctx_bucket_tensor(ctx, ob->bucket, TM_BUCKET_MASTER);
            for (int r = 0; r < ob->n_runs; r++) {
                int64_t a, e;
                run_part(ob, &ob->runs[r], &a, &e);
                if (a >= e) continue;
                /* (the state and the master hold [lo, hi) only under ZeRO-1 and 2, and so do
                 * the gradients under ZeRO-2) */
                TM__TRY(tm__segs_add_adamw(ctx, l, P, G, ob->state[0], ob->state[1], M, a, e, ob->lo, goff, poff,
                                           ob->runs[r].decay ? c->weight_decay : 0.0));
            }
        }
        TM__TRY(tm__adamw_update_multi(ctx, l, c, lr, t, grad_scale));
    }
    return TM_OK;
}

/* SGD: one sgd_update per run of parameters that share the weight-decay setting (slices of
 * the flat bucket tensors). */
static tm_status sgd_step(tm_optimizer *opt, double lr, int64_t t) {
    tm_ctx *ctx = opt->ctx;
    for (int k = 0; k < opt->n_buckets; k++) {
        const tm__opt_bucket *ob = &opt->b[k];
        tm_tensor *P = tm_ctx_bucket_tensor(ctx, ob->bucket, TM_BUCKET_PARAMS);
        int64_t goff, poff = tm__bucket_params_offset(ctx, ob->bucket);
        tm_tensor *G;
        TM__TRY(reduced_grads(ctx, ob->bucket, &G, &goff));
        tm_tensor *M = tm_ctx_bucket_tensor(ctx, ob->bucket, TM_BUCKET_MASTER);
        for (int r = 0; r < ob->n_runs; r++) {
            const tm__opt_run *run = &ob->runs[r];
            int64_t a, e;
            run_part(ob, run, &a, &e);
            if (a >= e) continue;
            tm_tensor *p, *g, *m = NULL, *st[TM__OPT_MAX_STATE] = {NULL, NULL};
            TM__TRY(range(ctx, P, a - poff, e - poff, &p));
            TM__TRY(range(ctx, G, a - goff, e - goff, &g));
            /* (the master, like the state, holds [lo, hi) only under ZeRO-1) */
            if (M) TM__TRY(range(ctx, M, a - ob->lo, e - ob->lo, &m));
            for (int j = 0; j < opt->n_state; j++) TM__TRY(range(ctx, ob->state[j], a - ob->lo, e - ob->lo, &st[j]));
            TM__TRY(tm__sgd_run(opt, p, g, st, m, run->decay, lr, t));
        }
    }
    return TM_OK;
}

/* SGD reads its gradients once per run, op by op: the clip's factor is applied beforehand
 * by one grad_scale_multi over the buckets' ranges [lo, hi) (the pass tm_ctx_clip_grad_norm
 * would have made; no fused SGD kernel yet). */
static tm_status sgd_prescale(tm_optimizer *opt, tm_tensor *grad_scale) {
    tm_ctx *ctx = opt->ctx;
    tm__segs *l;
    TM__TRY(tm__ctx_segs(ctx, tm_tensor_device(grad_scale), opt->n_buckets, &l));
    TM__TRY(tm__segs_begin(ctx, l, TM__SEGS_GRADS, opt->n_buckets));
    for (int k = 0; k < opt->n_buckets; k++) {
        const tm__opt_bucket *ob = &opt->b[k];
        if (ob->hi > ob->lo)
            TM__TRY(tm__segs_add_grad(ctx, l, tm_ctx_bucket_tensor(ctx, ob->bucket, TM_BUCKET_GRADS), ob->lo, ob->hi));
    }
    return tm__grad_scale_multi(ctx, l, grad_scale);
}

tm_status tm_optimizer_step(tm_optimizer *opt, double lr) { return tm_optimizer_step_scaled(opt, lr, NULL); }

tm_status tm_optimizer_step_scaled(tm_optimizer *opt, double lr, tm_tensor *grad_scale) {
    if (!opt) return TM_ERR_INVALID_ARG;
    tm_ctx *ctx = opt->ctx;
    const char *fn = grad_scale ? "tm_optimizer_step_scaled" : "tm_optimizer_step";
    if (lr < 0.0) lr = opt->lr;
    if (!isfinite(lr)) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: lr must be finite, got %g", fn, lr);
    if (grad_scale) {
        tm_device gd = tm_tensor_device(grad_scale);
        tm_dtype want = gd.type == TM_DEVICE_CUDA ? TM_F32 : TM_F64;
        if (tm_tensor_ndim(grad_scale) != 0 || tm_tensor_dtype(grad_scale) != want)
            return tm__err(ctx, TM_ERR_INVALID_ARG,
                           "%s: grad_scale must be the 0-d %s factor of tm_ctx_clip_grad_norm_deferred, got %s %dd", fn,
                           tm_dtype_name(want), tm_dtype_name(tm_tensor_dtype(grad_scale)), tm_tensor_ndim(grad_scale));
        for (int k = 0; k < opt->n_buckets; k++) {
            tm_bucket_info bi;
            TM__TRY(tm_ctx_bucket_info(ctx, opt->b[k].bucket, &bi));
            if (bi.device.type != gd.type || bi.device.index != gd.index)
                return tm__err(ctx, TM_ERR_DEVICE,
                               "%s: grad_scale is on %s %d but bucket %d (parameters such as \"%s\") is on %s %d; "
                               "nothing was changed", fn, gd.type == TM_DEVICE_CUDA ? "CUDA" : "CPU", gd.index, k,
                               tm__bucket_first_param(ctx, opt->b[k].bucket),
                               bi.device.type == TM_DEVICE_CUDA ? "CUDA" : "CPU", bi.device.index);
        }
    }
    /* Refuse before touching anything, so a failed step leaves every parameter as it was. */
    for (int k = 0; k < opt->n_buckets; k++) {
        tm_bucket_info bi;
        TM__TRY(tm_ctx_bucket_info(ctx, opt->b[k].bucket, &bi));
        if (!tm__op_available(ctx, opt->op, bi.device))
            return tm__err(ctx, TM_ERR_UNSUPPORTED,
                           "%s: %s has no %s kernel on %s yet (bucket %d: %s parameters such as "
                           "\"%s\"); nothing was changed", fn, opt->name, opt->op,
                           bi.device.type == TM_DEVICE_CUDA ? "CUDA" : "the CPU", k, tm_dtype_name(bi.dtype),
                           tm__bucket_first_param(ctx, opt->b[k].bucket));
    }
    int64_t t = 0;
    TM__TRY(tm_tensor_read(ctx, opt->counter, TM_I64, &t, 1));
    t += 1;
    if (opt->kind == TM__OPT_ADAMW) {
        TM__TRY(adamw_step(opt, lr, t, grad_scale));
    } else {
        if (grad_scale) TM__TRY(sgd_prescale(opt, grad_scale));
        TM__TRY(sgd_step(opt, lr, t));
    }
    /* ZeRO-1: every rank updated its blocks; every rank needs every parameter. */
    TM__TRY(tm__zero_gather_params(ctx));
    return tm_tensor_write(ctx, opt->counter, TM_I64, &t, 1);
}

int64_t tm_optimizer_steps(const tm_optimizer *opt) {
    int64_t t = 0;
    if (opt) tm_tensor_read(opt->ctx, opt->counter, TM_I64, &t, 1);
    return t;
}

void tm_optimizer_free(tm_optimizer *opt) {
    if (!opt) return;
    tm_ctx *ctx = opt->ctx;
    for (int k = 0; k < opt->n_buckets; k++) tm__host_free(ctx, opt->b[k].runs);
    for (int d = 0; d < 2; d++) tm__segs_free(ctx, opt->segs[d]);
    tm__host_free(ctx, opt->b);
    tm__host_free(ctx, opt);
}
