/*
 * bpe_train.h — `tinymoe tokenize --bpe N`: train a byte-level BPE on a text file and write it as
 * a Hugging Face tokenizer.json (GPT-2's layout: ByteLevel pre-tokenizer with GPT-2's split,
 * ByteLevel decoder, <|endoftext|> as the last id) that train/bpe.c and the `tokenizers` package
 * both load and encode alike.
 */
#ifndef TMD_BPE_TRAIN_H
#define TMD_BPE_TRAIN_H

#include <stddef.h>
#include <stdint.h>

/* Train on in_path a vocabulary of at most n_tokens ids (>= 258: the 256 bytes, merges, and
 * <|endoftext|>) and write it to out_json (atomically). *merges_out (may be NULL) gets the number
 * of merges learnt (fewer than n_tokens - 257 when the text runs out of pairs).
 * Algorithm: Sennrich et al. (2016) on GPT-2's byte-level pieces (Radford et al. 2019), as the
 * `tokenizers` BpeTrainer does it: words are the pre-tokenizer's pieces with their counts; each
 * step merges the most frequent adjacent pair (ties: the smaller left id, then right id). Ids:
 * byte b is id b; merge k makes id 256 + k (a merged string already in the vocabulary keeps its
 * id); <|endoftext|> is the last. Returns 0, TMD_CONFIG_ERROR (n_tokens out of range, a file that
 * cannot be read) or TMD_RUNTIME_ERROR (memory, write), with a message in err. */
int tmd_bpe_train_file(const char *in_path, int n_tokens, const char *out_json, int *merges_out, char *err,
                       size_t errlen);

/* The trainer's two stages, for tests/test_bpe_train.c to hold the merge learner against a
 * reference (tests/bpe_train_naive.c: the recount-everything algorithm this file replaced). */

/* A distinct pre-tokenizer piece and how many times the text has it. */
typedef struct tmd_bpe_word {
    unsigned char *bytes;
    size_t len;
    int64_t count;
} tmd_bpe_word;

/* The merges learnt: merge k joins ids left[k] and right[k] into id[k] (256 + the number of new
 * strings before it, or the id of the same string made earlier). */
typedef struct tmd_bpe_merges {
    int n;
    int32_t *left, *right, *id;
} tmd_bpe_merges;

/* Cut text[0, n) with GPT-2's pattern and count the distinct pieces: *words (malloc'ed, in order
 * of first appearance; free with tmd_bpe_words_free), *nwords. Returns 0 or TMD_RUNTIME_ERROR. */
int tmd_bpe_count_words(const unsigned char *text, size_t n, tmd_bpe_word **words, size_t *nwords, char *err,
                        size_t errlen);
void tmd_bpe_words_free(tmd_bpe_word *words, size_t nwords);

/* Learn at most n_tokens - 257 merges from the words (see tmd_bpe_train_file for the rule) into
 * *out (its arrays malloc'ed; free with tmd_bpe_merges_free). Returns 0 or TMD_RUNTIME_ERROR. */
int tmd_bpe_learn(const tmd_bpe_word *words, size_t nwords, int n_tokens, tmd_bpe_merges *out, char *err,
                  size_t errlen);
void tmd_bpe_merges_free(tmd_bpe_merges *m);

#endif
