/* test_sample.c — tm_sample_token (framework/sample.c): greedy and its ties, the documented
 * Philox draw reproduced bit for bit, determinism per (seed, counter), empirical frequencies
 * over 20000 counters against the closed-form distribution (temperature, top-k, top-p, alone
 * and combined, ties at the boundaries) within 5 binomial standard deviations, tokens outside
 * the top-k / nucleus never drawn, a nucleus cut computed by hand, infinite logits, and every
 * bad argument named. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static tm_sampler_config cfg(double temperature, int top_k, double top_p, uint64_t seed) {
    tm_sampler_config c = tm_sampler_config_default();
    c.temperature = temperature;
    c.top_k = top_k;
    c.top_p = top_p;
    c.seed = seed;
    return c;
}

static int draw(tm_ctx *ctx, const float *l, int V, const tm_sampler_config *c, uint64_t counter) {
    int tok = -1;
    TT_OK(ctx, tm_sample_token(ctx, l, V, c, counter, &tok));
    cr_assert(tok >= 0 && tok < V, "token %d outside [0, %d)", tok, V);
    return tok;
}

Test(sample, defaults) {
    tm_sampler_config c = tm_sampler_config_default();
    cr_assert_eq(c.temperature, 1.0);
    cr_assert_eq(c.top_k, 0);
    cr_assert_eq(c.top_p, 1.0);
    cr_assert_eq(c.seed, 0);
}

Test(sample, temperature_zero_is_argmax_with_ties_to_the_lowest_index) {
    tm_ctx *ctx = tt_ctx();
    float l[6] = {1, 5, -2, 5, 4.999f, 0};
    tm_sampler_config c = cfg(0, 0, 1, 9);
    for (uint64_t k = 0; k < 50; k++) cr_assert_eq(draw(ctx, l, 6, &c, k), 1);
    c.temperature = -1; /* any temperature <= 0 */
    cr_assert_eq(draw(ctx, l, 6, &c, 0), 1);
    float flat[4] = {2, 2, 2, 2};
    cr_assert_eq(draw(ctx, flat, 4, &c, 3), 0);
    float inf[4] = {-INFINITY, 3, INFINITY, INFINITY};
    cr_assert_eq(draw(ctx, inf, 4, &c, 3), 2);
    float one = 7;
    cr_assert_eq(draw(ctx, &one, 1, &c, 0), 0);
    tm_ctx_free(ctx);
}

Test(sample, top_k_one_is_argmax) {
    tm_ctx *ctx = tt_ctx();
    float l[6] = {1, 5, -2, 5, 4.999f, 0};
    tm_sampler_config c = cfg(3.0, 1, 1, 4);
    for (uint64_t k = 0; k < 500; k++) cr_assert_eq(draw(ctx, l, 6, &c, k), 1);
    tm_ctx_free(ctx);
}

/* The documented draw: u = ((out0 >> 5) 2^26 + (out1 >> 6)) / 2^53 of Philox4x32-10 with key
 * (seed lo, seed hi) and counter (counter lo, counter hi, 0x4c504d53, 0). Two equal logits:
 * token 0 iff u < 1/2; three with probabilities 1/4, 1/4, 1/2 ranked (2, 0, 1). */
Test(sample, the_draw_is_the_documented_philox_uniform) {
    tm_ctx *ctx = tt_ctx();
    float two[2] = {0.5f, 0.5f};
    float three[3] = {0, 0, (float)log(2.0)};
    uint64_t seed = 0x123456789abcdefull;
    tm_sampler_config c = cfg(1, 0, 1, seed);
    int seen[3] = {0, 0, 0};
    for (uint64_t k = 0; k < 400; k++) {
        uint64_t counter = k * 0x100000001ull; /* exercise the high word too */
        uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
        uint32_t ctr[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), 0x4c504d53u, 0}, o[4];
        tm_philox4x32_10(ctr, key, o);
        double u = ((double)(o[0] >> 5) * 67108864.0 + (double)(o[1] >> 6)) / 9007199254740992.0;
        cr_assert_eq(draw(ctx, two, 2, &c, counter), u < 0.5 ? 0 : 1, "counter %llu, u = %.17g",
                     (unsigned long long)counter, u);
        int want = u < 0.5 ? 2 : u < 0.75 ? 0 : 1;
        int got = draw(ctx, three, 3, &c, counter);
        cr_assert_eq(got, want, "counter %llu, u = %.17g", (unsigned long long)counter, u);
        seen[got]++;
        tm_ctx_arena_reset(ctx);
    }
    cr_assert(seen[0] && seen[1] && seen[2]);
    tm_ctx_free(ctx);
}

