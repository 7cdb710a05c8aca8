/*
 * arena.c — host allocation through the hook, device allocation, and the per-step arenas.
 *
 * Every temporary (op outputs, saved tensors, gradients of intermediates, tape nodes, tensor
 * headers, kernel scratch) is bumped out of an arena; tm_ctx_arena_reset rewinds all arenas at
 * once. Because the chunks are kept, the arena doubles as the caching allocator of the CUDA
 * backend: after the first step no cudaMalloc happens.
 */
#include "ctx_internal.h"

#include <stdlib.h>

void *tm__host_alloc_raw(tm_ctx *ctx, size_t nbytes) {
    if (nbytes == 0) nbytes = 1;
    if (ctx->has_alloc) return ctx->alloc.alloc(nbytes, TM__ALIGN, ctx->alloc.user);
    size_t n = (nbytes + TM__ALIGN - 1) / TM__ALIGN * TM__ALIGN;
    return aligned_alloc(TM__ALIGN, n);
}

void *tm__host_alloc(tm_ctx *ctx, size_t nbytes) {
    void *p = tm__host_alloc_raw(ctx, nbytes);
    if (p) ctx->alloc_count++;
    return p;
}

void tm__host_free(tm_ctx *ctx, void *p) {
    if (!p) return;
    if (ctx->has_alloc)
        ctx->alloc.free(p, ctx->alloc.user);
    else
        free(p);
}

void *tm__dev_alloc(tm_ctx *ctx, tm_device dev, size_t nbytes) {
    const tm__backend_ops *be = ctx->be[tm__backend(dev)];
    void *p = NULL;
    if (!be) {
        tm__err(ctx, TM_ERR_DEVICE, "%s memory requested in a context without that device",
                dev.type == TM_DEVICE_CUDA ? "CUDA" : "host");
        return NULL;
    }
    if (be->alloc(ctx, nbytes ? nbytes : 1, &p) != TM_OK) return NULL;
    ctx->alloc_count++;
    return p;
}

void tm__dev_free(tm_ctx *ctx, tm_device dev, void *p) {
    const tm__backend_ops *be = ctx->be[tm__backend(dev)];
    if (p && be) be->free(ctx, p);
}

tm_status tm__dev_memset0(tm_ctx *ctx, tm_device dev, void *p, size_t nbytes) {
    if (!nbytes) return TM_OK;
    const tm__backend_ops *be = ctx->be[tm__backend(dev)];
    if (!be) return tm__err(ctx, TM_ERR_DEVICE, "memset on a device this context does not have");
    return be->memset0(ctx, p, nbytes);
}

static void *arena_bump(tm_ctx *ctx, tm__arena *a, size_t nbytes) {
    size_t n = (nbytes + TM__ALIGN - 1) / TM__ALIGN * TM__ALIGN;
    if (n == 0) n = TM__ALIGN;
    /* First chunk at or after the current one that fits; the sequence of requests of a
     * training step repeats, so the same chunks serve the same requests every step. */
    for (int i = a->cur; i < a->n; i++) {
        tm__chunk *c = &a->chunks[i];
        if (c->size - c->used >= n) {
            void *p = (char *)c->mem + c->used;
            c->used += n;
            a->cur = i;
            a->used += n;
            if (a->used > a->peak) a->peak = a->used;
            return p;
        }
    }
    if (a->n == a->cap) {
        int cap = a->cap ? a->cap * 2 : 8;
        tm__chunk *nc = tm__host_alloc(ctx, sizeof *nc * cap);
        if (!nc) return NULL;
        if (a->n) memcpy(nc, a->chunks, sizeof *nc * a->n);
        tm__host_free(ctx, a->chunks);
        a->chunks = nc;
        a->cap = cap;
    }
    size_t size = n > ctx->chunk_bytes ? n : ctx->chunk_bytes;
    if (a == &ctx->meta && size > ((size_t)4 << 20) && n <= ((size_t)4 << 20)) size = (size_t)4 << 20;
    void *mem = tm__dev_alloc(ctx, a->dev, size);
    if (!mem) return NULL;
    tm__chunk *c = &a->chunks[a->n];
    c->mem = mem;
    c->size = size;
    c->used = n;
    a->cur = a->n++;
    a->used += n;
    if (a->used > a->peak) a->peak = a->used;
    return mem;
}

void tm__arena_reset(tm__arena *a) {
    for (int i = 0; i < a->n; i++) a->chunks[i].used = 0;
    a->cur = 0;
    a->used = 0;
}

void tm__arena_release(tm_ctx *ctx, tm__arena *a) {
    for (int i = 0; i < a->n; i++) tm__dev_free(ctx, a->dev, a->chunks[i].mem);
    tm__host_free(ctx, a->chunks);
    memset(a, 0, sizeof *a);
}

void *tm__arena_alloc(tm_ctx *ctx, tm_device dev, size_t nbytes) {
    tm__arena *a;
    if (dev.type == TM_DEVICE_CPU) {
        a = &ctx->arena[TM__CPU];
    } else if (ctx->be[TM__CUDA] && dev.index == ctx->cuda_device) {
        a = &ctx->arena[TM__CUDA];
    } else {
        tm__err(ctx, TM_ERR_DEVICE, "cuda:%d is not this context's device (context cuda_device=%d)",
                dev.index, ctx->cuda_device);
        return NULL;
    }
    void *p = arena_bump(ctx, a, nbytes);
    if (!p)
        tm__err(ctx, TM_ERR_NOMEM, "out of %s memory allocating %zu bytes (arena holds %zu)",
                dev.type == TM_DEVICE_CPU ? "host" : "device", nbytes, a->used);
    return p;
}

void *tm__meta_alloc(tm_ctx *ctx, size_t nbytes) {
    void *p = arena_bump(ctx, &ctx->meta, nbytes);
    if (!p) tm__err(ctx, TM_ERR_NOMEM, "out of host memory allocating %zu bytes of bookkeeping", nbytes);
    return p;
}
