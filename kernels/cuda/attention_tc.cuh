/*
 * attention_tc.cuh — the tensor-core kernels of tm_attention (bf16, D = 64 or 128, sm_80 and
 * later): forward, Delta, dq, dk/dv. Included by attention.cu (after common.cuh: tm__bf16,
 * tm__ld, tm__st), which holds the layout contract, the launch code and the design notes; the
 * cp.async / ldmatrix / mma.sync wrappers and their fragment layouts are mma.cuh's.
 * Everything here is templated on the head dim D and the tile shapes so that one source
 * serves D 64 and 128; fa_cfg<D> picks the shapes the entry points launch.
 */
#ifndef TM_CUDA_ATTENTION_TC_CUH
#define TM_CUDA_ATTENTION_TC_CUH

#include "mma.cuh"

/* ---- PTX (sm_80 and later) -------------------------------------------------------------------------
 * cp.async, ldmatrix, mma.sync and the bf16 packing come from mma.cuh (layouts there); only
 * attention's own instruction stays here. */

/* 2^x in one MUFU.EX2 (mma.cuh's tm__ex2_approx: exp2f adds a range fix-up for subnormal results,
 * which P and dS do not need: below 2^-126 they are zero after the bf16 rounding anyway). */
__device__ __forceinline__ float fa_exp2(float x) { return tm__ex2_approx(x); }

/* Fragments from a shared tile of rows with stride LD (bf16):
 * fa_lda: the A operand (16 rows from r0, 16 columns from c0) of a row-major (m, k) tile;
 * fa_ldb: the B operands of two n8 tiles (n0.., n0+8..) x k16 from c0, from (n, k) rows
 *         (K for Q K^T): r[0], r[1] for n-tile n0, r[2], r[3] for n0 + 8;
 * fa_ldbt: the same from (k, n) rows (V for P V), transposed by ldmatrix. */
template <int LD> __device__ __forceinline__ void fa_lda(uint32_t (&a)[4], const tm__bf16 *s, int r0, int c0) {
    const int lane = threadIdx.x & 31;
    tm__ldsm_x4(a, s + (r0 + (lane & 15)) * LD + c0 + (lane >> 4) * 8);
}
template <int LD> __device__ __forceinline__ void fa_ldb(uint32_t (&r)[4], const tm__bf16 *s, int n0, int c0) {
    const int lane = threadIdx.x & 31;
    tm__ldsm_x4(r, s + (n0 + (lane & 7) + (lane >> 4) * 8) * LD + c0 + ((lane >> 3) & 1) * 8);
}
template <int LD> __device__ __forceinline__ void fa_ldbt(uint32_t (&r)[4], const tm__bf16 *s, int k0, int n0) {
    const int lane = threadIdx.x & 31;
    tm__ldsm_x4_trans(r, s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n0 + (lane >> 4) * 8);
}

/* ---- end of PTX ---------------------------------------------------------------------------------- */

#define FA_THREADS 128 /* 4 warps */
#define FA_PAD 8       /* bf16 per shared row beyond D: rows 16 bytes apart modulo 128 (no bank conflicts) */
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f
#define FA_RESCALE 8.0f /* log2 units: how far a row max may pass the running max before O, l are rescaled */

/* Tile shapes the entry points launch (see attention.cu's top comment for why):
 *   forward  MT m16 tiles of query rows per warp (block 64 MT rows), BN keys per tile;
 *   dq       QMT, QBN likewise, QQR: Q and dO fragments held in registers across the key tiles;
 *   dk/dv    KMT m16 tiles of keys per warp (block 64 KMT keys), BQ query rows per step,
 *            KKR: K and V fragments held in registers across the query steps. */
template <int D> struct fa_cfg;
template <> struct fa_cfg<64> {
    static constexpr int MT = 2, BN = 64, QMT = 2, QBN = 64, QQR = 0, KMT = 2, BQ = 32, KKR = 0;
};
template <> struct fa_cfg<128> {
    static constexpr int MT = 2, BN = 64, QMT = 2, QBN = 32, QQR = 0, KMT = 1, BQ = 64, KKR = 0;
};

typedef struct fa_params {
    const tm__bf16 *q, *k, *v, *o, *dout; /* o: the forward's output (read by the Delta kernel) */
    tm__bf16 *out, *dq, *dk, *dv;         /* dq, dk, dv may be NULL */
    float *lse, *delta;                   /* (B, Hq, Tq) f32 each */
    int64_t qs, ks;                       /* row strides over time: Hq D (q, o, dq) and Hkv D (k, v) */
    int B, Tq, Tk, Hq, Hkv, G, off, D;
    float scale, scale_log2;              /* scale and scale log2(e), the latter for exp2 */
    int fq, fk, fv;                       /* dq / dk / dv fresh (call->gin_fresh): stored, not read */
} fa_params;

__host__ __device__ __forceinline__ int fa_imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int fa_cdiv(int a, int b) { return (a + b - 1) / b; }

