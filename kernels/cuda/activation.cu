/*
 * activation.cu — CUDA kernels of tm_silu and tm_swiglu (elementwise, f32 math).
 *
 * Layout: silu   in[0] x (n), out[0] y = x * sigmoid(x) (n)
 *         swiglu in[0] gate (n), in[1] up (n, same shape), out[0] = silu(gate) * up (n)
 * All tensors contiguous (the op table has no TM__OP_STRIDED: views are copied before the
 * kernel). No saved tensors: backward recomputes sigmoid from the inputs and ADDS into the
 * input gradients (dx, dgate, dup may already hold gradient); both write a fresh one
 * (call->gin_fresh, TM__OP_GRAD_WRITES) as 0 + x without reading it.
 *   silu'(x) = s * (1 + x * (1 - s)), s = sigmoid(x)
 *   swiglu:  dgate = dy * up * silu'(gate),  dup = dy * silu(gate)
 *
 * Vectorisation: these are memory bound, so each thread moves 16 bytes per access (4 f32 or
 * 8 bf16: tm__vld / tm__vst, kernels/cuda/vec.cuh) when n is a multiple of that and every pointer is 16-byte aligned
 * (checked on the host); otherwise one element per access. Both paths are one kernel template
 * (N elements per access) sharing the per-element functions below, so every element gets the
 * same f32 expressions in the same order (swiglu.cuh's: ex2.approx and rcp.approx) on either path:
 * the same bits.
 * bf16 is widened by its bits (exact, as __bfloat162float) and stored rounded to nearest even
 * (tm__st's __float2bfloat16_rn). The vector path runs one resident wave (ACT_BLOCKS_PER_SM
 * blocks per SM, guaranteed by __launch_bounds__) with a grid-stride loop.
 * Deterministic: every output element is written by one thread, no atomics.
 */
#include "common.cuh"
#include "swiglu.cuh"
#include "vec.cuh"

#define ACT_BLOCKS_PER_SM 4

/* The per-element arithmetic is swiglu.cuh's, shared by the scalar and the vector kernels and
 * by the Hopper grouped GEMM's fused SwiGLU epilogue. The kernels take n elements, n a multiple of N (the host picks N = 1 otherwise), and loop
 * over the n / N groups of N consecutive elements. */
template <int N, typename T>
__global__ void __launch_bounds__(TM__CU_THREADS, ACT_BLOCKS_PER_SM)
silu_forward_kernel(void *y_, const void *x_, int64_t n) {
    T *y = (T *)y_;
    const T *x = (const T *)x_;
    const int64_t nv = n / N;
    TM__CU_GRID_STRIDE(i, nv) {
        float v[N], r[N];
        tm__vld<N>(x + i * N, v);
#pragma unroll
        for (int k = 0; k < N; k++) r[k] = tm__silu_fwd(v[k]);
        tm__vst<N>(y + i * N, r);
    }
}

template <int N, typename T>
__global__ void __launch_bounds__(TM__CU_THREADS, ACT_BLOCKS_PER_SM)
silu_backward_kernel(void *dx_, const void *x_, const void *dy_, int fx, int64_t n) {
    T *dx = (T *)dx_;
    const T *x = (const T *)x_, *dy = (const T *)dy_;
    const int64_t nv = n / N;
    TM__CU_GRID_STRIDE(i, nv) {
        float v[N], d[N], a[N];
        tm__vld<N>(x + i * N, v);
        tm__vld<N>(dy + i * N, d);
        if (fx) { /* fresh (call->gin_fresh): not read, the accumulator starts at 0.0f */
#pragma unroll
            for (int k = 0; k < N; k++) a[k] = 0.0f;
        } else {
            tm__vld<N>(dx + i * N, a);
        }
#pragma unroll
        for (int k = 0; k < N; k++) a[k] = tm__silu_bwd(a[k], v[k], d[k]);
        tm__vst<N>(dx + i * N, a);
    }
}

