/*
 * moe_dispatch.cu — CUDA kernels of tm_moe_permute and tm_moe_unpermute. T tokens, H hidden
 * size, E experts, R permuted rows; layouts and results as kernels/cpu/moe_dispatch.c (read
 * its comment first), f32 or bf16 storage.
 *
 * moe_permute
 *   in[0] x (T, H), in[1] routing_map (T, E) u8, in[2] probs (T, E); iattr align_size, pad_to
 *   out[0] permuted (R, H) x's dtype, out[1] permuted_probs (R) probs' dtype,
 *   out[2] row_token (R) i64 (-1 on padding), out[3] tokens_per_expert (E) i64 (with padding)
 *   saved[0] row_of (T, E) i64: the row of routed (t,e), -1 elsewhere
 *   1. permute_rank_kernel, one block per expert: a block-wide exclusive scan down the
 *      expert's column of routing_map gives rank[t,e] (routed tokens t' < t of e) into row_of,
 *      and the expert's routed count.
 *   2. The E counts come back to the host in one copy: the op's one synchronisation (R sizes
 *      the outputs). The host applies the padding rules (tm__moe_permute_rows, shared with the
 *      CPU, so errors and R agree), uploads tokens_per_expert and each expert's first row
 *      (host-to-device copies do not wait), and gives tokens_per_expert a host mirror
 *      (framework/internal.h): grouped_matmul takes its group sizes from there and does not
 *      read them back again.
 *   3. permute_scatter_kernel turns ranks into rows (row = first row of e + rank), fills
 *      row_token and permuted_probs; rows nobody claims are padding (row_token -1, prob 0:
 *      set beforehand by memsets). permute_rows_kernel, one block per row, copies x[row_token]
 *      or zeros. Both move bits (bf16 stays bit-exact, as on the CPU).
 *   Backward, one block per token: dx[t] += sum over e ascending (= ascending rows, the CPU's
 *   order) of d permuted[row_of[t,e]], summed in f32; d probs[t,e] += d permuted_probs[row].
 *
 * moe_unpermute
 *   in[0] expert_out (R, H), in[1] row_token (R) i64 or i32, in[2] permuted_probs (R)
 *   (optional; f32 or bf16 whatever expert_out's dtype); iattr num_tokens; out[0] y (T, H)
 *   y[t] = sum over t's rows in ascending row order of expert_out[r] * p[r], in f32 (the
 *   CPU's order and precision), stored once.
 *   Each token's list of rows is built on the device without a read back: a stable radix sort
 *   (CUB) of the row indices by key row_token + 1 (0 for padding) puts every token's rows
 *   together in ascending order; unpermute_bounds_kernel marks where each token's run starts
 *   and ends; unpermute_forward_kernel, one block per token, sums its run.
 *   Backward, one block per row r of token t: d expert_out[r] += dy[t] p[r];
 *   d p[r] += <expert_out[r], dy[t]> (a block sum in a fixed tree).
 *   row_token outside [-1, num_tokens): the CPU reports TM_ERR_INDEX; validating on the device
 *   would need a read back (a synchronisation per layer), so the CUDA kernels treat such rows
 *   as padding instead: skipped in the forward, no gradient in the backward.
 *
 * Determinism: no float atomics. Every output element is written by one thread, summing in a
 * fixed order; the scans are integer, the radix sort is stable, so results are bit-identical
 * from run to run.
 */
#define CCCL_DISABLE_NVTX /* no profiler ranges from CUB inside the library */
#include <cub/device/device_radix_sort.cuh>
#include <limits.h>

#include "common.cuh"

#define PERMUTE_SCAN_THREADS 256

/* Blocks for a loop of one block per item (rows, tokens): the items, capped to fill the GPU. */
static unsigned per_item_blocks(const tm__cuda *st, int64_t n) {
    int64_t cap = (int64_t)st->num_sms * 32;
    return (unsigned)(n < cap ? (n < 1 ? 1 : n) : cap);
}

/* ---- moe_permute --------------------------------------------------------------------------- */

