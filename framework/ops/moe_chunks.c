/*
 * moe_chunks.c — tm_moe_sort_chunks: the public entry point, its check and the validation of
 * the chunk sizes. Kernels: kernels/cpu/moe_chunks.c, kernels/cuda/moe_chunks.cu.
 *
 *   in[0]  x            (R, H) float
 *   in[1]  split_sizes  (G * K) i64, on x's device: chunk i = g * K + k of x holds split_sizes[i]
 *                       rows, chunks in order i = 0, 1, ... (sum = R)
 *   iattr  [0] G (num_groups >= 1; K = numel(split_sizes) / G)
 *   out[0] y            (R, H) x's dtype: the same chunks in order k * G + g
 *
 * The expert-parallel dispatch receives its rows source-rank major (G = ep ranks, K = local
 * experts) and its grouped GEMMs need them expert-major: Megatron-LM's sort_chunks_by_idxs and
 * TransformerEngine's moe_sort_chunks_by_index with sorted_idxs = the grid transposed. The
 * backward is the inverse reordering of dy (the [K, G] grid back to [G, K]), added into dx.
 */
#include "internal.h"

/* The chunk sizes on the host, checked: from split_sizes directly on the CPU, from its host
 * mirror on a device (NULL there without a mirror: the CUDA kernels take the sizes on the
 * device, unchecked, and stay in bounds whatever they hold). */
tm_status tm__moe_sort_chunks_sizes(tm__call *c, const int64_t **out) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *sz = c->in[1];
    const int64_t *v = sz->device.type == TM_DEVICE_CPU ? (const int64_t *)tm__data(sz) : tm__mirror_find(ctx, sz);
    *out = NULL;
    if (!v) return TM_OK;
    int64_t n = sz->shape[0], sum = 0;
    for (int64_t i = 0; i < n; i++) {
        if (v[i] < 0 || v[i] > x->shape[0] - sum)
            return tm__err(ctx, TM_ERR_SHAPE,
                           "moe_sort_chunks: split_sizes[%lld] = %lld %s (x %s, num_groups %lld, the chunks before it "
                           "hold %lld rows)",
                           (long long)i, (long long)v[i], v[i] < 0 ? "is negative" : "runs past the rows of x",
                           tm__tdesc(ctx, x), (long long)c->iattr[0], (long long)sum);
        sum += v[i];
    }
    if (sum != x->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "moe_sort_chunks: split_sizes sum to %lld but x %s has %lld rows",
                       (long long)sum, tm__tdesc(ctx, x), (long long)x->shape[0]);
    *out = v;
    return TM_OK;
}

tm_status tm__moe_sort_chunks_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *sz = c->in[1];
    const int64_t G = c->iattr[0];
    TM__TRY(tm__check_float(c, 0));
    if (x->ndim != 2)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_sort_chunks: x must be [R, H], got %s", tm__tdesc(ctx, x));
    if (sz->dtype != TM_I64 || sz->ndim != 1)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_sort_chunks: split_sizes must be i64 [num_groups * K], got %s",
                       tm__tdesc(ctx, sz));
    if (G < 1 || sz->shape[0] % G)
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "moe_sort_chunks: num_groups = %lld must be >= 1 and divide the %lld chunks of split_sizes %s",
                       (long long)G, (long long)sz->shape[0], tm__tdesc(ctx, sz));
    const int64_t *v;
    TM__TRY(tm__moe_sort_chunks_sizes(c, &v));
    return tm__out_new(c, 0, x->dtype, 2, x->shape);
}

tm_status tm_moe_sort_chunks(tm_ctx *ctx, tm_tensor *x, tm_tensor *split_sizes, int64_t num_groups, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_MOE_SORT_CHUNKS);
    c.n_in = 2;
    c.in[0] = x;
    c.in[1] = split_sizes;
    c.iattr[0] = num_groups;
    return tm__op_run1(&c, out);
}
