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
/* (not a plan-only context's data blocks: placeholder addresses, no memory; plan.c) */
#define HOST_POISON(a, p, n)                                                                          \
    do {                                                                                              \
        if ((a)->dev.type == TM_DEVICE_CPU && !(ctx->plan_only && (a) != &ctx->meta))                 \
            ASAN_POISON_MEMORY_REGION((p), (n));                                                      \
    } while (0)
#define HOST_UNPOISON(a, p, n)                                                                        \
    do {                                                                                              \
        if ((a)->dev.type == TM_DEVICE_CPU && !(ctx->plan_only && (a) != &ctx->meta))                 \
            ASAN_UNPOISON_MEMORY_REGION((p), (n));                                                    \
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

static size_t align_up(size_t nbytes) {
    size_t n = (nbytes + TM__ALIGN - 1) / TM__ALIGN * TM__ALIGN;
    return n ? n : TM__ALIGN;
}

static int is_meta(const tm_ctx *ctx, const tm__arena *a) { return a == &ctx->meta; }

/* A chunk's memory from the arena's device; the meta arena's is host memory that the framework
 * reads and writes itself, so in a plan-only context (whose CPU backend allocates nothing:
 * plan.c) it comes from the real CPU backend. */
static void *chunk_mem_alloc(tm_ctx *ctx, tm__arena *a, size_t size) {
    if (!(ctx->plan_only && is_meta(ctx, a))) return tm__dev_alloc(ctx, a->dev, size);
    void *p = NULL;
    if (tm__host_ops()->alloc(ctx, size ? size : 1, &p) != TM_OK) return NULL;
    ctx->alloc_count++;
    return p;
}

static void chunk_mem_free(tm_ctx *ctx, tm__arena *a, void *p) {
    if (ctx->plan_only && is_meta(ctx, a)) tm__host_ops()->free(ctx, p);
    else tm__dev_free(ctx, a->dev, p);
}

/* Add a chunk of `size` bytes from the arena's device; NULL (nothing changed) if the device
 * has none to give. */
static tm__chunk *chunk_add(tm_ctx *ctx, tm__arena *a, size_t size) {
    if (a->n == a->cap) {
        int cap = a->cap ? a->cap * 2 : 8;
        tm__chunk *nc = tm__host_alloc(ctx, sizeof *nc * cap);
        if (!nc) return NULL;
        if (a->n) memcpy(nc, a->chunks, sizeof *nc * a->n);
        tm__host_free(ctx, a->chunks);
        a->chunks = nc;
        a->cap = cap;
    }
    void *mem = chunk_mem_alloc(ctx, a, size);
    if (!mem) return NULL;
    tm__chunk *c = &a->chunks[a->n++];
    c->mem = mem;
    c->size = size;
    c->used = 0;
    c->first = NULL;
    a->reserved += size;
    if (a->reserved > a->reserved_peak) a->reserved_peak = a->reserved;
    a->grew = 1;
    return c;
}

/* The meta arena: bump n bytes (a multiple of TM__ALIGN) out of the first chunk at or after the
 * current one that fits (the requests of a step repeat, so the same chunks serve them). */
static void *meta_bump(tm_ctx *ctx, tm__arena *a, size_t n) {
    for (int i = a->cur; i < a->n; i++) {
        tm__chunk *c = &a->chunks[i];
        if (c->size - c->used >= n) {
            void *p = (char *)c->mem + c->used;
            c->used += n;
            a->cur = i;
            return p;
        }
    }
    size_t size = n > ctx->chunk_bytes ? n : ctx->chunk_bytes;
    if (size > ((size_t)4 << 20) && n <= ((size_t)4 << 20)) size = (size_t)4 << 20;
    tm__chunk *c = chunk_add(ctx, a, size);
    if (!c) return NULL;
    c->used = n;
    a->cur = a->n - 1;
    return c->mem;
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
    int c = 4 + 4 * (e - 2) + k;
    return c < TM__NCLASSES ? c : TM__NCLASSES - 1;
}

static int backend_of_arena(const tm_ctx *ctx, const tm__arena *a) { return (int)(a - ctx->arena); }

static void count_used(tm_ctx *ctx, tm__arena *a, ptrdiff_t delta) {
    a->used = (size_t)((ptrdiff_t)a->used + delta);
    if (a->used > a->peak) a->peak = a->used;
    if (a->used > a->step_peak) a->step_peak = a->used;
    tm__mem_account(ctx, a->dev, TM_MEM_TEMPORARIES, delta);
}

/* -- block records ------------------------------------------------------------------------------ */

enum { SLAB = 256 };

static tm__block *rec_new(tm_ctx *ctx, tm__arena *a) {
    if (!a->spare) {
        if (a->n_slabs == a->cap_slabs) {
            int cap = a->cap_slabs ? 2 * a->cap_slabs : 8;
            tm__block **ns = tm__host_alloc(ctx, sizeof *ns * (size_t)cap);
            if (!ns) return NULL;
            if (a->n_slabs) memcpy(ns, a->slabs, sizeof *ns * (size_t)a->n_slabs);
            tm__host_free(ctx, a->slabs);
            a->slabs = ns;
            a->cap_slabs = cap;
        }
        tm__block *s = tm__host_alloc(ctx, sizeof *s * SLAB);
        if (!s) return NULL;
        a->slabs[a->n_slabs++] = s;
        for (int i = 0; i < SLAB; i++) {
            s[i].next = a->spare;
            a->spare = &s[i];
        }
    }
    tm__block *b = a->spare;
    a->spare = b->next;
    memset(b, 0, sizeof *b);
    return b;
}

static void rec_put(tm__arena *a, tm__block *b) {
    b->next = a->spare;
    a->spare = b;
}

/* -- free bins ------------------------------------------------------------------------------------ */

static void bin_insert(tm__arena *a, tm__block *b) {
    int c = class_floor(b->size);
    b->is_free = 1;
    b->bin = c;
    b->fprev = NULL;
    b->fnext = a->bins[c];
    if (b->fnext) b->fnext->fprev = b;
    a->bins[c] = b;
    a->binmask[c >> 6] |= (uint64_t)1 << (c & 63);
}

static void bin_remove(tm__arena *a, tm__block *b) {
    if (b->fprev)
        b->fprev->fnext = b->fnext;
    else
        a->bins[b->bin] = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    if (!a->bins[b->bin]) a->binmask[b->bin >> 6] &= ~((uint64_t)1 << (b->bin & 63));
    b->is_free = 0;
    b->fprev = b->fnext = NULL;
}

/* The first non-empty bin at or above c, or -1. */
static int bin_next(const tm__arena *a, int c) {
    for (int w = c >> 6; w < (TM__NCLASSES + 63) / 64; w++) {
        uint64_t m = a->binmask[w];
        if (w == c >> 6) m &= ~(uint64_t)0 << (c & 63);
        if (m) return w * 64 + __builtin_ctzll(m);
    }
    return -1;
}

/* A free block of at least n bytes, or NULL. Bin c0 = class_floor(n) holds blocks from
 * class_size(c0) up, some smaller than n: the smallest that fits is taken there (requests of a
 * step repeat their sizes, so exact fits are common). Every block of a higher bin fits and is
 * within a quarter of its bin's size: the first of the lowest non-empty bin is taken. */
static tm__block *best_fit(tm__arena *a, size_t n) {
    int c0 = class_floor(n), c = bin_next(a, c0);
    if (c == c0) {
        tm__block *best = NULL;
        for (tm__block *b = a->bins[c]; b; b = b->fnext)
            if (b->size >= n && (!best || b->size < best->size)) best = b;
        if (best) return best;
        c = c0 + 1 < TM__NCLASSES ? bin_next(a, c0 + 1) : -1;
    }
    return c >= 0 ? a->bins[c] : NULL;
}

/* -- live blocks by address ---------------------------------------------------------------------- */

static size_t map_slot(const tm__arena *a, const void *p) {
    uint64_t h = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 20) & (a->map_cap - 1);
}

