/* checkpoint.c — the driver's checkpoint files: meta text, finding the newest, loading one as
 * a model; see checkpoint.h. */
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "finite.h"
#include "status.h"
#include "strbuf.h"
#include "util.h"

#define META_MAGIC "tinymoe-checkpoint 1"
#define META_MAX (1 << 20)

/* ---- meta text ------------------------------------------------------------------------- */

char *tmd_ckpt_meta_encode(const tmd_config *cfg, const tmd_ckpt_state *state, size_t *len) {
    tmd_sbuf b = {0};
    tmd_sb_printf(&b, "%s\n[config]\n", META_MAGIC);
    char val[4 * TMD_PATH_MAX];
    for (int i = 0; i < tmd_config_num_keys(); i++) {
        tmd_config_format_exact(cfg, i, val, sizeof val);
        tmd_sb_printf(&b, "%s = %s\n", tmd_config_key_name(i), val);
    }
    tmd_sb_printf(&b, "[state]\nstep = %" PRId64 "\ndata_position = %" PRId64 "\n", state->step, state->data_position);
    const tmd_data_id *d = &state->data;
    if (d->data_tokens)
        tmd_sb_printf(&b, "data_tokens = %" PRId64 "\ndata_fingerprint = %016" PRIx64 "\n", d->data_tokens, d->data_hash);
    if (d->val_tokens)
        tmd_sb_printf(&b, "val_tokens = %" PRId64 "\nval_fingerprint = %016" PRIx64 "\n", d->val_tokens, d->val_hash);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    *len = b.n;
    return b.p;
}

static int parse_i64(const char *s, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || errno || v < 0) return -1;
    *out = v;
    return 0;
}

static int parse_hex64(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    if (strlen(s) != 16) return -1;
    unsigned long long v = strtoull(s, &end, 16);
    if (*end || errno) return -1;
    *out = v;
    return 0;
}

int tmd_ckpt_meta_decode(const char *meta, size_t len, const char *path, tmd_config *cfg, tmd_ckpt_state *state,
                         char *err, size_t errlen) {
    /* tinymoe writes about 3 KB; a meta a thousand times that is not one of ours. */
    if (len > META_MAX)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "'%s' has %zu bytes of meta, more than the %d a checkpoint of 'tinymoe train' has", path, len,
                        META_MAX);
    char *text = malloc(len + 1);
    if (!text) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory reading '%s'", path);
    memcpy(text, meta, len);
    text[len] = 0;
    tmd_config_defaults(cfg);
    memset(state, 0, sizeof *state);
    int rc = 0, section = -1, have_step = 0, have_pos = 0, line = 0;
    char *s = text;
    if (strlen(text) != len || strncmp(text, META_MAGIC "\n", strlen(META_MAGIC) + 1)) {
        rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                      "'%s' is a tinymoe checkpoint file but not one written by 'tinymoe train' (its meta does not "
                      "start with '%s')",
                      path, META_MAGIC);
        goto done;
    }
    while (s && !rc) {
        line++;
        char *nl = strchr(s, '\n');
        if (nl) *nl = 0;
        if (line == 1) {
            s = nl ? nl + 1 : NULL;
            continue;
        }
        if (!strcmp(s, "[config]") || !strcmp(s, "[state]")) {
            section = s[1] == 'c' ? 0 : 1;
        } else {
            char *k, *v;
            const char *why = NULL;
            int r = tmd_config_parse_line(s, &k, &v, &why);
            if (r < 0 || (r > 0 && section < 0)) {
                rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': meta line %d: %s", path, line,
                              r < 0 ? why : "entry outside a section");
            } else if (r > 0 && section == 0) {
                char where[TMD_PATH_MAX + 64], e2[1024];
                snprintf(where, sizeof where, "meta line %d of %s", line, path);
                /* Keys of a newer or older build: refuse, the run would not be the same. */
                if (tmd_config_set(cfg, k, v, TMD_SRC_FILE, where, e2, sizeof e2))
                    rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR, "checkpoint config: %s", e2);
            } else if (r > 0) {
                int64_t x = 0;
                uint64_t h = 0;
                int hex = strstr(k, "_fingerprint") != NULL;
                if (hex ? parse_hex64(v, &h) : parse_i64(v, &x))
                    rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': meta line %d: '%s' is not %s", path, line, v,
                                  hex ? "a 16-digit hexadecimal fingerprint" : "a count");
                else if (!strcmp(k, "step")) state->step = x, have_step = 1;
                else if (!strcmp(k, "data_position")) state->data_position = x, have_pos = 1;
                else if (!strcmp(k, "data_tokens")) state->data.data_tokens = x;
                else if (!strcmp(k, "val_tokens")) state->data.val_tokens = x;
                else if (!strcmp(k, "data_fingerprint")) state->data.data_hash = h;
                else if (!strcmp(k, "val_fingerprint")) state->data.val_hash = h;
                else
                    rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': meta line %d: unknown state '%s'", path, line,
                                  k);
            }
        }
        s = nl ? nl + 1 : NULL;
    }
    if (!rc && (!have_step || !have_pos))
        rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': meta lacks the %s", path,
                      !have_step ? "step" : "data_position");
    /* Where a value came from is now "the checkpoint" (shown for values off their default). */
    if (!rc) {
        tmd_config d;
        tmd_config_defaults(&d);
        char a[4 * TMD_PATH_MAX], b[4 * TMD_PATH_MAX];
        for (int i = 0; i < tmd_config_num_keys(); i++) {
            tmd_config_format_exact(cfg, i, a, sizeof a);
            tmd_config_format_exact(&d, i, b, sizeof b);
            cfg->source[i] = strcmp(a, b) ? TMD_SRC_CKPT : TMD_SRC_DEFAULT;
        }
    }
