/*
 * moe_gating.cu — CUDA kernels of tm_moe_gating: the router's gating GEMM in f32.
 *
 * Layout (as kernels/cpu/moe_gating.c):
 *   in[0]    x       (T, H)   bf16 or f32
 *   in[1]    w       (H, E)   f32
 *   out[0]   logits  (T, E)   f32: logits = x @ w
 *   saved[0] xf      (T, H)   f32, cuBLASLt path with bf16 x only: x widened (exact), which dw reads
 * Backward: dx = dlogits @ w^T, dw += x^T @ dlogits (dx written when fresh, else added).
 *
 * Three paths, the same products of exactly widened inputs in f32:
 *   direct   bf16 x, f32 w, H a multiple of 8, x on a 16-byte boundary, E <= 8 (MG_DIRECT_MAX_E
 *            says why not more): the kernels below read bf16 x with 16-byte loads and never
 *            widen it in memory.
 *   split    bf16 x and f32 w otherwise (tm__gating_set_split turns it off; on by default since it
 *            made fine's step, E 64, 2.7% faster, 46.48 -> 45.23 ms on an H200). x is exactly bf16, so
 *            x @ w = x @ w_hi + x @ w_mid + x @ w_lo with w split into three bf16 terms (24
 *            mantissa bits), each product exact in f32: one cuBLASLt bf16 GEMM against
 *            [w_hi | w_mid | w_lo] into f32, then the three column blocks summed (small first).
 *            dw likewise with dlogits split; dx, both operands f32, as one bf16 GEMM over K = 6E
 *            (the six products of the splits above 2^-24), rounded once into bf16 dx by the
 *            GEMM. Tensor cores instead of the CUDA cores' f32 FMAs, where E > 8 makes the
 *            products FMA-bound (MG_DIRECT_MAX_E).
 *   cuBLASLt anything else (f32 x; odd H; more experts without the split): cuBLASLt's true f32 GEMM
 *            (no TF32: tm__gemm_cuda) on x, or on an f32 copy of bf16 x kept for dw.
 *
 * Why the direct path: E is 8 to 64, so each GEMM is a thin one (T x H x E, H x E x T); cuBLASLt's
 * f32 kernels on the widened copy cost about 150 us a layer at the coarse preset (the cast's
 * write and read of an f32 (T, H) copy, then three f32 GEMMs with 32-wide tiles), for products
 * whose inputs are 25 MB. A first direct version (commit 8ecc57e) lost to that: it loaded its tiles
 * by 2-byte loads a few at a time between barriers, with 4 to 12 warps an SM, so every tile waited
 * out the memory's latency. These kernels load each tile by 16-byte loads (one or a few per
 * thread, all issued before the barrier), keep 256 threads a block and a small shared-memory
 * footprint so that several blocks share an SM (one block's loads overlap another's FMAs), and
 * give each thread a register tile (outputs x reduction steps), the register tiling of an SGEMM:
 *   forward  logits (T, E): block TB tokens x ET experts (tiles of ET over grid.y); h in stages
 *            of 64 through a 4-deep cp.async ring (x (TB, 64) bf16, rows padded to 144 bytes so
 *            that a column reads conflict-free; w (64, ET) f32); a thread RT tokens x RE experts.
 *   dx       (T, H): block 32 tokens x 256 h; e in chunks of 8: dlogits (32, 8) and w^T
 *            (8, 256) in shared memory; a thread 4 tokens x 8 consecutive h, stored as one
 *            16-byte bf16 row piece (added in f32 to what dx holds and rounded once, or written).
 *   dw       (H, E): the sum over T split into fixed chunks of 256 tokens (not by the GPU's size:
 *            the same bits on every device); block HB h x ET e of one chunk, tokens in stages of
 *            32 through a 3-deep cp.async ring; a thread RH h x RE e; each chunk's partial sums
 *            go to scratch, and a second kernel adds the chunks in order into dw.
 * Every sum runs in a fixed order (over h, e or chunks ascending, each thread's own FMA chain), so
 * results are the same bits run to run; not cuBLASLt's bits (its order differs).
 */
