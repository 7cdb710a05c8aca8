/*
 * test_bpe.c — byte-level BPE tokenizers (train/bpe.c, train/bpe_pretok.c) against the
 * references, and their refusals.
 *
 * bpe/oracle_*: tests/bpe_oracle.py trains byte-level BPE tokenizers with Hugging Face
 * `tokenizers` (GPT-2's split, Llama-3's with ignore_merges, tiktoken's cl100k spelling, Qwen2's
 * single digits, add_prefix_space, merges as "a b" strings, and pre-tokenizers of made-up patterns
 * and every Split behavior that the old hand-written splits refused) on generated English-like text, a
 * multilingual / emoji / odd-whitespace sample, whitespace runs, text around special tokens and
 * this repository's sources (plus tinyshakespeare when ../shared has it), and writes the ids
 * that `tokenizers` and `tiktoken` give. Every id must be the same here, and every sequence
 * must decode back to its text byte for byte. Without a Python that has both packages the test
 * skips with the reason, except with TM_REQUIRE_PYDEPS=1 (CI), where it fails (tt_python_with;
 * scripts/install-pydeps.sh installs them into .pyenv/).
 */
#include <cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bpe.h"
#include "bpe_norm.h"
#include "bpe_pretok.h"
#include "child.h"
#include "common.h"
#include "data.h"
#include "status.h"

static void setup(void) { tt_tmpdir_make("tm_test_bpe_"); }
static void teardown(void) {
    tt_kill_children();
    tt_tmpdir_remove();
}
TestSuite(bpe, .init = setup, .fini = teardown);

/* ---- the reference ids -------------------------------------------------------------------- */

/* Skip (or fail under TM_REQUIRE_PYDEPS=1) when the reference cannot run. */
static void run_oracle(const char *dir) {
    const char *py = tt_python_with("tokenizers, tiktoken");
    if (!py) cr_skip_test("no Python with the tokenizers and tiktoken packages (scripts/install-pydeps.sh installs them)");
    const char *log = tt_path("oracle.log");
    char repo[4096];
    if (!getcwd(repo, sizeof repo)) cr_assert_fail("getcwd");
    const char *shakespeare = "../shared/data/tinyshakespeare.txt";
    char extra[4200];
    snprintf(extra, sizeof extra, "shakespeare=%s", shakespeare);
    struct stat st;
    int have_sh = stat(shakespeare, &st) == 0;
    char *argv[] = {(char *)py, "tests/bpe_oracle.py", (char *)dir, "--repo", repo,
                    have_sh ? "--extra" : NULL, extra, NULL};
    int rc = tt_run(argv, log, 600, NULL);
    long n;
    unsigned char *out = tt_slurp(log, &n);
    cr_assert_eq(rc, 0, "tests/bpe_oracle.py failed (exit %d):\n%s", rc, out ? (char *)out : "");
    cr_log_info("%s", out ? (char *)out : "");
    free(out);
}

static uint32_t *read_u32(const char *path, int64_t *n) {
    long len;
    unsigned char *b = tt_slurp(path, &len);
    cr_assert(b, "cannot read %s", path);
    *n = len / 4;
    uint32_t *v = malloc(sizeof *v * (size_t)(*n + 1));
    for (int64_t i = 0; i < *n; i++)
        v[i] = (uint32_t)b[4 * i] | (uint32_t)b[4 * i + 1] << 8 | (uint32_t)b[4 * i + 2] << 16 |
               (uint32_t)b[4 * i + 3] << 24;
    free(b);
    return v;
}

/* The pieces around the first difference, for the message. */
static void show_diff(const tmd_bpe *t, const uint32_t *got, int64_t ng, const uint32_t *want, int64_t nw,
                      char *buf, size_t len) {
    int64_t i = 0;
    while (i < ng && i < nw && got[i] == want[i]) i++;
    size_t w = (size_t)snprintf(buf, len, "first difference at id %lld of %lld (reference) / %lld (here):\n", (long long)i,
                                (long long)nw, (long long)ng);
    for (int side = 0; side < 2 && w < len; side++) {
        const uint32_t *v = side ? got : want;
        int64_t n = side ? ng : nw;
        w += (size_t)snprintf(buf + w, len - w, "  %s:", side ? "here     " : "reference");
        for (int64_t k = i > 4 ? i - 4 : 0; k < n && k < i + 6 && w < len; k++) {
            const unsigned char *b;
            int bl = tmd_bpe_token_bytes(t, v[k], &b);
            w += (size_t)snprintf(buf + w, len - w, " %u'%.*s'", v[k], bl > 0 ? bl : 0, bl > 0 ? (const char *)b : "");
        }
        if (w < len) w += (size_t)snprintf(buf + w, len - w, "\n");
    }
}

