/* test_param.c — parameter groups and buckets, f32 master weights, and the update ops over
 * bucket ranges: the model's expert weights form their own bucket with contiguous gradients; a
 * bucket-wide update equals the per-parameter updates bit for bit; bf16 master weights keep
 * updates that bf16 alone would lose; bad group and shard descriptions are refused by field. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static tm_model *small_model(tm_ctx *ctx, tm_dtype dt) {
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 17;
    c.d_model = 16;
    c.n_layers = 2;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.max_seq_len = 8;
    c.moe.ffn_size = 8;
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c, dt, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, 3));
    return m;
}

Test(param, model_buckets_by_group) {
    tm_ctx *ctx = tt_ctx();
    tm_model *m = small_model(ctx, TM_F32);
    cr_assert_eq(tm_ctx_num_buckets(ctx), 2, "dense + expert buckets, got %d", tm_ctx_num_buckets(ctx));
    int64_t seen[2] = {0, 0};
    int counted[2] = {0, 0};
    for (int i = 0; i < tm_ctx_num_params(ctx); i++) {
        tm_tensor *p = tm_ctx_param(ctx, i);
        tm_param_info pi;
        TT_OK(ctx, tm_param_get_info(p, &pi));
        int expert = strstr(tm_tensor_name(p), ".experts.") != NULL;
        cr_assert_eq(pi.opts.group, expert ? TM_PARAM_EXPERT : TM_PARAM_DENSE, "%s", tm_tensor_name(p));
        tm_bucket_info bi;
        TT_OK(ctx, tm_ctx_bucket_info(ctx, pi.bucket, &bi));
        cr_assert_eq(bi.group, pi.opts.group);
        if (expert) cr_assert(bi.expert_lo == 0 && bi.expert_hi == 4, "expert range [%d, %d)", bi.expert_lo, bi.expert_hi);
        /* parameters sit in creation order, without overlap */
        cr_assert_geq(pi.bucket_offset, seen[pi.bucket], "%s overlaps its predecessor", tm_tensor_name(p));
        seen[pi.bucket] = pi.bucket_offset + tm_tensor_numel(p);
        counted[pi.bucket]++;
        cr_assert_leq(seen[pi.bucket], bi.numel);
    }
    for (int b = 0; b < 2; b++) {
        tm_bucket_info bi;
        TT_OK(ctx, tm_ctx_bucket_info(ctx, b, &bi));
        cr_assert_eq(bi.num_params, counted[b]);
    }
    /* The gradients of a bucket are one contiguous range: writing the flat gradient view is
     * seen through every parameter's own gradient, at its bucket offset. */
    for (int b = 0; b < 2; b++) {
        tm_tensor *g = tm_ctx_bucket_tensor(ctx, b, TM_BUCKET_GRADS);
        int64_t n = tm_tensor_numel(g);
        double *v = malloc(sizeof(double) * (size_t)n);
        for (int64_t i = 0; i < n; i++) v[i] = (double)(i % 1000) + b;
        TT_OK(ctx, tm_tensor_write(ctx, g, TM_F64, v, n));
        for (int i = 0; i < tm_ctx_num_params(ctx); i++) {
            tm_tensor *p = tm_ctx_param(ctx, i);
            tm_param_info pi;
            TT_OK(ctx, tm_param_get_info(p, &pi));
            if (pi.bucket != b) continue;
            double *gp = tt_read(ctx, tm_tensor_grad(p));
            for (int64_t k = 0; k < tm_tensor_numel(p); k++)
                cr_assert_eq(gp[k], v[pi.bucket_offset + k], "%s grad[%lld]", tm_tensor_name(p), (long long)k);
            free(gp);
        }
        free(v);
    }
    cr_assert_null(tm_ctx_bucket_tensor(ctx, 0, TM_BUCKET_MASTER), "f32 buckets have no master");
    cr_assert_null(tm_ctx_bucket_tensor(ctx, 2, TM_BUCKET_PARAMS));
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(param, bad_options_name_the_field) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[3] = {4, 3, 2};
    tm_tensor *p = NULL;
    tm_param_options o = tm_param_options_default();
    o.group = TM_PARAM_EXPERT;
    o.expert_lo = 2;
    o.expert_hi = 4; /* 2 experts, shape[0] = 4 */
    cr_assert_eq(tm_param_new_ex(ctx, "w", TM_F32, 3, s, tm_cpu(), &o, &p), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "expert_lo") && strstr(tm_ctx_errmsg(ctx), "\"w\""), "%s", tm_ctx_errmsg(ctx));
    o = tm_param_options_default();
    o.shard_axis = 1;
    o.logical_ndim = 3;
    o.logical_shape[0] = 4, o.logical_shape[1] = 6, o.logical_shape[2] = 2;
    o.shard_offset = 4; /* [4, 7) does not fit 6 */
    cr_assert_eq(tm_param_new_ex(ctx, "w", TM_F32, 3, s, tm_cpu(), &o, &p), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "shard"), "%s", tm_ctx_errmsg(ctx));
    o.shard_offset = 3; /* fits: [3, 6) of axis 1 */
    TT_OK(ctx, tm_param_new_ex(ctx, "w", TM_F32, 3, s, tm_cpu(), &o, &p));
    tm_param_info pi;
    TT_OK(ctx, tm_param_get_info(p, &pi));
    cr_assert(pi.opts.shard_axis == 1 && pi.opts.shard_offset == 3 && pi.opts.logical_shape[1] == 6);
    o.group = (tm_param_group)7;
    cr_assert_eq(tm_param_new_ex(ctx, "w2", TM_F32, 3, s, tm_cpu(), &o, &p), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "group"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_null(tm_ctx_find(ctx, "w2"), "a refused parameter was registered");
    tm_buffer_new(ctx, "buf", TM_F32, 1, s, tm_cpu(), &p);
    cr_assert_eq(tm_param_get_info(p, &pi), TM_ERR_INVALID_ARG);
    tm_ctx_free(ctx);
}

