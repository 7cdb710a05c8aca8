/*
 * indexing.c — CPU kernels of tm_embedding, tm_index_select, tm_gather and tm_scatter_add.
 *
 *   embedding     weight (V, C), ids (S...)  -> out (S..., C)   out[s] = weight[ids[s]]
 *   index_select  x (N, C), idx (M)          -> out (M, C)      out[m] = x[idx[m]]
 *   gather        x (N, C), idx (N, K)       -> out (N, K)      out[n, k] = x[n, idx[n, k]]
 *   scatter_add   src (M, C), idx (M)        -> out (n_rows, C) out[idx[m]] += src[m]
 * No saved tensors: every backward reads the index input and the upstream gradient.
 *
 *   index_check   ids (S...), iattr[0] hi, iattr[1] ignore_index
 *                 -> out[0] safe (S...) ids' dtype: ids[s] where valid, ignore_index elsewhere
 *                    out[1] first_bad (2) i64: {s, ids[s]} of the lowest flat s whose id is
 *                    outside [0, hi) and not ignore_index; {-1, 0} when there is none
 *                 Not differentiable; reports nothing itself (no error for a bad id): the
 *                 caller reads first_bad back when it reads its other results.
 *
 *   iattr[1]      (embedding, index_select, gather, scatter_add) 1: the indices are known valid
 *                 (tm__embedding_unchecked); the CPU checks them all the same
 *
 * Every forward but index_check's checks all indices before it writes anything; the first one out of range
 * (lowest flat position) fails the op with TM_ERR_INDEX, naming its position and value
 * (tm__index_range_err, shared with the CUDA kernels). The CUDA forward reads a flag back to
 * learn this, so these forwards count one synchronisation when they have indices and iattr[1]
 * is 0 (tm_ctx_sync_count; kernels/cuda/indexing.cu).
 *
 * Row scatter-adds (the backward of embedding and index_select, the forward of scatter_add)
 * must be race-free and give the same bits for any thread count, so they never let two threads
 * add into one row: scatter_rows() groups the sources of every destination row with a stable
 * counting sort, then each destination row is owned by one thread, which sums its sources in
 * ascending source order, in f64.
 */
#include <omp.h>

#include "internal.h"

enum { PAR_MIN = 1 << 15 };

/* Arena scratch on the host; a zero-byte request still gets a valid pointer. */
static void *scratch(tm_ctx *ctx, size_t nbytes) {
    return tm__arena_alloc(ctx, tm_cpu(), nbytes ? nbytes : TM__ALIGN);
}

/* TM_ERR_INDEX unless every entry of c->in[1] lies in [0, tm__index_range_hi(c)); the message
 * (tm__index_range_err) names the first one out of range. Counts the synchronisation that the
 * CUDA forward makes to read its bad-index flag back, unless the indices are known valid
 * (iattr[1], tm__embedding_unchecked) or there are none. */
static tm_status check_range(tm__call *c) {
    const tm_tensor *idx = c->in[1];
    int64_t n = tm__numel(idx), first = n, hi = tm__index_range_hi(c);
    if (n > 0 && !c->iattr[1]) tm__count_sync(c->ctx);
    int nth = tm__nthreads(c->ctx);
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) reduction(min : first) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        int64_t v = tm__idx(idx, i);
        if ((v < 0 || v >= hi) && i < first) first = i;
    }
    if (first == n) return TM_OK;
    return tm__index_range_err(c, first, tm__idx(idx, first));
}

static tm_status check_kernel_dtype(tm__call *c, const tm_tensor *t) {
    if (t->dtype == TM_F32 || t->dtype == TM_F64) return TM_OK;
    return tm__err(c->ctx, TM_ERR_INTERNAL, "%s: CPU kernel got %s", tm__opname(c), tm__tdesc(c->ctx, t));
}

