/* test_kv_cache.c — incremental decoding (tm_kv_cache_*, tm_model_forward_cached): the logits
 * of the cached path, fed a sequence whole, as a prompt then one token at a time, or in random
 * chunks, against tm_model_forward on the whole sequence (the reference), for MHA and GQA,
 * softmax and sigmoid+bias routing, dense first layers, tied embeddings, f32 and bf16, batch 1
 * and 3; reuse after reset; the tape and the expert-bias counts left alone; no system allocation
 * in steady state; every bad argument named (and nothing appended); the copies into the cache
 * on CUDA. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"
#include "../layers/kv_cache.h" /* tm__kv_cache_write, for the CUDA copy test */

/* MHA, softmax top-2 of 4 experts, aux / seq-aux / z losses on (they must not disturb
 * decoding). */
static tm_model_config cfg_mha(void) {
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 29;
    c.d_model = 16;
    c.n_layers = 2;
    c.n_heads = 2;
    c.n_kv_heads = 2;
    c.max_seq_len = 20;
    c.init_std = 0.3;
    c.moe.ffn_size = 12;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    c.moe.aux_loss_coeff = 0.01;
    c.moe.seq_aux_loss_coeff = 0.01;
    c.moe.z_loss_coeff = 0.001;
    return c;
}

/* GQA (4 query heads over 1 kv head), a dense first layer, tied embeddings, 3 layers. */
static tm_model_config cfg_gqa(void) {
    tm_model_config c = cfg_mha();
    c.n_heads = 4;
    c.n_kv_heads = 1;
    c.n_layers = 3;
    c.first_k_dense = 1;
    c.dense_ffn_size = 20;
    c.tie_embeddings = 1;
    return c;
}

/* DeepSeek-V3 style routing: sigmoid scores, an expert bias (set to random values below),
 * group-limited top-2, scaling, a shared expert; 2 query heads over 1 kv head. */
static tm_model_config cfg_sigmoid(void) {
    tm_model_config c = cfg_mha();
    c.n_kv_heads = 1;
    c.moe.router.num_experts = 8;
    c.moe.router.topk = 2;
    c.moe.router.score_function = TM_SCORE_SIGMOID;
    c.moe.router.num_groups = 4;
    c.moe.router.group_topk = 2;
    c.moe.router.scaling_factor = 2.5;
    c.moe.use_expert_bias = 1;
    c.moe.shared_ffn_size = 8;
    return c;
}

static tm_model *make(tm_ctx *ctx, const tm_model_config *cfg, tm_dtype dt, uint64_t seed) {
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, cfg, dt, tm_cpu(), &m));
    TT_OK(ctx, tm_model_init(m, seed));
    /* Nonzero expert biases, so that selection really depends on them. */
    for (int l = 0; l < cfg->n_layers; l++) {
        char name[64];
        snprintf(name, sizeof name, "layers.%d.moe.expert_bias", l);
        tm_tensor *b = tm_ctx_find(ctx, name);
        if (!b) continue;
        int64_t E = tm_tensor_numel(b);
        float v[64];
        for (int64_t e = 0; e < E; e++) v[e] = (float)(0.3 * sin(1.7 * (double)(e + 1) * (l + 1)));
        TT_OK(ctx, tm_tensor_write(ctx, b, TM_F32, v, E));
    }
    return m;
}

/* Deterministic pseudo-random ids in [0, hi). */
static void fill_ids(int32_t *v, int64_t n, int64_t hi, uint32_t seed) {
    uint32_t r = seed * 2654435761u + 1;
    for (int64_t i = 0; i < n; i++) {
        r = r * 1664525u + 1013904223u;
        v[i] = (int32_t)((r >> 8) % (uint32_t)hi);
    }
}

static tm_tensor *ids(tm_ctx *ctx, const int32_t *v, int64_t B, int64_t T) {
    int64_t s[2] = {B, T};
    tm_tensor *t = NULL;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, s, tm_cpu(), TM_I32, v, &t));
    return t;
}

