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
const char *tm_version(void);
int tm_version_number(void);

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
    TM_ERR_INTERNAL = 11    /* a bug in tinymoe: please report */
} tm_status;

/* A short constant description of a status code ("shape mismatch", ...). Never NULL. */
const char *tm_status_str(tm_status s);

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
const char *tm_dtype_name(tm_dtype dt);
size_t tm_dtype_size(tm_dtype dt);

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
} tm_ctx_options;

/* Defaults: no allocator hook, all threads, CPU only, 64 MiB chunks. */
tm_ctx_options tm_ctx_options_default(void);

/* Make a context. opts may be NULL (defaults). Errors: TM_ERR_INVALID_ARG (out NULL),
 * TM_ERR_NOMEM, TM_ERR_DEVICE (cuda_device >= 0 but CUDA absent from the build or no such
 * device; the message says which). On failure *out is NULL and, since no context exists to
 * hold a message, the reason is available from tm_last_create_error(). */
tm_status tm_ctx_new(tm_ctx **out, const tm_ctx_options *opts);

/* Message of the last failed tm_ctx_new in this thread (thread-local; "" if none). */
const char *tm_last_create_error(void);

/* Free the context and everything it owns (tensors, parameters, device memory). NULL: no-op. */
void tm_ctx_free(tm_ctx *ctx);

/* Message of the context's last failed call: names the op and its arguments ("" if nothing
 * failed yet; successful calls leave it unchanged, so read it right after a failure). The
 * pointer stays valid until the next call on the context. */
const char *tm_ctx_errmsg(const tm_ctx *ctx);

/* Number of CUDA devices visible (0 when the build has no CUDA or no driver/device). */
int tm_cuda_device_count(void);

/* Wait for all queued device work of the context to finish. Errors: TM_ERR_CUDA. */
tm_status tm_ctx_sync(tm_ctx *ctx);

/* Release every temporary tensor and the autograd tape (all arena tensor handles become
 * invalid). Memory is kept for the next step, so a steady-state training step performs no
 * system allocation. Parameters, gradients and buffers are untouched. Call it after the
 * optimizer step. */
void tm_ctx_arena_reset(tm_ctx *ctx);

/* Count of system allocations (host allocator calls and cudaMalloc) this context has made
 * since creation. A second identical training step leaves it unchanged. */
uint64_t tm_ctx_alloc_count(const tm_ctx *ctx);

/* Bytes of arena currently handed out on a device (0 after tm_ctx_arena_reset) and the
 * high-water mark since creation. */
size_t tm_ctx_arena_used(const tm_ctx *ctx, tm_device dev);
size_t tm_ctx_arena_peak(const tm_ctx *ctx, tm_device dev);

/* Enable (1) or disable (0) recording of the autograd tape; returns the previous setting.
 * With recording off (evaluation, sampling) ops produce tensors without grad history. */
int tm_ctx_set_grad_enabled(tm_ctx *ctx, int enabled);

/* ------------------------------------------------------------------------------------------ */
/* Tensors                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Temporary tensors (arena). shape has ndim entries, each >= 0, ndim in [0, TM_MAX_DIMS]
 * (ndim 0 = scalar). Errors: TM_ERR_INVALID_ARG (null, ndim, negative size), TM_ERR_DTYPE
 * (f64 on CUDA), TM_ERR_DEVICE, TM_ERR_NOMEM. */
tm_status tm_tensor_empty(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                          tm_tensor **out);
tm_status tm_tensor_zeros(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                          tm_tensor **out);
/* Copy numel elements of src_dt from host memory `src` into a new temporary of dtype dt
 * (converted; float->bf16 rounds to nearest even; float->int truncates). */
tm_status tm_tensor_from_host(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape,
                              tm_device dev, tm_dtype src_dt, const void *src, tm_tensor **out);

/* Persistent trainable parameter: allocated in the device's single contiguous parameter
 * buffer, with its gradient (zeroed) in the matching contiguous gradient buffer.
 * `name` (<= 127 bytes, unique in the context) keys the counter-based RNG and checkpoints.
 * Contents are zero until initialised (tm_tensor_init_normal / tm_tensor_write).
 * Errors: as tm_tensor_empty, plus TM_ERR_INVALID_ARG for a duplicate or over-long name. */
tm_status tm_param_new(tm_ctx *ctx, const char *name, tm_dtype dt, int ndim, const int64_t *shape,
                       tm_device dev, tm_tensor **out);
/* Persistent tensor without gradient (optimizer state, expert_bias, data). Zero-filled. */
tm_status tm_buffer_new(tm_ctx *ctx, const char *name, tm_dtype dt, int ndim,
                        const int64_t *shape, tm_device dev, tm_tensor **out);

