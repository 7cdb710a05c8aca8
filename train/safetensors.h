/*
 * safetensors.h — the safetensors file format: writing one, and reading and validating one
 * into a table of tensors. Knows nothing of any model (train/hf.c maps Mixtral onto it).
 *
 * The format (https://huggingface.co/docs/safetensors, "Format"):
 *   u64 little-endian N | N bytes of UTF-8 JSON | data
 * The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
 * relative to the start of the data, end exclusive) plus an optional "__metadata__" map of
 * strings; it starts with '{' and may be padded with spaces. The data is the tensors'
 * little-endian row-major bytes, fully indexed: no holes, no overlaps.
 *
 * Both directions assume a little-endian host for the element bytes (the caller checks
 * tmd_st_host_supported first). Functions return 0, TMD_CONFIG_ERROR (an invalid or foreign
 * file, an unknown dtype) or TMD_RUNTIME_ERROR (I/O or memory), the codes of status.h, with a
 * message in err naming the file and the tensor.
 */
#ifndef TMD_SAFETENSORS_H
#define TMD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define TMD_ST_MAX_DIMS 8

/* Whether this host's byte order is the format's (little-endian). */
int tmd_st_host_supported(void);

/* ---- writing ---- */

typedef struct tmd_st_out {
    const char *name;  /* written as a JSON string (escaped) */
    const char *dtype; /* a safetensors dtype name: "F32", "BF16", "F16", "I32", ... */
    int ndim;          /* 0 .. TMD_ST_MAX_DIMS */
    int64_t shape[TMD_ST_MAX_DIMS];
} tmd_st_out;

/* The bytes of tensor i (numel x dtype size, row-major, little-endian) in *data. Called once
 * per tensor, in order, on the caller's thread, while another thread writes the bytes of
 * tensor i - 1: the pointer must stay valid, and the bytes unchanged, until the call for
 * i + 2 (or the end of tmd_st_write); a producer alternates between two buffers. Returns 0, or
 * an error code with a message in err (the write is abandoned and that code returned). */
typedef int (*tmd_st_bytes_fn)(void *user, int i, const void **data, char *err, size_t errlen);

/* Write `path` atomically (atomic.h: an older file stays until the new one is complete) with
 * the n tensors of t, in that order, back to back; tensor i is written by a second thread
 * while `bytes` produces tensor i + 1 (a transpose, a read from a checkpoint) on this one. metadata: NULL, or key / value string pairs
 * ending in NULL, written as "__metadata__" (transformers refuses files without
 * {"format": "pt"}). The header is padded with spaces so that the data starts 8-byte aligned
 * (N a multiple of 8). */
int tmd_st_write(const char *path, const tmd_st_out *t, int n, const char *const *metadata, tmd_st_bytes_fn bytes,
                 void *user, char *err, size_t errlen);

/* ---- reading ---- */

/* Element kinds the reader converts to float (tmd_st_to_float); every other dtype is
 * TMD_ST_OTHER. */
enum { TMD_ST_F32 = 0, TMD_ST_BF16 = 1, TMD_ST_F16 = 2, TMD_ST_OTHER = 3 };

typedef struct tmd_st_tensor {
    const char *name;  /* points into the parsed header */
    const char *dtype; /* the safetensors dtype name */
    int kind;          /* TMD_ST_F32, TMD_ST_BF16, TMD_ST_F16 or TMD_ST_OTHER */
    int ndim;
    int64_t shape[TMD_ST_MAX_DIMS];
    uint64_t begin, end;       /* data offsets */
    const unsigned char *data; /* the file's bytes of this tensor */
} tmd_st_tensor;

typedef struct tmd_st_file {
    unsigned char *img; /* the whole file */
    size_t len;
    struct cJSON *root; /* the parsed header */
    tmd_st_tensor *t;   /* sorted by name */
    int n;
} tmd_st_file;

/* Read the whole of `path` and validate it: header length against the file size (and at most
 * 100 MB, the reference implementation's limit), UTF-8, a JSON object with nothing after it,
 * __metadata__ a map of strings, per tensor known dtype, shape of at most TMD_ST_MAX_DIMS
 * sizes, data_offsets inside the data and spanning exactly the shape's bytes, no repeated
 * names, and the data exactly the tensors' bytes back to back (no overlaps, holes or trailing
 * bytes). On failure *f is empty. */
int tmd_st_open(const char *path, tmd_st_file *f, char *err, size_t errlen);
void tmd_st_close(tmd_st_file *f);

/* One element of kind TMD_ST_F32, TMD_ST_BF16 or TMD_ST_F16 at p, as float (exact: every bf16
 * and f16 value, subnormals, infinities and NaNs included, is an f32 value). */
float tmd_st_to_float(const unsigned char *p, int kind);

#endif
