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
 *    On an sm_90 GPU (and a build with the sm_90a image) the forward, dQ and dK/dV products run on
 *    wgmma instead: attention_sm90.cu (fa90_use; its top comment has the design). Delta and
 *    everything below (the math, tie rules, one writer per gradient row) are the same; the rest
 *    of this paragraph describes the sm_80 kernels, which stay the path elsewhere and the Hopper
 *    kernels' parity reference (tests/test_cuda_parity_attention.c runs both on one GPU).
 *    The sm_80 kernels:
 *    the kernels live in attention_tc.cuh, templated on D and the tile shapes, fa_cfg<D> picks them.
 *    Warps multiply 16x16 by 16x8 bf16 tiles with mma.sync.m16n8k16 into f32 accumulators; tiles
 *    travel global -> shared with cp.async (double-buffered: the next tile loads while this one is
 *    used) and shared -> registers with ldmatrix (.trans where the operand is needed transposed).
 *    Shared rows are padded to D + 8 bf16 so the 8 rows of an ldmatrix hit distinct banks. Rows
 *    past Tq or Tk are zero-filled by cp.async, never read from memory. Blocks of 4 warps; a warp
 *    owns MT m16 tiles of rows (query rows in the forward and dq, keys in dk/dv), so each operand
 *    fragment loaded from shared memory feeds 2 MT mma (MT = 1 fed only two: the issue rate of
 *    ldmatrix, not the tensor pipe, bounded the first version). Blocks start in order of their
 *    work, longest first over all heads (the last query blocks, the first key blocks), so the
 *    causal triangle's short blocks fill the tail. A warp skips the tiles none of its rows sees.
 *    Forward (fa_forward_kernel, FlashAttention-2): one block per (b, h, 64 MT query rows), K, V
 *      in tiles of BN keys up to the block's last visible key. Per tile: S = Q K^T (Q's fragments
 *      stay in registers at D 64), online softmax in f32 registers in log2 units with the scale
 *      folded into the exponent's FFMA (P = 2^(s scale log2 e - m)); the accumulators of S are
 *      already the A fragments of P, rounded to bf16 for O += P V 16 keys at a time. The running
 *      max m moves only when a row's tile max passes it by more than FA_RESCALE = 8 (log2 units),
 *      so O and l are rescaled on few tiles instead of every one (FlashAttention-4's conditional
 *      rescaling; P stays below 2^8, exact after o = acc / l). lse_i = (m + log2 l) ln 2. The
 *      causal mask is applied only on tiles that cross a row's limit (they include every tile
 *      with keys past Tk).
 *    Backward, three kernels:
 *      fa_delta_kernel         Delta_i = dO_i . o_i (bf16 o: FlashAttention-2's choice), D / 8
 *                              lanes per row with 16-byte loads.
 *      fa_backward_dq_kernel   one block per (b, h, 64 QMT query rows): over the key tiles (QBN)
 *                              in order, S = Q K^T, dP = dO V^T, P = 2^(s' - lse_i log2 e), dS in
 *                              bf16, dQ += dS K.
 *      fa_backward_dkv_kernel  one block per (b, kv head, 64 KMT keys), 16 KMT keys per warp: over
 *                              the G query heads in order, each over its query blocks (BQ rows)
 *                              in order from the first that sees the block's keys: S^T = K Q^T,
 *                              dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, all in registers.
 *    The dq kernel recomputes S and dP (7 matrix products for the backward where
 *    FlashAttention-2 does 5 and adds dQ from the dk/dv blocks with atomics): the price of every
 *    gradient row having one writer, which the deterministic contract below needs.
 *    Tiles (fa_cfg, the fastest of the variants timed on an H100): D 64: forward MT 2, BN 64;
 *    dq QMT 2, QBN 64; dk/dv KMT 2, BQ 32. D 128: forward MT 2, BN 64; dq QMT 2, QBN 32; dk/dv
 *    KMT 1, BQ 64 (at D 128 the dk, dv accumulators of 32 keys would need 256 registers a thread).
 *    Shared memory per block: (rows held) x (D + 8) x 2 bytes, e.g. D 128 forward (128 + 4 x 64)
 *    rows = 102 KiB, dk/dv (2 x 64 + 4 x 64) rows + lse, Delta = 103 KiB; above 48 KiB the kernels
 *    opt in with cudaFuncSetAttribute. Registers (ptxas, CUDA 13), D 64 / D 128: forward 239 / 255
 *    (sm_80: 230 / 255), dq 255 / 255, dk/dv 255 / 255, Delta 30: 2 blocks of 4 warps per SM, the
 *    register file being the limit. ptxas spills 8-72 bytes a thread in dq, dk/dv and the D 128
 *    forward (the stack stays in L1); the spill-free shapes (dq QMT 1 at D 64, BN 32 for the D 128
 *    forward, dk/dv KMT 1 at D 64) timed 3-7% slower on the H100.
 *    Precision: P and dS are rounded to bf16 as mma operands and Delta comes from the bf16 o, where
 *    the f32 kernels and the CPU keep them in f32; exponentials by ex2.approx (2 ulp, flushing
 *    results below 2^-126 to zero); tests/test_cuda_parity_attention.c states the tolerance this
 *    needs.
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
 * gradient buffer) is right too. That single store per element is also why a fresh dq / dk / dv
 * (call->gin_fresh, TM__OP_GRAD_WRITES; attn_dims.fq / fk / fv, fa_params likewise) costs
 * nothing: the store writes 0 + the sum instead of reading the gradient.
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
    int fq, fk, fv; /* backward: dq / dk / dv is fresh (call->gin_fresh): stored, not read */
} attn_dims;

