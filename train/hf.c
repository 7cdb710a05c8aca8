/*
 * hf.c — Hugging Face Mixtral export and import; see hf.h and docs/hf-export.md.
 *
 * The safetensors container itself is train/safetensors.c; this file knows Mixtral: names,
 * shapes and transposes, config.json, and the `tinymoe export` command. We write the tensors
 * in the order of the plan, with {"format": "pt"} in the metadata (transformers refuses
 * safetensors files without it).
 *
 * Both directions go through one plan: the list of HF tensors of a model, each naming the
 * tinymoe parameter it comes from, the expert slice and whether it is transposed. Export reads
 * each parameter once and writes its HF pieces; import validates the whole file against the
 * plan before the first parameter is written.
 */
#include "hf.h"

#include <cJSON.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "atomic.h"
#include "bpe.h"
#include "checkpoint.h"
#include "finite.h"
#include "safetensors.h"
#include "status.h"
#include "strbuf.h"
#include "tokenizer.h"
#include "util.h"

#define HF_NAME_MAX 112

/* A JSON number that reads back as exactly v, in the fewest digits, and always with a '.' or
 * an exponent so that readers with typed float fields see a float. */
static void fmt_double(char *buf, size_t len, double v) {
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(buf, len, "%.1f", v); /* 10000.0, not 1e+04 */
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, len, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) break;
    }
    if (!strpbrk(buf, ".eE") && strlen(buf) + 2 < len) strcat(buf, ".0");
}

static int join(char *out, size_t len, const char *dir, const char *name) {
    return (size_t)snprintf(out, len, "%s/%s", dir, name) >= len ? -1 : 0;
}

/* ---- the plan: HF tensors of a model ------------------------------------------------------ */

typedef struct hf_entry {
    char name[HF_NAME_MAX]; /* HF name */
    tm_tensor *t;           /* the tinymoe parameter it comes from */
    int64_t expert;         /* slice of a stacked [E, A, B] parameter, or -1 */
    int transpose;          /* HF holds the transpose of the tinymoe matrix */
    int ndim;
    int64_t shape[2];       /* HF shape */
    const void *src;        /* the file's bytes (import) */
    int src_dtype;          /* TMD_ST_F32 / TMD_ST_BF16 / TMD_ST_F16 (import) */
} hf_entry;

typedef struct hf_plan {
    hf_entry *e;
    int n, cap;
} hf_plan;

static void plan_free(hf_plan *p) {
    free(p->e);
    memset(p, 0, sizeof *p);
}

static int plan_add(hf_plan *p, tm_ctx *ctx, const char *hf, const char *tm, int64_t expert, int transpose, int ndim,
                    int64_t s0, int64_t s1, char *err, size_t errlen) {
    if (p->n == p->cap) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "internal error: HF plan overflow at '%s'", hf);
    tm_tensor *t = tm_ctx_find(ctx, tm);
    if (!t)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "the model has no parameter '%s' (for HF tensor '%s')", tm, hf);
    /* The tinymoe shape this HF tensor implies. */
    int64_t want[3];
    int wn = 0;
    if (expert >= 0) want[wn++] = tm_tensor_dim(t, 0);
    if (ndim == 1) {
        want[wn++] = s0;
    } else if (transpose) {
        want[wn++] = s1;
        want[wn++] = s0;
    } else {
        want[wn++] = s0;
        want[wn++] = s1;
    }
    int ok = tm_tensor_ndim(t) == wn && (expert < 0 || expert < tm_tensor_dim(t, 0));
    for (int i = 0; ok && i < wn; i++) ok = tm_tensor_dim(t, i) == want[i];
    if (!ok)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR,
                        "internal error: parameter '%s' does not have the shape HF tensor '%s' needs", tm, hf);
    hf_entry *e = &p->e[p->n++];
    memset(e, 0, sizeof *e);
    snprintf(e->name, sizeof e->name, "%s", hf);
    e->t = t;
    e->expert = expert;
    e->transpose = transpose;
    e->ndim = ndim;
    e->shape[0] = s0;
    e->shape[1] = ndim == 2 ? s1 : 1;
    return 0;
}

/* The Mixtral tensors of `model`, in file order: per parameter, all its pieces together (so
 * export reads each parameter once). */
static int plan_build(tm_ctx *ctx, const tm_model *model, hf_plan *p, char *err, size_t errlen) {
    const tm_model_config *c = tm_model_get_config(model);
    memset(p, 0, sizeof *p);
    const int64_t H = c->d_model, V = c->vocab_size, D = c->d_model / c->n_heads, Hq = c->n_heads * D,
                  Hkv = c->n_kv_heads * D, F = c->moe.ffn_size, E = c->moe.router.num_experts;
    const int L = c->n_layers;
    p->cap = 3 + L * (7 + 3 * (int)E);
    p->e = calloc((size_t)p->cap, sizeof *p->e);
    if (!p->e) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory (%d tensor descriptors)", p->cap);
    char hf[HF_NAME_MAX], tm[HF_NAME_MAX];
    int rc;
#define ADD(EXPERT, TR, ND, S0, S1)                                                                \
    do {                                                                                           \
        if ((rc = plan_add(p, ctx, hf, tm, EXPERT, TR, ND, S0, S1, err, errlen))) goto out;        \
    } while (0)
    snprintf(hf, sizeof hf, "model.embed_tokens.weight");
    snprintf(tm, sizeof tm, "embed.weight");
    ADD(-1, 0, 2, V, H);
    for (int l = 0; l < L; l++) {
        static const struct { const char *hf, *tm; int kv, out; } attn[] = {
            {"q_proj", "wq", 0, 0}, {"k_proj", "wk", 1, 0}, {"v_proj", "wv", 1, 0}, {"o_proj", "wo", 0, 1}};
        snprintf(hf, sizeof hf, "model.layers.%d.input_layernorm.weight", l);
        snprintf(tm, sizeof tm, "layers.%d.attn_norm.weight", l);
        ADD(-1, 0, 1, H, 0);
        for (int a = 0; a < 4; a++) {
            int64_t rows = attn[a].out ? H : attn[a].kv ? Hkv : Hq, cols = attn[a].out ? Hq : H;
            snprintf(hf, sizeof hf, "model.layers.%d.self_attn.%s.weight", l, attn[a].hf);
            snprintf(tm, sizeof tm, "layers.%d.attn.%s", l, attn[a].tm);
            ADD(-1, 1, 2, rows, cols);
        }
        snprintf(hf, sizeof hf, "model.layers.%d.post_attention_layernorm.weight", l);
        snprintf(tm, sizeof tm, "layers.%d.ffn_norm.weight", l);
        ADD(-1, 0, 1, H, 0);
        snprintf(hf, sizeof hf, "model.layers.%d.block_sparse_moe.gate.weight", l);
        snprintf(tm, sizeof tm, "layers.%d.moe.gate.weight", l);
        ADD(-1, 1, 2, E, H);
        /* tm_swiglu(gate = x w0, up = x w1) = silu(gate) * up; Mixtral: silu(w1 x) * (w3 x). */
        static const struct { const char *hf, *tm; int down; } ex[] = {{"w1", "w0", 0}, {"w3", "w1", 0}, {"w2", "wo", 1}};
        for (int k = 0; k < 3; k++)
            for (int64_t j = 0; j < E; j++) {
                snprintf(hf, sizeof hf, "model.layers.%d.block_sparse_moe.experts.%lld.%s.weight", l, (long long)j, ex[k].hf);
                snprintf(tm, sizeof tm, "layers.%d.moe.experts.%s", l, ex[k].tm);
                ADD(j, 1, 2, ex[k].down ? H : F, ex[k].down ? F : H);
            }
    }
    snprintf(hf, sizeof hf, "model.norm.weight");
    snprintf(tm, sizeof tm, "norm.weight");
    ADD(-1, 0, 1, H, 0);
    if (!c->tie_embeddings) {
        snprintf(hf, sizeof hf, "lm_head.weight");
        snprintf(tm, sizeof tm, "lm_head.weight");
        ADD(-1, 1, 2, V, H);
    }
#undef ADD
    return 0;
out:
    plan_free(p);
    return rc;
}

