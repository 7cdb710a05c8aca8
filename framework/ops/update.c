/*
 * update.c — the update ops: AdamW, SGD, the gradient sum of squares, gradient scaling and
 * the aux-loss-free expert-bias update, as non-differentiable rows of the op table that write
 * their first input in place (kernels: kernels/cpu/update.c; AdamW, SGD, sumsq and scale
 * also kernels/cuda/update.cu). optim/ builds tm_optimizer_step
 * and tm_ctx_clip_grad_norm from them over bucket ranges, so the optimizer has no device code.
 *
 * Attributes (kernels read them by these indices):
 *   sgd_update    in: param, grad [, b] [, master]   iattr[0] has_b, iattr[1] has_master
 *                 fattr: 0 lr, 1 momentum, 2 wd; iattr[2] nesterov
 *   moe_expert_bias_update  in: expert_bias, counts; fattr[0] rate
 *   adamw_update_multi, grad_sumsq_multi, grad_scale_multi: see "fused updates" below
 * AdamW, the gradient sum of squares and gradient scaling have one op each, over a table of
 * ranges: the public tm_adamw_update, tm_grad_sumsq and tm_grad_scale are that op over one
 * range (a table of one row in the context's segment list of the tensor's device).
 */
#include <math.h>

#include "internal.h"
#include "update_multi.h"

static tm_status check_flat(tm__call *c, int i, const char *what, int64_t n, int want_f32) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *t = c->in[i];
    if (!tm__is_contiguous(t))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s %s must be contiguous (updates write in place)", tm__opname(c),
                       what, tm__tdesc(ctx, t));
    if (tm__numel(t) != n)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: %s %s must have %lld elements like the parameter %s", tm__opname(c), what,
                       tm__tdesc(ctx, t), (long long)n, tm__tdesc(ctx, c->in[0]));
    if (want_f32 && t->dtype != TM_F32)
        return tm__err(ctx, TM_ERR_DTYPE, "%s: %s must be f32, got %s", tm__opname(c), what, tm__tdesc(ctx, t));
    return TM_OK;
}

static tm_status check_param_grad(tm__call *c) {
    TM__TRY(tm__check_float(c, 0));
    int64_t n = tm__numel(c->in[0]);
    TM__TRY(check_flat(c, 0, "param", n, 0));
    TM__TRY(check_flat(c, 1, "grad", n, 0));
    return tm__check_same_dtype(c, 0, 1);
}

/* The checks of an op over one range, made by its front end before the range goes into a
 * segment table: the argument t (what) of op `op` is non-NULL, of ctx, on the device of ref
 * (when given), contiguous, with n elements (n < 0: any), float, or f32 when want_f32. */
static tm_status range_arg(tm_ctx *ctx, const char *op, const char *what, const tm_tensor *t, const tm_tensor *ref,
                           int64_t n, int want_f32) {
    if (!t) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s is NULL", op, what);
    if (t->ctx != ctx) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s belongs to another context", op, what);
    if (ref && !tm__same_device(t->device, ref->device))
        return tm__err(ctx, TM_ERR_DEVICE, "%s: %s %s is not on the device of %s", op, what, tm__tdesc(ctx, t),
                       tm__tdesc(ctx, ref));
    if (!tm__is_contiguous(t))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s %s must be contiguous (updates write in place)", op, what,
                       tm__tdesc(ctx, t));
    if (n >= 0 && tm__numel(t) != n)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: %s %s must have %lld elements like the parameter %s", op, what,
                       tm__tdesc(ctx, t), (long long)n, tm__tdesc(ctx, ref));
    if (want_f32 && t->dtype != TM_F32)
        return tm__err(ctx, TM_ERR_DTYPE, "%s: %s must be f32, got %s", op, what, tm__tdesc(ctx, t));
    if (!want_f32 && !tm__is_float(t->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "%s: %s must be float, got %s", op, what, tm__tdesc(ctx, t));
    return TM_OK;
}

tm_status tm__sgd_update_check(tm__call *c) {
    if (c->n_in != 2 + (int)c->iattr[0] + (int)c->iattr[1])
        return tm__err(c->ctx, TM_ERR_INTERNAL, "sgd_update: %d inputs", c->n_in);
    TM__TRY(check_param_grad(c));
    int64_t n = tm__numel(c->in[0]);
    int k = 2;
    if (c->iattr[0]) TM__TRY(check_flat(c, k++, "momentum buffer b", n, 1));
    if (c->iattr[1]) TM__TRY(check_flat(c, k++, "master", n, 1));
    return TM_OK;
}

