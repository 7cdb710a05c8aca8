/*
 * moe_gating.cu — CUDA kernels of tm_moe_gating: the router's gating GEMM in f32 from bf16
 * activations, without the f32 copy of x that tm_cast + tm_matmul made.
 *
 * Layout (as kernels/cpu/moe_gating.c):
 *   in[0]  x       (T, H)   bf16 (or f32: then cuBLASLt, as tm_matmul)
 *   in[1]  w       (H, E)   f32
 *   out[0] logits  (T, E)   f32
 *   logits[t, e] = sum_h x[t, h] w[h, e]
 *   dx[t, h]     = sum_e dlogits[t, e] w[h, e]      bf16: (old dx, widened) + the sum, rounded once
 *   dw[h, e]    += sum_t x[t, h] dlogits[t, e]      f32
 * Why kernels of our own: with E = 8 (coarse) to 64 (fine) the three products are thin GEMMs
 * bound by the (T, H) operand's memory, and going through an f32 copy of x doubled that memory
 * and added the cast's passes both ways (issue 20's step profile: 2.0 ms of a coarse step for the
 * router's GEMMs and casts). Each kernel reads or writes the (T, H) operand once, in bf16.
 *
 * Sums in f32 with fmaf, each in a fixed order whatever the grid (deterministic, no atomics):
 *   logits and dx: h (resp. e) ascending in one thread;
 *   dw: tokens ascending inside chunks of gt_tc(T) tokens (a function of T alone), one thread per
 *   (chunk, h, e); the chunks' partial sums (f32 scratch (P, H, E)) are added by tm__cu_reduce in
 *   its fixed order.
 * Tiles: the forward gives a thread one token and GT_EC experts (x's tile is staged through
 * shared memory, transposed, so the thread reads its token's values conflict-free; w's tile is
 * read by all threads at once: broadcasts); dx gives a thread one h and GT_TS tokens (its row of
 * w in registers, dlogits' tile read by all threads at once; stores coalesced along h); dw gives
 * a thread one h and GT_EC experts over its chunk's tokens. Blocks of GT_TB threads; out-of-range rows and columns are loaded as
 * zeros and never stored.
 */
#include "common.cuh"

#define GT_TB 128 /* threads a block */
#define GT_HC 32  /* forward: h per shared-memory tile */
#define GT_TS 32  /* dx: tokens a block and experts per tile; dw: tokens per tile */
#define GT_EC 16  /* experts a thread (forward, dw) */

/* dw's chunk of tokens: 256, or more so that there are at most 1024 chunks (the scratch is
 * P H E floats). A function of T alone: the same sums on every run. */
static int64_t gt_tc(int64_t T) {
    int64_t tc = 256;
    while ((T + tc - 1) / tc > 1024) tc *= 2;
    return tc;
}

/* logits (T, E) = x (T, H) @ w (H, E). grid (ceil(T / GT_TB), ceil(E / GT_EC)) */
__global__ void __launch_bounds__(GT_TB) gating_forward_kernel(float *logits, const tm__bf16 *x, const float *w,
                                                               int64_t T, int64_t H, int64_t E) {
    __shared__ float xs[GT_HC][GT_TB + 1];
    __shared__ float ws[GT_HC][GT_EC];
    const int tid = threadIdx.x;
    const int64_t t0 = (int64_t)blockIdx.x * GT_TB, e0 = (int64_t)blockIdx.y * GT_EC;
    float acc[GT_EC];
#pragma unroll
    for (int j = 0; j < GT_EC; j++) acc[j] = 0.0f;
    for (int64_t h0 = 0; h0 < H; h0 += GT_HC) {
        /* x's tile, coalesced along h, stored transposed: xs[hh][token] */
        for (int i = tid; i < GT_TB * GT_HC; i += GT_TB) {
            const int r = i / GT_HC, hh = i % GT_HC;
            const int64_t t = t0 + r, h = h0 + hh;
            xs[hh][r] = t < T && h < H ? __bfloat162float(x[t * H + h]) : 0.0f;
        }
        for (int i = tid; i < GT_HC * GT_EC; i += GT_TB) {
            const int hh = i / GT_EC, j = i % GT_EC;
            const int64_t h = h0 + hh, e = e0 + j;
            ws[hh][j] = h < H && e < E ? w[h * E + e] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int hh = 0; hh < GT_HC; hh++) {
            const float xv = xs[hh][tid];
#pragma unroll
            for (int j = 0; j < GT_EC; j++) acc[j] = fmaf(xv, ws[hh][j], acc[j]);
        }
        __syncthreads();
    }
    const int64_t t = t0 + tid;
    if (t >= T) return;
#pragma unroll
    for (int j = 0; j < GT_EC; j++)
        if (e0 + j < E) logits[t * E + e0 + j] = acc[j];
}

