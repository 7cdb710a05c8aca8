/*
 * grouped_matmul.cu — CUDA kernels of tm_grouped_matmul: the experts' ragged GEMM.
 *
 * Layout, as kernels/cpu/grouped_matmul.c:
 *   in[0]  x       (R, K)     rows of group g are [off_g, off_g + counts[g]), off_g = sum_{h<g} counts[h]
 *   in[1]  w       (G, K, N)
 *   in[2]  counts  (G) i64    each >= 0, sum = R
 *   out[0] y       (R, N)     y_g = x_g @ w[g]
 * Backward, accumulating (beta = 1) into gin, except a fresh dx (call->gin_fresh,
 * TM__OP_GRAD_WRITES), which the per-group GEMMs write with beta = 0 (the groups tile its rows):
 *   dx_g  += dy_g @ w[g]^T    (counts[g], K)
 *   dw[g] += x_g^T @ dy_g     (K, N); an empty group leaves dw[g] untouched (not even rewritten)
 * Nothing is saved: the backward reads x, w and counts again.
 *
 * Three implementations:
 *
 * f32, and bf16 by default: one cuBLASLt GEMM per non-empty group (tm__gemm_cuda_ragged, f32
 *   compute, no TF32; bf16 in and out. A plan per power-of-two bucket of the group's size, so
 *   a new routing queries no heuristic: with exact-size plans every call missed the cache,
 *   which made this path 1.7x slower per training step than the one below). The loop
 *   needs the group sizes on the host: tm__grouped_matmul_counts takes them from the counts'
 *   host mirror (framework/internal.h; a tm_moe_permute's tokens_per_expert have one) or reads
 *   them back once (one synchronisation, counted) and mirrors them. Validated on the host.
 *
 * bf16 with grouped_gemm = TM_GROUPED_GEMM_DEVICE (tm__gmm_device_schedule): our tensor-core kernel with the group offsets
 *   computed ON THE DEVICE, in one launch per direction: nothing is read
 *   back, no synchronisation, forward or backward. Counts with a host mirror are validated from
 *   it (as for f32: the same errors); counts without one are not validated (that would need a
 *   read back) but clamped on the device so that no access leaves the tensors: a count is taken
 *   as min(max(counts[g], 0), rows left), rows past the last group get y = 0 and no gradient.
 *   In isolation it is slower than cuBLASLt: on an H100 at the MoE benchmark's shapes (R = 98304,
 *   K 2048, N 2816, 64 groups) 263-273 TFLOP/s forward (32-35% of a dense GEMM of the same
 *   FLOPs) against 632-656 for cuBLASLt per group (bench/kernels.c); wgmma + TMA (sm_90a) is
 *   the way to close that. A training step is slower with it too (H100: coarse 114 against
 *   87 ms, fine 107 against 99 ms per step with cuBLASLt); what it has is a step without a
 *   single wait for the device (a CUDA graph capture needs that), and one launch instead of
 *   one cuBLASLt call per expert and direction (a slow host would feel those).
 *
 * bf16 with grouped_gemm = TM_GROUPED_GEMM_HOPPER: grouped_matmul_sm90.cu (sm_90a: wgmma, TMA,
 *   a persistent warp-specialised kernel, its own layout comment), the same device-side contract
 *   (clamped counts, rows past the groups 0, empty groups' dw untouched, no synchronisation);
 *   gmm_try_sm90 hands it each direction and falls back to the kernel below, per direction,
 *   where it says no (device, shape, alignment, group count), recording why (tm__gmm_note).
 *
 * The bf16 kernel, step by step:
 *
 * 1. gmm_schedule_kernel, one block of 1024 threads, from counts (G) on the device:
 *      c_g   = min(max(counts[g], 0), R)
 *      off_g = min(sum_{h<g} c_h, R)               (G + 1) i64: the clamped exclusive scan
 *      ts_g  = sum_{h<g} ceil((off_{h+1} - off_h) / BM)   (G + 1) i64: first m-tile of group g
 *    then, for each of the MT = ceil(R / BM) + G + 1 m-tiles of the grid, its group (binary
 *    search of ts) and rows [r0, r1) (each at most BM rows, never crossing a group end):
 *      tile_g (MT) i32, tile_r0, tile_r1 (MT) i64; tile_g = G: rows past the last group (only
 *      with bad counts), -1: nothing (a surplus tile: the grid is sized without knowing the
 *      counts, and sum_g ceil(n_g / BM) + ceil(tail / BM) <= R / BM + (G + 1)(BM - 1) / BM
 *      < ceil(R / BM) + G + 1 whatever the counts).
 * 2. gmm_kernel<MODE, VEC>: C (M, Nout) (+)= A (M, red) @ B (red, Nout) per CTA tile of
 *    BM x BN = 128 x 128, reduction in steps of BK = 32; 8 warps as 2 (M) x 4 (N), each warp
 *    64 x 32 = 4 x 4 mma.sync.m16n8k16 bf16 -> f32 tiles (64 f32 accumulators per thread).
 *      MODE   grid (1-D)                   A (M x red)                B (red x Nout)              C
 *      FWD    MT x ceil(N/BN)               x rows of the tile (K)     w[g] (K, N)                y rows, beta 0
 *      DX     MT x ceil(K/BN)               dy rows of the tile (N)    w[g]^T: w[g] read as (N,K) dx rows, beta 1
 *                                                                                  (beta 0 when fresh: args.write)
 *      DW     G x ceil(K/BM) x ceil(N/BN)   x_g^T: x (n_g, K) read     dy_g (n_g, N)              dw[g], beta 1
 *                                           column-wise
 *    blockIdx.x -> (m-tile, n-tile) with the n-tile fastest (CTAs side by side share their A
 *    rows in L2; a group's CTAs share w[g]). FWD/DX take group and rows of their m-tile from the
 *    schedule; surplus CTAs exit at once; DW CTAs of an empty group exit without writing.
 *    Shared memory: STAGES = 4 buffers of (A tile + B tile), each filled by cp.async.cg 16-byte
 *    copies (zero-filled past the edges: src-size 0) while the tensor cores work on an earlier
 *    one: load tiles 0..STAGES-2; then for each tile kt: wait until tile kt has landed
 *    (cp.async.wait_group STAGES-2), __syncthreads (which also frees the buffer of tile kt-1),
 *    issue the load of tile kt+STAGES-1 into that buffer, compute tile kt.
 *    Smem tiles are stored as the operands lie in global memory (contiguous dimension along the
 *    smem row) and turned into mma fragments by ldmatrix:
 *      A (m, red) red-contiguous (FWD, DX): [BM][BK + 8], ldmatrix.x4          -> a0..a3
 *      A (m, red) m-contiguous   (DW):      [BK][BM + 8], ldmatrix.x4.trans    -> a0..a3
 *      B (red, n) n-contiguous   (FWD, DW): [BK][BN + 8], ldmatrix.x4.trans    -> b0, b1 of 2 n8 tiles
 *      B (red, n) red-contiguous (DX):      [BN][BK + 8], ldmatrix.x4          -> b0, b1 of 2 n8 tiles
 *    The 8 padding elements (16 bytes) make a row stride of 80 or 272 bytes, 5 or 17 16-byte
 *    units: the 8 rows one ldmatrix phase reads fall in 8 different bank groups (no conflicts)
 *    and every row stays 16-byte aligned for cp.async. Smem: 68 to 80 KiB per CTA, 2 CTAs/SM.
 *    Epilogue: straight from the accumulator fragments (c0, c1 at row gid, c2, c3 at row gid + 8,
 *    columns 2 tig, 2 tig + 1) as bf16 pairs; beta 1 adds the old value in f32 and rounds once,
 *    as cuBLASLt does with beta = 1.
 *    VEC (cp.async) needs K and N multiples of 8 and 16-byte aligned x, w, y / dy, dx, dw, so
 *    that every 16-byte chunk of a row is wholly inside or outside the matrix and aligned. Other
 *    shapes take VEC = false: the same kernel with element-wise guarded loads into the same
 *    smem layout (slow but exact; only odd shapes need it).
 *
 * Determinism: every element of y, dx and dw[g] is produced by one thread of one CTA, summing
 *   its reduction in a fixed order (k-tiles ascending, two k16 steps each, the mma's internal
 *   order), independent of the launch and of the SM count. dw[g] is a reduction over the
 *   group's ragged rows: one CTA owns a (BM x BN) tile of dw[g] and loops over all the group's
 *   rows in order. No atomics at all: bit-identical results run to run.
 *
 * Timing it from a benchmark (bench/kernels.c does): make bf16 CUDA tensors x (R, K), w (G, K, N)
 *   and counts (G) i64, call tm_grouped_matmul in a loop (tm_ctx_arena_reset between
 *   iterations keeps memory flat; tm_backward_with_grad on y for the backward kernels) and
 *   bracket the loop with tm_ctx_sync; flops = 2 R K N forward, 4 R K N backward. By default
 *   (cuBLASLt per group) counts without a host mirror are read back once per arena lifetime;
 *   in a context created with grouped_gemm = TM_GROUPED_GEMM_DEVICE (the device-scheduled kernel)
 *   tm_ctx_sync_count stays put inside the loop.
 */