tm_status tm__moe_expert_bias_update_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *bias = c->in[0], *counts = c->in[1];
    if (bias->dtype != TM_F32 && bias->dtype != TM_F64)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_expert_bias_update: expert_bias must be f32 or f64 [E], got %s",
                       tm__tdesc(ctx, bias));
    if (counts->dtype != TM_I64)
        return tm__err(ctx, TM_ERR_DTYPE, "moe_expert_bias_update: counts must be i64 [E], got %s", tm__tdesc(ctx, counts));
    if (bias->ndim != 1 || bias->shape[0] == 0)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_expert_bias_update: expert_bias must be [E] with E >= 1, got %s",
                       tm__tdesc(ctx, bias));
    if (counts->ndim != 1 || counts->shape[0] != bias->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "moe_expert_bias_update: counts must be [%lld] like expert_bias %s, got %s",
                       (long long)bias->shape[0], tm__tdesc(ctx, bias), tm__tdesc(ctx, counts));
    if (!isfinite(c->fattr[0]))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_expert_bias_update: rate must be finite, got %g", c->fattr[0]);
    return TM_OK;
}

/* ---- public functions -------------------------------------------------------------------- */

/* adamw_update_multi's fattr[TM__ADAMW_*] (framework/update_multi.h). 1 - beta and the bias
 * corrections in f64: 1 - 0.999f in f32 is 0.00099998713, which would leave (1 - beta2) / bc2
 * != 1 at step 1 (a 1e-5 error on every early update). */
static void adamw_attrs(double *f, const tm_adamw_config *cfg, double lr, int64_t step) {
    f[TM__ADAMW_LR] = lr;
    f[TM__ADAMW_BETA1] = cfg->beta1;
    f[TM__ADAMW_OMB1] = 1.0 - cfg->beta1;
    f[TM__ADAMW_BETA2] = cfg->beta2;
    f[TM__ADAMW_OMB2] = 1.0 - cfg->beta2;
    f[TM__ADAMW_EPS] = cfg->eps;
    f[TM__ADAMW_BC1] = 1.0 - pow(cfg->beta1, (double)step);
    f[TM__ADAMW_BC2] = 1.0 - pow(cfg->beta2, (double)step);
}
_Static_assert(TM__ADAMW_NATTR <= TM__MAX_ATTR, "AdamW's attributes fit a call");

/* The context's segment list of dev, emptied for one range of kind (the public single-tensor
 * updates: one row, uploaded when it differs from the table the device holds). */
static tm_status one_range(tm_ctx *ctx, tm_device dev, int kind, tm__segs **l) {
    TM__TRY(tm__ctx_segs(ctx, dev, 1, l));
    return tm__segs_begin(ctx, *l, kind, 1);
}

tm_status tm_adamw_update(tm_ctx *ctx, tm_tensor *param, tm_tensor *grad, tm_tensor *m, tm_tensor *v,
                          tm_tensor *master, const tm_adamw_config *cfg, double lr, double weight_decay, int64_t step) {
    static const char op[] = "adamw_update";
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!cfg) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: cfg is NULL", op);
    if (step < 1) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: step must be >= 1, got %lld", op, (long long)step);
    if (!isfinite(lr) || !isfinite(weight_decay))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: lr %g and weight_decay %g must be finite", op, lr, weight_decay);
    TM__TRY(range_arg(ctx, op, "param", param, NULL, -1, 0));
    int64_t n = tm__numel(param);
    TM__TRY(range_arg(ctx, op, "grad", grad, param, n, 0));
    if (grad->dtype != param->dtype)
        return tm__err(ctx, TM_ERR_DTYPE, "%s: grad %s must have the dtype of param %s", op, tm__tdesc(ctx, grad),
                       tm__tdesc(ctx, param));
    TM__TRY(range_arg(ctx, op, "m", m, param, n, 1));
    TM__TRY(range_arg(ctx, op, "v", v, param, n, 1));
    if (master) TM__TRY(range_arg(ctx, op, "master", master, param, n, 1));
    if (!tm__op_available(ctx, "adamw_update_multi", param->device))
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: no kernel for %s", op, tm__tdesc(ctx, param));
    if (n == 0) return TM_OK;
    tm__segs *l;
    TM__TRY(one_range(ctx, param->device, TM__SEGS_ADAMW, &l));
    TM__TRY(tm__segs_add_adamw(ctx, l, param, grad, m, v, master, 0, n, 0, 0, 0, weight_decay));
    return tm__adamw_update_multi(ctx, l, cfg, lr, step, NULL);
}

