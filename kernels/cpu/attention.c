/*
 * attention.c — CPU kernels of tm_attention: fused causal scaled-dot-product attention with
 * grouped-query heads, FlashAttention-style (Dao et al. 2022; backward after FlashAttention-2,
 * Dao 2023): the forward keeps only the per-row logsumexp, and the backward rebuilds each
 * probability as P_ij = exp(s_ij - lse_i) instead of storing the (Tq, Tk) matrix.
 *
 * Layout:
 *   in[0]    q    (B, Tq, Hq, D)
 *   in[1]    k    (B, Tk, Hkv, D)     query head h reads kv head h / G, G = Hq / Hkv
 *   in[2]    v    (B, Tk, Hkv, D)
 *   out[0]   o    (B, Tq, Hq, D)
 *   saved[0] lse  (B, Hq, Tq)         logsumexp of the scaled, masked scores of each query row
 * Query i sees keys j < n_i = i + (Tk - Tq) + 1 (the queries are the last Tq of Tk positions),
 * so every row sees at least key 0 and no row is empty.
 *
 * Backward for one query row, with dP_ij = dO_i . v_j and Delta_i = sum_j P_ij dP_ij
 * (= rowsum(dO_i * O_i); taken from the row itself, which needs no O and matches the P
 * being differentiated exactly, also when O was rounded to f32 or bf16):
 *   dS_ij = P_ij (dP_ij - Delta_i)
 *   dq_i += scale sum_j dS_ij k_j,   dk_j += scale dS_ij q_i,   dv_j += P_ij dO_i
 * The backward runs one task per (b, kv head): the task owns dk and dv of its kv head and dq of
 * the G query heads that read it, so the GQA reduction needs no atomics and its order (query
 * head, then row) is fixed, which makes the gradients bitwise reproducible for any thread count.
 * A fresh dq / dk / dv (call->gin_fresh, TM__OP_GRAD_WRITES) is zeroed by the task that owns
 * its rows, just before it accumulates into them (the rows are then in its cache): the same
 * bits as the zero-filled buffer, without the autograd's separate pass over it.
 *
 * Work is done in groups of GROUP = 4 consecutive query rows of one head. The group's scores
 * (and in the backward dP) against every key it sees form a (4, n) block computed by tile4():
 * keys are first transposed to (D, Tk) panels, so the block is a sum over x of a q element
 * times a contiguous run of keys — register accumulators, no horizontal sums (at D = 32 a
 * per-key dot product spends as much on reducing its vector as on multiplying). The forward
 * transposes every (b, kv head) once up front, the backward task its own. The group also
 * shares each load and store of dk_j / dv_j in the backward among its 4 rows. The softmax rows and
 * the D-long axpys are `omp simd` loops; the f32 exponential is tm__exp_f32
 * (kernels/cpu/vecmath.h, <= 1.01 ulp), which vectorises where libm's expf would not.
 *
 * One kernel body, instantiated for f32 (training) and f64 (gradient checks), computes in the
 * storage type and accumulates into the gradients in place. f32 accumulates in f32: the sums
 * run over D (scores), over at most Tk softmax weights in [0, 1] (outputs, dq) and over Tq G rows
 * (dk, dv); tests/test_attention.c bounds the result against the f64 kernel. The f32 group and
 * task functions are also compiled for AVX2 + FMA (TM__SIMD_CLONES); the copy is picked per CPU,
 * never per thread, so the bitwise reproducibility above holds.
 */
#include <math.h>
#include <omp.h>

#include "internal.h"
#include "vecmath.h"

enum { PAR_MIN = 1 << 15 };       /* below this many multiply-adds, stay serial */
enum { GROUP = 4 };               /* query rows per group (the rows of a tile4 block) */
enum { GROUPS_PER_CHUNK = 4 };    /* forward scheduling unit: 16 rows of one (b, h) */
enum { KEY_PAD = 8 };             /* transposed key panels are padded to a multiple of this */

