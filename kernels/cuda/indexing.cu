/*
 * indexing.cu — CUDA kernels of tm_embedding, tm_index_select, tm_gather, tm_scatter_add and
 * tm_index_check.
 *
 * Layouts, shared with kernels/cpu/indexing.c:
 *   embedding     weight (V, C), ids (S...)  -> out (S..., C)   out[s] = weight[ids[s]]
 *   index_select  x (N, C), idx (M)          -> out (M, C)      out[m] = x[idx[m]]
 *   gather        x (N, C), idx (N, K)       -> out (N, K)      out[n, k] = x[n, idx[n, k]]
 *   scatter_add   src (M, C), idx (M), iattr[0] n_rows -> out (n_rows, C)  out[idx[m]] += src[m]
 *   iattr[1] 1: the indices are known valid (tm__embedding_unchecked): no flag is read back.
 *   iattr[2] 1: they are also distinct (tm__embedding_unique): the backward scatters without
 *            sorting (ix_scatter_unique_kernel: one writer per destination row, the same f64
 *            addition as the sorted path's run of one source).
 *   No saved tensors: every backward reads the index input and the upstream gradient.
 *   index_check   ids (S...), iattr[0] hi, iattr[1] ignore_index
 *                 -> out[0] safe (S...) ids' dtype: ids[s] where valid, ignore_index elsewhere
 *                    out[1] first_bad (2) i64 {s, ids[s]} of the lowest bad flat s, {-1, 0}
 * Float data is f32 or bf16, indices i32 or i64 (templates on both).
 *
 * Bad indices. The CPU kernels check every index before they write anything and fail with
 * TM_ERR_INDEX naming the first bad one. Here the indices live on the device, so:
 *   - no kernel reads or writes out of bounds whatever the indices hold: a bad index yields a
 *     zero row / element in a forward and contributes nothing to a gradient;
 *   - a forward (unless iattr[1]) finds the lowest bad flat position with an integer atomicMin
 *     (order-free), a one-thread kernel pairs it with its value, and the pair (16 bytes) is
 *     copied back: one synchronisation per forward that has indices, counted by the backend
 *     (the CPU kernels count one at the same point). A bad index then fails the op with the
 *     CPU's message (tm__index_range_err);
 *   - index_check writes the same pair into its first_bad output and reads nothing back:
 *     tm_model_forward validates its ids so and then embeds with tm__embedding_unchecked, which
 *     skips the read, so the model's forward makes no synchronisation here.
 *
 * Determinism (no float atomics). Row scatter-adds — the backward of embedding and
 * index_select, the forward of scatter_add — group their sources by destination row with a
 * sort of the keys idx[m] << 32 | m. The keys are distinct, so the sorted order is unique (any
 * correct sort gives it) and lists the sources of each row in ascending m: the stable counting
 * sort of the CPU. The sort is CUB's radix sort over the key bits that can be set (32 + the bits
 * of R; a bad index's all-ones key stays the largest in those bits): a few launches, where the
 * bitonic network it replaced took 105 for the 16K ids of a step (0.28 ms of an H200). Then
 * one block per destination row finds its run of keys by binary search and sums the sources in
 * that order, in f64 from the destination's old value, as the CPU does: the same additions in
 * the same order. gather's backward adds within rows of dx only: one thread per row walks k in
 * order, adding in f32 (bf16 dx staged through f32 scratch as the CPU's dispatcher stages it):
 * the CPU's additions. Bad ids get the largest key
 * and sort past every row.
 */
#include "common.cuh"

#define CCCL_DISABLE_NVTX /* no profiler ranges from CUB inside the library */
#include <cub/device/device_radix_sort.cuh>

#define IDX_NONE 0xffffffffffffffffull /* no bad position; also the key of a bad index */

/* ---- bad-index flag ------------------------------------------------------------------------ */

/* fb[0], read as unsigned, is lowered to the lowest flat position whose index is outside [0, hi).
 * Initialised to all ones (-1 as i64): none. */
template <typename I>
__global__ void ix_first_bad_scan_kernel(unsigned long long *fb, const I *idx, int64_t n, int64_t hi) {
    TM__CU_GRID_STRIDE(i, n) {
        int64_t v = (int64_t)idx[i];
        if (v < 0 || v >= hi) atomicMin(fb, (unsigned long long)i);
    }
}

