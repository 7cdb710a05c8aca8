/*
 * atomic.h — the driver's atomic file replacement, and mkdir -p.
 *
 * A file is written in full to a fresh temporary file in its own directory
 * ("<path>.tmp.XXXXXX", mkstemp; same directory so the rename cannot cross file systems),
 * flushed and fsynced, renamed over <path>, and the directory is fsynced so that the new name
 * itself survives a crash (best effort: some file systems refuse fsync on a directory). A
 * reader sees the old file or the new one, never part of one; on any failure the temporary is
 * removed and an older file at <path> stays as it was.
 *
 *   tmd_atomic a;
 *   if (tmd_atomic_open(&a, path, err, errlen)) return ...;
 *   ... write to a.f (or tmd_atomic_write) ...
 *   if (writing failed) { tmd_atomic_abort(&a); return ...; }
 *   return tmd_atomic_commit(&a, err, errlen);
 *
 * Staging and publishing are separate steps so that several files can be completed before any
 * is renamed (tmd_atomic_stage on each, then tmd_atomic_publish on each): a failure while
 * staging then leaves every target as it was.
 *
 * Functions return 0, or TMD_RUNTIME_ERROR (an I/O failure) / TMD_CONFIG_ERROR (a path too
 * long, or not a directory), the codes of status.h, with a message in err naming the file and
 * the system error (strerror).
 */
#ifndef TMD_ATOMIC_H
#define TMD_ATOMIC_H

#include <stddef.h>
#include <stdio.h>

#define TMD_ATOMIC_PATH_MAX 4096

typedef struct tmd_atomic {
    FILE *f;                            /* open for writing between open and stage */
    int error;                          /* errno of the first failed tmd_atomic_write */
    char path[TMD_ATOMIC_PATH_MAX];     /* the target */
    char tmp[TMD_ATOMIC_PATH_MAX + 16]; /* the temporary ("" once published or removed) */
} tmd_atomic;

/* Create the temporary file for `path` (mode 0644: mkstemp's 0600 would hide ordinary output
 * from other users) and open a->f on it ("wb"). TMD_CONFIG_ERROR, touching nothing, when path
 * exists and is not a regular file (a device, a FIFO, a socket, a directory, a symbolic link):
 * renaming over it would replace it. On failure nothing is left to abort. */
int tmd_atomic_open(tmd_atomic *a, const char *path, char *err, size_t errlen);

/* fwrite n bytes to a->f; 0, or -1 after recording errno in a->error (the first failure's,
 * which is the one tmd_atomic_stage reports: a later fflush may fail differently or not at
 * all). */
int tmd_atomic_write(tmd_atomic *a, const void *p, size_t n);

/* Finish the temporary: fflush, check the stream's error flag, fsync, fclose. On failure the
 * temporary is removed ("cannot write '<path>' (via '<tmp>'): <error>"). */
int tmd_atomic_stage(tmd_atomic *a, char *err, size_t errlen);

/* Rename a staged temporary over the target, then fsync the target's directory. On failure the
 * temporary is removed and the target is untouched. */
int tmd_atomic_publish(tmd_atomic *a, char *err, size_t errlen);

/* tmd_atomic_stage, then tmd_atomic_publish. */
int tmd_atomic_commit(tmd_atomic *a, char *err, size_t errlen);

/* Close the stream if open and remove the temporary if it is still there. Safe on a failed,
 * published or aborted handle, so error paths may call it unconditionally. */
void tmd_atomic_abort(tmd_atomic *a);

/* mkdir -p: create `dir` and any missing parents (mode 0777 less the umask). TMD_CONFIG_ERROR
 * when dir is empty or too long, or exists and is not a directory; TMD_RUNTIME_ERROR when a
 * mkdir fails. */
int tmd_mkdirs(const char *dir, char *err, size_t errlen);

#endif
