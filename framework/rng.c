/*
 * rng.c — Philox4x32-10 counter-based random numbers and tensor initialisation.
 *
 * Reference: J. Salmon, M. Moraes, R. Dror, D. Shaw, "Parallel random numbers: as easy as
 * 1, 2, 3", SC 2011 (Random123). Constants and round function as in Random123's philox.h;
 * the known-answer vectors of Random123 (kat_vectors) are checked in tests/test_rng.c.
 *
 * Element i of a tensor named N under seed S: key = (S lo, S hi), counter = (i lo, i hi,
 * h lo, h hi) with h = FNV-1a-64(N). A value depends only on (S, N, i), so a shard of a
 * tensor on any rank or device computes the same numbers as the whole tensor would.
 */
#include "comm.h"
#include "backend.h"

#include <math.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

void tm_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0, p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

uint64_t tm_hash_name(const char *name) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *p = (const unsigned char *)name; p && *p; p++) {
        h ^= *p;
        h *= 0x100000001b3ull;
    }
    return h;
}

/* Uniform in (0, 1): 53 random bits, offset by half an ulp so log() never sees 0. */
static double u01(uint32_t a, uint32_t b) {
    uint64_t x = (((uint64_t)a << 32) | b) >> 11;
    return ((double)x + 0.5) * (1.0 / 9007199254740992.0);
}

/* Values [lo, hi) of tensor t's flat elements into vals[0, hi - lo). */
static void draw(const tm_ctx *ctx, const tm_tensor *t, uint64_t h, uint64_t seed, int normal, double p0, double p1,
                 int64_t lo, int64_t hi, double *vals) {
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    /* A shard of a parameter (expert parallelism: experts [lo, hi) of E) draws the values of its
     * elements' logical indices, so every layout initialises the logical tensor alike. */
    const tm_param_options *po = t->pm && t->pm->opts.shard_axis >= 0 ? &t->pm->opts : NULL;
    int64_t lstride[TM_MAX_DIMS] = {0}, sstride[TM_MAX_DIMS] = {0};
    if (po) {
        int64_t a = 1, b = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            lstride[d] = a, sstride[d] = b;
            a *= po->logical_shape[d], b *= t->shape[d];
        }
    }
#pragma omp parallel for num_threads(ctx->n_threads) if (hi - lo > 16384)
    for (int64_t li = lo; li < hi; li++) {
        int64_t i = li;
        if (po) {
            int64_t rem = li;
            i = 0;
            for (int d = 0; d < t->ndim; d++) {
                int64_t k = rem / sstride[d];
                rem -= k * sstride[d];
                i += (k + (d == po->shard_axis ? po->shard_offset : 0)) * lstride[d];
            }
        }
        uint32_t ctr[4] = {(uint32_t)i, (uint32_t)((uint64_t)i >> 32), (uint32_t)h, (uint32_t)(h >> 32)}, r[4];
        tm_philox4x32_10(ctr, key, r);
        double u1 = u01(r[0], r[1]);
        if (normal) {
            double u2 = u01(r[2], r[3]);
            vals[li - lo] = p0 + p1 * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
        } else {
            vals[li - lo] = p0 + (p1 - p0) * u1;
        }
    }
}

/* The group of ranks that hold the same values of parameter t (its data-parallel replicas), or
 * -1 when t is not such a parameter, has none, or has master weights to keep in step (an
 * optimizer exists: the whole-tensor write does that). */
static int replica_group(const tm_ctx *ctx, const tm_tensor *t, int *G, int *me) {
    const tm__comm *c = ctx->comm;
    if (!c || !t->pm || t->pm->master || ctx->buckets[t->pm->bucket]->has_master) return -1;
    int g = t->pm->opts.group == TM_PARAM_EXPERT ? TM_COMM_EXPERT_DP : TM_COMM_DP;
    if (c->size[g] < 2) return -1;
    *G = c->size[g];
    *me = c->rank[g];
    return g;
}

/* Each of the G replicas draws elements [me blk, (me + 1) blk) and an all-gather over their
 * group fills in the rest: the same bits (a value depends on its logical index only) in 1/G of
 * the host's time. A 4-GPU data-parallel start of the fine preset drew all 894M values on every
 * rank (14.7 s). */
