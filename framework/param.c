/*
 * param.c — parameter groups and buckets (the contract is in tinymoe.h, "Parameter groups and
 * buckets"), f32 master weights, and the flat optimizer state that follows a bucket's layout.
 *
 * Layout of one bucket (device, dtype, group):
 *   params  [p0 | pad | p1 | pad | ...]   dtype, each parameter 64-byte aligned, creation order
 *   grads   [g0 | pad | g1 | pad | ...]   same offsets
 *   master  [m0 | pad | m1 | pad | ...]   f32, same element offsets (bf16 buckets under an optimizer)
 *   state   one flat f32 buffer per optimizer moment, same element offsets (tm__state_alloc)
 * Padding is zero everywhere and never written by backward, so a kernel may run over a whole
 * bucket or any [lo, hi) range of it. Buffers grow by doubling (the data moves; tensors keep
 * (storage, offset)), except between tm_ctx_defer_params and tm_ctx_materialize_params (what
 * tm_model_new does): there a parameter only takes its offset, and materializing allocates each
 * buffer once at its exact size. Growth by doubling copied a model of N bytes about log2(N / 1 MiB)
 * times and could hold 2N; under tm_ctx_options.no_grad_buffers the gradient buffers are never
 * made at all (a context that only runs forwards: eval, sampling, export).
 */
#include "extend.h"
#include "ctx_internal.h"

#include <stdio.h>

tm_param_options tm_param_options_default(void) {
    tm_param_options o;
    memset(&o, 0, sizeof o);
    o.group = TM_PARAM_DENSE;
    o.shard_axis = -1;
    return o;
}

/* ---- growable buffers ---------------------------------------------------------------------- */

/* Grow p to exactly cap bytes (cap > its capacity): the bytes in use move, the rest is zero. */
static tm_status pool_grow(tm_ctx *ctx, tm__pool *p, size_t cap) {
    void *mem = tm__dev_alloc(ctx, p->st.device, cap);
    if (!mem)
        return tm__err(ctx, TM_ERR_NOMEM, "out of %s memory growing a parameter buffer to %zu bytes",
                       p->st.device.type == TM_DEVICE_CPU ? "host" : "device", cap);
    /* (after a deferral `used` may exceed the old capacity: what lies past it is zero) */
    size_t keep = p->used < p->st.nbytes ? p->used : p->st.nbytes;
    tm_status s = TM_OK;
    if (keep) s = tm__memcpy(ctx, mem, p->st.device, p->st.data, p->st.device, keep);
    if (s == TM_OK) s = tm__dev_memset0(ctx, p->st.device, (char *)mem + keep, cap - keep);
    if (s != TM_OK) {
        tm__dev_free(ctx, p->st.device, mem);
        return s;
    }
    tm__dev_free(ctx, p->st.device, p->st.data);
    p->st.data = mem;
    p->st.nbytes = cap;
    return TM_OK;
}

static tm_status pool_reserve(tm_ctx *ctx, tm__pool *p, size_t need) {
    if (p->used + need <= p->st.nbytes) return TM_OK;
    /* deferred: the caller's `used` grows, the memory comes at tm_ctx_materialize_params */
    if (ctx->params_deferred) {
        if (p->used + need > p->want) p->want = p->used + need;
        return TM_OK;
    }
    size_t cap = p->st.nbytes ? p->st.nbytes : ((size_t)1 << 20);
    while (cap < p->used + need) cap *= 2;
    return pool_grow(ctx, p, cap);
}

void tm__flat_view(tm_tensor *t, tm_ctx *ctx, tm__storage *st, tm_dtype dt, int64_t numel) {
    memset(t, 0, sizeof *t);
    t->ctx = ctx;
    t->dtype = dt;
    t->device = st->device;
    t->ndim = 1;
    t->shape[0] = numel;
    t->stride[0] = 1;
    t->storage = st;
    t->persistent = 1;
    t->name = "";
}

static void flat_set(tm_tensor *t, tm_ctx *ctx, tm__pool *p, tm_dtype dt, int64_t numel) {
    tm__flat_view(t, ctx, &p->st, dt, numel);
}

