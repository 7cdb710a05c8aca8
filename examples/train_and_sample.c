/* train_and_sample.c — the life of a model through the public API: build a small MoE language
 * model from a config, train it with a hand-written loop, save a checkpoint, reload it into a
 * fresh inference-only context, check it computes the same loss, and generate with a KV cache.
 *
 *   cc train_and_sample.c $(pkg-config --cflags --libs tinymoe) \
 *       -Wl,-rpath,$(pkg-config --variable=libdir tinymoe) -o train_and_sample
 *   ./train_and_sample [checkpoint path, default train_and_sample.ckpt]
 *
 * The data is made here: each sequence counts upwards modulo V with a stride of 1, 2 or 3,
 * from a random start. Only the first two tokens reveal the stride, so the model has to look
 * back (attention) and, once it does, every later token is certain: the mean cross-entropy
 * can fall from ln V = 2.77 towards ln(3) / T = 0.07.
 */
#include <stdio.h>
#include <string.h>
#include <tinymoe.h>

enum { V = 16, T = 16, B = 16, STEPS = 100, SEED = 42 };

/* Every call returns a tm_status; on failure the context's message names the op and the
 * offending arguments. `ctx` is the context in scope, `out:` frees what was made so far. */
#define CHECK(expr)                                                                          \
    do {                                                                                     \
        tm_status s_ = (expr);                                                               \
        if (s_ != TM_OK) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #expr,               \
                    tm_status_str(s_), tm_ctx_errmsg(ctx));                                  \
            goto out;                                                                        \
        }                                                                                    \
    } while (0)

static tm_model_config model_config(void) {
    tm_model_config c = tm_model_config_default(); /* start from the defaults, then shrink */
    c.vocab_size = V;
    c.d_model = 32;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2; /* grouped-query attention: two query heads per key/value head */
    c.max_seq_len = T;
    c.moe.ffn_size = 64;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    return c;
}

/* Batch number `batch`: B sequences of T + 1 tokens; inputs are the first T, targets the last
 * T. A fixed LCG makes every run see the same data. */
static tm_status make_batch(tm_ctx *ctx, uint32_t batch, tm_tensor **tokens, tm_tensor **targets) {
    int32_t inp[B * T], tgt[B * T];
    uint32_t r = 2654435761u * (batch + 1);
    for (int b = 0; b < B; b++) {
        r = r * 1664525u + 1013904223u;
        int x = (int)(r >> 24) % V, stride = 1 + (int)(r >> 16) % 3;
        for (int t = 0; t <= T; t++, x = (x + stride) % V) {
            if (t < T) inp[b * T + t] = x;
            if (t > 0) tgt[b * T + t - 1] = x;
        }
    }
    int64_t shape[2] = {B, T};
    tm_status s = tm_tensor_from_host(ctx, TM_I32, 2, shape, tm_cpu(), TM_I32, inp, tokens);
    return s ? s : tm_tensor_from_host(ctx, TM_I32, 2, shape, tm_cpu(), TM_I32, tgt, targets);
}

/* Mean cross-entropy on a held-out batch, without recording a tape. */
static tm_status eval_loss(tm_ctx *ctx, tm_model *model, double *ce) {
    int prev = tm_ctx_set_grad_enabled(ctx, 0);
    tm_tensor *tokens, *targets;
    tm_model_out out;
    tm_status s = make_batch(ctx, 1000000, &tokens, &targets);
    if (!s) s = tm_model_forward(model, tokens, targets, &out);
    if (!s) *ce = out.ce_value;
    tm_ctx_arena_reset(ctx);
    tm_ctx_set_grad_enabled(ctx, prev);
    return s;
}

/* Train from scratch, print the loss before and after, save a checkpoint. */
static int train(const char *path, double *trained_ce) {
    int rc = 1;
    tm_ctx *ctx = NULL;
    tm_model *model = NULL;
    tm_optimizer *opt = NULL;
    if (tm_ctx_new(&ctx, NULL) != TM_OK) { /* no context yet: the message is thread-local */
        fprintf(stderr, "tm_ctx_new: %s\n", tm_last_create_error());
        return 1;
    }
    tm_model_config cfg = model_config();
    CHECK(tm_model_new(ctx, &cfg, TM_F32, tm_cpu(), &model));
    CHECK(tm_model_init(model, SEED)); /* the same seed gives the same weights on any backend */
    tm_adamw_config ac = tm_adamw_config_default();
    ac.lr = 1e-2;
    ac.weight_decay = 0.01;
    CHECK(tm_adamw_new(ctx, &ac, &opt)); /* after the model: it covers the parameters that exist */
    int64_t active, total = tm_model_num_params(model, &active);
    printf("model: %lld parameters, %lld active per token\n", (long long)total, (long long)active);

    double ce0;
    CHECK(eval_loss(ctx, model, &ce0));
    printf("loss before training: %.4f\n", ce0);
    for (uint32_t step = 0; step < STEPS; step++) {
        tm_tensor *tokens, *targets;
        tm_model_out out;
        double gnorm;
        CHECK(make_batch(ctx, step, &tokens, &targets));
        CHECK(tm_model_forward(model, tokens, targets, &out)); /* out.loss: ce + MoE aux loss */
        CHECK(tm_backward(ctx, out.loss));                     /* accumulates into the grads */
        CHECK(tm_ctx_clip_grad_norm(ctx, 1.0, &gnorm));
        CHECK(tm_optimizer_step(opt, -1)); /* -1: the configured lr; pass a scheduled one here */
        CHECK(tm_model_step(model));       /* MoE bookkeeping, once per optimizer step */
        CHECK(tm_ctx_zero_grad(ctx));
        tm_ctx_arena_reset(ctx); /* every temporary of this step (tokens, out.*) dies here */
        if (step % 25 == 0) printf("step %3u: train loss %.4f, grad norm %.3f\n", step, out.ce_value, gnorm);
    }
    CHECK(eval_loss(ctx, model, trained_ce));
    printf("loss after %d steps: %.4f\n", STEPS, *trained_ce);
    if (!(*trained_ce < 0.5 * ce0)) {
        fprintf(stderr, "training did not halve the loss (%.4f -> %.4f)\n", ce0, *trained_ce);
        goto out;
    }
    /* Parameters, MoE buffers and the AdamW state, written atomically; the meta blob is ours. */
    CHECK(tm_ckpt_save(ctx, path, &cfg, sizeof cfg));
    printf("saved %s\n", path);
    rc = 0;
out: /* objects first, the context (which owns every tensor) last */
    tm_optimizer_free(opt);
    tm_model_free(model);
    tm_ctx_free(ctx);
    return rc;
}