Test(bpe, oracle_tokenizers_and_tiktoken_ids_and_round_trips) {
    TT_WATCHDOG(900);
    const char *dir = tt_path("oracle");
    run_oracle(dir);
    char path[4400], kind[64], name[64];
    snprintf(path, sizeof path, "%s/manifest.txt", dir);
    FILE *man = fopen(path, "r");
    cr_assert(man);
    int cases = 0, failed = 0;
    static char msg[1 << 16];
    msg[0] = 0;
    while (fscanf(man, "%63s %63s", kind, name) == 2) {
        snprintf(path, sizeof path, "%s/tok_%s.json", dir, strcmp(kind, "tiktoken") ? kind : "cl100k");
        tmd_bpe *t;
        char err[2048];
        cr_assert_eq(tmd_bpe_load(path, &t, err, sizeof err), 0, "%s", err);
        snprintf(path, sizeof path, "%s/corpus_%s.txt", dir, name);
        long len;
        unsigned char *text = tt_slurp(path, &len);
        snprintf(path, sizeof path, "%s/ids_%s_%s.u32", dir, kind, name);
        int64_t nw, ng = 0, cap = 0;
        uint32_t *want = read_u32(path, &nw), *got = NULL;
        cr_assert_eq(tmd_bpe_encode(t, (const char *)text, (size_t)len, &got, &ng, &cap, err, sizeof err), 0, "%s", err);
        int same = ng == nw && !memcmp(got, want, sizeof *got * (size_t)ng);
        if (!same) {
            size_t w = strlen(msg);
            snprintf(msg + w, sizeof msg - w, "%s on %s: ", kind, name);
            w = strlen(msg);
            show_diff(t, got, ng, want, nw, msg + w, sizeof msg - w);
            failed++;
        }
        /* Decoding gives back the text (add_prefix_space: with its space in front). */
        size_t cap_b = (size_t)len + 16, nb = 0;
        unsigned char *back = malloc(cap_b + 64);
        int ok = 1;
        for (int64_t i = 0; i < ng && ok; i++) {
            const unsigned char *b;
            int bl = tmd_bpe_token_bytes(t, got[i], &b);
            ok = bl >= 0 && nb + (size_t)bl <= cap_b;
            if (ok) memcpy(back + nb, b, (size_t)bl), nb += (size_t)bl;
        }
        /* prefix: a space before the text and after every special token that is not followed by
         * one; lossy*: a Removed behavior drops text */
        int prefixed = !strcmp(kind, "prefix") || !strncmp(kind, "lossy", 5);
        if (prefixed) {
            /* a space before the text and after every special token that is not followed by one */
            ok = ok && nb >= (size_t)len;
        } else if (!(ok && nb == (size_t)len && !memcmp(back, text, nb))) {
            size_t w = strlen(msg);
            snprintf(msg + w, sizeof msg - w, "%s on %s: decoding does not give the text back (%zu bytes, want %ld)\n",
                     kind, name, nb, len);
            failed++;
        }
        free(back);
        free(text);
        free(want);
        free(got);
        tmd_bpe_free(t);
        cases++;
    }
    fclose(man);
    cr_assert_gt(cases, 30, "only %d cases in the manifest", cases);
    cr_assert_eq(failed, 0, "%d of %d cases differ:\n%s", failed, cases, msg);
}

/* ---- a hand-made tokenizer for the refusals and the token files --------------------------- */

/* GPT-2's bytes_to_unicode, written here again from its definition. */
static void put_byte_char(char *dst, int b) {
    int n = 0, cp = -1;
    for (int x = 0; x < 256; x++) {
        int self = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
        int c = self ? x : 256 + n++;
        if (x == b) cp = c;
    }
    if (cp < 0x80) dst[0] = (char)cp, dst[1] = 0;
    else dst[0] = (char)(0xC0 | cp >> 6), dst[1] = (char)(0x80 | (cp & 0x3F)), dst[2] = 0;
}

/* Byte b is id b; merges "l l" -> 256 (rank 0) and "h e" -> 257 (rank 1); <|endoftext|> is
 * eot_id. */
static cJSON *small_tokenizer(int eot_id) {
    cJSON *j = cJSON_CreateObject(), *m = cJSON_AddObjectToObject(j, "model"), *v = cJSON_AddObjectToObject(m, "vocab");
    cJSON_AddStringToObject(m, "type", "BPE");
    cJSON_AddNullToObject(m, "dropout");
    cJSON_AddFalseToObject(m, "byte_fallback");
    char s[8];
    for (int b = 0; b < 256; b++) {
        put_byte_char(s, b);
        cJSON_AddNumberToObject(v, s, b);
    }
    cJSON_AddNumberToObject(v, "ll", 256);
    cJSON_AddNumberToObject(v, "he", 257);
    cJSON *mg = cJSON_AddArrayToObject(m, "merges");
    cJSON_AddItemToArray(mg, cJSON_CreateString("l l"));
    cJSON_AddItemToArray(mg, cJSON_CreateString("h e"));
    cJSON *pt = cJSON_AddObjectToObject(j, "pre_tokenizer");
    cJSON_AddStringToObject(pt, "type", "ByteLevel");
    cJSON_AddFalseToObject(pt, "add_prefix_space");
    cJSON_AddTrueToObject(pt, "trim_offsets"); /* not read here; the `tokenizers` library needs it */
    cJSON_AddTrueToObject(pt, "use_regex");
    cJSON *dec = cJSON_AddObjectToObject(j, "decoder");
    cJSON_AddStringToObject(dec, "type", "ByteLevel");
    cJSON_AddFalseToObject(dec, "add_prefix_space");
    cJSON_AddTrueToObject(dec, "trim_offsets");
    cJSON_AddTrueToObject(dec, "use_regex");
    cJSON_AddNullToObject(j, "normalizer");
    cJSON *at = cJSON_AddArrayToObject(j, "added_tokens"), *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "id", eot_id);
    cJSON_AddStringToObject(e, "content", "<|endoftext|>");
    cJSON_AddFalseToObject(e, "single_word");
    cJSON_AddFalseToObject(e, "lstrip");
    cJSON_AddFalseToObject(e, "rstrip");
    cJSON_AddFalseToObject(e, "normalized");
    cJSON_AddTrueToObject(e, "special");
    cJSON_AddItemToArray(at, e);
    return j;
}

static const char *write_json(const cJSON *j, const char *name) {
    const char *p = tt_path(name);
    char *s = cJSON_PrintUnformatted(j);
    FILE *f = fopen(p, "w");
    cr_assert(f);
    fputs(s, f);
    fclose(f);
    free(s);
    return p;
}

