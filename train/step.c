/*
 * step.c — one optimizer step of `tinymoe train` (run.h: tmd_run_step): grad_accum
 * micro-batches, the guard against non-finite values, gradient clipping, the update and the
 * expert-bias update.
 *
 * The guard sits between the backward passes and the update: a loss or a gradient norm that is
 * NaN or infinite means the update would write non-finite weights, which the next checkpoint
 * would then keep (and --keep-last would prune the good ones for). So the step stops there:
 * it is skipped while skip_nonfinite allows (gradients zeroed, no update, the batch consumed,
 * as large-scale trainers do), and otherwise the run ends with a message naming the step and
 * the first tensor that went bad.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "finite.h"
#include "run.h"
#include "status.h"
#include "util.h"

/* Training micro-batch `micro` of `step` into r->inp / r->tgt. */
/* Rows [b0, b0 + Bl) of it: this rank's slice (all B rows in a single process), so that the
 * global batch and its order are the same for every layout. */
static void train_batch(tmd_run *r, int64_t step, int micro) {
    if (!r->synth) {
        tmd_batcher_next_rows(&r->bt, r->b0, r->Bl, r->inp, r->tgt);
        return;
    }
    /* Fresh sequences from the source: nothing can be memorised, so the training loss is an
     * unbiased estimate of the expected loss and its gap to the optimum is a true gap. */
    for (int b = r->b0; b < r->b0 + r->Bl; b++) {
        uint64_t stream = ((uint64_t)step * (uint64_t)r->c.grad_accum + (uint64_t)micro) * (uint64_t)r->B + (uint64_t)b;
        tmd_markov_sample(&r->src, (uint64_t)r->c.seed, stream, r->seq, r->T + 1);
        memcpy(r->inp + (size_t)(b - r->b0) * r->T, r->seq, sizeof *r->seq * (size_t)r->T);
        memcpy(r->tgt + (size_t)(b - r->b0) * r->T, r->seq + 1, sizeof *r->seq * (size_t)r->T);
    }
}


/* What went bad first: a gradient (the backward overflowed), else a weight (an earlier update
 * overflowed), else nothing (the forward overflowed on finite values). */
static void culprit(tmd_run *r, char *buf, size_t len) {
    tmd_nonfinite bad;
    char e[256], d[256];
    int g = tmd_find_nonfinite(r->ctx, 1, &bad, e, sizeof e);
    if (g == 1) {
        tmd_nonfinite_describe(&bad, d, sizeof d);
        snprintf(buf, len, "the first non-finite gradient: %s", d);
        return;
    }
    int w = g ? g : tmd_find_nonfinite(r->ctx, 0, &bad, e, sizeof e);
    if (w == 1) {
        tmd_nonfinite_describe(&bad, d, sizeof d);
        snprintf(buf, len, "the weights already held a non-finite value: %s", d);
    } else if (w) {
        snprintf(buf, len, "could not look for the tensor: %s", e);
    } else {
        snprintf(buf, len, "every weight and gradient is finite: the forward pass overflowed");
    }
}

static int nonfinite(tmd_run *r, int64_t step, double loss, double gnorm, tmd_step *out, char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    char what[96];
    if (isfinite(loss)) snprintf(what, sizeof what, "the gradient norm is %g", gnorm);
    else snprintf(what, sizeof what, "the training loss is %g", loss);
    if (r->skipped < c->skip_nonfinite) {
        r->skipped++;
        tm_status s = tm_ctx_zero_grad(r->ctx);
        tm_ctx_arena_reset(r->ctx);
        if (s) return tmd_run_lib_fail(r, err, errlen, "zeroing gradients", s);
        out->skipped = 1;
        out->loss = loss;
        out->gnorm = gnorm;
        return 0;
    }
    char why[512], ck[TMD_PATH_MAX + 160];
    culprit(r, why, sizeof why);
    tm_ctx_zero_grad(r->ctx);
    tm_ctx_arena_reset(r->ctx);
    if (r->saved_step >= 0) {
        char p[TMD_PATH_MAX + 32];
        tmd_ckpt_path(c->out, r->saved_step, p, sizeof p);
        if (r->prune_pending >= 0)
            snprintf(ck, sizeof ck, "the newest checkpoint, %s, holds the weights that gave this; none older was pruned", p);
        else
            snprintf(ck, sizeof ck, "the newest checkpoint of this run is %s", p);
    } else if (r->resume_path[0]) {
        snprintf(ck, sizeof ck, "this run resumed from %s", r->resume_path);
    } else {
        snprintf(ck, sizeof ck, "this run wrote no checkpoint");
    }
    char skips[64] = "";
    if (c->skip_nonfinite) snprintf(skips, sizeof skips, " after skipping %lld such steps", (long long)r->skipped);
    return tmd_fail(err, errlen, TMD_RUNTIME_ERROR,
                    "%s at step %lld%s (%s); stopped before the update, so no checkpoint holds it (%s). Try a lower "
                    "lr or grad_clip, or skip_nonfinite N to skip up to N such steps",
                    what, (long long)step + 1, skips, why, ck);
}

