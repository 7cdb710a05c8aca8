/* layout.c — seeing and planning parallel layouts: `--print-layout` (which rank holds which
 * parameters and experts, and the bytes of parameters, gradients and optimizer state of each,
 * measured, plus <out>/layout.svg) and `tinymoe plan` (the same figures and the communication of
 * a step for any scale, computed without running). See layout.h. Uses only the public header. */
#include "layout.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomic.h"
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
/* The formulas of the library, for a model that is not built:
 *  - a bucket per (dtype, group): the model's dtype for dense weights, f32 for the MoE gates
 *    (f64 for f64 models), the model's dtype for the experts (framework/param.c);
 *  - every parameter padded to 64 bytes in its bucket; gradients the same layout;
 *  - expert parallelism: each rank holds E / P experts of every routed-expert tensor;
 *  - ZeRO-1 and 2: a bucket of n elements over a group of G ranks in blocks of ceil(n / G)
 *    rounded up to 64 elements (framework/comm.c tm__zero_block); rank j's block [j blk, (j+1) blk)
 *    clipped to n; AdamW keeps 2 f32 buffers of its block (at least one element each), a bf16
 *    bucket an f32 master of its block;
 *  - ZeRO-2: the gradients a rank keeps are a shard of blk elements per bucket (a group of one
 *    rank too: blk is then n rounded up to 64), and the full buffer of G blk elements exists
 *    from a step's first backward to its synchronisation (the transient bytes);
 *  - the optimizer's step counter: an i64 host buffer.
 * Communication of a step (bytes this rank hands to the collectives, as tm_comm_get_stats counts
 * them): gradient sync per bucket whose group has > 1 rank: all-reduce of the bucket, or under
 * ZeRO-1 and 2 a reduce-scatter of the G blocks; then their parameter all-gather of the block. The MoE
 * dispatch of expert parallelism per layer and micro-batch, forward and backward, assuming
 * balanced routing: all-to-all of T k (P - 1) / P rows of H each way; all-gather of T rows of
 * H (+ the router outputs, T E (f32 + u8)) and a reduce-scatter of P T rows; or, deduplicated,
 * all-to-all of a row of H (+ 2L f32) per (token, other rank touched) each way. */

typedef struct pbucket {
    int dtype_size, expert; /* element size; expert group */
    int64_t numel;          /* padded elements */
} pbucket;

/* ZeRO-3's traffic needs each parameter's place in its bucket: the parameters of the plan in
 * creation order. */
typedef struct pparam {
    pbucket *b;
    int64_t off, numel;
} pparam;
enum { PLAN_MAX_PARAMS = 1 << 14 };
static pparam plan_params[PLAN_MAX_PARAMS];
static int plan_n;

static int64_t padded(int64_t numel, int es) { return (numel * es + 63) / 64 * 64 / es; }

static void add(pbucket *b, int64_t numel) {
    if (plan_n < PLAN_MAX_PARAMS) plan_params[plan_n++] = (pparam){b, b->numel, numel};
    b->numel += padded(numel, b->dtype_size);
}

/* Elements of [off, off + n) in group rank j's ZeRO block of a bucket of `size` elements. */
static int64_t piece_of(int64_t off, int64_t n, int64_t blk, int64_t size, int j) {
    int64_t a = j * blk < size ? j * blk : size, e = (j + 1) * blk < size ? (j + 1) * blk : size;
    int64_t s = off > a ? off : a, t = off + n < e ? off + n : e;
    return t > s ? t - s : 0;
}

