/*
 * attention.cu — CUDA kernels of tm_attention: fused causal scaled-dot-product attention with
 * grouped-query heads, flash-style (Dao et al. 2022): no (Tq, Tk) matrix is ever stored; the
 * forward keeps the per-row logsumexp and the backward rebuilds P_ij = exp(s_ij - lse_i).
 *
 * Layout, shared with kernels/cpu/attention.c:
 *   in[0]    q    (B, Tq, Hq, D)
 *   in[1]    k    (B, Tk, Hkv, D)     query head h reads kv head h / G, G = Hq / Hkv
 *   in[2]    v    (B, Tk, Hkv, D)
 *   fattr[0] scale (<= 0: 1 / sqrt(D))
 *   out[0]   o    (B, Tq, Hq, D)      (the tensor-core backward reads it back for Delta)
 *   saved[0] lse  (B, Hq, Tq) f32     logsumexp of the scaled, masked scores of each query row
 *                                     (f32 here for f32 and bf16 q; the CPU saves it in q's dtype:
 *                                     each backend reads only what its own forward saved)
 * Query i sees keys j < n_i = i + (Tk - Tq) + 1 (the queries are the last Tq of Tk positions).
 * s_ij = scale q_i . k_j.
 * Backward (after FlashAttention-2, Dao 2023), with dP_ij = dO_i . v_j and dS_ij = P_ij (dP_ij - Delta_i):
 *   dq_i += scale sum_j dS_ij k_j,   dk_j += scale sum_(h, i) dS_ij q_i,   dv_j += sum_(h, i) P_ij dO_i
 * (the sums over h run over the G query heads of kv head h / G).
 *
 * Two implementations:
 *
 * 1. Tensor cores: bf16 with D = 64 or 128 and 16-byte-aligned tensors (fa_usable), sm_80 and later.
 *    Warps multiply 16x16 by 16x8 bf16 tiles with mma.sync.m16n8k16 into f32 accumulators; tiles
 *    travel global -> shared with cp.async (double-buffered: the next tile loads while this one is
 *    used) and shared -> registers with ldmatrix (.trans where the operand is needed transposed).
 *    Shared rows are padded to D + 8 bf16 so the 8 rows of an ldmatrix hit distinct banks. Rows
 *    past Tq or Tk are zero-filled by cp.async, never read from memory.
 *    Forward (fa_forward_kernel, FlashAttention-2): one block of 4 warps per (b, h, 64 query rows),
 *      16 rows per warp; K, V in tiles of 64 keys, only up to the block's last visible key. Per
 *      tile: S = Q K^T (Q's fragments stay in registers), online softmax in f32 registers in
 *      log2 units (m' = max(m, max_j s_ij log2 e), acc = acc 2^(m - m') + sum_j 2^(s' - m') v_j,
 *      likewise the row sum l); the S accumulators are already the A fragments of P, which is
 *      rounded to bf16 for O += P V. The causal mask is applied only on tiles that cross a row's
 *      limit (they include every tile with keys past Tk). o_i = acc / l, lse_i = (m + log2 l) ln 2.
 *    Backward, three kernels:
 *      fa_delta_kernel         Delta_i = dO_i . o_i (bf16 o: FlashAttention-2's choice; one warp per row).
 *      fa_backward_dq_kernel   one block per (b, h, 64 query rows): over the key tiles in order,
 *                              S = Q K^T, dP = dO V^T, P = 2^(s' - lse_i log2 e), dS in bf16, dQ += dS K.
 *      fa_backward_dkv_kernel  one block per (b, kv head, 64 keys), 16 keys per warp: over the G
 *                              query heads in order, each over its query blocks (BQ rows) in order
 *                              from the first that sees the block's keys: S^T = K Q^T, dP^T = V dO^T,
 *                              dV += P^T dO, dK += dS^T Q, all in registers.
 *    Shapes per block (D = 128): Q (64, D) and two K, V tiles (64, D) in 85 KiB of shared memory
 *    for the forward, 102 KiB for dq, 69 KiB for dk/dv (BQ = 32; 64 for D = 64); above 48 KiB the
 *    kernels opt in with cudaFuncSetAttribute. ptxas (sm_90, CUDA 13): 138 / 189 registers
 *    (forward D 64 / 128), 164 / 248 (dq), 201 / 249 (dk/dv), no spills (sm_80 alike).
 *    Precision: P and dS are rounded to bf16 as mma operands and Delta comes from the bf16 o, where
 *    the f32 kernels and the CPU keep them in f32; tests/test_cuda_parity_attention.c states the
 *    tolerance this needs.
 *
 * 2. Everything else (f32; bf16 with other head dims): one block per row, f32 arithmetic.
 *    Forward: one block per query row (b, h, i). Keys come in tiles of ATT_TILE; each warp takes
 *    keys of the tile and reduces its dot products over D with a butterfly; the tile's scores
 *    update the running max m, sum l and the unnormalised output acc (online softmax):
 *      m' = max(m, max_j s_ij), acc = acc e^(m - m') + sum_j e^(s_ij - m') v_j, likewise l;
 *      o_i = acc / l, lse_i = m + log l.
 *    Backward with Delta_i = sum_j P_ij dP_ij (from the row itself, as on the CPU: no O needed):
 *      dq_i                    one block per query row, which also writes Delta_i
 *      dk_j, dv_j              one block per key row (b, kv head, j): sums over the G query heads
 *                              of the kv head, then rows i >= j - (Tk - Tq)
 *    All arithmetic is f32 (bf16 loaded and rounded on store). Work is O(B Hq Tq Tk D) in each
 *    direction, without tensor cores.
 *
 * Determinism, both paths: every output element (o, lse, Delta, each row of dq, dk, dv) is written
 * by exactly one block, which adds its terms in an order fixed by the shapes alone (tiles in
 * order, mma's fixed internal order, butterflies over fixed lanes); no atomics, so the results
 * are bitwise reproducible. The CPU's f32 kernel sums in another order, which is what the
 * parity tolerance covers. One thread adds both dk and dv of an element, so k passed as v (one
 * gradient buffer) is right too.
 */
#include "common.cuh"

#define ATT_THREADS 128
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_TILE 32 /* keys (forward, dq) or query rows (dk, dv) per tile */

typedef struct attn_dims {
    int64_t B, Tq, Tk, Hq, Hkv, D;
    int64_t G;   /* query heads per kv head */
    int64_t off; /* Tk - Tq */
    float scale;
} attn_dims;

static attn_dims attn_dims_of(const tm__call *c) {
    const tm_tensor *q = c->in[0], *k = c->in[1];
    attn_dims d;
    d.B = q->shape[0], d.Tq = q->shape[1], d.Hq = q->shape[2], d.D = q->shape[3];
    d.Tk = k->shape[1], d.Hkv = k->shape[2];
    d.G = d.Hq / d.Hkv;
    d.off = d.Tk - d.Tq;
    d.scale = (float)(c->fattr[0] > 0.0 ? c->fattr[0] : 1.0 / sqrt((double)d.D));
    return d;
}

