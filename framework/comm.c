/*
 * comm.c — the communicator of a context (include/tinymoe.h, "Distributed"; framework/comm.h):
 * creation and groups, the engine tables that need no library (self: one rank; mpi-staged: CUDA
 * memory through host buffers and the mpi table), traffic accounting, the host-memory
 * collectives of drivers, and the per-bucket gradient synchronisation (all-reduce, or ZeRO's
 * reduce-scatter and parameter all-gather: in place for ZeRO-1, into the rank's gradient shard
 * for ZeRO-2, whose full gradient buffer is then given back).
 *
 * The one place in framework/ that knows whether the build has MPI or NCCL is the engine
 * registration in tm_comm_init, as backend.c is for CUDA.
 */
#include "comm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

tm_comm_options tm_comm_options_default(void) {
    tm_comm_options o;
    memset(&o, 0, sizeof o);
    o.ep_size = 1;
    o.ep_strategy = TM_EP_ALLTOALL;
    o.zero = 0;
    o.timeout_s = 60.0;
    o.mpi_comm = NULL;
    o.nccl = TM_NCCL_AUTO;
    o.overlap = 1;
    o.comm_sms = 16;
    o.zero3_keep_last = 1;
    o.grad_sync_chunk_bytes = TM__GRAD_SYNC_CHUNK_BYTES;
    return o;
}

tm__comm *tm__ctx_comm(const tm_ctx *ctx) { return ctx ? ctx->comm : NULL; }

void tm__comm_account(tm__comm *c, tm_comm_kind k, size_t bytes, double seconds) {
    if (!c || (unsigned)k >= TM_COMM_NKINDS) return;
    c->stats.calls[k]++;
    if (c->side_active) c->stats.beside[k]++;
    c->stats.bytes[k] += (int64_t)bytes;
    c->stats.seconds[k] += seconds;
}

static const char *const GROUP_NAME[TM_COMM_NGROUPS] = {"world", "dp", "ep", "expert_dp"};

const char *tm__comm_gdesc(tm__comm *c, int g) {
    static _Thread_local char fallback[64];
    char *b = fallback;
    if (c && c->ctx) {
        b = c->ctx->desc[c->ctx->desc_next];
        c->ctx->desc_next = (c->ctx->desc_next + 1) % 8;
    }
    if (!c || g < 0 || g >= TM_COMM_NGROUPS) snprintf(b, 64, "group %d", g);
    else snprintf(b, 128, "%s (rank %d of %d; world rank %d)", GROUP_NAME[g], c->rank[g], c->size[g], c->world_rank);
    return b;
}

const tm__comm_ops *tm__comm_ops_for(tm__comm *c, tm_device dev) {
    return dev.type == TM_DEVICE_CUDA ? c->device : c->host;
}

/* ---- self: a world of one rank; moves memory of any device of the context ------------------ */

static tm_status self_copy(tm__comm *c, void *dst, const void *src, int64_t n, tm_dtype dt, tm_device dev) {
    if (dst == src || n <= 0) return TM_OK;
    return tm__memcpy(c->ctx, dst, dev, src, dev, (size_t)n * tm_dtype_size(dt));
}
static tm_status self_allreduce(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt, tm_device dev) {
    return self_copy(c, recv, send, n, dt, dev);
}
static tm_status self_allgatherv(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                                 const int64_t *displs, tm_dtype dt, tm_device dev) {
    return self_copy(c, (char *)recv + displs[0] * (int64_t)tm_dtype_size(dt), send, counts[0], dt, dev);
}
static tm_status self_reduce_scatter(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt,
                                     tm_device dev) {
    return self_copy(c, recv, send, n, dt, dev);
}
static tm_status self_reduce_scatterv(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                                      tm_dtype dt, tm_device dev) {
    return self_copy(c, recv, send, counts[0], dt, dev);
}
static tm_status self_alltoallv(tm__comm *c, int g, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
                                const int64_t *rc, const int64_t *rd, tm_dtype dt, tm_device dev) {
    size_t es = tm_dtype_size(dt);
    if (sc[0] != rc[0])
        return tm__err(c->ctx, TM_ERR_COMM, "alltoall: one rank sends %lld elements to itself but expects %lld",
                       (long long)sc[0], (long long)rc[0]);
    return self_copy(c, (char *)recv + rd[0] * (int64_t)es, (const char *)send + sd[0] * (int64_t)es, sc[0], dt, dev);
}
static tm_status self_bcast(tm__comm *c, int g, void *buf, int64_t n, tm_dtype dt, int root, tm_device dev) {
    return TM_OK;
}
static tm_status self_barrier(tm__comm *c, int g) { return TM_OK; }

const tm__comm_ops tm__comm_self_ops = {
    "self", self_allreduce, self_allgatherv, self_reduce_scatter, self_reduce_scatterv, self_alltoallv, self_bcast,
    self_barrier, NULL, NULL,
};

