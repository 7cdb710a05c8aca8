/*
 * grouped_matmul_sm90.cu — the Hopper grouped GEMM of tm_grouped_matmul (bf16 in and out, f32
 * accumulation), one launch per GEMM, group offsets computed on the device (no host read of the
 * counts). Compiled for sm_90a (wgmma, TMA, setmaxnreg need the "a" feature set); on any other
 * target the kernel body is empty and tm__gmm90_supported says no, so the callers keep their
 * sm_80 paths (grouped_matmul.cu).
 *
 * Uses (R rows of tokens in groups, G groups, w (G, K, N)):
 *   FWD  y_g  = x_g @ w[g]       M-grouped: C rows = the group's rows, reduction K, C cols N
 *   DX   dx_g += dy_g @ w[g]^T   M-grouped: reduction N, C cols K
 *   DW   dw[g] += x_g^T @ dy_g   K-grouped: C (K, N) per group, reduction over the group's rows
 *   FWD_SWIGLU  gate_g = x_g @ w_gate[g], up_g = x_g @ w_up[g], h = swiglu(gate, up): FWD over both
 *        weights at once (the MoE experts' first layer, tm_grouped_swiglu): a tile's BN
 *        accumulator columns are BN / 2 columns of w_gate and the same BN / 2 of w_up, so the
 *        epilogue holds gate and up of the same elements and writes all three outputs; this saves
 *        the elementwise pass that read gate and up back, and one of the two launches.
 *
 * Operands as wgmma sees them (A: M x red, B: red x Nc), each 64-element reduction slab in shared
 * memory, 128-byte swizzle, loaded by TMA (cp.async.bulk.tensor with mbarrier complete_tx):
 *   mode  A (smem)                                 B (smem)
 *   FWD   x rows, K-major: 1 box {64 K, 128 rows}   w[g], N-major: BN/64 boxes {64 N, 64 K}, 3-D map
 *   DX    dy rows, K-major: 1 box {64 N, 128 rows}  w[g] as (K, N): K-major: 1 box {64 N, BN K rows}
 *   DW    x_g^T, M-major: 2 boxes {64 K, 64 rows}   dy_g, N-major: BN/64 boxes {64 N, 64 rows}
 *   FWD_SWIGLU  as FWD                              BN/128 boxes of w_gate, then BN/128 of w_up
 * A K-major tile is rows of 128 bytes; 8 rows make a 1024-byte swizzle atom (descriptor SBO 1024),
 * the k16 steps advance the start address by 32 bytes inside the row. An MN-major box is 64
 * reduction rows of 64 M/N elements (128 bytes); atoms of 8 rows (SBO 1024), the 64-wide blocks one
 * box apart (LBO 8192); the k16 steps advance by 16 rows = 2048 bytes. (PTX ISA, "matrix descriptor";
 * CUTLASS's canonical GMMA layouts state the same strides.) w is a 3-D map (N, K, G) so that a
 * reduction slab past K reads zeros, never w[g + 1].
 *
 * CTA: 3 warpgroups, 384 threads, persistent (one CTA per SM; tiles t = blockIdx.x, + gridDim.x,
 * ..., or for DW from a counter, see "Schedule"):
 *   warpgroup 0   producer: one thread issues the TMA loads; setmaxnreg 40
 *   warpgroups 1-2 consumers: rows [64 (wg - 1), + 64) of the 128 x BN tile, m64nBNk16 wgmma,
 *                 BN / 2 f32 accumulators per thread; setmaxnreg 232
 * BN: 256, or 128 where that pads fewer columns (Nout 1408 = 11 x 128).
 * Ping-pong (tm__gmm90_args.schedule; by default FWD_SWIGLU only): BN 128, and each consumer
 * warpgroup owns a whole 128 x 128 tile (two m64n128 wgmmas per k16, 128 accumulators a thread),
 * the CTA's tiles alternating between them (warpgroup k % 2 takes its k-th tile). The producer is
 * unchanged; each warpgroup steps over the other's slabs in the ring. The main loops take turns
 * (named barriers 4 + w: a warpgroup starts its main loop once the other has issued its last
 * wgmma), so one warpgroup's epilogue runs while the other's wgmmas keep the tensor cores busy:
 * FWD_SWIGLU 0.374 -> 0.335 ms at coarse's shapes (H200). FWD and DX lose with it (0.293 -> 0.312
 * ms): their epilogues are short, and a 128 x 128 tile loads a third more bytes per FLOP.
 * Pipeline: STAGES (3 at BN 256, 5 at BN 128, 4 at ping-pong's BN 128, whose staging is twice
 * as large: what 227 KiB leave beside the epilogue's staging)
 * buffers of A (16 KiB) + B (BN x 128 bytes), a full and an empty mbarrier each. The producer waits empty[s], arms full[s] with the stage's bytes
 * (TMA counts the zero-filled bytes too) and issues the boxes; a consumer waits full[s], issues
 * the 4 k16 wgmmas, commits, and after wgmma.wait_group 1 (the previous slab's wgmmas are done)
 * each of its warps arrives on that slab's empty barrier (8 arrivals; ping-pong 4, the warps of the
 * one warpgroup that read it). The producer runs up to
 * STAGES slabs ahead, across tile boundaries, so the next tile's loads overlap this one's epilogue.
 *
 * Schedule (each CTA at its start, in shared memory, from counts on the device):
 *   c_g = min(max(counts[g], 0), R), off_g = min(sum_{h<g} c_h, R) (the clamped exclusive scan)
 *   M-grouped: ts_g = sum_{h<g} ceil(n_h / 128) m-tiles, plus a pseudo-group G of the rows past the
 *     last group (FWD, FWD_SWIGLU, DX_SWIGLU and a fresh DX write them 0, an added DX skips them;
 *     only bad counts make any); tile t is m-tile
 *     t / tiles_n (group: binary search of ts), n-tile t % tiles_n: the n-tiles of one m-tile run on
 *     neighbouring CTAs at once and share its rows in L2; a group's tiles share w[g].
 *   K-grouped: every non-empty group owns tiles_m * tiles_n tiles, each the group's whole reduction,
 *     so a tile's work is its group's rows; groups go out most rows first (tile x: group
 *     s_ord[x / (tiles_m tiles_n)], n fastest) and CTAs take tiles from a device-wide counter
 *     (args.sched) rather than round-robin: with skewed routing (one group 2.6 times the mean) the
 *     round-robin left CTAs holding two of the longest tiles while others had finished, and DW ran
 *     at 67% of dense where M-grouped FWD ran at 97% (H100, coarse shapes).
 *   Empty groups own no tile: they cost nothing, and dw[g] of an empty group is not written.
 * M-grouped tiles start at off_g + 128 i: a tile crossing the group's end loads the next group's
 * rows (or zeros past R) and computes them, but stores only rows < off_{g+1}.
 * K-grouped: the last slab of a group can reach into the next group's rows; TMA zero-fills only
 * past R, so the consumers zero those rows in shared memory before the wgmma, in A and in B (so
 * that even a non-finite value of the next group contributes exactly 0): with the 128-byte swizzle
 * an MN-major box keeps each reduction row in its own 128-byte line (the swizzle permutes only the
 * line's 16-byte chunks), so zeroing lines [valid, 64) of each box is exact. Then
 * fence.proxy.async (generic writes -> the async proxy that wgmma reads through) and a barrier of
 * the 256 consumer threads.
 * Epilogue, per consumer warpgroup (its 64 rows): the accumulator fragments go to a staging tile in
 * shared memory (64 x BN bf16 as BN / 64 boxes with the TMA's 128-byte swizzle) by stmatrix.x4 (one
 * instruction per four 8x8 fragments, conflict-free: the 8 rows of a matrix land in 8 different
 * 16-byte chunk columns), then one thread issues TMA stores of the boxes (cp.async.bulk.tensor,
 * clipped at R, K, N) and the warpgroup goes on to its next tile without waiting for them; before
 * the staging is written again, that thread waits for the stores' reads (bulk wait_group.read). A
 * warpgroup whose rows cross its group's end copies its rows below it with 16-byte stores instead
 * (TMA cannot stop at a group's end). DX and DW (beta = 1): the old C tile comes into the staging
 * by cp.async while the second slab's wgmmas run, is read back by ldmatrix.x4 in the fragment
 * layout, added in f32 and rounded once, as cuBLASLt does with beta = 1. A fresh dx (args.write:
 * the caller's gradient holds no contribution yet) takes the forward's beta = 0 epilogue
 * instead (kernel template WRITE): no load of the old tile, and the rows past the groups get 0;
 * a fresh dw likewise (its empty groups, which own no tile, are zeroed by the caller).
 * Measured on an H100 (bench/gmm_sm90_harness.cu, R 98304, E 64, H 2048, F 1408; % of a dense
 * cuBLAS GEMM of the same FLOPs, two runs): fwd 84-93%, dx 75-85%, dw 70-87%, fwd + bwd 78-87%. The same
 * epilogue with st.global from the fragments ran at 33-35% (beta's loads serialised behind
 * stores) and with st.shared instead of stmatrix at 75-83%; BN 128 everywhere 61-72%; a consumer
 * warpgroup started 1-3 slabs behind the other (epilogues apart) gained nothing beyond the noise.
 * FWD_SWIGLU's epilogue: gate and up, rounded to bf16, go to the staging (its boxes in the
 * accumulators' order: gate's, then up's) and out by TMA to their tensors; once the gate's boxes
 * are read (bulk wait_group.read 1: up's store may still be reading), h = swiglu(gate, up) of the
 * rounded values (swiglu.cuh, the elementwise kernel's expression: the same bits as tm_swiglu on
 * the stored gate and up) overwrites them and goes out to h. Each element's gate and up are the
 * same sums FWD makes (the k-slabs in order, wgmma's order inside one), so the fused outputs equal
 * FWD + FWD + swiglu bit for bit (the harness checks it).
 * Determinism: each C element is one thread's sum in a fixed order (slabs ascending, the wgmma's
 * internal order), whatever the grid: no atomics, bit-identical run to run.
 */
