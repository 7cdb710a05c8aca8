/*
 * comm.h — the communicator behind the public "Distributed" functions (include/tinymoe.h):
 * groups, and one table of collective functions per memory kind, the way framework/backend.h
 * has one table of kernels per device. Private to framework/ and the engines (framework/comm_mpi.c,
 * kernels/cuda/comm_nccl.cu).
 *
 *   engine       table                    implementation            moves
 *   self         tm__comm_self_ops        framework/comm.c          any device (one rank)
 *   plan         tm__comm_plan_ops        framework/plan.c          nothing (plan-only contexts)
 *   mpi          tm__comm_mpi_ops         framework/comm_mpi.c (MPI=1)        CPU memory
 *   mpi-staged   tm__comm_staged_ops      framework/comm.c          CUDA memory through host
 *                                                                   buffers and the mpi table
 *   nccl         tm__comm_nccl_ops        kernels/cuda/comm_nccl.cu (NCCL=1)     CUDA memory
 *
 * Contracts of a table (every function reports failures through tm__err with TM_ERR_COMM and
 * returns its status; counts are in elements of dt; pointers are memory of the device the
 * table serves; `g` is a tm_comm_group):
 *  - allreduce: recv = sum over the group of send, n elements (send == recv: in place). Float
 *    dtypes and i32 / i64; the mpi table sums bf16 in f32.
 *  - allgatherv: rank r's n = counts[r] elements of send land at recv + displs[r].
 *  - reduce_scatter: send holds G blocks of n elements; recv (n) = sum over the group of block
 *    `rank`. recv may be send + rank * n (in place).
 *  - reduce_scatterv: the ragged reduce-scatter: send holds G consecutive blocks of counts[j]
 *    elements (block j starts at counts[0] + ... + counts[j - 1]); recv (counts[rank]) = sum
 *    over the group of block `rank`. recv does not overlap send. (MPI_Reduce_scatter.)
 *  - alltoallv: sc[j] elements from send + sd[j] go to rank j; rc[j] from rank j land at
 *    recv + rd[j].
 *  - bcast: n elements of buf from group rank root. barrier: every rank of the group arrives.
 * A collective that does not complete within the communicator's timeout fails (the peers are
 * then in an undefined state: the caller reports and the program aborts the job).
 */
#ifndef TM_COMM_H
#define TM_COMM_H

#include "ctx_internal.h"

typedef struct tm__comm tm__comm;

typedef struct tm__comm_ops {
    const char *name;
    tm_status (*allreduce)(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt, tm_device dev);
    tm_status (*allgatherv)(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                            const int64_t *displs, tm_dtype dt, tm_device dev);
    tm_status (*reduce_scatter)(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt, tm_device dev);
    tm_status (*reduce_scatterv)(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts, tm_dtype dt,
                                 tm_device dev);
    tm_status (*alltoallv)(tm__comm *c, int g, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
                           const int64_t *rc, const int64_t *rd, tm_dtype dt, tm_device dev);
    tm_status (*bcast)(tm__comm *c, int g, void *buf, int64_t n, tm_dtype dt, int root, tm_device dev);
    tm_status (*barrier)(tm__comm *c, int g);
    void (*free)(tm__comm *c); /* the engine's state (may be NULL) */
    /* Make group g's communicator for the side stream (NULL: an engine that blocks, whose
     * collectives run in place). Collective over the group: every rank calls it at the same
     * point (tm__coll_side_prepare). */
    tm_status (*side_group)(tm__comm *c, int g);
} tm__comm_ops;

struct tm__comm {
    tm_ctx *ctx;
    tm_comm_options opts;
    int rank[TM_COMM_NGROUPS], size[TM_COMM_NGROUPS];
    int world_rank, world_size;
    const tm__comm_ops *host;   /* CPU memory: mpi or self */
    const tm__comm_ops *device; /* CUDA memory: nccl, mpi-staged or self (NULL: no CUDA device) */
    void *mpi;                  /* the mpi engine's state (framework/comm_mpi.c) */
    void *nccl;                 /* the nccl engine's state (kernels/cuda/comm_nccl.cu) */
    int device_async;           /* the device engine enqueues on a stream and has the side
                                 * stream's communicators (nccl under overlap and ZeRO-3, or
                                 * the groups tm__coll_side_prepare made): a collective can run
                                 * beside the work (tm__coll_side_begin) */
    unsigned side_groups;       /* bit g: the device engine has group g's side communicator */
    int side_active;            /* between tm__coll_side_begin and _end: calls count as beside */
    int side_background;        /* tm__coll_side_end_background is ending the side work */
    tm_comm_stats stats;
};