Test(bpe, small_tokenizer_encodes_by_hand) {
    cJSON *j = small_tokenizer(258);
    const char *p = write_json(j, "t.json");
    cJSON_Delete(j);
    tmd_bpe *t;
    char err[1024];
    cr_assert_eq(tmd_bpe_load(p, &t, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_bpe_vocab_size(t), 259);
    cr_assert_eq(tmd_bpe_eot(t), 258);
    /* "hello" -> he l l o -> "he" merged after "ll" (lower rank first): he, ll, o */
    const char *text = "hello<|endoftext|> hell";
    uint32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    cr_assert_eq(tmd_bpe_encode(t, text, strlen(text), &ids, &n, &cap, err, sizeof err), 0);
    /* "hello": (l,l) has rank 0, (h,e) rank 1 -> he ll o; the special token; " hell" is one
     * GPT-2 piece -> ' ' he ll */
    uint32_t want[] = {257, 256, 'o', 258, ' ', 257, 256};
    cr_assert_eq(n, 7, "%lld ids", (long long)n);
    for (int i = 0; i < 7; i++) cr_assert_eq(ids[i], want[i], "id %d: %u, want %u", i, ids[i], want[i]);
    free(ids);
    /* decoding: merges to their bytes, the special token to its text, padded ids to nothing */
    const unsigned char *b;
    cr_assert(tmd_bpe_token_bytes(t, 256, &b) == 2 && !memcmp(b, "ll", 2));
    cr_assert(tmd_bpe_token_bytes(t, 258, &b) == 13 && !memcmp(b, "<|endoftext|>", 13));
    cr_assert(tmd_bpe_token_bytes(t, ' ', &b) == 1 && b[0] == ' ');
    cr_assert_eq(tmd_bpe_token_bytes(t, 259, &b), -1);
    cr_assert_eq(tmd_bpe_token_bytes(t, -1, &b), -1);
    tmd_bpe_free(t);
}

/* Each broken tokenizer.json is refused with the file and the field named. */
Test(bpe, malformed_tokenizer_json_names_file_and_field) {
    struct {
        const char *what, *field;
        void (*edit)(cJSON *);
    } cases[] = {
        {"WordPiece model", "model.type", NULL},          {"byte fallback", "model.byte_fallback", NULL},
        {"NFKC normalizer", "normalizer.type", NULL},           {"a pattern PCRE2 cannot compile", "pretokenizers[0].pattern.Regex", NULL},
        {"bad merge", "model.merges[1]", NULL},           {"a missing byte", "model.vocab", NULL},
        {"lstrip", "added_tokens[0].lstrip", NULL},        {"no decoder", "decoder.type", NULL},
        {"a merge of unknown tokens", "model.merges[0]", NULL}, {"a negative id", "model.vocab[", NULL},
        {"Metaspace", "pre_tokenizer.type", NULL},
        {"\\w, which Oniguruma and PCRE2 read differently", "pretokenizers[0].pattern.Regex", NULL},
        {"an unknown behavior", "pretokenizers[0].behavior", NULL},
    };
    int n = (int)(sizeof cases / sizeof *cases);
    for (int i = 0; i < n; i++) {
        cJSON *j = small_tokenizer(258), *m = cJSON_GetObjectItem(j, "model");
        switch (i) {
        case 0: cJSON_ReplaceItemInObject(m, "type", cJSON_CreateString("WordPiece")); break;
        case 1: cJSON_ReplaceItemInObject(m, "byte_fallback", cJSON_CreateTrue()); break;
        case 2: {
            cJSON *nz = cJSON_CreateObject();
            cJSON_AddStringToObject(nz, "type", "NFKC");
            cJSON_ReplaceItemInObject(j, "normalizer", nz);
            break;
        }
        case 3:
        case 11:
        case 12: {
            cJSON *pt = cJSON_CreateObject(), *seq = cJSON_AddArrayToObject(pt, "pretokenizers"), *sp = cJSON_CreateObject();
            cJSON_AddStringToObject(pt, "type", "Sequence");
            cJSON_AddStringToObject(sp, "type", "Split");
            cJSON_AddStringToObject(cJSON_AddObjectToObject(sp, "pattern"), "Regex",
                                    i == 3 ? "\\p{L}+|(\\p{N}" : i == 11 ? "\\w+|\\s+" : "\\p{L}+");
            cJSON_AddStringToObject(sp, "behavior", i == 12 ? "Glued" : "Isolated");
            cJSON_AddItemToArray(seq, sp);
            cJSON *bl = cJSON_CreateObject();
            cJSON_AddStringToObject(bl, "type", "ByteLevel");
            cJSON_AddFalseToObject(bl, "use_regex");
            cJSON_AddItemToArray(seq, bl);
            cJSON_ReplaceItemInObject(j, "pre_tokenizer", pt);
            break;
        }
        case 4: cJSON_ReplaceItemInArray(cJSON_GetObjectItem(m, "merges"), 1, cJSON_CreateString("h e x")); break;
        case 5: cJSON_DeleteItemFromObject(cJSON_GetObjectItem(m, "vocab"), "A"); break;
        case 6: cJSON_ReplaceItemInObject(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "added_tokens"), 0), "lstrip",
                                          cJSON_CreateTrue());
            break;
        case 7: cJSON_DeleteItemFromObject(j, "decoder"); break;
        case 8: cJSON_ReplaceItemInArray(cJSON_GetObjectItem(m, "merges"), 0, cJSON_CreateString("zz q")); break;
        case 9: cJSON_ReplaceItemInObject(cJSON_GetObjectItem(m, "vocab"), "ll", cJSON_CreateNumber(-3)); break;
        case 10:
            cJSON_ReplaceItemInObject(cJSON_GetObjectItem(j, "pre_tokenizer"), "type", cJSON_CreateString("Metaspace"));
            break;
        }
        char name[32];
        snprintf(name, sizeof name, "bad%d.json", i);
        const char *p = write_json(j, name);
        cJSON_Delete(j);
        tmd_bpe *t = NULL;
        char err[2048] = "";
        int rc = tmd_bpe_load(p, &t, err, sizeof err);
        cr_assert_eq(rc, TMD_CONFIG_ERROR, "%s: rc %d (%s)", cases[i].what, rc, err);
        cr_assert_null(t);
        cr_assert(strstr(err, p), "%s: the message does not name the file: %s", cases[i].what, err);
        cr_assert(strstr(err, cases[i].field), "%s: the message does not name '%s': %s", cases[i].what, cases[i].field,
                  err);
        /* PCRE2's own words and where in the pattern */
        if (i == 3) cr_assert(strstr(err, "missing closing parenthesis") && strstr(err, "offset 13"), "%s", err);
        if (i == 11) cr_assert(strstr(err, "\\w at offset 0") && strstr(err, "Oniguruma"), "%s", err);
    }
    /* not JSON at all, and a missing file */
    FILE *f = fopen(tt_path("notjson.json"), "w");
    fputs("{\"model\": {\"vocab\": {\"a\": 1,,}}", f);
    fclose(f);
    tmd_bpe *t = NULL;
    char err[2048];
    cr_assert_eq(tmd_bpe_load(tt_path("notjson.json"), &t, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "notjson.json") && strstr(err, "not valid JSON"), "%s", err);
    cr_assert_eq(tmd_bpe_load(tt_path("missing.json"), &t, err, sizeof err), TMD_CONFIG_ERROR);
    cr_assert(strstr(err, "missing.json"), "%s", err);
}

