/*
 * autograd.c — reverse-mode differentiation over the tape.
 *
 * The tape is the list of recorded calls, newest first; recording order is a topological
 * order, so walking it backwards visits every consumer of a tensor before its producer. A node
 * whose outputs received no gradient is skipped, except a collective (TM__OP_COLLECTIVE): its
 * backward is a collective as well, so it runs on every rank, with zero upstream gradients and
 * scratch input gradients where this rank has none. Gradients of parameters accumulate into the
 * contiguous gradient buffer; gradients of temporaries are arena tensors that start at zero,
 * except where the first contributor is an op that writes its input gradients whole
 * (TM__OP_GRAD_WRITES): it gets the buffer unfilled and marked fresh (call->gin_fresh) and
 * stores its gradient instead of adding it into zeros, as PyTorch's autograd hands a first
 * contribution over. For the MoE layer's [rows, ffn] intermediates that saves a memset and a
 * read-back per gradient, several GB of memory traffic a step.
 *
 * Memory: when a node is done, nothing can read its upstream gradients any more (every
 * consumer of its outputs came later in the recording, so its backward has run), nor its
 * saved tensors or its dispatcher staging copies (the tape is consumed). They go back to the
 * arena at once (release_node) and serve the gradients of the nodes still to come, so the
 * backward pass holds the gradients of one "frontier" of the graph rather than all of them.
 * Kept: gradients of leaves (tm_tensor_set_requires_grad tensors: the user reads them) and of
 * parameters (persistent). An op output's gradient pointer is cleared when it is freed, so
 * tm_tensor_grad of an intermediate is NULL after the backward, as in PyTorch.
 */
#include "ctx_internal.h"

#include <math.h>

static tm_status ensure_grad(tm_ctx *ctx, tm_tensor *t) {
    if (t->grad) return TM_OK;
    return tm__tensor_zeros(ctx, t->dtype, t->ndim, t->shape, t->device, &t->grad);
}

/* Whether input i of c may get a fresh (unfilled, write-whole) gradient: the op writes its
 * gradients whole, the input has none yet, it is no parameter or buffer (those accumulate over
 * micro-batches), and no other input of the call is the same tensor (x * x: the second
 * contribution adds to the first). */
static int fresh_ok(const tm__call *c, int i) {
    const tm_tensor *s = c->src[i];
    if (!(tm__op_table[c->op].flags & TM__OP_GRAD_WRITES)) return 0;
    if (c->ctx->fresh_force) return 1; /* test hook: a deliberately wrong autograd */
    if (s->grad || s->persistent || s->is_param) return 0;
    for (int j = 0; j < c->n_in; j++)
        if (j != i && c->src[j] == s) return 0;
    return 1;
}

tm_status tm__gin_prepare(tm__call *c, int i) {
    if (!c->gin[i] || !c->gin_fresh[i]) return TM_OK;
    c->gin_fresh[i] = 0;
    return tm__dev_memset0(c->ctx, c->gin[i]->device, tm__data(c->gin[i]),
                           (size_t)tm__numel(c->gin[i]) * tm_dtype_size(c->gin[i]->dtype));
}

/* After node n's backward (or its skipping): free its upstream gradients (the outputs'
 * gradients, zeros made for outputs without one, perturbed copies), its saved tensors and its
 * staging copies. */
static void release_node(tm_ctx *ctx, tm__node *n) {
    if (!ctx->mem_reuse) return;
    tm__call *c = &n->call;
    for (int i = 0; i < c->n_out; i++) {
        tm_tensor *o = c->out[i], *g = c->gout[i];
        if (g && g != o->grad) tm__tensor_release(ctx, g);
        c->gout[i] = NULL;
        if (o->grad && o->node == n && !o->persistent && !o->grad->persistent) {
            tm__tensor_release(ctx, o->grad);
            o->grad = NULL;
        }
    }
    tm__release_call(c);
}

