/*
 * attention_sm90.cu — tm_attention's bf16 kernels on Hopper (sm_90a): the products on wgmma,
 * D = 64 or 128. The math, the tensors' layout, the causal rule (query i sees keys j <= i + off),
 * lse's and Delta's meaning are attention.cu's (its top comment); the sm_80 kernels of
 * attention_tc.cuh compute the same with mma.sync and stay the path for every other GPU.
 *
 * Why: the mma.sync kernels keep every operand and accumulator in registers (239-255 a thread),
 * so 8 warps fit an SM and each ldmatrix feeds 2-4 mma; they ran at 30-41% of the tensor pipe.
 * wgmma reads its B operand (and here A, where it is a tile of q, k, v or dO) straight from shared
 * memory, one instruction per 64 x N x 16 product for the whole warpgroup, and runs asynchronously,
 * so the registers hold only accumulators. FlashAttention-3 (Shah et al. 2024) is the model.
 *
 * Tiles in shared memory: a (ROWS, D) bf16 tile is D / 64 panels of (ROWS, 64), each row 128
 * bytes with the 128-byte swizzle (16-byte chunk c of row r at r 128 + ((c ^ (r % 8)) 16)), the
 * panels ROWS 128 bytes apart from a 1024-byte aligned base: the layout TMA's 128-byte swizzle
 * writes and wgmma's descriptors read (wgmma.cuh). TMA zero-fills rows past Tq or Tk (the tensor
 * maps are (D, heads, T, B), so a box never reads the next sequence).
 * The same tile serves as a K-major operand (rows = M or N, reduction over D: S = Q K^T) and as an
 * N-major B (rows = the reduction, D = N: O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q).
 *
 * Each kernel is a TMA producer warp and NC consumer warpgroups of 64 rows (query rows in the
 * forward and dQ, keys in dK/dV; fa90_cfg), m64 wgmmas; "the TMA-producer kernels" below says how
 * the stages and barriers work. The per-tile work:
 *   forward  (b, h, 64 NC query rows); key tiles of BN streamed: S = Q K^T (m64nBN, A = Q, B = K
 *            from shared memory), the online softmax of attention_tc.cuh in registers (log2 units,
 *            scale folded into the exponent, conditional rescale by FA_RESCALE), then O += P V with
 *            P's bf16 A fragments in registers (the accumulator layout of S is the A layout).
 *   dQ       (b, h, 64 NC query rows); key tiles of 64 streamed: S = Q K^T, dP = dO V^T (m64n64,
 *            issued together, the softmax of S while dP runs), dS = P (dP - Delta_i), dQ += dS K
 *            (A = dS in registers). Recomputing S and dP here rather than adding dQ from the dK/dV
 *            CTAs with atomics keeps one writer per gradient row (determinism; attention.cu).
 *   dK/dV    (b, kv head, 64 NC keys); over the G query heads in order, each over its query tiles
 *            of 64 from the first that sees the keys, streamed: S^T = K Q^T, dP^T = V dO^T
 *            (m64n64), dV += P^T dO, dK += dS^T Q (A in registers, B = dO and Q N-major).
 * Blocks start longest first (the last query blocks, the first key blocks), as on sm_80; a
 * warpgroup skips the tiles none of its rows sees. A first version loaded by cp.async from every
 * thread into a double buffer with a CTA barrier each tile: its warpgroups computed their softmax
 * in lockstep while the tensor cores waited (docs/PERFORMANCE.md has both versions' times). Here
 * each consumer waits only for its stage, and 2-3 CTAs of one consumer each share an SM, so one's
 * softmax runs under another's products. Not yet done: FlashAttention-3's ordering of two
 * consumers by named barriers, and issuing the next tile's S before this tile's softmax.
 *
 * Precision and order: P and dS are rounded to bf16 as operands (as on sm_80); each output element
 * is one thread's f32 sum over the tiles in a fixed order, so results are the same bits run to
 * run, but not the sm_80 kernels' bits (wgmma's internal order differs from mma.sync's, and the
 * tiles are larger): tests/test_cuda_parity_attention.c holds both to the CPU with one tolerance.
 */
#include "attention_sm90.h"
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FA90_DEVICE 1
#endif

#define FA90_LOG2E 1.4426950408889634f
#define FA90_LN2 0.6931471805599453f
#define FA90_RESCALE 8.0f /* as FA_RESCALE in attention_tc.cuh */

typedef __nv_bfloat16 fa90_bf16;

struct fa90_p {
    const fa90_bf16 *q, *k, *v, *dout;
    fa90_bf16 *out, *dq, *dk, *dv;
    float *lse;
    const float *delta;
    long long qs, ks; /* row strides over time: Hq D and Hkv D */
    int B, Tq, Tk, Hq, Hkv, G, off;
    float scale, scale_log2;
    int fq, fk, fv;
};

__host__ __device__ __forceinline__ int fa90_min(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int fa90_cdiv(int a, int b) { return (a + b - 1) / b; }

/* K-major operand: the k16 block kk of rows [row, row + 64) of a (ROWS, D) tile. */
template <int ROWS>
__device__ __forceinline__ uint64_t fa90_desc_k(uint32_t tile, int row, int kk) {
    return tm__wgmma_desc(tile + (uint32_t)((kk >> 2) * (ROWS * 128) + row * 128 + (kk & 3) * 32), 16, 1024);
}
/* N-major B: reduction rows [16 kk, + 16) of a (ROWS, D) tile, its D columns as N. */
template <int ROWS>
__device__ __forceinline__ uint64_t fa90_desc_n(uint32_t tile, int kk) {
    return tm__wgmma_desc(tile + (uint32_t)(kk * 2048), ROWS * 128, 1024);
}
template <int N, int TB>
__device__ __forceinline__ void fa90_ss(float *d, uint64_t da, uint64_t db, int scale_d) {
    if (N == 64) tm__wgmma_ss_n64<TB>(d, da, db, scale_d);
    else tm__wgmma_ss_n128<TB>(d, da, db, scale_d);
}
template <int N>
__device__ __forceinline__ void fa90_rs(float *d, const uint32_t *a, uint64_t db) {
    if (N == 64) tm__wgmma_rs_n64<1>(d, a, db, 1);
    else tm__wgmma_rs_n128<1>(d, a, db, 1);
}
/* g[0..1] (+)= (a, b), rounded once; fresh: g not read. */
__device__ __forceinline__ void fa90_add2(fa90_bf16 *g, float a, float b, int fresh) {
    if (!fresh) {
        const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(g));
        a += o.x, b += o.y;
    }
    *reinterpret_cast<uint32_t *>(g) = tm__pack_bf16x2(a, b);
}

