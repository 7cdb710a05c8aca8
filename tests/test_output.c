/*
 * test_output.c — what `tinymoe train` prints where (issue 23, output): on a user's terminal the
 * step table with a progress bar under it that fits the terminal's width (80 and 40 columns);
 * into a pipe, or on a pseudo-terminal that a launcher made (Open MPI's variables set), the table
 * alone without a carriage return or an escape sequence; `--progress bar|lines` forcing either;
 * and an Open MPI launch redirected to a file (skipped without mpirun).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "child.h"
#include "common.h"

#define TRAIN "train", "--preset", "tiny", "--steps", "40", "--log_every", "10", "--eval_every", "0", \
              "--sample_tokens", "0", "--out", ""

/* The widest progress-bar redraw: the text between a carriage return and the erase-to-end-of-
 * line that closes it (the step table's rows are records, printed once; a terminal narrower
 * than them wraps them, as it wraps any long line; the redraws must fit or each leaves a row
 * behind). -1 when there is none. */
static int widest_bar(const char *out) {
    int best = -1;
    for (const char *p = strchr(out, '\r'); p; p = strchr(p + 1, '\r')) {
        const char *e = strstr(p + 1, "\033[K"), *q = p + 1;
        if (!e) break;
        while (q < e && *q != '\r' && *q != '\n') q++;
        if (q < e || e == p + 1) continue;
        if ((int)(e - p - 1) > best) best = (int)(e - p - 1);
    }
    return best;
}

static void assert_table(const char *out) {
    cr_assert(strstr(out, "   step     loss"), "no step table header in:\n%s", out);
    cr_assert(strstr(out, "\n     40 ") || strstr(out, "\r     40 ") || strstr(out, "K     40 "),
              "no row for step 40 in:\n%s", out);
    cr_assert(strstr(out, "\n     10 ") || strstr(out, "K     10 "), "no row for step 10 in:\n%s", out);
}

static char *on_pty(int cols) {
    char *argv[] = {(char *)tt_tinymoe(), TRAIN, NULL};
    tt_child c = tt_spawn_pty(argv, cols, 24);
    int st;
    char *out = tt_capture(&c, 60, &st);
    cr_assert_eq(st, 0, "exit %d:\n%s", st, out);
    return out;
}

Test(output, a_terminal_gets_the_table_and_a_bar_that_fits_80_columns) {
    char *out = on_pty(80);
    assert_table(out);
    cr_assert(strstr(out, "\033[K"), "no progress bar drawn on a terminal:\n%s", out);
    cr_assert(strstr(out, "40/40 ["), "the bar lacks its step count and cells:\n%s", out);
    int w = widest_bar(out);
    cr_assert(w > 40, "no full-width bar (widest %d) on an 80-column terminal:\n%s", w, out);
    cr_assert_leq(w, 79, "a bar of %d columns on an 80-column terminal:\n%s", w, out);
    free(out);
}

/* A narrow terminal: the bar drops its less important fields instead of wrapping. */
Test(output, the_bar_narrows_with_the_terminal) {
    char *out = on_pty(40);
    cr_assert(strstr(out, "\033[K"), "no progress bar:\n%s", out);
    int w = widest_bar(out);
    cr_assert(w > 0 && w <= 39, "a bar of %d columns on a 40-column terminal:\n%s", w, out);
    cr_assert(strstr(out, "40/40"), "the step count is gone:\n%s", out);
    free(out);
}

Test(output, a_pipe_gets_the_table_alone) {
    char *argv[] = {(char *)tt_tinymoe(), TRAIN, NULL};
    tt_child c = tt_spawn(argv, NULL, 0);
    int st;
    char *out = tt_capture(&c, 60, &st);
    cr_assert_eq(st, 0, "exit %d:\n%s", st, out);
    assert_table(out);
    cr_assert_null(strchr(out, '\r'), "a carriage return in piped output:\n%s", out);
    cr_assert_null(strchr(out, '\033'), "an escape sequence in piped output:\n%s", out);
    free(out);
}

/* A pseudo-terminal made by a launcher (Open MPI hands one to each rank; its variables mark it). */
Test(output, a_launchers_terminal_gets_the_table_alone) {
    /* (an MPI launch leaves Open MPI's own allocations at exit: no leak check for it under
     * SAN=1, as tests/test_dist.c does) */
    char *argv[] = {"/usr/bin/env", "OMPI_COMM_WORLD_SIZE=1", "ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0",
                    (char *)tt_tinymoe(), TRAIN, NULL};
    tt_child c = tt_spawn_pty(argv, 80, 24);
    int st;
    char *out = tt_capture(&c, 60, &st);
    cr_assert_eq(st, 0, "exit %d:\n%s", st, out);
    assert_table(out);
    cr_assert_null(strstr(out, "\033[K"), "a progress bar under a launcher:\n%s", out);
    free(out);
}

Test(output, progress_bar_and_lines_force_either) {
    char *argv[] = {(char *)tt_tinymoe(), TRAIN, "--progress", "bar", NULL};
    tt_child c = tt_spawn(argv, NULL, 0);
    int st;
    char *out = tt_capture(&c, 60, &st);
    cr_assert_eq(st, 0, "exit %d:\n%s", st, out);
    assert_table(out);
    cr_assert(strstr(out, "\033[K"), "--progress bar into a pipe drew no bar:\n%s", out);
    free(out);
    char *argv2[] = {(char *)tt_tinymoe(), TRAIN, "--progress", "lines", NULL};
    c = tt_spawn_pty(argv2, 80, 24);
    out = tt_capture(&c, 60, &st);
    cr_assert_eq(st, 0, "exit %d:\n%s", st, out);
    assert_table(out);
    cr_assert_null(strstr(out, "\033[K"), "--progress lines on a terminal drew a bar:\n%s", out);
    free(out);
}

/* The cluster habit: mpirun ... > train.log. */
Test(output, an_open_mpi_launch_into_a_file_gets_the_table_alone) {
    if (system("command -v mpirun >/dev/null 2>&1")) cr_skip_test("mpirun is not installed");
    tt_tmpdir_make("tinymoe_output_");
    char log[1024];
    snprintf(log, sizeof log, "%s", tt_path("train.log"));
    char *argv[] = {"/usr/bin/env", "ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0", "mpirun", "--oversubscribe",
                    "--allow-run-as-root", "-np", "2", (char *)tt_tinymoe(), TRAIN, NULL};
    int rc = tt_run(argv, log, 120, NULL);
    long len;
    char *out = (char *)tt_slurp(log, &len);
    cr_assert_eq(rc, 0, "exit %d:\n%s", rc, out);
    assert_table(out);
    cr_assert_null(strstr(out, "\033[K"), "progress-bar frames in the log file:\n%s", out);
    free(out);
    tt_tmpdir_remove();
}
