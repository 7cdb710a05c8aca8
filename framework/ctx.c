/*
 * ctx.c — version, status strings, contexts and their error messages.
 */
#include "ctx_internal.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

const char *tm_version(void) { return TM_VERSION_STRING; }
int tm_version_number(void) { return TM_VERSION_NUMBER; }

const char *tm_status_str(tm_status s) {
    switch (s) {
    case TM_OK: return "ok";
    case TM_ERR_INVALID_ARG: return "invalid argument";
    case TM_ERR_SHAPE: return "shape mismatch";
    case TM_ERR_DTYPE: return "unsupported dtype";
    case TM_ERR_DEVICE: return "device mismatch or unavailable";
    case TM_ERR_INDEX: return "index out of range";
    case TM_ERR_NOMEM: return "out of memory";
    case TM_ERR_UNSUPPORTED: return "not supported";
    case TM_ERR_STATE: return "invalid state";
    case TM_ERR_CUDA: return "CUDA error";
    case TM_ERR_IO: return "I/O error";
    case TM_ERR_INTERNAL: return "internal error";
    case TM_ERR_COMM: return "communication error";
    }
    return "unknown status";
}

static const char *const dtype_names[TM_NDTYPES] = {"f32", "bf16", "f64", "i32", "i64", "u8"};
static const size_t dtype_sizes[TM_NDTYPES] = {4, 2, 8, 4, 8, 1};

const char *tm_dtype_name(tm_dtype dt) {
    return ((unsigned)dt < TM_NDTYPES) ? dtype_names[dt] : "?";
}
size_t tm_dtype_size(tm_dtype dt) { return ((unsigned)dt < TM_NDTYPES) ? dtype_sizes[dt] : 0; }

tm_ctx_options tm_ctx_options_default(void) {
    tm_ctx_options o;
    memset(&o, 0, sizeof o);
    o.cuda_device = -1;
    o.grouped_gemm = TM_GROUPED_GEMM_AUTO;
    return o;
}

static _Thread_local char create_error[1100];
const char *tm_last_create_error(void) { return create_error; }

int tm_cuda_device_count(void) {
    const tm__backend_ops *be = tm__backend_get(TM__CUDA);
    return be ? be->device_count() : 0;
}

