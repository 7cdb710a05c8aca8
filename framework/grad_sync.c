/*
 * grad_sync.c — the data-parallel gradient all-reduce run during the backward
 * (tm_comm_sync_grads_in_backward): PyTorch DDP's bucketed all-reduce that overlaps the backward
 * (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
 * section 3.2.3), Megatron-LM's overlap_grad_reduce.
 *
 * Without it tm_comm_sync_grads all-reduces each bucket after the last backward of a step, and
 * the whole all-reduce adds to the step (on 4 H200s the `fine` model's data-parallel step took 7
 * ms more than one GPU's, about its all-reduce). With it the armed backward starts each part of
 * the all-reduce as soon as the gradients it covers are final, beside the work that is left.
 *
 * Plan (gsync_plan, at the start of the armed backward, from the tape autograd.c is about to
 * walk, newest node first, node k = 0, 1, ...): a parameter's gradient is final after the
 * largest k of a node that reads it (src[]), the node nearest the start of the forward: every
 * contribution to its gradient comes from such a node (views of it included: their node reads
 * the parameter). The buckets tm_comm_sync_grads would all-reduce (ZeRO-0, a group of several
 * ranks, not sharded) are cut into chunks of tm_comm_options.grad_sync_chunk_bytes; a chunk is
 * ready at the largest final k of the parameters it overlaps (-1: none of them has a gradient
 * in this backward, ready at once).
 *
 * Order: collectives on a communicator must be issued in the same order by every rank, and the
 * tapes of two ranks need not hold the same nodes (data-dependent paths), so the order comes
 * from the model's construction, which every rank repeats: chunks go in decreasing order of
 * the first-registered parameter they overlap (ctx->named's order; a tie: the later bucket, the
 * later chunk), each when it and every chunk before it are ready. In a model whose forward uses
 * the parameters in their construction order, the first-registered parameter of a chunk is the
 * one the backward finishes last, so this is the order in which chunks become ready (the
 * largest index instead would make a chunk spanning layers 2 to 7 hold back layers 3 to 6's
 * expert chunks until the backward reached layer 2).
 *
 * Launch (gsync_progress, called by autograd.c before node k's backward with k - 1 done): an
 * in-place all-reduce of the chunk's range of the bucket's gradient buffer, on the side stream
 * where the engine has one for the group (NCCL with tm_comm_options.overlap: side.c's entry,
 * waited for by the work stream when the backward ends, tm__side_finish_all), in place on the
 * work stream elsewhere (CPU ranks, whose collectives block: the same calls at the same points).
 * Nothing written after a chunk's launch lands in it: its parameters' last writers ran before.
 * When every chunk of a bucket went, the bucket is marked done and tm_comm_sync_grads skips it.
 * Values: each element is the same sum over the same ranks as tm_comm_sync_grads makes; an
 * engine may pick another algorithm (and so summation order) for a chunk than for a whole
 * bucket, which on 3 or more ranks can change the last bit.
 */
#include "comm.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

typedef struct gsync_chunk {
    int bucket;
    int64_t lo, hi; /* bucket elements */
    int64_t ready;  /* the tape index after which it may go (-1: at once) */
    int key;        /* the smallest registration index of a parameter it overlaps (-1: none) */
} gsync_chunk;

struct tm__gsync {
    gsync_chunk *c;
    int n, cap, next; /* chunks, in launch order; next: the first not launched */
    int *left;        /* per bucket: chunks not launched (-1: the bucket is not synchronised here) */
    int n_left;
};

/* More pieces than this is a mistake of grad_sync_chunk_bytes (each is a collective and a side
 * entry, which side.c polls linearly at every new one): fine's 1.8 GB of bf16 gradients make 56
 * pieces of 32 MiB. */
enum { GSYNC_MAX_CHUNKS = 4096 };

/* What tm_comm_sync_grads all-reduces (ZeRO-0, a group of several ranks, not ZeRO-3's). */
static int reducible(tm_ctx *ctx, int bi) {
    const tm__bucket *b = ctx->buckets[bi];
    int g = tm__bucket_comm_group(ctx, bi);
    return !b->params_sharded && !tm__zero_enabled(ctx) && ctx->comm->size[g] > 1 && b->info.numel > 0;
}

/* ... and what an armed backward takes over: it has its gradient buffer, and its group can run
 * beside the work (a side communicator: NCCL; host memory, whose collectives block, too). An
 * engine without one (host-staged MPI for CUDA memory) would run every piece in place, a wait
 * each: slower than one all-reduce after the backward, which it is left to. */
static int eligible(tm_ctx *ctx, int bi) {
    const tm__bucket *b = ctx->buckets[bi];
    return reducible(ctx, bi) && b->grads.st.data != NULL &&
           tm__coll_side_group(ctx, tm__bucket_comm_group(ctx, bi), b->info.device);
}

