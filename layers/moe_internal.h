/*
 * moe_internal.h — private to layers/: what layers/model.c needs of the MoE block (layers/moe.c)
 * beyond the public contract (include/tinymoe.h, "Mixture of Experts: the block").
 */
#ifndef TM_MOE_INTERNAL_H
#define TM_MOE_INTERNAL_H

#include <string.h>

#include "extend.h"

/* Slots of tm_moe_stats.packed after the E counts: i64 [E + TM__MOE_STAT_SLOTS]. */
enum { TM__MOE_STAT_DROPPED = 0, TM__MOE_STAT_AUX, TM__MOE_STAT_SEQ_AUX, TM__MOE_STAT_Z, TM__MOE_STAT_SLOTS };

/* Where this rank's rows sit in the global batch under data parallelism (G ranks of the dp
 * group): rows [off, off + T) of Tg. */
typedef struct tm__dp_rows {
    int G;
    int64_t T, off, Tg;
} tm__dp_rows;
/* The row map of this rank's T rows: one small host all-gather of the ranks' row counts (none
 * without data parallelism). Every rank of the dp group calls it. */
tm_status tm__dp_rows_of(tm_ctx *ctx, int64_t T, tm__dp_rows *out);

/* The block's weights in the order its forward gathers them under ZeRO-3 (gate, routed
 * experts' w0, w1, wo, shared expert's): up to 7 into out, their number returned (model.c
 * prefetches the next layer's). */
int tm__moe_weights(const tm_moe *m, tm_tensor **out);
/* Bytes of the block's expert-parallel dispatch and combine, forward and backward, for `tokens`
 * rows of a micro-batch under balanced routing (tm_model_plan_step); 0 with ep_size 1. */
double tm__moe_plan_dispatch(const tm_moe *m, int64_t tokens);
/* tm_moe_forward with the running count's update chosen by the caller: accumulate = 0 leaves
 * tokens_per_expert_sum alone (tm_model_forward adds the counts itself, once the step's ids are
 * known to be valid, with tm__moe_accumulate). dp: the row map of x's rows when the caller has
 * it (tm_model_forward makes one per forward for all its layers); NULL: the block makes it. */
tm_status tm__moe_forward(tm_moe *m, tm_tensor *x, int64_t num_seqs, tm_tensor **y, tm_moe_stats *stats,
                          int accumulate, const tm__dp_rows *dp);
/* tokens_per_expert_sum += counts (i64 [E]) on the device (tm_moe_accumulate_counts). */
tm_status tm__moe_accumulate(tm_moe *m, tm_tensor *counts);
/* Statistics travel to the host packed into i64 tensors, one 8-byte slot per value: copy the
 * bytes of t (contiguous, elements of at most 8 bytes; NULL: nothing) into packed from slot
 * `slot` on, device to device (no kernel, no read). A float lands in its slot's first bytes. */
tm_status tm__stat_put(tm_ctx *ctx, tm_tensor *packed, int64_t slot, const tm_tensor *t);
/* The float of dtype dt (f32 or f64) held in a slot read back. */
double tm__stat_value(const int64_t *slot, tm_dtype dt);
/* Fill the host fields of *st (dropped_tokens, load ratios, loss values) from the E +
 * TM__MOE_STAT_SLOTS slots of a packed tensor already read back. */
void tm__moe_stats_decode(const tm_moe *m, const int64_t *slots, tm_moe_stats *st);

#endif