/* sum_x a[x] b[x] over D, a in shared memory (f32), b in global memory: the lanes of a warp
 * stride over x, then a butterfly; every lane gets the same value (float addition commutes). */
template <typename T>
__device__ __forceinline__ float attn_warp_dot(const float *a, const T *b, int64_t D) {
    float s = 0.0f;
    for (int64_t x = threadIdx.x & 31; x < D; x += 32) s += a[x] * tm__ld(b + x);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

/* Dynamic shared memory: (nvec * D + 2 * ATT_TILE) floats. */
static size_t att_smem(int nvec, int64_t D) { return (size_t)(nvec * D + 2 * ATT_TILE) * sizeof(float); }

/* ---- forward ------------------------------------------------------------------------------------ */

template <typename T>
__global__ void __launch_bounds__(ATT_THREADS)
attn_forward_kernel(void *o_, float *lse, const void *q_, const void *k_, const void *v_, attn_dims d) {
    extern __shared__ float sm[];
    const int64_t D = d.D, ks = d.Hkv * D;
    float *qs = sm, *acc = qs + D, *p = acc + D; /* q row, unnormalised output, a tile's scores */
    const int64_t row = blockIdx.x;              /* (b * Hq + h) * Tq + i: lse's layout */
    const int64_t i = row % d.Tq, h = (row / d.Tq) % d.Hq, b = row / (d.Tq * d.Hq), hk = h / d.G;
    const int64_t n = i + d.off + 1, qo = ((b * d.Tq + i) * d.Hq + h) * D;
    const T *kb = (const T *)k_ + b * d.Tk * ks + hk * D; /* key j at kb + j * ks */
    const T *vb = (const T *)v_ + b * d.Tk * ks + hk * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    for (int64_t x = threadIdx.x; x < D; x += blockDim.x) {
        qs[x] = tm__ld((const T *)q_ + qo + x);
        acc[x] = 0.0f;
    }
    __syncthreads();
    float m = -INFINITY, l = 0.0f; /* every thread keeps the same copy */
    for (int64_t j0 = 0; j0 < n; j0 += ATT_TILE) {
        const int cnt = (int)(n - j0 < ATT_TILE ? n - j0 : ATT_TILE);
        for (int jj = warp; jj < cnt; jj += ATT_WARPS) {
            float s = attn_warp_dot(qs, kb + (j0 + jj) * ks, D);
            if (lane == 0) p[jj] = s * d.scale;
        }
        __syncthreads();
        float mt = m;
        for (int jj = 0; jj < cnt; jj++) mt = fmaxf(mt, p[jj]);
        const float corr = expf(m - mt); /* 0 on the first tile (m = -inf) */
        __syncthreads();                 /* every thread has read the scores */
        if ((int)threadIdx.x < cnt) p[threadIdx.x] = expf(p[threadIdx.x] - mt);
        __syncthreads();
        float ls = 0.0f;
        for (int jj = 0; jj < cnt; jj++) ls += p[jj];
        l = l * corr + ls;
        m = mt;
        for (int64_t x = threadIdx.x; x < D; x += blockDim.x) {
            float a = acc[x] * corr;
            for (int jj = 0; jj < cnt; jj++) a += p[jj] * tm__ld(vb + (j0 + jj) * ks + x);
            acc[x] = a;
        }
        __syncthreads(); /* p is rewritten by the next tile */
    }
    const float inv = 1.0f / l;
    T *o = (T *)o_ + qo;
    for (int64_t x = threadIdx.x; x < D; x += blockDim.x) tm__st(o + x, acc[x] * inv);
    if (threadIdx.x == 0) lse[row] = m + logf(l);
}

/* ---- backward ----------------------------------------------------------------------------------- */

/* One block per query row (b, h, i): delta[row] = Delta_i; dq_i += scale sum_j dS_ij k_j when
 * dq is not NULL. Two passes over the keys: Delta first, since every dS_ij needs it. */
template <typename T>
__global__ void __launch_bounds__(ATT_THREADS)
attn_backward_q_kernel(void *dq_, float *delta, const void *q_, const void *k_, const void *v_, const void *dout_,
                       const float *lse, attn_dims d) {
    extern __shared__ float sm[];
    const int64_t D = d.D, ks = d.Hkv * D;
    float *qs = sm, *dos = qs + D, *dqa = dos + D, *p = dqa + D, *dp = p + ATT_TILE;
    const int64_t row = blockIdx.x;
    const int64_t i = row % d.Tq, h = (row / d.Tq) % d.Hq, b = row / (d.Tq * d.Hq), hk = h / d.G;
    const int64_t n = i + d.off + 1, qo = ((b * d.Tq + i) * d.Hq + h) * D;
    const T *kb = (const T *)k_ + b * d.Tk * ks + hk * D;
    const T *vb = (const T *)v_ + b * d.Tk * ks + hk * D;
    const float lse_i = lse[row];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    for (int64_t x = threadIdx.x; x < D; x += blockDim.x) {
        qs[x] = tm__ld((const T *)q_ + qo + x);
        dos[x] = tm__ld((const T *)dout_ + qo + x);
        dqa[x] = 0.0f;
    }
    __syncthreads();
    float dl = 0.0f; /* Delta_i; every thread keeps the same copy */
    for (int pass = 0; pass < (dq_ ? 2 : 1); pass++) {
        for (int64_t j0 = 0; j0 < n; j0 += ATT_TILE) {
            const int cnt = (int)(n - j0 < ATT_TILE ? n - j0 : ATT_TILE);
            for (int jj = warp; jj < cnt; jj += ATT_WARPS) {
                float s = attn_warp_dot(qs, kb + (j0 + jj) * ks, D);
                float t = attn_warp_dot(dos, vb + (j0 + jj) * ks, D);
                if (lane == 0) {
                    p[jj] = expf(s * d.scale - lse_i);
                    dp[jj] = t;
                }
            }
            __syncthreads();
            if (pass == 0) {
                for (int jj = 0; jj < cnt; jj++) dl += p[jj] * dp[jj];
            } else {
                for (int64_t x = threadIdx.x; x < D; x += blockDim.x) {
                    float a = dqa[x];
                    for (int jj = 0; jj < cnt; jj++) a += p[jj] * (dp[jj] - dl) * tm__ld(kb + (j0 + jj) * ks + x);
                    dqa[x] = a;
                }
            }
            __syncthreads(); /* p, dp are rewritten by the next tile */
        }
    }
    if (threadIdx.x == 0) delta[row] = dl;
    if (!dq_) return;
    T *dq = (T *)dq_ + qo;
    for (int64_t x = threadIdx.x; x < D; x += blockDim.x) tm__st(dq + x, tm__ld(dq + x) + d.scale * dqa[x]);
}

/* One block per key row (b, hk, j): dk_j += scale sum dS_ij q_i, dv_j += sum P_ij dO_i over
 * the query heads h of kv head hk, then the rows i that see key j, in that order. dk or dv may
 * be NULL (delta is read only for dk). */
template <typename T>
__global__ void __launch_bounds__(ATT_THREADS)
attn_backward_kv_kernel(void *dk_, void *dv_, const void *q_, const void *k_, const void *v_, const void *dout_,
                        const float *lse, const float *delta, attn_dims d) {
    extern __shared__ float sm[];
    const int64_t D = d.D, qs = d.Hq * D;
    float *kr = sm, *vr = kr + D, *dka = vr + D, *dva = dka + D, *p = dva + D, *ds = p + ATT_TILE;
    const int64_t row = blockIdx.x; /* (b * Hkv + hk) * Tk + j */
    const int64_t j = row % d.Tk, hk = (row / d.Tk) % d.Hkv, b = row / (d.Tk * d.Hkv);
    const int64_t ko = ((b * d.Tk + j) * d.Hkv + hk) * D;
    const int64_t i0 = j - d.off > 0 ? j - d.off : 0; /* the first query row that sees key j */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    for (int64_t x = threadIdx.x; x < D; x += blockDim.x) {
        kr[x] = tm__ld((const T *)k_ + ko + x);
        vr[x] = tm__ld((const T *)v_ + ko + x);
        dka[x] = 0.0f;
        dva[x] = 0.0f;
    }
    __syncthreads();
    for (int64_t h = hk * d.G; h < (hk + 1) * d.G; h++) {
        const T *qb = (const T *)q_ + b * d.Tq * qs + h * D; /* query row i at qb + i * qs */
        const T *ob = (const T *)dout_ + b * d.Tq * qs + h * D;
        const int64_t lrow = (b * d.Hq + h) * d.Tq;          /* lse / delta of row i at lrow + i */
        for (int64_t r0 = i0; r0 < d.Tq; r0 += ATT_TILE) {
            const int cnt = (int)(d.Tq - r0 < ATT_TILE ? d.Tq - r0 : ATT_TILE);
            for (int rr = warp; rr < cnt; rr += ATT_WARPS) {
                const int64_t i = r0 + rr;
                float s = attn_warp_dot(kr, qb + i * qs, D), t = attn_warp_dot(vr, ob + i * qs, D);
                if (lane == 0) {
                    float pi = expf(s * d.scale - lse[lrow + i]);
                    p[rr] = pi;
                    ds[rr] = dk_ ? pi * (t - delta[lrow + i]) : 0.0f;
                }
            }
            __syncthreads();
            for (int64_t x = threadIdx.x; x < D; x += blockDim.x) {
                float a = dka[x], c = dva[x];
                for (int rr = 0; rr < cnt; rr++) {
                    a += ds[rr] * tm__ld(qb + (r0 + rr) * qs + x);
                    c += p[rr] * tm__ld(ob + (r0 + rr) * qs + x);
                }
                dka[x] = a;
                dva[x] = c;
            }
            __syncthreads(); /* p, ds are rewritten by the next tile */
        }
    }
    for (int64_t x = threadIdx.x; x < D; x += blockDim.x) {
        if (dk_) tm__st((T *)dk_ + ko + x, tm__ld((const T *)dk_ + ko + x) + d.scale * dka[x]);
        if (dv_) tm__st((T *)dv_ + ko + x, tm__ld((const T *)dv_ + ko + x) + dva[x]);
    }
}

/* ==== tensor-core path: bf16, D = 64 or 128 ===================================================== */

/* ---- PTX (sm_80 and later: cp.async, ldmatrix, mma.sync bf16) ------------------------------------ */

__device__ __forceinline__ uint32_t fa_saddr(const void *s) { return (uint32_t)__cvta_generic_to_shared(s); }

/* 16 bytes global -> shared without a register round trip; src_bytes 0 reads nothing and fills
 * the 16 bytes with zeros (rows past the end of a tensor). */
__device__ __forceinline__ void fa_cp16(void *s, const void *g, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fa_saddr(s)), "l"(g), "r"(src_bytes)
                 : "memory");
}
/* The same for one f32 (src_bytes 4 or 0). */
__device__ __forceinline__ void fa_cp4(void *s, const void *g, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(fa_saddr(s)), "l"(g), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void fa_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* Wait until at most N of this thread's committed groups are still in flight. */
template <int N> __device__ __forceinline__ void fa_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
/* Four 8x8 b16 matrices; lanes 8m..8m+7 give the row addresses of matrix m. Lane l gets, in
 * r[m], row l/4, columns 2(l%4) and 2(l%4)+1 of matrix m (low half: the lower column). */
__device__ __forceinline__ void fa_ldsm4(uint32_t (&r)[4], const void *s) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_saddr(s))
                 : "memory");
}
/* The same, transposed: lane l gets rows 2(l%4), 2(l%4)+1 (low, high half) of column l/4. */
__device__ __forceinline__ void fa_ldsm4t(uint32_t (&r)[4], const void *s) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_saddr(s))
                 : "memory");
}
/* d (16x8 f32) += a (16x16 bf16, row) b (16x8 bf16, col). With g = lane/4, t = lane%4:
 * a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..];
 * b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g];
 * d[0], d[1] = D[g][2t], D[g][2t+1]; d[2], d[3] = D[g+8][2t], D[g+8][2t+1]. */