#include "grouped_matmul_sm90.h"
#include "mma.cuh"
#include "swiglu.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

#include <cuda.h> /* CUtensorMap and the encode function's types only: no link to libcuda */
#include <cuda_bf16.h>
#include <stdio.h>
#include <string.h>

#define GMM90_BM 128
#define GMM90_BK 64
#define GMM90_THREADS 384
#define GMM90_TQ 4 /* DW: tile ids the producer may hand out ahead of the consumers */
/* 227 KiB per CTA less the 1024 alignment bytes, the mbarriers, the tile-id queue and the
 * schedule at 1024 groups */
#define GMM90_SMEM_BUDGET (232448 - 1024 - 128 - 3 * GMM90_TQ * 8 - 3 * (TM__GMM90_MAX_G + 2) * 4)

template <int BN, bool PP = false> struct gmm90_cfg {
    static constexpr int A_BYTES = GMM90_BM * GMM90_BK * 2;
    static constexpr int B_BYTES = BN * GMM90_BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    /* the epilogue's staging tile: per consumer warpgroup its rows (64, or ping-pong 128) x BN, as
     * BN / 64 swizzled boxes per 64 rows */
    static constexpr int STG_WG = (PP ? 128 : 64) * BN * 2;
    static constexpr int STG_BYTES = 2 * STG_WG;
    static constexpr int FIT = (GMM90_SMEM_BUDGET - STG_BYTES) / STAGE_BYTES;
    static constexpr int STAGES = FIT > 6 ? 6 : FIT;
    static_assert(STAGES >= 3, "too little shared memory for the pipeline");
    /* tiles, staging, 2 STAGES mbarriers, the tile-id queue (2 TQ mbarriers, TQ i32 padded to 8
     * bytes each), the schedule (3 (G + 2) i32), 1024 bytes to align the tiles */
    static size_t smem(int64_t G) {
        return 1024 + (size_t)STAGES * STAGE_BYTES + STG_BYTES + 2 * STAGES * 8 + 3 * GMM90_TQ * 8 +
               3 * (size_t)(G + 2) * 4;
    }
};

