/* test_generate.c — the driver's generation: tmd_generate (train/generate.c) against a
 * reference that recomputes tm_model_forward on the whole window for every token with the same
 * sampler and counters (greedy and sampled streams, a window that slides several times, a
 * prompt longer than the window, stopping at the end-of-text token, tiny windows, bad
 * arguments); and `tinymoe sample` (train/sample.c): its flags, and its output on a checkpoint
 * against the same reference. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "common.h"
#include "config.h"
#include "generate.h"
#include "sample.h"
#include "status.h"

static tm_model_config cfg_small(int max_seq_len) {
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 29;
    c.d_model = 16;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.max_seq_len = max_seq_len;
    c.init_std = 0.4;
    c.first_k_dense = 1;
    c.dense_ffn_size = 16;
    c.moe.ffn_size = 12;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    return c;
}

/* The documented window rule, with the logits of a full forward of the window each time. */
static int reference(tm_ctx *ctx, tm_model *m, const int32_t *prompt, int n_prompt, int max_new,
                     const tm_sampler_config *sc, int eot, int32_t *out) {
    const tm_model_config *c = tm_model_get_config(m);
    int S = c->max_seq_len, V = c->vocab_size, keep = S / 2 > 0 ? S / 2 : 1;
    int32_t *win = malloc(sizeof(int32_t) * (size_t)S);
    float *lg = malloc(sizeof(float) * (size_t)S * (size_t)V);
    int n = n_prompt < S ? n_prompt : S, count = 0;
    memcpy(win, prompt + n_prompt - n, sizeof(int32_t) * (size_t)n);
    for (int g = 0; g < max_new;) {
        int64_t shape[2] = {1, n};
        tm_tensor *tok;
        tm_model_out o;
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, shape, tm_cpu(), TM_I32, win, &tok));
        TT_OK(ctx, tm_model_forward(m, tok, NULL, &o));
        TT_OK(ctx, tm_tensor_read(ctx, o.logits, TM_F32, lg, (int64_t)n * V));
        int next;
        TT_OK(ctx, tm_sample_token(ctx, lg + (size_t)(n - 1) * V, V, sc, (uint64_t)(n_prompt + g), &next));
        tm_ctx_arena_reset(ctx);
        if (next == eot) break;
        out[count++] = next;
        if (++g == max_new) break;
        if (n == S) {
            memmove(win, win + n - (keep - 1), sizeof(int32_t) * (size_t)(keep - 1));
            n = keep - 1;
        }
        win[n++] = next;
    }
    free(lg);
    free(win);
    return count;
}

/* tmd_generate into memory: the bytes written, their count in *len. */
static unsigned char *generate(tm_ctx *ctx, tm_model *m, const int32_t *prompt, int n_prompt, int max_new,
                               const tm_sampler_config *sc, int eot, int64_t *n_gen, size_t *len) {
    char *buf = NULL, err[512] = "";
    size_t sz = 0;
    FILE *f = open_memstream(&buf, &sz);
    cr_assert(f);
    int rc = tmd_generate(ctx, m, prompt, n_prompt, max_new, sc, eot, NULL, f, n_gen, err, sizeof err);
    cr_assert_eq(rc, 0, "tmd_generate: %s", err);
    fclose(f);
    *len = sz;
    return (unsigned char *)buf;
}

