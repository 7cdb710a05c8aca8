/*
 * moe_dispatch.c — CPU kernels of tm_moe_drop_tokens, tm_moe_permute and tm_moe_unpermute.
 * T tokens, H hidden size, E experts, R permuted rows. A (t,e) is "routed" where
 * routing_map[t,e] != 0.
 *
 * moe_drop_tokens (Megatron apply_router_token_dropping, without pad_to_capacity)
 *   in[0]  probs        (T, E) float
 *   in[1]  routing_map  (T, E) u8
 *   iattr  [0] capacity >= 0, [1] policy (tm_drop_policy)
 *   out[0] probs_kept   (T, E) probs' dtype: probs where kept, 0 elsewhere
 *   out[1] map_kept     (T, E) u8 0/1
 *   out[2] dropped      ()     i64: routed pairs removed
 *   out[3] tokens_per_expert (E) i64: routed pairs kept per expert (column sums of map_kept)
 *   Per expert, at most `capacity` routed tokens survive: TM_DROP_POSITION keeps the first
 *   ones (lowest t); TM_DROP_PROBS the ones of highest p, ties to the lower t (NaN ranks
 *   lowest). Megatron ranks with torch.topk over the whole column, whose tie order is
 *   unspecified and which may pick unrouted zero-prob tokens; here only routed tokens compete
 *   and the order is total, so the kept set is a function of the inputs alone.
 *   Backward (reads map_kept, no saved tensors): d probs += d probs_kept * map_kept.
 *
 * moe_permute (TE moe_permute / token_dispatch with align_size; flag TM__OP_NATIVE_BF16: it
 * only moves rows, so bf16 x and probs are permuted bit-exactly, never staged through f32)
 *   in[0]  x            (T, H) float
 *   in[1]  routing_map  (T, E) u8
 *   in[2]  probs        (T, E) float
 *   iattr  [0] align_size >= 1, [1] pad_to >= 0, [2] topk in [0, E] (0: not known; else every
 *          token routes to exactly topk experts: tm_moe_permute_topk)
 *   out[0] permuted       (R, H) x's dtype
 *   out[1] permuted_probs (R)    probs' dtype
 *   out[2] row_token      (R)    i64, -1 on padding rows
 *   out[3] tokens_per_expert (E) i64, rows of each expert including padding
 *   saved[0] row_of     (T, E) i64: the row of routed (t,e), -1 elsewhere
 *   Rows are expert-major and token-ascending within an expert; expert e's block holds its
 *   n_e routed tokens followed by zero padding up to round_up(n_e, align_size), or up to exactly
 *   pad_to rows when pad_to > 0 (then n_e > pad_to is an error: drop tokens first). R is the
 *   sum of the blocks, so out[0..2] are allocated here, not in the check. Synchronisation
 *   rule (tm__moe_permute_fixed_rows, shared with CUDA): R is known without the data when
 *   pad_to > 0 (E * pad_to) or topk > 0 with align_size 1 (T * topk; here the count is
 *   checked, TM_ERR_INVALID_ARG when it differs); otherwise a device reads the counts back for
 *   R, one synchronisation counted on the CPU too (tm_ctx_sync_count). out[3] gets a host
 *   mirror (internal.h), from which grouped_matmul takes its group sizes without another
 *   synchronisation, where a device has the values on the host: after that read, or pad_to
 *   each; with R = T * topk it has none (the first grouped_matmul on it reads once).
 *   Backward: dx[t] += sum over t's rows in ascending row order of d permuted[row] (summed in
 *   f64, added once); d probs[t,e] += d permuted_probs[row_of[t,e]]. Padding rows feed nothing.
 *   A fresh dx / d probs (call->gin_fresh, TM__OP_GRAD_WRITES) is written as 0 + x, with 0 for
 *   tokens without rows and unrouted (t, e).
 *
 * moe_unpermute (TE moe_unpermute / combine)
 *   in[0]  expert_out     (R, H) float
 *   in[1]  row_token      (R)    i64 or i32, each in [-1, num_tokens)
 *   in[2]  permuted_probs (R)    optional (n_in 3); absent: every weight is 1
 *   iattr  [0] num_tokens
 *   out[0] y              (num_tokens, H) expert_out's dtype
 *   y[t] = sum over rows r with row_token[r] = t, ascending, of expert_out[r] * p[r], summed in
 *   the compute dtype (f32; f64 for f64) and rounded to bf16 once by the dispatcher; rows with
 *   row_token -1 are padding and skipped, tokens without rows get 0. A row_token outside
 *   [-1, num_tokens) is TM_ERR_INDEX here; the CUDA kernel skips such rows instead (it does not
 *   read row_token back, see kernels/cuda/moe_dispatch.cu).
 *   Backward: d expert_out[r] += dy[t] * p[r]; d p[r] += <expert_out[r], dy[t]> (f64 dot);
 *   nothing for padding rows. A fresh gradient (call->gin_fresh, TM__OP_GRAD_WRITES) is
 *   written instead, as 0 + x, with padding rows 0.
 *
 * Parallelism and determinism: every parallel loop gives each output element to exactly one
 * iteration (rows for the permute copy and the unpermute backward, tokens for the permute
 * backward and the unpermute forward, experts for the drop selection), and each iteration
 * sums in a fixed order, so results are bit-identical for any thread count and no atomics are
 * needed. The index bookkeeping (counts, row assignment, the token -> rows index) is a serial
 * O(T*E) or O(R) integer pass, small next to the O(R*H) row traffic it organises.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "internal.h"

enum { PAR_MIN = 1 << 15 };

/* Arena scratch on the host; a zero-byte request still gets a valid pointer. */
static void *scratch(tm_ctx *ctx, size_t nbytes) {
    return tm__arena_alloc(ctx, tm_cpu(), nbytes ? nbytes : TM__ALIGN);
}

