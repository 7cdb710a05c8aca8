/* rundir.c — the run directory (key `out`) of `tinymoe train`; see rundir.h. */
#include "rundir.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "atomic.h"
#include "checkpoint.h"
#include "log.h"
#include "plot.h"
#include "status.h"
#include "tinymoe.h"
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

/* Keep the newest keep_last checkpoints of out (0: all). Only ever called after a save
 * succeeded, so the newest file is complete before an older one goes. */
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

int tmd_rundir_save_checkpoint(tmd_run *r, int64_t done, char *err, size_t errlen) {
    if (!r->c.out[0] || r->saved_step == done) return 0;
    tmd_config c = r->c;
    /* The file describes the run, not how it was started. */
    c.resume[0] = c.init_from[0] = 0;
    tmd_ckpt_state st = {.step = done, .data_position = r->synth ? 0 : r->bt.position};
    size_t len = 0;
    char *meta = tmd_ckpt_meta_encode(&c, &st, &len);
    if (!meta) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory for the checkpoint meta");
    char path[TMD_PATH_MAX + 32];
    tmd_ckpt_path(r->c.out, done, path, sizeof path);
    double t0 = tmd_now_s();
    tm_status s = tm_ckpt_save(r->ctx, path, meta, len);
    free(meta);
    if (s) return tmd_run_lib_fail(r, err, errlen, "saving a checkpoint", s);
    r->saved_step = done;
    if (r->rank == 0) prune_checkpoints(r, done);
    if (r->log) {
        struct stat sb;
        if (r->tty) tmd_progress_clear(r->log);
        fprintf(r->log, "step %lld: saved %s (%.1f MB, %.2f s)\n", (long long)done, path,
                stat(path, &sb) ? 0.0 : (double)sb.st_size / 1e6, tmd_now_s() - t0);
        fflush(r->log);
    }
    return 0;
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
    char line[4096];
    while (fgets(line, sizeof line, in)) {
        double step = json_field(line, "step");
        if (!(step <= (double)upto)) continue;
        fputs(line, out.f);
        if (json_type_is(line, "train")) {
            double loss = json_field(line, "loss");
            if (isfinite(loss)) tmd_bins_add(&r->loss_bins, (int64_t)step - 1, &loss);
        } else if (json_type_is(line, "eval")) {
            double v = json_field(line, "val_loss");
            if (isfinite(v)) tmd_bins_add(&r->val_bins, (int64_t)step - 1, &v);
        }
    }
    fclose(in);
    return tmd_atomic_commit(&out, err, errlen) ? TMD_RUNTIME_ERROR : 0;
}

int tmd_rundir_open_outputs(tmd_run *r, int64_t start, char *err, size_t errlen) {
    if (!r->c.out[0] || r->rank != 0) return 0; /* rank 0 owns the run directory */
    char e[TMD_PATH_MAX + 256];
    if (tmd_mkdirs(r->c.out, e, sizeof e)) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "key 'out': %s", e);
    int rc;
    remove_stale_temporaries(r->c.out);
    if (start == 0 && r->c.overwrite) delete_checkpoints(r->c.out);
    snprintf(r->metrics_path, sizeof r->metrics_path, "%s/metrics.jsonl", r->c.out);
    if (start > 0 && (rc = restore_metrics(r, start, err, errlen))) return rc;
    r->metrics = fopen(r->metrics_path, start > 0 ? "a" : "w");
    if (!r->metrics)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot write '%s': %s", r->metrics_path, strerror(errno));
    return 0;
}
