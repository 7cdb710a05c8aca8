/*
 * attention_sm90.h — the Hopper (sm_90a, wgmma) kernels of tm_attention's bf16 path, D 64 or 128:
 * forward, dQ and dK/dV (attention_sm90.cu; the layout, the math and the tile shapes are described
 * there). attention.cu calls them on an sm_90 device when the build holds their sm_90a image and
 * keeps its mma.sync kernels (attention_tc.cuh) for every other GPU and as their parity reference;
 * Delta_i = dO_i . o_i comes from attention.cu's fa_delta_kernel in both cases.
 */
#ifndef TM_ATTENTION_SM90_H
#define TM_ATTENTION_SM90_H

#include <cuda_runtime.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Tensors as in attention.cu: q, o, dout, dq (B, Tq, Hq, D); k, v, dk, dv (B, Tk, Hkv, D), bf16,
 * rows of D contiguous, 16-byte aligned; lse, delta (B, Hq, Tq) f32. Query i sees keys
 * j <= i + off, off = Tk - Tq >= 0. */
typedef struct tm__fa90_args {
    const void *q, *k, *v, *dout;
    void *out, *dq, *dk, *dv; /* forward: out; backward: any of dq, dk, dv may be NULL */
    float *lse;               /* forward: written (natural log); backward: read */
    const float *delta;       /* backward: Delta_i */
    int B, Tq, Tk, Hq, Hkv, D;
    float scale;              /* s_ij = scale q_i . k_j */
    int fq, fk, fv;           /* dq / dk / dv fresh: stored, not read and added to */
} tm__fa90_args;

/* 1 when the current device is sm_90 and this build holds the kernels' sm_90a image; else 0 with
 * the reason in why. */
int tm__fa90_supported(char *why, size_t why_len);

/* 0: launched on stream (nothing when Tq is 0); else 1, why says what. The forward fails before
 * launching anything; the backward checks its arguments first, but a failure to encode or launch
 * the dK/dV kernel comes after dQ's launch. D must be 64 or 128, Hq a multiple of Hkv,
 * Tk >= Tq, the tensors as above. */
int tm__fa90_forward(const tm__fa90_args *a, cudaStream_t stream, char *why, size_t why_len);
int tm__fa90_backward(const tm__fa90_args *a, cudaStream_t stream, char *why, size_t why_len);

#ifdef __cplusplus
}
#endif

#endif