static int map_grow(tm_ctx *ctx, tm__arena *a) {
    size_t cap = a->map_cap ? 2 * a->map_cap : 1024;
    tm__block **nm = tm__host_alloc(ctx, sizeof *nm * cap);
    if (!nm) return 0;
    memset(nm, 0, sizeof *nm * cap);
    tm__block **old = a->map;
    size_t old_cap = a->map_cap;
    a->map = nm;
    a->map_cap = cap;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i]) {
            size_t j = map_slot(a, old[i]->p);
            while (nm[j]) j = (j + 1) & (cap - 1);
            nm[j] = old[i];
        }
    tm__host_free(ctx, old);
    return 1;
}

static int map_put(tm_ctx *ctx, tm__arena *a, tm__block *b) {
    if (2 * (a->map_n + 1) > a->map_cap && !map_grow(ctx, a)) return 0;
    size_t j = map_slot(a, b->p);
    while (a->map[j]) j = (j + 1) & (a->map_cap - 1);
    a->map[j] = b;
    a->map_n++;
    return 1;
}

/* Remove and return the live block at p (NULL if none): linear probing with backward shift. */
static tm__block *map_take(tm__arena *a, const void *p) {
    if (!a->map_cap) return NULL;
    size_t mask = a->map_cap - 1, j = map_slot(a, p);
    while (a->map[j] && a->map[j]->p != p) j = (j + 1) & mask;
    tm__block *b = a->map[j];
    if (!b) return NULL;
    a->map[j] = NULL;
    a->map_n--;
    for (size_t k = (j + 1) & mask; a->map[k]; k = (k + 1) & mask) {
        size_t h = map_slot(a, a->map[k]->p);
        /* the entry at k may move to the hole at j if its home h is not in (j, k] */
        if ((k > j && (h <= j || h > k)) || (k < j && h <= j && h > k)) {
            a->map[j] = a->map[k];
            a->map[k] = NULL;
            j = k;
        }
    }
    return b;
}