#include "common.cuh"
#include "mma.cuh"
#include "vec.cuh"

#define MG_THREADS 256
#define MG_ST 4       /* forward: cp.async stages */
#define MG_HC 64      /* forward: h per stage */
#define MG_EC 8       /* dx: e per chunk (the direct path's E at most: one chunk) */
#define MG_DST 3      /* dw: cp.async stages */
#define MG_TS 32      /* dw: tokens per stage */
#define MG_TCHUNK 256 /* dw: tokens per partial sum */
/* The direct path's experts at most. With more, the products are bound by the CUDA cores' f32 FMA
 * rate (3 T H E FMAs a layer: 3.2 G at the fine preset, >= 108 us at an H200's peak), where
 * cuBLASLt's SIMT GEMMs come closer to the peak than these kernels; one training A/B at fine (E 64)
 * gave no gain. The way past that is the tensor cores: the split path below (off by default until
 * measured). */
#define MG_DIRECT_MAX_E 8

/* Rows [r0, r0 + R) of a bf16 (rows, ld) matrix, columns [c0, c0 + C) (C a multiple of 8), into
 * shared memory at d with row stride DS elements, by cp.async of 16 bytes; rows >= rows_end and
 * columns >= cols_end (a multiple of 8) are zero-filled. */
template <int R, int C, int DS>
__device__ __forceinline__ void mg_tile_bf16(tm__bf16 *d, const tm__bf16 *g, int64_t ld, int r0, int rows_end, int c0,
                                             int cols_end) {
    for (int i = threadIdx.x; i < R * (C / 8); i += MG_THREADS) {
        const int r = i / (C / 8), c = (i % (C / 8)) * 8;
        const bool ok = r0 + r < rows_end && c0 + c < cols_end;
        tm__cp_async16(tm__smem_u32(d + r * DS + c), ok ? (const void *)(g + (int64_t)(r0 + r) * ld + c0 + c) : (const void *)g,
                       ok ? 16 : 0);
    }
}
/* The same for an f32 (rows, ld) matrix by 4-byte cp.async (ld need not be a multiple of 4). */
template <int R, int C>
__device__ __forceinline__ void mg_tile_f32(float *d, const float *g, int64_t ld, int r0, int rows_end, int c0, int cols_end) {
    for (int i = threadIdx.x; i < R * C; i += MG_THREADS) {
        const int r = i / C, c = i % C;
        const bool ok = r0 + r < rows_end && c0 + c < cols_end;
        tm__cp_async4(tm__smem_u32(d + r * C + c), ok ? (const void *)(g + (int64_t)(r0 + r) * ld + c0 + c) : (const void *)g,
                      ok ? 4 : 0);
    }
}

/* ---- forward: logits (T, E) = x (T, H) @ w (H, E) ------------------------------------------ */
/* ET experts a block (RE a thread, ET / RE threads across them), RT tokens a thread; h in stages
 * of MG_HC through an MG_ST-deep cp.async ring: x (TB, MG_HC) bf16 with rows padded to 144 bytes
 * (conflict-free reads down a column), w (MG_HC, ET) f32. */
