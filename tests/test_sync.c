/* test_sync.c — host round trips (tm_ctx_sync_count) on the CPU, where CI runs: the counting
 * rules (a tm_tensor_read, tm_ctx_sync, a data-dependent output size, an error flag that the
 * CUDA kernel reads back: cross_entropy's bad target, the indexing ops' bad index), and the
 * bounds the MoE block and the model are designed to: one MoE layer's forward + backward makes
 * at most one synchronisation (the permute's row count), a model's forward + backward at most
 * n_moe_layers + 1 (one per MoE layer, plus the single read of the step's statistics at the end
 * of tm_model_forward). */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"

static uint64_t syncs(tm_ctx *ctx) { return tm_ctx_sync_count(ctx); }

/* ---- counting rules -------------------------------------------------------------------- */

Test(sync, tensor_read_of_a_cpu_tensor_counts_one) {
    tm_ctx *ctx = tt_ctx();
    cr_assert_eq(syncs(ctx), 0);
    int64_t s[2] = {3, 4}, none[1] = {0};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, s, 1), *empty, *tr;
    uint64_t before = syncs(ctx);
    float buf[12];
    TT_OK(ctx, tm_tensor_read(ctx, x, TM_F32, buf, 12));
    cr_assert_eq(syncs(ctx) - before, 1);
    /* A strided view is one read too. */
    TT_OK(ctx, tm_transpose(ctx, x, 0, 1, &tr));
    TT_OK(ctx, tm_tensor_read(ctx, tr, TM_F32, buf, 12));
    cr_assert_eq(syncs(ctx) - before, 2);
    /* Nothing to read: nothing to wait for. */
    TT_OK(ctx, tm_tensor_empty(ctx, TM_F32, 1, none, tm_cpu(), &empty));
    TT_OK(ctx, tm_tensor_read(ctx, empty, TM_F32, buf, 0));
    cr_assert_eq(syncs(ctx) - before, 2);
    /* A failed read (wrong count) counts nothing. */
    cr_assert_eq(tm_tensor_read(ctx, x, TM_F32, buf, 11), TM_ERR_INVALID_ARG);
    cr_assert_eq(syncs(ctx) - before, 2);
    /* Ops and writes do not wait for the device. */
    tm_tensor *y;
    TT_OK(ctx, tm_matmul(ctx, x, tr, 0, 0, &y));
    TT_OK(ctx, tm_tensor_write(ctx, x, TM_F32, buf, 12));
    cr_assert_eq(syncs(ctx) - before, 2);
    TT_OK(ctx, tm_ctx_sync(ctx));
    cr_assert_eq(syncs(ctx) - before, 3);
    tm_ctx_free(ctx);
}

Test(sync, data_dependent_sizes_and_error_flags_count_one) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {4, 3}, ms[2] = {4, 2};
    const double map[8] = {1, 0, 1, 1, 0, 1, 0, 0}, probs[8] = {.5, 0, .4, .6, 0, 1, 0, 0};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 2);
    uint64_t before = syncs(ctx);
    tm_moe_dispatch d;
    TT_OK(ctx, tm_moe_permute(ctx, x, tt_from(ctx, TM_U8, 2, ms, map), tt_from(ctx, TM_F32, 2, ms, probs), 1, 0, &d));
    cr_assert_eq(d.num_rows, 4);
    cr_assert_eq(syncs(ctx) - before, 1, "permute: the row count R");

    /* cross_entropy's CUDA forward reads its bad-target flag back: one, also on the CPU. */
    int64_t ls[2] = {4, 5}, ts[1] = {4}, zero[1] = {0}, zs[2] = {0, 5};
    const double tg[4] = {0, 4, -1, 2};
    tm_tensor *loss;
    before = syncs(ctx);
    TT_OK(ctx, tm_cross_entropy(ctx, tt_randn(ctx, TM_F32, 2, ls, 3), tt_from(ctx, TM_I64, 1, ts, tg), -1, &loss));
    cr_assert_eq(syncs(ctx) - before, 1, "cross_entropy: the bad-target flag");
    tm_tensor *no_rows, *no_targets;
    TT_OK(ctx, tm_tensor_empty(ctx, TM_F32, 2, zs, tm_cpu(), &no_rows));
    TT_OK(ctx, tm_tensor_empty(ctx, TM_I64, 1, zero, tm_cpu(), &no_targets));
    TT_OK(ctx, tm_cross_entropy(ctx, no_rows, no_targets, -1, &loss));
    cr_assert_eq(syncs(ctx) - before, 1, "cross_entropy without rows reads nothing back");
    tm_ctx_free(ctx);
}

