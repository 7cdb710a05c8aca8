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
 * each rank's sums into its piece's gradient, the shard. No full gradient buffer exists at this
 * level.
 *
 * Memory of the gathered weights. The caller gives them back once its layer's forward is done
 * (tm__param_done: the storage's arena block is freed). The backward needs them again: before
 * a tape node runs, autograd.c calls tm__fsdp_regather for each input whose storage is such a
 * gathered one without memory (the all-gather repeated, not taped), and after the all-gather's
 * own backward (the last reader in reverse order) the block is freed again. So a layer's
 * weights live while its forward runs and again while its backward runs. Every rank runs the
 * same tape in the same order, so the repeated all-gathers meet.
 *
 * Kept weights (tm_comm_options.zero3_keep_last; PyTorch FSDP2's reshard_after_forward =
 * False, which torchtitan sets for the last block). The backward starts with the weights the
 * forward gathered last, so giving them back only to gather them again at once is a repeated
 * all-gather and, as the backward starts, a wait with nothing to hide it behind. While
 * tm__param_keep is on (layers/model.c: from the last layers' attention norms to the
 * lm_head), tm__param_use marks what it gathers under grad mode `keep`: tm__param_done leaves
 * it, and the backward finds it gathered (tm__fsdp_regather: no gather, but the gathers ahead
 * start from it as from one gathered again). It goes back after its all-gather's backward as
 * the others do (tm__fsdp_gather_released), or at tm_ctx_arena_reset when no backward came.
 * The bits are the same: the gather is the one the backward would repeat.
 *
 * The all-gather is tm_comm_allgather's op in its parameter form (iattr[1] = 1, iattr[2] the
 * parameter's place in ctx->named; ops/comm.c hands it to tm__fsdp_gather_*): its counts come
 * from the layout every rank computes alike, so its check exchanges nothing, and its backward
 * is a ragged reduce-scatter straight to each piece's rank (the bytes of a reduce-scatter,
 * where an all-reduce of the whole gradient would move twice as many).
 *
 * Overlap (tm_comm_options.overlap, where the engine enqueues on a stream: NCCL; comm.h,
 * tm__coll_side_*). The collectives then run on a second stream beside the work, in PyTorch
 * FSDP's manner:
 *  - forward: tm__param_prefetch (layers/model.c: the next layer's weights, as a layer starts)
 *    all-gathers into fresh buffers on the side stream; the all-gather op of a parameter adopts
 *    its buffer and makes the work stream wait for it, so the gather ran during the previous
 *    layer's compute.
 *  - backward: the storages gathered in the forward are listed in their order of use
 *    (`order`); when the backward gathers one again (tm__fsdp_regather), it starts the gathers
 *    of the ones before it on the side stream, as many bytes ahead as the largest forward
 *    prefetch (one layer: `window`).
 *  - the gradients' reduce-scatters are started on the side stream and finished later (`red`):
 *    the work stream waits for one and adds its result into the gradient shard only when it is
 *    done (polled at each new one), when eight are in flight, and at the end of the backward;
 *    the full gradient it reads is kept until then.
 * Memory given to a side collective is taken from the arena on the work stream's order before
 * the side stream is told to wait for that stream, and is read by the work only after waiting
 * for the collective's event: the ordering that makes arena reuse safe. Without overlap (the
 * CPU: blocking host collectives) everything runs in place and the values are the same.
 */
#include "comm.h"

#include <stdio.h>

/* How a gathered storage is filled again: the pieces of one parameter over its group. */
struct tm__fsdp_src {
    tm_tensor *piece;
    int group, G;
    int64_t *cd; /* counts [G], displacements [G] in elements (meta arena) */
    int counted; /* its bytes are counted as TM_MEM_PARAMETERS now (see `count`) */
    int keep;    /* kept from its forward to its backward (top of this file): until the backward meets it */
    void *ev;    /* a gather again started beside the work, not yet waited for (NULL: none) */
};

/* A forward prefetch: p's all-gather started into `flat`, done at `ev`. */
typedef struct fsdp_pf {
    const tm_tensor *p;
    tm_tensor *flat;
    void *ev;
} fsdp_pf;

/* A gradient reduce-scatter in flight: t (the piece's sums, a view of this rank's block of go)
 * into gx when ev has happened; go (the full gradient, reduced in place) kept until then. */
typedef struct fsdp_red {
    void *ev;
    tm_device dev;
    tm_tensor *t, *gx, *go;
} fsdp_red;

