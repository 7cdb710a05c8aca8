/*
 * elementwise.cu — CUDA kernels of tm_add, tm_sub, tm_mul and tm_scale.
 *
 * Layout (as kernels/cpu/elementwise.c):
 *   in[0] a, in[1] b   one of them full (n = numel(out) elements), the other full too or its
 *                      trailing-dims suffix of m elements, read with period m:
 *                      out[i] = a[i or i % m] (op) b[i or i % m]
 *   out[0]             n elements;  scale: out = fattr[0] * in[0]
 * Backward: the full operand's gradient is elementwise; the broadcast operand's is a sum over
 * the n / m rows of period m, done by tm__cu_reduce (fixed order, no atomics), so gradients
 * are bitwise reproducible.
 */
#include "common.cuh"

enum { EW_ADD, EW_SUB, EW_MUL };

/* out (n) = a (period pa) op b (period pb); a period equals n for a full operand. */
template <typename T>
__global__ void ew_forward_kernel(void *out_, const void *a_, int64_t pa, const void *b_, int64_t pb, int64_t n,
                                  int op) {
    T *out = (T *)out_;
    const T *a = (const T *)a_, *b = (const T *)b_;
    TM__CU_GRID_STRIDE(i, n) {
        float x = tm__ld(a + (pa == n ? i : i % pa)), y = tm__ld(b + (pb == n ? i : i % pb));
        tm__st(out + i, op == EW_ADD ? x + y : op == EW_SUB ? x - y : x * y);
    }
}

/* g (n) += alpha * dy * other (period po), or alpha * dy when other is NULL. */
template <typename T>
__global__ void ew_grad_full_kernel(void *g_, const void *dy_, const void *other_, int64_t po, int64_t n,
                                    float alpha) {
    T *g = (T *)g_;
    const T *dy = (const T *)dy_, *other = (const T *)other_;
    TM__CU_GRID_STRIDE(i, n) {
        float v = alpha * tm__ld(dy + i);
        if (other) v *= tm__ld(other + (po == n ? i : i % po));
        tm__st(g + i, tm__ld(g + i) + v);
    }
}

/* prod (n, f32) = dy * other (full): the rows that the broadcast operand's gradient sums. */
template <typename T>
__global__ void ew_prod_kernel(float *prod, const void *dy_, const void *other_, int64_t n) {
    const T *dy = (const T *)dy_, *other = (const T *)other_;
    TM__CU_GRID_STRIDE(i, n) prod[i] = tm__ld(dy + i) * tm__ld(other + i);
}

static tm_status ew_forward(tm__call *c, int op) {
    tm__cuda *st;
    const char *what = tm__opname(c);
    TM__TRY(tm__cu_enter(c->ctx, what, &st));
    const tm_tensor *a = c->in[0], *b = c->in[1];
    int64_t n = tm__numel(c->out[0]);
    if (n == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(a->dtype, ew_forward_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                        tm__data(c->out[0]), tm__data(a), tm__numel(a), tm__data(b), tm__numel(b), n, op);
    TM__CU_LAUNCHED(c->ctx, what, "ew_forward_kernel");
    return TM_OK;
}

/* Gradient of operand i (period pi) given the other operand `o` (period po; NULL for add/sub)
 * and the sign alpha. */
static tm_status ew_grad(tm__call *c, tm__cuda *st, int i, const tm_tensor *o, float alpha) {
    tm_tensor *g = c->gin[i];
    if (!g) return TM_OK;
    const char *what = tm__opname(c);
    const tm_tensor *dy = c->gout[0];
    tm_dtype dt = dy->dtype;
    int64_t n = tm__numel(dy), m = tm__numel(g);
    int64_t po = o ? tm__numel(o) : n;
    if (m == n) {
        TM__CU_LAUNCH_FLOAT(dt, ew_grad_full_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                            tm__data(g), tm__data(dy), o ? tm__data(o) : NULL, po, n, alpha);
        TM__CU_LAUNCHED(c->ctx, what, "ew_grad_full_kernel");
        return TM_OK;
    }
    if (m == 0) return TM_OK;
    /* Broadcast operand: g (m) += alpha * sum over the n / m rows of dy (* other, full). */
    if (!o) return tm__cu_reduce(c->ctx, what, dt, tm__data(dy), g->dtype, tm__data(g), 1, n / m, m, alpha, 1);
    float *prod;
    TM__TRY(tm__cu_scratch(c->ctx, st, (size_t)n * sizeof(float), (void **)&prod));
    TM__CU_LAUNCH_FLOAT(dt, ew_prod_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream, prod,
                        tm__data(dy), tm__data(o), n);
    TM__CU_LAUNCHED(c->ctx, what, "ew_prod_kernel");
    return tm__cu_reduce(c->ctx, what, TM_F32, prod, g->dtype, tm__data(g), 1, n / m, m, alpha, 1);
}

static tm_status ew_backward(tm__call *c, int op) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, tm__opname(c), &st));
    if (tm__numel(c->gout[0]) == 0) return TM_OK;
    const tm_tensor *a = c->in[0], *b = c->in[1];
    if (op == EW_MUL) {
        TM__TRY(ew_grad(c, st, 0, b, 1.0f));
        return ew_grad(c, st, 1, a, 1.0f);
    }
    TM__TRY(ew_grad(c, st, 0, NULL, 1.0f));
    return ew_grad(c, st, 1, NULL, op == EW_SUB ? -1.0f : 1.0f);
}

extern "C" tm_status tm__add_forward_cuda(tm__call *c) { return ew_forward(c, EW_ADD); }
extern "C" tm_status tm__sub_forward_cuda(tm__call *c) { return ew_forward(c, EW_SUB); }
extern "C" tm_status tm__mul_forward_cuda(tm__call *c) { return ew_forward(c, EW_MUL); }
extern "C" tm_status tm__add_backward_cuda(tm__call *c) { return ew_backward(c, EW_ADD); }
extern "C" tm_status tm__sub_backward_cuda(tm__call *c) { return ew_backward(c, EW_SUB); }
extern "C" tm_status tm__mul_backward_cuda(tm__call *c) { return ew_backward(c, EW_MUL); }

/* ---- scale --------------------------------------------------------------------------------- */

template <typename T>
__global__ void scale_kernel(void *out_, const void *x_, int64_t n, float alpha) {
    T *out = (T *)out_;
    const T *x = (const T *)x_;
    TM__CU_GRID_STRIDE(i, n) tm__st(out + i, alpha * tm__ld(x + i));
}

extern "C" tm_status tm__scale_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "scale", &st));
    const tm_tensor *x = c->in[0];
    int64_t n = tm__numel(x);
    if (n == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(x->dtype, scale_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                        tm__data(c->out[0]), tm__data(x), n, (float)c->fattr[0]);
    TM__CU_LAUNCHED(c->ctx, "scale", "scale_kernel");
    return TM_OK;
}

extern "C" tm_status tm__scale_backward_cuda(tm__call *c) {
    tm_tensor *g = c->gin[0];
    if (!g) return TM_OK;
    return tm__cu_axpy(c->ctx, "scale", g->dtype, tm__data(g), c->gout[0]->dtype, tm__data(c->gout[0]),
                       tm__numel(g), (float)c->fattr[0]);
}
