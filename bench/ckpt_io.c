/*
 * ckpt_io.c — checkpoint save and load throughput beside raw file I/O of the same bytes on the
 * same disk, in one run (issue 21). bench/ckpt_io.sh makes the checkpoint (tinymoe train
 * --steps 1) and runs this on it.
 *
 *   ckpt_io CKPT [--device cpu|cuda] [--dir DIR] [--threads N] [--reps R]
 *
 * The context is rebuilt from the file's list of tensors (tm_ckpt_inspect): one tm_buffer_new
 * per entry, same name, dtype and shape, on the device asked for, so any checkpoint works
 * without its model code. Then, each timed R times (the best is printed):
 *   load         tm_ckpt_load of CKPT into that context (every tensor, validated first)
 *   load weights tm_ckpt_load_flags(TM_CKPT_SKIP_UNKNOWN) into a context that holds only the
 *                tensors that are not optimizer state (what eval, sample and export load)
 *   save         tm_ckpt_save of the context to DIR (temp file, fsync, rename, fsync dir)
 *   raw write    the saved file's byte count written to one file in DIR, 8 MiB write() calls,
 *                one thread, fsync, close
 *   raw read     that file read back, 8 MiB read() calls, one thread
 * Before every timed read, the file's pages are dropped from the page cache with
 * posix_fadvise(POSIX_FADV_DONTNEED) after an fsync (no root needed). On a virtual disk the
 * host may still cache: the raw figures, measured the same way, are the yardstick.
 * GB/s are 1e9 bytes of the file per second. Also printed: zlib crc32 and deflate (level 1,
 * Huffman-only, the v1 writer's setting) on one thread over the first 64 MiB of tensor data,
 * and memcpy, so that the time can be attributed.
 *
 * Output: the table, then one line
 *   RESULT bytes=... save_gbs=... load_gbs=... load_weights_gbs=... raw_write_gbs=... raw_read_gbs=...
 * Uses only the public header (and zlib for the component figures).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "tinymoe.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void die(const char *what, const char *msg) {
    fprintf(stderr, "ckpt_io: %s: %s\n", what, msg);
    exit(1);
}

#define CHECK(ctx, call)                                                    \
    do {                                                                    \
        if ((call) != TM_OK) die(#call, tm_ctx_errmsg(ctx));                \
    } while (0)

/* fsync and drop the file's pages from the page cache, so the next read goes to the disk. */
static void drop_cache(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) die(path, strerror(errno));
    fsync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
}

static long long file_size(const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0) die(path, strerror(errno));
    return (long long)sb.st_size;
}

enum { CHUNK = 8 << 20 };

static double raw_write(const char *path, const unsigned char *buf, long long n) {
    double t0 = now_s();
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) die(path, strerror(errno));
    for (long long off = 0; off < n;) {
        size_t boff = (size_t)(off % (64 << 20)), k = CHUNK;
        if ((long long)k > n - off) k = (size_t)(n - off);
        if (k > (size_t)(64 << 20) - boff) k = (size_t)(64 << 20) - boff;
        ssize_t w = write(fd, buf + boff, k);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) die(path, strerror(errno));
        off += w;
    }
    if (fsync(fd) != 0) die(path, strerror(errno));
    close(fd);
    return now_s() - t0;
}

static double raw_read(const char *path, unsigned char *buf, long long n) {
    drop_cache(path);
    double t0 = now_s();
    int fd = open(path, O_RDONLY);
    if (fd < 0) die(path, strerror(errno));
    long long got = 0;
    for (;;) {
        ssize_t r = read(fd, buf, CHUNK);
        if (r < 0) die(path, strerror(errno));
        if (r == 0) break;
        got += r;
    }
    close(fd);
    if (got != n) die(path, "short read");
    return now_s() - t0;
}

static int is_optimizer_state(const char *name) {
    static const char *suffix[] = {".adamw_m", ".adamw_v", ".master", ".sgd_b"};
    size_t n = strlen(name);
    for (size_t i = 0; i < sizeof suffix / sizeof suffix[0]; i++) {
        size_t k = strlen(suffix[i]);
        if (n > k && !strcmp(name + n - k, suffix[i])) return 1;
    }
    return !strncmp(name, "optim.", 6);
}

/* A context holding a buffer for every entry (or every non-optimizer entry). */
static tm_ctx *make_ctx(const tm_ckpt_info *info, int cuda, int threads, int weights_only) {
    tm_ctx *ctx;
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = threads;
    o.cuda_device = cuda ? 0 : -1;
    if (tm_ctx_new(&ctx, &o) != TM_OK) die("tm_ctx_new", tm_last_create_error());
    tm_device dev = {cuda ? TM_DEVICE_CUDA : TM_DEVICE_CPU, 0};
    for (int i = 0; i < info->num_entries; i++) {
        const tm_ckpt_entry *e = &info->entries[i];
        if (weights_only && is_optimizer_state(e->name)) continue;
        tm_tensor *t;
        CHECK(ctx, tm_buffer_new(ctx, e->name, e->dtype, e->ndim, e->shape, dev, &t));
    }
    return ctx;
}

