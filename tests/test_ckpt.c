/*
 * test_ckpt.c — checkpoint save/load (checkpoints/ckpt.c): bitwise round trip of every dtype,
 * a single-byte corruption sweep over a whole file, truncation, version/magic/name/shape/dtype
 * checks (each leaving the context untouched), and atomic replacement under a failing write.
 */
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "common.h"

static char g_dir[128];
static void setup(void) { snprintf(g_dir, sizeof g_dir, "%s", tt_tmpdir_make("tm_test_ckpt_")); }
static void teardown(void) { tt_tmpdir_remove(); }
TestSuite(ckpt, .init = setup, .fini = teardown);

static void spit(const char *path, const unsigned char *b, long len) {
    FILE *f = fopen(path, "wb");
    cr_assert(f, "fopen %s: %s", path, strerror(errno));
    if (len) cr_assert_eq(fwrite(b, 1, (size_t)len, f), (size_t)len);
    cr_assert_eq(fclose(f), 0);
}
static void put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* The reference set: parameters in f32, bf16, f64 (one 0-d, one with an empty dim) and
 * buffers in f32 and i64, with awkward sizes. `variant` changes one aspect:
 *   0 as described; 1 renames "b" to "b2"; 2 transposes "w"; 3 adds a parameter "extra";
 *   4 makes "w" f64. */
enum { N_BASE = 7 };
static const char *const base_names[N_BASE] = {"w", "b", "d", "s", "e", "m", "idx"};

static tm_ctx *make_ctx(int variant, uint64_t seed) {
    tm_ctx *ctx = tt_ctx();
    tm_tensor *t;
    int64_t sw[2] = {3, 5}, swt[2] = {5, 3}, sb[1] = {7}, sd[3] = {2, 3, 1}, se[2] = {4, 0},
            sm[2] = {3, 5}, si[1] = {6};
    TT_OK(ctx, tm_param_new(ctx, "w", variant == 4 ? TM_F64 : TM_F32, 2, variant == 2 ? swt : sw,
                            tm_cpu(), &t));
    TT_OK(ctx, tm_tensor_init_normal(ctx, t, seed, NULL, 0.0, 1.0));
    TT_OK(ctx, tm_param_new(ctx, variant == 1 ? "b2" : "b", TM_BF16, 1, sb, tm_cpu(), &t));
    TT_OK(ctx, tm_tensor_init_normal(ctx, t, seed, "b", 0.0, 1.0));
    TT_OK(ctx, tm_param_new(ctx, "d", TM_F64, 3, sd, tm_cpu(), &t));
    TT_OK(ctx, tm_tensor_init_normal(ctx, t, seed, NULL, 0.0, 1.0));
    TT_OK(ctx, tm_param_new(ctx, "s", TM_F32, 0, NULL, tm_cpu(), &t));
    TT_OK(ctx, tm_tensor_init_uniform(ctx, t, seed, NULL, -1.0, 1.0));
    TT_OK(ctx, tm_param_new(ctx, "e", TM_F32, 2, se, tm_cpu(), &t));
    TT_OK(ctx, tm_buffer_new(ctx, "m", TM_F32, 2, sm, tm_cpu(), &t));
    TT_OK(ctx, tm_tensor_init_normal(ctx, t, seed, NULL, 0.0, 1.0));
    TT_OK(ctx, tm_buffer_new(ctx, "idx", TM_I64, 1, si, tm_cpu(), &t));
    int64_t iv[6];
    for (int i = 0; i < 6; i++) iv[i] = (int64_t)(seed * 0x9E3779B97F4A7C15ull) ^ ((int64_t)i << 40) ^ -i;
    TT_OK(ctx, tm_tensor_write(ctx, t, TM_I64, iv, 6));
    if (variant == 3) {
        int64_t sx[1] = {2};
        TT_OK(ctx, tm_param_new(ctx, "extra", TM_F32, 1, sx, tm_cpu(), &t));
    }
    return ctx;
}

/* Bytes of every reference tensor of ctx (by the base names), in native dtype, concatenated;
 * in one of 8 rotating static buffers (a few snapshots live at once in a test). */
