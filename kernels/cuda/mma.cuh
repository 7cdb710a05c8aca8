/*
 * mma.cuh — the sm_80 PTX that the tensor-core kernels share, one definition each:
 * attention_tc.cuh (tm_attention), grouped_matmul.cu (the mma.sync grouped GEMM) and the
 * epilogue of grouped_matmul_sm90.cu. Until issue 20 each file carried its own copy (fa_*,
 * gmm_*, gmm90_*), identical in PTX text, constraints and clobbers; a fix made in one copy
 * would not have reached the others.
 *
 *   tm__smem_u32          a __shared__ pointer as the 32-bit shared-window address
 *   tm__cp_async16 / 4    global -> shared copy, 16 bytes (.cg) or 4 bytes (.ca), with zero fill
 *   tm__cp_async_commit   close this thread's current group of copies
 *   tm__cp_async_wait<N>  wait until at most N of this thread's groups are in flight
 *   tm__ldsm_x4[_trans]   ldmatrix: four 8x8 b16 matrices from shared memory into registers
 *   tm__mma_bf16_16816    mma.sync m16n8k16, bf16 x bf16 + f32 -> f32
 *   tm__pack_bf16x2       two f32 rounded into one bf16x2 register (fragment or output pair)
 *   tm__quad_max / _sum   a value's max / sum over the 4 lanes of a quad (lanes 4g..4g+3: one
 *                         row of an mma or wgmma accumulator)
 *
 * PTX ISA 9.0 (CUDA 13.0), by section title: "Data Movement and Conversion Instructions:
 * cp.async", "cp.async.commit_group", "cp.async.wait_group"; "Warp-level matrix load
 * instruction: ldmatrix"; "Matrix Fragments for mma.m16n8k16 with floating point type" and
 * "Multiply-and-Accumulate Instruction: mma". All need sm_80 or later.
 *
 * Shared-memory operands are 32-bit shared-window addresses (tm__smem_u32 of a __shared__
 * pointer) because that is the operand the .shared instructions take: a kernel stepping
 * through a tile converts its base once and adds byte offsets, instead of a generic -> shared
 * conversion per instruction. cp.async and ldmatrix also come with a __shared__ pointer
 * overload (below) for kernels that address tiles by element.
 *
 * Fragment layouts (bf16), with g = lane / 4 and t = lane % 4:
 *   A (16x16, row): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1], a[2] = A[g][2t+8..2t+9],
 *                   a[3] = A[g+8][2t+8..2t+9]
 *   B (16x8, col):  b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
 *   D (16x8, f32):  d[0], d[1] = D[g][2t], D[g][2t+1]; d[2], d[3] = D[g+8][2t], D[g+8][2t+1]
 * (each 32-bit register holds two bf16, the lower column or row in the low half). ldmatrix x4:
 * lanes 8m..8m+7 give the row addresses of matrix m; lane l gets, in r[m], row l/4, columns
 * 2(l%4) and 2(l%4)+1 of matrix m; with .trans, rows 2(l%4) and 2(l%4)+1 of column l/4. So
 * one x4 of a row-major 16x16 tile (lanes 0-15 at rows 0-15 column 0, lanes 16-31 at rows
 * 0-15 column 8) is exactly an A fragment, and one x4 of (n, k) rows gives b0, b1 for two
 * n8 tiles: the callers pick the lane -> row mapping, this file only issues the instruction.
 *
 * Why the asm is written as it is (the SASS of every kernel depends on it; change it only
 * with a before/after cuobjdump -sass comparison):
 *   - "memory" on cp.async, its commit and wait, and ldmatrix: these read or write shared
 *     memory behind the compiler's back. Without the clobber the compiler may keep a value
 *     it stored to a tile in a register, or move a plain shared load above the wait that
 *     makes it valid, or sink plain shared stores (the grouped GEMM's unaligned path fills
 *     its tiles that way) below an ldmatrix that reads them.
 *   - volatile everywhere, mma.sync included: mma has no memory effects and would be correct
 *     without it, but every copy this file replaced had it and the kernels were tuned and
 *     validated with it; whether dropping it moves the SASS has not been tried.
 *   - fragments are passed as pointers to their first register (four of them), the grouped
 *     GEMM's form. Attention's copies took references to arrays of four, which would catch a
 *     wrong-sized fragment at compile time, but with them the grouped GEMM's PTX reorders the
 *     ldmatrix address arithmetic and its SASS moves; with pointers both kernels compile to
 *     the SASS they had with their own copies.
 */
