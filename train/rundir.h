/*
 * rundir.h — the run directory (key `out`) of `tinymoe train`: whether a new run may use it,
 * what is cleaned and restored in it when the loop starts, and the checkpoint policy.
 *
 * A fresh run refuses a directory that holds another run's checkpoints unless overwrite says
 * to delete them. When the loop starts, temporaries of interrupted writes are removed, and a
 * resumed run's metrics.jsonl is cut back to the checkpoint's step (or carried over from the
 * checkpoint's directory). Checkpoints are <out>/ckpt-<step>.tmck; after each save only the
 * newest keep_last up to that step are kept.
 */
#ifndef TMD_RUNDIR_H
#define TMD_RUNDIR_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "run.h"

/* A fresh run (no resume) must not mix its checkpoints with an earlier run's in c->out:
 * TMD_CONFIG_ERROR saying how to resume it, unless c->overwrite. Writes nothing. */
int tmd_rundir_check_out_dir(const tmd_config *c, char *err, size_t errlen);
/* Create out, remove stale temporaries (and, for a fresh run with overwrite, the earlier
 * checkpoints), restore metrics.jsonl up to step `start` when resuming, and open it in
 * r->metrics. Nothing (0) when out is empty. */
int tmd_rundir_open_outputs(tmd_run *r, int64_t start, char *err, size_t errlen);
/* Write <out>/ckpt-<done>.tmck (unless out is empty or this run already saved step `done`),
 * then prune to the newest keep_last. */
int tmd_rundir_save_checkpoint(tmd_run *r, int64_t done, char *err, size_t errlen);

#endif