/* -- chunks of a data arena ------------------------------------------------------------------------- */

/* A new chunk as one free block; NULL if the device or the host has no room. */
static tm__block *data_chunk_add(tm_ctx *ctx, tm__arena *a, size_t size) {
    tm__block *b = rec_new(ctx, a);
    if (!b) return NULL;
    tm__chunk *c = chunk_add(ctx, a, size);
    if (!c) {
        rec_put(a, b);
        return NULL;
    }
    b->p = c->mem;
    b->size = size;
    c->first = b;
    bin_insert(a, b);
    return b;
}

/* Give back every chunk that holds no live block; returns the bytes given back. */
static size_t release_free_chunks(tm_ctx *ctx, tm__arena *a) {
    size_t freed = 0;
    int w = 0;
    for (int i = 0; i < a->n; i++) {
        tm__chunk *c = &a->chunks[i];
        tm__block *f = c->first;
        if (f && f->is_free && f->size == c->size) {
            bin_remove(a, f);
            rec_put(a, f);
            HOST_UNPOISON(a, c->mem, c->size);
            chunk_mem_free(ctx, a, c->mem);
            a->reserved -= c->size;
            freed += c->size;
            continue;
        }
        a->chunks[w++] = *c;
    }
    if (freed) a->n_trims++;
    a->n = w;
    return freed;
}

/* Chunks are at least chunk_bytes and multiples of 2 MiB past that (the CUDA driver's page for
 * large allocations), so that a request a little larger than last step's finds room. */
