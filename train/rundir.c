/* rundir.c — the run directory (key `out`) of `tinymoe train`; see rundir.h. */
#include "rundir.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "atomic.h"
#include "checkpoint.h"
#include "finite.h"
#include "lock.h"
#include "log.h"
#include "plot.h"
#include "status.h"
#include "tinymoe.h"
#include "tokenizer.h"
#include "util.h"

/* Temporary files of writes that a crash or kill -9 interrupted: checkpoint saves
 * ("ckpt-*.tmck.tmp.XXXXXX") and the metrics rewrite of a resume ("metrics.jsonl.tmp.XXXXXX"). */
static void remove_stale_temporaries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char path[TMD_PATH_MAX + 300];
    while ((e = readdir(d)))
        if ((!strncmp(e->d_name, "ckpt-", 5) && strstr(e->d_name, TMD_CKPT_EXT ".tmp.")) ||
            !strncmp(e->d_name, "metrics.jsonl.tmp.", 18)) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
    closedir(d);
}

/* Keep the newest keep_last checkpoints of out up to step `done` (0: all). Only ever called
 * after a save succeeded, so the newest file is complete before an older one goes. */
static void prune_checkpoints(tmd_run *r, int64_t done) {
    if (r->c.keep_last <= 0) return;
    int64_t *steps;
    int n;
    char e[256], path[TMD_PATH_MAX + 32];
    if (tmd_ckpt_list(r->c.out, &steps, &n, e, sizeof e)) return;
    /* Only files up to the one just written count: a later step can only be there because
     * the user resumed from an earlier checkpoint on purpose, and it is theirs to delete. */
    int upto = 0;
    while (upto < n && steps[upto] <= done) upto++;
    for (int i = 0; i + r->c.keep_last < upto; i++) {
        tmd_ckpt_path(r->c.out, steps[i], path, sizeof path);
        unlink(path);
    }
    free(steps);
}

/* A fresh run must not mix its checkpoints with an earlier run's in the same directory
 * (`--resume DIR` picks the highest step, and pruning would delete the other run's files):
 * refuse, unless overwrite says to delete them. Called before anything is written. */
int tmd_rundir_check_out_dir(const tmd_config *c, char *err, size_t errlen) {
    struct stat sb;
    if (c->resume[0] || !c->out[0] || stat(c->out, &sb) || !S_ISDIR(sb.st_mode)) return 0;
    int64_t *steps;
    int n;
    char e[512];
    if (tmd_ckpt_list(c->out, &steps, &n, e, sizeof e)) return 0;
    int64_t newest = n ? steps[n - 1] : 0;
    free(steps);
    if (n == 0 || c->overwrite) return 0;
    return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                    "out = '%s' holds %d checkpoint%s of an earlier run (newest: step %lld); continue it with "
                    "--resume %s, write this run elsewhere with --out DIR, or pass --overwrite to delete them",
                    c->out, n, n > 1 ? "s" : "", (long long)newest, c->out);
}

/* The nearest existing ancestor of a path that does not exist, for "out is under a file". */
static int nearest_existing(const char *path, char *buf, size_t len, struct stat *sb) {
    if ((size_t)snprintf(buf, len, "%s", path) >= len) return -1;
    for (;;) {
        char *slash = strrchr(buf, '/');
        if (!slash) return stat(".", sb) == 0 ? (snprintf(buf, len, "."), 0) : -1;
        if (slash == buf) return stat("/", sb) == 0 ? (snprintf(buf, len, "/"), 0) : -1;
        *slash = 0;
        if (stat(buf, sb) == 0) return 0;
        if (errno != ENOENT && errno != ENOTDIR) return -1;
    }
}

