/*
 * bpe_train.c — a byte-level BPE trainer; see bpe_train.h.
 *
 * Layout: words (the distinct pre-tokenizer pieces) in a hash table of byte strings -> index;
 * each word's current symbols as an int array; tokens as byte strings. Every merge step counts
 * the adjacent pairs of all words (weighted by the word's count) into a hash table of
 * (left << 32 | right) -> count, takes the largest, and rewrites the words holding it. That is
 * O(merges x symbols of the distinct words): about a second for 1,000 merges on tinyshakespeare;
 * the incremental pair counts of the `tokenizers` trainer (only the words holding the merged
 * pair change) are the next step for large corpora.
 */
#include "bpe_train.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomic.h"
#include "bpe_pretok.h"
#include "hf.h"
#include "status.h"
#include "strbuf.h"
#include "util.h"

typedef struct word {
    unsigned char *bytes;
    size_t len;
    int64_t count;
    int *sym, nsym;
} word;

typedef struct trainer {
    word *w;
    size_t nw, capw;
    size_t *slot; /* open addressing: index + 1 into w, 0 empty */
    size_t nslot;
    int oom;
} trainer;

static uint64_t fnv(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static int grow_words(trainer *t) {
    size_t ns = t->nslot ? 2 * t->nslot : 1 << 16;
    size_t *s = calloc(ns, sizeof *s);
    if (!s) return -1;
    for (size_t i = 0; i < t->nw; i++) {
        size_t h = fnv(t->w[i].bytes, t->w[i].len) & (ns - 1);
        while (s[h]) h = (h + 1) & (ns - 1);
        s[h] = i + 1;
    }
    free(t->slot);
    t->slot = s, t->nslot = ns;
    return 0;
}

static int add_piece(void *ctx, const unsigned char *p, size_t n) {
    trainer *t = ctx;
    if (n == 0) return 0;
    if (2 * (t->nw + 1) > t->nslot && grow_words(t)) return t->oom = 1, -1;
    size_t h = fnv(p, n) & (t->nslot - 1);
    for (; t->slot[h]; h = (h + 1) & (t->nslot - 1)) {
        word *w = &t->w[t->slot[h] - 1];
        if (w->len == n && !memcmp(w->bytes, p, n)) return w->count++, 0;
    }
    if (t->nw == t->capw) {
        size_t c = t->capw ? 2 * t->capw : 4096;
        word *nw = realloc(t->w, c * sizeof *nw);
        if (!nw) return t->oom = 1, -1;
        t->w = nw, t->capw = c;
    }
    word *w = &t->w[t->nw];
    memset(w, 0, sizeof *w);
    w->bytes = malloc(n);
    w->sym = malloc(n * sizeof *w->sym);
    if (!w->bytes || !w->sym) return free(w->bytes), free(w->sym), t->oom = 1, -1;
    memcpy(w->bytes, p, n);
    w->len = n, w->count = 1, w->nsym = (int)n;
    for (size_t i = 0; i < n; i++) w->sym[i] = p[i];
    t->slot[h] = ++t->nw;
    return 0;
}

/* pair counts: open addressing on (left << 32 | right) + 1 */
typedef struct pairs {
    uint64_t *key;
    int64_t *count;
    size_t n, cap;
} pairs;

static int pairs_add(pairs *p, uint64_t k, int64_t c) {
    if (2 * (p->n + 1) > p->cap) {
        size_t nc = p->cap ? 2 * p->cap : 1 << 16;
        uint64_t *nk = calloc(nc, sizeof *nk);
        int64_t *ncnt = calloc(nc, sizeof *ncnt);
        if (!nk || !ncnt) return free(nk), free(ncnt), -1;
        for (size_t i = 0; i < p->cap; i++)
            if (p->key[i]) {
                size_t h = (size_t)((p->key[i] * 0x9E3779B97F4A7C15ull) >> 20) & (nc - 1);
                while (nk[h]) h = (h + 1) & (nc - 1);
                nk[h] = p->key[i], ncnt[h] = p->count[i];
            }
        free(p->key), free(p->count);
        p->key = nk, p->count = ncnt, p->cap = nc;
    }
    uint64_t key = k + 1;
    size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & (p->cap - 1);
    while (p->key[h] && p->key[h] != key) h = (h + 1) & (p->cap - 1);
    if (!p->key[h]) p->key[h] = key, p->n++;
    p->count[h] += c;
    return 0;
}

int tmd_bpe_train_file(const char *in_path, int n_tokens, const char *out_json, int *merges_out, char *err,
                       size_t errlen) {
    if (n_tokens < 258 || n_tokens > 1 << 20)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "--bpe %d: the vocabulary must hold the 256 bytes and <|endoftext|> (>= 258) and at most %d",
                        n_tokens, 1 << 20);
    FILE *f = fopen(in_path, "rb");
    if (!f) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "cannot read '%s': %s", in_path, strerror(errno));
    struct { char *p; size_t n, cap; } text = {0};
    for (;;) { /* the whole file, NUL bytes included */
        if (text.n == text.cap) {
            size_t c = text.cap ? 2 * text.cap : 1 << 20;
            char *np = realloc(text.p, c);
            if (!np) {
                fclose(f);
                free(text.p);
                return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory reading '%s'", in_path);
            }
            text.p = np, text.cap = c;
        }
        size_t k = fread(text.p + text.n, 1, text.cap - text.n, f);
        text.n += k;
        if (k == 0) break;
    }
    int rd_err = ferror(f);
    fclose(f);
    if (rd_err) return free(text.p), tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "reading '%s' failed", in_path);

    int rc = 0, n_merges = 0;
    trainer t = {0};
    pairs pc = {0};
    tmd_split *sp = NULL;
    unsigned char **tok = NULL; /* token id -> bytes */
    size_t *toklen = NULL;
    int (*merge)[2] = NULL;
    int ntok = 256, max_merges = n_tokens - 257;
    char m[512];
    if (tmd_split_new(tmd_gpt2_pattern, 0, TMD_SPLIT_ISOLATED, 0, &sp, m, sizeof m)) {
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "GPT-2's pattern: %s", m);
        goto out;
    }
    if (text.n && tmd_split_pieces(sp, (const unsigned char *)text.p, text.n, add_piece, &t, m, sizeof m)) {
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, t.oom ? "out of memory counting the words of '%s'" : "'%s': %s",
                      in_path, m);
        goto out;
    }
    tok = calloc((size_t)n_tokens, sizeof *tok);
    toklen = calloc((size_t)n_tokens, sizeof *toklen);
    merge = calloc((size_t)max_merges + 1, sizeof *merge);
    if (!tok || !toklen || !merge) {
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
        goto out;
    }
    for (int b = 0; b < 256; b++) {
        tok[b] = malloc(1);
        if (!tok[b]) {
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
            goto out;
        }
        tok[b][0] = (unsigned char)b, toklen[b] = 1;
    }
    while (n_merges < max_merges && ntok < n_tokens - 1) {
        if (pc.cap) { /* the table is made by the first pairs_add */
            memset(pc.key, 0, pc.cap * sizeof *pc.key);
            memset(pc.count, 0, pc.cap * sizeof *pc.count);
        }
        pc.n = 0;
        for (size_t i = 0; i < t.nw; i++)
            for (int j = 0; j + 1 < t.w[i].nsym; j++)
                if (pairs_add(&pc, (uint64_t)t.w[i].sym[j] << 32 | (uint32_t)t.w[i].sym[j + 1], t.w[i].count)) {
                    rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory counting pairs");
                    goto out;
                }
        uint64_t best = 0;
        int64_t bc = 0;
        for (size_t i = 0; i < pc.cap; i++)
            if (pc.key[i] && (pc.count[i] > bc || (pc.count[i] == bc && pc.key[i] - 1 < best)))
                best = pc.key[i] - 1, bc = pc.count[i];
        if (bc == 0) break; /* every word is one token */
        int a = (int)(best >> 32), c = (int)(uint32_t)best;
        size_t nl = toklen[a] + toklen[c];
        unsigned char *s = malloc(nl);
        if (!s) {
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
            goto out;
        }
        memcpy(s, tok[a], toklen[a]), memcpy(s + toklen[a], tok[c], toklen[c]);
        int id = -1; /* a string made before by other merges keeps its id */
        for (int q = 256; q < ntok && id < 0; q++)
            if (toklen[q] == nl && !memcmp(tok[q], s, nl)) id = q;
        if (id < 0) tok[ntok] = s, toklen[ntok] = nl, id = ntok++;
        else free(s);
        merge[n_merges][0] = a, merge[n_merges][1] = c, n_merges++;
        for (size_t i = 0; i < t.nw; i++) {
            word *w = &t.w[i];
            int o = 0;
            for (int j = 0; j < w->nsym; j++) {
                if (j + 1 < w->nsym && w->sym[j] == a && w->sym[j + 1] == c) w->sym[o++] = id, j++;
                else w->sym[o++] = w->sym[j];
            }
            w->nsym = o;
        }
    }
    {
        tmd_sbuf b = {0};
        tmd_sb_printf(&b,
                      "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n"
                      "  \"added_tokens\": [{\"id\": %d, \"content\": \"<|endoftext|>\", \"single_word\": false, "
                      "\"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}],\n"
                      "  \"normalizer\": null,\n"
                      "  \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
                      "\"use_regex\": true},\n  \"post_processor\": null,\n"
                      "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, "
                      "\"use_regex\": true},\n"
                      "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
                      "\"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \"fuse_unk\": false, "
                      "\"byte_fallback\": false, \"ignore_merges\": false,\n    \"vocab\": {",
                      ntok);
        for (int q = 0; q < ntok; q++) {
            tmd_sb_printf(&b, q ? ", " : "");
            tmd_json_byte_token(&b, tok[q], toklen[q]);
            tmd_sb_printf(&b, ": %d", q);
        }
        tmd_sb_printf(&b, "},\n    \"merges\": [");
        for (int q = 0; q < n_merges; q++) {
            tmd_sb_printf(&b, q ? ", [" : "[");
            tmd_json_byte_token(&b, tok[merge[q][0]], toklen[merge[q][0]]);
            tmd_sb_printf(&b, ", ");
            tmd_json_byte_token(&b, tok[merge[q][1]], toklen[merge[q][1]]);
            tmd_sb_printf(&b, "]");
        }
        tmd_sb_printf(&b, "]\n  }\n}\n");
        if (b.oom) {
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory writing '%s'", out_json);
        } else {
            tmd_atomic at;
            rc = tmd_atomic_open(&at, out_json, err, errlen);
            if (!rc) {
                tmd_atomic_write(&at, b.p, b.n);
                rc = tmd_atomic_commit(&at, err, errlen);
            }
        }
        free(b.p);
    }
    if (merges_out) *merges_out = n_merges;
out:
    for (int q = 0; tok && q < ntok; q++) free(tok[q]);
    free(tok), free(toklen), free(merge);
    for (size_t i = 0; i < t.nw; i++) free(t.w[i].bytes), free(t.w[i].sym);
    free(t.w), free(t.slot), free(pc.key), free(pc.count);
    tmd_split_free(sp);
    free(text.p);
    return rc;
}
