/*
 * common.cuh — what every CUDA kernel file of tinymoe shares: the per-context CUDA state,
 * error checking that turns CUDA failures into TM_ERR_CUDA messages, bf16 load/store, launch
 * geometry and the deterministic reduction helper (kernels/cuda/backend.cu).
 *
 * CUDA C++ is used only for what C lacks on the device (overloads of the load/store helpers
 * and one template parameter per kernel for the storage type); every exported function has
 * C linkage and a C signature.
 *
 * Storage types on CUDA: f32 and bf16 (f64 tensors cannot be created on a CUDA device).
 * bf16 kernels load bf16, compute in f32 and store rounded to nearest even.
 */
#ifndef TM_CUDA_COMMON_CUH
#define TM_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "internal.h"
}

typedef __nv_bfloat16 tm__bf16;

/* ---- per-context state ------------------------------------------------------------------ */

/* One cached cuBLASLt plan: descriptors and the heuristic's algorithm for one GEMM shape.
 * Steady-state training repeats a handful of shapes, so after the first step no GEMM queries
 * the heuristic again. */
typedef struct tm__gemm_plan {
    int valid;
    /* key */
    tm_dtype dt;                         /* A and B */
    tm_dtype cdt;                        /* C = D (dt but for tm__gemm_cuda_out) */
    int trans_a, trans_b;
    int64_t M, N, K, lda, ldb, ldc, sa, sb, sc, batch;
    uint32_t align_a, align_b, align_c;  /* pointer alignment classes the algorithm assumes */
    int ragged;                          /* TM__GEMM_RAGGED_*: M / K are buckets, not sizes */
    /* value */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;   /* cuBLASLt's A (our B), B (our A), C = D */
    cublasLtMatmulAlgo_t algo;
    int64_t cur_M, cur_K;                /* the sizes the layouts hold now (ragged plans) */
} tm__gemm_plan;

#define TM__GEMM_CACHE 64
#define TM__GEMM_WORKSPACE ((size_t)32 << 20)

typedef struct tm__cuda {
    int device;
    int num_sms;
    cudaStream_t stream;                 /* every kernel and copy of the context goes here */
    /* Collectives that run beside the work (backend.h, side_begin): their stream, made at the
     * first use, and whether the engine's calls go there now. */
    cudaStream_t side;
    int side_on;
    /* Recorded on the side stream at each side_end but background work's (the gradient
     * all-reduce's pieces, tm__coll_side_background): until it has happened, collectives beside
     * the work may hold SMs (kernels that size their grid leave them comm_sms; tm__cuda_side_busy). */
    cudaEvent_t side_tail;
    cublasLtHandle_t lt;
    void *workspace;                     /* cuBLASLt workspace, allocated once */
    size_t workspace_bytes;
    tm__gemm_plan plans[TM__GEMM_CACHE];
    int next_victim;                     /* round-robin eviction when the cache is full */
    /* Set by an engine that enqueued collectives it must watch (comm_nccl.cu, under a timeout):
     * the next wait for the stream is its, not a plain cudaStreamSynchronize (device.cu). */
    tm_status (*comm_wait)(tm_ctx *ctx, const char *what);
    int fa90; /* attention.cu: the wgmma attention kernels run here (tm__fa90_supported): 0 not yet
               * asked, 1 yes, 2 no */
} tm__cuda;

/* 1 while work enqueued on the side stream has not finished, as far as the host can tell now
 * (it runs ahead of the device: work still queued counts as busy, as it will run beside what is
 * launched next). */
static inline int tm__cuda_side_busy(const tm__cuda *st) {
    if (!st->side_tail) return 0;
    cudaError_t r = cudaEventQuery(st->side_tail);
    if (r == cudaSuccess) return 0;
    if (r != cudaErrorNotReady) (void)cudaGetLastError(); /* shows at the next wait of the work stream */
    return 1;
}

/* ---- errors -------------------------------------------------------------------------------- */

/* `what` names the op or backend function. A failing runtime call also leaves the error in
 * the thread's "last error" slot; it is cleared so the next launch check does not report it
 * again. (Sticky errors — a faulting kernel — stay, as they must.) */
#define TM__CU_CHECK(ctx, what, call)                                                          \
    do {                                                                                       \
        cudaError_t tm__e_ = (call);                                                           \
        if (tm__e_ != cudaSuccess) {                                                           \
            (void)cudaGetLastError();                                                          \
            return tm__err((ctx), TM_ERR_CUDA, "%s: %s failed at %s:%d: %s", (what), #call,    \
                           __FILE__, __LINE__, cudaGetErrorString(tm__e_));                    \
        }                                                                                      \
    } while (0)