/* fb[1] = the value at position fb[0], or 0 when fb[0] is -1. */
template <typename I>
__global__ void ix_first_bad_value_kernel(int64_t *fb, const I *idx) {
    int64_t p = fb[0];
    fb[1] = p >= 0 ? (int64_t)idx[p] : 0;
}

/* fb: 2 i64 on the device, any content. Finds the first index of idx (n) outside [0, hi)
 * and leaves {position, value} or {-1, 0} in fb; nothing is read back. */
static tm_status first_bad_launch(tm_ctx *ctx, const tm__cuda *st, const char *what, int64_t *fb, tm_dtype idt,
                                  const void *idx, int64_t n, int64_t hi) {
    TM__CU_CHECK(ctx, what, cudaMemsetAsync(fb, 0xff, sizeof(int64_t), st->stream));
    unsigned g = tm__cu_blocks(st, n);
    unsigned long long *pos = (unsigned long long *)fb;
    if (idt == TM_I32) {
        if (n > 0) ix_first_bad_scan_kernel<<<g, TM__CU_THREADS, 0, st->stream>>>(pos, (const int32_t *)idx, n, hi);
        ix_first_bad_value_kernel<<<1, 1, 0, st->stream>>>(fb, (const int32_t *)idx);
    } else {
        if (n > 0) ix_first_bad_scan_kernel<<<g, TM__CU_THREADS, 0, st->stream>>>(pos, (const int64_t *)idx, n, hi);
        ix_first_bad_value_kernel<<<1, 1, 0, st->stream>>>(fb, (const int64_t *)idx);
    }
    TM__CU_LAUNCHED(ctx, what, "ix_first_bad_scan_kernel / ix_first_bad_value_kernel");
    return TM_OK;
}

/* The error check of a forward: unless iattr[1] says the indices are valid (or there are none),
 * find the first bad index of c->in[1] and read it back (one synchronisation). */
static tm_status check_indices(tm__call *c, const tm__cuda *st) {
    const tm_tensor *idx = c->in[1];
    int64_t n = tm__numel(idx);
    if (n == 0 || c->iattr[1]) return TM_OK;
    int64_t *fb, host[2];
    TM__TRY(tm__cu_scratch(c->ctx, st, 2 * sizeof(int64_t), (void **)&fb));
    TM__TRY(first_bad_launch(c->ctx, st, tm__opname(c), fb, idx->dtype, tm__data(idx), n, tm__index_range_hi(c)));
    TM__TRY(tm__cuda_memcpy(c->ctx, host, fb, sizeof host, TM__D2H));
    return host[0] >= 0 ? tm__index_range_err(c, host[0], host[1]) : TM_OK;
}

/* ---- row lookup: embedding and index_select forward ------------------------------------------ */

template <typename T, typename I>
__global__ void ix_lookup_rows_kernel(T *out, const T *table, const I *idx, int64_t M, int64_t R, int64_t C) {
    TM__CU_GRID_STRIDE(e, M * C) {
        int64_t m = e / C, col = e % C, v = (int64_t)idx[m];
        if (v >= 0 && v < R) out[e] = table[v * C + col];
        else tm__st(out + e, 0.0f);
    }
}

/* ---- row scatter-add: embedding and index_select backward, scatter_add forward --------------- */

/* keys (M): idx[m] << 32 | m for valid idx[m], IDX_NONE for bad ones. */
template <typename I>
__global__ void ix_scatter_keys_kernel(unsigned long long *keys, const I *idx, int64_t M, int64_t R) {
    TM__CU_GRID_STRIDE(i, M) {
        unsigned long long key = IDX_NONE;
        int64_t v = (int64_t)idx[i];
        if (v >= 0 && v < R) key = ((unsigned long long)v << 32) | (unsigned long long)i;
        keys[i] = key;
    }
}

/* First position in sorted keys[0, n) whose key is >= want. */
static __device__ int64_t ix_lower_bound_key(const unsigned long long *keys, int64_t n, unsigned long long want) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (keys[mid] < want) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* dst (R, C) (+)= the rows of src (M, C) whose keys (sorted, M of them) name row r, summed in
 * key order (ascending m) in f64. accumulate = 0: rows that receive nothing become 0. */