static fa_params fa_params_make(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D, float scale) {
    fa_params p;
    memset(&p, 0, sizeof p);
    p.B = (int)B, p.Tq = (int)Tq, p.Tk = (int)Tk, p.Hq = (int)Hq, p.Hkv = (int)Hkv, p.D = (int)D;
    p.G = (int)(Hq / Hkv), p.off = (int)(Tk - Tq);
    p.qs = Hq * D, p.ks = Hkv * D;
    p.scale = scale, p.scale_log2 = scale * FA_LOG2E;
    return p;
}
/* Blocks: (b, h, query block of BM rows), (b, kv head, key block of BN keys), 1024 / D rows of o. */
static int64_t fa_grid_q(const fa_params *p, int BM) { return (int64_t)fa_cdiv(p->Tq, BM) * p->B * p->Hq; }
static int64_t fa_grid_kv(const fa_params *p, int BN) { return (int64_t)fa_cdiv(p->Tk, BN) * p->B * p->Hkv; }
static int64_t fa_grid_delta(const fa_params *p) { return ((int64_t)p->B * p->Tq * p->Hq + FA_THREADS / (p->D / 8) - 1) / (FA_THREADS / (p->D / 8)); }
/* Dynamic shared memory in bytes. */
static size_t fa_smem_fwd(int D, int BM, int BN) { return (size_t)(BM + 4 * BN) * (D + FA_PAD) * 2; }
static size_t fa_smem_dq(int D, int BM, int BN) { return (size_t)(2 * BM + 4 * BN) * (D + FA_PAD) * 2; }
static size_t fa_smem_dkv(int D, int BN, int BQ) {
    return (size_t)(2 * BN + 4 * BQ) * (D + FA_PAD) * 2 + 4 * BQ * sizeof(float);
}

/* Rows [0, ROWS) of D bf16 each, row r from g + r gs, into s (row stride D + FA_PAD), asynchronously;
 * rows from `valid` on are zero-filled, so padding rows hold zeros, never stale data or NaN. */
template <int D, int ROWS>
__device__ __forceinline__ void fa_load_rows(tm__bf16 *s, const tm__bf16 *g, int64_t gs, int valid) {
    constexpr int CH = D / 8; /* 16-byte chunks per row */
#pragma unroll
    for (int c = threadIdx.x; c < ROWS * CH; c += FA_THREADS) {
        const int r = c / CH, x = (c % CH) * 8;
        const bool ok = r < valid;
        tm__cp_async16(s + r * (D + FA_PAD) + x, ok ? (const void *)(g + r * gs + x) : (const void *)g, ok ? 16 : 0);
    }
}

/* o (two adjacent bf16, 4-byte aligned) = (lo, hi) rounded. */
__device__ __forceinline__ void fa_st2(tm__bf16 *o, float lo, float hi) { *reinterpret_cast<uint32_t *>(o) = tm__pack_bf16x2(lo, hi); }
/* g[0], g[1] += a, b (bf16, rounded once). */
/* g[0..1] += (a, b); fresh: g = 0 + (a, b), g not read. */
__device__ __forceinline__ void fa_add2(tm__bf16 *g, float a, float b, int fresh = 0) {
    tm__st(g, (fresh ? 0.0f : tm__ld(g)) + a);
    tm__st(g + 1, (fresh ? 0.0f : tm__ld(g + 1)) + b);
}

/* ---- forward: one block per (b, h, 64 MT query rows), 16 MT rows per warp ------------------------ */

