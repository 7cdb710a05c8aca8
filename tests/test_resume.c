/*
 * test_resume.c — driver checkpoints (train/checkpoint.c, train/rundir.c, the save/resume path
 * of train.c): training 2N steps equals training N, saving, and resuming N more, bit for bit
 * (every loss and every tensor), on synthetic data and on a token file with gradient
 * accumulation, expert biases and SGD; SIGINT in the middle of a run writes a checkpoint whose
 * resumption again equals the uninterrupted run; keep_last pruning; config mismatches on
 * resume; eval of a checkpoint reproduces the validation loss of training; meta text round
 * trip.
 */
#include <dirent.h>
#include <errno.h>
#include <math.h>
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
#include "hf.h"
#include "status.h"
#include "train.h"

static void setup(void) { tt_tmpdir_make("tm_test_resume_"); }
static void teardown(void) { tt_tmpdir_remove(); }
TestSuite(resume, .init = setup, .fini = teardown);

static void set(tmd_config *c, const char *k, const char *v) {
    char err[512];
    cr_assert_eq(tmd_config_set(c, k, v, TMD_SRC_FLAG, "test", err, sizeof err), 0, "%s", err);
}

/* A small MoE (2 layers, 4 experts top-2) logging every step, without periodic evaluation. */
static void small_run(tmd_config *c, const char *out, int steps) {
    tmd_config_defaults(c);
    const char *kv[][2] = {
        {"d_model", "32"},        {"n_layers", "2"},         {"n_heads", "2"},         {"n_kv_heads", "1"},
        {"num_experts", "4"},     {"topk", "2"},             {"expert_ffn_size", "32"}, {"seq_len", "16"},
        {"batch_size", "4"},      {"synthetic_vocab", "8"},  {"synthetic_k", "2"},     {"warmup_steps", "2"},
        {"lr", "1e-2"},           {"log_every", "1"},        {"eval_every", "0"},      {"eval_batches", "2"},
        {"threads", "2"},         {"lr_schedule", "cosine"}, {"min_lr", "1e-3"},
    };
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++) set(c, kv[i][0], kv[i][1]);
    char s[32];
    snprintf(s, sizeof s, "%d", steps);
    set(c, "steps", s);
    set(c, "out", out);
}

/* Byte-level token file of pseudo-random "words" (so the batcher's position matters). */
static const char *token_file(void) {
    static char path[256];
    snprintf(path, sizeof path, "%s", tt_path("tokens.bin"));
    enum { N = 6000 };
    static uint32_t tok[N];
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < N; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        tok[i] = (x % 7 == 0) ? ' ' : 'a' + (uint32_t)(x % 26);
    }
    char err[256];
    cr_assert_eq(tmd_tokens_write(path, tok, N, err, sizeof err), 0, "%s", err);
    return path;
}

/* The bytes of a checkpoint's tensor data (format version 2: from after the meta blob and its
 * CRC to the index, whose offsets depend on the meta's length): equal sections mean
 * bit-identical tensors, whatever the two runs' configs say. */
static unsigned char *tensor_section(const char *path, long *n) {
    long len;
    unsigned char *img = tt_slurp(path, &len);
    cr_assert(len > 64);
    uint64_t ml = 0, index_off = 0;
    for (int i = 7; i >= 0; i--) ml = (ml << 8) | img[24 + i];
    for (int i = 7; i >= 0; i--) index_off = (index_off << 8) | img[32 + i];
    long off = 64 + (long)ml + 4;
    cr_assert(off < (long)index_off && (long)index_off < len);
    *n = (long)index_off - off;
    unsigned char *s = malloc((size_t)*n);
    memcpy(s, img + off, (size_t)*n);
    free(img);
    return s;
}

static void assert_same_tensors(const char *a, const char *b) {
    long na, nb;
    unsigned char *sa = tensor_section(a, &na), *sb = tensor_section(b, &nb);
    cr_assert_eq(na, nb, "%s and %s differ in size", a, b);
    cr_assert_eq(memcmp(sa, sb, (size_t)na), 0, "%s and %s hold different tensors", a, b);
    free(sa);
    free(sb);
}

/* The "loss" of every train record with step in (from, to], as text (exact: the shortest
 * round-trip representation of the double). */
static int losses(const char *metrics, int from, int to, char out[][40]) {
    long len;
    char *text = (char *)tt_slurp(metrics, &len);
    int n = 0;
    for (char *line = text; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        const char *st = strstr(line, "\"step\": "), *lo = strstr(line, "\"loss\": ");
        if (strstr(line, "\"type\": \"train\"") && st && lo) {
            int step = atoi(st + 8);
            if (step > from && step <= to) {
                cr_assert_eq(step, from + n + 1, "records out of order at step %d", step);
                snprintf(out[n++], 40, "%.*s", (int)strcspn(lo + 8, ",}"), lo + 8);
            }
        }
        line = nl ? nl + 1 : NULL;
    }
    free(text);
    return n;
}

static void run_ok(const tmd_config *c, tmd_train_result *res) {
    char err[2048] = "";
    int rc = tmd_train(c, NULL, res, err, sizeof err);
    cr_assert_eq(rc, TMD_OK, "tmd_train: %d %s", rc, err);
}

/* Run `c` for 2N steps saving at N; resume a copy from step N into another directory; both
 * must end with identical tensors and log identical losses for steps N+1..2N. */
