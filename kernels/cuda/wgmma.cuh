/*
 * wgmma.cuh — the sm_90a warpgroup MMA PTX of the Hopper attention kernels (attention_sm90.cu):
 * wgmma.mma_async with both operands in shared memory (SS) or A in registers (RS), its fence,
 * commit and wait, and the shared-memory matrix descriptor. Only for translation units compiled
 * with -gencode arch=compute_90a (the callers guard their bodies with __CUDA_ARCH_FEAT_SM90_ALL).
 * grouped_matmul_sm90.cu uses the fence, commit, wait and descriptor here and keeps its own
 * n128 / n256 wrappers with an A-transpose operand (gmm90_wgmma_*).
 *
 * PTX ISA 9.0, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions":
 *   d (64 x N, f32) = A (64 x 16, bf16) B (16 x N, bf16) + (scale_d ? d : 0)
 * executed by the 128 threads of a warpgroup together. Layouts, g = lane / 4, t = lane % 4, warp
 * w = (thread / 32) % 4 of the warpgroup:
 *   d:   d[4 i + e] = D[16 w + g + 8 (e / 2)][8 i + 2 t + (e % 2)], i < N / 8 (mma.sync's
 *        m16n8 accumulator, repeated over the N / 8 column blocks and the 4 warps' row blocks)
 *   A in registers (RS): a[0..3] = A[16 w + g][2t, 2t+1], A[16 w + g + 8][2t, 2t+1],
 *        A[16 w + g][2t+8, 2t+9], A[16 w + g + 8][2t+8, 2t+9] (two bf16 each, the lower column in
 *        the low half): so the accumulators of one product, k16 column block j, are the A registers
 *        {pack(d[8j], d[8j+1]), pack(d[8j+2], d[8j+3]), pack(d[8j+4], d[8j+5]), pack(d[8j+6], d[8j+7])}
 *        of the next (FlashAttention-3's P and dS never leave the registers).
 *   A, B in shared memory: a descriptor each (tm__wgmma_desc), 128-byte swizzle. TB = 0: B is
 *        stored K-major (N rows of 16 K elements, as a (N, K) row-major tile); TB = 1: N-major (K
 *        rows of N elements). A is always K-major here.
 * The descriptors' strides, for tiles stored as panels of 64 columns (128 bytes a row, 16-byte
 * chunk c of row r at r 128 + ((c ^ (r % 8)) 16), each panel's base 1024-byte aligned):
 *   K-major: SBO 1024 (8-row atoms), LBO unused (16); the k16 step moves the start 32 bytes
 *            inside the row, the next 64 columns are the next panel.
 *   N-major: SBO 1024, LBO = the panel's bytes (the next 64 N); the k16 step moves 16 rows,
 *            2048 bytes.
 * (CUTLASS's canonical GMMA layouts state the same strides; grouped_matmul_sm90.cu uses both.)
 *
 * The asm takes the accumulators "+f": the compiler sees them written when the wgmma is issued,
 * not when it completes. A caller reads them only after tm__wgmma_wait and ties them to that
 * point with tm__wgmma_fence_regs (an empty asm), and keeps the A registers of an RS wgmma alive
 * the same way until its wait: otherwise the compiler may move a read above the wait or reuse a
 * register that the tensor cores still read.
 */
#ifndef TM_CUDA_WGMMA_CUH
#define TM_CUDA_WGMMA_CUH

#include <stdint.h>

__device__ __forceinline__ uint64_t tm__wgmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}
/* Orders this thread's register writes (accumulators, A operands) before the wgmmas that follow. */
__device__ __forceinline__ void tm__wgmma_fence(void) { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void tm__wgmma_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void tm__wgmma_wait(void) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void tm__wgmma_fence_regs(float *r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void tm__wgmma_fence_regs(uint32_t *r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(r[i])::"memory");
}
/* generic writes to shared memory (st.shared, cp.async) -> visible to the wgmma's reads */
__device__ __forceinline__ void tm__fence_proxy_async(void) { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* The operand lists were written out by a script (N / 2 accumulator registers each). */
template <int TB>
__device__ __forceinline__ void tm__wgmma_ss_n64(float *d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void tm__wgmma_ss_n128(float *d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, %67;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void tm__wgmma_rs_n64(float *d, const uint32_t *a, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void tm__wgmma_rs_n128(float *d, const uint32_t *a, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

#endif
