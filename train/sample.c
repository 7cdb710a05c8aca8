/*
 * sample.c — `tinymoe sample` (sample.h): flags, loading the checkpoint and its tokenizer,
 * and tmd_generate (generate.h) streaming to stdout.
 */
#include "sample.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "config.h"
#include "data.h"
#include "generate.h"
#include "status.h"
#include "tokenizer.h"
#include "util.h"


static const char USAGE[] =
    "usage: tinymoe sample --ckpt CKPT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K]\n"
    "                      [--top-p P] [--seed S] [--device cpu|cuda] [--threads N] [--tokenizer PATH]\n"
    "\n"
    "Continues TEXT with a trained model: prints TEXT, then the generated text as it is produced,\n"
    "then a newline; a summary line (tokens, tokens/s) goes to stderr. Text goes through the run's\n"
    "tokenizer (tokenizer.json beside the checkpoint, written by 'tinymoe train --tokenizer'), or is\n"
    "bytes for a byte-level model (tokens 0..255; 256 is end-of-text). Generation stops at the\n"
    "end-of-text token.\n"
    "\n"
    "  --ckpt CKPT       a checkpoint file, or a run directory (its newest ckpt-*.tmck); required\n"
    "  --prompt TEXT     the text to continue (default: a newline); an empty TEXT starts from the\n"
    "                    end-of-text token, i.e. a new document\n"
    "  --tokens N        generate at most N tokens (default 256)\n"
    "  --temperature T   softmax temperature, >= 0; 0 = greedy, always the likeliest token (default 0.8)\n"
    "  --top-k K         draw among the K likeliest tokens only; 0 = all (default 0)\n"
    "  --top-p P         nucleus: among the likeliest tokens whose probabilities add up to P, in (0, 1]\n"
    "                    (default 1 = all); applied after top-k\n"
    "  --seed S          the same seed, prompt and checkpoint give the same text (default 0)\n"
    "  --device D        cpu or cuda (default: the checkpoint's)\n"
    "  --threads N       CPU threads; 0 = all (default 0)\n"
    "  --tokenizer PATH  a Hugging Face tokenizer.json to use instead of the checkpoint's (a model\n"
    "                    trained on token files made elsewhere: llm.c's GPT-2 shards take GPT-2's)\n"
    "\n"
    "Flags take '--flag value' or '--flag=value'; '-' and '_' are interchangeable (--top_k).\n"
    "The model sees at most its max_seq_len (seq_len) tokens: a longer prompt is cut to its end,\n"
    "and when the text fills that window it keeps its last half and goes on (positions restart).\n"
    "\n"
    "exit status: 0 ok, 1 runtime error, 2 usage error or unusable checkpoint\n";

static int parse_int(const char *flag, const char *v, long long lo, long long hi, long long *out, char *err,
                     size_t errlen) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "sample: %s needs an integer in [%lld, %lld], got '%s'", flag,
                        lo, hi, v);
    *out = x;
    return 0;
}

static int parse_double(const char *flag, const char *v, double *out, char *err, size_t errlen) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !isfinite(x))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "sample: %s needs a number, got '%s'", flag, v);
    *out = x;
    return 0;
}

