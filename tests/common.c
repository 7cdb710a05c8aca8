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

const char *tt_python_with(const char *module) {
    static char found[1024];
    const char *cands[] = {getenv("TM_PYTHON"), ".pyenv/bin/python", "python3"};
    for (int i = 0; i < 3; i++) {
        if (!cands[i] || !cands[i][0]) continue;
        char cmd[1200];
        snprintf(cmd, sizeof cmd, "'%s' -c 'import %s' >/dev/null 2>&1", cands[i], module);
        if (system(cmd) == 0) {
            snprintf(found, sizeof found, "%s", cands[i]);
            return found;
        }
    }
    const char *req = getenv("TM_REQUIRE_PYDEPS");
    cr_assert(!(req && !strcmp(req, "1")), "TM_REQUIRE_PYDEPS=1 but no Python imports %s (run scripts/install-pydeps.sh)",
              module);
    return NULL;
}
