/*
 * layout.h — seeing and planning parallel layouts (driver code; the public header only).
 *
 * tmd_layout_print: collective over the context's world; rank 0 prints, per rank, its ep and
 * expert-dp ranks, the experts it holds and the bytes of its parameters, gradients and
 * optimizer state (tm_ctx_memory_report of `dev`), and writes <out_dir>/layout.svg (ranks x
 * dense parameters and experts held, with the ZeRO-1 blocks). Returns 0 or TMD_RUNTIME_ERROR.
 *
 * tmd_plan_compute: the same figures for one rank of a layout, and the bytes its collectives
 * move per optimizer step, from the configuration alone at any scale: the library lays the rank
 * out in a plan-only context (nothing is allocated; tinymoe.h, tm_ctx_options.plan_only and
 * tm_model_plan_step), so the driver keeps no copy of its formulas. tests/test_dist.c checks
 * them against what --print-layout and metrics.jsonl measure on a real run.
 */
#ifndef TMD_LAYOUT_H
#define TMD_LAYOUT_H

#include <stdint.h>
#include <stdio.h>

#include "config.h"
#include "tinymoe.h"

int tmd_layout_print(tm_ctx *ctx, tm_device dev, int num_experts, FILE *log, const char *out_dir, char *err,
                     size_t errlen);

/* After the run (collective): rank 0 prints each rank's peak parameter, gradient and optimizer
 * bytes and the transient gradient bytes (peak less current). Returns 0 or TMD_RUNTIME_ERROR. */
int tmd_layout_print_peaks(tm_ctx *ctx, tm_device dev, const tm_comm_stats *last, FILE *log, char *err,
                           size_t errlen);

typedef struct tmd_plan {
    int64_t params, gradients, optimizer; /* bytes held by the rank */
    int64_t grad_sync;                    /* bytes handed to the gradient collectives per step (an
                                           * all-reduce; ZeRO-1 and 2: a reduce-scatter) */
    int64_t param_gather;                 /* ZeRO-1 and 2: bytes of the parameter all-gather per step */
    int64_t dispatch;                     /* MoE dispatch bytes per step (balanced routing) */
    int64_t transient;                    /* ZeRO-2: bytes of the full gradient buffer, held from a
                                           * step's first backward to its gradient sync; ZeRO-3:
                                           * the most all-gathered weight bytes held at once */
    int64_t bwd_reduce;                   /* ZeRO-3: bytes of the backward's reduce of the
                                           * gathered weights' gradients into the shards */
    int64_t experts_lo, experts_hi;       /* the routed experts held; -1, -1: no MoE layer */
    int zero;                             /* the ZeRO stage planned for */
} tmd_plan;

/* Rank `rank` of `ranks` under c's layout keys (ep_size, ep_strategy, zero) and optimizer: c
 * resolved and valid, ranks divisible by ep_size and dividing batch_size, rank in [0, ranks).
 * Returns 0, or TMD_RUNTIME_ERROR with the library's message in err. */
int tmd_plan_compute(const tmd_config *c, int ranks, int rank, tmd_plan *out, char *err, size_t errlen);

/* `tinymoe plan --ranks N [--config FILE] [--key value ...]` (ep_size, ep_strategy and zero are
 * keys): returns the exit status. */
int tmd_plan_main(int argc, char **argv);

#endif
