/*
 * hf.c — Hugging Face Mixtral export and import; see hf.h and docs/hf-export.md.
 *
 * The safetensors format (https://huggingface.co/docs/safetensors, "Format"):
 *   u64 little-endian N | N bytes of UTF-8 JSON | data
 * The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
 * relative to the start of the data, end exclusive) plus an optional "__metadata__" map of
 * strings; it starts with '{' and may be padded with spaces. The data is the tensors'
 * little-endian row-major bytes, fully indexed: no holes, no overlaps. We write the data
 * 8-byte aligned (N a multiple of 8), in the order of the header, with {"format": "pt"} in the
 * metadata (transformers refuses safetensors files without it).
 *
 * Both directions go through one plan: the list of HF tensors of a model, each naming the
 * tinymoe parameter it comes from, the expert slice and whether it is transposed. Export reads
 * each parameter once and writes its HF pieces; import validates the whole file against the
 * plan before the first parameter is written.
 */
#include "hf.h"

#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "train.h"
#include "strbuf.h"

/* The safetensors reference implementation's limit on the header; ours are a few kB. */
#define ST_MAX_HEADER 100000000ull
#define ST_MAX_DIMS 8
#define HF_NAME_MAX 112

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return rc;
}

static int host_little_endian(void) {
    const uint32_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

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

/* ---- files: atomic replacement ------------------------------------------------------------ */

static void sync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        fsync(fd); /* best effort: some file systems refuse it; the files are synced already */
        close(fd);
    }
}

