/*
 * bpe_norm.h — the normalizer of a tokenizer.json: Unicode NFC (Qwen2 / Qwen2.5 state
 * `"normalizer": {"type": "NFC"}`), applied by utf8proc (Debian libutf8proc-dev), not by tables
 * of our own.
 *
 * tokenizers (src/normalizers/unicode.rs) runs NFC on the text between the added tokens that
 * are not `normalized` (bpe.h, step 1), before those that are, and before the pre-tokenizer:
 * bpe.c calls tmd_nfc on that same text. utf8proc's NFC is UTF8PROC_STABLE | UTF8PROC_COMPOSE
 * (utf8proc_NFC; Unicode's UAX #15: canonical decomposition, canonical ordering of combining
 * marks, canonical composition, algorithmic Hangul).
 *
 * Known difference: tokenizers' tables (the unicode-normalization-alignments crate; 0.22.1 and
 * 0.23.2 alike) are Unicode 9's; utf8proc 2.8 (Debian bookworm) has Unicode 15's. Combining
 * marks assigned from Unicode 10 on (U+1DF6, U+0898, U+1AC1, U+10EAB, ...) have combining
 * class 0 for tokenizers, so a run of marks holding one is reordered here and not there
 * (a\u0898\u0316: here a\u0316\u0898). Text in the scripts and marks of Unicode 9
 * normalizes identically (tests/test_bpe.c, bpe/nfc_oracle_*).
 *
 * Bytes that are not UTF-8 (tokenizers cannot be given them) are kept as they are; the valid
 * text between them is normalized, each run on its own.
 */
#ifndef TMD_BPE_NORM_H
#define TMD_BPE_NORM_H

#include <stddef.h>

/* The NFC of s[0, n). When s is its own NFC by a cheap test (no byte >= 0xCC: every character is
 * below U+0300, where nothing combines with what precedes it), *out = s, *out_n = n and nothing
 * is written; otherwise the normalized bytes go to *buf (a malloc'ed buffer of *cap bytes,
 * grown with realloc; *buf may start NULL with *cap 0) and *out = *buf. Returns 0, or -1 when
 * memory runs out. */
int tmd_nfc(const unsigned char *s, size_t n, unsigned char **buf, size_t *cap, const unsigned char **out,
            size_t *out_n);

/* The version of the linked utf8proc and of its Unicode tables, for messages: "utf8proc 2.8.0,
 * Unicode 15.0.0". */
const char *tmd_nfc_version(void);

#endif