tm_status tm_sgd_update(tm_ctx *ctx, tm_tensor *param, tm_tensor *grad, tm_tensor *b, tm_tensor *master,
                        const tm_sgd_config *cfg, double lr, double weight_decay) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!cfg) return tm__err(ctx, TM_ERR_INVALID_ARG, "sgd_update: cfg is NULL");
    if (!isfinite(lr) || !isfinite(weight_decay))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "sgd_update: lr %g and weight_decay %g must be finite", lr, weight_decay);
    if (!b && cfg->momentum > 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "sgd_update: momentum %g needs the buffer b", cfg->momentum);
    tm__call c = tm__call_init(ctx, TM__OP_SGD_UPDATE);
    int k = 0;
    c.in[k++] = param;
    c.in[k++] = grad;
    if (b) c.in[k++] = b;
    if (master) c.in[k++] = master;
    c.n_in = k;
    c.iattr[0] = b != NULL;
    c.iattr[1] = master != NULL;
    c.iattr[2] = cfg->nesterov;
    c.fattr[0] = lr;
    c.fattr[1] = cfg->momentum;
    c.fattr[2] = weight_decay;
    return tm__op_run(&c);
}

/* The dtype of the sums of squares and the clip factor: f64 cannot live on CUDA. */
static tm_dtype clip_dtype(tm_device dev) { return dev.type == TM_DEVICE_CUDA ? TM_F32 : TM_F64; }

tm_status tm_grad_sumsq(tm_ctx *ctx, tm_tensor *grad, tm_tensor **out) {
    static const char op[] = "grad_sumsq";
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: out is NULL", op);
    TM__TRY(range_arg(ctx, op, "grad", grad, NULL, -1, 0));
    if (!tm__op_available(ctx, "grad_sumsq_multi", grad->device))
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: no kernel for %s", op, tm__tdesc(ctx, grad));
    int64_t none[1] = {0};
    if (tm__numel(grad) == 0) return tm_tensor_zeros(ctx, clip_dtype(grad->device), 0, none, grad->device, out);
    tm__segs *l;
    TM__TRY(one_range(ctx, grad->device, TM__SEGS_GRADS, &l));
    TM__TRY(tm__segs_add_grad(ctx, l, grad, 0, tm__numel(grad)));
    tm_tensor *partials, *factor;
    TM__TRY(tm__grad_sumsq_multi(ctx, l, 0.0, &partials, &factor));
    return tm_reshape(ctx, partials, 0, none, out);
}

tm_status tm_grad_scale(tm_ctx *ctx, tm_tensor *grad, double scale) {
    static const char op[] = "grad_scale";
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!isfinite(scale)) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: scale must be finite, got %g", op, scale);
    TM__TRY(range_arg(ctx, op, "grad", grad, NULL, -1, 0));
    if (!tm__op_available(ctx, "grad_scale_multi", grad->device))
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: no kernel for %s", op, tm__tdesc(ctx, grad));
    if (tm__numel(grad) == 0) return TM_OK;
    tm_tensor *factor;
    TM__TRY(tm__clip_factor(ctx, grad->device, scale, &factor));
    tm__segs *l;
    TM__TRY(one_range(ctx, grad->device, TM__SEGS_GRADS, &l));
    TM__TRY(tm__segs_add_grad(ctx, l, grad, 0, tm__numel(grad)));
    return tm__grad_scale_multi(ctx, l, factor);
}

tm_status tm__clip_factor(tm_ctx *ctx, tm_device dev, double scale, tm_tensor **out) {
    int64_t none[1] = {0};
    return tm_tensor_from_host(ctx, clip_dtype(dev), 0, none, dev, TM_F64, &scale, out);
}

tm_status tm_moe_expert_bias_update(tm_ctx *ctx, tm_tensor *expert_bias, tm_tensor *counts, double rate) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!expert_bias || !counts)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_expert_bias_update: %s is NULL", expert_bias ? "counts" : "expert_bias");
    tm__call c = tm__call_init(ctx, TM__OP_MOE_EXPERT_BIAS_UPDATE);
    c.in[0] = expert_bias;
    c.in[1] = counts;
    c.fattr[0] = rate;
    return tm__op_run(&c);
}

