/*
 * shard.c — named tensors whose logical value is spread over the ranks, gathered for
 * checkpoints and scattered back when one is loaded, so that a checkpoint holds the same
 * logical tensors whatever the layout (N ranks, ep_size, zero) that wrote or reads it.
 *
 * Two kinds of spreading compose:
 *  - expert shards (expert parallelism): a parameter holding experts [lo, hi) of E along dim 0
 *    (tm_param_options shard_axis 0), and the optimizer state that follows it (t->like). The
 *    ep group's ranks hold consecutive, equal shards: the logical tensor is their all-gather
 *    along dim 0.
 *  - ZeRO-1 blocks (t->zs): optimizer state and master weights of a bucket live in G equal
 *    blocks over the bucket's group; the tensor's elements [off, off + n) of the bucket are cut
 *    by the block boundaries, and its rank-local value is the all-gather of each rank's overlap
 *    in rank order.
 * Gathering applies the ZeRO step first (giving this rank's expert shard), then the expert step.
 */
#include "comm.h"

#include <stdio.h>

void tm__named_set_like(tm_tensor *t, const tm_tensor *param) {
    if (t) t->like = param;
}

void tm__named_attach_zero(tm_ctx *ctx, tm_tensor *t, struct tm__zshard *z, int group, int64_t off, int64_t blk, int64_t lo,
                           int64_t hi) {
    z->group = group;
    z->off = off;
    z->blk = blk;
    z->lo = lo;
    z->hi = hi;
    tm__host_free(ctx, t->zs);
    t->zs = z;
}

tm_status tm__named_set_zero(tm_ctx *ctx, tm_tensor *t, int group, int64_t off, int64_t blk, int64_t lo, int64_t hi) {
    tm__zshard *z = tm__host_alloc(ctx, sizeof *z);
    if (!z) return tm__err(ctx, TM_ERR_NOMEM, "ZeRO-1 shard of \"%s\": out of host memory", t->name);
    tm__named_attach_zero(ctx, t, z, group, off, blk, lo, hi);
    return TM_OK;
}

/* The parameter options that describe t's expert shard (its own, or its parameter's). */
static const tm_param_options *shard_opts(const tm_tensor *t) {
    const tm_tensor *p = t->like ? t->like : t;
    return p->pm && p->pm->opts.shard_axis == 0 ? &p->pm->opts : NULL;
}

static int expert_sharded(const tm_tensor *t) {
    const tm_param_options *o = shard_opts(t);
    return o && o->logical_shape[0] != t->shape[0];
}

int tm__named_sharded(const tm_ctx *ctx, const tm_tensor *t) {
    return (t->zs && tm_comm_size(ctx, (tm_comm_group)t->zs->group) > 1) ||
           (expert_sharded(t) && tm_comm_size(ctx, TM_COMM_EP) > 1);
}

void tm__named_logical(const tm_tensor *t, int *ndim, int64_t *shape) {
    *ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) shape[d] = t->shape[d];
    if (expert_sharded(t)) shape[0] = shard_opts(t)->logical_shape[0];
}

/* Overlap of the tensor's bucket range with group rank j's block. */
static int64_t overlap(const tm__zshard *z, int64_t n, int j, int64_t *start) {
    int64_t a = z->off > j * z->blk ? z->off : j * z->blk;
    int64_t b = z->off + n < (j + 1) * z->blk ? z->off + n : (j + 1) * z->blk;
    if (start) *start = a;
    return b > a ? b - a : 0;
}

/* This rank's (expert-local) value of t into dst (host). */
static tm_status local_value(tm_ctx *ctx, const tm_tensor *t, void *dst) {
    int64_t n = tm__numel(t);
    if (!t->zs) return tm_tensor_read(ctx, t, t->dtype, dst, n);
    const tm__zshard *z = t->zs;
    int g = z->group, G = tm_comm_size(ctx, (tm_comm_group)g), me = tm_comm_rank(ctx, (tm_comm_group)g);
    size_t es = tm_dtype_size(t->dtype);
    int64_t *cd = tm__meta_alloc(ctx, sizeof(int64_t) * 2 * (size_t)G), acc = 0;
    if (!cd) return TM_ERR_NOMEM;
    for (int j = 0; j < G; j++) {
        cd[j] = overlap(z, n, j, NULL);
        cd[G + j] = acc;
        acc += cd[j];
    }
    if (acc != n)
        return tm__err(ctx, TM_ERR_INTERNAL, "ZeRO-1 shard of \"%s\": blocks cover %lld of its %lld elements", t->name,
                       (long long)acc, (long long)n);
    int64_t start;
    int64_t mine = overlap(z, n, me, &start);
    /* this rank's piece, staged on the host */
    void *piece = tm__arena_alloc(ctx, tm_cpu(), (size_t)(mine ? mine : 1) * es);
    if (!piece) return TM_ERR_NOMEM;
    if (mine)
        TM__TRY(tm__memcpy(ctx, piece, tm_cpu(), (char *)t->storage->data + (t->offset + start - z->lo) * (int64_t)es,
                           t->device, (size_t)mine * es));
    if (G == 1) {
        memcpy(dst, piece, (size_t)n * es);
        return TM_OK;
    }
    return tm__coll_allgatherv(ctx, g, piece, dst, cd, cd + G, t->dtype, tm_cpu());
}

