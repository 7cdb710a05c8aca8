/*
 * tma.cuh — the sm_90 PTX of bulk-asynchronous copies and the mbarriers that track them, for the
 * Hopper kernels (grouped_matmul_sm90.cu; attention_sm90.cu's next version): TMA tensor loads
 * into shared memory that complete on an mbarrier, TMA tensor stores from shared memory in bulk
 * groups, stmatrix, and the waits. Only for translation units compiled with -gencode
 * arch=compute_90a (the callers guard their bodies with __CUDA_ARCH_FEAT_SM90_ALL); moved here
 * from grouped_matmul_sm90.cu unchanged (gmm90_* there, tm__* here; the file's PTX compared equal).
 *
 * PTX ISA 9.0, by section title: "mbarrier" (init, arrive, arrive.expect_tx, try_wait.parity),
 * "cp.async.bulk.tensor", "cp.async.bulk.commit_group", "cp.async.bulk.wait_group", "stmatrix".
 *   - A load names its mbarrier; the barrier's phase completes when the arrivals it was initialised
 *     for have come and the bytes announced by expect_tx have landed (TMA counts zero-filled
 *     out-of-bounds bytes too). Waiters spin on try_wait.parity with the phase's parity.
 *   - Stores go out in bulk groups: wait_group.read N returns once all but the newest N groups
 *     have read their shared memory (the staging may then be rewritten), wait_group N once they
 *     have completed.
 *   - Tensor maps (CUtensorMap, made on the host by cuTensorMapEncodeTiled) are passed as kernel
 *     parameters (__grid_constant__) and addressed by their generic address.
 * "memory" on every one of them: they read or write shared memory behind the compiler's back.
 */
#ifndef TM_CUDA_TMA_CUH
#define TM_CUDA_TMA_CUH

#include <cuda.h> /* CUtensorMap only: no link to libcuda */
#include <stdint.h>

__device__ __forceinline__ void tm__mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void tm__mbar_expect_tx(uint32_t bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tm__mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void tm__mbar_wait(uint32_t bar, int parity) {
    asm volatile("{\n"
                 ".reg .pred done;\n"
                 "WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n"
                 "}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void tm__tma_load_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void tm__tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void tm__tma_store_2d(const CUtensorMap *map, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"((uint64_t)map),
                 "r"(src), "r"(c0), "r"(c1)
                 : "memory");
}
__device__ __forceinline__ void tm__tma_store_3d(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"((uint64_t)map),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
/* Four 8x8 b16 matrices, lane l addressing row l % 8 of matrix l / 8; register j of lane l holds
 * row l / 4, columns 2 (l % 4), + 1 of matrix j (the mma accumulator fragment's layout). */
__device__ __forceinline__ void tm__stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}
__device__ __forceinline__ void tm__bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void tm__bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
/* all but the newest bulk group have read their shared memory */
__device__ __forceinline__ void tm__bulk_wait_read1() { asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory"); }
__device__ __forceinline__ void tm__bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void tm__cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

#endif
