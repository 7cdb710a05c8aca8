/*
 * ckpt.c — checkpoint files: every parameter and buffer of a context plus an opaque meta blob.
 *
 * The byte layout is specified in docs/checkpoint-format.md; in short, version 2 (all integers
 * little-endian):
 *
 *   header   "TMCKPT\0\0" | version u32 = 2 | endian u32 | n u32 | flags u32 | meta_len u64 |
 *            index_off u64 | index_len u64 | file_len u64 | reserved u32 | crc32(bytes 0..59)
 *   meta     meta_len bytes | crc32(meta) u32
 *   data     each tensor's stored bytes (raw, or one zlib stream), back to back in index order
 *   index    per tensor: name_len u16 | name | dtype u8 | ndim u8 | encoding u8 | 0 u8 |
 *            shape i64[ndim] | raw_len u64 | stored_len u64 | offset u64 | crc32(stored) u32
 *   end      "TMCKEND\0" | crc32(index)
 * Version 1 (no index, every tensor deflated) is still read: parse_image_v1.
 *
 * Saving never exposes a partial file: it writes "<path>.tmp.XXXXXX" in the same directory,
 * fsyncs it, renames it over `path` and fsyncs the directory. Whatever instant a crash (or
 * kill -9, or a full disk) hits, `path` names either the old complete file or the new one.
 * The data goes out in 64 MiB batches: thread 0 gathers the next batch to (pinned) host memory
 * while the other threads checksum and pwrite the current one (write_data).
 * An asynchronous save (tm_ckpt_snapshot_*) splits this in two: take copies every tensor into
 * one host buffer on the context's thread, write does the rest from there on any thread, the
 * same file by the same protocol (plan_save and write_file serve both). Under a communicator
 * both kinds of save are written by every rank (save_ranks; snap_*_ranks for snapshots, whose
 * commit renames once every rank's part is written).
 * tm_ckpt_reader reads one tensor at a time into the caller's memory (export streams this way).
 *
 * Loading never leaves a half-loaded context: header, meta and index are checked, the entries
 * matched against the context, then the stored bytes of the tensors the context holds (only
 * those) are read by all threads and every CRC checked, compressed entries inflated once to
 * check, before the first tensor is written. Compressed entries are inflated a second time to
 * be written, so that host memory holds the stored bytes plus one inflated tensor. The file
 * stays open from the first read to the last, so a concurrent save (a rename) cannot swap it.
 * The one failure that can still strike mid-write is the device copy itself (TM_ERR_CUDA).
 */
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "extend.h"

#define CK_VERSION 2u    /* what this build writes */
#define CK_VERSION_V1 1u /* still read */
#define CK_ENDIAN 0x01020304u
#define CK_HEADER_BYTES 32
#define CK_NAME_MAX 127 /* tm_param_new's limit */

static const unsigned char ck_magic[8] = {'T', 'M', 'C', 'K', 'P', 'T', 0, 0};
static const unsigned char ck_end[8] = {'T', 'M', 'C', 'K', 'E', 'N', 'D', 0};

/* zlib level 1: parameters are near-incompressible floats, so higher levels gain a few percent
 * of size for several times the time; checkpoints are written often, read once. */
enum { CK_ZLEVEL = 1 };

/* Tensor data is written as the host holds it; the format says little-endian, so a
 * big-endian host would need byte swapping that nobody has asked for yet. */
static int host_little_endian(void) {
    const uint32_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

static void put_u16(unsigned char *p, uint16_t v) { p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8); }
static void put_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void put_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint16_t get_u16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get_u32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint64_t get_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* zlib's crc32 takes a uInt length; feed large blocks in pieces. */
static uint32_t crc_update(uint32_t crc, const void *p, size_t n) {
    const unsigned char *b = p;
    uLong c = crc;
    while (n > 0) {
        uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
        c = crc32(c, b, k);
        b += k;
        n -= k;
    }
    return (uint32_t)c;
}

/* Checkpoints hold logical tensors: a tensor spread over the ranks (an expert shard, a ZeRO-1
 * block of optimizer state) is stored whole, gathered from the ranks (framework/shard.c). */
static void logical_shape(const tm_tensor *t, int *ndim, int64_t *shape) { tm__named_logical(t, ndim, shape); }

static size_t tensor_bytes(const tm_tensor *t) {
    int nd;
    int64_t shape[TM_MAX_DIMS], n = 1;
    logical_shape(t, &nd, shape);
    for (int d = 0; d < nd; d++) n *= shape[d];
    return (size_t)n * tm_dtype_size(tm_tensor_dtype(t));
}

/* zlib allocates through the context's allocator hook like everything else the library does
 * (compress2 / uncompress would call malloc behind the embedder's back). */
static voidpf ck_zalloc(voidpf opaque, uInt items, uInt size) {
    if (size && items > (size_t)-1 / size) return Z_NULL;
    void *p = tm__host_alloc((tm_ctx *)opaque, (size_t)items * size);
    return p ? p : Z_NULL;
}
static void ck_zfree(voidpf opaque, voidpf p) { tm__host_free((tm_ctx *)opaque, p); }

/* Tensors are compressed with deflate level 1 and the Huffman-only strategy: weights and
 * optimizer moments are floats whose bytes almost never repeat, so LZ77 matching finds next to
 * nothing (it was 2.4x slower for a slightly larger file on f32 weights here, 24 vs 57 MB/s);
 * integer buffers are tiny. It is an ordinary zlib stream: any inflate reads it. */
static int ck_deflate_init(tm_ctx *ctx, z_stream *z) {
    memset(z, 0, sizeof *z);
    z->zalloc = ck_zalloc;
    z->zfree = ck_zfree;
    z->opaque = ctx;
    return deflateInit2(z, CK_ZLEVEL, Z_DEFLATED, 15, 8, Z_HUFFMAN_ONLY);
}

/* One deflate of n bytes into dst (capacity *dst_len >= compressBound(n)) on a stream made by
 * ck_deflate_init; allocates nothing, so it may run on any thread. */
static int ck_deflate(z_stream *z, const unsigned char *src, size_t n, unsigned char *dst, size_t *dst_len) {
    int zs = deflateReset(z);
    if (zs != Z_OK) return zs;
    z->next_in = (Bytef *)src;
    z->avail_in = (uInt)n;
    z->next_out = dst;
    z->avail_out = (uInt)*dst_len;
    zs = deflate(z, Z_FINISH);
    *dst_len = z->total_out;
    return zs == Z_STREAM_END ? Z_OK : (zs == Z_OK ? Z_BUF_ERROR : zs);
}

/* One-shot inflate; Z_OK only when the stream ends exactly after filling *dst_len bytes. */
static int ck_inflate(tm_ctx *ctx, const unsigned char *src, size_t n, unsigned char *dst, size_t *dst_len) {
    z_stream z = {.zalloc = ck_zalloc, .zfree = ck_zfree, .opaque = ctx};
    int zs = inflateInit(&z);
    if (zs != Z_OK) return zs;
    z.next_in = (Bytef *)src;
    z.avail_in = (uInt)n;
    z.next_out = dst;
    z.avail_out = (uInt)*dst_len;
    zs = inflate(&z, Z_FINISH);
    *dst_len = z.total_out;
    int trailing = z.avail_in != 0;
    inflateEnd(&z);
    if (zs == Z_STREAM_END) return trailing ? Z_DATA_ERROR : Z_OK;
    return zs == Z_OK || zs == Z_BUF_ERROR ? Z_DATA_ERROR : zs;
}

static size_t ck_bound(size_t raw) { return (size_t)compressBound((uLong)raw); }

/* ---- saving ---------------------------------------------------------------------------- */

/* Version 2 (docs/checkpoint-format.md): header | meta | tensor data | index | end marker.
 * The index comes last because the writer learns a compressed tensor's length only after
 * compressing it; the header (written last, at offset 0) points at it. */
enum {
    CK_V2_HEADER = 64,
    CK_ENC_RAW = 0,
    CK_ENC_ZLIB = 1,
    CK_BATCH = 64 << 20, /* staging: tensors are gathered to the host in batches of this many bytes */
    CK_CHUNK = 8 << 20,  /* one unit of work for a thread: CRC and pwrite (or pread and CRC) */
};

/* pwrite / pread all n bytes at off, through short transfers and EINTR; 0 or an errno value
 * (EIO for a read that hits the end of the file early). */
static int pwrite_all(int fd, const unsigned char *p, size_t n, uint64_t off) {
    while (n > 0) {
        size_t k = n > (1u << 30) ? (1u << 30) : n;
        ssize_t w = pwrite(fd, p, k, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return errno;
        if (w == 0) return EIO;
        p += w, n -= (size_t)w, off += (uint64_t)w;
    }
    return 0;
}

static int pread_all(int fd, unsigned char *p, size_t n, uint64_t off) {
    while (n > 0) {
        size_t k = n > (1u << 30) ? (1u << 30) : n;
        ssize_t r = pread(fd, p, k, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) return -1; /* the file ended early */
        p += r, n -= (size_t)r, off += (uint64_t)r;
    }
    return 0;
}

/* One tensor being saved. What the index needs (name, dtype, logical shape) is copied here when
 * the save is planned, so that writing a snapshot reads nothing of the context. */
typedef struct ck_out {
    const tm_tensor *t;
    const char *name; /* the context's name (immutable while the tensor lives) */
    tm_dtype dtype;
    int ndim;
    int64_t shape[TM_MAX_DIMS]; /* logical */
    size_t raw, stored, boff; /* bytes; boff: offset in its batch's staging buffer */
    size_t goff;              /* snapshots: offset in the snapshot's buffer */
    int zip;                  /* stored as a zlib stream */
    int batch;
    uint64_t off; /* in the file */
    uint32_t crc; /* of the stored bytes */
} ck_out;

/* One unit of work of a batch: CRC (raw tensors) and pwrite of [src, src + len) at off. */
typedef struct ck_item {
    int k; /* tensor */
    int crc_it;
    const unsigned char *src;
    size_t len;
    uint64_t off;
    uint32_t crc;
    int err;
} ck_item;

tm_ckpt_save_options tm_ckpt_save_options_default(void) {
    tm_ckpt_save_options o = {TM_CKPT_COMPRESS_AUTO, NULL, NULL, NULL};
    return o;
}

static int ck_want_zip(const tm_ckpt_save_options *o, const tm_tensor *t) {
    tm_dtype dt = tm_tensor_dtype(t);
    if (o->compress_tensor) return o->compress_tensor(tm_tensor_name(t), dt, o->user) != 0;
    if (o->compress == TM_CKPT_COMPRESS_ALL) return 1;
    if (o->compress == TM_CKPT_COMPRESS_NONE) return 0;
    /* AUTO: float weights and optimizer state are near-incompressible (docs/checkpoint-format.md
     * gives the measurement); integer buffers (counts, step counters) compress well and are small. */
    return !(dt == TM_F32 || dt == TM_BF16 || dt == TM_F64);
}

/* Make the rename durable. Best effort: some file systems refuse fsync on a directory, and
 * the file itself is already complete and synced by then. */
static void sync_dir(const char *path) {
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash) {
        strcpy(dir, ".");
    } else if (slash == path) {
        strcpy(dir, "/");
    } else {
        size_t n = (size_t)(slash - path);
        if (n >= sizeof dir) return;
        memcpy(dir, path, n);
        dir[n] = '\0';
    }
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
}

/* A planned save and everything it allocates, freed in one place (save_free). A synchronous
 * save stages the tensors in batches in raw[0], raw[1]; a snapshot (tm_ckpt_snapshot_new) holds
 * every tensor in snap, at o[k].goff, and writes from there. Errors of the write go to the
 * context, or, for a snapshot (written on any thread), to err. */
typedef struct ck_save {
    tm_ctx *ctx;
    int n, nb, nth;
    ck_out *o;
    ck_item *items;
    unsigned char *raw[2], *comp, *index;
    int pinned[2];
    size_t index_len;
    z_stream *z;
    int nz, *zs;
    unsigned char *snap; /* snapshots: every tensor's bytes */
    int snap_pinned;
    size_t snap_bytes, held; /* held: host bytes of the staging buffers (reported by snapshots) */
    char *err;               /* NULL: errors to ctx */
    size_t err_cap;
    void (*before_commit)(const char *tmp_path, void *user); /* tm_ckpt_save_options */
    void *user;
} ck_save;

enum { CK_ERR_MAX = PATH_MAX + 1024 };

