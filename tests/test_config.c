/* test_config.c — `tinymoe train` configuration: the key table, config files, flags, presets,
 * semantic checks naming their key, and data errors caught before anything is written. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "data.h"
#include "status.h"
#include "train.h"

/* A fresh temporary directory (removed by the test with rm_rf). */
static char *tmpdir(void) {
    char *d = strdup("/tmp/tinymoe_test_config_XXXXXX");
    cr_assert(mkdtemp(d), "mkdtemp");
    return d;
}

static void rm_rf(char *d) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", d);
    cr_assert_eq(system(cmd), 0);
    free(d);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    cr_assert(f, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
}

/* Parse a NULL-terminated argument list. */
static int parse(tmd_config *cfg, char *err, size_t errlen, const char *const *args) {
    char *argv[64];
    int argc = 0;
    while (args[argc]) {
        argv[argc] = (char *)args[argc];
        argc++;
    }
    int help = 0;
    return tmd_config_from_args(cfg, argc, argv, &help, err, errlen);
}
#define PARSE(cfg, err, ...) parse(cfg, err, sizeof err, (const char *[]){__VA_ARGS__, NULL})

#define HAS(s, sub) cr_assert(strstr((s), (sub)), "expected \"%s\" in: %s", (sub), (s))

Test(config, defaults_are_valid) {
    tmd_config c;
    tmd_config_defaults(&c);
    cr_assert_str_eq(c.data, "synthetic");
    cr_assert_eq(c.model.vocab_size, 0, "vocab_size defaults to auto");
    tmd_config_resolve(&c);
    cr_assert_eq(c.model.vocab_size, c.synthetic_vocab);
    cr_assert_eq(c.model.dense_ffn_size, 4 * c.model.d_model);
    cr_assert_float_eq(c.sched.min_lr, c.sched.lr / 10, 1e-15);
    char err[1024] = "";
    cr_assert_eq(tmd_config_validate(&c, err, sizeof err), 0, "%s", err);
    /* Token files: the byte-level vocabulary. */
    tmd_config_defaults(&c);
    snprintf(c.data, sizeof c.data, "x.bin");
    tmd_config_resolve(&c);
    cr_assert_eq(c.model.vocab_size, 257);
}

Test(config, unknown_key_in_file_names_line_and_suggests) {
    char *d = tmpdir(), path[256], err[1024] = "";
    snprintf(path, sizeof path, "%s/run.cfg", d);
    write_text(path, "# a comment\nsteps = 5\n\nlrr = 0.1\n");
    tmd_config c;
    cr_assert_eq(PARSE(&c, err, "--config", path), -1);
    HAS(err, "unknown key 'lrr'");
    HAS(err, "line 4 of ");
    HAS(err, "run.cfg");
    HAS(err, "did you mean 'lr'?");
    rm_rf(d);
}

Test(config, unknown_flag_suggests_closest) {
    tmd_config c;
    char err[1024] = "";
    cr_assert_eq(PARSE(&c, err, "--batch_sise", "4"), -1);
    HAS(err, "unknown key 'batch_sise'");
    HAS(err, "flag --batch_sise");
    HAS(err, "did you mean 'batch_size'?");
    cr_assert_eq(PARSE(&c, err, "--num-expert=4"), -1);
    HAS(err, "did you mean 'num_experts'?");
    /* Nothing close: no suggestion, a pointer to the list. */
    cr_assert_eq(PARSE(&c, err, "--zzzzzzzzzzzz", "1"), -1);
    cr_assert_null(strstr(err, "did you mean"), "%s", err);
    HAS(err, "--help");
}

/* Other trainers' names get tinymoe's key, not a near-miss spelling (block_size is nearer to
 * batch_size than to seq_len); an unknown flag before another flag is named itself. */
