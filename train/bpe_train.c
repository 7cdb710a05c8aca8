/*
 * bpe_train.c — a byte-level BPE trainer; see bpe_train.h.
 *
 * Words: the distinct pieces of GPT-2's split, each with its count, in a hash table of byte
 * strings (a corpus of millions of pieces has some tens of thousands of distinct ones).
 *
 * Merges: the incremental algorithm of the `tokenizers` BpeTrainer
 * (tokenizers/src/models/bpe/trainer.rs `do_train`, word.rs `Word::merge`; sentencepiece's
 * bpe_model_trainer.cc is the same idea), which gives exactly the merges of recounting every
 * pair at every step (tests/bpe_train_naive.c is that reference, held against this file by
 * tests/test_bpe_train.c):
 *   - a pair index: (left << 32 | right) -> its count over all words (each occurrence weighted by
 *     its word's count) and the list of words where it has occurred (pair_ent; a word may stay
 *     listed after it lost the pair, or be listed twice: the words are rescanned, so such
 *     entries only cost a scan);
 *   - a max-heap of (count, pair), ordered by count, ties to the smaller pair (the smaller left
 *     id, then right id), with lazy updates: a count that rises gets a new entry pushed, a count
 *     that falls leaves its old entries, which are repushed with the true count or dropped
 *     when they come to the top. Invariant: every pair of count c > 0 has an entry >= c; so
 *     the first popped entry that equals its pair's count is the pair the full recount picks;
 *   - merging (a, b) -> id rewrites, left to right, only the words listed for (a, b); each
 *     occurrence changes the counts of its neighbours' pairs: (x, a) -> (x, id) and
 *     (b, y) -> (id, y), taken against the word as already rewritten on the left, which keeps
 *     the counts exact through overlaps such as (a, a) in "aaaa".
 * One step costs the occurrences of the merged pair plus the heap's log, instead of a pass over
 * every symbol of every word: a 1,000-token vocabulary on tinyshakespeare took 1.5 s with the
 * recount and takes 0.1 s now, most of it GPT-2's split (bench/tokenizer.sh times it against
 * tokenizers' BpeTrainer: docs/PERFORMANCE.md).
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

static uint64_t fnv(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static uint64_t mix(uint64_t x) { /* splitmix64's finalizer */
    x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27, x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* ---- counting the words -------------------------------------------------------------------- */

typedef struct counter {
    tmd_bpe_word *w;
    size_t nw, capw;
    size_t *slot; /* open addressing: index + 1 into w, 0 empty */
    size_t nslot;
    int oom;
} counter;

static int grow_words(counter *t) {
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
    counter *t = ctx;
    if (n == 0) return 0;
    if (2 * (t->nw + 1) > t->nslot && grow_words(t)) return t->oom = 1, -1;
    size_t h = fnv(p, n) & (t->nslot - 1);
    for (; t->slot[h]; h = (h + 1) & (t->nslot - 1)) {
        tmd_bpe_word *w = &t->w[t->slot[h] - 1];
        if (w->len == n && !memcmp(w->bytes, p, n)) return w->count++, 0;
    }
    if (t->nw == t->capw) {
        size_t c = t->capw ? 2 * t->capw : 4096;
        tmd_bpe_word *nw = realloc(t->w, c * sizeof *nw);
        if (!nw) return t->oom = 1, -1;
        t->w = nw, t->capw = c;
    }
    tmd_bpe_word *w = &t->w[t->nw];
    if (!(w->bytes = malloc(n))) return t->oom = 1, -1;
    memcpy(w->bytes, p, n);
    w->len = n, w->count = 1;
    t->slot[h] = ++t->nw;
    return 0;
}

void tmd_bpe_words_free(tmd_bpe_word *words, size_t nwords) {
    for (size_t i = 0; words && i < nwords; i++) free(words[i].bytes);
    free(words);
}

int tmd_bpe_count_words(const unsigned char *text, size_t n, tmd_bpe_word **words, size_t *nwords, char *err,
                        size_t errlen) {
    *words = NULL, *nwords = 0;
    counter t = {0};
    tmd_split *sp = NULL;
    char m[512];
    int rc = 0;
    if (tmd_split_new(tmd_gpt2_pattern, 0, TMD_SPLIT_ISOLATED, 0, &sp, m, sizeof m))
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "GPT-2's pattern: %s", m);
    else if (n && tmd_split_pieces(sp, text, n, add_piece, &t, m, sizeof m))
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "%s", t.oom ? "out of memory counting the words" : m);
    tmd_split_free(sp);
    free(t.slot);
    if (rc) return tmd_bpe_words_free(t.w, t.nw), rc;
    *words = t.w, *nwords = t.nw;
    return 0;
}

/* ---- learning the merges ------------------------------------------------------------------- */

