/*
 * extend.h — the one internal header that layers/, optim/ and checkpoints/ use beside the
 * public tinymoe.h: error reporting, host memory through the allocator hook, the bucket
 * machinery an optimizer needs (master weights, flat state per bucket, named per-parameter
 * views of it for checkpoints), and a kernel-availability query so that a multi-op update can
 * refuse before touching anything; and, for layers/, the few runtime entry points a model
 * built from public ops still needs (host scratch of the step, the no-sync embedding and
 * cross-entropy, untaped copies into views, a persistent tensor owned by its caller).
 * Everything else of the runtime stays behind internal.h: tm_tensor is an incomplete type here.
 */
#ifndef TM_EXTEND_H
#define TM_EXTEND_H

#include "tinymoe.h"

/* Set the context's message (printf-style) and return `s`. Safe with ctx == NULL. */
tm_status tm__err(tm_ctx *ctx, tm_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* Return the status of expr when it is not TM_OK. */
#define TM__TRY(expr)                 \
    do {                              \
        tm_status tm__s_ = (expr);    \
        if (tm__s_ != TM_OK) return tm__s_; \
    } while (0)

/* "f32[2,3]@cpu", a tensor described for messages: one of 8 rotating buffers in the context,
 * so up to 8 may appear in one message. "NULL" for NULL. */
const char *tm__tdesc(tm_ctx *ctx, const tm_tensor *t);

/* Shape only: "[2,3]". Same buffer rules. */
const char *tm__sdesc(tm_ctx *ctx, int ndim, const int64_t *shape);
/* The context's CPU thread count (tm_ctx_options.num_threads, resolved). */
int tm__nthreads(const tm_ctx *ctx);

/* Host allocation through the context's allocator hook (counted in tm_ctx_alloc_count). */
void *tm__host_alloc(tm_ctx *ctx, size_t nbytes);
void tm__host_free(tm_ctx *ctx, void *p);
/* Host staging memory for device copies: page-locked (cudaHostAlloc) when a device backend of
 * the context offers it and the driver grants it, else tm__host_alloc's. *pinned says which;
 * pass it back to tm__host_free_pinned. NULL (no error set) when out of memory. */
void *tm__host_alloc_pinned(tm_ctx *ctx, size_t nbytes, int *pinned);
void tm__host_free_pinned(tm_ctx *ctx, void *p, int pinned);

/* Create the f32 master copy of bucket `bucket` (no-op if it exists), initialised from the
 * parameters' current values; from then on tm_tensor_write on a parameter of it also writes
 * its master. Errors: TM_ERR_NOMEM, TM_ERR_CUDA. */
tm_status tm__bucket_master_ensure(tm_ctx *ctx, int bucket);
/* A parameter's f32 master copy (same shape), or NULL when it has none. */
tm_tensor *tm__param_master(const tm_tensor *param);
/* A zeroed persistent f32 buffer [numel] with bucket `bucket`'s layout on its device, owned by
 * the context, not named (so not in checkpoints by itself). fn names the caller. Errors:
 * TM_ERR_NOMEM, TM_ERR_CUDA. */
tm_status tm__state_alloc(tm_ctx *ctx, const char *fn, int bucket, tm_tensor **flat);
/* The same with numel elements (a ZeRO-1 block of the bucket: tm_ctx_grad_shard). */
tm_status tm__state_alloc_n(tm_ctx *ctx, const char *fn, int bucket, int64_t numel, tm_tensor **flat);
/* Register `name` as a named persistent view of `base` (a persistent tensor) with the given
 * shape at element `offset` (checkpoints save and load it under that name). Errors: as
 * tm_buffer_new (name rules, NOMEM). */
tm_status tm__named_alias(tm_ctx *ctx, const char *fn, const char *name, const tm_tensor *base, int ndim,
                          const int64_t *shape, int64_t offset, tm_tensor **out);
/* The position of named tensor `name` in tm_ctx_named's order (a hash lookup), or -1. */
int tm__names_find(const tm_ctx *ctx, const char *name);
/* The name of the first parameter of bucket `bucket` (for messages); "?" if none. */
const char *tm__bucket_first_param(const tm_ctx *ctx, int bucket);
/* tm_ctx_options.no_grad_buffers of the context: its parameters have no gradients (param.c). */
int tm__ctx_no_grad_buffers(const tm_ctx *ctx);
/* 1 when op `name` (as in framework/ops.def) has a forward kernel for tensors on dev in this
 * context. */
int tm__op_available(const tm_ctx *ctx, const char *name, tm_device dev);

/* ---- for layers/ (layers/model.c, moe.c, kv_cache.c) ------------------------------------ */
/* 1 for the float dtypes (f32, bf16, f64). */
static inline int tm__is_float(tm_dtype dt) { return dt == TM_F32 || dt == TM_BF16 || dt == TM_F64; }
/* 1 when a and b are the same device (any CPU is the CPU). */
static inline int tm__same_device(tm_device a, tm_device b) {
    return a.type == b.type && (a.type == TM_DEVICE_CPU || a.index == b.index);
}
/* 1 while the context records the tape (tm_ctx_set_grad_enabled). */
int tm__grad_enabled(const tm_ctx *ctx);
/* The context a tensor belongs to. */
tm_ctx *tm__tensor_ctx(const tm_tensor *t);
/* nbytes from the per-step data arena of dev (64-byte aligned; gone at tm_ctx_arena_reset;
 * inside a kernel, given back when it returns); NULL + message on failure. */
void *tm__arena_alloc(tm_ctx *ctx, tm_device dev, size_t nbytes);
/* nbytes of per-step host bookkeeping memory (tensor headers, tape nodes); gone at
 * tm_ctx_arena_reset; NULL on failure. */
void *tm__meta_alloc(tm_ctx *ctx, size_t nbytes);
/* tm_embedding without the check of its ids, for ids already known to be valid (tm_index_check
 * on the device, or read on the host): the same result, but the CUDA forward does not read its
 * bad-index flag back, so it
 * does not synchronise (and the CPU forward counts no synchronisation). An id outside [0, V)
 * then gives a zero row on CUDA (the CPU still reports it). */
tm_status tm__embedding_unchecked(tm_ctx *ctx, tm_tensor *weight, tm_tensor *ids, tm_tensor **out);
/* tm__embedding_unchecked for ids that name each row of weight at most once (a permutation, as
 * the expert-parallel regrouping's): the same values and gradient; the CUDA backward adds each
 * source row into its destination directly instead of sorting the ids (a sort of the ~10^5 rows
 * per call, O(M log^2 M) in ~150 launches, cost each MoE layer's all-to-all path milliseconds). */
tm_status tm__embedding_unique(tm_ctx *ctx, tm_tensor *weight, tm_tensor *ids, tm_tensor **out);
/* tm_tensor_init_normal of parameter t under its own name, collective over the ranks that hold
 * replicas of it (its data-parallel group: every rank for dense parameters, the expert-data-
 * parallel group for expert shards) when a communicator is attached and no optimizer has made
 * master weights yet: each rank draws 1/G of the elements and an all-gather fills in the rest,
 * the same bits as the whole draw. Every rank of the group must call it for the same tensors in
 * the same order (tm_model_init, tm_moe_init do). Otherwise the same as tm_tensor_init_normal. */
tm_status tm__param_init_normal_replicated(tm_ctx *ctx, tm_tensor *t, uint64_t seed, double mean, double std);
/* tm_moe_permute (align_size, pad_to as there) for a caller that already has the padded rows
 * per expert on the host (rows: E values, as tokens_per_expert will hold them; the chunked
 * expert-parallel dispatch gets them from its one exchange of counts): R = their sum is not
 * read back (no synchronisation), and tokens_per_expert is mirrored with rows, so the grouped
 * GEMMs on it read nothing either. The CPU checks the promise (TM_ERR_INVALID_ARG naming the
 * expert whose rows differ); CUDA cannot without a read back and trusts it (a map that breaks
 * it places no row at or past R). Errors: those of tm_moe_permute; TM_ERR_INVALID_ARG (rows
 * NULL, negative or overflowing). */
tm_status tm__moe_permute_counted(tm_ctx *ctx, tm_tensor *x, tm_tensor *routing_map, tm_tensor *probs,
                                  int64_t align_size, int64_t pad_to, const int64_t *rows, tm_moe_dispatch *out);
/* tm_comm_alltoall for counts every rank derived from one all-gathered table (the MoE layer's
 * dispatch): the same op without its check's exchange of the counts (a host collective per
 * call that could only confirm them). */
tm_status tm__comm_alltoall_consistent(tm_ctx *ctx, tm_tensor *x, tm_tensor *send_counts, tm_tensor *recv_counts,
                                       tm_comm_group g, tm_tensor **out);
/* tm__comm_alltoall_consistent beside the work (tm_comm_options.overlap, where the engine can
 * run it on its side stream over g: NCCL with the group's side communicator, made by
 * tm__comm_side_prepare; CPU ranks, whose collectives block, run the same bookkeeping). The
 * forward returns once the transfer is enqueued: *out is written beside the work, and the first
 * op that reads it (or tm__side_wait) makes the work wait for it; x's memory is held until
 * then. The backward likewise sends the gradient back beside the work and *writes* it into x's
 * gradient, which its first reader waits for: x must have no reader but this op (the chunked
 * MoE layer's rows of one chunk). Elsewhere exactly tm__comm_alltoall_consistent. */
tm_status tm__comm_alltoall_beside(tm_ctx *ctx, tm_tensor *x, tm_tensor *send_counts, tm_tensor *recv_counts,
                                   tm_comm_group g, tm_tensor **out);
/* Ready group g for collectives beside the work on dev (its side communicator, where the
 * engine needs one: NCCL; tm_comm_options.overlap on). Collective over g: every rank of the
 * group calls it at the same point (the MoE layer's creation). Nothing where overlap is off,
 * the group has one rank or the engine blocks (CPU ranks, host-staged MPI). Errors: TM_ERR_COMM. */
tm_status tm__comm_side_prepare(tm_ctx *ctx, tm_comm_group g, tm_device dev);
/* The work waits for the collectives beside the work that write t's storage (none: nothing);
 * call before reading t by other than an op (ops wait by themselves). framework/side.c. */
tm_status tm__side_wait(tm_ctx *ctx, const tm_tensor *t);
/* tm_cross_entropy without the check of its targets, for targets already known to be valid
 * (checked on the device, e.g. by tm_index_check): the same result, but the CUDA forward does not read its bad-target flag
 * back, so it does not synchronise (and the CPU forward counts no synchronisation). A target
 * outside [0, V) that is not ignore_index is then undefined on CUDA (the CPU still reports it).
 * The loss of bf16 logits is f32 (a bf16 loss would keep 3 significant digits), computed from
 * the bf16 logits directly: no f32 copy of the logits, and their gradient is written in bf16,
 * the bits of a cast to f32 followed by the cross-entropy. */
tm_status tm__cross_entropy_unchecked(tm_ctx *ctx, tm_tensor *logits, tm_tensor *targets, int64_t ignore_index,
                                    tm_tensor **out);
/* Not taped: dst = src (accumulate 0) or dst += alpha * src (accumulate 1) with ANY strides on
 * both sides (dst must not overlap itself); same shape and device; dtypes converted. Used
 * where the destination is a view (concat forward, slice backward, KV cache writes). */
tm_status tm__assign(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, int accumulate, double alpha);
/* Not taped, no kernel: copy the bytes of src (contiguous) into the memory of dst (contiguous)
 * from byte `offset` on, device to device (no dtype conversion: statistics packed into i64
 * slots). TM_ERR_INTERNAL when either is strided or the bytes do not fit in dst. */
tm_status tm__copy_bytes(tm_ctx *ctx, tm_tensor *dst, size_t offset, const tm_tensor *src);
/* A zeroed contiguous tensor that outlives tm_ctx_arena_reset, owned by the caller until
 * tm__persistent_free: unnamed (no checkpoint sees it), no gradient, and, like the KV caches
 * that use it, not in tm_ctx_memory_report. fn names the caller in messages. Errors: as
 * tm_tensor_zeros (TM_ERR_NOMEM when host or device memory runs out). */
tm_status tm__persistent_new(tm_ctx *ctx, const char *fn, tm_dtype dt, int ndim, const int64_t *shape,
                             tm_device dev, tm_tensor **out);
/* Free a tensor of tm__persistent_new (its views become invalid). NULL: no-op. */
void tm__persistent_free(tm_ctx *ctx, tm_tensor *t);

/* ---- distributed (framework/comm.c) --------------------------------------------------------- */
/* The group a bucket's gradients are summed over: TM_COMM_EXPERT_DP for expert buckets,
 * TM_COMM_DP otherwise. */
int tm__bucket_comm_group(const tm_ctx *ctx, int bucket);
/* 1 when the context's communicator shards optimizer state (ZeRO-1 or 2). */
int tm__zero_enabled(const tm_ctx *ctx);
/* Elements of each rank's block of a bucket under ZeRO-1 (tm_ctx_grad_shard's ranges are
 * [r blk, (r + 1) blk) clipped to the bucket). */
int64_t tm__zero_block(const tm_ctx *ctx, int bucket);
/* Make the parameter, gradient (and master) buffers of a bucket hold at least n elements, the
 * bytes past its parameters zero (collectives over G equal blocks read and write them). */
tm_status tm__bucket_reserve(tm_ctx *ctx, int bucket, int64_t n);
/* The ZeRO stage of the context's communicator: 0 (none, or no communicator), 1, 2 or 3. */
int tm__zero_level(const tm_ctx *ctx);
/* ZeRO-2: make bucket `bucket`'s persistent gradient shard (the reduced gradients of this
 * rank's block; no-op below ZeRO-2 or when made). Errors: TM_ERR_NOMEM, TM_ERR_CUDA. */
tm_status tm__bucket_grad_shard_ensure(tm_ctx *ctx, int bucket);
/* The gradients the clip and the optimizer read after tm_comm_sync_grads: the flat full
 * gradients (*off = 0), or under ZeRO-2 the shard, whose element i is bucket element *off + i
 * (NULL before tm__bucket_grad_shard_ensure). */
tm_tensor *tm__bucket_grads_reduced(tm_ctx *ctx, int bucket, int64_t *off);
/* Call before reading a bucket's reduced gradients: under ZeRO-3 a shard that no reduce-scatter
 * wrote since tm_ctx_zero_grad is zeroed now. tm_ctx_zero_grad leaves the gathered units' shards
 * alone, because the backward's first reduce-scatter of a unit overwrites its shard whole
 * (framework/fsdp.c); only a unit without a backward this step still holds the last sums.
 * Errors: TM_ERR_CUDA. */
tm_status tm__bucket_grads_settle(tm_ctx *ctx, int bucket);
/* ZeRO-3 (framework/fsdp.c). tm__zero3_shard_params: keep only this rank's block of every
 * bucket's parameters (made with the optimizer, after its master weights); no-op below ZeRO-3
 * or when done. Errors: TM_ERR_NOMEM, TM_ERR_CUDA.
 * tm__param_use: the weight to compute with: p itself, or under ZeRO-3 a view of its unit's
 * all-gather over p's group (a taped collective whose backward reduce-scatters the unit's
 * gradient into this rank's shard; the first use of the unit in a forward runs it, later ones
 * share it), shaped as p. Every rank of the group calls it for the same parameters in the same
 * order. tm__param_done: this use is over (no-op for p itself); the unit's memory goes back
 * when every use of it is, and the backward gathers it again when it needs it.
 * tm__param_prefetch: start the all-gathers of the units of the parameters the forward will
 * use next (the next layer's) beside the work, for their tm__param_use to take up
 * (tm_comm_options.overlap with NCCL; a no-op on the CPU ranks); sets_window: the set is a
 * layer's, whose bytes bound how far ahead the backward gathers (not the lm_head's).
 * tm__param_sharded: 1 for a parameter whose data this rank holds a block of only.
 * tm__param_keep: while on (returns the previous setting), the weights tm__param_use gathers
 * under grad mode are kept: their tm__param_done gives nothing back and the backward finds
 * them gathered (tm_comm_options.zero3_keep_last; the caller turns it on for the last weights
 * of its forward, whose backward comes first). Their memory goes back after their backward. */
tm_status tm__zero3_shard_params(tm_ctx *ctx);
tm_status tm__param_use(tm_ctx *ctx, tm_tensor *p, tm_tensor **w);
void tm__param_done(tm_ctx *ctx, tm_tensor *w);
int tm__param_keep(tm_ctx *ctx, int on);
tm_status tm__param_prefetch(tm_ctx *ctx, tm_tensor *const *params, int n, int sets_window);
/* 1 + the highest unit (tm_ctx_set_param_unit) a parameter of ctx was made in; 0 when none. */
int tm__param_unit_end(const tm_ctx *ctx);
int tm__param_sharded(const tm_tensor *p);
/* The element of bucket `bucket` that its flat parameter view starts at: 0, or under ZeRO-3
 * this rank's block start (the view holds the block only). */
int64_t tm__bucket_params_offset(const tm_ctx *ctx, int bucket);
/* ZeRO-1: all-gather every bucket's parameters from the ranks that updated their blocks. */
tm_status tm__zero_gather_params(tm_ctx *ctx);
/* Plan-only contexts (tm_model_plan_step; include/tinymoe.h, tm_ctx_options.plan_only).
 * tm__ctx_plan_only: 1 for such a context. tm__zero_plan_step: run the bucket side of one
 * optimizer step on the placeholders: the full gradient buffers a backward makes (ZeRO-2), then
 * tm_comm_sync_grads, then the parameters' all-gather after the update (ZeRO-1 and 2); *grad_sync
 * and *param_gather: the bytes the two counted (tm_comm_get_stats), *transient: the gradient
 * bytes the backward's buffers added (tm_ctx_memory_report). Errors: those of the three.
 * tm__fsdp_use_plan: one gather of p's unit under ZeRO-3 (fsdp.c): *unit the bucket it is (-1
 * for a parameter this rank holds whole), *held the bytes of the gathered unit (counted as
 * parameters while in use), *gather the bytes of its all-gather, *reduce those of the
 * reduce-scatter of its gradient in the backward; the byte counts 0 for a parameter this rank
 * holds whole. Errors: none today (TM_OK). */
int tm__ctx_plan_only(const tm_ctx *ctx);
tm_status tm__zero_plan_step(tm_ctx *ctx, int64_t *grad_sync, int64_t *param_gather, int64_t *transient);
tm_status tm__fsdp_use_plan(tm_ctx *ctx, const tm_tensor *p, int *unit, int64_t *held, int64_t *gather,
                            int64_t *reduce);

/* ---- sharded named tensors (framework/shard.c): checkpoints hold logical tensors ----------- */
/* t (a named view of optimizer state of `param`) follows param's logical shape and expert
 * shard. */
void tm__named_set_like(tm_tensor *t, const tm_tensor *param);
/* t's elements are elements [off, off + numel(t)) of a bucket split in ZeRO-1 blocks of blk
 * elements over group `group`; this rank holds bucket elements [lo, hi), t's storage starting at
 * element lo. Errors: TM_ERR_NOMEM. */
tm_status tm__named_set_zero(tm_ctx *ctx, tm_tensor *t, int group, int64_t off, int64_t blk, int64_t lo, int64_t hi);
struct tm__zshard;
/* The same with a shard record z already allocated (tm__host_alloc; t takes it over): ZeRO-3
 * allocates every record of a bucket first, so that attaching them cannot fail half-way. */
void tm__named_attach_zero(tm_ctx *ctx, tm_tensor *t, struct tm__zshard *z, int group, int64_t off, int64_t blk, int64_t lo,
                           int64_t hi);
/* 1 when reading t's logical value needs the other ranks (a collective: every rank must call
 * tm__named_gather for it, in the same order). */
int tm__named_sharded(const tm_ctx *ctx, const tm_tensor *t);
/* The logical shape of a named tensor (its own shape unless it is an expert shard). */
void tm__named_logical(const tm_tensor *t, int *ndim, int64_t *shape);
/* The logical tensor's elements (t's dtype, row-major) into host memory dst; collective when
 * tm__named_sharded. Errors: TM_ERR_NOMEM, TM_ERR_COMM, TM_ERR_CUDA. */
tm_status tm__named_gather(tm_ctx *ctx, const tm_tensor *t, void *dst);
/* Take this rank's part of the logical elements src (t's dtype) into t. No communication. */
tm_status tm__named_scatter(tm_ctx *ctx, tm_tensor *t, const void *src);
/* The logical elements [*lo, *lo + *n) of t (row-major) that this rank holds (a checkpoint's
 * per-rank write: checkpoints/ckpt.c): the whole tensor when it is not spread over the ranks,
 * the expert shard, or the expert shard's part in this rank's ZeRO block (*n may be 0). Ranks
 * holding replicas report the same range. No communication. */
void tm__named_local_range(const tm_ctx *ctx, const tm_tensor *t, int64_t *lo, int64_t *n);
/* Elements [from, from + count) of that range into host memory dst (t's dtype). Errors:
 * TM_ERR_INTERNAL (outside the range), TM_ERR_CUDA. */
tm_status tm__named_read_local(tm_ctx *ctx, const tm_tensor *t, int64_t from, int64_t count, void *dst);

/* Host mirrors of small i64 tensors (the invariant: framework/internal.h, "host mirrors"). */
/* Mirror t (contiguous i64) with numel(t) values copied from vals (any host memory). */
tm_status tm__mirror_set(tm_ctx *ctx, const tm_tensor *t, const int64_t *vals);
/* t's mirror (numel(t) values), or NULL when t has none (or is not contiguous i64). */
const int64_t *tm__mirror_find(const tm_ctx *ctx, const tm_tensor *t);
/* t's storage is about to be written: forget every mirror of that storage. */
void tm__mirror_drop(tm_ctx *ctx, const tm_tensor *t);

/* ---- fused updates over many bucket ranges (framework/ops/update.c) ------------------------ */
/* A segment list: the ranges one fused update op covers on one device (framework/
 * update_multi.h), with its table on that device. Fill it before every use (begin, then one
 * add per range, in a fixed order); the ops upload the table only when it differs from the one
 * the device holds, so a steady training step uploads nothing. Empty ranges are left out. */
typedef struct tm__segs tm__segs;
enum { TM__SEGS_ADAMW = 1, TM__SEGS_GRADS = 2 };
/* A list for up to cap ranges (it grows when begin asks for more) of tensors on dev. fn names
 * the caller in messages. Errors: TM_ERR_NOMEM, TM_ERR_CUDA. */
tm_status tm__segs_new(tm_ctx *ctx, const char *fn, tm_device dev, int cap, tm__segs **out);
/* NULL: no-op. */
void tm__segs_free(tm_ctx *ctx, tm__segs *l);
/* The context's own list for dev (tm_ctx_clip_grad_norm's, and the one range of
 * tm_adamw_update / tm_grad_sumsq / tm_grad_scale), made on first use (for cap ranges),
 * freed with the context. Errors: as tm__segs_new. */
tm_status tm__ctx_segs(tm_ctx *ctx, tm_device dev, int cap, tm__segs **out);
/* Empty the list to describe up to cap ranges of kind TM__SEGS_ADAMW or TM__SEGS_GRADS. */
tm_status tm__segs_begin(tm_ctx *ctx, tm__segs *l, int kind, int cap);
/* Ranges left in the list (empty ones are not). */
int tm__segs_count(const tm__segs *l);
/* AdamW range [a, e) of a bucket: elements [a, e) of the flat params P, [a - goff, e - goff) of
 * the grads G (P's float dtype; goff > 0: a ZeRO-2 gradient shard starting at bucket element
 * goff; P likewise from poff > 0: a ZeRO-3 parameter block), elements [a - off, e - off) of the
 * flat f32 moments m, v and master weights (NULL:
 * none; bf16 parameters then round each step), with weight decay wd. Errors (nothing is added):
 * TM_ERR_INVALID_ARG (NULL, not contiguous, a range outside a tensor, the list full or of
 * another kind), TM_ERR_DTYPE, TM_ERR_DEVICE. */
tm_status tm__segs_add_adamw(tm_ctx *ctx, tm__segs *l, tm_tensor *P, tm_tensor *G, tm_tensor *m, tm_tensor *v,
                             tm_tensor *master, int64_t a, int64_t e, int64_t off, int64_t goff, int64_t poff,
                             double wd);
/* Gradient range [a, e) of the flat gradients G. Errors: as tm__segs_add_adamw. */
tm_status tm__segs_add_grad(tm_ctx *ctx, tm__segs *l, tm_tensor *G, int64_t a, int64_t e);
/* AdamW over every range of l (TM__SEGS_ADAMW) in one op, with each range's weight decay
 * (tm_adamw_update is this over one range). factor: NULL, or the clip's factor (the *factor
 * of tm__grad_sumsq_multi, 0-d on l's device): the update then reads every gradient as
 * tm__grad_scale_multi would have left it (bit for bit) without writing the gradients, so a
 * clip followed by the update makes one pass over them instead of two. Errors: as
 * tm_adamw_update; TM_ERR_INVALID_ARG for a factor of another device, shape or dtype. */
tm_status tm__adamw_update_multi(tm_ctx *ctx, tm__segs *l, const tm_adamw_config *cfg, double lr, int64_t step,
                                 tm_tensor *factor);
/* The clip's two ops over l (TM__SEGS_GRADS, at least one range). grad_sumsq_multi: *partials
 * [count] = tm_grad_sumsq of each range (f64 on the CPU, f32 on CUDA, the same values), and
 * *factor (0-d, f64 / f32) = max_norm / (norm + 1e-6) when max_norm > 0 and norm > max_norm,
 * else exactly 1, where norm = sqrt of the partials (f64 each) added in range order: computed
 * on the device, nothing is read back. grad_scale_multi: every range *= factor (rounded to f32
 * for f32 and bf16 gradients), nothing when factor is 1, without a host read. */
tm_status tm__grad_sumsq_multi(tm_ctx *ctx, tm__segs *l, double max_norm, tm_tensor **partials, tm_tensor **factor);
tm_status tm__grad_scale_multi(tm_ctx *ctx, tm__segs *l, tm_tensor *factor);
/* A factor for tm__grad_scale_multi computed on the host: scale as a 0-d tensor on dev (f64 on
 * the CPU, f32 on CUDA; a step temporary). Errors: TM_ERR_NOMEM, TM_ERR_CUDA. */
tm_status tm__clip_factor(tm_ctx *ctx, tm_device dev, double scale, tm_tensor **out);

#endif