/* dK/dV's epilogue: rows jw + g and jw + g + 8 of dk (times scale) and dv into the gradients (added,
 * or stored where fresh). dk and dv of an element have the same owner thread; when they are one
 * buffer (k passed as v), it adds their sum, rounded once (as on sm_80). */
template <int D>
__device__ __forceinline__ void fa90_dkv_store(const fa90_p &p, const float *dk, const float *dv, int b, int hk, int jw, int g,
                                               int t4) {
    constexpr int ND = D / 8;
    const bool one = p.dk == p.dv;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int j = jw + half * 8 + g;
        if (j >= p.Tk) continue;
        const long long ro = ((long long)b * p.Tk + j) * p.ks + (long long)hk * D + t4 * 2;
#pragma unroll
        for (int x = 0; x < ND; x++) {
            const float k0 = p.scale * dk[4 * x + 2 * half], k1 = p.scale * dk[4 * x + 2 * half + 1];
            const float v0 = dv[4 * x + 2 * half], v1 = dv[4 * x + 2 * half + 1];
            if (one) {
                fa90_add2(p.dk + ro + x * 8, k0 + v0, k1 + v1, p.fk && p.fv);
            } else {
                if (p.dk) fa90_add2(p.dk + ro + x * 8, k0, k1, p.fk);
                if (p.dv) fa90_add2(p.dv + ro + x * 8, v0, v1, p.fv);
            }
        }
    }
}

/* ---- the per-tile work of each kernel (one warpgroup, 64 rows) ---------------------------------- */

/* Forward: key tile j0 (K at kt, V at vt, BN rows) for the warpgroup's query rows qrow + [0, 64) of
 * the (BM, D) Q tile at qt, the warp's first row w0: S = Q K^T, the online softmax of
 * attention_tc.cuh's forward (its comment says why each step), O += P V. o, m, l: the thread's
 * accumulator, running max (log2 units) and sum. */
template <int D, int BN, int BM>
__device__ __forceinline__ void fa90_fwd_tile(const fa90_p &p, float *o, float *m, float *l, uint32_t qt, int qrow, uint32_t kt,
                                              uint32_t vt, int j0, int w0, int g, int t4) {
    constexpr int KD = D / 16, NB = BN / 8, ND = D / 8;
    float s[BN / 2];
    tm__wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KD; kk++) fa90_ss<BN, 0>(s, fa90_desc_k<BM>(qt, qrow, kk), fa90_desc_k<BN>(kt, 0, kk), kk > 0);
    tm__wgmma_commit();
    tm__wgmma_wait<0>();
    tm__wgmma_fence_regs<BN / 2>(s);
    const bool diag = j0 + BN - 1 > w0 + p.off;
    const int i0 = w0 + g, i1 = i0 + 8;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < NB; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (diag && j0 + n * 8 + t4 * 2 + (e & 1) > (e < 2 ? i0 : i1) + p.off) s[4 * n + e] = -INFINITY;
        mx0 = fmaxf(mx0, fmaxf(s[4 * n], s[4 * n + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * n + 2], s[4 * n + 3]));
    }
    const float mx[2] = {tm__quad_max(mx0) * p.scale_log2, tm__quad_max(mx1) * p.scale_log2};
    float cr[2], mu[2];
    bool moved = false;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        if (mx[half] > m[half] + FA90_RESCALE) {
            cr[half] = tm__ex2_approx(m[half] - mx[half]);
            m[half] = mx[half];
            moved = true;
        } else {
            cr[half] = 1.0f;
        }
        mu[half] = m[half] == -INFINITY ? 0.0f : m[half];
    }
    if (__any_sync(0xffffffffu, moved)) {
        l[0] *= cr[0], l[1] *= cr[1];
#pragma unroll
        for (int x = 0; x < ND; x++) {
            o[4 * x] *= cr[0], o[4 * x + 1] *= cr[0];
            o[4 * x + 2] *= cr[1], o[4 * x + 3] *= cr[1];
        }
    }
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int n = 2 * kk + u;
            const float e0 = tm__ex2_approx(fmaf(s[4 * n], p.scale_log2, -mu[0]));
            const float e1 = tm__ex2_approx(fmaf(s[4 * n + 1], p.scale_log2, -mu[0]));
            const float e2 = tm__ex2_approx(fmaf(s[4 * n + 2], p.scale_log2, -mu[1]));
            const float e3 = tm__ex2_approx(fmaf(s[4 * n + 3], p.scale_log2, -mu[1]));
            l[0] += e0 + e1;
            l[1] += e2 + e3;
            pa[kk][2 * u] = tm__pack_bf16x2(e0, e1);
            pa[kk][2 * u + 1] = tm__pack_bf16x2(e2, e3);
        }
    }
    tm__wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) fa90_rs<D>(o, pa[kk], fa90_desc_n<BN>(vt, kk));
    tm__wgmma_commit();
    tm__wgmma_wait<0>();
    tm__wgmma_fence_regs<D / 2>(o);
    tm__wgmma_fence_regs<BN / 4>(&pa[0][0]);
}
/* The forward's epilogue: rows w0 + g and w0 + g + 8 of O = o / l and lse = (m + log2 l) ln 2. */
template <int D>
__device__ __forceinline__ void fa90_fwd_store(const fa90_p &p, const float *o, const float *m, const float *l, int b, int h, int w0,
                                               int g, int t4) {
    constexpr int ND = D / 8;
    const long long lrow = ((long long)b * p.Hq + h) * p.Tq;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int i = w0 + half * 8 + g;
        const float lt = tm__quad_sum(l[half]);
        if (i >= p.Tq) continue;
        const float inv = 1.0f / lt;
        fa90_bf16 *orow = p.out + ((long long)b * p.Tq + i) * p.qs + (long long)h * D + t4 * 2;
#pragma unroll
        for (int x = 0; x < ND; x++)
            *reinterpret_cast<uint32_t *>(orow + x * 8) = tm__pack_bf16x2(o[4 * x + 2 * half] * inv, o[4 * x + 2 * half + 1] * inv);
        if (t4 == 0) p.lse[lrow + i] = (m[half] + log2f(lt)) * FA90_LN2;
    }
}

