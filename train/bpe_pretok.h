/*
 * bpe_pretok.h — one Split pre-tokenizer of a Hugging Face tokenizer.json: its pattern compiled
 * by PCRE2 (8-bit library, UTF + UCP, JIT where the platform has it, else PCRE2's interpreter)
 * and its pieces cut as `tokenizers` cuts them.
 *
 * tokenizers (src/tokenizer/pattern.rs, normalizer.rs `split`, pre_tokenizer.rs) finds the
 * pattern's matches left to right with Oniguruma (onig's find_iter: after an empty match at the
 * end of the previous match it moves one character on), lists them with the gaps between them
 * (a gap is a piece too), flips match and gap with `invert`, then applies the behavior:
 *   Isolated           every match and every gap is a piece
 *   Removed            the matches are dropped, the gaps are pieces
 *   MergedWithPrevious a match joins the piece before it (unless that one is a match)
 *   MergedWithNext     a match joins the gap after it
 *   Contiguous         consecutive matches, and consecutive gaps, are one piece
 * and drops empty pieces. This file does the same, step for step.
 *
 * Oniguruma and PCRE2 agree on the patterns of byte-level BPE tokenizers (GPT-2, Llama-3,
 * cl100k, Qwen2, o200k-style case classes, lookahead, possessive quantifiers, (?i:)) with three
 * exceptions, which the pattern is rewritten for or refused over (tests/test_bpe.c checks them):
 *   \s, \S   PCRE2's \s with UCP also takes U+180E MONGOLIAN VOWEL SEPARATOR (its \h list),
 *            Oniguruma's is Unicode White_Space: rewritten to \p{White_Space} / \P{White_Space}.
 *   {,n}     Oniguruma's {0,n}; PCRE2 10.42 reads it as literal text: rewritten to {0,n}.
 *   \w \W \b \B \h \H and [[:name:]]   refused: Oniguruma's word class (Alphabetic, marks,
 *            connector punctuation, six Latin-1 numbers) and POSIX classes are not PCRE2's, and its
 *            \h is a hexadecimal digit, PCRE2's a horizontal space.
 * What stays different: the Unicode version of the property tables (PCRE2 10.42: Unicode 14;
 * the Oniguruma in tokenizers 0.22: 15.1), which matters only for code points assigned since,
 * and script names (\p{Han}): PCRE2 takes Script_Extensions, Oniguruma Script.
 * Text that is not valid UTF-8 is matched with PCRE2_MATCH_INVALID_UTF: no match takes an
 * invalid byte, so such bytes end up in gaps (tokenizers takes valid UTF-8 only).
 */
#ifndef TMD_BPE_PRETOK_H
#define TMD_BPE_PRETOK_H

#include <stddef.h>

typedef enum tmd_split_behavior {
    TMD_SPLIT_REMOVED,
    TMD_SPLIT_ISOLATED,
    TMD_SPLIT_MERGED_WITH_PREVIOUS,
    TMD_SPLIT_MERGED_WITH_NEXT,
    TMD_SPLIT_CONTIGUOUS,
} tmd_split_behavior;

/* GPT-2's pattern: ByteLevel's split when its use_regex is true (tokenizers' default). */
extern const char tmd_gpt2_pattern[];

typedef struct tmd_split tmd_split;

/* Compile `pattern` (a regex, or with literal != 0 a string matched as it is: tokenizers'
 * {"String": ...}). Returns 0; -1 with a message in msg (PCRE2's error text and the offset in the
 * pattern, or the construct refused above and why) for the caller to put after the file and
 * field; -2 when memory runs out. */
int tmd_split_new(const char *pattern, int literal, tmd_split_behavior behavior, int invert, tmd_split **out,
                  char *msg, size_t msglen);
void tmd_split_free(tmd_split *sp);

/* Cut s[0, n) into its pieces and call emit(ctx, piece, length) for each, in order (emit's
 * non-zero return stops and is returned). Returns 0, emit's value, or -1 with a message in msg
 * (memory, or an error of PCRE2's matcher such as its JIT stack or match limit). Not
 * thread-safe: the match data and scratch are the split's own. */
int tmd_split_pieces(tmd_split *sp, const unsigned char *s, size_t n,
                     int (*emit)(void *ctx, const unsigned char *piece, size_t len), void *ctx, char *msg,
                     size_t msglen);

#endif
