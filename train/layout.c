/* layout.c — seeing and planning parallel layouts: `--print-layout` (which rank holds which
 * parameters and experts, and the bytes of parameters, gradients and optimizer state of each,
 * measured, plus <out>/layout.svg) and `tinymoe plan` (the same figures and the communication of
 * a step for any scale, laid out by the library in a plan-only context without running). This
 * file only presents them (tables, svg). See layout.h. Uses only the public header. */
#include "layout.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomic.h"
#include "run.h"
#include "status.h"
#include "tinymoe.h"
#include "util.h"

/* ---- measured: --print-layout ------------------------------------------------------------ */

enum { R_RANK, R_EP, R_XDP, R_ELO, R_EHI, R_PARAMS, R_GRADS, R_OPTIM, R_BUFFERS, R_OWNED, R_ELEMS, R_N };

static void human(double b, char *buf, size_t n) {
    if (b >= 1 << 30) snprintf(buf, n, "%.2f GiB", b / (1 << 30));
    else if (b >= 1 << 20) snprintf(buf, n, "%.2f MiB", b / (1 << 20));
    else if (b >= 1 << 10) snprintf(buf, n, "%.1f KiB", b / (1 << 10));
    else snprintf(buf, n, "%.0f B", b);
}

static void write_svg(FILE *f, const int64_t *rows, int W, int E, int P, int zero) {
    const int cw = 28, dw = 120, rh = 26, left = 70, top = 40;
    int width = left + dw + 10 + E * cw + 20, height = top + W * rh + 50;
    if (width < 640) width = 640; /* room for the title */
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
               "font-size=\"11\">\n", width, height);
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    fprintf(f, "<text x=\"%d\" y=\"16\" font-size=\"13\">%d ranks, ep_size %d%s: parameters held (dense | "
               "experts)%s</text>\n", left, W, P, zero == 3 ? ", ZeRO-3" : zero == 2 ? ", ZeRO-2" : zero ? ", ZeRO-1" : "",
            zero == 3   ? "; dark band: this rank's block (weights, gradients, optimizer state)"
            : zero == 2 ? "; dark band: this rank's optimizer-state and gradient block"
            : zero      ? "; dark band: this rank's optimizer-state block" : "");
    fprintf(f, "<text x=\"%d\" y=\"%d\">dense</text>\n", left, top - 6);
    for (int e = 0; e < E; e++)
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">e%d</text>\n", left + dw + 10 + e * cw + cw / 2,
                top - 6, e);
    for (int r = 0; r < W; r++) {
        const int64_t *q = rows + (size_t)r * R_N;
        int y = top + r * rh;
        fprintf(f, "<text x=\"8\" y=\"%d\">rank %d</text>\n", y + 17, r);
        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"#9ecae1\" stroke=\"#555\"/>\n", left, y + 3,
                dw, rh - 6);
        if (zero && q[R_ELEMS] > 0) {
            /* this rank's share of the optimizer state, placed at its block */
            double frac = (double)q[R_OWNED] / (double)q[R_ELEMS];
            int bw = (int)ceil(frac * dw), bx = left + (int)((double)r * frac * dw) % dw; /* dense: dp rank = rank */
            fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"6\" fill=\"#08519c\"/>\n", bx, y + rh - 9,
                    bw < 2 ? 2 : bw);
        }
        for (int e = 0; e < E; e++) {
            int held = e >= q[R_ELO] && e < q[R_EHI];
            fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\" stroke=\"#555\"/>\n",
                    left + dw + 10 + e * cw, y + 3, cw - 2, rh - 6, held ? "#fd8d3c" : "#f0f0f0");
        }
    }
    char pb[32], ob[32];
    human((double)rows[R_PARAMS], pb, sizeof pb);
    human((double)rows[R_OPTIM], ob, sizeof ob);
    char gb[32];
    human((double)rows[R_GRADS], gb, sizeof gb);
    fprintf(f, "<text x=\"%d\" y=\"%d\">rank 0: parameters %s, gradients %s, optimizer state %s</text>\n", left,
            top + W * rh + 22, pb, gb, ob);
    fprintf(f, "</svg>\n");
}

