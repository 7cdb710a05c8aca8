/*
 * optimizer.h — what the optimizers of optim/ share (private to the library).
 *
 * A tm_optimizer is one object whatever the algorithm, so that tm_optimizer_step / _steps /
 * _free serve all of them: the generic part (optimizer.c) owns the parameter list, the
 * per-parameter f32 state buffers, the argument checks of a step and the step counter; each
 * algorithm (adamw.c, sgd.c) validates its config and applies its update to one parameter.
 */
#ifndef TM_OPTIM_OPTIMIZER_H
#define TM_OPTIM_OPTIMIZER_H

#include "ctx_internal.h"

enum { TM__OPT_MAX_STATE = 2 }; /* state buffers per parameter: AdamW m, v */

typedef enum tm__opt_kind { TM__OPT_ADAMW = 0, TM__OPT_SGD = 1 } tm__opt_kind;

struct tm_optimizer {
    tm_ctx *ctx;
    tm__opt_kind kind;
    const char *name; /* "AdamW", "SGD": for messages */
    union {
        tm_adamw_config adamw;
        tm_sgd_config sgd;
    } cfg;
    double lr;      /* the configured lr: tm_optimizer_step's lr < 0 means this one */
    tm_tensor *counter; /* i64 0-d host buffer: updates taken (saved with the context) */
    int n;          /* parameters covered */
    int n_state;    /* state buffers per parameter, <= TM__OPT_MAX_STATE */
    tm_tensor **param;                   /* [n] */
    tm_tensor **state[TM__OPT_MAX_STATE]; /* [n] each: f32, same shape and device as param[i] */
};

/* Make an optimizer over every parameter of the context, with n_state f32 state buffers per
 * parameter named "<param><suffix[j]>" (zero-filled) and an i64 host buffer `counter` for the
 * step count. fn names the caller in messages.
 * Errors: TM_ERR_STATE (no parameters; a state buffer of that name exists already),
 * TM_ERR_INVALID_ARG (a state name over 127 bytes), TM_ERR_NOMEM. Every name is checked
 * before any buffer is made. On success the caller fills kind, name, cfg and lr. */
tm_status tm__optimizer_create(tm_ctx *ctx, const char *fn, int n_state, const char *const *suffix,
                               const char *counter, tm_optimizer **out);

/* The per-algorithm update of parameter i at step t (1-based) with learning rate lr. Called
 * by tm_optimizer_step after it has checked that every parameter is a float CPU tensor. */
void tm__adamw_update(const tm_optimizer *opt, int i, double lr, int64_t t);
void tm__sgd_update(const tm_optimizer *opt, int i, double lr, int64_t t);

#endif