int tmd_rundir_claim(tmd_run *r, const tmd_config *c, char *err, size_t errlen) {
    if (!c->out[0]) return 0;
    struct stat sb;
    if (stat(c->out, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode))
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                            "key 'out' = '%s' exists and is not a directory (give a directory for the checkpoints "
                            "and metrics)",
                            c->out);
        /* Under mpirun the ranks are one run: rank 0, which owns the directory, holds the lock. */
        int rc = tm_mpi_world_rank() == 0 ? tmd_lock_dir(&r->lock, c->out, err, errlen) : 0;
        if (rc) return rc;
        /* Appended to in place (not replaced atomically): it must be a file of ours. */
        char m[TMD_PATH_MAX + 32];
        snprintf(m, sizeof m, "%s/metrics.jsonl", c->out);
        if (lstat(m, &sb) == 0 && !S_ISREG(sb.st_mode))
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s' exists and is not a regular file: refusing to write it",
                            m);
    } else if (errno == ENOENT || errno == ENOTDIR) {
        char anc[TMD_PATH_MAX];
        if (nearest_existing(c->out, anc, sizeof anc, &sb) == 0 && !S_ISDIR(sb.st_mode))
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                            "key 'out' = '%s' cannot be created: '%s' is not a directory", c->out, anc);
    } else {
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "key 'out' = '%s': %s", c->out, strerror(errno));
    }
    return tmd_rundir_check_out_dir(c, err, errlen);
}

static void delete_checkpoints(const char *dir) {
    int64_t *steps;
    int n;
    char e[512], path[TMD_PATH_MAX + 32];
    if (tmd_ckpt_list(dir, &steps, &n, e, sizeof e)) return;
    for (int i = 0; i < n; i++) {
        tmd_ckpt_path(dir, steps[i], path, sizeof path);
        unlink(path);
    }
    free(steps);
}

/* ---- asynchronous saves ---------------------------------------------------------------- */

static void *bg_main(void *arg) {
    tmd_bgsave *bg = arg;
    double t0 = tmd_now_s();
    tm_status s = tm_ckpt_snapshot_write(bg->snap, bg->path, bg->threads);
    bg->status = s;
    if (s) snprintf(bg->msg, sizeof bg->msg, "%s", tm_ckpt_snapshot_errmsg(bg->snap));
    bg->write_s = tmd_now_s() - t0;
    atomic_store(&bg->done, 1);
    return NULL;
}

/* all: under mpirun, every rank's snapshot bytes and write time ([world][2]: bytes, us). */
static void log_saved(tmd_run *r, int64_t step, const char *path, double seconds, const tmd_bgsave *bg,
                      const int64_t *all) {
    if (!r->log) return;
    struct stat sb;
    double mb = stat(path, &sb) ? 0.0 : (double)sb.st_size / 1e6;
    char wait[96] = "";
    if (bg && bg->wait_s >= 0.0005)
        snprintf(wait, sizeof wait, ", %.3f s of it waiting for the previous write", bg->wait_s);
    if (r->tty) tmd_progress_clear(r->log);
    if (bg && all) {
        double most = 0, sum = 0, slowest = 0;
        for (int q = 0; q < r->world; q++) {
            double b = (double)all[2 * q] / 1e6, w = (double)all[2 * q + 1] / 1e6;
            most = b > most ? b : most;
            slowest = w > slowest ? w : slowest;
            sum += b;
        }
        fprintf(r->log,
                "step %lld: saved %s (%.1f MB; training stalled %.3f s for the snapshot%s, %.1f MB of host memory per "
                "rank at most (rank 0: %.1f MB; %.1f MB on the %d ranks); every rank wrote its part in the background, "
                "the slowest in %.2f s; committed in %.3f s)\n",
                (long long)step, path, mb, bg->stall_s + bg->wait_s, wait, most, (double)all[0] / 1e6, sum, r->world,
                slowest, bg->commit_s);
    } else if (bg)
        fprintf(r->log,
                "step %lld: saved %s (%.1f MB; training stalled %.3f s for the snapshot, %.1f MB of host memory%s; "
                "written in the background in %.2f s)\n",
                (long long)step, path, mb, bg->stall_s + bg->wait_s, (double)tm_ckpt_snapshot_bytes(r->snap) / 1e6,
                wait, bg->write_s);
    else
        fprintf(r->log, "step %lld: saved %s (%.1f MB, %.2f s)\n", (long long)step, path, mb, seconds);
    tmd_run_log_flush(r);
}

/* Join the writer (rank 0; it has finished or is about to), report a success in the log and do
 * the pruning that waited for the file; a failure waits in bg->failed for tmd_rundir_save_wait. */
