/* test_train.c — short runs through tmd_train / tmd_eval: the loss falls, metrics.jsonl has one
 * line per log and per evaluation, the plots are written, a rerun is bit-identical, byte-level
 * token files train, sample and evaluate. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "data.h"
#include "plot.h"
#include "status.h"
#include "train.h"

static char *tmpdir(void) {
    char *d = strdup("/tmp/tinymoe_test_train_XXXXXX");
    cr_assert(mkdtemp(d), "mkdtemp");
    return d;
}

static void rm_rf(char *d) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", d);
    cr_assert_eq(system(cmd), 0);
    free(d);
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    cr_assert_eq(fread(s, 1, (size_t)n, f), (size_t)n);
    s[n] = 0;
    fclose(f);
    return s;
}

/* A tiny MoE on a tiny synthetic source: 20 steps in well under a second per run. */
static void tiny(tmd_config *c, const char *out) {
    tmd_config_defaults(c);
    const char *kv[][2] = {
        {"d_model", "32"},         {"n_layers", "2"},     {"n_heads", "2"},
        {"n_kv_heads", "1"},       {"num_experts", "4"},  {"topk", "2"},
        {"expert_ffn_size", "32"}, {"seq_len", "16"},     {"batch_size", "8"},
        {"synthetic_vocab", "8"},  {"synthetic_k", "2"},  {"steps", "20"},
        {"warmup_steps", "2"},     {"lr", "1e-2"},        {"log_every", "5"},
        {"eval_every", "10"},      {"eval_batches", "2"}, {"threads", "2"},
    };
    char err[512];
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        cr_assert_eq(tmd_config_set(c, kv[i][0], kv[i][1], TMD_SRC_FLAG, "test", err, sizeof err), 0, "%s", err);
    snprintf(c->out, sizeof c->out, "%s", out);
}

/* Lines of metrics.jsonl of one type, and their `field` values as text (exact comparison). */
static int records(const char *text, const char *type, const char *field, char vals[][32], int max) {
    char tag[64], key[64];
    snprintf(tag, sizeof tag, "{\"type\": \"%s\"", type);
    snprintf(key, sizeof key, "\"%s\": ", field);
    int n = 0;
    for (const char *line = text; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (strncmp(line, tag, strlen(tag))) continue;
        const char *eol = strchr(line, '\n');
        const char *v = strstr(line, key);
        cr_assert(v && (!eol || v < eol), "record without %s: %.200s", field, line);
        v += strlen(key);
        if (n < max) snprintf(vals[n], 32, "%.*s", (int)strcspn(v, ",}"), v);
        n++;
    }
    return n;
}

static void assert_svg(const char *path) {
    char *s = slurp(path);
    cr_assert(strstr(s, "<svg ") && strstr(s, "xmlns=\"http://www.w3.org/2000/svg\""), "%s: no <svg> element", path);
    cr_assert(strstr(s, "</svg>\n"), "%s: not closed", path);
    /* XML-ish: every '<' is closed by a '>' before the next '<', and no stray '&'. */
    int open = 0;
    for (const char *c = s; *c; c++) {
        if (*c == '<') cr_assert(!open++, "%s: nested '<' at %ld", path, (long)(c - s));
        if (*c == '>') cr_assert(open--, "%s: stray '>' at %ld", path, (long)(c - s));
        if (*c == '&')
            cr_assert(!strncmp(c, "&amp;", 5) || !strncmp(c, "&lt;", 4) || !strncmp(c, "&gt;", 4) ||
                          !strncmp(c, "&quot;", 6) || !strncmp(c, "&apos;", 6),
                      "%s: unescaped '&'", path);
    }
    free(s);
}

