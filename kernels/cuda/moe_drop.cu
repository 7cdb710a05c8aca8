/*
 * moe_drop.cu — CUDA kernels of tm_moe_drop_tokens (capacity-based token dropping). Semantics,
 * layout and tie order are those of kernels/cpu/moe_dispatch.c:
 *   in[0]  probs        (T, E) f32/bf16
 *   in[1]  routing_map  (T, E) u8 (nonzero = routed)
 *   iattr  [0] capacity >= 0, [1] policy (tm_drop_policy)
 *   out[0] probs_kept   (T, E) probs' dtype: probs where kept, 0 elsewhere (bits copied)
 *   out[1] map_kept     (T, E) u8 0/1
 *   out[2] dropped      ()     i64: routed pairs removed
 *   out[3] tokens_per_expert (E) i64: routed pairs kept per expert = min(count_e, capacity)
 *   Per expert, at most `capacity` routed tokens survive: TM_DROP_POSITION keeps the first ones
 *   (lowest t); TM_DROP_PROBS the ones of highest p, ties to the lower t, NaN ranked as -inf.
 *   (Padding every expert to exactly `capacity` rows is the permute's pad_to, not this op's.)
 *   Backward (no saved tensors): d probs += d probs_kept where map_kept.
 *
 * Passes, all on the stream, nothing read back:
 *   1. scan (one block of 256 per expert): walks its column in token order; a block-wide
 *      exclusive scan of the routed flags gives each routed token its position among the
 *      expert's routed tokens; keep = position < capacity (the position policy's answer, and
 *      the probs policy's for experts that do not overflow); count_e = routed tokens. For the
 *      probs policy it also compacts the column's routed (p, t) into scratch, in token order.
 *   2. rank (probs policy; blocks of 256 candidates of one expert, grid (chunks, experts)):
 *      for an overflowing expert, candidate i's rank = #{j : p_j > p_i or (p_j == p_i and
 *      j < i)}, the position of i in the CPU's total order (p descending, t ascending; j < i
 *      is t_j < t_i since the list is in token order); keep = rank < capacity. The candidates
 *      are compared 256 at a time through shared memory: O(n_e^2) comparisons for an expert of
 *      n_e routed tokens, O(T^2) in the worst case (every token on one expert), plenty for
 *      correctness up to T ~ 16k; a sort would be the next step.
 *   3. apply: probs_kept = keep ? probs : 0, elementwise.
 *   4. totals (one block): tokens_per_expert[e] = min(count_e, capacity), dropped = sum of the
 *      excess (integer sums: exact in any order).
 * Scratch: count (E) i64; for the probs policy (E, T) f32 and (E, T) i32 candidate lists.
 */
#include "common.cuh"

#define DROP_THREADS 256

template <typename T>
__global__ void __launch_bounds__(DROP_THREADS)
drop_scan_kernel(unsigned char *keep, float *cand_p, int32_t *cand_t, long long *count, const void *p_,
                 const unsigned char *map, int64_t Tn, int64_t E, long long cap) {
    __shared__ int wsum[DROP_THREADS / 32];
    const T *p = (const T *)p_;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int64_t e = blockIdx.x; e < E; e += gridDim.x) {
        long long base = 0;
        for (int64_t t0 = 0; t0 < Tn; t0 += DROP_THREADS) {
            const int64_t t = t0 + threadIdx.x;
            const int f = t < Tn && map[t * E + e] != 0;
            const unsigned bal = __ballot_sync(0xffffffffu, f);
            if (lane == 0) wsum[w] = __popc(bal);
            __syncthreads();
            int off = 0, tot = 0;
            for (int i = 0; i < DROP_THREADS / 32; i++) {
                off += i < w ? wsum[i] : 0;
                tot += wsum[i];
            }
            const long long pos = base + off + __popc(bal & ((1u << lane) - 1u));
            if (t < Tn) {
                keep[t * E + e] = f && pos < cap;
                if (f && cand_p) {
                    float v = tm__ld(p + t * E + e);
                    cand_p[e * Tn + pos] = v != v ? -INFINITY : v;
                    cand_t[e * Tn + pos] = (int32_t)t;
                }
            }
            base += tot;
            __syncthreads(); /* wsum is rewritten by the next chunk */
        }
        if (threadIdx.x == 0) count[e] = base;
    }
}

__global__ void __launch_bounds__(DROP_THREADS)
drop_rank_kernel(unsigned char *keep, const float *cand_p, const int32_t *cand_t, const long long *count, int64_t Tn,
                 int64_t E, long long cap) {
    __shared__ float tile[DROP_THREADS];
    const int64_t i0 = (int64_t)blockIdx.x * DROP_THREADS, i = i0 + threadIdx.x;
    for (int64_t e = blockIdx.y; e < E; e += gridDim.y) {
        const long long n = count[e];
        if (n <= cap || i0 >= n) continue; /* the same for every thread of the block */
        const float *cp = cand_p + e * Tn;
        const float pi = i < n ? cp[i] : 0.0f;
        long long rank = 0;
        for (int64_t j0 = 0; j0 < n; j0 += DROP_THREADS) {
            if (j0 + threadIdx.x < n) tile[threadIdx.x] = cp[j0 + threadIdx.x];
            __syncthreads();
            const int m = n - j0 < DROP_THREADS ? (int)(n - j0) : DROP_THREADS;
            for (int jj = 0; jj < m; jj++) {
                const float pj = tile[jj];
                rank += pj > pi || (pj == pi && j0 + jj < i);
            }
            __syncthreads(); /* the tile is reloaded */
        }
        if (i < n) keep[(int64_t)cand_t[e * Tn + i] * E + e] = rank < cap;
    }
}