/* dQ: key tile j0 (K at kt, V at vt, 64 rows) for rows qrow + [0, 64) of the (BM, D) Q and dO tiles
 * at qt and ot: S = Q K^T and dP = dO V^T issued together (the softmax of S while dP runs),
 * dS = P (dP - Delta_i), dQ += dS K. ll, dd: lse (log2 units) and Delta of the thread's two rows. */
template <int D, int BM>
__device__ __forceinline__ void fa90_dq_tile(const fa90_p &p, float *dq, const float *ll, const float *dd, uint32_t qt, uint32_t ot,
                                             int qrow, uint32_t kt, uint32_t vt, int j0, int w0, int g, int t4) {
    constexpr int BN = 64, KD = D / 16, NB = BN / 8;
    float s[BN / 2], dp[BN / 2];
    tm__wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KD; kk++) fa90_ss<BN, 0>(s, fa90_desc_k<BM>(qt, qrow, kk), fa90_desc_k<BN>(kt, 0, kk), kk > 0);
    tm__wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < KD; kk++) fa90_ss<BN, 0>(dp, fa90_desc_k<BM>(ot, qrow, kk), fa90_desc_k<BN>(vt, 0, kk), kk > 0);
    tm__wgmma_commit();
    tm__wgmma_wait<1>();
    tm__wgmma_fence_regs<BN / 2>(s);
    /* P = 2^(s scale log2 e - lse log2 e), 0 past a row's limit (keys past Tk included) */
    const bool mask = j0 + BN - 1 > w0 + p.off;
    const int i0 = w0 + g;
#pragma unroll
    for (int n = 0; n < NB; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float x = tm__ex2_approx(fmaf(s[4 * n + e], p.scale_log2, -ll[e >> 1]));
            if (mask && j0 + 8 * n + 2 * t4 + (e & 1) > i0 + 8 * (e >> 1) + p.off) x = 0.0f;
            s[4 * n + e] = x;
        }
    tm__wgmma_wait<0>();
    tm__wgmma_fence_regs<BN / 2>(dp);
    uint32_t da[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int n = 2 * kk + u;
            da[kk][2 * u] = tm__pack_bf16x2(s[4 * n] * (dp[4 * n] - dd[0]), s[4 * n + 1] * (dp[4 * n + 1] - dd[0]));
            da[kk][2 * u + 1] = tm__pack_bf16x2(s[4 * n + 2] * (dp[4 * n + 2] - dd[1]), s[4 * n + 3] * (dp[4 * n + 3] - dd[1]));
        }
    tm__wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) fa90_rs<D>(dq, da[kk], fa90_desc_n<BN>(kt, kk));
    tm__wgmma_commit();
    tm__wgmma_wait<0>();
    tm__wgmma_fence_regs<D / 2>(dq);
    tm__wgmma_fence_regs<BN / 4>(&da[0][0]);
}
/* dQ's epilogue: rows w0 + g and w0 + g + 8 of dq (times scale) into the gradient. */
template <int D>
__device__ __forceinline__ void fa90_dq_store(const fa90_p &p, const float *dq, int b, int h, int w0, int g, int t4) {
    constexpr int ND = D / 8;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int i = w0 + half * 8 + g;
        if (i >= p.Tq) continue;
        fa90_bf16 *row = p.dq + ((long long)b * p.Tq + i) * p.qs + (long long)h * D + t4 * 2;
#pragma unroll
        for (int x = 0; x < ND; x++) fa90_add2(row + x * 8, p.scale * dq[4 * x + 2 * half], p.scale * dq[4 * x + 2 * half + 1], p.fq);
    }
}


/* ---- the TMA-producer kernels (FlashAttention-3's structure) -------------------------------------
 * Warpgroup 0 is the producer: all its threads give registers back (setmaxnreg.dec), warps 1-3
 * leave, warp 0 stays. The operand every tile uses (forward: the Q tile; dQ: the Q and dO tiles
 * with their lse and Delta; dK/dV: the K and V tiles) is loaded once on `fixed`. The streamed
 * operand (forward and dQ: K and V tiles of keys; dK/dV: Q and dO tiles of queries with their lse
 * and Delta) goes through STAGES stages: the producer waits until the consumers have released a
 * stage (empty[s]; where lse and Delta come along, all 32 lanes wait, as they write the stage),
 * then lane 0 announces its bytes on full[s] and issues D / 64 TMA boxes of {64 D, rows} per tensor
 * (zero past T: the tensor maps are (D, heads, T, B), so a box never reads the next sequence);
 * where lse and Delta come along, the warp's 32 lanes copy them and arrive on the barrier too
 * (33 arrivals a phase, else 1). Warpgroups 1..NC are the consumers, 64 rows each, the per-tile
 * work above; a consumer warp arrives on empty[s] once its warpgroup's wgmmas that read the stage
 * are complete (4 NC arrivals a phase). No CTA-wide barrier after the start: each consumer runs at
 * its own pace with up to STAGES tiles loaded ahead of it, so one warpgroup's softmax overlaps
 * another's (or another CTA's) products without the lockstep of a CTA-wide barrier. */