static tm_status init_replicated(tm_ctx *ctx, tm_tensor *t, int g, int G, int me, uint64_t h, uint64_t seed, int normal,
                                 double p0, double p1) {
    int64_t n = tm__numel(t), blk = (n + G - 1) / G;
    int64_t lo = me * blk < n ? me * blk : n, hi = lo + blk < n ? lo + blk : n;
    size_t es = tm_dtype_size(t->dtype);
    int64_t *cd = tm__meta_alloc(ctx, sizeof(int64_t) * 2 * (size_t)G);
    double *vals = tm__arena_alloc(ctx, tm_cpu(), (size_t)(hi - lo + 1) * sizeof(double));
    void *conv = tm__arena_alloc(ctx, tm_cpu(), (size_t)(hi - lo + 1) * es);
    if (!cd || !vals || !conv) return TM_ERR_NOMEM;
    for (int j = 0; j < G; j++) {
        int64_t a = j * blk < n ? j * blk : n, b = a + blk < n ? a + blk : n;
        cd[j] = b - a;
        cd[G + j] = a;
    }
    draw(ctx, t, h, seed, normal, p0, p1, lo, hi, vals);
    tm__host_ops()->convert(conv, t->dtype, vals, TM_F64, hi - lo, ctx->n_threads);
    tm__mirror_drop(ctx, t);
    char *data = tm__data(t);
    TM__TRY(tm__memcpy(ctx, data + (size_t)lo * es, t->device, conv, tm_cpu(), (size_t)(hi - lo) * es));
    return tm__coll_allgatherv(ctx, g, data + (size_t)lo * es, data, cd, cd + G, t->dtype, t->device);
}

static tm_status init_common(tm_ctx *ctx, const char *fn, tm_tensor *t, const char *name, int normal,
                             uint64_t seed, double p0, double p1, int replicated) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!t) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: tensor is NULL", fn);
    if (!tm__is_float(t->dtype)) return tm__err(ctx, TM_ERR_DTYPE, "%s: %s is not a float tensor", fn, tm__tdesc(ctx, t));
    if (!tm__is_contiguous(t)) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s is a strided view", fn, tm__tdesc(ctx, t));
    if (normal && !(p1 >= 0)) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: std must be >= 0, got %g", fn, p1);
    if (!normal && !(p0 <= p1)) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: lo %g > hi %g", fn, p0, p1);
    const char *nm = name ? name : t->name;
    if (!nm || !*nm) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s has no name; pass one (it keys the random stream)", fn, tm__tdesc(ctx, t));
    uint64_t h = tm_hash_name(nm);
    int64_t n = tm__numel(t);
    int mark = tm__scope_open(ctx); /* the values go back to the arena when written */
    int G = 1, me = 0, g = replicated ? replica_group(ctx, t, &G, &me) : -1;
    tm_status s;
    if (g >= 0) {
        s = init_replicated(ctx, t, g, G, me, h, seed, normal, p0, p1);
    } else {
        double *vals = tm__arena_alloc(ctx, tm_cpu(), (size_t)(n ? n : 1) * sizeof(double));
        if (!vals) {
            tm__scope_close(ctx, mark, NULL, 0);
            return TM_ERR_NOMEM;
        }
        draw(ctx, t, h, seed, normal, p0, p1, 0, n, vals);
        s = tm_tensor_write(ctx, t, TM_F64, vals, n);
    }
    tm__scope_close(ctx, mark, NULL, 0);
    return s;
}

tm_status tm_tensor_init_normal(tm_ctx *ctx, tm_tensor *t, uint64_t seed, const char *name, double mean, double std) {
    return init_common(ctx, "tm_tensor_init_normal", t, name, 1, seed, mean, std, 0);
}

tm_status tm__param_init_normal_replicated(tm_ctx *ctx, tm_tensor *t, uint64_t seed, double mean, double std) {
    return init_common(ctx, "tm_tensor_init_normal", t, NULL, 1, seed, mean, std, 1);
}

tm_status tm_tensor_init_uniform(tm_ctx *ctx, tm_tensor *t, uint64_t seed, const char *name, double lo, double hi) {
    return init_common(ctx, "tm_tensor_init_uniform", t, name, 0, seed, lo, hi, 0);
}