template <int D, int MT, int BN>
__global__ void __launch_bounds__(FA_THREADS) fa_forward_kernel(fa_params p) {
    extern __shared__ __align__(16) unsigned char fa_smem[];
    constexpr int LD = D + FA_PAD, KD = D / 16, ND = D / 8, BM = 64 * MT, NB = BN / 8;
    /* Q's fragments stay in registers where they fit beside O and S (D 64). */
    constexpr bool QREG = D <= 64;
    tm__bf16 *qs = (tm__bf16 *)fa_smem; /* (BM, LD) */
    tm__bf16 *ks = qs + BM * LD;        /* 2 x (BN, LD) */
    tm__bf16 *vs = ks + 2 * BN * LD;    /* 2 x (BN, LD) */
    /* The last query blocks see the most keys: every head's last block starts first. */
    const int bhn = p.B * p.Hq, nqb = fa_cdiv(p.Tq, BM);
    const int qb = nqb - 1 - (int)(blockIdx.x / (unsigned)bhn);
    const int bh = (int)(blockIdx.x % (unsigned)bhn), h = bh % p.Hq, b = bh / p.Hq, hk = h / p.G;
    const int q0 = qb * BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int w0 = q0 + warp * 16 * MT; /* the warp's first row; row (mt, half) = w0 + 16 mt + 8 half + g */
    const tm__bf16 *qg = p.q + ((int64_t)b * p.Tq + q0) * p.qs + (int64_t)h * D;
    const tm__bf16 *kg = p.k + (int64_t)b * p.Tk * p.ks + (int64_t)hk * D; /* key 0 */
    const tm__bf16 *vg = p.v + (int64_t)b * p.Tk * p.ks + (int64_t)hk * D;
    /* keys [0, kend) are seen by some row of the block, [0, wend) by some row of the warp */
    const int kend = fa_imin(p.Tk, fa_imin(q0 + BM, p.Tq) + p.off);
    const int wend = w0 < p.Tq ? fa_imin(p.Tk, fa_imin(w0 + 16 * MT, p.Tq) + p.off) : 0;
    const int ntiles = fa_cdiv(kend, BN);

    fa_load_rows<D, BM>(qs, qg, p.qs, p.Tq - q0);
    fa_load_rows<D, BN>(ks, kg, p.ks, p.Tk);
    fa_load_rows<D, BN>(vs, vg, p.ks, p.Tk);
    tm__cp_async_commit();

    uint32_t qf[QREG ? MT : 1][QREG ? KD : 1][4];
    float o[MT][ND][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int x = 0; x < ND; x++) o[mt][x][0] = o[mt][x][1] = o[mt][x][2] = o[mt][x][3] = 0.0f;
    /* running max (log2 units) and this thread's part of the running sum, per row */
    float m[MT][2], l[MT][2], cr[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;

    for (int t = 0; t < ntiles; t++) {
        const int buf = t & 1, j0 = t * BN;
        if (t + 1 < ntiles) { /* prefetch the next tile into the other buffer */
            const int j1 = j0 + BN;
            fa_load_rows<D, BN>(ks + (buf ^ 1) * BN * LD, kg + (int64_t)j1 * p.ks, p.ks, p.Tk - j1);
            fa_load_rows<D, BN>(vs + (buf ^ 1) * BN * LD, vg + (int64_t)j1 * p.ks, p.ks, p.Tk - j1);
            tm__cp_async_commit();
            tm__cp_async_wait<1>();
        } else {
            tm__cp_async_wait<0>();
        }
        __syncthreads();
        if (QREG && t == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int kk = 0; kk < KD; kk++) fa_lda<LD>(qf[QREG ? mt : 0][QREG ? kk : 0], qs, warp * 16 * MT + mt * 16, kk * 16);
        }
        /* A warp whose rows see no key of the tile skips it: for them it would change nothing
         * (every score masked, the rescale factors 1). */
        if (j0 < wend) {
            const tm__bf16 *kt = ks + buf * BN * LD, *vt = vs + buf * BN * LD;
            /* S = Q K^T: s[mt][n] holds keys j0 + 8n .. j0 + 8n + 7 */
            float s[MT][NB][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int n = 0; n < NB; n++) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                uint32_t qa[QREG ? 1 : MT][4];
                if (!QREG) {
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) fa_lda<LD>(qa[QREG ? 0 : mt], qs, warp * 16 * MT + mt * 16, kk * 16);
                }
#pragma unroll
                for (int np = 0; np < NB / 2; np++) {
                    uint32_t r[4];
                    fa_ldb<LD>(r, kt, np * 16, kk * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        const uint32_t(&a)[4] = QREG ? qf[QREG ? mt : 0][QREG ? kk : 0] : qa[QREG ? 0 : mt];
                        tm__mma_bf16_16816(s[mt][2 * np], a, r[0], r[1]);
                        tm__mma_bf16_16816(s[mt][2 * np + 1], a, r[2], r[3]);
                    }
                }
            }
            /* Online softmax in log2 units, the scale folded into the exponent's FFMA: keys
             * past a row's limit masked (only on tiles that cross it; keys past Tk always lie
             * beyond every row's limit). The running max m that P is taken against moves only
             * when a row's max exceeds it by more than FA_RESCALE (or on the first visible
             * tile): P = 2^(s' - m) then stays below 2^FA_RESCALE, exact after the final
             * division by l, and O and l are rescaled only on the tiles where some row of the
             * warp moved, not on every tile. */
            const bool diag = j0 + BN - 1 > w0 + p.off;
            float mu[MT][2];
            bool moved = false;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const int i0 = w0 + mt * 16 + g, i1 = i0 + 8;
                float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
                for (int n = 0; n < NB; n++) {
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (diag && j0 + n * 8 + t4 * 2 + (e & 1) > (e < 2 ? i0 : i1) + p.off) s[mt][n][e] = -INFINITY;
                    mx0 = fmaxf(mx0, fmaxf(s[mt][n][0], s[mt][n][1]));
                    mx1 = fmaxf(mx1, fmaxf(s[mt][n][2], s[mt][n][3]));
                }
                mx0 = tm__quad_max(mx0) * p.scale_log2, mx1 = tm__quad_max(mx1) * p.scale_log2;
                const float mx[2] = {mx0, mx1};
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    if (mx[half] > m[mt][half] + FA_RESCALE) { /* false for a row still fully masked (-inf) */
                        cr[mt][half] = fa_exp2(m[mt][half] - mx[half]); /* 0 on the first visible tile */
                        m[mt][half] = mx[half];
                        moved = true;
                    } else {
                        cr[mt][half] = 1.0f;
                    }
                    /* a row with every key so far masked keeps 2^(-inf - 0) = 0 instead of NaN */
                    mu[mt][half] = m[mt][half] == -INFINITY ? 0.0f : m[mt][half];
                }
            }
            if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    l[mt][0] *= cr[mt][0], l[mt][1] *= cr[mt][1];
