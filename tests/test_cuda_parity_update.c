/*
 * test_cuda_parity_update.c — the CUDA update ops (kernels/cuda/update.cu) against the CPU ones
 * (kernels/cpu/update.c): adamw_update and sgd_update over several steps with fresh random
 * gradients each step, grad_sumsq, grad_scale, and tm_ctx_clip_grad_norm + tm_optimizer_step on
 * CUDA buckets against the same on CPU buckets. The update ops have no backward (never on the
 * tape), so "forward" here is the in-place update of every tensor they write.
 *
 * Tolerances (|cuda - cpu| <= atol + rtol * |cpu|):
 *   f32 parameters, f32 state (m, v, b) and f32 master weights: atol 1e-5, rtol 1e-5. The
 *     CUDA kernels round every operation on its own in the CPU's order, so they are expected
 *     to agree bit for bit; the tolerance only covers a toolchain that fuses differently.
 *   bf16 parameters: atol 1e-2, rtol 1e-2 (about two bf16 ulps: with a master, the parameter
 *     is the master rounded, and a master value 1e-5 apart may round to the neighbouring bf16).
 *   grad_sumsq: rtol 1e-6. Both sum in f64 in a fixed order, but not the same order, and the
 *     CUDA result is stored as f32 (f64 cannot live on CUDA): agreement to f32 rounding.
 *   clip + step: the norms to rtol 1e-6, then parameters as above; the whole training-like
 *     loop runs 3 steps so differences would compound.
 * Every test but the coverage declaration skips when no CUDA device is visible.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "parity.h"

TT_PARITY_COVERS("adamw_update")
TT_PARITY_COVERS("sgd_update")
TT_PARITY_COVERS("grad_sumsq")
TT_PARITY_COVERS("grad_scale")

#define F32_TOL 1e-5
#define BF16_TOL 1e-2

/* A tensor on dev from host f64 values. */
static tm_tensor *make(tm_ctx *ctx, tm_dtype dt, int64_t n, tm_device dev, const double *v) {
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, 1, &n, dev, TM_F64, v, &t));
    return t;
}

static void assert_same(tm_ctx *ctx, const tm_tensor *gpu, const tm_tensor *cpu, double tol, const char *what,
                        const char *name) {
    cr_assert_eq(tm_tensor_device(gpu).type, TM_DEVICE_CUDA, "%s: %s not on CUDA", name, what);
    double *a = tt_read(ctx, gpu), *b = tt_read(ctx, cpu);
    double r = tt_close_ratio(a, b, tm_tensor_numel(cpu), tol, tol);
    cr_assert(r <= 1.0, "%s: %s differs between CUDA and the CPU, ratio %g", name, what, r);
    free(a), free(b);
}

/* ---- adamw_update and sgd_update over several steps ------------------------------------------ */

typedef struct upd_case {
    const char *name;
    int sgd;           /* 0: AdamW, 1: SGD */
    tm_dtype dt;       /* the parameter's */
    int master;        /* an f32 master (bf16 only) */
    int64_t n;
    double wd;
    double momentum;   /* SGD */
    int nesterov;      /* SGD */
} upd_case;

/* One side's tensors: param, grad, m|b, v, master. */
typedef struct upd_side {
    tm_tensor *p, *g, *s0, *s1, *master;
} upd_side;