static void check_exact_resume(tmd_config *c, int n) {
    char a[256], b[256], ck[512], fa[512], fb[512];
    snprintf(a, sizeof a, "%s", tt_path("a"));
    snprintf(b, sizeof b, "%s", tt_path("b"));
    char s[32];
    snprintf(s, sizeof s, "%d", n);
    set(c, "save_every", s);
    set(c, "out", a);
    tmd_train_result ra, rb;
    run_ok(c, &ra);
    tmd_ckpt_path(a, n, ck, sizeof ck);
    tmd_config r = *c;
    set(&r, "out", b);
    snprintf(r.resume, sizeof r.resume, "%s", ck);
    run_ok(&r, &rb);
    tmd_ckpt_path(a, 2 * n, fa, sizeof fa);
    tmd_ckpt_path(b, 2 * n, fb, sizeof fb);
    assert_same_tensors(fa, fb);
    char la[64][40], lb[64][40], ma[512], mb[512];
    snprintf(ma, sizeof ma, "%s/metrics.jsonl", a);
    snprintf(mb, sizeof mb, "%s/metrics.jsonl", b);
    cr_assert_eq(losses(ma, n, 2 * n, la), n);
    cr_assert_eq(losses(mb, n, 2 * n, lb), n, "the resumed run logs steps %d..%d", n + 1, 2 * n);
    for (int i = 0; i < n; i++) cr_assert_str_eq(la[i], lb[i], "loss of step %d", n + 1 + i);
    /* The resumed run's directory carries the history of steps 1..N from the first run. */
    cr_assert_eq(losses(ma, 0, n, la), n);
    cr_assert_eq(losses(mb, 0, n, lb), n, "history up to step %d carried over", n);
    for (int i = 0; i < n; i++) cr_assert_str_eq(la[i], lb[i], "history of step %d", 1 + i);
    cr_assert_eq(ra.val_loss, rb.val_loss);
    cr_assert_eq(ra.last_loss, rb.last_loss);
    /* The test can fail: the checkpoint at N differs from the one at 2N. */
    tmd_ckpt_path(a, n, ck, sizeof ck);
    long n1, n2;
    unsigned char *s1 = tensor_section(ck, &n1), *s2 = tensor_section(fa, &n2);
    cr_assert(n1 != n2 || memcmp(s1, s2, (size_t)n1), "training changed nothing between steps %d and %d", n, 2 * n);
    free(s1);
    free(s2);
}

Test(resume, exact_on_synthetic_data_adamw) {
    TT_WATCHDOG(120);
    tmd_config c;
    small_run(&c, "", 12);
    check_exact_resume(&c, 6);
}

Test(resume, exact_on_a_token_file_with_grad_accum_expert_bias_and_sgd) {
    TT_WATCHDOG(120);
    tmd_config c;
    small_run(&c, "", 10);
    set(&c, "data", token_file());
    set(&c, "val_fraction", "0.2");
    set(&c, "grad_accum", "2");
    set(&c, "expert_bias", "true");
    set(&c, "score_function", "sigmoid");
    set(&c, "optimizer", "sgd");
    set(&c, "lr", "0.1");
    check_exact_resume(&c, 5);
}

/* apply_topk_weights_early lives in the checkpoint's config: a resume that does not repeat the
 * flag still trains with it (the same tensors, bit for bit, as the run that never stopped,
 * which differ from a run without it), and a resume that contradicts it is refused by name. */
Test(resume, keeps_apply_topk_weights_early) {
    TT_WATCHDOG(120);
    char a[256], b[256], off[256], ck[512], fa[512], fb[512], foff[512], err[2048];
    snprintf(a, sizeof a, "%s", tt_path("early"));
    snprintf(b, sizeof b, "%s", tt_path("resumed"));
    snprintf(off, sizeof off, "%s", tt_path("late"));
    tmd_config c;
    small_run(&c, a, 8);
    set(&c, "apply_topk_weights_early", "true");
    set(&c, "save_every", "4");
    tmd_train_result res;
    run_ok(&c, &res);
    tmd_ckpt_path(a, 4, ck, sizeof ck);
    tmd_config m;
    tmd_ckpt_state st;
    cr_assert_eq(tmd_ckpt_read_meta(ck, &m, &st, err, sizeof err), 0, "%s", err);
    cr_assert_eq(m.model.moe.apply_topk_weights_early, 1, "the checkpoint's config keeps the key");

    tmd_config r;
    small_run(&r, b, 8); /* without the flag */
    snprintf(r.resume, sizeof r.resume, "%s", ck);
    run_ok(&r, &res);
    tmd_ckpt_path(a, 8, fa, sizeof fa);
    tmd_ckpt_path(b, 8, fb, sizeof fb);
    assert_same_tensors(fa, fb);

    tmd_config l;
    small_run(&l, off, 8);
    set(&l, "save_every", "4");
    run_ok(&l, &res);
    tmd_ckpt_path(off, 8, foff, sizeof foff);
    long n1, n2;
    unsigned char *s1 = tensor_section(fa, &n1), *s2 = tensor_section(foff, &n2);
    cr_assert(n1 != n2 || memcmp(s1, s2, (size_t)n1), "the option changed nothing in training");
    free(s1);
    free(s2);

    small_run(&r, tt_path("refused"), 8);
    set(&r, "apply_topk_weights_early", "false");
    snprintf(r.resume, sizeof r.resume, "%s", ck);
    cr_assert_eq(tmd_train(&r, NULL, NULL, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "'apply_topk_weights_early' = false") && strstr(err, ck) && strstr(err, "differs"), "%s", err);
}

/* SIGINT while training (in a child process): a checkpoint at the step it stopped, exit status
 * 130; resuming it to the end equals a run that was never interrupted. The schedule is
 * constant so that the resumed run may end earlier than the interrupted one was set to (keeps
 * the test short) and still follow the same trajectory as the reference. */
