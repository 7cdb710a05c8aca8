/*
 * hf_tokenizer.c — the tokenizer files of a Hugging Face export of a byte-level model (the
 * built-in tokenizer of `tinymoe tokenize`: ids 0..255 are the bytes, 256 ends a text), so that
 * transformers' AutoTokenizer.from_pretrained(DIR) encodes text as the model was trained on it
 * and a text-generation pipeline stops at end-of-text. See hf.h.
 *
 * tokenizer.json expresses the byte tokenizer in the `tokenizers` library's terms: a BPE model
 * without merges over GPT-2's byte-to-unicode alphabet (each byte b is one printable code point,
 * its vocabulary entry maps to id b), a ByteLevel pre-tokenizer without its regex split (the text
 * stays one word, so every byte becomes its own token) and the ByteLevel decoder; end-of-text is
 * the special token "<|endoftext|>" (id 256). One difference from `tinymoe tokenize`: tokenizers
 * matches the literal text "<|endoftext|>" as that special token, where tinymoe encodes its 13 bytes.
 * Byte-to-unicode: Radford et al. 2019, GPT-2's encoder.py bytes_to_unicode(): the bytes
 * '!'..'~', 0xA1..0xAC and 0xAE..0xFF are their own code points; the other 68 bytes, in order,
 * become 256, 257, ...
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomic.h"
#include "config.h"
#include "data.h"
#include "hf.h"
#include "status.h"
#include "strbuf.h"
#include "util.h"

/* The code point GPT-2's byte-level alphabet gives byte b. */
unsigned tmd_byte_to_unicode(unsigned b) {
    unsigned n = 0;
    for (unsigned c = 0; c < 256; c++) {
        int printable = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
        if (c == b) return printable ? c : 256 + n;
        if (!printable) n++;
    }
    return 0;
}

void tmd_json_byte_token(tmd_sbuf *b, const unsigned char *s, size_t n) {
    tmd_sb_printf(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned cp = tmd_byte_to_unicode(s[i]); /* < 0x144: one or two UTF-8 bytes */
        if (cp == '"' || cp == '\\') tmd_sb_printf(b, "\\%c", (int)cp);
        else if (cp < 0x80) tmd_sb_printf(b, "%c", (int)cp);
        else tmd_sb_printf(b, "%c%c", (int)(0xC0 | cp >> 6), (int)(0x80 | (cp & 0x3F)));
    }
    tmd_sb_printf(b, "\"");
}

static int write_file(const char *dir, const char *name, tmd_sbuf *b, char *err, size_t errlen) {
    if (b->oom) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory writing %s", name);
    char path[TMD_PATH_MAX + 64];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "output path '%s/%s' is too long", dir, name);
    tmd_atomic a;
    int rc = tmd_atomic_open(&a, path, err, errlen);
    if (!rc) {
        tmd_atomic_write(&a, b->p, b->n);
        rc = tmd_atomic_commit(&a, err, errlen);
    }
    return rc;
}

int tmd_hf_write_byte_tokenizer(const char *dir, int model_max_length, char *err, size_t errlen) {
    if (tmd_mkdirs(dir, err, errlen)) return TMD_RUNTIME_ERROR;
    tmd_sbuf b = {0};
    tmd_sb_printf(&b, "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n"
                      "  \"added_tokens\": [{\"id\": %d, \"content\": \"<|endoftext|>\", \"single_word\": false, "
                      "\"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}],\n"
                      "  \"normalizer\": null,\n"
                      "  \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
                      "\"use_regex\": false},\n"
                      "  \"post_processor\": null,\n"
                      "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
                      "\"use_regex\": false},\n"
                      "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
                      "\"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \"fuse_unk\": false, "
                      "\"byte_fallback\": false, \"ignore_merges\": false,\n    \"vocab\": {",
                  TMD_BYTE_EOT);
    for (unsigned i = 0; i < 256; i++) {
        tmd_sb_printf(&b, "%s", i ? ", " : "");
        unsigned char byte = (unsigned char)i;
        tmd_json_byte_token(&b, &byte, 1);
        tmd_sb_printf(&b, ": %u", i);
    }
    tmd_sb_printf(&b, "},\n    \"merges\": []\n  }\n}\n");
    int rc = write_file(dir, TMD_HF_TOKENIZER_FILE, &b, err, errlen);
    free(b.p);
    if (rc) return rc;

    return tmd_hf_write_token_configs(dir, "<|endoftext|>", TMD_BYTE_EOT, model_max_length, err, errlen);
}

int tmd_hf_write_token_configs(const char *dir, const char *eos_text, int eos_id, int model_max_length, char *err,
                               size_t errlen) {
    if (tmd_mkdirs(dir, err, errlen)) return TMD_RUNTIME_ERROR;
    tmd_sbuf c = {0};
    tmd_sb_printf(&c, "{\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\",\n  \"eos_token\": ");
    if (eos_text) {
        /* a JSON string: the end-of-text names of bpe.h are printable ASCII, escaped anyway */
        tmd_sb_printf(&c, "\"");
        for (const unsigned char *p = (const unsigned char *)eos_text; *p; p++) {
            if (*p == '"' || *p == '\\') tmd_sb_printf(&c, "\\%c", *p);
            else if (*p < 0x20) tmd_sb_printf(&c, "\\u%04x", *p);
            else tmd_sb_printf(&c, "%c", *p);
        }
        tmd_sb_printf(&c, "\"");
    } else {
        tmd_sb_printf(&c, "null");
    }
    tmd_sb_printf(&c,
                  ",\n  \"bos_token\": null,\n  \"unk_token\": null,\n  \"pad_token\": null,\n"
                  "  \"model_max_length\": %d,\n  \"clean_up_tokenization_spaces\": false\n}\n",
                  model_max_length);
    int rc = write_file(dir, "tokenizer_config.json", &c, err, errlen);
    free(c.p);
    if (rc) return rc;

    char id[16] = "null";
    if (eos_text) snprintf(id, sizeof id, "%d", eos_id);
    tmd_sbuf g = {0};
    tmd_sb_printf(&g, "{\n  \"bos_token_id\": null,\n  \"eos_token_id\": %s,\n  \"pad_token_id\": %s\n}\n", id, id);
    rc = write_file(dir, "generation_config.json", &g, err, errlen);
    free(g.p);
    return rc;
}
