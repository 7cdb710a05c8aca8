/*
 * util.h — small helpers the driver's files share: the error message, reading a whole file,
 * the clock.
 *
 * Driver functions report failure as a return code plus a readable message in a caller's
 * buffer (char *err, size_t errlen). tmd_fail formats that message and returns the code, so a
 * failure is one statement: `return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "...", ...);`.
 */
#ifndef TMD_UTIL_H
#define TMD_UTIL_H

#include <stddef.h>

/* printf `fmt` into err (truncated to errlen - 1 bytes and NUL-terminated; nothing when err is
 * NULL or errlen 0) and return `code`. The codes are the caller's: the TMD_* codes of status.h,
 * or -1 in the files whose functions document 0 / -1. */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
int tmd_fail(char *err, size_t errlen, int code, const char *fmt, ...);

/* The whole of the regular file `path` in a malloc'ed buffer (*data, free() it; *len bytes).
 * TMD_CONFIG_ERROR when it cannot be opened, is not a regular file, or is larger than max
 * bytes (0: no limit; a small file that is huge is hostile, not worth a GB of memory),
 * TMD_RUNTIME_ERROR when memory or a read fails (codes of status.h); the message names the
 * file. */
int tmd_read_file(const char *path, size_t max, unsigned char **data, size_t *len, char *err, size_t errlen);

/* Seconds on the monotonic clock (CLOCK_MONOTONIC), for measuring durations. */
double tmd_now_s(void);

#endif
