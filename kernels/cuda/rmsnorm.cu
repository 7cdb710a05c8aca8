/*
 * rmsnorm.cu — CUDA kernels of tm_rmsnorm: y = x * rstd * w, rstd = 1 / sqrt(mean_c(x^2) + eps),
 * and of tm_add_rmsnorm (the residual add fused with it; its layout at the end of this file).
 *
 * Layout, shared with kernels/cpu/rmsnorm.c (x viewed as (N, C)):
 *   in[0] x (N, C), in[1] weight (C), fattr[0] eps, out[0] y (N, C)
 *   saved[0] rstd (N) f32 (for f32 and bf16 x)
 * One block per row; f32 sums in a fixed tree order. A row is read in groups of RN_G = 8
 * elements (thread i takes groups i, i + blockDim.x, ..., each in order; the elements past the
 * last whole group one per thread), with 16-byte accesses where every row pointer of the call
 * is aligned (C a multiple of 8 and aligned tensors: a model's rows) and element accesses in
 * the same order otherwise; both kernels of a direction (rmsnorm and add_rmsnorm) read alike.
 * Backward, per row with r = rstd[n], g = w * dy:
 *   dx = r * g - x * (r^3 / C) * sum_c(g * x)
 *   dw = sum_n dy * x * r
 * dw without an (N, C) scratch: the backward's block b takes the rows [b rows, (b + 1) rows)
 * (rows = ceil(N / RN_DW_BLOCKS), a function of N alone) one after the other, each thread
 * adding its groups' products dy * x * r into registers in row order, and stores the block's
 * partial sums as row b of an f32 (P, C) scratch, P = ceil(N / rows); tm__cu_reduce then adds
 * the P rows in its fixed order. No atomics: the sums depend on N, C and the GPU's SM count
 * (tm__cu_reduce's split), as before. The scratch shrinks from N C to P C floats (2048 C at
 * most: 6 MB for C = 768 against 50 MB at N = 16384), which removes the products' write and
 * their read back, two of the backward's passes over (N, C) in f32. Rows too wide for the
 * registers (C / RN_G > RN_DW_MAXG threads) and small N (rows = 1) store the products
 * themselves, one scratch row per row, as before.
 * Every input gradient is written whole (TM__OP_GRAD_WRITES): a fresh dx / dy (call->gin_fresh,
 * the flags fx / fy) is not read, its accumulator starts at 0.0f; a fresh dw gets tm__cu_reduce
 * with accumulate 0.
 */
#include "common.cuh"
#include "vec.cuh"

#define RN_G 8
#define RN_DW_BLOCKS 2048 /* the most dw partial rows (blocks) of a backward: about one wave of an H100 */
#define RN_DW_MAXG 4      /* groups per thread whose dw sums live in registers */

/* A block per row needs one thread per group. */
static inline int rn_threads(int64_t C) { return tm__cu_row_threads((C + RN_G - 1) / RN_G); }

__device__ __forceinline__ bool rn_aligned(uintptr_t bits) { return (bits & 15u) == 0; }

/* A group of dst as the accumulator of a gradient: zeros when it is fresh (not read). */
template <typename T>
__device__ __forceinline__ void rn_ld_acc(const T *p, float *v, bool vec, int fresh) {
    if (fresh) {
#pragma unroll
        for (int k = 0; k < RN_G; k++) v[k] = 0.0f;
    } else {
        tm__vld_group<RN_G>(p, v, vec);
    }
}

/* v rounded to T, as a store to T and a load back give it. */
template <typename T>
__device__ __forceinline__ float rn_round(float v) {
    T t;
    tm__st(&t, v);
    return tm__ld(&t);
}

/* out = in * r * w over a row, in the groups' order (both forwards' second pass). */
template <typename T>
__device__ __forceinline__ void rn_scale_row(T *out, const T *in, const T *w, float r, int64_t C, bool vec) {
    const int64_t ng = C / RN_G, c0 = ng * RN_G;
    for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) {
        float v[RN_G], g[RN_G];
        tm__vld_group<RN_G>(in + j * RN_G, v, vec);
        tm__vld_group<RN_G>(w + j * RN_G, g, vec);
#pragma unroll
        for (int k = 0; k < RN_G; k++) v[k] = v[k] * r * g[k];
        tm__vst_group<RN_G>(out + j * RN_G, v, vec);
    }
    for (int64_t i = c0 + threadIdx.x; i < C; i += blockDim.x) tm__st(out + i, tm__ld(in + i) * r * tm__ld(w + i));
}