struct tm__fsdp {
    fsdp_pf *pf;
    int n_pf, cap_pf;
    tm__storage **order; /* storages gathered by this forward, in order of use */
    int n_order, cap_order, cursor;
    fsdp_red *red; /* oldest first */
    int n_red, cap_red;
    size_t window; /* bytes the backward gathers ahead: the largest forward prefetch */
};

enum { FSDP_MAX_RED = 8 };

static tm_status fsdp_state(tm_ctx *ctx, struct tm__fsdp **out) {
    if (!ctx->fsdp) {
        ctx->fsdp = tm__host_alloc(ctx, sizeof *ctx->fsdp);
        if (!ctx->fsdp) return tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of host memory");
        memset(ctx->fsdp, 0, sizeof *ctx->fsdp);
    }
    *out = ctx->fsdp;
    return TM_OK;
}

/* Room for `need` elements of size es in *arr (host memory, doubled as it grows). */
static tm_status grow(tm_ctx *ctx, void **arr, int *cap, int need, size_t es) {
    if (need <= *cap) return TM_OK;
    int nc = *cap ? 2 * *cap : 16;
    while (nc < need) nc *= 2;
    void *n = tm__host_alloc(ctx, es * (size_t)nc);
    if (!n) return tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of host memory");
    if (*arr) {
        memcpy(n, *arr, es * (size_t)*cap);
        tm__host_free(ctx, *arr);
    }
    *arr = n;
    *cap = nc;
    return TM_OK;
}

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

/* What tm__param_use's all-gather (tm__coll_allgatherv: this rank's piece) and its backward's
 * reduce-scatter (tm__coll_reduce_scatterv: every piece) count, and the gathered weight's
 * bytes (`count`: its storage, numel elements). */
tm_status tm__fsdp_use_plan(tm_ctx *ctx, const tm_tensor *p, int64_t *held, int64_t *gather, int64_t *reduce) {
    *held = *gather = *reduce = 0;
    if (!tm__param_sharded(p)) return TM_OK;
    int G = tm_comm_size(ctx, (tm_comm_group)p->zs->group), me = tm_comm_rank(ctx, (tm_comm_group)p->zs->group);
    int64_t *cd = NULL, es = (int64_t)tm_dtype_size(p->dtype), all = 0;
    TM__TRY(piece_counts(ctx, p, G, &cd));
    for (int j = 0; j < G; j++) all += cd[j];
    *held = tm__numel(p) * es;
    *gather = cd[me] * es;
    *reduce = all * es;
    return TM_OK;
}

/* All-gather a piece over its group into dst, beside the work when `side` (then *ev is the
 * event to wait for, NULL where the collective ran in place). */
static tm_status gather_into(tm_ctx *ctx, const tm_tensor *piece, int g, int G, const int64_t *cd, void *dst,
                             int side, void **ev) {
    *ev = NULL;
    if (side) TM__TRY(tm__coll_side_begin(ctx, piece->device));
    tm_status s = tm__coll_allgatherv(ctx, g, tm__data(piece), dst, cd, cd + G, piece->dtype, piece->device);
    if (side) {
        void *e = NULL;
        tm_status se = tm__coll_side_end(ctx, piece->device, &e);
        if (s == TM_OK) s = se;
        if (s == TM_OK) *ev = e;
        else if (e) (void)tm__coll_event_wait(ctx, piece->device, e);
    }
    return s;
}

static fsdp_pf *find_pf(tm_ctx *ctx, const tm_tensor *p) {
    struct tm__fsdp *f = ctx->fsdp;
    for (int i = 0; f && i < f->n_pf; i++)
        if (f->pf[i].p == p) return &f->pf[i];
    return NULL;
}

static void drop_pf(tm_ctx *ctx, fsdp_pf *e) {
    struct tm__fsdp *f = ctx->fsdp;
    *e = f->pf[--f->n_pf];
}

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
    src->ev = NULL;
    /* kept only where something would give it back and a backward can come */
    src->keep = ctx->fsdp_keep && ctx->grad_enabled && ctx->mem_reuse;
    flat->storage->fsdp = src;
    count(ctx, flat->storage, 1);
    if (ctx->grad_enabled) {
        struct tm__fsdp *f;
        TM__TRY(fsdp_state(ctx, &f));
        if (!ctx->tape) f->n_order = f->cursor = 0; /* a new forward: the last backward is done */
        TM__TRY(grow(ctx, (void **)&f->order, &f->cap_order, f->n_order + 1, sizeof *f->order));
        f->order[f->n_order++] = flat->storage;
    }
    int64_t shape[TM_MAX_DIMS];
    for (int d = 0; d < p->ndim; d++) shape[d] = p->shape[d];
    return tm_reshape(ctx, flat, p->ndim, shape, w);
}