/* ---- fused updates (adamw_update_multi, grad_sumsq_multi, grad_scale_multi) ----------------- */
/*
 * One op over a table of bucket ranges of one device (framework/update_multi.h), so that a
 * training step makes one AdamW launch per device instead of one per decay run, and the clip
 * two launches instead of one to three per bucket plus the concatenation of the partials.
 *
 * Attributes (in[0] is the table, i64 [capacity, TM__SEG_WORDS] on the device):
 *   adamw_update_multi  iattr[0] ranges, iattr[1] blocks (the sum of the ranges' `first`
 *                       blocks), iattr[2] has_factor: in[1] the clip's factor (out[1] of
 *                       grad_sumsq_multi), every gradient read as grad_scale_multi would have
 *                       left it (g * factor rounded to g's dtype; nothing when it is 1), the
 *                       gradients themselves untouched; fattr[TM__ADAMW_*]
 *                       (framework/update_multi.h; each range has its own weight decay)
 *   grad_sumsq_multi    in[1] ticket: i64 [1], zero before and after (CUDA: the count of
 *                       finished blocks, reset by the last one); iattr[0] ranges, iattr[1]
 *                       sum-of-squares blocks; fattr[0] max_norm -> out[0] partials [ranges],
 *                       out[1] factor (): f64 on the CPU, f32 on CUDA
 *   grad_scale_multi    in[1] factor (out[1] of grad_sumsq_multi); iattr[0] ranges, iattr[1]
 *                       blocks
 * The table is written only by the tm__segs functions below, which build it from tensors they
 * checked: the ops are internal (extend.h) and check the table's shape, not its pointers.
 */
_Static_assert(sizeof(tm__seg) == TM__SEG_WORDS * sizeof(int64_t), "tm__seg is TM__SEG_WORDS i64 words");

struct tm__segs {
    tm_device dev;
    int kind, cap, n;
    int want;                /* ranges announced by tm__segs_begin (<= cap) */
    int n_up;                /* ranges of the table the device holds; -1: none yet */
    int64_t blocks, sblocks; /* grid of the elementwise kernels, of the sum of squares */
    tm__seg *pend, *up;      /* host: the table being built, the table last uploaded */
    tm_tensor *table;        /* i64 [cap, TM__SEG_WORDS] on dev */
    tm_tensor *ticket;       /* i64 [1] on dev, zero (grad_sumsq_multi) */
};

static tm_status segs_alloc(tm_ctx *ctx, const char *fn, tm__segs *l, int cap) {
    int64_t shape[2] = {cap, TM__SEG_WORDS};
    tm__seg *pend = tm__host_alloc(ctx, sizeof *pend * (size_t)cap), *up = tm__host_alloc(ctx, sizeof *up * (size_t)cap);
    tm_tensor *table = NULL;
    tm_status s = pend && up ? TM_OK : tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    if (s == TM_OK) s = tm__persistent_new(ctx, fn, TM_I64, 2, shape, l->dev, &table);
    if (s != TM_OK) {
        tm__host_free(ctx, pend);
        tm__host_free(ctx, up);
        return s;
    }
    tm__host_free(ctx, l->pend);
    tm__host_free(ctx, l->up);
    tm__persistent_free(ctx, l->table); /* (on CUDA cudaFree waits for the kernels that read it) */
    l->pend = pend, l->up = up, l->table = table;
    l->cap = cap;
    l->n = 0;
    l->n_up = -1;
    return TM_OK;
}

tm_status tm__segs_new(tm_ctx *ctx, const char *fn, tm_device dev, int cap, tm__segs **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    tm__segs *l = tm__host_alloc(ctx, sizeof *l);
    if (!l) return tm__err(ctx, TM_ERR_NOMEM, "%s: out of host memory", fn);
    memset(l, 0, sizeof *l);
    l->dev = dev;
    int64_t one[1] = {1};
    tm_status s = segs_alloc(ctx, fn, l, cap > 0 ? cap : 1);
    if (s == TM_OK) s = tm__persistent_new(ctx, fn, TM_I64, 1, one, dev, &l->ticket);
    if (s != TM_OK) {
        tm__segs_free(ctx, l);
        return s;
    }
    *out = l;
    return TM_OK;
}

