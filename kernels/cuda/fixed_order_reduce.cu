/*
 * fixed_order_reduce.cu — the deterministic reducer (tm__cu_reduce) that every CUDA sum, mean, norm and
 * bias-gradient goes through, and axpy (tm__cu_axpy). No float atomics: partial sums are
 * combined in a fixed order that depends only on the shape and the SM count, so results are
 * bitwise reproducible run to run.
 */
#include "common.cuh"

/* ---- axpy ------------------------------------------------------------------------------------ */

template <typename D, typename S>
__global__ void tm__axpy_kernel(D *dst, const S *src, int64_t n, float alpha) {
    TM__CU_GRID_STRIDE(i, n) tm__st(dst + i, tm__ld(dst + i) + alpha * tm__ld(src + i));
}

extern "C" tm_status tm__cu_axpy(tm_ctx *ctx, const char *what, tm_dtype dst_dt, void *dst, tm_dtype src_dt,
                                 const void *src, int64_t n, float alpha) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (n == 0) return TM_OK;
    unsigned g = tm__cu_blocks(st, n);
    cudaStream_t s = st->stream;
    if (dst_dt == TM_F32 && src_dt == TM_F32)
        tm__axpy_kernel<<<g, TM__CU_THREADS, 0, s>>>((float *)dst, (const float *)src, n, alpha);
    else if (dst_dt == TM_F32)
        tm__axpy_kernel<<<g, TM__CU_THREADS, 0, s>>>((float *)dst, (const tm__bf16 *)src, n, alpha);
    else if (src_dt == TM_F32)
        tm__axpy_kernel<<<g, TM__CU_THREADS, 0, s>>>((tm__bf16 *)dst, (const float *)src, n, alpha);
    else
        tm__axpy_kernel<<<g, TM__CU_THREADS, 0, s>>>((tm__bf16 *)dst, (const tm__bf16 *)src, n, alpha);
    TM__CU_LAUNCHED(ctx, what, "tm__axpy_kernel");
    return TM_OK;
}

/* ---- deterministic reduction over the middle axis ----------------------------------------- */
/*
 * src [O, A, I] -> out [O, S, I] where split s sums rows a in [s*chunk, (s+1)*chunk).
 * I == 1 (a contiguous row per (o, s)): one block strides over the row and reduces in a fixed
 * tree. I > 1: a block of 32 x 8 threads takes 32 consecutive i (coalesced) and 8 row
 * phases; the 8 partials are added in order. Both are deterministic for a given launch shape.
 */
#define TM__RED_ROWS 8

template <typename T, typename D>
__global__ void tm__reduce_row_kernel(const T *src, D *out, int64_t A, int S, int64_t chunk, float alpha,
                                      int accumulate) {
    __shared__ float sh[32];
    int64_t os = blockIdx.x; /* o * S + s */
    int64_t o = os / S, s = os % S;
    int64_t a0 = s * chunk, a1 = a0 + chunk < A ? a0 + chunk : A;
    const T *row = src + o * A;
    float v = 0.0f;
    for (int64_t a = a0 + threadIdx.x; a < a1; a += blockDim.x) v += tm__ld(row + a);
    v = tm__block_sum(v, sh);
    if (threadIdx.x == 0) {
        float r = alpha * v;
        if (accumulate) r += tm__ld(out + os);
        tm__st(out + os, r);
    }
}

