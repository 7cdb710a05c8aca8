/*
 * backend.cu — the CUDA backend of a context: device, stream, raw allocation, copies,
 * dtype-converting strided copy / accumulate / fill, the deterministic reducer and the
 * cuBLASLt GEMM every matmul goes through.
 *
 * One non-blocking stream per context carries all of its work, so ops need no
 * synchronisation between them; only device-to-host copies (and error flags read back by
 * ops such as cross_entropy) wait. Device memory is requested here with plain cudaMalloc: the
 * context's arenas keep what they get for the next step, so they are the caching allocator
 * and nothing here caches memory a second time.
 */
#include "common.cuh"

#include <stdio.h>

/* ---- device, context state ------------------------------------------------------------------ */

extern "C" int tm__cuda_device_count(void) {
    int n = 0;
    /* No driver or no device is a normal situation for a CPU-only machine, not an error. */
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

static void tm__gemm_plan_destroy(tm__gemm_plan *p) {
    if (!p->valid) return;
    cublasLtMatrixLayoutDestroy(p->la);
    cublasLtMatrixLayoutDestroy(p->lb);
    cublasLtMatrixLayoutDestroy(p->lc);
    cublasLtMatmulDescDestroy(p->op);
    p->valid = 0;
}

extern "C" void tm__cuda_shutdown(tm_ctx *ctx, void *state) {
    tm__cuda *st = (tm__cuda *)state;
    if (!st) return;
    /* Teardown must go on whatever fails: errors are ignored here on purpose. */
    cudaSetDevice(st->device);
    if (st->stream) cudaStreamSynchronize(st->stream);
    for (int i = 0; i < TM__GEMM_CACHE; i++) tm__gemm_plan_destroy(&st->plans[i]);
    if (st->workspace) cudaFree(st->workspace);
    if (st->lt) cublasLtDestroy(st->lt);
    if (st->stream) cudaStreamDestroy(st->stream);
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

extern "C" tm_status tm__cuda_init(tm_ctx *ctx, int device, void **state) {
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
    *state = st;
    return TM_OK;
}

/* ---- memory ------------------------------------------------------------------------------------ */

extern "C" tm_status tm__cuda_malloc(tm_ctx *ctx, size_t nbytes, void **p) {
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

extern "C" void tm__cuda_free(tm_ctx *ctx, void *p) {
    tm__cuda *st = (tm__cuda *)tm__cuda_state(ctx);
    if (!p || !st) return;
    cudaSetDevice(st->device);
    cudaFree(p); /* synchronises the device: no kernel still reads p */
    (void)cudaGetLastError();
}

extern "C" tm_status tm__cuda_memcpy(tm_ctx *ctx, void *dst, const void *src, size_t nbytes, int kind) {
    tm__cuda *st;
    const char *what = "cuda_memcpy";
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (nbytes == 0) return TM_OK;
    cudaMemcpyKind k = kind == TM__H2D ? cudaMemcpyHostToDevice
                     : kind == TM__D2H ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
    /* From pageable host memory the call returns once the source has been staged, so the
     * caller may reuse `src` at once; the copy itself stays ordered on the stream. */
    TM__CU_CHECK(ctx, what, cudaMemcpyAsync(dst, src, nbytes, k, st->stream));
    if (kind == TM__D2H) TM__CU_CHECK(ctx, what, cudaStreamSynchronize(st->stream));
    return TM_OK;
}

extern "C" tm_status tm__cuda_memset0(tm_ctx *ctx, void *p, size_t nbytes) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "cuda_memset0", &st));
    if (nbytes == 0) return TM_OK;
    TM__CU_CHECK(ctx, "cuda_memset0", cudaMemsetAsync(p, 0, nbytes, st->stream));
    return TM_OK;
}

extern "C" tm_status tm__cuda_sync(tm_ctx *ctx) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "cuda_sync", &st));
    TM__CU_CHECK(ctx, "cuda_sync", cudaStreamSynchronize(st->stream));
    return TM_OK;
}

/* ---- strided copy with conversion, accumulate, fill ---------------------------------------- */

