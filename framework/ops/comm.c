/*
 * comm.c — collectives as ops (include/tinymoe.h, "Distributed"): all-reduce, all-gather,
 * reduce-scatter and the ragged all-to-all, each a row of framework/ops.def with kernels COMM:
 * one forward and one backward serve every device, moving memory through the communicator's
 * engine for that device (framework/comm.h).
 *
 * Backward rules (the adjoint of each forward, with the ranks' losses adding up):
 *   allreduce      y = sum_r x_r on every rank     dx_r = sum_r' dy_r'         (all-reduce)
 *   allgather      y = [x_0; x_1; ...]             dx_r = sum_r' dy_r'[rows r] (reduce-scatter)
 *   reduce_scatter y_r = sum_r' x_r'[rows r]       dx_r[rows s] = dy_s         (all-gather)
 *   alltoall       rows to rank j by send_counts   the same rows sent back     (reverse all-to-all)
 * The rows are TM__OP_COLLECTIVE: recorded whenever grad mode is on and the input is float, and
 * run by tm_backward in tape order on every rank, with zero upstream gradients and a scratch
 * input gradient where this rank has none, so every rank takes part in every backward
 * collective.
 *
 * Attributes: iattr[0] the group. allgather saves the row count of every rank (i64 [G], CPU),
 * exchanged by its check together with the dtype and trailing shape, so a rank whose tensor
 * does not fit is an error naming it rather than a corrupt transfer. allgather's parameter form
 * (iattr[1] = 1, iattr[2] the parameter's place among the named tensors) is ZeRO-3's gather of
 * a sharded weight: framework/fsdp.c checks and runs it (counts from the layout, nothing
 * exchanged; started ahead beside the work where it can). Ragged all-gathers are adjoint to
 * ragged reduce-scatters (tm__coll_reduce_scatterv).
 */
#include <stdio.h>

#include "comm.h"

static int group_size(const tm_ctx *ctx, int g) { return tm_comm_size(ctx, (tm_comm_group)g); }

static tm_status check_group_attr(tm__call *c) {
    if ((uint64_t)c->iattr[0] >= TM_COMM_NGROUPS)
        return tm__err(c->ctx, TM_ERR_INVALID_ARG, "%s: group %lld is not a tm_comm_group", tm__opname(c),
                       (long long)c->iattr[0]);
    return TM_OK;
}

static tm_status check_summable(tm__call *c) {
    tm_dtype dt = c->in[0]->dtype;
    if (!tm__is_float(dt) && !tm__is_index(dt))
        return tm__err(c->ctx, TM_ERR_DTYPE, "%s: x must be float, i32 or i64 to be summed, got %s", tm__opname(c),
                       tm__tdesc(c->ctx, c->in[0]));
    return TM_OK;
}

