/*
 * elementwise.cu — CUDA kernels of tm_add, tm_sub, tm_mul, tm_scale and tm_scale_rows.
 *
 * Layout (as kernels/cpu/elementwise.c):
 *   in[0] a, in[1] b   one of them full (n = numel(out) elements), the other full too or its
 *                      trailing-dims suffix of m elements, read with period m:
 *                      out[i] = a[i or i % m] (op) b[i or i % m]
 *   out[0]             n elements;  scale: out = fattr[0] * in[0]
 * Backward: the full operand's gradient is elementwise; the broadcast operand's is a sum over
 * the n / m rows of period m, done by tm__cu_reduce (fixed order, no atomics), so gradients
 * are bitwise reproducible.
 *
 * scale_rows: in[0] x (R, C) f32 or bf16, in[1] w (R) f32 or bf16 (each its own dtype);
 * out[r, c] = x[r, c] * w[r] in f32, stored in x's dtype. A warp per row (its lanes stride
 * over the columns), so no element needs a division by C. Backward: dx[r, c] += dy[r, c] w[r];
 * dw[r] += <x[r], dy[r]>, each lane summing its columns in ascending order, then a fixed
 * shuffle tree (no atomics: the same bits run to run; the CPU sums in f64, so the two agree to
 * f32 rounding).
 *
 * Every backward here writes each input gradient whole (TM__OP_GRAD_WRITES): a fresh one
 * (call->gin_fresh) is stored as 0 + x without being read (the elementwise kernels take a flag;
 * a broadcast operand's reduction runs with accumulate 0, which may keep the sign of a zero sum).
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

/* g (n) += alpha * dy * other (period po), or alpha * dy when other is NULL; fresh: g = 0 + that,
 * g not read. */
template <typename T>
__global__ void ew_grad_full_kernel(void *g_, const void *dy_, const void *other_, int64_t po, int64_t n,
                                    float alpha, int fresh) {
    T *g = (T *)g_;
    const T *dy = (const T *)dy_, *other = (const T *)other_;
    TM__CU_GRID_STRIDE(i, n) {
        float v = alpha * tm__ld(dy + i);
        if (other) v *= tm__ld(other + (po == n ? i : i % po));
        tm__st(g + i, (fresh ? 0.0f : tm__ld(g + i)) + v);
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
    const int fresh = c->gin_fresh[i];
    const tm_tensor *dy = c->gout[0];
    tm_dtype dt = dy->dtype;
    int64_t n = tm__numel(dy), m = tm__numel(g);
    int64_t po = o ? tm__numel(o) : n;
    if (m == n) {
        TM__CU_LAUNCH_FLOAT(dt, ew_grad_full_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                            tm__data(g), tm__data(dy), o ? tm__data(o) : NULL, po, n, alpha, fresh);
        TM__CU_LAUNCHED(c->ctx, what, "ew_grad_full_kernel");
        return TM_OK;
    }
    if (m == 0) return TM_OK;
    /* Broadcast operand: g (m) += alpha * sum over the n / m rows of dy (* other, full). */
    if (!o) return tm__cu_reduce(c->ctx, what, dt, tm__data(dy), g->dtype, tm__data(g), 1, n / m, m, alpha, !fresh);
    float *prod;
    TM__TRY(tm__cu_scratch(c->ctx, st, (size_t)n * sizeof(float), (void **)&prod));
    TM__CU_LAUNCH_FLOAT(dt, ew_prod_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream, prod,
                        tm__data(dy), tm__data(o), n);
    TM__CU_LAUNCHED(c->ctx, what, "ew_prod_kernel");
    return tm__cu_reduce(c->ctx, what, TM_F32, prod, g->dtype, tm__data(g), 1, n / m, m, alpha, !fresh);
}

static tm_status ew_backward(tm__call *c, int op) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, tm__opname(c), &st));
    if (tm__numel(c->gout[0]) == 0) { /* a broadcast operand of an empty output gets zeros */
        TM__TRY(tm__gin_prepare(c, 0));
        return tm__gin_prepare(c, 1);
    }
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

/* dx = (fresh ? 0 : dx) + alpha * dy: tm__cu_axpy's sum, without reading a fresh dx */
template <typename T>
__global__ void scale_grad_kernel(void *dx_, const void *dy_, int64_t n, float alpha, int fresh) {
    T *dx = (T *)dx_;
    const T *dy = (const T *)dy_;
    TM__CU_GRID_STRIDE(i, n) tm__st(dx + i, (fresh ? 0.0f : tm__ld(dx + i)) + alpha * tm__ld(dy + i));
}

extern "C" tm_status tm__scale_backward_cuda(tm__call *c) {
    tm_tensor *g = c->gin[0];
    if (!g) return TM_OK;
    const int64_t n = tm__numel(g);
    if (c->gout[0]->dtype != g->dtype) /* not made by tm_scale (same dtypes); kept general */
        return tm__cu_axpy(c->ctx, "scale", g->dtype, tm__data(g), c->gout[0]->dtype, tm__data(c->gout[0]), n,
                           (float)c->fattr[0]);
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "scale", &st));
    if (n == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(g->dtype, scale_grad_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream, tm__data(g),
                        tm__data(c->gout[0]), n, (float)c->fattr[0], (int)c->gin_fresh[0]);
    TM__CU_LAUNCHED(c->ctx, "scale", "scale_grad_kernel");
    return TM_OK;
}

