/* test_plan.c — plan-only contexts (tinymoe.h, tm_ctx_options.plan_only; framework/plan.c):
 * the layout a model and its optimizer get there is the one a computing context gives them
 * (bytes of every memory category, buckets, ZeRO ranges), nothing of the model's size is
 * allocated, and everything that would need values is refused. The ranks of a world are
 * checked against real ranks in tests/test_dist.c (dist/library_plan_*, the helper's "plan"). */
#include <stdio.h>
#include <string.h>

#include "common.h"

static tm_model_config small(int tie) {
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 61;
    c.d_model = 32;
    c.n_layers = 3;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.max_seq_len = 16;
    c.first_k_dense = 1;
    c.dense_ffn_size = 40;
    c.tie_embeddings = tie;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    c.moe.ffn_size = 24;
    c.moe.shared_ffn_size = 8;
    return c;
}

/* A plan-only context (tm_ctx_options.plan_only), one thread. */
static tm_ctx *plan_ctx(void) {
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    o.plan_only = 1;
    tm_ctx *ctx = NULL;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK);
    return ctx;
}

/* A context (plan-only or computing) with a world of one rank, the model and the optimizer. */
static tm_ctx *build(int plan, const tm_model_config *c, tm_dtype dt, int sgd, tm_model **m, tm_optimizer **opt) {
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    o.plan_only = plan;
    tm_ctx *ctx = NULL;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK, "%s", tm_last_create_error());
    TT_OK(ctx, tm_model_new(ctx, c, dt, tm_cpu(), m));
    if (!plan) TT_OK(ctx, tm_model_init(*m, 7));
    tm_sgd_config sc = tm_sgd_config_default();
    sc.momentum = 0.5;
    TT_OK(ctx, sgd ? tm_sgd_new(ctx, &sc, opt) : tm_adamw_new(ctx, NULL, opt));
    return ctx;
}

Test(plan, one_rank_plan_equals_the_computing_context) {
    const tm_dtype dts[3] = {TM_F32, TM_BF16, TM_F64};
    for (int k = 0; k < 12; k++) {
        tm_dtype dt = dts[k % 3];
        int sgd = (k / 3) % 2, tie = k / 6;
        tm_model_config c = small(tie);
        tm_model *pm, *rm;
        tm_optimizer *po, *ro;
        tm_ctx *p = build(1, &c, dt, sgd, &pm, &po), *r = build(0, &c, dt, sgd, &rm, &ro);
        tm_memory_report a, b;
        TT_OK(p, tm_ctx_memory_report(p, tm_cpu(), &a));
        TT_OK(r, tm_ctx_memory_report(r, tm_cpu(), &b));
        for (int cat = 0; cat < TM_MEM_TEMPORARIES; cat++)
            cr_assert_eq(a.current[cat], b.current[cat], "%s sgd %d tie %d: category %d planned %zu, made %zu",
                         tm_dtype_name(dt), sgd, tie, cat, a.current[cat], b.current[cat]);
        cr_assert_gt(a.current[TM_MEM_PARAMETERS], 0);
        cr_assert_eq(tm_model_num_params(pm, NULL), tm_model_num_params(rm, NULL));
        cr_assert_eq(tm_ctx_num_buckets(p), tm_ctx_num_buckets(r));
        for (int i = 0; i < tm_ctx_num_buckets(p); i++) {
            tm_bucket_info x, y;
            TT_OK(p, tm_ctx_bucket_info(p, i, &x));
            TT_OK(r, tm_ctx_bucket_info(r, i, &y));
            cr_assert(x.numel == y.numel && x.dtype == y.dtype && x.group == y.group && x.num_params == y.num_params &&
                          x.has_master == y.has_master,
                      "bucket %d differs", i);
        }
        tm_step_plan sp;
        TT_OK(p, tm_model_plan_step(pm, 32, 2, &sp));
        cr_assert(sp.grad_sync == 0 && sp.param_gather == 0 && sp.bwd_reduce == 0 && sp.dispatch == 0 && sp.transient == 0,
                  "one rank, ZeRO-0: nothing moves, nothing transient");
        tm_optimizer_free(po), tm_optimizer_free(ro);
        tm_model_free(pm), tm_model_free(rm);
        tm_ctx_free(p), tm_ctx_free(r);
    }
}

/* A model of 2^40 parameter bytes and more is planned in no time and no memory: its bytes are
 * in the report, not in the process. */