static void bg_join(tmd_run *r) {
    tmd_bgsave *bg = &r->bg;
    if (!bg->active) return;
    pthread_join(bg->thread, NULL);
    bg->active = 0;
    if (bg->status == TM_OK) {
        log_saved(r, bg->step, bg->path, 0, bg, NULL);
        if (r->prune_proven == bg->step) {
            prune_checkpoints(r, bg->step);
            r->prune_proven = -1;
        }
    } else {
        bg->failed = 1;
        /* The file was not written: nothing is pruned for it. */
        if (r->prune_pending == bg->step) r->prune_pending = -1;
        if (r->prune_proven == bg->step) r->prune_proven = -1;
    }
}

/* Under mpirun (collective: every rank at the same point, so `pending` is the same on every
 * rank): join this rank's writer, commit the file (rank 0 renames it once every rank's part is
 * written and fsynced), report it and do the pruning that waited for it. A failure, the same on
 * every rank, waits in bg->failed for tmd_rundir_save_wait. */
static void bg_commit(tmd_run *r) {
    tmd_bgsave *bg = &r->bg;
    if (!bg->pending) return;
    if (bg->active) pthread_join(bg->thread, NULL), bg->active = 0;
    double t0 = tmd_now_s();
    tm_status s = tm_ckpt_snapshot_commit(r->snap);
    bg->commit_s = tmd_now_s() - t0;
    bg->pending = 0;
    /* The log's figures, every rank's host memory and write time: an all-gather that every rank
     * makes (s is the same on every rank), into memory that cannot fail for up to 256 ranks. */
    int64_t mine[2] = {(int64_t)tm_ckpt_snapshot_bytes(r->snap), (int64_t)(bg->write_s * 1e6)}, few[2 * 256];
    int64_t *all = r->world <= 256 ? few : s == TM_OK ? malloc(sizeof mine * (size_t)r->world) : NULL;
    if (s == TM_OK && (!all || tm_comm_allgather_host(r->ctx, TM_COMM_WORLD, mine, all, sizeof mine) != TM_OK)) {
        if (all != few) free(all);
        all = NULL;
    }
    if (s == TM_OK) {
        log_saved(r, bg->step, bg->path, 0, bg, all);
        if (r->prune_proven == bg->step) {
            if (r->rank == 0) prune_checkpoints(r, bg->step);
            r->prune_proven = -1;
        }
    } else {
        bg->failed = 1;
        bg->status = s;
        snprintf(bg->msg, sizeof bg->msg, "%s", tm_ctx_errmsg(r->ctx));
        if (r->prune_pending == bg->step) r->prune_pending = -1;
        if (r->prune_proven == bg->step) r->prune_proven = -1;
    }
    if (all != few) free(all);
}

int tmd_rundir_part_written(const tmd_run *r) {
    return r->bg.pending && (!r->bg.active || atomic_load(&r->bg.done));
}

int tmd_rundir_save_wait(tmd_run *r, char *err, size_t errlen) {
    tmd_bgsave *bg = &r->bg;
    if (r->world > 1) bg_commit(r);
    else bg_join(r);
    if (!bg->failed) return 0;
    bg->failed = 0;
    return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "writing the checkpoint of step %lld in the background: %s",
                    (long long)bg->step, bg->msg);
}

int tmd_rundir_finish(tmd_run *r, int rc, char *err, size_t errlen) {
    if (r->world > 1 && r->bg.pending && rc) {
        /* After a failure the other ranks may be gone or elsewhere: no collective, no commit.
         * The temporary file goes with the snapshot (tm_ckpt_snapshot_free); the previous
         * checkpoint stays the newest. */
        if (r->bg.active) pthread_join(r->bg.thread, NULL), r->bg.active = 0;
        r->bg.pending = 0;
        if (r->log) {
            fprintf(r->log, "also: the checkpoint of step %lld, being written in the background, was dropped (a failed "
                    "run under mpirun commits no file)\n", (long long)r->bg.step);
            fflush(r->log);
        }
    } else if (r->world > 1) {
        bg_commit(r); /* (the ends of the run commit before this: nothing is pending here) */
    } else {
        bg_join(r);
    }
    if (!r->bg.failed) return rc;
    r->bg.failed = 0;
    if (!rc)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "writing the checkpoint of step %lld in the background: %s",
                        (long long)r->bg.step, r->bg.msg);
    FILE *f = r->log ? r->log : stderr;
    fprintf(f, "also: writing the checkpoint of step %lld in the background: %s\n", (long long)r->bg.step, r->bg.msg);
    fflush(f);
    return rc;
}