void tm__param_done(tm_ctx *ctx, tm_tensor *w) {
    if (!w || !w->storage || !w->storage->fsdp || !w->storage->data || w->persistent || !ctx->mem_reuse) return;
    if (w->storage->fsdp->keep) return; /* until its backward */
    count(ctx, w->storage, 0);
    tm__tensor_release(ctx, w);
}

int tm__param_keep(tm_ctx *ctx, int on) {
    int prev = ctx->fsdp_keep;
    ctx->fsdp_keep = on;
    return prev;
}

void tm__fsdp_gather_released(tm_ctx *ctx, tm_tensor *w) {
    if (w && w->storage && w->storage->fsdp) w->storage->fsdp->keep = 0;
    tm__param_done(ctx, w);
}

tm_status tm__param_prefetch(tm_ctx *ctx, tm_tensor *const *params, int n) {
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        tm_tensor *p = params[i];
        /* CPU ranks (blocking host collectives) and overlap off: nothing to start early */
        if (!tm__param_sharded(p) || !tm__coll_side_on(ctx, p->device) || find_pf(ctx, p)) continue;
        int g = p->zs->group, G = tm_comm_size(ctx, (tm_comm_group)g);
        int64_t *cd = NULL, numel = tm__numel(p);
        TM__TRY(piece_counts(ctx, p, G, &cd));
        struct tm__fsdp *f;
        TM__TRY(fsdp_state(ctx, &f));
        TM__TRY(grow(ctx, (void **)&f->pf, &f->cap_pf, f->n_pf + 1, sizeof *f->pf));
        tm_tensor *flat;
        TM__TRY(tm__tensor_new(ctx, p->dtype, 1, &numel, p->device, &flat));
        void *ev;
        TM__TRY(gather_into(ctx, p->pm->piece, g, G, cd, tm__data(flat), 1, &ev));
        f->pf[f->n_pf++] = (fsdp_pf){p, flat, ev};
        bytes += (size_t)numel * tm_dtype_size(p->dtype);
    }
    if (bytes && ctx->fsdp && bytes > ctx->fsdp->window) ctx->fsdp->window = bytes;
    return TM_OK;
}

/* ---- the all-gather op's parameter form (ops/comm.c) -------------------------------------- */

tm_status tm__fsdp_gather_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    if (c->iattr[2] < 0 || c->iattr[2] >= ctx->n_named || !tm__param_sharded(ctx->named[c->iattr[2]]) ||
        ctx->named[c->iattr[2]]->pm->piece != c->src[0])
        return tm__err(ctx, TM_ERR_INTERNAL, "%s: the parameter form's input is no ZeRO-3 piece of parameter %lld",
                       tm__opname(c), (long long)c->iattr[2]);
    const tm_tensor *p = ctx->named[c->iattr[2]];
    int G = tm_comm_size(ctx, (tm_comm_group)c->iattr[0]);
    int64_t *cd, gl = G, numel = tm__numel(p);
    TM__TRY(piece_counts(ctx, p, G, &cd));
    tm_tensor *counts;
    TM__TRY(tm__tensor_new(ctx, TM_I64, 1, &gl, tm_cpu(), &counts));
    memcpy(tm__data(counts), cd, sizeof(int64_t) * (size_t)G);
    c->saved[c->n_saved++] = counts;
    fsdp_pf *e = find_pf(ctx, p);
    if (e) {
        c->out[0] = e->flat; /* filled beside the work: the forward waits for it */
        return TM_OK;
    }
    return tm__out_new(c, 0, p->dtype, 1, &numel);
}

tm_status tm__fsdp_gather_forward(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *p = ctx->named[c->iattr[2]], *x = c->in[0];
    fsdp_pf *e = find_pf(ctx, p);
    if (e && e->flat == c->out[0]) {
        void *ev = e->ev;
        drop_pf(ctx, e);
        return tm__coll_event_wait(ctx, x->device, ev);
    }
    int g = (int)c->iattr[0], G = (int)c->saved[0]->shape[0];
    const int64_t *n = tm__data(c->saved[0]);
    int64_t *cd = tm__meta_alloc(ctx, sizeof(int64_t) * 2 * (size_t)G), acc = 0;
    if (!cd) return TM_ERR_NOMEM;
    for (int j = 0; j < G; j++) cd[j] = n[j], cd[G + j] = acc, acc += n[j];
    void *ev;
    return gather_into(ctx, x, g, G, cd, tm__data(c->out[0]), 0, &ev);
}

