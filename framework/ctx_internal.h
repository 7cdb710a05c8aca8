/*
 * ctx_internal.h — the context struct, known only to the framework sources (kernels use the accessor
 * functions in internal.h).
 */
#ifndef TM_CTX_INTERNAL_H
#define TM_CTX_INTERNAL_H

#include "internal.h"

/* The per-step arenas. Each holds chunks of memory from its device (cudaMalloc, or the host
 * allocator for the CPU), kept from step to step: the arenas are the caching allocator of the
 * CUDA backend.
 *
 * The meta arena (host bookkeeping: headers, tape) bumps through its chunks and frees nothing
 * before tm_ctx_arena_reset.
 *
 * A data arena (tensor data, scratch) is a best-fit allocator over its chunks: every chunk is
 * cut into blocks, in address order (prev/next), each in use or free. A request takes the
 * smallest free block that holds it (free blocks sit in size-class bins, four classes per
 * doubling), splits off the rest as a free block, and a block given back merges with free
 * neighbours, so the same bytes serve requests of other sizes later in the step or in later
 * steps (ragged MoE shapes change every step). A request no free block holds adds a chunk.
 * At tm_ctx_arena_reset every chunk becomes one free block again; if the step had to add
 * chunks, they are all given back and replaced by one chunk of the size the step needed
 * (in-use peak plus an eighth, at least what it held), so the next step runs in one contiguous
 * chunk and performs no system allocation. A chunk that cannot be had from the device first
 * gives back every wholly free chunk and retries. Block records live in host slabs owned by
 * the arena; live blocks are found by address through an open-addressing table. */
typedef struct tm__block {
    char *p;
    size_t size;
    struct tm__block *prev, *next;   /* address neighbours in the same chunk; NULL at its ends */
    struct tm__block *fprev, *fnext; /* the bin's list, free blocks only */
    int is_free, bin;
} tm__block;

typedef struct tm__chunk {
    void *mem;
    size_t size, used; /* used: the bump offset (meta arena only) */
    tm__block *first;  /* the block at mem (data arenas) */
} tm__chunk;

#define TM__NCLASSES 240

typedef struct tm__arena {
    tm_device dev;
    tm__chunk *chunks;
    int n, cap, cur;   /* cur: the meta arena's current chunk */
    size_t used, peak; /* bytes in live blocks; high-water mark since creation */
    size_t step_peak;  /* high-water mark since the last reset */
    size_t reserved, reserved_peak; /* bytes of the chunks; their high-water mark */
    int grew;          /* chunks were added since the last reset */
    uint64_t n_trims;  /* consolidations and chunk releases (tm_memory_report) */
    /* data arenas: */
    tm__block *bins[TM__NCLASSES];
    uint64_t binmask[(TM__NCLASSES + 63) / 64];
    tm__block *spare;  /* unused records */
    tm__block **slabs;
    int n_slabs, cap_slabs;
    tm__block **map;   /* live blocks by address (open addressing, linear probing) */
    size_t map_cap, map_n;
} tm__arena;

/* One arena block taken while a kernel scope is open (see tm__scope_open). */
typedef struct tm__scope_entry {
    void *p;
    size_t size;
    int backend;
    tm__storage *st; /* the tensor storage that owns the block, NULL for raw scratch */
} tm__scope_entry;

/* Memory accounting per device (tm_ctx_memory_report). */
typedef struct tm__mem_stats {
    size_t current[TM_MEM_NCATEGORIES], peak[TM_MEM_NCATEGORIES];
    size_t total, total_peak, at_peak[TM_MEM_NCATEGORIES];
} tm__mem_stats;