tm_status tm_ctx_new(tm_ctx **out, const tm_ctx_options *opts) {
    create_error[0] = 0;
    if (!out) {
        snprintf(create_error, sizeof create_error, "tm_ctx_new: out is NULL");
        return TM_ERR_INVALID_ARG;
    }
    *out = NULL;
    tm_ctx_options o = opts ? *opts : tm_ctx_options_default();
    if (o.allocator && (!o.allocator->alloc || !o.allocator->free)) {
        snprintf(create_error, sizeof create_error,
                 "tm_ctx_new: allocator given but its alloc or free function is NULL");
        return TM_ERR_INVALID_ARG;
    }
    if (o.cpu_gemm != TM_CPU_GEMM_AUTO && o.cpu_gemm != TM_CPU_GEMM_BUILTIN) {
        snprintf(create_error, sizeof create_error,
                 "tm_ctx_new: cpu_gemm = %d is neither TM_CPU_GEMM_AUTO (0) nor TM_CPU_GEMM_BUILTIN (1)", o.cpu_gemm);
        return TM_ERR_INVALID_ARG;
    }
    if (o.grouped_gemm != TM_GROUPED_GEMM_CUBLASLT && o.grouped_gemm != TM_GROUPED_GEMM_DEVICE &&
        o.grouped_gemm != TM_GROUPED_GEMM_HOPPER && o.grouped_gemm != TM_GROUPED_GEMM_AUTO) {
        snprintf(create_error, sizeof create_error,
                 "tm_ctx_new: grouped_gemm = %d is none of TM_GROUPED_GEMM_CUBLASLT (0), TM_GROUPED_GEMM_DEVICE (1), "
                 "TM_GROUPED_GEMM_HOPPER (2), TM_GROUPED_GEMM_AUTO (3)",
                 o.grouped_gemm);
        return TM_ERR_INVALID_ARG;
    }
    if (o.no_grad_buffers != 0 && o.no_grad_buffers != 1) {
        snprintf(create_error, sizeof create_error, "tm_ctx_new: no_grad_buffers = %d is neither 0 nor 1",
                 o.no_grad_buffers);
        return TM_ERR_INVALID_ARG;
    }
    if (o.plan_only != 0 && o.plan_only != 1) {
        snprintf(create_error, sizeof create_error, "tm_ctx_new: plan_only = %d is neither 0 nor 1", o.plan_only);
        return TM_ERR_INVALID_ARG;
    }
    if (o.plan_only && o.cuda_device >= 0) {
        snprintf(create_error, sizeof create_error,
                 "tm_ctx_new: plan_only with cuda_device %d: a plan-only context has only its CPU device, which "
                 "allocates nothing (plan on it: a CUDA run's layout is the same)", o.cuda_device);
        return TM_ERR_INVALID_ARG;
    }
    tm_ctx tmp;
    memset(&tmp, 0, sizeof tmp);
    if (o.allocator) {
        tmp.alloc = *o.allocator;
        tmp.has_alloc = 1;
    }
    tm_ctx *ctx = tm__host_alloc(&tmp, sizeof *ctx);
    if (!ctx) {
        snprintf(create_error, sizeof create_error, "tm_ctx_new: out of host memory");
        return TM_ERR_NOMEM;
    }
    memset(ctx, 0, sizeof *ctx);
    ctx->alloc = tmp.alloc;
    ctx->has_alloc = tmp.has_alloc;
    ctx->alloc_count = 1;
    ctx->n_threads = o.num_threads > 0 ? o.num_threads : omp_get_max_threads();
    ctx->grad_enabled = 1;
    ctx->no_grad_buffers = o.no_grad_buffers;
    ctx->cpu_gemm_builtin = o.cpu_gemm == TM_CPU_GEMM_BUILTIN;
    /* AUTO is cuBLASLt until the CUDA backend's init, which knows the device, says otherwise */
    ctx->gmm_auto = o.grouped_gemm == TM_GROUPED_GEMM_AUTO;
    ctx->gmm_device = ctx->gmm_auto ? TM_GROUPED_GEMM_CUBLASLT : o.grouped_gemm;
    ctx->chunk_bytes = o.arena_chunk_bytes ? o.arena_chunk_bytes : ((size_t)64 << 20);
    ctx->arena[TM__CPU].dev = tm_cpu();
    ctx->meta.dev = tm_cpu();
    ctx->cuda_device = -1;
    ctx->perturb_op = -1;
    ctx->mem_reuse = 1;
    ctx->gating_split = 1; /* tm__gating_set_split */
    ctx->gmlp_fused = 0;   /* tm__grouped_mlp_set_fused: measured slower than the composition (internal.h) */
    ctx->be[TM__CPU] = o.plan_only ? &tm__plan_backend : tm__backend_get(TM__CPU);
    ctx->plan_only = o.plan_only;
    if (o.cuda_device >= 0) {
        const tm__backend_ops *be = tm__backend_get(TM__CUDA);
        if (!be) {
            snprintf(create_error, sizeof create_error,
                     "tm_ctx_new: cuda_device %d requested but this build has no CUDA backend "
                     "(rebuild with CUDA=1)", o.cuda_device);
            tm__host_free(ctx, ctx);
            return TM_ERR_DEVICE;
        }
        int n = be->device_count();
        if (o.cuda_device >= n) {
            snprintf(create_error, sizeof create_error,
                     "tm_ctx_new: cuda_device %d requested but %d CUDA device(s) visible",
                     o.cuda_device, n);
            tm__host_free(ctx, ctx);
            return TM_ERR_DEVICE;
        }
        tm_status s = be->init(ctx, o.cuda_device, &ctx->state[TM__CUDA]);
        if (s != TM_OK) {
            snprintf(create_error, sizeof create_error, "%s", ctx->errmsg);
            tm__host_free(ctx, ctx);
            return s;
        }
        ctx->be[TM__CUDA] = be;
        ctx->cuda_device = o.cuda_device;
        tm_device d = tm_cuda(o.cuda_device);
        ctx->arena[TM__CUDA].dev = d;
    }
    *out = ctx;
    return TM_OK;
}