typedef struct attn_dims {
    int64_t B, Tq, Tk, Hq, Hkv, D;
    int64_t G;      /* query heads per kv head */
    int64_t off;    /* Tk - Tq */
    int64_t qs, ks; /* row strides over time of q / o and of k / v: Hq * D, Hkv * D */
    int64_t Tkp;    /* Tk rounded up to KEY_PAD: the row length of panels and score blocks */
    int64_t ngroups; /* row groups per (b, head): ceil(Tq / GROUP) */
    double scale;
} attn_dims;

static attn_dims attn_dims_of(const tm__call *c) {
    const tm_tensor *q = c->in[0], *k = c->in[1];
    attn_dims d;
    d.B = q->shape[0], d.Tq = q->shape[1], d.Hq = q->shape[2], d.D = q->shape[3];
    d.Tk = k->shape[1], d.Hkv = k->shape[2];
    d.G = d.Hq / d.Hkv;
    d.off = d.Tk - d.Tq;
    d.qs = d.Hq * d.D, d.ks = d.Hkv * d.D;
    d.Tkp = (d.Tk + KEY_PAD - 1) / KEY_PAD * KEY_PAD;
    d.ngroups = (d.Tq + GROUP - 1) / GROUP;
    d.scale = c->fattr[0] > 0.0 ? c->fattr[0] : 1.0 / sqrt((double)d.D);
    return d;
}

/*
 * tile4: s[r][j] = sum_x a[r][x] bt[x][j] for the GROUP rows r of a (D contiguous) and the
 * columns j < n rounded up to a whole tile (s and bt rows hold at least that many: Tkp).
 * With GNU vector extensions a tile is GROUP accumulators of one 32-byte vector (8 f32 or 4
 * f64 keys), held in registers over the whole x loop (plain loops would keep them in memory at
 * -O2, as kernels/cpu/gemm.c notes); elsewhere the plain loop. One vector per row, not two:
 * as fast with AVX2 (measured), and the baseline SSE2 copy, which splits each vector in two
 * registers, still has enough of them (two per row spill there and run 4x slower).
 * KEY_PAD is a multiple of every tile width.
 */
#if defined(__GNUC__)
#define TILE4(T, SFX)                                                                            \
    static TM__FORCE_INLINE void tile4_##SFX(T *restrict s, const T *restrict a,                 \
                                             const T *restrict bt, int64_t ld, int64_t n,        \
                                             int64_t D) {                                        \
        typedef T vec __attribute__((vector_size(32)));                                          \
        enum { VW = 32 / sizeof(T) };                                                            \
        for (int64_t j0 = 0; j0 < n; j0 += VW) {                                                 \
            vec acc[GROUP];                                                                      \
            TM__UNROLL(4) for (int r = 0; r < GROUP; r++) acc[r] = (vec){0};                     \
            for (int64_t x = 0; x < D; x++) {                                                    \
                vec b;                                                                           \
                memcpy(&b, bt + x * ld + j0, sizeof b);                                          \
                TM__UNROLL(4) for (int r = 0; r < GROUP; r++) acc[r] += a[r * D + x] * b;        \
            }                                                                                    \
            TM__UNROLL(4) for (int r = 0; r < GROUP; r++) memcpy(s + r * ld + j0, &acc[r], sizeof(vec)); \
        }                                                                                        \
    }
#else
#define TILE4(T, SFX)                                                                            \
    static void tile4_##SFX(T *restrict s, const T *restrict a, const T *restrict bt,            \
                            int64_t ld, int64_t n, int64_t D) {                                  \
        const int64_t n1 = (n + KEY_PAD - 1) / KEY_PAD * KEY_PAD;                                \
        for (int r = 0; r < GROUP; r++) {                                                        \
            for (int64_t j = 0; j < n1; j++) s[r * ld + j] = 0;                                  \
            for (int64_t x = 0; x < D; x++)                                                      \
                for (int64_t j = 0; j < n1; j++) s[r * ld + j] += a[r * D + x] * bt[x * ld + j]; \
        }                                                                                        \
    }
#endif

