/*
 * moe_chunks.cu — CUDA kernels of tm_moe_sort_chunks (layout: framework/ops/moe_chunks.c).
 *
 *   x (R, H) as chunks in [G, K] order, split_sizes (G * K) i64 on the device
 *   -> y (R, H), the same chunks in [K, G] order.
 * The chunk sizes stay on the device (the expert-parallel dispatch's received counts): one
 * single-thread kernel scans them into three tables of the arena, then a warp per row gathers.
 *   S[i]  first row of chunk i = g * K + k in x          (ascending in i)
 *   D[j]  first row of chunk j = k * G + g in y          (ascending in j)
 *   Di[i] = D[j(i)]
 * Forward, warp per row d of y: j = the last chunk with D[j] <= d, i = (j % G) * K + j / G,
 * y[d] = x[S[i] + d - D[j]]. Backward, warp per row s of dx: i = the last chunk with S[i] <= s,
 * dx[s] += dy[Di[i] + s - S[i]]. Each output row is written by one warp exactly once: no
 * atomics, the same bits run to run. Sizes that do not sum to R (only possible without the host
 * check, i.e. without a mirror) stay in bounds: rows no chunk covers are zero (forward) or get
 * nothing (backward).
 * Rows move as 16-byte vectors when the row and both bases allow it (H = 1024 bf16: 128 of
 * them per row, 4 per lane), else as elements; the backward adds 8 bf16 or 4 f32 per vector
 * in f32, each rounded once. A fresh dx (call->gin_fresh, TM__OP_GRAD_WRITES) is written, not
 * read: 0 + dy, and zeros in rows no chunk covers.
 */
#include "common.cuh"

#define SC_WARPS 8 /* warps per block: a warp per row */

__global__ void sort_chunks_offsets_kernel(int64_t *S, int64_t *D, int64_t *Di, const int64_t *sz, int64_t G,
                                           int64_t K) {
    if (threadIdx.x || blockIdx.x) return;
    int64_t off = 0;
    for (int64_t i = 0; i < G * K; i++) S[i] = off, off += sz[i] > 0 ? sz[i] : 0;
    off = 0;
    for (int64_t k = 0; k < K; k++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t i = g * K + k, j = k * G + g;
            D[j] = Di[i] = off;
            off += sz[i] > 0 ? sz[i] : 0;
        }
}

/* The last index with a[idx] <= v in the ascending a[0..n) (a[0] = 0 <= v). */
__device__ __forceinline__ int64_t sc_last_le(const int64_t *a, int64_t n, int64_t v) {
    int64_t lo = 0, hi = n; /* answer in [lo, hi) */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) >> 1;
        if (a[mid] <= v) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* Row copy in units of V (16-byte vectors or single elements): `units` per row. */
template <typename V>
__global__ void sort_chunks_forward_kernel(V *y, const V *x, const int64_t *S, const int64_t *D, const int64_t *sz,
                                           int64_t G, int64_t K, int64_t R, int64_t units) {
    const int lane = threadIdx.x & 31;
    const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t d = warp; d < R; d += nwarps) {
        const int64_t j = sc_last_le(D, G * K, d), i = (j % G) * K + j / G, r = d - D[j];
        const int64_t s = S[i] + r;
        V *dst = y + d * units;
        if (r < sz[i] && s < R) {
            const V *src = x + s * units;
            for (int64_t u = lane; u < units; u += 32) dst[u] = src[u];
        } else {
            for (int64_t u = lane; u < units; u += 32) dst[u] = V{};
        }
    }
}

/* a += b for the 16 bytes of a vector: 8 bf16 or 4 f32, added in f32 and rounded once. */
__device__ __forceinline__ uint4 sc_add(uint4 a, uint4 b, int bf16) {
    uint4 r;
    if (bf16) {
        const tm__bf16 *pa = (const tm__bf16 *)&a, *pb = (const tm__bf16 *)&b;
        tm__bf16 *pr = (tm__bf16 *)&r;
#pragma unroll
        for (int q = 0; q < 8; q++) tm__st(pr + q, tm__ld(pa + q) + tm__ld(pb + q));
    } else {
        const float *pa = (const float *)&a, *pb = (const float *)&b;
        float *pr = (float *)&r;
#pragma unroll
        for (int q = 0; q < 4; q++) pr[q] = pa[q] + pb[q];
    }
    return r;
}

/* dx[s] += dy[d(s)]; T the element type, or uint4 (units of 16 bytes, bf16 telling what they
 * hold) where the rows and both bases allow it. fresh: dx[s] = 0 + dy[d(s)], 0 where uncovered. */
template <typename T>
__global__ void sort_chunks_backward_kernel(T *dx, const T *dy, const int64_t *S, const int64_t *Di,
                                            const int64_t *sz, int64_t n, int64_t R, int64_t units, int bf16,
                                            int fresh) {
    const int lane = threadIdx.x & 31;
    const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t s = warp; s < R; s += nwarps) {
        const int64_t i = sc_last_le(S, n, s), r = s - S[i], d = Di[i] + r;
        T *out = dx + s * units;
        if (r >= sz[i] || d >= R) {
            if (fresh)
                for (int64_t u = lane; u < units; u += 32) {
                    if constexpr (sizeof(T) == 16) out[u] = T{};
                    else tm__st(out + u, 0.0f);
                }
            continue;
        }
        const T *in = dy + d * units;
        for (int64_t u = lane; u < units; u += 32) {
            if constexpr (sizeof(T) == 16) out[u] = sc_add(fresh ? T{} : out[u], in[u], bf16);
            else tm__st(out + u, (fresh ? 0.0f : tm__ld(out + u)) + tm__ld(in + u));
        }
    }
}