done:
    free(text);
    return rc;
}

/* ---- finding checkpoints --------------------------------------------------------------- */

/* Step of a "ckpt-<digits>.tmck" name, or -1. */
static int64_t ckpt_name_step(const char *name) {
    size_t n = strlen(name), e = strlen(TMD_CKPT_EXT);
    if (n <= 5 + e || strncmp(name, "ckpt-", 5) || strcmp(name + n - e, TMD_CKPT_EXT)) return -1;
    int64_t v = 0;
    for (size_t i = 5; i < n - e; i++) {
        if (name[i] < '0' || name[i] > '9' || v > INT64_MAX / 10 - 9) return -1;
        v = v * 10 + (name[i] - '0');
    }
    return v;
}

int tmd_ckpt_list(const char *dir, int64_t **steps, int *n, char *err, size_t errlen) {
    *steps = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "cannot read directory '%s': %s", dir, strerror(errno));
    int cap = 0, rc = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t s = ckpt_name_step(e->d_name);
        if (s < 0) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            int64_t *ns = realloc(*steps, sizeof *ns * (size_t)cap);
            if (!ns) {
                rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory listing '%s'", dir);
                break;
            }
            *steps = ns;
        }
        (*steps)[(*n)++] = s;
    }
    closedir(d);
    /* Ascending (insertion sort: a handful of files). */
    for (int i = 1; i < *n; i++)
        for (int j = i; j > 0 && (*steps)[j - 1] > (*steps)[j]; j--) {
            int64_t t = (*steps)[j];
            (*steps)[j] = (*steps)[j - 1];
            (*steps)[j - 1] = t;
        }
    return rc;
}

void tmd_ckpt_path(const char *dir, int64_t step, char *path, size_t pathlen) {
    snprintf(path, pathlen, "%s/ckpt-%08" PRId64 TMD_CKPT_EXT, dir, step);
}

