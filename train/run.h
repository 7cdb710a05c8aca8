/*
 * run.h — the state of one `tinymoe train` or `tinymoe eval` run, shared by the files that make
 * up those commands, each calling only those below it: train.c (the training loop) calls step.c
 * (one optimizer step), eval.c (the validation loss, `tinymoe eval`) and rundir.c (the run
 * directory); all four call run.c (the setup of a run, its forward pass, header, errors and
 * end), which calls none of them. Not used elsewhere.
 */
#ifndef TMD_RUN_H
#define TMD_RUN_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "bpe.h"
#include "checkpoint.h"
#include "config.h"
#include "data.h"
#include "lock.h"
#include "markov.h"
#include "plot.h"
#include "tensorboard.h"
#include "tinymoe.h"

/* The background write of an asynchronous save (async_save; rundir.c). The writer thread
 * touches only this struct's snap, path, threads (read) and status, msg, write_s, done
 * (written); the loop's thread reads those only after `done` is set or the thread is joined. */
typedef struct tmd_bgsave {
    pthread_t thread;
    int active;       /* a writer thread was started and not joined yet */
    atomic_int done;  /* the writer has finished (joining it will not block) */
    tm_ckpt_snapshot *snap;
    char path[TMD_PATH_MAX + 32];
    int64_t step;     /* the step the snapshot holds */
    int threads;      /* tm_ckpt_snapshot_write's num_threads */
    tm_status status; /* of the write */
    char msg[TMD_PATH_MAX + 1024];
    int failed;       /* a joined write failed and has not been reported yet */
    double stall_s, write_s; /* the snapshot's stall of training; the background write */
    double wait_s;           /* the save's wait for the previous write, before the snapshot */
    int pending;             /* under mpirun: taken and not committed yet (the same on every rank) */
    double commit_s;         /* under mpirun: the commit's stall (index, fsync, rename on rank 0) */
} tmd_bgsave;

typedef struct tmd_run {
    tmd_config c;
    int T, B, synth;
    FILE *log; /* NULL once a write to it failed (a closed pipe): the run goes on, silently */
    int tty;
    int threads; /* CPU threads of the context */
    int log_errno; /* why the log was dropped (0: it was not) */
    /* data */
    tmd_markov src;
    double optimum;
    tmd_tokens train, val;
    tmd_bpe *bpe; /* key 'tokenizer' (NULL: bytes); training runs only, eval reads token files alone */
    char tokenizer_path[TMD_PATH_MAX + 32]; /* the file bpe was read from */
    tmd_data_id data_id; /* what the run trains on, recorded in its checkpoints (checkpoint.h) */
    tmd_batcher bt;
    int64_t n_eval;           /* validation windows */
    int32_t *inp, *tgt, *seq; /* [B*T], [B*T] (one block: tgt = inp + B*T), [T+1] */
    /* model */
    tm_ctx *ctx;
    tm_device dev;
    tm_model *model;
    tm_optimizer *opt;
    int64_t params, active;
    int n_moe, E, *moe_layer;
    /* records */
    tmd_bins loss_bins, val_bins, load_bins;
    double *step_load; /* [n_moe * E] tokens per expert of the current step */
    tm_comm_stats last_comm; /* the collectives of the last training step, by kind (--print-layout) */
    double *iv_load;   /* [n_moe * E] their sum over the current log interval (metrics "experts") */
    double *iv_layer_load; /* [n_moe] sum over the interval of each step's max / mean tokens per expert */
    double elapsed0;   /* training seconds before this process (a resumed run's, from metrics.jsonl) */
    FILE *metrics;
    tmd_tb tb; /* key tensorboard: rank 0's event file (tb.f NULL: none) */
    char metrics_path[TMD_PATH_MAX + 32];
    /* checkpoints */
    char resume_path[TMD_PATH_MAX]; /* the checkpoint resumed from ("" for a fresh run) */
    tmd_ckpt_state resume_state;
    int64_t resume_ck_steps; /* the checkpoint's own `steps` (a resumed run may change it) */
    int64_t saved_step; /* step of the newest checkpoint written by this run (-1: none) */
    int64_t prune_pending; /* a save whose pruning waits for the next finite loss (-1: none) */
    int64_t prune_proven;  /* a save whose weights gave a finite loss, pruning once its file is complete (-1) */
    tm_ckpt_snapshot *snap; /* async_save: host memory for the state, allocated at the first save */
    tmd_bgsave bg;          /* async_save: the write in flight */
    int64_t skipped;    /* steps skipped for a non-finite loss or gradient norm (skip_nonfinite) */
    tmd_lock lock;      /* out's lock, held from the first write to the end of the run */
    int eval_split;     /* eval: validate on the val_fraction tail of data, as training did */
    /* distributed: this process's world rank and the world size; each micro-batch of B rows
     * is split into world slices of Bl rows, this rank's starting at row b0 */
    int rank, world, Bl, b0;
    int uniform_error; /* the failure happened where every rank fails alike (config checks) */
} tmd_run;

