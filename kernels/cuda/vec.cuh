/*
 * vec.cuh — N consecutive f32 or bf16 elements moved as one aligned 8- or 16-byte access and
 * widened to f32 (loads) or rounded from f32 (stores), so that bandwidth-bound kernels issue a
 * quarter or an eighth of the memory instructions. N = 1 is the plain element access
 * (tm__ld / tm__st), the fallback for odd sizes and misaligned views.
 *
 *   tm__vld<N>(p, f)   f[0..N) = p[0..N) as f32 (bf16 widened by its bits: exact)
 *   tm__vst<N>(p, f)   p[0..N) = f[0..N), bf16 rounded to nearest even (as tm__st)
 *   tm__vldraw<N>(p), tm__vwiden<N, T>(raw, f)   tm__vld in two steps (loads issued early)
 *   tm__vec_n<T>::n    the N of a 16-byte access
 *   tm__vsplit(p, lo, hi, ...)   a range as head, whole 16-byte vectors, tail
 *   tm__vld_group<G>(p, f, vec), tm__vst_group<G>   G elements, vectors when vec, same order
 *
 * p must be aligned to N * sizeof(T) bytes; N * sizeof(T) is sizeof(T), 8 or 16. The caller
 * checks alignment and divisibility on the host and picks N (tm__vec_ok).
 */
#ifndef TM_CUDA_VEC_CUH
#define TM_CUDA_VEC_CUH

#include "common.cuh"

#include <type_traits>

/* The raw access type of N elements of T. */
template <typename T, int N>
struct tm__vraw {
    static constexpr int bytes = N * (int)sizeof(T);
    static_assert(N == 1 || bytes == 8 || bytes == 16, "one element, 8 or 16 bytes");
    using type = typename std::conditional<bytes == 16, uint4, typename std::conditional<bytes == 8, uint2, T>::type>::type;
};

__device__ __forceinline__ void tm__vwords(const uint4 &q, unsigned *w) { w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w; }
__device__ __forceinline__ void tm__vwords(const uint2 &q, unsigned *w) { w[0] = q.x, w[1] = q.y; }
__device__ __forceinline__ void tm__vpack(uint4 &q, const unsigned *w) { q = make_uint4(w[0], w[1], w[2], w[3]); }
__device__ __forceinline__ void tm__vpack(uint2 &q, const unsigned *w) { q = make_uint2(w[0], w[1]); }

__device__ __forceinline__ unsigned tm__bf16_bits(float v) { return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(v)); }

/* Elements of T in 16 bytes. */
template <typename T>
struct tm__vec_n {
    static constexpr int n = 16 / (int)sizeof(T);
};

/* The raw access alone, so that several loads can be in flight before any is widened:
 * tm__vwiden(tm__vldraw(p)) is tm__vld(p). */
template <int N, typename T>
__device__ __forceinline__ typename tm__vraw<T, N>::type tm__vldraw(const T *p) {
    return *reinterpret_cast<const typename tm__vraw<T, N>::type *>(p);
}

template <int N, typename T>
__device__ __forceinline__ void tm__vwiden(const typename tm__vraw<T, N>::type &r, float *f) {
    if constexpr (N == 1) {
        f[0] = tm__ld(&r);
    } else {
        unsigned w[sizeof(r) / 4];
        tm__vwords(r, w);
        if constexpr (sizeof(T) == 4) {
#pragma unroll
            for (int i = 0; i < N; i++) f[i] = __uint_as_float(w[i]);
        } else {
#pragma unroll
            for (int i = 0; i < N / 2; i++) { /* little endian: element 2i is the low half */
                f[2 * i] = __uint_as_float(w[i] << 16);
                f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
            }
        }
    }
}

template <int N, typename T>
__device__ __forceinline__ void tm__vld(const T *p, float *f) {
    tm__vwiden<N, T>(tm__vldraw<N>(p), f);
}

template <int N, typename T>
__device__ __forceinline__ void tm__vst(T *p, const float *f) {
    if constexpr (N == 1) {
        tm__st(p, f[0]);
    } else {
        using R = typename tm__vraw<T, N>::type;
        unsigned w[sizeof(R) / 4];
        if constexpr (sizeof(T) == 4) {
#pragma unroll
            for (int i = 0; i < N; i++) w[i] = __float_as_uint(f[i]);
        } else {
#pragma unroll
            for (int i = 0; i < N / 2; i++) w[i] = tm__bf16_bits(f[2 * i]) | tm__bf16_bits(f[2 * i + 1]) << 16;
        }
        R r;
        tm__vpack(r, w);
        *reinterpret_cast<R *>(p) = r;
    }
}

/* G consecutive elements (G a multiple of 16 bytes' worth) as whole 16-byte accesses when vec
 * (p 16-byte aligned), else G element accesses: the same values, in the same order, either
 * way. Kernels that read rows in groups of G use these so that a row's alignment (or its dtype)
 * changes the access width but not which thread sums which element in which order. */
template <int G, typename T>
__device__ __forceinline__ void tm__vld_group(const T *p, float *f, bool vec) {
    constexpr int N = tm__vec_n<T>::n;
    static_assert(G % N == 0, "a group is whole 16-byte vectors");
    if (vec) {
#pragma unroll
        for (int h = 0; h < G / N; h++) tm__vld<N>(p + h * N, f + h * N);
    } else {
#pragma unroll
        for (int k = 0; k < G; k++) f[k] = tm__ld(p + k);
    }
}

template <int G, typename T>
__device__ __forceinline__ void tm__vst_group(T *p, const float *f, bool vec) {
    constexpr int N = tm__vec_n<T>::n;
    static_assert(G % N == 0, "a group is whole 16-byte vectors");
    if (vec) {
#pragma unroll
        for (int h = 0; h < G / N; h++) tm__vst<N>(p + h * N, f + h * N);
    } else {
#pragma unroll
        for (int k = 0; k < G; k++) tm__st(p + k, f[k]);
    }
}

/* [lo, hi) of p as a head [lo, *a) up to the first 16-byte boundary, *nv whole 16-byte vectors
 * from *a, and a tail [*b, hi): the split of a range whose start is not aligned (a row of odd
 * length, a chunk of a bucket). p must be aligned to its element size. */
template <typename T>
__device__ __forceinline__ void tm__vsplit(const T *p, int64_t lo, int64_t hi, int64_t *a, int64_t *nv, int64_t *b) {
    constexpr int N = tm__vec_n<T>::n;
    int64_t s = lo + (int64_t)(((16u - ((uintptr_t)(p + lo) & 15u)) & 15u) / sizeof(T));
    if (s > hi) s = hi;
    *a = s;
    *nv = (hi - s) / N;
    *b = s + *nv * N;
}

#endif /* TM_CUDA_VEC_CUH */
