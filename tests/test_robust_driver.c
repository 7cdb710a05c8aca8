/*
 * test_robust_driver.c — the `tinymoe` binary in child processes (issue 14): what only a
 * process shows.
 *
 *   the out directory's lock (a second run fails at once naming the holder's pid; a dead
 *   holder's lock does not block); SIGINT to a process group whose reader (| tee) is gone
 *   still saves, and the checkpoint resumes bit for bit; two quick signals (Ctrl-C twice,
 *   TERM to the process and then its group, `timeout`) leave a checkpoint; Ctrl-C stops a long
 *   evaluation and the end-of-training sample promptly; a file-size limit fails like a full
 *   disk instead of killing; absurd sizes end in seconds with the key named or a clamp note;
 *   every command keeps the exit statuses --help documents; tokenize never replaces its input
 *   or a file that is not a regular file.
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checkpoint.h"
#include "child.h"
#include "common.h"
#include "config.h"
#include "data.h"
#include "status.h"
#include "train.h"

static void setup(void) { tt_tmpdir_make("tm_test_driver_"); }
static void teardown(void) {
    tt_kill_children();
    tt_tmpdir_remove();
}
TestSuite(driver, .init = setup, .fini = teardown);

#define ARGV(...) ((char *const[]){__VA_ARGS__, NULL})
#define T ((char *)tt_tinymoe())
#define P(name) ((char *)tt_path(name))

/* The tiny preset on one thread, logging every step, no periodic evaluation. */
#define TINY "train", "--preset", "tiny", "--threads", "1", "--log_every", "1", "--eval_every", "0"

static char *slurp_text(const char *path) {
    long len;
    return (char *)tt_slurp(path, &len);
}

