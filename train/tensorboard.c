/*
 * tensorboard.c — TensorBoard event files; see tensorboard.h.
 *
 * A file is a sequence of TFRecords (TensorFlow's tensorflow/core/lib/io/record_writer.cc):
 *     uint64 length, little-endian | uint32 masked crc32c of those 8 bytes | data | uint32 masked crc32c of data
 *     masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8
 * Each record's data is a serialized Event (tensorflow/core/util/event.proto):
 *     Event      { double wall_time = 1; int64 step = 2; string file_version = 3;
 *                  Summary summary = 5; SessionLog session_log = 7; }
 *     Summary    { repeated Value value = 1; }
 *     Value      { string tag = 1; float simple_value = 2; }
 *     SessionLog { Status status = 1; }          START = 1
 * Only these fields are written, so a minimal encoder of protobuf's wire format (varints,
 * 64- and 32-bit little-endian fixed fields, length-delimited fields) does it; a protobuf
 * library plus code generated from event.proto would be a dependency larger than the feature.
 */
#include "tensorboard.h"

#include <errno.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "atomic.h"

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
}

uint32_t tmd_crc32c(uint32_t crc, const void *data, size_t n) {
    /* The table is a pure function of the polynomial: filling it twice (two threads) writes
     * the same values, so no lock is needed. */
    if (!crc_table[1]) crc_init();
    const unsigned char *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = crc_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

static uint32_t masked_crc(const void *data, size_t n) {
    uint32_t c = tmd_crc32c(0, data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

/* ---- protobuf's wire format ------------------------------------------------------------- */

typedef struct pb {
    unsigned char b[512];
    size_t n;
    int overflow;
} pb;

static void pb_byte(pb *p, unsigned v) {
    if (p->n < sizeof p->b) p->b[p->n++] = (unsigned char)v;
    else p->overflow = 1;
}
static void pb_varint(pb *p, uint64_t v) {
    while (v >= 0x80) pb_byte(p, (unsigned)(v & 0x7f) | 0x80), v >>= 7;
    pb_byte(p, (unsigned)v);
}
static void pb_key(pb *p, int field, int wire) { pb_varint(p, (uint64_t)field << 3 | (uint64_t)wire); }
static void pb_fixed(pb *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) pb_byte(p, (unsigned)(v >> (8 * i)) & 0xff);
}
static void pb_double(pb *p, int field, double v) {
    uint64_t u;
    memcpy(&u, &v, 8);
    pb_key(p, field, 1), pb_fixed(p, u, 8);
}
static void pb_float(pb *p, int field, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    pb_key(p, field, 5), pb_fixed(p, u, 4);
}
static void pb_bytes(pb *p, int field, const void *data, size_t n) {
    pb_key(p, field, 2), pb_varint(p, n);
    for (size_t i = 0; i < n; i++) pb_byte(p, ((const unsigned char *)data)[i]);
}
/* int64 fields are varints of the two's complement (negative steps never occur here). */
static void pb_int64(pb *p, int field, int64_t v) { pb_key(p, field, 0), pb_varint(p, (uint64_t)v); }

static double wall_time(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + 1e-6 * (double)tv.tv_usec;
}

static int write_record(tmd_tb *tb, const pb *event) {
    if (!tb->f) return -1;
    if (event->overflow) return errno = ENAMETOOLONG, -1;
    unsigned char head[12];
    uint64_t len = event->n;
    for (int i = 0; i < 8; i++) head[i] = (unsigned char)(len >> (8 * i));
    uint32_t hc = masked_crc(head, 8), dc = masked_crc(event->b, event->n);
    for (int i = 0; i < 4; i++) head[8 + i] = (unsigned char)(hc >> (8 * i));
    unsigned char tail[4];
    for (int i = 0; i < 4; i++) tail[i] = (unsigned char)(dc >> (8 * i));
    if (fwrite(head, 1, 12, tb->f) != 12 || fwrite(event->b, 1, event->n, tb->f) != event->n ||
        fwrite(tail, 1, 4, tb->f) != 4)
        return -1;
    return 0;
}

int tmd_tb_open(tmd_tb *tb, const char *dir, int64_t start_step, char *err, size_t errlen) {
    memset(tb, 0, sizeof *tb);
    char e[TMD_PATH_MAX + 256];
    if (tmd_mkdirs(dir, e, sizeof e)) {
        snprintf(err, errlen, "key 'tensorboard': %s", e);
        return -1;
    }
    char host[256] = "localhost";
    if (gethostname(host, sizeof host - 1)) strcpy(host, "localhost");
    host[sizeof host - 1] = 0;
    for (char *c = host; *c; c++)
        if (*c == '/') *c = '_';
    snprintf(tb->path, sizeof tb->path, "%s/events.out.tfevents.%lld.%s.%ld.0", dir, (long long)time(NULL), host,
             (long)getpid());
    tb->f = fopen(tb->path, "wb");
    if (!tb->f) {
        snprintf(err, errlen, "key 'tensorboard': cannot write '%s': %s", tb->path, strerror(errno));
        return -1;
    }
    pb ev = {0};
    pb_double(&ev, 1, wall_time());
    pb_bytes(&ev, 3, "brain.Event:2", 13);
    int rc = write_record(tb, &ev);
    if (!rc && start_step > 0) {
        pb sl = {0}, e2 = {0};
        pb_varint(&sl, 1 << 3), pb_varint(&sl, 1); /* status = START */
        pb_double(&e2, 1, wall_time());
        pb_int64(&e2, 2, start_step + 1);
        pb_bytes(&e2, 7, sl.b, sl.n);
        rc = write_record(tb, &e2);
    }
    if (rc || tmd_tb_flush(tb)) {
        snprintf(err, errlen, "key 'tensorboard': cannot write '%s': %s", tb->path, strerror(errno ? errno : EIO));
        tmd_tb_close(tb);
        return -1;
    }
    return 0;
}

int tmd_tb_scalar(tmd_tb *tb, const char *tag, int64_t step, double value) {
    pb val = {0}, sum = {0}, ev = {0};
    pb_bytes(&val, 1, tag, strlen(tag));
    pb_float(&val, 2, (float)value);
    pb_bytes(&sum, 1, val.b, val.n);
    pb_double(&ev, 1, wall_time());
    pb_int64(&ev, 2, step);
    if (val.overflow || sum.overflow) return errno = ENAMETOOLONG, -1;
    pb_bytes(&ev, 5, sum.b, sum.n);
    return write_record(tb, &ev);
}

int tmd_tb_flush(tmd_tb *tb) {
    if (!tb->f) return -1;
    return fflush(tb->f) || ferror(tb->f) ? -1 : 0;
}

void tmd_tb_close(tmd_tb *tb) {
    if (tb->f) fclose(tb->f);
    tb->f = NULL;
}
