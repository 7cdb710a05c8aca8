/*
 * demo.c — `tinymoe demo`: trains the model of model.h on the order-2 Markov source of
 * markov.h and reports, per step, how far the loss is from the source's exact optimum.
 *
 * Every batch is fresh from the source, so the training loss is an unbiased estimate of the
 * expected loss (nothing can be memorised) and the gap to the optimum is a true gap.
 */
#include "demo.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "markov.h"
#include "model.h"
#include "tinymoe.h"

enum { VOCAB = 64, D_MODEL = 64, N_LAYERS = 2, N_HEADS = 4, N_KV_HEADS = 2, D_FF = 176, SEQ = 64, BATCH = 8 };
enum { NEXT_PER_CONTEXT = 3 };
static const double LR_MIN_FRAC = 0.1, CLIP = 1.0;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Linear warmup, then cosine decay to LR_MIN_FRAC * lr_max at the last step. */
static double lr_at(double lr_max, int step, int steps) {
    int warm = steps / 10 < 20 ? steps / 10 : 20;
    if (step < warm) return lr_max * (step + 1) / warm;
    double p = steps - warm > 1 ? (double)(step - warm) / (steps - warm - 1) : 1.0;
    return lr_max * (LR_MIN_FRAC + (1.0 - LR_MIN_FRAC) * 0.5 * (1.0 + cos(M_PI * p)));
}

typedef struct {
    tm_ctx *ctx;
    tmd_model model;
    tm_optimizer *opt;
    markov src;
    tm_device dev;
    int32_t *seq, *ids, *tgt; /* [BATCH, SEQ + 1], [BATCH, SEQ], [BATCH * SEQ] */
} demo;

/* One step: sample a batch, forward, backward, clip, AdamW. */
static tm_status step(demo *d, uint64_t seed, int s, double lr, double *loss_out, double *norm_out) {
    tm_ctx *ctx = d->ctx;
    for (int b = 0; b < BATCH; b++) {
        int32_t *row = d->seq + b * (SEQ + 1);
        markov_sample(&d->src, seed, (uint64_t)s * BATCH + (uint64_t)b, row, SEQ + 1);
        for (int t = 0; t < SEQ; t++) {
            d->ids[b * SEQ + t] = row[t];
            d->tgt[b * SEQ + t] = row[t + 1];
        }
    }
    int64_t sbt[2] = {BATCH, SEQ}, sn[1] = {BATCH * SEQ};
    tm_tensor *ids, *tgt, *loss;
    tm_status st;
    if ((st = tm_tensor_from_host(ctx, TM_I32, 2, sbt, d->dev, TM_I32, d->ids, &ids))) return st;
    if ((st = tm_tensor_from_host(ctx, TM_I32, 1, sn, d->dev, TM_I32, d->tgt, &tgt))) return st;
    if ((st = tmd_model_loss(ctx, &d->model, ids, tgt, &loss))) return st;
    if ((st = tm_backward(ctx, loss))) return st;
    if ((st = tm_ctx_clip_grad_norm(ctx, CLIP, norm_out))) return st;
    if ((st = tm_optimizer_step(d->opt, lr))) return st;
    if ((st = tm_ctx_zero_grad(ctx))) return st;
    float l = 0;
    if ((st = tm_tensor_read(ctx, loss, TM_F32, &l, 1))) return st;
    *loss_out = l;
    tm_ctx_arena_reset(ctx);
    return TM_OK;
}

static int fail(demo *d, const char *what, tm_status s) {
    fprintf(stderr, "tinymoe demo: %s failed (%s): %s\n", what, tm_status_str(s), tm_ctx_errmsg(d->ctx));
    return 1;
}