#pragma unroll
                    for (int x = 0; x < ND; x++) {
                        o[mt][x][0] *= cr[mt][0], o[mt][x][1] *= cr[mt][0];
                        o[mt][x][2] *= cr[mt][1], o[mt][x][3] *= cr[mt][1];
                    }
                }
            }
            /* O += P V: the accumulator layout of S is the A layout of P, 16 keys per step */
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                uint32_t pa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int u = 0; u < 2; u++) {
                        const int n = 2 * kk + u;
                        const float e0 = fa_exp2(fmaf(s[mt][n][0], p.scale_log2, -mu[mt][0]));
                        const float e1 = fa_exp2(fmaf(s[mt][n][1], p.scale_log2, -mu[mt][0]));
                        const float e2 = fa_exp2(fmaf(s[mt][n][2], p.scale_log2, -mu[mt][1]));
                        const float e3 = fa_exp2(fmaf(s[mt][n][3], p.scale_log2, -mu[mt][1]));
                        l[mt][0] += e0 + e1;
                        l[mt][1] += e2 + e3;
                        pa[mt][2 * u] = tm__pack_bf16x2(e0, e1);
                        pa[mt][2 * u + 1] = tm__pack_bf16x2(e2, e3);
                    }
                }
#pragma unroll
                for (int dp = 0; dp < KD; dp++) {
                    uint32_t r[4];
                    fa_ldbt<LD>(r, vt, kk * 16, dp * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        tm__mma_bf16_16816(o[mt][2 * dp], pa[mt], r[0], r[1]);
                        tm__mma_bf16_16816(o[mt][2 * dp + 1], pa[mt], r[2], r[3]);
                    }
                }
            }
        }
        __syncthreads(); /* the buffer is refilled by the next iteration's prefetch */
    }

    const int64_t lrow = ((int64_t)b * p.Hq + h) * p.Tq;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int i = w0 + mt * 16 + half * 8 + g;
            const float lt = tm__quad_sum(l[mt][half]);
            if (i >= p.Tq) continue;
            const float inv = 1.0f / lt;
            tm__bf16 *orow = p.out + ((int64_t)b * p.Tq + i) * p.qs + (int64_t)h * D + t4 * 2;
#pragma unroll
            for (int x = 0; x < ND; x++) fa_st2(orow + x * 8, o[mt][x][2 * half] * inv, o[mt][x][2 * half + 1] * inv);
            if (t4 == 0) p.lse[lrow + i] = (m[mt][half] + log2f(lt)) * FA_LN2;
        }
    }
}

/* ---- backward ------------------------------------------------------------------------------------ */

/* Delta_i = dO_i . O_i over rows (b, i, h) of o, D / 8 lanes per row, 16 bytes of o and dO per
 * lane; delta in lse's layout (B, Hq, Tq). The lanes of a row add in a fixed butterfly. */
template <int D>
__global__ void __launch_bounds__(FA_THREADS) fa_delta_kernel(fa_params p) {
    constexpr int LPR = D / 8, RPB = FA_THREADS / LPR; /* lanes per row, rows per block */
    const int64_t row = (int64_t)blockIdx.x * RPB + threadIdx.x / LPR;
    const int x = (threadIdx.x % LPR) * 8;
    const bool ok = row < (int64_t)p.B * p.Tq * p.Hq; /* shuffles need every lane: no early return */
    float s = 0.0f;
    if (ok) {
        const uint4 ov = *reinterpret_cast<const uint4 *>(p.o + row * D + x);
        const uint4 gv = *reinterpret_cast<const uint4 *>(p.dout + row * D + x);
        const __nv_bfloat162 *o2 = reinterpret_cast<const __nv_bfloat162 *>(&ov), *g2 = reinterpret_cast<const __nv_bfloat162 *>(&gv);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float2 a = __bfloat1622float2(o2[e]), c = __bfloat1622float2(g2[e]);
            s = fmaf(a.x, c.x, s);
            s = fmaf(a.y, c.y, s);
        }
    }
#pragma unroll
    for (int w = LPR / 2; w > 0; w >>= 1) s += __shfl_xor_sync(0xffffffffu, s, w);
    if (ok && threadIdx.x % LPR == 0) {
        const int64_t h = row % p.Hq, i = (row / p.Hq) % p.Tq, b = row / ((int64_t)p.Hq * p.Tq);
        p.delta[(b * p.Hq + h) * p.Tq + i] = s;
    }
}

