/*
 * test_hf_tokenizer.c — the tokenizer files `tinymoe export` writes beside a byte-level model
 * (issue 23: AutoTokenizer works on the export of a byte-level model). The vocabulary against
 * GPT-2's published byte-to-unicode alphabet (printable bytes are themselves, space is U+0120
 * 'Ġ', newline U+010A 'Ċ', byte 0 U+0100), and, through the `tokenizers` library
 * (tests/hf_tokenizer_check.py; skipped without it unless TM_REQUIRE_PYDEPS=1), every text
 * encodes to the ids `tinymoe tokenize` gives it: its bytes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "../train/hf.h"
#include "child.h"
#include "common.h"

static cJSON *read_json(const char *path) {
    long len;
    char *s = (char *)tt_slurp(path, &len);
    cr_assert(s, "cannot read %s", path);
    cJSON *j = cJSON_ParseWithLength(s, (size_t)len);
    cr_assert(j, "%s is not JSON", path);
    free(s);
    return j;
}

/* The id of the vocabulary entry whose key is the UTF-8 of code point cp. */
static int vocab_id(const cJSON *vocab, unsigned cp) {
    char k[4] = {0};
    if (cp < 0x80) k[0] = (char)cp;
    else k[0] = (char)(0xC0 | cp >> 6), k[1] = (char)(0x80 | (cp & 0x3F));
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(vocab, k);
    cr_assert(cJSON_IsNumber(v), "no vocabulary entry for U+%04X", cp);
    return v->valueint;
}

Test(hf_tokenizer, byte_vocabulary_is_gpt2s_alphabet) {
    tt_tmpdir_make("tm_hftok_");
    char err[512];
    cr_assert_eq(tmd_hf_write_byte_tokenizer(tt_path("x"), 512, err, sizeof err), 0, "%s", err);
    cJSON *t = read_json(tt_path("x/tokenizer.json"));
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(t, "model");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    cr_assert_eq(cJSON_GetArraySize(vocab), 256);
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(model, "merges")), 0);
    unsigned char seen[256] = {0};
    for (const cJSON *e = vocab->child; e; e = e->next) {
        cr_assert(e->valueint >= 0 && e->valueint < 256 && !seen[e->valueint], "id %d twice or out of range", e->valueint);
        seen[e->valueint] = 1;
    }
    cr_assert_eq(vocab_id(vocab, 'A'), 'A');
    cr_assert_eq(vocab_id(vocab, '"'), '"');
    cr_assert_eq(vocab_id(vocab, '\\'), '\\');
    cr_assert_eq(vocab_id(vocab, '~'), '~');
    cr_assert_eq(vocab_id(vocab, 0x120), ' ');  /* 'Ġ' */
    cr_assert_eq(vocab_id(vocab, 0x10A), '\n'); /* 'Ċ' */
    cr_assert_eq(vocab_id(vocab, 0x100), 0);
    cr_assert_eq(vocab_id(vocab, 0xE9), 0xE9);  /* 'é' is its own byte value */
    cr_assert_eq(vocab_id(vocab, 0x143), 0xAD); /* soft hyphen, the last non-printable byte */
    const cJSON *added = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(t, "added_tokens"), 0);
    cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(added, "content")->valuestring, "<|endoftext|>");
    cr_assert_eq(cJSON_GetObjectItemCaseSensitive(added, "id")->valueint, 256);
    cJSON_Delete(t);
    cJSON *g = read_json(tt_path("x/generation_config.json"));
    cr_assert_eq(cJSON_GetObjectItemCaseSensitive(g, "eos_token_id")->valueint, 256);
    cJSON_Delete(g);
    cJSON *c = read_json(tt_path("x/tokenizer_config.json"));
    cr_assert_eq(cJSON_GetObjectItemCaseSensitive(c, "model_max_length")->valueint, 512);
    cJSON_Delete(c);
    tt_tmpdir_remove();
}

/* Tokenize a text, train two steps, export: the `tokenizers` library encodes the text (and
 * others: Unicode, emoji, whitespace runs, code) to exactly the ids tinymoe tokenize wrote. */
Test(hf_tokenizer, tokenizers_library_encodes_like_tinymoe_tokenize, .timeout = 180) {
    const char *py = tt_python_with("tokenizers");
    if (!py) cr_skip_test("no Python with the tokenizers package (scripts/install-pydeps.sh installs one)");
    tt_tmpdir_make("tm_hftok2_");
    FILE *f = fopen(tt_path("text.txt"), "w");
    for (int i = 0; i < 400; i++)
        fprintf(f, "Line %d: The quick brown fox — naïve café, 日本語, 😀 — jumps over {x[%d] >> 2}\n\t  end\n", i, i);
    fclose(f);
    char *tok[] = {(char *)tt_tinymoe(), "tokenize", (char *)tt_path("text.txt"), (char *)tt_path("text.bin"), NULL};
    cr_assert_eq(tt_run(tok, tt_path("tok.log"), 60, NULL), 0);
    char data[1100], out[1100], hf[1100];
    snprintf(data, sizeof data, "%s", tt_path("text.bin"));
    snprintf(out, sizeof out, "%s", tt_path("run"));
    snprintf(hf, sizeof hf, "%s", tt_path("hf"));
    char *train[] = {(char *)tt_tinymoe(), "train", "--data", data, "--steps", "2", "--eval_every", "0",
                     "--sample_tokens", "0", "--out", out, NULL};
    cr_assert_eq(tt_run(train, tt_path("train.log"), 120, NULL), 0);
    char *exp[] = {(char *)tt_tinymoe(), "export", "--ckpt", out, "--out", hf, NULL};
    cr_assert_eq(tt_run(exp, tt_path("export.log"), 60, NULL), 0);
    long len;
    char *log = (char *)tt_slurp(tt_path("export.log"), &len);
    cr_assert(strstr(log, "tokenizer.json"), "export does not say it wrote the tokenizer:\n%s", log);
    free(log);
    char *check[] = {(char *)py, "tests/hf_tokenizer_check.py", hf, (char *)tt_path("text.txt"), NULL};
    int rc = tt_run(check, tt_path("check.log"), 120, NULL);
    log = (char *)tt_slurp(tt_path("check.log"), &len);
    cr_assert_eq(rc, 0, "the tokenizers library disagrees (exit %d):\n%s", rc, log ? log : "");
    cr_log_info("%s", log);
    free(log);
    tt_tmpdir_remove();
}
