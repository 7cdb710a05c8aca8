/*
 * softmax.cu — CUDA kernels of tm_softmax and tm_log_softmax over the last axis.
 *
 * Layout, shared with kernels/cpu/softmax.c (x viewed as (N, C)):
 *   in[0] x (N, C), out[0] y (N, C); no saved tensors: backward reads y and dy only.
 *   softmax      dx = y * (dy - sum_c(dy * y))
 *   log_softmax  dx = dy - exp(y) * sum_c(dy)
 * One block per row, the row maximum subtracted before exp, f32 sums in a fixed tree order.
 * Backward adds into dx, or writes 0 + the gradient into a fresh dx (call->gin_fresh,
 * TM__OP_GRAD_WRITES) without reading it.
 */
#include "common.cuh"

template <typename T>
__global__ void softmax_forward_kernel(void *y_, const void *x_, int64_t C, int log_out) {
    __shared__ float sh[32];
    int64_t off = (int64_t)blockIdx.x * C;
    const T *x = (const T *)x_ + off;
    T *y = (T *)y_ + off;
    float mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < C; i += blockDim.x) mx = fmaxf(mx, tm__ld(x + i));
    mx = tm__block_max(mx, sh);
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < C; i += blockDim.x) sum += expf(tm__ld(x + i) - mx);
    sum = tm__block_sum(sum, sh);
    if (log_out) {
        float lse = mx + logf(sum);
        for (int64_t i = threadIdx.x; i < C; i += blockDim.x) tm__st(y + i, tm__ld(x + i) - lse);
    } else {
        float inv = 1.0f / sum;
        for (int64_t i = threadIdx.x; i < C; i += blockDim.x) tm__st(y + i, expf(tm__ld(x + i) - mx) * inv);
    }
}

template <typename T>
__global__ void softmax_backward_kernel(void *dx_, const void *y_, const void *dy_, int64_t C, int log_out,
                                        int fresh) {
    __shared__ float sh[32];
    int64_t off = (int64_t)blockIdx.x * C;
    const T *y = (const T *)y_ + off, *dy = (const T *)dy_ + off;
    T *dx = (T *)dx_ + off;
    float s = 0.0f;
    for (int64_t i = threadIdx.x; i < C; i += blockDim.x) s += log_out ? tm__ld(dy + i) : tm__ld(dy + i) * tm__ld(y + i);
    s = tm__block_sum(s, sh);
    for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
        float yi = tm__ld(y + i), d = tm__ld(dy + i);
        tm__st(dx + i, (fresh ? 0.0f : tm__ld(dx + i)) + (log_out ? d - expf(yi) * s : yi * (d - s)));
    }
}

static tm_status softmax_forward(tm__call *c, int log_out) {
    tm__cuda *st;
    const char *what = tm__opname(c);
    TM__TRY(tm__cu_enter(c->ctx, what, &st));
    const tm_tensor *x = c->in[0];
    int64_t C = x->ndim ? x->shape[x->ndim - 1] : 1, N = C ? tm__numel(x) / C : 0;
    if (N == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(x->dtype, softmax_forward_kernel, (unsigned)N, tm__cu_row_threads(C), 0, st->stream,
                        tm__data(c->out[0]), tm__data(x), C, log_out);
    TM__CU_LAUNCHED(c->ctx, what, "softmax_forward_kernel");
    return TM_OK;
}

static tm_status softmax_backward(tm__call *c, int log_out) {
    tm_tensor *dx = c->gin[0];
    if (!dx) return TM_OK;
    tm__cuda *st;
    const char *what = tm__opname(c);
    TM__TRY(tm__cu_enter(c->ctx, what, &st));
    const tm_tensor *y = c->out[0];
    int64_t C = y->ndim ? y->shape[y->ndim - 1] : 1, N = C ? tm__numel(y) / C : 0;
    if (N == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(y->dtype, softmax_backward_kernel, (unsigned)N, tm__cu_row_threads(C), 0, st->stream,
                        tm__data(dx), tm__data(y), tm__data(c->gout[0]), C, log_out, (int)c->gin_fresh[0]);
    TM__CU_LAUNCHED(c->ctx, what, "softmax_backward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__softmax_forward_cuda(tm__call *c) { return softmax_forward(c, 0); }
extern "C" tm_status tm__log_softmax_forward_cuda(tm__call *c) { return softmax_forward(c, 1); }
extern "C" tm_status tm__softmax_backward_cuda(tm__call *c) { return softmax_backward(c, 0); }
extern "C" tm_status tm__log_softmax_backward_cuda(tm__call *c) { return softmax_backward(c, 1); }