/* A growable contiguous buffer (the parameters of a bucket, or their gradients). */
typedef struct tm__pool {
    tm__storage st; /* st.nbytes is the capacity */
    size_t used;
    size_t want;    /* capacity asked for while tm_ctx_defer_params is in force (param.c) */
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
    /* ZeRO-1 (tm__zero_enabled when the master was made): the master holds bucket elements
     * [master_lo, master_hi) only, and no parameter has a master view of its own */
    int master_sharded;
    int64_t master_lo, master_hi;
    tm_tensor flat[3]; /* 1-D views of the used range: params, grads, master (TM_BUCKET_*) */
    /* ZeRO-2 (tm__zero_level >= 2 when the bucket was made): the full gradient buffer `grads`
     * is transient: its layout (grads.used) is kept, its memory exists only from the first
     * backward of a step (tm__bucket_grads_materialize, G blocks of the ZeRO block, zeroed) to
     * the reduce-scatter of tm_comm_sync_grads or tm_ctx_zero_grad, which give it back. What
     * persists is `gshard`: the reduced gradients of this rank's block (the ZeRO block's
     * elements; the view `flat_gshard` covers bucket elements [gshard_lo, gshard_hi)). */
    int grads_transient;
    size_t grads_acct; /* bytes of the materialized full buffer, as accounted */
    tm__pool gshard;
    int64_t gshard_lo, gshard_hi;
    tm_tensor flat_gshard;
    /* ZeRO-3 (framework/fsdp.c, once the optimizer is made): `params` holds this rank's block
     * [params_lo, params_hi) only, its storage flagged `sharded` so that no op reads it as the
     * parameters; the flat view and the pieces reach it through `params_alias`. */
    int params_sharded;
    int64_t params_lo, params_hi;
    tm__storage params_alias;
    int gsync_done; /* grad_sync.c: the last backward all-reduced it whole (tm_comm_sync_grads skips it) */
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
    int no_grad_buffers;  /* tm_ctx_options.no_grad_buffers: parameters have no gradient (param.c) */
    int plan_only;        /* tm_ctx_options.plan_only: the CPU backend is tm__plan_backend (plan.c) */
    uintptr_t plan_next;  /* plan.c: bytes of placeholders handed out */
    int params_deferred;  /* between tm_ctx_defer_params and tm_ctx_materialize_params */
    int cpu_gemm_builtin; /* tm_ctx_options.cpu_gemm == TM_CPU_GEMM_BUILTIN */
    int gmm_auto;         /* tm_ctx_options.grouped_gemm was TM_GROUPED_GEMM_AUTO (resolved into gmm_device) */
    int gmm_device;       /* tm_ctx_options.grouped_gemm (TM_GROUPED_GEMM_*); tm__gmm_device_schedule: not cuBLASLt */
    char gmm_note[256];   /* tm__gmm_note: why the last bf16 grouped GEMM under TM_GROUPED_GEMM_HOPPER did not
                           * take the Hopper kernel ("" when it did) */
    uint64_t gsw_fused;   /* tm__gsw_fused_launches */
    uint64_t attn_sm90;   /* tm__attn_sm90_launches */
    int attn_sm80;        /* tm__attn_set_sm80: bf16 attention on the sm_80 kernels even on Hopper */
    int gating_split;     /* tm__gating_set_split: moe_gating's split path on CUDA */
    uint64_t gating_split_n; /* tm__gating_split_launches */
    int gmlp_fused;       /* tm__grouped_mlp_set_fused: grouped_mlp's DX_SWIGLU backward on CUDA (off) */
    uint64_t gmlp_fused_n; /* tm__grouped_mlp_fused_launches */
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
    tm_tensor **params; /* the parameters among them, creation order (names.c) */
    int n_params, cap_params;
    int *name_slots; /* hash index of named: position + 1, 0 empty (names.c) */
    int name_cap;
    tm__storage **owned; /* storages of buffers, freed with the context */
    int n_owned, cap_owned;

    tm__node *tape; /* most recent node; linked backwards */

    const tm__backend_ops *be[TM__NBACKENDS]; /* registered backends; be[TM__CUDA] NULL without a device */
    void *state[TM__NBACKENDS];           /* each backend's per-context state (tm__cuda_state) */
    int cuda_device;
    uint64_t sync_count;                  /* device-to-host synchronisations (tm_ctx_sync_count) */
    double sync_seconds;                  /* host time blocked in them (tm_ctx_sync_seconds) */

    /* tm_ctx_zero_grad's count: a ZeRO-3 unit's shard not written since the last one (its
     * unit's grad_epoch, fsdp.c) is overwritten by its reduce-scatter or zeroed before it is read */
    uint64_t grad_epoch;

    int perturb_op; /* tests: op id whose backward sees a scaled upstream grad; -1 off */
    /* tests (tm__test_fresh_hooks): fill fresh gradients with NaN, so that an element a
     * TM__OP_GRAD_WRITES backward leaves unwritten shows; mark every gradient of such an op
     * fresh, even one holding earlier contributions (a deliberately wrong autograd); and the
     * count of fresh gradients handed out */
    int fresh_poison, fresh_force;
    int64_t fresh_count;

    /* Memory reuse within a step (tm__set_mem_reuse): 1 (default) gives blocks back to the
     * arena as soon as nothing can read them (kernel scratch, consumed gradients, saved
     * tensors, staging copies); 0 keeps everything until tm_ctx_arena_reset, as before. */
    int mem_reuse;
    tm__scope_entry *scope_log; /* blocks taken inside open kernel scopes */
    int scope_n, scope_cap, scope_depth;

    tm__mem_stats mem[TM__NBACKENDS];

    struct tm__mirror *mirrors; /* host mirrors (internal.h), newest first, meta memory; reset with the arena */
    struct tm__comm *comm; /* tm_comm_init (framework/comm.h); NULL: one rank */
    struct tm__fsdp *fsdp; /* ZeRO-3's prefetches and reduce-scatters in flight (framework/fsdp.c) */
    int fsdp_keep;         /* ZeRO-3: weights gathered now are kept until their backward (tm__param_keep) */
    int param_unit;        /* the unit of parameters made now (tm_ctx_set_param_unit) */
    int param_unit_end;    /* 1 + the highest unit a parameter was made in (0: none yet) */
    int fsdp_gather_always; /* test hook: ZeRO-3 units of a group of one gathered as any other (fsdp.c) */
    struct tm__side *side; /* other collectives started beside the work, not yet waited for (side.c) */
    struct tm__gsync *gsync; /* grad_sync.c: the armed backward's gradient all-reduce chunks */
    int gsync_armed;         /* tm_comm_sync_grads_in_backward: the next backward synchronises */
    int gsync_broken;        /* 1: an armed backward failed after starting some chunks; 2: a
                              * backward followed an armed one before tm_comm_sync_grads */
    struct tm__segs *segs[TM__NBACKENDS]; /* tm__ctx_segs: the clip's segment list per backend */
};