template <typename T>
__global__ void ix_scatter_rows_kernel(T *dst, const T *src, const unsigned long long *keys, int64_t M, int64_t R,
                                       int64_t C, int accumulate) {
    __shared__ int64_t run[2];
    for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
        if (threadIdx.x == 0) {
            run[0] = ix_lower_bound_key(keys, M, (unsigned long long)r << 32);
            run[1] = ix_lower_bound_key(keys, M, (unsigned long long)(r + 1) << 32);
        }
        __syncthreads();
        const int64_t j0 = run[0], j1 = run[1];
        if (j0 < j1 || !accumulate) {
            T *d = dst + r * C;
            for (int64_t col = threadIdx.x; col < C; col += blockDim.x) {
                double a = accumulate ? (double)tm__ld(d + col) : 0.0;
                for (int64_t j = j0; j < j1; j++)
                    a += (double)tm__ld(src + (int64_t)(keys[j] & 0xffffffffull) * C + col);
                tm__st(d + col, (float)a);
            }
        }
        __syncthreads(); /* run[] is rewritten for the next row */
    }
}

/* keys[0, M) sorted into sorted[0, M) through tmp (tmp_bytes from a first call with tmp NULL). */
static cudaError_t ix_sort_keys(void *tmp, size_t &tmp_bytes, const unsigned long long *keys,
                                unsigned long long *sorted, int64_t M, int64_t R, cudaStream_t stream) {
    int end_bit = 32; /* row fields hold R - 1 at most, below the all-ones of a bad key */
    while (end_bit < 64 && ((unsigned long long)R >> (end_bit - 32)) != 0) end_bit++;
    return cub::DeviceRadixSort::SortKeys(tmp, tmp_bytes, keys, sorted, (int)M, 0, end_bit, stream);
}

template <typename T, typename I>
static tm_status scatter_rows_launch(tm__call *c, const tm__cuda *st, T *dst, const T *src, const I *idx, int64_t R,
                                     int64_t M, int64_t C, int accumulate) {
    tm_ctx *ctx = c->ctx;
    const char *what = tm__opname(c);
    unsigned long long *keys;
    size_t tmp_bytes = 0;
    TM__CU_CHECK(ctx, what, ix_sort_keys(nullptr, tmp_bytes, nullptr, nullptr, M, R, st->stream));
    void *tmp;
    TM__TRY(tm__cu_scratch(ctx, st, 2 * (size_t)M * sizeof *keys, (void **)&keys));
    TM__TRY(tm__cu_scratch(ctx, st, tmp_bytes, &tmp));
    unsigned long long *sorted = keys + M;
    ix_scatter_keys_kernel<<<tm__cu_blocks(st, M), TM__CU_THREADS, 0, st->stream>>>(keys, idx, M, R);
    TM__CU_CHECK(ctx, what, ix_sort_keys(tmp, tmp_bytes, keys, sorted, M, R, st->stream));
    unsigned grid = (unsigned)(R < ((int64_t)1 << 30) ? R : ((int64_t)1 << 30));
    ix_scatter_rows_kernel<<<grid, tm__cu_row_threads(C), 0, st->stream>>>(dst, src, sorted, M, R, C, accumulate);
    return TM_OK;
}

/* dst (R, C) (+)= src (M, C) scattered by idx (M); bad indices add nothing.
 * accumulate = 0: dst is overwritten (rows that receive nothing become 0). */
static tm_status scatter_rows(tm__call *c, const tm__cuda *st, tm_tensor *dst, const tm_tensor *src,
                              const tm_tensor *idx, int accumulate) {
    tm_ctx *ctx = c->ctx;
    const char *what = tm__opname(c);
    int64_t R = dst->shape[0], C = dst->shape[1], M = tm__numel(idx);
    if (R == 0 || C == 0) return TM_OK;
    if (M == 0)
        return accumulate ? TM_OK : tm__cuda_memset0(ctx, tm__data(dst), (size_t)(R * C) * tm_dtype_size(dst->dtype));
    /* A key holds the row in its high 32 bits and the source position in its low 32. */
    /* The key holds the row in 32 bits; CUB's sort counts its keys in an int. */
    if (M > (int64_t)INT32_MAX || R >= (int64_t)UINT32_MAX)
        return tm__err(ctx, TM_ERR_UNSUPPORTED,
                       "%s: the CUDA row scatter-add takes at most 2^31 - 1 sources into fewer than 2^32 - 1 rows, "
                       "got %lld sources into %lld rows",
                       what, (long long)M, (long long)R);
    const void *ip = tm__data(idx);
    if (dst->dtype == TM_BF16) {
        tm__bf16 *d = (tm__bf16 *)tm__data(dst);
        const tm__bf16 *s = (const tm__bf16 *)tm__data(src);
        if (idx->dtype == TM_I32) TM__TRY(scatter_rows_launch(c, st, d, s, (const int32_t *)ip, R, M, C, accumulate));
        else TM__TRY(scatter_rows_launch(c, st, d, s, (const int64_t *)ip, R, M, C, accumulate));
    } else {
        float *d = (float *)tm__data(dst);
        const float *s = (const float *)tm__data(src);
        if (idx->dtype == TM_I32) TM__TRY(scatter_rows_launch(c, st, d, s, (const int32_t *)ip, R, M, C, accumulate));
        else TM__TRY(scatter_rows_launch(c, st, d, s, (const int64_t *)ip, R, M, C, accumulate));
    }
    TM__CU_LAUNCHED(ctx, what, "ix_scatter_keys_kernel / radix sort / ix_scatter_rows_kernel");
    return TM_OK;
}