/* ---- mpi-staged: CUDA memory through host buffers and the host table ----------------------- */
/* Lets several ranks share one GPU (tests) or run where NCCL is missing. Every call copies its
 * device input to the host (a synchronisation), runs the host collective and copies back. */

/* Host staging from the arena inside a kernel scope: given back when the scope closes. */
static void *stage(tm__comm *c, size_t nbytes) { return tm__arena_alloc(c->ctx, tm_cpu(), nbytes ? nbytes : 1); }

static int64_t sum_counts(const int64_t *counts, const int64_t *displs, int n) {
    int64_t hi = 0;
    for (int j = 0; j < n; j++)
        if (counts[j] > 0 && displs[j] + counts[j] > hi) hi = displs[j] + counts[j];
    return hi;
}

/* One staged call: the device input copied into a host buffer `in` (nin bytes), the host
 * output `out` (nout bytes; `in` itself for an in-place call), then the output copied back to
 * recv by staged_end, which also gives the buffers back whatever the collective returned. */
typedef struct staged {
    int mark;
    void *in, *out;
} staged;

static tm_status staged_begin(tm__comm *c, staged *st, const void *send, size_t nin, size_t nout, int in_place,
                              tm_device dev) {
    st->mark = tm__scope_open(c->ctx);
    st->in = stage(c, nin);
    st->out = in_place ? st->in : stage(c, nout);
    tm_status s = st->in && st->out ? tm__memcpy(c->ctx, st->in, tm_cpu(), send, dev, nin) : TM_ERR_NOMEM;
    if (s) tm__scope_close(c->ctx, st->mark, NULL, 0);
    return s;
}

static tm_status staged_end(tm__comm *c, staged *st, tm_status s, void *recv, size_t nout, tm_device dev) {
    if (!s) s = tm__memcpy(c->ctx, recv, dev, st->out, tm_cpu(), nout);
    tm__scope_close(c->ctx, st->mark, NULL, 0);
    return s;
}

static tm_status staged_allreduce(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt,
                                  tm_device dev) {
    size_t nb = (size_t)n * tm_dtype_size(dt);
    staged st;
    TM__TRY(staged_begin(c, &st, send, nb, nb, 1, dev));
    return staged_end(c, &st, c->host->allreduce(c, g, st.in, st.in, n, dt, tm_cpu()), recv, nb, dev);
}

static tm_status staged_allgatherv(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                                   const int64_t *displs, tm_dtype dt, tm_device dev) {
    size_t es = tm_dtype_size(dt), nin = (size_t)counts[c->rank[g]] * es;
    size_t nout = (size_t)sum_counts(counts, displs, c->size[g]) * es;
    staged st;
    TM__TRY(staged_begin(c, &st, send, nin, nout, 0, dev));
    return staged_end(c, &st, c->host->allgatherv(c, g, st.in, st.out, counts, displs, dt, tm_cpu()), recv, nout,
                      dev);
}

static tm_status staged_reduce_scatter(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt,
                                       tm_device dev) {
    size_t es = tm_dtype_size(dt), nin = (size_t)n * (size_t)c->size[g] * es, nout = (size_t)n * es;
    staged st;
    TM__TRY(staged_begin(c, &st, send, nin, nout, 0, dev));
    return staged_end(c, &st, c->host->reduce_scatter(c, g, st.in, st.out, n, dt, tm_cpu()), recv, nout, dev);
}

static tm_status staged_reduce_scatterv(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                                        tm_dtype dt, tm_device dev) {
    size_t es = tm_dtype_size(dt), nin = 0, nout = (size_t)counts[c->rank[g]] * es;
    for (int j = 0; j < c->size[g]; j++) nin += (size_t)counts[j] * es;
    staged st;
    TM__TRY(staged_begin(c, &st, send, nin, nout, 0, dev));
    return staged_end(c, &st, c->host->reduce_scatterv(c, g, st.in, st.out, counts, dt, tm_cpu()), recv, nout, dev);
}

static tm_status staged_alltoallv(tm__comm *c, int g, const void *send, const int64_t *sc, const int64_t *sd,
                                  void *recv, const int64_t *rc, const int64_t *rd, tm_dtype dt, tm_device dev) {
    size_t es = tm_dtype_size(dt);
    size_t nin = (size_t)sum_counts(sc, sd, c->size[g]) * es, nout = (size_t)sum_counts(rc, rd, c->size[g]) * es;
    staged st;
    TM__TRY(staged_begin(c, &st, send, nin, nout, 0, dev));
    return staged_end(c, &st, c->host->alltoallv(c, g, st.in, sc, sd, st.out, rc, rd, dt, tm_cpu()), recv, nout, dev);
}

static tm_status staged_bcast(tm__comm *c, int g, void *buf, int64_t n, tm_dtype dt, int root, tm_device dev) {
    size_t nb = (size_t)n * tm_dtype_size(dt);
    staged st;
    TM__TRY(staged_begin(c, &st, buf, nb, nb, 1, dev));
    return staged_end(c, &st, c->host->bcast(c, g, st.in, n, dt, root, tm_cpu()), buf, nb, dev);
}

