/* test_sync.c — host round trips (tm_ctx_sync_count) on the CPU, where CI runs: the counting
 * rules (a tm_tensor_read, tm_ctx_sync, a data-dependent output size, an error flag that the
 * CUDA kernel reads back: cross_entropy's bad target, the indexing ops' bad index,
 * grouped_matmul's counts without a host mirror), and the bounds the
 * MoE block and the model are designed to: one MoE layer's forward + backward makes at most one
 * synchronisation, exactly: the permute's row count where it depends on the data (dropless
 * with align_size > 1, capacity without pad_to_capacity); dropless with align_size 1 the
 * permute knows R = T * topk and the first grouped GEMM reads the counts instead; with
 * pad_to_capacity none; the same with apply_topk_weights_early (the row scaling reads
 * nothing). A model's forward + backward makes at most n_moe_layers + 1 (one per
 * MoE layer, plus the single read of the step's statistics at the end of tm_model_forward).
 * The same counts on CUDA (f32), where the GPU is (skipped without one). */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"
#include "parity.h"

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
 * flag back: one each, also on the CPU, when there are indices; tm__embedding_unchecked (ids
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
    TT_OK(ctx, tm__embedding_unchecked(ctx, w, idx, &o));
    TT_OK(ctx, tm_embedding(ctx, w, none, &o));
    TT_OK(ctx, tm_index_check(ctx, idx, 6, 0, &safe, &fb));
    cr_assert_eq(syncs(ctx) - before, 4, "checked embedding, no ids, index_check: nothing read back");
    tm_ctx_free(ctx);
}

/* grouped_matmul needs its counts on the host: a permute's tokens_per_expert carry a host
 * mirror (no wait); other counts are read back once, then mirrored; writing the counts drops
 * the mirror. The CPU counts where CUDA waits. */
Test(sync, grouped_matmul_counts_mirror) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {4, 3}, ms[2] = {4, 2}, ws[3] = {2, 3, 5}, G = 2;
    const double map[8] = {1, 0, 1, 1, 0, 1, 0, 0}, probs[8] = {.5, 0, .4, .6, 0, 1, 0, 0}, cnt[2] = {3, 1};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 2), *w = tt_randn(ctx, TM_F32, 3, ws, 3), *y, *view;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    tm_moe_dispatch d;
    TT_OK(ctx, tm_moe_permute(ctx, x, tt_from(ctx, TM_U8, 2, ms, map), tt_from(ctx, TM_F32, 2, ms, probs), 1, 0, &d));
    uint64_t before = syncs(ctx);
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, d.tokens_per_expert, &y));
    TT_OK(ctx, tm_reshape(ctx, d.tokens_per_expert, 1, &G, &view));
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, view, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, tt_randn(ctx, TM_F32, 2, (int64_t[]){4, 5}, 4)));
    cr_assert_eq(syncs(ctx) - before, 0, "counts from a permute: no wait");

    tm_tensor *c = tt_from(ctx, TM_I64, 1, &G, cnt);
    before = syncs(ctx);
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, c, &y));
    cr_assert_eq(syncs(ctx) - before, 1, "other counts: one read back");
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, c, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, tt_randn(ctx, TM_F32, 2, (int64_t[]){4, 5}, 5)));
    cr_assert_eq(syncs(ctx) - before, 1, "then mirrored, for the backward too");
    const int64_t again[2] = {3, 1};
    TT_OK(ctx, tm_tensor_write(ctx, c, TM_I64, again, 2));
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, c, &y));
    cr_assert_eq(syncs(ctx) - before, 2, "a write drops the mirror");
    TT_OK(ctx, tm_tensor_write(ctx, d.tokens_per_expert, TM_I64, again, 2));
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, view, &y));
    cr_assert_eq(syncs(ctx) - before, 3, "also a permute's, and through a view");
    tm_ctx_free(ctx);
}

/* The permute reads its counts back only where R depends on the data: not with pad_to (the
 * counts, pad_to each, are mirrored all the same), nor with tm_moe_permute_topk and
 * align_size 1 (the counts stay on the device, unmirrored: the first grouped_matmul reads
 * them once). */