template <typename T>
__global__ void rmsnorm_forward_kernel(void *y_, float *rstd, const void *x_, const void *w_, int64_t C, float eps) {
    __shared__ float sh[32];
    const T *x = (const T *)x_ + blockIdx.x * C, *w = (const T *)w_;
    T *y = (T *)y_ + blockIdx.x * C;
    const bool vec = rn_aligned((uintptr_t)x | (uintptr_t)y | (uintptr_t)w);
    const int64_t ng = C / RN_G, c0 = ng * RN_G;
    float ss = 0.0f;
    for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) {
        float v[RN_G];
        tm__vld_group<RN_G>(x + j * RN_G, v, vec);
#pragma unroll
        for (int k = 0; k < RN_G; k++) ss += v[k] * v[k];
    }
    for (int64_t i = c0 + threadIdx.x; i < C; i += blockDim.x) {
        float v = tm__ld(x + i);
        ss += v * v;
    }
    ss = tm__block_sum(ss, sh);
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
    rn_scale_row(y, x, w, r, C, vec);
}

/* prod[k] = a[k] * b[k] * r for the RN_G elements of group j of a row, f32 (dw's products). */
template <typename T>
__device__ __forceinline__ void rn_prod(float *prod, const T *a, const T *b, float r, int64_t j, bool vec) {
    float u[RN_G], v[RN_G];
    tm__vld_group<RN_G>(a + j * RN_G, u, vec);
    tm__vld_group<RN_G>(b + j * RN_G, v, vec);
#pragma unroll
    for (int k = 0; k < RN_G; k++) u[k] = u[k] * v[k] * r;
    tm__vst_group<RN_G>(prod + j * RN_G, u, vec && rn_aligned((uintptr_t)prod));
}

/* dw's running sums of one thread: its groups j = threadIdx.x + q blockDim.x (q < RN_DW_MAXG)
 * and its element past the last whole group (threadIdx.x < C % RN_G). */
struct rn_dw_acc {
    float g[RN_DW_MAXG][RN_G];
    float tail;
};

__device__ __forceinline__ void rn_dw_zero(rn_dw_acc &a) {
#pragma unroll
    for (int q = 0; q < RN_DW_MAXG; q++)
#pragma unroll
        for (int k = 0; k < RN_G; k++) a.g[q][k] = 0.0f;
    a.tail = 0.0f;
}

/* a += the products a_row * b_row * r of this thread's elements of one row. */
template <typename T>
__device__ __forceinline__ void rn_dw_add(rn_dw_acc &acc, const T *a, const T *b, float r, int64_t C, bool vec) {
    const int64_t ng = C / RN_G, c0 = ng * RN_G;
#pragma unroll
    for (int q = 0; q < RN_DW_MAXG; q++) {
        const int64_t j = threadIdx.x + (int64_t)q * blockDim.x;
        if (j < ng) {
            float u[RN_G], v[RN_G];
            tm__vld_group<RN_G>(a + j * RN_G, u, vec);
            tm__vld_group<RN_G>(b + j * RN_G, v, vec);
#pragma unroll
            for (int k = 0; k < RN_G; k++) acc.g[q][k] += u[k] * v[k] * r;
        }
    }
    const int64_t i = c0 + threadIdx.x;
    if (i < C) acc.tail += tm__ld(a + i) * tm__ld(b + i) * r;
}

/* part[0, C) = this block's sums (every element has one owner thread). */
__device__ __forceinline__ void rn_dw_store(float *part, const rn_dw_acc &acc, int64_t C) {
    const int64_t ng = C / RN_G, c0 = ng * RN_G;
    const bool vec = rn_aligned((uintptr_t)part);
#pragma unroll
    for (int q = 0; q < RN_DW_MAXG; q++) {
        const int64_t j = threadIdx.x + (int64_t)q * blockDim.x;
        if (j < ng) tm__vst_group<RN_G>(part + j * RN_G, acc.g[q], vec);
    }
    const int64_t i = c0 + threadIdx.x;
    if (i < C) part[i] = acc.tail;
}

