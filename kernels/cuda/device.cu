/*
 * device.cu — the CUDA backend of a context: device, stream, raw allocation, host <-> device
 * copies, and the backend table (framework/backend.h) that the framework calls, with the
 * kernel tables of every op with CUDA kernels generated from framework/ops.def.
 *
 * One non-blocking stream per context carries all of its work, so ops need no
 * synchronisation between them; only device-to-host copies (and error flags read back by
 * ops such as cross_entropy) wait, and each such wait is counted (tm_ctx_sync_count). Device
 * memory is requested here with plain cudaMalloc: the context's arenas keep what they get for
 * the next step, so they are the caching allocator and nothing here caches memory a second
 * time.
 */
#include "common.cuh"
#include "grouped_matmul_sm90.h"

#include <stdio.h>

/* ---- device, context state ------------------------------------------------------------------ */

static int tm__cuda_device_count(void) {
    int n = 0;
    /* No driver or no device is a normal situation for a CPU-only machine, not an error. */
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

static void tm__cuda_shutdown(tm_ctx *ctx, void *state) {
    tm__cuda *st = (tm__cuda *)state;
    if (!st) return;
    /* Teardown must go on whatever fails: errors are ignored here on purpose. */
    cudaSetDevice(st->device);
    if (st->stream) cudaStreamSynchronize(st->stream);
    if (st->side) cudaStreamSynchronize(st->side);
    tm__gemm_plans_destroy(st);
    if (st->workspace) cudaFree(st->workspace);
    if (st->lt) cublasLtDestroy(st->lt);
    if (st->stream) cudaStreamDestroy(st->stream);
    if (st->side) cudaStreamDestroy(st->side);
    if (st->side_tail) cudaEventDestroy(st->side_tail);
    (void)cudaGetLastError();
    tm__host_free(ctx, st);
}

static tm_status tm__cuda_init_state(tm_ctx *ctx, int device, tm__cuda *st) {
    const char *what = "cuda_init";
    TM__CU_CHECK(ctx, what, cudaSetDevice(device));
    TM__CU_CHECK(ctx, what, cudaDeviceGetAttribute(&st->num_sms, cudaDevAttrMultiProcessorCount, device));
    TM__CU_CHECK(ctx, what, cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking));
    TM__LT_CHECK(ctx, what, cublasLtCreate(&st->lt));
    st->workspace_bytes = TM__GEMM_WORKSPACE;
    cudaError_t e = cudaMalloc(&st->workspace, st->workspace_bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        st->workspace = NULL;
        return tm__err(ctx, e == cudaErrorMemoryAllocation ? TM_ERR_NOMEM : TM_ERR_CUDA,
                       "%s: cudaMalloc of the %zu-byte cuBLASLt workspace on cuda:%d failed: %s",
                       what, st->workspace_bytes, device, cudaGetErrorString(e));
    }
    return TM_OK;
}

static tm_status tm__cuda_init(tm_ctx *ctx, int device, void **state) {
    *state = NULL;
    int n = tm__cuda_device_count();
    if (device < 0 || device >= n)
        return tm__err(ctx, TM_ERR_DEVICE, "cuda_init: CUDA device %d requested but %d visible", device, n);
    tm__cuda *st = (tm__cuda *)tm__host_alloc(ctx, sizeof *st);
    if (!st) return tm__err(ctx, TM_ERR_NOMEM, "cuda_init: out of host memory for the CUDA state");
    memset(st, 0, sizeof *st);
    st->device = device;
    tm_status s = tm__cuda_init_state(ctx, device, st);
    if (s != TM_OK) {
        tm__cuda_shutdown(ctx, st);
        return s;
    }
    /* TM_GROUPED_GEMM_AUTO: the Hopper grouped GEMM where it runs (faster than cuBLASLt per group at
     * every benchmark shape, and never a wait), cuBLASLt per group elsewhere (the sm_80 device
     * kernel is slower than it). Decided here, once, with the device current. */
    if (tm__gmm_auto(ctx)) {
        char why[256];
        tm__set_gmm_device_schedule(ctx, tm__gmm90_supported(why, sizeof why) ? TM_GROUPED_GEMM_HOPPER
                                                                              : TM_GROUPED_GEMM_CUBLASLT);
    }
    *state = st;
    return TM_OK;
}

/* ---- memory ------------------------------------------------------------------------------------ */

static tm_status tm__cuda_malloc(tm_ctx *ctx, size_t nbytes, void **p) {
    tm__cuda *st;
    *p = NULL;
    TM__TRY(tm__cu_enter(ctx, "cuda_malloc", &st));
    cudaError_t e = cudaMalloc(p, nbytes ? nbytes : 1);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *p = NULL;
        return tm__err(ctx, e == cudaErrorMemoryAllocation ? TM_ERR_NOMEM : TM_ERR_CUDA,
                       "cuda_malloc: cudaMalloc(%zu bytes) on cuda:%d failed: %s", nbytes, st->device,
                       cudaGetErrorString(e));
    }
    return TM_OK;
}

