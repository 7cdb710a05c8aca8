/*
 * test_cuda_parity_update.c — the CUDA update ops (kernels/cuda/update.cu) against the CPU ones
 * (kernels/cpu/update.c): tm_adamw_update and sgd_update over several steps with fresh random
 * gradients each step, tm_grad_sumsq, tm_grad_scale (the table ops adamw_update_multi,
 * grad_sumsq_multi, grad_scale_multi over one range), and tm_ctx_clip_grad_norm + tm_optimizer_step on
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
 *   the table ops over several ranges (adamw_update_multi, grad_sumsq_multi, grad_scale_multi):
 *     as above against the CPU's, and bit for bit against one range at a time (tm_adamw_update,
 *     tm_grad_sumsq, tm_grad_scale): the same per-element code and summation order.
 * Every test but the coverage declaration skips when no CUDA device is visible.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "extend.h"
#include "parity.h"

TT_PARITY_COVERS("sgd_update")

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

/* v's elements [1, n + 1) as a tensor of n: the view starts one element past an aligned base. */
static tm_tensor *make_off(tm_ctx *ctx, tm_dtype dt, int64_t n, tm_device dev, const double *v) {
    double *h = malloc(sizeof(double) * (size_t)(n + 1));
    h[0] = 0.25;
    memcpy(h + 1, v, sizeof(double) * (size_t)n);
    tm_tensor *base = make(ctx, dt, n + 1, dev, h), *t;
    free(h);
    TT_OK(ctx, tm_slice(ctx, base, 0, 1, n + 1, &t));
    return t;
}

/* The AdamW kernel moves 4 elements per access when every range starts aligned and one at a
 * time otherwise (kernels/cuda/update.cu, adamw_range): the same data updated through aligned
 * tensors and through views one element off must agree bit for bit, over steps. */