static void bucket_refresh_views(tm_ctx *ctx, tm__bucket *b) {
    flat_set(&b->flat[TM_BUCKET_PARAMS], ctx, &b->params, b->info.dtype, b->info.numel);
    if (b->params_sharded) { /* ZeRO-3: the block, through the unflagged alias */
        b->flat[TM_BUCKET_PARAMS].shape[0] = b->params_hi - b->params_lo;
        b->flat[TM_BUCKET_PARAMS].storage = &b->params_alias;
    }
    flat_set(&b->flat[TM_BUCKET_GRADS], ctx, &b->grads, b->info.dtype, b->info.numel);
    if (b->has_master)
        flat_set(&b->flat[TM_BUCKET_MASTER], ctx, &b->master, TM_F32,
                 b->master_sharded ? b->master_hi - b->master_lo : b->info.numel);
}

/* ---- placing a parameter ------------------------------------------------------------------ */

static tm_status check_opts(tm_ctx *ctx, const char *fn, const char *name, const tm_tensor *t, tm_param_options *o) {
    if (o->group != TM_PARAM_DENSE && o->group != TM_PARAM_EXPERT)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: \"%s\": group %d is neither TM_PARAM_DENSE nor TM_PARAM_EXPERT", fn,
                       name, (int)o->group);
    if (o->group == TM_PARAM_EXPERT) {
        if (t->ndim < 1)
            return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: expert parameter \"%s\" needs experts along dim 0, got a scalar",
                           fn, name);
        if (o->expert_lo == 0 && o->expert_hi == 0) o->expert_hi = (int)t->shape[0];
        if (o->expert_lo < 0 || o->expert_hi - o->expert_lo != t->shape[0])
            return tm__err(ctx, TM_ERR_INVALID_ARG,
                           "%s: expert parameter \"%s\" %s: expert_lo %d .. expert_hi %d must span shape[0] = %lld", fn,
                           name, tm__sdesc(ctx, t->ndim, t->shape), o->expert_lo, o->expert_hi, (long long)t->shape[0]);
    } else {
        o->expert_lo = o->expert_hi = 0;
    }
    if (o->logical_ndim == 0) {
        o->logical_ndim = t->ndim;
        for (int i = 0; i < t->ndim; i++) o->logical_shape[i] = t->shape[i];
    }
    if (o->logical_ndim != t->ndim)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: \"%s\": logical_ndim %d differs from ndim %d", fn, name,
                       o->logical_ndim, t->ndim);
    if (o->shard_axis < -1 || o->shard_axis >= t->ndim)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: \"%s\": shard_axis %d outside [-1, %d)", fn, name, o->shard_axis,
                       t->ndim);
    for (int i = 0; i < t->ndim; i++) {
        if (i == o->shard_axis) {
            if (o->shard_offset < 0 || o->shard_offset + t->shape[i] > o->logical_shape[i])
                return tm__err(ctx, TM_ERR_INVALID_ARG,
                               "%s: \"%s\": the shard [%lld, %lld) of axis %d does not fit the logical size %lld", fn,
                               name, (long long)o->shard_offset, (long long)(o->shard_offset + t->shape[i]), i,
                               (long long)o->logical_shape[i]);
        } else if (o->logical_shape[i] != t->shape[i]) {
            return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: \"%s\": logical shape %s differs from shape %s on axis %d", fn,
                           name, tm__sdesc(ctx, o->logical_ndim, o->logical_shape), tm__sdesc(ctx, t->ndim, t->shape), i);
        }
    }
    if (o->shard_axis < 0) o->shard_offset = 0;
    return TM_OK;
}

/* The unit key of a parameter made now: its unit under ZeRO-3 (tinymoe.h, "Units": one bucket
 * per unit is what one all-gather serves), -1 (any) below. */
static int unit_key(const tm_ctx *ctx) { return tm__zero_level(ctx) >= 3 ? ctx->param_unit : -1; }

static int bucket_find(tm_ctx *ctx, tm_device dev, tm_dtype dt, const tm_param_options *o) {
    int unit = unit_key(ctx);
    for (int i = 0; i < ctx->n_buckets; i++) {
        const tm_bucket_info *b = &ctx->buckets[i]->info;
        if (tm__same_device(b->device, dev) && b->dtype == dt && b->group == o->group && b->expert_lo == o->expert_lo &&
            b->expert_hi == o->expert_hi && b->unit == unit)
            return i;
    }
    return -1;
}

