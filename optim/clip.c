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
 * The usual case, every bucket on one device and no communicator, is fused (clip_fused): one
 * grad_sumsq_multi over every bucket, which also computes the norm and the scale factor on the
 * device, and one grad_scale_multi that reads the factor there: two CUDA launches, bit for bit
 * the values of the general path below, and no host read between them. The host reads the
 * per-bucket partials (one copy, the step's one clip synchronisation) only when the caller asks
 * for the norm: `tinymoe train` does every step (train/step.c: its non-finite guard must see the
 * norm before the update, and it logs it), a caller passing norm_out = NULL waits for nothing.
 *
 * General path (buckets on the CPU and a GPU, or a communicator): one grad_sumsq op per bucket,
 * the partials read back once per device (concatenated there, read in one copy), added over
 * the world, then one grad_scale op per bucket decided on the host.
 */
#include <math.h>

#include "extend.h"

/* Every bucket's gradients on one device and one rank: the clip in two ops (see the top). The
 * partial of each non-empty bucket (f64, or f32 on CUDA), added in bucket order from 0, is the
 * general path's sum (its empty buckets add 0). */
static tm_status clip_fused(tm_ctx *ctx, tm_device dev, double max_norm, double *norm_out) {
    int nb = tm_ctx_num_buckets(ctx);
    tm__segs *l;
    TM__TRY(tm__ctx_segs(ctx, dev, nb, &l));
    TM__TRY(tm__segs_begin(ctx, l, TM__SEGS_GRADS, nb));
    for (int k = 0; k < nb; k++) {
        int64_t lo = 0, hi = 0;
        TM__TRY(tm_ctx_grad_shard(ctx, k, &lo, &hi));
        if (hi > lo) TM__TRY(tm__segs_add_grad(ctx, l, tm_ctx_bucket_tensor(ctx, k, TM_BUCKET_GRADS), lo, hi));
    }
    int m = tm__segs_count(l);
    if (m == 0) {
        if (norm_out) *norm_out = 0.0;
        return TM_OK;
    }
    tm_tensor *partials, *factor;
    TM__TRY(tm__grad_sumsq_multi(ctx, l, max_norm, &partials, &factor));
    if (max_norm > 0.0) TM__TRY(tm__grad_scale_multi(ctx, l, factor));
    if (!norm_out) return TM_OK;
    enum { NB_STACK = 32 };
    double vals_s[NB_STACK], *vals = vals_s;
    if (m > NB_STACK && !(vals = tm__host_alloc(ctx, sizeof *vals * (size_t)m)))
        return tm__err(ctx, TM_ERR_NOMEM, "tm_ctx_clip_grad_norm: out of host memory");
    tm_status s = tm_tensor_read(ctx, partials, TM_F64, vals, m);
    double ss = 0.0;
    for (int j = 0; j < m; j++) ss += vals[j]; /* bucket order, as the device added them */
    if (vals != vals_s) tm__host_free(ctx, vals);
    TM__TRY(s);
    *norm_out = sqrt(ss);
    return TM_OK;
}

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
    /* One device and one rank: fused. */
    int one_dev = nb > 0 && tm_comm_size(ctx, TM_COMM_WORLD) <= 1;
    tm_device dev = tm_cpu();
    for (int k = 0; one_dev && k < nb; k++) {
        tm_bucket_info bi;
        TM__TRY(tm_ctx_bucket_info(ctx, k, &bi));
        if (k == 0) dev = bi.device;
        else if (!tm__same_device(bi.device, dev)) one_dev = 0;
    }
    if (one_dev && tm__op_available(ctx, "grad_sumsq_multi", dev) && tm__op_available(ctx, "grad_scale_multi", dev))
        return clip_fused(ctx, dev, max_norm, norm_out);
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