static inline double ld(const void *p, tm_dtype dt, int64_t i) {
    switch (dt) {
    case TM_F32: return ((const float *)p)[i];
    case TM_F64: return ((const double *)p)[i];
    default: return tm__bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

static inline void st(void *p, tm_dtype dt, int64_t i, double v) {
    switch (dt) {
    case TM_F32: ((float *)p)[i] = (float)v; break;
    case TM_F64: ((double *)p)[i] = v; break;
    default: ((uint16_t *)p)[i] = tm__f32_to_bf16((float)v); break;
    }
}

static tm_status check_kernel_dtype(tm__call *c, const tm_tensor *t) {
    if (t->dtype == TM_F32 || t->dtype == TM_F64) return TM_OK;
    return tm__err(c->ctx, TM_ERR_INTERNAL, "%s: CPU kernel got %s", tm__opname(c), tm__tdesc(c->ctx, t));
}

/* ---- moe_drop_tokens ------------------------------------------------------------------- */

typedef struct drop_cand {
    double p; /* NaN mapped to -inf */
    int64_t t;
} drop_cand;

/* Highest p first, then lowest t: a total order, so qsort's instability cannot show. */
static int cand_cmp(const void *a, const void *b) {
    const drop_cand *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return (x->t > y->t) - (x->t < y->t);
}

tm_status tm__moe_drop_tokens_forward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *probs = c->in[0];
    TM__TRY(check_kernel_dtype(c, probs));
    const int64_t T = probs->shape[0], E = probs->shape[1], cap = c->iattr[0];
    const int policy = (int)c->iattr[1];
    const uint8_t *map = tm__data(c->in[1]);
    uint8_t *keep = tm__data(c->out[1]);
    const void *p = tm__data(probs);
    void *pk = tm__data(c->out[0]);
    const tm_dtype dt = probs->dtype;
    const int nth = tm__nthreads(ctx);

    int64_t *count = scratch(ctx, (size_t)E * sizeof *count);
    if (!count) return TM_ERR_NOMEM;
    memset(count, 0, (size_t)E * sizeof *count);
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) {
            keep[t * E + e] = map[t * E + e] != 0;
            count[e] += keep[t * E + e];
        }
    int64_t dropped = 0, worst = 0;
    for (int64_t e = 0; e < E; e++) {
        if (count[e] > cap) dropped += count[e] - cap;
        if (count[e] > worst) worst = count[e];
    }

    if (dropped) {
        /* Only overflowing experts are visited; each owns its column of keep. */
        drop_cand *cand = NULL;
        if (policy == TM_DROP_PROBS) {
            cand = scratch(ctx, (size_t)nth * (size_t)worst * sizeof *cand);
            if (!cand) return TM_ERR_NOMEM;
        }
#pragma omp parallel for num_threads(nth) if (T * E >= PAR_MIN) schedule(dynamic, 1)
        for (int64_t e = 0; e < E; e++) {
            if (count[e] <= cap) continue;
            if (policy == TM_DROP_POSITION) {
                int64_t seen = 0;
                for (int64_t t = 0; t < T; t++)
                    if (keep[t * E + e] && ++seen > cap) keep[t * E + e] = 0;
                continue;
            }
            drop_cand *l = cand + (int64_t)omp_get_thread_num() * worst;
            int64_t n = 0;
            for (int64_t t = 0; t < T; t++) {
                if (!keep[t * E + e]) continue;
                double v = ld(p, dt, t * E + e);
                l[n].p = isnan(v) ? -INFINITY : v;
                l[n++].t = t;
            }
            qsort(l, (size_t)n, sizeof *l, cand_cmp);
            for (int64_t i = cap; i < n; i++) keep[l[i].t * E + e] = 0;
        }
    }

    const int64_t n = T * E;
    if (dt == TM_F64) {
        const double *pd = p;
        double *od = pk;
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
        for (int64_t i = 0; i < n; i++) od[i] = keep[i] ? pd[i] : 0.0;
    } else {
        const float *pf = p;
        float *of = pk;
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
        for (int64_t i = 0; i < n; i++) of[i] = keep[i] ? pf[i] : 0.0f;
    }
    *(int64_t *)tm__data(c->out[2]) = dropped;
    int64_t *kept = tm__data(c->out[3]);
    for (int64_t e = 0; e < E; e++) kept[e] = count[e] > cap ? cap : count[e];
    return TM_OK;
}

