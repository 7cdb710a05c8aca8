/*
 * moe_dispatch.cu — CUDA kernels of tm_moe_permute and tm_moe_unpermute. T tokens, H hidden
 * size, E experts, R permuted rows; layouts and results as kernels/cpu/moe_dispatch.c (read
 * its comment first), f32 or bf16 storage.
 *
 * moe_permute
 *   in[0] x (T, H), in[1] routing_map (T, E) u8, in[2] probs (T, E);
 *   iattr align_size, pad_to, topk (0: not known), R + 1 given by the caller (0: not given;
 *   tm__moe_permute_counted)
 *   out[0] permuted (R, H) x's dtype, out[1] permuted_probs (R) probs' dtype,
 *   out[2] row_token (R) i64 (-1 on padding), out[3] tokens_per_expert (E) i64 (with padding)
 *   saved[0] row_of (T, E) i64: the row of routed (t,e), -1 elsewhere
 *   row(t,e) = first[e] + rank(t,e): first[e] = rows of the experts before e (padding
 *   included), rank = routed tokens t' < t of expert e. All of it is computed on the device,
 *   over tiles of 32 tokens (one warp's ballot):
 *   1. permute_count_kernel, a warp per (tile, e): the tile's routed count in column e.
 *   2. permute_scan_kernel, a block per expert: exclusive scan of its column of tile counts,
 *      in place -> each tile's first rank (i32: T <= INT_MAX on CUDA), count[e], and rows[e]
 *      (padded: round_up(count, align_size), or pad_to) straight into tokens_per_expert;
 *      permute_first_kernel, one block: first[e] = exclusive scan of rows.
 *      Scratch: (ceil(T / 32), E) i32, count and first (E) i64.
 *   3. permute_scatter_kernel, a warp per (tile, e): rank = the tile's first rank + routed
 *      lanes below (popc of the ballot); writes row_of, row_token and permuted_probs (bits).
 *      Rows nobody claims are padding (row_token -1, prob 0: memsets beforehand).
 *   4. permute_tokens_kernel, a warp per token: x[t] read once (8 vectors a lane in flight)
 *      and stored to each of its rows (row_of), then the padding rows (row_token -1) zeroed; as
 *      raw 16-byte vectors when the row length and both pointers allow, else 8, 4 or 2 bytes.
 *      (The row-major gather it replaced read each token's row k times.)
 *   Synchronisation rule (tm__moe_permute_fixed_rows, shared with the CPU's counting): when R
 *   is known without the data (pad_to > 0: R = E * pad_to; topk > 0 with align_size 1:
 *   R = T * topk) nothing is read back. With pad_to the host also knows tokens_per_expert
 *   (pad_to each) and mirrors them (framework/internal.h); with topk they stay on the device
 *   without a mirror (a grouped_matmul that needs them on the host reads them itself). Where R
 *   depends on the data (align_size > 1, or neither pad_to nor topk), count[] comes back in
 *   one copy after step 2: the op's one synchronisation; the host applies
 *   tm__moe_permute_rows (the CPU's errors and R) and mirrors the padded counts.
 *   Not validated on the device (that would need a read back): with pad_to, an expert's tokens
 *   past the first pad_to are not placed (row_of -1; the CPU reports TM_ERR_INVALID_ARG);
 *   with topk, a map that does not route T * topk pairs places no row at or past R and leaves
 *   unclaimed rows as padding. No access ever leaves the tensors.
 *   Backward, a warp per token: dx[t] += sum over e ascending (= ascending rows, the CPU's
 *   order) of d permuted[row_of[t,e]], summed in f32. The token's row_of is read once (a
 *   ballot per 32 experts) into a list of its routed rows (up to 32, in shared memory; a
 *   token with more takes a slower loop that rescans row_of per chunk of the row, summing in
 *   the same order); then per chunk of the row the loads of up to 8 rows are all in flight
 *   before they are summed, so the kernel waits on memory once per chunk, not once per row.
 *   d probs[t,e] += d permuted_probs[row] elementwise. A fresh dx / d probs (call->gin_fresh,
 *   TM__OP_GRAD_WRITES) is not read: 0 + the sum is stored, zeros for a token without rows and
 *   for unrouted (t, e), in the same kernels.
 *
 * moe_unpermute
 *   in[0] expert_out (R, H), in[1] row_token (R) i64 or i32, in[2] permuted_probs (R)
 *   (optional; f32 or bf16 whatever expert_out's dtype); iattr num_tokens; out[0] y (T, H)
 *   y[t] = sum over t's rows in ascending row order of expert_out[r] * p[r], in f32 (the
 *   CPU's order and precision), stored once: the prob weighting is fused into the sum.
 *   Each token's list of rows is built on the device without a read back: a stable radix sort
 *   (CUB, 32-bit keys and values) of the row indices by key row_token + 1 (0 for padding)
 *   puts every token's rows together in ascending order; unpermute_bounds_kernel marks where
 *   each token's run starts and ends; unpermute_forward_kernel, a warp per token, sums its
 *   run (row ids and weights fetched 32 at a time, one per lane, and broadcast by shuffles).
 *   The sort's result (order, lo, hi: 4 R + 8 T bytes) is saved for the backward.
 *   Backward, token-major, a warp per token t and each of its rows r (the saved map):
 *   d expert_out[r] += dy[t] p[r]; d p[r] += <expert_out[r], dy[t]>: each lane sums its
 *   elements in order, then a fixed shuffle tree (lane 0 gets the sum). t's rows follow each
 *   other on one warp, so dy[t] comes from memory once and from the cache for the other rows
 *   (the row-major kernel it replaced, a warp per row in row order, fetched it once per row:
 *   k times); each lane loads 4 of its vectors of each operand before computing with them.
 *   Per row the arithmetic and its order are the row-major kernel's, so the same bits.
 *   row_token outside [-1, num_tokens): the CPU reports TM_ERR_INDEX; validating on the device
 *   would need a read back (a synchronisation per layer), so the CUDA kernels treat such rows
 *   as padding instead: skipped in the forward, no gradient in the backward.
 *   A fresh d expert_out / d p (call->gin_fresh, TM__OP_GRAD_WRITES) is written instead of
 *   added to (the accumulator starts at 0.0f, no load), and unpermute_pad_zero_kernel writes 0
 *   to its padding rows (the token-major pass never visits them).
 *
 * Vectorisation: the row kernels move 16 bytes per access (4 f32 or 8 bf16: float4 / uint4
 * loads, bf16 widened exactly, stored rounded to nearest even as tm__st does) when H is a
 * multiple of that and every row pointer they touch is 16-byte aligned; otherwise one element
 * per access (the permute's raw copy steps down to 8, 4 or 2 bytes). A warp per row with 8 rows
 * per block keeps every load of a warp on one contiguous row. The permute's outputs are bit
 * moves; y, dx and d expert_out get the same per-element arithmetic in the same order on
 * either path (and as the earlier block-per-row kernels), so the same bits; only d p's dot
 * product splits a row over the lanes differently on the two paths (each split fixed).
 *
 * Determinism: no float atomics. Every output element is written by one thread, summing in a
 * fixed order; the scans are integer, the radix sort is stable, so results are bit-identical
 * from run to run.
 */