typedef struct piece_acc {
    char *out;
    size_t len;
} piece_acc;

static int join_piece(void *ctx, const unsigned char *p, size_t n) {
    piece_acc *a = ctx;
    size_t w = strlen(a->out);
    snprintf(a->out + w, a->len - w, "%s%.*s", w ? "|" : "", (int)n, (const char *)p);
    return 0;
}

/* The pieces of one Split, joined with '|'. */
static void pieces_of(const char *pattern, int literal, tmd_split_behavior beh, int invert, const char *text, char *out,
                      size_t len) {
    tmd_split *sp;
    char msg[512];
    cr_assert_eq(tmd_split_new(pattern, literal, beh, invert, &sp, msg, sizeof msg), 0, "%s: %s", pattern, msg);
    out[0] = 0;
    piece_acc a = {out, len};
    cr_assert_eq(tmd_split_pieces(sp, (const unsigned char *)text, strlen(text), join_piece, &a, msg, sizeof msg), 0,
                 "%s", msg);
    tmd_split_free(sp);
}

/* Every behavior, with and without invert, on the examples that tokenizers documents for them
 * (src/tokenizer/normalizer.rs, the doc of `split`; src/pre_tokenizers/split.rs, test `basic`),
 * and the places where Oniguruma and PCRE2 part (bpe_pretok.h), with what tokenizers 0.22.1 and
 * 0.23.2 give there: U+180E is no \s, {,2} is {0,2} (its empty matches are no pieces). */
Test(bpe, split_behaviors_as_tokenizers_documents_them) {
    static const struct {
        tmd_split_behavior b;
        const char *dash, *words;
    } want[] = {
        {TMD_SPLIT_REMOVED, "the|final|countdown", "How|are|you|doing|?"},
        {TMD_SPLIT_ISOLATED, "the|-|final|-|-|countdown", "How| |are| |you| |doing|?"},
        {TMD_SPLIT_MERGED_WITH_PREVIOUS, "the-|final-|-|countdown", "How |are |you |doing|?"},
        {TMD_SPLIT_MERGED_WITH_NEXT, "the|-final|-|-countdown", "How| are| you| doing|?"},
        {TMD_SPLIT_CONTIGUOUS, "the|-|final|--|countdown", "How| |are| |you| |doing?"},
    };
    char got[512];
    for (int i = 0; i < 5; i++) {
        pieces_of("-", 1, want[i].b, 0, "the-final--countdown", got, sizeof got);
        cr_assert_str_eq(got, want[i].dash, "behavior %d", (int)want[i].b);
        /* split.rs's \w+|[^\w\s]+ with invert, in the \p{L} spelling (\w is refused) */
        pieces_of("\\p{L}+|[^\\p{L}\\s]+", 0, want[i].b, 1, "How are you doing?", got, sizeof got);
        cr_assert_str_eq(got, want[i].words, "behavior %d, inverted", (int)want[i].b);
    }
    pieces_of("\\s", 0, TMD_SPLIT_ISOLATED, 0, "a\xe1\xa0\x8e" "b c", got, sizeof got);
    cr_assert_str_eq(got, "a\xe1\xa0\x8e" "b| |c");
    pieces_of("\\p{N}{,2}", 0, TMD_SPLIT_ISOLATED, 0, "ab12345c", got, sizeof got);
    cr_assert_str_eq(got, "a|b|12|34|5|c");
    /* a literal String pattern is no regex */
    pieces_of("a.c", 1, TMD_SPLIT_ISOLATED, 0, "abca.c", got, sizeof got);
    cr_assert_str_eq(got, "abc|a.c");
}

/* An id above 65535 makes the token file uint32 (llm.c's version 7), read back as written. */
Test(bpe, tokenize_writes_uint32_tokens_above_65535) {
    cJSON *j = small_tokenizer(70000);
    const char *tok = write_json(j, "big.json");
    cJSON_Delete(j);
    const char *in = tt_path("in.txt"), *out = tt_path("out.bin");
    FILE *f = fopen(in, "w");
    fputs("hello<|endoftext|>ab", f);
    fclose(f);
    char *argv[] = {(char *)tt_tinymoe(), "tokenize", "--tokenizer", (char *)tok, (char *)in, (char *)out, NULL};
    int rc = tt_run(argv, tt_path("log"), 60, NULL);
    long n;
    unsigned char *log = tt_slurp(tt_path("log"), &n);
    cr_assert_eq(rc, 0, "%s", log);
    free(log);
    unsigned char *b = tt_slurp(out, &n);
    cr_assert_eq(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, TMD_DATA_MAGIC_V7);
    free(b);
    tmd_tokens t;
    char err[1024];
    cr_assert_eq(tmd_tokens_load(out, &t, err, sizeof err), 0, "%s", err);
    uint32_t want[] = {257, 256, 'o', 70000, 'a', 'b', 70000}; /* the end-of-text appended */
    cr_assert_eq(t.n, 7);
    for (int i = 0; i < 7; i++) cr_assert_eq(t.tok[i], want[i], "token %d: %u, want %u", i, t.tok[i], want[i]);
    tmd_tokens_free(&t);
}

/* ---- the driver, end to end --------------------------------------------------------------- */

/* Run the tinymoe binary with args (NULL-terminated, after argv[0]); its exit code, and its
 * output in *out (malloc'ed). */
static int tinymoe(char **out, const char *log, ...) {
    char *argv[64];
    int n = 0;
    argv[n++] = (char *)tt_tinymoe();
    va_list ap;
    va_start(ap, log);
    for (char *a; (a = va_arg(ap, char *)) && n < 63;) argv[n++] = a;
    va_end(ap);
    argv[n] = NULL;
    int rc = tt_run(argv, tt_path(log), 300, NULL);
    long len;
    *out = (char *)tt_slurp(tt_path(log), &len);
    return rc;
}

/* tokenize -> train -> sample -> export through a tokenizer whose merges make "he" and "ll"
 * (ids 256, 257) and whose <|endoftext|> is 258. The model learns "hello hello ...", so its
 * greedy continuation is made of ids >= 256: before subword tokenizers, sample dropped every
 * one of them and printed "o o o". */