/* mkdir -p */
static int make_dir(const char *dir, char *err, size_t errlen) {
    char p[PATH_MAX];
    if (!*dir || strlen(dir) >= sizeof p) return fail(err, errlen, TMD_CONFIG_ERROR, "output directory '%s' is empty or too long", dir);
    strcpy(p, dir);
    for (char *s = p + 1;; s++) {
        if (*s == '/' || !*s) {
            char c = *s;
            *s = 0;
            if (mkdir(p, 0755) != 0 && errno != EEXIST)
                return fail(err, errlen, TMD_RUNTIME_ERROR, "cannot create directory '%s': %s", p, strerror(errno));
            *s = c;
            if (!c) break;
        }
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return fail(err, errlen, TMD_CONFIG_ERROR, "'%s' exists and is not a directory", dir);
    return 0;
}

static int join(char *out, size_t len, const char *dir, const char *name) {
    return (size_t)snprintf(out, len, "%s/%s", dir, name) >= len ? -1 : 0;
}

typedef struct tmpfile_w {
    char tmp[PATH_MAX], final[PATH_MAX];
    FILE *f;
} tmpfile_w;

static int tmp_open(tmpfile_w *w, const char *dir, const char *name, char *err, size_t errlen) {
    w->f = NULL;
    if (join(w->final, sizeof w->final, dir, name) || (size_t)snprintf(w->tmp, sizeof w->tmp, "%s.tmp.XXXXXX", w->final) >= sizeof w->tmp)
        return fail(err, errlen, TMD_CONFIG_ERROR, "output path '%s/%s' is too long", dir, name);
    int fd = mkstemp(w->tmp);
    if (fd < 0) return fail(err, errlen, TMD_RUNTIME_ERROR, "cannot create '%s': %s", w->tmp, strerror(errno));
    (void)fchmod(fd, 0644); /* mkstemp makes 0600; these are ordinary files others read */
    w->f = fdopen(fd, "wb");
    if (!w->f) {
        int e = errno;
        close(fd);
        unlink(w->tmp);
        return fail(err, errlen, TMD_RUNTIME_ERROR, "cannot open '%s': %s", w->tmp, strerror(e));
    }
    return 0;
}

static void tmp_abort(tmpfile_w *w) {
    if (w->f) fclose(w->f);
    w->f = NULL;
    unlink(w->tmp);
}

/* Flush, fsync, rename over the final name. On failure the temporary file is removed and an
 * older file of that name stays as it was. */
static int tmp_commit(tmpfile_w *w, char *err, size_t errlen) {
    int e = 0;
    if (fflush(w->f) != 0 || ferror(w->f)) e = errno ? errno : EIO;
    if (!e && fsync(fileno(w->f)) != 0) e = errno;
    if (fclose(w->f) != 0 && !e) e = errno;
    w->f = NULL;
    if (e) {
        unlink(w->tmp);
        return fail(err, errlen, TMD_RUNTIME_ERROR, "cannot write '%s' (via '%s'): %s", w->final, w->tmp, strerror(e));
    }
    if (rename(w->tmp, w->final) != 0) {
        e = errno;
        unlink(w->tmp);
        return fail(err, errlen, TMD_RUNTIME_ERROR, "cannot rename '%s' to '%s': %s", w->tmp, w->final, strerror(e));
    }
    return 0;
}

/* ---- the plan: HF tensors of a model ------------------------------------------------------ */

typedef struct hf_entry {
    char name[HF_NAME_MAX]; /* HF name */
    tm_tensor *t;           /* the tinymoe parameter it comes from */
    int64_t expert;         /* slice of a stacked [E, A, B] parameter, or -1 */
    int transpose;          /* HF holds the transpose of the tinymoe matrix */
    int ndim;
    int64_t shape[2];       /* HF shape */
    uint64_t begin, end;    /* data offsets (export) */
    const void *src;        /* the file's bytes (import) */
    int src_dtype;          /* ST_F32 / ST_BF16 / ST_F16 (import) */
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
    if (p->n == p->cap) return fail(err, errlen, TMD_RUNTIME_ERROR, "internal error: HF plan overflow at '%s'", hf);
    tm_tensor *t = tm_ctx_find(ctx, tm);
    if (!t) return fail(err, errlen, TMD_CONFIG_ERROR, "the model has no parameter '%s' (for HF tensor '%s')", tm, hf);
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
    if (!ok) return fail(err, errlen, TMD_RUNTIME_ERROR, "internal error: parameter '%s' does not have the shape HF tensor '%s' needs", tm, hf);
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
    if (!p->e) return fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory (%d tensor descriptors)", p->cap);
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
    if (!mc) return fail(err, errlen, TMD_CONFIG_ERROR, "%s no model config", pre);
    const tm_moe_config *m = &mc->moe;
    const tm_router_config *r = &m->router;
    if (r->score_function != TM_SCORE_SOFTMAX)
        return fail(err, errlen, TMD_CONFIG_ERROR, "%s score_function = sigmoid; Mixtral's router is a softmax over the experts", pre);
    if (r->use_pre_softmax && !r->norm_topk_prob)
        return fail(err, errlen, TMD_CONFIG_ERROR,
                    "%s norm_topk_prob = false with pre_softmax = true; Mixtral renormalises the top-k softmax weights to "
                    "sum 1 (norm_topk_prob = true, or pre_softmax = false, which is the same function)", pre);
    if (r->num_groups > 1)
        return fail(err, errlen, TMD_CONFIG_ERROR, "%s num_groups = %d (group-limited routing); Mixtral routes over all experts", pre,
                    r->num_groups);
    if (m->use_expert_bias)
        return fail(err, errlen, TMD_CONFIG_ERROR, "%s expert_bias = true; Mixtral's router has no selection bias", pre);
    if (m->shared_ffn_size > 0)
        return fail(err, errlen, TMD_CONFIG_ERROR, "%s shared_ffn_size = %d; Mixtral has no shared expert", pre, m->shared_ffn_size);
    if (mc->first_k_dense > 0)
        return fail(err, errlen, TMD_CONFIG_ERROR, "%s first_k_dense = %d; every Mixtral layer is a MoE layer", pre, mc->first_k_dense);
    if (r->scaling_factor != 1.0)
        return fail(err, errlen, TMD_CONFIG_ERROR, "%s scaling_factor = %g; Mixtral does not scale the routing weights", pre,
                    r->scaling_factor);
    if (m->capacity_factor > 0)
        return fail(err, errlen, TMD_CONFIG_ERROR,
                    "%s capacity_factor = %g; Mixtral is dropless (the logits would differ whenever a token is dropped)", pre,
                    m->capacity_factor);
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
        return fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory writing %s", TMD_HF_CONFIG_FILE);
    }
    tmpfile_w w;
    int rc = tmp_open(&w, dir, TMD_HF_CONFIG_FILE, err, errlen);
    if (!rc) {
        fwrite(b.p, 1, b.n, w.f);
        rc = tmp_commit(&w, err, errlen);
    }
    free(b.p);
    return rc;
}