static attn_dims attn_dims_of(const tm__call *c) {
    const tm_tensor *q = c->in[0], *k = c->in[1];
    attn_dims d;
    d.B = q->shape[0], d.Tq = q->shape[1], d.Hq = q->shape[2], d.D = q->shape[3];
    d.Tk = k->shape[1], d.Hkv = k->shape[2];
    d.G = d.Hq / d.Hkv;
    d.off = d.Tk - d.Tq;
    d.scale = (float)(c->fattr[0] > 0.0 ? c->fattr[0] : 1.0 / sqrt((double)d.D));
    d.fq = c->gin[0] && c->gin_fresh[0], d.fk = c->gin[1] && c->gin_fresh[1], d.fv = c->gin[2] && c->gin_fresh[2];
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
    for (int64_t x = threadIdx.x; x < D; x += blockDim.x) tm__st(dq + x, (d.fq ? 0.0f : tm__ld(dq + x)) + d.scale * dqa[x]);
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
        if (dk_) tm__st((T *)dk_ + ko + x, (d.fk ? 0.0f : tm__ld((const T *)dk_ + ko + x)) + d.scale * dka[x]);
        if (dv_) tm__st((T *)dv_ + ko + x, (d.fv ? 0.0f : tm__ld((const T *)dv_ + ko + x)) + dva[x]);
    }
}

/* ==== tensor-core path: bf16, D = 64 or 128 (kernels in attention_tc.cuh) ========================= */

#include "attention_tc.cuh"
#include "attention_sm90.h"

/* ---- entry points ------------------------------------------------------------------------------- */

/* The tensor-core kernels take bf16 with D = 64 or 128, every tensor they touch 16-byte aligned
 * (cp.async moves 16-byte chunks; rows are 128 or 256 bytes), and sizes whose block counts and
 * positions fit in int. Anything else takes the kernels above. The backward may choose its path
 * independently of the forward: both save the same lse. */
