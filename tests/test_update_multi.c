/*
 * test_update_multi.c — the fused update ops over segment lists (framework/ops/update.c,
 * "fused updates"; kernels/cpu/update.c) on the CPU: adamw_update_multi gives bit for bit what
 * one tm_adamw_update per range gives (f32, f64 and bf16 with and without master weights, in one
 * list, with per-range weight decay and state offsets), grad_sumsq_multi the partials of
 * tm_grad_sumsq per range and the factor of tm_ctx_clip_grad_norm's rule, grad_scale_multi what
 * tm_grad_scale gives (and nothing at factor 1); a list whose ranges move is uploaded again; bad
 * ranges are refused; the clip waits for the device only when asked for the norm; the public
 * tm_grad_sumsq, tm_grad_scale and tm_adamw_update, which run these ops over one range. The CUDA
 * kernels' parity: tests/test_cuda_parity_update.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "extend.h"

/* Two "buckets" of flat tensors: f32 or f64 parameters without master (state offset 0), and
 * bf16 parameters with f32 master weights whose state and master start at element OFF1 (a
 * ZeRO-1 block). */
enum { N0 = 9000, N1 = 7001, OFF1 = 64 };

typedef struct group {
    tm_tensor *P, *G, *m, *v, *master;
    int64_t off;
} group;

typedef struct side {
    group g[2];
} side;

static tm_tensor *host_tensor(tm_ctx *ctx, tm_dtype dt, int64_t n, const double *v) {
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 1, &n, tm_cpu(), TM_F64, v, &t));
    return t;
}

static double *uniform(int64_t n, uint64_t seed, double scale) {
    double *v = malloc(sizeof *v * (size_t)n);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = scale * ((double)(s >> 11) / 9007199254740992.0 * 4.0 - 2.0);
    }
    return v;
}

static void make_side(tm_ctx *ctx, tm_dtype dt0, side *sd) {
    const tm_dtype dts[2] = {dt0, TM_BF16};
    const int64_t ns[2] = {N0, N1}, offs[2] = {0, OFF1};
    for (int k = 0; k < 2; k++) {
        group *g = &sd->g[k];
        int64_t n = ns[k], ns_ = n - offs[k];
        double *p = uniform(n, 10 + (uint64_t)k, 1.0), *z = calloc((size_t)n, sizeof *z);
        if (k == 1) /* the master starts as the bf16 parameter widened, as tm__bucket_master_ensure makes it */
            for (int64_t i = 0; i < n; i++) {
                float f = (float)p[i];
                uint32_t u;
                memcpy(&u, &f, 4);
                u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
                memcpy(&f, &u, 4);
                p[i] = f;
            }
        g->P = host_tensor(ctx, dts[k], n, p);
        g->G = host_tensor(ctx, dts[k], n, z);
        g->m = host_tensor(ctx, TM_F32, ns_, z);
        g->v = host_tensor(ctx, TM_F32, ns_, z);
        g->master = k == 1 ? host_tensor(ctx, TM_F32, ns_, p + offs[k]) : NULL;
        g->off = offs[k];
        free(p), free(z);
    }
}

/* Step t's gradients, of assorted scales (some tiny: the sqrt(v) + eps path). */
static void set_grads(tm_ctx *ctx, side *sd, int t) {
    const int64_t ns[2] = {N0, N1};
    for (int k = 0; k < 2; k++) {
        double *h = uniform(ns[k], 100 + 7 * (uint64_t)t + (uint64_t)k, 1.0);
        for (int64_t i = 0; i < ns[k]; i++) h[i] *= (i % 7 == 0) ? 1e-6 : (i % 3 == 0 ? 30.0 : 1.0);
        TT_OK(ctx, tm_tensor_write(ctx, sd->g[k].G, TM_F64, h, ns[k]));
        free(h);
    }
}

typedef struct range {
    int group;
    int64_t a, e;
    double wd;
} range;

/* Decay runs as the optimizer cuts them, an empty one among them. */
static const range RANGES[] = {
    {0, 0, 1000, 0.1}, {0, 1000, 1003, 0.0}, {0, 1003, 1003, 0.0}, {0, 1003, N0, 0.1},
    {1, OFF1, 5000, 0.0}, {1, 5000, N1, 0.05},
};
enum { N_RANGES = sizeof RANGES / sizeof RANGES[0] };

static void slice(tm_ctx *ctx, tm_tensor *t, int64_t a, int64_t e, tm_tensor **out) {
    TT_OK(ctx, tm_slice(ctx, t, 0, a, e, out));
}