Test(sample, deterministic_per_seed_and_counter) {
    tm_ctx *ctx = tt_ctx();
    float l[8] = {0.1f, 0.3f, -0.2f, 0.8f, 0.0f, 0.5f, -1.0f, 0.2f};
    tm_sampler_config c = cfg(1.5, 0, 1, 77), c2 = cfg(1.5, 0, 1, 78);
    int a[300], diff_seed = 0;
    for (int k = 0; k < 300; k++) a[k] = draw(ctx, l, 8, &c, (uint64_t)k);
    /* Stateless: the same counters in reverse order give the same tokens. */
    for (int k = 299; k >= 0; k--) cr_assert_eq(draw(ctx, l, 8, &c, (uint64_t)k), a[k], "counter %d", k);
    for (int k = 0; k < 300; k++) diff_seed += draw(ctx, l, 8, &c2, (uint64_t)k) != a[k];
    cr_assert(diff_seed > 100, "seed 78 agrees with seed 77 on %d of 300 draws", 300 - diff_seed);
    tm_ctx_free(ctx);
}

/* The closed form, computed independently of the implementation's sort: p = softmax(l / T);
 * rank r_i = #{j : l_j > l_i or (l_j = l_i and j < i)}; top-k keeps r_i < k; the nucleus keeps
 * a top-k token when the top-k mass ranked strictly before it is below top_p times the top-k
 * mass; q = p renormalised over the kept set. */
static void closed_form(const float *l, int V, const tm_sampler_config *c, double *q) {
    double *p = malloc(sizeof(double) * (size_t)V), z = 0;
    int *r = malloc(sizeof(int) * (size_t)V);
    for (int i = 0; i < V; i++) z += p[i] = exp((double)l[i] / c->temperature);
    for (int i = 0; i < V; i++) {
        p[i] /= z;
        r[i] = 0;
        for (int j = 0; j < V; j++) r[i] += l[j] > l[i] || (l[j] == l[i] && j < i);
    }
    int k = c->top_k <= 0 || c->top_k > V ? V : c->top_k;
    double zk = 0, zq = 0;
    for (int i = 0; i < V; i++)
        if (r[i] < k) zk += p[i];
    for (int i = 0; i < V; i++) {
        double before = 0;
        for (int j = 0; j < V; j++)
            if (r[j] < r[i]) before += p[j];
        q[i] = r[i] < k && before < c->top_p * zk ? p[i] : 0;
        zq += q[i];
    }
    for (int i = 0; i < V; i++) q[i] /= zq;
    free(p);
    free(r);
}

/* N draws at counters 0..N-1; every count within 5 binomial sigma of N q, zero where q = 0. */
static void check_frequencies(const float *l, int V, tm_sampler_config c) {
    enum { N = 20000 };
    tm_ctx *ctx = tt_ctx();
    double q[64];
    closed_form(l, V, &c, q);
    int64_t n[64] = {0};
    for (uint64_t k = 0; k < N; k++) {
        n[draw(ctx, l, V, &c, k)]++;
        tm_ctx_arena_reset(ctx);
    }
    for (int i = 0; i < V; i++) {
        double mean = N * q[i], sd = sqrt(N * q[i] * (1 - q[i]));
        if (q[i] == 0) cr_assert_eq(n[i], 0, "token %d is outside the kept set but was drawn %lld times", i, (long long)n[i]);
        else
            cr_assert(fabs((double)n[i] - mean) <= 5 * sd, "token %d: %lld draws, expected %.1f +- %.1f (T %g, k %d, p %g)",
                      i, (long long)n[i], mean, sd, c.temperature, c.top_k, c.top_p);
    }
    tm_ctx_free(ctx);
}

static const float L8[8] = {0.1f, 1.3f, -0.7f, 0.8f, 0.0f, 1.1f, -1.5f, 0.45f};

