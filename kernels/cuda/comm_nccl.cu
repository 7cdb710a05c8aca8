/*
 * nccl.cu — the nccl engine (framework/comm.h): collectives on CUDA memory through NCCL, for
 * builds with CUDA, MPI and NCCL (Makefile NCCL=1). No kernels: host code that enqueues NCCL
 * calls on the context's stream (CUDA C++ only to reach the stream in common.cuh).
 *
 * Layout: (N ranks, one per GPU)
 *   one ncclComm_t per group of more than one rank (world, dp, ep, expert_dp), made with
 *   ncclCommInitRank; group rank 0 draws the unique id and the mpi engine broadcasts it over
 *   the group. The context's device is the rank's GPU (the driver picks local rank % GPUs).
 *   Ranks that share a GPU cannot share an NCCL communicator: tm__nccl_comm_create then
 *   answers TM_ERR_UNSUPPORTED and tm_comm_init uses the host-staged mpi engine instead.
 * Calls (stream-ordered, like every kernel of the context):
 *   allreduce       ncclAllReduce (sum)
 *   allgatherv      ncclAllGather when the counts are equal and packed, else one
 *                   ncclBroadcast per rank in an ncclGroupStart/End group
 *   reduce_scatter  ncclReduceScatter (sum; in place when recv = send + rank n)
 *   reduce_scatterv ncclReduceScatter when the counts are equal, else one ncclReduce to each
 *                   block's rank in a group
 *   alltoallv       ncclSend / ncclRecv pairs in one group (the ragged all-to-all), the
 *                   rank's rows to itself among them
 *   bcast           ncclBroadcast; barrier: the mpi engine's
 * Side stream (backend.h, side_begin; framework/comm.h): while it is on, the calls go to the
 * context's side stream through a second communicator per group (made at creation when the
 * options will use it: overlap under ZeRO-3; c->device_async; or for one group when a layer
 * asks, collectively: the ep group of a chunked MoE layer, nccl_side_group), so collectives beside the work
 * never share a communicator with those on the work stream.
 * Timeout: the calls stay asynchronous (the host never waits for a collective by itself);
 * with timeout_s > 0 the next wait of the host for the stream (a device-to-host copy,
 * tm_ctx_sync) polls it and NCCL's error state, and past the timeout or on an asynchronous
 * NCCL error aborts the communicators (ncclCommAbort) and fails with TM_ERR_COMM (finish and
 * pending_wait below). Determinism: NCCL's reductions follow a fixed order for a given communicator
 * and size (ring or tree chosen once per size), so a run repeats bit for bit on the same
 * machine and NCCL version.
 */
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.cuh"

extern "C" {
#include "comm.h"
}

typedef struct nccl_state {
    ncclComm_t comm[TM_COMM_NGROUPS]; /* NULL for groups of one rank */
    /* The same groups for collectives on the side stream (backend.h, side_begin), made with
     * `comm` when the options use the side stream (overlap under ZeRO-3; the ep group's alone
     * when a chunked MoE layer asks: nccl_side_group): two streams never
     * share a communicator, so a side collective and one on the work stream cannot wait for
     * each other's kernels. */
    ncclComm_t side[TM_COMM_NGROUPS];
    const char *last_what;            /* the last collective enqueued, for a timeout's message */
    int last_group;
    size_t last_bytes;
} nccl_state;

static tm_status nccl_fail(tm__comm *c, const char *what, int g, ncclResult_t r) {
    return tm__err(c->ctx, TM_ERR_COMM, "%s over %s failed: NCCL %s (%d)", what, tm__comm_gdesc(c, g),
                   ncclGetErrorString(r), (int)r);
}

#define NCCL_TRY(c, what, g, call)                    \
    do {                                              \
        ncclResult_t r_ = (call);                     \
        if (r_ != ncclSuccess) return nccl_fail((c), (what), (g), r_); \
    } while (0)

static int nccl_type(tm_dtype dt, ncclDataType_t *t) {
    switch (dt) {
    case TM_F32: *t = ncclFloat32; return 1;
    case TM_BF16: *t = ncclBfloat16; return 1;
    case TM_F64: *t = ncclFloat64; return 1;
    case TM_I32: *t = ncclInt32; return 1;
    case TM_I64: *t = ncclInt64; return 1;
    case TM_U8: *t = ncclUint8; return 1;
    default: return 0;
    }
}