/* Finish the oldest reduce-scatter in flight: the work stream waits for it, its sums go into
 * the gradient shard, its buffers go back. */
static tm_status finish_red(tm_ctx *ctx) {
    struct tm__fsdp *f = ctx->fsdp;
    fsdp_red r = f->red[0];
    memmove(f->red, f->red + 1, sizeof *f->red * (size_t)--f->n_red);
    tm_status s = tm__coll_event_wait(ctx, r.dev, r.ev);
    if (s == TM_OK && r.gx) s = tm__accumulate(ctx, r.gx, r.t, 1.0); /* r.t: a view into r.go */
    tm__tensor_release(ctx, r.go);
    return s;
}

tm_status tm__fsdp_gather_backward(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0];
    tm_tensor *go = c->gout[0], *t;
    int g = (int)c->iattr[0];
    struct tm__fsdp *f;
    TM__TRY(fsdp_state(ctx, &f));
    /* the reduce-scatters that are done by now are finished first (no wait), and at most
     * FSDP_MAX_RED stay in flight */
    while (f->n_red && (f->n_red >= FSDP_MAX_RED || tm__coll_event_done(ctx, f->red[0].dev, f->red[0].ev)))
        TM__TRY(finish_red(ctx));
    /* The sums land in go itself, at this rank's block (an in-place reduce-scatter): a buffer
     * taken here would be inside the kernel's scope (dispatch.c), given back when the kernel
     * returns while the side stream still writes it, its data NULL when the sums are added.
     * (Session 8's illegal memory access on 2 H100s: found by reading, not yet rerun.) */
    const int64_t *cnt = tm__data(c->saved[0]);
    int G = (int)c->saved[0]->shape[0], me = tm_comm_rank(ctx, (tm_comm_group)g);
    int64_t before = 0;
    for (int j = 0; j < me; j++) before += cnt[j];
    if (!(t = tm__meta_alloc(ctx, sizeof *t))) return TM_ERR_NOMEM;
    *t = *go;
    t->ndim = 1;
    t->shape[0] = cnt[me];
    t->stride[0] = 1;
    t->offset = go->offset + before;
    t->grad = NULL;
    t->node = NULL;
    t->requires_grad = 0;
    (void)x, (void)G;
    /* The piece's gradient (a view of the shard) written since the last tm_ctx_zero_grad? If
     * not it holds zeros, and the sums go straight into it (no add kernel afterwards, which read
     * the sums and the shard and wrote the shard: 3 passes over this rank's share); the values
     * are those of 0 + sums. Where it was written (a second micro-batch, a weight used twice),
     * they land in go and are added. */
    tm__param_meta *pm = ctx->named[c->iattr[2]]->pm;
    tm_tensor *gx = c->gin[0];
    int direct = gx && pm && pm->grad_epoch != ctx->grad_epoch + 1 && gx->dtype == go->dtype &&
                 tm__numel(gx) == cnt[me] && tm__is_contiguous(gx);
    if (gx && pm) pm->grad_epoch = ctx->grad_epoch + 1;
    int side = tm__coll_side_on(ctx, go->device);
    if (side) TM__TRY(tm__coll_side_begin(ctx, go->device));
    tm_status s = tm__coll_reduce_scatterv(ctx, g, tm__data(go), tm__data(direct ? gx : t), tm__data(c->saved[0]),
                                           go->dtype, go->device);
    if (direct) gx = NULL; /* nothing left to add */
    void *ev = NULL;
    if (side) {
        tm_status se = tm__coll_side_end(ctx, go->device, &ev);
        if (s == TM_OK) s = se;
    }
    if (s != TM_OK) {
        if (ev) (void)tm__coll_event_wait(ctx, go->device, ev);
        return s;
    }
    if (!ev) return gx ? tm__accumulate(ctx, gx, t, 1.0) : TM_OK;
    TM__TRY(grow(ctx, (void **)&f->red, &f->cap_red, f->n_red + 1, sizeof *f->red));
    f->red[f->n_red++] = (fsdp_red){ev, go->device, t, gx, go};
    /* go is read beside the work until ev: the tape must not give it back (autograd.c's
     * release_node frees the gradients it still sees) */
    c->gout[0] = NULL;
    if (c->out[0]->grad == go) c->out[0]->grad = NULL;
    return TM_OK;
}