Test(sample, frequencies_plain_softmax) { check_frequencies(L8, 8, cfg(1.0, 0, 1.0, 1)); }
Test(sample, frequencies_temperature) {
    check_frequencies(L8, 8, cfg(0.5, 0, 1.0, 2));
    check_frequencies(L8, 8, cfg(2.5, 0, 1.0, 3));
}
Test(sample, frequencies_top_k) {
    check_frequencies(L8, 8, cfg(1.0, 3, 1.0, 4));
    check_frequencies(L8, 8, cfg(1.0, 8, 1.0, 5)); /* k = V: all */
    check_frequencies(L8, 8, cfg(1.0, 50, 1.0, 5));
}
Test(sample, frequencies_top_p) {
    check_frequencies(L8, 8, cfg(1.0, 0, 0.6, 6));
    check_frequencies(L8, 8, cfg(1.0, 0, 0.95, 7));
}
Test(sample, frequencies_combined) {
    check_frequencies(L8, 8, cfg(0.8, 5, 0.7, 8));
    check_frequencies(L8, 8, cfg(1.7, 6, 0.9, 9));
}
/* Ties on the top-k boundary go to the lower index: logits 2 at {0, 2}, 1 at {1, 3, 4}; top 3
 * keeps 0, 2 and 1. */
Test(sample, frequencies_ties_at_the_top_k_boundary) {
    static const float tie[5] = {2, 1, 2, 1, 1};
    double q[5];
    tm_sampler_config c = cfg(1.0, 3, 1.0, 10);
    closed_form(tie, 5, &c, q);
    cr_assert(q[0] > 0 && q[1] > 0 && q[2] > 0 && q[3] == 0 && q[4] == 0);
    check_frequencies(tie, 5, c);
}

/* 50 random logits, top 5 at temperature 3 (a flat distribution over the 5): nothing else. */
Test(sample, tokens_outside_the_top_k_are_never_drawn) {
    tm_ctx *ctx = tt_ctx();
    float l[50];
    int rank5[50] = {0};
    for (int i = 0; i < 50; i++) l[i] = (float)sin(3.7 * i + 1.1);
    for (int i = 0; i < 50; i++) {
        int r = 0;
        for (int j = 0; j < 50; j++) r += l[j] > l[i];
        rank5[i] = r < 5;
    }
    tm_sampler_config c = cfg(3.0, 5, 1.0, 11);
    for (uint64_t k = 0; k < 5000; k++) {
        int t = draw(ctx, l, 50, &c, k);
        cr_assert(rank5[t], "token %d (logit %g) is not among the top 5", t, l[t]);
        tm_ctx_arena_reset(ctx);
    }
    tm_ctx_free(ctx);
}

/* Probabilities by index 0.1, 0.5, 0.05, 0.2, 0.15 (ranked 1, 3, 4, 0, 2). top_p 0.75: the
 * prefix 0.5, 0.7, 0.85 first reaches it at 3 tokens {1, 3, 4}; top_p 0.4: {1} alone. With
 * top_k 2 the top-k mass is 0.7 and top_p 0.7 is relative to it (0.49): {1} alone, whereas a
 * threshold on the whole mass (0.7) would keep {1, 3}. */
Test(sample, nucleus_cut_by_hand) {
    tm_ctx *ctx = tt_ctx();
    const double p[5] = {0.1, 0.5, 0.05, 0.2, 0.15};
    float l[5];
    for (int i = 0; i < 5; i++) l[i] = (float)log(p[i]);
    tm_sampler_config c = cfg(1.0, 0, 0.75, 12);
    int64_t n[5] = {0};
    enum { N = 20000 };
    for (uint64_t k = 0; k < N; k++) {
        n[draw(ctx, l, 5, &c, k)]++;
        tm_ctx_arena_reset(ctx);
    }
    cr_assert(n[0] == 0 && n[2] == 0, "tokens 0 and 2 lie outside the nucleus: drawn %lld, %lld times", (long long)n[0],
              (long long)n[2]);
    const double want[5] = {0, 0.5 / 0.85, 0, 0.2 / 0.85, 0.15 / 0.85};
    for (int i = 0; i < 5; i++) {
        double sd = sqrt(N * want[i] * (1 - want[i]));
        cr_assert(fabs((double)n[i] - N * want[i]) <= 5 * sd + 1e-9, "token %d: %lld draws, expected %.1f", i,
                  (long long)n[i], N * want[i]);
    }
    c.top_p = 0.4;
    for (uint64_t k = 0; k < 300; k++) cr_assert_eq(draw(ctx, l, 5, &c, k), 1);
    c = cfg(1.0, 2, 0.7, 13);
    for (uint64_t k = 0; k < 300; k++) cr_assert_eq(draw(ctx, l, 5, &c, k), 1, "top_p is relative to the top-k mass");
    c = cfg(1.0, 2, 0.8, 13); /* 0.56 of 0.7: {1, 3} */
    int saw3 = 0;
    for (uint64_t k = 0; k < 300; k++) {
        int t = draw(ctx, l, 5, &c, k);
        cr_assert(t == 1 || t == 3);
        saw3 |= t == 3;
    }
    cr_assert(saw3);
    tm_ctx_free(ctx);
}