void tm_ctx_free(tm_ctx *ctx) {
    if (!ctx) return;
    tm__side_free(ctx);
    tm__gsync_free(ctx);
    tm__fsdp_free(ctx);
    tm__comm_destroy(ctx);
    for (int b = 0; b < TM__NBACKENDS; b++) tm__segs_free(ctx, ctx->segs[b]);
    for (int b = 0; b < TM__NBACKENDS; b++) {
        tm__arena_release(ctx, &ctx->arena[b]);
    }
    tm__arena_release(ctx, &ctx->meta);
    tm__buckets_free(ctx);
    for (int i = 0; i < ctx->n_owned; i++) {
        tm__storage *st = ctx->owned[i];
        if (st->data) tm__dev_free(ctx, st->device, st->data);
        tm__host_free(ctx, st);
    }
    for (int i = 0; i < ctx->n_named; i++) {
        tm_tensor *t = ctx->named[i];
        if (t->grad) tm__host_free(ctx, t->grad);
        if (t->pm) {
            if (t->pm->master) tm__host_free(ctx, t->pm->master);
            tm__host_free(ctx, t->pm);
        }
        tm__host_free(ctx, t->zs);
        tm__host_free(ctx, (void *)t->name);
        tm__host_free(ctx, t);
    }
    tm__host_free(ctx, ctx->named);
    tm__names_free(ctx);
    tm__host_free(ctx, ctx->owned);
    tm__host_free(ctx, ctx->scope_log);
    for (int b = 0; b < TM__NBACKENDS; b++)
        if (ctx->be[b] && ctx->be[b]->shutdown) ctx->be[b]->shutdown(ctx, ctx->state[b]);
    tm__host_free(ctx, ctx);
}

tm_status tm__ctx_segs(tm_ctx *ctx, tm_device dev, int cap, tm__segs **out) {
    int b = tm__backend(dev);
    if (!ctx->segs[b]) TM__TRY(tm__segs_new(ctx, "tm_ctx_clip_grad_norm", dev, cap, &ctx->segs[b]));
    *out = ctx->segs[b];
    return TM_OK;
}

const char *tm_ctx_errmsg(const tm_ctx *ctx) { return ctx ? ctx->errmsg : "context is NULL"; }

tm_status tm__err(tm_ctx *ctx, tm_status s, const char *fmt, ...) {
    if (!ctx) return s;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->errmsg, sizeof ctx->errmsg, fmt, ap);
    va_end(ap);
    return s;
}

static char *desc_buf(tm_ctx *ctx) {
    static _Thread_local char fallback[128]; /* only when ctx is NULL */
    if (!ctx) return fallback;
    char *b = ctx->desc[ctx->desc_next];
    ctx->desc_next = (ctx->desc_next + 1) % 8;
    return b;
}