static tm_status staged_barrier(tm__comm *c, int g) { return c->host->barrier(c, g); }

const tm__comm_ops tm__comm_staged_ops = {
    "mpi-staged", staged_allreduce, staged_allgatherv, staged_reduce_scatter, staged_reduce_scatterv, staged_alltoallv,
    staged_bcast,
    staged_barrier, NULL, NULL,
};

/* ---- accounted entry points ---------------------------------------------------------------- */

/* A group of one rank is the self engine's whatever the communicator's engine: NCCL makes no
 * communicator for such a group (ZeRO-3 with ep_size = world size gathers expert weights over
 * expert-data-parallel groups of one), unless asked to check itself on one rank (nccl always). */
static tm_status need_ops(tm_ctx *ctx, tm__comm *c, int g, tm_device dev, const tm__comm_ops **ops) {
    int self = c->size[g] == 1 && c->opts.nccl != TM_NCCL_ALWAYS;
    *ops = self ? &tm__comm_self_ops : tm__comm_ops_for(c, dev);
    if (!*ops)
        return tm__err(ctx, TM_ERR_DEVICE, "collective on %s memory: the communicator has no engine for it",
                       dev.type == TM_DEVICE_CUDA ? "CUDA" : "CPU");
    return TM_OK;
}

/* Without a communicator every group is this one rank. */
static tm__comm *comm_or_self(tm_ctx *ctx, tm__comm *tmp) {
    if (ctx->comm) return ctx->comm;
    memset(tmp, 0, sizeof *tmp);
    tmp->ctx = ctx;
    for (int g = 0; g < TM_COMM_NGROUPS; g++) tmp->size[g] = 1;
    tmp->world_size = 1;
    tmp->host = &tm__comm_self_ops;
    tmp->device = &tm__comm_self_ops;
    return tmp;
}

tm_status tm__coll_allreduce(tm_ctx *ctx, int g, const void *send, void *recv, int64_t n, tm_dtype dt, tm_device dev) {
    tm__comm tmp, *c = comm_or_self(ctx, &tmp);
    const tm__comm_ops *ops;
    TM__TRY(need_ops(ctx, c, g, dev, &ops));
    double t0 = tm__now();
    tm_status s = ops->allreduce(c, g, send, recv, n, dt, dev);
    tm__comm_account(ctx->comm, TM_COMM_ALLREDUCE, (size_t)n * tm_dtype_size(dt), tm__now() - t0);
    return s;
}

tm_status tm__coll_allgatherv(tm_ctx *ctx, int g, const void *send, void *recv, const int64_t *counts,
                              const int64_t *displs, tm_dtype dt, tm_device dev) {
    tm__comm tmp, *c = comm_or_self(ctx, &tmp);
    const tm__comm_ops *ops;
    TM__TRY(need_ops(ctx, c, g, dev, &ops));
    double t0 = tm__now();
    tm_status s = ops->allgatherv(c, g, send, recv, counts, displs, dt, dev);
    tm__comm_account(ctx->comm, TM_COMM_ALLGATHER, (size_t)counts[c->rank[g]] * tm_dtype_size(dt), tm__now() - t0);
    return s;
}

tm_status tm__coll_reduce_scatter(tm_ctx *ctx, int g, const void *send, void *recv, int64_t n, tm_dtype dt,
                                  tm_device dev) {
    tm__comm tmp, *c = comm_or_self(ctx, &tmp);
    const tm__comm_ops *ops;
    TM__TRY(need_ops(ctx, c, g, dev, &ops));
    double t0 = tm__now();
    tm_status s = ops->reduce_scatter(c, g, send, recv, n, dt, dev);
    tm__comm_account(ctx->comm, TM_COMM_REDUCE_SCATTER, (size_t)n * (size_t)c->size[g] * tm_dtype_size(dt),
                     tm__now() - t0);
    return s;
}

tm_status tm__coll_reduce_scatterv(tm_ctx *ctx, int g, const void *send, void *recv, const int64_t *counts,
                                   tm_dtype dt, tm_device dev) {
    tm__comm tmp, *c = comm_or_self(ctx, &tmp);
    const tm__comm_ops *ops;
    TM__TRY(need_ops(ctx, c, g, dev, &ops));
    size_t n = 0;
    for (int j = 0; j < c->size[g]; j++) n += (size_t)counts[j];
    double t0 = tm__now();
    tm_status s = ops->reduce_scatterv(c, g, send, recv, counts, dt, dev);
    tm__comm_account(ctx->comm, TM_COMM_REDUCE_SCATTER, n * tm_dtype_size(dt), tm__now() - t0);
    return s;
}

/* ---- collectives beside the work (comm.h) ---------------------------------------------------- */