__device__ __forceinline__ void fa_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* Two floats rounded to bf16 (nearest even), lo in the low half. */
__device__ __forceinline__ uint32_t fa_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
/* A float from shared memory. */
__device__ __forceinline__ float fa_lds(const float *s) { return *s; }

/* ---- end of PTX ---------------------------------------------------------------------------------- */

#define FA_THREADS 128 /* 4 warps */
#define FA_BM 64       /* query rows per block of the forward and dq kernels, 16 per warp */
#define FA_BN 64       /* keys per tile (forward, dq) and per block of the dk/dv kernel, 16 per warp */
#define FA_PAD 8       /* bf16 per shared row beyond D: rows 16 bytes apart modulo 128 (no bank conflicts) */
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

/* Query rows per step of the dk/dv kernel: its registers hold dk, dv (16 x D each per warp)
 * and the (16, BQ) blocks of P^T and dP^T. */
template <int D> struct fa_cfg {
    static constexpr int BQ = D <= 64 ? 64 : 32;
};

typedef struct fa_params {
    const tm__bf16 *q, *k, *v, *o, *dout; /* o: the forward's output (read by the Delta kernel) */
    tm__bf16 *out, *dq, *dk, *dv;         /* dq, dk, dv may be NULL */
    float *lse, *delta;                   /* (B, Hq, Tq) f32 each */
    int64_t qs, ks;                       /* row strides over time: Hq D (q, o, dq) and Hkv D (k, v) */
    int B, Tq, Tk, Hq, Hkv, G, off, D;
    int nqb, nkb;                         /* query blocks of FA_BM, key blocks of FA_BN */
    float scale, scale_log2;              /* scale and scale log2(e), the latter for exp2 */
} fa_params;

__host__ __device__ __forceinline__ int fa_imin(int a, int b) { return a < b ? a : b; }

