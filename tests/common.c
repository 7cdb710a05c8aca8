/* common.c — shared test helpers; see common.h. */
#include "common.h"

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

tm_ctx *tt_ctx(void) { return tt_ctx_threads(2); }

tm_ctx *tt_ctx_threads(int n) {
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = n;
    o.arena_chunk_bytes = 4 << 20;
    tm_ctx *ctx = NULL;
    tm_status s = tm_ctx_new(&ctx, &o);
    cr_assert_eq(s, TM_OK, "tm_ctx_new: %s", tm_last_create_error());
    return ctx;
}

static tm_tensor *from_f64(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, const double *v) {
    tm_tensor *t = NULL;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, ndim, shape, tm_cpu(), TM_F64, v, &t));
    return t;
}

/* The tests draw their random inputs from the library's own counter-based RNG through a
 * private stream name, so a failing case is reproducible from its seed alone. */
static double *draw(int64_t n, uint64_t seed, int normal) {
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    for (int64_t i = 0; i < n; i++) {
        uint32_t ctr[4] = {(uint32_t)i, (uint32_t)(i >> 32), 0x7e57u, 0}, r[4];
        tm_philox4x32_10(ctr, key, r);
        double u1 = ((double)(r[0] >> 5) * 67108864.0 + (double)(r[1] >> 6) + 0.5) / 9007199254740992.0;
        double u2 = ((double)(r[2] >> 5) * 67108864.0 + (double)(r[3] >> 6) + 0.5) / 9007199254740992.0;
        v[i] = normal ? sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2) : u1;
    }
    return v;
}

tm_tensor *tt_randn(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, uint64_t seed) {
    int64_t n = tm__numel_of(ndim, shape);
    double *v = draw(n, seed, 1);
    tm_tensor *t = from_f64(ctx, dt, ndim, shape, v);
    free(v);
    return t;
}

tm_tensor *tt_randu(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, uint64_t seed, double lo, double hi) {
    int64_t n = tm__numel_of(ndim, shape);
    double *v = draw(n, seed, 0);
    for (int64_t i = 0; i < n; i++) v[i] = lo + (hi - lo) * v[i];
    tm_tensor *t = from_f64(ctx, dt, ndim, shape, v);
    free(v);
    return t;
}

tm_tensor *tt_randint(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, uint64_t seed, int64_t hi) {
    int64_t n = tm__numel_of(ndim, shape);
    double *v = draw(n, seed, 0);
    for (int64_t i = 0; i < n; i++) {
        int64_t k = (int64_t)(v[i] * (double)hi);
        v[i] = (double)(k < hi ? k : hi - 1);
    }
    tm_tensor *t = from_f64(ctx, dt, ndim, shape, v);
    free(v);
    return t;
}

tm_tensor *tt_from(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, const double *vals) {
    return from_f64(ctx, dt, ndim, shape, vals);
}

double *tt_read(tm_ctx *ctx, const tm_tensor *t) {
    int64_t n = tm_tensor_numel(t);
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    TT_OK(ctx, tm_tensor_read(ctx, t, TM_F64, v, n));
    return v;
}

double tt_close_ratio(const double *a, const double *b, int64_t n, double atol, double rtol) {
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]);
        if (d == 0) continue; /* exact, also with zero tolerances */
        double r = d / (atol + rtol * fabs(b[i]));
        if (isnan(r)) return INFINITY;
        if (r > worst) worst = r;
    }
    return worst;
}

void tt_assert_close_host(tm_ctx *ctx, const tm_tensor *got, const double *want, double atol, double rtol) {
    int64_t n = tm_tensor_numel(got);
    double *g = tt_read(ctx, got);
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(g[i] - want[i]);
        if (d != 0 && !(d / (atol + rtol * fabs(want[i])) <= 1.0)) {
            double gi = g[i];
            free(g);
            cr_assert_fail("element %lld: got %.17g want %.17g (atol %g rtol %g)", (long long)i, gi, want[i], atol, rtol);
        }
    }
    free(g);
}

void tt_assert_close(tm_ctx *ctx, const tm_tensor *got, const tm_tensor *want, double atol, double rtol) {
    cr_assert_eq(tm_tensor_numel(got), tm_tensor_numel(want), "numel %lld vs %lld", (long long)tm_tensor_numel(got),
                 (long long)tm_tensor_numel(want));
    double *w = tt_read(ctx, want);
    tt_assert_close_host(ctx, got, w, atol, rtol);
    free(w);
}

static double dot_host(tm_ctx *ctx, tm_tensor *out, const double *g) {
    int64_t n = tm_tensor_numel(out);
    double *o = tt_read(ctx, out);
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += o[i] * g[i];
    free(o);
    return s;
}