static int side_on(tm__comm *c) {
    tm__cuda *cu = (tm__cuda *)tm__cuda_state(c->ctx);
    return cu && cu->side_on;
}

static ncclComm_t gcomm(tm__comm *c, int g) {
    nccl_state *ns = (nccl_state *)c->nccl;
    return side_on(c) ? ns->side[g] : ns->comm[g];
}

/* Enter the context's device; the stream of its work, or the side stream while it is on. */
static tm_status enter(tm__comm *c, const char *what, cudaStream_t *stream) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, what, &st));
    *stream = st->side_on ? st->side : st->stream;
    return TM_OK;
}

/* With a timeout, a collective does not wait: it records what it was and leaves its wait to
 * the next point where the host waits for the stream anyway (a device-to-host copy, tm_ctx_sync:
 * device.cu calls pending_wait through tm__cuda.comm_wait). There the host polls the stream and
 * NCCL's asynchronous error state; past the timeout, or on an NCCL error, it aborts every
 * communicator (ncclCommAbort unblocks the kernels waiting for a dead peer) and fails. Waiting
 * after every collective instead (as this engine once did) drained the GPU's queue at each
 * all-to-all of each MoE layer: the next kernels were launched only after the collective ended. */
static tm_status pending_wait(tm_ctx *ctx, const char *what) {
    tm__comm *c = tm__ctx_comm(ctx);
    tm__cuda *st = (tm__cuda *)tm__cuda_state(ctx);
    nccl_state *ns = c ? (nccl_state *)c->nccl : NULL;
    if (!st || !ns) return TM_OK;
    double timeout = c->opts.timeout_s, t0 = tm__now();
    for (long polls = 0;; polls++) {
        cudaError_t e = cudaStreamQuery(st->stream);
        if (e == cudaSuccess) return TM_OK;
        if (e != cudaErrorNotReady) {
            (void)cudaGetLastError();
            return tm__err(ctx, TM_ERR_CUDA, "%s: waiting for the device after %s over %s: %s", what, ns->last_what,
                           tm__comm_gdesc(c, ns->last_group), cudaGetErrorString(e));
        }
        ncclResult_t async = ncclSuccess;
        int bad = -1;
        for (int g = 0; g < TM_COMM_NGROUPS && bad < 0; g++) {
            if (ns->comm[g]) ncclCommGetAsyncError(ns->comm[g], &async);
            if (async == ncclSuccess && ns->side[g]) ncclCommGetAsyncError(ns->side[g], &async);
            if (async != ncclSuccess) bad = g;
        }
        double waited = tm__now() - t0;
        if (bad >= 0 || waited > timeout) {
            for (int g = 0; g < TM_COMM_NGROUPS; g++) {
                if (ns->comm[g]) ncclCommAbort(ns->comm[g]);
                if (ns->side[g]) ncclCommAbort(ns->side[g]);
                ns->comm[g] = ns->side[g] = NULL;
            }
            if (bad >= 0)
                return tm__err(ctx, TM_ERR_COMM, "%s: NCCL failed over %s: %s (%d); the communicators were aborted",
                               what, tm__comm_gdesc(c, bad), ncclGetErrorString(async), (int)async);
            return tm__err(ctx, TM_ERR_COMM,
                           "%s: the device did not finish within %g s with collectives in flight (the last: %s of "
                           "%zu bytes over %s): a rank died, stopped answering, or left the collective sequence (the "
                           "NCCL communicators were aborted)",
                           what, timeout, ns->last_what, ns->last_bytes, tm__comm_gdesc(c, ns->last_group));
        }
        /* spin the first ~2 ms (a step's wait is usually shorter), then poll every 20 us */
        if (polls > 2000) {
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    }
}

static tm_status finish(tm__comm *c, const char *what, int g, cudaStream_t stream, size_t bytes) {
    (void)stream;
    if (!(c->opts.timeout_s > 0)) return TM_OK;
    nccl_state *ns = (nccl_state *)c->nccl;
    tm__cuda *st = (tm__cuda *)tm__cuda_state(c->ctx);
    ns->last_what = what;
    ns->last_group = g;
    ns->last_bytes = bytes;
    if (st) st->comm_wait = pending_wait;
    return TM_OK;
}

static tm_status start(tm__comm *c, const char *what, int g, tm_dtype dt, ncclDataType_t *t, cudaStream_t *stream) {
    if (!gcomm(c, g)) return tm__err(c->ctx, TM_ERR_COMM, "%s over %s: no NCCL communicator (aborted earlier?)", what,
                                     tm__comm_gdesc(c, g));
    if (!nccl_type(dt, t))
        return tm__err(c->ctx, TM_ERR_DTYPE, "%s over %s: NCCL has no type for %s", what, tm__comm_gdesc(c, g),
                       tm_dtype_name(dt));
    return enter(c, what, stream);
}

static tm_status nccl_allreduce(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt,
                                tm_device dev) {
    ncclDataType_t t;
    cudaStream_t s;
    TM__TRY(start(c, "allreduce", g, dt, &t, &s));
    NCCL_TRY(c, "allreduce", g, ncclAllReduce(send, recv, (size_t)n, t, ncclSum, gcomm(c, g), s));
    return finish(c, "allreduce", g, s, (size_t)n * tm_dtype_size(dt));
}

static tm_status nccl_allgatherv(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                                 const int64_t *displs, tm_dtype dt, tm_device dev) {
    ncclDataType_t t;
    cudaStream_t s;
    TM__TRY(start(c, "allgather", g, dt, &t, &s));
    int G = c->size[g], me = c->rank[g], packed = 1;
    size_t es = tm_dtype_size(dt);
    for (int j = 0; j < G; j++) packed &= counts[j] == counts[0] && displs[j] == counts[0] * j;
    if (packed) {
        NCCL_TRY(c, "allgather", g, ncclAllGather(send, recv, (size_t)counts[0], t, gcomm(c, g), s));
    } else {
        NCCL_TRY(c, "allgather", g, ncclGroupStart());
        for (int j = 0; j < G; j++) {
            if (!counts[j]) continue;
            ncclResult_t r = ncclBroadcast(j == me ? send : NULL, (char *)recv + displs[j] * (int64_t)es,
                                           (size_t)counts[j], t, j, gcomm(c, g), s);
            if (r != ncclSuccess) {
                ncclGroupEnd();
                return nccl_fail(c, "allgather", g, r);
            }
        }
        NCCL_TRY(c, "allgather", g, ncclGroupEnd());
    }
    return finish(c, "allgather", g, s, (size_t)counts[me] * es);
}

static tm_status nccl_reduce_scatter(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt,
                                     tm_device dev) {
    ncclDataType_t t;
    cudaStream_t s;
    TM__TRY(start(c, "reduce_scatter", g, dt, &t, &s));
    NCCL_TRY(c, "reduce_scatter", g, ncclReduceScatter(send, recv, (size_t)n, t, ncclSum, gcomm(c, g), s));
    return finish(c, "reduce_scatter", g, s, (size_t)n * (size_t)c->size[g] * tm_dtype_size(dt));
}

static tm_status nccl_reduce_scatterv(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                                      tm_dtype dt, tm_device dev) {
    ncclDataType_t t;
    cudaStream_t s;
    TM__TRY(start(c, "reduce_scatter", g, dt, &t, &s));
    int G = c->size[g], me = c->rank[g], equal = 1;
    size_t es = tm_dtype_size(dt), total = 0;
    for (int j = 0; j < G; j++) equal &= counts[j] == counts[0], total += (size_t)counts[j];
    if (equal) {
        NCCL_TRY(c, "reduce_scatter", g, ncclReduceScatter(send, recv, (size_t)counts[0], t, ncclSum, gcomm(c, g), s));
        return finish(c, "reduce_scatter", g, s, total * es);
    }
    /* Ragged blocks: one reduce to each block's rank (the bytes of a reduce-scatter, where an
     * all-reduce of everything would move twice as many). */
    NCCL_TRY(c, "reduce_scatter", g, ncclGroupStart());
    size_t off = 0;
    for (int j = 0; j < G; j++) {
        if (counts[j]) {
            ncclResult_t r = ncclReduce((const char *)send + off * es, j == me ? recv : NULL, (size_t)counts[j], t,
                                        ncclSum, j, gcomm(c, g), s);
            if (r != ncclSuccess) {
                ncclGroupEnd();
                return nccl_fail(c, "reduce_scatter", g, r);
            }
        }
        off += (size_t)counts[j];
    }
    NCCL_TRY(c, "reduce_scatter", g, ncclGroupEnd());
    return finish(c, "reduce_scatter", g, s, total * es);
}

static tm_status nccl_alltoallv(tm__comm *c, int g, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
                                const int64_t *rc, const int64_t *rd, tm_dtype dt, tm_device dev) {
    ncclDataType_t t;
    cudaStream_t s;
    TM__TRY(start(c, "alltoall", g, dt, &t, &s));
    size_t es = tm_dtype_size(dt), sent = 0;
    int me = c->rank[g];
    /* This rank's own rows go through the group too, as a send and receive to itself: NCCL moves
     * them inside its kernel while the peers' rows cross NVLink (bench_alltoall, 2 / 4 H100s: 6 /
     * 0 us more than the peers' rows alone). A cudaMemcpyAsync of them before the group (as this
     * engine did through 0ab29e2) ran first and alone: 50 MB, 34 us of a 0.24 ms dispatch on 2 GPUs;
     * the same copy on a stream forked beside the group measured no faster (0.237 ms). */
    if (sc[me] != rc[me])
        return tm__err(c->ctx, TM_ERR_COMM, "alltoall over %s: this rank sends itself %lld elements but expects %lld",
                       tm__comm_gdesc(c, g), (long long)sc[me], (long long)rc[me]);
    NCCL_TRY(c, "alltoall", g, ncclGroupStart());
    for (int j = 0; j < c->size[g]; j++) {
        ncclResult_t r = ncclSuccess;
        if (sc[j]) r = ncclSend((const char *)send + sd[j] * (int64_t)es, (size_t)sc[j], t, j, gcomm(c, g), s);
        if (r == ncclSuccess && rc[j]) r = ncclRecv((char *)recv + rd[j] * (int64_t)es, (size_t)rc[j], t, j, gcomm(c, g), s);
        if (r != ncclSuccess) {
            ncclGroupEnd();
            return nccl_fail(c, "alltoall", g, r);
        }
        sent += (size_t)sc[j];
    }
    NCCL_TRY(c, "alltoall", g, ncclGroupEnd());
    return finish(c, "alltoall", g, s, sent * es);
}

static tm_status nccl_bcast(tm__comm *c, int g, void *buf, int64_t n, tm_dtype dt, int root, tm_device dev) {
    ncclDataType_t t;
    cudaStream_t s;
    TM__TRY(start(c, "bcast", g, dt, &t, &s));
    NCCL_TRY(c, "bcast", g, ncclBroadcast(buf, buf, (size_t)n, t, root, gcomm(c, g), s));
    return finish(c, "bcast", g, s, (size_t)n * tm_dtype_size(dt));
}

static tm_status nccl_barrier(tm__comm *c, int g) { return c->host->barrier(c, g); }

/* One communicator of group g (collective over it): group rank 0 draws the unique id, the mpi
 * engine broadcasts it. */
/* One communicator of group g; a side one (beside the work) keeps to comm_sms CTAs, the SMs
 * the work leaves it (tm_comm_options.comm_sms). */
static tm_status make_comm(tm__comm *c, int g, ncclComm_t *dst, int side) {
    tm_status s = TM_OK;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (c->rank[g] == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) s = nccl_fail(c, "ncclGetUniqueId", g, r);
    }
    /* every rank takes part in the broadcast, even after a failure above, so none waits */
    tm_status bs = c->host->bcast(c, g, &id, (int64_t)sizeof id, TM_U8, 0, tm_cpu());
    if (s == TM_OK) s = bs;
    if (s == TM_OK) {
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        if (side && c->opts.comm_sms > 0) cfg.maxCTAs = c->opts.comm_sms, cfg.minCTAs = 1;
        ncclResult_t r = ncclCommInitRankConfig(dst, c->size[g], id, c->rank[g], &cfg);
        if (r != ncclSuccess) s = nccl_fail(c, "ncclCommInitRankConfig", g, r);
    }
    return s;
}

