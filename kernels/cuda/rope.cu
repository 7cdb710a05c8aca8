/*
 * rope.cu — CUDA kernels of tm_rope, rotary position embedding in the rotate-half pairing
 * (GPT-NeoX / Llama / Mixtral), exactly as kernels/cpu/rope.c.
 *
 * Layout, shared with the CPU kernels:
 *   in[0]   x (B, T, H, D), D = 2 * half; row t sits at position pos = pos_offset (iattr[0]) + t
 *   fattr[0] theta
 *   out[0]  y (B, T, H, D)
 *   saved   none: the rotation depends on positions only.
 * For i < half, with angle = pos * theta^(-2i/D) and (x1, x2) = (x[i], x[i + half]):
 *   forward   y1 = x1 cos - x2 sin,    y2 = x2 cos + x1 sin
 *   backward  the rotation by -angle:  dx1 += dy1 cos + dy2 sin,  dx2 += dy2 cos - dy1 sin
 *
 * As on the CPU, cos/sin are tabulated once per call, (T, half), in f64 (at positions in the
 * tens of thousands an f32 angle has lost the bits that decide the rotation), and the rotation
 * itself is computed in f64 from the f32 / bf16 inputs and rounded once on store. Elementwise:
 * nothing to reduce, so the result is the same on every run. The backward writes dx whole
 * (TM__OP_GRAD_WRITES): a fresh dx (call->gin_fresh, add = 2) gets 0 + the rotation, unread.
 */
#include "common.cuh"

/* cs, sn (T, half); sn carries the sign of the rotation (backward: -sin). */
__global__ void rope_table_kernel(double *cs, double *sn, int64_t Tn, int64_t half, int64_t pos0, double theta,
                                  double sign) {
    TM__CU_GRID_STRIDE(e, Tn * half) {
        const int64_t t = e / half, i = e % half;
        const double angle = (double)(pos0 + t) * pow(theta, -2.0 * (double)i / (double)(2 * half));
        cs[e] = cos(angle);
        sn[e] = sign * sin(angle);
    }
}

/* One thread per pair (row r = (b, t, h), i): y = rotation of x (add 1: y += rotation of x;
 * add 2: y = 0 + rotation of x, y not read). */
template <typename T>
__global__ void rope_rotate_kernel(void *y_, const void *x_, const double *cs, const double *sn, int64_t rows,
                                   int64_t Tn, int64_t H, int64_t half, int add) {
    T *y = (T *)y_;
    const T *x = (const T *)x_;
    TM__CU_GRID_STRIDE(e, rows * half) {
        const int64_t r = e / half, i = e % half, t = (r / H) % Tn;
        const int64_t p1 = r * 2 * half + i, p2 = p1 + half;
        const double c = cs[t * half + i], s = sn[t * half + i];
        const double a = tm__ld(x + p1), b = tm__ld(x + p2);
        double y1 = a * c - b * s, y2 = b * c + a * s;
        if (add == 1) {
            y1 += tm__ld(y + p1);
            y2 += tm__ld(y + p2);
        } else if (add == 2) {
            y1 += 0.0;
            y2 += 0.0;
        }
        tm__st(y + p1, (float)y1);
        tm__st(y + p2, (float)y2);
    }
}

/* Rotate src by sign * angle into dst (add = 0), add the rotation into dst (add = 1), or store
 * 0 + the rotation into a fresh gradient dst (add = 2). */
static tm_status rope_apply(tm__call *c, tm_tensor *dst, const tm_tensor *src, double sign, int add) {
    tm_ctx *ctx = c->ctx;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, "rope", &st));
    const int64_t B = src->shape[0], Tn = src->shape[1], H = src->shape[2], half = src->shape[3] / 2;
    if (B * Tn * H * half == 0) return TM_OK;
    double *cs;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)(2 * Tn * half) * sizeof(double), (void **)&cs));
    double *sn = cs + Tn * half;
    rope_table_kernel<<<tm__cu_blocks(st, Tn * half), TM__CU_THREADS, 0, st->stream>>>(cs, sn, Tn, half, c->iattr[0],
                                                                                        c->fattr[0], sign);
    const int64_t rows = B * Tn * H;
    TM__CU_LAUNCH_FLOAT(src->dtype, rope_rotate_kernel, tm__cu_blocks(st, rows * half), TM__CU_THREADS, 0, st->stream,
                        tm__data(dst), tm__data(src), cs, sn, rows, Tn, H, half, add);
    TM__CU_LAUNCHED(ctx, "rope", "rope_table_kernel / rope_rotate_kernel");
    return TM_OK;
}

extern "C" tm_status tm__rope_forward_cuda(tm__call *c) { return rope_apply(c, c->out[0], c->in[0], +1.0, 0); }

extern "C" tm_status tm__rope_backward_cuda(tm__call *c) {
    if (!c->gin[0]) return TM_OK;
    return rope_apply(c, c->gin[0], c->gout[0], -1.0, c->gin_fresh[0] ? 2 : 1);
}