#define INDEXING_KERNELS(T, SFX)                                                                 \
    /* dst (R, C) (+)= rows of src (M, C) grouped by destination: the sources of row r are       \
     * order[start[r] .. start[r+1]). acc: (nth, C) f64 scratch. */                              \
    static void scatter_rows_##SFX(T *dst, const T *src, const int64_t *start,                  \
                                   const int64_t *order, double *acc, int64_t R, int64_t M,      \
                                   int64_t C, int accumulate, int nth) {                         \
        _Pragma("omp parallel for num_threads(nth) if ((R + M) * C >= PAR_MIN) schedule(dynamic, 16)") \
        for (int64_t r = 0; r < R; r++) {                                                        \
            T *d = dst + r * C;                                                                  \
            if (start[r] == start[r + 1]) {                                                      \
                if (!accumulate) memset(d, 0, (size_t)C * sizeof *d);                            \
                continue;                                                                        \
            }                                                                                    \
            double *a = acc + (int64_t)omp_get_thread_num() * C;                                 \
            for (int64_t i = 0; i < C; i++) a[i] = accumulate ? (double)d[i] : 0.0;              \
            for (int64_t j = start[r]; j < start[r + 1]; j++) {                                  \
                const T *s = src + order[j] * C;                                                 \
                for (int64_t i = 0; i < C; i++) a[i] += s[i];                                    \
            }                                                                                    \
            for (int64_t i = 0; i < C; i++) d[i] = (T)a[i];                                      \
        }                                                                                        \
    }                                                                                            \
    /* dsrc (M, C) += dout[idx[m]]: the backward of scatter_add, a row gather. */                \
    static void gather_rows_add_##SFX(T *dsrc, const T *dout, const tm_tensor *idx, int64_t M,  \
                                      int64_t C, int nth) {                                      \
        _Pragma("omp parallel for num_threads(nth) if (M * C >= PAR_MIN) schedule(static)")      \
        for (int64_t m = 0; m < M; m++) {                                                        \
            const T *s = dout + tm__idx(idx, m) * C;                                             \
            T *d = dsrc + m * C;                                                                 \
            for (int64_t i = 0; i < C; i++) d[i] += s[i];                                        \
        }                                                                                        \
    }                                                                                            \
    static void gather_forward_##SFX(T *out, const T *x, const tm_tensor *idx, int64_t N,       \
                                     int64_t C, int64_t K, int nth) {                            \
        _Pragma("omp parallel for num_threads(nth) if (N * K >= PAR_MIN) schedule(static)")      \
        for (int64_t n = 0; n < N; n++)                                                          \
            for (int64_t k = 0; k < K; k++) out[n * K + k] = x[n * C + tm__idx(idx, n * K + k)]; \
    }                                                                                            \
    /* Threads own rows of dx, so repeated indices within a row are added by one thread, in     \
     * order. */                                                                                 \
    static void gather_backward_##SFX(T *dx, const T *dout, const tm_tensor *idx, int64_t N,    \
                                      int64_t C, int64_t K, int nth) {                           \
        _Pragma("omp parallel for num_threads(nth) if (N * K >= PAR_MIN) schedule(static)")      \
        for (int64_t n = 0; n < N; n++)                                                          \
            for (int64_t k = 0; k < K; k++) dx[n * C + tm__idx(idx, n * K + k)] += dout[n * K + k]; \
    }

INDEXING_KERNELS(float, f32)
INDEXING_KERNELS(double, f64)

/* dst (R, C) (+)= src (M, C) scattered by idx (M), values known to lie in [0, R).
 * accumulate = 0: dst is overwritten (rows that receive nothing become 0). */
static tm_status scatter_rows(tm__call *c, tm_tensor *dst, const tm_tensor *src, const tm_tensor *idx,
                              int accumulate) {
    tm_ctx *ctx = c->ctx;
    int64_t R = dst->shape[0], C = dst->shape[1], M = tm__numel(idx);
    if (R == 0 || C == 0) return TM_OK;
    int nth = tm__nthreads(ctx);
    int64_t *start = scratch(ctx, (size_t)(R + 1) * sizeof(int64_t));
    int64_t *order = scratch(ctx, (size_t)M * sizeof(int64_t));
    double *acc = scratch(ctx, (size_t)nth * (size_t)C * sizeof(double));
    if (!start || !order || !acc) return TM_ERR_NOMEM;

    /* Stable counting sort of the sources by destination row. After the placement loop
     * start[r] has advanced to the old start[r + 1]; shifting by one restores it. */
    memset(start, 0, (size_t)(R + 1) * sizeof *start);
    for (int64_t m = 0; m < M; m++) start[tm__idx(idx, m) + 1]++;
    for (int64_t r = 0; r < R; r++) start[r + 1] += start[r];
    for (int64_t m = 0; m < M; m++) order[start[tm__idx(idx, m)]++] = m;
    memmove(start + 1, start, (size_t)R * sizeof *start);
    start[0] = 0;

    if (dst->dtype == TM_F64)
        scatter_rows_f64(tm__data(dst), tm__data(src), start, order, acc, R, M, C, accumulate, nth);
    else
        scatter_rows_f32(tm__data(dst), tm__data(src), start, order, acc, R, M, C, accumulate, nth);
    return TM_OK;
}

