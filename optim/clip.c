/*
 * clip.c — tm_ctx_clip_grad_norm: global L2 norm of all parameter gradients, and rescaling
 * when it exceeds max_norm (the rule of torch.nn.utils.clip_grad_norm_: scale by
 * max_norm / (norm + 1e-6), so a norm just above max_norm lands just below it).
 *
 * One path: per device (the CPU, then the CUDA device), one grad_sumsq_multi over the gradient
 * ranges of every bucket there (padding is zero: it adds nothing), giving one partial sum per
 * bucket, then one grad_scale_multi over the same ranges. Each partial is a fixed-order f64 sum
 * (kernels/cpu/update.c, kernels/cuda/update.cu; f32-rounded on CUDA), and the norm is the
 * partials added in bucket order, so it is bitwise independent of the thread count and
 * reproducible run to run.
 *
 * Every bucket on one device and no communicator (the usual case): grad_sumsq_multi also
 * computes the norm and the scale factor on the device, and grad_scale_multi reads the factor
 * there: two CUDA launches and no host read between them. The host reads the per-bucket
 * partials (one copy, the step's one clip synchronisation) only when the caller asks for the
 * norm: `tinymoe train` does every step (train/step.c: its non-finite guard must see the norm
 * before the update, and it logs it), a caller passing norm_out = NULL waits for nothing.
 *
 * Otherwise (buckets on the CPU and a GPU, or a communicator) the host decides: the partials of
 * each device are read (one copy per device), added over the world, and the scale factor, when
 * clipping, goes to each device as a 0-d tensor for its grad_scale_multi.
 *
 * tm_ctx_clip_grad_norm_deferred is the same clip without the grad_scale_multi of the one-device
 * case: the factor goes back to the caller as a device tensor, for tm_optimizer_step_scaled,
 * whose AdamW kernel multiplies each gradient by it as it reads it (adamw_update_multi's
 * factor: the bits the scaled gradient would have had). The clip's second pass over every
 * gradient (a read and a write) disappears and nothing is read back for it, so the step stays
 * free of host waits. The gradients keep their unscaled values; that is the contract's price,
 * and why tm_ctx_clip_grad_norm, which leaves them scaled, stays the default. In the host-decided
 * case the deferred clip hands back the host's factor as a tensor on the buckets' device when
 * they are all on one (a communicator's ranks: the pass is saved there too), and otherwise
 * scales in place as before and hands back NULL (nothing left to apply; also when the norm is
 * within max_norm).
 */
#include <math.h>

#include "extend.h"

/* The gradient ranges of the buckets on CUDA (cuda = 1) or the CPU (0) into the context's
 * segment list of that device: each bucket's local range (tm_ctx_grad_shard: its ZeRO block,
 * or the whole bucket; under ZeRO-2 the shard that holds that block's sums), skipping those this rank does not measure when owned_only (a bucket
 * replicated over its group is counted by one replica, group rank 0). idx[j] = the bucket of
 * range j; *m = the ranges (0: no list); *devp = the list's device. */
static tm_status grad_ranges(tm_ctx *ctx, int cuda, int owned_only, tm__segs **out, tm_device *devp, int *idx,
                            int *m) {
    int nb = tm_ctx_num_buckets(ctx), found = 0;
    tm_device dev = tm_cpu();
    *m = 0;
    for (int k = 0; k < nb; k++) {
        tm_bucket_info bi;
        TM__TRY(tm_ctx_bucket_info(ctx, k, &bi));
        if ((bi.device.type == TM_DEVICE_CUDA) != cuda) continue;
        dev = bi.device;
        found = 1;
    }
    if (!found) return TM_OK;
    tm__segs *l;
    TM__TRY(tm__ctx_segs(ctx, dev, nb, &l));
    TM__TRY(tm__segs_begin(ctx, l, TM__SEGS_GRADS, nb));
    for (int k = 0; k < nb; k++) {
        tm_bucket_info bi;
        int64_t lo = 0, hi = 0;
        TM__TRY(tm_ctx_bucket_info(ctx, k, &bi));
        if ((bi.device.type == TM_DEVICE_CUDA) != cuda) continue;
        TM__TRY(tm_ctx_grad_shard(ctx, k, &lo, &hi));
        if (hi <= lo) continue;
        if (owned_only && !tm__zero_enabled(ctx) &&
            tm_comm_rank(ctx, (tm_comm_group)tm__bucket_comm_group(ctx, k)) != 0)
            continue;
        int64_t goff;
        TM__TRY(tm__bucket_grads_settle(ctx, k));
        tm_tensor *G = tm__bucket_grads_reduced(ctx, k, &goff);
        if (!G)
            return tm__err(ctx, TM_ERR_STATE, "tm_ctx_clip_grad_norm: bucket %d (\"%s\", ...) has no reduced gradients: "
                           "under ZeRO-2 call tm_comm_sync_grads after the backward", k, tm__bucket_first_param(ctx, k));
        TM__TRY(tm__segs_add_grad(ctx, l, G, lo - goff, hi - goff));
        idx[(*m)++] = k;
    }
    *out = l;
    *devp = dev;
    return TM_OK;
}

/* The clip over scratch arrays of nb entries (see the top). factor_out NULL: the gradients are
 * scaled here; otherwise, when the factor is computed on the device, the scaling is left to
 * the update that reads *factor_out (NULL when the gradients were scaled here after all). */
