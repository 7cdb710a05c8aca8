/*
 * main.c — the `tinymoe` command line.
 *
 *   tinymoe train [--preset NAME] [--config FILE] [--key value ...] [--resume CKPT]
 *   tinymoe eval [--ckpt CKPT] --data FILE [--key value ...]
 *   tinymoe tokenize [--tokenizer tokenizer.json] IN.txt OUT.bin [--val-fraction F]
 *   tinymoe sample --ckpt CKPT --prompt TEXT [--tokens N ...]
 *   tinymoe inspect CKPT
 *   tinymoe export --ckpt CKPT --format hf --out DIR
 *   tinymoe --version | --help
 *
 * Exit status, every command: 0 success; 1 a runtime failure (I/O, memory, a run that diverged);
 * 2 bad input: usage, configuration, data or checkpoint errors, found before anything is
 * written; 128 + n when signal n stopped a run (130 SIGINT, 143 SIGTERM, 129 SIGHUP), after it saved its
 * checkpoint. Messages go to stderr, prefixed "tinymoe: ".
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bpe.h"
#include "bpe_train.h"
#include "checkpoint.h"
#include "config.h"
#include "data.h"
#include "hf.h"
#include "layout.h"
#include "sample.h"
#include "status.h"
#include "stop.h"
#include "tinymoe.h"
#include "train.h"
#include "util.h"

static const char USAGE[] =
    "usage: tinymoe <command> [flags]\n"
    "\n"
    "commands:\n"
    "  train      train a Mixtral-style MoE language model; with no flags, a small model on a\n"
    "             synthetic source whose optimal loss is known exactly (about a minute on 2 cores);\n"
    "             checkpoints go to out/ (--save-every N, --keep-last K); --resume DIR continues\n"
    "  eval       --ckpt CKPT --data FILE: mean loss and perplexity of a trained model on a token file\n"
    "  sample     --ckpt CKPT --prompt TEXT: generate text from a trained model\n"
    "  inspect    CKPT: config, step and tensors of a checkpoint\n"
    "  export     --ckpt CKPT --format hf --out DIR: a Hugging Face Mixtral model directory\n"
    "  plan       --ranks N [--key value ...]: memory per rank and communication per step of a parallel\n"
    "             layout (ep_size, zero), computed without running\n"
    "  tokenize   [--tokenizer tokenizer.json] [--bpe N] IN.txt OUT.bin [--val-fraction F]:\n"
    "             llm.c token files of bytes (256 + end-of-text), or of a Hugging Face byte-level BPE\n"
    "             (GPT-2, Llama-3, Qwen2; --bpe N trains one of N tokens on IN.txt first); with F > 0\n"
    "             the last F of the text goes to OUT_val.bin\n"
    "\n"
    "CKPT is a checkpoint file (out/ckpt-00000600.tmck) or a directory (its newest checkpoint).\n"
    "\n"
    "  --version  print the version\n"
    "  --help     print this help; 'tinymoe train --help' lists every configuration key\n"
    "\n"
    "train on any text file:\n"
    "  tinymoe tokenize input.txt input.bin --val-fraction 0.1\n"
    "  tinymoe train --preset shakespeare --data input.bin --val_data input_val.bin\n"
    "with subword tokens (a Hugging Face tokenizer.json; sample and export then use it too):\n"
    "  tinymoe tokenize --tokenizer tokenizer.json input.txt input.bin --val-fraction 0.1\n"
    "  tinymoe train --preset shakespeare --data input.bin --val_data input_val.bin \\\n"
    "                --tokenizer tokenizer.json\n"
    "\n"
    "distributed: mpirun -np N tinymoe train [--ep_size P] [--ep_strategy alltoall|allgather] [--zero 1|2|3]\n"
    "             [--print-layout] ...: one process per rank (docs/layouts.md)\n"
    "\n"
    "out directory: a run holds <out>/tinymoe.lock for its whole life; a second run into the same\n"
    "directory fails at once, naming the holder's pid (a lock left by a dead run does not count)\n"
    "\n"
    "exit status (every command):\n"
    "  0        ok\n"
    "  1        runtime failure: I/O error, disk full or file-size limit, out of memory, a run whose\n"
    "           loss or gradients became NaN or infinite (no checkpoint of it is written)\n"
    "  2        bad input: usage, configuration, data or checkpoint error, found before anything is\n"
    "           written; also an out directory in use by another run\n"
    "  128+n    signal n stopped a run (130 SIGINT, 143 SIGTERM, 129 SIGHUP) after its checkpoint was written\n";

static const char TRAIN_USAGE[] =
    "usage: tinymoe train [--preset NAME] [--config FILE] [--key value | --key=value ...]\n"
    "\n"
    "Trains a model and prints the resolved config, parameter counts, a data summary, then per\n"
    "log_every steps: loss (ce + MoE losses), ce, aux and z losses, learning rate, gradient norm,\n"
    "ms/step, tokens/s and expert load (max tokens per expert / mean, 1 = balanced). On a terminal\n"
    "a progress bar with ETA under that table, fitted to its width; no bar into a file or a pipe,\n"
    "under mpirun or srun, or with TERM=dumb (--progress auto|bar|lines). Writes\n"
    "<out>/metrics.jsonl, loss.svg and experts.svg. Sources, later ones win: defaults, preset,\n"
    "--config file ('key = value' lines, '#' comments), flags. Flag names may use '-' for '_'; a\n"
    "bool flag alone means true.\n"
    "\n";

static const char EVAL_USAGE[] =
    "usage: tinymoe eval --ckpt CKPT --data FILE [--json | --quiet] [--key value ...]\n"
    "\n"
    "Prints the mean cross-entropy (nats/token) and perplexity (exp of it) on FILE (all of it,\n"
    "or eval_batches batches when given; or on val_data when given; data=synthetic uses the\n"
    "synthetic validation sequences) of the model in CKPT (a checkpoint file, or a directory:\n"
    "its newest). Model keys come from the checkpoint; data, val_data, eval_batches, batch_size,\n"
    "threads and device may be set. Without --ckpt: a freshly initialised model from the keys and\n"
    "the seed (a check of the data and the evaluation path). --quiet prints the result line alone;\n"
    "--json one JSON object (loss, perplexity, tokens, seconds, model, step). Same keys as\n"
    "'tinymoe train':\n"
    "\n";

static int usage_error(const char *msg) {
    fprintf(stderr, "tinymoe: %s\nrun 'tinymoe --help' for usage\n", msg);
    return TMD_CONFIG_ERROR;
}

/* Take eval's flags that are not config keys out of argv: "--ckpt X" / "--ckpt=X", --json,
 * --quiet. */
