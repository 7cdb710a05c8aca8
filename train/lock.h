/*
 * lock.h — one run per out directory.
 *
 * A run takes an exclusive flock(2) on <out>/tinymoe.lock for its whole life and writes its
 * pid into the file. A second `tinymoe train` into the same directory (fresh, or --resume)
 * fails at once, naming the directory and the holder's pid, instead of interleaving its
 * checkpoints and metrics with the first run's and pruning them. The kernel drops the lock
 * when the holder exits however it exits (kill -9 included), so a lock file left behind by a
 * dead run never blocks: only a live holder does. The file itself stays (removing it would
 * let a third run lock a new file while the second still holds the old one).
 */
#ifndef TMD_LOCK_H
#define TMD_LOCK_H

#include <stddef.h>

#define TMD_LOCK_FILE "tinymoe.lock"

/* Zero-initialised (a calloc'ed run): not held. */
typedef struct tmd_lock {
    int held;
    int fd;
} tmd_lock;

/* Take the lock of directory `dir` (which must exist). 0; TMD_CONFIG_ERROR when another
 * process holds it ("out = '<dir>' is in use by another tinymoe run (pid N) ..."), or
 * TMD_RUNTIME_ERROR when the lock file cannot be created or locked. The descriptor is
 * close-on-exec. Taking a lock already held by l is a no-op. */
int tmd_lock_dir(tmd_lock *l, const char *dir, char *err, size_t errlen);
/* Release (no-op when not held). */
void tmd_unlock(tmd_lock *l);

#endif
