/* test_memory.c — memory reuse within a step, and the memory report.
 *
 * With reuse on (the default), the per-step arenas take blocks back before tm_ctx_arena_reset:
 * kernel scratch when its kernel returns, upstream gradients, saved tensors and staging copies
 * once their tape node's backward has run (framework/arena.c, dispatch.c, autograd.c). These
 * tests hold that to three promises: it saves memory (a training step of a small MoE model
 * peaks at least 30% lower than with reuse off), it changes nothing that is computed (losses
 * and parameters bit-identical to the run without reuse), and a repeated step still makes no
 * system allocation. They also check that the report's categories add up. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"

enum { MB = 4, MT = 32, MV = 61 };

static size_t round64(size_t n) { return (n + 63) / 64 * 64; }

/* A small model of the shape of the shakespeare preset (MoE everywhere, aux and z losses). */
static tm_ctx *model_ctx(int reuse, tm_model **m, tm_optimizer **opt) {
    tm_ctx *ctx = tt_ctx();
    tm__set_mem_reuse(ctx, reuse);
    tm_model_config c = tm_model_config_default();
    c.vocab_size = MV;
    c.d_model = 32;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 4;
    c.max_seq_len = MT;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    c.moe.ffn_size = 64;
    c.moe.router.norm_topk_prob = 1;
    c.moe.aux_loss_coeff = 1e-2;
    c.moe.z_loss_coeff = 1e-3;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), m));
    TT_OK(ctx, tm_model_init(*m, 1));
    TT_OK(ctx, tm_adamw_new(ctx, NULL, opt));
    tm_ctx_arena_reset(ctx);
    return ctx;
}

/* One training step (forward, backward, clip, AdamW at learning rate lr) on a fixed batch;
 * returns the loss. */
static double train_step(tm_ctx *ctx, tm_model *m, tm_optimizer *opt, double lr) {
    int32_t tok[MB * MT], tgt[MB * MT];
    for (int i = 0; i < MB * MT; i++) {
        tok[i] = (int32_t)((i * 37 + 11) % MV);
        tgt[i] = (int32_t)((i * 53 + 5) % MV);
    }
    int64_t sh[2] = {MB, MT};
    tm_tensor *a = NULL, *b = NULL;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, sh, tm_cpu(), TM_I32, tok, &a));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, sh, tm_cpu(), TM_I32, tgt, &b));
    tm_model_out out;
    TT_OK(ctx, tm_model_forward(m, a, b, &out));
    TT_OK(ctx, tm_backward(ctx, out.loss));
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, NULL));
    TT_OK(ctx, tm_optimizer_step(opt, lr));
    TT_OK(ctx, tm_ctx_zero_grad(ctx));
    tm_ctx_arena_reset(ctx);
    return out.loss_value;
}

static size_t peak_temporaries(tm_ctx *ctx) {
    tm_memory_report r;
    TT_OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &r));
    return r.peak[TM_MEM_TEMPORARIES];
}