tm_status tm__named_gather(tm_ctx *ctx, const tm_tensor *t, void *dst) {
    int mark = tm__scope_open(ctx);
    int P = tm_comm_size(ctx, TM_COMM_EP);
    tm_status s;
    if (!expert_sharded(t) || P == 1) {
        s = local_value(ctx, t, dst);
    } else {
        /* ep ranks hold equal consecutive shards along dim 0, in ep-rank order */
        int64_t n = tm__numel(t);
        size_t es = tm_dtype_size(t->dtype);
        void *mine = tm__arena_alloc(ctx, tm_cpu(), (size_t)(n ? n : 1) * es);
        int64_t *cd = tm__meta_alloc(ctx, sizeof(int64_t) * 2 * (size_t)P);
        s = mine && cd ? local_value(ctx, t, mine) : TM_ERR_NOMEM;
        if (s == TM_OK) {
            for (int j = 0; j < P; j++) cd[j] = n, cd[P + j] = n * j;
            s = tm__coll_allgatherv(ctx, TM_COMM_EP, mine, dst, cd, cd + P, t->dtype, tm_cpu());
        }
    }
    tm__scope_close(ctx, mark, NULL, 0);
    return s;
}

tm_status tm__named_scatter(tm_ctx *ctx, tm_tensor *t, const void *src) {
    int64_t n = tm__numel(t);
    size_t es = tm_dtype_size(t->dtype);
    const char *local = src;
    if (expert_sharded(t)) local += (size_t)shard_opts(t)->shard_offset * (size_t)(n / (t->shape[0] ? t->shape[0] : 1)) * es;
    if (!t->zs) return tm_tensor_write(ctx, t, t->dtype, local, n);
    const tm__zshard *z = t->zs;
    int64_t start, mine = overlap(z, n, tm_comm_rank(ctx, (tm_comm_group)z->group), &start);
    if (!mine) return TM_OK;
    return tm__memcpy(ctx, (char *)t->storage->data + (t->offset + start - z->lo) * (int64_t)es, t->device,
                      local + (start - z->off) * (int64_t)es, tm_cpu(), (size_t)mine * es);
}

/* Where this rank's part of t lies: its logical element range [lo, lo + n) and its first
 * element in memory (the elements are contiguous there: a parameter, a ZeRO block's overlap,
 * optimizer state). Not sharded: the whole tensor. */
static void local_part(const tm_ctx *ctx, const tm_tensor *t, int64_t *lo, int64_t *n, int64_t *mem_off) {
    int64_t numel = tm__numel(t), base = 0;
    if (expert_sharded(t) && tm_comm_size(ctx, TM_COMM_EP) > 1)
        base = shard_opts(t)->shard_offset * (numel / (t->shape[0] ? t->shape[0] : 1));
    if (!t->zs) {
        *lo = base, *n = numel, *mem_off = t->offset;
        return;
    }
    const tm__zshard *z = t->zs;
    int64_t start, mine = overlap(z, numel, tm_comm_rank(ctx, (tm_comm_group)z->group), &start);
    *lo = base + (mine ? start - z->off : 0);
    *n = mine;
    *mem_off = t->offset + start - z->lo;
}

void tm__named_local_range(const tm_ctx *ctx, const tm_tensor *t, int64_t *lo, int64_t *n) {
    int64_t off;
    local_part(ctx, t, lo, n, &off);
}

tm_status tm__named_read_local(tm_ctx *ctx, const tm_tensor *t, int64_t from, int64_t count, void *dst) {
    int64_t lo, n, off;
    local_part(ctx, t, &lo, &n, &off);
    if (from < 0 || count < 0 || from + count > n)
        return tm__err(ctx, TM_ERR_INTERNAL, "\"%s\": elements [%lld, %lld) of this rank's %lld", t->name,
                       (long long)from, (long long)(from + count), (long long)n);
    if (!count) return TM_OK;
    size_t es = tm_dtype_size(t->dtype);
    return tm__memcpy(ctx, dst, tm_cpu(), (const char *)t->storage->data + (off + from) * (int64_t)es, t->device,
                      (size_t)count * es);
}