static size_t chunk_size_for(const tm_ctx *ctx, size_t n) {
    size_t q = (size_t)2 << 20;
    if (n <= ctx->chunk_bytes) return ctx->chunk_bytes;
    return (n + q - 1) / q * q;
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

/* Mark a block free and merge it with free address neighbours (the lower record survives, so
 * a chunk's first record stays its first). */
static void block_free(tm__arena *a, tm__block *b) {
    tm__block *nx = b->next, *pv = b->prev;
    if (nx && nx->is_free) {
        bin_remove(a, nx);
        b->size += nx->size;
        b->next = nx->next;
        if (nx->next) nx->next->prev = b;
        rec_put(a, nx);
    }
    if (pv && pv->is_free) {
        bin_remove(a, pv);
        pv->size += b->size;
        pv->next = b->next;
        if (b->next) b->next->prev = pv;
        rec_put(a, b);
        b = pv;
    }
    bin_insert(a, b);
}

/* A block of a data arena: the best-fitting free block, split to n bytes; a new chunk when no
 * free block holds n. *size receives the block's size. */
static void *data_take(tm_ctx *ctx, tm__arena *a, size_t nbytes, size_t *size, tm__storage *st) {
    size_t n = align_up(nbytes);
    tm__block *b = best_fit(a, n);
    if (!b) {
        size_t want = chunk_size_for(ctx, n);
        b = data_chunk_add(ctx, a, want);
        if (!b) {
            /* the device is full: what no live block uses goes back, then one more try */
            char msg[sizeof ctx->errmsg];
            memcpy(msg, ctx->errmsg, sizeof msg);
            if (release_free_chunks(ctx, a)) b = data_chunk_add(ctx, a, want);
            if (!b && want > n) b = data_chunk_add(ctx, a, n);
            if (!b) {
                memcpy(ctx->errmsg, msg, sizeof msg);
                return NULL;
            }
        }
    }
    tm__block *r = NULL;
    if (b->size - n >= TM__ALIGN && (r = rec_new(ctx, a)) != NULL) {
        r->p = b->p + n;
        r->size = b->size - n;
        r->prev = b;
        r->next = b->next;
        if (b->next) b->next->prev = r;
        b->next = r;
        bin_remove(a, b);
        b->size = n;
        bin_insert(a, r);
    } else {
        bin_remove(a, b);
    }
    if (!map_put(ctx, a, b)) {
        block_free(a, b);
        tm__err(ctx, TM_ERR_NOMEM, "out of host memory for the arena's block table");
        return NULL;
    }
    n = b->size;
    HOST_UNPOISON(a, b->p, n);
    count_used(ctx, a, (ptrdiff_t)n);
    if (ctx->scope_depth > 0) scope_log(ctx, a, b->p, n, st);
    *size = n;
    return b->p;
}

static tm__arena *data_arena(tm_ctx *ctx, tm_device dev) {
    if (dev.type == TM_DEVICE_CPU) return &ctx->arena[TM__CPU];
    if (dev.type == TM_DEVICE_CUDA && ctx->be[TM__CUDA] && dev.index == ctx->cuda_device) return &ctx->arena[TM__CUDA];
    return NULL;
}

/* A block given back is free at once, its bytes ready for the next request.
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
    tm__block *b = map_take(a, p);
    if (!b) return; /* not a live block of this arena (already given back, or before a reset) */
    count_used(ctx, a, -(ptrdiff_t)b->size);
    HOST_POISON(a, b->p, b->size);
    block_free(a, b);
}

/* Every chunk one free block again. If the step had to add chunks, they all go back and one
 * chunk of the size the step needed replaces them: the in-use peak plus an eighth, and never
 * less than the step held (fragmentation made it need that much). So a run whose shapes
 * change from step to step settles in one chunk a little above its largest step, and a run
 * whose steps repeat adds nothing after its first. */
