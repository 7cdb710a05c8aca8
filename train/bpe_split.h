/*
 * bpe_split.h — the pre-tokenizers of byte-level BPE tokenizers: the regex splits of GPT-2 and
 * of Llama-3 / cl100k / Qwen2, written out by hand over UTF-8 (no regex engine), with the
 * Unicode classes of unicode_tab.c.
 *
 * The patterns, as Hugging Face tokenizers and tiktoken give them:
 *
 *   GPT-2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   Llama-3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *            ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *            (cl100k_base's spelling, with possessive quantifiers and \s*[\r\n], matches the same
 *            pieces; Qwen2's is Llama-3's with \p{N} for \p{N}{1,3}: max_digits 1)
 *
 * Each call returns the piece that the leftmost-first regex match at the start of the text
 * would (the patterns cover every character, so pieces tile the text). \p{L} and \p{N} are
 * Unicode 14.0's (unicode_tab.c, generated from Python 3.11's unicodedata; the references' own
 * tables are newer, which matters only for code points assigned since). \s is Unicode's
 * White_Space (U+0009-000D, 0020, 0085, 00A0, 1680, 2000-200A, 2028, 2029, 202F, 205F, 3000),
 * which is Oniguruma's and Rust regex's \s. A byte that does not start valid UTF-8 (a stray
 * continuation byte, an overlong or surrogate form) is one character of none of these classes;
 * the reference libraries take only valid UTF-8, so such text has no reference to match.
 */
#ifndef TMD_BPE_SPLIT_H
#define TMD_BPE_SPLIT_H

#include <stddef.h>
#include <stdint.h>

typedef enum tmd_split_kind {
    TMD_SPLIT_NONE,   /* the whole text is one piece (ByteLevel with use_regex false alone) */
    TMD_SPLIT_GPT2,   /* GPT-2's pattern */
    TMD_SPLIT_LLAMA3, /* Llama-3 / cl100k (max_digits 3) and Qwen2 (max_digits 1) */
} tmd_split_kind;

/* Byte length (>= 1) of the piece that starts text s (n >= 1 bytes). */
size_t tmd_split_next(tmd_split_kind kind, int max_digits, const unsigned char *s, size_t n);

/* The class of a code point: 'L' (\p{L}), 'N' (\p{N}), 'S' (\s), or 'O' (anything else). */
int tmd_unicode_class(uint32_t cp);

/* Decode one UTF-8 character at s (n >= 1 bytes): its code point and byte length; an invalid
 * byte gives the code point 0xFFFFFFFF (class 'O') and length 1. */
uint32_t tmd_utf8_next(const unsigned char *s, size_t n, size_t *len);

#endif