static int take_ckpt_flag(int *argc, char **argv, const char **ckpt, int *format) {
    int w = 0;
    for (int i = 0; i < *argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--json")) {
            *format = TMD_EVAL_JSON;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            if (*format != TMD_EVAL_JSON) *format = TMD_EVAL_QUIET;
        } else if (!strcmp(a, "--ckpt")) {
            if (i + 1 >= *argc) return -1;
            *ckpt = argv[++i];
        } else if (!strncmp(a, "--ckpt=", 7)) {
            *ckpt = a + 7;
        } else {
            argv[w++] = argv[i];
        }
    }
    *argc = w;
    return 0;
}

static int cmd_train_or_eval(int eval, int argc, char **argv) {
    tmd_config cfg;
    int help = 0;
    char err[2048];
    const char *ckpt = NULL;
    int format = TMD_EVAL_TEXT;
    if (eval && take_ckpt_flag(&argc, argv, &ckpt, &format)) return usage_error("eval: --ckpt needs a checkpoint file or directory");
    if (tmd_config_from_args(&cfg, argc, argv, &help, err, sizeof err)) {
        fprintf(stderr, "tinymoe: %s\n", err);
        return TMD_CONFIG_ERROR;
    }
    if (help) {
        fputs(eval ? EVAL_USAGE : TRAIN_USAGE, stdout);
        tmd_config_help(stdout);
        return 0;
    }
    /* Both name the model to evaluate; the import would silently lose to the checkpoint. */
    if (ckpt && cfg.init_from[0]) {
        fprintf(stderr,
                "tinymoe: eval: --ckpt '%s' and --init_from '%s' both name the model to evaluate: give one\n", ckpt,
                cfg.init_from);
        return TMD_CONFIG_ERROR;
    }
    int rc, uniform = 0;
    if (eval) {
        double loss;
        rc = tmd_eval_format(&cfg, ckpt, format, stdout, &loss, err, sizeof err);
    } else {
        tmd_train_result res;
        rc = tmd_train(&cfg, stdout, &res, err, sizeof err);
        if (rc && res.stopped_by_signal) return rc; /* a clean stop, already reported */
        uniform = res.uniform_error;
    }
    int rank = tm_mpi_world_rank(), world = tm_mpi_world_size();
    if (rc) {
        fflush(stdout);
        if (world == 1) fprintf(stderr, "tinymoe: %s\n", err);
        else if (uniform && rank == 0) fprintf(stderr, "tinymoe: %s\n", err); /* every rank found it */
        else if (!uniform) fprintf(stderr, "tinymoe: rank %d of %d: %s\n", rank, world, err);
        fflush(stderr);
        /* A failure of this rank alone leaves the others waiting in a collective: end the job.
         * A configuration error every rank found alike ends every rank by itself. */
        if (world > 1 && !uniform) tm_mpi_abort(rc);
    }
    return rc;
}