/* One block per expert e (blockDim PERMUTE_SCAN_THREADS, a multiple of 32): rank[t,e] =
 * number of routed t' < t of expert e, -1 where (t,e) is not routed; count[e] = routed tokens.
 * The column is scanned in chunks of blockDim tokens: warp scans, then a scan of the warp
 * totals, plus the running total of the previous chunks. */
__global__ void permute_rank_kernel(int64_t *rank, int64_t *count, const uint8_t *map, int64_t T, int64_t E) {
    __shared__ int64_t warp_sum[32];
    const int64_t e = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int64_t carry = 0;
    for (int64_t base = 0; base < T; base += blockDim.x) {
        const int64_t t = base + threadIdx.x;
        const int f = t < T && map[t * E + e] != 0;
        int v = f; /* inclusive scan within the warp */
        for (int o = 1; o < 32; o <<= 1) {
            int u = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += u;
        }
        if (lane == 31) warp_sum[warp] = v;
        __syncthreads();
        if (warp == 0) { /* inclusive scan of the warp totals */
            int64_t w = lane < nw ? warp_sum[lane] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                int64_t u = __shfl_up_sync(0xffffffffu, w, o);
                if (lane >= o) w += u;
            }
            if (lane < nw) warp_sum[lane] = w;
        }
        __syncthreads();
        if (t < T) rank[t * E + e] = f ? carry + (warp ? warp_sum[warp - 1] : 0) + (v - f) : -1;
        carry += warp_sum[nw - 1];
        __syncthreads(); /* warp_sum is rewritten by the next chunk */
    }
    if (threadIdx.x == 0) count[e] = carry;
}

/* (t,e) routed: its rank becomes its row first[e] + rank; row_token[row] = t and
 * permuted_probs[row] = probs[t,e] (P: the probs' storage as raw bits). */
template <typename P>
__global__ void permute_scatter_kernel(int64_t *row_of, int64_t *row_token, P *pp, const P *probs, const int64_t *first,
                                       int64_t T, int64_t E) {
    TM__CU_GRID_STRIDE(i, T * E) {
        const int64_t k = row_of[i];
        if (k < 0) continue;
        const int64_t t = i / E, e = i - t * E, r = first[e] + k;
        row_of[i] = r;
        row_token[r] = t;
        pp[r] = probs[i];
    }
}

/* One block per row: permuted[r] = x[row_token[r]], zeros on padding (X: raw bits). */
template <typename X>
__global__ void permute_rows_kernel(X *dst, const X *x, const int64_t *row_token, int64_t R, int64_t H) {
    for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
        const int64_t t = row_token[r];
        X *d = dst + r * H;
        if (t < 0) {
            for (int64_t h = threadIdx.x; h < H; h += blockDim.x) d[h] = (X)0;
        } else {
            const X *s = x + t * H;
            for (int64_t h = threadIdx.x; h < H; h += blockDim.x) d[h] = s[h];
        }
    }
}

/* One block per token: dx[t] += sum over e ascending of g[row_of[t,e]] (f32). */
template <typename T_>
__global__ void permute_dx_kernel(void *dx_, const void *g_, const int64_t *row_of, int64_t T, int64_t H, int64_t E) {
    T_ *dx = (T_ *)dx_;
    const T_ *g = (const T_ *)g_;
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const int64_t *ro = row_of + t * E;
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            float a = 0.0f;
            int any = 0;
            for (int64_t e = 0; e < E; e++) {
                const int64_t r = ro[e];
                if (r < 0) continue;
                a += tm__ld(g + r * H + h);
                any = 1;
            }
            if (any) tm__st(dx + t * H + h, tm__ld(dx + t * H + h) + a);
        }
    }
}

/* dprobs (T, E) += gpp[row_of] where routed. */
template <typename T_>
__global__ void permute_dprobs_kernel(void *dp_, const void *gpp_, const int64_t *row_of, int64_t n) {
    T_ *dp = (T_ *)dp_;
    const T_ *gpp = (const T_ *)gpp_;
    TM__CU_GRID_STRIDE(i, n) {
        const int64_t r = row_of[i];
        if (r >= 0) tm__st(dp + i, tm__ld(dp + i) + tm__ld(gpp + r));
    }
}