#include "common.cuh"
#include "mma.cuh"
#include "grouped_matmul_sm90.h"

#include <stdlib.h>
#include <string.h>

static inline char *at(const void *p, int64_t i, size_t esz) { return (char *)p + i * (int64_t)esz; }

/* ---- f32, and bf16 by default: one cuBLASLt GEMM per group ---------------------------------- */

static tm_status gmm_forward_lt(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    const tm_dtype dt = x->dtype;
    const int64_t *cnt;
    TM__TRY(tm__grouped_matmul_counts(c, &cnt));
    const int64_t G = w->shape[0], K = w->shape[1], N = w->shape[2];
    const size_t esz = tm_dtype_size(dt);
    const void *X = tm__data(x), *W = tm__data(w);
    void *Y = tm__data(c->out[0]);
    for (int64_t g = 0, off = 0; g < G; off += cnt[g], g++) {
        if (cnt[g] == 0) continue;
        // (n_g, K) @ (K, N) -> (n_g, N)
        TM__TRY(tm__gemm_cuda_ragged(c->ctx, dt, TM__GEMM_RAGGED_M, 0, 0, cnt[g], N, K, 1.0, at(X, off * K, esz), K,
                                     at(W, g * K * N, esz), N, 0.0, at(Y, off * N, esz), N));
    }
    return TM_OK;
}