/* The CUDA forwards of embedding, index_select, gather and scatter_add read their bad-index
 * flag back: one each, also on the CPU, when there are indices; tm__embedding_checked (ids
 * validated already, as tm_model_forward's are) and tm_index_check read nothing. */
Test(sync, index_flags_count_one) {
    tm_ctx *ctx = tt_ctx();
    int64_t ws[2] = {6, 4}, n = 5, ks[2] = {6, 2}, zero[1] = {0};
    const double ids[5] = {5, 0, 2, 2, 1}, cols[12] = {0, 3, 1, 1, 2, 0, 3, 3, 0, 1, 2, 2}, rows[6] = {1, 1, 0, 5, 2, 1};
    tm_tensor *w = tt_randn(ctx, TM_F32, 2, ws, 4), *idx = tt_from(ctx, TM_I64, 1, &n, ids), *o, *safe, *fb;
    tm_tensor *none = tt_from(ctx, TM_I32, 1, zero, ids);
    uint64_t before = syncs(ctx);
    TT_OK(ctx, tm_embedding(ctx, w, idx, &o));
    cr_assert_eq(syncs(ctx) - before, 1, "embedding: the bad-index flag");
    TT_OK(ctx, tm_index_select(ctx, w, idx, &o));
    TT_OK(ctx, tm_gather(ctx, w, tt_from(ctx, TM_I32, 2, ks, cols), &o));
    TT_OK(ctx, tm_scatter_add(ctx, o, tt_from(ctx, TM_I32, 1, ks, rows), 6, &o));
    cr_assert_eq(syncs(ctx) - before, 4, "index_select, gather, scatter_add: one flag each");
    TT_OK(ctx, tm__embedding_checked(ctx, w, idx, &o));
    TT_OK(ctx, tm_embedding(ctx, w, none, &o));
    TT_OK(ctx, tm_index_check(ctx, idx, 6, 0, &safe, &fb));
    cr_assert_eq(syncs(ctx) - before, 4, "checked embedding, no ids, index_check: nothing read back");
    tm_ctx_free(ctx);
}

/* ---- one MoE layer ----------------------------------------------------------------------- */

static void moe_layer_bound(double capacity_factor, int with_seq_aux) {
    tm_ctx *ctx = tt_ctx();
    tm_moe_config c = tm_moe_config_default();
    c.hidden_size = 16;
    c.ffn_size = 12;
    c.router.num_experts = 6;
    c.router.topk = 2;
    c.aux_loss_coeff = 1e-2;
    c.z_loss_coeff = 1e-3;
    c.seq_aux_loss_coeff = with_seq_aux ? 1e-3 : 0;
    c.capacity_factor = capacity_factor;
    c.use_expert_bias = 1;
    c.strategy = TM_MOE_GROUPED;
    tm_moe *m = NULL;
    TT_OK(ctx, tm_moe_new(ctx, "blk", &c, TM_F32, tm_cpu(), &m));
    TT_OK(ctx, tm_moe_init(m, 5, 0.3, 0.2));
    int64_t xs[3] = {2, 20, 16};
    for (int step = 0; step < 2; step++) {
        tm_tensor *x = tt_randn(ctx, TM_F32, 3, xs, 40 + step), *y, *l;
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
        uint64_t before = syncs(ctx);
        tm_moe_stats st;
        TT_OK(ctx, tm_moe_forward(m, x, 2, &y, &st));
        TT_OK(ctx, tm_sum_all(ctx, y, &l));
        TT_OK(ctx, tm_add(ctx, l, st.aux_loss, &l));
        TT_OK(ctx, tm_add(ctx, l, st.z_loss, &l));
        if (with_seq_aux) TT_OK(ctx, tm_add(ctx, l, st.seq_aux_loss, &l));
        TT_OK(ctx, tm_backward(ctx, l));
        uint64_t n = syncs(ctx) - before;
        cr_assert_leq(n, 1, "MoE forward + backward (capacity_factor %g, seq aux %d): %llu synchronisations, at "
                      "most 1 (the permute's row count)", capacity_factor, with_seq_aux, (unsigned long long)n);
        TT_OK(ctx, tm_moe_step(m));
        TT_OK(ctx, tm_ctx_zero_grad(ctx));
        tm_ctx_arena_reset(ctx);
    }
    tm_moe_free(m);
    tm_ctx_free(ctx);
}

