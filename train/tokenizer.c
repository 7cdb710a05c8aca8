/*
 * tokenizer.c — the tokenizer of a run, a checkpoint and a prompt (tokenizer.h).
 */
#include "tokenizer.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "atomic.h"
#include "data.h"
#include "status.h"
#include "util.h"

static int readable(const char *path);

int tmd_tokenizer_for_run(tmd_config *c, const char *resume_ckpt, tmd_bpe **out, char *used, size_t used_len,
                          char *err, size_t errlen) {
    *out = NULL;
    if (used_len) used[0] = 0;
    if (!c->tokenizer[0]) return 0;
    char path[TMD_PATH_MAX + 32];
    snprintf(path, sizeof path, "%s", c->tokenizer);
    if (resume_ckpt && !readable(path)) {
        tmd_tokenizer_file_of_ckpt(resume_ckpt, c, path, sizeof path);
        if (!path[0]) snprintf(path, sizeof path, "%s", c->tokenizer); /* its own message, below */
        else tmd_config_note(c, "key 'tokenizer' = '%s' is gone: the run's copy %s is used", c->tokenizer, path);
    }
    snprintf(used, used_len, "%s", path);
    char e[2048];
    int rc = tmd_bpe_load(path, out, e, sizeof e);
    if (rc) return tmd_fail(err, errlen, rc, "key 'tokenizer': %s", e);
    int need = tmd_bpe_vocab_size(*out), vi = tmd_config_key_index("vocab_size");
    if (c->source[vi] == TMD_SRC_AUTO) {
        c->model.vocab_size = need;
        return 0;
    }
    if (c->model.vocab_size < need) {
        rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                      "key 'vocab_size' = %d: smaller than the %d ids of key 'tokenizer' = '%s' (leave vocab_size "
                      "unset to take %d, or give a larger one, e.g. a multiple of 64)",
                      c->model.vocab_size, need, c->tokenizer, need);
        tmd_bpe_free(*out);
        *out = NULL;
    }
    return rc;
}

int tmd_tokenizer_copy(const char *src, const char *dir, char *err, size_t errlen) {
    char dst[TMD_PATH_MAX + 32];
    snprintf(dst, sizeof dst, "%s/%s", dir, TMD_TOKENIZER_FILE);
    struct stat a, b;
    if (stat(src, &a) == 0 && stat(dst, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) return 0;
    unsigned char *data;
    size_t len;
    int rc = tmd_read_file(src, 0, &data, &len, err, errlen);
    if (rc) return rc;
    tmd_atomic at;
    if ((rc = tmd_atomic_open(&at, dst, err, errlen))) {
        free(data);
        return rc;
    }
    tmd_atomic_write(&at, data, len);
    free(data);
    return tmd_atomic_commit(&at, err, errlen);
}

static int readable(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

void tmd_tokenizer_file_of_ckpt(const char *ckpt_path, const tmd_config *cfg, char *path, size_t len) {
    const char *slash = strrchr(ckpt_path, '/');
    if (slash) snprintf(path, len, "%.*s/%s", (int)(slash - ckpt_path), ckpt_path, TMD_TOKENIZER_FILE);
    else snprintf(path, len, "%s", TMD_TOKENIZER_FILE);
    if (readable(path)) return;
    if (cfg->tokenizer[0] && readable(cfg->tokenizer)) snprintf(path, len, "%s", cfg->tokenizer);
    else path[0] = 0;
}

int tmd_tokenizer_for_ckpt(const char *ckpt_path, const tmd_config *cfg, const char *explicit_path, tmd_bpe **out,
                           char *found, size_t foundlen, char *err, size_t errlen) {
    *out = NULL;
    char path[TMD_PATH_MAX + 32];
    if (explicit_path) snprintf(path, sizeof path, "%s", explicit_path);
    else tmd_tokenizer_file_of_ckpt(ckpt_path, cfg, path, sizeof path);
    if (found && foundlen) snprintf(found, foundlen, "%s", path);
    int V = cfg->model.vocab_size;
    if (!path[0]) {
        if (V == TMD_BYTE_VOCAB) return 0;
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "the model of '%s' has vocab_size %d but no tokenizer: no %s beside it%s%s%s; give --tokenizer "
                        "PATH/tokenizer.json (the one its token files were made with; llm.c's GPT-2 shards: GPT-2's)",
                        ckpt_path, V, TMD_TOKENIZER_FILE, cfg->tokenizer[0] ? ", and its key 'tokenizer' = '" : "",
                        cfg->tokenizer, cfg->tokenizer[0] ? "' is not there" : " and its key 'tokenizer' is empty");
    }
    char e[2048];
    int rc = tmd_bpe_load(path, out, e, sizeof e);
    if (rc) return tmd_fail(err, errlen, rc, "%s", e);
    if (tmd_bpe_vocab_size(*out) > V) {
        rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                      "tokenizer '%s' has %d ids, more than the vocab_size %d of the model of '%s': not the tokenizer "
                      "it was trained with",
                      path, tmd_bpe_vocab_size(*out), V, ckpt_path);
        tmd_bpe_free(*out);
        *out = NULL;
    }
    return rc;
}

int tmd_prompt_tokens(tmd_bpe *bpe, const char *text, int vocab_size, const char *what, int32_t **ids, int *n,
                      char *err, size_t errlen) {
    *ids = NULL;
    *n = 0;
    size_t len = strlen(text);
    uint32_t *v = NULL;
    int64_t nv = 0, cap = 0;
    int eot = bpe ? tmd_bpe_eot(bpe) : vocab_size > TMD_BYTE_EOT ? TMD_BYTE_EOT : -1;
    if (!len) {
        if (eot < 0)
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                            "an empty %s starts from the end-of-text token, which %s lacks; give a text", what,
                            bpe ? "the tokenizer" : "this model's vocabulary");
        uint32_t e = (uint32_t)eot;
        if (tmd_bpe_encode_append(&v, &nv, &cap, &e, 1)) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
    } else if (bpe) {
        int rc = tmd_bpe_encode(bpe, text, len, &v, &nv, &cap, err, errlen);
        if (rc) return rc;
    } else {
        for (size_t i = 0; i < len; i++) {
            uint32_t b = (unsigned char)text[i];
            if (tmd_bpe_encode_append(&v, &nv, &cap, &b, 1)) {
                free(v);
                return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
            }
        }
    }
    if (nv > 1 << 30) {
        free(v);
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s is too long (%lld tokens)", what, (long long)nv);
    }
    for (int64_t i = 0; i < nv; i++)
        if (v[i] >= (uint32_t)vocab_size) {
            int rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                              bpe ? "%s: token %lld is %u, outside this model's vocabulary (vocab_size = %d)"
                                  : "%s: byte %lld is 0x%02x, outside this model's vocabulary (vocab_size = %d: not a "
                                    "byte-level model? give its tokenizer)",
                              what, (long long)i, v[i], vocab_size);
            free(v);
            return rc;
        }
    *ids = (int32_t *)v; /* ids < vocab_size <= INT_MAX: the same bits as int32 */
    *n = (int)nv;
    return 0;
}