static tm_status run_nodes(tm_ctx *ctx) {
    tm__node *n = ctx->tape;
    ctx->tape = NULL; /* consumed, even on error: a retry must not double-count */
    /* an armed backward all-reduces the parameters' gradients as they become final
     * (grad_sync.c): before node k's backward, the chunks whose last writer was a node < k */
    TM__TRY(tm__gsync_plan(ctx, n));
    int64_t k = 0;
    for (; n; n = n->prev, k++) {
        TM__TRY(tm__gsync_progress(ctx, k - 1));
        tm__call *c = &n->call;
        int any = 0, collective = (tm__op_table[c->op].flags & TM__OP_COLLECTIVE) != 0;
        for (int i = 0; i < c->n_out; i++) any |= c->out[i]->grad != NULL;
        if (!any && !collective) {
            release_node(ctx, n);
            continue;
        }
        for (int i = 0; i < c->n_out; i++) {
            if (c->out[i]->grad) {
                c->gout[i] = c->out[i]->grad;
            } else {
                tm_tensor *z;
                TM__TRY(tm__tensor_zeros(ctx, c->out[i]->dtype, c->out[i]->ndim, c->out[i]->shape, c->out[i]->device, &z));
                c->gout[i] = z;
            }
        }
        if (ctx->perturb_op == c->op) {
            /* Test hook (tm__test_perturb_backward): a deliberately wrong backward. */
            for (int i = 0; i < c->n_out; i++) {
                if (!tm__is_float(c->gout[i]->dtype)) continue; /* index outputs carry no gradient */
                tm_tensor *g;
                TM__TRY(tm__tensor_zeros(ctx, c->gout[i]->dtype, c->gout[i]->ndim, c->gout[i]->shape, c->gout[i]->device, &g));
                TM__TRY(tm__accumulate(ctx, g, c->gout[i], 1.25));
                c->gout[i] = g;
            }
        }
        /* A view of a ZeRO-3 unit whose gradient is already the unit's (fsdp.c) has nothing to
         * move; a reshape whose input has no gradient yet hands its output's gradient over
         * instead of adding it into zeros (ops/shape.c). */
        if (c->op == TM__OP_VIEW && ctx->perturb_op != c->op && (tm__fsdp_view_grad_skip(c) || tm__view_grad_adopt(c))) {
            release_node(ctx, n);
            continue;
        }
        int needed = 0;
        for (int i = 0; i < c->n_in; i++) {
            tm_tensor *s = c->src[i];
            c->gin[i] = NULL;
            c->gin_fresh[i] = 0;
            if (!s->requires_grad) continue;
            tm_status ast;
            if (s->storage && s->storage->fsdp && tm__fsdp_grad_alias(c, i, &ast)) {
                /* ZeRO-3: a gathered unit's weights take their gradients in the unit's buffer (fsdp.c) */
                TM__TRY(ast);
                c->gin[i] = s->grad;
                needed = 1;
                continue;
            }
            if (fresh_ok(c, i)) {
                if (!s->grad) TM__TRY(tm__tensor_new(ctx, s->dtype, s->ndim, s->shape, s->device, &s->grad));
                if (ctx->fresh_poison) TM__TRY(tm__fill(ctx, s->grad, NAN));
                c->gin_fresh[i] = 1;
                ctx->fresh_count++;
            }
            TM__TRY(ensure_grad(ctx, s));
            c->gin[i] = s->grad;
            needed = 1;
        }
        if ((needed || collective) && tm__side_pending(ctx)) {
            /* a gradient (or input) still being written by a collective beside the work, e.g.
             * the chunked MoE layer's all-to-all backward (side.c): the work waits for it here,
             * at its first reader, not when the collective was started */
            for (int i = 0; i < c->n_out; i++) TM__TRY(tm__side_wait(ctx, c->gout[i]));
            for (int i = 0; i < c->n_in; i++) {
                TM__TRY(tm__side_wait(ctx, c->gin[i]));
                TM__TRY(tm__side_wait(ctx, c->in[i]));
            }
            for (int i = 0; i < c->n_saved; i++) TM__TRY(tm__side_wait(ctx, c->saved[i]));
        }
        if (needed || collective) { /* a collective's backward runs on every rank */
            /* ZeRO-3: a gathered weight given back after its layer's forward is gathered again
             * for the backward that reads it (fsdp.c) */
            for (int i = 0; i < c->n_in; i++)
                if (c->in[i]->storage && c->in[i]->storage->fsdp) TM__TRY(tm__fsdp_regather(ctx, c->in[i]->storage));
            for (int i = 0; i < c->n_saved; i++)
                if (c->saved[i] && c->saved[i]->storage && c->saved[i]->storage->fsdp)
                    TM__TRY(tm__fsdp_regather(ctx, c->saved[i]->storage));
            tm_status st = tm__run_kernel(c, 1);
            /* written now: a later contributor adds */
            memset(c->gin_fresh, 0, sizeof c->gin_fresh);
            if (st != TM_OK) return st;
        }
        /* the all-gather of a weight is done: every reader of it (views included) came later
         * on the tape, so its memory can go (ZeRO-3), kept from the forward or not */
        if (c->op == TM__OP_COMM_ALLGATHER && c->out[0]->storage && c->out[0]->storage->fsdp)
            tm__fsdp_gather_released(ctx, c->out[0]);
        release_node(ctx, n);
    }
    return tm__gsync_progress(ctx, INT64_MAX);
}