/* +inf logits share the mass; -inf ones get none, even at an infinite temperature; all -inf:
 * uniform. */
Test(sample, infinite_logits_take_the_softmax_limits) {
    tm_ctx *ctx = tt_ctx();
    float a[4] = {-INFINITY, INFINITY, 0, INFINITY};
    float b[3] = {-INFINITY, -INFINITY, -INFINITY};
    float d[3] = {-INFINITY, 5, -3};
    tm_sampler_config c = cfg(1.0, 0, 1.0, 14), hot = cfg(INFINITY, 0, 1.0, 15);
    int na[4] = {0}, nb[3] = {0}, nd[3] = {0};
    for (uint64_t k = 0; k < 3000; k++) {
        na[draw(ctx, a, 4, &c, k)]++;
        nb[draw(ctx, b, 3, &c, k)]++;
        nd[draw(ctx, d, 3, &hot, k)]++;
        tm_ctx_arena_reset(ctx);
    }
    cr_assert(na[0] == 0 && na[2] == 0 && abs((int)(na[1] - na[3])) < 300, "%d %d %d %d", na[0], na[1], na[2], na[3]);
    for (int i = 0; i < 3; i++) cr_assert(abs(nb[i] - 1000) < 200, "all -inf: token %d drawn %d of 3000", i, nb[i]);
    cr_assert(nd[0] == 0 && abs(nd[1] - nd[2]) < 300, "T = inf: %d %d %d", nd[0], nd[1], nd[2]);
    tm_ctx_free(ctx);
}

Test(sample, bad_arguments_are_named) {
    tm_ctx *ctx = tt_ctx();
    float l[4] = {0, 1, NAN, 2};
    float ok[4] = {0, 1, 3, 2};
    tm_sampler_config c = cfg(1.0, 0, 1.0, 0);
    int tok = -7;
    cr_assert_eq(tm_sample_token(ctx, l, 4, &c, 0, &tok), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "logits[2] is NaN"), "%s", tm_ctx_errmsg(ctx));
    c.temperature = 0; /* greedy too */
    cr_assert_eq(tm_sample_token(ctx, l, 4, &c, 0, &tok), TM_ERR_INVALID_ARG);
    c.temperature = NAN;
    cr_assert_eq(tm_sample_token(ctx, ok, 4, &c, 0, &tok), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "temperature is NaN"), "%s", tm_ctx_errmsg(ctx));
    c.temperature = 1;
    const double bad_p[3] = {0, 1.5, NAN};
    const char *name[3] = {"top_p = 0 ", "top_p = 1.5", "top_p = nan"};
    for (int i = 0; i < 3; i++) {
        c.top_p = bad_p[i];
        cr_assert_eq(tm_sample_token(ctx, ok, 4, &c, 0, &tok), TM_ERR_INVALID_ARG);
        cr_assert(strstr(tm_ctx_errmsg(ctx), name[i]), "%s", tm_ctx_errmsg(ctx));
    }
    c.top_p = 1;
    cr_assert_eq(tm_sample_token(ctx, ok, 0, &c, 0, &tok), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "V = 0"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_sample_token(ctx, NULL, 4, &c, 0, &tok), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "logits is NULL"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_sample_token(ctx, ok, 4, NULL, 0, &tok), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "cfg is NULL"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_sample_token(ctx, ok, 4, &c, 0, NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "token is NULL"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_sample_token(NULL, ok, 4, &c, 0, &tok), TM_ERR_INVALID_ARG);
    cr_assert_eq(tok, -7, "token written on failure");
    tm_ctx_free(ctx);
}
