/*
 * kernels.c — the MoE kernels against their hardware references, on the GPU:
 *
 * 1. Grouped GEMM (tm_grouped_matmul) on the expert shapes against ONE dense GEMM of the same
 *    FLOPs (tm_matmul, cuBLASLt): x [R,K] bf16, R = T k rows split over E groups, w [E,K,N];
 *    the dense GEMM is x [R,K] @ w [K,N], 2 R K N FLOPs like the grouped one. Two shapes:
 *      gate_up: (R, H) x (E, H, 2F)      down: (R, F) x (E, F, H)
 *    (T=16384, k=6, E=64, H=2048, F=1408: R = 98304), each under three routings of the T
 *    tokens to k distinct experts each: balanced (token t takes experts (t k + j) mod E: every
 *    group R / E rows), random (uniform), skewed (expert popularity log-normal, sigma 1: a
 *    few experts with several times the mean load, as early in training). Forward (2 R K N
 *    FLOPs) and forward + backward (dx and dw too: 6 R K N). The counts are a persistent i64
 *    buffer: the library reads a device tensor's counts back at most once per arena lifetime
 *    (tinymoe.h, tm_grouped_matmul), so the timed loops reset the arena every --block calls;
 *    the syncs per call are printed. --gmm (bench/gpu.sh runs this program with and without
 *    --gmm device) is echoed in the RESULT lines.
 *
 * 2. Permute / unpermute (tm_moe_permute, tm_moe_unpermute) against a device-to-device copy
 *    (cudaMemcpy, straight from the CUDA runtime: the public API has no plain copy; memcpy on
 *    the CPU). Uniform random routing, bf16 rows, f32 routing weights, align 1. Bandwidth =
 *    the bytes the op must move at least (each read or written once), over its time, b = 2:
 *      permute   fwd: (T + R) H b + T E (1 + 4) + R (4 + 8)
 *                     x read, rows written; routing map and weights read; row weights and
 *                     row tokens written
 *                bwd: (R + T) H b + R 8        d rows read, dx written; row tokens read
 *      unpermute fwd: (R + T) H b + R (4 + 8)  rows, weights, row tokens read; y written
 *                bwd: (T + 2R) H b + R (4 + 4 + 8)
 *                     dy and rows read, d rows written; weights read, d weights written,
 *                     row tokens read
 *    The backward's time is (forward + backward) - forward - seed, all measured: the seed is
 *    tm_backward_with_grad's copy of the given upstream gradient into the output's gradient
 *    (the harness's, not the op's: in a model the op's upstream gradient is written by the
 *    next op's backward), timed as a device copy of the output's bytes. The copy moves
 *    S = R H b bytes: 2 S bytes read + written. The permute's forward includes its one read
 *    of the expert counts (a synchronisation, by design: R sizes its output).
 *
 * Inputs are parameters (persistent; their gradients accumulate), upstream gradients
 * persistent buffers, all random. Forward timings run with grad mode off (no tape), forward +
 * backward with it on and tm_backward_with_grad.
 *
 * Output: a human table, then machine-readable lines
 *   RESULT bench=gemm op=gate_up kind=grouped routing=random ... tflops_fwd=... tflops_fwdbwd=...
 *   RESULT bench=permute op=permute ... gbs_fwd=... gbs_bwd=... copy_gbs=...
 */
#define BENCH_PROG "kernels"
#include <math.h>

#include "bench.h"

#ifdef TM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

enum { OP_GROUPED, OP_DENSE, OP_PERMUTE, OP_PERMUTE_TOPK, OP_UNPERMUTE };

typedef struct op_case {
    int kind;
    tm_tensor *a, *b, *c, *d; /* the op's inputs, in argument order */
    tm_tensor *dy;            /* upstream gradient of its output */
    int64_t num_tokens;       /* unpermute; permute_topk: topk */
} op_case;

