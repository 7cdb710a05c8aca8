/*
 * reduce.cu — CUDA kernels of tm_sum, tm_mean (one axis) and tm_sum_all, tm_mean_all.
 *
 * Layout: in[0] x viewed as (O, A, I) around the reduced axis (A = its size; *_all: O = I = 1,
 * A = numel); iattr[0] = axis (normalised by the check), iattr[1] = keepdim; out[0] (O, I).
 * Forward: tm__cu_reduce, f32 accumulation in a fixed tree order (no atomics).
 * Backward: dx[o, a, i] += s * dy[o, i] with s = 1 (sum) or 1 / A (mean).
 */
#include "common.cuh"

typedef struct red_dims {
    int64_t O, A, I;
} red_dims;

static red_dims red_dims_of(const tm__call *c, int all) {
    const tm_tensor *x = c->in[0];
    red_dims d = {1, tm__numel(x), 1};
    if (all) return d;
    int axis = (int)c->iattr[0];
    d.A = x->shape[axis];
    d.O = 1;
    for (int i = 0; i < axis; i++) d.O *= x->shape[i];
    d.I = 1;
    for (int i = axis + 1; i < x->ndim; i++) d.I *= x->shape[i];
    return d;
}

static tm_status red_forward(tm__call *c, int all, int mean) {
    const tm_tensor *x = c->in[0];
    red_dims d = red_dims_of(c, all);
    float alpha = mean ? 1.0f / (float)d.A : 1.0f;
    if (d.A == 0 && d.O * d.I > 0) /* nothing to add: the sum is 0, the mean 0 / 0 */
        return tm__cuda_fill(c->ctx, c->out[0], mean ? NAN : 0.0);
    return tm__cu_reduce(c->ctx, tm__opname(c), x->dtype, tm__data(x), c->out[0]->dtype, tm__data(c->out[0]), d.O,
                         d.A, d.I, alpha, 0);
}

/* dx (O, A, I) += s * dy (O, I) */
template <typename T>
__global__ void red_backward_kernel(void *dx_, const void *dy_, int64_t A, int64_t I, int64_t n, float s) {
    T *dx = (T *)dx_;
    const T *dy = (const T *)dy_;
    TM__CU_GRID_STRIDE(j, n) {
        int64_t i = j % I, o = j / I / A;
        tm__st(dx + j, tm__ld(dx + j) + s * tm__ld(dy + o * I + i));
    }
}

static tm_status red_backward(tm__call *c, int all, int mean) {
    tm_tensor *dx = c->gin[0];
    if (!dx) return TM_OK;
    tm__cuda *st;
    const char *what = tm__opname(c);
    TM__TRY(tm__cu_enter(c->ctx, what, &st));
    red_dims d = red_dims_of(c, all);
    int64_t n = tm__numel(dx);
    if (n == 0) return TM_OK;
    float s = mean ? 1.0f / (float)d.A : 1.0f;
    TM__CU_LAUNCH_FLOAT(dx->dtype, red_backward_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                        tm__data(dx), tm__data(c->gout[0]), d.A, d.I, n, s);
    TM__CU_LAUNCHED(c->ctx, what, "red_backward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__sum_forward_cuda(tm__call *c) { return red_forward(c, 0, 0); }
extern "C" tm_status tm__mean_forward_cuda(tm__call *c) { return red_forward(c, 0, 1); }
extern "C" tm_status tm__sum_all_forward_cuda(tm__call *c) { return red_forward(c, 1, 0); }
extern "C" tm_status tm__mean_all_forward_cuda(tm__call *c) { return red_forward(c, 1, 1); }
extern "C" tm_status tm__sum_backward_cuda(tm__call *c) { return red_backward(c, 0, 0); }
extern "C" tm_status tm__mean_backward_cuda(tm__call *c) { return red_backward(c, 0, 1); }
extern "C" tm_status tm__sum_all_backward_cuda(tm__call *c) { return red_backward(c, 1, 0); }
extern "C" tm_status tm__mean_all_backward_cuda(tm__call *c) { return red_backward(c, 1, 1); }
