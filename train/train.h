/*
 * train.h — `tinymoe train` and `tinymoe eval` as functions (the command line is main.c), so
 * the training loop can be tested.
 *
 * tmd_train: validate the config, claim the out directory (not a file; locked against another
 * run, lock.h), load and check the data, build the model and the optimizer (any problem up to
 * here: status 2 and nothing written but the lock file); print the resolved config, the
 * parameter counts and a data summary; train (per step: grad_accum micro-batches, clip, the
 * scheduled learning rate, the optimizer step, the expert-bias update); validate every
 * eval_every steps and at the end; log every log_every steps (a progress bar when `log` is a
 * terminal, plain lines otherwise) and append the same records to <out>/metrics.jsonl; at the
 * end draw <out>/loss.svg and <out>/experts.svg and, with sample_prompt, print a sample.
 */
#ifndef TMD_TRAIN_H
#define TMD_TRAIN_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "config.h"
#include "status.h"

typedef struct tmd_train_result {
    int64_t steps;
    int64_t params, active_params; /* total, and active per token */
    double first_loss;             /* training loss (ce + layer losses) of the first step */
    double last_loss;              /* mean training loss over the last logged interval */
    double last_ce;                /* its cross-entropy part */
    double val_loss;               /* final validation cross-entropy (NaN: none) */
    double optimum;                /* synthetic data: the source's optimal loss (NaN otherwise) */
    double train_seconds;          /* wall time of the training steps (evaluations excluded) */
    double tokens_per_s;           /* training tokens per second over the run */
    int stopped_by_signal;         /* SIGINT / SIGTERM that ended the run early (0: none) */
    int rank, world;               /* distributed runs: this rank and the world size */
    int uniform_error;             /* a failure every rank hit alike (configuration checks), so
                                    * one rank reports it and no rank needs to abort the job */
} tmd_train_result;

/* log: where the summary and progress go (stdout in the driver; a write to it that fails, a
 * closed pipe, only stops the printing); res may be NULL. On failure err holds the message
 * (without the "tinymoe: " prefix). A step whose loss or gradient norm is not finite ends the
 * run with TMD_RUNTIME_ERROR before its update (after skip_nonfinite skips), and no checkpoint
 * with a non-finite weight is ever written (step.c, rundir.h).
 * Checkpoints (with out set): <out>/ckpt-<step>.tmck every save_every steps, at the end, and
 * when SIGINT or SIGTERM arrives (caught for the duration of the call, stop.h: the loop stops
 * after the current step, evaluation batch or sampled token, saves, and returns 128 + the
 * signal number); the newest keep_last are kept. With cfg->resume the run continues from that checkpoint (file, or the newest in a
 * directory): its config is the checkpoint's, the keys cfg set explicitly must agree with it
 * except run settings (tmd_config_key_resumable), and on the CPU the result is bit-identical
 * to a run that was never interrupted. */
int tmd_train(const tmd_config *cfg, FILE *log, tmd_train_result *res, char *err, size_t errlen);

/* `tinymoe eval`: mean cross-entropy (and perplexity, printed) of the model that cfg and its
 * seed define, freshly initialised, on val_data if given, else on the whole of data. */
int tmd_eval(const tmd_config *cfg, FILE *log, double *loss, char *err, size_t errlen);
/* The same for the model of checkpoint `ckpt` (file or directory): its config, with data,
 * val_data, eval_batches, batch_size and run settings taken from cfg where cfg sets them
 * explicitly; giving data without val_data evaluates all of data. */
int tmd_eval_ckpt(const tmd_config *cfg, const char *ckpt, FILE *log, double *loss, char *err, size_t errlen);

/* What `tinymoe eval` prints on `log`: the run's header then the result (TEXT), the result line
 * alone (QUIET, --quiet), or one JSON object on one line (JSON, --json: loss, perplexity,
 * tokens, seconds, model, step, and optimum for the synthetic source). */
enum { TMD_EVAL_TEXT = 0, TMD_EVAL_QUIET = 1, TMD_EVAL_JSON = 2 };
/* tmd_eval (ckpt NULL) or tmd_eval_ckpt, printing in `format`. */
int tmd_eval_format(const tmd_config *cfg, const char *ckpt, int format, FILE *log, double *loss, char *err,
                    size_t errlen);

#endif