/* One tm_adamw_update per range (the reference). */
static void adamw_per_range(tm_ctx *ctx, side *sd, const tm_adamw_config *cfg, double lr, int64_t t) {
    for (int r = 0; r < N_RANGES; r++) {
        const range *q = &RANGES[r];
        group *g = &sd->g[q->group];
        if (q->a == q->e) continue;
        tm_tensor *p, *gr, *m, *v, *ms = NULL;
        slice(ctx, g->P, q->a, q->e, &p);
        slice(ctx, g->G, q->a, q->e, &gr);
        slice(ctx, g->m, q->a - g->off, q->e - g->off, &m);
        slice(ctx, g->v, q->a - g->off, q->e - g->off, &v);
        if (g->master) slice(ctx, g->master, q->a - g->off, q->e - g->off, &ms);
        TT_OK(ctx, tm_adamw_update(ctx, p, gr, m, v, ms, cfg, lr, q->wd, t));
    }
}

static void adamw_fused(tm_ctx *ctx, tm__segs *l, side *sd, const tm_adamw_config *cfg, double lr, int64_t t) {
    TT_OK(ctx, tm__segs_begin(ctx, l, TM__SEGS_ADAMW, N_RANGES));
    for (int r = 0; r < N_RANGES; r++) {
        const range *q = &RANGES[r];
        group *g = &sd->g[q->group];
        TT_OK(ctx, tm__segs_add_adamw(ctx, l, g->P, g->G, g->m, g->v, g->master, q->a, q->e, g->off, 0, 0, q->wd));
    }
    cr_assert_eq(tm__segs_count(l), N_RANGES - 1, "the empty range is left out");
    TT_OK(ctx, tm__adamw_update_multi(ctx, l, cfg, lr, t, NULL));
}

/* Bitwise equality of two tensors' bytes (read in their own dtype). */
static void assert_bitwise(tm_ctx *ctx, const tm_tensor *a, const tm_tensor *b, const char *what) {
    int64_t n = tm_tensor_numel(a);
    tm_dtype dt = tm_tensor_dtype(a);
    size_t nb = (size_t)n * tm_dtype_size(dt);
    void *x = malloc(nb ? nb : 1), *y = malloc(nb ? nb : 1);
    TT_OK(ctx, tm_tensor_read(ctx, a, dt, x, n));
    TT_OK(ctx, tm_tensor_read(ctx, b, dt, y, n));
    int64_t bad = -1;
    size_t es = tm_dtype_size(dt);
    for (int64_t i = 0; i < n && bad < 0; i++)
        if (memcmp((char *)x + (size_t)i * es, (char *)y + (size_t)i * es, es)) bad = i;
    cr_assert(bad < 0, "%s differs at element %lld", what, (long long)bad);
    free(x), free(y);
}

static void assert_sides_equal(tm_ctx *ctx, side *a, side *b) {
    for (int k = 0; k < 2; k++) {
        assert_bitwise(ctx, a->g[k].P, b->g[k].P, k ? "bf16 parameters" : "parameters");
        assert_bitwise(ctx, a->g[k].m, b->g[k].m, "m");
        assert_bitwise(ctx, a->g[k].v, b->g[k].v, "v");
        if (a->g[k].master) assert_bitwise(ctx, a->g[k].master, b->g[k].master, "master");
    }
}

static void adamw_bitwise(tm_dtype dt0) {
    tm_ctx *ctx = tt_ctx();
    side ref, fus;
    make_side(ctx, dt0, &ref);
    make_side(ctx, dt0, &fus);
    tm__segs *l = NULL;
    TT_OK(ctx, tm__segs_new(ctx, "test", tm_cpu(), 2, &l)); /* grows to N_RANGES at begin */
    tm_adamw_config cfg = tm_adamw_config_default();
    cfg.beta2 = 0.95;
    for (int t = 1; t <= 4; t++) {
        set_grads(ctx, &ref, t);
        set_grads(ctx, &fus, t);
        adamw_per_range(ctx, &ref, &cfg, 3e-3 * t, t);
        adamw_fused(ctx, l, &fus, &cfg, 3e-3 * t, t);
    }
    assert_sides_equal(ctx, &ref, &fus);
    tm__segs_free(ctx, l);
    tm_ctx_free(ctx);
}

Test(update_multi, adamw_is_bitwise_the_per_range_update_f32) { adamw_bitwise(TM_F32); }
Test(update_multi, adamw_is_bitwise_the_per_range_update_f64) { adamw_bitwise(TM_F64); }

