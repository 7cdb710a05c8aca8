/*
 * tinymoe.h — the public contract of tinymoe, an embeddable training microframework.
 *
 * Everything a program may use is declared here; every other symbol is private (tm__ prefix).
 *
 * Conventions (read once, they hold for every function below):
 *  - Errors: every fallible function returns a tm_status. TM_OK is 0. On failure the
 *    context's last-error message (tm_ctx_errmsg) names the op, the offending argument and,
 *    for tensors, their shapes, dtypes and devices. Nothing is half-written: output pointers
 *    are only set on success. No function calls exit() or abort().
 *    Each function's comment lists the codes it returns and when ("Errors: ..."); two hold for
 *    every function and are not repeated: a NULL ctx (or NULL model / moe / optimizer handle
 *    where that is the first argument) returns TM_ERR_INVALID_ARG without a message (there is
 *    nowhere to put one; the *_config_check and tm_lr_schedule_check functions accept a NULL
 *    ctx), and TM_ERR_INTERNAL means a bug in tinymoe. TM_ERR_CUDA only ever comes from CUDA
 *    work (a CUDA device, CUDA tensors).
 *  - Ownership: a tm_ctx owns every tensor made through it. Tensors produced by ops and by
 *    tm_tensor_empty/zeros/from_host are *temporaries*: they live in the context's per-step
 *    arena and become invalid at tm_ctx_arena_reset(). Parameters (tm_param_new) and buffers
 *    (tm_buffer_new) are *persistent*: they live until tm_ctx_free().
 *  - Shapes: up to TM_MAX_DIMS dimensions, row-major. Negative axes count from the end.
 *  - Threads: a context is not thread-safe; use one context per thread. Two contexts in one
 *    process share no mutable state.
 *  - *_free(NULL) is a no-op.
 */
#ifndef TINYMOE_H
#define TINYMOE_H

#include <stddef.h>
#include <stdint.h>

/* TM_API marks every function of the public contract. The library is compiled with
 * -fvisibility=hidden, so these are the only symbols libtinymoe.so exports (the Makefile's
 * `make test` checks it); the tm__ internals stay inside it. */
#if defined(__GNUC__) || defined(__clang__)
#define TM_API __attribute__((visibility("default")))
#else
#define TM_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define TM_VERSION_MAJOR 0
#define TM_VERSION_MINOR 1
#define TM_VERSION_PATCH 0
#define TM_VERSION_STRING "0.1.0"
/* MAJOR*10000 + MINOR*100 + PATCH, comparable with tm_version_number(). */
#define TM_VERSION_NUMBER (TM_VERSION_MAJOR * 10000 + TM_VERSION_MINOR * 100 + TM_VERSION_PATCH)

/* The version of the library actually linked (may differ from the header's macros). */
TM_API const char *tm_version(void);
TM_API int tm_version_number(void);

/* ------------------------------------------------------------------------------------------ */
/* Status codes                                                                                */
/* ------------------------------------------------------------------------------------------ */

typedef enum tm_status {
    TM_OK = 0,
    TM_ERR_INVALID_ARG = 1, /* null pointer, bad flag or attribute value */
    TM_ERR_SHAPE = 2,       /* shapes do not agree */
    TM_ERR_DTYPE = 3,       /* dtype not accepted by the op */
    TM_ERR_DEVICE = 4,      /* tensors on different devices, or device not available */
    TM_ERR_INDEX = 5,       /* an index value out of range (e.g. token id >= vocab) */
    TM_ERR_NOMEM = 6,       /* host or device allocation failed */
    TM_ERR_UNSUPPORTED = 7, /* valid request that this build/backend does not implement */
    TM_ERR_STATE = 8,       /* call not valid in the context's current state */
    TM_ERR_CUDA = 9,        /* a CUDA runtime / cuBLASLt call failed */
    TM_ERR_IO = 10,         /* file or stream I/O failed */
    TM_ERR_INTERNAL = 11,   /* a bug in tinymoe: please report */
    TM_ERR_COMM = 12        /* a collective failed or timed out, or the ranks disagree (Distributed) */
} tm_status;

/* A short constant description of a status code ("shape mismatch", ...). Never NULL. */
TM_API const char *tm_status_str(tm_status s);

/* ------------------------------------------------------------------------------------------ */
/* Types                                                                                       */
/* ------------------------------------------------------------------------------------------ */

#define TM_MAX_DIMS 4

typedef enum tm_dtype {
    TM_F32 = 0,  /* IEEE binary32 */
    TM_BF16 = 1, /* bfloat16; on the CPU storage only (computed in f32, rounded to nearest even) */
    TM_F64 = 2,  /* IEEE binary64; CPU only; meant for gradient checks */
    TM_I32 = 3,
    TM_I64 = 4,
    TM_U8 = 5,   /* also used for booleans (0/1) */
    TM_NDTYPES = 6
} tm_dtype;

/* Name ("f32", "bf16", ...) and size in bytes of a dtype; "?" / 0 when out of range. */
TM_API const char *tm_dtype_name(tm_dtype dt);
TM_API size_t tm_dtype_size(tm_dtype dt);

typedef enum tm_device_type { TM_DEVICE_CPU = 0, TM_DEVICE_CUDA = 1 } tm_device_type;

typedef struct tm_device {
    tm_device_type type;
    int index; /* CUDA device ordinal; 0 for the CPU */
} tm_device;

static inline tm_device tm_cpu(void) { tm_device d = {TM_DEVICE_CPU, 0}; return d; }
static inline tm_device tm_cuda(int index) { tm_device d = {TM_DEVICE_CUDA, index}; return d; }

typedef struct tm_ctx tm_ctx;
typedef struct tm_tensor tm_tensor;

/* Optional allocator hook for host memory (tinymoe's own bookkeeping, arenas, parameters).
 * All three must be set, or the struct not given. `user` is passed back unchanged.
 * alloc must return memory aligned to at least 64 bytes or NULL on failure. */
typedef struct tm_allocator {
    void *(*alloc)(size_t nbytes, size_t alignment, void *user);
    void (*free)(void *ptr, void *user);
    void *user;
} tm_allocator;

/* ------------------------------------------------------------------------------------------ */
/* Context                                                                                     */
/* ------------------------------------------------------------------------------------------ */

typedef struct tm_ctx_options {
    const tm_allocator *allocator; /* NULL: aligned_alloc/free */
    int num_threads;               /* CPU threads for kernels; <= 0: all available */
    int cuda_device;               /* CUDA ordinal this context may use; -1: CPU only */
    size_t arena_chunk_bytes;      /* growth quantum of the per-step arenas; 0: 64 MiB */
    int cpu_gemm;                  /* TM_CPU_GEMM_AUTO (0): CBLAS when the build has it;
                                    * TM_CPU_GEMM_BUILTIN: always the built-in blocked kernel, so
                                    * results do not depend on whether the build found OpenBLAS */
    int grouped_gemm;              /* bf16 tm_grouped_matmul on CUDA (see there):
                                    * TM_GROUPED_GEMM_CUBLASLT (0): one cuBLASLt GEMM per group
                                    * from host group sizes (one wait per call without a host copy);
                                    * TM_GROUPED_GEMM_DEVICE: one tensor-core kernel over all groups,
                                    * sizes taken on the device, never a wait (slower per GEMM);
                                    * TM_GROUPED_GEMM_HOPPER: the same contract (never a wait) on a
                                    * Hopper (sm_90) wgmma + TMA kernel; on other GPUs, shapes (K or
                                    * N not a multiple of 8, more than 1024 groups) or unaligned
                                    * data it takes TM_GROUPED_GEMM_DEVICE's kernel instead;
                                    * TM_GROUPED_GEMM_AUTO (tm_ctx_options_default): HOPPER when the
                                    * context's CUDA device is sm_90 and this build holds the sm_90a
                                    * kernel, CUBLASLT otherwise (decided once, at tm_ctx_new; on an
                                    * H100 the fine preset's step: 82.9 -> 70.3 ms, coarse 73.3 -> 72.8,
                                    * docs/PERFORMANCE.md) */
    int no_grad_buffers;           /* 1: a context that only runs forwards (evaluation, sampling,
                                    * export): its parameters get no gradient buffer, which halves
                                    * the memory of an f32 model's parameters + gradients and the
                                    * time to make them; tm_tensor_grad of a parameter is NULL,
                                    * tm_ctx_bucket_tensor(.., TM_BUCKET_GRADS) is NULL, and
                                    * tm_backward / tm_backward_with_grad and making an optimizer
                                    * fail with TM_ERR_STATE naming this option. 0 (default):
                                    * parameters have gradients */
    int plan_only;                 /* 1: a context that lays things out without computing
                                    * (`tinymoe plan`): parameters, gradient buffers, master
                                    * weights, optimizer state and buffers are placed and counted
                                    * in tm_ctx_memory_report exactly as in a context that
                                    * computes (the same code places them), but its CPU device
                                    * allocates nothing: their addresses are placeholders no code
                                    * reads, copies and fills do nothing, and ops, tm_tensor_read
                                    * and tm_tensor_write fail with TM_ERR_STATE. With
                                    * tm_comm_options.plan_world_size it lays out one rank of a
                                    * world that need not exist; tm_model_plan_step gives a step's
                                    * traffic and transient bytes. Requires cuda_device = -1 (the
                                    * layout of a CUDA run is the same). 0 (default): computes */
} tm_ctx_options;

enum { TM_CPU_GEMM_AUTO = 0, TM_CPU_GEMM_BUILTIN = 1 };
enum { TM_GROUPED_GEMM_CUBLASLT = 0, TM_GROUPED_GEMM_DEVICE = 1, TM_GROUPED_GEMM_HOPPER = 2, TM_GROUPED_GEMM_AUTO = 3 };

/* Defaults: no allocator hook, all threads, CPU only, 64 MiB chunks, CPU GEMM auto, grouped
 * GEMM auto, gradient buffers. */
TM_API tm_ctx_options tm_ctx_options_default(void);

/* Make a context. opts may be NULL (defaults). Errors: TM_ERR_INVALID_ARG (out NULL; an
 * allocator whose alloc or free is NULL; cpu_gemm not one of TM_CPU_GEMM_*; grouped_gemm not one of TM_GROUPED_GEMM_*), TM_ERR_NOMEM (host memory; the cuBLASLt workspace),
 * TM_ERR_DEVICE (cuda_device >= 0 but CUDA absent from the build or no such device; the
 * message says which), TM_ERR_CUDA (selecting the device, creating its stream or the cuBLASLt
 * handle failed). On failure *out is NULL (unless out is NULL) and, since no context exists to
 * hold a message, the reason is available from tm_last_create_error(). */
TM_API tm_status tm_ctx_new(tm_ctx **out, const tm_ctx_options *opts);

/* Message of the last failed tm_ctx_new in this thread (thread-local; "" if none). */
TM_API const char *tm_last_create_error(void);

/* Free the context and everything it owns (tensors, parameters, device memory). NULL: no-op. */
TM_API void tm_ctx_free(tm_ctx *ctx);

/* Message of the context's last failed call: names the op and its arguments ("" if nothing
 * failed yet; successful calls leave it unchanged, so read it right after a failure). The
 * pointer stays valid until the next call on the context. */
TM_API const char *tm_ctx_errmsg(const tm_ctx *ctx);

/* Number of CUDA devices visible (0 when the build has no CUDA or no driver/device). */
TM_API int tm_cuda_device_count(void);

/* Wait for all queued device work of the context to finish (nothing to do without CUDA).
 * Errors: TM_ERR_CUDA (a failed kernel launched earlier may report here). */
TM_API tm_status tm_ctx_sync(tm_ctx *ctx);

/* Release every temporary tensor and the autograd tape (all arena tensor handles become
 * invalid). Memory is kept for the next step, so a steady-state training step performs no
 * system allocation. Parameters, gradients and buffers are untouched. Call it after the
 * optimizer step. */
TM_API void tm_ctx_arena_reset(tm_ctx *ctx);

/* Count of system allocations (host allocator calls and cudaMalloc) this context has made
 * since creation. A second identical training step leaves it unchanged. */
TM_API uint64_t tm_ctx_alloc_count(const tm_ctx *ctx);

/* Count of device-to-host synchronisations this context has made since creation: the points
 * where the host waits for the device's queue. Tests bound it to show that a training step
 * does not stall the device more than its design needs.
 * CUDA counts every device-to-host copy (tm_tensor_read of a device tensor, a row count,
 * statistic or error flag read back by an op) and every tm_ctx_sync.
 * The CPU counts at the same logical points, where a CUDA run would wait, so that a CPU-only
 * build (CI) can bound round trips too: one per tm_tensor_read of a non-empty CPU tensor; one
 * per tm_ctx_sync of a context without a CUDA device; one per forward of an op that must read
 * data back to size its outputs (tm_moe_permute: its row count R, only where R depends on the
 * data: not with pad_to > 0, nor with tm_moe_permute_topk and align_size 1, whose
 * tokens_per_expert then stay on the device; see there) or to report an error (the
 * bad-target flag of tm_cross_entropy's CUDA forward, when there are rows; the bad-index flag
 * of the CUDA forwards of tm_embedding, tm_index_select, tm_gather and tm_scatter_add, when
 * there are indices); one per f32 tm_grouped_matmul (forward or backward) whose counts have no
 * host mirror (see there; so does bf16, except under tm_ctx_options.grouped_gemm = TM_GROUPED_GEMM_DEVICE, which reads nothing back). tm_index_check reads nothing back, and tm_model_forward, which
 * checks its ids with it, embeds them without the flag read. tm_moe_unpermute reads nothing
 * back either (its CUDA kernels skip bad rows instead of reading row_token back). Nothing is
 * counted twice (a CUDA tensor's read counts its copy only). Never decreases; wraps only after
 * 2^64. */
TM_API uint64_t tm_ctx_sync_count(const tm_ctx *ctx);

/* Wall-clock seconds (monotonic clock) the host has spent blocked on a device since the
 * context was created: inside the CUDA stream synchronisations that tm_ctx_sync_count counts
 * (a device-to-host copy, tm_ctx_sync) and waiting for NCCL collectives. 0 without a device
 * (the CPU backend's counted points wait for nothing). Over a training step, the step's time
 * minus this is the host's own work: a wait near zero means the GPU finished before the host
 * asked, i.e. the step is bound by the host's launches, not by the GPU. Never decreases; 0 for
 * a NULL ctx. */
TM_API double tm_ctx_sync_seconds(const tm_ctx *ctx);

/* Bytes of arena currently handed out on a device (0 after tm_ctx_arena_reset) and the
 * high-water mark since creation. */
TM_API size_t tm_ctx_arena_used(const tm_ctx *ctx, tm_device dev);
TM_API size_t tm_ctx_arena_peak(const tm_ctx *ctx, tm_device dev);

/* Memory of a context on one device, by category, in bytes:
 *   TM_MEM_PARAMETERS   the parameter buffer's bytes in use (each parameter padded to 64 bytes);
 *                       under ZeRO-3 (tm_comm_options.zero) the parameter blocks, and each
 *                       all-gathered weight while it is held, so peak[] less current[] is the
 *                       most gathered at once (this peak restarts when the optimizer shards the
 *                       parameters)
 *   TM_MEM_GRADIENTS    the parameter-gradient buffer's bytes in use (same layout); under ZeRO-2
 *                       and 3 the gradient shard of each bucket (its ZeRO block) always, and
 *                       (ZeRO-2 only) the full buffer (G ZeRO blocks) from a step's first
 *                       backward to tm_comm_sync_grads, so current[] between steps is the shards
 *                       and peak[] the shards plus the full buffer
 *   TM_MEM_OPTIMIZER    optimizer state (AdamW moments, SGD momentum, step counters) and the f32
 *                       master weights of bf16 buckets
 *   TM_MEM_BUFFERS      every other persistent buffer (tm_buffer_new: expert_bias, counters)
 *   TM_MEM_TEMPORARIES  the per-step arena's bytes handed out (tensors of the step: activations,
 *                       saved tensors, gradients of temporaries, kernel scratch); blocks given
 *                       back during the step (consumed gradients, saved tensors after their
 *                       backward, scratch after its kernel) no longer count.
 * Not included: the host bookkeeping arena (tensor headers, tape), KV caches, the CUDA
 * library's own workspace, and the unused capacity of the growable buffers and arena chunks. */
typedef enum tm_mem_category {
    TM_MEM_PARAMETERS = 0,
    TM_MEM_GRADIENTS,
    TM_MEM_OPTIMIZER,
    TM_MEM_BUFFERS,
    TM_MEM_TEMPORARIES,
    TM_MEM_NCATEGORIES
} tm_mem_category;

typedef struct tm_memory_report {
    size_t current[TM_MEM_NCATEGORIES]; /* bytes in use now */
    size_t peak[TM_MEM_NCATEGORIES];    /* each category's own high-water mark */
    size_t total;                       /* sum of current[] */
    size_t total_peak;                  /* high-water mark of the sum (<= the sum of peak[]) */
    size_t at_peak[TM_MEM_NCATEGORIES]; /* current[] when total_peak was reached; sums to it */
    /* The per-step arena's chunks: bytes held from the device (in use by TM_MEM_TEMPORARIES or
     * free for the next request) and their high-water mark. What the process holds of the
     * device is about total - current[TM_MEM_TEMPORARIES] + reserved. The arena is a best-fit
     * allocator that reuses freed bytes for requests of any size; when a step needs more, it
     * replaces its chunks at the next tm_ctx_arena_reset by one chunk of about 1.125x the
     * step's in-use peak, so reserved stays near peak[TM_MEM_TEMPORARIES] when shapes change
     * from step to step (ragged MoE dispatch). */
    size_t reserved, reserved_peak;
    uint64_t arena_trims; /* times the arena gave chunks back to the device (consolidations, retries) */
} tm_memory_report;

/* Fill *out with the memory of `dev` (the CPU, or the context's CUDA device). High-water
 * marks run from context creation or the last tm_ctx_memory_reset_peak.
 * Errors: TM_ERR_INVALID_ARG (out NULL), TM_ERR_DEVICE (dev not a device of the context). */
TM_API tm_status tm_ctx_memory_report(const tm_ctx *ctx, tm_device dev, tm_memory_report *out);
/* Which kernels the context's ops took where a faster path depends on the device, dtype and
 * shapes (so that a user can see whether a run was on the fast path; `tinymoe train` prints it
 * after a CUDA run). Counts run from context creation, summed over forwards and backwards. */
typedef struct tm_kernel_report {
    int grouped_gemm;              /* the bf16 grouped GEMM path in use: TM_GROUPED_GEMM_CUBLASLT,
                                    * _DEVICE or _HOPPER (AUTO resolved at tm_ctx_new) */
    uint64_t grouped_swiglu_fused; /* tm_grouped_swiglu forwards (tm_grouped_mlp's included) whose
                                    * two projections and SwiGLU ran as one Hopper launch */
    uint64_t grouped_mlp_fused;    /* tm_grouped_mlp backwards whose down projection's dx ran
                                    * SwiGLU's backward in its epilogue (one Hopper launch) */
    uint64_t attention_sm90;       /* tm_attention forwards and backwards on the Hopper kernels */
    uint64_t gating_split;         /* tm_moe_gating launches on the split bf16 tensor-core path */
    char grouped_gemm_note[256];   /* why the last bf16 grouped GEMM under TM_GROUPED_GEMM_HOPPER
                                    * did not take the Hopper kernel; "" when it did (or none ran) */
} tm_kernel_report;

/* Fill *out (all zero on a context without a CUDA device). Errors: TM_ERR_INVALID_ARG (ctx or
 * out NULL). */
TM_API tm_status tm_ctx_kernel_report(const tm_ctx *ctx, tm_kernel_report *out);

/* Restart every high-water mark of the memory report (all devices) at the current values,
 * e.g. to measure one training step. tm_ctx_arena_peak is not affected. NULL: no-op. */
TM_API void tm_ctx_memory_reset_peak(tm_ctx *ctx);

/* Enable (1) or disable (0) recording of the autograd tape; returns the previous setting.
 * With recording off (evaluation, sampling) ops produce tensors without grad history. */
TM_API int tm_ctx_set_grad_enabled(tm_ctx *ctx, int enabled);

/* ------------------------------------------------------------------------------------------ */
/* Tensors                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Temporary tensors (arena). shape has ndim entries, each >= 0, ndim in [0, TM_MAX_DIMS]
 * (ndim 0 = scalar). Errors: TM_ERR_INVALID_ARG (out NULL, ndim outside [0, TM_MAX_DIMS],
 * shape NULL with ndim > 0, a negative size), TM_ERR_DTYPE (dt not a tm_dtype; f64 on CUDA),
 * TM_ERR_DEVICE (a CUDA device other than the context's cuda_device, or none; an unknown
 * device type), TM_ERR_NOMEM; tm_tensor_zeros on CUDA also TM_ERR_CUDA. */
TM_API tm_status tm_tensor_empty(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                          tm_tensor **out);
TM_API tm_status tm_tensor_zeros(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                          tm_tensor **out);
/* Copy numel elements of src_dt from host memory `src` into a new temporary of dtype dt
 * (converted; float->bf16 rounds to nearest even; float->int truncates).
 * Errors: as tm_tensor_empty, plus TM_ERR_INVALID_ARG (src NULL), TM_ERR_DTYPE (src_dt not a
 * tm_dtype), TM_ERR_CUDA (the upload). */
TM_API tm_status tm_tensor_from_host(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape,
                              tm_device dev, tm_dtype src_dt, const void *src, tm_tensor **out);