int tmd_layout_print(tm_ctx *ctx, tm_device dev, int num_experts, FILE *log, const char *out_dir, char *err,
                     size_t errlen) {
    int W = tm_comm_size(ctx, TM_COMM_WORLD), P = tm_comm_size(ctx, TM_COMM_EP);
    tm_comm_options o = tm_comm_get_options(ctx);
    int64_t mine[R_N] = {0};
    mine[R_RANK] = tm_comm_rank(ctx, TM_COMM_WORLD);
    mine[R_EP] = tm_comm_rank(ctx, TM_COMM_EP);
    mine[R_XDP] = tm_comm_rank(ctx, TM_COMM_EXPERT_DP);
    mine[R_ELO] = -1, mine[R_EHI] = -1;
    for (int k = 0; k < tm_ctx_num_buckets(ctx); k++) {
        tm_bucket_info bi;
        int64_t lo, hi;
        if (tm_ctx_bucket_info(ctx, k, &bi) || tm_ctx_grad_shard(ctx, k, &lo, &hi)) continue;
        if (bi.group == TM_PARAM_EXPERT) mine[R_ELO] = bi.expert_lo, mine[R_EHI] = bi.expert_hi;
        mine[R_OWNED] += hi - lo;
        mine[R_ELEMS] += bi.numel;
    }
    tm_memory_report mr;
    if (tm_ctx_memory_report(ctx, dev, &mr) == TM_OK) {
        mine[R_PARAMS] = (int64_t)mr.current[TM_MEM_PARAMETERS];
        mine[R_GRADS] = (int64_t)mr.current[TM_MEM_GRADIENTS];
        mine[R_OPTIM] = (int64_t)mr.current[TM_MEM_OPTIMIZER];
        mine[R_BUFFERS] = (int64_t)mr.current[TM_MEM_BUFFERS];
    }
    if (dev.type != TM_DEVICE_CPU && tm_ctx_memory_report(ctx, tm_cpu(), &mr) == TM_OK)
        mine[R_OPTIM] += (int64_t)mr.current[TM_MEM_OPTIMIZER]; /* the step counter lives on the host */
    int64_t *rows = malloc(sizeof(int64_t) * R_N * (size_t)W);
    if (!rows) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
    tm_status s = tm_comm_allgather_host(ctx, TM_COMM_WORLD, mine, rows, sizeof mine);
    if (s) {
        free(rows);
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "gathering the layout: %s", tm_ctx_errmsg(ctx));
    }
    if (mine[R_RANK] == 0 && log) {
        fprintf(log, "\nlayout: %d rank%s; dp %d; ep_size %d (%s), %d expert-dp group%s of %d; ZeRO-%d; engine %s\n", W,
                W > 1 ? "s" : "", W, P, tm_ep_strategy_name(o.ep_strategy), P, P > 1 ? "s" : "",
                W / P, o.zero, tm_comm_engine(ctx, dev));
        fprintf(log, "  %4s %3s %4s %-10s %14s %14s %14s   (bytes on %s)\n", "rank", "ep", "xdp", "experts",
                "parameters", "gradients", "optimizer", dev.type == TM_DEVICE_CPU ? "cpu" : "the GPU");
        for (int r = 0; r < W; r++) {
            const int64_t *q = rows + (size_t)r * R_N;
            char ex[32];
            if (q[R_ELO] < 0) snprintf(ex, sizeof ex, "-");
            else snprintf(ex, sizeof ex, "[%lld,%lld)", (long long)q[R_ELO], (long long)q[R_EHI]);
            fprintf(log, "  %4lld %3lld %4lld %-10s %14lld %14lld %14lld\n", (long long)q[R_RANK], (long long)q[R_EP],
                    (long long)q[R_XDP], ex, (long long)q[R_PARAMS], (long long)q[R_GRADS], (long long)q[R_OPTIM]);
        }
        fflush(log);
    }
    int rc = 0;
    if (mine[R_RANK] == 0 && out_dir && *out_dir) {
        char path[1024], e[512];
        snprintf(path, sizeof path, "%s/layout.svg", out_dir);
        if (tmd_mkdirs(out_dir, e, sizeof e)) {
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "key 'out': %s", e);
        } else {
            FILE *f = fopen(path, "w");
            if (!f) {
                rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot write '%s': %s", path, strerror(errno));
            } else {
                write_svg(f, rows, W, num_experts, P, o.zero);
                if (fclose(f)) rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot write '%s'", path);
            }
        }
    }
    free(rows);
    return rc;
}

