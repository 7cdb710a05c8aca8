/*
 * data.h — token data for the tinymoe driver: llm.c token files, the byte-level tokenizer,
 * and deterministic batching. Driver code: uses only the public header; functions return 0 on
 * success or -1 with a message in err (which names the file and what is wrong).
 *
 * File format (llm.c, dev/data/data_common.py): a header of 256 little-endian int32:
 *   [0] magic: 20240520 (version 1: uint16 tokens) or 20240801 (version 7: uint32 tokens)
 *   [1] version: 1 or 7 (must match the magic)
 *   [2] number of tokens that follow the header
 * then the tokens. A data source is one file or a glob of shards (concatenated in sorted name
 * order).
 */
#ifndef TMD_DATA_H
#define TMD_DATA_H

#include <stddef.h>
#include <stdint.h>

#define TMD_DATA_MAGIC_V1 20240520
#define TMD_DATA_MAGIC_V7 20240801
#define TMD_DATA_HEADER_INTS 256

/* Byte-level tokenizer: tokens 0..255 are bytes, 256 is end-of-text. */
#define TMD_BYTE_VOCAB 257
#define TMD_BYTE_EOT 256

/* A token stream held in memory (uint32). */
/* Where a stretch of a token stream came from: tokens [start, next start) of the stream are
 * tokens [file_pos, ...) of the file `path` (messages name the shard and the place in it). */
typedef struct tmd_token_shard {
    int64_t start, file_pos;
    char *path;
} tmd_token_shard;

typedef struct tmd_tokens {
    uint32_t *tok;
    int64_t n;
    uint32_t max_token; /* largest token id present (for vocab checks) */
    char source[256];   /* file or pattern it came from, for messages */
    tmd_token_shard *shards; /* by start, ascending; NULL for a stream not read from files */
    int n_shards;
} tmd_tokens;

/* Load one file or every file matching a glob pattern (sorted bytewise), validating each
 * header (magic, version, token count vs file size, no trailing bytes) before reading any
 * tokens. Files are opened one at a time (a corpus of thousands of shards needs no more file
 * descriptors than one). A path without * ? [ is opened as is (a missing file reports strerror); a pattern
 * matching nothing is an error, and so is a source holding no tokens at all. The whole source
 * is held as one uint32 array (4 bytes per token). On error *out is left empty. */
int tmd_tokens_load(const char *pattern, tmd_tokens *out, char *err, size_t errlen);
void tmd_tokens_free(tmd_tokens *t);
/* Split off the last round(fraction * n) tokens (0 < fraction < 1) of a stream into val (a
 * copy; train is truncated to the first part). Each side must keep >= 2 tokens (one input and
 * its target). On error train is unchanged and *val empty. */
int tmd_tokens_split(tmd_tokens *train, double fraction, tmd_tokens *val, char *err, size_t errlen);
/* A 64-bit fingerprint of the token values (and their count): what a checkpoint records of
 * its data, so that a resume notices a file replaced since. One multiply per token, over
 * tokens already in memory: negligible next to loading them. Not cryptographic. */
uint64_t tmd_tokens_fingerprint(const tmd_tokens *t);
/* Every token < vocab_size, else an error naming the source, the position and the value. */
int tmd_tokens_check_vocab(const tmd_tokens *t, int vocab_size, char *err, size_t errlen);

/* Write a token file (version 1 if every token fits in uint16, else 7) atomically: a temporary
 * file in the same directory, fflush, fsync, rename (then fsync of the directory). On failure
 * the temporary file is removed and an existing file at `path` is untouched. Little-endian
 * whatever the host. */
int tmd_tokens_write(const char *path, const uint32_t *tok, int64_t n, char *err, size_t errlen);

/* tinymoe tokenize: bytes of `in_path` -> tokens (end-of-text appended); with val_fraction > 0
 * the last round(val_fraction * n) tokens go to a second file named like out_path with "_val"
 * before the extension (out.bin -> out_val.bin, out -> out_val), and the training part to
 * out_path; its name is copied to val_path_out (may be NULL; "" when val_fraction == 0).
 * val_fraction in [0, 1). Both files are written in full to temporary files before either is
 * renamed into place. Unlike the rest of this file, returns the codes of status.h:
 * TMD_CONFIG_ERROR for bad input, with nothing written (a missing, empty or non-regular input,
 * either output naming the input file, an output that exists and is not a regular file, a
 * fraction out of range or leaving too few tokens), TMD_RUNTIME_ERROR for I/O and memory. */
int tmd_tokenize_file(const char *in_path, const char *out_path, double val_fraction, char *val_path_out,
                      size_t val_path_len, char *err, size_t errlen);
/* The same with a byte-level BPE tokenizer (bpe.h; NULL: bytes): the text's ids, then the
 * tokenizer's end-of-text token when it has one. Token files are uint16 while every id fits,
 * else uint32 (llm.c's version 7: Llama-3's 128256 tokens). */
struct tmd_bpe;
int tmd_tokenize_file_bpe(const char *in_path, const char *out_path, double val_fraction, struct tmd_bpe *bpe,
                          char *val_path_out, size_t val_path_len, char *err, size_t errlen);

/* Deterministic batching: row b of the batch at position p is the window of T+1 tokens at an
 * offset in [0, n - T - 1] drawn from Philox4x32-10 with key = seed and counter = (p, b,
 * stream tag) — so (seed, position) fully determines every batch, independent of thread count,
 * and resuming at `position` reproduces the rest exactly. */
typedef struct tmd_batcher {
    const tmd_tokens *data;
    int B, T;
    uint64_t seed;
    int64_t position; /* batches produced so far: the state to save for an exact resume */
} tmd_batcher;

/* Errors: B < 1, T < 1, or fewer than T + 1 tokens in data. data must outlive the batcher.
 * Tokens are assumed to fit in int32 (check the vocabulary first). */
int tmd_batcher_init(tmd_batcher *bt, const tmd_tokens *data, int B, int T, uint64_t seed, char *err, size_t errlen);
/* inputs and targets: B*T int32 each, row-major (B, T); targets = inputs shifted by one.
 * Advances position by one. */
void tmd_batcher_next(tmd_batcher *bt, int32_t *inputs, int32_t *targets);
/* Rows [b0, b0 + rows) of the next batch (what tmd_batcher_next writes there) into inputs and
 * targets (rows * T each): a data-parallel rank's slice. Advances position by one. */
void tmd_batcher_next_rows(tmd_batcher *bt, int b0, int rows, int32_t *inputs, int32_t *targets);

#endif