static int64_t chunk_elems(const tm_ctx *ctx, const tm__bucket *b) {
    const int64_t cb = ctx->comm->opts.grad_sync_chunk_bytes > 0 ? ctx->comm->opts.grad_sync_chunk_bytes
                                                                  : TM__GRAD_SYNC_CHUNK_BYTES;
    const int64_t ce = cb / (int64_t)tm_dtype_size(b->info.dtype);
    return ce < 1 ? 1 : ce;
}

const char *tm__gsync_broken_why(const tm_ctx *ctx) {
    switch (ctx->gsync_broken) {
    case 1: return "the backward armed by tm_comm_sync_grads_in_backward failed after starting some of the gradient "
                   "all-reduces";
    case 2: return "a backward ran after the one armed by tm_comm_sync_grads_in_backward and before "
                   "tm_comm_sync_grads: it added this rank's gradients to the summed ones";
    default: return NULL;
    }
}

static int chunk_cmp(const void *a, const void *b) {
    const gsync_chunk *x = a, *y = b;
    if (x->key != y->key) return x->key > y->key ? -1 : 1;
    if (x->bucket != y->bucket) return x->bucket > y->bucket ? -1 : 1;
    return x->lo > y->lo ? -1 : x->lo < y->lo;
}

tm_status tm_comm_sync_grads_in_backward(tm_ctx *ctx) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!ctx->comm) return TM_OK;
    if (ctx->gsync_broken)
        return tm__err(ctx, TM_ERR_STATE, "tm_comm_sync_grads_in_backward: %s; zero the gradients (tm_ctx_zero_grad) "
                       "and redo the step", tm__gsync_broken_why(ctx));
    int64_t pieces = 0;
    for (int i = 0; i < ctx->n_buckets; i++) {
        if (!reducible(ctx, i)) continue;
        const int64_t ce = chunk_elems(ctx, ctx->buckets[i]);
        pieces += (ctx->buckets[i]->info.numel + ce - 1) / ce;
    }
    if (pieces > GSYNC_MAX_CHUNKS)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_comm_sync_grads_in_backward: tm_comm_options.grad_sync_chunk_bytes "
                       "= %lld cuts the gradients into %lld pieces, more than %d; use larger pieces",
                       (long long)ctx->comm->opts.grad_sync_chunk_bytes, (long long)pieces, GSYNC_MAX_CHUNKS);
    /* the side communicators of the groups involved: collective over each group, which every
     * rank reaches here at the same point */
    unsigned done = 0;
    for (int i = 0; i < ctx->n_buckets; i++) {
        if (!reducible(ctx, i)) continue;
        int g = tm__bucket_comm_group(ctx, i);
        if (done >> g & 1u) continue;
        done |= 1u << g;
        TM__TRY(tm__coll_side_prepare(ctx, g, ctx->buckets[i]->info.device));
    }
    ctx->gsync_armed = 1;
    return TM_OK;
}

void tm__gsync_disarm(tm_ctx *ctx) {
    ctx->gsync_armed = 0;
    ctx->gsync_broken = 0;
    for (int i = 0; i < ctx->n_buckets; i++) ctx->buckets[i]->gsync_done = 0;
    if (ctx->gsync) ctx->gsync->n = ctx->gsync->next = 0;
}

