/*
 * test_bpe_train.c — `tinymoe tokenize --bpe N` (issue 23): the trainer's merges on a corpus
 * whose pair counts are known by hand, the vocabulary bound, a round trip through our own
 * encoder, refusals, and (tests/bpe_train_check.py, with the `tokenizers` package; skipped
 * without it unless TM_REQUIRE_PYDEPS=1) that the library loads the trained file and encodes a
 * Unicode-rich text to the ids tinymoe wrote; the incremental merge learner against the
 * recount-everything reference (tests/bpe_train_naive.c) on several corpora; and transformers'
 * AutoTokenizer on the export of a model trained with such a tokenizer.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "../train/bpe.h"
#include "../train/bpe_train.h"
#include "bpe_train_naive.h"
#include "child.h"
#include "common.h"

static void write_text(const char *path, const char *s) {
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    fputs(s, f);
    fclose(f);
}

static cJSON *merges_of(const char *path) {
    long len;
    char *s = (char *)tt_slurp(path, &len);
    cr_assert(s, "cannot read %s", path);
    cJSON *j = cJSON_ParseWithLength(s, (size_t)len);
    free(s);
    cr_assert(j, "%s is not JSON", path);
    return j;
}

/* "ab ab ab ab cd cd" under GPT-2's split: "ab" once, " ab" three times, " cd" twice. Pairs:
 * (a,b) 4, (' ',a) 3, (' ',c) 2, (c,d) 2: a+b first; then (' ',ab) 3; then (' ',c) and (c,d)
 * tie at 2 and the smaller ids go first: ' ' (32) + 'c'. */
Test(bpe_train, merges_follow_the_pair_counts) {
    tt_tmpdir_make("tm_bpetr_");
    write_text(tt_path("in.txt"), "ab ab ab ab cd cd");
    char err[512];
    int merges = -1;
    cr_assert_eq(tmd_bpe_train_file(tt_path("in.txt"), 300, tt_path("tok.json"), &merges, err, sizeof err), 0, "%s", err);
    cr_assert_eq(merges, 4, "merges %d", merges); /* a b, Ġ ab, Ġ c, Ġc d: then every word is one token */
    cJSON *j = merges_of(tt_path("tok.json"));
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "model"), "merges");
    const char *want[4][2] = {{"a", "b"}, {"\xc4\xa0", "ab"}, {"\xc4\xa0", "c"}, {"\xc4\xa0" "c", "d"}};
    cr_assert_eq(cJSON_GetArraySize(m), 4);
    for (int i = 0; i < 4; i++) {
        const cJSON *p = cJSON_GetArrayItem(m, i);
        cr_assert_str_eq(cJSON_GetArrayItem(p, 0)->valuestring, want[i][0], "merge %d", i);
        cr_assert_str_eq(cJSON_GetArrayItem(p, 1)->valuestring, want[i][1], "merge %d", i);
    }
    cJSON_Delete(j);
    /* our encoder: " ab" is one token, id 257; end-of-text is the last id (260) */
    tmd_bpe *t = NULL;
    cr_assert_eq(tmd_bpe_load(tt_path("tok.json"), &t, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_bpe_vocab_size(t), 261);
    cr_assert_eq(tmd_bpe_eot(t), 260);
    uint32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    cr_assert_eq(tmd_bpe_encode(t, " ab cd", 6, &ids, &n, &cap, err, sizeof err), 0, "%s", err);
    cr_assert_eq(n, 2);
    cr_assert_eq(ids[0], 257);
    cr_assert_eq(ids[1], 259);
    free(ids);
    tmd_bpe_free(t);
    tt_tmpdir_remove();
}

