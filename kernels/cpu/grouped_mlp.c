/*
 * grouped_mlp.c — CPU kernels of tm_grouped_mlp: the experts' whole FFN, as the composition of
 * grouped_swiglu's and grouped_matmul's CPU kernels.
 *
 * Layout:
 *   in[0]    x       (R, K)     rows of group g are [off_g, off_g + counts[g]) (grouped_matmul's)
 *   in[1]    w_gate  (G, K, F)
 *   in[2]    w_up    (G, K, F)
 *   in[3]    w_down  (G, F, N)
 *   in[4]    counts  (G) i64    each >= 0, sum = R
 *   out[0]   y       (R, N)     y_g = h_g @ w_down[g]
 *   saved[0] a       (R, F)     a_g = x_g @ w_gate[g]   (grouped_swiglu's saved[0] and [1], in the
 *   saved[1] b       (R, F)     b_g = x_g @ w_up[g]      kernel's dtype: f32 for bf16 x)
 *   saved[2] h       (R, F)     h = silu(a) * b, the down projection's input
 * grouped_swiglu's forward allocates a and b with tm__saved_new on the call it is given, so they
 * land in that sub-call's saved[]; they are moved into this call's, where the dispatcher keeps
 * them past the kernel's scope and the tape hands them to the backward.
 * Backward, the composition's kernels in the order its tape runs them (newest first):
 *   down:    dh = dy_g @ w_down[g]^T (fresh scratch),  dw_down[g] += h_g^T @ dy_g
 *   swiglu:  grouped_swiglu's backward with dh as its upstream gradient (its comment says how)
 * dh only where x, w_gate or w_up needs a gradient (the composition's h needs none otherwise).
 *
 * bf16: the dispatcher runs the kernels on f32 copies and rounds the results once; the
 * composition also stores h (grouped_swiglu's output, the down projection's input) and dh (h's
 * gradient) as bf16 tensors, so these kernels round them at the same points, as grouped_swiglu's
 * kernels do with a, b, da, db (kernels/cpu/grouped_swiglu.c); w_down's gradient too, where it is
 * one tensor with w_gate's or w_up's (the composition stores it between the down projection's
 * contribution and the SwiGLU's). h is saved rounded.
 */
#include "internal.h"

tm_status tm__grouped_mlp_forward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0];
    tm_dtype dt = x->dtype;
    if (dt != TM_F32 && dt != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "grouped_mlp: CPU kernel got x %s", tm__tdesc(c->ctx, x));
    int bf16 = c->src[0]->dtype == TM_BF16;
    int64_t shape[2] = {x->shape[0], c->in[1]->shape[2]};
    tm_tensor *h;
    TM__TRY(tm__tensor_new(c->ctx, dt, 2, shape, x->device, &h));
    tm__call s = tm__grouped_mlp_swiglu_call(c, h, NULL);
    TM__TRY(tm__grouped_swiglu_forward_cpu(&s));
    if (s.n_saved != 2)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "grouped_mlp: grouped_swiglu's forward saved %d tensors, want 2",
                       s.n_saved);
    c->saved[c->n_saved++] = s.saved[0];
    c->saved[c->n_saved++] = s.saved[1];
    c->saved[c->n_saved++] = h;
    if (bf16) tm__round_bf16_host(h);
    s = tm__grouped_mlp_down_call(c, h, NULL);
    return tm__grouped_matmul_forward_cpu(&s);
}

tm_status tm__grouped_mlp_backward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *gx = c->gin[0], *gwg = c->gin[1], *gwu = c->gin[2], *gwd = c->gin[3];
    if (c->n_saved != 3)
        return tm__err(ctx, TM_ERR_INTERNAL, "grouped_mlp: backward got %d saved tensors, want 3", c->n_saved);
    tm_tensor *h = c->saved[2];
    if (h->dtype != TM_F32 && h->dtype != TM_F64)
        return tm__err(ctx, TM_ERR_INTERNAL, "grouped_mlp: CPU kernel got h %s", tm__tdesc(ctx, h));
    if (!gx && !gwg && !gwu && !gwd) return TM_OK;
    int bf16 = c->src[0]->dtype == TM_BF16;
    tm_tensor *dh = NULL;
    if (gx || gwg || gwu) TM__TRY(tm__tensor_new(ctx, h->dtype, h->ndim, h->shape, h->device, &dh));
    tm__call s = tm__grouped_mlp_down_call(c, h, dh);
    TM__TRY(tm__grouped_matmul_backward_cpu(&s));
    if (!dh) return TM_OK;
    if (bf16) {
        tm__round_bf16_host(dh);
        if (gwd && (gwd == gwg || gwd == gwu)) tm__round_bf16_host(gwd);
    }
    s = tm__grouped_mlp_swiglu_call(c, h, dh);
    return tm__grouped_swiglu_backward_cpu(&s);
}