Test(train, synthetic_loss_falls_metrics_plots_and_rerun_identical) {
    TT_WATCHDOG(120);
    char *d = tmpdir(), out1[256], out2[256], path[300], err[1024] = "";
    snprintf(out1, sizeof out1, "%s/run1", d);
    snprintf(out2, sizeof out2, "%s/nested/run2", d);
    tmd_config c;
    tiny(&c, out1);
    tmd_train_result r1, r2;
    char *logbuf = NULL;
    size_t loglen = 0;
    FILE *lf = open_memstream(&logbuf, &loglen);
    cr_assert_eq(tmd_train(&c, lf, &r1, err, sizeof err), TMD_OK, "%s", err);
    fclose(lf);

    cr_assert_eq(r1.steps, 20);
    cr_assert(r1.params > r1.active_params && r1.active_params > 0);
    cr_assert(isfinite(r1.optimum) && r1.optimum > 0 && r1.optimum < log(8.0));
    cr_assert(fabs(r1.first_loss - log(8.0)) < 0.3, "first loss %g should be near log(8)", r1.first_loss);
    cr_assert_lt(r1.last_loss, r1.first_loss - 0.1, "loss %g -> %g did not fall", r1.first_loss, r1.last_loss);
    cr_assert(isfinite(r1.val_loss) && r1.val_loss < r1.first_loss);
    cr_assert(strstr(logbuf, "optimal loss"), "the summary prints the optimum");
    cr_assert(strstr(logbuf, "parameters"), "the summary prints the parameter counts");
    cr_assert(strstr(logbuf, "steps                = 20"), "the summary prints the resolved config");
    free(logbuf);

    snprintf(path, sizeof path, "%s/metrics.jsonl", out1);
    char *m1 = slurp(path);
    char loss1[8][32], val1[4][32], loss2[8][32], val2[4][32];
    cr_assert_eq(records(m1, "train", "loss", loss1, 8), 4, "one train record per log_every = 5 steps");
    cr_assert_eq(records(m1, "eval", "val_loss", val1, 4), 2, "evaluations at steps 10 and 20");
    char steps[8][32];
    records(m1, "train", "step", steps, 8);
    cr_assert_str_eq(steps[0], "5");
    cr_assert_str_eq(steps[3], "20");
    for (const char *f = m1; *f; f++) cr_assert(*f != 'n' || strncmp(f, "nan", 3), "NaN in the JSON");
    snprintf(path, sizeof path, "%s/loss.svg", out1);
    assert_svg(path);
    snprintf(path, sizeof path, "%s/experts.svg", out1);
    assert_svg(path);
    char *svg = slurp(path);
    cr_assert(strstr(svg, "layer 1"), "heatmap rows are labelled by layer");
    free(svg);

    /* Same seed, other output directory (created with its parents): identical numbers. */
    snprintf(c.out, sizeof c.out, "%s", out2);
    cr_assert_eq(tmd_train(&c, NULL, &r2, err, sizeof err), TMD_OK, "%s", err);
    cr_assert_eq(r1.first_loss, r2.first_loss);
    cr_assert_eq(r1.last_loss, r2.last_loss);
    cr_assert_eq(r1.val_loss, r2.val_loss);
    snprintf(path, sizeof path, "%s/metrics.jsonl", out2);
    char *m2 = slurp(path);
    cr_assert_eq(records(m2, "train", "loss", loss2, 8), 4);
    cr_assert_eq(records(m2, "eval", "val_loss", val2, 4), 2);
    for (int i = 0; i < 4; i++) cr_assert_str_eq(loss1[i], loss2[i], "train record %d", i);
    for (int i = 0; i < 2; i++) cr_assert_str_eq(val1[i], val2[i], "eval record %d", i);
    free(m1);
    free(m2);
    rm_rf(d);
}

Test(train, grad_accum_and_sgd_run) {
    TT_WATCHDOG(120);
    char *d = tmpdir(), err[1024] = "";
    tmd_config c;
    tiny(&c, "");
    char e2[256];
    cr_assert_eq(tmd_config_set(&c, "grad_accum", "2", TMD_SRC_FLAG, "test", e2, sizeof e2), 0);
    cr_assert_eq(tmd_config_set(&c, "steps", "10", TMD_SRC_FLAG, "test", e2, sizeof e2), 0);
    tmd_train_result r;
    cr_assert_eq(tmd_train(&c, NULL, &r, err, sizeof err), TMD_OK, "%s", err);
    cr_assert_lt(r.last_loss, r.first_loss);
    cr_assert_eq(tmd_config_set(&c, "optimizer", "sgd", TMD_SRC_FLAG, "test", e2, sizeof e2), 0);
    cr_assert_eq(tmd_config_set(&c, "lr", "0.1", TMD_SRC_FLAG, "test", e2, sizeof e2), 0);
    cr_assert_eq(tmd_config_set(&c, "expert_bias", "true", TMD_SRC_FLAG, "test", e2, sizeof e2), 0);
    cr_assert_eq(tmd_train(&c, NULL, &r, err, sizeof err), TMD_OK, "%s", err);
    cr_assert(isfinite(r.last_loss) && isfinite(r.val_loss));
    rm_rf(d);
}

/* force_load_balance: the header says the routing is forced, and every logged interval gives every
 * expert of every layer B T topk / E = 8 x 16 x 2 / 4 = 64 tokens a step (experts records of
 * metrics.jsonl), with sigmoid scores, an expert bias and groups too; the same run routed by
 * its scores does not (so the check can fail). */
