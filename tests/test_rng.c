/* test_rng.c — Philox4x32-10 known answers and the (seed, name, index) contract. */
#include <math.h>
#include <stdlib.h>

#include "common.h"

/* Known-answer vectors of Random123 (kat_vectors: philox4x32 10 rounds). */
Test(rng, philox_known_answers) {
    struct {
        uint32_t ctr[4], key[2], out[4];
    } kat[3] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}, {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}, {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (int k = 0; k < 3; k++) {
        uint32_t out[4];
        tm_philox4x32_10(kat[k].ctr, kat[k].key, out);
        for (int i = 0; i < 4; i++) cr_assert_eq(out[i], kat[k].out[i], "vector %d word %d: %08x != %08x", k, i, out[i], kat[k].out[i]);
    }
}

Test(rng, fnv1a) {
    cr_assert_eq(tm_hash_name(""), 0xcbf29ce484222325ull);
    cr_assert_eq(tm_hash_name("a"), 0xaf63dc4c8601ec8cull);
}

Test(rng, keyed_by_seed_name_and_index) {
    tm_ctx *ctx = tt_ctx();
    int64_t n = 1000, half = 500;
    tm_tensor *a, *b, *c, *d, *h;
    TT_OK(ctx, tm_param_new(ctx, "layers.0.w", TM_F32, 1, &n, tm_cpu(), &a));
    TT_OK(ctx, tm_param_new(ctx, "layers.1.w", TM_F32, 1, &n, tm_cpu(), &b));
    TT_OK(ctx, tm_tensor_empty(ctx, TM_F32, 1, &n, tm_cpu(), &c));
    TT_OK(ctx, tm_tensor_empty(ctx, TM_F64, 1, &n, tm_cpu(), &d));
    TT_OK(ctx, tm_tensor_empty(ctx, TM_F32, 1, &half, tm_cpu(), &h));
    TT_OK(ctx, tm_tensor_init_normal(ctx, a, 42, NULL, 0, 0.02));
    TT_OK(ctx, tm_tensor_init_normal(ctx, b, 42, NULL, 0, 0.02));
    TT_OK(ctx, tm_tensor_init_normal(ctx, c, 42, "layers.0.w", 0, 0.02));
    TT_OK(ctx, tm_tensor_init_normal(ctx, d, 42, "layers.0.w", 0, 0.02));
    TT_OK(ctx, tm_tensor_init_normal(ctx, h, 42, "layers.0.w", 0, 0.02));
    double *va = tt_read(ctx, a), *vb = tt_read(ctx, b), *vc = tt_read(ctx, c), *vd = tt_read(ctx, d), *vh = tt_read(ctx, h);
    int same_ab = 0;
    for (int i = 0; i < n; i++) {
        cr_assert_eq(va[i], vc[i], "same (seed, name, index) -> same value");
        cr_assert_eq((float)vd[i], (float)va[i], "f64 draw rounds to the f32 draw");
        same_ab += va[i] == vb[i];
    }
    for (int i = 0; i < half; i++) cr_assert_eq(vh[i], va[i], "a shorter tensor is a prefix (layout independence)");
    cr_assert_lt(same_ab, 3);
    free(va); free(vb); free(vc); free(vd); free(vh);
    tm_tensor *anon;
    TT_OK(ctx, tm_tensor_empty(ctx, TM_F32, 1, &n, tm_cpu(), &anon));
    cr_assert_eq(tm_tensor_init_normal(ctx, anon, 1, NULL, 0, 1), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_tensor_init_normal(ctx, a, 1, NULL, 0, -1), TM_ERR_INVALID_ARG);
    tm_ctx_free(ctx);
}

Test(rng, normal_and_uniform_moments) {
    tm_ctx *ctx = tt_ctx();
    int64_t n = 200000;
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_empty(ctx, TM_F64, 1, &n, tm_cpu(), &t));
    TT_OK(ctx, tm_tensor_init_normal(ctx, t, 5, "x", 1.5, 2.0));
    double *v = tt_read(ctx, t), m = 0, s = 0;
    for (int64_t i = 0; i < n; i++) m += v[i];
    m /= n;
    for (int64_t i = 0; i < n; i++) s += (v[i] - m) * (v[i] - m);
    s = sqrt(s / (n - 1));
    /* standard errors: 2/sqrt(n) = 0.0045 for the mean, ~0.0032 for the std */
    cr_assert(fabs(m - 1.5) < 0.02 && fabs(s - 2.0) < 0.015, "mean %g std %g", m, s);
    free(v);
    TT_OK(ctx, tm_tensor_init_uniform(ctx, t, 5, "x", -1, 3));
    v = tt_read(ctx, t);
    double lo = 1e9, hi = -1e9;
    m = 0;
    for (int64_t i = 0; i < n; i++) {
        m += v[i];
        lo = fmin(lo, v[i]);
        hi = fmax(hi, v[i]);
    }
    m /= n;
    cr_assert(lo >= -1 && hi < 3 && fabs(m - 1) < 0.02, "lo %g hi %g mean %g", lo, hi, m);
    free(v);
    tm_ctx_free(ctx);
}