static tm_status ck_fail(ck_save *sv, tm_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static tm_status ck_fail(ck_save *sv, tm_status st, const char *fmt, ...) {
    char buf[CK_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (sv->err) {
        snprintf(sv->err, sv->err_cap, "%s", buf);
        return st;
    }
    return tm__err(sv->ctx, st, "%s", buf);
}

static void save_free(tm_ctx *ctx, ck_save *sv) {
    for (int i = 0; i < sv->nz; i++) deflateEnd(&sv->z[i]);
    tm__host_free(ctx, sv->z);
    tm__host_free(ctx, sv->zs);
    for (int i = 0; i < 2; i++) tm__host_free_pinned(ctx, sv->raw[i], sv->pinned[i]);
    tm__host_free_pinned(ctx, sv->snap, sv->snap_pinned);
    tm__host_free(ctx, sv->comp);
    tm__host_free(ctx, sv->index);
    tm__host_free(ctx, sv->items);
    tm__host_free(ctx, sv->o);
    memset(sv, 0, sizeof *sv);
}

/* The checks of a save's arguments (fn names the public function). */
static tm_status save_args(tm_ctx *ctx, const char *fn, const char *path, const void *meta, size_t meta_bytes) {
    if (!path || !*path) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: path is NULL or empty", fn);
    if (!meta && meta_bytes)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: meta is NULL but meta_bytes is %zu", fn, meta_bytes);
    if (strlen(path) + 11 >= PATH_MAX)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: path '%s' is too long", fn, path);
    return TM_OK;
}

/* Plan the save of every named tensor of ctx: batches of up to CK_BATCH bytes (or one larger
 * tensor), whose largest sizes the staging buffers, allocated here once; for a snapshot, one
 * buffer for all the tensors instead of the two batch buffers. The deflate streams are made
 * here, on the context's thread: zlib allocates then (through the context's allocator), and
 * not while compressing. */
static tm_status plan_save(tm_ctx *ctx, const char *fn, const tm_ckpt_save_options *opt, int snapshot, ck_save *sv) {
    memset(sv, 0, sizeof *sv);
    sv->ctx = ctx;
    if (opt) sv->before_commit = opt->before_commit, sv->user = opt->user;
    if (!host_little_endian())
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: big-endian hosts are not supported", fn);
    int n = tm_ctx_num_named(ctx);
    if ((uint64_t)n > UINT32_MAX) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: too many tensors (%d)", fn, n);
    sv->n = n;
    sv->nth = tm__nthreads(ctx);
    sv->o = tm__host_alloc(ctx, sizeof *sv->o * (size_t)(n ? n : 1));
    if (!sv->o) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    memset(sv->o, 0, sizeof *sv->o * (size_t)(n ? n : 1));
    size_t raw_cap = 1, comp_cap = 1, index_len = 0, max_items = 1, goff = 0;
    int nb = 0, any_zip = 0;
    for (int k = 0; k < n;) {
        size_t raw = 0, comp = 0, items = 0;
        do {
            ck_out *x = &sv->o[k];
            x->t = tm_ctx_named(ctx, k);
            x->name = tm_tensor_name(x->t);
            x->dtype = tm_tensor_dtype(x->t);
            logical_shape(x->t, &x->ndim, x->shape);
            x->raw = tensor_bytes(x->t);
            x->zip = ck_want_zip(opt, x->t);
            if (x->zip && (compressBound((uLong)x->raw) > UINT_MAX || (uLong)x->raw != x->raw)) {
                tm_status st = tm__err(ctx, TM_ERR_UNSUPPORTED,
                                       "%s: tensor '%s' of %zu bytes exceeds zlib's 4 GiB limit for one deflate call; "
                                       "store it uncompressed (tm_ckpt_save_options)", fn, x->name, x->raw);
                save_free(ctx, sv);
                return st;
            }
            any_zip |= x->zip;
            x->batch = nb;
            x->boff = raw;
            x->goff = goff;
            goff += (x->raw + 63) & ~(size_t)63; /* 64-byte aligned slots */
            index_len += 2 + strlen(x->name) + 4 + 8 * (size_t)x->ndim + 8 + 8 + 8 + 4;
            raw += x->raw;
            if (x->zip) comp += ck_bound(x->raw);
            items += x->zip ? 1 : (x->raw + CK_CHUNK - 1) / CK_CHUNK + 1;
            k++;
        } while (k < n && raw + tensor_bytes(tm_ctx_named(ctx, k)) <= CK_BATCH);
        if (raw > raw_cap) raw_cap = raw;
        if (comp > comp_cap) comp_cap = comp;
        if (items > max_items) max_items = items;
        nb++;
    }
    sv->nb = nb;
    sv->index_len = index_len;
    int nth = sv->nth, bad = 0;
    if (snapshot) {
        sv->snap_bytes = goff;
        sv->snap = tm__host_alloc_pinned(ctx, goff ? goff : 1, &sv->snap_pinned);
        bad = !sv->snap;
    } else {
        for (int i = 0; i < (nb > 1 ? 2 : 1); i++) sv->raw[i] = tm__host_alloc_pinned(ctx, raw_cap, &sv->pinned[i]);
        bad = !sv->raw[0] || (nb > 1 && !sv->raw[1]);
    }
    sv->items = tm__host_alloc(ctx, sizeof *sv->items * max_items);
    sv->index = tm__host_alloc(ctx, index_len + 12);
    sv->zs = tm__host_alloc(ctx, sizeof *sv->zs * (size_t)(n ? n : 1));
    if (any_zip) {
        sv->comp = tm__host_alloc(ctx, comp_cap);
        sv->z = tm__host_alloc(ctx, sizeof *sv->z * (size_t)nth);
    }
    sv->held = (snapshot ? goff : (nb > 1 ? 2 : 1) * raw_cap) + (any_zip ? comp_cap : 0) + index_len + 12;
    if (bad || !sv->items || !sv->index || !sv->zs || (any_zip && (!sv->comp || !sv->z))) {
        size_t want = sv->held;
        save_free(ctx, sv);
        return tm__err(ctx, TM_ERR_NOMEM, "%s: cannot allocate %zu bytes of staging memory", fn, want);
    }
    for (; any_zip && sv->nz < nth; sv->nz++) {
        int zs = ck_deflate_init(ctx, &sv->z[sv->nz]); /* zlib allocates here, on this thread only */
        if (zs != Z_OK) {
            save_free(ctx, sv);
            return tm__err(ctx, zs == Z_MEM_ERROR ? TM_ERR_NOMEM : TM_ERR_INTERNAL, "%s: zlib deflateInit failed (%d)",
                           fn, zs);
        }
    }
    return TM_OK;
}

/* Take part in the gathers of named tensors [from, n) that the writing rank makes (the ranks
 * other than 0, and rank 0 after a failure, so that nobody waits for a partner). */
static tm_status drain_gathers(tm_ctx *ctx, int from) {
    tm_status st = TM_OK;
    for (int k = from; k < tm_ctx_num_named(ctx); k++) {
        const tm_tensor *t = tm_ctx_named(ctx, k);
        if (!tm__named_sharded(ctx, t)) continue;
        size_t nb = tensor_bytes(t);
        void *buf = tm__host_alloc(ctx, nb ? nb : 1);
        if (!buf) return tm__err(ctx, TM_ERR_NOMEM, "tm_ckpt_save: out of host memory gathering '%s'", tm_tensor_name(t));
        tm_status s = tm__named_gather(ctx, t, buf);
        tm__host_free(ctx, buf);
        if (st == TM_OK) st = s;
        if (s == TM_ERR_COMM) return s; /* the partners are gone */
    }
    return st;
}

/* Gather batch b's tensors (logical values, this thread only: it calls into the runtime) into
 * buf at their batch offsets. */
static tm_status gather_batch(tm_ctx *ctx, ck_out *o, int n, int b, unsigned char *buf, int *progress) {
    for (int k = 0; k < n; k++) {
        if (o[k].batch != b) continue;
        *progress = k; /* the gathers of the other ranks pair with these */
        TM__TRY(tm__named_gather(ctx, o[k].t, buf + o[k].boff));
        *progress = k + 1;
    }
    return TM_OK;
}

/* The data of every tensor, batch by batch: while thread 0 gathers batch b + 1 (device to
 * pinned host memory) into one staging buffer, the other threads checksum and pwrite batch b
 * from the other, in CK_CHUNK pieces at offsets fixed in advance; thread 0 joins them when its
 * gather is done. Tensors chosen for compression are deflated (one per thread) before their
 * batch is written, so that the batch's offsets are known. The file's bytes do not depend on
 * the thread count. A snapshot's tensors are in host memory already: nothing is gathered, and
 * the context is not used (nth threads, at most sv->nz of them deflating). */
static tm_status write_data(ck_save *sv, const char *path, const char *tmp, int fd, int nth, uint64_t *cursor,
                            int *progress) {
    const char *fn = "tm_ckpt_save";
    ck_out *o = sv->o;
    int n = sv->n, nb = sv->nb, nz = sv->nz < nth ? sv->nz : nth;
    tm_status st = n && !sv->snap ? gather_batch(sv->ctx, o, n, 0, sv->raw[0], progress) : TM_OK;
    for (int b = 0; b < nb && st == TM_OK; b++) {
        unsigned char *cur = sv->raw[b & 1], *nxt = sv->raw[(b + 1) & 1];
        int k0 = 0;
        while (o[k0].batch != b) k0++;
        int k1 = k0;
        while (k1 < n && o[k1].batch == b) k1++;
        /* compress the chosen tensors of the batch, one per thread */
        size_t coff = 0;
        for (int k = k0; k < k1; k++) {
            o[k].stored = o[k].zip ? ck_bound(o[k].raw) : o[k].raw;
            if (o[k].zip) o[k].off = coff, coff += o[k].stored; /* offset in comp for now */
        }
#pragma omp parallel for num_threads(nz > 0 ? nz : 1) schedule(dynamic) if (k1 - k0 > 1)
        for (int k = k0; k < k1; k++) {
            if (!o[k].zip) continue;
#ifdef _OPENMP
            z_stream *z = &sv->z[omp_get_thread_num()];
#else
            z_stream *z = &sv->z[0];
#endif
            size_t cl = o[k].stored;
            unsigned char *dst = sv->comp + o[k].off;
            const unsigned char *src = sv->snap ? sv->snap + o[k].goff : cur + o[k].boff;
            sv->zs[k - k0] = ck_deflate(z, src, o[k].raw, dst, &cl);
            o[k].stored = cl;
            o[k].crc = crc_update(0, dst, cl);
        }
        int ni = 0;
        for (int k = k0; k < k1; k++) {
            if (o[k].zip) {
                if (sv->zs[k - k0] != Z_OK) {
                    st = ck_fail(sv, sv->zs[k - k0] == Z_MEM_ERROR ? TM_ERR_NOMEM : TM_ERR_INTERNAL,
                                 "%s: '%s': compressing tensor '%s' failed (zlib %d)", fn, path, o[k].name,
                                 sv->zs[k - k0]);
                    break;
                }
                sv->items[ni++] = (ck_item){.k = k, .src = sv->comp + o[k].off, .len = o[k].stored, .off = *cursor};
            } else {
                const unsigned char *src = sv->snap ? sv->snap + o[k].goff : cur + o[k].boff;
                for (size_t c = 0; c < o[k].raw || (c == 0 && o[k].raw == 0); c += CK_CHUNK) {
                    size_t len = o[k].raw - c < CK_CHUNK ? o[k].raw - c : CK_CHUNK;
                    sv->items[ni++] = (ck_item){.k = k, .crc_it = 1, .src = src + c, .len = len, .off = *cursor + c};
                    if (o[k].raw == 0) break;
                }
            }
            o[k].off = *cursor;
            *cursor += o[k].stored;
        }
        if (st != TM_OK) break;
        tm_status gst = TM_OK;
        int more = !sv->snap && b + 1 < nb;
#pragma omp parallel num_threads(nth)
        {
#ifdef _OPENMP
            int tid = omp_get_thread_num();
#else
            int tid = 0;
#endif
            if (tid == 0 && more) gst = gather_batch(sv->ctx, o, n, b + 1, nxt, progress);
#pragma omp for schedule(dynamic) nowait
            for (int i = 0; i < ni; i++) {
                ck_item *it = &sv->items[i];
                if (it->crc_it) it->crc = crc_update(0, it->src, it->len);
                it->err = pwrite_all(fd, it->src, it->len, it->off);
            }
        }
        for (int i = 0; i < ni && st == TM_OK; i++)
            if (sv->items[i].err)
                st = ck_fail(sv, TM_ERR_IO, "%s: cannot write '%s' (via '%s'): %s", fn, path, tmp,
                             strerror(sv->items[i].err));
        /* each raw tensor's CRC from its chunks' */
        for (int i = 0; i < ni; i++) {
            const ck_item *it = &sv->items[i];
            if (!it->crc_it) continue;
            ck_out *x = &o[it->k];
            x->crc = it->off == x->off ? it->crc : (uint32_t)crc32_combine(x->crc, it->crc, (z_off_t)it->len);
        }
        if (st == TM_OK) st = gst;
    }
    return st;
}

/* Write the planned save to "<path>.tmp.XXXXXX", fsync, rename over path, fsync the directory;
 * on failure the temporary file is removed. The arguments are checked (save_args). */
static tm_status write_file(ck_save *sv, const char *path, const void *meta, size_t meta_bytes, int nth,
                            int *progress) {
    const char *fn = "tm_ckpt_save";
    int n = sv->n;
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s.tmp.XXXXXX", path);
    tm_status st = TM_OK;
    int fd = mkstemp(tmp);
    if (fd < 0) return ck_fail(sv, TM_ERR_IO, "%s: cannot create '%s': %s", fn, tmp, strerror(errno));
    /* mkstemp creates 0600; a checkpoint is an ordinary file others may read. */
    (void)fchmod(fd, 0644);

    int err = 0;
    unsigned char c4[4];
    uint64_t cursor = CK_V2_HEADER;
    if (meta_bytes) err = pwrite_all(fd, meta, meta_bytes, cursor);
    put_u32(c4, crc_update(0, meta, meta_bytes));
    if (!err) err = pwrite_all(fd, c4, 4, cursor + meta_bytes);
    cursor += (uint64_t)meta_bytes + 4;
    if (err) st = ck_fail(sv, TM_ERR_IO, "%s: cannot write '%s' (via '%s'): %s", fn, path, tmp, strerror(err));
    if (st == TM_OK) st = write_data(sv, path, tmp, fd, nth, &cursor, progress);
    if (st == TM_OK) {
        if (sv->before_commit) sv->before_commit(tmp, sv->user);
        /* the index: one entry per tensor, in context creation order */
        size_t index_len = sv->index_len;
        unsigned char *p = sv->index;
        for (int k = 0; k < n; k++) {
            const ck_out *x = &sv->o[k];
            size_t name_len = strlen(x->name);
            put_u16(p, (uint16_t)name_len), p += 2;
            memcpy(p, x->name, name_len), p += name_len;
            *p++ = (unsigned char)x->dtype;
            *p++ = (unsigned char)x->ndim;
            *p++ = (unsigned char)(x->zip ? CK_ENC_ZLIB : CK_ENC_RAW);
            *p++ = 0;
            for (int a = 0; a < x->ndim; a++) put_u64(p, (uint64_t)x->shape[a]), p += 8;
            put_u64(p, (uint64_t)x->raw), p += 8;
            put_u64(p, (uint64_t)x->stored), p += 8;
            put_u64(p, x->off), p += 8;
            put_u32(p, x->crc), p += 4;
        }
        memcpy(p, ck_end, 8);
        put_u32(p + 8, crc_update(0, sv->index, index_len));
        uint64_t index_off = cursor, file_len = cursor + index_len + 12;
        unsigned char h[CK_V2_HEADER];
        memset(h, 0, sizeof h);
        memcpy(h, ck_magic, 8);
        put_u32(h + 8, CK_VERSION);
        put_u32(h + 12, CK_ENDIAN);
        put_u32(h + 16, (uint32_t)n);
        put_u32(h + 20, 0); /* flags */
        put_u64(h + 24, (uint64_t)meta_bytes);
        put_u64(h + 32, index_off);
        put_u64(h + 40, (uint64_t)index_len);
        put_u64(h + 48, file_len);
        put_u32(h + 60, crc_update(0, h, 60));
        err = pwrite_all(fd, sv->index, index_len + 12, index_off);
        if (!err) err = pwrite_all(fd, h, sizeof h, 0);
        if (!err && fsync(fd) != 0) err = errno;
        if (close(fd) != 0 && !err) err = errno;
        fd = -1;
        if (err) {
            st = ck_fail(sv, TM_ERR_IO, "%s: cannot write '%s' (via '%s'): %s", fn, path, tmp, strerror(err));
        } else if (rename(tmp, path) != 0) {
            st = ck_fail(sv, TM_ERR_IO, "%s: cannot rename '%s' to '%s': %s", fn, tmp, path, strerror(errno));
        } else {
            sync_dir(path);
        }
    }
    if (st != TM_OK) {
        if (fd >= 0) close(fd);
        unlink(tmp);
    }
    return st;
}

static tm_status save_file(tm_ctx *ctx, const char *path, const void *meta, size_t meta_bytes,
                           const tm_ckpt_save_options *opt, int *progress) {
    const char *fn = "tm_ckpt_save";
    TM__TRY(save_args(ctx, fn, path, meta, meta_bytes));
    ck_save sv;
    tm_status st = plan_save(ctx, fn, opt, 0, &sv);
    if (st != TM_OK) return st;
    st = write_file(&sv, path, meta, meta_bytes, sv.nth, progress);
    save_free(ctx, &sv);
    return st;
}

/* ---- distributed saves: every rank writes what it holds ------------------------------------ */

/* Under a communicator of W > 1 ranks, a tensor spread over the ranks (expert shards, ZeRO
 * blocks of optimizer state, master weights and, under ZeRO-3, parameters: tm__named_sharded)
 * is written by the ranks that hold it, each its own logical range (tm__named_local_range) at
 * an offset that every rank computes alike from the logical shapes, all ranks at once and
 * nothing gathered; of replicas (an expert shard on every expert-dp rank) the lowest rank
 * writes. World rank 0 writes what every rank holds whole (replicated weights, counters: its
 * own value, as a single-rank save would) and the tensors chosen for deflate, gathered (small
 * integer buffers under TM_CKPT_COMPRESS_AUTO); their stored length is known only after
 * deflating, so they follow the raw tensors in the file and in the index (a load matches the
 * index by name, so its order is free). The file is an ordinary version-2 checkpoint of
 * logical tensors: any layout, and any reader of today's files, reads it.
 * Protocol: rank 0 creates "<path>.tmp.XXXXXX" and broadcasts its name; every rank pwrites
 * its ranges, fsyncs and closes; the statuses and each range's CRC are all-gathered; rank 0
 * combines the CRCs (crc32_combine, in offset order), writes the index and the header, fsyncs,
 * renames over path and syncs the directory, then broadcasts the outcome. Until the rename,
 * path names the previous file, whatever instant a crash or kill -9 strikes on any rank. */

enum { CKD_RANK0 = 0, CKD_RANKS = 1 };

typedef struct ckd_tensor {
    const tm_tensor *t;
    const char *name; /* the context's name (immutable while the tensor lives) */
    int cls;        /* CKD_RANK0 or CKD_RANKS */
    int zip;
    size_t raw, stored, es; /* bytes; es: of one element */
    uint64_t off;
    uint32_t crc;
    int64_t lo, cnt; /* this rank's logical range (CKD_RANKS) */
    int writer;      /* this rank writes its range */
    size_t goff, held; /* snapshots: this rank's bytes of the tensor at snap + goff (held: 0 for none) */
} ckd_tensor;

/* n bytes at off, in CK_CHUNK pieces on nth threads, written from p (crc, then pwrite) or read
 * into p (pread, then crc); *crc extended over them in file order. 0 or an errno value (-1: a
 * read hit the end of the file early). One loop for both directions: saves and loads split,
 * checksum and combine the same way. */
static int crc_io(int fd, unsigned char *p, size_t n, uint64_t off, int nth, uint32_t *crc, int reading) {
    enum { MAXC = CK_BATCH / CK_CHUNK };
    uint32_t c[MAXC];
    int e[MAXC];
    for (size_t b = 0; b < n; b += CK_BATCH) {
        size_t bn = n - b < CK_BATCH ? n - b : CK_BATCH;
        int nc = (int)((bn + CK_CHUNK - 1) / CK_CHUNK);
#pragma omp parallel for num_threads(nth) schedule(dynamic) if (nc > 1)
        for (int i = 0; i < nc; i++) {
            size_t a = b + (size_t)i * CK_CHUNK, len = n - a < CK_CHUNK ? n - a : CK_CHUNK;
            if (reading) {
                e[i] = pread_all(fd, p + a, len, off + a);
                if (!e[i]) c[i] = crc_update(0, p + a, len);
            } else {
                c[i] = crc_update(0, p + a, len);
                e[i] = pwrite_all(fd, p + a, len, off + a);
            }
        }
        for (int i = 0; i < nc; i++) {
            if (e[i]) return e[i];
            size_t a = b + (size_t)i * CK_CHUNK, len = n - a < CK_CHUNK ? n - a : CK_CHUNK;
            *crc = (uint32_t)crc32_combine(*crc, c[i], (z_off_t)len);
        }
    }
    return 0;
}

static int crc_pwrite(int fd, const unsigned char *p, size_t n, uint64_t off, int nth, uint32_t *crc) {
    return crc_io(fd, (unsigned char *)p, n, off, nth, crc, 0); /* p is only read when writing */
}

/* Whether the ranks' ranges of tensor k (rg: [W][n][2] lo, count) tile its numel elements,
 * each range held by one rank or by replicas with the same range. */
static int ckd_tiles(const int64_t *rg, int W, int n, int k, int64_t numel) {
    int64_t covered = 0;
    for (int r = 0; r < W; r++) {
        int64_t lo = rg[((size_t)r * n + k) * 2], cnt = rg[((size_t)r * n + k) * 2 + 1];
        if (cnt < 0 || lo < 0 || lo + cnt > numel) return 0;
        if (!cnt) continue;
        int dup = 0;
        for (int q = 0; q < W && !dup; q++) {
            if (q == r) continue;
            int64_t l2 = rg[((size_t)q * n + k) * 2], c2 = rg[((size_t)q * n + k) * 2 + 1];
            if (!c2) continue;
            if (l2 == lo && c2 == cnt) dup = q < r;
            else if (l2 < lo + cnt && lo < l2 + c2) return 0; /* a partial overlap */
        }
        if (!dup) covered += cnt;
    }
    return covered == numel;
}

static int ckd_is_writer(const int64_t *rg, int n, int k, int r) {
    int64_t lo = rg[((size_t)r * n + k) * 2], cnt = rg[((size_t)r * n + k) * 2 + 1];
    if (cnt <= 0) return 0;
    for (int q = 0; q < r; q++)
        if (rg[((size_t)q * n + k) * 2] == lo && rg[((size_t)q * n + k) * 2 + 1] == cnt) return 0;
    return 1;
}

/* A: the n named tensors' sizes and compression choices into x, and every rank's range of each
 * tensor spread over the ranks into rg ([W][n][2]: lo, count; -1 for a tensor this rank does not
 * write by ranges): an all-gather of a few integers per tensor. mine: [n][2] scratch. Collective. */
static tm_status ckd_ranges(tm_ctx *ctx, const tm_ckpt_save_options *opt, ckd_tensor *x, int n, int64_t *mine,
                            int64_t *rg) {
    for (int k = 0; k < n; k++) {
        ckd_tensor *c = &x[k];
        c->t = tm_ctx_named(ctx, k);
        c->name = tm_tensor_name(c->t);
        c->raw = tensor_bytes(c->t);
        c->es = tm_dtype_size(tm_tensor_dtype(c->t));
        c->zip = ck_want_zip(opt, c->t);
        mine[2 * k] = mine[2 * k + 1] = -1;
        if (!c->zip && tm__named_sharded(ctx, c->t)) tm__named_local_range(ctx, c->t, &mine[2 * k], &mine[2 * k + 1]);
    }
    return tm_comm_allgather_host(ctx, TM_COMM_WORLD, mine, rg, sizeof(int64_t) * 2 * (size_t)n);
}

/* Who writes each tensor, decided alike on every rank from rg: the ranks whose ranges tile it
 * (each its own range; of replicas the lowest), else world rank 0; and the raw tensors' offsets
 * from data_start in creation order. Returns where the raw data ends: the deflated tensors follow
 * (their lengths are known only once deflated). */
static uint64_t ckd_layout(ckd_tensor *x, int n, int W, int me, const int64_t *rg, uint64_t data_start) {
    uint64_t cursor = data_start;
    for (int k = 0; k < n; k++) {
        ckd_tensor *c = &x[k];
        int64_t numel = (int64_t)(c->raw / c->es);
        c->cls = rg[2 * k + 1] >= 0 && ckd_tiles(rg, W, n, k, numel) ? CKD_RANKS : CKD_RANK0;
        c->writer = 0;
        if (c->cls == CKD_RANKS) {
            c->lo = rg[((size_t)me * n + k) * 2];
            c->cnt = rg[((size_t)me * n + k) * 2 + 1];
            c->writer = ckd_is_writer(rg, n, k, me);
        }
        if (!c->zip) c->off = cursor, c->stored = c->raw, cursor += c->raw;
    }
    return cursor;
}

/* Rank 0's end of a distributed save: each spread tensor's CRC from its writers' (res: per rank
 * `stride` int64, the CRC of tensor k at 1 + k; in offset order), the index in file order (raw
 * tensors, then deflated ones), the header, the file cut to its length, fsync, rename, directory
 * sync. fd is closed here; the caller removes tmp on failure. */
static tm_status ckd_commit(ck_save *sv, ckd_tensor *x, int n, int W, const int64_t *rg, const int64_t *res,
                            size_t stride, const char *path, const char *tmp, int fd, uint64_t meta_bytes,
                            uint64_t end) {
    tm_ctx *ctx = sv->ctx;
    const char *fn = "tm_ckpt_save";
    size_t index_len = 0;
    for (int k = 0; k < n; k++) {
        ckd_tensor *c = &x[k];
        int nd;
        int64_t shape[TM_MAX_DIMS];
        logical_shape(c->t, &nd, shape);
        index_len += 2 + strlen(tm_tensor_name(c->t)) + 4 + 8 * (size_t)nd + 8 + 8 + 8 + 4;
        if (c->cls != CKD_RANKS) continue;
        size_t es = tm_dtype_size(tm_tensor_dtype(c->t));
        c->crc = 0;
        int64_t at = 0; /* the writers' ranges tile the tensor: take them in order */
        for (;;) {
            int r = 0;
            while (r < W && !(ckd_is_writer(rg, n, k, r) && rg[((size_t)r * n + k) * 2] == at)) r++;
            if (r == W) break;
            int64_t cnt = rg[((size_t)r * n + k) * 2 + 1];
            c->crc = (uint32_t)crc32_combine(c->crc, (uint32_t)res[(size_t)r * stride + 1 + k], (z_off_t)((size_t)cnt * es));
            at += cnt;
        }
        if ((size_t)at * es != c->raw) {
            close(fd);
            return tm__err(ctx, TM_ERR_INTERNAL, "%s: '%s': the ranks' parts of '%s' cover %lld of its %zu bytes", fn,
                           path, tm_tensor_name(c->t), (long long)at * (long long)es, c->raw);
        }
    }
    unsigned char *index = tm__host_alloc(ctx, index_len + 12);
    if (!index) {
        close(fd);
        return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory for the index of '%s'", fn, path);
    }
    unsigned char *p = index;
    for (int pass = 0; pass < 2; pass++)
        for (int k = 0; k < n; k++) {
            const ckd_tensor *c = &x[k];
            if (c->zip != pass) continue;
            const char *name = tm_tensor_name(c->t);
            size_t name_len = strlen(name);
            int nd;
            int64_t shape[TM_MAX_DIMS];
            logical_shape(c->t, &nd, shape);
            put_u16(p, (uint16_t)name_len), p += 2;
            memcpy(p, name, name_len), p += name_len;
            *p++ = (unsigned char)tm_tensor_dtype(c->t);
            *p++ = (unsigned char)nd;
            *p++ = (unsigned char)(c->zip ? CK_ENC_ZLIB : CK_ENC_RAW);
            *p++ = 0;
            for (int a = 0; a < nd; a++) put_u64(p, (uint64_t)shape[a]), p += 8;
            put_u64(p, (uint64_t)c->raw), p += 8;
            put_u64(p, (uint64_t)c->stored), p += 8;
            put_u64(p, c->off), p += 8;
            put_u32(p, c->crc), p += 4;
        }
    memcpy(p, ck_end, 8);
    put_u32(p + 8, crc_update(0, index, index_len));
    unsigned char h[CK_V2_HEADER];
    memset(h, 0, sizeof h);
    memcpy(h, ck_magic, 8);
    put_u32(h + 8, CK_VERSION);
    put_u32(h + 12, CK_ENDIAN);
    put_u32(h + 16, (uint32_t)n);
    put_u32(h + 20, 0);
    put_u64(h + 24, meta_bytes);
    put_u64(h + 32, end);
    put_u64(h + 40, (uint64_t)index_len);
    put_u64(h + 48, end + index_len + 12);
    put_u32(h + 60, crc_update(0, h, 60));
    if (sv->before_commit) sv->before_commit(tmp, sv->user);
    int err = pwrite_all(fd, index, index_len + 12, end);
    tm__host_free(ctx, index);
    if (!err) err = pwrite_all(fd, h, sizeof h, 0);
    /* (a file the ranks created by name, not by mkstemp, could be longer than this one) */
    if (!err && ftruncate(fd, (off_t)(end + index_len + 12)) != 0) err = errno;
    if (!err && fsync(fd) != 0) err = errno;
    if (close(fd) != 0 && !err) err = errno;
    if (err) return tm__err(ctx, TM_ERR_IO, "%s: cannot write '%s' (via '%s'): %s", fn, path, tmp, strerror(err));
    if (rename(tmp, path) != 0)
        return tm__err(ctx, TM_ERR_IO, "%s: cannot rename '%s' to '%s': %s", fn, tmp, path, strerror(errno));
    sync_dir(path);
    return TM_OK;
}

/* The first failure wins: remember its status and message (the context's message buffer is
 * rewritten by every later error). */
static void ckd_note(tm_ctx *ctx, tm_status *st, char *msg, size_t cap, tm_status s) {
    if (s == TM_OK || *st != TM_OK) return;
    *st = s;
    snprintf(msg, cap, "%s", tm_ctx_errmsg(ctx));
}

static tm_status save_ranks(tm_ctx *ctx, const char *path, const void *meta, size_t meta_bytes,
                            const tm_ckpt_save_options *opt) {
    const char *fn = "tm_ckpt_save";
    int W = tm_comm_size(ctx, TM_COMM_WORLD), me = tm_comm_rank(ctx, TM_COMM_WORLD), n = tm_ctx_num_named(ctx);
    int nth = tm__nthreads(ctx);
    tm_status st = TM_OK, s;
    char msg[CK_ERR_MAX] = "";
    ckd_tensor *x = tm__host_alloc(ctx, sizeof *x * (size_t)(n ? n : 1));
    int64_t *mine = tm__host_alloc(ctx, sizeof(int64_t) * 2 * (size_t)(n ? n : 1));
    int64_t *rg = tm__host_alloc(ctx, sizeof(int64_t) * 2 * (size_t)(n ? n : 1) * (size_t)W);
    int64_t *res = tm__host_alloc(ctx, sizeof(int64_t) * (size_t)(n + 1) * (size_t)W);
    int64_t *snd = tm__host_alloc(ctx, sizeof(int64_t) * (size_t)(n + 1));
    unsigned char *buf = tm__host_alloc(ctx, CK_BATCH);
    if (!x || !mine || !rg || !res || !snd || !buf) {
        /* (small allocations: the other ranks would wait in the first collective) */
        tm__host_free(ctx, x), tm__host_free(ctx, mine), tm__host_free(ctx, rg), tm__host_free(ctx, res);
        tm__host_free(ctx, snd), tm__host_free(ctx, buf);
        return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory planning a save of %d tensors", fn, n);
    }
    memset(x, 0, sizeof *x * (size_t)(n ? n : 1));
    /* A: every rank's range of every tensor spread over the ranks */
    s = ckd_ranges(ctx, opt, x, n, mine, rg);
    if (s != TM_OK) goto out;
    uint64_t data_start = CK_V2_HEADER + (uint64_t)meta_bytes + 4, cursor;
    {
        /* B: the temporary file (rank 0) and the layout of the data, the same on every rank */
        struct {
            int64_t st, meta_bytes;
            char tmp[PATH_MAX];
        } b;
        memset(&b, 0, sizeof b);
        int fd = -1;
        if (me == 0) {
            snprintf(b.tmp, sizeof b.tmp, "%s.tmp.XXXXXX", path);
            fd = mkstemp(b.tmp);
            if (fd < 0) {
                b.st = tm__err(ctx, TM_ERR_IO, "%s: cannot create '%s': %s", fn, b.tmp, strerror(errno));
                ckd_note(ctx, &st, msg, sizeof msg, (tm_status)b.st);
            } else {
                (void)fchmod(fd, 0644);
            }
            b.meta_bytes = (int64_t)meta_bytes;
        }
        s = tm_comm_bcast_host(ctx, TM_COMM_WORLD, 0, &b, sizeof b);
        if (s != TM_OK) {
            if (fd >= 0) close(fd), unlink(b.tmp);
            goto out;
        }
        if (b.st != TM_OK) {
            if (me != 0) st = tm__err(ctx, (tm_status)b.st, "%s: rank 0 failed to create the file for '%s' (%s)", fn, path,
                                      tm_status_str((tm_status)b.st));
            s = st; /* (rank 0's message is the context's already) */
            goto out;
        }
        data_start = CK_V2_HEADER + (uint64_t)b.meta_bytes + 4;
        cursor = ckd_layout(x, n, W, me, rg, data_start);
        uint64_t zcursor = cursor; /* deflated tensors after the raw ones */
        if (me != 0 && st == TM_OK) {
            fd = open(b.tmp, O_WRONLY);
            if (fd < 0)
                ckd_note(ctx, &st, msg, sizeof msg,
                         tm__err(ctx, TM_ERR_IO, "%s: rank %d cannot open '%s' (rank 0's temporary file for '%s'; the "
                                 "ranks must share the directory): %s", fn, me, b.tmp, path, strerror(errno)));
        }
        if (me == 0 && st == TM_OK) {
            int e = meta_bytes ? pwrite_all(fd, meta, meta_bytes, CK_V2_HEADER) : 0;
            unsigned char c4[4];
            put_u32(c4, crc_update(0, meta, meta_bytes));
            if (!e) e = pwrite_all(fd, c4, 4, CK_V2_HEADER + meta_bytes);
            if (e) ckd_note(ctx, &st, msg, sizeof msg,
                            tm__err(ctx, TM_ERR_IO, "%s: cannot write '%s' (via '%s'): %s", fn, path, b.tmp, strerror(e)));
        }
        /* C: rank 0's tensors, in creation order (the gathers of spread ones are collective) */
        z_stream z;
        int zok = 0;
        unsigned char *comp = NULL;
        for (int k = 0; k < n; k++) {
            ckd_tensor *c = &x[k];
            if (c->cls != CKD_RANK0) continue;
            int coll = tm__named_sharded(ctx, c->t);
            if (me != 0 && !coll) continue;
            unsigned char *v = tm__host_alloc(ctx, c->raw ? c->raw : 1);
            s = v ? tm__named_gather(ctx, c->t, v)
                  : tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory for '%s' (%zu bytes)", fn, tm_tensor_name(c->t),
                            c->raw);
            if (s == TM_ERR_COMM) {
                tm__host_free(ctx, v);
                if (fd >= 0) close(fd);
                if (me == 0) unlink(b.tmp);
                if (zok) deflateEnd(&z);
                tm__host_free(ctx, comp);
                goto out;
            }
            ckd_note(ctx, &st, msg, sizeof msg, s);
            if (me == 0 && st == TM_OK && !c->zip) {
                int e = crc_pwrite(fd, v, c->raw, c->off, nth, &c->crc);
                if (e) ckd_note(ctx, &st, msg, sizeof msg, tm__err(ctx, TM_ERR_IO, "%s: cannot write '%s' (via '%s'): %s",
                                                                   fn, path, b.tmp, strerror(e)));
            } else if (me == 0 && st == TM_OK) {
                size_t cl = ck_bound(c->raw);
                if (!zok) zok = ck_deflate_init(ctx, &z) == Z_OK;
                tm__host_free(ctx, comp);
                comp = zok && (uLong)c->raw == c->raw && cl <= UINT_MAX ? tm__host_alloc(ctx, cl) : NULL;
                int zs = comp ? ck_deflate(&z, v, c->raw, comp, &cl) : Z_MEM_ERROR;
                int e = zs == Z_OK ? pwrite_all(fd, comp, cl, zcursor) : 0;
                if (zs != Z_OK)
                    ckd_note(ctx, &st, msg, sizeof msg, tm__err(ctx, zs == Z_MEM_ERROR ? TM_ERR_NOMEM : TM_ERR_INTERNAL,
                                                                "%s: '%s': compressing tensor '%s' failed (zlib %d)", fn,
                                                                path, tm_tensor_name(c->t), zs));
                else if (e)
                    ckd_note(ctx, &st, msg, sizeof msg, tm__err(ctx, TM_ERR_IO, "%s: cannot write '%s' (via '%s'): %s",
                                                                fn, path, b.tmp, strerror(e)));
                c->off = zcursor, c->stored = cl, c->crc = crc_update(0, comp, cl);
                zcursor += cl;
            }
            tm__host_free(ctx, v);
        }
        if (zok) deflateEnd(&z);
        tm__host_free(ctx, comp);
        /* D: this rank's ranges, staged through buf (device to host), CRC and pwrite */
        for (int k = 0; k < n && st == TM_OK; k++) {
            ckd_tensor *c = &x[k];
            if (c->cls != CKD_RANKS || !c->writer) continue;
            size_t es = tm_dtype_size(tm_tensor_dtype(c->t));
            int64_t per = CK_BATCH / (int64_t)es;
            for (int64_t a = 0; a < c->cnt && st == TM_OK; a += per) {
                int64_t m = c->cnt - a < per ? c->cnt - a : per;
                s = tm__named_read_local(ctx, c->t, a, m, buf);
                ckd_note(ctx, &st, msg, sizeof msg, s);
                int e = s == TM_OK ? crc_pwrite(fd, buf, (size_t)m * es, c->off + (uint64_t)(c->lo + a) * es, nth, &c->crc) : 0;
                if (e) ckd_note(ctx, &st, msg, sizeof msg, tm__err(ctx, TM_ERR_IO, "%s: rank %d cannot write its part of "
                                                                   "'%s' (via '%s'): %s", fn, me, path, b.tmp, strerror(e)));
            }
        }
        if (fd >= 0 && me != 0) {
            if (st == TM_OK && fsync(fd) != 0)
                ckd_note(ctx, &st, msg, sizeof msg, tm__err(ctx, TM_ERR_IO, "%s: rank %d cannot fsync its part of '%s' "
                                                            "(via '%s'): %s", fn, me, path, b.tmp, strerror(errno)));
            close(fd);
            fd = -1;
        }
        /* E: every rank's status and the CRC of each of its ranges */
        snd[0] = st;
        for (int k = 0; k < n; k++) snd[k + 1] = x[k].cls == CKD_RANKS && x[k].writer ? (int64_t)x[k].crc : 0;
        s = tm_comm_allgather_host(ctx, TM_COMM_WORLD, snd, res, sizeof(int64_t) * (size_t)(n + 1));
        if (s != TM_OK) {
            if (fd >= 0) close(fd);
            if (me == 0) unlink(b.tmp);
            goto out;
        }
        /* F: rank 0 commits, or removes the file */
        int64_t v = st;
        if (me == 0) {
            for (int r = 1; r < W && v == TM_OK; r++)
                if (res[(size_t)r * (n + 1)] != TM_OK) {
                    v = res[(size_t)r * (n + 1)];
                    st = tm__err(ctx, (tm_status)v, "%s: rank %d failed to write its part of '%s' (%s)", fn, r, path,
                                 tm_status_str((tm_status)v));
                    snprintf(msg, sizeof msg, "%s", tm_ctx_errmsg(ctx));
                }
            if (v == TM_OK) {
                ck_save sv = {.ctx = ctx, .before_commit = opt->before_commit, .user = opt->user};
                v = st = ckd_commit(&sv, x, n, W, rg, res, (size_t)n + 1, path, b.tmp, fd, (uint64_t)meta_bytes,
                                    zcursor);
                fd = -1;
                if (st != TM_OK) snprintf(msg, sizeof msg, "%s", tm_ctx_errmsg(ctx));
            }
            if (fd >= 0) close(fd);
            if (v != TM_OK) unlink(b.tmp);
        }
        s = tm_comm_bcast_host(ctx, TM_COMM_WORLD, 0, &v, sizeof v);
        if (s != TM_OK) goto out;
        if (me != 0 && st == TM_OK && v != TM_OK)
            st = tm__err(ctx, (tm_status)v, "%s: rank 0 failed to write '%s' (%s)", fn, path, tm_status_str((tm_status)v)),
            snprintf(msg, sizeof msg, "%s", tm_ctx_errmsg(ctx));
    }
    s = st;
    if (st != TM_OK) tm__err(ctx, st, "%s", msg); /* the first failure's message */
out:
    tm__host_free(ctx, x), tm__host_free(ctx, mine), tm__host_free(ctx, rg), tm__host_free(ctx, res);
    tm__host_free(ctx, snd), tm__host_free(ctx, buf);
    return s;
}

/* Under a communicator saving is collective: every rank takes part and returns the same status;
 * each rank writes the parts of spread tensors it holds, world rank 0 the rest (save_ranks). */
tm_status tm_ckpt_save_ex(tm_ctx *ctx, const char *path, const void *meta, size_t meta_bytes,
                          const tm_ckpt_save_options *options) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    tm_ckpt_save_options opt = options ? *options : tm_ckpt_save_options_default();
    if ((unsigned)opt.compress > TM_CKPT_COMPRESS_ALL)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_ckpt_save: options->compress is %d (0..2)", (int)opt.compress);
    int W = tm_comm_size(ctx, TM_COMM_WORLD), me = tm_comm_rank(ctx, TM_COMM_WORLD), progress = 0;
    if (W == 1) return save_file(ctx, path, meta, meta_bytes, &opt, &progress);
    tm_status st = save_args(ctx, "tm_ckpt_save", path, meta, meta_bytes);
    if (st == TM_OK && host_little_endian()) return save_ranks(ctx, path, meta, meta_bytes, &opt);
    /* (every rank refuses the same arguments alike; a big-endian host takes the gathered path,
     * which refuses it on rank 0 with the reason) */
    if (me == 0) {
        st = save_file(ctx, path, meta, meta_bytes, &opt, &progress);
        if (st != TM_OK && st != TM_ERR_COMM) {
            char msg[1024]; /* keep the first error's message */
            snprintf(msg, sizeof msg, "%s", tm_ctx_errmsg(ctx));
            drain_gathers(ctx, progress);
            tm__err(ctx, st, "%s", msg);
        }
    } else {
        st = drain_gathers(ctx, 0);
    }
    int64_t v = st;
    tm_status bs = tm_comm_bcast_host(ctx, TM_COMM_WORLD, 0, &v, sizeof v);
    if (bs != TM_OK) return bs;
    if (me != 0 && v != TM_OK)
        return tm__err(ctx, (tm_status)v, "tm_ckpt_save: rank 0 failed to write '%s' (%s)", path ? path : "(null)",
                       tm_status_str((tm_status)v));
    return st;
}