tm_status tm__moe_drop_tokens_backward_cpu(tm__call *c) {
    tm_tensor *gp = c->gin[0];
    if (!gp) return TM_OK;
    const tm_tensor *g = c->gout[0];
    const uint8_t *keep = tm__data(c->out[1]);
    const int64_t n = tm__numel(gp);
    const int nth = tm__nthreads(c->ctx);
    if (gp->dtype == TM_F64) {
        double *d = tm__data(gp);
        const double *s = tm__data(g);
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
        for (int64_t i = 0; i < n; i++)
            if (keep[i]) d[i] += s[i];
    } else {
        float *d = tm__data(gp);
        const float *s = tm__data(g);
#pragma omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)
        for (int64_t i = 0; i < n; i++)
            if (keep[i]) d[i] += s[i];
    }
    return TM_OK;
}

/* ---- moe_permute ----------------------------------------------------------------------- */

tm_status tm__moe_permute_forward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *m = c->in[1], *probs = c->in[2];
    const int64_t T = x->shape[0], H = x->shape[1], E = m->shape[1];
    const uint8_t *map = tm__data(m);
    int64_t *rows = tm__data(c->out[3]);
    int64_t *count = scratch(ctx, (size_t)E * sizeof *count), *next = scratch(ctx, (size_t)E * sizeof *next);
    if (!count || !next) return TM_ERR_NOMEM;

    memset(count, 0, (size_t)E * sizeof *count);
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) count[e] += map[t * E + e] != 0;
    int known;
    int64_t R, R_fixed;
    TM__TRY(tm__moe_permute_fixed_rows(c, &known, &R_fixed));
    /* R sizes the outputs: where it depends on the data a device kernel must read the counts
     * back here, so this is one synchronisation (tm_ctx_sync_count), counted on the CPU too. */
    if (!known) tm__count_sync(ctx);
    TM__TRY(tm__moe_permute_rows(c, count, rows, &R));
    if (known && R != R_fixed && c->iattr[3] > 0) /* tm__moe_permute_counted: the caller's counts */
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "moe_permute: routing_map %s gives %lld rows (align_size %lld), the caller's counts say %lld",
                       tm__tdesc(ctx, m), (long long)R, (long long)c->iattr[0], (long long)R_fixed);
    if (known && R != R_fixed) /* topk promised T * topk routed pairs (pad_to cannot differ) */
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "moe_permute: routing_map routes %lld (token, expert) pairs, not T * topk = %lld * %lld "
                       "(topk promises exactly topk experts per token; routing_map %s)",
                       (long long)R, (long long)T, (long long)c->iattr[2], tm__tdesc(ctx, m));
    /* As on a device, padded counts the host has get a mirror: grouped_matmul on them counts no
     * further synchronisation. With R = T * topk a device has them only on the device: no
     * mirror, the first grouped_matmul on them counts its read. */
    if (!known || c->iattr[1] > 0) TM__TRY(tm__mirror_set(ctx, c->out[3], rows));
    for (int64_t e = 0, o = 0; e < E; o += rows[e], e++) next[e] = o;

    int64_t ps[2] = {R, H}, ts[2] = {T, E};
    tm_tensor *row_of_t;
    TM__TRY(tm__out_new(c, 0, x->dtype, 2, ps));
    TM__TRY(tm__out_new(c, 1, probs->dtype, 1, &R));
    TM__TRY(tm__out_new(c, 2, TM_I64, 1, &R));
    TM__TRY(tm__saved_new(c, TM_I64, 2, ts, &row_of_t));
    int64_t *row_of = tm__data(row_of_t), *row_token = tm__data(c->out[2]);
    void *pp = tm__data(c->out[1]);
    const void *p = tm__data(probs);
    const tm_dtype pdt = probs->dtype;

    /* Walking tokens in order hands each expert its rows in ascending token order. */
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) {
            int64_t i = t * E + e;
            if (!map[i]) {
                row_of[i] = -1;
                continue;
            }
            int64_t r = next[e]++;
            row_of[i] = r;
            row_token[r] = t;
            st(pp, pdt, r, ld(p, pdt, i));
        }
    for (int64_t e = 0, end = 0; e < E; e++) {
        end += rows[e];
        for (int64_t r = next[e]; r < end; r++) {
            row_token[r] = -1;
            st(pp, pdt, r, 0.0);
        }
    }

    const size_t rb = (size_t)H * tm_dtype_size(x->dtype);
    const char *xs = tm__data(x);
    char *dst = tm__data(c->out[0]);
    const int nth = tm__nthreads(ctx);