Test(resume, sigint_saves_and_resumes_exactly) {
    TT_WATCHDOG(180);
    char a[256], ref[256], fa[512], fr[512];
    snprintf(a, sizeof a, "%s", tt_path("interrupted"));
    snprintf(ref, sizeof ref, "%s", tt_path("reference"));
    tmd_config c;
    small_run(&c, a, 100000);
    set(&c, "lr_schedule", "constant");
    set(&c, "log_every", "20");
    fflush(NULL);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        char err[2048];
        int rc = tmd_train(&c, NULL, NULL, err, sizeof err);
        if (rc != 128 + SIGINT) fprintf(stderr, "child: rc %d: %s\n", rc, err);
        _exit(rc);
    }
    /* Signal once the loop is logging (the handler is installed by then). */
    char metrics[512];
    snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", a);
    struct stat sb;
    for (int i = 0; i < 6000 && (stat(metrics, &sb) || sb.st_size == 0); i++) usleep(10000);
    cr_assert(sb.st_size > 0, "the child never logged");
    cr_assert_eq(kill(pid, SIGINT), 0);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGINT, "child status %d", status);

    char ck[512], err[512];
    cr_assert_eq(tmd_ckpt_resolve(a, ck, sizeof ck, err, sizeof err), 0, "%s", err);
    tmd_config kc;
    tmd_ckpt_state st;
    cr_assert_eq(tmd_ckpt_read_meta(ck, &kc, &st, err, sizeof err), 0, "%s", err);
    cr_assert(st.step >= 20 && st.step < 100000, "stopped at step %lld", (long long)st.step);
    cr_log_info("SIGINT stopped the run at step %lld", (long long)st.step);

    int end = (int)st.step + 6;
    char s[32];
    snprintf(s, sizeof s, "%d", end);
    tmd_config r = c;
    set(&r, "steps", s); /* steps may change on resume */
    set(&r, "log_every", "1");
    snprintf(r.resume, sizeof r.resume, "%s", a);
    tmd_train_result rr, rf;
    run_ok(&r, &rr);
    tmd_config f = c;
    set(&f, "steps", s);
    set(&f, "log_every", "1");
    set(&f, "out", ref);
    run_ok(&f, &rf);
    tmd_ckpt_path(a, end, fa, sizeof fa);
    tmd_ckpt_path(ref, end, fr, sizeof fr);
    assert_same_tensors(fa, fr);
    cr_assert_eq(rr.val_loss, rf.val_loss);
    char la[8][40], lf[8][40], ma[512], mf[512];
    snprintf(ma, sizeof ma, "%s/metrics.jsonl", a);
    snprintf(mf, sizeof mf, "%s/metrics.jsonl", ref);
    cr_assert_eq(losses(ma, end - 6, end, la), 6);
    cr_assert_eq(losses(mf, end - 6, end, lf), 6);
    for (int i = 0; i < 6; i++) cr_assert_str_eq(la[i], lf[i], "loss of step %d", end - 5 + i);
}

/* keep_last: only the newest K checkpoints stay; stray temporaries of a killed save go. */
Test(resume, keep_last_prunes_and_stale_temporaries_go) {
    char a[256], path[512];
    snprintf(a, sizeof a, "%s", tt_path("keep"));
    tmd_config c;
    small_run(&c, a, 12);
    set(&c, "save_every", "3");
    set(&c, "keep_last", "2");
    cr_assert_eq(mkdir(a, 0777), 0);
    snprintf(path, sizeof path, "%s/ckpt-00000003.tmck.tmp.AbCdEf", a);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs("half a checkpoint", f);
    fclose(f);
    tmd_train_result res;
    run_ok(&c, &res);
    int64_t *steps;
    int n;
    char err[256];
    cr_assert_eq(tmd_ckpt_list(a, &steps, &n, err, sizeof err), 0, "%s", err);
    cr_assert_eq(n, 2);
    cr_assert_eq(steps[0], 9);
    cr_assert_eq(steps[1], 12);
    free(steps);
    struct stat sb;
    cr_assert_neq(stat(path, &sb), 0, "the stale temporary was removed");
}

/* Resuming with a model or training key that differs from the checkpoint: refused, naming the
 * key, both values and the file; run settings and steps may differ. */
Test(resume, config_mismatch_is_refused) {
    char a[256], b[256], ck[512], err[2048];
    snprintf(a, sizeof a, "%s", tt_path("m"));
    snprintf(b, sizeof b, "%s", tt_path("m2"));
    tmd_config c;
    small_run(&c, a, 4);
    tmd_train_result res;
    run_ok(&c, &res);
    tmd_ckpt_path(a, 4, ck, sizeof ck);
    const char *bad[][3] = {{"d_model", "64", "'d_model' = 64"}, {"lr", "0.5", "'lr' = 0.5"}, {"seed", "7", "'seed' = 7"}};
    for (int i = 0; i < 3; i++) {
        tmd_config r;
        small_run(&r, b, 8);
        set(&r, bad[i][0], bad[i][1]);
        snprintf(r.resume, sizeof r.resume, "%s", a);
        cr_assert_eq(tmd_train(&r, NULL, NULL, err, sizeof err), TMD_CONFIG_ERROR, "%s", bad[i][0]);
        cr_assert(strstr(err, bad[i][2]) && strstr(err, ck) && strstr(err, "differs"), "%s", err);
    }
    struct stat sb;
    cr_assert_neq(stat(b, &sb), 0, "nothing written by a refused resume");
    /* Allowed: more steps, other log/eval settings, other out. */
    tmd_config r;
    small_run(&r, b, 8);
    set(&r, "log_every", "3");
    set(&r, "eval_every", "2");
    snprintf(r.resume, sizeof r.resume, "%s", a);
    run_ok(&r, &res);
    cr_assert_eq(res.steps, 8);
    /* A corrupted checkpoint names the file and what is wrong. */
    long len;
    unsigned char *img = tt_slurp(ck, &len);
    img[len / 2] ^= 1;
    FILE *f = fopen(ck, "wb");
    fwrite(img, 1, (size_t)len, f);
    fclose(f);
    free(img);
    small_run(&r, b, 8);
    snprintf(r.resume, sizeof r.resume, "%s", ck);
    cr_assert_eq(tmd_train(&r, NULL, NULL, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, ck) && strstr(err, "corrupt"), "%s", err);
    /* resume and init_from together are refused. */
    small_run(&r, b, 8);
    snprintf(r.resume, sizeof r.resume, "%s", a);
    snprintf(r.init_from, sizeof r.init_from, "%s", a);
    cr_assert_eq(tmd_train(&r, NULL, NULL, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "init_from"), "%s", err);
}