/* Logical shape and element strides of a source tensor, passed by value to kernels. */
typedef struct tm__cu_layout {
    int ndim;
    int64_t shape[TM_MAX_DIMS];
    int64_t stride[TM_MAX_DIMS];
} tm__cu_layout;

static tm__cu_layout tm__cu_layout_of(const tm_tensor *t) {
    tm__cu_layout l;
    memset(&l, 0, sizeof l);
    l.ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) {
        l.shape[d] = t->shape[d];
        l.stride[d] = t->stride[d];
    }
    return l;
}

/* Element offset of logical (row-major) index i. */
__device__ __forceinline__ int64_t tm__cu_offset(const tm__cu_layout &l, int64_t i) {
    int64_t off = 0;
    for (int d = l.ndim - 1; d >= 0; d--) {
        off += (i % l.shape[d]) * l.stride[d];
        i /= l.shape[d];
    }
    return off;
}

/* Conversions with the host's semantics: float -> int truncates, float -> bf16 rounds to
 * nearest even, int -> int wraps like a C cast. */
template <typename D> __device__ __forceinline__ D tm__cvt_f(float v);
template <> __device__ __forceinline__ float tm__cvt_f<float>(float v) { return v; }
template <> __device__ __forceinline__ tm__bf16 tm__cvt_f<tm__bf16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ int32_t tm__cvt_f<int32_t>(float v) { return (int32_t)v; }
template <> __device__ __forceinline__ int64_t tm__cvt_f<int64_t>(float v) { return (int64_t)v; }
template <> __device__ __forceinline__ uint8_t tm__cvt_f<uint8_t>(float v) { return (uint8_t)v; }

template <typename D, typename S> struct tm__cvt {
    __device__ static D go(S v) { return (D)v; } /* int <-> int, int -> f32 */
};
template <typename D> struct tm__cvt<D, float> {
    __device__ static D go(float v) { return tm__cvt_f<D>(v); }
};
template <typename D> struct tm__cvt<D, tm__bf16> {
    __device__ static D go(tm__bf16 v) { return tm__cvt_f<D>(__bfloat162float(v)); }
};
template <typename S> struct tm__cvt<tm__bf16, S> {
    __device__ static tm__bf16 go(S v) { return __float2bfloat16_rn((float)v); }
};
template <> struct tm__cvt<tm__bf16, tm__bf16> {
    __device__ static tm__bf16 go(tm__bf16 v) { return v; }
};
template <> struct tm__cvt<tm__bf16, float> {
    __device__ static tm__bf16 go(float v) { return __float2bfloat16_rn(v); }
};

/* dl.ndim == 0 marks a contiguous destination (no index arithmetic). */
template <typename D, typename S>
__global__ void tm__copy_kernel(D *dst, tm__cu_layout dl, const S *src, tm__cu_layout sl, int64_t n) {
    TM__CU_GRID_STRIDE(i, n) dst[dl.ndim ? tm__cu_offset(dl, i) : i] = tm__cvt<D, S>::go(src[tm__cu_offset(sl, i)]);
}

template <typename D>
static void tm__copy_launch_src(tm_dtype sdt, unsigned g, cudaStream_t s, D *dst, tm__cu_layout dl, const void *src,
                                tm__cu_layout sl, int64_t n) {
    switch (sdt) {
    case TM_F32: tm__copy_kernel<D, float><<<g, TM__CU_THREADS, 0, s>>>(dst, dl, (const float *)src, sl, n); break;
    case TM_BF16: tm__copy_kernel<D, tm__bf16><<<g, TM__CU_THREADS, 0, s>>>(dst, dl, (const tm__bf16 *)src, sl, n); break;
    case TM_I32: tm__copy_kernel<D, int32_t><<<g, TM__CU_THREADS, 0, s>>>(dst, dl, (const int32_t *)src, sl, n); break;
    case TM_I64: tm__copy_kernel<D, int64_t><<<g, TM__CU_THREADS, 0, s>>>(dst, dl, (const int64_t *)src, sl, n); break;
    case TM_U8: tm__copy_kernel<D, uint8_t><<<g, TM__CU_THREADS, 0, s>>>(dst, dl, (const uint8_t *)src, sl, n); break;
    default: break; /* rejected by the caller */
    }
}