static int64_t row_elems(const tm_tensor *t) {
    int64_t n = 1;
    for (int d = 1; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

static tm_status public_run(tm_ctx *ctx, int op, tm_tensor **in, int n_in, int g, tm_tensor **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    tm__call c = tm__call_init(ctx, op);
    c.n_in = n_in;
    for (int i = 0; i < n_in; i++) c.in[i] = in[i];
    c.iattr[0] = g;
    return tm__op_run1(&c, out);
}

/* Scratch for an input gradient this rank does not need (the collective still runs). */
static tm_status gin_or_scratch(tm__call *c, int i, tm_tensor **out) {
    if (c->gin[i]) {
        *out = c->gin[i];
        return TM_OK;
    }
    const tm_tensor *x = c->in[i];
    tm_dtype dt = c->gout[0]->dtype; /* f32 when the CPU stages bf16 */
    return tm__tensor_zeros(c->ctx, dt, x->ndim, x->shape, x->device, out);
}

/* dst += src (a fresh result of the backward collective). */
static tm_status add_into(tm__call *c, tm_tensor *dst, tm_tensor *src) {
    if (!c->gin[0]) return TM_OK;
    return tm__accumulate(c->ctx, dst, src, 1.0);
}

/* ---- allreduce ---------------------------------------------------------------------------- */

tm_status tm__comm_allreduce_check(tm__call *c) {
    TM__TRY(check_group_attr(c));
    TM__TRY(check_summable(c));
    return tm__out_new(c, 0, c->in[0]->dtype, c->in[0]->ndim, c->in[0]->shape);
}

tm_status tm__comm_allreduce_forward(tm__call *c) {
    return tm__coll_allreduce(c->ctx, (int)c->iattr[0], tm__data(c->in[0]), tm__data(c->out[0]), tm__numel(c->in[0]),
                              c->in[0]->dtype, c->in[0]->device);
}

tm_status tm__comm_allreduce_backward(tm__call *c) {
    tm_tensor *g = c->gout[0], *t;
    TM__TRY(tm__tensor_new(c->ctx, g->dtype, g->ndim, g->shape, g->device, &t));
    TM__TRY(tm__coll_allreduce(c->ctx, (int)c->iattr[0], tm__data(g), tm__data(t), tm__numel(g), g->dtype, g->device));
    return add_into(c, c->gin[0], t);
}

tm_status tm_comm_allreduce(tm_ctx *ctx, tm_tensor *x, tm_comm_group g, tm_tensor **out) {
    return public_run(ctx, TM__OP_COMM_ALLREDUCE, &x, 1, (int)g, out);
}

/* ---- allgather ---------------------------------------------------------------------------- */

/* Exchange (rows, dtype, ndim, trailing dims) over the group; fail naming a rank that differs. */
enum { META = 6 };

tm_status tm__comm_allgather_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    TM__TRY(check_group_attr(c));
    if (c->iattr[1]) return tm__fsdp_gather_check(c); /* ZeRO-3's form: framework/fsdp.c */
    const tm_tensor *x = c->in[0];
    if (x->ndim < 1)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: x %s must have a dim 0 to concatenate along", tm__opname(c),
                       tm__tdesc(ctx, x));
    int g = (int)c->iattr[0], G = group_size(ctx, g);
    int64_t mine[META] = {x->shape[0], x->dtype, x->ndim, 0, 0, 0};
    for (int d = 1; d < x->ndim; d++) mine[2 + d] = x->shape[d];
    int64_t *all = tm__meta_alloc(ctx, sizeof(int64_t) * META * (size_t)G);
    if (!all) return TM_ERR_NOMEM;
    TM__TRY(tm_comm_allgather_host(ctx, (tm_comm_group)g, mine, all, sizeof mine));
    int64_t rows = 0;
    for (int j = 0; j < G; j++) {
        const int64_t *o = all + META * j;
        if (memcmp(o + 1, mine + 1, sizeof(int64_t) * (META - 1)))
            return tm__err(ctx, TM_ERR_SHAPE,
                           "%s over %s: x %s here but rank %d of the group has %s with %lld dims [%lld, %lld, %lld, "
                           "%lld]: dtype and trailing dims must agree",
                           tm__opname(c), tm__comm_gdesc(ctx->comm, g), tm__tdesc(ctx, x), j,
                           tm_dtype_name((tm_dtype)o[1]), (long long)o[2], (long long)o[0], (long long)o[3],
                           (long long)o[4], (long long)o[5]);
        rows += o[0];
    }
    int64_t shape[TM_MAX_DIMS], gl = G;
    for (int d = 0; d < x->ndim; d++) shape[d] = x->shape[d];
    shape[0] = rows;
    tm_tensor *counts;
    TM__TRY(tm__tensor_new(ctx, TM_I64, 1, &gl, tm_cpu(), &counts));
    for (int j = 0; j < G; j++) ((int64_t *)tm__data(counts))[j] = all[META * j];
    if (c->n_saved >= TM__MAX_SAVED) return TM_ERR_INTERNAL;
    c->saved[c->n_saved++] = counts;
    return tm__out_new(c, 0, x->dtype, x->ndim, shape);
}