/* tinymoe eval --ckpt on the training run's own validation data reproduces the run's final
 * validation loss exactly; the loaded model comes from the checkpoint, not from the seed. */
Test(resume, eval_of_a_checkpoint_matches_training) {
    char a[256], err[2048];
    snprintf(a, sizeof a, "%s", tt_path("e"));
    tmd_config c;
    small_run(&c, a, 10);
    set(&c, "data", token_file());
    set(&c, "val_fraction", "0.2");
    set(&c, "eval_batches", "0");
    tmd_train_result res;
    run_ok(&c, &res);
    tmd_config cli;
    tmd_config_defaults(&cli);
    set(&cli, "threads", "2");
    double loss = NAN, fresh = NAN;
    cr_assert_eq(tmd_eval_ckpt(&cli, a, NULL, &loss, err, sizeof err), TMD_OK, "%s", err);
    cr_assert_eq(loss, res.val_loss, "eval %.17g vs training %.17g", loss, res.val_loss);
    cr_assert_eq(tmd_eval(&c, NULL, &fresh, err, sizeof err), TMD_OK, "%s", err);
    cr_assert(fresh > loss + 0.05, "a fresh model (%g) is worse than the trained one (%g)", fresh, loss);
    /* Model keys cannot be changed when evaluating a checkpoint. */
    set(&cli, "n_layers", "3");
    cr_assert_eq(tmd_eval_ckpt(&cli, a, NULL, &loss, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "n_layers"), "%s", err);
}

/* The meta text carries every key exactly (floats to the last bit, strings with quotes,
 * newlines and '#'), and the state. */
Test(resume, meta_round_trip) {
    tmd_config c, d;
    small_run(&c, "out dir/#x", 33);
    set(&c, "lr", "0.1");
    set(&c, "force_load_balance", "true"); /* off its default, so that the round trip shows */
    c.adamw.beta2 = 1.0 - 1e-9 / 3.0;
    snprintf(c.sample_prompt, sizeof c.sample_prompt, "ROMEO:\n\t\"hi\" # not a comment \\");
    tmd_ckpt_state st = {.step = 1234567890123, .data_position = 42}, st2;
    size_t len;
    char *meta = tmd_ckpt_meta_encode(&c, &st, &len);
    cr_assert_not_null(meta);
    char err[1024];
    cr_assert_eq(tmd_ckpt_meta_decode(meta, len, "x.tmck", &d, &st2, err, sizeof err), 0, "%s", err);
    cr_assert_eq(st2.step, st.step);
    cr_assert_eq(st2.data_position, st.data_position);
    cr_assert_eq(d.adamw.beta2, c.adamw.beta2);
    cr_assert_str_eq(d.sample_prompt, c.sample_prompt);
    for (int i = 0; i < tmd_config_num_keys(); i++) {
        char x[2048], y[2048];
        tmd_config_format_exact(&c, i, x, sizeof x);
        tmd_config_format_exact(&d, i, y, sizeof y);
        cr_assert_str_eq(x, y, "key %s", tmd_config_key_name(i));
    }
    /* Damaged meta: the message names the file and the line. */
    char *bad = strdup(meta);
    char *p = strstr(bad, "\nd_model = ");
    cr_assert_not_null(p);
    memcpy(p + 1, "d_modle", 7);
    cr_assert_neq(tmd_ckpt_meta_decode(bad, len, "x.tmck", &d, &st2, err, sizeof err), 0);
    cr_assert(strstr(err, "d_modle") && strstr(err, "x.tmck"), "%s", err);
    free(bad);
    cr_assert_neq(tmd_ckpt_meta_decode("hello", 5, "y.tmck", &d, &st2, err, sizeof err), 0);
    cr_assert(strstr(err, "y.tmck"), "%s", err);
    free(meta);
}

/* force_load_balance is kept by the meta, and a meta written before the key existed (no line
 * for it) reads as not forced. */
Test(resume, meta_force_load_balance_and_older_checkpoints) {
    tmd_config c, d;
    small_run(&c, "", 3);
    set(&c, "force_load_balance", "true");
    tmd_ckpt_state st = {.step = 3, .data_position = 7}, st2;
    size_t len;
    char *meta = tmd_ckpt_meta_encode(&c, &st, &len), err[1024];
    cr_assert_not_null(meta);
    cr_assert_eq(tmd_ckpt_meta_decode(meta, len, "x.tmck", &d, &st2, err, sizeof err), 0, "%s", err);
    cr_assert_eq(d.model.moe.router.force_load_balance, 1);
    char *line = strstr(meta, "\nforce_load_balance = true\n");
    cr_assert_not_null(line, "%s", meta);
    const char *rest = strchr(line + 1, '\n');
    memmove(line, rest, strlen(rest) + 1); /* the older build's meta */
    cr_assert_null(strstr(meta, "force_load_balance"));
    cr_assert_eq(tmd_ckpt_meta_decode(meta, strlen(meta), "old.tmck", &d, &st2, err, sizeof err), 0, "%s", err);
    cr_assert_eq(d.model.moe.router.force_load_balance, 0);
    cr_assert_eq(d.model.moe.router.topk, 2);
    free(meta);
}

/* The driver's Hugging Face round trip: a trained checkpoint exported (tmd_hf_export) and read
 * back with init_from evaluates to the same loss, bit for bit, as the checkpoint itself; an
 * architecture key that contradicts config.json is refused by name. */
