/*
 * finite.h — finding NaN and infinite values in a model's parameters or their gradients.
 *
 * The guard that keeps a diverged run from passing for progress: a checkpoint is not written
 * while a weight is non-finite, a checkpoint or an export whose weights are not finite is
 * refused by eval, resume, sample, export and init_from, and when a step's loss or gradient
 * norm is non-finite the message names the first tensor that went bad. Every call reads every
 * parameter (to the host): it is for saves, loads and failures, not for every step.
 */
#ifndef TMD_FINITE_H
#define TMD_FINITE_H

#include <stddef.h>
#include <stdint.h>

#include "tinymoe.h"

typedef struct tmd_nonfinite {
    const char *name; /* the parameter (its gradient, with grads) */
    int64_t index;    /* the first bad element */
    double value;     /* NaN or +-inf */
} tmd_nonfinite;

/* The first parameter of ctx, in creation order, whose values (grads = 0) or gradients
 * (grads = 1) hold a NaN or an infinity: 1 with *bad filled, 0 when all are finite, -1 when a
 * read failed (message in err). */
int tmd_find_nonfinite(tm_ctx *ctx, int grads, tmd_nonfinite *bad, char *err, size_t errlen);

/* "'layers.0.attn.wq' holds nan at element 17" into buf. */
void tmd_nonfinite_describe(const tmd_nonfinite *bad, char *buf, size_t len);

/* The weights of ctx must be finite: 0, or TMD_CONFIG_ERROR "<what> holds a non-finite weight:
 * ...", naming the tensor (what: "checkpoint 'x'", "the export in 'dir'"). */
int tmd_require_finite_weights(tm_ctx *ctx, const char *what, char *err, size_t errlen);

#endif
