/* train.c — the training loop of `tinymoe train`: steps (step.c), evaluations (eval.c), saves
 * (rundir.c), the log, the plots and the final report, on a run set up by run.c; see train.h.
 * Nothing below it calls back into it. Uses only the public header (plus the driver's own
 * headers). */
#include "train.h"

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint.h"
#include "data.h"
#include "finite.h"
#include "generate.h"
#include "hf.h"
#include "lock.h"
#include "layout.h"
#include "log.h"
#include "markov.h"
#include "plot.h"
#include "run.h"
#include "rundir.h"
#include "status.h"
#include "stop.h"
#include "tinymoe.h"
#include "tokenizer.h"
#include "util.h"

/* Plot resolution: steps of the loss curve, columns of the heatmap. */
enum { LOSS_BINS = 1000, LOAD_BINS = 160 };


typedef struct interval {
    int n;
    double loss, ce, aux, z, gnorm, seconds, max_load;
    int64_t dropped;
    /* distributed: this rank's collectives (tm_comm_get_stats), and the gradient sync's part */
    double comm_bytes, comm_s, sync_bytes, sync_s;
    double wait_s; /* host blocked on the device (tm_ctx_sync_seconds) */
} interval;

/* A failed TensorBoard write stops TensorBoard logging with one message; training goes on
 * (metrics.jsonl holds the same figures). */
static void tb_check(tmd_run *r, int rc) {
    if (!rc && !tmd_tb_flush(&r->tb)) return;
    fprintf(stderr, "tinymoe: cannot write '%s': %s; TensorBoard logging stops (metrics.jsonl goes on)\n", r->tb.path,
            strerror(errno ? errno : EIO));
    tmd_tb_close(&r->tb);
}

/* The interval's scalars as TensorBoard events, tagged as torchtitan / Megatron name them. */
static void tb_train(tmd_run *r, int64_t step, double lr, const interval *iv, double tps) {
    if (!r->tb.f) return;
    double n = iv->n;
    int rc = tmd_tb_scalar(&r->tb, "loss/train", step, iv->loss / n);
    rc |= tmd_tb_scalar(&r->tb, "loss/cross_entropy", step, iv->ce / n);
    rc |= tmd_tb_scalar(&r->tb, "moe/aux_loss", step, iv->aux / n);
    rc |= tmd_tb_scalar(&r->tb, "moe/z_loss", step, iv->z / n);
    rc |= tmd_tb_scalar(&r->tb, "optim/lr", step, lr);
    rc |= tmd_tb_scalar(&r->tb, "optim/grad_norm", step, iv->gnorm / n);
    rc |= tmd_tb_scalar(&r->tb, "perf/tokens_per_s", step, tps);
    rc |= tmd_tb_scalar(&r->tb, "perf/ms_per_step", step, 1e3 * iv->seconds / n);
    rc |= tmd_tb_scalar(&r->tb, "moe/max_load", step, iv->max_load / n);
    if (iv->dropped) rc |= tmd_tb_scalar(&r->tb, "moe/dropped", step, (double)iv->dropped);
    /* each MoE layer's max load (its busiest expert's tokens over the mean, per step), averaged
     * over the interval like max_load */
    for (int l = 0; r->iv_layer_load && l < r->n_moe; l++) {
        char tag[64];
        snprintf(tag, sizeof tag, "moe/max_load/layer_%02d", r->moe_layer[l]);
        rc |= tmd_tb_scalar(&r->tb, tag, step, r->iv_layer_load[l] / n);
    }
    tb_check(r, rc);
}