static const char TOKENIZE_USAGE[] =
    "usage: tinymoe tokenize [--tokenizer tokenizer.json] [--bpe N] IN.txt OUT.bin [--val-fraction F]\n"
    "\n"
    "Writes the tokens of IN.txt in llm.c's token file format (uint16, or uint32 when an id is above\n"
    "65535), the end-of-text token appended. With F in (0, 1) the last F of the tokens goes to\n"
    "OUT_val.bin (OUT.bin -> OUT_val.bin).\n"
    "\n"
    "  --tokenizer PATH  a Hugging Face tokenizer.json of a byte-level BPE (GPT-2, Llama-3, Qwen2 or one\n"
    "                    trained like them): its ids, as the tokenizers package's encode(text,\n"
    "                    add_special_tokens=False), special tokens such as <|endoftext|> in the text\n"
    "                    included. Train with 'tinymoe train --data OUT.bin --tokenizer PATH'\n"
    "                    (vocab_size follows it), so that sample and export use it too.\n"
    "  --bpe N           first train a byte-level BPE of N tokens on IN.txt (the 256 bytes, N - 257\n"
    "                    merges of the most frequent adjacent pairs within GPT-2's pre-tokenizer pieces,\n"
    "                    <|endoftext|> last), write it to --tokenizer PATH (default: tokenizer.json beside\n"
    "                    OUT.bin), then tokenize with it; the tokenizers package loads it and encodes alike\n"
    "  (none)            bytes: ids 0..255, 256 end-of-text (vocab_size 257)\n";