Test(cuda_parity_update, adamw_vector_path_equals_scalar_path) {
    TT_SKIP_WITHOUT_CUDA();
    const struct { tm_dtype dt; int master; int64_t n; } cases[] = {
        {TM_F32, 0, 70001}, {TM_BF16, 1, 70001}, {TM_BF16, 0, 4101}, {TM_F32, 0, 3}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        tm_ctx *ctx = tt_parity_ctx();
        const int64_t n = cases[c].n;
        const tm_dtype dt = cases[c].dt;
        double *hp = tt_parity_uniform(n, 21), *hz = calloc((size_t)n, sizeof(double));
        upd_side sd[2];
        for (int k = 0; k < 2; k++) { /* 0: aligned, 1: one element off */
            tm_tensor *(*mk)(tm_ctx *, tm_dtype, int64_t, tm_device, const double *) = k ? make_off : make;
            sd[k].p = mk(ctx, dt, n, tm_cuda(0), hp);
            sd[k].s0 = mk(ctx, TM_F32, n, tm_cuda(0), hz);
            sd[k].s1 = mk(ctx, TM_F32, n, tm_cuda(0), hz);
            sd[k].master = cases[c].master ? mk(ctx, TM_F32, n, tm_cuda(0), hp) : NULL;
        }
        tm_adamw_config ac = tm_adamw_config_default();
        for (int t = 1; t <= 3; t++) {
            double *hg = tt_parity_uniform(n, 200 + (uint64_t)t);
            for (int64_t i = 0; i < n; i++) hg[i] *= (i % 5 == 0) ? 1e-6 : 3.0;
            for (int k = 0; k < 2; k++) {
                sd[k].g = (k ? make_off : make)(ctx, dt, n, tm_cuda(0), hg);
                TT_OK(ctx, tm_adamw_update(ctx, sd[k].p, sd[k].g, sd[k].s0, sd[k].s1, sd[k].master, &ac, 1e-2 * t, 0.1, t));
            }
            free(hg);
        }
        const tm_tensor *got[2][4] = {{sd[0].p, sd[0].s0, sd[0].s1, sd[0].master}, {sd[1].p, sd[1].s0, sd[1].s1, sd[1].master}};
        const char *what[4] = {"param", "m", "v", "master"};
        for (int i = 0; i < 4; i++) {
            if (!got[0][i]) continue;
            double *a = tt_read(ctx, got[0][i]), *b = tt_read(ctx, got[1][i]);
            for (int64_t e = 0; e < n; e++)
                cr_assert(memcmp(&a[e], &b[e], sizeof(double)) == 0, "adamw %s%s n %lld: %s[%lld] %.9g aligned, %.9g one element off",
                          tm_dtype_name(dt), cases[c].master ? " with master" : "", (long long)n, what[i], (long long)e, a[e], b[e]);
            free(a), free(b);
        }
        free(hp), free(hz);
        tm_ctx_free(ctx);
    }
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

/* ---- the fused ops: adamw_update_multi, grad_sumsq_multi, grad_scale_multi ------------------- */
/* Against the CPU's fused ops (tolerances above) and against the CUDA single-range ops, which
 * they must reproduce bit for bit (same per-element code, same sum order): a difference there
 * would change every CUDA training run. */

TT_PARITY_COVERS("adamw_update_multi")
TT_PARITY_COVERS("grad_sumsq_multi")
TT_PARITY_COVERS("grad_scale_multi")

/* Flat "buckets" on one device: f32 without master; bf16 with an f32 master whose state starts
 * at element 64 (a ZeRO-1 block); bf16 without master. Sizes leave ragged last blocks. */
enum { MG = 3 };
static const tm_dtype MG_DT[MG] = {TM_F32, TM_BF16, TM_BF16};
static const int64_t MG_N[MG] = {300007, 70001, 4099}, MG_OFF[MG] = {0, 64, 0};
static const int MG_MASTER[MG] = {0, 1, 0};

typedef struct mgroup {
    tm_tensor *P, *G, *m, *v, *master;
} mgroup;

static void mg_make(tm_ctx *ctx, tm_device dev, mgroup *g) {
    for (int k = 0; k < MG; k++) {
        int64_t n = MG_N[k], ns = n - MG_OFF[k];
        double *p = tt_parity_uniform(n, 70 + (uint64_t)k), *z = calloc((size_t)n, sizeof(double));
        if (MG_DT[k] == TM_BF16)
            for (int64_t i = 0; i < n; i++) {
                float f = (float)p[i];
                uint32_t u;
                memcpy(&u, &f, 4);
                u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
                memcpy(&f, &u, 4);
                p[i] = f;
            }
        g[k].P = make(ctx, MG_DT[k], n, dev, p);
        g[k].G = make(ctx, MG_DT[k], n, dev, z);
        g[k].m = make(ctx, TM_F32, ns, dev, z);
        g[k].v = make(ctx, TM_F32, ns, dev, z);
        g[k].master = MG_MASTER[k] ? make(ctx, TM_F32, ns, dev, p + MG_OFF[k]) : NULL;
        free(p), free(z);
    }
}

static void mg_grads(tm_ctx *ctx, mgroup *g, int t, double scale) {
    for (int k = 0; k < MG; k++) {
        double *h = tt_parity_uniform(MG_N[k], 300 + 11 * (uint64_t)t + (uint64_t)k);
        for (int64_t i = 0; i < MG_N[k]; i++) h[i] *= scale * ((i % 7 == 0) ? 1e-6 : (i % 3 == 0 ? 30.0 : 1.0));
        TT_OK(ctx, tm_tensor_write(ctx, g[k].G, TM_F64, h, MG_N[k]));
        free(h);
    }
}

typedef struct mrange {
    int group;
    int64_t a, e;
    double wd;
} mrange;

static const mrange MR[] = {
    {0, 0, 4096, 0.1}, {0, 4096, 4099, 0.0}, {0, 4099, 200001, 0.1}, {0, 200001, 300007, 0.0},
    {1, 64, 65, 0.0}, {1, 65, 70001, 0.05}, {2, 0, 4099, 0.01},
};
enum { N_MR = sizeof MR / sizeof MR[0] };

static void mg_adamw_per_range(tm_ctx *ctx, mgroup *g, const tm_adamw_config *cfg, double lr, int t) {
    for (int r = 0; r < N_MR; r++) {
        const mrange *q = &MR[r];
        mgroup *x = &g[q->group];
        int64_t o = MG_OFF[q->group];
        tm_tensor *p, *gr, *m, *v, *ms = NULL;
        TT_OK(ctx, tm_slice(ctx, x->P, 0, q->a, q->e, &p));
        TT_OK(ctx, tm_slice(ctx, x->G, 0, q->a, q->e, &gr));
        TT_OK(ctx, tm_slice(ctx, x->m, 0, q->a - o, q->e - o, &m));
        TT_OK(ctx, tm_slice(ctx, x->v, 0, q->a - o, q->e - o, &v));
        if (x->master) TT_OK(ctx, tm_slice(ctx, x->master, 0, q->a - o, q->e - o, &ms));
        TT_OK(ctx, tm_adamw_update(ctx, p, gr, m, v, ms, cfg, lr, q->wd, t));
    }
}

static void mg_adamw_fused(tm_ctx *ctx, tm__segs *l, mgroup *g, const tm_adamw_config *cfg, double lr, int t) {
    TT_OK(ctx, tm__segs_begin(ctx, l, TM__SEGS_ADAMW, N_MR));
    for (int r = 0; r < N_MR; r++) {
        const mrange *q = &MR[r];
        mgroup *x = &g[q->group];
        TT_OK(ctx, tm__segs_add_adamw(ctx, l, x->P, x->G, x->m, x->v, x->master, q->a, q->e, MG_OFF[q->group], 0, 0, q->wd));
    }
    TT_OK(ctx, tm__adamw_update_multi(ctx, l, cfg, lr, t, NULL));
}

/* The same bits (both tensors on CUDA, read in their dtype). */
static void assert_bits(tm_ctx *ctx, const tm_tensor *a, const tm_tensor *b, const char *what, const char *name) {
    int64_t n = tm_tensor_numel(a);
    tm_dtype dt = tm_tensor_dtype(a);
    size_t es = tm_dtype_size(dt);
    char *x = malloc(es * (size_t)n + 1), *y = malloc(es * (size_t)n + 1);
    TT_OK(ctx, tm_tensor_read(ctx, a, dt, x, n));
    TT_OK(ctx, tm_tensor_read(ctx, b, dt, y, n));
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
        if (memcmp(x + (size_t)i * es, y + (size_t)i * es, es)) bad = i;
    cr_assert(bad < 0, "%s: %s of the fused CUDA op differs from the single-range CUDA op at element %lld", name, what,
              (long long)bad);
    free(x), free(y);
}

Test(cuda_parity_update, adamw_update_multi) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    mgroup fc[MG], fg[MG], rg[MG]; /* fused on the CPU, fused on CUDA, per range on CUDA */
    mg_make(ctx, tm_cpu(), fc);
    mg_make(ctx, tm_cuda(0), fg);
    mg_make(ctx, tm_cuda(0), rg);
    tm__segs *lc, *lg;
    TT_OK(ctx, tm__segs_new(ctx, "test", tm_cpu(), N_MR, &lc));
    TT_OK(ctx, tm__segs_new(ctx, "test", tm_cuda(0), N_MR, &lg));
    tm_adamw_config cfg = tm_adamw_config_default();
    cfg.beta2 = 0.95;
    for (int t = 1; t <= 4; t++) {
        mg_grads(ctx, fc, t, 1.0);
        mg_grads(ctx, fg, t, 1.0);
        mg_grads(ctx, rg, t, 1.0);
        uint64_t before = tm_ctx_sync_count(ctx);
        mg_adamw_fused(ctx, lg, fg, &cfg, 3e-3 * t, t);
        cr_assert_eq(tm_ctx_sync_count(ctx), before, "adamw_update_multi waited for the device");
        mg_adamw_fused(ctx, lc, fc, &cfg, 3e-3 * t, t);
        mg_adamw_per_range(ctx, rg, &cfg, 3e-3 * t, t);
    }
    for (int k = 0; k < MG; k++) {
        const char *name = k == 0 ? "f32" : k == 1 ? "bf16 with master" : "bf16 without master";
        assert_bits(ctx, fg[k].P, rg[k].P, "param", name);
        assert_bits(ctx, fg[k].m, rg[k].m, "m", name);
        assert_bits(ctx, fg[k].v, rg[k].v, "v", name);
        if (fg[k].master) assert_bits(ctx, fg[k].master, rg[k].master, "master", name);
        assert_same(ctx, fg[k].P, fc[k].P, MG_DT[k] == TM_BF16 ? BF16_TOL : F32_TOL, "param", name);
        assert_same(ctx, fg[k].m, fc[k].m, F32_TOL, "m", name);
        assert_same(ctx, fg[k].v, fc[k].v, F32_TOL, "v", name);
        if (fg[k].master) assert_same(ctx, fg[k].master, fc[k].master, F32_TOL, "master", name);
    }
    tm__segs_free(ctx, lc);
    tm__segs_free(ctx, lg);
    tm_ctx_free(ctx);
}

