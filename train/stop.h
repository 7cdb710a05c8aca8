/*
 * stop.h — how signals end a `tinymoe` run without losing it.
 *
 * While a run holds them (tmd_stop_catch ... tmd_stop_restore), SIGINT, SIGTERM and SIGHUP (a
 * closed terminal or a dropped ssh session: the run must not be lost with it) are stop
 * requests: the first is recorded (tmd_stop_signal) and the run stops at its next safe point
 * (after the current training step, between evaluation batches, between sampled tokens),
 * writes its checkpoint and returns 128 + the signal number. A second one is counted but does
 * nothing else: Ctrl-C pressed twice, or `timeout` / a scheduler sending TERM to the process
 * and then to its whole group, arrives during the save that the first one asked for, and the
 * save must finish. The third ends the process at once with the signal's default action (the
 * user insists; a checkpoint being written then is a temporary file, never a torn checkpoint).
 *
 * SIGPIPE and SIGXFSZ are ignored as well: a reader that went away (`| tee log` ended by the
 * same Ctrl-C) must not kill the run before it saves, and a file-size limit (ulimit -f) must
 * fail a write with EFBIG, reported like a full disk, rather than kill the process.
 * tmd_signals_ignore_io sets just those two, for commands that do not train.
 */
#ifndef TMD_STOP_H
#define TMD_STOP_H

#include <signal.h>

typedef struct tmd_stop_saved {
    struct sigaction intr, term, hup, pipe, xfsz;
} tmd_stop_saved;

/* Install the handlers above (clearing any earlier request); restore what was there (and
 * clear the request). */
void tmd_stop_catch(tmd_stop_saved *old);
void tmd_stop_restore(const tmd_stop_saved *old);

/* The first stop signal received since tmd_stop_catch (0: none), and how many arrived. */
int tmd_stop_signal(void);
int tmd_stop_count(void);

/* "SIGINT", "SIGTERM", "SIGHUP", or "signal N". */
const char *tmd_stop_name(int sig);

/* SIGPIPE and SIGXFSZ ignored for the rest of the process (the command-line driver). */
void tmd_signals_ignore_io(void);

#endif
