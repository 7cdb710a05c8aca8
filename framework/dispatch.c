/*
 * dispatch.c — runs one op: validation, the row's check, contiguity and bf16 staging, the
 * backend's forward kernel, and recording on the tape. See the top of internal.h.
 */
#include "ctx_internal.h"

#include <stdio.h>

tm_status tm__check_float(tm__call *c, int i) {
    if (!tm__is_float(c->in[i]->dtype))
        return tm__err(c->ctx, TM_ERR_DTYPE, "%s: input %d must be f32, bf16 or f64, got %s", tm__opname(c), i,
                       tm__tdesc(c->ctx, c->in[i]));
    return TM_OK;
}

tm_status tm__check_index(tm__call *c, int i) {
    if (!tm__is_index(c->in[i]->dtype))
        return tm__err(c->ctx, TM_ERR_DTYPE, "%s: input %d must be i32 or i64 indices, got %s", tm__opname(c), i,
                       tm__tdesc(c->ctx, c->in[i]));
    return TM_OK;
}

tm_status tm__check_same_dtype(tm__call *c, int i, int j) {
    if (c->in[i]->dtype != c->in[j]->dtype)
        return tm__err(c->ctx, TM_ERR_DTYPE, "%s: inputs %d and %d must have one dtype, got %s and %s", tm__opname(c), i,
                       j, tm__tdesc(c->ctx, c->in[i]), tm__tdesc(c->ctx, c->in[j]));
    return TM_OK;
}

tm_status tm__check_ndim(tm__call *c, int i, int min_ndim, int max_ndim) {
    int nd = c->in[i]->ndim;
    if (nd < min_ndim || nd > max_ndim) {
        if (min_ndim == max_ndim)
            return tm__err(c->ctx, TM_ERR_SHAPE, "%s: input %d must have %d dims, got %s", tm__opname(c), i, min_ndim,
                           tm__tdesc(c->ctx, c->in[i]));
        return tm__err(c->ctx, TM_ERR_SHAPE, "%s: input %d must have %d..%d dims, got %s", tm__opname(c), i, min_ndim,
                       max_ndim, tm__tdesc(c->ctx, c->in[i]));
    }
    return TM_OK;
}

/* CPU kernels compute in f32/f64: run a bf16 call on f32 copies and round the results back
 * (bf16 is a storage format on the CPU). Gradients: gin is staged in f32 and written back. */
static tm_status f32_stage(tm_ctx *ctx, tm_tensor *t, tm_tensor **out) {
    if (!t || t->dtype != TM_BF16) {
        *out = t;
        return TM_OK;
    }
    tm_tensor *f;
    TM__TRY(tm__tensor_new(ctx, TM_F32, t->ndim, t->shape, t->device, &f));
    TM__TRY(tm__copy_into(ctx, f, t));
    *out = f;
    return TM_OK;
}

static int call_has_bf16(const tm__call *c) {
    for (int i = 0; i < c->n_in; i++)
        if (c->in[i]->dtype == TM_BF16) return 1;
    for (int i = 0; i < c->n_out; i++)
        if (c->out[i] && c->out[i]->dtype == TM_BF16) return 1;
    return 0;
}

/* The index of the first of ts[0..i] that is ts[i]: an op may take one tensor twice (x * x,
 * attention with k as v), and then its gradient slots are one tensor too. */
static int first_alias(tm_tensor *const *ts, int i) {
    int j = 0;
    while (ts[j] != ts[i]) j++;
    return j;
}

static tm_status run_bf16_on_cpu(tm__call *c, tm__fn fn, int backward) {
    tm__call k = *c;
    /* One f32 copy per distinct tensor: aliased gradient slots must accumulate into one
     * staging buffer, or the second write-back would overwrite the first's contribution. */
    for (int i = 0; i < c->n_in; i++) {
        int j = first_alias(c->in, i);
        if (j < i) k.in[i] = k.in[j];
        else TM__TRY(f32_stage(c->ctx, c->in[i], &k.in[i]));
    }
    for (int i = 0; i < c->n_out; i++) {
        if (!c->out[i]) continue;
        if (backward) TM__TRY(f32_stage(c->ctx, c->out[i], &k.out[i]));
        else if (c->out[i]->dtype == TM_BF16)
            TM__TRY(tm__tensor_new(c->ctx, TM_F32, c->out[i]->ndim, c->out[i]->shape, c->out[i]->device, &k.out[i]));
    }
    if (backward) {
        for (int i = 0; i < c->n_out; i++) TM__TRY(f32_stage(c->ctx, c->gout[i], &k.gout[i]));
        for (int i = 0; i < c->n_in; i++) {
            int j = c->gin[i] ? first_alias(c->gin, i) : i;
            if (j < i) k.gin[i] = k.gin[j];
            else if (c->gin_fresh[i] && c->gin[i]->dtype == TM_BF16) /* nothing to read: written whole */
                TM__TRY(tm__tensor_new(c->ctx, TM_F32, c->gin[i]->ndim, c->gin[i]->shape, c->gin[i]->device, &k.gin[i]));
            else TM__TRY(f32_stage(c->ctx, c->gin[i], &k.gin[i]));
        }
    }
    TM__TRY(fn(&k));
    if (backward) {
        for (int i = 0; i < c->n_in; i++)
            if (c->gin[i] && k.gin[i] != c->gin[i] && first_alias(c->gin, i) == i)
                TM__TRY(tm__copy_into(c->ctx, c->gin[i], k.gin[i]));
    } else {
        for (int i = 0; i < c->n_out; i++) {
            if (!k.out[i]) continue;
            if (!c->out[i] || c->out[i]->dtype != TM_BF16) {
                c->out[i] = k.out[i]; /* allocated by the kernel (data-dependent shape) */
                continue;
            }
            if (k.out[i] != c->out[i]) TM__TRY(tm__copy_into(c->ctx, c->out[i], k.out[i]));
        }
        c->n_saved = k.n_saved;
        for (int i = 0; i < k.n_saved; i++) c->saved[i] = k.saved[i];
    }
    return TM_OK;
}