struct gmm90_params {
    __nv_bfloat16 *C;
    __nv_bfloat16 *C2, *C3; /* FWD_SWIGLU: gate and up (C is h); DX_SWIGLU: C2 dup (C is dgate) */
    const __nv_bfloat16 *Gi, *Ui; /* DX_SWIGLU: the forward's gate and up (R, Nout), read by the epilogue */
    const int64_t *counts;
    int G, R;
    int Kred;      /* M-grouped: reduction length (FWD K, DX N) */
    int Nout;      /* columns of C (FWD N, DX K, DW N) */
    int M;         /* DW: rows of dw[g] (K) */
    int tiles_m;   /* DW: ceil(K / BM) */
    int tiles_n;   /* ceil(Nout / BNC): BNC = BN, or BN / 2 for FWD_SWIGLU */
    long long ldc; /* row stride of C */
    long long c_gstride; /* DW: elements from dw[g] to dw[g + 1] */
    int *sched;    /* DW: the tile counter (0 at launch), or NULL for the static schedule */
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GMM90_DEVICE 1
#endif

/* ---- PTX wrappers (sm_90a): TMA, mbarriers and stmatrix are tma.cuh's, wgmma's fence, commit,
 * wait and descriptor wgmma.cuh's; the sm_80 ones the epilogue uses (cp.async, ldmatrix, the bf16
 * packing) mma.cuh's ---- */
#ifdef GMM90_DEVICE
/* Ties the accumulators to this point: no read or write of them moves across it. */
__device__ __forceinline__ void gmm90_reg_fence(float &r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void gmm90_bar(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void gmm90_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

/* d (64 x N f32, the warpgroup's fragments) (+)= A (64 x 16) @ B (16 x N), both from shared memory
 * through descriptors; TA / TB: A M-major / B N-major (else K-major); scale_d 0: d = A B. The
 * operand lists were written out by a script (N / 2 accumulator registers each). */
template <int TA, int TB>
__device__ __forceinline__ void gmm90_wgmma_n128(float *d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

template <int TA, int TB>
__device__ __forceinline__ void gmm90_wgmma_n256(float *d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
#endif

/* ---- the kernel ---- */

struct gmm90_tile {
    int g;          /* group; M-grouped g = G: the rows past the last group */
    int r0, r1;     /* M-grouped: rows [r0, r1) of C, r1 the group's end (the tile stores < r1) */
    int m0, n0;     /* DW: first row (of K) of dw[g]; first column of C */
    int red0, nk;   /* first reduction index (DW: the group's first row), slabs of 64 */
    int red1;       /* DW: the group's end row */
};

/* WRITE (DX, DW): the gradient is fresh (call->gin_fresh): written as the forward writes y,
 * beta = 0, without loading the old tile; DX's rows past the groups get 0, DW's empty groups
 * are the caller's (grouped_matmul.cu zeroes them) */
template <int MODE, int BN, bool WRITE = false, bool PP = false>
__global__ void __launch_bounds__(GMM90_THREADS, 1)
    gmm90_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                 const __grid_constant__ CUtensorMap tmC, const __grid_constant__ CUtensorMap tmB2,
                 const __grid_constant__ CUtensorMap tmC2, const __grid_constant__ CUtensorMap tmC3, gmm90_params p) {
#ifdef GMM90_DEVICE
    typedef gmm90_cfg<BN, PP> CF;
    static_assert(!PP || (BN == 128 && MODE != TM__GMM90_DW), "ping-pong: M-grouped at BN 128 (128 accumulators a thread)");
    constexpr int STAGES = CF::STAGES;
    constexpr bool MG = MODE != TM__GMM90_DW; /* M-grouped */
    /* FWD_SWIGLU: the tile's BN accumulator columns are BN / 2 columns of w_gate, then the same
     * BN / 2 columns of w_up; C (h, gate, up) advances BN / 2 columns a tile */
    constexpr bool SW = MODE == TM__GMM90_FWD_SWIGLU;
    constexpr bool DXS = MODE == TM__GMM90_DX_SWIGLU; /* DX with SwiGLU's backward in the epilogue */
    static_assert(!DXS || PP, "DX_SWIGLU runs ping-pong only (its epilogue's loads hide under the other main loop)");
    static_assert(!DXS || WRITE, "DX_SWIGLU writes fresh gradients (ACCUM's cp.async into its staging would race)");
    constexpr int BNC = SW ? BN / 2 : BN;
    extern __shared__ unsigned char gmm90_raw[];
    unsigned char *sm = (unsigned char *)(((uintptr_t)gmm90_raw + 1023) & ~(uintptr_t)1023);
    unsigned char *sA = sm, *sB = sm + STAGES * CF::A_BYTES;
    unsigned char *sStg = sB + STAGES * CF::B_BYTES; /* the epilogue's staging */
    uint64_t *full = (uint64_t *)(sStg + CF::STG_BYTES), *empty = full + STAGES;
    uint64_t *tq_full = empty + STAGES, *tq_empty = tq_full + GMM90_TQ; /* DW's tile-id queue */
    volatile int *s_tq = (volatile int *)(tq_empty + GMM90_TQ);
    int *s_off = (int *)(tq_empty + 2 * GMM90_TQ), *s_ts = s_off + (p.G + 2), *s_ord = s_ts + (p.G + 2);
    const int tid = threadIdx.x, G = p.G, R = p.R;

    /* -- the schedule -- */
    for (int g = tid; g < G; g += GMM90_THREADS) {
        long long c = p.counts[g];
        s_off[g] = (int)(c < 0 ? 0 : (c > R ? R : c));
    }
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            tm__mbar_init(tm__smem_u32(&full[s]), 1);
            tm__mbar_init(tm__smem_u32(&empty[s]), PP ? 4 : 8); /* each consumer warp that reads the slab */
        }
        for (int q = 0; q < GMM90_TQ; q++) {
            tm__mbar_init(tm__smem_u32(&tq_full[q]), 1);
            tm__mbar_init(tm__smem_u32(&tq_empty[q]), 256); /* every consumer thread has read the id */
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid < 32) {
        const int lane = tid;
        long long rows = 0, tiles = 0;
        for (int base = 0; base < G; base += 32) {
            const int g = base + lane;
            const long long c = g < G ? s_off[g] : 0;
            long long x = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const long long y = __shfl_up_sync(0xffffffffu, x, o);
                if (lane >= o) x += y;
            }
            const long long S = rows + x - c;
            const long long lo = S < R ? S : R, hi = S + c < R ? S + c : R;
            long long t;
            if (MG) t = (hi - lo + GMM90_BM - 1) / GMM90_BM;
            else t = hi > lo ? (long long)p.tiles_m * p.tiles_n : 0;
            long long xt = t;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const long long y = __shfl_up_sync(0xffffffffu, xt, o);
                if (lane >= o) xt += y;
            }
            __syncwarp();
            if (g < G) s_off[g] = (int)lo, s_ts[g] = (int)(tiles + xt - t);
            rows += __shfl_sync(0xffffffffu, x, 31);
            tiles += __shfl_sync(0xffffffffu, xt, 31);
        }
        if (lane == 0) {
            const int end = (int)(rows < R ? rows : R);
            s_off[G] = end, s_ts[G] = (int)tiles;
            s_off[G + 1] = R;
            /* the rows past the groups get tiles where they are written (y = 0, a fresh dx 0) */
            s_ts[G + 1] = (int)tiles + (MODE == TM__GMM90_FWD || SW || DXS || (MODE == TM__GMM90_DX && WRITE)
                                            ? (R - end + GMM90_BM - 1) / GMM90_BM
                                            : 0);
        }
    }
    __syncthreads();
    const int total = MG ? s_ts[G + 1] * p.tiles_n : s_ts[G];
    const int gmax = MG ? G : G - 1;
    const int TT = p.tiles_m * p.tiles_n; /* DW: tiles of a non-empty group, each its whole reduction */
    if (!MG) {
        /* DW: the groups by rows, most first (ties by index): s_ord[rank] = g. Tile x is tile x % TT
         * of group s_ord[x / TT], so the longest tiles go out first and the short ones fill the
         * tail (the longest-processing-time-first order); empty groups rank last with no tile. */
        for (int g = tid; g < G; g += GMM90_THREADS) {
            const int c = s_off[g + 1] - s_off[g];
            int rank = 0;
            for (int h = 0; h < G; h++) {
                const int ch = s_off[h + 1] - s_off[h];
                rank += ch > c || (ch == c && h < g);
            }
            s_ord[rank] = g;
        }
        __syncthreads();
    }

    auto decode = [&](int t) {
        gmm90_tile tl;
        int x, nt, lo = 0;
        if (MG) {
            x = t / p.tiles_n, nt = t - x * p.tiles_n;
            int hi = gmax; /* the last g with ts[g] <= x: a group with tiles */
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (s_ts[mid] <= x) lo = mid;
                else hi = mid - 1;
            }
        } else {
            x = t, nt = 0, lo = s_ord[t / TT];
        }
        (void)gmax;
        tl.g = lo;
        if (MG) {
            tl.r0 = s_off[lo] + (x - s_ts[lo]) * GMM90_BM;
            tl.r1 = s_off[lo + 1];
            tl.m0 = 0, tl.n0 = nt * BNC;
            tl.red0 = 0, tl.red1 = p.Kred, tl.nk = (p.Kred + GMM90_BK - 1) / GMM90_BK;
        } else {
            const int loc = x % TT, mt = loc / p.tiles_n;
            tl.m0 = mt * GMM90_BM, tl.n0 = (loc - mt * p.tiles_n) * BN;
            tl.r0 = tl.r1 = 0;
            tl.red0 = s_off[lo], tl.red1 = s_off[lo + 1];
            tl.nk = (tl.red1 - tl.red0 + GMM90_BK - 1) / GMM90_BK;
        }
        return tl;
    };

    /* The tiles of this CTA. Static (M-grouped, or DW without a counter): t = blockIdx.x + k
     * gridDim.x, which producer and consumers each count alike. DW with p.sched: the first tile is
     * blockIdx.x, each later one the next of a device-wide counter (atomicAdd), claimed by the
     * producer as it starts the tile's loads and passed to the consumers through the queue s_tq
     * (tq_full: the id is written; tq_empty: all 256 consumer threads have read it). A CTA that
     * drew a long tile thus draws fewer: skewed routings no longer leave some CTAs with two long
     * tiles while others idle. Which CTA computes a tile changes nothing in its sums. */
    const bool dyn = !MG && p.sched != nullptr;

