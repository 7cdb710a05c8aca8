/*
 * bpe.c — byte-level BPE from a Hugging Face tokenizer.json (bpe.h): loading and checking the
 * JSON (cJSON), the byte-to-unicode map, ranked merges through a priority queue, added tokens,
 * a cache of pieces, decoding.
 *
 * The reference is tokenizers' own code (tokenizers/src/models/bpe/{model,word}.rs,
 * pre_tokenizers/byte_level.rs, tokenizer/added_vocabulary.rs); where it has a choice to make
 * (ties between equal ranks, a merge listed twice, two kinds of added tokens) this file makes
 * the same one, said where it happens.
 */
#include "bpe.h"

#include <cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bpe_norm.h"
#include "bpe_pretok.h"
#include "status.h"
#include "util.h"

#define MAX_TOKENIZER_BYTES (512u << 20) /* Llama-3's is 9 MB, Qwen2's 7 MB */
#define MAX_ID (1 << 24)                 /* ids beyond are a broken file, not a vocabulary */
#define CACHE_SLOTS (1u << 16)           /* the piece cache is cleared when half full */
#define CACHE_POOL_MAX (16u << 20)

typedef struct added {
    unsigned char *s;
    int len, id;
} added;

/* A set of added tokens, sorted by first byte then longest first: the first that matches at a
 * position is the longest there. */
typedef struct added_set {
    added *tok;
    int n;
    int start[257]; /* tokens starting with byte b: [start[b], start[b + 1]) */
} added_set;

typedef struct cache_slot {
    uint64_t hash;
    uint32_t key_off, key_len, ids_off, ids_n; /* key_len 0: empty */
} cache_slot;

#define MAX_SPLITS 8 /* Split pre-tokenizers in the Sequence before ByteLevel (DeepSeek-V3 has 3) */

struct tmd_bpe {
    char path[1024], desc[1200];
    /* the pre-tokenizer: splits[0..nsplit) in order, then ByteLevel: its space, then its own
     * GPT-2 split when use_regex (bl_split) */
    tmd_split *splits[MAX_SPLITS], *bl_split;
    int nsplit;
    int prefix_space;  /* ByteLevel add_prefix_space */
    unsigned char *pbuf; /* a piece with add_prefix_space's space */
    size_t pbuf_cap;
    char msg[512]; /* a matcher error while encoding */
    int ignore_merges; /* a piece that is a token is that token */
    int nfc;           /* the normalizer is NFC (bpe_norm.h) */
    unsigned char *nbuf; /* the NFC of a segment */
    size_t nbuf_cap;
    int vocab_size, eot;
    /* per id: what it decodes to (dec_len -1: no token); mappable ids are also in tab */
    uint32_t *dec_off;
    int32_t *dec_len;
    unsigned char *pool;
    size_t pool_n, pool_cap;
    int32_t *tab; /* bytes -> id, open addressing, -1 empty */
    size_t tab_mask;
    int32_t byte_id[256];
    uint64_t *mkey; /* (left id << 32 | right id) -> rank, new id; UINT64_MAX empty */
    int32_t *mrank, *mnew;
    size_t m_mask;
    added_set special, normal; /* normalized: false (matched first) and true */
    /* scratch of one piece */
    int32_t *sym, *prev, *next;
    struct heap_ent {
        int32_t rank, pos, new_id;
    } *heap;
    size_t scratch_cap, heap_cap;
    /* the piece cache */
    cache_slot *cache;
    size_t cache_used;
    unsigned char *ckeys;
    uint32_t *cids;
    size_t ckeys_n, ckeys_cap, cids_n, cids_cap;
};

/* ---- errors ------------------------------------------------------------------------------ */

#if defined(__GNUC__)
__attribute__((format(printf, 5, 6)))
#endif
static int jfail(char *err, size_t errlen, const char *path, const char *field, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "tokenizer '%s': field '%s': %s", path, field, msg);
}

static int nomem(char *err, size_t errlen, const char *path) {
    return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "tokenizer '%s': out of memory", path);
}

/* A JSON value shown in a message. */
static const char *show(const cJSON *v, char *b, size_t len) {
    if (!v) snprintf(b, len, "missing");
    else if (cJSON_IsString(v)) snprintf(b, len, "\"%.60s\"", v->valuestring);
    else if (cJSON_IsNumber(v)) snprintf(b, len, "%.17g", v->valuedouble);
    else if (cJSON_IsBool(v)) snprintf(b, len, "%s", cJSON_IsTrue(v) ? "true" : "false");
    else if (cJSON_IsNull(v)) snprintf(b, len, "null");
    else snprintf(b, len, "%s", cJSON_IsArray(v) ? "an array" : "an object");
    return b;
}

static const cJSON *get(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }
static int is_true(const cJSON *o, const char *k) { return cJSON_IsTrue(get(o, k)); }
static const char *type_of(const cJSON *o) {
    const cJSON *t = get(o, "type");
    return cJSON_IsString(t) ? t->valuestring : NULL;
}

/* ---- the byte-to-unicode map (GPT-2's bytes_to_unicode) ----------------------------------- */

/* Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') are their own character; the other 68
 * take U+0100 upwards in byte order, so that no token string holds a space or a control. */
static void byte_map(uint32_t b2u[256], int16_t u2b[324]) {
    uint32_t next = 256;
    for (int i = 0; i < 324; i++) u2b[i] = -1;
    for (int b = 0; b < 256; b++) {
        int self = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        b2u[b] = self ? (uint32_t)b : next++;
        u2b[b2u[b]] = (int16_t)b;
    }
}

/* One UTF-8 character at s (n >= 1 bytes): its code point and byte length; a byte that does not
 * start a valid character gives 0xFFFFFFFF and length 1. */