static tm_status bucket_new(tm_ctx *ctx, const char *fn, tm_device dev, tm_dtype dt, const tm_param_options *o,
                            int *idx) {
    if (ctx->n_buckets == ctx->cap_buckets) {
        int cap = ctx->cap_buckets ? 2 * ctx->cap_buckets : 8;
        tm__bucket **nb = tm__host_alloc(ctx, sizeof *nb * (size_t)cap);
        if (!nb) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
        if (ctx->n_buckets) memcpy(nb, ctx->buckets, sizeof *nb * (size_t)ctx->n_buckets);
        tm__host_free(ctx, ctx->buckets);
        ctx->buckets = nb;
        ctx->cap_buckets = cap;
    }
    tm__bucket *b = tm__host_alloc(ctx, sizeof *b);
    if (!b) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    memset(b, 0, sizeof *b);
    b->info.device = dev;
    b->info.dtype = dt;
    b->info.group = o->group;
    b->info.expert_lo = o->expert_lo;
    b->info.expert_hi = o->expert_hi;
    b->info.unit = unit_key(ctx);
    b->params.st.device = b->grads.st.device = b->master.st.device = b->gshard.st.device = dev;
    b->grads_transient = tm__zero_level(ctx) >= 2;
    bucket_refresh_views(ctx, b);
    *idx = ctx->n_buckets;
    ctx->buckets[ctx->n_buckets++] = b;
    return TM_OK;
}

tm_status tm__param_place(tm_ctx *ctx, const char *fn, tm_tensor *t, const tm_param_options *opts) {
    tm_param_options o = opts ? *opts : tm_param_options_default();
    TM__TRY(check_opts(ctx, fn, t->name, t, &o));
    int bi = bucket_find(ctx, t->device, t->dtype, &o);
    if (bi < 0 && tm__fsdp_sharded(ctx))
        return tm__err(ctx, TM_ERR_STATE, "%s: \"%s\": the parameters are split over the ranks (ZeRO-3) already; "
                       "create every parameter before the optimizer", fn, t->name);
    if (bi < 0) TM__TRY(bucket_new(ctx, fn, t->device, t->dtype, &o, &bi));
    tm__bucket *b = ctx->buckets[bi];
    size_t esz = tm_dtype_size(t->dtype);
    size_t nbytes = (size_t)tm__numel(t) * esz;
    size_t padded = (nbytes + TM__ALIGN - 1) / TM__ALIGN * TM__ALIGN;
    size_t mpadded = padded / esz * sizeof(float); /* same element count in f32 */
    /* (refusals before any allocation: nothing to give back) */
    if (b->has_master && b->master_sharded)
        return tm__err(ctx, TM_ERR_STATE, "%s: \"%s\": its bucket's master weights are split over the ranks (ZeRO-1) "
                       "already; create every parameter before the optimizer", fn, t->name);
    if (b->grads_transient && (b->gshard.st.data || b->grads.st.data))
        return tm__err(ctx, TM_ERR_STATE, "%s: \"%s\": its bucket's gradients are split over the ranks (ZeRO-2) "
                       "already; create every parameter before the optimizer and the first backward", fn, t->name);
    int grads = !ctx->no_grad_buffers; /* tm_ctx_options.no_grad_buffers: no gradient at all */
    tm_tensor *g = grads ? tm__host_alloc(ctx, sizeof *g) : NULL;
    tm__param_meta *pm = tm__host_alloc(ctx, sizeof *pm);
    tm_tensor *mt = b->has_master ? tm__host_alloc(ctx, sizeof *mt) : NULL;
    tm_status s = ((grads && !g) || !pm || (b->has_master && !mt)) ? tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn) : TM_OK;
    if (s == TM_OK) s = pool_reserve(ctx, &b->params, padded);
    /* ZeRO-2: the gradient layout only; the memory comes with the first backward */
    if (s == TM_OK && grads && !b->grads_transient) s = pool_reserve(ctx, &b->grads, padded);
    if (s == TM_OK && b->has_master) s = pool_reserve(ctx, &b->master, mpadded);
    if (s != TM_OK) {
        tm__host_free(ctx, g);
        tm__host_free(ctx, pm);
        tm__host_free(ctx, mt);
        return s;
    }
    memset(pm, 0, sizeof *pm);
    pm->opts = o;
    pm->bucket = bi;
    pm->unit = ctx->param_unit;
    if (pm->unit >= ctx->param_unit_end) ctx->param_unit_end = pm->unit + 1;
    pm->bucket_offset = (int64_t)(b->params.used / esz);
    t->storage = &b->params.st;
    t->offset = pm->bucket_offset;
    b->params.used += padded;
    tm__mem_account(ctx, t->device, TM_MEM_PARAMETERS, (ptrdiff_t)padded);
    if (g) {
        if (!b->grads_transient) tm__mem_account(ctx, t->device, TM_MEM_GRADIENTS, (ptrdiff_t)padded);
        *g = *t;
        g->name = "";
        g->is_param = 0;
        g->requires_grad = 0;
        g->storage = &b->grads.st;
        g->offset = (int64_t)(b->grads.used / esz);
        b->grads.used += padded;
    }
    if (mt) { /* the master of a new (zero) parameter is zero: the pool's fresh bytes are */
        *mt = *t;
        mt->dtype = TM_F32;
        mt->name = "";
        mt->is_param = 0;
        mt->requires_grad = 0;
        mt->storage = &b->master.st;
        mt->offset = pm->bucket_offset;
        b->master.used += mpadded;
        tm__mem_account(ctx, t->device, TM_MEM_OPTIMIZER, (ptrdiff_t)mpadded);
        pm->master = mt;
    }
    t->grad = g;
    t->pm = pm;
    b->info.numel = (int64_t)(b->params.used / esz);
    b->info.num_params++;
    bucket_refresh_views(ctx, b);
    return TM_OK;
}