/* The clip's ops over every range of MR's groups as gradients (one range per group, plus
 * ranges of assorted sizes cut from group 0: one chunk, exactly one chunk, one past, many). */
static const int64_t CLIP_CUTS[][2] = {{0, 5}, {5, 4101}, {4101, 8198}, {8198, 300007}};

static void clip_list(tm_ctx *ctx, tm__segs *l, mgroup *g) {
    int n = (int)(sizeof CLIP_CUTS / sizeof CLIP_CUTS[0]);
    TT_OK(ctx, tm__segs_begin(ctx, l, TM__SEGS_GRADS, n + 2));
    for (int j = 0; j < n; j++) TT_OK(ctx, tm__segs_add_grad(ctx, l, g[0].G, CLIP_CUTS[j][0], CLIP_CUTS[j][1]));
    TT_OK(ctx, tm__segs_add_grad(ctx, l, g[1].G, MG_OFF[1], MG_N[1]));
    TT_OK(ctx, tm__segs_add_grad(ctx, l, g[2].G, 0, MG_N[2]));
}

/* cpu: compare with the CPU's ops too (not when the CUDA partials overflow f32, which the
 * CPU's f64 partials do not). */
static void clip_multi(double max_norm, double grad_scale, int cpu) {
    tm_ctx *ctx = tt_parity_ctx();
    mgroup gc[MG], gg[MG], gr[MG]; /* CPU fused, CUDA fused, CUDA per range */
    mg_make(ctx, tm_cpu(), gc);
    mg_make(ctx, tm_cuda(0), gg);
    mg_make(ctx, tm_cuda(0), gr);
    mg_grads(ctx, gc, 1, grad_scale);
    mg_grads(ctx, gg, 1, grad_scale);
    mg_grads(ctx, gr, 1, grad_scale);
    tm__segs *lc, *lg;
    TT_OK(ctx, tm__segs_new(ctx, "test", tm_cpu(), 1, &lc));
    TT_OK(ctx, tm__segs_new(ctx, "test", tm_cuda(0), 1, &lg));
    clip_list(ctx, lc, gc);
    clip_list(ctx, lg, gg);
    int m = tm__segs_count(lg);
    tm_tensor *pc, *fc, *pg, *fg, *pg2, *fg2;
    uint64_t before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm__grad_sumsq_multi(ctx, lg, max_norm, &pg, &fg));
    TT_OK(ctx, tm__grad_sumsq_multi(ctx, lg, max_norm, &pg2, &fg2)); /* the ticket was reset */
    TT_OK(ctx, tm__grad_scale_multi(ctx, lg, fg));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "the fused clip ops waited for the device");
    TT_OK(ctx, tm__grad_sumsq_multi(ctx, lc, max_norm, &pc, &fc));
    TT_OK(ctx, tm__grad_scale_multi(ctx, lc, fc));
    cr_assert_eq(tm_tensor_dtype(pg), TM_F32);
    cr_assert_eq(tm_tensor_dtype(fg), TM_F32);
    double *vg = tt_read(ctx, pg), *vg2 = tt_read(ctx, pg2), *vc = tt_read(ctx, pc), f, f2, fcpu;
    TT_OK(ctx, tm_tensor_read(ctx, fg, TM_F64, &f, 1));
    TT_OK(ctx, tm_tensor_read(ctx, fg2, TM_F64, &f2, 1));
    TT_OK(ctx, tm_tensor_read(ctx, fc, TM_F64, &fcpu, 1));
    cr_assert(memcmp(vg, vg2, sizeof(double) * (size_t)m) == 0 && f == f2, "two runs of grad_sumsq_multi differ");
    /* per range on CUDA: grad_sumsq's f32 partials, bit for bit; the host's rule for the factor */
    double ss = 0.0;
    for (int j = 0; j < m; j++) {
        tm_tensor *g, *o;
        int64_t ncuts = (int64_t)(sizeof CLIP_CUTS / sizeof CLIP_CUTS[0]);
        if (j < ncuts) TT_OK(ctx, tm_slice(ctx, gr[0].G, 0, CLIP_CUTS[j][0], CLIP_CUTS[j][1], &g));
        else if (j == ncuts) TT_OK(ctx, tm_slice(ctx, gr[1].G, 0, MG_OFF[1], MG_N[1], &g));
        else g = gr[2].G;
        TT_OK(ctx, tm_grad_sumsq(ctx, g, &o));
        double want;
        TT_OK(ctx, tm_tensor_read(ctx, o, TM_F64, &want, 1));
        cr_assert(vg[j] == want, "range %d: partial %.17g, grad_sumsq %.17g", j, vg[j], want);
        cr_assert(!cpu || fabs(vg[j] - vc[j]) <= 1e-6 * vc[j], "range %d: partial %.17g on CUDA, %.17g on the CPU", j,
                  vg[j], vc[j]);
        ss += want;
    }
    double norm = sqrt(ss), scale = max_norm / (norm + 1e-6);
    int clips = max_norm > 0 && norm > max_norm;
    cr_assert(f == (clips ? (double)(float)scale : 1.0), "factor %.17g (norm %.17g, max_norm %g)", f, norm, max_norm);
    cr_assert(!cpu || fabs(f - fcpu) <= 1e-6 * fcpu, "factor %.17g on CUDA, %.17g on the CPU", f, fcpu);
    /* the scaled gradients: grad_scale per range on CUDA, bit for bit (untouched when not clipping) */
    int64_t ncuts = (int64_t)(sizeof CLIP_CUTS / sizeof CLIP_CUTS[0]);
    for (int j = 0; clips && j < m; j++) {
        tm_tensor *g;
        if (j < ncuts) TT_OK(ctx, tm_slice(ctx, gr[0].G, 0, CLIP_CUTS[j][0], CLIP_CUTS[j][1], &g));
        else if (j == ncuts) TT_OK(ctx, tm_slice(ctx, gr[1].G, 0, MG_OFF[1], MG_N[1], &g));
        else g = gr[2].G;
        TT_OK(ctx, tm_grad_scale(ctx, g, scale));
    }
    for (int k = 0; k < MG; k++) {
        assert_bits(ctx, gg[k].G, gr[k].G, "gradients", clips ? "clipped" : "not clipped");
        if (cpu)
            assert_same(ctx, gg[k].G, gc[k].G, MG_DT[k] == TM_BF16 ? BF16_TOL : F32_TOL, "gradients", "grad_scale_multi");
    }
    free(vg), free(vg2), free(vc);
    tm__segs_free(ctx, lc);
    tm__segs_free(ctx, lg);
    tm_ctx_free(ctx);
}

