/*
 * attention.c — tm_attention (fused causal attention with grouped-query heads): public entry
 * point and check. Kernels: kernels/cpu/attention.c, kernels/cuda/attention.cu.
 *
 * Call layout: in[0] q (B, Tq, Hq, D), in[1] k (B, Tk, Hkv, D), in[2] v (B, Tk, Hkv, D);
 * fattr[0] scale (<= 0: 1/sqrt(D)); out[0] (B, Tq, Hq, D); saved[0] logsumexp (B, Hq, Tq).
 */
#include <math.h>

#include "internal.h"

tm_status tm__attention_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *q = c->in[0], *k = c->in[1], *v = c->in[2];
    for (int i = 0; i < 3; i++) {
        TM__TRY(tm__check_float(c, i));
        TM__TRY(tm__check_ndim(c, i, 4, 4));
    }
    TM__TRY(tm__check_same_dtype(c, 0, 1));
    TM__TRY(tm__check_same_dtype(c, 0, 2));
    for (int d = 0; d < 4; d++)
        if (v->shape[d] != k->shape[d])
            return tm__err(ctx, TM_ERR_SHAPE, "attention: v must have the shape of k [B,Tk,Hkv,D], got k %s, v %s",
                           tm__tdesc(ctx, k), tm__tdesc(ctx, v));
    int64_t B = q->shape[0], Tq = q->shape[1], Hq = q->shape[2], D = q->shape[3];
    int64_t Tk = k->shape[1], Hkv = k->shape[2];
    if (k->shape[0] != B || k->shape[3] != D)
        return tm__err(ctx, TM_ERR_SHAPE,
                       "attention: q [B,Tq,Hq,D] and k [B,Tk,Hkv,D] must agree in B and D, got q %s, k %s",
                       tm__tdesc(ctx, q), tm__tdesc(ctx, k));
    if (D < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0)
        return tm__err(ctx, TM_ERR_SHAPE,
                       "attention: needs D >= 1 and Hq a positive multiple of Hkv (q [B,Tq,Hq,D], k [B,Tk,Hkv,D]), "
                       "got q %s, k %s",
                       tm__tdesc(ctx, q), tm__tdesc(ctx, k));
    if (Tk < Tq)
        return tm__err(ctx, TM_ERR_SHAPE,
                       "attention: needs Tk >= Tq (queries are the last Tq of Tk positions), got q %s, k %s",
                       tm__tdesc(ctx, q), tm__tdesc(ctx, k));
    if (!isfinite(c->fattr[0]))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "attention: scale must be finite (<= 0 for 1/sqrt(D)), got %g (q %s)",
                       c->fattr[0], tm__tdesc(ctx, q));
    return tm__out_new(c, 0, q->dtype, 4, q->shape);
}

tm_status tm_attention(tm_ctx *ctx, tm_tensor *q, tm_tensor *k, tm_tensor *v, double scale, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_ATTENTION);
    c.n_in = 3;
    c.in[0] = q;
    c.in[1] = k;
    c.in[2] = v;
    c.fattr[0] = scale;
    return tm__op_run1(&c, out);
}
