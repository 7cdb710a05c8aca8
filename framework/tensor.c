/*
 * tensor.c — tensor headers, temporaries, parameters and buffers, host I/O, and the untaped
 * copy / accumulate / fill primitives that the generic ops and the autograd engine build on.
 */
#include "ctx_internal.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>

int64_t tm__numel_of(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

int tm__is_contiguous(const tm_tensor *t) {
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s) return 0;
        s *= t->shape[i];
    }
    return 1;
}

static void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride) {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        stride[i] = s;
        s *= shape[i];
    }
}

static tm_status check_new(tm_ctx *ctx, const char *fn, tm_dtype dt, int ndim, const int64_t *shape,
                           tm_device dev) {
    if ((unsigned)dt >= TM_NDTYPES) return tm__err(ctx, TM_ERR_DTYPE, "%s: dtype %d is not a tm_dtype", fn, (int)dt);
    if (ndim < 0 || ndim > TM_MAX_DIMS)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: ndim %d outside [0, %d]", fn, ndim, TM_MAX_DIMS);
    if (ndim > 0 && !shape) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: shape is NULL with ndim %d", fn, ndim);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0)
            return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: shape %s has a negative size at dim %d", fn,
                           tm__sdesc(ctx, ndim, shape), i);
    if (dev.type == TM_DEVICE_CUDA) {
        if (!ctx->be[TM__CUDA] || dev.index != ctx->cuda_device)
            return tm__err(ctx, TM_ERR_DEVICE, "%s: cuda:%d is not available in this context (cuda_device=%d)",
                           fn, dev.index, ctx->cuda_device);
        if (dt == TM_F64) return tm__err(ctx, TM_ERR_DTYPE, "%s: f64 is CPU-only (gradient checks); got f64 on cuda:%d", fn, dev.index);
    } else if (dev.type != TM_DEVICE_CPU) {
        return tm__err(ctx, TM_ERR_DEVICE, "%s: unknown device type %d", fn, (int)dev.type);
    }
    return TM_OK;
}

static tm_tensor *header_new(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev) {
    tm_tensor *t = tm__meta_alloc(ctx, sizeof *t);
    if (!t) return NULL;
    memset(t, 0, sizeof *t);
    t->ctx = ctx;
    t->dtype = dt;
    t->device = dev;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    contiguous_strides(ndim, t->shape, t->stride);
    t->name = "";
    return t;
}

tm_status tm__tensor_new(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                         tm_tensor **out) {
    TM__TRY(check_new(ctx, "tensor", dt, ndim, shape, dev));
    tm_tensor *t = header_new(ctx, dt, ndim, shape, dev);
    tm__storage *st = tm__meta_alloc(ctx, sizeof *st);
    if (!t || !st) return TM_ERR_NOMEM;
    memset(st, 0, sizeof *st);
    st->nbytes = (size_t)tm__numel_of(ndim, shape) * tm_dtype_size(dt);
    st->device = dev;
    TM__TRY(tm__arena_alloc_storage(ctx, st));
    t->storage = st;
    *out = t;
    return TM_OK;
}

tm_status tm__tensor_zeros(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                           tm_tensor **out) {
    tm_tensor *t;
    TM__TRY(tm__tensor_new(ctx, dt, ndim, shape, dev, &t));
    TM__TRY(tm__dev_memset0(ctx, dev, t->storage->data, t->storage->nbytes));
    *out = t;
    return TM_OK;
}

tm_status tm__tensor_view(tm_ctx *ctx, const tm_tensor *base, int ndim, const int64_t *shape,
                          const int64_t *stride, int64_t offset, tm_tensor **out) {
    tm_tensor *t = tm__meta_alloc(ctx, sizeof *t);
    if (!t) return TM_ERR_NOMEM;
    memset(t, 0, sizeof *t);
    t->ctx = ctx;
    t->dtype = base->dtype;
    t->device = base->device;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        t->stride[i] = stride[i];
    }
    t->offset = offset;
    t->storage = base->storage;
    t->name = "";
    *out = t;
    return TM_OK;
}