/* ---- gather and the backward of scatter_add ------------------------------------------------- */

template <typename T, typename I>
__global__ void ix_gather_forward_kernel(T *out, const T *x, const I *idx, int64_t N, int64_t C, int64_t K) {
    TM__CU_GRID_STRIDE(e, N * K) {
        int64_t n = e / K, v = (int64_t)idx[e];
        if (v >= 0 && v < C) out[e] = x[n * C + v];
        else tm__st(out + e, 0.0f);
    }
}

/* One thread per row n of dx (f32): dx[n, idx[n, k]] += dout[n, k] for k in order. */
template <typename T, typename I>
__global__ void ix_gather_backward_kernel(float *dx, const T *dout, const I *idx, int64_t N, int64_t C, int64_t K) {
    TM__CU_GRID_STRIDE(n, N) {
        for (int64_t k = 0; k < K; k++) {
            int64_t v = (int64_t)idx[n * K + k];
            if (v >= 0 && v < C) dx[n * C + v] += tm__ld(dout + n * K + k);
        }
    }
}

/* dst = src elementwise, converting (bf16 <-> f32 staging of gather's dx). */
template <typename D, typename S>
__global__ void ix_convert_kernel(D *dst, const S *src, int64_t n) {
    TM__CU_GRID_STRIDE(i, n) tm__st(dst + i, tm__ld(src + i));
}

/* dsrc (M, C) += dout[idx[m]]: a row gather, no two threads write one element. */
template <typename T, typename I>
__global__ void ix_gather_rows_add_kernel(T *dsrc, const T *dout, const I *idx, int64_t M, int64_t R, int64_t C) {
    TM__CU_GRID_STRIDE(e, M * C) {
        int64_t m = e / C, col = e % C, v = (int64_t)idx[m];
        if (v >= 0 && v < R) tm__st(dsrc + e, tm__ld(dsrc + e) + tm__ld(dout + v * C + col));
    }
}

/* Launch kern<T, I> with T the storage type of float dtype dt and I that of index dtype it. */
#define IDX_LAUNCH(dt, it, kern, grid, block, stream, out, in, idx, ...)                                           \
    do {                                                                                                           \
        if ((dt) == TM_BF16 && (it) == TM_I32)                                                                     \
            kern<tm__bf16, int32_t><<<(grid), (block), 0, (stream)>>>((tm__bf16 *)(out), (const tm__bf16 *)(in),   \
                                                                      (const int32_t *)(idx), __VA_ARGS__);        \
        else if ((dt) == TM_BF16)                                                                                  \
            kern<tm__bf16, int64_t><<<(grid), (block), 0, (stream)>>>((tm__bf16 *)(out), (const tm__bf16 *)(in),   \
                                                                      (const int64_t *)(idx), __VA_ARGS__);        \
        else if ((it) == TM_I32)                                                                                   \
            kern<float, int32_t><<<(grid), (block), 0, (stream)>>>((float *)(out), (const float *)(in),            \
                                                                   (const int32_t *)(idx), __VA_ARGS__);           \
        else                                                                                                       \
            kern<float, int64_t><<<(grid), (block), 0, (stream)>>>((float *)(out), (const float *)(in),            \
                                                                   (const int64_t *)(idx), __VA_ARGS__);           \
    } while (0)

/* ---- entry points ----------------------------------------------------------------------------- */

