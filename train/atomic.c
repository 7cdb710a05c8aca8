/* atomic.c — atomic file replacement and mkdir -p for the driver; see atomic.h. */
#include "atomic.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "status.h"
#include "util.h"

static const char *kind_of(mode_t m) {
    return S_ISDIR(m)    ? "a directory"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISSOCK(m) ? "a socket"
           : S_ISLNK(m)  ? "a symbolic link"
                         : "not a regular file";
}

int tmd_atomic_open(tmd_atomic *a, const char *path, char *err, size_t errlen) {
    memset(a, 0, sizeof *a);
    if (strlen(path) >= sizeof a->path)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "cannot write '%s': path too long", path);
    /* The rename would replace whatever is at path by a regular file: /dev/null (run as
     * root), a FIFO someone reads, the link rather than its target. Only regular files are
     * ours to replace. (lstat, so a link is seen as a link.) */
    struct stat st;
    if (lstat(path, &st) == 0 && !S_ISREG(st.st_mode))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "refusing to write '%s': it exists and is %s, not a regular file",
                        path, kind_of(st.st_mode));
    memcpy(a->path, path, strlen(path) + 1);
    snprintf(a->tmp, sizeof a->tmp, "%s.tmp.XXXXXX", path);
    int fd = mkstemp(a->tmp);
    if (fd < 0) {
        int e = errno;
        a->tmp[0] = 0;
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot create a temporary file next to '%s': %s", path,
                        strerror(e));
    }
    (void)fchmod(fd, 0644);
    a->f = fdopen(fd, "wb");
    if (!a->f) {
        int rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot open '%s': %s", a->tmp, strerror(errno));
        close(fd);
        unlink(a->tmp);
        a->tmp[0] = 0;
        return rc;
    }
    return 0;
}

int tmd_atomic_write(tmd_atomic *a, const void *p, size_t n) {
    if (a->error) return -1;
    if (n && fwrite(p, 1, n, a->f) != n) {
        a->error = errno ? errno : EIO;
        return -1;
    }
    return 0;
}

int tmd_atomic_stage(tmd_atomic *a, char *err, size_t errlen) {
    int e = a->error;
    if (!e && (fflush(a->f) != 0 || ferror(a->f))) e = errno ? errno : EIO;
    if (!e && fsync(fileno(a->f)) != 0) e = errno;
    if (fclose(a->f) != 0 && !e) e = errno;
    a->f = NULL;
    if (!e) return 0;
    int rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot write '%s' (via '%s'): %s", a->path, a->tmp, strerror(e));
    tmd_atomic_abort(a);
    return rc;
}

/* The directory entry of the rename is only durable once the directory itself is synced. */
static void sync_parent(const char *path) {
    char dir[TMD_ATOMIC_PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        (void)fsync(fd); /* best effort: the file's own data is synced already */
        close(fd);
    }
}

int tmd_atomic_publish(tmd_atomic *a, char *err, size_t errlen) {
    if (rename(a->tmp, a->path) != 0) {
        int rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot rename '%s' to '%s': %s", a->tmp, a->path,
                          strerror(errno));
        tmd_atomic_abort(a);
        return rc;
    }
    a->tmp[0] = 0;
    sync_parent(a->path);
    return 0;
}

int tmd_atomic_commit(tmd_atomic *a, char *err, size_t errlen) {
    int rc = tmd_atomic_stage(a, err, errlen);
    return rc ? rc : tmd_atomic_publish(a, err, errlen);
}

void tmd_atomic_abort(tmd_atomic *a) {
    if (a->f) fclose(a->f);
    a->f = NULL;
    if (a->tmp[0]) unlink(a->tmp);
    a->tmp[0] = 0;
}

int tmd_mkdirs(const char *dir, char *err, size_t errlen) {
    char p[TMD_ATOMIC_PATH_MAX];
    if (!*dir || strlen(dir) >= sizeof p)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "directory '%s' is empty or too long", dir);
    memcpy(p, dir, strlen(dir) + 1);
    for (char *s = p + 1;; s++) {
        if (*s == '/' || !*s) {
            char c = *s;
            *s = 0;
            if (mkdir(p, 0777) != 0 && errno != EEXIST)
                return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot create directory '%s': %s", p, strerror(errno));
            *s = c;
            if (!c) break;
        }
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s' exists and is not a directory", dir);
    return 0;
}