Test(resume, init_from_an_export_matches_the_checkpoint) {
    char a[256], hf[256], err[2048];
    snprintf(a, sizeof a, "%s", tt_path("run"));
    snprintf(hf, sizeof hf, "%s", tt_path("hf"));
    tmd_config c;
    small_run(&c, a, 6);
    set(&c, "data", token_file());
    set(&c, "val_fraction", "0.2");
    set(&c, "eval_batches", "0");
    set(&c, "vocab_size", "257");
    tmd_train_result res;
    run_ok(&c, &res);
    tmd_loaded_model m;
    cr_assert_eq(tmd_ckpt_load_model(a, -1, 2, &m, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_hf_export(m.ctx, m.model, hf, err, sizeof err), 0, "%s", err);
    tmd_loaded_model_free(&m);

    tmd_config e;
    tmd_config_defaults(&e);
    set(&e, "data", token_file());
    set(&e, "threads", "2");
    set(&e, "seq_len", "16");
    set(&e, "batch_size", "4");
    set(&e, "eval_batches", "0");
    double from_ckpt = NAN, from_hf = NAN;
    cr_assert_eq(tmd_eval_ckpt(&e, a, NULL, &from_ckpt, err, sizeof err), TMD_OK, "%s", err);
    set(&e, "init_from", hf);
    cr_assert_eq(tmd_eval(&e, NULL, &from_hf, err, sizeof err), TMD_OK, "%s", err);
    cr_assert_eq(from_ckpt, from_hf, "checkpoint %.17g vs export %.17g", from_ckpt, from_hf);
    /* apply_topk_weights_early is architecture too: a Mixtral export is always without it. */
    set(&e, "apply_topk_weights_early", "true");
    cr_assert_eq(tmd_eval(&e, NULL, &from_hf, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "apply_topk_weights_early") && strstr(err, "config.json"), "%s", err);
    set(&e, "apply_topk_weights_early", "false");
    set(&e, "n_layers", "3");
    cr_assert_eq(tmd_eval(&e, NULL, &from_hf, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "n_layers") && strstr(err, "config.json"), "%s", err);
}

/* A fresh run into a directory holding another run's checkpoints refuses to start (nothing
 * touched, status 2, the message says how to resume or overwrite); with overwrite it deletes
 * them. Pruning never deletes checkpoints of later steps than the one just written. */
Test(resume, fresh_run_refuses_an_earlier_runs_checkpoints) {
    char a[256], err[2048], path[512];
    snprintf(a, sizeof a, "%s", tt_path("o"));
    tmd_config c;
    small_run(&c, a, 9);
    set(&c, "save_every", "3");
    tmd_train_result res;
    run_ok(&c, &res);
    char metrics[512];
    snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", a);
    long n0;
    unsigned char *m0 = tt_slurp(metrics, &n0);
    tmd_config f;
    small_run(&f, a, 4);
    cr_assert_eq(tmd_train(&f, NULL, NULL, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "earlier run") && strstr(err, "step 9") && strstr(err, "--resume") &&
                  strstr(err, "--overwrite"),
              "%s", err);
    long n1;
    unsigned char *m1 = tt_slurp(metrics, &n1);
    cr_assert(n0 == n1 && !memcmp(m0, m1, (size_t)n0), "metrics.jsonl untouched");
    int64_t *steps;
    int n;
    cr_assert_eq(tmd_ckpt_list(a, &steps, &n, err, sizeof err), 0);
    cr_assert_eq(n, 3, "3, 6, 9 kept (keep_last 3)");
    free(steps);

    /* Resume from step 3 into the same directory up to step 5 with keep_last 1: each save
     * prunes only checkpoints up to its own step, so 6 and 9 (later steps, left by the earlier
     * run) stay and the run's own newest (5) survives. */
    tmd_config r;
    small_run(&r, a, 5);
    set(&r, "keep_last", "1");
    set(&r, "save_every", "4");
    tmd_ckpt_path(a, 3, path, sizeof path);
    snprintf(r.resume, sizeof r.resume, "%s", path);
    run_ok(&r, &res);
    cr_assert_eq(tmd_ckpt_list(a, &steps, &n, err, sizeof err), 0);
    cr_assert_eq(n, 3);
    cr_assert(steps[0] == 5 && steps[1] == 6 && steps[2] == 9, "%lld %lld %lld", (long long)steps[0],
              (long long)steps[1], (long long)steps[2]);
    free(steps);

    set(&f, "overwrite", "true");
    run_ok(&f, &res);
    cr_assert_eq(tmd_ckpt_list(a, &steps, &n, err, sizeof err), 0);
    cr_assert_eq(n, 1, "only the new run's checkpoint");
    cr_assert_eq(steps[0], 4);
    free(steps);
    free(m0);
    free(m1);
}

/* exit_interval (Megatron's --exit-interval) ends a run after a multiple of it, with a
 * checkpoint, exit status 0 and the schedule of the full run; a resume continues it exactly
 * (tests/gpu/e2e.sh replays a CPU trajectory on the GPU this way, 5 steps at a time). */
Test(resume, exit_interval_stops_with_a_checkpoint_and_resumes_exactly) {
    TT_WATCHDOG(120);
    char a[256], b[256], ck[512], fa[512], fb[512], ma[512], mb[512];
    snprintf(a, sizeof a, "%s", tt_path("a"));
    snprintf(b, sizeof b, "%s", tt_path("b"));
    tmd_config c, r;
    small_run(&c, a, 12);
    tmd_train_result ra, rb;
    run_ok(&c, &ra); /* the whole run, for reference */
    small_run(&r, b, 12);
    set(&r, "exit_interval", "5");
    run_ok(&r, &rb);
    cr_assert_eq(rb.steps, 5, "stopped after step 5, not %lld", (long long)rb.steps);
    tmd_ckpt_path(b, 5, ck, sizeof ck);
    cr_assert_eq(access(ck, F_OK), 0, "no checkpoint at step 5");
    for (int k = 0; k < 2; k++) { /* resume twice more: steps 6-10 (stops again), then 11-12 */
        tmd_config rr = r;
        snprintf(rr.resume, sizeof rr.resume, "%s", b);
        run_ok(&rr, &rb);
        cr_assert_eq(rb.steps, k == 0 ? 10 : 12);
    }
    tmd_ckpt_path(a, 12, fa, sizeof fa);
    tmd_ckpt_path(b, 12, fb, sizeof fb);
    assert_same_tensors(fa, fb);
    char la[64][40], lb[64][40];
    snprintf(ma, sizeof ma, "%s/metrics.jsonl", a);
    snprintf(mb, sizeof mb, "%s/metrics.jsonl", b);
    cr_assert_eq(losses(ma, 0, 12, la), 12);
    cr_assert_eq(losses(mb, 0, 12, lb), 12);
    for (int i = 0; i < 12; i++) cr_assert_str_eq(la[i], lb[i], "loss of step %d", i + 1);
    cr_assert_eq(ra.val_loss, rb.val_loss);
}

/* A run directory's newest checkpoint is opened under the name it has (issue 24, defect 6): a
 * file renamed by hand to ckpt-99.tmck was looked up as ckpt-00000099.tmck, which does not
 * exist. Of two names for one step the canonical one is taken. */
Test(resume, a_renamed_checkpoint_is_found_under_its_name) {
    const char *dir = tt_tmpdir_make("tm_rename_");
    const char *names[] = {"ckpt-00000007.tmck", "ckpt-99.tmck", "notes.txt"};
    for (int i = 0; i < 3; i++) {
        FILE *f = fopen(tt_path(names[i]), "w");
        cr_assert(f);
        fputs("x", f);
        fclose(f);
    }
    char path[1024], err[1024];
    cr_assert_eq(tmd_ckpt_resolve(dir, path, sizeof path, err, sizeof err), 0, "%s", err);
    char want[1024];
    snprintf(want, sizeof want, "%s/ckpt-99.tmck", dir);
    cr_assert_str_eq(path, want);
    FILE *f = fopen(tt_path("ckpt-00000099.tmck"), "w");
    cr_assert(f);
    fclose(f);
    cr_assert_eq(tmd_ckpt_resolve(dir, path, sizeof path, err, sizeof err), 0, "%s", err);
    snprintf(want, sizeof want, "%s/ckpt-00000099.tmck", dir);
    cr_assert_str_eq(path, want);
    tt_tmpdir_remove();
}

/* The same data file by another path (issue 24, defect 5): a run on DIR/tokens.bin resumed with
 * DIR/./tokens.bin (or through a symbolic link) was refused as "differs from the checkpoint".
 * The files are now compared by their tokens (count and fingerprint): the resume runs and equals
 * the run that never stopped; a file with other tokens is still refused, naming the fingerprints. */
Test(resume, the_same_data_by_another_path) {
    TT_WATCHDOG(120);
    char a[256], b[256], other[512], link[512], ck[512], fa[512], fb[512], err[2048];
    snprintf(a, sizeof a, "%s", tt_path("first"));
    snprintf(b, sizeof b, "%s", tt_path("second"));
    const char *data = token_file();
    tmd_config c;
    small_run(&c, a, 8);
    set(&c, "data", data);
    set(&c, "save_every", "4");
    run_ok(&c, NULL);
    snprintf(link, sizeof link, "%s", tt_path("tokens-link.bin"));
    cr_assert_eq(symlink(data, link), 0, "symlink: %s", strerror(errno));
    tmd_ckpt_path(a, 4, ck, sizeof ck);
    tmd_config r;
    small_run(&r, b, 8);
    set(&r, "data", link);
    set(&r, "save_every", "4");
    snprintf(r.resume, sizeof r.resume, "%s", ck);
    run_ok(&r, NULL);
    tmd_ckpt_path(a, 8, fa, sizeof fa);
    tmd_ckpt_path(b, 8, fb, sizeof fb);
    assert_same_tensors(fa, fb);
    /* a file holding other tokens: refused, naming the fingerprints */
    snprintf(other, sizeof other, "%s", tt_path("other.bin"));
    uint32_t tok[3000];
    for (int i = 0; i < 3000; i++) tok[i] = 'a' + (uint32_t)(i % 26);
    cr_assert_eq(tmd_tokens_write(other, tok, 3000, err, sizeof err), 0, "%s", err);
    tmd_config q;
    small_run(&q, tt_path("third"), 8);
    set(&q, "data", other);
    snprintf(q.resume, sizeof q.resume, "%s", ck);
    cr_assert_eq(tmd_train(&q, NULL, NULL, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "not the data checkpoint") && strstr(err, "fingerprint"), "%s", err);
}

/* ---- asynchronous saves (async_save, the default) --------------------------------------- */

/* Whether dir holds the temporary file of a save of `step` being written. */
static int writing(const char *dir, int step) {
    char pre[64];
    snprintf(pre, sizeof pre, "ckpt-%08d.tmck.tmp.", step);
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int found = 0;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, pre, strlen(pre))) found = 1;
    closedir(d);
    return found;
}