/* out (M, C) = table[idx[m]] for idx of any shape (M = numel): embedding and index_select. */
static tm_status row_lookup_forward(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, tm__opname(c), &st));
    const tm_tensor *table = c->in[0], *idx = c->in[1];
    int64_t V = table->shape[0], C = table->shape[1], M = tm__numel(idx);
    if (M * C > 0) {
        IDX_LAUNCH(table->dtype, idx->dtype, ix_lookup_rows_kernel, tm__cu_blocks(st, M * C), TM__CU_THREADS,
                   st->stream, tm__data(c->out[0]), tm__data(table), tm__data(idx), M, V, C);
        TM__CU_LAUNCHED(c->ctx, tm__opname(c), "ix_lookup_rows_kernel");
    }
    return check_indices(c, st);
}

/* dst (R, C) += src (M, C) scattered by distinct idx (M): each destination row has one source,
 * so one thread per element writes it: old + src in f64, rounded once, as ix_scatter_rows_kernel
 * adds a run of one. Out-of-range indices add nothing. */
template <typename T, typename I>
__global__ void ix_scatter_unique_kernel(T *dst, const T *src, const I *idx, int64_t M, int64_t R, int64_t C) {
    TM__CU_GRID_STRIDE(i, M * C) {
        int64_t m = i / C, col = i - m * C, r = (int64_t)idx[m];
        if (r < 0 || r >= R) continue;
        T *d = dst + r * C + col;
        tm__st(d, (float)((double)tm__ld(d) + (double)tm__ld(src + m * C + col)));
    }
}

static tm_status row_lookup_backward(tm__call *c) {
    if (!c->gin[0]) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, tm__opname(c), &st));
    if (c->op == TM__OP_EMBEDDING && c->iattr[2]) {
        const tm_tensor *dst = c->gin[0], *src = c->gout[0], *idx = c->in[1];
        int64_t R = dst->shape[0], C = dst->shape[1], M = tm__numel(idx);
        if (M * C > 0) {
            IDX_LAUNCH(dst->dtype, idx->dtype, ix_scatter_unique_kernel, tm__cu_blocks(st, M * C), TM__CU_THREADS,
                       st->stream, tm__data(dst), tm__data(src), tm__data(idx), M, R, C);
            TM__CU_LAUNCHED(c->ctx, tm__opname(c), "ix_scatter_unique_kernel");
        }
        return TM_OK;
    }
    return scatter_rows(c, st, c->gin[0], c->gout[0], c->in[1], 1);
}

extern "C" tm_status tm__embedding_forward_cuda(tm__call *c) { return row_lookup_forward(c); }
extern "C" tm_status tm__embedding_backward_cuda(tm__call *c) { return row_lookup_backward(c); }
extern "C" tm_status tm__index_select_forward_cuda(tm__call *c) { return row_lookup_forward(c); }
extern "C" tm_status tm__index_select_backward_cuda(tm__call *c) { return row_lookup_backward(c); }

extern "C" tm_status tm__gather_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "gather", &st));
    const tm_tensor *x = c->in[0], *idx = c->in[1];
    int64_t N = x->shape[0], C = x->shape[1], K = idx->shape[1];
    if (N * K > 0) {
        IDX_LAUNCH(x->dtype, idx->dtype, ix_gather_forward_kernel, tm__cu_blocks(st, N * K), TM__CU_THREADS, st->stream,
                   tm__data(c->out[0]), tm__data(x), tm__data(idx), N, C, K);
        TM__CU_LAUNCHED(c->ctx, "gather", "ix_gather_forward_kernel");
    }
    return check_indices(c, st);
}

template <typename T>
static void gather_backward_launch(const tm__cuda *st, float *dx, const T *dout, tm_dtype it, const void *idx,
                                   int64_t N, int64_t C, int64_t K) {
    unsigned g = tm__cu_blocks(st, N);
    if (it == TM_I32)
        ix_gather_backward_kernel<<<g, TM__CU_THREADS, 0, st->stream>>>(dx, dout, (const int32_t *)idx, N, C, K);
    else
        ix_gather_backward_kernel<<<g, TM__CU_THREADS, 0, st->stream>>>(dx, dout, (const int64_t *)idx, N, C, K);
}

/* bf16 dx is staged through f32 scratch, as the CPU dispatcher stages it, so that a column hit
 * several times in a row is rounded once, after its last add. */