static fa_params fa_params_make(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D, float scale) {
    fa_params p;
    memset(&p, 0, sizeof p);
    p.B = (int)B, p.Tq = (int)Tq, p.Tk = (int)Tk, p.Hq = (int)Hq, p.Hkv = (int)Hkv, p.D = (int)D;
    p.G = (int)(Hq / Hkv), p.off = (int)(Tk - Tq);
    p.qs = Hq * D, p.ks = Hkv * D;
    p.nqb = (int)((Tq + FA_BM - 1) / FA_BM), p.nkb = (int)((Tk + FA_BN - 1) / FA_BN);
    p.scale = scale, p.scale_log2 = scale * FA_LOG2E;
    return p;
}
/* Blocks of each kernel: (b, h, query block), (b, kv head, key block), 4 rows of o per block. */
static int64_t fa_grid_q(const fa_params *p) { return (int64_t)p->nqb * p->B * p->Hq; }
static int64_t fa_grid_kv(const fa_params *p) { return (int64_t)p->nkb * p->B * p->Hkv; }
static int64_t fa_grid_delta(const fa_params *p) { return ((int64_t)p->B * p->Tq * p->Hq + 3) / 4; }
/* Dynamic shared memory in bytes. */
static size_t fa_smem_fwd(int D) { return (size_t)(FA_BM + 4 * FA_BN) * (D + FA_PAD) * 2; }
static size_t fa_smem_dq(int D) { return (size_t)(2 * FA_BM + 4 * FA_BN) * (D + FA_PAD) * 2; }
static size_t fa_smem_dkv(int D, int BQ) { return (size_t)(2 * FA_BN + 4 * BQ) * (D + FA_PAD) * 2 + 4 * BQ * sizeof(float); }

/* Rows [0, ROWS) of D bf16 each, row r from g + r gs, into s (row stride D + FA_PAD), asynchronously;
 * rows from `valid` on are zero-filled, so padding rows hold zeros, never stale data or NaN. */
template <int D, int ROWS>
__device__ __forceinline__ void fa_load_rows(tm__bf16 *s, const tm__bf16 *g, int64_t gs, int valid) {
    constexpr int CH = D / 8; /* 16-byte chunks per row */
    for (int c = threadIdx.x; c < ROWS * CH; c += FA_THREADS) {
        const int r = c / CH, x = (c % CH) * 8;
        const bool ok = r < valid;
        fa_cp16(s + r * (D + FA_PAD) + x, ok ? (const void *)(g + r * gs + x) : (const void *)g, ok ? 16 : 0);
    }
}

/* o (two adjacent bf16, 4-byte aligned) = (lo, hi) rounded. */
__device__ __forceinline__ void fa_st2(tm__bf16 *o, float lo, float hi) { *reinterpret_cast<uint32_t *>(o) = fa_pack(lo, hi); }
/* g[0], g[1] += a, b (bf16, rounded once). */
__device__ __forceinline__ void fa_add2(tm__bf16 *g, float a, float b) {
    tm__st(g, tm__ld(g) + a);
    tm__st(g + 1, tm__ld(g + 1) + b);
}

/* ---- forward: one block per (b, h, 64 query rows) ------------------------------------------------ */

template <int D>
__global__ void __launch_bounds__(FA_THREADS) fa_forward_kernel(fa_params p) {
    extern __shared__ __align__(16) unsigned char fa_smem[];
    constexpr int LD = D + FA_PAD, KD = D / 16, ND = D / 8;
    tm__bf16 *qs = (tm__bf16 *)fa_smem;    /* (FA_BM, LD) */
    tm__bf16 *ks = qs + FA_BM * LD;        /* 2 x (FA_BN, LD) */
    tm__bf16 *vs = ks + 2 * FA_BN * LD;    /* 2 x (FA_BN, LD) */
    /* The last query blocks see the most keys: they start first. */
    const int qb = p.nqb - 1 - (int)(blockIdx.x % (unsigned)p.nqb);
    const int bh = (int)(blockIdx.x / (unsigned)p.nqb), h = bh % p.Hq, b = bh / p.Hq, hk = h / p.G;
    const int q0 = qb * FA_BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int i0 = q0 + warp * 16 + g, i1 = i0 + 8; /* this thread's two query rows */
    const tm__bf16 *qg = p.q + ((int64_t)b * p.Tq + q0) * p.qs + (int64_t)h * D;
    const tm__bf16 *kg = p.k + (int64_t)b * p.Tk * p.ks + (int64_t)hk * D; /* key 0 */
    const tm__bf16 *vg = p.v + (int64_t)b * p.Tk * p.ks + (int64_t)hk * D;
    /* keys [0, kend) are seen by some row of the block */
    const int kend = fa_imin(p.Tk, fa_imin(q0 + FA_BM, p.Tq) - 1 + p.off + 1);
    const int ntiles = (kend + FA_BN - 1) / FA_BN;

    fa_load_rows<D, FA_BM>(qs, qg, p.qs, p.Tq - q0);
    fa_load_rows<D, FA_BN>(ks, kg, p.ks, p.Tk);
    fa_load_rows<D, FA_BN>(vs, vg, p.ks, p.Tk);
    fa_commit();

    uint32_t qf[KD][4];
    float o[ND][4];
#pragma unroll
    for (int x = 0; x < ND; x++) o[x][0] = o[x][1] = o[x][2] = o[x][3] = 0.0f;
    /* running max (log2 units) and this thread's part of the running sum, rows i0 and i1 */
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    for (int t = 0; t < ntiles; t++) {
        const int buf = t & 1, j0 = t * FA_BN;
        if (t + 1 < ntiles) { /* prefetch the next tile into the other buffer */
            const int j1 = j0 + FA_BN;
            fa_load_rows<D, FA_BN>(ks + (buf ^ 1) * FA_BN * LD, kg + (int64_t)j1 * p.ks, p.ks, p.Tk - j1);
            fa_load_rows<D, FA_BN>(vs + (buf ^ 1) * FA_BN * LD, vg + (int64_t)j1 * p.ks, p.ks, p.Tk - j1);
            fa_commit();
            fa_wait<1>();
        } else {
            fa_wait<0>();
        }
        __syncthreads();
        if (t == 0) {
#pragma unroll
            for (int kk = 0; kk < KD; kk++) fa_ldsm4(qf[kk], qs + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
        }
        const tm__bf16 *kt = ks + buf * FA_BN * LD, *vt = vs + buf * FA_BN * LD;

        /* S = Q K^T: s[n] holds keys j0 + 8n .. j0 + 8n + 7 */
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KD; kk++) {
#pragma unroll
            for (int np = 0; np < 4; np++) {
                uint32_t r[4];
                fa_ldsm4(r, kt + (np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
                fa_mma(s[2 * np], qf[kk], r[0], r[1]);
                fa_mma(s[2 * np + 1], qf[kk], r[2], r[3]);
            }
        }
        /* Scores in log2 units; keys past a row's limit masked, only on tiles that cross it
         * (keys past Tk always lie beyond every row's limit). */
        const bool diag = j0 + FA_BN - 1 > q0 + p.off;
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = s[n][e] * p.scale_log2;
                if (diag && j0 + n * 8 + t4 * 2 + (e & 1) > (e < 2 ? i0 : i1) + p.off) x = -INFINITY;
                s[n][e] = x;
            }
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
        /* a row lives in the 4 lanes of a quad */
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        /* a row with every key so far masked keeps exp2(-inf - 0) = 0 instead of NaN */
        const float mu0 = mn0 == -INFINITY ? 0.0f : mn0, mu1 = mn1 == -INFINITY ? 0.0f : mn1;
        const float c0 = exp2f(m0 - mu0), c1 = exp2f(m1 - mu1);
        m0 = mn0, m1 = mn1;
        float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            s[n][0] = exp2f(s[n][0] - mu0);
            s[n][1] = exp2f(s[n][1] - mu0);
            s[n][2] = exp2f(s[n][2] - mu1);
            s[n][3] = exp2f(s[n][3] - mu1);
            ls0 += s[n][0] + s[n][1];
            ls1 += s[n][2] + s[n][3];
        }
        l0 = l0 * c0 + ls0;
        l1 = l1 * c1 + ls1;
#pragma unroll
        for (int x = 0; x < ND; x++) {
            o[x][0] *= c0, o[x][1] *= c0;
            o[x][2] *= c1, o[x][3] *= c1;
        }
        /* O += P V: the accumulator layout of s is the A layout of P, 16 keys per step */
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const uint32_t a[4] = {fa_pack(s[2 * kk][0], s[2 * kk][1]), fa_pack(s[2 * kk][2], s[2 * kk][3]),
                                   fa_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]), fa_pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < KD; dp++) {
                uint32_t r[4];
                fa_ldsm4t(r, vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * 16 + (lane >> 4) * 8);
                fa_mma(o[2 * dp], a, r[0], r[1]);
                fa_mma(o[2 * dp + 1], a, r[2], r[3]);
            }
        }
        __syncthreads(); /* the buffer is refilled by the next iteration's prefetch */
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int64_t lrow = ((int64_t)b * p.Hq + h) * p.Tq;
    if (i0 < p.Tq) {
        const float inv = 1.0f / l0;
        tm__bf16 *orow = p.out + ((int64_t)b * p.Tq + i0) * p.qs + (int64_t)h * D + t4 * 2;
#pragma unroll
        for (int x = 0; x < ND; x++) fa_st2(orow + x * 8, o[x][0] * inv, o[x][1] * inv);
        if (t4 == 0) p.lse[lrow + i0] = (m0 + log2f(l0)) * FA_LN2;
    }
    if (i1 < p.Tq) {
        const float inv = 1.0f / l1;
        tm__bf16 *orow = p.out + ((int64_t)b * p.Tq + i1) * p.qs + (int64_t)h * D + t4 * 2;
#pragma unroll
        for (int x = 0; x < ND; x++) fa_st2(orow + x * 8, o[x][2] * inv, o[x][3] * inv);
        if (t4 == 0) p.lse[lrow + i1] = (m1 + log2f(l1)) * FA_LN2;
    }
}

