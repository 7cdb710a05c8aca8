/* data.c — llm.c token files, the byte-level tokenizer and deterministic batching; see data.h.
 *
 * Every multi-byte value on disk is encoded and decoded byte by byte as little-endian, so the
 * files are the same on any host (no byte-order assumption, no #if on endianness). */
#include "data.h"

#include <errno.h>
#include <glob.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "atomic.h"
#include "bpe.h"
#include "status.h"
#include "tinymoe.h"
#include "util.h"

#define HEADER_BYTES (TMD_DATA_HEADER_INTS * 4)
/* Tokens converted per fread/fwrite: bounds the staging buffer (256 KiB of bytes). */
#define CHUNK_TOKENS 65536

/* Copy a name into a fixed buffer, keeping the end (the file name) when it is too long. */
static void set_source(char *dst, size_t cap, const char *src) {
    size_t n = strlen(src);
    if (n < cap) {
        memcpy(dst, src, n + 1);
    } else {
        memcpy(dst, "...", 3);
        memcpy(dst + 3, src + n - (cap - 4), cap - 4);
        dst[cap - 1] = '\0';
    }
}

static int32_t get_i32le(const unsigned char *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}
static void put_u32le(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

/* ------------------------------------------------------------------------------------------
 * Loading
 * ------------------------------------------------------------------------------------------ */

/* One validated shard: its token width, count and size. Validation opens the file and closes
 * it again; reading opens it once more (so a corpus of any number of shards holds one file
 * descriptor at a time, under any `ulimit -n`). */
typedef struct {
    FILE *f;
    int width; /* bytes per token: 2 (version 1) or 4 (version 7) */
    int64_t n, size;
} shard;

static int validate_shard(const char *path, shard *s, char *err, size_t errlen);

static int open_shard(const char *path, shard *s, char *err, size_t errlen) {
    int rc = validate_shard(path, s, err, errlen);
    if (s->f) fclose(s->f);
    s->f = NULL;
    return rc;
}

/* The hint for a file that is no token file: text (no NUL, tabs / newlines / printable bytes
 * or UTF-8 in the first 4 KiB) is what people give first. */
static const char *not_tokens_hint(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return "";
    unsigned char b[4096];
    size_t n = fread(b, 1, sizeof b, f);
    fclose(f);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (b[i] == 0 || (b[i] < 0x20 && b[i] != '\n' && b[i] != '\r' && b[i] != '\t')) bad++;
    if (n == 0 || bad * 100 > n) return "";
    static char hint[1200];
    snprintf(hint, sizeof hint,
             "; it looks like text: make a token file of it with 'tinymoe tokenize %.900s tokens.bin --val-fraction "
             "0.1' and give --data tokens.bin --val_data tokens_val.bin",
             path);
    return hint;
}

static int validate_shard(const char *path, shard *s, char *err, size_t errlen) {
    s->f = fopen(path, "rb");
    if (!s->f) return tmd_fail(err, errlen, -1, "cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(s->f), &st) != 0) return tmd_fail(err, errlen, -1, "cannot stat '%s': %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return tmd_fail(err, errlen, -1, "'%s' is not a regular file", path);
    int64_t size = (int64_t)st.st_size;
    s->size = size;
    if (size < HEADER_BYTES)
        return tmd_fail(err, errlen, -1,
                        "'%s' is %lld bytes, shorter than the %d-byte header of a token file (truncated, or "
                        "not a token file)%s",
                        path, (long long)size, HEADER_BYTES, not_tokens_hint(path));
    unsigned char h[HEADER_BYTES];
    if (fread(h, 1, sizeof h, s->f) != sizeof h)
        return tmd_fail(err, errlen, -1, "cannot read the header of '%s': %s", path,
                        ferror(s->f) ? strerror(errno) : "unexpected end of file");

    int32_t magic = get_i32le(h), version = get_i32le(h + 4), count = get_i32le(h + 8);
    int want_version;
    if (magic == TMD_DATA_MAGIC_V1) {
        want_version = 1;
        s->width = 2;
    } else if (magic == TMD_DATA_MAGIC_V7) {
        want_version = 7;
        s->width = 4;
    } else {
        return tmd_fail(err, errlen, -1,
                        "'%s' has magic %d, expected %d (llm.c tokens, uint16) or %d (uint32): not a "
                        "token file%s",
                        path, magic, TMD_DATA_MAGIC_V1, TMD_DATA_MAGIC_V7, not_tokens_hint(path));
    }
    if (version != want_version)
        return tmd_fail(err, errlen, -1, "'%s' has version %d, but its magic %d means version %d", path, version, magic,
                        want_version);
    if (count < 0) return tmd_fail(err, errlen, -1, "'%s' declares a negative token count %d", path, count);
    s->n = count;
    int64_t body = size - HEADER_BYTES, want = (int64_t)count * s->width;
    if (body < want)
        return tmd_fail(err, errlen, -1,
                        "'%s' is truncated: its header declares %d tokens (%lld bytes) but only %lld bytes "
                        "follow the header",
                        path, count, (long long)want, (long long)body);
    if (body > want)
        return tmd_fail(err, errlen, -1,
                        "'%s' has %lld bytes after the %d tokens its header declares (wrong count, or "
                        "appended data)",
                        path, (long long)(body - want), count);
    return 0;
}

/* Append the n tokens of s at dst, decoding little-endian uint16/uint32: the file is opened
 * again (it must still be the size validated) and closed before returning. */
static int read_tokens_open(shard *s, const char *path, uint32_t *dst, unsigned char *buf, char *err, size_t errlen);
static int read_tokens(shard *s, const char *path, uint32_t *dst, unsigned char *buf, char *err, size_t errlen) {
    s->f = fopen(path, "rb");
    if (!s->f) return tmd_fail(err, errlen, -1, "cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    int rc;
    if (fstat(fileno(s->f), &st) != 0 || (int64_t)st.st_size != s->size)
        rc = tmd_fail(err, errlen, -1, "'%s' changed while the data was being loaded (%lld bytes, then %lld)", path,
                      (long long)s->size, (long long)st.st_size);
    else if (fseek(s->f, HEADER_BYTES, SEEK_SET) != 0)
        rc = tmd_fail(err, errlen, -1, "cannot seek in '%s': %s", path, strerror(errno));
    else
        rc = read_tokens_open(s, path, dst, buf, err, errlen);
    fclose(s->f);
    s->f = NULL;
    return rc;
}

static int read_tokens_open(shard *s, const char *path, uint32_t *dst, unsigned char *buf, char *err, size_t errlen) {
    for (int64_t done = 0; done < s->n;) {
        size_t k = (size_t)(s->n - done < CHUNK_TOKENS ? s->n - done : CHUNK_TOKENS);
        if (fread(buf, (size_t)s->width, k, s->f) != k)
            return tmd_fail(err, errlen, -1, "cannot read the tokens of '%s': %s", path,
                            ferror(s->f) ? strerror(errno) : "file shrank while being read");
        if (s->width == 2)
            for (size_t i = 0; i < k; i++) dst[done + i] = (uint32_t)buf[2 * i] | (uint32_t)buf[2 * i + 1] << 8;
        else
            for (size_t i = 0; i < k; i++) dst[done + i] = (uint32_t)get_i32le(buf + 4 * i);
        done += (int64_t)k;
    }
    return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The whole source is read into one uint32 array (4 bytes per token whatever the file width):
 * fine for the corpora this driver trains on (tens of millions of tokens at most); a streaming
 * or mmap reader would replace this for larger ones. All headers are validated before any
 * token is read, so a bad shard costs no I/O on the others. */
int tmd_tokens_load(const char *pattern, tmd_tokens *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (!pattern || !*pattern) return tmd_fail(err, errlen, -1, "no token file given");

    /* A plain path is opened directly so a missing file reports strerror (glob would only say
     * "no match"); a pattern must match at least one file. */
    char **paths = NULL;
    size_t npaths = 0;
    glob_t g;
    memset(&g, 0, sizeof g);
    int globbed = strpbrk(pattern, "*?[") != NULL;
    if (globbed) {
        int rc = glob(pattern, 0, NULL, &g);
        if (rc != 0) {
            globfree(&g);
            if (rc == GLOB_NOMATCH) return tmd_fail(err, errlen, -1, "no file matches '%s'", pattern);
            return tmd_fail(err, errlen, -1, "cannot expand '%s': %s", pattern,
                            rc == GLOB_NOSPACE ? "out of memory" : "read error");
        }
        /* glob sorts with strcoll; re-sort bytewise so the shard order never depends on the
         * locale. */
        paths = g.gl_pathv;
        npaths = g.gl_pathc;
        qsort(paths, npaths, sizeof *paths, cmp_str);
    } else {
        paths = (char **)&pattern;
        npaths = 1;
    }

    int rc = -1;
    shard *sh = calloc(npaths, sizeof *sh);
    unsigned char *buf = malloc((size_t)CHUNK_TOKENS * 4);
    if (!sh || !buf) {
        tmd_fail(err, errlen, -1, "out of memory listing the files of '%s'", pattern);
        goto done;
    }
    int64_t total = 0;
    for (size_t i = 0; i < npaths; i++) {
        if (open_shard(paths[i], &sh[i], err, errlen) != 0) goto done;
        total += sh[i].n;
    }
    if (total == 0) {
        tmd_fail(err, errlen, -1, "'%s' holds no tokens", pattern);
        goto done;
    }
    if ((uint64_t)total > SIZE_MAX / sizeof(uint32_t) || !(out->tok = malloc((size_t)total * sizeof(uint32_t)))) {
        tmd_fail(err, errlen, -1, "out of memory for the %lld tokens of '%s'", (long long)total, pattern);
        goto done;
    }
    if (!(out->shards = calloc(npaths, sizeof *out->shards))) {
        tmd_fail(err, errlen, -1, "out of memory listing the files of '%s'", pattern);
        goto done;
    }
    int64_t at = 0;
    for (size_t i = 0; i < npaths; i++) {
        if (read_tokens(&sh[i], paths[i], out->tok + at, buf, err, errlen) != 0) goto done;
        out->shards[i].start = at;
        out->shards[i].file_pos = 0;
        if (!(out->shards[i].path = strdup(paths[i]))) {
            tmd_fail(err, errlen, -1, "out of memory listing the files of '%s'", pattern);
            goto done;
        }
        out->n_shards = (int)i + 1;
        at += sh[i].n;
    }
    out->n = total;
    uint32_t mx = 0;
    for (int64_t i = 0; i < total; i++) mx = out->tok[i] > mx ? out->tok[i] : mx;
    out->max_token = mx;
    set_source(out->source, sizeof out->source, pattern);
    rc = 0;

done:
    if (sh)
        for (size_t i = 0; i < npaths; i++)
            if (sh[i].f) fclose(sh[i].f);
    free(sh);
    free(buf);
    if (globbed) globfree(&g);
    if (rc != 0) tmd_tokens_free(out);
    return rc;
}

void tmd_tokens_free(tmd_tokens *t) {
    if (!t) return;
    free(t->tok);
    for (int i = 0; i < t->n_shards; i++) free(t->shards[i].path);
    free(t->shards);
    memset(t, 0, sizeof *t);
}

static uint32_t max_of(const uint32_t *tok, int64_t n) {
    uint32_t mx = 0;
    for (int64_t i = 0; i < n; i++) mx = tok[i] > mx ? tok[i] : mx;
    return mx;
}

/* ------------------------------------------------------------------------------------------
 * Split and vocabulary check
 * ------------------------------------------------------------------------------------------ */

int tmd_tokens_split(tmd_tokens *train, double fraction, tmd_tokens *val, char *err, size_t errlen) {
    memset(val, 0, sizeof *val);
    if (!(fraction > 0.0 && fraction < 1.0)) /* also rejects NaN */
        return tmd_fail(err, errlen, -1, "validation fraction %g of '%s' must be in (0, 1)", fraction, train->source);
    int64_t n = train->n, n_val = (int64_t)llround(fraction * (double)n), n_train = n - n_val;
    /* One (input, target) pair needs two tokens: fewer on either side cannot train or
     * evaluate anything. */
    if (n_val < 2 || n_train < 2)
        return tmd_fail(err, errlen, -1,
                        "validation fraction %g of the %lld tokens of '%s' leaves %lld training and %lld "
                        "validation tokens (each needs >= 2)",
                        fraction, (long long)n, train->source, (long long)n_train, (long long)n_val);
    val->tok = malloc((size_t)n_val * sizeof(uint32_t));
    if (!val->tok)
        return tmd_fail(err, errlen, -1, "out of memory for the %lld validation tokens of '%s'", (long long)n_val,
                        train->source);
    memcpy(val->tok, train->tok + n_train, (size_t)n_val * sizeof(uint32_t));
    val->n = n_val;
    /* the shards the tail comes from, their starts moved into the tail */
    int first = 0;
    while (first + 1 < train->n_shards && train->shards[first + 1].start <= n_train) first++;
    if (train->n_shards && (val->shards = calloc((size_t)(train->n_shards - first), sizeof *val->shards))) {
        for (int i = first; i < train->n_shards; i++) {
            tmd_token_shard *d = &val->shards[i - first];
            const tmd_token_shard *sr = &train->shards[i];
            d->start = sr->start > n_train ? sr->start - n_train : 0;
            d->file_pos = sr->file_pos + (sr->start > n_train ? 0 : n_train - sr->start);
            if (!(d->path = strdup(sr->path))) break;
            val->n_shards = i - first + 1;
        }
    }
    val->max_token = max_of(val->tok, n_val);
    char name[sizeof val->source + 64];
    snprintf(name, sizeof name, "last %g of %s", fraction, train->source);
    set_source(val->source, sizeof val->source, name);

    /* Shrinking in place keeps train's memory; realloc only returns the tail to the heap. */
    uint32_t *shrunk = realloc(train->tok, (size_t)n_train * sizeof(uint32_t));
    if (shrunk) train->tok = shrunk;
    train->n = n_train;
    train->max_token = max_of(train->tok, n_train);
    return 0;
}

uint64_t tmd_tokens_fingerprint(const tmd_tokens *t) {
    /* FNV-1a over whole tokens, then a final mix so that every token moves every bit. */
    uint64_t h = 1469598103934665603ull ^ (uint64_t)t->n;
    for (int64_t i = 0; i < t->n; i++) h = (h ^ t->tok[i]) * 1099511628211ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

int tmd_tokens_check_vocab(const tmd_tokens *t, int vocab_size, char *err, size_t errlen) {
    if (vocab_size < 1) return tmd_fail(err, errlen, -1, "vocab size %d must be >= 1", vocab_size);
    if (t->max_token < (uint32_t)vocab_size) return 0;
    for (int64_t i = 0; i < t->n; i++)
        if (t->tok[i] >= (uint32_t)vocab_size) {
            /* name the file it came from and the place in it, not only the pattern */
            int k = -1;
            for (int j = 0; j < t->n_shards && t->shards[j].start <= i; j++) k = j;
            if (k >= 0 && (t->n_shards > 1 || strcmp(t->shards[k].path, t->source)))
                return tmd_fail(err, errlen, -1,
                                "token %u at position %lld of '%s' (file %d of %d of '%s', position %lld of the "
                                "stream) is >= the vocab size %d",
                                t->tok[i], (long long)(i - t->shards[k].start + t->shards[k].file_pos),
                                t->shards[k].path, k + 1, t->n_shards, t->source, (long long)i, vocab_size);
            return tmd_fail(err, errlen, -1, "token %u at position %lld of '%s' is >= the vocab size %d", t->tok[i],
                            (long long)i, t->source, vocab_size);
        }
    return 0; /* unreachable while max_token is kept up to date */
}

/* ------------------------------------------------------------------------------------------
 * Writing: staged in a temporary file, then renamed over the target (atomic.h)
 * ------------------------------------------------------------------------------------------ */

/* Write a complete, fsync'ed token file to a staged temporary for `path`, for the caller to
 * publish. On failure nothing is left behind; the code is TMD_CONFIG_ERROR or
 * TMD_RUNTIME_ERROR (status.h). */
static int stage(tmd_atomic *a, const char *path, const uint32_t *tok, int64_t n, char *err, size_t errlen) {
    if (n < 0 || (n > 0 && !tok))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "cannot write '%s': invalid token array", path);
    if (n > INT32_MAX)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "cannot write '%s': %lld tokens exceed the format's int32 count",
                        path, (long long)n);
    uint32_t mx = max_of(tok, n);
    int v7 = mx > UINT16_MAX, width = v7 ? 4 : 2;
    unsigned char *buf = malloc((size_t)CHUNK_TOKENS * 4 > HEADER_BYTES ? (size_t)CHUNK_TOKENS * 4 : HEADER_BYTES);
    if (!buf) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot write '%s': out of memory", path);
    int rc = tmd_atomic_open(a, path, err, errlen);
    if (rc) {
        free(buf);
        return rc;
    }
    memset(buf, 0, HEADER_BYTES);
    put_u32le(buf, v7 ? TMD_DATA_MAGIC_V7 : TMD_DATA_MAGIC_V1);
    put_u32le(buf + 4, v7 ? 7 : 1);
    put_u32le(buf + 8, (uint32_t)n);
    int ok = tmd_atomic_write(a, buf, HEADER_BYTES) == 0;
    for (int64_t done = 0; ok && done < n;) {
        size_t k = (size_t)(n - done < CHUNK_TOKENS ? n - done : CHUNK_TOKENS);
        for (size_t i = 0; i < k; i++) {
            uint32_t v = tok[done + i];
            if (v7) {
                put_u32le(buf + 4 * i, v);
            } else {
                buf[2 * i] = (unsigned char)v;
                buf[2 * i + 1] = (unsigned char)(v >> 8);
            }
        }
        ok = tmd_atomic_write(a, buf, (size_t)width * k) == 0;
        done += (int64_t)k;
    }
    free(buf);
    return tmd_atomic_stage(a, err, errlen);
}

int tmd_tokens_write(const char *path, const uint32_t *tok, int64_t n, char *err, size_t errlen) {
    tmd_atomic a;
    if (stage(&a, path, tok, n, err, errlen) != 0) return -1;
    return tmd_atomic_publish(&a, err, errlen) ? -1 : 0;
}

/* ------------------------------------------------------------------------------------------
 * Byte-level tokenizer
 * ------------------------------------------------------------------------------------------ */

/* out.bin -> out_val.bin; an extension is a '.' inside the last path component that does not
 * start it (".cache" has none), as Python's os.path.splitext. */
static int val_name(const char *out_path, char *dst, size_t cap) {
    const char *base = strrchr(out_path, '/');
    base = base ? base + 1 : out_path;
    const char *dot = strrchr(base, '.');
    if (!dot || dot == base) dot = out_path + strlen(out_path);
    int n = snprintf(dst, cap, "%.*s_val%s", (int)(dot - out_path), out_path, dot);
    return n >= 0 && (size_t)n < cap ? 0 : -1;
}

/* Whether an output would overwrite the input: the same file (device and inode), by any name
 * (a link, "./x", the val file of another name). */
static int same_file(const char *path, const struct stat *in) {
    struct stat st;
    return stat(path, &st) == 0 && st.st_dev == in->st_dev && st.st_ino == in->st_ino;
}

/* The text is held whole (1 byte) and as tokens (4 bytes per byte): 5x the file size, fine
 * for the text corpora a byte-level model trains on. */
int tmd_tokenize_file(const char *in_path, const char *out_path, double val_fraction, char *val_path_out,
                      size_t val_path_len, char *err, size_t errlen) {
    return tmd_tokenize_file_bpe(in_path, out_path, val_fraction, NULL, val_path_out, val_path_len, err, errlen);
}

/* Bytes, or BPE ids of the text, then the end-of-text token: *tok (malloc'ed), *n. */
static int encode_text(const unsigned char *text, int64_t nbytes, tmd_bpe *bpe, const char *in_path, uint32_t **tok,
                       int64_t *n, char *err, size_t errlen) {
    if (!bpe) {
        if (!(*tok = malloc((size_t)(nbytes + 1) * sizeof **tok)))
            return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory for the %lld bytes of '%s'",
                            (long long)nbytes, in_path);
        for (int64_t i = 0; i < nbytes; i++) (*tok)[i] = text[i];
        (*tok)[nbytes] = TMD_BYTE_EOT;
        *n = nbytes + 1;
        return 0;
    }
    int64_t cap = nbytes / 3 + 16;
    *n = 0;
    if (!(*tok = malloc((size_t)cap * sizeof **tok)))
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory for the tokens of '%s'", in_path);
    int rc = tmd_bpe_encode(bpe, (const char *)text, (size_t)nbytes, tok, n, &cap, err, errlen);
    int eot = tmd_bpe_eot(bpe);
    if (!rc && eot >= 0) {
        uint32_t e = (uint32_t)eot;
        rc = tmd_bpe_encode_append(tok, n, &cap, &e, 1) ? tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory") : 0;
    }
    return rc;
}

int tmd_tokenize_file_bpe(const char *in_path, const char *out_path, double val_fraction, tmd_bpe *bpe,
                          char *val_path_out, size_t val_path_len, char *err, size_t errlen) {
    const int BAD = TMD_CONFIG_ERROR, IO = TMD_RUNTIME_ERROR;
    if (val_path_out && val_path_len) val_path_out[0] = '\0';
    if (!(val_fraction >= 0.0 && val_fraction < 1.0))
        return tmd_fail(err, errlen, BAD, "validation fraction %g must be in [0, 1)", val_fraction);
    char val_path[4096] = "";
    if (val_fraction > 0.0) {
        if (val_name(out_path, val_path, sizeof val_path) != 0)
            return tmd_fail(err, errlen, BAD, "output path '%s' is too long", out_path);
        if (val_path_out && strlen(val_path) >= val_path_len)
            return tmd_fail(err, errlen, BAD, "no room for the validation file name '%s'", val_path);
    }

    FILE *f = fopen(in_path, "rb");
    if (!f) return tmd_fail(err, errlen, BAD, "cannot open '%s': %s", in_path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return tmd_fail(err, errlen, BAD, "'%s' is not a readable regular file", in_path);
    }
    /* Every output against the input, before anything is read or written: replacing the text
     * by its own tokens (OUT named like the input, or OUT_val: `tokenize y_val.bin y.bin`) is
     * surely not what was meant. */
    const char *outs[2] = {out_path, val_path[0] ? val_path : NULL};
    for (int o = 0; o < 2; o++)
        if (outs[o] && same_file(outs[o], &st)) {
            fclose(f);
            return tmd_fail(err, errlen, BAD, "output '%s'%s is the input file '%s'", outs[o],
                            o ? " (the validation part)" : "", in_path);
        }
    if (st.st_size == 0) {
        fclose(f);
        return tmd_fail(err, errlen, BAD, "'%s' is empty: nothing to tokenize", in_path);
    }
    int64_t nbytes = (int64_t)st.st_size, n = 0;
    if (nbytes + 1 > INT32_MAX && !bpe) {
        fclose(f);
        return tmd_fail(err, errlen, BAD, "'%s' has %lld bytes, more tokens than a token file can hold", in_path,
                        (long long)nbytes);
    }
    unsigned char *text = malloc((size_t)nbytes);
    uint32_t *tok = NULL;
    int rc = IO;
    tmd_atomic a_train = {0}, a_val = {0}; /* zeroed: tmd_atomic_abort does nothing */
    if (!text) {
        tmd_fail(err, errlen, IO, "out of memory for the %lld bytes of '%s'", (long long)nbytes, in_path);
        goto done;
    }
    if (fread(text, 1, (size_t)nbytes, f) != (size_t)nbytes) {
        tmd_fail(err, errlen, IO, "cannot read '%s': %s", in_path,
                 ferror(f) ? strerror(errno) : "file shrank while being read");
        goto done;
    }
    if ((rc = encode_text(text, nbytes, bpe, in_path, &tok, &n, err, errlen))) goto done;
    rc = IO;
    if (n > INT32_MAX) {
        rc = tmd_fail(err, errlen, BAD, "'%s' makes %lld tokens, more than a token file can hold", in_path, (long long)n);
        goto done;
    }

    int64_t n_train = n;
    if (val_fraction > 0.0) {
        int64_t n_val = (int64_t)llround(val_fraction * (double)n);
        n_train = n - n_val;
        if (n_val < 2 || n_train < 2) {
            rc = tmd_fail(err, errlen, BAD,
                          "validation fraction %g of the %lld tokens of '%s' leaves %lld training and %lld "
                          "validation tokens (each needs >= 2)",
                          val_fraction, (long long)n, in_path, (long long)n_train, (long long)n_val);
            goto done;
        }
        /* Both files are staged before either is renamed into place: a failure leaves neither
         * half-written nor one new beside one stale. */
        if ((rc = stage(&a_val, val_path, tok + n_train, n_val, err, errlen)) != 0) goto done;
    }
    if ((rc = stage(&a_train, out_path, tok, n_train, err, errlen)) != 0) goto done;
    rc = IO;
    if (val_fraction > 0.0 && tmd_atomic_publish(&a_val, err, errlen) != 0) goto done;
    if (tmd_atomic_publish(&a_train, err, errlen) != 0) goto done;
    if (val_path_out && val_path_len) snprintf(val_path_out, val_path_len, "%s", val_path);
    rc = 0;

done:
    tmd_atomic_abort(&a_val);
    tmd_atomic_abort(&a_train);
    fclose(f);
    free(text);
    free(tok);
    return rc;
}

/* ------------------------------------------------------------------------------------------
 * Batching
 * ------------------------------------------------------------------------------------------ */

/* Fourth counter word: keeps the batcher's Philox stream apart from other users of the same
 * seed (initialisation, the synthetic source), which put small stream ids there. */
#define BATCH_STREAM 0x62617463u /* "batc" */

int tmd_batcher_init(tmd_batcher *bt, const tmd_tokens *data, int B, int T, uint64_t seed, char *err,
                     size_t errlen) {
    memset(bt, 0, sizeof *bt);
    if (B < 1) return tmd_fail(err, errlen, -1, "batch size B = %d must be >= 1", B);
    if (T < 1) return tmd_fail(err, errlen, -1, "sequence length T = %d must be >= 1", T);
    if (!data || !data->tok) return tmd_fail(err, errlen, -1, "no token data to batch");
    if (data->n < (int64_t)T + 1)
        return tmd_fail(err, errlen, -1, "a window of T+1 = %lld tokens does not fit in the %lld tokens of '%s'",
                        (long long)T + 1, (long long)data->n, data->source);
    bt->data = data;
    bt->B = B;
    bt->T = T;
    bt->seed = seed;
    bt->position = 0;
    return 0;
}

void tmd_batcher_next(tmd_batcher *bt, int32_t *inputs, int32_t *targets) {
    tmd_batcher_next_rows(bt, 0, bt->B, inputs, targets);
}

void tmd_batcher_next_rows(tmd_batcher *bt, int b0, int rows, int32_t *inputs, int32_t *targets) {
    const uint32_t *tok = bt->data->tok;
    const int T = bt->T;
    const uint64_t n_start = (uint64_t)(bt->data->n - T); /* offsets 0 .. n - T - 1 */
    const uint32_t key[2] = {(uint32_t)bt->seed, (uint32_t)(bt->seed >> 32)};
    const uint64_t p = (uint64_t)bt->position;
    for (int b = b0; b < b0 + rows; b++) {
        uint32_t ctr[4] = {(uint32_t)p, (uint32_t)(p >> 32), (uint32_t)b, BATCH_STREAM}, r[4];
        tm_philox4x32_10(ctr, key, r);
        /* 64 random bits mod n_start: the bias, under n_start / 2^64, is far below anything a
         * training run could notice. */
        uint64_t off = ((uint64_t)r[0] << 32 | r[1]) % n_start;
        const uint32_t *w = tok + off;
        int32_t *in = inputs + (size_t)(b - b0) * T, *tg = targets + (size_t)(b - b0) * T;
        for (int t = 0; t < T; t++) {
            in[t] = (int32_t)w[t];
            tg[t] = (int32_t)w[t + 1];
        }
    }
    bt->position++;
}