template <int NC, int MINB> struct fa90_tma_regs {
    /* The CTA's registers are what ptxas gives each thread for the launch bounds (65536 / (MINB
     * threads), rounded down to 8) times its threads; setmaxnreg.inc waits until that pool holds
     * the request, so asking for more hangs. The consumers take what the producer warpgroup's 24
     * leave, rounded down to 8, at most 240. */
    static constexpr int T = 128 * (NC + 1);
    static constexpr int CAP = 65536 / (MINB * T) / 8 * 8;
    static constexpr int R0 = (CAP * T - 128 * 24) / (128 * NC) / 8 * 8;
    static constexpr int CONS = R0 > 240 ? 240 : R0;
    static_assert(128 * 24 + 128 * NC * CONS <= CAP * T, "the consumers' setmaxnreg would wait forever");
    static_assert(NC >= 1 && 64 * NC <= 256, "a TMA box holds at most 256 rows");
};
/* The barriers after the tiles: fixed (the operand loaded once), full[s] and empty[s] of each stage.
 * init: by thread 0, then the CTA's one barrier. */
template <int STAGES> struct fa90_ring {
    uint64_t *bars;
    __device__ __forceinline__ uint32_t fixed() const { return tm__smem_u32(&bars[0]); }
    __device__ __forceinline__ uint32_t full(int s) const { return tm__smem_u32(&bars[1 + s]); }
    __device__ __forceinline__ uint32_t empty(int s) const { return tm__smem_u32(&bars[1 + STAGES + s]); }
    __device__ __forceinline__ void init(int full_count, int empty_count, int fixed_count) const {
        if (threadIdx.x == 0) {
            tm__mbar_init(fixed(), fixed_count);
            for (int s = 0; s < STAGES; s++) {
                tm__mbar_init(full(s), full_count);
                tm__mbar_init(empty(s), empty_count);
            }
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
    }
};
/* ROWS rows from row r0 of head h, sequence b of a (D, heads, T, B) tensor map into the swizzled
 * (ROWS, D) tile at s, completing on bar (whose bytes the caller announced). */
template <int ROWS, int D>
__device__ __forceinline__ void fa90_tma_tile(uint32_t s, const CUtensorMap *map, int h, int r0, int b, uint32_t bar) {
#pragma unroll
    for (int pp = 0; pp < D / 64; pp++) tm__tma_load_4d(s + pp * ROWS * 128, map, 64 * pp, h, r0, b, bar);
}
/* The stage after s (phase ph flips when the ring wraps). */
template <int STAGES> __device__ __forceinline__ void fa90_stage_next(int &s, int &ph) {
    if (++s == STAGES) s = 0, ph ^= 1;
}
/* A consumer warp's release of stage s once its warpgroup's wgmmas that read it are complete. */
__device__ __forceinline__ void fa90_release(uint32_t empty, int lane) {
    __syncwarp();
    if (lane == 0) tm__mbar_arrive(empty);
}
/* The forward's and dQ's CTA: query head h (kv head hk) of sequence b, rows [q0, q0 + BM), the
 * last blocks first (longest first); keys [0, kend) are seen by some of its rows, ntiles tiles of
 * BN. */
template <int BM, int BN> struct fa90_qblock {
    int h, b, hk, q0, ntiles;
    __device__ __forceinline__ explicit fa90_qblock(const fa90_p &p) {
        const int bhn = p.B * p.Hq, nqb = fa90_cdiv(p.Tq, BM);
        const int bh = (int)(blockIdx.x % (unsigned)bhn);
        h = bh % p.Hq, b = bh / p.Hq, hk = h / p.G;
        q0 = (nqb - 1 - (int)(blockIdx.x / (unsigned)bhn)) * BM;
        ntiles = fa90_cdiv(fa90_min(p.Tk, fa90_min(q0 + BM, p.Tq) + p.off), BN);
    }
};
/* The forward's and dQ's producer loop: key tiles 0..ntiles-1 (K at ks, V at vs, BN rows each)
 * through the ring, each once its stage is released. */
template <int BN, int D, int STAGES>
__device__ __forceinline__ void fa90_produce_kv(const fa90_ring<STAGES> &r, uint32_t ks, uint32_t vs, const CUtensorMap *tmK,
                                                const CUtensorMap *tmV, int hk, int b, int ntiles) {
    constexpr uint32_t KB = BN * D * 2;
    int s = 0, ph = 0;
    for (int t = 0; t < ntiles; t++) {
        tm__mbar_wait(r.empty(s), ph ^ 1);
        tm__mbar_expect_tx(r.full(s), 2 * KB);
        fa90_tma_tile<BN, D>(ks + s * KB, tmK, hk, t * BN, b, r.full(s));
        fa90_tma_tile<BN, D>(vs + s * KB, tmV, hk, t * BN, b, r.full(s));
        fa90_stage_next<STAGES>(s, ph);
    }
}

/* Forward: (b, h, 64 NC query rows), key tiles of BN streamed. */
template <int D, int BN, int NC, int STAGES, int MINB>
__global__ void __launch_bounds__(128 * (NC + 1), MINB)
    fa90_forward_tma_kernel(const __grid_constant__ CUtensorMap tmQ, const __grid_constant__ CUtensorMap tmK,
                            const __grid_constant__ CUtensorMap tmV, const __grid_constant__ CUtensorMap tmO, fa90_p p) {
#ifdef FA90_DEVICE
    constexpr int BM = 64 * NC;
    constexpr uint32_t QB = BM * D * 2, KB = BN * D * 2;
    extern __shared__ __align__(16) unsigned char fa90_smem[];
    const uint32_t base = tm__smem_u32(fa90_smem), qs = (base + 1023) & ~1023u, ks = qs + QB, vs = ks + STAGES * KB;
    const fa90_ring<STAGES> ring{(uint64_t *)(fa90_smem + (vs + STAGES * KB - base))};
    const fa90_qblock<BM, BN> blk(p);
    const int tid = threadIdx.x, wg = tid >> 7;
    ring.init(1, 4 * NC, 1);

    if (wg == 0) { /* ---- producer ---- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid != 0) return;
        tm__mbar_expect_tx(ring.fixed(), QB);
        fa90_tma_tile<BM, D>(qs, &tmQ, blk.h, blk.q0, blk.b, ring.fixed());
        fa90_produce_kv<BN, D, STAGES>(ring, ks, vs, &tmK, &tmV, blk.hk, blk.b, blk.ntiles);
        return;
    }

    /* ---- consumers ---- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(fa90_tma_regs<NC, MINB>::CONS));
    const int w = wg - 1, wl = tid - 128 * wg, warp = wl >> 5, lane = wl & 31, g = lane >> 2, t4 = lane & 3;
    const int r0 = blk.q0 + 64 * w, w0 = r0 + 16 * warp; /* the warpgroup's and the warp's first row */
    const int wend = r0 < p.Tq ? fa90_min(p.Tk, fa90_min(r0 + 64, p.Tq) + p.off) : 0;
    float o[D / 2];
#pragma unroll
    for (int x = 0; x < D / 2; x++) o[x] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    tm__mbar_wait(ring.fixed(), 0);
    int s = 0, ph = 0;
    for (int t = 0; t < blk.ntiles; t++) {
        const int j0 = t * BN;
        tm__mbar_wait(ring.full(s), ph);
        if (j0 < wend) fa90_fwd_tile<D, BN, BM>(p, o, m, l, qs, 64 * w, ks + s * KB, vs + s * KB, j0, w0, g, t4);
        fa90_release(ring.empty(s), lane);
        fa90_stage_next<STAGES>(s, ph);
    }
    fa90_fwd_store<D>(p, o, m, l, blk.b, blk.h, w0, g, t4);
#endif
}

/* dQ: (b, h, 64 NC query rows), key tiles of 64 streamed. */
template <int D, int NC, int STAGES, int MINB>
__global__ void __launch_bounds__(128 * (NC + 1), MINB)
    fa90_dq_tma_kernel(const __grid_constant__ CUtensorMap tmQ, const __grid_constant__ CUtensorMap tmK,
                       const __grid_constant__ CUtensorMap tmV, const __grid_constant__ CUtensorMap tmO, fa90_p p) {
#ifdef FA90_DEVICE
    constexpr int BM = 64 * NC, BN = 64;
    constexpr uint32_t QB = BM * D * 2, KB = BN * D * 2;
    extern __shared__ __align__(16) unsigned char fa90_smem[];
    const uint32_t base = tm__smem_u32(fa90_smem), qs = (base + 1023) & ~1023u, dos = qs + QB, ks = dos + QB,
                   vs = ks + STAGES * KB;
    float *ls = (float *)(fa90_smem + (vs + STAGES * KB - base)), *dls = ls + BM;
    const fa90_ring<STAGES> ring{(uint64_t *)(dls + BM)};
    const fa90_qblock<BM, BN> blk(p);
    const int tid = threadIdx.x, wg = tid >> 7;
    ring.init(1, 4 * NC, 33);

    if (wg == 0) { /* ---- producer ---- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid >= 32) return;
        const int lane = tid;
        if (lane == 0) {
            tm__mbar_expect_tx(ring.fixed(), 2 * QB);
            fa90_tma_tile<BM, D>(qs, &tmQ, blk.h, blk.q0, blk.b, ring.fixed());
            fa90_tma_tile<BM, D>(dos, &tmO, blk.h, blk.q0, blk.b, ring.fixed());
        }
        const long long lrow = ((long long)blk.b * p.Hq + blk.h) * p.Tq + blk.q0;
        for (int r = lane; r < BM; r += 32) {
            const bool ok = blk.q0 + r < p.Tq;
            ls[r] = ok ? p.lse[lrow + r] : 0.0f;
            dls[r] = ok ? p.delta[lrow + r] : 0.0f;
        }
        tm__mbar_arrive(ring.fixed()); /* release: the stores above are visible to the waiters */
        if (lane == 0) fa90_produce_kv<BN, D, STAGES>(ring, ks, vs, &tmK, &tmV, blk.hk, blk.b, blk.ntiles);
        return;
    }

    /* ---- consumers ---- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(fa90_tma_regs<NC, MINB>::CONS));
    const int w = wg - 1, wl = tid - 128 * wg, warp = wl >> 5, lane = wl & 31, g = lane >> 2, t4 = lane & 3;
    const int r0 = blk.q0 + 64 * w, w0 = r0 + 16 * warp;
    const int wend = r0 < p.Tq ? fa90_min(p.Tk, fa90_min(r0 + 64, p.Tq) + p.off) : 0;
    float dq[D / 2];
#pragma unroll
    for (int x = 0; x < D / 2; x++) dq[x] = 0.0f;
    tm__mbar_wait(ring.fixed(), 0);
    const int rl = 64 * w + 16 * warp + g;
    const float ll[2] = {ls[rl] * FA90_LOG2E, ls[rl + 8] * FA90_LOG2E}, dd[2] = {dls[rl], dls[rl + 8]};
    int s = 0, ph = 0;
    for (int t = 0; t < blk.ntiles; t++) {
        const int j0 = t * BN;
        tm__mbar_wait(ring.full(s), ph);
        if (j0 < wend) fa90_dq_tile<D, BM>(p, dq, ll, dd, qs, dos, 64 * w, ks + s * KB, vs + s * KB, j0, w0, g, t4);
        fa90_release(ring.empty(s), lane);
        fa90_stage_next<STAGES>(s, ph);
    }
    fa90_dq_store<D>(p, dq, blk.b, blk.h, w0, g, t4);
#endif
}

/* dK/dV: (b, kv head, 64 NC keys); over the G query heads in order, each over its query tiles of 64
 * from the first that sees the keys, streamed: S^T = K Q^T, dP^T = V dO^T (m64n64), dV += P^T dO,
 * dK += dS^T Q (A in registers, B = dO and Q N-major). */
template <int D, int NC, int STAGES, int MINB>
__global__ void __launch_bounds__(128 * (NC + 1), MINB)
    fa90_dkv_tma_kernel(const __grid_constant__ CUtensorMap tmQ, const __grid_constant__ CUtensorMap tmK,
                        const __grid_constant__ CUtensorMap tmV, const __grid_constant__ CUtensorMap tmO, fa90_p p) {
#ifdef FA90_DEVICE
    constexpr int BN = 64 * NC, BQ = 64, KD = D / 16, NQ = BQ / 8;
    constexpr uint32_t KB = BN * D * 2, QB = BQ * D * 2;
    extern __shared__ __align__(16) unsigned char fa90_smem[];
    const uint32_t base = tm__smem_u32(fa90_smem), ks = (base + 1023) & ~1023u, vs = ks + KB, qs = vs + KB,
                   dos = qs + STAGES * QB;
    float *ls = (float *)(fa90_smem + (dos + STAGES * QB - base)), *dls = ls + STAGES * BQ;
    const fa90_ring<STAGES> ring{(uint64_t *)(dls + STAGES * BQ)};
    const int bhn = p.B * p.Hkv;
    const int kb = (int)(blockIdx.x / (unsigned)bhn);
    const int bh = (int)(blockIdx.x % (unsigned)bhn), hk = bh % p.Hkv, b = bh / p.Hkv;
    const int j0 = kb * BN;
    const int qstart = j0 - p.off > 0 ? (j0 - p.off) / BQ * BQ : 0;
    const int nqblk = fa90_cdiv(p.Tq - qstart, BQ), nit = p.G * nqblk;
    const int tid = threadIdx.x, wg = tid >> 7;
    ring.init(33, 4 * NC, 1);

    if (wg == 0) { /* ---- producer ---- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid >= 32) return;
        const int lane = tid;
        if (lane == 0) {
            tm__mbar_expect_tx(ring.fixed(), 2 * KB);
            fa90_tma_tile<BN, D>(ks, &tmK, hk, j0, b, ring.fixed());
            fa90_tma_tile<BN, D>(vs, &tmV, hk, j0, b, ring.fixed());
        }
        int s = 0, ph = 0;
        for (int it = 0; it < nit; it++) {
            const int h = hk * p.G + it / nqblk, i0 = qstart + (it % nqblk) * BQ;
            tm__mbar_wait(ring.empty(s), ph ^ 1);
            if (lane == 0) {
                tm__mbar_expect_tx(ring.full(s), 2 * QB);
                fa90_tma_tile<BQ, D>(qs + s * QB, &tmQ, h, i0, b, ring.full(s));
                fa90_tma_tile<BQ, D>(dos + s * QB, &tmO, h, i0, b, ring.full(s));
            }
            const long long lrow = ((long long)b * p.Hq + h) * p.Tq + i0;
#pragma unroll
            for (int r = lane; r < BQ; r += 32) {
                const bool ok = i0 + r < p.Tq;
                ls[s * BQ + r] = ok ? p.lse[lrow + r] : 0.0f;
                dls[s * BQ + r] = ok ? p.delta[lrow + r] : 0.0f;
            }
            tm__mbar_arrive(ring.full(s)); /* release: the stores above are visible to the waiters */
            fa90_stage_next<STAGES>(s, ph);
        }
        return;
    }

    /* ---- consumers ---- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(fa90_tma_regs<NC, MINB>::CONS));
    const int w = wg - 1, wl = tid - 128 * wg, warp = wl >> 5, lane = wl & 31, g = lane >> 2, t4 = lane & 3;
    const int wj = j0 + 64 * w, jw = wj + 16 * warp; /* the warpgroup's and the warp's first key */
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int x = 0; x < D / 2; x++) dk[x] = dv[x] = 0.0f;
    tm__mbar_wait(ring.fixed(), 0);
    int s = 0, ph = 0;
    for (int it = 0; it < nit; it++) {
        const int i0 = qstart + (it % nqblk) * BQ;
        tm__mbar_wait(ring.full(s), ph);
        /* a warpgroup whose keys no query of the tile sees (or past Tk) skips it */
        if (wj < p.Tk && wj <= fa90_min(i0 + BQ, p.Tq) - 1 + p.off) {
            const uint32_t qt = qs + s * QB, ot = dos + s * QB;
            const float *lt = ls + s * BQ, *dt = dls + s * BQ;
            float sc[BQ / 2], dp[BQ / 2];
            tm__wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < KD; kk++) fa90_ss<BQ, 0>(sc, fa90_desc_k<BN>(ks, 64 * w, kk), fa90_desc_k<BQ>(qt, 0, kk), kk > 0);
            tm__wgmma_commit();
#pragma unroll
            for (int kk = 0; kk < KD; kk++) fa90_ss<BQ, 0>(dp, fa90_desc_k<BN>(vs, 64 * w, kk), fa90_desc_k<BQ>(ot, 0, kk), kk > 0);
            tm__wgmma_commit();
            tm__wgmma_wait<1>();
            tm__wgmma_fence_regs<BQ / 2>(sc);
            /* P^T: key rows jw + g (+ 8), query columns i0 + 8 n + 2 t4 (+ 1); 0 where j > i + off
             * and for rows i >= Tq */
            const bool mask = jw + 15 > i0 + p.off || i0 + BQ > p.Tq;
#pragma unroll
            for (int n = 0; n < NQ; n++) {
                const int c0 = 8 * n + 2 * t4;
                const float2 lse2 = *reinterpret_cast<const float2 *>(lt + c0);
                const float l2[2] = {lse2.x * FA90_LOG2E, lse2.y * FA90_LOG2E};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float x = tm__ex2_approx(fmaf(sc[4 * n + e], p.scale_log2, -l2[e & 1]));
                    const int i = i0 + c0 + (e & 1), j = jw + g + 8 * (e >> 1);
                    if (mask && (j > i + p.off || i >= p.Tq)) x = 0.0f;
                    sc[4 * n + e] = x;
                }
            }
            tm__wgmma_wait<0>();
            tm__wgmma_fence_regs<BQ / 2>(dp);
            uint32_t pa[BQ / 16][4], da[BQ / 16][4];
#pragma unroll
            for (int kq = 0; kq < BQ / 16; kq++)
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    const int n = 2 * kq + u, c0 = 8 * n + 2 * t4;
                    const float2 del2 = *reinterpret_cast<const float2 *>(dt + c0);
                    pa[kq][2 * u] = tm__pack_bf16x2(sc[4 * n], sc[4 * n + 1]);
                    pa[kq][2 * u + 1] = tm__pack_bf16x2(sc[4 * n + 2], sc[4 * n + 3]);
                    da[kq][2 * u] = tm__pack_bf16x2(sc[4 * n] * (dp[4 * n] - del2.x), sc[4 * n + 1] * (dp[4 * n + 1] - del2.y));
                    da[kq][2 * u + 1] = tm__pack_bf16x2(sc[4 * n + 2] * (dp[4 * n + 2] - del2.x), sc[4 * n + 3] * (dp[4 * n + 3] - del2.y));
                }
            tm__wgmma_fence();
#pragma unroll
            for (int kq = 0; kq < BQ / 16; kq++) fa90_rs<D>(dv, pa[kq], fa90_desc_n<BQ>(ot, kq));
#pragma unroll
            for (int kq = 0; kq < BQ / 16; kq++) fa90_rs<D>(dk, da[kq], fa90_desc_n<BQ>(qt, kq));
            tm__wgmma_commit();
            tm__wgmma_wait<0>();
            tm__wgmma_fence_regs<D / 2>(dv);
            tm__wgmma_fence_regs<D / 2>(dk);
            tm__wgmma_fence_regs<BQ / 4>(&pa[0][0]);
            tm__wgmma_fence_regs<BQ / 4>(&da[0][0]);
        }
        fa90_release(ring.empty(s), lane);
        fa90_stage_next<STAGES>(s, ph);
    }
    fa90_dkv_store<D>(p, dk, dv, b, hk, jw, g, t4);
