/*
 * update.cu — CUDA kernels of the update ops (attribute layout: framework/ops/update.c; CPU
 * kernels: kernels/cpu/update.c).
 *
 * Layout: every tensor is a contiguous 1-D range of n elements with the same element offsets
 * (a parameter, or a bucket range of parameters / gradients / f32 state / f32 master):
 *   adamw_update  in: p (n) f32|bf16, g (n) like p, m (n) f32, v (n) f32 [, master (n) f32]
 *   sgd_update    in: p (n), g (n) [, b (n) f32] [, master (n) f32]
 *   grad_sumsq    in: g (n) -> out () f32: sum_i g_i^2 accumulated in f64, rounded once
 *   grad_scale    in: g (n), written in place: g *= scale
 * No saved tensors (nothing is on the tape).
 *
 * AdamW: m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
 *        p -= lr ((m / bc1) / (sqrt(v / bc2) + eps) + wd p)
 * SGD:   g' = g + wd p;  b = mom b + g';  p -= lr (nesterov ? g' + mom b : b)
 *
 * Bit for bit with the CPU: the elementwise updates compute in f32 with every operation
 * rounded on its own, in the CPU kernel's order (__fmul_rn / __fadd_rn / __fdiv_rn /
 * __fsqrt_rn never fuse into an FMA, which nvcc would otherwise do and the ISO C11 CPU build
 * does not), from the same f32-rounded attributes. bf16 parameters are loaded, updated in f32
 * and stored rounded to nearest even; with an f32 master the master is read and written and
 * the parameter is the master rounded, exactly as on the CPU.
 *
 * grad_sumsq: f64 tensors cannot live on CUDA, so its output is a 0-d f32 (the CPU's is f64).
 * The f64 sum is deterministic and depends on n only: the CPU's chunking (at most 256 chunks of
 * at least 4096 elements), one block per chunk reducing its chunk in a fixed tree, then the
 * chunk partials added in chunk order by one thread. The order inside a chunk differs from
 * the CPU's sequential sum, so the two agree to f64 rounding (then f32 rounding), not bit for
 * bit. Nothing is read back: tm_ctx_clip_grad_norm reads every bucket's partial in one copy.
 */
#include "common.cuh"

/* ---- AdamW ----------------------------------------------------------------------------------- */

template <typename T>
__global__ void adamw_kernel(void *p_, const void *g_, float *m, float *v, float *master, int64_t n, float lr, float b1,
                             float omb1, float b2, float omb2, float eps, float wd, float bc1, float bc2) {
    T *p = (T *)p_;
    const T *g = (const T *)g_;
    TM__CU_GRID_STRIDE(i, n) {
        float gi = tm__ld(g + i), pi = master ? master[i] : tm__ld(p + i);
        float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(omb1, gi));
        float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(omb2, gi), gi));
        m[i] = mi;
        v[i] = vi;
        float step = __fdiv_rn(__fdiv_rn(mi, bc1), __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, bc2)), eps));
        pi = __fsub_rn(pi, __fmul_rn(lr, __fadd_rn(step, __fmul_rn(wd, pi))));
        if (master) master[i] = pi;
        tm__st(p + i, pi);
    }
}

extern "C" tm_status tm__adamw_update_forward_cuda(tm__call *c) {
    tm_tensor *p = c->in[0];
    int64_t n = tm__numel(p);
    if (p->dtype != TM_F32 && p->dtype != TM_BF16)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "adamw_update: dtype %s on CUDA", tm_dtype_name(p->dtype));
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "adamw_update", &st));
    if (n == 0) return TM_OK;
    const double *f = c->fattr;
    float *m = (float *)tm__data(c->in[2]), *v = (float *)tm__data(c->in[3]);
    float *master = c->iattr[0] ? (float *)tm__data(c->in[4]) : NULL;
    TM__CU_LAUNCH_FLOAT(p->dtype, adamw_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream, tm__data(p),
                        tm__data(c->in[1]), m, v, master, n, (float)f[0], (float)f[1], (float)f[2], (float)f[3],
                        (float)f[4], (float)f[5], (float)f[6], (float)f[7], (float)f[8]);
    TM__CU_LAUNCHED(c->ctx, "adamw_update", "adamw_kernel");
    return TM_OK;
}

/* ---- SGD ------------------------------------------------------------------------------------- */

/* b NULL: plain SGD (momentum 0). */
template <typename T>
__global__ void sgd_kernel(void *p_, const void *g_, float *b, float *master, int64_t n, float lr, float mom,
                           int nesterov, float wd) {
    T *p = (T *)p_;
    const T *g = (const T *)g_;
    TM__CU_GRID_STRIDE(i, n) {
        float pi = master ? master[i] : tm__ld(p + i);
        float gi = __fadd_rn(tm__ld(g + i), __fmul_rn(wd, pi));
        float d = gi;
        if (b) {
            float bi = __fadd_rn(__fmul_rn(mom, b[i]), gi);
            b[i] = bi;
            d = nesterov ? __fadd_rn(gi, __fmul_rn(mom, bi)) : bi;
        }
        pi = __fsub_rn(pi, __fmul_rn(lr, d));
        if (master) master[i] = pi;
        tm__st(p + i, pi);
    }
}