typedef struct snap {
    unsigned char *b;
    size_t n;
} snap;
static snap snapshot(tm_ctx *ctx) {
    static unsigned char buf[8][4096];
    static int next;
    snap s = {buf[next++ % 8], 0};
    for (int k = 0; k < N_BASE; k++) {
        tm_tensor *t = tm_ctx_find(ctx, base_names[k]);
        if (!t) continue; /* variants rename one */
        size_t nb = (size_t)tm_tensor_numel(t) * tm_dtype_size(tm_tensor_dtype(t));
        cr_assert(s.n + nb <= 4096);
        TT_OK(ctx, tm_tensor_read(ctx, t, tm_tensor_dtype(t), s.b + s.n, tm_tensor_numel(t)));
        s.n += nb;
    }
    return s;
}
static void assert_snap_eq(snap a, snap b, const char *what) {
    cr_assert_eq(a.n, b.n, "%s", what);
    cr_assert_eq(memcmp(a.b, b.b, a.n), 0, "%s: tensors changed", what);
}

static const char meta_ref[] = "step=17;rng=0123456789abcdef;pos=4242";

Test(ckpt, round_trip_bitwise) {
    tm_ctx *a = make_ctx(0, 1), *b = make_ctx(0, 2);
    const char *path = tt_path("a.ckpt");
    TT_OK(a, tm_ckpt_save(a, path, meta_ref, sizeof meta_ref));
    snap sa = snapshot(a), sb0 = snapshot(b);
    cr_assert_neq(memcmp(sa.b, sb0.b, sa.n), 0, "different seeds give different tensors");
    char meta[64];
    size_t ml = 0;
    TT_OK(b, tm_ckpt_load(b, path, meta, sizeof meta, &ml));
    cr_assert_eq(ml, sizeof meta_ref);
    cr_assert_eq(memcmp(meta, meta_ref, ml), 0);
    assert_snap_eq(sa, snapshot(b), "round trip");
    /* Saving over an existing file replaces it and leaves nothing else in the directory. */
    TT_OK(b, tm_ckpt_save(b, path, NULL, 0));
    TT_OK(a, tm_ckpt_load(a, path, NULL, 0, &ml));
    cr_assert_eq(ml, 0);
    cr_assert_eq(tt_dir_entries(g_dir), 1);
    tm_ctx_free(a);
    tm_ctx_free(b);
}

/* Every single-byte change anywhere in the file (two different flips per byte) must fail the
 * load and leave every tensor of the target context bit-identical. */
Test(ckpt, corruption_sweep_every_byte) {
    tm_ctx *a = make_ctx(0, 1), *b = make_ctx(0, 2);
    const char *path = tt_path("a.ckpt"), *bad = tt_path("bad.ckpt");
    TT_OK(a, tm_ckpt_save(a, path, meta_ref, sizeof meta_ref));
    long len;
    unsigned char *img = tt_slurp(path, &len);
    cr_assert(len > 100 && len < 4096, "small checkpoint: %ld bytes", len);
    snap before = snapshot(b);
    char meta[64];
    static const unsigned char flips[2] = {0x01, 0xA5};
    for (long i = 0; i < len; i++) {
        for (int f = 0; f < 2; f++) {
            img[i] ^= flips[f];
            spit(bad, img, len);
            img[i] ^= flips[f];
            size_t ml = 12345;
            tm_status s = tm_ckpt_load(b, bad, meta, sizeof meta, &ml);
            cr_assert_neq(s, TM_OK, "byte %ld ^ 0x%02x of %ld loaded silently", i, flips[f], len);
            cr_assert_eq(ml, 12345, "meta length untouched on failure");
            cr_assert(strstr(tm_ctx_errmsg(b), bad), "byte %ld: %s", i, tm_ctx_errmsg(b));
            assert_snap_eq(before, snapshot(b), "corrupt load");
        }
    }
    /* The intact file still loads into the same context afterwards. */
    TT_OK(b, tm_ckpt_load(b, path, meta, sizeof meta, NULL));
    assert_snap_eq(snapshot(a), snapshot(b), "after sweep");
    free(img);
    tm_ctx_free(a);
    tm_ctx_free(b);
}