/* One adamw_update over a whole bucket gives the same bits as one per parameter. */
Test(param, bucket_update_equals_per_parameter_updates) {
    double got[2][512];
    int64_t n = 0;
    for (int mode = 0; mode < 2; mode++) {
        tm_ctx *ctx = tt_ctx();
        int64_t s1[2] = {7, 9}, s2[1] = {13}, s3[2] = {5, 11};
        tm_tensor *p[3];
        TT_OK(ctx, tm_param_new(ctx, "a", TM_F32, 2, s1, tm_cpu(), &p[0]));
        TT_OK(ctx, tm_param_new(ctx, "b", TM_F32, 1, s2, tm_cpu(), &p[1]));
        TT_OK(ctx, tm_param_new(ctx, "c", TM_F32, 2, s3, tm_cpu(), &p[2]));
        for (int i = 0; i < 3; i++) TT_OK(ctx, tm_tensor_init_normal(ctx, p[i], 5, NULL, 0, 1));
        tm_tensor *G = tm_ctx_bucket_tensor(ctx, 0, TM_BUCKET_GRADS), *P = tm_ctx_bucket_tensor(ctx, 0, TM_BUCKET_PARAMS);
        n = tm_tensor_numel(P);
        cr_assert_leq(n, 512);
        tm_tensor *rg = tt_randn(ctx, TM_F32, 1, &n, 9), *m, *v;
        TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 1, &n, tm_cpu(), &m));
        TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 1, &n, tm_cpu(), &v));
        double *hg = tt_read(ctx, rg);
        /* gradients only where parameters are: backward never writes the padding */
        for (int64_t i = 0; i < n; i++) {
            int inside = 0;
            for (int k = 0; k < 3; k++) {
                tm_param_info pi;
                TT_OK(ctx, tm_param_get_info(p[k], &pi));
                inside |= i >= pi.bucket_offset && i < pi.bucket_offset + tm_tensor_numel(p[k]);
            }
            if (!inside) hg[i] = 0;
        }
        TT_OK(ctx, tm_tensor_write(ctx, G, TM_F64, hg, n));
        free(hg);
        tm_adamw_config cfg = tm_adamw_config_default();
        for (int step = 1; step <= 3; step++) {
            if (mode == 0) {
                TT_OK(ctx, tm_adamw_update(ctx, P, G, m, v, NULL, &cfg, 1e-2, 0.0, step));
            } else {
                for (int i = 0; i < 3; i++) {
                    tm_param_info pi;
                    TT_OK(ctx, tm_param_get_info(p[i], &pi));
                    tm_tensor *ms, *vs;
                    TT_OK(ctx, tm_slice(ctx, m, 0, pi.bucket_offset, pi.bucket_offset + tm_tensor_numel(p[i]), &ms));
                    TT_OK(ctx, tm_slice(ctx, v, 0, pi.bucket_offset, pi.bucket_offset + tm_tensor_numel(p[i]), &vs));
                    TT_OK(ctx, tm_adamw_update(ctx, p[i], tm_tensor_grad(p[i]), ms, vs, NULL, &cfg, 1e-2, 0.0, step));
                }
            }
        }
        TT_OK(ctx, tm_tensor_read(ctx, P, TM_F64, got[mode], n));
        tm_ctx_free(ctx);
    }
    /* padding stays zero either way (zero gradient, zero parameter, no decay) */
    for (int64_t i = 0; i < n; i++) cr_assert_eq(got[0][i], got[1][i], "element %lld", (long long)i);
}

