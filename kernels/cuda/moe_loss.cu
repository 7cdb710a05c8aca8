/*
 * moe_loss.cu — CUDA kernels of the MoE auxiliary losses. Formulas, attributes and saved
 * tensors are those of kernels/cpu/moe_loss.c (T tokens, E experts, k = topk):
 *
 * moe_aux_loss:  in[0] scores (T, E) f32/bf16, in[1] tokens_per_expert (E) i64; iattr[0] k,
 *   iattr[1] total_tokens (<= 0: T); fattr[0] coeff.
 *   out[0] () = c * sum_{t,e} scores[t,e] * count[e],  c = E * coeff / (k * T^2) (0 if T = 0)
 *   backward: dscores[t,e] += c * count[e] * dy
 * moe_seq_aux_loss:  in[0] scores (T, E), in[1] routing_map (T, E) u8; iattr[0] k,
 *   iattr[1] num_seqs n; fattr[0] coeff; S = T / n.
 *   saved[0] counts_s (n, E) i64: per-sequence column sums of routing_map (computed here)
 *   out[0] () = c_S / n * sum_{t,e} scores[t,e] * counts_{s(t)}[e],  c_S = E * coeff / (k * S^2)
 *   backward: dscores[t,e] += c_S / n * counts_{s(t)}[e] * dy
 * moe_z_loss:  in[0] logits (T, E); fattr[0] coeff.
 *   saved[0] lse (T) f32 (f32 and bf16 logits, as the CPU's staged kernel saves it)
 *   out[0] () = coeff / T * sum_t lse_t^2  (0 if T = 0)
 *   backward: dlogits[t,e] += dy * coeff * 2 / T * lse_t * exp(logits[t,e] - lse_t)
 *
 * The reductions follow the design TransformerEngine settled on for fused_moe_aux_loss after
 * its PR #2758 (block partial sums in f32, the coefficient applied once and kept for the
 * backward, never accumulating into a bf16 output), but in two passes instead of an atomic f32
 * accumulator, so that a loss is bitwise reproducible: pass 1, ML_PARTIALS_MAX blocks at most,
 * each sums a grid-stride share of the terms in f32 (fixed by the shape alone, not by the GPU)
 * and writes one partial; pass 2, one block adds the partials in a fixed tree and writes
 * scale * sum, the product taken in f64 and rounded once to the output dtype. The z-loss has
 * one more pass in front: one block per row computes lse_t (a max-shifted logsumexp in f32)
 * and lse_t^2. The backwards read dy on the device (no synchronisation) and write each
 * gradient element once. Compared with the CPU (f64 row sums added in row order) only the
 * summation order and the f32 accumulation differ.
 */
#include "common.cuh"

#define ML_THREADS 256
#define ML_PARTIALS_MAX 1024

/* Pass-1 blocks for n terms: about 4 terms per thread, at most ML_PARTIALS_MAX. */
static unsigned ml_blocks(int64_t n) {
    int64_t b = (n + 4 * ML_THREADS - 1) / (4 * ML_THREADS);
    if (b > ML_PARTIALS_MAX) b = ML_PARTIALS_MAX;
    return (unsigned)(b < 1 ? 1 : b);
}

/* partial[block] = sum over the block's terms i of s[i] * cnt[(t / seq_len) * E + e], i = t E + e. */
template <typename T>
__global__ void __launch_bounds__(ML_THREADS)
ml_dot_kernel(float *partial, const void *s_, const long long *cnt, int64_t n, int64_t E, int64_t seq_len) {
    __shared__ float sh[32];
    const T *s = (const T *)s_;
    float acc = 0.0f;
    TM__CU_GRID_STRIDE(i, n) {
        int64_t t = i / E, e = i - t * E;
        acc += tm__ld(s + i) * (float)cnt[(t / seq_len) * E + e];
    }
    acc = tm__block_sum(acc, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

/* partial[block] = sum over the block's share of x[0..n). */
__global__ void __launch_bounds__(ML_THREADS) ml_sum_kernel(float *partial, const float *x, int64_t n) {
    __shared__ float sh[32];
    float acc = 0.0f;
    TM__CU_GRID_STRIDE(i, n) acc += x[i];
    acc = tm__block_sum(acc, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

/* out = scale * sum(partial[0..nb)), one block. */
template <typename T>
__global__ void __launch_bounds__(ML_THREADS) ml_final_kernel(void *out, const float *partial, int nb, double scale) {
    __shared__ float sh[32];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < nb; i += blockDim.x) acc += partial[i];
    acc = tm__block_sum(acc, sh);
    if (threadIdx.x == 0) tm__st((T *)out, (float)(scale * (double)acc));
}

/* ds[t,e] += scale * dy * cnt[(t / seq_len) * E + e]. */
template <typename T>
__global__ void ml_counts_backward_kernel(void *ds_, const void *dy_, const long long *cnt, double scale, int64_t n,
                                          int64_t E, int64_t seq_len) {
    T *ds = (T *)ds_;
    const float a = (float)(scale * (double)tm__ld((const T *)dy_));
    TM__CU_GRID_STRIDE(i, n) {
        int64_t t = i / E, e = i - t * E;
        tm__st(ds + i, tm__ld(ds + i) + a * (float)cnt[(t / seq_len) * E + e]);
    }
}

/* The two passes: out = scale * sum_i s[i] * cnt[...]; out = 0 without terms. */
static tm_status ml_dot_loss(tm__call *c, const char *what, const long long *cnt, int64_t seq_len, double scale) {
    tm_ctx *ctx = c->ctx;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *s = c->in[0];
    const int64_t n = tm__numel(s), E = s->shape[1];
    if (n == 0) return tm__cuda_fill(ctx, c->out[0], 0.0);
    const unsigned nb = ml_blocks(n);
    float *partial;
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)nb * sizeof(float), (void **)&partial));
    TM__CU_LAUNCH_FLOAT(s->dtype, ml_dot_kernel, nb, ML_THREADS, 0, st->stream, partial, tm__data(s), cnt, n, E,
                        seq_len);
    TM__CU_LAUNCHED(ctx, what, "ml_dot_kernel");
    TM__CU_LAUNCH_FLOAT(c->out[0]->dtype, ml_final_kernel, 1, ML_THREADS, 0, st->stream, tm__data(c->out[0]), partial,
                        (int)nb, scale);
    TM__CU_LAUNCHED(ctx, what, "ml_final_kernel");
    return TM_OK;
}

