/*
 * model.c — a Mixtral-style decoder-only language model, built from the public ops (plus the
 * internal error and data-parallel helpers of layers/moe_internal.h):
 *
 *   tokens [B,T] --embedding--> x [B*T,H]
 *   n_layers x:  x += wo( attention( rope(rmsnorm(x) wq), rope(rmsnorm(x) wk), rmsnorm(x) wv ) )
 *                x += ffn(rmsnorm(x))        ffn = MoE block, or a dense SwiGLU for the first
 *                                            first_k_dense layers
 *   rmsnorm --lm_head (or embed.weight^T when tied)--> logits [B,T,V]
 *   loss = mean CE + the MoE layers' aux / seq-aux / z losses (coefficients applied there)
 *
 * Each residual add is fused with the norm that reads its sum (tm_add_rmsnorm: ffn_norm after
 * the attention's add, the next layer's attn_norm or the final norm after the FFN's); only
 * layer 0's attn_norm stands alone. Same bits as separate adds and norms.
 *
 * The residual stream is kept as one [B*T, H] matrix so every projection is a single GEMM of
 * B*T rows; only rope and attention see the [B,T,heads,D] view of it (a reshape of contiguous
 * memory, no copy). Weights are stored [in, out] so activations multiply from the left.
 *
 * Everything a forward needs on the host (per-layer statistics) lives in the model, allocated
 * once in tm_model_new; the per-step tensors come from the context's arena, so a steady-state
 * training step makes no system allocation.
 *
 * Host round trips: tm_model_forward reads back once, at its end. The tokens and targets are
 * checked on the device (tm_index_check: invalid ids are replaced, the first one recorded), the
 * loss, the cross-entropy, the check results and every MoE layer's packed statistics are copied
 * into one i64 tensor, and that tensor is read; only then, with the ids known to be valid, do
 * the MoE layers' running counts for the expert-bias update grow (on the device). With the
 * grouped MoE strategy each MoE layer adds its permute's row count: n_moe_layers + 1 in all.
 *
 * tm_model_forward_cached runs the same blocks (one function, `block`, serves both paths) on a
 * few new positions of a sequence whose earlier keys and values sit in a tm_kv_cache
 * (layers/kv_cache.c): rope starts at the cache's length, the new keys and values are written
 * into the cache and the queries attend to all of it (tm_attention's Tk > Tq causal offset).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cache.h"
#include "moe_internal.h"

typedef struct tm__layer {
    tm_tensor *attn_norm, *wq, *wk, *wv, *wo;
    tm_tensor *ffn_norm;
    tm_tensor *mlp_w0, *mlp_w1, *mlp_wo; /* dense layers */
    tm_moe *moe;                         /* MoE layers */
} tm__layer;

struct tm_model {
    tm_ctx *ctx;
    tm_model_config cfg; /* as given, with moe.hidden_size = d_model */
    tm_dtype dtype;
    tm_device dev;
    tm_tensor *embed, *norm, *lm_head; /* lm_head NULL when tied */
    tm__layer *layers;                 /* [n_layers] */
    int n_moe;
    int64_t *tokens_per_expert;        /* [n_moe * E], handed out by tm_model_forward */
    tm_tensor *pin;                    /* ZeRO-3: the norm weight gathered before its layer (or the
                                        * head) runs, whose use that one ends (`pinned`) */
};

tm_model_config tm_model_config_default(void) {
    tm_model_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = 257;
    c.d_model = 128;
    c.n_layers = 4;
    c.n_heads = 4;
    c.n_kv_heads = 4;
    c.max_seq_len = 128;
    c.rope_theta = 10000.0;
    c.norm_eps = 1e-5;
    c.tie_embeddings = 0;
    c.first_k_dense = 0;
    c.dense_ffn_size = 0; /* 4 * d_model */
    c.init_std = 0.02;
    c.moe = tm_moe_config_default();
    c.moe.hidden_size = c.d_model;
    c.moe.ffn_size = 256;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    c.moe.router.score_function = TM_SCORE_SOFTMAX;
    c.moe.router.use_pre_softmax = 1;
    c.moe.aux_loss_coeff = 1e-2;
    return c;
}

#define BAD(...) tm__err(ctx, TM_ERR_INVALID_ARG, __VA_ARGS__)

/* The MoE block's config as the model builds it: hidden_size always follows d_model. */
static tm_moe_config moe_config_of(const tm_model_config *c) {
    tm_moe_config m = c->moe;
    m.hidden_size = c->d_model;
    return m;
}

tm_status tm_model_config_check(tm_ctx *ctx, const tm_model_config *c) {
    if (!c) return BAD("model config: cfg is NULL");
    if (c->vocab_size < 1) return BAD("model config: vocab_size = %d must be >= 1", c->vocab_size);
    if (c->d_model < 1) return BAD("model config: d_model = %d must be >= 1", c->d_model);
    if (c->n_layers < 1) return BAD("model config: n_layers = %d must be >= 1", c->n_layers);
    if (c->n_heads < 1) return BAD("model config: n_heads = %d must be >= 1", c->n_heads);
    if (c->d_model % c->n_heads)
        return BAD("model config: n_heads = %d does not divide d_model = %d", c->n_heads, c->d_model);
    if ((c->d_model / c->n_heads) % 2)
        return BAD("model config: head dim d_model / n_heads = %d / %d = %d must be even (rotary embeddings rotate "
                   "pairs)", c->d_model, c->n_heads, c->d_model / c->n_heads);
    if (c->n_kv_heads < 1) return BAD("model config: n_kv_heads = %d must be >= 1", c->n_kv_heads);
    if (c->n_heads % c->n_kv_heads)
        return BAD("model config: n_kv_heads = %d does not divide n_heads = %d", c->n_kv_heads, c->n_heads);
    if (c->max_seq_len < 1) return BAD("model config: max_seq_len = %d must be >= 1", c->max_seq_len);
    if (!(c->rope_theta > 0) || !isfinite(c->rope_theta))
        return BAD("model config: rope_theta = %g must be finite and > 0", c->rope_theta);
    if (!(c->norm_eps >= 0) || !isfinite(c->norm_eps))
        return BAD("model config: norm_eps = %g must be finite and >= 0", c->norm_eps);
    if (c->tie_embeddings != 0 && c->tie_embeddings != 1)
        return BAD("model config: tie_embeddings = %d must be 0 or 1", c->tie_embeddings);
    if (c->first_k_dense < 0 || c->first_k_dense > c->n_layers)
        return BAD("model config: first_k_dense = %d must be in [0, n_layers = %d]", c->first_k_dense, c->n_layers);
    if (c->dense_ffn_size < 0)
        return BAD("model config: dense_ffn_size = %d must be >= 0 (0: 4 * d_model)", c->dense_ffn_size);
    if (!(c->init_std >= 0) || !isfinite(c->init_std))
        return BAD("model config: init_std = %g must be finite and >= 0", c->init_std);
    /* The MoE block reports "moe config: <field> = ..."; re-issue it as "model config:
     * moe.<field> = ..." so the name is the model config's own key. The message is copied
     * first: tm__err writes into the buffer tm_ctx_errmsg points at. */
    tm_moe_config moe = moe_config_of(c);
    tm_status s = tm_moe_config_check(ctx, &moe);
    if (s != TM_OK && ctx) {
        char msg[512];
        const char *m = tm_ctx_errmsg(ctx), *prefix = "moe config: ";
        snprintf(msg, sizeof msg, "%s", strncmp(m, prefix, strlen(prefix)) ? m : m + strlen(prefix));
        return tm__err(ctx, s, "model config: moe.%s", msg);
    }
    return s;
}