template <int ET, int RE, int RT> struct mg_fwd {
    static constexpr int TXN = ET / RE, TYN = MG_THREADS / TXN, TB = TYN * RT, XS = MG_HC + 8;
    static constexpr size_t SMEM = (size_t)MG_ST * (TB * XS * 2 + MG_HC * ET * 4);
};
template <int ET, int RE, int RT>
__global__ void __launch_bounds__(MG_THREADS) mg_forward_kernel(const tm__bf16 *__restrict__ x, const float *__restrict__ w,
                                                               float *__restrict__ out, int T, int H, int E) {
    typedef mg_fwd<ET, RE, RT> C;
    extern __shared__ __align__(16) unsigned char mg_smem[];
    tm__bf16 *xs = (tm__bf16 *)mg_smem;                          // [MG_ST][TB][XS]
    float *ws = (float *)(mg_smem + MG_ST * C::TB * C::XS * 2); // [MG_ST][MG_HC][ET]
    const int tx = threadIdx.x % C::TXN, ty = threadIdx.x / C::TXN;
    const int t0 = blockIdx.x * C::TB, e0 = blockIdx.y * ET, nk = (H + MG_HC - 1) / MG_HC;
    auto load = [&](int k) { /* chunk k into stage k % MG_ST; a group is committed either way */
        if (k < nk) {
            const int s = k % MG_ST;
            mg_tile_bf16<C::TB, MG_HC, C::XS>(xs + s * C::TB * C::XS, x, H, t0, T, k * MG_HC, H);
            mg_tile_f32<MG_HC, ET>(ws + s * MG_HC * ET, w, E, k * MG_HC, H, e0, E);
        }
        tm__cp_async_commit();
    };
    float acc[RT][RE];
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int j = 0; j < RE; j++) acc[r][j] = 0.0f;
#pragma unroll
    for (int k = 0; k < MG_ST - 1; k++) load(k);
    for (int k = 0; k < nk; k++) {
        tm__cp_async_wait<MG_ST - 2>();
        __syncthreads(); /* stage k is in; stage (k - 1) % MG_ST is free for chunk k + MG_ST - 1 */
        load(k + MG_ST - 1);
        const tm__bf16 *xt = xs + (k % MG_ST) * C::TB * C::XS + ty * RT * C::XS;
        const float *wt = ws + (k % MG_ST) * MG_HC * ET + tx * RE;
#pragma unroll 8
        for (int hh = 0; hh < MG_HC; hh++) {
            float wv[RE];
#pragma unroll
            for (int j = 0; j < RE; j += 2) {
                const float2 v = *reinterpret_cast<const float2 *>(wt + hh * ET + j);
                wv[j] = v.x, wv[j + 1] = v.y;
            }
#pragma unroll
            for (int r = 0; r < RT; r++) {
                const float xv = __bfloat162float(xt[r * C::XS + hh]);
#pragma unroll
                for (int j = 0; j < RE; j++) acc[r][j] = fmaf(xv, wv[j], acc[r][j]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RT; r++) {
        const int t = t0 + ty * RT + r;
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < RE; j++) {
            const int e = e0 + tx * RE + j;
            if (e < E) out[(int64_t)t * E + e] = acc[r][j];
        }
    }
}

/* ---- dx (T, H) = g (T, E) @ w^T, bf16, written (fresh) or added in f32 and rounded once ------- */
#define MG_DX_TB 32
#define MG_DX_HB 256
__global__ void __launch_bounds__(MG_THREADS) mg_dx_kernel(const float *__restrict__ g, const float *__restrict__ w,
                                                          tm__bf16 *__restrict__ dx, int T, int H, int E, int fresh) {
    constexpr int RT = MG_DX_TB / (MG_THREADS / (MG_DX_HB / 8)); /* 4 tokens a thread */
    __shared__ float gs[MG_DX_TB][MG_EC + 1];                    // (32, 8) dlogits chunk
    __shared__ __align__(16) float wt[MG_EC][MG_DX_HB];          // (8, 256) w^T chunk
    const int tx = threadIdx.x % (MG_DX_HB / 8), ty = threadIdx.x / (MG_DX_HB / 8);
    const int t0 = blockIdx.x * MG_DX_TB, h0 = blockIdx.y * MG_DX_HB;
    float acc[RT][8];
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int k = 0; k < 8; k++) acc[r][k] = 0.0f;
    for (int e0 = 0; e0 < E; e0 += MG_EC) {
        for (int i = threadIdx.x; i < MG_DX_TB * MG_EC; i += MG_THREADS) {
            const int r = i / MG_EC, e = i % MG_EC;
            gs[r][e] = (t0 + r < T && e0 + e < E) ? g[(int64_t)(t0 + r) * E + e0 + e] : 0.0f;
        }
        /* w^T: consecutive threads take consecutive h (conflict-free stores; w is small and in L2) */
        for (int i = threadIdx.x; i < MG_EC * MG_DX_HB; i += MG_THREADS) {
            const int hh = i % MG_DX_HB, e = i / MG_DX_HB;
            wt[e][hh] = (h0 + hh < H && e0 + e < E) ? w[(int64_t)(h0 + hh) * E + e0 + e] : 0.0f;
        }
        __syncthreads();
#pragma unroll 4
        for (int e = 0; e < MG_EC; e++) {
            const float4 a = *reinterpret_cast<const float4 *>(&wt[e][tx * 8]);
            const float4 b = *reinterpret_cast<const float4 *>(&wt[e][tx * 8 + 4]);
            const float wv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int r = 0; r < RT; r++) {
                const float gv = gs[ty * RT + r][e];
#pragma unroll
                for (int k = 0; k < 8; k++) acc[r][k] = fmaf(gv, wv[k], acc[r][k]);
            }
        }
        __syncthreads();
    }
    const int h = h0 + tx * 8;
    if (h >= H) return;