int tmd_ckpt_resolve(const char *ckpt, char *path, size_t pathlen, char *err, size_t errlen) {
    struct stat st;
    if (!ckpt || !*ckpt) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "no checkpoint given");
    if (stat(ckpt, &st)) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "checkpoint '%s': %s", ckpt, strerror(errno));
    if (!S_ISDIR(st.st_mode)) {
        if ((size_t)snprintf(path, pathlen, "%s", ckpt) >= pathlen)
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "checkpoint path '%s' is too long", ckpt);
        return 0;
    }
    /* The newest by step, opened under the name it has: a file renamed by hand (ckpt-99.tmck)
     * is found and opened as such, not under the name the run would have written. Of two
     * names for one step (ckpt-99 and ckpt-00000099) the canonical one wins. */
    DIR *d = opendir(ckpt);
    if (!d) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "cannot read directory '%s': %s", ckpt, strerror(errno));
    int64_t best = -1;
    char name[256] = {0}, canon[64];
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t s = ckpt_name_step(e->d_name);
        if (s < 0 || s < best || strlen(e->d_name) >= sizeof name) continue;
        snprintf(canon, sizeof canon, "ckpt-%08" PRId64 TMD_CKPT_EXT, s);
        if (s == best && strcmp(e->d_name, canon)) continue;
        best = s;
        snprintf(name, sizeof name, "%s", e->d_name);
    }
    closedir(d);
    if (best < 0)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "directory '%s' holds no checkpoint (ckpt-*" TMD_CKPT_EXT ")",
                        ckpt);
    if ((size_t)snprintf(path, pathlen, "%s/%s", ckpt, name) >= pathlen)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "checkpoint path '%s/%s' is too long", ckpt, name);
    return 0;
}

/* The file's entry of that name, or NULL. */
static const tm_ckpt_entry *entry_named(const tm_ckpt_info *info, const char *name) {
    for (int i = 0; i < info->num_entries; i++)
        if (!strcmp(info->entries[i].name, name)) return &info->entries[i];
    return NULL;
}

/* Whether entry `name` exists with this shape; otherwise a message naming the keys. */
static int expect_shape(const tm_ckpt_info *info, const char *path, const char *name, int ndim, const int64_t *shape,
                        const char *keys, char *err, size_t errlen) {
    const tm_ckpt_entry *e = entry_named(info, name);
    int ok = e && e->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++) ok = e->shape[d] == shape[d];
    if (ok) return 0;
    char want[96];
    size_t w = (size_t)snprintf(want, sizeof want, "[");
    for (int d = 0; d < ndim && w < sizeof want; d++)
        w += (size_t)snprintf(want + w, sizeof want - w, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (w < sizeof want) snprintf(want + w, sizeof want - w, "]");
    return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                    "'%s': its meta (%s) implies tensor '%s' of shape %s, which the file %s: the meta does not "
                    "describe this file (edited, or from another build)",
                    path, keys, name, want, e ? "holds with another shape" : "does not hold");
}

/* The meta against the tensors, before any model is built from the meta: every key that sizes
 * the model (layers, vocabulary, widths, experts) is read off a tensor's shape. */
static int check_meta_against_file(const tm_ckpt_info *info, const char *path, const tmd_config *c,
                                   const tmd_ckpt_state *st, char *err, size_t errlen) {
    const tm_model_config *m = &c->model;
    /* Layers: the highest "layers.<i>." index in the file + 1. */
    long layers = 0;
    for (int i = 0; i < info->num_entries; i++) {
        const char *n = info->entries[i].name;
        if (strncmp(n, "layers.", 7)) continue;
        char *end;
        long l = strtol(n + 7, &end, 10);
        if (end != n + 7 && *end == '.' && l >= 0 && l < 1000000000 && l + 1 > layers) layers = l + 1;
    }
    if (layers != m->n_layers)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "'%s': its meta says n_layers = %d but the file holds the tensors of %ld layers: the meta does "
                        "not describe this file (edited, or from another build)",
                        path, m->n_layers, layers);
    int64_t ev[2] = {m->vocab_size, m->d_model};
    int rc = expect_shape(info, path, "embed.weight", 2, ev, "vocab_size, d_model", err, errlen);
    char name[96];
    if (!rc && m->first_k_dense > 0) {
        int64_t s[2] = {m->d_model, m->dense_ffn_size};
        rc = expect_shape(info, path, "layers.0.mlp.w0", 2, s, "d_model, dense_ffn_size", err, errlen);
    }
    if (!rc && m->first_k_dense < m->n_layers) {
        int64_t s[3] = {m->moe.router.num_experts, m->d_model, m->moe.ffn_size};
        snprintf(name, sizeof name, "layers.%d.moe.experts.w0", m->first_k_dense);
        rc = expect_shape(info, path, name, 3, s, "num_experts, d_model, expert_ffn_size", err, errlen);
    }
    if (rc) return rc;
    int64_t most = 0;
    int synth = tmd_config_synthetic(c);
    if (!synth && __builtin_mul_overflow(st->step, (int64_t)c->grad_accum, &most)) most = INT64_MAX;
    if (st->data_position > most)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "'%s': its meta says data_position = %lld, beyond the %lld batches that %lld steps of "
                        "grad_accum %d%s can have drawn: the meta is damaged",
                        path, (long long)st->data_position, (long long)most, (long long)st->step, c->grad_accum,
                        synth ? " on synthetic data (which has no position)" : "");
    return 0;
}

