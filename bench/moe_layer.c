/*
 * moe_layer.c — one MoE layer, forward and forward + backward, in bf16, timed on the GPU the way
 * bench/moe_layer_torch.py times the same layer in PyTorch (bench/gpu.sh runs both).
 *
 * The layer (tm_moe_new, the public API): x [T,H] bf16 -> router logits = f32(x) @ gate [H,E]
 * (f32) -> softmax over the E experts -> top-k -> weights renormalised to sum 1
 * (norm_topk_prob, Mixtral / Qwen-MoE) -> permute (expert-major rows, dropless, align 1) ->
 * grouped GEMMs x_e @ w0[e], x_e @ w1[e] [H,F] -> SwiGLU -> @ wo[e] [F,H] -> unpermute weighted
 * by the routing weights (f32 accumulation) -> y [T,H] bf16. No auxiliary loss, no z-loss, no
 * expert bias, no shared expert: the timing is the routed path alone, on both sides.
 * Default shapes T=16384 H=2048 F=1408 E=64 k=6 (issue 12).
 *
 * Inputs: x is a bf16 parameter drawn N(0, 1) (persistent, so that it needs no upload per
 * iteration; its gradient accumulates, as does PyTorch's x.grad), weights N(0, 0.02) (the gate
 * too: logits of standard deviation about 0.9, a near-uniform routing), the upstream gradient
 * dy a bf16 buffer drawn N(0, 1). An iteration is tm_moe_forward, then (fwd+bwd)
 * tm_backward_with_grad(y, dy), then tm_ctx_arena_reset. Gradients of the weights accumulate
 * across iterations (no zero_grad in the loop), on both sides.
 *
 * FLOPs counted: the expert GEMMs only (the router GEMM, 2 T H E, is 0.25% of them and left
 * out): forward 3 GEMMs x 2 T k H F = 6 T k H F; backward twice the forward (dx and dw of each
 * GEMM): forward + backward 18 T k H F. At the default shapes 5.10e12 per iteration.
 *
 * Output: human lines, then one machine-readable line
 *   RESULT bench=moe_layer impl=tinymoe ms_fwd=... ms_fwdbwd=... tflops_fwd=... tflops_fwdbwd=...
 */
#define BENCH_PROG "moe_layer"
#include <math.h>

#include "bench.h"

/* Time `iters` iterations after `warmup` untimed ones. Returns 0 or 1 (message printed). */
static int run(tm_ctx *ctx, tm_moe *moe, tm_tensor *x, tm_tensor *dy, int backward, long warmup, long iters,
               double *sec, double *syncs, uint64_t *allocs) {
    double t0 = 0;
    uint64_t s0 = 0, a0 = 0;
    for (long it = 0; it < warmup + iters; it++) {
        if (it == warmup) {
            CHECK(tm_ctx_sync(ctx));
            s0 = tm_ctx_sync_count(ctx);
            a0 = tm_ctx_alloc_count(ctx);
            t0 = bench_now();
        }
        tm_tensor *y;
        CHECK(tm_moe_forward(moe, x, 1, &y, NULL));
        if (backward) CHECK(tm_backward_with_grad(ctx, y, dy));
        tm_ctx_arena_reset(ctx);
    }
    *syncs = (double)(tm_ctx_sync_count(ctx) - s0) / (double)iters;
    CHECK(tm_ctx_sync(ctx));
    *sec = (bench_now() - t0) / (double)iters;
    *allocs = tm_ctx_alloc_count(ctx) - a0;
    return 0;
fail:
    return 1;
}

