/*
 * moe_stats.c — CPU kernel of tm_moe_accumulate_counts.
 *
 *   in[0]  sum     (E) i64, contiguous, updated in place: sum[e] += counts[e]
 *   in[1]  counts  (E) i64
 *   no outputs, never on the tape (TM__OP_NONDIFF)
 */
#include "internal.h"

tm_status tm__moe_accumulate_counts_forward_cpu(tm__call *c) {
    int64_t *sum = tm__data(c->in[0]);
    const int64_t *counts = tm__data(c->in[1]);
    const int64_t E = c->in[0]->shape[0];
    for (int64_t e = 0; e < E; e++) sum[e] += counts[e];
    return TM_OK;
}
