/*
 * grouped_swiglu.cu — CUDA kernels of tm_grouped_swiglu: the experts' gate and up projections
 * with SwiGLU.
 *
 * Layout, as kernels/cpu/grouped_swiglu.c:
 *   in[0]    x       (R, K)     rows of group g are [off_g, off_g + counts[g]) (grouped_matmul's)
 *   in[1]    w_gate  (G, K, F)
 *   in[2]    w_up    (G, K, F)
 *   in[3]    counts  (G) i64    each >= 0, sum = R
 *   out[0]   h       (R, F)     h = silu(a) * b
 *   saved[0] a       (R, F)     a_g = x_g @ w_gate[g], in x's dtype (what grouped_matmul stores)
 *   saved[1] b       (R, F)     b_g = x_g @ w_up[g]
 *
 * Forward: bf16 x first offers the call to gsw_try_fused, the one-launch Hopper path (both
 * GEMMs with SwiGLU in the epilogue, writing a, b and h: the composition's values, a and b
 * rounded to bf16 before the activation reads them). Where it does not run, and for f32, the
 * composition: grouped_matmul's kernels for a and b (whichever path the context's grouped_gemm
 * mode selects, with its counts contract: a host mirror or one read back for cuBLASLt, none on
 * the device schedules), then swiglu's kernel on them.
 * Backward, the composition's kernels in the order its tape runs them (newest first), so every
 * gradient has its bits (bf16 intermediates are bf16 tensors here, as there):
 *   swiglu:  da, db = d(silu(a) * b) into fresh scratch of a's dtype (only those some gradient needs)
 *   up:      dx (+)= db_g @ w_up[g]^T,   dw_up[g] += x_g^T @ db_g      (dx written if fresh)
 *   gate:    dx  += da_g @ w_gate[g]^T,  dw_gate[g] += x_g^T @ da_g
 */
#include "common.cuh"
#include "grouped_matmul_sm90.h"

#include <string.h>

/* The one-launch path under TM_GROUPED_GEMM_HOPPER (grouped_matmul_sm90.cu's FWD_SWIGLU: both
 * GEMMs and the activation in one kernel, counts read on the device): 1 when it ran (its status
 * in *s), 0 to run the composition (the reason goes to tm__gmm_note, as grouped_matmul's does). */
static int gsw_try_fused(tm__call *c, tm__cuda *st, tm_tensor *a, tm_tensor *b, tm_tensor *h, tm_status *s) {
    *s = TM_OK;
    if (tm__gmm_mode(c->ctx) != TM_GROUPED_GEMM_HOPPER) return 0;
    const tm_tensor *x = c->in[0], *wg = c->in[1], *wu = c->in[2];
    /* a mirror of the counts is validated as grouped_matmul's device path does; nothing is read back */
    tm__call k = tm__grouped_swiglu_gmm_call(c, 1, a, NULL);
    const int64_t *cnt;
    if ((*s = tm__grouped_matmul_counts_mirrored(&k, &cnt)) != TM_OK) return 1;
    if (x->shape[0] == 0 || wg->shape[2] == 0) return 0; /* nothing to compute: the composition's checks */
    tm__gmm90_args g;
    memset(&g, 0, sizeof g);
    g.mode = TM__GMM90_FWD_SWIGLU;
    g.a = tm__data(x), g.b = tm__data(wg), g.b2 = tm__data(wu);
    g.c = tm__data(h), g.c_gate = tm__data(a), g.c_up = tm__data(b);
    g.counts = (const int64_t *)tm__data(c->in[3]);
    g.G = wg->shape[0], g.R = x->shape[0], g.K = wg->shape[1], g.N = wg->shape[2];
    g.spare_sms = tm__cuda_side_busy(st) ? tm__coll_spare_sms(c->ctx) : 0;
    char why[256];
    const int rc = tm__gmm90_run(&g, st->stream, why, sizeof why);
    if (rc == 0) {
        tm__gmm_set_note(c->ctx, "");
        tm__gsw_fused_count(c->ctx);
        return 1;
    }
    if (rc > 0) {
        tm__gmm_set_note(c->ctx, why);
        return 0;
    }
    *s = tm__err(c->ctx, TM_ERR_CUDA, "%s: x %s, w_gate %s on the sm90 kernel: %s", tm__opname(c),
                 tm__tdesc(c->ctx, x), tm__tdesc(c->ctx, wg), why);
    return 1;
}

extern "C" tm_status tm__grouped_swiglu_forward_cuda(tm__call *c) {
    tm__cuda *st;
    TM__TRY(tm__cu_enter(c->ctx, tm__opname(c), &st)); /* grouped_mlp's kernels run this one too */
    const tm_tensor *x = c->in[0];
    int64_t shape[2] = {x->shape[0], c->in[1]->shape[2]};
    tm_tensor *a, *b, *h = c->out[0];
    TM__TRY(tm__saved_new(c, x->dtype, 2, shape, &a));
    TM__TRY(tm__saved_new(c, x->dtype, 2, shape, &b));
    if (x->dtype == TM_BF16) {
        tm_status s;
        if (gsw_try_fused(c, st, a, b, h, &s)) return s;
    }
    tm__call k = tm__grouped_swiglu_gmm_call(c, 1, a, NULL);
    TM__TRY(tm__grouped_matmul_forward_cuda(&k));
    k = tm__grouped_swiglu_gmm_call(c, 2, b, NULL);
    TM__TRY(tm__grouped_matmul_forward_cuda(&k));
    k = tm__grouped_swiglu_act_call(c, a, b);
    return tm__swiglu_forward_cuda(&k);
}

extern "C" tm_status tm__grouped_swiglu_backward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *gx = c->gin[0], *gwg = c->gin[1], *gwu = c->gin[2], *a = c->saved[0], *b = c->saved[1];
    if (!gx && !gwg && !gwu) return TM_OK;
    /* the composition's swiglu computes the gradient of a (b) only where x or w_gate (w_up) needs one */
    tm_tensor *da = NULL, *db = NULL;
    if (gx || gwg) TM__TRY(tm__tensor_new(ctx, a->dtype, a->ndim, a->shape, a->device, &da));
    if (gx || gwu) TM__TRY(tm__tensor_new(ctx, b->dtype, b->ndim, b->shape, b->device, &db));
    tm__call k = tm__grouped_swiglu_act_call(c, a, b);
    k.gin[0] = da, k.gin_fresh[0] = 1;
    k.gin[1] = db, k.gin_fresh[1] = 1;
    TM__TRY(tm__swiglu_backward_cuda(&k));
    if (db) {
        k = tm__grouped_swiglu_gmm_call(c, 2, NULL, db);
        TM__TRY(tm__grouped_matmul_backward_cuda(&k));
    }
    if (da) {
        k = tm__grouped_swiglu_gmm_call(c, 1, NULL, da);
        if (db) k.gin_fresh[0] = 0; /* the up projection wrote dx */
        TM__TRY(tm__grouped_matmul_backward_cuda(&k));
    }
    return TM_OK;
}
