/*
 * internal.h — private structures shared by the framework, the kernels and the layers.
 * Nothing here is part of the public contract (include/tinymoe.h); every name is tm__.
 *
 * How an op works (read this before adding one):
 *  1. A public function (framework/ops/<group>.c) fills a tm__call: inputs, integer and float
 *     attributes, and calls tm__op_run(&call).
 *  2. tm__op_run looks the op up in the op table (framework/op_table.c, one row per op),
 *     checks that inputs are non-NULL and on one device, and calls the row's `check`, which
 *     validates dtypes/shapes/attributes (with a message naming the op and the tensors) and
 *     allocates the outputs (tm__out_new). Ops whose output size is data-dependent may leave an
 *     output NULL in `check` and allocate it in the forward kernel.
 *  3. Inputs that are not contiguous are copied to contiguous temporaries (unless the row has
 *     TM__OP_STRIDED); on the CPU, bf16 inputs/outputs are converted to f32 around the kernel
 *     (bf16 is storage-only on the CPU), so CPU kernels see f32 or f64 only.
 *  4. The row's forward kernel for the input device runs (fwd[TM__CPU] or fwd[TM__CUDA]).
 *     It may stash extra tensors for backward in call->saved[] (e.g. rstd, logsumexp).
 *  5. If grad mode is on and an input requires a gradient, a copy of the call is pushed on the
 *     tape. tm_backward later calls the row's backward kernel with call->gout[i] (upstream
 *     gradient of out[i]; never NULL, zeros if out[i] got none) and call->gin[i] (gradient of
 *     in[i], contiguous, same shape/dtype as in[i]; NULL when in[i] needs none).
 *     Backward kernels ADD into gin[i] (gin may already hold gradient from other uses),
 *     except where call->gin_fresh[i] is set: then gin[i] holds no contribution yet and was
 *     not zero-filled (its contents are garbage), and the kernel must WRITE every element of it
 *     (the value 0 + x would give). Autograd sets gin_fresh[i] only for ops whose row has
 *     TM__OP_GRAD_WRITES, only when in[i]'s gradient did not exist before this node, never for a
 *     parameter or persistent tensor (their gradients accumulate across micro-batches), and never
 *     when another input of the call is the same tensor (x * x: the second contribution must add
 *     to the first). ZeRO-3's weights (views of a gathered unit or of a resident block) are the
 *     one exception, decided by framework/fsdp.c: their gradients are elements of the unit's
 *     gradient buffer or of the shard, fresh where nothing wrote that parameter's elements yet. Pointwise kernels store 0.0 + x (so a -0.0 reads +0.0 as zeros + x would);
 *     GEMM paths (beta = 0), the fixed-order CUDA reductions (accumulate 0) and the generic
 *     copies (contiguous, cast, concat: tm__assign) may leave the sign of a zero as it comes. A path of a
 *     GRAD_WRITES op that can only accumulate calls tm__gin_prepare(c, i) first, which zero-fills
 *     a fresh gin[i] and clears its flag. The dispatcher's bf16 staging carries the flag over.
 */
#ifndef TM_INTERNAL_H
#define TM_INTERNAL_H

#include "tinymoe.h"
#include "extend.h"

#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#define TM__MAX_IN 8
#define TM__MAX_OUT 6
#define TM__MAX_SAVED 6
#define TM__MAX_ATTR 16
#define TM__ALIGN 64

enum { TM__CPU = 0, TM__CUDA = 1, TM__NBACKENDS = 2 };

/* A block of memory on one device that tensors point into (with an element offset).
 * Parameters of a device all share one storage (the contiguous parameter buffer), as do their
 * gradients; growing that buffer moves `data`, which is why tensors keep (storage, offset)
 * rather than raw pointers. */
typedef struct tm__storage {
    void *data;          /* NULL once released (tm__tensor_release) */
    size_t nbytes;
    tm_device device;
    size_t arena_bytes;  /* size of the per-step arena block holding data; 0: not an arena block */
    int sharded;         /* ZeRO-3: a bucket's parameter block, which ops must not read as the
                          * parameters it is the storage of (framework/fsdp.c) */
    struct tm__fsdp_src *fsdp; /* ZeRO-3: a gathered weight's storage, and how to gather it again
                                * (framework/fsdp.c); NULL otherwise */
} tm__storage;