static uint32_t utf8_next(const unsigned char *s, size_t n, size_t *len) {
    unsigned c = s[0];
    *len = 1;
    if (c < 0x80) return c;
    int k;
    uint32_t cp, min;
    if (c >= 0xC2 && c <= 0xDF) k = 1, cp = c & 0x1F, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) k = 2, cp = c & 0x0F, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) k = 3, cp = c & 0x07, min = 0x10000;
    else return 0xFFFFFFFFu;
    if ((size_t)k >= n) return 0xFFFFFFFFu;
    for (int i = 1; i <= k; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0xFFFFFFFFu;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0xFFFFFFFFu;
    *len = (size_t)k + 1;
    return cp;
}

/* A token string's bytes through the reverse map, into dst (room for strlen(s) bytes): the
 * count, or -1 if a character is not a byte character (or the string is not UTF-8). */
static int string_bytes(const char *s, const int16_t u2b[324], unsigned char *dst) {
    size_t n = strlen(s), i = 0;
    int k = 0;
    while (i < n) {
        size_t len;
        uint32_t cp = utf8_next((const unsigned char *)s + i, n - i, &len);
        if (cp >= 324 || u2b[cp] < 0) return -1;
        dst[k++] = (unsigned char)u2b[cp];
        i += len;
    }
    return k;
}

/* ---- hashing ------------------------------------------------------------------------------ */

