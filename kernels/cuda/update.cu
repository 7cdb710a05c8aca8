/*
 * update.cu — CUDA kernels of the update ops (attribute layout: framework/ops/update.c; CPU
 * kernels: kernels/cpu/update.c).
 *
 * Layout: every tensor is a contiguous 1-D range of n elements with the same element offsets
 * (a parameter, or a bucket range of parameters / gradients / f32 state / f32 master):
 *   sgd_update    in: p (n), g (n) [, b (n) f32] [, master (n) f32]
 *   adamw_update_multi, grad_sumsq_multi, grad_scale_multi: over every range (n_s) of a segment
 *                 table of this device (framework/update_multi.h; tm_adamw_update,
 *                 tm_grad_sumsq and tm_grad_scale pass one range): AdamW on p (n_s) f32|bf16,
 *                 g like p, m, v [, master] f32; grad_sumsq_multi -> partials (ranges) f32
 *                 (sum_i g_i^2 accumulated in f64, rounded once), factor () f32;
 *                 grad_scale_multi: g *= factor () (see "fused updates" at the end of this
 *                 file, with the launch counts)
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
 * The sum of squares: f64 tensors cannot live on CUDA, so its partials are f32 (the CPU's f64).
 * The f64 sum is deterministic and depends on n only: the CPU's chunking (at most 256 chunks of
 * at least 4096 elements), one block per chunk reducing its chunk in a fixed tree, then the
 * chunk partials added in chunk order by one thread. The order inside a chunk differs from
 * the CPU's sequential sum, so the two agree to f64 rounding (then f32 rounding), not bit for
 * bit. Nothing is read back: tm_ctx_clip_grad_norm reads every bucket's partial in one copy.
 */
#include "common.cuh"
#include "update_multi.h"
#include "vec.cuh"

/* ---- AdamW ----------------------------------------------------------------------------------- */

/* v rounded to T, as a store to T and a load back give it. */
template <typename T>
__device__ __forceinline__ float round_to(float v) {
    T t;
    tm__st(&t, v);
    return tm__ld(&t);
}

/* The one AdamW update of an element, in the CPU kernel's order: g the gradient, p the
 * parameter (or its master), m, v the moments, all updated in place. gs: the clip's factor (1:
 * none); the gradient is scaled as scale_elem would have stored it (the product rounded to T),
 * so the update is bit for bit the one that reads a gradient scaled by grad_scale_multi. */
template <typename T>
__device__ __forceinline__ void adamw_math(float gi, float &pi, float &mi, float &vi, float lr, float b1, float omb1,
                                           float b2, float omb2, float eps, float wd, float bc1, float bc2, float gs) {
    if (gs != 1.0f) gi = round_to<T>(__fmul_rn(gi, gs));
    mi = __fadd_rn(__fmul_rn(b1, mi), __fmul_rn(omb1, gi));
    vi = __fadd_rn(__fmul_rn(b2, vi), __fmul_rn(__fmul_rn(omb2, gi), gi));
    float step = __fdiv_rn(__fdiv_rn(mi, bc1), __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, bc2)), eps));
    pi = __fsub_rn(pi, __fmul_rn(lr, __fadd_rn(step, __fmul_rn(wd, pi))));
}