/* ---- construction ------------------------------------------------------------------------ */

static tm_status param(tm_model *m, const char *name, int ndim, int64_t d0, int64_t d1, tm_tensor **out) {
    int64_t shape[2] = {d0, d1};
    return tm_param_new(m->ctx, name, m->dtype, ndim, shape, m->dev, out);
}

/* "layers.<l>.<suffix>" */
static tm_status layer_param(tm_model *m, int l, const char *suffix, int ndim, int64_t d0, int64_t d1,
                             tm_tensor **out) {
    char name[128];
    snprintf(name, sizeof name, "layers.%d.%s", l, suffix);
    return param(m, name, ndim, d0, d1, out);
}

/* Units (tinymoe.h, "Units"; ZeRO-3 gathers one at a time), after those of the parameters made
 * before the model (another model's, the caller's): base the embedding, base + l + 1 layer l
 * (its norms, attention, FFN or MoE block), base + n_layers + 1 the final norm and lm_head. */
static tm_status build_units(tm_model *m) {
    int base = tm__param_unit_end(m->ctx);
    const tm_model_config *c = &m->cfg;
    int64_t H = c->d_model, V = c->vocab_size, D = H / c->n_heads;
    int64_t Hq = c->n_heads * D, Hkv = c->n_kv_heads * D, F = c->dense_ffn_size ? c->dense_ffn_size : 4 * (int64_t)c->d_model;
    TM__TRY(tm_ctx_set_param_unit(m->ctx, base));
    TM__TRY(param(m, "embed.weight", 2, V, H, &m->embed));
    for (int l = 0; l < c->n_layers; l++) {
        tm__layer *L = &m->layers[l];
        TM__TRY(tm_ctx_set_param_unit(m->ctx, base + l + 1));
        TM__TRY(layer_param(m, l, "attn_norm.weight", 1, H, 0, &L->attn_norm));
        TM__TRY(layer_param(m, l, "attn.wq", 2, H, Hq, &L->wq));
        TM__TRY(layer_param(m, l, "attn.wk", 2, H, Hkv, &L->wk));
        TM__TRY(layer_param(m, l, "attn.wv", 2, H, Hkv, &L->wv));
        TM__TRY(layer_param(m, l, "attn.wo", 2, Hq, H, &L->wo));
        TM__TRY(layer_param(m, l, "ffn_norm.weight", 1, H, 0, &L->ffn_norm));
        if (l < c->first_k_dense) {
            TM__TRY(layer_param(m, l, "mlp.w0", 2, H, F, &L->mlp_w0));
            TM__TRY(layer_param(m, l, "mlp.w1", 2, H, F, &L->mlp_w1));
            TM__TRY(layer_param(m, l, "mlp.wo", 2, F, H, &L->mlp_wo));
        } else {
            char prefix[64];
            snprintf(prefix, sizeof prefix, "layers.%d.moe", l);
            TM__TRY(tm_moe_new(m->ctx, prefix, &c->moe, m->dtype, m->dev, &L->moe));
        }
    }
    TM__TRY(tm_ctx_set_param_unit(m->ctx, base + c->n_layers + 1));
    TM__TRY(param(m, "norm.weight", 1, H, 0, &m->norm));
    if (!c->tie_embeddings) TM__TRY(param(m, "lm_head.weight", 2, H, V, &m->lm_head));
    return TM_OK;
}

static tm_status build(tm_model *m) {
    int unit = tm_ctx_param_unit(m->ctx); /* the caller's, restored */
    tm_status s = build_units(m);
    (void)tm_ctx_set_param_unit(m->ctx, unit);
    return s;
}