/* ---- backward ------------------------------------------------------------------------------------ */

/* Delta_i = dO_i . O_i, one warp per row of o (b, i, h); delta in lse's layout (B, Hq, Tq). */
__global__ void __launch_bounds__(FA_THREADS) fa_delta_kernel(fa_params p) {
    const int64_t row = (int64_t)blockIdx.x * (FA_THREADS / 32) + (threadIdx.x >> 5);
    if (row >= (int64_t)p.B * p.Tq * p.Hq) return; /* whole warps */
    const int lane = threadIdx.x & 31;
    const tm__bf16 *o = p.o + row * p.D, *go = p.dout + row * p.D;
    float s = 0.0f;
    for (int x = lane; x < p.D; x += 32) s += tm__ld(o + x) * tm__ld(go + x);
    for (int w = 16; w > 0; w >>= 1) s += __shfl_xor_sync(0xffffffffu, s, w);
    if (lane == 0) {
        const int64_t h = row % p.Hq, i = (row / p.Hq) % p.Tq, b = row / ((int64_t)p.Hq * p.Tq);
        p.delta[(b * p.Hq + h) * p.Tq + i] = s;
    }
}

/* dq += scale dS K: one block per (b, h, 64 query rows), keys in tiles of 64 in order. */
template <int D>
__global__ void __launch_bounds__(FA_THREADS) fa_backward_dq_kernel(fa_params p) {
    extern __shared__ __align__(16) unsigned char fa_smem[];
    constexpr int LD = D + FA_PAD, KD = D / 16, ND = D / 8;
    tm__bf16 *qs = (tm__bf16 *)fa_smem;    /* (FA_BM, LD) */
    tm__bf16 *dos = qs + FA_BM * LD;       /* (FA_BM, LD) */
    tm__bf16 *ks = dos + FA_BM * LD;       /* 2 x (FA_BN, LD) */
    tm__bf16 *vs = ks + 2 * FA_BN * LD;    /* 2 x (FA_BN, LD) */
    const int qb = p.nqb - 1 - (int)(blockIdx.x % (unsigned)p.nqb);
    const int bh = (int)(blockIdx.x / (unsigned)p.nqb), h = bh % p.Hq, b = bh / p.Hq, hk = h / p.G;
    const int q0 = qb * FA_BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int i0 = q0 + warp * 16 + g, i1 = i0 + 8;
    const int64_t qoff = ((int64_t)b * p.Tq + q0) * p.qs + (int64_t)h * D;
    const tm__bf16 *kg = p.k + (int64_t)b * p.Tk * p.ks + (int64_t)hk * D;
    const tm__bf16 *vg = p.v + (int64_t)b * p.Tk * p.ks + (int64_t)hk * D;
    const int kend = fa_imin(p.Tk, fa_imin(q0 + FA_BM, p.Tq) - 1 + p.off + 1);
    const int ntiles = (kend + FA_BN - 1) / FA_BN;

    fa_load_rows<D, FA_BM>(qs, p.q + qoff, p.qs, p.Tq - q0);
    fa_load_rows<D, FA_BM>(dos, p.dout + qoff, p.qs, p.Tq - q0);
    fa_load_rows<D, FA_BN>(ks, kg, p.ks, p.Tk);
    fa_load_rows<D, FA_BN>(vs, vg, p.ks, p.Tk);
    fa_commit();

    const int64_t lrow = ((int64_t)b * p.Hq + h) * p.Tq;
    const float lse0 = i0 < p.Tq ? p.lse[lrow + i0] * FA_LOG2E : 0.0f, lse1 = i1 < p.Tq ? p.lse[lrow + i1] * FA_LOG2E : 0.0f;
    const float dl0 = i0 < p.Tq ? p.delta[lrow + i0] : 0.0f, dl1 = i1 < p.Tq ? p.delta[lrow + i1] : 0.0f;
    float acc[ND][4];
#pragma unroll
    for (int x = 0; x < ND; x++) acc[x][0] = acc[x][1] = acc[x][2] = acc[x][3] = 0.0f;

    for (int t = 0; t < ntiles; t++) {
        const int buf = t & 1, j0 = t * FA_BN;
        if (t + 1 < ntiles) {
            const int j1 = j0 + FA_BN;
            fa_load_rows<D, FA_BN>(ks + (buf ^ 1) * FA_BN * LD, kg + (int64_t)j1 * p.ks, p.ks, p.Tk - j1);
            fa_load_rows<D, FA_BN>(vs + (buf ^ 1) * FA_BN * LD, vg + (int64_t)j1 * p.ks, p.ks, p.Tk - j1);
            fa_commit();
            fa_wait<1>();
        } else {
            fa_wait<0>();
        }
        __syncthreads();
        const tm__bf16 *kt = ks + buf * FA_BN * LD, *vt = vs + buf * FA_BN * LD;

        /* S = Q K^T and dP = dO V^T, keys j0 + 8n .. + 7 in s[n], dp[n] */
        float s[8][4], dp[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KD; kk++) {
            uint32_t a[4], c[4];
            fa_ldsm4(a, qs + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
            fa_ldsm4(c, dos + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < 4; np++) {
                const int off = (np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8;
                uint32_t r[4];
                fa_ldsm4(r, kt + off);
                fa_mma(s[2 * np], a, r[0], r[1]);
                fa_mma(s[2 * np + 1], a, r[2], r[3]);
                fa_ldsm4(r, vt + off);
                fa_mma(dp[2 * np], c, r[0], r[1]);
                fa_mma(dp[2 * np + 1], c, r[2], r[3]);
            }
        }
        /* P = exp(s - lse), dS = P (dP - Delta), in s */
        const bool diag = j0 + FA_BN - 1 > q0 + p.off;
#pragma unroll
        for (int n = 0; n < 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float pr = exp2f(s[n][e] * p.scale_log2 - (e < 2 ? lse0 : lse1));
                if (diag && j0 + n * 8 + t4 * 2 + (e & 1) > (e < 2 ? i0 : i1) + p.off) pr = 0.0f;
                s[n][e] = pr * (dp[n][e] - (e < 2 ? dl0 : dl1));
            }
        }
        /* dQ += dS K: K as the (key, d) B operand, transposed from its (key, d) rows */
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const uint32_t a[4] = {fa_pack(s[2 * kk][0], s[2 * kk][1]), fa_pack(s[2 * kk][2], s[2 * kk][3]),
                                   fa_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]), fa_pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dd = 0; dd < KD; dd++) {
                uint32_t r[4];
                fa_ldsm4t(r, kt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dd * 16 + (lane >> 4) * 8);
                fa_mma(acc[2 * dd], a, r[0], r[1]);
                fa_mma(acc[2 * dd + 1], a, r[2], r[3]);
            }
        }
        __syncthreads();
    }

    if (i0 < p.Tq) {
        tm__bf16 *row = p.dq + ((int64_t)b * p.Tq + i0) * p.qs + (int64_t)h * D + t4 * 2;
#pragma unroll
        for (int x = 0; x < ND; x++) fa_add2(row + x * 8, p.scale * acc[x][0], p.scale * acc[x][1]);
    }
    if (i1 < p.Tq) {
        tm__bf16 *row = p.dq + ((int64_t)b * p.Tq + i1) * p.qs + (int64_t)h * D + t4 * 2;
#pragma unroll
        for (int x = 0; x < ND; x++) fa_add2(row + x * 8, p.scale * acc[x][2], p.scale * acc[x][3]);
    }
}

