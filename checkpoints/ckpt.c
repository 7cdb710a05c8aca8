/*
 * ckpt.c — checkpoint files: every parameter and buffer of a context plus an opaque meta blob.
 *
 * The byte layout is specified in docs/checkpoint-format.md; in short (all integers
 * little-endian):
 *
 *   header   "TMCKPT\0\0" | version u32 | endian u32 0x01020304 | n_tensors u32 |
 *            meta_len u64 | crc32(previous 28 bytes) u32                       (32 bytes)
 *   meta     meta_len bytes | crc32(meta) u32
 *   tensors  n_tensors records, in the context's creation order:
 *            name_len u16 | name | dtype u8 | ndim u8 | shape i64[ndim] | raw_len u64 |
 *            comp_len u64 | crc32(compressed) u32 | zlib stream (comp_len bytes)
 *   end      "TMCKEND\0" | crc32 over the record descriptors (everything but the zlib streams)
 *
 * Saving never exposes a partial file: it writes "<path>.tmp.XXXXXX" in the same directory,
 * fsyncs it, renames it over `path` and fsyncs the directory. Whatever instant a crash (or
 * kill -9, or a full disk) hits, `path` names either the old complete file or the new one.
 *
 * Loading never leaves a half-loaded context: the whole file is read into host memory and
 * checked end to end (structure, every CRC, every name/dtype/shape against the context, every
 * zlib stream actually inflated to its recorded length) before the first tensor is written.
 * The price is one extra inflate per tensor and the compressed file in host memory; a
 * checkpoint is loaded once per run, and the alternative (re-reading the file for a second
 * pass) would reopen the window for a concurrent writer to swap the file in between.
 * The one failure that can still strike mid-write is the device copy itself (TM_ERR_CUDA).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "extend.h"

#define CK_VERSION 1u
#define CK_ENDIAN 0x01020304u
#define CK_HEADER_BYTES 32
#define CK_NAME_MAX 127 /* tm_param_new's limit */

static const unsigned char ck_magic[8] = {'T', 'M', 'C', 'K', 'P', 'T', 0, 0};
static const unsigned char ck_end[8] = {'T', 'M', 'C', 'K', 'E', 'N', 'D', 0};

/* zlib level 1: parameters are near-incompressible floats, so higher levels gain a few percent
 * of size for several times the time; checkpoints are written often, read once. */
enum { CK_ZLEVEL = 1, CK_WBUF = 1 << 20 };

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

/* ---- saving --------------------------------------------------------------------------- */

/* Buffered writer over a file descriptor; the first error sticks (errno value in err). */
typedef struct ck_writer {
    int fd;
    unsigned char *buf;
    size_t n;
    int err;
} ck_writer;

static void w_flush(ck_writer *w) {
    size_t off = 0;
    while (!w->err && off < w->n) {
        ssize_t k = write(w->fd, w->buf + off, w->n - off);
        if (k < 0) {
            if (errno != EINTR) w->err = errno;
        } else {
            off += (size_t)k;
        }
    }
    w->n = 0;
}

static void w_put(ck_writer *w, const void *p, size_t n) {
    const unsigned char *b = p;
    while (!w->err && n > 0) {
        size_t k = CK_WBUF - w->n < n ? CK_WBUF - w->n : n;
        memcpy(w->buf + w->n, b, k);
        w->n += k;
        b += k;
        n -= k;
        if (w->n == CK_WBUF) w_flush(w);
    }
}

/* Tensors are compressed in batches of up to CK_BATCH raw bytes (or one larger tensor): the
 * batch is read on the calling thread, compressed in parallel (one z_stream per thread,
 * created beforehand on this thread so that zlib allocates only here, through the allocator
 * hook, which need not be thread-safe), then written in order. Deflate is deterministic, so the
 * file does not depend on the thread count. */
enum { CK_BATCH = 64 << 20 };

typedef struct ck_stage {
    unsigned char *raw, *comp;  /* batch buffers */
    size_t raw_cap, comp_cap;
    size_t *raw_off, *comp_off, *comp_len; /* per tensor of the batch */
    int *zs;
    z_stream *z; /* [nthreads] */
    int nz;
} ck_stage;

