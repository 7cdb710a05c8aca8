/*
 * moe_router.cu — CUDA kernels of the fused top-k router (tm_moe_router) and of the aux-loss
 * scores (tm_moe_aux_scores). The semantics, attributes and outputs are those of
 * kernels/cpu/moe_router.c (read its top comment first); only the arithmetic differs: f32 here
 * whatever the logits' dtype (bf16 logits are loaded as f32), f64 on the CPU.
 *
 * Op "moe_router":
 *   in[0]  logits (T, E) f32/bf16      in[1] expert_bias (E) f32/bf16, optional, selection only
 *   iattr  [0] E [1] k [2] score_function [3] use_pre_softmax [4] num_groups G [5] group_topk
 *          [6] norm_topk_prob [7] force_load_balance;  fattr[0] scaling_factor
 *   out[0] probs (T, E) logits' dtype   out[1] routing_map (T, E) u8   out[2] topk_idx (T, k) i32
 *   out[3] topk_weights (T, k) logits' dtype   out[4] tokens_per_expert (E) i64
 *   nothing saved: the backward recomputes a row's scores from logits and reads out[2].
 * One warp per token (a block of 32 threads, grid-stride over tokens), the row in shared memory:
 *   s (E) f32        score-function output (softmax post: the logits)
 *   v (E) f32        selection scores s (+ bias); becomes the row of probs once selected
 *   gscore (G) f32   group scores          q (k) f32   the weights      idx (k) i32
 *   elig (E) u8      experts still selectable         gfree (G) u8     groups not yet kept
 * so E (9 bytes each, plus 8 per k and 5 per group) is bounded by the 48 KiB of shared memory
 * a block gets without opting in: about 5400 experts (TM_ERR_UNSUPPORTED beyond).
 *
 * Selection: k rounds of a warp argmax over 64-bit keys (order-preserving f32 bits << 32 |
 * ~index): the larger value wins and equal values go to the lower index, the CPU's tie rule
 * (include/tinymoe.h); a round only sees experts not yet taken (and, with groups, of kept
 * groups), so the k indices are distinct. -0 and +0 compare equal, as in the CPU's double
 * comparison. NaN ranks below -inf here; the CPU's insertion never lets a NaN displace an entry
 * but keeps one met while its list is short, so a row that mixes NaN and numbers may select
 * differently (both give k distinct experts; an all-NaN row selects 0..k-1 on both).
 * Ties agree with the CPU where they come from equal inputs (equal logits give equal scores in
 * f32 and in f64); two scores that differ in f64 but round to one f32 value tie here only.
 * force_load_balance: idx_j = (t k + j) % E (torchtitan's round robin), lane j % 32 writing
 * idx_j, in place of the bias, groups and argmax rounds; the weights and the backward are
 * unchanged, and the selection is integer arithmetic, so CUDA and the CPU agree exactly on it.
 * Groups: group g scores the f32 sum, in selection order, of its top k / group_topk values of
 * v; group_topk rounds of the same argmax keep the best groups (ties: lower group).
 * tokens_per_expert: an integer atomicAdd per selected (t, e) into counts zeroed on the stream
 * before the launch: exact, so the order of the additions cannot show.
 *
 * Backward (per token, one warp), with dq_j = scaling * (d probs[t, idx_j] + d topk_weights[t, j]):
 *   softmax pre:   norm_topk_prob: dq <- (dq - <dq, s_S> / Z) / Z, Z = sum_S s; then over all E
 *                  dl_e += s_e (g_e - <dq, s_S>) with g_e = dq_j at e = idx_j, 0 elsewhere
 *   softmax post:  dl[idx_j] += q_j (dq_j - <dq, q>)
 *   sigmoid:       k > 1: dq <- (dq - <dq, s_S> / D) / D, D = sum_S s + 1e-20;
 *                  dl[idx_j] += dq_j s_j (1 - s_j)
 * Every element of dl is written by one lane once: no atomics.
 *
 * Op "moe_aux_scores": in[0] logits (T, E), iattr[0] score_function, out[0] (T, E) logits' dtype:
 * softmax over E, or q = s / (sum_E s + 1e-20) with s = sigmoid(l). One block per row, f32 sums
 * in a fixed tree (tm__block_sum). Backward: softmax dl = q (g - <g, q>); sigmoid
 * dl = (g - <g, s> / D) / D * s (1 - s), D = sum_E s + 1e-20.
 */