static int64_t entry_numel(const hf_entry *e) { return e->shape[0] * e->shape[1]; }

/* Offset, in elements of the tinymoe parameter, of HF element (r, c). */
static inline int64_t tm_index(const hf_entry *e, int64_t r, int64_t c) {
    int64_t rows = e->shape[0], cols = e->shape[1];
    int64_t base = e->expert >= 0 ? e->expert * rows * cols : 0;
    return base + (e->transpose ? c * rows + r : r * cols + c);
}

/* ---- config check ------------------------------------------------------------------------- */

int tmd_hf_check_config(const tm_model_config *mc, char *err, size_t errlen) {
    const char *pre = "cannot export to Hugging Face Mixtral:";
    if (!mc) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s no model config", pre);
    const tm_moe_config *m = &mc->moe;
    const tm_router_config *r = &m->router;
    if (r->score_function != TM_SCORE_SOFTMAX)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "%s score_function = sigmoid; Mixtral's router is a softmax over the experts", pre);
    if (r->use_pre_softmax && !r->norm_topk_prob)
        return tmd_fail(
            err, errlen, TMD_CONFIG_ERROR,
            "%s norm_topk_prob = false with pre_softmax = true; Mixtral renormalises the top-k softmax weights to "
            "sum 1 (norm_topk_prob = true, or pre_softmax = false, which is the same function)",
            pre);
    if (r->num_groups > 1)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "%s num_groups = %d (group-limited routing); Mixtral routes over all experts", pre,
                        r->num_groups);
    if (m->use_expert_bias)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s expert_bias = true; Mixtral's router has no selection bias",
                        pre);
    if (m->shared_ffn_size > 0)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s shared_ffn_size = %d; Mixtral has no shared expert", pre,
                        m->shared_ffn_size);
    if (mc->first_k_dense > 0)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s first_k_dense = %d; every Mixtral layer is a MoE layer", pre,
                        mc->first_k_dense);
    if (r->scaling_factor != 1.0)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "%s scaling_factor = %g; Mixtral does not scale the routing weights", pre, r->scaling_factor);
    if (m->capacity_factor > 0)
        return tmd_fail(
            err, errlen, TMD_CONFIG_ERROR,
            "%s capacity_factor = %g; Mixtral is dropless (the logits would differ whenever a token is dropped)", pre,
            m->capacity_factor);
    if (m->apply_topk_weights_early)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "%s apply_topk_weights_early = true; Mixtral weights the expert outputs by the routing "
                        "weights, not the expert inputs",
                        pre);
    return 0;
}

/* ---- export ------------------------------------------------------------------------------- */

static const char *st_dtype_name(tm_dtype dt) { return dt == TM_BF16 ? "BF16" : "F32"; }

static int write_config(const char *dir, const tm_model_config *c, tm_dtype dtype, char *err, size_t errlen) {
    char theta[40], eps[40], std[40], aux[40];
    fmt_double(theta, sizeof theta, c->rope_theta);
    fmt_double(eps, sizeof eps, c->norm_eps);
    fmt_double(std, sizeof std, c->init_std);
    fmt_double(aux, sizeof aux, c->moe.aux_loss_coeff);
    const char *td = dtype == TM_BF16 ? "bfloat16" : "float32";
    /* The byte tokenizer (vocab 257) ends texts with 256; other vocabularies have no special ids. */
    char eos[16];
    snprintf(eos, sizeof eos, c->vocab_size == 257 ? "256" : "null");
    tmd_sbuf b = {0};
    /* rope_theta twice: transformers 5 reads rope_parameters, 4.x the top-level key. dtype
     * twice, likewise (5 writes "dtype", 4.x "torch_dtype"). */
    tmd_sb_printf(&b,
              "{\n"
              "  \"architectures\": [\"MixtralForCausalLM\"],\n"
              "  \"attention_dropout\": 0.0,\n"
              "  \"bos_token_id\": null,\n"
              "  \"dtype\": \"%s\",\n"
              "  \"eos_token_id\": %s,\n"
              "  \"head_dim\": %d,\n"
              "  \"hidden_act\": \"silu\",\n"
              "  \"hidden_size\": %d,\n"
              "  \"initializer_range\": %s,\n"
              "  \"intermediate_size\": %d,\n"
              "  \"max_position_embeddings\": %d,\n"
              "  \"model_type\": \"mixtral\",\n"
              "  \"num_attention_heads\": %d,\n"
              "  \"num_experts_per_tok\": %d,\n"
              "  \"num_hidden_layers\": %d,\n"
              "  \"num_key_value_heads\": %d,\n"
              "  \"num_local_experts\": %d,\n"
              "  \"output_router_logits\": false,\n"
              "  \"pad_token_id\": null,\n"
              "  \"rms_norm_eps\": %s,\n"
              "  \"rope_parameters\": {\"rope_theta\": %s, \"rope_type\": \"default\"},\n"
              "  \"rope_theta\": %s,\n"
              "  \"router_aux_loss_coef\": %s,\n"
              "  \"router_jitter_noise\": 0.0,\n"
              "  \"sliding_window\": null,\n"
              "  \"tie_word_embeddings\": %s,\n"
              "  \"torch_dtype\": \"%s\",\n"
              "  \"use_cache\": true,\n"
              "  \"vocab_size\": %d\n"
              "}\n",
              td, eos, c->d_model / c->n_heads, c->d_model, std, c->moe.ffn_size, c->max_seq_len, c->n_heads,
              c->moe.router.topk, c->n_layers, c->n_kv_heads, c->moe.router.num_experts, eps, theta, theta, aux,
              c->tie_embeddings ? "true" : "false", td, c->vocab_size);
    if (b.oom) {
        free(b.p);
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory writing %s", TMD_HF_CONFIG_FILE);
    }
    char path[PATH_MAX];
    tmd_atomic a;
    int rc = join(path, sizeof path, dir, TMD_HF_CONFIG_FILE)
                 ? tmd_fail(err, errlen, TMD_CONFIG_ERROR, "output path '%s/%s' is too long", dir, TMD_HF_CONFIG_FILE)
                 : tmd_atomic_open(&a, path, err, errlen);
    if (!rc) {
        tmd_atomic_write(&a, b.p, b.n);
        rc = tmd_atomic_commit(&a, err, errlen);
    }
    free(b.p);
    return rc;
}

