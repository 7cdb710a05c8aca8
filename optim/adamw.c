/*
 * adamw.c — the AdamW optimizer: tm_adamw_new and its per-parameter update (optimizer.c drives it).
 *
 * Update of one parameter p with gradient g at step t (Loshchilov & Hutter 2019, Alg. 2; bias
 * correction of Kingma & Ba 2015), exactly as documented in tinymoe.h:
 *   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
 *   p -= lr * ( (m / bc1) / (sqrt(v / bc2) + eps) + wd * p ),   bc_i = 1 - beta_i^t
 * Weight decay is decoupled (it multiplies p, not g) and applied to parameters of 2 or more
 * dims only: decaying gains (RMSNorm weights) and biases towards 0 only hurts.
 *
 * State: m and v are f32 buffers named "<param>.adamw_m" / "<param>.adamw_v", created by
 * tm_adamw_new on the parameter's device (see optimizer.c for their lifetime).
 *
 * Precision: f32 and bf16 parameters are updated in f32 arithmetic, f64 parameters in f64
 * (state stays f32 either way). bf16 parameters are rounded to nearest after each update;
 * updates smaller than half a bf16 ulp of p are lost — keep f32 master weights for real
 * training in bf16.
 */
#include <math.h>

#include "optimizer.h"

enum { PAR_MIN = 1 << 14 };

tm_adamw_config tm_adamw_config_default(void) {
    tm_adamw_config c = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0};
    return c;
}

/* Written as negated ranges so that NaN fails every test. */
static tm_status check_config(tm_ctx *ctx, const tm_adamw_config *c) {
    const char *fn = "tm_adamw_new";
    if (!(c->lr >= 0.0 && isfinite(c->lr)))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: lr must be finite and >= 0, got %g", fn, c->lr);
    if (!(c->beta1 >= 0.0 && c->beta1 < 1.0))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: beta1 must be in [0, 1), got %g", fn, c->beta1);
    if (!(c->beta2 >= 0.0 && c->beta2 < 1.0))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: beta2 must be in [0, 1), got %g", fn, c->beta2);
    if (!(c->eps > 0.0 && isfinite(c->eps)))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: eps must be finite and > 0, got %g", fn, c->eps);
    if (!(c->weight_decay >= 0.0 && isfinite(c->weight_decay)))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: weight_decay must be finite and >= 0, got %g", fn,
                       c->weight_decay);
    return TM_OK;
}

tm_status tm_adamw_new(tm_ctx *ctx, const tm_adamw_config *cfg, tm_optimizer **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "tm_adamw_new: out is NULL");
    tm_adamw_config c = cfg ? *cfg : tm_adamw_config_default();
    TM__TRY(check_config(ctx, &c));
    static const char *const suffix[2] = {".adamw_m", ".adamw_v"};
    tm_optimizer *opt = NULL;
    TM__TRY(tm__optimizer_create(ctx, "tm_adamw_new", 2, suffix, "optim.adamw.steps", &opt));
    opt->kind = TM__OPT_ADAMW;
    opt->name = "AdamW";
    opt->cfg.adamw = c;
    opt->lr = c.lr;
    *out = opt;
    return TM_OK;
}

/* One parameter's update. LOAD/STORE convert between the parameter's storage type PT and the
 * compute type T; m and v are always f32. 1 - beta (omb) and the bias corrections arrive
 * computed in f64: 1 - 0.999f in f32 is 0.00099998713, not 0.001, which would leave
 * (1 - beta2) / bc2 != 1 at step 1 and put a 1e-5 relative error on every early update. */
#define ADAMW_KERNEL(SFX, PT, T, SQRT, LOAD, STORE)                                               \
    static void adamw_##SFX(PT *p, const PT *g, float *m, float *v, int64_t n, T lr, T b1,       \
                            T omb1, T b2, T omb2, T eps, T wd, T bc1, T bc2, int nth) {           \
        _Pragma("omp parallel for num_threads(nth) if (n >= PAR_MIN) schedule(static)")           \
        for (int64_t i = 0; i < n; i++) {                                                         \
            T gi = LOAD(g[i]), pi = LOAD(p[i]);                                                   \
            T mi = b1 * (T)m[i] + omb1 * gi;                                                      \
            T vi = b2 * (T)v[i] + omb2 * gi * gi;                                                 \
            m[i] = (float)mi;                                                                     \
            v[i] = (float)vi;                                                                     \
            pi -= lr * ((mi / bc1) / (SQRT(vi / bc2) + eps) + wd * pi);                           \
            p[i] = STORE(pi);                                                                     \
        }                                                                                         \
    }
#define ID(x) (x)
ADAMW_KERNEL(f32, float, float, sqrtf, ID, ID)
ADAMW_KERNEL(f64, double, double, sqrt, ID, ID)
ADAMW_KERNEL(bf16, uint16_t, float, sqrtf, tm__bf16_to_f32, tm__f32_to_bf16)
#undef ID

void tm__adamw_update(const tm_optimizer *opt, int i, double lr, int64_t t) {
    const tm_adamw_config *c = &opt->cfg.adamw;
    tm_tensor *p = opt->param[i];
    double bc1 = 1.0 - pow(c->beta1, (double)t), bc2 = 1.0 - pow(c->beta2, (double)t);
    double omb1 = 1.0 - c->beta1, omb2 = 1.0 - c->beta2;
    double wd = p->ndim >= 2 ? c->weight_decay : 0.0;
    int64_t n = tm__numel(p);
    int nth = tm__nthreads(opt->ctx);
    float *m = tm__data(opt->state[0][i]), *v = tm__data(opt->state[1][i]);
    switch (p->dtype) {
    case TM_F32:
        adamw_f32(tm__data(p), tm__data(p->grad), m, v, n, (float)lr, (float)c->beta1, (float)omb1,
                  (float)c->beta2, (float)omb2, (float)c->eps, (float)wd, (float)bc1, (float)bc2, nth);
        break;
    case TM_BF16:
        adamw_bf16(tm__data(p), tm__data(p->grad), m, v, n, (float)lr, (float)c->beta1, (float)omb1,
                   (float)c->beta2, (float)omb2, (float)c->eps, (float)wd, (float)bc1, (float)bc2, nth);
        break;
    case TM_F64:
        adamw_f64(tm__data(p), tm__data(p->grad), m, v, n, lr, c->beta1, omb1, c->beta2, omb2, c->eps, wd, bc1,
                  bc2, nth);
        break;
    default: /* tm_optimizer_step admits float dtypes only */
        break;
    }
}
