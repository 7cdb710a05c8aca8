/*
 * kv_cache.h — private to layers/: the key/value cache object (layers/kv_cache.c) and the
 * model accessors it needs (layers/model.c). The public contract is in include/tinymoe.h
 * ("Incremental decoding").
 */
#ifndef TM_KV_CACHE_H
#define TM_KV_CACHE_H

#include "internal.h"

struct tm_kv_cache {
    tm_model *model;
    tm_ctx *ctx;
    tm_device dev;
    int batch, capacity, len, n_layers;
    /* One device block for every layer: k of layer l at slot 2l, v at 2l + 1, each
     * [batch, capacity, n_kv_heads, head_dim] contiguous. The headers are persistent and
     * unnamed (no checkpoint sees them); views of them are made per forward. */
    tm__storage storage;
    tm_tensor *slots; /* [2 * n_layers] */
};

/* The model's context, dtype and device (layers/model.c). */
tm_ctx *tm__model_ctx(const tm_model *m);
tm_dtype tm__model_dtype(const tm_model *m);
tm_device tm__model_device(const tm_model *m);

/* Write k and v ([batch, T, n_kv_heads, head_dim], the cache's dtype and device, any strides)
 * at positions [len, len + T) of layer l's slots and return views of positions [0, len + T)
 * in *k_all, *v_all (arena headers over the cache memory). len is not advanced: the caller
 * does that once every layer has succeeded. Not taped. */
tm_status tm__kv_cache_write(tm_kv_cache *c, int l, const tm_tensor *k, const tm_tensor *v, tm_tensor **k_all,
                             tm_tensor **v_all);

#endif