static int write_weights(tm_ctx *ctx, hf_plan *p, const char *dir, uint64_t *file_bytes, char *err, size_t errlen) {
    /* Header first: offsets follow from the shapes. */
    tmd_sbuf h = {0};
    uint64_t off = 0;
    size_t max_param = 0, max_piece = 0;
    tmd_sb_printf(&h, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < p->n; i++) {
        hf_entry *e = &p->e[i];
        size_t es = tm_dtype_size(tm_tensor_dtype(e->t));
        size_t pb = (size_t)tm_tensor_numel(e->t) * es, eb = (size_t)entry_numel(e) * es;
        if (pb > max_param) max_param = pb;
        if (eb > max_piece) max_piece = eb;
        e->begin = off;
        e->end = off + eb;
        off = e->end;
        tmd_sb_printf(&h, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld", e->name, st_dtype_name(tm_tensor_dtype(e->t)),
                  (long long)e->shape[0]);
        if (e->ndim == 2) tmd_sb_printf(&h, ",%lld", (long long)e->shape[1]);
        tmd_sb_printf(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)e->begin, (unsigned long long)e->end);
    }
    tmd_sb_printf(&h, "}");
    while (!h.oom && h.n % 8) tmd_sb_printf(&h, " "); /* 8 + N a multiple of 8: the data starts aligned */
    unsigned char *param = malloc(max_param ? max_param : 1), *piece = malloc(max_piece ? max_piece : 1);
    int rc = 0;
    if (h.oom || !param || !piece) {
        rc = fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory staging %s (%zu bytes)", TMD_HF_WEIGHTS_FILE, max_param + max_piece);
        goto done;
    }
    tmpfile_w w;
    if ((rc = tmp_open(&w, dir, TMD_HF_WEIGHTS_FILE, err, errlen))) goto done;
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)h.n >> (8 * i));
    fwrite(len8, 1, 8, w.f);
    fwrite(h.p, 1, h.n, w.f);
    const tm_tensor *loaded = NULL;
    for (int i = 0; i < p->n; i++) {
        hf_entry *e = &p->e[i];
        tm_dtype dt = tm_tensor_dtype(e->t);
        size_t es = tm_dtype_size(dt);
        if (e->t != loaded) {
            if (tm_tensor_read(ctx, e->t, dt, param, tm_tensor_numel(e->t)) != TM_OK) {
                rc = fail(err, errlen, TMD_RUNTIME_ERROR, "reading parameter '%s': %s", tm_tensor_name(e->t), tm_ctx_errmsg(ctx));
                tmp_abort(&w);
                goto done;
            }
            loaded = e->t;
        }
        int64_t rows = e->shape[0], cols = e->shape[1];
        const unsigned char *out = param + (size_t)tm_index(e, 0, 0) * es;
        if (e->transpose) {
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++)
                    memcpy(piece + (size_t)(r * cols + c) * es, param + (size_t)tm_index(e, r, c) * es, es);
            out = piece;
        }
        fwrite(out, es, (size_t)entry_numel(e), w.f);
    }
    if ((rc = tmp_commit(&w, err, errlen))) goto done;
    if (file_bytes) *file_bytes = 8 + h.n + off;
done:
    free(h.p);
    free(param);
    free(piece);
    return rc;
}

int tmd_hf_export(tm_ctx *ctx, tm_model *model, const char *dir, char *err, size_t errlen) {
    if (!ctx || !model || !dir) return fail(err, errlen, TMD_CONFIG_ERROR, "tmd_hf_export: ctx, model and dir are required");
    const tm_model_config *c = tm_model_get_config(model);
    int rc = tmd_hf_check_config(c, err, errlen);
    if (rc) return rc;
    tm_tensor *embed = tm_ctx_find(ctx, "embed.weight");
    tm_dtype dt = embed ? tm_tensor_dtype(embed) : TM_F64;
    if (dt != TM_F32 && dt != TM_BF16)
        return fail(err, errlen, TMD_CONFIG_ERROR, "cannot export to Hugging Face Mixtral: dtype = %s; export f32 or bf16 models",
                    tm_dtype_name(dt));
    if (!host_little_endian()) return fail(err, errlen, TMD_RUNTIME_ERROR, "export: big-endian hosts are not supported");
    hf_plan p;
    if ((rc = plan_build(ctx, model, &p, err, errlen))) return rc;
    if (!(rc = make_dir(dir, err, errlen)) && !(rc = write_weights(ctx, &p, dir, NULL, err, errlen)) &&
        !(rc = write_config(dir, c, dt, err, errlen)))
        sync_dir(dir);
    plan_free(&p);
    return rc;
}

/* ---- safetensors reading ------------------------------------------------------------------ */

enum { ST_F32 = 0, ST_BF16 = 1, ST_F16 = 2, ST_OTHER = 3 };

typedef struct st_tensor {
    const char *name; /* in the cJSON tree */
    const char *dtype;
    int kind;         /* ST_F32, ST_BF16, ST_F16 or ST_OTHER */
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    uint64_t begin, end;
    const unsigned char *data;
} st_tensor;

typedef struct st_file {
    unsigned char *img;
    size_t len;
    cJSON *root;
    st_tensor *t;
    int n;
} st_file;

static void st_close(st_file *f) {
    cJSON_Delete(f->root);
    free(f->img);
    free(f->t);
    memset(f, 0, sizeof *f);
}

static int read_whole(const char *path, unsigned char **img, size_t *len, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return fail(err, errlen, TMD_CONFIG_ERROR, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return fail(err, errlen, TMD_CONFIG_ERROR, "'%s' is not a regular file", path);
    }
    size_t n = (size_t)sb.st_size, got = 0;
    unsigned char *b = malloc(n ? n : 1);
    if (!b) {
        close(fd);
        return fail(err, errlen, TMD_RUNTIME_ERROR, "'%s': out of memory (%zu bytes)", path, n);
    }
    while (got < n) {
        ssize_t r = read(fd, b + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = r < 0 ? errno : EIO;
            close(fd);
            free(b);
            return fail(err, errlen, TMD_RUNTIME_ERROR, "cannot read '%s': %s", path, strerror(e));
        }
        got += (size_t)r;
    }
    close(fd);
    *img = b;
    *len = n;
    return 0;
}

