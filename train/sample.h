/*
 * sample.h — `tinymoe sample`: continue a prompt with a model loaded from a checkpoint.
 *
 *   tinymoe sample --ckpt CKPT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K]
 *                  [--top-p P] [--seed S] [--device cpu|cuda] [--threads N] [--tokenizer PATH]
 *
 * CKPT is a checkpoint file or a run directory (its newest ckpt-*.tmck). Text goes through the
 * model's tokenizer (tokenizer.h: --tokenizer, else tokenizer.json beside the checkpoint, else
 * the path its key 'tokenizer' recorded), or is bytes for a byte-level model (tokens 0..255
 * are bytes, 256 is end-of-text). Prints TEXT, then each generated token's text as it is drawn
 * (train/generate.h: KV-cache decoding, the sliding window, the sampler counters), then a
 * newline, all on stdout; one summary line (tokens generated, seconds, tokens/s including the
 * prompt's prefill, the checkpoint) on stderr. Defaults: prompt "\n" (an empty TEXT starts
 * from the end-of-text token alone, i.e. a fresh document), 256 tokens, temperature 0.8
 * (0: greedy), top-k 0 (all), top-p 1 (all), seed 0, the checkpoint's device, all threads.
 * Generation stops early at end-of-text (the tokenizer's <|endoftext|> or the like; not printed). Flags are '--flag value' or
 * '--flag=value', with '-' and '_' interchangeable in names (--top-k, --top_k); the last
 * occurrence wins.
 *
 * Returns the exit status: 0, TMD_CONFIG_ERROR (2) for usage errors (unknown flag, missing or
 * bad value, naming the flag and the value; no --ckpt; a prompt byte the model's vocabulary
 * lacks) and for checkpoints that cannot be used (tmd_ckpt_load_model's status), or
 * TMD_RUNTIME_ERROR (1) when generation fails. Messages go to stderr prefixed "tinymoe: ".
 */
#ifndef TMD_SAMPLE_H
#define TMD_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

#include "tinymoe.h"

typedef struct tmd_sample_opts {
    const char *ckpt;   /* required */
    const char *prompt; /* default "\n" */
    int tokens;         /* >= 0; default 256 */
    tm_sampler_config sampler; /* temperature 0.8, top_k 0, top_p 1, seed 0 */
    int device;         /* tmd_device_kind, or -1 (default): the checkpoint's */
    int threads;        /* >= 0; 0 (default): all */
    const char *tokenizer; /* NULL (default): the checkpoint's (tokenizer.h) */
} tmd_sample_opts;

/* Parse the arguments after "sample" into o (defaults first). *help is set by --help / -h
 * (nothing else is then checked). Returns 0 or TMD_CONFIG_ERROR with a message. */
int tmd_sample_parse(int argc, char **argv, tmd_sample_opts *o, int *help, char *err, size_t errlen);

/* The whole subcommand: argv are the arguments after "sample". Returns the exit status. */
int tmd_sample_main(int argc, char **argv);

#endif