/* One host mirror (internal.h, "host mirrors"): n i64 values of storage st from element offset. */
typedef struct tm__mirror {
    const tm__storage *st;
    int64_t offset, n;
    const int64_t *vals;
    struct tm__mirror *next;
} tm__mirror;

void tm__arena_reset(tm_ctx *ctx, tm__arena *a);
void tm__arena_release(tm_ctx *ctx, tm__arena *a);
/* Device allocation for the given device (host allocator or cudaMalloc), counted. */
void *tm__dev_alloc(tm_ctx *ctx, tm_device dev, size_t nbytes);
void tm__dev_free(tm_ctx *ctx, tm_device dev, void *p);
tm_status tm__dev_memset0(tm_ctx *ctx, tm_device dev, void *p, size_t nbytes);
/* Place a new parameter t (header filled, storage not yet) in the bucket of its (device,
 * dtype, group); allocates its gradient header (framework/param.c). */
tm_status tm__param_place(tm_ctx *ctx, const char *fn, tm_tensor *t, const tm_param_options *opts);
/* The index of named tensors (names.c): the position in ctx->named of `name`, or -1;
 * room for one more named tensor (call before making it: adding cannot fail); register t
 * (its name is new); free the index (tm_ctx_free). */
int tm__names_find(const tm_ctx *ctx, const char *name);
tm_status tm__names_reserve(tm_ctx *ctx, const char *fn);
void tm__names_add(tm_ctx *ctx, tm_tensor *t);
void tm__names_free(tm_ctx *ctx);
/* Free every bucket's memory (tm_ctx_free). */
void tm__buckets_free(tm_ctx *ctx);
/* Run the forward (backward=0) or backward kernel of a call on its backend (dispatch.c),
 * giving its scratch back to the arena when it returns. */
