/*
 * bench.h — what the GPU benchmark programs (moe_layer.c, kernels.c, attention.c, alltoall.c) share: option
 * parsing, the device, the clock and the error check. Header-only (static functions), public
 * header only, like any program using the library.
 *
 * Timing: every program times a loop of calls the way the PyTorch scripts beside them time
 * PyTorch: wait for the device (tm_ctx_sync / torch.cuda.synchronize), read the wall clock,
 * run N calls, wait again, read the clock. Warm-up calls run first, untimed, so that the
 * arenas have grown to their steady size (no cudaMalloc in the timed loop; the programs print
 * the allocation count of the timed loop to show it) and cuBLASLt has chosen its algorithms.
 */
#ifndef TINYMOE_BENCH_H
#define TINYMOE_BENCH_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tinymoe.h"

typedef struct bench_opt {
    const char *key;  /* "--iters" */
    long *num;        /* an integer option, or */
    const char **str; /* a string option */
    long lo;          /* smallest accepted integer */
    const char *help;
} bench_opt;

static inline double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void bench_usage(FILE *f, const char *prog, const char *about, const bench_opt *o, int n) {
    fprintf(f, "usage: %s [options]\n%s\n", prog, about);
    for (int i = 0; i < n; i++) {
        if (o[i].num) fprintf(f, "  %-12s %-10ld %s\n", o[i].key, *o[i].num, o[i].help);
        else fprintf(f, "  %-12s %-10s %s\n", o[i].key, *o[i].str, o[i].help);
    }
}

/* Returns 1 to go on, 0 after --help, -1 on a bad option (message printed). */
static inline int bench_parse(int argc, char **argv, const char *prog, const char *about, const bench_opt *o, int n) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            bench_usage(stdout, prog, about, o, n);
            return 0;
        }
        int k = 0;
        while (k < n && strcmp(argv[i], o[k].key)) k++;
        if (k == n || i + 1 == argc) {
            fprintf(stderr, "%s: %s '%s'\n", prog, k == n ? "unknown option" : "missing value for", argv[i]);
            bench_usage(stderr, prog, about, o, n);
            return -1;
        }
        const char *v = argv[++i];
        if (o[k].str) {
            *o[k].str = v;
            continue;
        }
        char *end = NULL;
        errno = 0;
        long x = strtol(v, &end, 10);
        if (errno || end == v || *end || x < o[k].lo) {
            fprintf(stderr, "%s: %s must be an integer >= %ld, got '%s'\n", prog, o[k].key, o[k].lo, v);
            return -1;
        }
        *o[k].num = x;
    }
    return 1;
}

/* The value of a program's --gmm option (default | device | hopper | auto: tm_ctx_options.grouped_gemm),
 * which bench_ctx applies and the RESULT lines report. "default" is cuBLASLt per group, the
 * tables' baseline column (the library's own default is auto: hopper on an sm_90, cuBLASLt elsewhere). */
static inline const char **bench_gmm_slot(void) {
    static const char *gmm = "default";
    return &gmm;
}
static inline const char *bench_gmm(void) { return *bench_gmm_slot(); }

/* The context for --device cpu|cuda (and --gmm). On a machine or build without CUDA, --device cuda is
 * refused with a message saying so (exit status 3 from the programs): the benchmarks are
 * built everywhere (CI compiles them) and run where a GPU is. */
static inline int bench_ctx(const char *prog, const char *device, long threads, tm_ctx **ctx, tm_device *dev) {
    tm_ctx_options co = tm_ctx_options_default();
    co.num_threads = (int)threads;
    if (!strcmp(bench_gmm(), "device")) co.grouped_gemm = TM_GROUPED_GEMM_DEVICE;
    else if (!strcmp(bench_gmm(), "hopper")) co.grouped_gemm = TM_GROUPED_GEMM_HOPPER;
    else if (!strcmp(bench_gmm(), "auto")) co.grouped_gemm = TM_GROUPED_GEMM_AUTO;
    else if (!strcmp(bench_gmm(), "default")) co.grouped_gemm = TM_GROUPED_GEMM_CUBLASLT;
    else {
        fprintf(stderr, "%s: --gmm must be default (cuBLASLt per group), device, hopper or auto, got '%s'\n", prog,
                bench_gmm());
        return 2;
    }
    if (!strcmp(device, "cuda")) {
        if (tm_cuda_device_count() < 1) {
            fprintf(stderr,
                    "%s: --device cuda: no CUDA device is visible (this build of tinymoe %s the CUDA backend); "
                    "this benchmark is meant for a GPU machine (--device cpu runs a smoke test of it)\n",
                    prog,
#ifdef TM_HAVE_CUDA
                    "has"
#else
                    "lacks"
#endif
            );
            return 3;
        }
        co.cuda_device = 0;
        *dev = tm_cuda(0);
    } else if (!strcmp(device, "cpu")) {
        *dev = tm_cpu();
    } else {
        fprintf(stderr, "%s: --device must be cpu or cuda, got '%s'\n", prog, device);
        return 2;
    }
    if (tm_ctx_new(ctx, &co) != TM_OK) {
        fprintf(stderr, "%s: tm_ctx_new: %s\n", prog, tm_last_create_error());
        return 1;
    }
    return 0;
}

/* CHECK(expr): on failure print the call, the status and the context's message, goto fail.
 * The including file defines BENCH_PROG (its name) and has `ctx` and a `fail:` label in scope. */
#define CHECK(expr)                                                                                    \
    do {                                                                                               \
        tm_status s_ = (expr);                                                                         \
        if (s_ != TM_OK) {                                                                             \
            fprintf(stderr, "%s: %s failed: %s: %s\n", BENCH_PROG, #expr, tm_status_str(s_),          \
                    ctx ? tm_ctx_errmsg(ctx) : "");                                                    \
            goto fail;                                                                                 \
        }                                                                                              \
    } while (0)

/* splitmix64: cheap, deterministic host randomness for routings. */
static inline uint64_t bench_rand(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline double bench_u01(uint64_t *s) { return (double)(bench_rand(s) >> 11) * (1.0 / 9007199254740992.0); }

#endif