/* Persistent trainable parameter of the dense group (tm_param_new_ex below): allocated in its
 * bucket's contiguous parameter buffer (or placed there without memory until
 * tm_ctx_materialize_params, below), with its gradient (zeroed) in the bucket's gradient
 * buffer (none under tm_ctx_options.no_grad_buffers). A bf16 parameter written with tm_tensor_write (or initialised) after an optimizer
 * made its f32 master copy has the master rewritten from the same values.
 * `name` (<= 127 bytes, unique in the context) keys the counter-based RNG and checkpoints.
 * Contents are zero until initialised (tm_tensor_init_normal / tm_tensor_write).
 * Errors: as tm_tensor_empty, plus TM_ERR_INVALID_ARG (name NULL, empty, over 127 bytes, or
 * already the name of a parameter or buffer of the context), TM_ERR_DTYPE (not a float
 * dtype), TM_ERR_CUDA (growing the CUDA parameter buffer copies it). */
TM_API tm_status tm_param_new(tm_ctx *ctx, const char *name, tm_dtype dt, int ndim, const int64_t *shape,
                       tm_device dev, tm_tensor **out);
/* Deferred placement: the parameters made between tm_ctx_defer_params and
 * tm_ctx_materialize_params (tm_param_new, tm_param_new_ex, tm_moe_new, tm_model_new) take
 * their place in their bucket but no memory; tm_ctx_materialize_params then allocates each
 * bucket's parameter (and gradient) buffer once, at exactly the size its parameters use, and
 * zeroes it. Without it a bucket grows by doubling as parameters are added, each growth a
 * copy of the bucket (a model of N bytes is copied about log2(N / 1 MiB) times and may hold
 * up to 2N). Like PyTorch's "meta" device followed by to_empty() (torch.nn.Module.to_empty),
 * except that the parameters keep their handles. tm_model_new does this itself when no
 * deferral is in force (a caller's deferral around it covers it: one allocation per bucket
 * for everything made inside).
 * While deferred, a parameter made since has no data: tm_tensor_read / _write / _fill and
 * every op given it fail with TM_ERR_STATE naming it and tm_ctx_materialize_params, and its
 * bucket's flat views (tm_ctx_bucket_tensor) are not to be used. Buffers (tm_buffer_new) are
 * allocated as usual.
 * tm_ctx_defer_params errors: TM_ERR_INVALID_ARG (ctx NULL), TM_ERR_STATE (already deferred).
 * tm_ctx_materialize_params errors: TM_ERR_INVALID_ARG (ctx NULL), TM_ERR_STATE (no deferral in
 * force), TM_ERR_NOMEM naming the bucket (the deferral stays in force for the buckets not yet
 * allocated; the call may be repeated), TM_ERR_CUDA. tm_ctx_params_deferred: 1 while deferred,
 * else 0 (also for NULL). */
TM_API tm_status tm_ctx_defer_params(tm_ctx *ctx);
TM_API tm_status tm_ctx_materialize_params(tm_ctx *ctx);
TM_API int tm_ctx_params_deferred(const tm_ctx *ctx);

/* Parameter groups and buckets.
 * Every parameter belongs to a group: dense (replicated over the data-parallel ranks: attention,
 * norms, router, embeddings) or expert (the weights of routed experts [expert_lo, expert_hi),
 * stacked along dim 0; with expert parallelism a rank holds a contiguous range of them). The
 * context stores parameters in buckets keyed by (device, dtype, group): each bucket holds its
 * parameters in one contiguous buffer (creation order, 64-byte aligned, zero padding), their
 * gradients in a second buffer of the same layout, and, once an optimizer asks for it, an f32
 * master copy of bf16 parameters (mixed precision as in Megatron-LM and llm.c: bf16 compute
 * weights, f32 master weights and optimizer state). A collective or an optimizer shard then
 * covers one bucket, or an element range [lo, hi) of one.
 * A parameter also records its logical (global) shape and, when it is a shard of a larger
 * tensor, its offset along the sharded axis, so checkpoints can store whole logical tensors.
 * Units (ZeRO-3 / FSDP, tm_comm_options.zero = 3): a parameter also belongs to a unit, the
 * context's current one when it is made (tm_ctx_set_param_unit; 0 by default), as a module
 * wrapped by PyTorch's FSDP is one FlatParameter. When the communicator asks for ZeRO-3 as the
 * parameter is made, buckets are keyed by (device, dtype, group, unit): each unit's parameters
 * of one dtype and group share a bucket, whose G equal blocks are one all-gather before the unit
 * computes and one reduce-scatter of its gradient after (the model makes a unit per layer, so
 * a layer moves as 3 collectives: its dense, expert and f32 router weights). Below ZeRO-3 the
 * unit is recorded and does not split buckets. */
typedef enum tm_param_group { TM_PARAM_DENSE = 0, TM_PARAM_EXPERT = 1 } tm_param_group;

typedef struct tm_param_options {
    tm_param_group group;     /* default TM_PARAM_DENSE */
    int expert_lo, expert_hi; /* expert group: the global experts [lo, hi) held along dim 0
                               * (shape[0] == hi - lo; 0, 0: all of dim 0); ignored for dense */
    int logical_ndim;         /* 0 (default): the logical shape is the shape */
    int64_t logical_shape[TM_MAX_DIMS];
    int shard_axis;           /* -1 (default): not a shard; else the axis split across ranks */
    int64_t shard_offset;     /* where this shard starts along shard_axis in the logical tensor */
} tm_param_options;

/* Dense, not sharded. */
TM_API tm_param_options tm_param_options_default(void);

/* tm_param_new with a group and a shard description; opts NULL: tm_param_options_default().
 * Errors: as tm_param_new, plus TM_ERR_INVALID_ARG naming the field for a bad group, an expert
 * range that does not match shape[0], a logical shape of another rank, differing from shape
 * on an axis other than shard_axis, or a shard that does not fit inside the logical shape. */
TM_API tm_status tm_param_new_ex(tm_ctx *ctx, const char *name, tm_dtype dt, int ndim, const int64_t *shape,
                          tm_device dev, const tm_param_options *opts, tm_tensor **out);

/* A parameter's group, shard description and place in its bucket. */
typedef struct tm_param_info {
    tm_param_options opts;  /* as given, defaults filled in (logical_ndim = ndim when not set) */
    int bucket;             /* index for tm_ctx_bucket_info */
    int64_t bucket_offset;  /* element offset of the parameter in its bucket's buffers */
    int unit;               /* the unit it was made in (tm_ctx_set_param_unit) */
} tm_param_info;
/* Errors: TM_ERR_INVALID_ARG (NULL, or t is not a parameter). */
TM_API tm_status tm_param_get_info(const tm_tensor *t, tm_param_info *out);

typedef struct tm_bucket_info {
    tm_device device;
    tm_dtype dtype;           /* of the parameters and gradients */
    tm_param_group group;
    int expert_lo, expert_hi; /* expert group: the range its parameters hold */
    int64_t numel;            /* elements in use, padding included */
    int num_params;
    int has_master;           /* an f32 master copy exists (bf16 buckets under an optimizer) */
    int unit;                 /* the unit of its parameters when buckets are keyed by unit
                               * (ZeRO-3 when they were made); -1: any unit */
} tm_bucket_info;

/* Buckets in order of creation; tm_ctx_bucket_info errors: TM_ERR_INVALID_ARG (NULL, i out
 * of range). */
/* The unit of the parameters made from now on (see "Units" above): unit >= 0. tm_model_new
 * makes its units after every unit a parameter of the context was made in so far (base = 1 +
 * the highest, 0 for the first parameters): base its embedding, base + l + 1 layer l, base +
 * n_layers + 1 the final norm and lm_head; it restores the caller's unit afterwards.
 * tm_ctx_param_unit: the current one (0 for NULL). Errors: TM_ERR_INVALID_ARG (ctx NULL,
 * unit < 0). */
TM_API tm_status tm_ctx_set_param_unit(tm_ctx *ctx, int unit);
TM_API int tm_ctx_param_unit(const tm_ctx *ctx);
TM_API int tm_ctx_num_buckets(const tm_ctx *ctx);
TM_API tm_status tm_ctx_bucket_info(const tm_ctx *ctx, int i, tm_bucket_info *out);

typedef enum tm_bucket_part { TM_BUCKET_PARAMS = 0, TM_BUCKET_GRADS = 1, TM_BUCKET_MASTER = 2 } tm_bucket_part;
/* A 1-D persistent view [numel] of bucket i's parameters, gradients or f32 master weights,
 * valid until a parameter is added to that bucket or the context is freed (writes through it
 * change the parameters; they are not recorded on the tape). NULL for a bad index, or for the
 * master of a bucket without one. Under ZeRO-1 and 2 (tm_comm_options.zero) the master view holds
 * only this rank's block [lo, hi) of the bucket (tm_ctx_grad_shard): [hi - lo] elements. Under
 * ZeRO-2 the gradient view has memory only from a step's first backward to tm_comm_sync_grads
 * (its data is NULL otherwise; tm_tensor_read on it fails with TM_ERR_STATE). */
TM_API tm_tensor *tm_ctx_bucket_tensor(const tm_ctx *ctx, int i, tm_bucket_part part);

/* Persistent tensor without gradient (optimizer state, expert_bias, data). Zero-filled; any
 * dtype. Errors: as tm_param_new, less the float-dtype rule. */
TM_API tm_status tm_buffer_new(tm_ctx *ctx, const char *name, tm_dtype dt, int ndim,
                        const int64_t *shape, tm_device dev, tm_tensor **out);

/* Parameters in creation order: count, and the i-th (NULL when out of range). */
TM_API int tm_ctx_num_params(const tm_ctx *ctx);
TM_API tm_tensor *tm_ctx_param(const tm_ctx *ctx, int i);
/* Every named persistent tensor (parameters, buffers, f32 master weights, optimizer state:
 * what a checkpoint holds) in creation order: count, and the i-th (NULL when out of range). */
TM_API int tm_ctx_num_named(const tm_ctx *ctx);
TM_API tm_tensor *tm_ctx_named(const tm_ctx *ctx, int i);
/* Find a parameter or buffer by name; NULL if none. */
TM_API tm_tensor *tm_ctx_find(const tm_ctx *ctx, const char *name);

/* Set every parameter gradient to zero (one memset per bucket; under ZeRO-2 the full gradient
 * buffers are given back, as zero gradients need none, and the shards zeroed). Errors:
 * TM_ERR_CUDA. */
TM_API tm_status tm_ctx_zero_grad(tm_ctx *ctx);

/* Introspection. Functions taking a tensor return 0 / NULL for t == NULL. */
TM_API int tm_tensor_ndim(const tm_tensor *t);
TM_API int64_t tm_tensor_dim(const tm_tensor *t, int axis); /* negative axis from the end; -1 if invalid */
TM_API int64_t tm_tensor_numel(const tm_tensor *t);
TM_API tm_dtype tm_tensor_dtype(const tm_tensor *t);
TM_API tm_device tm_tensor_device(const tm_tensor *t);
TM_API const char *tm_tensor_name(const tm_tensor *t); /* "" for unnamed temporaries */
TM_API int tm_tensor_is_contiguous(const tm_tensor *t);
TM_API int tm_tensor_requires_grad(const tm_tensor *t);
/* Gradient accumulated by tm_backward, or NULL if none has been computed yet. */
TM_API tm_tensor *tm_tensor_grad(const tm_tensor *t);
/* Mark a temporary leaf tensor (one not produced by an op) as needing a gradient, so that
 * tm_backward computes tm_tensor_grad(t). Errors: TM_ERR_INVALID_ARG (t NULL), TM_ERR_STATE
 * (t is the output of a recorded op, or a parameter: parameters always require one),
 * TM_ERR_DTYPE (requires_grad on a non-float tensor). */
TM_API tm_status tm_tensor_set_requires_grad(tm_ctx *ctx, tm_tensor *t, int requires_grad);

/* Copy the tensor's logical elements (any strides, any device) to host memory `dst`,
 * converted to dst_dt. count must equal numel. Errors: TM_ERR_INVALID_ARG (t or dst NULL,
 * count != numel), TM_ERR_DTYPE (dst_dt not a tm_dtype), TM_ERR_NOMEM (host staging of a
 * device or strided tensor), TM_ERR_CUDA. */
TM_API tm_status tm_tensor_read(tm_ctx *ctx, const tm_tensor *t, tm_dtype dst_dt, void *dst, int64_t count);
/* Overwrite a contiguous tensor's elements from host memory `src` of src_dt (count = numel).
 * Not recorded on the tape. Errors: TM_ERR_INVALID_ARG (t or src NULL, count != numel, t a
 * strided view), TM_ERR_DTYPE (src_dt not a tm_dtype), TM_ERR_NOMEM (host staging of a
 * conversion for a device tensor), TM_ERR_CUDA. */
TM_API tm_status tm_tensor_write(tm_ctx *ctx, tm_tensor *t, tm_dtype src_dt, const void *src, int64_t count);

/* ------------------------------------------------------------------------------------------ */
/* Counter-based random numbers                                                                */
/* ------------------------------------------------------------------------------------------ */
/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
 * Element i of a tensor named N drawn with seed S uses key = (S lo, S hi) and counter =
 * (i lo, i hi, h lo, h hi) with h = FNV-1a-64(N). The value therefore depends only on
 * (seed, name, logical element index), never on the device, the thread count or the parallel
 * layout. Initialisation is computed on the host and uploaded, so CPU and CUDA parameters are
 * bit-identical. */

/* Four 32-bit outputs of Philox4x32-10 for a 128-bit counter and 64-bit key. */
TM_API void tm_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);
/* FNV-1a 64-bit hash of a NUL-terminated string (the RNG stream id of a tensor name). */
TM_API uint64_t tm_hash_name(const char *name);

/* Fill t with N(mean, std^2) (Box-Muller on two Philox outputs in f64, then converted) or
 * U[lo, hi) keyed by (seed, name, index). name NULL: the tensor's own name. Float dtypes only.
 * Errors: TM_ERR_DTYPE (t not float), TM_ERR_INVALID_ARG (t NULL, t a strided view, std < 0
 * or NaN, lo > hi or NaN, an unnamed temporary and no name), TM_ERR_NOMEM (numel doubles of
 * host arena), TM_ERR_CUDA (the upload). */
TM_API tm_status tm_tensor_init_normal(tm_ctx *ctx, tm_tensor *t, uint64_t seed, const char *name,
                                double mean, double std);
TM_API tm_status tm_tensor_init_uniform(tm_ctx *ctx, tm_tensor *t, uint64_t seed, const char *name,
                                 double lo, double hi);
/* Fill with a constant (any dtype; value converted). Not recorded on the tape.
 * Errors: TM_ERR_INVALID_ARG (t NULL, t a strided view), TM_ERR_CUDA. */
TM_API tm_status tm_tensor_fill(tm_ctx *ctx, tm_tensor *t, double value);

/* ------------------------------------------------------------------------------------------ */
/* Autograd                                                                                    */
/* ------------------------------------------------------------------------------------------ */
/* Ops record themselves on the context's tape when grad mode is on and an input requires a
 * gradient. tm_backward walks the tape in reverse and ACCUMULATES into .grad of every tensor
 * that requires one (parameters: into the contiguous gradient buffer), so calling forward +
 * backward on several micro-batches before one optimizer step accumulates their gradients.
 * The tape recorded so far is consumed by the call (a second backward does not re-run it).
 * As in PyTorch, only leaves keep their gradient: once the backward has used the gradient of
 * an op's output it is freed, and tm_tensor_grad of that output is NULL afterwards. */

/* loss: a one-element float tensor; its upstream gradient is 1.
 * Errors: TM_ERR_INVALID_ARG (loss NULL), TM_ERR_SHAPE (not one element), TM_ERR_STATE (loss
 * does not require grad), and those of the recorded ops' backward kernels: TM_ERR_UNSUPPORTED
 * (an op without a backward kernel on its backend, named), TM_ERR_NOMEM (gradients of
 * temporaries, scratch), TM_ERR_CUDA. After an error the tape is gone all the same and some
 * gradients may be partly accumulated. */
TM_API tm_status tm_backward(tm_ctx *ctx, tm_tensor *loss);
/* Backward from any tensor with an explicit upstream gradient of the same shape.
 * Errors: TM_ERR_INVALID_ARG (out or grad NULL), TM_ERR_STATE (out does not require grad),
 * TM_ERR_SHAPE (grad's shape is not out's), TM_ERR_DEVICE (grad on another device),
 * TM_ERR_DTYPE (on CUDA, a grad that is not f32 or bf16), then as tm_backward. */
TM_API tm_status tm_backward_with_grad(tm_ctx *ctx, tm_tensor *out, tm_tensor *grad);

/* ------------------------------------------------------------------------------------------ */
/* Ops                                                                                         */
/* ------------------------------------------------------------------------------------------ */
/* Every op: inputs on one device; float ops accept f32, bf16 and f64 (CPU) alike and produce
 * the input dtype; results are temporaries. Each op is one row of the op table
 * (framework/op_table.c): its CPU kernel is in kernels/cpu/<op>.c, its CUDA kernel in
 * kernels/cuda/<op>.cu, its test in tests/test_<op>.c.
 *
 * Errors of every op (framework/dispatch.c), in addition to those listed with it; the message
 * names the op and the offending input with its dtype, shape and device:
 *   TM_ERR_INVALID_ARG  an input or the out pointer NULL; an input made by another context;
 *   TM_ERR_DEVICE       inputs on different devices (tm_to_device excepted);
 *   TM_ERR_UNSUPPORTED  no kernel for the inputs' backend. Every op has CPU kernels; CUDA ones
 *                       exist only for matmul, add, sub, mul, scale, scale_rows, the four
 *                       reductions, the shape ops (reshape ... to_device), embedding,
 *                       index_select, gather, scatter_add, index_check, rmsnorm, silu, swiglu,
 *                       softmax, log_softmax, cross_entropy, rope and attention (the rows of
 *                       framework/op_table.c with a CUDA column). Also a GEMM that cuBLASLt
 *                       has no algorithm for;
 *   TM_ERR_NOMEM        the per-step arena could not grow (outputs, saved tensors, contiguous
 *                       copies of strided inputs, scratch, the tape entry);
 *   TM_ERR_CUDA         a CUDA runtime or cuBLASLt call failed (CUDA inputs only).
 * "Float" below means f32, bf16 or f64, and a float input of another dtype is TM_ERR_DTYPE;
 * "index" means i32 or i64. The backward of an op (run by tm_backward) can fail with
 * TM_ERR_NOMEM and TM_ERR_CUDA too. */

/* C = op(A) @ op(B), op = transpose of the last two dims when trans_* is nonzero.
 * a: [..., M, K] (or [..., K, M] transposed), b: [K, N] or [..., K, N] with the same leading
 * dims as a (batched). out: [..., M, N]. Accumulation in f32 (f64 for f64).
 * Errors: TM_ERR_DTYPE (a or b not float, or of different dtypes), TM_ERR_SHAPE (a or b with
 * fewer than 2 dims; b neither 2-D nor of a's ndim; batch dims or inner dims differ). */
TM_API tm_status tm_matmul(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, int trans_a, int trans_b, tm_tensor **out);

/* Elementwise a+b, a-b, a*b. Broadcasting over leading dims: the shape of one operand must
 * equal the trailing dims of the other's (e.g. [B,T,C] + [C]); out has the larger shape.
 * Errors: TM_ERR_DTYPE (not float, or of different dtypes), TM_ERR_SHAPE (no broadcast). */
TM_API tm_status tm_add(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, tm_tensor **out);
TM_API tm_status tm_sub(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, tm_tensor **out);
TM_API tm_status tm_mul(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, tm_tensor **out);
/* out = alpha * x. Errors: TM_ERR_DTYPE (x not float), TM_ERR_INVALID_ARG (alpha not finite). */
TM_API tm_status tm_scale(tm_ctx *ctx, tm_tensor *x, double alpha, tm_tensor **out);
/* Row scaling: out[r, c] = x[r, c] * w[r], x [R, C], w [R] (a weight per row: the broadcast
 * tm_mul cannot express, w being a leading dim). w's dtype is computed like x's, as the
 * permuted_probs of tm_moe_unpermute: f32 or bf16 with f32 or bf16, f64 with f64; the product
 * is taken in f32 (f64 for f64) and rounded once to x's dtype, so bf16 rows times f32 router
 * weights round once, as Megatron-LM's `probs * hidden` followed by `.to(hidden.dtype)`.
 * out [R, C] of x's dtype. Backward: dx[r, c] = dy[r, c] w[r]; dw[r] = <x[r], dy[r]>
 * (f64 sum on the CPU, f32 on CUDA). The MoE block's early top-k weighting
 * (tm_moe_config.apply_topk_weights_early) applies it to the permuted rows.
 * Errors: TM_ERR_DTYPE (x or w not float; f64 with another dtype), TM_ERR_SHAPE (x not 2-D,
 * w not [R]). */
TM_API tm_status tm_scale_rows(tm_ctx *ctx, tm_tensor *x, tm_tensor *w, tm_tensor **out);

/* Sum / mean over one axis (keepdim keeps it as size 1), or over all elements (*_all: a 0-d
 * scalar). Accumulation in f64 on the CPU, f32 on CUDA.
 * Errors: TM_ERR_DTYPE (x not float), TM_ERR_INVALID_ARG (axis out of range; not for *_all). */
TM_API tm_status tm_sum(tm_ctx *ctx, tm_tensor *x, int axis, int keepdim, tm_tensor **out);
TM_API tm_status tm_mean(tm_ctx *ctx, tm_tensor *x, int axis, int keepdim, tm_tensor **out);
TM_API tm_status tm_sum_all(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);
TM_API tm_status tm_mean_all(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);