Test(config, other_tools_names_get_the_key) {
    static const char *const cases[][3] = {
        {"--block_size", "64", "nanoGPT's name; tinymoe's key is seq_len"},
        {"--learning_rate", "1e-3", "nanoGPT's name; tinymoe's key is lr"},
        {"--max_iters", "10", "tinymoe's key is steps"},
        {"--n_embd", "64", "tinymoe's key is d_model"},
        {"--gradient_accumulation_steps", "2", "tinymoe's key is grad_accum"},
        {"--moe-router-topk", "2", "Megatron-LM's name; tinymoe's key is topk"},
        {"--moe-aux-loss-coeff", "0.01", "tinymoe's key is aux_loss_coeff"},
        {"--expert-model-parallel-size", "2", "tinymoe's key is ep_size"},
        {"--num_experts_per_tok", "2", "Hugging Face's name; tinymoe's key is topk"},
        {"--moe-router-force-load-balancing", "true", "Megatron-LM's name; tinymoe's key is force_load_balance"},
        {"--debug_moe_force_load_balance", "true", "torchtitan's name; tinymoe's key is force_load_balance"},
        {"--moe_force_load_balance", "true", "tinymoe's key is force_load_balance"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tmd_config c;
        char err[1024] = "";
        cr_assert_eq(PARSE(&c, err, cases[i][0], cases[i][1]), -1, "%s was accepted", cases[i][0]);
        HAS(err, cases[i][2]);
        cr_assert_null(strstr(err, "did you mean"), "%s", err);
    }
    tmd_config c;
    char err[1024] = "";
    cr_assert_eq(PARSE(&c, err, "--compile", "--steps", "1"), -1);
    HAS(err, "unknown key 'compile' (flag --compile)");
    cr_assert_null(strstr(err, "unexpected argument"), "%s", err);
}

/* The text presets without their text say what to give. */
Test(config, a_text_preset_without_data_says_to_give_data) {
    tmd_config c;
    char err[1024] = "";
    cr_assert_eq(PARSE(&c, err, "--preset", "shakespeare"), 0, "%s", err);
    tmd_config_resolve(&c);
    cr_assert_neq(tmd_config_validate(&c, err, sizeof err), 0);
    HAS(err, "preset shakespeare trains on text: give --data");
    HAS(err, "tinymoe tokenize");
}

Test(config, malformed_values_name_key_value_and_type) {
    tmd_config c;
    char err[1024] = "";
    cr_assert_eq(PARSE(&c, err, "--steps", "ten"), -1);
    HAS(err, "key 'steps'");
    HAS(err, "integer");
    HAS(err, "'ten'");
    HAS(err, "flag --steps");
    cr_assert_eq(PARSE(&c, err, "--steps", "99999999999999999999999"), -1);
    HAS(err, "key 'steps'");
    cr_assert_eq(PARSE(&c, err, "--d_model", "3000000000"), -1, "out of int range");
    HAS(err, "key 'd_model'");
    cr_assert_eq(PARSE(&c, err, "--lr", "1e-3x"), -1);
    HAS(err, "key 'lr'");
    HAS(err, "number");
    HAS(err, "'1e-3x'");
    cr_assert_eq(PARSE(&c, err, "--lr", "nan"), -1, "non-finite");
    cr_assert_eq(PARSE(&c, err, "--score_function", "tanh"), -1);
    HAS(err, "key 'score_function'");
    HAS(err, "softmax|sigmoid");
    HAS(err, "'tanh'");
    cr_assert_eq(PARSE(&c, err, "--lr_schedule=exp"), -1);
    HAS(err, "constant|cosine|linear|wsd");
    cr_assert_eq(PARSE(&c, err, "--tie_embeddings", "maybe"), -1);
    HAS(err, "key 'tie_embeddings'");
    HAS(err, "true or false");
    cr_assert_eq(PARSE(&c, err, "--steps"), -1, "missing value");
    HAS(err, "--steps needs a value");
    cr_assert_eq(PARSE(&c, err, "steps", "5"), -1, "not a flag");
    HAS(err, "'steps'");

    /* In a file: the line number too. */
    char *d = tmpdir(), path[256];
    snprintf(path, sizeof path, "%s/bad.cfg", d);
    write_text(path, "lr = 0.1\ninit_std = small\n");
    cr_assert_eq(PARSE(&c, err, "--config", path), -1);
    HAS(err, "key 'init_std'");
    HAS(err, "line 2 of ");
    HAS(err, "'small'");
    write_text(path, "lr 0.1\n");
    cr_assert_eq(PARSE(&c, err, "--config", path), -1);
    HAS(err, "line 1 of ");
    HAS(err, "key = value");
    write_text(path, "sample_prompt = \"abc\n");
    cr_assert_eq(PARSE(&c, err, "--config", path), -1);
    HAS(err, "unterminated");
    rm_rf(d);

    cr_assert_eq(PARSE(&c, err, "--config", "/nonexistent/run.cfg"), -1);
    HAS(err, "/nonexistent/run.cfg");
}

Test(config, file_syntax_and_flags_override_file) {
    char *d = tmpdir(), path[256], err[1024] = "";
    snprintf(path, sizeof path, "%s/run.cfg", d);
    write_text(path, "  # comment\n"
                     "steps = 5          # trailing comment\n"
                     "lr=0.002\n"
                     "\n"
                     "score_function = sigmoid\n"
                     "sample_prompt = \"ROMEO: # not a comment\\n\"  # but this is\n"
                     "tie_embeddings = yes\n");
    tmd_config c;
    cr_assert_eq(PARSE(&c, err, "--steps", "7", "--config", path, "--batch-size=3", "--nesterov"), 0, "%s", err);
    cr_assert_eq(c.sched.total_steps, 7, "the flag wins over the file, wherever it is");
    cr_assert_float_eq(c.sched.lr, 0.002, 1e-15);
    cr_assert_eq(c.model.moe.router.score_function, TM_SCORE_SIGMOID);
    cr_assert_str_eq(c.sample_prompt, "ROMEO: # not a comment\n");
    cr_assert_eq(c.model.tie_embeddings, 1);
    cr_assert_eq(c.batch_size, 3, "dashes read as underscores");
    cr_assert_eq(c.sgd.nesterov, 1, "a bool flag alone means true");

    /* The printed config marks where each non-default came from. */
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    tmd_config_print(&c, f);
    fclose(f);
    HAS(buf, "steps                = 7");
    HAS(buf, "# flag");
    HAS(buf, "# config file");
    HAS(buf, "sample_prompt        = \"ROMEO: # not a comment\\n\"");
    free(buf);
    rm_rf(d);
}

/* The engine switches the library takes as options (no environment variables): keys that land
 * in tm_ctx_options.grouped_gemm and tm_comm_options.nccl. */
Test(config, engine_switches_are_keys) {
    char err[1024] = "";
    tmd_config c;
    cr_assert_eq(PARSE(&c, err, "--steps", "1"), 0, "%s", err);
    cr_assert_eq(c.grouped_gemm, TM_GROUPED_GEMM_AUTO);
    cr_assert_eq(c.nccl, TM_NCCL_AUTO);
    cr_assert_eq(PARSE(&c, err, "--grouped_gemm", "cublaslt"), 0, "%s", err);
    cr_assert_eq(c.grouped_gemm, TM_GROUPED_GEMM_CUBLASLT);
    cr_assert_eq(PARSE(&c, err, "--grouped_gemm", "device", "--nccl", "always"), 0, "%s", err);
    cr_assert_eq(c.grouped_gemm, TM_GROUPED_GEMM_DEVICE);
    cr_assert_eq(c.nccl, TM_NCCL_ALWAYS);
    cr_assert_eq(PARSE(&c, err, "--grouped_gemm", "hopper"), 0, "%s", err);
    cr_assert_eq(c.grouped_gemm, TM_GROUPED_GEMM_HOPPER);
    cr_assert_neq(PARSE(&c, err, "--grouped_gemm", "sm90"), 0);
    HAS(err, "grouped_gemm");
    cr_assert_eq(PARSE(&c, err, "--nccl", "off"), 0, "%s", err);
    cr_assert_eq(c.nccl, TM_NCCL_OFF);
    cr_assert_neq(PARSE(&c, err, "--nccl", "1"), 0);
    HAS(err, "nccl");
    /* Neither changes the trained state: both may change on resume. */
    cr_assert(tmd_config_key_resumable(tmd_config_key_index("grouped_gemm"), 0));
    cr_assert(tmd_config_key_resumable(tmd_config_key_index("nccl"), 0));
}

Test(config, presets_apply_before_file_and_flags) {
    tmd_config c;
    char err[1024] = "";
    cr_assert_eq(PARSE(&c, err, "--preset", "tiny"), 0, "%s", err);
    cr_assert_eq(c.model.d_model, 32);
    cr_assert_str_eq(c.preset, "tiny");
    cr_assert_eq(PARSE(&c, err, "--d_model", "48", "--preset", "tiny"), 0, "%s", err);
    cr_assert_eq(c.model.d_model, 48, "flags win over the preset");
    cr_assert_eq(PARSE(&c, err, "--preset", "small"), 0, "%s", err);
    cr_assert_eq(c.model.d_model, 128);
    cr_assert_eq(c.model.max_seq_len, 128);
    cr_assert_eq(c.model.moe.ffn_size, 256);
    cr_assert_eq(PARSE(&c, err, "--preset", "shakespeare"), 0, "%s", err);
    cr_assert_str_eq(c.sample_prompt, "ROMEO:");

    char *d = tmpdir(), path[256];
    snprintf(path, sizeof path, "%s/run.cfg", d);
    write_text(path, "preset = tiny\nn_layers = 3\n");
    cr_assert_eq(PARSE(&c, err, "--config", path), 0, "%s", err);
    cr_assert_eq(c.model.d_model, 32, "a preset named in the file");
    cr_assert_eq(c.model.n_layers, 3, "the file wins over its preset");
    cr_assert_eq(PARSE(&c, err, "--config", path, "--preset", "small"), 0, "%s", err);
    cr_assert_eq(c.model.d_model, 128, "--preset wins over the file's preset");
    cr_assert_eq(c.model.n_layers, 3);
    rm_rf(d);

    cr_assert_eq(PARSE(&c, err, "--preset", "huge"), -1);
    HAS(err, "key 'preset'");
    HAS(err, "tiny|small|shakespeare");
    HAS(err, "'huge'");
    /* Every preset gives a valid configuration. */
    const char *names[] = {"tiny", "small", "shakespeare"};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(PARSE(&c, err, "--preset", names[i], "--sample_prompt", ""), 0, "%s", err);
        tmd_config_resolve(&c);
        cr_assert_eq(tmd_config_validate(&c, err, sizeof err), 0, "preset %s: %s", names[i], err);
    }
}