/* sum over the row of w * a * b, in the groups' order, reduced over the block. */
template <typename T>
__device__ __forceinline__ float rn_dot(const T *w, const T *a, const T *b, int64_t C, bool vec, float *sh) {
    const int64_t ng = C / RN_G, c0 = ng * RN_G;
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) {
        float p[RN_G], u[RN_G], v[RN_G];
        tm__vld_group<RN_G>(w + j * RN_G, p, vec);
        tm__vld_group<RN_G>(a + j * RN_G, u, vec);
        tm__vld_group<RN_G>(b + j * RN_G, v, vec);
#pragma unroll
        for (int k = 0; k < RN_G; k++) dot += p[k] * u[k] * v[k];
    }
    for (int64_t i = c0 + threadIdx.x; i < C; i += blockDim.x) dot += tm__ld(w + i) * tm__ld(a + i) * tm__ld(b + i);
    return tm__block_sum(dot, sh);
}

/* The rows [blockIdx.x rows, + rows) of N in order; dx may be NULL; part (P, C) f32, when not
 * NULL, gets row blockIdx.x = sum over the block's rows of dy * x * r (rows == 1: the
 * products, stored group by group; otherwise register sums, RN_DW_MAXG groups per thread at
 * most: the launch checks). */
template <typename T>
__global__ void rmsnorm_backward_kernel(void *dx_, float *part, const void *dy_, const void *x_, const void *w_,
                                        const float *rstd, int64_t N, int64_t C, int64_t rows, int fx) {
    __shared__ float sh[32];
    rn_dw_acc acc;
    rn_dw_zero(acc);
    const int64_t n0 = (int64_t)blockIdx.x * rows, n1 = n0 + rows < N ? n0 + rows : N;
    for (int64_t n = n0; n < n1; n++) {
        int64_t off = n * C;
        const T *x = (const T *)x_ + off, *dy = (const T *)dy_ + off, *w = (const T *)w_;
        T *dx = dx_ ? (T *)dx_ + off : NULL;
        const bool vec = rn_aligned((uintptr_t)x | (uintptr_t)dy | (uintptr_t)w | (uintptr_t)dx);
        const int64_t ng = C / RN_G, c0 = ng * RN_G;
        float r = rstd[n];
        if (part && rows == 1) {
            for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) rn_prod(part + off, dy, x, r, j, vec);
            for (int64_t i = c0 + threadIdx.x; i < C; i += blockDim.x) part[off + i] = tm__ld(dy + i) * tm__ld(x + i) * r;
        } else if (part) {
            rn_dw_add(acc, dy, x, r, C, vec);
        }
        if (!dx) continue;
        float dot = rn_dot(w, dy, x, C, vec, sh);
        float coef = r * r * r * dot / (float)C;
        for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) {
            float d[RN_G], p[RN_G], g[RN_G], v[RN_G];
            rn_ld_acc(dx + j * RN_G, d, vec, fx);
            tm__vld_group<RN_G>(w + j * RN_G, p, vec);
            tm__vld_group<RN_G>(dy + j * RN_G, g, vec);
            tm__vld_group<RN_G>(x + j * RN_G, v, vec);
#pragma unroll
            for (int k = 0; k < RN_G; k++) d[k] = d[k] + r * p[k] * g[k] - coef * v[k];
            tm__vst_group<RN_G>(dx + j * RN_G, d, vec);
        }
        for (int64_t i = c0 + threadIdx.x; i < C; i += blockDim.x)
            tm__st(dx + i, (fx ? 0.0f : tm__ld(dx + i)) + r * tm__ld(w + i) * tm__ld(dy + i) - coef * tm__ld(x + i));
    }
    if (part && rows > 1) rn_dw_store(part + (int64_t)blockIdx.x * C, acc, C);
}

/* Rows per block of a backward computing dw (see the top): 1 when C is too wide for the
 * register sums. *blocks: the grid, = the partial rows. */
