/*
 * plan.c — plan-only contexts (include/tinymoe.h, tm_ctx_options.plan_only): the CPU backend
 * that places without memory, and the communicator engine of a world that need not exist.
 *
 * Why a backend: `tinymoe plan` must report what a run of any size holds and moves, and the one
 * way for that to stay equal to a run is to run the run's own code: tm_model_new places the
 * parameters in their buckets (param.c), tm_comm_init makes the groups (comm.c), the optimizer
 * shards its state and the master weights over the ZeRO blocks (optim/optimizer.c, param.c),
 * ZeRO-3 keeps each rank's block of the parameters (fsdp.c), and every one of them counts its
 * bytes in the memory report as it allocates. Under this table those allocations cost nothing:
 * an address is a placeholder in the upper half of the address space (user code cannot touch
 * it: an access faults at once rather than corrupting anything), copies and fills do nothing,
 * and no kernel runs (dispatch.c refuses every op of a plan-only context; tensor.c refuses reads
 * and writes). So a 64-rank layout of a model larger than the machine is a few milliseconds of
 * host bookkeeping per rank.
 *
 * The host bookkeeping itself (the meta arena: tensor headers, tape) is real memory (arena.c).
 */
#include "comm.h"

#include <stdint.h>

/* ---- the backend ---------------------------------------------------------------------------- */

/* Placeholders from 2^63 on (64-bit builds), aligned, never reused within a context: distinct
 * allocations never overlap, as the arena's block table and the pools' offsets expect. */
static tm_status plan_alloc(tm_ctx *ctx, size_t nbytes, void **p) {
#if UINTPTR_MAX > 0xffffffffu
    const uintptr_t base = (uintptr_t)1 << 63;
#else
    const uintptr_t base = (uintptr_t)1 << 31;
#endif
    size_t n = (nbytes + TM__ALIGN - 1) / TM__ALIGN * TM__ALIGN;
    if (n < nbytes || ctx->plan_next > UINTPTR_MAX - base - n)
        return tm__err(ctx, TM_ERR_NOMEM, "plan-only context: %zu bytes more do not fit the address space it plans in",
                       nbytes);
    *p = (void *)(base + ctx->plan_next);
    ctx->plan_next += n ? n : TM__ALIGN;
    return TM_OK;
}

static void plan_free(tm_ctx *ctx, void *p) {}

static tm_status plan_memcpy(tm_ctx *ctx, void *dst, const void *src, size_t nbytes, int kind) { return TM_OK; }
static tm_status plan_memset0(tm_ctx *ctx, void *p, size_t nbytes) { return TM_OK; }
static tm_status plan_sync(tm_ctx *ctx) { return TM_OK; }
static tm_status plan_copy_into(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src) { return TM_OK; }
static tm_status plan_accumulate(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, double alpha) { return TM_OK; }
static tm_status plan_assign(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, int accumulate, double alpha) {
    return TM_OK;
}
static tm_status plan_fill(tm_ctx *ctx, tm_tensor *t, double value) { return TM_OK; }

static tm_status plan_gemm(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                           double alpha, const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb,
                           int64_t sb, double beta, void *C, int64_t ldc, int64_t sc, int64_t batch) {
    return tm__err(ctx, TM_ERR_STATE, "gemm: a plan-only context (tm_ctx_options.plan_only) computes nothing");
}

/* (no kernels: dispatch.c refuses ops before it would look here) */
static const tm__fn plan_none[TM__NOPS];

const tm__backend_ops tm__plan_backend = {
    .name = "plan",
    .device_count = NULL,
    .init = NULL,
    .shutdown = NULL,
    .alloc = plan_alloc,
    .free = plan_free,
    .memcpy = plan_memcpy,
    .memset0 = plan_memset0,
    .sync = plan_sync,
    .copy_into = plan_copy_into,
    .accumulate = plan_accumulate,
    .assign = plan_assign,
    .fill = plan_fill,
    .gemm = plan_gemm,
    .fwd = plan_none,
    .bwd = plan_none,
    .convert = tm__convert_host,
    .gather_strided = tm__gather_strided_host,
};

/* ---- the communicator engine ---------------------------------------------------------------- */
/* Every collective succeeds without moving anything (its buffers are placeholders); the
 * accounted entry points of comm.c count its bytes as they do for a real engine. */

static tm_status pc_allreduce(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt, tm_device dev) {
    return TM_OK;
}
static tm_status pc_allgatherv(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                               const int64_t *displs, tm_dtype dt, tm_device dev) {
    return TM_OK;
}
static tm_status pc_reduce_scatter(tm__comm *c, int g, const void *send, void *recv, int64_t n, tm_dtype dt,
                                   tm_device dev) {
    return TM_OK;
}
static tm_status pc_reduce_scatterv(tm__comm *c, int g, const void *send, void *recv, const int64_t *counts,
                                    tm_dtype dt, tm_device dev) {
    return TM_OK;
}
static tm_status pc_alltoallv(tm__comm *c, int g, const void *send, const int64_t *sc, const int64_t *sd, void *recv,
                              const int64_t *rc, const int64_t *rd, tm_dtype dt, tm_device dev) {
    return TM_OK;
}
static tm_status pc_bcast(tm__comm *c, int g, void *buf, int64_t n, tm_dtype dt, int root, tm_device dev) {
    return TM_OK;
}
static tm_status pc_barrier(tm__comm *c, int g) { return TM_OK; }

const tm__comm_ops tm__comm_plan_ops = {
    "plan", pc_allreduce, pc_allgatherv, pc_reduce_scatter, pc_reduce_scatterv, pc_alltoallv, pc_bcast, pc_barrier, NULL,
    NULL, /* side_group: a plan moves nothing, beside the work or not */
};