void tmd_plan_compute(const tmd_config *c, int ranks, int ep_size, int zero, int rank, tmd_plan *out) {
    memset(out, 0, sizeof *out);
    out->zero = zero;
    const tm_model_config *m = &c->model;
    int es = c->dtype == TMD_DTYPE_BF16 ? 2 : 4, gs = 4;
    int64_t H = m->d_model, V = m->vocab_size, D = H / m->n_heads, Hq = (int64_t)m->n_heads * D,
            Hkv = (int64_t)m->n_kv_heads * D, Fd = m->dense_ffn_size ? m->dense_ffn_size : 4 * H,
            E = m->moe.router.num_experts, F = m->moe.ffn_size, Fs = m->moe.shared_ffn_size, L = E / ep_size;
    pbucket dense = {es, 0, 0}, gate = {gs, 0, 0}, expert = {es, 1, 0};
    plan_n = 0;
    add(&dense, V * H);
    int n_moe = 0;
    for (int l = 0; l < m->n_layers; l++) {
        add(&dense, H);
        add(&dense, H * Hq), add(&dense, H * Hkv), add(&dense, H * Hkv), add(&dense, Hq * H);
        add(&dense, H);
        if (l < m->first_k_dense) {
            add(&dense, H * Fd), add(&dense, H * Fd), add(&dense, Fd * H);
            continue;
        }
        n_moe++;
        (es == gs ? add(&dense, H * E) : add(&gate, H * E));
        add(&expert, L * H * F), add(&expert, L * H * F), add(&expert, L * F * H);
        if (Fs) add(&dense, H * Fs), add(&dense, H * Fs), add(&dense, Fs * H);
    }
    add(&dense, H);
    if (!m->tie_embeddings) add(&dense, H * V);
    pbucket *bk[3] = {&dense, &gate, &expert};
    int dp = ranks, xdp = ranks / ep_size;
    for (int k = 0; k < 3; k++) {
        pbucket *b = bk[k];
        if (!b->numel) continue;
        int G = b->expert ? xdp : dp, gr = b->expert ? rank / ep_size : rank;
        out->params += b->numel * b->dtype_size;
        int64_t lo = 0, hi = b->numel, blk = (b->numel + G - 1) / G;
        blk = (blk + 63) / 64 * 64;
        if (zero) {
            lo = blk * gr < b->numel ? blk * gr : b->numel;
            hi = blk * (gr + 1) < b->numel ? blk * (gr + 1) : b->numel;
        }
        int64_t own = hi - lo;
        out->optimizer += 2 * 4 * (own ? own : 1) + (b->dtype_size == 2 ? 4 * own : 0);
        if (zero >= 2) {
            out->gradients += blk * b->dtype_size;
            out->transient += (int64_t)G * blk * b->dtype_size;
        } else {
            out->gradients += b->numel * b->dtype_size;
        }
        if (G > 1) {
            out->grad_sync += zero ? (int64_t)G * blk * b->dtype_size : b->numel * b->dtype_size;
            if (zero) out->param_gather += blk * b->dtype_size;
        }
    }
    out->optimizer += 64; /* the step counter: an i64 buffer, 64-byte aligned */
    if (zero >= 3) {
        /* ZeRO-3 (framework/fsdp.c): the parameters are the blocks; no full gradient buffer, and
         * no synchronisation or all-gather after the step: each use of a parameter all-gathers
         * its pieces in the forward and again in the backward, whose reduce goes straight into
         * the shards (a reduce-scatter when every rank's piece is equal, else an all-reduce of
         * the parameter's gradient, this rank keeping its piece). */
        out->params = out->gradients;
        out->grad_sync = out->param_gather = 0;
        for (int i = 0; i < plan_n; i++) {
            const pparam *q = &plan_params[i];
            int G = q->b->expert ? xdp : dp, gr = q->b->expert ? rank / ep_size : rank;
            int64_t blk = ((q->b->numel + G - 1) / G + 63) / 64 * 64, mine = piece_of(q->off, q->numel, blk, q->b->numel, gr);
            int equal = 1;
            for (int j = 1; j < G; j++)
                equal &= piece_of(q->off, q->numel, blk, q->b->numel, j) == piece_of(q->off, q->numel, blk, q->b->numel, 0);
            int uses = (i == 0 && m->tie_embeddings) ? 2 : 1; /* a tied embedding is its lm_head too */
            out->param_gather += (int64_t)uses * 2 * mine * q->b->dtype_size * c->grad_accum;
            out->bwd_reduce += (int64_t)uses * (equal ? (int64_t)G * mine : q->numel) * q->b->dtype_size * c->grad_accum;
        }
        /* transient: the most gathered at once: a layer's weights with its MoE block's during
         * its forward (the backward holds the MoE block's, then the layer's own), or the
         * embedding or lm_head alone; unpadded (a gathered weight is its numel elements) */
        int64_t most = V * H * es;
        int at = 1; /* plan_params[0] is the embedding */
        for (int l = 0; l < m->n_layers; l++) {
            int64_t layer = 0;
            int n_own = l < m->first_k_dense ? 9 : 6 + 4 + (Fs ? 3 : 0);
            /* (its attn_norm is gathered on its own, with the residual add before the layer) */
            for (int j = 0; j < n_own && at < plan_n; j++, at++)
                if (j > 0) layer += plan_params[at].numel * plan_params[at].b->dtype_size;
            if (layer > most) most = layer;
        }
        out->transient = most;
    }
    /* the MoE dispatch (balanced routing), per micro-batch: forward + backward */
    int64_t T = (int64_t)c->batch_size / ranks * m->max_seq_len, k = m->moe.router.topk;
    double per_layer = 0;
    if (ep_size > 1) {
        if (c->ep_strategy == TM_EP_ALLTOALL) {
            per_layer = 2.0 * 2.0 * (double)T * (double)k * (ep_size - 1) / ep_size * (double)H * es;
        } else if (c->ep_strategy == TM_EP_ALLTOALL_DEDUP) {
            /* a token goes to each other rank holding one of its k experts (k of E drawn without
             * replacement: it misses a rank's L experts with probability C(E-L, k) / C(E, k)),
             * with its L weights and L map values (f32) for that rank; the partial rows come back */
            double miss = 1;
            for (int64_t i = 0; i < k; i++) miss *= (double)(E - L - i) / (double)(E - i);
            double rows = (double)T * (ep_size - 1) * (1 - (miss > 0 ? miss : 0));
            per_layer = 2.0 * rows * (2.0 * H * es + 2.0 * L * gs);
        } else {
            per_layer = 2.0 * ((double)T * H * es + (double)T * E * (gs + 1) + (double)ep_size * T * H * es);
        }
    }
    out->dispatch = (int64_t)(per_layer * n_moe * c->grad_accum);
    out->experts_lo = (rank % ep_size) * L;
    out->experts_hi = out->experts_lo + L;
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
    fprintf(f, "  rank %4d  experts [%lld,%lld)  parameters %lld  gradients %lld  optimizer %lld  grad_sync %lld  "
               "param_gather %lld  dispatch %lld  transient %lld  bwd_reduce %lld\n", r, (long long)p->experts_lo,
            (long long)p->experts_hi, (long long)p->params, (long long)p->gradients, (long long)p->optimizer,
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
              "zero, computed from the configuration without building anything (any scale: e.g. 256 experts\n"
              "on 64 ranks). Ranks with equal figures print together; --per-rank prints one line per rank\n"
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
        tmd_plan_compute(&c, ranks, c.ep_size, c.zero, r, &p[r]);
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
