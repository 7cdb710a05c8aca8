/*
 * generate.c — tmd_generate: prompt -> sampled continuation through a KV cache (generate.h).
 */
#include "generate.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"
#include "stop.h"
#include "util.h"

/* The window of tokens the cache holds, or is about to. */
typedef struct window {
    int32_t *tok; /* [S] */
    int n;        /* tokens in the window */
    int pending;  /* the last `pending` of them are not in the cache yet */
} window;

/* Run the window's pending tokens through the cache and read the logits of the last one. */
static tm_status forward(tm_ctx *ctx, tm_model *model, tm_kv_cache *cache, tm_device dev, window *w, float *logits,
                         int V) {
    int64_t shape[2] = {1, w->pending};
    tm_tensor *tok, *lg, *last;
    tm_status s = tm_tensor_from_host(ctx, TM_I32, 2, shape, dev, TM_I32, w->tok + w->n - w->pending, &tok);
    if (!s) s = tm_model_forward_cached(model, cache, tok, &lg);
    if (!s) s = tm_slice(ctx, lg, 1, w->pending - 1, w->pending, &last);
    if (!s) s = tm_tensor_read(ctx, last, TM_F32, logits, V);
    if (!s) w->pending = 0;
    return s;
}

/* Append a token; a full window first shrinks to its last keep - 1 tokens and the cache
 * restarts, so the surviving tokens and the new one are prefilled at positions from 0. */
static void append(window *w, tm_kv_cache *cache, int S, int keep, int32_t token) {
    if (w->n == S) {
        memmove(w->tok, w->tok + w->n - (keep - 1), sizeof *w->tok * (size_t)(keep - 1));
        w->n = keep - 1;
        w->pending = keep - 1;
        tm_kv_cache_reset(cache);
    }
    w->tok[w->n++] = token;
    w->pending++;
}

/* The text of one token: its bytes through the tokenizer, or the byte itself. */
static int put_token(const tmd_bpe *bpe, int id, FILE *out) {
    const unsigned char *b;
    int n = bpe ? tmd_bpe_token_bytes(bpe, id, &b) : id < 256 ? 1 : 0;
    unsigned char one = (unsigned char)id;
    if (!bpe) b = &one;
    if (n > 0 && fwrite(b, 1, (size_t)n, out) != (size_t)n) return EOF;
    return fflush(out);
}

int tmd_generate(tm_ctx *ctx, tm_model *model, const int32_t *prompt, int n_prompt, int max_new_tokens,
                 const tm_sampler_config *sc, int eot_token, const tmd_bpe *bpe, FILE *out, int64_t *n_generated,
                 char *err, size_t errlen) {
    if (n_generated) *n_generated = 0;
    if (!ctx || !model || !sc || !out)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "generate: %s is NULL",
                        !ctx     ? "ctx"
                        : !model ? "model"
                        : !sc    ? "sampler config"
                                 : "out");
    if (n_prompt < 1 || !prompt)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR,
                        "generate: the prompt is empty (n_prompt = %d); start from at least one token, e.g. "
                        "the end-of-text token",
                        n_prompt);
    if (max_new_tokens < 0)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "generate: max_new_tokens = %d must be >= 0", max_new_tokens);
    if (max_new_tokens == 0) return 0;
    const tm_model_config *c = tm_model_get_config(model);
    int V = c->vocab_size, S = c->max_seq_len, keep = S / 2 > 0 ? S / 2 : 1;
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= V)
            return tmd_fail(err, errlen, TMD_RUNTIME_ERROR,
                            "generate: prompt token %d = %d is outside [0, vocab_size = %d)", i, (int)prompt[i], V);
    /* The model's device is its parameters': embed.weight always exists. */
    tm_device dev = tm_tensor_device(tm_ctx_find(ctx, "embed.weight"));

    window w = {malloc(sizeof(int32_t) * (size_t)S), 0, 0};
    float *logits = malloc(sizeof(float) * (size_t)V);
    tm_kv_cache *cache = NULL;
    int rc = 0;
    tm_status s = TM_OK;
    if (!w.tok || !logits) {
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "generate: out of memory");
        goto done;
    }
    if ((s = tm_kv_cache_new(model, 1, S, &cache))) {
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "generate: %s", tm_ctx_errmsg(ctx));
        goto done;
    }
    w.n = w.pending = n_prompt < S ? n_prompt : S;
    memcpy(w.tok, prompt + n_prompt - w.n, sizeof(int32_t) * (size_t)w.n);
    for (int64_t g = 0;;) {
        int next = 0;
        if (tmd_stop_signal()) break; /* the caller says why */
        s = forward(ctx, model, cache, dev, &w, logits, V);
        if (!s) s = tm_sample_token(ctx, logits, V, sc, (uint64_t)n_prompt + (uint64_t)g, &next);
        /* Copy the message before the reset: it may name arena tensors. */
        if (s)
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "generate: token %lld: %s", (long long)g, tm_ctx_errmsg(ctx));
        tm_ctx_arena_reset(ctx);
        if (rc || next == eot_token) break;
        if (put_token(bpe, next, out) == EOF) {
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "generate: cannot write the sample: %s", strerror(errno));
            break;
        }
        g++;
        if (n_generated) *n_generated = g;
        if (g == max_new_tokens) break;
        append(&w, cache, S, keep, next);
    }
done:
    tm_kv_cache_free(cache);
    free(logits);
    free(w.tok);
    return rc;
}
