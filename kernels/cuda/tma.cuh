/*
 * tma.cuh — the sm_90 PTX of bulk-asynchronous copies and the mbarriers that track them, for the
 * Hopper kernels (grouped_matmul_sm90.cu, attention_sm90.cu): TMA tensor loads
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
 *   - Tensor maps (CUtensorMap, made on the host by cuTensorMapEncodeTiled: tm__tma_map_bf16 at the
 *     end) are passed as kernel parameters (__grid_constant__) and addressed by their generic
 *     address.
 * "memory" on every one of them: they read or write shared memory behind the compiler's back.
 */
#ifndef TM_CUDA_TMA_CUH
#define TM_CUDA_TMA_CUH

#include <cuda.h> /* CUtensorMap and the encode function's types only: no link to libcuda */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

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
__device__ __forceinline__ void tm__tma_load_4d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, int c3,
                                                uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
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

/* ---- host: tensor maps ---- */

typedef CUresult (*tm__tma_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                      const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* cuTensorMapEncodeTiled through the runtime's driver entry point: no link to libcuda. NULL (why
 * says what) when the driver has none. */
static inline tm__tma_encode_fn tm__tma_encoder(char *why, size_t n) {
    static tm__tma_encode_fn fn = NULL;
    if (fn) return fn;
    void *f = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !f) {
        snprintf(why, n, "cuTensorMapEncodeTiled not found through cudaGetDriverEntryPointByVersion (%s, query %d)",
                 cudaGetErrorString(e), (int)q);
        return NULL;
    }
    fn = (tm__tma_encode_fn)f;
    return fn;
}

/* A bf16 tensor map of rank 2 to 4: dims[0] contiguous, strides (bytes, multiples of 16) of dims
 * 1.., box in elements (box[0] 64: 128 bytes), 128-byte swizzle, zero fill out of bounds. 0, or -1
 * with why naming `what`. */
static inline int tm__tma_map_bf16(tm__tma_encode_fn enc, CUtensorMap *m, const void *base, int rank, const uint64_t *dims,
                                   const uint64_t *strides, const uint32_t *box, const char *what, char *why, size_t n) {
    cuuint64_t d[4], s[3];
    cuuint32_t b[4], es[4] = {1, 1, 1, 1};
    for (int i = 0; i < rank; i++) d[i] = dims[i], b[i] = box[i];
    for (int i = 0; i < rank - 1; i++) s[i] = strides[i];
    CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)base, d, s, b, es,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        snprintf(why, n, "cuTensorMapEncodeTiled failed (CUresult %d) for %s: dims %llu x %llu x %llu x %llu", (int)r, what,
                 (unsigned long long)d[0], (unsigned long long)d[1], (unsigned long long)(rank > 2 ? d[2] : 1),
                 (unsigned long long)(rank > 3 ? d[3] : 1));
        return -1;
    }
    return 0;
}

/* Whether the Hopper kernels of a file can run on device dev (e: cudaGetDevice's result): 1 when
 * dev is sm_90 and `kernel`, one of the file's kernels, has its sm_90a body; else 0, with why
 * naming `what` (the kernels, for the device test) or `file` (for the image test). The files build
 * their kernel bodies for sm_90a only (an sm_80 / sm_90 / PTX image holds empty bodies of a handful
 * of registers), so a body with fewer than 32 registers means the build lacks the sm_90a image
 * (the Makefile's -gencode arch=compute_90a). Leaves no CUDA error behind for the next launch check. */
static inline int tm__sm90_probe(int dev, cudaError_t e, const void *kernel, const char *what, const char *file, char *why,
                                 size_t n) {
    int maj = 0, min = 0;
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&maj, cudaDevAttrComputeCapabilityMajor, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&min, cudaDevAttrComputeCapabilityMinor, dev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(why, n, "no CUDA device (%s)", cudaGetErrorString(e));
        return 0;
    }
    if (maj != 9 || min != 0) {
        snprintf(why, n, "device %d is sm_%d%d: %s needs sm_90 (Hopper)", dev, maj, min, what);
        return 0;
    }
    cudaFuncAttributes fa;
    e = cudaFuncGetAttributes(&fa, kernel);
    if (e != cudaSuccess) (void)cudaGetLastError();
    if (e != cudaSuccess || fa.numRegs < 32) {
        snprintf(why, n, "this build has no sm_90a image of %s (%s, %d registers)", file, cudaGetErrorString(e),
                 e == cudaSuccess ? fa.numRegs : 0);
        return 0;
    }
    return 1;
}

#endif