/* The side communicator of one group, made when a layer first needs it (tm__coll_side_prepare:
 * the chunked MoE layer's expert-parallel group, without ZeRO-3's eager set). */
static tm_status nccl_side_group(tm__comm *c, int g) {
    nccl_state *ns = (nccl_state *)c->nccl;
    if (!ns) return tm__err(c->ctx, TM_ERR_COMM, "side communicator over %s: the nccl engine has no state",
                            tm__comm_gdesc(c, g));
    if (ns->side[g]) return TM_OK;
    tm__cuda *cu;
    TM__TRY(tm__cu_enter(c->ctx, "tm__coll_side_prepare (nccl)", &cu));
    return make_comm(c, g, &ns->side[g], 1);
}

static void nccl_free(tm__comm *c) {
    nccl_state *st = (nccl_state *)c->nccl;
    if (!st) return;
    tm__cuda *cu = (tm__cuda *)tm__cuda_state(c->ctx);
    if (cu && cu->comm_wait == pending_wait) {
        (void)pending_wait(c->ctx, "tm_comm_free"); /* bounded by the timeout; aborts on expiry */
        cu->comm_wait = NULL;
    }
    for (int g = 0; g < TM_COMM_NGROUPS; g++) {
        if (st->side[g]) ncclCommDestroy(st->side[g]);
        if (st->comm[g]) ncclCommDestroy(st->comm[g]);
    }
    tm__host_free(c->ctx, st);
    c->nccl = NULL;
}