static int run(demo *d, const tmd_demo_opts *o) {
    tm_status s;
    tm_ctx_options co = tm_ctx_options_default();
    co.num_threads = o->threads;
    co.cuda_device = o->cuda ? 0 : -1;
    if ((s = tm_ctx_new(&d->ctx, &co))) {
        fprintf(stderr, "tinymoe demo: cannot create a context (%s): %s\n", tm_status_str(s), tm_last_create_error());
        return 1;
    }
    d->dev = o->cuda ? tm_cuda(0) : tm_cpu();

    double t0 = now_s();
    if (markov_init(&d->src, VOCAB, NEXT_PER_CONTEXT, o->seed)) {
        fprintf(stderr, "tinymoe demo: out of memory building the data source\n");
        return 1;
    }
    double opt_loss = markov_optimal_loss(&d->src, SEQ);
    double t_src = now_s() - t0;

    tmd_config mc = {.vocab = VOCAB, .d_model = D_MODEL, .n_layers = N_LAYERS, .n_heads = N_HEADS,
                     .n_kv_heads = N_KV_HEADS, .d_ff = D_FF, .rope_theta = 10000.0, .norm_eps = 1e-5,
                     .init_std = 0.02};
    if ((s = tmd_model_init(d->ctx, &d->model, &mc, d->dev, o->seed))) return fail(d, "model init", s);
    tm_adamw_config ac = tm_adamw_config_default();
    ac.lr = o->lr;
    ac.beta2 = 0.95;
    ac.weight_decay = 0.1;
    if ((s = tm_adamw_new(d->ctx, &ac, &d->opt))) return fail(d, "tm_adamw_new", s);
    d->seq = malloc(sizeof *d->seq * BATCH * (SEQ + 1));
    d->ids = malloc(sizeof *d->ids * BATCH * SEQ);
    d->tgt = malloc(sizeof *d->tgt * BATCH * SEQ);
    if (!d->seq || !d->ids || !d->tgt) {
        fprintf(stderr, "tinymoe demo: out of memory\n");
        return 1;
    }

    printf("tinymoe %s demo: decoder-only transformer LM on a synthetic order-2 Markov source\n", tm_version());
    printf("model : vocab %d, d_model %d, %d layers, %d query / %d kv heads, swiglu d_ff %d, %lld parameters\n",
           VOCAB, D_MODEL, N_LAYERS, N_HEADS, N_KV_HEADS, D_FF, (long long)tmd_num_params(d->ctx));
    printf("data  : %d x %d contexts, %d allowed next tokens each (flat Dirichlet probabilities), seed %llu\n",
           VOCAB, VOCAB, NEXT_PER_CONTEXT, (unsigned long long)o->seed);
    printf("        exact optimum %.4f nats/token = (H(x1|x0) %.4f + %d x H(x2|x0,x1) %.4f) / %d,\n"
           "        from the transition table and its stationary distribution (%d power iterations,\n"
           "        residual %.1e, %.0f ms); log(vocab) = %.4f\n",
           opt_loss, d->src.h1, SEQ - 1, d->src.h2, SEQ, d->src.iters, d->src.residual, 1e3 * t_src, log((double)VOCAB));
    printf("train : batch %d x seq %d, AdamW (peak lr %.0e, warmup + cosine, betas 0.9/0.95, wd 0.1), clip %.1f, "
           "%d steps, device %s\n\n", BATCH, SEQ, o->lr, CLIP, o->steps, o->cuda ? "cuda:0" : "cpu");
    printf("rows: loss, grad_norm (before clipping) and ms/step are means over the steps since the previous row\n");
    printf("%6s  %8s  %8s  %9s  %8s  %8s  %9s\n", "step", "loss", "optimum", "grad_norm", "lr", "ms/step", "tokens/s");

    enum { TAIL = 10 };
    double tail[TAIL] = {0}, first_loss = 0, t_train = now_s();
    double sum_loss = 0, sum_norm = 0, sum_dt = 0;
    int n_row = 0;
    uint64_t allocs_after_first = 0;
    for (int i = 0; i < o->steps; i++) {
        double lr = lr_at(o->lr, i, o->steps), loss = 0, norm = 0, ts = now_s();
        if ((s = step(d, o->seed, i, lr, &loss, &norm))) return fail(d, "training step", s);
        double dt = now_s() - ts;
        if (i == 0) {
            first_loss = loss;
            allocs_after_first = tm_ctx_alloc_count(d->ctx);
        }
        tail[i % TAIL] = loss;
        sum_loss += loss;
        sum_norm += norm;
        sum_dt += dt;
        n_row++;
        if (i == 0 || (i + 1) % o->log_every == 0 || i + 1 == o->steps) {
            printf("%6d  %8.4f  %8.4f  %9.4f  %8.2e  %8.2f  %9.0f\n", i + 1, sum_loss / n_row, opt_loss,
                   sum_norm / n_row, lr, 1e3 * sum_dt / n_row, (double)n_row * BATCH * SEQ / sum_dt);
            fflush(stdout);
            sum_loss = sum_norm = sum_dt = 0;
            n_row = 0;
        }
    }
    double elapsed = now_s() - t_train;
    int n_tail = o->steps < TAIL ? o->steps : TAIL;
    double mean = 0;
    for (int i = 0; i < n_tail; i++) mean += tail[i];
    mean /= n_tail;
    printf("\nloss %.4f -> %.4f (mean of the last %d steps); optimum %.4f; gap to optimum %.4f nats/token\n",
           first_loss, mean, n_tail, opt_loss, mean - opt_loss);
    printf("%d steps in %.2f s (%.0f tokens/s); system allocations after step 1: %llu\n", o->steps, elapsed,
           (double)o->steps * BATCH * SEQ / elapsed,
           (unsigned long long)(tm_ctx_alloc_count(d->ctx) - allocs_after_first));
    return 0;
}

int tmd_demo(const tmd_demo_opts *o) {
    demo d = {0};
    int rc = run(&d, o);
    free(d.seq);
    free(d.ids);
    free(d.tgt);
    markov_free(&d.src);
    tm_optimizer_free(d.opt);
    tm_ctx_free(d.ctx);
    return rc;
}