static int64_t rn_dw_rows(int64_t N, int64_t C, int threads, int64_t *blocks) {
    int64_t rows = (N + RN_DW_BLOCKS - 1) / RN_DW_BLOCKS;
    if (rows < 1 || C / RN_G > (int64_t)RN_DW_MAXG * threads) rows = 1;
    *blocks = (N + rows - 1) / rows;
    return rows;
}

extern "C" tm_status tm__rmsnorm_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "rmsnorm", &st));
    const tm_tensor *x = c->in[0], *w = c->in[1];
    int64_t C = x->shape[x->ndim - 1], N = C ? tm__numel(x) / C : 0;
    tm_tensor *rstd;
    TM__TRY(tm__saved_new(c, TM_F32, 1, &N, &rstd));
    if (N == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(x->dtype, rmsnorm_forward_kernel, (unsigned)N, rn_threads(C), 0, st->stream,
                        tm__data(c->out[0]), (float *)tm__data(rstd), tm__data(x), tm__data(w), C, (float)c->fattr[0]);
    TM__CU_LAUNCHED(c->ctx, "rmsnorm", "rmsnorm_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__rmsnorm_backward_cuda(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1], *dy = c->gout[0], *rstd = c->saved[0];
    tm_tensor *dx = c->gin[0], *dw = c->gin[1];
    int64_t C = x->shape[x->ndim - 1], N = C ? tm__numel(x) / C : 0;
    if (N == 0) return tm__gin_prepare(c, 1); /* no rows: dw = 0 (a fresh one gets the zeros) */
    if (!dx && !dw) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "rmsnorm", &st));
    const int threads = rn_threads(C);
    int64_t P = N, rows = dw ? rn_dw_rows(N, C, threads, &P) : 1;
    float *part = NULL;
    if (dw) TM__TRY(tm__cu_scratch(c->ctx, st, (size_t)(P * C) * sizeof(float), (void **)&part));
    TM__CU_LAUNCH_FLOAT(x->dtype, rmsnorm_backward_kernel, (unsigned)P, threads, 0, st->stream,
                        dx ? tm__data(dx) : NULL, part, tm__data(dy), tm__data(x), tm__data(w),
                        (const float *)tm__data(rstd), N, C, rows, dx && c->gin_fresh[0]);
    TM__CU_LAUNCHED(c->ctx, "rmsnorm", "rmsnorm_backward_kernel");
    if (dw)
        TM__TRY(tm__cu_reduce(c->ctx, "rmsnorm", TM_F32, part, dw->dtype, tm__data(dw), 1, P, C, 1.0f, !c->gin_fresh[1]));
    return TM_OK;
}

/* ---- add_rmsnorm: the residual add fused with the norm after it ----------------------------- */
/*
 * Layout (kernels/cpu/rmsnorm.c): in[0] x (N, C), in[1] y (N, C), in[2] weight (C), fattr[0]
 * eps; out[0] s = x + y, out[1] h = rmsnorm(s); saved[0] rstd (N) f32, saved[1] s (out[0]).
 * Backward: t = ds + rmsnorm's dx(s, w, dh); dx += t; dy += t; dw as rmsnorm's.
 * One block per row, each direction one kernel (plus rmsnorm's dw reduction): the forward
 * writes s and reads it back from its own row (cache) instead of the unfused add's write and
 * rmsnorm's read of s from memory; the backward reads ds, dh, s once and adds t into dx and dy
 * without storing s's gradient. Per element the arithmetic of the add, rmsnorm and axpy
 * kernels in their order, with s and t rounded to T where the unfused ops store them.
 * Launches per residual add + norm (two per layer; derived from elementwise.cu and above):
 * forward 2 -> 1 (ew_forward_kernel + rmsnorm_forward_kernel); backward 3 + R -> 1 + R
 * (rmsnorm_backward_kernel + two ew_grad_full_kernel + rmsnorm's dw reduction, R = 1 or 2
 * tm__cu_reduce launches). Memory passes over (N, C), in units of the activation dtype, bf16:
 * forward 5 -> 4, backward about 14 -> 11 -> 7 (the f32 dw products, 4 of them, became
 * register sums: see the top).
 */