/* The whole file validated (every CRC), and its meta's step. */
static int64_t complete_checkpoint_step(const char *path) {
    tm_ctx *ctx = tt_ctx_threads(1);
    tm_ckpt_info *info = NULL;
    cr_assert_eq(tm_ckpt_inspect(ctx, path, &info), TM_OK, "%s", tm_ctx_errmsg(ctx));
    tm_ckpt_info_free(info);
    tm_ctx_free(ctx);
    tmd_config kc;
    tmd_ckpt_state st;
    char err[512];
    cr_assert_eq(tmd_ckpt_read_meta(path, &kc, &st, err, sizeof err), 0, "%s", err);
    return st.step;
}

/* Training goes on while a checkpoint is written (TINYMOE_CKPT_TEST_DELAY_MS holds each write
 * open for 400 ms, several steps), yet every checkpoint holds the state of its own step: the
 * same tensors as the synchronous saves of the same run, and the final ones agree. */
Test(resume, async_saves_hold_the_state_of_their_step) {
    TT_WATCHDOG(120);
    char a[256], b[256], fa[512], fb[512];
    snprintf(a, sizeof a, "%s", tt_path("async"));
    snprintf(b, sizeof b, "%s", tt_path("sync"));
    tmd_config c;
    small_run(&c, a, 12);
    set(&c, "save_every", "3");
    set(&c, "keep_last", "0");
    tmd_config s = c;
    set(&s, "out", b);
    set(&s, "async_save", "false");
    cr_assert(c.async_save, "async_save is on by default");
    tmd_train_result ra, rs;
    setenv("TINYMOE_CKPT_TEST_DELAY_MS", "400", 1);
    double t0 = tt_now();
    run_ok(&c, &ra);
    double ta = tt_now() - t0;
    unsetenv("TINYMOE_CKPT_TEST_DELAY_MS");
    run_ok(&s, &rs);
    /* 4 writes of >= 400 ms each, one at a time, the last one waited for */
    cr_assert(ta >= 1.6, "the writes were held open (%.2f s)", ta);
    for (int step = 3; step <= 12; step += 3) {
        tmd_ckpt_path(a, step, fa, sizeof fa);
        tmd_ckpt_path(b, step, fb, sizeof fb);
        cr_assert_eq(complete_checkpoint_step(fa), step);
        assert_same_tensors(fa, fb);
    }
    cr_assert_eq(ra.val_loss, rs.val_loss);
    cr_assert(!writing(a, 12), "no temporary file left");
}