Test(bpe, tokenize_train_sample_export_through_the_run_tokenizer) {
    TT_WATCHDOG(600);
    cJSON *j = small_tokenizer(258);
    char tok[4096], txt[4096]; /* tt_path's buffers rotate */
    snprintf(tok, sizeof tok, "%s", write_json(j, "tokenizer.json"));
    cJSON_Delete(j);
    snprintf(txt, sizeof txt, "%s", tt_path("hello.txt"));
    FILE *f = fopen(txt, "w");
    for (int i = 0; i < 3000; i++) fputs("hello ", f);
    fclose(f);
    char *out;
    cr_assert_eq(tinymoe(&out, "tok.log", "tokenize", "--tokenizer", tok, txt, tt_path("hello.bin"), "--val-fraction",
                         "0.1", NULL),
                 0, "%s", out);
    cr_assert(strstr(out, "end-of-text 258 appended"), "%s", out);
    free(out);
    int rc = tinymoe(&out, "train.log", "train", "--preset", "tiny", "--data", tt_path("hello.bin"), "--val_data",
                     tt_path("hello_val.bin"), "--tokenizer", tok, "--steps", "40", "--lr", "0.02", "--threads", "2",
                     "--out", tt_path("run"), "--sample_prompt", "hello", "--sample_tokens", "6", "--temperature", "0",
                     "--progress", "lines", NULL);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "vocab_size") && strstr(out, "259"), "vocab_size does not follow the tokenizer:\n%s", out);
    free(out);
    /* the run's copy of the tokenizer, byte for byte */
    long la, lb;
    unsigned char *a = tt_slurp(tok, &la), *b = tt_slurp(tt_path("run/tokenizer.json"), &lb);
    cr_assert(b && la == lb && !memcmp(a, b, (size_t)la), "run/tokenizer.json is not the tokenizer");
    free(b);
    /* sample reads it from the run directory even once the original is gone */
    cr_assert_eq(rename(tok, tt_path("moved.json")), 0);
    rc = tinymoe(&out, "sample.log", "sample", "--ckpt", tt_path("run"), "--prompt", "hello", "--tokens", "12",
                 "--temperature", "0", NULL);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "hello hello hello"), "the continuation lost its subword tokens:\n%s", out);
    cr_assert(strstr(out, "tokenizer ") && strstr(out, "run/tokenizer.json"), "%s", out);
    free(out);
    /* export ships it; eval needs none */
    rc = tinymoe(&out, "export.log", "export", "--ckpt", tt_path("run"), "--out", tt_path("hf"), NULL);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    b = tt_slurp(tt_path("hf/tokenizer.json"), &lb);
    cr_assert(b && la == lb && !memcmp(a, b, (size_t)la), "hf/tokenizer.json is not the tokenizer");
    free(a);
    free(b);
    /* tokenizer_config.json and generation_config.json name the end-of-text token (258 here, by
     * construction of small_tokenizer) as the `tokenizers` library reads it from tokenizer.json,
     * and model_max_length is config.json's max_position_embeddings */
    const char *py = tt_python_with("tokenizers");
    if (py) {
        static const char check[] =
            "import json, os, sys\n"
            "from tokenizers import Tokenizer\n"
            "d = sys.argv[1]\n"
            "tok = Tokenizer.from_file(os.path.join(d, 'tokenizer.json'))\n"
            "tc = json.load(open(os.path.join(d, 'tokenizer_config.json')))\n"
            "gc = json.load(open(os.path.join(d, 'generation_config.json')))\n"
            "mc = json.load(open(os.path.join(d, 'config.json')))\n"
            "eos = tok.token_to_id(tc['eos_token'])\n"
            "assert tc['tokenizer_class'] == 'PreTrainedTokenizerFast', tc\n"
            "assert eos == 258 and gc['eos_token_id'] == eos and gc['pad_token_id'] == eos, (eos, gc)\n"
            "assert tc['model_max_length'] == mc['max_position_embeddings'], (tc, mc)\n"
            "assert tok.encode('hello' + tc['eos_token']).ids[-1] == eos\n"
            "print('ok', eos)\n";
        char *pargv[] = {(char *)py, "-c", (char *)check, (char *)tt_path("hf"), NULL};
        int prc = tt_run(pargv, tt_path("check.log"), 120, NULL);
        long pl;
        char *plog = (char *)tt_slurp(tt_path("check.log"), &pl);
        cr_assert_eq(prc, 0, "the export's tokenizer files, through tokenizers:\n%s", plog ? plog : "");
        free(plog);
    }
    rc = tinymoe(&out, "eval.log", "eval", "--ckpt", tt_path("run"), "--data", tt_path("hello_val.bin"), "--quiet",
                 NULL);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    /* without the run directory's copy nor the recorded file: a clear refusal, then --tokenizer */
    cr_assert_eq(mkdir(tt_path("bare"), 0755), 0);
    char ck[4096];
    snprintf(ck, sizeof ck, "%s", tt_path("bare/ckpt-00000040.tmck"));
    cr_assert_eq(rename(tt_path("run/ckpt-00000040.tmck"), ck), 0);
    rc = tinymoe(&out, "bare.log", "sample", "--ckpt", ck, "--prompt", "hello", "--tokens", "4", NULL);
    cr_assert_eq(rc, TMD_CONFIG_ERROR, "%s", out);
    cr_assert(strstr(out, "vocab_size 259 but no tokenizer") && strstr(out, "--tokenizer"), "%s", out);
    free(out);
    rc = tinymoe(&out, "bare2.log", "sample", "--ckpt", ck, "--prompt", "hello", "--tokens", "12", "--temperature",
                 "0", "--tokenizer", tt_path("moved.json"), NULL);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "hello hello hello"), "%s", out);
    free(out);
}