Test(cuda_parity_update, clip_multi_scales) {
    TT_SKIP_WITHOUT_CUDA();
    clip_multi(5.0, 1.0, 1);
}

Test(cuda_parity_update, clip_multi_below_max_norm) {
    TT_SKIP_WITHOUT_CUDA();
    clip_multi(1e9, 1.0, 1);
}

Test(cuda_parity_update, clip_multi_nonfinite_norm) {
    TT_SKIP_WITHOUT_CUDA();
    /* The f32 partials overflow to inf (f64 sums near 1e43): norm inf, factor 0, gradients 0,
     * as the general path's host arithmetic gives. */
    clip_multi(1.0, 1e20, 0);
}

/* tm_ctx_clip_grad_norm on CUDA buckets waits only when asked for the norm. */
Test(cuda_parity_update, clip_without_norm_does_not_wait) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    model_params mp;
    make_params(ctx, tm_cuda(0), &mp);
    set_grads(ctx, &mp, 0);
    uint64_t before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 5.0, NULL));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "the clip waited without norm_out");
    double norm = 0;
    TT_OK(ctx, tm_ctx_clip_grad_norm(ctx, 5.0, &norm));
    cr_assert_eq(tm_ctx_sync_count(ctx) - before, 1);
    /* 5 up to the rounding of the scaled gradient of the bf16 parameter "half" (2^-9 relative
     * per element): the H100 gave 4.9999869 */
    cr_assert(fabs(norm - 5.0) <= 1e-4 * 5.0, "norm after clipping to 5: %.17g", norm);
    tm_ctx_free(ctx);
}