    const int wg = tid / 128;
    if (wg == 0) {
        /* ---- producer ---- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid != 0) return;
        int s = 0, ph = 0;
        for (int k = 0, t = blockIdx.x;; k++) {
            if (dyn) {
                const int q = k % GMM90_TQ;
                tm__mbar_wait(tm__smem_u32(&tq_empty[q]), ((k / GMM90_TQ) & 1) ^ 1);
                if (k > 0) t = (int)gridDim.x + atomicAdd(p.sched, 1);
                s_tq[q] = t;
                tm__mbar_arrive(tm__smem_u32(&tq_full[q]));
            } else if (k > 0) {
                t += gridDim.x;
            }
            if (t >= total) break;
            const gmm90_tile tl = decode(t);
            if (MG && tl.g == G) continue; /* rows past the groups: nothing to load */
            for (int kt = 0; kt < tl.nk; kt++) {
                tm__mbar_wait(tm__smem_u32(&empty[s]), ph ^ 1);
                const uint32_t fb = tm__smem_u32(&full[s]);
                tm__mbar_expect_tx(fb, CF::STAGE_BYTES);
                const uint32_t a = tm__smem_u32(sA + s * CF::A_BYTES), b = tm__smem_u32(sB + s * CF::B_BYTES);
                const int k0 = tl.red0 + kt * GMM90_BK;
                if (MODE == TM__GMM90_FWD) {
                    tm__tma_load_2d(a, &tmA, k0, tl.r0, fb);
#pragma unroll
                    for (int j = 0; j < BN / 64; j++) tm__tma_load_3d(b + j * 8192, &tmB, tl.n0 + 64 * j, k0, tl.g, fb);
                } else if (SW) {
                    tm__tma_load_2d(a, &tmA, k0, tl.r0, fb);
#pragma unroll
                    for (int j = 0; j < BN / 128; j++) {
                        tm__tma_load_3d(b + j * 8192, &tmB, tl.n0 + 64 * j, k0, tl.g, fb);
                        tm__tma_load_3d(b + (BN / 128 + j) * 8192, &tmB2, tl.n0 + 64 * j, k0, tl.g, fb);
                    }
                } else if (MODE == TM__GMM90_DX || DXS) {
                    tm__tma_load_2d(a, &tmA, k0, tl.r0, fb);
                    tm__tma_load_3d(b, &tmB, k0, tl.n0, tl.g, fb);
                } else {
                    tm__tma_load_2d(a, &tmA, tl.m0, k0, fb);
                    tm__tma_load_2d(a + 8192, &tmA, tl.m0 + 64, k0, fb);
#pragma unroll
                    for (int j = 0; j < BN / 64; j++) tm__tma_load_2d(b + j * 8192, &tmB, tl.n0 + 64 * j, k0, fb);
                }
                if (++s == STAGES) s = 0, ph ^= 1;
            }
        }
        return;
    }

    /* ---- consumers ---- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int w = wg - 1, wl = tid - 128 * wg, warp = wl >> 5, lane = wl & 31;
    constexpr bool ACCUM = MODE != TM__GMM90_FWD && !SW && !WRITE;
    constexpr int TA = MODE == TM__GMM90_DW ? 1 : 0; /* A M-major */
    constexpr int TB = MODE == TM__GMM90_DX || DXS ? 0 : 1; /* B N-major */
    /* A warpgroup's rows of a tile, in halves of 64 (one m64 wgmma each): cooperative, rows
     * [64 w, + 64) of the CTA's tile; ping-pong, all 128 rows of its own tile */
    constexpr int HALVES = PP ? 2 : 1;
    constexpr int NA = BN / 2;           /* accumulators of a half, per thread */
    constexpr int STG_HALF = 64 * BN * 2; /* staging bytes of a half */
    float acc[HALVES * NA];
    int s = 0, ph = 0;
    /* This warpgroup's staging: per half BN / 64 boxes of 64 rows x 128 bytes, 128-byte swizzle
     * (the TMA store's layout): element (r, c) at box c / 64, line r, 16-byte chunk (c % 64 / 8) ^ (r % 8). */
    unsigned char *stg = sStg + w * CF::STG_WG;
    const uint32_t stg_a = tm__smem_u32(stg);
    const int wbar = 2 + w; /* named barrier of this warpgroup's 128 threads */
    auto stg_off = [](int r, int c8) { return (c8 >> 3) * 8192 + r * 128 + (((c8 & 7) ^ (r & 7)) << 4); };
    /* the staging tile is free: the last TMA store from it has read it, every thread is past it */
    auto stg_acquire = [&]() {
        if (wl == 0) tm__bulk_wait_read();
        gmm90_bar(wbar, 128);
    };
    (void)stg_a, (void)stg_off, (void)stg_acquire, (void)wbar;
    for (int k = 0, t = blockIdx.x;; k++) {
        if (dyn) {
            const int q = k % GMM90_TQ;
            tm__mbar_wait(tm__smem_u32(&tq_full[q]), (k / GMM90_TQ) & 1);
            t = s_tq[q];
            tm__mbar_arrive(tm__smem_u32(&tq_empty[q]));
        } else if (k > 0) {
            t += gridDim.x;
        }
        if (t >= total) break;
        const gmm90_tile tl = decode(t);
        if (PP && (k & 1) != w) {
            /* the other warpgroup's tile: step over its slabs in the ring */
            const int n = MG && tl.g == G ? 0 : tl.nk;
            for (int i = 0; i < n; i++)
                if (++s == STAGES) s = 0, ph ^= 1;
            continue;
        }
        /* Ping-pong: this warpgroup's main loop waits until the other's has issued its last wgmma
         * (named barrier 4 + w, which the other arrives on), and passes the turn on once its own
         * has: the main loops alternate, and each epilogue runs under the other's main loop. */
        const bool pass_on = PP && t + (int)gridDim.x < total; /* the other warpgroup has tile k + 1 */
        /* This wait is also what makes the ring's parity safe: a warpgroup never waits on the slabs
         * it steps over, so its full[s] wait with parity ph is right only because every earlier
         * tile's slabs have been consumed (their main loop has issued) by the time it passes here.
         * It must stay unconditional for k > 0. */
        if (PP && k > 0) gmm90_bar(4 + w, 256);
        /* this warpgroup's rows of C: [row0, row0 + 64 HALVES), stored below wlim */
        const int row0 = (MG ? tl.r0 : tl.m0) + (PP ? 0 : 64 * w), wlim = MG ? tl.r1 : p.M;
        __nv_bfloat16 *Cg = MG ? p.C : p.C + (long long)tl.g * p.c_gstride;
        (void)Cg, (void)pass_on;
        if (MG && tl.g == G) {
            if (pass_on) gmm90_arrive(4 + (w ^ 1), 256);
            /* rows past the groups (bad counts only): FWD writes y = 0 there, DX adds nothing
             * (a fresh dx gets 0 there) */
            if (MODE == TM__GMM90_FWD || SW || DXS || WRITE) {
                const __nv_bfloat162 z = __floats2bfloat162_rn(0.0f, 0.0f);
                for (int r = row0 + wl / 8; r < row0 + 64 * HALVES && r < tl.r1; r += 16)
                    for (int col = tl.n0 + 2 * (wl & 7); col < tl.n0 + BNC && col < p.Nout; col += 16) {
                        *(__nv_bfloat162 *)(p.C + (long long)r * p.ldc + col) = z;
                        if (SW || DXS) *(__nv_bfloat162 *)(p.C2 + (long long)r * p.ldc + col) = z;
                        if (SW) *(__nv_bfloat162 *)(p.C3 + (long long)r * p.ldc + col) = z;
                    }
            }
            continue;
        }
        {
            int prev = -1;
            for (int kt = 0; kt < tl.nk; kt++) {
                tm__mbar_wait(tm__smem_u32(&full[s]), ph);
                unsigned char *a = sA + s * CF::A_BYTES, *b = sB + s * CF::B_BYTES;
                if (!MG) {
                    const int valid = tl.red1 - (tl.red0 + kt * GMM90_BK);
                    if (valid < GMM90_BK) {
                        /* rows [valid, 64) belong to the next group: zero them in A (this
                         * warpgroup's box) and in B (boxes w, w + 2, ...) */
                        const uint4 z = make_uint4(0, 0, 0, 0);
                        for (int idx = wl; idx < GMM90_BK * 8; idx += 128) {
                            const int row = idx >> 3;
                            if (row < valid) continue;
                            const int off = row * 128 + (idx & 7) * 16;
                            *(uint4 *)(a + w * 8192 + off) = z;
#pragma unroll
                            for (int j = w; j < BN / 64; j += 2) *(uint4 *)(b + j * 8192 + off) = z;
                        }
                        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                        gmm90_bar(1, 256);
                    }
                }
                const uint32_t aa = tm__smem_u32(a), ba = tm__smem_u32(b);
#pragma unroll
                for (int i = 0; i < HALVES * NA; i++) gmm90_reg_fence(acc[i]);
                tm__wgmma_fence();
#pragma unroll
                for (int j = 0; j < GMM90_BK / 16; j++) {
                    uint64_t db;
                    if (TB) db = tm__wgmma_desc(ba + j * 2048, 8192, 1024);
                    else db = tm__wgmma_desc(ba + j * 32, 16, 1024);
                    const int sc = (kt > 0 || j > 0) ? 1 : 0;
#pragma unroll
                    for (int h = 0; h < HALVES; h++) {
                        const int blk = PP ? h : w; /* the 64-row block of A: 8192 bytes apart */
                        uint64_t da;
                        if (TA) da = tm__wgmma_desc(aa + blk * 8192 + j * 2048, 8192, 1024);
                        else da = tm__wgmma_desc(aa + blk * 8192 + j * 32, 16, 1024);
                        if (BN == 256) gmm90_wgmma_n256<TA, TB>(acc + h * NA, da, db, sc);
                        else gmm90_wgmma_n128<TA, TB>(acc + h * NA, da, db, sc);
                    }
                }
                tm__wgmma_commit();
                if (ACCUM && kt == (tl.nk > 1 ? 1 : 0)) {
                    /* beta = 1: the old C tile into the staging tile while the tensor cores work
                     * (by the second slab the last tile's store has long read the staging) */
                    stg_acquire();
#pragma unroll
                    for (int h = 0; h < HALVES; h++)
                        for (int idx = wl; idx < 64 * (BN / 8); idx += 128) {
                            const int r = idx / (BN / 8), c8 = idx - r * (BN / 8);
                            const int row = row0 + 64 * h + r, col = tl.n0 + 8 * c8;
                            const bool ok = row < wlim && col < p.Nout;
                            tm__cp_async16(stg_a + h * STG_HALF + stg_off(r, c8),
                                           ok ? (const void *)(Cg + (long long)row * p.ldc + col) : p.C, ok ? 16 : 0);
                        }
                    tm__cp_async_commit();
                }
#pragma unroll
                for (int i = 0; i < HALVES * NA; i++) gmm90_reg_fence(acc[i]);
                tm__wgmma_wait<1>();
                if (prev >= 0 && lane == 0) tm__mbar_arrive(tm__smem_u32(&empty[prev]));
                prev = s;
                if (++s == STAGES) s = 0, ph ^= 1;
            }
            if (pass_on) gmm90_arrive(4 + (w ^ 1), 256);
            tm__wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < HALVES * NA; i++) gmm90_reg_fence(acc[i]);
            if (prev >= 0 && lane == 0) tm__mbar_arrive(tm__smem_u32(&empty[prev]));
        }

        /* -- epilogue -- */
        /* matrices (rows 8 hm of the warp's 16, columns 8 i): m = lane / 8 -> hm = m & 1, i + (m >> 1) */
        const int m = lane >> 3, r = 16 * warp + 8 * (m & 1) + (lane & 7);
        if constexpr (DXS) {
            /* per half: dh = the fragments rounded to bf16 (the bits DX stores), gate and up of the
             * same elements loaded from global memory in the fragment layout (row 16 warp + lane / 4
             * (+ 8), columns 8 x + 2 (lane % 4), + 1: one 4-byte load each; rows past R and columns
             * past Nout read as 0), then swiglu.cuh's backward as swiglu_backward_kernel computes it
             * on fresh gradients: dgate -> staging region 0, dup -> region 1 (the two 64-row halves'
             * regions of this warpgroup's staging), TMA stores; half 1 reuses the regions once
             * half 0's stores have read them. */
            stg_acquire();
            const int g4 = lane >> 2, t4 = lane & 3;
#pragma unroll
            for (int hh = 0; hh < HALVES; hh++) {
                const float *ac = acc + hh * NA;
                const int wrow = row0 + 64 * hh;
                if (wrow >= wlim) break; /* (uniform) no row of this half or the next stores */
                if (hh > 0) stg_acquire();
                const bool whole = wrow + 64 <= wlim;
                /* in chunks of XC column blocks (registers: the 128 accumulators stay live): gate and
                 * up words [x][e] for block c + x, row g4 (e 0) or g4 + 8 (e 1), all loads of a chunk
                 * issued before its arithmetic */
                constexpr int XC = 8;
                /* the thread's two rows of gate and up, as 4-byte words from column n0 + 2 (lane % 4) */
                const int rw = wrow + 16 * warp + g4, cw = tl.n0 + 2 * t4;
                const long long o0 = (long long)rw * p.ldc + cw;
                const unsigned int *gp = (const unsigned int *)(p.Gi + o0), *up = (const unsigned int *)(p.Ui + o0);
                const int ld4 = (int)(p.ldc >> 1) * 8; /* words from row r to row r + 8 */
                const bool ok0 = rw < p.R, ok1 = rw + 8 < p.R;
#pragma unroll
                for (int c = 0; c < BN / 8; c += XC) {
                    uint32_t gw[XC][2], uw[XC][2];
#pragma unroll
                    for (int x = 0; x < XC; x++) {
                        const bool okc = cw + 8 * (c + x) < p.Nout;
                        const int wo = 4 * (c + x); /* 8 columns = 4 words */
                        gw[x][0] = ok0 && okc ? __ldg(gp + wo) : 0u;
                        uw[x][0] = ok0 && okc ? __ldg(up + wo) : 0u;
                        gw[x][1] = ok1 && okc ? __ldg(gp + ld4 + wo) : 0u;
                        uw[x][1] = ok1 && okc ? __ldg(up + ld4 + wo) : 0u;
                    }
                    /* stmatrix.x4: matrices (block i, rows g4), (i, g4 + 8), (i + 1, g4), (i + 1, g4 + 8) */
#pragma unroll
                    for (int i = 0; i < XC; i += 2) {
                        uint32_t dg[4], du[4];
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            const int x = i + (j >> 1), e = j & 1, o = 4 * (c + x) + 2 * e;
                            const float2 gf = __bfloat1622float2(*(const __nv_bfloat162 *)&gw[x][e]);
                            const float2 uf = __bfloat1622float2(*(const __nv_bfloat162 *)&uw[x][e]);
                            const float d0 = __bfloat162float(__float2bfloat16_rn(ac[o]));
                            const float d1 = __bfloat162float(__float2bfloat16_rn(ac[o + 1]));
                            const float s0 = tm__sigmoidf(gf.x), s1 = tm__sigmoidf(gf.y);
                            dg[j] = tm__pack_bf16x2(tm__swiglu_bwd_gate(0.0f, gf.x, s0, d0, uf.x),
                                                    tm__swiglu_bwd_gate(0.0f, gf.y, s1, d1, uf.y));
                            du[j] = tm__pack_bf16x2(tm__swiglu_bwd_up(0.0f, gf.x, s0, d0), tm__swiglu_bwd_up(0.0f, gf.y, s1, d1));
                        }
                        const uint32_t addr = stg_a + stg_off(r, c + i + (m >> 1));
                        tm__stsm_x4(addr, dg[0], dg[1], dg[2], dg[3]);
                        tm__stsm_x4(addr + STG_HALF, du[0], du[1], du[2], du[3]);
                    }
                }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                gmm90_bar(wbar, 128);
                if (whole) {
                    if (wl == 0) {
#pragma unroll
                        for (int j = 0; j < BN / 64; j++) {
                            if (tl.n0 + 64 * j >= p.Nout) break;
                            tm__tma_store_2d(&tmC, stg_a + j * 8192, tl.n0 + 64 * j, wrow);
                            tm__tma_store_2d(&tmC2, stg_a + STG_HALF + j * 8192, tl.n0 + 64 * j, wrow);
                        }
                        tm__bulk_commit();
                    }
                } else {
                    for (int idx = wl; idx < 2 * 64 * (BN / 8); idx += 128) {
                        const int reg = idx / (64 * (BN / 8)), rem = idx - reg * 64 * (BN / 8);
                        const int rr = rem / (BN / 8), c8 = rem - rr * (BN / 8);
                        const int row = wrow + rr, col = tl.n0 + 8 * c8;
                        if (row < wlim && col < p.Nout)
                            *(uint4 *)((reg ? p.C2 : p.C) + (long long)row * p.ldc + col) =
                                *(const uint4 *)(stg + reg * STG_HALF + stg_off(rr, c8));
                    }
                }
            }
            continue;
        }
        if constexpr (SW) {
            /* per half: gate and up rounded to bf16 -> staging (boxes [0, BN / 128) gate, the rest
             * up, the accumulators' own column order) -> their TMA stores; once the gate boxes are
             * read, h = swiglu(gate, up) of the rounded values -> those boxes -> its store. Rows
             * that cross the group's end are copied below it with 16-byte stores. */
            stg_acquire();
#pragma unroll
            for (int hh = 0; hh < HALVES; hh++) {
                const float *ac = acc + hh * NA;
                const int wrow = row0 + 64 * hh;
                if (wrow >= wlim) break; /* (uniform) no row of this half or the next stores */
                const uint32_t sa = stg_a + hh * STG_HALF;
                const unsigned char *sg = stg + hh * STG_HALF;
                const bool whole = wrow + 64 <= wlim; /* the half's 64 rows all store (TMA) */
#pragma unroll
                for (int i = 0; i < BN / 8; i += 2) {
                    const uint32_t o0 = 4 * i + 0, o1 = 4 * i + 2, o2 = 4 * (i + 1), o3 = 4 * (i + 1) + 2;
                    tm__stsm_x4(sa + stg_off(r, i + (m >> 1)), tm__pack_bf16x2(ac[o0], ac[o0 + 1]),
                                tm__pack_bf16x2(ac[o1], ac[o1 + 1]), tm__pack_bf16x2(ac[o2], ac[o2 + 1]),
                                tm__pack_bf16x2(ac[o3], ac[o3 + 1]));
                }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                gmm90_bar(wbar, 128);
                if (whole) {
                    if (wl == 0) {
#pragma unroll
                        for (int j = 0; j < BN / 128; j++)
                            if (tl.n0 + 64 * j < p.Nout) tm__tma_store_2d(&tmC2, sa + j * 8192, tl.n0 + 64 * j, wrow);
                        tm__bulk_commit();
#pragma unroll
                        for (int j = 0; j < BN / 128; j++)
                            if (tl.n0 + 64 * j < p.Nout)
                                tm__tma_store_2d(&tmC3, sa + (BN / 128 + j) * 8192, tl.n0 + 64 * j, wrow);
                        tm__bulk_commit();
                    }
                } else {
                    for (int idx = wl; idx < 64 * (BN / 8); idx += 128) {
                        const int rr = idx / (BN / 8), c8 = idx - rr * (BN / 8), up = c8 >= BN / 16;
                        const int row = wrow + rr, col = tl.n0 + 8 * (c8 - up * (BN / 16));
                        if (row < wlim && col < p.Nout)
                            *(uint4 *)((up ? p.C3 : p.C2) + (long long)row * p.ldc + col) = *(const uint4 *)(sg + stg_off(rr, c8));
                    }
                }
                /* h while the stores read the staging, packed as bf16 pairs in the fragment layout */
                uint32_t hp[BN / 8];
#pragma unroll
                for (int q = 0; q < BN / 8; q++) {
                    const int o = 2 * q; /* accumulators o, o + 1: gate; o + BN / 4, + 1: up */
                    const float g0 = __bfloat162float(__float2bfloat16_rn(ac[o])), g1 = __bfloat162float(__float2bfloat16_rn(ac[o + 1]));
                    const float u0 = __bfloat162float(__float2bfloat16_rn(ac[o + BN / 4]));
                    const float u1 = __bfloat162float(__float2bfloat16_rn(ac[o + BN / 4 + 1]));
                    hp[q] = tm__pack_bf16x2(tm__swiglu_fwd(g0, u0), tm__swiglu_fwd(g1, u1));
                }
                /* the gate's boxes are free for h (up's store, the last group, may still read) */
                if (whole && wl == 0) tm__bulk_wait_read1();
                gmm90_bar(wbar, 128);
#pragma unroll
                for (int i = 0; i < BN / 16; i += 2) /* hp[2 x] holds accumulators 4 x, + 1; hp[2 x + 1] 4 x + 2, + 3 */
                    tm__stsm_x4(sa + stg_off(r, i + (m >> 1)), hp[2 * i], hp[2 * i + 1], hp[2 * (i + 1)], hp[2 * (i + 1) + 1]);
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                gmm90_bar(wbar, 128);
                if (whole) {
                    if (wl == 0) {
#pragma unroll
                        for (int j = 0; j < BN / 128; j++)
                            if (tl.n0 + 64 * j < p.Nout) tm__tma_store_2d(&tmC, sa + j * 8192, tl.n0 + 64 * j, wrow);
                        tm__bulk_commit();
                    }
                } else {
                    for (int idx = wl; idx < 64 * (BN / 16); idx += 128) {
                        const int rr = idx / (BN / 16), c8 = idx - rr * (BN / 16);
                        const int row = wrow + rr, col = tl.n0 + 8 * c8;
                        if (row < wlim && col < p.Nout)
                            *(uint4 *)(p.C + (long long)row * p.ldc + col) = *(const uint4 *)(sg + stg_off(rr, c8));
                    }
                }
            }
            continue;
        }
        /* fragments (+ the old C in f32, rounded once) -> staging as bf16 -> TMA store of each
         * half's 64 rows (TMA clips at R, K, N); a half whose rows cross the group's end copies
         * its rows below it with 16-byte stores instead */
        if (ACCUM) {
            tm__cp_async_wait_all();
            gmm90_bar(wbar, 128);
        } else {
            stg_acquire();
        }
