/*
 * bpe_train_naive.c — the reference of train/bpe_train.c's merge learner, for
 * tests/test_bpe_train.c: the trainer as it first was, which recounts every adjacent pair of
 * every word at every step (O(merges x symbols)), takes the most frequent (ties: the smaller
 * left id, then right id) and rewrites every word. Slow, and plainly the definition: the
 * incremental learner must give the same merges and ids, byte for byte.
 */
#include "bpe_train_naive.h"

#include <stdlib.h>
#include <string.h>

typedef struct pairs { /* open addressing on (left << 32 | right) + 1 */
    uint64_t *key;
    int64_t *count;
    size_t n, cap;
} pairs;

static int pairs_add(pairs *p, uint64_t k, int64_t c) {
    if (2 * (p->n + 1) > p->cap) {
        size_t nc = p->cap ? 2 * p->cap : 1 << 12;
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

int tt_bpe_learn_naive(const tmd_bpe_word *words, size_t nw, int n_tokens, tmd_bpe_merges *out) {
    memset(out, 0, sizeof *out);
    int max_merges = n_tokens - 257, ntok = 256, rc = -1;
    int **sym = calloc(nw + 1, sizeof *sym), *nsym = calloc(nw + 1, sizeof *nsym);
    unsigned char **tok = calloc((size_t)n_tokens, sizeof *tok);
    size_t *toklen = calloc((size_t)n_tokens, sizeof *toklen);
    pairs pc = {0};
    out->left = malloc((size_t)max_merges * sizeof *out->left);
    out->right = malloc((size_t)max_merges * sizeof *out->right);
    out->id = malloc((size_t)max_merges * sizeof *out->id);
    if (!sym || !nsym || !tok || !toklen || !out->left || !out->right || !out->id) goto done;
    for (size_t i = 0; i < nw; i++) {
        if (!(sym[i] = malloc((words[i].len + 1) * sizeof **sym))) goto done;
        for (size_t j = 0; j < words[i].len; j++) sym[i][j] = words[i].bytes[j];
        nsym[i] = (int)words[i].len;
    }
    for (int b = 0; b < 256; b++) {
        if (!(tok[b] = malloc(1))) goto done;
        tok[b][0] = (unsigned char)b, toklen[b] = 1;
    }
    while (out->n < max_merges && ntok < n_tokens - 1) {
        if (pc.cap) memset(pc.key, 0, pc.cap * sizeof *pc.key), memset(pc.count, 0, pc.cap * sizeof *pc.count);
        pc.n = 0;
        for (size_t i = 0; i < nw; i++)
            for (int j = 0; j + 1 < nsym[i]; j++)
                if (pairs_add(&pc, (uint64_t)sym[i][j] << 32 | (uint32_t)sym[i][j + 1], words[i].count)) goto done;
        uint64_t best = 0;
        int64_t bc = 0;
        for (size_t i = 0; i < pc.cap; i++)
            if (pc.key[i] && (pc.count[i] > bc || (pc.count[i] == bc && pc.key[i] - 1 < best)))
                best = pc.key[i] - 1, bc = pc.count[i];
        if (bc == 0) break;
        int a = (int)(best >> 32), c = (int)(uint32_t)best;
        size_t nl = toklen[a] + toklen[c];
        unsigned char *s = malloc(nl);
        if (!s) goto done;
        memcpy(s, tok[a], toklen[a]), memcpy(s + toklen[a], tok[c], toklen[c]);
        int id = -1;
        for (int q = 256; q < ntok && id < 0; q++)
            if (toklen[q] == nl && !memcmp(tok[q], s, nl)) id = q;
        if (id < 0) tok[ntok] = s, toklen[ntok] = nl, id = ntok++;
        else free(s);
        out->left[out->n] = a, out->right[out->n] = c, out->id[out->n] = id, out->n++;
        for (size_t i = 0; i < nw; i++) {
            int o = 0;
            for (int j = 0; j < nsym[i]; j++) {
                if (j + 1 < nsym[i] && sym[i][j] == a && sym[i][j + 1] == c) sym[i][o++] = id, j++;
                else sym[i][o++] = sym[i][j];
            }
            nsym[i] = o;
        }
    }
    rc = 0;
done:
    for (size_t i = 0; sym && i < nw; i++) free(sym[i]);
    for (int q = 0; tok && q < ntok; q++) free(tok[q]);
    free(sym), free(nsym), free(tok), free(toklen), free(pc.key), free(pc.count);
    if (rc) tmd_bpe_merges_free(out);
    return rc;
}