/* kill -9 while a background write is in flight (the second save's temporary file exists,
 * training has gone on): the previous checkpoint is complete, and resuming from it equals a run
 * that was never interrupted, bit for bit. */
Test(resume, kill9_during_a_background_save_resumes_exactly) {
    TT_WATCHDOG(180);
    char a[256], ref[256], fa[512], fr[512], ck[512];
    snprintf(a, sizeof a, "%s", tt_path("killed"));
    snprintf(ref, sizeof ref, "%s", tt_path("straight"));
    tmd_config c;
    small_run(&c, a, 9);
    set(&c, "save_every", "3");
    fflush(NULL);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        setenv("TINYMOE_CKPT_TEST_DELAY_MS", "60000", 1); /* every write hangs until the kill */
        char err[2048];
        int rc = tmd_train(&c, NULL, NULL, err, sizeof err);
        fprintf(stderr, "child: ended by itself: rc %d: %s\n", rc, err);
        _exit(rc);
    }
    /* First the hook itself: a write held open for a minute is killed inside it, and leaves
     * no checkpoint at all (only its temporary file). */
    int ok = 0;
    for (int i = 0; i < 6000 && !ok; i++) {
        ok = writing(a, 3);
        if (!ok) usleep(10000);
    }
    cr_assert(ok, "no background write of step 3 seen");
    cr_assert_eq(kill(pid, SIGKILL), 0);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "child status %d", status);
    int64_t *steps;
    int n;
    char err[512];
    cr_assert_eq(tmd_ckpt_list(a, &steps, &n, err, sizeof err), 0, "%s", err);
    cr_assert_eq(n, 0, "the write held open by the hook never completed");
    free(steps);

    /* Now let the first write complete and kill the second: step 3 must be whole. */
    snprintf(a, sizeof a, "%s", tt_path("killed2"));
    set(&c, "out", a);
    fflush(NULL);
    pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        setenv("TINYMOE_CKPT_TEST_DELAY_MS", "1500", 1);
        char e2[2048];
        int rc = tmd_train(&c, NULL, NULL, e2, sizeof e2);
        fprintf(stderr, "child: rc %d: %s\n", rc, e2);
        _exit(rc);
    }
    tmd_ckpt_path(a, 3, ck, sizeof ck);
    struct stat sb;
    ok = 0;
    for (int i = 0; i < 6000 && !ok; i++) {
        ok = stat(ck, &sb) == 0 && writing(a, 6);
        if (!ok) usleep(5000);
    }
    cr_assert(ok, "never saw step 3 complete with step 6 being written");
    cr_assert_eq(kill(pid, SIGKILL), 0);
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "child status %d", status);
    cr_assert(writing(a, 6), "the kill landed inside the write of step 6");
    cr_assert_eq(complete_checkpoint_step(ck), 3);
    cr_assert_eq(tmd_ckpt_list(a, &steps, &n, err, sizeof err), 0, "%s", err);
    cr_assert_eq(n, 1);
    cr_assert_eq(steps[0], 3);
    free(steps);

    tmd_config r = c;
    snprintf(r.resume, sizeof r.resume, "%s", a);
    tmd_train_result rr, rf;
    run_ok(&r, &rr); /* async saves again */
    tmd_config f = c;
    set(&f, "out", ref);
    set(&f, "async_save", "false");
    run_ok(&f, &rf);
    tmd_ckpt_path(a, 9, fa, sizeof fa);
    tmd_ckpt_path(ref, 9, fr, sizeof fr);
    assert_same_tensors(fa, fr);
    cr_assert(!writing(a, 6), "the resumed run swept the killed write's temporary file");
    cr_assert_eq(rr.val_loss, rf.val_loss);
    char la[8][40], lf[8][40], ma[512], mf[512];
    snprintf(ma, sizeof ma, "%s/metrics.jsonl", a);
    snprintf(mf, sizeof mf, "%s/metrics.jsonl", ref);
    cr_assert_eq(losses(ma, 3, 9, la), 6);
    cr_assert_eq(losses(mf, 3, 9, lf), 6);
    for (int i = 0; i < 6; i++) cr_assert_str_eq(la[i], lf[i], "loss of step %d", 4 + i);
}

/* SIGTERM while a background write is in flight: the run stops after its step, waits for that
 * write, saves the step it stopped at, and exits 128 + 15 only once that file is complete. */
