/* eval.c — evaluation: the mean validation loss of a run (tmd_run_evaluate, which the training
 * loop calls too) and `tinymoe eval` (tmd_eval, tmd_eval_ckpt; see train.h). */
#include "train.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "markov.h"
#include "run.h"
#include "status.h"
#include "stop.h"
#include "tinymoe.h"
#include "util.h"

/* Synthetic validation sequences come from their own Philox streams, disjoint from every
 * training stream (step * grad_accum + micro) * batch_size + row < 2^61. */
static const uint64_t VAL_STREAM = 1ull << 61;

/* Validation window w: a fixed synthetic sequence, or tokens [w T, w T + T] of the val set. */
static void val_window(tmd_run *r, int64_t w, int32_t *inp, int32_t *tgt) {
    if (r->synth) {
        tmd_markov_sample(&r->src, (uint64_t)r->c.seed, VAL_STREAM | (uint64_t)w, r->seq, r->T + 1);
    } else {
        const uint32_t *t = r->val.tok + w * r->T;
        for (int i = 0; i <= r->T; i++) r->seq[i] = (int32_t)t[i];
    }
    memcpy(inp, r->seq, sizeof *r->seq * (size_t)r->T);
    memcpy(tgt, r->seq + 1, sizeof *r->seq * (size_t)r->T);
}

/* Mean cross-entropy over the validation windows, with grad mode off. */
int tmd_run_evaluate(tmd_run *r, double *loss, char *err, size_t errlen) {
    int prev = tm_ctx_set_grad_enabled(r->ctx, 0);
    double sum = 0;
    int64_t tokens = 0;
    int rc = 0;
    for (int64_t w0 = 0; w0 < r->n_eval; w0 += r->B) {
        /* A long evaluation must not hold a stop request back until it ends. */
        if (tmd_stop_signal()) {
            rc = 128 + tmd_stop_signal();
            tokens = 0;
            break;
        }
        int rows = (int)(r->n_eval - w0 < r->B ? r->n_eval - w0 : r->B);
        /* Distributed: each rank takes a slice of the batch's windows (the model's host values
         * are the whole batch's); a batch of fewer windows than ranks is run whole by every
         * rank (each then holds a 1 / world share of it). */
        int lo = 0, n = rows;
        if (r->world > 1 && rows >= r->world) {
            lo = (int)((int64_t)rows * r->rank / r->world);
            n = (int)((int64_t)rows * (r->rank + 1) / r->world) - lo;
        }
        for (int b = 0; b < n; b++) val_window(r, w0 + lo + b, r->inp + (size_t)b * r->T, r->tgt + (size_t)b * r->T);
        tm_model_out out;
        tm_status s = tmd_run_forward(r, n, 1, &out);
        if (s) {
            rc = tmd_run_lib_fail(r, err, errlen, "validation forward", s);
            break;
        }
        sum += out.ce_value * rows * r->T;
        tokens += (int64_t)rows * r->T;
        tm_ctx_arena_reset(r->ctx);
    }
    tm_ctx_arena_reset(r->ctx);
    tm_ctx_set_grad_enabled(r->ctx, prev);
    *loss = tokens ? sum / (double)tokens : NAN;
    return rc;
}

static int eval_run(const tmd_config *cfg, const char *ckpt, int format, FILE *log, double *loss, char *err,
                    size_t errlen) {
    tmd_run *r = calloc(1, sizeof *r);
    if (!r) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
    double v = NAN;
    tmd_config c = *cfg;
    int rc = ckpt ? tmd_run_resume_config(r, cfg, &c, 1, ckpt, err, errlen) : 0;
    if (!rc && !ckpt && cfg->init_from[0]) rc = tmd_run_init_from_config(cfg, &c, err, errlen);
    if (!rc) rc = tmd_run_setup(r, &c, format == TMD_EVAL_TEXT ? log : NULL, 1, err, errlen);
    if (!rc) {
        tmd_run_print_header(r, 1);
        double t0 = tmd_now_s();
        rc = tmd_run_evaluate(r, &v, err, errlen);
        if (!rc && log && r->rank == 0 && format == TMD_EVAL_JSON) {
            tmd_json j;
            tmd_json_begin(&j);
            tmd_json_num(&j, "loss", v);
            tmd_json_num(&j, "perplexity", exp(v));
            tmd_json_int(&j, "tokens", (int64_t)r->n_eval * r->T);
            tmd_json_num(&j, "seconds", tmd_now_s() - t0);
            if (r->synth) tmd_json_num(&j, "optimum", r->optimum);
            if (ckpt) {
                tmd_json_str(&j, "model", r->resume_path);
                tmd_json_int(&j, "step", r->resume_state.step);
            } else {
                tmd_json_str(&j, "model", c.init_from[0] ? c.init_from : "initialised");
            }
            fprintf(log, "%s\n", tmd_json_end(&j));
            fflush(log);
        } else if (!rc && log && r->rank == 0 && format == TMD_EVAL_QUIET) {
            fprintf(log, "loss %.6f nats/token, perplexity %.3f, over %lld tokens\n", v, exp(v),
                    (long long)r->n_eval * r->T);
            fflush(log);
        } else if (!rc && log && r->rank == 0) { /* under mpirun: rank 0 reports */
            fprintf(log, "loss %.6f nats/token, perplexity %.3f, over %lld tokens (%.1f s)", v, exp(v),
                    (long long)r->n_eval * r->T, tmd_now_s() - t0);
            if (r->synth) fprintf(log, "; optimum %.4f", r->optimum);
            if (ckpt)
                fprintf(log, "\nmodel: %s (step %lld)\n", r->resume_path, (long long)r->resume_state.step);
            else if (c.init_from[0])
                fprintf(log, "\nmodel: the Hugging Face export in %s\n", c.init_from);
            else
                fprintf(log, "\nmodel: freshly initialised from the config and seed (give --ckpt to evaluate a "
                             "trained one)\n");
        }
        /* Not a measurement: the weights are finite (checked at the load), so the forward pass
         * overflowed. A script must not read it as a result. */
        if (!rc && !isfinite(v))
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR,
                          "the mean loss is %g: the model's forward pass overflows on this data (its weights are "
                          "finite, but a run that diverged can leave them too large)",
                          v);
    }
    if (loss) *loss = v;
    tmd_run_free(r);
    free(r);
    return rc;
}

int tmd_eval(const tmd_config *cfg, FILE *log, double *loss, char *err, size_t errlen) {
    return eval_run(cfg, NULL, TMD_EVAL_TEXT, log, loss, err, errlen);
}

int tmd_eval_ckpt(const tmd_config *cfg, const char *ckpt, FILE *log, double *loss, char *err, size_t errlen) {
    return eval_run(cfg, ckpt, TMD_EVAL_TEXT, log, loss, err, errlen);
}

int tmd_eval_format(const tmd_config *cfg, const char *ckpt, int format, FILE *log, double *loss, char *err,
                    size_t errlen) {
    return eval_run(cfg, ckpt, format, log, loss, err, errlen);
}