extern "C" const tm__comm_ops tm__comm_nccl_ops = {
    "nccl", nccl_allreduce, nccl_allgatherv, nccl_reduce_scatter, nccl_reduce_scatterv, nccl_alltoallv, nccl_bcast,
    nccl_barrier, nccl_free, nccl_side_group,
};

/* FNV-1a of the host name: which ranks share a machine. */
static uint64_t host_hash(void) {
    char name[256] = {0};
    FILE *f = fopen("/proc/sys/kernel/hostname", "r");
    if (f) {
        if (!fgets(name, sizeof name, f)) name[0] = 0;
        fclose(f);
    }
    return tm_hash_name(name);
}

extern "C" tm_status tm__nccl_comm_create(tm__comm *c) {
    tm_ctx *ctx = c->ctx;
    tm__cuda *cu;
    TM__TRY(tm__cu_enter(ctx, "tm_comm_init (nccl)", &cu));
    /* Ranks sharing a GPU cannot share a communicator: fall back to host staging. */
    int W = c->world_size;
    uint64_t mine[2] = {host_hash(), (uint64_t)cu->device};
    uint64_t *all = (uint64_t *)tm__host_alloc(ctx, sizeof(uint64_t) * 2 * (size_t)W);
    if (!all) return tm__err(ctx, TM_ERR_NOMEM, "tm_comm_init: out of host memory");
    int64_t cd[2] = {(int64_t)sizeof mine, 0};
    tm_status s = TM_OK;
    {
        int64_t *counts = (int64_t *)tm__host_alloc(ctx, sizeof(int64_t) * 2 * (size_t)W);
        if (!counts) s = tm__err(ctx, TM_ERR_NOMEM, "tm_comm_init: out of host memory");
        for (int j = 0; s == TM_OK && j < W; j++) counts[j] = cd[0], counts[W + j] = cd[0] * j;
        if (s == TM_OK) s = c->host->allgatherv(c, TM_COMM_WORLD, mine, all, counts, counts + W, TM_U8, tm_cpu());
        tm__host_free(ctx, counts);
    }
    int shared = 0;
    for (int i = 0; s == TM_OK && i < W; i++)
        for (int j = i + 1; j < W; j++) shared |= all[2 * i] == all[2 * j] && all[2 * i + 1] == all[2 * j + 1];
    tm__host_free(ctx, all);
    TM__TRY(s);
    if (shared) return TM_ERR_UNSUPPORTED;
    nccl_state *st = (nccl_state *)tm__host_alloc(ctx, sizeof *st);
    if (!st) return tm__err(ctx, TM_ERR_NOMEM, "tm_comm_init: out of host memory");
    memset(st, 0, sizeof *st);
    c->nccl = st;
    /* groups of one rank need no communicator, unless NCCL was asked for one rank (a check of
     * this engine on a single GPU: tm_comm_options.nccl = TM_NCCL_ALWAYS) */
    int force = c->opts.nccl == TM_NCCL_ALWAYS, side = c->opts.overlap && c->opts.zero >= 3;
    for (int k = 0; k < 1 + side && s == TM_OK; k++)
        for (int g = 0; g < TM_COMM_NGROUPS; g++) {
            if (c->size[g] < 2 && !force) continue;
            s = make_comm(c, g, k ? &st->side[g] : &st->comm[g], k);
            if (s != TM_OK) break;
            if (k) c->side_groups |= 1u << g;
        }
    c->device_async = s == TM_OK && side;
    if (s != TM_OK) {
        c->side_groups = 0;
        nccl_free(c);
    }
    return s;
}
