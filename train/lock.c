/* lock.c — the out directory's lock; see lock.h. */
#include "lock.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "status.h"
#include "util.h"

/* The pid the holder wrote, or -1 (it may be between taking the lock and writing it). */
static long holder_pid(int fd) {
    char buf[32];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *end;
    long pid = strtol(buf, &end, 10);
    return end != buf && pid > 0 ? pid : -1;
}

int tmd_lock_dir(tmd_lock *l, const char *dir, char *err, size_t errlen) {
    if (l->held) return 0;
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, TMD_LOCK_FILE) >= sizeof path)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "out = '%s': path too long", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot create the lock file '%s': %s", path,
                        strerror(errno));
    int r;
    while ((r = flock(fd, LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
    }
    if (r != 0) {
        int e = errno;
        long pid = e == EWOULDBLOCK ? holder_pid(fd) : -1;
        close(fd);
        if (e != EWOULDBLOCK)
            return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot lock '%s': %s", path, strerror(e));
        char who[48] = "pid unknown";
        if (pid > 0) snprintf(who, sizeof who, "pid %ld", pid);
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "out = '%s' is in use by another tinymoe run (%s holds %s); wait for it to end, or write "
                        "this run elsewhere with --out DIR",
                        dir, who, path);
    }
    /* Best effort: the pid only makes the message of a refused run more useful. */
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) == 0 && pwrite(fd, buf, (size_t)n, 0) == n) {
    }
    l->fd = fd;
    l->held = 1;
    return 0;
}

void tmd_unlock(tmd_lock *l) {
    if (!l->held) return;
    close(l->fd); /* closing the last descriptor releases the flock */
    l->held = 0;
}
