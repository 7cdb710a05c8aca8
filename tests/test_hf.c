/*
 * test_hf.c — Hugging Face Mixtral export / import (train/hf.c).
 *
 * Round trips (export, read config.json back, import into a fresh model) must give bitwise
 * identical logits for MHA and GQA, tied and untied, top-1 and top-2, f32 and bf16. The files
 * are also read here independently of hf.c, with cJSON and the safetensors format as published:
 * the header's layout, names, dtypes, shapes and offsets, and each HF matrix against the
 * tinymoe parameter it must be the transpose (or copy) of. Refusals name the config key;
 * corrupt files name the file and tensor and leave the model untouched.
 *
 * With TM_HF_DUMP_DIR set, hf/transformers_reference also writes a trained model's export,
 * tokens and tinymoe logits (.npy) there for tests/gpu/hf_check.py, which compares them with
 * transformers' MixtralForCausalLM.
 */
#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "common.h"
#include "config.h"
#include "hf.h"
#include "status.h"
#include "run.h"
#include "train.h"

static void setup(void) { tt_tmpdir_make("tm_test_hf_"); }
static void teardown(void) { tt_tmpdir_remove(); }
TestSuite(hf, .init = setup, .fini = teardown);

/* ---- models ------------------------------------------------------------------------------- */

static tm_model_config small_config(int n_kv_heads, int tie, int topk) {
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 257;
    c.d_model = 32;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = n_kv_heads;
    c.max_seq_len = 24;
    c.rope_theta = 500.0; /* small theta: positions turn the rotary angles visibly */
    c.norm_eps = 1e-6;
    c.tie_embeddings = tie;
    c.init_std = 0.15; /* logits of a few units, routing far from uniform */
    c.moe.ffn_size = 24;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = topk;
    c.moe.router.use_pre_softmax = 1;
    c.moe.router.norm_topk_prob = 1;
    c.moe.aux_loss_coeff = 0.02;
    return c;
}

/* A model with seeded weights; norm weights drawn around 1 so that swapping two norms, or a
 * norm for another, changes the logits. */
static tm_model *make_model(tm_ctx *ctx, const tm_model_config *c, tm_dtype dt, uint64_t seed) {
    tm_model *m;
    TT_OK(ctx, tm_model_new(ctx, c, dt, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, seed));
    char name[64];
    for (int l = 0; l < c->n_layers; l++) {
        snprintf(name, sizeof name, "layers.%d.attn_norm.weight", l);
        TT_OK(ctx, tm_tensor_init_normal(ctx, tm_ctx_find(ctx, name), seed, NULL, 1.0, 0.3));
        snprintf(name, sizeof name, "layers.%d.ffn_norm.weight", l);
        TT_OK(ctx, tm_tensor_init_normal(ctx, tm_ctx_find(ctx, name), seed, NULL, 1.0, 0.3));
    }
    TT_OK(ctx, tm_tensor_init_normal(ctx, tm_ctx_find(ctx, "norm.weight"), seed, NULL, 1.0, 0.3));
    return m;
}

static void random_tokens(int32_t *tok, int n, int vocab, uint64_t seed) {
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int32_t)((s >> 33) % (uint64_t)vocab);
    }
}

/* Logits [B,T,V] of the model on tokens, as f32 (malloc'd). */
static float *logits_of(tm_ctx *ctx, tm_model *m, const int32_t *tok, int B, int T) {
    int64_t shape[2] = {B, T};
    tm_tensor *t;
    int prev = tm_ctx_set_grad_enabled(ctx, 0);
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, shape, tm_cpu(), TM_I32, tok, &t));
    tm_model_out o;
    TT_OK(ctx, tm_model_forward(m, t, NULL, &o));
    int64_t n = tm_tensor_numel(o.logits);
    float *out = malloc((size_t)n * sizeof(float));
    TT_OK(ctx, tm_tensor_read(ctx, o.logits, TM_F32, out, n));
    tm_ctx_set_grad_enabled(ctx, prev);
    tm_ctx_arena_reset(ctx);
    return out;
}

/* Every parameter's bytes, concatenated (malloc'd), to show a failed import changed nothing. */
static unsigned char *param_bytes(tm_ctx *ctx, size_t *len) {
    size_t n = 0;
    for (int i = 0; i < tm_ctx_num_params(ctx); i++) {
        tm_tensor *t = tm_ctx_param(ctx, i);
        n += (size_t)tm_tensor_numel(t) * tm_dtype_size(tm_tensor_dtype(t));
    }
    unsigned char *b = malloc(n + 1), *p = b;
    for (int i = 0; i < tm_ctx_num_params(ctx); i++) {
        tm_tensor *t = tm_ctx_param(ctx, i);
        TT_OK(ctx, tm_tensor_read(ctx, t, tm_tensor_dtype(t), p, tm_tensor_numel(t)));
        p += (size_t)tm_tensor_numel(t) * tm_dtype_size(tm_tensor_dtype(t));
    }
    *len = n;
    return b;
}

/* ---- an independent safetensors reader ---------------------------------------------------- */

typedef struct stf {
    unsigned char *img;
    long len;
    uint64_t n;       /* header length */
    cJSON *hdr;
    unsigned char *data;
    uint64_t data_len;
} stf;

static stf stf_load(const char *path) {
    stf f;
    memset(&f, 0, sizeof f);
    f.img = tt_slurp(path, &f.len);
    cr_assert_geq(f.len, 8);
    for (int i = 7; i >= 0; i--) f.n = f.n << 8 | f.img[i];
    cr_assert_leq(f.n, (uint64_t)f.len - 8);
    f.hdr = cJSON_ParseWithLength((const char *)f.img + 8, (size_t)f.n);
    cr_assert(f.hdr, "%s: header is not JSON", path);
    f.data = f.img + 8 + f.n;
    f.data_len = (uint64_t)f.len - 8 - f.n;
    return f;
}

static void stf_free(stf *f) {
    cJSON_Delete(f->hdr);
    free(f->img);
}

/* The bytes of tensor `name` (asserting it exists, with the dtype and 2-d or 1-d shape). */
static const unsigned char *stf_tensor(const stf *f, const char *name, const char *dtype, int64_t d0, int64_t d1) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(f->hdr, name);
    cr_assert(e, "tensor %s missing", name);
    cr_assert_str_eq(cJSON_GetObjectItem(e, "dtype")->valuestring, dtype, "%s dtype", name);
    const cJSON *s = cJSON_GetObjectItem(e, "shape");
    cr_assert_eq(cJSON_GetArraySize(s), d1 ? 2 : 1, "%s ndim", name);
    cr_assert_eq((int64_t)cJSON_GetArrayItem(s, 0)->valuedouble, d0, "%s dim 0", name);
    if (d1) cr_assert_eq((int64_t)cJSON_GetArrayItem(s, 1)->valuedouble, d1, "%s dim 1", name);
    const cJSON *o = cJSON_GetObjectItem(e, "data_offsets");
    return f->data + (uint64_t)cJSON_GetArrayItem(o, 0)->valuedouble;
}

/* Write a safetensors file from a header tree and data bytes (header padded to 8 bytes). */
static void stf_write(const char *path, const cJSON *hdr, const unsigned char *data, size_t data_len) {
    char *h = cJSON_PrintUnformatted(hdr);
    size_t n = strlen(h), padded = (n + 7) / 8 * 8;
    FILE *fp = fopen(path, "wb");
    cr_assert(fp, "fopen %s: %s", path, strerror(errno));
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    fwrite(len8, 1, 8, fp);
    fwrite(h, 1, n, fp);
    for (size_t i = n; i < padded; i++) fputc(' ', fp);
    if (data_len) fwrite(data, 1, data_len, fp);
    cr_assert_eq(fclose(fp), 0);
    free(h);
}

static void spit(const char *path, const void *b, size_t len) {
    FILE *fp = fopen(path, "wb");
    cr_assert(fp, "fopen %s: %s", path, strerror(errno));
    if (len) cr_assert_eq(fwrite(b, 1, len, fp), len);
    cr_assert_eq(fclose(fp), 0);
}

/* The Mixtral tensor names and shapes a config implies, built here from the HF layout. */
typedef struct expect {
    char name[96];
    int64_t d0, d1;
} expect;