/* dx (T, H) (=|+=) dlogits (T, E) @ w^T: a thread per h (stores coalesced along h) over GT_TS
 * tokens, e ascending. grid (ceil(H / GT_TB), ceil(T / GT_TS)); fresh: dx is written (not read) */
__global__ void __launch_bounds__(GT_TB) gating_dx_kernel(tm__bf16 *dx, const float *dl, const float *w, int64_t T,
                                                          int64_t H, int64_t E, int fresh) {
    __shared__ float ds[GT_TS][GT_TS]; /* dlogits' tile: ds[token][e] */
    const int tid = threadIdx.x;
    const int64_t h = (int64_t)blockIdx.x * GT_TB + tid, t0 = (int64_t)blockIdx.y * GT_TS;
    float acc[GT_TS];
#pragma unroll
    for (int r = 0; r < GT_TS; r++) acc[r] = 0.0f;
    for (int64_t e0 = 0; e0 < E; e0 += GT_TS) {
        float wr[GT_TS]; /* w[h, e0 .. e0 + GT_TS), this thread's row */
#pragma unroll
        for (int j = 0; j < GT_TS; j++) wr[j] = h < H && e0 + j < E ? w[h * E + e0 + j] : 0.0f;
        for (int i = tid; i < GT_TS * GT_TS; i += GT_TB) {
            const int r = i / GT_TS, j = i % GT_TS;
            const int64_t t = t0 + r, e = e0 + j;
            ds[r][j] = t < T && e < E ? dl[t * E + e] : 0.0f;
        }
        __syncthreads();
#pragma unroll 4
        for (int r = 0; r < GT_TS; r++) {
            float a = acc[r];
#pragma unroll
            for (int j = 0; j < GT_TS; j++) a = fmaf(ds[r][j], wr[j], a);
            acc[r] = a;
        }
        __syncthreads();
    }
    if (h >= H) return;
#pragma unroll 4
    for (int r = 0; r < GT_TS; r++) {
        const int64_t t = t0 + r;
        if (t >= T) break;
        tm__bf16 *o = dx + t * H + h;
        tm__st(o, fresh ? acc[r] : tm__ld(o) + acc[r]);
    }
}

/* part[p] (H, E) = sum over the tokens of chunk p of x[t, h] dlogits[t, e], tokens ascending.
 * grid (ceil(H / GT_TB), ceil(E / GT_EC), P) */
__global__ void __launch_bounds__(GT_TB) gating_dw_kernel(float *part, const tm__bf16 *x, const float *dl, int64_t T,
                                                          int64_t H, int64_t E, int64_t tc) {
    __shared__ float xs[GT_TS][GT_TB];  /* x's tile: xs[token][hh] */
    __shared__ float ds[GT_TS][GT_EC];  /* dlogits' tile: ds[token][j] */
    const int tid = threadIdx.x;
    const int64_t h0 = (int64_t)blockIdx.x * GT_TB, e0 = (int64_t)blockIdx.y * GT_EC, p = blockIdx.z;
    const int64_t tb = p * tc, te = tb + tc < T ? tb + tc : T;
    float acc[GT_EC];
#pragma unroll
    for (int j = 0; j < GT_EC; j++) acc[j] = 0.0f;
    for (int64_t s0 = tb; s0 < te; s0 += GT_TS) {
        for (int i = tid; i < GT_TS * GT_TB; i += GT_TB) {
            const int r = i / GT_TB, hh = i % GT_TB;
            const int64_t t = s0 + r, h = h0 + hh;
            xs[r][hh] = t < te && h < H ? __bfloat162float(x[t * H + h]) : 0.0f;
        }
        for (int i = tid; i < GT_TS * GT_EC; i += GT_TB) {
            const int r = i / GT_EC, j = i % GT_EC;
            const int64_t t = s0 + r, e = e0 + j;
            ds[r][j] = t < te && e < E ? dl[t * E + e] : 0.0f;
        }
        __syncthreads();
#pragma unroll 4
        for (int r = 0; r < GT_TS; r++) {
            const float xv = xs[r][tid];
#pragma unroll
            for (int j = 0; j < GT_EC; j++) acc[j] = fmaf(xv, ds[r][j], acc[j]);
        }
        __syncthreads();
    }
    const int64_t h = h0 + tid;
    if (h >= H) return;
    float *o = part + (p * H + h) * E + e0;
#pragma unroll
    for (int j = 0; j < GT_EC; j++)
        if (e0 + j < E) o[j] = acc[j];
}

static const char *const GT_WHAT = "moe_gating";

