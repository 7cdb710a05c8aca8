/*
 * update_multi.h — the segment table of the update ops adamw_update_multi,
 * grad_sumsq_multi and grad_scale_multi (front ends and the table's owner, tm__segs:
 * framework/ops/update.c; kernels: kernels/cpu/update.c, kernels/cuda/update.cu). They are
 * the only AdamW, sum-of-squares and scaling ops: the public single-tensor functions pass a
 * table of one range.
 *
 * A segment is one contiguous range of a bucket on the table's device: for AdamW a decay run of
 * the parameters with the matching gradients, moments and master weights; for the clip a
 * bucket's gradients. The table holds raw pointers because one op must reach the buffers of
 * several buckets (an op takes at most TM__MAX_IN tensors). It is rebuilt on the host from the
 * bucket tensors before every use and uploaded only when it differs from what the device holds,
 * so a bucket that moved (grew) gets a fresh table and a steady training step uploads nothing.
 *
 * Grid: a kernel gives each segment ceil(n / chunk) consecutive blocks starting at block
 * `first` (`sfirst`, `schunk` for the sum of squares, whose chunks are the CPU's: at most
 * TM__SUMSQ_MAX_CHUNKS of at least TM__SUMSQ_MIN_CHUNK elements, so that the f64 sums are
 * made of the same chunk sums on both backends). A block finds its segment by binary search
 * over `first`, which grows with the segment index.
 */
#ifndef TM_UPDATE_MULTI_H
#define TM_UPDATE_MULTI_H

#include <stdint.h>

typedef struct tm__seg {
    void *p;             /* adamw: the parameters; clip: the gradients */
    const void *g;       /* adamw: the gradients (p's dtype); clip: NULL */
    float *m, *v;        /* adamw: the moments (f32); clip: NULL */
    float *master;       /* adamw: the f32 master weights, or NULL */
    int64_t n;           /* elements, >= 1 */
    int64_t first, chunk;   /* elementwise kernels: first block, elements per block */
    int64_t sfirst, schunk; /* sum of squares: first block, elements per block */
    double wd;           /* adamw: this segment's weight decay (0 for gains and biases) */
    int32_t dtype;       /* tm_dtype of p (and g) */
    int32_t pad_;        /* 0 (the host compares tables bytewise) */
} tm__seg;

/* The table is an i64 tensor [capacity, TM__SEG_WORDS] (framework/ops/update.c asserts the size). */
#define TM__SEG_WORDS 12

enum {
    TM__SEG_CHUNK = 4096,        /* elements per block of the elementwise kernels */
    TM__SUMSQ_MAX_CHUNKS = 256,  /* the sum of squares' chunking (grad_sumsq too) */
    TM__SUMSQ_MIN_CHUNK = 4096
};

/* adamw_update_multi's fattr[] slots (each range carries its own weight decay, tm__seg.wd).
 * 1 - beta and the bias corrections bc = 1 - beta^step are computed in f64 by the front end. */
enum {
    TM__ADAMW_LR = 0,
    TM__ADAMW_BETA1,
    TM__ADAMW_OMB1, /* 1 - beta1 */
    TM__ADAMW_BETA2,
    TM__ADAMW_OMB2, /* 1 - beta2 */
    TM__ADAMW_EPS,
    TM__ADAMW_BC1,
    TM__ADAMW_BC2,
    TM__ADAMW_NATTR
};

/* Elements per chunk of the sum of squares of n elements (n >= 1): a function of n alone. */
static inline int64_t tm__sumsq_chunk(int64_t n) {
    int64_t chunk = (n + TM__SUMSQ_MAX_CHUNKS - 1) / TM__SUMSQ_MAX_CHUNKS;
    return chunk < TM__SUMSQ_MIN_CHUNK ? TM__SUMSQ_MIN_CHUNK : chunk;
}

#endif
