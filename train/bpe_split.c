/*
 * bpe_split.c — GPT-2 and Llama-3 pre-tokenizer splits by hand (bpe_split.h).
 *
 * Each branch below is one alternative of the pattern, tried in the pattern's order; where
 * the regex would backtrack (the \s+(?!\S) lookahead, \s*[\r\n]+) the code computes the
 * match it settles on directly: \s+(?!\S) before a non-space keeps all of a whitespace run but
 * its last character (which then starts the next piece, e.g. " word"), and \s*[\r\n]+ ends
 * after the run's last \r or \n.
 */
#include "bpe_split.h"

#include "unicode_tab.h"

#define BAD_CP 0xFFFFFFFFu

uint32_t tmd_utf8_next(const unsigned char *s, size_t n, size_t *len) {
    unsigned c = s[0];
    *len = 1;
    if (c < 0x80) return c;
    int k;
    uint32_t cp, min;
    if (c >= 0xC2 && c <= 0xDF) k = 1, cp = c & 0x1F, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) k = 2, cp = c & 0x0F, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) k = 3, cp = c & 0x07, min = 0x10000;
    else return BAD_CP;
    if ((size_t)k >= n) return BAD_CP;
    for (int i = 1; i <= k; i++) {
        if ((s[i] & 0xC0) != 0x80) return BAD_CP;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return BAD_CP;
    *len = (size_t)k + 1;
    return cp;
}

static int in_ranges(const uint32_t (*r)[2], int n, uint32_t cp) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (cp < r[mid][0]) hi = mid - 1;
        else if (cp > r[mid][1]) lo = mid + 1;
        else return 1;
    }
    return 0;
}

static int is_space(uint32_t cp) {
    if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
    if (cp < 0x85) return 0;
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

int tmd_unicode_class(uint32_t cp) {
    if (cp < 0x80) {
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return 'L';
        if (cp >= '0' && cp <= '9') return 'N';
        return is_space(cp) ? 'S' : 'O';
    }
    if (cp == BAD_CP) return 'O';
    if (is_space(cp)) return 'S';
    if (in_ranges(tmd_unicode_L, tmd_unicode_L_n, cp)) return 'L';
    if (in_ranges(tmd_unicode_N, tmd_unicode_N_n, cp)) return 'N';
    return 'O';
}

/* The class of the character at s[i] (i < n) and its length. */
static int cls_at(const unsigned char *s, size_t n, size_t i, size_t *len) {
    return tmd_unicode_class(tmd_utf8_next(s + i, n - i, len));
}

/* End of the run of class c starting at i (at most max characters; max < 0: no limit). */
static size_t run(const unsigned char *s, size_t n, size_t i, int c, int max) {
    size_t len;
    for (int k = 0; i < n && (max < 0 || k < max); k++) {
        if (cls_at(s, n, i, &len) != c) break;
        i += len;
    }
    return i;
}

/* 's 't 'm 'd 're 've 'll after the apostrophe at s[0]: the match length or 0. Case-insensitive
 * in Llama-3's pattern, where 'ſ' (U+017F, LATIN SMALL LETTER LONG S) folds to s as well. */
static size_t contraction(const unsigned char *s, size_t n, int icase) {
    if (n < 2 || s[0] != '\'') return 0;
    unsigned a = s[1], b = n > 2 ? s[2] : 0;
    if (icase) {
        if (a == 0xC5 && b == 0xBF) return 3; /* 'ſ */
        a = a >= 'A' && a <= 'Z' ? a | 0x20 : a;
        b = b >= 'A' && b <= 'Z' ? b | 0x20 : b;
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* \s+(?!\S) then \s+, at a whitespace character at s[0]; end_ws is the end of the run. */
static size_t space_run(const unsigned char *s, size_t n, size_t end_ws) {
    if (end_ws == n) return n;
    /* the start of the run's last character */
    size_t last = end_ws - 1;
    while (last > 0 && (s[last] & 0xC0) == 0x80) last--;
    size_t len;
    if (tmd_utf8_next(s + last, n - last, &len) == BAD_CP || last + len != end_ws) last = end_ws - 1;
    return last > 0 ? last : end_ws;
}

static size_t gpt2(const unsigned char *s, size_t n) {
    size_t k = contraction(s, n, 0), len0, len1;
    if (k) return k;
    int c = cls_at(s, n, 0, &len0);
    if (c == 'L' || c == 'N' || c == 'O') return run(s, n, len0, c, -1);
    if (s[0] == ' ' && n > 1) {
        int c1 = cls_at(s, n, 1, &len1);
        if (c1 != 'S') return run(s, n, 1 + len1, c1, -1);
    }
    return space_run(s, n, run(s, n, 0, 'S', -1));
}

static size_t llama3(const unsigned char *s, size_t n, int max_digits) {
    size_t k = contraction(s, n, 1), len0, len1;
    if (k) return k;
    int c = cls_at(s, n, 0, &len0);
    if (c == 'L') return run(s, n, len0, 'L', -1);
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (c != 'N' && s[0] != '\r' && s[0] != '\n' && len0 < n && cls_at(s, n, len0, &len1) == 'L')
        return run(s, n, len0 + len1, 'L', -1);
    if (c == 'N') return run(s, n, len0, 'N', max_digits - 1);
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    size_t start = c == 'O' ? 0 : s[0] == ' ' && n > 1 && cls_at(s, n, 1, &len1) == 'O' ? 1 : n;
    if (start < n) {
        size_t e = run(s, n, start, 'O', -1);
        while (e < n && (s[e] == '\r' || s[e] == '\n')) e++;
        return e;
    }
    /* whitespace: \s*[\r\n]+ ends after the run's last newline; else \s+(?!\S) | \s+ */
    size_t end_ws = run(s, n, 0, 'S', -1), nl = 0;
    for (size_t i = 0; i < end_ws; i++)
        if (s[i] == '\r' || s[i] == '\n') nl = i + 1;
    return nl ? nl : space_run(s, n, end_ws);
}

size_t tmd_split_next(tmd_split_kind kind, int max_digits, const unsigned char *s, size_t n) {
    switch (kind) {
    case TMD_SPLIT_GPT2: return gpt2(s, n);
    case TMD_SPLIT_LLAMA3: return llama3(s, n, max_digits);
    default: return n;
    }
}