static tm_status run_kernel_unscoped(tm__call *c, int backward) {
    const tm__op_def *op = &tm__op_table[c->op];
    int b = tm__backend(c->in[0]->device);
    const tm__backend_ops *be = c->ctx->be[b];
    tm__fn fn = be ? (backward ? be->bwd[c->op] : be->fwd[c->op]) : NULL;
    if (!fn) {
        return tm__err(c->ctx, TM_ERR_UNSUPPORTED, "%s: no %s kernel for %s yet (input %s)", op->name,
                       backward ? "backward" : "forward", b == TM__CUDA ? "CUDA" : "the CPU",
                       tm__tdesc(c->ctx, c->in[0]));
    }
    if (b == TM__CPU && !(op->flags & TM__OP_NATIVE_BF16) && call_has_bf16(c)) return run_bf16_on_cpu(c, fn, backward);
    return fn(c);
}

/* The kernel runs inside a scope (arena.c): whatever it takes from the arena beyond what it
 * produces is scratch, given back when it returns. A forward produces its outputs and saved
 * tensors; a backward produces nothing (the gradients it adds into were allocated before). */
tm_status tm__run_kernel(tm__call *c, int backward) {
    int mark = tm__scope_open(c->ctx);
    tm_status s = run_kernel_unscoped(c, backward);
    tm_tensor *keep[TM__MAX_OUT + TM__MAX_SAVED];
    int nkeep = 0;
    if (!backward) {
        for (int i = 0; i < c->n_out; i++) keep[nkeep++] = c->out[i];
        for (int i = 0; i < c->n_saved; i++) keep[nkeep++] = c->saved[i];
    }
    tm__scope_close(c->ctx, mark, keep, nkeep);
    return s;
}

/* Give back what only the call's kernels could read: its saved tensors, and the contiguous
 * copies the dispatcher made of non-contiguous inputs (c->in[i] != c->src[i]) unless an
 * output shares their storage. Called once nothing will run the call's kernels again: after
 * the forward when the call is not recorded, after its backward otherwise (autograd.c). */
void tm__release_call(tm__call *c) {
    for (int i = 0; i < c->n_saved; i++) {
        int shared = 0;
        for (int j = 0; j < c->n_out; j++) shared |= c->out[j] && c->out[j]->storage == c->saved[i]->storage;
        if (!shared) tm__tensor_release(c->ctx, c->saved[i]);
    }
    for (int i = 0; i < c->n_in; i++) {
        tm_tensor *t = c->in[i];
        if (!t || t == c->src[i] || t->storage == c->src[i]->storage) continue;
        int shared = 0;
        for (int j = 0; j < c->n_out; j++) shared |= c->out[j] && c->out[j]->storage == t->storage;
        if (!shared) tm__tensor_release(c->ctx, t); /* a copy used twice: the second is a no-op */
    }
}