Test(config, help_lists_every_key_with_default) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    tmd_config_help(f);
    fclose(f);
    tmd_config c;
    tmd_config_defaults(&c);
    cr_assert_geq(tmd_config_num_keys(), 60);
    for (int i = 0; i < tmd_config_num_keys(); i++) {
        char pat[96], def[128];
        snprintf(pat, sizeof pat, "\n  %s ", tmd_config_key_name(i));
        const char *line = strstr(buf, pat);
        cr_assert(line, "--help lacks key %s", tmd_config_key_name(i));
        /* The default shown on the key's line is the value the defaults hold. */
        tmd_config_format(&c, i, def, sizeof def);
        const char *eol = strchr(line + 1, '\n');
        char one[512];
        snprintf(one, sizeof one, "%.*s", (int)(eol - line - 1), line + 1);
        if (strcmp(def, "\"\"")) {
            /* Numbers may be spelled differently (1e-5 vs 1e-05): compare parsed values. */
            int found = strstr(one, def) != NULL;
            if (!found) {
                char *end;
                double v = strtod(def, &end);
                for (const char *p = one + strlen(tmd_config_key_name(i)) + 2; *p && !found; p++) {
                    char *e2;
                    double w = strtod(p, &e2);
                    if (e2 != p && *e2 == ' ' && w == v && *end == 0) found = 1;
                }
            }
            cr_assert(found, "key %s: default '%s' not on its help line: %s", tmd_config_key_name(i), def, one);
        }
    }
    HAS(buf, "presets");
    free(buf);
}