static tm_status comm_wait(tm_ctx *ctx, tm__cuda *st, const char *what);

static void tm__cuda_free(tm_ctx *ctx, void *p) {
    tm__cuda *st = (tm__cuda *)tm__cuda_state(ctx);
    if (!p || !st) return;
    /* cudaFree waits for the device: collectives in flight are waited for under their timeout
     * first; if they fail, the block is left allocated (the run is failing anyway) */
    if (comm_wait(ctx, st, "cuda_free") != TM_OK) return;
    cudaSetDevice(st->device);
    cudaFree(p); /* synchronises the device: no kernel still reads p */
    (void)cudaGetLastError();
}

/* Before the host waits for the stream: if an engine left collectives to watch (NCCL under a
 * timeout, kernels/cuda/comm_nccl.cu), it waits for them, failing past its timeout; the
 * collectives themselves never block the host, so the GPU's queue stays full across them. */
static tm_status comm_wait(tm_ctx *ctx, tm__cuda *st, const char *what) {
    tm_status (*w)(tm_ctx *, const char *) = st->comm_wait;
    if (!w) return TM_OK;
    st->comm_wait = NULL;
    return w(ctx, what);
}

extern "C" tm_status tm__cuda_memcpy(tm_ctx *ctx, void *dst, const void *src, size_t nbytes, int kind) {
    tm__cuda *st;
    const char *what = "cuda_memcpy";
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (nbytes == 0) return TM_OK;
    cudaMemcpyKind k = kind == TM__H2D ? cudaMemcpyHostToDevice
                     : kind == TM__D2H ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
    /* From pageable host memory the call returns once the source has been staged, so the
     * caller may reuse `src` at once; the copy itself stays ordered on the stream. To pageable
     * memory it returns only when the copy is done, i.e. after everything queued before it:
     * the wait is inside the copy as much as inside the synchronisation, so both are timed. */
    if (kind != TM__D2H) {
        TM__CU_CHECK(ctx, what, cudaMemcpyAsync(dst, src, nbytes, k, st->stream));
        return TM_OK;
    }
    tm__count_sync(ctx);
    double t0 = tm__now();
    /* Collectives in flight: their engine waits first (a copy to pageable memory would block
     * inside cudaMemcpyAsync, past any timeout); the copy then finds the stream idle. */
    tm_status ws = comm_wait(ctx, st, what);
    if (ws != TM_OK) {
        tm__add_wait(ctx, t0);
        return ws;
    }
    cudaError_t e = cudaMemcpyAsync(dst, src, nbytes, k, st->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(st->stream);
    tm__add_wait(ctx, t0);
    TM__CU_CHECK(ctx, what, e);
    return TM_OK;
}

extern "C" tm_status tm__cuda_memset0(tm_ctx *ctx, void *p, size_t nbytes) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "cuda_memset0", &st));
    if (nbytes == 0) return TM_OK;
    TM__CU_CHECK(ctx, "cuda_memset0", cudaMemsetAsync(p, 0, nbytes, st->stream));
    return TM_OK;
}

static tm_status tm__cuda_sync(tm_ctx *ctx) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "cuda_sync", &st));
    tm__count_sync(ctx);
    double t0 = tm__now();
    tm_status ws = comm_wait(ctx, st, "cuda_sync");
    cudaError_t e = ws == TM_OK ? cudaStreamSynchronize(st->stream) : cudaSuccess;
    /* side work nothing waited for yet (backend.h): a sync means all of the context's work */
    if (e == cudaSuccess && ws == TM_OK && st->side) e = cudaStreamSynchronize(st->side);
    tm__add_wait(ctx, t0);
    TM__TRY(ws);
    TM__CU_CHECK(ctx, "cuda_sync", e);
    return TM_OK;
}


/* Page-locked host memory (backend.h): D2H / H2D copies to and from it run at the link's speed
 * and skip the driver's staging through its own small pinned buffers. NULL when the driver
 * refuses (no device, locked-memory limit): the caller falls back to pageable memory. */
