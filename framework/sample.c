/*
 * sample.c — tm_sample_token: one token from a row of logits, by temperature, top-k (Fan et al.
 * 2018, "Hierarchical Neural Story Generation") and nucleus / top-p sampling (Holtzman et al.
 * 2020, "The Curious Case of Neural Text Degeneration"), in that order, as HuggingFace's
 * TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper chain does.
 *
 * The candidates are ranked once by (logit descending, index ascending): a strict total order,
 * so ties are broken towards lower indices everywhere (the top-k boundary, the nucleus
 * boundary, the inverse-CDF walk), and ranking by logit rather than by probability keeps two
 * different logits in their order even where their probabilities round to the same double.
 * The draw is one Philox4x32-10 output keyed by (seed, counter): no state, so a generation can
 * be replayed or resumed from any token.
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

/* "SMPL" as a little-endian word: the stream of sampling draws, apart from every tensor
 * initialisation stream (those put a name hash in words 2-3). */
#define TM__SAMPLE_STREAM 0x4c504d53u

#define BAD(...) tm__err(ctx, TM_ERR_INVALID_ARG, __VA_ARGS__)

tm_sampler_config tm_sampler_config_default(void) {
    tm_sampler_config c;
    c.temperature = 1.0;
    c.top_k = 0;
    c.top_p = 1.0;
    c.seed = 0;
    return c;
}

typedef struct cand {
    float logit;
    int index;
} cand;

static int by_rank(const void *pa, const void *pb) {
    const cand *a = pa, *b = pb;
    if (a->logit != b->logit) return a->logit > b->logit ? -1 : 1;
    return (a->index > b->index) - (a->index < b->index);
}

/* u in [0, 1) with 53 random bits: (out0 >> 5) * 2^26 + (out1 >> 6), over 2^53. */
static double uniform53(uint64_t seed, uint64_t counter) {
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t ctr[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), TM__SAMPLE_STREAM, 0}, o[4];
    tm_philox4x32_10(ctr, key, o);
    return ((double)(o[0] >> 5) * 67108864.0 + (double)(o[1] >> 6)) / 9007199254740992.0;
}

static tm_status sample_token(tm_ctx *ctx, const float *logits, int V, const tm_sampler_config *cfg,
                              uint64_t counter, int *token) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!logits || !cfg || !token)
        return BAD("tm_sample_token: %s is NULL", !logits ? "logits" : !cfg ? "cfg" : "token");
    if (V < 1) return BAD("tm_sample_token: V = %d must be >= 1", V);
    if (isnan(cfg->temperature)) return BAD("tm_sample_token: temperature is NaN");
    if (!(cfg->top_p > 0 && cfg->top_p <= 1)) return BAD("tm_sample_token: top_p = %g must be in (0, 1]", cfg->top_p);
    for (int i = 0; i < V; i++)
        if (isnan(logits[i])) return BAD("tm_sample_token: logits[%d] is NaN (V = %d)", i, V);

    if (cfg->temperature <= 0) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (logits[i] > logits[best]) best = i;
        *token = best;
        return TM_OK;
    }

    cand *c = tm__arena_alloc(ctx, tm_cpu(), sizeof *c * (size_t)V);
    double *p = tm__arena_alloc(ctx, tm_cpu(), sizeof *p * (size_t)V);
    if (!c || !p) return TM_ERR_NOMEM;
    for (int i = 0; i < V; i++) c[i] = (cand){logits[i], i};
    qsort(c, (size_t)V, sizeof *c, by_rank);
    int k = cfg->top_k <= 0 || cfg->top_k >= V ? V : cfg->top_k;

    /* Unnormalised probabilities exp((l - max) / T) of the top k. The limits of softmax stand
     * in where that expression is undefined: +inf logits share all the mass; all -inf is a
     * uniform distribution (every logit equal); -inf alone has none, even at T = +inf. */
    double mx = c[0].logit, T = cfg->temperature;
    for (int j = 0; j < k; j++) {
        double l = c[j].logit;
        if (isinf(mx)) p[j] = l == mx ? 1.0 : 0.0;
        else p[j] = isinf(l) ? 0.0 : exp((l - mx) / T);
    }
    double zk = 0;
    for (int j = 0; j < k; j++) zk += p[j];

    /* Nucleus: the shortest prefix of the ranking whose share of the top-k mass reaches top_p. */
    int n = k;
    double zn = zk;
    if (cfg->top_p < 1) {
        double acc = 0;
        for (int j = 0; j < k; j++) {
            acc += p[j];
            if (acc >= cfg->top_p * zk) {
                n = j + 1;
                zn = acc;
                break;
            }
        }
    }

    /* Inverse CDF in rank order. acc > target is strict, so a zero-probability candidate is
     * never the one returned; the summation order is the one zn was built with, so the walk
     * ends inside the prefix (the fallback only guards against that reasoning being wrong). */
    double target = uniform53(cfg->seed, counter) * zn, acc = 0;
    int pick = c[0].index;
    for (int j = 0; j < n; j++) {
        if (p[j] > 0) pick = c[j].index;
        acc += p[j];
        if (acc > target) break;
    }
    *token = pick;
    return TM_OK;
}

/* The candidate lists are arena scratch, given back on return. */
tm_status tm_sample_token(tm_ctx *ctx, const float *logits, int V, const tm_sampler_config *cfg, uint64_t counter,
                          int *token) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    int mark = tm__scope_open(ctx);
    tm_status s = sample_token(ctx, logits, V, cfg, counter, token);
    tm__scope_close(ctx, mark, NULL, 0);
    return s;
}