/* Parse flags, resolve, validate: the error message. */
static int check(char *err, size_t errlen, const char *const *args) {
    tmd_config c;
    if (parse(&c, err, errlen, args)) return -2;
    tmd_config_resolve(&c);
    return tmd_config_validate(&c, err, errlen);
}

Test(config, semantic_errors_name_the_key) {
    static const struct {
        const char *args[7], *key;
    } cases[] = {
        {{"--steps", "0"}, "steps"},
        {{"--batch_size", "0"}, "batch_size"},
        {{"--grad_accum", "0"}, "grad_accum"},
        {{"--seq_len", "0"}, "seq_len"},
        {{"--d_model", "0"}, "d_model"},
        {{"--n_layers", "0"}, "n_layers"},
        {{"--n_heads", "3"}, "n_heads"},
        {{"--n_kv_heads", "3"}, "n_kv_heads"},
        {{"--vocab_size", "8"}, "vocab_size"},
        {{"--rope_theta", "0"}, "rope_theta"},
        {{"--norm_eps", "-1"}, "norm_eps"},
        {{"--first_k_dense", "5"}, "first_k_dense"},
        {{"--init_std", "-0.1"}, "init_std"},
        {{"--num_experts", "0"}, "num_experts"},
        {{"--topk", "5"}, "topk"},
        {{"--expert_ffn_size", "0"}, "expert_ffn_size"},
        {{"--num_groups", "3"}, "num_groups"},
        {{"--num_groups", "2", "--group_topk", "3"}, "group_topk"},
        {{"--scaling_factor", "0"}, "scaling_factor"},
        {{"--expert_bias_rate", "-1"}, "expert_bias_rate"},
        {{"--aux_loss_coeff", "-1"}, "aux_loss_coeff"},
        {{"--seq_aux_loss_coeff", "-1"}, "seq_aux_loss_coeff"},
        {{"--z_loss_coeff", "-1"}, "z_loss_coeff"},
        {{"--align_size", "0"}, "align_size"},
        {{"--capacity_factor", "-1"}, "capacity_factor"},
        {{"--pad_to_capacity", "true"}, "pad_to_capacity"},
        {{"--shared_ffn_size", "-1"}, "shared_ffn_size"},
        {{"--lr", "-1"}, "lr"},
        {{"--min_lr", "1"}, "min_lr"},
        {{"--warmup_steps", "-1"}, "warmup_steps"},
        {{"--warmup_steps", "1000", "--steps", "10"}, "steps"},
        {{"--lr_schedule", "wsd", "--decay_fraction", "0"}, "decay_fraction"},
        {{"--beta1", "1"}, "beta1"},
        {{"--beta2", "-0.5"}, "beta2"},
        {{"--eps", "0"}, "eps"},
        {{"--weight_decay", "-1"}, "weight_decay"},
        {{"--optimizer", "sgd", "--momentum", "1"}, "momentum"},
        {{"--optimizer", "sgd", "--momentum", "0", "--nesterov", "true"}, "nesterov"},
        {{"--grad_clip", "-1"}, "grad_clip"},
        {{"--seed", "-1"}, "seed"},
        {{"--threads", "-1"}, "threads"},
        {{"--synthetic_vocab", "1"}, "synthetic_vocab"},
        {{"--synthetic_k", "0"}, "synthetic_k"},
        {{"--data", "x.bin", "--val_fraction", "1"}, "val_fraction"},
        {{"--data", ""}, "data"},
        {{"--val_data", "v.bin"}, "val_data"},
        {{"--eval_every", "-1"}, "eval_every"},
        {{"--eval_batches", "-1"}, "eval_batches"},
        {{"--log_every", "0"}, "log_every"},
        {{"--sample_prompt", "hello"}, "sample_prompt"},
        {{"--sample_tokens", "-1"}, "sample_tokens"},
        {{"--temperature", "-1"}, "temperature"},
        {{"--top_k", "-1"}, "top_k"},
        {{"--overlap_chunks", "0"}, "overlap_chunks"},
        {{"--overlap_chunks", "33", "--seq_len", "32"}, "overlap_chunks"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char err[1024] = "", want[64];
        int rc = check(err, sizeof err, cases[i].args);
        cr_assert_eq(rc, -1, "case %zu (%s %s): expected a semantic error, got %d: %s", i, cases[i].args[0],
                     cases[i].args[1], rc, err);
        snprintf(want, sizeof want, "key '%s'", cases[i].key);
        cr_assert(strstr(err, want), "case %zu (%s %s): expected \"%s\" in: %s", i, cases[i].args[0], cases[i].args[1],
                  want, err);
    }
    if (tm_cuda_device_count() == 0) {
        char err[1024] = "";
        cr_assert_eq(check(err, sizeof err, (const char *[]){"--device", "cuda", NULL}), -1);
        HAS(err, "key 'device'");
    }
}

/* A range error names where the value came from (issue 24, defect 3): a config file's line as
 * "file:line", a flag, a preset; the key alone said nothing of which of them set it. */
Test(config, semantic_errors_name_where_the_value_came_from) {
    char *d = tmpdir(), path[256], err[1024] = "", want[300];
    snprintf(path, sizeof path, "%s/run.conf", d);
    write_text(path, "steps = -1\n");
    cr_assert_eq(check(err, sizeof err, (const char *[]){"--config", path, NULL}), -1);
    snprintf(want, sizeof want, "%s:1: key 'steps' = -1: must be >= 1", path);
    cr_assert(!strncmp(err, want, strlen(want)), "expected \"%s\" at the start of: %s", want, err);
    write_text(path, "# two lines of comments\n\nbatch_size = 0\n");
    cr_assert_eq(check(err, sizeof err, (const char *[]){"--config", path, NULL}), -1);
    snprintf(want, sizeof want, "%s:3: key 'batch_size'", path);
    cr_assert(!strncmp(err, want, strlen(want)), "expected \"%s\" at the start of: %s", want, err);
    /* the flag wins over the file, and is named */
    cr_assert_eq(check(err, sizeof err, (const char *[]){"--config", path, "--batch_size", "-2", NULL}), -1);
    HAS(err, "flag --batch_size: key 'batch_size' = -2");
    rm_rf(d);
}

/* ---------------------------------------------------------------------------------------- */
/* Data errors: found before anything is written                                             */

static int train_args(char *err, size_t errlen, const char *out, const char *const *args) {
    tmd_config c;
    if (parse(&c, err, errlen, args)) return -2;
    snprintf(c.out, sizeof c.out, "%s", out);
    return tmd_train(&c, NULL, NULL, err, errlen);
}

static void write_tokens(const char *path, int n, uint32_t max) {
    uint32_t *t = malloc(sizeof *t * (size_t)n);
    for (int i = 0; i < n; i++) t[i] = (uint32_t)((i * 7u) % max);
    char err[256];
    cr_assert_eq(tmd_tokens_write(path, t, n, err, sizeof err), 0, "%s", err);
    free(t);
}

static int exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

Test(config, data_errors_name_the_file_and_write_nothing) {
    char *d = tmpdir(), out[256], good[256], bad[256], err[2048] = "";
    snprintf(out, sizeof out, "%s/out", d);
    snprintf(good, sizeof good, "%s/good.bin", d);
    snprintf(bad, sizeof bad, "%s/bad.bin", d);
    write_tokens(good, 5000, 257);

    /* Missing file. */
    cr_assert_eq(train_args(err, sizeof err, out, (const char *[]){"--data", "/nonexistent/train.bin", NULL}),
                 TMD_CONFIG_ERROR);
    HAS(err, "/nonexistent/train.bin");
    /* Missing validation file. */
    cr_assert_eq(
        train_args(err, sizeof err, out, (const char *[]){"--data", good, "--val_data", "/nonexistent/v.bin", NULL}),
        TMD_CONFIG_ERROR);
    HAS(err, "/nonexistent/v.bin");
    HAS(err, "val_data");
    /* A glob matching nothing. */
    char glob[300];
    snprintf(glob, sizeof glob, "%s/shard_*.bin", d);
    cr_assert_eq(train_args(err, sizeof err, out, (const char *[]){"--data", glob, NULL}), TMD_CONFIG_ERROR);
    HAS(err, "shard_*.bin");
    /* Wrong magic: text, the usual first mistake, gets the command that makes a token file of it. */
    write_text(bad, "this is not a token file, just text that is long enough to be read as a header.........");
    cr_assert_eq(train_args(err, sizeof err, out, (const char *[]){"--data", bad, NULL}), TMD_CONFIG_ERROR);
    HAS(err, "bad.bin");
    HAS(err, "it looks like text");
    HAS(err, "'tinymoe tokenize ");
    /* Binary that is no token file: no text hint. */
    {
        FILE *f = fopen(bad, "wb");
        cr_assert_not_null(f);
        for (int i = 0; i < 2048; i++) fputc(i % 7 == 0 ? 0 : 200 + i % 50, f);
        fclose(f);
    }
    cr_assert_eq(train_args(err, sizeof err, out, (const char *[]){"--data", bad, NULL}), TMD_CONFIG_ERROR);
    HAS(err, "not a token file");
    cr_assert_null(strstr(err, "looks like text"), "%s", err);
    /* A token >= vocab_size. */
    write_tokens(bad, 5000, 300);
    cr_assert_eq(train_args(err, sizeof err, out, (const char *[]){"--data", bad, NULL}), TMD_CONFIG_ERROR);
    HAS(err, "bad.bin");
    HAS(err, "257");
    /* A batch larger than the data. */
    cr_assert_eq(train_args(err, sizeof err, out,
                            (const char *[]){"--data", good, "--batch_size", "100", "--seq_len", "64", NULL}),
                 TMD_CONFIG_ERROR);
    HAS(err, "key 'batch_size' = 100");
    HAS(err, "good.bin");
    /* A validation split shorter than one sequence. */
    cr_assert_eq(train_args(err, sizeof err, out,
                            (const char *[]){"--data", good, "--val_fraction", "0.01", "--seq_len", "64", NULL}),
                 TMD_CONFIG_ERROR);
    HAS(err, "seq_len");
    /* A config the model rejects (found by the validation, before the data is read). */
    cr_assert_eq(train_args(err, sizeof err, out, (const char *[]){"--data", good, "--topk", "9", NULL}),
                 TMD_CONFIG_ERROR);
    HAS(err, "key 'topk'");

    cr_assert(!exists(out), "nothing may be written for a rejected run");
    rm_rf(d);
}