void tm__tensor_release(tm_ctx *ctx, tm_tensor *t) {
    if (!ctx || !t || t->persistent || !ctx->mem_reuse) return;
    tm__storage *st = t->storage;
    if (!st || !st->data || !st->arena_bytes) return;
    tm__side_release(ctx, st); /* a collective beside the work still using it is waited for */
    tm__mirror_drop(ctx, t);
    tm__arena_free(ctx, st->device, st->data, st->arena_bytes);
    st->data = NULL;
}

tm_status tm__out_new(tm__call *c, int i, tm_dtype dt, int ndim, const int64_t *shape) {
    return tm__tensor_new(c->ctx, dt, ndim, shape, c->in[0]->device, &c->out[i]);
}

tm_status tm__saved_new(tm__call *c, tm_dtype dt, int ndim, const int64_t *shape, tm_tensor **out) {
    if (c->n_saved >= TM__MAX_SAVED)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "%s: more than %d saved tensors", tm__opname(c), TM__MAX_SAVED);
    tm_tensor *t;
    TM__TRY(tm__tensor_new(c->ctx, dt, ndim, shape, c->in[0]->device, &t));
    c->saved[c->n_saved++] = t;
    *out = t;
    return TM_OK;
}

/* ---- public creation ------------------------------------------------------------------- */

tm_status tm_tensor_empty(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                          tm_tensor **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_empty: out is NULL");
    TM__TRY(check_new(ctx, "tm_tensor_empty", dt, ndim, shape, dev));
    return tm__tensor_new(ctx, dt, ndim, shape, dev, out);
}

tm_status tm_tensor_zeros(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                          tm_tensor **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_zeros: out is NULL");
    TM__TRY(check_new(ctx, "tm_tensor_zeros", dt, ndim, shape, dev));
    return tm__tensor_zeros(ctx, dt, ndim, shape, dev, out);
}

tm_status tm_tensor_from_host(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                              tm_dtype src_dt, const void *src, tm_tensor **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out || !src) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_from_host: %s is NULL", out ? "src" : "out");
    TM__TRY(check_new(ctx, "tm_tensor_from_host", dt, ndim, shape, dev));
    tm_tensor *t;
    TM__TRY(tm__tensor_new(ctx, dt, ndim, shape, dev, &t));
    TM__TRY(tm_tensor_write(ctx, t, src_dt, src, tm__numel(t)));
    *out = t;
    return TM_OK;
}

/* Optimizer state is told apart by name: the optimizers name their state buffers
 * "<param>.adamw_m", "<param>.adamw_v", "<param>.sgd_b" and their step counters
 * "optim.<name>.steps" (optim/adamw.c, optim/sgd.c). */
static int buffer_category(const char *name) {
    static const char *const suffixes[] = {".adamw_m", ".adamw_v", ".sgd_b"};
    size_t len = strlen(name);
    if (strncmp(name, "optim.", 6) == 0) return TM_MEM_OPTIMIZER;
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
        size_t sl = strlen(suffixes[i]);
        if (len >= sl && memcmp(name + len - sl, suffixes[i], sl) == 0) return TM_MEM_OPTIMIZER;
    }
    return TM_MEM_BUFFERS;
}