#include "common.cuh"

#define RT_SMEM_MAX 49152

/* ---- warp helpers (deterministic: a fixed xor tree) ---------------------------------------- */

__device__ __forceinline__ float rt_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float rt_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Key of (x, e): ordered like x (NaN lowest, -0 == +0), then by lower e. Never 0, which
 * stands for "nothing selectable" (e < 2^32 - 1). */
__device__ __forceinline__ unsigned long long rt_key(float x, int64_t e) {
    uint32_t u = __float_as_uint(x), o;
    if (x != x) o = 0u;
    else if (x == 0.0f) o = 0x80000000u;
    else o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)o << 32) | (unsigned long long)(0xffffffffu - (uint32_t)e);
}

/* The best eligible index in [lo, hi) of x (every lane of the warp calls it, every lane gets
 * the answer). The caller guarantees that one is eligible. */
__device__ __forceinline__ int64_t rt_argmax(const float *x, const unsigned char *elig, int64_t lo, int64_t hi) {
    unsigned long long best = 0;
    for (int64_t e = lo + threadIdx.x; e < hi; e += 32)
        if (elig[e]) {
            unsigned long long kk = rt_key(x[e], e);
            best = kk > best ? kk : best;
        }
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long y = __shfl_xor_sync(0xffffffffu, best, o);
        best = y > best ? y : best;
    }
    return (int64_t)(0xffffffffu - (uint32_t)(best & 0xffffffffull));
}

__device__ __forceinline__ float rt_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

extern __shared__ __align__(16) unsigned char rt_smem[];

/* ---- moe_router forward --------------------------------------------------------------------- */

static size_t router_fwd_smem(int64_t E, int64_t k, int64_t G) {
    return (size_t)(2 * E + G + k) * sizeof(float) + (size_t)k * sizeof(int32_t) + (size_t)(E + G);
}