/* Shape ops, for tensors of any dtype. reshape/view: a view when x is contiguous (one dim may
 * be -1), a copy otherwise. transpose/permute/slice: views (no copy). slice keeps [start, end)
 * of `axis` (negative start/end count from the end). concat: along axis, all other dims
 * equal, n in [1, 8]. contiguous: a dense copy of a view (x itself if already dense).
 * Errors: reshape TM_ERR_INVALID_ARG (ndim outside [0, TM_MAX_DIMS], shape NULL with ndim > 0),
 * TM_ERR_SHAPE (more than one -1, a negative size, another element count); transpose
 * TM_ERR_INVALID_ARG (an axis out of range); permute TM_ERR_INVALID_ARG (perm NULL or not a
 * permutation of the dims); slice TM_ERR_INVALID_ARG (axis), TM_ERR_INDEX ([start, end) not
 * inside the axis once negative ends are resolved); concat TM_ERR_INVALID_ARG (xs NULL, n
 * outside [1, 8], axis out of range for xs[0]), TM_ERR_DTYPE (dtypes differ), TM_ERR_SHAPE
 * (ndims differ, or a dim other than axis). */
TM_API tm_status tm_reshape(tm_ctx *ctx, tm_tensor *x, int ndim, const int64_t *shape, tm_tensor **out);
TM_API tm_status tm_transpose(tm_ctx *ctx, tm_tensor *x, int axis0, int axis1, tm_tensor **out);
TM_API tm_status tm_permute(tm_ctx *ctx, tm_tensor *x, const int *perm, tm_tensor **out);
TM_API tm_status tm_slice(tm_ctx *ctx, tm_tensor *x, int axis, int64_t start, int64_t end, tm_tensor **out);
TM_API tm_status tm_concat(tm_ctx *ctx, int n, tm_tensor *const *xs, int axis, tm_tensor **out);
TM_API tm_status tm_contiguous(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);
/* Convert dtype (any to any; differentiable between float dtypes, gradient converted back).
 * Errors: TM_ERR_DTYPE (dt not a tm_dtype; f64 on CUDA). */
TM_API tm_status tm_cast(tm_ctx *ctx, tm_tensor *x, tm_dtype dt, tm_tensor **out);
/* Copy to another device (differentiable: the gradient is copied back); any dtype.
 * Errors: TM_ERR_DEVICE (dev is not the CPU or the context's CUDA device), TM_ERR_DTYPE (f64
 * to CUDA), TM_ERR_CUDA (the copy). */
TM_API tm_status tm_to_device(tm_ctx *ctx, tm_tensor *x, tm_device dev, tm_tensor **out);

/* Embedding lookup: weight [V, C], ids (i32 or i64) of any shape S -> out [S..., C].
 * Backward scatter-adds rows into d weight, in a fixed order (bitwise reproducible, also on
 * CUDA). Errors: TM_ERR_DTYPE (weight not float, ids not index), TM_ERR_SHAPE (weight not 2-D,
 * ids of more than 3 dims), TM_ERR_INDEX naming the first id outside [0, V) and its position.
 * On CUDA the ids are checked on the device and the verdict read back: one host round trip
 * (tm_ctx_sync_count) per call with ids (tm_model_forward checks its tokens with
 * tm_index_check instead and skips this read). The same holds for the three below. */
TM_API tm_status tm_embedding(tm_ctx *ctx, tm_tensor *weight, tm_tensor *ids, tm_tensor **out);
/* The three below: TM_ERR_DTYPE (x / src not float, idx not index), TM_ERR_SHAPE (a shape
 * other than the one shown), TM_ERR_INDEX naming the first index out of range (lowest flat
 * position) and its value; TM_ERR_UNSUPPORTED on CUDA for a row scatter-add (scatter_add, the
 * backward of index_select and embedding) of 2^32 - 1 or more rows or sources.
 * Row gather: x [N, C], idx [M] (i32/i64) -> out [M, C], out[m] = x[idx[m]], idx in [0, N). */
TM_API tm_status tm_index_select(tm_ctx *ctx, tm_tensor *x, tm_tensor *idx, tm_tensor **out);
/* Gather along the last axis: x [N, C], idx [N, K] -> out [N, K], out[n,k] = x[n, idx[n,k]],
 * idx in [0, C). */
TM_API tm_status tm_gather(tm_ctx *ctx, tm_tensor *x, tm_tensor *idx, tm_tensor **out);
/* Row scatter-add: src [M, C], idx [M] -> out [n_rows, C] zero-initialised,
 * out[idx[m]] += src[m], idx in [0, n_rows). Also TM_ERR_INVALID_ARG (n_rows < 0). */
TM_API tm_status tm_scatter_add(tm_ctx *ctx, tm_tensor *src, tm_tensor *idx, int64_t n_rows, tm_tensor **out);
/* Validate indices on their own device, without reading them back (tm_model_forward checks
 * its tokens and targets so): an id is valid when it lies in [0, hi) or equals ignore_index.
 * ids: i32 or i64, any shape. Outputs, on ids' device, not differentiable:
 *   *safe      ids' dtype and shape: each valid id, ignore_index in place of each invalid one
 *              (so pass a valid value, e.g. 0, as ignore_index when nothing is ignored);
 *   *first_bad i64 [2]: {flat position, value} of the first invalid id, {-1, 0} when none.
 * A bad id is not an error here: read first_bad back (with the other results of the step) and
 * report it. Errors: TM_ERR_INVALID_ARG (ids, safe or first_bad NULL, ids of another context,
 * hi < 0, ignore_index outside the i32 range for i32 ids), TM_ERR_DTYPE (ids not i32/i64), TM_ERR_NOMEM,
 * TM_ERR_CUDA. */
TM_API tm_status tm_index_check(tm_ctx *ctx, tm_tensor *ids, int64_t hi, int64_t ignore_index, tm_tensor **safe,
                         tm_tensor **first_bad);

/* RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2 over last axis) + eps) * weight.
 * x [..., C], weight [C]. Errors: TM_ERR_DTYPE (not float, or x and weight of different
 * dtypes), TM_ERR_SHAPE (x 0-d or C = 0, weight not [C]), TM_ERR_INVALID_ARG (eps negative,
 * NaN or infinite). */
TM_API tm_status tm_rmsnorm(tm_ctx *ctx, tm_tensor *x, tm_tensor *weight, double eps, tm_tensor **out);
/* The pre-norm residual step "x = x + f(x); h = norm(x)" in one op: *sum = x + y and
 * *out = tm_rmsnorm(*sum, weight, eps), both [..., C] in x's dtype; the same bits as tm_add
 * followed by tm_rmsnorm (forward and gradients; bf16 sums are rounded before the norm reads
 * them, as tm_add's output is), with one kernel per direction on CUDA. x and y [..., C] of one
 * shape (no broadcasting) and one float dtype, weight [C] of that dtype.
 * Errors: TM_ERR_INVALID_ARG (sum or out NULL; eps negative, NaN or infinite), TM_ERR_DTYPE
 * (not float, or dtypes differ), TM_ERR_SHAPE (x and y differ, x 0-d or C = 0, weight not [C]). */
TM_API tm_status tm_add_rmsnorm(tm_ctx *ctx, tm_tensor *x, tm_tensor *y, tm_tensor *weight, double eps,
                                tm_tensor **sum, tm_tensor **out);
/* SiLU(x) = x * sigmoid(x) (Elfwing et al. 2018). On CUDA sigmoid(x) = 1 / (1 + e^-x) takes e^-x by
 * ex2.approx and the reciprocal by rcp.approx (kernels/cuda/swiglu.cuh: a few f32 ulp; a subnormal
 * sigmoid flushes to 0); the CPU computes in f64. Errors: TM_ERR_DTYPE (x not float). */
TM_API tm_status tm_silu(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);
/* SwiGLU (Shazeer 2020), fused: out = silu(gate) * up (silu as tm_silu's, on each backend); gate and
 * up of the same shape.
 * Errors: TM_ERR_DTYPE (not float, or of different dtypes), TM_ERR_SHAPE (shapes differ). */
TM_API tm_status tm_swiglu(tm_ctx *ctx, tm_tensor *gate, tm_tensor *up, tm_tensor **out);
/* Softmax / log-softmax over the last axis (max-subtracted).
 * Errors: TM_ERR_DTYPE (x not float), TM_ERR_SHAPE (x 0-d). */
TM_API tm_status tm_softmax(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);
TM_API tm_status tm_log_softmax(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);
/* Fused cross-entropy: logits [N, V] float, targets [N] i32/i64. Rows whose target equals
 * ignore_index are skipped; out (0-d, the logits' dtype) = mean over the valid rows of
 * (logsumexp(logits[n]) - logits[n, target[n]]); 0 when no row is valid.
 * Errors: TM_ERR_DTYPE (logits not float, targets not index), TM_ERR_SHAPE (logits not 2-D or
 * with V = 0, targets not [N]), TM_ERR_INDEX for the first target outside [0, V) that is not
 * ignore_index (its row and value). */
TM_API tm_status tm_cross_entropy(tm_ctx *ctx, tm_tensor *logits, tm_tensor *targets, int64_t ignore_index,
                           tm_tensor **out);
/* Rotary position embedding, rotate-half convention (GPT-NeoX / Llama / Mixtral; Su et al.
 * 2021): x [B, T, H, D], D even; position of row t is pos_offset + t;
 * inv_freq[i] = theta^(-2i/D), i < D/2; for the pair (x1 = x[..., i], x2 = x[..., i + D/2]):
 * y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin, angle = pos * inv_freq[i].
 * Errors: TM_ERR_DTYPE (x not float), TM_ERR_SHAPE (x not 4-D, D odd), TM_ERR_INVALID_ARG
 * (theta <= 0, NaN or infinite; pos_offset < 0). */
TM_API tm_status tm_rope(tm_ctx *ctx, tm_tensor *x, int64_t pos_offset, double theta, tm_tensor **out);
/* Causal scaled-dot-product attention with grouped-query heads, fused (one op, own backward):
 * q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D], Hq % Hkv == 0, Tk >= Tq; query head h reads
 * kv head h / (Hq / Hkv); query i (0-based) sees keys j <= i + (Tk - Tq);
 * out[b,i,h] = sum_j softmax_j(q.k_j * scale) v_j with scale = 1/sqrt(D) when scale <= 0.
 * out [B, Tq, Hq, D]. (Vaswani et al. 2017; GQA: Ainslie et al. 2023.)
 * On CUDA, bf16 with D = 64 or 128 runs on tensor cores (FlashAttention-2 style; on sm_90, wgmma
 * kernels after FlashAttention-3, which sum in another order): the softmax weights and their
 * gradients are rounded to bf16 as matrix operands, so results differ from the f32 computation by
 * a few bf16 ulps of the gradients' scale; f32 and other head dims compute in f32. Either way the
 * results are the same bits run to run on one GPU model.
 * Errors: TM_ERR_DTYPE (not float, or of different dtypes), TM_ERR_SHAPE (not 4-D; v's shape
 * not k's; B or D differ; D, Hq or Hkv < 1; Hq % Hkv != 0; Tk < Tq), TM_ERR_INVALID_ARG (scale
 * not finite), TM_ERR_UNSUPPORTED (on CUDA: D > 3056, or 2^31 or more rows of q or k). */
TM_API tm_status tm_attention(tm_ctx *ctx, tm_tensor *q, tm_tensor *k, tm_tensor *v, double scale,
                       tm_tensor **out);

/* ------------------------------------------------------------------------------------------ */
/* Mixture of Experts: the pieces                                                              */
/* ------------------------------------------------------------------------------------------ */
/* Notation: T tokens (rows of x), H hidden size, E routed experts, k = topk, F expert FFN size.
 * Sources: NVIDIA TransformerEngine (TE) fused_router / fused_moe_aux_loss / permutation,
 * Megatron-LM moe_utils.py (topk_routing_with_score_function, switch_load_balancing_loss_func,
 * apply_router_token_dropping, get_updated_expert_bias), DeepSeek-V3 (arXiv 2412.19437),
 * ST-MoE (Zoph et al. 2022, arXiv 2202.08906), Switch Transformer (Fedus et al. 2021). */

/* The router's gating GEMM: logits = x @ w, in w's dtype, from x widened exactly (Megatron-LM's
 * router_gating_linear with moe_router_dtype fp32: the routing decision is made in f32 whatever
 * the activations' dtype).
 *   x       [T, H]  float: w's dtype, or bf16 with f32 w
 *   w       [H, E]  f32 or f64
 *   logits  [T, E]  w's dtype: logits[t, e] = sum_h x[t, h] w[h, e]
 * The values of tm_matmul(tm_cast(x, dtype(w)), w) up to the f32 summation order: products of
 * exactly widened inputs summed in f32 (f64 for f64 w). On CUDA, bf16 x with H a multiple of 8
 * and at most 8 experts runs kernels that read bf16 x directly (no widened copy;
 * kernels/cuda/moe_gating.cu); other bf16 x with f32 w runs bf16 tensor-core GEMMs on a three-term
 * bf16 split of the f32 operand (w, or dlogits for dw and dx), whose products of the 24-bit terms
 * are exact in f32, summed within n 2^-23 of the terms' magnitudes; f32 and f64 inputs run
 * cuBLASLt's true f32 (f64) GEMM.
 * Backward: dx = dlogits w^T in x's dtype (added in f32 to a gradient x already has and rounded
 * once, where the cast's backward rounded twice), dw += x^T dlogits in w's dtype; every sum in a
 * fixed order (deterministic).
 * Errors (messages name the tensors): TM_ERR_DTYPE for w not f32 / f64, or x neither w's dtype
 * nor bf16 with f32 w; TM_ERR_SHAPE for x not [T, H] or w not [H, E]. */
TM_API tm_status tm_moe_gating(tm_ctx *ctx, tm_tensor *x, tm_tensor *w, tm_tensor **logits);

typedef enum tm_score_function {
    TM_SCORE_SOFTMAX = 0, /* softmax over experts (pre- or post-top-k, see use_pre_softmax) */
    TM_SCORE_SIGMOID = 1  /* independent sigmoid per expert (DeepSeek-V3) */
} tm_score_function;

typedef struct tm_router_config {
    int num_experts;     /* E >= 1 */
    int topk;            /* k in [1, E] */
    tm_score_function score_function;
    int use_pre_softmax; /* softmax only. 1: s = softmax(logits) over all E, (p, idx) = TOPK(s).
                          * 0: (v, idx) = TOPK(logits), p = softmax(v) over the k selected. */
    int num_groups;      /* group-limited routing (DeepSeek-V3): 0 or 1 disables. E % num_groups == 0 */
    int group_topk;      /* groups kept, in [1, num_groups]; k % group_topk == 0 */
    double scaling_factor; /* multiplies p last (1.0: none); must be > 0 */
    int norm_topk_prob;  /* softmax-pre only (ignored otherwise): p = p / sum(p) (Mixtral / Qwen-MoE) */
    int force_load_balance; /* 0 (default) or 1, BENCHMARKING ONLY: the selection ignores the scores,
                             * idx[t][j] = (t k + j) % E (below); the model does not learn to route */
} tm_router_config;

/* E = 8, k = 2, softmax, pre-softmax, no groups, scaling 1, no renormalisation, not forced. */
TM_API tm_router_config tm_router_config_default(void);

/* Float outputs have the logits' dtype (f32; bf16 logits give bf16 outputs, computed in f64 on
 * the CPU, in f32 on CUDA, and rounded; f64 for gradient checks). */
typedef struct tm_router_out {
    tm_tensor *probs;             /* [T,E]: p at the routed (t,e), 0 elsewhere */
    tm_tensor *routing_map;       /* u8  [T,E]: 1 where routed */
    tm_tensor *topk_idx;          /* i32 [T,k]: selected experts, in descending selection score
                                   * (force_load_balance: (t k + j) % E for j = 0..k-1, in j order) */
    tm_tensor *topk_weights;      /* [T,k]: p of the selected experts (same order) */
    tm_tensor *tokens_per_expert; /* i64 [E]: column sums of routing_map */
} tm_router_out;

/* Fused top-k router (one op, forward and backward), after TE fused_topk_with_score_function
 * and Megatron topk_routing_with_score_function:
 *   softmax, pre : s = softmax(logits); (p, idx) = TOPK(s); norm_topk_prob: p /= sum(p)
 *   softmax, post: (v, idx) = TOPK(logits); p = softmax(v)
 *   sigmoid      : s = sigmoid(logits); selection uses s + expert_bias when a bias is given,
 *                  p is gathered from s (the bias never enters the weights);
 *                  p = p / (sum(p) + 1e-20) when k > 1
 *   group-limited TOPK: experts form num_groups contiguous groups; a group scores the sum of
 *     its top (k / group_topk) selection scores; the best group_topk groups are kept, the others
 *     masked to -inf, then a plain top-k. Softmax-pre selects on s (+ bias), softmax-post on
 *     logits (+ bias).
 *   p *= scaling_factor last. Ties: the lowest expert index wins (everywhere, groups too).
 *   force_load_balance = 1 (torchtitan debug.moe_force_load_balance ->
 *     TokenChoiceTopKRouter._debug_force_load_balance; Megatron-LM
 *     --moe-router-force-load-balancing, "for benchmarking purposes only"): BENCHMARKING ONLY.
 *     The selection is round robin, whatever the scores: row t of logits takes
 *       idx[t][j] = (t * k + j) % E,  j = 0..k-1, in that order in topk_idx
 *     (k distinct experts as k <= E; t is the row of this call's logits, so each rank of an
 *     expert-parallel run counts its own rows from 0, as torchtitan does). Over T rows expert e
 *     gets floor(T k / E) or that + 1 rows: exactly T k / E each when T k % E == 0. Everything
 *     after the selection is the normal computation for that selection: p = s[idx] (softmax pre,
 *     then norm_topk_prob), softmax over l[idx] (softmax post), s[idx] normalised when k > 1
 *     (sigmoid), scaling_factor last; probs, routing_map and tokens_per_expert follow, and the
 *     backward is the normal one for the selection, so the router weights still get gradients.
 *     The expert bias and group-limited routing do not affect the selection in this mode (their
 *     configuration is still checked, and a bias update sees the forced counts), so a benchmark
 *     keeps its model's configuration and only the selection changes. Megatron's clean counts
 *     (tm_moe_aux_counts) are a top-k of the scores and are not forced.
 * logits: float [T,E]. expert_bias: float [E] (any float dtype) or NULL, used for selection
 * only (no gradient), with either score function (softmax + bias shifts the selection only,
 * too). The arithmetic is f64 on the CPU and f32 on CUDA (bf16 logits read as f32): CUDA's
 * float outputs and gradients are within 1e-5 (f32) or one bf16 rounding step of the CPU's.
 * Both select the same experts unless f32 rounding makes two scores equal (or unequal) that
 * are not so in f64; equal logits give equal scores on both. NaN ranks lowest on CUDA, while
 * the CPU's insertion may keep one, so a row mixing NaN and numbers may select differently.
 * tokens_per_expert is exact on both. On error every field of *out is NULL (out given).
 * Gradients flow from probs and topk_weights (both may be used) into logits.
 * Errors (message names the field and its value): TM_ERR_INVALID_ARG for out or cfg NULL,
 * score_function not a tm_score_function, force_load_balance not 0 or 1, num_experts < 1,
 * k outside [1,E], num_groups < 0,
 * E % num_groups, group_topk outside [1, num_groups], k % group_topk,
 * k / group_topk > E / num_groups, scaling_factor <= 0, NaN or infinite; TM_ERR_DTYPE for
 * logits or expert_bias not float; TM_ERR_SHAPE for logits not [T,E] with E = num_experts >= 1, or
 * expert_bias not [E]; TM_ERR_UNSUPPORTED on CUDA for a row beyond 48 KiB of shared memory
 * (9 E + 8 k + 5 num_groups bytes: E above about 5400). */
TM_API tm_status tm_moe_router(tm_ctx *ctx, tm_tensor *logits, tm_tensor *expert_bias, const tm_router_config *cfg,
                        tm_router_out *out);

/* Switch / GShard load-balancing loss (TE fused_moe_aux_loss, Megatron
 * switch_load_balancing_loss_func):
 *   aux = E * coeff / (k * T^2) * sum_e (sum_t scores[t,e]) * tokens_per_expert[e]
 * scores: float [T,E] (the router's aux scores: softmax over all E, or s / sum_E s for
 * sigmoid, see tm_moe_aux_scores); tokens_per_expert: i64 [E] (no gradient): the routed
 * counts (tm_router_out) or Megatron's clean ones (tm_moe_aux_counts). T = rows of scores, or
 * total_tokens when > 0 (data parallelism: counts and T summed over ranks). Out: 0-d, the
 * scores' dtype (f64 for f64 scores, as in gradient checks); 0 when T = 0.
 * Gradient: d scores[t,e] = E * coeff / (k * T^2) * tokens_per_expert[e].
 * Errors: TM_ERR_DTYPE (scores not float, tokens_per_expert not i64), TM_ERR_SHAPE (scores
 * not [T,E] with E >= 1, tokens_per_expert not [E]), TM_ERR_INVALID_ARG (topk outside [1, E],
 * coeff not finite, 0 < total_tokens < T).
 * On CUDA the sum is a two-pass fixed-order f32 reduction (block partial sums, then one block
 * adds them in order; c applied once, in f64): bitwise reproducible run to run, and within
 * 1e-5 of the CPU's f64 sum (a bf16 rounding step for bf16 scores). The same holds for
 * tm_moe_seq_aux_loss and tm_moe_z_loss. */
TM_API tm_status tm_moe_aux_loss(tm_ctx *ctx, tm_tensor *scores, tm_tensor *tokens_per_expert, int topk, double coeff,
                          int64_t total_tokens, tm_tensor **out);
/* Sequence-level variant (DeepSeek-V3 sec. 2.1.2, complementary sequence-wise balance loss):
 * the rows form num_seqs contiguous sequences of S = T / num_seqs tokens; per sequence the
 * formula above with that sequence's scores and counts (counts from routing_map [T,E] u8:
 * routed or, from tm_moe_aux_counts, clean) and S in place of T; the result is the mean over
 * sequences. Out: 0-d, the scores' dtype; 0 when T = 0.
 * Errors: TM_ERR_DTYPE (scores not float, routing_map not u8), TM_ERR_SHAPE (scores not [T,E]
 * with E >= 1, routing_map not of scores' shape), TM_ERR_INVALID_ARG (topk outside [1, E],
 * coeff not finite, num_seqs < 1 or not dividing T). */