/* The table follows tensors that move: a second side through the same list. */
Test(update_multi, adamw_list_follows_moved_tensors) {
    tm_ctx *ctx = tt_ctx();
    side ref, a, b;
    make_side(ctx, TM_F32, &ref);
    make_side(ctx, TM_F32, &a);
    make_side(ctx, TM_F32, &b);
    tm__segs *l = NULL;
    TT_OK(ctx, tm__segs_new(ctx, "test", tm_cpu(), N_RANGES, &l));
    tm_adamw_config cfg = tm_adamw_config_default();
    for (int t = 1; t <= 2; t++) {
        set_grads(ctx, &ref, t);
        set_grads(ctx, &a, t);
        set_grads(ctx, &b, t);
        adamw_per_range(ctx, &ref, &cfg, 1e-2, t);
        adamw_fused(ctx, l, &a, &cfg, 1e-2, t);
        adamw_fused(ctx, l, &b, &cfg, 1e-2, t);
    }
    assert_sides_equal(ctx, &ref, &a);
    assert_sides_equal(ctx, &ref, &b);
    tm__segs_free(ctx, l);
    tm_ctx_free(ctx);
}

/* ---- the clip's two ops ----------------------------------------------------------------------- */

static void clip_ops(tm_dtype dt0, double max_norm) {
    tm_ctx *ctx = tt_ctx();
    side ref, fus;
    make_side(ctx, dt0, &ref);
    make_side(ctx, dt0, &fus);
    set_grads(ctx, &ref, 3);
    set_grads(ctx, &fus, 3);
    tm__segs *l = NULL;
    TT_OK(ctx, tm__segs_new(ctx, "test", tm_cpu(), 1, &l));
    TT_OK(ctx, tm__segs_begin(ctx, l, TM__SEGS_GRADS, 3));
    TT_OK(ctx, tm__segs_add_grad(ctx, l, fus.g[0].G, 0, N0));
    TT_OK(ctx, tm__segs_add_grad(ctx, l, fus.g[1].G, 5, 5)); /* empty: left out */
    TT_OK(ctx, tm__segs_add_grad(ctx, l, fus.g[1].G, OFF1, N1));
    cr_assert_eq(tm__segs_count(l), 2);
    tm_tensor *part, *factor;
    uint64_t before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm__grad_sumsq_multi(ctx, l, max_norm, &part, &factor));
    TT_OK(ctx, tm__grad_scale_multi(ctx, l, factor));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "the fused clip read something back");
    cr_assert_eq(tm_tensor_dtype(part), TM_F64);
    cr_assert_eq(tm_tensor_numel(part), 2);
    cr_assert_eq(tm_tensor_ndim(factor), 0);
    /* the reference: grad_sumsq per range, the host's rule, grad_scale per range */
    tm_tensor *g1, *s0, *s1;
    slice(ctx, ref.g[1].G, OFF1, N1, &g1);
    TT_OK(ctx, tm_grad_sumsq(ctx, ref.g[0].G, &s0));
    TT_OK(ctx, tm_grad_sumsq(ctx, g1, &s1));
    double want[2], got[2], f;
    TT_OK(ctx, tm_tensor_read(ctx, s0, TM_F64, &want[0], 1));
    TT_OK(ctx, tm_tensor_read(ctx, s1, TM_F64, &want[1], 1));
    TT_OK(ctx, tm_tensor_read(ctx, part, TM_F64, got, 2));
    TT_OK(ctx, tm_tensor_read(ctx, factor, TM_F64, &f, 1));
    cr_assert(memcmp(want, got, sizeof want) == 0, "partials %.17g %.17g, grad_sumsq %.17g %.17g", got[0], got[1],
              want[0], want[1]);
    double norm = sqrt(0.0 + want[0] + want[1]);
    double wf = max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
    cr_assert(f == wf, "factor %.17g, want %.17g (norm %.17g)", f, wf, norm);
    if (wf != 1.0) {
        TT_OK(ctx, tm_grad_scale(ctx, ref.g[0].G, wf));
        TT_OK(ctx, tm_grad_scale(ctx, g1, wf));
    }
    assert_bitwise(ctx, ref.g[0].G, fus.g[0].G, "scaled gradients");
    assert_bitwise(ctx, ref.g[1].G, fus.g[1].G, "scaled bf16 gradients (elements before OFF1 untouched)");
    tm__segs_free(ctx, l);
    tm_ctx_free(ctx);
}

