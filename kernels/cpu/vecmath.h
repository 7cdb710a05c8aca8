/*
 * vecmath.h — what the CPU kernels need to vectorise transcendental f32 loops without
 * -ffast-math: a branchless expf the vectoriser can see through (libm's expf is an opaque call,
 * so an `omp simd` loop calling it stays scalar), and the attribute that compiles a hot
 * function a second time for AVX2 + FMA.
 */
#ifndef TM_KERNELS_CPU_VECMATH_H
#define TM_KERNELS_CPU_VECMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The library is built for the baseline x86-64 ISA (SSE2: 4 f32 lanes, no FMA). On x86-64 GCC
 * a function marked TM__SIMD_CLONES is also compiled for x86-64-v3 (AVX2 + FMA: 8 lanes) and
 * the copy is picked at load time, as in kernels/cpu/gemm.c; OpenMP regions inside it are
 * outlined into each copy. fp-contract=fast lets that copy fuse a * b + c (-std=c11 turns
 * contraction off), so results may differ from the baseline copy in the last bit — but never
 * with the thread count: the same copy runs on every thread. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TM__SIMD_CLONES \
    __attribute__((target_clones("arch=x86-64-v3", "default"), optimize("fp-contract=fast")))
#else
#define TM__SIMD_CLONES
#endif

/* For helpers of a TM__SIMD_CLONES function: inlined, they are compiled with each copy; left
 * out of line (GCC declines `inline` for large or repeated calls), they would run the baseline
 * code from the AVX2 copy too. */
#if defined(__GNUC__)
#define TM__FORCE_INLINE inline __attribute__((always_inline))
#else
#define TM__FORCE_INLINE inline
#endif

#if defined(__GNUC__) && !defined(TM__UNROLL)
#define TM__PRAGMA(x) _Pragma(#x)
#define TM__UNROLL(n) TM__PRAGMA(GCC unroll n)
#elif !defined(TM__UNROLL)
#define TM__UNROLL(n)
#endif

/*
 * e^x in f32, branchless. Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, with ln2 split
 * into a 9-bit head (n * head is exact for |n| < 2^15) and a tail; e^r by the degree-7
 * polynomial of Cephes' expf (S. Moshier, Cephes Math Library 2.x: 1 + r + r^2 P(r));
 * 2^n written straight into the exponent bits. Measured against exp() in f64 on every float
 * in [-87.33654, 88.37626]: 0.99 ulp at most without FMA, 1.01 with it (tests/test_activation.c
 * checks a sweep at 2 ulp).
 * Range: below -87.33654 (= ln FLT_MIN, where the result would be subnormal) it returns 0;
 * above 88.37626 (= 127.5 ln 2, where n would reach 128) +inf, where libm's expf stays finite
 * up to 88.72284 — immaterial to its users: sigmoid(x) = 1 / (1 + e^-x) is then 0 (true value
 * < 3e-39), and a softmax only takes e^(s - max) <= 1. NaN gives NaN.
 * n is rounded with the 1.5 * 2^23 shifter, not rintf or a float -> int conversion: the sum
 * t = x log2(e) + 1.5 * 2^23 holds round(x log2(e)) in its low mantissa bits, so
 * bits(t) << 23 is n << 23 (the exponent field and the 2^22 of the shifter fall off the top),
 * and adding 127 << 23 makes the float 2^n. SSE2 has every instruction of it.
 */
static TM__FORCE_INLINE float tm__exp_f32(float x) {
    const float lo = -87.33654475f, hi = 88.3762626647949f, shifter = 0x1.8p23f;
    const float t = x * 1.44269504088896341f + shifter;
    const float n = t - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    uint32_t bits;
    memcpy(&bits, &t, sizeof bits);
    bits = (bits << 23) + (127u << 23);
    float scale, e;
    memcpy(&scale, &bits, sizeof scale);
    e = p * scale;
    /* Outside [lo, hi] e is garbage (2^n wrapped; inf - inf in r for x = +-inf) and is replaced
     * whole, in the integer domain: GCC turns a float select such as `x < lo ? 0 : e` (or a
     * clamp of x) into a branch around the arithmetic, and under the default -ftrapping-math
     * it will not if-convert that back, so the loop would not vectorise. */
    const uint32_t under = -(uint32_t)(x < lo), over = -(uint32_t)(x > hi);
    memcpy(&bits, &e, sizeof bits);
    bits = (bits & ~(under | over)) | (over & 0x7f800000u); /* 0x7f800000: +inf */
    memcpy(&e, &bits, sizeof e);
    return e;
}

#endif