TM_API tm_status tm_moe_seq_aux_loss(tm_ctx *ctx, tm_tensor *scores, tm_tensor *routing_map, int topk, double coeff,
                              int64_t num_seqs, tm_tensor **out);
/* Scores for the auxiliary losses (Megatron compute_routing_scores_for_aux_loss, TE
 * fused_compute_score_for_moe_aux_loss), from router logits float [T,E]:
 *   softmax: q = softmax(logits) over all E
 *   sigmoid: q = s / (sum_E s + 1e-20), s = sigmoid(logits)
 * No bias, no grouping, no scaling, whatever the router does. out: [T,E], the logits' dtype
 * (f64 for f64 logits). Differentiable. These are the scores of tm_moe_aux_loss and
 * tm_moe_seq_aux_loss; the counts that go with them are the routed ones (tm_router_out) or
 * Megatron's clean ones, a plain top-k of these very scores: tm_moe_aux_counts.
 * Errors: TM_ERR_INVALID_ARG (score_function not a tm_score_function), TM_ERR_DTYPE (logits
 * not float), TM_ERR_SHAPE (logits not [T,E] with E >= 1). Computed in f32 on CUDA (f64 on
 * the CPU). */
TM_API tm_status tm_moe_aux_scores(tm_ctx *ctx, tm_tensor *logits, tm_score_function score_function, tm_tensor **out);
/* Megatron's "clean" routing for the balance losses (TM_AUX_COUNTS_CLEAN): a plain top-k of
 * the aux scores, without groups, expert bias, capacity or scaling, as Megatron-LM's
 * TopKRouter builds it for the aux losses (moe_utils.py compute_routing_scores_for_aux_loss:
 * torch.topk of the scores; router.py _apply_aux_loss: tokens_per_expert =
 * routing_map.sum(0), then switch_load_balancing_loss_func):
 *   routing_map[t,e]     = 1 if e is among the topk largest of logits[t,:], else 0
 *   tokens_per_expert[e] = sum_t routing_map[t,e]                (so sum_e = T * topk)
 * Ties: the lower expert index wins. softmax and s / sum_E s with s = sigmoid both keep the
 * order of a row's logits, so this is the top-k of tm_moe_aux_scores for either score
 * function; selecting on the logits themselves keeps rounding in the scores (softmax
 * underflowing to 0, sigmoid saturating at 1) from creating ties the logits do not have.
 * Computed by the router op (softmax-post selection, no groups, no bias; its other outputs
 * are dropped). logits: float [T,E]. Outputs, on logits' device: routing_map u8 [T,E] (for
 * tm_moe_seq_aux_loss), tokens_per_expert i64 [E] (for tm_moe_aux_loss). Not differentiable:
 * never recorded on the tape, whatever the grad mode.
 * Errors: TM_ERR_INVALID_ARG (logits, routing_map or tokens_per_expert NULL; logits of
 * another context; topk outside [1, E]), TM_ERR_DTYPE (logits not float), TM_ERR_SHAPE
 * (logits not [T,E] with E >= 1), TM_ERR_NOMEM, TM_ERR_CUDA. */
TM_API tm_status tm_moe_aux_counts(tm_ctx *ctx, tm_tensor *logits, int topk, tm_tensor **routing_map,
                            tm_tensor **tokens_per_expert);
/* Router z-loss (ST-MoE eq. 5): z = coeff * mean_t (logsumexp_e logits[t,e])^2; 0 when T = 0.
 * Out: 0-d, the logits' dtype (f64 for f64 logits).
 * Errors: TM_ERR_DTYPE (logits not float), TM_ERR_SHAPE (logits not [T,E] with E >= 1),
 * TM_ERR_INVALID_ARG (coeff not finite). CUDA: logsumexp in f32, see tm_moe_aux_loss. */
TM_API tm_status tm_moe_z_loss(tm_ctx *ctx, tm_tensor *logits, double coeff, tm_tensor **out);
/* Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2; Megatron get_updated_expert_bias), once per
 * optimizer step with counts summed over micro-batches and ranks:
 *   expert_bias[e] += rate * sign(mean(counts) - counts[e])     (sign(0) = 0)
 * expert_bias: f32 or f64 [E] (f32 on CUDA; a buffer; views allowed; the new value is computed
 * in f64 and rounded once to its dtype, on CUDA too: the result is the CPU's bit for bit),
 * counts: i64 [E] on the same device. An in-place update, not an op: never recorded on the
 * tape; reads nothing back.
 * Errors: TM_ERR_INVALID_ARG (a tensor NULL or of another context, rate not finite),
 * TM_ERR_DEVICE (on different devices), TM_ERR_DTYPE (expert_bias not f32 or f64, counts not
 * i64), TM_ERR_SHAPE (expert_bias not [E] with E >= 1, counts not [E]), TM_ERR_CUDA. */
TM_API tm_status tm_moe_expert_bias_update(tm_ctx *ctx, tm_tensor *expert_bias, tm_tensor *counts, double rate);
/* The running count behind that update, kept on the device: sum[e] += counts[e] in place.
 * sum: i64 [E], contiguous (a buffer, e.g. the block's tokens_per_expert_sum); counts: i64 [E]
 * (tm_router_out / tm_moe_drop_out tokens_per_expert). Not recorded on the tape; reads nothing
 * back. Errors: TM_ERR_DTYPE (sum or counts not i64), TM_ERR_SHAPE (not both [E]),
 * TM_ERR_INVALID_ARG (a tensor NULL or of another context; sum a strided view), TM_ERR_DEVICE (on
 * different devices), TM_ERR_CUDA. */
TM_API tm_status tm_moe_accumulate_counts(tm_ctx *ctx, tm_tensor *sum, tm_tensor *counts);

typedef enum tm_drop_policy {
    TM_DROP_PROBS = 0,   /* per expert, keep the `capacity` tokens of highest p (ties: lower t) */
    TM_DROP_POSITION = 1 /* per expert, keep the first `capacity` routed tokens */
} tm_drop_policy;

/* capacity = ceil((T * k / E) * capacity_factor), in doubles as Megatron get_capacity;
 * -1 for invalid arguments (num_tokens < 0, topk < 1, num_experts < 1, factor <= 0, NaN or
 * infinite) or a capacity beyond int64. */
TM_API int64_t tm_moe_capacity(int64_t num_tokens, int topk, int num_experts, double capacity_factor);

typedef struct tm_moe_drop_out {
    tm_tensor *probs_kept;        /* [T,E] probs' dtype: probs where kept, 0 elsewhere */
    tm_tensor *map_kept;          /* u8 [T,E] */
    tm_tensor *tokens_per_expert; /* i64 [E]: routed pairs kept per expert (column sums of map_kept) */
    tm_tensor *dropped;           /* i64 0-d: routed pairs removed */
} tm_moe_drop_out;

/* Token dropping (Megatron apply_router_token_dropping without pad_to_capacity): removes from
 * routing_map [T,E] u8 and probs float [T,E] every routed (t,e) beyond `capacity` per expert,
 * chosen by `policy`. Every output stays on the inputs' device (read the counts with
 * tm_tensor_read when the host needs them); probs_kept is differentiable (the gradient passes
 * where kept), the others are not. Unlike Megatron's column top-k, only routed tokens compete
 * for an expert's slots, with a fixed tie order. On error every field of *out is NULL (out
 * given). Errors: TM_ERR_INVALID_ARG (out NULL, capacity < 0, policy not a tm_drop_policy),
 * TM_ERR_DTYPE (probs not float, routing_map not u8), TM_ERR_SHAPE (probs not 2-D, routing_map
 * not of probs' shape). On CUDA nothing is read back either: the kept set is the CPU's exactly
 * (TM_DROP_PROBS ranks in O(n_e^2) per expert of n_e routed tokens; TM_ERR_UNSUPPORTED beyond
 * 2^31 - 1 tokens). */
TM_API tm_status tm_moe_drop_tokens(tm_ctx *ctx, tm_tensor *probs, tm_tensor *routing_map, int64_t capacity,
                             tm_drop_policy policy, tm_moe_drop_out *out);

typedef struct tm_moe_dispatch {
    tm_tensor *permuted;          /* [R,H] x's dtype: expert-major, token-ascending rows; padding 0 */
    tm_tensor *permuted_probs;    /* [R] (probs' dtype): p[t,e] of each row; 0 on padding */
    tm_tensor *row_token;         /* i64 [R]: source token t of each row, -1 on padding */
    tm_tensor *tokens_per_expert; /* i64 [E]: rows per expert incl. padding (the grouped GEMM's counts) */
    int64_t num_rows;             /* R */
} tm_moe_dispatch;

/* Token dispatch / permute (TE token_dispatch / moe_permute): every routed (t,e) becomes one row
 * of `permuted`, grouped by expert (expert-major), tokens ascending within an expert. Each
 * expert's row count is rounded up to a multiple of align_size (>= 1) with zero rows, or, with
 * pad_to > 0, padded to exactly pad_to rows (pad_to_capacity; align_size is then ignored; an
 * expert with more than pad_to routed tokens is TM_ERR_INVALID_ARG: drop tokens first).
 * x: [T,H] float; routing_map: u8 [T,E]; probs: float [T,E] (its own dtype; rows are moved
 * bit-exactly, bf16 included). Differentiable in x and probs:
 * dx[t] = sum of d permuted over t's rows; d probs[t,e] = d permuted_probs[row(t,e)].
 * Synchronisation: with pad_to > 0, R = E * pad_to is known without the data: nothing is read
 * back, and tokens_per_expert (pad_to each) is kept on the host too, so that tm_grouped_matmul
 * on those counts does not read them back. Otherwise R depends on routing_map (align_size > 1,
 * or tokens per expert unknown): on CUDA the forward reads the E expert counts back once (one
 * synchronisation, tm_ctx_sync_count; counted on the CPU too) and keeps them on the host with
 * tokens_per_expert likewise. (tm_moe_permute_topk also knows R with align_size 1.) The
 * backward does not synchronise.
 * On CUDA, with pad_to > 0, an expert with more than pad_to routed tokens is not reported (that
 * would be a read back): its tokens past the first pad_to are not placed (no row, no gradient).
 * Errors: TM_ERR_INVALID_ARG (out NULL, align_size < 1, pad_to < 0, an expert with more than
 * pad_to routed tokens (the CPU), padding that would make R * H elements overflow),
 * TM_ERR_DTYPE (x or probs not float, routing_map not u8), TM_ERR_SHAPE (x not 2-D, probs not
 * 2-D, routing_map not of probs' shape or not one row per token of x). */
TM_API tm_status tm_moe_permute(tm_ctx *ctx, tm_tensor *x, tm_tensor *routing_map, tm_tensor *probs, int64_t align_size,
                         int64_t pad_to, tm_moe_dispatch *out);
/* tm_moe_permute where every token routes to exactly topk experts (a tm_moe_router's
 * routing_map before any dropping; topk in [1, E], 0 is tm_moe_permute). With align_size 1 and
 * pad_to 0 the forward then knows R = T * topk without the data and reads nothing back: the
 * rows are placed on the device, and tokens_per_expert stays on the device only (no host
 * copy: a tm_grouped_matmul that needs its group sizes on the host reads them once, then keeps
 * them). Other align_size / pad_to behave as tm_moe_permute. The CPU checks the promise
 * (TM_ERR_INVALID_ARG naming the routed count); CUDA cannot without a read back: there a map
 * that breaks it places rows past R nowhere and leaves rows it does not fill as padding,
 * while tokens_per_expert holds the actual counts (which then do not sum to R).
 * Errors: those of tm_moe_permute; TM_ERR_INVALID_ARG (topk outside [0, E]; on the CPU,
 * routing_map not routing T * topk pairs). */
TM_API tm_status tm_moe_permute_topk(tm_ctx *ctx, tm_tensor *x, tm_tensor *routing_map, tm_tensor *probs, int topk,
                              int64_t align_size, int64_t pad_to, tm_moe_dispatch *out);

/* Combine / unpermute: y[t] = sum over rows r with row_token[r] = t of
 * expert_out[r] * permuted_probs[r] (f32 accumulation, f64 for f64, cast once to expert_out's
 * dtype); padding rows (row_token -1) are skipped. expert_out float [R,H], permuted_probs [R]
 * or NULL (weights 1), of a dtype computed like expert_out's (f32 or bf16 with f32 or bf16,
 * f64 with f64), row_token i64 (or i32) [R], out [num_tokens, H] of expert_out's dtype.
 * Backward: d expert_out[r] = dy[t] p[r]; d permuted_probs[r] = <expert_out[r], dy[t]>.
 * No synchronisation, forward or backward.
 * Errors: TM_ERR_DTYPE (expert_out not float, row_token not index, permuted_probs of another
 * kind), TM_ERR_SHAPE (expert_out not 2-D, row_token or permuted_probs not [R]),
 * TM_ERR_INVALID_ARG (num_tokens < 0), TM_ERR_INDEX (on the CPU: the first row_token outside
 * [-1, num_tokens), with its row; on CUDA, which does not read row_token back, such rows are
 * skipped like padding rows and get no gradient). */
TM_API tm_status tm_moe_unpermute(tm_ctx *ctx, tm_tensor *expert_out, tm_tensor *permuted_probs, tm_tensor *row_token,
                           int64_t num_tokens, tm_tensor **out);

/* Chunk regrouping: x [R, H] holds G * K chunks of consecutive rows in [G, K] order (chunk
 * i = g * K + k has split_sizes[i] rows, sum R); out [R, H] holds the same chunks in [K, G]
 * order (chunk (k, g) at position k * G + g), each chunk's rows in their order.
 * TransformerEngine's moe_sort_chunks_by_index (Megatron-LM's sort_chunks_by_idxs) with the
 * index of a grid transpose: the expert-parallel dispatch receives rows source-rank major
 * ([ep ranks, local experts]) and regroups them expert-major for its grouped GEMMs, and back.
 * split_sizes: i64 [num_groups * K] on x's device (num_groups = G >= 1 divides it). Rows move
 * bit-exactly (any float dtype). Backward: dx = the inverse regrouping of dy ([K, G] -> [G, K]).
 * The sizes are checked (non-negative, summing to R) on the CPU and, on a device, where they
 * have a host copy (a tensor made from host values by the MoE block); otherwise the CUDA
 * kernels read them on the device, never reading back (no synchronisation), and stay in
 * bounds whatever they hold (rows no chunk covers come out zero).
 * Errors: TM_ERR_DTYPE (x not float, split_sizes not i64 1-D), TM_ERR_INVALID_ARG (num_groups
 * < 1 or not dividing the chunks), TM_ERR_SHAPE (x not 2-D; checked sizes negative or not
 * summing to R, naming the first bad chunk). */
TM_API tm_status tm_moe_sort_chunks(tm_ctx *ctx, tm_tensor *x, tm_tensor *split_sizes, int64_t num_groups,
                                    tm_tensor **out);

/* Grouped (ragged) GEMM: rows of x [R,K] form consecutive groups of counts[g] rows
 * (counts: i64 [G], sum = R); out[rows of g] = x[rows of g] @ w[g], w [G,K,N], out [R,N].
 * Empty groups cost nothing and leave dw[g] untouched (zero).
 * Backward: dx_g = dy_g @ w[g]^T; dw[g] = x_g^T @ dy_g.
 * f32 (and f64 on the CPU): one GEMM per non-empty group, with the group sizes on the host.
 * The tokens_per_expert of a tm_moe_permute carry them already (a host copy made by the
 * permute's own read): no synchronisation. Other counts on a device are read back once (one
 * synchronisation, tm_ctx_sync_count; counted on the CPU too) and kept with the tensor, so
 * later calls and the backward on the same counts do not wait again. Writing the counts
 * (tm_tensor_write, tm_tensor_fill, an in-place op) discards that host copy. The counts are
 * validated from it, on every device alike.
 * bf16 on CUDA: as f32 (one cuBLASLt GEMM per group, bf16 in and out, f32 accumulation),
 * unless the context was created with tm_ctx_options.grouped_gemm = TM_GROUPED_GEMM_DEVICE,
 * which selects one tensor-core kernel over all groups, which takes the group sizes
 * on the device: no synchronisation, whatever the counts (none counted on the CPU either).
 * Counts with a host copy (a permute's) are validated from it as above; others are not
 * validated on that path but clamped (a negative count as 0, a count cut at the rows left;
 * rows past the last group get out = 0 and no gradient). TM_GROUPED_GEMM_HOPPER: the same
 * contract on an sm_90a kernel (wgmma, TMA; kernels/cuda/grouped_matmul_sm90.cu), one launch
 * per direction; where it cannot run (not an sm_90 device, K or N not a multiple of 8, more than
 * 1024 groups, data not 16-byte aligned) the TM_GROUPED_GEMM_DEVICE kernel runs instead, with
 * the reason kept for tests (tm__gmm_note). Results differ from cuBLASLt's by f32 summation
 * order only. cuBLASLt is the default: the device kernel is slower per GEMM and per training
 * step (docs/PERFORMANCE.md) but never makes the host wait; the Hopper kernel never waits
 * either and on an H100 is faster than cuBLASLt per group (docs/PERFORMANCE.md, section 2).
 * Errors: TM_ERR_DTYPE (x or w not float, or of different dtypes; counts not i64),
 * TM_ERR_SHAPE (x not 2-D, w not 3-D, counts not [G], K differs, counts running past R or not
 * summing to R), TM_ERR_INVALID_ARG (a negative count; on CUDA, shapes too large for one
 * launch). */
TM_API tm_status tm_grouped_matmul(tm_ctx *ctx, tm_tensor *x, tm_tensor *w, tm_tensor *counts, tm_tensor **out);
/* The experts' gate and up projections and SwiGLU (Shazeer 2020, "GLU Variants Improve
 * Transformer") in one op: per group g of rows (counts as tm_grouped_matmul's),
 *   out_g = silu(x_g @ w_gate[g]) * (x_g @ w_up[g]),   silu(a) = a * sigmoid(a).
 * x [R,K]; w_gate and w_up [G,K,F], of one shape and of x's float dtype; counts i64 [G]
 * (each >= 0, sum = R; validated, read and kept on the host exactly as tm_grouped_matmul does,
 * so no more synchronisations than there); out [R,F] in x's dtype.
 * The same values as tm_swiglu(tm_grouped_matmul(x, w_gate, counts), tm_grouped_matmul(x, w_up,
 * counts)), bf16 rounding included: both projections are rounded to the dtype first, then the
 * activation is computed from the rounded values in f32 and rounded once; the gradients of x,
 * w_gate and w_up are those of that composition too (its kernels, in its order). Why one op:
 * on Hopper both GEMMs and the activation can run in one launch, without writing the two
 * projections out and reading them back; elsewhere it runs the composition's kernels. The
 * two projections are kept for the backward ([R,F] each, as the composition keeps them).
 * Errors: TM_ERR_DTYPE (x, w_gate or w_up not float or of different dtypes; counts not i64),
 * TM_ERR_SHAPE (x not 2-D, a weight not 3-D, w_gate and w_up of different shapes, counts not
 * [G], K differs, counts running past R or not summing to R), TM_ERR_INVALID_ARG (a negative
 * count; on CUDA, shapes too large for one launch). */
TM_API tm_status tm_grouped_swiglu(tm_ctx *ctx, tm_tensor *x, tm_tensor *w_gate, tm_tensor *w_up, tm_tensor *counts,
                                   tm_tensor **out);
/* The experts' whole feed-forward network in one op (Megatron-LM's GroupedMLP; SwiGLU: Shazeer
 * 2020, "GLU Variants Improve Transformer"): per group g of rows (counts as tm_grouped_matmul's),
 *   y_g = (silu(x_g @ w_gate[g]) * (x_g @ w_up[g])) @ w_down[g],   silu(a) = a * sigmoid(a).
 * x [R,K]; w_gate and w_up [G,K,F], of one shape; w_down [G,F,N] (w_gate's G and F); all four of
 * one float dtype; counts i64 [G] (each >= 0, sum = R; validated, read and kept on the host
 * exactly as tm_grouped_matmul does, so no more synchronisations than there); y [R,N] in x's
 * dtype. The same values as tm_grouped_matmul(tm_grouped_swiglu(x, w_gate, w_up, counts),
 * w_down, counts) bit for bit, bf16 rounding included (the SwiGLU output is rounded to the dtype
 * before the down projection reads it), and so are the gradients of x, w_gate, w_up and w_down:
 * the backward runs that composition's kernels in its order, computing the intermediate
 * gradient only where x, w_gate or w_up needs one. Why one op: its backward sees the SwiGLU's
 * saved projections, so that a backend can compute SwiGLU's backward in the epilogue of the down
 * projection's input-gradient GEMM (bf16 on Hopper; written and bit-exact, but not used by
 * default: it measured slower than the composition's two kernels). The MoE block runs its
 * routed experts through this op. Kept for the backward:
 * the two projections and the SwiGLU output ([R,F] each, as the composition keeps them).
 * Errors: TM_ERR_DTYPE (x or a weight not float, or of different dtypes; counts not i64),
 * TM_ERR_SHAPE (x not 2-D, a weight not 3-D, w_gate and w_up of different shapes, w_down not
 * [G,F,N], counts not [G], K differs, counts running past R or not summing to R),
 * TM_ERR_INVALID_ARG (a negative count; on CUDA, shapes too large for one launch). */
TM_API tm_status tm_grouped_mlp(tm_ctx *ctx, tm_tensor *x, tm_tensor *w_gate, tm_tensor *w_up, tm_tensor *w_down,
                                tm_tensor *counts, tm_tensor **y);

/* ------------------------------------------------------------------------------------------ */
/* Mixture of Experts: the block                                                               */
/* ------------------------------------------------------------------------------------------ */