#pragma omp parallel for num_threads(nth) if (R * H >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        int64_t t = row_token[r];
        if (t < 0) memset(dst + (size_t)r * rb, 0, rb);
        else memcpy(dst + (size_t)r * rb, xs + (size_t)t * rb, rb);
    }
    return TM_OK;
}

/* Element conversions for the backward kernels, which see f32, f64 or (native) bf16. */
#define LD_F(v) ((double)(v))
#define ST_F32(v) ((float)(v))
#define ST_F64(v) (v)
#define LD_BF16(v) ((double)tm__bf16_to_f32(v))
#define ST_BF16(v) tm__f32_to_bf16((float)(v))

#define PERMUTE_BACKWARD_KERNELS(T_, SFX, LD, ST)                                                \
    /* dx (T, H) += sum of g (R, H) over each token's rows. acc: (nth, H) f64 scratch. fresh:     \
     * dx not read, written whole. */                                                            \
    static void permute_dx_##SFX(T_ *dx, const T_ *g, const int64_t *row_of, double *acc,       \
                                 int64_t T, int64_t H, int64_t E, int fresh, int nth) {          \
        _Pragma("omp parallel for num_threads(nth) if (T * H >= PAR_MIN) schedule(static)")      \
        for (int64_t t = 0; t < T; t++) {                                                        \
            double *a = acc + (int64_t)omp_get_thread_num() * H;                                 \
            int any = 0;                                                                         \
            for (int64_t e = 0; e < E; e++) {                                                    \
                int64_t r = row_of[t * E + e];                                                   \
                if (r < 0) continue;                                                             \
                const T_ *gr = g + r * H;                                                        \
                if (!any)                                                                        \
                    for (int64_t h = 0; h < H; h++) a[h] = LD(gr[h]);                            \
                else                                                                             \
                    for (int64_t h = 0; h < H; h++) a[h] += LD(gr[h]);                           \
                any = 1;                                                                         \
            }                                                                                    \
            T_ *d = dx + t * H;                                                                  \
            if (!any) {                                                                          \
                if (fresh) memset(d, 0, (size_t)H * sizeof *d);                                  \
                continue;                                                                        \
            }                                                                                    \
            if (fresh)                                                                           \
                for (int64_t h = 0; h < H; h++) d[h] = ST(0.0 + a[h]);                           \
            else                                                                                 \
                for (int64_t h = 0; h < H; h++) d[h] = ST(LD(d[h]) + a[h]);                      \
        }                                                                                        \
    }                                                                                            \
    /* dprobs (T, E) += gpp[row_of] where routed; fresh: dp = 0 + that, 0 where not routed. */  \
    static void permute_dprobs_##SFX(T_ *dp, const T_ *gpp, const int64_t *row_of, int64_t n,   \
                                     int fresh, int nth) {                                       \
        _Pragma("omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)")          \
        for (int64_t i = 0; i < n; i++)                                                          \
            if (row_of[i] >= 0) dp[i] = ST((fresh ? 0.0 : LD(dp[i])) + LD(gpp[row_of[i]]));      \
            else if (fresh) dp[i] = ST(0.0);                                                     \
    }