/* After the run: each rank's high-water marks, and the bytes its collectives moved in the last
 * training step by kind. The peaks less what is held now are the transient part: ZeRO-2's full
 * gradient buffer (from a step's first backward to its gradient synchronisation), ZeRO-3's
 * all-gathered weights; 0 at the other levels. */
int tmd_layout_print_peaks(tm_ctx *ctx, tm_device dev, const tm_comm_stats *last, FILE *log, char *err,
                           size_t errlen) {
    int W = tm_comm_size(ctx, TM_COMM_WORLD);
    enum { K_RANK, K_PARAMS, K_GRADS, K_OPTIM, K_TRANSIENT, K_AR, K_AG, K_RS, K_A2A, K_N };
    int64_t mine[K_N] = {0};
    mine[K_AR] = last->bytes[TM_COMM_ALLREDUCE];
    mine[K_AG] = last->bytes[TM_COMM_ALLGATHER];
    mine[K_RS] = last->bytes[TM_COMM_REDUCE_SCATTER];
    mine[K_A2A] = last->bytes[TM_COMM_ALLTOALL];
    mine[K_RANK] = tm_comm_rank(ctx, TM_COMM_WORLD);
    tm_memory_report mr;
    if (tm_ctx_memory_report(ctx, dev, &mr) == TM_OK) {
        mine[K_PARAMS] = (int64_t)mr.peak[TM_MEM_PARAMETERS];
        mine[K_GRADS] = (int64_t)mr.peak[TM_MEM_GRADIENTS];
        mine[K_OPTIM] = (int64_t)mr.peak[TM_MEM_OPTIMIZER];
        /* ZeRO-2's full gradient buffer, ZeRO-3's all-gathered weights (counted as parameters
         * while they are held; the library restarts that peak when it shards the parameters) */
        mine[K_TRANSIENT] = (int64_t)(mr.peak[TM_MEM_GRADIENTS] - mr.current[TM_MEM_GRADIENTS]) +
                            (int64_t)(mr.peak[TM_MEM_PARAMETERS] - mr.current[TM_MEM_PARAMETERS]);
    }
    int64_t *rows = malloc(sizeof(int64_t) * K_N * (size_t)W);
    if (!rows) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
    tm_status s = tm_comm_allgather_host(ctx, TM_COMM_WORLD, mine, rows, sizeof mine);
    if (s) {
        free(rows);
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "gathering the memory peaks: %s", tm_ctx_errmsg(ctx));
    }
    if (mine[K_RANK] == 0 && log) {
        fprintf(log, "\nlayout after the run, peaks: ZeRO-%d\n", tm_comm_get_options(ctx).zero);
        fprintf(log, "  %4s %14s %14s %14s %14s   (bytes on %s)\n", "rank", "parameters", "gradients", "optimizer",
                "transient", dev.type == TM_DEVICE_CPU ? "cpu" : "the GPU");
        for (int r = 0; r < W; r++) {
            const int64_t *q = rows + (size_t)r * K_N;
            fprintf(log, "  %4lld %14lld %14lld %14lld %14lld\n", (long long)q[K_RANK], (long long)q[K_PARAMS],
                    (long long)q[K_GRADS], (long long)q[K_OPTIM], (long long)q[K_TRANSIENT]);
        }
        /* (all of them: the gradients' and weights' collectives, and the MoE layers' and the
         * loss's own, which `tinymoe plan` counts under dispatch or not at all) */
        fprintf(log, "  the last step's collectives, bytes each rank handed to them:\n  %4s %14s %14s %14s %14s\n",
                "rank", "all-reduce", "all-gather", "reduce-scatter", "all-to-all");
        for (int r = 0; r < W; r++) {
            const int64_t *q = rows + (size_t)r * K_N;
            fprintf(log, "  %4lld %14lld %14lld %14lld %14lld\n", (long long)q[K_RANK], (long long)q[K_AR],
                    (long long)q[K_AG], (long long)q[K_RS], (long long)q[K_A2A]);
        }
        fflush(log);
    }
    free(rows);
    return 0;
}

