/* finite.c — non-finite values in parameters and gradients; see finite.h. */
#include "finite.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "status.h"
#include "util.h"

/* Elements read per tm_tensor_read: bounds the staging buffer (4 MiB) whatever the tensor. */
enum { CHUNK = 1 << 20 };

/* ZeRO-3: each rank holds a block of every bucket's parameters (the flat bucket view); each
 * scans its blocks, names the parameter of the first bad element, and the ranks agree on
 * whether any found one (a collective: every rank calls it). */
static int find_in_blocks(tm_ctx *ctx, tmd_nonfinite *bad, char *err, size_t errlen) {
    int64_t found = 0;
    for (int k = 0; k < tm_ctx_num_buckets(ctx) && !found; k++) {
        tm_tensor *P = tm_ctx_bucket_tensor(ctx, k, TM_BUCKET_PARAMS);
        int64_t lo, hi, n = P ? tm_tensor_numel(P) : 0;
        if (!n || tm_ctx_grad_shard(ctx, k, &lo, &hi)) continue;
        float *v = malloc(sizeof *v * (size_t)n);
        if (!v) return tmd_fail(err, errlen, -1, "out of memory checking the weights");
        if (tm_tensor_read(ctx, P, TM_F32, v, n)) {
            free(v);
            return tmd_fail(err, errlen, -1, "reading the parameters of bucket %d: %s", k, tm_ctx_errmsg(ctx));
        }
        for (int64_t j = 0; j < n && !found; j++) {
            if (isfinite(v[j])) continue;
            found = 1;
            *bad = (tmd_nonfinite){"?", lo + j, v[j]};
            for (int i = 0; i < tm_ctx_num_params(ctx); i++) {
                tm_param_info pi;
                tm_tensor *p = tm_ctx_param(ctx, i);
                if (tm_param_get_info(p, &pi) || pi.bucket != k) continue;
                if (lo + j >= pi.bucket_offset && lo + j < pi.bucket_offset + tm_tensor_numel(p))
                    *bad = (tmd_nonfinite){tm_tensor_name(p), lo + j - pi.bucket_offset, v[j]};
            }
        }
        free(v);
    }
    int64_t any = found;
    if (tm_comm_allreduce_host(ctx, TM_COMM_WORLD, TM_I64, &any, 1))
        return tmd_fail(err, errlen, -1, "checking the weights: %s", tm_ctx_errmsg(ctx));
    if (any && !found) *bad = (tmd_nonfinite){"(a parameter block of another rank)", 0, NAN};
    return any ? 1 : 0;
}

int tmd_find_nonfinite(tm_ctx *ctx, int grads, tmd_nonfinite *bad, char *err, size_t errlen) {
    if (!grads && tm_comm_get_options(ctx).zero == 3) return find_in_blocks(ctx, bad, err, errlen);
    float *buf = NULL;
    int rc = 0;
    /* The chunk views below must not land on the tape. */
    int prev = tm_ctx_set_grad_enabled(ctx, 0);
    for (int i = 0; i < tm_ctx_num_params(ctx) && !rc; i++) {
        tm_tensor *p = tm_ctx_param(ctx, i), *t = grads ? tm_tensor_grad(p) : p;
        if (!t) continue;
        int64_t n = tm_tensor_numel(t);
        if (!buf && !(buf = malloc(sizeof *buf * CHUNK))) {
            rc = tmd_fail(err, errlen, -1, "out of memory checking the weights");
            break;
        }
        tm_tensor *flat = t;
        /* Chunks of a flat view; a tensor that fits is read whole. */
        if (n > CHUNK && tm_reshape(ctx, t, 1, &n, &flat) != TM_OK) {
            rc = tmd_fail(err, errlen, -1, "reading '%s': %s", tm_tensor_name(p), tm_ctx_errmsg(ctx));
            break;
        }
        for (int64_t at = 0; at < n && !rc; at += CHUNK) {
            int64_t k = n - at < CHUNK ? n - at : CHUNK;
            tm_tensor *part = flat;
            tm_status s = n > CHUNK ? tm_slice(ctx, flat, 0, at, at + k, &part) : TM_OK;
            if (!s) s = tm_tensor_read(ctx, part, TM_F32, buf, k);
            if (s) {
                rc = tmd_fail(err, errlen, -1, "reading '%s': %s", tm_tensor_name(p), tm_ctx_errmsg(ctx));
                break;
            }
            for (int64_t j = 0; j < k; j++)
                if (!isfinite(buf[j])) {
                    *bad = (tmd_nonfinite){tm_tensor_name(p), at + j, buf[j]};
                    rc = 1;
                    break;
                }
        }
        if (n > CHUNK) tm_ctx_arena_reset(ctx);
    }
    tm_ctx_set_grad_enabled(ctx, prev);
    free(buf);
    return rc;
}

void tmd_nonfinite_describe(const tmd_nonfinite *bad, char *buf, size_t len) {
    snprintf(buf, len, "'%s' holds %s at element %lld", bad->name, isnan(bad->value) ? "nan" : bad->value > 0 ? "inf" : "-inf",
             (long long)bad->index);
}

int tmd_require_finite_weights(tm_ctx *ctx, const char *what, char *err, size_t errlen) {
    tmd_nonfinite bad;
    int rc = tmd_find_nonfinite(ctx, 0, &bad, err, errlen);
    if (rc < 0) return TMD_RUNTIME_ERROR;
    if (rc == 0) return 0;
    char d[256];
    tmd_nonfinite_describe(&bad, d, sizeof d);
    return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                    "%s holds a non-finite weight: %s (written by a run that diverged?); it cannot be used", what, d);
}