typedef enum tm_aux_counts {
    TM_AUX_COUNTS_ROUTED = 0, /* count the tokens actually routed (after groups, bias) — default */
    TM_AUX_COUNTS_CLEAN = 1   /* count a plain top-k of the aux scores (Megatron's behaviour):
                               * tm_moe_aux_counts */
} tm_aux_counts;

typedef enum tm_moe_strategy {
    TM_MOE_GROUPED = 0, /* permute -> tm_grouped_mlp -> unpermute (dropless by default) */
    TM_MOE_DENSE = 1    /* every expert on every token, weighted by probs: the test oracle */
} tm_moe_strategy;

typedef struct tm_moe_config {
    int hidden_size;      /* H */
    int ffn_size;         /* F of each routed expert */
    tm_router_config router; /* num_experts, topk, score function, groups, scaling, ... */
    int use_expert_bias;  /* aux-loss-free balancing: a bias buffer used for selection only */
    double expert_bias_update_rate; /* default 1e-3 */
    double aux_loss_coeff;      /* 0: off */
    tm_aux_counts aux_counts;
    double seq_aux_loss_coeff;  /* 0: off; needs num_seqs in tm_moe_forward */
    double z_loss_coeff;        /* 0: off */
    int64_t align_size;         /* >= 1; rows per expert rounded up to a multiple */
    double capacity_factor;     /* 0: dropless (default); > 0: capacity as tm_moe_capacity */
    tm_drop_policy drop_policy;
    int pad_to_capacity;        /* with capacity: every expert gets exactly `capacity` rows */
    int shared_ffn_size;        /* 0: none; else a dense SwiGLU of this F on every token, added */
    tm_moe_strategy strategy;
    int apply_topk_weights_early; /* 0 (default) or 1: router weights on the experts' input, below */
    int overlap_chunks;   /* 1 (default; 0 too): off; C > 1: expert-parallel work in C token chunks, below */
} tm_moe_config;

/* overlap_chunks (C). With expert parallelism (ep_size > 1) and ep_strategy alltoall or
 * alltoall_dedup, the permute -> dispatch all-to-all -> experts -> combine all-to-all ->
 * unpermute part of the block runs on C chunks of the layer's tokens (rows [c T / C,
 * (c + 1) T / C) of this rank's T, so chunk sizes differ by at most one: a C that does not
 * divide T is fine), software-pipelined so that one chunk's all-to-all can run on a
 * communication stream while another chunk's experts compute: in program order the dispatch of
 * chunk c + 1 is issued before the experts of chunk c, and the combine of chunk c before the
 * experts of chunk c + 2 (one chunk of lag, so that the backward, which replays the tape in
 * reverse, issues the combine-backward of chunk c before the experts-backward of chunk c + 1;
 * layers/moe.c gives both orders). Source: Megatron-LM's expert-parallel all-to-all overlap
 * (--overlap-moe-expert-parallel-comm), and MaxText PR #3981, which splits route, dispatch,
 * experts and combine per chunk. What overlaps: with tm_comm_options.overlap (the default) and
 * the NCCL engine, every chunk's dispatch all-to-all(s) and its combine all-to-all run on a
 * second CUDA stream (tm_moe_new makes the ep group's second NCCL communicator, collectively:
 * every rank of the group makes its layers in the same order), forward and backward: chunk c's
 * experts wait for its dispatch only (the forward D(c + 1), and in the backward the dispatch
 * gradient of chunk c + 1, run while chunk c's experts compute), the combines are waited for
 * once, by the unpermute (its gradient likewise, by each chunk's experts backward). The count
 * exchange stays on the compute stream (its counts are read at once). The buffers a transfer
 * moves are held until the compute stream has waited for it (framework/side.c). With overlap
 * off, host-staged MPI, or on CPU ranks (whose collectives block: the same bookkeeping runs,
 * its waits at once) the values are the same bit for bit; tm_comm_stats.beside counts what ran
 * beside the work. Speed: on the fine benchmark on 4 H100s chunking did not pay (C = 2 and 4
 * slower than C = 1; its routing is very unbalanced, docs/PERFORMANCE.md), so the default is 1.
 * What is not chunked: the router, top-k, the aux / seq aux / z losses, the expert-bias
 * statistics and capacity dropping are computed over all T tokens exactly as with C = 1 (the
 * chunks take rows of the routing that was decided for the whole layer), so the losses are the
 * same up to the order of float sums; C = 1 is the unchunked code, bit for bit. Host reads:
 * all chunks' counts are exchanged on the device and read together, once per layer forward,
 * before the first chunk's rows move (layers/moe.c lists the reads). With pad_to_capacity
 * every chunk pads each expert to the layer's capacity (C times the padding rows; the results
 * are the same).
 * Ignored (the block computes as with C = 1) for ep_size 1 (no collective to overlap) and for
 * ep_strategy allgather (its collectives are one all-gather of every token before the experts
 * and one reduce-scatter after them, not per-chunk traffic; chunking them is another pipeline).
 * Errors (tm_moe_config_check): overlap_chunks < 0; (tm_moe_forward, every rank alike when
 * the ranks have the same T) C > T on a block that chunks. */

/* apply_topk_weights_early. Off (0), each routed (t,e)'s router weight p[t,e] (the probs after
 * drops: its row's permuted_probs) weights the expert's output in the combine:
 *     y[t] = sum over routed e of p[t,e] * FFN_e(x[t])
 * On (1), it scales the expert's input instead and the combine sums with weight 1:
 *     y[t] = sum over routed e of FFN_e(p[t,e] * x[t])
 * i.e. expert input row r = p_r * x[t(r)] (tm_scale_rows of the permuted rows by their
 * permuted_probs), the SwiGLU FFN as usual, then tm_moe_unpermute with NULL weights. SwiGLU is
 * not linear (silu(p a) * (p b) is not p silu(a) b), so this is another model, not a
 * reordering of the same arithmetic. Gradients reach x and p (so the gate):
 * d p_r = <x[t(r)], d row r>.
 * Source: Megatron-LM moe_apply_probs_on_input (megatron/core/transformer/transformer_config.py;
 * used in moe/experts.py, the forward of GroupedMLP, TEGroupedMLP and SequentialMLP:
 * hidden = permuted_probs.unsqueeze(-1) * hidden, cast back to hidden's dtype, then the probs
 * reset to ones so that nothing weights the output again), as Llama 4 routes (Hugging Face
 * Llama4TextMoe: hidden states times the router scores before the experts; top-1, sigmoid).
 * What carries over, and where tinymoe differs:
 *   - topk: Megatron asserts moe_router_topk == 1 ("`moe_apply_probs_on_input` only works with
 *     `moe_router_topk`=1"), as does TensorRT-LLM's apply_router_weight_on_input for Llama 4.
 *     tinymoe accepts any topk: every routed (t,e) is its own row with its own p, and the
 *     formula above is well defined (the dense strategy checks it); with k = 1 and
 *     norm_topk_prob the weight is 1 and the option changes nothing, so pair k = 1 with
 *     sigmoid scores or a softmax without renormalisation, as Llama 4 does;
 *   - precision: Megatron multiplies the fp32 probs (moe_router_dtype fp32) by the bf16 rows in
 *     fp32 and casts back; here the product is taken in f32 (f64 for an f64 block) and rounded
 *     once to the block's dtype (tm_scale_rows);
 *   - padding rows (align_size, pad_to_capacity; Megatron's drop-and-pad slots, whose probs
 *     are 0) get weight 0: their input stays zero and the combine skips them;
 *   - capacity: a dropped (t,e) has no row (tm_moe_drop_tokens zeroes its p and map entry),
 *     so dropping acts as it does with the option off; capacities and counts are unchanged;
 *   - the shared expert (shared_ffn_size) sees the unweighted x, as Llama 4's does;
 *   - the dense strategy computes sum over all E experts of FFN_e(probs[:, e] * x): an expert
 *     a token does not route to gets p = 0, a zero input and FFN_e(0) = 0 (no biases), so it
 *     remains an independent oracle of the grouped path;
 *   - expert parallelism: ALLTOALL scales the rows on their source rank before the dispatch
 *     all-to-all (the weights still never travel); ALLGATHER scales the local experts' rows of
 *     the gathered tokens; both then combine with weight 1, so every layout computes what one
 *     process does.
 * Not TransformerEngine's flag of the same name (the JAX MoEBlock, transformer_engine/jax/moe.py,
 * with PR #3116): that one multiplies the SwiGLU output by the weights before the linear wo
 * GEMM, which moves the multiply but keeps the late-weighted function. A Hugging Face Mixtral
 * export cannot express the option (Mixtral weights the expert outputs) and refuses it. */

/* H 64, F 128, router defaults (E 8, k 2), no bias, no losses, align 1, dropless, grouped. */
TM_API tm_moe_config tm_moe_config_default(void);

/* Check every field (the message names the field and its value). ctx may be NULL (no message).
 * Errors: TM_ERR_INVALID_ARG (cfg NULL, a field out of range). */
TM_API tm_status tm_moe_config_check(tm_ctx *ctx, const tm_moe_config *cfg);

typedef struct tm_moe tm_moe;

/* Build a block's parameters (names prefixed by `prefix`, e.g. "layers.3.moe"). Under expert
 * parallelism (the context's communicator has ep_size P > 1) the experts.* tensors hold this
 * rank's E / P experts [ep rank * E / P, ...), as shards of the logical [E, ...] tensors
 * (tm_param_options shard_axis 0: initialised and checkpointed as the logical tensors), and the
 * forward dispatches tokens with the communicator's ep_strategy (tinymoe.h, "Distributed"):
 *   <p>.gate.weight [H,E]; <p>.experts.w0, .w1 [E,H,F]; <p>.experts.wo [E,F,H] (these three in
 *   the expert parameter group, experts [0, E)); the rest dense:
 *   <p>.shared.w0, .w1 [H,Fs]; <p>.shared.wo [Fs,H] (if shared_ffn_size);
 *   buffers <p>.expert_bias [E] in the gate dtype (if use_expert_bias) and
 *   <p>.tokens_per_expert_sum i64 [E].
 * Parameters are zero: initialise them (tm_moe_init or tm_tensor_init_normal).
 * dtype: f32, bf16 or f64 (CPU) for the weights; the gate math is always f32 (f64 for f64):
 * gate.weight, expert_bias, the logits and the losses are in that gate dtype.
 * Errors: TM_ERR_INVALID_ARG (out or prefix NULL, a field as tm_moe_config_check, a prefix of
 * 96 bytes or more, a name already in the context: one block per prefix; under expert
 * parallelism num_experts not divisible by ep_size, or the dense strategy), TM_ERR_DTYPE (dtype
 * not float; f64 on CUDA), TM_ERR_DEVICE (dev not available), TM_ERR_NOMEM, TM_ERR_CUDA. A
 * failure may leave the parameters made before it in the context. */
TM_API tm_status tm_moe_new(tm_ctx *ctx, const char *prefix, const tm_moe_config *cfg, tm_dtype dtype, tm_device dev,
                     tm_moe **out);
TM_API void tm_moe_free(tm_moe *moe); /* the parameters stay with the context; NULL: no-op */
/* Normal(0, std) for every weight, keyed by (seed, parameter name); output projections
 * (experts.wo, shared.wo) use out_std. With a communicator attached and no optimizer yet, it is
 * collective: the ranks holding copies of a weight (dense: every rank; an expert shard: its
 * expert-data-parallel group) each draw a part and all-gather the rest, the same values as one
 * rank drawing all; call it on every rank. Errors: TM_ERR_INVALID_ARG (std or out_std < 0 or
 * NaN), TM_ERR_NOMEM, TM_ERR_CUDA, TM_ERR_COMM. */
TM_API tm_status tm_moe_init(tm_moe *moe, uint64_t seed, double std, double out_std);
TM_API const tm_moe_config *tm_moe_get_config(const tm_moe *moe);
/* A parameter or buffer of the block by suffix ("gate.weight", "experts.w0", "expert_bias", ...). */
TM_API tm_tensor *tm_moe_tensor(const tm_moe *moe, const char *suffix);

typedef struct tm_moe_stats {
    /* Filled by tm_moe_forward: tensors on the block's device, arena temporaries (valid until
     * tm_ctx_arena_reset); nothing of them has been read back. */
    /* Differentiable 0-d losses in the gate dtype (f32; f64 for an f64 block), coefficients
     * applied; NULL when the coefficient is 0. Add them to the training loss. */
    tm_tensor *aux_loss, *seq_aux_loss, *z_loss;
    tm_tensor *tokens_per_expert; /* i64 [E]: routed (after drops, before alignment) */
    tm_tensor *dropped;           /* i64 0-d: routed (t,e) pairs removed by capacity; NULL when dropless */
    /* i64 [E + 4]: all of the above in one tensor, so that one read brings them to the host
     * (tm_moe_stats_read): the E counts, dropped, then the aux, seq-aux and z loss values,
     * each in an 8-byte slot holding its gate-dtype bits (an f32 in the slot's first 4 bytes);
     * 0 for what is off. */
    tm_tensor *packed;
    /* Host copies: 0 after tm_moe_forward, filled by tm_moe_stats_read. */
    int64_t dropped_tokens;       /* routed (t,e) pairs removed by capacity */
    double max_load_ratio;        /* max_e count / mean_e count (1 = perfectly balanced) */
    double min_load_ratio;        /* min_e count / mean_e count */
    double aux_loss_value, seq_aux_loss_value, z_loss_value; /* 0 when off */
} tm_moe_stats;

/* y = MoE(x): x [..., H] -> y [..., H] (same dtype). num_seqs: sequences in x for the
 * sequence-level aux loss (rows are split evenly; 1 if unused). stats may be NULL; otherwise
 * it receives the statistics as device tensors (see tm_moe_stats; tm_moe_stats_read brings
 * them to the host). With grad mode on, tokens_per_expert is also added to the block's running
 * sum for tm_moe_update_expert_bias, on the device (evaluation and sampling forwards do not
 * move the expert bias). Host round trips (tm_ctx_sync_count), forward + backward: with the grouped strategy
 * at most one: the permute's row count where it depends on the data (dropless with
 * align_size > 1, or a capacity without pad_to_capacity); dropless with align_size 1 the permute
 * reads nothing (R = T * topk) and a grouped GEMM that needs the group sizes on the host reads
 * them once; with pad_to_capacity none. None with the dense strategy; the forward reads no
 * statistic back.
 * Errors: TM_ERR_INVALID_ARG (x or y NULL, num_seqs < 1, a sequence-level aux loss with the
 * T rows not divisible by num_seqs), TM_ERR_SHAPE (x 0-d or its last dim not H), TM_ERR_DTYPE
 * (x not of the block's dtype), and those of the ops it runs (see Ops): TM_ERR_DEVICE (x not
 * on the block's device), TM_ERR_UNSUPPORTED (on CUDA: the MoE ops are CPU only for now),
 * TM_ERR_NOMEM, TM_ERR_CUDA. */
TM_API tm_status tm_moe_forward(tm_moe *moe, tm_tensor *x, int64_t num_seqs, tm_tensor **y, tm_moe_stats *stats);
/* Bring the statistics of a forward of this block to the host with one read of stats->packed
 * (one synchronisation): fills dropped_tokens, max_load_ratio, min_load_ratio and the three
 * loss values of *stats. Call it before tm_ctx_arena_reset, when (and only if) the values are
 * needed. Errors: TM_ERR_INVALID_ARG (stats NULL, stats->packed NULL or not the i64 [E + 4] of
 * a forward of this block), TM_ERR_NOMEM, TM_ERR_CUDA. */
TM_API tm_status tm_moe_stats_read(tm_moe *moe, tm_moe_stats *stats);
/* Once per optimizer step: apply the expert-bias update (if use_expert_bias and the rate is
 * > 0) from the counts summed since the last call, then clear the sum (named tm_moe_step
 * before 2026-11).
 * Errors: those of tm_moe_expert_bias_update, TM_ERR_CUDA (clearing a CUDA sum). */
TM_API tm_status tm_moe_update_expert_bias(tm_moe *moe);

/* ------------------------------------------------------------------------------------------ */
/* Mixtral-style decoder-only language model                                                   */
/* ------------------------------------------------------------------------------------------ */
/* tokens -> embedding -> n_layers x [ x += attn(rmsnorm(x)); x += ffn(rmsnorm(x)) ]
 *        -> rmsnorm -> lm_head -> logits
 * attn: causal, grouped-query heads, rotary embeddings (rotate-half, theta rope_theta), no
 * biases; ffn: the MoE block (tm_moe_*) or, for the first first_k_dense layers, a dense SwiGLU.
 * Matches MixtralForCausalLM's architecture (Jiang et al. 2024, arXiv 2401.04088).
 * Parameter names: "embed.weight", "layers.<i>.attn_norm.weight", "layers.<i>.attn.wq|wk|wv|wo",
 * "layers.<i>.ffn_norm.weight", "layers.<i>.moe.*" (tm_moe_new) or "layers.<i>.mlp.w0|w1|wo",
 * "norm.weight", "lm_head.weight" (absent when tied). */
typedef struct tm_model_config {
    int vocab_size;     /* default 257 (bytes + end-of-text) */
    int d_model;        /* H; default 128 */
    int n_layers;       /* default 4 */
    int n_heads;        /* query heads; default 4; d_model % n_heads == 0 */
    int n_kv_heads;     /* default 4; n_heads % n_kv_heads == 0 */
    int max_seq_len;    /* longest sequence the model accepts; default 128 */
    double rope_theta;  /* default 10000 */
    double norm_eps;    /* RMSNorm epsilon; default 1e-5 */
    int tie_embeddings; /* lm_head = embed.weight^T; default 0 */
    int first_k_dense;  /* layers [0, first_k_dense) use a dense SwiGLU; default 0 */
    int dense_ffn_size; /* F of those layers; 0 (default): 4 * d_model */
    double init_std;    /* N(0, init_std^2); residual output projections (attn.wo, the
                         * ffn output weights) get init_std / sqrt(2 n_layers); default 0.02 */
    tm_moe_config moe;  /* every MoE option; moe.hidden_size is taken from d_model.
                         * aux_loss_coeff / z_loss_coeff weigh the layer losses in the total. */
} tm_model_config;

/* Defaults above with moe = 4 experts, top-2, ffn 256, softmax-pre, aux_loss_coeff 1e-2. */
TM_API tm_model_config tm_model_config_default(void);
/* Check every field; the message names the field (and for MoE fields, "moe." + the name).
 * ctx may be NULL (no message). Errors: TM_ERR_INVALID_ARG (cfg NULL, a field out of range). */
TM_API tm_status tm_model_config_check(tm_ctx *ctx, const tm_model_config *cfg);

typedef struct tm_model tm_model;

/* Build the parameters named above (zero until tm_model_init) on dev in dtype (f32, bf16, or
 * f64 on the CPU; the MoE gates are f32, f64 for f64), each bucket allocated once at its exact
 * size (tm_ctx_defer_params; under a caller's deferral, at the caller's
 * tm_ctx_materialize_params). One model per context: the names are fixed. Errors: TM_ERR_INVALID_ARG (out NULL, cfg as tm_model_config_check, a parameter name
 * already in the context), TM_ERR_DTYPE (dtype not float; f64 on CUDA), TM_ERR_DEVICE (dev not
 * available), TM_ERR_NOMEM, TM_ERR_CUDA. A failure may leave the parameters made before it in
 * the context. */
TM_API tm_status tm_model_new(tm_ctx *ctx, const tm_model_config *cfg, tm_dtype dtype, tm_device dev, tm_model **out);
/* Free the model's host bookkeeping; call before tm_ctx_free (the parameters stay with the
 * context). NULL: no-op. */
TM_API void tm_model_free(tm_model *model);
/* Initialise every parameter from (seed, name) as described in tm_model_config (norm
 * weights 1). Identical on every backend and layout. Collective under a communicator (as
 * tm_moe_init: each replica draws 1/G of a weight, an all-gather fills in the rest; call it on
 * every rank). Errors: TM_ERR_NOMEM, TM_ERR_CUDA, TM_ERR_COMM. */
TM_API tm_status tm_model_init(tm_model *model, uint64_t seed);
TM_API const tm_model_config *tm_model_get_config(const tm_model *model);
/* Parameter counts: total, and active per token (routed experts counted topk / E). */
TM_API int64_t tm_model_num_params(const tm_model *model, int64_t *active_per_token);

/* What one optimizer step of a run moves and holds beyond what is held between steps, for
 * this rank: the plan of a model built in a plan-only context (tm_ctx_options.plan_only, with
 * tm_comm_init's plan_world_size and plan_rank) after its optimizer was made, as a run makes
 * them. Bytes are those tm_comm_get_stats counts (all-reduce: the buffer; all-gather: this
 * rank's part; reduce-scatter: the input; all-to-all: the rows sent) and tm_ctx_memory_report
 * counts; each comes from the code that issues the collective or holds the memory:
 *  - grad_sync, param_gather (ZeRO 0-2), transient (ZeRO-2): tm_comm_sync_grads and the
 *    parameters' all-gather after the update run on the placeholders, after the full gradient
 *    buffers a backward makes (ZeRO-2: G ZeRO blocks per bucket, held from a step's first
 *    backward to the synchronisation: the transient bytes);
 *  - param_gather, bwd_reduce, transient (ZeRO-3): every unit the model's forward uses
 *    ("Units": the embedding, each layer's dense, expert and router buckets, the final norm with
 *    the lm_head) is all-gathered once (this rank's block), and again in the backward
 *    (tm_model_forward gives each back after its layer) unless the forward keeps it
 *    (tm_comm_options.zero3_keep_last); its reduce-scatter sends the gathered gradient (G
 *    blocks); transient: the most gathered unit bytes in use at once (a layer's units, the
 *    embedding's, the head's, with the kept units held so far: a unit gathered ahead counts
 *    from its use, as in a run);
 *  - dispatch: the MoE layers' expert-parallel exchange, forward and backward, for `tokens`
 *    rows per micro-batch under balanced routing (each expert receives tokens x topk / E rows):
 *    alltoall: 2 x 2 x tokens x topk x (P-1)/P rows of d_model; alltoall_dedup: a token goes
 *    to each other rank holding one of its topk experts (probability 1 - C(E-L, k) / C(E, k),
 *    L = E / P) with its L weights and L map values, and a partial row comes back; allgather:
 *    the tokens (d_model), router weights and map (E x (gate size + 1) bytes) of the rank out,
 *    the P x tokens output rows reduce-scattered; 0 with ep_size 1.
 * micro_batches (>= 1) multiplies what each micro-batch repeats (ZeRO-3's gathers and
 * reduce-scatters, the dispatch); the synchronisation and the parameter all-gather run once
 * per step. tokens: rows of one micro-batch on this rank (batch rows x sequence length), >= 1.
 * The context's gradient state is that of a step's end afterwards (call it once).
 * Errors: TM_ERR_INVALID_ARG (NULL, tokens or micro_batches < 1), TM_ERR_STATE (not a plan-only
 * context). */