static tm_status gmm_backward_lt(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *gx = c->gin[0], *gw = c->gin[1];
    const tm_dtype dt = x->dtype;
    const int64_t *cnt;
    TM__TRY(tm__grouped_matmul_counts(c, &cnt)); /* counts may have been rewritten since the forward */
    /* the validated groups tile dx's rows: a fresh dx is written by beta = 0; dw skips empty
     * groups, so a fresh dw is zero-filled first */
    TM__TRY(tm__gin_prepare(c, 1));
    const double bx = c->gin_fresh[0] ? 0.0 : 1.0;
    const int64_t G = w->shape[0], K = w->shape[1], N = w->shape[2];
    const size_t esz = tm_dtype_size(dt);
    const void *X = tm__data(x), *W = tm__data(w), *DY = tm__data(c->gout[0]);
    for (int64_t g = 0, off = 0; g < G; off += cnt[g], g++) {
        const int64_t n = cnt[g];
        if (n == 0) continue;
        const void *dy = at(DY, off * N, esz);
        if (gx) // (n, N) @ (K, N)^T -> (n, K)
            TM__TRY(tm__gemm_cuda_ragged(c->ctx, dt, TM__GEMM_RAGGED_M, 0, 1, n, K, N, 1.0, dy, N,
                                         at(W, g * K * N, esz), N, bx, at(tm__data(gx), off * K, esz), K));
        if (gw) // (n, K)^T @ (n, N) -> (K, N)
            TM__TRY(tm__gemm_cuda_ragged(c->ctx, dt, TM__GEMM_RAGGED_K, 1, 0, K, N, n, 1.0, at(X, off * K, esz), K, dy,
                                         N, 1.0, at(tm__data(gw), g * K * N, esz), N));
    }
    return TM_OK;
}

/* ---- bf16: the tensor-core kernel ------------------------------------------------------------ */

enum { GMM_FWD = 0, GMM_DX = 1, GMM_DW = 2 };

#define GMM_BM 128
#define GMM_BN 128
#define GMM_BK 32
#define GMM_STAGES 4
#define GMM_PAD 8
#define GMM_THREADS 256
#define GMM_SCHED_THREADS 1024

/* Shared-memory geometry of one mode (elements of bf16; see the top of the file). */
template <int MODE> struct gmm_layout {
    static constexpr bool A_MC = MODE == GMM_DW; /* A stored m-contiguous: smem [BK][BM + PAD] */
    static constexpr bool B_KC = MODE == GMM_DX; /* B stored red-contiguous: smem [BN][BK + PAD] */
    static constexpr int A_LD = A_MC ? GMM_BM + GMM_PAD : GMM_BK + GMM_PAD;
    static constexpr int A_ELEMS = A_MC ? GMM_BK * A_LD : GMM_BM * A_LD;
    static constexpr int B_LD = B_KC ? GMM_BK + GMM_PAD : GMM_BN + GMM_PAD;
    static constexpr int B_ELEMS = B_KC ? GMM_BN * B_LD : GMM_BK * B_LD;
    static constexpr int STAGE = A_ELEMS + B_ELEMS;
    static constexpr size_t SMEM = (size_t)GMM_STAGES * STAGE * sizeof(tm__bf16);
    static_assert((A_LD * 2) % 16 == 0 && (B_LD * 2) % 16 == 0, "smem rows must stay 16-byte aligned");
    static_assert((A_ELEMS * 2) % 16 == 0 && (STAGE * 2) % 16 == 0, "smem tiles must stay 16-byte aligned");
};
static_assert(GMM_THREADS == 256 && GMM_BM == 128 && GMM_BN == 128 && GMM_BK == 32,
              "the load mapping (2 16-byte chunks per thread and operand) and the warp grid assume these");

/* The device schedule (gmm_schedule_kernel; arena scratch of the call). */
struct gmm_sched {
    int64_t *off;     /* (G + 1) first row of each group; off[G]: end of the last group (<= R) */
    int64_t *ts;      /* (G + 1) first m-tile of each group; ts[G]: m-tiles of all groups */
    int64_t *r0, *r1; /* (MT) rows [r0, r1) of each m-tile */
    int *tg;          /* (MT) group of each m-tile; G: rows past the last group; -1: none */
};

struct gmm_args {
    const tm__bf16 *A, *B;
    tm__bf16 *C;
    int64_t lda, ldb, ldc;     /* row strides (elements) of A, B, C as stored */
    int64_t b_gstride;         /* FWD, DX: elements between w[g] and w[g + 1] */
    int64_t c_gstride;         /* DW: elements between dw[g] and dw[g + 1] */
    int64_t M;                 /* DW: rows of dw[g] (K); FWD, DX: rows come from the schedule */
    int64_t Nout;              /* columns of C */
    int64_t Kred;              /* FWD, DX: reduction length; DW: a group's rows (from off) */
    int64_t G;
    int64_t tiles_m, tiles_n;  /* DW: m-tiles over M; every mode: n-tiles over Nout */
    int write;                 /* DX: dx is fresh (call->gin_fresh): beta 0, rows past the groups 0 */
    const int64_t *off, *r0, *r1;
    const int *tg;
};