static void upd_run(const upd_case *uc) {
    enum { STEPS = 4 };
    tm_ctx *ctx = tt_parity_ctx();
    tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
    double *hp = tt_parity_uniform(uc->n, 11), *hz = calloc((size_t)(uc->n ? uc->n : 1), sizeof(double));
    /* the master starts as the bf16 parameter widened, as tm__bucket_master_ensure makes it */
    for (int64_t i = 0; i < uc->n; i++) {
        float f = (float)hp[i];
        uint32_t u;
        memcpy(&u, &f, 4);
        if (uc->dt == TM_BF16) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        memcpy(&f, &u, 4);
        hp[i] = f;
    }
    upd_side sd[2];
    for (int k = 0; k < 2; k++) {
        sd[k].p = make(ctx, uc->dt, uc->n, devs[k], hp);
        sd[k].s0 = make(ctx, TM_F32, uc->n, devs[k], hz);
        sd[k].s1 = make(ctx, TM_F32, uc->n, devs[k], hz);
        sd[k].master = uc->master ? make(ctx, TM_F32, uc->n, devs[k], hp) : NULL;
    }
    tm_adamw_config ac = tm_adamw_config_default();
    ac.beta2 = 0.95;
    tm_sgd_config sc = tm_sgd_config_default();
    sc.momentum = uc->momentum;
    sc.nesterov = uc->nesterov;
    for (int t = 1; t <= STEPS; t++) {
        double *hg = tt_parity_uniform(uc->n, 100 + (uint64_t)t);
        /* gradients of assorted scales, some tiny: the sqrt(v) + eps path */
        for (int64_t i = 0; i < uc->n; i++) hg[i] *= (i % 7 == 0) ? 1e-6 : (i % 3 == 0 ? 30.0 : 1.0);
        double lr = 3e-3 * t;
        for (int k = 0; k < 2; k++) {
            sd[k].g = make(ctx, uc->dt, uc->n, devs[k], hg);
            if (uc->sgd)
                TT_OK(ctx, tm_sgd_update(ctx, sd[k].p, sd[k].g, uc->momentum > 0 ? sd[k].s0 : NULL, sd[k].master, &sc,
                                         lr, uc->wd));
            else
                TT_OK(ctx, tm_adamw_update(ctx, sd[k].p, sd[k].g, sd[k].s0, sd[k].s1, sd[k].master, &ac, lr, uc->wd, t));
        }
        free(hg);
    }
    assert_same(ctx, sd[1].p, sd[0].p, uc->dt == TM_BF16 ? BF16_TOL : F32_TOL, "param", uc->name);
    if (!uc->sgd || uc->momentum > 0) assert_same(ctx, sd[1].s0, sd[0].s0, F32_TOL, uc->sgd ? "b" : "m", uc->name);
    if (!uc->sgd) assert_same(ctx, sd[1].s1, sd[0].s1, F32_TOL, "v", uc->name);
    if (uc->master) assert_same(ctx, sd[1].master, sd[0].master, F32_TOL, "master", uc->name);
    free(hp), free(hz);
    tm_ctx_free(ctx);
}

static const upd_case ADAMW_CASES[] = {
    {"adamw f32, no decay", 0, TM_F32, 0, 1037, 0.0, 0, 0},
    {"adamw f32, decay, many blocks", 0, TM_F32, 0, 300007, 0.1, 0, 0},
    {"adamw bf16 with f32 master, decay", 0, TM_BF16, 1, 70001, 0.1, 0, 0},
    {"adamw bf16 with f32 master, no decay", 0, TM_BF16, 1, 37, 0.0, 0, 0},
    {"adamw bf16 without master", 0, TM_BF16, 0, 4099, 0.01, 0, 0},
    {"adamw empty", 0, TM_F32, 0, 0, 0.1, 0, 0},
};

static const upd_case SGD_CASES[] = {
    {"sgd f32 plain", 1, TM_F32, 0, 1037, 0.0, 0.0, 0},
    {"sgd f32 momentum, decay", 1, TM_F32, 0, 300007, 0.01, 0.9, 0},
    {"sgd f32 nesterov", 1, TM_F32, 0, 4099, 0.0, 0.9, 1},
    {"sgd bf16 with f32 master, momentum, decay", 1, TM_BF16, 1, 70001, 0.01, 0.9, 0},
    {"sgd bf16 without master, nesterov", 1, TM_BF16, 0, 37, 0.0, 0.5, 1},
};

Test(cuda_parity_update, adamw_steps) {
    TT_SKIP_WITHOUT_CUDA();
    for (size_t k = 0; k < sizeof ADAMW_CASES / sizeof ADAMW_CASES[0]; k++) upd_run(&ADAMW_CASES[k]);
}