static tm_status named_new(tm_ctx *ctx, const char *fn, const char *name, tm_dtype dt, int ndim,
                           const int64_t *shape, tm_device dev, int is_param, const tm_param_options *opts,
                           const tm_tensor *alias, int64_t alias_offset, tm_tensor **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out || !name) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s is NULL", fn, out ? "name" : "out");
    size_t len = strlen(name);
    if (len == 0 || len > 127)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: name \"%.40s\" must have 1..127 bytes (has %zu)", fn, name, len);
    if (tm_ctx_find(ctx, name)) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: name \"%s\" already exists", fn, name);
    TM__TRY(check_new(ctx, fn, dt, ndim, shape, dev));
    if (is_param && !tm__is_float(dt))
        return tm__err(ctx, TM_ERR_DTYPE, "%s: parameter \"%s\" must be a float dtype, got %s", fn, name, tm_dtype_name(dt));

    TM__TRY(tm__names_reserve(ctx, fn));
    tm_tensor *t = tm__host_alloc(ctx, sizeof *t);
    char *nm = tm__host_alloc(ctx, len + 1);
    if (!t || !nm) {
        tm__host_free(ctx, t);
        tm__host_free(ctx, nm);
        return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    }
    memcpy(nm, name, len + 1);
    memset(t, 0, sizeof *t);
    t->ctx = ctx;
    t->dtype = dt;
    t->device = dev;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    contiguous_strides(ndim, t->shape, t->stride);
    t->name = nm;
    t->persistent = 1;
    size_t esz = tm_dtype_size(dt);
    size_t nbytes = (size_t)tm__numel_of(ndim, shape) * esz;
    size_t padded = (nbytes + TM__ALIGN - 1) / TM__ALIGN * TM__ALIGN;
    tm_status s = TM_OK;
    if (is_param) {
        t->is_param = 1;
        t->requires_grad = 1;
        s = tm__param_place(ctx, fn, t, opts);
        if (s != TM_OK) {
            tm__host_free(ctx, t);
            tm__host_free(ctx, nm);
            return s;
        }
    } else if (alias) {
        t->storage = alias->storage;
        t->offset = alias->offset + alias_offset;
    } else {
        if (ctx->n_owned == ctx->cap_owned) {
            int cap = ctx->cap_owned ? 2 * ctx->cap_owned : 16;
            tm__storage **no = tm__host_alloc(ctx, sizeof *no * cap);
            if (!no) s = tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
            else {
                if (ctx->n_owned) memcpy(no, ctx->owned, sizeof *no * ctx->n_owned);
                tm__host_free(ctx, ctx->owned);
                ctx->owned = no;
                ctx->cap_owned = cap;
            }
        }
        tm__storage *st = s == TM_OK ? tm__host_alloc(ctx, sizeof *st) : NULL;
        void *mem = st ? tm__dev_alloc(ctx, dev, padded) : NULL;
        if (mem) s = tm__dev_memset0(ctx, dev, mem, padded);
        if (!mem || s != TM_OK) {
            if (mem) tm__dev_free(ctx, dev, mem);
            tm__host_free(ctx, st);
            tm__host_free(ctx, t);
            tm__host_free(ctx, nm);
            return s != TM_OK ? s : tm__err(ctx, TM_ERR_NOMEM, "%s: out of memory for \"%s\" (%zu bytes)", fn, name, nbytes);
        }
        memset(st, 0, sizeof *st);
        st->data = mem;
        st->nbytes = padded;
        st->device = dev;
        ctx->owned[ctx->n_owned++] = st;
        t->storage = st;
        tm__mem_account(ctx, dev, buffer_category(name), (ptrdiff_t)padded);
    }
    tm__names_add(ctx, t);
    *out = t;
    return TM_OK;
}

tm_status tm_param_new(tm_ctx *ctx, const char *name, tm_dtype dt, int ndim, const int64_t *shape,
                       tm_device dev, tm_tensor **out) {
    return named_new(ctx, "tm_param_new", name, dt, ndim, shape, dev, 1, NULL, NULL, 0, out);
}

tm_status tm_param_new_ex(tm_ctx *ctx, const char *name, tm_dtype dt, int ndim, const int64_t *shape,
                          tm_device dev, const tm_param_options *opts, tm_tensor **out) {
    return named_new(ctx, "tm_param_new_ex", name, dt, ndim, shape, dev, 1, opts, NULL, 0, out);
}

tm_status tm_buffer_new(tm_ctx *ctx, const char *name, tm_dtype dt, int ndim, const int64_t *shape,
                        tm_device dev, tm_tensor **out) {
    return named_new(ctx, "tm_buffer_new", name, dt, ndim, shape, dev, 0, NULL, NULL, 0, out);
}

tm_status tm__named_alias(tm_ctx *ctx, const char *fn, const char *name, const tm_tensor *base, int ndim,
                          const int64_t *shape, int64_t offset, tm_tensor **out) {
    return named_new(ctx, fn, name, base->dtype, ndim, shape, base->device, 0, NULL, base, offset, out);
}

int tm_ctx_num_params(const tm_ctx *ctx) { return ctx ? ctx->n_params : 0; }