/* Element counts and displacements of the saved row counts times the row size. */
static tm_status elem_counts(tm__call *c, const tm_tensor *rows, int64_t per_row, int64_t **cd) {
    int G = (int)rows->shape[0];
    int64_t *v = tm__meta_alloc(c->ctx, sizeof(int64_t) * 2 * (size_t)G);
    if (!v) return TM_ERR_NOMEM;
    int64_t off = 0;
    for (int j = 0; j < G; j++) {
        v[j] = ((const int64_t *)tm__data(rows))[j] * per_row;
        v[G + j] = off;
        off += v[j];
    }
    *cd = v;
    return TM_OK;
}

tm_status tm__comm_allgather_forward(tm__call *c) {
    const tm_tensor *x = c->in[0];
    if (c->iattr[1]) return tm__fsdp_gather_forward(c);
    int G = (int)c->saved[0]->shape[0];
    int64_t *cd;
    TM__TRY(elem_counts(c, c->saved[0], row_elems(x), &cd));
    return tm__coll_allgatherv(c->ctx, (int)c->iattr[0], tm__data(x), tm__data(c->out[0]), cd, cd + G, x->dtype,
                               x->device);
}

tm_status tm__comm_allgather_backward(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    if (c->iattr[1]) return tm__fsdp_gather_backward(c);
    int g = (int)c->iattr[0], G = (int)c->saved[0]->shape[0];
    tm_tensor *go = c->gout[0], *gx;
    TM__TRY(gin_or_scratch(c, 0, &gx));
    int64_t *cd;
    TM__TRY(elem_counts(c, c->saved[0], row_elems(c->in[0]), &cd));
    int equal = 1;
    for (int j = 1; j < G; j++) equal &= cd[j] == cd[0];
    tm_tensor *t;
    TM__TRY(tm__tensor_new(ctx, go->dtype, gx->ndim, gx->shape, go->device, &t));
    if (equal)
        TM__TRY(tm__coll_reduce_scatter(ctx, g, tm__data(go), tm__data(t), cd[0], go->dtype, go->device));
    else
        TM__TRY(tm__coll_reduce_scatterv(ctx, g, tm__data(go), tm__data(t), cd, go->dtype, go->device));
    return add_into(c, gx, t);
}

tm_status tm_comm_allgather(tm_ctx *ctx, tm_tensor *x, tm_comm_group g, tm_tensor **out) {
    return public_run(ctx, TM__OP_COMM_ALLGATHER, &x, 1, (int)g, out);
}

/* ---- reduce_scatter ------------------------------------------------------------------------- */

tm_status tm__comm_reduce_scatter_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    TM__TRY(check_group_attr(c));
    TM__TRY(check_summable(c));
    const tm_tensor *x = c->in[0];
    int G = group_size(ctx, (int)c->iattr[0]);
    if (x->ndim < 1 || x->shape[0] % G)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: x %s must have a dim 0 divisible by the group's %d ranks", tm__opname(c),
                       tm__tdesc(ctx, x), G);
    int64_t shape[TM_MAX_DIMS];
    for (int d = 0; d < x->ndim; d++) shape[d] = x->shape[d];
    shape[0] /= G;
    return tm__out_new(c, 0, x->dtype, x->ndim, shape);
}

tm_status tm__comm_reduce_scatter_forward(tm__call *c) {
    const tm_tensor *x = c->in[0];
    return tm__coll_reduce_scatter(c->ctx, (int)c->iattr[0], tm__data(x), tm__data(c->out[0]), tm__numel(c->out[0]),
                                   x->dtype, x->device);
}