typedef struct lword {
    int32_t *sym;
    int64_t count;
    uint32_t nsym;
    int stamp; /* the step that last rewrote it: a word listed twice is rewritten once */
} lword;

typedef struct pair_ent {
    uint64_t key; /* left << 32 | right */
    int64_t count;
    uint32_t *wl, nwl, capwl; /* words where the pair has occurred */
    int stamp;                /* the step that last raised its count */
} pair_ent;

typedef struct heap_ent {
    int64_t count;
    uint64_t key;
} heap_ent;

typedef struct learner {
    lword *w;
    pair_ent *p;
    size_t np, capp;
    uint32_t *slot; /* open addressing: index + 1 into p, 0 empty */
    size_t nslot;
    heap_ent *heap;
    size_t nh, caph;
    uint32_t *raised; /* pairs whose count rose in this step: pushed after it */
    size_t nraised, capraised;
    int step;
} learner;

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *np = realloc(*p, c * elem);
    if (!np) return -1;
    *p = np, *cap = c;
    return 0;
}

/* The index of pair `key`, made (count 0) when absent and add != 0; -1 when absent or out of
 * memory. */
static int64_t pair_find(learner *L, uint64_t key, int add) {
    if (add && 2 * (L->np + 1) > L->nslot) {
        size_t ns = L->nslot ? 2 * L->nslot : 1 << 16;
        uint32_t *s = calloc(ns, sizeof *s);
        if (!s) return -1;
        for (size_t i = 0; i < L->np; i++) {
            size_t h = mix(L->p[i].key) & (ns - 1);
            while (s[h]) h = (h + 1) & (ns - 1);
            s[h] = (uint32_t)i + 1;
        }
        free(L->slot);
        L->slot = s, L->nslot = ns;
    }
    if (!L->nslot) return -1;
    size_t mask = L->nslot - 1, h = mix(key) & mask;
    for (; L->slot[h]; h = (h + 1) & mask)
        if (L->p[L->slot[h] - 1].key == key) return L->slot[h] - 1;
    if (!add || L->np >= UINT32_MAX - 1 || grow((void **)&L->p, &L->capp, L->np + 1, sizeof *L->p)) return -1;
    L->p[L->np] = (pair_ent){.key = key, .stamp = -1};
    L->slot[h] = (uint32_t)++L->np;
    return (int64_t)L->np - 1;
}

static uint64_t pkey(int32_t a, int32_t b) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)b; }

static int raise_pair(learner *L, uint64_t key, int64_t k, uint32_t wi) {
    int64_t i = pair_find(L, key, 1);
    if (i < 0) return -1;
    pair_ent *e = &L->p[i];
    e->count += k;
    if (!e->nwl || e->wl[e->nwl - 1] != wi) {
        size_t cap = e->capwl;
        if (grow((void **)&e->wl, &cap, (size_t)e->nwl + 1, sizeof *e->wl)) return -1;
        e->capwl = (uint32_t)cap;
        e->wl[e->nwl++] = wi;
    }
    if (e->stamp != L->step) {
        e->stamp = L->step;
        if (grow((void **)&L->raised, &L->capraised, L->nraised + 1, sizeof *L->raised)) return -1;
        L->raised[L->nraised++] = (uint32_t)i;
    }
    return 0;
}

/* The pair occurs in the word (its count is at least k): it exists. */
static void lower_pair(learner *L, uint64_t key, int64_t k) { L->p[pair_find(L, key, 0)].count -= k; }

static int heap_before(const heap_ent *x, const heap_ent *y) {
    return x->count > y->count || (x->count == y->count && x->key < y->key);
}

static int heap_push(learner *L, heap_ent e) {
    if (grow((void **)&L->heap, &L->caph, L->nh + 1, sizeof *L->heap)) return -1;
    size_t i = L->nh++;
    while (i && heap_before(&e, &L->heap[(i - 1) / 2])) L->heap[i] = L->heap[(i - 1) / 2], i = (i - 1) / 2;
    L->heap[i] = e;
    return 0;
}

static heap_ent heap_pop(learner *L) {
    heap_ent top = L->heap[0], last = L->heap[--L->nh];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= L->nh) break;
        if (c + 1 < L->nh && heap_before(&L->heap[c + 1], &L->heap[c])) c++;
        if (!heap_before(&L->heap[c], &last)) break;
        L->heap[i] = L->heap[c], i = c;
    }
    if (L->nh) L->heap[i] = last;
    return top;
}

/* Push the pairs raised in this step with their counts now. */
static int push_raised(learner *L) {
    for (size_t r = 0; r < L->nraised; r++) {
        const pair_ent *e = &L->p[L->raised[r]];
        if (e->count > 0 && heap_push(L, (heap_ent){e->count, e->key})) return -1;
    }
    L->nraised = 0;
    return 0;
}