PERMUTE_BACKWARD_KERNELS(float, f32, LD_F, ST_F32)
PERMUTE_BACKWARD_KERNELS(double, f64, LD_F, ST_F64)
PERMUTE_BACKWARD_KERNELS(uint16_t, bf16, LD_BF16, ST_BF16)

tm_status tm__moe_permute_backward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *m = c->in[1];
    const int64_t T = x->shape[0], H = x->shape[1], E = m->shape[1];
    const int64_t *row_of = tm__data(c->saved[0]);
    tm_tensor *dx = c->gin[0], *dp = c->gin[2];
    const int nth = tm__nthreads(ctx);
    const int fx = dx && c->gin_fresh[0], fp = dp && c->gin_fresh[2];
    if (dx && T * H > 0) {
        double *acc = scratch(ctx, (size_t)nth * (size_t)H * sizeof *acc);
        if (!acc) return TM_ERR_NOMEM;
        const void *g = tm__data(c->gout[0]);
        switch (dx->dtype) {
        case TM_F32: permute_dx_f32(tm__data(dx), g, row_of, acc, T, H, E, fx, nth); break;
        case TM_F64: permute_dx_f64(tm__data(dx), g, row_of, acc, T, H, E, fx, nth); break;
        default: permute_dx_bf16(tm__data(dx), g, row_of, acc, T, H, E, fx, nth); break;
        }
    }
    if (dp) {
        const void *g = tm__data(c->gout[1]);
        switch (dp->dtype) {
        case TM_F32: permute_dprobs_f32(tm__data(dp), g, row_of, T * E, fp, nth); break;
        case TM_F64: permute_dprobs_f64(tm__data(dp), g, row_of, T * E, fp, nth); break;
        default: permute_dprobs_bf16(tm__data(dp), g, row_of, T * E, fp, nth); break;
        }
    }
    return TM_OK;
}

/* ---- moe_unpermute --------------------------------------------------------------------- */

