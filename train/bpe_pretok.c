/*
 * bpe_pretok.c — Split pre-tokenizers through PCRE2 (bpe_pretok.h): the pattern's rewrite for
 * Oniguruma's meaning, its compilation, and tokenizers' match list and behaviors.
 */
#include "bpe_pretok.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char tmd_gpt2_pattern[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* A match or a gap of the list tokenizers builds (pattern.rs find_matches). */
typedef struct span {
    size_t s, e;
    int match;
} span;

struct tmd_split {
    pcre2_code *code;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit_stack;
    tmd_split_behavior behavior;
    int invert;
    span *list;
    size_t cap;
};

/* ---- the rewrite ------------------------------------------------------------------------ */

typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

static int put(sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -2;
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

/* Oniguruma's pattern as PCRE2 reads it the same way (bpe_pretok.h): 0, -1 with msg set (a
 * refused construct) or -2 (memory). The scan knows escapes, \Q...\E and whether it is inside a
 * character class. put() fails with -2. */
static int rewrite(const char *re, char **out, char *msg, size_t msglen) {
    sbuf b = {0};
    int in_class = 0, rc = 0;
    size_t n = strlen(re);
    for (size_t i = 0; i < n && !rc;) {
        char c = re[i];
        if (c == '\\' && i + 1 < n) {
            char d = re[i + 1];
            if (d == 's' || d == 'S') {
                rc = put(&b, d == 's' ? "\\p{White_Space}" : "\\P{White_Space}", 15);
            } else if (strchr("wWbBhH", d)) {
                snprintf(msg, msglen,
                         "\\%c at offset %zu: Oniguruma (tokenizers' regex engine) and PCRE2 give it different "
                         "characters, so it is not supported",
                         d, i);
                rc = -1;
            } else if (d == 'Q') {
                const char *e = strstr(re + i + 2, "\\E");
                size_t end = e ? (size_t)(e - re) + 2 : n;
                rc = put(&b, re + i, end - i);
                i = end;
                continue;
            } else {
                rc = put(&b, re + i, 2);
            }
            i += 2;
            continue;
        }
        if (in_class) {
            if (c == '[' && i + 1 < n && re[i + 1] == ':') {
                snprintf(msg, msglen,
                         "a POSIX class [:...:] at offset %zu: Oniguruma's (Unicode) and PCRE2's differ, so it is "
                         "not supported",
                         i);
                rc = -1;
                break;
            }
            if (c == ']') in_class = 0;
            rc = put(&b, re + i, 1);
            i++;
            continue;
        }
        if (c == '[') {
            /* a ']' right after '[' or '[^' is a member, not the end */
            size_t j = i + 1;
            if (j < n && re[j] == '^') j++;
            if (j < n && re[j] == ']') j++;
            rc = put(&b, re + i, j - i);
            in_class = 1;
            i = j;
            continue;
        }
        if (c == '{' && i + 1 < n && re[i + 1] == ',') {
            size_t j = i + 2;
            while (j < n && re[j] >= '0' && re[j] <= '9') j++;
            if (j > i + 2 && j < n && re[j] == '}') {
                rc = put(&b, "{0", 2);
                i++;
                continue;
            }
        }
        rc = put(&b, re + i, 1);
        i++;
    }
    if (!rc && !b.p) rc = put(&b, "", 0);
    if (rc) {
        free(b.p);
        return rc;
    }
    *out = b.p;
    return 0;
}

/* ---- compiling ------------------------------------------------------------------------- */

void tmd_split_free(tmd_split *sp) {
    if (!sp) return;
    pcre2_match_data_free(sp->md);
    pcre2_match_context_free(sp->mctx);
    pcre2_jit_stack_free(sp->jit_stack);
    pcre2_code_free(sp->code);
    free(sp->list);
    free(sp);
}

/* PCRE2's message for error code ec at offset off of the pattern. */
static void compile_error(int ec, size_t off, char *msg, size_t msglen) {
    PCRE2_UCHAR text[256];
    pcre2_get_error_message(ec, text, sizeof text);
    snprintf(msg, msglen, "PCRE2 cannot compile it: %s (at offset %zu)", (const char *)text, off);
}

int tmd_split_new(const char *pattern, int literal, tmd_split_behavior behavior, int invert, tmd_split **out,
                  char *msg, size_t msglen) {
    *out = NULL;
    msg[0] = 0;
    int ec;
    PCRE2_SIZE eoff;
    /* MULTILINE: Oniguruma's ^ and $ are line anchors (its Ruby syntax). PCRE2_LITERAL takes no
     * UCP, which it does not need. */
    uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP | PCRE2_MULTILINE);
    char *re = NULL;
    if (literal) {
        if (!(re = strdup(pattern))) return -2;
    } else {
        /* The pattern as written first, so that a syntax error's offset is in the file's text. */
        pcre2_code *c = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, opts, &ec, &eoff, NULL);
        if (!c) {
            compile_error(ec, (size_t)eoff, msg, msglen);
            return -1;
        }
        pcre2_code_free(c);
        int rc = rewrite(pattern, &re, msg, msglen);
        if (rc) return rc;
    }
    tmd_split *sp = calloc(1, sizeof *sp);
    if (!sp) {
        free(re);
        return -2;
    }
    sp->behavior = behavior;
    sp->invert = invert;
    sp->code = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, opts, &ec, &eoff, NULL);
    free(re);
    if (!sp->code) {
        compile_error(ec, (size_t)eoff, msg, msglen);
        if (!literal) snprintf(msg + strlen(msg), msglen - strlen(msg), " of the pattern rewritten for PCRE2");
        tmd_split_free(sp);
        return -1;
    }
    /* JIT where PCRE2 has it for this machine; pcre2_match runs the interpreter otherwise. Its
     * stack may grow to 8 MiB: a long run of one class backtracks through a frame per character. */
    if (pcre2_jit_compile(sp->code, PCRE2_JIT_COMPLETE) == 0) {
        if (!(sp->jit_stack = pcre2_jit_stack_create(32 << 10, 8 << 20, NULL))) goto nomem;
    }
    if (!(sp->mctx = pcre2_match_context_create(NULL))) goto nomem;
    if (sp->jit_stack) pcre2_jit_stack_assign(sp->mctx, NULL, sp->jit_stack);
    /* Llama-3's \s*[\r\n]+ backtracks once per character of a whitespace run that ends in no
     * newline: PCRE2's default limit (10 million) stops it at a 10 MB run, as Oniguruma's retry
     * limit of the same size makes tokenizers panic there. Such runs are linear work, so the
     * limit goes to its maximum and the file is encoded. */
    pcre2_set_match_limit(sp->mctx, UINT32_MAX);
    if (!(sp->md = pcre2_match_data_create_from_pattern(sp->code, NULL))) goto nomem;
    *out = sp;
    return 0;