#define CCCL_DISABLE_NVTX /* no profiler ranges from CUB inside the library */
#include <cub/device/device_radix_sort.cuh>
#include <limits.h>

#include "common.cuh"
#include "vec.cuh"

#define DISPATCH_WARPS 8 /* warps per block of the warp-per-item kernels */
#define DISPATCH_THREADS (DISPATCH_WARPS * 32)
#define SCAN_THREADS 256 /* a multiple of 32, at most 1024 (block_scan) */
#define TILE 32          /* tokens per tile of the permute's index passes: one ballot */
#define VECS 2           /* 16-byte vectors per lane held at once by the summing kernels */
#define DX_MAXROWS 32    /* routed rows of a token listed at once by permute_dx_kernel */
#define DX_GROUP 8       /* rows whose loads permute_dx_kernel issues before summing them */
#define PR_VECS 8        /* vectors per lane permute_tokens_kernel loads before storing them */
static_assert(DX_MAXROWS >= 32, "permute_tokens_kernel lists a batch of 32 experts' rows at once");
#define UNP_BATCH 4      /* vectors per lane whose loads unpermute's backward issues at once */
#define FULL 0xffffffffu

/* Blocks of DISPATCH_WARPS warps for a loop of one warp per item, capped to fill the GPU. */
static unsigned warp_blocks(const tm__cuda *st, int64_t n) {
    int64_t b = (n + DISPATCH_WARPS - 1) / DISPATCH_WARPS, cap = (int64_t)st->num_sms * 32;
    if (b > cap) b = cap;
    return (unsigned)(b < 1 ? 1 : b);
}

static inline int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

__device__ __forceinline__ int64_t warp_id() { return ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int64_t warp_count() { return ((int64_t)gridDim.x * blockDim.x) >> 5; }

/* ---- moe_permute --------------------------------------------------------------------------- */

/* Inclusive scan of v over the block (blockDim a multiple of 32, <= 1024); *total = the
 * block's sum. Every thread of the block must call it; sh: 32 int64 of shared memory. */
__device__ __forceinline__ int64_t block_scan(int64_t v, int64_t *sh, int64_t *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const int64_t u = __shfl_up_sync(FULL, v, o);
        if (lane >= o) v += u;
    }
    if (lane == 31) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int64_t w = lane < nw ? sh[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int64_t u = __shfl_up_sync(FULL, w, o);
            if (lane >= o) w += u;
        }
        if (lane < nw) sh[lane] = w;
    }
    __syncthreads();
    const int64_t incl = v + (warp ? sh[warp - 1] : 0);
    *total = sh[nw - 1];
    __syncthreads(); /* sh is rewritten by the next call */
    return incl;
}

/* A warp per item = tile * E + e: tile_cnt[item] = routed tokens among the tile's 32 in
 * expert e's column. */
__global__ void __launch_bounds__(DISPATCH_THREADS)
permute_count_kernel(int32_t *__restrict__ tile_cnt, const uint8_t *__restrict__ map, int64_t T, int64_t E,
                     int64_t items) {
    const int lane = threadIdx.x & 31;
    for (int64_t item = warp_id(); item < items; item += warp_count()) {
        const int64_t tile = item / E, e = item - tile * E, t = tile * TILE + lane;
        const unsigned bal = __ballot_sync(FULL, t < T && map[t * E + e] != 0);
        if (lane == 0) tile_cnt[item] = __popc(bal);
    }
}

/* A block per expert e, in place over the tile counts: tile[i, e] becomes the routed tokens of
 * e in the tiles before i (exclusive scan down the column; <= T <= INT_MAX), count[e] = all of
 * them, rows[e] = its padded row count (the host's tm__moe_permute_rows formula: pad_to, or
 * count rounded up to align). */
__global__ void __launch_bounds__(SCAN_THREADS)
permute_scan_kernel(int32_t *__restrict__ tile, int64_t *__restrict__ count, int64_t *__restrict__ rows, int64_t ntiles,
                    int64_t E, int64_t align, int64_t pad_to) {
    __shared__ int64_t sh[32];
    for (int64_t e = blockIdx.x; e < E; e += gridDim.x) {
        int64_t carry = 0;
        for (int64_t base = 0; base < ntiles; base += blockDim.x) {
            const int64_t i = base + threadIdx.x;
            const int64_t v = i < ntiles ? (int64_t)tile[i * E + e] : 0;
            int64_t tot;
            const int64_t incl = block_scan(v, sh, &tot);
            if (i < ntiles) tile[i * E + e] = (int32_t)(carry + incl - v);
            carry += tot;
        }
        if (threadIdx.x == 0) {
            const int64_t rem = carry % align;
            count[e] = carry;
            rows[e] = pad_to > 0 ? pad_to : carry + (rem ? align - rem : 0);
        }
    }
}

/* One block: first[e] = sum of rows[e'] for e' < e. */
__global__ void __launch_bounds__(SCAN_THREADS)
permute_first_kernel(int64_t *__restrict__ first, const int64_t *__restrict__ rows, int64_t E) {
    __shared__ int64_t sh[32];
    int64_t carry = 0;
    for (int64_t base = 0; base < E; base += blockDim.x) {
        const int64_t i = base + threadIdx.x;
        const int64_t v = i < E ? rows[i] : 0;
        int64_t tot;
        const int64_t incl = block_scan(v, sh, &tot);
        if (i < E) first[i] = carry + incl - v;
        carry += tot;
    }
}

/* A warp per item = tile * E + e, lane = token of the tile: a routed (t,e) of rank k gets row
 * first[e] + k (none past pad_to's block or at/after R: see the top), row_of[t,e] = its row
 * or -1, row_token[row] = t, permuted_probs[row] = probs[t,e] (P: the probs' bits). */