/* Columns [t0, t0 + n) of tok [B, S] as a contiguous [B, n] host array. */
static void columns(const int32_t *tok, int64_t B, int64_t S, int64_t t0, int64_t n, int32_t *out) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < n; t++) out[b * n + t] = tok[b * S + t0 + t];
}

/* Full-sequence reference logits [B, S, V] (host, f64). */
static double *full_logits(tm_ctx *ctx, tm_model *m, const int32_t *tok, int64_t B, int64_t S) {
    tm_model_out o;
    TT_OK(ctx, tm_model_forward(m, ids(ctx, tok, B, S), NULL, &o));
    double *v = tt_read(ctx, o.logits);
    tm_ctx_arena_reset(ctx);
    return v;
}

/* Feed tok [B, S] through the cache in chunks of the given sizes (summing to S), resetting the
 * arena between chunks (the cache must survive it); returns the logits [B, S, V]. */
static double *cached_logits(tm_ctx *ctx, tm_model *m, tm_kv_cache *kc, const int32_t *tok, int64_t B, int64_t S,
                             const int *chunks, int n_chunks) {
    int64_t V = tm_model_get_config(m)->vocab_size;
    double *all = malloc(sizeof(double) * (size_t)(B * S * V));
    int32_t *part = malloc(sizeof(int32_t) * (size_t)(B * S));
    int64_t t0 = 0;
    for (int i = 0; i < n_chunks; i++) {
        int64_t n = chunks[i];
        columns(tok, B, S, t0, n, part);
        tm_tensor *lg = NULL;
        TT_OK(ctx, tm_model_forward_cached(m, kc, ids(ctx, part, B, n), &lg));
        cr_assert_eq(tm_tensor_ndim(lg), 3);
        cr_assert(tm_tensor_dim(lg, 0) == B && tm_tensor_dim(lg, 1) == n && tm_tensor_dim(lg, 2) == V);
        cr_assert_eq(tm_tensor_dtype(lg), tm_tensor_dtype(tm_ctx_find(ctx, "embed.weight")));
        cr_assert_not(tm_tensor_requires_grad(lg), "the cached path records no tape");
        double *v = tt_read(ctx, lg);
        for (int64_t b = 0; b < B; b++)
            memcpy(all + (b * S + t0) * V, v + b * n * V, sizeof(double) * (size_t)(n * V));
        free(v);
        t0 += n;
        cr_assert_eq(tm_kv_cache_len(kc), t0);
        tm_ctx_arena_reset(ctx);
    }
    cr_assert_eq(t0, S);
    free(part);
    return all;
}

/* Worst |got - want| / (atol + rtol |want|), reported with its position. */
static void assert_close(const double *got, const double *want, int64_t n, double atol, double rtol, const char *what) {
    double worst = tt_close_ratio(got, want, n, atol, rtol);
    cr_assert(worst <= 1, "%s: cached logits differ from the full forward (ratio %g > 1 at atol %g, rtol %g)", what,
              worst, atol, rtol);
}