/* The bytes of HF tensor i for tmd_st_write. The plan keeps a parameter's pieces together, so
 * each parameter is read once (from the context, or from a checkpoint: rd); transposed pieces
 * go through a staging buffer. tmd_st_write writes tensor i - 1 on another thread while tensor
 * i is made here, so parameters and pieces alternate between two buffers each (the bytes of
 * HF tensor i stay untouched until i + 2 is asked for). */
typedef struct export_src {
    tm_ctx *ctx;
    const hf_plan *p;
    tm_ckpt_reader *rd;   /* NULL: read the parameters from ctx */
    const char *ckpt;     /* rd's file, for messages */
    unsigned char *param[2], *piece[2];
    const tm_tensor *loaded[2];
    int slot;             /* param[slot] holds the parameter read last */
} export_src;

/* The first non-finite element of n values of dtype dt (f32 or bf16) at p: 1 with *at and
 * *value, else 0. */
static int first_nonfinite(const void *p, int64_t n, tm_dtype dt, int64_t *at, double *value) {
    /* A pass the compiler vectorises (the exponent all ones: inf or NaN), then the search. */
    unsigned any = 0;
    if (dt == TM_BF16) {
        const uint16_t *h = p;
#pragma omp simd reduction(| : any)
        for (int64_t j = 0; j < n; j++) any |= (h[j] & 0x7f80u) == 0x7f80u;
    } else {
        const uint32_t *w = p;
#pragma omp simd reduction(| : any)
        for (int64_t j = 0; j < n; j++) any |= (w[j] & 0x7f800000u) == 0x7f800000u;
    }
    if (!any) return 0;
    for (int64_t j = 0; j < n; j++) {
        float v;
        if (dt == TM_BF16) {
            uint32_t u = (uint32_t)((const uint16_t *)p)[j] << 16;
            memcpy(&v, &u, sizeof v);
        } else {
            v = ((const float *)p)[j];
        }
        if (!isfinite(v)) {
            *at = j;
            *value = v;
            return 1;
        }
    }
    return 0;
}

/* Parameter t's logical bytes into buf: from the context, or from the checkpoint (its CRC
 * checked, and its values finite: a diverged run's weights are refused as tmd_ckpt_load_model
 * refuses them). */
static int read_param(export_src *x, const tm_tensor *t, unsigned char *buf, char *err, size_t errlen) {
    tm_dtype dt = tm_tensor_dtype(t);
    if (!x->rd) {
        if (tm_tensor_read(x->ctx, t, dt, buf, tm_tensor_numel(t)) != TM_OK)
            return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "reading parameter '%s': %s", tm_tensor_name(t),
                            tm_ctx_errmsg(x->ctx));
        return 0;
    }
    int k = tm_ckpt_reader_find(x->rd, tm_tensor_name(t));
    uint64_t bytes = (uint64_t)tm_tensor_numel(t) * tm_dtype_size(dt);
    if (tm_ckpt_reader_read(x->rd, k, buf, bytes) != TM_OK)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "%s", tm_ctx_errmsg(x->ctx));
    tmd_nonfinite bad = {tm_tensor_name(t), 0, 0};
    if (first_nonfinite(buf, tm_tensor_numel(t), dt, &bad.index, &bad.value)) {
        char d[256];
        tmd_nonfinite_describe(&bad, d, sizeof d);
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "checkpoint '%s' holds a non-finite weight: %s (written by a run that diverged?); it cannot "
                        "be used", x->ckpt, d);
    }
    return 0;
}

/* dst [rows, cols] = the transpose of src [cols, rows] (row-major, es-byte elements), in 32 x 32
 * tiles so that both sides stay in cache, tile rows over the threads. An element-by-element copy
 * through memcpy took most of an export's time (coarse: 10.3 s for 1 GB against 0.8 s of writing).
 * Below TR_PARALLEL elements one thread does it: a parallel region costs tens of microseconds on a
 * many-core machine, and a model of many small tensors (1000 layers x 32 experts) spent 17 s of
 * its export starting regions on 64 cores, 4.5 s on 2. */
#define TR_TILE 32
#define TR_PARALLEL (1 << 16)
#define TR_BODY(T)                                                                                      \
    do {                                                                                                \
        const T *s = src;                                                                               \
        T *d = dst;                                                                                     \
        _Pragma("omp parallel for schedule(static) if (rows * cols >= TR_PARALLEL)")                      \
        for (int64_t r0 = 0; r0 < rows; r0 += TR_TILE)                                                  \
            for (int64_t c0 = 0; c0 < cols; c0 += TR_TILE) {                                            \
                int64_t r1 = r0 + TR_TILE < rows ? r0 + TR_TILE : rows;                                 \
                int64_t c1 = c0 + TR_TILE < cols ? c0 + TR_TILE : cols;                                 \
                for (int64_t r = r0; r < r1; r++)                                                       \
                    for (int64_t c = c0; c < c1; c++) d[r * cols + c] = s[c * rows + r];                \
            }                                                                                           \
    } while (0)