tm_status tm_model_new(tm_ctx *ctx, const tm_model_config *cfg, tm_dtype dtype, tm_device dev, tm_model **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return BAD("tm_model_new: out is NULL");
    TM__TRY(tm_model_config_check(ctx, cfg));
    if (!tm__is_float(dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "tm_model_new: dtype %s is not a float dtype", tm_dtype_name(dtype));
    tm_model_config c = *cfg;
    c.moe = moe_config_of(cfg);
    int n_moe = c.n_layers - c.first_k_dense, E = c.moe.router.num_experts;
    /* One host block: the model, its layers, the per-forward expert counts. */
    size_t layers_off = (sizeof(tm_model) + 63) & ~(size_t)63;
    size_t tpe_off = (layers_off + sizeof(tm__layer) * (size_t)c.n_layers + 63) & ~(size_t)63;
    size_t nbytes = tpe_off + sizeof(int64_t) * (size_t)n_moe * (size_t)E + 1;
    char *mem = tm__host_alloc(ctx, nbytes);
    if (!mem) return tm__err(ctx, TM_ERR_NOMEM, "tm_model_new: out of host memory (%zu bytes)", nbytes);
    memset(mem, 0, nbytes);
    tm_model *m = (tm_model *)mem;
    m->ctx = ctx;
    m->cfg = c;
    m->dtype = dtype;
    m->dev = dev;
    m->layers = (tm__layer *)(mem + layers_off);
    m->n_moe = n_moe;
    m->tokens_per_expert = (int64_t *)(mem + tpe_off);
    /* Every parameter placed first, then each bucket allocated once at its exact size (rather
     * than grown by doubling as the parameters come: tinymoe.h, "Deferred placement"). */
    int defer = !tm_ctx_params_deferred(ctx);
    tm_status s = defer ? tm_ctx_defer_params(ctx) : TM_OK;
    if (s == TM_OK) s = build(m);
    if (defer && tm_ctx_params_deferred(ctx)) {
        /* also after a failed build: the parameters made stay usable */
        char msg[512];
        snprintf(msg, sizeof msg, "%s", tm_ctx_errmsg(ctx));
        tm_status ms = tm_ctx_materialize_params(ctx);
        if (s != TM_OK && ms == TM_OK) tm__err(ctx, s, "%s", msg); /* the build's message stays */
        if (s == TM_OK) s = ms;
    }
    if (s != TM_OK) {
        /* Parameters already made stay with the context (there is no way to remove one). */
        tm_model_free(m);
        return s;
    }
    *out = m;
    return TM_OK;
}

void tm_model_free(tm_model *m) {
    if (!m) return;
    for (int l = 0; l < m->cfg.n_layers; l++) tm_moe_free(m->layers[l].moe);
    tm__host_free(m->ctx, m);
}

const tm_model_config *tm_model_get_config(const tm_model *m) { return m ? &m->cfg : NULL; }
tm_ctx *tm__model_ctx(const tm_model *m) { return m->ctx; }
tm_dtype tm__model_dtype(const tm_model *m) { return m->dtype; }
tm_device tm__model_device(const tm_model *m) { return m->dev; }

tm_status tm_model_init(tm_model *m, uint64_t seed) {
    if (!m) return TM_ERR_INVALID_ARG;
    tm_ctx *ctx = m->ctx;
    const tm_model_config *c = &m->cfg;
    /* GPT-2's residual scaling: each layer adds two projections into the residual stream, so
     * their std shrinks by sqrt(2 n_layers) to keep the stream's variance independent of depth. */
    double std = c->init_std, out_std = c->init_std / sqrt(2.0 * c->n_layers);
    TM__TRY(tm__param_init_normal_replicated(ctx, m->embed, seed, 0, std));
    for (int l = 0; l < c->n_layers; l++) {
        tm__layer *L = &m->layers[l];
        TM__TRY(tm_tensor_fill(ctx, L->attn_norm, 1.0));
        TM__TRY(tm__param_init_normal_replicated(ctx, L->wq, seed, 0, std));
        TM__TRY(tm__param_init_normal_replicated(ctx, L->wk, seed, 0, std));
        TM__TRY(tm__param_init_normal_replicated(ctx, L->wv, seed, 0, std));
        TM__TRY(tm__param_init_normal_replicated(ctx, L->wo, seed, 0, out_std));
        TM__TRY(tm_tensor_fill(ctx, L->ffn_norm, 1.0));
        if (L->moe) {
            TM__TRY(tm_moe_init(L->moe, seed, std, out_std));
        } else {
            TM__TRY(tm__param_init_normal_replicated(ctx, L->mlp_w0, seed, 0, std));
            TM__TRY(tm__param_init_normal_replicated(ctx, L->mlp_w1, seed, 0, std));
            TM__TRY(tm__param_init_normal_replicated(ctx, L->mlp_wo, seed, 0, out_std));
        }
    }
    TM__TRY(tm_tensor_fill(ctx, m->norm, 1.0));
    if (m->lm_head) TM__TRY(tm__param_init_normal_replicated(ctx, m->lm_head, seed, 0, std));
    return TM_OK;
}

int64_t tm_model_num_params(const tm_model *m, int64_t *active_per_token) {
    if (!m) {
        if (active_per_token) *active_per_token = 0;
        return 0;
    }
    const tm_model_config *c = &m->cfg;
    int64_t total = tm_tensor_numel(m->embed) + tm_tensor_numel(m->norm) + tm_tensor_numel(m->lm_head);
    int64_t routed = 0, routed_active = 0; /* routed expert weights, all / as seen by one token */
    const char *per_layer[] = {"gate.weight", "shared.w0", "shared.w1", "shared.wo"};
    const char *experts[] = {"experts.w0", "experts.w1", "experts.wo"};
    for (int l = 0; l < c->n_layers; l++) {
        const tm__layer *L = &m->layers[l];
        const tm_tensor *own[] = {L->attn_norm, L->wq, L->wk, L->wv, L->wo, L->ffn_norm, L->mlp_w0, L->mlp_w1, L->mlp_wo};
        for (size_t i = 0; i < sizeof own / sizeof *own; i++) total += tm_tensor_numel(own[i]);
        if (!L->moe) continue;
        for (size_t i = 0; i < sizeof per_layer / sizeof *per_layer; i++)
            total += tm_tensor_numel(tm_moe_tensor(L->moe, per_layer[i]));
        for (size_t i = 0; i < sizeof experts / sizeof *experts; i++) {
            /* the logical [E, ...] tensor, also where this rank holds a shard of the experts */
            tm_tensor *w = tm_moe_tensor(L->moe, experts[i]);
            tm_param_info pi;
            int64_t n = tm_tensor_numel(w);
            if (tm_tensor_dim(w, 0) > 0 && tm_param_get_info(w, &pi) == TM_OK)
                n = n / tm_tensor_dim(w, 0) * pi.opts.logical_shape[0];
            routed += n;
            routed_active += n / c->moe.router.num_experts * c->moe.router.topk;
        }
    }
    total += routed;
    if (active_per_token) *active_per_token = total - routed + routed_active;
    return total;
}

/* ---- forward ----------------------------------------------------------------------------- */

/* x [N,H] -> swiglu(x w0, x w1) wo [N,H] */
static tm_status swiglu_mlp(tm_ctx *ctx, tm_tensor *x, tm_tensor *w0, tm_tensor *w1, tm_tensor *wo, tm_tensor **out) {
    tm_tensor *g, *u, *a;
    TM__TRY(tm_matmul(ctx, x, w0, 0, 0, &g)); // (N, F)
    TM__TRY(tm_matmul(ctx, x, w1, 0, 0, &u)); // (N, F)
    TM__TRY(tm_swiglu(ctx, g, u, &a));
    return tm_matmul(ctx, a, wo, 0, 0, out);  // (N, H)
}

/* Causal GQA self-attention of h [B*T,H] -> [B*T,H] (before the residual add). Without a
 * cache the T rows are whole sequences (positions 0..T-1). With one they are positions
 * [len, len + T): their keys and values join the cache first, and the queries attend to all
 * len + T cached positions (tm_attention lets query i see keys j <= i + len). */
static tm_status self_attention(tm_model *m, int l, const tm__layer *L, tm_tensor *h, int64_t B, int64_t T,
                                tm_kv_cache *kv, tm_tensor **out) {
    tm_ctx *ctx = m->ctx;
    const tm_model_config *c = &m->cfg;
    int64_t D = c->d_model / c->n_heads, pos = kv ? kv->len : 0;
    int64_t sq[4] = {B, T, c->n_heads, D}, skv[4] = {B, T, c->n_kv_heads, D}, s2[2] = {B * T, c->n_heads * D};
    tm_tensor *q, *k, *v, *a;
    TM__TRY(tm_matmul(ctx, h, L->wq, 0, 0, &q)); // (B*T, Hq*D)
    TM__TRY(tm_matmul(ctx, h, L->wk, 0, 0, &k)); // (B*T, Hkv*D)
    TM__TRY(tm_matmul(ctx, h, L->wv, 0, 0, &v)); // (B*T, Hkv*D)
    TM__TRY(tm_reshape(ctx, q, 4, sq, &q));      // (B, T, Hq, D)
    TM__TRY(tm_reshape(ctx, k, 4, skv, &k));     // (B, T, Hkv, D)
    TM__TRY(tm_reshape(ctx, v, 4, skv, &v));
    TM__TRY(tm_rope(ctx, q, pos, c->rope_theta, &q));
    TM__TRY(tm_rope(ctx, k, pos, c->rope_theta, &k));
    if (kv) TM__TRY(tm__kv_cache_write(kv, l, k, v, &k, &v)); // (B, len+T, Hkv, D) views of the cache
    TM__TRY(tm_attention(ctx, q, k, v, 0.0, &a)); // (B, T, Hq, D)
    TM__TRY(tm_reshape(ctx, a, 2, s2, &a));       // (B*T, Hq*D)
    return tm_matmul(ctx, a, L->wo, 0, 0, out);   // (B*T, H)
}

/* Decoder block l on the residual stream x [B*T,H], given h = attn_norm(x): x + attn(h), then
 * + ffn(norm(.)). Each residual add is fused with the norm after it (tm_add_rmsnorm: the bits
 * of tm_add and tm_rmsnorm, one kernel per direction on CUDA), so the block stops before its
 * last add: *x1 = x + attn(h) and *y = ffn(ffn_norm(*x1)), whose sum the caller fuses with the
 * next norm (norm_after). st (may be NULL) receives the MoE block's statistics; untouched
 * on dense layers. */
/* ZeRO-3: a copy of layer L whose weights are all-gathered (tm__param_use: L's own tensors
 * otherwise), and their memory given back after the layer's forward (the backward gathers them
 * again), but for the last layers' (`kept`). The MoE block gathers its own; attn_norm is not
 * the block's (the norm before it is fused with the previous residual add: first_norm,
 * add_norm_after). */
enum { LAYER_OWN = 8 };

/* The slots of L's own weights that layer_use gathers (NULL where the layer has none). */
static void layer_own(tm__layer *L, tm_tensor **f[LAYER_OWN]) {
    tm_tensor **g[LAYER_OWN] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->ffn_norm, &L->mlp_w0, &L->mlp_w1, &L->mlp_wo};
    memcpy(f, g, sizeof g);
}