static int shape_str(char *b, size_t n, int ndim, const int64_t *shape) {
    int k = snprintf(b, n, "[");
    for (int i = 0; i < ndim && k < (int)n; i++)
        k += snprintf(b + k, n - k, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (k < (int)n) k += snprintf(b + k, n - k, "]");
    return k;
}

const char *tm__sdesc(tm_ctx *ctx, int ndim, const int64_t *shape) {
    char *b = desc_buf(ctx);
    shape_str(b, 128, ndim, shape);
    return b;
}

const char *tm__tdesc(tm_ctx *ctx, const tm_tensor *t) {
    char *b = desc_buf(ctx);
    if (!t) {
        snprintf(b, 128, "NULL");
        return b;
    }
    int k = snprintf(b, 128, "%s", tm_dtype_name(t->dtype));
    k += shape_str(b + k, 128 - k, t->ndim, t->shape);
    if (k < 128) {
        if (t->device.type == TM_DEVICE_CPU)
            snprintf(b + k, 128 - k, "@cpu");
        else
            snprintf(b + k, 128 - k, "@cuda:%d", t->device.index);
    }
    return b;
}

int tm__nthreads(const tm_ctx *ctx) { return ctx->n_threads; }
int tm__grad_enabled(const tm_ctx *ctx) { return ctx->grad_enabled; }
int tm__cpu_gemm_builtin(const tm_ctx *ctx) { return ctx->cpu_gemm_builtin; }
void *tm__cuda_state(const tm_ctx *ctx) { return ctx->state[TM__CUDA]; }

int tm_ctx_set_grad_enabled(tm_ctx *ctx, int enabled) {
    if (!ctx) return 0;
    int prev = ctx->grad_enabled;
    ctx->grad_enabled = enabled ? 1 : 0;
    return prev;
}

uint64_t tm_ctx_alloc_count(const tm_ctx *ctx) { return ctx ? ctx->alloc_count : 0; }

tm_status tm_ctx_sync(tm_ctx *ctx) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    /* The CUDA backend counts its own wait; a CPU-only context counts the call itself, where a
     * CUDA run would wait (tm_ctx_sync_count). */
    if (!ctx->be[TM__CUDA]) tm__count_sync(ctx);
    for (int b = 0; b < TM__NBACKENDS; b++)
        if (ctx->be[b]) TM__TRY(ctx->be[b]->sync(ctx));
    return TM_OK;
}

uint64_t tm_ctx_sync_count(const tm_ctx *ctx) { return ctx ? ctx->sync_count : 0; }

double tm_ctx_sync_seconds(const tm_ctx *ctx) { return ctx ? ctx->sync_seconds : 0.0; }

void tm_ctx_arena_reset(tm_ctx *ctx) {
    if (!ctx) return;
    /* nothing beside the work may still use the arena's memory (a failed step may have left
     * collectives unwaited) */
    (void)tm__side_finish_all(ctx);
    tm__fsdp_reset(ctx);
    for (int b = 0; b < TM__NBACKENDS; b++) tm__arena_reset(ctx, &ctx->arena[b]);
    tm__arena_reset(ctx, &ctx->meta);
    ctx->tape = NULL;
    ctx->scope_n = ctx->scope_depth = 0;
    ctx->mirrors = NULL; /* they lived in the meta arena */
}

static const tm__arena *arena_of(const tm_ctx *ctx, tm_device dev) {
    if (!ctx) return NULL;
    if (dev.type == TM_DEVICE_CPU) return &ctx->arena[TM__CPU];
    if (dev.type == TM_DEVICE_CUDA && ctx->be[TM__CUDA] && dev.index == ctx->cuda_device) return &ctx->arena[TM__CUDA];
    return NULL;
}
size_t tm_ctx_arena_used(const tm_ctx *ctx, tm_device dev) {
    const tm__arena *a = arena_of(ctx, dev);
    return a ? a->used : 0;
}
size_t tm_ctx_arena_peak(const tm_ctx *ctx, tm_device dev) {
    const tm__arena *a = arena_of(ctx, dev);
    return a ? a->peak : 0;
}

tm_status tm_ctx_kernel_report(const tm_ctx *ctx, tm_kernel_report *out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err((tm_ctx *)ctx, TM_ERR_INVALID_ARG, "tm_ctx_kernel_report: out is NULL");
    memset(out, 0, sizeof *out);
    if (ctx->cuda_device < 0) return TM_OK;
    out->grouped_gemm = ctx->gmm_device;
    out->grouped_swiglu_fused = ctx->gsw_fused;
    out->grouped_mlp_fused = ctx->gmlp_fused_n;
    out->attention_sm90 = ctx->attn_sm90;
    out->gating_split = ctx->gating_split_n;
    snprintf(out->grouped_gemm_note, sizeof out->grouped_gemm_note, "%s", ctx->gmm_note);
    return TM_OK;
}