tm_status tm_ckpt_save(tm_ctx *ctx, const char *path, const void *meta, size_t meta_bytes) {
    return tm_ckpt_save_ex(ctx, path, meta, meta_bytes, NULL);
}

/* ---- snapshots: asynchronous saves ----------------------------------------------------- */

/* A snapshot is a planned save whose tensors stay in host memory: taking it is the gather step
 * of a save (device-to-host copies, and under a communicator the collectives), on the context's
 * thread; writing it is the rest (CRC, deflate, pwrite, fsync), which reads nothing of the
 * context, so it may run on another thread while the context trains.
 * One process: sv.snap holds every tensor and write makes the whole file (write_file).
 * Several ranks: each rank holds only what it writes in a save by every rank (save_ranks: its
 * ranges of the spread tensors; world rank 0 also the whole tensors, the gathered and the
 * deflated ones), in `snap`. Write puts that into the ranks' shared temporary file
 * "<path>.tmp.<token>" (the token drawn by rank 0 at take) and fsyncs it; commit, a collective
 * on the context's thread once every rank's write has returned, gathers the statuses and CRCs,
 * and rank 0 writes the index and header, fsyncs and renames (ckd_commit). The writer threads
 * make no collective call: MPI is initialised for calls from the main thread only. */
enum { CKD_MSG_WORDS = 128 }; /* int64 words of each rank's message in a commit's all-gather */