/* Rebuild the model from the checkpoint alone, check its loss, and generate. */
static int reload_and_sample(const char *path, double trained_ce) {
    int rc = 1;
    tm_ctx *ctx = NULL;
    tm_model *model = NULL;
    tm_kv_cache *cache = NULL;
    if (tm_ctx_new(&ctx, NULL) != TM_OK) {
        fprintf(stderr, "tm_ctx_new: %s\n", tm_last_create_error());
        return 1;
    }
    /* The config travels in the checkpoint's meta blob (as raw bytes: this program reads its
     * own files; a real one would write a portable format). tm_ckpt_inspect validates the
     * file and lists it without loading anything. */
    tm_ckpt_info *info = NULL;
    tm_model_config cfg;
    CHECK(tm_ckpt_inspect(ctx, path, &info));
    printf("%s: %d tensors, %llu bytes\n", path, info->num_entries, (unsigned long long)info->file_bytes);
    size_t meta_bytes = info->meta_bytes;
    if (meta_bytes == sizeof cfg) memcpy(&cfg, info->meta, sizeof cfg);
    tm_ckpt_info_free(info);
    if (meta_bytes != sizeof cfg) {
        fprintf(stderr, "%s: the meta blob is not a tm_model_config\n", path);
        goto out;
    }
    CHECK(tm_model_new(ctx, &cfg, TM_F32, tm_cpu(), &model)); /* parameters zero until loaded */
    /* No optimizer here, so the file's AdamW state is unknown to this context: skip it. */
    CHECK(tm_ckpt_load_flags(ctx, path, TM_CKPT_SKIP_UNKNOWN, &cfg, sizeof cfg, NULL));
    double ce;
    CHECK(eval_loss(ctx, model, &ce));
    printf("reloaded: loss %.4f (before saving: %.4f)\n", ce, trained_ce);
    if (ce != trained_ce) { /* same weights, inputs and kernels: the same bits */
        fprintf(stderr, "the reloaded model gives another loss\n");
        goto out;
    }

    /* Generation: the prompt once, then one token per call; the cache keeps the keys and
     * values of earlier positions so nothing is recomputed. */
    int32_t seq[T] = {5, 7}; /* the prompt: stride 2 */
    int n = 2, fed = 0, follows = 0; /* tokens in seq, tokens already in the cache */
    tm_sampler_config sc = tm_sampler_config_default();
    sc.temperature = 0; /* greedy (argmax); > 0 samples, optionally within top_k / top_p */
    CHECK(tm_kv_cache_new(model, 1, T, &cache));
    while (n < T) {
        int64_t shape[2] = {1, n - fed};
        tm_tensor *tokens, *logits;
        float lg[T * V];
        int next;
        CHECK(tm_tensor_from_host(ctx, TM_I32, 2, shape, tm_cpu(), TM_I32, seq + fed, &tokens));
        CHECK(tm_model_forward_cached(model, cache, tokens, &logits)); /* [1, n - fed, V] */
        CHECK(tm_tensor_read(ctx, logits, TM_F32, lg, (n - fed) * V));
        /* The next token comes from the logits of the last position; counter n numbers the draw. */
        CHECK(tm_sample_token(ctx, lg + (n - fed - 1) * V, V, &sc, (uint64_t)n, &next));
        follows += next == (seq[n - 1] + 2) % V;
        fed = n;
        seq[n++] = next;
        tm_ctx_arena_reset(ctx); /* logits were a temporary; the cache is not */
    }
    printf("generated:");
    for (int i = 0; i < n; i++) printf(" %d", seq[i]);
    printf("  (%d of %d follow the stride)\n", follows, n - 2);
    rc = follows == n - 2 ? 0 : 1;
    if (rc) fprintf(stderr, "generation did not continue the pattern\n");
out: /* the cache belongs to the model, the model to the context */
    tm_kv_cache_free(cache);
    tm_model_free(model);
    tm_ctx_free(ctx);
    return rc;
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : "train_and_sample.ckpt";
    double ce;
    if (train(path, &ce) || reload_and_sample(path, ce)) return 1;
    puts("ok");
    return 0;
}