void tm__segs_free(tm_ctx *ctx, tm__segs *l) {
    if (!l) return;
    tm__host_free(ctx, l->pend);
    tm__host_free(ctx, l->up);
    tm__persistent_free(ctx, l->table);
    tm__persistent_free(ctx, l->ticket);
    tm__host_free(ctx, l);
}

tm_status tm__segs_begin(tm_ctx *ctx, tm__segs *l, int kind, int cap) {
    if (cap > l->cap) TM__TRY(segs_alloc(ctx, "segment list", l, cap));
    l->kind = kind;
    l->want = cap;
    l->n = 0;
    l->blocks = l->sblocks = 0;
    return TM_OK;
}

int tm__segs_count(const tm__segs *l) { return l ? l->n : 0; }

/* t non-NULL, of ctx, contiguous, on the list's device, with at least `need` elements. */
static tm_status seg_tensor(tm_ctx *ctx, const tm__segs *l, const char *op, const char *what, const tm_tensor *t,
                            int64_t need) {
    if (!t) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s is NULL", op, what);
    if (t->ctx != ctx) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s belongs to another context", op, what);
    if (!tm__same_device(t->device, l->dev))
        return tm__err(ctx, TM_ERR_DEVICE, "%s: %s %s is not on the list's device", op, what, tm__tdesc(ctx, t));
    if (!tm__is_contiguous(t))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: %s %s must be contiguous (updates write in place)", op, what,
                       tm__tdesc(ctx, t));
    if (tm__numel(t) < need)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: range ending at element %lld is outside %s %s", op, (long long)need,
                       what, tm__tdesc(ctx, t));
    return TM_OK;
}

static tm_status seg_room(tm_ctx *ctx, const tm__segs *l, const char *op, int kind, int64_t a, int64_t e) {
    if (l->kind != kind) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: the segment list is of another kind", op);
    if (a < 0 || e < a) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: bad range [%lld, %lld)", op, (long long)a, (long long)e);
    if (e > a && l->n >= l->want)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: more than the %d ranges announced by tm__segs_begin", op, l->want);
    return TM_OK;
}

/* Append seg (p, g, ... filled; n >= 1) with its blocks. */
static void seg_push(tm__segs *l, tm__seg *sg) {
    sg->chunk = TM__SEG_CHUNK;
    sg->first = l->blocks;
    l->blocks += (sg->n + sg->chunk - 1) / sg->chunk;
    sg->schunk = tm__sumsq_chunk(sg->n);
    sg->sfirst = l->sblocks;
    l->sblocks += (sg->n + sg->schunk - 1) / sg->schunk;
    l->pend[l->n++] = *sg;
}

static void *elem(const tm_tensor *t, int64_t i) { return (char *)tm__data(t) + i * (int64_t)tm_dtype_size(t->dtype); }

tm_status tm__segs_add_adamw(tm_ctx *ctx, tm__segs *l, tm_tensor *P, tm_tensor *G, tm_tensor *m, tm_tensor *v,
                             tm_tensor *master, int64_t a, int64_t e, int64_t off, int64_t goff, int64_t poff,
                             double wd) {
    static const char op[] = "adamw_update_multi";
    TM__TRY(seg_room(ctx, l, op, TM__SEGS_ADAMW, a, e));
    if (off < 0 || off > a) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: state offset %lld past the range start %lld", op, (long long)off, (long long)a);
    if (goff < 0 || goff > a) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: gradient offset %lld past the range start %lld", op, (long long)goff, (long long)a);
    if (poff < 0 || poff > a) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: parameter offset %lld past the range start %lld", op, (long long)poff, (long long)a);
    TM__TRY(seg_tensor(ctx, l, op, "param", P, e - poff));
    TM__TRY(seg_tensor(ctx, l, op, "grad", G, e - goff));
    TM__TRY(seg_tensor(ctx, l, op, "m", m, e - off));
    TM__TRY(seg_tensor(ctx, l, op, "v", v, e - off));
    if (master) TM__TRY(seg_tensor(ctx, l, op, "master", master, e - off));
    if (!tm__is_float(P->dtype) || G->dtype != P->dtype)
        return tm__err(ctx, TM_ERR_DTYPE, "%s: param %s must be float and grad %s of its dtype", op, tm__tdesc(ctx, P),
                       tm__tdesc(ctx, G));
    if (m->dtype != TM_F32 || v->dtype != TM_F32 || (master && master->dtype != TM_F32))
        return tm__err(ctx, TM_ERR_DTYPE, "%s: m %s, v %s and master %s must be f32", op, tm__tdesc(ctx, m),
                       tm__tdesc(ctx, v), tm__tdesc(ctx, master));
    if (!isfinite(wd)) return tm__err(ctx, TM_ERR_INVALID_ARG, "%s: weight_decay %g must be finite", op, wd);
    if (e == a) return TM_OK;
    tm__seg sg;
    memset(&sg, 0, sizeof sg);
    sg.p = elem(P, a - poff);
    sg.g = elem(G, a - goff);
    sg.m = elem(m, a - off);
    sg.v = elem(v, a - off);
    sg.master = master ? elem(master, a - off) : NULL;
    sg.n = e - a;
    sg.wd = wd;
    sg.dtype = (int32_t)P->dtype;
    seg_push(l, &sg);
    return TM_OK;
}