/* ---- deferred placement ----------------------------------------------------------------- */

tm_status tm_ctx_defer_params(tm_ctx *ctx) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (ctx->params_deferred)
        return tm__err(ctx, TM_ERR_STATE, "tm_ctx_defer_params: parameters are deferred already (call "
                       "tm_ctx_materialize_params first)");
    ctx->params_deferred = 1;
    return TM_OK;
}

int tm_ctx_params_deferred(const tm_ctx *ctx) { return ctx ? ctx->params_deferred : 0; }
int tm__ctx_no_grad_buffers(const tm_ctx *ctx) { return ctx->no_grad_buffers; }

/* Each buffer that parameters outgrew while deferred gets one allocation of exactly what they
 * use (the bytes it held before the deferral move; the rest is zero). A bucket whose buffer
 * cannot be had keeps the deferral, so the call can be repeated; buckets done stay done. */
tm_status tm_ctx_materialize_params(tm_ctx *ctx) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!ctx->params_deferred)
        return tm__err(ctx, TM_ERR_STATE, "tm_ctx_materialize_params: no tm_ctx_defer_params in force");
    for (int i = 0; i < ctx->n_buckets; i++) {
        tm__bucket *b = ctx->buckets[i];
        tm__pool *pools[3] = {&b->params, b->grads_transient ? NULL : &b->grads, b->has_master ? &b->master : NULL};
        for (int k = 0; k < 3; k++) {
            tm__pool *p = pools[k];
            if (!p) continue;
            size_t cap = p->used > p->want ? p->used : p->want;
            if (cap > p->st.nbytes) {
                tm_status s = pool_grow(ctx, p, cap);
                if (s != TM_OK) {
                    char msg[512]; /* tm__err writes where tm_ctx_errmsg points */
                    snprintf(msg, sizeof msg, "%s", tm_ctx_errmsg(ctx));
                    return tm__err(ctx, s, "tm_ctx_materialize_params: bucket %d (\"%s\" ...): %s", i,
                                   tm__bucket_first_param(ctx, i), msg);
                }
            }
            p->want = 0;
        }
        bucket_refresh_views(ctx, b);
    }
    ctx->params_deferred = 0;
    return TM_OK;
}

void tm__bucket_refresh_views(tm_ctx *ctx, int bi) { bucket_refresh_views(ctx, ctx->buckets[bi]); }