Test(cuda_parity_update, sgd_steps) {
    TT_SKIP_WITHOUT_CUDA();
    for (size_t k = 0; k < sizeof SGD_CASES / sizeof SGD_CASES[0]; k++) upd_run(&SGD_CASES[k]);
}

/* ---- grad_sumsq and grad_scale ---------------------------------------------------------------- */

Test(cuda_parity_update, grad_sumsq) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    /* one chunk, exactly one chunk, two chunks, many chunks with a ragged last one, 256 chunks */
    const int64_t sizes[] = {0, 5, 4096, 4097, 3 * (1 << 17) + 5, (int64_t)256 * 4096 * 3 + 11};
    const tm_dtype dts[2] = {TM_F32, TM_BF16};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        double *h = tt_parity_uniform(n, 40 + (uint64_t)s);
        for (int d = 0; d < 2; d++) {
            tm_tensor *gc = make(ctx, dts[d], n, tm_cpu(), h), *gg = make(ctx, dts[d], n, tm_cuda(0), h);
            tm_tensor *oc, *og, *og2;
            TT_OK(ctx, tm_grad_sumsq(ctx, gc, &oc));
            uint64_t before = tm_ctx_sync_count(ctx);
            TT_OK(ctx, tm_grad_sumsq(ctx, gg, &og));
            TT_OK(ctx, tm_grad_sumsq(ctx, gg, &og2));
            cr_assert_eq(tm_ctx_sync_count(ctx), before, "grad_sumsq read something back");
            cr_assert_eq(tm_tensor_ndim(og), 0);
            cr_assert_eq(tm_tensor_dtype(og), TM_F32, "the CUDA sum is f32 (f64 cannot live on CUDA)");
            cr_assert_eq(tm_tensor_device(og).type, TM_DEVICE_CUDA);
            double vc, vg, vg2;
            TT_OK(ctx, tm_tensor_read(ctx, oc, TM_F64, &vc, 1));
            TT_OK(ctx, tm_tensor_read(ctx, og, TM_F64, &vg, 1));
            TT_OK(ctx, tm_tensor_read(ctx, og2, TM_F64, &vg2, 1));
            cr_assert(fabs(vg - vc) <= 1e-6 * fabs(vc), "grad_sumsq %s n=%lld: cuda %.17g cpu %.17g",
                      tm_dtype_name(dts[d]), (long long)n, vg, vc);
            cr_assert(memcmp(&vg, &vg2, sizeof vg) == 0, "grad_sumsq differs between two runs on one input");
        }
        free(h);
        tm_ctx_arena_reset(ctx);
    }
    tm_ctx_free(ctx);
}

Test(cuda_parity_update, grad_scale) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t sizes[] = {0, 7, 300007};
    const tm_dtype dts[2] = {TM_F32, TM_BF16};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        double *h = tt_parity_uniform(sizes[s], 60 + (uint64_t)s);
        for (int d = 0; d < 2; d++) {
            tm_tensor *gc = make(ctx, dts[d], sizes[s], tm_cpu(), h), *gg = make(ctx, dts[d], sizes[s], tm_cuda(0), h);
            TT_OK(ctx, tm_grad_scale(ctx, gc, 0.3141592653589793));
            TT_OK(ctx, tm_grad_scale(ctx, gg, 0.3141592653589793));
            assert_same(ctx, gg, gc, dts[d] == TM_BF16 ? BF16_TOL : F32_TOL, "scaled gradient",
                        dts[d] == TM_BF16 ? "grad_scale bf16" : "grad_scale f32");
        }
        free(h);
    }
    tm_ctx_free(ctx);
}

/* ---- tm_ctx_clip_grad_norm + tm_optimizer_step on CUDA buckets ---------------------------- */

/* The same parameters in ctx on dev: a dense f32 bucket (matrices, which decay, and vectors,
 * which do not: several runs), a dense bf16 bucket (master weights), and ten expert buckets
 * (one expert each), so the clip concatenates more than tm_concat's 8 partials at once. */
