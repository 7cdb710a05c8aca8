/*
 * kv_cache.h — private to layers/: the key/value cache object (layers/kv_cache.c) and the
 * model accessors it needs (layers/model.c). The public contract is in include/tinymoe.h
 * ("Incremental decoding").
 */
#ifndef TM_KV_CACHE_H
#define TM_KV_CACHE_H

#include "extend.h"

struct tm_kv_cache {
    tm_model *model;
    tm_ctx *ctx;
    int batch, capacity, len, n_layers;
    /* Every layer's keys and values in one persistent, unnamed tensor (tm__persistent_new: no
     * checkpoint sees it, tm_ctx_arena_reset leaves it), [2 * n_layers * batch, capacity,
     * n_kv_heads, head_dim]: k of layer l in rows [2l * batch, (2l + 1) * batch), v in the next
     * batch rows. Views of it (tm_slice) are made per forward. */
    tm_tensor *block;
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