/* Snapshot the state at step `done` (the stall) and start its write on a thread. */
/* The driver's test hook: TINYMOE_CKPT_TEST_DELAY_MS=N holds every save's temporary file open
 * N ms longer (tm_ckpt_save_options.before_commit), so that tests land kills and signals inside
 * a save whatever the machine's speed. Unset (always, outside the tests): no hook. */
static void hold_save_open(const char *tmp_path, void *user) {
    (void)tmp_path;
    long ms = (long)(intptr_t)user;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static tm_ckpt_save_options save_options(void) {
    tm_ckpt_save_options o = tm_ckpt_save_options_default();
    const char *v = getenv("TINYMOE_CKPT_TEST_DELAY_MS");
    long ms = v ? strtol(v, NULL, 10) : 0;
    if (ms > 0) o.before_commit = hold_save_open, o.user = (void *)(intptr_t)ms;
    return o;
}

/* The snapshot of step `done` (the stall) and its write started on a thread, on every rank.
 * The previous save has been waited for (tmd_rundir_save_checkpoint). */
static int save_async(tmd_run *r, int64_t done, const char *path, const char *meta, size_t len, char *err,
                      size_t errlen) {
    tmd_bgsave *bg = &r->bg;
    double t0 = tmd_now_s();
    tm_status s = TM_OK;
    if (!r->snap) {
        tm_ckpt_save_options so = save_options();
        s = tm_ckpt_snapshot_new(r->ctx, &so, &r->snap);
        if (s == TM_ERR_NOMEM)
            return tmd_fail(err, errlen, TMD_RUNTIME_ERROR,
                            "async_save: no host memory for a snapshot of the training state (%s); run with "
                            "--async_save false to save without one",
                            tm_ctx_errmsg(r->ctx));
        if (s) return tmd_run_lib_fail(r, err, errlen, "allocating a checkpoint snapshot", s);
    }
    s = tm_ckpt_snapshot_take(r->snap, meta, len);
    if (s) return tmd_run_lib_fail(r, err, errlen, "taking a checkpoint snapshot", s);
    bg->stall_s = tmd_now_s() - t0;
    bg->snap = r->snap;
    bg->step = done;
    snprintf(bg->path, sizeof bg->path, "%s", path);
    /* The writer thread does only file I/O: one thread on the CPU, where training has the cores;
     * with a GPU training the host is idle, and every thread of the context checksums and writes. */
    bg->threads = r->dev.type == TM_DEVICE_CUDA ? 0 : 1;
    bg->status = TM_OK;
    bg->msg[0] = 0;
    bg->write_s = 0;
    bg->commit_s = 0;
    atomic_store(&bg->done, 0);
    /* Under mpirun every rank writes its part; the file is committed (collectively, on this
     * thread) once every rank's part is written: tmd_rundir_part_written, tmd_rundir_save_wait. */
    bg->pending = r->world > 1;
    /* The stop signals go to the loop's thread (stop.h): blocked in the writer, which inherits
     * the mask in force when it is created. */
    sigset_t stop, old;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &stop, &old);
    int e = pthread_create(&bg->thread, NULL, bg_main, bg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e) {
        /* No thread: write it here, synchronously (under mpirun, this rank's part: the commit
         * follows with the other ranks'). */
        bg_main(bg);
        if (r->world > 1) return 0;
        if (bg->status)
            return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "saving a checkpoint: %s", bg->msg);
        log_saved(r, done, path, 0, bg, NULL);
        return 0;
    }
    bg->active = 1;
    return 0;
}