/* Parameters in creation order: count, and the i-th (NULL when out of range). */
int tm_ctx_num_params(const tm_ctx *ctx);
tm_tensor *tm_ctx_param(const tm_ctx *ctx, int i);
/* Find a parameter or buffer by name; NULL if none. */
tm_tensor *tm_ctx_find(const tm_ctx *ctx, const char *name);

/* Set every parameter gradient to zero (one memset per device buffer). */
tm_status tm_ctx_zero_grad(tm_ctx *ctx);

/* Introspection. Functions taking a tensor return 0 / NULL for t == NULL. */
int tm_tensor_ndim(const tm_tensor *t);
int64_t tm_tensor_dim(const tm_tensor *t, int axis); /* negative axis from the end; -1 if invalid */
int64_t tm_tensor_numel(const tm_tensor *t);
tm_dtype tm_tensor_dtype(const tm_tensor *t);
tm_device tm_tensor_device(const tm_tensor *t);
const char *tm_tensor_name(const tm_tensor *t); /* "" for unnamed temporaries */
int tm_tensor_is_contiguous(const tm_tensor *t);
int tm_tensor_requires_grad(const tm_tensor *t);
/* Gradient accumulated by tm_backward, or NULL if none has been computed yet. */
tm_tensor *tm_tensor_grad(const tm_tensor *t);
/* Mark a temporary leaf tensor (one not produced by an op) as needing a gradient, so that
 * tm_backward computes tm_tensor_grad(t). Errors: TM_ERR_STATE on a non-leaf, TM_ERR_DTYPE
 * on a non-float tensor. */
tm_status tm_tensor_set_requires_grad(tm_ctx *ctx, tm_tensor *t, int requires_grad);

/* Copy the tensor's logical elements (any strides, any device) to host memory `dst`,
 * converted to dst_dt. count must equal numel. Errors: TM_ERR_INVALID_ARG, TM_ERR_CUDA. */
tm_status tm_tensor_read(tm_ctx *ctx, const tm_tensor *t, tm_dtype dst_dt, void *dst, int64_t count);
/* Overwrite a contiguous tensor's elements from host memory `src` of src_dt (count = numel).
 * Not recorded on the tape. */
tm_status tm_tensor_write(tm_ctx *ctx, tm_tensor *t, tm_dtype src_dt, const void *src, int64_t count);

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
void tm_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);
/* FNV-1a 64-bit hash of a NUL-terminated string (the RNG stream id of a tensor name). */
uint64_t tm_hash_name(const char *name);

/* Fill t with N(mean, std^2) (Box-Muller on two Philox outputs in f64, then converted) or
 * U[lo, hi) keyed by (seed, name, index). name NULL: the tensor's own name. Float dtypes only.
 * Errors: TM_ERR_DTYPE, TM_ERR_INVALID_ARG (std < 0, lo > hi, unnamed temporary and no name). */
tm_status tm_tensor_init_normal(tm_ctx *ctx, tm_tensor *t, uint64_t seed, const char *name,
                                double mean, double std);
tm_status tm_tensor_init_uniform(tm_ctx *ctx, tm_tensor *t, uint64_t seed, const char *name,
                                 double lo, double hi);
/* Fill with a constant (any dtype; value converted). Not recorded on the tape. */
tm_status tm_tensor_fill(tm_ctx *ctx, tm_tensor *t, double value);

/* ------------------------------------------------------------------------------------------ */
/* Autograd                                                                                    */
/* ------------------------------------------------------------------------------------------ */
/* Ops record themselves on the context's tape when grad mode is on and an input requires a
 * gradient. tm_backward walks the tape in reverse and ACCUMULATES into .grad of every tensor
 * that requires one (parameters: into the contiguous gradient buffer), so calling forward +
 * backward on several micro-batches before one optimizer step accumulates their gradients.
 * The tape recorded so far is consumed by the call (a second backward does not re-run it). */

/* loss: a one-element float tensor; its upstream gradient is 1.
 * Errors: TM_ERR_SHAPE (not one element), TM_ERR_STATE (loss does not require grad). */
tm_status tm_backward(tm_ctx *ctx, tm_tensor *loss);
/* Backward from any tensor with an explicit upstream gradient of the same shape. */
tm_status tm_backward_with_grad(tm_ctx *ctx, tm_tensor *out, tm_tensor *grad);

/* ------------------------------------------------------------------------------------------ */
/* Ops                                                                                         */
/* ------------------------------------------------------------------------------------------ */
/* Every op: inputs on one device; float ops accept f32, bf16 and f64 (CPU) alike and produce
 * the input dtype; results are temporaries. Each op is one row of the op table
 * (framework/op_table.c): its CPU kernel is in kernels/cpu/<op>.c, its CUDA kernel in
 * kernels/cuda/<op>.cu, its test in tests/test_<op>.c. */