static void transpose_into(void *dst, const void *src, int64_t rows, int64_t cols, size_t es) {
    if (es == 2) TR_BODY(uint16_t);
    else if (es == 4) TR_BODY(uint32_t);
    else
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++)
                memcpy((char *)dst + (size_t)(r * cols + c) * es, (const char *)src + (size_t)(c * rows + r) * es, es);
}
#undef TR_BODY

static int export_bytes(void *user, int i, const void **data, char *err, size_t errlen) {
    export_src *x = user;
    const hf_entry *e = &x->p->e[i];
    tm_dtype dt = tm_tensor_dtype(e->t);
    size_t es = tm_dtype_size(dt);
    if (e->t != x->loaded[x->slot]) {
        int rc;
        x->slot ^= 1; /* the other buffer: the writer may still be writing from this one */
        x->loaded[x->slot] = NULL;
        if ((rc = read_param(x, e->t, x->param[x->slot], err, errlen))) return rc;
        x->loaded[x->slot] = e->t;
    }
    *data = x->param[x->slot] + (size_t)tm_index(e, 0, 0) * es;
    if (e->transpose) { /* HF (r, c) is the parameter's (c, r): tm_index */
        transpose_into(x->piece[i & 1], *data, e->shape[0], e->shape[1], es);
        *data = x->piece[i & 1];
    }
    return 0;
}

static int write_weights(tm_ctx *ctx, const hf_plan *p, tm_ckpt_reader *rd, const char *ckpt, const char *dir,
                         char *err, size_t errlen) {
    char path[PATH_MAX];
    if (join(path, sizeof path, dir, TMD_HF_WEIGHTS_FILE))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "output path '%s/%s' is too long", dir, TMD_HF_WEIGHTS_FILE);
    tmd_st_out *t = calloc((size_t)p->n, sizeof *t);
    if (!t) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory staging %s", TMD_HF_WEIGHTS_FILE);
    size_t max_param = 0, max_piece = 0;
    for (int i = 0; i < p->n; i++) {
        const hf_entry *e = &p->e[i];
        size_t es = tm_dtype_size(tm_tensor_dtype(e->t));
        size_t pb = (size_t)tm_tensor_numel(e->t) * es, eb = (size_t)entry_numel(e) * es;
        if (pb > max_param) max_param = pb;
        if (eb > max_piece) max_piece = eb;
        t[i] = (tmd_st_out){.name = e->name,
                            .dtype = st_dtype_name(tm_tensor_dtype(e->t)),
                            .ndim = e->ndim,
                            .shape = {e->shape[0], e->shape[1]}};
    }
    export_src x = {.ctx = ctx, .p = p, .rd = rd, .ckpt = ckpt};
    int rc = 0;
    for (int b = 0; b < 2; b++) {
        x.param[b] = malloc(max_param ? max_param : 1);
        x.piece[b] = malloc(max_piece ? max_piece : 1);
        if (!x.param[b] || !x.piece[b])
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory staging %s (%zu bytes)", TMD_HF_WEIGHTS_FILE,
                          2 * (max_param + max_piece));
    }
    if (!rc) {
        static const char *const meta[] = {"format", "pt", NULL};
        rc = tmd_st_write(path, t, p->n, meta, export_bytes, &x, err, errlen);
    }
    free(t);
    for (int b = 0; b < 2; b++) free(x.param[b]), free(x.piece[b]);
    return rc;
}

/* The export of model (its parameters in ctx, or, with rd, in the checkpoint rd reads). */
static int export_model(tm_ctx *ctx, tm_model *model, tm_ckpt_reader *rd, const char *ckpt, const char *dir, char *err,
                        size_t errlen) {
    const tm_model_config *c = tm_model_get_config(model);
    int rc = tmd_hf_check_config(c, err, errlen);
    if (rc) return rc;
    tm_tensor *embed = tm_ctx_find(ctx, "embed.weight");
    tm_dtype dt = embed ? tm_tensor_dtype(embed) : TM_F64;
    if (dt != TM_F32 && dt != TM_BF16)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "cannot export to Hugging Face Mixtral: dtype = %s; export f32 or bf16 models",
                        tm_dtype_name(dt));
    if (!tmd_st_host_supported())
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "export: big-endian hosts are not supported");
    hf_plan p;
    if ((rc = plan_build(ctx, model, &p, err, errlen))) return rc;
    /* From a checkpoint: every parameter the plan reads is in the file, as the model has it
     * (what tm_ckpt_load checks), before anything is written. */
    for (int i = 0; rd && i < p.n && !rc; i++) {
        const tm_tensor *t = p.e[i].t;
        const tm_ckpt_info *info = tm_ckpt_reader_info(rd);
        int k = tm_ckpt_reader_find(rd, tm_tensor_name(t));
        const tm_ckpt_entry *en = k >= 0 ? &info->entries[k] : NULL;
        int same = en && en->dtype == tm_tensor_dtype(t) && en->ndim == tm_tensor_ndim(t);
        for (int d = 0; same && d < en->ndim; d++) same = en->shape[d] == tm_tensor_dim(t, d);
        if (!same)
            rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                          "'%s': %s tensor '%s' as its meta's model has it (%s, %d dims): the meta does not describe "
                          "this file", ckpt, en ? "holds another" : "lacks", tm_tensor_name(t),
                          tm_dtype_name(tm_tensor_dtype(t)), tm_tensor_ndim(t));
    }
    if (!rc && !(rc = tmd_mkdirs(dir, err, errlen)) && !(rc = write_weights(ctx, &p, rd, ckpt, dir, err, errlen)))
        rc = write_config(dir, c, dt, err, errlen);
    /* The byte tokenizer's vocabulary (as write_config's eos): its tokenizer goes beside. */
    if (!rc && c->vocab_size == 257) rc = tmd_hf_write_byte_tokenizer(dir, c->max_seq_len, err, errlen);
    plan_free(&p);
    return rc;
}

int tmd_hf_export(tm_ctx *ctx, tm_model *model, const char *dir, char *err, size_t errlen) {
    if (!ctx || !model || !dir)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "tmd_hf_export: ctx, model and dir are required");
    return export_model(ctx, model, NULL, NULL, dir, err, errlen);
}