static tm_status layer_use(tm_ctx *ctx, const tm__layer *L, tm__layer *W) {
    *W = *L;
    tm_tensor **f[LAYER_OWN];
    layer_own(W, f);
    for (int i = 0; i < LAYER_OWN; i++)
        if (*f[i]) TM__TRY(tm__param_use(ctx, *f[i], f[i]));
    return TM_OK;
}

static void layer_done(tm_ctx *ctx, tm__layer *W) {
    tm_tensor **f[LAYER_OWN];
    layer_own(W, f);
    for (int i = 0; i < LAYER_OWN; i++) tm__param_done(ctx, *f[i]);
}

static tm_status block_of(tm_model *m, int l, const tm__layer *L, tm_tensor *x, tm_tensor *h, int64_t B, int64_t T,
                          tm_kv_cache *kv, const tm__dp_rows *dp, tm_moe_stats *st, tm_tensor **x1, tm_tensor **y) {
    tm_ctx *ctx = m->ctx;
    const tm_model_config *c = &m->cfg;
    tm_tensor *a;
    TM__TRY(self_attention(m, l, L, h, B, T, kv, &a));
    TM__TRY(tm_add_rmsnorm(ctx, x, a, L->ffn_norm, c->norm_eps, x1, &h));
    /* The running counts of the expert-bias update are left to the caller (tm_model_forward
     * adds them once the step's ids are known to be valid; the cached forward never does). */
    if (L->moe) return tm__moe_forward(L->moe, h, B, y, st, 0, dp);
    return swiglu_mlp(ctx, h, L->mlp_w0, L->mlp_w1, L->mlp_wo, y);
}

/* The weights of layer l (all of it: norms, attention, FFN or MoE block) into w (room for
 * LAYER_OWN + 8); l = n_layers: the final norm and the lm_head (the embedding when tied). */
static int layer_weights(const tm_model *m, int l, tm_tensor **w) {
    if (l == m->cfg.n_layers) {
        w[0] = m->norm;
        w[1] = m->lm_head ? m->lm_head : m->embed;
        return 2;
    }
    const tm__layer *N = &m->layers[l];
    int n = 0;
    tm_tensor *const dense[] = {N->attn_norm, N->wq, N->wk, N->wv, N->wo, N->ffn_norm, N->mlp_w0, N->mlp_w1, N->mlp_wo};
    for (size_t i = 0; i < sizeof dense / sizeof *dense; i++)
        if (dense[i]) w[n++] = dense[i];
    if (N->moe) n += tm__moe_weights(N->moe, w + n);
    return n;
}

