/*
 * kv_cache.c — the key/value cache of incremental decoding (tm_kv_cache_*): persistent memory
 * for the rotated keys and the values of every position a model has seen, per layer.
 *
 * The memory is one persistent tensor owned by the cache (tm__persistent_new: not an arena
 * block, it outlives tm_ctx_arena_reset; not a named buffer, checkpoints must not carry it).
 * Writes and reads go through tm__assign and tm_slice views, which every backend implements,
 * so the cache itself is device-generic. It starts zeroed, so that nothing ever reads
 * uninitialised memory, not even a position past len. The cached forward that uses it is
 * tm_model_forward_cached (layers/model.c).
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kv_cache.h"

#define BAD(...) tm__err(ctx, TM_ERR_INVALID_ARG, __VA_ARGS__)

tm_status tm_kv_cache_new(tm_model *model, int batch, int max_len, tm_kv_cache **out) {
    if (!model) return TM_ERR_INVALID_ARG;
    tm_ctx *ctx = tm__model_ctx(model);
    if (!out) return BAD("tm_kv_cache_new: out is NULL");
    const tm_model_config *c = tm_model_get_config(model);
    if (batch < 1) return BAD("tm_kv_cache_new: batch = %d must be >= 1", batch);
    if (max_len < 1 || max_len > c->max_seq_len)
        return BAD("tm_kv_cache_new: max_len = %d must be in [1, max_seq_len = %d]", max_len, c->max_seq_len);
    tm_dtype dt = tm__model_dtype(model);
    tm_device dev = tm__model_device(model);
    int64_t D = c->d_model / c->n_heads, Hkv = c->n_kv_heads, L = c->n_layers;
    int64_t slot = (int64_t)batch * max_len * Hkv * D; /* elements of one layer's k (or v) */
    size_t esz = tm_dtype_size(dt);
    if ((uint64_t)slot > SIZE_MAX / esz / 2 / (uint64_t)L)
        return tm__err(ctx, TM_ERR_NOMEM, "tm_kv_cache_new: batch = %d x max_len = %d does not fit in memory", batch,
                       max_len);
    size_t nbytes = (size_t)slot * esz * 2 * (size_t)L;

    tm_kv_cache *kc = tm__host_alloc(ctx, sizeof *kc);
    if (!kc) return tm__err(ctx, TM_ERR_NOMEM, "tm_kv_cache_new: out of host memory");
    memset(kc, 0, sizeof *kc);
    int64_t shape[4] = {2 * L * batch, max_len, Hkv, D};
    tm_status s = tm__persistent_new(ctx, "tm_kv_cache_new", dt, 4, shape, dev, &kc->block);
    if (s != TM_OK) {
        tm__host_free(ctx, kc);
        if (s != TM_ERR_NOMEM) return s;
        return tm__err(ctx, TM_ERR_NOMEM, "tm_kv_cache_new: out of %s memory for %zu bytes (batch = %d, max_len = %d)",
                       dev.type == TM_DEVICE_CPU ? "host" : "device", nbytes, batch, max_len);
    }
    kc->model = model;
    kc->ctx = ctx;
    kc->batch = batch;
    kc->capacity = max_len;
    kc->n_layers = (int)L;
    *out = kc;
    return TM_OK;
}

void tm_kv_cache_free(tm_kv_cache *kc) {
    if (!kc) return;
    tm__persistent_free(kc->ctx, kc->block);
    tm__host_free(kc->ctx, kc);
}

void tm_kv_cache_reset(tm_kv_cache *kc) {
    if (kc) kc->len = 0;
}

int tm_kv_cache_len(const tm_kv_cache *kc) { return kc ? kc->len : 0; }
int tm_kv_cache_capacity(const tm_kv_cache *kc) { return kc ? kc->capacity : 0; }

/* Slot i (k of layer l at 2l, v at 2l + 1) as a [batch, capacity, Hkv, D] view. */
static tm_status slot_view(tm_kv_cache *kc, int64_t i, tm_tensor **out) {
    return tm_slice(kc->ctx, kc->block, 0, i * kc->batch, (i + 1) * kc->batch, out);
}

tm_status tm__kv_cache_write(tm_kv_cache *kc, int l, const tm_tensor *k, const tm_tensor *v, tm_tensor **k_all,
                             tm_tensor **v_all) {
    tm_ctx *ctx = kc->ctx;
    int64_t T = tm_tensor_dim(k, 1), len = kc->len;
    const tm_tensor *src[2] = {k, v};
    tm_tensor *all[2];
    for (int i = 0; i < 2; i++) {
        tm_tensor *slot;
        TM__TRY(slot_view(kc, 2 * (int64_t)l + i, &slot));
        if (tm_tensor_ndim(src[i]) != 4 || tm_tensor_dim(src[i], 0) != tm_tensor_dim(slot, 0) ||
            tm_tensor_dim(src[i], 2) != tm_tensor_dim(slot, 2) || tm_tensor_dim(src[i], 3) != tm_tensor_dim(slot, 3) ||
            tm_tensor_dim(src[i], 1) != T || len + T > kc->capacity)
            return tm__err(ctx, TM_ERR_INTERNAL, "kv cache write: %s at len %lld into %s", tm__tdesc(ctx, src[i]),
                           (long long)len, tm__tdesc(ctx, slot));
        tm_tensor *dst;
        TM__TRY(tm_slice(ctx, slot, 1, len, len + T, &dst));
        TM__TRY(tm__assign(ctx, dst, src[i], 0, 0.0));
        TM__TRY(tm_slice(ctx, slot, 1, 0, len + T, &all[i]));
    }
    *k_all = all[0];
    *v_all = all[1];
    return TM_OK;
}