/* C = op(A) @ op(B), op = transpose of the last two dims when trans_* is nonzero.
 * a: [..., M, K] (or [..., K, M] transposed), b: [K, N] or [..., K, N] with the same leading
 * dims as a (batched). out: [..., M, N]. Accumulation in f32 (f64 for f64).
 * Errors: TM_ERR_SHAPE (inner dims or batch dims differ), TM_ERR_DTYPE (mixed dtypes). */
tm_status tm_matmul(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, int trans_a, int trans_b, tm_tensor **out);

/* Elementwise a+b, a-b, a*b. Broadcasting over leading dims: the shape of one operand must
 * equal the trailing dims of the other's (e.g. [B,T,C] + [C]); out has the larger shape. */
tm_status tm_add(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, tm_tensor **out);
tm_status tm_sub(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, tm_tensor **out);
tm_status tm_mul(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, tm_tensor **out);
/* out = alpha * x. */
tm_status tm_scale(tm_ctx *ctx, tm_tensor *x, double alpha, tm_tensor **out);

/* Sum / mean over one axis (keepdim keeps it as size 1), or over all elements (*_all: a 0-d
 * scalar). Accumulation in f64 on the CPU, f32 on CUDA. */
tm_status tm_sum(tm_ctx *ctx, tm_tensor *x, int axis, int keepdim, tm_tensor **out);
tm_status tm_mean(tm_ctx *ctx, tm_tensor *x, int axis, int keepdim, tm_tensor **out);
tm_status tm_sum_all(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);
tm_status tm_mean_all(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);

/* Shape ops. reshape/view: a view when x is contiguous (one dim may be -1), a copy otherwise.
 * transpose/permute/slice: views (no copy). slice keeps [start, end) of `axis` (negative
 * start/end count from the end). concat: along axis, all other dims equal, n in [1, 8].
 * contiguous: a dense copy of a view (x itself if already dense). */
tm_status tm_reshape(tm_ctx *ctx, tm_tensor *x, int ndim, const int64_t *shape, tm_tensor **out);
tm_status tm_transpose(tm_ctx *ctx, tm_tensor *x, int axis0, int axis1, tm_tensor **out);
tm_status tm_permute(tm_ctx *ctx, tm_tensor *x, const int *perm, tm_tensor **out);
tm_status tm_slice(tm_ctx *ctx, tm_tensor *x, int axis, int64_t start, int64_t end, tm_tensor **out);
tm_status tm_concat(tm_ctx *ctx, int n, tm_tensor *const *xs, int axis, tm_tensor **out);
tm_status tm_contiguous(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);
/* Convert dtype (differentiable between float dtypes; gradient converted back). */
tm_status tm_cast(tm_ctx *ctx, tm_tensor *x, tm_dtype dt, tm_tensor **out);
/* Copy to another device (differentiable: the gradient is copied back). */
tm_status tm_to_device(tm_ctx *ctx, tm_tensor *x, tm_device dev, tm_tensor **out);

/* Embedding lookup: weight [V, C], ids (i32 or i64) of any shape S -> out [S..., C].
 * Backward scatter-adds rows into d weight. Errors: TM_ERR_INDEX naming the first id outside
 * [0, V) and its position. */
tm_status tm_embedding(tm_ctx *ctx, tm_tensor *weight, tm_tensor *ids, tm_tensor **out);
/* Row gather: x [N, C], idx [M] (i32/i64) -> out [M, C], out[m] = x[idx[m]]. */
tm_status tm_index_select(tm_ctx *ctx, tm_tensor *x, tm_tensor *idx, tm_tensor **out);
/* Gather along the last axis: x [N, C], idx [N, K] -> out [N, K], out[n,k] = x[n, idx[n,k]]. */
tm_status tm_gather(tm_ctx *ctx, tm_tensor *x, tm_tensor *idx, tm_tensor **out);
/* Row scatter-add: src [M, C], idx [M] -> out [n_rows, C] zero-initialised,
 * out[idx[m]] += src[m]. */
tm_status tm_scatter_add(tm_ctx *ctx, tm_tensor *src, tm_tensor *idx, int64_t n_rows, tm_tensor **out);

/* RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2 over last axis) + eps) * weight.
 * x [..., C], weight [C]. */
