/*
 * mma.cuh — the sm_80+ PTX the tensor-core kernels share: asynchronous global -> shared copies
 * (cp.async and its group waits), ldmatrix (four 8x8 b16 matrices, plain and transposed) and
 * mma.sync m16n8k16 with bf16 inputs and f32 accumulators, plus the bf16 pair packing their
 * epilogues use. One definition each; attention.cu and grouped_matmul.cu carry their own
 * copies today (fa_* and gmm_*) and are meant to include this instead.
 *
 * Shared-memory operands are 32-bit shared-window addresses (tm__smem_u32 of a __shared__
 * pointer), the form every instruction below takes: kernels that step through a tile compute
 * the address once and add byte offsets to it.
 *
 * Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16", bf16), with g = lane / 4 and
 * t = lane % 4:
 *   A (16x16, row): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1], a[2] = A[g][2t+8..2t+9],
 *                   a[3] = A[g+8][2t+8..2t+9]
 *   B (16x8, col):  b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
 *   D (16x8, f32):  d[0], d[1] = D[g][2t], D[g][2t+1]; d[2], d[3] = D[g+8][2t], D[g+8][2t+1]
 * (each 32-bit register holds two bf16, the lower column or row in the low half). ldmatrix x4:
 * lanes 8m..8m+7 give the row addresses of matrix m; lane l gets, in r[m], row l/4, columns
 * 2(l%4) and 2(l%4)+1 of matrix m; with .trans, rows 2(l%4) and 2(l%4)+1 of column l/4.
 */
#ifndef TM_CUDA_MMA_CUH
#define TM_CUDA_MMA_CUH

#include <cuda_bf16.h>
#include <stdint.h>

/* The shared-window address of a __shared__ pointer. */
__device__ __forceinline__ uint32_t tm__smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16 bytes global -> shared without a register round trip, cached in L2 only (.cg);
 * src_bytes 0 reads nothing and fills the 16 bytes with zeros (rows past a tensor's end). */
__device__ __forceinline__ void tm__cp_async16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/* 4 bytes (one f32) the same way (.ca: the only form for sizes under 16); src_bytes 4 or 0. */
__device__ __forceinline__ void tm__cp_async4(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/* Close this thread's group of cp.async issued since the last commit. */
__device__ __forceinline__ void tm__cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* Wait until at most N of this thread's committed groups are still in flight (N = 0: all
 * landed). Other threads' copies need a __syncthreads after it before they are read. */
template <int N>
__device__ __forceinline__ void tm__cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Four 8x8 b16 matrices from shared memory into r[0..4) (layout at the top). */
__device__ __forceinline__ void tm__ldsm_x4(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
/* The same, each matrix transposed. */
__device__ __forceinline__ void tm__ldsm_x4_trans(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

/* d (16x8 f32) += a (16x16 bf16, row) b (16x8 bf16, col), fragments as at the top. */
__device__ __forceinline__ void tm__mma_bf16_16816(float *d, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats rounded to bf16 (nearest even) in one register, lo in the low half: an A or B
 * fragment register built from f32 values (attention's P), or a pair of output elements. */
__device__ __forceinline__ uint32_t tm__pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

#endif
