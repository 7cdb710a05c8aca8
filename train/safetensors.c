/* safetensors.c — writing and validated reading of safetensors files; see safetensors.h. */
#include "safetensors.h"

#include <cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "atomic.h"
#include "status.h"
#include "strbuf.h"
#include "util.h"

/* The safetensors reference implementation's limit on the header. */
#define ST_MAX_HEADER 100000000ull

static const struct {
    const char *name;
    int size, kind;
} ST_DTYPES[] = {
    {"F64", 8, TMD_ST_OTHER},     {"F32", 4, TMD_ST_F32},       {"F16", 2, TMD_ST_F16},    {"BF16", 2, TMD_ST_BF16},
    {"F8_E5M2", 1, TMD_ST_OTHER}, {"F8_E4M3", 1, TMD_ST_OTHER}, {"I64", 8, TMD_ST_OTHER},  {"U64", 8, TMD_ST_OTHER},
    {"I32", 4, TMD_ST_OTHER},     {"U32", 4, TMD_ST_OTHER},     {"I16", 2, TMD_ST_OTHER},  {"U16", 2, TMD_ST_OTHER},
    {"I8", 1, TMD_ST_OTHER},      {"U8", 1, TMD_ST_OTHER},      {"BOOL", 1, TMD_ST_OTHER},
};

static int dtype_index(const char *name) {
    for (int k = 0; k < (int)(sizeof ST_DTYPES / sizeof *ST_DTYPES); k++)
        if (!strcmp(name, ST_DTYPES[k].name)) return k;
    return -1;
}

int tmd_st_host_supported(void) {
    const uint32_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

/* ---- writing ------------------------------------------------------------------------------ */

/* A JSON string: quotes, backslashes and control characters escaped (RFC 8259, section 7). */
static void json_string(tmd_sbuf *b, const char *s) {
    tmd_sb_printf(b, "\"");
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') tmd_sb_printf(b, "\\%c", *c);
        else if (*c < 0x20) tmd_sb_printf(b, "\\u%04x", *c);
        else tmd_sb_printf(b, "%c", *c);
    }
    tmd_sb_printf(b, "\"");
}

/* The writer thread of tmd_st_write: one tensor queued at a time (the producer waits until the
 * previous one is written), written in order; a NULL item ends it. After a failed write the
 * rest is skipped (tmd_atomic_commit reports the first error). */
typedef struct st_writer {
    tmd_atomic *a;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    const void *item;
    size_t len;
    int full, end;
} st_writer;

static void *st_writer_main(void *arg) {
    st_writer *w = arg;
    int failed = 0;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->full) pthread_cond_wait(&w->cv, &w->mu);
        const void *p = w->item;
        size_t len = w->len;
        int end = w->end;
        pthread_mutex_unlock(&w->mu);
        if (!end && !failed) failed = tmd_atomic_write(w->a, p, len) != 0;
        /* the slot is free only once its bytes are written: the producer may reuse them */
        pthread_mutex_lock(&w->mu);
        w->full = 0;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
        if (end) return NULL;
    }
}