/* dq += scale dS K: one block per (b, h, 64 MT query rows), 16 MT rows per warp, keys in tiles
 * of BN in order. QR: Q and dO fragments held in registers for the whole block. */
template <int D, int MT, int BN, int QR>
__global__ void __launch_bounds__(FA_THREADS) fa_backward_dq_kernel(fa_params p) {
    extern __shared__ __align__(16) unsigned char fa_smem[];
    constexpr int LD = D + FA_PAD, KD = D / 16, ND = D / 8, BM = 64 * MT, NB = BN / 8;
    tm__bf16 *qs = (tm__bf16 *)fa_smem; /* (BM, LD) */
    tm__bf16 *dos = qs + BM * LD;       /* (BM, LD) */
    tm__bf16 *ks = dos + BM * LD;       /* 2 x (BN, LD) */
    tm__bf16 *vs = ks + 2 * BN * LD;    /* 2 x (BN, LD) */
    const int bhn = p.B * p.Hq, nqb = fa_cdiv(p.Tq, BM);
    const int qb = nqb - 1 - (int)(blockIdx.x / (unsigned)bhn);
    const int bh = (int)(blockIdx.x % (unsigned)bhn), h = bh % p.Hq, b = bh / p.Hq, hk = h / p.G;
    const int q0 = qb * BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int w0 = q0 + warp * 16 * MT, wr = warp * 16 * MT;
    const int64_t qoff = ((int64_t)b * p.Tq + q0) * p.qs + (int64_t)h * D;
    const tm__bf16 *kg = p.k + (int64_t)b * p.Tk * p.ks + (int64_t)hk * D;
    const tm__bf16 *vg = p.v + (int64_t)b * p.Tk * p.ks + (int64_t)hk * D;
    const int kend = fa_imin(p.Tk, fa_imin(q0 + BM, p.Tq) + p.off);
    const int wend = w0 < p.Tq ? fa_imin(p.Tk, fa_imin(w0 + 16 * MT, p.Tq) + p.off) : 0;
    const int ntiles = fa_cdiv(kend, BN);

    fa_load_rows<D, BM>(qs, p.q + qoff, p.qs, p.Tq - q0);
    fa_load_rows<D, BM>(dos, p.dout + qoff, p.qs, p.Tq - q0);
    fa_load_rows<D, BN>(ks, kg, p.ks, p.Tk);
    fa_load_rows<D, BN>(vs, vg, p.ks, p.Tk);
    tm__cp_async_commit();

    const int64_t lrow = ((int64_t)b * p.Hq + h) * p.Tq;
    float lse[MT][2], dl[MT][2]; /* lse in log2 units, Delta; 0 for rows past Tq (zero q, dO: dS = 0) */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int i = w0 + mt * 16 + half * 8 + g;
            lse[mt][half] = i < p.Tq ? p.lse[lrow + i] * FA_LOG2E : 0.0f;
            dl[mt][half] = i < p.Tq ? p.delta[lrow + i] : 0.0f;
        }
    uint32_t qf[QR ? MT : 1][QR ? KD : 1][4], of[QR ? MT : 1][QR ? KD : 1][4];
    float acc[MT][ND][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int x = 0; x < ND; x++) acc[mt][x][0] = acc[mt][x][1] = acc[mt][x][2] = acc[mt][x][3] = 0.0f;

    for (int t = 0; t < ntiles; t++) {
        const int buf = t & 1, j0 = t * BN;
        if (t + 1 < ntiles) {
            const int j1 = j0 + BN;
            fa_load_rows<D, BN>(ks + (buf ^ 1) * BN * LD, kg + (int64_t)j1 * p.ks, p.ks, p.Tk - j1);
            fa_load_rows<D, BN>(vs + (buf ^ 1) * BN * LD, vg + (int64_t)j1 * p.ks, p.ks, p.Tk - j1);
            tm__cp_async_commit();
            tm__cp_async_wait<1>();
        } else {
            tm__cp_async_wait<0>();
        }
        __syncthreads();
        if (QR && t == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int kk = 0; kk < KD; kk++) {
                    fa_lda<LD>(qf[QR ? mt : 0][QR ? kk : 0], qs, wr + mt * 16, kk * 16);
                    fa_lda<LD>(of[QR ? mt : 0][QR ? kk : 0], dos, wr + mt * 16, kk * 16);
                }
        }
        if (j0 < wend) {
            const tm__bf16 *kt = ks + buf * BN * LD, *vt = vs + buf * BN * LD;
            /* S = Q K^T and dP = dO V^T, keys j0 + 8n .. + 7 in s[mt][n], dp[mt][n] */
            float s[MT][NB][4], dp[MT][NB][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int n = 0; n < NB; n++)
                    s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = dp[mt][n][0] = dp[mt][n][1] = dp[mt][n][2] =
                        dp[mt][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                uint32_t a[QR ? 1 : MT][4], c[QR ? 1 : MT][4];
                if (!QR) {
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        fa_lda<LD>(a[QR ? 0 : mt], qs, wr + mt * 16, kk * 16);
                        fa_lda<LD>(c[QR ? 0 : mt], dos, wr + mt * 16, kk * 16);
                    }
                }
#pragma unroll
                for (int np = 0; np < NB / 2; np++) {
                    uint32_t r[4];
                    fa_ldb<LD>(r, kt, np * 16, kk * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        const uint32_t(&qa)[4] = QR ? qf[QR ? mt : 0][QR ? kk : 0] : a[QR ? 0 : mt];
                        tm__mma_bf16_16816(s[mt][2 * np], qa, r[0], r[1]);
                        tm__mma_bf16_16816(s[mt][2 * np + 1], qa, r[2], r[3]);
                    }
                    fa_ldb<LD>(r, vt, np * 16, kk * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        const uint32_t(&oa)[4] = QR ? of[QR ? mt : 0][QR ? kk : 0] : c[QR ? 0 : mt];
                        tm__mma_bf16_16816(dp[mt][2 * np], oa, r[0], r[1]);
                        tm__mma_bf16_16816(dp[mt][2 * np + 1], oa, r[2], r[3]);
                    }
                }
            }
            /* dQ += dS K, 16 keys per step: P = exp(s - lse), dS = P (dP - Delta) into bf16 A
             * fragments right before the step; K as the (key, d) B operand, transposed */
            const bool diag = j0 + BN - 1 > w0 + p.off;
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                uint32_t da[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int u = 0; u < 2; u++) {
                        const int n = 2 * kk + u;
                        float ds[4];
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int half = e >> 1, i = w0 + mt * 16 + half * 8 + g;
                            float pr = fa_exp2(fmaf(s[mt][n][e], p.scale_log2, -lse[mt][half]));
                            if (diag && j0 + n * 8 + t4 * 2 + (e & 1) > i + p.off) pr = 0.0f;
                            ds[e] = pr * (dp[mt][n][e] - dl[mt][half]);
                        }
                        da[mt][2 * u] = tm__pack_bf16x2(ds[0], ds[1]);
                        da[mt][2 * u + 1] = tm__pack_bf16x2(ds[2], ds[3]);
                    }
                }