extern "C" tm_status tm__gather_backward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *dx = c->gin[0];
    const tm_tensor *idx = c->in[1];
    int64_t N = c->in[0]->shape[0], C = c->in[0]->shape[1], K = idx->shape[1];
    if (!dx || N * K == 0) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "gather", &st));
    if (dx->dtype == TM_F32) {
        gather_backward_launch(st, (float *)tm__data(dx), (const float *)tm__data(c->gout[0]), idx->dtype,
                               tm__data(idx), N, C, K);
    } else {
        float *acc;
        tm__bf16 *d = (tm__bf16 *)tm__data(dx);
        TM__TRY(tm__cu_scratch(ctx, st, (size_t)(N * C) * sizeof(float), (void **)&acc));
        unsigned g = tm__cu_blocks(st, N * C);
        ix_convert_kernel<<<g, TM__CU_THREADS, 0, st->stream>>>(acc, (const tm__bf16 *)d, N * C);
        gather_backward_launch(st, acc, (const tm__bf16 *)tm__data(c->gout[0]), idx->dtype, tm__data(idx), N, C, K);
        ix_convert_kernel<<<g, TM__CU_THREADS, 0, st->stream>>>(d, (const float *)acc, N * C);
    }
    TM__CU_LAUNCHED(ctx, "gather", "ix_convert_kernel / ix_gather_backward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__scatter_add_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "scatter_add", &st));
    TM__TRY(scatter_rows(c, st, c->out[0], c->in[0], c->in[1], 0));
    return check_indices(c, st);
}

extern "C" tm_status tm__scatter_add_backward_cuda(tm__call *c) {
    tm_tensor *dsrc = c->gin[0];
    const tm_tensor *idx = c->in[1];
    int64_t M = c->in[0]->shape[0], C = c->in[0]->shape[1], R = c->iattr[0];
    if (!dsrc || M * C == 0) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "scatter_add", &st));
    IDX_LAUNCH(dsrc->dtype, idx->dtype, ix_gather_rows_add_kernel, tm__cu_blocks(st, M * C), TM__CU_THREADS, st->stream,
               tm__data(dsrc), tm__data(c->gout[0]), tm__data(idx), M, R, C);
    TM__CU_LAUNCHED(c->ctx, "scatter_add", "ix_gather_rows_add_kernel");
    return TM_OK;
}

/* ---- index_check ------------------------------------------------------------------------------- */

template <typename I>
__global__ void ix_index_check_kernel(I *safe, unsigned long long *fb, const I *ids, int64_t n, int64_t hi,
                                      int64_t ign) {
    TM__CU_GRID_STRIDE(i, n) {
        int64_t v = (int64_t)ids[i];
        bool ok = (v >= 0 && v < hi) || v == ign;
        safe[i] = ok ? ids[i] : (I)ign;
        if (!ok) atomicMin(fb, (unsigned long long)i);
    }
}

extern "C" tm_status tm__index_check_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "index_check";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *ids = c->in[0];
    const int64_t n = tm__numel(ids), hi = c->iattr[0], ign = c->iattr[1];
    int64_t *fb = (int64_t *)tm__data(c->out[1]);
    TM__CU_CHECK(ctx, what, cudaMemsetAsync(fb, 0xff, sizeof(int64_t), st->stream)); /* -1: none yet */
    unsigned g = tm__cu_blocks(st, n);
    unsigned long long *pos = (unsigned long long *)fb;
    void *safe = tm__data(c->out[0]);
    const void *v = tm__data(ids);
    if (ids->dtype == TM_I32) {
        if (n > 0)
            ix_index_check_kernel<<<g, TM__CU_THREADS, 0, st->stream>>>((int32_t *)safe, pos, (const int32_t *)v, n, hi,
                                                                        ign);
        ix_first_bad_value_kernel<<<1, 1, 0, st->stream>>>(fb, (const int32_t *)v);
    } else {
        if (n > 0)
            ix_index_check_kernel<<<g, TM__CU_THREADS, 0, st->stream>>>((int64_t *)safe, pos, (const int64_t *)v, n, hi,
                                                                        ign);
        ix_first_bad_value_kernel<<<1, 1, 0, st->stream>>>(fb, (const int64_t *)v);
    }
    TM__CU_LAUNCHED(ctx, what, "ix_index_check_kernel / ix_first_bad_value_kernel");
    return TM_OK;
}
