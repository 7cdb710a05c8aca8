/*
 * copy.cu — the CUDA backend's untaped data movement: dtype-converting strided copy,
 * accumulate, assign and fill (the copy_into / accumulate / assign / fill entries of the backend
 * table; contracts in framework/internal.h). Conversions follow the host's semantics exactly.
 *
 * Layout: a source of up to 4 dims is read through its (shape, stride) by logical row-major
 * index; destinations are contiguous except for assign, which takes any strides on both sides.
 *
 * Two paths. The vector path, for f32/bf16 on both sides, moves N = 16 / max(element sizes)
 * elements per access (8 for bf16 -> bf16, else 4) and computes the strided offset once per N
 * elements: it needs every strided side's last dimension of stride 1 with a length N divides,
 * its other strides multiples of N and its data aligned to N elements (tm__vec_width). That is
 * what the autograd's view backwards (head transposes, slices of a fused projection) and
 * contiguous() copies of them look like. Everything else takes the element path: one element
 * per thread, the offset's divisions per element. Both compute the same f32 expression per
 * element (dst + alpha * src for accumulate), so they give the same bits.
 */
#include "common.cuh"
#include "vec.cuh"

#include <algorithm>

/* ---- strided copy with conversion, accumulate, fill ---------------------------------------- */

/* Logical shape and element strides of a source tensor, passed by value to kernels. With
 * fast = 1 (fewer than 2^31 elements) the offset's divisions by the dimensions are a multiply
 * and a shift by per-dimension magic numbers (q = umulhi(i, mul) >> shr, exact for i < 2^31:
 * the round-up method of Granlund and Montgomery, "Division by invariant integers using
 * multiplication", 1994, as CUTLASS's FastDivmod uses it): a 64-bit division is a long
 * software sequence on the GPU and made the strided copies compute-bound. */
typedef struct tm__cu_layout {
    int ndim;
    int fast;
    int64_t shape[TM_MAX_DIMS];
    int64_t stride[TM_MAX_DIMS];
    uint32_t mul[TM_MAX_DIMS]; /* 0: the dimension is 1 (q = i) */
    uint32_t shr[TM_MAX_DIMS];
} tm__cu_layout;

static tm__cu_layout tm__cu_layout_of(const tm_tensor *t) {
    tm__cu_layout l;
    memset(&l, 0, sizeof l);
    l.ndim = t->ndim;
    l.fast = tm__numel(t) < ((int64_t)1 << 31);
    for (int d = 0; d < t->ndim; d++) {
        l.shape[d] = t->shape[d];
        l.stride[d] = t->stride[d];
        const uint64_t div = (uint64_t)t->shape[d];
        if (!l.fast || div <= 1) continue;
        int lg = 0; /* ceil(log2(div)) */
        while (((uint64_t)1 << lg) < div) lg++;
        const int p = 31 + lg;
        l.mul[d] = (uint32_t)((((uint64_t)1 << p) + div - 1) / div); /* < 2^32 since 2^lg < 2 div */
        l.shr[d] = (uint32_t)(p - 32);
    }
    return l;
}

/* Element offset of logical (row-major) index i. The loops are unrolled over TM_MAX_DIMS so
 * that every field is read at a constant offset of the kernel's parameters: a loop bounded by
 * the runtime ndim indexes them dynamically, which makes each thread copy the struct to local
 * memory first. */