tm_status tm__comm_reduce_scatter_backward(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    int g = (int)c->iattr[0], G = group_size(ctx, g);
    tm_tensor *go = c->gout[0], *gx, *t;
    TM__TRY(gin_or_scratch(c, 0, &gx));
    TM__TRY(tm__tensor_new(ctx, go->dtype, gx->ndim, gx->shape, go->device, &t));
    int64_t *cd = tm__meta_alloc(ctx, sizeof(int64_t) * 2 * (size_t)G);
    if (!cd) return TM_ERR_NOMEM;
    for (int j = 0; j < G; j++) {
        cd[j] = tm__numel(go);
        cd[G + j] = tm__numel(go) * j;
    }
    TM__TRY(tm__coll_allgatherv(ctx, g, tm__data(go), tm__data(t), cd, cd + G, go->dtype, go->device));
    return add_into(c, gx, t);
}

tm_status tm_comm_reduce_scatter(tm_ctx *ctx, tm_tensor *x, tm_comm_group g, tm_tensor **out) {
    return public_run(ctx, TM__OP_COMM_REDUCE_SCATTER, &x, 1, (int)g, out);
}

/* ---- alltoall ------------------------------------------------------------------------------- */

static tm_status check_counts(tm__call *c, int i, const char *what, int G) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *t = c->in[i];
    if (t->dtype != TM_I64)
        return tm__err(ctx, TM_ERR_DTYPE, "%s: %s must be i64, got %s", tm__opname(c), what, tm__tdesc(ctx, t));
    if (t->device.type != TM_DEVICE_CPU)
        return tm__err(ctx, TM_ERR_DEVICE, "%s: %s %s must be on the CPU (the counts drive the host's transfers)",
                       tm__opname(c), what, tm__tdesc(ctx, t));
    if (t->ndim != 1 || t->shape[0] != G || !tm__is_contiguous(t))
        return tm__err(ctx, TM_ERR_SHAPE, "%s: %s %s must be a contiguous [%d] (one count per rank of the group)", tm__opname(c),
                       what, tm__tdesc(ctx, t), G);
    for (int j = 0; j < G; j++)
        if (tm__idx(t, j) < 0)
            return tm__err(ctx, TM_ERR_SHAPE, "%s: %s[%d] = %lld is negative", tm__opname(c), what, j,
                           (long long)tm__idx(t, j));
    return TM_OK;
}

tm_status tm__comm_alltoall_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    TM__TRY(check_group_attr(c));
    const tm_tensor *x = c->in[0];
    int g = (int)c->iattr[0], G = group_size(ctx, g);
    if (x->ndim < 1)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: x %s must have rows (dim 0)", tm__opname(c), tm__tdesc(ctx, x));
    TM__TRY(check_counts(c, 1, "send_counts", G));
    TM__TRY(check_counts(c, 2, "recv_counts", G));
    int64_t sent = 0, recv = 0;
    for (int j = 0; j < G; j++) sent += tm__idx(c->in[1], j), recv += tm__idx(c->in[2], j);
    if (sent != x->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "%s: send_counts sum to %lld but x %s has %lld rows", tm__opname(c),
                       (long long)sent, tm__tdesc(ctx, x), (long long)x->shape[0]);
    /* What each rank sends here must be what this rank expects: one exchange of the counts,
     * unless the caller derived both sides from one all-gathered table (iattr[1], the MoE
     * layer's dispatch: tm__comm_alltoall_consistent), where it would be a second exchange of
     * the same numbers. */
    if (!c->iattr[1]) {
        int64_t *cd = tm__meta_alloc(ctx, sizeof(int64_t) * 5 * (size_t)G), *got = cd + 4 * G;
        if (!cd) return TM_ERR_NOMEM;
        for (int j = 0; j < G; j++) cd[j] = cd[2 * G + j] = 1, cd[G + j] = cd[3 * G + j] = j;
        TM__TRY(tm__coll_alltoallv(ctx, g, tm__data(c->in[1]), cd, cd + G, got, cd + 2 * G, cd + 3 * G, TM_I64,
                                   tm_cpu()));
        for (int j = 0; j < G; j++)
            if (got[j] != tm__idx(c->in[2], j))
                return tm__err(ctx, TM_ERR_SHAPE,
                               "%s over %s: rank %d of the group sends %lld rows here but recv_counts[%d] = %lld",
                               tm__opname(c), tm__comm_gdesc(ctx->comm, g), j, (long long)got[j], j,
                               (long long)tm__idx(c->in[2], j));
    }
    int64_t shape[TM_MAX_DIMS];
    for (int d = 0; d < x->ndim; d++) shape[d] = x->shape[d];
    shape[0] = recv;
    return tm__out_new(c, 0, x->dtype, x->ndim, shape);
}