/* The three feeding schedules for one (config, dtype, batch). */
static void check_matches_full(tm_model_config cfg, tm_dtype dt, int64_t B, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    tm_model *m = make(ctx, &cfg, dt, 11);
    const int64_t S = cfg.max_seq_len, V = cfg.vocab_size;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)(B * S));
    fill_ids(tok, B * S, V, 3 + (uint32_t)B);
    double *want = full_logits(ctx, m, tok, B, S);

    tm_kv_cache *kc = NULL;
    TT_OK(ctx, tm_kv_cache_new(m, (int)B, (int)S, &kc));
    cr_assert_eq(tm_kv_cache_len(kc), 0);
    cr_assert_eq(tm_kv_cache_capacity(kc), S);

    int whole[1] = {(int)S};
    double *got = cached_logits(ctx, m, kc, tok, B, S, whole, 1);
    assert_close(got, want, B * S * V, atol, rtol, "whole sequence at once");
    free(got);

    /* A 5-token prompt, then one token per call. */
    int one[64];
    one[0] = 5;
    for (int i = 1; i <= S - 5; i++) one[i] = 1;
    tm_kv_cache_reset(kc);
    cr_assert_eq(tm_kv_cache_len(kc), 0);
    double *stepwise = cached_logits(ctx, m, kc, tok, B, S, one, (int)(S - 4));
    assert_close(stepwise, want, B * S * V, atol, rtol, "prompt then one token at a time");

    /* Random chunk sizes from 1 to 6. */
    int chunks[64], n = 0;
    uint32_t r = 77 + (uint32_t)B;
    for (int64_t left = S; left > 0; n++) {
        r = r * 1664525u + 1013904223u;
        int k = 1 + (int)((r >> 8) % 6);
        chunks[n] = k < left ? k : (int)left;
        left -= chunks[n];
    }
    tm_kv_cache_reset(kc);
    got = cached_logits(ctx, m, kc, tok, B, S, chunks, n);
    assert_close(got, want, B * S * V, atol, rtol, "random chunks");
    free(got);

    /* Reset and reuse: the same schedule gives bit-identical logits. */
    tm_kv_cache_reset(kc);
    got = cached_logits(ctx, m, kc, tok, B, S, one, (int)(S - 4));
    for (int64_t i = 0; i < B * S * V; i++)
        cr_assert(got[i] == stepwise[i], "after reset: logit %lld is %.9g, was %.9g", (long long)i, got[i], stepwise[i]);
    free(got);

    free(stepwise);
    free(want);
    free(tok);
    tm_kv_cache_free(kc);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* f32: the cached path differs from the full forward only in GEMM row blocking and summation
 * order. bf16 (a storage format on the CPU: every op's output is rounded to 8 bits) flips
 * roundings between the two paths, and a flipped rounding of an activation is 2^-8 relative. */
#define F32_TOL 1e-5, 1e-5
#define BF16_TOL 3e-2, 3e-2

Test(kv_cache, mha_softmax_f32_batch1) { check_matches_full(cfg_mha(), TM_F32, 1, F32_TOL); }
Test(kv_cache, mha_softmax_f32_batch3) { check_matches_full(cfg_mha(), TM_F32, 3, F32_TOL); }
Test(kv_cache, gqa_dense_first_tied_f32_batch1) { check_matches_full(cfg_gqa(), TM_F32, 1, F32_TOL); }
Test(kv_cache, gqa_dense_first_tied_f32_batch3) { check_matches_full(cfg_gqa(), TM_F32, 3, F32_TOL); }
Test(kv_cache, sigmoid_bias_groups_shared_f32_batch1) { check_matches_full(cfg_sigmoid(), TM_F32, 1, F32_TOL); }
Test(kv_cache, sigmoid_bias_groups_shared_f32_batch3) { check_matches_full(cfg_sigmoid(), TM_F32, 3, F32_TOL); }
Test(kv_cache, dense_strategy_f32_batch3) {
    tm_model_config c = cfg_mha();
    c.moe.strategy = TM_MOE_DENSE;
    check_matches_full(c, TM_F32, 3, F32_TOL);
}
Test(kv_cache, mha_softmax_bf16_batch1) { check_matches_full(cfg_mha(), TM_BF16, 1, BF16_TOL); }
Test(kv_cache, gqa_dense_first_tied_bf16_batch3) { check_matches_full(cfg_gqa(), TM_BF16, 3, BF16_TOL); }
Test(kv_cache, sigmoid_bias_bf16_batch3) { check_matches_full(cfg_sigmoid(), TM_BF16, 3, BF16_TOL); }

/* A cache shorter than max_seq_len, and a sequence shorter than the cache. */
Test(kv_cache, partial_fill_of_a_short_cache) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = cfg_gqa();
    tm_model *m = make(ctx, &c, TM_F32, 2);
    enum { B = 2, S = 7 };
    int32_t tok[B * S];
    fill_ids(tok, B * S, c.vocab_size, 9);
    double *want = full_logits(ctx, m, tok, B, S);
    tm_kv_cache *kc = NULL;
    TT_OK(ctx, tm_kv_cache_new(m, B, 9, &kc));
    int chunks[3] = {3, 1, 3};
    double *got = cached_logits(ctx, m, kc, tok, B, S, chunks, 3);
    assert_close(got, want, B * S * c.vocab_size, F32_TOL, "7 of 9 positions");
    free(got);
    free(want);
    tm_kv_cache_free(kc);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* The cached path runs with the tape off whatever the grad mode, restores the mode, and leaves
 * the expert-bias running counts (fed only by training forwards) untouched. */
Test(kv_cache, no_tape_and_no_expert_statistics) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = cfg_sigmoid();
    tm_model *m = make(ctx, &c, TM_F32, 4);
    cr_assert_eq(tm_ctx_set_grad_enabled(ctx, 1), 1, "grad mode is on by default");
    tm_kv_cache *kc = NULL;
    TT_OK(ctx, tm_kv_cache_new(m, 1, 8, &kc));
    int32_t tok[4] = {1, 2, 3, 4};
    tm_tensor *lg = NULL;
    TT_OK(ctx, tm_model_forward_cached(m, kc, ids(ctx, tok, 1, 4), &lg));
    TT_OK(ctx, tm_model_forward_cached(m, kc, ids(ctx, tok, 1, 1), &lg));
    cr_assert_eq(tm_ctx_set_grad_enabled(ctx, 1), 1, "grad mode restored");
    cr_assert_not(tm_tensor_requires_grad(lg));
    for (int l = 0; l < c.n_layers; l++) {
        char name[64];
        snprintf(name, sizeof name, "layers.%d.moe.tokens_per_expert_sum", l);
        double *sum = tt_read(ctx, tm_ctx_find(ctx, name));
        for (int e = 0; e < c.moe.router.num_experts; e++) cr_assert_eq(sum[e], 0, "%s[%d] = %g", name, e, sum[e]);
        free(sum);
    }
    /* Whereas a training forward does count (so the check above can fail). */
    tm_model_out o;
    TT_OK(ctx, tm_model_forward(m, ids(ctx, tok, 1, 4), NULL, &o));
    double *sum = tt_read(ctx, tm_ctx_find(ctx, "layers.0.moe.tokens_per_expert_sum"));
    double total = 0;
    for (int e = 0; e < c.moe.router.num_experts; e++) total += sum[e];
    cr_assert_eq(total, 4 * c.moe.router.topk);
    free(sum);
    tm_kv_cache_free(kc);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* After the first decode step every later one reuses the arena's chunks (the cache itself is
 * allocated once): no system allocation, for batch 1 (contiguous cache views) and batch 3
 * (strided ones, copied for the attention). */