/* After every <<<...>>>: launch-configuration errors are reported here, asynchronous faults
 * by the next synchronising call. */
#define TM__CU_LAUNCHED(ctx, what, kernel_name)                                                \
    do {                                                                                       \
        cudaError_t tm__e_ = cudaGetLastError();                                               \
        if (tm__e_ != cudaSuccess)                                                             \
            return tm__err((ctx), TM_ERR_CUDA, "%s: launch of %s failed at %s:%d: %s", (what), \
                           (kernel_name), __FILE__, __LINE__, cudaGetErrorString(tm__e_));     \
    } while (0)

#define TM__LT_CHECK(ctx, what, call)                                                          \
    do {                                                                                       \
        cublasStatus_t tm__b_ = (call);                                                        \
        if (tm__b_ != CUBLAS_STATUS_SUCCESS)                                                   \
            return tm__err((ctx), TM_ERR_CUDA, "%s: %s failed at %s:%d: %s (%d)", (what),      \
                           #call, __FILE__, __LINE__, cublasLtGetStatusString(tm__b_),         \
                           (int)tm__b_);                                                       \
    } while (0)

/* The context's CUDA state with its device made current (several contexts may drive
 * different GPUs from one thread). TM_ERR_DEVICE when the context has no CUDA device. */
static inline tm_status tm__cu_enter(tm_ctx *ctx, const char *what, tm__cuda **st) {
    tm__cuda *s = (tm__cuda *)tm__cuda_state(ctx);
    *st = NULL;
    if (!s) return tm__err(ctx, TM_ERR_DEVICE, "%s: the context has no CUDA device", what);
    int cur = -1;
    TM__CU_CHECK(ctx, what, cudaGetDevice(&cur));
    if (cur != s->device) TM__CU_CHECK(ctx, what, cudaSetDevice(s->device));
    *st = s;
    return TM_OK;
}

/* Arena scratch on the context's CUDA device (valid until the arena reset). */
static inline tm_status tm__cu_scratch(tm_ctx *ctx, const tm__cuda *st, size_t nbytes, void **p) {
    *p = tm__arena_alloc(ctx, tm_cuda(st->device), nbytes ? nbytes : 1);
    return *p ? TM_OK : TM_ERR_NOMEM; /* the arena has set the message */
}

/* ---- launch geometry ------------------------------------------------------------------------ */

#define TM__CU_THREADS 256
/* Blocks for a grid-stride loop over n elements: enough to fill the GPU, never more than
 * needed. */
static inline unsigned tm__cu_blocks(const tm__cuda *st, int64_t n) {
    int64_t b = (n + TM__CU_THREADS - 1) / TM__CU_THREADS;
    int64_t cap = (int64_t)st->num_sms * 32;
    if (b > cap) b = cap;
    return (unsigned)(b < 1 ? 1 : b);
}
#define TM__CU_GRID_STRIDE(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

/* Launch kern<T> with T the storage type of the float dtype dt (f32 or bf16). Such kernels
 * take their tensors as void pointers and cast them to T inside. */
#define TM__CU_LAUNCH_FLOAT(dt, kern, grid, block, smem, stream, ...)                      \
    do {                                                                                   \
        if ((dt) == TM_BF16) kern<tm__bf16><<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__); \
        else kern<float><<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__);              \
    } while (0)

/* ---- bf16 / f32 load and store ------------------------------------------------------------ */