tm_status tm_rmsnorm(tm_ctx *ctx, tm_tensor *x, tm_tensor *weight, double eps, tm_tensor **out);
/* SiLU(x) = x * sigmoid(x) (Elfwing et al. 2018). */
tm_status tm_silu(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);
/* SwiGLU (Shazeer 2020), fused: out = silu(gate) * up; gate and up of the same shape. */
tm_status tm_swiglu(tm_ctx *ctx, tm_tensor *gate, tm_tensor *up, tm_tensor **out);
/* Softmax / log-softmax over the last axis (max-subtracted). */
tm_status tm_softmax(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);
tm_status tm_log_softmax(tm_ctx *ctx, tm_tensor *x, tm_tensor **out);
/* Fused cross-entropy: logits [N, V] float, targets [N] i32/i64. Rows whose target equals
 * ignore_index are skipped; out (0-d, f32 or the logits dtype) = mean over the valid rows of
 * (logsumexp(logits[n]) - logits[n, target[n]]); 0 when no row is valid.
 * Errors: TM_ERR_INDEX for a target outside [0, V) that is not ignore_index. */
tm_status tm_cross_entropy(tm_ctx *ctx, tm_tensor *logits, tm_tensor *targets, int64_t ignore_index,
                           tm_tensor **out);
/* Rotary position embedding, rotate-half convention (GPT-NeoX / Llama / Mixtral; Su et al.
 * 2021): x [B, T, H, D], D even; position of row t is pos_offset + t;
 * inv_freq[i] = theta^(-2i/D), i < D/2; for the pair (x1 = x[..., i], x2 = x[..., i + D/2]):
 * y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin, angle = pos * inv_freq[i]. */
tm_status tm_rope(tm_ctx *ctx, tm_tensor *x, int64_t pos_offset, double theta, tm_tensor **out);
/* Causal scaled-dot-product attention with grouped-query heads, fused (one op, own backward):
 * q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D], Hq % Hkv == 0, Tk >= Tq; query head h reads
 * kv head h / (Hq / Hkv); query i (0-based) sees keys j <= i + (Tk - Tq);
 * out[b,i,h] = sum_j softmax_j(q.k_j * scale) v_j with scale = 1/sqrt(D) when scale <= 0.
 * out [B, Tq, Hq, D]. (Vaswani et al. 2017; GQA: Ainslie et al. 2023.) */
tm_status tm_attention(tm_ctx *ctx, tm_tensor *q, tm_tensor *k, tm_tensor *v, double scale,
                       tm_tensor **out);

/* ------------------------------------------------------------------------------------------ */
/* Optimizers                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* AdamW: Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (ICLR 2019), Alg. 2,
 * with bias correction as in Kingma & Ba (2015). For every parameter p with gradient g, at
 * step t = 1, 2, ...:
 *   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
 *   p -= lr * ( (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * p )
 * State m, v is f32 (one buffer each per parameter, named "<param>.adamw_m" / ".adamw_v"). */
typedef struct tm_adamw_config {
    double lr;           /* default 1e-3 */
    double beta1, beta2; /* default 0.9, 0.999 */
    double eps;          /* default 1e-8 */
    double weight_decay; /* default 0.0; applied to parameters of 2 or more dims only */
} tm_adamw_config;

tm_adamw_config tm_adamw_config_default(void);

typedef struct tm_optimizer tm_optimizer;

/* An AdamW optimizer over every parameter the context holds when it is called. cfg NULL:
 * tm_adamw_config_default(). Errors: TM_ERR_INVALID_ARG (lr < 0, betas outside [0, 1),
 * eps <= 0, weight_decay < 0, naming the field; a state name over 127 bytes), TM_ERR_STATE (no
 * parameters, or the state buffers exist already: one AdamW per context), TM_ERR_NOMEM. */
tm_status tm_adamw_new(tm_ctx *ctx, const tm_adamw_config *cfg, tm_optimizer **out);
/* One update from the gradients currently accumulated. lr < 0: the configured lr (pass the
 * scheduled value otherwise). Does not zero the gradients (tm_ctx_zero_grad).
 * Errors: TM_ERR_INVALID_ARG (lr NaN or infinite), TM_ERR_UNSUPPORTED (a CUDA parameter: the
 * CUDA update kernel comes with the full CUDA backend; nothing is changed). */
tm_status tm_optimizer_step(tm_optimizer *opt, double lr);
/* Number of steps taken. */
int64_t tm_optimizer_steps(const tm_optimizer *opt);
/* Free the optimizer (its state buffers stay with the context until tm_ctx_free). NULL: no-op. */
void tm_optimizer_free(tm_optimizer *opt);

/* Global L2 norm of all parameter gradients (accumulated in f64): sqrt(sum_p sum_i g_i^2).
 * With max_norm > 0, gradients are then scaled by max_norm / (norm + 1e-6) when norm >
 * max_norm (torch.nn.utils.clip_grad_norm_). *norm_out (may be NULL) gets the norm before
 * clipping. Errors: TM_ERR_INVALID_ARG (max_norm NaN), TM_ERR_UNSUPPORTED (CUDA gradients). */
tm_status tm_ctx_clip_grad_norm(tm_ctx *ctx, double max_norm, double *norm_out);

#ifdef __cplusplus
}
#endif
#endif /* TINYMOE_H */