/* ---- run.c ------------------------------------------------------------------------------ */

/* A library call failed: TMD_RUNTIME_ERROR with the context's message, prefixed by `what`. */
int tmd_run_lib_fail(tmd_run *r, char *err, size_t errlen, const char *what, tm_status s);
/* Flush r->log after printing; when that fails (EPIPE: the reader is gone, or any other
 * error) stop printing for the rest of the run rather than fail it. */
void tmd_run_log_flush(tmd_run *r);
/* Free what the run holds (not r itself). */
void tmd_run_free(tmd_run *r);
/* The communicator options of the layout keys (ep_size, ep_strategy, zero, comm_timeout, nccl,
 * comm_overlap): what a run attaches, and what `tinymoe plan` lays out. */
tm_comm_options tmd_comm_options_of(const tmd_config *c);
/* Resolve and validate cfg, load and check the data, build the model (and, unless eval_only,
 * the optimizer), apply init_from, and load r->resume_path when set. Nothing is written. */
int tmd_run_setup(tmd_run *r, const tmd_config *cfg, FILE *log, int eval_only, char *err, size_t errlen);
/* The model's forward pass over r->inp (and r->tgt with with_targets) for `rows` rows. */
tm_status tmd_run_forward(tmd_run *r, int rows, int with_targets, tm_model_out *out);
/* The resolved config, the parameter counts and a data summary, to r->log. */
void tmd_run_print_header(tmd_run *r, int eval_only);
/* The configuration of a run resumed from (or, for_eval, evaluating) checkpoint `ckpt`: the
 * checkpoint's, plus what the command line cli may change; sets r->resume_path and
 * r->resume_state. */
int tmd_run_resume_config(tmd_run *r, const tmd_config *cli, tmd_config *out, int for_eval, const char *ckpt,
                          char *err, size_t errlen);
/* cli with the architecture keys of cli->init_from's config.json. */
int tmd_run_init_from_config(const tmd_config *cli, tmd_config *out, char *err, size_t errlen);

/* ---- step.c ----------------------------------------------------------------------------- */

/* What one optimizer step saw: the means over its micro-batches, and whether it was skipped. */
typedef struct tmd_step {
    double loss, ce, aux, z, max_load; /* training loss (ce + layer losses) and its parts */
    double gnorm;                      /* global gradient norm before clipping */
    int64_t dropped;                   /* tokens dropped by expert capacity */
    /* distributed: this rank's collectives in the step (tm_comm_get_stats), all of them and the
     * gradient synchronisation's part; bytes sent by this rank, seconds waited */
    double comm_bytes, comm_s, sync_bytes, sync_s;
    /* seconds the host spent blocked on the device (tm_ctx_sync_seconds over the step) */
    double wait_s;
    int skipped; /* a non-finite loss or gradient norm, within skip_nonfinite: no update made */
} tmd_step;

/* One optimizer step `step` (from 0) at learning rate lr: grad_accum micro-batches (r->step_load
 * gets the tokens per expert), then, unless the loss or the gradient norm is non-finite, the
 * clip, the update and the expert-bias update. A non-finite step is skipped (out->skipped)
 * while r->skipped < skip_nonfinite, else TMD_RUNTIME_ERROR names the step and the first bad
 * tensor; either way no update is made. */
int tmd_run_step(tmd_run *r, int64_t step, double lr, tmd_step *out, char *err, size_t errlen);

/* ---- eval.c ----------------------------------------------------------------------------- */

/* Mean cross-entropy over the run's validation windows, with grad mode off. Checks for a stop
 * request (stop.h) between batches: then returns 128 + the signal, *loss NaN. */
int tmd_run_evaluate(tmd_run *r, double *loss, char *err, size_t errlen);

#endif