int tm__coll_side_on(const tm_ctx *ctx, tm_device dev) {
    const tm__backend_ops *be = tm__ctx_backend(ctx, dev);
    /* host memory: its collectives block, the CPU backend's side stream is the work itself
     * (kernels/cpu/backend.c), and the bookkeeping runs as on a GPU */
    return ctx->comm && ctx->comm->opts.overlap && be && be->side_begin &&
           (dev.type == TM_DEVICE_CPU || ctx->comm->device_async);
}

int tm__coll_spare_sms(const tm_ctx *ctx) {
    return ctx->comm && ctx->comm->opts.overlap && ctx->comm->device_async ? ctx->comm->opts.comm_sms : 0;
}

int tm__coll_side_group(const tm_ctx *ctx, int g, tm_device dev) {
    if (!tm__coll_side_on(ctx, dev) || (unsigned)g >= TM_COMM_NGROUPS) return 0;
    const tm__comm *c = ctx->comm;
    /* host memory needs no communicator of its own; a device engine needs the group's second
     * one (two streams never share a communicator) */
    return dev.type == TM_DEVICE_CPU || c->size[g] < 2 || (c->side_groups >> g & 1u);
}

tm_status tm__coll_side_prepare(tm_ctx *ctx, int g, tm_device dev) {
    tm__comm *c = ctx ? ctx->comm : NULL;
    if (!c || !c->opts.overlap || dev.type == TM_DEVICE_CPU || (unsigned)g >= TM_COMM_NGROUPS || c->size[g] < 2 ||
        (c->side_groups >> g & 1u))
        return TM_OK;
    const tm__comm_ops *ops = tm__comm_ops_for(c, dev);
    if (!ops || !ops->side_group) return TM_OK; /* an engine that blocks: the collectives run in place */
    TM__TRY(ops->side_group(c, g));
    c->side_groups |= 1u << g;
    c->device_async = 1;
    return TM_OK;
}

tm_status tm__comm_side_prepare(tm_ctx *ctx, tm_comm_group g, tm_device dev) {
    return tm__coll_side_prepare(ctx, (int)g, dev);
}

tm_status tm__coll_side_begin(tm_ctx *ctx, tm_device dev) {
    if (!tm__coll_side_on(ctx, dev)) return TM_OK;
    TM__TRY(tm__ctx_backend(ctx, dev)->side_begin(ctx));
    ctx->comm->side_active = 1;
    return TM_OK;
}

tm_status tm__coll_side_end(tm_ctx *ctx, tm_device dev, void **event) {
    *event = NULL;
    if (!tm__coll_side_on(ctx, dev)) return TM_OK;
    ctx->comm->side_active = 0;
    return tm__ctx_backend(ctx, dev)->side_end(ctx, event);
}

tm_status tm__coll_side_end_background(tm_ctx *ctx, tm_device dev, void **event) {
    if (ctx->comm) ctx->comm->side_background = 1;
    tm_status s = tm__coll_side_end(ctx, dev, event);
    if (ctx->comm) ctx->comm->side_background = 0;
    return s;
}

int tm__coll_side_background(const tm_ctx *ctx) { return ctx && ctx->comm && ctx->comm->side_background; }

tm_status tm__coll_event_wait(tm_ctx *ctx, tm_device dev, void *event) {
    if (!event) return TM_OK;
    const tm__backend_ops *be = tm__ctx_backend(ctx, dev);
    tm_status s = be->event_wait(ctx, event);
    be->event_free(ctx, event);
    return s;
}

int tm__coll_event_done(tm_ctx *ctx, tm_device dev, void *event) {
    return !event || tm__ctx_backend(ctx, dev)->event_query(ctx, event);
}

tm_status tm__coll_alltoallv(tm_ctx *ctx, int g, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
                             const int64_t *rc, const int64_t *rd, tm_dtype dt, tm_device dev) {
    tm__comm tmp, *c = comm_or_self(ctx, &tmp);
    const tm__comm_ops *ops;
    TM__TRY(need_ops(ctx, c, g, dev, &ops));
    int64_t sent = 0;
    for (int j = 0; j < c->size[g]; j++)
        if (j != c->rank[g]) sent += sc[j];
    double t0 = tm__now();
    tm_status s = ops->alltoallv(c, g, send, sc, sd, recv, rc, rd, dt, dev);
    tm__comm_account(ctx->comm, TM_COMM_ALLTOALL, (size_t)sent * tm_dtype_size(dt), tm__now() - t0);
    return s;
}

/* ---- creation and queries ---------------------------------------------------------------- */

int tm_mpi_available(void) {
#ifdef TM_HAVE_MPI
    return 1;
#else
    return 0;
#endif
}

#ifndef TM_HAVE_MPI
/* Without MPI every process is a world of one; started by mpirun as several ranks, refuse
 * rather than let N independent copies train side by side. */
tm_status tm_mpi_init(int *argc, char ***argv, int *world_size) {
    if (world_size) *world_size = 1;
    const char *v = getenv("OMPI_COMM_WORLD_SIZE");
    if (!v) v = getenv("PMI_SIZE");
    if (v && atoi(v) > 1) return TM_ERR_UNSUPPORTED;
    return TM_OK;
}
void tm_mpi_finalize(void) {}
void tm_mpi_abort(int code) {}
int tm_mpi_world_rank(void) { return 0; }
int tm_mpi_world_size(void) { return 1; }
#endif