Test(sync, moe_layer_forward_backward_dropless) { moe_layer_bound(0, 0); }
Test(sync, moe_layer_forward_backward_capacity) { moe_layer_bound(0.75, 0); }
Test(sync, moe_layer_forward_backward_capacity_seq_aux) { moe_layer_bound(1.0, 1); }

/* ---- the model --------------------------------------------------------------------------- */

static void model_bound(int first_k_dense, double capacity_factor, int with_targets) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 31;
    c.d_model = 16;
    c.n_layers = 3;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.max_seq_len = 12;
    c.first_k_dense = first_k_dense;
    c.dense_ffn_size = 20;
    c.moe.ffn_size = 12;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    c.moe.aux_loss_coeff = 1e-2;
    c.moe.seq_aux_loss_coeff = 1e-3;
    c.moe.z_loss_coeff = 1e-3;
    c.moe.capacity_factor = capacity_factor;
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, 3));
    int n_moe = c.n_layers - first_k_dense;
    enum { B = 2, T = 12 };
    int32_t tok[B * T + 1];
    for (int i = 0; i < B * T + 1; i++) tok[i] = (i * 7 + 3) % 31;
    int64_t s[2] = {B, T};
    for (int step = 0; step < 2; step++) {
        tm_tensor *tokens, *targets = NULL;
        TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, s, tm_cpu(), TM_I32, tok, &tokens));
        if (with_targets) TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, s, tm_cpu(), TM_I32, tok + 1, &targets));
        uint64_t before = syncs(ctx);
        tm_model_out o;
        TT_OK(ctx, tm_model_forward(m, tokens, targets, &o));
        if (with_targets) TT_OK(ctx, tm_backward(ctx, o.loss));
        uint64_t n = syncs(ctx) - before;
        cr_assert_leq(n, (uint64_t)n_moe + 1,
                      "model forward%s (%d MoE layers, capacity_factor %g): %llu synchronisations, at most %d",
                      with_targets ? " + backward" : "", n_moe, capacity_factor, (unsigned long long)n, n_moe + 1);
        if (with_targets) {
            cr_assert(o.loss_value > 0 && o.ce_value > 0);
            cr_assert(n_moe == 0 || (o.aux_value > 0 && o.seq_aux_value > 0 && o.z_value > 0));
            TT_OK(ctx, tm_model_step(m));
        }
        TT_OK(ctx, tm_ctx_zero_grad(ctx));
        tm_ctx_arena_reset(ctx);
    }
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(sync, model_forward_backward) {
    model_bound(1, 0, 1);
    model_bound(0, 0, 1);
    model_bound(3, 0, 1); /* no MoE layer: the statistics read alone */
}
Test(sync, model_forward_backward_capacity) { model_bound(1, 0.75, 1); }
Test(sync, model_forward_without_targets) { model_bound(1, 0, 0); }