template <typename T>
__global__ void __launch_bounds__(32)
router_forward_kernel(void *probs_, unsigned char *map, int32_t *topk_idx, void *topk_w_, unsigned long long *counts,
                      const void *logits_, const void *bias_, int bias_bf16, int64_t Tn, int64_t E, int64_t k,
                      int sigm, int pre, int64_t G, int64_t gk, int norm, int force, float scaling) {
    float *s = (float *)rt_smem, *v = s + E, *gscore = v + E, *q = gscore + G;
    int32_t *idx = (int32_t *)(q + k);
    unsigned char *elig = (unsigned char *)(idx + k), *gfree = elig + E;
    const int lane = threadIdx.x;
    const int64_t gs = E / G;
    T *probs = (T *)probs_, *topk_w = (T *)topk_w_;

    for (int64_t t = blockIdx.x; t < Tn; t += gridDim.x) {
        const T *l = (const T *)logits_ + t * E;
        /* s: the score function (softmax post keeps the logits); v = s (+ bias) */
        if (sigm) {
            for (int64_t e = lane; e < E; e += 32) s[e] = rt_sigmoid(tm__ld(l + e));
        } else if (pre) {
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t e = lane; e < E; e += 32) mx = fmaxf(mx, tm__ld(l + e));
            mx = rt_warp_max(mx);
            for (int64_t e = lane; e < E; e += 32) sum += expf(tm__ld(l + e) - mx);
            sum = rt_warp_sum(sum);
            for (int64_t e = lane; e < E; e += 32) s[e] = expf(tm__ld(l + e) - mx) / sum;
        } else {
            for (int64_t e = lane; e < E; e += 32) s[e] = tm__ld(l + e);
        }
        if (force) {
            /* t k + j < T E, the element count of logits: no overflow */
            for (int64_t j = lane; j < k; j += 32) idx[j] = (int32_t)((t * k + j) % E);
        } else {
            for (int64_t e = lane; e < E; e += 32) {
                float b = 0.0f;
                if (bias_) b = bias_bf16 ? tm__ld((const tm__bf16 *)bias_ + e) : ((const float *)bias_)[e];
                v[e] = bias_ ? s[e] + b : s[e];
                elig[e] = 1;
            }
            __syncwarp();

            if (G > 1) {
                const int64_t m = k / gk;
                for (int64_t g = 0; g < G; g++) {
                    float sum = 0.0f;
                    for (int64_t j = 0; j < m; j++) {
                        int64_t w = rt_argmax(v, elig, g * gs, (g + 1) * gs);
                        sum += v[w];
                        __syncwarp();
                        if (lane == 0) elig[w] = 0;
                        __syncwarp();
                    }
                    if (lane == 0) gscore[g] = sum;
                    for (int64_t e = g * gs + lane; e < (g + 1) * gs; e += 32) elig[e] = 1;
                    __syncwarp();
                }
                for (int64_t g = lane; g < G; g += 32) gfree[g] = 1;
                __syncwarp();
                for (int64_t j = 0; j < gk; j++) {
                    int64_t w = rt_argmax(gscore, gfree, 0, G);
                    __syncwarp();
                    if (lane == 0) gfree[w] = 0; /* 0: kept */
                    __syncwarp();
                }
                for (int64_t e = lane; e < E; e += 32) elig[e] = gfree[e / gs] == 0;
                __syncwarp();
            }

            for (int64_t j = 0; j < k; j++) {
                int64_t w = rt_argmax(v, elig, 0, E);
                __syncwarp();
                if (lane == 0) {
                    idx[j] = (int32_t)w;
                    elig[w] = 0;
                }
                __syncwarp();
            }
        }
        __syncwarp();

        /* q = s at the selection, then the weight rule of the score function, then scaling */
        for (int64_t j = lane; j < k; j += 32) q[j] = s[idx[j]];
        if (!sigm && !pre) {
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t j = lane; j < k; j += 32) mx = fmaxf(mx, q[j]);
            mx = rt_warp_max(mx);
            for (int64_t j = lane; j < k; j += 32) sum += expf(q[j] - mx);
            sum = rt_warp_sum(sum);
            for (int64_t j = lane; j < k; j += 32) q[j] = expf(q[j] - mx) / sum;
        } else if ((!sigm && norm) || (sigm && k > 1)) {
            float sum = 0.0f;
            for (int64_t j = lane; j < k; j += 32) sum += q[j];
            sum = rt_warp_sum(sum);
            if (sigm) sum += 1e-20f;
            for (int64_t j = lane; j < k; j += 32) q[j] /= sum;
        }
        for (int64_t j = lane; j < k; j += 32) q[j] *= scaling;

        /* v and elig become the rows of probs and routing_map */
        for (int64_t e = lane; e < E; e += 32) {
            v[e] = 0.0f;
            elig[e] = 0;
        }
        __syncwarp();
        for (int64_t j = lane; j < k; j += 32) {
            int32_t e = idx[j];
            v[e] = q[j];
            elig[e] = 1;
            topk_idx[t * k + j] = e;
            tm__st(topk_w + t * k + j, q[j]);
            atomicAdd(counts + e, 1ull);
        }
        __syncwarp();
        for (int64_t e = lane; e < E; e += 32) {
            tm__st(probs + t * E + e, v[e]);
            map[t * E + e] = elig[e];
        }
        __syncwarp(); /* the next token overwrites the shared row */
    }
}

static unsigned rt_grid(int64_t rows) { return (unsigned)(rows < 2147483647 ? rows : 2147483647); }