typedef struct tm_step_plan {
    int64_t grad_sync;    /* bytes handed to tm_comm_sync_grads' collectives: all-reduces, or
                           * ZeRO-1 and 2 reduce-scatters; 0 under ZeRO-3 */
    int64_t param_gather; /* ZeRO-1 and 2: the parameters' all-gather after the update; ZeRO-3:
                           * the weights' all-gathers, forward and backward (the kept ones:
                           * forward only) */
    int64_t bwd_reduce;   /* ZeRO-3: the reduce-scatters of the gathered weights' gradients */
    int64_t dispatch;     /* the MoE layers' expert-parallel exchange (balanced routing) */
    int64_t transient;    /* bytes held during the step beyond those between steps: ZeRO-2's
                           * full gradient buffers, ZeRO-3's gathered weights in use at once */
} tm_step_plan;
TM_API tm_status tm_model_plan_step(tm_model *model, int64_t tokens, int micro_batches, tm_step_plan *out);

typedef struct tm_model_out {
    tm_tensor *logits;  /* [B,T,V], the model's dtype */
    tm_tensor *loss;    /* 0-d: ce + sum of the MoE layer losses (coefficients applied); NULL
                         * without targets. ce_loss's dtype */
    tm_tensor *ce_loss; /* 0-d mean cross-entropy over targets != ignore_index; f32 for f32
                         * and bf16 models (bf16 logits are cast first), f64 for f64 */
    /* Host values, all from the forward's one read (below): */
    double loss_value, ce_value;               /* 0 without targets */
    double aux_value, seq_aux_value, z_value;  /* summed over MoE layers; 0 when off */
    int n_moe_layers;
    /* [n_moe_layers * E] routed tokens per expert of this forward (after drops), row-major by
     * MoE layer; owned by the model, valid until its next forward. */
    const int64_t *tokens_per_expert;
    double max_load_ratio;  /* max over MoE layers of max_e count / mean count */
    int64_t dropped_tokens; /* summed over MoE layers */
} tm_model_out;

/* Forward: tokens i32 [B,T] (values in [0, vocab_size), T <= max_seq_len); targets i32 [B,T]
 * or NULL (no loss); target -1 is ignored. Every statistic of the step (loss, cross-entropy,
 * each MoE layer's counts, dropped pairs and losses) is gathered on the model's device into one
 * tensor and read back once, at the end: a forward's host round trips (tm_ctx_sync_count) are
 * that read plus one per MoE layer of the grouped strategy (its permute's row count), so a
 * forward + tm_backward makes at most n_moe_layers + 1. The token and target values are checked
 * on the device too (tm_index_check) and reported from that read: a bad id still lets the
 * forward run (on a replaced id) but fails the call with TM_ERR_INDEX, *out untouched and the
 * MoE layers' running counts unchanged (they grow, with grad mode on, only after the check).
 * Under data parallelism (a communicator with dp > 1) it is collective over the dp group and
 * makes two host collectives whatever the depth: an all-gather of the ranks' row counts (where
 * this rank's rows sit in the global batch, shared by every MoE layer) and an all-reduce of the
 * loss values read back; the MoE layers' device collectives come on top (tinymoe.h,
 * "Distributed").
 * Errors: TM_ERR_INVALID_ARG (tokens or out NULL), TM_ERR_DTYPE / TM_ERR_SHAPE
 * (tokens or targets not i32 [B,T] with B, T >= 1; targets' shape not tokens'; T >
 * max_seq_len), TM_ERR_DEVICE (tokens or targets not on the model's device), TM_ERR_INDEX (a
 * token outside [0, vocab_size), or a target outside it and not -1, naming its position and
 * value; tokens are reported before targets), and those of the ops and blocks it runs:
 * TM_ERR_UNSUPPORTED (an op without a kernel on the model's device, named), TM_ERR_NOMEM,
 * TM_ERR_CUDA. */
TM_API tm_status tm_model_forward(tm_model *model, tm_tensor *tokens, tm_tensor *targets, tm_model_out *out);
/* Once per optimizer step: tm_moe_update_expert_bias on every MoE layer. Errors: those of
 * tm_moe_update_expert_bias. */
TM_API tm_status tm_model_step(tm_model *model);

/* ------------------------------------------------------------------------------------------ */
/* Incremental decoding                                                                        */
/* ------------------------------------------------------------------------------------------ */
/* A key/value cache lets a model process a sequence a few tokens at a time (a prompt, then one
 * generated token per call) without recomputing the prefix: each layer keeps the rotated keys
 * and the values of every position seen so far. Per layer it holds k and v of shape
 * [batch, max_len, n_kv_heads, head_dim] in the model's dtype on its device, allocated once by
 * tm_kv_cache_new outside the arenas and outside the named tensors (so never in checkpoints).
 * Memory: 2 * n_layers * batch * max_len * n_kv_heads * head_dim * sizeof(dtype) bytes. */
typedef struct tm_kv_cache tm_kv_cache;

/* A cache for `batch` sequences of up to max_len positions, 1 <= max_len <= max_seq_len: one
 * zeroed device allocation (counted by tm_ctx_alloc_count), length 0.
 * Errors: TM_ERR_INVALID_ARG (null, batch < 1, max_len outside [1, max_seq_len], naming the
 * argument), TM_ERR_NOMEM, TM_ERR_CUDA. The cache belongs to the model and must be freed
 * before it. */
TM_API tm_status tm_kv_cache_new(tm_model *model, int batch, int max_len, tm_kv_cache **out);
/* NULL: no-op. */
TM_API void tm_kv_cache_free(tm_kv_cache *cache);
/* Forget every position (length 0); memory is kept. */
TM_API void tm_kv_cache_reset(tm_kv_cache *cache);
/* Positions held (the same for every sequence of the batch), and the capacity. */
TM_API int tm_kv_cache_len(const tm_kv_cache *cache);
TM_API int tm_kv_cache_capacity(const tm_kv_cache *cache);

/* Forward of T new tokens per sequence, tokens i32 [batch, T], at positions
 * [len, len + T) where len = tm_kv_cache_len(cache): their keys and values are appended to the
 * cache and *logits (an arena temporary, [batch, T, V], the model's dtype) receives the same
 * values tm_model_forward gives for those positions on the whole sequence (equal up to
 * floating-point summation order), however the sequence is split into calls. Runs with the
 * tape off whatever the grad mode (no backward through the cache; the mode is restored) and
 * does not touch the expert-bias statistics. The cache stays valid across
 * tm_ctx_arena_reset. Host round trips: one read of tokens (checked on the host before
 * anything runs) and one per MoE layer of the grouped strategy (its permute's row count).
 * Exception: with moe.capacity_factor > 0 a token's expert slots depend on which other
 * tokens share its forward (capacity = f(tokens in the call)), so cached decoding then
 * drops differently from the full forward and the logits differ.
 * Errors (after any of them len is unchanged: nothing is appended):
 * TM_ERR_INVALID_ARG (null, a cache made for another model, len + T > capacity, naming the
 * sizes), TM_ERR_DTYPE / TM_ERR_SHAPE (tokens not i32 [batch, T] with T >= 1; the batch
 * differs from the cache's), TM_ERR_INDEX (a token outside [0, vocab_size), naming its
 * position and value), TM_ERR_DEVICE (tokens on another device), TM_ERR_UNSUPPORTED (an op
 * without a kernel on the model's device, naming the op), TM_ERR_NOMEM, TM_ERR_CUDA. */
TM_API tm_status tm_model_forward_cached(tm_model *model, tm_kv_cache *cache, tm_tensor *tokens, tm_tensor **logits);

/* ------------------------------------------------------------------------------------------ */
/* Sampling                                                                                    */
/* ------------------------------------------------------------------------------------------ */
/* Temperature, top-k (Fan et al. 2018) and nucleus / top-p (Holtzman et al. 2020, "The Curious
 * Case of Neural Text Degeneration") sampling, applied in that order (as HuggingFace's
 * temperature -> top-k -> top-p warpers):
 *   temperature <= 0: argmax of the logits (ties: the lowest index); otherwise
 *   rank the tokens by (logit descending, index ascending) — ties go to lower indices
 *   everywhere below; p_i = softmax(logits / temperature)_i; keep the first top_k of the
 *   ranking (top_k <= 0 or >= V: all); then keep the shortest prefix of those whose mass
 *   reaches top_p of the kept top-k mass (sum of p over the prefix >= top_p * sum over the
 *   top k; top_p = 1: all); renormalise and draw with one uniform u in [0, 1) from
 *   Philox4x32-10 with key = (seed lo, seed hi) and counter = (counter lo, counter hi,
 *   0x4c504d53, 0): u = ((out0 >> 5) * 2^26 + (out1 >> 6)) / 2^53; the token is the first in
 *   rank order whose cumulative renormalised probability exceeds u (inverse CDF), so a token
 *   of probability 0 is never drawn. Infinite logits take softmax's limits: if any logit is
 *   +inf those share all the mass equally; if all are -inf the distribution is uniform.
 *   The same (logits, config, counter) always gives the same token. */
typedef struct tm_sampler_config {
    double temperature; /* default 1.0 */
    int top_k;          /* default 0 (all) */
    double top_p;       /* default 1.0 (all); in (0, 1] */
    uint64_t seed;      /* default 0 */
} tm_sampler_config;

TM_API tm_sampler_config tm_sampler_config_default(void);

/* Draw one token from host logits[V] (f32). counter: the draw's index (e.g. the position of
 * the token being generated). Scratch memory (V entries, for temperature > 0) comes from
 * ctx's host arena and is released by the next tm_ctx_arena_reset.
 * Errors: TM_ERR_INVALID_ARG (null, V < 1, temperature NaN, top_p outside (0, 1] or NaN, a
 * NaN logit, naming it), TM_ERR_NOMEM. */
TM_API tm_status tm_sample_token(tm_ctx *ctx, const float *logits, int V, const tm_sampler_config *cfg, uint64_t counter,
                          int *token);

/* ------------------------------------------------------------------------------------------ */
/* Checkpoints                                                                                 */
/* ------------------------------------------------------------------------------------------ */
/* Byte layout: docs/checkpoint-format.md (little-endian; version 2: header, meta, the tensors'
 * bytes raw or as zlib streams, an index of the tensors with each one's offset and CRC32).
 * Files of version 1 (tinymoe before issue 21) still load and inspect. */

/* Write every parameter and buffer of ctx (name, dtype, shape and data as full logical
 * tensors, whatever device holds them) plus an opaque meta blob (the caller's config, step,
 * RNG and data position). Written to "<path>.tmp.XXXXXX" in the same directory, fsync'ed,
 * renamed over path, then the directory is fsync'ed: a crash at any moment leaves either the
 * previous file or the new one, complete. On failure the temporary file is removed.
 * Errors: TM_ERR_INVALID_ARG (path NULL, empty or too long for its temporary name, meta NULL
 * with meta_bytes > 0), TM_ERR_IO (the message names the file and the system error),
 * TM_ERR_UNSUPPORTED (a big-endian host; a tensor over 4 GiB, zlib's limit for one deflate
 * call), TM_ERR_NOMEM, TM_ERR_CUDA (reading a device tensor). */
/* Under a communicator of several ranks saving is collective: every rank calls it (with the
 * same path; the ranks must share its directory) and the ranks write one file of logical
 * tensors together: each tensor spread over the ranks (expert shards, ZeRO blocks of optimizer
 * state, master weights, ZeRO-3 parameters) is written in place by the ranks that hold it, its
 * ranges at offsets every rank computes from the logical shapes, nothing gathered; world rank
 * 0 writes the meta, the tensors every rank holds whole and the compressed ones, then (once
 * every rank reported its writes and their CRCs) the index, and renames the file into place
 * (docs/checkpoint-format.md, "Written by every rank"). Every rank returns the same status: an
 * error on any rank fails the save on all (the message names the rank), TM_ERR_COMM if a
 * collective failed. Loading needs no communication: each rank reads the file and keeps its
 * part, so a checkpoint written under one layout loads under any other. */
TM_API tm_status tm_ckpt_save(tm_ctx *ctx, const char *path, const void *meta, size_t meta_bytes);

/* How tensors are stored: each tensor is either raw bytes or one zlib stream (deflate level 1,
 * Huffman-only), recorded per tensor in the file. AUTO (the default): integer tensors
 * compressed, float tensors (weights, optimizer state: near-incompressible, and deflate runs
 * at ~60 MB/s a thread against GB/s for the disk) raw. NONE / ALL: every tensor raw /
 * compressed. compress_tensor, when not NULL, decides instead, per tensor: nonzero =
 * compressed; it is called once per tensor, on the calling thread, with the tensor's name and
 * dtype and `user`. */
typedef enum tm_ckpt_compress {
    TM_CKPT_COMPRESS_AUTO = 0,
    TM_CKPT_COMPRESS_NONE = 1,
    TM_CKPT_COMPRESS_ALL = 2
} tm_ckpt_compress;
typedef struct tm_ckpt_save_options {
    tm_ckpt_compress compress;
    int (*compress_tensor)(const char *name, tm_dtype dtype, void *user);
    void *user;
    /* Called (when not NULL) once the tensor data is in the temporary file "<path>.tmp.XXXXXX"
     * (tmp_path) and before its index is written, it is fsynced and renamed over path: a hook to
     * observe or delay a save at the moment a crash would leave only the temporary file (the
     * driver's tests hold saves open there to land signals and kills inside them). Runs on the
     * thread that writes (a snapshot's writer thread). */
    void (*before_commit)(const char *tmp_path, void *user);
} tm_ckpt_save_options;
/* {TM_CKPT_COMPRESS_AUTO, NULL, NULL, NULL} */
TM_API tm_ckpt_save_options tm_ckpt_save_options_default(void);
/* tm_ckpt_save with options (NULL: the defaults, exactly tm_ckpt_save). Same errors, plus
 * TM_ERR_INVALID_ARG for a compress value out of range, and TM_ERR_UNSUPPORTED for a tensor
 * over 4 GiB chosen for compression (zlib's limit for one deflate call; raw has no limit).
 * The tensors are copied to host staging memory (page-locked where the device backend offers
 * it) in batches of 64 MiB, while the previous batch is checksummed and written by the other
 * threads of the context. */
TM_API tm_status tm_ckpt_save_ex(tm_ctx *ctx, const char *path, const void *meta, size_t meta_bytes,
                                 const tm_ckpt_save_options *options);

/* Asynchronous saves (torchtitan's asynchronous checkpointing): a save in two steps, so that
 * training stalls only for the copy of its state to host memory. A snapshot is host memory for
 * every parameter and buffer of ctx (their logical bytes, page-locked where the device backend
 * offers it, one 64-byte aligned slot each) plus the meta blob; tm_ckpt_snapshot_take copies
 * the context's current tensors into it (the "gather to host" step: device-to-host copies and,
 * under a communicator, the gathers of sharded tensors), and tm_ckpt_snapshot_write writes
 * them as tm_ckpt_save would: the same file, byte for byte, through the same temporary file,
 * fsync and rename, so a crash or kill -9 during the write leaves the previous file at path
 * intact. The write reads nothing of the context (names, shapes and every byte were taken), so
 * it may run on another thread while the context's thread goes on training:
 *
 *     tm_ckpt_snapshot *s;
 *     tm_ckpt_snapshot_new(ctx, NULL, &s);           once: allocates tm_ckpt_snapshot_bytes(s)
 *     ...  tm_ckpt_snapshot_take(s, meta, len);      the stall: a copy of the state
 *          start a thread: tm_ckpt_snapshot_write(s, path, 1), report tm_ckpt_snapshot_errmsg(s)
 *          ... train; join the thread before the next take (or before tm_ckpt_snapshot_free)
 *
 * Threads: new, take, commit and free are calls on the context (its thread, in turn with its other
 * calls); write may be on any thread. A snapshot must not be taken, written or freed while it
 * is being written. ctx must outlive the snapshot, and its set of parameters and buffers must
 * not change between new and take.
 *
 * Under a communicator of several ranks the file is written by every rank, as tm_ckpt_save
 * writes it (docs/checkpoint-format.md, "Written by every rank"): each rank's snapshot holds only
 * what it writes (its ranges of the tensors spread over the ranks: expert shards, ZeRO blocks;
 * world rank 0 also the tensors every rank holds whole and those chosen for compression), so
 * tm_ckpt_snapshot_bytes falls with the rank count. new, take and commit are collective (every
 * rank calls them in the same order, and each returns the same status on every rank); write
 * runs on each rank, on any thread, makes no collective call (it cannot deadlock with the
 * collectives of training, and MPI need not allow calls from other threads) and writes that
 * rank's part into the ranks' shared temporary file "<path>.tmp.XXXXXX" (the ranks must share
 * the directory: one node or a shared file system), fsynced. The file appears at path only at
 * tm_ckpt_snapshot_commit, once every rank's write has returned; until then a crash or kill -9
 * of any rank leaves the previous file:
 *
 *     every rank: take (collective); start a thread: write(s, path, 0); ... train ...
 *                 join the thread; commit(s) (collective; rank 0 renames)
 */
typedef struct tm_ckpt_snapshot tm_ckpt_snapshot;

/* Allocate a snapshot of ctx's parameters and buffers. options as tm_ckpt_save_ex (NULL: the
 * defaults), applied now: which tensors are compressed is decided here, once (compress_tensor
 * is called here, once per tensor). The deflate state for compressed tensors is made here too,
 * for up to the context's thread count of writer threads.
 * Errors: TM_ERR_INVALID_ARG (out NULL, compress out of range), TM_ERR_UNSUPPORTED (a big-endian
 * host; a tensor over 4 GiB chosen for compression), TM_ERR_NOMEM (the message gives the bytes).
 * *out is NULL after a failure. Free with tm_ckpt_snapshot_free. */
TM_API tm_status tm_ckpt_snapshot_new(tm_ctx *ctx, const tm_ckpt_save_options *options, tm_ckpt_snapshot **out);
/* Host memory the snapshot holds on this rank, in bytes: the tensors' bytes (under a communicator,
 * the ones this rank writes), staging for compressed tensors, the index (one process) and the
 * meta (world rank 0). 0 for NULL. */
TM_API uint64_t tm_ckpt_snapshot_bytes(const tm_ckpt_snapshot *s);
/* Copy the current value of every parameter and buffer (full logical tensors) and meta
 * (meta_bytes bytes; may be NULL when 0) into s, replacing what it held. When it returns, ctx
 * may change its tensors: the snapshot keeps the values of this call. Errors (the message in
 * tm_ctx_errmsg of the snapshot's context): TM_ERR_INVALID_ARG (s NULL, meta NULL with
 * meta_bytes > 0, the context's parameters or buffers differ from those at tm_ckpt_snapshot_new),
 * TM_ERR_NOMEM, TM_ERR_CUDA, TM_ERR_COMM. After a failure the snapshot holds nothing writable. */
TM_API tm_status tm_ckpt_snapshot_take(tm_ckpt_snapshot *s, const void *meta, size_t meta_bytes);
/* Write what the last successful take copied to path, exactly as tm_ckpt_save writes (same
 * format, same atomic protocol; the temporary file is removed on failure), with num_threads
 * threads checksumming, compressing and writing (0: the context's thread count; more than it
 * write but deflate with at most that many). Under a communicator of several ranks: this
 * rank's part only, into the ranks' temporary file for path (every rank passes the same path),
 * fsynced; tm_ckpt_snapshot_commit finishes the file (or removes it).
 * Errors (the message in tm_ckpt_snapshot_errmsg(s), not the context's): TM_ERR_INVALID_ARG
 * (s NULL, path NULL, empty or too long, num_threads < 0, no successful take), TM_ERR_IO (the
 * message names the file and the system error), TM_ERR_NOMEM / TM_ERR_INTERNAL (deflate). */
TM_API tm_status tm_ckpt_snapshot_write(tm_ckpt_snapshot *s, const char *path, int num_threads);
/* Under a communicator of several ranks: finish the write of every rank (collective, on the
 * context's thread, once this rank's tm_ckpt_snapshot_write has returned: join its thread
 * first). The statuses of the ranks' writes and the CRCs of their parts are all-gathered; if
 * every write succeeded, world rank 0 writes the index and header, fsyncs, renames the
 * temporary file over the path given to write and fsyncs the directory; otherwise the
 * temporary file is removed and path is left as it was. Returns the same status on every rank
 * (the message in tm_ctx_errmsg names the rank that failed and its message). With one process
 * write has done all of this: TM_OK at once. A write that is never committed (the snapshot
 * taken again or freed first) is removed, never renamed. Errors: TM_ERR_INVALID_ARG (s NULL; a
 * rank called no write since the last commit), a rank's write's error, TM_ERR_IO (rank 0's
 * index, fsync or rename), TM_ERR_COMM. */