/* bf16 with f32 master weights: 400 steps each too small to move a bf16 value of 1.0 (half an
 * ulp is 2^-8; each SGD step moves 1e-3) add up on the master, and the parameter follows. */
Test(param, bf16_master_keeps_small_updates) {
    tm_ctx *ctx = tt_ctx();
    int64_t s = 8;
    tm_tensor *p;
    TT_OK(ctx, tm_param_new(ctx, "p", TM_BF16, 1, &s, tm_cpu(), &p));
    TT_OK(ctx, tm_tensor_fill(ctx, p, 1.0));
    tm_sgd_config cfg = tm_sgd_config_default();
    cfg.momentum = 0;
    cfg.lr = 1e-3;
    tm_optimizer *opt;
    TT_OK(ctx, tm_sgd_new(ctx, &cfg, &opt));
    tm_bucket_info bi;
    TT_OK(ctx, tm_ctx_bucket_info(ctx, 0, &bi));
    cr_assert(bi.has_master, "a bf16 bucket under an optimizer has a master");
    tm_tensor *master = tm_ctx_find(ctx, "p.master");
    cr_assert_not_null(master);
    double ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    for (int t = 0; t < 400; t++) {
        TT_OK(ctx, tm_tensor_write(ctx, tm_tensor_grad(p), TM_F64, ones, 8));
        TT_OK(ctx, tm_optimizer_step(opt, -1));
        tm_ctx_arena_reset(ctx);
    }
    double *mv = tt_read(ctx, master), *pv = tt_read(ctx, p);
    /* master: 1 - 400e-3 in f32 steps; the bf16 parameter is that rounded (0.6 -> 0.6015625) */
    cr_assert(fabs(mv[0] - 0.6) < 1e-4, "master %g", mv[0]);
    cr_assert(fabs(pv[0] - 0.6) < 4e-3 && pv[0] != 1.0, "parameter %g did not follow its master", pv[0]);
    /* writing the parameter rewrites its master */
    TT_OK(ctx, tm_tensor_fill(ctx, p, 2.0));
    double two[8] = {2, 2, 2, 2, 2, 2, 2, 2};
    TT_OK(ctx, tm_tensor_write(ctx, p, TM_F64, two, 8));
    double *m2 = tt_read(ctx, master);
    cr_assert_eq(m2[0], 2.0);
    free(mv), free(pv), free(m2);
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

/* The named tensors are what a checkpoint holds: parameters, buffers, and the optimizer's state
 * and master weights once it exists, each reachable by index and by name. */
Test(param, named_tensors_cover_parameters_buffers_and_state) {
    tm_ctx *ctx = tt_ctx();
    int64_t s4 = 4, s23[2] = {2, 3};
    tm_tensor *w, *b, *buf;
    TT_OK(ctx, tm_param_new(ctx, "w", TM_BF16, 2, s23, tm_cpu(), &w));
    TT_OK(ctx, tm_param_new(ctx, "b", TM_F32, 1, &s4, tm_cpu(), &b));
    TT_OK(ctx, tm_buffer_new(ctx, "buf", TM_I64, 1, &s4, tm_cpu(), &buf));
    cr_assert_eq(tm_ctx_num_named(ctx), 3);
    cr_assert_eq(tm_ctx_named(ctx, 0), w);
    cr_assert_eq(tm_ctx_named(ctx, 1), b);
    cr_assert_eq(tm_ctx_named(ctx, 2), buf);
    cr_assert_null(tm_ctx_named(ctx, 3));
    cr_assert_null(tm_ctx_named(ctx, -1));
    cr_assert_null(tm_ctx_named(NULL, 0));
    cr_assert_eq(tm_ctx_num_named(NULL), 0);

    tm_optimizer *opt;
    TT_OK(ctx, tm_adamw_new(ctx, NULL, &opt));
    int n = tm_ctx_num_named(ctx), masters = 0;
    cr_assert_gt(n, 3, "AdamW's moments are named");
    for (int i = 0; i < n; i++) {
        tm_tensor *t = tm_ctx_named(ctx, i);
        cr_assert_eq(tm_ctx_find(ctx, tm_tensor_name(t)), t, "%s", tm_tensor_name(t));
        masters += strcmp(tm_tensor_name(t), "w.master") == 0;
    }
    cr_assert_eq(masters, 1, "the bf16 parameter's f32 master is named w.master");
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

/* ---- deferred placement and contexts without gradient buffers ------------------------------ */

#include "ctx_internal.h"

/* Parameters of two buckets (dense f32, expert f32) big enough to outgrow the first 1 MiB a
 * bucket starts with, made with or without a deferral around them, initialised by name. */
static void make_params(tm_ctx *ctx, int defer) {
    if (defer) TT_OK(ctx, tm_ctx_defer_params(ctx));
    for (int i = 0; i < 6; i++) {
        char name[32];
        snprintf(name, sizeof name, "w%d", i);
        int64_t shape[2] = {300 + i, 257};
        tm_tensor *t;
        TT_OK(ctx, tm_param_new(ctx, name, TM_F32, 2, shape, tm_cpu(), &t));
        tm_param_options o = tm_param_options_default();
        o.group = TM_PARAM_EXPERT;
        int64_t es[3] = {2, 100 + i, 129};
        snprintf(name, sizeof name, "e%d", i);
        TT_OK(ctx, tm_param_new_ex(ctx, name, TM_F32, 3, es, tm_cpu(), &o, &t));
        if (defer) {
            /* no memory yet: every use is refused, naming the parameter and the remedy */
            int64_t n = tm_tensor_numel(t);
            double *v = calloc((size_t)n, sizeof *v);
            cr_assert_eq(tm_tensor_write(ctx, t, TM_F64, v, n), TM_ERR_STATE);
            cr_assert(strstr(tm_ctx_errmsg(ctx), "tm_ctx_materialize_params") && strstr(tm_ctx_errmsg(ctx), name),
                      "%s", tm_ctx_errmsg(ctx));
            cr_assert_eq(tm_tensor_read(ctx, t, TM_F64, v, n), TM_ERR_STATE);
            cr_assert_eq(tm_tensor_fill(ctx, t, 1.0), TM_ERR_STATE);
            tm_tensor *y = NULL;
            cr_assert_eq(tm_scale(ctx, t, 2.0, &y), TM_ERR_STATE, "an op given it");
            cr_assert(strstr(tm_ctx_errmsg(ctx), "tm_ctx_materialize_params"), "%s", tm_ctx_errmsg(ctx));
            free(v);
        }
    }
    if (defer) {
        cr_assert(tm_ctx_params_deferred(ctx));
        TT_OK(ctx, tm_ctx_materialize_params(ctx));
        cr_assert(!tm_ctx_params_deferred(ctx));
        cr_assert_eq(tm_ctx_materialize_params(ctx), TM_ERR_STATE, "no deferral in force");
    }
    for (int i = 0; i < tm_ctx_num_params(ctx); i++) {
        tm_tensor *p = tm_ctx_param(ctx, i);
        TT_OK(ctx, tm_tensor_init_normal(ctx, p, 7, tm_tensor_name(p), 0.0, 1.0));
    }
}

Test(param, deferred_placement_allocates_exactly_and_keeps_values) {
    tm_ctx *a = tt_ctx(), *b = tt_ctx();
    make_params(a, 0);
    make_params(b, 1);
    cr_assert_eq(tm_ctx_num_buckets(a), tm_ctx_num_buckets(b));
    for (int i = 0; i < tm_ctx_num_buckets(b); i++) {
        tm__bucket *ba = a->buckets[i], *bb = b->buckets[i];
        cr_assert_eq(ba->params.used, bb->params.used, "bucket %d: the same layout", i);
        /* grown by doubling: capacity a power of two MiB above the use; deferred: exactly the use */
        cr_assert_gt(ba->params.st.nbytes, ba->params.used, "bucket %d grew past its use by doubling", i);
        cr_assert_eq(bb->params.st.nbytes, bb->params.used, "bucket %d: one allocation of its exact size", i);
        cr_assert_eq(bb->grads.st.nbytes, bb->grads.used, "bucket %d: gradients likewise", i);
    }
    for (int i = 0; i < tm_ctx_num_params(a); i++) {
        tm_tensor *pa = tm_ctx_param(a, i), *pb = tm_ctx_param(b, i);
        tm_param_info ia, ib;
        TT_OK(a, tm_param_get_info(pa, &ia));
        TT_OK(b, tm_param_get_info(pb, &ib));
        cr_assert_eq(ia.bucket_offset, ib.bucket_offset, "%s", tm_tensor_name(pa));
        double *va = tt_read(a, pa), *vb = tt_read(b, pb);
        cr_assert_eq(memcmp(va, vb, sizeof(double) * (size_t)tm_tensor_numel(pa)), 0, "%s", tm_tensor_name(pa));
        free(va);
        free(vb);
    }
    cr_assert_eq(tm_ctx_defer_params(b), TM_OK);
    cr_assert_eq(tm_ctx_defer_params(b), TM_ERR_STATE, "twice");
    TT_OK(b, tm_ctx_materialize_params(b)); /* nothing was made: nothing changes */
    tm_ctx_free(a);
    tm_ctx_free(b);
}

Test(param, model_new_buckets_are_exact) {
    tm_ctx *ctx = tt_ctx();
    tm_model *m = small_model(ctx, TM_BF16);
    for (int i = 0; i < tm_ctx_num_buckets(ctx); i++)
        cr_assert_eq(ctx->buckets[i]->params.st.nbytes, ctx->buckets[i]->params.used, "bucket %d", i);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* A forwards-only context computes what a training one does, holds no gradient memory, and
 * refuses backward and optimizers by the option's name. */
Test(param, no_grad_buffers_forward_only) {
    tm_ctx *ctx[2];
    tm_model *m[2];
    double loss[2];
    tm_memory_report rep[2];
    for (int k = 0; k < 2; k++) {
        tm_ctx_options o = tm_ctx_options_default();
        o.num_threads = 2;
        o.no_grad_buffers = k;
        TT_OK(NULL, tm_ctx_new(&ctx[k], &o));
        m[k] = small_model(ctx[k], TM_F32);
        int64_t shape[2] = {2, 8};
        tm_tensor *tok = tt_randint(ctx[k], TM_I32, 2, shape, 5, 17), *tgt = tt_randint(ctx[k], TM_I32, 2, shape, 6, 17);
        tm_model_out out;
        TT_OK(ctx[k], tm_model_forward(m[k], tok, tgt, &out));
        loss[k] = out.loss_value;
        TT_OK(ctx[k], tm_ctx_memory_report(ctx[k], tm_cpu(), &rep[k]));
        if (k == 1) {
            cr_assert_eq(tm_backward(ctx[k], out.loss), TM_ERR_STATE);
            cr_assert(strstr(tm_ctx_errmsg(ctx[k]), "no_grad_buffers"), "%s", tm_ctx_errmsg(ctx[k]));
            tm_adamw_config ac = tm_adamw_config_default();
            tm_optimizer *opt = NULL;
            cr_assert_eq(tm_adamw_new(ctx[k], &ac, &opt), TM_ERR_STATE);
            cr_assert(strstr(tm_ctx_errmsg(ctx[k]), "no_grad_buffers"), "%s", tm_ctx_errmsg(ctx[k]));
            cr_assert_null(tm_tensor_grad(tm_ctx_param(ctx[k], 0)));
            cr_assert_null(tm_ctx_bucket_tensor(ctx[k], 0, TM_BUCKET_GRADS));
            TT_OK(ctx[k], tm_ctx_zero_grad(ctx[k]));
        } else {
            TT_OK(ctx[k], tm_backward(ctx[k], out.loss));
        }
    }
    cr_assert_eq(loss[0], loss[1], "same loss bits: %.17g vs %.17g", loss[0], loss[1]);
    cr_assert_gt(rep[0].current[TM_MEM_GRADIENTS], 0);
    cr_assert_eq(rep[1].current[TM_MEM_GRADIENTS], 0);
    cr_assert_eq(rep[0].current[TM_MEM_PARAMETERS], rep[1].current[TM_MEM_PARAMETERS]);
    tm_ctx_options bad = tm_ctx_options_default();
    bad.no_grad_buffers = 2;
    tm_ctx *none = NULL;
    cr_assert_eq(tm_ctx_new(&none, &bad), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_last_create_error(), "no_grad_buffers"));
    for (int k = 0; k < 2; k++) {
        tm_model_free(m[k]);
        tm_ctx_free(ctx[k]);
    }
}