extern "C" tm_status tm__moe_router_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_router";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *lt = c->in[0], *bias = c->n_in > 1 ? c->in[1] : NULL;
    const int64_t T = lt->shape[0], E = c->iattr[0], k = c->iattr[1];
    const int64_t G = c->iattr[4] > 1 ? c->iattr[4] : 1, gk = G > 1 ? c->iattr[5] : 1;
    if (bias && bias->dtype != TM_F32 && bias->dtype != TM_BF16)
        return tm__err(ctx, TM_ERR_INTERNAL, "moe_router: CUDA kernel got expert_bias %s", tm__tdesc(ctx, bias));
    unsigned long long *counts = (unsigned long long *)tm__data(c->out[4]); // (E)
    TM__TRY(tm__cuda_memset0(ctx, counts, (size_t)E * sizeof(int64_t)));
    if (T == 0) return TM_OK;
    const size_t smem = router_fwd_smem(E, k, G);
    if (smem > RT_SMEM_MAX)
        return tm__err(ctx, TM_ERR_UNSUPPORTED,
                       "moe_router: num_experts = %lld, topk = %lld need %zu bytes of shared memory per token on CUDA "
                       "(at most %d); logits %s",
                       (long long)E, (long long)k, smem, RT_SMEM_MAX, tm__tdesc(ctx, lt));
    TM__CU_LAUNCH_FLOAT(lt->dtype, router_forward_kernel, rt_grid(T), 32, smem, st->stream, tm__data(c->out[0]),
                        (unsigned char *)tm__data(c->out[1]), (int32_t *)tm__data(c->out[2]), tm__data(c->out[3]),
                        counts, tm__data(lt), bias ? tm__data(bias) : NULL, bias && bias->dtype == TM_BF16, T, E, k,
                        c->iattr[2] == TM_SCORE_SIGMOID, c->iattr[3] != 0, G, gk, c->iattr[6] != 0,
                        c->iattr[7] != 0, (float)c->fattr[0]);
    TM__CU_LAUNCHED(ctx, what, "router_forward_kernel");
    return TM_OK;
}

/* ---- moe_router backward -------------------------------------------------------------------- */

static size_t router_bwd_smem(int64_t E, int64_t k) { return (size_t)(2 * E + 2 * k) * sizeof(float); }

template <typename T>
__global__ void __launch_bounds__(32)
router_backward_kernel(void *dl_, const void *logits_, const int32_t *topk_idx, const void *gp_, const void *gw_,
                       int64_t Tn, int64_t E, int64_t k, int sigm, int pre, int norm, float scaling) {
    float *s = (float *)rt_smem, *g = s + E, *dq = g + E, *q = dq + k;
    const int lane = threadIdx.x;
    T *dl = (T *)dl_;
    const T *gp = (const T *)gp_, *gw = (const T *)gw_;

    for (int64_t t = blockIdx.x; t < Tn; t += gridDim.x) {
        const T *l = (const T *)logits_ + t * E;
        const int32_t *id = topk_idx + t * k;
        for (int64_t j = lane; j < k; j += 32) dq[j] = scaling * (tm__ld(gp + t * E + id[j]) + tm__ld(gw + t * k + j));

        if (!sigm && pre) {
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t e = lane; e < E; e += 32) mx = fmaxf(mx, tm__ld(l + e));
            mx = rt_warp_max(mx);
            for (int64_t e = lane; e < E; e += 32) sum += expf(tm__ld(l + e) - mx);
            sum = rt_warp_sum(sum);
            for (int64_t e = lane; e < E; e += 32) {
                s[e] = expf(tm__ld(l + e) - mx) / sum;
                g[e] = 0.0f;
            }
            __syncwarp();
            if (norm) {
                float z = 0.0f, dot = 0.0f;
                for (int64_t j = lane; j < k; j += 32) z += s[id[j]];
                z = rt_warp_sum(z);
                for (int64_t j = lane; j < k; j += 32) dot += dq[j] * s[id[j]] / z;
                dot = rt_warp_sum(dot);
                for (int64_t j = lane; j < k; j += 32) dq[j] = (dq[j] - dot) / z;
            }
            float dot = 0.0f;
            for (int64_t j = lane; j < k; j += 32) dot += dq[j] * s[id[j]];
            dot = rt_warp_sum(dot);
            for (int64_t j = lane; j < k; j += 32) g[id[j]] = dq[j];
            __syncwarp();
            for (int64_t e = lane; e < E; e += 32) tm__st(dl + t * E + e, tm__ld(dl + t * E + e) + s[e] * (g[e] - dot));
        } else if (!sigm) {
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t j = lane; j < k; j += 32) {
                q[j] = tm__ld(l + id[j]);
                mx = fmaxf(mx, q[j]);
            }
            mx = rt_warp_max(mx);
            for (int64_t j = lane; j < k; j += 32) sum += expf(q[j] - mx);
            sum = rt_warp_sum(sum);
            float dot = 0.0f;
            for (int64_t j = lane; j < k; j += 32) {
                q[j] = expf(q[j] - mx) / sum;
                dot += dq[j] * q[j];
            }
            dot = rt_warp_sum(dot);
            for (int64_t j = lane; j < k; j += 32) {
                T *d = dl + t * E + id[j];
                tm__st(d, tm__ld(d) + q[j] * (dq[j] - dot));
            }
        } else {
            for (int64_t j = lane; j < k; j += 32) q[j] = rt_sigmoid(tm__ld(l + id[j]));
            if (k > 1) {
                float d = 0.0f, dot = 0.0f;
                for (int64_t j = lane; j < k; j += 32) d += q[j];
                d = rt_warp_sum(d) + 1e-20f;
                for (int64_t j = lane; j < k; j += 32) dot += dq[j] * q[j] / d;
                dot = rt_warp_sum(dot);
                for (int64_t j = lane; j < k; j += 32) dq[j] = (dq[j] - dot) / d;
            }
            for (int64_t j = lane; j < k; j += 32) {
                T *d = dl + t * E + id[j];
                tm__st(d, tm__ld(d) + dq[j] * q[j] * (1.0f - q[j]));
            }
        }
        __syncwarp(); /* the next token overwrites the shared row */
    }
}

