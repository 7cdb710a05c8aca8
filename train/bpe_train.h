/*
 * bpe_train.h — `tinymoe tokenize --bpe N`: train a byte-level BPE on a text file and write it as
 * a Hugging Face tokenizer.json (GPT-2's layout: ByteLevel pre-tokenizer with GPT-2's split,
 * ByteLevel decoder, <|endoftext|> as the last id) that train/bpe.c and the `tokenizers` package
 * both load and encode alike.
 */
#ifndef TMD_BPE_TRAIN_H
#define TMD_BPE_TRAIN_H

#include <stddef.h>

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

#endif