/* ZeRO-3: start the all-gathers of layer l's units beside the work (fsdp.c; nothing to start
 * on CPU ranks or with overlap off). */
static tm_status prefetch_layer(tm_model *m, int l) {
    tm_tensor *w[LAYER_OWN + 8];
    return tm__param_prefetch(m->ctx, w, layer_weights(m, l, w), l < m->cfg.n_layers);
}

/* The use of the norm weight gathered before layer l's block (or the head) ends with it:
 * the norm is its unit's first weight, so the unit stays gathered from the norm to the block
 * rather than going back between them. */
static void pinned_done(tm_model *m) {
    tm__param_done(m->ctx, m->pin);
    m->pin = NULL;
}

static tm_status layer_forward(tm_model *m, int l, tm_tensor *x, tm_tensor *h, int64_t B, int64_t T, tm_kv_cache *kv,
                             const tm__dp_rows *dp, tm_moe_stats *st, tm_tensor **x1, tm_tensor **y) {
    tm__layer W;
    TM__TRY(layer_use(m->ctx, &m->layers[l], &W));
    /* ZeRO-3: the next layer's all-gathers start beside this one's compute; during the last
     * layer, those of the final norm and the lm_head */
    TM__TRY(prefetch_layer(m, l + 1));
    tm_status s = block_of(m, l, &W, x, h, B, T, kv, dp, st, x1, y);
    layer_done(m->ctx, &W);
    pinned_done(m);
    return s;
}

/* ZeRO-3: 1 when the weights of layer l (its attention norm, own and MoE weights; l =
 * n_layers: the final norm and the lm_head) are kept gathered from their forward to their
 * backward (tm_comm_options.zero3_keep_last: the last layers, whose backward comes first). */
static int kept(const tm_model *m, int l) {
    int k = tm_comm_get_options(m->ctx).zero3_keep_last;
    return k > 0 && l >= m->cfg.n_layers - k;
}

static tm_status block(tm_model *m, int l, tm_tensor *x, tm_tensor *h, int64_t B, int64_t T, tm_kv_cache *kv,
                       const tm__dp_rows *dp, tm_moe_stats *st, tm_tensor **x1, tm_tensor **y) {
    int prev = tm__param_keep(m->ctx, kept(m, l)); /* the MoE block's gathers too */
    tm_status s = layer_forward(m, l, x, h, B, T, kv, dp, st, x1, y);
    tm__param_keep(m->ctx, prev);
    return s;
}

/* x1 + y and its norm with the norm weight after layer l (gathered for the call under ZeRO-3). */
static tm_status add_norm_after(tm_model *m, int l, tm_tensor *x1, tm_tensor *y, tm_tensor **x, tm_tensor **h);

/* The norm after layer l: the next layer's attention norm, or the final norm. */
static tm_tensor *norm_after(const tm_model *m, int l) {
    return l + 1 < m->cfg.n_layers ? m->layers[l + 1].attn_norm : m->norm;
}

/* tm__param_use of one weight, kept until its backward when `keep` (tm__param_keep). */
static tm_status use_kept(tm_ctx *ctx, tm_tensor *p, int keep, tm_tensor **w) {
    int prev = tm__param_keep(ctx, keep);
    tm_status s = tm__param_use(ctx, p, w);
    tm__param_keep(ctx, prev);
    return s;
}

static tm_status add_norm_after(tm_model *m, int l, tm_tensor *x1, tm_tensor *y, tm_tensor **x, tm_tensor **h) {
    tm_tensor *w;
    TM__TRY(use_kept(m->ctx, norm_after(m, l), kept(m, l + 1), &w)); /* layer l + 1's, or the final norm */
    m->pin = w; /* done by layer l + 1, or the head */
    return tm_add_rmsnorm(m->ctx, x1, y, w, m->cfg.norm_eps, x, h);
}

/* h = attn_norm(x) of layer 0, the one norm not fused with a residual add (n_layers >= 1). */
static tm_status first_norm(tm_model *m, tm_tensor *x, tm_tensor **h) {
    tm_tensor *w;
    TM__TRY(use_kept(m->ctx, m->layers[0].attn_norm, kept(m, 0), &w));
    m->pin = w; /* done by layer 0 */
    return tm_rmsnorm(m->ctx, x, w, m->cfg.norm_eps, h);
}

/* tokens i32 [B,T] -> the residual stream [B*T,H]. The tokens are valid already (checked on the
 * device by tm_index_check in tm_model_forward, on the host by tm_model_forward_cached), so the
 * embedding need not read its own bad-id flag back (no synchronisation on CUDA). */
static tm_status embed(tm_model *m, tm_tensor *tokens, tm_tensor **x) {
    int64_t flat[1] = {tm_tensor_dim(tokens, 0) * tm_tensor_dim(tokens, 1)};
    tm_tensor *ids;
    TM__TRY(tm_reshape(m->ctx, tokens, 1, flat, &ids));
    tm_tensor *w;
    m->pin = NULL; /* (a failed forward's is gone with its arena) */
    TM__TRY(tm__param_use(m->ctx, m->embed, &w));
    TM__TRY(prefetch_layer(m, 0)); /* ZeRO-3: layer 0's units beside the lookup */
    tm_status s = tm__embedding_unchecked(m->ctx, w, ids, x); // (B*T, H)
    tm__param_done(m->ctx, w);
    return s;
}

/* lm_head (embed.weight^T when tied) on the final norm h [B*T,H] -> logits [B,T,V]. */
static tm_status head(tm_model *m, tm_tensor *h, int64_t B, int64_t T, tm_tensor **logits_2d, tm_tensor **logits) {
    tm_ctx *ctx = m->ctx;
    int64_t s3[3] = {B, T, m->cfg.vocab_size};
    tm_tensor *lg, *w;
    TM__TRY(use_kept(ctx, m->lm_head ? m->lm_head : m->embed, kept(m, m->cfg.n_layers), &w));
    tm_status s = tm_matmul(ctx, h, w, 0, m->lm_head ? 0 : 1, &lg); // (B*T, V)
    tm__param_done(ctx, w);
    pinned_done(m); /* the final norm's */
    TM__TRY(s);
    if (logits_2d) *logits_2d = lg;
    return tm_reshape(ctx, lg, 3, s3, logits); // (B, T, V)
}