static void comm_free(tm__comm *c) {
    if (!c) return;
    if (c->device && c->device->free) c->device->free(c);
    if (c->host && c->host->free) c->host->free(c);
}

void tm__comm_destroy(tm_ctx *ctx) {
    if (!ctx || !ctx->comm) return;
    comm_free(ctx->comm);
    tm__host_free(ctx, ctx->comm);
    ctx->comm = NULL;
}

tm_status tm_comm_init(tm_ctx *ctx, const tm_comm_options *opts) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    static const char fn[] = "tm_comm_init";
    tm_comm_options o = opts ? *opts : tm_comm_options_default();
    if (ctx->comm) return tm__err(ctx, TM_ERR_STATE, "%s: the context has a communicator already", fn);
    if (ctx->n_params)
        return tm__err(ctx, TM_ERR_STATE, "%s: the context has %d parameters already; attach the communicator first "
                       "(expert weights are sized by the layout)", fn, ctx->n_params);
    if (o.ep_size < 1) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: ep_size = %d must be >= 1", fn, o.ep_size);
    if (o.zero < 0 || o.zero > 3)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: zero = %d must be 0, 1, 2 or 3", fn, o.zero);
    if (o.ep_strategy != TM_EP_ALLTOALL && o.ep_strategy != TM_EP_ALLGATHER && o.ep_strategy != TM_EP_ALLTOALL_DEDUP)
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "%s: ep_strategy = %d is none of alltoall (0), allgather (1), alltoall_dedup (2)", fn,
                       (int)o.ep_strategy);
    if (o.comm_sms < 0 || o.comm_sms > 64)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: comm_sms = %d must be in [0, 64]", fn, o.comm_sms);
    if (o.zero3_keep_last < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: zero3_keep_last = %d must be >= 0 (layers)", fn, o.zero3_keep_last);
    if (o.grad_sync_chunk_bytes < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: grad_sync_chunk_bytes = %lld must be >= 0 (0: the default, %d MiB)",
                       fn, (long long)o.grad_sync_chunk_bytes, TM__GRAD_SYNC_CHUNK_BYTES >> 20);
    if (isnan(o.timeout_s)) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: timeout_s is NaN", fn);
    if (o.nccl != TM_NCCL_AUTO && o.nccl != TM_NCCL_OFF && o.nccl != TM_NCCL_ALWAYS)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: nccl = %d is none of TM_NCCL_AUTO (0), TM_NCCL_OFF (1), TM_NCCL_ALWAYS (2)",
                       fn, o.nccl);
    if (o.plan_world_size < 0 || (o.plan_world_size > 0 && !ctx->plan_only))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: plan_world_size = %d: %s", fn, o.plan_world_size,
                       o.plan_world_size < 0 ? "must be >= 0"
                                             : "only a plan-only context (tm_ctx_options.plan_only) lays out a world "
                                               "other than its own");
    int plan_w = o.plan_world_size ? o.plan_world_size : 1;
    if (ctx->plan_only && (o.plan_rank < 0 || o.plan_rank >= plan_w))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: plan_rank = %d outside the %d rank%s of plan_world_size", fn,
                       o.plan_rank, plan_w, plan_w > 1 ? "s" : "");
    tm__comm *c = tm__host_alloc(ctx, sizeof *c);
    if (!c) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    memset(c, 0, sizeof *c);
    c->ctx = ctx;
    c->opts = o;
    c->world_size = 1;
    for (int g = 0; g < TM_COMM_NGROUPS; g++) c->size[g] = 1;
    c->host = &tm__comm_self_ops;
    tm_status s = TM_OK;
    if (ctx->plan_only) {
        /* a world laid out, not joined (plan.c): no MPI, no NCCL */
        c->host = &tm__comm_plan_ops;
        c->world_size = plan_w;
        c->world_rank = o.plan_rank;
    }
#ifdef TM_HAVE_MPI
    if (!ctx->plan_only) s = tm__mpi_comm_create(c, o.mpi_comm);
    if (ctx->plan_only) s = TM_OK;
    else if (s == TM_OK) c->host = &tm__comm_mpi_ops;
    else if (s == TM_ERR_STATE && !o.mpi_comm) s = TM_OK; /* MPI not initialised: one rank */
#else
    if (o.mpi_comm && !ctx->plan_only)
        s = tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: mpi_comm given but this build has no MPI (MPI=0)", fn);