/* Element i of the ranges. */
template <typename T>
__device__ __forceinline__ void adamw_elem(T *p, const T *g, float *m, float *v, float *master, int64_t i, float lr,
                                           float b1, float omb1, float b2, float omb2, float eps, float wd, float bc1,
                                           float bc2, float gs) {
    float pi = master ? master[i] : tm__ld(p + i), mi = m[i], vi = v[i];
    adamw_math<T>(tm__ld(g + i), pi, mi, vi, lr, b1, omb1, b2, omb2, eps, wd, bc1, bc2, gs);
    m[i] = mi;
    v[i] = vi;
    if (master) master[i] = pi;
    tm__st(p + i, pi);
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

/* ---- the sum of squares ---------------------------------------------------------------------- */

/* The CPU kernel's chunking (tm__sumsq_chunk, framework/update_multi.h), so both split n alike:
 * at most 256 chunks, one block each, so a large bucket is 256 blocks on 132 SMs. 1024 threads a
 * block keep enough 16-byte loads in flight for the memory's rate (256 left the sum of a 1 GB
 * bucket at 2.2 TB/s on an H200). */
enum { SUMSQ_THREADS = 1024 };

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

/* This thread's share of the sum of squares of g[lo, hi), in a fixed order (a function of the
 * range and blockDim alone, so a chunk's sum is the same whichever table carries it): the range is a head up to the first
 * 16-byte boundary, whole 16-byte vectors (8 bf16 or 4 f32, kernels/cuda/vec.cuh), and a tail;
 * the thread takes head and tail elements lo + threadIdx.x + k blockDim.x and vectors
 * threadIdx.x + k blockDim.x, each vector's elements in order. 16-byte loads, several in
 * flight, are what keep this at the memory's rate (one 2-byte load per step left it at an
 * eighth of it). */
template <typename T>
__device__ __forceinline__ double sumsq_thread(const void *g_, int64_t lo, int64_t hi) {
    constexpr int N = tm__vec_n<T>::n;
    const T *g = (const T *)g_;
    int64_t a, nv, b;
    tm__vsplit(g, lo, hi, &a, &nv, &b);
    double acc = 0.0;
    for (int64_t i = lo + threadIdx.x; i < a; i += blockDim.x) {
        double x = (double)tm__ld(g + i);
        acc = fma(x, x, acc);
    }
#pragma unroll 4
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
        float f[N];
        tm__vld<N>(g + a + v * N, f);
#pragma unroll
        for (int k = 0; k < N; k++) acc = fma((double)f[k], (double)f[k], acc);
    }
    for (int64_t i = b + threadIdx.x; i < hi; i += blockDim.x) {
        double x = (double)tm__ld(g + i);
        acc = fma(x, x, acc);
    }
    return acc;
}

/* ---- scaling --------------------------------------------------------------------------------- */

template <typename T>
__device__ __forceinline__ void scale_elem(T *g, int64_t i, float s) {
    tm__st(g + i, __fmul_rn(tm__ld(g + i), s));
}

/* ---- fused updates over a segment table ------------------------------------------------------ */
/*
 * The table (framework/update_multi.h) lists ranges of several buckets of this device; segment
 * s owns the blocks [first, first + ceil(n / chunk)) (sfirst / schunk for the sum of squares),
 * and a block finds its segment by binary search over `first` (every thread of a block does the
 * same search on the same few cached words; no shared memory, no barrier). Each element gets
 * the arithmetic of the helpers above (adamw_elem, sumsq_thread, scale_elem), whichever
 * range and block carry it.
 *
 * grad_sumsq_multi in one launch: every block sums its chunk (sumsq_thread, then
 * sumsq_block_sum's fixed tree) and stores the f64 partial; the last block to finish (an integer
 * atomic ticket: the only atomic, it decides who adds, not the order) adds each segment's chunk
 * partials in chunk order
 * (the CPU's order), rounds the segment's sum to f32 (the segment's partial), adds
 * those in segment order in f64 from 0 (tm_ctx_clip_grad_norm's host sum), and computes the
 * norm and the factor in f64 (IEEE sqrt and division: the host's values) rounded to f32
 * (tm_grad_scale's (float)scale). The order never depends on which block finishes last.
 * grad_scale_multi reads that factor on the device and returns at once when it is 1 (no
 * clipping), so no host read sits between the two launches.
 *
 * Launches per optimizer step on one GPU, derived from optim/optimizer.c and optim/clip.c
 * (B buckets on the device, R_k decay runs in bucket k, C_k = 2 when bucket k's gradients span
 * more than one 4096-element chunk, else 1):
 *   before: AdamW sum_k R_k adamw_kernel; clip sum_k C_k sumsq kernels, B copy kernels (the
 *           partials concatenated, when B > 1), 1 read, and B scale_kernel when it clips
 *   after:  AdamW 1 adamw_multi_kernel; clip 1 sumsq_multi_kernel and 1 scale_multi_kernel
 *           (none when max_norm <= 0), and 1 read only when the caller asks for the norm (the
 *           driver does, every step: its non-finite guard precedes the update), plus one table
 *           upload on the first step or after a bucket moved, none in steady state
 *   deferred (tm_ctx_clip_grad_norm_deferred + tm_optimizer_step_scaled, what the driver
 *           runs): no scale_multi_kernel; adamw_multi_kernel reads the factor and scales each
 *           gradient as it loads it (adamw_elem), so the gradients are read twice per step
 *           (sum of squares, update) instead of three times and written never instead of once
 * E.g. an f32 MoE model of L = 12 layers: its dense bucket alternates decay (matrices) and no
 * decay (norm gains): embed | attn_norm | wq..wo | ffn_norm | gate | ... | norm | lm_head,
 * R = 4L + 3 = 51 runs, its expert bucket 1 run: before 52 + 4 + 2 + 2 = 60 launches and 1 read
 * per step when clipping (58 when not), after 3 launches and 1 read.
 */