/* ---- 1. the schedule ---- */

/* Exclusive scan of v over the block (blockDim.x a multiple of 32, <= 1024); *total gets the
 * block's sum. sh: 32 slots. */
__device__ __forceinline__ long long gmm_block_scan(long long v, long long *sh, long long *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    long long x = v;
    for (int o = 1; o < 32; o <<= 1) {
        long long y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads(); /* sh may still be read by a previous call */
    if (lane == 31) sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        long long s = lane < nw ? sh[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            long long y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        if (lane < nw) sh[lane] = s; /* inclusive sums of the warp totals */
    }
    __syncthreads();
    *total = sh[nw - 1];
    return (warp ? sh[warp - 1] : 0) + x - v;
}

__global__ void __launch_bounds__(GMM_SCHED_THREADS) gmm_schedule_kernel(const int64_t *counts, int64_t G,
                                                                         int64_t R, int64_t MT, gmm_sched s) {
    __shared__ long long sh[32];
    long long rows = 0, tiles = 0; /* carried over the chunks of 1024 groups */
    for (int64_t base = 0; base < G; base += blockDim.x) {
        const int64_t g = base + threadIdx.x;
        long long c = 0, tot;
        if (g < G) {
            c = counts[g];
            c = c < 0 ? 0 : (c > R ? R : c);
        }
        /* min(min(S, R) + c, R) = min(S + c, R) for c >= 0: clamping the prefix sums clamps each
         * group to the rows left. */
        const long long S = rows + gmm_block_scan(c, sh, &tot);
        rows = min(rows + tot, (long long)R);
        const long long lo = min(S, (long long)R), hi = min(S + c, (long long)R);
        const long long t = (hi - lo + GMM_BM - 1) / GMM_BM;
        const long long T = tiles + gmm_block_scan(t, sh, &tot);
        tiles += tot;
        if (g < G) s.off[g] = lo, s.ts[g] = T;
    }
    if (threadIdx.x == 0) s.off[G] = rows, s.ts[G] = tiles;
    __syncthreads(); /* the block's global writes are visible to the whole block after it */
    const int64_t total = s.ts[G], end = s.off[G];
    for (int64_t mt = threadIdx.x; mt < MT; mt += blockDim.x) {
        int g;
        int64_t r0, r1;
        if (mt < total) {
            /* the last g with ts[g] <= mt: ts[g] <= mt < ts[g + 1], so g is not empty */
            int64_t lo = 0, hi = G;
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) >> 1;
                if (s.ts[mid] <= mt) lo = mid;
                else hi = mid - 1;
            }
            g = (int)lo;
            r0 = s.off[lo] + (mt - s.ts[lo]) * GMM_BM;
            r1 = min(r0 + GMM_BM, s.off[lo + 1]);
        } else {
            r0 = end + (mt - total) * GMM_BM; /* rows past the last group (bad counts only) */
            r1 = min(r0 + GMM_BM, R);
            g = r0 < R ? (int)G : -1;
            if (g < 0) r0 = r1 = 0;
        }
        s.tg[mt] = g, s.r0[mt] = r0, s.r1[mt] = r1;
    }
}

/* ---- 2. the GEMM ---- */