static uint64_t hash_bytes(const unsigned char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}
static uint64_t hash_pair(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    return k ^ (k >> 33);
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

static int pool_add(tmd_bpe *t, const unsigned char *s, size_t n, uint32_t *off) {
    if (t->pool_n + n > t->pool_cap) {
        size_t cap = t->pool_cap ? t->pool_cap : 1 << 16;
        while (cap < t->pool_n + n) cap *= 2;
        unsigned char *p = realloc(t->pool, cap);
        if (!p) return -1;
        t->pool = p;
        t->pool_cap = cap;
    }
    if (n) memcpy(t->pool + t->pool_n, s, n);
    *off = (uint32_t)t->pool_n;
    t->pool_n += n;
    return 0;
}

/* The vocabulary id whose bytes are s[0, n), or -1. */
static int32_t lookup(const tmd_bpe *t, const unsigned char *s, size_t n) {
    for (size_t i = hash_bytes(s, n) & t->tab_mask;; i = (i + 1) & t->tab_mask) {
        int32_t id = t->tab[i];
        if (id < 0) return -1;
        if ((size_t)t->dec_len[id] == n && !memcmp(t->pool + t->dec_off[id], s, n)) return id;
    }
}

/* Returns the id already holding these bytes, or -1 once inserted. */
static int32_t tab_insert(tmd_bpe *t, int32_t id) {
    const unsigned char *s = t->pool + t->dec_off[id];
    size_t n = (size_t)t->dec_len[id];
    for (size_t i = hash_bytes(s, n) & t->tab_mask;; i = (i + 1) & t->tab_mask) {
        int32_t o = t->tab[i];
        if (o < 0) {
            t->tab[i] = id;
            return -1;
        }
        if ((size_t)t->dec_len[o] == n && !memcmp(t->pool + t->dec_off[o], s, n)) return o;
    }
}

static size_t merge_slot(const tmd_bpe *t, uint64_t key) {
    size_t i = hash_pair(key) & t->m_mask;
    while (t->mkey[i] != UINT64_MAX && t->mkey[i] != key) i = (i + 1) & t->m_mask;
    return i;
}

/* ---- loading ------------------------------------------------------------------------------ */

/* A split for field `f`: 0, or the message with the file and field. */
static int new_split(tmd_bpe *t, const char *pattern, int literal, tmd_split_behavior beh, int invert, const char *f,
                     tmd_split **out, char *err, size_t errlen) {
    char msg[512];
    int rc = tmd_split_new(pattern, literal, beh, invert, out, msg, sizeof msg);
    if (rc == -2) return nomem(err, errlen, t->path);
    if (rc) return jfail(err, errlen, t->path, f, "\"%.200s\": %s", pattern, msg);
    return 0;
}

/* ByteLevel (tokenizers' pre_tokenizers/byte_level.rs): add_prefix_space, then GPT-2's split
 * unless use_regex is false (its default is true). */
static int read_byte_level(tmd_bpe *t, const cJSON *bl, const char *field, char *err, size_t errlen) {
    char f[96], b[96];
    const cJSON *ur = get(bl, "use_regex"), *aps = get(bl, "add_prefix_space");
    if (ur && !cJSON_IsBool(ur)) {
        snprintf(f, sizeof f, "%s.use_regex", field);
        return jfail(err, errlen, t->path, f, "%s, expected true or false", show(ur, b, sizeof b));
    }
    if (aps && !cJSON_IsBool(aps)) {
        snprintf(f, sizeof f, "%s.add_prefix_space", field);
        return jfail(err, errlen, t->path, f, "%s, expected true or false", show(aps, b, sizeof b));
    }
    t->prefix_space = cJSON_IsTrue(aps);
    if (ur && !cJSON_IsTrue(ur)) return 0;
    return new_split(t, tmd_gpt2_pattern, 0, TMD_SPLIT_ISOLATED, 0, field, &t->bl_split, err, errlen);
}

/* Split (tokenizers' pre_tokenizers/split.rs): pattern {"Regex": ...} or {"String": ...},
 * behavior, invert. */
static int read_split(tmd_bpe *t, const cJSON *sp, const char *field, tmd_split **out, char *err, size_t errlen) {
    static const char *const behaviors[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
    char f[128], b[96];
    const cJSON *pat = get(sp, "pattern"), *re = get(pat, "Regex"), *str = get(pat, "String");
    const cJSON *p = re ? re : str;
    snprintf(f, sizeof f, "%s.pattern.%s", field, re ? "Regex" : str ? "String" : "Regex");
    if (!cJSON_IsString(p))
        return jfail(err, errlen, t->path, f, "%s, expected a string", show(p, b, sizeof b));
    const cJSON *beh = get(sp, "behavior"), *inv = get(sp, "invert");
    int k = -1;
    for (int i = 0; i < 5 && cJSON_IsString(beh); i++)
        if (!strcmp(beh->valuestring, behaviors[i])) k = i;
    if (k < 0) {
        snprintf(f, sizeof f, "%s.behavior", field);
        return jfail(err, errlen, t->path, f, "%s, expected Removed, Isolated, MergedWithPrevious, MergedWithNext or "
                     "Contiguous", show(beh, b, sizeof b));
    }
    if (inv && !cJSON_IsBool(inv)) {
        snprintf(f, sizeof f, "%s.invert", field);
        return jfail(err, errlen, t->path, f, "%s, expected true or false", show(inv, b, sizeof b));
    }
    static const tmd_split_behavior map[] = {TMD_SPLIT_REMOVED, TMD_SPLIT_ISOLATED, TMD_SPLIT_MERGED_WITH_PREVIOUS,
                                             TMD_SPLIT_MERGED_WITH_NEXT, TMD_SPLIT_CONTIGUOUS};
    snprintf(f, sizeof f, "%s.pattern.%s", field, re ? "Regex" : "String");
    return new_split(t, p->valuestring, !re, map[k], cJSON_IsTrue(inv), f, out, err, errlen);
}

/* ByteLevel alone, or a Sequence of Splits ending with ByteLevel. */
static int read_pre_tokenizer(tmd_bpe *t, const cJSON *root, char *err, size_t errlen) {
    const cJSON *pt = get(root, "pre_tokenizer");
    char b[96], f[96];
    const char *ty = type_of(pt);
    if (ty && !strcmp(ty, "ByteLevel")) return read_byte_level(t, pt, "pre_tokenizer", err, errlen);
    if (!ty || strcmp(ty, "Sequence"))
        return jfail(err, errlen, t->path, "pre_tokenizer.type", "%s: byte-level BPE needs ByteLevel, or a Sequence of "
                     "Splits and ByteLevel", ty ? ty : show(pt, b, sizeof b));
    const cJSON *seq = get(pt, "pretokenizers");
    int n = cJSON_IsArray(seq) ? cJSON_GetArraySize(seq) : 0;
    const char *last = n ? type_of(cJSON_GetArrayItem(seq, n - 1)) : NULL;
    if (n < 1 || n > MAX_SPLITS + 1 || !last || strcmp(last, "ByteLevel"))
        return jfail(err, errlen, t->path, "pre_tokenizer.pretokenizers",
                     "supported: up to %d Splits, then ByteLevel (the byte-to-unicode map ends the sequence)", MAX_SPLITS);
    for (int i = 0; i < n - 1; i++) {
        const cJSON *sp = cJSON_GetArrayItem(seq, i);
        snprintf(f, sizeof f, "pre_tokenizer.pretokenizers[%d]", i);
        if (!type_of(sp) || strcmp(type_of(sp), "Split")) {
            snprintf(f + strlen(f), sizeof f - strlen(f), ".type");
            return jfail(err, errlen, t->path, f, "%s: only Split can come before ByteLevel",
                         type_of(sp) ? type_of(sp) : show(sp, b, sizeof b));
        }
        int rc = read_split(t, sp, f, &t->splits[i], err, errlen);
        if (rc) return rc;
        t->nsplit = i + 1;
    }
    snprintf(f, sizeof f, "pre_tokenizer.pretokenizers[%d]", n - 1);
    return read_byte_level(t, cJSON_GetArrayItem(seq, n - 1), f, err, errlen);
}

/* One normalizer: NFC sets t->nfc; a Sequence (tokenizers' normalizers.Sequence: each member in
 * order) is taken when all its members are. NFC twice is NFC once. */
static int read_normalizer(tmd_bpe *t, const cJSON *nz, const char *field, int depth, char *err, size_t errlen) {
    char b[96], f[160];
    const char *ty = type_of(nz);
    if (ty && !strcmp(ty, "NFC")) {
        t->nfc = 1;
        return 0;
    }
    if (ty && !strcmp(ty, "Sequence") && depth < 4) {
        const cJSON *seq = get(nz, "normalizers");
        snprintf(f, sizeof f, "%s.normalizers", field);
        if (!cJSON_IsArray(seq)) return jfail(err, errlen, t->path, f, "%s, expected an array", show(seq, b, sizeof b));
        int i = 0;
        for (const cJSON *e = seq->child; e; e = e->next, i++) {
            snprintf(f, sizeof f, "%s.normalizers[%d]", field, i);
            int rc = read_normalizer(t, e, f, depth + 1, err, errlen);
            if (rc) return rc;
        }
        return 0;
    }
    snprintf(f, sizeof f, "%s.type", field);
    return jfail(err, errlen, t->path, f,
                 "%s: only NFC (Qwen2's), or a Sequence of NFC, is supported; other normalizers (NFKC, NFD, "
                 "Lowercase, Replace, Prepend, ...) are not",
                 ty ? ty : show(nz, b, sizeof b));
}

/* The fields around the model: normalizer, decoder; the post-processor is not applied. */
static int read_pipeline(tmd_bpe *t, const cJSON *root, char *err, size_t errlen) {
    char b[96];
    const cJSON *nz = get(root, "normalizer");
    if (nz && !cJSON_IsNull(nz)) {
        int rc = read_normalizer(t, nz, "normalizer", 0, err, errlen);
        if (rc) return rc;
    }
    const cJSON *dec = get(root, "decoder");
    if (!type_of(dec) || strcmp(type_of(dec), "ByteLevel"))
        return jfail(err, errlen, t->path, "decoder.type", "%s, expected ByteLevel",
                     type_of(dec) ? type_of(dec) : show(dec, b, sizeof b));
    return read_pre_tokenizer(t, root, err, errlen);
}

static int check_model(tmd_bpe *t, const cJSON *m, char *err, size_t errlen) {
    char b[96];
    if (!cJSON_IsObject(m)) return jfail(err, errlen, t->path, "model", "%s, expected an object", show(m, b, sizeof b));
    const char *ty = type_of(m);
    if (ty && strcmp(ty, "BPE"))
        return jfail(err, errlen, t->path, "model.type", "\"%s\": only BPE is supported", ty);
    if (is_true(m, "byte_fallback"))
        return jfail(err, errlen, t->path, "model.byte_fallback",
                     "true: a SentencePiece-style BPE (Mistral, Mixtral, Llama 1-2) is not supported, only byte-level BPE");
    const cJSON *d = get(m, "dropout");
    if (d && !cJSON_IsNull(d) && !(cJSON_IsNumber(d) && d->valuedouble == 0))
        return jfail(err, errlen, t->path, "model.dropout", "%s: BPE dropout is not supported", show(d, b, sizeof b));
    static const char *const affix[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const cJSON *v = get(m, affix[i]);
        if (v && !cJSON_IsNull(v) && !(cJSON_IsString(v) && !v->valuestring[0])) {
            char f[64];
            snprintf(f, sizeof f, "model.%s", affix[i]);
            return jfail(err, errlen, t->path, f, "%s is not supported", show(v, b, sizeof b));
        }
    }
    const cJSON *im = get(m, "ignore_merges");
    if (im && !cJSON_IsBool(im))
        return jfail(err, errlen, t->path, "model.ignore_merges", "%s, expected true or false", show(im, b, sizeof b));
    t->ignore_merges = cJSON_IsTrue(im);
    return 0;
}

static int grow_ids(tmd_bpe *t, int n) {
    int32_t *dl = realloc(t->dec_len, sizeof *dl * (size_t)n);
    if (dl) t->dec_len = dl;
    uint32_t *dof = realloc(t->dec_off, sizeof *dof * (size_t)n);
    if (dof) t->dec_off = dof;
    if (!dl || !dof) return -1;
    for (int i = t->vocab_size; i < n; i++) t->dec_len[i] = -1, t->dec_off[i] = 0;
    t->vocab_size = n;
    return 0;
}

static int id_of(const cJSON *v) {
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble >= MAX_ID || v->valuedouble != (int)v->valuedouble)
        return -1;
    return (int)v->valuedouble;
}

static int read_vocab(tmd_bpe *t, const cJSON *m, const uint32_t b2u[256], const int16_t u2b[324], char *err,
                      size_t errlen) {
    char b[96], f[160];
    const cJSON *voc = get(m, "vocab");
    if (!cJSON_IsObject(voc))
        return jfail(err, errlen, t->path, "model.vocab", "%s, expected an object of token: id", show(voc, b, sizeof b));
    int maxid = -1, count = 0;
    for (const cJSON *e = voc->child; e; e = e->next, count++) {
        int id = id_of(e);
        if (id < 0) {
            snprintf(f, sizeof f, "model.vocab[\"%.60s\"]", e->string);
            return jfail(err, errlen, t->path, f, "%s, expected an integer id in [0, %d)", show(e, b, sizeof b), MAX_ID);
        }
        maxid = id > maxid ? id : maxid;
    }
    if (grow_ids(t, maxid + 1)) return nomem(err, errlen, t->path);
    t->tab_mask = pow2_at_least((size_t)count * 2 + 2) - 1;
    if (!(t->tab = malloc(sizeof *t->tab * (t->tab_mask + 1)))) return nomem(err, errlen, t->path);
    memset(t->tab, 0xFF, sizeof *t->tab * (t->tab_mask + 1));
    unsigned char *buf = NULL;
    size_t bufcap = 0;
    int rc = 0;
    for (const cJSON *e = voc->child; e && !rc; e = e->next) {
        int id = id_of(e);
        snprintf(f, sizeof f, "model.vocab[\"%.60s\"]", e->string);
        if (t->dec_len[id] >= 0) {
            rc = jfail(err, errlen, t->path, f, "id %d is also another token's", id);
            break;
        }
        size_t sl = strlen(e->string);
        if (sl + 1 > bufcap) {
            unsigned char *nb = realloc(buf, (bufcap = sl + 64));
            if (!nb) {
                rc = nomem(err, errlen, t->path);
                break;
            }
            buf = nb;
        }
        /* A string of byte characters decodes to its bytes and can come out of merges; any
         * other (none in GPT-2's or Llama-3's vocabularies) decodes to its UTF-8 text. */
        int k = string_bytes(e->string, u2b, buf);
        int mappable = k >= 0 && sl > 0;
        if (!mappable) memcpy(buf, e->string, (size_t)(k = (int)sl));
        if (pool_add(t, buf, (size_t)k, &t->dec_off[id])) {
            rc = nomem(err, errlen, t->path);
            break;
        }
        t->dec_len[id] = k;
        if (mappable && tab_insert(t, id) >= 0)
            rc = jfail(err, errlen, t->path, f, "the same bytes as another token");
    }
    free(buf);
    if (rc) return rc;
    for (int by = 0; by < 256; by++) {
        unsigned char c = (unsigned char)by;
        if ((t->byte_id[by] = lookup(t, &c, 1)) < 0)
            return jfail(err, errlen, t->path, "model.vocab",
                         "no token for byte 0x%02x (character U+%04X): a byte-level vocabulary holds all 256 bytes", by,
                         (unsigned)b2u[by]);
    }
    return 0;
}

/* One side of a merge: its id, or a message. */
static int side_id(tmd_bpe *t, const char *s, const int16_t u2b[324], unsigned char *buf, int *len) {
    int k = string_bytes(s, u2b, buf);
    *len = k;
    return k > 0 ? lookup(t, buf, (size_t)k) : -1;
}

static int read_merges(tmd_bpe *t, const cJSON *m, const int16_t u2b[324], char *err, size_t errlen) {
    char b[96], f[64];
    const cJSON *mg = get(m, "merges");
    if (!cJSON_IsArray(mg))
        return jfail(err, errlen, t->path, "model.merges", "%s, expected an array", show(mg, b, sizeof b));
    int n = cJSON_GetArraySize(mg);
    t->m_mask = pow2_at_least((size_t)n * 2 + 2) - 1;
    t->mkey = malloc(sizeof *t->mkey * (t->m_mask + 1));
    t->mrank = malloc(sizeof *t->mrank * (t->m_mask + 1));
    t->mnew = malloc(sizeof *t->mnew * (t->m_mask + 1));
    if (!t->mkey || !t->mrank || !t->mnew) return nomem(err, errlen, t->path);
    memset(t->mkey, 0xFF, sizeof *t->mkey * (t->m_mask + 1));
    int rank = 0, rc = 0;
    unsigned char *buf = NULL;
    size_t bufcap = 0;
    for (const cJSON *e = mg->child; e && !rc; e = e->next, rank++) {
        snprintf(f, sizeof f, "model.merges[%d]", rank);
        /* "a b" (tokenizers before 0.20) or ["a", "b"] */
        char *l = NULL, *r = NULL, *dup = NULL;
        if (cJSON_IsString(e)) {
            dup = strdup(e->valuestring);
            char *sp = dup ? strchr(dup, ' ') : NULL;
            if (sp && !strchr(sp + 1, ' ')) *sp = 0, l = dup, r = sp + 1;
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) &&
                   cJSON_IsString(e->child->next)) {
            l = e->child->valuestring;
            r = e->child->next->valuestring;
        }
        if (!l) {
            free(dup);
            rc = jfail(err, errlen, t->path, f, "%s, expected \"left right\" or [\"left\", \"right\"]", show(e, b, sizeof b));
            break;
        }
        size_t need = strlen(l) + strlen(r) + 1;
        if (need > bufcap) {
            unsigned char *nb = realloc(buf, (bufcap = need + 64));
            if (!nb) {
                free(dup);
                rc = nomem(err, errlen, t->path);
                break;
            }
            buf = nb;
        }
        int ll, rl, a = side_id(t, l, u2b, buf, &ll), c = side_id(t, r, u2b, buf + (ll > 0 ? ll : 0), &rl);
        int nw = a >= 0 && c >= 0 ? lookup(t, buf, (size_t)(ll + rl)) : -1;
        if (a < 0 || c < 0 || nw < 0)
            rc = jfail(err, errlen, t->path, f, "\"%.40s\" + \"%.40s\": %s\"%.80s%s\" is not a byte-level token of model.vocab",
                       l, r, a < 0 ? "" : c < 0 ? "" : "the merged ", a < 0 ? l : c < 0 ? r : l, a < 0 || c < 0 ? "" : r);
        free(dup);
        if (rc) break;
        /* A pair listed twice keeps its last rank: tokenizers collects the list into a map. */
        uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)c;
        size_t s = merge_slot(t, key);
        t->mkey[s] = key;
        t->mrank[s] = rank;
        t->mnew[s] = nw;
    }
    free(buf);
    return rc;
}