int tmd_hf_export_ckpt(const char *ckpt, const char *dir, tmd_loaded_model *out, int64_t *params, int64_t *active,
                       char *err, size_t errlen) {
    if (!ckpt || !dir || !out)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "tmd_hf_export_ckpt: ckpt, dir and out are required");
    memset(out, 0, sizeof *out);
    int rc = tmd_ckpt_resolve(ckpt, out->path, sizeof out->path, err, errlen);
    if (!rc) rc = tmd_ckpt_read_meta(out->path, &out->cfg, &out->state, err, errlen);
    if (rc) return rc;
    tmd_config *c = &out->cfg;
    c->device = TMD_DEVICE_CPU; /* export only reads the weights */
    char e[1024];
    if (tmd_config_validate(c, e, sizeof e))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "checkpoint '%s': %s", out->path, e);
    /* The model as metadata only: its parameters placed (names, shapes) but never given
     * memory (the deferral is not ended); the bytes come from the file, one parameter at a
     * time, straight into the export's buffers. */
    tm_ctx_options o = tm_ctx_options_default();
    o.no_grad_buffers = 1;
    if (tm_ctx_new(&out->ctx, &o)) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "%s", tm_last_create_error());
    tm_device dev = {TM_DEVICE_CPU, 0};
    tm_ckpt_reader *rd = NULL;
    tm_status s = tm_ctx_defer_params(out->ctx);
    if (!s) s = tm_model_new(out->ctx, &c->model, c->dtype == TMD_DTYPE_BF16 ? TM_BF16 : TM_F32, dev, &out->model);
    if (!s) s = tm_ckpt_reader_open(out->ctx, out->path, &rd);
    if (s) {
        rc = tmd_fail(err, errlen, s == TM_ERR_NOMEM ? TMD_RUNTIME_ERROR : TMD_CONFIG_ERROR, "loading '%s': %s",
                      out->path, tm_ctx_errmsg(out->ctx));
    } else {
        *params = tm_model_num_params(out->model, active);
        rc = export_model(out->ctx, out->model, rd, out->path, dir, err, errlen);
    }
    tm_ckpt_reader_close(rd);
    return rc;
}

/* ---- import ------------------------------------------------------------------------------- */

/* The file's tensor of that name: tmd_st_open sorts them by name, so this is a binary search
 * (a linear one per plan entry made a 100,000-tensor import quadratic: over a minute). */
static const tmd_st_tensor *file_find(const tmd_st_file *f, const char *name) {
    int lo = 0, hi = f->n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(f->t[mid].name, name);
        if (!c) return &f->t[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

static void fmt_shape(char *b, size_t len, int ndim, const int64_t *s) {
    size_t n = (size_t)snprintf(b, len, "[");
    for (int i = 0; i < ndim && n < len; i++) n += (size_t)snprintf(b + n, len - n, "%s%lld", i ? ", " : "", (long long)s[i]);
    if (n < len) snprintf(b + n, len - n, "]");
}

int tmd_hf_import(tm_ctx *ctx, tm_model *model, const char *dir, char *err, size_t errlen) {
    if (!ctx || !model || !dir)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "tmd_hf_import: ctx, model and dir are required");
    if (!tmd_st_host_supported())
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "import: big-endian hosts are not supported");
    char path[PATH_MAX], index[PATH_MAX];
    if (join(path, sizeof path, dir, TMD_HF_WEIGHTS_FILE) || join(index, sizeof index, dir, "model.safetensors.index.json"))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "path '%s' is too long", dir);
    if (access(path, F_OK) != 0 && access(index, F_OK) == 0)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "'%s': sharded checkpoints are not supported (merge the shards into one %s)", index,
                        TMD_HF_WEIGHTS_FILE);
    hf_plan p;
    int rc = plan_build(ctx, model, &p, err, errlen);
    if (rc) return rc;
    tmd_st_file f;
    if ((rc = tmd_st_open(path, &f, err, errlen))) {
        plan_free(&p);
        return rc;
    }
    rc = TMD_CONFIG_ERROR;
    float *buf = NULL;
    unsigned char *used = calloc((size_t)f.n + 1, 1);
    if (!used) {
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "import: out of memory (%d tensors)", f.n);
        goto out;
    }
    /* Each plan entry finds its file tensor; a file tensor no entry found is foreign. The
     * plan's names are unique, so a file tensor is found at most once. */
    for (int i = 0; i < p.n; i++) {
        const tmd_st_tensor *t = file_find(&f, p.e[i].name);
        if (t) used[t - f.t] = 1;
    }
    for (int i = 0; i < f.n; i++)
        if (!used[i]) {
            tmd_fail(err, errlen, rc, "'%s': tensor '%s' is not part of this Mixtral model (unknown tensor)", path,
                     f.t[i].name);
            goto out;
        }
    for (int i = 0; i < p.n; i++) {
        hf_entry *e = &p.e[i];
        const tmd_st_tensor *t = file_find(&f, e->name);
        if (!t) continue; /* reported below, with the count of missing ones */
        if (t->kind == TMD_ST_OTHER) {
            tmd_fail(err, errlen, rc, "'%s': tensor '%s' has dtype %s; expected F32, BF16 or F16", path, t->name,
                     t->dtype);
            goto out;
        }
        int same = t->ndim == e->ndim && t->shape[0] == e->shape[0] && (e->ndim == 1 || t->shape[1] == e->shape[1]);
        if (!same) {
            char got[96], want[64];
            fmt_shape(got, sizeof got, t->ndim, t->shape);
            fmt_shape(want, sizeof want, e->ndim, e->shape);
            tmd_fail(err, errlen, rc, "'%s': tensor '%s' has shape %s; the model needs %s", path, t->name, got, want);
            goto out;
        }
        e->src = t->data;
        e->src_dtype = t->kind;
    }
    int missing = 0;
    const char *first = NULL;
    for (int i = 0; i < p.n; i++)
        if (!p.e[i].src) {
            if (!missing++) first = p.e[i].name;
        }
    if (missing) {
        tmd_fail(err, errlen, rc, "'%s': tensor '%s' is missing%s (%d of the model's %d tensors absent)", path, first,
                 missing > 1 ? ", among others" : "", missing, p.n);
        goto out;
    }
    /* Everything checked: now write, one parameter at a time through an f32 staging buffer. */
    int64_t max_numel = 1;
    for (int i = 0; i < p.n; i++)
        if (tm_tensor_numel(p.e[i].t) > max_numel) max_numel = tm_tensor_numel(p.e[i].t);
    buf = malloc((size_t)max_numel * sizeof(float));
    if (!buf) {
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "import: out of memory (%lld floats)", (long long)max_numel);
        goto out;
    }
    for (int i = 0; i < p.n;) {
        tm_tensor *t = p.e[i].t;
        for (; i < p.n && p.e[i].t == t; i++) {
            const hf_entry *e = &p.e[i];
            size_t es = e->src_dtype == TMD_ST_F32 ? 4 : 2;
            const unsigned char *src = e->src;
            for (int64_t r = 0; r < e->shape[0]; r++)
                for (int64_t c = 0; c < e->shape[1]; c++, src += es)
                    buf[tm_index(e, r, c)] = tmd_st_to_float(src, e->src_dtype);
        }
        if (tm_tensor_write(ctx, t, TM_F32, buf, tm_tensor_numel(t)) != TM_OK) {
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "writing parameter '%s': %s", tm_tensor_name(t),
                          tm_ctx_errmsg(ctx));
            goto out;
        }
    }
    rc = 0;
