/*
 * attention.c — tm_attention (fused causal grouped-query attention) forward and forward +
 * backward in bf16 on the GPU, timed the way bench/attention_torch.py times
 * F.scaled_dot_product_attention (bench/gpu.sh runs both, for D = 64 and D = 128).
 *
 * q [B,S,Hq,D], k and v [B,S,Hkv,D] bf16 parameters drawn N(0, 1) (persistent; their gradients
 * accumulate, as PyTorch's .grad do), the upstream gradient a bf16 buffer N(0, 1); scale
 * 1/sqrt(D). Defaults B=16 S=1024 Hq=12 Hkv=4 D=64 (issue 12). An iteration: tm_attention,
 * then (fwd+bwd) tm_backward_with_grad, then tm_ctx_arena_reset.
 *
 * FLOPs (the FlashAttention convention): the two products Q K^T and P V cost 4 B Hq S^2 D,
 * halved by the causal mask: forward 2 B Hq S^2 D; the backward is 2.5 times the forward
 * (recomputing Q K^T, then dV, dP, dQ, dK), forward + backward 3.5 x 2 B Hq S^2 D = 7 B Hq S^2 D.
 *
 * Output: human lines, then one machine-readable line
 *   RESULT bench=attention impl=tinymoe D=... ms_fwd=... ms_fwdbwd=... tflops_fwd=... tflops_fwdbwd=...
 */
#define BENCH_PROG "attention"
#include <math.h>

#include "bench.h"

static int run(tm_ctx *ctx, tm_tensor *q, tm_tensor *k, tm_tensor *v, tm_tensor *dy, int backward, long warmup,
               long iters, double *sec, uint64_t *syncs, uint64_t *allocs) {
    double t0 = 0;
    uint64_t s0 = 0, a0 = 0;
    for (long it = 0; it < warmup + iters; it++) {
        if (it == warmup) {
            CHECK(tm_ctx_sync(ctx));
            s0 = tm_ctx_sync_count(ctx);
            a0 = tm_ctx_alloc_count(ctx);
            t0 = bench_now();
        }
        tm_tensor *o;
        CHECK(tm_attention(ctx, q, k, v, 0.0, &o));
        if (backward) CHECK(tm_backward_with_grad(ctx, o, dy));
        tm_ctx_arena_reset(ctx);
    }
    *syncs = tm_ctx_sync_count(ctx) - s0;
    CHECK(tm_ctx_sync(ctx));
    *sec = (bench_now() - t0) / (double)iters;
    *allocs = tm_ctx_alloc_count(ctx) - a0;
    return 0;
fail:
    return 1;
}

int main(int argc, char **argv) {
    long B = 16, S = 1024, Hq = 12, Hkv = 4, D = 64, warmup = 5, iters = 50, seed = 1, threads = 0;
    const char *device = "cuda";
    const bench_opt opts[] = {
        {"--device", NULL, &device, 0, "cuda, or cpu (a smoke test: pass small shapes, as bench/gpu.sh --smoke does; the defaults are the GPU's)"},
        {"--B", &B, NULL, 1, "batch"},
        {"--S", &S, NULL, 1, "sequence length"},
        {"--Hq", &Hq, NULL, 1, "query heads"},
        {"--Hkv", &Hkv, NULL, 1, "key/value heads (divides Hq)"},
        {"--D", &D, NULL, 1, "head dimension"},
        {"--warmup", &warmup, NULL, 0, "untimed iterations first"},
        {"--iters", &iters, NULL, 1, "timed iterations"},
        {"--seed", &seed, NULL, 0, "seed of the inputs"},
        {"--threads", &threads, NULL, 0, "CPU threads (0: all)"},
    };
    int n = (int)(sizeof opts / sizeof opts[0]);
    int pr = bench_parse(argc, argv, BENCH_PROG, "causal GQA attention forward and forward+backward, bf16 (bench/attention.c)",
                         opts, n);
    if (pr <= 0) return pr < 0 ? 2 : 0;
    if (Hq % Hkv) {
        fprintf(stderr, "%s: --Hkv %ld does not divide --Hq %ld\n", BENCH_PROG, Hkv, Hq);
        return 2;
    }
    tm_ctx *ctx = NULL;
    tm_device dev;
    int rc = bench_ctx(BENCH_PROG, device, threads, &ctx, &dev);
    if (rc) return rc;
    rc = 1;
    const int64_t qs[4] = {B, S, Hq, D}, ks[4] = {B, S, Hkv, D};
    tm_tensor *q, *k, *v, *dy;
    CHECK(tm_param_new(ctx, "q", TM_BF16, 4, qs, dev, &q));
    CHECK(tm_param_new(ctx, "k", TM_BF16, 4, ks, dev, &k));
    CHECK(tm_param_new(ctx, "v", TM_BF16, 4, ks, dev, &v));
    CHECK(tm_buffer_new(ctx, "dy", TM_BF16, 4, qs, dev, &dy));
    tm_tensor *all[4] = {q, k, v, dy};
    for (int i = 0; i < 4; i++) CHECK(tm_tensor_init_normal(ctx, all[i], (uint64_t)seed, NULL, 0.0, 1.0));

    double fwd = 0, fb = 0;
    uint64_t sf = 0, sfb = 0, af = 0, afb = 0;
    if (run(ctx, q, k, v, dy, 0, warmup, iters, &fwd, &sf, &af)) goto fail;
    if (run(ctx, q, k, v, dy, 1, warmup, iters, &fb, &sfb, &afb)) goto fail;
    double fl_f = 2.0 * (double)B * (double)Hq * (double)S * (double)S * (double)D, fl_fb = 3.5 * fl_f;
    printf("tinymoe %s attention on %s: B=%ld S=%ld Hq=%ld Hkv=%ld D=%ld bf16 causal; %ld warm-up + %ld timed "
           "iterations\n",
           tm_version(), device, B, S, Hq, Hkv, D, warmup, iters);
    printf("  forward           %9.3f ms  %8.1f TFLOP/s (2 B Hq S^2 D = %.3g)  %llu syncs, %llu allocations timed\n",
           1e3 * fwd, fl_f / fwd / 1e12, fl_f, (unsigned long long)sf, (unsigned long long)af);
    printf("  forward+backward  %9.3f ms  %8.1f TFLOP/s (7 B Hq S^2 D = %.3g)  %llu syncs, %llu allocations timed\n",
           1e3 * fb, fl_fb / fb / 1e12, fl_fb, (unsigned long long)sfb, (unsigned long long)afb);
    printf("RESULT bench=attention impl=tinymoe device=%s B=%ld S=%ld Hq=%ld Hkv=%ld D=%ld ms_fwd=%.4f ms_fwdbwd=%.4f "
           "tflops_fwd=%.2f tflops_fwdbwd=%.2f syncs_timed=%llu allocs_timed=%llu iters=%ld\n",
           device, B, S, Hq, Hkv, D, 1e3 * fwd, 1e3 * fb, fl_f / fwd / 1e12, fl_fb / fb / 1e12,
           (unsigned long long)(sf + sfb), (unsigned long long)(af + afb), iters);
    rc = 0;
fail:
    tm_ctx_free(ctx);
    return rc;
}