Test(sync, permute_reads_only_where_r_depends_on_the_data) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {4, 3}, ms[2] = {4, 2}, ws[3] = {2, 3, 5};
    const double map[8] = {1, 0, 1, 1, 0, 1, 0, 0}, probs[8] = {.5, 0, .4, .6, 0, 1, 0, 0};
    const double one[8] = {1, 0, 0, 1, 0, 1, 1, 0}; /* one expert per token */
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 2), *w = tt_randn(ctx, TM_F32, 3, ws, 3), *y, *y2;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    tm_tensor *m = tt_from(ctx, TM_U8, 2, ms, map), *m1 = tt_from(ctx, TM_U8, 2, ms, one), *p = tt_from(ctx, TM_F32, 2, ms, probs);
    tm_moe_dispatch d;
    uint64_t before = syncs(ctx);
    TT_OK(ctx, tm_moe_permute(ctx, x, m, p, 1, 2, &d));
    cr_assert_eq(d.num_rows, 4);
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, d.tokens_per_expert, &y));
    cr_assert_eq(syncs(ctx) - before, 0, "pad_to: R = E * pad_to, the counts mirrored");

    TT_OK(ctx, tm_moe_permute_topk(ctx, x, m1, p, 1, 1, 0, &d));
    cr_assert_eq(d.num_rows, 4);
    cr_assert_eq(syncs(ctx) - before, 0, "topk, align_size 1: R = T * topk");
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, d.tokens_per_expert, &y));
    cr_assert_eq(syncs(ctx) - before, 1, "no mirror: the first grouped_matmul reads the counts");
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, d.tokens_per_expert, &y2));
    TT_OK(ctx, tm_add(ctx, y, y2, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, tt_randn(ctx, TM_F32, 2, (int64_t[]){4, 5}, 4)));
    cr_assert_eq(syncs(ctx) - before, 1, "then mirrored, for the backward too");

    TT_OK(ctx, tm_moe_permute_topk(ctx, x, m1, p, 1, 4, 0, &d));
    cr_assert_eq(d.num_rows, 8);
    cr_assert_eq(syncs(ctx) - before, 2, "topk with align padding: R depends on the data");
    TT_OK(ctx, tm_moe_permute_topk(ctx, x, m, p, 0, 1, 0, &d));
    cr_assert_eq(syncs(ctx) - before, 3, "topk 0 is tm_moe_permute");
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
        TT_OK(ctx, tm_moe_update_expert_bias(m));
        TT_OK(ctx, tm_ctx_zero_grad(ctx));
        tm_ctx_arena_reset(ctx);
    }
    tm_moe_free(m);
    tm_ctx_free(ctx);
}

Test(sync, moe_layer_forward_backward_dropless) { moe_layer_bound(0, 0); }
Test(sync, moe_layer_forward_backward_capacity) { moe_layer_bound(0.75, 0); }
Test(sync, moe_layer_forward_backward_capacity_seq_aux) { moe_layer_bound(1.0, 1); }

static tm_tensor *dev_tensor(tm_ctx *ctx, tm_dtype dt, int nd, const int64_t *shape, tm_device dev, uint64_t seed,
                             int grad);

/* The exact count of one MoE layer's forward + backward (the rule at the top), per
 * configuration, so that a regression (a second read, or a read where none is needed) fails.
 * dev: the CPU, or CUDA (f32; the caller skips without a GPU). */