tm_tensor *tm_ctx_param(const tm_ctx *ctx, int i) {
    return ctx && i >= 0 && i < ctx->n_params ? ctx->params[i] : NULL;
}

int tm_ctx_num_named(const tm_ctx *ctx) { return ctx ? ctx->n_named : 0; }

tm_tensor *tm_ctx_named(const tm_ctx *ctx, int i) {
    return ctx && i >= 0 && i < ctx->n_named ? ctx->named[i] : NULL;
}

tm_tensor *tm_ctx_find(const tm_ctx *ctx, const char *name) {
    if (!ctx || !name) return NULL;
    int k = tm__names_find(ctx, name);
    return k >= 0 ? ctx->named[k] : NULL;
}

/* ---- introspection ----------------------------------------------------------------------- */

int tm_tensor_ndim(const tm_tensor *t) { return t ? t->ndim : 0; }
int64_t tm_tensor_dim(const tm_tensor *t, int axis) {
    if (!t) return -1;
    int a = tm__axis(axis, t->ndim);
    return a < 0 ? -1 : t->shape[a];
}
int64_t tm_tensor_numel(const tm_tensor *t) { return t ? tm__numel(t) : 0; }
tm_dtype tm_tensor_dtype(const tm_tensor *t) { return t ? t->dtype : TM_F32; }
tm_device tm_tensor_device(const tm_tensor *t) { return t ? t->device : tm_cpu(); }
tm_ctx *tm__tensor_ctx(const tm_tensor *t) { return t ? t->ctx : NULL; }
const char *tm_tensor_name(const tm_tensor *t) { return t ? t->name : NULL; }
int tm_tensor_is_contiguous(const tm_tensor *t) { return t ? tm__is_contiguous(t) : 0; }
int tm_tensor_requires_grad(const tm_tensor *t) { return t ? (int)t->requires_grad : 0; }
tm_tensor *tm_tensor_grad(const tm_tensor *t) { return t ? t->grad : NULL; }

tm_status tm_tensor_set_requires_grad(tm_ctx *ctx, tm_tensor *t, int requires_grad) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!t) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_set_requires_grad: tensor is NULL");
    if (t->node) return tm__err(ctx, TM_ERR_STATE, "tm_tensor_set_requires_grad: %s is the output of an op, not a leaf", tm__tdesc(ctx, t));
    if (t->is_param) return tm__err(ctx, TM_ERR_STATE, "tm_tensor_set_requires_grad: parameter \"%s\" always requires grad", t->name);
    if (requires_grad && !tm__is_float(t->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "tm_tensor_set_requires_grad: %s is not a float tensor", tm__tdesc(ctx, t));
    t->requires_grad = requires_grad ? 1 : 0;
    return TM_OK;
}

tm_status tm__memcpy(tm_ctx *ctx, void *dst, tm_device ddev, const void *src, tm_device sdev, size_t nbytes) {
    if (!nbytes) return TM_OK;
    int b = ddev.type == TM_DEVICE_CPU ? tm__backend(sdev) : tm__backend(ddev);
    const tm__backend_ops *be = ctx->be[b];
    if (!be) return tm__err(ctx, TM_ERR_DEVICE, "memcpy: %s memory used in a context without that backend",
                            b == TM__CUDA ? "CUDA" : "CPU");
    int kind = ddev.type == TM_DEVICE_CPU && sdev.type != TM_DEVICE_CPU ? TM__D2H
             : sdev.type == TM_DEVICE_CPU && ddev.type != TM_DEVICE_CPU ? TM__H2D : TM__D2D;
    return be->memcpy(ctx, dst, src, nbytes, kind);
}

static tm_status tensor_read(tm_ctx *ctx, const tm_tensor *t, tm_dtype dst_dt, void *dst, int64_t count);
static tm_status tensor_write(tm_ctx *ctx, tm_tensor *t, tm_dtype src_dt, const void *src, int64_t count);

/* Read and write stage through arena memory inside a scope: the staging goes back to the arena
 * when they return. */