struct tm_ckpt_snapshot {
    ck_save sv;  /* one process: the planned save; several ranks: ctx, n, nth, err, before_commit */
    int W, me;   /* world size and rank */
    int taken;   /* a take succeeded */
    unsigned char *meta; /* world rank 0 */
    size_t meta_bytes, meta_cap;
    char err[CK_ERR_MAX];
    /* several ranks */
    ckd_tensor *x;
    int64_t *rg;                /* [W][n][2]: every rank's range of each spread tensor (fixed) */
    int64_t *snd, *res;         /* a commit's all-gather: [stride], [W][stride] */
    unsigned char *snap, *comp, *scratch; /* scratch: ranks > 0, their end of rank 0's gathers */
    int snap_pinned, zok;
    size_t snap_bytes, comp_cap, scratch_bytes;
    z_stream z;                 /* rank 0, when a tensor is deflated */
    uint64_t zstart, zend;      /* where the deflated tensors start (the last take), end (the last write) */
    char token[8];              /* rank 0's, from the last take */
    char path[PATH_MAX], tmp[PATH_MAX]; /* of the last write */
    int written;                /* a write since the last commit made tmp (or may have): not renamed */
    int wrote;                  /* tm_ckpt_snapshot_write was called since the last commit */
    tm_status wst;              /* its status */
};

