/*
 * parity.c — the CUDA-against-CPU parity harness and its coverage registry (see parity.h).
 */
#include "parity.h"
#include "internal.h"

#include <stdlib.h>
#include <string.h>

int tt_parity_attn_sm80;
uint64_t tt_parity_attn_sm90;
int tt_parity_gating_split;
uint64_t tt_parity_gating_split_n;

tm_ctx *tt_parity_ctx(void) {
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 2;
    o.cuda_device = 0;
    o.arena_chunk_bytes = 8 << 20;
    tm_ctx *ctx = NULL;
    tm_status s = tm_ctx_new(&ctx, &o);
    cr_assert_eq(s, TM_OK, "tm_ctx_new(cuda_device=0): %s", tm_last_create_error());
    tm__attn_set_sm80(ctx, tt_parity_attn_sm80);
    tm__gating_set_split(ctx, tt_parity_gating_split);
    return ctx;
}

/* ---- coverage ---------------------------------------------------------------------------- */

/* Filled by constructors before main and by tt_parity_run inside a test's process; the
 * completeness test reads only what constructors wrote. */
enum { TT_PARITY_MAX_OPS = 256 };
static const char *covered[TT_PARITY_MAX_OPS];
static int n_covered;

void tt_parity_cover(const char *op) {
    if (tt_parity_covered(op) || n_covered == TT_PARITY_MAX_OPS) return;
    covered[n_covered++] = op;
}

int tt_parity_covered(const char *op) {
    for (int i = 0; i < n_covered; i++)
        if (strcmp(covered[i], op) == 0) return 1;
    return 0;
}

/* ---- host data --------------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) {
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* Uniform in [-2, 2): keeps softmax/exp inputs tame and products O(1). */
double *tt_parity_uniform(int64_t n, uint64_t seed) {
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) v[i] = (double)(rng_next(&seed) >> 11) * 0x1.0p-53 * 4.0 - 2.0;
    return v;
}

static int64_t numel_of(int nd, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < nd; d++) n *= shape[d];
    return n;
}

/* ---- one side (CPU or CUDA) of a parity run --------------------------------------------- */

typedef struct side {
    tm_tensor *in[TT_PARITY_MAX_IN];
    tm_tensor *out;
} side;

static void run_side(tm_ctx *ctx, const tt_pcase *pc, tm_dtype dt, tm_device dev, double **host_in, const double *host_g,
                     side *sd) {
    for (int i = 0; i < pc->n_in; i++) {
        tm_dtype idt = pc->is_index[i] ? pc->index_dt[i] : dt;
        TT_OK(ctx, tm_tensor_from_host(ctx, idt, pc->nd[i], pc->shape[i], dev, TM_F64, host_in[i], &sd->in[i]));
        if (!pc->is_index[i]) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, sd->in[i], 1));
    }
    TT_OK(ctx, pc->fn(ctx, sd->in, pc->iattr, &sd->out));
    cr_assert_eq(tm_tensor_dtype(sd->out), dt, "%s: output dtype", pc->name);
    int64_t oshape[TM_MAX_DIMS];
    int ond = tm_tensor_ndim(sd->out);
    for (int d = 0; d < ond; d++) oshape[d] = tm_tensor_dim(sd->out, d);
    tm_tensor *g;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, ond, oshape, dev, TM_F64, host_g, &g));
    TT_OK(ctx, tm_backward_with_grad(ctx, sd->out, g));
}

void tt_parity_run(const tt_pcase *pc, tm_dtype dt, double atol, double rtol) {
    tm_ctx *ctx = tt_parity_ctx();
    tt_parity_cover(pc->op);
    double *host_in[TT_PARITY_MAX_IN];
    for (int i = 0; i < pc->n_in; i++) {
        int64_t n = numel_of(pc->nd[i], pc->shape[i]);
        host_in[i] = tt_parity_uniform(n, 1000 + 17 * (uint64_t)i + (uint64_t)n);
        if (pc->is_index[i]) { /* uniform in [0, hi); a cross-entropy's gets one ignored row */
            int64_t V = pc->index_hi > 0 ? pc->index_hi : pc->shape[0][pc->nd[0] - 1];
            for (int64_t k = 0; k < n; k++) host_in[i][k] = (double)((int64_t)((host_in[i][k] + 2.0) * 0.25 * V) % V);
            if (pc->index_hi == 0 && n > 0) host_in[i][n / 2] = (double)pc->iattr[0];
        }
    }
    side cpu, gpu;
    memset(&cpu, 0, sizeof cpu);
    memset(&gpu, 0, sizeof gpu);
    /* The output shape is known after the first run; the upstream gradient is drawn for it. */
    tm_tensor *probe;
    tm_tensor *pin[TT_PARITY_MAX_IN];
    int prev = tm_ctx_set_grad_enabled(ctx, 0);
    for (int i = 0; i < pc->n_in; i++)
        TT_OK(ctx, tm_tensor_from_host(ctx, pc->is_index[i] ? pc->index_dt[i] : TM_F32, pc->nd[i], pc->shape[i],
                                       tm_cpu(), TM_F64, host_in[i], &pin[i]));
    TT_OK(ctx, pc->fn(ctx, pin, pc->iattr, &probe));
    tm_ctx_set_grad_enabled(ctx, prev);
    double *host_g = tt_parity_uniform(tm_tensor_numel(probe), 77);

    run_side(ctx, pc, dt, tm_cpu(), host_in, host_g, &cpu);
    run_side(ctx, pc, dt, tm_cuda(0), host_in, host_g, &gpu);
    cr_assert_eq(tm_tensor_device(gpu.out).type, TM_DEVICE_CUDA, "%s: output not on CUDA", pc->name);

    cr_assert_eq(tm_tensor_numel(gpu.out), tm_tensor_numel(cpu.out), "%s: output size", pc->name);
    double *go = tt_read(ctx, gpu.out), *co = tt_read(ctx, cpu.out);
    if (pc->atol_scale > 0) atol *= pc->atol_scale;
    double r = tt_close_ratio(go, co, tm_tensor_numel(cpu.out), atol, rtol);
    cr_assert(r <= 1.0, "%s (%s): forward differs, ratio %g", pc->name, tm_dtype_name(dt), r);
    free(go), free(co);
    for (int i = 0; i < pc->n_in; i++) {
        if (pc->is_index[i]) continue;
        tm_tensor *gg = tm_tensor_grad(gpu.in[i]), *cg = tm_tensor_grad(cpu.in[i]);
        cr_assert(gg && cg, "%s: input %d has no gradient (cuda %p, cpu %p)", pc->name, i, (void *)gg, (void *)cg);
        double *a = tt_read(ctx, gg), *b = tt_read(ctx, cg);
        double rg = tt_close_ratio(a, b, tm_tensor_numel(cg), atol, rtol);
        cr_assert(rg <= 1.0, "%s (%s): gradient of input %d differs, ratio %g", pc->name, tm_dtype_name(dt), i, rg);
        free(a), free(b);
    }
    for (int i = 0; i < pc->n_in; i++) free(host_in[i]);
    free(host_g);
    tt_parity_attn_sm90 += tm__attn_sm90_launches(ctx);
    tt_parity_gating_split_n += tm__gating_split_launches(ctx);
    tm_ctx_free(ctx);
}

