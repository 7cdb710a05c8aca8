/*
 * shape.c — reshape / transpose / permute / slice (views), concat, contiguous, cast,
 * to_device. These are device-generic: they move bytes with tm__assign / tm__copy_into /
 * tm__accumulate / tm__memcpy, which each backend implements.
 *
 * A view is one op ("view") whose attributes describe it twice:
 *   iattr[0]        ndim of the view
 *   iattr[1..4]     shape
 *   iattr[5..8]     strides in the input's *logical* (row-major contiguous) index space
 *   iattr[9]        offset in that space
 *   iattr[10..13]   strides in the input's actual storage
 *   iattr[14]       offset relative to the input's storage offset
 * The forward is free (the check builds the view); the backward adds the upstream gradient
 * into the logical view of the input's gradient, which is always contiguous.
 */
#include "../internal.h"

enum { V_NDIM = 0, V_SHAPE = 1, V_LSTRIDE = 5, V_LOFF = 9, V_ASTRIDE = 10, V_AOFF = 14 };

static void dense_strides(int ndim, const int64_t *shape, int64_t *stride) {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        stride[i] = s;
        s *= shape[i];
    }
}

static tm_status run_view(tm_ctx *ctx, tm_tensor *x, int ndim, const int64_t *shape, const int64_t *lstride,
                          int64_t loff, const int64_t *astride, int64_t aoff, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_VIEW);
    c.n_in = 1;
    c.in[0] = x;
    c.iattr[V_NDIM] = ndim;
    for (int i = 0; i < ndim; i++) {
        c.iattr[V_SHAPE + i] = shape[i];
        c.iattr[V_LSTRIDE + i] = lstride[i];
        c.iattr[V_ASTRIDE + i] = astride[i];
    }
    c.iattr[V_LOFF] = loff;
    c.iattr[V_AOFF] = aoff;
    return tm__op_run1(&c, out);
}

tm_status tm__view_check(tm__call *c) {
    int64_t shape[TM_MAX_DIMS], stride[TM_MAX_DIMS];
    int nd = (int)c->iattr[V_NDIM];
    for (int i = 0; i < nd; i++) {
        shape[i] = c->iattr[V_SHAPE + i];
        stride[i] = c->iattr[V_ASTRIDE + i];
    }
    tm_tensor *x = c->in[0];
    return tm__tensor_view(c->ctx, x, nd, shape, stride, x->offset + c->iattr[V_AOFF], &c->out[0]);
}

tm_status tm__view_forward(tm__call *c) { return TM_OK; }

tm_status tm__view_backward(tm__call *c) {
    if (!c->gin[0]) return TM_OK;
    int64_t shape[TM_MAX_DIMS], stride[TM_MAX_DIMS];
    int nd = (int)c->iattr[V_NDIM];
    for (int i = 0; i < nd; i++) {
        shape[i] = c->iattr[V_SHAPE + i];
        stride[i] = c->iattr[V_LSTRIDE + i];
    }
    tm_tensor *g = c->gin[0], *v;
    TM__TRY(tm__tensor_view(c->ctx, g, nd, shape, stride, g->offset + c->iattr[V_LOFF], &v));
    return tm__assign(c->ctx, v, c->gout[0], 1, 1.0);
}

int tm__view_grad_adopt(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *x = c->src[0], *o = c->out[0], *g = c->gout[0], *v;
    int nd = (int)c->iattr[V_NDIM];
    if (c->in[0] != x || !x->requires_grad || x->grad || x->persistent || !x->node || !g || g->persistent ||
        !g->storage || !g->storage->arena_bytes || g->dtype != x->dtype || !tm__is_contiguous(g) ||
        c->iattr[V_LOFF] != 0 || tm__numel(o) != tm__numel(x))
        return 0;
    /* a reshape: its output read densely from the input's first element */
    int64_t s = 1;
    for (int i = nd - 1; i >= 0; i--) {
        if (o->shape[i] != 1 && c->iattr[V_LSTRIDE + i] != s) return 0;
        s *= o->shape[i];
    }
    int64_t st[TM_MAX_DIMS];
    dense_strides(x->ndim, x->shape, st);
    if (tm__tensor_view(ctx, g, x->ndim, x->shape, st, g->offset, &v) != TM_OK) return 0;
    x->grad = v;
    /* the block is x's gradient's now: the release of this node's gradients must leave it */
    c->gout[0] = NULL;
    if (o->grad == g) o->grad = NULL;
    return 1;
}

static tm_status need(tm_ctx *ctx, const char *fn, const void *x, tm_tensor **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: out is NULL", fn);
    if (!x) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: input is NULL", fn);
    return TM_OK;
}

