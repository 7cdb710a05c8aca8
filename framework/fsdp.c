/*
 * fsdp.c — ZeRO-3 (FSDP): parameters sharded like the optimizer state, all-gathered around
 * their use, one unit at a time (include/tinymoe.h, tm_comm_options.zero and "Units";
 * docs/layouts.md, "ZeRO").
 *
 * Layout. Under ZeRO-3 buckets are keyed by unit as well (param.c): a unit (a layer, for the
 * model) of one dtype and group is one bucket. When the optimizer is made
 * (tm__zero3_shard_params) every bucket keeps only this rank's ZeRO block [lo, hi) of its
 * parameters: blk elements, the tail zero; the full buffer is given back. A parameter p (bucket
 * elements [off, off + n)) is then a named tensor split in ZeRO blocks (t->zs, framework/shard.c):
 * checkpoints gather and scatter it like the optimizer state, and any op that reads it directly is
 * refused (dispatch.c), as are tm_tensor_read / _write. This is PyTorch FSDP1's FlatParameter:
 * the unit's G blocks are equal, so its all-gather is one ncclAllGather of blk elements a rank,
 * straight into the gathered buffer whose element e is bucket element e, and its gradient's
 * reduce-scatter one ncclReduceScatter back into this rank's gradient shard (ZeRO-2's gshard).
 * Every rank sends and receives the same bytes (a bucket split by parameter would make the
 * rank holding a whole weight broadcast it: 4/3 of the link bytes on 4 GPUs), and a layer is
 * three collectives a direction, not one per weight (30 for the coarse preset's layer).
 *
 * Use (tm__param_use, for layers/): the first use of a unit in a forward runs the all-gather op
 * (tm_comm_allgather's parameter form: input this rank's block, a 1-D tensor whose gradient is
 * the shard block; output the gathered unit [G blk]); every use is then a view of it (a slice
 * and a reshape, on the tape), so w's gradient flows to the gathered unit's gradient and the
 * op's backward reduce-scatters it into the shard. The unit stays gathered while any use is not
 * done (tm__param_done counts them down) and its memory goes back when the last one is.
 *
 * The unit's gradient. In the backward, every tensor on a gathered unit's storage that is
 * contiguous takes as its gradient the same elements of one flat gradient buffer of the unit
 * (tm__fsdp_grad_alias, from autograd.c, as the first contribution comes): the weight gradients
 * are written where the reduce-scatter reads them, and the views between a weight and the
 * gathered unit do nothing in the backward (tm__fsdp_view_grad_skip). A parameter's elements
 * not yet written in this backward are handed to an op that writes its gradient whole as fresh
 * (no zeroing: the dW GEMMs write with beta 0), or zeroed before any other op adds to them; at
 * the reduce-scatter, the elements nothing wrote (parameters without a gradient, the padding
 * between parameters, the tail) are zeroed. So the buffer is neither filled nor read back. The
 * first reduce-scatter of a unit after tm_ctx_zero_grad overwrites its shard (zero_grad leaves
 * it as it is); later ones in the same step are added; a shard no backward wrote is zeroed
 * before the clip or the optimizer reads it (tm__bucket_grads_settle).
 *
 * Resident units. A unit whose group has one rank (every unit of a one-rank run; the expert
 * units when ep_size is the world, whose expert-data-parallel groups have one rank) has nothing
 * to gather: its block is the whole bucket. Its weights are views of the block itself and their
 * gradients the same elements of the gradient shard (fresh for the first op since
 * tm_ctx_zero_grad that writes a weight's whole gradient, added otherwise): no copy, no
 * gathered buffer, no reduce (through session 12's first commit each was copied like a gather).
 *
 * Memory of the gathered units. A unit given back after its forward is gathered again for the
 * backward: before a tape node runs, autograd.c calls tm__fsdp_regather for each input whose
 * storage is a gathered unit without memory (the all-gather repeated, not taped), and after the
 * all-gather's own backward (the last reader in reverse order) the memory goes back again. So a
 * layer's weights live while its forward runs and again while its backward runs. Every rank
 * runs the same tape in the same order, so the repeated all-gathers meet.
 *
 * Kept units (tm_comm_options.zero3_keep_last; PyTorch FSDP2's reshard_after_forward = False,
 * which torchtitan sets for the last block). The backward starts with the weights the forward
 * gathered last, so giving them back only to gather them again at once is a repeated
 * all-gather and, as the backward starts, a wait with nothing to hide it behind. A unit used
 * while tm__param_keep is on (layers/model.c: the last layers, the final norm, the lm_head)
 * under grad mode is kept: its last tm__param_done gives nothing back and the backward finds it
 * gathered (tm__fsdp_regather: no gather, but the gathers ahead start from it as from one
 * gathered again). It goes back after its all-gather's backward as the others do, or at
 * tm_ctx_arena_reset when no backward came.
 *
 * Overlap (tm_comm_options.overlap, where the engine enqueues on a stream: NCCL; comm.h,
 * tm__coll_side_*). The collectives then run on a second stream beside the work, in PyTorch
 * FSDP's manner:
 *  - forward: tm__param_prefetch (layers/model.c: the next layer's units, as a layer starts)
 *    all-gathers into fresh buffers on the side stream; the all-gather op adopts the buffer and
 *    makes the work stream wait for it, so the gather ran during the previous layer's compute.
 *  - backward: the units gathered in the forward are listed in their order of use (`order`);
 *    when the backward gathers one again (tm__fsdp_regather), it starts the gathers of the ones
 *    before it on the side stream, as many bytes ahead as the largest forward prefetch of a
 *    layer (`window`: one layer; the lm_head's, which can be larger, does not count).
 *  - the gradients' reduce-scatters are started on the side stream and finished later (`red`):
 *    the work stream waits for one (and adds its result into the gradient shard where the shard
 *    was written already) only when it is done (polled at each new one), when eight are in
 *    flight, and at the end of the backward; the unit's gradient it reads is kept until then.
 * Memory given to a side collective is taken from the arena on the work stream's order before
 * the side stream is told to wait for that stream, and is read by the work only after waiting
 * for the collective's event: the ordering that makes arena reuse safe. Without overlap (the
 * CPU: blocking host collectives) everything runs in place and the values are the same.
 */
