/* test_presets.c — the GPU benchmark presets of `tinymoe train` (coarse, fine; bench/train_gpu.sh,
 * docs/PERFORMANCE.md): they parse to the sizes issue 12 gives, pass the library's model checks,
 * and the model they build has the parameter counts of the closed form below, total and active
 * per token. Those counts feed the MFU of the benchmark (6 x active parameters per token).
 *
 * Closed form, for an untied Mixtral-style model with every layer MoE and no shared expert
 * (tinymoe.h, tm_model_config; D = H / n_heads):
 *   total  = 2 V H + H                                     embedding, lm_head, final norm
 *          + L (2 H + H^2 + 2 H (Hkv D) + H^2              norms, wq, wk, wv, wo
 *               + H E + 3 E H F)                           router gate, routed experts
 *   active = total - L 3 (E - k) H F                       a token meets k of the E experts
 * The full-size counts are checked against the driver's own count (tmd_footprint, which sizes
 * the memory a run needs). The library's count (tm_model_num_params, the sum of the tensors it
 * makes) is checked on the preset's model cut to one layer and a 256-token vocabulary, built on
 * the CPU in bf16 and never initialised: every width of the preset, at 0.2 to 0.4 GB rather
 * than the 2 to 3.6 GB (parameters and gradients) of the whole model; a model's count is
 * linear in n_layers and vocab_size. */
#include <string.h>

#include "common.h"
#include "config.h"
#include "footprint.h"

typedef struct spec {
    const char *name;
    int64_t H, L, heads, kv, E, k, F, V, seq, batch;
    int64_t total, active; /* the closed form, worked out by hand */
} spec;

static int64_t closed_total(const spec *s, int64_t L, int64_t V) {
    int64_t D = s->H / s->heads;
    return 2 * V * s->H + s->H +
           L * (2 * s->H + s->H * s->H + 2 * s->H * (s->kv * D) + s->H * s->H + s->H * s->E + 3 * s->E * s->H * s->F);
}
static int64_t closed_active(const spec *s, int64_t L, int64_t V) {
    return closed_total(s, L, V) - L * 3 * (s->E - s->k) * s->H * s->F;
}

static const spec SPECS[] = {
    {"coarse", 768, 12, 12, 4, 8, 2, 2048, 32768, 1024, 16, 522283776, 182545152},
    {"fine", 1024, 8, 16, 4, 64, 6, 512, 32768, 1024, 16, 893928448, 164119552},
};

Test(presets, gpu_benchmark_models_parse_and_count) {
    TT_WATCHDOG(120);
    for (size_t i = 0; i < sizeof SPECS / sizeof SPECS[0]; i++) {
        const spec *s = &SPECS[i];
        int64_t total = closed_total(s, s->L, s->V), active = closed_active(s, s->L, s->V);
        cr_assert_eq(total, s->total, "%s: the closed form gives %lld", s->name, (long long)total);
        cr_assert_eq(active, s->active, "%s: the closed form gives %lld", s->name, (long long)active);

        tmd_config c;
        char err[1024] = "";
        int help = 0;
        char *argv[] = {"--preset", (char *)s->name};
        cr_assert_eq(tmd_config_from_args(&c, 2, argv, &help, err, sizeof err), 0, "%s: %s", s->name, err);
        tmd_config_resolve(&c);
        cr_assert_str_eq(c.preset, s->name);
        const tm_model_config *m = &c.model;
        cr_assert_eq(m->d_model, s->H, "%s d_model", s->name);
        cr_assert_eq(m->n_layers, s->L, "%s n_layers", s->name);
        cr_assert_eq(m->n_heads, s->heads, "%s n_heads", s->name);
        cr_assert_eq(m->n_kv_heads, s->kv, "%s n_kv_heads", s->name);
        cr_assert_eq(m->moe.router.num_experts, s->E, "%s num_experts", s->name);
        cr_assert_eq(m->moe.router.topk, s->k, "%s topk", s->name);
        cr_assert_eq(m->moe.ffn_size, s->F, "%s expert_ffn_size", s->name);
        cr_assert_eq(m->vocab_size, s->V, "%s vocab_size", s->name);
        cr_assert_eq(m->max_seq_len, s->seq, "%s seq_len", s->name);
        cr_assert_eq(c.batch_size, s->batch, "%s batch_size", s->name);
        cr_assert_eq(m->first_k_dense, 0);
        cr_assert_eq(m->tie_embeddings, 0);
        cr_assert_eq(m->moe.shared_ffn_size, 0);
        cr_assert(m->moe.router.norm_topk_prob && m->moe.router.use_pre_softmax &&
                      m->moe.router.score_function == TM_SCORE_SOFTMAX,
                  "%s: softmax top-k with renormalised weights", s->name);
        cr_assert_eq(tm_model_config_check(NULL, m), TM_OK, "%s: the library refuses the model", s->name);

        /* The driver's own count (its memory estimate) agrees. */
        double params = 0, bytes = 0;
        tmd_footprint(&c, &params, &bytes);
        cr_assert_eq((int64_t)params, s->total, "%s: tmd_footprint counts %.0f", s->name, params);

        /* And the model the library builds, one layer and 256 tokens of it. */
        tm_model_config cut = *m;
        cut.n_layers = 1;
        cut.vocab_size = 256;
        tm_ctx *ctx = tt_ctx();
        tm_model *model = NULL;
        TT_OK(ctx, tm_model_new(ctx, &cut, TM_BF16, tm_cpu(), &model));
        int64_t lib_active = 0, lib_total = tm_model_num_params(model, &lib_active);
        cr_assert_eq(lib_total, closed_total(s, 1, 256), "%s: tm_model_num_params %lld, closed form %lld", s->name,
                     (long long)lib_total, (long long)closed_total(s, 1, 256));
        cr_assert_eq(lib_active, closed_active(s, 1, 256), "%s: active per token %lld, closed form %lld", s->name,
                     (long long)lib_active, (long long)closed_active(s, 1, 256));
        tm_model_free(model);
        tm_ctx_free(ctx);
    }
}

/* Both are listed by --help and by the preset key's error message. */
Test(presets, gpu_benchmark_models_are_listed) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    tmd_config_help(f);
    fclose(f);
    cr_assert(strstr(buf, "\n  coarse ") && strstr(buf, "\n  fine "), "--help lists the presets");
    cr_assert(strstr(buf, "522M parameters, 183M active") && strstr(buf, "894M parameters, 164M active"),
              "the help text states the counts checked above");
    free(buf);
    tmd_config c;
    char err[1024] = "";
    int help = 0;
    char *argv[] = {"--preset", "huge"};
    cr_assert_eq(tmd_config_from_args(&c, 2, argv, &help, err, sizeof err), -1);
    cr_assert(strstr(err, "coarse|fine"), "%s", err);
}