static size_t ck_bound(size_t raw) { return (size_t)compressBound((uLong)raw); }

/* Sizes of the largest batch, so the buffers are allocated once. */
static void plan_batches(const tm_ctx *ctx, size_t *raw_cap, size_t *comp_cap, int *max_count) {
    *raw_cap = 1, *comp_cap = 1, *max_count = 1;
    for (int k = 0; k < tm_ctx_num_named(ctx);) {
        size_t raw = 0, comp = 0;
        int n = 0;
        do {
            size_t rb = tensor_bytes(tm_ctx_named(ctx, k));
            raw += rb, comp += ck_bound(rb), n++, k++;
        } while (k < tm_ctx_num_named(ctx) && raw + tensor_bytes(tm_ctx_named(ctx, k)) <= CK_BATCH);
        if (raw > *raw_cap) *raw_cap = raw;
        if (comp > *comp_cap) *comp_cap = comp;
        if (n > *max_count) *max_count = n;
    }
}

static tm_status write_tensors(tm_ctx *ctx, const char *path, ck_writer *w, ck_stage *st, uint32_t *table_crc,
                               int *progress) {
    uint32_t tcrc = 0;
    for (int k0 = 0; k0 < tm_ctx_num_named(ctx) && !w->err;) {
        int k1 = k0;
        size_t raw = 0, comp = 0;
        do {
            const tm_tensor *t = tm_ctx_named(ctx, k1);
            size_t rb = tensor_bytes(t);
            *progress = k1; /* the gathers of the other ranks pair with these */
            TM__TRY(tm__named_gather(ctx, t, st->raw + raw));
            *progress = k1 + 1;
            st->raw_off[k1 - k0] = raw;
            st->comp_off[k1 - k0] = comp;
            raw += rb, comp += ck_bound(rb), k1++;
        } while (k1 < tm_ctx_num_named(ctx) && raw + tensor_bytes(tm_ctx_named(ctx, k1)) <= CK_BATCH);
        int n = k1 - k0;
#pragma omp parallel for num_threads(st->nz) schedule(dynamic) if (n > 1)
        for (int i = 0; i < n; i++) {
            const tm_tensor *t = tm_ctx_named(ctx, k0 + i);
            size_t rb = tensor_bytes(t), cl = ck_bound(rb);
#ifdef _OPENMP
            z_stream *z = &st->z[omp_get_thread_num()];
#else
            z_stream *z = &st->z[0];
#endif
            st->zs[i] = ck_deflate(z, st->raw + st->raw_off[i], rb, st->comp + st->comp_off[i], &cl);
            st->comp_len[i] = cl;
        }
        for (int i = 0; i < n && !w->err; i++) {
            const tm_tensor *t = tm_ctx_named(ctx, k0 + i);
            if (st->zs[i] != Z_OK)
                return tm__err(ctx, st->zs[i] == Z_MEM_ERROR ? TM_ERR_NOMEM : TM_ERR_INTERNAL,
                               "tm_ckpt_save: '%s': compressing tensor '%s' failed (zlib %d)", path, tm_tensor_name(t),
                               st->zs[i]);
            size_t name_len = strlen(tm_tensor_name(t)), cl = st->comp_len[i];
            const unsigned char *data = st->comp + st->comp_off[i];
            /* descriptor: u16 name_len, name, u8 dtype, u8 ndim, i64 shape[], u64 raw, u64 comp, u32 crc */
            unsigned char d[2 + CK_NAME_MAX + 2 + 8 * TM_MAX_DIMS + 8 + 8 + 4], *p = d;
            put_u16(p, (uint16_t)name_len), p += 2;
            memcpy(p, tm_tensor_name(t), name_len), p += name_len;
            int lnd;
            int64_t lshape[TM_MAX_DIMS];
            logical_shape(t, &lnd, lshape);
            *p++ = (unsigned char)tm_tensor_dtype(t);
            *p++ = (unsigned char)lnd;
            for (int a = 0; a < lnd; a++) put_u64(p, (uint64_t)lshape[a]), p += 8;
            put_u64(p, (uint64_t)tensor_bytes(t)), p += 8;
            put_u64(p, (uint64_t)cl), p += 8;
            put_u32(p, crc_update(0, data, cl)), p += 4;
            tcrc = crc_update(tcrc, d, (size_t)(p - d));
            w_put(w, d, (size_t)(p - d));
            w_put(w, data, cl);
        }
        k0 = k1;
    }
    *table_crc = tcrc;
    return TM_OK;
}