static int cmp_added(const void *pa, const void *pb) {
    const added *a = pa, *b = pb;
    if (a->s[0] != b->s[0]) return (int)a->s[0] - (int)b->s[0];
    return b->len - a->len;
}

static int set_finish(added_set *s) {
    if (s->n) qsort(s->tok, (size_t)s->n, sizeof *s->tok, cmp_added);
    for (int b = 0, i = 0; b <= 256; b++) {
        while (i < s->n && s->tok[i].s[0] < b) i++;
        s->start[b] = i;
    }
    return 0;
}

static int read_added(tmd_bpe *t, const cJSON *root, const int16_t u2b[324], char *err, size_t errlen) {
    char b[96], f[96];
    const cJSON *at = get(root, "added_tokens");
    if (at && !cJSON_IsNull(at) && !cJSON_IsArray(at))
        return jfail(err, errlen, t->path, "added_tokens", "%s, expected an array", show(at, b, sizeof b));
    int n = at ? cJSON_GetArraySize(at) : 0;
    t->special.tok = calloc((size_t)n + 1, sizeof(added));
    t->normal.tok = calloc((size_t)n + 1, sizeof(added));
    if (!t->special.tok || !t->normal.tok) return nomem(err, errlen, t->path);
    static const char *const eot_names[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"};
    int eot_rank = 99, i = 0;
    for (const cJSON *e = at ? at->child : NULL; e; e = e->next, i++) {
        const cJSON *content = get(e, "content");
        int id = id_of(get(e, "id"));
        if (id < 0) {
            snprintf(f, sizeof f, "added_tokens[%d].id", i);
            return jfail(err, errlen, t->path, f, "%s, expected an integer in [0, %d)", show(get(e, "id"), b, sizeof b),
                         MAX_ID);
        }
        if (!cJSON_IsString(content) || !content->valuestring[0]) {
            snprintf(f, sizeof f, "added_tokens[%d].content", i);
            return jfail(err, errlen, t->path, f, "%s, expected a non-empty string", show(content, b, sizeof b));
        }
        static const char *const unsupported[] = {"lstrip", "rstrip", "single_word"};
        for (int k = 0; k < 3; k++)
            if (is_true(e, unsupported[k])) {
                snprintf(f, sizeof f, "added_tokens[%d].%s", i, unsupported[k]);
                return jfail(err, errlen, t->path, f, "true (token \"%.40s\") is not supported", content->valuestring);
            }
        if (id >= t->vocab_size && grow_ids(t, id + 1)) return nomem(err, errlen, t->path);
        /* Tokens not normalized are split off first, then the normalized ones in what is left
         * (tokenizers' AddedVocabulary; "special" tokens are not normalized by default). */
        const cJSON *norm = get(e, "normalized");
        added_set *s = cJSON_IsTrue(norm) ? &t->normal : &t->special;
        added *a = &s->tok[s->n++];
        if (!(a->s = (unsigned char *)strdup(content->valuestring))) return nomem(err, errlen, t->path);
        size_t sl = strlen(content->valuestring);
        a->len = (int)sl;
        a->id = id;
        /* A normalized token is looked for in the normalized text, as its normalized content
         * (AddedVocabulary::refresh_added_tokens), and decodes to that content too: tokenizers
         * 0.23.1 (PR #1995, "add_tokens normalizes content at insertion", a breaking change of
         * its release notes) made id_to_token, and so decode, return the normalized form it
         * caches, so that the decoder inverts what the normalizer did (issue #1392: byte-level
         * added tokens decoded wrong). Up to 0.22.x decode gave the content as written:
         * "cafe\u0301" decoded to itself there, to "caf\u00e9" from 0.23.1 on. */
        if (s == &t->normal && t->nfc) {
            const unsigned char *nc;
            size_t nl;
            if (tmd_nfc(a->s, sl, &t->nbuf, &t->nbuf_cap, &nc, &nl)) return nomem(err, errlen, t->path);
            if (nc != a->s) {
                unsigned char *c = malloc(nl + 1);
                if (!c) return nomem(err, errlen, t->path);
                memcpy(c, nc, nl);
                c[nl] = 0;
                free(a->s);
                a->s = c;
                a->len = (int)nl;
            }
        }
        /* What it decodes to is ByteLevel's rule (bpe.h) on that content, whether or not the
         * vocabulary has the token. */
        unsigned char *tmp = malloc((size_t)a->len + 1);
        if (!tmp) return nomem(err, errlen, t->path);
        int k = string_bytes((const char *)a->s, u2b, tmp);
        int rc = k >= 0 ? pool_add(t, tmp, (size_t)k, &t->dec_off[id]) : pool_add(t, a->s, (size_t)a->len, &t->dec_off[id]);
        free(tmp);
        if (rc) return nomem(err, errlen, t->path);
        t->dec_len[id] = k >= 0 ? k : a->len;
        for (int r = 0; r < 4; r++)
            if (r < eot_rank && !strcmp(content->valuestring, eot_names[r])) eot_rank = r, t->eot = id;
    }
    set_finish(&t->special);
    set_finish(&t->normal);
    return 0;
}

int tmd_bpe_load(const char *path, tmd_bpe **out, char *err, size_t errlen) {
    *out = NULL;
    unsigned char *data = NULL;
    size_t len = 0;
    int rc = tmd_read_file(path, MAX_TOKENIZER_BYTES, &data, &len, err, errlen);
    if (rc) return rc;
    tmd_bpe *t = calloc(1, sizeof *t);
    if (!t) {
        free(data);
        return nomem(err, errlen, path);
    }
    snprintf(t->path, sizeof t->path, "%s", path);
    t->eot = -1;
    cJSON *root = cJSON_ParseWithLength((const char *)data, len);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long off = at && at >= (const char *)data && at <= (const char *)data + len ? (long)(at - (const char *)data) : -1;
        rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR, "tokenizer '%s': not valid JSON (error near byte %ld of %zu)", path,
                      off, len);
    }
    free(data);
    if (!root) goto fail;
    uint32_t b2u[256];
    int16_t u2b[324];
    byte_map(b2u, u2b);
    const cJSON *m = get(root, "model");
    if ((rc = check_model(t, m, err, errlen)) || (rc = read_pipeline(t, root, err, errlen)) ||
        (rc = read_vocab(t, m, b2u, u2b, err, errlen)) || (rc = read_merges(t, m, u2b, err, errlen)) ||
        (rc = read_added(t, root, u2b, err, errlen)))
        goto fail;
    cJSON_Delete(root);
    root = NULL;
    snprintf(t->desc, sizeof t->desc, "byte-level BPE%s, %d Split pattern%s%s, %d tokens (%s)",
             t->nfc ? " with NFC" : "", t->nsplit, t->nsplit == 1 ? "" : "s",
             t->bl_split ? " + ByteLevel's GPT-2 split" : "", t->vocab_size, path);
    *out = t;
    return 0;
