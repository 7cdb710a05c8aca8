/*
 * grouped_mlp.cu — CUDA kernels of tm_grouped_mlp: the experts' whole FFN.
 *
 * Layout, as kernels/cpu/grouped_mlp.c:
 *   in[0]    x       (R, K)     rows of group g are [off_g, off_g + counts[g]) (grouped_matmul's)
 *   in[1]    w_gate  (G, K, F)
 *   in[2]    w_up    (G, K, F)
 *   in[3]    w_down  (G, F, N)
 *   in[4]    counts  (G) i64    each >= 0, sum = R
 *   out[0]   y       (R, N)     y_g = h_g @ w_down[g]
 *   saved[0] a       (R, F)     a_g = x_g @ w_gate[g], in x's dtype (grouped_swiglu's saved, moved
 *   saved[1] b       (R, F)     b_g = x_g @ w_up[g]     here from the sub-call it saved them on)
 *   saved[2] h       (R, F)     h = silu(a) * b
 *
 * Forward: grouped_swiglu's kernel (its one-launch Hopper path included, under the same
 * conditions) then grouped_matmul's for the down projection, on calls made from this one.
 * Backward, by default the composition's kernels in the order its tape runs them:
 *   down:    dh = dy_g @ w_down[g]^T (fresh scratch of x's dtype), dw_down[g] += h_g^T @ dy_g
 *   swiglu:  grouped_swiglu's backward with dh as its upstream gradient
 * so every gradient has the composition's bits (bf16 intermediates are bf16 tensors here too).
 *
 * The fused backward (gmlp_try_fused): bf16 under TM_GROUPED_GEMM_HOPPER, with the context's
 * tm__grouped_mlp_set_fused on (OFF by default: it has the composition's bits but measured slower
 * than it, framework/internal.h). The down projection's dx and
 * SwiGLU's backward are one launch, DX_SWIGLU: dh = dy_g @ w_down[g]^T rounded to bf16 in the
 * epilogue (never stored), and from it and the saved a, b the gradients da, db, written whole;
 * the sm90 header states them equal to DX (fresh) then the elementwise swiglu backward bit for
 * bit. Then w_down's DW, and the up and gate projections' backward on db and da exactly as
 * grouped_swiglu's backward runs them, so the gradients stay the composition's. Where the kernel
 * declines (device, shapes, alignment, group count: the reason goes to tm__gmm_note) the
 * composition runs.
 */
#include "common.cuh"
#include "grouped_matmul_sm90.h"

#include <string.h>

