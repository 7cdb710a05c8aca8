/*
 * strbuf.h — a growable text buffer for the driver (checkpoint meta, JSON headers).
 *
 * tmd_sb_printf appends formatted text, growing the buffer with realloc; the first failure
 * sets oom and every later call does nothing, so a caller checks once at the end. p is
 * NUL-terminated whenever n > 0; free it with free().
 */
#ifndef TMD_STRBUF_H
#define TMD_STRBUF_H

#include <stddef.h>

typedef struct tmd_sbuf {
    char *p;
    size_t n, cap;
    int oom;
} tmd_sbuf;

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void tmd_sb_printf(tmd_sbuf *b, const char *fmt, ...);

#endif