tm_status tm__gsync_plan(tm_ctx *ctx, const tm__node *tape) {
    /* a backward adds to the buckets: one all-reduced by the last backward and not yet taken by
     * tm_comm_sync_grads would now hold summed and local gradients, which nothing can undo */
    for (int i = 0; i < ctx->n_buckets; i++) {
        if (ctx->buckets[i]->gsync_done && !ctx->gsync_broken) ctx->gsync_broken = 2;
        ctx->buckets[i]->gsync_done = 0;
    }
    if (ctx->gsync) ctx->gsync->n = ctx->gsync->next = 0;
    if (!ctx->gsync_armed || !ctx->comm) return TM_OK;
    ctx->gsync_armed = 0;
    int any = 0;
    for (int i = 0; i < ctx->n_buckets && !any; i++) any = eligible(ctx, i);
    if (!any) return TM_OK;
    if (!ctx->gsync) {
        ctx->gsync = tm__host_alloc(ctx, sizeof *ctx->gsync);
        if (!ctx->gsync) return tm__err(ctx, TM_ERR_NOMEM, "gradient all-reduce during the backward: out of host memory");
        memset(ctx->gsync, 0, sizeof *ctx->gsync);
    }
    struct tm__gsync *s = ctx->gsync;
    /* each parameter's final node */
    for (int i = 0; i < ctx->n_named; i++)
        if (ctx->named[i]->is_param) ctx->named[i]->pm->gsync_k = -1;
    int64_t k = 0;
    for (const tm__node *n = tape; n; n = n->prev, k++)
        for (int i = 0; i < n->call.n_in; i++) {
            tm_tensor *p = n->call.src[i];
            if (p && p->is_param && p->requires_grad) p->pm->gsync_k = k; /* the last seen is the largest */
        }
    /* chunks (at most GSYNC_MAX_CHUNKS: checked when armed, options fixed since) */
    int total = 0;
    for (int i = 0; i < ctx->n_buckets; i++) {
        if (!eligible(ctx, i)) continue;
        const int64_t ce = chunk_elems(ctx, ctx->buckets[i]);
        total += (int)((ctx->buckets[i]->info.numel + ce - 1) / ce);
    }
    if (total > s->cap || ctx->n_buckets > s->n_left) {
        tm__host_free(ctx, s->c);
        tm__host_free(ctx, s->left);
        s->c = tm__host_alloc(ctx, sizeof *s->c * (size_t)total);
        s->left = tm__host_alloc(ctx, sizeof *s->left * (size_t)ctx->n_buckets);
        s->cap = s->c ? total : 0;
        s->n_left = s->left ? ctx->n_buckets : 0;
        if (!s->c || !s->left) return tm__err(ctx, TM_ERR_NOMEM, "gradient all-reduce during the backward: out of host "
                                              "memory for %d chunks", total);
    }
    int n = 0;
    for (int i = 0; i < ctx->n_buckets; i++) {
        s->left[i] = -1;
        if (!eligible(ctx, i)) continue;
        const tm__bucket *b = ctx->buckets[i];
        const int64_t ce = chunk_elems(ctx, b);
        int first = n;
        for (int64_t lo = 0; lo < b->info.numel; lo += ce)
            s->c[n++] = (gsync_chunk){i, lo, lo + ce < b->info.numel ? lo + ce : b->info.numel, -1, INT_MAX};
        s->left[i] = n - first;
        for (int r = 0; r < ctx->n_named; r++) {
            tm_tensor *p = ctx->named[r];
            if (!p->is_param || p->pm->bucket != i) continue;
            int64_t off = p->pm->bucket_offset, m = tm__numel(p);
            if (m == 0) continue;
            for (int64_t c = off / ce; c <= (off + m - 1) / ce && first + c < n; c++) {
                gsync_chunk *q = &s->c[first + c];
                if (p->pm->gsync_k > q->ready) q->ready = p->pm->gsync_k;
                if (r < q->key) q->key = r;
            }
        }
        for (int c = first; c < n; c++)
            if (s->c[c].key == INT_MAX) s->c[c].key = -1; /* padding only: last, ready at once */
    }
    s->n = n;
    s->next = 0;
    qsort(s->c, (size_t)n, sizeof *s->c, chunk_cmp);
    return TM_OK;
}

tm_status tm__gsync_progress(tm_ctx *ctx, int64_t done) {
    struct tm__gsync *s = ctx->gsync;
    if (!s) return TM_OK;
    while (s->next < s->n && s->c[s->next].ready <= done) {
        const gsync_chunk *q = &s->c[s->next++];
        tm__bucket *b = ctx->buckets[q->bucket];
        int g = tm__bucket_comm_group(ctx, q->bucket);
        tm_device dev = b->info.device;
        tm_dtype dt = b->info.dtype;
        char *p = (char *)b->grads.st.data + (size_t)q->lo * tm_dtype_size(dt);
        int side = tm__coll_side_group(ctx, g, dev);
        if (side) TM__TRY(tm__coll_side_begin(ctx, dev));
        tm_status st = tm__coll_allreduce(ctx, g, p, p, q->hi - q->lo, dt, dev);
        void *ev = NULL;
        if (side) {
            tm_status se = tm__coll_side_end_background(ctx, dev, &ev);
            if (st == TM_OK) st = se;
        }
        if (st != TM_OK) {
            (void)tm__coll_event_wait(ctx, dev, ev);
            return st;
        }
        /* nothing to hold or hand back: the gradient buffer is the bucket's, persistent */
        if (ev) TM__TRY(tm__side_add(ctx, dev, ev, NULL, NULL, 0, NULL, 0));
        if (--s->left[q->bucket] == 0) b->gsync_done = 1;
    }
    return TM_OK;
}

/* The backward ended: on success every chunk went (progress with the last index); on an error
 * part way the chunks started cannot be taken back, and tm_comm_sync_grads must not add them a
 * second time. */
void tm__gsync_end(tm_ctx *ctx, tm_status backward) {
    struct tm__gsync *s = ctx->gsync;
    if (!s || !s->n) return;
    if (backward != TM_OK && s->next > 0 && !ctx->gsync_broken) ctx->gsync_broken = 1;
    if (backward != TM_OK)
        for (int i = 0; i < ctx->n_buckets; i++) ctx->buckets[i]->gsync_done = 0;
    s->n = s->next = 0;
}

void tm__gsync_free(tm_ctx *ctx) {
    if (!ctx->gsync) return;
    tm__host_free(ctx, ctx->gsync->c);
    tm__host_free(ctx, ctx->gsync->left);
    tm__host_free(ctx, ctx->gsync);
    ctx->gsync = NULL;
}
