/* util.c — see util.h. */
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "status.h"

int tmd_fail(char *err, size_t errlen, int code, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

int tmd_read_file(const char *path, size_t max, unsigned char **data, size_t *len, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s' is not a regular file", path);
    }
    if (max && (uint64_t)sb.st_size > max) {
        close(fd);
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s' is %lld bytes, more than the %zu bytes such a file may have",
                        path, (long long)sb.st_size, max);
    }
    size_t n = (size_t)sb.st_size, got = 0;
    unsigned char *b = malloc(n ? n : 1);
    if (!b) {
        close(fd);
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "'%s': out of memory (%zu bytes)", path, n);
    }
    while (got < n) {
        ssize_t r = read(fd, b + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = r < 0 ? errno : EIO;
            close(fd);
            free(b);
            return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot read '%s': %s", path, strerror(e));
        }
        got += (size_t)r;
    }
    close(fd);
    *data = b;
    *len = n;
    return 0;
}

double tmd_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
