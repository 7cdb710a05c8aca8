/*
 * rope.c — CPU kernels of tm_rope, rotary position embedding in the rotate-half pairing of
 * GPT-NeoX / Llama / Mixtral (HF transformers' rotate_half), not the interleaved (2i, 2i+1)
 * pairing of the RoFormer paper.
 *
 * Layout:
 *   in[0]   x (B, T, H, D), D = 2 * half; row t sits at position pos = pos_offset + t
 *   out[0]  y (B, T, H, D)
 *   saved   none: the rotation depends on positions only.
 * For i < half, with angle = pos * theta^(-2i/D) and (x1, x2) = (x[i], x[i + half]):
 *   forward   y1 = x1 cos - x2 sin,    y2 = x2 cos + x1 sin
 *   backward  the transpose of a rotation is the rotation by -angle:
 *             dx1 += dy1 cos + dy2 sin,  dx2 += dy2 cos - dy1 sin
 *
 * The backward writes dx whole (TM__OP_GRAD_WRITES): a fresh dx (call->gin_fresh) is stored as
 * 0 + the rotation, the bits adding into zeros gives, without being read.
 *
 * cos/sin are tabulated once per call, (T, half), in f64: at positions in the tens of
 * thousands an f32 angle has already lost the bits that decide the rotation.
 */
#include <math.h>

#include "internal.h"

enum { PAR_MIN = 1 << 15 };

/* cs/sn: (T, half) tables; sn already carries the sign of the rotation (backward: -sin). */
#define ROPE_KERNEL(T, SFX)                                                                      \
    static void rope_rotate_##SFX(T *y, const T *x, const double *cs, const double *sn,          \
                                  int64_t B, int64_t Tn, int64_t H, int64_t half, int add,        \
                                  int nth) {                                                      \
        const int64_t rows = B * Tn * H, D = 2 * half;                                           \
        _Pragma("omp parallel for num_threads(nth) if (rows * D >= PAR_MIN) schedule(static)")   \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const int64_t t = (r / H) % Tn;                                                       \
            const double *c_ = cs + t * half, *s_ = sn + t * half;                                \
            const T *x1 = x + r * D, *x2 = x1 + half;                                             \
            T *y1 = y + r * D, *y2 = y1 + half;                                                   \
            if (add == 1) {                                                                       \
                _Pragma("omp simd")                                                               \
                for (int64_t i = 0; i < half; i++) {                                              \
                    double a = x1[i], b = x2[i];                                                  \
                    y1[i] = (T)(y1[i] + (a * c_[i] - b * s_[i]));                                \
                    y2[i] = (T)(y2[i] + (b * c_[i] + a * s_[i]));                                \
                }                                                                                 \
            } else if (add == 2) {                                                                \
                _Pragma("omp simd")                                                               \
                for (int64_t i = 0; i < half; i++) {                                              \
                    double a = x1[i], b = x2[i];                                                  \
                    y1[i] = (T)(0.0 + (a * c_[i] - b * s_[i]));                                  \
                    y2[i] = (T)(0.0 + (b * c_[i] + a * s_[i]));                                  \
                }                                                                                 \
            } else {                                                                              \
                _Pragma("omp simd")                                                               \
                for (int64_t i = 0; i < half; i++) {                                              \
                    double a = x1[i], b = x2[i];                                                  \
                    y1[i] = (T)(a * c_[i] - b * s_[i]);                                           \
                    y2[i] = (T)(b * c_[i] + a * s_[i]);                                           \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

ROPE_KERNEL(float, f32)
ROPE_KERNEL(double, f64)

/* Rotate src by sign * angle into dst (add = 0), add the rotation into dst (add = 1), or store
 * 0 + the rotation into a fresh gradient dst (add = 2). */
static tm_status rope_apply(tm__call *c, tm_tensor *dst, const tm_tensor *src, double sign, int add) {
    tm_ctx *ctx = c->ctx;
    const int64_t B = src->shape[0], Tn = src->shape[1], H = src->shape[2], half = src->shape[3] / 2;
    const int64_t pos0 = c->iattr[0];
    const double theta = c->fattr[0];
    const int nth = tm__nthreads(ctx);
    if (B * Tn * H * half == 0) return TM_OK;

    double *cs = tm__arena_alloc(ctx, tm_cpu(), (size_t)(2 * Tn * half) * sizeof(double));
    if (!cs) return TM_ERR_NOMEM;
    double *sn = cs + Tn * half;
#pragma omp parallel for num_threads(nth) if (Tn * half >= 4096) schedule(static)
    for (int64_t t = 0; t < Tn; t++) {
        const double pos = (double)(pos0 + t);
        for (int64_t i = 0; i < half; i++) {
            const double angle = pos * pow(theta, -2.0 * (double)i / (double)(2 * half));
            cs[t * half + i] = cos(angle);
            sn[t * half + i] = sign * sin(angle);
        }
    }

    switch (src->dtype) {
    case TM_F32: rope_rotate_f32(tm__data(dst), tm__data(src), cs, sn, B, Tn, H, half, add, nth); return TM_OK;
    case TM_F64: rope_rotate_f64(tm__data(dst), tm__data(src), cs, sn, B, Tn, H, half, add, nth); return TM_OK;
    default:
        return tm__err(ctx, TM_ERR_INTERNAL, "rope: CPU kernel got x %s", tm__tdesc(ctx, src));
    }
}

tm_status tm__rope_forward_cpu(tm__call *c) { return rope_apply(c, c->out[0], c->in[0], +1.0, 0); }

tm_status tm__rope_backward_cpu(tm__call *c) {
    if (!c->gin[0]) return TM_OK;
    return rope_apply(c, c->gin[0], c->gout[0], -1.0, c->gin_fresh[0] ? 2 : 1);
}
