/*
 * grouped_matmul_sm90.h — the Hopper (sm_90a) grouped GEMM of tm_grouped_matmul, behind a plain C
 * interface so that grouped_matmul.cu and the standalone harness (bench/gmm_sm90_harness.cu) call
 * it alike. Layout, tiles, pipeline and limits: the top of grouped_matmul_sm90.cu.
 */
#ifndef TM_GROUPED_MATMUL_SM90_H
#define TM_GROUPED_MATMUL_SM90_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { TM__GMM90_FWD = 0, TM__GMM90_DX = 1, TM__GMM90_DW = 2, TM__GMM90_FWD_SWIGLU = 3, TM__GMM90_DX_SWIGLU = 4 };
/* How the two consumer warpgroups share a CTA's tiles (grouped_matmul_sm90.cu, "Schedule"):
 * cooperative, one 128 x BN tile at a time, 64 rows each; ping-pong, a 128 x 128 tile each, their
 * main loops taking turns so that one's epilogue runs under the other's main loop. AUTO: ping-pong
 * for FWD_SWIGLU (unless bn is 256), cooperative for the others. */
enum { TM__GMM90_AUTO = 0, TM__GMM90_COOPERATIVE = 1, TM__GMM90_PINGPONG = 2 };

/* One grouped GEMM, bf16 in and out, f32 accumulation. Group g owns rows
 * [off_g, off_g + counts[g]) of the (R, .) operands, off_g = sum_{h<g} counts[h], counts (G) i64
 * on the device (never read by the host; clamped on the device as grouped_matmul.cu's device
 * kernel does: a count is min(max(counts[g], 0), rows left)).
 *   FWD: y  (R, N)     = x_g @ w[g]             a = x (R, K), b = w (G, K, N), c = y; rows past the
 *                                               last group get y = 0
 *   DX:  dx (R, K)    += dy_g @ w[g]^T          a = dy (R, N), b = w (G, K, N), c = dx; with
 *                                               write, dx = (rows past the last group get 0)
 *   DW:  dw[g] (K, N) += x_g^T @ dy_g           a = x (R, K), b = dy (R, N), c = dw (G, K, N); an
 *                                               empty group leaves dw[g] untouched
 *   FWD_SWIGLU: gate (R, N) = x_g @ w[g],  up (R, N) = x_g @ w2[g],  h (R, N) = swiglu(gate, up)
 *                                               a = x (R, K), b = w_gate (G, K, N), b2 = w_up
 *                                               (G, K, N), c = h, c_gate = gate, c_up = up; h from
 *                                               the bf16-rounded gate and up (swiglu.cuh: the bits
 *                                               of tm_swiglu on them); rows past the last group get 0
 *   DX_SWIGLU: dh = dy_g @ w[g]^T rounded to bf16 (not stored), then SwiGLU's backward on it:
 *              dgate (R, K) = dh u silu'(g), dup (R, K) = dh silu(g), written (fresh), g and u the
 *                                               forward's gate and up (R, K): a = dy (R, N), b = w
 *                                               (G, K, N) (the down projection's weight), c = dgate,
 *                                               c_dup = dup, gate_in, up_in; the bits of DX with
 *                                               write then tm_swiglu's backward; rows past the last
 *                                               group get 0. Ping-pong only. Used by
 *                                               tm_grouped_mlp's fused backward
 *                                               (kernels/cuda/grouped_mlp.cu), which is off by
 *                                               default until this mode has run on a GPU
 * All pointers 16-byte aligned, K and N multiples of 8 (TMA strides), 1 <= G <= TM__GMM90_MAX_G,
 * R < 2^31 - 512. DX_SWIGLU: gate_in and up_in must not be c or c_dup (other CTAs read them while
 * one writes). */
typedef struct tm__gmm90_args {
    int mode;
    const void *a, *b;
    void *c;
    const int64_t *counts;
    int64_t G, R, K, N;
    int bn; /* accumulator columns per tile: 0 picks (256, or 128 when that pads fewer columns); 128 or
             * 256; FWD_SWIGLU's tile takes half of them from each weight */
    int spare_sms; /* SMs left free (collectives beside the work: tm__cuda.comm_sms); 0: none */
    int write;     /* DX, DW: 1 writes the gradient (beta = 0: a fresh one) instead of adding into
                    * it; dx whole (rows past the groups 0), dw except its empty groups (no tile:
                    * the caller zeroes them) */
    int *sched;    /* DW: one int of device memory holding 0 at the launch (the kernel's tile
                    * counter: dynamic, largest groups first), or NULL (a static round-robin of
                    * the same tiles); FWD, DX: unused */
    const void *b2;      /* FWD_SWIGLU: w_up (G, K, N); otherwise unused */
    void *c_gate, *c_up; /* FWD_SWIGLU: the pre-activations (R, N), written; otherwise unused */
    int schedule;        /* TM__GMM90_AUTO (0), _COOPERATIVE or _PINGPONG (not for DW, nor with bn 256) */
    const void *gate_in, *up_in; /* DX_SWIGLU: the forward's gate and up (R, K), read; otherwise unused */
    void *c_dup;                 /* DX_SWIGLU: dup (R, K), written (c is dgate); otherwise unused */
} tm__gmm90_args;

#define TM__GMM90_MAX_G 1024

/* 1 when the current device can run the kernel (compute capability 9.0 and an sm_90a image in
 * this build); otherwise 0 with the reason in why. */
int tm__gmm90_supported(char *why, size_t why_len);

/* 0: launched on stream (one kernel, no host synchronisation, nothing read back).
 * 1: this shape / alignment / device is not for it (why says which; the caller takes another path).
 * -1: a CUDA or driver error (why says which). */
int tm__gmm90_run(const tm__gmm90_args *a, cudaStream_t stream, char *why, size_t why_len);

#ifdef __cplusplus
}
#endif

#endif