/* The context's communicator, NULL when none is attached. */
tm__comm *tm__ctx_comm(const tm_ctx *ctx);
/* The table moving memory of dev. */
const tm__comm_ops *tm__comm_ops_for(tm__comm *c, tm_device dev);
/* Traffic accounting (tm_comm_get_stats; its clock is tm__now, backend.h). */
void tm__comm_account(tm__comm *c, tm_comm_kind k, size_t bytes, double seconds);
/* "dp (rank 1 of 4)", for messages (rotating buffers of tm__tdesc). */
const char *tm__comm_gdesc(tm__comm *c, int g);

extern const tm__comm_ops tm__comm_self_ops;
/* plan.c: the engine of a plan-only context's world (moves nothing; comm.c counts it). */
extern const tm__comm_ops tm__comm_plan_ops;
extern const tm__comm_ops tm__comm_staged_ops;

/* framework/comm_mpi.c, in builds with MPI: make the world (world: pointer to an MPI_Comm or NULL for
 * MPI_COMM_WORLD) and the group communicators, fill rank[] / size[]; TM_ERR_STATE when MPI is
 * not initialised (the caller then makes a world of one). */
tm_status tm__mpi_comm_create(tm__comm *c, const void *world);
extern const tm__comm_ops tm__comm_mpi_ops;
/* kernels/cuda/comm_nccl.cu, in builds with NCCL: one NCCL communicator per group on the context's CUDA
 * device, the unique ids broadcast over the mpi engine. */
tm_status tm__nccl_comm_create(tm__comm *c);
extern const tm__comm_ops tm__comm_nccl_ops;

/* Collective entry points that account traffic and pick the table by device (framework code
 * calls these, never a table directly). */
/* tm_comm_options.grad_sync_chunk_bytes's default (0 there means this): large enough that an
 * NCCL all-reduce of one chunk runs near its bus bandwidth (NVLink: from about 16 MiB), small
 * enough that the backward starts the first ones early (PyTorch DDP's bucket_cap_mb is 25). */
#define TM__GRAD_SYNC_CHUNK_BYTES (32 << 20)

tm_status tm__coll_allreduce(tm_ctx *ctx, int g, const void *send, void *recv, int64_t n, tm_dtype dt, tm_device dev);
tm_status tm__coll_allgatherv(tm_ctx *ctx, int g, const void *send, void *recv, const int64_t *counts,
                              const int64_t *displs, tm_dtype dt, tm_device dev);
tm_status tm__coll_reduce_scatter(tm_ctx *ctx, int g, const void *send, void *recv, int64_t n, tm_dtype dt,
                                  tm_device dev);
tm_status tm__coll_reduce_scatterv(tm_ctx *ctx, int g, const void *send, void *recv, const int64_t *counts,
                                   tm_dtype dt, tm_device dev);
tm_status tm__coll_alltoallv(tm_ctx *ctx, int g, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
                             const int64_t *rc, const int64_t *rd, tm_dtype dt, tm_device dev);

/* Collectives beside the work (the backend's side stream, backend.h). Between side_begin and
 * side_end every collective on dev's memory is enqueued on the side stream, after the work
 * queued so far; side_end gives an event after them. Nothing waits on the host: whoever reads
 * the results first calls event_wait (the work stream waits; the event is freed), and memory
 * the side collectives read or write must not be given back before that. tm__coll_side_on is
 * 1 where it is worth it: a communicator with tm_comm_options.overlap whose engine for dev
 * enqueues on a stream (NCCL); elsewhere the collectives run in place and the event is NULL
 * (event_wait / event_done of NULL: nothing to wait for). */
int tm__coll_side_on(const tm_ctx *ctx, tm_device dev);
/* tm__coll_side_on for collectives over group g: also 0 where the device engine has no side
 * communicator of g. tm__coll_side_prepare makes it where the engine can (NCCL, overlap on, a
 * group of several ranks): collective over g, so every rank of the group calls it at the same
 * point (the MoE layer's creation: layers/moe.c); elsewhere it does nothing. Errors: the
 * engine's (TM_ERR_COMM). */
int tm__coll_side_group(const tm_ctx *ctx, int g, tm_device dev);
tm_status tm__coll_side_prepare(tm_ctx *ctx, int g, tm_device dev);
tm_status tm__coll_side_begin(tm_ctx *ctx, tm_device dev);
tm_status tm__coll_side_end(tm_ctx *ctx, tm_device dev, void **event);
/* tm__coll_side_end for work that must not make kernels leave SMs to it (tm__coll_side_background). */
tm_status tm__coll_side_end_background(tm_ctx *ctx, tm_device dev, void **event);
tm_status tm__coll_event_wait(tm_ctx *ctx, tm_device dev, void *event);
int tm__coll_event_done(tm_ctx *ctx, tm_device dev, void *event);

#endif