tm_status tm__segs_add_grad(tm_ctx *ctx, tm__segs *l, tm_tensor *G, int64_t a, int64_t e) {
    static const char op[] = "grad_sumsq_multi";
    TM__TRY(seg_room(ctx, l, op, TM__SEGS_GRADS, a, e));
    TM__TRY(seg_tensor(ctx, l, op, "grad", G, e));
    if (!tm__is_float(G->dtype)) return tm__err(ctx, TM_ERR_DTYPE, "%s: grad %s must be float", op, tm__tdesc(ctx, G));
    if (e == a) return TM_OK;
    tm__seg sg;
    memset(&sg, 0, sizeof sg);
    sg.p = elem(G, a);
    sg.n = e - a;
    sg.dtype = (int32_t)G->dtype;
    seg_push(l, &sg);
    return TM_OK;
}

/* Bring the device's table up to the one just built: one host-to-device copy when it changed
 * (the first use, a bucket that moved), nothing otherwise. On CUDA the copy is queued on the
 * context's stream (cudaMemcpyAsync): kernels queued before it still read the old table, and
 * the host does not wait. */
static tm_status segs_commit(tm_ctx *ctx, tm__segs *l) {
    size_t bytes = sizeof(tm__seg) * (size_t)l->n;
    if (l->n_up == l->n && memcmp(l->pend, l->up, bytes) == 0) return TM_OK;
    TM__TRY(tm__memcpy(ctx, tm__data(l->table), l->dev, l->pend, tm_cpu(), bytes));
    memcpy(l->up, l->pend, bytes);
    l->n_up = l->n;
    return TM_OK;
}

static tm_status check_table(tm__call *c) {
    const tm_tensor *t = c->in[0];
    if (t->dtype != TM_I64 || t->ndim != 2 || t->shape[1] != TM__SEG_WORDS || !tm__is_contiguous(t))
        return tm__err(c->ctx, TM_ERR_INTERNAL, "%s: segment table %s", tm__opname(c), tm__tdesc(c->ctx, t));
    if (c->iattr[0] < 0 || c->iattr[0] > t->shape[0] || c->iattr[1] < 0)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "%s: %lld ranges in a table of %lld", tm__opname(c),
                       (long long)c->iattr[0], (long long)t->shape[0]);
    return TM_OK;
}


tm_status tm__adamw_update_multi_check(tm__call *c) {
    TM__TRY(check_table(c));
    if (c->iattr[2] != 0 && c->iattr[2] != 1)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "adamw_update_multi: has_factor %lld", (long long)c->iattr[2]);
    if (c->n_in != 1 + (int)c->iattr[2])
        return tm__err(c->ctx, TM_ERR_INTERNAL, "adamw_update_multi: %d inputs", c->n_in);
    if (c->iattr[2]) {
        const tm_tensor *f = c->in[1];
        if (f->dtype != clip_dtype(f->device) || f->ndim != 0)
            return tm__err(c->ctx, TM_ERR_INTERNAL, "adamw_update_multi: factor %s", tm__tdesc(c->ctx, f));
    }
    return TM_OK;
}

tm_status tm__grad_sumsq_multi_check(tm__call *c) {
    TM__TRY(check_table(c));
    const tm_tensor *tk = c->in[1];
    if (tk->dtype != TM_I64 || tm__numel(tk) != 1)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "grad_sumsq_multi: ticket %s", tm__tdesc(c->ctx, tk));
    int64_t n = c->iattr[0];
    tm_dtype dt = clip_dtype(c->in[0]->device);
    TM__TRY(tm__out_new(c, 0, dt, 1, &n));
    return tm__out_new(c, 1, dt, 0, &n);
}