enum { N_EXPERT_BUCKETS = 10, MAX_PARAMS = 16 };
typedef struct model_params {
    int n;
    tm_tensor *p[MAX_PARAMS];
} model_params;

static void make_params(tm_ctx *ctx, tm_device dev, model_params *mp) {
    mp->n = 0;
    int64_t s_w1[2] = {37, 29}, s_g[1] = {29}, s_w2[2] = {29, 41}, s_b[1] = {41}, s_h[2] = {17, 23};
    TT_OK(ctx, tm_param_new(ctx, "w1", TM_F32, 2, s_w1, dev, &mp->p[mp->n++]));
    TT_OK(ctx, tm_param_new(ctx, "gain", TM_F32, 1, s_g, dev, &mp->p[mp->n++]));
    TT_OK(ctx, tm_param_new(ctx, "w2", TM_F32, 2, s_w2, dev, &mp->p[mp->n++]));
    TT_OK(ctx, tm_param_new(ctx, "bias", TM_F32, 1, s_b, dev, &mp->p[mp->n++]));
    TT_OK(ctx, tm_param_new(ctx, "half", TM_BF16, 2, s_h, dev, &mp->p[mp->n++]));
    for (int e = 0; e < N_EXPERT_BUCKETS; e++) {
        char name[32];
        snprintf(name, sizeof name, "experts.%d.w", e);
        tm_param_options o = tm_param_options_default();
        o.group = TM_PARAM_EXPERT;
        o.expert_lo = e;
        o.expert_hi = e + 1;
        int64_t s_e[3] = {1, 5 + e, 3};
        TT_OK(ctx, tm_param_new_ex(ctx, name, TM_F32, 3, s_e, dev, &o, &mp->p[mp->n++]));
    }
    for (int i = 0; i < mp->n; i++) {
        int64_t n = tm_tensor_numel(mp->p[i]);
        double *h = tt_parity_uniform(n, 500 + (uint64_t)i);
        TT_OK(ctx, tm_tensor_write(ctx, mp->p[i], TM_F64, h, n));
        free(h);
    }
}

/* Gradients of step t: same host values on both sides. */
static void set_grads(tm_ctx *ctx, model_params *mp, int t) {
    for (int i = 0; i < mp->n; i++) {
        int64_t n = tm_tensor_numel(mp->p[i]);
        double *h = tt_parity_uniform(n, 900 + 31 * (uint64_t)t + (uint64_t)i);
        for (int64_t k = 0; k < n; k++) h[k] *= 3.0;
        TT_OK(ctx, tm_tensor_write(ctx, tm_tensor_grad(mp->p[i]), TM_F64, h, n));
        free(h);
    }
}