/* out (M, C) = table[idx[m]] for idx of any shape (M = numel): embedding and index_select. */
static tm_status row_lookup_forward(tm__call *c) {
    const tm_tensor *table = c->in[0], *idx = c->in[1];
    TM__TRY(check_kernel_dtype(c, table));
    int64_t C = table->shape[1], M = tm__numel(idx);
    TM__TRY(check_range(c));
    size_t row = (size_t)C * tm_dtype_size(table->dtype);
    const char *src = tm__data(table);
    char *dst = tm__data(c->out[0]);
    int nth = tm__nthreads(c->ctx);
#pragma omp parallel for num_threads(nth) if (M * C >= PAR_MIN) schedule(static)
    for (int64_t m = 0; m < M; m++) memcpy(dst + (size_t)m * row, src + (size_t)tm__idx(idx, m) * row, row);
    return TM_OK;
}

/* d table += scatter of d out: embedding and index_select. */
static tm_status row_lookup_backward(tm__call *c) {
    if (!c->gin[0]) return TM_OK;
    return scatter_rows(c, c->gin[0], c->gout[0], c->in[1], 1);
}

tm_status tm__embedding_forward_cpu(tm__call *c) { return row_lookup_forward(c); }
tm_status tm__embedding_backward_cpu(tm__call *c) { return row_lookup_backward(c); }
tm_status tm__index_select_forward_cpu(tm__call *c) { return row_lookup_forward(c); }
tm_status tm__index_select_backward_cpu(tm__call *c) { return row_lookup_backward(c); }

tm_status tm__gather_forward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0], *idx = c->in[1];
    TM__TRY(check_kernel_dtype(c, x));
    int64_t N = x->shape[0], C = x->shape[1], K = idx->shape[1];
    TM__TRY(check_range(c));
    int nth = tm__nthreads(c->ctx);
    if (x->dtype == TM_F64)
        gather_forward_f64(tm__data(c->out[0]), tm__data(x), idx, N, C, K, nth);
    else
        gather_forward_f32(tm__data(c->out[0]), tm__data(x), idx, N, C, K, nth);
    return TM_OK;
}

tm_status tm__gather_backward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0], *idx = c->in[1];
    tm_tensor *dx = c->gin[0];
    if (!dx) return TM_OK;
    int64_t N = x->shape[0], C = x->shape[1], K = idx->shape[1];
    int nth = tm__nthreads(c->ctx);
    if (x->dtype == TM_F64)
        gather_backward_f64(tm__data(dx), tm__data(c->gout[0]), idx, N, C, K, nth);
    else
        gather_backward_f32(tm__data(dx), tm__data(c->gout[0]), idx, N, C, K, nth);
    return TM_OK;
}

tm_status tm__scatter_add_forward_cpu(tm__call *c) {
    const tm_tensor *src = c->in[0];
    TM__TRY(check_kernel_dtype(c, src));
    TM__TRY(check_range(c));
    return scatter_rows(c, c->out[0], src, c->in[1], 0);
}

tm_status tm__scatter_add_backward_cpu(tm__call *c) {
    const tm_tensor *src = c->in[0], *idx = c->in[1];
    tm_tensor *dsrc = c->gin[0];
    if (!dsrc) return TM_OK;
    int64_t M = src->shape[0], C = src->shape[1];
    int nth = tm__nthreads(c->ctx);
    if (src->dtype == TM_F64)
        gather_rows_add_f64(tm__data(dsrc), tm__data(c->gout[0]), idx, M, C, nth);
    else
        gather_rows_add_f32(tm__data(dsrc), tm__data(c->gout[0]), idx, M, C, nth);
    return TM_OK;
}

tm_status tm__index_check_forward_cpu(tm__call *c) {
    const tm_tensor *ids = c->in[0];
    const int64_t n = tm__numel(ids), hi = c->iattr[0], ign = c->iattr[1];
    int64_t first = n;
    const int nth = tm__nthreads(c->ctx);
    if (ids->dtype == TM_I32) {
        const int32_t *v = tm__data(ids);
        int32_t *o = tm__data(c->out[0]);
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) reduction(min : first) schedule(static)
        for (int64_t i = 0; i < n; i++) {
            int ok = (v[i] >= 0 && v[i] < hi) || v[i] == ign;
            o[i] = ok ? v[i] : (int32_t)ign;
            if (!ok && i < first) first = i;
        }
    } else {
        const int64_t *v = tm__data(ids);
        int64_t *o = tm__data(c->out[0]);
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) reduction(min : first) schedule(static)
        for (int64_t i = 0; i < n; i++) {
            int ok = (v[i] >= 0 && v[i] < hi) || v[i] == ign;
            o[i] = ok ? v[i] : ign;
            if (!ok && i < first) first = i;
        }
    }
    int64_t *fb = tm__data(c->out[1]);
    fb[0] = first < n ? first : -1;
    fb[1] = first < n ? tm__idx(ids, first) : 0;
    return TM_OK;
}