static int expected_tensors(const tm_model_config *c, expect *out) {
    int n = 0;
    int64_t H = c->d_model, D = H / c->n_heads, F = c->moe.ffn_size, E = c->moe.router.num_experts;
#define EXP(D0, D1, ...) (snprintf(out[n].name, sizeof out[n].name, __VA_ARGS__), out[n].d0 = (D0), out[n].d1 = (D1), n++)
    EXP(c->vocab_size, H, "model.embed_tokens.weight");
    for (int l = 0; l < c->n_layers; l++) {
        EXP(H, 0, "model.layers.%d.input_layernorm.weight", l);
        EXP(c->n_heads * D, H, "model.layers.%d.self_attn.q_proj.weight", l);
        EXP(c->n_kv_heads * D, H, "model.layers.%d.self_attn.k_proj.weight", l);
        EXP(c->n_kv_heads * D, H, "model.layers.%d.self_attn.v_proj.weight", l);
        EXP(H, c->n_heads * D, "model.layers.%d.self_attn.o_proj.weight", l);
        EXP(H, 0, "model.layers.%d.post_attention_layernorm.weight", l);
        EXP(E, H, "model.layers.%d.block_sparse_moe.gate.weight", l);
        for (int e = 0; e < E; e++) {
            EXP(F, H, "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", l, e);
            EXP(H, F, "model.layers.%d.block_sparse_moe.experts.%d.w2.weight", l, e);
            EXP(F, H, "model.layers.%d.block_sparse_moe.experts.%d.w3.weight", l, e);
        }
    }
    EXP(H, 0, "model.norm.weight");
    if (!c->tie_embeddings) EXP(c->vocab_size, H, "lm_head.weight");
#undef EXP
    return n;
}

/* ---- round trips -------------------------------------------------------------------------- */

static void assert_same_config(const tm_model_config *a, const tm_model_config *b) {
    cr_assert_eq(a->vocab_size, b->vocab_size);
    cr_assert_eq(a->d_model, b->d_model);
    cr_assert_eq(a->n_layers, b->n_layers);
    cr_assert_eq(a->n_heads, b->n_heads);
    cr_assert_eq(a->n_kv_heads, b->n_kv_heads);
    cr_assert_eq(a->max_seq_len, b->max_seq_len);
    cr_assert_eq(a->rope_theta, b->rope_theta);
    cr_assert_eq(a->norm_eps, b->norm_eps);
    cr_assert_eq(a->tie_embeddings, b->tie_embeddings);
    cr_assert_eq(a->first_k_dense, 0);
    cr_assert_eq(b->first_k_dense, 0);
    cr_assert_eq(a->init_std, b->init_std);
    cr_assert_eq(a->moe.ffn_size, b->moe.ffn_size);
    cr_assert_eq(a->moe.router.num_experts, b->moe.router.num_experts);
    cr_assert_eq(a->moe.router.topk, b->moe.router.topk);
    cr_assert_eq(b->moe.router.score_function, TM_SCORE_SOFTMAX);
    cr_assert_eq(b->moe.router.use_pre_softmax, 1);
    cr_assert_eq(b->moe.router.norm_topk_prob, 1);
    cr_assert_eq(b->moe.router.scaling_factor, 1.0);
    cr_assert_eq(b->moe.use_expert_bias, 0);
    cr_assert_eq(b->moe.shared_ffn_size, 0);
    cr_assert_eq(b->moe.capacity_factor, 0.0);
    cr_assert_eq(a->moe.aux_loss_coeff, b->moe.aux_loss_coeff);
}

/* Export a seeded model, read the config back, import into a model built from it in a new
 * context, and compare logits. exact: bitwise; else within 1e-5 relative to the largest. */
static void round_trip(const tm_model_config *c, tm_dtype dt, int exact) {
    const char *dir = tt_path("export");
    char err[1024] = "";
    tm_ctx *a = tt_ctx();
    tm_model *ma = make_model(a, c, dt, 11);
    int rc = tmd_hf_export(a, ma, dir, err, sizeof err);
    cr_assert_eq(rc, 0, "export: %s", err);
    /* vocab 257 is the byte tokenizer's: its three tokenizer files go beside (test_hf_tokenizer.c) */
    cr_assert_eq(tt_dir_entries(dir), c->vocab_size == 257 ? 5 : 2,
                 "config.json and model.safetensors (and the byte tokenizer's files), no temporaries");

    tm_model_config rc_cfg;
    int bf16 = -1;
    rc = tmd_hf_read_config(dir, &rc_cfg, &bf16, err, sizeof err);
    cr_assert_eq(rc, 0, "read config: %s", err);
    cr_assert_eq(bf16, dt == TM_BF16);
    assert_same_config(tm_model_get_config(ma), &rc_cfg);

    tm_ctx *b = tt_ctx();
    tm_model *mb;
    TT_OK(b, tm_model_new(b, &rc_cfg, bf16 ? TM_BF16 : TM_F32, tm_cpu(), &mb));
    enum { B = 2, T = 24 };
    int32_t tok[B * T];
    random_tokens(tok, B * T, c->vocab_size, 5);
    float *want = logits_of(a, ma, tok, B, T), *before = logits_of(b, mb, tok, B, T);
    int64_t n = (int64_t)B * T * c->vocab_size;
    cr_assert_neq(memcmp(want, before, (size_t)n * 4), 0, "the fresh model differs before the import");
    rc = tmd_hf_import(b, mb, dir, err, sizeof err);
    cr_assert_eq(rc, 0, "import: %s", err);
    float *got = logits_of(b, mb, tok, B, T);
    if (exact) {
        for (int64_t i = 0; i < n; i++)
            cr_assert_eq(memcmp(&got[i], &want[i], 4), 0, "logit %lld: %.9g after the round trip, %.9g before", (long long)i,
                         got[i], want[i]);
    } else {
        double mx = 0, ref = 0;
        for (int64_t i = 0; i < n; i++) {
            mx = fmax(mx, fabs((double)got[i] - want[i]));
            ref = fmax(ref, fabs((double)want[i]));
        }
        cr_assert(ref > 0.5, "logits of a few units (max %g)", ref);
        cr_assert_leq(mx, 1e-5 * ref, "max |diff| %g vs max |logit| %g", mx, ref);
    }
    free(want);
    free(before);
    free(got);
    tm_model_free(ma);
    tm_model_free(mb);
    tm_ctx_free(a);
    tm_ctx_free(b);
}

Test(hf, round_trip_f32_gqa_untied) {
    tm_model_config c = small_config(2, 0, 2);
    round_trip(&c, TM_F32, 1);
}

Test(hf, round_trip_f32_mha_tied) {
    tm_model_config c = small_config(4, 1, 2);
    round_trip(&c, TM_F32, 1);
}

Test(hf, round_trip_f32_top1_mqa) {
    tm_model_config c = small_config(1, 0, 1);
    round_trip(&c, TM_F32, 1);
}

Test(hf, round_trip_bf16_gqa_untied) {
    tm_model_config c = small_config(2, 0, 2);
    round_trip(&c, TM_BF16, 1);
}

Test(hf, round_trip_bf16_mha_tied) {
    tm_model_config c = small_config(4, 1, 2);
    round_trip(&c, TM_BF16, 1);
}

/* Softmax over the selected logits (pre_softmax = false) is Mixtral's renormalised top-k in
 * another order of operations: it exports, and comes back as pre-softmax + norm_topk_prob with
 * logits equal up to rounding. */
Test(hf, softmax_post_exports_as_mixtral) {
    tm_model_config c = small_config(2, 0, 2);
    c.moe.router.use_pre_softmax = 0;
    c.moe.router.norm_topk_prob = 0;
    round_trip(&c, TM_F32, 0);
}

/* ---- the files, read independently -------------------------------------------------------- */

