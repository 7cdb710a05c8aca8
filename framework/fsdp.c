/*
 * fsdp.c — ZeRO-3 (FSDP): parameters sharded like the optimizer state, all-gathered around
 * their use (include/tinymoe.h, tm_comm_options.zero; docs/layouts.md, "ZeRO").
 *
 * Layout. When the optimizer is made under zero = 3 (tm__zero3_shard_params), every bucket keeps
 * only this rank's ZeRO block [lo, hi) of its parameters (blk elements, the tail zero): the full
 * parameter buffer is given back. A parameter p of the bucket (elements [off, off + n)) overlaps
 * the blocks of one or more group ranks; its *piece* here is the overlap with [lo, hi), a 1-D
 * view of the block (possibly empty) whose gradient is the matching part of the bucket's
 * gradient shard (ZeRO-2's gshard, param.c). p itself is then a named tensor split in ZeRO
 * blocks (t->zs, framework/shard.c): checkpoints gather and scatter it like the optimizer state,
 * and any op that reads it directly is refused (dispatch.c), as are tm_tensor_read / _write.
 *
 * Use (tm__param_use, for layers/): w = reshape(allgather(piece of p over p's group)). The
 * all-gather is the collective op tm_comm_allgather (ragged counts: the pieces), so it is on the
 * tape and its backward, a reduce-scatter of w's gradient (ragged, as the pieces are), adds
 * each rank's sums into its piece's gradient, the shard. No full
 * gradient buffer exists at this level.
 *
 * Memory of the gathered weights. The caller gives them back once its layer's forward is done
 * (tm__param_done: the storage's arena block is freed). The backward needs them again: before
 * a tape node runs, autograd.c calls tm__fsdp_regather for each input whose storage is such a
 * gathered one without memory (the all-gather repeated, not taped), and after the all-gather's
 * own backward (the last reader in reverse order) the block is freed again. So a layer's
 * weights live while its forward runs and again while its backward runs. Every rank runs the
 * same tape in the same order, so the repeated all-gathers meet.
 *
 * The all-gather is tm_comm_allgather's op in its parameter form (iattr[1] = 1, iattr[2] the
 * parameter's place in ctx->named; ops/comm.c hands its check to tm__fsdp_gather_check): its counts come
 * from the layout every rank computes alike, so its check exchanges nothing (the general op
 * all-gathers the shapes over the host first), and its backward is a ragged reduce-scatter
 * straight to each piece's rank (the bytes of a reduce-scatter, where an all-reduce of the
 * whole gradient would move twice as many).
 *
 * Overlap: tm__param_prefetch is where the next layer's all-gathers would be started on a
 * communication stream (the GPU's part, not done: every collective here runs in place on the
 * work stream). On the CPU ranks the collectives are blocking host calls and nothing could
 * overlap.
 */
#include "comm.h"

#include <stdio.h>

/* How a gathered storage is filled again: the pieces of one parameter over its group. */
struct tm__fsdp_src {
    tm_tensor *piece;
    int group, G;
    int64_t *cd; /* counts [G], displacements [G] in elements (meta arena) */
    int counted; /* its bytes are counted as TM_MEM_PARAMETERS now (see `count`) */
};

/* A gathered weight's bytes count as parameters while it holds memory, not as temporaries, so
 * that the memory report (and --print-layout's peaks) show the all-gathers' transient bytes:
 * peak[TM_MEM_PARAMETERS] less current is the most gathered at once. Only where they are given
 * back during the step (mem_reuse, the default); the arena's own count is of its blocks, so the
 * bytes move between the categories, they are not counted twice. */
static void count(tm_ctx *ctx, tm__storage *st, int on) {
    struct tm__fsdp_src *src = st->fsdp;
    if (!ctx->mem_reuse || src->counted == on) return;
    ptrdiff_t n = (ptrdiff_t)st->nbytes;
    /* the decrease first, so that the total never passes through a false peak */
    tm__mem_account(ctx, st->device, on ? TM_MEM_TEMPORARIES : TM_MEM_PARAMETERS, -n);
    tm__mem_account(ctx, st->device, on ? TM_MEM_PARAMETERS : TM_MEM_TEMPORARIES, n);
    src->counted = on;
}

static int64_t overlap(int64_t off, int64_t n, int64_t a, int64_t b, int64_t *start) {
    int64_t s = off > a ? off : a, e = off + n < b ? off + n : b;
    if (start) *start = s;
    return e > s ? e - s : 0;
}