int tmd_rundir_save_checkpoint(tmd_run *r, int64_t done, char *err, size_t errlen) {
    if (!r->c.out[0] || r->saved_step == done) return 0;
    /* One snapshot at a time: the previous write ends (under mpirun, is committed) first, also
     * when this save is refused below. */
    double tw = tmd_now_s();
    int wrc = tmd_rundir_save_wait(r, err, errlen);
    if (wrc) return wrc;
    r->bg.wait_s = tmd_now_s() - tw;
    /* The last line of defence against a diverged run passing for progress: the update of the
     * step just done may have overflowed a weight with a finite loss and gradient norm (weight
     * decay at an absurd lr). Such a checkpoint is not written, and so prunes nothing. */
    tmd_nonfinite bad;
    int nf = tmd_find_nonfinite(r->ctx, 0, &bad, err, errlen);
    if (nf < 0) return TMD_RUNTIME_ERROR;
    if (nf == 1) {
        char d[256], prev[TMD_PATH_MAX + 64] = "no earlier checkpoint of this run";
        tmd_nonfinite_describe(&bad, d, sizeof d);
        if (r->saved_step >= 0) {
            char p[TMD_PATH_MAX + 32];
            tmd_ckpt_path(r->c.out, r->saved_step, p, sizeof p);
            snprintf(prev, sizeof prev, "the newest checkpoint is %s", p);
        }
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR,
                        "the weights are no longer finite after step %lld (%s): the run diverged; no checkpoint of it "
                        "is written and none is pruned (%s). Try a lower lr or grad_clip",
                        (long long)done, d, prev);
    }
    tmd_config c = r->c;
    /* The file describes the run, not how it was started. */
    c.resume[0] = c.init_from[0] = 0;
    c.notes[0] = 0;
    tmd_ckpt_state st = {.step = done, .data_position = r->synth ? 0 : r->bt.position, .data = r->data_id};
    size_t len = 0;
    char *meta = tmd_ckpt_meta_encode(&c, &st, &len);
    if (!meta) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory for the checkpoint meta");
    char path[TMD_PATH_MAX + 32];
    tmd_ckpt_path(r->c.out, done, path, sizeof path);
    double t0 = tmd_now_s();
    if (r->c.async_save) {
        int rc = save_async(r, done, path, meta, len, err, errlen);
        free(meta);
        if (rc) return rc;
    } else {
        tm_ckpt_save_options so = save_options();
        tm_status s = tm_ckpt_save_ex(r->ctx, path, meta, len, &so);
        free(meta);
        if (s) return tmd_run_lib_fail(r, err, errlen, "saving a checkpoint", s);
        log_saved(r, done, path, tmd_now_s() - t0, NULL, NULL);
    }
    r->saved_step = done;
    /* Not pruned yet: finite weights may still be garbage, and only the next step's loss says
     * so. The older checkpoints go once that loss is finite (tmd_rundir_prune), or the run ends
     * another way; a run that diverges right after this save keeps them all. An asynchronous
     * save prunes only once its file is complete as well. */
    r->prune_pending = done;
    return 0;
}

void tmd_rundir_prune(tmd_run *r) {
    if (r->prune_pending >= 0) {
        r->prune_proven = r->prune_pending;
        r->prune_pending = -1;
    }
    if (r->world == 1 && r->bg.active && atomic_load(&r->bg.done)) bg_join(r); /* may prune */
    if (r->prune_proven < 0) return;
    /* once the file is complete (bg_join; under mpirun, bg_commit) */
    if ((r->bg.active || r->bg.pending) && r->bg.step == r->prune_proven) return;
    if (r->rank == 0) prune_checkpoints(r, r->prune_proven);
    r->prune_proven = -1;
}

/* The text after `"key":` in a metrics line (tmd_json writes `"key": value`), or NULL. */
static const char *json_value(const char *line, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\"", key);
    const char *p = strstr(line, pat);
    if (!p) return NULL;
    p += strlen(pat);
    while (*p == ' ') p++;
    if (*p++ != ':') return NULL;
    while (*p == ' ') p++;
    return p;
}

static double json_field(const char *line, const char *key) {
    const char *v = json_value(line, key);
    return v ? strtod(v, NULL) : NAN;
}

static int json_type_is(const char *line, const char *type) {
    const char *v = json_value(line, "type");
    size_t n = strlen(type);
    return v && v[0] == '"' && !strncmp(v + 1, type, n) && v[n + 1] == '"';
}

/* On resume, metrics.jsonl keeps the records up to the checkpoint's step (a run killed after
 * its last checkpoint logged steps that will now be trained again) and the plots get them
 * back; a run resumed into a new out directory starts from the checkpoint run's records. The file is rewritten atomically (atomic.h), then opened for appending. */