#endif
    if (s == TM_OK && c->world_size % o.ep_size)
        s = tm__err(ctx, TM_ERR_INVALID_ARG, "%s: ep_size = %d does not divide the world size %d", fn, o.ep_size,
                    c->world_size);
    if (s == TM_OK) {
        int P = o.ep_size, r = c->world_rank, N = c->world_size;
        c->rank[TM_COMM_WORLD] = c->rank[TM_COMM_DP] = r;
        c->size[TM_COMM_WORLD] = c->size[TM_COMM_DP] = N;
        c->rank[TM_COMM_EP] = r % P;
        c->size[TM_COMM_EP] = P;
        c->rank[TM_COMM_EXPERT_DP] = r / P;
        c->size[TM_COMM_EXPERT_DP] = N / P;
    }
    if (s == TM_OK && ctx->cuda_device >= 0) {
        c->device = c->world_size == 1 ? &tm__comm_self_ops : &tm__comm_staged_ops;
#ifdef TM_HAVE_NCCL
        /* NCCL unless ranks share a GPU (TM_ERR_UNSUPPORTED: host staging) or opts.nccl is
         * TM_NCCL_OFF; TM_NCCL_ALWAYS uses it for one rank too (the GPU machine's one-GPU check
         * of the NCCL path). */
        int force = o.nccl == TM_NCCL_ALWAYS, off = o.nccl == TM_NCCL_OFF;
        if (((c->world_size > 1 && c->host == &tm__comm_mpi_ops) || force) && !off) {
            tm_status ns = tm__nccl_comm_create(c);
            if (ns == TM_OK) c->device = &tm__comm_nccl_ops;
            else if (ns != TM_ERR_UNSUPPORTED) s = ns;
        }
#endif
    }
    if (s != TM_OK) {
        comm_free(c);
        tm__host_free(ctx, c);
        return s;
    }
    ctx->comm = c;
    return TM_OK;
}

int tm_comm_rank(const tm_ctx *ctx, tm_comm_group g) {
    if (!ctx || !ctx->comm || (unsigned)g >= TM_COMM_NGROUPS) return 0;
    return ctx->comm->rank[g];
}

int tm_comm_size(const tm_ctx *ctx, tm_comm_group g) {
    if (!ctx || !ctx->comm || (unsigned)g >= TM_COMM_NGROUPS) return 1;
    return ctx->comm->size[g];
}

tm_comm_options tm_comm_get_options(const tm_ctx *ctx) {
    tm_comm_options o = ctx && ctx->comm ? ctx->comm->opts : tm_comm_options_default();
    o.mpi_comm = NULL;
    return o;
}

const char *tm_comm_engine(const tm_ctx *ctx, tm_device dev) {
    if (!ctx || !ctx->comm) return "self";
    const tm__comm_ops *ops = tm__comm_ops_for(ctx->comm, dev);
    return ops ? ops->name : "none";
}

tm_status tm_comm_get_stats(const tm_ctx *ctx, tm_comm_stats *out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err((tm_ctx *)ctx, TM_ERR_INVALID_ARG, "tm_comm_get_stats: out is NULL");
    if (ctx->comm) *out = ctx->comm->stats;
    else memset(out, 0, sizeof *out);
    return TM_OK;
}

void tm_comm_reset_stats(tm_ctx *ctx) {
    if (ctx && ctx->comm) memset(&ctx->comm->stats, 0, sizeof ctx->comm->stats);
}

const char *tm_ep_strategy_name(tm_ep_strategy s) {
    static const char *const names[3] = {"alltoall", "allgather", "alltoall_dedup"};
    return (unsigned)s < 3 ? names[s] : "?";
}

const char *tm_comm_kind_name(tm_comm_kind k) {
    static const char *const names[TM_COMM_NKINDS] = {"allreduce", "allgather", "reduce_scatter", "alltoall", "other"};
    return (unsigned)k < TM_COMM_NKINDS ? names[k] : "?";
}

/* ---- host-memory collectives ---------------------------------------------------------------- */

static tm_status check_group(tm_ctx *ctx, const char *fn, tm_comm_group g) {
    if ((unsigned)g >= TM_COMM_NGROUPS)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: group %d is not a tm_comm_group", fn, (int)g);
    return TM_OK;
}

tm_status tm_comm_allreduce_host(tm_ctx *ctx, tm_comm_group g, tm_dtype dt, void *buf, int64_t n) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    static const char fn[] = "tm_comm_allreduce_host";
    TM__TRY(check_group(ctx, fn, g));
    if (!buf || n < 0) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s", fn, buf ? "n < 0" : "buf is NULL");
    if (dt != TM_F64 && dt != TM_I64)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: dtype %s is neither f64 nor i64", fn, tm_dtype_name(dt));
    if (!ctx->comm || ctx->comm->size[g] == 1 || n == 0) return TM_OK;
    return tm__coll_allreduce(ctx, g, buf, buf, n, dt, tm_cpu());
}

tm_status tm_comm_allgather_host(tm_ctx *ctx, tm_comm_group g, const void *in, void *out, size_t nbytes) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    static const char fn[] = "tm_comm_allgather_host";
    TM__TRY(check_group(ctx, fn, g));
    if (!in || !out) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s is NULL", fn, in ? "out" : "in");
    int G = tm_comm_size(ctx, g);
    int64_t *cd = tm__meta_alloc(ctx, sizeof(int64_t) * 2 * (size_t)G);
    if (!cd) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    for (int j = 0; j < G; j++) {
        cd[j] = (int64_t)nbytes;
        cd[G + j] = (int64_t)nbytes * j;
    }
    return tm__coll_allgatherv(ctx, g, in, out, cd, cd + G, TM_U8, tm_cpu());
}