tm_status tm_tensor_read(tm_ctx *ctx, const tm_tensor *t, tm_dtype dst_dt, void *dst, int64_t count) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (ctx->plan_only)
        return tm__err(ctx, TM_ERR_STATE, "tm_tensor_read: %s: a plan-only context (tm_ctx_options.plan_only) holds no "
                       "values", t ? tm__tdesc(ctx, t) : "NULL");
    int mark = tm__scope_open(ctx);
    tm_status s = tensor_read(ctx, t, dst_dt, dst, count);
    tm__scope_close(ctx, mark, NULL, 0);
    return s;
}

tm_status tm_tensor_write(tm_ctx *ctx, tm_tensor *t, tm_dtype src_dt, const void *src, int64_t count) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (ctx->plan_only)
        return tm__err(ctx, TM_ERR_STATE, "tm_tensor_write: %s: a plan-only context (tm_ctx_options.plan_only) holds no "
                       "values", t ? tm__tdesc(ctx, t) : "NULL");
    int mark = tm__scope_open(ctx);
    tm_status s = tensor_write(ctx, t, src_dt, src, count);
    tm__scope_close(ctx, mark, NULL, 0);
    return s;
}

static tm_status tensor_read(tm_ctx *ctx, const tm_tensor *t, tm_dtype dst_dt, void *dst, int64_t count) {
    if (!t || !dst) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_read: %s is NULL", t ? "dst" : "tensor");
    if ((unsigned)dst_dt >= TM_NDTYPES) return tm__err(ctx, TM_ERR_DTYPE, "tm_tensor_read: bad dst dtype %d", (int)dst_dt);
    int64_t n = tm__numel(t);
    if (count != n) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_read: count %lld but %s has %lld elements", (long long)count, tm__tdesc(ctx, t), (long long)n);
    if (t->zs)
        return tm__err(ctx, TM_ERR_STATE, "tm_tensor_read: \"%s\" is split over the ranks (ZeRO-1); this rank holds "
                       "part of it (checkpoints gather it)", t->name);
    if (n == 0) return TM_OK;
    if (t->storage && !t->storage->data && ctx->params_deferred && t->is_param)
        return tm__err(ctx, TM_ERR_STATE, "tm_tensor_read: parameter \"%s\" has no memory yet: it was made after "
                       "tm_ctx_defer_params; call tm_ctx_materialize_params first", t->name);
    if (t->storage && !t->storage->data)
        return tm__err(ctx, TM_ERR_STATE, "tm_tensor_read: %s has no memory now: a parameter gradient under ZeRO-2 "
                       "exists from a step's first backward to tm_comm_sync_grads, which keeps this rank's reduced "
                       "block only", tm__tdesc(ctx, t));
    /* A CPU tensor stands for device memory here: reading it back is where a CUDA run would
     * wait for its stream, so it counts as one synchronisation (tm_ctx_sync_count). A device
     * tensor's D2H copy below counts itself. */
    if (t->device.type == TM_DEVICE_CPU) tm__count_sync(ctx);
    size_t nbytes = (size_t)n * tm_dtype_size(t->dtype);
    const void *src;
    /* Stage through the host arena when the tensor is on a device or strided. */
    if (t->device.type == TM_DEVICE_CPU && tm__is_contiguous(t)) {
        src = tm__data(t);
    } else if (dst_dt == t->dtype && tm__is_contiguous(t)) {
        /* A dense device tensor in its own dtype: one copy straight into dst (pinned memory
         * there makes it a DMA at the link's speed), no staging in the arena. */
        return tm__memcpy(ctx, dst, tm_cpu(), tm__data(t), t->device, nbytes);
    } else {
        const tm_tensor *dense = t;
        if (!tm__is_contiguous(t)) {
            if (t->device.type == TM_DEVICE_CPU) {
                void *tmp = tm__arena_alloc(ctx, tm_cpu(), nbytes);
                if (!tmp) return TM_ERR_NOMEM;
                tm__host_ops()->gather_strided(t, tmp);
                src = tmp;
                goto convert;
            }
            tm_tensor *c;
            TM__TRY(tm__contiguous_copy(ctx, t, &c));
            dense = c;
        }
        void *tmp = tm__arena_alloc(ctx, tm_cpu(), nbytes);
        if (!tmp) return TM_ERR_NOMEM;
        TM__TRY(tm__memcpy(ctx, tmp, tm_cpu(), tm__data(dense), dense->device, nbytes));
        src = tmp;
    }
convert:
    tm__host_ops()->convert(dst, dst_dt, src, t->dtype, n, ctx->n_threads);
    return TM_OK;
}