Test(resume, sigterm_during_a_background_save_completes_it) {
    TT_WATCHDOG(180);
    char a[256];
    snprintf(a, sizeof a, "%s", tt_path("term"));
    tmd_config c;
    small_run(&c, a, 100000);
    set(&c, "save_every", "5");
    set(&c, "keep_last", "0");
    set(&c, "lr_schedule", "constant");
    fflush(NULL);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        setenv("TINYMOE_CKPT_TEST_DELAY_MS", "1000", 1);
        char err[2048];
        int rc = tmd_train(&c, NULL, NULL, err, sizeof err);
        if (rc != 128 + SIGTERM) fprintf(stderr, "child: rc %d: %s\n", rc, err);
        _exit(rc);
    }
    int ok = 0;
    for (int i = 0; i < 6000 && !ok; i++) {
        ok = writing(a, 5);
        if (!ok) usleep(5000);
    }
    cr_assert(ok, "no background write of step 5 seen");
    cr_assert_eq(kill(pid, SIGTERM), 0);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM, "child status %d", status);
    char ck[512], p5[512], err[512];
    tmd_ckpt_path(a, 5, p5, sizeof p5);
    cr_assert_eq(complete_checkpoint_step(p5), 5, "the write in flight completed");
    cr_assert_eq(tmd_ckpt_resolve(a, ck, sizeof ck, err, sizeof err), 0, "%s", err);
    int64_t step = complete_checkpoint_step(ck);
    /* the step it stopped at: the last one trained (every step is logged) */
    static char l[2000][40];
    char m[512];
    cr_assert(step >= 5 && step < 2000, "stopped at step %lld", (long long)step);
    snprintf(m, sizeof m, "%s/metrics.jsonl", a);
    int nl = losses(m, 0, (int)step, l);
    cr_assert_eq(nl, step, "steps 1..%lld logged", (long long)step);
    cr_assert_eq(losses(m, (int)step, 100000, l), 0, "no step trained after the checkpoint's");
    cr_assert(step >= 5, "stopped at step %lld", (long long)step);
    cr_assert(!writing(a, (int)step) && !writing(a, 5), "no temporary file left");
    cr_log_info("SIGTERM during the background write of step 5: stopped at step %lld", (long long)step);
}

/* Plots and the clock after a resume (issue 23, item 5): a run of 20 steps resumed to 40 draws
 * loss.svg with as many points and experts.svg with as many cells as a straight run of 40 (the
 * restored history is per step, the per-expert loads come back from metrics.jsonl's "experts"
 * records), and elapsed_s goes on from where the first process stopped. */
static int count_of(const char *text, const char *what) {
    int n = 0;
    for (const char *p = strstr(text, what); p; p = strstr(p + 1, what)) n++;
    return n;
}

static int first_polyline_points(const char *svg) {
    const char *p = strstr(svg, "<polyline");
    cr_assert_not_null(p, "no polyline in loss.svg");
    p = strstr(p, "points=\"");
    cr_assert_not_null(p);
    p += 8;
    int n = 0;
    for (; *p && *p != '"'; p++)
        if (*p == ',') n++;
    return n;
}

Test(resume, plots_and_clock_are_whole_after_a_resume) {
    tt_tmpdir_make("tinymoe_resume_plots_");
    char a[256], b[256];
    snprintf(a, sizeof a, "%s", tt_path("straight"));
    snprintf(b, sizeof b, "%s", tt_path("split"));
    char *straight[] = {(char *)tt_tinymoe(), "train", "--preset", "tiny", "--steps", "40", "--log_every", "10",
                        "--sample_tokens", "0", "--out", a, NULL};
    char *first[] = {(char *)tt_tinymoe(), "train", "--preset", "tiny", "--steps", "20", "--log_every", "10",
                     "--sample_tokens", "0", "--out", b, NULL};
    char *second[] = {(char *)tt_tinymoe(), "train", "--resume", b, "--steps", "40", NULL};
    char log[300];
    snprintf(log, sizeof log, "%s", tt_path("log"));
    cr_assert_eq(tt_run(straight, log, 120, NULL), 0);
    cr_assert_eq(tt_run(first, log, 120, NULL), 0);
    cr_assert_eq(tt_run(second, log, 120, NULL), 0);
    char pa[300], pb[300];
    long len;
    snprintf(pa, sizeof pa, "%s/loss.svg", a);
    snprintf(pb, sizeof pb, "%s/loss.svg", b);
    char *la = (char *)tt_slurp(pa, &len), *lb = (char *)tt_slurp(pb, &len);
    cr_assert_eq(first_polyline_points(lb), first_polyline_points(la), "loss.svg: %d points after a resume, %d straight",
                 first_polyline_points(lb), first_polyline_points(la));
    free(la), free(lb);
    snprintf(pa, sizeof pa, "%s/experts.svg", a);
    snprintf(pb, sizeof pb, "%s/experts.svg", b);
    char *ea = (char *)tt_slurp(pa, &len), *eb = (char *)tt_slurp(pb, &len);
    cr_assert_eq(count_of(eb, "<rect x="), count_of(ea, "<rect x="), "experts.svg: %d cells after a resume, %d straight",
                 count_of(eb, "<rect x="), count_of(ea, "<rect x="));
    free(ea), free(eb);
    snprintf(pb, sizeof pb, "%s/metrics.jsonl", b);
    char *m = (char *)tt_slurp(pb, &len);
    cr_assert_eq(count_of(m, "\"type\": \"experts\""), 4, "experts records:\n%s", m);
    double last = -1;
    int seen = 0;
    for (const char *p = strstr(m, "\"elapsed_s\": "); p; p = strstr(p + 1, "\"elapsed_s\": ")) {
        double e = strtod(p + 13, NULL);
        cr_assert(e >= last, "elapsed_s went back from %g to %g:\n%s", last, e, m);
        last = e, seen++;
    }
    cr_assert_eq(seen, 4, "%s", m);
    free(m);
    tt_tmpdir_remove();
}