template <int N, typename T>
__global__ void __launch_bounds__(TM__CU_THREADS, ACT_BLOCKS_PER_SM)
swiglu_forward_kernel(void *y_, const void *g_, const void *u_, int64_t n) {
    T *y = (T *)y_;
    const T *g = (const T *)g_, *u = (const T *)u_;
    const int64_t nv = n / N;
    TM__CU_GRID_STRIDE(i, nv) {
        float v[N], w[N], r[N];
        tm__vld<N>(g + i * N, v);
        tm__vld<N>(u + i * N, w);
#pragma unroll
        for (int k = 0; k < N; k++) r[k] = tm__swiglu_fwd(v[k], w[k]);
        tm__vst<N>(y + i * N, r);
    }
}

/* dg / du may be NULL (input needs no gradient), not both. fg / fu: dg / du is fresh
 * (call->gin_fresh): not read, the accumulator starts at 0.0f, so it gets the bits
 * accumulating into zeros would give. */
template <int N, typename T>
__global__ void __launch_bounds__(TM__CU_THREADS, ACT_BLOCKS_PER_SM)
swiglu_backward_kernel(void *dg_, void *du_, const void *g_, const void *u_, const void *dy_, int fg, int fu,
                       int64_t n) {
    T *dg = (T *)dg_, *du = (T *)du_;
    const T *g = (const T *)g_, *u = (const T *)u_, *dy = (const T *)dy_;
    const int64_t nv = n / N;
    TM__CU_GRID_STRIDE(i, nv) {
        float v[N], s[N], d[N], a[N], w[N];
        tm__vld<N>(g + i * N, v);
        tm__vld<N>(dy + i * N, d);
#pragma unroll
        for (int k = 0; k < N; k++) s[k] = tm__sigmoidf(v[k]);
        if (dg) {
            tm__vld<N>(u + i * N, w);
            if (fg) {
#pragma unroll
                for (int k = 0; k < N; k++) a[k] = 0.0f;
            } else {
                tm__vld<N>(dg + i * N, a);
            }
#pragma unroll
            for (int k = 0; k < N; k++) a[k] = tm__swiglu_bwd_gate(a[k], v[k], s[k], d[k], w[k]);
            tm__vst<N>(dg + i * N, a);
        }
        if (du) {
            if (fu) {
#pragma unroll
                for (int k = 0; k < N; k++) a[k] = 0.0f;
            } else {
                tm__vld<N>(du + i * N, a);
            }
#pragma unroll
            for (int k = 0; k < N; k++) a[k] = tm__swiglu_bwd_up(a[k], v[k], s[k], d[k]);
            tm__vst<N>(du + i * N, a);
        }
    }
}

/* ---- host ------------------------------------------------------------------------------------ */

static inline int act_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Elements per access for n elements of dt at these pointers (NULL ones ignored): 16 bytes'
 * worth when n and every pointer allow, else 1. */
static int act_width(tm_dtype dt, int64_t n, const void *p0, const void *p1, const void *p2, const void *p3,
                     const void *p4) {
    int w = dt == TM_BF16 ? 8 : 4;
    if (n % w != 0) return 1;
    const void *ps[5] = {p0, p1, p2, p3, p4};
    for (int k = 0; k < 5; k++)
        if (!act_aligned16(ps[k])) return 1;
    return w;
}

/* Blocks for nv groups: at most one resident wave for the vector path (ACT_BLOCKS_PER_SM
 * blocks of TM__CU_THREADS per SM fit by __launch_bounds__); the scalar path keeps the
 * common geometry. */
static unsigned act_blocks(const tm__cuda *st, int64_t nv, int width) {
    if (width == 1) return tm__cu_blocks(st, nv);
    int64_t b = (nv + TM__CU_THREADS - 1) / TM__CU_THREADS, cap = (int64_t)st->num_sms * ACT_BLOCKS_PER_SM;
    if (b > cap) b = cap;
    return (unsigned)(b < 1 ? 1 : b);
}