/*
 * The kernel body for element type T. EXP / LOG: the exponential and logarithm of T; ATTR:
 * attributes of the group / task functions (the SIMD clones for f32).
 *
 * transpose: the (D, Tkp) panel pt[x][j] = m_j[x] of the n rows m_j = m + j * stride, zero
 *            for j >= n.
 * gather:    the GROUP rows src + r * stride (D long) into dst (GROUP, D), zero rows from m on.
 * combine:   y += sum_j w[j] * b_j over the n rows b_j = b + j * stride (D long); four rows
 *            per pass over y.
 */
#define ATTN_KERNELS(T, SFX, EXP, LOG, ATTR)                                                     \
    TILE4(T, SFX)                                                                                \
                                                                                                 \
    static void transpose_##SFX(T *restrict pt, const T *restrict m, int64_t stride, int64_t n,  \
                                int64_t Tkp, int64_t D) {                                        \
        for (int64_t x = 0; x < D; x++) {                                                        \
            T *row = pt + x * Tkp;                                                               \
            for (int64_t j = 0; j < n; j++) row[j] = m[j * stride + x];                          \
            for (int64_t j = n; j < Tkp; j++) row[j] = 0;                                        \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    static TM__FORCE_INLINE void gather_##SFX(T *restrict dst, const T *restrict src,            \
                                              int64_t stride, int m, int64_t D) {                \
        for (int r = 0; r < GROUP; r++)                                                          \
            for (int64_t x = 0; x < D; x++) dst[r * D + x] = r < m ? src[r * stride + x] : 0;    \
    }                                                                                            \
                                                                                                 \
    static TM__FORCE_INLINE void combine_##SFX(T *restrict y, const T *restrict w,               \
                                               const T *restrict b, int64_t stride, int64_t n,   \
                                               int64_t D) {                                      \
        int64_t j = 0;                                                                           \
        for (; j + 4 <= n; j += 4) {                                                             \
            const T *b0 = b + j * stride, *b1 = b0 + stride, *b2 = b1 + stride, *b3 = b2 + stride; \
            const T w0 = w[j], w1 = w[j + 1], w2 = w[j + 2], w3 = w[j + 3];                      \
            _Pragma("omp simd") for (int64_t x = 0; x < D; x++)                                  \
                y[x] += w0 * b0[x] + w1 * b1[x] + w2 * b2[x] + w3 * b3[x];                       \
        }                                                                                        \
        for (; j < n; j++) {                                                                     \
            const T *bj = b + j * stride, wj = w[j];                                             \
            _Pragma("omp simd") for (int64_t x = 0; x < D; x++) y[x] += wj * bj[x];              \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* Forward of the row groups [g0, g1), group g = (b * Hq + h) * ngroups + t holding rows    \
     * 4t .. 4t + 3 of head h; kt: the (B, Hkv, D, Tkp) key panels; s: (GROUP, Tkp) scratch,    \
     * qg: (GROUP, D) scratch. */                                                                \
    ATTR static void forward_groups_##SFX(const attn_dims *d, const T *q, const T *kt,           \
                                          const T *v, T *o, T *lse, T *s, T *qg, int64_t g0,     \
                                          int64_t g1) {                                          \
        const T scale = (T)d->scale;                                                             \
        const int64_t D = d->D, Tkp = d->Tkp;                                                    \
        for (int64_t g = g0; g < g1; g++) {                                                      \
            const int64_t t = g % d->ngroups, h = g / d->ngroups % d->Hq;                        \
            const int64_t b = g / (d->ngroups * d->Hq), hk = h / d->G, i0 = t * GROUP;           \
            const int m = d->Tq - i0 < GROUP ? (int)(d->Tq - i0) : GROUP;                        \
            const int64_t qo = (b * d->Tq + i0) * d->qs + h * D; /* row i0 + r at qo + r * qs */ \
            const T *vb = v + b * d->Tk * d->ks + hk * D;        /* value j at vb + j * ks */    \
                                                                                                 \
            gather_##SFX(qg, q + qo, d->qs, m, D);                                               \
            tile4_##SFX(s, qg, kt + (b * d->Hkv + hk) * D * Tkp, Tkp, i0 + m + d->off, D);       \
            for (int r = 0; r < m; r++) {                                                        \
                const int64_t n = i0 + r + d->off + 1;                                           \
                T *sr = s + r * Tkp, *oi = o + qo + r * d->qs;                                   \
                T mx = -INFINITY;                                                                \
                _Pragma("omp simd reduction(max : mx)") for (int64_t j = 0; j < n; j++)          \
                    mx = sr[j] > mx ? sr[j] : mx;                                                \
                mx *= scale;                                                                     \
                T sum = 0;                                                                       \
                _Pragma("omp simd reduction(+ : sum)") for (int64_t j = 0; j < n; j++) {         \
                    sr[j] = EXP(scale * sr[j] - mx);                                             \
                    sum += sr[j];                                                                \
                }                                                                                \
                for (int64_t x = 0; x < D; x++) oi[x] = 0;                                       \
                combine_##SFX(oi, sr, vb, d->ks, n, D);                                          \
                const T inv = 1 / sum;                                                           \
                _Pragma("omp simd") for (int64_t x = 0; x < D; x++) oi[x] *= inv;                \
                lse[(b * d->Hq + h) * d->Tq + i0 + r] = mx + LOG(sum);                           \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* Backward of one (b, kv head) task, accumulating into dq / dk / dv (each NULL when not    \
     * wanted; fresh[0..2]: zeroed here first, the task's rows of them). Scratch w: kt and vt    \
     * (D, Tkp) panels, p and dp (GROUP, Tkp), qg and dog (GROUP, D). */                         \
    ATTR static void backward_task_##SFX(const attn_dims *d, const T *q, const T *k, const T *v, \
                                         const T *dout, const T *lse, T *dq, T *dk, T *dv,       \
                                         const unsigned char *fresh, T *w, int64_t task) {       \
        const T scale = (T)d->scale;                                                             \
        const int64_t D = d->D, Tkp = d->Tkp;                                                    \
        const int64_t b = task / d->Hkv, hk = task % d->Hkv;                                     \
        const int64_t kvo = b * d->Tk * d->ks + hk * D; /* key / value j at kvo + j * ks */     \
        for (int64_t j = 0; j < d->Tk; j++) {                                                    \
            if (dk && fresh[1]) memset(dk + kvo + j * d->ks, 0, (size_t)D * sizeof(T));          \
            if (dv && fresh[2]) memset(dv + kvo + j * d->ks, 0, (size_t)D * sizeof(T));          \
        }                                                                                        \
        if (dq && fresh[0])                                                                      \
            for (int64_t i = 0; i < d->Tq; i++)                                                  \
                memset(dq + (b * d->Tq + i) * d->qs + hk * d->G * D, 0, (size_t)(d->G * D) * sizeof(T)); \
        T *kt = w, *vt = kt + D * Tkp, *p = vt + D * Tkp, *dp = p + GROUP * Tkp;                 \
        T *qg = dp + GROUP * Tkp, *dog = qg + GROUP * D;                                         \
        transpose_##SFX(kt, k + kvo, d->ks, d->Tk, Tkp, D);                                      \
        transpose_##SFX(vt, v + kvo, d->ks, d->Tk, Tkp, D);                                      \
        for (int64_t h = hk * d->G; h < (hk + 1) * d->G; h++) {                                  \
            for (int64_t i0 = 0; i0 < d->Tq; i0 += GROUP) {                                      \
                const int m = d->Tq - i0 < GROUP ? (int)(d->Tq - i0) : GROUP;                    \
                const int64_t nmax = i0 + m + d->off, qo = (b * d->Tq + i0) * d->qs + h * D;     \
                gather_##SFX(qg, q + qo, d->qs, m, D);                                           \
                gather_##SFX(dog, dout + qo, d->qs, m, D);                                       \
                tile4_##SFX(p, qg, kt, Tkp, nmax, D);                                            \
                tile4_##SFX(dp, dog, vt, Tkp, nmax, D);                                          \
                /* Row r's p and dp become P and scale * dS (the scale of s = scale q.k folded  \
                 * in) up to nmax, zero past its own n (and whole for rows past the end). */     \
                for (int r = 0; r < GROUP; r++) {                                                \
                    const int64_t n = r < m ? i0 + r + d->off + 1 : 0;                           \
                    T *pr = p + r * Tkp, *dpr = dp + r * Tkp, delta = 0;                         \
                    const T lse_i = r < m ? lse[(b * d->Hq + h) * d->Tq + i0 + r] : 0;           \
                    _Pragma("omp simd reduction(+ : delta)") for (int64_t j = 0; j < n; j++) {   \
                        pr[j] = EXP(scale * pr[j] - lse_i);                                      \
                        delta += pr[j] * dpr[j];                                                 \
                    }                                                                            \
                    _Pragma("omp simd") for (int64_t j = 0; j < n; j++)                          \
                        dpr[j] = scale * pr[j] * (dpr[j] - delta);                               \
                    for (int64_t j = n; j < nmax; j++) pr[j] = dpr[j] = 0;                       \
                    if (dq && r < m) combine_##SFX(dq + qo + r * d->qs, dpr, k + kvo, d->ks, n, D); \
                }                                                                                \
                /* dk_j += sum_r dS_rj q_r, dv_j += sum_r P_rj dO_r: one pass over each row. */  \
                const T *q0 = qg, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;                      \
                const T *o0 = dog, *o1 = o0 + D, *o2 = o1 + D, *o3 = o2 + D;                     \
                const T *s0 = dp, *s1 = s0 + Tkp, *s2 = s1 + Tkp, *s3 = s2 + Tkp;                \
                const T *p0 = p, *p1 = p0 + Tkp, *p2 = p1 + Tkp, *p3 = p2 + Tkp;                 \
                for (int64_t j = 0; j < nmax; j++) {                                             \
                    if (dk) {                                                                    \
                        T *y = dk + kvo + j * d->ks;                                             \
                        const T w0 = s0[j], w1 = s1[j], w2 = s2[j], w3 = s3[j];                  \
                        _Pragma("omp simd") for (int64_t x = 0; x < D; x++)                      \
                            y[x] += w0 * q0[x] + w1 * q1[x] + w2 * q2[x] + w3 * q3[x];           \
                    }                                                                            \
                    if (dv) {                                                                    \
                        T *y = dv + kvo + j * d->ks;                                             \
                        const T w0 = p0[j], w1 = p1[j], w2 = p2[j], w3 = p3[j];                  \
                        _Pragma("omp simd") for (int64_t x = 0; x < D; x++)                      \
                            y[x] += w0 * o0[x] + w1 * o1[x] + w2 * o2[x] + w3 * o3[x];           \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }

ATTN_KERNELS(float, f32, tm__exp_f32, logf, TM__SIMD_CLONES)
ATTN_KERNELS(double, f64, exp, log, )

static tm_status check_cpu_dtype(tm__call *c) {
    if (c->in[0]->dtype != TM_F32 && c->in[0]->dtype != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "attention: CPU kernel got q %s",
                       tm__tdesc(c->ctx, c->in[0]));
    return TM_OK;
}

tm_status tm__attention_forward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    tm_ctx *ctx = c->ctx;
    const attn_dims d = attn_dims_of(c);
    tm_tensor *lse_t;
    const int64_t lse_shape[3] = {d.B, d.Hq, d.Tq};
    TM__TRY(tm__saved_new(c, c->out[0]->dtype, 3, lse_shape, &lse_t));
    if (d.B * d.Hq * d.Tq == 0) return TM_OK;

    const int f64 = c->in[0]->dtype == TM_F64;
    const size_t es = f64 ? sizeof(double) : sizeof(float);
    const int nth = tm__nthreads(ctx);
    const int64_t panels = d.B * d.Hkv, per_thread = GROUP * (d.Tkp + d.D);
    char *kt = tm__arena_alloc(ctx, tm_cpu(), (size_t)(panels * d.D * d.Tkp) * es);
    char *scratch = tm__arena_alloc(ctx, tm_cpu(), (size_t)(nth * per_thread) * es);
    if (!kt || !scratch) return TM_ERR_NOMEM;
    const char *q = tm__data(c->in[0]), *k = tm__data(c->in[1]);
    const void *v = tm__data(c->in[2]);
    void *o = tm__data(c->out[0]), *lse = tm__data(lse_t);

    /* Groups of the causal triangle's later rows cost more, so they are dealt in small
     * dynamic chunks. */
    const int64_t groups = d.B * d.Hq * d.ngroups;
    const int64_t chunks = (groups + GROUPS_PER_CHUNK - 1) / GROUPS_PER_CHUNK;
#pragma omp parallel num_threads(nth) if (d.B * d.Hq * d.Tq * d.Tk * d.D >= PAR_MIN)
    {
#pragma omp for schedule(static)
        for (int64_t pn = 0; pn < panels; pn++) {
            const int64_t src = (pn / d.Hkv * d.Tk * d.ks + pn % d.Hkv * d.D) * (int64_t)es;
            char *dst = kt + (size_t)(pn * d.D * d.Tkp) * es;
            if (f64)
                transpose_f64((double *)dst, (const double *)(k + src), d.ks, d.Tk, d.Tkp, d.D);
            else
                transpose_f32((float *)dst, (const float *)(k + src), d.ks, d.Tk, d.Tkp, d.D);
        }
        char *s = scratch + (size_t)(omp_get_thread_num() * per_thread) * es;
        char *qg = s + (size_t)(GROUP * d.Tkp) * es;
#pragma omp for schedule(dynamic, 1)
        for (int64_t ch = 0; ch < chunks; ch++) {
            const int64_t g0 = ch * GROUPS_PER_CHUNK;
            const int64_t g1 = g0 + GROUPS_PER_CHUNK < groups ? g0 + GROUPS_PER_CHUNK : groups;
            if (f64)
                forward_groups_f64(&d, (const double *)q, (const double *)kt, v, o, lse,
                                   (double *)s, (double *)qg, g0, g1);
            else
                forward_groups_f32(&d, (const float *)q, (const float *)kt, v, o, lse,
                                   (float *)s, (float *)qg, g0, g1);
        }
    }
    return TM_OK;
}

tm_status tm__attention_backward_cpu(tm__call *c) {
    TM__TRY(check_cpu_dtype(c));
    tm_ctx *ctx = c->ctx;
    if (!c->gin[0] && !c->gin[1] && !c->gin[2]) return TM_OK;
    const attn_dims d = attn_dims_of(c);
    if (d.B * d.Hq * d.Tq == 0) { /* no query: dk and dv are zeros (fresh ones get them) */
        TM__TRY(tm__gin_prepare(c, 1));
        return tm__gin_prepare(c, 2);
    }

    const int f64 = c->in[0]->dtype == TM_F64;
    const size_t es = f64 ? sizeof(double) : sizeof(float);
    const int nth = tm__nthreads(ctx);
    const int64_t per_thread = 2 * d.D * d.Tkp + 2 * GROUP * d.Tkp + 2 * GROUP * d.D;
    char *scratch = tm__arena_alloc(ctx, tm_cpu(), (size_t)(nth * per_thread) * es);
    if (!scratch) return TM_ERR_NOMEM;
    const void *q = tm__data(c->in[0]), *k = tm__data(c->in[1]), *v = tm__data(c->in[2]);
    const void *dout = tm__data(c->gout[0]), *lse = tm__data(c->saved[0]);
    void *dq = c->gin[0] ? tm__data(c->gin[0]) : NULL, *dk = c->gin[1] ? tm__data(c->gin[1]) : NULL;
    void *dv = c->gin[2] ? tm__data(c->gin[2]) : NULL;
    const int64_t tasks = d.B * d.Hkv;

#pragma omp parallel for num_threads(nth) if (tasks > 1 && d.B * d.Hq * d.Tq * d.Tk * d.D >= PAR_MIN) \
    schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        char *w = scratch + (size_t)(omp_get_thread_num() * per_thread) * es;
        if (f64)
            backward_task_f64(&d, q, k, v, dout, lse, dq, dk, dv, c->gin_fresh, (double *)w, task);
        else
            backward_task_f32(&d, q, k, v, dout, lse, dq, dk, dv, c->gin_fresh, (float *)w, task);
    }
    return TM_OK;
}