Test(memory, reuse_cuts_the_peak_of_a_training_step) {
    tm_model *m[2];
    tm_optimizer *opt[2];
    tm_ctx *ctx[2];
    for (int k = 0; k < 2; k++) ctx[k] = model_ctx(k, &m[k], &opt[k]); /* 0: reuse off, 1: on */

    /* Steps 0 and 1 train; steps 2 and 3 run at lr 0, so they route exactly alike. (Two
     * training steps route differently: the expert groups' sizes, and with them the sizes of
     * the grouped matmul's temporaries, follow the weights, so only steps with the same
     * weights must peak alike.) */
    size_t peak[2][4];
    uint64_t allocs[2][4];
    for (int s = 0; s < 4; s++) {
        double loss[2];
        for (int k = 0; k < 2; k++) {
            tm_ctx_memory_reset_peak(ctx[k]);
            loss[k] = train_step(ctx[k], m[k], opt[k], s < 2 ? 1e-3 : 0.0);
            peak[k][s] = peak_temporaries(ctx[k]);
            allocs[k][s] = tm_ctx_alloc_count(ctx[k]);
        }
        cr_assert(memcmp(&loss[0], &loss[1], sizeof(double)) == 0, "step %d: loss %.17g with reuse, %.17g without", s,
                  loss[1], loss[0]);
    }
    cr_log_info("peak temporaries of one step: %zu bytes without reuse, %zu with (%.1f%% less)", peak[0][1], peak[1][1],
                100.0 * (1.0 - (double)peak[1][1] / (double)peak[0][1]));
    cr_assert_lt((double)peak[1][1], 0.7 * (double)peak[0][1], "peak %zu with reuse, %zu without: not 30%% lower",
                 peak[1][1], peak[0][1]);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(peak[k][2], peak[k][3], "identical steps, different peaks (reuse %d): %zu, then %zu bytes", k,
                     peak[k][2], peak[k][3]);
        cr_assert_eq(allocs[k][1], allocs[k][0], "reuse %d: the second step allocated (%llu -> %llu)", k,
                     (unsigned long long)allocs[k][0], (unsigned long long)allocs[k][1]);
        for (int s = 2; s < 4; s++)
            cr_assert_eq(allocs[k][s], allocs[k][0], "reuse %d: step %d allocated", k, s);
        cr_assert_eq(tm_ctx_arena_used(ctx[k], tm_cpu()), 0);
    }

    /* What was computed is what was computed without reuse, to the last bit. */
    int np = tm_ctx_num_params(ctx[0]);
    cr_assert_eq(np, tm_ctx_num_params(ctx[1]));
    for (int i = 0; i < np; i++) {
        tm_tensor *p0 = tm_ctx_param(ctx[0], i), *p1 = tm_ctx_param(ctx[1], i);
        int64_t n = tm_tensor_numel(p0);
        float *v0 = malloc(sizeof(float) * (size_t)n), *v1 = malloc(sizeof(float) * (size_t)n);
        TT_OK(ctx[0], tm_tensor_read(ctx[0], p0, TM_F32, v0, n));
        TT_OK(ctx[1], tm_tensor_read(ctx[1], p1, TM_F32, v1, n));
        int same = memcmp(v0, v1, sizeof(float) * (size_t)n) == 0;
        free(v0);
        free(v1);
        cr_assert(same, "parameter %s differs after 4 steps with and without reuse", tm_tensor_name(p0));
    }
    for (int k = 0; k < 2; k++) {
        tm_optimizer_free(opt[k]);
        tm_model_free(m[k]);
        tm_ctx_free(ctx[k]);
    }
}

static void assert_consistent(tm_ctx *ctx, const char *when) {
    tm_memory_report r;
    TT_OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &r));
    size_t sum = 0, sum_at = 0, sum_peak = 0;
    for (int c = 0; c < TM_MEM_NCATEGORIES; c++) {
        sum += r.current[c];
        sum_at += r.at_peak[c];
        sum_peak += r.peak[c];
        cr_assert_geq(r.peak[c], r.current[c], "%s: category %d below its peak", when, c);
        cr_assert_geq(r.peak[c], r.at_peak[c], "%s: category %d", when, c);
    }
    cr_assert_eq(sum, r.total, "%s: categories sum to %zu, total %zu", when, sum, r.total);
    cr_assert_eq(sum_at, r.total_peak, "%s: at_peak sums to %zu, total_peak %zu", when, sum_at, r.total_peak);
    cr_assert_geq(r.total_peak, r.total, "%s", when);
    cr_assert_leq(r.total_peak, sum_peak, "%s", when);
    cr_assert_eq(r.current[TM_MEM_TEMPORARIES], tm_ctx_arena_used(ctx, tm_cpu()), "%s: temporaries %zu, arena %zu", when,
                 r.current[TM_MEM_TEMPORARIES], tm_ctx_arena_used(ctx, tm_cpu()));
}