/* Queue an item (p NULL: the end) once the last one is written. */
static void st_writer_put(st_writer *w, const void *p, size_t len) {
    pthread_mutex_lock(&w->mu);
    while (w->full) pthread_cond_wait(&w->cv, &w->mu);
    w->item = p;
    w->len = len;
    w->end = p == NULL;
    w->full = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

int tmd_st_write(const char *path, const tmd_st_out *t, int n, const char *const *metadata, tmd_st_bytes_fn bytes,
                 void *user, char *err, size_t errlen) {
    /* Header first: the offsets follow from the shapes. */
    uint64_t *size = calloc((size_t)n + 1, sizeof *size);
    if (!size) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory writing '%s'", path);
    tmd_sbuf h = {0};
    tmd_sb_printf(&h, "{");
    const char *sep = "";
    if (metadata) {
        tmd_sb_printf(&h, "\"__metadata__\":{");
        for (int k = 0; metadata[k] && metadata[k + 1]; k += 2) {
            tmd_sb_printf(&h, "%s", k ? "," : "");
            json_string(&h, metadata[k]);
            tmd_sb_printf(&h, ":");
            json_string(&h, metadata[k + 1]);
        }
        tmd_sb_printf(&h, "}");
        sep = ",";
    }
    uint64_t off = 0;
    int rc = 0;
    for (int i = 0; i < n; i++) {
        int d = dtype_index(t[i].dtype);
        if (d < 0 || t[i].ndim < 0 || t[i].ndim > TMD_ST_MAX_DIMS) {
            rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR, "cannot write '%s': tensor '%s' has %s", path, t[i].name,
                          d < 0 ? "an unknown dtype" : "too many dimensions");
            goto done;
        }
        size[i] = (uint64_t)ST_DTYPES[d].size;
        for (int k = 0; k < t[i].ndim; k++) size[i] *= (uint64_t)t[i].shape[k];
        tmd_sb_printf(&h, "%s", sep);
        json_string(&h, t[i].name);
        tmd_sb_printf(&h, ":{\"dtype\":\"%s\",\"shape\":[", t[i].dtype);
        for (int k = 0; k < t[i].ndim; k++) tmd_sb_printf(&h, "%s%lld", k ? "," : "", (long long)t[i].shape[k]);
        tmd_sb_printf(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                      (unsigned long long)(off + size[i]));
        off += size[i];
        sep = ",";
    }
    tmd_sb_printf(&h, "}");
    while (!h.oom && h.n % 8) tmd_sb_printf(&h, " "); /* 8 + N a multiple of 8: the data starts aligned */
    if (h.oom) {
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory writing the header of '%s'", path);
        goto done;
    }
    tmd_atomic a;
    if ((rc = tmd_atomic_open(&a, path, err, errlen))) goto done;
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)h.n >> (8 * i));
    tmd_atomic_write(&a, len8, 8);
    tmd_atomic_write(&a, h.p, h.n);
    /* Tensor i goes to the writer thread while tensor i + 1 is produced here. */
    st_writer w = {.a = &a};
    int threaded = pthread_mutex_init(&w.mu, NULL) == 0;
    if (threaded && pthread_cond_init(&w.cv, NULL) != 0) pthread_mutex_destroy(&w.mu), threaded = 0;
    if (threaded && pthread_create(&w.thread, NULL, st_writer_main, &w) != 0) {
        pthread_cond_destroy(&w.cv), pthread_mutex_destroy(&w.mu);
        threaded = 0;
    }
    for (int i = 0; i < n && !rc; i++) {
        const void *data = NULL;
        rc = bytes(user, i, &data, err, errlen);
        if (!rc && !threaded) tmd_atomic_write(&a, data, (size_t)size[i]);
        if (!rc && threaded) st_writer_put(&w, data, (size_t)size[i]);
    }
    if (threaded) {
        st_writer_put(&w, NULL, 0); /* the end: the writer finishes the queue and stops */
        pthread_join(w.thread, NULL);
        pthread_cond_destroy(&w.cv);
        pthread_mutex_destroy(&w.mu);
    }
    if (rc) {
        tmd_atomic_abort(&a);
        goto done;
    }
    rc = tmd_atomic_commit(&a, err, errlen); /* (reports a failed write: tmd_atomic_write kept its errno) */
done:
    free(h.p);
    free(size);
    return rc;
}

/* ---- reading ------------------------------------------------------------------------------ */

/* RFC 3629 UTF-8 (no overlong forms, no surrogates, <= U+10FFFF); returns the offset of the
 * first bad byte, or len. */
static size_t utf8_check(const unsigned char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) {
            i++;
            continue;
        }
        if ((c & 0xE0) == 0xC0) k = 1, cp = c & 0x1F, min = 0x80;
        else if ((c & 0xF0) == 0xE0) k = 2, cp = c & 0x0F, min = 0x800;
        else if ((c & 0xF8) == 0xF0) k = 3, cp = c & 0x07, min = 0x10000;
        else return i;
        if (k >= len - i) return i;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xC0) != 0x80) return i;
            cp = cp << 6 | (s[i + j] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
        i += k + 1;
    }
    return len;
}

/* A JSON number that is a whole number in [0, 2^53] (cJSON keeps numbers as doubles). */
static int json_u64(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0 && d <= 9007199254740992.0) || d != floor(d)) return -1;
    *out = (uint64_t)d;
    return 0;
}