Test(update_multi, clip_ops_scale_f32) { clip_ops(TM_F32, 5.0); }
Test(update_multi, clip_ops_scale_f64) { clip_ops(TM_F64, 5.0); }
Test(update_multi, clip_ops_below_max_norm_leave_the_gradients) { clip_ops(TM_F32, 1e9); }
Test(update_multi, clip_ops_max_norm_0_measures_only) { clip_ops(TM_F32, 0.0); }

Test(update_multi, bad_ranges_are_refused) {
    tm_ctx *ctx = tt_ctx();
    side sd;
    make_side(ctx, TM_F32, &sd);
    group *g = &sd.g[0];
    tm__segs *l = NULL;
    TT_OK(ctx, tm__segs_new(ctx, "test", tm_cpu(), 2, &l));
    TT_OK(ctx, tm__segs_begin(ctx, l, TM__SEGS_ADAMW, 1));
    cr_assert_eq(tm__segs_add_adamw(ctx, l, g->P, g->G, g->m, g->v, NULL, 0, N0 + 1, 0, 0, 0, 0.0), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "outside"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm__segs_add_adamw(ctx, l, g->P, sd.g[1].G, g->m, g->v, NULL, 0, 10, 0, 0, 0, 0.0), TM_ERR_DTYPE);
    cr_assert_eq(tm__segs_add_adamw(ctx, l, g->P, g->G, g->m, g->v, NULL, 10, 5, 0, 0, 0, 0.0), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm__segs_add_adamw(ctx, l, g->P, g->G, g->m, g->v, NULL, 5, 10, 6, 0, 0, 0.0), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm__segs_add_adamw(ctx, l, g->P, g->G, g->m, g->v, NULL, 5, 10, 0, 6, 0, 0.0), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "gradient offset 6"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm__segs_add_adamw(ctx, l, g->P, g->G, g->m, g->v, NULL, 5, 10, 0, 0, 6, 0.0), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "parameter offset 6"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm__segs_add_grad(ctx, l, g->G, 0, 10), TM_ERR_INVALID_ARG, "a gradient range in an AdamW list");
    TT_OK(ctx, tm__segs_add_adamw(ctx, l, g->P, g->G, g->m, g->v, NULL, 0, 10, 0, 0, 0, 0.0));
    cr_assert_eq(tm__segs_add_adamw(ctx, l, g->P, g->G, g->m, g->v, NULL, 10, 20, 0, 0, 0, 0.0), TM_ERR_INVALID_ARG,
                 "more ranges than announced");
    cr_assert_eq(tm__segs_count(l), 1, "nothing was added by the refused calls");
    tm_tensor *part, *factor;
    cr_assert_eq(tm__grad_sumsq_multi(ctx, l, 1.0, &part, &factor), TM_ERR_INVALID_ARG, "an AdamW list");
    tm__segs_free(ctx, l);
    tm_ctx_free(ctx);
}

/* The clip reads the partials back only for norm_out (the CPU counts that read). */
Test(update_multi, clip_waits_only_for_the_norm) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {37, 29};
    tm_tensor *p;
    TT_OK(ctx, tm_param_new(ctx, "w", TM_F32, 2, s, tm_cpu(), &p));
    TT_OK(ctx, tm_tensor_fill(ctx, tm_tensor_grad(p), 1.0));
    uint64_t before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, NULL));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "a clip without norm_out waited");
    double norm = 0;
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, &norm));
    cr_assert_eq(tm_ctx_sync_count(ctx) - before, 1, "one read for the norm");
    cr_assert(fabs(norm - 1.0 / (sqrt(37.0 * 29.0) + 1e-6) * sqrt(37.0 * 29.0)) < 1e-6, "norm after clipping %g", norm);
    tm_ctx_free(ctx);
}

/* ---- the public single-tensor functions: one range of the same ops -------------------------- */

static tm_tensor *vec(tm_ctx *ctx, tm_dtype dt, int64_t n, const double *v) {
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 1, &n, tm_cpu(), TM_F64, v, &t));
    return t;
}

/* tm_grad_sumsq, tm_grad_scale and tm_adamw_update run the table ops over one range: their
 * values, empty tensors, and the checks their front ends make (the ops themselves only check
 * the table). */