static void check_same(tm_model_config c, tm_dtype dt, int n_prompt, int max_new, tm_sampler_config sc) {
    tm_ctx *ctx = tt_ctx();
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c, dt, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, 21));
    int32_t prompt[64];
    for (int i = 0; i < n_prompt; i++) prompt[i] = (int32_t)((7 * i + 3) % c.vocab_size);
    int32_t *want = malloc(sizeof(int32_t) * (size_t)max_new);
    int n_want = reference(ctx, m, prompt, n_prompt, max_new, &sc, -1, want);
    cr_assert_eq(n_want, max_new);
    int64_t n_gen = -1;
    size_t len = 0;
    unsigned char *got = generate(ctx, m, prompt, n_prompt, max_new, &sc, -1, &n_gen, &len);
    cr_assert_eq(n_gen, max_new);
    cr_assert_eq(len, (size_t)max_new, "%zu bytes written for %d tokens", len, max_new);
    for (int i = 0; i < max_new; i++)
        cr_assert_eq(got[i], want[i], "token %d: cached %d, reference %d", i, got[i], want[i]);
    /* The stream is not constant (the comparison above means something). */
    int distinct = 0;
    for (int i = 1; i < max_new; i++) distinct |= want[i] != want[0];
    cr_assert(distinct, "every generated token is %d", want[0]);
    free(got);

    /* End-of-text: stop before the first occurrence of a token the stream contains (not printed,
     * not counted). */
    int eot = want[max_new / 2], first = 0;
    while (want[first] != eot) first++;
    got = generate(ctx, m, prompt, n_prompt, max_new, &sc, eot, &n_gen, &len);
    cr_assert_eq(n_gen, first);
    cr_assert_eq(len, (size_t)first);
    for (int i = 0; i < first; i++) cr_assert_eq(got[i], want[i]);
    free(got);
    free(want);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

static tm_sampler_config greedy(void) {
    tm_sampler_config sc = tm_sampler_config_default();
    sc.temperature = 0;
    return sc;
}

static tm_sampler_config sampled(void) {
    tm_sampler_config sc = tm_sampler_config_default();
    sc.temperature = 1.0;
    sc.top_p = 0.95;
    sc.seed = 1234;
    return sc;
}

/* Window 12: 3 prompt tokens + 40 generated cross the slide (12 -> 6) four times. */
Test(generate, greedy_matches_full_recompute_across_slides) { check_same(cfg_small(12), TM_F32, 3, 40, greedy()); }
Test(generate, sampled_matches_full_recompute_across_slides) { check_same(cfg_small(12), TM_F32, 3, 40, sampled()); }
Test(generate, top_k_sampling_matches) {
    tm_sampler_config sc = sampled();
    sc.top_k = 5;
    sc.temperature = 0.7;
    check_same(cfg_small(12), TM_F32, 5, 30, sc);
}
/* A prompt of 20 tokens for a window of 12: only its last 12 are seen. */
Test(generate, prompt_longer_than_the_window) { check_same(cfg_small(12), TM_F32, 20, 25, sampled()); }
/* Windows of 1 (every token re-prefilled alone) and 3 (keep 1). */
Test(generate, tiny_windows) {
    check_same(cfg_small(1), TM_F32, 2, 10, sampled());
    check_same(cfg_small(3), TM_F32, 2, 12, sampled());
}
Test(generate, bf16_model) { check_same(cfg_small(10), TM_BF16, 4, 25, sampled()); }

/* Counters are absolute indices: the same prompt, seed and model generate the same text
 * whatever the window, as long as the window never slides; a different seed does not. */