template <int MODE, bool VEC>
__global__ void __launch_bounds__(GMM_THREADS, 2) gmm_kernel(gmm_args a) {
    typedef gmm_layout<MODE> L;
    constexpr bool A_MC = L::A_MC, B_KC = L::B_KC;
    extern __shared__ __align__(128) unsigned char gmm_smem[];
    tm__bf16 *const sm = (tm__bf16 *)gmm_smem;

    /* Which tile: rows [m_lo, m_hi) of C (at most BM of them from m_lo), columns from n0,
     * reduction [red_lo, red_hi). */
    const int64_t bid = blockIdx.x;
    int64_t m_lo, m_hi, red_lo, red_hi, nt;
    const tm__bf16 *A = a.A, *B = a.B;
    tm__bf16 *C = a.C;
    if constexpr (MODE == GMM_DW) {
        const int64_t per = a.tiles_m * a.tiles_n, g = bid / per, rem = bid - g * per, mt = rem / a.tiles_n;
        nt = rem - mt * a.tiles_n;
        red_lo = a.off[g], red_hi = a.off[g + 1]; /* the group's rows of x and dy */
        if (red_hi <= red_lo) return;             /* an empty group: dw[g] stays as it was */
        m_lo = mt * GMM_BM, m_hi = a.M;
        C += g * a.c_gstride;
    } else {
        const int64_t mt = bid / a.tiles_n;
        nt = bid - mt * a.tiles_n;
        const int g = a.tg[mt];
        if (g < 0) return; /* a surplus tile */
        m_lo = a.r0[mt], m_hi = a.r1[mt];
        red_lo = 0, red_hi = a.Kred;
        if (g >= a.G) {                     /* rows past the last group (bad counts) */
            if (MODE == GMM_DX && !a.write) return; /* no gradient */
            red_hi = 0;                     /* y = 0; a fresh dx = 0 */
        } else {
            B += (int64_t)g * a.b_gstride;
        }
    }
    const int64_t n0 = nt * GMM_BN;
    const int64_t ktiles = (red_hi - red_lo + GMM_BK - 1) / GMM_BK;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm0 = (warp >> 2) * 64, wn0 = (warp & 3) * 32;

    /* Fill buffer `stage` with reduction tile kt: 512 16-byte chunks per operand, 2 per thread. */
    auto load = [&](int stage, int64_t kt) {
        tm__bf16 *sA = sm + stage * L::STAGE, *sB = sA + L::A_ELEMS;
        const int64_t k0 = red_lo + kt * GMM_BK;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int ch = tid + h * GMM_THREADS;
            /* A element (m, k) */
            int ar, ac;        /* smem row, column of the chunk */
            int64_t am, ak;    /* global m, k of its first element */
            if constexpr (A_MC) ar = ch >> 4, ac = (ch & 15) * 8, am = m_lo + ac, ak = k0 + ar;
            else ar = ch >> 2, ac = (ch & 3) * 8, am = m_lo + ar, ak = k0 + ac;
            tm__bf16 *da = sA + ar * L::A_LD + ac;
            /* B element (k, n) */
            int br, bc;
            int64_t bk, bn;
            if constexpr (B_KC) br = ch >> 2, bc = (ch & 3) * 8, bn = n0 + br, bk = k0 + bc;
            else br = ch >> 4, bc = (ch & 15) * 8, bk = k0 + br, bn = n0 + bc;
            tm__bf16 *db = sB + br * L::B_LD + bc;
            if constexpr (VEC) {
                /* the contiguous extent is a multiple of 8: a chunk is wholly in or out */
                const bool aok = am < m_hi && ak < red_hi, bok = bk < red_hi && bn < a.Nout;
                const tm__bf16 *ga = A_MC ? A + ak * a.lda + am : A + am * a.lda + ak;
                const tm__bf16 *gb = B_KC ? B + bn * a.ldb + bk : B + bk * a.ldb + bn;
                tm__cp_async16(tm__smem_u32(da), aok ? ga : a.A, aok ? 16 : 0);
                tm__cp_async16(tm__smem_u32(db), bok ? gb : a.B, bok ? 16 : 0);
            } else {
                const unsigned short *A16 = (const unsigned short *)A, *B16 = (const unsigned short *)B;
                unsigned short *da16 = (unsigned short *)da, *db16 = (unsigned short *)db;
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    int64_t m = am, k = ak;
                    if constexpr (A_MC) m += e;
                    else k += e;
                    da16[e] = m < m_hi && k < red_hi ? A16[A_MC ? k * a.lda + m : m * a.lda + k] : (unsigned short)0;
                    int64_t kb = bk, n = bn;
                    if constexpr (B_KC) kb += e;
                    else n += e;
                    db16[e] = kb < red_hi && n < a.Nout ? B16[B_KC ? n * a.ldb + kb : kb * a.ldb + n] : (unsigned short)0;
                }
            }
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;

#pragma unroll
    for (int s = 0; s < GMM_STAGES - 1; s++) {
        if (s < ktiles) load(s, s);
        tm__cp_async_commit(); /* empty groups keep the count of groups in step with the tiles */
    }
    for (int64_t kt = 0; kt < ktiles; kt++) {
        tm__cp_async_wait<GMM_STAGES - 2>(); /* this thread's copies of tile kt have landed... */
        __syncthreads();               /* ...everyone's have, and buffer (kt - 1) % STAGES is free */
        const int64_t nk = kt + GMM_STAGES - 1;
        if (nk < ktiles) load((int)(nk % GMM_STAGES), nk);
        tm__cp_async_commit();

        const tm__bf16 *sA = sm + (int)(kt % GMM_STAGES) * L::STAGE, *sB = sA + L::A_ELEMS;
        const uint32_t aBase = tm__smem_u32(sA), bBase = tm__smem_u32(sB);
#pragma unroll
        for (int kk = 0; kk < GMM_BK; kk += 16) {
            uint32_t af[4][4], bf[4][2];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if constexpr (A_MC) {
                    /* matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
                     * of smem [k][m]: lane l gives row k = (l & 7) + (l >> 4) * 8 at m ((l >> 3) & 1) * 8 */
                    const int r = kk + (lane & 7) + (lane >> 4) * 8, col = wm0 + i * 16 + ((lane >> 3) & 1) * 8;
                    tm__ldsm_x4_trans(af[i], aBase + (uint32_t)(r * L::A_LD + col) * 2u);
                } else {
                    /* same four matrices of smem [m][k]: lane l gives row m = l & 15 at k (l >> 4) * 8 */
                    const int r = wm0 + i * 16 + (lane & 15), col = kk + (lane >> 4) * 8;
                    tm__ldsm_x4(af[i], aBase + (uint32_t)(r * L::A_LD + col) * 2u);
                }
            }
#pragma unroll
            for (int jp = 0; jp < 2; jp++) {
                uint32_t t[4];
                if constexpr (B_KC) {
                    /* matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                     * of smem [n][k]: b0, b1 of the n8 tile 2 jp, then of 2 jp + 1 */
                    const int r = wn0 + jp * 16 + (lane & 7) + (lane >> 4) * 8, col = kk + ((lane >> 3) & 1) * 8;
                    tm__ldsm_x4(t, bBase + (uint32_t)(r * L::B_LD + col) * 2u);
                } else {
                    /* the same from smem [k][n], transposed */
                    const int r = kk + (lane & 7) + ((lane >> 3) & 1) * 8, col = wn0 + jp * 16 + (lane >> 4) * 8;
                    tm__ldsm_x4_trans(t, bBase + (uint32_t)(r * L::B_LD + col) * 2u);
                }
                bf[2 * jp][0] = t[0], bf[2 * jp][1] = t[1], bf[2 * jp + 1][0] = t[2], bf[2 * jp + 1][1] = t[3];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) tm__mma_bf16_16816(acc[i][j], af[i], bf[j][0], bf[j][1]);
        }
    }
    tm__cp_async_wait<0>(); /* only empty groups can be pending; leave nothing in flight */

    /* Epilogue: thread (gid, tig) of the warp holds C[gid][2 tig, 2 tig + 1] and
     * C[gid + 8][2 tig, 2 tig + 1] of each 16 x 8 tile. */
    const bool ACCUM = MODE != GMM_FWD && !a.write;
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int64_t row = m_lo + wm0 + i * 16 + gid + hf * 8;
            if (row >= m_hi) continue;
            tm__bf16 *crow = C + row * a.ldc;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int64_t col = n0 + wn0 + j * 8 + 2 * tig;
                if (col >= a.Nout) continue;
                float v0 = acc[i][j][2 * hf], v1 = acc[i][j][2 * hf + 1];
                if constexpr (VEC) {
                    /* Nout and ldc are multiples of 8 and col is even: the pair is inside and
                     * 4-byte aligned */
                    __nv_bfloat162 *p = (__nv_bfloat162 *)(crow + col);
                    if (ACCUM) {
                        const float2 o = __bfloat1622float2(*p);
                        v0 += o.x, v1 += o.y;
                    }
                    *p = __floats2bfloat162_rn(v0, v1);
                } else {
                    if (ACCUM) v0 += __bfloat162float(crow[col]);
                    crow[col] = __float2bfloat16_rn(v0);
                    if (col + 1 < a.Nout) {
                        if (ACCUM) v1 += __bfloat162float(crow[col + 1]);
                        crow[col + 1] = __float2bfloat16_rn(v1);
                    }
                }
            }
        }
}