/* A real text: at most N ids, and encoding then decoding gives every byte back. */
Test(bpe_train, vocabulary_bound_and_round_trip) {
    tt_tmpdir_make("tm_bpetr2_");
    FILE *f = fopen(tt_path("in.txt"), "wb");
    for (int i = 0; i < 300; i++)
        fprintf(f, "Line %d: naïve café — 日本語 😀 the quick brown fox jumps over the lazy dog %d\n\t  x\n", i, i * 7);
    fclose(f);
    char err[512];
    int merges = 0;
    cr_assert_eq(tmd_bpe_train_file(tt_path("in.txt"), 400, tt_path("tok.json"), &merges, err, sizeof err), 0, "%s", err);
    cr_assert_eq(merges, 400 - 257, "a text this varied has pairs left for every merge (%d)", merges);
    tmd_bpe *t = NULL;
    cr_assert_eq(tmd_bpe_load(tt_path("tok.json"), &t, err, sizeof err), 0, "%s", err);
    cr_assert_leq(tmd_bpe_vocab_size(t), 400);
    long len;
    unsigned char *text = tt_slurp(tt_path("in.txt"), &len);
    uint32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    cr_assert_eq(tmd_bpe_encode(t, (const char *)text, (size_t)len, &ids, &n, &cap, err, sizeof err), 0, "%s", err);
    cr_assert_lt(n, len / 2, "%lld ids for %ld bytes: the merges compress", (long long)n, len);
    long at = 0;
    for (int64_t i = 0; i < n; i++) {
        const unsigned char *b;
        int k = tmd_bpe_token_bytes(t, ids[i], &b);
        cr_assert_geq(k, 1);
        cr_assert(at + k <= len && !memcmp(text + at, b, (size_t)k), "id %lld decodes to other bytes", (long long)i);
        at += k;
    }
    cr_assert_eq(at, len);
    free(ids);
    free(text);
    tmd_bpe_free(t);
    tt_tmpdir_remove();
}

Test(bpe_train, refusals_name_the_flag_and_file) {
    tt_tmpdir_make("tm_bpetr3_");
    char err[512];
    cr_assert_neq(tmd_bpe_train_file(tt_path("in.txt"), 257, tt_path("tok.json"), NULL, err, sizeof err), 0);
    cr_assert(strstr(err, "--bpe 257"), "%s", err);
    cr_assert_neq(tmd_bpe_train_file(tt_path("missing.txt"), 300, tt_path("tok.json"), NULL, err, sizeof err), 0);
    cr_assert(strstr(err, "missing.txt"), "%s", err);
    char *argv[] = {(char *)tt_tinymoe(), "tokenize", "--bpe", "12", (char *)tt_path("in.txt"), (char *)tt_path("o.bin"), NULL};
    cr_assert_eq(tt_run(argv, tt_path("log"), 30, NULL), 2);
    long len;
    char *log = (char *)tt_slurp(tt_path("log"), &len);
    cr_assert(strstr(log, "--bpe"), "%s", log);
    free(log);
    tt_tmpdir_remove();
}

Test(bpe_train, tokenizers_library_encodes_like_tinymoe) {
    TT_WATCHDOG(120);
    const char *py = tt_python_with("tokenizers");
    if (!py) cr_skip_test("no Python with the tokenizers package (scripts/install-pydeps.sh installs one)");
    tt_tmpdir_make("tm_bpetr4_");
    FILE *f = fopen(tt_path("in.txt"), "wb");
    for (int i = 0; i < 200; i++)
        fprintf(f, "First Citizen %d:\nBefore we proceed — naïve café, Ελληνικά, 日本語 😀👩‍👩‍👧 {x[%d] >> 2}\n\n  \t end  \n",
                i, i);
    fclose(f);
    char tokp[1100];
    snprintf(tokp, sizeof tokp, "%s", tt_path("tokenizer.json"));
    char *argv[] = {(char *)tt_tinymoe(), "tokenize", "--bpe", "600", (char *)tt_path("in.txt"), (char *)tt_path("in.bin"),
                    NULL};
    int rc = tt_run(argv, tt_path("tok.log"), 60, NULL);
    long len;
    char *log = (char *)tt_slurp(tt_path("tok.log"), &len);
    cr_assert_eq(rc, 0, "tokenize --bpe exit %d:\n%s", rc, log);
    cr_assert(strstr(log, "trained a byte-level BPE of 600 tokens"), "%s", log);
    free(log);
    char *check[] = {(char *)py, "tests/bpe_train_check.py", tokp, (char *)tt_path("in.txt"), (char *)tt_path("in.bin"),
                     NULL};
    rc = tt_run(check, tt_path("check.log"), 90, NULL);
    log = (char *)tt_slurp(tt_path("check.log"), &len);
    cr_assert_eq(rc, 0, "the tokenizers library disagrees (exit %d):\n%s", rc, log ? log : "");
    cr_log_info("%s", log);
    free(log);
    tt_tmpdir_remove();
}

/* ---- the incremental learner against the recount-everything one (tests/bpe_train_naive.c) -- */

