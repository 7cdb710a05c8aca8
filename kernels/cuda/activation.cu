/*
 * activation.cu — CUDA kernels of tm_silu and tm_swiglu (elementwise, f32 math).
 *
 * Layout: silu   in[0] x, out[0] y = x * sigmoid(x)
 *         swiglu in[0] gate, in[1] up (same shape), out[0] = silu(gate) * up
 * No saved tensors: backward recomputes sigmoid from the inputs.
 *   silu'(x) = s * (1 + x * (1 - s)), s = sigmoid(x)
 *   swiglu:  dgate = dy * up * silu'(gate),  dup = dy * silu(gate)
 */
#include "common.cuh"

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__global__ void silu_forward_kernel(void *y_, const void *x_, int64_t n) {
    T *y = (T *)y_;
    const T *x = (const T *)x_;
    TM__CU_GRID_STRIDE(i, n) {
        float v = tm__ld(x + i);
        tm__st(y + i, v * sigmoidf(v));
    }
}

template <typename T>
__global__ void silu_backward_kernel(void *dx_, const void *x_, const void *dy_, int64_t n) {
    T *dx = (T *)dx_;
    const T *x = (const T *)x_, *dy = (const T *)dy_;
    TM__CU_GRID_STRIDE(i, n) {
        float v = tm__ld(x + i), s = sigmoidf(v);
        tm__st(dx + i, tm__ld(dx + i) + tm__ld(dy + i) * s * (1.0f + v * (1.0f - s)));
    }
}

template <typename T>
__global__ void swiglu_forward_kernel(void *y_, const void *g_, const void *u_, int64_t n) {
    T *y = (T *)y_;
    const T *g = (const T *)g_, *u = (const T *)u_;
    TM__CU_GRID_STRIDE(i, n) {
        float v = tm__ld(g + i);
        tm__st(y + i, v * sigmoidf(v) * tm__ld(u + i));
    }
}

/* dg / du may be NULL (input needs no gradient). */
template <typename T>
__global__ void swiglu_backward_kernel(void *dg_, void *du_, const void *g_, const void *u_, const void *dy_,
                                       int64_t n) {
    T *dg = (T *)dg_, *du = (T *)du_;
    const T *g = (const T *)g_, *u = (const T *)u_, *dy = (const T *)dy_;
    TM__CU_GRID_STRIDE(i, n) {
        float v = tm__ld(g + i), s = sigmoidf(v), d = tm__ld(dy + i);
        if (dg) tm__st(dg + i, tm__ld(dg + i) + d * tm__ld(u + i) * s * (1.0f + v * (1.0f - s)));
        if (du) tm__st(du + i, tm__ld(du + i) + d * v * s);
    }
}

extern "C" tm_status tm__silu_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "silu", &st));
    const tm_tensor *x = c->in[0];
    int64_t n = tm__numel(x);
    if (n == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(x->dtype, silu_forward_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                        tm__data(c->out[0]), tm__data(x), n);
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
    TM__CU_LAUNCH_FLOAT(dx->dtype, silu_backward_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                        tm__data(dx), tm__data(c->in[0]), tm__data(c->gout[0]), n);
    TM__CU_LAUNCHED(c->ctx, "silu", "silu_backward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__swiglu_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "swiglu", &st));
    const tm_tensor *g = c->in[0];
    int64_t n = tm__numel(g);
    if (n == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(g->dtype, swiglu_forward_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                        tm__data(c->out[0]), tm__data(g), tm__data(c->in[1]), n);
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
    TM__CU_LAUNCH_FLOAT(g->dtype, swiglu_backward_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                        dg ? tm__data(dg) : NULL, du ? tm__data(du) : NULL, tm__data(g), tm__data(c->in[1]),
                        tm__data(c->gout[0]), n);
    TM__CU_LAUNCHED(c->ctx, "swiglu", "swiglu_backward_kernel");
    return TM_OK;
}