extern "C" tm_status tm__moe_permute_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_permute";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *x = c->in[0], *m = c->in[1], *probs = c->in[2];
    const int64_t T = x->shape[0], H = x->shape[1], E = m->shape[1];
    if (E > INT_MAX)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "moe_permute: %lld experts exceed the CUDA grid (routing_map %s)",
                       (long long)E, tm__tdesc(ctx, m));
    int64_t ts[2] = {T, E};
    tm_tensor *row_of_t;
    TM__TRY(tm__saved_new(c, TM_I64, 2, ts, &row_of_t));
    int64_t *row_of = (int64_t *)tm__data(row_of_t);
    const size_t ebytes = (size_t)E * sizeof(int64_t);

    /* 1-2: routed counts, brought back in one copy (the synchronisation). */
    int64_t *count_d, *first_d;
    TM__TRY(tm__cu_scratch(ctx, st, ebytes, (void **)&count_d));
    TM__TRY(tm__cu_scratch(ctx, st, ebytes, (void **)&first_d));
    int64_t *count = (int64_t *)tm__arena_alloc(ctx, tm_cpu(), 2 * ebytes + TM__ALIGN);
    if (!count) return TM_ERR_NOMEM;
    int64_t *first = count + E;
    if (E > 0) {
        permute_rank_kernel<<<(unsigned)E, PERMUTE_SCAN_THREADS, 0, st->stream>>>(
            row_of, count_d, (const uint8_t *)tm__data(m), T, E);
        TM__CU_LAUNCHED(ctx, what, "permute_rank_kernel");
        TM__TRY(tm__cuda_memcpy(ctx, count, count_d, ebytes, TM__D2H));
    } else {
        tm__count_sync(ctx); /* one per forward, as the CPU counts (nothing to wait for here) */
    }

    int64_t R;
    int64_t *rows = (int64_t *)tm__arena_alloc(ctx, tm_cpu(), ebytes + TM__ALIGN);
    if (!rows) return TM_ERR_NOMEM;
    TM__TRY(tm__moe_permute_rows(c, count, rows, &R));
    for (int64_t e = 0, o = 0; e < E; o += rows[e], e++) first[e] = o;
    int64_t ps[2] = {R, H};
    TM__TRY(tm__out_new(c, 0, x->dtype, 2, ps));
    TM__TRY(tm__out_new(c, 1, probs->dtype, 1, &R));
    TM__TRY(tm__out_new(c, 2, TM_I64, 1, &R));
    TM__TRY(tm__cuda_memcpy(ctx, tm__data(c->out[3]), rows, ebytes, TM__H2D));
    TM__TRY(tm__cuda_memcpy(ctx, first_d, first, ebytes, TM__H2D));
    TM__TRY(tm__mirror_set(ctx, c->out[3], rows));

    /* 3: rows. */
    int64_t *row_token = (int64_t *)tm__data(c->out[2]);
    void *pp = tm__data(c->out[1]);
    if (R > 0) {
        TM__CU_CHECK(ctx, what, cudaMemsetAsync(row_token, 0xff, (size_t)R * sizeof(int64_t), st->stream)); /* -1 */
        TM__CU_CHECK(ctx, what, cudaMemsetAsync(pp, 0, (size_t)R * tm_dtype_size(probs->dtype), st->stream));
    }
    if (T * E > 0) {
        unsigned g = tm__cu_blocks(st, T * E);
        if (tm_dtype_size(probs->dtype) == 2)
            permute_scatter_kernel<uint16_t><<<g, TM__CU_THREADS, 0, st->stream>>>(
                row_of, row_token, (uint16_t *)pp, (const uint16_t *)tm__data(probs), first_d, T, E);
        else
            permute_scatter_kernel<uint32_t><<<g, TM__CU_THREADS, 0, st->stream>>>(
                row_of, row_token, (uint32_t *)pp, (const uint32_t *)tm__data(probs), first_d, T, E);
        TM__CU_LAUNCHED(ctx, what, "permute_scatter_kernel");
    }
    if (R * H > 0) {
        unsigned g = per_item_blocks(st, R);
        int threads = tm__cu_row_threads(H);
        if (tm_dtype_size(x->dtype) == 2)
            permute_rows_kernel<uint16_t><<<g, threads, 0, st->stream>>>(
                (uint16_t *)tm__data(c->out[0]), (const uint16_t *)tm__data(x), row_token, R, H);
        else
            permute_rows_kernel<uint32_t><<<g, threads, 0, st->stream>>>(
                (uint32_t *)tm__data(c->out[0]), (const uint32_t *)tm__data(x), row_token, R, H);
        TM__CU_LAUNCHED(ctx, what, "permute_rows_kernel");
    }
    return TM_OK;
}