static tm_status op_call(tm_ctx *ctx, const op_case *oc, int backward) {
    tm_tensor *out = NULL;
    tm_status s = TM_OK;
    switch (oc->kind) {
    case OP_GROUPED: s = tm_grouped_matmul(ctx, oc->a, oc->b, oc->c, &out); break;
    case OP_DENSE: s = tm_matmul(ctx, oc->a, oc->b, 0, 0, &out); break;
    case OP_PERMUTE: {
        tm_moe_dispatch d;
        s = tm_moe_permute(ctx, oc->a, oc->b, oc->c, 1, 0, &d);
        out = d.permuted;
        break;
    }
    case OP_PERMUTE_TOPK: {
        tm_moe_dispatch d;
        s = tm_moe_permute_topk(ctx, oc->a, oc->b, oc->c, (int)oc->num_tokens, 1, 0, &d);
        out = d.permuted;
        break;
    }
    default: s = tm_moe_unpermute(ctx, oc->a, oc->b, oc->c, oc->num_tokens, &out); break;
    }
    if (s == TM_OK && backward) s = tm_backward_with_grad(ctx, out, oc->dy);
    return s;
}

/* Seconds per call of `iters` timed calls, resetting the arena every `block` calls (and first
 * running max(warmup, block) untimed ones the same way). */
static int timed(tm_ctx *ctx, const op_case *oc, int backward, long warmup, long iters, long block, double *sec,
                 double *syncs, uint64_t *allocs) {
    int prev = tm_ctx_set_grad_enabled(ctx, backward);
    long warm = warmup > block ? warmup : (block < iters ? block : iters);
    double t0 = 0;
    uint64_t s0 = 0, a0 = 0;
    for (long it = 0; it < warm + iters; it++) {
        if (it == warm) {
            tm_ctx_arena_reset(ctx);
            CHECK(tm_ctx_sync(ctx));
            s0 = tm_ctx_sync_count(ctx);
            a0 = tm_ctx_alloc_count(ctx);
            t0 = bench_now();
        }
        CHECK(op_call(ctx, oc, backward));
        if ((it + 1) % block == 0) tm_ctx_arena_reset(ctx);
    }
    *syncs = (double)(tm_ctx_sync_count(ctx) - s0) / (double)iters;
    CHECK(tm_ctx_sync(ctx));
    *sec = (bench_now() - t0) / (double)iters;
    *allocs = tm_ctx_alloc_count(ctx) - a0;
    tm_ctx_arena_reset(ctx);
    tm_ctx_set_grad_enabled(ctx, prev);
    return 0;
fail:
    tm_ctx_arena_reset(ctx);
    tm_ctx_set_grad_enabled(ctx, prev);
    return 1;
}

/* A routing of T tokens to k distinct experts of E: map [T*E] (1 where routed, may be NULL),
 * weights [T*E] (random, each token's k summing to 1; may be NULL) and counts [E]. */