Test(train, force_load_balance_balances_every_step_and_says_so) {
    TT_WATCHDOG(120);
    for (int forced = 1; forced >= 0; forced--)
        for (int variant = 0; variant < (forced ? 2 : 1); variant++) {
            char *d = tmpdir(), out[256], path[300], err[1024] = "", e2[256];
            snprintf(out, sizeof out, "%s/run", d);
            tmd_config c;
            tiny(&c, out);
            cr_assert_eq(tmd_config_set(&c, "force_load_balance", forced ? "true" : "false", TMD_SRC_FLAG, "test", e2,
                                        sizeof e2), 0, "%s", e2);
            if (variant) {
                const char *kv[][2] = {{"score_function", "sigmoid"}, {"expert_bias", "true"}, {"num_groups", "2"},
                                       {"group_topk", "1"}};
                for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
                    cr_assert_eq(tmd_config_set(&c, kv[i][0], kv[i][1], TMD_SRC_FLAG, "test", e2, sizeof e2), 0, "%s", e2);
            }
            char *logbuf = NULL;
            size_t loglen = 0;
            FILE *lf = open_memstream(&logbuf, &loglen);
            tmd_train_result r;
            cr_assert_eq(tmd_train(&c, lf, &r, err, sizeof err), TMD_OK, "%s", err);
            fclose(lf);
            cr_assert_eq(strstr(logbuf, "routing: FORCED") != NULL, forced, "forced %d: %s", forced, logbuf);
            free(logbuf);
            snprintf(path, sizeof path, "%s/metrics.jsonl", out);
            char *m = slurp(path);
            int records_seen = 0, off_balance = 0;
            for (const char *line = m; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
                static const char tag[] = "{\"type\": \"experts\"";
                if (strncmp(line, tag, sizeof tag - 1)) continue;
                records_seen++;
                const char *v = strstr(line, "\"load\": [") + 9;
                for (int i = 0; i < 2 * 4; i++) { /* 2 layers x 4 experts */
                    char *end;
                    double x = strtod(v, &end);
                    cr_assert(end != v, "load entry %d unreadable: %.200s", i, line);
                    off_balance += x != 8.0 * 16 * 2 / 4;
                    v = end + 1;
                }
            }
            cr_assert_eq(records_seen, 4, "one experts record per log_every = 5 steps");
            if (forced) cr_assert_eq(off_balance, 0, "variant %d: an expert's load is not 64", variant);
            else cr_assert_gt(off_balance, 0, "routing by the scores came out exactly balanced");
            free(m);
            rm_rf(d);
        }
}

Test(train, byte_level_token_file_trains_samples_and_evaluates) {
    TT_WATCHDOG(120);
    char *d = tmpdir(), txt[256], bin[256], val[256], err[1024] = "";
    snprintf(txt, sizeof txt, "%s/text.txt", d);
    snprintf(bin, sizeof bin, "%s/text.bin", d);
    FILE *f = fopen(txt, "w");
    for (int i = 0; i < 300; i++) fputs("to be or not to be, that is the question. ", f);
    fclose(f);
    cr_assert_eq(tmd_tokenize_file(txt, bin, 0.1, val, sizeof val, err, sizeof err), 0, "%s", err);

    tmd_config c;
    tiny(&c, "");
    const char *kv[][2] = {{"data", bin},           {"val_data", val}, {"seq_len", "32"}, {"sample_prompt", "to be"},
                           {"sample_tokens", "20"}, {"top_k", "5"},    {"lr", "3e-3"}};
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        cr_assert_eq(tmd_config_set(&c, kv[i][0], kv[i][1], TMD_SRC_FLAG, "test", err, sizeof err), 0, "%s", err);
    char *logbuf = NULL;
    size_t loglen = 0;
    FILE *lf = open_memstream(&logbuf, &loglen);
    tmd_train_result r;
    int rc = tmd_train(&c, lf, &r, err, sizeof err);
    fclose(lf);
    cr_assert_eq(rc, TMD_OK, "%s", err);
    cr_assert(fabs(r.first_loss - log(257.0)) < 0.5, "first loss %g should be near log(257)", r.first_loss);
    cr_assert_lt(r.last_loss, r.first_loss - 0.5);
    cr_assert(isnan(r.optimum));
    const char *s = strstr(logbuf, "sample (temperature");
    cr_assert(s, "no sample in the output");
    cr_assert(strstr(s, "\nto be"), "the sample continues the prompt: %s", s);

    /* eval: a freshly initialised model on the validation file: about log(257). */
    double loss = NAN;
    cr_assert_eq(tmd_config_set(&c, "data", val, TMD_SRC_FLAG, "test", err, sizeof err), 0);
    cr_assert_eq(tmd_config_set(&c, "val_data", "", TMD_SRC_FLAG, "test", err, sizeof err), 0);
    cr_assert_eq(tmd_eval(&c, NULL, &loss, err, sizeof err), TMD_OK, "%s", err);
    cr_assert(fabs(loss - log(257.0)) < 0.3, "eval loss %g", loss);
    free(logbuf);
    rm_rf(d);
}

Test(train, bins_stay_bounded_and_keep_sums) {
    tmd_bins b;
    cr_assert_eq(tmd_bins_init(&b, 2, 8), 0);
    double total[2] = {0, 0};
    for (int64_t s = 0; s < 1000; s++) {
        double v[2] = {1.0, (double)s};
        tmd_bins_add(&b, s, v);
        total[0] += v[0], total[1] += v[1];
    }
    cr_assert_leq(b.n, 8);
    cr_assert_eq(b.width, 128, "width doubles until 1000 steps fit in 8 bins");
    double sum[2] = {0, 0};
    int64_t count = 0;
    for (int i = 0; i < b.n; i++) {
        sum[0] += b.sum[2 * i], sum[1] += b.sum[2 * i + 1];
        count += b.count[i];
    }
    cr_assert_eq(count, 1000);
    cr_assert_float_eq(sum[0], total[0], 1e-9);
    cr_assert_float_eq(sum[1], total[1], 1e-6);
    tmd_bins_free(&b);
}
