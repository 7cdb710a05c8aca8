/*
 * bpe.h — byte-level BPE tokenizers read from a Hugging Face tokenizer.json (GPT-2, Llama-3,
 * Qwen2 and tokenizers trained like them): encode text to token ids and decode ids to bytes,
 * matching the `tokenizers` library id for id (tests/test_bpe.c checks it, and tiktoken's
 * cl100k-style split).
 *
 * Encoding, as tokenizers' Tokenizer.encode(text, add_special_tokens=False):
 *   1. added tokens (added_tokens: <|endoftext|> and the like) are matched first, leftmost and
 *      then longest, anywhere in the text; the text between them is encoded separately: with
 *      an NFC normalizer (Qwen2's) it is first normalized (bpe_norm.h), then the added tokens
 *      marked "normalized" are matched in it, as their NFC;
 *   2. the pre-tokenizer splits each such segment into pieces: each Split of the file's
 *      Sequence, in order, cuts every piece of the one before with its own regex pattern run by
 *      PCRE2 and its behavior (bpe_pretok.h); then ByteLevel puts add_prefix_space's space
 *      before every piece that does not start with one, and cuts it with GPT-2's pattern unless
 *      its use_regex is false;
 *   3. each piece's bytes become their GPT-2 byte-to-unicode characters, one symbol each, and
 *      the merges are applied lowest rank first (leftmost first among equal ranks), the
 *      standard algorithm of Sennrich et al. (2016) as tokenizers implements it: a priority
 *      queue of adjacent pairs, O(m log m) for a piece of m bytes; with model.ignore_merges
 *      (Llama-3) a piece that is itself in the vocabulary is that token. Pieces are cached.
 * No post-processor runs (no BOS/EOS is added): a corpus file gets the end-of-text token
 * appended by the caller.
 *
 * Decoding (ByteLevel's decoder): a token whose characters are all byte-to-unicode
 * characters is those bytes, any other (an added token such as "<|im start|>" with a space)
 * its UTF-8 text; the concatenation is the text (bytes: a sequence cut inside a character is
 * not valid UTF-8 until the rest comes). An added token marked "normalized" decodes from its
 * normalized content, as tokenizers >= 0.23.1 does (bpe.c, read_added, says why).
 *
 * Refused, with a message naming the file and the field: normalizers other than NFC (and
 * Sequences of them: a Sequence is taken when every member is NFC), other models than BPE,
 * BPE with byte_fallback (SentencePiece-style: Mistral / Mixtral, Llama 1-2), dropout,
 * continuing_subword_prefix or end_of_word_suffix, pre-tokenizers other than ByteLevel or
 * Splits + ByteLevel, a pattern PCRE2 cannot compile (PCRE2's message and offset) or with a
 * construct that PCRE2 and tokenizers' Oniguruma read differently (bpe_pretok.h), decoders other
 * than ByteLevel, added tokens with lstrip / rstrip / single_word, a vocabulary without the 256
 * byte characters.
 */
#ifndef TMD_BPE_H
#define TMD_BPE_H

#include <stddef.h>
#include <stdint.h>

typedef struct tmd_bpe tmd_bpe;

/* Read and check a tokenizer.json. Returns 0, TMD_CONFIG_ERROR (a file that cannot be read or
 * is not a supported tokenizer; the message names `path` and the JSON field, e.g.
 * "model.merges[12]") or TMD_RUNTIME_ERROR (memory). Free with tmd_bpe_free. */
int tmd_bpe_load(const char *path, tmd_bpe **out, char *err, size_t errlen);
void tmd_bpe_free(tmd_bpe *t);

/* Ids in [0, vocab_size) may be tokens (the largest id of the vocabulary or added tokens + 1). */
int tmd_bpe_vocab_size(const tmd_bpe *t);
/* The end-of-text token: the first added token among <|endoftext|>, <|end_of_text|>, </s>,
 * <eos>; -1 when there is none. */
int tmd_bpe_eot(const tmd_bpe *t);
/* A short description for messages: "byte-level BPE, 1 Split pattern, 128256 tokens (path)",
 * "byte-level BPE with NFC, ..." when the text is normalized. */
const char *tmd_bpe_describe(const tmd_bpe *t);

/* Append the ids of text[0, len) to *ids (a malloc'ed array of *cap entries holding *n; grown
 * with realloc as needed; *ids may start NULL with *n = *cap = 0). Not thread-safe (the piece
 * cache is shared). Returns 0 or TMD_RUNTIME_ERROR (memory, or PCRE2's matcher failing: its
 * message). */
int tmd_bpe_encode(tmd_bpe *t, const char *text, size_t len, uint32_t **ids, int64_t *n, int64_t *cap, char *err,
                   size_t errlen);

/* Append k ids to the growable array of tmd_bpe_encode: 0, or -1 when memory runs out. */
int tmd_bpe_encode_append(uint32_t **ids, int64_t *n, int64_t *cap, const uint32_t *add, int64_t k);

/* The bytes a token decodes to (*bytes points into t; valid until tmd_bpe_free) and their
 * count, or -1 for an id that is no token (a model's padded vocabulary: 50304 > GPT-2's 50257). */
int tmd_bpe_token_bytes(const tmd_bpe *t, int64_t id, const unsigned char **bytes);

#endif