double tt_gradcheck(tm_ctx *ctx, tt_fn fn, void *user, int n_in, tm_tensor **inputs, const int *check, double eps,
                    double atol, double rtol) {
    /* Parameters keep their slot in the gradient buffer (zeroed here); temporaries get a
     * fresh gradient. */
    TT_OK(ctx, tm_ctx_zero_grad(ctx));
    for (int i = 0; i < n_in; i++) {
        if (!check[i]) continue;
        cr_assert_eq(tm_tensor_dtype(inputs[i]), TM_F64, "gradcheck: input %d must be f64", i);
        if (inputs[i]->is_param) continue;
        inputs[i]->grad = NULL;
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, inputs[i], 1));
    }
    int prev = tm_ctx_set_grad_enabled(ctx, 1);
    tm_tensor *out = NULL;
    TT_OK(ctx, fn(ctx, inputs, user, &out));
    int64_t m = tm_tensor_numel(out);
    int64_t oshape[TM_MAX_DIMS];
    for (int d = 0; d < tm_tensor_ndim(out); d++) oshape[d] = tm_tensor_dim(out, d);
    tm_tensor *g = tt_randn(ctx, tm_tensor_dtype(out), tm_tensor_ndim(out), oshape, 0x9e3779b97f4a7c15ull ^ (uint64_t)m);
    double *gh = tt_read(ctx, g);
    TT_OK(ctx, tm_backward_with_grad(ctx, out, g));

    tm_ctx_set_grad_enabled(ctx, 0);
    double worst = 0;
    for (int i = 0; i < n_in; i++) {
        if (!check[i]) continue;
        int64_t n = tm_tensor_numel(inputs[i]);
        double *an = calloc((size_t)(n ? n : 1), sizeof(double));
        if (tm_tensor_grad(inputs[i])) {
            double *t = tt_read(ctx, tm_tensor_grad(inputs[i]));
            memcpy(an, t, sizeof(double) * (size_t)n);
            free(t);
        }
        double *x = tt_read(ctx, inputs[i]);
        for (int64_t j = 0; j < n; j++) {
            double x0 = x[j];
            x[j] = x0 + eps;
            TT_OK(ctx, tm_tensor_write(ctx, inputs[i], TM_F64, x, n));
            TT_OK(ctx, fn(ctx, inputs, user, &out));
            double lp = dot_host(ctx, out, gh);
            x[j] = x0 - eps;
            TT_OK(ctx, tm_tensor_write(ctx, inputs[i], TM_F64, x, n));
            TT_OK(ctx, fn(ctx, inputs, user, &out));
            double lm = dot_host(ctx, out, gh);
            x[j] = x0;
            double num = (lp - lm) / (2 * eps);
            double r = fabs(an[j] - num) / (atol + rtol * fabs(num));
            if (isnan(r)) r = INFINITY;
            if (r > worst) worst = r;
        }
        TT_OK(ctx, tm_tensor_write(ctx, inputs[i], TM_F64, x, n));
        free(x);
        free(an);
    }
    free(gh);
    tm_ctx_set_grad_enabled(ctx, prev);
    return worst;
}

static char tt_dir[128];

const char *tt_tmpdir_make(const char *prefix) {
    snprintf(tt_dir, sizeof tt_dir, "/tmp/%sXXXXXX", prefix);
    cr_assert(mkdtemp(tt_dir), "mkdtemp %s: %s", tt_dir, strerror(errno));
    return tt_dir;
}

