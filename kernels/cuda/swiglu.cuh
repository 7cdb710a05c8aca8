/*
 * swiglu.cuh — the per-element arithmetic of SiLU and SwiGLU (Shazeer 2020), shared by the
 * elementwise kernels (activation.cu) and the Hopper grouped GEMM's fused SwiGLU epilogue
 * (grouped_matmul_sm90.cu), so that the fused and the separate forward give the same bits.
 *   silu(x) = x sigmoid(x),  swiglu(g, u) = silu(g) u,  sigmoid(x) = 1 / (1 + e^-x)
 *   silu'(x) = s (1 + x (1 - s)), s = sigmoid(x)
 *   swiglu:  dgate = dy u silu'(g),  dup = dy silu(g)
 * f32 throughout, the same expression in the same order everywhere. The sigmoid takes e^-x as
 * ex2.approx(-x log2 e) and its reciprocal by rcp.approx (each within 2 ulp; e^-x then carries the
 * rounding of its argument, |x| 2^-24 relative: 1e-6 at |x| = 16), not expf and an IEEE division:
 * two MUFU instructions instead of about forty, which is what lets the Hopper GEMM compute h in its
 * epilogue without stalling its tensor cores (the IEEE version cost that kernel a third of its
 * speed at the coarse preset's shapes). Limits as expf's: x -> -inf gives e^-x = inf, sigmoid 0;
 * x -> +inf gives 1; NaN stays NaN. The ftz forms flush a subnormal sigmoid (x in about
 * [-88.7, -87.3]) to 0, so silu there is -0 where the CPU's f64 gives about -5e-37. f32 silu and
 * swiglu on CUDA carry these errors too (within the parity tests' 1e-5). acc is the gradient already accumulated in dx / dgate / dup.
 */
#ifndef TM_SWIGLU_CUH
#define TM_SWIGLU_CUH

#include "mma.cuh" /* tm__ex2_approx, tm__rcp_approx */

__device__ __forceinline__ float tm__sigmoidf(float x) { return tm__rcp_approx(1.0f + tm__ex2_approx(x * -1.4426950408889634f)); }

__device__ __forceinline__ float tm__silu_fwd(float v) { return v * tm__sigmoidf(v); }
__device__ __forceinline__ float tm__silu_bwd(float acc, float v, float d) {
    float s = tm__sigmoidf(v);
    return acc + d * s * (1.0f + v * (1.0f - s));
}
__device__ __forceinline__ float tm__swiglu_fwd(float v, float u) { return v * tm__sigmoidf(v) * u; }
__device__ __forceinline__ float tm__swiglu_bwd_gate(float acc, float v, float s, float d, float u) {
    return acc + d * u * s * (1.0f + v * (1.0f - s));
}
__device__ __forceinline__ float tm__swiglu_bwd_up(float acc, float v, float s, float d) { return acc + d * v * s; }

#endif
