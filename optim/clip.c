/*
 * clip.c — tm_ctx_clip_grad_norm: global L2 norm of all parameter gradients, and rescaling
 * when it exceeds max_norm (the rule of torch.nn.utils.clip_grad_norm_: scale by
 * max_norm / (norm + 1e-6), so a norm just above max_norm lands just below it).
 *
 * One grad_sumsq op per bucket over its whole gradient buffer (padding is zero: it adds
 * nothing), the partial sums added on the host in bucket order, then one grad_scale op per
 * bucket. Each partial is a fixed-order f64 sum (kernels/cpu/update.c, kernels/cuda/update.cu),
 * so the norm is bitwise independent of the thread count and reproducible run to run.
 *
 * Synchronisations: the host needs the norm (to decide whether to scale, and for norm_out), so
 * it reads the partials back, once per device: the partials of a device's buckets stay on that
 * device and are concatenated there into one vector, read in one copy. A CUDA run therefore
 * waits once per clip, not once per bucket (a CPU-only context counts one as well).
 */
#include <math.h>

#include "extend.h"

/* Read the m 0-d partials xs[] (one device) into vals[0..m) in one copy: concatenated on
 * their device, at most 8 at a time (tm_concat's limit), in order. xs is overwritten. */
static tm_status read_partials(tm_ctx *ctx, tm_tensor **xs, int m, double *vals) {
    int64_t one[1] = {1}, total = m;
    for (int j = 0; j < m; j++) TM__TRY(tm_reshape(ctx, xs[j], 1, one, &xs[j]));
    while (m > 1) {
        int w = 0;
        for (int j = 0; j < m; j += 8) {
            int n = m - j < 8 ? m - j : 8;
            if (n == 1) xs[w++] = xs[j];
            else TM__TRY(tm_concat(ctx, n, xs + j, 0, &xs[w++]));
        }
        m = w;
    }
    return tm_tensor_read(ctx, xs[0], TM_F64, vals, total);
}

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
    /* Stack arrays for the usual handful of buckets: a training step allocates nothing on
     * the host (tm_ctx_alloc_count stays flat). */
    enum { NB_STACK = 32 };
    double part_s[NB_STACK], *part = part_s;
    tm_tensor *xs_s[NB_STACK], **xs = xs_s;
    int idx_s[NB_STACK], *idx = idx_s;
    double vals_s[NB_STACK], *vals = vals_s;
    tm_status s = TM_OK;
    if (nb > NB_STACK) {
        part = tm__host_alloc(ctx, sizeof *part * (size_t)nb);
        xs = tm__host_alloc(ctx, sizeof *xs * (size_t)nb);
        idx = tm__host_alloc(ctx, sizeof *idx * (size_t)nb);
        vals = tm__host_alloc(ctx, sizeof *vals * (size_t)nb);
        if (!part || !xs || !idx || !vals) s = tm__err(ctx, TM_ERR_NOMEM, "tm_ctx_clip_grad_norm: out of host memory");
    }
    for (int k = 0; s == TM_OK && k < nb; k++) part[k] = 0.0;
    /* Under a communicator each rank measures what it holds (tm_ctx_grad_shard: its ZeRO-1
     * block, or the whole bucket), a bucket replicated over its group counted by one replica
     * (group rank 0); the per-bucket partial sums are then added over the world, and summed in
     * bucket order, the same on every rank. */
    int world = tm_comm_size(ctx, TM_COMM_WORLD) > 1;
    /* CPU buckets, then CUDA buckets (a context has at most one CUDA device) */
    for (int pass = 0; s == TM_OK && pass < 2; pass++) {
        int m = 0;
        for (int k = 0; s == TM_OK && k < nb; k++) {
            tm_bucket_info bi;
            int64_t lo = 0, hi = 0;
            s = tm_ctx_bucket_info(ctx, k, &bi);
            if (s == TM_OK) s = tm_ctx_grad_shard(ctx, k, &lo, &hi);
            tm_tensor *g = tm_ctx_bucket_tensor(ctx, k, TM_BUCKET_GRADS);
            if (s != TM_OK || (bi.device.type == TM_DEVICE_CUDA) != pass || hi <= lo) continue;
            int owner = tm__zero_enabled(ctx) || tm_comm_rank(ctx, (tm_comm_group)tm__bucket_comm_group(ctx, k)) == 0;
            if (!owner) continue;
            if (hi - lo != tm_tensor_numel(g)) s = tm_slice(ctx, g, 0, lo, hi, &g);
            if (s == TM_OK) s = tm_grad_sumsq(ctx, g, &xs[m]);
            idx[m++] = k;
        }
        if (s == TM_OK && m > 0) s = read_partials(ctx, xs, m, vals);
        for (int j = 0; s == TM_OK && j < m; j++) part[idx[j]] = vals[j];
    }
    if (s == TM_OK && world) s = tm_comm_allreduce_host(ctx, TM_COMM_WORLD, TM_F64, part, nb);
    double ss = 0.0;
    for (int k = 0; s == TM_OK && k < nb; k++) ss += part[k]; /* bucket order */
    if (part != part_s) tm__host_free(ctx, part);
    if (xs != xs_s) tm__host_free(ctx, xs);
    if (idx != idx_s) tm__host_free(ctx, idx);
    if (vals != vals_s) tm__host_free(ctx, vals);
    TM__TRY(s);
    double norm = sqrt(ss);
    if (max_norm > 0.0 && norm > max_norm) {
        double scale = max_norm / (norm + 1e-6);
        for (int k = 0; k < nb; k++) {
            tm_tensor *g = tm_ctx_bucket_tensor(ctx, k, TM_BUCKET_GRADS);
            int64_t lo = 0, hi = 0;
            TM__TRY(tm_ctx_grad_shard(ctx, k, &lo, &hi));
            if (hi <= lo) continue;
            if (hi - lo != tm_tensor_numel(g)) TM__TRY(tm_slice(ctx, g, 0, lo, hi, &g));
            TM__TRY(tm_grad_scale(ctx, g, scale));
        }
    }
    if (norm_out) *norm_out = norm;
    return TM_OK;
}