static tm_status tensor_write(tm_ctx *ctx, tm_tensor *t, tm_dtype src_dt, const void *src, int64_t count) {
    if (!t || !src) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_write: %s is NULL", t ? "src" : "tensor");
    if ((unsigned)src_dt >= TM_NDTYPES) return tm__err(ctx, TM_ERR_DTYPE, "tm_tensor_write: bad src dtype %d", (int)src_dt);
    int64_t n = tm__numel(t);
    if (count != n) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_write: count %lld but %s has %lld elements", (long long)count, tm__tdesc(ctx, t), (long long)n);
    if (!tm__is_contiguous(t)) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_write: %s is a strided view; write to a contiguous tensor", tm__tdesc(ctx, t));
    if (t->zs)
        return tm__err(ctx, TM_ERR_STATE, "tm_tensor_write: \"%s\" is split over the ranks (ZeRO-1); this rank holds "
                       "part of it", t->name);
    if (n == 0) return TM_OK;
    if (t->storage && !t->storage->data && ctx->params_deferred && t->is_param)
        return tm__err(ctx, TM_ERR_STATE, "tm_tensor_write: parameter \"%s\" has no memory yet: it was made after "
                       "tm_ctx_defer_params; call tm_ctx_materialize_params first", t->name);
    if (t->storage && !t->storage->data)
        return tm__err(ctx, TM_ERR_STATE, "tm_tensor_write: %s has no memory now (a parameter gradient under ZeRO-2 "
                       "outside a step's backward)", tm__tdesc(ctx, t));
    tm__mirror_drop(ctx, t);
    tm_tensor *master = t->pm ? t->pm->master : NULL;
    if (master) TM__TRY(tm_tensor_write(ctx, master, src_dt, src, count)); /* f32 master weights follow */
    if (t->pm) TM__TRY(tm__param_master_write(ctx, t, src_dt, src));   /* (sharded over the ranks) */
    if (t->device.type == TM_DEVICE_CPU) {
        tm__host_ops()->convert(tm__data(t), t->dtype, src, src_dt, n, ctx->n_threads);
        return TM_OK;
    }
    size_t nbytes = (size_t)n * tm_dtype_size(t->dtype);
    const void *stage = src;
    if (src_dt != t->dtype) {
        void *tmp = tm__arena_alloc(ctx, tm_cpu(), nbytes);
        if (!tmp) return TM_ERR_NOMEM;
        tm__host_ops()->convert(tmp, t->dtype, src, src_dt, n, ctx->n_threads);
        stage = tmp;
    }
    return tm__memcpy(ctx, tm__data(t), t->device, stage, tm_cpu(), nbytes);
}

tm_status tm_tensor_fill(tm_ctx *ctx, tm_tensor *t, double value) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!t) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_fill: tensor is NULL");
    if (!tm__is_contiguous(t)) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_tensor_fill: %s is a strided view", tm__tdesc(ctx, t));
    if (t->storage && !t->storage->data && ctx->params_deferred && t->is_param)
        return tm__err(ctx, TM_ERR_STATE, "tm_tensor_fill: parameter \"%s\" has no memory yet: it was made after "
                       "tm_ctx_defer_params; call tm_ctx_materialize_params first", t->name);
    if (t->pm && t->pm->master) TM__TRY(tm__fill(ctx, t->pm->master, value)); /* f32 master weights follow */
    if (t->pm) TM__TRY(tm__param_master_fill(ctx, t, value));
    return tm__fill(ctx, t, value);
}
/* ---- untaped primitives: validation here, the work in the backend ---------------------- */

static const tm__backend_ops *be_of(tm_ctx *ctx, tm_device d) { return ctx->be[tm__backend(d)]; }

tm_status tm__fill(tm_ctx *ctx, tm_tensor *t, double value) {
    if (tm__numel(t) == 0) return TM_OK;
    tm__mirror_drop(ctx, t);
    return be_of(ctx, t->device)->fill(ctx, t, value);
}