static int cmp_name(const void *a, const void *b) {
    return strcmp(((const tmd_st_tensor *)a)->name, ((const tmd_st_tensor *)b)->name);
}
static int cmp_offset(const void *a, const void *b) {
    const tmd_st_tensor *x = *(const tmd_st_tensor *const *)a, *y = *(const tmd_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int tensor_parse(const char *path, const cJSON *item, tmd_st_tensor *t, uint64_t data_len, char *err,
                        size_t errlen) {
    const char *nm = item->string;
    if (!cJSON_IsObject(item))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': entry is not a JSON object", path, nm);
    const cJSON *dtype = NULL, *shape = NULL, *offs = NULL, *m;
    cJSON_ArrayForEach(m, item) {
        if (!strcmp(m->string, "dtype") && !dtype) dtype = m;
        else if (!strcmp(m->string, "shape") && !shape) shape = m;
        else if (!strcmp(m->string, "data_offsets") && !offs) offs = m;
        else
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': unexpected or repeated member \"%s\"",
                            path, nm, m->string);
    }
    if (!dtype || !shape || !offs)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': missing \"%s\"", path, nm,
                        !dtype   ? "dtype"
                        : !shape ? "shape"
                                 : "data_offsets");
    t->name = nm;
    if (!cJSON_IsString(dtype))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': dtype is not a string", path, nm);
    int k = dtype_index(dtype->valuestring);
    if (k < 0)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': unknown dtype \"%.32s\"", path, nm,
                        dtype->valuestring);
    if (!cJSON_IsArray(shape) || cJSON_GetArraySize(shape) > TMD_ST_MAX_DIMS)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': shape is not an array of at most %d sizes",
                        path, nm, TMD_ST_MAX_DIMS);
    /* numel * size without overflow: every product stays below 2^64 when checked against the
     * data length (< 2^63) as it grows. */
    t->kind = ST_DTYPES[k].kind;
    t->dtype = ST_DTYPES[k].name;
    uint64_t bytes = (uint64_t)ST_DTYPES[k].size;
    const cJSON *d;
    t->ndim = 0;
    cJSON_ArrayForEach(d, shape) {
        uint64_t v;
        if (json_u64(d, &v))
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "'%s': tensor '%s': shape holds a value that is not a size",
                            path, nm);
        t->shape[t->ndim++] = (int64_t)v;
        if (v && bytes > UINT64_MAX / v) bytes = UINT64_MAX;
        else bytes *= v;
    }
    uint64_t b, e;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || json_u64(cJSON_GetArrayItem(offs, 0), &b) ||
        json_u64(cJSON_GetArrayItem(offs, 1), &e) || b > e)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "'%s': tensor '%s': data_offsets is not [begin, end] with 0 <= begin <= end", path, nm);
    if (e > data_len)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "'%s': tensor '%s': data_offsets [%llu, %llu] run past the %llu data bytes of the file", path,
                        nm, (unsigned long long)b, (unsigned long long)e, (unsigned long long)data_len);
    if (bytes != e - b)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "'%s': tensor '%s': %s shape holds %llu bytes but data_offsets [%llu, %llu] span %llu", path,
                        nm, t->dtype, (unsigned long long)bytes, (unsigned long long)b, (unsigned long long)e,
                        (unsigned long long)(e - b));
    t->begin = b;
    t->end = e;
    return 0;
}

void tmd_st_close(tmd_st_file *f) {
    cJSON_Delete(f->root);
    free(f->img);
    free(f->t);
    memset(f, 0, sizeof *f);
}