/* RFC 3629 UTF-8 (no overlong forms, no surrogates, <= U+10FFFF); returns the offset of the
 * first bad byte, or len. */
static size_t utf8_check(const unsigned char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) {
            i++;
            continue;
        }
        if ((c & 0xE0) == 0xC0) k = 1, cp = c & 0x1F, min = 0x80;
        else if ((c & 0xF0) == 0xE0) k = 2, cp = c & 0x0F, min = 0x800;
        else if ((c & 0xF8) == 0xF0) k = 3, cp = c & 0x07, min = 0x10000;
        else return i;
        if (k >= len - i) return i;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xC0) != 0x80) return i;
            cp = cp << 6 | (s[i + j] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
        i += k + 1;
    }
    return len;
}

/* A JSON number that is a whole number in [0, 2^53] (cJSON keeps numbers as doubles). */
static int json_u64(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0 && d <= 9007199254740992.0) || d != floor(d)) return -1;
    *out = (uint64_t)d;
    return 0;
}

static const struct { const char *name; int size, kind; } ST_DTYPES[] = {
    {"F64", 8, ST_OTHER}, {"F32", 4, ST_F32}, {"F16", 2, ST_F16}, {"BF16", 2, ST_BF16}, {"F8_E5M2", 1, ST_OTHER},
    {"F8_E4M3", 1, ST_OTHER}, {"I64", 8, ST_OTHER}, {"U64", 8, ST_OTHER}, {"I32", 4, ST_OTHER}, {"U32", 4, ST_OTHER},
    {"I16", 2, ST_OTHER}, {"U16", 2, ST_OTHER}, {"I8", 1, ST_OTHER}, {"U8", 1, ST_OTHER}, {"BOOL", 1, ST_OTHER},
};

static int cmp_name(const void *a, const void *b) {
    return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}
static int cmp_offset(const void *a, const void *b) {
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int st_tensor_parse(const char *path, const cJSON *item, st_tensor *t, uint64_t data_len, char *err, size_t errlen) {
    const char *nm = item->string;
    if (!cJSON_IsObject(item)) return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': entry is not a JSON object", path, nm);
    const cJSON *dtype = NULL, *shape = NULL, *offs = NULL, *m;
    cJSON_ArrayForEach(m, item) {
        if (!strcmp(m->string, "dtype") && !dtype) dtype = m;
        else if (!strcmp(m->string, "shape") && !shape) shape = m;
        else if (!strcmp(m->string, "data_offsets") && !offs) offs = m;
        else return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': unexpected or repeated member \"%s\"", path, nm, m->string);
    }
    if (!dtype || !shape || !offs)
        return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': missing \"%s\"", path, nm,
                    !dtype ? "dtype" : !shape ? "shape" : "data_offsets");
    t->name = nm;
    if (!cJSON_IsString(dtype)) return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': dtype is not a string", path, nm);
    int size = 0;
    for (size_t k = 0; k < sizeof ST_DTYPES / sizeof *ST_DTYPES; k++)
        if (!strcmp(dtype->valuestring, ST_DTYPES[k].name)) {
            size = ST_DTYPES[k].size;
            t->kind = ST_DTYPES[k].kind;
            t->dtype = ST_DTYPES[k].name;
        }
    if (!size) return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': unknown dtype \"%.32s\"", path, nm, dtype->valuestring);
    if (!cJSON_IsArray(shape) || cJSON_GetArraySize(shape) > ST_MAX_DIMS)
        return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': shape is not an array of at most %d sizes", path, nm, ST_MAX_DIMS);
    /* numel * size without overflow: every product stays below 2^64 when checked against the
     * data length (< 2^63) as it grows. */
    uint64_t bytes = (uint64_t)size;
    const cJSON *d;
    t->ndim = 0;
    cJSON_ArrayForEach(d, shape) {
        uint64_t v;
        if (json_u64(d, &v)) return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': shape holds a value that is not a size", path, nm);
        t->shape[t->ndim++] = (int64_t)v;
        if (v && bytes > UINT64_MAX / v) bytes = UINT64_MAX;
        else bytes *= v;
    }
    uint64_t b, e;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || json_u64(cJSON_GetArrayItem(offs, 0), &b) ||
        json_u64(cJSON_GetArrayItem(offs, 1), &e) || b > e)
        return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': data_offsets is not [begin, end] with 0 <= begin <= end", path, nm);
    if (e > data_len)
        return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': data_offsets [%llu, %llu] run past the %llu data bytes of the file",
                    path, nm, (unsigned long long)b, (unsigned long long)e, (unsigned long long)data_len);
    if (bytes != e - b)
        return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': %s shape holds %llu bytes but data_offsets [%llu, %llu] span %llu",
                    path, nm, t->dtype, (unsigned long long)bytes, (unsigned long long)b, (unsigned long long)e,
                    (unsigned long long)(e - b));
    t->begin = b;
    t->end = e;
    return 0;
}