tm_status tm__zero3_shard_params(tm_ctx *ctx) {
    if (tm__zero_level(ctx) < 3) return TM_OK;
    for (int bi = 0; bi < ctx->n_buckets; bi++) {
        tm__bucket *b = ctx->buckets[bi];
        if (b->params_sharded) continue;
        TM__TRY(tm__bucket_grad_shard_ensure(ctx, bi));
        int g = tm__bucket_comm_group(ctx, bi);
        int64_t lo, hi, blk = tm__zero_block(ctx, bi);
        TM__TRY(tm_ctx_grad_shard(ctx, bi, &lo, &hi));
        size_t es = tm_dtype_size(b->info.dtype), nbytes = (size_t)blk * es;
        void *mem = tm__dev_alloc(ctx, b->info.device, nbytes ? nbytes : 1);
        if (!mem)
            return tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of %s memory for the %zu bytes of bucket %d's parameter block",
                           b->info.device.type == TM_DEVICE_CPU ? "host" : "device", nbytes, bi);
        tm_status s = tm__dev_memset0(ctx, b->info.device, mem, nbytes ? nbytes : 1);
        if (s == TM_OK && hi > lo)
            s = tm__memcpy(ctx, mem, b->info.device, (char *)b->params.st.data + (size_t)lo * es, b->info.device,
                           (size_t)(hi - lo) * es);
        /* headers first, so that nothing changes if one cannot be had */
        int np = 0;
        for (int k = 0; k < ctx->n_named; k++)
            if (ctx->named[k]->is_param && ctx->named[k]->pm->bucket == bi) np++;
        tm_tensor **pieces = tm__host_alloc(ctx, sizeof *pieces * 2 * (size_t)(np ? np : 1));
        tm__zshard **zs = tm__host_alloc(ctx, sizeof *zs * (size_t)(np ? np : 1));
        if (s == TM_OK && (!pieces || !zs)) s = tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of host memory");
        for (int k = 0; s == TM_OK && k < 2 * np; k++)
            if (!(pieces[k] = tm__host_alloc(ctx, sizeof **pieces))) s = tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of host memory");
        for (int k = 0; s == TM_OK && k < np; k++)
            if (!(zs[k] = tm__host_alloc(ctx, sizeof **zs))) s = tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of host memory");
        if (s != TM_OK) {
            tm__dev_free(ctx, b->info.device, mem);
            /* (the headers made so far are few bytes; they leak only on this error path) */
            return s;
        }
        tm__dev_free(ctx, b->info.device, b->params.st.data);
        tm__mem_account(ctx, b->info.device, TM_MEM_PARAMETERS, (ptrdiff_t)nbytes - (ptrdiff_t)b->params.used);
        /* the parameters' peak restarts from the blocks: from here on it measures the blocks
         * and the all-gathers (`count`), not the full buffer the model was built in */
        tm__mem_stats *ms = &ctx->mem[tm__backend(b->info.device)];
        ms->peak[TM_MEM_PARAMETERS] = ms->current[TM_MEM_PARAMETERS];
        b->params.st.data = mem;
        b->params.st.nbytes = nbytes ? nbytes : 1;
        b->params.st.sharded = 1;
        b->params_sharded = 1;
        b->params_lo = lo;
        b->params_hi = hi;
        /* the optimizer, pieces and flat views read the block through an unflagged alias */
        b->params_alias = b->params.st;
        b->params_alias.sharded = 0;
        tm__bucket_refresh_views(ctx, bi);
        int j = 0;
        for (int k = 0; k < ctx->n_named; k++) {
            tm_tensor *p = ctx->named[k];
            if (!p->is_param || p->pm->bucket != bi) continue;
            int64_t off = p->pm->bucket_offset, n = tm__numel(p), start;
            int64_t mine = overlap(off, n, lo, hi, &start);
            tm_tensor *pc = pieces[2 * j], *pg = pieces[2 * j + 1];
            memset(pc, 0, sizeof *pc);
            pc->ctx = ctx;
            pc->dtype = p->dtype;
            pc->device = p->device;
            pc->ndim = 1;
            pc->shape[0] = mine;
            pc->stride[0] = 1;
            pc->offset = mine ? start - lo : 0;
            pc->storage = &b->params_alias;
            pc->persistent = 1;
            pc->requires_grad = 1;
            pc->name = "";
            *pg = *pc;
            pg->requires_grad = 0;
            pg->storage = &b->gshard.st;
            pc->grad = pg;
            p->pm->piece = pc;
            tm__named_attach_zero(ctx, p, zs[j], g, off, blk, lo, hi);
            p->offset = 0; /* shard.c: element e of the bucket sits at storage + (e - lo) */
            j++;
        }
        tm__host_free(ctx, pieces);
        tm__host_free(ctx, zs);
    }
    return TM_OK;
}

