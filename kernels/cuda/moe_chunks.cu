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
 * them per row, 4 per lane), else as elements.
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

template <typename T>
__global__ void sort_chunks_backward_kernel(T *dx, const T *dy, const int64_t *S, const int64_t *Di,
                                            const int64_t *sz, int64_t n, int64_t R, int64_t H) {
    const int lane = threadIdx.x & 31;
    const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t s = warp; s < R; s += nwarps) {
        const int64_t i = sc_last_le(S, n, s), r = s - S[i], d = Di[i] + r;
        if (r >= sz[i] || d >= R) continue;
        for (int64_t c = lane; c < H; c += 32) tm__st(dx + s * H + c, tm__ld(dx + s * H + c) + tm__ld(dy + d * H + c));
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
    if (dx->dtype == TM_BF16)
        sort_chunks_backward_kernel<tm__bf16><<<grid, SC_WARPS * 32, 0, st->stream>>>(
            (tm__bf16 *)tm__data(dx), (const tm__bf16 *)tm__data(c->gout[0]), S, Di, sz, n, R, H);
    else
        sort_chunks_backward_kernel<float><<<grid, SC_WARPS * 32, 0, st->stream>>>(
            (float *)tm__data(dx), (const float *)tm__data(c->gout[0]), S, Di, sz, n, R, H);
    TM__CU_LAUNCHED(c->ctx, what, "sort_chunks_offsets_kernel / sort_chunks_backward_kernel");
    return TM_OK;
}