/* The query block `it` of a dk/dv block (the G heads of its kv head in order, each from its
 * first query block qstart on): q, dO rows and their lse, Delta into buffer bf. */
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
        fa_cp4(ls + x, ok ? p.lse + lrow + x : p.lse + lrow, ok ? 4 : 0);
    } else if (x < 2 * BQ) {
        const bool ok = i0 + (x - BQ) < p.Tq;
        fa_cp4(dls + (x - BQ), ok ? p.delta + lrow + (x - BQ) : p.delta + lrow, ok ? 4 : 0);
    }
}

/* dk += scale dS^T Q, dv += P^T dO: one block per (b, kv head, 64 keys), 16 keys per warp; the
 * G query heads of the kv head in order, each over its query blocks in order. */
template <int D, int BQ>
__global__ void __launch_bounds__(FA_THREADS) fa_backward_dkv_kernel(fa_params p) {
    static_assert(2 * BQ <= FA_THREADS && BQ % 16 == 0, "lse and Delta take one thread per row");
    extern __shared__ __align__(16) unsigned char fa_smem[];
    constexpr int LD = D + FA_PAD, KD = D / 16, ND = D / 8, NQ = BQ / 8;
    tm__bf16 *ks = (tm__bf16 *)fa_smem;    /* (FA_BN, LD) */
    tm__bf16 *vs = ks + FA_BN * LD;        /* (FA_BN, LD) */
    tm__bf16 *qs = vs + FA_BN * LD;        /* 2 x (BQ, LD) */
    tm__bf16 *dos = qs + 2 * BQ * LD;      /* 2 x (BQ, LD) */
    float *ls = (float *)(dos + 2 * BQ * LD); /* 2 x BQ */
    float *dls = ls + 2 * BQ;              /* 2 x BQ */
    /* The first key blocks are seen by the most queries: they start first. */
    const int kb = (int)(blockIdx.x % (unsigned)p.nkb);
    const int bh = (int)(blockIdx.x / (unsigned)p.nkb), hk = bh % p.Hkv, b = bh / p.Hkv;
    const int j0 = kb * FA_BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int jr0 = j0 + warp * 16 + g, jr1 = jr0 + 8; /* this thread's two keys */
    /* query rows i >= j0 - off see some key of the block; j0 < Tk makes qstart < Tq */
    const int qstart = j0 - p.off > 0 ? (j0 - p.off) / BQ * BQ : 0;
    const int nqblk = (p.Tq - qstart + BQ - 1) / BQ, nit = p.G * nqblk;
    const int64_t koff = ((int64_t)b * p.Tk + j0) * p.ks + (int64_t)hk * D;

    fa_load_rows<D, FA_BN>(ks, p.k + koff, p.ks, p.Tk - j0);
    fa_load_rows<D, FA_BN>(vs, p.v + koff, p.ks, p.Tk - j0);
    fa_dkv_load<D, BQ>(p, qs, dos, ls, dls, b, hk, qstart, nqblk, 0);
    fa_commit();

    float dk[ND][4], dv[ND][4];
#pragma unroll
    for (int x = 0; x < ND; x++) dk[x][0] = dk[x][1] = dk[x][2] = dk[x][3] = dv[x][0] = dv[x][1] = dv[x][2] = dv[x][3] = 0.0f;

    for (int it = 0; it < nit; it++) {
        const int buf = it & 1;
        if (it + 1 < nit) {
            fa_dkv_load<D, BQ>(p, qs + (buf ^ 1) * BQ * LD, dos + (buf ^ 1) * BQ * LD, ls + (buf ^ 1) * BQ,
                               dls + (buf ^ 1) * BQ, b, hk, qstart, nqblk, it + 1);
            fa_commit();
            fa_wait<1>();
        } else {
            fa_wait<0>();
        }
        __syncthreads();
        const int i0 = qstart + (it % nqblk) * BQ;
        const tm__bf16 *qt = qs + buf * BQ * LD, *ot = dos + buf * BQ * LD;
        const float *lt = ls + buf * BQ, *dt = dls + buf * BQ;

        /* S^T = K Q^T and dP^T = V dO^T: (16 keys, BQ queries) per warp, queries i0 + 8n .. + 7 in s[n] */
        float s[NQ][4], dp[NQ][4];
#pragma unroll
        for (int n = 0; n < NQ; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KD; kk++) {
            uint32_t a[4], c[4];
            fa_ldsm4(a, ks + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
            fa_ldsm4(c, vs + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < BQ / 16; np++) {
                const int off = (np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8;
                uint32_t r[4];
                fa_ldsm4(r, qt + off);
                fa_mma(s[2 * np], a, r[0], r[1]);
                fa_mma(s[2 * np + 1], a, r[2], r[3]);
                fa_ldsm4(r, ot + off);
                fa_mma(dp[2 * np], c, r[0], r[1]);
                fa_mma(dp[2 * np + 1], c, r[2], r[3]);
            }
        }
        /* P^T = exp(s - lse_i), dS^T = P^T (dP^T - Delta_i); zero where j > i + off and for rows
         * i >= Tq (zero-filled q, dO: harmless, but cleaner to drop) */
        const bool mask = j0 + FA_BN - 1 > i0 + p.off || i0 + BQ > p.Tq;
#pragma unroll
        for (int n = 0; n < NQ; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = n * 8 + t4 * 2 + (e & 1), i = i0 + c;
                float pr = exp2f(s[n][e] * p.scale_log2 - fa_lds(lt + c) * FA_LOG2E);
                if (mask && ((e < 2 ? jr0 : jr1) > i + p.off || i >= p.Tq)) pr = 0.0f;
                s[n][e] = pr;
                dp[n][e] = pr * (dp[n][e] - fa_lds(dt + c));
            }
        }
        /* dV += P^T dO, dK += dS^T Q: 16 queries per step, dO and Q as (query, d) B operands */
#pragma unroll
        for (int kq = 0; kq < BQ / 16; kq++) {
            const uint32_t pa[4] = {fa_pack(s[2 * kq][0], s[2 * kq][1]), fa_pack(s[2 * kq][2], s[2 * kq][3]),
                                    fa_pack(s[2 * kq + 1][0], s[2 * kq + 1][1]), fa_pack(s[2 * kq + 1][2], s[2 * kq + 1][3])};
            const uint32_t da[4] = {fa_pack(dp[2 * kq][0], dp[2 * kq][1]), fa_pack(dp[2 * kq][2], dp[2 * kq][3]),
                                    fa_pack(dp[2 * kq + 1][0], dp[2 * kq + 1][1]), fa_pack(dp[2 * kq + 1][2], dp[2 * kq + 1][3])};
#pragma unroll
            for (int dd = 0; dd < KD; dd++) {
                const int off = (kq * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dd * 16 + (lane >> 4) * 8;
                uint32_t r[4];
                fa_ldsm4t(r, ot + off);
                fa_mma(dv[2 * dd], pa, r[0], r[1]);
                fa_mma(dv[2 * dd + 1], pa, r[2], r[3]);
                fa_ldsm4t(r, qt + off);
                fa_mma(dk[2 * dd], da, r[0], r[1]);
                fa_mma(dk[2 * dd + 1], da, r[2], r[3]);
            }
        }
        __syncthreads();
    }

    /* dk and dv of an element have the same owner thread; when they are one buffer (k passed as
     * v), it adds their sum, rounded once. */
    const bool one = p.dk == p.dv;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int j = half ? jr1 : jr0;
        if (j >= p.Tk) continue;
        const int64_t ro = ((int64_t)b * p.Tk + j) * p.ks + (int64_t)hk * D + t4 * 2;
#pragma unroll
        for (int x = 0; x < ND; x++) {
            const float k0 = p.scale * dk[x][2 * half], k1 = p.scale * dk[x][2 * half + 1];
            const float v0 = dv[x][2 * half], v1 = dv[x][2 * half + 1];
            if (one) {
                fa_add2(p.dk + ro + x * 8, k0 + v0, k1 + v1);
            } else {
                if (p.dk) fa_add2(p.dk + ro + x * 8, k0, k1);
                if (p.dv) fa_add2(p.dv + ro + x * 8, v0, v1);
            }
        }
    }
}

/* ==== end of tensor-core path ===================================================================== */

/* ---- entry points ------------------------------------------------------------------------------- */

/* The tensor-core kernels take bf16 with D = 64 or 128, every tensor they touch 16-byte aligned
 * (cp.async moves 16-byte chunks; rows are 128 or 256 bytes), and sizes whose block counts and
 * positions fit in int. Anything else takes the kernels above. The backward may choose its path
 * independently of the forward: both save the same lse. */
static int fa_usable(const tm__call *c, const attn_dims *d, int backward) {
    if (c->in[0]->dtype != TM_BF16 || (d->D != 64 && d->D != 128)) return 0;
    if (d->Tk > (1 << 30) || d->B * d->Hq > (1 << 30) || d->B * d->Hkv > (1 << 30)) return 0;
    const int64_t nqb = (d->Tq + FA_BM - 1) / FA_BM, nkb = (d->Tk + FA_BN - 1) / FA_BN;
    if (nqb * d->B * d->Hq > INT32_MAX || nkb * d->B * d->Hkv > INT32_MAX || d->B * d->Tq * d->Hq / 4 >= INT32_MAX)
        return 0;
    const tm_tensor *t[8] = {c->in[0], c->in[1], c->in[2], c->out[0], NULL, NULL, NULL, NULL};
    if (backward) t[4] = c->gout[0], t[5] = c->gin[0], t[6] = c->gin[1], t[7] = c->gin[2];
    for (int i = 0; i < 8; i++)
        if (t[i] && ((uintptr_t)tm__data(t[i]) & 15) != 0) return 0;
    return backward ? c->out[0] != NULL : 1;
}

static fa_params fa_params_of(const tm__call *c, const attn_dims *d) {
    fa_params p = fa_params_make(d->B, d->Tq, d->Tk, d->Hq, d->Hkv, d->D, d->scale);
    p.q = (const tm__bf16 *)tm__data(c->in[0]);
    p.k = (const tm__bf16 *)tm__data(c->in[1]);
    p.v = (const tm__bf16 *)tm__data(c->in[2]);
    return p;
}

/* Kernels that take more than 48 KiB of dynamic shared memory must say so before launch. */
template <typename K> static tm_status fa_smem_optin(tm_ctx *ctx, K kernel, size_t bytes) {
    if (bytes > 48 * 1024)
        TM__CU_CHECK(ctx, "attention", cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    return TM_OK;
}

template <int D> static tm_status fa_forward(tm__call *c, tm__cuda *st, const attn_dims *d, float *lse) {
    fa_params p = fa_params_of(c, d);
    p.out = (tm__bf16 *)tm__data(c->out[0]);
    p.lse = lse;
    const size_t sm = fa_smem_fwd(D);
    TM__TRY(fa_smem_optin(c->ctx, fa_forward_kernel<D>, sm));
    fa_forward_kernel<D><<<(unsigned)fa_grid_q(&p), FA_THREADS, sm, st->stream>>>(p);
    TM__CU_LAUNCHED(c->ctx, "attention", "fa_forward_kernel");
    return TM_OK;
}

template <int D> static tm_status fa_backward(tm__call *c, tm__cuda *st, const attn_dims *d) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *dq = c->gin[0], *dk = c->gin[1], *dv = c->gin[2];
    fa_params p = fa_params_of(c, d);
    p.o = (const tm__bf16 *)tm__data(c->out[0]);
    p.dout = (const tm__bf16 *)tm__data(c->gout[0]);
    p.lse = (float *)tm__data(c->saved[0]);
    p.dq = dq ? (tm__bf16 *)tm__data(dq) : NULL;
    p.dk = dk ? (tm__bf16 *)tm__data(dk) : NULL;
    p.dv = dv ? (tm__bf16 *)tm__data(dv) : NULL;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)d->B * d->Hq * d->Tq * sizeof(float), (void **)&p.delta));
    fa_delta_kernel<<<(unsigned)fa_grid_delta(&p), FA_THREADS, 0, st->stream>>>(p);
    TM__CU_LAUNCHED(ctx, "attention", "fa_delta_kernel");
    if (dq) {
        const size_t sm = fa_smem_dq(D);
        TM__TRY(fa_smem_optin(ctx, fa_backward_dq_kernel<D>, sm));
        fa_backward_dq_kernel<D><<<(unsigned)fa_grid_q(&p), FA_THREADS, sm, st->stream>>>(p);
        TM__CU_LAUNCHED(ctx, "attention", "fa_backward_dq_kernel");
    }
    if (dk || dv) {
        constexpr int BQ = fa_cfg<D>::BQ;
        const size_t sm = fa_smem_dkv(D, BQ);
        TM__TRY(fa_smem_optin(ctx, fa_backward_dkv_kernel<D, BQ>, sm));
        fa_backward_dkv_kernel<D, BQ><<<(unsigned)fa_grid_kv(&p), FA_THREADS, sm, st->stream>>>(p);
        TM__CU_LAUNCHED(ctx, "attention", "fa_backward_dkv_kernel");
    }
    return TM_OK;
}