/* TM_ERR_INDEX naming id i (flat) of ids (i32 [B,T]) by position and value. */
static tm_status bad_id(tm_model *m, const char *fn, const tm_tensor *ids, const char *what, int ignore, int64_t i,
                        int64_t value) {
    tm_ctx *ctx = m->ctx;
    int64_t T = tm_tensor_dim(ids, 1);
    return tm__err(ctx, TM_ERR_INDEX, "%s: %s[%lld, %lld] = %lld is outside [0, vocab_size = %lld)%s (%s %s)", fn, what,
                   (long long)(i / T), (long long)(i % T), (long long)value, (long long)m->cfg.vocab_size,
                   ignore ? " and is not the ignore index -1" : "", what, tm__tdesc(ctx, ids));
}

/* Every id of ids (i32 [B,T]) in [0, hi), or equal to the ignore index when `ignore` is set;
 * otherwise TM_ERR_INDEX naming the first offender. Checked on the host before anything runs
 * (one read of ids), so a bad batch leaves no trace in a KV cache. */
static tm_status check_range(tm_model *m, const char *fn, tm_tensor *ids, const char *what, int ignore) {
    tm_ctx *ctx = m->ctx;
    int64_t n = tm_tensor_numel(ids), V = m->cfg.vocab_size;
    int32_t *h = tm__arena_alloc(ctx, tm_cpu(), sizeof(int32_t) * (size_t)n);
    if (!h) return TM_ERR_NOMEM;
    TM__TRY(tm_tensor_read(ctx, ids, TM_I32, h, n));
    for (int64_t i = 0; i < n; i++) {
        if ((h[i] >= 0 && h[i] < V) || (ignore && h[i] == -1)) continue;
        return bad_id(m, fn, ids, what, ignore, i, h[i]);
    }
    return TM_OK;
}

static tm_status check_ids(tm_model *m, const char *fn, tm_tensor *t, const char *what, const tm_tensor *like) {
    tm_ctx *ctx = m->ctx;
    tm_dtype dt = tm_tensor_dtype(t);
    if (dt != TM_I32 || tm_tensor_ndim(t) != 2 || tm_tensor_dim(t, 0) < 1 || tm_tensor_dim(t, 1) < 1)
        return tm__err(ctx, dt != TM_I32 ? TM_ERR_DTYPE : TM_ERR_SHAPE,
                       "%s: %s must be i32 [B,T] with B, T >= 1, got %s", fn, what, tm__tdesc(ctx, t));
    if (!tm__same_device(tm_tensor_device(t), m->dev))
        return tm__err(ctx, TM_ERR_DEVICE, "%s: %s %s is not on the model's device", fn, what, tm__tdesc(ctx, t));
    if (like && (tm_tensor_dim(t, 0) != tm_tensor_dim(like, 0) || tm_tensor_dim(t, 1) != tm_tensor_dim(like, 1)))
        return tm__err(ctx, TM_ERR_SHAPE, "%s: %s %s must have the shape of tokens %s", fn, what, tm__tdesc(ctx, t),
                       tm__tdesc(ctx, like));
    return TM_OK;
}

/* a + b for 0-d losses, either of which may be absent (NULL) and whose dtypes may differ (the
 * MoE losses are f32, the cross-entropy has the logits' dtype: f64 in gradient checks). The sum
 * has a's dtype. */
static tm_status add_loss(tm_ctx *ctx, tm_tensor *a, tm_tensor *b, tm_tensor **out) {
    if (!a || !b) {
        *out = a ? a : b;
        return TM_OK;
    }
    if (tm_tensor_dtype(b) != tm_tensor_dtype(a)) TM__TRY(tm_cast(ctx, b, tm_tensor_dtype(a), &b));
    return tm_add(ctx, a, b, out);
}

/* The one tensor tm_model_forward reads back: i64 slots. */
enum {
    SLOT_LOSS = 0,    /* the loss's bits (its dtype: f32 in the slot's first 4 bytes, or f64) */
    SLOT_CE = 1,      /* the cross-entropy's, likewise */
    SLOT_TOK_BAD = 2, /* tm_index_check of tokens: first bad position (-1: none), its value */
    SLOT_TGT_BAD = 4, /* and of targets */
    SLOT_LAYERS = 6   /* then each MoE layer's packed statistics (E + TM__MOE_STAT_SLOTS) */
};