/* ---- host side ---- */

static const char *const GMM_WHAT = "grouped_matmul";

/* 1: bf16 goes to cuBLASLt per group (the default; TM_GROUPED_GEMM_DEVICE: our kernel). */
static int gmm_use_cublaslt(tm__call *c) { return !tm__gmm_device_schedule(c->ctx); }

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* The schedule of the call's counts on the device (step 1); *MT: m-tiles of the FWD / DX grid. */
static tm_status gmm_schedule(tm__call *c, tm__cuda *st, int64_t R, int64_t G, gmm_sched *s, int64_t *MT) {
    tm_ctx *ctx = c->ctx;
    const int64_t mt = (R + GMM_BM - 1) / GMM_BM + G + 1;
    if (G > INT32_MAX - 1)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "grouped_matmul: %lld groups, at most %d on CUDA (counts %s)",
                       (long long)G, INT32_MAX - 1, tm__tdesc(ctx, c->in[2]));
    void *p;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)(2 * (G + 1) + 2 * mt) * sizeof(int64_t) + (size_t)mt * sizeof(int), &p));
    s->off = (int64_t *)p;
    s->ts = s->off + (G + 1);
    s->r0 = s->ts + (G + 1);
    s->r1 = s->r0 + mt;
    s->tg = (int *)(s->r1 + mt);
    gmm_schedule_kernel<<<1, GMM_SCHED_THREADS, 0, st->stream>>>((const int64_t *)tm__data(c->in[2]), G, R, mt, *s);
    TM__CU_LAUNCHED(ctx, GMM_WHAT, "gmm_schedule_kernel");
    *MT = mt;
    return TM_OK;
}