Test(memory, report_categories_add_up) {
    tm_model *m;
    tm_optimizer *opt;
    tm_ctx *ctx = model_ctx(1, &m, &opt);

    /* Parameters and gradients: each parameter padded to 64 bytes, in two equal buffers. */
    size_t params = 0, state = 0;
    for (int i = 0; i < tm_ctx_num_params(ctx); i++) {
        tm_tensor *p = tm_ctx_param(ctx, i);
        params += round64((size_t)tm_tensor_numel(p) * tm_dtype_size(tm_tensor_dtype(p)));
        char name[160];
        snprintf(name, sizeof name, "%s.adamw_m", tm_tensor_name(p));
        tm_tensor *mm = tm_ctx_find(ctx, name);
        snprintf(name, sizeof name, "%s.adamw_v", tm_tensor_name(p));
        tm_tensor *vv = tm_ctx_find(ctx, name);
        cr_assert(mm && vv, "no AdamW state for %s", tm_tensor_name(p));
        state += round64((size_t)tm_tensor_numel(mm) * 4) + round64((size_t)tm_tensor_numel(vv) * 4);
    }
    tm_tensor *steps = tm_ctx_find(ctx, "optim.adamw.steps");
    cr_assert_not_null(steps);
    state += round64((size_t)tm_tensor_numel(steps) * 8);

    tm_memory_report r;
    TT_OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &r));
    cr_assert_eq(r.current[TM_MEM_PARAMETERS], params, "parameters %zu, expected %zu", r.current[TM_MEM_PARAMETERS], params);
    cr_assert_eq(r.current[TM_MEM_GRADIENTS], params, "gradients %zu, expected %zu", r.current[TM_MEM_GRADIENTS], params);
    cr_assert_eq(r.current[TM_MEM_OPTIMIZER], state, "optimizer %zu, expected %zu", r.current[TM_MEM_OPTIMIZER], state);
    cr_assert_gt(r.current[TM_MEM_BUFFERS], 0, "the MoE blocks' counters are buffers");
    cr_assert_eq(r.current[TM_MEM_TEMPORARIES], 0, "after a reset");
    cr_assert_gt(r.peak[TM_MEM_TEMPORARIES], 0, "initialisation staged through the arena");
    assert_consistent(ctx, "after creation");

    /* Temporaries follow the arena through a step; the peak restarts on request. */
    tm_ctx_memory_reset_peak(ctx);
    TT_OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &r));
    cr_assert_eq(r.peak[TM_MEM_TEMPORARIES], 0);
    cr_assert_eq(r.total_peak, r.total);
    int64_t sh[2] = {MB, MT};
    int32_t tok[MB * MT];
    for (int i = 0; i < MB * MT; i++) tok[i] = (int32_t)(i % MV);
    tm_tensor *a = NULL;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, sh, tm_cpu(), TM_I32, tok, &a));
    tm_model_out out;
    TT_OK(ctx, tm_model_forward(m, a, a, &out));
    assert_consistent(ctx, "after forward");
    TT_OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &r));
    size_t fwd = r.current[TM_MEM_TEMPORARIES];
    cr_assert_gt(fwd, 0);
    TT_OK(ctx, tm_backward(ctx, out.loss));
    assert_consistent(ctx, "after backward");
    TT_OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &r));
    cr_assert_gt(r.peak[TM_MEM_TEMPORARIES], fwd);
    cr_assert_eq(r.peak[TM_MEM_TEMPORARIES], tm_ctx_arena_peak(ctx, tm_cpu()), "the arena peaked in this step");
    tm_ctx_arena_reset(ctx);
    assert_consistent(ctx, "after reset");
    TT_OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &r));
    cr_assert_eq(r.current[TM_MEM_TEMPORARIES], 0);
    cr_assert_eq(r.total, params * 2 + state + r.current[TM_MEM_BUFFERS]);

    /* Errors. */
    cr_assert_eq(tm_ctx_memory_report(ctx, tm_cpu(), NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "tm_ctx_memory_report"), "%s", tm_ctx_errmsg(ctx));
    if (tm_cuda_device_count() == 0) {
        cr_assert_eq(tm_ctx_memory_report(ctx, tm_cuda(0), &r), TM_ERR_DEVICE);
        cr_assert(strstr(tm_ctx_errmsg(ctx), "cuda:0"), "%s", tm_ctx_errmsg(ctx));
    }
    cr_assert_eq(tm_ctx_memory_report(NULL, tm_cpu(), &r), TM_ERR_INVALID_ARG);
    tm_ctx_memory_reset_peak(NULL);
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* y = x w, z = y * y, loss = sum(z): x a leaf, w a parameter. Returns the context. */
static tm_ctx *small_graph(int reuse, tm_tensor **x, tm_tensor **w, tm_tensor **y, tm_tensor **z) {
    tm_ctx *ctx = tt_ctx();
    tm__set_mem_reuse(ctx, reuse);
    int64_t sx[2] = {3, 4}, sw[2] = {4, 2};
    TT_OK(ctx, tm_param_new(ctx, "w", TM_F64, 2, sw, tm_cpu(), w));
    TT_OK(ctx, tm_tensor_init_normal(ctx, *w, 3, NULL, 0.0, 1.0));
    *x = tt_randn(ctx, TM_F64, 2, sx, 5);
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, *x, 1));
    tm_tensor *loss = NULL;
    TT_OK(ctx, tm_matmul(ctx, *x, *w, 0, 0, y));
    TT_OK(ctx, tm_mul(ctx, *y, *y, z));
    TT_OK(ctx, tm_sum_all(ctx, *z, &loss));
    TT_OK(ctx, tm_backward(ctx, loss));
    return ctx;
}