#pragma unroll
                for (int dd = 0; dd < KD; dd++) {
                    uint32_t r[4];
                    fa_ldbt<LD>(r, kt, kk * 16, dd * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        tm__mma_bf16_16816(acc[mt][2 * dd], da[mt], r[0], r[1]);
                        tm__mma_bf16_16816(acc[mt][2 * dd + 1], da[mt], r[2], r[3]);
                    }
                }
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int i = w0 + mt * 16 + half * 8 + g;
            if (i >= p.Tq) continue;
            tm__bf16 *row = p.dq + ((int64_t)b * p.Tq + i) * p.qs + (int64_t)h * D + t4 * 2;
#pragma unroll
            for (int x = 0; x < ND; x++)
                fa_add2(row + x * 8, p.scale * acc[mt][x][2 * half], p.scale * acc[mt][x][2 * half + 1], p.fq);
        }
    }
}

/* The query block `it` of a dk/dv block (the G heads of its kv head in order, each from its
 * first query block qstart on): q, dO rows and their lse, Delta into one buffer. */
template <int D, int BQ>
__device__ __forceinline__ void fa_dkv_load(const fa_params &p, tm__bf16 *qs, tm__bf16 *dos, float *ls, float *dls,
                                            int b, int hk, int qstart, int nqblk, int it) {
    const int h = hk * p.G + it / nqblk, i0 = qstart + (it % nqblk) * BQ;
    const int64_t qoff = ((int64_t)b * p.Tq + i0) * p.qs + (int64_t)h * D;
    fa_load_rows<D, BQ>(qs, p.q + qoff, p.qs, p.Tq - i0);
    fa_load_rows<D, BQ>(dos, p.dout + qoff, p.qs, p.Tq - i0);
    const int64_t lrow = ((int64_t)b * p.Hq + h) * p.Tq + i0;
    const int x = threadIdx.x;
    if (x < BQ) {
        const bool ok = i0 + x < p.Tq;
        tm__cp_async4(ls + x, ok ? p.lse + lrow + x : p.lse + lrow, ok ? 4 : 0);
    } else if (x < 2 * BQ) {
        const bool ok = i0 + (x - BQ) < p.Tq;
        tm__cp_async4(dls + (x - BQ), ok ? p.delta + lrow + (x - BQ) : p.delta + lrow, ok ? 4 : 0);
    }
}

/* dk += scale dS^T Q, dv += P^T dO: one block per (b, kv head, 64 MT keys), 16 MT keys per warp;
 * the G query heads of the kv head in order, each over its query blocks of BQ rows in order.
 * KR: K and V fragments held in registers for the whole block. */