#pragma unroll
        for (int hh = 0; hh < HALVES; hh++) {
            const float *ac = acc + hh * NA;
#pragma unroll
            for (int i = 0; i < BN / 8; i += 2) {
                const uint32_t addr = stg_a + hh * STG_HALF + stg_off(r, i + (m >> 1));
                float v[8];
#pragma unroll
                for (int j = 0; j < 4; j++) /* matrix j: hm = j & 1, column block i + (j >> 1) */
                    v[2 * j] = ac[4 * (i + (j >> 1)) + 2 * (j & 1)], v[2 * j + 1] = ac[4 * (i + (j >> 1)) + 2 * (j & 1) + 1];
                if (ACCUM) {
                    uint32_t o[4];
                    tm__ldsm_x4(o, addr);
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const float2 f = __bfloat1622float2(*(const __nv_bfloat162 *)&o[j]);
                        v[2 * j] += f.x, v[2 * j + 1] += f.y;
                    }
                }
                tm__stsm_x4(addr, tm__pack_bf16x2(v[0], v[1]), tm__pack_bf16x2(v[2], v[3]), tm__pack_bf16x2(v[4], v[5]),
                            tm__pack_bf16x2(v[6], v[7]));
            }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        gmm90_bar(wbar, 128);
#pragma unroll
        for (int hh = 0; hh < HALVES; hh++) {
            const int wrow = row0 + 64 * hh;
            const uint32_t sa = stg_a + hh * STG_HALF;
            if (!MG || wrow + 64 <= wlim) {
                if (wl == 0) {
#pragma unroll
                    for (int j = 0; j < BN / 64; j++) {
                        if (tl.n0 + 64 * j >= p.Nout) break;
                        if (MG) tm__tma_store_2d(&tmC, sa + j * 8192, tl.n0 + 64 * j, wrow);
                        else tm__tma_store_3d(&tmC, sa + j * 8192, tl.n0 + 64 * j, wrow, tl.g);
                    }
                    tm__bulk_commit();
                }
            } else {
                for (int idx = wl; idx < 64 * (BN / 8); idx += 128) {
                    const int rr = idx / (BN / 8), c8 = idx - rr * (BN / 8);
                    const int row = wrow + rr, col = tl.n0 + 8 * c8;
                    if (row < wlim && col < p.Nout)
                        *(uint4 *)(Cg + (long long)row * p.ldc + col) = *(const uint4 *)(stg + hh * STG_HALF + stg_off(rr, c8));
                }
            }
        }
    }
    if (wl == 0) tm__bulk_wait(); /* the stores have read the staging before the CTA's memory goes */
