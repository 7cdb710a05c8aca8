/*
 * arena.c — host allocation through the hook, device allocation, and the per-step arenas.
 *
 * Every temporary (op outputs, saved tensors, gradients of intermediates, tape nodes, tensor
 * headers, kernel scratch) comes out of an arena; tm_ctx_arena_reset rewinds all arenas at
 * once. Because the chunks are kept, the arena doubles as the caching allocator of the CUDA
 * backend: after the first step no cudaMalloc happens. Within a step, the data arenas reuse
 * blocks given back early (tm__arena_free: size-class free lists, ctx_internal.h), so a block
 * that died in the backward pass serves a later request instead of new memory.
 */
#include "ctx_internal.h"

#include <stdlib.h>

/* Under AddressSanitizer, host blocks given back to a data arena are poisoned until they are
 * handed out again, so a read of a released tensor or of scratch after its kernel is reported
 * as a use-after-poison. */
#if defined(__SANITIZE_ADDRESS__)
#define TM__ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TM__ASAN 1
#endif
#endif
#ifdef TM__ASAN
#include <sanitizer/asan_interface.h>
#define HOST_POISON(a, p, n)                                                        \
    do {                                                                            \
        if ((a)->dev.type == TM_DEVICE_CPU) ASAN_POISON_MEMORY_REGION((p), (n));   \
    } while (0)
#define HOST_UNPOISON(a, p, n)                                                      \
    do {                                                                            \
        if ((a)->dev.type == TM_DEVICE_CPU) ASAN_UNPOISON_MEMORY_REGION((p), (n)); \
    } while (0)
#else
#define HOST_POISON(a, p, n) ((void)0)
#define HOST_UNPOISON(a, p, n) ((void)0)
#endif

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

/* ---- the arenas ----------------------------------------------------------------------------- */

/* Bump n bytes (a multiple of TM__ALIGN) out of the arena's chunks, adding a chunk when none
 * fits. Byte counts (used, peak) are the caller's business. */