tm_status tm_model_forward(tm_model *m, tm_tensor *tokens, tm_tensor *targets, tm_model_out *out) {
    static const char fn[] = "tm_model_forward";
    if (!m) return TM_ERR_INVALID_ARG;
    tm_ctx *ctx = m->ctx;
    const tm_model_config *c = &m->cfg;
    if (!tokens || !out) return BAD("%s: %s is NULL", fn, tokens ? "out" : "tokens");
    TM__TRY(check_ids(m, fn, tokens, "tokens", NULL));
    if (targets) TM__TRY(check_ids(m, fn, targets, "targets", tokens));
    int64_t B = tm_tensor_dim(tokens, 0), T = tm_tensor_dim(tokens, 1);
    int64_t E = c->moe.router.num_experts, V = c->vocab_size, per_layer = E + TM__MOE_STAT_SLOTS;
    if (T > c->max_seq_len)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: sequence length T = %lld of tokens %s exceeds max_seq_len = %d", fn,
                       (long long)T, tm__tdesc(ctx, tokens), c->max_seq_len);

    tm_model_out o;
    memset(&o, 0, sizeof o);
    o.n_moe_layers = m->n_moe;
    /* The step's statistics, on the device; each MoE layer's routed counts, for after the read. */
    int64_t n_slots = SLOT_LAYERS + (int64_t)m->n_moe * per_layer;
    tm_tensor *stats, **counts = tm__meta_alloc(ctx, sizeof(tm_tensor *) * (size_t)(m->n_moe + 1));
    int64_t *slots = tm__arena_alloc(ctx, tm_cpu(), sizeof(int64_t) * (size_t)n_slots);
    if (!counts || !slots) return TM_ERR_NOMEM;
    TM__TRY(tm_tensor_zeros(ctx, TM_I64, 1, &n_slots, m->dev, &stats));

    /* Ids are checked on the device: invalid ones are replaced (tokens by 0, targets by the
     * ignore index) so the forward runs through, and reported after the one read below. */
    tm_tensor *tok, *tok_bad, *tgt = NULL, *tgt_bad = NULL;
    TM__TRY(tm_index_check(ctx, tokens, V, 0, &tok, &tok_bad));
    TM__TRY(tm__stat_put(ctx, stats, SLOT_TOK_BAD, tok_bad));
    if (targets) {
        TM__TRY(tm_index_check(ctx, targets, V, -1, &tgt, &tgt_bad));
        TM__TRY(tm__stat_put(ctx, stats, SLOT_TGT_BAD, tgt_bad));
    }

    /* Where this rank's rows sit in the global batch under data parallelism: one small host
     * collective for the whole forward, shared by every MoE layer (each made its own before). */
    tm__dp_rows dp;
    TM__TRY(tm__dp_rows_of(ctx, B * T, &dp));
    int64_t dp_tokens = dp.Tg;

    tm_tensor *x, *h, *x1, *y;
    TM__TRY(embed(m, tok, &x)); // (B*T, H)
    TM__TRY(first_norm(m, x, &h));
    tm_tensor *moe_loss[3] = {NULL, NULL, NULL}; /* aux, seq aux, z: summed over layers */
    int j = 0;
    for (int l = 0; l < c->n_layers; l++) {
        tm_moe_stats st;
        TM__TRY(block(m, l, x, h, B, T, NULL, &dp, &st, &x1, &y));
        TM__TRY(add_norm_after(m, l, x1, y, &x, &h)); // x1 + y, its norm
        if (!m->layers[l].moe) continue;
        tm_tensor *parts[3] = {st.aux_loss, st.seq_aux_loss, st.z_loss};
        for (int p = 0; p < 3; p++) TM__TRY(add_loss(ctx, moe_loss[p], parts[p], &moe_loss[p]));
        TM__TRY(tm__stat_put(ctx, stats, SLOT_LAYERS + (int64_t)j * per_layer, st.packed));
        counts[j++] = st.tokens_per_expert;
    }
    tm_tensor *logits;
    TM__TRY(head(m, h, B, T, &logits, &o.logits)); // (B*T, V), (B, T, V)

    if (targets) {
        int64_t flat[1] = {B * T};
        tm_tensor *tg, *lg = logits;
        TM__TRY(tm_reshape(ctx, tgt, 1, flat, &tg));
        /* The targets were checked above: the cross-entropy need not read its own flag back.
         * Its loss is f32 for bf16 logits, read from the bf16 logits directly: no f32 copy of
         * the (B*T, V) logits, and the gradient comes back in bf16 (extend.h). */
        TM__TRY(tm__cross_entropy_unchecked(ctx, lg, tg, -1, &o.ce_loss));
        /* Data parallelism: this rank's share of the global batch's mean (tinymoe.h). */
        if (dp_tokens > B * T) TM__TRY(tm_scale(ctx, o.ce_loss, (double)(B * T) / (double)dp_tokens, &o.ce_loss));
        o.loss = o.ce_loss;
        for (int p = 0; p < 3; p++) TM__TRY(add_loss(ctx, o.loss, moe_loss[p], &o.loss));
        TM__TRY(tm__stat_put(ctx, stats, SLOT_LOSS, o.loss));
        TM__TRY(tm__stat_put(ctx, stats, SLOT_CE, o.ce_loss));
    }

    /* The step's one read. */
    TM__TRY(tm_tensor_read(ctx, stats, TM_I64, slots, n_slots));
    if (slots[SLOT_TOK_BAD] >= 0) return bad_id(m, fn, tokens, "tokens", 0, slots[SLOT_TOK_BAD], slots[SLOT_TOK_BAD + 1]);
    if (targets && slots[SLOT_TGT_BAD] >= 0)
        return bad_id(m, fn, targets, "targets", 1, slots[SLOT_TGT_BAD], slots[SLOT_TGT_BAD + 1]);
    if (targets) {
        o.loss_value = tm__stat_value(slots + SLOT_LOSS, tm_tensor_dtype(o.loss));
        o.ce_value = tm__stat_value(slots + SLOT_CE, tm_tensor_dtype(o.ce_loss));
    }
    for (j = 0; j < m->n_moe; j++) {
        const int64_t *ls = slots + SLOT_LAYERS + (int64_t)j * per_layer;
        tm_moe_stats st;
        memset(&st, 0, sizeof st);
        tm__moe_stats_decode(m->layers[c->first_k_dense + j].moe, ls, &st);
        o.aux_value += st.aux_loss_value;
        o.seq_aux_value += st.seq_aux_loss_value;
        o.z_value += st.z_loss_value;
        o.dropped_tokens += st.dropped_tokens;
        if (st.max_load_ratio > o.max_load_ratio) o.max_load_ratio = st.max_load_ratio;
    }
    if (tm_comm_size(ctx, TM_COMM_DP) > 1) {
        /* The loss values read back are this rank's shares: their sum over the ranks is the
         * global batch's (the counts and drops are global already). */
        double v[5] = {o.loss_value, o.ce_value, o.aux_value, o.seq_aux_value, o.z_value};
        TM__TRY(tm_comm_allreduce_host(ctx, TM_COMM_DP, TM_F64, v, 5));
        o.loss_value = v[0], o.ce_value = v[1], o.aux_value = v[2], o.seq_aux_value = v[3], o.z_value = v[4];
    }
    /* Only training forwards (grad mode on) feed the expert-bias update, and only once the
     * batch is known to be valid: a refused batch leaves the running counts alone. */
    if (tm__grad_enabled(ctx))
        for (j = 0; j < m->n_moe; j++) TM__TRY(tm__moe_accumulate(m->layers[c->first_k_dense + j].moe, counts[j]));
    for (j = 0; j < m->n_moe; j++)
        memcpy(m->tokens_per_expert + (int64_t)j * E, slots + SLOT_LAYERS + (int64_t)j * per_layer,
               sizeof(int64_t) * (size_t)E);
    o.tokens_per_expert = m->tokens_per_expert;
    *out = o;
    return TM_OK;
}