template <typename P>
__global__ void __launch_bounds__(DISPATCH_THREADS)
permute_scatter_kernel(int64_t *__restrict__ row_of, int64_t *__restrict__ row_token, P *__restrict__ pp,
                       const P *__restrict__ probs, const uint8_t *__restrict__ map, const int32_t *__restrict__ tile_off,
                       const int64_t *__restrict__ first, int64_t T, int64_t E, int64_t items, int64_t pad_to, int64_t R) {
    const int lane = threadIdx.x & 31;
    const unsigned below = (1u << lane) - 1u;
    for (int64_t item = warp_id(); item < items; item += warp_count()) {
        const int64_t tile = item / E, e = item - tile * E, t = tile * TILE + lane;
        const int f = t < T && map[t * E + e] != 0;
        const unsigned bal = __ballot_sync(FULL, f);
        if (t < T) {
            int64_t r = -1;
            if (f) {
                const int64_t k = (int64_t)tile_off[item] + __popc(bal & below);
                if (pad_to == 0 || k < pad_to) r = first[e] + k;
                if (r >= R) r = -1;
            }
            row_of[t * E + e] = r;
            if (r >= 0) {
                row_token[r] = t;
                pp[r] = probs[t * E + e];
            }
        }
    }
}

/* x's row s (nv vectors V) into the rows listed by the warp: per chunk of PR_VECS vectors a
 * lane, every load is issued before the chunk is stored to each row, so the row is read once
 * and the warp waits on memory once per chunk. row(j) gives the j-th of the n rows. */
template <typename V, typename RowFn>
__device__ __forceinline__ void permute_copy_token(V *__restrict__ dst, const V *__restrict__ s, int64_t nv, int n,
                                                   int lane, RowFn row) {
    for (int64_t base = 0; base < nv; base += 32 * PR_VECS) {
        V q[PR_VECS];
#pragma unroll
        for (int u = 0; u < PR_VECS; u++) {
            const int64_t v = base + u * 32 + lane;
            if (v < nv) q[u] = s[v];
        }
        for (int j = 0; j < n; j++) {
            V *d = dst + row(j) * nv;
#pragma unroll
            for (int u = 0; u < PR_VECS; u++) {
                const int64_t v = base + u * 32 + lane;
                if (v < nv) d[v] = q[u];
            }
        }
    }
}

/* Token-major: a warp per token t copies x[t] to each of its rows (row_of[t, e] >= 0), reading
 * it once; then the rows nobody claims (row_token -1: padding) are zeroed, a warp per 32
 * rows. The token's rows are listed first (a ballot per 32 experts, into shared memory, as
 * permute_dx_kernel does); a token routed to more than DX_MAXROWS experts is copied per batch
 * of 32 experts instead (x[t] read once per batch). The rows are disjoint, so the order of
 * the stores does not matter: the output is the gather's, bit for bit. V: a raw vector of 16,
 * 8, 4 or 2 bytes, nv of them per row. */
template <typename V>
__global__ void __launch_bounds__(DISPATCH_THREADS)
permute_tokens_kernel(V *__restrict__ dst, const V *__restrict__ x, const int64_t *__restrict__ row_of,
                      const int64_t *__restrict__ row_token, int64_t T, int64_t E, int64_t R, int64_t nv) {
    __shared__ int64_t rows_sh[DISPATCH_WARPS][DX_MAXROWS];
    const int lane = threadIdx.x & 31;
    const unsigned below = (1u << lane) - 1u;
    int64_t *rows = rows_sh[threadIdx.x >> 5];
    for (int64_t t = warp_id(); t < T; t += warp_count()) {
        const int64_t *ro = row_of + t * E;
        __syncwarp(); /* every lane is done reading the previous token's list */
        int64_t n = 0;
        for (int64_t eb = 0; eb < E; eb += 32) {
            const int64_t rl = eb + lane < E ? ro[eb + lane] : -1;
            const unsigned bal = __ballot_sync(FULL, rl >= 0);
            const int64_t pos = n + __popc(bal & below);
            if (rl >= 0 && pos < DX_MAXROWS) rows[pos] = rl;
            n += __popc(bal);
        }
        __syncwarp(); /* the list is visible to every lane */
        const V *s = x + t * nv;
        if (n <= DX_MAXROWS) {
            permute_copy_token(dst, s, nv, (int)n, lane, [&](int j) { return rows[j]; });
            continue;
        }
        for (int64_t eb = 0; eb < E; eb += 32) { /* the list holds one batch at a time */
            const int64_t rl = eb + lane < E ? ro[eb + lane] : -1;
            const unsigned bal = __ballot_sync(FULL, rl >= 0);
            __syncwarp(); /* the previous batch's list is read */
            if (rl >= 0) rows[__popc(bal & below)] = rl;
            __syncwarp();
            permute_copy_token(dst, s, nv, __popc(bal), lane, [&](int j) { return rows[j]; });
        }
    }
    V zero;
    memset(&zero, 0, sizeof zero);
    for (int64_t base = warp_id() * 32; base < R; base += warp_count() * 32) {
        const int64_t r = base + lane;
        unsigned bal = __ballot_sync(FULL, r < R && row_token[r] < 0);
        while (bal) {
            const int j = __ffs(bal) - 1;
            bal &= bal - 1u;
            V *d = dst + (base + j) * nv;
            for (int64_t v = lane; v < nv; v += 32) d[v] = zero;
        }
    }
}

template <typename V>
static void permute_tokens_launch(const tm__cuda *st, void *dst, const void *x, const int64_t *row_of,
                                  const int64_t *row_token, int64_t T, int64_t E, int64_t R, int64_t row_bytes) {
    const int64_t items = T > (R + 31) / 32 ? T : (R + 31) / 32;
    permute_tokens_kernel<V><<<warp_blocks(st, items), DISPATCH_THREADS, 0, st->stream>>>(
        (V *)dst, (const V *)x, row_of, row_token, T, E, R, row_bytes / (int64_t)sizeof(V));
}

/* The old per-chunk scan, for a token with more than DX_MAXROWS routed rows (a map routing a
 * token to over 32 experts): for each chunk of the row, the routed e are found 32 at a time
 * (a ballot over row_of >= 0) and taken in ascending order; dxt: the token's row of dx. */
