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
 *   out[0]   o    (B, Tq, Hq, D)
 *   saved[0] lse  (B, Hq, Tq) f32     logsumexp of the scaled, masked scores of each query row
 *                                     (f32 here for f32 and bf16 q; the CPU saves it in q's dtype:
 *                                     each backend reads only what its own forward saved)
 * Query i sees keys j < n_i = i + (Tk - Tq) + 1 (the queries are the last Tq of Tk positions).
 * s_ij = scale q_i . k_j.
 *
 * Forward: one block per query row (b, h, i). Keys come in tiles of ATT_TILE; each warp takes
 * keys of the tile and reduces its dot products over D with a butterfly; the tile's scores
 * update the running max m, sum l and the unnormalised output acc (online softmax):
 *   m' = max(m, max_j s_ij), acc = acc e^(m - m') + sum_j e^(s_ij - m') v_j, likewise l;
 *   o_i = acc / l, lse_i = m + log l.
 * Backward (after FlashAttention-2, Dao 2023), with dP_ij = dO_i . v_j,
 * Delta_i = sum_j P_ij dP_ij (from the row itself, as on the CPU: no O needed) and
 * dS_ij = P_ij (dP_ij - Delta_i):
 *   dq_i += scale sum_j dS_ij k_j          one block per query row, which also writes Delta_i
 *   dk_j += scale sum_(h, i) dS_ij q_i     one block per key row (b, kv head, j): sums over the
 *   dv_j += sum_(h, i) P_ij dO_i           G query heads of the kv head, then rows i >= j - (Tk - Tq)
 * Every block owns the rows it writes and adds its terms in a fixed order (tiles in order, the
 * terms of a tile in order, dot products by a fixed butterfly), so no atomics are needed and
 * the results are bitwise reproducible. All arithmetic is f32 (bf16 loaded and rounded on
 * store); the CPU's f32 kernel sums in another order, which is what the parity tolerance covers.
 * Work is O(B Hq Tq Tk D) in each direction, without tensor cores: correct and simple first;
 * speed is a later concern.
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

/* ---- entry points ------------------------------------------------------------------------------- */

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