int tmd_run_step(tmd_run *r, int64_t step, double lr, tmd_step *out, char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    tm_status s;
    memset(out, 0, sizeof *out);
    double wait0 = tm_ctx_sync_seconds(r->ctx);
    tm_comm_reset_stats(r->ctx);
    if (r->step_load) memset(r->step_load, 0, sizeof *r->step_load * (size_t)r->n_moe * (size_t)r->E);
    for (int m = 0; m < c->grad_accum; m++) {
        train_batch(r, step, m);
        tm_model_out mo;
        if ((s = tmd_run_forward(r, r->Bl, 1, &mo))) return tmd_run_lib_fail(r, err, errlen, "forward", s);
        tm_tensor *l = mo.loss;
        /* Mean over micro-batches: each backward adds 1/grad_accum of its gradient. */
        if (c->grad_accum > 1 && (s = tm_scale(r->ctx, mo.loss, 1.0 / c->grad_accum, &l)))
            return tmd_run_lib_fail(r, err, errlen, "loss scaling", s);
        /* The last backward all-reduces the gradients as they become final, beside the rest of
         * it (tm_comm_sync_grads_in_backward); its all-reduce traffic is the gradient sync's.
         * auto: where the experts' gradients are all-reduced too (expert_dp > 1). With the dense
         * weights' alone (~10% of fine's bytes) it measured 0.9% slower on 2 H200s (dedup, 48.9
         * against 48.5 ms: the pieces contend with the all-to-alls), with all of them 3% faster
         * (data parallel, 48.1 against 49.6 ms). */
        const int gso = c->grad_sync_overlap == 1 ||
                        (c->grad_sync_overlap == 0 && tm_comm_size(r->ctx, TM_COMM_EXPERT_DP) > 1);
        const int arm = c->comm_overlap && gso && m == c->grad_accum - 1 && r->world > 1;
        tm_comm_stats b0, b1;
        if (arm && (s = tm_comm_sync_grads_in_backward(r->ctx)))
            return tmd_run_lib_fail(r, err, errlen, "arming the gradient synchronisation", s);
        if (arm) tm_comm_get_stats(r->ctx, &b0);
        if ((s = tm_backward(r->ctx, l))) return tmd_run_lib_fail(r, err, errlen, "backward", s);
        if (arm) {
            tm_comm_get_stats(r->ctx, &b1);
            out->sync_bytes += (double)(b1.bytes[TM_COMM_ALLREDUCE] - b0.bytes[TM_COMM_ALLREDUCE]);
            out->sync_s += b1.seconds[TM_COMM_ALLREDUCE] - b0.seconds[TM_COMM_ALLREDUCE];
        }
        double w = 1.0 / c->grad_accum;
        out->loss += w * mo.loss_value;
        out->ce += w * mo.ce_value;
        out->aux += w * (mo.aux_value + mo.seq_aux_value);
        out->z += w * mo.z_value;
        out->max_load += w * mo.max_load_ratio;
        out->dropped += mo.dropped_tokens;
        if (r->step_load && mo.tokens_per_expert && mo.n_moe_layers == r->n_moe)
            for (int i = 0; i < r->n_moe * r->E; i++) r->step_load[i] += (double)mo.tokens_per_expert[i];
        /* Parameter gradients persist; the activations of this micro-batch are done with. */
        tm_ctx_arena_reset(r->ctx);
    }
    double gnorm = NAN;
    if (!isfinite(out->loss)) return nonfinite(r, step, out->loss, gnorm, out, err, errlen);
    /* Distributed: every bucket's gradient summed over its group (one collective per bucket). */
    tm_comm_stats before, after;
    tm_comm_get_stats(r->ctx, &before);
    if ((s = tm_comm_sync_grads(r->ctx))) return tmd_run_lib_fail(r, err, errlen, "gradient synchronisation", s);
    tm_comm_get_stats(r->ctx, &after);
    for (int k = 0; k < TM_COMM_NKINDS; k++) {
        out->sync_bytes += (double)(after.bytes[k] - before.bytes[k]);
        out->sync_s += after.seconds[k] - before.seconds[k];
    }
    /* The clip's one device read (the norm; without &gnorm the clip would not wait at all):
     * needed every step, since the guard below must see a non-finite norm before the update,
     * and the norm is logged. The clip's factor goes to the update, which scales each gradient
     * as it reads it (one pass over the gradients fewer than scaling them here). */
    tm_tensor *grad_scale = NULL;
    if ((s = tm_ctx_clip_grad_norm_deferred(r->ctx, c->grad_clip, &gnorm, &grad_scale)))
        return tmd_run_lib_fail(r, err, errlen, "gradient clipping", s);
    if (!isfinite(gnorm)) return nonfinite(r, step, out->loss, gnorm, out, err, errlen);
    out->gnorm = gnorm;
    if ((s = tm_optimizer_step_scaled(r->opt, lr, grad_scale)))
        return tmd_run_lib_fail(r, err, errlen, "optimizer step", s);
    if ((s = tm_model_step(r->model))) return tmd_run_lib_fail(r, err, errlen, "expert-bias update", s);
    if ((s = tm_ctx_zero_grad(r->ctx))) return tmd_run_lib_fail(r, err, errlen, "zeroing gradients", s);
    tm_ctx_arena_reset(r->ctx);
    tm_comm_stats cs;
    tm_comm_get_stats(r->ctx, &cs);
    for (int k = 0; k < TM_COMM_NKINDS; k++) out->comm_bytes += (double)cs.bytes[k], out->comm_s += cs.seconds[k];
    r->last_comm = cs;
    out->wait_s = tm_ctx_sync_seconds(r->ctx) - wait0;
    return 0;
}