/* A write that was never committed: its temporary file goes (every rank that wrote removes it;
 * removing it twice is harmless). */
static void snap_drop_tmp(tm_ckpt_snapshot *s) {
    if (s->written) unlink(s->tmp);
    s->written = 0;
}

/* Several ranks: the plan (who writes what: ckd_ranges, ckd_layout) and this rank's host memory
 * for what it writes. Collective; every rank returns the same status. */
static tm_status snap_new_ranks(tm_ckpt_snapshot *s, const tm_ckpt_save_options *opt) {
    const char *fn = "tm_ckpt_snapshot_new";
    tm_ctx *ctx = s->sv.ctx;
    int n = s->sv.n, W = s->W, me = s->me;
    size_t stride = (size_t)n + 1 + CKD_MSG_WORDS;
    int64_t *mine = tm__host_alloc(ctx, sizeof(int64_t) * 2 * (size_t)(n ? n : 1));
    s->x = tm__host_alloc(ctx, sizeof *s->x * (size_t)(n ? n : 1));
    s->rg = tm__host_alloc(ctx, sizeof(int64_t) * 2 * (size_t)(n ? n : 1) * (size_t)W);
    s->snd = tm__host_alloc(ctx, sizeof(int64_t) * stride);
    s->res = tm__host_alloc(ctx, sizeof(int64_t) * stride * (size_t)W);
    if (!mine || !s->x || !s->rg || !s->snd || !s->res) {
        /* (small allocations, as in save_ranks: the other ranks would wait in the first collective) */
        tm__host_free(ctx, mine);
        return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory planning a snapshot of %d tensors", fn, n);
    }
    memset(s->x, 0, sizeof *s->x * (size_t)(n ? n : 1));
    tm_status st = ckd_ranges(ctx, opt, s->x, n, mine, s->rg);
    tm__host_free(ctx, mine);
    if (st != TM_OK) return st;
    ckd_layout(s->x, n, W, me, s->rg, 0);
    size_t goff = 0;
    int any_zip = 0;
    for (int k = 0; k < n; k++) {
        ckd_tensor *c = &s->x[k];
        /* (the same on every rank: logical sizes) */
        if (c->zip && (compressBound((uLong)c->raw) > UINT_MAX || (uLong)c->raw != c->raw))
            return tm__err(ctx, TM_ERR_UNSUPPORTED,
                           "%s: tensor '%s' of %zu bytes exceeds zlib's 4 GiB limit for one deflate call; store it "
                           "uncompressed (tm_ckpt_save_options)", fn, c->name, c->raw);
        if (c->cls == CKD_RANK0) {
            c->held = me == 0 ? c->raw : 0;
            if (me != 0 && tm__named_sharded(ctx, c->t) && c->raw > s->scratch_bytes) s->scratch_bytes = c->raw;
            if (me == 0 && c->zip) {
                any_zip = 1;
                if (ck_bound(c->raw) > s->comp_cap) s->comp_cap = ck_bound(c->raw);
            }
        } else {
            c->held = c->writer ? (size_t)c->cnt * c->es : 0;
        }
        c->goff = goff;
        goff += (c->held + 63) & ~(size_t)63; /* 64-byte aligned slots */
    }
    s->snap_bytes = goff;
    tm_status a = TM_OK;
    s->snap = tm__host_alloc_pinned(ctx, goff ? goff : 1, &s->snap_pinned);
    if (s->scratch_bytes) s->scratch = tm__host_alloc(ctx, s->scratch_bytes);
    if (any_zip) s->comp = tm__host_alloc(ctx, s->comp_cap);
    if (!s->snap || (s->scratch_bytes && !s->scratch) || (any_zip && !s->comp)) {
        a = tm__err(ctx, TM_ERR_NOMEM, "%s: rank %d cannot allocate %zu bytes of host memory for its part of the snapshot",
                    fn, me, goff + s->scratch_bytes + s->comp_cap);
    } else if (any_zip) {
        int zs = ck_deflate_init(ctx, &s->z); /* zlib allocates here, on this thread only */
        if (zs == Z_OK) s->zok = 1;
        else a = tm__err(ctx, zs == Z_MEM_ERROR ? TM_ERR_NOMEM : TM_ERR_INTERNAL, "%s: zlib deflateInit failed (%d)", fn, zs);
    }
    /* every rank returns the same status */
    int64_t v = a;
    st = tm_comm_allgather_host(ctx, TM_COMM_WORLD, &v, s->res, sizeof v);
    if (st != TM_OK) return st;
    for (int r = 0; r < W && a == TM_OK; r++)
        if (s->res[r] != TM_OK)
            a = tm__err(ctx, (tm_status)s->res[r], "%s: rank %d could not allocate its part of the snapshot (%s)", fn, r,
                        tm_status_str((tm_status)s->res[r]));
    return a;
}

/* A name for the ranks' temporary file that rank 0 draws at each take: 6 letters or digits,
 * like mkstemp's (the driver's sweep of stale temporaries matches "<name>.tmp.*"). */
static void snap_token(const tm_ckpt_snapshot *s, char out[8]) {
    static const char a[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t v = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 17) ^ (uint64_t)(uintptr_t)s;
    /* splitmix64's finaliser */
    v += 0x9e3779b97f4a7c15ull;
    v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
    v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
    v ^= v >> 31;
    for (int i = 0; i < 6; i++) out[i] = a[v % 62], v /= 62;
    out[6] = out[7] = 0;
}

/* Several ranks: rank 0's tensors (the gathers of spread ones collective, in creation order),
 * every rank's own ranges, then the agreement on the statuses, rank 0's meta length and token. */
static tm_status snap_take_ranks(tm_ckpt_snapshot *s, const void *meta, size_t meta_bytes) {
    const char *fn = "tm_ckpt_snapshot_take";
    tm_ctx *ctx = s->sv.ctx;
    int n = s->sv.n, W = s->W, me = s->me;
    tm_status st = TM_OK;
    char msg[CK_ERR_MAX] = "";
    snap_drop_tmp(s); /* the last write, if it was never committed */
    s->wrote = 0;
    if (me == 0 && meta_bytes > s->meta_cap) {
        unsigned char *m = tm__host_alloc(ctx, meta_bytes);
        if (!m) {
            ckd_note(ctx, &st, msg, sizeof msg,
                     tm__err(ctx, TM_ERR_NOMEM, "%s: cannot allocate %zu bytes for the meta", fn, meta_bytes));
        } else {
            tm__host_free(ctx, s->meta);
            s->meta = m;
            s->meta_cap = meta_bytes;
        }
    }
    for (int k = 0; k < n; k++) {
        ckd_tensor *c = &s->x[k];
        if (c->cls != CKD_RANK0) continue;
        int coll = tm__named_sharded(ctx, c->t);
        if (!coll && (me != 0 || st != TM_OK)) continue;
        tm_status g = tm__named_gather(ctx, c->t, me == 0 ? s->snap + c->goff : s->scratch);
        if (g == TM_ERR_COMM) return g; /* the partners are gone */
        ckd_note(ctx, &st, msg, sizeof msg, g);
    }
    for (int k = 0; k < n && st == TM_OK; k++) {
        ckd_tensor *c = &s->x[k];
        if (c->cls == CKD_RANKS && c->writer)
            ckd_note(ctx, &st, msg, sizeof msg, tm__named_read_local(ctx, c->t, 0, c->cnt, s->snap + c->goff));
    }
    struct {
        int64_t st, meta_bytes;
        char token[8];
    } mine, *all = (void *)s->res; /* (res holds W * stride >= W * 3 words) */
    memset(&mine, 0, sizeof mine);
    mine.st = st;
    mine.meta_bytes = (int64_t)meta_bytes;
    if (me == 0) snap_token(s, mine.token);
    tm_status cs = tm_comm_allgather_host(ctx, TM_COMM_WORLD, &mine, all, sizeof mine);
    if (cs != TM_OK) return cs;
    if (st != TM_OK) return tm__err(ctx, st, "%s", msg); /* the first failure's message */
    for (int r = 0; r < W; r++)
        if (all[r].st != TM_OK)
            return tm__err(ctx, (tm_status)all[r].st, "%s: rank %d failed to take its part of the snapshot (%s)", fn, r,
                           tm_status_str((tm_status)all[r].st));
    s->zstart = ckd_layout(s->x, n, W, me, s->rg, CK_V2_HEADER + (uint64_t)all[0].meta_bytes + 4);
    memcpy(s->token, all[0].token, sizeof s->token);
    s->token[7] = 0;
    if (me == 0) {
        if (meta_bytes) memcpy(s->meta, meta, meta_bytes);
        s->meta_bytes = meta_bytes;
    }
    return TM_OK;
}

/* Several ranks, on any thread: this rank's part of the file (rank 0: the meta, its whole
 * tensors, the deflated ones after the raw data), fsynced; no collective call. */