static void tm__copy_launch(tm_dtype ddt, tm_dtype sdt, unsigned g, cudaStream_t s, void *d, tm__cu_layout dl,
                            const void *src, tm__cu_layout sl, int64_t n) {
    switch (ddt) {
    case TM_F32: tm__copy_launch_src(sdt, g, s, (float *)d, dl, src, sl, n); break;
    case TM_BF16: tm__copy_launch_src(sdt, g, s, (tm__bf16 *)d, dl, src, sl, n); break;
    case TM_I32: tm__copy_launch_src(sdt, g, s, (int32_t *)d, dl, src, sl, n); break;
    case TM_I64: tm__copy_launch_src(sdt, g, s, (int64_t *)d, dl, src, sl, n); break;
    case TM_U8: tm__copy_launch_src(sdt, g, s, (uint8_t *)d, dl, src, sl, n); break;
    default: break;
    }
}

static int tm__cu_dtype_ok(tm_dtype dt) {
    return dt == TM_F32 || dt == TM_BF16 || dt == TM_I32 || dt == TM_I64 || dt == TM_U8;
}

extern "C" tm_status tm__cuda_copy_into(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src) {
    tm__cuda *st;
    const char *what = "copy_into";
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (!tm__cu_dtype_ok(dst->dtype) || !tm__cu_dtype_ok(src->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "%s: no CUDA conversion from %s to %s", what,
                       tm__tdesc(ctx, src), tm__tdesc(ctx, dst));
    int64_t n = tm__numel(dst);
    if (n == 0) return TM_OK;
    if (src->dtype == dst->dtype && tm__is_contiguous(src)) {
        TM__CU_CHECK(ctx, what, cudaMemcpyAsync(tm__data(dst), tm__data(src), (size_t)n * tm_dtype_size(dst->dtype),
                                                cudaMemcpyDeviceToDevice, st->stream));
        return TM_OK;
    }
    tm__cu_layout dl;
    memset(&dl, 0, sizeof dl); /* contiguous */
    tm__copy_launch(dst->dtype, src->dtype, tm__cu_blocks(st, n), st->stream, tm__data(dst), dl, tm__data(src),
                    tm__cu_layout_of(src), n);
    TM__CU_LAUNCHED(ctx, what, "tm__copy_kernel");
    return TM_OK;
}

template <typename D, typename S>
__global__ void tm__accumulate_kernel(D *dst, tm__cu_layout dl, const S *src, tm__cu_layout sl, int64_t n, float alpha) {
    TM__CU_GRID_STRIDE(i, n) {
        D *d = dst + (dl.ndim ? tm__cu_offset(dl, i) : i);
        tm__st(d, tm__ld(d) + alpha * tm__ld(src + tm__cu_offset(sl, i)));
    }
}

static void tm__accumulate_launch(tm_dtype ddt, tm_dtype sdt, unsigned g, cudaStream_t st, void *d, tm__cu_layout dl,
                                  const void *s, tm__cu_layout sl, int64_t n, float a) {
    if (ddt == TM_F32 && sdt == TM_F32)
        tm__accumulate_kernel<<<g, TM__CU_THREADS, 0, st>>>((float *)d, dl, (const float *)s, sl, n, a);
    else if (ddt == TM_F32)
        tm__accumulate_kernel<<<g, TM__CU_THREADS, 0, st>>>((float *)d, dl, (const tm__bf16 *)s, sl, n, a);
    else if (sdt == TM_F32)
        tm__accumulate_kernel<<<g, TM__CU_THREADS, 0, st>>>((tm__bf16 *)d, dl, (const float *)s, sl, n, a);
    else
        tm__accumulate_kernel<<<g, TM__CU_THREADS, 0, st>>>((tm__bf16 *)d, dl, (const tm__bf16 *)s, sl, n, a);
}

extern "C" tm_status tm__cuda_accumulate(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, double alpha) {
    tm__cuda *st;
    const char *what = "accumulate";
    TM__TRY(tm__cu_enter(ctx, what, &st));
    int fd = dst->dtype == TM_F32 || dst->dtype == TM_BF16, fs = src->dtype == TM_F32 || src->dtype == TM_BF16;
    if (!fd || !fs)
        return tm__err(ctx, TM_ERR_DTYPE, "%s: CUDA accumulates f32/bf16 only, got %s += %s", what,
                       tm__tdesc(ctx, dst), tm__tdesc(ctx, src));
    int64_t n = tm__numel(dst);
    if (n == 0) return TM_OK;
    tm__cu_layout dl;
    memset(&dl, 0, sizeof dl); /* contiguous */
    tm__accumulate_launch(dst->dtype, src->dtype, tm__cu_blocks(st, n), st->stream, tm__data(dst), dl, tm__data(src),
                          tm__cu_layout_of(src), n, (float)alpha);
    TM__CU_LAUNCHED(ctx, what, "tm__accumulate_kernel");
    return TM_OK;
}

/* tm__assign on the device: both sides strided (dst must not overlap itself). */
extern "C" tm_status tm__cuda_assign(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, int accumulate, double alpha) {
    tm__cuda *st;
    const char *what = accumulate ? "assign (accumulate)" : "assign";
    TM__TRY(tm__cu_enter(ctx, what, &st));
    int64_t n = tm__numel(dst);
    if (n == 0) return TM_OK;
    if (accumulate ? !(dst->dtype == TM_F32 || dst->dtype == TM_BF16) || !(src->dtype == TM_F32 || src->dtype == TM_BF16)
                   : !tm__cu_dtype_ok(dst->dtype) || !tm__cu_dtype_ok(src->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "%s: not supported on CUDA from %s to %s", what, tm__tdesc(ctx, src),
                       tm__tdesc(ctx, dst));
    tm__cu_layout dl = tm__cu_layout_of(dst), sl = tm__cu_layout_of(src);
    unsigned g = tm__cu_blocks(st, n);
    if (accumulate)
        tm__accumulate_launch(dst->dtype, src->dtype, g, st->stream, tm__data(dst), dl, tm__data(src), sl, n,
                              (float)alpha);
    else
        tm__copy_launch(dst->dtype, src->dtype, g, st->stream, tm__data(dst), dl, tm__data(src), sl, n);
    TM__CU_LAUNCHED(ctx, what, accumulate ? "tm__accumulate_kernel" : "tm__copy_kernel");
    return TM_OK;
}

template <typename D>
__global__ void tm__fill_kernel(D *dst, D v, int64_t n) {
    TM__CU_GRID_STRIDE(i, n) dst[i] = v;
}

extern "C" tm_status tm__cuda_fill(tm_ctx *ctx, tm_tensor *t, double value) {
    tm__cuda *st;
    const char *what = "fill";
    TM__TRY(tm__cu_enter(ctx, what, &st));
    int64_t n = tm__numel(t);
    if (n == 0) return TM_OK;
    if (!tm__is_contiguous(t))
        return tm__err(ctx, TM_ERR_INTERNAL, "%s: expects a contiguous tensor, got %s", what, tm__tdesc(ctx, t));
    unsigned g = tm__cu_blocks(st, n);
    void *d = tm__data(t);
    cudaStream_t s = st->stream;
    switch (t->dtype) {
    case TM_F32: tm__fill_kernel<<<g, TM__CU_THREADS, 0, s>>>((float *)d, (float)value, n); break;
    case TM_BF16: {
        __nv_bfloat16_raw r;
        r.x = tm__f32_to_bf16((float)value); /* the host's rounding, NaN included */
        tm__bf16 b = r;
        tm__fill_kernel<<<g, TM__CU_THREADS, 0, s>>>((tm__bf16 *)d, b, n);
        break;
    }
    case TM_I32: tm__fill_kernel<<<g, TM__CU_THREADS, 0, s>>>((int32_t *)d, (int32_t)value, n); break;
    case TM_I64: tm__fill_kernel<<<g, TM__CU_THREADS, 0, s>>>((int64_t *)d, (int64_t)value, n); break;
    case TM_U8: tm__fill_kernel<<<g, TM__CU_THREADS, 0, s>>>((uint8_t *)d, (uint8_t)value, n); break;
    default:
        return tm__err(ctx, TM_ERR_DTYPE, "%s: dtype not supported on CUDA: %s", what, tm__tdesc(ctx, t));
    }
    TM__CU_LAUNCHED(ctx, what, "tm__fill_kernel");
    return TM_OK;
}

/* ---- axpy ------------------------------------------------------------------------------------ */

template <typename D, typename S>
__global__ void tm__axpy_kernel(D *dst, const S *src, int64_t n, float alpha) {
    TM__CU_GRID_STRIDE(i, n) tm__st(dst + i, tm__ld(dst + i) + alpha * tm__ld(src + i));
}

extern "C" tm_status tm__cu_axpy(tm_ctx *ctx, const char *what, tm_dtype dst_dt, void *dst, tm_dtype src_dt,
                                 const void *src, int64_t n, float alpha) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (n == 0) return TM_OK;
    unsigned g = tm__cu_blocks(st, n);
    cudaStream_t s = st->stream;
    if (dst_dt == TM_F32 && src_dt == TM_F32)
        tm__axpy_kernel<<<g, TM__CU_THREADS, 0, s>>>((float *)dst, (const float *)src, n, alpha);
    else if (dst_dt == TM_F32)
        tm__axpy_kernel<<<g, TM__CU_THREADS, 0, s>>>((float *)dst, (const tm__bf16 *)src, n, alpha);
    else if (src_dt == TM_F32)
        tm__axpy_kernel<<<g, TM__CU_THREADS, 0, s>>>((tm__bf16 *)dst, (const float *)src, n, alpha);
    else
        tm__axpy_kernel<<<g, TM__CU_THREADS, 0, s>>>((tm__bf16 *)dst, (const tm__bf16 *)src, n, alpha);
    TM__CU_LAUNCHED(ctx, what, "tm__axpy_kernel");
    return TM_OK;
}

/* ---- deterministic reduction over the middle axis ----------------------------------------- */
/*
 * src [O, A, I] -> out [O, S, I] where split s sums rows a in [s*chunk, (s+1)*chunk).
 * I == 1 (a contiguous row per (o, s)): one block strides over the row and reduces in a fixed
 * tree. I > 1: a block of 32 x 8 threads takes 32 consecutive i (coalesced) and 8 row
 * phases; the 8 partials are added in order. Both are deterministic for a given launch shape.
 */
#define TM__RED_ROWS 8

template <typename T, typename D>
__global__ void tm__reduce_row_kernel(const T *src, D *out, int64_t A, int S, int64_t chunk, float alpha,
                                      int accumulate) {
    __shared__ float sh[32];
    int64_t os = blockIdx.x; /* o * S + s */
    int64_t o = os / S, s = os % S;
    int64_t a0 = s * chunk, a1 = a0 + chunk < A ? a0 + chunk : A;
    const T *row = src + o * A;
    float v = 0.0f;
    for (int64_t a = a0 + threadIdx.x; a < a1; a += blockDim.x) v += tm__ld(row + a);
    v = tm__block_sum(v, sh);
    if (threadIdx.x == 0) {
        float r = alpha * v;
        if (accumulate) r += tm__ld(out + os);
        tm__st(out + os, r);
    }
}

template <typename T, typename D>
__global__ void tm__reduce_col_kernel(const T *src, D *out, int64_t A, int64_t I, int S, int64_t chunk,
                                      float alpha, int accumulate) {
    __shared__ float sh[TM__RED_ROWS][33];
    int64_t nib = (I + 31) / 32;
    int64_t b = blockIdx.x;
    int64_t ib = b % nib, os = b / nib; /* os = o * S + s */
    int64_t o = os / S, s = os % S;
    int64_t i = ib * 32 + threadIdx.x;
    int64_t a0 = s * chunk, a1 = a0 + chunk < A ? a0 + chunk : A;
    float v = 0.0f;
    if (i < I)
        for (int64_t a = a0 + threadIdx.y; a < a1; a += TM__RED_ROWS) v += tm__ld(src + (o * A + a) * I + i);
    sh[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.y == 0 && i < I) {
        float r = 0.0f;
        for (int y = 0; y < TM__RED_ROWS; y++) r += sh[y][threadIdx.x];
        r *= alpha;
        int64_t idx = os * I + i;
        if (accumulate) r += tm__ld(out + idx);
        tm__st(out + idx, r);
    }
}

template <typename T, typename D>
static void tm__reduce_launch(const tm__cuda *st, const T *src, D *out, int64_t O, int64_t A, int64_t I, int S,
                              float alpha, int accumulate) {
    int64_t chunk = (A + S - 1) / S;
    if (chunk < 1) chunk = 1;
    if (I == 1) {
        int threads = tm__cu_row_threads(chunk);
        tm__reduce_row_kernel<<<(unsigned)(O * S), threads, 0, st->stream>>>(src, out, A, S, chunk, alpha, accumulate);
    } else {
        dim3 block(32, TM__RED_ROWS);
        int64_t nb = O * S * ((I + 31) / 32);
        tm__reduce_col_kernel<<<(unsigned)nb, block, 0, st->stream>>>(src, out, A, I, S, chunk, alpha, accumulate);
    }
}

template <typename T>
static void tm__reduce_launch_dst(const tm__cuda *st, const T *src, tm_dtype dst_dt, void *dst, int64_t O, int64_t A,
                                  int64_t I, int S, float alpha, int accumulate) {
    if (dst_dt == TM_BF16) tm__reduce_launch(st, src, (tm__bf16 *)dst, O, A, I, S, alpha, accumulate);
    else tm__reduce_launch(st, src, (float *)dst, O, A, I, S, alpha, accumulate);
}

extern "C" tm_status tm__cu_reduce(tm_ctx *ctx, const char *what, tm_dtype src_dt, const void *src,
                                   tm_dtype dst_dt, void *dst, int64_t O, int64_t A, int64_t I, float alpha,
                                   int accumulate) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (O * I == 0) return TM_OK;
    /* Split A when the blocks of one pass would not fill the GPU and rows are long enough
     * to be worth a second pass. */
    int64_t base = O * (I == 1 ? 1 : (I + 31) / 32);
    int64_t want = (int64_t)st->num_sms * 4;
    int64_t S = 1;
    if (base < want && A >= 1024) {
        S = want / base;
        int64_t max_s = A / 256; /* at least 256 rows per split */
        if (S > max_s) S = max_s;
        if (S > 1024) S = 1024;
        if (S < 1) S = 1;
    }
    if (S == 1) {
        if (src_dt == TM_BF16) tm__reduce_launch_dst(st, (const tm__bf16 *)src, dst_dt, dst, O, A, I, 1, alpha, accumulate);
        else tm__reduce_launch_dst(st, (const float *)src, dst_dt, dst, O, A, I, 1, alpha, accumulate);
        TM__CU_LAUNCHED(ctx, what, "tm__reduce_*_kernel");
        return TM_OK;
    }
    void *part;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)(O * S * I) * sizeof(float), &part));
    if (src_dt == TM_BF16) tm__reduce_launch(st, (const tm__bf16 *)src, (float *)part, O, A, I, (int)S, 1.0f, 0);
    else tm__reduce_launch(st, (const float *)src, (float *)part, O, A, I, (int)S, 1.0f, 0);
    TM__CU_LAUNCHED(ctx, what, "tm__reduce_*_kernel (partials)");
    tm__reduce_launch_dst(st, (const float *)part, dst_dt, dst, O, S, I, 1, alpha, accumulate);
    TM__CU_LAUNCHED(ctx, what, "tm__reduce_*_kernel (final)");
    return TM_OK;
}