extern "C" tm_status tm__moe_permute_backward_cuda(tm__call *c) {
    tm_tensor *dx = c->gin[0], *dp = c->gin[2];
    if (!dx && !dp) return TM_OK;
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_permute";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const int64_t T = c->in[0]->shape[0], H = c->in[0]->shape[1], E = c->in[1]->shape[1];
    const int64_t *row_of = (const int64_t *)tm__data(c->saved[0]);
    if (dx && T * H > 0) {
        TM__CU_LAUNCH_FLOAT(dx->dtype, permute_dx_kernel, per_item_blocks(st, T), tm__cu_row_threads(H), 0, st->stream,
                            tm__data(dx), tm__data(c->gout[0]), row_of, T, H, E);
        TM__CU_LAUNCHED(ctx, what, "permute_dx_kernel");
    }
    if (dp && T * E > 0) {
        TM__CU_LAUNCH_FLOAT(dp->dtype, permute_dprobs_kernel, tm__cu_blocks(st, T * E), TM__CU_THREADS, 0, st->stream,
                            tm__data(dp), tm__data(c->gout[1]), row_of, T * E);
        TM__CU_LAUNCHED(ctx, what, "permute_dprobs_kernel");
    }
    return TM_OK;
}

/* ---- moe_unpermute ------------------------------------------------------------------------- */

/* key[r] = row_token[r] + 1 for a row of a token in [0, T), 0 for padding (and for a
 * row_token outside [-1, T), treated as padding); val[r] = r. */
template <typename I>
__global__ void unpermute_keys_kernel(unsigned long long *key, int64_t *val, const I *rt, int64_t R, int64_t T) {
    TM__CU_GRID_STRIDE(r, R) {
        const int64_t t = (int64_t)rt[r];
        key[r] = t >= 0 && t < T ? (unsigned long long)(t + 1) : 0ull;
        val[r] = r;
    }
}

/* Over the sorted keys: token t's rows are sorted positions [lo[t], hi[t]) (both 0 when t
 * has none: lo and hi are zeroed beforehand). */
__global__ void unpermute_bounds_kernel(int64_t *lo, int64_t *hi, const unsigned long long *key, int64_t R) {
    TM__CU_GRID_STRIDE(i, R) {
        const unsigned long long k = key[i];
        if (k == 0) continue;
        const int64_t t = (int64_t)k - 1;
        if (i == 0 || key[i - 1] != k) lo[t] = i;
        if (i == R - 1 || key[i + 1] != k) hi[t] = i + 1;
    }
}

/* One block per token: y[t] = sum over j in [lo[t], hi[t]) of eo[order[j]] * w[order[j]]. */
template <typename T_, typename W>
__global__ void unpermute_forward_kernel(void *y_, const void *eo_, const void *w_, const int64_t *order,
                                         const int64_t *lo, const int64_t *hi, int64_t T, int64_t H) {
    T_ *y = (T_ *)y_;
    const T_ *eo = (const T_ *)eo_;
    const W *w = (const W *)w_;
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const int64_t j0 = lo[t], j1 = hi[t];
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            float a = 0.0f;
            for (int64_t j = j0; j < j1; j++) {
                const int64_t r = order[j];
                a += tm__ld(eo + r * H + h) * (w ? tm__ld(w + r) : 1.0f);
            }
            tm__st(y + t * H + h, a);
        }
    }
}

/* One block per row r whose token t is in [0, T): deo[r] += dy[t] w[r]; dw[r] += <eo[r], dy[t]>.
 * The skip is the same for the whole block, so every thread reaches tm__block_sum. */
