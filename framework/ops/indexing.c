/*
 * indexing.c — row and element lookups by integer index: tm_embedding, tm_index_select,
 * tm_gather, tm_scatter_add; and tm_index_check, which validates indices on their device.
 * Public entry points and checks; kernels in kernels/cpu/indexing.c and kernels/cuda/indexing.cu.
 * Index values are range-checked by the forward kernels, which is where the index data is
 * readable (on the host for the CPU backend, on the device for CUDA, which reads a flag back);
 * checks here cover dtypes and shapes only. Both backends report a bad index with the message
 * of tm__index_range_err.
 *
 * Call layout of embedding, index_select, gather, scatter_add: in[0] the float table / source,
 * in[1] the indices; iattr[0] n_rows (scatter_add); iattr[1] 1: the indices are known valid
 * (tm__embedding_unchecked), so the CUDA forward does not read its bad-index flag back.
 */
#include <stdio.h>

#include "internal.h"

/* "[i0,i1,...]": the multi-index of flat element i of t ("[]" for a scalar). */
static const char *pos_str(char *buf, size_t cap, const tm_tensor *t, int64_t i) {
    int64_t sub[TM_MAX_DIMS];
    for (int d = t->ndim - 1; d >= 0; d--) {
        sub[d] = t->shape[d] ? i % t->shape[d] : 0;
        i = t->shape[d] ? i / t->shape[d] : 0;
    }
    size_t len = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < t->ndim && len < cap; d++)
        len += (size_t)snprintf(buf + len, cap - len, d ? ",%lld" : "%lld", (long long)sub[d]);
    if (len < cap) snprintf(buf + len, cap - len, "]");
    return buf;
}

int64_t tm__index_range_hi(const tm__call *c) {
    switch (c->op) {
    case TM__OP_GATHER: return c->in[0]->shape[1];
    case TM__OP_SCATTER_ADD: return c->iattr[0];
    default: return c->in[0]->shape[0]; /* embedding, index_select */
    }
}

tm_status tm__index_range_err(tm__call *c, int64_t pos, int64_t value) {
    tm_ctx *ctx = c->ctx;
    const char *idx_name = c->op == TM__OP_EMBEDDING ? "ids" : "idx";
    char what[96], pos_buf[96];
    switch (c->op) {
    case TM__OP_GATHER: snprintf(what, sizeof what, "the columns of x %s", tm__tdesc(ctx, c->src[0])); break;
    case TM__OP_SCATTER_ADD:
        snprintf(what, sizeof what, "the rows of out (n_rows = %lld)", (long long)c->iattr[0]);
        break;
    default:
        snprintf(what, sizeof what, "the rows of %s %s", c->op == TM__OP_EMBEDDING ? "weight" : "x",
                 tm__tdesc(ctx, c->src[0]));
    }
    return tm__err(ctx, TM_ERR_INDEX, "%s: %s%s = %lld is outside [0, %lld), %s; %s %s", tm__opname(c), idx_name,
                   pos_str(pos_buf, sizeof pos_buf, c->in[1], pos), (long long)value,
                   (long long)tm__index_range_hi(c), what, idx_name, tm__tdesc(ctx, c->src[1]));
}

tm_status tm__embedding_check(tm__call *c) {
    const tm_tensor *w = c->in[0], *ids = c->in[1];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_ndim(c, 0, 2, 2));
    TM__TRY(tm__check_index(c, 1));
    TM__TRY(tm__check_ndim(c, 1, 0, TM_MAX_DIMS - 1)); /* out appends C */
    int64_t shape[TM_MAX_DIMS];
    for (int d = 0; d < ids->ndim; d++) shape[d] = ids->shape[d];
    shape[ids->ndim] = w->shape[1];
    return tm__out_new(c, 0, w->dtype, ids->ndim + 1, shape);
}

tm_status tm__index_select_check(tm__call *c) {
    const tm_tensor *x = c->in[0], *idx = c->in[1];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_ndim(c, 0, 2, 2));
    TM__TRY(tm__check_index(c, 1));
    TM__TRY(tm__check_ndim(c, 1, 1, 1));
    int64_t shape[2] = {idx->shape[0], x->shape[1]};
    return tm__out_new(c, 0, x->dtype, 2, shape);
}

tm_status tm__gather_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *idx = c->in[1];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_ndim(c, 0, 2, 2));
    TM__TRY(tm__check_index(c, 1));
    TM__TRY(tm__check_ndim(c, 1, 2, 2));
    if (idx->shape[0] != x->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "gather: idx must have the %lld rows of x, got x %s, idx %s",
                       (long long)x->shape[0], tm__tdesc(ctx, x), tm__tdesc(ctx, idx));
    return tm__out_new(c, 0, x->dtype, 2, idx->shape);
}