#pragma unroll
    for (int r = 0; r < RT; r++) {
        const int t = t0 + ty * RT + r;
        if (t >= T) continue;
        tm__bf16 *p = dx + (int64_t)t * H + h;
        if (!fresh) {
            float o[8];
            tm__vld<8>(p, o);
#pragma unroll
            for (int k = 0; k < 8; k++) acc[r][k] += o[k];
        }
        tm__vst<8>(p, acc[r]);
    }
}

/* ---- dw (H, E) += x^T (H, T) @ g (T, E): partial sums of 256-token chunks, then their sum ---- */
/* Block: RH h a thread over TYN threads (HB = TYN RH h), ET experts (RE a thread); grid (chunks,
 * h blocks, e tiles); tokens in stages of MG_TS through an MG_DST-deep cp.async ring: x (MG_TS, HB)
 * bf16, rows padded by 16 bytes, and g (MG_TS, ET) f32. part[chunk][h][e] (e over E). */
template <int ET, int RE, int RH> struct mg_dw {
    static constexpr int TXN = ET / RE, TYN = MG_THREADS / TXN, HB = TYN * RH, XS = HB + 8;
    static constexpr size_t SMEM = (size_t)MG_DST * (MG_TS * XS * 2 + MG_TS * ET * 4);
};
template <int ET, int RE, int RH>
__global__ void __launch_bounds__(MG_THREADS) mg_dw_partial_kernel(const tm__bf16 *__restrict__ x, const float *__restrict__ g,
                                                                  float *__restrict__ part, int T, int H, int E) {
    typedef mg_dw<ET, RE, RH> C;
    extern __shared__ __align__(16) unsigned char mg_smem[];
    tm__bf16 *xs = (tm__bf16 *)mg_smem;                           // [MG_DST][MG_TS][XS]
    float *gs = (float *)(mg_smem + MG_DST * MG_TS * C::XS * 2); // [MG_DST][MG_TS][ET]
    const int tx = threadIdx.x % C::TXN, ty = threadIdx.x / C::TXN;
    const int c0 = blockIdx.x * MG_TCHUNK, h0 = blockIdx.y * C::HB, e0 = blockIdx.z * ET;
    const int c1 = min(T, c0 + MG_TCHUNK), ns = (c1 - c0 + MG_TS - 1) / MG_TS;
    auto load = [&](int k) { /* tokens c0 + k MG_TS.. into stage k % MG_DST */
        if (k < ns) {
            const int s = k % MG_DST;
            mg_tile_bf16<MG_TS, C::HB, C::XS>(xs + s * MG_TS * C::XS, x, H, c0 + k * MG_TS, c1, h0, H);
            mg_tile_f32<MG_TS, ET>(gs + s * MG_TS * ET, g, E, c0 + k * MG_TS, c1, e0, E);
        }
        tm__cp_async_commit();
    };
    float acc[RH][RE];
#pragma unroll
    for (int r = 0; r < RH; r++)
#pragma unroll
        for (int j = 0; j < RE; j++) acc[r][j] = 0.0f;
#pragma unroll
    for (int k = 0; k < MG_DST - 1; k++) load(k);
    for (int k = 0; k < ns; k++) {
        tm__cp_async_wait<MG_DST - 2>();
        __syncthreads();
        load(k + MG_DST - 1);
        const tm__bf16 *xt = xs + (k % MG_DST) * MG_TS * C::XS + ty * RH;
        const float *gt = gs + (k % MG_DST) * MG_TS * ET + tx * RE;
#pragma unroll 4
        for (int t = 0; t < MG_TS; t++) {
            float gv[RE], xv[RH];
#pragma unroll
            for (int j = 0; j < RE; j += 4) {
                const float4 v = *reinterpret_cast<const float4 *>(gt + t * ET + j);
                gv[j] = v.x, gv[j + 1] = v.y, gv[j + 2] = v.z, gv[j + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < RH; r++) xv[r] = __bfloat162float(xt[t * C::XS + r]);
#pragma unroll
            for (int r = 0; r < RH; r++)
#pragma unroll
                for (int j = 0; j < RE; j++) acc[r][j] = fmaf(xv[r], gv[j], acc[r][j]);
        }
    }
    float *pc = part + (int64_t)blockIdx.x * H * E;
#pragma unroll
    for (int r = 0; r < RH; r++) {
        const int h = h0 + ty * RH + r;
        if (h >= H) continue;
#pragma unroll
        for (int j = 0; j < RE; j++) {
            const int e = e0 + tx * RE + j;
            if (e < E) pc[(int64_t)h * E + e] = acc[r][j];
        }
    }
}

/* dw[i] = (fresh ? 0 : dw[i]) + sum over the chunks in order of part[c][i], i over H E */
__global__ void mg_dw_reduce_kernel(const float *__restrict__ part, float *__restrict__ dw, int64_t n, int chunks, int fresh) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int c = 0; c < chunks; c++) s += part[(int64_t)c * n + i];
        dw[i] = fresh ? s : dw[i] + s;
    }
}