#define UNPERMUTE_KERNELS(T_, SFX)                                                               \
    /* y (T, H) = sum of w[r] eo[r] over the rows order[start[t] .. start[t+1]) of each token. */ \
    static void unpermute_forward_##SFX(T_ *y, const T_ *eo, const T_ *w, const int64_t *start,  \
                                        const int64_t *order, int64_t T, int64_t H, int nth) {   \
        _Pragma("omp parallel for num_threads(nth) if (T * H >= PAR_MIN) schedule(static)")      \
        for (int64_t t = 0; t < T; t++) {                                                        \
            T_ *yr = y + t * H;                                                                  \
            memset(yr, 0, (size_t)H * sizeof *yr);                                               \
            for (int64_t j = start[t]; j < start[t + 1]; j++) {                                  \
                int64_t r = order[j];                                                            \
                const T_ *er = eo + r * H;                                                       \
                const T_ wr = w ? w[r] : (T_)1;                                                  \
                for (int64_t h = 0; h < H; h++) yr[h] += er[h] * wr;                             \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    /* fd / fw: deo / dw is fresh (call->gin_fresh): written (padding rows 0) as 0 + x, not read */ \
    static void unpermute_backward_##SFX(T_ *deo, T_ *dw, const T_ *dy, const T_ *eo,           \
                                         const T_ *w, const tm_tensor *rt, int64_t R, int64_t H, \
                                         int nth, int fd, int fw) {                              \
        _Pragma("omp parallel for num_threads(nth) if (R * H >= PAR_MIN) schedule(static)")      \
        for (int64_t r = 0; r < R; r++) {                                                        \
            int64_t t = tm__idx(rt, r);                                                          \
            if (t < 0) {                                                                         \
                if (deo && fd) memset(deo + r * H, 0, (size_t)H * sizeof *deo);                  \
                if (dw && fw) dw[r] = 0;                                                         \
                continue;                                                                        \
            }                                                                                    \
            const T_ *dyr = dy + t * H;                                                          \
            if (deo) {                                                                           \
                const T_ wr = w ? w[r] : (T_)1;                                                  \
                T_ *d = deo + r * H;                                                             \
                if (fd)                                                                          \
                    for (int64_t h = 0; h < H; h++) d[h] = (T_)0 + dyr[h] * wr;                  \
                else                                                                             \
                    for (int64_t h = 0; h < H; h++) d[h] += dyr[h] * wr;                         \
            }                                                                                    \
            if (dw) {                                                                            \
                const T_ *er = eo + r * H;                                                       \
                double s = 0.0;                                                                  \
                for (int64_t h = 0; h < H; h++) s += (double)er[h] * dyr[h];                     \
                dw[r] = (T_)((fw ? 0.0 : (double)dw[r]) + s);                                    \
            }                                                                                    \
        }                                                                                        \
    }

UNPERMUTE_KERNELS(float, f32)
UNPERMUTE_KERNELS(double, f64)

tm_status tm__moe_unpermute_forward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *eo = c->in[0], *rt = c->in[1], *w = c->n_in == 3 ? c->in[2] : NULL;
    TM__TRY(check_kernel_dtype(c, eo));
    const int64_t R = eo->shape[0], H = eo->shape[1], T = c->iattr[0];

    int64_t bad = -1;
    for (int64_t r = 0; r < R && bad < 0; r++) {
        int64_t t = tm__idx(rt, r);
        if (t < -1 || t >= T) bad = r;
    }
    if (bad >= 0)
        return tm__err(ctx, TM_ERR_INDEX, "moe_unpermute: row_token[%lld] = %lld is outside [-1, num_tokens = %lld); row_token %s",
                       (long long)bad, (long long)tm__idx(rt, bad), (long long)T, tm__tdesc(ctx, c->src[1]));

    /* Token -> rows index: a stable counting sort of the non-padding rows by token, so each
     * token's rows are summed in ascending row order by the one thread that owns the token. */
    int64_t *start = scratch(ctx, (size_t)(T + 1) * sizeof *start), *order = scratch(ctx, (size_t)R * sizeof *order);
    if (!start || !order) return TM_ERR_NOMEM;
    memset(start, 0, (size_t)(T + 1) * sizeof *start);
    for (int64_t r = 0; r < R; r++) start[tm__idx(rt, r) + 1] += tm__idx(rt, r) >= 0;
    for (int64_t t = 0; t < T; t++) start[t + 1] += start[t];
    for (int64_t r = 0; r < R; r++) {
        int64_t t = tm__idx(rt, r);
        if (t >= 0) order[start[t]++] = r;
    }
    memmove(start + 1, start, (size_t)T * sizeof *start);
    start[0] = 0;

    const int nth = tm__nthreads(ctx);
    if (eo->dtype == TM_F64)
        unpermute_forward_f64(tm__data(c->out[0]), tm__data(eo), w ? tm__data(w) : NULL, start, order, T, H, nth);
    else
        unpermute_forward_f32(tm__data(c->out[0]), tm__data(eo), w ? tm__data(w) : NULL, start, order, T, H, nth);
    return TM_OK;
}

tm_status tm__moe_unpermute_backward_cpu(tm__call *c) {
    const tm_tensor *eo = c->in[0], *rt = c->in[1], *w = c->n_in == 3 ? c->in[2] : NULL;
    tm_tensor *deo = c->gin[0], *dw = c->n_in == 3 ? c->gin[2] : NULL;
    if (!deo && !dw) return TM_OK;
    const int64_t R = eo->shape[0], H = eo->shape[1];
    const int nth = tm__nthreads(c->ctx);
    const int fd = deo && c->gin_fresh[0], fw = dw && c->gin_fresh[2];
    if (eo->dtype == TM_F64)
        unpermute_backward_f64(deo ? tm__data(deo) : NULL, dw ? tm__data(dw) : NULL, tm__data(c->gout[0]),
                               tm__data(eo), w ? tm__data(w) : NULL, rt, R, H, nth, fd, fw);
    else
        unpermute_backward_f32(deo ? tm__data(deo) : NULL, dw ? tm__data(dw) : NULL, tm__data(c->gout[0]),
                               tm__data(eo), w ? tm__data(w) : NULL, rt, R, H, nth, fd, fw);
    return TM_OK;
}