/* Read and validate a whole safetensors file. */
static int st_open(const char *path, st_file *f, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    int rc = read_whole(path, &f->img, &f->len, err, errlen);
    if (rc) return rc;
    rc = TMD_CONFIG_ERROR;
    if (f->len < 8) {
        fail(err, errlen, rc, "'%s' is not a safetensors file: %zu bytes, shorter than the 8-byte header length", path, f->len);
        goto bad;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | f->img[i];
    if (n > f->len - 8 || n > ST_MAX_HEADER || n < 2) {
        fail(err, errlen, rc, "'%s': header length %llu does not fit the file (%zu bytes; at most %llu, at least 2)", path,
             (unsigned long long)n, f->len, (unsigned long long)ST_MAX_HEADER);
        goto bad;
    }
    const char *hdr = (const char *)f->img + 8;
    size_t bad_at = utf8_check((const unsigned char *)hdr, (size_t)n);
    if (bad_at != n) {
        fail(err, errlen, rc, "'%s': header is not UTF-8 (byte %zu of the header)", path, bad_at);
        goto bad;
    }
    if (hdr[0] != '{') {
        fail(err, errlen, rc, "'%s': header does not start with '{'", path);
        goto bad;
    }
    const char *end = NULL;
    f->root = cJSON_ParseWithLengthOpts(hdr, (size_t)n, &end, 0);
    if (!f->root) {
        const char *at = cJSON_GetErrorPtr();
        fail(err, errlen, rc, "'%s': header is not valid JSON (near byte %lld of the header)", path,
             at ? (long long)(at - hdr) : -1LL);
        goto bad;
    }
    for (const char *q = end; q < hdr + n; q++)
        if (*q != ' ' && *q != '\t' && *q != '\n' && *q != '\r') {
            fail(err, errlen, rc, "'%s': header has bytes after its JSON object (byte %lld)", path, (long long)(q - hdr));
            goto bad;
        }
    if (!cJSON_IsObject(f->root)) {
        fail(err, errlen, rc, "'%s': header is not a JSON object", path);
        goto bad;
    }
    uint64_t data_len = f->len - 8 - n;
    int count = cJSON_GetArraySize(f->root);
    f->t = calloc((size_t)count + 1, sizeof *f->t);
    st_tensor **order = calloc((size_t)count + 1, sizeof *order);
    if (!f->t || !order) {
        free(order);
        rc = fail(err, errlen, TMD_RUNTIME_ERROR, "'%s': out of memory (%d tensors)", path, count);
        goto bad;
    }
    const cJSON *item;
    int meta_seen = 0;
    cJSON_ArrayForEach(item, f->root) {
        if (!strcmp(item->string, "__metadata__")) {
            const cJSON *kv;
            int ok = cJSON_IsObject(item) && !meta_seen++;
            cJSON_ArrayForEach(kv, item) ok = ok && cJSON_IsString(kv);
            if (!ok) {
                free(order);
                fail(err, errlen, rc, "'%s': __metadata__ is repeated or not a map of strings", path);
                goto bad;
            }
            continue;
        }
        if (st_tensor_parse(path, item, &f->t[f->n], data_len, err, errlen)) {
            free(order);
            goto bad;
        }
        f->t[f->n].data = f->img + 8 + n + f->t[f->n].begin;
        f->n++;
    }
    qsort(f->t, (size_t)f->n, sizeof *f->t, cmp_name);
    for (int i = 1; i < f->n; i++)
        if (!strcmp(f->t[i].name, f->t[i - 1].name)) {
            free(order);
            fail(err, errlen, rc, "'%s': tensor '%s' appears twice in the header", path, f->t[i].name);
            goto bad;
        }
    /* The data must be exactly the tensors' bytes, back to back. */
    for (int i = 0; i < f->n; i++) order[i] = &f->t[i];
    qsort(order, (size_t)f->n, sizeof *order, cmp_offset);
    uint64_t cursor = 0;
    for (int i = 0; i < f->n; i++) {
        const st_tensor *t = order[i];
        if (t->begin != cursor) {
            if (t->begin < cursor)
                fail(err, errlen, rc, "'%s': tensor '%s' (data_offsets [%llu, %llu]) overlaps tensor '%s'", path, t->name,
                     (unsigned long long)t->begin, (unsigned long long)t->end, order[i - 1]->name);
            else
                fail(err, errlen, rc, "'%s': %llu unindexed data bytes before tensor '%s' (data_offsets [%llu, %llu])", path,
                     (unsigned long long)(t->begin - cursor), t->name, (unsigned long long)t->begin, (unsigned long long)t->end);
            free(order);
            goto bad;
        }
        cursor = t->end;
    }
    free(order);
    if (cursor != data_len) {
        fail(err, errlen, rc, "'%s': %llu data bytes after the last tensor are not indexed by the header (truncated or padded file?)",
             path, (unsigned long long)(data_len - cursor));
        goto bad;
    }
    return 0;
bad:
    st_close(f);
    return rc;
}

/* ---- import ------------------------------------------------------------------------------- */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, ex = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (ex == 0x1F) {
        bits = sign | 0x7F800000u | man << 13;
    } else if (ex) {
        bits = sign | (ex + 112) << 23 | man << 13;
    } else if (man) { /* subnormal: normalise */
        int shift = 0;
        while (!(man & 0x400)) {
            man <<= 1;
            shift++;
        }
        bits = sign | (uint32_t)(113 - shift) << 23 | (man & 0x3FF) << 13;
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float load_elem(const unsigned char *p, int kind) {
    float f;
    uint32_t u;
    uint16_t s;
    switch (kind) {
    case ST_F32: memcpy(&f, p, 4); return f;
    case ST_BF16:
        memcpy(&s, p, 2);
        u = (uint32_t)s << 16;
        memcpy(&f, &u, 4);
        return f;
    default: memcpy(&s, p, 2); return half_to_float(s);
    }
}

static hf_entry *plan_find(hf_plan *p, const char *name) {
    for (int i = 0; i < p->n; i++)
        if (!strcmp(p->e[i].name, name)) return &p->e[i];
    return NULL;
}

static void fmt_shape(char *b, size_t len, int ndim, const int64_t *s) {
    size_t n = (size_t)snprintf(b, len, "[");
    for (int i = 0; i < ndim && n < len; i++) n += (size_t)snprintf(b + n, len - n, "%s%lld", i ? ", " : "", (long long)s[i]);
    if (n < len) snprintf(b + n, len - n, "]");
}

int tmd_hf_import(tm_ctx *ctx, tm_model *model, const char *dir, char *err, size_t errlen) {
    if (!ctx || !model || !dir) return fail(err, errlen, TMD_CONFIG_ERROR, "tmd_hf_import: ctx, model and dir are required");
    if (!host_little_endian()) return fail(err, errlen, TMD_RUNTIME_ERROR, "import: big-endian hosts are not supported");
    char path[PATH_MAX], index[PATH_MAX];
    if (join(path, sizeof path, dir, TMD_HF_WEIGHTS_FILE) || join(index, sizeof index, dir, "model.safetensors.index.json"))
        return fail(err, errlen, TMD_CONFIG_ERROR, "path '%s' is too long", dir);
    if (access(path, F_OK) != 0 && access(index, F_OK) == 0)
        return fail(err, errlen, TMD_CONFIG_ERROR, "'%s': sharded checkpoints are not supported (merge the shards into one %s)", index,
                    TMD_HF_WEIGHTS_FILE);
    hf_plan p;
    int rc = plan_build(ctx, model, &p, err, errlen);
    if (rc) return rc;
    st_file f;
    if ((rc = st_open(path, &f, err, errlen))) {
        plan_free(&p);
        return rc;
    }
    rc = TMD_CONFIG_ERROR;
    float *buf = NULL;
    for (int i = 0; i < f.n; i++) {
        const st_tensor *t = &f.t[i];
        hf_entry *e = plan_find(&p, t->name);
        if (!e) {
            fail(err, errlen, rc, "'%s': tensor '%s' is not part of this Mixtral model (unknown tensor)", path, t->name);
            goto out;
        }
        if (t->kind == ST_OTHER) {
            fail(err, errlen, rc, "'%s': tensor '%s' has dtype %s; expected F32, BF16 or F16", path, t->name, t->dtype);
            goto out;
        }
        int same = t->ndim == e->ndim && t->shape[0] == e->shape[0] && (e->ndim == 1 || t->shape[1] == e->shape[1]);
        if (!same) {
            char got[96], want[64];
            fmt_shape(got, sizeof got, t->ndim, t->shape);
            fmt_shape(want, sizeof want, e->ndim, e->shape);
            fail(err, errlen, rc, "'%s': tensor '%s' has shape %s; the model needs %s", path, t->name, got, want);
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
        fail(err, errlen, rc, "'%s': tensor '%s' is missing%s (%d of the model's %d tensors absent)", path, first,
             missing > 1 ? ", among others" : "", missing, p.n);
        goto out;
    }
    /* Everything checked: now write, one parameter at a time through an f32 staging buffer. */
    int64_t max_numel = 1;
    for (int i = 0; i < p.n; i++)
        if (tm_tensor_numel(p.e[i].t) > max_numel) max_numel = tm_tensor_numel(p.e[i].t);
    buf = malloc((size_t)max_numel * sizeof(float));
    if (!buf) {
        rc = fail(err, errlen, TMD_RUNTIME_ERROR, "import: out of memory (%lld floats)", (long long)max_numel);
        goto out;
    }
    for (int i = 0; i < p.n;) {
        tm_tensor *t = p.e[i].t;
        for (; i < p.n && p.e[i].t == t; i++) {
            const hf_entry *e = &p.e[i];
            size_t es = e->src_dtype == ST_F32 ? 4 : 2;
            const unsigned char *src = e->src;
            for (int64_t r = 0; r < e->shape[0]; r++)
                for (int64_t c = 0; c < e->shape[1]; c++, src += es) buf[tm_index(e, r, c)] = load_elem(src, e->src_dtype);
        }
        if (tm_tensor_write(ctx, t, TM_F32, buf, tm_tensor_numel(t)) != TM_OK) {
            rc = fail(err, errlen, TMD_RUNTIME_ERROR, "writing parameter '%s': %s", tm_tensor_name(t), tm_ctx_errmsg(ctx));
            goto out;
        }
    }
    rc = 0;
out:
    free(buf);
    st_close(&f);
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
        return fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s = %s must be an integer >= %d", j->path, key, jshow(v, b, sizeof b), lo);
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
        return fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s = %s must be a number %s 0", j->path, key, jshow(v, b, sizeof b),
                    positive ? ">" : ">=");
    *out = v->valuedouble;
    return 0;
}

static int j_bool(const jcfg *j, const char *key, int def, int *out) {
    const cJSON *v = jget(j->root, key);
    char b[64];
    if (v && !cJSON_IsBool(v))
        return fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s = %s must be true or false", j->path, key, jshow(v, b, sizeof b));
    *out = v ? cJSON_IsTrue(v) : def;
    return 0;
}

static int j_str(const jcfg *j, const cJSON *obj, const char *key, const char **out) {
    const cJSON *v = jget(obj, key);
    char b[64];
    if (v && !cJSON_IsString(v))
        return fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s = %s must be a string", j->path, key, jshow(v, b, sizeof b));
    *out = v ? v->valuestring : NULL;
    return 0;
}

/* rope_parameters (transformers 5) or rope_scaling (4.x): plain RoPE only; its rope_theta, if
 * any, into *theta. */
static int check_rope(const jcfg *j, const char *field, double *theta, int *has_theta) {
    const cJSON *r = jget(j->root, field), *m;
    if (!r) return 0;
    if (!cJSON_IsObject(r)) return fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s must be an object", j->path, field);
    cJSON_ArrayForEach(m, r) {
        char b[64];
        if (!strcmp(m->string, "rope_type") || !strcmp(m->string, "type")) {
            if (!cJSON_IsString(m) || strcmp(m->valuestring, "default"))
                return fail(j->err, j->errlen, TMD_CONFIG_ERROR,
                            "'%s': %s.%s = %s: tinymoe implements plain rotary embeddings only (\"default\")", j->path, field,
                            m->string, jshow(m, b, sizeof b));
        } else if (!strcmp(m->string, "rope_theta")) {
            if (j_num(j, r, "rope_theta", 0, 1, theta)) return TMD_CONFIG_ERROR;
            *has_theta = 1;
        } else if (!strcmp(m->string, "partial_rotary_factor")) {
            if (!cJSON_IsNumber(m) || m->valuedouble != 1.0)
                return fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s.partial_rotary_factor = %s: tinymoe rotates whole heads (1.0)",
                            j->path, field, jshow(m, b, sizeof b));
        } else {
            return fail(j->err, j->errlen, TMD_CONFIG_ERROR, "'%s': %s.%s is not supported (plain rotary embeddings only)", j->path,
                        field, m->string);
        }
    }
    return 0;
}

static int parse_config(const jcfg *j, tm_model_config *mc, int *dtype_bf16) {
    char *err = j->err;
    size_t errlen = j->errlen;
    const char *path = j->path;
    const int E = TMD_CONFIG_ERROR;
    const cJSON *a, *b;
    /* transformers (Python's json) takes the last of repeated keys, cJSON the first: refuse. */
    cJSON_ArrayForEach(a, j->root) {
        for (b = a->next; b; b = b->next)
            if (!strcmp(a->string, b->string)) return fail(err, errlen, E, "'%s': key \"%s\" appears twice", path, a->string);
    }
    const char *s;
    if (j_str(j, j->root, "model_type", &s)) return E;
    if (!s || strcmp(s, "mixtral"))
        return fail(err, errlen, E, "'%s': model_type = \"%s\": not a Mixtral config (\"mixtral\")", path, s ? s : "(missing)");
    const cJSON *arch = jget(j->root, "architectures");
    if (arch) {
        int found = 0;
        cJSON_ArrayForEach(a, arch) found |= cJSON_IsString(a) && !strcmp(a->valuestring, "MixtralForCausalLM");
        if (!cJSON_IsArray(arch) || !found)
            return fail(err, errlen, E, "'%s': architectures does not list MixtralForCausalLM", path);
    }
    if (jget(j->root, "quantization_config"))
        return fail(err, errlen, E, "'%s': quantization_config: quantized checkpoints are not supported", path);
    if (j_str(j, j->root, "hidden_act", &s)) return E;
    if (s && strcmp(s, "silu"))
        return fail(err, errlen, E, "'%s': hidden_act = \"%s\": tinymoe's experts are SwiGLU (\"silu\")", path, s);

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
    if (H % nh) return fail(err, errlen, E, "'%s': num_attention_heads = %d does not divide hidden_size = %d", path, nh, H);
    if ((H / nh) % 2) return fail(err, errlen, E, "'%s': head size hidden_size / num_attention_heads = %d is odd (rotary pairs)", path, H / nh);
    if (j_int(j, "head_dim", H / nh, 1, &hd)) return E;
    if (hd != H / nh)
        return fail(err, errlen, E, "'%s': head_dim = %d: tinymoe needs head_dim = hidden_size / num_attention_heads = %d", path, hd, H / nh);
    if (nh % nkv) return fail(err, errlen, E, "'%s': num_key_value_heads = %d does not divide num_attention_heads = %d", path, nkv, nh);
    if (k > ne) return fail(err, errlen, E, "'%s': num_experts_per_tok = %d exceeds num_local_experts = %d", path, k, ne);
    if (j_int(j, "sliding_window", INT_MAX, 1, &sw)) return E;
    if (sw < maxpos)
        return fail(err, errlen, E, "'%s': sliding_window = %d is shorter than max_position_embeddings = %d: tinymoe attends to the whole context",
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
        return fail(err, errlen, E, "'%s': %s = \"%s\": tinymoe loads float32, bfloat16 or float16 weights", path, dkey, dt);

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
    c.moe.aux_loss_coeff = aux;
    if (tm_model_config_check(NULL, &c) != TM_OK)
        return fail(err, errlen, E, "'%s': the config does not describe a valid tinymoe model", path);
    *mc = c;
    if (dtype_bf16) *dtype_bf16 = bf16;
    return 0;
}

int tmd_hf_read_config(const char *dir, tm_model_config *mc, int *dtype_bf16, char *err, size_t errlen) {
    if (!dir || !mc) return fail(err, errlen, TMD_CONFIG_ERROR, "tmd_hf_read_config: dir and mc are required");
    char path[PATH_MAX];
    if (join(path, sizeof path, dir, TMD_HF_CONFIG_FILE)) return fail(err, errlen, TMD_CONFIG_ERROR, "path '%s' is too long", dir);
    unsigned char *img;
    size_t len;
    int rc = read_whole(path, &img, &len, err, errlen);
    if (rc) return rc;
    cJSON *root = cJSON_ParseWithLength((const char *)img, len);
    if (!root || !cJSON_IsObject(root)) {
        const char *at = cJSON_GetErrorPtr();
        rc = fail(err, errlen, TMD_CONFIG_ERROR, "'%s' is not a JSON object%s", path, root || !at ? "" : " (invalid JSON)");
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
    "loadable with transformers' from_pretrained(DIR) and with 'tinymoe train --init-from DIR'.\n"
    "Only Mixtral-expressible models export: softmax router with top-k weights summing to 1,\n"
    "no groups, expert bias, shared experts or dense layers, scaling 1, dropless; f32 or bf16.\n"
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
    memset(&lm, 0, sizeof lm);
    /* On the CPU whatever the checkpoint trained on: export only reads the weights. */
    int rc = tmd_ckpt_load_model(ckpt, TMD_DEVICE_CPU, 0, &lm, err, sizeof err);
    if (!rc) rc = tmd_hf_export(lm.ctx, lm.model, out, err, sizeof err);
    if (rc) {
        fprintf(stderr, "tinymoe: export: %s\n", err);
    } else {
        int64_t active, total = tm_model_num_params(lm.model, &active);
        printf("exported %s (step %lld, %lld parameters, %lld active per token) to %s/%s and %s/%s\n", lm.path,
               (long long)lm.state.step, (long long)total, (long long)active, out, TMD_HF_CONFIG_FILE, out, TMD_HF_WEIGHTS_FILE);
    }
    tmd_loaded_model_free(&lm);
    return rc;
}