/* The kernels keep up to 4 rows of D floats in shared memory: refuse a D that does not fit
 * the default 48 KiB (D > 3000 or so, far beyond any head size in use). The backward runs on
 * the shapes the forward accepted. */
static tm_status check_limits(tm__call *c, const attn_dims *d) {
    if (att_smem(4, d->D) > 48 * 1024)
        return tm__err(c->ctx, TM_ERR_UNSUPPORTED, "attention: the CUDA kernels take head dims up to %d, got q %s",
                       (int)((48 * 1024 / sizeof(float) - 2 * ATT_TILE) / 4), tm__tdesc(c->ctx, c->in[0]));
    /* One block per query row and per key row. */
    if (d->B * d->Hq * d->Tq > INT32_MAX || d->B * d->Hkv * d->Tk > INT32_MAX)
        return tm__err(c->ctx, TM_ERR_UNSUPPORTED, "attention: the CUDA kernels take < 2^31 rows, got q %s, k %s",
                       tm__tdesc(c->ctx, c->in[0]), tm__tdesc(c->ctx, c->in[1]));
    return TM_OK;
}

extern "C" tm_status tm__attention_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "attention", &st));
    const attn_dims d = attn_dims_of(c);
    TM__TRY(check_limits(c, &d));
    tm_tensor *lse;
    const int64_t lse_shape[3] = {d.B, d.Hq, d.Tq};
    TM__TRY(tm__saved_new(c, TM_F32, 3, lse_shape, &lse));
    const int64_t rows = d.B * d.Hq * d.Tq;
    if (rows == 0) return TM_OK;
    if (fa_usable(c, &d, 0))
        return d.D == 64 ? fa_forward<64>(c, st, &d, (float *)tm__data(lse)) : fa_forward<128>(c, st, &d, (float *)tm__data(lse));
    TM__CU_LAUNCH_FLOAT(c->in[0]->dtype, attn_forward_kernel, (unsigned)rows, ATT_THREADS, att_smem(2, d.D),
                        st->stream, tm__data(c->out[0]), (float *)tm__data(lse), tm__data(c->in[0]),
                        tm__data(c->in[1]), tm__data(c->in[2]), d);
    TM__CU_LAUNCHED(ctx, "attention", "attn_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__attention_backward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *dq = c->gin[0], *dk = c->gin[1], *dv = c->gin[2];
    if (!dq && !dk && !dv) return TM_OK;
    const attn_dims d = attn_dims_of(c);
    const int64_t rows = d.B * d.Hq * d.Tq, krows = d.B * d.Hkv * d.Tk;
    if (rows == 0) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "attention", &st));
    if (fa_usable(c, &d, 1)) return d.D == 64 ? fa_backward<64>(c, st, &d) : fa_backward<128>(c, st, &d);
    const tm_dtype dt = c->in[0]->dtype;
    const void *q = tm__data(c->in[0]), *k = tm__data(c->in[1]), *v = tm__data(c->in[2]);
    const void *dout = tm__data(c->gout[0]);
    const float *lse = (const float *)tm__data(c->saved[0]);
    float *delta;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)rows * sizeof(float), (void **)&delta));
    if (dq || dk) {
        TM__CU_LAUNCH_FLOAT(dt, attn_backward_q_kernel, (unsigned)rows, ATT_THREADS, att_smem(3, d.D), st->stream,
                            dq ? tm__data(dq) : NULL, delta, q, k, v, dout, lse, d);
        TM__CU_LAUNCHED(ctx, "attention", "attn_backward_q_kernel");
    }
    if (dk || dv) {
        TM__CU_LAUNCH_FLOAT(dt, attn_backward_kv_kernel, (unsigned)krows, ATT_THREADS, att_smem(4, d.D), st->stream,
                            dk ? tm__data(dk) : NULL, dv ? tm__data(dv) : NULL, q, k, v, dout, lse, delta, d);
        TM__CU_LAUNCHED(ctx, "attention", "attn_backward_kv_kernel");
    }
    return TM_OK;
}