static tm_status ml_counts_backward(tm__call *c, const char *what, const long long *cnt, int64_t seq_len,
                                    double scale) {
    tm_tensor *ds = c->gin[0];
    const tm_tensor *s = c->in[0];
    const int64_t n = tm__numel(s), E = s->shape[1];
    if (!ds || n == 0) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, what, &st));
    if (ds->dtype != c->gout[0]->dtype)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "%s: CUDA backward got dscores %s and dy %s", what,
                       tm__tdesc(c->ctx, ds), tm__tdesc(c->ctx, c->gout[0]));
    TM__CU_LAUNCH_FLOAT(ds->dtype, ml_counts_backward_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                        tm__data(ds), tm__data(c->gout[0]), cnt, scale, n, E, seq_len);
    TM__CU_LAUNCHED(c->ctx, what, "ml_counts_backward_kernel");
    return TM_OK;
}

/* ---- moe_aux_loss ------------------------------------------------------------------------- */

/* c = E * coeff / (k * T^2), T the global token count; 0 when there are no tokens. */
static double aux_scale(const tm__call *c) {
    int64_t T = c->iattr[1] > 0 ? c->iattr[1] : c->in[0]->shape[0], E = c->in[0]->shape[1];
    if (T == 0) return 0.0;
    return (double)E * c->fattr[0] / ((double)c->iattr[0] * (double)T * (double)T);
}

extern "C" tm_status tm__moe_aux_loss_forward_cuda(tm__call *c) {
    const int64_t T = c->in[0]->shape[0];
    return ml_dot_loss(c, "moe_aux_loss", (const long long *)tm__data(c->in[1]), T > 0 ? T : 1, aux_scale(c));
}

extern "C" tm_status tm__moe_aux_loss_backward_cuda(tm__call *c) {
    const int64_t T = c->in[0]->shape[0];
    return ml_counts_backward(c, "moe_aux_loss", (const long long *)tm__data(c->in[1]), T > 0 ? T : 1,
                              aux_scale(c));
}

/* ---- moe_seq_aux_loss --------------------------------------------------------------------- */

/* counts_s[q, e] = routed (t, e) with t in [q S, (q + 1) S). One thread per (q, e). */
__global__ void seq_counts_kernel(long long *cnt, const unsigned char *map, int64_t nq, int64_t S, int64_t E) {
    TM__CU_GRID_STRIDE(i, nq * E) {
        int64_t q = i / E, e = i - q * E;
        long long n = 0;
        for (int64_t t = q * S; t < (q + 1) * S; t++) n += map[t * E + e] != 0;
        cnt[i] = n;
    }
}

/* c_S / n = E * coeff / (k * S^2 * n); 0 when the sequences are empty. */
static double seq_scale(const tm__call *c, int64_t *S_out) {
    int64_t T = c->in[0]->shape[0], E = c->in[0]->shape[1], n = c->iattr[1], S = T / n;
    *S_out = S;
    if (S == 0) return 0.0;
    return (double)E * c->fattr[0] / ((double)c->iattr[0] * (double)S * (double)S * (double)n);
}

extern "C" tm_status tm__moe_seq_aux_loss_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_seq_aux_loss";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const int64_t E = c->in[0]->shape[1], nq = c->iattr[1];
    int64_t S;
    const double scale = seq_scale(c, &S);
    const int64_t cshape[2] = {nq, E};
    tm_tensor *counts;
    TM__TRY(tm__saved_new(c, TM_I64, 2, cshape, &counts));
    long long *cnt = (long long *)tm__data(counts);
    if (nq * E > 0) {
        seq_counts_kernel<<<tm__cu_blocks(st, nq * E), TM__CU_THREADS, 0, st->stream>>>(
            cnt, (const unsigned char *)tm__data(c->in[1]), nq, S, E);
        TM__CU_LAUNCHED(ctx, what, "seq_counts_kernel");
    }
    return ml_dot_loss(c, what, cnt, S > 0 ? S : 1, scale);
}

