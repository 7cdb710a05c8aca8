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

#include "status.h"
#include "strbuf.h"
#include "util.h"

#define META_MAGIC "tinymoe-checkpoint 1"

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

int tmd_ckpt_meta_decode(const char *meta, size_t len, const char *path, tmd_config *cfg, tmd_ckpt_state *state,
                         char *err, size_t errlen) {
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
                int64_t x;
                if (parse_i64(v, &x))
                    rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': meta line %d: '%s' is not a count", path, line,
                                  v);
                else if (!strcmp(k, "step")) state->step = x, have_step = 1;
                else if (!strcmp(k, "data_position")) state->data_position = x, have_pos = 1;
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
    int64_t *steps;
    int n, rc = tmd_ckpt_list(ckpt, &steps, &n, err, errlen);
    if (rc) return rc;
    if (n == 0) {
        free(steps);
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "directory '%s' holds no checkpoint (ckpt-*" TMD_CKPT_EXT ")",
                        ckpt);
    }
    tmd_ckpt_path(ckpt, steps[n - 1], path, pathlen);
    free(steps);
    return 0;
}

int tmd_ckpt_read_meta(const char *path, tmd_config *cfg, tmd_ckpt_state *state, char *err, size_t errlen) {
    tm_ctx *ctx = NULL;
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    if (tm_ctx_new(&ctx, &o)) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "%s", tm_last_create_error());
    tm_ckpt_info *info = NULL;
    tm_status s = tm_ckpt_inspect(ctx, path, &info);
    int rc;
    if (s)
        rc = tmd_fail(err, errlen, s == TM_ERR_NOMEM ? TMD_RUNTIME_ERROR : TMD_CONFIG_ERROR, "%s", tm_ctx_errmsg(ctx));
    else rc = tmd_ckpt_meta_decode(info->meta, info->meta_bytes, path, cfg, state, err, errlen);
    tm_ckpt_info_free(info);
    tm_ctx_free(ctx);
    return rc;
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
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = threads;
    o.cuda_device = c->device == TMD_DEVICE_CUDA ? 0 : -1;
    if (tm_ctx_new(&out->ctx, &o)) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "%s", tm_last_create_error());
    tm_device dev = {c->device == TMD_DEVICE_CUDA ? TM_DEVICE_CUDA : TM_DEVICE_CPU, 0};
    tm_status s = tm_model_new(out->ctx, &c->model, c->dtype == TMD_DTYPE_BF16 ? TM_BF16 : TM_F32, dev, &out->model);
    if (!s) s = tm_ckpt_load_flags(out->ctx, out->path, TM_CKPT_SKIP_UNKNOWN, NULL, 0, NULL);
    if (s) {
        rc = tmd_fail(err, errlen, s == TM_ERR_NOMEM || s == TM_ERR_CUDA ? TMD_RUNTIME_ERROR : TMD_CONFIG_ERROR,
                      "loading '%s': %s", out->path, tm_ctx_errmsg(out->ctx));
        tmd_loaded_model_free(out);
    }
    return rc;
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