tm_status tm_comm_bcast_host(tm_ctx *ctx, tm_comm_group g, int root, void *buf, size_t nbytes) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    static const char fn[] = "tm_comm_bcast_host";
    TM__TRY(check_group(ctx, fn, g));
    if (!buf && nbytes) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: buf is NULL", fn);
    if (root < 0 || root >= tm_comm_size(ctx, g))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: root %d outside the group's %d ranks", fn, root, tm_comm_size(ctx, g));
    if (!ctx->comm || ctx->comm->size[g] == 1) return TM_OK;
    double t0 = tm__now();
    tm_status s = ctx->comm->host->bcast(ctx->comm, g, buf, (int64_t)nbytes, TM_U8, root, tm_cpu());
    tm__comm_account(ctx->comm, TM_COMM_OTHER, nbytes, tm__now() - t0);
    return s;
}

tm_status tm_comm_barrier(tm_ctx *ctx, tm_comm_group g) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    TM__TRY(check_group(ctx, "tm_comm_barrier", g));
    if (!ctx->comm || ctx->comm->size[g] == 1) return TM_OK;
    double t0 = tm__now();
    tm_status s = ctx->comm->host->barrier(ctx->comm, g);
    tm__comm_account(ctx->comm, TM_COMM_OTHER, 0, tm__now() - t0);
    return s;
}

/* ---- gradient synchronisation and ZeRO ranges ----------------------------------------------- */

int tm__bucket_comm_group(const tm_ctx *ctx, int bi) {
    return ctx->buckets[bi]->info.group == TM_PARAM_EXPERT ? TM_COMM_EXPERT_DP : TM_COMM_DP;
}

int tm__zero_level(const tm_ctx *ctx) { return ctx && ctx->comm ? ctx->comm->opts.zero : 0; }

int tm__zero_enabled(const tm_ctx *ctx) { return tm__zero_level(ctx) >= 1; }

/* Elements per rank of a bucket under ZeRO: the bucket split in G equal blocks, each a
 * multiple of 64 elements (so every block starts 64-byte aligned for any dtype). */
int64_t tm__zero_block(const tm_ctx *ctx, int bi) {
    int G = tm_comm_size(ctx, tm__bucket_comm_group(ctx, bi));
    int64_t n = ctx->buckets[bi]->info.numel, blk = (n + G - 1) / G;
    return (blk + 63) / 64 * 64;
}

tm_status tm_ctx_grad_shard(const tm_ctx *ctx, int i, int64_t *lo, int64_t *hi) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!lo || !hi || i < 0 || i >= ctx->n_buckets)
        return tm__err((tm_ctx *)ctx, TM_ERR_INVALID_ARG, "tm_ctx_grad_shard: %s",
                       lo && hi ? "bucket index out of range" : "lo or hi is NULL");
    int64_t n = ctx->buckets[i]->info.numel;
    if (!tm__zero_enabled(ctx)) {
        *lo = 0;
        *hi = n;
        return TM_OK;
    }
    int64_t blk = tm__zero_block(ctx, i);
    int r = tm_comm_rank(ctx, tm__bucket_comm_group(ctx, i));
    int64_t a = blk * r, b = a + blk;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
    return TM_OK;
}

/* ZeRO-2: the bucket's full gradients (G blocks) reduce-scattered into this rank's shard, then
 * the full buffer given back (param.c: it is made again, zeroed, by the next backward). A group
 * of one rank copies its block. */
static tm_status sync_into_shard(tm_ctx *ctx, int i) {
    tm__bucket *b = ctx->buckets[i];
    TM__TRY(tm__bucket_grad_shard_ensure(ctx, i));
    if (b->info.numel == 0) return TM_OK;
    if (!b->grads.st.data)
        return tm__err(ctx, TM_ERR_STATE, "tm_comm_sync_grads: bucket %d (\"%s\", ...) has no gradients to reduce "
                       "(ZeRO-2 gives its full gradient buffer back after each synchronisation; run a backward first)",
                       i, tm__bucket_first_param(ctx, i));
    int g = tm__bucket_comm_group(ctx, i), G = ctx->comm->size[g];
    int64_t blk = tm__zero_block(ctx, i);
    TM__TRY(tm__bucket_reserve(ctx, i, blk * G)); /* the parameters' all-gather after the step */
    tm_dtype dt = b->info.dtype;
    tm_device dev = b->info.device;
    if (G == 1) TM__TRY(tm__memcpy(ctx, b->gshard.st.data, dev, b->grads.st.data, dev, (size_t)blk * tm_dtype_size(dt)));
    else TM__TRY(tm__coll_reduce_scatter(ctx, g, b->grads.st.data, b->gshard.st.data, blk, dt, dev));
    tm__bucket_grads_release(ctx, i);
    return TM_OK;
}