tm_status tm__op_run(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (c->op < 0 || c->op >= TM__NOPS) return tm__err(ctx, TM_ERR_INTERNAL, "op id %d out of range", c->op);
    const tm__op_def *op = &tm__op_table[c->op];
    if (!op->check) return tm__err(ctx, TM_ERR_UNSUPPORTED, "op id %d has no row in the op table of this build", c->op);
    if (ctx->plan_only)
        return tm__err(ctx, TM_ERR_STATE, "%s: a plan-only context (tm_ctx_options.plan_only) lays out, it runs no ops",
                       op->name);
    if (op->n_in >= 0) c->n_in = op->n_in;
    c->n_out = op->n_out;
    if (c->n_in < 1 || c->n_in > TM__MAX_IN)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %d inputs given, expected 1..%d", op->name, c->n_in, TM__MAX_IN);
    for (int i = 0; i < c->n_in; i++) {
        if (!c->in[i]) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: input %d is NULL", op->name, i);
        if (c->in[i]->ctx != ctx)
            return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: input %d %s belongs to another context", op->name, i,
                           tm__tdesc(ctx, c->in[i]));
        if (!(op->flags & TM__OP_ANY_DEVICE) && !tm__same_device(c->in[i]->device, c->in[0]->device))
            return tm__err(ctx, TM_ERR_DEVICE, "%s: inputs on different devices: input 0 is %s, input %d is %s",
                           op->name, tm__tdesc(ctx, c->in[0]), i, tm__tdesc(ctx, c->in[i]));
    }
    for (int i = 0; i < c->n_in && ctx->params_deferred; i++)
        if (c->in[i]->is_param && c->in[i]->storage && !c->in[i]->storage->data)
            return tm__err(ctx, TM_ERR_STATE, "%s: input %d is parameter \"%s\", which has no memory yet: it was made "
                           "after tm_ctx_defer_params; call tm_ctx_materialize_params first", op->name, i,
                           c->in[i]->name);
    for (int i = 0; i < c->n_in; i++)
        if (c->in[i]->storage && c->in[i]->storage->sharded)
            return tm__err(ctx, TM_ERR_STATE, "%s: input %d %s is a parameter (or a view of one) that this rank holds a "
                           "ZeRO-3 block of only: compute with its all-gather (tm__param_use)", op->name, i,
                           tm__tdesc(ctx, c->in[i]));
    /* an input a collective beside the work still writes: the work waits for it first */
    for (int i = 0; i < c->n_in && tm__side_pending(ctx); i++) TM__TRY(tm__side_wait(ctx, c->in[i]));
    for (int i = 0; i < c->n_in; i++) c->src[i] = c->in[i];
    for (int i = 0; i < TM__MAX_OUT; i++) c->out[i] = NULL;
    c->n_saved = 0;

    TM__TRY(op->check(c));

    if (!(op->flags & TM__OP_STRIDED))
        for (int i = 0; i < c->n_in; i++)
            if (!tm__is_contiguous(c->in[i])) TM__TRY(tm__contiguous_copy(ctx, c->in[i], &c->in[i]));

    /* The in-place ops (updates, bookkeeping: all TM__OP_NONDIFF) may write their inputs, so
     * those lose their host mirrors (internal.h). */
    if (op->flags & TM__OP_NONDIFF)
        for (int i = 0; i < c->n_in; i++) tm__mirror_drop(ctx, c->src[i]);

    TM__TRY(tm__run_kernel(c, 0));
    for (int i = 0; i < c->n_out; i++)
        if (!c->out[i]) return tm__err(ctx, TM_ERR_INTERNAL, "%s: output %d was not produced", op->name, i);

    int needs = 0;
    if (ctx->grad_enabled && !(op->flags & TM__OP_NONDIFF) && (op->kernels & (TM__K_CPU_BWD | TM__K_CUDA_BWD)))
        for (int i = 0; i < c->n_in; i++) needs |= c->src[i]->requires_grad;
    /* A collective's backward is a collective too: every rank records it, so that every rank
     * runs it, whether or not its own input needs a gradient. */
    int collective = (op->flags & TM__OP_COLLECTIVE) && ctx->grad_enabled && tm__is_float(c->src[0]->dtype);
    if (needs || collective) {
        tm__node *n = tm__meta_alloc(ctx, sizeof *n);
        if (!n) return TM_ERR_NOMEM;
        n->call = *c;
        n->prev = ctx->tape;
        ctx->tape = n;
        for (int i = 0; i < c->n_out; i++) {
            if (!tm__is_float(c->out[i]->dtype)) continue;
            c->out[i]->requires_grad = 1;
            c->out[i]->node = n;
        }
    } else {
        tm__release_call(c);
    }
    return TM_OK;
}

tm_status tm__op_run1(tm__call *c, tm_tensor **out) {
    if (!c->ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(c->ctx, TM_ERR_INVALID_ARG, "%s: out is NULL", tm__opname(c));
    TM__TRY(tm__op_run(c));
    *out = c->out[0];
    return TM_OK;
}

int tm__op_available(const tm_ctx *ctx, const char *name, tm_device dev) {
    const tm__backend_ops *be = ctx ? ctx->be[tm__backend(dev)] : NULL;
    if (!be || !name) return 0;
    for (int i = 0; i < TM__NOPS; i++)
        if (strcmp(tm__op_table[i].name, name) == 0) return be->fwd[i] != NULL;
    return 0;
}