Test(memory, only_leaves_keep_their_gradient) {
    tm_tensor *x[2], *w[2], *y[2], *z[2];
    tm_ctx *ctx[2];
    for (int k = 0; k < 2; k++) ctx[k] = small_graph(k, &x[k], &w[k], &y[k], &z[k]);
    /* Without reuse every gradient stays until the reset (the old behaviour)... */
    cr_assert_not_null(tm_tensor_grad(y[0]));
    cr_assert_not_null(tm_tensor_grad(z[0]));
    /* ...with it, those of op outputs are freed and their pointers cleared, as in PyTorch. */
    cr_assert_null(tm_tensor_grad(y[1]));
    cr_assert_null(tm_tensor_grad(z[1]));
    for (int k = 0; k < 2; k++) {
        cr_assert_not_null(tm_tensor_grad(x[k]));
        cr_assert_not_null(tm_tensor_grad(w[k]));
    }
    double *gx0 = tt_read(ctx[0], tm_tensor_grad(x[0])), *gx1 = tt_read(ctx[1], tm_tensor_grad(x[1]));
    double *gw0 = tt_read(ctx[0], tm_tensor_grad(w[0])), *gw1 = tt_read(ctx[1], tm_tensor_grad(w[1]));
    cr_assert(memcmp(gx0, gx1, sizeof(double) * 12) == 0, "leaf gradient differs with reuse");
    cr_assert(memcmp(gw0, gw1, sizeof(double) * 8) == 0, "parameter gradient differs with reuse");
    free(gx0), free(gx1), free(gw0), free(gw1);
    /* The forward outputs themselves stay readable until the reset. */
    double *y1 = tt_read(ctx[1], y[1]);
    free(y1);
    for (int k = 0; k < 2; k++) tm_ctx_free(ctx[k]);
}