out:
    free(used);
    free(buf);
    tmd_st_close(&f);
    plan_free(&p);
    return rc;
}

/* ---- config.json -------------------------------------------------------------------------- */

typedef struct jcfg {
    const cJSON *root;
    const char *path;
    char *err;
    size_t errlen;
} jcfg;

/* A short rendering of a JSON value for messages. */
static const char *jshow(const cJSON *v, char *b, size_t len) {
    if (cJSON_IsNumber(v)) snprintf(b, len, "%.17g", v->valuedouble);
    else if (cJSON_IsString(v)) snprintf(b, len, "\"%.40s\"", v->valuestring);
    else if (cJSON_IsBool(v)) snprintf(b, len, "%s", cJSON_IsTrue(v) ? "true" : "false");
    else if (cJSON_IsNull(v)) snprintf(b, len, "null");
    else snprintf(b, len, "%s", cJSON_IsArray(v) ? "an array" : "an object");
    return b;
}

static const cJSON *jget(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return v && !cJSON_IsNull(v) ? v : NULL; /* null means "the default", as in transformers */
}

static int j_int(const jcfg *j, const char *key, int def, int lo, int *out) {
    const cJSON *v = jget(j->root, key);
    if (!v) {
        *out = def;
        return 0;
    }
    char b[64];
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo || v->valuedouble > INT_MAX)
        return tmd_fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s = %s must be an integer >= %d", j->path, key,
                        jshow(v, b, sizeof b), lo);
    *out = (int)v->valuedouble;
    return 0;
}

static int j_num(const jcfg *j, const cJSON *obj, const char *key, double def, int positive, double *out) {
    const cJSON *v = jget(obj, key);
    if (!v) {
        *out = def;
        return 0;
    }
    char b[64];
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble < 0 || (positive && v->valuedouble == 0))
        return tmd_fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s = %s must be a number %s 0", j->path, key,
                        jshow(v, b, sizeof b), positive ? ">" : ">=");
    *out = v->valuedouble;
    return 0;
}

static int j_bool(const jcfg *j, const char *key, int def, int *out) {
    const cJSON *v = jget(j->root, key);
    char b[64];
    if (v && !cJSON_IsBool(v))
        return tmd_fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s = %s must be true or false", j->path, key,
                        jshow(v, b, sizeof b));
    *out = v ? cJSON_IsTrue(v) : def;
    return 0;
}

static int j_str(const jcfg *j, const cJSON *obj, const char *key, const char **out) {
    const cJSON *v = jget(obj, key);
    char b[64];
    if (v && !cJSON_IsString(v))
        return tmd_fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s = %s must be a string", j->path, key,
                        jshow(v, b, sizeof b));
    *out = v ? v->valuestring : NULL;
    return 0;
}

/* rope_parameters (transformers 5) or rope_scaling (4.x): plain RoPE only; its rope_theta, if
 * any, into *theta. */
static int check_rope(const jcfg *j, const char *field, double *theta, int *has_theta) {
    const cJSON *r = jget(j->root, field), *m;
    if (!r) return 0;
    if (!cJSON_IsObject(r))
        return tmd_fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s must be an object", j->path, field);
    cJSON_ArrayForEach(m, r) {
        char b[64];
        if (!strcmp(m->string, "rope_type") || !strcmp(m->string, "type")) {
            if (!cJSON_IsString(m) || strcmp(m->valuestring, "default"))
                return tmd_fail(j->err, j->errlen, TMD_CONFIG_ERROR,
                                "'%s': %s.%s = %s: tinymoe implements plain rotary embeddings only (\"default\")",
                                j->path, field, m->string, jshow(m, b, sizeof b));
        } else if (!strcmp(m->string, "rope_theta")) {
            if (j_num(j, r, "rope_theta", 0, 1, theta)) return TMD_CONFIG_ERROR;
            *has_theta = 1;
        } else if (!strcmp(m->string, "partial_rotary_factor")) {
            if (!cJSON_IsNumber(m) || m->valuedouble != 1.0)
                return tmd_fail(j->err, j->errlen, TMD_CONFIG_ERROR,
                                "'%s': %s.partial_rotary_factor = %s: tinymoe rotates whole heads (1.0)", j->path,
                                field, jshow(m, b, sizeof b));
        } else {
            return tmd_fail(j->err, j->errlen, TMD_CONFIG_ERROR,
                            "'%s': %s.%s is not supported (plain rotary embeddings only)", j->path, field, m->string);
        }
    }
    return 0;
}

static int cmp_cstr(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* The first (in sorted order) member name of obj that appears twice, in *dup (NULL: none).
 * -1 when out of memory. */
static int repeated_key(const cJSON *obj, const char **dup) {
    *dup = NULL;
    size_t n = 0, i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, obj) n++;
    const char **names = malloc(sizeof *names * (n ? n : 1));
    if (!names) return -1;
    cJSON_ArrayForEach(m, obj) names[i++] = m->string;
    qsort(names, n, sizeof *names, cmp_cstr);
    for (i = 1; i < n && !*dup; i++)
        if (!strcmp(names[i - 1], names[i])) *dup = names[i];
    free(names);
    return 0;
}

