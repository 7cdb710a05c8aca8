/*
 * test_cli.c — what `tinymoe eval` and `tinymoe plan` print for scripts and at scale (issue 23,
 * item 8): `eval --json` is one JSON object whose loss equals the in-process evaluation's,
 * `eval --quiet` one line; `plan` without --ranks says what to give (exit 2); at 64 ranks its
 * rank classes cover every rank once, --per-rank prints every rank, and the summary names the
 * dispatch and parameter all-gather traffic.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "child.h"
#include "common.h"
#include "config.h"
#include "status.h"
#include "train.h"

static char *run_out(char *const *argv, int *rc) {
    tt_child c = tt_spawn(argv, NULL, 0);
    return tt_capture(&c, 120, rc);
}

Test(cli, eval_json_is_one_object_with_the_loss) {
    char *argv[] = {(char *)tt_tinymoe(), "eval", "--preset", "tiny", "--json", NULL};
    int rc;
    char *out = run_out(argv, &rc);
    cr_assert_eq(rc, 0, "exit %d:\n%s", rc, out);
    cr_assert_eq(out[0], '{', "not a JSON object first:\n%s", out);
    char *nl = strchr(out, '\n');
    cr_assert(nl && nl[1] == 0, "more than one line:\n%s", out);
    const char *l = strstr(out, "\"loss\": ");
    cr_assert_not_null(l, "%s", out);
    double got = strtod(l + 8, NULL);
    /* the same evaluation in this process */
    tmd_config c;
    char err[1024];
    char *args[] = {"--preset", "tiny"};
    int help = 0;
    cr_assert_eq(tmd_config_from_args(&c, 2, args, &help, err, sizeof err), 0, "%s", err);
    double want;
    cr_assert_eq(tmd_eval(&c, NULL, &want, err, sizeof err), TMD_OK, "%s", err);
    cr_assert_float_eq(got, want, 1e-12 * (1 + want), "--json loss %.17g, in-process %.17g", got, want);
    cr_assert(strstr(out, "\"perplexity\": ") && strstr(out, "\"tokens\": "), "%s", out);
    free(out);
}

Test(cli, eval_quiet_prints_the_result_line_alone) {
    char *argv[] = {(char *)tt_tinymoe(), "eval", "--preset", "tiny", "--quiet", NULL};
    int rc;
    char *out = run_out(argv, &rc);
    cr_assert_eq(rc, 0, "exit %d:\n%s", rc, out);
    cr_assert_eq(strncmp(out, "loss ", 5), 0, "%s", out);
    cr_assert(strstr(out, "perplexity"), "%s", out);
    char *nl = strchr(out, '\n');
    cr_assert(nl && nl[1] == 0, "more than one line:\n%s", out);
    free(out);
}

Test(cli, plan_without_ranks_says_what_to_give) {
    char *argv[] = {(char *)tt_tinymoe(), "plan", "--preset", "tiny", NULL};
    int rc;
    char *out = run_out(argv, &rc);
    cr_assert_eq(rc, TMD_CONFIG_ERROR, "exit %d:\n%s", rc, out);
    cr_assert(strstr(out, "give --ranks N"), "%s", out);
    cr_assert_null(strstr(out, "--ranks 0"), "%s", out);
    free(out);
}

Test(cli, plan_at_64_ranks_shows_every_rank) {
    char *argv[] = {(char *)tt_tinymoe(), "plan", "--preset", "small", "--num_experts", "64", "--batch_size", "64",
                    "--ranks", "64", "--ep_size", "8", "--zero", "1", NULL};
    int rc;
    char *out = run_out(argv, &rc);
    cr_assert_eq(rc, 0, "exit %d:\n%s", rc, out);
    /* the classes' rank counts add up to 64, each rank once */
    int total = 0;
    for (const char *p = strstr(out, "  ranks "); p; p = strstr(p + 1, "  ranks ")) {
        const char *n = strchr(p, '(');
        cr_assert_not_null(n, "%s", p);
        total += atoi(n + 1);
    }
    cr_assert_eq(total, 64, "classes cover %d of 64 ranks:\n%s", total, out);
    const char *sum = strstr(out, "largest rank");
    cr_assert(sum && strstr(sum, "MoE dispatch") && strstr(sum, "parameter all-gather"), "%s", out);
    cr_assert_null(strstr(sum, "dispatch 0 B"), "no dispatch traffic with ep_size 8:\n%s", out);
    free(out);
    char *argv2[] = {(char *)tt_tinymoe(), "plan", "--preset", "small", "--num_experts", "64", "--batch_size", "64",
                     "--ranks", "64", "--ep_size", "8", "--zero", "1", "--per-rank", NULL};
    out = run_out(argv2, &rc);
    cr_assert_eq(rc, 0, "exit %d:\n%s", rc, out);
    int rows = 0;
    for (const char *p = strstr(out, "  rank "); p; p = strstr(p + 1, "  rank ")) rows++;
    cr_assert_eq(rows, 64, "%d per-rank rows:\n%s", rows, out);
    free(out);
}

/* Ranks of one node left unbound share its CPUs instead of each taking all of them: under
 * mpirun -np 2 each rank runs max(1, CPUs / 2) threads by default (bound by Open MPI or not:
 * a rank bound to one CPU is widened to the same share). */
Test(cli, ranks_of_a_node_share_its_cpus) {
    if (system("command -v mpirun >/dev/null 2>&1")) cr_skip_test("mpirun is not installed");
    long online = sysconf(_SC_NPROCESSORS_ONLN), want = online / 2 > 1 ? online / 2 : 1;
    /* no leak check for an MPI launch under SAN=1 (Open MPI's own allocations), as test_dist.c */
    char *argv[] = {"/usr/bin/env", "ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0", "mpirun", "--oversubscribe",
                    "--allow-run-as-root", "-np", "2", (char *)tt_tinymoe(), "train",
                    "--preset", "tiny", "--steps", "2", "--eval_every", "0", "--sample_tokens", "0", "--out", "",
                    NULL};
    int rc;
    char *out = run_out(argv, &rc);
    cr_assert_eq(rc, 0, "exit %d:\n%s", rc, out);
    char line[64];
    snprintf(line, sizeof line, "on cpu, %ld CPU thread%s per rank", want, want > 1 ? "s" : "");
    cr_assert(strstr(out, line), "expected \"%s\" in:\n%s", line, out);
    free(out);
}