static void steady_state(int B) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = cfg_gqa();
    tm_model *m = make(ctx, &c, TM_F32, 5);
    tm_kv_cache *kc = NULL;
    TT_OK(ctx, tm_kv_cache_new(m, B, c.max_seq_len, &kc));
    int32_t tok[3 * 20];
    fill_ids(tok, 3 * 20, c.vocab_size, 8);
    tm_tensor *lg;
    TT_OK(ctx, tm_model_forward_cached(m, kc, ids(ctx, tok, B, 4), &lg));
    tm_ctx_arena_reset(ctx);
    TT_OK(ctx, tm_model_forward_cached(m, kc, ids(ctx, tok + 4, B, 1), &lg));
    tm_ctx_arena_reset(ctx);
    uint64_t allocs = tm_ctx_alloc_count(ctx);
    for (int s = 0; s < 12; s++) {
        float row[3 * 29];
        TT_OK(ctx, tm_model_forward_cached(m, kc, ids(ctx, tok + 5 + s, B, 1), &lg));
        TT_OK(ctx, tm_tensor_read(ctx, lg, TM_F32, row, (int64_t)B * c.vocab_size));
        tm_ctx_arena_reset(ctx);
        cr_assert_eq(tm_ctx_alloc_count(ctx), allocs, "decode step %d (len %d) allocated: %llu -> %llu", s + 2,
                     tm_kv_cache_len(kc), (unsigned long long)allocs, (unsigned long long)tm_ctx_alloc_count(ctx));
    }
    cr_assert_eq(tm_kv_cache_len(kc), 17);
    tm_kv_cache_free(kc);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(kv_cache, no_system_allocation_in_steady_state_batch1) { steady_state(1); }