tm_status tm__grad_scale_multi_check(tm__call *c) {
    TM__TRY(check_table(c));
    const tm_tensor *f = c->in[1];
    if (f->dtype != clip_dtype(f->device) || f->ndim != 0)
        return tm__err(c->ctx, TM_ERR_INTERNAL, "grad_scale_multi: factor %s", tm__tdesc(c->ctx, f));
    return TM_OK;
}

tm_status tm__adamw_update_multi(tm_ctx *ctx, tm__segs *l, const tm_adamw_config *cfg, double lr, int64_t step,
                                 tm_tensor *factor) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!l || !cfg) return tm__err(ctx, TM_ERR_INVALID_ARG, "adamw_update_multi: %s is NULL", l ? "cfg" : "list");
    if (l->kind != TM__SEGS_ADAMW) return tm__err(ctx, TM_ERR_INVALID_ARG, "adamw_update_multi: not an AdamW list");
    if (step < 1) return tm__err(ctx, TM_ERR_INVALID_ARG, "adamw_update_multi: step must be >= 1, got %lld", (long long)step);
    if (!isfinite(lr)) return tm__err(ctx, TM_ERR_INVALID_ARG, "adamw_update_multi: lr %g must be finite", lr);
    if (l->n == 0) return TM_OK;
    if (factor && (factor->ctx != ctx || !tm__same_device(factor->device, l->dev) || factor->ndim != 0 ||
                   factor->dtype != clip_dtype(l->dev)))
        return tm__err(ctx, TM_ERR_INVALID_ARG, "adamw_update_multi: grad_scale %s must be a 0-d %s tensor of this "
                       "context on the parameters' device", tm__tdesc(ctx, factor), tm_dtype_name(clip_dtype(l->dev)));
    TM__TRY(segs_commit(ctx, l));
    tm__call c = tm__call_init(ctx, TM__OP_ADAMW_UPDATE_MULTI);
    c.in[0] = l->table;
    c.n_in = 1;
    if (factor) c.in[c.n_in++] = factor;
    c.iattr[0] = l->n;
    c.iattr[1] = l->blocks;
    c.iattr[2] = factor != NULL;
    adamw_attrs(c.fattr, cfg, lr, step);
    return tm__op_run(&c);
}

tm_status tm__grad_sumsq_multi(tm_ctx *ctx, tm__segs *l, double max_norm, tm_tensor **partials, tm_tensor **factor) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!l || !partials || !factor) return tm__err(ctx, TM_ERR_INVALID_ARG, "grad_sumsq_multi: NULL argument");
    if (l->kind != TM__SEGS_GRADS || l->n == 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "grad_sumsq_multi: needs a gradient list with at least one range");
    if (isnan(max_norm)) return tm__err(ctx, TM_ERR_INVALID_ARG, "grad_sumsq_multi: max_norm is NaN");
    TM__TRY(segs_commit(ctx, l));
    tm__call c = tm__call_init(ctx, TM__OP_GRAD_SUMSQ_MULTI);
    c.in[0] = l->table;
    c.in[1] = l->ticket;
    c.iattr[0] = l->n;
    c.iattr[1] = l->sblocks;
    c.fattr[0] = max_norm;
    TM__TRY(tm__op_run(&c));
    *partials = c.out[0];
    *factor = c.out[1];
    return TM_OK;
}

tm_status tm__grad_scale_multi(tm_ctx *ctx, tm__segs *l, tm_tensor *factor) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!l || !factor) return tm__err(ctx, TM_ERR_INVALID_ARG, "grad_scale_multi: NULL argument");
    if (l->kind != TM__SEGS_GRADS) return tm__err(ctx, TM_ERR_INVALID_ARG, "grad_scale_multi: not a gradient list");
    if (l->n == 0) return TM_OK;
    TM__TRY(segs_commit(ctx, l));
    tm__call c = tm__call_init(ctx, TM__OP_GRAD_SCALE_MULTI);
    c.in[0] = l->table;
    c.in[1] = factor;
    c.iattr[0] = l->n;
    c.iattr[1] = l->blocks;
    return tm__op_run(&c);
}