static tm_status clip(tm_ctx *ctx, double max_norm, double *norm_out, tm_tensor **factor_out, double *part,
                      double *vals, int *idx) {
    int nb = tm_ctx_num_buckets(ctx);
    int world = tm_comm_size(ctx, TM_COMM_WORLD) > 1;
    /* Every bucket on one device (one_dev), and one rank: the factor is computed and applied on
     * the device. */
    int one_dev = nb > 0;
    tm_device dev0 = tm_cpu();
    for (int k = 0; one_dev && k < nb; k++) {
        tm_bucket_info bi;
        TM__TRY(tm_ctx_bucket_info(ctx, k, &bi));
        if (k == 0) dev0 = bi.device;
        else if (!tm__same_device(bi.device, dev0)) one_dev = 0;
    }
    int on_device = one_dev && !world;
    for (int k = 0; k < nb; k++) part[k] = 0.0;
    int need_norm = norm_out || !on_device;
    for (int cuda = 0; cuda < 2; cuda++) {
        tm__segs *l = NULL;
        tm_device dev;
        int m = 0;
        TM__TRY(grad_ranges(ctx, cuda, world, &l, &dev, idx, &m));
        if (m == 0) continue;
        tm_tensor *partials, *factor;
        TM__TRY(tm__grad_sumsq_multi(ctx, l, on_device ? max_norm : 0.0, &partials, &factor));
        if (on_device && factor_out) *factor_out = factor; /* 1 when not clipping */
        else if (on_device && max_norm > 0.0) TM__TRY(tm__grad_scale_multi(ctx, l, factor));
        if (!need_norm) continue;
        TM__TRY(tm_tensor_read(ctx, partials, TM_F64, vals, m));
        for (int j = 0; j < m; j++) part[idx[j]] = vals[j];
    }
    if (!need_norm) return TM_OK;
    /* Under a communicator each rank measured what it holds; the per-bucket partial sums are
     * added over the world, and summed in bucket order, the same on every rank. */
    if (world) TM__TRY(tm_comm_allreduce_host(ctx, TM_COMM_WORLD, TM_F64, part, nb));
    double ss = 0.0;
    for (int k = 0; k < nb; k++) ss += part[k]; /* bucket order (empty buckets add 0) */
    double norm = sqrt(ss);
    if (!on_device && max_norm > 0.0 && norm > max_norm) {
        double scale = max_norm / (norm + 1e-6);
        /* Deferred, under a communicator, every bucket on one device: the factor the host
         * computed goes to the update as the one-rank case's does, saving the scale's pass
         * over the gradients (a read and a write of each). */
        if (factor_out && one_dev) {
            if (norm_out) *norm_out = norm;
            return tm__clip_factor(ctx, dev0, scale, factor_out);
        }
        for (int cuda = 0; cuda < 2; cuda++) {
            tm__segs *l = NULL;
            tm_device dev;
            int m = 0;
            TM__TRY(grad_ranges(ctx, cuda, 0, &l, &dev, idx, &m));
            if (m == 0) continue;
            tm_tensor *factor;
            TM__TRY(tm__clip_factor(ctx, dev, scale, &factor));
            TM__TRY(tm__grad_scale_multi(ctx, l, factor));
        }
    }
    if (norm_out) *norm_out = norm;
    return TM_OK;
}

/* Both public entry points: fn names the caller in messages. */
static tm_status clip_entry(tm_ctx *ctx, const char *fn, double max_norm, double *norm_out, tm_tensor **factor_out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (isnan(max_norm)) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: max_norm is NaN", fn);
    int nb = tm_ctx_num_buckets(ctx);
    /* Refuse before touching anything. */
    for (int k = 0; k < nb; k++) {
        tm_bucket_info bi;
        TM__TRY(tm_ctx_bucket_info(ctx, k, &bi));
        if (!tm__op_available(ctx, "grad_sumsq_multi", bi.device) || !tm__op_available(ctx, "grad_scale_multi", bi.device))
            return tm__err(ctx, TM_ERR_UNSUPPORTED,
                           "%s: no grad_sumsq_multi / grad_scale_multi kernel on %s yet (bucket %d: "
                           "%s gradients of parameters such as \"%s\"); nothing was changed", fn,
                           bi.device.type == TM_DEVICE_CUDA ? "CUDA" : "the CPU", k, tm_dtype_name(bi.dtype),
                           tm__bucket_first_param(ctx, k));
    }
    /* Stack arrays for the usual handful of buckets: a training step allocates nothing on
     * the host (tm_ctx_alloc_count stays flat). */
    enum { NB_STACK = 32 };
    double part_s[NB_STACK], *part = part_s, vals_s[NB_STACK], *vals = vals_s;
    int idx_s[NB_STACK], *idx = idx_s;
    tm_status s = TM_OK;
    if (nb > NB_STACK) {
        part = tm__host_alloc(ctx, sizeof *part * (size_t)nb);
        vals = tm__host_alloc(ctx, sizeof *vals * (size_t)nb);
        idx = tm__host_alloc(ctx, sizeof *idx * (size_t)nb);
        if (!part || !vals || !idx) s = tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    }
    if (s == TM_OK) s = clip(ctx, max_norm, norm_out, factor_out, part, vals, idx);
    if (part != part_s) tm__host_free(ctx, part);
    if (vals != vals_s) tm__host_free(ctx, vals);
    if (idx != idx_s) tm__host_free(ctx, idx);
    return s;
}

tm_status tm_ctx_clip_grad_norm(tm_ctx *ctx, double max_norm, double *norm_out) {
    return clip_entry(ctx, "tm_ctx_clip_grad_norm", max_norm, norm_out, NULL);
}

tm_status tm_ctx_clip_grad_norm_deferred(tm_ctx *ctx, double max_norm, double *norm_out, tm_tensor **grad_scale) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!grad_scale) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_ctx_clip_grad_norm_deferred: grad_scale is NULL");
    *grad_scale = NULL;
    return clip_entry(ctx, "tm_ctx_clip_grad_norm_deferred", max_norm, norm_out, grad_scale);
}
