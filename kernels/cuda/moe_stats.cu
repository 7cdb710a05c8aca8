/*
 * moe_stats.cu — CUDA kernels of the MoE block's device-side statistics: tm_moe_accumulate_counts
 * and tm_moe_expert_bias_update (the aux-loss-free balancing update, whose CPU kernel lives in
 * kernels/cpu/update.c). Both are in-place, non-differentiable rows of the op table
 * (NONDIFF_CPU_CUDA); neither reads anything back to the host.
 *
 * moe_accumulate_counts (kernels/cpu/moe_stats.c):
 *   in[0] sum (E) i64, contiguous, updated in place: sum[e] += counts[e]
 *   in[1] counts (E) i64
 *   One thread per expert: integer adds, exact.
 *
 * moe_expert_bias_update (kernels/cpu/update.c; TM__OP_STRIDED: both 1-D, walked by stride):
 *   in[0] expert_bias (E) f32 (f64 cannot live on CUDA), updated in place
 *   in[1] counts (E) i64;  fattr[0] rate
 *   expert_bias[e] += rate * sign(mean(counts) - counts[e])   (sign(0) = 0)
 *   One block. The mean is summed in f64 by one thread in index order, then every expert's new
 *   value is computed in f64 and rounded once to f32: the CPU's arithmetic step for step, so
 *   the result is bit-identical to the CPU's (rate * sign is exact, so a fused multiply-add
 *   cannot change it either).
 */
#include "common.cuh"

__global__ void acc_counts_kernel(long long *sum, const long long *counts, int64_t E) {
    TM__CU_GRID_STRIDE(e, E) sum[e] += counts[e];
}

extern "C" tm_status tm__moe_accumulate_counts_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_accumulate_counts";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    const int64_t E = c->in[0]->shape[0];
    if (E == 0) return TM_OK;
    acc_counts_kernel<<<tm__cu_blocks(st, E), TM__CU_THREADS, 0, st->stream>>>(
        (long long *)tm__data(c->in[0]), (const long long *)tm__data(c->in[1]), E);
    TM__CU_LAUNCHED(ctx, what, "acc_counts_kernel");
    return TM_OK;
}

__global__ void bias_update_kernel(float *bias, int64_t sb, const long long *cnt, int64_t sc, int64_t E,
                                   double rate) {
    __shared__ double mean_sh;
    if (threadIdx.x == 0) {
        double m = 0.0;
        for (int64_t e = 0; e < E; e++) m += (double)cnt[e * sc];
        mean_sh = m / (double)E;
    }
    __syncthreads();
    const double mean = mean_sh;
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
        double d = mean - (double)cnt[e * sc];
        double sign = (double)((d > 0) - (d < 0));
        bias[e * sb] = (float)((double)bias[e * sb] + rate * sign);
    }
}

extern "C" tm_status tm__moe_expert_bias_update_forward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const char *what = "moe_expert_bias_update";
    tm__cuda *st;
    TM__TRY(tm__cu_enter(ctx, what, &st));
    tm_tensor *bias = c->in[0];
    const tm_tensor *counts = c->in[1];
    if (bias->dtype != TM_F32)
        return tm__err(ctx, TM_ERR_INTERNAL, "%s: CUDA kernel got expert_bias %s", what, tm__tdesc(ctx, bias));
    const int64_t E = bias->shape[0];
    if (E == 0) return TM_OK;
    bias_update_kernel<<<1, TM__CU_THREADS, 0, st->stream>>>((float *)tm__data(bias), bias->stride[0],
                                                             (const long long *)tm__data(counts), counts->stride[0],
                                                             E, c->fattr[0]);
    TM__CU_LAUNCHED(ctx, what, "bias_update_kernel");
    return TM_OK;
}