#endif
}

/* ---- host side ---- */

static int gmm90_probe(int dev, cudaError_t e, char *why, size_t n);

extern "C" int tm__gmm90_supported(char *why, size_t n) {
    /* per device: 0 unknown, 1 yes, 2 no (with its reason) */
    static int known[64];
    static char reason[64][200];
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess && dev >= 0 && dev < 64 && known[dev]) {
        if (known[dev] == 2) snprintf(why, n, "%s", reason[dev]);
        return known[dev] == 1;
    }
    const int r = gmm90_probe(dev, e, why, n);
    if (e == cudaSuccess && dev >= 0 && dev < 64) {
        if (!r) snprintf(reason[dev], sizeof reason[dev], "%s", why);
        known[dev] = r ? 1 : 2;
    }
    return r;
}

static int gmm90_probe(int dev, cudaError_t e, char *why, size_t n) {
    return tm__sm90_probe(dev, e, (const void *)gmm90_kernel<TM__GMM90_FWD, 256>, "the wgmma / TMA grouped GEMM",
                          "grouped_matmul_sm90.cu", why, n);
}

template <int MODE, int BN, bool WRITE = false, bool PP = false>
static int gmm90_launch(const tm__gmm90_args *a, const CUtensorMap &ma, const CUtensorMap &mb, const CUtensorMap &mc,
                        const CUtensorMap &mb2, const CUtensorMap &mc2, const CUtensorMap &mc3, gmm90_params p,
                        long long tiles_bound, cudaStream_t st, char *why, size_t n) {
    const size_t smem = gmm90_cfg<BN, PP>::smem(a->G);
    cudaError_t e = cudaFuncSetAttribute(gmm90_kernel<MODE, BN, WRITE, PP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    int dev = 0, sms = 0;
    if (e == cudaSuccess) e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) {
        snprintf(why, n, "grouped_matmul sm90: setting up the kernel: %s", cudaGetErrorString(e));
        return -1;
    }
    /* a CTA per SM, less the SMs left to collectives beside the work (their CTAs would hold
     * back as many of ours, each until a collective ends: the static schedule's tail) */
    if (a->spare_sms > 0 && a->spare_sms < sms) sms -= a->spare_sms;
    const long long grid = tiles_bound < sms ? tiles_bound : sms;
    if (grid <= 0) return 0;
    gmm90_kernel<MODE, BN, WRITE, PP><<<(unsigned)grid, GMM90_THREADS, smem, st>>>(ma, mb, mc, mb2, mc2, mc3, p);
    e = cudaGetLastError();
    if (e != cudaSuccess) {
        snprintf(why, n, "grouped_matmul sm90: launching gmm90_kernel<%d, %d, %d, %d> (%lld CTAs, %zu bytes of shared memory): %s",
                 MODE, BN, (int)WRITE, (int)PP, grid, smem, cudaGetErrorString(e));
        return -1;
    }
    return 0;
}