static void moe_layer_exact_opt(tm_device dev, double capacity_factor, int pad_to_capacity, int64_t align, int early,
                                uint64_t want) {
    tm_ctx *ctx = dev.type == TM_DEVICE_CPU ? tt_ctx() : tt_parity_ctx();
    tm_moe_config c = tm_moe_config_default();
    c.hidden_size = 16;
    c.ffn_size = 12;
    c.shared_ffn_size = 8;
    c.router.num_experts = 6;
    c.router.topk = 2;
    c.aux_loss_coeff = 1e-2;
    c.seq_aux_loss_coeff = 1e-3;
    c.z_loss_coeff = 1e-3;
    c.capacity_factor = capacity_factor;
    c.pad_to_capacity = pad_to_capacity;
    c.align_size = align;
    c.use_expert_bias = 1;
    c.strategy = TM_MOE_GROUPED;
    c.apply_topk_weights_early = early;
    tm_moe *m = NULL;
    TT_OK(ctx, tm_moe_new(ctx, "blk", &c, TM_F32, dev, &m));
    TT_OK(ctx, tm_moe_init(m, 5, 0.3, 0.2));
    int64_t xs[3] = {2, 20, 16};
    for (int step = 0; step < 2; step++) {
        tm_tensor *x, *y, *l;
        x = dev_tensor(ctx, TM_F32, 3, xs, dev, 40 + (uint64_t)step, 1);
        uint64_t before = syncs(ctx);
        tm_moe_stats st;
        tm_status s = tm_moe_forward(m, x, 2, &y, &st);
        if (s == TM_ERR_UNSUPPORTED && dev.type != TM_DEVICE_CPU)
            cr_skip_test("tm_moe_forward on CUDA: %s", tm_ctx_errmsg(ctx));
        TT_OK(ctx, s);
        TT_OK(ctx, tm_sum_all(ctx, y, &l));
        TT_OK(ctx, tm_add(ctx, l, st.aux_loss, &l));
        TT_OK(ctx, tm_add(ctx, l, st.seq_aux_loss, &l));
        TT_OK(ctx, tm_add(ctx, l, st.z_loss, &l));
        TT_OK(ctx, tm_backward(ctx, l));
        uint64_t n = syncs(ctx) - before;
        cr_assert_eq(n, want, "MoE forward + backward on %s (capacity_factor %g, pad_to_capacity %d, align_size %lld, "
                     "apply_topk_weights_early %d): %llu synchronisations, want %llu",
                     dev.type == TM_DEVICE_CPU ? "the CPU" : "CUDA", capacity_factor, pad_to_capacity, (long long)align,
                     early, (unsigned long long)n, (unsigned long long)want);
        TT_OK(ctx, tm_moe_update_expert_bias(m));
        TT_OK(ctx, tm_ctx_zero_grad(ctx));
        tm_ctx_arena_reset(ctx);
    }
    tm_moe_free(m);
    tm_ctx_free(ctx);
}

/* The same counts with early top-k weighting: scaling the rows (tm_scale_rows) reads nothing. */
static void moe_layer_exact(tm_device dev, double capacity_factor, int pad_to_capacity, int64_t align, uint64_t want) {
    moe_layer_exact_opt(dev, capacity_factor, pad_to_capacity, align, 0, want);
    moe_layer_exact_opt(dev, capacity_factor, pad_to_capacity, align, 1, want);
}

Test(sync, moe_layer_exact_counts) {
    moe_layer_exact(tm_cpu(), 0, 0, 1, 1);    /* dropless: R = T * topk; the first grouped GEMM reads */
    moe_layer_exact(tm_cpu(), 0, 0, 8, 1);    /* dropless, align padding: the permute reads */
    moe_layer_exact(tm_cpu(), 0.75, 0, 1, 1); /* capacity: the permute reads */
    moe_layer_exact(tm_cpu(), 1.0, 1, 8, 0);  /* pad_to_capacity: nothing */
}

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

/* ---- on CUDA ------------------------------------------------------------------------------- */

static uint64_t mix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static tm_tensor *dev_tensor(tm_ctx *ctx, tm_dtype dt, int nd, const int64_t *shape, tm_device dev, uint64_t seed,
                             int grad) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++) v[i] = ((double)(mix(&s) >> 11) * 0x1.0p-53 - 0.5) * 0.6;
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, nd, shape, dev, TM_F64, v, &t));
    if (grad) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, t, 1));
    free(v);
    return t;
}

/* The grouped strategy's dispatch chain of one MoE layer (layers/moe.c) on `dev`, routing
 * decided on the host (top-2 of 6 experts; with capacity > 0 each expert keeps its first
 * `capacity` tokens and is padded to exactly that many rows, pad_to_capacity): permute ->
 * swiglu(rows @ w0[e], rows @ w1[e]) @ wo[e] -> unpermute, plus a shared SwiGLU expert, then
 * backward. Returns the synchronisations of forward + backward. */