int64_t tm__bucket_params_offset(const tm_ctx *ctx, int bi) {
    const tm__bucket *b = ctx->buckets[bi];
    return b->params_sharded ? b->params_lo : 0;
}

tm_status tm__bucket_reserve(tm_ctx *ctx, int bi, int64_t n) {
    tm__bucket *b = ctx->buckets[bi];
    size_t es = tm_dtype_size(b->info.dtype), want = (size_t)n * es;
    if (!b->params_sharded && want > b->params.used) TM__TRY(pool_reserve(ctx, &b->params, want - b->params.used));
    if (!ctx->no_grad_buffers && !b->grads_transient && want > b->grads.used)
        TM__TRY(pool_reserve(ctx, &b->grads, want - b->grads.used));
    size_t mwant = (size_t)n * sizeof(float);
    if (b->has_master && mwant > b->master.used) TM__TRY(pool_reserve(ctx, &b->master, mwant - b->master.used));
    return TM_OK;
}

void tm__buckets_free(tm_ctx *ctx) {
    for (int i = 0; i < ctx->n_buckets; i++) {
        tm__bucket *b = ctx->buckets[i];
        tm__pool *pools[4] = {&b->params, &b->grads, &b->master, &b->gshard};
        for (int k = 0; k < 4; k++)
            if (pools[k]->st.data) tm__dev_free(ctx, pools[k]->st.device, pools[k]->st.data);
        tm__host_free(ctx, b);
    }
    tm__host_free(ctx, ctx->buckets);
    ctx->buckets = NULL;
    ctx->n_buckets = ctx->cap_buckets = 0;
}

/* ---- public queries ------------------------------------------------------------------------- */

tm_status tm_param_get_info(const tm_tensor *t, tm_param_info *out) {
    if (!t || !out) return TM_ERR_INVALID_ARG;
    if (!t->is_param || !t->pm)
        return tm__err(t->ctx, TM_ERR_INVALID_ARG, "tm_param_get_info: %s is not a parameter", tm__tdesc(t->ctx, t));
    out->opts = t->pm->opts;
    out->bucket = t->pm->bucket;
    out->bucket_offset = t->pm->bucket_offset;
    out->unit = t->pm->unit;
    return TM_OK;
}

tm_status tm_ctx_set_param_unit(tm_ctx *ctx, int unit) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (unit < 0) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_ctx_set_param_unit: unit = %d must be >= 0", unit);
    ctx->param_unit = unit;
    return TM_OK;
}

int tm_ctx_param_unit(const tm_ctx *ctx) { return ctx ? ctx->param_unit : 0; }

int tm__param_unit_end(const tm_ctx *ctx) { return ctx->param_unit_end; }

int tm_ctx_num_buckets(const tm_ctx *ctx) { return ctx ? ctx->n_buckets : 0; }

tm_status tm_ctx_bucket_info(const tm_ctx *ctx, int i, tm_bucket_info *out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out || i < 0 || i >= ctx->n_buckets)
        return tm__err((tm_ctx *)ctx, TM_ERR_INVALID_ARG, "tm_ctx_bucket_info: %s", out ? "bucket index out of range" : "out is NULL");
    *out = ctx->buckets[i]->info;
    out->has_master = ctx->buckets[i]->has_master;
    return TM_OK;
}

tm_tensor *tm_ctx_bucket_tensor(const tm_ctx *ctx, int i, tm_bucket_part part) {
    if (!ctx || i < 0 || i >= ctx->n_buckets || (unsigned)part > TM_BUCKET_MASTER) return NULL;
    tm__bucket *b = ctx->buckets[i];
    if (part == TM_BUCKET_MASTER && !b->has_master) return NULL;
    if (part == TM_BUCKET_GRADS && ctx->no_grad_buffers) return NULL;
    return &b->flat[part];
}

const char *tm__bucket_first_param(const tm_ctx *ctx, int bucket) {
    for (int k = 0; k < ctx->n_named; k++)
        if (ctx->named[k]->is_param && ctx->named[k]->pm->bucket == bucket) return ctx->named[k]->name;
    return "?";
}