fail:
    cJSON_Delete(root);
    tmd_bpe_free(t);
    return rc;
}

void tmd_bpe_free(tmd_bpe *t) {
    if (!t) return;
    added_set *sets[2] = {&t->special, &t->normal};
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < sets[k]->n; i++) free(sets[k]->tok[i].s);
        free(sets[k]->tok);
    }
    free(t->dec_off), free(t->dec_len), free(t->pool), free(t->tab);
    free(t->mkey), free(t->mrank), free(t->mnew);
    free(t->sym), free(t->prev), free(t->next), free(t->heap);
    free(t->cache), free(t->ckeys), free(t->cids);
    for (int i = 0; i < t->nsplit; i++) tmd_split_free(t->splits[i]);
    tmd_split_free(t->bl_split);
    free(t->pbuf);
    free(t->nbuf);
    free(t);
}

int tmd_bpe_vocab_size(const tmd_bpe *t) { return t->vocab_size; }
int tmd_bpe_eot(const tmd_bpe *t) { return t->eot; }
const char *tmd_bpe_describe(const tmd_bpe *t) { return t->desc; }

int tmd_bpe_token_bytes(const tmd_bpe *t, int64_t id, const unsigned char **bytes) {
    if (id < 0 || id >= t->vocab_size || t->dec_len[id] < 0) return -1;
    *bytes = t->pool + t->dec_off[id];
    return t->dec_len[id];
}

