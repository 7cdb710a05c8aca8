/*
 * test_cuda_parity_comm.c — the collective ops (framework/ops/comm.c) on CUDA tensors against
 * the CPU, forward and backward, in a world of one rank (the self engine moves device memory;
 * several ranks are tests/test_dist.c's, and the host-staged and NCCL engines the GPU
 * machine's). Tolerances as tests/test_cuda_parity.c: f32 1e-5, bf16 1e-2 (the ops move or
 * copy values, so the results are in fact exact). Skips without a CUDA device.
 */
#include <stdlib.h>

#include "common.h"
#include "parity.h"

static tm_status f_allreduce(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_comm_allreduce(c, in[0], TM_COMM_DP, o);
}
static tm_status f_allgather(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_comm_allgather(c, in[0], TM_COMM_WORLD, o);
}
static tm_status f_reduce_scatter(tm_ctx *c, tm_tensor **in, const int64_t *a, tm_tensor **o) {
    return tm_comm_reduce_scatter(c, in[0], TM_COMM_EP, o);
}

static const tt_pcase CASES[] = {
    {.op = "comm_allreduce", .name = "allreduce [5,7]", .fn = f_allreduce, .n_in = 1, .nd = {2}, .shape = {{5, 7}}},
    {.op = "comm_allgather", .name = "allgather [4,3]", .fn = f_allgather, .n_in = 1, .nd = {2}, .shape = {{4, 3}}},
    {.op = "comm_reduce_scatter", .name = "reduce_scatter [6,2]", .fn = f_reduce_scatter, .n_in = 1, .nd = {2},
     .shape = {{6, 2}}},
};

TT_PARITY_COVERS("comm_allreduce")
TT_PARITY_COVERS("comm_allgather")
TT_PARITY_COVERS("comm_reduce_scatter")
Test(cuda_parity_comm, collectives_f32_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    for (size_t k = 0; k < sizeof CASES / sizeof CASES[0]; k++) {
        tt_parity_run(&CASES[k], TM_F32, 1e-5, 1e-5);
        tt_parity_run(&CASES[k], TM_BF16, 1e-2, 1e-2);
    }
}

/* alltoall keeps its counts on the CPU whatever x's device: its own comparison. */
TT_PARITY_COVERS("comm_alltoall")
Test(cuda_parity_comm, alltoall_f32) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t shape[2] = {5, 3}, one = 1, five = 5;
    double *xv = tt_parity_uniform(15, 7), *gv = tt_parity_uniform(15, 8);
    tm_tensor *cnt, *x[2], *g[2], *y[2];
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &one, tm_cpu(), TM_I64, &five, &cnt));
    tm_device dev[2] = {tm_cpu(), tm_cuda(0)};
    double *out[2], *grad[2];
    for (int d = 0; d < 2; d++) {
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, shape, dev[d], TM_F64, xv, &x[d]));
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x[d], 1));
        TT_OK(ctx, tm_comm_alltoall(ctx, x[d], cnt, cnt, TM_COMM_WORLD, &y[d]));
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, shape, dev[d], TM_F64, gv, &g[d]));
        TT_OK(ctx, tm_backward_with_grad(ctx, y[d], g[d]));
        out[d] = tt_read(ctx, y[d]);
        grad[d] = tt_read(ctx, tm_tensor_grad(x[d]));
    }
    cr_assert_leq(tt_close_ratio(out[1], out[0], 15, 1e-5, 1e-5), 1.0);
    cr_assert_leq(tt_close_ratio(grad[1], grad[0], 15, 1e-5, 1e-5), 1.0);
    for (int d = 0; d < 2; d++) free(out[d]), free(grad[d]);
    free(xv), free(gv);
    tm_ctx_free(ctx);
}
