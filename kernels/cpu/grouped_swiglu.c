/*
 * grouped_swiglu.c — CPU kernels of tm_grouped_swiglu: the experts' gate and up projections
 * with SwiGLU, as the composition of grouped_matmul's and swiglu's CPU kernels.
 *
 * Layout:
 *   in[0]    x       (R, K)     rows of group g are [off_g, off_g + counts[g]) (grouped_matmul's)
 *   in[1]    w_gate  (G, K, F)
 *   in[2]    w_up    (G, K, F)
 *   in[3]    counts  (G) i64    each >= 0, sum = R
 *   out[0]   h       (R, F)     h = silu(a) * b
 *   saved[0] a       (R, F)     a_g = x_g @ w_gate[g], in the kernel's dtype (f32 for bf16 x)
 *   saved[1] b       (R, F)     b_g = x_g @ w_up[g]
 * Backward, the composition's kernels in the order its tape runs them (newest first):
 *   swiglu:  da, db = d(silu(a) * b) into fresh scratch (only those some gradient needs)
 *   up:      dx (+)= db_g @ w_up[g]^T,   dw_up[g] += x_g^T @ db_g      (dx written if fresh)
 *   gate:    dx  += da_g @ w_gate[g]^T,  dw_gate[g] += x_g^T @ da_g
 * so every gradient has the composition's bits: the same GEMMs adding into dx in the same order.
 *
 * bf16: the dispatcher runs the kernels on f32 copies (bf16 is storage-only on the CPU) and
 * rounds the results once. The composition also rounds what it stores between its ops: a and b
 * (grouped_matmul's bf16 outputs), da and db (swiglu's bf16 input gradients) and dx after the up
 * projection's contribution (a bf16 gradient). Where the caller's x is bf16 these kernels round
 * the same values through bf16 at the same points, so the op equals the composition bitwise in
 * bf16 too; a and b are saved rounded, as the composition keeps them.
 */
#include "internal.h"

tm_status tm__grouped_swiglu_forward_cpu(tm__call *c) {
    const tm_tensor *x = c->in[0];
    tm_dtype dt = x->dtype;
    if (dt != TM_F32 && dt != TM_F64)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "grouped_swiglu: CPU kernel got x %s", tm__tdesc(c->ctx, x));
    int bf16 = c->src[0]->dtype == TM_BF16;
    int64_t shape[2] = {x->shape[0], c->in[1]->shape[2]};
    tm_tensor *a, *b;
    TM__TRY(tm__saved_new(c, dt, 2, shape, &a));
    TM__TRY(tm__saved_new(c, dt, 2, shape, &b));
    tm__call s = tm__grouped_swiglu_gmm_call(c, 1, a, NULL);
    TM__TRY(tm__grouped_matmul_forward_cpu(&s));
    s = tm__grouped_swiglu_gmm_call(c, 2, b, NULL);
    TM__TRY(tm__grouped_matmul_forward_cpu(&s));
    if (bf16) tm__round_bf16_host(a), tm__round_bf16_host(b);
    s = tm__grouped_swiglu_act_call(c, a, b);
    return tm__swiglu_forward_cpu(&s);
}

tm_status tm__grouped_swiglu_backward_cpu(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *gx = c->gin[0], *gwg = c->gin[1], *gwu = c->gin[2], *a = c->saved[0], *b = c->saved[1];
    if (a->dtype != TM_F32 && a->dtype != TM_F64)
        return tm__err(ctx, TM_ERR_INTERNAL, "grouped_swiglu: CPU kernel got a %s", tm__tdesc(ctx, a));
    if (!gx && !gwg && !gwu) return TM_OK;
    int bf16 = c->src[0]->dtype == TM_BF16;
    /* the composition's swiglu computes the gradient of a (b) only where x or w_gate (w_up) needs one */
    tm_tensor *da = NULL, *db = NULL;
    if (gx || gwg) TM__TRY(tm__tensor_new(ctx, a->dtype, a->ndim, a->shape, a->device, &da));
    if (gx || gwu) TM__TRY(tm__tensor_new(ctx, b->dtype, b->ndim, b->shape, b->device, &db));
    tm__call s = tm__grouped_swiglu_act_call(c, a, b);
    s.gin[0] = da, s.gin_fresh[0] = 1;
    s.gin[1] = db, s.gin_fresh[1] = 1;
    TM__TRY(tm__swiglu_backward_cpu(&s));
    if (bf16) {
        if (da) tm__round_bf16_host(da);
        if (db) tm__round_bf16_host(db);
    }
    if (db) {
        s = tm__grouped_swiglu_gmm_call(c, 2, NULL, db);
        TM__TRY(tm__grouped_matmul_backward_cpu(&s));
        /* dx holds the up projection's contribution now (gate's adds to it); the composition
         * stores it in bf16 in between, as it does a weight gradient that w_gate shares */
        if (bf16 && gx) tm__round_bf16_host(gx);
        if (bf16 && gwu && gwu == gwg) tm__round_bf16_host(gwu);
    }
    if (da) {
        s = tm__grouped_swiglu_gmm_call(c, 1, NULL, da);
        if (db) s.gin_fresh[0] = 0; /* the up projection wrote dx */
        TM__TRY(tm__grouped_matmul_backward_cpu(&s));
    }
    return TM_OK;
}