/* ---- GEMM through cuBLASLt ---------------------------------------------------------------------- */
/*
 * Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a row-major matrix with
 * row stride ld is, read column-major, its transpose with leading dimension ld. So cuBLASLt
 * computes with its "A" = our B and its "B" = our A, transposes as given, m = N, n = M.
 */

/* The largest power of two (<= 256) dividing the address: cuBLASLt's heuristic must not pick
 * an algorithm that assumes more alignment than a view into the middle of a tensor has. */
static uint32_t tm__align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && (a & (al - 1))) al >>= 1;
    return al;
}

static tm_status tm__gemm_plan_make(tm_ctx *ctx, tm__cuda *st, tm__gemm_plan *p) {
    const char *what = "gemm";
    cudaDataType_t ty = p->dt == TM_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    /* f32 inputs accumulate in true f32 (not TF32): CPU/CUDA parity stays at f32 precision. */
    TM__LT_CHECK(ctx, what, cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = p->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt A = our B */
    cublasOperation_t tb = p->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt B = our A */
    TM__LT_CHECK(ctx, what, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    TM__LT_CHECK(ctx, what, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    /* Stored shapes, column-major (rows, cols): our B is [K,N] row-major -> (N, K), or (K, N)
     * when transposed; our A [M,K] -> (K, M), or (M, K); C -> (N, M). */
    uint64_t la_r = p->trans_b ? p->K : p->N, la_c = p->trans_b ? p->N : p->K;
    uint64_t lb_r = p->trans_a ? p->M : p->K, lb_c = p->trans_a ? p->K : p->M;
    TM__LT_CHECK(ctx, what, cublasLtMatrixLayoutCreate(&p->la, ty, la_r, la_c, p->ldb));
    TM__LT_CHECK(ctx, what, cublasLtMatrixLayoutCreate(&p->lb, ty, lb_r, lb_c, p->lda));
    TM__LT_CHECK(ctx, what, cublasLtMatrixLayoutCreate(&p->lc, ty, p->N, p->M, p->ldc));
    if (p->batch > 1) {
        int32_t bc = (int32_t)p->batch;
        struct { cublasLtMatrixLayout_t l; int64_t s; } ls[3] = {{p->la, p->sb}, {p->lb, p->sa}, {p->lc, p->sc}};
        for (int i = 0; i < 3; i++) {
            TM__LT_CHECK(ctx, what, cublasLtMatrixLayoutSetAttribute(ls[i].l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
            TM__LT_CHECK(ctx, what, cublasLtMatrixLayoutSetAttribute(ls[i].l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                                     &ls[i].s, sizeof ls[i].s));
        }
    }
    cublasLtMatmulPreference_t pref;
    TM__LT_CHECK(ctx, what, cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = st->workspace_bytes;
    cublasStatus_t bs = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    uint32_t al[4] = {p->align_b, p->align_a, p->align_c, p->align_c};
    cublasLtMatmulPreferenceAttributes_t at[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4 && bs == CUBLAS_STATUS_SUCCESS; i++)
        bs = cublasLtMatmulPreferenceSetAttribute(pref, at[i], &al[i], sizeof al[i]);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    if (bs == CUBLAS_STATUS_SUCCESS)
        bs = cublasLtMatmulAlgoGetHeuristic(st->lt, p->op, p->la, p->lb, p->lc, p->lc, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (bs != CUBLAS_STATUS_SUCCESS)
        return tm__err(ctx, TM_ERR_CUDA, "%s: cublasLtMatmulAlgoGetHeuristic failed at %s:%d: %s (%d)", what,
                       __FILE__, __LINE__, cublasLtGetStatusString(bs), (int)bs);
    if (found < 1)
        return tm__err(ctx, TM_ERR_UNSUPPORTED,
                       "%s: cuBLASLt has no algorithm for %s M=%lld N=%lld K=%lld batch=%lld trans=(%d,%d)", what,
                       tm_dtype_name(p->dt), (long long)p->M, (long long)p->N, (long long)p->K,
                       (long long)p->batch, p->trans_a, p->trans_b);
    p->algo = res.algo;
    return TM_OK;
}

static tm_status tm__gemm_plan_get(tm_ctx *ctx, tm__cuda *st, const tm__gemm_plan *key, tm__gemm_plan **out) {
    for (int i = 0; i < TM__GEMM_CACHE; i++) {
        tm__gemm_plan *p = &st->plans[i];
        if (p->valid && p->dt == key->dt && p->trans_a == key->trans_a && p->trans_b == key->trans_b &&
            p->M == key->M && p->N == key->N && p->K == key->K && p->lda == key->lda && p->ldb == key->ldb &&
            p->ldc == key->ldc && p->batch == key->batch && p->sa == key->sa && p->sb == key->sb &&
            p->sc == key->sc && p->align_a == key->align_a && p->align_b == key->align_b &&
            p->align_c == key->align_c) {
            *out = p;
            return TM_OK;
        }
    }
    int slot = -1;
    for (int i = 0; i < TM__GEMM_CACHE && slot < 0; i++)
        if (!st->plans[i].valid) slot = i;
    if (slot < 0) {
        slot = st->next_victim;
        st->next_victim = (st->next_victim + 1) % TM__GEMM_CACHE;
        tm__gemm_plan_destroy(&st->plans[slot]);
    }
    tm__gemm_plan *p = &st->plans[slot];
    *p = *key;
    p->valid = 0;
    p->op = NULL;
    p->la = p->lb = p->lc = NULL;
    tm_status s = tm__gemm_plan_make(ctx, st, p);
    if (s != TM_OK) {
        /* Release whatever was created before the failure. */
        if (p->la) cublasLtMatrixLayoutDestroy(p->la);
        if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
        if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
        if (p->op) cublasLtMatmulDescDestroy(p->op);
        return s;
    }
    p->valid = 1;
    *out = p;
    return TM_OK;
}

extern "C" tm_status tm__gemm_cuda(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N,
                                   int64_t K, double alpha, const void *A, int64_t lda, int64_t sa, const void *B,
                                   int64_t ldb, int64_t sb, double beta, void *C, int64_t ldc, int64_t sc,
                                   int64_t batch) {
    tm__cuda *st;
    const char *what = "gemm";
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (dt != TM_F32 && dt != TM_BF16)
        return tm__err(ctx, TM_ERR_DTYPE, "%s: CUDA GEMM takes f32 or bf16, got %s", what, tm_dtype_name(dt));
    if (batch < 1) batch = 1;
    if (M == 0 || N == 0) return TM_OK;
    if (batch > INT32_MAX)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: batch %lld exceeds cuBLASLt's limit", what, (long long)batch);
    if (K == 0) {
        /* An empty inner dimension: C = beta * C, which cuBLASLt does not take as a GEMM. */
        if (beta == 1.0) return TM_OK;
        if (beta == 0.0 && ldc == N && (batch == 1 || sc == M * N))
            TM__CU_CHECK(ctx, what, cudaMemsetAsync(C, 0, (size_t)(batch * M * N) * tm_dtype_size(dt), st->stream));
        else
            return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: K == 0 with beta %g on a strided C", what, beta);
        return TM_OK;
    }
    tm__gemm_plan key;
    memset(&key, 0, sizeof key);
    key.dt = dt;
    key.trans_a = trans_a != 0;
    key.trans_b = trans_b != 0;
    key.M = M; key.N = N; key.K = K;
    key.lda = lda; key.ldb = ldb; key.ldc = ldc;
    key.batch = batch;
    key.sa = batch > 1 ? sa : 0;
    key.sb = batch > 1 ? sb : 0;
    key.sc = batch > 1 ? sc : 0;
    key.align_a = tm__align_of(A);
    key.align_b = tm__align_of(B);
    key.align_c = tm__align_of(C);
    tm__gemm_plan *p;
    TM__TRY(tm__gemm_plan_get(ctx, st, &key, &p));
    float fa = (float)alpha, fb = (float)beta;
    TM__LT_CHECK(ctx, what, cublasLtMatmul(st->lt, p->op, &fa, B, p->la, A, p->lb, &fb, C, p->lc, C, p->lc, &p->algo,
                                           st->workspace, st->workspace_bytes, st->stream));
    return TM_OK;
}