static uint64_t moe_chain_syncs(tm_ctx *ctx, tm_device dev, int64_t capacity) {
    enum { T = 40, H = 16, F = 12, E = 6, S = 8 };
    double map[T * E] = {0};
    int64_t used[E] = {0};
    uint64_t s = 7;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < 2; j++) {
            int e = (int)(mix(&s) % E);
            if (map[t * E + e] || (capacity > 0 && used[e] >= capacity)) continue;
            map[t * E + e] = 1;
            used[e]++;
        }
    int64_t xs[2] = {T, H}, ms[2] = {T, E}, w01[3] = {E, H, F}, wos[3] = {E, F, H}, s01[2] = {H, S}, sos[2] = {S, H};
    tm_tensor *x = dev_tensor(ctx, TM_F32, 2, xs, dev, 1, 1), *probs = dev_tensor(ctx, TM_F32, 2, ms, dev, 2, 1);
    tm_tensor *w0 = dev_tensor(ctx, TM_F32, 3, w01, dev, 3, 1), *w1 = dev_tensor(ctx, TM_F32, 3, w01, dev, 4, 1);
    tm_tensor *wo = dev_tensor(ctx, TM_F32, 3, wos, dev, 5, 1), *sw0 = dev_tensor(ctx, TM_F32, 2, s01, dev, 6, 1);
    tm_tensor *sw1 = dev_tensor(ctx, TM_F32, 2, s01, dev, 7, 1), *swo = dev_tensor(ctx, TM_F32, 2, sos, dev, 8, 1);
    tm_tensor *m;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_U8, 2, ms, dev, TM_F64, map, &m));
    uint64_t before = syncs(ctx);
    tm_moe_dispatch d;
    tm_tensor *a, *b, *h, *eo, *y, *sa, *sb, *sh, *so, *l;
    TT_OK(ctx, tm_moe_permute(ctx, x, m, probs, 1, capacity, &d));
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w0, d.tokens_per_expert, &a));
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w1, d.tokens_per_expert, &b));
    TT_OK(ctx, tm_swiglu(ctx, a, b, &h));
    TT_OK(ctx, tm_grouped_matmul(ctx, h, wo, d.tokens_per_expert, &eo));
    TT_OK(ctx, tm_moe_unpermute(ctx, eo, d.permuted_probs, d.row_token, T, &y));
    TT_OK(ctx, tm_matmul(ctx, x, sw0, 0, 0, &sa));
    TT_OK(ctx, tm_matmul(ctx, x, sw1, 0, 0, &sb));
    TT_OK(ctx, tm_swiglu(ctx, sa, sb, &sh));
    TT_OK(ctx, tm_matmul(ctx, sh, swo, 0, 0, &so));
    TT_OK(ctx, tm_add(ctx, y, so, &y));
    TT_OK(ctx, tm_sum_all(ctx, y, &l));
    TT_OK(ctx, tm_backward(ctx, l));
    return syncs(ctx) - before;
}

/* One MoE layer's forward + backward on CUDA: at most one synchronisation, as on the CPU. The
 * whole block (tm_moe_forward) needs the router and loss ops on CUDA too; where this build has
 * none yet (TM_ERR_UNSUPPORTED) the layer's dispatch chain runs on CUDA alone (tm_moe_permute
 * with pad_to = the capacity: one read dropless, none with a capacity). */