Test(kv_cache, no_system_allocation_in_steady_state_batch3) { steady_state(3); }

/* ---- errors ------------------------------------------------------------------------------ */

static void expect_msg(tm_ctx *ctx, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert(strstr(msg, a), "message does not name '%s': %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message does not name '%s': %s", b, msg);
}

Test(kv_cache, bad_cache_arguments_are_named) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = cfg_mha();
    tm_model *m = make(ctx, &c, TM_F32, 1);
    tm_kv_cache *kc = (tm_kv_cache *)0x1;
    cr_assert_eq(tm_kv_cache_new(m, 1, c.max_seq_len + 1, &kc), TM_ERR_INVALID_ARG);
    expect_msg(ctx, "max_len = 21", "max_seq_len = 20");
    cr_assert_eq(tm_kv_cache_new(m, 1, 0, &kc), TM_ERR_INVALID_ARG);
    expect_msg(ctx, "max_len = 0", NULL);
    cr_assert_eq(tm_kv_cache_new(m, 0, 4, &kc), TM_ERR_INVALID_ARG);
    expect_msg(ctx, "batch = 0", NULL);
    cr_assert_eq(kc, (tm_kv_cache *)0x1, "out written on failure");
    cr_assert_eq(tm_kv_cache_new(m, 1, 4, NULL), TM_ERR_INVALID_ARG);
    expect_msg(ctx, "out", NULL);
    cr_assert_eq(tm_kv_cache_new(NULL, 1, 4, &kc), TM_ERR_INVALID_ARG);
    tm_kv_cache_free(NULL);
    tm_kv_cache_reset(NULL);
    cr_assert_eq(tm_kv_cache_len(NULL), 0);
    cr_assert_eq(tm_kv_cache_capacity(NULL), 0);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