/* ---- planned: tinymoe plan ---------------------------------------------------------------- */
/* No formula here: each rank's layout is the library's, made by the code a run makes it with,
 * in a plan-only context (tinymoe.h, tm_ctx_options.plan_only) whose device allocates nothing:
 * the communicator of a world of `ranks` with this rank (tm_comm_options.plan_world_size),
 * the model, the optimizer; the memory report then holds the rank's parameter, gradient and
 * optimizer bytes, and tm_model_plan_step what a step moves and holds beyond them. */
int tmd_plan_compute(const tmd_config *c, int ranks, int rank, tmd_plan *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    out->zero = c->zero;
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    o.plan_only = 1;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o))
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot create a plan-only context: %s", tm_last_create_error());
    tm_comm_options co = tmd_comm_options_of(c);
    co.plan_world_size = ranks;
    co.plan_rank = rank;
    tm_model *m = NULL;
    tm_optimizer *opt = NULL;
    tm_step_plan sp;
    tm_memory_report mr;
    const char *what = "attaching the communicator";
    tm_status s = tm_comm_init(ctx, &co);
    if (!s) what = "building the model", s = tm_model_new(ctx, &c->model, c->dtype == TMD_DTYPE_BF16 ? TM_BF16 : TM_F32,
                                                           tm_cpu(), &m);
    if (!s) what = "creating the optimizer",
            s = c->optimizer == TMD_OPT_ADAMW ? tm_adamw_new(ctx, &c->adamw, &opt) : tm_sgd_new(ctx, &c->sgd, &opt);
    if (!s) what = "reading the memory report", s = tm_ctx_memory_report(ctx, tm_cpu(), &mr);
    if (!s) {
        out->params = (int64_t)mr.current[TM_MEM_PARAMETERS];
        out->gradients = (int64_t)mr.current[TM_MEM_GRADIENTS];
        out->optimizer = (int64_t)mr.current[TM_MEM_OPTIMIZER];
        out->experts_lo = out->experts_hi = -1; /* a model without MoE layers holds none */
        for (int k = 0; k < tm_ctx_num_buckets(ctx); k++) {
            tm_bucket_info bi;
            if (tm_ctx_bucket_info(ctx, k, &bi) == TM_OK && bi.group == TM_PARAM_EXPERT)
                out->experts_lo = bi.expert_lo, out->experts_hi = bi.expert_hi;
        }
        what = "planning a step";
        s = tm_model_plan_step(m, (int64_t)c->batch_size / ranks * c->model.max_seq_len, c->grad_accum, &sp);
    }
    if (!s) {
        out->grad_sync = sp.grad_sync;
        out->param_gather = sp.param_gather;
        out->bwd_reduce = sp.bwd_reduce;
        out->dispatch = sp.dispatch;
        out->transient = sp.transient;
    }
    int rc = s ? tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "rank %d of %d: %s: %s", rank, ranks, what, tm_ctx_errmsg(ctx))
               : 0;
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
    return rc;
}

/* Ranks whose figures are equal (all but their experts) print as one class: "ranks 0-3, 8-11". */
static int same_figures(const tmd_plan *a, const tmd_plan *b) {
    return a->params == b->params && a->gradients == b->gradients && a->optimizer == b->optimizer &&
           a->grad_sync == b->grad_sync && a->param_gather == b->param_gather && a->dispatch == b->dispatch &&
           a->transient == b->transient && a->bwd_reduce == b->bwd_reduce;
}