struct tm__node;

struct tm_tensor {
    tm_ctx *ctx;
    tm_dtype dtype;
    tm_device device;
    int ndim;
    int64_t shape[TM_MAX_DIMS];
    int64_t stride[TM_MAX_DIMS]; /* in elements */
    int64_t offset;              /* in elements, from storage->data */
    tm__storage *storage;
    tm_tensor *grad;             /* contiguous, same shape/dtype/device; NULL until needed */
    struct tm__node *node;       /* producing tape entry; NULL for leaves */
    unsigned requires_grad : 1;
    unsigned is_param : 1;
    unsigned persistent : 1;     /* param or buffer: not in the arena */
    const char *name;            /* "" for temporaries */
    /* parameters only (framework/param.c) */
    struct tm__param_meta *pm;   /* group, bucket, logical shape, shard; NULL for non-parameters */
    /* named views of sharded state (framework/shard.c): the parameter whose logical shape and
     * expert shard this view follows (optimizer state of a parameter), and where a ZeRO-1
     * shard's elements live; NULL for everything else */
    const struct tm_tensor *like;
    struct tm__zshard *zs;
};

/* A named tensor split over a bucket's group in ZeRO-1 blocks (framework/shard.c): its elements
 * are elements [off, off + numel) of the bucket; group rank j holds bucket elements
 * [j blk, (j + 1) blk), this rank [lo, hi), at storage + offset + (e - lo). */
typedef struct tm__zshard {
    int group;
    int64_t off, blk, lo, hi;
} tm__zshard;

/* What a parameter records beside its data (tm_param_new_ex). */
typedef struct tm__param_meta {
    tm_param_options opts;       /* group, expert range, logical shape, shard axis and offset */
    int bucket;                  /* index in ctx->buckets */
    int unit;                    /* tm_ctx_set_param_unit's when it was made */
    int64_t bucket_offset;       /* element offset of the parameter in its bucket */
    tm_tensor *master;           /* f32 master copy (bf16 parameters once an optimizer made it) */
    int sharded;                 /* ZeRO-3: this rank holds its bucket's block only (fsdp.c) */
    int64_t gsync_k;             /* grad_sync.c's plan: the tape index of its last gradient write */
} tm__param_meta;

/* One op invocation; the tape stores copies of these. */
typedef struct tm__call {
    tm_ctx *ctx;
    int op;                      /* tm__op_id */
    int n_in, n_out, n_saved;
    tm_tensor *in[TM__MAX_IN];   /* data inputs as the kernel sees them (contiguous) */
    tm_tensor *src[TM__MAX_IN];  /* the caller's tensors (gradients are routed to these) */
    tm_tensor *out[TM__MAX_OUT];
    tm_tensor *saved[TM__MAX_SAVED];
    int64_t iattr[TM__MAX_ATTR];
    double fattr[TM__MAX_ATTR];
    /* backward only */
    tm_tensor *gout[TM__MAX_OUT];
    tm_tensor *gin[TM__MAX_IN];
    unsigned char gin_fresh[TM__MAX_IN]; /* 1: gin[i] holds no contribution, not zero-filled:
                                          * write it whole (TM__OP_GRAD_WRITES ops only) */
} tm__call;

typedef tm_status (*tm__fn)(tm__call *c);

enum {
    TM__OP_STRIDED = 1u << 0,   /* forward handles non-contiguous inputs itself (views, copies) */
    TM__OP_NATIVE_BF16 = 1u << 1, /* CPU kernels handle bf16 themselves (casts, copies) */
    TM__OP_NONDIFF = 1u << 2,   /* never recorded on the tape */
    TM__OP_ANY_DEVICE = 1u << 3, /* inputs may sit on different devices (to_device) */
    TM__OP_COLLECTIVE = 1u << 4, /* a collective: recorded whenever grad mode is on and input 0 is
                                  * float, and run by every backward (framework/ops/comm.c) */
    TM__OP_GRAD_WRITES = 1u << 5 /* backward honours call->gin_fresh (writes a fresh gin[i] whole
                                  * instead of adding into zeros: saves the zero-fill and read-back) */
};