/* The most frequent pair (ties: the smaller key), or -1 when no pair is left. */
static int64_t best_pair(learner *L) {
    while (L->nh) {
        heap_ent top = heap_pop(L);
        int64_t i = pair_find(L, top.key, 0);
        int64_t c = L->p[i].count;
        if (c > 0 && c == top.count) return i;
        if (c > 0 && c < top.count && heap_push(L, (heap_ent){c, top.key})) return -2;
        /* c > top.count: a newer entry holds c; c == 0: the pair is gone */
    }
    return -1;
}

/* Rewrite word wi's occurrences of (a, b) as id, left to right, moving the neighbours' counts. */
static int merge_word(learner *L, uint32_t wi, int32_t a, int32_t b, int32_t id) {
    lword *w = &L->w[wi];
    int32_t *s = w->sym;
    int64_t k = w->count;
    uint32_t n = w->nsym, o = 0;
    for (uint32_t j = 0; j < n;) {
        if (j + 1 < n && s[j] == a && s[j + 1] == b) {
            if (o > 0) {
                lower_pair(L, pkey(s[o - 1], a), k);
                if (raise_pair(L, pkey(s[o - 1], id), k, wi)) return -1;
            }
            if (j + 2 < n) {
                lower_pair(L, pkey(b, s[j + 2]), k);
                if (raise_pair(L, pkey(id, s[j + 2]), k, wi)) return -1;
            }
            lower_pair(L, pkey(a, b), k);
            s[o++] = id, j += 2;
        } else {
            s[o++] = s[j++];
        }
    }
    w->nsym = o;
    return 0;
}

/* Token strings -> ids (the merged ones, >= 256): a merge that makes a string made before
 * gives it the same id, as tokenizers' trainer does (word_to_id). */
typedef struct tokens {
    unsigned char **s;
    size_t *len;
    int32_t *slot; /* id + 1, 0 empty */
    size_t mask;
    int n;
} tokens;

static int32_t *tok_slot(tokens *T, const unsigned char *s, size_t n) {
    size_t h = fnv(s, n) & T->mask;
    for (; T->slot[h]; h = (h + 1) & T->mask) {
        int32_t q = T->slot[h] - 1;
        if (T->len[q] == n && !memcmp(T->s[q], s, n)) break;
    }
    return &T->slot[h];
}

void tmd_bpe_merges_free(tmd_bpe_merges *m) {
    free(m->left), free(m->right), free(m->id);
    memset(m, 0, sizeof *m);
}

int tmd_bpe_learn(const tmd_bpe_word *words, size_t nwords, int n_tokens, tmd_bpe_merges *out, char *err,
                  size_t errlen) {
    memset(out, 0, sizeof *out);
    if (n_tokens < 258 || n_tokens > 1 << 20)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "a vocabulary of %d: must be in [258, %d]", n_tokens, 1 << 20);
    if (nwords >= UINT32_MAX)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "%zu distinct words: more than this trainer indexes",
                        nwords);
    int max_merges = n_tokens - 257, rc = 0;
    learner L = {0};
    tokens T = {0};
    size_t nslot = 1;
    while (nslot < 2 * (size_t)n_tokens) nslot *= 2;
    T.s = calloc((size_t)n_tokens, sizeof *T.s);
    T.len = calloc((size_t)n_tokens, sizeof *T.len);
    T.slot = calloc(nslot, sizeof *T.slot);
    T.mask = nslot - 1;
    out->left = malloc((size_t)max_merges * sizeof *out->left);
    out->right = malloc((size_t)max_merges * sizeof *out->right);
    out->id = malloc((size_t)max_merges * sizeof *out->id);
    L.w = calloc(nwords ? nwords : 1, sizeof *L.w);
    if (!T.s || !T.len || !T.slot || !out->left || !out->right || !out->id || !L.w) goto oom;
    for (int b = 0; b < 256; b++) {
        if (!(T.s[b] = malloc(1))) goto oom;
        T.s[b][0] = (unsigned char)b, T.len[b] = 1;
    }
    T.n = 256;
    L.step = 1;
    for (size_t i = 0; i < nwords; i++) {
        lword *w = &L.w[i];
        if (words[i].len >= UINT32_MAX) {
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "a word of %zu bytes: too long", words[i].len);
            goto done;
        }
        if (!(w->sym = malloc((words[i].len ? words[i].len : 1) * sizeof *w->sym))) goto oom;
        w->count = words[i].count, w->nsym = (uint32_t)words[i].len;
        for (size_t j = 0; j < words[i].len; j++) w->sym[j] = words[i].bytes[j];
        for (uint32_t j = 0; j + 1 < w->nsym; j++)
            if (raise_pair(&L, pkey(w->sym[j], w->sym[j + 1]), w->count, (uint32_t)i)) goto oom;
    }
    if (push_raised(&L)) goto oom;
    while (out->n < max_merges && T.n < n_tokens - 1) {
        int64_t bi = best_pair(&L);
        if (bi == -2) goto oom;
        if (bi < 0) break; /* every word is one token */
        int32_t a = (int32_t)(L.p[bi].key >> 32), b = (int32_t)(uint32_t)L.p[bi].key;
        size_t nl = T.len[a] + T.len[b];
        unsigned char *s = malloc(nl);
        if (!s) goto oom;
        memcpy(s, T.s[a], T.len[a]), memcpy(s + T.len[a], T.s[b], T.len[b]);
        int32_t *slot = tok_slot(&T, s, nl), id;
        if (*slot) {
            id = *slot - 1;
            free(s);
        } else {
            id = T.n++;
            T.s[id] = s, T.len[id] = nl, *slot = id + 1;
        }
        out->left[out->n] = a, out->right[out->n] = b, out->id[out->n] = id, out->n++;
        /* The pair's word list leaves the pair: it is read while other lists grow (and the pair
         * table may move); a later occurrence of the pair (through a reused id) starts a new one. */
        uint32_t *wl = L.p[bi].wl, nwl = L.p[bi].nwl;
        L.p[bi].wl = NULL, L.p[bi].nwl = L.p[bi].capwl = 0;
        L.step++;
        for (uint32_t q = 0; q < nwl; q++) {
            if (L.w[wl[q]].stamp == L.step) continue;
            L.w[wl[q]].stamp = L.step;
            if (merge_word(&L, wl[q], a, b, id)) {
                free(wl);
                goto oom;
            }
        }
        free(wl);
        if (push_raised(&L)) goto oom;
    }
    goto done;