static void *chunk_bump(tm_ctx *ctx, tm__arena *a, size_t n) {
    /* First chunk at or after the current one that fits; the sequence of requests of a
     * training step repeats, so the same chunks serve the same requests every step. */
    for (int i = a->cur; i < a->n; i++) {
        tm__chunk *c = &a->chunks[i];
        if (c->size - c->used >= n) {
            void *p = (char *)c->mem + c->used;
            c->used += n;
            a->cur = i;
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
    return mem;
}

static size_t align_up(size_t nbytes) {
    size_t n = (nbytes + TM__ALIGN - 1) / TM__ALIGN * TM__ALIGN;
    return n ? n : TM__ALIGN;
}

/* Size classes, four per doubling, in units u of TM__ALIGN bytes: class c < 4 is u = c; above,
 * class 4 + 4(e - 2) + k is u = 2^e + k 2^(e-2) (k = 0..3). */
static int class_floor(size_t size) {
    size_t u = size / TM__ALIGN;
    if (u < 4) return (int)u;
    int e = 0;
#if defined(__GNUC__)
    e = 63 - __builtin_clzll((unsigned long long)u);
#else
    while ((u >> (e + 1)) != 0) e++;
#endif
    int k = (int)((u - ((size_t)1 << e)) >> (e - 2));
    return 4 + 4 * (e - 2) + k;
}
static size_t class_size(int c) {
    if (c < 4) return (size_t)c * TM__ALIGN;
    int e = (c - 4) / 4 + 2, k = (c - 4) % 4;
    return (((size_t)1 << e) + ((size_t)k << (e - 2))) * TM__ALIGN;
}
static int class_ceil(size_t size) {
    int c = class_floor(size);
    return class_size(c) == size ? c : c + 1;
}

/* A request may take a free block up to this many classes above its own (a block at most
 * ~1.4x the request); past that, bumping fresh memory wastes less. */
enum { REUSE_SPAN = 2 };

static int backend_of_arena(const tm_ctx *ctx, const tm__arena *a) { return (int)(a - ctx->arena); }

static void count_used(tm_ctx *ctx, tm__arena *a, ptrdiff_t delta) {
    a->used = (size_t)((ptrdiff_t)a->used + delta);
    if (a->used > a->peak) a->peak = a->used;
    tm__mem_account(ctx, a->dev, TM_MEM_TEMPORARIES, delta);
}

/* Log a block taken inside an open kernel scope (tm__scope_open). A log that cannot grow
 * loses the entry: that block then simply lives until the reset. */
static void scope_log(tm_ctx *ctx, tm__arena *a, void *p, size_t size, tm__storage *st) {
    if (ctx->scope_n == ctx->scope_cap) {
        int cap = ctx->scope_cap ? 2 * ctx->scope_cap : 256;
        tm__scope_entry *nl = tm__host_alloc(ctx, sizeof *nl * (size_t)cap);
        if (!nl) return;
        if (ctx->scope_n) memcpy(nl, ctx->scope_log, sizeof *nl * (size_t)ctx->scope_n);
        tm__host_free(ctx, ctx->scope_log);
        ctx->scope_log = nl;
        ctx->scope_cap = cap;
    }
    tm__scope_entry *e = &ctx->scope_log[ctx->scope_n++];
    e->p = p;
    e->size = size;
    e->backend = backend_of_arena(ctx, a);
    e->st = st;
}

/* A block of a data arena: from a free list when one holds a block of a fitting class,
 * bumped otherwise. *size receives the block's size (>= nbytes). */
static void *data_take(tm_ctx *ctx, tm__arena *a, size_t nbytes, size_t *size, tm__storage *st) {
    size_t n = align_up(nbytes);
    void *p = NULL;
    if (a->free_bytes) {
        int c0 = class_ceil(n);
        for (int c = c0; c < c0 + REUSE_SPAN && c < TM__NCLASSES; c++) {
            tm__free_block *f = a->free_list[c];
            if (!f) continue;
            a->free_list[c] = f->next;
            f->next = a->spare;
            a->spare = f;
            a->free_bytes -= f->size;
            p = f->p;
            n = f->size;
            break;
        }
    }
    if (!p) p = chunk_bump(ctx, a, n);
    if (!p) return NULL;
    HOST_UNPOISON(a, p, n);
    count_used(ctx, a, (ptrdiff_t)n);
    if (ctx->scope_depth > 0) scope_log(ctx, a, p, n, st);
    *size = n;
    return p;
}

static tm__arena *data_arena(tm_ctx *ctx, tm_device dev) {
    if (dev.type == TM_DEVICE_CPU) return &ctx->arena[TM__CPU];
    if (dev.type == TM_DEVICE_CUDA && ctx->be[TM__CUDA] && dev.index == ctx->cuda_device) return &ctx->arena[TM__CUDA];
    return NULL;
}

/* Blocks given back go to the free list of the largest class not above their size, so any
 * block on list c is at least class_size(c) bytes: a request of class c takes any of them.
 *
 * CUDA: a block given back on the host while kernels queued on the context's stream still
 * read or write it is safe to hand out again at once, because everything that can touch an
 * arena block of the context (kernels, memsets, copies) runs on that one stream, in order:
 * the next user's work is queued after the previous user's. Host code never touches device
 * blocks, and host blocks are only used by synchronous host code (a device-to-host copy
 * returns when its data has landed; a host-to-device copy from pageable memory returns once
 * the source has been staged). */
void tm__arena_free(tm_ctx *ctx, tm_device dev, void *p, size_t size) {
    if (!ctx || !p || !size) return;
    tm__arena *a = data_arena(ctx, dev);
    if (!a) return;
    count_used(ctx, a, -(ptrdiff_t)size);
    HOST_POISON(a, p, size);
    if (a->n) {
        tm__chunk *c = &a->chunks[a->cur];
        if ((char *)p >= (char *)c->mem && (char *)p + size == (char *)c->mem + c->used) {
            c->used -= size; /* the last block bumped: un-bump it */
            return;
        }
    }
    tm__free_block *f = a->spare;
    if (f)
        a->spare = f->next;
    else
        f = tm__meta_alloc(ctx, sizeof *f);
    if (!f) return; /* no bookkeeping memory: the block stays unused until the reset */
    int c = class_floor(size);
    f->p = p;
    f->size = size;
    f->next = a->free_list[c];
    a->free_list[c] = f;
    a->free_bytes += size;
}

void tm__arena_reset(tm_ctx *ctx, tm__arena *a) {
    for (int i = 0; i < a->n; i++) a->chunks[i].used = 0;
    a->cur = 0;
    if (a != &ctx->meta && a->used) tm__mem_account(ctx, a->dev, TM_MEM_TEMPORARIES, -(ptrdiff_t)a->used);
    a->used = 0;
    /* the entries live in the meta arena, which is reset together with the data arenas */
    memset(a->free_list, 0, sizeof a->free_list);
    a->spare = NULL;
    a->free_bytes = 0;
}

void tm__arena_release(tm_ctx *ctx, tm__arena *a) {
    for (int i = 0; i < a->n; i++) {
        HOST_UNPOISON(a, a->chunks[i].mem, a->chunks[i].size);
        tm__dev_free(ctx, a->dev, a->chunks[i].mem);
    }
    tm__host_free(ctx, a->chunks);
    memset(a, 0, sizeof *a);
}

static void *data_alloc(tm_ctx *ctx, tm_device dev, size_t nbytes, size_t *size, tm__storage *st) {
    tm__arena *a = data_arena(ctx, dev);
    if (!a) {
        tm__err(ctx, TM_ERR_DEVICE, "cuda:%d is not this context's device (context cuda_device=%d)",
                dev.index, ctx->cuda_device);
        return NULL;
    }
    void *p = data_take(ctx, a, nbytes, size, st);
    if (!p)
        tm__err(ctx, TM_ERR_NOMEM, "out of %s memory allocating %zu bytes (arena holds %zu)",
                dev.type == TM_DEVICE_CPU ? "host" : "device", nbytes, a->used);
    return p;
}

void *tm__arena_alloc(tm_ctx *ctx, tm_device dev, size_t nbytes) {
    size_t size;
    return data_alloc(ctx, dev, nbytes, &size, NULL);
}

tm_status tm__arena_alloc_storage(tm_ctx *ctx, tm__storage *st) {
    size_t size = 0;
    st->data = data_alloc(ctx, st->device, st->nbytes, &size, st);
    st->arena_bytes = st->data ? size : 0;
    return st->data ? TM_OK : TM_ERR_NOMEM;
}

void *tm__meta_alloc(tm_ctx *ctx, size_t nbytes) {
    tm__arena *a = &ctx->meta;
    size_t n = align_up(nbytes);
    void *p = chunk_bump(ctx, a, n);
    if (!p) {
        tm__err(ctx, TM_ERR_NOMEM, "out of host memory allocating %zu bytes of bookkeeping", nbytes);
        return NULL;
    }
    a->used += n;
    if (a->used > a->peak) a->peak = a->used;
    return p;
}

/* ---- kernel scopes --------------------------------------------------------------------------- */

int tm__set_mem_reuse(tm_ctx *ctx, int on) {
    if (!ctx) return 0;
    int prev = ctx->mem_reuse;
    ctx->mem_reuse = on ? 1 : 0;
    return prev;
}

int tm__scope_open(tm_ctx *ctx) {
    if (!ctx->mem_reuse) return -1;
    ctx->scope_depth++;
    return ctx->scope_n;
}

void tm__scope_close(tm_ctx *ctx, int mark, tm_tensor *const *keep, int nkeep) {
    if (mark < 0 || ctx->scope_depth <= 0) return;
    ctx->scope_depth--;
    if (mark > ctx->scope_n) mark = ctx->scope_n; /* only after a reset inside the scope */
    int w = mark;
    for (int i = mark; i < ctx->scope_n; i++) {
        tm__scope_entry e = ctx->scope_log[i];
        if (e.st) {
            if (e.st->data != e.p) continue; /* released already (tm__tensor_release) */
            int kept = 0;
            for (int k = 0; k < nkeep && !kept; k++) kept = keep[k] && keep[k]->storage == e.st;
            if (kept) {
                if (ctx->scope_depth > 0) ctx->scope_log[w++] = e; /* the enclosing scope decides */
                continue;
            }
            e.st->data = NULL;
        }
        tm__arena_free(ctx, ctx->arena[e.backend].dev, e.p, e.size);
    }
    ctx->scope_n = w;
}

/* ---- accounting ------------------------------------------------------------------------------ */

void tm__mem_account(tm_ctx *ctx, tm_device dev, int cat, ptrdiff_t delta) {
    if (!ctx || cat < 0 || cat >= TM_MEM_NCATEGORIES || !delta) return;
    tm__mem_stats *m = &ctx->mem[tm__backend(dev)];
    if (delta < 0 && (size_t)-delta > m->current[cat]) delta = -(ptrdiff_t)m->current[cat];
    m->current[cat] = (size_t)((ptrdiff_t)m->current[cat] + delta);
    m->total = (size_t)((ptrdiff_t)m->total + delta);
    if (m->current[cat] > m->peak[cat]) m->peak[cat] = m->current[cat];
    if (m->total > m->total_peak) {
        m->total_peak = m->total;
        memcpy(m->at_peak, m->current, sizeof m->at_peak);
    }
}