extern "C" tm_status tm__moe_router_backward_cuda(tm__call *c) {
    tm_tensor *dl = c->gin[0]; /* gin[1] (expert_bias) is left alone: the bias only selects */
    if (!dl) return TM_OK;
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_router";
    const tm_tensor *lt = c->in[0];
    const int64_t T = lt->shape[0], E = c->iattr[0], k = c->iattr[1];
    if (T == 0) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if (c->gout[0]->dtype != lt->dtype || c->gout[3]->dtype != lt->dtype || dl->dtype != lt->dtype)
        return tm__err(ctx, TM_ERR_INTERNAL, "moe_router: CUDA backward got gradients %s, %s, %s for logits %s",
                       tm__tdesc(ctx, c->gout[0]), tm__tdesc(ctx, c->gout[3]), tm__tdesc(ctx, dl), tm__tdesc(ctx, lt));
    const size_t smem = router_bwd_smem(E, k);
    if (smem > RT_SMEM_MAX)
        return tm__err(ctx, TM_ERR_UNSUPPORTED,
                       "moe_router: num_experts = %lld, topk = %lld need %zu bytes of shared memory per token on CUDA "
                       "(at most %d); logits %s",
                       (long long)E, (long long)k, smem, RT_SMEM_MAX, tm__tdesc(ctx, lt));
    TM__CU_LAUNCH_FLOAT(lt->dtype, router_backward_kernel, rt_grid(T), 32, smem, st->stream, tm__data(dl),
                        tm__data(lt), (const int32_t *)tm__data(c->out[2]), tm__data(c->gout[0]),
                        tm__data(c->gout[3]), T, E, k, c->iattr[2] == TM_SCORE_SIGMOID, c->iattr[3] != 0,
                        c->iattr[6] != 0, (float)c->fattr[0]);
    TM__CU_LAUNCHED(ctx, what, "router_backward_kernel");
    return TM_OK;
}

/* ---- moe_aux_scores ------------------------------------------------------------------------- */