static void cuda_moe_layer_bound(double capacity_factor) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    tm_moe_config c = tm_moe_config_default();
    c.hidden_size = 16;
    c.ffn_size = 12;
    c.shared_ffn_size = 8;
    c.router.num_experts = 6;
    c.router.topk = 2;
    c.aux_loss_coeff = 1e-2;
    c.z_loss_coeff = 1e-3;
    c.capacity_factor = capacity_factor;
    c.strategy = TM_MOE_GROUPED;
    tm_moe *m = NULL;
    TT_OK(ctx, tm_moe_new(ctx, "blk", &c, TM_F32, tm_cuda(0), &m));
    TT_OK(ctx, tm_moe_init(m, 5, 0.3, 0.2));
    int64_t xs[2] = {40, 16};
    tm_tensor *x = dev_tensor(ctx, TM_F32, 2, xs, tm_cuda(0), 40, 1), *y, *l;
    uint64_t before = syncs(ctx);
    tm_moe_stats st;
    tm_status s = tm_moe_forward(m, x, 1, &y, &st);
    if (s == TM_ERR_UNSUPPORTED) {
        cr_log_info("tm_moe_forward on CUDA: %s; running the layer's dispatch chain on CUDA instead", tm_ctx_errmsg(ctx));
        int64_t capacity = capacity_factor > 0 ? tm_moe_capacity(40, 2, 6, capacity_factor) : 0;
        uint64_t n = moe_chain_syncs(ctx, tm_cuda(0), capacity), want = capacity > 0 ? 0 : 1;
        cr_assert_eq(n, want, "MoE chain forward + backward on CUDA (capacity %lld): %llu synchronisations, want %llu",
                     (long long)capacity, (unsigned long long)n, (unsigned long long)want);
        tm_ctx *cpu = tt_ctx();
        uint64_t n_cpu = moe_chain_syncs(cpu, tm_cpu(), capacity);
        cr_assert_eq(n, n_cpu, "CUDA waits %llu times, the CPU counts %llu", (unsigned long long)n,
                     (unsigned long long)n_cpu);
        tm_ctx_free(cpu);
    } else {
        TT_OK(ctx, s);
        TT_OK(ctx, tm_sum_all(ctx, y, &l));
        TT_OK(ctx, tm_add(ctx, l, st.aux_loss, &l));
        TT_OK(ctx, tm_add(ctx, l, st.z_loss, &l));
        TT_OK(ctx, tm_backward(ctx, l));
        uint64_t n = syncs(ctx) - before;
        cr_assert_leq(n, 1, "MoE forward + backward on CUDA (capacity_factor %g): %llu synchronisations, at most 1",
                      capacity_factor, (unsigned long long)n);
    }
    tm_moe_free(m);
    tm_ctx_free(ctx);
}

Test(sync, cuda_moe_layer_forward_backward_dropless) { cuda_moe_layer_bound(0); }
Test(sync, cuda_moe_layer_forward_backward_capacity) { cuda_moe_layer_bound(0.75); }

/* The exact counts on CUDA, configuration by configuration, as on the CPU (f32: the grouped
 * GEMMs need their group sizes on the host). */
Test(sync, cuda_moe_layer_exact_counts) {
    TT_SKIP_WITHOUT_CUDA();
    moe_layer_exact(tm_cuda(0), 0, 0, 1, 1);    /* dropless: the permute reads nothing, the first GEMM once */
    moe_layer_exact(tm_cuda(0), 0, 0, 8, 1);    /* dropless, align padding: the permute reads */
    moe_layer_exact(tm_cuda(0), 0.75, 0, 1, 1); /* capacity: the permute reads */
    moe_layer_exact(tm_cuda(0), 1.0, 1, 8, 0);  /* pad_to_capacity: nothing */
}

/* A tiny model's training step on CUDA: at most n_moe_layers + 1 synchronisations, the count
 * the CPU makes for the same step. Skipped while an op of the model has no CUDA kernel. */
static uint64_t model_step_syncs(tm_ctx *ctx, tm_device dev, double capacity_factor, int *n_moe, tm_status *st) {
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 31;
    c.d_model = 16;
    c.n_layers = 3;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.max_seq_len = 12;
    c.first_k_dense = 1;
    c.dense_ffn_size = 20;
    c.moe.ffn_size = 12;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    c.moe.aux_loss_coeff = 1e-2;
    c.moe.z_loss_coeff = 1e-3;
    c.moe.capacity_factor = capacity_factor;
    *n_moe = c.n_layers - c.first_k_dense;
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, dev, &m));
    TT_OK(ctx, tm_model_init(m, 3));
    enum { B = 2, T = 12 };
    int32_t tok[B * T + 1];
    for (int i = 0; i < B * T + 1; i++) tok[i] = (i * 7 + 3) % 31;
    int64_t s[2] = {B, T};
    tm_tensor *tokens, *targets;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, s, dev, TM_I32, tok, &tokens));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, s, dev, TM_I32, tok + 1, &targets));
    uint64_t before = syncs(ctx);
    tm_model_out o;
    *st = tm_model_forward(m, tokens, targets, &o);
    if (*st == TM_OK) TT_OK(ctx, tm_backward(ctx, o.loss));
    uint64_t n = syncs(ctx) - before;
    tm_model_free(m);
    return n;
}

