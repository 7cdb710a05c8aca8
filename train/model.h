/*
 * model.h — a small decoder-only transformer LM built from tinymoe's public API only.
 *
 *   tokens -> embedding -> n_layers x [ x += attn(rmsnorm(x)); x += swiglu_mlp(rmsnorm(x)) ]
 *          -> rmsnorm -> lm_head -> logits
 * Attention: causal, grouped-query (n_heads query heads share n_kv_heads key/value heads),
 * rotary positions on q and k. No biases; the LM head is not tied to the embedding.
 */
#ifndef TMD_MODEL_H
#define TMD_MODEL_H

#include "tinymoe.h"

#define TMD_MAX_LAYERS 16

typedef struct tmd_config {
    int vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff;
    double rope_theta, norm_eps;
    double init_std; /* N(0, init_std^2); output projections get init_std / sqrt(2 n_layers) */
} tmd_config;

typedef struct tmd_block {
    tm_tensor *attn_norm, *wq, *wk, *wv, *wo;
    tm_tensor *mlp_norm, *w_gate, *w_up, *w_down;
} tmd_block;

typedef struct tmd_model {
    tmd_config cfg;
    tm_tensor *wte;
    tmd_block blocks[TMD_MAX_LAYERS];
    tm_tensor *norm_f, *lm_head;
} tmd_model;

/* Create and initialise the parameters on dev (names "wte", "blocks.<i>.attn.wq", ...). */
tm_status tmd_model_init(tm_ctx *ctx, tmd_model *m, const tmd_config *cfg, tm_device dev, uint64_t seed);
/* Mean next-token cross-entropy of ids [B, T] against targets [B * T] (0-d tensor). */
tm_status tmd_model_loss(tm_ctx *ctx, const tmd_model *m, tm_tensor *ids, tm_tensor *targets, tm_tensor **loss);
/* Total number of parameter elements of the context. */
int64_t tmd_num_params(const tm_ctx *ctx);

#endif