/* The fused backward: 1 when it ran (its status in *s), 0 to run the composition. */
static int gmlp_try_fused(tm__call *c, tm_status *s) {
    *s = TM_OK;
    tm_ctx *ctx = c->ctx;
    if (tm__gmm_mode(ctx) != TM_GROUPED_GEMM_HOPPER) return 0;
    tm__cuda *st;
    if ((*s = tm__cu_enter(ctx, tm__opname(c), &st)) != TM_OK) return 1;
    tm_tensor *gx = c->gin[0], *gwg = c->gin[1], *gwu = c->gin[2], *gwd = c->gin[3];
    tm_tensor *a = c->saved[0], *b = c->saved[1], *h = c->saved[2];
    const tm_tensor *x = c->in[0], *wd = c->in[3];
    /* a mirror of the counts is validated as grouped_matmul's device path does; nothing is read back */
    tm__call k = tm__grouped_mlp_down_call(c, h, NULL);
    const int64_t *cnt;
    if ((*s = tm__grouped_matmul_counts_mirrored(&k, &cnt)) != TM_OK) return 1;
    const int64_t R = x->shape[0], F = wd->shape[1], N = wd->shape[2];
    if (R == 0 || F == 0 || N == 0) return 0; /* nothing to compute: the composition's checks */
    tm_tensor *da, *db; /* scratch of the kernel's scope, as grouped_swiglu's backward's */
    if ((*s = tm__tensor_new(ctx, a->dtype, a->ndim, a->shape, a->device, &da)) != TM_OK) return 1;
    if ((*s = tm__tensor_new(ctx, b->dtype, b->ndim, b->shape, b->device, &db)) != TM_OK) return 1;
    tm__gmm90_args g;
    memset(&g, 0, sizeof g);
    g.mode = TM__GMM90_DX_SWIGLU;
    g.a = tm__data(c->gout[0]), g.b = tm__data(wd);
    g.c = tm__data(da), g.c_dup = tm__data(db);
    g.gate_in = tm__data(a), g.up_in = tm__data(b);
    g.counts = (const int64_t *)tm__data(c->in[4]);
    g.G = wd->shape[0], g.R = R, g.K = F, g.N = N;
    g.write = 1;
    g.schedule = TM__GMM90_AUTO; /* DX_SWIGLU is ping-pong whatever AUTO picks for the others */
    g.spare_sms = tm__cuda_side_busy(st) ? tm__coll_spare_sms(ctx) : 0;
    char why[256];
    const int rc = tm__gmm90_run(&g, st->stream, why, sizeof why);
    if (rc > 0) {
        tm__gmm_set_note(ctx, why);
        return 0;
    }
    if (rc < 0) {
        *s = tm__err(ctx, TM_ERR_CUDA, "grouped_mlp: dy %s, w_down %s, dx with SwiGLU's backward on the sm90 "
                     "kernel: %s", tm__tdesc(ctx, c->gout[0]), tm__tdesc(ctx, wd), why);
        return 1;
    }
    tm__gmm_set_note(ctx, "");
    tm__grouped_mlp_fused_count(ctx);
    if (gwd) { /* the down projection's DW, as the composition runs it after its dx */
        k = tm__grouped_mlp_down_call(c, h, NULL);
        if ((*s = tm__grouped_matmul_backward_cuda(&k)) != TM_OK) return 1;
    }
    /* grouped_swiglu's backward from here on: the composition's swiglu gives da (db) only where x
     * or w_gate (w_up) needs a gradient, and the up projection's runs first */
    tm__call sw = tm__grouped_mlp_swiglu_call(c, h, NULL);
    const int want_db = gx || gwu, want_da = gx || gwg;
    if (want_db) {
        k = tm__grouped_swiglu_gmm_call(&sw, 2, NULL, db);
        if ((*s = tm__grouped_matmul_backward_cuda(&k)) != TM_OK) return 1;
    }
    if (want_da) {
        k = tm__grouped_swiglu_gmm_call(&sw, 1, NULL, da);
        if (want_db) k.gin_fresh[0] = 0; /* the up projection wrote dx */
        *s = tm__grouped_matmul_backward_cuda(&k);
    }
    return 1;
}

extern "C" tm_status tm__grouped_mlp_forward_cuda(tm__call *c) {
    const tm_tensor *x = c->in[0];
    int64_t shape[2] = {x->shape[0], c->in[1]->shape[2]};
    tm_tensor *h;
    TM__TRY(tm__tensor_new(c->ctx, x->dtype, 2, shape, x->device, &h));
    tm__call k = tm__grouped_mlp_swiglu_call(c, h, NULL);
    TM__TRY(tm__grouped_swiglu_forward_cuda(&k));
    if (k.n_saved != 2)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "grouped_mlp: grouped_swiglu's forward saved %d tensors, want 2",
                       k.n_saved);
    c->saved[c->n_saved++] = k.saved[0];
    c->saved[c->n_saved++] = k.saved[1];
    c->saved[c->n_saved++] = h;
    k = tm__grouped_mlp_down_call(c, h, NULL);
    return tm__grouped_matmul_forward_cuda(&k);
}

extern "C" tm_status tm__grouped_mlp_backward_cuda(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    tm_tensor *gx = c->gin[0], *gwg = c->gin[1], *gwu = c->gin[2], *gwd = c->gin[3];
    if (c->n_saved != 3)
        return tm__err(ctx, TM_ERR_INTERNAL, "grouped_mlp: backward got %d saved tensors, want 3", c->n_saved);
    if (!gx && !gwg && !gwu && !gwd) return TM_OK;
    tm_tensor *h = c->saved[2];
    const int want_dh = gx || gwg || gwu; /* the composition's h needs a gradient only then */
    if (want_dh && h->dtype == TM_BF16 && tm__grouped_mlp_fused(ctx)) {
        tm_status s;
        if (gmlp_try_fused(c, &s)) return s;
    }
    tm_tensor *dh = NULL;
    if (want_dh) TM__TRY(tm__tensor_new(ctx, h->dtype, h->ndim, h->shape, h->device, &dh));
    tm__call k = tm__grouped_mlp_down_call(c, h, dh);
    TM__TRY(tm__grouped_matmul_backward_cuda(&k));
    if (!dh) return TM_OK;
    k = tm__grouped_mlp_swiglu_call(c, h, dh);
    return tm__grouped_swiglu_backward_cuda(&k);
}