/* ---- encoding ----------------------------------------------------------------------------- */

typedef struct vec {
    uint32_t **v;
    int64_t *n, *cap;
} vec;

static int push(vec *o, uint32_t id) {
    if (*o->n == *o->cap) {
        int64_t cap = *o->cap ? *o->cap * 2 : 1024;
        uint32_t *p = realloc(*o->v, sizeof *p * (size_t)cap);
        if (!p) return -1;
        *o->v = p;
        *o->cap = cap;
    }
    (*o->v)[(*o->n)++] = id;
    return 0;
}

/* The min-heap of candidate merges: lowest rank, then leftmost (tokenizers' Merge ordering). */
static int heap_less(const struct heap_ent *a, const struct heap_ent *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}
static void heap_push(tmd_bpe *t, size_t *hn, struct heap_ent e) {
    size_t i = (*hn)++;
    while (i > 0 && heap_less(&e, &t->heap[(i - 1) / 2])) {
        t->heap[i] = t->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    t->heap[i] = e;
}
static struct heap_ent heap_pop(tmd_bpe *t, size_t *hn) {
    struct heap_ent top = t->heap[0], last = t->heap[--*hn];
    size_t i = 0, n = *hn;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_less(&t->heap[c + 1], &t->heap[c])) c++;
        if (!heap_less(&t->heap[c], &last)) break;
        t->heap[i] = t->heap[c];
        i = c;
    }
    if (n) t->heap[i] = last;
    return top;
}