static int parse_config(const jcfg *j, tm_model_config *mc, int *dtype_bf16) {
    char *err = j->err;
    size_t errlen = j->errlen;
    const char *path = j->path;
    const int E = TMD_CONFIG_ERROR;
    const cJSON *a;
    /* transformers (Python's json) takes the last of repeated keys, cJSON the first: refuse.
     * Sorted, not compared pairwise: a file of 200,000 keys took 93 s that way. */
    const char *dup = NULL;
    if (repeated_key(j->root, &dup)) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "'%s': out of memory", path);
    if (dup) return tmd_fail(err, errlen, E, "'%s': key \"%s\" appears twice", path, dup);
    const char *s;
    if (j_str(j, j->root, "model_type", &s)) return E;
    if (!s || strcmp(s, "mixtral"))
        return tmd_fail(err, errlen, E, "'%s': model_type = \"%s\": not a Mixtral config (\"mixtral\")", path,
                        s ? s : "(missing)");
    const cJSON *arch = jget(j->root, "architectures");
    if (arch) {
        int found = 0;
        cJSON_ArrayForEach(a, arch) found |= cJSON_IsString(a) && !strcmp(a->valuestring, "MixtralForCausalLM");
        if (!cJSON_IsArray(arch) || !found)
            return tmd_fail(err, errlen, E, "'%s': architectures does not list MixtralForCausalLM", path);
    }
    if (jget(j->root, "quantization_config"))
        return tmd_fail(err, errlen, E, "'%s': quantization_config: quantized checkpoints are not supported", path);
    if (j_str(j, j->root, "hidden_act", &s)) return E;
    if (s && strcmp(s, "silu"))
        return tmd_fail(err, errlen, E, "'%s': hidden_act = \"%s\": tinymoe's experts are SwiGLU (\"silu\")", path, s);

    /* Defaults: MixtralConfig's, which is what transformers uses for a missing field. */
    int V = 0, H = 0, F = 0, L = 0, nh = 0, nkv = 0, hd = 0, maxpos = 0, tie = 0, ne = 0, k = 0, sw = 0;
    double eps = 0, theta = 1e6, std = 0, aux = 0;
    int has_theta = 0;
    if (j_int(j, "vocab_size", 32000, 1, &V) || j_int(j, "hidden_size", 4096, 1, &H) ||
        j_int(j, "intermediate_size", 14336, 1, &F) || j_int(j, "num_hidden_layers", 32, 1, &L) ||
        j_int(j, "num_attention_heads", 32, 1, &nh) || j_int(j, "num_key_value_heads", nh, 1, &nkv) ||
        j_int(j, "max_position_embeddings", 4096 * 32, 1, &maxpos) || j_int(j, "num_local_experts", 8, 1, &ne) ||
        j_int(j, "num_experts_per_tok", 2, 1, &k) || j_bool(j, "tie_word_embeddings", 0, &tie) ||
        j_num(j, j->root, "rms_norm_eps", 1e-5, 0, &eps) || j_num(j, j->root, "initializer_range", 0.02, 0, &std) ||
        j_num(j, j->root, "router_aux_loss_coef", 0.001, 0, &aux))
        return E;
    if (H % nh)
        return tmd_fail(err, errlen, E, "'%s': num_attention_heads = %d does not divide hidden_size = %d", path, nh, H);
    if ((H / nh) % 2)
        return tmd_fail(err, errlen, E, "'%s': head size hidden_size / num_attention_heads = %d is odd (rotary pairs)",
                        path, H / nh);
    if (j_int(j, "head_dim", H / nh, 1, &hd)) return E;
    if (hd != H / nh)
        return tmd_fail(err, errlen, E,
                        "'%s': head_dim = %d: tinymoe needs head_dim = hidden_size / num_attention_heads = %d", path,
                        hd, H / nh);
    if (nh % nkv)
        return tmd_fail(err, errlen, E, "'%s': num_key_value_heads = %d does not divide num_attention_heads = %d", path,
                        nkv, nh);
    if (k > ne)
        return tmd_fail(err, errlen, E, "'%s': num_experts_per_tok = %d exceeds num_local_experts = %d", path, k, ne);
    if (j_int(j, "sliding_window", INT_MAX, 1, &sw)) return E;
    if (sw < maxpos)
        return tmd_fail(err, errlen, E,
                        "'%s': sliding_window = %d is shorter than max_position_embeddings = %d: tinymoe attends to "
                        "the whole context",
                        path, sw, maxpos);
    if (check_rope(j, "rope_scaling", &theta, &has_theta) || check_rope(j, "rope_parameters", &theta, &has_theta)) return E;
    if (!has_theta && j_num(j, j->root, "rope_theta", 1e6, 1, &theta)) return E;
    const char *dt = NULL, *dkey = "torch_dtype";
    if (j_str(j, j->root, "torch_dtype", &dt)) return E;
    if (!dt) {
        dkey = "dtype";
        if (j_str(j, j->root, "dtype", &dt)) return E;
    }
    int bf16 = 0;
    if (dt && !strcmp(dt, "bfloat16")) bf16 = 1;
    else if (dt && strcmp(dt, "float32") && strcmp(dt, "float16"))
        return tmd_fail(err, errlen, E, "'%s': %s = \"%s\": tinymoe loads float32, bfloat16 or float16 weights", path,
                        dkey, dt);

    tm_model_config c = tm_model_config_default();
    c.vocab_size = V;
    c.d_model = H;
    c.n_layers = L;
    c.n_heads = nh;
    c.n_kv_heads = nkv;
    c.max_seq_len = maxpos;
    c.rope_theta = theta;
    c.norm_eps = eps;
    c.tie_embeddings = tie;
    c.first_k_dense = 0;
    c.dense_ffn_size = 0;
    c.init_std = std;
    c.moe.hidden_size = H;
    c.moe.ffn_size = F;
    c.moe.router = tm_router_config_default();
    c.moe.router.num_experts = ne;
    c.moe.router.topk = k;
    c.moe.router.score_function = TM_SCORE_SOFTMAX;
    c.moe.router.use_pre_softmax = 1;
    c.moe.router.norm_topk_prob = 1;
    c.moe.router.num_groups = 0;
    c.moe.router.group_topk = 0;
    c.moe.router.scaling_factor = 1.0;
    c.moe.use_expert_bias = 0;
    c.moe.shared_ffn_size = 0;
    c.moe.capacity_factor = 0;
    c.moe.pad_to_capacity = 0;
    c.moe.apply_topk_weights_early = 0;
    c.moe.aux_loss_coeff = aux;
    if (tm_model_config_check(NULL, &c) != TM_OK)
        return tmd_fail(err, errlen, E, "'%s': the config does not describe a valid tinymoe model", path);
    *mc = c;
    if (dtype_bf16) *dtype_bf16 = bf16;
    return 0;
}

int tmd_hf_read_config(const char *dir, tm_model_config *mc, int *dtype_bf16, char *err, size_t errlen) {
    if (!dir || !mc) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "tmd_hf_read_config: dir and mc are required");
    char path[PATH_MAX];
    if (join(path, sizeof path, dir, TMD_HF_CONFIG_FILE))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "path '%s' is too long", dir);
    unsigned char *img;
    size_t len;
    /* A model config is a few KB; 64 MiB is far beyond any real one and bounds the parse. */
    int rc = tmd_read_file(path, (size_t)64 << 20, &img, &len, err, errlen);
    if (rc) return rc;
    cJSON *root = cJSON_ParseWithLength((const char *)img, len);
    if (!root || !cJSON_IsObject(root)) {
        const char *at = cJSON_GetErrorPtr();
        rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s' is not a JSON object%s", path,
                      root || !at ? "" : " (invalid JSON)");
    } else {
        jcfg j = {root, path, err, errlen};
        rc = parse_config(&j, mc, dtype_bf16);
    }
    cJSON_Delete(root);
    free(img);
    return rc;
}