static void clip_and_step(int sgd) {
    tm_ctx *cg = tt_parity_ctx(), *cc = tt_ctx();
    model_params mg, mc;
    make_params(cg, tm_cuda(0), &mg);
    make_params(cc, tm_cpu(), &mc);
    cr_assert_eq(tm_ctx_num_buckets(cg), 2 + N_EXPERT_BUCKETS);
    tm_optimizer *og, *oc;
    if (sgd) {
        tm_sgd_config c = tm_sgd_config_default();
        c.weight_decay = 0.01;
        c.nesterov = 1;
        TT_OK(cg, tm_sgd_new(cg, &c, &og));
        TT_OK(cc, tm_sgd_new(cc, &c, &oc));
    } else {
        tm_adamw_config c = tm_adamw_config_default();
        c.weight_decay = 0.1;
        TT_OK(cg, tm_adamw_new(cg, &c, &og));
        TT_OK(cc, tm_adamw_new(cc, &c, &oc));
    }
    for (int t = 0; t < 3; t++) {
        set_grads(cg, &mg, t);
        set_grads(cc, &mc, t);
        double ng = 0, nc = 0;
        uint64_t before = tm_ctx_sync_count(cg);
        TT_OK(cg, tm_ctx_clip_grad_norm(cg, 5.0, &ng)); /* the norms are ~100: clipping scales */
        cr_assert_eq(tm_ctx_sync_count(cg) - before, 1, "the clip over %d CUDA buckets waited %llu times",
                     tm_ctx_num_buckets(cg), (unsigned long long)(tm_ctx_sync_count(cg) - before));
        TT_OK(cc, tm_ctx_clip_grad_norm(cc, 5.0, &nc));
        cr_assert(ng > 5.0 && fabs(ng - nc) <= 1e-6 * nc, "step %d: norm %.17g on CUDA, %.17g on the CPU", t, ng, nc);
        TT_OK(cg, tm_optimizer_step(og, 1e-2));
        TT_OK(cc, tm_optimizer_step(oc, 1e-2));
        TT_OK(cg, tm_ctx_zero_grad(cg));
        TT_OK(cc, tm_ctx_zero_grad(cc));
        tm_ctx_arena_reset(cg);
        tm_ctx_arena_reset(cc);
    }
    cr_assert_eq(tm_optimizer_steps(og), 3);
    for (int i = 0; i < mg.n; i++) {
        const char *name = tm_tensor_name(mc.p[i]);
        double tol = tm_tensor_dtype(mc.p[i]) == TM_BF16 ? BF16_TOL : F32_TOL;
        /* a CUDA tensor read through tt_read lands in cg; compare on the host */
        double *a = tt_read(cg, mg.p[i]), *b = tt_read(cc, mc.p[i]);
        double r = tt_close_ratio(a, b, tm_tensor_numel(mc.p[i]), tol, tol);
        cr_assert(r <= 1.0, "%s: parameter %s differs after 3 clipped steps, ratio %g", sgd ? "SGD" : "AdamW", name, r);
        free(a), free(b);
        /* the optimizer state, found by name as checkpoints do */
        const char *suffix[2] = {sgd ? ".sgd_b" : ".adamw_m", sgd ? NULL : ".adamw_v"};
        for (int j = 0; j < 2 && suffix[j]; j++) {
            char sn[160];
            snprintf(sn, sizeof sn, "%s%s", name, suffix[j]);
            tm_tensor *sgpu = tm_ctx_find(cg, sn), *scpu = tm_ctx_find(cc, sn);
            cr_assert(sgpu && scpu, "no state %s", sn);
            double *x = tt_read(cg, sgpu), *y = tt_read(cc, scpu);
            double rs = tt_close_ratio(x, y, tm_tensor_numel(scpu), F32_TOL, F32_TOL);
            cr_assert(rs <= 1.0, "%s: state %s differs, ratio %g", sgd ? "SGD" : "AdamW", sn, rs);
            free(x), free(y);
        }
        if (tm_tensor_dtype(mc.p[i]) == TM_BF16) {
            char sn[160];
            snprintf(sn, sizeof sn, "%s.master", name);
            tm_tensor *mgpu = tm_ctx_find(cg, sn), *mcpu = tm_ctx_find(cc, sn);
            cr_assert(mgpu && mcpu, "no master %s", sn);
            double *x = tt_read(cg, mgpu), *y = tt_read(cc, mcpu);
            double rm = tt_close_ratio(x, y, tm_tensor_numel(mcpu), F32_TOL, F32_TOL);
            cr_assert(rm <= 1.0, "%s: master %s differs, ratio %g", sgd ? "SGD" : "AdamW", sn, rm);
            free(x), free(y);
        }
    }
    tm_optimizer_free(og);
    tm_optimizer_free(oc);
    tm_ctx_free(cg);
    tm_ctx_free(cc);
}

Test(cuda_parity_update, clip_and_adamw_step_on_cuda_buckets) {
    TT_SKIP_WITHOUT_CUDA();
    clip_and_step(0);
}

Test(cuda_parity_update, clip_and_sgd_step_on_cuda_buckets) {
    TT_SKIP_WITHOUT_CUDA();
    clip_and_step(1);
}