/* ---- the clip's factor applied by the update on the device (tm_ctx_clip_grad_norm_deferred) -- */
/* The same bits as the clip's scale pass followed by the update (tests/common.c), on CUDA
 * buckets: adamw_multi_kernel scales each gradient as scale_multi_kernel stores it. */
Test(cuda_parity_update, clip_deferred_adamw_f32) {
    TT_SKIP_WITHOUT_CUDA();
    tt_check_clip_deferred(tm_cuda(0), TM_F32, 0);
}
Test(cuda_parity_update, clip_deferred_adamw_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    tt_check_clip_deferred(tm_cuda(0), TM_BF16, 0);
}
Test(cuda_parity_update, clip_deferred_sgd_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    tt_check_clip_deferred(tm_cuda(0), TM_BF16, 1);
}

/* Deferred clip + scaled AdamW step without the norm: no device wait at all (the step's
 * counter is a host buffer). */
Test(cuda_parity_update, clip_deferred_does_not_wait) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    model_params mp;
    make_params(ctx, tm_cuda(0), &mp);
    set_grads(ctx, &mp, 0);
    tm_optimizer *opt = NULL;
    TT_OK(ctx, tm_adamw_new(ctx, NULL, &opt));
    TT_OK(ctx, tm_optimizer_step(opt, -1.0)); /* the first step uploads the range table */
    uint64_t before = tm_ctx_sync_count(ctx);
    tm_tensor *gs = NULL;
    TT_OK(ctx, tm_ctx_clip_grad_norm_deferred(ctx, 5.0, NULL, &gs));
    cr_assert(gs != NULL);
    TT_OK(ctx, tm_optimizer_step_scaled(opt, -1.0, gs));
    uint64_t step_reads = tm_ctx_sync_count(ctx) - before;
    before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_optimizer_step(opt, -1.0));
    cr_assert_eq(step_reads, tm_ctx_sync_count(ctx) - before, "the deferred clip added a wait to the step");
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}