/* ---- tinymoe export ------------------------------------------------------------------------- */

static const char EXPORT_USAGE[] =
    "usage: tinymoe export --ckpt PATH [--format hf] --out DIR\n"
    "\n"
    "Writes the model of a checkpoint (PATH: a .tmck file, or a run directory: its newest\n"
    "checkpoint) as a Hugging Face MixtralForCausalLM: DIR/config.json and DIR/model.safetensors,\n"
    "loadable with transformers' from_pretrained(DIR) and with 'tinymoe train --init-from DIR';\n"
    "and DIR/tokenizer.json when the run has a tokenizer (tokenizer.json beside the checkpoint, or\n"
    "the file its key 'tokenizer' names) with tokenizer_config.json and generation_config.json\n"
    "(eos: the tokenizer's end-of-text token), for transformers' AutoTokenizer and pipelines.\n"
    "Only Mixtral-expressible models export: softmax router with top-k weights summing to 1,\n"
    "no groups, expert bias, shared experts or dense layers, scaling 1, dropless, weights on\n"
    "the expert outputs (not apply_topk_weights_early); f32 or bf16.\n"
    "\n"
    "  --ckpt PATH   checkpoint file or directory\n"
    "  --format hf   the output format (hf is the only one, and the default)\n"
    "  --out DIR     output directory (created if missing; existing files of those names replaced)\n"
    "\n"
    "exit status: 0 ok, 1 runtime error, 2 usage error or a model Mixtral cannot express\n";

int tmd_export_main(int argc, char **argv) {
    const char *ckpt = NULL, *format = "hf", *out = NULL;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(EXPORT_USAGE, stdout);
            return TMD_OK;
        }
        static const char *const flags[] = {"--ckpt", "--format", "--out"};
        const char **dst[] = {&ckpt, &format, &out};
        int f = -1;
        const char *v = NULL;
        for (int k = 0; k < 3; k++) {
            size_t n = strlen(flags[k]);
            if (!strncmp(a, flags[k], n) && (a[n] == 0 || a[n] == '=')) {
                f = k;
                v = a[n] == '=' ? a + n + 1 : i + 1 < argc ? argv[++i] : NULL;
            }
        }
        if (f < 0) {
            fprintf(stderr, "tinymoe: export: unknown argument '%s' (see 'tinymoe export --help')\n", a);
            return TMD_CONFIG_ERROR;
        }
        if (!v || !*v) {
            fprintf(stderr, "tinymoe: export: %s needs a value\n", flags[f]);
            return TMD_CONFIG_ERROR;
        }
        *dst[f] = v;
    }
    if (strcmp(format, "hf")) {
        fprintf(stderr, "tinymoe: export: --format %s is not a known format (hf)\n", format);
        return TMD_CONFIG_ERROR;
    }
    if (!ckpt || !out) {
        fprintf(stderr, "tinymoe: export: %s is required (see 'tinymoe export --help')\n", !ckpt ? "--ckpt" : "--out");
        return TMD_CONFIG_ERROR;
    }
    char err[2048];
    tmd_loaded_model lm;
    int64_t total = 0, active = 0;
    /* Streamed from the file on the CPU, whatever the checkpoint trained on. */
    int rc = tmd_hf_export_ckpt(ckpt, out, &lm, &total, &active, err, sizeof err);
    /* The run's subword tokenizer goes beside the model, as on the Hub (a byte-level model's
     * was written by tmd_hf_export). */
    char tok[TMD_PATH_MAX + 32] = "";
    if (!rc) tmd_tokenizer_file_of_ckpt(lm.path, &lm.cfg, tok, sizeof tok);
    if (!rc && tok[0]) rc = tmd_tokenizer_copy(tok, out, err, sizeof err);
    /* and its tokenizer_config.json / generation_config.json, eos from its end-of-text token */
    int eos = -1;
    if (!rc && tok[0]) {
        tmd_bpe *bpe = NULL;
        rc = tmd_bpe_load(tok, &bpe, err, sizeof err);
        const unsigned char *eb = NULL;
        int el = rc ? -1 : (eos = tmd_bpe_eot(bpe)) >= 0 ? tmd_bpe_token_bytes(bpe, eos, &eb) : -1;
        char eos_text[64] = "";
        if (el > 0 && el < (int)sizeof eos_text) memcpy(eos_text, eb, (size_t)el);
        if (!rc)
            rc = tmd_hf_write_token_configs(out, el > 0 ? eos_text : NULL, eos, tm_model_get_config(lm.model)->max_seq_len,
                                            err, sizeof err);
        tmd_bpe_free(bpe);
    }
    if (rc) {
        fprintf(stderr, "tinymoe: export: %s\n", err);
    } else {
        printf("exported %s (step %lld, %lld parameters, %lld active per token) to %s/%s and %s/%s%s", lm.path,
               (long long)lm.state.step, (long long)total, (long long)active, out, TMD_HF_CONFIG_FILE, out, TMD_HF_WEIGHTS_FILE,
               tm_model_get_config(lm.model)->vocab_size == 257
                   ? ", with the byte tokenizer (tokenizer.json, tokenizer_config.json, generation_config.json)"
                   : "");
        if (tok[0]) {
            printf(", and %s as %s/%s with tokenizer_config.json and generation_config.json (eos ", tok, out,
                   TMD_TOKENIZER_FILE);
            if (eos >= 0) printf("%d)", eos);
            else printf("none: the tokenizer has no end-of-text token)");
        }
        printf("\n");
        /* The weights are a model's like any other; only the routing it trained under was not
         * its own, and a Mixtral has no such switch. */
        if (lm.cfg.model.moe.router.force_load_balance)
            fprintf(stderr,
                    "tinymoe: export: note: %s was trained with force_load_balance = true (routing forced round robin, "
                    "a benchmark setting); the exported Mixtral routes by its router's scores (top-%d), so its outputs "
                    "are not the training run's\n",
                    lm.path, lm.cfg.model.moe.router.topk);
    }
    tmd_loaded_model_free(&lm);
    return rc;
}