tm_status tm__scatter_add_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *src = c->in[0], *idx = c->in[1];
    int64_t n_rows = c->iattr[0];
    TM__TRY(tm__check_float(c, 0));
    TM__TRY(tm__check_ndim(c, 0, 2, 2));
    TM__TRY(tm__check_index(c, 1));
    TM__TRY(tm__check_ndim(c, 1, 1, 1));
    if (idx->shape[0] != src->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "scatter_add: idx must have one entry per row of src, got src %s, idx %s",
                       tm__tdesc(ctx, src), tm__tdesc(ctx, idx));
    if (n_rows < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "scatter_add: n_rows must be >= 0, got %lld", (long long)n_rows);
    int64_t shape[2] = {n_rows, src->shape[1]};
    return tm__out_new(c, 0, src->dtype, 2, shape);
}

static tm_status run3(tm_ctx *ctx, int op, tm_tensor *a, tm_tensor *b, int64_t iattr0, int checked, int unique,
                      tm_tensor **out) {
    tm__call c = tm__call_init(ctx, op);
    c.n_in = 2;
    c.in[0] = a;
    c.in[1] = b;
    c.iattr[0] = iattr0;
    c.iattr[1] = checked;
    c.iattr[2] = unique;
    return tm__op_run1(&c, out);
}

static tm_status run2(tm_ctx *ctx, int op, tm_tensor *a, tm_tensor *b, int64_t iattr0, int checked,
                      tm_tensor **out) {
    return run3(ctx, op, a, b, iattr0, checked, 0, out);
}

tm_status tm_embedding(tm_ctx *ctx, tm_tensor *weight, tm_tensor *ids, tm_tensor **out) {
    return run2(ctx, TM__OP_EMBEDDING, weight, ids, 0, 0, out);
}

tm_status tm__embedding_unchecked(tm_ctx *ctx, tm_tensor *weight, tm_tensor *ids, tm_tensor **out) {
    return run2(ctx, TM__OP_EMBEDDING, weight, ids, 0, 1, out);
}

tm_status tm__embedding_unique(tm_ctx *ctx, tm_tensor *weight, tm_tensor *ids, tm_tensor **out) {
    return run3(ctx, TM__OP_EMBEDDING, weight, ids, 0, 1, 1, out);
}

tm_status tm_index_select(tm_ctx *ctx, tm_tensor *x, tm_tensor *idx, tm_tensor **out) {
    return run2(ctx, TM__OP_INDEX_SELECT, x, idx, 0, 0, out);
}

tm_status tm_gather(tm_ctx *ctx, tm_tensor *x, tm_tensor *idx, tm_tensor **out) {
    return run2(ctx, TM__OP_GATHER, x, idx, 0, 0, out);
}

tm_status tm_scatter_add(tm_ctx *ctx, tm_tensor *src, tm_tensor *idx, int64_t n_rows, tm_tensor **out) {
    return run2(ctx, TM__OP_SCATTER_ADD, src, idx, n_rows, 0, out);
}

/* ids i32/i64 of any shape; iattr[0] hi >= 0, iattr[1] ignore_index. out[0] ids' dtype and
 * shape, out[1] i64 [2]. */
tm_status tm__index_check_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *ids = c->in[0];
    TM__TRY(tm__check_index(c, 0));
    if (c->iattr[0] < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "index_check: hi = %lld must be >= 0 (ids %s)", (long long)c->iattr[0],
                       tm__tdesc(ctx, ids));
    if (ids->dtype == TM_I32 && (c->iattr[1] < INT32_MIN || c->iattr[1] > INT32_MAX))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "index_check: ignore_index = %lld does not fit the i32 ids %s",
                       (long long)c->iattr[1], tm__tdesc(ctx, ids));
    int64_t two[1] = {2};
    TM__TRY(tm__out_new(c, 0, ids->dtype, ids->ndim, ids->shape));
    return tm__out_new(c, 1, TM_I64, 1, two);
}

tm_status tm_index_check(tm_ctx *ctx, tm_tensor *ids, int64_t hi, int64_t ignore_index, tm_tensor **safe,
                         tm_tensor **first_bad) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!safe || !first_bad)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "index_check: %s is NULL", safe ? "first_bad" : "safe");
    tm__call c = tm__call_init(ctx, TM__OP_INDEX_CHECK);
    c.n_in = 1;
    c.in[0] = ids;
    c.iattr[0] = hi;
    c.iattr[1] = ignore_index;
    TM__TRY(tm__op_run(&c));
    *safe = c.out[0];
    *first_bad = c.out[1];
    return TM_OK;
}