static void stage_free(tm_ctx *ctx, ck_stage *st) {
    for (int i = 0; i < st->nz; i++) deflateEnd(&st->z[i]);
    tm__host_free(ctx, st->z);
    tm__host_free(ctx, st->raw);
    tm__host_free(ctx, st->comp);
    tm__host_free(ctx, st->raw_off);
    tm__host_free(ctx, st->comp_off);
    tm__host_free(ctx, st->comp_len);
    tm__host_free(ctx, st->zs);
}

static tm_status stage_init(tm_ctx *ctx, const char *path, ck_stage *st) {
    memset(st, 0, sizeof *st);
    int count;
    plan_batches(ctx, &st->raw_cap, &st->comp_cap, &count);
    int nth = tm__nthreads(ctx);
    st->raw = tm__host_alloc(ctx, st->raw_cap);
    st->comp = tm__host_alloc(ctx, st->comp_cap);
    st->raw_off = tm__host_alloc(ctx, sizeof *st->raw_off * (size_t)count);
    st->comp_off = tm__host_alloc(ctx, sizeof *st->comp_off * (size_t)count);
    st->comp_len = tm__host_alloc(ctx, sizeof *st->comp_len * (size_t)count);
    st->zs = tm__host_alloc(ctx, sizeof *st->zs * (size_t)count);
    st->z = tm__host_alloc(ctx, sizeof *st->z * (size_t)nth);
    if (!st->raw || !st->comp || !st->raw_off || !st->comp_off || !st->comp_len || !st->zs || !st->z) {
        stage_free(ctx, st);
        return tm__err(ctx, TM_ERR_NOMEM, "tm_ckpt_save: '%s': cannot allocate %zu bytes of staging memory", path,
                       st->raw_cap + st->comp_cap);
    }
    for (; st->nz < nth; st->nz++) {
        int zs = ck_deflate_init(ctx, &st->z[st->nz]);
        if (zs != Z_OK) {
            stage_free(ctx, st);
            return tm__err(ctx, zs == Z_MEM_ERROR ? TM_ERR_NOMEM : TM_ERR_INTERNAL,
                           "tm_ckpt_save: '%s': zlib deflateInit failed (%d)", path, zs);
        }
    }
    return TM_OK;
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

static tm_status save_file(tm_ctx *ctx, const char *path, const void *meta, size_t meta_bytes, int *progress);

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

/* Under a communicator saving is collective: every rank takes part (sharded tensors are
 * gathered to logical ones), world rank 0 writes the file, and every rank returns its status. */
tm_status tm_ckpt_save(tm_ctx *ctx, const char *path, const void *meta, size_t meta_bytes) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    int W = tm_comm_size(ctx, TM_COMM_WORLD), me = tm_comm_rank(ctx, TM_COMM_WORLD), progress = 0;
    if (W == 1) return save_file(ctx, path, meta, meta_bytes, &progress);
    tm_status st;
    if (me == 0) {
        st = save_file(ctx, path, meta, meta_bytes, &progress);
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

static tm_status save_file(tm_ctx *ctx, const char *path, const void *meta, size_t meta_bytes, int *progress) {
    const char *fn = "tm_ckpt_save";
    if (!path || !*path) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: path is NULL or empty", fn);
    if (!meta && meta_bytes)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: meta is NULL but meta_bytes is %zu", fn, meta_bytes);
    if (!host_little_endian())
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: big-endian hosts are not supported", fn);
    if ((uint64_t)tm_ctx_num_named(ctx) > UINT32_MAX)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: too many tensors (%d)", fn, tm_ctx_num_named(ctx));

    size_t max_raw = 1;
    for (int k = 0; k < tm_ctx_num_named(ctx); k++) {
        size_t rb = tensor_bytes(tm_ctx_named(ctx, k));
        if (rb > max_raw) max_raw = rb;
    }
    /* One deflate call per tensor: its length must fit zlib's 32-bit uInt. */
    if (compressBound((uLong)max_raw) > UINT_MAX || (uLong)max_raw != max_raw)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: a tensor of %zu bytes exceeds zlib's 4 GiB limit", fn, max_raw);

    char tmp[PATH_MAX];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp.XXXXXX", path) >= sizeof tmp)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: path '%s' is too long", fn, path);

    ck_stage stage;
    TM__TRY(stage_init(ctx, path, &stage));
    unsigned char *wbuf = tm__host_alloc(ctx, CK_WBUF);
    tm_status st = TM_OK;
    int fd = -1;
    if (!wbuf) {
        st = tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': cannot allocate %d bytes of staging memory", fn, path, CK_WBUF);
        goto done;
    }
    fd = mkstemp(tmp);
    if (fd < 0) {
        st = tm__err(ctx, TM_ERR_IO, "%s: cannot create '%s': %s", fn, tmp, strerror(errno));
        goto done;
    }
    /* mkstemp creates 0600; a checkpoint is an ordinary file others may read. */
    (void)fchmod(fd, 0644);

    ck_writer w = {.fd = fd, .buf = wbuf};
    unsigned char h[CK_HEADER_BYTES];
    memcpy(h, ck_magic, 8);
    put_u32(h + 8, CK_VERSION);
    put_u32(h + 12, CK_ENDIAN);
    put_u32(h + 16, (uint32_t)tm_ctx_num_named(ctx));
    put_u64(h + 20, (uint64_t)meta_bytes);
    put_u32(h + 28, crc_update(0, h, 28));
    w_put(&w, h, sizeof h);
    unsigned char c4[4];
    if (meta_bytes) w_put(&w, meta, meta_bytes);
    put_u32(c4, crc_update(0, meta, meta_bytes));
    w_put(&w, c4, 4);

    uint32_t tcrc = 0;
    st = write_tensors(ctx, path, &w, &stage, &tcrc, progress);
    if (st == TM_OK) {
        w_put(&w, ck_end, 8);
        put_u32(c4, tcrc);
        w_put(&w, c4, 4);
        w_flush(&w);
        if (!w.err && fsync(fd) != 0) w.err = errno;
        if (close(fd) != 0 && !w.err) w.err = errno;
        fd = -1;
        if (w.err) {
            st = tm__err(ctx, TM_ERR_IO, "%s: cannot write '%s' (via '%s'): %s", fn, path, tmp,
                         strerror(w.err));
        } else if (rename(tmp, path) != 0) {
            st = tm__err(ctx, TM_ERR_IO, "%s: cannot rename '%s' to '%s': %s", fn, tmp, path,
                         strerror(errno));
        } else {
            sync_dir(path);
            goto done;
        }
    }
    if (fd >= 0) close(fd);
    unlink(tmp);
done:
    stage_free(ctx, &stage);
    tm__host_free(ctx, wbuf);
    return st;
}

/* ---- loading and inspecting ------------------------------------------------------------ */

/* One record as parsed from the file; points into the file image. */
typedef struct ck_rec {
    const unsigned char *name;
    size_t name_len;
    int dtype, ndim;
    int64_t shape[TM_MAX_DIMS];
    uint64_t raw_len, comp_len;
    uint32_t crc;
    const unsigned char *data;
    tm_tensor *t; /* the context's tensor of that name; NULL: skipped (TM_CKPT_SKIP_UNKNOWN) */
} ck_rec;

/* A parsed file image: header fields, meta and the record table (into img). */
typedef struct ck_image {
    const char *fn, *path;
    unsigned char *img;
    size_t len;
    uint32_t version, n;
    const unsigned char *meta;
    uint64_t meta_len;
    ck_rec *rec; /* [n] */
} ck_image;

static void image_free(tm_ctx *ctx, ck_image *im) {
    tm__host_free(ctx, im->rec);
    tm__host_free(ctx, im->img);
    im->rec = NULL;
    im->img = NULL;
}

static tm_status read_file(tm_ctx *ctx, ck_image *im) {
    const char *fn = im->fn, *path = im->path;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return tm__err(ctx, TM_ERR_IO, "%s: cannot open '%s': %s", fn, path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return tm__err(ctx, TM_ERR_IO, "%s: cannot stat '%s': %s", fn, path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is not a regular file", fn, path);
    }
    size_t n = (size_t)sb.st_size;
    unsigned char *b = tm__host_alloc(ctx, n ? n : 1);
    if (!b) {
        close(fd);
        return tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': cannot allocate %zu bytes", fn, path, n);
    }
    size_t off = 0;
    while (off < n) {
        ssize_t k = read(fd, b + off, n - off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            int e = k < 0 ? errno : 0;
            close(fd);
            tm__host_free(ctx, b);
            return tm__err(ctx, TM_ERR_IO, "%s: cannot read '%s': %s", fn, path,
                           e ? strerror(e) : "file shrank while reading");
        }
        off += (size_t)k;
    }
    close(fd);
    im->img = b;
    im->len = n;
    return TM_OK;
}

static tm_status truncated(tm_ctx *ctx, const ck_image *im, const char *what) {
    return tm__err(ctx, TM_ERR_IO, "%s: '%s' is truncated (%zu bytes) in %s", im->fn, im->path, im->len, what);
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
        if (r->dtype >= TM_NDTYPES)
            return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: tensor '%.*s' has dtype code %d", fn, path,
                           (int)r->name_len, (const char *)r->name, r->dtype);
        uint64_t numel = 1;
        int ok = 1;
        for (int d = 0; d < r->ndim && ok; d++) {
            ok = r->shape[d] >= 0 && (r->shape[d] == 0 || numel <= UINT64_MAX / (uint64_t)r->shape[d]);
            if (ok) numel *= (uint64_t)r->shape[d];
        }
        if (!ok || numel > UINT64_MAX / tm_dtype_size((tm_dtype)r->dtype) ||
            numel * tm_dtype_size((tm_dtype)r->dtype) != r->raw_len)
            return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: tensor '%.*s' claims %llu bytes for its shape %s",
                           fn, path, (int)r->name_len, (const char *)r->name, (unsigned long long)r->raw_len,
                           tm__sdesc(ctx, r->ndim, r->shape));
    }
    return TM_OK;
}