tm_status tm_ctx_zero_grad(tm_ctx *ctx) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    ctx->grad_epoch++;
    tm__gsync_disarm(ctx); /* gradients all-reduced by a backward are zeros now */
    for (int i = 0; i < ctx->n_buckets; i++) {
        tm__bucket *b = ctx->buckets[i];
        if (b->grads_transient) {
            /* ZeRO-2: zero gradients are no full buffer (the next backward makes one, zeroed)
             * and a zero shard; a gathered ZeRO-3 unit's shard is zeroed only if no backward
             * overwrites it before it is read (tm__bucket_grads_settle) */
            tm__bucket_grads_release(ctx, i);
            if (b->gshard.used && !tm__fsdp_shard_overwritten(ctx, i))
                TM__TRY(tm__dev_memset0(ctx, b->gshard.st.device, b->gshard.st.data, b->gshard.used));
            continue;
        }
        if (b->grads.used && b->grads.st.data)
            TM__TRY(tm__dev_memset0(ctx, b->grads.st.device, b->grads.st.data, b->grads.used));
    }
    return TM_OK;
}

/* ---- ZeRO-2 gradients: a transient full buffer and a persistent shard ---------------------- */

tm_status tm__bucket_grads_materialize(tm_ctx *ctx) {
    for (int i = 0; i < ctx->n_buckets; i++) {
        tm__bucket *b = ctx->buckets[i];
        /* (ZeRO-3: the gathers' backward adds into the shard; no full buffer at all) */
        if (!b->grads_transient || b->params_sharded || b->grads.st.data || !b->grads.used) continue;
        size_t es = tm_dtype_size(b->info.dtype);
        /* G whole blocks: the reduce-scatter reads them all (the bytes past the parameters
         * stay zero) */
        int G = tm_comm_size(ctx, (tm_comm_group)tm__bucket_comm_group(ctx, i));
        size_t nbytes = (size_t)tm__zero_block(ctx, i) * (size_t)G * es;
        if (nbytes < b->grads.used) nbytes = b->grads.used;
        void *mem = tm__dev_alloc(ctx, b->info.device, nbytes);
        if (!mem)
            return tm__err(ctx, TM_ERR_NOMEM, "backward: out of %s memory for the %zu bytes of bucket %d's full gradient "
                           "buffer (ZeRO-2 makes it for each step's backward)",
                           b->info.device.type == TM_DEVICE_CPU ? "host" : "device", nbytes, i);
        tm_status s = tm__dev_memset0(ctx, b->info.device, mem, nbytes);
        if (s != TM_OK) {
            tm__dev_free(ctx, b->info.device, mem);
            return s;
        }
        b->grads.st.data = mem;
        b->grads.st.nbytes = nbytes;
        b->grads_acct = nbytes;
        tm__mem_account(ctx, b->info.device, TM_MEM_GRADIENTS, (ptrdiff_t)nbytes);
    }
    return TM_OK;
}

void tm__bucket_grads_release(tm_ctx *ctx, int bi) {
    tm__bucket *b = ctx->buckets[bi];
    if (!b->grads_transient || !b->grads.st.data) return;
    tm__dev_free(ctx, b->info.device, b->grads.st.data);
    b->grads.st.data = NULL;
    b->grads.st.nbytes = 0;
    tm__mem_account(ctx, b->info.device, TM_MEM_GRADIENTS, -(ptrdiff_t)b->grads_acct);
    b->grads_acct = 0;
}

tm_status tm__bucket_grad_shard_ensure(tm_ctx *ctx, int bi) {
    tm__bucket *b = ctx->buckets[bi];
    if (!b->grads_transient || b->gshard.st.data) return TM_OK;
    int64_t lo, hi, blk = tm__zero_block(ctx, bi);
    TM__TRY(tm_ctx_grad_shard(ctx, bi, &lo, &hi));
    size_t nbytes = (size_t)blk * tm_dtype_size(b->info.dtype);
    void *mem = tm__dev_alloc(ctx, b->info.device, nbytes ? nbytes : 1);
    if (!mem)
        return tm__err(ctx, TM_ERR_NOMEM, "ZeRO-2: out of %s memory for the %zu bytes of bucket %d's gradient shard",
                       b->info.device.type == TM_DEVICE_CPU ? "host" : "device", nbytes, bi);
    tm_status s = tm__dev_memset0(ctx, b->info.device, mem, nbytes ? nbytes : 1);
    if (s != TM_OK) {
        tm__dev_free(ctx, b->info.device, mem);
        return s;
    }
    b->gshard.st.data = mem;
    b->gshard.st.nbytes = nbytes ? nbytes : 1;
    b->gshard.used = nbytes;
    b->gshard_lo = lo;
    b->gshard_hi = hi;
    tm__mem_account(ctx, b->info.device, TM_MEM_GRADIENTS, (ptrdiff_t)nbytes);
    flat_set(&b->flat_gshard, ctx, &b->gshard, b->info.dtype, hi - lo);
    return TM_OK;
}

