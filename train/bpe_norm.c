/*
 * bpe_norm.c — NFC through utf8proc (bpe_norm.h).
 *
 * A long text is normalized in chunks of about CHUNK bytes, each ended before an ASCII byte:
 * an ASCII character has combining class 0 and is never the second half of a composition, so
 * nothing before it changes with what follows (a normalization boundary in UAX #15's sense),
 * and utf8proc's buffers stay small whatever the text's size.
 */
#include "bpe_norm.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#define CHUNK ((size_t)1 << 16)
#define NFC_OPTIONS (UTF8PROC_STABLE | UTF8PROC_COMPOSE) /* utf8proc_NFC's */

/* Nothing at or above U+0300 (lead bytes >= 0xCC): already NFC. */
static int below_u0300(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] >= 0xCC) return 0;
    return 1;
}

static int put(unsigned char **buf, size_t *cap, size_t *len, const unsigned char *s, size_t n) {
    if (*len + n > *cap) {
        size_t c = *cap ? *cap : 4096;
        while (c < *len + n) c *= 2;
        unsigned char *p = realloc(*buf, c);
        if (!p) return -1;
        *buf = p, *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    return 0;
}

/* utf8proc's NFC of valid UTF-8 s[0, n), n > 0, appended: 0, -1 (memory), 1 (not UTF-8). */
static int nfc_valid(const unsigned char *s, size_t n, unsigned char **buf, size_t *cap, size_t *len) {
    utf8proc_uint8_t *d = NULL;
    utf8proc_ssize_t k = utf8proc_map(s, (utf8proc_ssize_t)n, &d, NFC_OPTIONS);
    if (k < 0) return k == UTF8PROC_ERROR_INVALIDUTF8 ? 1 : -1; /* else UTF8PROC_ERROR_NOMEM or _OVERFLOW */
    int rc = put(buf, cap, len, d, (size_t)k);
    free(d);
    return rc;
}

/* A chunk that holds bytes that are not UTF-8: its valid runs normalized, the rest copied. */
static int nfc_runs(const unsigned char *s, size_t n, unsigned char **buf, size_t *cap, size_t *len) {
    size_t i = 0, run = 0;
    while (i < n) {
        utf8proc_int32_t c;
        utf8proc_ssize_t k = utf8proc_iterate(s + i, (utf8proc_ssize_t)(n - i), &c);
        if (k > 0) {
            i += (size_t)k;
            continue;
        }
        if (i > run && nfc_valid(s + run, i - run, buf, cap, len)) return -1; /* valid: 1 cannot come */
        if (put(buf, cap, len, s + i, 1)) return -1;
        run = ++i;
    }
    return i > run && nfc_valid(s + run, i - run, buf, cap, len) ? -1 : 0;
}

int tmd_nfc(const unsigned char *s, size_t n, unsigned char **buf, size_t *cap, const unsigned char **out,
            size_t *out_n) {
    if (below_u0300(s, n)) {
        *out = s, *out_n = n;
        return 0;
    }
    size_t len = 0;
    for (size_t a = 0; a < n;) {
        size_t b = a + CHUNK < n ? a + CHUNK : n;
        while (b < n && s[b] >= 0x80) b++;
        int rc = below_u0300(s + a, b - a) ? put(buf, cap, &len, s + a, b - a) : nfc_valid(s + a, b - a, buf, cap, &len);
        if (rc == 1) rc = nfc_runs(s + a, b - a, buf, cap, &len);
        if (rc) return -1;
        a = b;
    }
    *out = *buf, *out_n = len;
    return 0;
}

const char *tmd_nfc_version(void) {
    static char v[64];
    if (!v[0]) snprintf(v, sizeof v, "utf8proc %s, Unicode %s", utf8proc_version(), utf8proc_unicode_version());
    return v;
}