Test(kv_cache, bad_forward_arguments_are_named_and_append_nothing) {
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = cfg_mha();
    tm_model *m = make(ctx, &c, TM_F32, 1);
    enum { S = 8 };
    int32_t tok[2 * S];
    fill_ids(tok, 2 * S, c.vocab_size, 12);
    double *want = full_logits(ctx, m, tok, 1, S);
    tm_kv_cache *kc = NULL;
    TT_OK(ctx, tm_kv_cache_new(m, 1, S, &kc));
    tm_tensor *lg = (tm_tensor *)0x1, *ok = NULL;
    TT_OK(ctx, tm_model_forward_cached(m, kc, ids(ctx, tok, 1, 6), &ok));

    /* Overflow: 6 + 3 > 8. */
    cr_assert_eq(tm_model_forward_cached(m, kc, ids(ctx, tok + 6, 1, 3), &lg), TM_ERR_INVALID_ARG);
    expect_msg(ctx, "capacity max_len = 8", "6 cached");
    cr_assert_eq(tm_kv_cache_len(kc), 6);
    /* A token outside the vocabulary, named by position. */
    int32_t bad[2] = {3, 29};
    cr_assert_eq(tm_model_forward_cached(m, kc, ids(ctx, bad, 1, 2), &lg), TM_ERR_INDEX);
    expect_msg(ctx, "tokens[0, 1] = 29", "vocab_size = 29");
    bad[1] = -1;
    cr_assert_eq(tm_model_forward_cached(m, kc, ids(ctx, bad, 1, 2), &lg), TM_ERR_INDEX);
    expect_msg(ctx, "tokens[0, 1] = -1", NULL);
    cr_assert_eq(tm_kv_cache_len(kc), 6);
    /* Wrong batch, dtype, rank. */
    cr_assert_eq(tm_model_forward_cached(m, kc, ids(ctx, tok, 2, 1), &lg), TM_ERR_SHAPE);
    expect_msg(ctx, "batch = 1", "2 sequences");
    int64_t s2[2] = {1, 1}, s1[1] = {2};
    tm_tensor *t64 = NULL, *t1 = NULL;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 2, s2, tm_cpu(), TM_I32, tok, &t64));
    cr_assert_eq(tm_model_forward_cached(m, kc, t64, &lg), TM_ERR_DTYPE);
    expect_msg(ctx, "tm_model_forward_cached", "i32 [B,T]");
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 1, s1, tm_cpu(), TM_I32, tok, &t1));
    cr_assert_eq(tm_model_forward_cached(m, kc, t1, &lg), TM_ERR_SHAPE);
    /* NULLs, and a cache made for another model. */
    cr_assert_eq(tm_model_forward_cached(m, NULL, t1, &lg), TM_ERR_INVALID_ARG);
    expect_msg(ctx, "cache is NULL", NULL);
    cr_assert_eq(tm_model_forward_cached(m, kc, NULL, &lg), TM_ERR_INVALID_ARG);
    expect_msg(ctx, "tokens is NULL", NULL);
    cr_assert_eq(tm_model_forward_cached(m, kc, t1, NULL), TM_ERR_INVALID_ARG);
    expect_msg(ctx, "logits is NULL", NULL);
    cr_assert_eq(tm_model_forward_cached(NULL, kc, t1, &lg), TM_ERR_INVALID_ARG);
    tm_ctx *ctx2 = tt_ctx();
    tm_model *m2 = make(ctx2, &c, TM_F32, 1);
    tm_kv_cache *kc2 = NULL;
    TT_OK(ctx2, tm_kv_cache_new(m2, 1, S, &kc2));
    cr_assert_eq(tm_model_forward_cached(m, kc2, ids(ctx, tok, 1, 1), &lg), TM_ERR_INVALID_ARG);
    expect_msg(ctx, "another model", NULL);
    cr_assert_eq(tm_kv_cache_len(kc2), 0);
    tm_kv_cache_free(kc2);
    tm_model_free(m2);
    tm_ctx_free(ctx2);
    cr_assert_eq(lg, (tm_tensor *)0x1, "logits written on failure");
    cr_assert_eq(tm_kv_cache_len(kc), 6);

    /* The failures left the cache intact: the last two positions still match. */
    TT_OK(ctx, tm_model_forward_cached(m, kc, ids(ctx, tok + 6, 1, 2), &ok));
    double *got = tt_read(ctx, ok);
    assert_close(got, want + 6 * c.vocab_size, 2 * c.vocab_size, F32_TOL, "after the failed calls");
    free(got);
    free(want);
    tm_kv_cache_free(kc);
    tm_model_free(m);
    tm_ctx_free(ctx);
}

/* ---- CUDA -------------------------------------------------------------------------------- */

/* On CUDA the cache lives in device memory and the writes into it are device copies
 * (tm__assign's CUDA path; strided destinations for batch > 1): chunks written at [len, len+T)
 * read back through the views exactly. The whole cached forward stops at the first op without
 * a CUDA kernel, named, with nothing appended. */