#include "comm.h"

#include <math.h>
#include <stdio.h>

/* A gathered unit's storage: how to fill it again, and its gradient in the backward. A resident
 * unit's (a group of one: nothing to gather) is its block's storage itself. */
struct tm__fsdp_src {
    int bucket;
    int resident; /* the block's own storage, used in place: never gathered nor given back */
    int users;    /* tm__param_use calls of this gather not yet done */
    int counted;  /* its bytes are counted as TM_MEM_PARAMETERS now (see `count`) */
    int keep;     /* kept from its forward to its backward (top of this file): until the backward meets it */
    void *ev;     /* a gather again started beside the work, not yet waited for (NULL: none) */
    tm_tensor *grad;          /* the unit's gradient [G blk] (arena), from its first contribution;
                               * resident: the gradient shard's block */
    unsigned char *written;   /* [n]: the parameter's elements of `grad` hold its gradient */
};

/* A unit: one bucket's parameters under ZeRO-3. */
typedef struct fsdp_unit {
    int sharded;            /* the bucket is (tm__zero3_shard_params) */
    int group, G;
    int64_t blk;            /* elements a rank (tm__zero_block) */
    tm_tensor block;        /* this rank's block [blk] (a view of params_alias; grad: block_grad) */
    tm_tensor block_grad;   /* [blk], the gradient shard (gshard) */
    int n;                  /* parameters, in bucket order (their element ranges) */
    int64_t *off, *len;
    uint64_t grad_epoch;    /* 1 + ctx->grad_epoch when the shard block was last written */
    tm__storage *live;      /* gathered in this forward and not given back; NULL: none */
    tm_tensor *live_t;      /* its gathered tensor [G blk] */
    tm_tensor *pf;          /* gathered ahead beside the work (tm__param_prefetch), not yet used */
    void *pf_ev;
    /* resident (a group of one, G = 1: the block is the whole bucket; the expert units when
     * ep_size is the world, every unit on one rank): the weights are views of the block and
     * their gradients go straight into the shard, which tm_ctx_zero_grad zeroes; nothing is
     * gathered, copied or reduced */
    struct tm__fsdp_src rsrc;
    uint64_t *epoch;        /* [n] resident: 1 + ctx->grad_epoch when the parameter's shard
                             * elements were last written (0: not since the shard was made) */
} fsdp_unit;

/* A gradient reduce-scatter in flight: into the shard block directly (t NULL), or into t (this
 * rank's block of the buffer reduced in place), added into gx when ev has happened; own[] (the
 * gradient it reads) kept until then. */
typedef struct fsdp_red {
    void *ev;
    tm_device dev;
    tm_tensor *t, *gx, *own[2];
} fsdp_red;

struct tm__fsdp {
    fsdp_unit *units; /* [n_units]: by bucket index */
    int n_units;
    tm__storage **order; /* units gathered by this forward, in order of first use */
    int n_order, cap_order, cursor;
    fsdp_red *red; /* oldest first */
    int n_red, cap_red;
    size_t window; /* bytes the backward gathers ahead: the largest forward prefetch */
};

enum { FSDP_MAX_RED = 8 };

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