/* ---- the split path: bf16 MMAs (cuBLASLt) on a three-term bf16 split of the f32 operand ------- */
/* v = hi + mid + lo + r, |r| <= 2^-25 |v| or so: hi = rn(v), mid = rn(v - hi), lo = rn(v - hi - mid),
 * each difference exact in f32 (Sterbenz). x is exactly bf16, so x w = x hi + x mid + x lo, three
 * bf16 products whose terms are exact in f32 (8 x 8 mantissa bits). */
__device__ __forceinline__ void mg_split3(float v, tm__bf16 *p) {
    const tm__bf16 h = __float2bfloat16_rn(v);
    const float r1 = v - __bfloat162float(h);
    const tm__bf16 m = __float2bfloat16_rn(r1);
    p[0] = h, p[1] = m, p[2] = __float2bfloat16_rn(r1 - __bfloat162float(m));
}
/* Which plane (0 hi, 1 mid, 2 lo) each of n column blocks holds. */
struct mg_pattern {
    int n, plane[6];
};
/* dst (R, n E) bf16: column block j of row r is plane pat.plane[j] of src row r (R, E) f32. */
__global__ void mg_split_kernel(const float *__restrict__ src, tm__bf16 *__restrict__ dst, int64_t R, int E, mg_pattern pat) {
    const int64_t n = R * E;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / E;
        const int e = (int)(i - r * E);
        tm__bf16 pl[3];
        mg_split3(src[i], pl);
        tm__bf16 *d = dst + r * pat.n * E + e;
        for (int j = 0; j < pat.n; j++) d[(int64_t)j * E] = pl[pat.plane[j]];
    }
}
/* out[r][e] = (fresh ? 0 : out[r][e]) + ((y[r][2E + e] + y[r][E + e]) + y[r][e]): the products with
 * lo, mid and hi of y (R, 3E) f32, the small ones first. */
__global__ void mg_sum3_kernel(const float *__restrict__ y, float *__restrict__ out, int64_t R, int E, int fresh) {
    const int64_t n = R * E;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / E;
        const int e = (int)(i - r * E);
        const float *yr = y + r * 3 * E;
        const float v = (yr[2 * E + e] + yr[E + e]) + yr[e];
        out[i] = fresh ? v : out[i] + v;
    }
}

/* ---- host ----------------------------------------------------------------------------------- */