/* Read and structurally validate the whole file: header, meta, records, CRCs. */
static tm_status parse_image(tm_ctx *ctx, ck_image *im) {
    const char *fn = im->fn, *path = im->path;
    TM__TRY(read_file(ctx, im));
    const unsigned char *img = im->img;
    size_t len = im->len;
    if (len < CK_HEADER_BYTES) {
        if (len < 8 || memcmp(img, ck_magic, 8) == 0) return truncated(ctx, im, "the header");
    }
    if (memcmp(img, ck_magic, 8) != 0)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is not a tinymoe checkpoint (bad magic)", fn, path);
    if (get_u32(img + 28) != crc_update(0, img, 28))
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: CRC mismatch in the header", fn, path);
    im->version = get_u32(img + 8);
    if (im->version != CK_VERSION)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: '%s' has format version %u, this build reads version %u",
                       fn, path, im->version, CK_VERSION);
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

static tm_status inflate_rec(tm_ctx *ctx, const ck_image *im, const ck_rec *r, unsigned char *dst) {
    size_t out = (size_t)r->raw_len;
    int zs = (uInt)r->comp_len != r->comp_len || (uInt)r->raw_len != r->raw_len
                 ? Z_DATA_ERROR
                 : ck_inflate(ctx, r->data, (size_t)r->comp_len, dst, &out);
    if (zs == Z_MEM_ERROR)
        return tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': out of memory inflating '%.*s'", im->fn, im->path,
                       (int)r->name_len, (const char *)r->name);
    if (zs != Z_OK || out != r->raw_len)
        return tm__err(ctx, TM_ERR_IO, "%s: '%s' is corrupt: tensor '%.*s' does not inflate to %llu bytes (zlib %d)",
                       im->fn, im->path, (int)r->name_len, (const char *)r->name, (unsigned long long)r->raw_len,
                       zs);
    return TM_OK;
}