/* ---- scale_rows ---------------------------------------------------------------------------- */

#define SR_WARPS 8 /* warps per block: a warp per row */

static unsigned sr_blocks(const tm__cuda *st, int64_t rows) {
    int64_t b = (rows + SR_WARPS - 1) / SR_WARPS, cap = (int64_t)st->num_sms * 32;
    if (b > cap) b = cap;
    return (unsigned)(b < 1 ? 1 : b);
}

template <typename T, typename W>
__global__ void scale_rows_forward_kernel(void *out_, const void *x_, const void *w_, int64_t R, int64_t C) {
    T *out = (T *)out_;
    const T *x = (const T *)x_;
    const W *w = (const W *)w_;
    const int lane = threadIdx.x & 31;
    const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = warp; r < R; r += nwarps) {
        const float wr = tm__ld(w + r);
        for (int64_t c = lane; c < C; c += 32) tm__st(out + r * C + c, tm__ld(x + r * C + c) * wr);
    }
}

template <typename T, typename W>
__global__ void scale_rows_backward_kernel(void *dx_, void *dw_, const void *dy_, const void *x_, const void *w_,
                                           int64_t R, int64_t C, int fx, int fw) {
    T *dx = (T *)dx_;
    W *dw = (W *)dw_;
    const T *dy = (const T *)dy_, *x = (const T *)x_;
    const W *w = (const W *)w_;
    const int lane = threadIdx.x & 31;
    const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = warp; r < R; r += nwarps) { /* the same trip count for every lane of the warp */
        const float wr = tm__ld(w + r);
        float s = 0.0f;
        for (int64_t c = lane; c < C; c += 32) {
            const int64_t i = r * C + c;
            const float g = tm__ld(dy + i);
            if (dx) tm__st(dx + i, (fx ? 0.0f : tm__ld(dx + i)) + g * wr);
            if (dw) s += tm__ld(x + i) * g;
        }
        if (dw) {
            for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
            if (lane == 0) tm__st(dw + r, (fw ? 0.0f : tm__ld(dw + r)) + s);
        }
    }
}

template <typename T, typename W>
static void scale_rows_launch(const tm__cuda *st, int backward, void *a, void *b, const void *c, const void *d,
                              const void *e, int64_t R, int64_t C, int fx, int fw) {
    const unsigned grid = sr_blocks(st, R);
    if (backward)
        scale_rows_backward_kernel<T, W><<<grid, SR_WARPS * 32, 0, st->stream>>>(a, b, c, d, e, R, C, fx, fw);
    else
        scale_rows_forward_kernel<T, W><<<grid, SR_WARPS * 32, 0, st->stream>>>(a, c, d, R, C);
}

/* forward: a = out, c = x, d = w; backward: a = dx, b = dw, c = dy, d = x, e = w, fx / fw: dx / dw
 * fresh (call->gin_fresh). */
static void scale_rows_dispatch(const tm__cuda *st, tm_dtype xdt, tm_dtype wdt, int backward, void *a, void *b,
                                const void *c, const void *d, const void *e, int64_t R, int64_t C, int fx = 0,
                                int fw = 0) {
    if (xdt == TM_BF16) {
        if (wdt == TM_BF16) scale_rows_launch<tm__bf16, tm__bf16>(st, backward, a, b, c, d, e, R, C, fx, fw);
        else scale_rows_launch<tm__bf16, float>(st, backward, a, b, c, d, e, R, C, fx, fw);
    } else {
        if (wdt == TM_BF16) scale_rows_launch<float, tm__bf16>(st, backward, a, b, c, d, e, R, C, fx, fw);
        else scale_rows_launch<float, float>(st, backward, a, b, c, d, e, R, C, fx, fw);
    }
}

extern "C" tm_status tm__scale_rows_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "scale_rows", &st));
    const tm_tensor *x = c->in[0], *w = c->in[1];
    const int64_t R = x->shape[0], C = x->shape[1];
    if (R * C == 0) return TM_OK;
    scale_rows_dispatch(st, x->dtype, w->dtype, 0, tm__data(c->out[0]), NULL, tm__data(x), tm__data(w), NULL, R, C);
    TM__CU_LAUNCHED(c->ctx, "scale_rows", "scale_rows_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__scale_rows_backward_cuda(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *dx = c->gin[0], *dw = c->gin[1];
    const int64_t R = x->shape[0], C = x->shape[1];
    if ((!dx && !dw) || R * C == 0) { /* C == 0: every dot product is 0 (a fresh dw gets the zeros) */
        TM__TRY(tm__gin_prepare(c, 0));
        return tm__gin_prepare(c, 1);
    }
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "scale_rows", &st));
    scale_rows_dispatch(st, x->dtype, w->dtype, 1, dx ? tm__data(dx) : NULL, dw ? tm__data(dw) : NULL,
                        tm__data(c->gout[0]), tm__data(x), tm__data(w), R, C, dx && c->gin_fresh[0],
                        dw && c->gin_fresh[1]);
    TM__CU_LAUNCHED(c->ctx, "scale_rows", "scale_rows_backward_kernel");
    return TM_OK;
}