tm_status tm_reshape(tm_ctx *ctx, tm_tensor *x, int ndim, const int64_t *shape, tm_tensor **out) {
    TM__TRY(need(ctx, "reshape", x, out));
    if (ndim < 0 || ndim > TM_MAX_DIMS || (ndim > 0 && !shape))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "reshape: ndim %d outside [0, %d] or shape NULL", ndim, TM_MAX_DIMS);
    int64_t s[TM_MAX_DIMS], known = 1;
    int infer = -1;
    for (int i = 0; i < ndim; i++) {
        s[i] = shape[i];
        if (s[i] == -1) {
            if (infer >= 0) return tm__err(ctx, TM_ERR_SHAPE, "reshape: more than one -1 in %s", tm__sdesc(ctx, ndim, shape));
            infer = i;
        } else if (s[i] < 0) {
            return tm__err(ctx, TM_ERR_SHAPE, "reshape: negative size in %s", tm__sdesc(ctx, ndim, shape));
        } else {
            known *= s[i];
        }
    }
    int64_t n = tm__numel(x);
    if (infer >= 0) {
        if (known == 0 || n % known)
            return tm__err(ctx, TM_ERR_SHAPE, "reshape: cannot reshape %s into %s", tm__tdesc(ctx, x), tm__sdesc(ctx, ndim, shape));
        s[infer] = n / known;
        known *= s[infer];
    }
    if (known != n)
        return tm__err(ctx, TM_ERR_SHAPE, "reshape: cannot reshape %s (%lld elements) into %s", tm__tdesc(ctx, x),
                       (long long)n, tm__sdesc(ctx, ndim, shape));
    if (!tm__is_contiguous(x)) TM__TRY(tm_contiguous(ctx, x, &x));
    int64_t st[TM_MAX_DIMS];
    dense_strides(ndim, s, st);
    return run_view(ctx, x, ndim, s, st, 0, st, 0, out);
}

tm_status tm_permute(tm_ctx *ctx, tm_tensor *x, const int *perm, tm_tensor **out) {
    TM__TRY(need(ctx, "permute", x, out));
    if (!perm) return tm__err(ctx, TM_ERR_INVALID_ARG, "permute: perm is NULL");
    int seen[TM_MAX_DIMS] = {0};
    int64_t shape[TM_MAX_DIMS], ls[TM_MAX_DIMS], as[TM_MAX_DIMS], dense[TM_MAX_DIMS];
    dense_strides(x->ndim, x->shape, dense);
    for (int i = 0; i < x->ndim; i++) {
        int p = tm__axis(perm[i], x->ndim);
        if (p < 0 || seen[p])
            return tm__err(ctx, TM_ERR_INVALID_ARG, "permute: perm[%d] = %d is not a permutation of the %d dims of %s", i,
                           perm[i], x->ndim, tm__tdesc(ctx, x));
        seen[p] = 1;
        shape[i] = x->shape[p];
        ls[i] = dense[p];
        as[i] = x->stride[p];
    }
    return run_view(ctx, x, x->ndim, shape, ls, 0, as, 0, out);
}

tm_status tm_transpose(tm_ctx *ctx, tm_tensor *x, int axis0, int axis1, tm_tensor **out) {
    TM__TRY(need(ctx, "transpose", x, out));
    int a = tm__axis(axis0, x->ndim), b = tm__axis(axis1, x->ndim);
    if (a < 0 || b < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "transpose: axes (%d, %d) out of range for %s", axis0, axis1, tm__tdesc(ctx, x));
    int perm[TM_MAX_DIMS];
    for (int i = 0; i < x->ndim; i++) perm[i] = i;
    perm[a] = b;
    perm[b] = a;
    return tm_permute(ctx, x, perm, out);
}

tm_status tm_slice(tm_ctx *ctx, tm_tensor *x, int axis, int64_t start, int64_t end, tm_tensor **out) {
    TM__TRY(need(ctx, "slice", x, out));
    int a = tm__axis(axis, x->ndim);
    if (a < 0) return tm__err(ctx, TM_ERR_INVALID_ARG, "slice: axis %d out of range for %s", axis, tm__tdesc(ctx, x));
    int64_t n = x->shape[a], s0 = start < 0 ? start + n : start, e0 = end < 0 ? end + n : end;
    if (s0 < 0 || e0 > n || s0 > e0)
        return tm__err(ctx, TM_ERR_INDEX, "slice: [%lld, %lld) is not inside [0, %lld) of axis %d of %s", (long long)start,
                       (long long)end, (long long)n, axis, tm__tdesc(ctx, x));
    int64_t shape[TM_MAX_DIMS], dense[TM_MAX_DIMS];
    dense_strides(x->ndim, x->shape, dense);
    for (int i = 0; i < x->ndim; i++) shape[i] = x->shape[i];
    shape[a] = e0 - s0;
    return run_view(ctx, x, x->ndim, shape, dense, s0 * dense[a], x->stride, s0 * x->stride[a], out);
}

