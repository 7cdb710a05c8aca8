/*
 * clip.c — tm_ctx_clip_grad_norm: global L2 norm of all parameter gradients, and rescaling
 * when it exceeds max_norm (the rule of torch.nn.utils.clip_grad_norm_: scale by
 * max_norm / (norm + 1e-6), so a norm just above max_norm lands just below it).
 *
 * One grad_sumsq op per bucket over its whole gradient buffer (padding is zero: it adds
 * nothing), the partial sums added on the host in bucket order, then one grad_scale op per
 * bucket. Each partial is a fixed-order f64 sum (kernels/cpu/update.c), so the norm is bitwise
 * independent of the thread count. On a device, reading the partials is one synchronisation
 * per bucket.
 */
#include <math.h>

#include "extend.h"

tm_status tm_ctx_clip_grad_norm(tm_ctx *ctx, double max_norm, double *norm_out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (isnan(max_norm)) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_ctx_clip_grad_norm: max_norm is NaN");
    int nb = tm_ctx_num_buckets(ctx);
    /* Refuse before touching anything. */
    for (int k = 0; k < nb; k++) {
        tm_bucket_info bi;
        TM__TRY(tm_ctx_bucket_info(ctx, k, &bi));
        if (!tm__op_available(ctx, "grad_sumsq", bi.device) || !tm__op_available(ctx, "grad_scale", bi.device))
            return tm__err(ctx, TM_ERR_UNSUPPORTED,
                           "tm_ctx_clip_grad_norm: no grad_sumsq / grad_scale kernel on %s yet (bucket %d: %s "
                           "gradients of parameters such as \"%s\"); nothing was changed",
                           bi.device.type == TM_DEVICE_CUDA ? "CUDA" : "the CPU", k, tm_dtype_name(bi.dtype),
                           tm__bucket_first_param(ctx, k));
    }
    /* Under a communicator each rank measures what it holds (tm_ctx_grad_shard: its ZeRO-1 range,
     * or the whole bucket), and a bucket replicated over its group is counted by one replica
     * (group rank 0); the per-bucket partial sums are then added over the world and summed in
     * bucket order, the same order on every rank. */
    int world = tm_comm_size(ctx, TM_COMM_WORLD) > 1;
    /* (no system allocation in a steady-state step: the stack for the usual few buckets) */
    double stack_part[64], *part = nb <= 64 ? stack_part : tm__host_alloc(ctx, sizeof(double) * (size_t)nb);
    if (!part) return tm__err(ctx, TM_ERR_NOMEM, "tm_ctx_clip_grad_norm: out of host memory");
    tm_status st = TM_OK;
    for (int k = 0; k < nb && st == TM_OK; k++) {
        tm_tensor *g = tm_ctx_bucket_tensor(ctx, k, TM_BUCKET_GRADS), *sl, *p;
        int64_t lo = 0, hi = 0;
        part[k] = 0.0;
        st = tm_ctx_grad_shard(ctx, k, &lo, &hi);
        if (st != TM_OK || hi <= lo) continue;
        int owner = tm__zero_enabled(ctx) || tm_comm_rank(ctx, (tm_comm_group)tm__bucket_comm_group(ctx, k)) == 0;
        if (!owner) continue;
        st = hi - lo == tm_tensor_numel(g) ? (sl = g, TM_OK) : tm_slice(ctx, g, 0, lo, hi, &sl);
        if (st == TM_OK) st = tm_grad_sumsq(ctx, sl, &p);
        if (st == TM_OK) st = tm_tensor_read(ctx, p, TM_F64, &part[k], 1);
    }
    if (st == TM_OK && world) st = tm_comm_allreduce_host(ctx, TM_COMM_WORLD, TM_F64, part, nb);
    double ss = 0.0;
    for (int k = 0; k < nb; k++) ss += part[k];
    if (part != stack_part) tm__host_free(ctx, part);
    TM__TRY(st);
    double norm = sqrt(ss);
    if (max_norm > 0.0 && norm > max_norm) {
        double s = max_norm / (norm + 1e-6);
        for (int k = 0; k < nb; k++) {
            tm_tensor *g = tm_ctx_bucket_tensor(ctx, k, TM_BUCKET_GRADS), *sl = g;
            int64_t lo = 0, hi = 0;
            TM__TRY(tm_ctx_grad_shard(ctx, k, &lo, &hi));
            if (hi <= lo) continue;
            if (hi - lo != tm_tensor_numel(g)) TM__TRY(tm_slice(ctx, g, 0, lo, hi, &sl));
            TM__TRY(tm_grad_scale(ctx, sl, s));
        }
    }
    if (norm_out) *norm_out = norm;
    return TM_OK;
}