#endif
}

/* ---- host ----------------------------------------------------------------------------------------- */

/* Tile shapes, stages and CTAs per SM of the launches (the fastest variants timed by
 * bench/attn_sm90_harness.cu --variants: docs/PERFORMANCE.md's attention section). Forward (F*),
 * dQ (Q*), dK/dV (K*): *NC consumer warpgroups of 64 rows, *ST stages, *MINB CTAs an SM; FBN the
 * forward's key tile (dQ's is 64, dK/dV's query tile 64). One consumer warpgroup a CTA with 2-3
 * CTAs an SM beat two a CTA in every kernel (their producers and barriers are independent). */
template <int D> struct fa90_cfg;
template <> struct fa90_cfg<64> {
    static constexpr int FBN = 64, FNC = 1, FST = 2, FMINB = 3;
    static constexpr int QNC = 1, QST = 2, QMINB = 3;
    static constexpr int KNC = 1, KST = 3, KMINB = 2;
};
template <> struct fa90_cfg<128> {
    static constexpr int FBN = 64, FNC = 1, FST = 2, FMINB = 2;
    static constexpr int QNC = 1, QST = 2, QMINB = 2;
    static constexpr int KNC = 1, KST = 2, KMINB = 2;
};

/* Shared memory bytes of the TMA-producer kernels: tiles, lse / Delta, barriers, + 1024 for the
 * base's alignment. */