static void print_ranks(FILE *f, const int *cls, int ranks, int k) {
    int n = 0, first = 1;
    for (int r = 0; r < ranks; r++) {
        if (cls[r] != k) continue;
        int e = r;
        while (e + 1 < ranks && cls[e + 1] == k) e++;
        fprintf(f, "%s%d", first ? "" : ", ", r);
        if (e > r) fprintf(f, "-%d", e);
        n += e - r + 1;
        first = 0;
        r = e;
    }
    fprintf(f, " (%d rank%s)", n, n > 1 ? "s" : "");
}

static void print_plan_row(FILE *f, int r, const tmd_plan *p) {
    char ex[48];
    if (p->experts_lo < 0) snprintf(ex, sizeof ex, "-");
    else snprintf(ex, sizeof ex, "[%lld,%lld)", (long long)p->experts_lo, (long long)p->experts_hi);
    fprintf(f, "  rank %4d  experts %s  parameters %lld  gradients %lld  optimizer %lld  grad_sync %lld  "
               "param_gather %lld  dispatch %lld  transient %lld  bwd_reduce %lld\n", r, ex, (long long)p->params,
            (long long)p->gradients, (long long)p->optimizer,
            (long long)p->grad_sync, (long long)p->param_gather, (long long)p->dispatch, (long long)p->transient,
            (long long)p->bwd_reduce);
}

static void print_plan_class(FILE *f, const tmd_plan *p) {
    char a[32], b[32], o[32], g[32], pg[32], d[32], tr[32], br[32];
    human((double)p->transient, tr, sizeof tr);
    human((double)p->bwd_reduce, br, sizeof br);
    human((double)p->params, a, sizeof a);
    human((double)p->gradients, b, sizeof b);
    human((double)p->optimizer, o, sizeof o);
    human((double)p->grad_sync, g, sizeof g);
    human((double)p->param_gather, pg, sizeof pg);
    human((double)p->dispatch, d, sizeof d);
    if (p->zero >= 3)
        fprintf(f, "    parameters %s, gradients %s, optimizer %s, transient %s (all-gathered weights); per step: "
                   "param_gather %s (all-gathers, forward and backward), bwd_reduce %s (reduce-scatter / all-reduce in "
                   "the backward), dispatch %s\n", a, b, o, tr, pg, br, d);
    else
        fprintf(f, "    parameters %s, gradients %s, optimizer %s, transient %s; per step: grad_sync %s (%s), "
                   "param_gather %s (all-gather), dispatch %s\n", a, b, o, tr, g, p->zero ? "reduce-scatter" : "all-reduce",
                pg, d);
    fprintf(f, "    bytes: parameters %lld gradients %lld optimizer %lld transient %lld grad_sync %lld param_gather %lld "
               "dispatch %lld bwd_reduce %lld\n", (long long)p->params, (long long)p->gradients, (long long)p->optimizer,
            (long long)p->transient, (long long)p->grad_sync, (long long)p->param_gather, (long long)p->dispatch,
            (long long)p->bwd_reduce);
}

