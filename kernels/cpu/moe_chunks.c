/*
 * moe_chunks.c — CPU kernels of tm_moe_sort_chunks (layout: framework/ops/moe_chunks.c).
 *
 *   x (R, H) as chunks in [G, K] order, split_sizes[g * K + k] rows each -> y (R, H) in [K, G]
 *   order. Backward: dx's chunk (g, k) += dy's chunk (g, k) read where the forward put it.
 * Rows are copied whole (flag TM__OP_NATIVE_BF16: bf16 moves bit-exactly); the backward adds in
 * the gradient's dtype (bf16 through f32, rounded once per element), or stores 0 + dy into a
 * fresh dx (call->gin_fresh, TM__OP_GRAD_WRITES: the chunks tile dx's rows, so all are written).
 */
#include "internal.h"

/* First rows of each chunk in the [G, K] order (src) and in the [K, G] order (dst). */
static void chunk_offsets(const int64_t *sz, int64_t G, int64_t K, int64_t *src, int64_t *dst) {
    int64_t off = 0;
    for (int64_t i = 0; i < G * K; i++) src[i] = off, off += sz[i];
    off = 0;
    for (int64_t k = 0; k < K; k++)
        for (int64_t g = 0; g < G; g++) dst[g * K + k] = off, off += sz[g * K + k];
}

static tm_status offsets_of(tm__call *c, int64_t **src, int64_t **dst, const int64_t **sz) {
    const int64_t n = c->in[1]->shape[0];
    TM__TRY(tm__moe_sort_chunks_sizes(c, sz));
    if (!*sz) return tm__err(c->ctx, TM_ERR_INTERNAL, "moe_sort_chunks: CPU kernel without the chunk sizes");
    int64_t *o = tm__arena_alloc(c->ctx, tm_cpu(), sizeof(int64_t) * (size_t)(2 * n + 1));
    if (!o) return TM_ERR_NOMEM;
    *src = o, *dst = o + n;
    chunk_offsets(*sz, c->iattr[0], n / c->iattr[0], *src, *dst);
    return TM_OK;
}

tm_status tm__moe_sort_chunks_forward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0];
    const int64_t n = c->in[1]->shape[0];
    const size_t row = (size_t)x->shape[1] * tm_dtype_size(x->dtype);
    const int64_t *sz, *src, *dst;
    TM__TRY(offsets_of(c, (int64_t **)&src, (int64_t **)&dst, &sz));
    const char *in = tm__data(x);
    char *out = tm__data(c->out[0]);
    for (int64_t i = 0; i < n; i++)
        if (sz[i]) memcpy(out + (size_t)dst[i] * row, in + (size_t)src[i] * row, (size_t)sz[i] * row);
    return TM_OK;
}

tm_status tm__moe_sort_chunks_backward_cpu(tm__call *c) {
    tm_tensor *gx = c->gin[0];
    if (!gx) return TM_OK;
    const tm_tensor *gy = c->gout[0];
    const int64_t n = c->in[1]->shape[0], H = gx->shape[1];
    const int64_t *sz, *src, *dst;
    TM__TRY(offsets_of(c, (int64_t **)&src, (int64_t **)&dst, &sz));
    const int fresh = c->gin_fresh[0];
    for (int64_t i = 0; i < n; i++) {
        const int64_t a = src[i] * H, b = dst[i] * H, m = sz[i] * H;
        switch (gx->dtype) {
        case TM_F64: {
            double *d = (double *)tm__data(gx) + a;
            const double *g = (const double *)tm__data(gy) + b;
            if (fresh)
                for (int64_t j = 0; j < m; j++) d[j] = 0.0 + g[j];
            else
                for (int64_t j = 0; j < m; j++) d[j] += g[j];
        } break;
        case TM_F32: {
            float *d = (float *)tm__data(gx) + a;
            const float *g = (const float *)tm__data(gy) + b;
            if (fresh)
                for (int64_t j = 0; j < m; j++) d[j] = 0.0f + g[j];
            else
                for (int64_t j = 0; j < m; j++) d[j] += g[j];
        } break;
        default: {
            uint16_t *d = (uint16_t *)tm__data(gx) + a;
            const uint16_t *g = (const uint16_t *)tm__data(gy) + b;
            for (int64_t j = 0; j < m; j++)
                d[j] = tm__f32_to_bf16((fresh ? 0.0f : tm__bf16_to_f32(d[j])) + tm__bf16_to_f32(g[j]));
        } break;
        }
    }
    return TM_OK;
}