/* Which kernels an op has (from its `kernels` column in ops.def), whatever this build holds. */
enum {
    TM__K_CPU_FWD = 1u << 0,
    TM__K_CPU_BWD = 1u << 1,
    TM__K_CUDA_FWD = 1u << 2,
    TM__K_CUDA_BWD = 1u << 3
};
#define TM__KMASK_CPU_CUDA (TM__K_CPU_FWD | TM__K_CPU_BWD | TM__K_CUDA_FWD | TM__K_CUDA_BWD)
#define TM__KMASK_CPU (TM__K_CPU_FWD | TM__K_CPU_BWD)
#define TM__KMASK_GENERIC TM__KMASK_CPU_CUDA
#define TM__KMASK_NONDIFF_CPU TM__K_CPU_FWD
#define TM__KMASK_NONDIFF_CPU_CUDA (TM__K_CPU_FWD | TM__K_CUDA_FWD)
#define TM__KMASK_COMM TM__KMASK_CPU_CUDA

/* One row of the op table (op_table.c, generated from ops.def). The kernels themselves live
 * in each backend's kernel table (tm__backend_ops.fwd / .bwd, framework/backend.h). */
typedef struct tm__op_def {
    const char *name;
    int n_in;                    /* -1: variadic (1..TM__MAX_IN) */
    int n_out;
    unsigned flags;              /* TM__OP_* */
    unsigned kernels;            /* TM__K_* */
    tm__fn check;                /* validate + allocate outputs */
} tm__op_def;

typedef enum tm__op_id {
#define TM__OP(ID, name, n_in, n_out, flags, kernels) TM__OP_##ID,
#include "ops.def"
#undef TM__OP
    TM__NOPS
} tm__op_id;

extern const tm__op_def tm__op_table[TM__NOPS];

/* ---- errors --------------------------------------------------------------------------- */