int main(int argc, char **argv) {
    const char *ckpt = NULL, *dir = "/tmp", *device = "cpu";
    int threads = 0, reps = 2;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc) dir = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (argv[i][0] != '-' && !ckpt) ckpt = argv[i];
        else {
            fprintf(stderr, "usage: ckpt_io CKPT [--device cpu|cuda] [--dir DIR] [--threads N] [--reps R]\n");
            return 2;
        }
    }
    if (!ckpt) die("usage", "ckpt_io CKPT [--device cpu|cuda] [--dir DIR] [--threads N] [--reps R]");
    if (reps < 1) reps = 1;
    int cuda = !strcmp(device, "cuda");
    if (cuda && tm_cuda_device_count() == 0) {
        fprintf(stderr, "ckpt_io: --device cuda: no CUDA device visible\n");
        return 3;
    }

    tm_ctx *ictx;
    tm_ctx_options io = tm_ctx_options_default();
    io.num_threads = threads;
    if (tm_ctx_new(&ictx, &io) != TM_OK) die("tm_ctx_new", tm_last_create_error());
    tm_ckpt_info *info;
    drop_cache(ckpt);
    double t0 = now_s();
    CHECK(ictx, tm_ckpt_inspect(ictx, ckpt, &info));
    double inspect_s = now_s() - t0;
    long long ckpt_bytes = file_size(ckpt), raw_total = 0, opt_bytes = 0, stored_total = 0, opt_stored = 0;
    for (int i = 0; i < info->num_entries; i++) {
        raw_total += (long long)info->entries[i].raw_bytes;
        stored_total += (long long)info->entries[i].stored_bytes;
        if (is_optimizer_state(info->entries[i].name)) {
            opt_bytes += (long long)info->entries[i].raw_bytes;
            opt_stored += (long long)info->entries[i].stored_bytes;
        }
    }

    tm_ctx *ctx = make_ctx(info, cuda, threads, 0);
    tm_ctx *wctx = make_ctx(info, cuda, threads, 1);
    char out[4096], raw[4096];
    snprintf(out, sizeof out, "%s/ckpt_io_bench.tmck", dir);
    snprintf(raw, sizeof raw, "%s/ckpt_io_bench.raw", dir);

    double load_s = 1e30, loadw_s = 1e30, save_s = 1e30, rw_s = 1e30, rr_s = 1e30;
    for (int r = 0; r < reps; r++) {
        drop_cache(ckpt);
        t0 = now_s();
        CHECK(ctx, tm_ckpt_load(ctx, ckpt, NULL, 0, NULL));
        double s = now_s() - t0;
        if (s < load_s) load_s = s;
        drop_cache(ckpt);
        t0 = now_s();
        CHECK(wctx, tm_ckpt_load_flags(wctx, ckpt, TM_CKPT_SKIP_UNKNOWN, NULL, 0, NULL));
        s = now_s() - t0;
        if (s < loadw_s) loadw_s = s;
        t0 = now_s();
        CHECK(ctx, tm_ckpt_save(ctx, out, info->meta, info->meta_bytes));
        s = now_s() - t0;
        if (s < save_s) save_s = s;
    }
    long long saved_bytes = file_size(out);

    /* The first 64 MiB of tensor data (the context's float tensors in file order): the bytes
     * the raw writes write and the components below work on, so nothing is special about them. */
    unsigned char *buf = calloc(64 << 20, 1);
    if (!buf) die("malloc", "64 MiB");
    size_t got = 0;
    for (int k = 0; k < tm_ctx_num_named(ctx) && got < (size_t)(64 << 20); k++) {
        const tm_tensor *t = tm_ctx_named(ctx, k);
        size_t nb = (size_t)tm_tensor_numel(t) * tm_dtype_size(tm_tensor_dtype(t));
        if (tm_tensor_dtype(t) != TM_F32 && tm_tensor_dtype(t) != TM_BF16) continue;
        if (got + nb > (size_t)(64 << 20)) continue;
        CHECK(ctx, tm_tensor_read(ctx, t, tm_tensor_dtype(t), buf + got, tm_tensor_numel(t)));
        got += nb;
    }
    if (got == 0) die(ckpt, "no float tensor under 64 MiB to measure with");
    unsigned char *rbuf = malloc(CHUNK);
    if (!rbuf) die("malloc", "8 MiB");
    for (int r = 0; r < reps; r++) {
        double s = raw_write(raw, buf, saved_bytes);
        if (s < rw_s) rw_s = s;
        s = raw_read(raw, rbuf, saved_bytes);
        if (s < rr_s) rr_s = s;
    }

    /* Components, one thread, over tensor-like bytes (the saved file's first 64 MiB). */
    size_t cn = (size_t)got;
    t0 = now_s();
    volatile uLong c = crc32(0, buf, (uInt)cn);
    double crc_s = now_s() - t0;
    (void)c;
    unsigned char *zb = malloc(compressBound((uLong)cn));
    if (!zb) die("malloc", "deflate buffer");
    z_stream z;
    memset(&z, 0, sizeof z);
    deflateInit2(&z, 1, Z_DEFLATED, 15, 8, Z_HUFFMAN_ONLY);
    z.next_in = buf;
    z.avail_in = (uInt)cn;
    z.next_out = zb;
    z.avail_out = (uInt)compressBound((uLong)cn);
    t0 = now_s();
    deflate(&z, Z_FINISH);
    double defl_s = now_s() - t0;
    double defl_ratio = (double)z.total_out / (double)cn;
    deflateEnd(&z);
    unsigned char *mb = malloc(cn);
    if (!mb) die("malloc", "memcpy buffer");
    memset(mb, 1, cn);
    t0 = now_s();
    memcpy(mb, buf, cn);
    double mc_s = now_s() - t0;
    volatile unsigned char sink = mb[cn / 2];
    (void)sink;

    double G = 1e9;
    printf("checkpoint %s: %d tensors, %.1f MB of tensors (%.1f MB optimizer state), %.1f MB stored, file "
           "%.1f MB, version %u; device %s, threads %d, best of %d\n",
           ckpt, info->num_entries, raw_total / 1e6, opt_bytes / 1e6, stored_total / 1e6, ckpt_bytes / 1e6,
           info->version, device, threads, reps);
    printf("  stored / raw bytes in this file: weights and buffers %.3f, optimizer state %.3f\n",
           (double)(stored_total - opt_stored) / (double)(raw_total - opt_bytes > 0 ? raw_total - opt_bytes : 1),
           (double)opt_stored / (double)(opt_bytes > 0 ? opt_bytes : 1));
    printf("  %-34s %10s %10s %8s\n", "what", "MB", "seconds", "GB/s");
    printf("  %-34s %10.1f %10.3f %8.3f\n", "inspect (full validation)", ckpt_bytes / 1e6, inspect_s,
           ckpt_bytes / G / inspect_s);
    printf("  %-34s %10.1f %10.3f %8.3f\n", "load (all tensors, cold)", ckpt_bytes / 1e6, load_s,
           ckpt_bytes / G / load_s);
    printf("  %-34s %10.1f %10.3f %8.3f\n", "load weights only (cold)", (raw_total - opt_bytes) / 1e6, loadw_s,
           (raw_total - opt_bytes) / G / loadw_s);
    printf("  %-34s %10.1f %10.3f %8.3f\n", "save (fsync, rename)", saved_bytes / 1e6, save_s,
           saved_bytes / G / save_s);
    printf("  %-34s %10.1f %10.3f %8.3f\n", "raw write, same bytes (fsync)", saved_bytes / 1e6, rw_s,
           saved_bytes / G / rw_s);
    printf("  %-34s %10.1f %10.3f %8.3f\n", "raw read, same bytes (cold)", saved_bytes / 1e6, rr_s,
           saved_bytes / G / rr_s);
    printf("  %-34s %10.1f %10.3f %8.3f\n", "crc32, 1 thread", cn / 1e6, crc_s, cn / G / crc_s);
    printf("  %-34s %10.1f %10.3f %8.3f  (stored/raw %.3f)\n", "deflate lvl1 huffman, 1 thread", cn / 1e6, defl_s,
           cn / G / defl_s, defl_ratio);
    printf("  %-34s %10.1f %10.3f %8.3f\n", "memcpy, 1 thread", cn / 1e6, mc_s, cn / G / mc_s);
    printf("  save / raw write: %.2fx the time; load / raw read: %.2fx the time\n", save_s / rw_s,
           load_s * saved_bytes / ckpt_bytes / rr_s);
    printf("RESULT bytes=%lld save_gbs=%.3f load_gbs=%.3f load_weights_gbs=%.3f raw_write_gbs=%.3f "
           "raw_read_gbs=%.3f save_s=%.3f load_s=%.3f load_weights_s=%.3f\n",
           saved_bytes, saved_bytes / G / save_s, ckpt_bytes / G / load_s, (raw_total - opt_bytes) / G / loadw_s,
           saved_bytes / G / rw_s, saved_bytes / G / rr_s, save_s, load_s, loadw_s);
    unlink(out);
    unlink(raw);
    free(buf);
    free(rbuf);
    free(zb);
    free(mb);
    tm_ckpt_info_free(info);
    tm_ctx_free(wctx);
    tm_ctx_free(ctx);
    tm_ctx_free(ictx);
    return 0;
}