static int rm_entry(const char *p, const struct stat *st, int flag, struct FTW *ftw) { return remove(p); }
void tt_tmpdir_remove(void) {
    if (tt_dir[0]) nftw(tt_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    tt_dir[0] = 0;
}

const char *tt_path(const char *name) {
    static char buf[8][256];
    static int i;
    char *b = buf[i++ % 8];
    snprintf(b, sizeof buf[0], "%s/%s", tt_dir, name);
    return b;
}

unsigned char *tt_slurp(const char *path, long *len) {
    FILE *f = fopen(path, "rb");
    cr_assert(f, "fopen %s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    *len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)*len + 1);
    cr_assert_eq(fread(b, 1, (size_t)*len, f), (size_t)*len);
    b[*len] = 0; /* text files can be used as strings */
    fclose(f);
    return b;
}

int tt_dir_entries(const char *dir) {
    DIR *d = opendir(dir);
    cr_assert(d, "opendir %s", dir);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

void tt_check_decay_only_on_matrices(tt_make_optimizer make) {
    tm_ctx *ctx = tt_ctx();
    int64_t s3[3] = {2, 1, 3}, s2[2] = {3, 5}, s1[1] = {7};
    tm_tensor *p3 = NULL, *p2 = NULL, *p1 = NULL, *p0 = NULL;
    TT_OK(ctx, tm_param_new(ctx, "t3", TM_F32, 3, s3, tm_cpu(), &p3));
    TT_OK(ctx, tm_param_new(ctx, "m2", TM_F32, 2, s2, tm_cpu(), &p2));
    TT_OK(ctx, tm_param_new(ctx, "gain", TM_F32, 1, s1, tm_cpu(), &p1));
    TT_OK(ctx, tm_param_new(ctx, "scalar", TM_F32, 0, NULL, tm_cpu(), &p0));
    tm_tensor *ps[4] = {p3, p2, p1, p0};
    for (int i = 0; i < 4; i++) TT_OK(ctx, tm_tensor_init_normal(ctx, ps[i], 7, NULL, 0.0, 1.0));
    double *before[4];
    for (int i = 0; i < 4; i++) before[i] = tt_read(ctx, ps[i]);
    tm_optimizer *opt = make(ctx, 0.5, 0.2);
    TT_OK(ctx, tm_ctx_zero_grad(ctx));
    TT_OK(ctx, tm_optimizer_step(opt, -1.0));
    for (int i = 0; i < 4; i++) {
        int64_t n = tm_tensor_numel(ps[i]);
        double f = tm_tensor_ndim(ps[i]) >= 2 ? 1.0 - 0.5 * 0.2 : 1.0;
        for (int64_t k = 0; k < n; k++) before[i][k] *= f;
        tt_assert_close_host(ctx, ps[i], before[i], 1e-30, 1e-6);
        free(before[i]);
    }
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
}

const char *tt_python_with_req(const char *modules, const char *require_var, const char *how) {
    static char found[1024];
    const char *cands[] = {getenv("TM_PYTHON"), ".pyenv/bin/python", "python3"};
    for (int i = 0; i < 3; i++) {
        if (!cands[i] || !cands[i][0]) continue;
        char cmd[1200];
        snprintf(cmd, sizeof cmd, "'%s' -c 'import %s' >/dev/null 2>&1", cands[i], modules);
        if (system(cmd) == 0) {
            snprintf(found, sizeof found, "%s", cands[i]);
            return found;
        }
    }
    const char *req = getenv(require_var);
    cr_assert(!(req && !strcmp(req, "1")), "%s=1 but no Python imports %s (tried $TM_PYTHON=%s, .pyenv/bin/python, python3): %s",
              require_var, modules, cands[0] ? cands[0] : "(unset)", how);
    return NULL;
}

const char *tt_python_with(const char *module) {
    return tt_python_with_req(module, "TM_REQUIRE_PYDEPS", "run scripts/install-pydeps.sh");
}

/* ---- tt_check_clip_deferred ---------------------------------------------------------------- */

enum { CD_PARAMS = 3, CD_STEPS = 4 };
static const int CD_NDIM[CD_PARAMS] = {2, 1, 2};
static const int64_t CD_SHAPE[CD_PARAMS][2] = {{37, 29}, {301, 1}, {5, 3000}}; /* the last spans chunks */

static tm_ctx *cd_ctx(tm_device dev, tm_dtype dt, int sgd, tm_tensor **p, tm_optimizer **opt) {
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 2;
    o.arena_chunk_bytes = 4 << 20;
    if (dev.type == TM_DEVICE_CUDA) o.cuda_device = dev.index;
    tm_ctx *ctx = NULL;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK, "tm_ctx_new: %s", tm_last_create_error());
    for (int i = 0; i < CD_PARAMS; i++) {
        char nm[2] = {(char)('a' + i), 0};
        TT_OK(ctx, tm_param_new(ctx, nm, dt, CD_NDIM[i], CD_SHAPE[i], dev, &p[i]));
        TT_OK(ctx, tm_tensor_init_normal(ctx, p[i], 3 + (uint64_t)i, NULL, 0.0, 1.0));
    }
    if (sgd) {
        tm_sgd_config c = tm_sgd_config_default();
        c.lr = 0.05, c.momentum = 0.9, c.weight_decay = 0.01;
        TT_OK(ctx, tm_sgd_new(ctx, &c, opt));
    } else {
        tm_adamw_config c = tm_adamw_config_default();
        c.lr = 1e-2, c.beta2 = 0.95, c.weight_decay = 0.1;
        TT_OK(ctx, tm_adamw_new(ctx, &c, opt));
    }
    return ctx;
}

/* t of ctx a and the tensor of the same name in b hold the same bits (both read as f64, which
 * every f32 / bf16 / f64 value converts to exactly). */
static void cd_same(tm_ctx *a, tm_ctx *b, const char *name, int step) {
    tm_tensor *ta = tm_ctx_find(a, name), *tb = tm_ctx_find(b, name);
    cr_assert(ta && tb, "step %d: \"%s\" missing", step, name);
    int64_t n = tm_tensor_numel(ta);
    double *x = tt_read(a, ta), *y = tt_read(b, tb);
    for (int64_t k = 0; k < n; k++)
        cr_assert(memcmp(&x[k], &y[k], sizeof x[k]) == 0, "step %d: %s[%lld] %.17g (clip + step) vs %.17g (deferred)",
                  step, name, (long long)k, x[k], y[k]);
    free(x);
    free(y);
}

void tt_check_clip_deferred(tm_device dev, tm_dtype dt, int sgd) {
    tm_tensor *pa[CD_PARAMS], *pb[CD_PARAMS];
    tm_optimizer *oa, *ob;
    tm_ctx *a = cd_ctx(dev, dt, sgd, pa, &oa), *b = cd_ctx(dev, dt, sgd, pb, &ob);
    for (int step = 0; step < CD_STEPS; step++) {
        /* Norms near 140: clipping at 1 scales; step 2 does not clip (factor exactly 1). */
        double max_norm = step == 2 ? 1e9 : 1.0, na = -1, nb = -2;
        double *g[CD_PARAMS];
        for (int i = 0; i < CD_PARAMS; i++) {
            tm_tensor *r = tt_randn(a, dt, CD_NDIM[i], CD_SHAPE[i], 100 + 10 * (uint64_t)step + (uint64_t)i);
            g[i] = tt_read(a, r);
            TT_OK(a, tm_tensor_write(a, tm_tensor_grad(pa[i]), TM_F64, g[i], tm_tensor_numel(pa[i])));
            TT_OK(b, tm_tensor_write(b, tm_tensor_grad(pb[i]), TM_F64, g[i], tm_tensor_numel(pb[i])));
        }
        TT_OK(a, tm_ctx_clip_grad_norm(a, max_norm, &na));
        TT_OK(a, tm_optimizer_step(oa, -1.0));
        tm_tensor *gs = NULL;
        TT_OK(b, tm_ctx_clip_grad_norm_deferred(b, max_norm, &nb, &gs));
        cr_assert_eq(na, nb, "step %d: norm %.17g (clip) vs %.17g (deferred)", step, na, nb);
        cr_assert(gs && tm_tensor_ndim(gs) == 0, "step %d: one device, no communicator: a 0-d factor", step);
        cr_assert_eq(tm_tensor_dtype(gs), dev.type == TM_DEVICE_CUDA ? TM_F32 : TM_F64);
        double f = 0;
        TT_OK(b, tm_tensor_read(b, gs, TM_F64, &f, 1));
        double want = max_norm > nb ? 1.0 : max_norm / (nb + 1e-6);
        cr_assert(fabs(f - want) <= 1e-6 * want, "step %d: factor %.17g, want %.17g", step, f, want);
        TT_OK(b, tm_optimizer_step_scaled(ob, -1.0, gs));
        for (int i = 0; i < CD_PARAMS; i++) {
            /* AdamW applied the factor as it read the gradients, which it leaves unscaled. */
            if (!sgd) {
                double *after = tt_read(b, tm_tensor_grad(pb[i]));
                cr_assert(memcmp(after, g[i], sizeof *after * (size_t)tm_tensor_numel(pb[i])) == 0,
                          "step %d: AdamW wrote the gradients of %s", step, tm_tensor_name(pb[i]));
                free(after);
            }
            free(g[i]);
            char nm[32];
            const char *base = tm_tensor_name(pa[i]);
            cd_same(a, b, base, step);
            const char *sfx[3] = {sgd ? ".sgd_b" : ".adamw_m", sgd ? NULL : ".adamw_v", dt == TM_BF16 ? ".master" : NULL};
            for (int j = 0; j < 3; j++) {
                if (!sfx[j]) continue;
                snprintf(nm, sizeof nm, "%s%s", base, sfx[j]);
                cd_same(a, b, nm, step);
            }
        }
        TT_OK(a, tm_ctx_zero_grad(a));
        TT_OK(b, tm_ctx_zero_grad(b));
        tm_ctx_arena_reset(a);
        tm_ctx_arena_reset(b);
    }
    tm_optimizer_free(oa);
    tm_optimizer_free(ob);
    tm_ctx_free(a);
    tm_ctx_free(b);
}