/* vocab_size set below the tokenizer's ids is refused before anything is built. */
Test(bpe, vocab_size_smaller_than_the_tokenizer_is_refused) {
    cJSON *j = small_tokenizer(258);
    char tok[4096], txt[4096];
    snprintf(tok, sizeof tok, "%s", write_json(j, "tokenizer.json"));
    cJSON_Delete(j);
    snprintf(txt, sizeof txt, "%s", tt_path("t.txt"));
    FILE *f = fopen(txt, "w");
    for (int i = 0; i < 500; i++) fputs("hello ", f);
    fclose(f);
    char *out;
    cr_assert_eq(tinymoe(&out, "tok.log", "tokenize", "--tokenizer", tok, txt, tt_path("t.bin"), NULL), 0, "%s", out);
    free(out);
    int rc = tinymoe(&out, "train.log", "train", "--preset", "tiny", "--data", tt_path("t.bin"), "--tokenizer", tok,
                     "--vocab_size", "257", "--out", "", NULL);
    cr_assert_eq(rc, TMD_CONFIG_ERROR, "%s", out);
    cr_assert(strstr(out, "key 'vocab_size' = 257: smaller than the 259 ids of key 'tokenizer'"), "%s", out);
    free(out);
}

/* A resumed run whose tokenizer file is gone takes the copy in its run directory. */
Test(bpe, resume_takes_the_run_copy_when_the_tokenizer_is_gone) {
    cJSON *j = small_tokenizer(258);
    char tok[4096], txt[4096];
    snprintf(tok, sizeof tok, "%s", write_json(j, "tokenizer.json"));
    cJSON_Delete(j);
    snprintf(txt, sizeof txt, "%s", tt_path("t.txt"));
    FILE *f = fopen(txt, "w");
    for (int i = 0; i < 500; i++) fputs("hello ", f);
    fclose(f);
    char *out;
    cr_assert_eq(tinymoe(&out, "tok.log", "tokenize", "--tokenizer", tok, txt, tt_path("t.bin"), NULL), 0, "%s", out);
    free(out);
    int rc = tinymoe(&out, "a.log", "train", "--preset", "tiny", "--data", tt_path("t.bin"), "--tokenizer", tok,
                     "--steps", "4", "--eval_every", "0", "--out", tt_path("run"), "--progress", "lines", NULL);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    cr_assert_eq(unlink(tok), 0);
    rc = tinymoe(&out, "b.log", "train", "--resume", tt_path("run"), "--steps", "6", "--progress", "lines", NULL);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(strstr(out, "is gone: the run's copy") && strstr(out, "run/tokenizer.json is used"), "%s", out);
    free(out);
}

/* Any bytes, invalid UTF-8 and NULs included, encode and decode back to themselves, under
 * either split (a byte-level tokenizer has a token for every byte). */
