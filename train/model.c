/* model.c — the demo's transformer LM; see model.h. */
#include "model.h"

#include <math.h>
#include <stdio.h>

#define TRY(expr)                         \
    do {                                  \
        tm_status s_ = (expr);            \
        if (s_ != TM_OK) return s_;       \
    } while (0)

static tm_status param(tm_ctx *ctx, tm_device dev, uint64_t seed, const char *name, int ndim, int64_t d0,
                       int64_t d1, double std, tm_tensor **out) {
    int64_t shape[2] = {d0, d1};
    TRY(tm_param_new(ctx, name, TM_F32, ndim, shape, dev, out));
    /* std 0: a norm gain, which starts at 1 so the block starts as a plain normalisation. */
    if (std == 0.0) return tm_tensor_fill(ctx, *out, 1.0);
    return tm_tensor_init_normal(ctx, *out, seed, NULL, 0.0, std);
}

tm_status tmd_model_init(tm_ctx *ctx, tmd_model *m, const tmd_config *cfg, tm_device dev, uint64_t seed) {
    const tmd_config *c = cfg;
    m->cfg = *cfg;
    int64_t C = c->d_model, hd = C / c->n_heads, kv = hd * c->n_kv_heads;
    /* GPT-2's residual scaling: each block adds two projections into the residual stream, so
     * their std shrinks by sqrt(2 n_layers) to keep the stream's variance independent of depth. */
    double std = c->init_std, std_out = c->init_std / sqrt(2.0 * c->n_layers);
    TRY(param(ctx, dev, seed, "wte", 2, c->vocab, C, std, &m->wte));
    for (int l = 0; l < c->n_layers; l++) {
        tmd_block *b = &m->blocks[l];
        char n[64];
#define P(field, suffix, nd, d0, d1, s)                                  \
    snprintf(n, sizeof n, "blocks.%d.%s", l, suffix);                    \
    TRY(param(ctx, dev, seed, n, nd, d0, d1, s, &b->field))
        P(attn_norm, "attn_norm", 1, C, 0, 0.0);
        P(wq, "attn.wq", 2, C, C, std);
        P(wk, "attn.wk", 2, C, kv, std);
        P(wv, "attn.wv", 2, C, kv, std);
        P(wo, "attn.wo", 2, C, C, std_out);
        P(mlp_norm, "mlp_norm", 1, C, 0, 0.0);
        P(w_gate, "mlp.w_gate", 2, C, c->d_ff, std);
        P(w_up, "mlp.w_up", 2, C, c->d_ff, std);
        P(w_down, "mlp.w_down", 2, c->d_ff, C, std_out);
#undef P
    }
    TRY(param(ctx, dev, seed, "norm_f", 1, C, 0, 0.0, &m->norm_f));
    TRY(param(ctx, dev, seed, "lm_head", 2, C, c->vocab, std, &m->lm_head));
    return TM_OK;
}

static tm_status attention(tm_ctx *ctx, const tmd_config *c, const tmd_block *b, tm_tensor *x, tm_tensor **out) {
    int64_t B = tm_tensor_dim(x, 0), T = tm_tensor_dim(x, 1), C = c->d_model, hd = C / c->n_heads;
    int64_t sq[4] = {B, T, c->n_heads, hd}, skv[4] = {B, T, c->n_kv_heads, hd}, sc[3] = {B, T, C};
    tm_tensor *h, *q, *k, *v, *a;
    TRY(tm_rmsnorm(ctx, x, b->attn_norm, c->norm_eps, &h));
    TRY(tm_matmul(ctx, h, b->wq, 0, 0, &q));   // (B, T, C)
    TRY(tm_matmul(ctx, h, b->wk, 0, 0, &k));   // (B, T, Hkv * hd)
    TRY(tm_matmul(ctx, h, b->wv, 0, 0, &v));
    TRY(tm_reshape(ctx, q, 4, sq, &q));        // (B, T, H, hd)
    TRY(tm_reshape(ctx, k, 4, skv, &k));       // (B, T, Hkv, hd)
    TRY(tm_reshape(ctx, v, 4, skv, &v));
    TRY(tm_rope(ctx, q, 0, c->rope_theta, &q));
    TRY(tm_rope(ctx, k, 0, c->rope_theta, &k));
    TRY(tm_attention(ctx, q, k, v, 0.0, &a));  // (B, T, H, hd)
    TRY(tm_reshape(ctx, a, 3, sc, &a));        // (B, T, C)
    return tm_matmul(ctx, a, b->wo, 0, 0, out);
}

static tm_status mlp(tm_ctx *ctx, const tmd_config *c, const tmd_block *b, tm_tensor *x, tm_tensor **out) {
    tm_tensor *h, *g, *u, *a;
    TRY(tm_rmsnorm(ctx, x, b->mlp_norm, c->norm_eps, &h));
    TRY(tm_matmul(ctx, h, b->w_gate, 0, 0, &g)); // (B, T, F)
    TRY(tm_matmul(ctx, h, b->w_up, 0, 0, &u));   // (B, T, F)
    TRY(tm_swiglu(ctx, g, u, &a));
    return tm_matmul(ctx, a, b->w_down, 0, 0, out); // (B, T, C)
}

tm_status tmd_model_loss(tm_ctx *ctx, const tmd_model *m, tm_tensor *ids, tm_tensor *targets, tm_tensor **loss) {
    const tmd_config *c = &m->cfg;
    tm_tensor *x, *y, *logits;
    TRY(tm_embedding(ctx, m->wte, ids, &x)); // (B, T, C)
    for (int l = 0; l < c->n_layers; l++) {
        TRY(attention(ctx, c, &m->blocks[l], x, &y));
        TRY(tm_add(ctx, x, y, &x));
        TRY(mlp(ctx, c, &m->blocks[l], x, &y));
        TRY(tm_add(ctx, x, y, &x));
    }
    TRY(tm_rmsnorm(ctx, x, m->norm_f, c->norm_eps, &x));
    TRY(tm_matmul(ctx, x, m->lm_head, 0, 0, &logits)); // (B, T, V)
    int64_t s2[2] = {tm_tensor_numel(ids), c->vocab};
    TRY(tm_reshape(ctx, logits, 2, s2, &logits));     // (B*T, V)
    return tm_cross_entropy(ctx, logits, targets, -1, loss);
}

int64_t tmd_num_params(const tm_ctx *ctx) {
    int64_t n = 0;
    for (int i = 0; i < tm_ctx_num_params(ctx); i++) n += tm_tensor_numel(tm_ctx_param(ctx, i));
    return n;
}