/* The pair (sym[i], sym[next[i]]) as a candidate, if it is a merge. */
static void candidate(tmd_bpe *t, size_t *hn, int i) {
    int j = t->next[i];
    if (j < 0) return;
    uint64_t key = (uint64_t)(uint32_t)t->sym[i] << 32 | (uint32_t)t->sym[j];
    size_t s = merge_slot(t, key);
    if (t->mkey[s] == key) heap_push(t, hn, (struct heap_ent){t->mrank[s], i, t->mnew[s]});
}

static int scratch(tmd_bpe *t, size_t m) {
    if (m <= t->scratch_cap) return 0;
    size_t cap = m * 2;
    int32_t *a = realloc(t->sym, sizeof *a * cap), *b = a ? realloc(t->prev, sizeof *b * cap) : NULL;
    if (a) t->sym = a;
    if (b) t->prev = b;
    int32_t *c = b ? realloc(t->next, sizeof *c * cap) : NULL;
    if (c) t->next = c;
    struct heap_ent *h = c ? realloc(t->heap, sizeof *h * cap * 3) : NULL;
    if (h) t->heap = h;
    if (!h) return -1;
    t->scratch_cap = cap;
    return 0;
}

/* The merges of one piece of m >= 2 bytes: the surviving symbols, in order, pushed to o. */
static int merge_piece(tmd_bpe *t, const unsigned char *s, size_t m, vec *o) {
    if (scratch(t, m)) return -1;
    for (size_t i = 0; i < m; i++) {
        t->sym[i] = t->byte_id[s[i]];
        t->prev[i] = (int32_t)i - 1;
        t->next[i] = i + 1 < m ? (int32_t)i + 1 : -1;
    }
    size_t hn = 0;
    for (size_t i = 0; i + 1 < m; i++) candidate(t, &hn, (int)i);
    while (hn) {
        struct heap_ent e = heap_pop(t, &hn);
        int i = e.pos, j = t->next[i];
        /* stale: the left symbol was merged away (sym -1), or the pair is no longer this merge */
        if (t->sym[i] < 0 || j < 0) continue;
        uint64_t key = (uint64_t)(uint32_t)t->sym[i] << 32 | (uint32_t)t->sym[j];
        size_t sl = merge_slot(t, key);
        if (t->mkey[sl] != key || t->mnew[sl] != e.new_id) continue;
        t->sym[i] = e.new_id;
        t->sym[j] = -1;
        t->next[i] = t->next[j];
        if (t->next[j] >= 0) t->prev[t->next[j]] = i;
        if (t->prev[i] >= 0) candidate(t, &hn, t->prev[i]);
        candidate(t, &hn, i);
    }
    for (int i = 0; i >= 0; i = t->next[i])
        if (push(o, (uint32_t)t->sym[i])) return -1;
    return 0;
}

static void cache_clear(tmd_bpe *t) {
    memset(t->cache, 0, sizeof *t->cache * CACHE_SLOTS);
    t->cache_used = t->ckeys_n = t->cids_n = 0;
}

/* Append what the cache holds for this piece: 1, or 0 when it has nothing. */
static int cache_get(tmd_bpe *t, const unsigned char *s, size_t m, uint64_t h, vec *o, int *rc) {
    if (!t->cache) return 0;
    for (size_t i = h & (CACHE_SLOTS - 1);; i = (i + 1) & (CACHE_SLOTS - 1)) {
        cache_slot *c = &t->cache[i];
        if (!c->key_len) return 0;
        if (c->hash == h && c->key_len == m && !memcmp(t->ckeys + c->key_off, s, m)) {
            for (uint32_t k = 0; k < c->ids_n; k++)
                if (push(o, t->cids[c->ids_off + k])) {
                    *rc = -1;
                    break;
                }
            return 1;
        }
    }
}

static void cache_put(tmd_bpe *t, const unsigned char *s, size_t m, uint64_t h, const uint32_t *ids, size_t k) {
    if (!t->cache && !(t->cache = calloc(CACHE_SLOTS, sizeof *t->cache))) return;
    if (t->cache_used >= CACHE_SLOTS / 2 || t->ckeys_n + m > CACHE_POOL_MAX || (t->cids_n + k) * 4 > CACHE_POOL_MAX)
        cache_clear(t);
    if (t->ckeys_n + m > t->ckeys_cap) {
        size_t cap = t->ckeys_cap ? t->ckeys_cap * 2 : 1 << 16;
        while (cap < t->ckeys_n + m) cap *= 2;
        unsigned char *p = realloc(t->ckeys, cap);
        if (!p) return;
        t->ckeys = p, t->ckeys_cap = cap;
    }
    if (t->cids_n + k > t->cids_cap) {
        size_t cap = t->cids_cap ? t->cids_cap * 2 : 1 << 14;
        while (cap < t->cids_n + k) cap *= 2;
        uint32_t *p = realloc(t->cids, cap * sizeof *p);
        if (!p) return;
        t->cids = p, t->cids_cap = cap;
    }
    size_t i = h & (CACHE_SLOTS - 1);
    while (t->cache[i].key_len) i = (i + 1) & (CACHE_SLOTS - 1);
    t->cache[i] = (cache_slot){h, (uint32_t)t->ckeys_n, (uint32_t)m, (uint32_t)t->cids_n, (uint32_t)k};
    memcpy(t->ckeys + t->ckeys_n, s, m);
    memcpy(t->cids + t->cids_n, ids, k * sizeof *ids);
    t->ckeys_n += m;
    t->cids_n += k;
    t->cache_used++;
}