Test(bpe, any_bytes_round_trip) {
    for (int split = 0; split < 2; split++) {
        cJSON *j = small_tokenizer(258);
        if (split) {
            cJSON *pt = cJSON_CreateObject(), *seq = cJSON_AddArrayToObject(pt, "pretokenizers"), *sp = cJSON_CreateObject();
            cJSON_AddStringToObject(pt, "type", "Sequence");
            cJSON_AddStringToObject(sp, "type", "Split");
            cJSON_AddStringToObject(cJSON_AddObjectToObject(sp, "pattern"), "Regex",
                                    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                                    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+");
            cJSON_AddStringToObject(sp, "behavior", "Isolated");
            cJSON_AddItemToArray(seq, sp);
            cJSON *bl = cJSON_CreateObject();
            cJSON_AddStringToObject(bl, "type", "ByteLevel");
            cJSON_AddFalseToObject(bl, "use_regex");
            cJSON_AddItemToArray(seq, bl);
            cJSON_ReplaceItemInObject(j, "pre_tokenizer", pt);
        }
        const char *p = write_json(j, "rt.json");
        cJSON_Delete(j);
        tmd_bpe *t;
        char err[1024];
        cr_assert_eq(tmd_bpe_load(p, &t, err, sizeof err), 0, "%s", err);
        enum { N = 200000 };
        unsigned char *text = malloc(N), *back = malloc(N);
        uint64_t s = 12345 + (uint64_t)split;
        for (int i = 0; i < N; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            unsigned r = (unsigned)(s >> 33);
            /* mostly text-like, with runs of high bytes (valid and broken UTF-8) and controls */
            text[i] = r % 4 ? (unsigned char)" helo\n\t'sX9<|"[r % 14] : (unsigned char)(r >> 8);
        }
        uint32_t *ids = NULL;
        int64_t n = 0, cap = 0;
        cr_assert_eq(tmd_bpe_encode(t, (const char *)text, N, &ids, &n, &cap, err, sizeof err), 0);
        size_t nb = 0;
        for (int64_t i = 0; i < n; i++) {
            const unsigned char *b;
            int bl = tmd_bpe_token_bytes(t, ids[i], &b);
            cr_assert(bl > 0 && nb + (size_t)bl <= N, "id %u at %lld", ids[i], (long long)i);
            memcpy(back + nb, b, (size_t)bl);
            nb += (size_t)bl;
        }
        cr_assert(nb == N && !memcmp(back, text, N), "split %d: %zu bytes back of %d", split, nb, N);
        free(ids);
        free(text);
        free(back);
        tmd_bpe_free(t);
    }
}

/* ---- the NFC normalizer (train/bpe_norm.c) ------------------------------------------------ */

/* tests/bpe_nfc_oracle.py's tokenizers with an NFC normalizer (GPT-2's split, Qwen2's layout, a
 * Sequence of NFC) give the same ids here on accents written both ways, Vietnamese, Hangul
 * jamo, marks out of order, singletons, marks after special tokens and a normalized added token
 * written decomposed, over 64 KiB with and without ASCII; what the ids decode to is tokenizers'
 * decode (the NFC of the text). Without the normalizer the ids differ (the script checks that NFC
 * changes every corpus). */
Test(bpe, nfc_oracle_ids_and_decoding) {
    TT_WATCHDOG(600);
    const char *py = tt_python_with("tokenizers");
    if (!py) cr_skip_test("no Python with the tokenizers package (scripts/install-pydeps.sh installs it)");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", tt_path("nfc"));
    char *argv[] = {(char *)py, "tests/bpe_nfc_oracle.py", dir, NULL};
    int rc = tt_run(argv, tt_path("nfc.log"), 300, NULL);
    long ln;
    unsigned char *log = tt_slurp(tt_path("nfc.log"), &ln);
    cr_assert_eq(rc, 0, "tests/bpe_nfc_oracle.py failed (exit %d):\n%s", rc, log ? (char *)log : "");
    cr_log_info("%s", log ? (char *)log : "");
    free(log);
    char path[4400], kind[64], name[64];
    snprintf(path, sizeof path, "%s/manifest.txt", dir);
    FILE *man = fopen(path, "r");
    cr_assert(man);
    int cases = 0, failed = 0;
    static char msg[1 << 15];
    msg[0] = 0;
    while (fscanf(man, "%63s %63s", kind, name) == 2) {
        snprintf(path, sizeof path, "%s/tok_%s.json", dir, kind);
        tmd_bpe *t;
        char err[2048];
        cr_assert_eq(tmd_bpe_load(path, &t, err, sizeof err), 0, "%s", err);
        cr_assert(strstr(tmd_bpe_describe(t), "with NFC"), "%s", tmd_bpe_describe(t));
        snprintf(path, sizeof path, "%s/corpus_%s.txt", dir, name);
        long len, dl;
        unsigned char *text = tt_slurp(path, &len);
        snprintf(path, sizeof path, "%s/dec_%s_%s.txt", dir, kind, name);
        unsigned char *dec = tt_slurp(path, &dl);
        snprintf(path, sizeof path, "%s/ids_%s_%s.u32", dir, kind, name);
        int64_t nw, ng = 0, cap = 0;
        uint32_t *want = read_u32(path, &nw), *got = NULL;
        cr_assert_eq(tmd_bpe_encode(t, (const char *)text, (size_t)len, &got, &ng, &cap, err, sizeof err), 0, "%s", err);
        int bad = 0;
        if (!(ng == nw && !memcmp(got, want, sizeof *got * (size_t)ng))) {
            size_t w = strlen(msg);
            snprintf(msg + w, sizeof msg - w, "%s on %s: ", kind, name);
            w = strlen(msg);
            show_diff(t, got, ng, want, nw, msg + w, sizeof msg - w);
            bad = 1;
        }
        size_t nb = 0, cap_b = (size_t)len * 2 + 64;
        unsigned char *back = malloc(cap_b);
        int ok = 1;
        for (int64_t i = 0; i < ng && ok; i++) {
            const unsigned char *b;
            int bl = tmd_bpe_token_bytes(t, got[i], &b);
            ok = bl >= 0 && nb + (size_t)bl <= cap_b;
            if (ok) memcpy(back + nb, b, (size_t)bl), nb += (size_t)bl;
        }
        if (!(ok && nb == (size_t)dl && !memcmp(back, dec, nb))) {
            size_t w = strlen(msg);
            snprintf(msg + w, sizeof msg - w, "%s on %s: decoding is not tokenizers' (%zu bytes, want %ld)\n", kind,
                     name, nb, dl);
            bad = 1;
        }
        failed += bad;
        free(back), free(dec), free(text), free(want), free(got);
        tmd_bpe_free(t);
        cases++;
    }
    fclose(man);
    cr_assert_eq(cases, 12, "%d cases in the manifest", cases);
    cr_assert_eq(failed, 0, "%d of %d cases differ:\n%s", failed, cases, msg);
}

/* tmd_nfc by hand: precomposition, canonical order, Hangul, bytes that are not UTF-8 kept where
 * they are with the text around them normalized, and a text past the 64 KiB chunk whose result
 * is known from its one repeated unit. */
Test(bpe, nfc_by_hand_invalid_bytes_and_chunks) {
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"cafe\xcc\x81", "caf\xc3\xa9"},                         /* e + U+0301 -> U+00E9 */
        {"a\xcc\x96\xcc\x81", "\xc3\xa1\xcc\x96"},               /* a U+0316 U+0301 -> U+00E1 U+0316 */
        {"\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8", "\xea\xb0\x81"}, /* jamo G A G -> U+AC01 */
        {"\xe2\x84\xab", "\xc3\x85"},                             /* U+212B ANGSTROM SIGN -> U+00C5 */
        {"e\xcc\x81\xff" "e\xcc\x81", "\xc3\xa9\xff\xc3\xa9"},   /* 0xFF stays, both sides composed */
        {"\xcc\x81\x80x\xed\xa0\x80" "a\xcc\x8a", "\xcc\x81\x80x\xed\xa0\x80\xc3\xa5"}, /* a lone mark, a
                                                                 continuation byte, a surrogate */
        {"plain ascii \xc3\xa9t\xc3\xa9", NULL},                 /* below U+0300: given back as is */
    };
    unsigned char *buf = NULL;
    size_t cap = 0;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const unsigned char *in = (const unsigned char *)cases[i].in, *out;
        size_t n;
        cr_assert_eq(tmd_nfc(in, strlen(cases[i].in), &buf, &cap, &out, &n), 0);
        const char *want = cases[i].want ? cases[i].want : cases[i].in;
        cr_assert(n == strlen(want) && !memcmp(out, want, n), "case %zu: %zu bytes '%.*s'", i, n, (int)n, out);
        if (!cases[i].want) cr_assert_eq(out, in, "case %zu: copied", i);
    }
    /* 100000 units of "e U+0301 U+0327 " (ASCII between, so chunks end inside) and, with no ASCII,
     * of "U+1100 U+1161 U+3000": each unit normalizes alone */
    for (int k = 0; k < 2; k++) {
        const char *unit = k ? "\xe1\x84\x80\xe1\x85\xa1\xe3\x80\x80" : "e\xcc\x81\xcc\xa7 ";
        const char *nfc = k ? "\xea\xb0\x80\xe3\x80\x80" : "\xc8\xa9\xcc\x81 "; /* U+AC00; U+0229 U+0301 */
        size_t ul = strlen(unit), nl = strlen(nfc), N = 100000;
        unsigned char *big = malloc(ul * N);
        for (size_t i = 0; i < N; i++) memcpy(big + i * ul, unit, ul);
        const unsigned char *out;
        size_t n;
        cr_assert_eq(tmd_nfc(big, ul * N, &buf, &cap, &out, &n), 0);
        cr_assert_eq(n, nl * N, "unit %d: %zu bytes", k, n);
        for (size_t i = 0; i < N; i++) cr_assert(!memcmp(out + i * nl, nfc, nl), "unit %d, copy %zu", k, i);
        free(big);
    }
    free(buf);
    cr_log_info("%s", tmd_nfc_version());
}