Test(generate, seed_and_counters) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = cfg_small(32);
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, 3));
    int32_t prompt[2] = {1, 2};
    tm_sampler_config sc = sampled();
    int64_t n;
    size_t la, lb, lc;
    unsigned char *a = generate(ctx, m, prompt, 2, 20, &sc, -1, &n, &la);
    unsigned char *b = generate(ctx, m, prompt, 2, 20, &sc, -1, &n, &lb);
    sc.seed++;
    unsigned char *d = generate(ctx, m, prompt, 2, 20, &sc, -1, &n, &lc);
    cr_assert(la == 20 && lb == 20 && lc == 20);
    cr_assert_eq(memcmp(a, b, 20), 0, "same seed, different text");
    cr_assert_neq(memcmp(a, d, 20), 0, "another seed, same text");
    free(a), free(b), free(d);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(generate, bad_arguments) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = cfg_small(8);
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, 3));
    tm_sampler_config sc = greedy();
    char err[256];
    int64_t n = -1;
    int32_t prompt[2] = {1, 29};
    FILE *f = tmpfile();
    cr_assert_eq(tmd_generate(ctx, m, prompt, 0, 5, &sc, -1, NULL, f, &n, err, sizeof err), TMD_RUNTIME_ERROR);
    cr_assert(strstr(err, "prompt is empty"), "%s", err);
    cr_assert_eq(n, 0);
    cr_assert_eq(tmd_generate(ctx, m, prompt, 2, 5, &sc, -1, NULL, f, &n, err, sizeof err), TMD_RUNTIME_ERROR);
    cr_assert(strstr(err, "prompt token 1 = 29"), "%s", err);
    cr_assert_eq(tmd_generate(ctx, m, prompt, 1, -1, &sc, -1, NULL, f, &n, err, sizeof err), TMD_RUNTIME_ERROR);
    cr_assert(strstr(err, "max_new_tokens = -1"), "%s", err);
    cr_assert_eq(tmd_generate(ctx, m, prompt, 1, 5, NULL, -1, NULL, f, &n, err, sizeof err), TMD_RUNTIME_ERROR);
    cr_assert(strstr(err, "sampler config is NULL"), "%s", err);
    sc.top_p = 0;
    cr_assert_eq(tmd_generate(ctx, m, prompt, 1, 5, &sc, -1, NULL, f, &n, err, sizeof err), TMD_RUNTIME_ERROR);
    cr_assert(strstr(err, "top_p = 0"), "%s", err);
    sc.top_p = 1;
    cr_assert_eq(tmd_generate(ctx, m, prompt, 1, 0, &sc, -1, NULL, f, &n, err, sizeof err), 0);
    cr_assert_eq(n, 0);
    cr_assert_eq(ftell(f), 0, "nothing written");
    fclose(f);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* ---- tinymoe sample ---------------------------------------------------------------------- */

static void cmd_setup(void) { tt_tmpdir_make("tm_test_sample_"); }
static void cmd_teardown(void) { tt_tmpdir_remove(); }
TestSuite(sample_cmd, .init = cmd_setup, .fini = cmd_teardown);

static int parse(int argc, const char **argv, tmd_sample_opts *o, char *err, size_t errlen) {
    int help = -1;
    int rc = tmd_sample_parse(argc, (char **)argv, o, &help, err, errlen);
    cr_assert_eq(help, 0);
    return rc;
}