Test(ckpt, truncated_files) {
    tm_ctx *a = make_ctx(0, 1), *b = make_ctx(0, 2);
    const char *path = tt_path("a.ckpt"), *bad = tt_path("trunc.ckpt");
    TT_OK(a, tm_ckpt_save(a, path, meta_ref, sizeof meta_ref));
    long len;
    unsigned char *img = tt_slurp(path, &len);
    snap before = snapshot(b);
    long cuts[] = {0, 1, 7, 8, 20, 31, 32, 33, 32 + (long)sizeof meta_ref + 3, len / 2, len - 13,
                   len - 12, len - 5, len - 1};
    for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
        spit(bad, img, cuts[k]);
        tm_status s = tm_ckpt_load(b, bad, NULL, 0, NULL);
        cr_assert_eq(s, TM_ERR_IO, "cut at %ld of %ld: %s", cuts[k], len, tm_ctx_errmsg(b));
        cr_assert(strstr(tm_ctx_errmsg(b), bad), "%s", tm_ctx_errmsg(b));
        if (cuts[k] >= 8)
            cr_assert(strstr(tm_ctx_errmsg(b), "truncated"), "cut at %ld: %s", cuts[k], tm_ctx_errmsg(b));
        assert_snap_eq(before, snapshot(b), "truncated load");
    }
    /* Trailing garbage is corruption too. */
    unsigned char *longer = malloc((size_t)len + 1);
    memcpy(longer, img, (size_t)len);
    longer[len] = 0;
    spit(bad, longer, len + 1);
    cr_assert_eq(tm_ckpt_load(b, bad, NULL, 0, NULL), TM_ERR_IO);
    cr_assert(strstr(tm_ctx_errmsg(b), "stray"), "%s", tm_ctx_errmsg(b));
    free(longer);
    free(img);
    tm_ctx_free(a);
    tm_ctx_free(b);
}

Test(ckpt, missing_file_and_bad_magic) {
    tm_ctx *b = make_ctx(0, 2);
    const char *nofile = tt_path("nope.ckpt");
    cr_assert_eq(tm_ckpt_load(b, nofile, NULL, 0, NULL), TM_ERR_IO);
    cr_assert(strstr(tm_ctx_errmsg(b), nofile), "%s", tm_ctx_errmsg(b));
    cr_assert(strstr(tm_ctx_errmsg(b), strerror(ENOENT)), "%s", tm_ctx_errmsg(b));

    const char *path = tt_path("a.ckpt");
    TT_OK(b, tm_ckpt_save(b, path, NULL, 0));
    long len;
    unsigned char *img = tt_slurp(path, &len);
    memcpy(img, "SAFETENS", 8);
    spit(path, img, len);
    cr_assert_eq(tm_ckpt_load(b, path, NULL, 0, NULL), TM_ERR_IO);
    cr_assert(strstr(tm_ctx_errmsg(b), "magic"), "%s", tm_ctx_errmsg(b));
    cr_assert(strstr(tm_ctx_errmsg(b), path), "%s", tm_ctx_errmsg(b));
    free(img);
    tm_ctx_free(b);
}

/* A well-formed header (valid CRC) of a version this build does not read. */
Test(ckpt, unsupported_version) {
    tm_ctx *a = make_ctx(0, 1), *b = make_ctx(0, 2);
    const char *path = tt_path("v2.ckpt");
    TT_OK(a, tm_ckpt_save(a, path, NULL, 0));
    long len;
    unsigned char *img = tt_slurp(path, &len);
    put32(img + 8, 2);
    put32(img + 28, (uint32_t)crc32(0, img, 28));
    spit(path, img, len);
    snap before = snapshot(b);
    cr_assert_eq(tm_ckpt_load(b, path, NULL, 0, NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(b), "version 2"), "%s", tm_ctx_errmsg(b));
    cr_assert(strstr(tm_ctx_errmsg(b), path), "%s", tm_ctx_errmsg(b));
    assert_snap_eq(before, snapshot(b), "version");
    free(img);
    tm_ctx_free(a);
    tm_ctx_free(b);
}