/* The direct kernels' conditions: bf16 x in rows of H, H a multiple of 8, 16-byte aligned, and
 * E <= MG_DIRECT_MAX_E (H 0 goes to cuBLASLt, whose empty products need no launch) */
static bool mg_direct(const tm_tensor *x, const tm_tensor *w) {
    return x->dtype == TM_BF16 && w->dtype == TM_F32 && x->shape[1] > 0 && x->shape[1] % 8 == 0 && ((uintptr_t)tm__data(x) & 15) == 0 &&
           w->shape[1] <= MG_DIRECT_MAX_E && x->shape[0] <= INT32_MAX && x->shape[1] <= INT32_MAX;
}

static unsigned mg_cdiv(int64_t a, int64_t b) { return (unsigned)((a + b - 1) / b); }

/* One launch with smem bytes of dynamic shared memory (asked for above 48 KiB). */
template <typename K, typename... A>
static tm_status mg_launch(tm_ctx *ctx, K kernel, dim3 grid, size_t smem, cudaStream_t stream, A... args) {
    if (smem > 48 * 1024) TM__CU_CHECK(ctx, "moe_gating", cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<grid, MG_THREADS, smem, stream>>>(args...);
    TM__CU_LAUNCHED(ctx, "moe_gating", "a gating kernel");
    return TM_OK;
}

/* The split path's planes of src (R, E) f32 in scratch: (R, n E) bf16 by pattern (see mg_pattern). */
static tm_status mg_planes(tm_ctx *ctx, tm__cuda *st, const float *src, int64_t R, int64_t E, mg_pattern pat, tm__bf16 **dst) {
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)R * pat.n * E * sizeof(tm__bf16), (void **)dst));
    mg_split_kernel<<<tm__cu_blocks(st, R * E), TM__CU_THREADS, 0, st->stream>>>(src, *dst, R, (int)E, pat);
    TM__CU_LAUNCHED(ctx, "moe_gating", "mg_split_kernel");
    return TM_OK;
}
static tm_status mg_sum3(tm_ctx *ctx, tm__cuda *st, const float *y, float *out, int64_t R, int64_t E, int fresh) {
    mg_sum3_kernel<<<tm__cu_blocks(st, R * E), TM__CU_THREADS, 0, st->stream>>>(y, out, R, (int)E, fresh);
    TM__CU_LAUNCHED(ctx, "moe_gating", "mg_sum3_kernel");
    return TM_OK;
}
static const mg_pattern MG_HML = {3, {0, 1, 2}}; /* hi | mid | lo */

/* Split path, forward: Y (T, 3E) f32 = x @ [w_hi | w_mid | w_lo] (one bf16 GEMM), then logits =
 * the sum of Y's three blocks. Saves nothing (dw reads bf16 x). */
static tm_status mg_forward_split(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1];
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "moe_gating", &st));
    tm__gating_split_count(ctx);
    if (T == 0 || E == 0) return TM_OK;
    tm__bf16 *w3;
    float *y3;
    TM__TRY(mg_planes(ctx, st, (const float *)tm__data(w), H, E, MG_HML, &w3));
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)T * 3 * E * sizeof(float), (void **)&y3));
    TM__TRY(tm__gemm_cuda_out(ctx, TM_BF16, TM_F32, 0, 0, T, 3 * E, H, 1.0, tm__data(x), H, 0, w3, 3 * E, 0, 0.0, y3, 3 * E,
                              0, 1));
    return mg_sum3(ctx, st, y3, (float *)tm__data(c->out[0]), T, E, 1);
}

/* Split path, backward:
 *   dx (T, H) bf16 = [g_hi g_hi g_mid g_hi g_mid g_lo] @ [w_hi w_mid w_hi w_lo w_mid w_hi]^T, one
 *     bf16 GEMM over K = 6E whose f32 sum holds every product of the splits above 2^-24 of the
 *     terms, written (fresh) or added in f32 to dx and rounded once by the GEMM's epilogue;
 *   dw (H, E) f32 (+)= the sum of the blocks of x^T @ [g_hi | g_mid | g_lo] (H, 3E). */
