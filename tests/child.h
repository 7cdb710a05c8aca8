/*
 * child.h — running the `tinymoe` binary in a child process, for the tests of what only a
 * process shows: signals, closed pipes, file-size limits, exit statuses, the out-directory lock.
 *
 * The binary is the one built beside the test binary (build/tinymoe next to
 * build/tinymoe_tests, build-san/ under SAN=1), so a test exercises main.c as users run it.
 */
#ifndef TT_CHILD_H
#define TT_CHILD_H

#include <sys/types.h>

typedef struct tt_child {
    pid_t pid;
    int out_fd; /* read end of the child's stdout + stderr when started with a pipe, else -1 */
} tt_child;

/* The tinymoe binary beside this test binary (asserts it exists). */
const char *tt_tinymoe(void);

/* Start argv (argv[0] is looked up with execvp; NULL-terminated) in its own process group
 * (so a signal to -pid reaches it and whatever it starts, as Ctrl-C reaches a pipeline).
 * stdout and stderr go to out_path (truncated), or to a pipe (out_path NULL: read out_fd).
 * fsize_limit > 0: RLIMIT_FSIZE in bytes. */
tt_child tt_spawn(char *const *argv, const char *out_path, long fsize_limit);

/* Start argv on a new pseudo-terminal of cols x rows (its stdin, stdout and stderr; the child
 * leads its own session and process group), with TERM=xterm and none of the variables by which
 * MPI launchers and Slurm mark their ranks, as a user's terminal has. out_fd: the terminal's
 * master side. */
tt_child tt_spawn_pty(char *const *argv, int cols, int rows);

/* Everything the child writes on out_fd until it closes it (EOF, or EIO once a pseudo-
 * terminal's child is gone), up to `seconds`; then waits for the child. A malloc'd,
 * NUL-terminated buffer; *status (may be NULL) gets the exit code as tt_run gives it. */
char *tt_capture(tt_child *c, double seconds, int *status);

/* Wait up to `seconds` for the child: its wait status, or -1 after killing it (SIGKILL to
 * the group) when it did not end in time. */
int tt_wait(tt_child *c, double seconds);

/* Run to completion (at most `seconds`), stdout + stderr into out_path: the exit code, 128 +
 * the signal if one killed it, or -1 on timeout. *elapsed (may be NULL) gets the seconds. */
int tt_run(char *const *argv, const char *out_path, double seconds, double *elapsed);

/* Poll until `path` exists and holds `text` (NULL: any content), up to `seconds`: 1, or 0. */
int tt_wait_for_text(const char *path, const char *text, double seconds);

/* Seconds on the monotonic clock. */
double tt_now(void);

/* SIGKILL the process group of every child started with tt_spawn and not yet waited for (a
 * test that failed half-way must not leave a training run behind): call from a suite's fini. */
void tt_kill_children(void);

#endif