template <int D, int BN, int NC, int STAGES> static size_t fa90_smem_fwd_tma() {
    return (size_t)(64 * NC + 2 * STAGES * BN) * D * 2 + (1 + 2 * STAGES) * 8 + 1024;
}
template <int D, int NC, int STAGES> static size_t fa90_smem_dq_tma() {
    return (size_t)(2 * 64 * NC + 2 * STAGES * 64) * D * 2 + 2 * 64 * NC * 4 + (1 + 2 * STAGES) * 8 + 1024;
}
template <int D, int NC, int STAGES> static size_t fa90_smem_dkv_tma() {
    return (size_t)(2 * 64 * NC + 2 * STAGES * 64) * D * 2 + 2 * STAGES * 64 * 4 + (1 + 2 * STAGES) * 8 + 1024;
}

static int fa90_probe(char *why, size_t n) {
    typedef fa90_cfg<64> C;
    int dev = 0;
    const cudaError_t e = cudaGetDevice(&dev);
    return tm__sm90_probe(dev, e, (const void *)fa90_dkv_tma_kernel<64, C::KNC, C::KST, C::KMINB>, "the wgmma attention",
                          "attention_sm90.cu", why, n);
}

extern "C" int tm__fa90_supported(char *why, size_t n) { return fa90_probe(why, n); }