tm_status tm_ctx_memory_report(const tm_ctx *ctx, tm_device dev, tm_memory_report *out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    tm_ctx *c = (tm_ctx *)ctx; /* messages only */
    if (!out) return tm__err(c, TM_ERR_INVALID_ARG, "tm_ctx_memory_report: out is NULL");
    if (!arena_of(ctx, dev)) {
        if (dev.type == TM_DEVICE_CUDA)
            return tm__err(c, TM_ERR_DEVICE, "tm_ctx_memory_report: cuda:%d is not this context's device (cuda_device=%d)",
                           dev.index, ctx->cuda_device);
        return tm__err(c, TM_ERR_DEVICE, "tm_ctx_memory_report: unknown device type %d", (int)dev.type);
    }
    const tm__mem_stats *m = &ctx->mem[tm__backend(dev)];
    memset(out, 0, sizeof *out);
    for (int i = 0; i < TM_MEM_NCATEGORIES; i++) {
        out->current[i] = m->current[i];
        out->peak[i] = m->peak[i];
        out->at_peak[i] = m->at_peak[i];
    }
    out->total = m->total;
    out->total_peak = m->total_peak;
    const tm__arena *a = arena_of(ctx, dev);
    out->reserved = a->reserved;
    out->reserved_peak = a->reserved_peak;
    out->arena_trims = a->n_trims;
    return TM_OK;
}

void tm_ctx_memory_reset_peak(tm_ctx *ctx) {
    if (!ctx) return;
    for (int b = 0; b < TM__NBACKENDS; b++) {
        tm__mem_stats *m = &ctx->mem[b];
        memcpy(m->peak, m->current, sizeof m->peak);
        memcpy(m->at_peak, m->current, sizeof m->at_peak);
        m->total_peak = m->total;
        ctx->arena[b].reserved_peak = ctx->arena[b].reserved;
    }
}

void tm__set_gmm_device_schedule(tm_ctx *ctx, int mode) {
    if (ctx) ctx->gmm_device = mode == TM_GROUPED_GEMM_HOPPER ? mode : mode ? TM_GROUPED_GEMM_DEVICE : 0;
}

int tm__gmm_device_schedule(tm_ctx *ctx) { return ctx->gmm_device != TM_GROUPED_GEMM_CUBLASLT; }

int tm__gmm_mode(tm_ctx *ctx) { return ctx->gmm_device; }

int tm__gmm_auto(const tm_ctx *ctx) { return ctx->gmm_auto; }

const char *tm__gmm_note(tm_ctx *ctx) { return ctx->gmm_note; }

void tm__gmm_set_note(tm_ctx *ctx, const char *why) { snprintf(ctx->gmm_note, sizeof ctx->gmm_note, "%s", why); }

uint64_t tm__gsw_fused_launches(const tm_ctx *ctx) { return ctx->gsw_fused; }

void tm__gsw_fused_count(tm_ctx *ctx) { ctx->gsw_fused++; }

uint64_t tm__attn_sm90_launches(const tm_ctx *ctx) { return ctx->attn_sm90; }

void tm__attn_sm90_count(tm_ctx *ctx) { ctx->attn_sm90++; }

void tm__attn_set_sm80(tm_ctx *ctx, int on) { ctx->attn_sm80 = on != 0; }

int tm__attn_sm80(const tm_ctx *ctx) { return ctx->attn_sm80; }

void tm__gating_set_split(tm_ctx *ctx, int on) { ctx->gating_split = on != 0; }

int tm__gating_split(const tm_ctx *ctx) { return ctx->gating_split; }

uint64_t tm__gating_split_launches(const tm_ctx *ctx) { return ctx->gating_split_n; }

void tm__gating_split_count(tm_ctx *ctx) { ctx->gating_split_n++; }

void tm__grouped_mlp_set_fused(tm_ctx *ctx, int on) { ctx->gmlp_fused = on != 0; }

int tm__grouped_mlp_fused(const tm_ctx *ctx) { return ctx->gmlp_fused; }

uint64_t tm__grouped_mlp_fused_launches(const tm_ctx *ctx) { return ctx->gmlp_fused_n; }

void tm__grouped_mlp_fused_count(tm_ctx *ctx) { ctx->gmlp_fused_n++; }