#ifndef TM_CUDA_MMA_CUH
#define TM_CUDA_MMA_CUH

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t tm__smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 2^x and 1/x in one MUFU instruction each (2 ulp; ftz: subnormal inputs and results are 0).
 * exp2f and an IEEE division add range fix-ups and Newton steps: attention's P and dS and the
 * SwiGLU sigmoid (swiglu.cuh) do not need them. */
__device__ __forceinline__ float tm__ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float tm__rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* 16 bytes without a register round trip, cached in L2 only (.cg: the data lands in shared
 * memory, a copy in L1 would be dead weight); src_bytes 0 reads nothing and fills the 16 bytes
 * with zeros, so rows past a tensor's end need no branch around the copy (the callers then
 * pass the tensor's base as src, an address known to be mapped). */
__device__ __forceinline__ void tm__cp_async16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/* 4 bytes (one f32) the same way; .ca because .cg exists only for 16-byte copies. src_bytes 4
 * or 0. */
__device__ __forceinline__ void tm__cp_async4(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/* A commit with no copies since the last one makes an empty group; pipelines commit every
 * stage anyway so that wait<N> counts stages, not copies. */
__device__ __forceinline__ void tm__cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* Covers this thread's copies only: other threads' copies need a __syncthreads after it
 * before they are read. */
template <int N>
__device__ __forceinline__ void tm__cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Layout at the top; addr is this lane's row address (16-byte aligned). */
__device__ __forceinline__ void tm__ldsm_x4(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
/* Each matrix transposed on the way: B fragments from a (k, n) row-major tile, A from (k, m). */
__device__ __forceinline__ void tm__ldsm_x4_trans(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

/* cp.async and ldmatrix from a __shared__ pointer instead of an address, for kernels that
 * index their tiles by element (attention). Converting inside the wrapper, after the call's other arguments are evaluated,
 * is the order attention's own copies had: converting at the call site instead computes the
 * shared address first, which reorders the address arithmetic and moves the scheduled SASS. */
__device__ __forceinline__ void tm__cp_async16(void *dst, const void *src, int src_bytes) {
    tm__cp_async16(tm__smem_u32(dst), src, src_bytes);
}
__device__ __forceinline__ void tm__cp_async4(void *dst, const void *src, int src_bytes) {
    tm__cp_async4(tm__smem_u32(dst), src, src_bytes);
}
__device__ __forceinline__ void tm__ldsm_x4(uint32_t *r, const void *s) { tm__ldsm_x4(r, tm__smem_u32(s)); }
__device__ __forceinline__ void tm__ldsm_x4_trans(uint32_t *r, const void *s) { tm__ldsm_x4_trans(r, tm__smem_u32(s)); }

/* d (16x8 f32) += a (16x16 bf16, row) b (16x8 bf16, col), in place (D and C are the same
 * registers, "+f"), fragments as at the top. b0, b1 are separate arguments because callers
 * hold B as the halves of an ldmatrix x4 that serves two n8 tiles. */
__device__ __forceinline__ void tm__mma_bf16_16816(float *d, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Round to nearest even, lo in the low half: the order an A fragment register (attention's P
 * and dS) and a pair of adjacent output columns both want. */
__device__ __forceinline__ uint32_t tm__pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* The max and the sum of a row over the 4 lanes of a quad (a row of an mma / wgmma accumulator). */
__device__ __forceinline__ float tm__quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float tm__quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

#endif