void tm__arena_reset(tm_ctx *ctx, tm__arena *a) {
    for (int i = 0; i < a->n; i++) a->chunks[i].used = 0;
    a->cur = 0;
    if (!is_meta(ctx, a) && a->used) tm__mem_account(ctx, a->dev, TM_MEM_TEMPORARIES, -(ptrdiff_t)a->used);
    a->used = 0;
    if (is_meta(ctx, a)) return;

    /* every record back to the spare list, the table and the bins emptied */
    a->spare = NULL;
    for (int s = 0; s < a->n_slabs; s++)
        for (int i = 0; i < SLAB; i++) rec_put(a, &a->slabs[s][i]);
    if (a->map_cap) memset(a->map, 0, sizeof *a->map * a->map_cap);
    a->map_n = 0;
    memset(a->bins, 0, sizeof a->bins);
    memset(a->binmask, 0, sizeof a->binmask);

    if (a->grew && a->n > 1) {
        size_t q = (size_t)2 << 20;
        size_t want = a->step_peak + a->step_peak / 8;
        if (want < a->reserved) want = a->reserved;
        want = (want + q - 1) / q * q;
        for (int i = 0; i < a->n; i++) {
            HOST_UNPOISON(a, a->chunks[i].mem, a->chunks[i].size);
            chunk_mem_free(ctx, a, a->chunks[i].mem);
        }
        a->n = 0;
        a->reserved = 0;
        a->n_trims++;
        char msg[sizeof ctx->errmsg];
        memcpy(msg, ctx->errmsg, sizeof msg);
        /* no room for it (another allocation took the device's memory meanwhile): the next
         * step adds chunks as it needs them */
        if (!data_chunk_add(ctx, a, want)) memcpy(ctx->errmsg, msg, sizeof msg);
    } else {
        for (int i = 0; i < a->n; i++) {
            tm__block *b = rec_new(ctx, a); /* cannot fail: the records of the step are spare */
            tm__chunk *c = &a->chunks[i];
            b->p = c->mem;
            b->size = c->size;
            c->first = b;
            bin_insert(a, b);
        }
    }
    a->grew = 0;
    a->step_peak = 0;
}

void tm__arena_release(tm_ctx *ctx, tm__arena *a) {
    for (int i = 0; i < a->n; i++) {
        HOST_UNPOISON(a, a->chunks[i].mem, a->chunks[i].size);
        chunk_mem_free(ctx, a, a->chunks[i].mem);
    }
    tm__host_free(ctx, a->chunks);
    for (int s = 0; s < a->n_slabs; s++) tm__host_free(ctx, a->slabs[s]);
    tm__host_free(ctx, a->slabs);
    tm__host_free(ctx, a->map);
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
    if (!p) {
        const double mib = 1024.0 * 1024.0;
        tm__err(ctx, TM_ERR_NOMEM,
                "out of %s memory allocating %zu bytes (%.1f MiB): the step's temporaries hold %.1f MiB in use "
                "of %.1f MiB reserved in %d chunk%s, and the %s gave no more",
                dev.type == TM_DEVICE_CPU ? "host" : "device", nbytes, nbytes / mib, a->used / mib, a->reserved / mib,
                a->n, a->n == 1 ? "" : "s", dev.type == TM_DEVICE_CPU ? "host allocator" : "device");
    }
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
    void *p = meta_bump(ctx, a, n);
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
            tm__side_release(ctx, e.st);
            e.st->data = NULL;
        }
        tm__arena_free(ctx, ctx->arena[e.backend].dev, e.p, e.size);
    }
    ctx->scope_n = w;
}

void tm__scope_forget(tm_ctx *ctx, const tm_tensor *t) {
    if (!t || !t->storage || ctx->scope_depth <= 0) return;
    for (int i = ctx->scope_n - 1; i >= 0; i--)
        if (ctx->scope_log[i].st == t->storage) {
            /* in order: the entries above each open scope's mark stay its own */
            memmove(ctx->scope_log + i, ctx->scope_log + i + 1, sizeof *ctx->scope_log * (size_t)(ctx->scope_n - i - 1));
            ctx->scope_n--;
            return;
        }
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
