/*
 * grouped_matmul.c — tm_grouped_matmul (ragged GEMM over expert groups): public entry point and
 * shape/dtype check. Kernels: kernels/cpu/grouped_matmul.c (layout documented there).
 *
 * The values of counts (each >= 0, sum = rows of x) are validated by the kernels, from the
 * host values the GEMM loop needs anyway (tm__grouped_matmul_counts): the counts' host mirror
 * when they come from tm_moe_permute (no synchronisation), else one read back, after which
 * they are mirrored. The check itself never reads device data. The bf16 CUDA kernel with the
 * device schedule (kernels/cuda/grouped_matmul.cu, the default) needs no host values: it
 * validates a mirror when there is one (tm__grouped_matmul_counts_mirrored) and otherwise
 * clamps the counts on the device.
 */
#include "internal.h"

/* Validate cnt (G host values) against R. src[0]: the caller's x, not a bf16 staging copy. The
 * messages name the call's op: grouped_swiglu's kernels run these kernels under their own op. */
static tm_status check_counts(tm__call *c, const int64_t *cnt) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->src[0], *counts = c->in[2];
    int64_t G = counts->shape[0], R = x->shape[0], sum = 0;
    for (int64_t g = 0; g < G; g++) {
        if (cnt[g] < 0)
            return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: counts[%lld] = %lld is negative (counts %s)",
                           tm__opname(c), (long long)g, (long long)cnt[g], tm__tdesc(ctx, counts));
        if (cnt[g] > R - sum)
            return tm__err(ctx, TM_ERR_SHAPE, "%s: counts exceed the rows of x at group %lld "
                           "(counts[%lld] = %lld, %lld rows before it, x %s)",
                           tm__opname(c), (long long)g, (long long)g, (long long)cnt[g], (long long)sum, tm__tdesc(ctx, x));
        sum += cnt[g];
    }
    if (sum != R)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: counts sum to %lld but x has %lld rows (x %s, counts %s)",
                       tm__opname(c), (long long)sum, (long long)R, tm__tdesc(ctx, x), tm__tdesc(ctx, counts));
    return TM_OK;
}

tm_status tm__grouped_matmul_counts(tm__call *c, const int64_t **out) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *counts = c->in[2];
    const int64_t G = counts->shape[0];
    const int64_t *cnt = tm__mirror_find(ctx, counts);
    if (counts->device.type == TM_DEVICE_CPU) {
        /* Where a device would read the counts back, the CPU counts a synchronisation; the values
         * are the data itself (equal to any mirror). CUDA reads nothing back for bf16 when it
         * schedules the groups on the device (the default), so neither is counted then. */
        if (!cnt && G > 0 && !(c->src[0]->dtype == TM_BF16 && tm__gmm_device_schedule(ctx))) {
            tm__count_sync(ctx);
            TM__TRY(tm__mirror_set(ctx, counts, tm__data(counts)));
        }
        cnt = tm__data(counts);
    } else if (!cnt) {
        int64_t *h = tm__arena_alloc(ctx, tm_cpu(), (size_t)(G ? G : 1) * sizeof *h);
        if (!h) return TM_ERR_NOMEM;
        if (G > 0) {
            TM__TRY(tm__memcpy(ctx, h, tm_cpu(), tm__data(counts), counts->device, (size_t)G * sizeof *h));
            TM__TRY(tm__mirror_set(ctx, counts, h));
        }
        cnt = h;
    }
    TM__TRY(check_counts(c, cnt));
    *out = cnt;
    return TM_OK;
}

tm_status tm__grouped_matmul_counts_mirrored(tm__call *c, const int64_t **out) {
    const int64_t *cnt = tm__mirror_find(c->ctx, c->in[2]);
    *out = NULL;
    if (cnt) TM__TRY(check_counts(c, cnt));
    *out = cnt;
    return TM_OK;
}

tm_status tm__grouped_matmul_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1], *counts = c->in[2];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_float(c, 1));
    TM__TRY(tm__check_same_dtype(c, 0, 1));
    if (counts->dtype != TM_I64)
        return tm__err(ctx, TM_ERR_DTYPE, "grouped_matmul: counts must be i64 [G], got %s", tm__tdesc(ctx, counts));
    if (x->ndim != 2)
        return tm__err(ctx, TM_ERR_SHAPE, "grouped_matmul: x must be [R,K], got %s", tm__tdesc(ctx, x));
    if (w->ndim != 3)
        return tm__err(ctx, TM_ERR_SHAPE, "grouped_matmul: w must be [G,K,N], got %s", tm__tdesc(ctx, w));
    if (counts->ndim != 1 || counts->shape[0] != w->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "grouped_matmul: counts must be [%lld] (one per group of w), got counts %s, w %s",
                       (long long)w->shape[0], tm__tdesc(ctx, counts), tm__tdesc(ctx, w));
    if (w->shape[1] != x->shape[1])
        return tm__err(ctx, TM_ERR_SHAPE, "grouped_matmul: inner dims differ: x %s, w %s (w must be [G,%lld,N])",
                       tm__tdesc(ctx, x), tm__tdesc(ctx, w), (long long)x->shape[1]);
    int64_t shape[2] = {x->shape[0], w->shape[2]};
    return tm__out_new(c, 0, x->dtype, 2, shape);
}

tm_status tm_grouped_matmul(tm_ctx *ctx, tm_tensor *x, tm_tensor *w, tm_tensor *counts, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_GROUPED_MATMUL);
    c.n_in = 3;
    c.in[0] = x;
    c.in[1] = w;
    c.in[2] = counts;
    return tm__op_run1(&c, out);
}
