/*
 * train.h — `tinymoe train` and `tinymoe eval` as functions (the command line is main.c), so
 * the training loop can be tested.
 *
 * tmd_train: validate the config, load and check the data, build the model and the optimizer
 * (any problem up to here: status 2 and nothing written); print the resolved config, the
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

/* Return values, also the process exit status. */
enum { TMD_OK = 0, TMD_RUNTIME_ERROR = 1, TMD_CONFIG_ERROR = 2 };

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
} tmd_train_result;

/* log: where the summary and progress go (stdout in the driver); res may be NULL. On failure
 * err holds the message (without the "tinymoe: " prefix). */
int tmd_train(const tmd_config *cfg, FILE *log, tmd_train_result *res, char *err, size_t errlen);

/* `tinymoe eval`: the validation loss of the model that cfg and its seed define (freshly
 * initialised until checkpoints exist) on val_data if given, else on the whole of data. */
int tmd_eval(const tmd_config *cfg, FILE *log, double *loss, char *err, size_t errlen);

#endif