extern "C" int tm__gmm90_run(const tm__gmm90_args *a, cudaStream_t st, char *why, size_t n) {
    const int64_t G = a->G, R = a->R, K = a->K, N = a->N;
    if (!tm__gmm90_supported(why, n)) return 1;
    if (G < 1 || G > TM__GMM90_MAX_G) {
        snprintf(why, n, "%lld groups: the sm90 kernel takes 1 to %d", (long long)G, TM__GMM90_MAX_G);
        return 1;
    }
    if (K < 8 || N < 8 || K % 8 || N % 8 || K > (1 << 24) || N > (1 << 24)) {
        snprintf(why, n, "K %lld, N %lld: the sm90 kernel needs multiples of 8 (16-byte TMA strides), 8 to 2^24",
                 (long long)K, (long long)N);
        return 1;
    }
    if (R < 0 || R > INT32_MAX - 512 || G * K * N > ((int64_t)1 << 40)) {
        snprintf(why, n, "R %lld rows: the sm90 kernel takes fewer than 2^31 - 512", (long long)R);
        return 1;
    }
    const int sw = a->mode == TM__GMM90_FWD_SWIGLU;
    if (sw && (!a->b2 || !a->c_gate || !a->c_up)) {
        snprintf(why, n, "FWD_SWIGLU needs w_up, gate and up (b2, c_gate, c_up)");
        return -1;
    }
    if ((((uintptr_t)a->a | (uintptr_t)a->b | (uintptr_t)a->c) & 15u) != 0 ||
        (sw && (((uintptr_t)a->b2 | (uintptr_t)a->c_gate | (uintptr_t)a->c_up) & 15u) != 0)) {
        snprintf(why, n, "an operand is not 16-byte aligned (TMA needs it)");
        return 1;
    }
    const int dxs = a->mode == TM__GMM90_DX_SWIGLU;
    if (dxs && (!a->gate_in || !a->up_in || !a->c_dup)) {
        snprintf(why, n, "DX_SWIGLU needs gate, up and dup (gate_in, up_in, c_dup)");
        return -1;
    }
    if (dxs && (a->gate_in == a->c || a->gate_in == a->c_dup || a->up_in == a->c || a->up_in == a->c_dup)) {
        snprintf(why, n, "DX_SWIGLU: dgate and dup must not overwrite gate or up (other CTAs still read them)");
        return -1;
    }
    if (dxs && (((uintptr_t)a->gate_in | (uintptr_t)a->up_in | (uintptr_t)a->c_dup) & 15u) != 0) {
        snprintf(why, n, "an operand is not 16-byte aligned (TMA needs it)");
        return 1;
    }
    if (R == 0) return 0; /* FWD: y is empty; DX, DW: nothing to add */
    tm__tma_encode_fn enc = tm__tma_encoder(why, n);
    if (!enc) return -1;

    const uint64_t b2 = 2;
    const int Nout = a->mode == TM__GMM90_DX || dxs ? (int)K : (int)N;
    /* BN: 256 unless 128 covers the columns with fewer padded ones (1408 = 11 x 128); FWD_SWIGLU's
     * accumulator columns are 2 N (a tile takes BN / 2 of w_gate and the same of w_up) */
    const int acc_cols = sw ? 2 * Nout : Nout;
    if (a->schedule < TM__GMM90_AUTO || a->schedule > TM__GMM90_PINGPONG ||
        (a->schedule == TM__GMM90_PINGPONG && (a->mode == TM__GMM90_DW || a->bn == 256)) ||
        (dxs && (a->schedule == TM__GMM90_COOPERATIVE || a->bn == 256))) {
        snprintf(why, n, "schedule %d with mode %d and bn %d: ping-pong takes FWD, DX, FWD_SWIGLU and DX_SWIGLU at "
                 "bn 128, and DX_SWIGLU runs only ping-pong", a->schedule, a->mode, a->bn);
        return -1;
    }
    /* ping-pong where asked, and by default for FWD_SWIGLU, whose epilogue (three outputs and the
     * SwiGLU) it hides: 0.374 -> 0.335 ms at coarse's shapes on an H200. FWD and DX lose with it
     * (their epilogues are short; 128 x 128 tiles load more bytes per FLOP than 128 x 256): 0.293
     * -> 0.312 ms and 0.140 -> 0.153 ms, so they stay cooperative. BN 256 cannot be ping-pong: two
     * 64 x 256 accumulator halves would take 256 registers a thread. */
    const int pp = a->schedule == TM__GMM90_PINGPONG || dxs ||
                   (a->schedule == TM__GMM90_AUTO && a->mode == TM__GMM90_FWD_SWIGLU && a->bn != 256);
    const int bn = pp                                                                      ? 128
                   : a->bn == 128 || a->bn == 256                                          ? a->bn
                   : ((acc_cols + 255) / 256) * 256 <= ((acc_cols + 127) / 128) * 128 ? 256
                                                                                         : 128;
    gmm90_params p;
    memset(&p, 0, sizeof p);
    p.C = (__nv_bfloat16 *)a->c, p.counts = a->counts, p.G = (int)G, p.R = (int)R;
    const int bnc = sw ? bn / 2 : bn; /* columns of C a tile */
    p.Nout = Nout, p.tiles_n = (Nout + bnc - 1) / bnc;
    CUtensorMap ma, mb, mc, mb2, mc2, mc3;
    const uint32_t cbox[3] = {64, 64, 1};
    const uint64_t w3[3] = {(uint64_t)N, (uint64_t)K, (uint64_t)G}, w3s[2] = {(uint64_t)N * b2, (uint64_t)(K * N) * b2};
    long long bound;
    if (a->mode == TM__GMM90_FWD || a->mode == TM__GMM90_DX || sw || dxs) {
        const int fwd = a->mode != TM__GMM90_DX && !dxs;
        const int64_t red = fwd ? K : N;
        const uint64_t da[2] = {(uint64_t)red, (uint64_t)R}, sa[1] = {(uint64_t)red * b2};
        const uint32_t ba[2] = {64, 128};
        if (tm__tma_map_bf16(enc, &ma, a->a, 2, da, sa, ba, fwd ? "x" : "dy", why, n)) return -1;
        const uint32_t bb[3] = {64, fwd ? 64u : (uint32_t)bn, 1};
        if (tm__tma_map_bf16(enc, &mb, a->b, 3, w3, w3s, bb, "w", why, n)) return -1;
        const uint64_t dc[2] = {(uint64_t)Nout, (uint64_t)R}, sc[1] = {(uint64_t)Nout * b2};
        if (tm__tma_map_bf16(enc, &mc, a->c, 2, dc, sc, cbox, sw ? "h" : fwd ? "y" : dxs ? "dgate" : "dx", why, n)) return -1;
        if (dxs) {
            if (tm__tma_map_bf16(enc, &mc2, a->c_dup, 2, dc, sc, cbox, "dup", why, n)) return -1;
            p.C2 = (__nv_bfloat16 *)a->c_dup;
            p.Gi = (const __nv_bfloat16 *)a->gate_in, p.Ui = (const __nv_bfloat16 *)a->up_in;
        }
        if (sw) {
            if (tm__tma_map_bf16(enc, &mb2, a->b2, 3, w3, w3s, bb, "w_up", why, n)) return -1;
            if (tm__tma_map_bf16(enc, &mc2, a->c_gate, 2, dc, sc, cbox, "gate", why, n)) return -1;
            if (tm__tma_map_bf16(enc, &mc3, a->c_up, 2, dc, sc, cbox, "up", why, n)) return -1;
            p.C2 = (__nv_bfloat16 *)a->c_gate, p.C3 = (__nv_bfloat16 *)a->c_up;
        }
        p.Kred = (int)red, p.ldc = Nout;
        bound = ((R + 127) / 128 + G + 1) * (long long)p.tiles_n;
    } else if (a->mode == TM__GMM90_DW) {
        const uint64_t dx[2] = {(uint64_t)K, (uint64_t)R}, sx[1] = {(uint64_t)K * b2};
        const uint64_t dd[2] = {(uint64_t)N, (uint64_t)R}, sd[1] = {(uint64_t)N * b2};
        const uint32_t box[2] = {64, 64};
        if (tm__tma_map_bf16(enc, &ma, a->a, 2, dx, sx, box, "x", why, n)) return -1;
        if (tm__tma_map_bf16(enc, &mb, a->b, 2, dd, sd, box, "dy", why, n)) return -1;
        if (tm__tma_map_bf16(enc, &mc, a->c, 3, w3, w3s, cbox, "dw", why, n)) return -1;
        p.M = (int)K, p.tiles_m = (int)((K + 127) / 128), p.ldc = N, p.c_gstride = K * N;
        p.sched = a->sched;
        bound = G * (long long)p.tiles_m * p.tiles_n;
    } else {
        snprintf(why, n, "mode %d is none of FWD, DX, DW, FWD_SWIGLU, DX_SWIGLU", a->mode);
        return -1;
    }
    if (bound > INT32_MAX - 4096) { /* DW's counter adds up to a grid (the SMs) past the last tile */
        snprintf(why, n, "%lld tiles: more than the sm90 kernel's int32 tile index", bound);
        return 1;
    }
    if (!sw) mb2 = mb, mc3 = mc; /* unused: any valid map */
    if (!sw && !dxs) mc2 = mc;
#define GMM90_MAPS ma, mb, mc, mb2, mc2, mc3, p, bound, st, why, n
    if (pp) switch (a->mode) {
        case TM__GMM90_FWD: return gmm90_launch<TM__GMM90_FWD, 128, false, true>(a, GMM90_MAPS);
        case TM__GMM90_FWD_SWIGLU: return gmm90_launch<TM__GMM90_FWD_SWIGLU, 128, false, true>(a, GMM90_MAPS);
        case TM__GMM90_DX_SWIGLU: return gmm90_launch<TM__GMM90_DX_SWIGLU, 128, true, true>(a, GMM90_MAPS);
        default:
            return a->write ? gmm90_launch<TM__GMM90_DX, 128, true, true>(a, GMM90_MAPS)
                            : gmm90_launch<TM__GMM90_DX, 128, false, true>(a, GMM90_MAPS);
        }
    switch (a->mode * 2 + (bn == 256)) {
    case 0: return gmm90_launch<TM__GMM90_FWD, 128>(a, GMM90_MAPS);
    case 1: return gmm90_launch<TM__GMM90_FWD, 256>(a, GMM90_MAPS);
    case 6: return gmm90_launch<TM__GMM90_FWD_SWIGLU, 128>(a, GMM90_MAPS);
    case 7: return gmm90_launch<TM__GMM90_FWD_SWIGLU, 256>(a, GMM90_MAPS);
    case 2:
        return a->write ? gmm90_launch<TM__GMM90_DX, 128, true>(a, GMM90_MAPS)
                        : gmm90_launch<TM__GMM90_DX, 128>(a, GMM90_MAPS);
    case 3:
        return a->write ? gmm90_launch<TM__GMM90_DX, 256, true>(a, GMM90_MAPS)
                        : gmm90_launch<TM__GMM90_DX, 256>(a, GMM90_MAPS);
    case 4:
        return a->write ? gmm90_launch<TM__GMM90_DW, 128, true>(a, GMM90_MAPS)
                        : gmm90_launch<TM__GMM90_DW, 128>(a, GMM90_MAPS);
    default:
        return a->write ? gmm90_launch<TM__GMM90_DW, 256, true>(a, GMM90_MAPS)
                        : gmm90_launch<TM__GMM90_DW, 256>(a, GMM90_MAPS);
    }
#undef GMM90_MAPS
}