static size_t max_raw_len(const ck_image *im) {
    size_t m = 1;
    for (uint32_t i = 0; i < im->n; i++)
        if (im->rec[i].raw_len > m) m = (size_t)im->rec[i].raw_len;
    return m;
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
    ck_image im = {.fn = fn, .path = path};
    unsigned char *seen = NULL, *raw = NULL;
    tm_status st = parse_image(ctx, &im);
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
    if (st == TM_OK && !(raw = tm__host_alloc(ctx, max_raw_len(&im))))
        st = tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': cannot allocate %zu bytes", fn, path, max_raw_len(&im));
    /* Inflate everything once to prove it inflates (skipped tensors too: a file that does not
     * is corrupt), then again to load: see the top comment. */
    for (uint32_t i = 0; i < im.n && st == TM_OK; i++) st = inflate_rec(ctx, &im, &im.rec[i], raw);
    for (uint32_t i = 0; i < im.n && st == TM_OK; i++) {
        const ck_rec *r = &im.rec[i];
        if (!r->t) continue;
        st = inflate_rec(ctx, &im, r, raw);
        if (st == TM_OK) st = tm__named_scatter(ctx, r->t, raw); /* this rank's part of the logical tensor */
    }
    if (st == TM_OK) {
        if (meta && im.meta_len) memcpy(meta, im.meta, (size_t)im.meta_len);
        if (meta_bytes) *meta_bytes = (size_t)im.meta_len;
    }
    tm__host_free(ctx, raw);
    tm__host_free(ctx, seen);
    image_free(ctx, &im);
    return st;
}