static tm_status fsdp_state(tm_ctx *ctx, struct tm__fsdp **out) {
    if (!ctx->fsdp) {
        ctx->fsdp = tm__host_alloc(ctx, sizeof *ctx->fsdp);
        if (!ctx->fsdp) return tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of host memory");
        memset(ctx->fsdp, 0, sizeof *ctx->fsdp);
    }
    struct tm__fsdp *f = ctx->fsdp;
    /* (units hold pointers into themselves: the array never moves once one is sharded, and
     * param.c refuses a new bucket then) */
    if (f->n_units < ctx->n_buckets && tm__fsdp_sharded(ctx))
        return tm__err(ctx, TM_ERR_INTERNAL, "ZeRO-3: bucket %d made after the parameters were sharded", ctx->n_buckets - 1);
    if (f->n_units < ctx->n_buckets) {
        fsdp_unit *u = tm__host_alloc(ctx, sizeof *u * (size_t)ctx->n_buckets);
        if (!u) return tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of host memory");
        memset(u, 0, sizeof *u * (size_t)ctx->n_buckets);
        if (f->n_units) memcpy(u, f->units, sizeof *u * (size_t)f->n_units);
        tm__host_free(ctx, f->units);
        f->units = u;
        f->n_units = ctx->n_buckets;
    }
    *out = f;
    return TM_OK;
}

static fsdp_unit *unit_of(tm_ctx *ctx, int bucket) { return &ctx->fsdp->units[bucket]; }

int tm__fsdp_sharded(const tm_ctx *ctx) {
    const struct tm__fsdp *f = ctx->fsdp;
    for (int i = 0; f && i < f->n_units; i++)
        if (f->units[i].sharded) return 1;
    return 0;
}

/* A gathered unit's bytes count as parameters while it holds memory, not as temporaries, so
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

tm_status tm__zero3_shard_params(tm_ctx *ctx) {
    if (tm__zero_level(ctx) < 3) return TM_OK;
    struct tm__fsdp *f;
    TM__TRY(fsdp_state(ctx, &f));
    for (int bi = 0; bi < ctx->n_buckets; bi++) {
        tm__bucket *b = ctx->buckets[bi];
        if (b->params_sharded) continue;
        TM__TRY(tm__bucket_grad_shard_ensure(ctx, bi));
        int g = tm__bucket_comm_group(ctx, bi);
        int64_t lo, hi, blk = tm__zero_block(ctx, bi);
        TM__TRY(tm_ctx_grad_shard(ctx, bi, &lo, &hi));
        size_t es = tm_dtype_size(b->info.dtype), nbytes = (size_t)blk * es;
        int np = 0;
        for (int k = 0; k < ctx->n_named; k++)
            if (ctx->named[k]->is_param && ctx->named[k]->pm->bucket == bi) np++;
        /* host headers first, so that nothing changes if one cannot be had */
        int64_t *rng = tm__host_alloc(ctx, sizeof *rng * 3 * (size_t)(np ? np : 1));
        tm__zshard **zs = tm__host_alloc(ctx, sizeof *zs * (size_t)(np ? np : 1));
        tm_status s = rng && zs ? TM_OK : tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of host memory");
        for (int k = 0; s == TM_OK && k < np; k++)
            if (!(zs[k] = tm__host_alloc(ctx, sizeof **zs))) s = tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of host memory");
        void *mem = s == TM_OK ? tm__dev_alloc(ctx, b->info.device, nbytes ? nbytes : 1) : NULL;
        if (s == TM_OK && !mem)
            s = tm__err(ctx, TM_ERR_NOMEM, "ZeRO-3: out of %s memory for the %zu bytes of bucket %d's parameter block",
                        b->info.device.type == TM_DEVICE_CPU ? "host" : "device", nbytes, bi);
        if (s == TM_OK) s = tm__dev_memset0(ctx, b->info.device, mem, nbytes ? nbytes : 1);
        if (s == TM_OK && hi > lo)
            s = tm__memcpy(ctx, mem, b->info.device, (char *)b->params.st.data + (size_t)lo * es, b->info.device,
                           (size_t)(hi - lo) * es);
        if (s != TM_OK) {
            if (mem) tm__dev_free(ctx, b->info.device, mem);
            /* (the headers made so far are few bytes; they leak only on this error path) */
            tm__host_free(ctx, rng);
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
        /* the optimizer, the block tensor and the flat views read the block through an
         * unflagged alias */
        b->params_alias = b->params.st;
        b->params_alias.sharded = 0;
        tm__bucket_refresh_views(ctx, bi);
        fsdp_unit *u = unit_of(ctx, bi);
        memset(u, 0, sizeof *u);
        u->sharded = 1;
        u->group = g;
        u->G = tm_comm_size(ctx, (tm_comm_group)g);
        u->blk = blk;
        u->n = np;
        u->off = rng;
        u->len = rng + np;
        u->epoch = (uint64_t *)(rng + 2 * np);
        memset(u->epoch, 0, sizeof *u->epoch * (size_t)np);
        tm_tensor *t = &u->block, *tg = &u->block_grad;
        tm__flat_view(t, ctx, &b->params_alias, b->info.dtype, blk);
        tm__flat_view(tg, ctx, &b->gshard.st, b->info.dtype, blk);
        t->requires_grad = 1;
        t->grad = tg;
        if (u->G == 1 && !ctx->fsdp_gather_always) {
            u->rsrc.bucket = bi;
            u->rsrc.resident = 1;
            u->rsrc.grad = tg;
            b->params_alias.fsdp = &u->rsrc;
        }
        int j = 0;
        for (int k = 0; k < ctx->n_named; k++) {
            tm_tensor *p = ctx->named[k];
            if (!p->is_param || p->pm->bucket != bi) continue;
            u->off[j] = p->pm->bucket_offset;
            u->len[j] = tm__numel(p);
            p->pm->sharded = 1;
            tm__named_attach_zero(ctx, p, zs[j], g, p->pm->bucket_offset, blk, lo, hi);
            p->offset = 0; /* shard.c: element e of the bucket sits at storage + (e - lo) */
            j++;
        }
        tm__host_free(ctx, zs);
    }
    return TM_OK;
}