static void check_header(const tm_model_config *c, tm_dtype dt) {
    const char *dir = tt_path("hdr");
    char err[1024] = "";
    tm_ctx *ctx = tt_ctx();
    tm_model *m = make_model(ctx, c, dt, 3);
    cr_assert_eq(tmd_hf_export(ctx, m, dir, err, sizeof err), 0, "%s", err);
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    stf f = stf_load(path);
    /* The data starts 8-byte aligned; the header is one JSON object padded with spaces. */
    cr_assert_eq(f.n % 8, 0, "header length %llu", (unsigned long long)f.n);
    cr_assert_eq(f.img[8], '{');
    long last = 8 + (long)f.n - 1;
    while (f.img[last] == ' ') last--;
    cr_assert_eq(f.img[last], '}', "only spaces after the JSON object");
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(f.hdr, "__metadata__");
    cr_assert(meta && cJSON_GetArraySize(meta) == 1);
    cr_assert_str_eq(cJSON_GetObjectItem(meta, "format")->valuestring, "pt");

    expect *want = calloc(1024, sizeof *want);
    int nwant = expected_tensors(c, want);
    cr_assert_eq(cJSON_GetArraySize(f.hdr), nwant + 1, "exactly the Mixtral tensors and __metadata__");
    /* Names, dtypes, shapes; and the offsets tile the data exactly. */
    uint64_t *begin = calloc((size_t)nwant, sizeof *begin), *end = calloc((size_t)nwant, sizeof *end);
    for (int i = 0; i < nwant; i++) {
        int gate = strstr(want[i].name, ".gate.weight") != NULL;
        const char *dts = dt == TM_BF16 && !gate ? "BF16" : "F32"; /* the router gate stays f32 */
        const unsigned char *p = stf_tensor(&f, want[i].name, dts, want[i].d0, want[i].d1);
        const cJSON *o = cJSON_GetObjectItem(cJSON_GetObjectItemCaseSensitive(f.hdr, want[i].name), "data_offsets");
        begin[i] = (uint64_t)cJSON_GetArrayItem(o, 0)->valuedouble;
        end[i] = (uint64_t)cJSON_GetArrayItem(o, 1)->valuedouble;
        cr_assert_eq(p, f.data + begin[i]);
        cr_assert_eq(end[i] - begin[i], (uint64_t)(want[i].d0 * (want[i].d1 ? want[i].d1 : 1)) * (strcmp(dts, "F32") ? 2 : 4),
                     "%s byte count", want[i].name);
    }
    uint64_t cursor = 0;
    for (int k = 0; k < nwant; k++) { /* walk the tensors in offset order */
        int next = -1;
        for (int i = 0; i < nwant; i++)
            if (begin[i] == cursor && end[i] > begin[i]) next = i;
        cr_assert_geq(next, 0, "no tensor starts at data offset %llu: a gap", (unsigned long long)cursor);
        cursor = end[next];
    }
    cr_assert_eq(cursor, f.data_len, "the tensors cover the data exactly");
    free(begin);
    free(end);
    free(want);
    stf_free(&f);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(hf, safetensors_header_f32_untied) {
    tm_model_config c = small_config(2, 0, 2);
    check_header(&c, TM_F32);
}

Test(hf, safetensors_header_bf16_tied) {
    tm_model_config c = small_config(2, 1, 2);
    check_header(&c, TM_BF16);
}

/* Each HF matrix against the tinymoe parameter it maps: HF linear weights are [out, in], so
 * q_proj[o][i] = wq[i][o]; experts.j.w1 / w3 / w2 are expert j of experts.w0 / w1 / wo
 * transposed; the router gate [E,H] is gate.weight^T; norms and the embedding are copies. */
Test(hf, layout_matches_tinymoe_parameters) {
    tm_model_config c = small_config(2, 0, 2);
    const char *dir = tt_path("layout");
    char err[1024] = "", path[512];
    tm_ctx *ctx = tt_ctx();
    tm_model *m = make_model(ctx, &c, TM_F32, 9);
    cr_assert_eq(tmd_hf_export(ctx, m, dir, err, sizeof err), 0, "%s", err);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    stf f = stf_load(path);
    const int64_t H = c.d_model, D = H / c.n_heads, F = c.moe.ffn_size, E = c.moe.router.num_experts, V = c.vocab_size;
    struct {
        const char *hf, *tm;
        int64_t expert, rows, cols; /* HF shape */
        int transposed;
    } cases[] = {
        {"model.embed_tokens.weight", "embed.weight", -1, V, H, 0},
        {"lm_head.weight", "lm_head.weight", -1, V, H, 1},
        {"model.norm.weight", "norm.weight", -1, H, 1, 0},
        {"model.layers.1.input_layernorm.weight", "layers.1.attn_norm.weight", -1, H, 1, 0},
        {"model.layers.1.post_attention_layernorm.weight", "layers.1.ffn_norm.weight", -1, H, 1, 0},
        {"model.layers.1.self_attn.q_proj.weight", "layers.1.attn.wq", -1, c.n_heads * D, H, 1},
        {"model.layers.1.self_attn.k_proj.weight", "layers.1.attn.wk", -1, c.n_kv_heads * D, H, 1},
        {"model.layers.0.self_attn.v_proj.weight", "layers.0.attn.wv", -1, c.n_kv_heads * D, H, 1},
        {"model.layers.0.self_attn.o_proj.weight", "layers.0.attn.wo", -1, H, c.n_heads * D, 1},
        {"model.layers.1.block_sparse_moe.gate.weight", "layers.1.moe.gate.weight", -1, E, H, 1},
        {"model.layers.1.block_sparse_moe.experts.2.w1.weight", "layers.1.moe.experts.w0", 2, F, H, 1},
        {"model.layers.1.block_sparse_moe.experts.3.w3.weight", "layers.1.moe.experts.w1", 3, F, H, 1},
        {"model.layers.0.block_sparse_moe.experts.1.w2.weight", "layers.0.moe.experts.wo", 1, H, F, 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        tm_tensor *t = tm_ctx_find(ctx, cases[k].tm);
        cr_assert(t, "%s", cases[k].tm);
        float *w = malloc((size_t)tm_tensor_numel(t) * 4);
        TT_OK(ctx, tm_tensor_read(ctx, t, TM_F32, w, tm_tensor_numel(t)));
        int64_t R = cases[k].rows, C = cases[k].cols;
        const unsigned char *p = stf_tensor(&f, cases[k].hf, "F32", R, C == 1 ? 0 : C);
        const float *slice = w + (cases[k].expert >= 0 ? cases[k].expert * R * C : 0);
        for (int64_t r = 0; r < R; r++)
            for (int64_t col = 0; col < C; col++) {
                float hf;
                memcpy(&hf, p + (size_t)(r * C + col) * 4, 4);
                float tmv = cases[k].transposed ? slice[col * R + r] : slice[r * C + col];
                cr_assert_eq(memcmp(&hf, &tmv, 4), 0, "%s[%lld][%lld] = %g, %s gives %g", cases[k].hf, (long long)r,
                             (long long)col, hf, cases[k].tm, tmv);
            }
        free(w);
    }
    stf_free(&f);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(hf, config_json_fields) {
    tm_model_config c = small_config(2, 1, 2);
    const char *dir = tt_path("cfg");
    char err[1024] = "", path[512];
    tm_ctx *ctx = tt_ctx();
    tm_model *m = make_model(ctx, &c, TM_BF16, 1);
    cr_assert_eq(tmd_hf_export(ctx, m, dir, err, sizeof err), 0, "%s", err);
    snprintf(path, sizeof path, "%s/config.json", dir);
    long len;
    unsigned char *txt = tt_slurp(path, &len);
    cJSON *j = cJSON_ParseWithLength((const char *)txt, (size_t)len);
    cr_assert(j, "config.json parses");
#define NUM(k) cJSON_GetObjectItemCaseSensitive(j, k)->valuedouble
#define STR(k) cJSON_GetObjectItemCaseSensitive(j, k)->valuestring
    cr_assert_str_eq(STR("model_type"), "mixtral");
    cr_assert_str_eq(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "architectures"), 0)->valuestring, "MixtralForCausalLM");
    cr_assert_eq(NUM("vocab_size"), 257);
    cr_assert_eq(NUM("hidden_size"), 32);
    cr_assert_eq(NUM("intermediate_size"), 24);
    cr_assert_eq(NUM("num_hidden_layers"), 2);
    cr_assert_eq(NUM("num_attention_heads"), 4);
    cr_assert_eq(NUM("num_key_value_heads"), 2);
    cr_assert_eq(NUM("head_dim"), 8);
    cr_assert_eq(NUM("max_position_embeddings"), 24);
    cr_assert_eq(NUM("rms_norm_eps"), 1e-6);
    cr_assert_eq(NUM("rope_theta"), 500.0);
    cr_assert_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "rope_parameters"), "rope_theta")->valuedouble, 500.0);
    cr_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "rope_parameters"), "rope_type")->valuestring, "default");
    cr_assert_eq(NUM("num_local_experts"), 4);
    cr_assert_eq(NUM("num_experts_per_tok"), 2);
    cr_assert_eq(NUM("router_aux_loss_coef"), 0.02);
    cr_assert_eq(NUM("initializer_range"), 0.15);
    cr_assert_eq(NUM("eos_token_id"), 256, "the byte tokenizer's end-of-text");
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(j, "tie_word_embeddings")));
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(j, "sliding_window")));
    cr_assert_str_eq(STR("hidden_act"), "silu");
    cr_assert_str_eq(STR("torch_dtype"), "bfloat16");
    /* Float fields are written as floats (a '.' or an exponent), for typed readers. */
    cr_assert(strstr((const char *)txt, "\"rope_theta\": 500.0,"), "%s", txt);
#undef NUM
#undef STR
    cJSON_Delete(j);
    free(txt);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* ---- refusals ----------------------------------------------------------------------------- */

Test(hf, refuses_what_mixtral_cannot_express) {
    char err[512];
    tm_model_config base = small_config(2, 0, 2);
    cr_assert_eq(tmd_hf_check_config(&base, err, sizeof err), 0, "the reference config exports: %s", err);
    for (int k = 0; k < 9; k++) {
        tm_model_config c = base;
        const char *key = NULL;
        switch (k) {
        case 0: c.moe.router.score_function = TM_SCORE_SIGMOID; key = "score_function"; break;
        case 1: c.moe.router.norm_topk_prob = 0; key = "norm_topk_prob"; break;
        case 2: c.moe.router.num_groups = 2; c.moe.router.group_topk = 1; key = "num_groups"; break;
        case 3: c.moe.use_expert_bias = 1; key = "expert_bias"; break;
        case 4: c.moe.shared_ffn_size = 16; key = "shared_ffn_size"; break;
        case 5: c.first_k_dense = 1; key = "first_k_dense"; break;
        case 6: c.moe.router.scaling_factor = 2.5; key = "scaling_factor"; break;
        case 7: c.moe.capacity_factor = 1.25; key = "capacity_factor"; break;
        case 8: c.moe.apply_topk_weights_early = 1; key = "apply_topk_weights_early"; break;
        }
        err[0] = 0;
        cr_assert_eq(tmd_hf_check_config(&c, err, sizeof err), TMD_CONFIG_ERROR, "%s must be refused", key);
        cr_assert(strstr(err, key), "the message names %s: %s", key, err);
    }
}