/* ---- contiguous ------------------------------------------------------------------------ */

tm_status tm__contiguous_check(tm__call *c) {
    return tm__out_new(c, 0, c->in[0]->dtype, c->in[0]->ndim, c->in[0]->shape);
}
tm_status tm__contiguous_forward(tm__call *c) { return tm__copy_into(c->ctx, c->out[0], c->in[0]); }
/* contiguous, cast and concat write each input gradient whole (TM__OP_GRAD_WRITES): a fresh
 * one (call->gin_fresh) gets the upstream gradient copied in (tm__assign with accumulate 0,
 * converting dtypes) instead of zeros plus an accumulate; the same values (a -0.0 stays -0.0
 * where 0 + x would give +0.0, as in a beta-0 GEMM). */
static tm_status grad_to(tm__call *c, int i, const tm_tensor *g) {
    if (c->gin_fresh[i]) return tm__assign(c->ctx, c->gin[i], g, 0, 1.0);
    return tm__accumulate(c->ctx, c->gin[i], g, 1.0);
}

tm_status tm__contiguous_backward(tm__call *c) {
    return c->gin[0] ? grad_to(c, 0, c->gout[0]) : TM_OK;
}

tm_status tm_contiguous(tm_ctx *ctx, tm_tensor *x, tm_tensor **out) {
    TM__TRY(need(ctx, "contiguous", x, out));
    if (tm__is_contiguous(x)) {
        *out = x;
        return TM_OK;
    }
    tm__call c = tm__call_init(ctx, TM__OP_CONTIGUOUS);
    c.n_in = 1;
    c.in[0] = x;
    return tm__op_run1(&c, out);
}

/* ---- cast -------------------------------------------------------------------------------- */

tm_status tm__cast_check(tm__call *c) {
    tm_dtype dt = (tm_dtype)c->iattr[0];
    if ((unsigned)dt >= TM_NDTYPES) return tm__err(c->ctx, TM_ERR_DTYPE, "cast: target dtype %d is not a tm_dtype", (int)dt);
    if (dt == TM_F64 && c->in[0]->device.type == TM_DEVICE_CUDA)
        return tm__err(c->ctx, TM_ERR_DTYPE, "cast: f64 is CPU-only, cannot cast %s", tm__tdesc(c->ctx, c->in[0]));
    return tm__out_new(c, 0, dt, c->in[0]->ndim, c->in[0]->shape);
}
tm_status tm__cast_forward(tm__call *c) { return tm__copy_into(c->ctx, c->out[0], c->in[0]); }
tm_status tm__cast_backward(tm__call *c) {
    if (!c->gin[0]) return TM_OK;
    if (!tm__is_float(c->out[0]->dtype)) return tm__gin_prepare(c, 0); /* no gradient through an index cast */
    tm_tensor *g = c->gout[0];
    if (c->gin_fresh[0]) return tm__assign(c->ctx, c->gin[0], g, 0, 1.0); /* converted in one pass */
    if (g->dtype != c->gin[0]->dtype) {
        tm_tensor *t;
        TM__TRY(tm__tensor_new(c->ctx, c->gin[0]->dtype, g->ndim, g->shape, g->device, &t));
        TM__TRY(tm__copy_into(c->ctx, t, g));
        g = t;
    }
    return tm__accumulate(c->ctx, c->gin[0], g, 1.0);
}

tm_status tm_cast(tm_ctx *ctx, tm_tensor *x, tm_dtype dt, tm_tensor **out) {
    TM__TRY(need(ctx, "cast", x, out));
    tm__call c = tm__call_init(ctx, TM__OP_CAST);
    c.n_in = 1;
    c.in[0] = x;
    c.iattr[0] = dt;
    return tm__op_run1(&c, out);
}

/* ---- to_device ----------------------------------------------------------------------------- */

tm_status tm__to_device_check(tm__call *c) {
    tm_device d = {(tm_device_type)c->iattr[0], (int)c->iattr[1]};
    tm_tensor *x = c->in[0];
    return tm__tensor_new(c->ctx, x->dtype, x->ndim, x->shape, d, &c->out[0]);
}