void tm__test_fsdp_gather_always(tm_ctx *ctx, int on) {
    if (ctx) ctx->fsdp_gather_always = on;
}

int tm__param_sharded(const tm_tensor *p) { return p && p->is_param && p->pm && p->pm->sharded; }

tm_status tm__fsdp_use_plan(tm_ctx *ctx, const tm_tensor *p, int *unit, int64_t *held, int64_t *gather,
                            int64_t *reduce) {
    *unit = -1;
    *held = *gather = *reduce = 0;
    if (!tm__param_sharded(p)) return TM_OK;
    const fsdp_unit *u = unit_of(ctx, p->pm->bucket);
    if (u->rsrc.resident) return TM_OK; /* nothing gathered or reduced */
    int64_t es = (int64_t)tm_dtype_size(p->dtype);
    *unit = p->pm->bucket;
    *held = u->G * u->blk * es;
    *gather = u->blk * es;
    *reduce = u->G * u->blk * es;
    return TM_OK;
}

/* All-gather unit u (this rank's block) into dst, beside the work when `side` (then *ev is the
 * event to wait for, NULL where the collective ran in place). */
static tm_status gather_into(tm_ctx *ctx, fsdp_unit *u, void *dst, int side, void **ev) {
    *ev = NULL;
    tm_device dev = u->block.device;
    int64_t *cd = tm__meta_alloc(ctx, sizeof(int64_t) * 2 * (size_t)u->G);
    if (!cd) return TM_ERR_NOMEM;
    for (int j = 0; j < u->G; j++) cd[j] = u->blk, cd[u->G + j] = j * u->blk; /* equal: one ncclAllGather */
    if (side) TM__TRY(tm__coll_side_begin(ctx, dev));
    tm_status s = tm__coll_allgatherv(ctx, u->group, tm__data(&u->block), dst, cd, cd + u->G, u->block.dtype, dev);
    if (side) {
        void *e = NULL;
        tm_status se = tm__coll_side_end(ctx, dev, &e);
        if (s == TM_OK) s = se;
        if (s == TM_OK) *ev = e;
        else if (e) (void)tm__coll_event_wait(ctx, dev, e);
    }
    return s;
}

/* The all-gather op of unit `bucket` (the parameter form of tm_comm_allgather): on the tape
 * under grad mode; its output's storage records how to gather it again. */
static tm_status unit_gather(tm_ctx *ctx, int bucket, fsdp_unit *u) {
    tm__call c = tm__call_init(ctx, TM__OP_COMM_ALLGATHER);
    c.n_in = 1;
    c.in[0] = &u->block;
    c.iattr[0] = u->group;
    c.iattr[1] = 1; /* the parameter form (top of this file) */
    c.iattr[2] = bucket;
    tm_tensor *flat;
    TM__TRY(tm__op_run1(&c, &flat));
    struct tm__fsdp_src *src = tm__meta_alloc(ctx, sizeof *src);
    if (!src) return TM_ERR_NOMEM;
    memset(src, 0, sizeof *src);
    src->bucket = bucket;
    flat->storage->fsdp = src;
    count(ctx, flat->storage, 1);
    if (ctx->grad_enabled) {
        struct tm__fsdp *f = ctx->fsdp;
        TM__TRY(grow(ctx, (void **)&f->order, &f->cap_order, f->n_order + 1, sizeof *f->order));
        f->order[f->n_order++] = flat->storage;
    }
    u->live = flat->storage;
    u->live_t = flat;
    return TM_OK;
}