/* Counts (rows) to elements with displacements: v[0..G) counts, v[G..2G) displacements. */
static tm_status a2a_elems(tm__call *c, const tm_tensor *rows, int64_t per_row, int64_t **out) {
    int G = (int)rows->shape[0];
    int64_t *v = tm__meta_alloc(c->ctx, sizeof(int64_t) * 2 * (size_t)G), off = 0;
    if (!v) return TM_ERR_NOMEM;
    for (int j = 0; j < G; j++) {
        v[j] = tm__idx(rows, j) * per_row;
        v[G + j] = off;
        off += v[j];
    }
    *out = v;
    return TM_OK;
}

static tm_status a2a(tm__call *c, const tm_tensor *src, const tm_tensor *scounts, tm_tensor *dst,
                     const tm_tensor *rcounts) {
    int G = (int)scounts->shape[0];
    int64_t *s, *r, per_row = row_elems(c->in[0]);
    TM__TRY(a2a_elems(c, scounts, per_row, &s));
    TM__TRY(a2a_elems(c, rcounts, per_row, &r));
    return tm__coll_alltoallv(c->ctx, (int)c->iattr[0], tm__data(src), s, s + G, tm__data(dst), r, r + G, src->dtype,
                              src->device);
}

/* The side form (iattr[2] = 1, tm__comm_alltoall_beside) where the engine can run it beside the
 * work over the group. */
static int beside(const tm__call *c) {
    return c->iattr[2] && tm__coll_side_group(c->ctx, (int)c->iattr[0], c->in[0]->device);
}

/* a2a on the side stream; *ev its event (NULL where it ran in place). On failure the event has
 * been waited for. */
static tm_status a2a_beside(tm__call *c, const tm_tensor *src, const tm_tensor *scounts, tm_tensor *dst,
                            const tm_tensor *rcounts, void **ev) {
    tm_ctx *ctx = c->ctx;
    tm_device dev = src->device;
    *ev = NULL;
    TM__TRY(tm__coll_side_begin(ctx, dev));
    tm_status s = a2a(c, src, scounts, dst, rcounts);
    void *e = NULL;
    tm_status se = tm__coll_side_end(ctx, dev, &e);
    if (s == TM_OK) s = se;
    if (s != TM_OK) {
        (void)tm__coll_event_wait(ctx, dev, e);
        return s;
    }
    *ev = e;
    return TM_OK;
}

tm_status tm__comm_alltoall_forward(tm__call *c) {
    if (!beside(c)) return a2a(c, c->in[0], c->in[1], c->out[0], c->in[2]);
    /* the rows arrive beside the work: their readers wait (side.c); the rows sent are held */
    void *ev;
    TM__TRY(a2a_beside(c, c->in[0], c->in[1], c->out[0], c->in[2], &ev));
    tm_tensor *use[1] = {c->in[0]};
    return tm__side_add(c->ctx, c->in[0]->device, ev, c->out[0], use, 1, NULL, 0);
}

/* The side form's backward: the reverse all-to-all beside the work, written straight into x's
 * gradient (the form's promise: x has no other reader, so its gradient is zero until here; the
 * CPU checks it), which its first reader waits for (autograd.c); the upstream gradient is taken
 * off the tape and held until then, as is a scratch result where x needs no gradient (every
 * rank still takes part). */