static tm_status mg_backward_split(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *gx = c->gin[0], *gw = c->gin[1];
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    const float *G = (const float *)tm__data(c->gout[0]), *W = (const float *)tm__data(w);
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "moe_gating", &st));
    if (gx && E == 0) {
        if (c->gin_fresh[0] && T * H > 0)
            TM__CU_CHECK(ctx, "moe_gating", cudaMemsetAsync(tm__data(gx), 0, (size_t)T * H * 2, st->stream));
    } else if (gx && T > 0 && H > 0) {
        const mg_pattern pa = {6, {0, 0, 1, 0, 1, 2}}, pb = {6, {0, 1, 0, 2, 1, 0}};
        tm__bf16 *a6, *b6;
        TM__TRY(mg_planes(ctx, st, G, T, E, pa, &a6));
        TM__TRY(mg_planes(ctx, st, W, H, E, pb, &b6));
        TM__TRY(tm__gemm_cuda(ctx, TM_BF16, 0, 1, T, H, 6 * E, 1.0, a6, 6 * E, 0, b6, 6 * E, 0, c->gin_fresh[0] ? 0.0 : 1.0,
                              tm__data(gx), H, 0, 1));
    }
    if (gw && H > 0 && E > 0) {
        if (T == 0) {
            if (c->gin_fresh[1]) TM__CU_CHECK(ctx, "moe_gating", cudaMemsetAsync(tm__data(gw), 0, (size_t)H * E * 4, st->stream));
        } else {
            tm__bf16 *g3;
            float *d3;
            TM__TRY(mg_planes(ctx, st, G, T, E, MG_HML, &g3));
            TM__TRY(tm__cu_scratch(ctx, st, (size_t)H * 3 * E * sizeof(float), (void **)&d3));
            TM__TRY(tm__gemm_cuda_out(ctx, TM_BF16, TM_F32, 1, 0, H, 3 * E, T, 1.0, tm__data(x), H, 0, g3, 3 * E, 0, 0.0, d3,
                                      3 * E, 0, 1));
            TM__TRY(mg_sum3(ctx, st, d3, (float *)tm__data(gw), H, E, c->gin_fresh[1]));
        }
    }
    return TM_OK;
}

extern "C" tm_status tm__moe_gating_forward_cuda(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    if (mg_direct(x, w)) {
        tm__cuda *st;
        TM__TRY(tm__cu_enter(c->ctx, "moe_gating", &st));
        if (T == 0 || E == 0) return TM_OK;
        const tm__bf16 *X = (const tm__bf16 *)tm__data(x);
        const float *W = (const float *)tm__data(w);
        float *O = (float *)tm__data(c->out[0]);
        typedef mg_fwd<8, 2, 1> F;
        TM__TRY(mg_launch(c->ctx, mg_forward_kernel<8, 2, 1>, dim3(mg_cdiv(T, F::TB), mg_cdiv(E, 8)), F::SMEM, st->stream, X, W, O,
                          (int)T, (int)H, (int)E));
        return TM_OK;
    }
    if (x->dtype == TM_BF16 && w->dtype == TM_F32 && tm__gating_split(c->ctx)) return mg_forward_split(c);
    const void *X = tm__data(x);
    if (x->dtype != w->dtype) { /* bf16 x: its f32 copy, kept for dw */
        tm_tensor *xf;
        TM__TRY(tm__saved_new(c, w->dtype, 2, x->shape, &xf));
        TM__TRY(tm__copy_into(c->ctx, xf, x));
        X = tm__data(xf);
    }
    return tm__gemm_cuda(c->ctx, w->dtype, 0, 0, T, E, H, 1.0, X, H, 0, tm__data(w), E, 0, 0.0, tm__data(c->out[0]),
                         E, 0, 1);
}

/* dx = dlogits @ w^T by cuBLASLt: into dx itself when x has w's dtype (a fresh gradient is
 * written by beta = 0, which never reads it), else in f32, then written (rounded once) or added
 * in f32 and rounded once. */