/* Counts and displacements of p's pieces over its group. */
static tm_status piece_counts(tm_ctx *ctx, const tm_tensor *p, int G, int64_t **out) {
    tm__bucket *b = ctx->buckets[p->pm->bucket];
    int64_t *cd = tm__meta_alloc(ctx, sizeof(int64_t) * 2 * (size_t)G), acc = 0;
    if (!cd) return TM_ERR_NOMEM;
    int64_t blk = p->zs->blk, n = tm__numel(p), size = b->info.numel;
    for (int j = 0; j < G; j++) {
        int64_t a = j * blk < size ? j * blk : size, e = (j + 1) * blk < size ? (j + 1) * blk : size;
        cd[j] = overlap(p->pm->bucket_offset, n, a, e, NULL);
        cd[G + j] = acc;
        acc += cd[j];
    }
    if (acc != n)
        return tm__err(ctx, TM_ERR_INTERNAL, "ZeRO-3: the blocks cover %lld of the %lld elements of \"%s\"", (long long)acc,
                       (long long)n, p->name);
    *out = cd;
    return TM_OK;
}

int tm__param_sharded(const tm_tensor *p) { return p && p->is_param && p->pm && p->pm->piece; }

tm_status tm__param_use(tm_ctx *ctx, tm_tensor *p, tm_tensor **w) {
    if (!tm__param_sharded(p)) {
        *w = p;
        return TM_OK;
    }
    int g = p->zs->group, G = tm_comm_size(ctx, (tm_comm_group)g), k = tm__names_find(ctx, p->name);
    if (k < 0) return tm__err(ctx, TM_ERR_INTERNAL, "ZeRO-3: \"%s\" is not a named tensor", p->name);
    int64_t *cd = NULL;
    TM__TRY(piece_counts(ctx, p, G, &cd));
    tm__call c = tm__call_init(ctx, TM__OP_COMM_ALLGATHER);
    c.n_in = 1;
    c.in[0] = p->pm->piece;
    c.iattr[0] = g;
    c.iattr[1] = 1; /* the parameter form (top of this file) */
    c.iattr[2] = k;
    tm_tensor *flat;
    TM__TRY(tm__op_run1(&c, &flat));
    struct tm__fsdp_src *src = tm__meta_alloc(ctx, sizeof *src);
    if (!src) return TM_ERR_NOMEM;
    src->piece = p->pm->piece;
    src->group = g;
    src->G = G;
    src->cd = cd;
    src->counted = 0;
    flat->storage->fsdp = src;
    count(ctx, flat->storage, 1);
    int64_t shape[TM_MAX_DIMS];
    for (int d = 0; d < p->ndim; d++) shape[d] = p->shape[d];
    return tm_reshape(ctx, flat, p->ndim, shape, w);
}

void tm__param_done(tm_ctx *ctx, tm_tensor *w) {
    if (!w || !w->storage || !w->storage->fsdp || !w->storage->data || w->persistent || !ctx->mem_reuse) return;
    count(ctx, w->storage, 0);
    tm__tensor_release(ctx, w);
}

/* ---- the all-gather op's parameter form (ops/comm.c) -------------------------------------- */

static const tm_tensor *form_param(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    int64_t k = c->iattr[2];
    if (k < 0 || k >= ctx->n_named || !tm__param_sharded(ctx->named[k]) || ctx->named[k]->pm->piece != c->src[0])
        return NULL;
    return ctx->named[k];
}

tm_status tm__fsdp_gather_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *p = form_param(c);
    if (!p)
        return tm__err(ctx, TM_ERR_INTERNAL, "%s: the parameter form's input is no ZeRO-3 piece of parameter %lld",
                       tm__opname(c), (long long)c->iattr[2]);
    int G = tm_comm_size(ctx, (tm_comm_group)c->iattr[0]);
    int64_t *cd, gl = G, numel = tm__numel(p);
    TM__TRY(piece_counts(ctx, p, G, &cd));
    tm_tensor *counts; /* the saved row counts of the general form (pieces are 1-D: elements) */
    TM__TRY(tm__tensor_new(ctx, TM_I64, 1, &gl, tm_cpu(), &counts));
    memcpy(tm__data(counts), cd, sizeof(int64_t) * (size_t)G);
    c->saved[c->n_saved++] = counts;
    return tm__out_new(c, 0, p->dtype, 1, &numel);
}

tm_status tm__param_prefetch(tm_ctx *ctx, tm_tensor *const *params, int n) {
    /* CPU ranks: blocking host collectives, nothing to start early (see the top). */
    (void)ctx, (void)params, (void)n;
    return TM_OK;
}

tm_status tm__fsdp_regather(tm_ctx *ctx, tm__storage *st) {
    struct tm__fsdp_src *src = st->fsdp;
    if (!src || st->data) return TM_OK;
    TM__TRY(tm__arena_alloc_storage(ctx, st));
    count(ctx, st, 1);
    const tm_tensor *pc = src->piece;
    return tm__coll_allgatherv(ctx, src->group, tm__data(pc), st->data, src->cd, src->cd + src->G, pc->dtype, pc->device);
}