/* The segment whose blocks include block b: the last s with start(s) <= b (segs[0] starts at
 * block 0, every segment has at least one block, starts grow with s). */
__device__ __forceinline__ int seg_find(const tm__seg *segs, int nseg, int64_t b, int sumsq) {
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        int64_t f = sumsq ? segs[mid].sfirst : segs[mid].first;
        if (f <= b) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* AdamW over [lo, hi) of a segment. Four consecutive elements per access (16 bytes of m, v and
 * master, 8 or 16 of p and g) when every base pointer allows it, all loads of a thread issued
 * before its arithmetic: the update is bound by the memory (28 bytes an element with bf16
 * parameters and f32 master weights), and one scalar element at a time, whose stores the
 * compiler may not move past the next element's loads (they might alias), kept too few bytes in
 * flight (3.3 of the H200's 4.8 TB/s). Each element gets adamw_math either way: the same bits. */
template <typename T>
__device__ __forceinline__ void adamw_range(const tm__seg *sg, int64_t lo, int64_t hi, float lr, float b1, float omb1,
                                            float b2, float omb2, float eps, float bc1, float bc2, float gs) {
    constexpr int N = 4;
    T *p = (T *)sg->p;
    const T *g = (const T *)sg->g;
    float *m = sg->m, *v = sg->v, *ms = sg->master;
    float wd = (float)sg->wd;
    const bool vec = (((uintptr_t)p | (uintptr_t)g) & (N * sizeof(T) - 1)) == 0 &&
                     (((uintptr_t)m | (uintptr_t)v | (uintptr_t)ms) & 15u) == 0;
    int64_t a = hi, nv = 0;
    if (vec) {
        a = (lo + N - 1) / N * N;
        if (a > hi) a = hi;
        nv = (hi - a) / N;
    }
    for (int64_t i = lo + threadIdx.x; i < a; i += blockDim.x)
        adamw_elem<T>(p, g, m, v, ms, i, lr, b1, omb1, b2, omb2, eps, wd, bc1, bc2, gs);
    for (int64_t k = threadIdx.x; k < nv; k += blockDim.x) {
        const int64_t i = a + k * N;
        float gf[N], pf[N], mf[N], vf[N];
        tm__vld<N>(g + i, gf);
        tm__vld<N>(m + i, mf);
        tm__vld<N>(v + i, vf);
        if (ms) tm__vld<N>(ms + i, pf);
        else tm__vld<N>(p + i, pf);
#pragma unroll
        for (int e = 0; e < N; e++) adamw_math<T>(gf[e], pf[e], mf[e], vf[e], lr, b1, omb1, b2, omb2, eps, wd, bc1, bc2, gs);
        tm__vst<N>(m + i, mf);
        tm__vst<N>(v + i, vf);
        if (ms) tm__vst<N>(ms + i, pf);
        tm__vst<N>(p + i, pf);
    }
    for (int64_t i = a + nv * N + threadIdx.x; i < hi; i += blockDim.x)
        adamw_elem<T>(p, g, m, v, ms, i, lr, b1, omb1, b2, omb2, eps, wd, bc1, bc2, gs);
}

/* factor: the clip's factor (grad_sumsq_multi's out[1], read on the device), or NULL. */
__global__ void adamw_multi_kernel(const tm__seg *segs, int nseg, float lr, float b1, float omb1, float b2, float omb2,
                                   float eps, float bc1, float bc2, const float *factor) {
    int64_t b = blockIdx.x;
    const float gs = factor ? *factor : 1.0f;
    const tm__seg *sg = segs + seg_find(segs, nseg, b, 0);
    int64_t lo = (b - sg->first) * sg->chunk, hi = lo + sg->chunk < sg->n ? lo + sg->chunk : sg->n;
    if (sg->dtype == TM_BF16) adamw_range<tm__bf16>(sg, lo, hi, lr, b1, omb1, b2, omb2, eps, bc1, bc2, gs);
    else adamw_range<float>(sg, lo, hi, lr, b1, omb1, b2, omb2, eps, bc1, bc2, gs);
}

/* part: one f64 per block; ticket: 0 at launch, 0 again when the kernel ends. */
__global__ void __launch_bounds__(SUMSQ_THREADS) sumsq_multi_kernel(const tm__seg *segs, int nseg, double *part, unsigned int *ticket, float *partials,
                                   float *factor, double max_norm) {
    __shared__ double sh[32];
    __shared__ int last;
    int64_t b = blockIdx.x;
    const tm__seg *sg = segs + seg_find(segs, nseg, b, 1);
    int64_t lo = (b - sg->sfirst) * sg->schunk, hi = lo + sg->schunk < sg->n ? lo + sg->schunk : sg->n;
    double acc = sg->dtype == TM_BF16 ? sumsq_thread<tm__bf16>(sg->p, lo, hi) : sumsq_thread<float>(sg->p, lo, hi);
    acc = sumsq_block_sum(acc, sh);
    if (threadIdx.x == 0) {
        part[b] = acc;
        __threadfence(); /* the partial is visible device-wide before the ticket counts it */
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x != 0) return;
    __threadfence();
    double ss = 0.0;
    for (int s = 0; s < nseg; s++) {
        const tm__seg *q = segs + s;
        int64_t nc = (q->n + q->schunk - 1) / q->schunk;
        double a = 0.0;
        for (int64_t k = 0; k < nc; k++) a += __ldcg(part + q->sfirst + k); /* L2: other blocks' writes */
        float pf = (float)a;
        partials[s] = pf;
        ss += (double)pf;
    }
    double norm = sqrt(ss);
    *factor = max_norm > 0.0 && norm > max_norm ? (float)(max_norm / (norm + 1e-6)) : 1.0f;
    *ticket = 0u;
}

/* scale_elem over g[lo, hi), in 16-byte vectors between a head and a tail (tm__vsplit): every
 * element gets the same one rounded product whichever access carries it. */
template <typename T>
__device__ __forceinline__ void scale_range(void *g_, int64_t lo, int64_t hi, float s) {
    constexpr int N = tm__vec_n<T>::n;
    T *g = (T *)g_;
    int64_t a, nv, b;
    tm__vsplit(g, lo, hi, &a, &nv, &b);
    for (int64_t i = lo + threadIdx.x; i < a; i += blockDim.x) scale_elem<T>(g, i, s);
#pragma unroll 4
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
        float f[N];
        tm__vld<N>(g + a + v * N, f);
#pragma unroll
        for (int k = 0; k < N; k++) f[k] = __fmul_rn(f[k], s);
        tm__vst<N>(g + a + v * N, f);
    }
    for (int64_t i = b + threadIdx.x; i < hi; i += blockDim.x) scale_elem<T>(g, i, s);
}

__global__ void scale_multi_kernel(const tm__seg *segs, int nseg, const float *factor) {
    float s = *factor;
    if (s == 1.0f) return; /* not clipping: the gradients stay as they are */
    int64_t b = blockIdx.x;
    const tm__seg *sg = segs + seg_find(segs, nseg, b, 0);
    int64_t lo = (b - sg->first) * sg->chunk, hi = lo + sg->chunk < sg->n ? lo + sg->chunk : sg->n;
    if (sg->dtype == TM_BF16) scale_range<tm__bf16>(sg->p, lo, hi, s);
    else scale_range<float>(sg->p, lo, hi, s);
}

/* The start of the three fused entry points: the stream, and nseg and blocks from the call,
 * checked against the grid limit. */
static tm_status multi_begin(tm__call *c, const char *what, tm__cuda **st, int *nseg, unsigned *blocks) {
    TM__TRY(tm__cu_enter(c->ctx, what, st));
    int64_t n = c->iattr[0], nb = c->iattr[1];
    if (nb > 0x7fffffffLL || n > 0x7fffffffLL)
        return tm__err(c->ctx, TM_ERR_INVALID_ARG, "%s: %lld blocks over %lld ranges exceed the CUDA grid", what,
                       (long long)nb, (long long)n);
    *nseg = (int)n;
    *blocks = (unsigned)nb;
    return TM_OK;
}

extern "C" tm_status tm__adamw_update_multi_forward_cuda(tm__call *c) {
    const char *what = "adamw_update_multi";
    tm__cuda *st;
    int nseg = 0;
    unsigned blocks = 0;
    TM__TRY(multi_begin(c, what, &st, &nseg, &blocks));
    if (nseg == 0 || blocks == 0) return TM_OK;
    const double *f = c->fattr;
    adamw_multi_kernel<<<blocks, TM__CU_THREADS, 0, st->stream>>>(
        (const tm__seg *)tm__data(c->in[0]), nseg, (float)f[TM__ADAMW_LR], (float)f[TM__ADAMW_BETA1],
        (float)f[TM__ADAMW_OMB1], (float)f[TM__ADAMW_BETA2], (float)f[TM__ADAMW_OMB2], (float)f[TM__ADAMW_EPS],
        (float)f[TM__ADAMW_BC1], (float)f[TM__ADAMW_BC2], c->iattr[2] ? (const float *)tm__data(c->in[1]) : NULL);
    TM__CU_LAUNCHED(c->ctx, what, "adamw_multi_kernel");
    return TM_OK;
}

extern "C" tm_status tm__grad_sumsq_multi_forward_cuda(tm__call *c) {
    const char *what = "grad_sumsq_multi";
    tm__cuda *st;
    int nseg = 0;
    unsigned blocks = 0;
    TM__TRY(multi_begin(c, what, &st, &nseg, &blocks));
    float *partials = (float *)tm__data(c->out[0]), *factor = (float *)tm__data(c->out[1]);
    if (nseg == 0 || blocks == 0) return tm__cuda_fill(c->ctx, c->out[1], 1.0); /* no gradients: nothing to clip */
    double *part;
    TM__TRY(tm__cu_scratch(c->ctx, st, (size_t)blocks * sizeof(double), (void **)&part));
    sumsq_multi_kernel<<<blocks, SUMSQ_THREADS, 0, st->stream>>>((const tm__seg *)tm__data(c->in[0]), nseg, part,
                                                                 (unsigned int *)tm__data(c->in[1]), partials, factor,
                                                                 c->fattr[0]);
    TM__CU_LAUNCHED(c->ctx, what, "sumsq_multi_kernel");
    return TM_OK;
}

extern "C" tm_status tm__grad_scale_multi_forward_cuda(tm__call *c) {
    const char *what = "grad_scale_multi";
    tm__cuda *st;
    int nseg = 0;
    unsigned blocks = 0;
    TM__TRY(multi_begin(c, what, &st, &nseg, &blocks));
    if (nseg == 0 || blocks == 0) return TM_OK;
    scale_multi_kernel<<<blocks, TM__CU_THREADS, 0, st->stream>>>((const tm__seg *)tm__data(c->in[0]), nseg,
                                                                  (const float *)tm__data(c->in[1]));
    TM__CU_LAUNCHED(c->ctx, what, "scale_multi_kernel");
    return TM_OK;
}