static int make_routing(const char *mode, long T, long k, long E, uint64_t seed, uint8_t *map, float *weights,
                        int64_t *counts) {
    uint64_t rng = seed;
    double *pop = calloc((size_t)E, sizeof *pop), *wk = calloc((size_t)E, sizeof *wk);
    int *perm = calloc((size_t)E, sizeof *perm);
    long *pick = calloc((size_t)k, sizeof *pick);
    double *wj = calloc((size_t)k, sizeof *wj);
    if (!pop || !wk || !perm || !pick || !wj) {
        free(pop), free(wk), free(perm), free(pick), free(wj);
        return -1;
    }
    for (long e = 0; e < E; e++) {
        counts[e] = 0;
        /* log-normal popularity: exp(N(0, 1)), Box-Muller */
        double u1 = bench_u01(&rng) + 1e-300, u2 = bench_u01(&rng);
        pop[e] = exp(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
    for (long t = 0; t < T; t++) {
        if (!strcmp(mode, "balanced")) {
            for (long j = 0; j < k; j++) pick[j] = (t * k + j) % E;
        } else if (!strcmp(mode, "random")) {
            for (long e = 0; e < E; e++) perm[e] = (int)e;
            for (long j = 0; j < k; j++) { /* partial Fisher-Yates */
                long r = j + (long)(bench_rand(&rng) % (uint64_t)(E - j));
                int tmp = perm[j];
                perm[j] = perm[r];
                perm[r] = tmp;
                pick[j] = perm[j];
            }
        } else { /* skewed: k draws without replacement, proportional to popularity */
            double total = 0;
            for (long e = 0; e < E; e++) wk[e] = pop[e], total += pop[e];
            for (long j = 0; j < k; j++) {
                double r = bench_u01(&rng) * total;
                long e = 0;
                while (e < E - 1 && (r >= wk[e] || wk[e] == 0)) r -= wk[e], e++;
                while (wk[e] == 0) e = (e + 1) % E; /* rounding at the end of the row */
                pick[j] = e;
                total -= wk[e];
                wk[e] = 0;
            }
        }
        double sum = 0;
        for (long j = 0; j < k; j++) {
            counts[pick[j]]++;
            if (map) map[t * E + pick[j]] = 1;
            wj[j] = 0.05 + bench_u01(&rng);
            sum += wj[j];
        }
        if (weights)
            for (long j = 0; j < k; j++) weights[t * E + pick[j]] = (float)(wj[j] / sum);
    }
    free(pop);
    free(wk);
    free(perm);
    free(pick);
    free(wj);
    return 0;
}

static double load_ratio(const int64_t *counts, long E) {
    double mean = 0, mx = 0;
    for (long e = 0; e < E; e++) mean += (double)counts[e] / (double)E, mx = fmax(mx, (double)counts[e]);
    return mean > 0 ? mx / mean : 0;
}

/* Bytes per second of a device-to-device copy of `bytes` (2 * bytes moved per call). */
static int copy_bandwidth(int cuda, size_t bytes, long warmup, long iters, double *gbs, double *sec) {
    double t0 = 0;
    if (cuda) {
#ifdef TM_HAVE_CUDA
        void *src = NULL, *dst = NULL;
        if (cudaMalloc(&src, bytes) != cudaSuccess || cudaMalloc(&dst, bytes) != cudaSuccess ||
            cudaMemset(src, 1, bytes) != cudaSuccess) {
            fprintf(stderr, "%s: cudaMalloc/cudaMemset of 2 x %zu bytes for the copy reference failed\n", BENCH_PROG,
                    bytes);
            cudaFree(src);
            cudaFree(dst);
            return 1;
        }
        for (long it = 0; it < warmup + iters; it++) {
            if (it == warmup) {
                cudaDeviceSynchronize();
                t0 = bench_now();
            }
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0);
        }
        cudaError_t e = cudaDeviceSynchronize();
        *sec = (bench_now() - t0) / (double)iters;
        cudaFree(src);
        cudaFree(dst);
        if (e != cudaSuccess) {
            fprintf(stderr, "%s: the copy reference failed: %s\n", BENCH_PROG, cudaGetErrorString(e));
            return 1;
        }
#else
        return 1;
#endif
    } else {
        char *src = malloc(bytes), *dst = malloc(bytes);
        if (!src || !dst) {
            free(src);
            free(dst);
            return 1;
        }
        memset(src, 1, bytes);
        memset(dst, 0, bytes);
        for (long it = 0; it < warmup + iters; it++) {
            if (it == warmup) t0 = bench_now();
            memcpy(dst, src, bytes);
            __asm__ volatile("" : : "r"(dst) : "memory");
        }
        *sec = (bench_now() - t0) / (double)iters;
        free(src);
        free(dst);
    }
    *gbs = 2.0 * (double)bytes / *sec / 1e9;
    return 0;
}

static int has_word(const char *list, const char *w) {
    size_t n = strlen(w);
    for (const char *p = list; (p = strstr(p, w)); p += n)
        if ((p == list || p[-1] == ',') && (p[n] == 0 || p[n] == ',')) return 1;
    return 0;
}

int main(int argc, char **argv) {
    long T = 16384, H = 2048, F = 1408, E = 64, k = 6, warmup = 3, iters = 20, block = 5, seed = 1, threads = 0;
    const char *device = "cuda", *what = "gemm,permute", *routings = "balanced,random,skewed";
    const bench_opt opts[] = {
        {"--device", NULL, &device, 0, "cuda, or cpu (a smoke test: pass small shapes, as bench/gpu.sh --smoke does; the defaults are the GPU's)"},
        {"--what", NULL, &what, 0, "gemm and/or permute"},
        {"--routings", NULL, &routings, 0, "of the grouped GEMM: balanced, random, skewed"},
        {"--T", &T, NULL, 1, "tokens"},
        {"--H", &H, NULL, 1, "hidden size"},
        {"--F", &F, NULL, 1, "expert FFN size"},
        {"--E", &E, NULL, 1, "experts (groups)"},
        {"--k", &k, NULL, 1, "experts per token"},
        {"--warmup", &warmup, NULL, 0, "untimed calls first"},
        {"--iters", &iters, NULL, 1, "timed calls"},
        {"--block", &block, NULL, 1, "calls between arena resets"},
        {"--seed", &seed, NULL, 0, "seed of the data and routings"},
        {"--threads", &threads, NULL, 0, "CPU threads (0: all)"},
        {"--gmm", NULL, bench_gmm_slot(), 0,
         "bf16 grouped GEMMs on CUDA: default (cuBLASLt per group), device, hopper or auto (tm_ctx_options.grouped_gemm)"},
    };
    int n = (int)(sizeof opts / sizeof opts[0]);
    int pr = bench_parse(argc, argv, BENCH_PROG, "grouped GEMM vs dense GEMM; permute/unpermute vs a copy (bench/kernels.c)",
                         opts, n);
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
    const long R = T * k;
    const int cuda = dev.type == TM_DEVICE_CUDA;
    int64_t *counts = calloc((size_t)E, sizeof *counts);
    uint8_t *map = NULL;
    float *wts = NULL;
    int64_t *row_token = NULL;
    float *row_w = NULL;
    if (!counts) goto oom;
    printf("tinymoe %s kernels on %s: T=%ld k=%ld E=%ld H=%ld F=%ld (R = %ld rows), bf16; %ld warm-up + %ld timed "
           "calls, arena reset every %ld; --gmm %s\n",
           tm_version(), device, T, k, E, H, F, R, warmup, iters, block, bench_gmm());

    if (has_word(what, "gemm")) {
        const struct { const char *name; long K, N; } shapes[2] = {{"gate_up", H, 2 * F}, {"down", F, H}};
        const char *modes[3] = {"balanced", "random", "skewed"};
        printf("\n%-8s %-9s %-9s %5s %5s %11s %9s %9s %11s %9s %9s %8s\n", "gemm", "kind", "routing", "K", "N",
               "fwd ms", "TFLOP/s", "vs dense", "fwd+bwd ms", "TFLOP/s", "vs dense", "syncs");
        for (int s = 0; s < 2; s++) {
            const long K = shapes[s].K, N = shapes[s].N;
            char nm[64];
            tm_tensor *x, *w, *wd, *dy, *cnt;
            const int64_t xs[2] = {R, K}, ws[3] = {E, K, N}, wds[2] = {K, N}, ys[2] = {R, N}, cs[1] = {E};
            snprintf(nm, sizeof nm, "%s.x", shapes[s].name);
            CHECK(tm_param_new(ctx, nm, TM_BF16, 2, xs, dev, &x));
            CHECK(tm_tensor_init_normal(ctx, x, (uint64_t)seed, NULL, 0.0, 1.0));
            snprintf(nm, sizeof nm, "%s.w", shapes[s].name);
            CHECK(tm_param_new(ctx, nm, TM_BF16, 3, ws, dev, &w));
            CHECK(tm_tensor_init_normal(ctx, w, (uint64_t)seed, NULL, 0.0, 0.02));
            snprintf(nm, sizeof nm, "%s.wd", shapes[s].name);
            CHECK(tm_param_new(ctx, nm, TM_BF16, 2, wds, dev, &wd));
            CHECK(tm_tensor_init_normal(ctx, wd, (uint64_t)seed, NULL, 0.0, 0.02));
            snprintf(nm, sizeof nm, "%s.dy", shapes[s].name);
            CHECK(tm_buffer_new(ctx, nm, TM_BF16, 2, ys, dev, &dy));
            CHECK(tm_tensor_init_normal(ctx, dy, (uint64_t)seed, NULL, 0.0, 1.0));
            const double fl = 2.0 * (double)R * (double)K * (double)N;
            double dense_f = 0, dense_fb = 0, sy = 0;
            uint64_t al = 0;
            op_case dc = {OP_DENSE, x, wd, NULL, NULL, dy, 0};
            if (timed(ctx, &dc, 0, warmup, iters, block, &dense_f, &sy, &al)) goto fail;
            if (timed(ctx, &dc, 1, warmup, iters, block, &dense_fb, &sy, &al)) goto fail;
            printf("%-8s %-9s %-9s %5ld %5ld %11.3f %9.1f %9s %11.3f %9.1f %9s %8s\n", shapes[s].name, "dense", "-", K,
                   N, 1e3 * dense_f, fl / dense_f / 1e12, "", 1e3 * dense_fb, 3 * fl / dense_fb / 1e12, "", "");
            printf("RESULT bench=gemm op=%s kind=dense routing=- device=%s R=%ld K=%ld N=%ld G=1 ms_fwd=%.4f "
                   "ms_fwdbwd=%.4f tflops_fwd=%.2f tflops_fwdbwd=%.2f gmm=%s\n",
                   shapes[s].name, device, R, K, N, 1e3 * dense_f, 1e3 * dense_fb, fl / dense_f / 1e12,
                   3 * fl / dense_fb / 1e12, bench_gmm());
            for (int m = 0; m < 3; m++) {
                if (!has_word(routings, modes[m])) continue;
                if (make_routing(modes[m], T, k, E, (uint64_t)seed + 17, NULL, NULL, counts)) goto oom;
                snprintf(nm, sizeof nm, "%s.counts.%s", shapes[s].name, modes[m]);
                CHECK(tm_buffer_new(ctx, nm, TM_I64, 1, cs, dev, &cnt));
                CHECK(tm_tensor_write(ctx, cnt, TM_I64, counts, E));
                op_case gc = {OP_GROUPED, x, w, cnt, NULL, dy, 0};
                double gf = 0, gfb = 0, sf = 0, sfb = 0;
                if (timed(ctx, &gc, 0, warmup, iters, block, &gf, &sf, &al)) goto fail;
                if (timed(ctx, &gc, 1, warmup, iters, block, &gfb, &sfb, &al)) goto fail;
                printf("%-8s %-9s %-9s %5ld %5ld %11.3f %9.1f %8.1f%% %11.3f %9.1f %8.1f%% %8.2f\n", shapes[s].name,
                       "grouped", modes[m], K, N, 1e3 * gf, fl / gf / 1e12, 100 * dense_f / gf, 1e3 * gfb,
                       3 * fl / gfb / 1e12, 100 * dense_fb / gfb, sf);
                printf("RESULT bench=gemm op=%s kind=grouped routing=%s device=%s R=%ld K=%ld N=%ld G=%ld ms_fwd=%.4f "
                       "ms_fwdbwd=%.4f tflops_fwd=%.2f tflops_fwdbwd=%.2f pct_dense_fwd=%.1f pct_dense_fwdbwd=%.1f "
                       "syncs_fwd=%.2f syncs_fwdbwd=%.2f max_load=%.3f gmm=%s\n",
                       shapes[s].name, modes[m], device, R, K, N, E, 1e3 * gf, 1e3 * gfb, fl / gf / 1e12,
                       3 * fl / gfb / 1e12, 100 * dense_f / gf, 100 * dense_fb / gfb, sf, sfb, load_ratio(counts, E),
                       bench_gmm());
            }
        }
    }

    if (has_word(what, "permute")) {
        const int64_t me[2] = {T, E}, xs[2] = {T, H}, rs[2] = {R, H}, r1[1] = {R};
        map = calloc((size_t)(T * E), 1);
        wts = calloc((size_t)(T * E), sizeof *wts);
        row_token = malloc(sizeof *row_token * (size_t)R);
        row_w = malloc(sizeof *row_w * (size_t)R);
        if (!map || !wts || !row_token || !row_w) goto oom;
        if (make_routing("random", T, k, E, (uint64_t)seed + 29, map, wts, counts)) goto oom;
        /* The permute's row order, for the unpermute's inputs: expert-major, tokens ascending. */
        long r = 0;
        for (long e = 0; e < E; e++)
            for (long t = 0; t < T; t++)
                if (map[t * E + e]) row_token[r] = t, row_w[r] = wts[t * E + e], r++;
        tm_tensor *x, *mp, *pr_, *dperm, *eo, *pw, *rt, *dy;
        CHECK(tm_param_new(ctx, "perm.x", TM_BF16, 2, xs, dev, &x));
        CHECK(tm_tensor_init_normal(ctx, x, (uint64_t)seed, NULL, 0.0, 1.0));
        CHECK(tm_buffer_new(ctx, "perm.map", TM_U8, 2, me, dev, &mp));
        CHECK(tm_tensor_write(ctx, mp, TM_U8, map, T * E));
        CHECK(tm_buffer_new(ctx, "perm.probs", TM_F32, 2, me, dev, &pr_));
        CHECK(tm_tensor_write(ctx, pr_, TM_F32, wts, T * E));
        CHECK(tm_buffer_new(ctx, "perm.drows", TM_BF16, 2, rs, dev, &dperm));
        CHECK(tm_tensor_init_normal(ctx, dperm, (uint64_t)seed, NULL, 0.0, 1.0));
        CHECK(tm_param_new(ctx, "unperm.rows", TM_BF16, 2, rs, dev, &eo));
        CHECK(tm_tensor_init_normal(ctx, eo, (uint64_t)seed, NULL, 0.0, 1.0));
        CHECK(tm_param_new(ctx, "unperm.weights", TM_F32, 1, r1, dev, &pw));
        CHECK(tm_tensor_write(ctx, pw, TM_F32, row_w, R));
        CHECK(tm_buffer_new(ctx, "unperm.row_token", TM_I64, 1, r1, dev, &rt));
        CHECK(tm_tensor_write(ctx, rt, TM_I64, row_token, R));
        CHECK(tm_buffer_new(ctx, "unperm.dy", TM_BF16, 2, xs, dev, &dy));
        CHECK(tm_tensor_init_normal(ctx, dy, (uint64_t)seed, NULL, 0.0, 1.0));

        const double b = 2, Td = (double)T, Rd = (double)R, Hd = (double)H, Ed = (double)E;
        const size_t copy_bytes = (size_t)R * (size_t)H * 2;
        double copy_gbs = 0, copy_s = 0;
        if (copy_bandwidth(cuda, copy_bytes, warmup, iters, &copy_gbs, &copy_s)) goto fail;
        printf("\n%-12s %11s %9s %8s %11s %9s %8s %8s\n", "op", "fwd ms", "GB/s", "of copy", "bwd ms", "GB/s",
               "of copy", "syncs");
        printf("%-12s %11.3f %9.1f %8s %11s %9s %8s %8s   (%s of %zu bytes; GB/s counts read + written)\n", "d2d copy",
               1e3 * copy_s, copy_gbs, "", "", "", "", "", cuda ? "cudaMemcpyAsync" : "memcpy", copy_bytes);
        printf("RESULT bench=copy device=%s bytes=%zu ms=%.4f gbs=%.1f\n", device, copy_bytes, 1e3 * copy_s, copy_gbs);
        const struct { const char *name; op_case oc; double bf, bb; } ops[3] = {
            {"permute", {OP_PERMUTE, x, mp, pr_, NULL, dperm, 0}, (Td + Rd) * Hd * b + Td * Ed * 5 + Rd * 12,
             (Rd + Td) * Hd * b + Rd * 8},
            {"permute_topk", {OP_PERMUTE_TOPK, x, mp, pr_, NULL, dperm, k}, (Td + Rd) * Hd * b + Td * Ed * 5 + Rd * 12,
             (Rd + Td) * Hd * b + Rd * 8},
            {"unpermute", {OP_UNPERMUTE, eo, pw, rt, NULL, dy, T}, (Rd + Td) * Hd * b + Rd * 12,
             (Td + 2 * Rd) * Hd * b + Rd * 16},
        };
        /* the outputs' bytes: permute R H b (the copy above), unpermute T H b. permute_topk is the
         * layer's dropless dispatch (tm_moe_permute_topk: R = T k known, nothing read back). */
        const size_t out_bytes[3] = {copy_bytes, copy_bytes, (size_t)T * (size_t)H * 2};
        for (int i = 0; i < 3; i++) {
            double f = 0, fb = 0, sf = 0, sfb = 0, seed = copy_s, seed_gbs = 0;
            uint64_t al = 0;
            if (out_bytes[i] != copy_bytes && copy_bandwidth(cuda, out_bytes[i], warmup, iters, &seed_gbs, &seed))
                goto fail;
            if (timed(ctx, &ops[i].oc, 0, warmup, iters, block, &f, &sf, &al)) goto fail;
            if (timed(ctx, &ops[i].oc, 1, warmup, iters, block, &fb, &sfb, &al)) goto fail;
            double bw = fb - f - seed, gf = ops[i].bf / f / 1e9, gb = bw > 0 ? ops[i].bb / bw / 1e9 : 0;
            printf("%-12s %11.3f %9.1f %7.1f%% %11.3f %9.1f %7.1f%% %8.2f\n", ops[i].name, 1e3 * f, gf,
                   100 * gf / copy_gbs, 1e3 * bw, gb, 100 * gb / copy_gbs, sf);
            printf("RESULT bench=permute op=%s device=%s T=%ld H=%ld E=%ld k=%ld ms_fwd=%.4f ms_fwdbwd=%.4f ms_bwd=%.4f "
                   "ms_seed=%.4f gbs_fwd=%.1f gbs_bwd=%.1f copy_gbs=%.1f pct_copy_fwd=%.1f pct_copy_bwd=%.1f "
                   "syncs_fwd=%.2f bytes_fwd=%.0f bytes_bwd=%.0f\n",
                   ops[i].name, device, T, H, E, k, 1e3 * f, 1e3 * fb, 1e3 * bw, 1e3 * seed, gf, gb, copy_gbs,
                   100 * gf / copy_gbs, 100 * gb / copy_gbs, sf, ops[i].bf, ops[i].bb);
        }
    }
    rc = 0;
    goto fail;
oom:
    fprintf(stderr, "%s: out of host memory\n", BENCH_PROG);
fail:
    free(counts);
    free(map);
    free(wts);
    free(row_token);
    free(row_w);
    tm_ctx_free(ctx);
    return rc;
}