static int exit_code(int status) {
    cr_assert_neq(status, -1, "the child did not end in time");
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* The newest checkpoint's step in dir (-1: none). */
static int64_t newest_step(const char *dir) {
    int64_t *steps;
    int n;
    char err[512];
    if (tmd_ckpt_list(dir, &steps, &n, err, sizeof err)) return -1;
    int64_t s = n ? steps[n - 1] : -1;
    free(steps);
    return s;
}

/* ---- defect 2: one run per out directory ------------------------------------------------- */

Test(driver, a_second_run_into_a_live_runs_directory_fails_at_once_naming_the_pid) {
    TT_WATCHDOG(180);
    char pid[32], out[300], *log;
    snprintf(out, sizeof out, "%s", tt_path("run"));
    /* A fresh run before its first checkpoint: another fresh run is refused. */
    tt_child a = tt_spawn(ARGV(T, TINY, "--steps", "100000000", "--out", out), P("a.log"), 0);
    cr_assert(tt_wait_for_text(tt_path("run/metrics.jsonl"), "\"train\"", 60), "the first run never logged");
    snprintf(pid, sizeof pid, "pid %d", (int)a.pid);
    double dt;
    int rc = tt_run(ARGV(T, TINY, "--steps", "2", "--warmup_steps", "1", "--out", out), P("b.log"), 30, &dt);
    log = slurp_text(tt_path("b.log"));
    cr_assert_eq(rc, TMD_CONFIG_ERROR, "a second fresh run: %d: %s", rc, log);
    cr_assert(strstr(log, out) && strstr(log, pid), "names the directory and the holder (%s): %s", pid, log);
    free(log);
    kill(-a.pid, SIGKILL);
    tt_wait(&a, 30);

    /* A run with checkpoints: --resume into it is refused while it lives... */
    snprintf(out, sizeof out, "%s", tt_path("run2"));
    a = tt_spawn(ARGV(T, TINY, "--steps", "100000000", "--save_every", "1", "--keep_last", "1", "--out", out),
                 P("a2.log"), 0);
    for (int i = 0; i < 6000 && newest_step(tt_path("run2")) < 1; i++) usleep(10000);
    cr_assert_geq(newest_step(tt_path("run2")), 1, "the first run never saved");
    snprintf(pid, sizeof pid, "pid %d", (int)a.pid);
    rc = tt_run(ARGV(T, "train", "--resume", out, "--steps", "100000000", "--threads", "1"), P("c.log"), 20, &dt);
    log = slurp_text(tt_path("c.log"));
    cr_assert_eq(rc, TMD_CONFIG_ERROR, "--resume into a live run's directory: %d: %s", rc, log);
    cr_assert(strstr(log, pid), "%s", log);
    cr_assert_lt(dt, 10.0, "refused at once, not after %.1f s", dt);
    free(log);
    /* ...and once its holder is killed (kill -9 leaves the lock file), it resumes. */
    kill(-a.pid, SIGKILL);
    tt_wait(&a, 30);
    struct stat sb;
    cr_assert_eq(stat(tt_path("run2/tinymoe.lock"), &sb), 0, "the dead run's lock file is still there");
    char steps[32];
    snprintf(steps, sizeof steps, "%lld", (long long)newest_step(tt_path("run2")) + 2);
    rc = tt_run(ARGV(T, "train", "--resume", out, "--steps", steps, "--threads", "1"), P("d.log"), 60, &dt);
    log = slurp_text(tt_path("d.log"));
    cr_assert_eq(rc, 0, "a stale lock does not block: %s", log);
    free(log);
}

/* ---- defect 3: pipes and signals ---------------------------------------------------------- */

/* The flags of the interrupted runs: a constant schedule, so that a resumed run may end at any
 * step and still follow the uninterrupted trajectory. */
#define LONG_RUN TINY, "--steps", "100000000", "--lr_schedule", "constant"

/* A straight in-process run to `steps` with the same flags, into dir. */
static void reference_run(const char *dir, int64_t steps) {
    char s[32], err[2048];
    snprintf(s, sizeof s, "%lld", (long long)steps);
    const char *argv[] = {"--preset", "tiny", "--threads", "1", "--log_every", "1", "--eval_every", "0",
                          "--lr_schedule", "constant", "--steps", s, "--out", dir};
    tmd_config c;
    int help;
    cr_assert_eq(tmd_config_from_args(&c, 14, (char **)argv, &help, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_train(&c, NULL, NULL, err, sizeof err), 0, "%s", err);
}

/* The tensor data of two checkpoints (format version 2: after the meta blob and its CRC, up to
 * the index, whose offsets depend on the meta's length) must be equal. */
static void assert_same_tensors(const char *a, const char *b) {
    long na, nb;
    unsigned char *sa = tt_slurp(a, &na), *sb = tt_slurp(b, &nb);
    uint64_t ma = 0, mb = 0, xa = 0, xb = 0;
    for (int i = 7; i >= 0; i--) ma = ma << 8 | sa[24 + i], mb = mb << 8 | sb[24 + i];
    for (int i = 7; i >= 0; i--) xa = xa << 8 | sa[32 + i], xb = xb << 8 | sb[32 + i];
    long oa = 64 + (long)ma + 4, ob = 64 + (long)mb + 4;
    cr_assert((long)xa <= na && (long)xb <= nb && oa <= (long)xa && ob <= (long)xb);
    cr_assert_eq((long)xa - oa, (long)xb - ob, "%s and %s differ in size", a, b);
    cr_assert_eq(memcmp(sa + oa, sb + ob, (size_t)((long)xa - oa)), 0, "%s and %s hold different tensors", a, b);
    free(sa);
    free(sb);
}

/* `tinymoe train ... 2>&1 | tee log`, then Ctrl-C: the terminal's SIGINT ends tee too, and the
 * next line the run prints meets a closed pipe. SIGPIPE killed the run there (exit 141, no
 * checkpoint); now the run stops printing, saves, exits 130, and the checkpoint resumes to the
 * same tensors as a run never interrupted. */
Test(driver, sigint_to_the_group_with_the_reader_gone_saves_and_resumes_exactly) {
    TT_WATCHDOG(180);
    char out[300];
    snprintf(out, sizeof out, "%s", tt_path("piped"));
    tt_child c = tt_spawn(ARGV(T, LONG_RUN, "--out", out), NULL, 0);
    /* Read until the run is training (a few step lines), then go away like tee. */
    char buf[4096];
    size_t got = 0;
    int lines = 0;
    double end = tt_now() + 60;
    while (lines < 3 && tt_now() < end) {
        ssize_t n = read(c.out_fd, buf, sizeof buf);
        if (n <= 0) break;
        got += (size_t)n;
        for (ssize_t i = 0; i < n; i++) lines += buf[i] == '\n' && got > 3000;
    }
    cr_assert_geq(lines, 3, "the run never printed its steps");
    close(c.out_fd);
    c.out_fd = -1;
    usleep(100000); /* it prints into the closed pipe for a while */
    kill(-c.pid, SIGINT);
    int code = exit_code(tt_wait(&c, 60));
    cr_assert_eq(code, 128 + SIGINT, "exit status %d (141: killed by SIGPIPE)", code);
    int64_t k = newest_step(tt_path("piped"));
    cr_assert_gt(k, 0, "a checkpoint was written");
    /* Resume 3 more steps; a reference run goes there straight. */
    char s[32], err[2048];
    snprintf(s, sizeof s, "%lld", (long long)k + 3);
    const char *argv[] = {"--resume", out, "--steps", s, "--threads", "1"};
    tmd_config r;
    int help;
    cr_assert_eq(tmd_config_from_args(&r, 6, (char **)argv, &help, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_train(&r, NULL, NULL, err, sizeof err), 0, "%s", err);
    reference_run(tt_path("ref"), k + 3);
    char fa[512], fb[512];
    tmd_ckpt_path(tt_path("piped"), k + 3, fa, sizeof fa);
    tmd_ckpt_path(tt_path("ref"), k + 3, fb, sizeof fb);
    assert_same_tensors(fa, fb);
}

/* Ctrl-C pressed twice, or TERM to the process and then to its whole group (what `timeout`
 * and schedulers do), 1 ms apart: the second arrived during the save the first asked for and
 * killed the run (one-shot handler) with nothing saved. Now the save completes, the message
 * says what happened, and the exit status is 128 + the signal. */
Test(driver, two_quick_signals_leave_a_checkpoint) {
    TT_WATCHDOG(180);
    const int sigs[] = {SIGINT, SIGTERM};
    for (int i = 0; i < 2; i++) {
        char name[32], log[32];
        snprintf(name, sizeof name, "twice%d", i);
        snprintf(log, sizeof log, "twice%d.log", i);
        char out[300];
        snprintf(out, sizeof out, "%s", tt_path(name));
        tt_child c = tt_spawn(ARGV(T, LONG_RUN, "--out", out), P(log), 0);
        char metrics[400];
        snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", out);
        cr_assert(tt_wait_for_text(metrics, "\"train\"", 60), "never trained");
        kill(c.pid, sigs[i]);
        usleep(1000);
        kill(-c.pid, sigs[i]);
        int code = exit_code(tt_wait(&c, 60));
        char *text = slurp_text(tt_path(log));
        cr_assert_eq(code, 128 + sigs[i], "%s twice: exit %d: %s", strsignal(sigs[i]), code, text);
        cr_assert_gt(newest_step(out), 0, "a checkpoint");
        cr_assert(strstr(text, "stopped at step") && strstr(text, "--resume"), "%s", text);
        free(text);
        tmd_config kc;
        tmd_ckpt_state st;
        char ck[512], err[1024];
        cr_assert_eq(tmd_ckpt_resolve(out, ck, sizeof ck, err, sizeof err), 0, "%s", err);
        cr_assert_eq(tmd_ckpt_read_meta(ck, &kc, &st, err, sizeof err), 0, "a whole checkpoint: %s", err);
    }
}

/* A closed terminal or a dropped ssh session sends SIGHUP to the session's process group: the
 * run used to die with it (exit 129, no checkpoint: everything since the last --save-every
 * lost). Now it stops like SIGTERM: checkpoint, a message naming the signal, exit 128 + 1. */
Test(driver, sighup_leaves_a_checkpoint) {
    TT_WATCHDOG(120);
    char out[300], metrics[400];
    snprintf(out, sizeof out, "%s", tt_path("hup"));
    snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", out);
    tt_child c = tt_spawn(ARGV(T, LONG_RUN, "--out", out), P("hup.log"), 0);
    cr_assert(tt_wait_for_text(metrics, "\"train\"", 60), "never trained");
    kill(-c.pid, SIGHUP);
    int code = exit_code(tt_wait(&c, 60));
    char *text = slurp_text(tt_path("hup.log"));
    cr_assert_eq(code, 128 + SIGHUP, "SIGHUP: exit %d: %s", code, text);
    cr_assert(strstr(text, "SIGHUP: stopped at step") && strstr(text, "--resume"), "%s", text);
    free(text);
    cr_assert_gt(newest_step(out), 0, "a checkpoint");
    tmd_config kc;
    tmd_ckpt_state st;
    char ck[512], err[1024];
    cr_assert_eq(tmd_ckpt_resolve(out, ck, sizeof ck, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_ckpt_read_meta(ck, &kc, &st, err, sizeof err), 0, "a whole checkpoint: %s", err);
}

/* `timeout 2 tinymoe train ...`: its TERM (to the child, and to the group) leaves a checkpoint. */
Test(driver, timeout_leaves_a_checkpoint) {
    TT_WATCHDOG(120);
    char out[300];
    snprintf(out, sizeof out, "%s", tt_path("timed"));
    int code = tt_run(ARGV("timeout", "-s", "TERM", "3", T, LONG_RUN, "--out", out), P("timed.log"), 60, NULL);
    char *text = slurp_text(tt_path("timed.log"));
    cr_assert_eq(code, 124, "timeout's own status for a timed-out command: %d: %s", code, text);
    cr_assert_gt(newest_step(out), 0, "a checkpoint");
    cr_assert(strstr(text, "SIGTERM: stopped at step"), "%s", text);
    free(text);
}

/* ---- defect 4: Ctrl-C during evaluation and sampling -------------------------------------- */

/* A long evaluation (eval_batches far beyond the synthetic validation set, which is clamped,
 * on a wider model) is stopped between batches: the run saves and exits 130 within seconds of
 * the signal (it went on for the whole evaluation). */
Test(driver, ctrl_c_stops_a_long_evaluation_promptly) {
    TT_WATCHDOG(180);
    char out[300];
    snprintf(out, sizeof out, "%s", tt_path("evalrun"));
    tt_child c = tt_spawn(ARGV(T, TINY, "--d_model", "64", "--n_heads", "4", "--n_kv_heads", "2", "--seq_len", "256",
                               "--steps", "5", "--eval_every", "1", "--eval_batches", "1000000000", "--out", out),
                          P("eval.log"), 0);
    cr_assert(tt_wait_for_text(tt_path("evalrun/metrics.jsonl"), "\"train\"", 60), "never trained");
    usleep(300000); /* inside the evaluation after step 1 */
    kill(c.pid, SIGINT);
    double t0 = tt_now();
    int code = exit_code(tt_wait(&c, 120));
    double dt = tt_now() - t0;
    char *text = slurp_text(tt_path("eval.log"));
    cr_assert_eq(code, 130, "exit %d: %s", code, text);
    cr_assert_lt(dt, 5.0, "stopped %.1f s after the signal", dt);
    cr_assert(strstr(text, "during the evaluation") && strstr(text, "clamped"), "%s", text);
    cr_assert_eq(newest_step(out), 1, "saved at the step the evaluation followed");
    free(text);
}

/* Ctrl-C during the sample at the end of training (a million tokens asked for): the sample
 * stops at once (the checkpoint was written before it) and the run exits 130. */
Test(driver, ctrl_c_stops_the_end_of_training_sample_promptly) {
    TT_WATCHDOG(180);
    char txt[300];
    snprintf(txt, sizeof txt, "%s", tt_path("text.txt"));
    char bin[300];
    snprintf(bin, sizeof bin, "%s", tt_path("text.bin"));
    FILE *f = fopen(txt, "w");
    for (int i = 0; i < 300; i++) fputs("to be or not to be, that is the question. ", f);
    fclose(f);
    char err[1024], val[300];
    cr_assert_eq(tmd_tokenize_file(txt, bin, 0.1, val, sizeof val, err, sizeof err), 0, "%s", err);
    char out[300];
    snprintf(out, sizeof out, "%s", tt_path("sampled"));
    tt_child c = tt_spawn(ARGV(T, TINY, "--data", bin, "--val_data", val, "--steps", "20", "--sample_prompt",
                               "to be", "--sample_tokens", "1000000", "--temperature", "0", "--out", out),
                          P("sample.log"), 0);
    cr_assert(tt_wait_for_text(tt_path("sample.log"), "sample (temperature", 60), "never sampled");
    usleep(300000);
    kill(c.pid, SIGINT);
    double t0 = tt_now();
    int code = exit_code(tt_wait(&c, 120));
    double dt = tt_now() - t0;
    char *text = slurp_text(tt_path("sample.log"));
    cr_assert_eq(code, 130, "exit %d: %.300s", code, text);
    cr_assert_lt(dt, 5.0, "stopped %.1f s after the signal", dt);
    cr_assert(strstr(text, "sample stopped"), "%.300s", text + (strlen(text) > 300 ? strlen(text) - 300 : 0));
    cr_assert_eq(newest_step(out), 20, "the checkpoint of the finished run");
    free(text);
}

/* ---- defect 9: the file-size limit --------------------------------------------------------- */

/* Past `ulimit -f` a write raised SIGXFSZ and killed the run (exit 153); now it fails like a
 * full disk: exit 1 and a message naming the file and the error. */
Test(driver, a_file_size_limit_fails_like_a_full_disk) {
    TT_WATCHDOG(60);
    tt_child c = tt_spawn(ARGV(T, TINY, "--steps", "3", "--warmup_steps", "1", "--out", P("small")), P("fsize.log"),
                          64 * 1024);
    int code = exit_code(tt_wait(&c, 60));
    char *text = slurp_text(tt_path("fsize.log"));
    cr_assert_eq(code, TMD_RUNTIME_ERROR, "exit %d: %s", code, text);
    cr_assert(strstr(text, "File too large") && strstr(text, "ckpt-00000003.tmck"), "%s", text);
    free(text);
}

/* ---- defect 7: absurd sizes ---------------------------------------------------------------- */

/* Every absurd value ends within seconds: refused naming the key (exit 2), or clamped with a
 * note. They crashed (--threads 100000: exit 139), overflowed (d_model 2e9: a negative
 * dense_ffn_size; steps 2^63-1: "-128 tokens"), failed late (capacity_factor 1e300: capacity
 * -1 at the first forward) or ran practically forever. */
Test(driver, absurd_sizes_are_refused_or_clamped_within_seconds) {
    TT_WATCHDOG(300);
    static const struct {
        const char *args[10];
        int code;
        const char *says;
    } cases[] = {
        {{"--threads", "100000"}, 2, "key 'threads'"},
        {{"--d_model", "2000000000"}, 2, "key 'd_model'"},
        {{"--capacity_factor", "1e300"}, 2, "key 'capacity_factor'"},
        {{"--capacity_factor", "3"}, 2, "num_experts / topk"},
        {{"--steps", "9223372036854775807"}, 2, "key 'steps'"},
        {{"--n_layers", "1000000"}, 2, "key 'n_layers'"},
        {{"--seq_len", "2000000000"}, 2, "key 'seq_len'"},
        {{"--batch_size", "1000000", "--seq_len", "1000000"}, 2, "memory"},
        {{"--d_model", "65536", "--n_layers", "10000"}, 2, "memory"},
        {{"--synthetic_vocab", "4096", "--vocab_size", "4096"}, 2, "key 'synthetic_vocab'"},
        {{"--synthetic_vocab", "1024", "--synthetic_k", "1024", "--vocab_size", "1024"}, 2, "transitions"},
        {{"--sample_tokens", "2000000000"}, 2, "key 'sample_tokens'"},
        {{"--preset", "tiny", "--steps", "1", "--eval_batches", "2147483647"}, 0, "clamped to the 8192 synthetic"},
        {{"--preset", "tiny", "--steps", "1", "--vocab_size", "4096"}, 0, "done: 1 steps"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *argv[20] = {T, "train", "--out", "", "--threads", "1"};
        int n = 6;
        for (int k = 0; cases[i].args[k]; k++) argv[n++] = (char *)cases[i].args[k];
        argv[n] = NULL;
        double dt;
        int code = tt_run(argv, P("absurd.log"), 60, &dt);
        char *text = slurp_text(tt_path("absurd.log"));
        cr_assert_eq(code, cases[i].code, "%s %s: exit %d: %s", cases[i].args[0], cases[i].args[1], code, text);
        cr_assert(strstr(text, cases[i].says), "%s %s: expected '%s' in: %s", cases[i].args[0], cases[i].args[1],
                  cases[i].says, text);
        cr_assert_lt(dt, 30.0, "%s %s took %.1f s", cases[i].args[0], cases[i].args[1], dt);
        free(text);
    }
}

/* ---- defect 8: exit statuses -------------------------------------------------------------- */

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

/* 0 ok, 1 runtime failure, 2 bad input, everywhere; --help and the README say so. Tokenize's
 * bad inputs exited 1, and so did a configuration asking for more memory than exists. */
Test(driver, exit_statuses_are_consistent_and_documented) {
    TT_WATCHDOG(120);
    write_file(tt_path("empty.txt"), "");
    write_file(tt_path("text.txt"), "hello world, hello tokens");
    write_file(tt_path("file"), "x");
    write_file(tt_path("a.cfg"), "lr = 0.1\n");
    write_file(tt_path("dup.cfg"), "lr = 0.1\nlr = 0.2\n");
    cr_assert_eq(mkdir(tt_path("dir"), 0755), 0);
    static const struct {
        const char *args[12];
        int code;
        const char *says;
    } cases[] = {
        {{"tokenize", "@empty.txt", "@o.bin"}, 2, "empty"},
        {{"tokenize", "@dir", "@o.bin"}, 2, "regular file"},
        {{"tokenize", "@text.txt", "@text.txt"}, 2, "is the input file"},
        {{"tokenize", "@missing.txt", "@o.bin"}, 2, "missing.txt"},
        {{"tokenize", "@text.txt", "@nodir/o.bin"}, 1, "nodir"},
        {{"train", "--config", "@a.cfg", "--config", "@dup.cfg"}, 2, "given twice"},
        {{"train", "--config", "@dup.cfg"}, 2, "lines 1 and 2"},
        {{"train", "--out", "@file"}, 2, "not a directory"},
        {{"train", "--d_model", "65536", "--n_layers", "10000"}, 2, "memory"},
        {{"eval", "--ckpt", "@dir", "--init_from", "@dir"}, 2, "give one"},
        {{"train", "--lr"}, 2, "needs a value"},
        {{"frobnicate"}, 2, "unknown command"},
        {{"inspect", "@missing.tmck"}, 2, "missing.tmck"},
        {{"--version"}, 0, "tinymoe"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *argv[20] = {T};
        char paths[12][300];
        int n = 1;
        for (int k = 0; cases[i].args[k]; k++) {
            const char *a = cases[i].args[k];
            if (a[0] == '@') {
                snprintf(paths[k], sizeof paths[k], "%s", tt_path(a + 1));
                argv[n++] = paths[k];
            } else {
                argv[n++] = (char *)a;
            }
        }
        argv[n] = NULL;
        int code = tt_run(argv, P("status.log"), 60, NULL);
        char *text = slurp_text(tt_path("status.log"));
        cr_assert_eq(code, cases[i].code, "%s %s: exit %d: %s", cases[i].args[0], cases[i].args[1], code, text);
        cr_assert(strstr(text, cases[i].says), "%s %s: expected '%s' in: %s", cases[i].args[0], cases[i].args[1],
                  cases[i].says, text);
        free(text);
    }
    cr_assert_eq(tt_run(ARGV(T, "--help"), P("help.log"), 30, NULL), 0);
    char *help = slurp_text(tt_path("help.log"));
    cr_assert(strstr(help, "exit status") && strstr(help, "128+n") && strstr(help, "bad input") &&
                  strstr(help, "tinymoe.lock"),
              "%s", help);
    free(help);
    /* The README beside build/: the repository's. */
    char readme[PATH_MAX];
    snprintf(readme, sizeof readme, "%s", tt_tinymoe());
    *strrchr(readme, '/') = 0;
    *strrchr(readme, '/') = 0;
    strcat(readme, "/README.md");
    char *r = slurp_text(readme);
    cr_assert(strstr(r, "## Exit status") && strstr(r, "128 + n") && strstr(r, "tinymoe.lock"),
              "README.md documents the exit statuses and the lock");
    free(r);
}

/* ---- defect 6: tokenize and the atomic writes --------------------------------------------- */

/* `tinymoe tokenize y_val.bin y.bin` replaced the user's y_val.bin (the text) by validation
 * tokens; a FIFO or a link as the output was replaced by a regular file. All refused with
 * exit 2, touching nothing. */
Test(driver, tokenize_never_replaces_its_input_or_a_non_regular_file) {
    TT_WATCHDOG(60);
    const char *text = "the user's only copy of the text";
    write_file(tt_path("y_val.bin"), text);
    int code = tt_run(ARGV(T, "tokenize", P("y_val.bin"), P("y.bin"), "--val-fraction", "0.5"), P("t.log"), 30, NULL);
    char *log = slurp_text(tt_path("t.log"));
    cr_assert_eq(code, 2, "%s", log);
    cr_assert(strstr(log, "is the input file"), "%s", log);
    free(log);
    char *kept = slurp_text(tt_path("y_val.bin"));
    cr_assert_str_eq(kept, text, "the input is untouched");
    free(kept);
    struct stat sb;
    cr_assert_neq(stat(tt_path("y.bin"), &sb), 0, "nothing written");

    write_file(tt_path("in.txt"), "some text to tokenize, long enough for a split");
    cr_assert_eq(mkfifo(tt_path("fifo"), 0644), 0);
    code = tt_run(ARGV(T, "tokenize", P("in.txt"), P("fifo")), P("t.log"), 30, NULL);
    log = slurp_text(tt_path("t.log"));
    cr_assert_eq(code, 2, "%s", log);
    cr_assert(strstr(log, "a FIFO"), "%s", log);
    free(log);
    cr_assert(lstat(tt_path("fifo"), &sb) == 0 && S_ISFIFO(sb.st_mode), "the FIFO is still a FIFO");

    write_file(tt_path("target"), "kept");
    cr_assert_eq(symlink(tt_path("target"), tt_path("link.bin")), 0);
    code = tt_run(ARGV(T, "tokenize", P("in.txt"), P("link.bin")), P("t.log"), 30, NULL);
    log = slurp_text(tt_path("t.log"));
    cr_assert_eq(code, 2, "%s", log);
    cr_assert(strstr(log, "symbolic link"), "%s", log);
    free(log);
    cr_assert(lstat(tt_path("link.bin"), &sb) == 0 && S_ISLNK(sb.st_mode), "the link is still a link");
}