tm_status tm_ckpt_load(tm_ctx *ctx, const char *path, void *meta, size_t meta_cap, size_t *meta_bytes) {
    return tm_ckpt_load_flags(ctx, path, 0, meta, meta_cap, meta_bytes);
}

/* The info and everything it points to live in one allocation: entries, then names, then meta. */
tm_status tm_ckpt_inspect(tm_ctx *ctx, const char *path, tm_ckpt_info **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    const char *fn = "tm_ckpt_inspect";
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: out is NULL", fn);
    *out = NULL;
    TM__TRY(load_checks(ctx, fn, path));
    ck_image im = {.fn = fn, .path = path};
    unsigned char *raw = NULL;
    tm_status st = parse_image(ctx, &im);
    if (st == TM_OK && !(raw = tm__host_alloc(ctx, max_raw_len(&im))))
        st = tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': cannot allocate %zu bytes", fn, path, max_raw_len(&im));
    for (uint32_t i = 0; i < im.n && st == TM_OK; i++) st = inflate_rec(ctx, &im, &im.rec[i], raw);
    tm__host_free(ctx, raw);
    if (st == TM_OK) {
        size_t bytes = sizeof(tm_ckpt_info) + (size_t)im.n * sizeof(tm_ckpt_entry) + (size_t)im.meta_len + 1;
        for (uint32_t i = 0; i < im.n; i++) bytes += im.rec[i].name_len + 1;
        unsigned char *blk = malloc(bytes);
        if (!blk) {
            st = tm__err(ctx, TM_ERR_NOMEM, "%s: '%s': out of memory", fn, path);
        } else {
            /* Plain malloc: the info outlives nothing of ctx and is freed without it. */
            tm_ckpt_info *info = (tm_ckpt_info *)blk;
            tm_ckpt_entry *e = (tm_ckpt_entry *)(info + 1);
            char *names = (char *)(e + im.n);
            for (uint32_t i = 0; i < im.n; i++) {
                const ck_rec *r = &im.rec[i];
                memcpy(names, r->name, r->name_len);
                names[r->name_len] = '\0';
                e[i] = (tm_ckpt_entry){.name = names, .dtype = (tm_dtype)r->dtype, .ndim = r->ndim,
                                       .raw_bytes = r->raw_len, .stored_bytes = r->comp_len};
                memcpy(e[i].shape, r->shape, sizeof r->shape);
                names += r->name_len + 1;
            }
            memcpy(names, im.meta, (size_t)im.meta_len);
            names[im.meta_len] = '\0';
            *info = (tm_ckpt_info){.version = im.version, .file_bytes = im.len, .num_entries = (int)im.n,
                                   .entries = e, .meta = names, .meta_bytes = (size_t)im.meta_len};
            *out = info;
        }
    }
    image_free(ctx, &im);
    return st;
}

void tm_ckpt_info_free(tm_ckpt_info *info) { free(info); }