__device__ __forceinline__ int64_t tm__cu_offset(const tm__cu_layout &l, int64_t i) {
    int64_t off = 0;
    if (l.fast) {
        uint32_t u = (uint32_t)i;
#pragma unroll
        for (int d = TM_MAX_DIMS - 1; d >= 0; d--) {
            if (d >= l.ndim) continue;
            const uint32_t q = l.mul[d] ? __umulhi(u, l.mul[d]) >> l.shr[d] : u;
            off += (int64_t)(u - q * (uint32_t)l.shape[d]) * l.stride[d];
            u = q;
        }
        return off;
    }
#pragma unroll
    for (int d = TM_MAX_DIMS - 1; d >= 0; d--) {
        if (d >= l.ndim) continue;
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

/* ---- the vector path --------------------------------------------------------------------- */

/* dst[i .. i+N) (=|+=) src[i .. i+N) for logical index i = v N, v < nv; a layout with ndim 0 is
 * contiguous. N consecutive logical elements are consecutive in memory on both sides (the
 * host checked), so one offset serves the N of them. */
template <typename D, typename S, bool ACC>
__global__ void tm__xfer_vec_kernel(D *dst, tm__cu_layout dl, const S *src, tm__cu_layout sl, int64_t nv, float alpha) {
    constexpr int N = 16 / (int)(sizeof(D) > sizeof(S) ? sizeof(D) : sizeof(S));
    TM__CU_GRID_STRIDE(v, nv) {
        const int64_t i = v * N;
        D *d = dst + (dl.ndim ? tm__cu_offset(dl, i) : i);
        float x[N];
        tm__vld<N>(src + (sl.ndim ? tm__cu_offset(sl, i) : i), x);
        if constexpr (ACC) {
            float y[N];
            tm__vld<N>(d, y);
#pragma unroll
            for (int k = 0; k < N; k++) x[k] = y[k] + alpha * x[k];
        }
        tm__vst<N>(d, x);
    }
}

static int tm__cu_float(tm_dtype dt) { return dt == TM_F32 || dt == TM_BF16; }

/* Whether strided tensor t allows N-element accesses: last stride 1, N divides the last length
 * and every other stride, data aligned to N elements. */
static int tm__vec_layout_ok(const tm_tensor *t, int N) {
    if (t->ndim < 1 || t->stride[t->ndim - 1] != 1 || t->shape[t->ndim - 1] % N) return 0;
    for (int d = 0; d < t->ndim - 1; d++)
        if (t->shape[d] > 1 && t->stride[d] % N) return 0;
    return ((uintptr_t)tm__data(t) % ((uintptr_t)N * tm_dtype_size(t->dtype))) == 0;
}

/* N of the vector path for dst <- src (dst_strided: dst is read through its layout, else
 * contiguous), or 0 where the element path must run. */
static int tm__vec_width(const tm_tensor *dst, int dst_strided, const tm_tensor *src) {
    if (!tm__cu_float(dst->dtype) || !tm__cu_float(src->dtype)) return 0;
    const int N = 16 / (int)std::max(tm_dtype_size(dst->dtype), tm_dtype_size(src->dtype));
    if (!tm__vec_layout_ok(src, N)) return 0;
    if (dst_strided) return tm__vec_layout_ok(dst, N) ? N : 0;
    return (uintptr_t)tm__data(dst) % ((uintptr_t)N * tm_dtype_size(dst->dtype)) == 0 ? N : 0;
}

template <typename D, typename S>
static void tm__xfer_vec_launch_t(const tm__cuda *st, int acc, void *d, tm__cu_layout dl, const void *s,
                                  tm__cu_layout sl, int64_t nv, float a) {
    const unsigned g = tm__cu_blocks(st, nv);
    if (acc) tm__xfer_vec_kernel<D, S, true><<<g, TM__CU_THREADS, 0, st->stream>>>((D *)d, dl, (const S *)s, sl, nv, a);
    else tm__xfer_vec_kernel<D, S, false><<<g, TM__CU_THREADS, 0, st->stream>>>((D *)d, dl, (const S *)s, sl, nv, a);
}

/* The vector path over n elements in N-element accesses (n % N == 0: N divides the last dim). */
static void tm__xfer_vec_launch(const tm__cuda *st, int acc, tm_tensor *dst, tm__cu_layout dl, const tm_tensor *src,
                                int N, int64_t n, float a) {
    tm__cu_layout sl;
    if (tm__is_contiguous(src)) memset(&sl, 0, sizeof sl);
    else sl = tm__cu_layout_of(src);
    void *d = tm__data(dst);
    const void *s = tm__data(src);
    const int64_t nv = n / N;
    if (dst->dtype == TM_F32 && src->dtype == TM_F32) tm__xfer_vec_launch_t<float, float>(st, acc, d, dl, s, sl, nv, a);
    else if (dst->dtype == TM_F32) tm__xfer_vec_launch_t<float, tm__bf16>(st, acc, d, dl, s, sl, nv, a);
    else if (src->dtype == TM_F32) tm__xfer_vec_launch_t<tm__bf16, float>(st, acc, d, dl, s, sl, nv, a);
    else tm__xfer_vec_launch_t<tm__bf16, tm__bf16>(st, acc, d, dl, s, sl, nv, a);
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
    if (int N = tm__vec_width(dst, 0, src)) {
        tm__xfer_vec_launch(st, 0, dst, dl, src, N, n, 1.0f);
        TM__CU_LAUNCHED(ctx, what, "tm__xfer_vec_kernel");
        return TM_OK;
    }
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
    if (int N = tm__vec_width(dst, 0, src)) {
        tm__xfer_vec_launch(st, 1, dst, dl, src, N, n, (float)alpha);
        TM__CU_LAUNCHED(ctx, what, "tm__xfer_vec_kernel");
        return TM_OK;
    }
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
    if (int N = tm__vec_width(dst, 1, src)) {
        if (tm__is_contiguous(dst)) memset(&dl, 0, sizeof dl);
        tm__xfer_vec_launch(st, accumulate, dst, dl, src, N, n, (float)alpha);
        TM__CU_LAUNCHED(ctx, what, "tm__xfer_vec_kernel");
        return TM_OK;
    }
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