static int restore_metrics(tmd_run *r, int64_t upto, char *err, size_t errlen) {
    FILE *in = fopen(r->metrics_path, "r");
    if (!in) {
        /* Resuming into another directory: carry over the history of the checkpoint's run. */
        char src[TMD_PATH_MAX + 32];
        const char *slash = strrchr(r->resume_path, '/');
        if (slash) snprintf(src, sizeof src, "%.*s/metrics.jsonl", (int)(slash - r->resume_path), r->resume_path);
        else snprintf(src, sizeof src, "metrics.jsonl");
        in = fopen(src, "r");
    }
    if (!in) return 0; /* none: start a new one */
    tmd_atomic out;
    if (tmd_atomic_open(&out, r->metrics_path, err, errlen)) {
        fclose(in);
        return TMD_RUNTIME_ERROR;
    }
    /* Only whole records are kept: a run killed in the middle of a write leaves a last line
     * without its newline (and its closing brace), which a reader of the file would choke on. */
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    /* A train record is the mean of its interval: each of the interval's steps gets it, so the
     * plot's bins see as many points before the resume as after (not one per log_every steps);
     * likewise an experts record's loads. The clock goes on from the last record kept. */
    int64_t last_train = 0, last_experts = 0, nl = r->iv_load ? (int64_t)r->n_moe * r->E : 0;
    double *load = nl ? malloc(sizeof *load * (size_t)nl) : NULL;
    while ((n = getline(&line, &cap, in)) > 0) {
        if (line[n - 1] != '\n' || n < 3 || line[0] != '{' || line[n - 2] != '}') continue;
        double step = json_field(line, "step");
        if (!(step <= (double)upto)) continue;
        fputs(line, out.f);
        if (json_type_is(line, "train")) {
            double loss = json_field(line, "loss"), el = json_field(line, "elapsed_s");
            if (isfinite(loss))
                for (int64_t s = last_train + 1; s <= (int64_t)step; s++) tmd_bins_add(&r->loss_bins, s - 1, &loss);
            if (isfinite(el) && el >= 0) r->elapsed0 = el;
            last_train = (int64_t)step;
        } else if (json_type_is(line, "experts") && load) {
            const char *p = json_value(line, "load");
            int64_t k = 0;
            if (p && *p == '[') {
                p++;
                for (char *end; k < nl; k++, p = end) {
                    while (*p == ' ' || *p == ',') p++;
                    load[k] = strtod(p, &end);
                    if (end == p) break;
                }
            }
            if (k == nl) /* a record of another model (resumed into a new layout) is skipped */
                for (int64_t s = last_experts + 1; s <= (int64_t)step; s++) tmd_bins_add(&r->load_bins, s - 1, load);
            last_experts = (int64_t)step;
        } else if (json_type_is(line, "eval")) {
            double v = json_field(line, "val_loss");
            if (isfinite(v)) tmd_bins_add(&r->val_bins, (int64_t)step - 1, &v);
        }
    }
    free(line);
    free(load);
    fclose(in);
    return tmd_atomic_commit(&out, err, errlen) ? TMD_RUNTIME_ERROR : 0;
}

int tmd_rundir_open_outputs(tmd_run *r, int64_t start, char *err, size_t errlen) {
    if (r->rank != 0) return 0; /* rank 0 owns the run directory */
    if (r->c.tensorboard[0] && tmd_tb_open(&r->tb, r->c.tensorboard, start, err, errlen)) return TMD_RUNTIME_ERROR;
    if (!r->c.out[0]) return 0;
    char e[TMD_PATH_MAX + 256];
    if (tmd_mkdirs(r->c.out, e, sizeof e)) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "key 'out': %s", e);
    int rc;
    /* Held already when out existed (tmd_rundir_claim); a new directory is locked before the
     * first file goes in, and before the temporaries are swept (a live run's are not stale). */
    if ((rc = tmd_lock_dir(&r->lock, r->c.out, err, errlen))) return rc;
    remove_stale_temporaries(r->c.out);
    if (start == 0 && r->c.overwrite) delete_checkpoints(r->c.out);
    /* The run's tokenizer goes with its checkpoints: sample and export find it there. */
    if (r->bpe && (rc = tmd_tokenizer_copy(r->tokenizer_path, r->c.out, err, errlen))) return rc;
    snprintf(r->metrics_path, sizeof r->metrics_path, "%s/metrics.jsonl", r->c.out);
    if (start > 0 && (rc = restore_metrics(r, start, err, errlen))) return rc;
    r->metrics = fopen(r->metrics_path, start > 0 ? "a" : "w");
    if (!r->metrics)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot write '%s': %s", r->metrics_path, strerror(errno));
    return 0;
}
