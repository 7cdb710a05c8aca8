/*
 * generate.h — continue a prompt with a model, one sampled token at a time, through a KV cache:
 * the one generation routine of the driver (`tinymoe sample` and the sample at the end of
 * `tinymoe train`).
 *
 * tmd_generate prefills the prompt through a tm_kv_cache of max_seq_len positions, then runs
 * one token per forward (tm_model_forward_cached: the prefix is never recomputed) and draws
 * each next token with tm_sample_token(sc, counter = absolute index of the token in
 * prompt + generation, i.e. n_prompt + g for the g-th generated token, g from 0), so a run is
 * reproducible from (model, prompt, sc) alone.
 *
 * The context window: a prompt longer than max_seq_len is cut to its last max_seq_len tokens.
 * When the window is full and one more token must join it, the window becomes its last
 * max(1, max_seq_len / 2) tokens (the new one included), the cache is reset and those tokens
 * are prefilled again: their rotary positions restart at 0, exactly as if that shorter text
 * had been the prompt (a sliding window recomputed in halves, so the cost of re-prefilling is
 * paid once per max_seq_len / 2 tokens).
 *
 * Output: each generated token is written to `out` and flushed as soon as it is drawn (the
 * prompt is not printed: the caller does that): through bpe (bpe.h: its bytes; an id the
 * tokenizer lacks, as in a vocabulary padded to a multiple of 64, prints nothing), or, with
 * bpe NULL, a token below 256 as that byte and any other not at all. Generation stops after max_new_tokens tokens or when eot_token is
 * drawn (not printed, not counted; eot_token < 0: never), and early, returning 0, once a stop
 * signal has been caught (stop.h: Ctrl-C during the sample at the end of training).
 *
 * ctx's arena is reset after every token (temporaries the caller made before the call die).
 * Returns 0, or TMD_RUNTIME_ERROR (status.h) with a message in err: bad arguments (naming them),
 * a library error (its message), or a failed write to out. *n_generated (may be NULL) gets the
 * number of tokens generated, also on failure.
 */
#ifndef TMD_GENERATE_H
#define TMD_GENERATE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "bpe.h"
#include "tinymoe.h"

int tmd_generate(tm_ctx *ctx, tm_model *model, const int32_t *prompt, int n_prompt, int max_new_tokens,
                 const tm_sampler_config *sc, int eot_token, const tmd_bpe *bpe, FILE *out, int64_t *n_generated,
                 char *err, size_t errlen);

#endif