__device__ __forceinline__ float tm__ld(const float *p) { return *p; }
__device__ __forceinline__ float tm__ld(const tm__bf16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void tm__st(float *p, float v) { *p = v; }
/* Round to nearest even, as the host's tm__f32_to_bf16 does for finite values. */
__device__ __forceinline__ void tm__st(tm__bf16 *p, float v) { *p = __float2bfloat16_rn(v); }

/* ---- block reductions (fixed order: deterministic for a fixed blockDim) ------------------- */

/* Sum of v over the block; every thread gets the result. `sh` holds >= 32 floats. */
__device__ __forceinline__ float tm__block_sum(float v, float *sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads(); /* sh may still be read by a previous call */
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float tm__block_max(float v, float *sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ long long tm__block_sum_ll(long long v, long long *sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Threads for one block per row of n elements: a multiple of 32 in [32, 1024]. */
static inline int tm__cu_row_threads(int64_t n) {
    int t = 32;
    while (t < 1024 && t < n) t <<= 1;
    return t > 512 ? 512 : t;
}

/* ---- shared helpers (backend.cu) ---------------------------------------------------------- */

/* dst[o, i] = alpha * sum_a src[o, a, i] (+ dst[o, i] when accumulate), for src [O, A, I]
 * (f32 or bf16) and dst [O, I] (f32 or bf16). f32 accumulation in a fixed order that depends
 * only on the shape and the GPU's SM count: bitwise reproducible, no atomics. Large A is split
 * over several blocks whose partial sums (f32 arena scratch) are added in a second pass. */
extern "C" tm_status tm__cu_reduce(tm_ctx *ctx, const char *what, tm_dtype src_dt, const void *src,
                        tm_dtype dst_dt, void *dst, int64_t O, int64_t A, int64_t I, float alpha,
                        int accumulate);

/* dst (contiguous, n elements, f32/bf16) += alpha * src (contiguous, n, f32/bf16). */
extern "C" tm_status tm__cu_axpy(tm_ctx *ctx, const char *what, tm_dtype dst_dt, void *dst, tm_dtype src_dt,
                      const void *src, int64_t n, float alpha);

/* ---- entry points shared between the CUDA files (C linkage, CUDA-internal) ------------- */

/* Stream-ordered copy between host and device (kind TM__H2D / TM__D2H / TM__D2D, backend.h);
 * D2H waits for completion so the host may read the result, and is counted as a sync. */
extern "C" tm_status tm__cuda_memcpy(tm_ctx *ctx, void *dst, const void *src, size_t nbytes, int kind);
extern "C" tm_status tm__cuda_memset0(tm_ctx *ctx, void *p, size_t nbytes);
/* Device versions of tm__copy_into / tm__accumulate / tm__assign / tm__fill (copy.cu). */
extern "C" tm_status tm__cuda_copy_into(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src);
extern "C" tm_status tm__cuda_accumulate(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, double alpha);
extern "C" tm_status tm__cuda_assign(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, int accumulate, double alpha);
extern "C" tm_status tm__cuda_fill(tm_ctx *ctx, tm_tensor *t, double value);
/* cuBLASLt GEMM (gemm.cu), the row-major contract of tm__gemm_cpu; dt TM_F32 or TM_BF16 (f32
 * accumulation). batch > 1: strided batched with element strides sa, sb, sc. */
extern "C" tm_status tm__gemm_cuda(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N,
                                   int64_t K, double alpha, const void *A, int64_t lda, int64_t sa, const void *B,
                                   int64_t ldb, int64_t sb, double beta, void *C, int64_t ldc, int64_t sc,
                                   int64_t batch);
/* tm__gemm_cuda with C (and D) of dtype cdt, A and B of dt: bf16 products into f32 outputs. */
extern "C" tm_status tm__gemm_cuda_out(tm_ctx *ctx, tm_dtype dt, tm_dtype cdt, int trans_a, int trans_b, int64_t M,
                                       int64_t N, int64_t K, double alpha, const void *A, int64_t lda, int64_t sa,
                                       const void *B, int64_t ldb, int64_t sb, double beta, void *C, int64_t ldc,
                                       int64_t sc, int64_t batch);
/* tm__gemm_cuda for one group of a ragged (grouped) GEMM, whose M (TM__GEMM_RAGGED_M) or K
 * (TM__GEMM_RAGGED_K) changes from call to call with the routing: the plan is cached per
 * power-of-two bucket of that size (its algorithm is the heuristic's for the bucket's top,
 * checked for the exact size with cublasLtMatmulAlgoCheck), and only the layouts' row and
 * column counts are reset per call. Exact keys would miss the cache on nearly every call
 * (a fresh heuristic query per expert and direction). batch 1 only. */
#define TM__GEMM_RAGGED_M 1
#define TM__GEMM_RAGGED_K 2
extern "C" tm_status tm__gemm_cuda_ragged(tm_ctx *ctx, tm_dtype dt, int ragged, int trans_a, int trans_b, int64_t M,
                                          int64_t N, int64_t K, double alpha, const void *A, int64_t lda,
                                          const void *B, int64_t ldb, double beta, void *C, int64_t ldc);
/* Free the cached cuBLASLt plans of a context (gemm.cu; at shutdown). */
extern "C" void tm__gemm_plans_destroy(tm__cuda *st);

#endif /* TM_CUDA_COMMON_CUH */