tm_status tm__contiguous_copy(tm_ctx *ctx, const tm_tensor *src, tm_tensor **out) {
    tm_tensor *t;
    TM__TRY(tm__tensor_new(ctx, src->dtype, src->ndim, src->shape, src->device, &t));
    TM__TRY(tm__copy_into(ctx, t, src));
    *out = t;
    return TM_OK;
}

tm_status tm__copy_into(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src) {
    int64_t n = tm__numel(dst);
    if (n != tm__numel(src) || !tm__is_contiguous(dst))
        return tm__err(ctx, TM_ERR_INTERNAL, "copy_into: %s <- %s", tm__tdesc(ctx, dst), tm__tdesc(ctx, src));
    if (!tm__same_device(dst->device, src->device))
        return tm__err(ctx, TM_ERR_INTERNAL, "copy_into across devices: %s <- %s", tm__tdesc(ctx, dst), tm__tdesc(ctx, src));
    if (n == 0) return TM_OK;
    tm__mirror_drop(ctx, dst);
    return be_of(ctx, dst->device)->copy_into(ctx, dst, src);
}

tm_status tm__accumulate(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, double alpha) {
    int64_t n = tm__numel(dst);
    if (n != tm__numel(src) || !tm__is_contiguous(dst) || !tm__is_float(dst->dtype))
        return tm__err(ctx, TM_ERR_INTERNAL, "accumulate: %s += %s", tm__tdesc(ctx, dst), tm__tdesc(ctx, src));
    if (n == 0) return TM_OK;
    tm__mirror_drop(ctx, dst);
    return be_of(ctx, dst->device)->accumulate(ctx, dst, src, alpha);
}

tm_status tm__assign(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, int accumulate, double alpha) {
    if (tm__numel(dst) != tm__numel(src) || dst->ndim != src->ndim)
        return tm__err(ctx, TM_ERR_INTERNAL, "assign: %s <- %s", tm__tdesc(ctx, dst), tm__tdesc(ctx, src));
    if (!tm__same_device(dst->device, src->device))
        return tm__err(ctx, TM_ERR_INTERNAL, "assign across devices: %s <- %s", tm__tdesc(ctx, dst), tm__tdesc(ctx, src));
    if (tm__numel(dst) == 0) return TM_OK;
    if (tm__is_contiguous(dst))
        return accumulate ? tm__accumulate(ctx, dst, src, alpha) : tm__copy_into(ctx, dst, src);
    tm__mirror_drop(ctx, dst);
    return be_of(ctx, dst->device)->assign(ctx, dst, src, accumulate, alpha);
}

tm_status tm__copy_bytes(tm_ctx *ctx, tm_tensor *dst, size_t offset, const tm_tensor *src) {
    size_t n = (size_t)tm__numel(src) * tm_dtype_size(src->dtype);
    size_t cap = (size_t)tm__numel(dst) * tm_dtype_size(dst->dtype);
    if (!tm__is_contiguous(dst) || !tm__is_contiguous(src) || offset > cap || n > cap - offset)
        return tm__err(ctx, TM_ERR_INTERNAL, "copy_bytes: the %zu bytes of %s do not fit at byte %zu of %s", n,
                       tm__tdesc(ctx, src), offset, tm__tdesc(ctx, dst));
    tm__mirror_drop(ctx, dst);
    return tm__memcpy(ctx, (char *)tm__data(dst) + offset, dst->device, tm__data(src), src->device, n);
}

/* ---- persistent tensors owned by their caller (extend.h) -------------------------------- */

/* The header and its storage in one host block: tm__persistent_free gives back both. */
typedef struct persistent_block {
    tm_tensor t;
    tm__storage st;
} persistent_block;

