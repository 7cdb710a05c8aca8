/*
 * main.c — the `tinymoe` command line.
 *
 *   tinymoe demo [--steps N] [--seed S] [--threads T] [--device cpu|cuda] [--lr LR]
 *                [--log-every N]
 *   tinymoe --version | --help
 *
 * Exit status: 0 success, 1 a run that failed (the library's message is printed), 2 a usage
 * error (the message names the flag).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "demo.h"
#include "tinymoe.h"

static const char USAGE[] =
    "usage: tinymoe <command> [flags]\n"
    "\n"
    "commands:\n"
    "  demo        train a 2-layer transformer LM on a synthetic order-2 Markov source and\n"
    "              report its loss against the source's exact optimum\n"
    "\n"
    "demo flags:\n"
    "  --steps N         optimizer steps (default 1000)\n"
    "  --seed S          seed of the data source, the initialisation and the batches (default 1)\n"
    "  --threads T       CPU kernel threads, 0 = all available (default 0)\n"
    "  --device D        cpu or cuda (CUDA device 0; default cpu)\n"
    "  --lr LR           peak learning rate (default 0.01; warmup, then cosine decay)\n"
    "  --log-every N     print a row every N steps (default 10; 1 = every step)\n"
    "\n"
    "  --version         print the version\n"
    "  --help            print this help\n";

static void usage_error(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, "tinymoe: ");
    fprintf(stderr, fmt, a, b);
    fprintf(stderr, "\nrun 'tinymoe --help' for usage\n");
    exit(2);
}

/* A decimal integer in [lo, hi], the whole string. */
static long long parse_int(const char *flag, const char *v, long long lo, long long hi) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi) {
        char range[64];
        snprintf(range, sizeof range, "an integer in [%lld, %lld]", lo, hi);
        fprintf(stderr, "tinymoe: %s needs %s, got '%s'\nrun 'tinymoe --help' for usage\n", flag, range, v);
        exit(2);
    }
    return x;
}

/* A finite number in (0, 1], the whole string. */
static double parse_double(const char *flag, const char *v) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !(x > 0.0 && x <= 1.0)) {
        fprintf(stderr, "tinymoe: %s needs a number in (0, 1], got '%s'\nrun 'tinymoe --help' for usage\n", flag, v);
        exit(2);
    }
    return x;
}

static int cmd_demo(int argc, char **argv) {
    tmd_demo_opts o = {.steps = 1000, .seed = 1, .threads = 0, .cuda = 0, .lr = 1e-2, .log_every = 10};
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(USAGE, stdout);
            return 0;
        }
        /* --flag value and --flag=value */
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a) : strlen(a);
        const char *flags[] = {"--steps", "--seed", "--threads", "--device", "--lr", "--log-every"};
        int f = -1;
        for (int k = 0; k < 6; k++)
            if (strlen(flags[k]) == nlen && !strncmp(a, flags[k], nlen)) f = k;
        if (f < 0) usage_error("demo: unknown flag '%s'%s", a, "");
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (!v) usage_error("%s needs a value%s", flags[f], "");
        switch (f) {
        case 0: o.steps = (int)parse_int("--steps", v, 1, 100000000); break;
        case 1: o.seed = (uint64_t)parse_int("--seed", v, 0, INT64_MAX); break;
        case 2: o.threads = (int)parse_int("--threads", v, 0, 4096); break;
        case 3:
            if (!strcmp(v, "cpu")) o.cuda = 0;
            else if (!strcmp(v, "cuda")) o.cuda = 1;
            else usage_error("--device must be 'cpu' or 'cuda', got '%s'%s", v, "");
            break;
        case 4: o.lr = parse_double("--lr", v); break;
        case 5: o.log_every = (int)parse_int("--log-every", v, 1, 100000000); break;
        }
    }
    if (o.cuda && tm_cuda_device_count() == 0) {
        fprintf(stderr, "tinymoe demo: --device cuda, but this build has no CUDA backend or no CUDA device "
                        "is visible\n");
        return 1;
    }
    return tmd_demo(&o);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fputs(USAGE, stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        fputs(USAGE, stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version")) {
        printf("tinymoe %s (library %s)\n", TM_VERSION_STRING, tm_version());
        return 0;
    }
    if (!strcmp(cmd, "demo")) return cmd_demo(argc - 2, argv + 2);
    usage_error("unknown command '%s'%s", cmd, "");
    return 2;
}
