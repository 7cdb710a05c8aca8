/*
 * ctx_internal.h — the context struct, known only to the framework sources (kernels use the accessor
 * functions in internal.h).
 */
#ifndef TM_CTX_INTERNAL_H
#define TM_CTX_INTERNAL_H

#include "internal.h"

/* A bump arena over a list of chunks. Reset rewinds every chunk; the chunks stay, so a step
 * that repeats the previous step's allocation sequence reuses exactly the same chunks and
 * performs no system allocation. */
typedef struct tm__chunk {
    void *mem;
    size_t size, used;
} tm__chunk;

typedef struct tm__arena {
    tm_device dev;
    tm__chunk *chunks;
    int n, cap, cur;
    size_t used, peak; /* bytes handed out since reset; high-water mark */
} tm__arena;

/* A growable contiguous buffer (the parameters of a bucket, or their gradients). */
typedef struct tm__pool {
    tm__storage st; /* st.nbytes is the capacity */
    size_t used;
} tm__pool;

/* A bucket: the parameters of one (device, dtype, group) in one contiguous buffer, their
 * gradients in another with the same layout, and, once an optimizer asked for it, an f32
 * master copy of bf16 parameters (framework/param.c). Parameters sit in creation order, each
 * aligned to TM__ALIGN bytes; padding is zero in all three. Storages grow (and move) as
 * parameters are added, which is why tensors keep (storage, offset). */
typedef struct tm__bucket {
    tm_bucket_info info;
    tm__pool params, grads, master;
    int has_master;
    tm_tensor flat[3]; /* 1-D views of the used range: params, grads, master (TM_BUCKET_*) */
} tm__bucket;

typedef struct tm__node {
    tm__call call;
    struct tm__node *prev;
} tm__node;

struct tm_ctx {
    tm_allocator alloc;
    int has_alloc;
    int n_threads;
    int grad_enabled;
    int cpu_gemm_builtin; /* tm_ctx_options.cpu_gemm == TM_CPU_GEMM_BUILTIN */
    uint64_t alloc_count;
    size_t chunk_bytes;
    char errmsg[1024];
    char desc[8][128];
    int desc_next;

    tm__arena arena[TM__NBACKENDS]; /* per-step tensor data, per backend */
    tm__arena meta;                 /* per-step host bookkeeping: headers, tape nodes */

    tm__bucket **buckets; /* parameter storage, in order of first use */
    int n_buckets, cap_buckets;
    tm_tensor **named; /* params and buffers, creation order */
    int n_named, cap_named;
    int n_params;
    tm__storage **owned; /* storages of buffers, freed with the context */
    int n_owned, cap_owned;

    tm__node *tape; /* most recent node; linked backwards */

    const tm__backend_ops *be[TM__NBACKENDS]; /* registered backends; be[TM__CUDA] NULL without a device */
    void *state[TM__NBACKENDS];           /* each backend's per-context state (tm__cuda_state) */
    int cuda_device;
    uint64_t sync_count;                  /* device-to-host synchronisations (tm_ctx_sync_count) */

    int perturb_op; /* tests: op id whose backward sees a scaled upstream grad; -1 off */
};

void tm__arena_reset(tm__arena *a);
void tm__arena_release(tm_ctx *ctx, tm__arena *a);
/* Device allocation for the given device (host allocator or cudaMalloc), counted. */
void *tm__dev_alloc(tm_ctx *ctx, tm_device dev, size_t nbytes);
void tm__dev_free(tm_ctx *ctx, tm_device dev, void *p);
tm_status tm__dev_memset0(tm_ctx *ctx, tm_device dev, void *p, size_t nbytes);
/* Place a new parameter t (header filled, storage not yet) in the bucket of its (device,
 * dtype, group); allocates its gradient header (framework/param.c). */
tm_status tm__param_place(tm_ctx *ctx, const char *fn, tm_tensor *t, const tm_param_options *opts);
/* Free every bucket's memory (tm_ctx_free). */
void tm__buckets_free(tm_ctx *ctx);
/* Run the forward (backward=0) or backward kernel of a call on its backend (dispatch.c). */
tm_status tm__run_kernel(tm__call *c, int backward);

#endif