template <typename T>
__global__ void drop_apply_kernel(void *pk_, const void *p_, const unsigned char *keep, int64_t n) {
    T *pk = (T *)pk_;
    const T *p = (const T *)p_;
    TM__CU_GRID_STRIDE(i, n) {
        if (keep[i]) pk[i] = p[i];
        else tm__st(pk + i, 0.0f);
    }
}

__global__ void __launch_bounds__(DROP_THREADS)
drop_totals_kernel(long long *kept, long long *dropped, const long long *count, int64_t E, long long cap) {
    __shared__ long long sh[32];
    long long d = 0;
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
        const long long n = count[e];
        kept[e] = n > cap ? cap : n;
        d += n > cap ? n - cap : 0;
    }
    d = tm__block_sum_ll(d, sh);
    if (threadIdx.x == 0) *dropped = d;
}

extern "C" tm_status tm__moe_drop_tokens_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_drop_tokens";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *probs = c->in[0];
    const int64_t T = probs->shape[0], E = probs->shape[1];
    const long long cap = (long long)c->iattr[0];
    const int by_probs = c->iattr[1] == TM_DROP_PROBS;
    if (by_probs && T > 2147483647)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: %lld tokens exceed the 2^31 - 1 of the CUDA kernel; probs %s", what,
                       (long long)T, tm__tdesc(ctx, probs));
    long long *count;
    float *cand_p = NULL;
    int32_t *cand_t = NULL;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)E * sizeof(long long), (void **)&count));
    if (by_probs && T * E > 0) {
        TM__TRY(tm__cu_scratch(ctx, st, (size_t)(T * E) * sizeof(float), (void **)&cand_p));
        TM__TRY(tm__cu_scratch(ctx, st, (size_t)(T * E) * sizeof(int32_t), (void **)&cand_t));
    }
    unsigned char *keep = (unsigned char *)tm__data(c->out[1]);
    const unsigned eblocks = (unsigned)(E < 65535 ? E : 65535);
    if (E > 0) {
        TM__CU_LAUNCH_FLOAT(probs->dtype, drop_scan_kernel, eblocks, DROP_THREADS, 0, st->stream, keep, cand_p, cand_t,
                            count, tm__data(probs), (const unsigned char *)tm__data(c->in[1]), T, E, cap);
        TM__CU_LAUNCHED(ctx, what, "drop_scan_kernel");
    }
    if (by_probs && T * E > 0) {
        dim3 grid((unsigned)((T + DROP_THREADS - 1) / DROP_THREADS), eblocks);
        drop_rank_kernel<<<grid, DROP_THREADS, 0, st->stream>>>(keep, cand_p, cand_t, count, T, E, cap);
        TM__CU_LAUNCHED(ctx, what, "drop_rank_kernel");
    }
    const int64_t n = T * E;
    if (n > 0) {
        TM__CU_LAUNCH_FLOAT(probs->dtype, drop_apply_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                            tm__data(c->out[0]), tm__data(probs), keep, n);
        TM__CU_LAUNCHED(ctx, what, "drop_apply_kernel");
    }
    drop_totals_kernel<<<1, DROP_THREADS, 0, st->stream>>>((long long *)tm__data(c->out[3]),
                                                           (long long *)tm__data(c->out[2]), count, E, cap);
    TM__CU_LAUNCHED(ctx, what, "drop_totals_kernel");
    return TM_OK;
}

template <typename T>
__global__ void drop_backward_kernel(void *dp_, const void *g_, const unsigned char *keep, int64_t n) {
    T *dp = (T *)dp_;
    const T *g = (const T *)g_;
    TM__CU_GRID_STRIDE(i, n) if (keep[i]) tm__st(dp + i, tm__ld(dp + i) + tm__ld(g + i));
}

extern "C" tm_status tm__moe_drop_tokens_backward_cuda(tm__call *c) {
    tm_tensor *dp = c->gin[0];
    if (!dp) return TM_OK;
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_drop_tokens";
    const int64_t n = tm__numel(dp);
    if (n == 0) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (c->gout[0]->dtype != dp->dtype)
        return tm__err(ctx, TM_ERR_INTERNAL, "%s: CUDA backward got dprobs %s and dprobs_kept %s", what,
                       tm__tdesc(ctx, dp), tm__tdesc(ctx, c->gout[0]));
    TM__CU_LAUNCH_FLOAT(dp->dtype, drop_backward_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                        tm__data(dp), tm__data(c->gout[0]), (const unsigned char *)tm__data(c->out[1]), n);
    TM__CU_LAUNCHED(ctx, what, "drop_backward_kernel");
    return TM_OK;
}
