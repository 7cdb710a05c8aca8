/* test_data.c — llm.c token files (round trips, shards, every header error), the validation
 * split, the vocabulary check, atomic writes, the byte-level tokenizer and the batcher.
 *
 * Every test works in its own mkdtemp directory under /tmp, removed by the fixture. Error
 * tests assert the -1 return AND that the message names the file and the offending value. */
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "data.h"
#include "status.h"

static char g_dir[128];
static void setup(void) { snprintf(g_dir, sizeof g_dir, "%s", tt_tmpdir_make("tm_test_data_")); }
static void teardown(void) { tt_tmpdir_remove(); }
TestSuite(data, .init = setup, .fini = teardown);


static void put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* A file with an llm.c header (magic, version, count) followed by `len` raw bytes. */
static void write_raw(const char *path, int32_t magic, int32_t version, int32_t count, const void *body, size_t len) {
    unsigned char h[TMD_DATA_HEADER_INTS * 4] = {0};
    put32(h, (uint32_t)magic);
    put32(h + 4, (uint32_t)version);
    put32(h + 8, (uint32_t)count);
    FILE *f = fopen(path, "wb");
    cr_assert(f, "fopen %s: %s", path, strerror(errno));
    cr_assert_eq(fwrite(h, 1, sizeof h, f), sizeof h);
    if (len) cr_assert_eq(fwrite(body, 1, len, f), len);
    cr_assert_eq(fclose(f), 0);
}


