/*
 * backend.c — the CPU backend table (framework/backend.h): host memory through the context's
 * allocator hook, memcpy, the copy primitives of copy.c, the GEMM of gemm.c, and the kernel
 * tables of every op with CPU kernels, generated from framework/ops.def.
 */
#include <string.h>

#include "internal.h"

static int cpu_device_count(void) { return 1; }

static tm_status cpu_alloc(tm_ctx *ctx, size_t nbytes, void **p) {
    *p = tm__host_alloc_raw(ctx, nbytes);
    if (!*p) return tm__err(ctx, TM_ERR_NOMEM, "out of host memory allocating %zu bytes", nbytes);
    return TM_OK;
}

static void cpu_free(tm_ctx *ctx, void *p) { tm__host_free(ctx, p); }

static tm_status cpu_memcpy(tm_ctx *ctx, void *dst, const void *src, size_t nbytes, int kind) {
    if (nbytes) memcpy(dst, src, nbytes);
    return TM_OK;
}

static tm_status cpu_memset0(tm_ctx *ctx, void *p, size_t nbytes) {
    if (nbytes) memset(p, 0, nbytes);
    return TM_OK;
}

static tm_status cpu_sync(tm_ctx *ctx) { return TM_OK; }

static tm_status cpu_gemm(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                          double alpha, const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                          double beta, void *C, int64_t ldc, int64_t sc, int64_t batch) {
    if (dt != TM_F32 && dt != TM_F64)
        return tm__err(ctx, TM_ERR_DTYPE, "gemm: the CPU computes in f32 or f64, got %s", tm_dtype_name(dt));
    size_t esz = tm_dtype_size(dt);
    for (int64_t i = 0; i < batch; i++)
        tm__gemm_cpu(ctx, dt, trans_a, trans_b, M, N, K, alpha, (const char *)A + i * sa * esz, lda,
                     (const char *)B + i * sb * esz, ldb, beta, (char *)C + i * sc * esz, ldc);
    return TM_OK;
}

static const tm__fn cpu_fwd[TM__NOPS] = {
#define TM__OP(ID, name, n_in, n_out, flags, kernels) TM__FWD_CPU_##kernels(name),
#include "ops.def"
#undef TM__OP
};

static const tm__fn cpu_bwd[TM__NOPS] = {
#define TM__OP(ID, name, n_in, n_out, flags, kernels) TM__BWD_CPU_##kernels(name),
#include "ops.def"
#undef TM__OP
};

/* The side stream (backend.h) of host memory: its collectives block until done, so what runs
 * "beside" the work has finished when side_end returns, and its event has happened. With
 * these the overlap bookkeeping of ZeRO-3 (framework/fsdp.c: prefetches, gathers ahead,
 * reduce-scatters finished later) runs on CPU ranks too, where the tests reach it. */
static const char cpu_event = 0;
static tm_status cpu_side_begin(tm_ctx *ctx) { return TM_OK; }
static tm_status cpu_side_end(tm_ctx *ctx, void **event) {
    *event = (void *)&cpu_event;
    return TM_OK;
}
static tm_status cpu_event_wait(tm_ctx *ctx, void *event) { return TM_OK; }
static int cpu_event_query(tm_ctx *ctx, void *event) { return 1; }
static void cpu_event_free(tm_ctx *ctx, void *event) {}

const tm__backend_ops tm__cpu_backend = {
    .name = "cpu",
    .device_count = cpu_device_count,
    .init = NULL,
    .shutdown = NULL,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .memcpy = cpu_memcpy,
    .memset0 = cpu_memset0,
    .sync = cpu_sync,
    .copy_into = tm__cpu_copy_into,
    .accumulate = tm__cpu_accumulate,
    .assign = tm__cpu_assign,
    .fill = tm__cpu_fill,
    .gemm = cpu_gemm,
    .fwd = cpu_fwd,
    .bwd = cpu_bwd,
    .convert = tm__convert_host,
    .gather_strided = tm__gather_strided_host,
    .host_alloc_pinned = NULL, /* host memory is what the CPU computes on: nothing to pin */
    .host_free_pinned = NULL,
    .side_begin = cpu_side_begin,
    .side_end = cpu_side_end,
    .event_wait = cpu_event_wait,
    .event_query = cpu_event_query,
    .event_free = cpu_event_free,
};