TM_API tm_status tm_ckpt_snapshot_commit(tm_ckpt_snapshot *s);
/* The message of the last tm_ckpt_snapshot_write ("" after a success; "" for NULL). Valid until
 * the next write or free of s. */
TM_API const char *tm_ckpt_snapshot_errmsg(const tm_ckpt_snapshot *s);
/* NULL: no-op. On the context's thread, not during a write. Removes the temporary file of a
 * write not committed (several ranks). Not collective. */
TM_API void tm_ckpt_snapshot_free(tm_ckpt_snapshot *s);

/* Load a checkpoint written by tm_ckpt_save into the tensors of ctx, which must hold exactly
 * the same set of names, each with the same dtype and shape. The whole file is validated
 * first (magic, version, endianness, every CRC, every tensor inflates, names/dtypes/shapes,
 * no tensor missing, meta fits meta_cap); only then are tensors written, so a failed load
 * leaves ctx untouched. The meta blob is copied to meta (meta NULL: not copied, whatever its
 * length) and its length to *meta_bytes (meta_bytes may be NULL). Errors name the file and
 * what is wrong: TM_ERR_IO (unreadable, not a regular file, not a checkpoint, truncated, CRC
 * mismatch, corrupt), TM_ERR_INVALID_ARG (path NULL or empty, unsupported version, unknown /
 * duplicate / missing tensor, dtype or shape mismatch, meta larger than meta_cap),
 * TM_ERR_UNSUPPORTED (foreign endianness; a big-endian host), TM_ERR_NOMEM, TM_ERR_CUDA (a
 * device copy failed; the only error after which ctx may be partly loaded). */
TM_API tm_status tm_ckpt_load(tm_ctx *ctx, const char *path, void *meta, size_t meta_cap, size_t *meta_bytes);

/* Flags of tm_ckpt_load_flags. TM_CKPT_SKIP_UNKNOWN: tensors of the file that the context does
 * not hold are skipped instead of being an error; use it to load a training checkpoint (with
 * optimizer state) into a model built for inference. In a version 2 file their bytes are not
 * read at all (the index gives each tensor's offset; their index entries are validated with
 * the index's CRC); in a version 1 file, which has no index, they are read and validated. Every
 * tensor of the context must still be in the file, and every byte read is validated before the
 * first tensor is written. */
enum { TM_CKPT_SKIP_UNKNOWN = 1u };
/* tm_ckpt_load with flags (0: exactly tm_ckpt_load). Same errors, plus TM_ERR_INVALID_ARG for
 * an unknown flag bit. */
TM_API tm_status tm_ckpt_load_flags(tm_ctx *ctx, const char *path, unsigned flags, void *meta, size_t meta_cap,
                             size_t *meta_bytes);

/* What a checkpoint holds, without loading it: tm_ckpt_inspect validates the whole file as
 * tm_ckpt_load does (structure, every CRC, every tensor inflates to its length) and lists it.
 * ctx is used for the allocator and the error message only (its tensors are not looked at). */
typedef struct tm_ckpt_entry {
    const char *name; /* valid until tm_ckpt_info_free */
    tm_dtype dtype;
    int ndim;
    int64_t shape[TM_MAX_DIMS];
    uint64_t raw_bytes;    /* numel * dtype size */
    uint64_t stored_bytes; /* in the file: raw_bytes, or the zlib stream's length */
    uint64_t offset;       /* of the stored bytes, from the file's start */
    int compressed;        /* 1: a zlib stream; 0: raw bytes (version 1 files: always 1) */
} tm_ckpt_entry;

typedef struct tm_ckpt_info {
    uint32_t version;        /* format version */
    uint64_t file_bytes;     /* size of the file */
    int num_entries;         /* tensors, in file order */
    const tm_ckpt_entry *entries;
    const void *meta;        /* the meta blob (not NUL-terminated; meta_bytes long) */
    size_t meta_bytes;
} tm_ckpt_info;

/* Errors: as tm_ckpt_load for the file checks (TM_ERR_IO, TM_ERR_INVALID_ARG for an
 * unsupported version, TM_ERR_UNSUPPORTED), TM_ERR_INVALID_ARG (out NULL, path NULL or empty),
 * TM_ERR_NOMEM. *out is NULL after a failure (out given). On success free *out with
 * tm_ckpt_info_free. The info is one block from malloc (not the context's allocator: it may
 * outlive ctx). */
TM_API tm_status tm_ckpt_inspect(tm_ctx *ctx, const char *path, tm_ckpt_info **out);
/* Flags of tm_ckpt_inspect_flags. TM_CKPT_INDEX_ONLY: validate and list the header, meta and
 * index (their CRCs; the index must tile the file's data exactly) without reading the tensors'
 * bytes, so it costs a few reads whatever the file's size (version 1 files, without an index,
 * are still read whole). What a later tm_ckpt_load reads it validates itself. */
enum { TM_CKPT_INDEX_ONLY = 1u };
/* tm_ckpt_inspect with flags (0: exactly tm_ckpt_inspect). Same errors, plus
 * TM_ERR_INVALID_ARG for an unknown flag bit. */
TM_API tm_status tm_ckpt_inspect_flags(tm_ctx *ctx, const char *path, unsigned flags, tm_ckpt_info **out);
/* NULL: no-op. */
TM_API void tm_ckpt_info_free(tm_ckpt_info *info);

/* Reading a checkpoint one tensor at a time, into the caller's memory, without a context that
 * holds its tensors (conversions: `tinymoe export` streams the weights into a safetensors file
 * this way). Open validates what tm_ckpt_inspect_flags(TM_CKPT_INDEX_ONLY) validates (a
 * version-1 file, which has no index, is read and checked whole here) and keeps the file open,
 * so a later save's rename cannot swap it; each read checks the entry's CRC (and that a
 * compressed entry inflates to its length) as tm_ckpt_load does, reading only that entry's
 * stored bytes (version 2), in 8 MiB pieces on the context's threads.
 *
 *     tm_ckpt_reader *r;
 *     tm_ckpt_reader_open(ctx, path, &r);
 *     const tm_ckpt_info *info = tm_ckpt_reader_info(r);   entries and meta, as inspect lists them
 *     tm_ckpt_reader_read(r, tm_ckpt_reader_find(r, "embed.weight"), buf, bytes);
 *     tm_ckpt_reader_close(r);
 *
 * Calls on the reader are calls on ctx (its thread); ctx must outlive the reader. */
typedef struct tm_ckpt_reader tm_ckpt_reader;
/* Errors: as tm_ckpt_inspect_flags with TM_CKPT_INDEX_ONLY (TM_ERR_IO, TM_ERR_INVALID_ARG for an
 * unsupported version, out NULL or path NULL / empty / too long, TM_ERR_UNSUPPORTED,
 * TM_ERR_NOMEM). *out is NULL after a failure. */
TM_API tm_status tm_ckpt_reader_open(tm_ctx *ctx, const char *path, tm_ckpt_reader **out);
/* The file's entries (file order) and meta; owned by the reader (valid until close). */
TM_API const tm_ckpt_info *tm_ckpt_reader_info(const tm_ckpt_reader *r);
/* The index of the entry named `name`, or -1 (also for NULL arguments). */
TM_API int tm_ckpt_reader_find(const tm_ckpt_reader *r, const char *name);
/* Entry `entry`'s raw bytes (numel x dtype size, row-major, the logical tensor) into dst, which
 * holds dst_bytes = the entry's raw_bytes. Errors (the message in the reader's context):
 * TM_ERR_INVALID_ARG (r NULL, entry out of range, dst NULL, dst_bytes not the entry's size),
 * TM_ERR_IO (a read fails, the data's CRC does not match, a zlib stream does not inflate to
 * exactly its length: the message names the file and the tensor; dst then holds garbage),
 * TM_ERR_NOMEM (a compressed entry's stored bytes). */
TM_API tm_status tm_ckpt_reader_read(tm_ckpt_reader *r, int entry, void *dst, uint64_t dst_bytes);
/* Close the file, free the reader. NULL: no-op. */
TM_API void tm_ckpt_reader_close(tm_ckpt_reader *r);

/* ------------------------------------------------------------------------------------------ */
/* Optimizers                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* AdamW: Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (ICLR 2019), Alg. 2,
 * with bias correction as in Kingma & Ba (2015). For every parameter p with gradient g, at
 * step t = 1, 2, ...:
 *   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
 *   p -= lr * ( (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * p )
 * State m, v is f32 (one buffer each per parameter, named "<param>.adamw_m" / ".adamw_v"); the
 * step count t is an i64 scalar host buffer "optim.adamw.steps". Being context buffers, all of
 * it is written by tm_ckpt_save and restored by tm_ckpt_load, so a reloaded optimizer continues
 * exactly. */
typedef struct tm_adamw_config {
    double lr;           /* default 1e-3 */
    double beta1, beta2; /* default 0.9, 0.999 */
    double eps;          /* default 1e-8 */
    double weight_decay; /* default 0.0; applied to parameters of 2 or more dims only */
} tm_adamw_config;

TM_API tm_adamw_config tm_adamw_config_default(void);

typedef struct tm_optimizer tm_optimizer;

/* An AdamW optimizer over every parameter the context holds when it is called. cfg NULL:
 * tm_adamw_config_default(). Errors: TM_ERR_INVALID_ARG (out NULL; lr < 0, betas outside
 * [0, 1), eps <= 0, weight_decay < 0, or any of them NaN, lr / eps / weight_decay infinite,
 * naming the field; a state name over 127 bytes), TM_ERR_STATE (no parameters, or the state
 * buffers exist already: one AdamW per context), TM_ERR_NOMEM, TM_ERR_CUDA (zeroing the state
 * of CUDA parameters). */
TM_API tm_status tm_adamw_new(tm_ctx *ctx, const tm_adamw_config *cfg, tm_optimizer **out);
/* One update from the gradients currently accumulated. lr < 0: the configured lr (pass the
 * scheduled value otherwise). Does not zero the gradients (tm_ctx_zero_grad). AdamW updates all
 * the buckets of a device in one op (one CUDA launch). Under ZeRO-1
 * (after tm_comm_sync_grads) each rank updates its block of every bucket, whose state (and
 * master weights) it alone keeps, then the parameters are all-gathered: a collective.
 * Runs on the parameters' devices (CPU and CUDA; bf16 buckets update their f32 master weights).
 * Errors: TM_ERR_INVALID_ARG (lr NaN or +inf; -inf is < 0, the configured lr),
 * TM_ERR_UNSUPPORTED (a device without the update kernel; nothing is changed), TM_ERR_CUDA. */
TM_API tm_status tm_optimizer_step(tm_optimizer *opt, double lr);
/* tm_optimizer_step on the gradients multiplied by grad_scale, the factor that
 * tm_ctx_clip_grad_norm_deferred handed back (NULL: exactly tm_optimizer_step). The result
 * (parameters, master weights, moments) is bit for bit that of tm_ctx_clip_grad_norm followed
 * by tm_optimizer_step: each gradient is scaled as tm_grad_scale stores it (the product
 * rounded to the gradient's dtype) before the update uses it. AdamW does it inside its update
 * kernel, reading the factor on the device: the gradients are read once and never written, and
 * nothing waits for the host. SGD scales the gradients in place first (one pass, as the clip
 * would have). The gradients are left unscaled by AdamW and scaled by SGD: read them before the
 * step if you need them, and zero them after it (tm_ctx_zero_grad) as usual.
 * Errors: those of tm_optimizer_step; TM_ERR_INVALID_ARG (grad_scale not a 0-d f32 tensor on
 * CUDA / f64 on the CPU), TM_ERR_DEVICE (a bucket on another device than grad_scale; nothing
 * is changed). */
TM_API tm_status tm_optimizer_step_scaled(tm_optimizer *opt, double lr, tm_tensor *grad_scale);
/* Number of steps taken. */
TM_API int64_t tm_optimizer_steps(const tm_optimizer *opt);
/* Free the optimizer (its state buffers stay with the context until tm_ctx_free). NULL: no-op. */
TM_API void tm_optimizer_free(tm_optimizer *opt);

/* SGD with momentum (Sutskever et al. 2013; PyTorch torch.optim.SGD semantics, dampening 0):
 *   g' = g + weight_decay * p                      (L2 decay, 2-or-more-dim parameters only)
 *   b  = momentum * b + g'        (b = g' at the first step)
 *   p -= lr * (nesterov ? g' + momentum * b : b)
 * momentum 0: plain SGD (no state). State b is f32, buffers "<param>.sgd_b"; the step count is
 * the i64 host buffer "optim.sgd.steps". */
typedef struct tm_sgd_config {
    double lr;           /* default 1e-2 */
    double momentum;     /* default 0.9; in [0, 1) */
    int nesterov;        /* default 0; needs momentum > 0 */
    double weight_decay; /* default 0 */
} tm_sgd_config;

TM_API tm_sgd_config tm_sgd_config_default(void);
/* Same contract as tm_adamw_new; use tm_optimizer_step / _steps / _free with it. Its
 * TM_ERR_INVALID_ARG fields: lr < 0 or not finite, momentum outside [0, 1) or NaN, nesterov
 * not 0 or 1, nesterov with momentum 0, weight_decay < 0 or not finite. */
TM_API tm_status tm_sgd_new(tm_ctx *ctx, const tm_sgd_config *cfg, tm_optimizer **out);

/* Learning-rate schedules. step counts optimizer steps from 0. With W = warmup_steps,
 * S = total_steps, lr_max = lr, lr_min = min_lr:
 *   warmup (all but constant): lr_max * (step + 1) / W for step < W
 *   constant: lr_max
 *   cosine  : lr_min + (lr_max - lr_min) * (1 + cos(pi * p)) / 2, p = (step - W) / (S - W)
 *             (Loshchilov & Hutter 2017, SGDR, without restarts)
 *   linear  : lr_max + (lr_min - lr_max) * p
 *   wsd     : warmup-stable-decay (Hu et al. 2024, MiniCPM): lr_max until the last
 *             decay_fraction * S steps, then linear to lr_min over them
 * p is clamped to [0, 1], so steps past S stay at lr_min. */
typedef enum tm_lr_kind { TM_LR_CONSTANT = 0, TM_LR_COSINE = 1, TM_LR_LINEAR = 2, TM_LR_WSD = 3 } tm_lr_kind;

typedef struct tm_lr_schedule {
    tm_lr_kind kind;
    double lr, min_lr;
    int64_t warmup_steps, total_steps;
    double decay_fraction; /* wsd only, in (0, 1]; default 0.2 */
} tm_lr_schedule;

/* Learning rate at `step`; NaN when step < 0 or the schedule is invalid (see
 * tm_lr_schedule_check). */
TM_API double tm_lr_at(const tm_lr_schedule *s, int64_t step);
/* ctx may be NULL (no message). Errors: TM_ERR_INVALID_ARG (message names the field): s NULL,
 * bad kind, lr < 0 or not finite, warmup_steps < 0; for decaying kinds min_lr outside [0, lr],
 * total_steps < warmup_steps; for wsd decay_fraction outside (0, 1]. */
TM_API tm_status tm_lr_schedule_check(tm_ctx *ctx, const tm_lr_schedule *s);

/* The update ops that tm_optimizer_step and tm_ctx_clip_grad_norm are built from, for
 * programs that write their own training step. Each writes its first input in place, is
 * never recorded on the tape, and runs on the tensors' device (CPU or CUDA). Inputs are
 * contiguous ranges of equal element counts: one parameter, or a bucket range of parameters
 * with the matching range of gradients, f32 state and f32 master (tm_ctx_bucket_tensor + slice).
 * Errors: TM_ERR_INVALID_ARG (NULL, a non-contiguous input, step < 1, lr / weight_decay /
 * scale not finite), TM_ERR_SHAPE (element counts differ), TM_ERR_DTYPE (param not float;
 * grad of another dtype; m, v, b, master not f32), TM_ERR_DEVICE, TM_ERR_UNSUPPORTED (no kernel
 * for the device). */

/* AdamW as tm_adamw_new documents, at step `step` (1-based; the bias corrections use it), with
 * the given lr and weight decay (pass 0 for gains and biases). m, v: f32. master: the f32
 * master copy of a bf16 param, or NULL: then the update reads and writes master and stores
 * param = master rounded to bf16; without one a bf16 param is read, updated in f32, rounded. */
TM_API tm_status tm_adamw_update(tm_ctx *ctx, tm_tensor *param, tm_tensor *grad, tm_tensor *m, tm_tensor *v,
                          tm_tensor *master, const tm_adamw_config *cfg, double lr, double weight_decay, int64_t step);
/* SGD as tm_sgd_new documents (cfg's momentum and nesterov; lr and weight_decay given). b: the
 * f32 momentum buffer (NULL allowed only with momentum 0); master as for AdamW. */
TM_API tm_status tm_sgd_update(tm_ctx *ctx, tm_tensor *param, tm_tensor *grad, tm_tensor *b, tm_tensor *master,
                        const tm_sgd_config *cfg, double lr, double weight_decay);
/* out: 0-d on grad's device = sum_i grad[i]^2, accumulated in f64 in a fixed order that
 * depends on the element count only (bitwise the same at any thread count and run to run).
 * The output is f64 on the CPU; on CUDA, where f64 tensors cannot live, it is f32 (the f64 sum
 * rounded once). Nothing is read back to the host. */
TM_API tm_status tm_grad_sumsq(tm_ctx *ctx, tm_tensor *grad, tm_tensor **out);
/* grad *= scale (in the gradient's dtype; scale rounded to f32 for f32 and bf16). */
TM_API tm_status tm_grad_scale(tm_ctx *ctx, tm_tensor *grad, double scale);

/* Global L2 norm of all parameter gradients (accumulated in f64): sqrt(sum_p sum_i g_i^2),
 * the tm_grad_sumsq of each bucket summed in bucket order, then every bucket scaled as
 * tm_grad_scale does. With max_norm > 0, gradients are then scaled by max_norm / (norm + 1e-6)
 * when norm > max_norm (torch.nn.utils.clip_grad_norm_). *norm_out (may be NULL) gets the norm
 * before clipping (CUDA partials are f32-rounded, see tm_grad_sumsq).
 * Synchronisations: with every bucket on one device and no communicator, the norm and the scale
 * factor are computed on the device (on CUDA: two kernel launches for all buckets, no host read
 * between them), and the per-bucket partial sums are read back once, only when norm_out is not
 * NULL (NULL: no synchronisation). Otherwise (buckets on the CPU and a GPU, or a communicator)
 * the partials of a device's buckets are read back together, one synchronisation per device
 * holding parameters, and the host decides the scaling. Errors: TM_ERR_INVALID_ARG (max_norm
 * NaN), TM_ERR_UNSUPPORTED (a device without the kernels; nothing is changed), TM_ERR_CUDA. */
TM_API tm_status tm_ctx_clip_grad_norm(tm_ctx *ctx, double max_norm, double *norm_out);
/* The clip of tm_ctx_clip_grad_norm with its scaling left to the optimizer: the same norm
 * (*norm_out, may be NULL) and the same factor, but when every bucket is on one device and
 * there is no communicator the gradients are NOT scaled: *grad_scale gets the factor as a 0-d
 * tensor on that device (f32 on CUDA, f64 on the CPU; exactly 1 when not clipping), computed
 * there and never read back, valid until the next tm_ctx_arena_reset. Pass it to
 * tm_optimizer_step_scaled, which applies it while it reads the gradients: the pair gives the
 * bits of tm_ctx_clip_grad_norm + tm_optimizer_step, with one pass over the gradients fewer
 * (the scale's read and write) and no host read in between. Under a communicator with every
 * bucket on one device, the host computes the factor from the world's norm and *grad_scale
 * gets it the same way when clipping (NULL when the norm is within max_norm); the gradients
 * are not scaled either. Otherwise (buckets on several devices) the gradients are scaled here
 * as tm_ctx_clip_grad_norm does and *grad_scale is NULL (nothing left to apply; the step's
 * NULL is tm_optimizer_step). Synchronisations: as tm_ctx_clip_grad_norm. Errors: those of
 * tm_ctx_clip_grad_norm; TM_ERR_INVALID_ARG (grad_scale NULL). */
TM_API tm_status tm_ctx_clip_grad_norm_deferred(tm_ctx *ctx, double max_norm, double *norm_out, tm_tensor **grad_scale);

/* ------------------------------------------------------------------------------------------ */
/* Distributed                                                                                 */
/* ------------------------------------------------------------------------------------------ */
/* One process per rank (`mpirun -np N`), one context per process. A communicator attached to
 * the context (tm_comm_init) describes the layout; without one, or in a build without MPI
 * (MPI=0), every function below behaves as a world of one rank.
 *
 * Groups, for a world of N ranks and ep_size P (P divides N; Megatron-LM's order, EP inner):
 *   TM_COMM_WORLD      every rank.
 *   TM_COMM_DP         every rank: the data-parallel group of the dense parameters (attention,
 *                      norms, router, embeddings, shared experts). Each rank reads its own slice
 *                      of the global batch.
 *   TM_COMM_EP         world ranks [g P, (g + 1) P), g = rank / P: they split the routed experts
 *                      contiguously, ep rank r holding experts [r E / P, (r + 1) E / P).
 *   TM_COMM_EXPERT_DP  world ranks {rank % P + j P : j < N / P}: the ranks that hold the same
 *                      experts; expert gradients are summed over it.
 * Rank r of a group is the r-th of its members in world order.
 *
 * Data-parallel semantics (tm_model_forward, tm_moe_forward under a dp group of more than one
 * rank): each rank's loss tensors are its *share* of the global batch's: the cross-entropy,
 * z-loss and sequence aux loss are scaled by (this rank's tokens / all ranks' tokens), the
 * switch aux loss uses the global tokens_per_expert and the global T (TransformerEngine's and
 * Megatron-LM's rule for expert parallelism), so the shares sum to the loss of the global batch
 * and tm_backward on every rank followed by tm_comm_sync_grads gives its gradient. Host values
 * (tm_model_out: loss_value, tokens_per_expert, dropped_tokens, ...) are the global ones on
 * every rank. Capacity dropping (capacity_factor > 0) decides over the global batch (the ranks'
 * router outputs are all-gathered), so every layout drops the tokens the single-process run
 * drops. Positions with an ignored target (-1) weigh as the others in a rank's share.
 *
 * Determinism: every collective runs a fixed algorithm for a given layout and message size, so
 * a run repeats bit for bit; different layouts sum in different orders (results agree to
 * rounding). Sources: Megatron-LM (parallel_state.py groups, distributed optimizer), PyTorch
 * DDP (bucketed gradient all-reduce), ZeRO (Rajbhandari et al. 2020, stages 1 to 3), PyTorch
 * FSDP (Zhao et al. 2023: parameters all-gathered around each unit's forward and backward). */