/* Returns -1 when the metrics file cannot be written. */
static int log_train(tmd_run *r, int64_t step, double lr, const interval *iv, double elapsed) {
    double n = iv->n, tps = (double)iv->n * r->c.grad_accum * r->B * r->T / iv->seconds;
    if (r->metrics) {
        tmd_json j;
        tmd_json_begin(&j);
        tmd_json_str(&j, "type", "train");
        tmd_json_int(&j, "step", step);
        tmd_json_num(&j, "loss", iv->loss / n);
        tmd_json_num(&j, "ce", iv->ce / n);
        tmd_json_num(&j, "aux", iv->aux / n);
        tmd_json_num(&j, "z", iv->z / n);
        tmd_json_num(&j, "lr", lr);
        tmd_json_num(&j, "grad_norm", iv->gnorm / n);
        tmd_json_num(&j, "ms_per_step", 1e3 * iv->seconds / n);
        tmd_json_num(&j, "tokens_per_s", tps);
        tmd_json_num(&j, "max_load", iv->max_load / n);
        tmd_json_int(&j, "dropped", iv->dropped);
        tmd_json_num(&j, "elapsed_s", r->elapsed0 + elapsed); /* a resumed run continues its clock */
        /* The host's time blocked on the device per step: ms_per_step minus this is the
         * host's own work; near 0 on a GPU, the step is bound by the host's launches. */
        if (r->dev.type == TM_DEVICE_CUDA) tmd_json_num(&j, "wait_ms", 1e3 * iv->wait_s / n);
        if (r->world > 1) {
            /* rank 0's collectives per step: all of them, and the gradient synchronisation */
            tmd_json_num(&j, "comm_bytes", iv->comm_bytes / n);
            tmd_json_num(&j, "comm_ms", 1e3 * iv->comm_s / n);
            tmd_json_num(&j, "grad_sync_bytes", iv->sync_bytes / n);
            tmd_json_num(&j, "grad_sync_ms", 1e3 * iv->sync_s / n);
        }
        if (tmd_jsonl_write(r->metrics, &j)) return -1;
        /* the interval's mean tokens per expert of every MoE layer, [layer][expert]: what
         * experts.svg draws, so that a resumed run redraws its whole history */
        if (r->iv_load) {
            fprintf(r->metrics, "{\"type\": \"experts\", \"step\": %lld, \"steps\": %d, \"load\": [", (long long)step,
                    iv->n);
            for (int i = 0; i < r->n_moe * r->E; i++) fprintf(r->metrics, "%s%.6g", i ? ", " : "", r->iv_load[i] / n);
            fprintf(r->metrics, "]}\n");
            if (fflush(r->metrics) || ferror(r->metrics)) return -1;
        }
    }
    tb_train(r, step, lr, iv, tps);
    if (r->iv_load) memset(r->iv_load, 0, sizeof *r->iv_load * (size_t)r->n_moe * (size_t)r->E);
    if (r->iv_layer_load) memset(r->iv_layer_load, 0, sizeof *r->iv_layer_load * (size_t)r->n_moe);
    if (!r->log) return 0;
    if (r->tty) tmd_progress_clear(r->log); /* the row goes above the bar, redrawn after it */
    fprintf(r->log, "%7lld %8.4f %8.4f %8.5f %8.5f %9.2e %7.3f %8.1f %9.0f %6.2f", (long long)step, iv->loss / n,
            iv->ce / n, iv->aux / n, iv->z / n, lr, iv->gnorm / n, 1e3 * iv->seconds / n, tps, iv->max_load / n);
    if (r->dev.type == TM_DEVICE_CUDA) fprintf(r->log, " %7.1f", 1e3 * iv->wait_s / n);
    if (r->world > 1) fprintf(r->log, " %9.3f %7.1f", iv->comm_bytes / n / 1e6, 1e3 * iv->comm_s / n);
    fprintf(r->log, "\n");
    tmd_run_log_flush(r);
    return 0;
}

/* The terminal's progress line: the means of the current log interval, redrawn at most every
 * 0.1 s (and at the last step). */
static void draw_progress(tmd_run *r, int64_t step, double lr, const interval *iv, double elapsed, double *last_draw) {
    double t = tmd_now_s();
    if (!r->tty || !r->log || iv->n == 0 || (t - *last_draw < 0.1 && step < r->c.sched.total_steps)) return;
    *last_draw = t;
    double n = iv->n;
    tmd_progress_fields p = {step, r->c.sched.total_steps, elapsed, iv->loss / n, lr,
                             (double)iv->n * r->c.grad_accum * r->B * r->T / iv->seconds, iv->max_load / n};
    tmd_progress(r->log, &p, tmd_term_cols(fileno(r->log)));
    tmd_run_log_flush(r);
}