/* Launch kern<width, T> over n elements of dt; the kernel's last argument is n. */
#define ACT_LAUNCH(st, dt, width, n, kern, ...)                                                      \
    do {                                                                                             \
        unsigned act_grid_ = act_blocks((st), (n) / (width), (width));                               \
        if ((dt) == TM_BF16) {                                                                       \
            if ((width) == 8)                                                                        \
                kern<8, tm__bf16><<<act_grid_, TM__CU_THREADS, 0, (st)->stream>>>(__VA_ARGS__, (n)); \
            else                                                                                     \
                kern<1, tm__bf16><<<act_grid_, TM__CU_THREADS, 0, (st)->stream>>>(__VA_ARGS__, (n)); \
        } else {                                                                                     \
            if ((width) == 4)                                                                        \
                kern<4, float><<<act_grid_, TM__CU_THREADS, 0, (st)->stream>>>(__VA_ARGS__, (n));    \
            else                                                                                     \
                kern<1, float><<<act_grid_, TM__CU_THREADS, 0, (st)->stream>>>(__VA_ARGS__, (n));    \
        }                                                                                            \
    } while (0)

extern "C" tm_status tm__silu_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "silu", &st));
    const tm_tensor *x = c->in[0];
    int64_t n = tm__numel(x);
    if (n == 0) return TM_OK;
    void *y = tm__data(c->out[0]);
    const void *xp = tm__data(x);
    int w = act_width(x->dtype, n, y, xp, NULL, NULL, NULL);
    ACT_LAUNCH(st, x->dtype, w, n, silu_forward_kernel, y, xp);
    TM__CU_LAUNCHED(c->ctx, "silu", "silu_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__silu_backward_cuda(tm__call *c) {
    tm_tensor *dx = c->gin[0];
    if (!dx) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "silu", &st));
    int64_t n = tm__numel(dx);
    if (n == 0) return TM_OK;
    void *dxp = tm__data(dx);
    const void *xp = tm__data(c->in[0]), *dyp = tm__data(c->gout[0]);
    int w = act_width(dx->dtype, n, dxp, xp, dyp, NULL, NULL);
    ACT_LAUNCH(st, dx->dtype, w, n, silu_backward_kernel, dxp, xp, dyp, (int)c->gin_fresh[0]);
    TM__CU_LAUNCHED(c->ctx, "silu", "silu_backward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__swiglu_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "swiglu", &st));
    const tm_tensor *g = c->in[0];
    int64_t n = tm__numel(g);
    if (n == 0) return TM_OK;
    void *y = tm__data(c->out[0]);
    const void *gp = tm__data(g), *up = tm__data(c->in[1]);
    int w = act_width(g->dtype, n, y, gp, up, NULL, NULL);
    ACT_LAUNCH(st, g->dtype, w, n, swiglu_forward_kernel, y, gp, up);
    TM__CU_LAUNCHED(c->ctx, "swiglu", "swiglu_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__swiglu_backward_cuda(tm__call *c) {
    tm_tensor *dg = c->gin[0], *du = c->gin[1];
    if (!dg && !du) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "swiglu", &st));
    const tm_tensor *g = c->in[0];
    int64_t n = tm__numel(g);
    if (n == 0) return TM_OK;
    void *dgp = dg ? tm__data(dg) : NULL, *dup = du ? tm__data(du) : NULL;
    const void *gp = tm__data(g), *up = tm__data(c->in[1]), *dyp = tm__data(c->gout[0]);
    int w = act_width(g->dtype, n, dgp, dup, gp, up, dyp);
    int fg = dg && c->gin_fresh[0], fu = du && c->gin_fresh[1];
    ACT_LAUNCH(st, g->dtype, w, n, swiglu_backward_kernel, dgp, dup, gp, up, dyp, fg, fu);
    TM__CU_LAUNCHED(c->ctx, "swiglu", "swiglu_backward_kernel");
    return TM_OK;
}