tm_status tm__run_kernel(tm__call *c, int backward);
/* Give back a call's saved tensors and the dispatcher's contiguous copies of its inputs, once
 * nothing will run its kernels again (dispatch.c). */
void tm__release_call(tm__call *c);
/* A parameter written or filled: the part of its bucket's sharded (ZeRO-1) master weights that
 * this rank holds follows (param.c; a no-op for other parameters). */
tm_status tm__param_master_write(tm_ctx *ctx, const tm_tensor *p, tm_dtype src_dt, const void *src);
tm_status tm__param_master_fill(tm_ctx *ctx, const tm_tensor *p, double value);
/* ZeRO-2 (param.c): give every bucket with a transient gradient buffer that has none its full
 * buffer, zeroed (tm_backward_with_grad, before the tape runs). Errors: TM_ERR_NOMEM,
 * TM_ERR_CUDA. And give bucket bi's full buffer back (after its reduce-scatter, or
 * tm_ctx_zero_grad); no-op when it has none. */
tm_status tm__bucket_grads_materialize(tm_ctx *ctx);
void tm__bucket_grads_release(tm_ctx *ctx, int bi);
/* t = a persistent 1-D view [numel] of dt over st from its first element, no gradient (param.c:
 * the buckets' flat views, ZeRO-3's blocks). */
void tm__flat_view(tm_tensor *t, tm_ctx *ctx, tm__storage *st, tm_dtype dt, int64_t numel);
/* Rebuild bucket bi's flat views (param.c), after its buffers changed. */
void tm__bucket_refresh_views(tm_ctx *ctx, int bi);
/* ZeRO-3: fill a gathered unit's storage again (st->fsdp set, st->data NULL): its all-gather,
 * not taped (autograd.c, before a node that reads it); no-op for a resident unit's block. */
tm_status tm__fsdp_regather(tm_ctx *ctx, tm__storage *st);
/* ZeRO-3: the all-gather node of gathered unit w is done in the backward (autograd.c): its
 * memory goes back, kept from the forward or not (tm__param_keep). */
void tm__fsdp_gather_released(tm_ctx *ctx, tm_tensor *w);
/* ZeRO-3's unit gradients (fsdp.c, from autograd.c). tm__fsdp_grad_alias: input i of c lies on
 * a gathered unit's storage, or a resident unit's block, and needs a gradient: if it is
 * contiguous (and its gradient, if any, is one), its gradient becomes the same elements of the
 * unit's gradient buffer (resident: of the shard), marked fresh (c->gin_fresh) for an op that
 * writes it whole as the parameter's first contribution, else zeroed where not written yet (the
 * shard is zero already); returns 1 then (*st: the status), 0 where the ordinary path applies.
 * tm__fsdp_view_grad_skip: 1 when view node c maps a unit's gradient onto itself (its output's
 * gradient is such elements already), its input's gradient then set: skip its backward. */
int tm__fsdp_grad_alias(tm__call *c, int i, tm_status *st);
int tm__fsdp_view_grad_skip(tm__call *c);
/* 1 when bucket bi is a gathered ZeRO-3 unit: the first reduce-scatter after tm_ctx_zero_grad
 * overwrites its gradient shard whole, so zeroing it there can wait (tm__bucket_grads_settle). */