int tmd_st_open(const char *path, tmd_st_file *f, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    int rc = tmd_read_file(path, 0, &f->img, &f->len, err, errlen); /* weights: any size; the header is capped below */
    if (rc) return rc;
    rc = TMD_CONFIG_ERROR;
    if (f->len < 8) {
        tmd_fail(err, errlen, rc, "'%s' is not a safetensors file: %zu bytes, shorter than the 8-byte header length",
                 path, f->len);
        goto bad;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | f->img[i];
    if (n > f->len - 8 || n > ST_MAX_HEADER || n < 2) {
        tmd_fail(err, errlen, rc,
                 "'%s': header length %llu does not fit the file (%zu bytes; at most %llu, at least 2)", path,
                 (unsigned long long)n, f->len, (unsigned long long)ST_MAX_HEADER);
        goto bad;
    }
    const char *hdr = (const char *)f->img + 8;
    size_t bad_at = utf8_check((const unsigned char *)hdr, (size_t)n);
    if (bad_at != n) {
        tmd_fail(err, errlen, rc, "'%s': header is not UTF-8 (byte %zu of the header)", path, bad_at);
        goto bad;
    }
    if (hdr[0] != '{') {
        tmd_fail(err, errlen, rc, "'%s': header does not start with '{'", path);
        goto bad;
    }
    const char *end = NULL;
    f->root = cJSON_ParseWithLengthOpts(hdr, (size_t)n, &end, 0);
    if (!f->root) {
        const char *at = cJSON_GetErrorPtr();
        tmd_fail(err, errlen, rc, "'%s': header is not valid JSON (near byte %lld of the header)", path,
                 at ? (long long)(at - hdr) : -1LL);
        goto bad;
    }
    for (const char *q = end; q < hdr + n; q++)
        if (*q != ' ' && *q != '\t' && *q != '\n' && *q != '\r') {
            tmd_fail(err, errlen, rc, "'%s': header has bytes after its JSON object (byte %lld)", path,
                     (long long)(q - hdr));
            goto bad;
        }
    if (!cJSON_IsObject(f->root)) {
        tmd_fail(err, errlen, rc, "'%s': header is not a JSON object", path);
        goto bad;
    }
    uint64_t data_len = f->len - 8 - n;
    int count = cJSON_GetArraySize(f->root);
    f->t = calloc((size_t)count + 1, sizeof *f->t);
    tmd_st_tensor **order = calloc((size_t)count + 1, sizeof *order);
    if (!f->t || !order) {
        free(order);
        rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "'%s': out of memory (%d tensors)", path, count);
        goto bad;
    }
    const cJSON *item;
    int meta_seen = 0;
    cJSON_ArrayForEach(item, f->root) {
        if (!strcmp(item->string, "__metadata__")) {
            const cJSON *kv;
            int ok = cJSON_IsObject(item) && !meta_seen++;
            cJSON_ArrayForEach(kv, item) ok = ok && cJSON_IsString(kv);
            if (!ok) {
                free(order);
                tmd_fail(err, errlen, rc, "'%s': __metadata__ is repeated or not a map of strings", path);
                goto bad;
            }
            continue;
        }
        if (tensor_parse(path, item, &f->t[f->n], data_len, err, errlen)) {
            free(order);
            goto bad;
        }
        f->t[f->n].data = f->img + 8 + n + f->t[f->n].begin;
        f->n++;
    }
    qsort(f->t, (size_t)f->n, sizeof *f->t, cmp_name);
    for (int i = 1; i < f->n; i++)
        if (!strcmp(f->t[i].name, f->t[i - 1].name)) {
            free(order);
            tmd_fail(err, errlen, rc, "'%s': tensor '%s' appears twice in the header", path, f->t[i].name);
            goto bad;
        }
    /* The data must be exactly the tensors' bytes, back to back. */
    for (int i = 0; i < f->n; i++) order[i] = &f->t[i];
    qsort(order, (size_t)f->n, sizeof *order, cmp_offset);
    uint64_t cursor = 0;
    for (int i = 0; i < f->n; i++) {
        const tmd_st_tensor *t = order[i];
        if (t->begin != cursor) {
            if (t->begin < cursor)
                tmd_fail(err, errlen, rc, "'%s': tensor '%s' (data_offsets [%llu, %llu]) overlaps tensor '%s'", path,
                         t->name, (unsigned long long)t->begin, (unsigned long long)t->end, order[i - 1]->name);
            else
                tmd_fail(err, errlen, rc,
                         "'%s': %llu unindexed data bytes before tensor '%s' (data_offsets [%llu, %llu])", path,
                         (unsigned long long)(t->begin - cursor), t->name, (unsigned long long)t->begin,
                         (unsigned long long)t->end);
            free(order);
            goto bad;
        }
        cursor = t->end;
    }
    free(order);
    if (cursor != data_len) {
        tmd_fail(
            err, errlen, rc,
            "'%s': %llu data bytes after the last tensor are not indexed by the header (truncated or padded file?)",
            path, (unsigned long long)(data_len - cursor));
        goto bad;
    }
    return 0;
bad:
    tmd_st_close(f);
    return rc;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, ex = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (ex == 0x1F) {
        bits = sign | 0x7F800000u | man << 13;
    } else if (ex) {
        bits = sign | (ex + 112) << 23 | man << 13;
    } else if (man) { /* subnormal: normalise */
        int shift = 0;
        while (!(man & 0x400)) {
            man <<= 1;
            shift++;
        }
        bits = sign | (uint32_t)(113 - shift) << 23 | (man & 0x3FF) << 13;
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

float tmd_st_to_float(const unsigned char *p, int kind) {
    float f;
    uint32_t u;
    uint16_t s;
    switch (kind) {
    case TMD_ST_F32: memcpy(&f, p, 4); return f;
    case TMD_ST_BF16:
        memcpy(&s, p, 2);
        u = (uint32_t)s << 16;
        memcpy(&f, &u, 4);
        return f;
    default: memcpy(&s, p, 2); return half_to_float(s);
    }
}