int tmd_plan_main(int argc, char **argv) {
    int ranks = 0, help = 0, w = 0, per_rank = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--per-rank") || !strcmp(a, "--per_rank")) per_rank = 1;
        else if (!strcmp(a, "--ranks") && i + 1 < argc) ranks = atoi(argv[++i]);
        else if (!strncmp(a, "--ranks=", 8)) ranks = atoi(a + 8);
        else argv[w++] = argv[i];
    }
    argc = w;
    tmd_config c;
    char err[2048];
    if (tmd_config_from_args(&c, argc, argv, &help, err, sizeof err)) {
        fprintf(stderr, "tinymoe: plan: %s\n", err);
        return TMD_CONFIG_ERROR;
    }
    if (help) {
        fputs("usage: tinymoe plan --ranks N [--per-rank] [--config FILE] [--preset NAME] [--key value ...]\n"
              "Memory per rank (parameters, gradients, optimizer state, in bytes) and the bytes each rank's\n"
              "collectives move per optimizer step, for N ranks and the layout keys ep_size, ep_strategy and\n"
              "zero, laid out by the library's own code in a context that allocates nothing (any scale: e.g.\n"
              "256 experts on 64 ranks). Ranks with equal figures print together; --per-rank prints one line per rank\n"
              "(bytes, with its experts). The MoE dispatch assumes balanced routing. docs/layouts.md\n"
              "explains the layouts.\n",
              stdout);
        return 0;
    }
    tmd_config_resolve(&c);
    if (tmd_config_validate(&c, err, sizeof err)) {
        fprintf(stderr, "tinymoe: plan: %s\n", err);
        return TMD_CONFIG_ERROR;
    }
    if (ranks == 0) {
        fprintf(stderr,
                "tinymoe: plan: give --ranks N, the number of ranks to plan for (a multiple of ep_size = %d that "
                "divides batch_size = %d), e.g. --ranks %d\n",
                c.ep_size, c.batch_size, c.ep_size);
        return TMD_CONFIG_ERROR;
    }
    if (ranks < 1 || ranks % c.ep_size || c.batch_size % ranks) {
        fprintf(stderr, "tinymoe: plan: --ranks %d must be >= 1, a multiple of ep_size = %d, and divide batch_size = %d\n",
                ranks, c.ep_size, c.batch_size);
        return TMD_CONFIG_ERROR;
    }
    tmd_plan *p = calloc((size_t)ranks, sizeof *p);
    int *cls = calloc((size_t)ranks, sizeof *cls), nc = 0, worst = 0;
    if (!p || !cls) {
        free(p), free(cls);
        fprintf(stderr, "tinymoe: plan: out of memory\n");
        return TMD_RUNTIME_ERROR;
    }
    printf("plan: %d ranks, ep_size %d (%s), ZeRO-%d, %s; each rank holds %d of the %d experts of every MoE layer\n",
           ranks, c.ep_size, tm_ep_strategy_name((tm_ep_strategy)c.ep_strategy), c.zero,
           c.dtype == TMD_DTYPE_BF16 ? "bf16" : "f32", c.model.moe.router.num_experts / c.ep_size,
           c.model.moe.router.num_experts);
    printf("per rank, bytes held, and bytes moved per optimizer step (dispatch: balanced routing)%s:\n",
           per_rank ? "" : "; ranks with equal figures together");
    for (int r = 0; r < ranks; r++) {
        if (tmd_plan_compute(&c, ranks, r, &p[r], err, sizeof err)) {
            fprintf(stderr, "tinymoe: plan: %s\n", err);
            free(p), free(cls);
            return TMD_RUNTIME_ERROR;
        }
        cls[r] = -1;
        for (int q = 0; q < r && cls[r] < 0; q++)
            if (same_figures(&p[q], &p[r])) cls[r] = cls[q];
        if (cls[r] < 0) cls[r] = nc++;
        if (p[r].params + p[r].gradients + p[r].optimizer + p[r].transient >
            p[worst].params + p[worst].gradients + p[worst].optimizer + p[worst].transient)
            worst = r;
    }
    for (int r = 0; per_rank && r < ranks; r++) print_plan_row(stdout, r, &p[r]);
    for (int k = 0; !per_rank && k < nc; k++) {
        int first = 0;
        while (cls[first] != k) first++;
        printf("  ranks ");
        print_ranks(stdout, cls, ranks, k);
        printf(":\n");
        print_plan_class(stdout, &p[first]);
    }
    char a[32], b[32], o[32], s[32], pg[32], d[32], tr[32];
    human((double)p[worst].transient, tr, sizeof tr);
    human((double)p[worst].params, a, sizeof a);
    human((double)p[worst].gradients, b, sizeof b);
    human((double)p[worst].optimizer, o, sizeof o);
    human((double)p[worst].grad_sync, s, sizeof s);
    human((double)p[worst].param_gather, pg, sizeof pg);
    human((double)p[worst].dispatch, d, sizeof d);
    if (c.zero >= 3) human((double)p[worst].bwd_reduce, s, sizeof s);
    printf("largest rank (%d): parameters %s, gradients %s, optimizer %s, transient %s; per step: gradient %s %s, "
           "parameter all-gather %s, MoE dispatch %s\n",
           worst, a, b, o, tr, c.zero >= 3 ? "reduce in the backward" : c.zero ? "reduce-scatter" : "all-reduce", s, pg, d);
    free(p), free(cls);
    return 0;
}