template <int MODE, bool VEC>
static tm_status gmm_launch1(tm_ctx *ctx, tm__cuda *st, const gmm_args &a, int64_t blocks) {
    const size_t smem = gmm_layout<MODE>::SMEM;
    TM__CU_CHECK(ctx, GMM_WHAT,
                 cudaFuncSetAttribute(gmm_kernel<MODE, VEC>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    gmm_kernel<MODE, VEC><<<(unsigned)blocks, GMM_THREADS, smem, st->stream>>>(a);
    TM__CU_LAUNCHED(ctx, GMM_WHAT, "gmm_kernel");
    return TM_OK;
}

template <int MODE>
static tm_status gmm_launch(tm__call *c, tm__cuda *st, const gmm_args &a, int64_t blocks, bool vec) {
    if (blocks <= 0) return TM_OK;
    if (blocks > INT32_MAX)
        return tm__err(c->ctx, TM_ERR_INVALID_ARG, "grouped_matmul: x %s, w %s need %lld tiles, more than one CUDA "
                       "launch holds", tm__tdesc(c->ctx, c->in[0]), tm__tdesc(c->ctx, c->in[1]), (long long)blocks);
    return vec ? gmm_launch1<MODE, true>(c->ctx, st, a, blocks) : gmm_launch1<MODE, false>(c->ctx, st, a, blocks);
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* dw[g] = 0 for each group g that owns no rows in the sm90 kernel's schedule (counts on the
 * device, clamped to [0, R] and cut at R as grouped_matmul_sm90.cu does): a fresh dw's groups
 * that the K-grouped kernel, which gives such groups no tile, leaves unwritten.  dw (G, K, N) */
__global__ void gmm_zero_empty_kernel(tm__bf16 *dw, const int64_t *counts, int64_t R, int64_t per_group) {
    const int64_t g = blockIdx.y;
    __shared__ int empty;
    if (threadIdx.x == 0) {
        int64_t S = 0; /* the clamped rows before g (G <= TM__GMM90_MAX_G: a short loop) */
        for (int64_t h = 0; h < g; h++) S += counts[h] < 0 ? 0 : (counts[h] > R ? R : counts[h]);
        const int64_t c = counts[g] < 0 ? 0 : (counts[g] > R ? R : counts[g]);
        const int64_t lo = S < R ? S : R, hi = S + c < R ? S + c : R;
        empty = hi <= lo;
    }
    __syncthreads();
    if (!empty) return;
    tm__bf16 *d = dw + g * per_group;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < per_group; i += (int64_t)gridDim.x * blockDim.x)
        tm__st(d + i, 0.0f);
}

static tm_status gmm_zero_empty(tm__call *c, tm__cuda *st, void *dw) {
    const tm_tensor *w = c->in[1];
    const int64_t G = w->shape[0], per = w->shape[1] * w->shape[2], R = c->in[0]->shape[0];
    if (G == 0 || per == 0) return TM_OK;
    const int64_t blocks = (per + 255) / 256;
    gmm_zero_empty_kernel<<<dim3((unsigned)(blocks < 64 ? blocks : 64), (unsigned)G), 256, 0, st->stream>>>(
        (tm__bf16 *)dw, (const int64_t *)tm__data(c->in[2]), R, per);
    TM__CU_CHECK(c->ctx, "grouped_matmul (dw of empty groups)", cudaGetLastError());
    return TM_OK;
}

/* Under TM_GROUPED_GEMM_HOPPER: the sm_90a kernel (grouped_matmul_sm90.cu) for one direction.
 * 1: done (*s TM_OK) or failed (*s the error); 0: it cannot take this call (the reason goes to
 * tm__gmm_note) and the caller runs the kernel of this file. */
static int gmm_try_sm90(tm__call *c, tm__cuda *st, int mode, const void *A, const void *B, void *C, tm_status *s) {
    *s = TM_OK;
    if (tm__gmm_mode(c->ctx) != TM_GROUPED_GEMM_HOPPER) return 0;
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm__gmm90_args a;
    memset(&a, 0, sizeof a);
    a.mode = mode, a.a = A, a.b = B, a.c = C, a.counts = (const int64_t *)tm__data(c->in[2]);
    a.G = w->shape[0], a.R = x->shape[0], a.K = w->shape[1], a.N = w->shape[2];
    a.bn = 0;
    a.spare_sms = tm__cuda_side_busy(st) ? tm__coll_spare_sms(c->ctx) : 0;
    a.write = (mode == TM__GMM90_DX && c->gin_fresh[0]) || (mode == TM__GMM90_DW && c->gin_fresh[1]);
    a.sched = NULL;
    if (mode == TM__GMM90_DW) { /* the dynamic tile schedule's counter, 0 at the launch */
        if ((*s = tm__cu_scratch(c->ctx, st, sizeof(int), (void **)&a.sched)) != TM_OK) return 1;
        const cudaError_t e = cudaMemsetAsync(a.sched, 0, sizeof(int), st->stream);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            *s = tm__err(c->ctx, TM_ERR_CUDA, "grouped_matmul: zeroing dw's tile counter: %s", cudaGetErrorString(e));
            return 1;
        }
    }
    char why[256];
    const int rc = tm__gmm90_run(&a, st->stream, why, sizeof why);
    if (rc == 0) {
        tm__gmm_set_note(c->ctx, "");
        /* a fresh dw: the kernel gives an empty group no tile, so its dw[g] is zeroed here */
        if (mode == TM__GMM90_DW && a.write) *s = gmm_zero_empty(c, st, C);
        return 1;
    }
    if (rc > 0) {
        tm__gmm_set_note(c->ctx, why);
        return 0;
    }
    *s = tm__err(c->ctx, TM_ERR_CUDA, "grouped_matmul: x %s, w %s, %s on the sm90 kernel: %s", tm__tdesc(c->ctx, x),
                 tm__tdesc(c->ctx, w), mode == TM__GMM90_FWD ? "forward" : mode == TM__GMM90_DX ? "dx" : "dw", why);
    return 1;
}