int main(int argc, char **argv) {
    long T = 16384, H = 2048, F = 1408, E = 64, k = 6, warmup = 3, iters = 20, seed = 1, threads = 0;
    const char *device = "cuda";
    const bench_opt opts[] = {
        {"--device", NULL, &device, 0, "cuda, or cpu (a smoke test: pass small shapes, as bench/gpu.sh --smoke does; the defaults are the GPU's)"},
        {"--T", &T, NULL, 1, "tokens"},
        {"--H", &H, NULL, 1, "hidden size"},
        {"--F", &F, NULL, 1, "expert FFN size"},
        {"--E", &E, NULL, 1, "routed experts"},
        {"--k", &k, NULL, 1, "experts per token"},
        {"--warmup", &warmup, NULL, 0, "untimed iterations first"},
        {"--iters", &iters, NULL, 1, "timed iterations"},
        {"--seed", &seed, NULL, 0, "initialisation seed"},
        {"--threads", &threads, NULL, 0, "CPU threads (0: all)"},
        {"--gmm", NULL, bench_gmm_slot(), 0,
         "bf16 grouped GEMMs on CUDA: default (cuBLASLt per group), device, hopper or auto (tm_ctx_options.grouped_gemm)"},
    };
    int n = (int)(sizeof opts / sizeof opts[0]);
    int pr = bench_parse(argc, argv, BENCH_PROG, "MoE layer forward and forward+backward, bf16 (bench/moe_layer.c)", opts, n);
    if (pr <= 0) return pr < 0 ? 2 : 0;
    if (k > E) {
        fprintf(stderr, "%s: --k %ld exceeds --E %ld\n", BENCH_PROG, k, E);
        return 2;
    }

    tm_ctx *ctx = NULL;
    tm_device dev;
    int rc = bench_ctx(BENCH_PROG, device, threads, &ctx, &dev);
    if (rc) return rc;
    rc = 1;
    tm_moe *moe = NULL;

    tm_moe_config cfg = tm_moe_config_default();
    cfg.hidden_size = (int)H;
    cfg.ffn_size = (int)F;
    cfg.router = tm_router_config_default();
    cfg.router.num_experts = (int)E;
    cfg.router.topk = (int)k;
    cfg.router.score_function = TM_SCORE_SOFTMAX;
    cfg.router.use_pre_softmax = 1;
    cfg.router.norm_topk_prob = 1;
    cfg.aux_loss_coeff = 0;
    cfg.seq_aux_loss_coeff = 0;
    cfg.z_loss_coeff = 0;
    cfg.align_size = 1;
    cfg.capacity_factor = 0;
    cfg.shared_ffn_size = 0;
    cfg.strategy = TM_MOE_GROUPED;
    double t_setup = bench_now();
    CHECK(tm_moe_new(ctx, "moe", &cfg, TM_BF16, dev, &moe));
    CHECK(tm_moe_init(moe, (uint64_t)seed, 0.02, 0.02));
    const int64_t xs[2] = {T, H};
    tm_tensor *x, *dy;
    CHECK(tm_param_new(ctx, "x", TM_BF16, 2, xs, dev, &x));
    CHECK(tm_tensor_init_normal(ctx, x, (uint64_t)seed, NULL, 0.0, 1.0));
    CHECK(tm_buffer_new(ctx, "dy", TM_BF16, 2, xs, dev, &dy));
    CHECK(tm_tensor_init_normal(ctx, dy, (uint64_t)seed, NULL, 0.0, 1.0));
    CHECK(tm_ctx_sync(ctx));
    t_setup = bench_now() - t_setup;

    double fwd = 0, fb = 0, sync_f = 0, sync_fb = 0;
    uint64_t alloc_f = 0, alloc_fb = 0;
    if (run(ctx, moe, x, dy, 0, warmup, iters, &fwd, &sync_f, &alloc_f)) goto fail;
    if (run(ctx, moe, x, dy, 1, warmup, iters, &fb, &sync_fb, &alloc_fb)) goto fail;

    /* The routing the timing saw (one more forward, untimed): expert loads. */
    tm_moe_stats st;
    tm_tensor *y;
    CHECK(tm_moe_forward(moe, x, 1, &y, &st));
    CHECK(tm_moe_stats_read(moe, &st));
    tm_ctx_arena_reset(ctx);

    double fl_f = 6.0 * (double)T * (double)k * (double)H * (double)F, fl_fb = 3.0 * fl_f;
    printf("tinymoe %s moe_layer on %s: T=%ld H=%ld F=%ld E=%ld k=%ld bf16, softmax top-k normalised, dropless, "
           "no aux losses; setup %.1f s; %ld warm-up + %ld timed iterations\n",
           tm_version(), device, T, H, F, E, k, t_setup, warmup, iters);
    printf("  forward           %9.3f ms  %8.1f TFLOP/s (expert GEMMs, 6 T k H F = %.3g)  %.2f syncs/iter, "
           "%llu allocations timed\n",
           1e3 * fwd, fl_f / fwd / 1e12, fl_f, sync_f, (unsigned long long)alloc_f);
    printf("  forward+backward  %9.3f ms  %8.1f TFLOP/s (18 T k H F = %.3g)  %.2f syncs/iter, %llu allocations timed\n",
           1e3 * fb, fl_fb / fb / 1e12, fl_fb, sync_fb, (unsigned long long)alloc_fb);
    printf("  expert load: max/mean %.3f, min/mean %.3f\n", st.max_load_ratio, st.min_load_ratio);
    /* which kernels the timed path took (a table is only worth what it measured) */
    tm_kernel_report kr;
    static const char *const gg[] = {"cublaslt", "device", "hopper"};
    if (tm_ctx_kernel_report(ctx, &kr) == TM_OK && !strcmp(device, "cuda"))
        printf("  kernels: grouped GEMM %s; one-launch gate/up + SwiGLU %llu, down dx + SwiGLU backward %llu%s%s\n",
               kr.grouped_gemm >= 0 && kr.grouped_gemm < 3 ? gg[kr.grouped_gemm] : "?",
               (unsigned long long)kr.grouped_swiglu_fused, (unsigned long long)kr.grouped_mlp_fused,
               kr.grouped_gemm_note[0] ? "; off the Hopper kernel: " : "", kr.grouped_gemm_note);
    printf("RESULT bench=moe_layer impl=tinymoe device=%s T=%ld H=%ld F=%ld E=%ld k=%ld ms_fwd=%.4f ms_fwdbwd=%.4f "
           "tflops_fwd=%.2f tflops_fwdbwd=%.2f syncs_fwd=%.2f syncs_fwdbwd=%.2f allocs_timed=%llu max_load=%.3f "
           "gmm=%s iters=%ld\n",
           device, T, H, F, E, k, 1e3 * fwd, 1e3 * fb, fl_f / fwd / 1e12, fl_fb / fb / 1e12, sync_f, sync_fb,
           (unsigned long long)(alloc_f + alloc_fb), st.max_load_ratio, bench_gmm(), iters);
    rc = 0;
fail:
    tm_moe_free(moe);
    tm_ctx_free(ctx);
    return rc;
}