static int fa_usable(const tm__call *c, const attn_dims *d, int backward) {
    if (c->in[0]->dtype != TM_BF16 || (d->D != 64 && d->D != 128)) return 0;
    if (d->Tk > (1 << 30) || d->B * d->Hq > (1 << 30) || d->B * d->Hkv > (1 << 30)) return 0;
    /* the smallest blocks launched: 64 query rows, 64 keys, 8 rows of o */
    const int64_t nqb = (d->Tq + 63) / 64, nkb = (d->Tk + 63) / 64;
    if (nqb * d->B * d->Hq > INT32_MAX || nkb * d->B * d->Hkv > INT32_MAX || d->B * d->Tq * d->Hq / 8 >= INT32_MAX)
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

/* The Hopper kernels (attention_sm90.cu) on an sm_90 device whose build holds their sm_90a image,
 * unless the context asked for the sm_80 ones (tm__attn_set_sm80: the tests). */
static int fa90_use(tm_ctx *ctx, tm__cuda *st) {
    if (tm__attn_sm80(ctx)) return 0;
    if (!st->fa90) {
        char why[256];
        st->fa90 = tm__fa90_supported(why, sizeof why) ? 1 : 2;
    }
    return st->fa90 == 1;
}

static tm__fa90_args fa90_args_of(const tm__call *c, const attn_dims *d) {
    tm__fa90_args a;
    memset(&a, 0, sizeof a);
    a.q = tm__data(c->in[0]), a.k = tm__data(c->in[1]), a.v = tm__data(c->in[2]);
    a.B = (int)d->B, a.Tq = (int)d->Tq, a.Tk = (int)d->Tk, a.Hq = (int)d->Hq, a.Hkv = (int)d->Hkv, a.D = (int)d->D;
    a.scale = d->scale;
    return a;
}

template <int D> static tm_status fa_forward(tm__call *c, tm__cuda *st, const attn_dims *d, float *lse) {
    typedef fa_cfg<D> C;
    if (fa90_use(c->ctx, st)) {
        tm__fa90_args a = fa90_args_of(c, d);
        a.out = tm__data(c->out[0]), a.lse = lse;
        char why[256];
        if (tm__fa90_forward(&a, st->stream, why, sizeof why)) return tm__err(c->ctx, TM_ERR_CUDA, "attention: %s", why);
        tm__attn_sm90_count(c->ctx);
        return TM_OK;
    }
    fa_params p = fa_params_of(c, d);
    p.out = (tm__bf16 *)tm__data(c->out[0]);
    p.lse = lse;
    const size_t sm = fa_smem_fwd(D, 64 * C::MT, C::BN);
    TM__TRY(fa_smem_optin(c->ctx, fa_forward_kernel<D, C::MT, C::BN>, sm));
    fa_forward_kernel<D, C::MT, C::BN><<<(unsigned)fa_grid_q(&p, 64 * C::MT), FA_THREADS, sm, st->stream>>>(p);
    TM__CU_LAUNCHED(c->ctx, "attention", "fa_forward_kernel");
    return TM_OK;
}

template <int D> static tm_status fa_backward(tm__call *c, tm__cuda *st, const attn_dims *d) {
    typedef fa_cfg<D> C;
    tm_ctx *ctx = c->ctx;
    tm_tensor *dq = c->gin[0], *dk = c->gin[1], *dv = c->gin[2];
    fa_params p = fa_params_of(c, d);
    p.o = (const tm__bf16 *)tm__data(c->out[0]);
    p.dout = (const tm__bf16 *)tm__data(c->gout[0]);
    p.lse = (float *)tm__data(c->saved[0]);
    p.dq = dq ? (tm__bf16 *)tm__data(dq) : NULL;
    p.dk = dk ? (tm__bf16 *)tm__data(dk) : NULL;
    p.dv = dv ? (tm__bf16 *)tm__data(dv) : NULL;
    p.fq = d->fq, p.fk = d->fk, p.fv = d->fv;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)d->B * d->Hq * d->Tq * sizeof(float), (void **)&p.delta));
    fa_delta_kernel<D><<<(unsigned)fa_grid_delta(&p), FA_THREADS, 0, st->stream>>>(p);
    TM__CU_LAUNCHED(ctx, "attention", "fa_delta_kernel");
    if (fa90_use(ctx, st)) {
        tm__fa90_args a = fa90_args_of(c, d);
        a.dout = p.dout, a.lse = p.lse, a.delta = p.delta;
        a.dq = p.dq, a.dk = p.dk, a.dv = p.dv, a.fq = p.fq, a.fk = p.fk, a.fv = p.fv;
        char why[256];
        if (tm__fa90_backward(&a, st->stream, why, sizeof why)) return tm__err(ctx, TM_ERR_CUDA, "attention: %s", why);
        tm__attn_sm90_count(ctx);
        return TM_OK;
    }
    if (dq) {
        const size_t sm = fa_smem_dq(D, 64 * C::QMT, C::QBN);
        TM__TRY(fa_smem_optin(ctx, fa_backward_dq_kernel<D, C::QMT, C::QBN, C::QQR>, sm));
        fa_backward_dq_kernel<D, C::QMT, C::QBN, C::QQR>
            <<<(unsigned)fa_grid_q(&p, 64 * C::QMT), FA_THREADS, sm, st->stream>>>(p);
        TM__CU_LAUNCHED(ctx, "attention", "fa_backward_dq_kernel");
    }
    if (dk || dv) {
        const size_t sm = fa_smem_dkv(D, 64 * C::KMT, C::BQ);
        TM__TRY(fa_smem_optin(ctx, fa_backward_dkv_kernel<D, C::KMT, C::BQ, C::KKR>, sm));
        fa_backward_dkv_kernel<D, C::KMT, C::BQ, C::KKR>
            <<<(unsigned)fa_grid_kv(&p, 64 * C::KMT), FA_THREADS, sm, st->stream>>>(p);
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
    if (rows == 0) { /* no query: dk and dv are zeros (fresh ones get them) */
        TM__TRY(tm__gin_prepare(c, 1));
        return tm__gin_prepare(c, 2);
    }
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
