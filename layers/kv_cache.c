/*
 * kv_cache.c — the key/value cache of incremental decoding (tm_kv_cache_*): persistent memory
 * for the rotated keys and the values of every position a model has seen, per layer.
 *
 * The memory is one device allocation made here (not an arena: it outlives
 * tm_ctx_arena_reset; not a named buffer: checkpoints must not carry it). Writes and reads go
 * through tm__assign and tensor views, which every backend implements, so the cache itself is
 * device-generic. The cached forward that uses it is tm_model_forward_cached (layers/model.c).
 */
#include <stdint.h>
#include <stdio.h>

#include "ctx_internal.h"
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

    size_t head = (sizeof(tm_kv_cache) + 63) & ~(size_t)63;
    char *hmem = tm__host_alloc(ctx, head + sizeof(tm_tensor) * 2 * (size_t)L);
    if (!hmem) return tm__err(ctx, TM_ERR_NOMEM, "tm_kv_cache_new: out of host memory");
    void *mem = tm__dev_alloc(ctx, dev, nbytes);
    if (!mem) {
        tm__host_free(ctx, hmem);
        return tm__err(ctx, TM_ERR_NOMEM, "tm_kv_cache_new: out of %s memory for %zu bytes (batch = %d, max_len = %d)",
                       dev.type == TM_DEVICE_CPU ? "host" : "device", nbytes, batch, max_len);
    }
    /* Zeroed so that nothing ever reads uninitialised memory, not even a position past len. */
    tm_status s = tm__dev_memset0(ctx, dev, mem, nbytes);
    if (s != TM_OK) {
        tm__dev_free(ctx, dev, mem);
        tm__host_free(ctx, hmem);
        return s;
    }
    tm_kv_cache *kc = (tm_kv_cache *)hmem;
    memset(kc, 0, sizeof *kc);
    kc->model = model;
    kc->ctx = ctx;
    kc->dev = dev;
    kc->batch = batch;
    kc->capacity = max_len;
    kc->n_layers = (int)L;
    kc->storage.data = mem;
    kc->storage.nbytes = nbytes;
    kc->storage.device = dev;
    kc->slots = (tm_tensor *)(hmem + head);
    for (int64_t i = 0; i < 2 * L; i++) {
        tm_tensor *t = &kc->slots[i];
        memset(t, 0, sizeof *t);
        t->ctx = ctx;
        t->dtype = dt;
        t->device = dev;
        t->ndim = 4;
        t->shape[0] = batch, t->shape[1] = max_len, t->shape[2] = Hkv, t->shape[3] = D;
        t->stride[3] = 1, t->stride[2] = D, t->stride[1] = Hkv * D, t->stride[0] = (int64_t)max_len * Hkv * D;
        t->offset = i * slot;
        t->storage = &kc->storage;
        t->persistent = 1;
        t->name = "";
    }
    *out = kc;
    return TM_OK;
}

void tm_kv_cache_free(tm_kv_cache *kc) {
    if (!kc) return;
    tm__dev_free(kc->ctx, kc->dev, kc->storage.data);
    tm__host_free(kc->ctx, kc);
}

void tm_kv_cache_reset(tm_kv_cache *kc) {
    if (kc) kc->len = 0;
}

int tm_kv_cache_len(const tm_kv_cache *kc) { return kc ? kc->len : 0; }
int tm_kv_cache_capacity(const tm_kv_cache *kc) { return kc ? kc->capacity : 0; }

/* Positions [start, end) of a slot as a [batch, end - start, Hkv, D] view. */
static tm_status slot_view(tm_kv_cache *kc, const tm_tensor *slot, int64_t start, int64_t end, tm_tensor **out) {
    int64_t shape[4] = {slot->shape[0], end - start, slot->shape[2], slot->shape[3]};
    return tm__tensor_view(kc->ctx, slot, 4, shape, slot->stride, slot->offset + start * slot->stride[1], out);
}

tm_status tm__kv_cache_write(tm_kv_cache *kc, int l, const tm_tensor *k, const tm_tensor *v, tm_tensor **k_all,
                             tm_tensor **v_all) {
    tm_ctx *ctx = kc->ctx;
    int64_t T = k->shape[1], len = kc->len;
    const tm_tensor *src[2] = {k, v};
    tm_tensor *all[2];
    for (int i = 0; i < 2; i++) {
        const tm_tensor *slot = &kc->slots[2 * l + i];
        if (src[i]->ndim != 4 || src[i]->shape[0] != slot->shape[0] || src[i]->shape[2] != slot->shape[2] ||
            src[i]->shape[3] != slot->shape[3] || src[i]->shape[1] != T || len + T > kc->capacity)
            return tm__err(ctx, TM_ERR_INTERNAL, "kv cache write: %s at len %lld into %s", tm__tdesc(ctx, src[i]),
                           (long long)len, tm__tdesc(ctx, slot));
        tm_tensor *dst;
        TM__TRY(slot_view(kc, slot, len, len + T, &dst));
        TM__TRY(tm__assign(ctx, dst, src[i], 0, 0.0));
        TM__TRY(slot_view(kc, slot, 0, len + T, &all[i]));
    }
    *k_all = all[0];
    *v_all = all[1];
    return TM_OK;
}