template <int D, int MT, int BQ, int KR>
__global__ void __launch_bounds__(FA_THREADS) fa_backward_dkv_kernel(fa_params p) {
    static_assert(2 * BQ <= FA_THREADS && BQ % 16 == 0, "lse and Delta take one thread per row");
    extern __shared__ __align__(16) unsigned char fa_smem[];
    constexpr int LD = D + FA_PAD, KD = D / 16, ND = D / 8, NQ = BQ / 8, BN = 64 * MT;
    tm__bf16 *ks = (tm__bf16 *)fa_smem;       /* (BN, LD) */
    tm__bf16 *vs = ks + BN * LD;              /* (BN, LD) */
    tm__bf16 *qs = vs + BN * LD;              /* 2 x (BQ, LD) */
    tm__bf16 *dos = qs + 2 * BQ * LD;         /* 2 x (BQ, LD) */
    float *ls = (float *)(dos + 2 * BQ * LD); /* 2 x BQ */
    float *dls = ls + 2 * BQ;                 /* 2 x BQ */
    /* The first key blocks are seen by the most queries: every head's first block starts first. */
    const int bhn = p.B * p.Hkv;
    const int kb = (int)(blockIdx.x / (unsigned)bhn);
    const int bh = (int)(blockIdx.x % (unsigned)bhn), hk = bh % p.Hkv, b = bh / p.Hkv;
    const int j0 = kb * BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int wr = warp * 16 * MT, wj = j0 + wr; /* the warp's first key; key (mt, half) = wj + 16 mt + 8 half + g */
    /* query rows i >= j0 - off see some key of the block; j0 < Tk makes qstart < Tq */
    const int qstart = j0 - p.off > 0 ? (j0 - p.off) / BQ * BQ : 0;
    const int nqblk = fa_cdiv(p.Tq - qstart, BQ), nit = p.G * nqblk;
    const int64_t koff = ((int64_t)b * p.Tk + j0) * p.ks + (int64_t)hk * D;

    fa_load_rows<D, BN>(ks, p.k + koff, p.ks, p.Tk - j0);
    fa_load_rows<D, BN>(vs, p.v + koff, p.ks, p.Tk - j0);
    fa_dkv_load<D, BQ>(p, qs, dos, ls, dls, b, hk, qstart, nqblk, 0);
    tm__cp_async_commit();

    uint32_t kf[KR ? MT : 1][KR ? KD : 1][4], vf[KR ? MT : 1][KR ? KD : 1][4];
    float dk[MT][ND][4], dv[MT][ND][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int x = 0; x < ND; x++)
            dk[mt][x][0] = dk[mt][x][1] = dk[mt][x][2] = dk[mt][x][3] = dv[mt][x][0] = dv[mt][x][1] = dv[mt][x][2] =
                dv[mt][x][3] = 0.0f;

    for (int it = 0; it < nit; it++) {
        const int buf = it & 1;
        if (it + 1 < nit) {
            fa_dkv_load<D, BQ>(p, qs + (buf ^ 1) * BQ * LD, dos + (buf ^ 1) * BQ * LD, ls + (buf ^ 1) * BQ,
                               dls + (buf ^ 1) * BQ, b, hk, qstart, nqblk, it + 1);
            tm__cp_async_commit();
            tm__cp_async_wait<1>();
        } else {
            tm__cp_async_wait<0>();
        }
        __syncthreads();
        if (KR && it == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int kk = 0; kk < KD; kk++) {
                    fa_lda<LD>(kf[KR ? mt : 0][KR ? kk : 0], ks, wr + mt * 16, kk * 16);
                    fa_lda<LD>(vf[KR ? mt : 0][KR ? kk : 0], vs, wr + mt * 16, kk * 16);
                }
        }
        const int i0 = qstart + (it % nqblk) * BQ;
        /* A warp whose keys no query of the step sees (or past Tk) skips it: P = dS = 0 there. */
        if (wj < p.Tk && wj <= fa_imin(i0 + BQ, p.Tq) - 1 + p.off) {
            const tm__bf16 *qt = qs + buf * BQ * LD, *ot = dos + buf * BQ * LD;
            const float *lt = ls + buf * BQ, *dt = dls + buf * BQ;

            /* S^T = K Q^T and dP^T = V dO^T: (16 MT keys, BQ queries) per warp, queries i0 + 8n .. + 7 in s[mt][n] */
            float s[MT][NQ][4], dp[MT][NQ][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int n = 0; n < NQ; n++)
                    s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = dp[mt][n][0] = dp[mt][n][1] = dp[mt][n][2] =
                        dp[mt][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                uint32_t a[KR ? 1 : MT][4], c[KR ? 1 : MT][4];
                if (!KR) {
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        fa_lda<LD>(a[KR ? 0 : mt], ks, wr + mt * 16, kk * 16);
                        fa_lda<LD>(c[KR ? 0 : mt], vs, wr + mt * 16, kk * 16);
                    }
                }
#pragma unroll
                for (int np = 0; np < BQ / 16; np++) {
                    uint32_t r[4];
                    fa_ldb<LD>(r, qt, np * 16, kk * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        const uint32_t(&ka)[4] = KR ? kf[KR ? mt : 0][KR ? kk : 0] : a[KR ? 0 : mt];
                        tm__mma_bf16_16816(s[mt][2 * np], ka, r[0], r[1]);
                        tm__mma_bf16_16816(s[mt][2 * np + 1], ka, r[2], r[3]);
                    }
                    fa_ldb<LD>(r, ot, np * 16, kk * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        const uint32_t(&va)[4] = KR ? vf[KR ? mt : 0][KR ? kk : 0] : c[KR ? 0 : mt];
                        tm__mma_bf16_16816(dp[mt][2 * np], va, r[0], r[1]);
                        tm__mma_bf16_16816(dp[mt][2 * np + 1], va, r[2], r[3]);
                    }
                }
            }
            /* dV += P^T dO, dK += dS^T Q, 16 queries per step: P^T = exp(s - lse_i), dS^T =
             * P^T (dP^T - Delta_i) into bf16 A fragments right before the step, zero where
             * j > i + off and for rows i >= Tq (zero-filled q, dO: harmless, but cleaner to
             * drop); dO and Q as (query, d) B operands */
            const bool mask = wj + 16 * MT - 1 > i0 + p.off || i0 + BQ > p.Tq;
#pragma unroll
            for (int kq = 0; kq < BQ / 16; kq++) {
                uint32_t pa[MT][4], da[MT][4];
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    const int n = 2 * kq + u, c0 = n * 8 + t4 * 2; /* this thread's queries i0 + c0, + 1 */
                    const float2 lse2 = *reinterpret_cast<const float2 *>(lt + c0);
                    const float2 del2 = *reinterpret_cast<const float2 *>(dt + c0);
                    const float ll[2] = {lse2.x * FA_LOG2E, lse2.y * FA_LOG2E}, dd2[2] = {del2.x, del2.y};
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        float pr[4], ds[4];
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int i = i0 + c0 + (e & 1), j = wj + mt * 16 + (e >> 1) * 8 + g;
                            float x = fa_exp2(fmaf(s[mt][n][e], p.scale_log2, -ll[e & 1]));
                            if (mask && (j > i + p.off || i >= p.Tq)) x = 0.0f;
                            pr[e] = x;
                            ds[e] = x * (dp[mt][n][e] - dd2[e & 1]);
                        }
                        pa[mt][2 * u] = tm__pack_bf16x2(pr[0], pr[1]);
                        pa[mt][2 * u + 1] = tm__pack_bf16x2(pr[2], pr[3]);
                        da[mt][2 * u] = tm__pack_bf16x2(ds[0], ds[1]);
                        da[mt][2 * u + 1] = tm__pack_bf16x2(ds[2], ds[3]);
                    }
                }
