/*
 * log.h — the driver's output: JSON lines for metrics files, and the one-line progress bar
 * drawn on a terminal.
 */
#ifndef TMD_LOG_H
#define TMD_LOG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* One JSON object built in a fixed buffer: {"k": v, ...}. Non-finite numbers become null
 * (JSON has no NaN). Keys are plain identifiers; strings are escaped. */
typedef struct tmd_json {
    char buf[2048];
    size_t n;
    int fields;
} tmd_json;

void tmd_json_begin(tmd_json *j);
void tmd_json_num(tmd_json *j, const char *key, double v);
void tmd_json_int(tmd_json *j, const char *key, int64_t v);
void tmd_json_str(tmd_json *j, const char *key, const char *v);
/* Close the object; returns the text (no newline). */
const char *tmd_json_end(tmd_json *j);

/* Append one object as a line and flush, so a reader (or a crash) sees whole lines. */
int tmd_jsonl_write(FILE *f, tmd_json *j);

/* "1:02:03" or "2:03" for a duration in seconds. */
void tmd_fmt_duration(char *buf, size_t len, double seconds);

/* Redraw the progress line: "\r step 120/600 [#####.....]  20% <fields> ETA 0:42", clearing to
 * the end of the line. */
void tmd_progress(FILE *f, int64_t step, int64_t total, double elapsed_s, const char *fields);
/* Erase the progress line (before printing a normal line). */
void tmd_progress_clear(FILE *f);

#endif