static tm_status alltoall_backward_beside(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *go = c->gout[0], *dst = c->gin[0], *scratch = NULL;
    const tm_tensor *x = c->in[0];
    if (dst && dst->device.type == TM_DEVICE_CPU) {
        const int64_t n = tm__numel(dst);
        for (int64_t i = 0; i < n; i++)
            if (tm__load_f64(tm__data(dst), dst->dtype, i) != 0.0)
                return tm__err(ctx, TM_ERR_INTERNAL,
                               "%s (beside the work): the gradient of x %s already holds a contribution (element %lld); "
                               "this form writes it, so x must have no other reader",
                               tm__opname(c), tm__tdesc(ctx, x), (long long)i);
    }
    if (!dst) {
        TM__TRY(tm__tensor_new(ctx, go->dtype, x->ndim, x->shape, go->device, &scratch));
        tm__scope_forget(ctx, scratch); /* the entry gives it back, not the kernel's scope */
        dst = scratch;
    }
    void *ev;
    tm_status s = a2a_beside(c, go, c->in[2], dst, c->in[1], &ev);
    if (s != TM_OK) {
        tm__tensor_release(ctx, scratch);
        return s;
    }
    /* go is read beside the work until ev: the tape must not give it back (release_node) */
    c->gout[0] = NULL;
    if (c->out[0]->grad == go) c->out[0]->grad = NULL;
    tm_tensor *use[2] = {go, scratch}, *own[2] = {go, scratch};
    return tm__side_add(ctx, go->device, ev, scratch ? NULL : dst, use, scratch ? 2 : 1, own, scratch ? 2 : 1);
}

tm_status tm__comm_alltoall_backward(tm__call *c) {
    if (beside(c)) return alltoall_backward_beside(c);
    tm_tensor *go = c->gout[0], *gx, *t;
    TM__TRY(gin_or_scratch(c, 0, &gx));
    TM__TRY(tm__tensor_new(c->ctx, go->dtype, gx->ndim, gx->shape, go->device, &t));
    TM__TRY(a2a(c, go, c->in[2], t, c->in[1]));
    return add_into(c, gx, t);
}

tm_status tm_comm_alltoall(tm_ctx *ctx, tm_tensor *x, tm_tensor *send_counts, tm_tensor *recv_counts, tm_comm_group g,
                           tm_tensor **out) {
    tm_tensor *in[3] = {x, send_counts, recv_counts};
    return public_run(ctx, TM__OP_COMM_ALLTOALL, in, 3, (int)g, out);
}

static tm_status alltoall_internal(tm_ctx *ctx, tm_tensor *x, tm_tensor *send_counts, tm_tensor *recv_counts,
                                   tm_comm_group g, int side, tm_tensor **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    tm__call c = tm__call_init(ctx, TM__OP_COMM_ALLTOALL);
    c.n_in = 3;
    c.in[0] = x;
    c.in[1] = send_counts;
    c.in[2] = recv_counts;
    c.iattr[0] = (int)g;
    c.iattr[1] = 1;
    c.iattr[2] = side;
    return tm__op_run1(&c, out);
}

tm_status tm__comm_alltoall_consistent(tm_ctx *ctx, tm_tensor *x, tm_tensor *send_counts, tm_tensor *recv_counts,
                                       tm_comm_group g, tm_tensor **out) {
    return alltoall_internal(ctx, x, send_counts, recv_counts, g, 0, out);
}

tm_status tm__comm_alltoall_beside(tm_ctx *ctx, tm_tensor *x, tm_tensor *send_counts, tm_tensor *recv_counts,
                                   tm_comm_group g, tm_tensor **out) {
    return alltoall_internal(ctx, x, send_counts, recv_counts, g, 1, out);
}