static bool gt_mixed(const tm__call *c) { return c->in[0]->dtype == TM_BF16 && c->in[1]->dtype == TM_F32; }

static unsigned gt_cdiv(int64_t a, int64_t b) { return (unsigned)((a + b - 1) / b); }

extern "C" tm_status tm__moe_gating_forward_cuda(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    void *Y = tm__data(c->out[0]);
    if (!gt_mixed(c)) /* x in w's dtype: the plain GEMM, as tm_matmul */
        return tm__gemm_cuda(c->ctx, w->dtype, 0, 0, T, E, H, 1.0, tm__data(x), H, 0, tm__data(w), E, 0, 0.0, Y, E, 0, 1);
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, GT_WHAT, &st));
    if (T == 0 || E == 0) return TM_OK;
    if (gt_cdiv(T, GT_TB) > 2147483647u || gt_cdiv(E, GT_EC) > 65535u)
        return tm__err(c->ctx, TM_ERR_UNSUPPORTED, "moe_gating: x %s, w %s: more than 65535 x %d experts",
                       tm__tdesc(c->ctx, x), tm__tdesc(c->ctx, w), GT_EC);
    gating_forward_kernel<<<dim3(gt_cdiv(T, GT_TB), gt_cdiv(E, GT_EC)), GT_TB, 0, st->stream>>>(
        (float *)Y, (const tm__bf16 *)tm__data(x), (const float *)tm__data(w), T, H, E);
    TM__CU_LAUNCHED(c->ctx, GT_WHAT, "gating_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__moe_gating_backward_cuda(tm__call *c) {
    const tm_tensor *x = c->in[0], *w = c->in[1];
    tm_tensor *gx = c->gin[0], *gw = c->gin[1];
    const int64_t T = x->shape[0], H = x->shape[1], E = w->shape[1];
    const void *G = tm__data(c->gout[0]);
    if (!gt_mixed(c)) {
        /* a fresh gradient (call->gin_fresh) is written by beta = 0, which never reads it */
        if (gx)
            TM__TRY(tm__gemm_cuda(c->ctx, w->dtype, 0, 1, T, H, E, 1.0, G, E, 0, tm__data(w), E, 0,
                                  c->gin_fresh[0] ? 0.0 : 1.0, tm__data(gx), H, 0, 1));
        if (gw)
            TM__TRY(tm__gemm_cuda(c->ctx, w->dtype, 1, 0, H, E, T, 1.0, tm__data(x), H, 0, G, E, 0,
                                  c->gin_fresh[1] ? 0.0 : 1.0, tm__data(gw), E, 0, 1));
        return TM_OK;
    }
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, GT_WHAT, &st));
    if (T == 0 || H == 0 || E == 0) { /* nothing to add; a fresh gradient is written as zeros */
        TM__TRY(tm__gin_prepare(c, 0));
        return tm__gin_prepare(c, 1);
    }
    if (gx) {
        if (gt_cdiv(T, GT_TS) > 65535u)
            return tm__err(c->ctx, TM_ERR_UNSUPPORTED, "moe_gating: x %s: more than 65535 x %d tokens",
                           tm__tdesc(c->ctx, x), GT_TS);
        gating_dx_kernel<<<dim3(gt_cdiv(H, GT_TB), gt_cdiv(T, GT_TS)), GT_TB, 0, st->stream>>>(
            (tm__bf16 *)tm__data(gx), (const float *)G, (const float *)tm__data(w), T, H, E, (int)c->gin_fresh[0]);
        TM__CU_LAUNCHED(c->ctx, GT_WHAT, "gating_dx_kernel");
    }
    if (gw) {
        const int64_t tc = gt_tc(T), P = (T + tc - 1) / tc;
        if (gt_cdiv(E, GT_EC) > 65535u)
            return tm__err(c->ctx, TM_ERR_UNSUPPORTED, "moe_gating: w %s: more than 65535 x %d experts",
                           tm__tdesc(c->ctx, w), GT_EC);
        float *part;
        TM__TRY(tm__cu_scratch(c->ctx, st, (size_t)(P * H * E) * sizeof(float), (void **)&part));
        gating_dw_kernel<<<dim3(gt_cdiv(H, GT_TB), gt_cdiv(E, GT_EC), (unsigned)P), GT_TB, 0, st->stream>>>(
            part, (const tm__bf16 *)tm__data(x), (const float *)G, T, H, E, tc);
        TM__CU_LAUNCHED(c->ctx, GT_WHAT, "gating_dw_kernel");
        TM__TRY(tm__cu_reduce(c->ctx, GT_WHAT, TM_F32, part, TM_F32, tm__data(gw), 1, P, H * E, 1.0f,
                              !c->gin_fresh[1]));
    }
    return TM_OK;
}