template <typename T, typename D>
__global__ void tm__reduce_col_kernel(const T *src, D *out, int64_t A, int64_t I, int S, int64_t chunk,
                                      float alpha, int accumulate) {
    __shared__ float sh[TM__RED_ROWS][33];
    int64_t nib = (I + 31) / 32;
    int64_t b = blockIdx.x;
    int64_t ib = b % nib, os = b / nib; /* os = o * S + s */
    int64_t o = os / S, s = os % S;
    int64_t i = ib * 32 + threadIdx.x;
    int64_t a0 = s * chunk, a1 = a0 + chunk < A ? a0 + chunk : A;
    float v = 0.0f;
    if (i < I)
        for (int64_t a = a0 + threadIdx.y; a < a1; a += TM__RED_ROWS) v += tm__ld(src + (o * A + a) * I + i);
    sh[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.y == 0 && i < I) {
        float r = 0.0f;
        for (int y = 0; y < TM__RED_ROWS; y++) r += sh[y][threadIdx.x];
        r *= alpha;
        int64_t idx = os * I + i;
        if (accumulate) r += tm__ld(out + idx);
        tm__st(out + idx, r);
    }
}

template <typename T, typename D>
static void tm__reduce_launch(const tm__cuda *st, const T *src, D *out, int64_t O, int64_t A, int64_t I, int S,
                              float alpha, int accumulate) {
    int64_t chunk = (A + S - 1) / S;
    if (chunk < 1) chunk = 1;
    if (I == 1) {
        int threads = tm__cu_row_threads(chunk);
        tm__reduce_row_kernel<<<(unsigned)(O * S), threads, 0, st->stream>>>(src, out, A, S, chunk, alpha, accumulate);
    } else {
        dim3 block(32, TM__RED_ROWS);
        int64_t nb = O * S * ((I + 31) / 32);
        tm__reduce_col_kernel<<<(unsigned)nb, block, 0, st->stream>>>(src, out, A, I, S, chunk, alpha, accumulate);
    }
}

template <typename T>
static void tm__reduce_launch_dst(const tm__cuda *st, const T *src, tm_dtype dst_dt, void *dst, int64_t O, int64_t A,
                                  int64_t I, int S, float alpha, int accumulate) {
    if (dst_dt == TM_BF16) tm__reduce_launch(st, src, (tm__bf16 *)dst, O, A, I, S, alpha, accumulate);
    else tm__reduce_launch(st, src, (float *)dst, O, A, I, S, alpha, accumulate);
}

extern "C" tm_status tm__cu_reduce(tm_ctx *ctx, const char *what, tm_dtype src_dt, const void *src,
                                   tm_dtype dst_dt, void *dst, int64_t O, int64_t A, int64_t I, float alpha,
                                   int accumulate) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (O * I == 0) return TM_OK;
    /* Split A when the blocks of one pass would not fill the GPU and rows are long enough
     * to be worth a second pass. */
    int64_t base = O * (I == 1 ? 1 : (I + 31) / 32);
    int64_t want = (int64_t)st->num_sms * 4;
    int64_t S = 1;
    if (base < want && A >= 1024) {
        S = want / base;
        int64_t max_s = A / 256; /* at least 256 rows per split */
        if (S > max_s) S = max_s;
        if (S > 1024) S = 1024;
        if (S < 1) S = 1;
    }
    if (S == 1) {
        if (src_dt == TM_BF16) tm__reduce_launch_dst(st, (const tm__bf16 *)src, dst_dt, dst, O, A, I, 1, alpha, accumulate);
        else tm__reduce_launch_dst(st, (const float *)src, dst_dt, dst, O, A, I, 1, alpha, accumulate);
        TM__CU_LAUNCHED(ctx, what, "tm__reduce_*_kernel");
        return TM_OK;
    }
    void *part;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)(O * S * I) * sizeof(float), &part));
    if (src_dt == TM_BF16) tm__reduce_launch(st, (const tm__bf16 *)src, (float *)part, O, A, I, (int)S, 1.0f, 0);
    else tm__reduce_launch(st, (const float *)src, (float *)part, O, A, I, (int)S, 1.0f, 0);
    TM__CU_LAUNCHED(ctx, what, "tm__reduce_*_kernel (partials)");
    tm__reduce_launch_dst(st, (const float *)part, dst_dt, dst, O, S, I, 1, alpha, accumulate);
    TM__CU_LAUNCHED(ctx, what, "tm__reduce_*_kernel (final)");
    return TM_OK;
}