/* The cached forward proper (tape off, arguments checked). */
static tm_status forward_cached(tm_model *m, tm_kv_cache *kv, tm_tensor *tokens, tm_tensor **logits) {
    int64_t B = tm_tensor_dim(tokens, 0), T = tm_tensor_dim(tokens, 1);
    tm_tensor *x, *h, *x1, *y;
    TM__TRY(embed(m, tokens, &x)); // (B*T, H)
    TM__TRY(first_norm(m, x, &h));
    /* The MoE statistics are not asked for, and with the tape off tm_moe_forward leaves the
     * expert-bias counts alone. */
    for (int l = 0; l < m->cfg.n_layers; l++) {
        TM__TRY(block(m, l, x, h, B, T, kv, NULL, NULL, &x1, &y));
        TM__TRY(add_norm_after(m, l, x1, y, &x, &h));
    }
    return head(m, h, B, T, NULL, logits); // (B, T, V)
}

tm_status tm_model_forward_cached(tm_model *m, tm_kv_cache *kv, tm_tensor *tokens, tm_tensor **logits) {
    static const char fn[] = "tm_model_forward_cached";
    if (!m) return TM_ERR_INVALID_ARG;
    tm_ctx *ctx = m->ctx;
    if (!kv || !tokens || !logits) return BAD("%s: %s is NULL", fn, !kv ? "cache" : !tokens ? "tokens" : "logits");
    if (kv->model != m) return BAD("%s: the cache was made for another model (tm_kv_cache_new)", fn);
    TM__TRY(check_ids(m, fn, tokens, "tokens", NULL));
    int64_t B = tm_tensor_dim(tokens, 0), T = tm_tensor_dim(tokens, 1);
    if (B != kv->batch)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: tokens %s hold %lld sequences but the cache was made for batch = %d", fn,
                       tm__tdesc(ctx, tokens), (long long)B, kv->batch);
    if (kv->len + T > kv->capacity)
        return BAD("%s: %lld new positions after the %d cached ones exceed the cache's capacity max_len = %d (tokens "
                   "%s); nothing was appended",
                   fn, (long long)T, kv->len, kv->capacity, tm__tdesc(ctx, tokens));
    TM__TRY(check_range(m, fn, tokens, "tokens", 0));
    int prev = tm_ctx_set_grad_enabled(ctx, 0);
    tm_status s = forward_cached(m, kv, tokens, logits);
    tm_ctx_set_grad_enabled(ctx, prev);
    /* Positions count only once every layer has written them: after a failure the cache holds
     * what it held before (the partly written slots lie past len and get overwritten). */
    if (s == TM_OK) kv->len += (int)T;
    return s;
}

tm_status tm_model_step(tm_model *m) {
    if (!m) return TM_ERR_INVALID_ARG;
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (m->layers[l].moe) TM__TRY(tm_moe_update_expert_bias(m->layers[l].moe));
    return TM_OK;
}

/* ---- the plan of a step (tinymoe.h, tm_model_plan_step) ---------------------------------- */

/* One set of weights the forward holds gathered at once (ZeRO-3): each distinct unit of the
 * set (fsdp.c gathers a unit once however many of its weights are used) counted once, added to
 * the step's traffic (gathered again in the backward unless kept), the set's bytes with those
 * kept so far (*kept_bytes) against the most held at once. A kept set (`keep`) is gathered
 * once and stays held through the rest of the forward; the backward, which gives the kept ones
 * back as it goes, holds no more than the forward's end did. */
static tm_status plan_uses(tm_ctx *ctx, tm_tensor *const *w, int n, int keep, int micro, int64_t *kept_bytes,
                           tm_step_plan *out) {
    int64_t held_set = 0;
    int seen[LAYER_OWN + 8], n_seen = 0;
    for (int i = 0; i < n; i++) {
        int64_t held, gather, reduce;
        int unit, dup = 0;
        if (!w[i]) continue;
        TM__TRY(tm__fsdp_use_plan(ctx, w[i], &unit, &held, &gather, &reduce));
        if (unit < 0) continue;
        for (int k = 0; k < n_seen; k++) dup |= seen[k] == unit;
        if (dup) continue;
        if (n_seen < (int)(sizeof seen / sizeof *seen)) seen[n_seen++] = unit;
        held_set += held;
        out->param_gather += (keep ? 1 : 2) * gather * micro;
        out->bwd_reduce += reduce * micro;
    }
    if (*kept_bytes + held_set > out->transient) out->transient = *kept_bytes + held_set;
    if (keep) *kept_bytes += held_set;
    return TM_OK;
}

tm_status tm_model_plan_step(tm_model *m, int64_t tokens, int micro_batches, tm_step_plan *out) {
    static const char fn[] = "tm_model_plan_step";
    if (!m) return TM_ERR_INVALID_ARG;
    tm_ctx *ctx = m->ctx;
    if (!out) return BAD("%s: out is NULL", fn);
    if (tokens < 1 || micro_batches < 1)
        return BAD("%s: tokens = %lld and micro_batches = %d must be >= 1", fn, (long long)tokens, micro_batches);
    if (!tm__ctx_plan_only(ctx))
        return tm__err(ctx, TM_ERR_STATE, "%s: the model's context computes (its collectives and buffers are real): "
                       "plan in a context made with tm_ctx_options.plan_only", fn);
    memset(out, 0, sizeof *out);
    /* ZeRO 0-2: the buckets' synchronisation and all-gather, run on the placeholders */
    int64_t grads_transient = 0;
    TM__TRY(tm__zero_plan_step(ctx, &out->grad_sync, &out->param_gather, &grads_transient));
    /* ZeRO-3: the forward's units in its order (the embedding, each layer's from its attention
     * norm to its block, the final norm's and the lm_head's), each set as long as it is held */
    const tm_model_config *c = &m->cfg;
    double dispatch = 0; /* (expected bytes: whole once summed) */
    int64_t kb = 0; /* bytes kept so far (zero3_keep_last) */
    TM__TRY(plan_uses(ctx, &m->embed, 1, 0, micro_batches, &kb, out));
    for (int l = 0; l <= c->n_layers; l++) {
        tm_tensor *set[LAYER_OWN + 8];
        int n = layer_weights(m, l, set); /* (tied: the embedding gathered again for the head) */
        TM__TRY(plan_uses(ctx, set, n, kept(m, l), micro_batches, &kb, out));
        if (l < c->n_layers && m->layers[l].moe) dispatch += tm__moe_plan_dispatch(m->layers[l].moe, tokens) * micro_batches;
    }
    out->dispatch = (int64_t)dispatch;
    out->transient += grads_transient; /* (one of the two is 0: ZeRO-2 gathers nothing) */
    return TM_OK;
}