/* A refused model writes nothing, not even the directory; f64 weights name the dtype. */
Test(hf, refused_export_writes_nothing) {
    char err[512];
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = small_config(2, 0, 2);
    c.first_k_dense = 1;
    c.dense_ffn_size = 16;
    tm_model *m;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    const char *dir = tt_path("refused");
    cr_assert_eq(tmd_hf_export(ctx, m, dir, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "first_k_dense"), "%s", err);
    struct stat st;
    cr_assert_neq(stat(dir, &st), 0, "no directory made");
    tm_model_free(m);
    tm_ctx_free(ctx);

    ctx = tt_ctx();
    c = small_config(2, 0, 2);
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F64, tm_cpu(), &m));
    cr_assert_eq(tmd_hf_export(ctx, m, dir, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "dtype = f64"), "%s", err);
    cr_assert_neq(stat(dir, &st), 0, "no directory made");
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* ---- corrupt weights ---------------------------------------------------------------------- */

typedef struct corrupt_fx {
    tm_ctx *ctx;
    tm_model *m;
    stf f;           /* the good export, parsed */
    char good[512];  /* its directory */
    char bad[512];   /* where corrupt copies go */
    char bad_file[600];
    unsigned char *before;
    size_t before_len;
} corrupt_fx;

static void fx_open(corrupt_fx *x) {
    tm_model_config c = small_config(2, 0, 2);
    char err[512];
    tm_ctx *src = tt_ctx();
    tm_model *ms = make_model(src, &c, TM_F32, 21);
    snprintf(x->good, sizeof x->good, "%s", tt_path("good"));
    cr_assert_eq(tmd_hf_export(src, ms, x->good, err, sizeof err), 0, "%s", err);
    tm_model_free(ms);
    tm_ctx_free(src);
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", x->good);
    x->f = stf_load(path);
    snprintf(x->bad, sizeof x->bad, "%s", tt_path("bad"));
    cr_assert_eq(mkdir(x->bad, 0755), 0);
    snprintf(x->bad_file, sizeof x->bad_file, "%s/model.safetensors", x->bad);
    x->ctx = tt_ctx();
    x->m = make_model(x->ctx, &c, TM_F32, 22);
    x->before = param_bytes(x->ctx, &x->before_len);
}

/* Import the corrupt copy: it must fail with TMD_CONFIG_ERROR, name the file and `what`, and
 * leave every parameter as it was. */
static void fx_expect_fail(corrupt_fx *x, const char *what) {
    char err[1024] = "";
    int rc = tmd_hf_import(x->ctx, x->m, x->bad, err, sizeof err);
    cr_assert_eq(rc, TMD_CONFIG_ERROR, "expected a refusal mentioning '%s', got rc %d: %s", what, rc, err);
    cr_assert(strstr(err, x->bad_file), "the message names the file: %s", err);
    cr_assert(strstr(err, what), "the message names '%s': %s", what, err);
    size_t n;
    unsigned char *after = param_bytes(x->ctx, &n);
    cr_assert_eq(n, x->before_len);
    cr_assert_eq(memcmp(after, x->before, n), 0, "the model is unchanged after a failed import");
    free(after);
}

static void fx_close(corrupt_fx *x) {
    free(x->before);
    stf_free(&x->f);
    tm_model_free(x->m);
    tm_ctx_free(x->ctx);
}

static cJSON *fx_hdr(corrupt_fx *x) { return cJSON_Duplicate(x->f.hdr, 1); }
static void set_offsets(cJSON *hdr, const char *name, double b, double e) {
    cJSON *o = cJSON_GetObjectItem(cJSON_GetObjectItemCaseSensitive(hdr, name), "data_offsets");
    cJSON_SetNumberValue(cJSON_GetArrayItem(o, 0), b);
    cJSON_SetNumberValue(cJSON_GetArrayItem(o, 1), e);
}
static double offset_of(cJSON *hdr, const char *name, int which) {
    return cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetObjectItemCaseSensitive(hdr, name), "data_offsets"), which)->valuedouble;
}

Test(hf, import_sanity_of_the_fixture) {
    corrupt_fx x;
    fx_open(&x);
    /* The unmodified file (rewritten by the test's own writer) imports and changes the model. */
    cJSON *h = fx_hdr(&x);
    stf_write(x.bad_file, h, x.f.data, x.f.data_len);
    char err[1024] = "";
    cr_assert_eq(tmd_hf_import(x.ctx, x.m, x.bad, err, sizeof err), 0, "%s", err);
    size_t n;
    unsigned char *after = param_bytes(x.ctx, &n);
    cr_assert_neq(memcmp(after, x.before, n), 0);
    free(after);
    cJSON_Delete(h);
    fx_close(&x);
}

Test(hf, import_rejects_truncated_files) {
    corrupt_fx x;
    fx_open(&x);
    spit(x.bad_file, x.f.img, (size_t)x.f.len - 100);
    fx_expect_fail(&x, "run past"); /* the last tensor's bytes are cut off */
    spit(x.bad_file, x.f.img, (size_t)x.f.len + 0 - (size_t)x.f.data_len - 3); /* inside the header */
    fx_expect_fail(&x, "header length");
    spit(x.bad_file, x.f.img, 5);
    fx_expect_fail(&x, "8-byte header length");
    unsigned char *longer = calloc((size_t)x.f.len + 8, 1);
    memcpy(longer, x.f.img, (size_t)x.f.len);
    spit(x.bad_file, longer, (size_t)x.f.len + 8);
    fx_expect_fail(&x, "not indexed");
    free(longer);
    fx_close(&x);
}

Test(hf, import_rejects_bad_header_length_and_json) {
    corrupt_fx x;
    fx_open(&x);
    unsigned char *img = malloc((size_t)x.f.len);
    memcpy(img, x.f.img, (size_t)x.f.len);
    uint64_t huge = (uint64_t)x.f.len; /* header claims more bytes than the file has */
    for (int i = 0; i < 8; i++) img[i] = (unsigned char)(huge >> (8 * i));
    spit(x.bad_file, img, (size_t)x.f.len);
    fx_expect_fail(&x, "header length");
    memcpy(img, x.f.img, (size_t)x.f.len);
    memcpy(img + 8 + 20, "\"\"\"", 3); /* inside the first key */
    spit(x.bad_file, img, (size_t)x.f.len);
    fx_expect_fail(&x, "not valid JSON");
    memcpy(img, x.f.img, (size_t)x.f.len);
    img[8 + 3] = 0xFF;
    spit(x.bad_file, img, (size_t)x.f.len);
    fx_expect_fail(&x, "UTF-8");
    free(img);
    fx_close(&x);
}

Test(hf, import_rejects_bad_offsets) {
    corrupt_fx x;
    fx_open(&x);
    /* Past the end of the data. */
    cJSON *h = fx_hdr(&x);
    double b = offset_of(h, "model.norm.weight", 0), e = offset_of(h, "model.norm.weight", 1);
    set_offsets(h, "model.norm.weight", (double)x.f.data_len, (double)x.f.data_len + (e - b));
    stf_write(x.bad_file, h, x.f.data, x.f.data_len);
    fx_expect_fail(&x, "model.norm.weight");
    cJSON_Delete(h);
    /* Two norms on the same bytes: one overlaps the other, and a hole opens elsewhere. */
    h = fx_hdr(&x);
    const char *n0 = "model.layers.0.input_layernorm.weight", *n1 = "model.layers.0.post_attention_layernorm.weight";
    set_offsets(h, n1, offset_of(h, n0, 0), offset_of(h, n0, 1));
    stf_write(x.bad_file, h, x.f.data, x.f.data_len);
    fx_expect_fail(&x, "overlaps");
    cJSON_Delete(h);
    /* The byte count disagrees with the shape. */
    h = fx_hdr(&x);
    set_offsets(h, "model.norm.weight", offset_of(h, "model.norm.weight", 0), offset_of(h, "model.norm.weight", 1) - 4);
    stf_write(x.bad_file, h, x.f.data, x.f.data_len);
    fx_expect_fail(&x, "model.norm.weight");
    cJSON_Delete(h);
    fx_close(&x);
}