static void cuda_model_bound(double capacity_factor) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx(), *cpu = tt_ctx();
    int n_moe;
    tm_status s;
    uint64_t n = model_step_syncs(ctx, tm_cuda(0), capacity_factor, &n_moe, &s);
    if (s == TM_ERR_UNSUPPORTED) cr_skip_test("the model's step on CUDA: %s", tm_ctx_errmsg(ctx));
    TT_OK(ctx, s);
    cr_assert_eq(n, (uint64_t)n_moe + 1, "model forward + backward on CUDA (%d MoE layers, capacity_factor %g): %llu "
                 "synchronisations, want %d (one per MoE layer, one for the statistics)", n_moe, capacity_factor,
                 (unsigned long long)n, n_moe + 1);
    uint64_t n_cpu = model_step_syncs(cpu, tm_cpu(), capacity_factor, &n_moe, &s);
    TT_OK(cpu, s);
    cr_assert_eq(n, n_cpu, "CUDA waits %llu times, the CPU counts %llu", (unsigned long long)n, (unsigned long long)n_cpu);
    tm_ctx_free(cpu);
    tm_ctx_free(ctx);
}

Test(sync, cuda_model_forward_backward) { cuda_model_bound(0); }
Test(sync, cuda_model_forward_backward_capacity) { cuda_model_bound(0.75); }

/* tm_ctx_sync_seconds: nothing on the CPU (its counted points wait for nothing); on CUDA, a
 * sync after a queue of work takes longer than the work needs to be enqueued, and the time
 * adds up monotonically. */
Test(sync, sync_seconds_cpu_is_zero) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {64, 64};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, s, 3), *y;
    float buf[64 * 64];
    TT_OK(ctx, tm_matmul(ctx, x, x, 0, 0, &y));
    TT_OK(ctx, tm_tensor_read(ctx, y, TM_F32, buf, 64 * 64));
    TT_OK(ctx, tm_ctx_sync(ctx));
    cr_assert_gt(syncs(ctx), 0);
    cr_assert_eq(tm_ctx_sync_seconds(ctx), 0.0);
    cr_assert_eq(tm_ctx_sync_seconds(NULL), 0.0);
    tm_ctx_free(ctx);
}

Test(sync, cuda_sync_seconds_measures_the_wait) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t s[2] = {2048, 2048};
    tm_tensor *x = dev_tensor(ctx, TM_F32, 2, s, tm_cuda(0), 2048, 1), *y = x;
    TT_OK(ctx, tm_ctx_sync(ctx));
    double w0 = tm_ctx_sync_seconds(ctx);
    /* 40 dependent f32 products of 2048^3 (each rescaled by about 1/sqrt(2048) to stay
     * finite): tens of milliseconds on any GPU, queued in far less. */
    for (int i = 0; i < 40; i++) {
        TT_OK(ctx, tm_matmul(ctx, y, x, 0, 0, &y));
        TT_OK(ctx, tm_scale(ctx, y, 0.022, &y));
    }
    double t0 = tm__now();
    TT_OK(ctx, tm_ctx_sync(ctx));
    double waited = tm_ctx_sync_seconds(ctx) - w0, wall = tm__now() - t0;
    cr_assert_gt(waited, 0.0, "the sync after 40 queued products waited %g s", waited);
    cr_assert_leq(waited, wall + 1e-6, "counted %g s of wait in a %g s call", waited, wall);
    float v;
    tm_tensor *e;
    TT_OK(ctx, tm_slice(ctx, y, 0, 0, 1, &e));
    TT_OK(ctx, tm_slice(ctx, e, 1, 0, 1, &e));
    TT_OK(ctx, tm_tensor_read(ctx, e, TM_F32, &v, 1));
    cr_assert_geq(tm_ctx_sync_seconds(ctx), w0 + waited, "the total never decreases");
    tm_ctx_free(ctx);
}
