/*
 * main.c — the `tinymoe` command line.
 *
 *   tinymoe train [--preset NAME] [--config FILE] [--key value ...]
 *   tinymoe eval --data FILE [--key value ...]
 *   tinymoe tokenize IN.txt OUT.bin [--val-fraction F]
 *   tinymoe sample --prompt TEXT           (needs checkpoints: a later issue)
 *   tinymoe --version | --help
 *
 * Exit status: 0 success; 1 a run that failed; 2 a usage, configuration or data error (nothing
 * written). Messages go to stderr, prefixed "tinymoe: ".
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "data.h"
#include "tinymoe.h"
#include "train.h"

static const char USAGE[] =
    "usage: tinymoe <command> [flags]\n"
    "\n"
    "commands:\n"
    "  train      train a Mixtral-style MoE language model; with no flags, a small model on a\n"
    "             synthetic source whose optimal loss is known exactly (about a minute on 2 cores)\n"
    "  eval       validation loss of a model on a token file\n"
    "  tokenize   IN.txt OUT.bin [--val-fraction F]: byte-level tokens (256 bytes + end-of-text)\n"
    "             in llm.c's token file format; with F > 0 the last F of the text goes to OUT_val.bin\n"
    "  sample     generate text from a trained model (needs checkpoints, a later version; for now\n"
    "             'tinymoe train --sample_prompt TEXT' samples from the model it has just trained)\n"
    "\n"
    "  --version  print the version\n"
    "  --help     print this help; 'tinymoe train --help' lists every configuration key\n"
    "\n"
    "train on any text file:\n"
    "  tinymoe tokenize input.txt input.bin --val-fraction 0.1\n"
    "  tinymoe train --preset shakespeare --data input.bin --val_data input_val.bin\n"
    "\n"
    "exit status: 0 ok, 1 runtime error, 2 usage, configuration or data error\n";

static const char TRAIN_USAGE[] =
    "usage: tinymoe train [--preset NAME] [--config FILE] [--key value | --key=value ...]\n"
    "\n"
    "Trains a model and prints the resolved config, parameter counts, a data summary, then per\n"
    "log_every steps: loss (ce + MoE losses), ce, aux and z losses, learning rate, gradient norm,\n"
    "ms/step, tokens/s and expert load (max tokens per expert / mean, 1 = balanced). A progress\n"
    "bar with ETA on a terminal, plain lines otherwise. Writes <out>/metrics.jsonl, loss.svg and\n"
    "experts.svg. Sources, later ones win: defaults, preset, --config file ('key = value' lines,\n"
    "'#' comments), flags. Flag names may use '-' for '_'; a bool flag alone means true.\n"
    "\n";

static const char EVAL_USAGE[] =
    "usage: tinymoe eval --data FILE [--key value ...]\n"
    "\n"
    "Prints the mean cross-entropy (nats/token) on FILE (all of it; or on val_data when given;\n"
    "data=synthetic uses the synthetic validation sequences) of the model the keys and the seed\n"
    "define. Until checkpoints exist (a later version) that is a freshly initialised model, so\n"
    "this checks data files and the evaluation path. Same keys as 'tinymoe train':\n"
    "\n";

static int usage_error(const char *msg) {
    fprintf(stderr, "tinymoe: %s\nrun 'tinymoe --help' for usage\n", msg);
    return TMD_CONFIG_ERROR;
}

static int cmd_train_or_eval(int eval, int argc, char **argv) {
    tmd_config cfg;
    int help = 0;
    char err[2048];
    if (tmd_config_from_args(&cfg, argc, argv, &help, err, sizeof err)) {
        fprintf(stderr, "tinymoe: %s\n", err);
        return TMD_CONFIG_ERROR;
    }
    if (help) {
        fputs(eval ? EVAL_USAGE : TRAIN_USAGE, stdout);
        tmd_config_help(stdout);
        return 0;
    }
    int rc;
    if (eval) {
        double loss;
        rc = tmd_eval(&cfg, stdout, &loss, err, sizeof err);
    } else {
        rc = tmd_train(&cfg, stdout, NULL, err, sizeof err);
    }
    if (rc) {
        fflush(stdout);
        fprintf(stderr, "tinymoe: %s\n", err);
    }
    return rc;
}

static int cmd_tokenize(int argc, char **argv) {
    const char *in = NULL, *out = NULL;
    double frac = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs("usage: tinymoe tokenize IN.txt OUT.bin [--val-fraction F]\n"
                  "byte-level tokens (0..255 the bytes, 256 end-of-text, appended) in llm.c's token file format;\n"
                  "with F in (0, 1) the last F of the tokens goes to OUT_val.bin (OUT.bin -> OUT_val.bin)\n",
                  stdout);
            return 0;
        }
        if (!strncmp(a, "--val-fraction", 14) || !strncmp(a, "--val_fraction", 14)) {
            const char *v = a[14] == '=' ? a + 15 : a[14] ? NULL : i + 1 < argc ? argv[++i] : NULL;
            char *end;
            errno = 0;
            frac = v ? strtod(v, &end) : -1;
            if (!v || !*v || *end || errno || !(frac >= 0 && frac < 1)) {
                fprintf(stderr, "tinymoe: tokenize: --val-fraction needs a number in [0, 1), got '%s'\n", v ? v : "");
                return TMD_CONFIG_ERROR;
            }
        } else if (!strncmp(a, "--", 2)) {
            fprintf(stderr, "tinymoe: tokenize: unknown flag '%s'\n", a);
            return TMD_CONFIG_ERROR;
        } else if (!in) {
            in = a;
        } else if (!out) {
            out = a;
        } else {
            fprintf(stderr, "tinymoe: tokenize: unexpected argument '%s' (usage: tinymoe tokenize IN.txt OUT.bin)\n",
                    a);
            return TMD_CONFIG_ERROR;
        }
    }
    if (!in || !out) return usage_error("tokenize needs IN.txt and OUT.bin");
    FILE *probe = fopen(in, "rb");
    if (!probe) {
        /* A missing input is the user's error (status 2), like a missing data file in train. */
        fprintf(stderr, "tinymoe: tokenize: cannot open '%s': %s\n", in, strerror(errno));
        return TMD_CONFIG_ERROR;
    }
    fclose(probe);
    char err[1024], val_path[TMD_PATH_MAX];
    val_path[0] = 0;
    if (tm__tokenize_file(in, out, frac, val_path, sizeof val_path, err, sizeof err)) {
        fprintf(stderr, "tinymoe: tokenize: %s\n", err);
        return TMD_RUNTIME_ERROR;
    }
    tm__tokens t;
    if (!tm__tokens_load(out, &t, err, sizeof err)) {
        printf("wrote %s (%lld tokens)", out, (long long)t.n);
        tm__tokens_free(&t);
        if (val_path[0] && !tm__tokens_load(val_path, &t, err, sizeof err)) {
            printf(" and %s (%lld tokens)", val_path, (long long)t.n);
            tm__tokens_free(&t);
        }
        printf("\n");
    }
    return 0;
}