Test(hf, import_rejects_missing_unknown_and_mismatched_tensors) {
    corrupt_fx x;
    fx_open(&x);
    /* Missing: drop the tensor stored last, with its bytes. */
    cJSON *h = fx_hdr(&x), *it;
    const char *last = NULL;
    double last_begin = -1;
    cJSON_ArrayForEach(it, h) {
        if (strcmp(it->string, "__metadata__") && offset_of(h, it->string, 0) > last_begin) {
            last_begin = offset_of(h, it->string, 0);
            last = it->string;
        }
    }
    char missing[128];
    snprintf(missing, sizeof missing, "'%s' is missing", last);
    cJSON_DeleteItemFromObjectCaseSensitive(h, last);
    stf_write(x.bad_file, h, x.f.data, (size_t)last_begin);
    fx_expect_fail(&x, missing);
    cJSON_Delete(h);
    /* Unknown: an extra (empty) tensor. */
    h = fx_hdr(&x);
    cJSON *extra = cJSON_CreateObject(), *shape = cJSON_CreateArray(), *offs = cJSON_CreateArray();
    cJSON_AddStringToObject(extra, "dtype", "F32");
    cJSON_AddItemToArray(shape, cJSON_CreateNumber(0));
    cJSON_AddItemToObject(extra, "shape", shape);
    cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)x.f.data_len));
    cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)x.f.data_len));
    cJSON_AddItemToObject(extra, "data_offsets", offs);
    cJSON_AddItemToObject(h, "model.layers.0.mlp.bias", extra);
    stf_write(x.bad_file, h, x.f.data, x.f.data_len);
    fx_expect_fail(&x, "'model.layers.0.mlp.bias' is not part of this Mixtral model");
    /* The same name twice. */
    cJSON_AddItemToObject(h, "model.layers.0.mlp.bias", cJSON_Duplicate(extra, 1));
    stf_write(x.bad_file, h, x.f.data, x.f.data_len);
    fx_expect_fail(&x, "appears twice");
    cJSON_Delete(h);
    /* Wrong shape with the right byte count. */
    h = fx_hdr(&x);
    cJSON *s = cJSON_GetObjectItem(cJSON_GetObjectItemCaseSensitive(h, "model.norm.weight"), "shape");
    cJSON_SetNumberValue(cJSON_GetArrayItem(s, 0), 2);
    cJSON_AddItemToArray(s, cJSON_CreateNumber(16));
    stf_write(x.bad_file, h, x.f.data, x.f.data_len);
    fx_expect_fail(&x, "tensor 'model.norm.weight' has shape [2, 16]; the model needs [32]");
    cJSON_Delete(h);
    /* A dtype of the right size that is not a float. */
    h = fx_hdr(&x);
    cJSON *d = cJSON_GetObjectItem(cJSON_GetObjectItemCaseSensitive(h, "model.layers.1.self_attn.k_proj.weight"), "dtype");
    cJSON_SetValuestring(d, "I32");
    stf_write(x.bad_file, h, x.f.data, x.f.data_len);
    fx_expect_fail(&x, "tensor 'model.layers.1.self_attn.k_proj.weight' has dtype I32");
    cJSON_SetValuestring(d, "F31");
    stf_write(x.bad_file, h, x.f.data, x.f.data_len);
    fx_expect_fail(&x, "unknown dtype");
    cJSON_Delete(h);
    fx_close(&x);
}

/* Weights stored in another float dtype than the model's convert: bf16 widens exactly into an
 * f32 model; F16 is read too (checked against the f32 value it encodes). */
Test(hf, import_converts_float_dtypes) {
    tm_model_config c = small_config(2, 0, 2);
    char err[1024] = "";
    tm_ctx *a = tt_ctx();
    tm_model *ma = make_model(a, &c, TM_BF16, 4);
    const char *dir = tt_path("bf16");
    cr_assert_eq(tmd_hf_export(a, ma, dir, err, sizeof err), 0, "%s", err);
    tm_ctx *b = tt_ctx();
    tm_model *mb;
    TT_OK(b, tm_model_new(b, &c, TM_F32, tm_cpu(), &mb));
    cr_assert_eq(tmd_hf_import(b, mb, dir, err, sizeof err), 0, "%s", err);
    /* Every f32 parameter now holds exactly the bf16 values. */
    for (int i = 0; i < tm_ctx_num_params(a); i++) {
        tm_tensor *ta = tm_ctx_param(a, i), *tb = tm_ctx_find(b, tm_tensor_name(ta));
        int64_t n = tm_tensor_numel(ta);
        float *va = malloc((size_t)n * 4), *vb = malloc((size_t)n * 4);
        TT_OK(a, tm_tensor_read(a, ta, TM_F32, va, n));
        TT_OK(b, tm_tensor_read(b, tb, TM_F32, vb, n));
        cr_assert_eq(memcmp(va, vb, (size_t)n * 4), 0, "%s", tm_tensor_name(ta));
        free(va);
        free(vb);
    }
    /* F16: rewrite model.norm.weight as F16 values 1 + k/1024 (exact in f16), subnormal and
     * negative ones included. */
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    stf f = stf_load(path);
    cJSON *h = cJSON_Duplicate(f.hdr, 1);
    const char *nm = "model.norm.weight";
    cJSON *e = cJSON_GetObjectItemCaseSensitive(h, nm);
    size_t begin = (size_t)offset_of(h, nm, 0), end = (size_t)offset_of(h, nm, 1);
    cr_assert_eq(end - begin, 32 * 2, "bf16 norm");
    cJSON_SetValuestring(cJSON_GetObjectItem(e, "dtype"), "F16");
    float want[32];
    unsigned char *data = malloc(f.data_len);
    memcpy(data, f.data, f.data_len);
    for (int k = 0; k < 32; k++) {
        uint16_t hbits;
        if (k == 0) hbits = 0x0001, want[k] = ldexpf(1.0f, -24); /* smallest subnormal */
        else if (k == 1) hbits = 0x8000 | 0x0200, want[k] = -ldexpf(1.0f, -15); /* negative subnormal */
        else if (k == 2) hbits = 0xC000, want[k] = -2.0f;
        else hbits = (uint16_t)(0x3C00 | k), want[k] = 1.0f + (float)k / 1024.0f;
        memcpy(data + begin + 2 * (size_t)k, &hbits, 2);
    }
    tm_ctx *d = tt_ctx();
    tm_model *md;
    TT_OK(d, tm_model_new(d, &c, TM_F32, tm_cpu(), &md));
    char *sub = (char *)tt_path("f16");
    cr_assert_eq(mkdir(sub, 0755), 0);
    char fpath[600];
    snprintf(fpath, sizeof fpath, "%s/model.safetensors", sub);
    stf_write(fpath, h, data, f.data_len);
    cr_assert_eq(tmd_hf_import(d, md, sub, err, sizeof err), 0, "%s", err);
    float got[32];
    TT_OK(d, tm_tensor_read(d, tm_ctx_find(d, "norm.weight"), TM_F32, got, 32));
    for (int k = 0; k < 32; k++) cr_assert_eq(got[k], want[k], "f16 element %d: %g, want %g", k, got[k], want[k]);
    free(data);
    cJSON_Delete(h);
    stf_free(&f);
    tm_model_free(ma);
    tm_model_free(mb);
    tm_model_free(md);
    tm_ctx_free(a);
    tm_ctx_free(b);
    tm_ctx_free(d);
}

/* ---- config.json -------------------------------------------------------------------------- */

/* Export a config once, set `key` to the JSON text `json_value` (NULL: delete the key; and
 * likewise key2 when given) in a copy of it, and read that. */