static tm_status gmm_forward_bf16(tm__call *c, tm__cuda *st) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    const int64_t R = x->shape[0], G = w->shape[0], K = w->shape[1], N = w->shape[2];
    const int64_t *cnt;
    TM__TRY(tm__grouped_matmul_counts_mirrored(c, &cnt)); /* validates a mirror; reads nothing back */
    if (R == 0 || N == 0) return TM_OK;
    void *y = tm__data(c->out[0]);
    tm_status rs;
    if (gmm_try_sm90(c, st, TM__GMM90_FWD, tm__data(x), tm__data(w), y, &rs)) return rs;
    gmm_sched s;
    int64_t MT;
    TM__TRY(gmm_schedule(c, st, R, G, &s, &MT));
    gmm_args a;
    memset(&a, 0, sizeof a);
    a.A = (const tm__bf16 *)tm__data(x), a.lda = K;
    a.B = (const tm__bf16 *)tm__data(w), a.ldb = N, a.b_gstride = K * N;
    a.C = (tm__bf16 *)y, a.ldc = N;
    a.Nout = N, a.Kred = K, a.G = G, a.tiles_n = cdiv(N, GMM_BN);
    a.r0 = s.r0, a.r1 = s.r1, a.tg = s.tg;
    const bool vec = K % 8 == 0 && N % 8 == 0 && aligned16(a.A) && aligned16(a.B) && aligned16(y);
    return gmm_launch<GMM_FWD>(c, st, a, MT * a.tiles_n, vec);
}

static tm_status gmm_backward_bf16(tm__call *c, tm__cuda *st) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *gx = c->gin[0], *gw = c->gin[1];
    const int64_t R = x->shape[0], G = w->shape[0], K = w->shape[1], N = w->shape[2];
    const int64_t *cnt;
    TM__TRY(tm__grouped_matmul_counts_mirrored(c, &cnt)); /* counts may have been rewritten since the forward */
    /* a fresh dx is written whole by either kernel (rows past the groups 0); a fresh dw by the
     * sm90 kernel with its empty groups zeroed after it (gmm_zero_empty); the kernel of this
     * file skips empty groups' dw and adds, so there a fresh dw is zero-filled first, as is a
     * fresh gradient that no kernel will write */
    if (R == 0 || K == 0 || N == 0) { /* nothing to add */
        TM__TRY(tm__gin_prepare(c, 1));
        return tm__gin_prepare(c, 0);
    }
    const void *X = tm__data(x), *W = tm__data(w), *DY = tm__data(c->gout[0]);
    tm_status rs;
    if (gx && gmm_try_sm90(c, st, TM__GMM90_DX, DY, W, tm__data(gx), &rs)) {
        TM__TRY(rs);
        gx = NULL; /* done */
    }
    if (gw && gmm_try_sm90(c, st, TM__GMM90_DW, X, DY, tm__data(gw), &rs)) {
        TM__TRY(rs);
        gw = NULL;
    }
    if (gw) TM__TRY(tm__gin_prepare(c, 1));
    if (!gx && !gw) return TM_OK;
    gmm_sched s;
    int64_t MT;
    TM__TRY(gmm_schedule(c, st, R, G, &s, &MT));
    const bool vec = K % 8 == 0 && N % 8 == 0 && aligned16(X) && aligned16(W) && aligned16(DY) &&
                     (!gx || aligned16(tm__data(gx))) && (!gw || aligned16(tm__data(gw)));
    if (gx) { // (n_g, N) @ (K, N)^T -> (n_g, K)
        gmm_args a;
        memset(&a, 0, sizeof a);
        a.A = (const tm__bf16 *)DY, a.lda = N;
        a.B = (const tm__bf16 *)W, a.ldb = N, a.b_gstride = K * N;
        a.C = (tm__bf16 *)tm__data(gx), a.ldc = K;
        a.Nout = K, a.Kred = N, a.G = G, a.tiles_n = cdiv(K, GMM_BN);
        a.r0 = s.r0, a.r1 = s.r1, a.tg = s.tg;
        a.write = c->gin_fresh[0];
        TM__TRY(gmm_launch<GMM_DX>(c, st, a, MT * a.tiles_n, vec));
    }
    if (gw) { // (n_g, K)^T @ (n_g, N) -> (K, N)
        gmm_args a;
        memset(&a, 0, sizeof a);
        a.A = (const tm__bf16 *)X, a.lda = K;
        a.B = (const tm__bf16 *)DY, a.ldb = N;
        a.C = (tm__bf16 *)tm__data(gw), a.ldc = N, a.c_gstride = K * N;
        a.M = K, a.Nout = N, a.G = G, a.tiles_m = cdiv(K, GMM_BM), a.tiles_n = cdiv(N, GMM_BN);
        a.off = s.off;
        TM__TRY(gmm_launch<GMM_DW>(c, st, a, G * a.tiles_m * a.tiles_n, vec));
    }
    return TM_OK;
}

/* ---- entry points ---------------------------------------------------------------------------- */

extern "C" tm_status tm__grouped_matmul_forward_cuda(tm__call *c) {
    if (c->in[0]->dtype != TM_BF16) return gmm_forward_lt(c);
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, GMM_WHAT, &st));
    return gmm_use_cublaslt(c) ? gmm_forward_lt(c) : gmm_forward_bf16(c, st);
}

extern "C" tm_status tm__grouped_matmul_backward_cuda(tm__call *c) {
    if (!c->gin[0] && !c->gin[1]) return TM_OK;
    if (c->in[0]->dtype != TM_BF16) return gmm_backward_lt(c);
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, GMM_WHAT, &st));
    return gmm_use_cublaslt(c) ? gmm_backward_lt(c) : gmm_backward_bf16(c, st);
}