Test(memory, freed_blocks_serve_later_requests_split_to_size) {
    tm_ctx *ctx = tt_ctx();
    tm_device cpu = tm_cpu();
    int64_t n1 = 1000, n2 = 10, n3 = 850, n4 = 2000, n5 = 100;
    tm_tensor *t1, *t2, *t3, *t4, *t5, *t6;
    TT_OK(ctx, tm__tensor_new(ctx, TM_F32, 1, &n1, cpu, &t1)); /* 4000 -> a 4032-byte block */
    TT_OK(ctx, tm__tensor_new(ctx, TM_F32, 1, &n2, cpu, &t2)); /* t1 is no longer the last block */
    void *p1 = tm__data(t1);
    size_t used = tm_ctx_arena_used(ctx, cpu);
    cr_assert_eq(used, 4032 + 64);
    tm__tensor_release(ctx, t1);
    cr_assert_eq(tm_ctx_arena_used(ctx, cpu), 64, "a freed block no longer counts as used");
    cr_assert_null(t1->storage->data, "a released storage has no data");
    tm__tensor_release(ctx, t1); /* twice: a no-op */
    cr_assert_eq(tm_ctx_arena_used(ctx, cpu), 64);
    /* 3400 bytes -> 3456 = 54 x 64: the freed 4032-byte block serves it, split; the 576 bytes
     * left serve a 400-byte request (448 = 7 x 64) right after it. */
    TT_OK(ctx, tm__tensor_new(ctx, TM_F32, 1, &n3, cpu, &t3));
    cr_assert_eq(tm__data(t3), p1, "the freed block was not reused");
    cr_assert_eq(tm_ctx_arena_used(ctx, cpu), 64 + 3456, "a reused block counts its own size");
    TT_OK(ctx, tm__tensor_new(ctx, TM_F32, 1, &n5, cpu, &t6));
    cr_assert_eq(tm__data(t6), (char *)p1 + 3456, "the rest of the split block was not reused");
    cr_assert_eq(tm_ctx_arena_used(ctx, cpu), 64 + 3456 + 448);
    /* A block given back serves the next request of its size at the same address. */
    TT_OK(ctx, tm__tensor_new(ctx, TM_F32, 1, &n4, cpu, &t4));
    void *p4 = tm__data(t4);
    tm__tensor_release(ctx, t4);
    TT_OK(ctx, tm__tensor_new(ctx, TM_F32, 1, &n4, cpu, &t5));
    cr_assert_eq(tm__data(t5), p4);
    /* Persistent tensors and views of them are never released. */
    tm_tensor *p = NULL;
    TT_OK(ctx, tm_param_new(ctx, "p", TM_F32, 1, &n2, cpu, &p));
    tm__tensor_release(ctx, p);
    cr_assert_not_null(p->storage->data);
    tm_ctx_arena_reset(ctx);
    cr_assert_eq(tm_ctx_arena_used(ctx, cpu), 0);
    tm_ctx_free(ctx);
}

Test(memory, kernel_scratch_and_staging_go_back_when_the_op_returns) {
    for (int reuse = 0; reuse < 2; reuse++) {
        tm_ctx *ctx = tt_ctx();
        tm__set_mem_reuse(ctx, reuse);
        tm_ctx_set_grad_enabled(ctx, 0);
        int64_t sq[4] = {2, 16, 4, 8}, sa[2] = {24, 40}, sb[2] = {24, 16};
        tm_tensor *q = tt_randn(ctx, TM_F32, 4, sq, 1), *k = tt_randn(ctx, TM_F32, 4, sq, 2),
                  *v = tt_randn(ctx, TM_F32, 4, sq, 3), *a = tt_randn(ctx, TM_F32, 2, sa, 4),
                  *b = tt_randn(ctx, TM_F32, 2, sb, 5);
        /* attention: the forward takes scratch and saves a logsumexp (not needed: grad is off) */
        size_t before = tm_ctx_arena_used(ctx, tm_cpu());
        tm_tensor *o = NULL;
        TT_OK(ctx, tm_attention(ctx, q, k, v, 0.0, &o));
        size_t grew = tm_ctx_arena_used(ctx, tm_cpu()) - before, out = round64(2 * 16 * 4 * 8 * 4);
        if (reuse) cr_assert_eq(grew, out, "attention left %zu bytes, its output is %zu", grew, out);
        else cr_assert_gt(grew, out);
        /* matmul of a transposed view: the dispatcher's contiguous copy of it goes back */
        tm_tensor *at = NULL, *c = NULL;
        TT_OK(ctx, tm_transpose(ctx, a, 0, 1, &at)); /* [40, 24], strided */
        before = tm_ctx_arena_used(ctx, tm_cpu());
        TT_OK(ctx, tm_matmul(ctx, at, b, 0, 0, &c));
        grew = tm_ctx_arena_used(ctx, tm_cpu()) - before, out = round64(40 * 16 * 4);
        if (reuse) cr_assert_eq(grew, out, "matmul left %zu bytes, its output is %zu", grew, out);
        else cr_assert_gt(grew, out);
        double *cv = tt_read(ctx, c);
        free(cv);
        tm_ctx_free(ctx);
    }
}