template <typename T>
__global__ void add_rmsnorm_forward_kernel(void *s_, void *h_, float *rstd, const void *x_, const void *y_,
                                           const void *w_, int64_t C, float eps) {
    __shared__ float sh[32];
    int64_t off = (int64_t)blockIdx.x * C;
    const T *x = (const T *)x_ + off, *y = (const T *)y_ + off, *w = (const T *)w_;
    T *s = (T *)s_ + off, *h = (T *)h_ + off;
    const bool vec = rn_aligned((uintptr_t)x | (uintptr_t)y | (uintptr_t)w | (uintptr_t)s | (uintptr_t)h);
    const int64_t ng = C / RN_G, c0 = ng * RN_G;
    float ss = 0.0f;
    for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) {
        float a[RN_G], b[RN_G];
        tm__vld_group<RN_G>(x + j * RN_G, a, vec);
        tm__vld_group<RN_G>(y + j * RN_G, b, vec);
#pragma unroll
        for (int k = 0; k < RN_G; k++) a[k] = a[k] + b[k];
        tm__vst_group<RN_G>(s + j * RN_G, a, vec);
#pragma unroll
        for (int k = 0; k < RN_G; k++) {
            float v = rn_round<T>(a[k]); /* the stored (rounded) sum, as rmsnorm reads it */
            ss += v * v;
        }
    }
    for (int64_t i = c0 + threadIdx.x; i < C; i += blockDim.x) {
        tm__st(s + i, tm__ld(x + i) + tm__ld(y + i));
        float v = tm__ld(s + i);
        ss += v * v;
    }
    ss = tm__block_sum(ss, sh);
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
    rn_scale_row(h, s, w, r, C, vec);
}

/* dx, dy may be NULL (and may be one tensor); part as rmsnorm_backward_kernel's, of dh * s * r. */
template <typename T>
__global__ void add_rmsnorm_backward_kernel(void *dx_, void *dy_, float *part, const void *ds_, const void *dh_,
                                            const void *s_, const void *w_, const float *rstd, int64_t N, int64_t C,
                                            int64_t rows, int fx, int fy) {
    __shared__ float sh[32];
    rn_dw_acc acc;
    rn_dw_zero(acc);
    const int64_t n0 = (int64_t)blockIdx.x * rows, n1 = n0 + rows < N ? n0 + rows : N;
    for (int64_t n = n0; n < n1; n++) {
        int64_t off = n * C;
        const T *s = (const T *)s_ + off, *dh = (const T *)dh_ + off, *ds = (const T *)ds_ + off, *w = (const T *)w_;
        T *dx = dx_ ? (T *)dx_ + off : NULL, *dy = dy_ ? (T *)dy_ + off : NULL;
        const bool vec = rn_aligned((uintptr_t)s | (uintptr_t)dh | (uintptr_t)ds | (uintptr_t)w | (uintptr_t)dx |
                                    (uintptr_t)dy);
        const int64_t ng = C / RN_G, c0 = ng * RN_G;
        float r = rstd[n];
        if (part && rows == 1) {
            for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) rn_prod(part + off, dh, s, r, j, vec);
            for (int64_t i = c0 + threadIdx.x; i < C; i += blockDim.x) part[off + i] = tm__ld(dh + i) * tm__ld(s + i) * r;
        } else if (part) {
            rn_dw_add(acc, dh, s, r, C, vec);
        }
        if (!dx && !dy) continue;
        float dot = rn_dot(w, dh, s, C, vec, sh);
        float coef = r * r * r * dot / (float)C;
        for (int64_t j = threadIdx.x; j < ng; j += blockDim.x) {
            float t[RN_G], p[RN_G], g[RN_G], v[RN_G], a[RN_G];
            tm__vld_group<RN_G>(ds + j * RN_G, t, vec);
            tm__vld_group<RN_G>(w + j * RN_G, p, vec);
            tm__vld_group<RN_G>(dh + j * RN_G, g, vec);
            tm__vld_group<RN_G>(s + j * RN_G, v, vec);
#pragma unroll
            for (int k = 0; k < RN_G; k++) t[k] = rn_round<T>(t[k] + r * p[k] * g[k] - coef * v[k]); /* s's gradient as stored */
            if (dx) {
                rn_ld_acc(dx + j * RN_G, a, vec, fx);
#pragma unroll
                for (int k = 0; k < RN_G; k++) a[k] = a[k] + t[k];
                tm__vst_group<RN_G>(dx + j * RN_G, a, vec);
            }
            if (dy) { /* after dx's store: dx and dy may be one tensor */
                rn_ld_acc(dy + j * RN_G, a, vec, fy);
#pragma unroll
                for (int k = 0; k < RN_G; k++) a[k] = a[k] + t[k];
                tm__vst_group<RN_G>(dy + j * RN_G, a, vec);
            }
        }
        for (int64_t i = c0 + threadIdx.x; i < C; i += blockDim.x) {
            T t; /* s's gradient as the unfused rmsnorm backward stores it */
            tm__st(&t, tm__ld(ds + i) + r * tm__ld(w + i) * tm__ld(dh + i) - coef * tm__ld(s + i));
            float tv = tm__ld(&t);
            if (dx) tm__st(dx + i, (fx ? 0.0f : tm__ld(dx + i)) + tv);
            if (dy) tm__st(dy + i, (fy ? 0.0f : tm__ld(dy + i)) + tv);
        }
    }
    if (part && rows > 1) rn_dw_store(part + (int64_t)blockIdx.x * C, acc, C);
}