typedef enum tm_comm_group {
    TM_COMM_WORLD = 0,
    TM_COMM_DP = 1,
    TM_COMM_EP = 2,
    TM_COMM_EXPERT_DP = 3,
    TM_COMM_NGROUPS = 4
} tm_comm_group;

/* Expert-parallel dispatch (layers/moe.c; docs/layouts.md, "Expert dispatch"):
 * ALLTOALL (default; TE's MoE block, Megatron's MoEAlltoAllTokenDispatcher): one row per
 * (token, expert) pair goes to the rank owning the expert by a ragged all-to-all (the counts
 * exchanged on the device), is regrouped expert-major, runs through the local experts and comes
 * back the same way; the combine weights stay on the source rank. One host read per MoE layer
 * forward (the counts that NCCL's send/recv and the grouped GEMMs take on the host), as one
 * process makes.
 * ALLGATHER (MaxText's "ring of experts"): tokens and router outputs are all-gathered over ep,
 * each rank runs only its experts on all of them, the outputs are reduce-scattered.
 * ALLTOALL_DEDUP (DeepEP's dispatch / combine): one row per (token, rank) pair, with the
 * token's weights and routing over that rank's experts; the rank combines its experts' outputs
 * into one partial row per token and sends it back, where the partials are summed. A token
 * moves min(topk, P)-or-fewer times instead of topk times (2 rows instead of 6 for top-6 on 2
 * ranks), at the price of two more host reads per MoE layer forward (the rows per rank, and
 * the counts received) and the weighted sum split by rank (equal to one process to rounding).
 * It pays where topk is large against ep_size; measured in docs/PERFORMANCE.md. */
typedef enum tm_ep_strategy { TM_EP_ALLTOALL = 0, TM_EP_ALLGATHER = 1, TM_EP_ALLTOALL_DEDUP = 2 } tm_ep_strategy;
/* "alltoall", "allgather", "alltoall_dedup"; "?" for other values. */
TM_API const char *tm_ep_strategy_name(tm_ep_strategy s);

typedef struct tm_comm_options {
    int ep_size;                /* P >= 1, divides the world size; default 1 */
    tm_ep_strategy ep_strategy; /* default TM_EP_ALLTOALL */
    int zero;                   /* ZeRO stage (Rajbhandari et al. 2020): 0 (default); 1: optimizer
                                 * state and f32 master weights sharded over each bucket's
                                 * data-parallel group; 2: the gradients too: tm_comm_sync_grads
                                 * reduce-scatters each bucket into this rank's block and gives
                                 * the full gradient buffer back (the next backward makes it
                                 * again, zeroed); 3 (FSDP): the parameters too, from when the
                                 * optimizer is made: each rank keeps its block of every bucket,
                                 * the model all-gathers each layer's weights for its forward and
                                 * again for its backward (but those of zero3_keep_last's last
                                 * layers, kept in between), and their backward reduces the
                                 * gradients straight into the shards (no full gradient buffer,
                                 * tm_comm_sync_grads has nothing left to do). A parameter is then
                                 * readable only through checkpoints (tm_tensor_read / _write and
                                 * ops refuse it with TM_ERR_STATE); tm_ctx_bucket_tensor's
                                 * parameter view holds this rank's block */
    double timeout_s;           /* a collective still waiting after this many seconds fails with
                                 * TM_ERR_COMM (a rank died or stopped answering); <= 0: wait
                                 * forever; default 60 */
    const void *mpi_comm;       /* NULL: MPI_COMM_WORLD (or one rank when MPI is not initialised);
                                 * else a pointer to the MPI_Comm to use as the world (duplicated) */
    int nccl;                   /* the engine of CUDA tensors' collectives: TM_NCCL_AUTO (0): NCCL
                                 * when every rank of several has its own GPU, else host-staged MPI
                                 * (one rank: copies); TM_NCCL_OFF: host-staged MPI even where NCCL
                                 * could serve; TM_NCCL_ALWAYS: NCCL also for one rank (a check of
                                 * that engine on one GPU). Builds without NCCL: ignored */
    int overlap;                /* 1 (default): where the engine runs on a device stream (NCCL),
                                 * ZeRO-3's all-gathers are started ahead of their use (the next
                                 * layer's during this one's forward; in the backward the weights
                                 * of the layers about to be reached) and its gradient
                                 * reduce-scatters run while the backward goes on, on a second
                                 * stream beside the work (PyTorch FSDP's prefetch and
                                 * asynchronous reduce-scatter), and so do the all-to-alls of
                                 * MoE layers with overlap_chunks > 1 (tm_moe_config); 0: each
                                 * collective in place, on the work stream, when its result is
                                 * needed (the same values) */
    int comm_sms;               /* with overlap on NCCL: streaming multiprocessors left to the
                                 * collectives beside the work. Their communicators run at most
                                 * this many CTAs (ncclConfig_t.maxCTAs), and the persistent
                                 * Hopper grouped GEMM launches num_sms - comm_sms CTAs when a
                                 * collective beside the work has not finished as it is launched
                                 * (all num_sms otherwise: most of a step has none). Why: a
                                 * kernel with a CTA per SM and a static tile schedule waits for
                                 * every SM a collective holds, so the CTAs placed there start
                                 * late and its tail grows by their whole share (DeepGEMM and
                                 * DeepEP split the SMs the same way). 0: no reservation (NCCL
                                 * picks its CTAs; the kernel takes every SM). Values are
                                 * unchanged: the grouped GEMM's sums do not depend on its grid.
                                 * (cuBLASLt is left to its heuristic: an SM count target there
                                 * changed its algorithms, and so the f32 rounding, against one
                                 * GPU.) Default 16; must be in [0, 64] */
    int plan_world_size;        /* plan-only contexts (tm_ctx_options.plan_only) only: the world to
                                 * lay out, >= 1 (0: one rank); no MPI is touched, the engine is
                                 * "plan" (collectives move nothing and are counted in
                                 * tm_comm_get_stats as a real engine's are) */
    int plan_rank;              /* the rank laid out, in [0, plan_world_size) */
    int zero3_keep_last;        /* ZeRO-3 only: how many of the model's last layers keep their
                                 * all-gathered weights from their forward to their backward (and
                                 * with them, from 1 on, the final norm and the lm_head, the last
                                 * weights the forward gathers); a layer's weights are its
                                 * attention norm, its own and its MoE block's. The backward starts
                                 * with these, so tm_model_forward does not give them back and the
                                 * backward does not gather them again: one all-gather per kept
                                 * unit and micro-batch fewer, and no wait for them as the
                                 * backward starts (PyTorch FSDP2's reshard_after_forward = False,
                                 * which torchtitan sets for the last block: "FSDP would prefetch
                                 * it immediately"). Values are the same bits whatever it is (the
                                 * same gathers, not repeated). Memory: their gathered bytes (the
                                 * compute dtype: bf16 for a bf16 model) stay held through the rest
                                 * of the forward, the loss and the backward until each weight's
                                 * own backward is done, so the most gathered at once
                                 * (TM_MEM_PARAMETERS' peak, tm_step_plan.transient) is at least
                                 * their sum. Only training forwards (grad mode on) keep anything;
                                 * the embedding's gather (used first, its backward last) never.
                                 * Counted in layers, >= 0; more than n_layers keeps every layer;
                                 * 0: every weight given back after its forward use (gathered
                                 * again for the backward). Default 1 */
    int64_t grad_sync_chunk_bytes; /* tm_comm_sync_grads_in_backward: the size of the pieces in
                                 * which an armed backward all-reduces the gradients, bytes of the
                                 * gradient dtype (PyTorch DDP's bucket_cap_mb, Megatron-LM's
                                 * bucket_size): smaller starts the first all-reduces sooner and
                                 * leaves less to run after the backward, larger runs each one
                                 * nearer the link's bandwidth. >= 0; 0: the default, 32 MiB */
} tm_comm_options;

enum { TM_NCCL_AUTO = 0, TM_NCCL_OFF = 1, TM_NCCL_ALWAYS = 2 };

/* ep_size 1, alltoall, zero 0, timeout 60 s, MPI_COMM_WORLD, NCCL auto, overlap on, comm_sms 16,
 * zero3_keep_last 1, grad_sync_chunk_bytes 32 MiB. */
TM_API tm_comm_options tm_comm_options_default(void);

/* MPI is process-wide state, so these three are the only functions of tinymoe that touch the
 * process rather than a context. tm_mpi_init initialises MPI (MPI_Init_thread, funneled) when
 * the build has MPI and the process was started by an MPI launcher (mpirun: OMPI_COMM_WORLD_SIZE,
 * PMI_SIZE or PMIX_RANK in the environment) and MPI is not initialised yet; otherwise it does
 * nothing. *world_size (may be NULL) receives the launcher's world size (1 otherwise). A
 * program that initialises MPI itself need not call it. Errors: TM_ERR_COMM (MPI_Init failed),
 * TM_ERR_UNSUPPORTED (a build without MPI started by a launcher as one of several ranks).
 * tm_mpi_finalize: MPI_Finalize if tm_mpi_init initialised MPI (free every context first).
 * tm_mpi_abort: MPI_Abort(MPI_COMM_WORLD, code) under an initialised MPI (every rank of the job
 * is killed: what a program does after a TM_ERR_COMM), otherwise nothing (returns). */
TM_API tm_status tm_mpi_init(int *argc, char ***argv, int *world_size);
TM_API void tm_mpi_finalize(void);
TM_API void tm_mpi_abort(int code);
/* 1 when this build has MPI (MPI=1). */
TM_API int tm_mpi_available(void);
/* This process's rank in MPI_COMM_WORLD and its size under an initialised MPI; 0 and 1
 * otherwise. */
TM_API int tm_mpi_world_rank(void);
TM_API int tm_mpi_world_size(void);

/* Attach a communicator to ctx (one per context; collective: every rank of the world calls it
 * with the same options). The world is opts->mpi_comm or MPI_COMM_WORLD under an initialised
 * MPI, else one rank; in a plan-only context, plan_world_size ranks of which this is plan_rank
 * (nothing collective happens). Call it before creating parameters: tm_moe_new sizes its expert weights
 * by the layout. Errors: TM_ERR_INVALID_ARG (ep_size < 1 or not dividing the world size, zero
 * not 0 to 3, ep_strategy not a tm_ep_strategy, timeout NaN, zero3_keep_last < 0, nccl not one of TM_NCCL_*,
 * plan_world_size < 0, or > 0 outside a plan-only context, plan_rank outside the world), TM_ERR_STATE (ctx has a
 * communicator already, or parameters), TM_ERR_COMM (an MPI call failed). */
TM_API tm_status tm_comm_init(tm_ctx *ctx, const tm_comm_options *opts);
/* This process's rank in group g and the group's size: 0 and 1 without a communicator (or for
 * a bad g / NULL ctx). */
TM_API int tm_comm_rank(const tm_ctx *ctx, tm_comm_group g);
TM_API int tm_comm_size(const tm_ctx *ctx, tm_comm_group g);
/* The options of the attached communicator (tm_comm_options_default() with ep_size 1 when none);
 * mpi_comm is NULL in the copy. */
TM_API tm_comm_options tm_comm_get_options(const tm_ctx *ctx);
/* Which engine moves tensors of device dev: "self" (one rank), "mpi" (CPU tensors),
 * "mpi-staged" (CUDA tensors through host buffers), "nccl" (CUDA tensors). */
TM_API const char *tm_comm_engine(const tm_ctx *ctx, tm_device dev);

/* Collectives as ops: every rank of group g calls them in the same order (they are recorded on
 * the tape whenever grad mode is on and the input is float, whether or not the input requires
 * a gradient, and their backward runs on every rank in tape order, so no rank waits for a
 * collective another skipped). Sums are in the input's dtype (bf16 is summed in f32 on the
 * CPU); integer tensors are allowed (not differentiable). Inputs of any device of the context
 * (CPU tensors through MPI, CUDA tensors through NCCL or host staging); out on x's device.
 * Errors (beside those of every op): TM_ERR_INVALID_ARG (g not a group), TM_ERR_SHAPE (as
 * stated; the sizes are checked across the ranks too), TM_ERR_COMM (the collective failed or
 * timed out, naming it, the group and the bytes).
 *
 * allreduce: out = sum over the ranks of g of x (same shape everywhere). Backward: the upstream
 * gradients are all-reduced (the output is replicated, and the ranks' losses add up). */
TM_API tm_status tm_comm_allreduce(tm_ctx *ctx, tm_tensor *x, tm_comm_group g, tm_tensor **out);
/* allgather: out = the ranks' x concatenated along dim 0 in rank order; x [n_r, ...] with the
 * trailing dims equal on every rank (n_r may differ: MPI_Allgatherv). Backward: reduce-scatter
 * (rank r gets the sum over the ranks of the gradient of its rows). */
TM_API tm_status tm_comm_allgather(tm_ctx *ctx, tm_tensor *x, tm_comm_group g, tm_tensor **out);
/* reduce_scatter: x [G n, ...] on every rank (G = size of g) -> out [n, ...] = sum over the
 * ranks of rows [r n, (r + 1) n) of x, r this rank. Backward: all-gather. */
TM_API tm_status tm_comm_reduce_scatter(tm_ctx *ctx, tm_tensor *x, tm_comm_group g, tm_tensor **out);
/* alltoall (ragged, MPI_Alltoallv): x [R, ...] holds send_counts[j] rows for rank j of g, in
 * rank order; out [sum recv_counts, ...] holds recv_counts[j] rows from rank j, in rank order.
 * send_counts and recv_counts: i64 [G] CPU tensors (recv_counts[j] must equal rank j's
 * send_counts[this rank]). Backward: the reverse all-to-all. Errors: also TM_ERR_SHAPE (counts
 * not [G], negative, not summing to R; mismatched across ranks), TM_ERR_DTYPE (counts not i64),
 * TM_ERR_DEVICE (counts not on the CPU). */
TM_API tm_status tm_comm_alltoall(tm_ctx *ctx, tm_tensor *x, tm_tensor *send_counts, tm_tensor *recv_counts,
                                  tm_comm_group g, tm_tensor **out);

/* Host-memory collectives for drivers (not ops, not taped): in-place sum of n f64 or i64
 * values; all-gather of nbytes from every rank into out (size nbytes * G, rank order);
 * broadcast of nbytes from rank root; barrier. Errors: TM_ERR_INVALID_ARG (NULL, n < 0, dtype
 * not f64 / i64, root out of range), TM_ERR_COMM. */
TM_API tm_status tm_comm_allreduce_host(tm_ctx *ctx, tm_comm_group g, tm_dtype dt, void *buf, int64_t n);
TM_API tm_status tm_comm_allgather_host(tm_ctx *ctx, tm_comm_group g, const void *in, void *out, size_t nbytes);
TM_API tm_status tm_comm_bcast_host(tm_ctx *ctx, tm_comm_group g, int root, void *buf, size_t nbytes);
TM_API tm_status tm_comm_barrier(tm_ctx *ctx, tm_comm_group g);

/* Gradient synchronisation, once per optimizer step after the last backward: every bucket's
 * gradients summed over its group (dense buckets: dp; expert buckets: expert_dp), one
 * collective per bucket: an all-reduce, or with zero = 1 a reduce-scatter after which this rank
 * holds the sums of its range [lo, hi) only (tm_ctx_grad_shard). With zero = 2 the reduce-scatter
 * writes into the bucket's gradient shard (a group of one rank copies) and the full gradient
 * buffer is given back: the parameters' gradients have no memory until the next backward.
 * tm_ctx_clip_grad_norm and tm_optimizer_step then work on what each rank holds (the norm is the
 * root of the ranks' sums of squares of their blocks, added over the world). No-op without a
 * communicator, or (zero 0 and 1) on groups of one rank. Errors: TM_ERR_COMM, TM_ERR_NOMEM,
 * TM_ERR_STATE (zero = 2 and no backward since the last synchronisation or tm_ctx_zero_grad).
 * With zero = 3 there is nothing to synchronise (the backward reduced into the shards). Buckets
 * that the last backward all-reduced (tm_comm_sync_grads_in_backward) are skipped; TM_ERR_STATE
 * too when that backward failed part way. */
TM_API tm_status tm_comm_sync_grads(tm_ctx *ctx);
/* Arm the next tm_backward (or tm_backward_with_grad) to run tm_comm_sync_grads' all-reduces
 * itself, as the gradients become final, beside the rest of the backward: PyTorch DDP's
 * overlapped bucketed all-reduce (Li et al. 2020, "PyTorch Distributed", section 3.2.3),
 * Megatron-LM's overlap_grad_reduce. Call it before the last backward of an optimizer step (with
 * gradient accumulation, the last micro-batch's: an earlier backward would be followed by more
 * gradient), then tm_comm_sync_grads as usual, which skips what the backward did and runs the
 * rest. What it covers: the buckets that tm_comm_sync_grads all-reduces, i.e. zero = 0 over
 * groups of two or more ranks (zero 1 and 2 reduce-scatter after the backward as before; zero 3
 * reduces during the backward anyway). How: the buckets are cut into pieces of
 * tm_comm_options.grad_sync_chunk_bytes; a piece's all-reduce starts once the backward has
 * run every node that writes a gradient in it, on the engine's second stream where it has one
 * (NCCL with tm_comm_options.overlap; the work stream waits for them at the end of the
 * backward), in place for host memory (CPU ranks, whose collectives block: the same values, no
 * overlap). Every rank starts the pieces in one order, that of the parameters' creation
 * (framework/grad_sync.c). Groups whose engine has no second stream for them (host-staged MPI
 * for CUDA memory) are left to tm_comm_sync_grads: a wait per piece would be slower than one
 * all-reduce after.
 * Values: each gradient is the same sum over the same ranks; an engine may reduce a piece in
 * another order than the whole bucket (3 or more ranks: the last bit can differ). Collective:
 * every rank of the world calls it at the same point (the first call makes the groups' second
 * communicators), with the same grad_sync_chunk_bytes and the same model, whose backward
 * reaches the parameters in the same order on every rank. tm_ctx_zero_grad and
 * tm_comm_sync_grads cancel an arming no backward used. A second backward between the armed one
 * and tm_comm_sync_grads would add local gradients to summed ones: tm_comm_sync_grads then
 * fails (TM_ERR_STATE) until tm_ctx_zero_grad. No-op without a communicator. Errors:
 * TM_ERR_INVALID_ARG (ctx NULL; grad_sync_chunk_bytes cutting the gradients into more than 4096
 * pieces), TM_ERR_STATE (the last armed backward failed part way, or was followed by another
 * backward: zero the gradients first), TM_ERR_COMM. */
TM_API tm_status tm_comm_sync_grads_in_backward(tm_ctx *ctx);
/* The element range [lo, hi) of bucket i that this rank owns under ZeRO-1 or 2 (the whole bucket
 * otherwise): the bucket's elements padded to a multiple of its group's size G, in G equal
 * blocks in group-rank order. Errors: TM_ERR_INVALID_ARG (NULL, i out of range). */
TM_API tm_status tm_ctx_grad_shard(const tm_ctx *ctx, int i, int64_t *lo, int64_t *hi);

/* Traffic of the collectives since the last reset, per kind: calls, bytes this rank sent
 * (all-reduce: the buffer; all-gather: its part; reduce-scatter: the input; all-to-all: the
 * rows sent) and host seconds spent in the calls: the whole transfer for the host engines (mpi,
 * mpi-staged); for nccl only the enqueueing, since NCCL collectives run on the context's stream
 * without the host waiting (their time shows in tm_ctx_sync_seconds, at the next wait). */
typedef enum tm_comm_kind {
    TM_COMM_ALLREDUCE = 0,
    TM_COMM_ALLGATHER,
    TM_COMM_REDUCE_SCATTER,
    TM_COMM_ALLTOALL,
    TM_COMM_OTHER, /* broadcasts, barriers */
    TM_COMM_NKINDS
} tm_comm_kind;
typedef struct tm_comm_stats {
    int64_t calls[TM_COMM_NKINDS];
    int64_t bytes[TM_COMM_NKINDS];
    double seconds[TM_COMM_NKINDS];
    /* Of calls, those that ran beside the work (tm_comm_options.overlap: ZeRO-3's gathers and
     * reduce-scatters, the chunked MoE layer's all-to-alls; on CPU ranks the same calls, whose
     * "side stream" is the host itself), and the times the work had to wait for such a
     * collective earlier than planned because memory it used was being given back (correct,
     * but that overlap was lost; 0 when the bookkeeping works as designed). */
    int64_t beside[TM_COMM_NKINDS];
    int64_t beside_early;
} tm_comm_stats;
/* Zeros without a communicator. Errors: TM_ERR_INVALID_ARG (out NULL). */
TM_API tm_status tm_comm_get_stats(const tm_ctx *ctx, tm_comm_stats *out);
TM_API void tm_comm_reset_stats(tm_ctx *ctx);
/* "allreduce", "allgather", ... ("?" out of range). */
TM_API const char *tm_comm_kind_name(tm_comm_kind k);


#ifdef __cplusplus
}
#endif
#endif /* TINYMOE_H */
