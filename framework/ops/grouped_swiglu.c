/*
 * grouped_swiglu.c — tm_grouped_swiglu (the experts' gate and up projections with SwiGLU):
 * public entry point and shape/dtype check. Kernels: kernels/cpu/grouped_swiglu.c (layout and
 * saved tensors documented there), kernels/cuda/grouped_swiglu.cu.
 *
 * The check is grouped_matmul's (framework/ops/grouped_matmul.c) for (x, w_gate) plus "w_up is
 * w_gate's twin"; the counts' values are validated by the kernels, through the grouped_matmul
 * kernels they call (tm__grouped_matmul_counts, whose messages name this op).
 */
#include "internal.h"

#include <stdio.h>

/* x = in[0], w_gate = in[1], w_up = in[2] and the counts in[ic], of one op whose float inputs
 * in[0, nf) must share x's dtype (grouped_mlp's w_down among them: its own shape is its check's);
 * messages name the op and the nf float inputs (`names`, comma-separated as they should read). */
tm_status tm__grouped_swiglu_operands_check(tm__call *c, int nf, int ic, const char *names) {
    tm_ctx *ctx = c->ctx;
    const char *op = tm__opname(c);
    const tm_tensor *x = c->in[0], *wg = c->in[1], *wu = c->in[2], *counts = c->in[ic];
    int one = 1;
    for (int i = 0; i < nf; i++) {
        TM__TRY(tm__check_float(c, i));
        one &= c->in[i]->dtype == x->dtype;
    }
    if (!one) {
        static const char *const label[4] = {"x", "w_gate", "w_up", "w_down"};
        char got[512];
        int at = 0;
        for (int i = 0; i < nf && i < 4 && at < (int)sizeof got; i++)
            at += snprintf(got + at, sizeof got - (size_t)at, "%s%s %s", i ? ", " : "", label[i], tm__tdesc(ctx, c->in[i]));
        return tm__err(ctx, TM_ERR_DTYPE, "%s: %s must have one dtype, got %s", op, names, got);
    }
    if (counts->dtype != TM_I64)
        return tm__err(ctx, TM_ERR_DTYPE, "%s: counts must be i64 [G], got %s", op, tm__tdesc(ctx, counts));
    if (x->ndim != 2) return tm__err(ctx, TM_ERR_SHAPE, "%s: x must be [R,K], got %s", op, tm__tdesc(ctx, x));
    if (wg->ndim != 3) return tm__err(ctx, TM_ERR_SHAPE, "%s: w_gate must be [G,K,F], got %s", op, tm__tdesc(ctx, wg));
    int same = wu->ndim == 3;
    for (int d = 0; same && d < 3; d++) same = wu->shape[d] == wg->shape[d];
    if (!same)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: w_gate and w_up must have one shape [G,K,F], got w_gate %s, w_up %s", op,
                       tm__tdesc(ctx, wg), tm__tdesc(ctx, wu));
    if (counts->ndim != 1 || counts->shape[0] != wg->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "%s: counts must be [%lld] (one per group of w_gate), got counts %s, w_gate %s",
                       op, (long long)wg->shape[0], tm__tdesc(ctx, counts), tm__tdesc(ctx, wg));
    if (wg->shape[1] != x->shape[1])
        return tm__err(ctx, TM_ERR_SHAPE, "%s: inner dims differ: x %s, w_gate %s (w_gate and w_up must be [G,%lld,F])",
                       op, tm__tdesc(ctx, x), tm__tdesc(ctx, wg), (long long)x->shape[1]);
    return TM_OK;
}

tm_status tm__grouped_swiglu_check(tm__call *c) {
    TM__TRY(tm__grouped_swiglu_operands_check(c, 3, 3, "x, w_gate and w_up"));
    const tm_tensor *x = c->in[0], *wg = c->in[1];
    int64_t shape[2] = {x->shape[0], wg->shape[2]};
    return tm__out_new(c, 0, x->dtype, 2, shape);
}

tm_status tm_grouped_swiglu(tm_ctx *ctx, tm_tensor *x, tm_tensor *w_gate, tm_tensor *w_up, tm_tensor *counts,
                            tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_GROUPED_SWIGLU);
    c.n_in = 4;
    c.in[0] = x;
    c.in[1] = w_gate;
    c.in[2] = w_up;
    c.in[3] = counts;
    return tm__op_run1(&c, out);
}

/* The kernels are the composition's kernels run on calls made from this op's call: the same
 * tensors in the slots those kernels read, under this op (so that their messages, the counts'
 * included, name grouped_swiglu). */
tm__call tm__grouped_swiglu_gmm_call(const tm__call *c, int w, tm_tensor *y, tm_tensor *dy) {
    tm__call s = tm__call_init(c->ctx, c->op);
    s.n_in = 3;
    s.n_out = 1;
    const int from[3] = {0, w, 3};
    for (int i = 0; i < 3; i++) {
        s.in[i] = c->in[from[i]];
        s.src[i] = c->src[from[i]];
    }
    s.out[0] = y;
    s.gout[0] = dy;
    if (dy) { /* backward: x's and this weight's gradients */
        s.gin[0] = c->gin[0], s.gin_fresh[0] = c->gin_fresh[0];
        s.gin[1] = c->gin[w], s.gin_fresh[1] = c->gin_fresh[w];
    }
    return s;
}

tm__call tm__grouped_swiglu_act_call(const tm__call *c, tm_tensor *a, tm_tensor *b) {
    tm__call s = tm__call_init(c->ctx, c->op);
    s.n_in = 2;
    s.n_out = 1;
    s.in[0] = s.src[0] = a;
    s.in[1] = s.src[1] = b;
    s.out[0] = c->out[0];
    s.gout[0] = c->gout[0];
    return s;
}