static int cmd_tokenize(int argc, char **argv) {
    const char *in = NULL, *out = NULL, *tokenizer = NULL;
    double frac = 0;
    long bpe_n = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(TOKENIZE_USAGE, stdout);
            return 0;
        }
        if (!strncmp(a, "--tokenizer", 11) && (a[11] == 0 || a[11] == '=')) {
            tokenizer = a[11] == '=' ? a + 12 : i + 1 < argc ? argv[++i] : NULL;
            if (!tokenizer || !*tokenizer) {
                fprintf(stderr, "tinymoe: tokenize: --tokenizer needs a tokenizer.json\n");
                return TMD_CONFIG_ERROR;
            }
        } else if (!strncmp(a, "--bpe", 5) && (a[5] == 0 || a[5] == '=')) {
            const char *v = a[5] == '=' ? a + 6 : i + 1 < argc ? argv[++i] : NULL;
            char *end;
            errno = 0;
            bpe_n = v ? strtol(v, &end, 10) : 0;
            if (!v || !*v || *end || errno || bpe_n < 258 || bpe_n > (1L << 20)) {
                fprintf(stderr, "tinymoe: tokenize: --bpe needs a vocabulary size in [258, %ld], got '%s'\n", 1L << 20,
                        v ? v : "");
                return TMD_CONFIG_ERROR;
            }
        } else if (!strncmp(a, "--val-fraction", 14) || !strncmp(a, "--val_fraction", 14)) {
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
    char err[1024], val_path[TMD_PATH_MAX];
    val_path[0] = 0;
    tmd_bpe *bpe = NULL;
    char trained[TMD_PATH_MAX + 32];
    int rc = 0;
    if (bpe_n) { /* train first; the file then serves as --tokenizer */
        if (tokenizer) {
            snprintf(trained, sizeof trained, "%s", tokenizer);
        } else {
            const char *slash = strrchr(out, '/');
            snprintf(trained, sizeof trained, "%.*s%stokenizer.json", slash ? (int)(slash - out) : 0, out, slash ? "/" : "");
        }
        int merges = 0;
        double tb = tmd_now_s();
        rc = tmd_bpe_train_file(in, (int)bpe_n, trained, &merges, err, sizeof err);
        if (!rc) printf("trained a byte-level BPE of %ld tokens on %s (%d merges) in %.2f s: %s\n", bpe_n, in, merges,
                        tmd_now_s() - tb, trained);
        tokenizer = trained;
    }
    if (!rc && tokenizer) rc = tmd_bpe_load(tokenizer, &bpe, err, sizeof err);
    double t0 = tmd_now_s();
    if (!rc) rc = tmd_tokenize_file_bpe(in, out, frac, bpe, val_path, sizeof val_path, err, sizeof err);
    double dt = tmd_now_s() - t0;
    if (rc) {
        fprintf(stderr, "tinymoe: tokenize: %s\n", err);
        tmd_bpe_free(bpe);
        return rc;
    }
    if (bpe) {
        printf("%s; end-of-text ", tmd_bpe_describe(bpe));
        if (tmd_bpe_eot(bpe) >= 0) printf("%d appended", tmd_bpe_eot(bpe));
        else printf("none (the tokenizer has no <|endoftext|>, <|end_of_text|>, </s> or <eos>)");
        printf("; %.2f s\n", dt);
    }
    tmd_bpe_free(bpe);
    tmd_tokens t;
    if (!tmd_tokens_load(out, &t, err, sizeof err)) {
        printf("wrote %s (%lld tokens)", out, (long long)t.n);
        tmd_tokens_free(&t);
        if (val_path[0] && !tmd_tokens_load(val_path, &t, err, sizeof err)) {
            printf(" and %s (%lld tokens)", val_path, (long long)t.n);
            tmd_tokens_free(&t);
        }
        printf("\n");
    }
    return 0;
}

static const char *shape_str(const tm_ckpt_entry *e, char *buf, size_t len) {
    size_t w = (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < e->ndim && w < len; d++)
        w += (size_t)snprintf(buf + w, len - w, "%s%lld", d ? ", " : "", (long long)e->shape[d]);
    if (w < len) snprintf(buf + w, len - w, "]");
    return buf;
}