/* Context/file disagreements: each is TM_ERR_INVALID_ARG naming the tensor, nothing loaded. */
static void mismatch(int variant, const char *needle1, const char *needle2) {
    tm_ctx *a = make_ctx(0, 1), *b = make_ctx(variant, 2);
    const char *path = tt_path("a.ckpt");
    TT_OK(a, tm_ckpt_save(a, path, NULL, 0));
    snap before = snapshot(b);
    cr_assert_eq(tm_ckpt_load(b, path, NULL, 0, NULL), TM_ERR_INVALID_ARG, "variant %d: %s", variant,
                 tm_ctx_errmsg(b));
    const char *msg = tm_ctx_errmsg(b);
    cr_assert(strstr(msg, path), "%s", msg);
    cr_assert(strstr(msg, needle1), "%s", msg);
    cr_assert(strstr(msg, needle2), "%s", msg);
    assert_snap_eq(before, snapshot(b), "mismatch");
    tm_ctx_free(a);
    tm_ctx_free(b);
}
Test(ckpt, unknown_tensor_name) { mismatch(1, "'b'", "unknown"); }
Test(ckpt, shape_mismatch) { mismatch(2, "[3,5]", "[5,3]"); }
Test(ckpt, missing_tensor) { mismatch(3, "lacks", "extra"); }
Test(ckpt, dtype_mismatch) { mismatch(4, "'w'", "f64"); }

Test(ckpt, meta_too_large_for_cap) {
    tm_ctx *a = make_ctx(0, 1), *b = make_ctx(0, 2);
    const char *path = tt_path("a.ckpt");
    TT_OK(a, tm_ckpt_save(a, path, meta_ref, sizeof meta_ref));
    snap before = snapshot(b);
    char small[8];
    cr_assert_eq(tm_ckpt_load(b, path, small, sizeof small, NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(b), "meta_cap"), "%s", tm_ctx_errmsg(b));
    assert_snap_eq(before, snapshot(b), "meta cap");
    cr_assert_eq(tm_ckpt_save(a, path, NULL, 3), TM_ERR_INVALID_ARG);
    tm_ctx_free(a);
    tm_ctx_free(b);
}

/* A save that fails half-way (the file size limit stops it at 4 KiB) returns TM_ERR_IO naming
 * the file, leaves the old checkpoint byte-for-byte intact and loadable, and removes its
 * temporary file. Criterion runs each test in its own process, so the limit does not leak. */
Test(ckpt, failed_save_keeps_old_file) {
    tm_ctx *a = make_ctx(0, 1);
    const char *path = tt_path("keep.ckpt");
    TT_OK(a, tm_ckpt_save(a, path, meta_ref, sizeof meta_ref));
    long len0;
    unsigned char *before = tt_slurp(path, &len0);

    tm_ctx *big = make_ctx(0, 3);
    tm_tensor *t;
    int64_t shape[2] = {300, 257};
    TT_OK(big, tm_buffer_new(big, "noise", TM_F32, 2, shape, tm_cpu(), &t));
    TT_OK(big, tm_tensor_init_normal(big, t, 9, NULL, 0.0, 1.0));
    struct rlimit saved, lim;
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &saved), 0);
    lim = saved;
    lim.rlim_cur = 4096;
    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    tm_status s = tm_ckpt_save(big, path, NULL, 0);
    setrlimit(RLIMIT_FSIZE, &saved);
    cr_assert_eq(s, TM_ERR_IO, "%s", tm_ctx_errmsg(big));
    cr_assert(strstr(tm_ctx_errmsg(big), path), "%s", tm_ctx_errmsg(big));
    cr_assert(strstr(tm_ctx_errmsg(big), strerror(EFBIG)), "%s", tm_ctx_errmsg(big));

    long len1;
    unsigned char *after = tt_slurp(path, &len1);
    cr_assert_eq(len1, len0);
    cr_assert_eq(memcmp(before, after, (size_t)len0), 0);
    cr_assert_eq(tt_dir_entries(g_dir), 1, "temporary file removed");
    tm_ctx *b = make_ctx(0, 2);
    char meta[64];
    TT_OK(b, tm_ckpt_load(b, path, meta, sizeof meta, NULL));
    assert_snap_eq(snapshot(a), snapshot(b), "old file");
    free(before);
    free(after);
    tm_ctx_free(a);
    tm_ctx_free(b);
    tm_ctx_free(big);
}

/* The target directory does not exist: the temporary cannot be created; the message says so. */
Test(ckpt, save_into_missing_directory) {
    tm_ctx *a = make_ctx(0, 1);
    const char *path = tt_path("no/such/dir.ckpt");
    cr_assert_eq(tm_ckpt_save(a, path, NULL, 0), TM_ERR_IO);
    cr_assert(strstr(tm_ctx_errmsg(a), path), "%s", tm_ctx_errmsg(a));
    cr_assert(strstr(tm_ctx_errmsg(a), strerror(ENOENT)), "%s", tm_ctx_errmsg(a));
    tm_ctx_free(a);
}