int tm__fsdp_shard_overwritten(const tm_ctx *ctx, int bi);
/* 1 once tm__zero3_shard_params has sharded a bucket: no bucket may be added after (fsdp.c
 * holds each unit's state by bucket index, and a new one would have no block). */
int tm__fsdp_sharded(const tm_ctx *ctx);
/* ZeRO-3's all-gather op in its parameter form (ops/comm.c, iattr[1] = 1), the end of a
 * backward (autograd.c: the reduce-scatters still in flight are finished, also after an error,
 * and the forward's order forgotten), and the state's reset (tm_ctx_arena_reset: everything
 * started beside the work waited for) and free. */
tm_status tm__fsdp_gather_check(tm__call *c);
tm_status tm__fsdp_gather_forward(tm__call *c);
tm_status tm__fsdp_gather_backward(tm__call *c);
tm_status tm__fsdp_backward_done(tm_ctx *ctx);
void tm__fsdp_reset(tm_ctx *ctx);
void tm__fsdp_free(tm_ctx *ctx);
/* Collectives started beside the work by ops (framework/side.c, whose top comment gives the
 * rules). tm__side_add: the collective behind event ev (tm__coll_side_end; may be NULL: it ran
 * in place) writes `result` (may be NULL) and moves the memory of use[0..n_use) (at most 2);
 * own[0..n_own) (at most 2) are given back once it is done. On failure the event has been
 * waited for. tm__side_wait (extend.h): the work stream waits for the collectives writing t's
 * storage (call before reading t). tm__side_release: the collectives using st are waited for first
 * (tm__tensor_release, the kernel scope's close: st is about to be given back).
 * tm__side_pending: entries not yet finished. tm__side_finish_all: everything waited for (the
 * end of a backward, tm_ctx_arena_reset). tm__side_free: the same, and the list freed. */
tm_status tm__side_add(tm_ctx *ctx, tm_device dev, void *ev, tm_tensor *result, tm_tensor *const *use, int n_use,
                       tm_tensor *const *own, int n_own);
void tm__side_release(tm_ctx *ctx, const tm__storage *st);
int tm__side_pending(const tm_ctx *ctx);
tm_status tm__side_finish_all(tm_ctx *ctx);
void tm__side_free(tm_ctx *ctx);
/* The data-parallel gradient all-reduce during an armed backward (grad_sync.c): _plan at the
 * start of autograd.c's walk of `tape` (every backward: it also clears the buckets' done marks),
 * _progress before each node's backward with the walk's nodes [0, done] finished (INT64_MAX:
 * the walk ended, everything left goes), _end with the backward's status; _disarm forgets an
 * arming and the marks (tm_ctx_zero_grad, tm_comm_sync_grads); _free at tm_ctx_free. */
tm_status tm__gsync_plan(tm_ctx *ctx, const tm__node *tape);
tm_status tm__gsync_progress(tm_ctx *ctx, int64_t done);
void tm__gsync_end(tm_ctx *ctx, tm_status backward);
void tm__gsync_disarm(tm_ctx *ctx);
/* Why the gradients cannot be synchronised (ctx->gsync_broken), or NULL. */
const char *tm__gsync_broken_why(const tm_ctx *ctx);
void tm__gsync_free(tm_ctx *ctx);
/* Take t's block out of the open kernel scope's log (arena.c): the scope's close will not give
 * it back; whoever called this does (a buffer a side collective still uses, side.c). */
void tm__scope_forget(tm_ctx *ctx, const tm_tensor *t);
/* Plan-only contexts (plan.c): the CPU backend that places without memory, and the
 * communicator engine of a world that need not exist. */
extern const tm__backend_ops tm__plan_backend;
/* Free the context's communicator (tm_ctx_free). */
void tm__comm_destroy(tm_ctx *ctx);

#endif