tm_status tm__param_use(tm_ctx *ctx, tm_tensor *p, tm_tensor **w) {
    if (!tm__param_sharded(p)) {
        *w = p;
        return TM_OK;
    }
    struct tm__fsdp *f;
    TM__TRY(fsdp_state(ctx, &f));
    int bucket = p->pm->bucket;
    fsdp_unit *u = unit_of(ctx, bucket);
    int64_t off = p->pm->bucket_offset, shape[TM_MAX_DIMS];
    for (int d = 0; d < p->ndim; d++) shape[d] = p->shape[d];
    tm_tensor *flat;
    if (u->rsrc.resident) { /* a view of the block itself */
        TM__TRY(tm_slice(ctx, &u->block, 0, off, off + tm__numel(p), &flat));
        return tm_reshape(ctx, flat, p->ndim, shape, w);
    }
    if (!u->live || !u->live->data) TM__TRY(unit_gather(ctx, bucket, u));
    struct tm__fsdp_src *src = u->live->fsdp;
    /* kept only where something would give it back and a backward can come */
    if (ctx->fsdp_keep && ctx->grad_enabled && ctx->mem_reuse) src->keep = 1;
    TM__TRY(tm_slice(ctx, u->live_t, 0, off, off + tm__numel(p), &flat));
    TM__TRY(tm_reshape(ctx, flat, p->ndim, shape, w));
    src->users++;
    return TM_OK;
}

static void unit_release(tm_ctx *ctx, tm__storage *st) {
    struct tm__fsdp_src *src = st->fsdp;
    fsdp_unit *u = unit_of(ctx, src->bucket);
    if (u->live == st) u->live = NULL, u->live_t = NULL;
    if (src->ev) { /* a gather ahead still writing it (its readers skipped: no gradient came) */
        (void)tm__coll_event_wait(ctx, st->device, src->ev);
        src->ev = NULL;
    }
    if (!st->data || !ctx->mem_reuse) return;
    count(ctx, st, 0);
    /* the storage goes back as a tensor's would (every view of it with it) */
    tm_tensor t = {.ctx = ctx, .storage = st};
    tm__tensor_release(ctx, &t);
}

void tm__param_done(tm_ctx *ctx, tm_tensor *w) {
    if (!w || !w->storage || !w->storage->fsdp || w->persistent || !ctx->mem_reuse) return;
    struct tm__fsdp_src *src = w->storage->fsdp;
    if (src->resident) return;
    if (src->users > 0) src->users--;
    if (src->users > 0 || src->keep) return; /* another use holds it / until its backward */
    unit_release(ctx, w->storage);
}

int tm__param_keep(tm_ctx *ctx, int on) {
    int prev = ctx->fsdp_keep;
    ctx->fsdp_keep = on;
    return prev;
}

void tm__fsdp_gather_released(tm_ctx *ctx, tm_tensor *w) {
    if (!w || !w->storage || !w->storage->fsdp) return;
    w->storage->fsdp->keep = 0;
    w->storage->fsdp->users = 0;
    unit_release(ctx, w->storage);
}

tm_status tm__param_prefetch(tm_ctx *ctx, tm_tensor *const *params, int n, int sets_window) {
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        tm_tensor *p = params[i];
        /* CPU ranks (blocking host collectives) and overlap off: nothing to start early */
        if (!tm__param_sharded(p) || !tm__coll_side_on(ctx, p->device)) continue;
        struct tm__fsdp *f;
        TM__TRY(fsdp_state(ctx, &f));
        fsdp_unit *u = unit_of(ctx, p->pm->bucket);
        if (u->rsrc.resident || (u->live && u->live->data) || u->pf) continue; /* nothing to gather, gathered, or on its way */
        int64_t numel = u->G * u->blk;
        tm_tensor *flat;
        TM__TRY(tm__tensor_new(ctx, p->dtype, 1, &numel, p->device, &flat));
        TM__TRY(gather_into(ctx, u, tm__data(flat), 1, &u->pf_ev));
        u->pf = flat;
        bytes += (size_t)numel * tm_dtype_size(p->dtype);
    }
    if (sets_window && bytes && ctx->fsdp && bytes > ctx->fsdp->window) ctx->fsdp->window = bytes;
    return TM_OK;
}

/* ---- the all-gather op's parameter form (ops/comm.c) -------------------------------------- */

tm_status tm__fsdp_gather_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    int64_t bi = c->iattr[2];
    if (!ctx->fsdp || bi < 0 || bi >= ctx->fsdp->n_units || !unit_of(ctx, (int)bi)->sharded ||
        c->src[0] != &unit_of(ctx, (int)bi)->block)
        return tm__err(ctx, TM_ERR_INTERNAL, "%s: the parameter form's input is no ZeRO-3 block of bucket %lld",
                       tm__opname(c), (long long)bi);
    fsdp_unit *u = unit_of(ctx, (int)bi);
    if (u->pf) {
        c->out[0] = u->pf; /* filled beside the work: the forward waits for it */
        return TM_OK;
    }
    int64_t numel = u->G * u->blk;
    return tm__out_new(c, 0, u->block.dtype, 1, &numel);
}