extern "C" tm_status tm__moe_seq_aux_loss_backward_cuda(tm__call *c) {
    int64_t S;
    const double scale = seq_scale(c, &S);
    return ml_counts_backward(c, "moe_seq_aux_loss", (const long long *)tm__data(c->saved[0]), S > 0 ? S : 1, scale);
}

/* ---- moe_z_loss --------------------------------------------------------------------------- */

/* One block per row (grid-stride): lse[t] = max-shifted logsumexp, rowsq[t] = lse[t]^2. */
template <typename T>
__global__ void z_rows_kernel(float *lse, float *rowsq, const void *x_, int64_t Tn, int64_t E) {
    __shared__ float sh[32];
    for (int64_t t = blockIdx.x; t < Tn; t += gridDim.x) {
        const T *x = (const T *)x_ + t * E;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t e = threadIdx.x; e < E; e += blockDim.x) mx = fmaxf(mx, tm__ld(x + e));
        mx = tm__block_max(mx, sh);
        for (int64_t e = threadIdx.x; e < E; e += blockDim.x) sum += expf(tm__ld(x + e) - mx);
        sum = tm__block_sum(sum, sh);
        if (threadIdx.x == 0) {
            float l = mx + logf(sum);
            lse[t] = l;
            rowsq[t] = l * l;
        }
    }
}

template <typename T>
__global__ void z_backward_kernel(void *dx_, const void *x_, const float *lse, const void *dy_, double c2, int64_t n,
                                  int64_t E) {
    T *dx = (T *)dx_;
    const T *x = (const T *)x_;
    const float a = (float)(c2 * (double)tm__ld((const T *)dy_));
    TM__CU_GRID_STRIDE(i, n) {
        float l = lse[i / E];
        tm__st(dx + i, tm__ld(dx + i) + a * l * expf(tm__ld(x + i) - l));
    }
}

extern "C" tm_status tm__moe_z_loss_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_z_loss";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *x = c->in[0];
    const int64_t T = x->shape[0], E = x->shape[1];
    tm_tensor *lse;
    TM__TRY(tm__saved_new(c, TM_F32, 1, &T, &lse));
    if (T == 0) return tm__cuda_fill(ctx, c->out[0], 0.0);
    float *rowsq, *partial;
    const unsigned nb = ml_blocks(T);
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)T * sizeof(float), (void **)&rowsq));
    TM__TRY(tm__cu_scratch(ctx, st, (size_t)nb * sizeof(float), (void **)&partial));
    const unsigned rows = (unsigned)(T < 2147483647 ? T : 2147483647);
    TM__CU_LAUNCH_FLOAT(x->dtype, z_rows_kernel, rows, tm__cu_row_threads(E), 0, st->stream,
                        (float *)tm__data(lse), rowsq, tm__data(x), T, E);
    TM__CU_LAUNCHED(ctx, what, "z_rows_kernel");
    ml_sum_kernel<<<nb, ML_THREADS, 0, st->stream>>>(partial, rowsq, T);
    TM__CU_LAUNCHED(ctx, what, "ml_sum_kernel");
    TM__CU_LAUNCH_FLOAT(c->out[0]->dtype, ml_final_kernel, 1, ML_THREADS, 0, st->stream, tm__data(c->out[0]), partial,
                        (int)nb, c->fattr[0] / (double)T);
    TM__CU_LAUNCHED(ctx, what, "ml_final_kernel");
    return TM_OK;
}

extern "C" tm_status tm__moe_z_loss_backward_cuda(tm__call *c) {
    const tm_tensor *x = c->in[0];
    tm_tensor *dx = c->gin[0];
    const int64_t T = x->shape[0], E = x->shape[1];
    if (!dx || T == 0) return TM_OK;
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_z_loss";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (dx->dtype != x->dtype || c->gout[0]->dtype != x->dtype)
        return tm__err(ctx, TM_ERR_INTERNAL, "moe_z_loss: CUDA backward got dlogits %s and dy %s for logits %s",
                       tm__tdesc(ctx, dx), tm__tdesc(ctx, c->gout[0]), tm__tdesc(ctx, x));
    const int64_t n = T * E;
    TM__CU_LAUNCH_FLOAT(x->dtype, z_backward_kernel, tm__cu_blocks(st, n), TM__CU_THREADS, 0, st->stream,
                        tm__data(dx), tm__data(x), (const float *)tm__data(c->saved[0]), tm__data(c->gout[0]),
                        c->fattr[0] * 2.0 / (double)T, n, E);
    TM__CU_LAUNCHED(ctx, what, "z_backward_kernel");
    return TM_OK;
}
