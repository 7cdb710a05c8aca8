/*
 * train_cpu.c — CPU training throughput of tinymoe's default language model, measured the
 * way bench/torch_moe.py measures PyTorch on the same architecture (bench/run.sh runs both).
 *
 * The model is tm_model_config_default(): d_model 128, 4 layers, 4 heads (4 kv heads), 4
 * experts top-2 with F 256, vocab 257 (bytes + end-of-text), untied LM head, aux loss 1e-2.
 * A step is what training does: forward with targets, backward, global-norm clipping to 1,
 * AdamW, zero_grad, the MoE per-step update, arena reset. Tokens are uniform random (the
 * work per step does not depend on their values, only on routing, which stays near uniform
 * at initialisation). Warm-up steps run first and are not timed (first-touch of the arenas,
 * OpenBLAS buffers, the parameter pages).
 *
 * Output: a human line, then one machine-readable line
 *   RESULT impl=tinymoe tokens_per_s=... ms_per_step=... params=... threads=... steps=... ...
 * Uses only the public header.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tinymoe.h"

typedef struct opts {
    long threads, batch, seq, warmup, steps, seed;
} opts;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int parse_long(const char *key, const char *s, long lo, long *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo) {
        fprintf(stderr, "train_cpu: %s must be an integer >= %ld, got \"%s\"\n", key, lo, s);
        return 0;
    }
    *out = v;
    return 1;
}

static int parse_args(int argc, char **argv, opts *o) {
    static const char *usage =
        "usage: train_cpu [--threads N] [--batch B] [--seq T] [--warmup N] [--steps N] [--seed S]\n";
    struct { const char *key; long *dst; long lo; } keys[] = {
        {"--threads", &o->threads, 1}, {"--batch", &o->batch, 1}, {"--seq", &o->seq, 1},
        {"--warmup", &o->warmup, 0},   {"--steps", &o->steps, 1}, {"--seed", &o->seed, 0},
    };
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            fputs(usage, stdout);
            return 0;
        }
        size_t k = 0;
        while (k < sizeof keys / sizeof keys[0] && strcmp(argv[i], keys[k].key)) k++;
        if (k == sizeof keys / sizeof keys[0] || i + 1 == argc) {
            fprintf(stderr, "train_cpu: %s \"%s\"\n%s", k == sizeof keys / sizeof keys[0] ? "unknown option" : "missing value for",
                    argv[i], usage);
            return 0;
        }
        if (!parse_long(keys[k].key, argv[++i], keys[k].lo, keys[k].dst)) return 0;
    }
    return 1;
}

/* splitmix64: the batch generator only needs to be cheap and deterministic. */
static uint64_t next_u64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#define CHECK(ctx, expr)                                                                        \
    do {                                                                                        \
        tm_status s_ = (expr);                                                                  \
        if (s_ != TM_OK) {                                                                      \
            fprintf(stderr, "train_cpu: %s failed: %s: %s\n", #expr, tm_status_str(s_),         \
                    (ctx) ? tm_ctx_errmsg(ctx) : "");                                           \
            goto fail;                                                                          \
        }                                                                                       \
    } while (0)

int main(int argc, char **argv) {
    opts o = {.threads = 2, .batch = 16, .seq = 128, .warmup = 3, .steps = 20, .seed = 1};
    if (!parse_args(argc, argv, &o)) return 2;

    int rc = 1;
    tm_ctx *ctx = NULL;
    tm_model *model = NULL;
    tm_optimizer *opt = NULL;
    int32_t *host = NULL;

    tm_ctx_options co = tm_ctx_options_default();
    co.num_threads = (int)o.threads;
    if (tm_ctx_new(&ctx, &co) != TM_OK) {
        fprintf(stderr, "train_cpu: tm_ctx_new: %s\n", tm_last_create_error());
        return 1;
    }
    tm_model_config cfg = tm_model_config_default();
    if (o.seq > cfg.max_seq_len) cfg.max_seq_len = (int)o.seq;
    CHECK(ctx, tm_model_new(ctx, &cfg, TM_F32, tm_cpu(), &model));
    CHECK(ctx, tm_model_init(model, (uint64_t)o.seed));
    int64_t active = 0, total = tm_model_num_params(model, &active);

    tm_adamw_config ac = tm_adamw_config_default();
    ac.lr = 1e-3;
    ac.weight_decay = 0.1;
    CHECK(ctx, tm_adamw_new(ctx, &ac, &opt));

    const int64_t B = o.batch, T = o.seq, V = cfg.vocab_size, shape[2] = {B, T};
    /* Rows of T + 1 random tokens: inputs are positions [0, T), targets [1, T + 1). */
    host = malloc(sizeof *host * (size_t)(B * (T + 1) + 2 * B * T));
    if (!host) {
        fprintf(stderr, "train_cpu: out of memory for the token buffers\n");
        goto fail;
    }
    int32_t *row = host, *tok = host + B * (T + 1), *tgt = tok + B * T;
    uint64_t rng = (uint64_t)o.seed;

    double t0 = 0, loss = 0;
    uint64_t allocs0 = 0;
    for (long step = 0; step < o.warmup + o.steps; step++) {
        if (step == o.warmup) {
            t0 = now_s();
            allocs0 = tm_ctx_alloc_count(ctx);
        }
        for (int64_t i = 0; i < B * (T + 1); i++) row[i] = (int32_t)(next_u64(&rng) % (uint64_t)V);
        for (int64_t b = 0; b < B; b++) {
            memcpy(tok + b * T, row + b * (T + 1), sizeof *tok * (size_t)T);
            memcpy(tgt + b * T, row + b * (T + 1) + 1, sizeof *tgt * (size_t)T);
        }
        tm_tensor *tokens, *targets;
        CHECK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, shape, tm_cpu(), TM_I32, tok, &tokens));
        CHECK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, shape, tm_cpu(), TM_I32, tgt, &targets));

        tm_model_out out;
        CHECK(ctx, tm_model_forward(model, tokens, targets, &out));
        CHECK(ctx, tm_backward(ctx, out.loss));
        CHECK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, NULL));
        CHECK(ctx, tm_optimizer_step(opt, -1.0));
        CHECK(ctx, tm_ctx_zero_grad(ctx));
        CHECK(ctx, tm_model_step(model));
        tm_ctx_arena_reset(ctx);
        loss = out.loss_value;
    }
    double dt = now_s() - t0;
    double tok_s = (double)(B * T) * (double)o.steps / dt, ms = 1e3 * dt / (double)o.steps;
    uint64_t allocs = tm_ctx_alloc_count(ctx) - allocs0;

    printf("tinymoe %s: %lld params (%lld active per token), B=%lld T=%lld, %ld threads, %ld warm-up + %ld timed "
           "steps: %.1f tokens/s, %.1f ms/step, final loss %.4f, %llu allocations in the timed steps\n",
           tm_version(), (long long)total, (long long)active, (long long)B, (long long)T, o.threads, o.warmup,
           o.steps, tok_s, ms, loss, (unsigned long long)allocs);
    printf("RESULT impl=tinymoe tokens_per_s=%.1f ms_per_step=%.2f params=%lld threads=%ld steps=%ld batch=%lld "
           "seq=%lld loss=%.4f\n", tok_s, ms, (long long)total, o.threads, o.steps, (long long)B, (long long)T, loss);
    rc = 0;
fail:
    free(host);
    tm_optimizer_free(opt);
    tm_model_free(model);
    tm_ctx_free(ctx);
    return rc;
}