Test(kv_cache, cuda_cache_memory_and_copies) {
    if (tm_cuda_device_count() == 0) cr_skip_test("no CUDA device");
    tm_ctx_options opt = tm_ctx_options_default();
    opt.num_threads = 2;
    opt.cuda_device = 0;
    tm_ctx *ctx = NULL;
    cr_assert_eq(tm_ctx_new(&ctx, &opt), TM_OK, "%s", tm_last_create_error());
    tm_model_config c = cfg_mha();
    const tm_dtype dts[2] = {TM_F32, TM_BF16};
    for (int d = 0; d < 2; d++) {
        tm_model *m = NULL;
        if (d == 1) { /* parameter names are per context: a second model needs its own */
            tm_ctx_free(ctx);
            cr_assert_eq(tm_ctx_new(&ctx, &opt), TM_OK, "%s", tm_last_create_error());
        }
        TT_OK(ctx, tm_model_new(ctx, &c, dts[d], tm_cuda(0), &m));
        TT_OK(ctx, tm_model_init(m, 1));
        for (int B = 1; B <= 3; B += 2) {
            const int64_t Hkv = c.n_kv_heads, D = c.d_model / c.n_heads, cap = 10;
            tm_kv_cache *kc = NULL;
            TT_OK(ctx, tm_kv_cache_new(m, B, (int)cap, &kc));
            double *want_k = calloc((size_t)(B * cap * Hkv * D), sizeof(double));
            double *want_v = calloc((size_t)(B * cap * Hkv * D), sizeof(double));
            const int chunks[3] = {4, 1, 3};
            for (int i = 0; i < 3; i++) {
                int64_t T = chunks[i], len = tm_kv_cache_len(kc), s[4] = {B, T, Hkv, D};
                tm_tensor *kh = tt_randn(ctx, dts[d], 4, s, 100 + 10 * i), *vh = tt_randn(ctx, dts[d], 4, s, 101 + 10 * i);
                tm_tensor *k, *v, *ka, *va;
                TT_OK(ctx, tm_to_device(ctx, kh, tm_cuda(0), &k));
                TT_OK(ctx, tm_to_device(ctx, vh, tm_cuda(0), &v));
                TT_OK(ctx, tm__kv_cache_write(kc, 1, k, v, &ka, &va));
                kc->len += (int)T; /* what tm_model_forward_cached does once every layer is written */
                double *hk = tt_read(ctx, kh), *hv = tt_read(ctx, vh);
                for (int64_t b = 0; b < B; b++)
                    for (int64_t t = 0; t < T; t++)
                        for (int64_t j = 0; j < Hkv * D; j++) {
                            want_k[(b * cap + len + t) * Hkv * D + j] = hk[(b * T + t) * Hkv * D + j];
                            want_v[(b * cap + len + t) * Hkv * D + j] = hv[(b * T + t) * Hkv * D + j];
                        }
                free(hk), free(hv);
                cr_assert_eq(tm_tensor_device(ka).type, TM_DEVICE_CUDA);
                cr_assert_eq(tm_tensor_dim(ka, 1), len + T);
                double *gk = tt_read(ctx, ka), *gv = tt_read(ctx, va);
                for (int64_t b = 0; b < B; b++)
                    for (int64_t t = 0; t < len + T; t++)
                        for (int64_t j = 0; j < Hkv * D; j++) {
                            int64_t g = (b * (len + T) + t) * Hkv * D + j, w = (b * cap + t) * Hkv * D + j;
                            cr_assert(gk[g] == want_k[w] && gv[g] == want_v[w], "%s B=%d chunk %d: k[%lld,%lld,%lld]",
                                      tm_dtype_name(dts[d]), B, i, (long long)b, (long long)t, (long long)j);
                        }
                free(gk), free(gv);
                tm_ctx_arena_reset(ctx);
            }
            free(want_k), free(want_v);

            tm_kv_cache_reset(kc);
            int32_t tok[3] = {1, 2, 3};
            int64_t ts[2] = {B, 1};
            tm_tensor *td = NULL, *lg = NULL;
            TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, ts, tm_cuda(0), TM_I32, tok, &td));
            tm_status st = tm_model_forward_cached(m, kc, td, &lg);
            if (st != TM_OK) {
                cr_assert_eq(st, TM_ERR_UNSUPPORTED, "%s", tm_ctx_errmsg(ctx));
                cr_assert(strstr(tm_ctx_errmsg(ctx), "CUDA"), "%s", tm_ctx_errmsg(ctx));
                cr_assert_eq(tm_kv_cache_len(kc), 0);
            } else {
                cr_assert_eq(tm_kv_cache_len(kc), 1);
            }
            tm_ctx_arena_reset(ctx);
            tm_kv_cache_free(kc);
        }
        tm_model_free(m);
    }
    tm_ctx_free(ctx);
}