tm_status tm__persistent_new(tm_ctx *ctx, const char *fn, tm_dtype dt, int ndim, const int64_t *shape,
                             tm_device dev, tm_tensor **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    TM__TRY(check_new(ctx, fn, dt, ndim, shape, dev));
    int64_t numel = tm__numel_of(ndim, shape);
    size_t esz = tm_dtype_size(dt);
    if ((uint64_t)numel > SIZE_MAX / esz)
        return tm__err(ctx, TM_ERR_NOMEM, "%s: %s %s does not fit in memory", fn, tm_dtype_name(dt),
                       tm__sdesc(ctx, ndim, shape));
    size_t nbytes = (size_t)numel * esz;
    persistent_block *b = tm__host_alloc(ctx, sizeof *b);
    if (!b) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    void *mem = tm__dev_alloc(ctx, dev, nbytes);
    if (!mem) {
        tm__host_free(ctx, b);
        return tm__err(ctx, TM_ERR_NOMEM, "%s: out of %s memory for %zu bytes", fn,
                       dev.type == TM_DEVICE_CPU ? "host" : "device", nbytes);
    }
    /* Zeroed so that nothing ever reads uninitialised memory. */
    tm_status s = tm__dev_memset0(ctx, dev, mem, nbytes);
    if (s != TM_OK) {
        tm__dev_free(ctx, dev, mem);
        tm__host_free(ctx, b);
        return s;
    }
    memset(b, 0, sizeof *b);
    b->st.data = mem;
    b->st.nbytes = nbytes;
    b->st.device = dev;
    tm_tensor *t = &b->t;
    t->ctx = ctx;
    t->dtype = dt;
    t->device = dev;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    contiguous_strides(ndim, t->shape, t->stride);
    t->storage = &b->st;
    t->persistent = 1;
    t->name = "";
    *out = t;
    return TM_OK;
}

void tm__persistent_free(tm_ctx *ctx, tm_tensor *t) {
    if (!t) return;
    /* A mirror keyed by this storage must not outlive it (a later storage may reuse the address). */
    tm__mirror_drop(ctx, t);
    tm__dev_free(ctx, t->device, t->storage->data);
    tm__host_free(ctx, (persistent_block *)t);
}

/* ---- host mirrors (internal.h) ---------------------------------------------------------- */

tm_status tm__mirror_set(tm_ctx *ctx, const tm_tensor *t, const int64_t *vals) {
    int64_t n = tm__numel(t);
    if (n == 0) return TM_OK; /* nothing a reader could need */
    if (t->dtype != TM_I64 || !tm__is_contiguous(t) || !t->storage || !t->storage->data)
        return tm__err(ctx, TM_ERR_INTERNAL, "mirror of %s: not a live contiguous i64 tensor", tm__tdesc(ctx, t));
    /* Mirrors of this storage whose elements overlap t's are replaced; disjoint views keep
     * theirs (the chunked expert-parallel dispatch mirrors each chunk's slice of one upload). */
    for (tm__mirror **pm = &ctx->mirrors; *pm;) {
        const tm__mirror *o = *pm;
        if (o->st == t->storage && o->offset < t->offset + n && t->offset < o->offset + o->n) *pm = o->next;
        else pm = &(*pm)->next;
    }
    tm__mirror *m = tm__meta_alloc(ctx, sizeof *m);
    int64_t *v = tm__meta_alloc(ctx, (size_t)n * sizeof *v);
    if (!m || !v) return TM_ERR_NOMEM;
    memcpy(v, vals, (size_t)n * sizeof *v);
    m->st = t->storage;
    m->offset = t->offset;
    m->n = n;
    m->vals = v;
    m->next = ctx->mirrors;
    ctx->mirrors = m;
    return TM_OK;
}

const int64_t *tm__mirror_find(const tm_ctx *ctx, const tm_tensor *t) {
    if (!t || t->dtype != TM_I64 || !t->storage || !t->storage->data || !tm__is_contiguous(t)) return NULL;
    for (const tm__mirror *m = ctx->mirrors; m; m = m->next)
        if (m->st == t->storage && m->offset == t->offset && m->n == tm__numel(t)) return m->vals;
    return NULL;
}

void tm__mirror_drop(tm_ctx *ctx, const tm_tensor *t) {
    if (!t) return;
    for (tm__mirror **pm = &ctx->mirrors; *pm;) {
        if ((*pm)->st == t->storage) *pm = (*pm)->next;
        else pm = &(*pm)->next;
    }
}