static tm_status snap_write_ranks(tm_ckpt_snapshot *s, const char *path, int nth) {
    const char *fn = "tm_ckpt_snapshot_write";
    ck_save *sv = &s->sv;
    int n = sv->n, me = s->me;
    snprintf(s->path, sizeof s->path, "%s", path);
    snprintf(s->tmp, sizeof s->tmp, "%s.tmp.%s", path, s->token);
    s->written = 1; /* from here the temporary file may exist */
    /* Every rank creates it if it is not there yet: no rank waits for another. */
    int fd = open(s->tmp, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return ck_fail(sv, TM_ERR_IO,
                       "%s: rank %d cannot create or open '%s' (the ranks' temporary file for '%s'; the ranks must "
                       "share the directory): %s", fn, me, s->tmp, path, strerror(errno));
    /* a checkpoint is an ordinary file others may read */
    if (me == 0) (void)fchmod(fd, 0644);
    tm_status st = TM_OK;
    int e = 0;
    uint64_t zc = s->zstart;
    if (me == 0) {
        unsigned char c4[4];
        if (s->meta_bytes) e = pwrite_all(fd, s->meta, s->meta_bytes, CK_V2_HEADER);
        put_u32(c4, crc_update(0, s->meta, s->meta_bytes));
        if (!e) e = pwrite_all(fd, c4, 4, CK_V2_HEADER + s->meta_bytes);
        for (int k = 0; k < n && !e && st == TM_OK; k++) {
            ckd_tensor *c = &s->x[k];
            if (c->cls != CKD_RANK0) continue;
            if (!c->zip) {
                c->crc = 0;
                e = crc_pwrite(fd, s->snap + c->goff, c->raw, c->off, nth, &c->crc);
                continue;
            }
            size_t cl = s->comp_cap;
            int zs = ck_deflate(&s->z, s->snap + c->goff, c->raw, s->comp, &cl);
            if (zs != Z_OK) {
                st = ck_fail(sv, zs == Z_MEM_ERROR ? TM_ERR_NOMEM : TM_ERR_INTERNAL,
                             "%s: '%s': compressing tensor '%s' failed (zlib %d)", fn, path, c->name, zs);
                break;
            }
            e = pwrite_all(fd, s->comp, cl, zc);
            c->off = zc, c->stored = cl, c->crc = crc_update(0, s->comp, cl);
            zc += cl;
        }
    }
    for (int k = 0; k < n && !e && st == TM_OK; k++) {
        ckd_tensor *c = &s->x[k];
        if (c->cls != CKD_RANKS || !c->writer) continue;
        c->crc = 0;
        e = crc_pwrite(fd, s->snap + c->goff, (size_t)c->cnt * c->es, c->off + (uint64_t)c->lo * c->es, nth, &c->crc);
    }
    s->zend = zc;
    if (st == TM_OK && !e && sv->before_commit) sv->before_commit(s->tmp, sv->user);
    if (st == TM_OK && !e && fsync(fd) != 0) e = errno;
    if (close(fd) != 0 && !e) e = errno;
    if (st == TM_OK && e)
        st = ck_fail(sv, TM_ERR_IO, "%s: rank %d cannot write its part of '%s' (via '%s'): %s", fn, me, path, s->tmp,
                     strerror(e));
    return st;
}

tm_status tm_ckpt_snapshot_new(tm_ctx *ctx, const tm_ckpt_save_options *options, tm_ckpt_snapshot **out) {
    const char *fn = "tm_ckpt_snapshot_new";
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: out is NULL", fn);
    *out = NULL;
    tm_ckpt_save_options opt = options ? *options : tm_ckpt_save_options_default();
    if ((unsigned)opt.compress > TM_CKPT_COMPRESS_ALL)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: options->compress is %d (0..2)", fn, (int)opt.compress);
    tm_ckpt_snapshot *s = tm__host_alloc(ctx, sizeof *s);
    if (!s) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    memset(s, 0, sizeof *s);
    s->W = tm_comm_size(ctx, TM_COMM_WORLD);
    s->me = tm_comm_rank(ctx, TM_COMM_WORLD);
    tm_status st;
    if (s->W == 1) {
        st = plan_save(ctx, fn, &opt, 1, &s->sv);
    } else if (!host_little_endian()) {
        st = tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: big-endian hosts are not supported", fn);
    } else {
        s->sv.ctx = ctx;
        s->sv.n = tm_ctx_num_named(ctx);
        s->sv.nth = tm__nthreads(ctx);
        s->sv.before_commit = opt.before_commit;
        s->sv.user = opt.user;
        st = snap_new_ranks(s, &opt);
    }
    s->sv.err = s->err;
    s->sv.err_cap = sizeof s->err;
    if (st != TM_OK) {
        tm_ckpt_snapshot_free(s);
        return st;
    }
    *out = s;
    return TM_OK;
}

uint64_t tm_ckpt_snapshot_bytes(const tm_ckpt_snapshot *s) {
    if (!s) return 0;
    if (s->W == 1) return (uint64_t)s->sv.held + s->meta_cap;
    return (uint64_t)s->snap_bytes + s->comp_cap + s->scratch_bytes + s->meta_cap;
}

/* One process: every tensor into the snapshot's buffer. */
static tm_status snapshot_gather(tm_ckpt_snapshot *s) {
    ck_save *sv = &s->sv;
    for (int k = 0; k < sv->n; k++) TM__TRY(tm__named_gather(sv->ctx, sv->o[k].t, sv->snap + sv->o[k].goff));
    return TM_OK;
}

tm_status tm_ckpt_snapshot_take(tm_ckpt_snapshot *s, const void *meta, size_t meta_bytes) {
    const char *fn = "tm_ckpt_snapshot_take";
    if (!s) return TM_ERR_INVALID_ARG;
    tm_ctx *ctx = s->sv.ctx;
    s->taken = 0;
    if (!meta && meta_bytes)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: meta is NULL but meta_bytes is %zu", fn, meta_bytes);
    int same = tm_ctx_num_named(ctx) == s->sv.n;
    for (int k = 0; same && k < s->sv.n; k++) same = tm_ctx_named(ctx, k) == (s->W == 1 ? s->sv.o[k].t : s->x[k].t);
    if (!same)
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "%s: the context's parameters and buffers changed since tm_ckpt_snapshot_new (%d tensors then, "
                       "%d now): make a new snapshot",
                       fn, s->sv.n, tm_ctx_num_named(ctx));
    if (s->W > 1) {
        tm_status st = snap_take_ranks(s, meta, meta_bytes);
        s->taken = st == TM_OK;
        return st;
    }
    if (meta_bytes > s->meta_cap) {
        unsigned char *m = tm__host_alloc(ctx, meta_bytes);
        if (!m) return tm__err(ctx, TM_ERR_NOMEM, "%s: cannot allocate %zu bytes for the meta", fn, meta_bytes);
        tm__host_free(ctx, s->meta);
        s->meta = m;
        s->meta_cap = meta_bytes;
    }
    TM__TRY(snapshot_gather(s));
    if (meta_bytes) memcpy(s->meta, meta, meta_bytes);
    s->meta_bytes = meta_bytes;
    s->taken = 1;
    return TM_OK;
}

tm_status tm_ckpt_snapshot_write(tm_ckpt_snapshot *s, const char *path, int num_threads) {
    if (!s) return TM_ERR_INVALID_ARG;
    s->err[0] = '\0';
    const char *fn = "tm_ckpt_snapshot_write";
    tm_status st;
    if (!path || !*path) st = ck_fail(&s->sv, TM_ERR_INVALID_ARG, "%s: path is NULL or empty", fn);
    else if (strlen(path) + 11 >= PATH_MAX) st = ck_fail(&s->sv, TM_ERR_INVALID_ARG, "%s: path '%s' is too long", fn, path);
    else if (num_threads < 0)
        st = ck_fail(&s->sv, TM_ERR_INVALID_ARG, "%s: num_threads is %d (>= 0; 0: the context's)", fn, num_threads);
    else if (!s->taken)
        st = ck_fail(&s->sv, TM_ERR_INVALID_ARG, "%s: '%s': nothing to write (no successful tm_ckpt_snapshot_take)", fn,
                     path);
    else if (s->W == 1)
        return write_file(&s->sv, path, s->meta, s->meta_bytes, num_threads > 0 ? num_threads : s->sv.nth, NULL);
    else {
        snap_drop_tmp(s); /* written again before a commit */
        st = snap_write_ranks(s, path, num_threads > 0 ? num_threads : s->sv.nth);
    }
    if (s->W > 1) s->wrote = 1, s->wst = st; /* the commit reports it, on every rank */
    return st;
}

tm_status tm_ckpt_snapshot_commit(tm_ckpt_snapshot *s) {
    const char *fn = "tm_ckpt_snapshot_commit";
    if (!s) return TM_ERR_INVALID_ARG;
    if (s->W == 1) return TM_OK;
    tm_ctx *ctx = s->sv.ctx;
    int n = s->sv.n, W = s->W, me = s->me;
    size_t stride = (size_t)n + 1 + CKD_MSG_WORDS;
    int64_t *snd = s->snd;
    char *m = (char *)(snd + n + 1);
    memset(snd, 0, sizeof(int64_t) * stride);
    if (!s->wrote) {
        snd[0] = TM_ERR_INVALID_ARG;
        snprintf(m, CKD_MSG_WORDS * 8, "no tm_ckpt_snapshot_write on rank %d since the last commit", me);
    } else {
        snd[0] = s->wst;
        size_t ml = strnlen(s->err, CKD_MSG_WORDS * 8 - 1); /* (cut to fit) */
        memcpy(m, s->err, ml);
        m[ml] = 0;
    }
    for (int k = 0; k < n; k++)
        snd[k + 1] = s->x[k].cls == CKD_RANKS && s->x[k].writer ? (int64_t)s->x[k].crc : 0;
    tm_status cs = tm_comm_allgather_host(ctx, TM_COMM_WORLD, snd, s->res, sizeof(int64_t) * stride);
    if (cs != TM_OK) return cs;
    int bad = -1;
    for (int r = 0; r < W && bad < 0; r++)
        if (s->res[(size_t)r * stride] != TM_OK) bad = r;
    int64_t v = bad >= 0 ? s->res[(size_t)bad * stride] : TM_OK;
    tm_status out = TM_OK;
    if (me == 0 && v == TM_OK) {
        int fd = open(s->tmp, O_WRONLY | O_CLOEXEC);
        if (fd < 0)
            out = tm__err(ctx, TM_ERR_IO, "%s: cannot open '%s' to finish '%s': %s", fn, s->tmp, s->path, strerror(errno));
        else {
            ck_save c = {.ctx = ctx};
            out = ckd_commit(&c, s->x, n, W, s->rg, s->res, stride, s->path, s->tmp, fd, (uint64_t)s->meta_bytes, s->zend);
        }
        v = out;
    }
    cs = tm_comm_bcast_host(ctx, TM_COMM_WORLD, 0, &v, sizeof v);
    if (v != TM_OK || cs != TM_OK) snap_drop_tmp(s);
    s->written = s->wrote = 0;
    if (cs != TM_OK) return cs;
    if (v == TM_OK || out != TM_OK) return out; /* (rank 0's own failure: its message is the context's) */
    if (bad >= 0) {
        const char *bm = (const char *)(s->res + (size_t)bad * stride + n + 1);
        char b[CKD_MSG_WORDS * 8];
        size_t bl = strnlen(bm, sizeof b - 1);
        memcpy(b, bm, bl);
        b[bl] = 0;
        return tm__err(ctx, (tm_status)v, "%s: rank %d failed to write its part of the checkpoint (%s): %s", fn, bad,
                       tm_status_str((tm_status)v), b);
    }
    return tm__err(ctx, (tm_status)v, "%s: rank 0 failed to finish the checkpoint '%s' (%s)", fn, s->path,
                   tm_status_str((tm_status)v));
}

const char *tm_ckpt_snapshot_errmsg(const tm_ckpt_snapshot *s) { return s ? s->err : ""; }

void tm_ckpt_snapshot_free(tm_ckpt_snapshot *s) {
    if (!s) return;
    tm_ctx *ctx = s->sv.ctx;
    if (s->W == 1) {
        save_free(ctx, &s->sv);
    } else {
        snap_drop_tmp(s);
        if (s->zok) deflateEnd(&s->z);
        tm__host_free_pinned(ctx, s->snap, s->snap_pinned);
        tm__host_free(ctx, s->comp);
        tm__host_free(ctx, s->scratch);
        tm__host_free(ctx, s->x);
        tm__host_free(ctx, s->rg);
        tm__host_free(ctx, s->snd);
        tm__host_free(ctx, s->res);
    }
    tm__host_free(ctx, s->meta);
    tm__host_free(ctx, s);
}

/* ---- loading and inspecting ------------------------------------------------------------ */

/* One record as parsed from the file. */
typedef struct ck_rec {
    const unsigned char *name;
    size_t name_len;
    int dtype, ndim, enc;
    int64_t shape[TM_MAX_DIMS];
    uint64_t raw_len, comp_len; /* comp_len: the stored bytes (= raw_len for raw tensors) */
    uint64_t off;               /* version 2: the data's offset in the file */
    uint32_t crc;
    const unsigned char *data; /* the stored bytes in host memory, once read */
    size_t boff;               /* version 2: offset in the data buffer; SIZE_MAX: not read */
    tm_tensor *t; /* the context's tensor of that name; NULL: skipped (TM_CKPT_SKIP_UNKNOWN) */
} ck_rec;

/* A parsed file: header fields, meta and the record table. Version 1 files are read whole
 * into img (they have no index); version 2 files keep meta and index in img and read the data
 * of the records asked for into dbuf. */
typedef struct ck_image {
    const char *fn, *path;
    int fd;
    unsigned char *img;
    size_t len; /* the file's size */
    uint32_t version, n;
    const unsigned char *meta;
    uint64_t meta_len;
    ck_rec *rec; /* [n] */
    unsigned char *dbuf;
} ck_image;

static void image_free(tm_ctx *ctx, ck_image *im) {
    tm__host_free(ctx, im->rec);
    tm__host_free(ctx, im->img);
    tm__host_free(ctx, im->dbuf);
    if (im->fd >= 0) close(im->fd);
    im->rec = NULL;
    im->img = NULL;
    im->dbuf = NULL;
    im->fd = -1;
}

static tm_status open_file(tm_ctx *ctx, ck_image *im) {
    const char *fn = im->fn, *path = im->path;
    im->fd = open(path, O_RDONLY);
    if (im->fd < 0) return tm__err(ctx, TM_ERR_IO, "%s: cannot open '%s': %s", fn, path, strerror(errno));
    struct stat sb;
    if (fstat(im->fd, &sb) != 0) return tm__err(ctx, TM_ERR_IO, "%s: cannot stat '%s': %s", fn, path, strerror(errno));
    if (!S_ISREG(sb.st_mode)) return tm__err(ctx, TM_ERR_IO, "%s: '%s' is not a regular file", fn, path);
    im->len = (size_t)sb.st_size;
    return TM_OK;
}

/* n bytes at off of the open file into a new host block *out. */
static tm_status read_range(tm_ctx *ctx, ck_image *im, uint64_t off, size_t n, unsigned char **out) {
    unsigned char *b = tm__host_alloc(ctx, n ? n : 1);
    if (!b) return tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': cannot allocate %zu bytes", im->fn, im->path, n);
    int e = pread_all(im->fd, b, n, off);
    if (e) {
        tm__host_free(ctx, b);
        return tm__err(ctx, TM_ERR_IO, "%s: cannot read '%s': %s", im->fn, im->path,
                       e > 0 ? strerror(e) : "file shrank while reading");
    }
    *out = b;
    return TM_OK;
}

static tm_status truncated(tm_ctx *ctx, const ck_image *im, const char *what) {
    return tm__err(ctx, TM_ERR_IO, "%s: '%s' is truncated (%zu bytes) in %s", im->fn, im->path, im->len, what);
}

/* The checks of a record's dtype and shape against its raw length (both versions). */
static tm_status check_rec_shape(tm_ctx *ctx, const ck_image *im, const ck_rec *r) {
    if (r->dtype >= TM_NDTYPES)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: tensor '%.*s' has dtype code %d", im->fn, im->path,
                       (int)r->name_len, (const char *)r->name, r->dtype);
    uint64_t numel = 1;
    int ok = 1;
    for (int d = 0; d < r->ndim && ok; d++) {
        ok = r->shape[d] >= 0 && (r->shape[d] == 0 || numel <= UINT64_MAX / (uint64_t)r->shape[d]);
        if (ok) numel *= (uint64_t)r->shape[d];
    }
    if (!ok || numel > UINT64_MAX / tm_dtype_size((tm_dtype)r->dtype) ||
        numel * tm_dtype_size((tm_dtype)r->dtype) != r->raw_len)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: tensor '%.*s' claims %llu bytes for its shape %s", im->fn,
                       im->path, (int)r->name_len, (const char *)r->name, (unsigned long long)r->raw_len,
                       tm__sdesc(ctx, r->ndim, r->shape));
    return TM_OK;
}

/* Walk the records: bounds, the end marker, the table CRC, every data CRC. Purely structural,
 * so that a corrupted descriptor is reported as corruption, not as the unknown name it may
 * spell. */