static int32_t get32(const unsigned char *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

static int exists(const char *path) { return access(path, F_OK) == 0; }


#define ASSERT_ERR(call, ...)                                                                     \
    do {                                                                                          \
        err[0] = '\0';                                                                            \
        cr_assert_eq((call), -1, "%s should fail", #call);                                        \
        const char *want_[] = {__VA_ARGS__};                                                      \
        for (size_t k_ = 0; k_ < sizeof want_ / sizeof *want_; k_++)                              \
            cr_assert(strstr(err, want_[k_]), "error '%s' should contain '%s'", err, want_[k_]); \
    } while (0)

/* ------------------------------------------------------------------------------------------
 * Round trips and shards
 * ------------------------------------------------------------------------------------------ */

static void round_trip(const uint32_t *tok, int64_t n, int want_version) {
    char err[512];
    const char *path = tt_path("rt.bin");
    cr_assert_eq(tmd_tokens_write(path, tok, n, err, sizeof err), 0, "%s", err);

    /* The bytes, independently of the loader: header as llm.c writes it, then the tokens
     * little-endian at the width the version implies. */
    long len;
    unsigned char *b = tt_slurp(path, &len);
    int width = want_version == 1 ? 2 : 4;
    cr_assert_eq(len, 1024 + width * n);
    cr_assert_eq(get32(b), want_version == 1 ? TMD_DATA_MAGIC_V1 : TMD_DATA_MAGIC_V7);
    cr_assert_eq(get32(b + 4), want_version);
    cr_assert_eq(get32(b + 8), n);
    for (int i = 3; i < 256; i++) cr_assert_eq(get32(b + 4 * i), 0);
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = width == 2 ? (uint32_t)b[1024 + 2 * i] | (uint32_t)b[1024 + 2 * i + 1] << 8
                                : (uint32_t)get32(b + 1024 + 4 * i);
        cr_assert_eq(v, tok[i], "byte image of token %lld", (long long)i);
    }
    free(b);

    tmd_tokens t;
    cr_assert_eq(tmd_tokens_load(path, &t, err, sizeof err), 0, "%s", err);
    cr_assert_eq(t.n, n);
    uint32_t mx = 0;
    for (int64_t i = 0; i < n; i++) {
        cr_assert_eq(t.tok[i], tok[i], "token %lld", (long long)i);
        mx = tok[i] > mx ? tok[i] : mx;
    }
    cr_assert_eq(t.max_token, mx);
    cr_assert_str_eq(t.source, path);
    tmd_tokens_free(&t);
    cr_assert_null(t.tok);
    cr_assert_eq(tt_dir_entries(g_dir), 1, "no temporary file left behind");
}

Test(data, round_trip_v1) {
    const uint32_t tok[] = {0, 1, 255, 256, 257, 4660, 65535, 7, 65534};
    round_trip(tok, 9, 1);
}

Test(data, round_trip_v7) {
    const uint32_t tok[] = {0, 65535, 65536, 100000, 3, 0xFFFFFFFFu, 50257};
    round_trip(tok, 7, 7);
}

Test(data, write_replaces_existing_file) {
    char err[512];
    const uint32_t a[] = {1, 2, 3, 4, 5, 6}, b[] = {9, 8};
    const char *path = tt_path("x.bin");
    cr_assert_eq(tmd_tokens_write(path, a, 6, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_tokens_write(path, b, 2, err, sizeof err), 0, "%s", err);
    tmd_tokens t;
    cr_assert_eq(tmd_tokens_load(path, &t, err, sizeof err), 0, "%s", err);
    cr_assert_eq(t.n, 2);
    cr_assert_eq(t.tok[0], 9);
    cr_assert_eq(t.tok[1], 8);
    tmd_tokens_free(&t);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0644, "mode %o", st.st_mode & 0777);
}

/* Three shards written out of order, mixing versions: loaded concatenated in name order. */
Test(data, glob_concatenates_shards_in_sorted_order) {
    char err[512];
    const uint32_t s0[] = {10, 11, 12}, s1[] = {20, 70000}, s2[] = {30, 31, 32, 33};
    cr_assert_eq(tmd_tokens_write(tt_path("shard_002.bin"), s2, 4, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_tokens_write(tt_path("shard_000.bin"), s0, 3, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_tokens_write(tt_path("shard_001.bin"), s1, 2, err, sizeof err), 0, "%s", err); /* v7 */
    cr_assert_eq(tmd_tokens_write(tt_path("other.bin"), s0, 3, err, sizeof err), 0, "%s", err);
    const char *pattern = tt_path("shard_*.bin");
    tmd_tokens t;
    cr_assert_eq(tmd_tokens_load(pattern, &t, err, sizeof err), 0, "%s", err);
    const uint32_t want[] = {10, 11, 12, 20, 70000, 30, 31, 32, 33};
    cr_assert_eq(t.n, 9);
    for (int i = 0; i < 9; i++) cr_assert_eq(t.tok[i], want[i], "token %d", i);
    cr_assert_eq(t.max_token, 70000);
    cr_assert_str_eq(t.source, pattern);
    tmd_tokens_free(&t);
}

/* More shards than file descriptors (issue 24, defect 1): every shard used to stay open from
 * the header check to the read, so 1,100 token files failed under `ulimit -n 1024` with "Too
 * many open files". Here 300 shards under a limit of 64 descriptors. */
Test(data, more_shards_than_file_descriptors) {
    char err[512], name[64];
    enum { NS = 300 };
    for (int k = 0; k < NS; k++) {
        uint32_t tok[3] = {(uint32_t)k, (uint32_t)(k + 1), (uint32_t)(k + 2)};
        snprintf(name, sizeof name, "s_%04d.bin", k);
        cr_assert_eq(tmd_tokens_write(tt_path(name), tok, 3, err, sizeof err), 0, "%s", err);
    }
    struct rlimit rl;
    cr_assert_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    struct rlimit low = {64, rl.rlim_max};
    cr_assert_eq(setrlimit(RLIMIT_NOFILE, &low), 0, "setrlimit: %s", strerror(errno));
    tmd_tokens t;
    int rc = tmd_tokens_load(tt_path("s_*.bin"), &t, err, sizeof err);
    setrlimit(RLIMIT_NOFILE, &rl);
    cr_assert_eq(rc, 0, "%s", err);
    cr_assert_eq(t.n, 3 * NS);
    for (int k = 0; k < NS; k++) cr_assert_eq(t.tok[3 * k + 1], (uint32_t)(k + 1), "shard %d", k);
    cr_assert_eq(t.n_shards, NS);
    tmd_tokens_free(&t);
}

/* A token out of range in one shard of a glob names that shard and the position inside it
 * (issue 24, defect 2: the message named only the glob); so does the held-out tail of a split. */
Test(data, bad_token_names_its_shard) {
    char err[512];
    const uint32_t a[] = {1, 2, 3, 4}, b[] = {5, 6, 900, 7, 8};
    cr_assert_eq(tmd_tokens_write(tt_path("p_0.bin"), a, 4, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_tokens_write(tt_path("p_1.bin"), b, 5, err, sizeof err), 0, "%s", err);
    tmd_tokens t, v;
    cr_assert_eq(tmd_tokens_load(tt_path("p_*.bin"), &t, err, sizeof err), 0, "%s", err);
    cr_assert_neq(tmd_tokens_check_vocab(&t, 256, err, sizeof err), 0);
    char want[256];
    snprintf(want, sizeof want, "token 900 at position 2 of '%s' (file 2 of 2", tt_path("p_1.bin"));
    cr_assert(strstr(err, want) && strstr(err, "position 6 of the stream"), "%s", err);
    /* the last 3 tokens (900, 7, 8) are the validation tail: 900 is its token 0, file position 2 */
    cr_assert_eq(tmd_tokens_split(&t, 3.0 / 9.0, &v, err, sizeof err), 0, "%s", err);
    cr_assert_eq(v.tok[0], 900);
    cr_assert_neq(tmd_tokens_check_vocab(&v, 256, err, sizeof err), 0);
    snprintf(want, sizeof want, "token 900 at position 2 of '%s' (file 1 of 1", tt_path("p_1.bin"));
    cr_assert(strstr(err, want) && strstr(err, "position 0 of the stream"), "%s", err);
    cr_assert_eq(tmd_tokens_check_vocab(&t, 256, err, sizeof err), 0, "the training part is clean: %s", err);
    tmd_tokens_free(&t);
    tmd_tokens_free(&v);
}

/* ------------------------------------------------------------------------------------------
 * Load errors
 * ------------------------------------------------------------------------------------------ */

Test(data, load_truncated_file) {
    char err[512];
    const char *path = tt_path("trunc.bin");
    const uint16_t body[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    write_raw(path, TMD_DATA_MAGIC_V1, 1, 10, body, sizeof body);
    tmd_tokens t;
    ASSERT_ERR(tmd_tokens_load(path, &t, err, sizeof err), path, "truncated", "10 tokens", "16 bytes");
    cr_assert_null(t.tok);
    cr_assert_eq(t.n, 0);
}

Test(data, load_file_shorter_than_header) {
    char err[512];
    const char *path = tt_path("tiny.bin");
    FILE *f = fopen(path, "wb");
    fputs("hello", f);
    fclose(f);
    tmd_tokens t;
    ASSERT_ERR(tmd_tokens_load(path, &t, err, sizeof err), path, "5 bytes", "1024-byte header");
}

Test(data, load_extra_bytes) {
    char err[512];
    const char *path = tt_path("extra.bin");
    const uint32_t body[4] = {1, 2, 3, 4};
    write_raw(path, TMD_DATA_MAGIC_V7, 7, 3, body, sizeof body);
    tmd_tokens t;
    ASSERT_ERR(tmd_tokens_load(path, &t, err, sizeof err), path, "4 bytes after the 3 tokens");
}

Test(data, load_wrong_magic) {
    char err[512];
    const char *path = tt_path("magic.bin");
    const uint16_t body[2] = {1, 2};
    write_raw(path, 20240519, 1, 2, body, sizeof body);
    tmd_tokens t;
    ASSERT_ERR(tmd_tokens_load(path, &t, err, sizeof err), path, "magic 20240519", "20240520", "20240801");
}

Test(data, load_version_not_matching_magic) {
    char err[512];
    const char *path = tt_path("version.bin");
    const uint16_t body[2] = {1, 2};
    write_raw(path, TMD_DATA_MAGIC_V1, 7, 2, body, sizeof body);
    tmd_tokens t;
    ASSERT_ERR(tmd_tokens_load(path, &t, err, sizeof err), path, "version 7", "20240520", "version 1");
    const uint32_t body7[2] = {1, 2};
    write_raw(path, TMD_DATA_MAGIC_V7, 1, 2, body7, sizeof body7);
    ASSERT_ERR(tmd_tokens_load(path, &t, err, sizeof err), path, "version 1", "20240801", "version 7");
}

Test(data, load_negative_count) {
    char err[512];
    const char *path = tt_path("neg.bin");
    write_raw(path, TMD_DATA_MAGIC_V1, 1, -3, NULL, 0);
    tmd_tokens t;
    ASSERT_ERR(tmd_tokens_load(path, &t, err, sizeof err), path, "-3");
}

Test(data, load_missing_file) {
    char err[512];
    const char *path = tt_path("nope.bin");
    tmd_tokens t;
    ASSERT_ERR(tmd_tokens_load(path, &t, err, sizeof err), path, strerror(ENOENT));
}

Test(data, load_empty_glob) {
    char err[512];
    const char *pattern = tt_path("nope_*.bin");
    tmd_tokens t;
    ASSERT_ERR(tmd_tokens_load(pattern, &t, err, sizeof err), "no file matches", pattern);
}

Test(data, load_no_tokens) {
    char err[512];
    const char *path = tt_path("empty.bin");
    write_raw(path, TMD_DATA_MAGIC_V1, 1, 0, NULL, 0);
    tmd_tokens t;
    ASSERT_ERR(tmd_tokens_load(path, &t, err, sizeof err), path, "no tokens");
}

/* One bad shard fails the whole source, and the message names that shard, not the pattern. */
Test(data, load_glob_names_the_bad_shard) {
    char err[512];
    const uint32_t tok[] = {1, 2, 3};
    cr_assert_eq(tmd_tokens_write(tt_path("s_a.bin"), tok, 3, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_tokens_write(tt_path("s_c.bin"), tok, 3, err, sizeof err), 0, "%s", err);
    const char *bad = tt_path("s_b.bin");
    write_raw(bad, TMD_DATA_MAGIC_V1, 1, 5, tok, 4);
    tmd_tokens t;
    ASSERT_ERR(tmd_tokens_load(tt_path("s_*.bin"), &t, err, sizeof err), bad, "truncated");
    cr_assert_null(t.tok);
}

/* ------------------------------------------------------------------------------------------
 * Split and vocabulary
 * ------------------------------------------------------------------------------------------ */

static tmd_tokens make_tokens(int64_t n, const char *source) {
    tmd_tokens t = {0};
    t.tok = malloc((size_t)n * sizeof *t.tok);
    for (int64_t i = 0; i < n; i++) t.tok[i] = (uint32_t)i;
    t.n = n;
    t.max_token = (uint32_t)(n - 1);
    snprintf(t.source, sizeof t.source, "%s", source);
    return t;
}

Test(data, split_last_fraction) {
    char err[512];
    tmd_tokens tr = make_tokens(10, "ten.bin"), va;
    cr_assert_eq(tmd_tokens_split(&tr, 0.3, &va, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tr.n, 7);
    cr_assert_eq(va.n, 3);
    for (int i = 0; i < 7; i++) cr_assert_eq(tr.tok[i], (uint32_t)i);
    for (int i = 0; i < 3; i++) cr_assert_eq(va.tok[i], (uint32_t)(7 + i));
    cr_assert_eq(tr.max_token, 6);
    cr_assert_eq(va.max_token, 9);
    cr_assert(strstr(va.source, "ten.bin"), "%s", va.source);
    tmd_tokens_free(&tr);
    tmd_tokens_free(&va);
}

Test(data, split_errors) {
    char err[512];
    tmd_tokens tr = make_tokens(10, "ten.bin"), va;
    const double bad[] = {0.0, 1.0, -0.5, 1.5, NAN};
    for (int i = 0; i < 5; i++) {
        ASSERT_ERR(tmd_tokens_split(&tr, bad[i], &va, err, sizeof err), "ten.bin", "(0, 1)");
        cr_assert_null(va.tok);
    }
    /* 10 * 0.1 = 1 validation token; 10 * 0.9 = 9 leaves 1 training token. */
    ASSERT_ERR(tmd_tokens_split(&tr, 0.1, &va, err, sizeof err), "ten.bin", "9 training and 1 validation");
    ASSERT_ERR(tmd_tokens_split(&tr, 0.9, &va, err, sizeof err), "ten.bin", "1 training and 9 validation");
    cr_assert_eq(tr.n, 10, "train unchanged after a failed split");
    tmd_tokens_free(&tr);
}

Test(data, check_vocab) {
    char err[512];
    tmd_tokens t = make_tokens(8, "v.bin");
    t.tok[5] = 300;
    t.tok[6] = 400;
    t.max_token = 400;
    ASSERT_ERR(tmd_tokens_check_vocab(&t, 257, err, sizeof err), "token 300", "position 5", "v.bin", "257");
    cr_assert_eq(tmd_tokens_check_vocab(&t, 401, err, sizeof err), 0);
    ASSERT_ERR(tmd_tokens_check_vocab(&t, 0, err, sizeof err), "vocab size 0");
    tmd_tokens_free(&t);
}

/* ------------------------------------------------------------------------------------------
 * Atomic writes
 * ------------------------------------------------------------------------------------------ */

Test(data, write_into_missing_directory) {
    char err[512];
    const uint32_t tok[] = {1, 2, 3};
    const char *path = tt_path("no_such_dir/out.bin");
    ASSERT_ERR(tmd_tokens_write(path, tok, 3, err, sizeof err), path, strerror(ENOENT));
    cr_assert_eq(tt_dir_entries(g_dir), 0);
}

/* A write that fails half-way (the file size limit stops it after 4 KiB): -1, the old file is
 * byte-for-byte intact, and no temporary file is left. Works as root, unlike a read-only
 * directory. Criterion runs each test in its own process, so the limit does not leak. */
Test(data, failed_write_keeps_old_file) {
    char err[512];
    const char *path = tt_path("keep.bin");
    const uint32_t old[] = {5, 6, 7};
    cr_assert_eq(tmd_tokens_write(path, old, 3, err, sizeof err), 0, "%s", err);
    long len0;
    unsigned char *before = tt_slurp(path, &len0);

    int64_t n = 100000;
    uint32_t *big = malloc((size_t)n * sizeof *big);
    for (int64_t i = 0; i < n; i++) big[i] = (uint32_t)(i % 257);
    struct rlimit saved, lim;
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &saved), 0);
    lim = saved;
    lim.rlim_cur = 4096;
    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    int rc = tmd_tokens_write(path, big, n, err, sizeof err);
    setrlimit(RLIMIT_FSIZE, &saved);
    free(big);
    cr_assert_eq(rc, -1);
    cr_assert(strstr(err, path), "%s", err);
    cr_assert(strstr(err, strerror(EFBIG)), "%s", err);

    long len1;
    unsigned char *after = tt_slurp(path, &len1);
    cr_assert_eq(len1, len0);
    cr_assert_eq(memcmp(before, after, (size_t)len0), 0);
    free(before);
    free(after);
    cr_assert_eq(tt_dir_entries(g_dir), 1, "temporary file removed");
}

/* The target is a directory: refused before anything is staged (the rename would fail, or
 * replace an empty one), and nothing is left behind. */
Test(data, failed_rename_removes_temp) {
    char err[512];
    const char *path = tt_path("adir");
    cr_assert_eq(mkdir(path, 0755), 0);
    const char *inner = tt_path("adir/x");
    FILE *f = fopen(inner, "w");
    fclose(f);
    const uint32_t tok[] = {1, 2, 3};
    ASSERT_ERR(tmd_tokens_write(path, tok, 3, err, sizeof err), path, "a directory");
    cr_assert_eq(tt_dir_entries(g_dir), 1);
    cr_assert(exists(inner));
}

/* ------------------------------------------------------------------------------------------
 * Tokenizer
 * ------------------------------------------------------------------------------------------ */

static void write_text(const char *path, const char *s) {
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    fputs(s, f);
    fclose(f);
}

static void assert_tokens(const char *path, const uint32_t *want, int64_t n) {
    char err[512];
    tmd_tokens t;
    cr_assert_eq(tmd_tokens_load(path, &t, err, sizeof err), 0, "%s", err);
    cr_assert_eq(t.n, n, "%s: %lld tokens, want %lld", path, (long long)t.n, (long long)n);
    for (int64_t i = 0; i < n; i++) cr_assert_eq(t.tok[i], want[i], "%s token %lld", path, (long long)i);
    tmd_tokens_free(&t);
}

Test(data, tokenize_with_val_split) {
    char err[512], valp[256];
    const char *in = tt_path("in.txt"), *out = tt_path("tok.bin");
    write_text(in, "hello\nworld"); /* 11 bytes + EOT = 12 tokens; 0.25 -> 3 validation */
    cr_assert_eq(tmd_tokenize_file(in, out, 0.25, valp, sizeof valp, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(valp, tt_path("tok_val.bin"));
    const uint32_t train[] = {'h', 'e', 'l', 'l', 'o', '\n', 'w', 'o', 'r'};
    const uint32_t val[] = {'l', 'd', TMD_BYTE_EOT};
    assert_tokens(out, train, 9);
    assert_tokens(valp, val, 3);
    long len;
    unsigned char *b = tt_slurp(out, &len);
    cr_assert_eq(get32(b), TMD_DATA_MAGIC_V1, "byte tokens fit uint16: version 1");
    cr_assert_eq(len, 1024 + 2 * 9);
    free(b);
    cr_assert_eq(tt_dir_entries(g_dir), 3);
}

Test(data, tokenize_without_split) {
    char err[512], valp[256] = "junk";
    const char *in = tt_path("in.txt"), *out = tt_path("all.bin");
    write_text(in, "a\xff\x00"); /* fputs stops at NUL: 2 bytes, one of them 255 */
    cr_assert_eq(tmd_tokenize_file(in, out, 0.0, valp, sizeof valp, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(valp, "");
    const uint32_t want[] = {'a', 255, TMD_BYTE_EOT};
    assert_tokens(out, want, 3);
    cr_assert_eq(tt_dir_entries(g_dir), 2);
}

/* The "_val" goes before the extension of the file name, never into a dotted directory. */
Test(data, tokenize_val_names) {
    char err[512], valp[256];
    const char *in = tt_path("in.txt");
    write_text(in, "abcdefghijklmnopqrst");
    cr_assert_eq(mkdir(tt_path("d.x"), 0755), 0);
    cr_assert_eq(tmd_tokenize_file(in, tt_path("d.x/data"), 0.5, valp, sizeof valp, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(valp, tt_path("d.x/data_val"));
    cr_assert_eq(tmd_tokenize_file(in, tt_path("d.x/.hidden"), 0.5, valp, sizeof valp, err, sizeof err), 0, "%s", err);
    cr_assert_str_eq(valp, tt_path("d.x/.hidden_val"));
    cr_assert_eq(tmd_tokenize_file(in, tt_path("d.x/a.b.bin"), 0.5, NULL, 0, err, sizeof err), 0, "%s", err);
    cr_assert(exists(tt_path("d.x/a.b_val.bin")));
}

/* tmd_tokenize_file returns the exit statuses: 2 for bad input, 1 for I/O. */
#define ASSERT_CODE(code, call, ...)                                                              \
    do {                                                                                          \
        err[0] = '\0';                                                                            \
        int rc_ = (call);                                                                         \
        cr_assert_eq(rc_, (code), "%s should fail with %d, got %d: %s", #call, (code), rc_, err); \
        const char *want_[] = {__VA_ARGS__};                                                      \
        for (size_t k_ = 0; k_ < sizeof want_ / sizeof *want_; k_++)                              \
            cr_assert(strstr(err, want_[k_]), "error '%s' should contain '%s'", err, want_[k_]); \
    } while (0)

Test(data, tokenize_errors) {
    char err[512], valp[256];
    const char *missing = tt_path("missing.txt"), *out = tt_path("o.bin");
    ASSERT_CODE(TMD_CONFIG_ERROR, tmd_tokenize_file(missing, out, 0.1, valp, sizeof valp, err, sizeof err), missing,
               strerror(ENOENT));
    const char *empty = tt_path("empty.txt");
    write_text(empty, "");
    ASSERT_CODE(TMD_CONFIG_ERROR, tmd_tokenize_file(empty, out, 0.1, valp, sizeof valp, err, sizeof err), empty, "empty");
    const char *small = tt_path("small.txt");
    write_text(small, "abcd"); /* 5 tokens: 0.1 -> 1 validation token */
    ASSERT_CODE(TMD_CONFIG_ERROR, tmd_tokenize_file(small, out, 0.1, valp, sizeof valp, err, sizeof err), small,
               "4 training and 1 validation");
    ASSERT_CODE(TMD_CONFIG_ERROR, tmd_tokenize_file(small, out, 1.0, valp, sizeof valp, err, sizeof err), "fraction 1");
    ASSERT_CODE(TMD_CONFIG_ERROR, tmd_tokenize_file(small, out, -0.1, valp, sizeof valp, err, sizeof err), "fraction -0.1");
    ASSERT_CODE(TMD_CONFIG_ERROR, tmd_tokenize_file(small, small, 0.0, valp, sizeof valp, err, sizeof err), small, "input");
    const char *nodir = tt_path("nodir/o.bin");
    ASSERT_CODE(TMD_RUNTIME_ERROR, tmd_tokenize_file(small, nodir, 0.5, valp, sizeof valp, err, sizeof err), "nodir/o");
    /* Nothing written by any failure: only the two inputs that exist remain. */
    cr_assert_eq(tt_dir_entries(g_dir), 2);
}

/* ------------------------------------------------------------------------------------------
 * Batching
 * ------------------------------------------------------------------------------------------ */

enum { BB = 3, BT = 5 };

Test(data, batcher_errors) {
    char err[512];
    tmd_tokens t = make_tokens(10, "small.bin");
    tmd_batcher bt;
    ASSERT_ERR(tmd_batcher_init(&bt, &t, BB, 10, 1, err, sizeof err), "T+1 = 11", "10 tokens", "small.bin");
    ASSERT_ERR(tmd_batcher_init(&bt, &t, 0, 4, 1, err, sizeof err), "B = 0");
    ASSERT_ERR(tmd_batcher_init(&bt, &t, 2, -1, 1, err, sizeof err), "T = -1");
    cr_assert_eq(tmd_batcher_init(&bt, &t, BB, 9, 1, err, sizeof err), 0, "T+1 = n fits: %s", err);
    tmd_tokens_free(&t);
}

/* Data tok[i] = i, so a row's first input is its offset. */
Test(data, batcher_windows_in_range_and_shifted) {
    char err[512];
    const int64_t n = 9; /* offsets 0 .. n - T - 1 = 3 */
    tmd_tokens t = make_tokens(n, "r.bin");
    tmd_batcher bt;
    cr_assert_eq(tmd_batcher_init(&bt, &t, BB, BT, 42, err, sizeof err), 0, "%s", err);
    int32_t in[BB * BT], tg[BB * BT];
    int seen[4] = {0};
    for (int s = 0; s < 200; s++) {
        tmd_batcher_next(&bt, in, tg);
        cr_assert_eq(bt.position, s + 1);
        for (int b = 0; b < BB; b++) {
            int32_t off = in[b * BT];
            cr_assert(off >= 0 && off <= n - BT - 1, "offset %d", off);
            seen[off]++;
            for (int j = 0; j < BT; j++) {
                cr_assert_eq(in[b * BT + j], off + j);
                cr_assert_eq(tg[b * BT + j], off + j + 1);
            }
        }
    }
    for (int o = 0; o < 4; o++) cr_assert(seen[o] > 100, "offset %d drawn %d times of 600", o, seen[o]);
    tmd_tokens_free(&t);
}

/* The documented scheme, recomputed here: row b at position p starts at
 * (r0 << 32 | r1) mod (n - T), r = Philox(key = seed, counter = (p lo, p hi, b, "batc")). */
Test(data, batcher_matches_philox_scheme) {
    char err[512];
    const int64_t n = 100003;
    tmd_tokens t = make_tokens(n, "p.bin");
    tmd_batcher bt;
    const uint64_t seed = 0x123456789abcdefull;
    cr_assert_eq(tmd_batcher_init(&bt, &t, BB, BT, seed, err, sizeof err), 0, "%s", err);
    bt.position = (1ll << 32) + 7; /* exercises the high counter word */
    int64_t p0 = bt.position;
    int32_t in[BB * BT], tg[BB * BT];
    for (int s = 0; s < 3; s++) {
        tmd_batcher_next(&bt, in, tg);
        uint64_t p = (uint64_t)(p0 + s);
        for (int b = 0; b < BB; b++) {
            uint32_t ctr[4] = {(uint32_t)p, (uint32_t)(p >> 32), (uint32_t)b, 0x62617463u}, r[4];
            uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
            tm_philox4x32_10(ctr, key, r);
            int64_t off = (int64_t)((((uint64_t)r[0] << 32) | r[1]) % (uint64_t)(n - BT));
            cr_assert_eq(in[b * BT], off, "position %llu row %d", (unsigned long long)p, b);
        }
    }
    tmd_tokens_free(&t);
}

Test(data, batcher_deterministic_and_resumable) {
    char err[512];
    tmd_tokens t = make_tokens(5000, "d.bin");
    enum { S = 8, RESUME = 3 };
    static int32_t in[S][BB * BT], tg[S][BB * BT];
    tmd_batcher a, b, c, d;
    cr_assert_eq(tmd_batcher_init(&a, &t, BB, BT, 7, err, sizeof err), 0, "%s", err);
    for (int s = 0; s < S; s++) tmd_batcher_next(&a, in[s], tg[s]);

    /* Same seed: the same sequence. */
    cr_assert_eq(tmd_batcher_init(&b, &t, BB, BT, 7, err, sizeof err), 0, "%s", err);
    int32_t x[BB * BT], y[BB * BT];
    for (int s = 0; s < S; s++) {
        tmd_batcher_next(&b, x, y);
        cr_assert_eq(memcmp(x, in[s], sizeof x), 0, "batch %d", s);
        cr_assert_eq(memcmp(y, tg[s], sizeof y), 0, "batch %d", s);
    }
    /* Resume: a fresh batcher set to position RESUME continues the same sequence. */
    cr_assert_eq(tmd_batcher_init(&c, &t, BB, BT, 7, err, sizeof err), 0, "%s", err);
    c.position = RESUME;
    for (int s = RESUME; s < S; s++) {
        tmd_batcher_next(&c, x, y);
        cr_assert_eq(memcmp(x, in[s], sizeof x), 0, "resumed batch %d", s);
    }
    cr_assert_eq(c.position, S);
    /* Another seed: different batches (8 x 3 offsets out of 4995 all equal by chance: ~0). */
    cr_assert_eq(tmd_batcher_init(&d, &t, BB, BT, 8, err, sizeof err), 0, "%s", err);
    int same = 0;
    for (int s = 0; s < S; s++) {
        tmd_batcher_next(&d, x, y);
        same += memcmp(x, in[s], sizeof x) == 0;
    }
    cr_assert_lt(same, S);
    /* Rows within a batch differ too (row index is in the counter). */
    cr_assert_neq(in[0][0], in[0][BT]);
    tmd_tokens_free(&t);
}