tm_status tm__fsdp_gather_forward(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    fsdp_unit *u = unit_of(ctx, (int)c->iattr[2]);
    if (u->pf && u->pf == c->out[0]) {
        void *ev = u->pf_ev;
        u->pf = NULL;
        u->pf_ev = NULL;
        return tm__coll_event_wait(ctx, c->in[0]->device, ev);
    }
    void *ev;
    return gather_into(ctx, u, tm__data(c->out[0]), 0, &ev);
}

/* ---- the unit's gradient (autograd.c) ------------------------------------------------------ */

/* The elements of the unit gradient that are t's: t's layout over the gradient's storage. */
static tm_status alias_of(tm_ctx *ctx, const struct tm__fsdp_src *src, const tm_tensor *t, tm_tensor **out) {
    tm_tensor *a;
    TM__TRY(tm__tensor_view(ctx, src->grad, t->ndim, t->shape, t->stride, src->grad->offset + t->offset, &a));
    a->persistent = 1; /* the unit's buffer is given back by this file, not through its views */
    *out = a;
    return TM_OK;
}

static int is_alias(const struct tm__fsdp_src *src, const tm_tensor *t, const tm_tensor *g) {
    if (!g || !src->grad || g->storage != src->grad->storage || g->offset != src->grad->offset + t->offset ||
        g->ndim != t->ndim)
        return 0;
    for (int d = 0; d < t->ndim; d++)
        if (g->shape[d] != t->shape[d] || g->stride[d] != t->stride[d]) return 0;
    return 1;
}

static tm_status zero_range(tm_ctx *ctx, const struct tm__fsdp_src *src, int64_t a, int64_t b) {
    if (b <= a) return TM_OK;
    size_t es = tm_dtype_size(src->grad->dtype);
    return tm__dev_memset0(ctx, src->grad->device, (char *)tm__data(src->grad) + (size_t)a * es, (size_t)(b - a) * es);
}

int tm__fsdp_grad_alias(tm__call *c, int i, tm_status *st) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *s = c->src[i];
    struct tm__fsdp_src *src = s->storage->fsdp;
    *st = TM_OK;
    if (!tm__is_contiguous(s) || (s->grad && !is_alias(src, s, s->grad))) return 0;
    fsdp_unit *u = unit_of(ctx, src->bucket);
    int res = src->resident;
    if (!src->grad) { /* (a resident unit's is the shard block, always there) */
        int64_t numel = u->G * u->blk;
        if ((*st = tm__tensor_new(ctx, s->dtype, 1, &numel, s->device, &src->grad)) != TM_OK) return 1;
        if (!(src->written = tm__meta_alloc(ctx, (size_t)(u->n ? u->n : 1)))) return *st = TM_ERR_NOMEM, 1;
        memset(src->written, 0, (size_t)(u->n ? u->n : 1));
        /* test hook: what nothing writes must be zeroed before the reduce-scatter reads it */
        if (ctx->fresh_poison && (*st = tm__fill(ctx, src->grad, NAN)) != TM_OK) return 1;
    }
    if (!s->grad && (*st = alias_of(ctx, src, s, &s->grad)) != TM_OK) return 1;
    /* The parameters s covers that hold no contribution yet: in this gather's buffer (garbage
     * until written), or for a resident unit in the shard since tm_ctx_zero_grad (zeros). This
     * op writes one whole when it writes its gradients whole and s is exactly that parameter
     * (fresh); otherwise it adds, into elements zeroed first where they are garbage. */
    int64_t a = s->offset, b = a + tm__numel(s);
    int whole = (tm__op_table[c->op].flags & TM__OP_GRAD_WRITES) != 0;
    for (int j = 0; j < c->n_in; j++)
        if (j != i && c->src[j] == s) whole = 0;
    for (int j = 0; j < u->n; j++) {
        int64_t pa = u->off[j], pb = pa + u->len[j];
        if (pb <= a || pa >= b || (res ? u->epoch[j] == ctx->grad_epoch + 1 : src->written[j])) continue;
        if (res) u->epoch[j] = ctx->grad_epoch + 1;
        else src->written[j] = 1;
        if (whole && pa == a && pb == b) {
            c->gin_fresh[i] = 1;
            ctx->fresh_count++;
            if (res && ctx->fresh_poison && (*st = tm__fill(ctx, s->grad, NAN)) != TM_OK) return 1;
        } else if (!res && (*st = zero_range(ctx, src, pa, pb)) != TM_OK) {
            return 1;
        }
    }
    return 1;
}

int tm__fsdp_view_grad_skip(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *x = c->src[0], *o = c->out[0];
    struct tm__fsdp_src *src = x->storage ? x->storage->fsdp : NULL;
    if (!src || c->in[0] != x || o->storage != x->storage || !tm__is_contiguous(x) || !is_alias(src, o, o->grad) ||
        (x->grad && !is_alias(src, x, x->grad)))
        return 0;
    if (!x->grad && alias_of(ctx, src, x, &x->grad) != TM_OK) return 0;
    /* o's gradient is x's, in place: nothing to move */
    c->gout[0] = NULL;
    o->grad = NULL;
    return 1;
}