int tmd_sample_parse(int argc, char **argv, tmd_sample_opts *o, int *help, char *err, size_t errlen) {
    memset(o, 0, sizeof *o);
    o->prompt = "\n";
    o->tokens = 256;
    o->sampler = tm_sampler_config_default();
    o->sampler.temperature = 0.8;
    o->device = -1;
    *help = 0;
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            *help = 1;
            return 0;
        }
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) || !a[2])
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                            "sample: unexpected argument '%s' (flags are --name value; see 'tinymoe sample --help')",
                            a);
        /* The name with '-' read as '_', and the value after '=' or in the next argument. */
        char name[32];
        const char *eq = strchr(a + 2, '=');
        size_t n = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
        if (n >= sizeof name) n = sizeof name - 1;
        for (size_t k = 0; k < n; k++) name[k] = a[2 + k] == '-' ? '_' : a[2 + k];
        name[n] = 0;
        static const char *const known[] = {"ckpt", "prompt", "tokens", "temperature", "top_k",
                                            "top_p", "seed", "device", "threads", "tokenizer"};
        int which = -1;
        for (int k = 0; k < (int)(sizeof known / sizeof *known); k++)
            if (!strcmp(name, known[k])) which = k;
        if (which < 0)
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "sample: unknown flag '%s' (see 'tinymoe sample --help')",
                            a);
        const char *v = eq ? eq + 1 : i + 1 < argc ? argv[++i] : NULL;
        char flag[40]; /* as the user spelled it, for messages */
        snprintf(flag, sizeof flag, "%.*s", (int)(eq ? (size_t)(eq - a) : strlen(a)), a);
        if (!v) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "sample: %s needs a value", flag);
        long long x;
        double d;
        switch (which) {
        case 0:
            if (!*v)
                return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                                "sample: %s needs a checkpoint file or directory, got ''", flag);
            o->ckpt = v;
            break;
        case 1: o->prompt = v; break;
        case 2:
            if (parse_int(flag, v, 0, INT_MAX, &x, err, errlen)) return TMD_CONFIG_ERROR;
            o->tokens = (int)x;
            break;
        case 3:
            if (parse_double(flag, v, &d, err, errlen)) return TMD_CONFIG_ERROR;
            if (d < 0)
                return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "sample: %s needs a number >= 0 (0: greedy), got '%s'",
                                flag, v);
            o->sampler.temperature = d;
            break;
        case 4:
            if (parse_int(flag, v, 0, INT_MAX, &x, err, errlen)) return TMD_CONFIG_ERROR;
            o->sampler.top_k = (int)x;
            break;
        case 5:
            if (parse_double(flag, v, &d, err, errlen)) return TMD_CONFIG_ERROR;
            if (!(d > 0 && d <= 1))
                return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "sample: %s needs a number in (0, 1], got '%s'", flag,
                                v);
            o->sampler.top_p = d;
            break;
        case 6: {
            char *end;
            errno = 0;
            unsigned long long s = strtoull(v, &end, 10);
            if (!*v || *end || errno || strchr(v, '-'))
                return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "sample: %s needs an integer in [0, 2^64), got '%s'",
                                flag, v);
            o->sampler.seed = (uint64_t)s;
            break;
        }
        case 7:
            if (!strcmp(v, "cpu")) o->device = TMD_DEVICE_CPU;
            else if (!strcmp(v, "cuda")) o->device = TMD_DEVICE_CUDA;
            else return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "sample: %s needs cpu or cuda, got '%s'", flag, v);
            break;
        case 8:
            if (parse_int(flag, v, 0, 1024, &x, err, errlen)) return TMD_CONFIG_ERROR;
            o->threads = (int)x;
            break;
        case 9:
            if (!*v) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "sample: %s needs a tokenizer.json, got ''", flag);
            o->tokenizer = v;
            break;
        }
    }
    if (!o->ckpt)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "sample: --ckpt CKPT is required (a checkpoint file, or a run directory for its newest "
                        "checkpoint)");
    return 0;
}

int tmd_sample_main(int argc, char **argv) {
    tmd_sample_opts o;
    int help = 0;
    char err[2048];
    int rc = tmd_sample_parse(argc, argv, &o, &help, err, sizeof err);
    if (!rc && help) {
        fputs(USAGE, stdout);
        return 0;
    }
    if (rc) {
        fprintf(stderr, "tinymoe: %s\n", err);
        return rc;
    }
    tmd_loaded_model lm;
    rc = tmd_ckpt_load_model(o.ckpt, o.device, o.threads, &lm, err, sizeof err);
    if (rc) {
        fprintf(stderr, "tinymoe: sample: %s\n", err);
        return rc;
    }
    int V = tm_model_get_config(lm.model)->vocab_size, n_prompt = 0;
    int32_t *prompt = NULL;
    tmd_bpe *bpe = NULL;
    char tok_path[TMD_PATH_MAX + 32];
    rc = tmd_tokenizer_for_ckpt(lm.path, &lm.cfg, o.tokenizer, &bpe, tok_path, sizeof tok_path, err, sizeof err);
    if (!rc) rc = tmd_prompt_tokens(bpe, o.prompt, V, "--prompt", &prompt, &n_prompt, err, sizeof err);
    if (!rc) {
        fputs(o.prompt, stdout);
        fflush(stdout);
        int64_t n_gen = 0;
        double t0 = tmd_now_s();
        int eot = bpe ? tmd_bpe_eot(bpe) : V > TMD_BYTE_EOT ? TMD_BYTE_EOT : -1;
        rc = tmd_generate(lm.ctx, lm.model, prompt, n_prompt, o.tokens, &o.sampler, eot, bpe, stdout, &n_gen, err,
                          sizeof err);
        /* The reader went away (| head): there is no one left to print for, which is the end
         * of the job, not a failure (SIGPIPE is ignored, so this is where it shows). */
        if (rc && errno == EPIPE) {
            tmd_bpe_free(bpe);
            tmd_loaded_model_free(&lm);
            free(prompt);
            return 0;
        }
        double dt = tmd_now_s() - t0;
        putchar('\n');
        fflush(stdout);
        if (!rc)
            fprintf(stderr, "sampled %lld tokens in %.2f s (%.1f tokens/s, the %d-token prompt's prefill included) from %s "
                    "(step %lld)%s%s\n", (long long)n_gen, dt, dt > 0 ? (double)n_gen / dt : 0.0, n_prompt, lm.path,
                    (long long)lm.state.step, bpe ? ", tokenizer " : "", bpe ? tok_path : "");
    }
    if (rc) fprintf(stderr, "tinymoe: %s%s\n", strncmp(err, "sample: ", 8) ? "sample: " : "", err);
    free(prompt);
    tmd_bpe_free(bpe);
    tmd_loaded_model_free(&lm);
    return rc;
}