int tmd_ckpt_read_meta(const char *path, tmd_config *cfg, tmd_ckpt_state *state, char *err, size_t errlen) {
    tm_ctx *ctx = NULL;
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    if (tm_ctx_new(&ctx, &o)) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "%s", tm_last_create_error());
    tm_ckpt_info *info = NULL;
    /* The index and meta only (a few reads): the load that follows reads and validates the
     * tensors it needs, and eval / sample / export never read the optimizer state. */
    tm_status s = tm_ckpt_inspect_flags(ctx, path, TM_CKPT_INDEX_ONLY, &info);
    int rc;
    if (s)
        rc = tmd_fail(err, errlen, s == TM_ERR_NOMEM ? TMD_RUNTIME_ERROR : TMD_CONFIG_ERROR, "%s", tm_ctx_errmsg(ctx));
    else rc = tmd_ckpt_meta_decode(info->meta, info->meta_bytes, path, cfg, state, err, errlen);
    if (!rc) rc = check_meta_against_file(info, path, cfg, state, err, errlen);
    tm_ckpt_info_free(info);
    tm_ctx_free(ctx);
    return rc;
}

int tmd_ckpt_check_data(const tmd_data_id *was, const tmd_data_id *now, const tmd_config *cfg, const char *path,
                        char *err, size_t errlen) {
    const struct {
        const char *key, *file;
        int64_t n0, n1;
        uint64_t h0, h1;
    } src[2] = {{"data", cfg->data, was->data_tokens, now->data_tokens, was->data_hash, now->data_hash},
                {"val_data", cfg->val_data, was->val_tokens, now->val_tokens, was->val_hash, now->val_hash}};
    for (int i = 0; i < 2; i++) {
        if (!src[i].n0 || (src[i].n0 == src[i].n1 && src[i].h0 == src[i].h1)) continue;
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "key '%s' = '%s': not the data checkpoint '%s' was trained on (it had %lld tokens, fingerprint "
                        "%016llx; the file now has %lld, fingerprint %016llx): the file was replaced or changed since. "
                        "Resume on it anyway with --allow_data_change",
                        src[i].key, src[i].file, path, (long long)src[i].n0, (unsigned long long)src[i].h0,
                        (long long)src[i].n1, (unsigned long long)src[i].h1);
    }
    return 0;
}

/* ---- loading a model ------------------------------------------------------------------- */

void tmd_loaded_model_free(tmd_loaded_model *m) {
    if (!m) return;
    tm_model_free(m->model);
    tm_ctx_free(m->ctx);
    m->model = NULL;
    m->ctx = NULL;
}

int tmd_ckpt_load_model(const char *ckpt, int device, int threads, tmd_loaded_model *out, char *err, size_t errlen) {
    return tmd_ckpt_load_model_ex(ckpt, device, threads, 0, out, err, errlen);
}

