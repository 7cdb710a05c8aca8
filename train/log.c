/* log.c — JSON lines and the progress bar; see log.h. */
#include "log.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

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

int tmd_progress_wanted(int mode, int fd) {
    if (mode == TMD_PROGRESS_BAR) return 1;
    if (mode == TMD_PROGRESS_LINES || !isatty(fd)) return 0;
    static const char *const launchers[] = {"OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK", "SLURM_STEP_ID"};
    for (size_t i = 0; i < sizeof launchers / sizeof launchers[0]; i++)
        if (getenv(launchers[i])) return 0;
    const char *term = getenv("TERM");
    return !(term && !strcmp(term, "dumb"));
}

int tmd_term_cols(int fd) {
    struct winsize ws;
    if (ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
    return 80;
}

int tmd_progress(FILE *f, const tmd_progress_fields *p, int cols) {
    /* the fields by priority: what goes first when the line does not fit */
    enum { F_PCT, F_ETA, F_LOSS, F_BAR, F_TPS, F_LR, F_LOAD, NF };
    double frac = p->total > 0 ? (double)p->step / (double)p->total : 1;
    char txt[NF][48], head[48], eta[32];
    tmd_fmt_duration(eta, sizeof eta, p->step > 0 ? p->elapsed_s / (double)p->step * (double)(p->total - p->step) : -1);
    snprintf(head, sizeof head, "%lld/%lld", (long long)p->step, (long long)p->total);
    snprintf(txt[F_PCT], sizeof txt[0], " %3.0f%%", 100 * frac);
    snprintf(txt[F_ETA], sizeof txt[0], " | ETA %s", eta);
    snprintf(txt[F_LOSS], sizeof txt[0], " loss %.4f", p->loss);
    snprintf(txt[F_TPS], sizeof txt[0], " | %.0f tok/s", p->tokens_per_s);
    snprintf(txt[F_LR], sizeof txt[0], " | lr %.2e", p->lr);
    snprintf(txt[F_LOAD], sizeof txt[0], " | load %.2f", p->load);
    int room = cols - 1 - (int)strlen(head), bar = 0, on[NF] = {0};
    for (int k = 0; k < NF; k++) {
        int need = k == F_BAR ? 3 + 10 : (int)strlen(txt[k]); /* " [" 10 cells "]" */
        if (need > room) break;
        on[k] = 1, room -= need;
        if (k == F_BAR) bar = 10;
    }
    if (on[F_BAR]) bar += room < 10 ? room : 10; /* what is left widens the bar, up to 20 cells */
    char cells[24];
    int fill = (int)(frac * bar);
    for (int i = 0; i < bar; i++) cells[i] = i < fill ? '#' : '.';
    cells[bar] = 0;
    char line[256];
    int n = snprintf(line, sizeof line, "%s", head);
    if (on[F_BAR]) n += snprintf(line + n, sizeof line - (size_t)n, " [%s]", cells);
    const int order[] = {F_PCT, F_LOSS, F_LR, F_TPS, F_LOAD, F_ETA};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++)
        if (on[order[i]]) n += snprintf(line + n, sizeof line - (size_t)n, "%s", txt[order[i]]);
    fprintf(f, "\r%s\033[K", line);
    fflush(f);
    return n;
}

void tmd_progress_clear(FILE *f) {
    fputs("\r\033[K", f);
    fflush(f);
}