#pragma unroll
                for (int dd = 0; dd < KD; dd++) {
                    uint32_t r[4];
                    fa_ldbt<LD>(r, ot, kq * 16, dd * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        tm__mma_bf16_16816(dv[mt][2 * dd], pa[mt], r[0], r[1]);
                        tm__mma_bf16_16816(dv[mt][2 * dd + 1], pa[mt], r[2], r[3]);
                    }
                    fa_ldbt<LD>(r, qt, kq * 16, dd * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        tm__mma_bf16_16816(dk[mt][2 * dd], da[mt], r[0], r[1]);
                        tm__mma_bf16_16816(dk[mt][2 * dd + 1], da[mt], r[2], r[3]);
                    }
                }
            }
        }
        __syncthreads();
    }

    /* dk and dv of an element have the same owner thread; when they are one buffer (k passed as
     * v), it adds their sum, rounded once. */
    const bool one = p.dk == p.dv;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int j = wj + mt * 16 + half * 8 + g;
            if (j >= p.Tk) continue;
            const int64_t ro = ((int64_t)b * p.Tk + j) * p.ks + (int64_t)hk * D + t4 * 2;
#pragma unroll
            for (int x = 0; x < ND; x++) {
                const float k0 = p.scale * dk[mt][x][2 * half], k1 = p.scale * dk[mt][x][2 * half + 1];
                const float v0 = dv[mt][x][2 * half], v1 = dv[mt][x][2 * half + 1];
                if (one) {
                    fa_add2(p.dk + ro + x * 8, k0 + v0, k1 + v1, p.fk && p.fv);
                } else {
                    if (p.dk) fa_add2(p.dk + ro + x * 8, k0, k1, p.fk);
                    if (p.dv) fa_add2(p.dv + ro + x * 8, v0, v1, p.fv);
                }
            }
        }
    }
}

#endif