tm_tensor *tm__bucket_grads_reduced(tm_ctx *ctx, int bi, int64_t *off) {
    tm__bucket *b = ctx->buckets[bi];
    if (!b->grads_transient) {
        *off = 0;
        return &b->flat[TM_BUCKET_GRADS];
    }
    *off = b->gshard_lo;
    return b->gshard.st.data ? &b->flat_gshard : NULL;
}

/* ---- master weights and optimizer state (extend.h) ------------------------------------------ */

/* ZeRO-1: the master holds this rank's block [lo, hi) of the bucket. */
static tm_status master_ensure_sharded(tm_ctx *ctx, int bi) {
    tm__bucket *b = ctx->buckets[bi];
    int64_t lo, hi;
    TM__TRY(tm_ctx_grad_shard(ctx, bi, &lo, &hi));
    TM__TRY(pool_reserve(ctx, &b->master, (size_t)(hi - lo) * sizeof(float)));
    b->master.used = (size_t)(hi - lo) * sizeof(float);
    tm__mem_account(ctx, b->info.device, TM_MEM_OPTIMIZER, (ptrdiff_t)b->master.used); /* master weights */
    b->has_master = 1;
    b->master_sharded = 1;
    b->master_lo = lo;
    b->master_hi = hi;
    bucket_refresh_views(ctx, b);
    if (hi == lo) return TM_OK;
    tm_tensor *src;
    int64_t n = hi - lo, one = 1;
    TM__TRY(tm__tensor_view(ctx, &b->flat[TM_BUCKET_PARAMS], 1, &n, &one, lo, &src));
    return tm__copy_into(ctx, &b->flat[TM_BUCKET_MASTER], src);
}

/* The part of parameter p's master inside a sharded master, as a view; *skip: elements of p
 * before it. NULL view when p's master is not sharded or p has nothing in this rank's block. */
static tm_status sharded_master_part(tm_ctx *ctx, const tm_tensor *p, tm_tensor **view, int64_t *skip) {
    *view = NULL;
    if (!p->pm) return TM_OK;
    tm__bucket *b = ctx->buckets[p->pm->bucket];
    if (!b->has_master || !b->master_sharded) return TM_OK;
    int64_t off = p->pm->bucket_offset, n = tm__numel(p);
    int64_t a = off > b->master_lo ? off : b->master_lo, e = off + n < b->master_hi ? off + n : b->master_hi;
    if (a >= e) return TM_OK;
    int64_t k = e - a, one = 1;
    *skip = a - off;
    return tm__tensor_view(ctx, &b->flat[TM_BUCKET_MASTER], 1, &k, &one, a - b->master_lo, view);
}

tm_status tm__param_master_write(tm_ctx *ctx, const tm_tensor *p, tm_dtype src_dt, const void *src) {
    tm_tensor *v;
    int64_t skip = 0;
    TM__TRY(sharded_master_part(ctx, p, &v, &skip));
    if (!v) return TM_OK;
    return tm_tensor_write(ctx, v, src_dt, (const char *)src + (size_t)skip * tm_dtype_size(src_dt), tm__numel(v));
}

tm_status tm__param_master_fill(tm_ctx *ctx, const tm_tensor *p, double value) {
    tm_tensor *v;
    int64_t skip = 0;
    TM__TRY(sharded_master_part(ctx, p, &v, &skip));
    return v ? tm__fill(ctx, v, value) : TM_OK;
}