Test(plan, a_model_larger_than_the_machine_is_planned) {
    tm_ctx *ctx = plan_ctx();
    tm_comm_options co = tm_comm_options_default();
    co.plan_world_size = 64;
    co.plan_rank = 63;
    co.ep_size = 8;
    co.zero = 3;
    TT_OK(ctx, tm_comm_init(ctx, &co));
    cr_assert_eq(tm_comm_size(ctx, TM_COMM_WORLD), 64);
    cr_assert_eq(tm_comm_rank(ctx, TM_COMM_EP), 63 % 8);
    cr_assert_eq(tm_comm_rank(ctx, TM_COMM_EXPERT_DP), 63 / 8);
    cr_assert_str_eq(tm_comm_engine(ctx, tm_cpu()), "plan");
    tm_model_config c = small(0);
    c.d_model = 8192, c.n_heads = 64, c.n_kv_heads = 8, c.n_layers = 60, c.first_k_dense = 0;
    c.vocab_size = 128000, c.moe.router.num_experts = 256, c.moe.router.topk = 8, c.moe.ffn_size = 2048;
    c.max_seq_len = 4096;
    tm_model *m;
    tm_optimizer *opt;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_BF16, tm_cpu(), &m));
    TT_OK(ctx, tm_adamw_new(ctx, NULL, &opt));
    int64_t n = tm_model_num_params(m, NULL);
    cr_assert_gt(n, (int64_t)1 << 39, "%lld parameters", (long long)n);
    tm_memory_report mr;
    TT_OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &mr));
    /* ZeRO-3 over 64 ranks, experts over 8: this rank holds about 1/64 of the weights, in bf16,
     * with 12 bytes of f32 master and moments per element it holds */
    double mine = (double)mr.current[TM_MEM_PARAMETERS] / 2;
    cr_assert(mine > (double)n / 64 * 0.9 && mine < (double)n / 64 * 1.1, "%.0f of %lld parameters", mine, (long long)n);
    double opt_el = (double)mr.current[TM_MEM_OPTIMIZER] / 12;
    cr_assert(opt_el > mine * 0.99 && opt_el < mine * 1.01, "optimizer %zu bytes, parameters %zu",
              mr.current[TM_MEM_OPTIMIZER], mr.current[TM_MEM_PARAMETERS]);
    tm_step_plan sp;
    TT_OK(ctx, tm_model_plan_step(m, 4096, 1, &sp));
    cr_assert_gt(sp.param_gather, 0);
    cr_assert_gt(sp.dispatch, 0);
    cr_assert_gt(sp.transient, 0);
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(plan, what_needs_values_is_refused) {
    tm_ctx_options o = tm_ctx_options_default();
    o.plan_only = 1;
    tm_ctx *ctx = NULL;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK);
    int64_t sh[1] = {4};
    tm_tensor *a, *b;
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 1, sh, tm_cpu(), &a)); /* placed, not filled */
    cr_assert_eq(tm_add(ctx, a, a, &b), TM_ERR_STATE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "plan-only") && strstr(tm_ctx_errmsg(ctx), "add"), "%s", tm_ctx_errmsg(ctx));
    float v[4] = {1, 2, 3, 4};
    cr_assert_eq(tm_tensor_read(ctx, a, TM_F32, v, 4), TM_ERR_STATE);
    cr_assert_eq(tm_tensor_write(ctx, a, TM_F32, v, 4), TM_ERR_STATE);
    cr_assert(v[0] == 1 && v[3] == 4);
    tm_comm_options co = tm_comm_options_default();
    co.plan_world_size = 4;
    co.plan_rank = 4;
    cr_assert_eq(tm_comm_init(ctx, &co), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "plan_rank = 4"), "%s", tm_ctx_errmsg(ctx));
    co.plan_rank = 1, co.ep_size = 3;
    cr_assert_eq(tm_comm_init(ctx, &co), TM_ERR_INVALID_ARG);
    tm_ctx_free(ctx);

    /* a computing context lays out only its own world, and does not plan */
    o.plan_only = 0;
    o.num_threads = 1;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK);
    co = tm_comm_options_default();
    co.plan_world_size = 2;
    cr_assert_eq(tm_comm_init(ctx, &co), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "plan-only"), "%s", tm_ctx_errmsg(ctx));
    tm_model_config c = small(0);
    tm_model *m;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    tm_step_plan sp;
    cr_assert_eq(tm_model_plan_step(m, 8, 1, &sp), TM_ERR_STATE);
    tm_model_free(m);
    tm_ctx_free(ctx);

    o.plan_only = 1;
    o.cuda_device = 0;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_last_create_error(), "plan_only"), "%s", tm_last_create_error());
}