static int read_edited2(const char *key, const char *json_value, const char *key2, const char *json_value2, char *err,
                        size_t errlen, tm_model_config *out) {
    static int seq;
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s", tt_path("cfg_edit"));
    if (!seq++) {
        tm_ctx *ctx = tt_ctx();
        tm_model_config c = small_config(2, 0, 2);
        tm_model *m = make_model(ctx, &c, TM_F32, 1);
        char e2[512];
        cr_assert_eq(tmd_hf_export(ctx, m, dir, e2, sizeof e2), 0, "%s", e2);
        tm_model_free(m);
        tm_ctx_free(ctx);
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    static char *orig;
    static long orig_len;
    if (!orig) orig = (char *)tt_slurp(path, &orig_len);
    cJSON *j = cJSON_ParseWithLength(orig, (size_t)orig_len);
    cJSON_DeleteItemFromObjectCaseSensitive(j, key);
    if (json_value) cJSON_AddItemToObject(j, key, cJSON_Parse(json_value));
    if (key2) cJSON_DeleteItemFromObjectCaseSensitive(j, key2);
    if (key2 && json_value2) cJSON_AddItemToObject(j, key2, cJSON_Parse(json_value2));
    char *txt = cJSON_Print(j);
    spit(path, txt, strlen(txt));
    free(txt);
    cJSON_Delete(j);
    tm_model_config c;
    int rc = tmd_hf_read_config(dir, &c, NULL, err, errlen);
    if (out) *out = c;
    return rc;
}

static int read_edited(const char *key, const char *json_value, char *err, size_t errlen, tm_model_config *out) {
    return read_edited2(key, json_value, NULL, NULL, err, errlen, out);
}

/* --init-from an export whose config.json holds a value tinymoe refuses (issue 24, defect 3):
 * the message names config.json and its own key, not only tinymoe's key. */
Test(hf, init_from_names_config_json_and_its_key) {
    char err[2048] = "";
    cr_assert_eq(read_edited("num_hidden_layers", "20000", err, sizeof err, NULL), 0, "%s", err);
    tmd_config c;
    tmd_config_defaults(&c);
    char e2[512];
    cr_assert_eq(tmd_config_set(&c, "init_from", tt_path("cfg_edit"), TMD_SRC_FLAG, "test", e2, sizeof e2), 0, "%s", e2);
    cr_assert_eq(tmd_config_set(&c, "out", "", TMD_SRC_FLAG, "test", e2, sizeof e2), 0, "%s", e2);
    cr_assert_eq(tmd_train(&c, NULL, NULL, err, sizeof err), TMD_CONFIG_ERROR, "%s", err);
    char want[700];
    snprintf(want, sizeof want, "%s/config.json key \"num_hidden_layers\"", tt_path("cfg_edit"));
    cr_assert(strstr(err, want) && strstr(err, "n_layers"), "%s", err);
}

Test(hf, read_config_refuses_non_mixtral_values) {
    struct {
        const char *key, *value, *named;
    } cases[] = {
        {"model_type", "\"llama\"", "model_type"},
        {"model_type", NULL, "model_type"},
        {"architectures", "[\"MixtralForSequenceClassification\"]", "architectures"},
        {"hidden_act", "\"gelu\"", "hidden_act"},
        {"head_dim", "16", "head_dim"},
        {"sliding_window", "8", "sliding_window"},
        {"rope_scaling", "{\"rope_type\": \"linear\", \"factor\": 2.0}", "rope_scaling.rope_type"},
        {"rope_parameters", "{\"rope_type\": \"yarn\", \"rope_theta\": 10000.0}", "rope_parameters.rope_type"},
        {"num_key_value_heads", "3", "num_key_value_heads"},
        {"num_experts_per_tok", "5", "num_experts_per_tok"},
        {"hidden_size", "\"32\"", "hidden_size"},
        {"rms_norm_eps", "-1e-6", "rms_norm_eps"},
        {"tie_word_embeddings", "1", "tie_word_embeddings"},
        {"torch_dtype", "\"int8\"", "torch_dtype"},
        {"quantization_config", "{\"quant_method\": \"gptq\"}", "quantization_config"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        char err[512] = "";
        int rc = read_edited(cases[k].key, cases[k].value, err, sizeof err, NULL);
        cr_assert_eq(rc, TMD_CONFIG_ERROR, "%s = %s must be refused", cases[k].key, cases[k].value ? cases[k].value : "(deleted)");
        cr_assert(strstr(err, cases[k].named), "names %s: %s", cases[k].named, err);
        cr_assert(strstr(err, "config.json"), "names the file: %s", err);
    }
}

/* Fields left out take MixtralConfig's defaults, as transformers does; null is "the default". */
Test(hf, read_config_defaults_like_transformers) {
    char err[512] = "";
    tm_model_config c;
    cr_assert_eq(read_edited("rope_parameters", NULL, err, sizeof err, &c), 0, "%s", err);
    cr_assert_eq(c.rope_theta, 500.0, "the top-level rope_theta");
    cr_assert_eq(read_edited("rope_theta", NULL, err, sizeof err, &c), 0, "%s", err);
    cr_assert_eq(c.rope_theta, 500.0, "rope_parameters.rope_theta");
    cr_assert_eq(read_edited2("rope_theta", NULL, "rope_parameters", "{\"rope_type\": \"default\"}", err, sizeof err, &c), 0, "%s", err);
    cr_assert_eq(c.rope_theta, 1e6, "Mixtral's default theta");
    cr_assert_eq(read_edited2("rope_theta", "2000", "rope_parameters", NULL, err, sizeof err, &c), 0, "%s", err);
    cr_assert_eq(c.rope_theta, 2000.0, "an integer theta, as on the Hub");
    cr_assert_eq(read_edited("num_key_value_heads", "null", err, sizeof err, &c), 0, "%s", err);
    cr_assert_eq(c.n_kv_heads, c.n_heads, "null kv heads: one per query head");
    cr_assert_eq(read_edited("head_dim", NULL, err, sizeof err, &c), 0, "%s", err);
    cr_assert_eq(read_edited("sliding_window", "4096", err, sizeof err, &c), 0, "a window wider than the context: %s", err);
    cr_assert_eq(read_edited("rms_norm_eps", NULL, err, sizeof err, &c), 0, "%s", err);
    cr_assert_eq(c.norm_eps, 1e-5);
}

Test(hf, read_config_missing_or_invalid_file) {
    char err[512] = "";
    tm_model_config c;
    cr_assert_eq(tmd_hf_read_config(tt_path("nowhere"), &c, NULL, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "nowhere/config.json"), "%s", err);
    const char *dir = tt_path("junk");
    cr_assert_eq(mkdir(dir, 0755), 0);
    spit(tt_path("junk/config.json"), "{\"model_type\": \"mixtral\",", 26);
    cr_assert_eq(tmd_hf_read_config(dir, &c, NULL, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "junk/config.json"), "%s", err);
    spit(tt_path("junk/config.json"), "{\"model_type\": \"mixtral\", \"model_type\": \"llama\"}", 48);
    cr_assert_eq(tmd_hf_read_config(dir, &c, NULL, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "appears twice"), "%s", err);
}

/* ---- tinymoe export: the command line ------------------------------------------------------ */

Test(hf, export_command_usage_errors) {
    char *help[] = {"--help"};
    cr_assert_eq(tmd_export_main(1, help), TMD_OK);
    cr_assert_eq(tmd_export_main(0, NULL), TMD_CONFIG_ERROR, "--ckpt and --out are required");
    char *no_out[] = {"--ckpt", "x.tmck"};
    cr_assert_eq(tmd_export_main(2, no_out), TMD_CONFIG_ERROR);
    char *fmt[] = {"--ckpt", "x.tmck", "--format", "gguf", "--out", "d"};
    cr_assert_eq(tmd_export_main(6, fmt), TMD_CONFIG_ERROR);
    char *unknown[] = {"--ckpt=x.tmck", "--out=d", "--dtype", "f16"};
    cr_assert_eq(tmd_export_main(4, unknown), TMD_CONFIG_ERROR);
    char *dangling[] = {"--ckpt=x.tmck", "--out"};
    cr_assert_eq(tmd_export_main(2, dangling), TMD_CONFIG_ERROR);
}

/* ---- the reference for transformers ------------------------------------------------------- */

/* NumPy .npy version 1.0: magic, u16 header length, a Python dict literal padded with spaces
 * and a newline so that the data starts at a multiple of 64 bytes. */
static void write_npy(const char *path, const char *descr, int ndim, const int64_t *shape, const void *data, size_t bytes) {
    char dict[256], dims[96] = "";
    size_t n = 0;
    for (int i = 0; i < ndim; i++) n += (size_t)snprintf(dims + n, sizeof dims - n, "%lld,%s", (long long)shape[i], i + 1 < ndim ? " " : "");
    int len = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", descr, dims);
    int total = (10 + len + 1 + 63) / 64 * 64, hlen = total - 10;
    FILE *fp = fopen(path, "wb");
    cr_assert(fp, "fopen %s: %s", path, strerror(errno));
    fwrite("\x93NUMPY\x01\x00", 1, 8, fp);
    fputc(hlen & 0xFF, fp);
    fputc(hlen >> 8, fp);
    fwrite(dict, 1, (size_t)len, fp);
    for (int i = len; i < hlen - 1; i++) fputc(' ', fp);
    fputc('\n', fp);
    fwrite(data, 1, bytes, fp);
    cr_assert_eq(fclose(fp), 0);
}

static void dump_case(const char *dir, const int32_t *tok, int B, int T, const float *logits, int V) {
    char path[600];
    int64_t st[2] = {B, T}, sl[3] = {B, T, V};
    snprintf(path, sizeof path, "%s/tokens.npy", dir);
    write_npy(path, "<i4", 2, st, tok, sizeof(int32_t) * (size_t)(B * T));
    snprintf(path, sizeof path, "%s/logits.npy", dir);
    write_npy(path, "<f4", 3, sl, logits, sizeof(float) * (size_t)(B * T * V));
}

/* A GQA model (V 257, E 4, top-2, T 64) trained a few steps (weights off their initial
 * distribution, norms away from 1): its export must import back bitwise; its bf16 export,
 * imported into an f32 model, must stay near it. With TM_HF_DUMP_DIR set, both exports go there
 * (f32/, bf16/) with tokens.npy and tinymoe's logits.npy for tests/gpu/hf_check.py; the bf16
 * case's logits are those of the f32 model that imported the bf16 file, so transformers loading
 * that file in float32 must match them as closely as the f32 case. */
Test(hf, transformers_reference) {
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 257;
    c.d_model = 64;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.max_seq_len = 64;
    c.rope_theta = 10000.0;
    c.norm_eps = 1e-5;
    c.init_std = 0.1;
    c.moe.ffn_size = 96;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    c.moe.router.use_pre_softmax = 1;
    c.moe.router.norm_topk_prob = 1;
    enum { B = 2, T = 64, TB = 2, STEPS = 5 };
    const char *dump = getenv("TM_HF_DUMP_DIR");
    char dir32[512], dir16[512], err[1024] = "";
    if (dump && *dump) {
        cr_assert(mkdir(dump, 0755) == 0 || errno == EEXIST, "mkdir %s: %s", dump, strerror(errno));
        snprintf(dir32, sizeof dir32, "%s/f32", dump);
        snprintf(dir16, sizeof dir16, "%s/bf16", dump);
    } else {
        snprintf(dir32, sizeof dir32, "%s", tt_path("ref_f32"));
        snprintf(dir16, sizeof dir16, "%s", tt_path("ref_bf16"));
    }

    tm_ctx *a = tt_ctx();
    tm_model *ma = make_model(a, &c, TM_F32, 7);
    tm_optimizer *opt;
    tm_adamw_config ac = tm_adamw_config_default();
    ac.lr = 3e-3;
    TT_OK(a, tm_adamw_new(a, &ac, &opt));
    int32_t batch[TB * (T + 1)], x[TB * T], y[TB * T];
    int64_t sx[2] = {TB, T};
    for (int step = 0; step < STEPS; step++) {
        random_tokens(batch, TB * (T + 1), c.vocab_size, 100 + (uint64_t)step);
        for (int s = 0; s < TB; s++)
            for (int t = 0; t < T; t++) {
                x[s * T + t] = batch[s * (T + 1) + t];
                y[s * T + t] = batch[s * (T + 1) + t + 1];
            }
        tm_tensor *tx, *ty;
        TT_OK(a, tm_tensor_from_host(a, TM_I32, 2, sx, tm_cpu(), TM_I32, x, &tx));
        TT_OK(a, tm_tensor_from_host(a, TM_I32, 2, sx, tm_cpu(), TM_I32, y, &ty));
        tm_model_out o;
        TT_OK(a, tm_model_forward(ma, tx, ty, &o));
        cr_assert(isfinite(o.loss_value));
        TT_OK(a, tm_backward(a, o.loss));
        TT_OK(a, tm_optimizer_step(opt, -1));
        TT_OK(a, tm_model_step(ma));
        TT_OK(a, tm_ctx_zero_grad(a));
        tm_ctx_arena_reset(a);
    }
    int32_t tok[B * T];
    random_tokens(tok, B * T, c.vocab_size, 99);
    float *ref = logits_of(a, ma, tok, B, T);
    cr_assert_eq(tmd_hf_export(a, ma, dir32, err, sizeof err), 0, "%s", err);

    /* f32: back into tinymoe, bitwise. */
    tm_model_config rc;
    cr_assert_eq(tmd_hf_read_config(dir32, &rc, NULL, err, sizeof err), 0, "%s", err);
    tm_ctx *b = tt_ctx();
    tm_model *mb;
    TT_OK(b, tm_model_new(b, &rc, TM_F32, tm_cpu(), &mb));
    cr_assert_eq(tmd_hf_import(b, mb, dir32, err, sizeof err), 0, "%s", err);
    float *back = logits_of(b, mb, tok, B, T);
    const int64_t n = (int64_t)B * T * c.vocab_size;
    cr_assert_eq(memcmp(back, ref, (size_t)n * 4), 0, "f32 round trip is bitwise");

    /* bf16: round the weights into a bf16 model, export it, widen it into an f32 model. */
    tm_ctx *h = tt_ctx(), *d = tt_ctx();
    tm_model *mh, *md;
    TT_OK(h, tm_model_new(h, &rc, TM_BF16, tm_cpu(), &mh));
    cr_assert_eq(tmd_hf_import(h, mh, dir32, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_hf_export(h, mh, dir16, err, sizeof err), 0, "%s", err);
    TT_OK(d, tm_model_new(d, &rc, TM_F32, tm_cpu(), &md));
    cr_assert_eq(tmd_hf_import(d, md, dir16, err, sizeof err), 0, "%s", err);
    float *l16 = logits_of(d, md, tok, B, T);
    double mx = 0, big = 0;
    for (int64_t i = 0; i < n; i++) {
        mx = fmax(mx, fabs((double)l16[i] - ref[i]));
        big = fmax(big, fabs((double)ref[i]));
    }
    /* bf16 keeps 8 significant bits: weights move by up to 2^-9 relative, the logits by a few
     * percent of their range at most; a wrong byte order or layout would move them by ~100%. */
    cr_assert(big > 1.0, "logits of a few units: %g", big);
    cr_assert_leq(mx, 0.05 * big, "bf16-rounded weights: max |diff| %g, max |logit| %g", mx, big);
    cr_assert_gt(mx, 0.0, "the bf16 rounding did change something");

    if (dump && *dump) {
        dump_case(dir32, tok, B, T, ref, c.vocab_size);
        dump_case(dir16, tok, B, T, l16, c.vocab_size);
        /* A third case for transformers only: tied embeddings, one KV head per query head, top-1
         * (whose single weight Mixtral renormalises to 1, as norm_topk_prob does here). */
        char dirt[512];
        snprintf(dirt, sizeof dirt, "%s/tied_top1", dump);
        tm_model_config ct = small_config(4, 1, 1);
        tm_ctx *t = tt_ctx();
        tm_model *mt = make_model(t, &ct, TM_F32, 8);
        cr_assert_eq(tmd_hf_export(t, mt, dirt, err, sizeof err), 0, "%s", err);
        int32_t tt[B * 24];
        random_tokens(tt, B * 24, ct.vocab_size, 98);
        float *lt = logits_of(t, mt, tt, B, 24);
        dump_case(dirt, tt, B, 24, lt, ct.vocab_size);
        free(lt);
        tm_model_free(mt);
        tm_ctx_free(t);
        fprintf(stderr, "hf/transformers_reference: wrote %s, %s and %s (bf16 vs f32 logits: max |diff| %g of max %g)\n", dir32,
                dir16, dirt, mx, big);
    }
    free(ref);
    free(back);
    free(l16);
    tm_optimizer_free(opt);
    tm_model_free(ma);
    tm_model_free(mb);
    tm_model_free(mh);
    tm_model_free(md);
    tm_ctx_free(a);
    tm_ctx_free(b);
    tm_ctx_free(h);
    tm_ctx_free(d);
}

/* tmd_export_main with stderr captured into a file; returns its exit status. */
static int export_cmd(int argc, char **argv, const char *errfile) {
    fflush(stderr);
    int saved = dup(2), fd = open(errfile, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    cr_assert(saved >= 0 && fd >= 0);
    dup2(fd, 2);
    close(fd);
    int rc = tmd_export_main(argc, argv);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    return rc;
}

/* A driver checkpoint of a model with the given extra keys: its directory (under tt_path). */
static const char *save_checkpoint(const char *run, const char *const (*kv)[2], int nkv, tm_ctx **ctx_out, tm_model **m_out) {
    tmd_config c;
    tmd_config_defaults(&c);
    char err[1024];
    const char *base[][2] = {{"vocab_size", "257"}, {"d_model", "32"}, {"n_layers", "2"}, {"n_heads", "4"},
                             {"n_kv_heads", "2"},   {"seq_len", "16"}, {"num_experts", "4"}, {"topk", "2"},
                             {"expert_ffn_size", "24"}, {"init_std", "0.2"}, {"norm_topk_prob", "true"}};
    for (size_t i = 0; i < sizeof base / sizeof *base; i++)
        cr_assert_eq(tmd_config_set(&c, base[i][0], base[i][1], TMD_SRC_FLAG, "test", err, sizeof err), 0, "%s", err);
    for (int i = 0; i < nkv; i++)
        cr_assert_eq(tmd_config_set(&c, kv[i][0], kv[i][1], TMD_SRC_FLAG, "test", err, sizeof err), 0, "%s", err);
    tmd_config_resolve(&c);
    tm_ctx *ctx = tt_ctx();
    tm_model *m = make_model(ctx, &c.model, TM_F32, 31);
    tmd_ckpt_state st = {.step = 12, .data_position = 0};
    size_t len;
    char *meta = tmd_ckpt_meta_encode(&c, &st, &len);
    const char *dir = tt_path(run);
    char path[1024];
    cr_assert_eq(mkdir(dir, 0755), 0);
    tmd_ckpt_path(dir, 12, path, sizeof path);
    TT_OK(ctx, tm_ckpt_save(ctx, path, meta, len));
    free(meta);
    *ctx_out = ctx;
    *m_out = m;
    return dir;
}

/* `tinymoe export` on a run directory writes an export whose import reproduces the model. */
Test(hf, export_command_round_trip) {
    tm_ctx *ctx;
    tm_model *m;
    const char *run = save_checkpoint("run", NULL, 0, &ctx, &m);
    char out[512], errfile[512];
    snprintf(out, sizeof out, "%s", tt_path("out/hf"));
    snprintf(errfile, sizeof errfile, "%s", tt_path("stderr.txt"));
    char *argv[] = {"--ckpt", (char *)run, "--format", "hf", "--out", out};
    int rc = export_cmd(6, argv, errfile);
    long n;
    char *log = (char *)tt_slurp(errfile, &n);
    log[n] = 0;
    cr_assert_eq(rc, 0, "%s", log);
    tm_model_config rcfg;
    char err[1024];
    cr_assert_eq(tmd_hf_read_config(out, &rcfg, NULL, err, sizeof err), 0, "%s", err);
    tm_ctx *b = tt_ctx();
    tm_model *mb;
    TT_OK(b, tm_model_new(b, &rcfg, TM_F32, tm_cpu(), &mb));
    cr_assert_eq(tmd_hf_import(b, mb, out, err, sizeof err), 0, "%s", err);
    int32_t tok[2 * 16];
    random_tokens(tok, 32, 257, 3);
    float *want = logits_of(ctx, m, tok, 2, 16), *got = logits_of(b, mb, tok, 2, 16);
    cr_assert_eq(memcmp(want, got, sizeof(float) * 2 * 16 * 257), 0, "the checkpoint's model, bitwise");
    /* the command streams the weights from the file; the export of the model in memory writes
     * the same bytes */
    char mem[512], fa[600], fb[600];
    snprintf(mem, sizeof mem, "%s", tt_path("out/mem"));
    cr_assert_eq(tmd_hf_export(ctx, m, mem, err, sizeof err), 0, "%s", err);
    for (int f = 0; f < 2; f++) {
        const char *name = f ? TMD_HF_CONFIG_FILE : TMD_HF_WEIGHTS_FILE;
        snprintf(fa, sizeof fa, "%s/%s", out, name);
        snprintf(fb, sizeof fb, "%s/%s", mem, name);
        long na, nb;
        unsigned char *a = tt_slurp(fa, &na), *bb = tt_slurp(fb, &nb);
        cr_assert(na == nb && !memcmp(a, bb, (size_t)na), "%s: the command's and the in-memory export differ", name);
        free(a), free(bb);
    }
    free(want);
    free(got);
    free(log);
    tm_model_free(m);
    tm_model_free(mb);
    tm_ctx_free(ctx);
    tm_ctx_free(b);
}

/* A checkpoint Mixtral cannot express: status 2, the key named, nothing written. */
Test(hf, export_command_refusal) {
    tm_ctx *ctx;
    tm_model *m;
    const char *const kv[][2] = {{"num_groups", "2"}, {"group_topk", "1"}};
    const char *run = save_checkpoint("run", kv, 2, &ctx, &m);
    char out[512], errfile[512];
    snprintf(out, sizeof out, "%s", tt_path("out"));
    snprintf(errfile, sizeof errfile, "%s", tt_path("stderr.txt"));
    char *argv[] = {"--ckpt", (char *)run, "--out", out};
    int rc = export_cmd(4, argv, errfile);
    long n;
    char *log = (char *)tt_slurp(errfile, &n);
    log[n] = 0;
    cr_assert_eq(rc, TMD_CONFIG_ERROR, "%s", log);
    cr_assert(strstr(log, "tinymoe: export:") && strstr(log, "num_groups"), "%s", log);
    struct stat st;
    cr_assert_neq(stat(out, &st), 0, "nothing written");
    /* A missing checkpoint: the loader's message, status 2. */
    char *argv2[] = {"--ckpt", (char *)tt_path("nothing-here"), "--out", out};
    cr_assert_eq(export_cmd(4, argv2, errfile), TMD_CONFIG_ERROR);
    free(log);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* Early top-k weighting (weights on the expert inputs) has no Mixtral form: the key, read back
 * from the checkpoint's config, is named and nothing is written; the same checkpoint without
 * the key exports. */
Test(hf, export_command_refuses_apply_topk_weights_early) {
    tm_ctx *ctx;
    tm_model *m;
    const char *const kv[][2] = {{"apply_topk_weights_early", "true"}};
    const char *run = save_checkpoint("run", kv, 1, &ctx, &m);
    char out[512], errfile[512];
    snprintf(out, sizeof out, "%s", tt_path("out"));
    snprintf(errfile, sizeof errfile, "%s", tt_path("stderr.txt"));
    char *argv[] = {"--ckpt", (char *)run, "--out", out};
    int rc = export_cmd(4, argv, errfile);
    long n;
    char *log = (char *)tt_slurp(errfile, &n);
    log[n] = 0;
    cr_assert_eq(rc, TMD_CONFIG_ERROR, "%s", log);
    cr_assert(strstr(log, "tinymoe: export:") && strstr(log, "apply_topk_weights_early"), "%s", log);
    struct stat st;
    cr_assert_neq(stat(out, &st), 0, "nothing written");
    free(log);
    tm_model_free(m);
    tm_ctx_free(ctx);
    const char *const off[][2] = {{"apply_topk_weights_early", "false"}};
    run = save_checkpoint("run_off", off, 1, &ctx, &m);
    argv[1] = (char *)run;
    rc = export_cmd(4, argv, errfile);
    log = (char *)tt_slurp(errfile, &n);
    log[n] = 0;
    cr_assert_eq(rc, TMD_OK, "%s", log);
    free(log);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* A model trained with force_load_balance exports (its weights are a model's like any other),
 * with a note on stderr that the export routes by its scores; without it, no note. */
Test(hf, export_command_notes_forced_routing) {
    tm_ctx *ctx;
    tm_model *m;
    char out[512], errfile[512];
    snprintf(errfile, sizeof errfile, "%s", tt_path("stderr.txt"));
    for (int forced = 1; forced >= 0; forced--) {
        const char *const kv[][2] = {{"force_load_balance", forced ? "true" : "false"}};
        const char *run = save_checkpoint(forced ? "run_forced" : "run_scored", kv, 1, &ctx, &m);
        snprintf(out, sizeof out, "%s", tt_path(forced ? "out_forced" : "out_scored"));
        char *argv[] = {"--ckpt", (char *)run, "--out", out};
        int rc = export_cmd(4, argv, errfile);
        long n;
        char *log = (char *)tt_slurp(errfile, &n);
        log[n] = 0;
        cr_assert_eq(rc, TMD_OK, "%s", log);
        char cfg[600];
        snprintf(cfg, sizeof cfg, "%s/%s", out, TMD_HF_CONFIG_FILE);
        struct stat st;
        cr_assert_eq(stat(cfg, &st), 0, "%s not written", cfg);
        const char *note = strstr(log, "force_load_balance");
        if (forced)
            cr_assert(note && strstr(log, "note:") && strstr(log, "routes by its router's scores"), "%s", log);
        else
            cr_assert_null(note, "a note without forced routing: %s", log);
        free(log);
        tm_model_free(m);
        tm_ctx_free(ctx);
    }
}

/* --init-from keeps the export's context (max_position_embeddings) as seq_len unless the command
 * gives one (issue 23, item 4), and the config dump labels what came from the export
 * 'init_from', not 'checkpoint'. */
Test(hf, init_from_keeps_the_exports_sequence_length) {
    char err[2048] = "";
    cr_assert_eq(read_edited("max_position_embeddings", "24", err, sizeof err, NULL), 0, "%s", err);
    tmd_config c, out;
    tmd_config_defaults(&c);
    char e2[512];
    cr_assert_eq(tmd_config_set(&c, "init_from", tt_path("cfg_edit"), TMD_SRC_FLAG, "test", e2, sizeof e2), 0, "%s", e2);
    cr_assert_eq(tmd_run_init_from_config(&c, &out, err, sizeof err), 0, "%s", err);
    cr_assert_eq(out.model.max_seq_len, 24, "seq_len %d, the export's max_position_embeddings is 24",
                 out.model.max_seq_len);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    tmd_config_print(&out, f);
    fclose(f);
    cr_assert(strstr(buf, "# init_from") && !strstr(buf, "# checkpoint"), "%s", buf);
    free(buf);
    /* a length the command gives wins */
    cr_assert_eq(tmd_config_set(&c, "seq_len", "12", TMD_SRC_FLAG, "test", e2, sizeof e2), 0, "%s", e2);
    cr_assert_eq(tmd_run_init_from_config(&c, &out, err, sizeof err), 0, "%s", err);
    cr_assert_eq(out.model.max_seq_len, 12);
}