static int cmd_inspect(int argc, char **argv) {
    const char *ckpt = NULL;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs("usage: tinymoe inspect CKPT\n"
                  "Validates a checkpoint completely (every CRC, every tensor inflates) and prints its format\n"
                  "version, training step and data position, the configuration it was trained with, and every\n"
                  "tensor: name, dtype, shape, size and stored (compressed) size. CKPT is a file, or a directory\n"
                  "(its newest ckpt-*.tmck).\n",
                  stdout);
            return 0;
        }
        if (!strncmp(argv[i], "--", 2)) {
            fprintf(stderr, "tinymoe: inspect: unknown flag '%s'\n", argv[i]);
            return TMD_CONFIG_ERROR;
        }
        if (ckpt) return usage_error("inspect takes one checkpoint");
        ckpt = argv[i];
    }
    if (!ckpt) return usage_error("inspect needs a checkpoint file or directory");
    char path[TMD_PATH_MAX], err[2048];
    int rc = tmd_ckpt_resolve(ckpt, path, sizeof path, err, sizeof err);
    if (rc) {
        fprintf(stderr, "tinymoe: inspect: %s\n", err);
        return rc;
    }
    tm_ctx *ctx = NULL;
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    if (tm_ctx_new(&ctx, &o)) {
        fprintf(stderr, "tinymoe: %s\n", tm_last_create_error());
        return TMD_RUNTIME_ERROR;
    }
    tm_ckpt_info *info = NULL;
    tm_status s = tm_ckpt_inspect(ctx, path, &info);
    if (s) {
        fprintf(stderr, "tinymoe: inspect: %s\n", tm_ctx_errmsg(ctx));
        tm_ctx_free(ctx);
        return s == TM_ERR_NOMEM ? TMD_RUNTIME_ERROR : TMD_CONFIG_ERROR;
    }
    printf("checkpoint %s: format version %u, %.2f MB, %d tensors, every CRC verified\n", path, info->version,
           (double)info->file_bytes / 1e6, info->num_entries);
    tmd_config cfg;
    tmd_ckpt_state st;
    if (!tmd_ckpt_meta_decode(info->meta, info->meta_bytes, path, &cfg, &st, err, sizeof err)) {
        printf("step %lld, data position %lld\n\nconfig (defaults unmarked):\n", (long long)st.step,
               (long long)st.data_position);
        tmd_config_print(&cfg, stdout);
    } else {
        printf("meta: %zu bytes, not written by 'tinymoe train' (%s)\n", info->meta_bytes, err);
    }
    printf("\n%-48s %-5s %-18s %12s %12s\n", "tensor", "dtype", "shape", "bytes", "stored");
    uint64_t raw = 0, stored = 0, numel_model = 0, numel_other = 0;
    for (int i = 0; i < info->num_entries; i++) {
        const tm_ckpt_entry *e = &info->entries[i];
        char shp[96];
        printf("%-48s %-5s %-18s %12llu %12llu\n", e->name, tm_dtype_name(e->dtype), shape_str(e, shp, sizeof shp),
               (unsigned long long)e->raw_bytes, (unsigned long long)e->stored_bytes);
        raw += e->raw_bytes;
        stored += e->stored_bytes;
        uint64_t numel = e->raw_bytes / tm_dtype_size(e->dtype);
        if (strstr(e->name, ".adamw_") || strstr(e->name, ".sgd_") || !strncmp(e->name, "optim.", 6))
            numel_other += numel;
        else
            numel_model += numel;
    }
    printf("%-48s %-5s %-18s %12llu %12llu\n", "total", "", "", (unsigned long long)raw, (unsigned long long)stored);
    printf("\n%llu model values (weights and buffers), %llu optimizer state values\n",
           (unsigned long long)numel_model, (unsigned long long)numel_other);
    tm_ckpt_info_free(info);
    tm_ctx_free(ctx);
    return 0;
}

/* Under mpirun, Open MPI binds each rank to one core by default when it starts 2 ranks or fewer
 * on a node (--bind-to core). libgomp sizes its thread pool from the affinity mask as the
 * program loads, so such a rank runs everything the host does on one CPU: on a 64-CPU H100
 * machine a 2-rank `fine` run spent 51 s before its first step (the host draws the initial
 * weights) against 8 s unbound. A rank bound to a single CPU while the node has more than one
 * per local rank gets its share back: CPUs [local_rank * share, (local_rank + 1) * share) with
 * share = online CPUs / local ranks. Binding chosen on purpose (--map-by slot:PE=N, or any mask
 * of more than one CPU) is left alone; --bind-to none avoids the question. Returns 1 if the
 * mask changed (the caller re-executes, so that libgomp reads the new one). */