tm_status tm__bucket_master_ensure(tm_ctx *ctx, int bi) {
    tm__bucket *b = ctx->buckets[bi];
    if (b->has_master) return TM_OK;
    if (tm__zero_enabled(ctx)) return master_ensure_sharded(ctx, bi);
    int64_t n = b->info.numel;
    TM__TRY(pool_reserve(ctx, &b->master, (size_t)n * sizeof(float)));
    /* header per parameter first (nothing observable changes if one fails) */
    for (int k = 0; k < ctx->n_named; k++) {
        tm_tensor *p = ctx->named[k];
        if (!p->is_param || p->pm->bucket != bi || p->pm->master) continue;
        tm_tensor *mt = tm__host_alloc(ctx, sizeof *mt);
        if (!mt) return tm__err(ctx, TM_ERR_NOMEM, "master weights: out of host memory");
        *mt = *p;
        mt->dtype = TM_F32;
        mt->name = "";
        mt->grad = NULL;
        mt->pm = NULL;
        mt->is_param = 0;
        mt->requires_grad = 0;
        mt->storage = &b->master.st;
        p->pm->master = mt;
    }
    b->master.used = (size_t)n * sizeof(float);
    tm__mem_account(ctx, b->info.device, TM_MEM_OPTIMIZER, (ptrdiff_t)b->master.used); /* master weights */
    b->has_master = 1;
    bucket_refresh_views(ctx, b);
    /* master = the parameters' current values, widened (padding: zero to zero) */
    return tm__copy_into(ctx, &b->flat[TM_BUCKET_MASTER], &b->flat[TM_BUCKET_PARAMS]);
}

tm_tensor *tm__param_master(const tm_tensor *p) { return p && p->pm ? p->pm->master : NULL; }

tm_status tm__state_alloc(tm_ctx *ctx, const char *fn, int bi, tm_tensor **out) {
    return tm__state_alloc_n(ctx, fn, bi, ctx->buckets[bi]->info.numel, out);
}

tm_status tm__state_alloc_n(tm_ctx *ctx, const char *fn, int bi, int64_t numel, tm_tensor **out) {
    tm__bucket *b = ctx->buckets[bi];
    if (ctx->n_owned == ctx->cap_owned) {
        int cap = ctx->cap_owned ? 2 * ctx->cap_owned : 16;
        tm__storage **no = tm__host_alloc(ctx, sizeof *no * (size_t)cap);
        if (!no) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
        if (ctx->n_owned) memcpy(no, ctx->owned, sizeof *no * (size_t)ctx->n_owned);
        tm__host_free(ctx, ctx->owned);
        ctx->owned = no;
        ctx->cap_owned = cap;
    }
    /* storage and header in one host block, the storage first: freeing the owned storage
     * (tm_ctx_free) frees the header with it */
    struct flat {
        tm__storage st;
        tm_tensor t;
    } *f = tm__host_alloc(ctx, sizeof *f);
    if (!f) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    memset(f, 0, sizeof *f);
    size_t nbytes = (size_t)(numel ? numel : 1) * sizeof(float);
    f->st.device = b->info.device;
    f->st.nbytes = nbytes;
    f->st.data = tm__dev_alloc(ctx, b->info.device, nbytes);
    tm_status s = f->st.data ? tm__dev_memset0(ctx, b->info.device, f->st.data, nbytes)
                             : tm__err(ctx, TM_ERR_NOMEM, "%s: out of memory for %zu bytes of optimizer state", fn, nbytes);
    if (s != TM_OK) {
        if (f->st.data) tm__dev_free(ctx, b->info.device, f->st.data);
        tm__host_free(ctx, f);
        return s;
    }
    memset(&f->t, 0, sizeof f->t);
    f->t.ctx = ctx;
    f->t.dtype = TM_F32;
    f->t.device = b->info.device;
    f->t.ndim = 1;
    f->t.shape[0] = numel;
    f->t.stride[0] = 1;
    f->t.storage = &f->st;
    f->t.persistent = 1;
    f->t.name = "";
    ctx->owned[ctx->n_owned++] = &f->st;
    tm__mem_account(ctx, b->info.device, TM_MEM_OPTIMIZER, (ptrdiff_t)nbytes);
    *out = &f->t;
    return TM_OK;
}