static int fa90_check(const tm__fa90_args *a, char *why, size_t n) {
    if ((a->D != 64 && a->D != 128) || a->Hkv <= 0 || a->Hq % a->Hkv != 0 || a->Tk < a->Tq || a->B <= 0) {
        snprintf(why, n, "attention sm90: unsupported shapes (B %d, Tq %d, Tk %d, Hq %d, Hkv %d, D %d)", a->B, a->Tq, a->Tk,
                 a->Hq, a->Hkv, a->D);
        return 1;
    }
    /* TMA needs 16-byte aligned bases (cuTensorMapEncodeTiled) */
    if (((uintptr_t)a->q | (uintptr_t)a->k | (uintptr_t)a->v | (uintptr_t)a->dout) & 15) {
        snprintf(why, n, "attention sm90: q, k, v and dout must start on 16-byte boundaries (q %p, k %p, v %p, dout %p)", a->q,
                 a->k, a->v, a->dout);
        return 1;
    }
    return 0;
}

static fa90_p fa90_params(const tm__fa90_args *a) {
    fa90_p p;
    p.q = (const fa90_bf16 *)a->q, p.k = (const fa90_bf16 *)a->k, p.v = (const fa90_bf16 *)a->v;
    p.dout = (const fa90_bf16 *)a->dout;
    p.out = (fa90_bf16 *)a->out, p.dq = (fa90_bf16 *)a->dq, p.dk = (fa90_bf16 *)a->dk, p.dv = (fa90_bf16 *)a->dv;
    p.lse = a->lse, p.delta = a->delta;
    p.qs = (long long)a->Hq * a->D, p.ks = (long long)a->Hkv * a->D;
    p.B = a->B, p.Tq = a->Tq, p.Tk = a->Tk, p.Hq = a->Hq, p.Hkv = a->Hkv, p.G = a->Hq / a->Hkv, p.off = a->Tk - a->Tq;
    p.scale = a->scale, p.scale_log2 = a->scale * FA90_LOG2E;
    p.fq = a->fq, p.fk = a->fk, p.fv = a->fv;
    return p;
}