static int log_eval(tmd_run *r, int64_t step, double val) {
    if (r->metrics) {
        tmd_json j;
        tmd_json_begin(&j);
        tmd_json_str(&j, "type", "eval");
        tmd_json_int(&j, "step", step);
        tmd_json_num(&j, "val_loss", val);
        if (r->synth) tmd_json_num(&j, "optimum", r->optimum);
        if (tmd_jsonl_write(r->metrics, &j)) return -1;
    }
    if (r->tb.f) tb_check(r, tmd_tb_scalar(&r->tb, "loss/validation", step, val));
    if (!r->log) return 0;
    if (r->tty) tmd_progress_clear(r->log);
    if (r->synth)
        fprintf(r->log, "step %lld: val loss %.4f (optimum %.4f, %+.1f%%)\n", (long long)step, val, r->optimum,
                100 * (val - r->optimum) / r->optimum);
    else fprintf(r->log, "step %lld: val loss %.4f\n", (long long)step, val);
    tmd_run_log_flush(r);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Sampling                                                                                  */

/* Continue the prompt for sample_tokens tokens with the KV cache (tmd_generate), printing the
 * bytes as they come. An empty prompt starts from the end-of-text token. */
static int sample(tmd_run *r, char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    int32_t *prompt = NULL;
    int n = 0, rc = tmd_prompt_tokens(r->bpe, c->sample_prompt, c->model.vocab_size, "key 'sample_prompt'", &prompt,
                                      &n, err, errlen);
    if (rc) return rc;
    FILE *f = r->log;
    fprintf(f, "\nsample (temperature %g, top_k %d, top_p %g):\n%s", c->temperature, c->top_k, c->top_p,
            c->sample_prompt);
    tmd_run_log_flush(r);
    tm_sampler_config sc = tm_sampler_config_default();
    sc.temperature = c->temperature;
    sc.top_k = c->top_k;
    sc.top_p = c->top_p;
    sc.seed = (uint64_t)c->seed;
    int eot = r->bpe ? tmd_bpe_eot(r->bpe) : TMD_BYTE_EOT;
    rc = r->log ? tmd_generate(r->ctx, r->model, prompt, n, c->sample_tokens, &sc, eot, r->bpe, f, NULL, err, errlen)
                : 0;
    free(prompt);
    if (!r->log) return 0;
    fprintf(f, "\n");
    tmd_run_log_flush(r);
    /* A reader that went away ends the sample, not the (finished) run. */
    return r->log ? rc : 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Training                                                                                  */

static int write_plots(tmd_run *r, char *err, size_t errlen) {
    if (!r->c.out[0] || r->rank != 0) return 0;
    char path[TMD_PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/loss.svg", r->c.out);
    if (tmd_plot_loss(path, &r->loss_bins, &r->val_bins, r->optimum, err, errlen)) return TMD_RUNTIME_ERROR;
    snprintf(path, sizeof path, "%s/experts.svg", r->c.out);
    if (r->n_moe == 0) {
        remove(path); /* an all-dense model: no heatmap, and none left from an earlier run */
        return 0;
    }
    return tmd_plot_experts(path, &r->load_bins, r->n_moe, r->E, r->moe_layer, err, errlen) ? TMD_RUNTIME_ERROR : 0;
}

/* A step skipped for a non-finite value (skip_nonfinite): a line and a metrics record. */
static int log_skip(tmd_run *r, int64_t step, const tmd_step *st) {
    if (r->metrics) {
        tmd_json j;
        tmd_json_begin(&j);
        tmd_json_str(&j, "type", "skip");
        tmd_json_int(&j, "step", step);
        tmd_json_num(&j, "loss", st->loss);
        tmd_json_num(&j, "grad_norm", st->gnorm);
        if (tmd_jsonl_write(r->metrics, &j)) return -1;
    }
    if (r->log) {
        if (r->tty) tmd_progress_clear(r->log);
        fprintf(r->log, "step %lld: skipped, no update: loss %g, gradient norm %g (%lld of skip_nonfinite %d)\n",
                (long long)step, st->loss, st->gnorm, (long long)r->skipped, r->c.skip_nonfinite);
        tmd_run_log_flush(r);
    }
    return 0;
}

/* A stop signal arrived (stop.h): save at step `done`, draw the plots, say what happened.
 * `during` names where the request was noticed ("" after a step). */
static int stop_run(tmd_run *r, tmd_train_result *res, int64_t done, const char *during, char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    int sig = tmd_stop_signal(), rc;
    if ((rc = tmd_rundir_save_checkpoint(r, done, err, errlen))) return rc;
    if ((rc = write_plots(r, err, errlen))) return rc;
    /* The process exits only with the checkpoint complete (a background write included). */
    if ((rc = tmd_rundir_save_wait(r, err, errlen))) return rc;
    tmd_rundir_prune(r);
    res->steps = done;
    res->stopped_by_signal = sig;
    /* Where the reader went away with the terminal (| tee ended by the same Ctrl-C), stderr
     * may still be there; a caller that gave no log wants silence. */
    FILE *f = r->log ? r->log : r->log_errno ? stderr : NULL;
    if (!f) return 128 + sig;
    if (r->log && r->tty) tmd_progress_clear(r->log);
    char ck[TMD_PATH_MAX + 32];
    tmd_ckpt_path(c->out, done, ck, sizeof ck);
    if (c->out[0])
        fprintf(f, "%s: stopped at step %lld%s; checkpoint %s; continue with 'tinymoe train --resume %s'\n",
                tmd_stop_name(sig), (long long)done, during, ck, c->out);
    else
        fprintf(f, "%s: stopped at step %lld%s; no checkpoint written (out is empty)\n", tmd_stop_name(sig),
                (long long)done, during);
    if (tmd_stop_count() > 1)
        fprintf(f,
                "(%d stop signals arrived: the second was absorbed so that the run could finish stopping; a third "
                "ends it at once)\n",
                tmd_stop_count());
    if (r->log) tmd_run_log_flush(r);
    else fflush(stderr);
    return 128 + sig;
}

/* The step table's header (rank 0): the columns log_train fills. */
static void print_table_header(tmd_run *r) {
    if (!r->log) return;
    fprintf(r->log, "%7s %8s %8s %8s %8s %9s %7s %8s %9s %6s", "step", "loss", "ce", "aux", "z", "lr", "gnorm",
            "ms/step", "tokens/s", "load");
    if (r->dev.type == TM_DEVICE_CUDA) fprintf(r->log, " %7s", "wait ms"); /* host blocked on the GPU */
    if (r->world > 1) fprintf(r->log, " %9s %7s", "comm MB", "comm ms"); /* rank 0's, per step */
    fprintf(r->log, "\n");
}

/* A finite step into the log interval's sums and the plots' bins (step from 0). */
static void interval_add(tmd_run *r, interval *iv, int64_t step, const tmd_step *st) {
    iv->loss += st->loss;
    iv->ce += st->ce;
    iv->aux += st->aux;
    iv->z += st->z;
    iv->max_load += st->max_load;
    iv->dropped += st->dropped;
    iv->gnorm += st->gnorm;
    iv->comm_bytes += st->comm_bytes;
    iv->comm_s += st->comm_s;
    iv->sync_bytes += st->sync_bytes;
    iv->sync_s += st->sync_s;
    iv->wait_s += st->wait_s;
    iv->n++;
    double loss = st->loss;
    tmd_bins_add(&r->loss_bins, step, &loss);
    if (r->step_load) {
        tmd_bins_add(&r->load_bins, step, r->step_load);
        for (int i = 0; i < r->n_moe * r->E; i++) r->iv_load[i] += r->step_load[i];
        for (int l = 0; l < r->n_moe; l++) {
            const double *ld = r->step_load + (size_t)l * r->E;
            double mx = 0, sum = 0;
            for (int e = 0; e < r->E; e++) sum += ld[e], mx = ld[e] > mx ? ld[e] : mx;
            r->iv_layer_load[l] += sum > 0 ? mx * r->E / sum : 0;
        }
    }
}

static int metrics_fail(tmd_run *r, char *err, size_t errlen) {
    return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot write '%s': %s", r->metrics_path, strerror(errno));
}

/* The validation after step `done` (1-based): its loss into *val, the plot and the log; > 128
 * when a stop signal came during it. */
static int evaluate_after(tmd_run *r, int64_t done, double *val, char *err, size_t errlen) {
    int rc = tmd_run_evaluate(r, val, err, errlen);
    if (rc) return rc;
    double v = *val;
    tmd_bins_add(&r->val_bins, done - 1, &v);
    return log_eval(r, done, *val) ? metrics_fail(r, err, errlen) : 0;
}

/* Megatron's --exit-interval: a run sliced into scheduler jobs (or replayed piecewise, as
 * tests/gpu/e2e.sh does) stops after step `done` with a checkpoint and continues with --resume. */
static int exit_at_interval(tmd_run *r, tmd_train_result *res, int64_t done, char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    int rc;
    if (!(c->save_every && done % c->save_every == 0) && (rc = tmd_rundir_save_checkpoint(r, done, err, errlen)))
        return rc;
    if ((rc = write_plots(r, err, errlen))) return rc;
    if ((rc = tmd_rundir_save_wait(r, err, errlen))) return rc;
    tmd_rundir_prune(r);
    if (r->log) {
        if (r->tty) tmd_progress_clear(r->log);
        fprintf(r->log, "stopped at step %lld (exit_interval %lld)%s%s%s\n", (long long)done,
                (long long)c->exit_interval, c->out[0] ? ": continue with 'tinymoe train --resume " : "", c->out,
                c->out[0] ? "'" : "");
        fflush(r->log);
    }
    res->steps = done;
    return 0;
}

/* The stop signal every rank acts on after this step: mpirun forwards a signal to each rank,
 * which may see it at different steps, so the ranks agree on the first step after which any
 * saw one. 0: none. In the same all-reduce, whether every rank's part of a background save is
 * written: the file is then committed now, at the same step on every rank (the writer threads
 * make no collective call). */
static int agreed_stop_signal(tmd_run *r, int *sig, char *err, size_t errlen) {
    *sig = tmd_stop_signal();
    if (r->world == 1) return 0;
    int64_t v[3] = {*sig != 0, *sig, tmd_rundir_part_written(r)};
    tm_status s = tm_comm_allreduce_host(r->ctx, TM_COMM_WORLD, TM_I64, v, 3);
    if (s) return tmd_run_lib_fail(r, err, errlen, "agreeing on a stop", s);
    *sig = v[0] ? (int)(v[1] / v[0]) : 0;
    if (v[2] == r->world) return tmd_rundir_save_wait(r, err, errlen);
    return 0;
}

/* After the last step: the end-of-run checkpoint complete, the plots, the summary, the sample. */
static int finish_run(tmd_run *r, tmd_train_result *res, int64_t start, double t_train, double first_loss, double val,
                      char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    int64_t steps = c->sched.total_steps;
    int rc;
    if ((rc = tmd_rundir_save_wait(r, err, errlen))) return rc;
    tmd_rundir_prune(r);
    if (r->tty && r->log) tmd_progress_clear(r->log);
    res->steps = steps;
    res->first_loss = first_loss;
    res->val_loss = val;
    res->train_seconds = t_train;
    res->tokens_per_s = (double)(steps - start) * c->grad_accum * r->B * r->T / t_train;
    if ((rc = write_plots(r, err, errlen))) return rc;
    if (r->log) {
        fprintf(r->log,
                "\ndone: %lld steps in %.1f s (%.0f tokens/s); train loss %.4f -> %.4f (ce %.4f); val loss %.4f\n",
                (long long)(steps - start), t_train, res->tokens_per_s, first_loss, res->last_loss, res->last_ce, val);
        if (r->skipped)
            fprintf(r->log, "skipped %lld step%s with a non-finite loss or gradient norm (skip_nonfinite %d)\n",
                    (long long)r->skipped, r->skipped > 1 ? "s" : "", c->skip_nonfinite);
        tm_memory_report mr; /* the model's device; the breakdown is the one at the peak */
        if (tm_ctx_memory_report(r->ctx, r->dev, &mr) == TM_OK) {
            const double mib = 1024.0 * 1024.0;
            fprintf(r->log, "memory (%s): peak %.1f MiB (parameters %.1f, gradients %.1f, optimizer %.1f, buffers %.1f, temporaries %.1f)\n",
                    r->dev.type == TM_DEVICE_CUDA ? "cuda:0" : "cpu", mr.total_peak / mib, mr.at_peak[TM_MEM_PARAMETERS] / mib, mr.at_peak[TM_MEM_GRADIENTS] / mib,
                    mr.at_peak[TM_MEM_OPTIMIZER] / mib, mr.at_peak[TM_MEM_BUFFERS] / mib, mr.at_peak[TM_MEM_TEMPORARIES] / mib);
            /* what the arena holds of the device beside what the step uses: with ragged shapes
             * (expert parallelism) the two differ; the process holds about the peak minus the
             * temporaries plus the reserved bytes */
            fprintf(r->log, "        temporaries: %.1f MiB in use at most, %.1f MiB reserved at most (%.2fx), %llu trim%s\n",
                    mr.peak[TM_MEM_TEMPORARIES] / mib, mr.reserved_peak / mib,
                    mr.peak[TM_MEM_TEMPORARIES] ? (double)mr.reserved_peak / (double)mr.peak[TM_MEM_TEMPORARIES] : 0.0,
                    (unsigned long long)mr.arena_trims, mr.arena_trims == 1 ? "" : "s");
        }
        tm_kernel_report kr; /* whether the run was on the fast paths (docs/cuda.md) */
        if (r->dev.type == TM_DEVICE_CUDA && tm_ctx_kernel_report(r->ctx, &kr) == TM_OK) {
            static const char *const gg[] = {"cublaslt", "device", "hopper"};
            char dxs[64] = ""; /* a path off by default: named only where it ran */
            if (kr.grouped_mlp_fused)
                snprintf(dxs, sizeof dxs, ", down dx + SwiGLU backward %llu", (unsigned long long)kr.grouped_mlp_fused);
            fprintf(r->log, "kernels (cuda:0): grouped GEMM %s; one-launch gate/up + SwiGLU %llu%s, Hopper attention %llu, "
                    "split router gating %llu\n", kr.grouped_gemm >= 0 && kr.grouped_gemm < 3 ? gg[kr.grouped_gemm] : "?",
                    (unsigned long long)kr.grouped_swiglu_fused, dxs, (unsigned long long)kr.attention_sm90,
                    (unsigned long long)kr.gating_split);
            if (kr.grouped_gemm_note[0])
                fprintf(r->log, "        the last grouped GEMM off the Hopper kernel: %s\n", kr.grouped_gemm_note);
        }
        if (r->synth)
            fprintf(r->log, "optimum %.4f: the val loss is %.4f nats/token (%.1f%%) above it\n", r->optimum,
                    val - r->optimum, 100 * (val - r->optimum) / r->optimum);
        if (c->out[0])
            fprintf(r->log, "wrote %s/metrics.jsonl, %s/loss.svg%s%s%s; checkpoint %s/ckpt-%08lld" TMD_CKPT_EXT "\n",
                    c->out, c->out, r->n_moe ? ", " : "", r->n_moe ? c->out : "", r->n_moe ? "/experts.svg" : "",
                    c->out, (long long)steps);
        tmd_run_log_flush(r);
    }
    /* Sampling runs on one process: its forwards would wait for the other ranks' collectives. */
    if (r->log && r->world == 1 && c->sample_prompt[0] && c->sample_tokens > 0 && (rc = sample(r, err, errlen)))
        return rc;
    /* The checkpoint is written; a stop request during the sample only cut the sample short. */
    if (tmd_stop_signal()) {
        FILE *f = r->log ? r->log : r->log_errno ? stderr : NULL;
        if (f) {
            fprintf(f, "%s: sample stopped; the run had finished (checkpoint written)\n",
                    tmd_stop_name(tmd_stop_signal()));
            fflush(f);
        }
        res->stopped_by_signal = tmd_stop_signal();
        return 128 + tmd_stop_signal();
    }
    return 0;
}

static int train_loop(tmd_run *r, tmd_train_result *res, char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    int64_t steps = c->sched.total_steps;
    if (tmd_bins_init(&r->loss_bins, 1, LOSS_BINS) || tmd_bins_init(&r->val_bins, 1, LOSS_BINS) ||
        (r->n_moe > 0 && tmd_bins_init(&r->load_bins, r->n_moe * r->E, LOAD_BINS)))
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory for the plots");
    int rc;
    int64_t start = r->resume_path[0] ? r->resume_state.step : 0;
    if ((rc = tmd_rundir_open_outputs(r, start, err, errlen))) return rc;
    if (start >= steps) {
        if (r->log)
            fprintf(r->log, "the checkpoint is at step %lld of %lld: nothing to train (raise steps to train longer)\n",
                    (long long)start, (long long)steps);
        tmd_run_log_flush(r);
        res->steps = start;
        return 0;
    }
    print_table_header(r);
    interval iv = {0};
    double t_train = 0, first_loss = NAN, val = NAN, last_draw = 0;
    for (int64_t step = start; step < steps; step++) {
        double lr = tm_lr_at(&c->sched, step), t0 = tmd_now_s();
        tmd_step st;
        if ((rc = tmd_run_step(r, step, lr, &st, err, errlen))) return rc;
        double dt = tmd_now_s() - t0;
        iv.seconds += dt;
        t_train += dt;
        int64_t done = step + 1;
        if (st.skipped) {
            if (log_skip(r, done, &st)) return metrics_fail(r, err, errlen);
        } else {
            tmd_rundir_prune(r); /* the weights of the last save gave a finite loss */
            if (isnan(first_loss)) first_loss = st.loss;
            interval_add(r, &iv, step, &st);
        }
        draw_progress(r, done, lr, &iv, t_train, &last_draw);
        /* An interval of skipped steps only has no means to record. */
        if ((done % c->log_every == 0 || done == steps) && iv.n > 0) {
            if (log_train(r, done, lr, &iv, t_train)) return metrics_fail(r, err, errlen);
            res->last_loss = iv.loss / iv.n;
            res->last_ce = iv.ce / iv.n;
            iv = (interval){0};
            last_draw = 0; /* the bar comes back under the new row at the next step */
        }
        if ((c->eval_every && done % c->eval_every == 0) || done == steps) {
            rc = evaluate_after(r, done, &val, err, errlen);
            if (rc > 128) return stop_run(r, res, done, " (during the evaluation after it)", err, errlen);
            if (rc) return rc;
        }
        if (((c->save_every && done % c->save_every == 0) || done == steps) &&
            (rc = tmd_rundir_save_checkpoint(r, done, err, errlen)))
            return rc;
        if (c->exit_interval && done % c->exit_interval == 0 && done < steps)
            return exit_at_interval(r, res, done, err, errlen);
        int sig;
        if ((rc = agreed_stop_signal(r, &sig, err, errlen))) return rc;
        if (sig) return stop_run(r, res, done, "", err, errlen);
    }
    return finish_run(r, res, start, t_train, first_loss, val, err, errlen);
}


int tmd_train(const tmd_config *cfg, FILE *log, tmd_train_result *res, char *err, size_t errlen) {
    tmd_train_result local;
    if (!res) res = &local;
    memset(res, 0, sizeof *res);
    res->val_loss = res->optimum = res->first_loss = NAN;
    tmd_run *r = calloc(1, sizeof *r);
    if (!r) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
    r->saved_step = -1;
    r->prune_pending = -1;
    r->prune_proven = -1;
    tmd_config c = *cfg;
    int rc = 0;
    if (cfg->resume[0] && cfg->init_from[0])
        rc = tmd_fail(
            err, errlen, TMD_CONFIG_ERROR,
            "keys 'resume' and 'init_from' exclude each other (resume restores the weights from the checkpoint)");
    if (!rc && cfg->resume[0]) rc = tmd_run_resume_config(r, cfg, &c, 0, cfg->resume, err, errlen);
    if (!rc && cfg->init_from[0]) rc = tmd_run_init_from_config(cfg, &c, err, errlen);
    if (!rc) rc = tmd_rundir_claim(r, &c, err, errlen);
    if (!rc) rc = tmd_run_setup(r, &c, log, 0, err, errlen);
    if (!rc) {
        res->params = r->params;
        res->active_params = r->active;
        res->optimum = r->synth ? r->optimum : NAN;
        /* From the first line printed: a closed pipe must not kill the run (SIGPIPE). */
        tmd_stop_saved old;
        tmd_stop_catch(&old);
        tmd_run_print_header(r, 0);
        if (c.print_layout) rc = tmd_layout_print(r->ctx, r->dev, r->E, r->log, c.out, err, errlen);
        if (!rc && r->resume_path[0] && r->log) {
            fprintf(r->log, "resuming from %s at step %lld", r->resume_path, (long long)r->resume_state.step);
            if (r->resume_ck_steps != c.sched.total_steps)
                fprintf(r->log, "; steps %lld -> %lld%s", (long long)r->resume_ck_steps, (long long)c.sched.total_steps,
                        c.sched.kind == TM_LR_CONSTANT ? "" : " (the learning-rate schedule now spans the new total)");
            fprintf(r->log, "\n\n");
            tmd_run_log_flush(r);
        }
        if (!rc) rc = train_loop(r, res, err, errlen);
        if (!rc && c.print_layout) rc = tmd_layout_print_peaks(r->ctx, r->dev, &r->last_comm, r->log, err, errlen);
        /* A background write still running after an error ends before the run does. */
        rc = tmd_rundir_finish(r, rc, err, errlen);
        tmd_stop_restore(&old);
        if (rc && r->log && r->tty) tmd_progress_clear(r->log);
    }
    res->rank = r->rank;
    res->world = r->world;
    res->uniform_error = rc && r->uniform_error;
    tmd_run_free(r);
    free(r);
    return rc;
}