extern "C" tm_status tm__add_rmsnorm_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "add_rmsnorm", &st));
    const tm_tensor *x = c->in[0], *y = c->in[1], *w = c->in[2];
    int64_t C = x->shape[x->ndim - 1], N = C ? tm__numel(x) / C : 0;
    tm_tensor *rstd;
    TM__TRY(tm__saved_new(c, TM_F32, 1, &N, &rstd));
    c->saved[c->n_saved++] = c->out[0];
    if (N == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(x->dtype, add_rmsnorm_forward_kernel, (unsigned)N, rn_threads(C), 0, st->stream,
                        tm__data(c->out[0]), tm__data(c->out[1]), (float *)tm__data(rstd), tm__data(x), tm__data(y),
                        tm__data(w), C, (float)c->fattr[0]);
    TM__CU_LAUNCHED(c->ctx, "add_rmsnorm", "add_rmsnorm_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__add_rmsnorm_backward_cuda(tm__call *c) {
    const tm_tensor *w = c->in[2], *ds = c->gout[0], *dh = c->gout[1], *rstd = c->saved[0], *s = c->saved[1];
    tm_tensor *dx = c->gin[0], *dy = c->gin[1], *dw = c->gin[2];
    int64_t C = s->shape[s->ndim - 1], N = C ? tm__numel(s) / C : 0;
    if (N == 0) return tm__gin_prepare(c, 2); /* no rows: dw = 0 (a fresh one gets the zeros) */
    if (!dx && !dy && !dw) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "add_rmsnorm", &st));
    const int threads = rn_threads(C);
    int64_t P = N, rows = dw ? rn_dw_rows(N, C, threads, &P) : 1;
    float *part = NULL;
    if (dw) TM__TRY(tm__cu_scratch(c->ctx, st, (size_t)(P * C) * sizeof(float), (void **)&part));
    TM__CU_LAUNCH_FLOAT(s->dtype, add_rmsnorm_backward_kernel, (unsigned)P, threads, 0, st->stream,
                        dx ? tm__data(dx) : NULL, dy ? tm__data(dy) : NULL, part, tm__data(ds), tm__data(dh),
                        tm__data(s), tm__data(w), (const float *)tm__data(rstd), N, C, rows, dx && c->gin_fresh[0],
                        dy && c->gin_fresh[1]);
    TM__CU_LAUNCHED(c->ctx, "add_rmsnorm", "add_rmsnorm_backward_kernel");
    if (dw)
        TM__TRY(tm__cu_reduce(c->ctx, "add_rmsnorm", TM_F32, part, dw->dtype, tm__data(dw), 1, P, C, 1.0f,
                              !c->gin_fresh[2]));
    return TM_OK;
}