static tm_status copy_across(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src) {
    if (!tm__is_contiguous(src)) {
        tm_tensor *t;
        TM__TRY(tm__contiguous_copy(ctx, src, &t));
        src = t;
    }
    return tm__memcpy(ctx, tm__data(dst), dst->device, tm__data(src), src->device,
                      (size_t)tm__numel(src) * tm_dtype_size(src->dtype));
}

tm_status tm__to_device_forward(tm__call *c) { return copy_across(c->ctx, c->out[0], c->in[0]); }
tm_status tm__to_device_backward(tm__call *c) {
    if (!c->gin[0]) return TM_OK;
    tm_tensor *g;
    TM__TRY(tm__tensor_new(c->ctx, c->gin[0]->dtype, c->gin[0]->ndim, c->gin[0]->shape, c->gin[0]->device, &g));
    TM__TRY(copy_across(c->ctx, g, c->gout[0]));
    return tm__accumulate(c->ctx, c->gin[0], g, 1.0);
}

tm_status tm_to_device(tm_ctx *ctx, tm_tensor *x, tm_device dev, tm_tensor **out) {
    TM__TRY(need(ctx, "to_device", x, out));
    tm__call c = tm__call_init(ctx, TM__OP_TO_DEVICE);
    c.n_in = 1;
    c.in[0] = x;
    c.iattr[0] = dev.type;
    c.iattr[1] = dev.index;
    return tm__op_run1(&c, out);
}

/* ---- concat -------------------------------------------------------------------------------- */

tm_status tm__concat_check(tm__call *c) {
    tm_tensor *x0 = c->in[0];
    int a = tm__axis((int)c->iattr[0], x0->ndim);
    if (a < 0) return tm__err(c->ctx, TM_ERR_INVALID_ARG, "concat: axis %d out of range for %s", (int)c->iattr[0], tm__tdesc(c->ctx, x0));
    c->iattr[0] = a;
    int64_t shape[TM_MAX_DIMS];
    for (int i = 0; i < x0->ndim; i++) shape[i] = x0->shape[i];
    shape[a] = 0;
    for (int k = 0; k < c->n_in; k++) {
        tm_tensor *x = c->in[k];
        TM__TRY(tm__check_same_dtype(c, 0, k));
        int ok = x->ndim == x0->ndim;
        for (int i = 0; ok && i < x0->ndim; i++) ok = i == a || x->shape[i] == x0->shape[i];
        if (!ok)
            return tm__err(c->ctx, TM_ERR_SHAPE, "concat: input %d %s does not match input 0 %s outside axis %d", k,
                           tm__tdesc(c->ctx, x), tm__tdesc(c->ctx, x0), a);
        shape[a] += x->shape[a];
    }
    return tm__out_new(c, 0, x0->dtype, x0->ndim, shape);
}

/* View of out (or its gradient) covering input k's part of the concat axis. */
static tm_status part_view(tm__call *c, tm_tensor *whole, int k, tm_tensor **v) {
    int a = (int)c->iattr[0];
    int64_t start = 0;
    for (int j = 0; j < k; j++) start += c->in[j]->shape[a];
    int64_t shape[TM_MAX_DIMS];
    for (int i = 0; i < whole->ndim; i++) shape[i] = whole->shape[i];
    shape[a] = c->in[k]->shape[a];
    return tm__tensor_view(c->ctx, whole, whole->ndim, shape, whole->stride, whole->offset + start * whole->stride[a], v);
}

tm_status tm__concat_forward(tm__call *c) {
    for (int k = 0; k < c->n_in; k++) {
        tm_tensor *v;
        TM__TRY(part_view(c, c->out[0], k, &v));
        TM__TRY(tm__assign(c->ctx, v, c->in[k], 0, 1.0));
    }
    return TM_OK;
}

tm_status tm__concat_backward(tm__call *c) {
    for (int k = 0; k < c->n_in; k++) {
        if (!c->gin[k]) continue;
        tm_tensor *v;
        TM__TRY(part_view(c, c->gout[0], k, &v));
        TM__TRY(grad_to(c, k, v));
    }
    return TM_OK;
}

tm_status tm_concat(tm_ctx *ctx, int n, tm_tensor *const *xs, int axis, tm_tensor **out) {
    TM__TRY(need(ctx, "concat", xs, out));
    if (n < 1 || n > TM__MAX_IN) return tm__err(ctx, TM_ERR_INVALID_ARG, "concat: n = %d outside [1, %d]", n, TM__MAX_IN);
    tm__call c = tm__call_init(ctx, TM__OP_CONCAT);
    c.n_in = n;
    for (int i = 0; i < n; i++) c.in[i] = xs[i];
    c.iattr[0] = axis;
    return tm__op_run1(&c, out);
}