static void *tm__cuda_host_alloc_pinned(tm_ctx *ctx, size_t nbytes) {
    tm__cuda *st;
    if (tm__cu_enter(ctx, "cuda_host_alloc_pinned", &st) != TM_OK) return NULL;
    void *p = NULL;
    if (cudaHostAlloc(&p, nbytes ? nbytes : 1, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void tm__cuda_host_free_pinned(tm_ctx *ctx, void *p) {
    (void)ctx;
    if (!p) return;
    cudaFreeHost(p); /* synchronises with the device: no copy still uses p */
    (void)cudaGetLastError();
}

/* ---- the side stream (backend.h): collectives beside the work ------------------------------- */

/* An event recorded on `from`, waited for by `to` (the event can go at once: the wait is
 * queued). */
static tm_status stream_after(tm_ctx *ctx, const char *what, cudaStream_t to, cudaStream_t from) {
    cudaEvent_t e;
    TM__CU_CHECK(ctx, what, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cudaError_t r = cudaEventRecord(e, from);
    if (r == cudaSuccess) r = cudaStreamWaitEvent(to, e, 0);
    cudaEventDestroy(e);
    TM__CU_CHECK(ctx, what, r);
    return TM_OK;
}

static tm_status tm__cuda_side_begin(tm_ctx *ctx) {
    tm__cuda *st;
    const char *what = "cuda_side_begin";
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (st->side_on) return tm__err(ctx, TM_ERR_INTERNAL, "%s: the side stream is already on", what);
    if (!st->side) TM__CU_CHECK(ctx, what, cudaStreamCreateWithFlags(&st->side, cudaStreamNonBlocking));
    TM__TRY(stream_after(ctx, what, st->side, st->stream));
    st->side_on = 1;
    return TM_OK;
}

static tm_status tm__cuda_side_end(tm_ctx *ctx, void **event) {
    tm__cuda *st;
    const char *what = "cuda_side_end";
    *event = NULL;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    st->side_on = 0;
    cudaEvent_t e;
    TM__CU_CHECK(ctx, what, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cudaError_t r = cudaEventRecord(e, st->side);
    /* background work (tm__coll_side_background) is not what kernels leave SMs to */
    if (r == cudaSuccess && !tm__coll_side_background(ctx)) {
        if (!st->side_tail) r = cudaEventCreateWithFlags(&st->side_tail, cudaEventDisableTiming);
        if (r == cudaSuccess) r = cudaEventRecord(st->side_tail, st->side);
    }
    if (r != cudaSuccess) cudaEventDestroy(e);
    TM__CU_CHECK(ctx, what, r);
    *event = (void *)e;
    return TM_OK;
}

static tm_status tm__cuda_event_wait(tm_ctx *ctx, void *event) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "cuda_event_wait", &st));
    if (event) TM__CU_CHECK(ctx, "cuda_event_wait", cudaStreamWaitEvent(st->stream, (cudaEvent_t)event, 0));
    return TM_OK;
}

static int tm__cuda_event_query(tm_ctx *ctx, void *event) {
    (void)ctx;
    if (!event) return 1;
    cudaError_t r = cudaEventQuery((cudaEvent_t)event);
    if (r == cudaErrorNotReady) return 0;
    (void)cudaGetLastError(); /* a failure shows at the next wait of the work stream */
    return 1;
}

static void tm__cuda_event_free(tm_ctx *ctx, void *event) {
    (void)ctx;
    if (event) cudaEventDestroy((cudaEvent_t)event);
}

/* ---- the backend table ------------------------------------------------------------------------- */

static tm_status tm__cuda_gemm_entry(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N,
                                     int64_t K, double alpha, const void *A, int64_t lda, int64_t sa, const void *B,
                                     int64_t ldb, int64_t sb, double beta, void *C, int64_t ldc, int64_t sc,
                                     int64_t batch) {
    return tm__gemm_cuda(ctx, dt, trans_a, trans_b, M, N, K, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch);
}

static const tm__fn tm__cuda_fwd[TM__NOPS] = {
#define TM__OP(ID, name, n_in, n_out, flags, kernels) TM__FWD_CUDA_##kernels(name),
#include "ops.def"
#undef TM__OP
};

static const tm__fn tm__cuda_bwd[TM__NOPS] = {
#define TM__OP(ID, name, n_in, n_out, flags, kernels) TM__BWD_CUDA_##kernels(name),
#include "ops.def"
#undef TM__OP
};

/* Positional (C++ has no designated initialisers of this kind): the order of tm__backend_ops. */
extern "C" const tm__backend_ops tm__cuda_backend = {
    "cuda",
    tm__cuda_device_count,
    tm__cuda_init,
    tm__cuda_shutdown,
    tm__cuda_malloc,
    tm__cuda_free,
    tm__cuda_memcpy,
    tm__cuda_memset0,
    tm__cuda_sync,
    tm__cuda_copy_into,
    tm__cuda_accumulate,
    tm__cuda_assign,
    tm__cuda_fill,
    tm__cuda_gemm_entry,
    tm__cuda_fwd,
    tm__cuda_bwd,
    NULL, /* convert: host memory, the CPU backend's */
    NULL, /* gather_strided */
    tm__cuda_host_alloc_pinned,
    tm__cuda_host_free_pinned,
    tm__cuda_side_begin,
    tm__cuda_side_end,
    tm__cuda_event_wait,
    tm__cuda_event_query,
    tm__cuda_event_free,
};