/* Normalizers other than NFC are refused naming their type and where it is; a Sequence is taken
 * only when each of its members is NFC. */
/* What added tokens decode to, by hand (no Python): a normalized one from its NFC content through
 * ByteLevel's rule, as tokenizers >= 0.23.1 (bpe.c, read_added), one not normalized as written,
 * and without a normalizer each as written. The bytes are what tokenizers 0.23.2 decodes (seen
 * by hand: "e\u0301" gives U+FFFD, the lossy reading of byte 0xE9, "x\u0301 y" itself); 0.22.1
 * gave "e\u0301" back. Either spelling of the text is the normalized token's id. */
Test(bpe, normalized_added_tokens_decode_as_their_nfc) {
    static const struct {
        const char *content;
        int normalized;
        const char *nfc_dec, *plain_dec; /* with the NFC normalizer, with none */
    } toks[] = {
        {"e\xcc\x81", 1, "\xe9", "e\xcc\x81"},              /* NFC U+00E9: a byte character */
        {"x\xcc\x81 y", 1, "x\xcc\x81 y", "x\xcc\x81 y"},   /* NFC changes nothing; not all bytes */
        {"<sp\xcc\x81>", 0, "<sp\xcc\x81>", "<sp\xcc\x81>"}, /* not normalized: as written */
        {"caf\xc3\xa9", 1, "caf\xe9", "caf\xe9"},           /* already NFC, all byte characters */
    };
    enum { N = sizeof toks / sizeof *toks, FIRST = 300 };
    for (int nfc = 0; nfc < 2; nfc++) {
        cJSON *j = small_tokenizer(258), *at = cJSON_GetObjectItem(j, "added_tokens");
        for (int i = 0; i < N; i++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "id", FIRST + i);
            cJSON_AddStringToObject(e, "content", toks[i].content);
            cJSON_AddBoolToObject(e, "normalized", toks[i].normalized);
            cJSON_AddBoolToObject(e, "special", !toks[i].normalized);
            cJSON_AddItemToArray(at, e);
        }
        if (nfc) cJSON_ReplaceItemInObject(j, "normalizer", cJSON_Parse("{\"type\": \"NFC\"}"));
        const char *p = write_json(j, "added.json");
        cJSON_Delete(j);
        tmd_bpe *t = NULL;
        char err[2048] = "";
        cr_assert_eq(tmd_bpe_load(p, &t, err, sizeof err), 0, "%s", err);
        for (int i = 0; i < N; i++) {
            const unsigned char *b;
            const char *want = nfc ? toks[i].nfc_dec : toks[i].plain_dec;
            int bl = tmd_bpe_token_bytes(t, FIRST + i, &b);
            cr_assert(bl == (int)strlen(want) && !memcmp(b, want, (size_t)bl), "NFC %d, token %d: %d bytes, want %zu",
                      nfc, i, bl, strlen(want));
        }
        if (nfc) { /* "e\u0301" and the precomposed "\u00e9" are both the token */
            const char *texts[] = {"e\xcc\x81", "\xc3\xa9"};
            for (int k = 0; k < 2; k++) {
                uint32_t *ids = NULL;
                int64_t n = 0, cap = 0;
                cr_assert_eq(tmd_bpe_encode(t, texts[k], strlen(texts[k]), &ids, &n, &cap, err, sizeof err), 0, "%s", err);
                cr_assert(n == 1 && ids[0] == FIRST, "text %d: %lld ids, first %u", k, (long long)n, n ? ids[0] : 0);
                free(ids);
            }
        }
        tmd_bpe_free(t);
    }
}

Test(bpe, normalizers_other_than_nfc_are_refused) {
    static const struct {
        const char *json, *field, *type; /* type NULL: taken */
    } cases[] = {
        {"{\"type\": \"NFC\"}", NULL, NULL},
        {"{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFC\"}]}", NULL, NULL},
        {"{\"type\": \"Sequence\", \"normalizers\": []}", NULL, NULL},
        {"{\"type\": \"NFKC\"}", "normalizer.type", "NFKC"},
        {"{\"type\": \"NFD\"}", "normalizer.type", "NFD"},
        {"{\"type\": \"Lowercase\"}", "normalizer.type", "Lowercase"},
        {"{\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"_\"}", "normalizer.type", "Replace"},
        {"{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFC\"}, {\"type\": \"Lowercase\"}]}",
         "normalizer.normalizers[1].type", "Lowercase"},
        {"{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFKD\"}]}]}",
         "normalizer.normalizers[0].normalizers[0].type", "NFKD"},
        {"{\"type\": \"Sequence\"}", "normalizer.normalizers", "missing"},
        {"\"NFC\"", "normalizer.type", "\"NFC\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        cJSON *j = small_tokenizer(258), *nz = cJSON_Parse(cases[i].json);
        cr_assert(nz, "case %zu", i);
        cJSON_ReplaceItemInObject(j, "normalizer", nz);
        const char *p = write_json(j, "nz.json");
        cJSON_Delete(j);
        tmd_bpe *t = NULL;
        char err[2048] = "";
        int rc = tmd_bpe_load(p, &t, err, sizeof err);
        if (!cases[i].type) {
            cr_assert_eq(rc, 0, "%s: %s", cases[i].json, err);
            /* "hello" has nothing NFC changes: the ids of small_tokenizer_encodes_by_hand */
            uint32_t *ids = NULL;
            int64_t n = 0, ncap = 0;
            cr_assert_eq(tmd_bpe_encode(t, "hello", 5, &ids, &n, &ncap, err, sizeof err), 0);
            cr_assert(n == 3 && ids[0] == 257 && ids[1] == 256 && ids[2] == 'o');
            free(ids);
            tmd_bpe_free(t);
            continue;
        }
        cr_assert_eq(rc, TMD_CONFIG_ERROR, "%s: rc %d (%s)", cases[i].json, rc, err);
        cr_assert_null(t);
        char field[128];
        snprintf(field, sizeof field, "field '%s': %s", cases[i].field, cases[i].type);
        cr_assert(strstr(err, p) && strstr(err, field), "%s: want the file and \"%s\" in: %s", cases[i].json, field, err);
        if (strcmp(cases[i].type, "missing")) cr_assert(strstr(err, "only NFC"), "%s", err);
    }
}
