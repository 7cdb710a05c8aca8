/*
 * rundir.h — the run directory (key `out`) of `tinymoe train`: whether a new run may use it,
 * what is cleaned and restored in it when the loop starts, and the checkpoint policy.
 *
 * One run at a time holds the directory (lock.h). A fresh run refuses a directory that holds
 * another run's checkpoints unless overwrite says to delete them. When the loop starts, temporaries of interrupted writes are removed, and a
 * resumed run's metrics.jsonl is cut back to the checkpoint's step (or carried over from the
 * checkpoint's directory). Checkpoints are <out>/ckpt-<step>.tmck; after each save only the
 * newest keep_last up to that step are kept, once the saved weights have proven finite.
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
/* Before the data is loaded: c->out must be a directory or creatable (not a file, not under
 * one: TMD_CONFIG_ERROR); an existing one is locked now (lock.h: another live run there is
 * refused at once) and checked with tmd_rundir_check_out_dir. Writes nothing but the lock file
 * into an existing directory. */
int tmd_rundir_claim(tmd_run *r, const tmd_config *c, char *err, size_t errlen);
/* Create out and lock it (if tmd_rundir_claim did not), remove stale temporaries (and, for a
 * fresh run with overwrite, the earlier checkpoints), restore metrics.jsonl up to step `start`
 * when resuming (whole records only: a torn last line is dropped), and open it in r->metrics.
 * Nothing (0) when out is empty. */
int tmd_rundir_open_outputs(tmd_run *r, int64_t start, char *err, size_t errlen);
/* Write <out>/ckpt-<done>.tmck (unless out is empty or this run already saved step `done`).
 * A model holding a non-finite weight is not saved: TMD_RUNTIME_ERROR naming the tensor. The
 * pruning this save calls for waits (r->prune_pending) for tmd_rundir_prune.
 *
 * With async_save (the default) the save first waits for the previous one's background write
 * (tmd_rundir_save_wait: its failure is this call's error), then copies the state to host
 * memory (tm_ckpt_snapshot_take into r->snap, allocated at the first save and kept: host
 * memory for one checkpoint, whatever the number of saves), which is all the loop waits for,
 * and starts a thread that writes the file (tm_ckpt_snapshot_write: the same temporary file,
 * fsync and rename, so a crash during it leaves the previous checkpoint). The log line of the
 * save comes when the write is complete: its size, the stall, the snapshot's host memory and
 * the write's time.
 * Under mpirun every rank snapshots and writes its own part (tm_ckpt_snapshot_*: its expert
 * shards and ZeRO blocks; rank 0 also the replicated tensors), each on its own thread, which
 * makes no collective call; the file is committed (rank 0 renames it) on the loop's thread, by
 * a collective at the first step after which every rank's part is written
 * (tmd_rundir_part_written, agreed with the stop signal), or at the next save, a stop or the end
 * of the run (tmd_rundir_save_wait). The log line then gives the largest snapshot of a rank. */
int tmd_rundir_save_checkpoint(tmd_run *r, int64_t done, char *err, size_t errlen);
/* Under mpirun: 1 when a background save is pending and this rank's part of it is written (its
 * writer thread has finished), else 0. No collective call. */
int tmd_rundir_part_written(const tmd_run *r);
/* Wait for the background write of the last save, if any: 0, or TMD_RUNTIME_ERROR with its
 * error. Under mpirun this commits the file (collective: every rank calls it at the same point;
 * a save calls it, and the loop before it reports the end of the run or a stop). */
int tmd_rundir_save_wait(tmd_run *r, char *err, size_t errlen);
/* At the end of tmd_train whatever happened: join a writer still running (after an error), so
 * that the process exits only with its file complete or removed. Returns rc, or, when rc is 0,
 * the writer's error; a writer's error after another one is printed to the log. No
 * collective call after an error (rc != 0): under mpirun a save not yet committed is then
 * dropped (its temporary file removed; the previous checkpoint stays). */
int tmd_rundir_finish(tmd_run *r, int rc, char *err, size_t errlen);
/* Keep the newest keep_last checkpoints up to the last save, if its pruning is pending. The
 * loop calls this once the weights of that save have given a finite loss (the next step), or
 * when the run ends without diverging: a divergence seen right after a save thus prunes
 * nothing, and the older checkpoints, whose weights are known to work, stay. A save being
 * written in the background is pruned for only once its file is complete. */
void tmd_rundir_prune(tmd_run *r);

#endif