static tm_status parse_records(tm_ctx *ctx, ck_image *im, size_t off) {
    const char *fn = im->fn, *path = im->path;
    const unsigned char *img = im->img;
    size_t len = im->len;
    uint32_t tcrc = 0;
    for (uint32_t i = 0; i < im->n; i++) {
        ck_rec *r = &im->rec[i];
        size_t start = off;
        if (len - off < 2) return truncated(ctx, im, "a tensor record");
        r->name_len = get_u16(img + off), off += 2;
        if (r->name_len == 0 || r->name_len > CK_NAME_MAX)
            return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: tensor record %u has a name of %zu bytes",
                           fn, path, i, r->name_len);
        if (len - off < r->name_len + 2) return truncated(ctx, im, "a tensor record");
        r->name = img + off, off += r->name_len;
        r->dtype = img[off++];
        r->ndim = img[off++];
        if (r->ndim > TM_MAX_DIMS)
            return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: tensor record %u has %d dims", fn, path,
                           i, r->ndim);
        if (len - off < (size_t)r->ndim * 8 + 20) return truncated(ctx, im, "a tensor record");
        for (int d = 0; d < r->ndim; d++) r->shape[d] = (int64_t)get_u64(img + off), off += 8;
        r->raw_len = get_u64(img + off), off += 8;
        r->comp_len = get_u64(img + off), off += 8;
        r->crc = get_u32(img + off), off += 4;
        tcrc = crc_update(tcrc, img + start, off - start);
        if (r->comp_len > len - off) return truncated(ctx, im, "tensor data");
        r->data = img + off;
        r->enc = CK_ENC_ZLIB;
        r->boff = SIZE_MAX;
        r->t = NULL;
        off += (size_t)r->comp_len;
    }
    if (len - off < 12) return truncated(ctx, im, "the end marker");
    if (memcmp(img + off, ck_end, 8) != 0)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: end marker missing after %u tensors", fn,
                       path, im->n);
    if (get_u32(img + off + 8) != tcrc)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the tensor table", fn, path);
    if (off + 12 != len)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: %zu stray bytes after the end marker", fn,
                       path, len - off - 12);
    for (uint32_t i = 0; i < im->n; i++) {
        const ck_rec *r = &im->rec[i];
        if (crc_update(0, r->data, (size_t)r->comp_len) != r->crc)
            return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the data of tensor '%.*s'",
                           fn, path, (int)r->name_len, (const char *)r->name);
        TM__TRY(check_rec_shape(ctx, im, r));
    }
    return TM_OK;
}

/* Version 1: the whole file in host memory, validated structurally: header, meta, records,
 * CRCs. im->version is known; the magic has been checked. */
static tm_status parse_image_v1(tm_ctx *ctx, ck_image *im) {
    const char *fn = im->fn, *path = im->path;
    if (im->len < CK_HEADER_BYTES) return truncated(ctx, im, "the header");
    TM__TRY(read_range(ctx, im, 0, im->len, &im->img));
    const unsigned char *img = im->img;
    size_t len = im->len;
    if (get_u32(img + 28) != crc_update(0, img, 28))
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the header", fn, path);
    uint32_t endian = get_u32(img + 12);
    if (endian != CK_ENDIAN)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: '%s' has endianness marker 0x%08x, expected 0x%08x",
                       fn, path, endian, CK_ENDIAN);
    im->n = get_u32(img + 16);
    im->meta_len = get_u64(img + 20);
    size_t off = CK_HEADER_BYTES;
    if (im->meta_len > len - off || len - off - (size_t)im->meta_len < 4) return truncated(ctx, im, "the meta blob");
    if (get_u32(img + off + im->meta_len) != crc_update(0, img + off, (size_t)im->meta_len))
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the meta blob", fn, path);
    im->meta = img + off;
    off += (size_t)im->meta_len + 4;
    /* Each record takes at least 2 + 1 + 2 + 20 bytes: a bound on n before allocating. */
    if (im->n > (len - off) / 25) return truncated(ctx, im, "the tensor table");
    im->rec = tm__host_alloc(ctx, (im->n ? im->n : 1) * sizeof *im->rec);
    if (!im->rec) return tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': out of memory for %u records", fn, path, im->n);
    return parse_records(ctx, im, off);
}


/* Version 2: header (64 bytes, already in h), meta and index read and validated; the tensor
 * data is not read here. The index must tile the data area exactly, in order. */
static tm_status parse_v2(tm_ctx *ctx, ck_image *im, const unsigned char *h) {
    const char *fn = im->fn, *path = im->path;
    im->n = get_u32(h + 16);
    uint32_t flags = get_u32(h + 20), reserved = get_u32(h + 56);
    im->meta_len = get_u64(h + 24);
    uint64_t index_off = get_u64(h + 32), index_len = get_u64(h + 40), file_len = get_u64(h + 48);
    uint32_t endian = get_u32(h + 12);
    if (endian != CK_ENDIAN)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: '%s' has endianness marker 0x%08x, expected 0x%08x", fn, path,
                       endian, CK_ENDIAN);
    if (flags || reserved)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: '%s' sets header flags 0x%08x / 0x%08x this build does not know",
                       fn, path, flags, reserved);
    if (file_len > im->len) return truncated(ctx, im, "the tensor data (its header gives a longer file)");
    if (file_len < im->len)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: %llu stray bytes after the end marker", fn, path,
                       (unsigned long long)(im->len - file_len));
    uint64_t data_start = CK_V2_HEADER + im->meta_len + 4;
    if (im->meta_len > file_len || data_start > index_off || index_off > file_len || index_len > file_len ||
        index_off + index_len + 12 != file_len || im->n > index_len / 28)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: header places meta (%llu bytes) and index (%llu bytes "
                       "at %llu) outside the file's %llu bytes", fn, path, (unsigned long long)im->meta_len,
                       (unsigned long long)index_len, (unsigned long long)index_off, (unsigned long long)file_len);
    /* meta and its CRC, then index and end marker: one block */
    size_t ml = (size_t)im->meta_len, il = (size_t)index_len;
    im->img = tm__host_alloc(ctx, ml + 4 + il + 12);
    if (!im->img) return tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': cannot allocate %zu bytes", fn, path, ml + il + 16);
    int e = pread_all(im->fd, im->img, ml + 4, CK_V2_HEADER);
    if (!e) e = pread_all(im->fd, im->img + ml + 4, il + 12, index_off);
    if (e)
        return tm__err(ctx, TM_ERR_IO, "%s: cannot read '%s': %s", fn, path, e > 0 ? strerror(e) : "file shrank while reading");
    if (get_u32(im->img + ml) != crc_update(0, im->img, ml))
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the meta blob", fn, path);
    im->meta = im->img;
    const unsigned char *x = im->img + ml + 4;
    if (memcmp(x + il, ck_end, 8) != 0)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: end marker missing after the index", fn, path);
    if (get_u32(x + il + 8) != crc_update(0, x, il))
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the tensor index", fn, path);
    im->rec = tm__host_alloc(ctx, (im->n ? im->n : 1) * sizeof *im->rec);
    if (!im->rec) return tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': out of memory for %u records", fn, path, im->n);
    size_t off = 0;
    uint64_t cursor = data_start;
    for (uint32_t i = 0; i < im->n; i++) {
        ck_rec *r = &im->rec[i];
        memset(r, 0, sizeof *r);
        r->boff = SIZE_MAX;
        if (il - off < 2) goto bad;
        r->name_len = get_u16(x + off), off += 2;
        if (r->name_len == 0 || r->name_len > CK_NAME_MAX || il - off < r->name_len + 4) goto bad;
        r->name = x + off, off += r->name_len;
        r->dtype = x[off++];
        r->ndim = x[off++];
        r->enc = x[off++];
        int pad = x[off++];
        if (r->ndim > TM_MAX_DIMS || pad || (r->enc != CK_ENC_RAW && r->enc != CK_ENC_ZLIB) ||
            il - off < (size_t)r->ndim * 8 + 28)
            goto bad;
        for (int d = 0; d < r->ndim; d++) r->shape[d] = (int64_t)get_u64(x + off), off += 8;
        r->raw_len = get_u64(x + off), off += 8;
        r->comp_len = get_u64(x + off), off += 8;
        r->off = get_u64(x + off), off += 8;
        r->crc = get_u32(x + off), off += 4;
        if (r->off != cursor || r->comp_len > index_off - cursor || (r->enc == CK_ENC_RAW && r->comp_len != r->raw_len))
            goto bad;
        cursor += r->comp_len;
        TM__TRY(check_rec_shape(ctx, im, r));
    }
    if (off != il || cursor != index_off) goto bad;
    return TM_OK;
bad:
    return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: the tensor index does not describe the file's data", fn, path);
}

/* Open the file and validate what every use needs: version 1, the whole file (structure and
 * every CRC); version 2, header, meta and index (their CRCs, the index tiling the data). */
static tm_status parse_file(tm_ctx *ctx, ck_image *im) {
    const char *fn = im->fn, *path = im->path;
    TM__TRY(open_file(ctx, im));
    unsigned char h[CK_V2_HEADER];
    size_t hn = im->len < sizeof h ? im->len : sizeof h;
    int e = pread_all(im->fd, h, hn, 0);
    if (e) return tm__err(ctx, TM_ERR_IO, "%s: cannot read '%s': %s", fn, path, e > 0 ? strerror(e) : "file shrank while reading");
    if (hn < 8) return truncated(ctx, im, "the header");
    if (memcmp(h, ck_magic, 8) != 0)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is not a tinymoe checkpoint (bad magic)", fn, path);
    if (hn < 12) return truncated(ctx, im, "the header");
    im->version = get_u32(h + 8);
    if (im->version == CK_VERSION_V1) return parse_image_v1(ctx, im);
    if (hn < CK_V2_HEADER) return truncated(ctx, im, "the header");
    int crc2 = get_u32(h + 60) == crc_update(0, h, 60);
    if (im->version != CK_VERSION && (crc2 || get_u32(h + 28) == crc_update(0, h, 28)))
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "%s: '%s' has format version %u; this build reads versions %u and %u (a newer tinymoe wrote it: "
                       "load it with that build, or save it again there)",
                       fn, path, im->version, CK_VERSION_V1, CK_VERSION);
    if (!crc2) return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the header", fn, path);
    return parse_v2(ctx, im, h);
}

/* Version 2: read the stored bytes of the records asked for (all, or those with a tensor of
 * the context) into one host buffer, several threads each reading and checksumming CK_CHUNK
 * pieces, and check every record's CRC. Version 1 files are in memory and checked already. */
static tm_status read_records(tm_ctx *ctx, ck_image *im, int all) {
    if (im->version == CK_VERSION_V1) return TM_OK;
    const char *fn = im->fn, *path = im->path;
    size_t total = 0, ni = 0;
    for (uint32_t i = 0; i < im->n; i++) {
        ck_rec *r = &im->rec[i];
        if (!all && !r->t) continue;
        r->boff = total;
        total += (size_t)r->comp_len;
        ni += (size_t)(r->comp_len + CK_CHUNK - 1) / CK_CHUNK;
    }
    im->dbuf = tm__host_alloc(ctx, total ? total : 1);
    ck_item *items = tm__host_alloc(ctx, sizeof *items * (ni ? ni : 1));
    if (!im->dbuf || !items) {
        tm__host_free(ctx, items);
        return tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': cannot allocate %zu bytes for the tensor data", fn, path, total);
    }
    size_t k = 0;
    for (uint32_t i = 0; i < im->n; i++) {
        ck_rec *r = &im->rec[i];
        if (r->boff == SIZE_MAX) continue;
        r->data = im->dbuf + r->boff;
        for (uint64_t c = 0; c < r->comp_len; c += CK_CHUNK) {
            size_t len = r->comp_len - c < CK_CHUNK ? (size_t)(r->comp_len - c) : CK_CHUNK;
            items[k++] = (ck_item){.k = (int)i, .src = im->dbuf + r->boff + c, .len = len, .off = r->off + c};
        }
    }
    int fd = im->fd;
#pragma omp parallel for num_threads(tm__nthreads(ctx)) schedule(dynamic) if (ni > 1)
    for (size_t j = 0; j < ni; j++) {
        ck_item *it = &items[j];
        it->err = pread_all(fd, (unsigned char *)it->src, it->len, it->off);
        if (!it->err) it->crc = crc_update(0, it->src, it->len);
    }
    tm_status st = TM_OK;
    for (size_t j = 0; j < ni && st == TM_OK; j++)
        if (items[j].err)
            st = tm__err(ctx, TM_ERR_IO, "%s: cannot read '%s': %s", fn, path,
                         items[j].err > 0 ? strerror(items[j].err) : "file shrank while reading");
    /* each record's CRC from its chunks' */
    for (size_t j = 0, i0 = 0; j < ni && st == TM_OK; j = i0) {
        const ck_rec *r = &im->rec[items[j].k];
        uint32_t crc = items[j].crc;
        for (i0 = j + 1; i0 < ni && items[i0].k == items[j].k; i0++)
            crc = (uint32_t)crc32_combine(crc, items[i0].crc, (z_off_t)items[i0].len);
        if (crc != r->crc)
            st = tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the data of tensor '%.*s'", fn, path,
                         (int)r->name_len, (const char *)r->name);
    }
    for (uint32_t i = 0; i < im->n && st == TM_OK; i++) { /* empty records have no chunk */
        const ck_rec *r = &im->rec[i];
        if (r->boff != SIZE_MAX && r->comp_len == 0 && r->crc != 0)
            st = tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the data of tensor '%.*s'", fn, path,
                         (int)r->name_len, (const char *)r->name);
    }
    tm__host_free(ctx, items);
    return st;
}

/* Every record against the context: name known (or skipped under TM_CKPT_SKIP_UNKNOWN) and
 * unique, dtype and shape equal, and no tensor of the context left out. */