template <typename T_, typename W, typename I>
__global__ void unpermute_backward_kernel(void *deo_, void *dw_, const void *dy_, const void *eo_, const void *w_,
                                          const I *rt, int64_t R, int64_t T, int64_t H) {
    __shared__ float sh[32];
    T_ *deo = (T_ *)deo_;
    W *dw = (W *)dw_;
    const T_ *dy = (const T_ *)dy_, *eo = (const T_ *)eo_;
    const W *w = (const W *)w_;
    for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
        const int64_t t = (int64_t)rt[r];
        if (t < 0 || t >= T) continue;
        const T_ *dyr = dy + t * H;
        if (deo) {
            const float wr = w ? tm__ld(w + r) : 1.0f;
            T_ *d = deo + r * H;
            for (int64_t h = threadIdx.x; h < H; h += blockDim.x) tm__st(d + h, tm__ld(d + h) + tm__ld(dyr + h) * wr);
        }
        if (dw) {
            const T_ *er = eo + r * H;
            float s = 0.0f;
            for (int64_t h = threadIdx.x; h < H; h += blockDim.x) s += tm__ld(er + h) * tm__ld(dyr + h);
            s = tm__block_sum(s, sh);
            if (threadIdx.x == 0) tm__st(dw + r, tm__ld(dw + r) + s);
        }
    }
}

template <typename T_>
static void unpermute_forward_launch(tm_dtype wdt, unsigned grid, int threads, cudaStream_t s, void *y, const void *eo,
                                     const void *w, const int64_t *order, const int64_t *lo, const int64_t *hi,
                                     int64_t T, int64_t H) {
    if (w && wdt == TM_BF16)
        unpermute_forward_kernel<T_, tm__bf16><<<grid, threads, 0, s>>>(y, eo, w, order, lo, hi, T, H);
    else
        unpermute_forward_kernel<T_, float><<<grid, threads, 0, s>>>(y, eo, w, order, lo, hi, T, H);
}

template <typename T_, typename W>
static void unpermute_backward_launch_w(tm_dtype idt, unsigned grid, int threads, cudaStream_t s, void *deo, void *dw,
                                        const void *dy, const void *eo, const void *w, const void *rt, int64_t R,
                                        int64_t T, int64_t H) {
    if (idt == TM_I32)
        unpermute_backward_kernel<T_, W, int32_t><<<grid, threads, 0, s>>>(deo, dw, dy, eo, w, (const int32_t *)rt, R, T, H);
    else
        unpermute_backward_kernel<T_, W, int64_t><<<grid, threads, 0, s>>>(deo, dw, dy, eo, w, (const int64_t *)rt, R, T, H);
}

template <typename T_>
static void unpermute_backward_launch(tm_dtype wdt, tm_dtype idt, unsigned grid, int threads, cudaStream_t s, void *deo,
                                      void *dw, const void *dy, const void *eo, const void *w, const void *rt, int64_t R,
                                      int64_t T, int64_t H) {
    if (w && wdt == TM_BF16)
        unpermute_backward_launch_w<T_, tm__bf16>(idt, grid, threads, s, deo, dw, dy, eo, w, rt, R, T, H);
    else
        unpermute_backward_launch_w<T_, float>(idt, grid, threads, s, deo, dw, dy, eo, w, rt, R, T, H);
}