tm_status tm_comm_sync_grads(tm_ctx *ctx) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!ctx->comm) return TM_OK;
    if (ctx->gsync_broken)
        return tm__err(ctx, TM_ERR_STATE, "tm_comm_sync_grads: %s; zero the gradients (tm_ctx_zero_grad) and redo the "
                       "step", tm__gsync_broken_why(ctx));
    ctx->gsync_armed = 0; /* an arming with no backward since must not reach the next step's first backward */
    for (int i = 0; i < ctx->n_buckets; i++) {
        tm__bucket *b = ctx->buckets[i];
        if (b->params_sharded) continue; /* ZeRO-3: the gathers' backward reduce-scattered already */
        if (b->gsync_done) { /* all-reduced by the armed backward (grad_sync.c) */
            b->gsync_done = 0;
            continue;
        }
        if (tm__zero_level(ctx) >= 2) {
            TM__TRY(sync_into_shard(ctx, i));
            continue;
        }
        int g = tm__bucket_comm_group(ctx, i);
        if (ctx->comm->size[g] == 1 || b->info.numel == 0) continue;
        tm_dtype dt = b->info.dtype;
        tm_device dev = b->info.device;
        if (!tm__zero_enabled(ctx)) {
            TM__TRY(tm__coll_allreduce(ctx, g, b->grads.st.data, b->grads.st.data, b->info.numel, dt, dev));
            continue;
        }
        /* In place: the block of this rank receives the sums (the buffers hold G blocks). */
        int64_t blk = tm__zero_block(ctx, i);
        TM__TRY(tm__bucket_reserve(ctx, i, blk * ctx->comm->size[g]));
        char *base = b->grads.st.data;
        TM__TRY(tm__coll_reduce_scatter(ctx, g, base, base + (size_t)blk * ctx->comm->rank[g] * tm_dtype_size(dt), blk,
                                        dt, dev));
    }
    return TM_OK;
}

tm_status tm__zero_gather_params(tm_ctx *ctx) {
    if (!tm__zero_enabled(ctx)) return TM_OK;
    for (int i = 0; i < ctx->n_buckets; i++) {
        tm__bucket *b = ctx->buckets[i];
        int g = tm__bucket_comm_group(ctx, i), G = ctx->comm->size[g];
        if (G == 1 || b->info.numel == 0 || b->params_sharded) continue; /* ZeRO-3 keeps the block */
        int64_t blk = tm__zero_block(ctx, i);
        TM__TRY(tm__bucket_reserve(ctx, i, blk * G));
        int64_t *cd = tm__meta_alloc(ctx, sizeof(int64_t) * 2 * (size_t)G);
        if (!cd) return tm__err(ctx, TM_ERR_NOMEM, "ZeRO parameter all-gather: out of host memory");
        for (int j = 0; j < G; j++) {
            cd[j] = blk;
            cd[G + j] = blk * j;
        }
        char *base = b->params.st.data;
        size_t es = tm_dtype_size(b->info.dtype);
        TM__TRY(tm__coll_allgatherv(ctx, g, base + (size_t)blk * ctx->comm->rank[g] * es, base, cd, cd + G,
                                    b->info.dtype, b->info.device));
    }
    return TM_OK;
}

/* ---- the bucket side of a step, planned (tm_model_plan_step) --------------------------------- */

int tm__ctx_plan_only(const tm_ctx *ctx) { return ctx && ctx->plan_only; }

static int64_t stats_bytes(const tm_ctx *ctx) {
    int64_t n = 0;
    if (ctx->comm)
        for (int k = 0; k < TM_COMM_NKINDS; k++) n += ctx->comm->stats.bytes[k];
    return n;
}

static int64_t grad_bytes(const tm_ctx *ctx) {
    int64_t n = 0;
    for (int b = 0; b < TM__NBACKENDS; b++) n += (int64_t)ctx->mem[b].current[TM_MEM_GRADIENTS];
    return n;
}

/* The calls a training step makes on the buckets, in its order (autograd.c's first backward,
 * the driver's tm_comm_sync_grads, tm_optimizer_step's all-gather), so that what they count is
 * what a run counts. */
tm_status tm__zero_plan_step(tm_ctx *ctx, int64_t *grad_sync, int64_t *param_gather, int64_t *transient) {
    int64_t g0 = grad_bytes(ctx);
    TM__TRY(tm__bucket_grads_materialize(ctx));
    *transient = grad_bytes(ctx) - g0;
    int64_t b0 = stats_bytes(ctx);
    TM__TRY(tm_comm_sync_grads(ctx));
    int64_t b1 = stats_bytes(ctx);
    TM__TRY(tm__zero_gather_params(ctx));
    *grad_sync = b1 - b0;
    *param_gather = stats_bytes(ctx) - b1;
    return TM_OK;
}
