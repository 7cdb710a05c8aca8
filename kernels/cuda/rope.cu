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
#include "vec.cuh"

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

/* One thread per (b, t) and V consecutive pairs i0 .. i0 + V - 1, over every head h of that
 * position: the V cos/sin pairs are read once for all H heads (a thread per pair read 16 bytes
 * of table per 4 bytes of bf16 x, from L2, and ran at half the memory's rate), and x1, x2 move
 * as V-element accesses (8 bytes of bf16, 16 of f32) when V is 4. Each pair gets the same f64
 * arithmetic as before: y = rotation of x (add 1: y += rotation of x; add 2: y = 0 + rotation
 * of x, y not read), rounded to f32 and then, for bf16, to bf16 on store (as tm__st of the f32). */
template <typename T, int V>
__global__ void rope_rotate_kernel(void *y_, const void *x_, const double *cs, const double *sn, int64_t BT,
                                   int64_t Tn, int64_t H, int64_t half, int add) {
    T *y = (T *)y_;
    const T *x = (const T *)x_;
    const int64_t hv = half / V;
    TM__CU_GRID_STRIDE(e, BT * hv) {
        const int64_t bt = e / hv, i0 = (e - bt * hv) * V, t = bt % Tn;
        double c[V], s[V];
#pragma unroll
        for (int k = 0; k < V; k++) c[k] = cs[t * half + i0 + k], s[k] = sn[t * half + i0 + k];
        for (int64_t h = 0; h < H; h++) {
            const int64_t p1 = (bt * H + h) * 2 * half + i0, p2 = p1 + half;
            float a[V], b[V], o1[V], o2[V];
            tm__vld<V>(x + p1, a);
            tm__vld<V>(x + p2, b);
            if (add == 1) {
                tm__vld<V>(y + p1, o1);
                tm__vld<V>(y + p2, o2);
            }
#pragma unroll
            for (int k = 0; k < V; k++) {
                double y1 = (double)a[k] * c[k] - (double)b[k] * s[k], y2 = (double)b[k] * c[k] + (double)a[k] * s[k];
                if (add == 1) {
                    y1 += o1[k];
                    y2 += o2[k];
                } else if (add == 2) {
                    y1 += 0.0;
                    y2 += 0.0;
                }
                o1[k] = (float)y1;
                o2[k] = (float)y2;
            }
            tm__vst<V>(y + p1, o1);
            tm__vst<V>(y + p2, o2);
        }
    }
}

template <int V>
static void rope_rotate_launch(const tm__cuda *st, tm_dtype dt, void *y, const void *x, const double *cs,
                               const double *sn, int64_t BT, int64_t Tn, int64_t H, int64_t half, int add) {
    const unsigned g = tm__cu_blocks(st, BT * (half / V));
    if (dt == TM_BF16)
        rope_rotate_kernel<tm__bf16, V><<<g, TM__CU_THREADS, 0, st->stream>>>(y, x, cs, sn, BT, Tn, H, half, add);
    else rope_rotate_kernel<float, V><<<g, TM__CU_THREADS, 0, st->stream>>>(y, x, cs, sn, BT, Tn, H, half, add);
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
    const size_t va = 4 * (src->dtype == TM_BF16 ? 2 : 4); /* bytes of a 4-element access */
    void *yd = tm__data(dst);
    const void *xd = tm__data(src);
    if (half % 4 == 0 && ((uintptr_t)yd % va) == 0 && ((uintptr_t)xd % va) == 0)
        rope_rotate_launch<4>(st, src->dtype, yd, xd, cs, sn, B * Tn, Tn, H, half, add);
    else rope_rotate_launch<1>(st, src->dtype, yd, xd, cs, sn, B * Tn, Tn, H, half, add);
    TM__CU_LAUNCHED(ctx, "rope", "rope_table_kernel / rope_rotate_kernel");
    return TM_OK;
}

extern "C" tm_status tm__rope_forward_cuda(tm__call *c) { return rope_apply(c, c->out[0], c->in[0], +1.0, 0); }

extern "C" tm_status tm__rope_backward_cuda(tm__call *c) {
    if (!c->gin[0]) return TM_OK;
    return rope_apply(c, c->gin[0], c->gout[0], -1.0, c->gin_fresh[0] ? 2 : 1);
}