static unsigned sc_blocks(const tm__cuda *st, int64_t rows) {
    int64_t b = (rows + SC_WARPS - 1) / SC_WARPS, cap = (int64_t)st->num_sms * 32;
    if (b > cap) b = cap;
    return (unsigned)(b < 1 ? 1 : b);
}

/* The three offset tables in the arena, from the sizes on the device. */
static tm_status sc_offsets(tm__call *c, const tm__cuda *st, int64_t **S, int64_t **D, int64_t **Di) {
    const int64_t n = c->in[1]->shape[0], G = c->iattr[0];
    void *p;
    TM__TRY(tm__cu_scratch(c->ctx, st, sizeof(int64_t) * (size_t)(3 * n), &p));
    *S = (int64_t *)p, *D = *S + n, *Di = *D + n;
    sort_chunks_offsets_kernel<<<1, 32, 0, st->stream>>>(*S, *D, *Di, (const int64_t *)tm__data(c->in[1]), G, n / G);
    return TM_OK;
}

extern "C" tm_status tm__moe_sort_chunks_forward_cuda(tm__call *c) {
    const char *what = "moe_sort_chunks";
    const tm_tensor *x = c->in[0];
    const int64_t R = x->shape[0], n = c->in[1]->shape[0], G = c->iattr[0];
    const size_t row = (size_t)x->shape[1] * tm_dtype_size(x->dtype);
    if (R == 0 || row == 0) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, what, &st));
    int64_t *S, *D, *Di;
    TM__TRY(sc_offsets(c, st, &S, &D, &Di));
    const int64_t *sz = (const int64_t *)tm__data(c->in[1]);
    void *y = tm__data(c->out[0]);
    const void *xp = tm__data(x);
    const unsigned grid = sc_blocks(st, R);
    if (row % 16 == 0 && (uintptr_t)y % 16 == 0 && (uintptr_t)xp % 16 == 0)
        sort_chunks_forward_kernel<uint4><<<grid, SC_WARPS * 32, 0, st->stream>>>((uint4 *)y, (const uint4 *)xp, S, D,
                                                                                  sz, G, n / G, R, (int64_t)row / 16);
    else if (tm_dtype_size(x->dtype) == 4)
        sort_chunks_forward_kernel<uint32_t><<<grid, SC_WARPS * 32, 0, st->stream>>>(
            (uint32_t *)y, (const uint32_t *)xp, S, D, sz, G, n / G, R, (int64_t)row / 4);
    else
        sort_chunks_forward_kernel<uint16_t><<<grid, SC_WARPS * 32, 0, st->stream>>>(
            (uint16_t *)y, (const uint16_t *)xp, S, D, sz, G, n / G, R, (int64_t)row / 2);
    TM__CU_LAUNCHED(c->ctx, what, "sort_chunks_offsets_kernel / sort_chunks_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__moe_sort_chunks_backward_cuda(tm__call *c) {
    const char *what = "moe_sort_chunks";
    tm_tensor *dx = c->gin[0];
    const int64_t R = c->in[0]->shape[0], H = c->in[0]->shape[1], n = c->in[1]->shape[0];
    if (!dx || R == 0 || H == 0) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, what, &st));
    int64_t *S, *D, *Di;
    TM__TRY(sc_offsets(c, st, &S, &D, &Di));
    const int64_t *sz = (const int64_t *)tm__data(c->in[1]);
    const unsigned grid = sc_blocks(st, R);
    const size_t row = (size_t)H * tm_dtype_size(dx->dtype);
    void *gx = tm__data(dx);
    const void *gy = tm__data(c->gout[0]);
    const int fresh = c->gin_fresh[0];
    if (row % 16 == 0 && (uintptr_t)gx % 16 == 0 && (uintptr_t)gy % 16 == 0)
        sort_chunks_backward_kernel<uint4><<<grid, SC_WARPS * 32, 0, st->stream>>>(
            (uint4 *)gx, (const uint4 *)gy, S, Di, sz, n, R, (int64_t)row / 16, dx->dtype == TM_BF16, fresh);
    else if (dx->dtype == TM_BF16)
        sort_chunks_backward_kernel<tm__bf16><<<grid, SC_WARPS * 32, 0, st->stream>>>(
            (tm__bf16 *)gx, (const tm__bf16 *)gy, S, Di, sz, n, R, H, 1, fresh);
    else
        sort_chunks_backward_kernel<float><<<grid, SC_WARPS * 32, 0, st->stream>>>((float *)gx, (const float *)gy, S,
                                                                                   Di, sz, n, R, H, 0, fresh);
    TM__CU_LAUNCHED(c->ctx, what, "sort_chunks_offsets_kernel / sort_chunks_backward_kernel");
    return TM_OK;
}
