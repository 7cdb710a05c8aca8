/*
 * names.c — the context's index of its named tensors (parameters and buffers).
 *
 * Every tm_param_new / tm_buffer_new checks that its name is new, tm_ctx_find and checkpoint
 * loading look names up, and the optimizers walk the parameters by position: with a linear
 * scan each of those is O(n), and building a model of n tensors is O(n^2) (a 10,000-layer
 * model never finished). Here a name costs O(1): an open-addressing hash table (FNV-1a, linear
 * probing, at most half full) maps a name to its position in ctx->named, and ctx->params lists
 * the parameters in creation order. Named tensors are never removed, so the table needs no
 * tombstones, and growing it is the only thing that can fail: tm__names_reserve does that
 * before a tensor is made, so that registering it (tm__names_add) cannot fail half-way.
 */
#include <string.h>

#include "ctx_internal.h"

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) h = (h ^ *p) * 1099511628211ull;
    return h;
}

/* Slot of `name` in a table of cap (a power of two) slots: where it is, or the empty slot
 * where it would go. Slots hold position + 1; 0 is empty. */
static int64_t slot_of(const tm_ctx *ctx, const int *slots, int64_t cap, const char *name) {
    int64_t i = (int64_t)(name_hash(name) & (uint64_t)(cap - 1));
    while (slots[i] && strcmp(ctx->named[slots[i] - 1]->name, name) != 0) i = (i + 1) & (cap - 1);
    return i;
}

int tm__names_find(const tm_ctx *ctx, const char *name) {
    if (!ctx->name_cap) return -1;
    int s = ctx->name_slots[slot_of(ctx, ctx->name_slots, ctx->name_cap, name)];
    return s ? s - 1 : -1;
}

static tm_status grow(tm_ctx *ctx, const char *fn, void **arr, int *cap, size_t elem, int need) {
    if (need <= *cap) return TM_OK;
    if (*cap > (1 << 29)) return tm__err(ctx, TM_ERR_NOMEM, "%s: too many named tensors (%d)", fn, *cap);
    int nc = *cap ? 2 * *cap : 64;
    void *n = tm__host_alloc(ctx, elem * (size_t)nc);
    if (!n) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    if (*cap) memcpy(n, *arr, elem * (size_t)*cap);
    tm__host_free(ctx, *arr);
    *arr = n;
    *cap = nc;
    return TM_OK;
}

tm_status tm__names_reserve(tm_ctx *ctx, const char *fn) {
    TM__TRY(grow(ctx, fn, (void **)&ctx->named, &ctx->cap_named, sizeof *ctx->named, ctx->n_named + 1));
    TM__TRY(grow(ctx, fn, (void **)&ctx->params, &ctx->cap_params, sizeof *ctx->params, ctx->n_params + 1));
    if (2 * (int64_t)(ctx->n_named + 1) <= ctx->name_cap) return TM_OK;
    int cap = ctx->name_cap ? 2 * ctx->name_cap : 128;
    int *slots = tm__host_alloc(ctx, sizeof *slots * (size_t)cap);
    if (!slots) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    memset(slots, 0, sizeof *slots * (size_t)cap);
    for (int k = 0; k < ctx->n_named; k++) slots[slot_of(ctx, slots, cap, ctx->named[k]->name)] = k + 1;
    tm__host_free(ctx, ctx->name_slots);
    ctx->name_slots = slots;
    ctx->name_cap = cap;
    return TM_OK;
}

void tm__names_add(tm_ctx *ctx, tm_tensor *t) {
    int64_t i = slot_of(ctx, ctx->name_slots, ctx->name_cap, t->name);
    ctx->named[ctx->n_named++] = t;
    ctx->name_slots[i] = ctx->n_named;
    if (t->is_param) ctx->params[ctx->n_params++] = t;
}

void tm__names_free(tm_ctx *ctx) {
    tm__host_free(ctx, ctx->name_slots);
    tm__host_free(ctx, ctx->params);
    ctx->name_slots = NULL;
    ctx->params = NULL;
    ctx->name_cap = ctx->cap_params = 0;
}