static int cmd_sample(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs("usage: tinymoe sample --prompt TEXT [--key value ...]\n"
                  "Needs a checkpoint to load, which a later version adds. Meanwhile\n"
                  "'tinymoe train --sample_prompt TEXT [--sample_tokens N --temperature T --top_k K]' samples\n"
                  "from the model it has just trained.\n",
                  stdout);
            return 0;
        }
    fprintf(stderr, "tinymoe: sample needs a checkpoint to load, which this version cannot write yet; use "
                    "'tinymoe train --sample_prompt TEXT ...' to sample from the model at the end of training\n");
    return TMD_CONFIG_ERROR;
}

/* libgomp reads OMP_WAIT_POLICY once, as the program loads, and by default its idle threads
 * spin. With other busy processes on the cores (or more threads than cores) a spinning thread
 * holds a core the working ones need, and a training step here took 10x longer (1160 vs 110
 * ms on 2 shared cores). Unless the user chose a policy, run again with the passive one;
 * should exec fail, carry on as we are. */
static void prefer_passive_openmp(char **argv) {
    if (getenv("OMP_WAIT_POLICY") || setenv("OMP_WAIT_POLICY", "passive", 1)) return;
    execv("/proc/self/exe", argv);
}

int main(int argc, char **argv) {
    prefer_passive_openmp(argv);
    if (argc < 2) {
        fputs(USAGE, stderr);
        return TMD_CONFIG_ERROR;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        fputs(USAGE, stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version")) {
        printf("tinymoe %s (library %s)\n", TM_VERSION_STRING, tm_version());
        return 0;
    }
    if (!strcmp(cmd, "train")) return cmd_train_or_eval(0, argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return cmd_train_or_eval(1, argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc - 2, argv + 2);
    if (!strcmp(cmd, "sample")) return cmd_sample(argc - 2, argv + 2);
    char msg[256];
    snprintf(msg, sizeof msg, "unknown command '%.64s' (train, eval, tokenize, sample)", cmd);
    return usage_error(msg);
}