static tm_status mg_dx_lt(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *gx = c->gin[0];
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    const void *G = tm__data(c->gout[0]);
    if (x->dtype == w->dtype)
        return tm__gemm_cuda(ctx, w->dtype, 0, 1, T, H, E, 1.0, G, E, 0, tm__data(w), E, 0, c->gin_fresh[0] ? 0.0 : 1.0,
                             tm__data(gx), H, 0, 1);
    tm_tensor *dxf;
    TM__TRY(tm__tensor_new(ctx, w->dtype, 2, x->shape, x->device, &dxf));
    TM__TRY(tm__gemm_cuda(ctx, w->dtype, 0, 1, T, H, E, 1.0, G, E, 0, tm__data(w), E, 0, 0.0, tm__data(dxf), H, 0, 1));
    return c->gin_fresh[0] ? tm__copy_into(ctx, gx, dxf) : tm__accumulate(ctx, gx, dxf, 1.0);
}

/* The direct path's backward (dx by cuBLASLt where dx itself is off a 16-byte boundary). */
static tm_status mg_backward_direct(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *gx = c->gin[0], *gw = c->gin[1];
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    const float *G = (const float *)tm__data(c->gout[0]), *W = (const float *)tm__data(w);
    const tm__bf16 *X = (const tm__bf16 *)tm__data(x);
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "moe_gating", &st));
    if (gx && ((uintptr_t)tm__data(gx) & 15)) {
        TM__TRY(mg_dx_lt(c));
    } else if (gx && T > 0) {
        if (E == 0) { /* dx = 0: written when fresh, unchanged otherwise */
            if (c->gin_fresh[0]) TM__CU_CHECK(ctx, "moe_gating", cudaMemsetAsync(tm__data(gx), 0, (size_t)T * H * 2, st->stream));
        } else {
            mg_dx_kernel<<<dim3(mg_cdiv(T, MG_DX_TB), mg_cdiv(H, MG_DX_HB)), MG_THREADS, 0, st->stream>>>(
                G, W, (tm__bf16 *)tm__data(gx), (int)T, (int)H, (int)E, c->gin_fresh[0]);
            TM__CU_LAUNCHED(ctx, "moe_gating", "mg_dx_kernel");
        }
    }
    if (gw && H > 0 && E > 0) {
        const int chunks = T > 0 ? (int)mg_cdiv(T, MG_TCHUNK) : 0;
        const int64_t n = H * E;
        float *part = NULL;
        if (chunks > 0) {
            TM__TRY(tm__cu_scratch(ctx, st, (size_t)chunks * n * sizeof(float), (void **)&part));
            typedef mg_dw<8, 4, 2> D;
            TM__TRY(mg_launch(ctx, mg_dw_partial_kernel<8, 4, 2>, dim3(chunks, mg_cdiv(H, D::HB), mg_cdiv(E, 8)), D::SMEM, st->stream,
                              X, G, part, (int)T, (int)H, (int)E));
        }
        mg_dw_reduce_kernel<<<tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream>>>(part, (float *)tm__data(gw), n, chunks,
                                                                                    c->gin_fresh[1]);
        TM__CU_LAUNCHED(ctx, "moe_gating", "mg_dw_reduce_kernel");
    }
    return TM_OK;
}

extern "C" tm_status tm__moe_gating_backward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *w = c->in[1];
    if (mg_direct(x, w)) return mg_backward_direct(c);
    if (x->dtype == TM_BF16 && w->dtype == TM_F32 && c->n_saved == 0) return mg_backward_split(c); /* as the forward went */
    tm_tensor *gx = c->gin[0], *gw = c->gin[1];
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    const void *G = tm__data(c->gout[0]);
    const bool widened = x->dtype != w->dtype;
    if (gx) TM__TRY(mg_dx_lt(c));
    if (gw) {
        const void *X = widened ? tm__data(c->saved[0]) : tm__data(x);
        TM__TRY(tm__gemm_cuda(ctx, w->dtype, 1, 0, H, E, T, 1.0, X, H, 0, G, E, 0, c->gin_fresh[1] ? 0.0 : 1.0,
                              tm__data(gw), E, 0, 1));
    }
    return TM_OK;
}