oom:
    rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory learning the merges (%zu distinct words, %zu pairs)",
                  nwords, L.np);
done:
    for (size_t i = 0; L.w && i < nwords; i++) free(L.w[i].sym);
    for (size_t i = 0; i < L.np; i++) free(L.p[i].wl);
    free(L.w), free(L.p), free(L.slot), free(L.heap), free(L.raised);
    for (int q = 0; T.s && q < n_tokens; q++) free(T.s[q]);
    free(T.s), free(T.len), free(T.slot);
    if (rc) tmd_bpe_merges_free(out);
    return rc;
}

/* ---- the file ------------------------------------------------------------------------------ */

static int write_json(const tmd_bpe_merges *mg, const char *out_json, char *err, size_t errlen) {
    int ntok = 256;
    for (int q = 0; q < mg->n; q++)
        if (mg->id[q] == ntok) ntok++;
    unsigned char **tok = calloc((size_t)ntok, sizeof *tok);
    size_t *toklen = calloc((size_t)ntok, sizeof *toklen);
    int rc = 0;
    if (!tok || !toklen) goto oom;
    for (int b = 0; b < 256; b++) {
        if (!(tok[b] = malloc(1))) goto oom;
        tok[b][0] = (unsigned char)b, toklen[b] = 1;
    }
    for (int q = 0; q < mg->n; q++) {
        int a = mg->left[q], c = mg->right[q], id = mg->id[q];
        if (tok[id]) continue; /* made before */
        if (!(tok[id] = malloc(toklen[a] + toklen[c]))) goto oom;
        memcpy(tok[id], tok[a], toklen[a]), memcpy(tok[id] + toklen[a], tok[c], toklen[c]);
        toklen[id] = toklen[a] + toklen[c];
    }
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
    for (int q = 0; q < mg->n; q++) {
        tmd_sb_printf(&b, q ? ", [" : "[");
        tmd_json_byte_token(&b, tok[mg->left[q]], toklen[mg->left[q]]);
        tmd_sb_printf(&b, ", ");
        tmd_json_byte_token(&b, tok[mg->right[q]], toklen[mg->right[q]]);
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
    goto done;
oom:
    rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory writing '%s'", out_json);
done:
    for (int q = 0; tok && q < ntok; q++) free(tok[q]);
    free(tok), free(toklen);
    return rc;
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

    tmd_bpe_word *words = NULL;
    size_t nw = 0;
    tmd_bpe_merges mg = {0};
    char m[512];
    int rc = tmd_bpe_count_words((const unsigned char *)text.p, text.n, &words, &nw, m, sizeof m);
    free(text.p);
    if (rc) return tmd_fail(err, errlen, rc, "'%s': %s", in_path, m);
    rc = tmd_bpe_learn(words, nw, n_tokens, &mg, err, errlen);
    tmd_bpe_words_free(words, nw);
    if (!rc) rc = write_json(&mg, out_json, err, errlen);
    if (!rc && merges_out) *merges_out = mg.n;
    tmd_bpe_merges_free(&mg);
    return rc;
}