typedef struct text_buf {
    char *p;
    size_t n, cap;
} text_buf;

static void tb_add(text_buf *b, const void *s, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = 2 * (b->n + n) + 4096;
        b->p = realloc(b->p, b->cap);
        cr_assert(b->p);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static void tb_file(text_buf *b, const char *path, long max) {
    long len;
    unsigned char *s = tt_slurp(path, &len);
    cr_assert(s, "cannot read %s", path);
    tb_add(b, s, (size_t)(len < max ? len : max));
    free(s);
}

static uint64_t lcg(uint64_t *s) { return (*s = *s * 6364136223846793005ull + 1442695040888963407ull) >> 33; }

/* Same merges, same ids, same count, for each vocabulary size. */
static void same_merges(const char *what, const text_buf *text, const int *sizes, int nsizes) {
    char err[512];
    tmd_bpe_word *w = NULL;
    size_t nw = 0;
    cr_assert_eq(tmd_bpe_count_words((const unsigned char *)text->p, text->n, &w, &nw, err, sizeof err), 0, "%s", err);
    for (int s = 0; s < nsizes; s++) {
        tmd_bpe_merges fast, ref;
        cr_assert_eq(tmd_bpe_learn(w, nw, sizes[s], &fast, err, sizeof err), 0, "%s", err);
        cr_assert_eq(tt_bpe_learn_naive(w, nw, sizes[s], &ref), 0);
        cr_assert_eq(fast.n, ref.n, "%s, %d tokens: %d merges against the reference's %d", what, sizes[s], fast.n, ref.n);
        for (int q = 0; q < ref.n; q++)
            cr_assert(fast.left[q] == ref.left[q] && fast.right[q] == ref.right[q] && fast.id[q] == ref.id[q],
                      "%s, %d tokens, merge %d: (%d, %d) -> %d against the reference's (%d, %d) -> %d", what, sizes[s], q,
                      fast.left[q], fast.right[q], fast.id[q], ref.left[q], ref.right[q], ref.id[q]);
        cr_log_info("%s: %zu bytes, %zu distinct words, %d tokens: %d merges identical", what, text->n, nw, sizes[s],
                    ref.n);
        tmd_bpe_merges_free(&fast);
        tmd_bpe_merges_free(&ref);
    }
    tmd_bpe_words_free(w, nw);
}

Test(bpe_train, incremental_merges_equal_the_full_recount) {
    TT_WATCHDOG(240);
    const int sizes[] = {300, 1000, 2500};
    text_buf b = {0};
    /* prose with Unicode and emoji, repeated with varying numbers: many tied counts */
    char line[512];
    for (int i = 0; i < 400; i++) {
        int k = snprintf(line, sizeof line,
                         "Line %d: naïve café — 日本語 Ελληνικά 😀👩‍👩‍👧 the quick brown fox jumps over the lazy dog %d\n\t  x\n",
                         i, i * 7);
        tb_add(&b, line, (size_t)k);
    }
    same_merges("prose", &b, sizes, 3);
    /* source code */
    b.n = 0;
    tb_file(&b, "train/bpe.c", 1 << 20);
    tb_file(&b, "train/bpe_pretok.c", 1 << 20);
    tb_file(&b, "framework/dispatch.c", 1 << 20);
    same_merges("source code", &b, sizes, 3);
    /* random words over two and three letters: long words, overlapping pairs (a, a), ties */
    uint64_t seed = 23;
    for (int alpha = 2; alpha <= 3; alpha++) {
        b.n = 0;
        for (int i = 0; i < 4000; i++) {
            int len = 1 + (int)(lcg(&seed) % 30);
            for (int j = 0; j < len; j++) tb_add(&b, &"abc"[lcg(&seed) % (uint64_t)alpha], 1);
            tb_add(&b, " ", 1);
        }
        same_merges(alpha == 2 ? "random words of a, b" : "random words of a, b, c", &b, sizes, 3);
    }
    /* long runs (one word of 5,000 'a's: merges inside a word that overlap), digits, spaces; a
     * vocabulary larger than the text's pairs: both run out at the same merge */
    b.n = 0;
    for (int i = 0; i < 5000; i++) tb_add(&b, "a", 1);
    tb_add(&b, " 11111111111111111111111 ", 25);
    for (int i = 0; i < 300; i++) tb_add(&b, i % 7 ? " " : "\n", 1);
    for (int i = 0; i < 999; i++) tb_add(&b, "ab", 2);
    tb_add(&b, " 😀😀😀😀😀😀😀 aaa", 33);
    same_merges("runs", &b, sizes, 3);
    /* tinyshakespeare, when the shared data is at hand (not needed: the corpora above stand alone) */
    const char *ts = "../shared/data/tinyshakespeare.txt";
    FILE *f = fopen(ts, "rb");
    if (f) {
        fclose(f);
        b.n = 0;
        tb_file(&b, ts, 400000);
        same_merges("tinyshakespeare (400 kB)", &b, (const int[]){1000}, 1);
    }
    free(b.p);
}

/* tokenize --bpe -> train -> export: transformers' AutoTokenizer on the export directory encodes
 * the training text and an unseen one (code, scripts, emoji, whitespace runs, the literal
 * <|endoftext|>) to the ids tinymoe wrote, decodes them back, and has tinymoe's end-of-text as
 * eos (tests/bpe_export_check.py). Skipped without transformers unless TM_REQUIRE_PYDEPS=1. */
Test(bpe_train, export_autotokenizer_encodes_like_tinymoe) {
    TT_WATCHDOG(300);
    const char *py = tt_python_with("transformers");
    if (!py) cr_skip_test("no Python with transformers (scripts/install-pydeps.sh installs it)");
    tt_tmpdir_make("tm_bpetr5_");
    FILE *f = fopen(tt_path("in.txt"), "wb");
    for (int i = 0; i < 300; i++)
        fprintf(f, "First Citizen %d:\nBefore we proceed any further — naïve café, Ελληνικά, 日本語 😀 {x[%d] >> 2}\n\n",
                i, i * 3);
    fclose(f);
    f = fopen(tt_path("other.txt"), "wb");
    fputs("int main(void) { return a[i] << 2 | b ^ ~c; }  // \"quoted\"\n\n\n    indented\t\ttabs  \r\n"
          "Привет, мир! 한국어 🚀👩‍👩‍👧 3.14159 -42 <|endoftext|> after the special token   ",
          f);
    fclose(f);
    char in[1100], in_bin[1100], other[1100], other_bin[1100], tok[1100], run[1100], hf[1100];
    snprintf(in, sizeof in, "%s", tt_path("in.txt"));
    snprintf(in_bin, sizeof in_bin, "%s", tt_path("in.bin"));
    snprintf(other, sizeof other, "%s", tt_path("other.txt"));
    snprintf(other_bin, sizeof other_bin, "%s", tt_path("other.bin"));
    snprintf(tok, sizeof tok, "%s", tt_path("tokenizer.json"));
    snprintf(run, sizeof run, "%s", tt_path("run"));
    snprintf(hf, sizeof hf, "%s", tt_path("hf"));
    char *steps[][20] = {
        {(char *)tt_tinymoe(), "tokenize", "--bpe", "700", in, in_bin, NULL},
        {(char *)tt_tinymoe(), "tokenize", "--tokenizer", tok, other, other_bin, NULL},
        {(char *)tt_tinymoe(), "train", "--data", in_bin, "--tokenizer", tok, "--steps", "2", "--eval_every", "0",
         "--sample_tokens", "0", "--threads", "2", "--out", run, NULL},
        {(char *)tt_tinymoe(), "export", "--ckpt", run, "--out", hf, NULL},
    };
    for (int s = 0; s < 4; s++) {
        int rc = tt_run(steps[s], tt_path("step.log"), 120, NULL);
        long len;
        char *log = (char *)tt_slurp(tt_path("step.log"), &len);
        cr_assert_eq(rc, 0, "tinymoe %s: exit %d\n%s", steps[s][1], rc, log ? log : "");
        free(log);
    }
    char *check[] = {(char *)py, "tests/bpe_export_check.py", hf, in, in_bin, other, other_bin, NULL};
    int rc = tt_run(check, tt_path("check.log"), 240, NULL);
    long len;
    char *log = (char *)tt_slurp(tt_path("check.log"), &len);
    cr_assert_eq(rc, 0, "transformers' AutoTokenizer disagrees (exit %d):\n%s", rc, log ? log : "");
    cr_log_info("%s", log);
    free(log);
    tt_tmpdir_remove();
}