/* One block per row (grid-stride): out = softmax(l), or s / (sum s + 1e-20). */
template <typename T>
__global__ void aux_scores_forward_kernel(void *out_, const void *logits_, int64_t Tn, int64_t E, int sigm) {
    __shared__ float sh[32];
    for (int64_t t = blockIdx.x; t < Tn; t += gridDim.x) {
        const T *l = (const T *)logits_ + t * E;
        T *o = (T *)out_ + t * E;
        if (sigm) {
            float d = 0.0f;
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) d += rt_sigmoid(tm__ld(l + e));
            d = tm__block_sum(d, sh) + 1e-20f;
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) tm__st(o + e, rt_sigmoid(tm__ld(l + e)) / d);
        } else {
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) mx = fmaxf(mx, tm__ld(l + e));
            mx = tm__block_max(mx, sh);
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) sum += expf(tm__ld(l + e) - mx);
            sum = tm__block_sum(sum, sh);
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) tm__st(o + e, expf(tm__ld(l + e) - mx) / sum);
        }
    }
}

template <typename T>
__global__ void aux_scores_backward_kernel(void *dl_, const void *logits_, const void *g_, int64_t Tn, int64_t E,
                                           int sigm) {
    __shared__ float sh[32];
    for (int64_t t = blockIdx.x; t < Tn; t += gridDim.x) {
        const T *l = (const T *)logits_ + t * E, *g = (const T *)g_ + t * E;
        T *dl = (T *)dl_ + t * E;
        if (sigm) {
            float d = 0.0f, gs = 0.0f;
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
                float s = rt_sigmoid(tm__ld(l + e));
                d += s;
                gs += tm__ld(g + e) * s;
            }
            d = tm__block_sum(d, sh) + 1e-20f;
            const float dot = tm__block_sum(gs, sh) / d;
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
                float s = rt_sigmoid(tm__ld(l + e));
                tm__st(dl + e, tm__ld(dl + e) + (tm__ld(g + e) - dot) / d * s * (1.0f - s));
            }
        } else {
            float mx = -INFINITY, sum = 0.0f, dot = 0.0f;
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) mx = fmaxf(mx, tm__ld(l + e));
            mx = tm__block_max(mx, sh);
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) sum += expf(tm__ld(l + e) - mx);
            sum = tm__block_sum(sum, sh);
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dot += tm__ld(g + e) * (expf(tm__ld(l + e) - mx) / sum);
            dot = tm__block_sum(dot, sh);
            for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
                float q = expf(tm__ld(l + e) - mx) / sum;
                tm__st(dl + e, tm__ld(dl + e) + q * (tm__ld(g + e) - dot));
            }
        }
    }
}

extern "C" tm_status tm__moe_aux_scores_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_aux_scores";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const tm_tensor *lt = c->in[0];
    const int64_t T = lt->shape[0], E = lt->shape[1];
    if (T == 0) return TM_OK;
    TM__CU_LAUNCH_FLOAT(lt->dtype, aux_scores_forward_kernel, rt_grid(T), tm__cu_row_threads(E), 0, st->stream,
                        tm__data(c->out[0]), tm__data(lt), T, E, c->iattr[0] == TM_SCORE_SIGMOID);
    TM__CU_LAUNCHED(ctx, what, "aux_scores_forward_kernel");
    return TM_OK;
}

extern "C" tm_status tm__moe_aux_scores_backward_cuda(tm__call *c) {
    tm_tensor *dl = c->gin[0];
    if (!dl) return TM_OK;
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_aux_scores";
    const tm_tensor *lt = c->in[0];
    const int64_t T = lt->shape[0], E = lt->shape[1];
    if (T == 0) return TM_OK;
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    TM__CU_LAUNCH_FLOAT(lt->dtype, aux_scores_backward_kernel, rt_grid(T), tm__cu_row_threads(E), 0, st->stream,
                        tm__data(dl), tm__data(lt), tm__data(c->gout[0]), T, E, c->iattr[0] == TM_SCORE_SIGMOID);
    TM__CU_LAUNCHED(ctx, what, "aux_scores_backward_kernel");
    return TM_OK;
}