tm_status tm__fsdp_backward_done(tm_ctx *ctx) {
    struct tm__fsdp *f = ctx->fsdp;
    tm_status s = TM_OK;
    while (f && f->n_red) {
        tm_status r = finish_red(ctx);
        if (s == TM_OK) s = r;
    }
    return s;
}

/* Everything started beside the work is waited for and forgotten (tm_ctx_arena_reset: the
 * memory it used goes back; a failed step may have left some). */
void tm__fsdp_reset(tm_ctx *ctx) {
    struct tm__fsdp *f = ctx->fsdp;
    if (!f) return;
    (void)tm__fsdp_backward_done(ctx);
    for (int i = 0; i < f->n_pf; i++) (void)tm__coll_event_wait(ctx, f->pf[i].flat->device, f->pf[i].ev);
    for (int i = 0; i < f->n_order; i++)
        if (f->order[i]->fsdp && f->order[i]->fsdp->ev) {
            (void)tm__coll_event_wait(ctx, f->order[i]->device, f->order[i]->fsdp->ev);
            f->order[i]->fsdp->ev = NULL;
        }
    /* kept from a forward whose backward never came: the arena takes the memory back, so its
     * bytes stop counting as parameters */
    for (int i = 0; i < f->n_order; i++)
        if (f->order[i]->fsdp && f->order[i]->fsdp->keep) {
            f->order[i]->fsdp->keep = 0;
            if (f->order[i]->data) count(ctx, f->order[i], 0);
        }
    f->n_pf = f->n_order = f->cursor = 0;
}

void tm__fsdp_free(tm_ctx *ctx) {
    struct tm__fsdp *f = ctx->fsdp;
    if (!f) return;
    tm__fsdp_reset(ctx);
    tm__host_free(ctx, f->pf);
    tm__host_free(ctx, f->order);
    tm__host_free(ctx, f->red);
    tm__host_free(ctx, f);
    ctx->fsdp = NULL;
}

/* Fill a gathered storage again (memory from the arena on the work stream's order). Its bytes
 * count as parameters from when it is used (here when in place; at the wait when gathered
 * ahead), as the forward's prefetches count from their adoption: the transient parameter
 * bytes are the weights in use, whatever is on its way beside them. */
static tm_status regather(tm_ctx *ctx, tm__storage *st, int side) {
    struct tm__fsdp_src *src = st->fsdp;
    TM__TRY(tm__arena_alloc_storage(ctx, st));
    if (!side) count(ctx, st, 1);
    return gather_into(ctx, src->piece, src->group, src->G, src->cd, st->data, side, &src->ev);
}

/* The backward reached st: start the gathers of the storages used before it in the forward
 * (the backward's next ones), up to the window's bytes ahead. */
static tm_status gather_ahead(tm_ctx *ctx, tm__storage *st) {
    struct tm__fsdp *f = ctx->fsdp;
    if (!f || !f->window || !tm__coll_side_on(ctx, st->device)) return TM_OK;
    /* the backward meets them in about the reverse order: search down from the last one found */
    int i = f->cursor < f->n_order ? f->cursor : f->n_order - 1;
    while (i >= 0 && f->order[i] != st) i--;
    if (i < 0) i = f->n_order - 1;
    while (i >= 0 && f->order[i] != st) i--;
    if (i < 0) return TM_OK;
    f->cursor = i;
    size_t ahead = 0;
    for (int j = i - 1; j >= 0 && ahead < f->window; j--) {
        tm__storage *o = f->order[j];
        ahead += o->nbytes;
        if (o->data || !o->fsdp) continue; /* gathered already (or on its way) */
        TM__TRY(regather(ctx, o, 1));
    }
    return TM_OK;
}

tm_status tm__fsdp_regather(tm_ctx *ctx, tm__storage *st) {
    struct tm__fsdp_src *src = st->fsdp;
    if (!src) return TM_OK;
    if (src->ev) {
        void *ev = src->ev;
        src->ev = NULL;
        TM__TRY(tm__coll_event_wait(ctx, st->device, ev));
        count(ctx, st, 1);
    } else if (!st->data) {
        TM__TRY(regather(ctx, st, 0));
    } else if (src->keep) {
        /* kept from the forward: met for the first time in the backward, it is where the
         * gathers ahead start, as from one gathered again; from here on it is one of those */
        src->keep = 0;
    } else {
        return TM_OK;
    }
    return gather_ahead(ctx, st);
}