static tm_status match_records(tm_ctx *ctx, ck_image *im, unsigned flags, unsigned char *seen) {
    const char *fn = im->fn, *path = im->path;
    for (uint32_t i = 0; i < im->n; i++) {
        ck_rec *r = &im->rec[i];
        char name[CK_NAME_MAX + 1];
        memcpy(name, r->name, r->name_len);
        name[r->name_len] = '\0';
        int k = strlen(name) == r->name_len ? tm__names_find(ctx, name) : -1;
        if (k < 0) {
            if ((flags & TM_CKPT_SKIP_UNKNOWN) && strlen(name) == r->name_len) continue;
            return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: '%s' holds tensor '%s', unknown in this context",
                           fn, path, name);
        }
        if (seen[k])
            return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: '%s' holds tensor '%s' twice", fn, path, name);
        seen[k] = 1;
        tm_tensor *t = r->t = tm_ctx_named(ctx, k);
        if (r->dtype != (int)tm_tensor_dtype(t))
            return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: '%s': tensor '%s' is %s in the file, %s", fn, path, name,
                           tm_dtype_name((tm_dtype)r->dtype), tm__tdesc(ctx, t));
        int lnd;
        int64_t lshape[TM_MAX_DIMS];
        logical_shape(t, &lnd, lshape);
        int same = r->ndim == lnd;
        for (int d = 0; same && d < r->ndim; d++) same = r->shape[d] == lshape[d];
        if (!same)
            return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: '%s': tensor '%s' has shape %s in the file, %s (logical %s)",
                           fn, path, name, tm__sdesc(ctx, r->ndim, r->shape), tm__tdesc(ctx, t),
                           tm__sdesc(ctx, lnd, lshape));
    }
    for (int k = 0; k < tm_ctx_num_named(ctx); k++)
        if (!seen[k])
            return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: '%s' lacks tensor %s (%s)", fn, path,
                           tm_tensor_name(tm_ctx_named(ctx, k)), tm__tdesc(ctx, tm_ctx_named(ctx, k)));
    return TM_OK;
}

/* A record's raw bytes: the stored ones (raw encoding: *out points at them), or inflated into
 * scratch (which holds raw_len bytes). */
static tm_status rec_bytes(tm_ctx *ctx, const ck_image *im, const ck_rec *r, unsigned char *scratch,
                           const unsigned char **out) {
    if (r->enc == CK_ENC_RAW) {
        *out = r->data;
        return TM_OK;
    }
    size_t got = (size_t)r->raw_len;
    int zs = (uInt)r->comp_len != r->comp_len || (uInt)r->raw_len != r->raw_len
                 ? Z_DATA_ERROR
                 : ck_inflate(ctx, r->data, (size_t)r->comp_len, scratch, &got);
    if (zs == Z_MEM_ERROR)
        return tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': out of memory inflating '%.*s'", im->fn, im->path,
                       (int)r->name_len, (const char *)r->name);
    if (zs != Z_OK || got != r->raw_len)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: tensor '%.*s' does not inflate to %llu bytes (zlib %d)",
                       im->fn, im->path, (int)r->name_len, (const char *)r->name, (unsigned long long)r->raw_len, zs);
    *out = scratch;
    return TM_OK;
}

/* Scratch for inflating: the largest compressed record's raw length among those read. */
static size_t max_inflate_len(const ck_image *im) {
    size_t m = 1;
    for (uint32_t i = 0; i < im->n; i++) {
        const ck_rec *r = &im->rec[i];
        if (r->enc == CK_ENC_ZLIB && r->data && r->raw_len > m) m = (size_t)r->raw_len;
    }
    return m;
}

/* Every compressed record that was read must inflate to its length (a file that does not is
 * corrupt, skipped tensors of version 1 included). */
static tm_status check_inflate(tm_ctx *ctx, const ck_image *im, unsigned char *scratch) {
    for (uint32_t i = 0; i < im->n; i++) {
        const ck_rec *r = &im->rec[i];
        const unsigned char *p;
        if (r->enc == CK_ENC_ZLIB && r->data) TM__TRY(rec_bytes(ctx, im, r, scratch, &p));
    }
    return TM_OK;
}

static tm_status load_checks(tm_ctx *ctx, const char *fn, const char *path) {
    if (!path || !*path) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: path is NULL or empty", fn);
    if (!host_little_endian()) return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: big-endian hosts are not supported", fn);
    return TM_OK;
}

tm_status tm_ckpt_load_flags(tm_ctx *ctx, const char *path, unsigned flags, void *meta, size_t meta_cap,
                             size_t *meta_bytes) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    const char *fn = "tm_ckpt_load";
    TM__TRY(load_checks(ctx, fn, path));
    if (flags & ~(unsigned)TM_CKPT_SKIP_UNKNOWN)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: unknown flags 0x%x", fn, flags & ~(unsigned)TM_CKPT_SKIP_UNKNOWN);
    ck_image im = {.fn = fn, .path = path, .fd = -1};
    unsigned char *seen = NULL, *scratch = NULL;
    tm_status st = parse_file(ctx, &im);
    if (st == TM_OK) {
        size_t n_named = tm_ctx_num_named(ctx) ? (size_t)tm_ctx_num_named(ctx) : 1;
        seen = tm__host_alloc(ctx, n_named);
        if (!seen) st = tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': out of memory", fn, path);
        else memset(seen, 0, n_named);
    }
    if (st == TM_OK) st = match_records(ctx, &im, flags, seen);
    if (st == TM_OK && meta && im.meta_len > meta_cap)
        st = tm__err(ctx, TM_ERR_INVALID_ARG, "%s: '%s' has %llu bytes of meta, meta_cap is %zu", fn, path,
                     (unsigned long long)im.meta_len, meta_cap);
    /* Only the records of the context's tensors are read (version 2): the index names them. */
    if (st == TM_OK) st = read_records(ctx, &im, 0);
    if (st == TM_OK && !(scratch = tm__host_alloc(ctx, max_inflate_len(&im))))
        st = tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': cannot allocate %zu bytes", fn, path, max_inflate_len(&im));
    /* Everything read is checked (CRCs above, inflating here) before the first tensor is
     * written; compressed records are inflated a second time for that: see the top comment. */
    if (st == TM_OK) st = check_inflate(ctx, &im, scratch);
    for (uint32_t i = 0; i < im.n && st == TM_OK; i++) {
        const ck_rec *r = &im.rec[i];
        const unsigned char *src;
        if (!r->t) continue;
        st = rec_bytes(ctx, &im, r, scratch, &src);
        if (st == TM_OK) st = tm__named_scatter(ctx, r->t, src); /* this rank's part of the logical tensor */
    }
    if (st == TM_OK) {
        if (meta && im.meta_len) memcpy(meta, im.meta, (size_t)im.meta_len);
        if (meta_bytes) *meta_bytes = (size_t)im.meta_len;
    }
    tm__host_free(ctx, scratch);
    tm__host_free(ctx, seen);
    image_free(ctx, &im);
    return st;
}

tm_status tm_ckpt_load(tm_ctx *ctx, const char *path, void *meta, size_t meta_cap, size_t *meta_bytes) {
    return tm_ckpt_load_flags(ctx, path, 0, meta, meta_cap, meta_bytes);
}

/* The info of a parsed file; it and everything it points to live in one allocation (plain
 * malloc: it outlives nothing of ctx and is freed without it): entries, then names, then meta. */
static tm_status make_info(tm_ctx *ctx, const ck_image *im, tm_ckpt_info **out) {
    size_t bytes = sizeof(tm_ckpt_info) + (size_t)im->n * sizeof(tm_ckpt_entry) + (size_t)im->meta_len + 1;
    for (uint32_t i = 0; i < im->n; i++) bytes += im->rec[i].name_len + 1;
    unsigned char *blk = malloc(bytes);
    if (!blk) return tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': out of memory", im->fn, im->path);
    tm_ckpt_info *info = (tm_ckpt_info *)blk;
    tm_ckpt_entry *e = (tm_ckpt_entry *)(info + 1);
    char *names = (char *)(e + im->n);
    for (uint32_t i = 0; i < im->n; i++) {
        const ck_rec *r = &im->rec[i];
        memcpy(names, r->name, r->name_len);
        names[r->name_len] = '\0';
        e[i] = (tm_ckpt_entry){.name = names, .dtype = (tm_dtype)r->dtype, .ndim = r->ndim,
                               .raw_bytes = r->raw_len, .stored_bytes = r->comp_len,
                               .offset = im->version == CK_VERSION_V1 ? (uint64_t)(r->data - im->img) : r->off,
                               .compressed = r->enc == CK_ENC_ZLIB};
        memcpy(e[i].shape, r->shape, sizeof r->shape);
        names += r->name_len + 1;
    }
    if (im->meta_len) memcpy(names, im->meta, (size_t)im->meta_len);
    names[im->meta_len] = '\0';
    *info = (tm_ckpt_info){.version = im->version, .file_bytes = im->len, .num_entries = (int)im->n,
                           .entries = e, .meta = names, .meta_bytes = (size_t)im->meta_len};
    *out = info;
    return TM_OK;
}

tm_status tm_ckpt_inspect_flags(tm_ctx *ctx, const char *path, unsigned flags, tm_ckpt_info **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    const char *fn = "tm_ckpt_inspect";
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: out is NULL", fn);
    *out = NULL;
    TM__TRY(load_checks(ctx, fn, path));
    if (flags & ~(unsigned)TM_CKPT_INDEX_ONLY)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: unknown flags 0x%x", fn, flags & ~(unsigned)TM_CKPT_INDEX_ONLY);
    ck_image im = {.fn = fn, .path = path, .fd = -1};
    unsigned char *scratch = NULL;
    tm_status st = parse_file(ctx, &im);
    if (st == TM_OK && !(flags & TM_CKPT_INDEX_ONLY)) {
        st = read_records(ctx, &im, 1);
        if (st == TM_OK && !(scratch = tm__host_alloc(ctx, max_inflate_len(&im))))
            st = tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': cannot allocate %zu bytes", fn, path, max_inflate_len(&im));
        if (st == TM_OK) st = check_inflate(ctx, &im, scratch);
        tm__host_free(ctx, scratch);
    }
    if (st == TM_OK) st = make_info(ctx, &im, out);
    image_free(ctx, &im);
    return st;
}

tm_status tm_ckpt_inspect(tm_ctx *ctx, const char *path, tm_ckpt_info **out) {
    return tm_ckpt_inspect_flags(ctx, path, 0, out);
}

void tm_ckpt_info_free(tm_ckpt_info *info) { free(info); }

/* ---- reading one tensor at a time -------------------------------------------------------- */

struct tm_ckpt_reader {
    tm_ctx *ctx;
    ck_image im;
    tm_ckpt_info *info;
    char path[PATH_MAX];
};

tm_status tm_ckpt_reader_open(tm_ctx *ctx, const char *path, tm_ckpt_reader **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    const char *fn = "tm_ckpt_reader_open";
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: out is NULL", fn);
    *out = NULL;
    TM__TRY(load_checks(ctx, fn, path));
    if (strlen(path) >= PATH_MAX) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: path '%s' is too long", fn, path);
    tm_ckpt_reader *r = tm__host_alloc(ctx, sizeof *r);
    if (!r) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    memset(r, 0, sizeof *r);
    r->ctx = ctx;
    snprintf(r->path, sizeof r->path, "%s", path);
    r->im = (ck_image){.fn = "tm_ckpt_reader", .path = r->path, .fd = -1};
    tm_status st = parse_file(ctx, &r->im);
    if (st == TM_OK) st = make_info(ctx, &r->im, &r->info);
    if (st != TM_OK) {
        tm_ckpt_reader_close(r);
        return st;
    }
    *out = r;
    return TM_OK;
}

const tm_ckpt_info *tm_ckpt_reader_info(const tm_ckpt_reader *r) { return r ? r->info : NULL; }

int tm_ckpt_reader_find(const tm_ckpt_reader *r, const char *name) {
    if (!r || !name) return -1;
    for (int i = 0; i < r->info->num_entries; i++)
        if (!strcmp(r->info->entries[i].name, name)) return i;
    return -1;
}

/* n bytes at off into dst, their CRC into *crc (crc_io). */
static int pread_crc(int fd, unsigned char *dst, size_t n, uint64_t off, int nth, uint32_t *crc) {
    *crc = 0;
    return crc_io(fd, dst, n, off, nth, crc, 1);
}

tm_status tm_ckpt_reader_read(tm_ckpt_reader *r, int entry, void *dst, uint64_t dst_bytes) {
    if (!r) return TM_ERR_INVALID_ARG;
    tm_ctx *ctx = r->ctx;
    const char *fn = "tm_ckpt_reader_read";
    ck_image *im = &r->im;
    if (entry < 0 || (uint32_t)entry >= im->n)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: '%s': entry %d of %u", fn, r->path, entry, im->n);
    ck_rec *rec = &im->rec[entry];
    if (!dst && dst_bytes) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: dst is NULL", fn);
    if (dst_bytes != rec->raw_len)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: '%s': tensor '%s' has %llu bytes, dst_bytes is %llu", fn, r->path,
                       r->info->entries[entry].name, (unsigned long long)rec->raw_len, (unsigned long long)dst_bytes);
    const unsigned char *p;
    if (im->version == CK_VERSION_V1) { /* in memory and checked (parse_image_v1) */
        TM__TRY(rec_bytes(ctx, im, rec, dst, &p));
        if (p != dst && dst_bytes) memcpy(dst, p, (size_t)dst_bytes);
        return TM_OK;
    }
    unsigned char *stored = rec->enc == CK_ENC_RAW ? dst : tm__host_alloc(ctx, rec->comp_len ? (size_t)rec->comp_len : 1);
    if (!stored)
        return tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': cannot allocate %llu bytes for tensor '%s'", fn, r->path,
                       (unsigned long long)rec->comp_len, r->info->entries[entry].name);
    uint32_t crc = 0;
    int e = pread_crc(im->fd, stored, (size_t)rec->comp_len, rec->off, tm__nthreads(ctx), &crc);
    tm_status st = TM_OK;
    if (e)
        st = tm__err(ctx, TM_ERR_IO, "%s: cannot read '%s': %s", fn, r->path,
                     e > 0 ? strerror(e) : "file shrank while reading");
    else if (crc != rec->crc)
        st = tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the data of tensor '%s'", fn, r->path,
                     r->info->entries[entry].name);
    if (st == TM_OK && rec->enc != CK_ENC_RAW) {
        rec->data = stored;
        st = rec_bytes(ctx, im, rec, dst, &p);
        rec->data = NULL;
    }
    if (stored != dst) tm__host_free(ctx, stored);
    return st;
}

void tm_ckpt_reader_close(tm_ckpt_reader *r) {
    if (!r) return;
    tm_ctx *ctx = r->ctx;
    free(r->info);
    image_free(ctx, &r->im);
    tm__host_free(ctx, r);
}