template <typename T_, int N>
__device__ void permute_dx_scan(T_ *__restrict__ dxt, const T_ *__restrict__ g, const int64_t *__restrict__ ro, int64_t H,
                                int64_t E, int lane, int fresh) {
    const int64_t nv = H / N;
    for (int64_t base = 0; base < nv; base += 32 * VECS) {
        float a[VECS][N];
#pragma unroll
        for (int u = 0; u < VECS; u++)
#pragma unroll
            for (int i = 0; i < N; i++) a[u][i] = 0.0f;
        for (int64_t eb = 0; eb < E; eb += 32) {
            const int64_t rl = eb + lane < E ? ro[eb + lane] : -1;
            unsigned bal = __ballot_sync(FULL, rl >= 0);
            while (bal) {
                const int j = __ffs(bal) - 1;
                bal &= bal - 1u;
                const int64_t r = __shfl_sync(FULL, rl, j);
#pragma unroll
                for (int u = 0; u < VECS; u++) {
                    const int64_t v = base + u * 32 + lane;
                    if (v < nv) {
                        float x[N];
                        tm__vld<N>(g + r * H + v * N, x);
#pragma unroll
                        for (int i = 0; i < N; i++) a[u][i] += x[i];
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < VECS; u++) {
            const int64_t v = base + u * 32 + lane;
            if (v < nv) {
                T_ *d = dxt + v * N;
                float o[N];
                if (fresh) {
#pragma unroll
                    for (int i = 0; i < N; i++) o[i] = 0.0f;
                } else {
                    tm__vld<N>(d, o);
                }
#pragma unroll
                for (int i = 0; i < N; i++) o[i] = o[i] + a[u][i];
                tm__vst<N>(d, o);
            }
        }
    }
}

/* A warp per token: dx[t] += sum over e ascending of g[row_of[t,e]] (f32). The token's row_of
 * is scanned once (a ballot per 32 experts) into a per-warp list of its routed rows in
 * ascending e; then, per chunk of VECS groups of N elements a lane, the loads of DX_GROUP
 * rows (and of dx) are all issued before any is summed, so the warp waits on one memory
 * latency per group, not one per row. The sum is the fallback's, element for element: 0,
 * then + each row in ascending e, then dx + that (the same bits). A token with more than
 * DX_MAXROWS routed rows takes the fallback permute_dx_scan. fresh: dx is a fresh gradient
 * (call->gin_fresh, TM__OP_GRAD_WRITES): not read, 0 + the sum stored, a token without routed
 * rows gets zeros. */
template <typename T_, int N>
__global__ void __launch_bounds__(DISPATCH_THREADS)
permute_dx_kernel(void *dx_, const void *g_, const int64_t *__restrict__ row_of, int64_t T, int64_t H, int64_t E,
                  int fresh) {
    using raw = typename tm__vraw<T_, N>::type;
    __shared__ int64_t rows_sh[DISPATCH_WARPS][DX_MAXROWS];
    T_ *__restrict__ dx = (T_ *)dx_;
    const T_ *__restrict__ g = (const T_ *)g_;
    const int lane = threadIdx.x & 31;
    const unsigned below = (1u << lane) - 1u;
    int64_t *rows = rows_sh[threadIdx.x >> 5];
    const int64_t nv = H / N;
    for (int64_t t = warp_id(); t < T; t += warp_count()) {
        const int64_t *ro = row_of + t * E;
        __syncwarp(); /* every lane is done reading the previous token's list */
        int64_t n = 0;
        for (int64_t eb = 0; eb < E; eb += 32) {
            const int64_t rl = eb + lane < E ? ro[eb + lane] : -1;
            const unsigned bal = __ballot_sync(FULL, rl >= 0);
            const int64_t pos = n + __popc(bal & below);
            if (rl >= 0 && pos < DX_MAXROWS) rows[pos] = rl;
            n += __popc(bal);
        }
        __syncwarp(); /* the list is visible to every lane */
        T_ *dxt = dx + t * H;
        if (n == 0) { /* no routed row: dx[t] untouched, or zeros when fresh */
            if (fresh)
                for (int64_t h = lane; h < H; h += 32) tm__st(dxt + h, 0.0f);
            continue;
        }
        if (n > DX_MAXROWS) {
            permute_dx_scan<T_, N>(dxt, g, ro, H, E, lane, fresh);
            continue;
        }
        const int nr = (int)n;
        for (int64_t base = 0; base < nv; base += 32 * VECS) {
            float a[VECS][N];
            raw o[VECS];
#pragma unroll
            for (int u = 0; u < VECS; u++) {
#pragma unroll
                for (int i = 0; i < N; i++) a[u][i] = 0.0f;
                const int64_t v = base + u * 32 + lane;
                if (v < nv && !fresh) o[u] = tm__vldraw<N>(dxt + v * N);
            }
            for (int j0 = 0; j0 < nr; j0 += DX_GROUP) {
                raw q[DX_GROUP][VECS];
#pragma unroll
                for (int jj = 0; jj < DX_GROUP; jj++)
                    if (j0 + jj < nr) {
                        const T_ *gr = g + rows[j0 + jj] * H;
#pragma unroll
                        for (int u = 0; u < VECS; u++) {
                            const int64_t v = base + u * 32 + lane;
                            if (v < nv) q[jj][u] = tm__vldraw<N>(gr + v * N);
                        }
                    }
#pragma unroll
                for (int jj = 0; jj < DX_GROUP; jj++)
                    if (j0 + jj < nr) {
#pragma unroll
                        for (int u = 0; u < VECS; u++) {
                            const int64_t v = base + u * 32 + lane;
                            if (v < nv) {
                                float x[N];
                                tm__vwiden<N, T_>(q[jj][u], x);
#pragma unroll
                                for (int i = 0; i < N; i++) a[u][i] += x[i];
                            }
                        }
                    }
            }
#pragma unroll
            for (int u = 0; u < VECS; u++) {
                const int64_t v = base + u * 32 + lane;
                if (v < nv) {
                    float f[N];
                    if (fresh) {
#pragma unroll
                        for (int i = 0; i < N; i++) f[i] = 0.0f;
                    } else {
                        tm__vwiden<N, T_>(o[u], f);
                    }
#pragma unroll
                    for (int i = 0; i < N; i++) f[i] = f[i] + a[u][i];
                    tm__vst<N>(dxt + v * N, f);
                }
            }
        }
    }
}

template <typename T_>
static void permute_dx_launch(const tm__cuda *st, int vec, void *dx, const void *g, const int64_t *row_of, int64_t T,
                              int64_t H, int64_t E, int fresh) {
    const unsigned grid = warp_blocks(st, T);
    if (vec)
        permute_dx_kernel<T_, tm__vec_n<T_>::n><<<grid, DISPATCH_THREADS, 0, st->stream>>>(dx, g, row_of, T, H, E, fresh);
    else permute_dx_kernel<T_, 1><<<grid, DISPATCH_THREADS, 0, st->stream>>>(dx, g, row_of, T, H, E, fresh);
}

/* dprobs (T, E) += gpp[row_of] where routed; fresh: dp = 0 + that, 0 where not routed (not read). */
template <typename T_>
__global__ void permute_dprobs_kernel(void *dp_, const void *gpp_, const int64_t *row_of, int64_t n, int fresh) {
    T_ *dp = (T_ *)dp_;
    const T_ *gpp = (const T_ *)gpp_;
    TM__CU_GRID_STRIDE(i, n) {
        const int64_t r = row_of[i];
        if (r >= 0) tm__st(dp + i, (fresh ? 0.0f : tm__ld(dp + i)) + tm__ld(gpp + r));
        else if (fresh) tm__st(dp + i, 0.0f);
    }
}

extern "C" tm_status tm__moe_permute_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_permute";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *x = c->in[0], *m = c->in[1], *probs = c->in[2];
    const int64_t T = x->shape[0], H = x->shape[1], E = m->shape[1], align = c->iattr[0], pad_to = c->iattr[1];
    if (E > INT_MAX || T > INT_MAX)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "moe_permute: %lld tokens or %lld experts exceed the CUDA kernels' "
                       "32-bit ranks and grid (routing_map %s)", (long long)T, (long long)E, tm__tdesc(ctx, m));
    int known;
    int64_t R;
    TM__TRY(tm__moe_permute_fixed_rows(c, &known, &R));
    int64_t ts[2] = {T, E};
    tm_tensor *row_of_t;
    TM__TRY(tm__saved_new(c, TM_I64, 2, ts, &row_of_t));
    int64_t *row_of = (int64_t *)tm__data(row_of_t);
    const uint8_t *map = (const uint8_t *)tm__data(m);
    const size_t ebytes = (size_t)E * sizeof(int64_t);
    int64_t *tpe = (int64_t *)tm__data(c->out[3]);

    /* 1-2: tile counts, their scans (in place), count / rows (= tokens_per_expert) / first per
     * expert. */
    const int64_t ntiles = (T + TILE - 1) / TILE, items = ntiles * E;
    int32_t *tile;
    int64_t *count_d, *first_d;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)items * sizeof *tile, (void **)&tile));
    TM__TRY(tm__cu_scratch(ctx, st, ebytes, (void **)&count_d));
    TM__TRY(tm__cu_scratch(ctx, st, ebytes, (void **)&first_d));
    if (items > 0) {
        permute_count_kernel<<<warp_blocks(st, items), DISPATCH_THREADS, 0, st->stream>>>(tile, map, T, E, items);
        TM__CU_LAUNCHED(ctx, what, "permute_count_kernel");
    }
    if (E > 0) {
        const int64_t cap = (int64_t)st->num_sms * 32;
        permute_scan_kernel<<<(unsigned)(E < cap ? E : cap), SCAN_THREADS, 0, st->stream>>>(
            tile, count_d, tpe, ntiles, E, align, pad_to);
        TM__CU_LAUNCHED(ctx, what, "permute_scan_kernel");
        permute_first_kernel<<<1, SCAN_THREADS, 0, st->stream>>>(first_d, tpe, E);
        TM__CU_LAUNCHED(ctx, what, "permute_first_kernel");
    }

    if (!known) {
        /* R depends on the data: the counts come back in one copy (the synchronisation). */
        int64_t *count = (int64_t *)tm__arena_alloc(ctx, tm_cpu(), 2 * ebytes + TM__ALIGN);
        if (!count) return TM_ERR_NOMEM;
        int64_t *rows = count + E;
        if (E > 0) TM__TRY(tm__cuda_memcpy(ctx, count, count_d, ebytes, TM__D2H));
        else tm__count_sync(ctx); /* one per such forward, as the CPU counts (nothing to wait for here) */
        TM__TRY(tm__moe_permute_rows(c, count, rows, &R));
        TM__TRY(tm__mirror_set(ctx, c->out[3], rows));
    } else if (pad_to > 0) {
        /* tokens_per_expert is pad_to each, whatever the data: the host has it for free. */
        int64_t *rows = (int64_t *)tm__arena_alloc(ctx, tm_cpu(), ebytes + TM__ALIGN);
        if (!rows) return TM_ERR_NOMEM;
        for (int64_t e = 0; e < E; e++) rows[e] = pad_to;
        TM__TRY(tm__mirror_set(ctx, c->out[3], rows));
    }
    int64_t ps[2] = {R, H};
    TM__TRY(tm__out_new(c, 0, x->dtype, 2, ps));
    TM__TRY(tm__out_new(c, 1, probs->dtype, 1, &R));
    TM__TRY(tm__out_new(c, 2, TM_I64, 1, &R));

    /* 3: rows of the routed pairs. */
    int64_t *row_token = (int64_t *)tm__data(c->out[2]);
    void *pp = tm__data(c->out[1]);
    if (R > 0) {
        TM__CU_CHECK(ctx, what, cudaMemsetAsync(row_token, 0xff, (size_t)R * sizeof(int64_t), st->stream)); /* -1 */
        TM__CU_CHECK(ctx, what, cudaMemsetAsync(pp, 0, (size_t)R * tm_dtype_size(probs->dtype), st->stream));
    }
    if (items > 0) {
        const unsigned g = warp_blocks(st, items);
        if (tm_dtype_size(probs->dtype) == 2)
            permute_scatter_kernel<uint16_t><<<g, DISPATCH_THREADS, 0, st->stream>>>(
                row_of, row_token, (uint16_t *)pp, (const uint16_t *)tm__data(probs), map, tile, first_d, T, E, items,
                pad_to, R);
        else
            permute_scatter_kernel<uint32_t><<<g, DISPATCH_THREADS, 0, st->stream>>>(
                row_of, row_token, (uint32_t *)pp, (const uint32_t *)tm__data(probs), map, tile, first_d, T, E, items,
                pad_to, R);
        TM__CU_LAUNCHED(ctx, what, "permute_scatter_kernel");
    }

    /* 4: the row copy, token-major, as wide as the row length and both pointers allow. */
    if (R * H > 0) {
        void *dst = tm__data(c->out[0]);
        const void *src = tm__data(x);
        const int64_t rb = H * (int64_t)tm_dtype_size(x->dtype);
        const uintptr_t a = (uintptr_t)dst | (uintptr_t)src | (uintptr_t)rb;
        if ((a & 15u) == 0) permute_tokens_launch<uint4>(st, dst, src, row_of, row_token, T, E, R, rb);
        else if ((a & 7u) == 0) permute_tokens_launch<uint2>(st, dst, src, row_of, row_token, T, E, R, rb);
        else if ((a & 3u) == 0) permute_tokens_launch<uint32_t>(st, dst, src, row_of, row_token, T, E, R, rb);
        else permute_tokens_launch<uint16_t>(st, dst, src, row_of, row_token, T, E, R, rb);
        TM__CU_LAUNCHED(ctx, what, "permute_tokens_kernel");
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
        void *d = tm__data(dx);
        const void *g = tm__data(c->gout[0]);
        const int64_t n = dx->dtype == TM_BF16 ? tm__vec_n<tm__bf16>::n : tm__vec_n<float>::n;
        const int vec = H % n == 0 && aligned16(d) && aligned16(g);
        if (dx->dtype == TM_BF16) permute_dx_launch<tm__bf16>(st, vec, d, g, row_of, T, H, E, c->gin_fresh[0]);
        else permute_dx_launch<float>(st, vec, d, g, row_of, T, H, E, c->gin_fresh[0]);
        TM__CU_LAUNCHED(ctx, what, "permute_dx_kernel");
    }
    if (dp && T * E > 0) {
        TM__CU_LAUNCH_FLOAT(dp->dtype, permute_dprobs_kernel, tm__cu_blocks(st, T * E), TM__CU_THREADS, 0, st->stream,
                            tm__data(dp), tm__data(c->gout[1]), row_of, T * E, (int)c->gin_fresh[2]);
        TM__CU_LAUNCHED(ctx, what, "permute_dprobs_kernel");
    }
    return TM_OK;
}

