/*
 * grouped_mlp.c — tm_grouped_mlp (the experts' whole FFN: gate and up projections with SwiGLU,
 * then the down projection; Megatron-LM's GroupedMLP): public entry point and shape/dtype check.
 * Kernels: kernels/cpu/grouped_mlp.c (layout and saved tensors documented there),
 * kernels/cuda/grouped_mlp.cu.
 *
 * The check is grouped_swiglu's (tm__grouped_swiglu_operands_check) for (x, w_gate, w_up) plus
 * "w_down is [G,F,N] with w_gate's G and F"; the counts' values are validated by the kernels,
 * through the grouped_matmul kernels they call (tm__grouped_matmul_counts, whose messages name
 * this op).
 */
#include "internal.h"

tm_status tm__grouped_mlp_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *wg = c->in[1], *wd = c->in[3];
    TM__TRY(tm__grouped_swiglu_operands_check(c, 4, 4, "x, w_gate, w_up and w_down"));
    if (wd->ndim != 3 || wd->shape[0] != wg->shape[0] || wd->shape[1] != wg->shape[2])
        return tm__err(ctx, TM_ERR_SHAPE, "grouped_mlp: w_down must be [%lld,%lld,N] (w_gate's G and F), got "
                       "w_down %s, w_gate %s", (long long)wg->shape[0], (long long)wg->shape[2], tm__tdesc(ctx, wd),
                       tm__tdesc(ctx, wg));
    int64_t shape[2] = {x->shape[0], wd->shape[2]};
    return tm__out_new(c, 0, x->dtype, 2, shape);
}

tm_status tm_grouped_mlp(tm_ctx *ctx, tm_tensor *x, tm_tensor *w_gate, tm_tensor *w_up, tm_tensor *w_down,
                         tm_tensor *counts, tm_tensor **y) {
    tm__call c = tm__call_init(ctx, TM__OP_GROUPED_MLP);
    c.n_in = 5;
    c.in[0] = x;
    c.in[1] = w_gate;
    c.in[2] = w_up;
    c.in[3] = w_down;
    c.in[4] = counts;
    return tm__op_run1(&c, y);
}

/* The kernels are the composition's kernels run on calls made from this op's call: the same
 * tensors in the slots those kernels read, under this op (so that their messages, the counts'
 * included, name grouped_mlp). In a forward c's gradient slots are empty, so the calls built
 * from it carry none. */
tm__call tm__grouped_mlp_swiglu_call(const tm__call *c, tm_tensor *h, tm_tensor *dh) {
    tm__call s = tm__call_init(c->ctx, c->op);
    s.n_in = 4;
    s.n_out = 1;
    const int from[4] = {0, 1, 2, 4};
    for (int i = 0; i < 4; i++) {
        s.in[i] = c->in[from[i]];
        s.src[i] = c->src[from[i]];
    }
    s.out[0] = h;
    s.gout[0] = dh;
    /* grouped_swiglu's saved a and b (c's first two), which a forward has not made yet: there
     * grouped_swiglu's kernel saves them on s */
    if (c->n_saved >= 2) {
        s.n_saved = 2;
        s.saved[0] = c->saved[0];
        s.saved[1] = c->saved[1];
    }
    for (int i = 0; i < 3; i++) s.gin[i] = c->gin[i], s.gin_fresh[i] = c->gin_fresh[i];
    return s;
}

tm__call tm__grouped_mlp_down_call(const tm__call *c, tm_tensor *h, tm_tensor *dh) {
    tm__call s = tm__call_init(c->ctx, c->op);
    s.n_in = 3;
    s.n_out = 1;
    s.in[0] = h;
    s.in[1] = c->in[3];
    s.in[2] = c->in[4];
    /* x stands for h where grouped_matmul reads its caller's tensor: the rows the counts must sum
     * to and the dtype its synchronisation rule looks at are h's, and the messages name x */
    s.src[0] = c->src[0];
    s.src[1] = c->src[3];
    s.src[2] = c->src[4];
    s.out[0] = c->out[0];
    s.gout[0] = c->gout[0];
    s.gin[0] = dh;
    s.gin_fresh[0] = dh != NULL; /* h's gradient: the composition's first and only contribution */
    s.gin[1] = c->gin[3];
    s.gin_fresh[1] = c->gin_fresh[3];
    return s;
}