Test(sample_cmd, defaults_and_spellings) {
    tmd_sample_opts o;
    char err[512];
    const char *a[] = {"--ckpt", "run"};
    cr_assert_eq(parse(2, a, &o, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(o.ckpt, "run");
    cr_assert_str_eq(o.prompt, "\n");
    cr_assert_eq(o.tokens, 256);
    cr_assert_eq(o.sampler.temperature, 0.8);
    cr_assert_eq(o.sampler.top_k, 0);
    cr_assert_eq(o.sampler.top_p, 1.0);
    cr_assert_eq(o.sampler.seed, 0);
    cr_assert_eq(o.device, -1);
    cr_assert_eq(o.threads, 0);
    const char *b[] = {"--prompt=", "--top-k", "7", "--top_p=0.5", "--ckpt=x.tmck", "--tokens", "3", "--seed",
                       "18446744073709551615", "--temperature=0", "--device", "cpu", "--threads=2", "--top_k=9",
                       "--prompt", "--tokens"};
    cr_assert_eq(parse(16, b, &o, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(o.ckpt, "x.tmck");
    cr_assert_str_eq(o.prompt, "--tokens", "a separate value is taken as it is");
    cr_assert_eq(o.tokens, 3);
    cr_assert_eq(o.sampler.top_k, 9, "the last occurrence wins");
    cr_assert_eq(o.sampler.top_p, 0.5);
    cr_assert_eq(o.sampler.seed, UINT64_MAX);
    cr_assert_eq(o.sampler.temperature, 0);
    cr_assert_eq(o.device, TMD_DEVICE_CPU);
    cr_assert_eq(o.threads, 2);
    const char *h[] = {"--tokens", "oops", "-h"};
    int help = 0;
    cr_assert_eq(tmd_sample_parse(3, (char **)h, &o, &help, err, sizeof err), 0);
    cr_assert_eq(help, 1);
}

Test(sample_cmd, usage_errors_name_the_flag_and_the_value) {
    struct { int argc; const char *argv[4]; const char *a, *b; } bad[] = {
        {0, {NULL}, "--ckpt CKPT is required", NULL},
        {1, {"--ckpt"}, "--ckpt needs a value", NULL},
        {2, {"--ckpt", ""}, "--ckpt needs a checkpoint", NULL},
        {3, {"--ckpt", "r", "stray"}, "unexpected argument 'stray'", NULL},
        {3, {"--ckpt", "r", "--bogus=1"}, "unknown flag '--bogus=1'", NULL},
        {4, {"--ckpt", "r", "--tokens", "-3"}, "--tokens", "'-3'"},
        {4, {"--ckpt", "r", "--tokens", "12x"}, "--tokens", "'12x'"},
        {4, {"--ckpt", "r", "--temperature", "-0.5"}, "--temperature", "'-0.5'"},
        {4, {"--ckpt", "r", "--temperature", "nan"}, "--temperature", "'nan'"},
        {4, {"--ckpt", "r", "--top-k", "-1"}, "--top-k", "'-1'"},
        {3, {"--ckpt", "r", "--top_p=0"}, "--top_p needs a number in (0, 1]", "'0'"},
        {4, {"--ckpt", "r", "--top-p", "1.01"}, "--top-p", "'1.01'"},
        {4, {"--ckpt", "r", "--seed", "-1"}, "--seed", "'-1'"},
        {4, {"--ckpt", "r", "--device", "gpu"}, "--device needs cpu or cuda", "'gpu'"},
        {4, {"--ckpt", "r", "--threads", "-2"}, "--threads", "'-2'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        tmd_sample_opts o;
        char err[512] = "";
        cr_assert_eq(parse(bad[i].argc, bad[i].argv, &o, err, sizeof err), TMD_CONFIG_ERROR, "case %zu", i);
        cr_assert(strstr(err, bad[i].a), "case %zu: '%s' not in: %s", i, bad[i].a, err);
        if (bad[i].b) cr_assert(strstr(err, bad[i].b), "case %zu: '%s' not in: %s", i, bad[i].b, err);
    }
}

/* Run tmd_sample_main with stdout and stderr sent to files; returns its status. */
static int run_sample(int argc, const char **argv, const char *out, const char *errf) {
    fflush(stdout);
    fflush(stderr);
    int so = dup(1), se = dup(2);
    int fo = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644), fe = open(errf, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    cr_assert(so >= 0 && se >= 0 && fo >= 0 && fe >= 0);
    dup2(fo, 1);
    dup2(fe, 2);
    int rc = tmd_sample_main(argc, (char **)argv);
    fflush(stdout);
    fflush(stderr);
    dup2(so, 1);
    dup2(se, 2);
    close(fo), close(fe), close(so), close(se);
    return rc;
}

/* A byte-level model saved as a driver checkpoint; `tinymoe sample` on its directory prints
 * the prompt, the reference's tokens and a newline, and a summary on stderr. */
Test(sample_cmd, samples_a_checkpoint_like_the_reference) {
    tmd_config c;
    tmd_config_defaults(&c);
    const char *kv[][2] = {{"vocab_size", "257"}, {"d_model", "16"},     {"n_layers", "2"},
                           {"n_heads", "2"},      {"n_kv_heads", "1"},   {"seq_len", "10"},
                           {"num_experts", "4"},  {"topk", "2"},         {"expert_ffn_size", "8"},
                           {"init_std", "0.3"},   {"first_k_dense", "1"}};
    char err[1024];
    for (size_t i = 0; i < sizeof kv / sizeof *kv; i++)
        cr_assert_eq(tmd_config_set(&c, kv[i][0], kv[i][1], TMD_SRC_FLAG, "test", err, sizeof err), 0, "%s", err);
    tmd_config_resolve(&c);
    tm_ctx *ctx = tt_ctx();
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c.model, TM_F32, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, 99));
    tmd_ckpt_state st = {.step = 7, .data_position = 0};
    size_t len;
    char *meta = tmd_ckpt_meta_encode(&c, &st, &len);
    char path[1024];
    tmd_ckpt_path(tt_path("run"), 7, path, sizeof path);
    cr_assert_eq(mkdir(tt_path("run"), 0755), 0);
    TT_OK(ctx, tm_ckpt_save(ctx, path, meta, len));
    free(meta);

    const char *prompt = "ab";
    int32_t ptok[2] = {'a', 'b'};
    tm_sampler_config sc = tm_sampler_config_default();
    sc.temperature = 0.9;
    sc.top_k = 40;
    sc.seed = 5;
    int32_t want[25];
    int n_want = reference(ctx, m, ptok, 2, 25, &sc, 256, want);
    const char *argv[] = {"--ckpt", tt_path("run"), "--prompt", prompt, "--tokens", "25", "--temperature", "0.9",
                          "--top-k=40", "--seed", "5", "--threads", "1"};
    int rc = run_sample(13, argv, tt_path("out.txt"), tt_path("err.txt"));
    long n_out = 0, n_err = 0;
    unsigned char *out = tt_slurp(tt_path("out.txt"), &n_out);
    char *log = (char *)tt_slurp(tt_path("err.txt"), &n_err);
    log[n_err] = 0; /* tt_slurp leaves room for it */
    cr_assert_eq(rc, 0, "%s", log);
    int n_bytes = 0;
    unsigned char expect[64];
    expect[n_bytes++] = 'a', expect[n_bytes++] = 'b';
    for (int i = 0; i < n_want; i++)
        if (want[i] < 256) expect[n_bytes++] = (unsigned char)want[i];
    expect[n_bytes++] = '\n';
    cr_assert_eq(n_out, n_bytes, "stdout has %ld bytes, expected %d", n_out, n_bytes);
    cr_assert_eq(memcmp(out, expect, (size_t)n_bytes), 0, "stdout differs from prompt + reference + newline");
    char summary[128];
    snprintf(summary, sizeof summary, "sampled %d tokens", n_want);
    cr_assert(n_err > 0 && strstr(log, summary) && strstr(log, "tokens/s") && strstr(log, "step 7"), "stderr: %.*s",
              (int)n_err, log);
    free(out);
    free(log);

    /* A missing checkpoint is a usage error. */
    const char *missing[] = {"--ckpt", tt_path("nothing-here")};
    cr_assert_eq(run_sample(2, missing, tt_path("out.txt"), tt_path("err.txt")), TMD_CONFIG_ERROR);
    tm_model_free(m);
    tm_ctx_free(ctx);

    /* A model of 64 tokens (not byte-level) and no tokenizer: its text cannot be encoded or
     * decoded, so sample refuses, saying what to give, and prints nothing (it used to encode the
     * prompt as bytes and drop every token >= 256 it drew). */
    cr_assert_eq(tmd_config_set(&c, "vocab_size", "64", TMD_SRC_FLAG, "test", err, sizeof err), 0, "%s", err);
    ctx = tt_ctx();
    TT_OK(ctx, tm_model_new(ctx, &c.model, TM_F32, tm_cpu(), &m));
    meta = tmd_ckpt_meta_encode(&c, &st, &len);
    TT_OK(ctx, tm_ckpt_save(ctx, tt_path("small.tmck"), meta, len));
    free(meta);
    const char *hi[] = {"--ckpt", tt_path("small.tmck"), "--prompt", "\x01\x3f\xc3\xa9"};
    cr_assert_eq(run_sample(4, hi, tt_path("out.txt"), tt_path("err.txt")), TMD_CONFIG_ERROR);
    log = (char *)tt_slurp(tt_path("err.txt"), &n_err);
    log[n_err] = 0;
    cr_assert(strstr(log, "vocab_size 64 but no tokenizer") && strstr(log, "--tokenizer"), "%s", log);
    free(log);
    const char *empty[] = {"--ckpt", tt_path("small.tmck"), "--prompt="};
    cr_assert_eq(run_sample(3, empty, tt_path("out.txt"), tt_path("err.txt")), TMD_CONFIG_ERROR);
    log = (char *)tt_slurp(tt_path("err.txt"), &n_err);
    log[n_err] = 0;
    cr_assert(strstr(log, "vocab_size 64 but no tokenizer"), "%s", log);
    free(log);
    out = tt_slurp(tt_path("out.txt"), &n_out);
    cr_assert_eq(n_out, 0, "printed %ld bytes", n_out);
    free(out);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* A checkpoint's tensors are logical: one written by a CUDA run (its meta says device = cuda)
 * samples on the CPU with --device cpu, the same text as a CPU checkpoint of the same model;
 * without --device on a machine without CUDA the error says to pass --device cpu. */
Test(sample_cmd, cuda_checkpoint_samples_on_the_cpu) {
    tmd_config c;
    tmd_config_defaults(&c);
    const char *kv[][2] = {{"vocab_size", "257"}, {"d_model", "16"},     {"n_layers", "2"},   {"n_heads", "2"},
                           {"n_kv_heads", "1"},   {"seq_len", "10"},     {"num_experts", "4"}, {"topk", "2"},
                           {"expert_ffn_size", "8"}, {"init_std", "0.3"}};
    char err[1024];
    for (size_t i = 0; i < sizeof kv / sizeof *kv; i++)
        cr_assert_eq(tmd_config_set(&c, kv[i][0], kv[i][1], TMD_SRC_FLAG, "test", err, sizeof err), 0, "%s", err);
    tmd_config_resolve(&c);
    tt_tmpdir_make("tm_sample_dev_");
    tm_ctx *ctx = tt_ctx();
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c.model, TM_F32, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, 3));
    tmd_ckpt_state st = {.step = 5, .data_position = 0};
    const char *names[2] = {"cpu.tmck", "cuda.tmck"};
    for (int k = 0; k < 2; k++) {
        c.device = k ? TMD_DEVICE_CUDA : TMD_DEVICE_CPU;
        size_t len;
        char *meta = tmd_ckpt_meta_encode(&c, &st, &len);
        TT_OK(ctx, tm_ckpt_save(ctx, tt_path(names[k]), meta, len));
        free(meta);
    }
    tm_model_free(m);
    tm_ctx_free(ctx);
    long n0 = 0, n1 = 0, ne = 0;
    const char *a_cpu[] = {"--ckpt", tt_path("cpu.tmck"), "--prompt", "ab", "--tokens", "12", "--seed", "3"};
    cr_assert_eq(run_sample(8, a_cpu, tt_path("out_cpu.txt"), tt_path("err.txt")), 0);
    const char *a_dev[] = {"--ckpt", tt_path("cuda.tmck"), "--prompt", "ab", "--tokens", "12", "--seed", "3",
                           "--device", "cpu"};
    cr_assert_eq(run_sample(10, a_dev, tt_path("out_dev.txt"), tt_path("err.txt")), 0);
    unsigned char *o0 = tt_slurp(tt_path("out_cpu.txt"), &n0), *o1 = tt_slurp(tt_path("out_dev.txt"), &n1);
    cr_assert(n0 > 3 && n0 == n1 && memcmp(o0, o1, (size_t)n0) == 0, "the two checkpoints sample differently");
    free(o0), free(o1);
    if (tm_cuda_device_count() == 0) {
        cr_assert_eq(run_sample(8, (const char *[]){"--ckpt", tt_path("cuda.tmck"), "--prompt", "ab", "--tokens", "12",
                                                     "--seed", "3"},
                                tt_path("out_dev.txt"), tt_path("err.txt")),
                     TMD_CONFIG_ERROR);
        char *log = (char *)tt_slurp(tt_path("err.txt"), &ne);
        log[ne] = 0;
        cr_assert(strstr(log, "trained on cuda") && strstr(log, "--device cpu"), "%s", log);
        free(log);
    }
    tt_tmpdir_remove();
}