/* One kernel's launch on grid CTAs of threads with smem bytes of dynamic shared memory. */
template <typename K, typename... A>
static int fa90_launch(K kernel, const char *name, long long grid, int threads, size_t smem, cudaStream_t st, char *why, size_t n,
                       const A &...args) {
    if (grid <= 0) return 0;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess) {
        kernel<<<(unsigned)grid, threads, smem, st>>>(args...);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess) {
        snprintf(why, n, "attention sm90: launching %s (%lld CTAs, %zu bytes of shared memory): %s", name, grid, smem,
                 cudaGetErrorString(e));
        return 1;
    }
    return 0;
}

/* Tensor maps m[0..3] of q, k, v and dO (q's again where dout is NULL) as (D, heads, T, B), boxes of
 * {64 D, 1 head, rows, 1}: qrows for q and dO, krows for k and v. Rows past T read as zeros. */
static int fa90_maps(const tm__fa90_args *a, int qrows, int krows, CUtensorMap m[4], char *why, size_t n) {
    tm__tma_encode_fn enc = tm__tma_encoder(why, n);
    if (!enc) return 1;
    const uint64_t D = (uint64_t)a->D;
    const uint64_t dq[4] = {D, (uint64_t)a->Hq, (uint64_t)a->Tq, (uint64_t)a->B};
    const uint64_t sq[3] = {D * 2, (uint64_t)a->Hq * D * 2, (uint64_t)a->Tq * a->Hq * D * 2};
    const uint64_t dk[4] = {D, (uint64_t)a->Hkv, (uint64_t)a->Tk, (uint64_t)a->B};
    const uint64_t sk[3] = {D * 2, (uint64_t)a->Hkv * D * 2, (uint64_t)a->Tk * a->Hkv * D * 2};
    const uint32_t bq[4] = {64, 1, (uint32_t)qrows, 1}, bk[4] = {64, 1, (uint32_t)krows, 1};
    if (tm__tma_map_bf16(enc, &m[0], a->q, 4, dq, sq, bq, "attention q", why, n) ||
        tm__tma_map_bf16(enc, &m[1], a->k, 4, dk, sk, bk, "attention k", why, n) ||
        tm__tma_map_bf16(enc, &m[2], a->v, 4, dk, sk, bk, "attention v", why, n))
        return 1;
    if (!a->dout) m[3] = m[0];
    else if (tm__tma_map_bf16(enc, &m[3], a->dout, 4, dq, sq, bq, "attention dout", why, n))
        return 1;
    return 0;
}

/* Each kernel's launch in a given shape (the library's shapes in fa90_cfg; the harness launches the
 * others). */
template <int D, int BN, int NC, int STAGES, int MINB>
static int fa90_forward_tma(const tm__fa90_args *a, cudaStream_t st, char *why, size_t n) {
    CUtensorMap m[4];
    if (fa90_maps(a, 64 * NC, BN, m, why, n)) return 1;
    const long long grid = (long long)fa90_cdiv(a->Tq, 64 * NC) * a->B * a->Hq;
    return fa90_launch(fa90_forward_tma_kernel<D, BN, NC, STAGES, MINB>, "fa90_forward_tma_kernel", grid, 128 * (NC + 1),
                       fa90_smem_fwd_tma<D, BN, NC, STAGES>(), st, why, n, m[0], m[1], m[2], m[3], fa90_params(a));
}
template <int D, int NC, int STAGES, int MINB> static int fa90_dq_tma(const tm__fa90_args *a, cudaStream_t st, char *why, size_t n) {
    CUtensorMap m[4];
    if (fa90_maps(a, 64 * NC, 64, m, why, n)) return 1;
    const long long grid = (long long)fa90_cdiv(a->Tq, 64 * NC) * a->B * a->Hq;
    return fa90_launch(fa90_dq_tma_kernel<D, NC, STAGES, MINB>, "fa90_dq_tma_kernel", grid, 128 * (NC + 1),
                       fa90_smem_dq_tma<D, NC, STAGES>(), st, why, n, m[0], m[1], m[2], m[3], fa90_params(a));
}
template <int D, int NC, int STAGES, int MINB> static int fa90_dkv_tma(const tm__fa90_args *a, cudaStream_t st, char *why, size_t n) {
    CUtensorMap m[4];
    if (fa90_maps(a, 64, 64 * NC, m, why, n)) return 1;
    const long long grid = (long long)fa90_cdiv(a->Tk, 64 * NC) * a->B * a->Hkv;
    return fa90_launch(fa90_dkv_tma_kernel<D, NC, STAGES, MINB>, "fa90_dkv_tma_kernel", grid, 128 * (NC + 1),
                       fa90_smem_dkv_tma<D, NC, STAGES>(), st, why, n, m[0], m[1], m[2], m[3], fa90_params(a));
}

template <int D> static int fa90_forward_d(const tm__fa90_args *a, cudaStream_t st, char *why, size_t n) {
    typedef fa90_cfg<D> C;
    return fa90_forward_tma<D, C::FBN, C::FNC, C::FST, C::FMINB>(a, st, why, n);
}
template <int D> static int fa90_backward_d(const tm__fa90_args *a, cudaStream_t st, char *why, size_t n) {
    typedef fa90_cfg<D> C;
    if (a->dq && fa90_dq_tma<D, C::QNC, C::QST, C::QMINB>(a, st, why, n)) return 1;
    if (a->dk || a->dv) return fa90_dkv_tma<D, C::KNC, C::KST, C::KMINB>(a, st, why, n);
    return 0;
}

extern "C" int tm__fa90_forward(const tm__fa90_args *a, cudaStream_t st, char *why, size_t n) {
    if (fa90_check(a, why, n)) return 1;
    if (a->Tq == 0) return 0; /* no rows: nothing to launch (a tensor map cannot have a 0 dimension) */
    return a->D == 64 ? fa90_forward_d<64>(a, st, why, n) : fa90_forward_d<128>(a, st, why, n);
}

extern "C" int tm__fa90_backward(const tm__fa90_args *a, cudaStream_t st, char *why, size_t n) {
    if (fa90_check(a, why, n)) return 1;
    if (a->Tq == 0) return 0;
    return a->D == 64 ? fa90_backward_d<64>(a, st, why, n) : fa90_backward_d<128>(a, st, why, n);
}