#define CACHE_MAX_PIECE 256 /* longer pieces (runs of spaces, long words) are rarely repeated */

static int encode_piece(tmd_bpe *t, const unsigned char *s, size_t m, vec *o) {
    if (!m) return 0;
    if (m == 1) return push(o, (uint32_t)t->byte_id[s[0]]);
    int32_t whole = t->ignore_merges ? lookup(t, s, m) : -1;
    if (whole >= 0) return push(o, (uint32_t)whole);
    uint64_t h = hash_bytes(s, m);
    int rc = 0;
    if (m <= CACHE_MAX_PIECE && cache_get(t, s, m, h, o, &rc)) return rc;
    int64_t before = *o->n;
    if (merge_piece(t, s, m, o)) return -1;
    if (m <= CACHE_MAX_PIECE) cache_put(t, s, m, h, *o->v + before, (size_t)(*o->n - before));
    return 0;
}

/* The pre-tokenizer's stages: each piece of Split i goes to Split i + 1, the last ones to
 * ByteLevel (tokenizers' Sequence applies each pre-tokenizer to every piece of the one before). */
typedef struct stage_ctx {
    tmd_bpe *t;
    vec *o;
    int i; /* the next Split; nsplit: ByteLevel */
} stage_ctx;

static int stage(void *ctx, const unsigned char *s, size_t n);

static int bpe_piece(void *ctx, const unsigned char *s, size_t n) {
    stage_ctx *c = ctx;
    return encode_piece(c->t, s, n, c->o) ? -2 : 0;
}

/* ByteLevel: add_prefix_space puts a space before a piece that does not start with one, then
 * its GPT-2 split, when it has one, cuts the piece. */
static int byte_level(stage_ctx *c, const unsigned char *s, size_t n) {
    tmd_bpe *t = c->t;
    if (t->prefix_space && s[0] != ' ') {
        if (n + 1 > t->pbuf_cap) {
            size_t cap = (n + 1) * 2;
            unsigned char *p = realloc(t->pbuf, cap);
            if (!p) return -2;
            t->pbuf = p, t->pbuf_cap = cap;
        }
        memcpy(t->pbuf + 1, s, n);
        t->pbuf[0] = ' ';
        s = t->pbuf, n++;
    }
    if (!t->bl_split) return bpe_piece(c, s, n);
    return tmd_split_pieces(t->bl_split, s, n, bpe_piece, c, t->msg, sizeof t->msg);
}

static int stage(void *ctx, const unsigned char *s, size_t n) {
    stage_ctx *c = ctx;
    if (c->i == c->t->nsplit) return byte_level(c, s, n);
    stage_ctx next = {c->t, c->o, c->i + 1};
    return tmd_split_pieces(c->t->splits[c->i], s, n, stage, &next, c->t->msg, sizeof c->t->msg);
}

/* A segment between added tokens: the pre-tokenizer's pieces, each through the merges. Returns
 * 0, -1 (t->msg says why) or -2 (memory). */
static int encode_segment(tmd_bpe *t, const unsigned char *s, size_t n, vec *o) {
    if (!n) return 0;
    stage_ctx c = {t, o, 0};
    return stage(&c, s, n);
}

/* The leftmost, then longest, token of set at or after s[from] within s[0, n): its start, or n. */
static size_t find_added(const added_set *set, const unsigned char *s, size_t n, size_t from, const added **hit) {
    if (!set->n) return n;
    for (size_t p = from; p < n; p++) {
        int b = s[p];
        for (int k = set->start[b]; k < set->start[b + 1]; k++) {
            const added *a = &set->tok[k];
            if ((size_t)a->len <= n - p && !memcmp(s + p, a->s, (size_t)a->len)) {
                *hit = a;
                return p;
            }
        }
    }
    return n;
}

static int encode_added(tmd_bpe *t, const added_set *set, const unsigned char *s, size_t n, vec *o);

/* The text between two tokens that are not normalized: normalized (NFC: each such stretch on its
 * own, as tokenizers does, so "<|endoftext|>" + U+0338 keeps its token instead of composing
 * ">" + U+0338 into U+226F), then split on the normalized added tokens. */
static int encode_between(tmd_bpe *t, const unsigned char *s, size_t n, vec *o) {
    if (t->nfc && n) {
        if (tmd_nfc(s, n, &t->nbuf, &t->nbuf_cap, &s, &n)) return -2;
    }
    return encode_added(t, &t->normal, s, n, o);
}

/* Split s on the tokens of `set`, encoding what lies between with the next set (through the
 * normalizer) or the pre-tokenizer. */
static int encode_added(tmd_bpe *t, const added_set *set, const unsigned char *s, size_t n, vec *o) {
    size_t pos = 0;
    while (pos < n) {
        const added *hit = NULL;
        size_t p = find_added(set, s, n, pos, &hit);
        int rc = set == &t->special ? encode_between(t, s + pos, p - pos, o) : encode_segment(t, s + pos, p - pos, o);
        if (rc) return rc;
        if (p == n) break;
        if (push(o, (uint32_t)hit->id)) return -1;
        pos = p + (size_t)hit->len;
    }
    return 0;
}

int tmd_bpe_encode(tmd_bpe *t, const char *text, size_t len, uint32_t **ids, int64_t *n, int64_t *cap, char *err,
                   size_t errlen) {
    vec o = {ids, n, cap};
    t->msg[0] = 0;
    int rc = encode_added(t, &t->special, (const unsigned char *)text, len, &o);
    if (rc == -1 && t->msg[0])
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "tokenizer '%s': encoding %zu bytes: %s", t->path, len, t->msg);
    if (rc)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "tokenizer '%s': out of memory encoding %zu bytes", t->path, len);
    return 0;
}

int tmd_bpe_encode_append(uint32_t **ids, int64_t *n, int64_t *cap, const uint32_t *add, int64_t k) {
    vec o = {ids, n, cap};
    for (int64_t i = 0; i < k; i++)
        if (push(&o, add[i])) return -1;
    return 0;
}