/* Zero what nothing wrote of the unit's gradient: parameters without a gradient, the padding
 * between parameters, the tail past the last. */
static tm_status zero_unwritten(tm_ctx *ctx, const fsdp_unit *u, const struct tm__fsdp_src *src) {
    int64_t z = 0; /* start of the run of unwritten elements */
    for (int j = 0; j < u->n; j++) {
        if (!src->written[j]) continue;
        TM__TRY(zero_range(ctx, src, z, u->off[j]));
        z = u->off[j] + u->len[j];
    }
    return zero_range(ctx, src, z, u->G * u->blk);
}

/* Finish the oldest reduce-scatter in flight: the work stream waits for it, its sums go into
 * the gradient shard where they did not land there, its buffers go back. */
static tm_status finish_red(tm_ctx *ctx) {
    struct tm__fsdp *f = ctx->fsdp;
    fsdp_red r = f->red[0];
    memmove(f->red, f->red + 1, sizeof *f->red * (size_t)--f->n_red);
    tm_status s = tm__coll_event_wait(ctx, r.dev, r.ev);
    if (s == TM_OK && r.t) s = tm__accumulate(ctx, r.gx, r.t, 1.0); /* r.t: a view of own[] */
    tm__tensor_release(ctx, r.own[0]);
    tm__tensor_release(ctx, r.own[1]);
    return s;
}

tm_status tm__fsdp_gather_backward(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *go = c->gout[0], *gx = c->gin[0];
    struct tm__fsdp *f = ctx->fsdp;
    fsdp_unit *u = unit_of(ctx, (int)c->iattr[2]);
    struct tm__fsdp_src *src = c->out[0]->storage->fsdp;
    /* the reduce-scatters that are done by now are finished first (no wait), and at most
     * FSDP_MAX_RED stay in flight */
    while (f->n_red && (f->n_red >= FSDP_MAX_RED || tm__coll_event_done(ctx, f->red[0].dev, f->red[0].ev)))
        TM__TRY(finish_red(ctx));
    /* What is reduced: the unit's gradient buffer, its unwritten elements zeroed; or the
     * upstream gradient where no view made the buffer (no weight of the unit got a gradient:
     * autograd's zeros), added into the buffer if both exist. */
    tm_tensor *send = go, *own[2] = {NULL, NULL};
    if (src && src->grad) {
        TM__TRY(zero_unwritten(ctx, u, src));
        if (go && !is_alias(src, c->out[0], go)) TM__TRY(tm__accumulate(ctx, src->grad, go, 1.0));
        send = src->grad;
        own[0] = src->grad;
        src->grad = NULL;
    }
    if (go && !go->persistent) own[1] = go; /* autograd's zeros, or a gradient no view made */
    /* The sums go straight into the shard block, overwriting it, if nothing wrote it since the
     * last tm_ctx_zero_grad (which leaves it as it was: tm__bucket_grads_settle), else into this
     * rank's block of the buffer
     * reduced (in place) and are added afterwards (a second micro-batch, a unit gathered twice
     * in one forward). A buffer taken here would be inside the kernel's scope (dispatch.c),
     * given back when the kernel returns while the side stream still writes it. */
    int direct = gx == &u->block_grad && u->grad_epoch != ctx->grad_epoch + 1;
    if (gx == &u->block_grad) u->grad_epoch = ctx->grad_epoch + 1;
    tm_tensor *t = NULL;
    if (!direct && gx) {
        int me = tm_comm_rank(ctx, (tm_comm_group)u->group);
        TM__TRY(tm__tensor_view(ctx, send, 1, &u->blk, (int64_t[]){1}, send->offset + me * u->blk, &t));
        t->persistent = 1; /* a view of `send`, which goes back as own[] */
    }
    int side = tm__coll_side_on(ctx, go->device);
    if (side) TM__TRY(tm__coll_side_begin(ctx, go->device));
    tm_status s = gx ? tm__coll_reduce_scatter(ctx, u->group, tm__data(send), tm__data(direct ? gx : t), u->blk,
                                               go->dtype, go->device)
                     : TM_OK;
    void *ev = NULL;
    if (side) {
        tm_status se = tm__coll_side_end(ctx, go->device, &ev);
        if (s == TM_OK) s = se;
    }
    /* the buffers are this file's now: the tape must not give them back (autograd.c's
     * release_node frees the gradients it still sees) */
    c->gout[0] = NULL;
    c->out[0]->grad = NULL;
    if (s != TM_OK || !ev) {
        if (ev) (void)tm__coll_event_wait(ctx, go->device, ev);
        if (s == TM_OK && t) s = tm__accumulate(ctx, gx, t, 1.0);
        tm__tensor_release(ctx, own[0]);
        tm__tensor_release(ctx, own[1]);
        return s;
    }
    TM__TRY(grow(ctx, (void **)&f->red, &f->cap_red, f->n_red + 1, sizeof *f->red));
    f->red[f->n_red++] = (fsdp_red){ev, go->device, t, gx, {own[0], own[1]}};
    return TM_OK;
}