static tm_status run_tape(tm_ctx *ctx) {
    tm_status r = run_nodes(ctx);
    /* Collectives still running beside the work end here, also after an error (nothing may
     * still write a gradient when the caller zeroes or reads them): gradients of leaves written
     * by them (side.c), ZeRO-3's gradient reduce-scatters (fsdp.c), the gradient all-reduce's
     * pieces (grad_sync.c, told the outcome: a piece that failed at its wait was not reduced). */
    tm_status s = tm__side_finish_all(ctx);
    tm_status f = tm__fsdp_backward_done(ctx);
    tm_status all = r != TM_OK ? r : s != TM_OK ? s : f;
    tm__gsync_end(ctx, all);
    return all;
}

tm_status tm_backward_with_grad(tm_ctx *ctx, tm_tensor *out, tm_tensor *grad) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out || !grad) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_backward: %s is NULL", out ? "grad" : "output");
    if (ctx->no_grad_buffers)
        return tm__err(ctx, TM_ERR_STATE, "tm_backward: %s: this context was made with tm_ctx_options.no_grad_buffers "
                       "= 1 (forwards only: its parameters have no gradient buffers); make the context without it to "
                       "train", tm__tdesc(ctx, out));
    if (!out->requires_grad)
        return tm__err(ctx, TM_ERR_STATE, "tm_backward: %s does not require grad (no parameter or requires_grad "
                       "input reached it, or grad mode was off)", tm__tdesc(ctx, out));
    if (grad->ndim != out->ndim || tm__numel(grad) != tm__numel(out))
        return tm__err(ctx, TM_ERR_SHAPE, "tm_backward: gradient %s does not match output %s", tm__tdesc(ctx, grad),
                       tm__tdesc(ctx, out));
    for (int i = 0; i < out->ndim; i++)
        if (grad->shape[i] != out->shape[i])
            return tm__err(ctx, TM_ERR_SHAPE, "tm_backward: gradient %s does not match output %s", tm__tdesc(ctx, grad),
                           tm__tdesc(ctx, out));
    if (!tm__same_device(grad->device, out->device))
        return tm__err(ctx, TM_ERR_DEVICE, "tm_backward: gradient %s is not on the output's device (%s)",
                       tm__tdesc(ctx, grad), tm__tdesc(ctx, out));
    /* ZeRO-2: the parameters' full gradient buffers exist from a step's first backward on */
    TM__TRY(tm__bucket_grads_materialize(ctx));
    if (out->grad) {
        TM__TRY(tm__accumulate(ctx, out->grad, grad, 1.0));
    } else {
        /* A fresh gradient is the seed itself: one copy, the bits zeros + grad would give,
         * without zeroing the buffer and reading it back (a full pass each for a large out). */
        TM__TRY(tm__tensor_new(ctx, out->dtype, out->ndim, out->shape, out->device, &out->grad));
        TM__TRY(tm__copy_into(ctx, out->grad, grad));
    }
    return run_tape(ctx);
}

tm_status tm_backward(tm_ctx *ctx, tm_tensor *loss) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!loss) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_backward: loss is NULL");
    if (tm__numel(loss) != 1)
        return tm__err(ctx, TM_ERR_SHAPE, "tm_backward: loss must have one element, got %s (use "
                       "tm_backward_with_grad for non-scalar outputs)", tm__tdesc(ctx, loss));
    if (!loss->requires_grad)
        return tm__err(ctx, TM_ERR_STATE, "tm_backward: loss %s does not require grad", tm__tdesc(ctx, loss));
    tm_tensor *one;
    TM__TRY(tm__tensor_new(ctx, loss->dtype, loss->ndim, loss->shape, loss->device, &one));
    TM__TRY(tm__fill(ctx, one, 1.0));
    tm_status s = tm_backward_with_grad(ctx, loss, one);
    tm__tensor_release(ctx, one);
    return s;
}

/* Test hook: make the backward of op `op` (tm__op_id, -1 to disable) see its upstream
 * gradient scaled by 1.25, i.e. a deliberately broken backward. */
void tm__test_perturb_backward(tm_ctx *ctx, int op) {
    if (ctx) ctx->perturb_op = op;
}

void tm__test_fresh_hooks(tm_ctx *ctx, int poison, int force) {
    if (!ctx) return;
    ctx->fresh_poison = poison;
    ctx->fresh_force = force;
}

int64_t tm__test_fresh_count(const tm_ctx *ctx) { return ctx ? ctx->fresh_count : 0; }