Test(update_multi, single_tensor_functions_are_one_range) {
    tm_ctx *ctx = tt_ctx();
    const double x5[5] = {1, 2, 3, 4, 5};
    tm_tensor *g = vec(ctx, TM_F32, 5, x5), *s;
    TT_OK(ctx, tm_grad_sumsq(ctx, g, &s));
    double v = 0, got[5];
    cr_assert_eq(tm_tensor_ndim(s), 0);
    cr_assert_eq(tm_tensor_dtype(s), TM_F64);
    TT_OK(ctx, tm_tensor_read(ctx, s, TM_F64, &v, 1));
    cr_assert(v == 55.0, "sum of squares %g", v);
    TT_OK(ctx, tm_grad_scale(ctx, g, 0.5));
    TT_OK(ctx, tm_tensor_read(ctx, g, TM_F64, got, 5));
    for (int i = 0; i < 5; i++) cr_assert(got[i] == 0.5 * x5[i], "scaled[%d] = %g", i, got[i]);
    TT_OK(ctx, tm_grad_scale(ctx, g, 1.0));
    TT_OK(ctx, tm_tensor_read(ctx, g, TM_F64, got, 5));
    cr_assert(got[4] == 2.5, "scale 1 changes nothing");
    /* empty */
    tm_tensor *e = vec(ctx, TM_F32, 0, x5);
    TT_OK(ctx, tm_grad_sumsq(ctx, e, &s));
    TT_OK(ctx, tm_tensor_read(ctx, s, TM_F64, &v, 1));
    cr_assert(v == 0.0);
    TT_OK(ctx, tm_grad_scale(ctx, e, 3.0));
    /* AdamW, first step from zero state: m = (1 - b1) g, v = (1 - b2) g^2, so the bias-corrected
     * step is g / (|g| + eps) = 1 (to eps) and p moves by lr. */
    const double one[1] = {1}, two[1] = {2}, zero[1] = {0};
    tm_tensor *p = vec(ctx, TM_F32, 1, one), *gr = vec(ctx, TM_F32, 1, two), *m = vec(ctx, TM_F32, 1, zero),
              *vv = vec(ctx, TM_F32, 1, zero);
    tm_adamw_config cfg = tm_adamw_config_default();
    TT_OK(ctx, tm_adamw_update(ctx, p, gr, m, vv, NULL, &cfg, 0.1, 0.0, 1));
    TT_OK(ctx, tm_tensor_read(ctx, p, TM_F64, &v, 1));
    cr_assert(fabs(v - 0.9) < 1e-6, "p = %.9g", v);
    TT_OK(ctx, tm_tensor_read(ctx, m, TM_F64, &v, 1));
    cr_assert(fabs(v - 0.2) < 1e-7, "m = %.9g", v);
    /* the checks */
    cr_assert_eq(tm_grad_sumsq(ctx, NULL, &s), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_grad_sumsq(ctx, g, NULL), TM_ERR_INVALID_ARG);
    int64_t two_n = 2;
    tm_tensor *ints;
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_I64, 1, &two_n, tm_cpu(), &ints));
    cr_assert_eq(tm_grad_sumsq(ctx, ints, &s), TM_ERR_DTYPE);
    cr_assert_eq(tm_grad_scale(ctx, ints, 2.0), TM_ERR_DTYPE);
    cr_assert_eq(tm_grad_scale(ctx, g, NAN), TM_ERR_INVALID_ARG);
    tm_tensor *m2 = vec(ctx, TM_F32, 2, x5), *m64 = vec(ctx, TM_F64, 1, zero);
    cr_assert_eq(tm_adamw_update(ctx, p, gr, m2, vv, NULL, &cfg, 0.1, 0.0, 2), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "adamw_update: m"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_adamw_update(ctx, p, gr, m64, vv, NULL, &cfg, 0.1, 0.0, 2), TM_ERR_DTYPE);
    cr_assert_eq(tm_adamw_update(ctx, p, gr, m, vv, NULL, &cfg, 0.1, 0.0, 0), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_adamw_update(ctx, p, NULL, m, vv, NULL, &cfg, 0.1, 0.0, 2), TM_ERR_INVALID_ARG);
    /* a strided view is refused (updates write in place) */
    tm_tensor *g2, *gt;
    int64_t sh[2] = {2, 2};
    const double x4[4] = {1, 2, 3, 4};
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, sh, tm_cpu(), TM_F64, x4, &g2));
    TT_OK(ctx, tm_transpose(ctx, g2, 0, 1, &gt));
    cr_assert_eq(tm_grad_scale(ctx, gt, 2.0), TM_ERR_INVALID_ARG);
    tm_ctx_free(ctx);
}