/* Set the context's message (printf-style) and return `s`. Safe with ctx == NULL. */
tm_status tm__err(tm_ctx *ctx, tm_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* tm__tdesc and tm__sdesc (descriptions for messages) are declared in extend.h. */


/* ---- memory ------------------------------------------------------------------------------ */

/* Host allocation through the context's allocator hook (counted in tm_ctx_alloc_count). */
void *tm__host_alloc(tm_ctx *ctx, size_t nbytes);
void tm__host_free(tm_ctx *ctx, void *p);

/* (tm__arena_alloc and tm__meta_alloc: extend.h) */
/* tm__arena_alloc for a tensor's storage: sets st->data and st->arena_bytes (the block's size). */
tm_status tm__arena_alloc_storage(tm_ctx *ctx, tm__storage *st);
/* Give a block of `size` bytes (the arena_bytes of its storage) back to the arena of `dev`,
 * for later requests of the same step. Nothing may read or write it afterwards; on CUDA the
 * work already queued on the context's stream may (the stream orders it before any reuse). */
void tm__arena_free(tm_ctx *ctx, tm_device dev, void *p, size_t size);

/* ---- tensors ----------------------------------------------------------------------------- */

int64_t tm__numel_of(int ndim, const int64_t *shape);
static inline int64_t tm__numel(const tm_tensor *t) { return tm__numel_of(t->ndim, t->shape); }
int tm__is_contiguous(const tm_tensor *t);
static inline void *tm__data(const tm_tensor *t) {
    return (char *)t->storage->data + t->offset * (int64_t)tm_dtype_size(t->dtype);
}
/* (tm__is_float and tm__same_device: extend.h) */
static inline int tm__is_index(tm_dtype dt) { return dt == TM_I32 || dt == TM_I64; }
static inline int tm__backend(tm_device d) { return d.type == TM_DEVICE_CUDA ? TM__CUDA : TM__CPU; }
/* Read element i (logical, contiguous tensor) of an i32/i64 tensor on the CPU. */
static inline int64_t tm__idx(const tm_tensor *t, int64_t i) {
    return t->dtype == TM_I32 ? (int64_t)((const int32_t *)tm__data(t))[i] : ((const int64_t *)tm__data(t))[i];
}
/* Normalise a possibly negative axis; -1 if out of range. */
static inline int tm__axis(int axis, int ndim) {
    if (axis < 0) axis += ndim;
    return (axis < 0 || axis >= ndim) ? -1 : axis;
}

/* New contiguous temporary (uninitialised / zeroed). */
tm_status tm__tensor_new(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                         tm_tensor **out);
tm_status tm__tensor_zeros(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, tm_device dev,
                           tm_tensor **out);
/* A view sharing base's storage. */
tm_status tm__tensor_view(tm_ctx *ctx, const tm_tensor *base, int ndim, const int64_t *shape,
                          const int64_t *stride, int64_t offset, tm_tensor **out);
/* Give a temporary's storage back to the arena now (before tm_ctx_arena_reset). Every tensor
 * sharing the storage (views) becomes invalid: its data pointer is NULL. No-op for persistent
 * tensors, storages not from the arena, storages already released, and with memory reuse off
 * (tm__set_mem_reuse). */
void tm__tensor_release(tm_ctx *ctx, tm_tensor *t);
/* Allocate output i of a call as a contiguous temporary on in[0]'s device. */
tm_status tm__out_new(tm__call *c, int i, tm_dtype dt, int ndim, const int64_t *shape);
/* Allocate a saved tensor for backward (appends to c->saved, returns it). */
tm_status tm__saved_new(tm__call *c, tm_dtype dt, int ndim, const int64_t *shape, tm_tensor **out);

/* Internal, not taped: dense copy of any strided tensor (same device and dtype). */
tm_status tm__contiguous_copy(tm_ctx *ctx, const tm_tensor *src, tm_tensor **out);
/* Internal, not taped: copy src (any strides) into dst (contiguous, same shape), converting
 * dtype; both on the same device. */
tm_status tm__copy_into(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src);
/* Internal, not taped: dst += alpha * src; same shape; dst contiguous; src any strides.
 * The gradient plumbing of view ops is built on this. */
tm_status tm__accumulate(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, double alpha);
/* (tm__assign: extend.h) */
/* Internal, not taped: set every element to `value`. */
tm_status tm__fill(tm_ctx *ctx, tm_tensor *t, double value);
/* Internal: memcpy between any two devices of the context (nbytes). */
tm_status tm__memcpy(tm_ctx *ctx, void *dst, tm_device ddev, const void *src, tm_device sdev, size_t nbytes);

/* ---- op machinery ------------------------------------------------------------------------ */

static inline tm__call tm__call_init(tm_ctx *ctx, int op) {
    tm__call c;
    memset(&c, 0, sizeof c);
    c.ctx = ctx;
    c.op = op;
    return c;
}
/* Run a filled call (see the top of this file). On success c->out[] are set. */
tm_status tm__op_run(tm__call *c);
/* Convenience for a public single-output op: checks ctx/out, runs, stores out[0]. */
tm_status tm__op_run1(tm__call *c, tm_tensor **out);
/* Name of the op of a call, for messages. */
static inline const char *tm__opname(const tm__call *c) { return tm__op_table[c->op].name; }

/* Common checks for `check` functions (messages name the op and tensor). */
tm_status tm__check_float(tm__call *c, int i);   /* in[i] is f32/bf16/f64 */
/* grouped_swiglu's operand check, shared with grouped_mlp (framework/ops/grouped_swiglu.c) */
tm_status tm__grouped_swiglu_operands_check(tm__call *c, int nf, int ic, const char *names);
tm_status tm__check_index(tm__call *c, int i);   /* in[i] is i32/i64 */
tm_status tm__check_same_dtype(tm__call *c, int i, int j);
tm_status tm__check_ndim(tm__call *c, int i, int min_ndim, int max_ndim);

/* Test hook: op `op`'s backward sees its upstream gradient scaled by 1.25 (-1: off). Used by
 * tests/test_mutation.c to prove every gradient test can fail. */
void tm__test_perturb_backward(tm_ctx *ctx, int op);
/* Test hooks of fresh gradients (autograd.c, call->gin_fresh): poison 1 fills every fresh
 * gradient with NaN before the op writes it; force 1 marks every input gradient of a
 * TM__OP_GRAD_WRITES op fresh, even one holding earlier contributions (a broken autograd
 * that tests must catch). tm__test_fresh_count: fresh gradients handed out so far. */
void tm__test_fresh_hooks(tm_ctx *ctx, int poison, int force);
/* Test hook (framework/fsdp.c): on, ZeRO-3 units over a group of one (one rank; the expert
 * units when ep_size is the world) are gathered, copied and reduced as those of several ranks
 * instead of used in place, so that one process reaches that path. Set before the optimizer. */
void tm__test_fsdp_gather_always(tm_ctx *ctx, int on);
int64_t tm__test_fresh_count(const tm_ctx *ctx);

/* Memory reuse within a step (default on): kernel scratch, consumed gradients, saved tensors
 * and staging copies go back to the arena as soon as they are dead. Tests turn it off (0) to
 * measure what it saves; with it off every temporary lives until tm_ctx_arena_reset. Returns
 * the previous setting. */
int tm__set_mem_reuse(tm_ctx *ctx, int on);

/* Kernel scopes (dispatch.c): while one is open, every data-arena block taken is logged;
 * tm__scope_close gives back every block logged since `mark` except the storages of the
 * tensors in keep[] (those move to the enclosing scope, if any). Kernels therefore need not
 * free their scratch. tm__scope_open returns the mark; with memory reuse off it logs nothing. */
int tm__scope_open(tm_ctx *ctx);
void tm__scope_close(tm_ctx *ctx, int mark, tm_tensor *const *keep, int nkeep);

/* Memory accounting (tm_ctx_memory_report): add `delta` bytes to category `cat`
 * (tm_mem_category) of device `dev`. Every allocation site of parameters, gradients,
 * buffers and arena blocks calls it. */
void tm__mem_account(tm_ctx *ctx, tm_device dev, int cat, ptrdiff_t delta);

/* (tm__cross_entropy_unchecked and tm__embedding_unchecked: extend.h) */
/* Index range errors of embedding, index_select, gather and scatter_add (framework/ops/
 * indexing.c), shared by their CPU and CUDA kernels so both name a bad index alike: the bound
 * of the call's indices c->in[1] ([0, hi)), and TM_ERR_INDEX for `value` at flat position
 * `pos` of them, with its multi-index. */
int64_t tm__index_range_hi(const tm__call *c);
tm_status tm__index_range_err(tm__call *c, int64_t pos, int64_t value);

/* ---- host mirrors of small i64 tensors (framework/tensor.c) ------------------------------- */
/*
 * A host mirror is a host copy of the values of a contiguous i64 tensor, kept beside the
 * device data so that a later kernel that needs those values on the host does not read them
 * back again. moe_permute's forward mirrors its padded tokens_per_expert on that output when it
 * has them on the host: it read them back (its one synchronisation, where R depends on the
 * data), or they are pad_to each (pad_to > 0); with R = T * topk (align_size 1) the counts stay
 * on the device and have no mirror. grouped_matmul, forward and backward, takes its group
 * sizes from the mirror of its counts, and reads them back (counted) and mirrors them only when
 * there is none. So a MoE layer's forward + backward waits at most once.
 *
 * Invariant: a mirror equals the tensor's data. Mirrors are kept per context, keyed by
 * (storage, element offset, numel), so views of the same elements share them, and disjoint
 * views of one storage may each have one (setting a mirror replaces those it overlaps); they live in
 * the host meta arena and are forgotten by tm_ctx_arena_reset, together with the headers they
 * describe. Every framework path that writes into existing tensor data drops the mirrors of
 * that storage first: tm_tensor_write, tm__fill (tm_tensor_fill), tm__copy_into,
 * tm__accumulate, tm__assign, tm__tensor_release, and the dispatcher before the forward of a
 * TM__OP_NONDIFF op (the in-place updates write their inputs). An op's kernels write only
 * their own fresh outputs, gin and scratch; code that writes existing tensor data by other
 * means (raw tm__memcpy / backend memcpy into a live tensor) must call tm__mirror_drop.
 */
/* tm__mirror_set, tm__mirror_find, tm__mirror_drop: extend.h (the MoE block uses them). */

/* ---- MoE dispatch helpers shared by the CPU and CUDA kernels (framework/ops/) ------------- */

/* moe_permute: from count[e] (routed tokens of expert e) the rows of each expert with its
 * padding, rows[e] (align_size / pad_to, c->iattr), and R = their sum; TM_ERR_INVALID_ARG
 * for an expert above pad_to or rows that overflow. */
tm_status tm__moe_permute_rows(tm__call *c, const int64_t *count, int64_t *rows, int64_t *R);
/* moe_permute: *known = 1 when R does not depend on routing_map's values, with R: pad_to > 0
 * (E * pad_to) or topk > 0 with align_size 1 (T * topk), or when the caller gave it
 * (iattr[3] = R + 1: tm__moe_permute_counted, whose counts the CPU kernel checks). Then no kernel reads anything back
 * and the CPU counts no synchronisation. TM_ERR_INVALID_ARG when R * H would overflow. */
tm_status tm__moe_permute_fixed_rows(tm__call *c, int *known, int64_t *R);
/* grouped_matmul: the group sizes of c->in[2] on the host, checked against the rows of x
 * (negative, running past R, not summing to R). From the counts' host mirror when they have
 * one; otherwise read back once (one synchronisation; counted on the CPU too) and mirrored, so
 * later calls on the same counts do not wait again. On the CPU with bf16 x under
 * tm__gmm_device_schedule, neither counted nor mirrored: that CUDA kernel reads nothing back. *cnt: G values (host memory of the step). */
tm_status tm__grouped_matmul_counts(tm__call *c, const int64_t **cnt);
/* The same from the host mirror only, never reading back: *cnt = the validated mirror, or NULL
 * when the counts have none (the bf16 CUDA kernel then takes them on the device, unvalidated). */
tm_status tm__grouped_matmul_counts_mirrored(tm__call *c, const int64_t **cnt);
/* grouped_swiglu's kernels (kernels/{cpu,cuda}/grouped_swiglu.*) run the composition's kernels on
 * these calls, made from the op's call c (framework/ops/grouped_swiglu.c): gmm_call is
 * grouped_matmul's (x, weight w = 1 gate or 2 up, counts) -> y; with dy (backward) its gout is dy
 * and its gin / gin_fresh are c's of x and of that weight. act_call is swiglu's (a, b) -> c's
 * out[0], its gout c's; the caller sets its gin. */
tm__call tm__grouped_swiglu_gmm_call(const tm__call *c, int w, tm_tensor *y, tm_tensor *dy);
tm__call tm__grouped_swiglu_act_call(const tm__call *c, tm_tensor *a, tm_tensor *b);
/* grouped_mlp's kernels (kernels/{cpu,cuda}/grouped_mlp.*) run grouped_swiglu's and grouped_matmul's
 * kernels on these calls, made from the op's call c (framework/ops/grouped_mlp.c): swiglu_call is
 * grouped_swiglu's (x, w_gate, w_up, counts) -> h, its gout dh, its saved c's saved[0..1] (a, b)
 * once c has them, its gin / gin_fresh c's of x, w_gate and w_up. down_call is grouped_matmul's
 * (h, w_down, counts) -> c's out[0], its gout c's; its gin are dh (fresh; NULL: none) and c's of
 * w_down. Both carry no gradient in a forward (c has none then). */
tm__call tm__grouped_mlp_swiglu_call(const tm__call *c, tm_tensor *h, tm_tensor *dh);
tm__call tm__grouped_mlp_down_call(const tm__call *c, tm_tensor *h, tm_tensor *dh);
/* moe_sort_chunks: split_sizes on the host, checked (non-negative, summing to the rows of x):
 * the tensor itself on the CPU, its host mirror on a device; *sizes = NULL on a device without a
 * mirror (its kernels then read the sizes on the device; never a read back). */
tm_status tm__moe_sort_chunks_sizes(tm__call *c, const int64_t **sizes);
/* 1 when bf16 grouped_matmul on CUDA schedules its groups on the device: our tensor-core
 * kernel, one launch, no read back (tm_ctx_options.grouped_gemm = TM_GROUPED_GEMM_DEVICE);
 * 0 by default: one cuBLASLt GEMM per group from host counts (a mirror, or one read
 * back), as f32. Measured on an H100 (docs/PERFORMANCE.md): cuBLASLt is 2.4x faster per GEMM
 * at the MoE benchmark's shapes, and once its plans are shared per size bucket (gemm.cu) a
 * training step is faster with it too (coarse 114 -> 87 ms, fine 107 -> 99 ms per step) in
 * spite of one wait per MoE layer; the device schedule is the one without any wait (what a
 * CUDA graph capture of the step needs). The CPU counts its synchronisations by the same rule.
 * TM_GROUPED_GEMM_HOPPER schedules on the device too (the sm_90a kernel, or the one above where
 * it cannot run). tm__set_gmm_device_schedule overrides the option for a context (tests: every
 * path): mode 0 cuBLASLt, TM_GROUPED_GEMM_HOPPER, any other non-zero TM_GROUPED_GEMM_DEVICE.
 * tm__gmm_mode: the context's TM_GROUPED_GEMM_*. tm__gmm_note: under TM_GROUPED_GEMM_HOPPER, why
 * the last bf16 grouped GEMM fell back to the sm_80 kernel ("" when the Hopper kernel ran). */
int tm__gmm_device_schedule(tm_ctx *ctx);
void tm__set_gmm_device_schedule(tm_ctx *ctx, int mode);
int tm__gmm_mode(tm_ctx *ctx);
/* The backward of a view op (ops/shape.c) by adoption, called by autograd.c before the kernel:
 * where the view is a reshape (its output read densely from the input's first element), the
 * input is an op's temporary output with no gradient yet and the output's gradient is a
 * contiguous arena block, that block becomes the input's gradient (a view in the input's
 * shape) and the node's release leaves it: 1. Otherwise 0 and the kernel runs (zeros + the
 * assign). The gradients are the same values: zeros + g is g. */
int tm__view_grad_adopt(tm__call *c);
/* A backward path that only accumulates: zero-fill gin[i] if it is fresh and clear the flag
 * (autograd.c). No-op for a gin[i] that is NULL or already holds gradient. */
tm_status tm__gin_prepare(tm__call *c, int i);
/* SMs that kernels sizing their grid to the GPU leave free for collectives beside the work
 * (tm_comm_options.comm_sms where the engine has side communicators, framework/comm.c); 0: none. */
int tm__coll_spare_sms(const tm_ctx *ctx);
/* 1 while the side work being ended is background work (grad_sync.c's gradient all-reduce): the
 * backend's side_end then does not count it as holding SMs (kernels/cuda/common.cuh,
 * tm__cuda_side_busy), so that the grouped GEMMs keep every SM while it waits queued for the
 * gradients it reduces, which on the host's clock is most of the backward. */
int tm__coll_side_background(const tm_ctx *ctx);
/* 1 when the options asked for TM_GROUPED_GEMM_AUTO: the CUDA backend's init then sets the mode
 * (HOPPER where the sm_90a kernel runs, else CUBLASLT; until then CUBLASLT). */
int tm__gmm_auto(const tm_ctx *ctx);
const char *tm__gmm_note(tm_ctx *ctx);
void tm__gmm_set_note(tm_ctx *ctx, const char *why);
/* tm_grouped_swiglu's one-launch Hopper forwards (FWD_SWIGLU) in this context, counted by the
 * CUDA kernel file when one is launched: the tests' proof that the fused path ran (its results
 * are the composition's bits, so they cannot tell). */
uint64_t tm__gsw_fused_launches(const tm_ctx *ctx);
void tm__gsw_fused_count(tm_ctx *ctx);
/* tm_grouped_mlp's fused Hopper backward on CUDA (kernels/cuda/grouped_mlp.cu: DX_SWIGLU, SwiGLU's
 * backward in the epilogue of the down projection's dx, for bf16 under TM_GROUPED_GEMM_HOPPER):
 * OFF by default: it gives the composition's bits (tests/test_cuda_parity_grouped_mlp.c) but is
 * slower than the composition's DX then elementwise backward (H200, a coarse training step: 340-359
 * us against 150 + 163 us a layer; an L2 prefetch of gate and up did not help; docs/PERFORMANCE.md,
 * session 18). The tests turn it on to hold it to the composition's bits. The backwards that
 * took it in this context are counted (tm_ctx_kernel_report; their results cannot tell). */
void tm__grouped_mlp_set_fused(tm_ctx *ctx, int on);
int tm__grouped_mlp_fused(const tm_ctx *ctx);
uint64_t tm__grouped_mlp_fused_launches(const tm_ctx *ctx);
void tm__grouped_mlp_fused_count(tm_ctx *ctx);
/* tm_attention's bf16 Hopper kernels (kernels/cuda/attention_sm90.cu, wgmma): the forwards and
 * backwards that took them in this context (counted by attention.cu), and a switch that sends
 * bf16 attention to the sm_80 kernels (attention_tc.cuh) even on Hopper, so that the tests check
 * both paths against the CPU on one GPU. */
uint64_t tm__attn_sm90_launches(const tm_ctx *ctx);
void tm__attn_sm90_count(tm_ctx *ctx);
void tm__attn_set_sm80(tm_ctx *ctx, int on);
int tm__attn_sm80(const tm_ctx *ctx);
/* tm_moe_gating's split path on CUDA (kernels/cuda/moe_gating.cu: bf16 MMAs on a three-term bf16
 * split of the f32 operand, for bf16 x where the direct kernels do not apply): on by default
 * (session 17: fine's step 2.7% faster than on cuBLASLt's f32 GEMMs); the tests switch it off to
 * hold the cuBLASLt path to the same bound. The gatings that took it in this context are counted. */
void tm__gating_set_split(tm_ctx *ctx, int on);
int tm__gating_split(const tm_ctx *ctx);
uint64_t tm__gating_split_launches(const tm_ctx *ctx);
void tm__gating_split_count(tm_ctx *ctx);

/* ---- context internals used by kernels --------------------------------------------------- */

/* (tm__nthreads and tm__grad_enabled: extend.h) */
/* 1: the CPU GEMM must use the built-in kernel even when the build has CBLAS. */
int tm__cpu_gemm_builtin(const tm_ctx *ctx);
/* Opaque CUDA state of the context (NULL when the context has no CUDA device). */
void *tm__cuda_state(const tm_ctx *ctx);

/* ---- bf16 ---------------------------------------------------------------------------- */

static inline float tm__bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* Round to nearest even; NaN stays NaN (quiet). */
static inline uint16_t tm__f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
/* t (f32, on the host) = bf16(t) element by element: what storing it in a bf16 tensor and reading it
 * back gives. The CPU kernels of composition ops (grouped_swiglu, grouped_mlp) round their f32
 * intermediates with it where the composition stores them in bf16 tensors (kernels/cpu/copy.c). */
void tm__round_bf16_host(tm_tensor *t);

/* ---- CPU GEMM (kernels/cpu/gemm.c) -------------------------------------------------------- */
/* Row-major C[M,N] = alpha * op(A) @ op(B) + beta * C, op(A) [M,K], op(B) [K,N];
 * lda/ldb/ldc are row strides of the stored (untransposed) matrices. dt: TM_F32 or TM_F64.
 * CBLAS when built with OpenBLAS (TM_HAVE_CBLAS), a blocked OpenMP kernel otherwise. */
void tm__gemm_cpu(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                  double alpha, const void *A, int64_t lda, const void *B, int64_t ldb, double beta,
                  void *C, int64_t ldc);

/* ---- kernels named by the registry (kernels/cpu/<op>.c, kernels/cuda/<op>.cu) ------------ */
#define TM__DECL_CHECK(name) tm_status tm__##name##_check(tm__call *c);
#define TM__DECL_CPU(name)                          \
    TM__DECL_CHECK(name)                            \
    tm_status tm__##name##_forward_cpu(tm__call *c); \
    tm_status tm__##name##_backward_cpu(tm__call *c);
#define TM__DECL_CPU_CUDA(name)                      \
    TM__DECL_CPU(name)                               \
    tm_status tm__##name##_forward_cuda(tm__call *c); \
    tm_status tm__##name##_backward_cuda(tm__call *c);
/* Device-generic kernels (built on the backend's copy / accumulate / GEMM entry points): one
 * forward and one backward serve both backends. */
#define TM__DECL_GENERIC(name)                  \
    TM__DECL_CHECK(name)                        \
    tm_status tm__##name##_forward(tm__call *c); \
    tm_status tm__##name##_backward(tm__call *c);
#define TM__DECL_NONDIFF_CPU(name) \
    TM__DECL_CHECK(name)          \
    tm_status tm__##name##_forward_cpu(tm__call *c);
#define TM__DECL_NONDIFF_CPU_CUDA(name) \
    TM__DECL_NONDIFF_CPU(name)          \
    tm_status tm__##name##_forward_cuda(tm__call *c);
#define TM__DECL_COMM(name) TM__DECL_GENERIC(name)
#define TM__OP(ID, name, n_in, n_out, flags, kernels) TM__DECL_##kernels(name)
#include "ops.def"
#undef TM__OP

#include "backend.h"

#endif /* TM_INTERNAL_H */