int tmd_ckpt_load_model_ex(const char *ckpt, int device, int threads, int with_grads, tmd_loaded_model *out, char *err,
                           size_t errlen) {
    memset(out, 0, sizeof *out);
    int rc = tmd_ckpt_resolve(ckpt, out->path, sizeof out->path, err, errlen);
    if (!rc) rc = tmd_ckpt_read_meta(out->path, &out->cfg, &out->state, err, errlen);
    if (rc) return rc;
    tmd_config *c = &out->cfg;
    if (device >= 0) c->device = device;
    else if (c->device == TMD_DEVICE_CUDA && tm_cuda_device_count() == 0)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "'%s' was trained on cuda, and this build has no CUDA backend or no CUDA device is visible: "
                        "pass --device cpu (checkpoints of either device load on the other)",
                        out->path);
    c->threads = threads;
    /* The meta is input like any other: its values are checked before a model is built. */
    char e[1024];
    if (tmd_config_validate(c, e, sizeof e))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "checkpoint '%s': %s", out->path, e);
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = threads;
    o.cuda_device = c->device == TMD_DEVICE_CUDA ? 0 : -1;
    o.no_grad_buffers = !with_grads; /* eval, sample and export run forwards only */
    if (tm_ctx_new(&out->ctx, &o)) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "%s", tm_last_create_error());
    tm_device dev = {c->device == TMD_DEVICE_CUDA ? TM_DEVICE_CUDA : TM_DEVICE_CPU, 0};
    tm_status s = tm_model_new(out->ctx, &c->model, c->dtype == TMD_DTYPE_BF16 ? TM_BF16 : TM_F32, dev, &out->model);
    if (!s) s = tm_ckpt_load_flags(out->ctx, out->path, TM_CKPT_SKIP_UNKNOWN, NULL, 0, NULL);
    if (s) {
        rc = tmd_fail(err, errlen, s == TM_ERR_NOMEM || s == TM_ERR_CUDA ? TMD_RUNTIME_ERROR : TMD_CONFIG_ERROR,
                      "loading '%s': %s", out->path, tm_ctx_errmsg(out->ctx));
        tmd_loaded_model_free(out);
        return rc;
    }
    char what[TMD_PATH_MAX + 16];
    snprintf(what, sizeof what, "checkpoint '%s'", out->path);
    if ((rc = tmd_require_finite_weights(out->ctx, what, err, errlen))) tmd_loaded_model_free(out);
    return rc;
}

/* data / val_data given as a file (or pattern) on both sides: a path that may be spelled
 * differently; the synthetic source or the held-out tail on either side is a different source. */
static int data_file_respelled(const char *name, const tmd_config *cli, const tmd_config *ck) {
    const char *x = NULL, *y = NULL;
    if (!strcmp(name, "data")) x = cli->data, y = ck->data;
    else if (!strcmp(name, "val_data")) x = cli->val_data, y = ck->val_data;
    else return 0;
    return x[0] && y[0] && strcmp(x, "synthetic") && strcmp(y, "synthetic");
}

int tmd_ckpt_merge_config(const tmd_config *cli, const tmd_config *ck, const char *path, int for_eval,
                          tmd_config *out, char *err, size_t errlen) {
    tmd_config m = *ck;
    char a[4 * TMD_PATH_MAX], b[4 * TMD_PATH_MAX], e2[1024];
    for (int i = 0; i < tmd_config_num_keys(); i++) {
        if (tmd_config_key_layout(i)) {
            /* How this run is launched, whatever launched the one that saved. */
            tmd_config_format_exact(cli, i, a, sizeof a);
            if (tmd_config_set(&m, tmd_config_key_name(i), a, (tmd_source)cli->source[i], "the command line", e2,
                               sizeof e2))
                return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s", e2);
            continue;
        }
        if (cli->source[i] == TMD_SRC_DEFAULT) continue;
        tmd_config_format_exact(cli, i, a, sizeof a);
        tmd_config_format_exact(ck, i, b, sizeof b);
        const char *name = tmd_config_key_name(i);
        if (tmd_config_key_resumable(i, for_eval)) {
            if (tmd_config_set(&m, name, a, (tmd_source)cli->source[i], "the command line", e2, sizeof e2))
                return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s", e2);
        } else if (strcmp(a, b) && data_file_respelled(name, cli, ck)) {
            /* The same data by another path (relative / absolute, a moved directory, a link):
             * the files are compared by what they hold, the token count and fingerprint the
             * checkpoint recorded (tmd_ckpt_check_data, after loading), not by the spelling. */
            if (tmd_config_set(&m, name, a, (tmd_source)cli->source[i], "the command line", e2, sizeof e2))
                return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s", e2);
        } else if (strcmp(a, b)) {
            /* Compared exactly, shown as a person would write them. */
            tmd_config_format(cli, i, a, sizeof a);
            tmd_config_format(ck, i, b, sizeof b);
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                            "key '%s' = %s differs from the checkpoint '%s', which has %s = %s; %s keeps the "
                            "checkpoint's model and training keys (drop the setting%s)",
                            name, a, path, name, b, for_eval ? "evaluating a checkpoint" : "resuming",
                            for_eval ? "" : ", or start a new run without --resume");
        }
    }
    *out = m;
    return 0;
}