extern "C" tm_status tm__moe_unpermute_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_unpermute";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *eo = c->in[0], *rt = c->in[1], *w = c->n_in == 3 ? c->in[2] : NULL;
    const int64_t R = eo->shape[0], H = eo->shape[1], T = c->iattr[0];
    void *y = tm__data(c->out[0]);
    if (T * H == 0) return TM_OK;
    if (R == 0) return tm__cuda_memset0(ctx, y, (size_t)(T * H) * tm_dtype_size(eo->dtype));
    if (R > INT_MAX)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "moe_unpermute: %lld rows exceed the CUDA sort's limit (expert_out %s)",
                       (long long)R, tm__tdesc(ctx, eo));

    /* Token -> rows: a stable sort of the row indices by token. */
    unsigned long long *key_in, *key_out;
    int64_t *val_in, *order, *lo, *hi;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)R * sizeof *key_in, (void **)&key_in));
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)R * sizeof *key_out, (void **)&key_out));
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)R * sizeof *val_in, (void **)&val_in));
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)R * sizeof *order, (void **)&order));
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)T * sizeof *lo, (void **)&lo));
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)T * sizeof *hi, (void **)&hi));
    unsigned g = tm__cu_blocks(st, R);
    if (rt->dtype == TM_I32)
        unpermute_keys_kernel<int32_t><<<g, TM__CU_THREADS, 0, st->stream>>>(key_in, val_in, (const int32_t *)tm__data(rt), R, T);
    else
        unpermute_keys_kernel<int64_t><<<g, TM__CU_THREADS, 0, st->stream>>>(key_in, val_in, (const int64_t *)tm__data(rt), R, T);
    TM__CU_LAUNCHED(ctx, what, "unpermute_keys_kernel");
    int end_bit = 0; /* keys are <= T: sort only the bits T has */
    while (end_bit < 64 && (((unsigned long long)T) >> end_bit) != 0) end_bit++;
    size_t tmp_bytes = 0;
    TM__CU_CHECK(ctx, what,
                 cub::DeviceRadixSort::SortPairs(nullptr, tmp_bytes, key_in, key_out, val_in, order, (int)R, 0, end_bit,
                                                 st->stream));
    void *tmp;
    TM__TRY(tm__cu_scratch(ctx, st, tmp_bytes, &tmp));
    TM__CU_CHECK(ctx, what,
                 cub::DeviceRadixSort::SortPairs(tmp, tmp_bytes, key_in, key_out, val_in, order, (int)R, 0, end_bit,
                                                 st->stream));
    TM__CU_CHECK(ctx, what, cudaMemsetAsync(lo, 0, (size_t)T * sizeof *lo, st->stream));
    TM__CU_CHECK(ctx, what, cudaMemsetAsync(hi, 0, (size_t)T * sizeof *hi, st->stream));
    unpermute_bounds_kernel<<<g, TM__CU_THREADS, 0, st->stream>>>(lo, hi, key_out, R);
    TM__CU_LAUNCHED(ctx, what, "unpermute_bounds_kernel");

    unsigned gt = per_item_blocks(st, T);
    int threads = tm__cu_row_threads(H);
    const void *wd = w ? tm__data(w) : NULL;
    tm_dtype wdt = w ? w->dtype : TM_F32;
    if (eo->dtype == TM_BF16)
        unpermute_forward_launch<tm__bf16>(wdt, gt, threads, st->stream, y, tm__data(eo), wd, order, lo, hi, T, H);
    else
        unpermute_forward_launch<float>(wdt, gt, threads, st->stream, y, tm__data(eo), wd, order, lo, hi, T, H);
    TM__CU_LAUNCHED(ctx, what, "unpermute_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__moe_unpermute_backward_cuda(tm__call *c) {
    const tm_tensor *eo = c->in[0], *rt = c->in[1], *w = c->n_in == 3 ? c->in[2] : NULL;
    tm_tensor *deo = c->gin[0], *dw = w ? c->gin[2] : NULL;
    if (!deo && !dw) return TM_OK;
    const int64_t R = eo->shape[0], H = eo->shape[1], T = c->iattr[0];
    if (R == 0 || H == 0) return TM_OK; /* H == 0: every dot product is 0 */
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_unpermute";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    unsigned g = per_item_blocks(st, R);
    int threads = tm__cu_row_threads(H);
    const void *wd = w ? tm__data(w) : NULL;
    tm_dtype wdt = w ? w->dtype : TM_F32;
    void *deo_d = deo ? tm__data(deo) : NULL, *dw_d = dw ? tm__data(dw) : NULL;
    if (eo->dtype == TM_BF16)
        unpermute_backward_launch<tm__bf16>(wdt, rt->dtype, g, threads, st->stream, deo_d, dw_d, tm__data(c->gout[0]),
                                            tm__data(eo), wd, tm__data(rt), R, T, H);
    else
        unpermute_backward_launch<float>(wdt, rt->dtype, g, threads, st->stream, deo_d, dw_d, tm__data(c->gout[0]),
                                         tm__data(eo), wd, tm__data(rt), R, T, H);
    TM__CU_LAUNCHED(ctx, what, "unpermute_backward_kernel");
    return TM_OK;
}