/* ZeRO-3 with zero3_keep_last (tinymoe.h): the units of the last layers, the final norm and
 * the head are gathered once per micro-batch instead of twice, and held together through the
 * loss. Laid out for rank 0 of 2 (a world of one gathers nothing: its units are used in place),
 * each gather of a unit sends this rank's ZeRO block (the bucket split in 2, rounded up to 64
 * elements) and holds both blocks, so the plan's all-gather bytes fall by the kept units' blocks
 * (the buckets of the kept parameters, from their names: "layers.<l>." of the last `keep`
 * layers, norm.weight, the head: lm_head.weight or the tied embedding's second use) per
 * micro-batch, and its transient bytes are the most of the kept units' and of the largest set
 * held without keeping. */
static int64_t kept_bytes(tm_ctx *ctx, const tm_model_config *c, int keep, int64_t *held) {
    int64_t b = 0;
    unsigned char seen[256] = {0};
    *held = 0;
    for (int i = 0; i < tm_ctx_num_params(ctx); i++) {
        tm_tensor *p = tm_ctx_param(ctx, i);
        const char *name = tm_tensor_name(p);
        int l, k = 0;
        if (sscanf(name, "layers.%d.", &l) == 1) k = keep > 0 && l >= c->n_layers - keep;
        else if (!strcmp(name, "norm.weight") || !strcmp(name, "lm_head.weight")) k = keep > 0;
        else if (!strcmp(name, "embed.weight")) k = keep > 0 && c->tie_embeddings;
        tm_param_info pi;
        tm_bucket_info bi;
        TT_OK(ctx, tm_param_get_info(p, &pi));
        TT_OK(ctx, tm_ctx_bucket_info(ctx, pi.bucket, &bi));
        cr_assert(pi.bucket < 256 && bi.unit >= 0, "bucket %d of unit %d", pi.bucket, bi.unit);
        if (!k || seen[pi.bucket]) continue;
        seen[pi.bucket] = 1;
        int64_t blk = ((bi.numel + 1) / 2 + 63) / 64 * 64 * (int64_t)tm_dtype_size(bi.dtype);
        b += blk;
        *held += 2 * blk;
    }
    return b;
}

Test(plan, zero3_keep_last_gathers_the_kept_weights_once_and_holds_them) {
    const int keeps[] = {0, 1, 2, 3, 7};
    for (int tie = 0; tie < 2; tie++) {
        tm_model_config c = small(tie);
        int64_t pg0 = 0, tr0 = 0, br0 = 0;
        for (size_t k = 0; k < sizeof keeps / sizeof *keeps; k++) {
            tm_ctx *ctx = plan_ctx();
            tm_comm_options co = tm_comm_options_default();
            cr_assert_eq(co.zero3_keep_last, 1, "the default keeps the last layer");
            co.zero = 3;
            co.zero3_keep_last = -1;
            cr_assert_eq(tm_comm_init(ctx, &co), TM_ERR_INVALID_ARG);
            cr_assert(strstr(tm_ctx_errmsg(ctx), "zero3_keep_last = -1"), "%s", tm_ctx_errmsg(ctx));
            co.zero3_keep_last = keeps[k];
            co.plan_world_size = 2;
            TT_OK(ctx, tm_comm_init(ctx, &co));
            tm_model *m;
            tm_optimizer *opt;
            TT_OK(ctx, tm_model_new(ctx, &c, TM_BF16, tm_cpu(), &m));
            TT_OK(ctx, tm_adamw_new(ctx, NULL, &opt));
            tm_step_plan sp;
            TT_OK(ctx, tm_model_plan_step(m, 32, 3, &sp));
            int64_t kh, kb = kept_bytes(ctx, &c, keeps[k], &kh);
            if (keeps[k] == 0) {
                pg0 = sp.param_gather, tr0 = sp.transient, br0 = sp.bwd_reduce;
                cr_assert(pg0 > 0 && tr0 > 0 && kb == 0);
            } else {
                cr_assert_gt(kb, 0);
                cr_assert_eq(sp.param_gather, pg0 - 3 * kb, "tie %d keep %d: all-gathers %lld, %lld without keeping, "
                             "%lld bytes kept x 3 micro-batches", tie, keeps[k], (long long)sp.param_gather,
                             (long long)pg0, (long long)kb);
                cr_assert_eq(sp.transient, kh > tr0 ? kh : tr0, "tie %d keep %d: transient %lld, %lld without keeping, "
                             "%lld kept", tie, keeps[k], (long long)sp.transient, (long long)tr0, (long long)kh);
                cr_assert_eq(sp.bwd_reduce, br0, "every gathered weight's gradient is reduced once, kept or not");
            }
            tm_optimizer_free(opt);
            tm_model_free(m);
            tm_ctx_free(ctx);
        }
    }
}
