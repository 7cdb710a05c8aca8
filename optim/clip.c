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
    double ss = 0.0;
    for (int k = 0; k < nb; k++) {
        tm_tensor *g = tm_ctx_bucket_tensor(ctx, k, TM_BUCKET_GRADS), *part;
        if (tm_tensor_numel(g) == 0) continue;
        double v = 0.0;
        TM__TRY(tm_grad_sumsq(ctx, g, &part));
        TM__TRY(tm_tensor_read(ctx, part, TM_F64, &v, 1));
        ss += v;
    }
    double norm = sqrt(ss);
    if (max_norm > 0.0 && norm > max_norm) {
        double s = max_norm / (norm + 1e-6);
        for (int k = 0; k < nb; k++) {
            tm_tensor *g = tm_ctx_bucket_tensor(ctx, k, TM_BUCKET_GRADS);
            if (tm_tensor_numel(g)) TM__TRY(tm_grad_scale(ctx, g, s));
        }
    }
    if (norm_out) *norm_out = norm;
    return TM_OK;
}