/* CUDA: a chain of ops with CUDA kernels (matmul, rmsnorm, swiglu, cross_entropy), backward
 * with and without reuse: the same gradients, a lower peak. Blocks freed on the host while
 * queued kernels may still use them are reused by later kernels of the same stream. */
Test(memory, cuda_reuse_is_stream_ordered) {
    if (tm_cuda_device_count() == 0) cr_skip_test("no CUDA device");
    enum { N = 256, H = 64, F = 96, V = 50 };
    float *gw[2];
    size_t peak[2];
    for (int reuse = 0; reuse < 2; reuse++) {
        tm_ctx_options o = tm_ctx_options_default();
        o.num_threads = 2;
        o.cuda_device = 0;
        tm_ctx *ctx = NULL;
        cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK, "%s", tm_last_create_error());
        tm__set_mem_reuse(ctx, reuse);
        tm_device d = tm_cuda(0);
        int64_t sw1[2] = {H, F}, sw2[2] = {H, F}, sw3[2] = {F, V}, sg[1] = {H}, sx[2] = {N, H}, st[1] = {N};
        tm_tensor *w1, *w2, *w3, *g;
        TT_OK(ctx, tm_param_new(ctx, "w1", TM_F32, 2, sw1, d, &w1));
        TT_OK(ctx, tm_param_new(ctx, "w2", TM_F32, 2, sw2, d, &w2));
        TT_OK(ctx, tm_param_new(ctx, "w3", TM_F32, 2, sw3, d, &w3));
        TT_OK(ctx, tm_param_new(ctx, "g", TM_F32, 1, sg, d, &g));
        TT_OK(ctx, tm_tensor_init_normal(ctx, w1, 1, NULL, 0.0, 0.2));
        TT_OK(ctx, tm_tensor_init_normal(ctx, w2, 1, NULL, 0.0, 0.2));
        TT_OK(ctx, tm_tensor_init_normal(ctx, w3, 1, NULL, 0.0, 0.2));
        TT_OK(ctx, tm_tensor_fill(ctx, g, 1.0));
        tm_ctx_arena_reset(ctx);
        for (int step = 0; step < 2; step++) {
            tm_ctx_memory_reset_peak(ctx);
            TT_OK(ctx, tm_ctx_zero_grad(ctx));
            tm_tensor *xh = tt_randn(ctx, TM_F32, 2, sx, 7), *x, *th = tt_randint(ctx, TM_I64, 1, st, 8, V), *t;
            TT_OK(ctx, tm_to_device(ctx, xh, d, &x));
            TT_OK(ctx, tm_to_device(ctx, th, d, &t));
            tm_tensor *h, *a, *b, *s, *logits, *loss;
            TT_OK(ctx, tm_rmsnorm(ctx, x, g, 1e-5, &h));
            TT_OK(ctx, tm_matmul(ctx, h, w1, 0, 0, &a));
            TT_OK(ctx, tm_matmul(ctx, h, w2, 0, 0, &b));
            TT_OK(ctx, tm_swiglu(ctx, a, b, &s));
            TT_OK(ctx, tm_matmul(ctx, s, w3, 0, 0, &logits));
            TT_OK(ctx, tm_cross_entropy(ctx, logits, t, -100, &loss));
            TT_OK(ctx, tm_backward(ctx, loss));
            if (step == 1) {
                tm_memory_report r;
                TT_OK(ctx, tm_ctx_memory_report(ctx, d, &r));
                peak[reuse] = r.peak[TM_MEM_TEMPORARIES];
                cr_assert_eq(r.current[TM_MEM_TEMPORARIES], tm_ctx_arena_used(ctx, d));
                gw[reuse] = malloc(sizeof(float) * H * F);
                TT_OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(w1), TM_F32, gw[reuse], H * F));
            }
            tm_ctx_arena_reset(ctx);
        }
        tm_ctx_free(ctx);
    }
    cr_log_info("CUDA peak temporaries: %zu without reuse, %zu with", peak[0], peak[1]);
    cr_assert_lt(peak[1], peak[0]);
    cr_assert(memcmp(gw[0], gw[1], sizeof(float) * H * F) == 0, "w1's gradient differs with reuse");
    free(gw[0]);
    free(gw[1]);
}
