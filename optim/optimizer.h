/*
 * optimizer.h — what the optimizers of optim/ share (private to the library; optim/ uses only
 * the public tinymoe.h and framework/extend.h).
 *
 * A tm_optimizer is one object whatever the algorithm. It covers the parameters the context
 * holds when it is made, bucket by bucket: per bucket its flat f32 state buffers (one per
 * moment, the bucket's layout, tm__state_alloc), named per parameter ("<param>.adamw_m", ...)
 * so checkpoints keep per-parameter tensors, the f32 master weights of bf16 buckets, and the
 * runs of the bucket that share a weight-decay setting. An SGD step is one update op per run;
 * an AdamW step one adamw_update_multi per device over every run of its buckets.
 * Under ZeRO-1 (tm_comm_options.zero) a rank keeps the state of its block [lo, hi) of each
 * bucket only, updates the runs' parts inside it, and all-gathers the parameters afterwards;
 * the per-parameter names are then views of state split over the ranks (framework/shard.c),
 * gathered by checkpoints.
 */
#ifndef TM_OPTIM_OPTIMIZER_H
#define TM_OPTIM_OPTIMIZER_H

#include "extend.h"

enum { TM__OPT_MAX_STATE = 2 }; /* state buffers per parameter: AdamW m, v */

typedef enum tm__opt_kind { TM__OPT_ADAMW = 0, TM__OPT_SGD = 1 } tm__opt_kind;

/* [lo, hi) of a bucket (padding included) whose parameters all decay or all do not. */
typedef struct tm__opt_run {
    int64_t lo, hi;
    int decay; /* parameters of 2 or more dims */
} tm__opt_run;

typedef struct tm__opt_bucket {
    int bucket;                          /* tm_ctx_bucket_info index */
    int64_t numel;                       /* elements covered (the bucket's size when made) */
    int64_t lo, hi;                      /* the range this rank updates: [0, numel), or its ZeRO-1
                                          * block (tm_ctx_grad_shard) */
    tm_tensor *state[TM__OPT_MAX_STATE]; /* flat f32 [hi - lo]: element i is bucket element lo + i */
    int n_runs;
    tm__opt_run *runs;
} tm__opt_bucket;

struct tm_optimizer {
    tm_ctx *ctx;
    tm__opt_kind kind;
    const char *name; /* "AdamW", "SGD": for messages */
    const char *op;   /* its update op: "adamw_update_multi", "sgd_update" */
    union {
        tm_adamw_config adamw;
        tm_sgd_config sgd;
    } cfg;
    double lr;          /* the configured lr: tm_optimizer_step's lr < 0 means this one */
    tm_tensor *counter; /* i64 0-d host buffer: updates taken (saved with the context) */
    int n_state;        /* state buffers per parameter, <= TM__OPT_MAX_STATE */
    int n_buckets;
    tm__opt_bucket *b;
    /* AdamW: the ranges of every bucket of the CPU (0) and of the CUDA device (1), updated by
     * one adamw_update_multi each (made on the first step) */
    tm__segs *segs[2];
};

/* Make an optimizer over every parameter of the context: n_state flat f32 state buffers per
 * bucket, named per parameter "<param><suffix[j]>" (zero-filled), master weights for bf16
 * buckets (named "<param>.master"), and an i64 host buffer `counter` for the step count.
 * fn names the caller in messages. Errors: TM_ERR_STATE (no parameters; a state buffer of
 * that name exists already), TM_ERR_INVALID_ARG (a state name over 127 bytes), TM_ERR_NOMEM,
 * TM_ERR_CUDA. Every name is checked before any buffer is made. On success the caller fills
 * kind, name, op, cfg and lr. */
tm_status tm__optimizer_create(tm_ctx *ctx, const char *fn, int n_state, const char *const *suffix,
                               const char *counter, tm_optimizer **out);

/* SGD's update of one run with learning rate lr at step t (1-based): p, g, state, master are
 * the run's slices (master NULL when the bucket has none). AdamW updates every run of a device
 * in one op (optimizer.c, adamw_step). */
tm_status tm__sgd_run(const tm_optimizer *opt, tm_tensor *p, tm_tensor *g, tm_tensor **state, tm_tensor *master,
                      int decay, double lr, int64_t t);

#endif