int tm__fsdp_shard_overwritten(const tm_ctx *ctx, int bi) {
    const struct tm__fsdp *f = ctx->fsdp;
    return f && bi < f->n_units && f->units[bi].sharded && !f->units[bi].rsrc.resident;
}

tm_status tm__bucket_grads_settle(tm_ctx *ctx, int bi) {
    if (!tm__fsdp_shard_overwritten(ctx, bi)) return TM_OK;
    fsdp_unit *u = unit_of(ctx, bi);
    if (u->grad_epoch == ctx->grad_epoch + 1) return TM_OK; /* written since tm_ctx_zero_grad */
    tm__bucket *b = ctx->buckets[bi];
    TM__TRY(tm__dev_memset0(ctx, b->gshard.st.device, b->gshard.st.data, b->gshard.used));
    u->grad_epoch = ctx->grad_epoch + 1; /* zeros now: a later reduce of this epoch adds */
    return TM_OK;
}

tm_status tm__fsdp_backward_done(tm_ctx *ctx) {
    struct tm__fsdp *f = ctx->fsdp;
    tm_status s = TM_OK;
    while (f && f->n_red) {
        tm_status r = finish_red(ctx);
        if (s == TM_OK) s = r;
    }
    /* the forward's units are all given back by now (each after its all-gather's backward, or
     * at the arena reset): the next forward lists its own */
    if (f && f->n_order && !f->n_red) {
        int any = 0;
        for (int i = 0; i < f->n_order; i++) any |= f->order[i]->data != NULL && !f->order[i]->fsdp->keep;
        if (!any) f->n_order = f->cursor = 0;
    }
    return s;
}

/* Everything started beside the work is waited for and forgotten (tm_ctx_arena_reset: the
 * memory it used goes back; a failed step may have left some). */
void tm__fsdp_reset(tm_ctx *ctx) {
    struct tm__fsdp *f = ctx->fsdp;
    if (!f) return;
    (void)tm__fsdp_backward_done(ctx);
    /* What is still gathered (kept from a forward whose backward never came, left by a failed
     * forward or backward, or gathered without grad mode and not given back) goes back with the
     * arena: its bytes stop counting as parameters. */
    for (int i = 0; i < f->n_units; i++) {
        fsdp_unit *u = &f->units[i];
        if (u->pf) (void)tm__coll_event_wait(ctx, u->pf->device, u->pf_ev);
        u->pf = NULL;
        u->pf_ev = NULL;
        if (u->live && u->live->fsdp->counted) count(ctx, u->live, 0);
        u->live = NULL;
        u->live_t = NULL;
    }
    for (int i = 0; i < f->n_order; i++) {
        struct tm__fsdp_src *src = f->order[i]->fsdp;
        if (src->ev) {
            (void)tm__coll_event_wait(ctx, f->order[i]->device, src->ev);
            src->ev = NULL;
        }
        if (src->counted) count(ctx, f->order[i], 0);
        src->keep = 0;
        src->grad = NULL;
    }
    f->n_order = f->cursor = 0;
}

void tm__fsdp_free(tm_ctx *ctx) {
    struct tm__fsdp *f = ctx->fsdp;
    if (!f) return;
    tm__fsdp_reset(ctx);
    for (int i = 0; i < f->n_units; i++) tm__host_free(ctx, f->units[i].off);
    tm__host_free(ctx, f->units);
    tm__host_free(ctx, f->order);
    tm__host_free(ctx, f->red);
    tm__host_free(ctx, f);
    ctx->fsdp = NULL;
}

/* Fill a gathered unit's storage again (memory from the arena on the work stream's order). Its
 * bytes count as parameters from when it is used (here when in place; at the wait when gathered
 * ahead), as the forward's prefetches count from their adoption: the transient parameter
 * bytes are the weights in use, whatever is on its way beside them. */
static tm_status regather(tm_ctx *ctx, tm__storage *st, int side) {
    struct tm__fsdp_src *src = st->fsdp;
    TM__TRY(tm__arena_alloc_storage(ctx, st));
    if (!side) count(ctx, st, 1);
    return gather_into(ctx, unit_of(ctx, src->bucket), st->data, side, &src->ev);
}

/* The backward reached st: start the gathers of the units used before it in the forward (the
 * backward's next ones), up to the window's bytes ahead. */
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
        if (o->data) continue; /* gathered already (or on its way) */
        TM__TRY(regather(ctx, o, 1));
    }
    return TM_OK;
}

tm_status tm__fsdp_regather(tm_ctx *ctx, tm__storage *st) {
    struct tm__fsdp_src *src = st->fsdp;
    if (!src || src->resident) return TM_OK;
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