/* ---- moe_unpermute ------------------------------------------------------------------------- */

/* key[r] = row_token[r] + 1 for a row of a token in [0, T), 0 for padding (and for a
 * row_token outside [-1, T), treated as padding); val[r] = r. */
template <typename I>
__global__ void unpermute_keys_kernel(unsigned *key, int32_t *val, const I *rt, int64_t R, int64_t T) {
    TM__CU_GRID_STRIDE(r, R) {
        const int64_t t = (int64_t)rt[r];
        key[r] = t >= 0 && t < T ? (unsigned)(t + 1) : 0u;
        val[r] = (int32_t)r;
    }
}

/* Over the sorted keys: token t's rows are sorted positions [lo[t], hi[t]) (both 0 when t
 * has none: lo and hi are zeroed beforehand). */
__global__ void unpermute_bounds_kernel(int32_t *lo, int32_t *hi, const unsigned *key, int64_t R) {
    TM__CU_GRID_STRIDE(i, R) {
        const unsigned k = key[i];
        if (k == 0) continue;
        const int64_t t = (int64_t)k - 1;
        if (i == 0 || key[i - 1] != k) lo[t] = (int32_t)i;
        if (i == R - 1 || key[i + 1] != k) hi[t] = (int32_t)(i + 1);
    }
}