static int widen_single_cpu_binding(void) {
    const char *lr = getenv("OMPI_COMM_WORLD_LOCAL_RANK"), *ls = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (!lr || !ls || getenv("TINYMOE_BINDING_WIDENED")) return 0;
    long local_rank = strtol(lr, NULL, 10), local_size = strtol(ls, NULL, 10), online = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t have;
    if (local_size < 1 || local_rank < 0 || local_rank >= local_size || online < 2 ||
        sched_getaffinity(0, sizeof have, &have) || CPU_COUNT(&have) != 1)
        return 0;
    long share = online / local_size;
    if (share < 2 || share * local_size > CPU_SETSIZE) return 0;
    cpu_set_t want;
    CPU_ZERO(&want);
    for (long c = local_rank * share; c < (local_rank + 1) * share; c++) CPU_SET((int)c, &want);
    if (sched_setaffinity(0, sizeof want, &want)) return 0;
    setenv("TINYMOE_BINDING_WIDENED", "1", 1); /* once: the re-executed program keeps it */
    const char *wr = getenv("OMPI_COMM_WORLD_RANK");
    if (wr && !strcmp(wr, "0"))
        fprintf(stderr,
                "tinymoe: note: mpirun bound each rank to one CPU (Open MPI's default for 2 ranks or fewer per "
                "node); each rank now uses its share of this node's %ld CPUs (%ld: rank 0 CPUs 0-%ld). Choose "
                "with mpirun --bind-to none or --map-by slot:PE=N.\n",
                online, share, share - 1);
    return 1;
}

/* libgomp reads OMP_WAIT_POLICY once, as the program loads, and by default its idle threads
 * spin. With other busy processes on the cores (or more threads than cores) a spinning thread
 * holds a core the working ones need, and a training step here took 10x longer (1160 vs 110
 * ms on 2 shared cores). Unless the user chose a policy, run again with the passive one (and
 * with a widened CPU binding, see above); should exec fail, carry on as we are. */
static void prepare_process(char **argv) {
    int widened = widen_single_cpu_binding();
    int passive = !getenv("OMP_WAIT_POLICY") && !setenv("OMP_WAIT_POLICY", "passive", 1);
    if (widened || passive) execv("/proc/self/exe", argv);
}

int main(int argc, char **argv) {
    prepare_process(argv);
    /* A reader that went away (| head, | tee ended by Ctrl-C) and a file-size limit become
     * write errors, reported like any other, instead of killing the process. */
    tmd_signals_ignore_io();
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
    if (!strcmp(cmd, "train") || !strcmp(cmd, "eval")) {
        /* Under mpirun: one process per rank (MPI only where a launcher started us). */
        tm_status ms = tm_mpi_init(&argc, &argv, NULL);
        if (ms) {
            fprintf(stderr, "tinymoe: %s\n", ms == TM_ERR_UNSUPPORTED
                                                  ? "started by mpirun as one of several ranks, but this build has no "
                                                    "MPI (rebuild with MPI=1)"
                                                  : "MPI_Init failed");
            return ms == TM_ERR_UNSUPPORTED ? TMD_CONFIG_ERROR : TMD_RUNTIME_ERROR;
        }
        int rc = cmd_train_or_eval(!strcmp(argv[1], "eval"), argc - 2, argv + 2);
        tm_mpi_finalize();
        return rc;
    }
    if (!strcmp(cmd, "plan")) return tmd_plan_main(argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc - 2, argv + 2);
    if (!strcmp(cmd, "inspect")) return cmd_inspect(argc - 2, argv + 2);
    if (!strcmp(cmd, "sample")) return tmd_sample_main(argc - 2, argv + 2);
    if (!strcmp(cmd, "export")) return tmd_export_main(argc - 2, argv + 2);
    char msg[256];
    snprintf(msg, sizeof msg, "unknown command '%.64s' (train, eval, sample, inspect, export, tokenize)", cmd);
    return usage_error(msg);
}