nomem:
    tmd_split_free(sp);
    return -2;
}

/* ---- pieces ----------------------------------------------------------------------------- */

static int add(tmd_split *sp, size_t *k, size_t s, size_t e, int match) {
    if (*k == sp->cap) {
        size_t cap = sp->cap ? sp->cap * 2 : 256;
        span *p = realloc(sp->list, cap * sizeof *p);
        if (!p) return -1;
        sp->list = p, sp->cap = cap;
    }
    sp->list[(*k)++] = (span){s, e, match};
    return 0;
}

/* Bytes of the UTF-8 character at s[0] (1 for a byte that starts none). */
static size_t char_len(const unsigned char *s, size_t n) {
    size_t k = s[0] < 0x80 ? 1 : s[0] >= 0xF0 && s[0] <= 0xF4 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC2 ? 2 : 1;
    if (k > n) return 1;
    for (size_t i = 1; i < k; i++)
        if ((s[i] & 0xC0) != 0x80) return 1;
    return k;
}

int tmd_split_pieces(tmd_split *sp, const unsigned char *s, size_t n,
                     int (*emit)(void *ctx, const unsigned char *piece, size_t len), void *ctx, char *msg,
                     size_t msglen) {
    if (!n) return 0; /* tokenizers: one empty gap, dropped as empty */
    size_t k = 0, prev = 0, last_end = 0, last_match_end = 0;
    int have_last = 0;
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(sp->md);
    /* onig's find_iter, with the gaps between matches (pattern.rs) */
    while (last_end <= n) {
        int rc = pcre2_match(sp->code, s, n, last_end, 0, sp->md, sp->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR text[256];
            pcre2_get_error_message(rc, text, sizeof text);
            snprintf(msg, msglen, "PCRE2 failed matching at byte %zu of a %zu-byte piece: %s", last_end, n,
                     (const char *)text);
            return -1;
        }
        size_t ms = ov[0], me = ov[1];
        if (ms == me && have_last && last_match_end == me) {
            last_end += last_end < n ? char_len(s + last_end, n - last_end) : 1;
            continue;
        }
        last_end = last_match_end = me;
        have_last = 1;
        if (prev != ms && add(sp, &k, prev, ms, 0)) goto nomem;
        if (add(sp, &k, ms, me, 1)) goto nomem;
        prev = me;
    }
    if (prev != n && add(sp, &k, prev, n, 0)) goto nomem;
    if (sp->invert)
        for (size_t i = 0; i < k; i++) sp->list[i].match = !sp->list[i].match;
    /* The behavior (normalizer.rs split): `match` becomes "remove" for Removed only; the
     * others join spans into the first of them (w counts the kept spans). */
    span *l = sp->list;
    size_t w = 0;
    int prev_match = 0;
    switch (sp->behavior) {
    case TMD_SPLIT_ISOLATED:
        for (size_t i = 0; i < k; i++) l[i].match = 0;
        w = k;
        break;
    case TMD_SPLIT_REMOVED: w = k; break;
    case TMD_SPLIT_CONTIGUOUS:
    case TMD_SPLIT_MERGED_WITH_PREVIOUS:
        for (size_t i = 0; i < k; i++) {
            int m = l[i].match;
            int join = sp->behavior == TMD_SPLIT_CONTIGUOUS ? m == prev_match : m && !prev_match;
            if (join && w) l[w - 1].e = l[i].e;
            else l[w++] = (span){l[i].s, l[i].e, 0};
            prev_match = m;
        }
        break;
    case TMD_SPLIT_MERGED_WITH_NEXT:
        /* tokenizers folds from the end: a match joins the span after it unless that is a match */
        for (size_t i = k; i-- > 0;) {
            int m = l[i].match;
            if (m && !prev_match && w) l[k - w].s = l[i].s;
            else l[k - ++w] = (span){l[i].s, l[i].e, 0};
            prev_match = m;
        }
        memmove(l, l + (k - w), w * sizeof *l);
        break;
    }
    for (size_t i = 0; i < w; i++) {
        if (l[i].match || l[i].e == l[i].s) continue;
        int rc = emit(ctx, s + l[i].s, l[i].e - l[i].s);
        if (rc) return rc;
    }
    return 0;
nomem:
    snprintf(msg, msglen, "out of memory splitting %zu bytes", n);
    return -1;
}