/* A warp per token: y[t] = sum over j in [lo[t], hi[t]) of eo[order[j]] * w[order[j]]. The
 * rows and weights of up to 32 j are fetched one per lane, then broadcast in ascending j;
 * each lane sums VECS groups of N elements. */
template <typename T_, typename W, int N>
__global__ void __launch_bounds__(DISPATCH_THREADS)
unpermute_forward_kernel(void *y_, const void *eo_, const void *w_, const int32_t *__restrict__ order,
                         const int32_t *__restrict__ lo, const int32_t *__restrict__ hi, int64_t T, int64_t H) {
    T_ *__restrict__ y = (T_ *)y_;
    const T_ *__restrict__ eo = (const T_ *)eo_;
    const W *__restrict__ w = (const W *)w_;
    const int lane = threadIdx.x & 31;
    const int64_t nv = H / N;
    for (int64_t t = warp_id(); t < T; t += warp_count()) {
        const int64_t j0 = lo[t], j1 = hi[t];
        for (int64_t base = 0; base < nv; base += 32 * VECS) {
            float a[VECS][N];
#pragma unroll
            for (int u = 0; u < VECS; u++)
#pragma unroll
                for (int i = 0; i < N; i++) a[u][i] = 0.0f;
            for (int64_t jb = j0; jb < j1; jb += 32) {
                int rl = 0;
                float wl = 1.0f;
                if (jb + lane < j1) {
                    rl = order[jb + lane];
                    if (w) wl = tm__ld(w + rl);
                }
                const int n = j1 - jb < 32 ? (int)(j1 - jb) : 32;
                for (int jj = 0; jj < n; jj++) {
                    const int64_t r = __shfl_sync(FULL, rl, jj);
                    const float wv = __shfl_sync(FULL, wl, jj);
#pragma unroll
                    for (int u = 0; u < VECS; u++) {
                        const int64_t v = base + u * 32 + lane;
                        if (v < nv) {
                            float x[N];
                            tm__vld<N>(eo + r * H + v * N, x);
#pragma unroll
                            for (int i = 0; i < N; i++) a[u][i] += x[i] * wv;
                        }
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < VECS; u++) {
                const int64_t v = base + u * 32 + lane;
                if (v < nv) tm__vst<N>(y + t * H + v * N, a[u]);
            }
        }
    }
}

/* Token-major, a warp per token t over its rows (sorted positions [lo[t], hi[t]) of order,
 * the forward's token -> rows map), one row after the other: for each row r,
 * deo[r] += dy[t] w[r] and dw[r] += <eo[r], dy[t]>, each lane summing its elements in order,
 * then a fixed shuffle tree (lane 0 gets the sum), exactly as the row-major kernel it replaced
 * (the same lane -> element split, the same order, the same tree: the same bits). A lane
 * issues the loads of UNP_BATCH of its vectors of each operand before computing with any, so
 * a row costs a memory latency per batch, not per vector. The warp's rows share dy[t]: the
 * first row brings it into the cache and the others read it there, so dy comes from memory
 * once instead of once per row (k times), which is the bandwidth the row-major order spent.
 * Row ids and weights are fetched 32 at a time, one per lane, and broadcast by shuffles. */
template <typename T_, typename W, int N>
__global__ void __launch_bounds__(DISPATCH_THREADS)
unpermute_backward_tokens_kernel(void *deo_, void *dw_, const void *dy_, const void *eo_, const void *w_,
                                 const int32_t *__restrict__ order, const int32_t *__restrict__ lo,
                                 const int32_t *__restrict__ hi, int64_t T, int64_t H, int fd, int fw) {
    using raw = typename tm__vraw<T_, N>::type;
    T_ *__restrict__ deo = (T_ *)deo_;
    W *__restrict__ dw = (W *)dw_;
    const T_ *__restrict__ dy = (const T_ *)dy_;
    const T_ *__restrict__ eo = (const T_ *)eo_;
    const W *__restrict__ w = (const W *)w_;
    const int lane = threadIdx.x & 31;
    const int64_t nv = H / N;
    for (int64_t t = warp_id(); t < T; t += warp_count()) {
        const int64_t j0 = lo[t], j1 = hi[t];
        const T_ *dyr = dy + t * H;
        for (int64_t jb = j0; jb < j1; jb += 32) {
            const int nb = j1 - jb < 32 ? (int)(j1 - jb) : 32;
            int rl = 0;
            float wl = 1.0f;
            if (lane < nb) {
                rl = order[jb + lane];
                if (w) wl = tm__ld(w + rl);
            }
            for (int jj = 0; jj < nb; jj++) {
                const int64_t r = __shfl_sync(FULL, rl, jj);
                const float wr = __shfl_sync(FULL, wl, jj);
                T_ *deor = deo ? deo + r * H : NULL;
                const T_ *eor = eo + r * H;
                float s = 0.0f;
                for (int64_t base = 0; base < nv; base += 32 * UNP_BATCH) {
                    raw gq[UNP_BATCH], oq[UNP_BATCH], eq[UNP_BATCH];
#pragma unroll
                    for (int u = 0; u < UNP_BATCH; u++) {
                        const int64_t v = base + u * 32 + lane;
                        if (v < nv) {
                            gq[u] = tm__vldraw<N>(dyr + v * N);
                            if (deo && !fd) oq[u] = tm__vldraw<N>(deor + v * N);
                            if (dw) eq[u] = tm__vldraw<N>(eor + v * N);
                        }
                    }
#pragma unroll
                    for (int u = 0; u < UNP_BATCH; u++) {
                        const int64_t v = base + u * 32 + lane;
                        if (v < nv) {
                            float g[N];
                            tm__vwiden<N, T_>(gq[u], g);
                            if (deo) {
                                float o[N];
                                if (fd) {
#pragma unroll
                                    for (int i = 0; i < N; i++) o[i] = 0.0f;
                                } else {
                                    tm__vwiden<N, T_>(oq[u], o);
                                }
#pragma unroll
                                for (int i = 0; i < N; i++) o[i] = o[i] + g[i] * wr;
                                tm__vst<N>(deor + v * N, o);
                            }
                            if (dw) {
                                float e[N];
                                tm__vwiden<N, T_>(eq[u], e);
#pragma unroll
                                for (int i = 0; i < N; i++) s += e[i] * g[i];
                            }
                        }
                    }
                }
                if (dw) {
                    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(FULL, s, o);
                    if (lane == 0) tm__st(dw + r, (fw ? 0.0f : tm__ld(dw + r)) + s);
                }
            }
        }
    }
}

template <typename T_, typename W>
static void unpermute_backward_tokens_launch_w(const tm__cuda *st, int vec, void *deo, void *dw, const void *dy,
                                               const void *eo, const void *w, const int32_t *order, const int32_t *lo,
                                               const int32_t *hi, int64_t T, int64_t H, int fd, int fw) {
    const unsigned grid = warp_blocks(st, T);
    if (vec)
        unpermute_backward_tokens_kernel<T_, W, tm__vec_n<T_>::n><<<grid, DISPATCH_THREADS, 0, st->stream>>>(
            deo, dw, dy, eo, w, order, lo, hi, T, H, fd, fw);
    else
        unpermute_backward_tokens_kernel<T_, W, 1><<<grid, DISPATCH_THREADS, 0, st->stream>>>(deo, dw, dy, eo, w, order,
                                                                                             lo, hi, T, H, fd, fw);
}

template <typename T_>
static void unpermute_backward_tokens_launch(const tm__cuda *st, tm_dtype wdt, int vec, void *deo, void *dw,
                                             const void *dy, const void *eo, const void *w, const int32_t *order,
                                             const int32_t *lo, const int32_t *hi, int64_t T, int64_t H, int fd,
                                             int fw) {
    if (w && wdt == TM_BF16)
        unpermute_backward_tokens_launch_w<T_, tm__bf16>(st, vec, deo, dw, dy, eo, w, order, lo, hi, T, H, fd, fw);
    else unpermute_backward_tokens_launch_w<T_, float>(st, vec, deo, dw, dy, eo, w, order, lo, hi, T, H, fd, fw);
}

/* Fresh gradients (call->gin_fresh): the token-major kernel writes the rows of tokens; the
 * padding rows (row_token outside [0, T), as the sort keys them) get 0 here. deo (R, H) and dw
 * (R) of type T_ / W; either may be NULL (not fresh or not wanted). A warp per row: one read of
 * row_token decides, and only padding rows (a few percent of R: the align padding) are written,
 * with 16-byte stores when vec. (An element-wise pass over R H read row_token and divided by H
 * per element: 195 us a layer at fine's shapes, 3% of its step, for rows it mostly skipped.) */
template <typename I, typename T_, typename W>
__global__ void unpermute_pad_zero_kernel(T_ *deo, W *dw, const I *rt, int64_t R, int64_t T, int64_t H, int vec) {
    const int lane = threadIdx.x & 31;
    const int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (r >= R) return;
    const int64_t t = (int64_t)rt[r];
    if (t >= 0 && t < T) return;
    if (dw && lane == 0) tm__st(dw + r, 0.0f);
    if (!deo) return;
    T_ *row = deo + r * H;
    if (vec) {
        constexpr int N = tm__vec_n<T_>::n;
        const float z[N] = {};
        for (int64_t i = (int64_t)lane * N; i < H; i += 32 * N) tm__vst<N>(row + i, z);
    } else {
        for (int64_t i = lane; i < H; i += 32) tm__st(row + i, 0.0f);
    }
}

template <typename T_, typename W>
static void unpermute_pad_zero_launch(const tm__cuda *st, const tm_tensor *rt, void *deo, void *dw, int64_t R,
                                      int64_t T, int64_t H) {
    const int vec = H % tm__vec_n<T_>::n == 0 && aligned16(deo);
    const unsigned g = (unsigned)((R * 32 + TM__CU_THREADS - 1) / TM__CU_THREADS);
    if (rt->dtype == TM_I32)
        unpermute_pad_zero_kernel<int32_t, T_, W><<<g, TM__CU_THREADS, 0, st->stream>>>(
            (T_ *)deo, (W *)dw, (const int32_t *)tm__data(rt), R, T, H, vec);
    else
        unpermute_pad_zero_kernel<int64_t, T_, W><<<g, TM__CU_THREADS, 0, st->stream>>>(
            (T_ *)deo, (W *)dw, (const int64_t *)tm__data(rt), R, T, H, vec);
}

template <typename T_, typename W>
static void unpermute_forward_launch_w(const tm__cuda *st, int vec, void *y, const void *eo, const void *w,
                                       const int32_t *order, const int32_t *lo, const int32_t *hi, int64_t T, int64_t H) {
    const unsigned grid = warp_blocks(st, T);
    if (vec)
        unpermute_forward_kernel<T_, W, tm__vec_n<T_>::n><<<grid, DISPATCH_THREADS, 0, st->stream>>>(y, eo, w, order, lo, hi, T, H);
    else
        unpermute_forward_kernel<T_, W, 1><<<grid, DISPATCH_THREADS, 0, st->stream>>>(y, eo, w, order, lo, hi, T, H);
}

template <typename T_>
static void unpermute_forward_launch(const tm__cuda *st, tm_dtype wdt, int vec, void *y, const void *eo, const void *w,
                                     const int32_t *order, const int32_t *lo, const int32_t *hi, int64_t T, int64_t H) {
    if (w && wdt == TM_BF16) unpermute_forward_launch_w<T_, tm__bf16>(st, vec, y, eo, w, order, lo, hi, T, H);
    else unpermute_forward_launch_w<T_, float>(st, vec, y, eo, w, order, lo, hi, T, H);
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
    if (R > INT_MAX || T > (int64_t)UINT_MAX)
        return tm__err(ctx, TM_ERR_UNSUPPORTED,
                       "moe_unpermute: %lld rows or %lld tokens exceed the CUDA sort's 32-bit keys (expert_out %s)",
                       (long long)R, (long long)T, tm__tdesc(ctx, eo));

    /* Token -> rows: a stable sort of the row indices by token. */
    unsigned *key_in, *key_out;
    int32_t *val_in, *order, *lo, *hi;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)R * sizeof *key_in, (void **)&key_in));
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)R * sizeof *key_out, (void **)&key_out));
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)R * sizeof *val_in, (void **)&val_in));
    /* order, lo, hi: saved for the backward's token-major pass */
    tm_tensor *sv[3];
    TM__TRY(tm__saved_new(c, TM_I32, 1, &R, &sv[0]));
    TM__TRY(tm__saved_new(c, TM_I32, 1, &T, &sv[1]));
    TM__TRY(tm__saved_new(c, TM_I32, 1, &T, &sv[2]));
    order = (int32_t *)tm__data(sv[0]);
    lo = (int32_t *)tm__data(sv[1]);
    hi = (int32_t *)tm__data(sv[2]);
    unsigned g = tm__cu_blocks(st, R);
    if (rt->dtype == TM_I32)
        unpermute_keys_kernel<int32_t><<<g, TM__CU_THREADS, 0, st->stream>>>(key_in, val_in, (const int32_t *)tm__data(rt), R, T);
    else
        unpermute_keys_kernel<int64_t><<<g, TM__CU_THREADS, 0, st->stream>>>(key_in, val_in, (const int64_t *)tm__data(rt), R, T);
    TM__CU_LAUNCHED(ctx, what, "unpermute_keys_kernel");
    int end_bit = 0; /* keys are <= T: sort only the bits T has */
    while (end_bit < 32 && (((unsigned long long)T) >> end_bit) != 0) end_bit++;
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

    const void *wd = w ? tm__data(w) : NULL, *eod = tm__data(eo);
    tm_dtype wdt = w ? w->dtype : TM_F32;
    const int64_t n = eo->dtype == TM_BF16 ? tm__vec_n<tm__bf16>::n : tm__vec_n<float>::n;
    const int vec = H % n == 0 && aligned16(y) && aligned16(eod);
    if (eo->dtype == TM_BF16) unpermute_forward_launch<tm__bf16>(st, wdt, vec, y, eod, wd, order, lo, hi, T, H);
    else unpermute_forward_launch<float>(st, wdt, vec, y, eod, wd, order, lo, hi, T, H);
    TM__CU_LAUNCHED(ctx, what, "unpermute_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__moe_unpermute_backward_cuda(tm__call *c) {
    const tm_tensor *eo = c->in[0], *w = c->n_in == 3 ? c->in[2] : NULL;
    tm_tensor *deo = c->gin[0], *dw = w ? c->gin[2] : NULL;
    if (!deo && !dw) return TM_OK;
    const int64_t R = eo->shape[0], H = eo->shape[1], T = c->iattr[0];
    if (R == 0 || H == 0 || T == 0) { /* H == 0: every dot product is 0; T == 0: every row padding */
        TM__TRY(tm__gin_prepare(c, 0)); /* a fresh gradient of these is all zeros */
        return w ? tm__gin_prepare(c, 2) : TM_OK;
    }
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_unpermute";
    if (c->n_saved != 3)
        return tm__err(ctx, TM_ERR_INTERNAL, "moe_unpermute: backward without the forward's token map (%d saved)",
                       c->n_saved);
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const void *wd = w ? tm__data(w) : NULL, *eod = tm__data(eo), *dyd = tm__data(c->gout[0]);
    tm_dtype wdt = w ? w->dtype : TM_F32;
    void *deo_d = deo ? tm__data(deo) : NULL, *dw_d = dw ? tm__data(dw) : NULL;
    const int64_t n = eo->dtype == TM_BF16 ? tm__vec_n<tm__bf16>::n : tm__vec_n<float>::n;
    const int vec = H % n == 0 && aligned16(deo_d) && aligned16(eod) && aligned16(dyd); /* NULL is aligned */
    /* the forward's token -> rows map (saved by every forward with T, R, H > 0) */
    const int32_t *order = (const int32_t *)tm__data(c->saved[0]), *lo = (const int32_t *)tm__data(c->saved[1]),
                  *hi = (const int32_t *)tm__data(c->saved[2]);
    const int fd = deo && c->gin_fresh[0], fw = dw && c->gin_fresh[2];
    if (fd || fw) {
        void *zd = fd ? deo_d : NULL, *zw = fw ? dw_d : NULL;
        const int wbf = w && wdt == TM_BF16;
        if (eo->dtype == TM_BF16) {
            if (wbf) unpermute_pad_zero_launch<tm__bf16, tm__bf16>(st, c->in[1], zd, zw, R, T, H);
            else unpermute_pad_zero_launch<tm__bf16, float>(st, c->in[1], zd, zw, R, T, H);
        } else {
            if (wbf) unpermute_pad_zero_launch<float, tm__bf16>(st, c->in[1], zd, zw, R, T, H);
            else unpermute_pad_zero_launch<float, float>(st, c->in[1], zd, zw, R, T, H);
        }
        TM__CU_LAUNCHED(ctx, what, "unpermute_pad_zero_kernel");
    }
    if (eo->dtype == TM_BF16)
        unpermute_backward_tokens_launch<tm__bf16>(st, wdt, vec, deo_d, dw_d, dyd, eod, wd, order, lo, hi, T, H, fd, fw);
    else unpermute_backward_tokens_launch<float>(st, wdt, vec, deo_d, dw_d, dyd, eod, wd, order, lo, hi, T, H, fd, fw);
    TM__CU_LAUNCHED(ctx, what, "unpermute_backward_tokens_kernel");
    return TM_OK;
}