extern "C" tm_status tm__sgd_update_forward_cuda(tm__call *c) {
    tm_tensor *p = c->in[0];
    int64_t n = tm__numel(p);
    if (p->dtype != TM_F32 && p->dtype != TM_BF16)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "sgd_update: dtype %s on CUDA", tm_dtype_name(p->dtype));
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "sgd_update", &st));
    if (n == 0) return TM_OK;
    int k = 2;
    float *b = c->iattr[0] ? (float *)tm__data(c->in[k++]) : NULL;
    float *master = c->iattr[1] ? (float *)tm__data(c->in[k++]) : NULL;
    const double *f = c->fattr;
    TM__CU_LAUNCH_FLOAT(p->dtype, sgd_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream, tm__data(p),
                        tm__data(c->in[1]), b, master, n, (float)f[0], (float)f[1], (int)c->iattr[2], (float)f[2]);
    TM__CU_LAUNCHED(c->ctx, "sgd_update", "sgd_kernel");
    return TM_OK;
}

/* ---- grad_sumsq ------------------------------------------------------------------------------ */

/* The CPU kernel's chunking (kernels/cpu/update.c), so both split n alike. */
enum { SUMSQ_MAX_CHUNKS = 256, SUMSQ_MIN_CHUNK = 4096, SUMSQ_THREADS = 256 };

/* Sum of v over the block in f64, in a fixed tree; thread 0 gets the result. sh: 32 doubles. */
__device__ __forceinline__ double sumsq_block_sum(double v, double *sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Block k sums chunk k: [k chunk, min(n, (k+1) chunk)). With one chunk, out gets the f32 result
 * directly; otherwise part[k] gets the f64 partial. */
template <typename T>
__global__ void sumsq_chunk_kernel(const void *g_, int64_t n, int64_t chunk, double *part, float *out) {
    __shared__ double sh[32];
    const T *g = (const T *)g_;
    int64_t lo = (int64_t)blockIdx.x * chunk, hi = lo + chunk < n ? lo + chunk : n;
    double acc = 0.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        double x = (double)tm__ld(g + i);
        acc = fma(x, x, acc);
    }
    acc = sumsq_block_sum(acc, sh);
    if (threadIdx.x == 0) {
        if (out) *out = (float)acc;
        else part[blockIdx.x] = acc;
    }
}

/* The partials in chunk order, as the CPU adds its chunk sums. */
__global__ void sumsq_final_kernel(const double *part, int nc, float *out) {
    double acc = 0.0;
    for (int k = 0; k < nc; k++) acc += part[k];
    *out = (float)acc;
}

extern "C" tm_status tm__grad_sumsq_forward_cuda(tm__call *c) {
    const tm_tensor *g = c->in[0];
    int64_t n = tm__numel(g);
    if (g->dtype != TM_F32 && g->dtype != TM_BF16)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "grad_sumsq: dtype %s on CUDA", tm_dtype_name(g->dtype));
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "grad_sumsq", &st));
    float *out = (float *)tm__data(c->out[0]);
    if (n == 0) {
        TM__TRY(tm__cuda_memset0(c->ctx, out, sizeof(float)));
        return TM_OK;
    }
    int64_t chunk = (n + SUMSQ_MAX_CHUNKS - 1) / SUMSQ_MAX_CHUNKS;
    if (chunk < SUMSQ_MIN_CHUNK) chunk = SUMSQ_MIN_CHUNK;
    int nc = (int)((n + chunk - 1) / chunk); /* 1..256 */
    double *part = NULL;
    if (nc > 1) TM__TRY(tm__cu_scratch(c->ctx, st, (size_t)nc * sizeof(double), (void **)&part));
    TM__CU_LAUNCH_FLOAT(g->dtype, sumsq_chunk_kernel, (unsigned)nc, SUMSQ_THREADS, 0, st->stream, tm__data(g), n, chunk,
                        part, nc > 1 ? (float *)NULL : out);
    TM__CU_LAUNCHED(c->ctx, "grad_sumsq", "sumsq_chunk_kernel");
    if (nc > 1) {
        sumsq_final_kernel<<<1, 1, 0, st->stream>>>(part, nc, out);
        TM__CU_LAUNCHED(c->ctx, "grad_sumsq", "sumsq_final_kernel");
    }
    return TM_OK;
}

/* ---- grad_scale ------------------------------------------------------------------------------ */

template <typename T>
__global__ void scale_kernel(void *g_, int64_t n, float s) {
    T *g = (T *)g_;
    TM__CU_GRID_STRIDE(i, n) tm__st(g + i, __fmul_rn(tm__ld(g + i), s));
}

extern "C" tm_status tm__grad_scale_forward_cuda(tm__call *c) {
    tm_tensor *g = c->in[0];
    int64_t n = tm__numel(g);
    if (g->dtype != TM_F32 && g->dtype != TM_BF16)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "grad_scale: dtype %s on CUDA", tm_dtype_name(g->dtype));
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, "grad_scale", &st));
    if (n == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(g->dtype, scale_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream, tm__data(g), n,
                        (float)c->fattr[0]);
    TM__CU_LAUNCHED(c->ctx, "grad_scale", "scale_kernel");
    return TM_OK;
}
