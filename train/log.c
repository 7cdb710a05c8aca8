/* log.c — JSON lines and the progress bar; see log.h. */
#include "log.h"

#include <math.h>
#include <stdlib.h>
#include <stdarg.h>
#include <string.h>

static void put(tmd_json *j, const char *fmt, ...) {
    if (j->n >= sizeof j->buf) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(j->buf + j->n, sizeof j->buf - j->n, fmt, ap);
    va_end(ap);
    j->n = w < 0 ? sizeof j->buf : j->n + (size_t)w;
}

static void key(tmd_json *j, const char *k) { put(j, "%s\"%s\": ", j->fields++ ? ", " : "", k); }

void tmd_json_begin(tmd_json *j) {
    j->n = 0;
    j->fields = 0;
    j->buf[0] = 0;
    put(j, "{");
}

void tmd_json_num(tmd_json *j, const char *k, double v) {
    key(j, k);
    if (isfinite(v)) {
        /* The shortest of 15 or 17 digits that reads back as the same double: readable, and
         * exact, so records of two runs compare bit for bit. */
        char b[32];
        snprintf(b, sizeof b, "%.15g", v);
        if (strtod(b, NULL) != v) snprintf(b, sizeof b, "%.17g", v);
        put(j, "%s", b);
    }
    else put(j, "null");
}

void tmd_json_int(tmd_json *j, const char *k, int64_t v) {
    key(j, k);
    put(j, "%lld", (long long)v);
}

void tmd_json_str(tmd_json *j, const char *k, const char *v) {
    key(j, k);
    put(j, "\"");
    for (const unsigned char *c = (const unsigned char *)v; *c; c++) {
        if (*c == '"' || *c == '\\') put(j, "\\%c", *c);
        else if (*c == '\n') put(j, "\\n");
        else if (*c < 0x20) put(j, "\\u%04x", *c);
        else put(j, "%c", *c);
    }
    put(j, "\"");
}

const char *tmd_json_end(tmd_json *j) {
    put(j, "}");
    if (j->n >= sizeof j->buf) {
        /* Never emit a truncated object: the fields are fixed, so this is a programming error. */
        snprintf(j->buf, sizeof j->buf, "{\"error\": \"record too long\"}");
        j->n = strlen(j->buf);
    }
    return j->buf;
}

int tmd_jsonl_write(FILE *f, tmd_json *j) {
    if (!f) return 0;
    fputs(tmd_json_end(j), f);
    fputc('\n', f);
    return fflush(f) || ferror(f) ? -1 : 0;
}

void tmd_fmt_duration(char *buf, size_t len, double s) {
    if (!(s >= 0) || s > 1e8) {
        snprintf(buf, len, "?");
        return;
    }
    long t = lround(s);
    if (t >= 3600) snprintf(buf, len, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else snprintf(buf, len, "%ld:%02ld", t / 60, t % 60);
}

void tmd_progress(FILE *f, int64_t step, int64_t total, double elapsed, const char *fields) {
    enum { WIDTH = 20 };
    double frac = total > 0 ? (double)step / (double)total : 1;
    int fill = (int)(frac * WIDTH);
    char bar[WIDTH + 1];
    for (int i = 0; i < WIDTH; i++) bar[i] = i < fill ? '#' : '.';
    bar[WIDTH] = 0;
    char eta[32];
    tmd_fmt_duration(eta, sizeof eta, step > 0 ? elapsed / (double)step * (double)(total - step) : -1);
    fprintf(f, "\r\033[K%lld/%lld [%s] %3.0f%% %s ETA %s", (long long)step, (long long)total, bar, 100 * frac, fields,
            eta);
    fflush(f);
}

void tmd_progress_clear(FILE *f) {
    fputs("\r\033[K", f);
    fflush(f);
}
