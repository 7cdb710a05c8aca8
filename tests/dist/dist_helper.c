/*
 * dist_helper.c — the SPMD half of tests/test_dist.c: run by `mpirun -np N` (one process per
 * rank), it checks the collectives as ops across real ranks and exits 0 when every check
 * passes (1 otherwise, with the failures on stderr). Built as $(BUILD)/tinymoe_dist_helper;
 * uses only the public header.
 *
 *   tinymoe_dist_helper collectives   forward values and gradient checks of comm_allreduce,
 *                                     comm_allgather (equal and ragged, and the pieces of
 *                                     ZeRO-3's parameter all-gather: ranks with no row), comm_reduce_scatter,
 *                                     comm_alltoall, over the world, ep and expert_dp groups
 *                                     (ep_size 2 when N is even); ZeRO-1's optimizer memory per
 *                                     rank (f32 state, bf16 master weights); the host round
 *                                     trips of an expert-parallel step (chunked too) and a
 *                                     chunked MoE layer (overlap_chunks) against an unchunked one
 *   tinymoe_dist_helper plan          the library's plan of each rank (a plan-only context:
 *                                     tm_model_plan_step) against a real step of the rank: bytes
 *                                     held, transient bytes, and each collective kind's bytes, for
 *                                     ZeRO 0-3, ep_size 1, 2 and the world, bf16, SGD, tied
 *                                     embeddings; and the plan of twice the ranks must differ
 *   tinymoe_dist_helper clip          the deferred clip (its factor handed to AdamW) against the
 *                                     clip that scales in place: the same bits, ZeRO 0 / 1 / 3
 *   tinymoe_dist_helper gsync         the gradient all-reduce started by an armed backward
 *                                     (tm_comm_sync_grads_in_backward) against tm_comm_sync_grads
 *                                     alone: pieces, calls beside the work, the same training
 *   tinymoe_dist_helper cuda           (GPU machine) every collective op on CUDA tensors against
 *                                     the same op on CPU tensors, forward and backward; with 2
 *                                     ranks the chunked MoE layer on CUDA (its all-to-alls beside
 *                                     the work under NCCL) against overlap off (bit for bit) and
 *                                     the CPU
 *   tinymoe_dist_helper hang | die    rank 1 stops answering / exits while rank 0 waits in an
 *                                     all-reduce (2 s timeout); rank 0 reports and aborts the job
 *
 * Gradient check: every rank r has an f64 input x_r and a fixed random upstream gradient g_r;
 * the scalar L = sum_r <g_r, f(x)_r> depends on every rank's input. Analytic: tm_backward_with_grad
 * on each rank. Numeric: for each rank q and element i, every rank evaluates L with x_q[i]
 * moved by +-h (the same collective calls everywhere) and the central difference is compared
 * on rank q with its analytic d L / d x_q[i].
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tinymoe.h"

static int g_rank, g_fail;

/* tm_comm_options.overlap of the next chunked_layer (default on), and what its forward and
 * backward ran beside the work: all-to-alls, and early waits (memory given back first). */
static int g_overlap = 1;
static int64_t g_beside, g_early;
/* and its device: the CPU (g_cuda < 0) or that CUDA device with engine choice g_nccl; g_engine
 * receives the engine that moved its tensors ("mpi", "nccl", ...) */
static int g_cuda = -1, g_nccl = TM_NCCL_AUTO;
static char g_engine[32];

/* Steps of the clip and gradient all-reduce checks; the latter's training run (below, used by
 * check_cuda too): per step the loss, the all-reduce calls of the armed backward (and of those
 * beside the work) and of tm_comm_sync_grads after it, its reduce-scatters; this rank's weights. */
enum { KS = 3 };
typedef struct gsync_run {
    double loss[KS];
    int64_t bw_calls[KS], bw_beside[KS], sync_calls[KS], sync_rs[KS];
    unsigned char *blocks;
    int64_t n_blocks;
} gsync_run;
static gsync_run gsync_train(int zero, int ep_size, int bf16, int tied, int arm, int64_t chunk);

#define CHECK(cond, ...)                                      \
    do {                                                      \
        if (!(cond)) {                                        \
            fprintf(stderr, "rank %d: FAIL ", g_rank);        \
            fprintf(stderr, __VA_ARGS__);                     \
            fprintf(stderr, "\n");                            \
            g_fail++;                                         \
        }                                                     \
    } while (0)

#define OK(ctx, expr)                                                                                  \
    do {                                                                                               \
        tm_status s_ = (expr);                                                                         \
        if (s_) {                                                                                      \
            fprintf(stderr, "rank %d: %s -> %s: %s\n", g_rank, #expr, tm_status_str(s_), tm_ctx_errmsg(ctx)); \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

/* Deterministic values any rank can recompute: element i of rank r's tensor `tag`. */
static double val(int tag, int r, int64_t i) {
    uint32_t ctr[4] = {(uint32_t)i, (uint32_t)r, (uint32_t)tag, 77}, key[2] = {12345, 678}, out[4];
    tm_philox4x32_10(ctr, key, out);
    return (double)(out[0] >> 8) / (double)(1u << 24) * 2.0 - 1.0;
}

typedef struct op_case {
    const char *name;
    int group;
    /* rows of rank r's input (world rank of the group member) and row width */
    int64_t (*rows)(int gr, int G);
    int64_t width;
    int kind; /* 0 allreduce, 1 allgather, 2 reduce_scatter, 3 alltoall */
} op_case;

static int64_t rows_two(int gr, int G) { return 2; }
static int64_t rows_ragged(int gr, int G) { return 1 + gr % 2; }
static int64_t rows_rs(int gr, int G) { return 2 * G; }
/* ZeRO-3's all-gather of a parameter's pieces (framework/fsdp.c): a parameter inside one rank's
 * block (the others hold no row of it), and one across two blocks */
static int64_t rows_one_owner(int gr, int G) { return gr == G - 1 ? 3 : 0; }
static int64_t rows_two_owners(int gr, int G) { return gr == 0 ? 2 : gr == 1 ? 5 : 0; }
/* alltoall: group rank a sends (a + 2 b) % 3 rows to group rank b */
static int64_t a2a_count(int a, int b) { return (a + 2 * b) % 3; }
static int64_t rows_a2a(int gr, int G) {
    int64_t n = 0;
    for (int b = 0; b < G; b++) n += a2a_count(gr, b);
    return n;
}

/* The op on this rank's x (a tensor of the case's rows x width). */
static tm_status run_op(tm_ctx *ctx, const op_case *oc, tm_tensor *x, tm_tensor **y) {
    int G = tm_comm_size(ctx, (tm_comm_group)oc->group), me = tm_comm_rank(ctx, (tm_comm_group)oc->group);
    switch (oc->kind) {
    case 0: return tm_comm_allreduce(ctx, x, (tm_comm_group)oc->group, y);
    case 1: return tm_comm_allgather(ctx, x, (tm_comm_group)oc->group, y);
    case 2: return tm_comm_reduce_scatter(ctx, x, (tm_comm_group)oc->group, y);
    default: {
        int64_t *sc = malloc(sizeof(int64_t) * 2 * (size_t)G), shape = G;
        for (int b = 0; b < G; b++) sc[b] = a2a_count(me, b), sc[G + b] = a2a_count(b, me);
        tm_tensor *s, *r;
        tm_status st = tm_tensor_from_host(ctx, TM_I64, 1, &shape, tm_cpu(), TM_I64, sc, &s);
        if (!st) st = tm_tensor_from_host(ctx, TM_I64, 1, &shape, tm_cpu(), TM_I64, sc + G, &r);
        free(sc);
        return st ? st : tm_comm_alltoall(ctx, x, s, r, (tm_comm_group)oc->group, y);
    }
    }
}

/* World rank of group member j of this rank's group g (the layout of tinymoe.h). */
static int member(tm_ctx *ctx, int g, int j) {
    int P = tm_comm_get_options(ctx).ep_size, r = tm_comm_rank(ctx, TM_COMM_WORLD);
    if (g == TM_COMM_EP) return (r / P) * P + j;
    if (g == TM_COMM_EXPERT_DP) return r % P + j * P;
    return j;
}

/* Expected y of this rank, from every member's (recomputed) input. */
static double *expected(tm_ctx *ctx, const op_case *oc, int64_t *n_out) {
    int g = oc->group, G = tm_comm_size(ctx, (tm_comm_group)g), me = tm_comm_rank(ctx, (tm_comm_group)g);
    int64_t W = oc->width, n = 0;
    double *y = NULL;
    switch (oc->kind) {
    case 0:
    case 2: {
        int64_t rows = oc->kind == 0 ? oc->rows(me, G) : oc->rows(me, G) / G;
        n = rows * W;
        y = calloc((size_t)n, sizeof *y);
        int64_t base = oc->kind == 0 ? 0 : me * n;
        for (int j = 0; j < G; j++)
            for (int64_t i = 0; i < n; i++) y[i] += val(oc->kind, member(ctx, g, j), base + i);
        break;
    }
    case 1:
        for (int j = 0; j < G; j++) n += oc->rows(j, G) * W;
        y = calloc((size_t)n, sizeof *y);
        for (int j = 0, k = 0; j < G; j++)
            for (int64_t i = 0; i < oc->rows(j, G) * W; i++) y[k++] = val(oc->kind, member(ctx, g, j), i);
        break;
    default:
        for (int j = 0; j < G; j++) n += a2a_count(j, me) * W;
        y = calloc((size_t)n, sizeof *y);
        for (int j = 0, k = 0; j < G; j++) {
            int64_t off = 0; /* where rank j's rows for me start in its x */
            for (int b = 0; b < me; b++) off += a2a_count(j, b);
            for (int64_t i = 0; i < a2a_count(j, me) * W; i++) y[k++] = val(oc->kind, member(ctx, g, j), off * W + i);
        }
    }
    *n_out = n;
    return y;
}

/* L = sum over ranks of <g_r, f(x)_r> with x = this rank's input (perturbed by the caller). */
static double loss_of(tm_ctx *ctx, const op_case *oc, tm_tensor *x) {
    tm_tensor *y;
    OK(ctx, run_op(ctx, oc, x, &y));
    int64_t n = tm_tensor_numel(y);
    double *h = malloc(sizeof(double) * (size_t)(n ? n : 1)), l = 0;
    OK(ctx, tm_tensor_read(ctx, y, TM_F64, h, n));
    for (int64_t i = 0; i < n; i++) l += val(100 + oc->kind, g_rank, i) * h[i];
    free(h);
    OK(ctx, tm_comm_allreduce_host(ctx, TM_COMM_WORLD, TM_F64, &l, 1));
    return l;
}

static void check_case(tm_ctx *ctx, const op_case *oc) {
    int g = oc->group, G = tm_comm_size(ctx, (tm_comm_group)g), me = tm_comm_rank(ctx, (tm_comm_group)g);
    int W = tm_comm_size(ctx, TM_COMM_WORLD);
    int64_t rows = oc->rows(me, G), shape[2] = {rows, oc->width}, n = rows * oc->width;
    double *xv = malloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) xv[i] = val(oc->kind, g_rank, i);

    /* forward */
    tm_tensor *x, *y;
    OK(ctx, tm_tensor_from_host(ctx, TM_F64, 2, shape, tm_cpu(), TM_F64, xv, &x));
    OK(ctx, run_op(ctx, oc, x, &y));
    int64_t ne;
    double *want = expected(ctx, oc, &ne), *got = malloc(sizeof(double) * (size_t)(ne ? ne : 1));
    CHECK(tm_tensor_numel(y) == ne, "%s: %lld outputs, expected %lld", oc->name, (long long)tm_tensor_numel(y), (long long)ne);
    if (tm_tensor_numel(y) == ne) {
        OK(ctx, tm_tensor_read(ctx, y, TM_F64, got, ne));
        for (int64_t i = 0; i < ne; i++)
            CHECK(fabs(got[i] - want[i]) <= 1e-12, "%s: y[%lld] = %.17g, expected %.17g", oc->name, (long long)i,
                  got[i], want[i]);
    }
    tm_ctx_arena_reset(ctx);

    /* analytic gradient */
    OK(ctx, tm_tensor_from_host(ctx, TM_F64, 2, shape, tm_cpu(), TM_F64, xv, &x));
    OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    OK(ctx, run_op(ctx, oc, x, &y));
    int64_t ny = tm_tensor_numel(y);
    double *gv = malloc(sizeof(double) * (size_t)(ny ? ny : 1)), *ga = malloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < ny; i++) gv[i] = val(100 + oc->kind, g_rank, i);
    tm_tensor *gy;
    int64_t yshape[2] = {tm_tensor_dim(y, 0), tm_tensor_dim(y, 1)};
    OK(ctx, tm_tensor_from_host(ctx, TM_F64, 2, yshape, tm_cpu(), TM_F64, gv, &gy));
    OK(ctx, tm_backward_with_grad(ctx, y, gy));
    if (n) OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(x), TM_F64, ga, n));
    tm_ctx_arena_reset(ctx);

    /* numeric, one element of one rank at a time, every rank evaluating */
    int prev = tm_ctx_set_grad_enabled(ctx, 0);
    const double h = 1e-6;
    for (int q = 0; q < W; q++) {
        int64_t nq = n;
        OK(ctx, tm_comm_bcast_host(ctx, TM_COMM_WORLD, q, &nq, sizeof nq));
        for (int64_t i = 0; i < nq; i++) {
            double l[2];
            for (int s = 0; s < 2; s++) {
                if (g_rank == q) xv[i] += s ? -h : h;
                OK(ctx, tm_tensor_from_host(ctx, TM_F64, 2, shape, tm_cpu(), TM_F64, xv, &x));
                l[s] = loss_of(ctx, oc, x);
                if (g_rank == q) xv[i] -= s ? -h : h;
                tm_ctx_arena_reset(ctx);
            }
            double num = (l[0] - l[1]) / (2 * h);
            if (g_rank == q)
                CHECK(fabs(num - ga[i]) <= 1e-6 + 1e-6 * fabs(num), "%s: dL/dx[%lld] analytic %.12g numeric %.12g",
                      oc->name, (long long)i, ga[i], num);
        }
    }
    tm_ctx_set_grad_enabled(ctx, prev);
    free(xv), free(want), free(got), free(gv), free(ga);
}

/* A backward whose collective input needs a gradient on rank 0 only still completes on every
 * rank, and rank 0 gets the right gradient. */
static void check_partial_requires_grad(tm_ctx *ctx) {
    int64_t shape[2] = {2, 3}, one = 1;
    double xv[6];
    for (int i = 0; i < 6; i++) xv[i] = val(7, g_rank, i);
    tm_tensor *x, *y, *w, *s, *t, *l;
    OK(ctx, tm_tensor_from_host(ctx, TM_F64, 2, shape, tm_cpu(), TM_F64, xv, &x));
    if (g_rank == 0) OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    double wv = 2.0;
    OK(ctx, tm_tensor_from_host(ctx, TM_F64, 1, &one, tm_cpu(), TM_F64, &wv, &w));
    OK(ctx, tm_tensor_set_requires_grad(ctx, w, 1));
    OK(ctx, tm_comm_allgather(ctx, x, TM_COMM_WORLD, &y)); /* [2 W, 3] */
    OK(ctx, tm_sum_all(ctx, y, &s));
    OK(ctx, tm_sum_all(ctx, w, &t));
    OK(ctx, tm_mul(ctx, s, t, &l)); /* L_r = 2 * sum(all x) */
    OK(ctx, tm_backward(ctx, l));
    if (g_rank == 0) {
        double gx[6];
        OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(x), TM_F64, gx, 6));
        int W = tm_comm_size(ctx, TM_COMM_WORLD);
        for (int i = 0; i < 6; i++)
            CHECK(fabs(gx[i] - 2.0 * W) < 1e-12, "partial requires_grad: dL/dx[%d] = %g, expected %d", i, gx[i], 2 * W);
    }
    tm_ctx_arena_reset(ctx);
}

/* Integer all-reduce (the MoE counts) and the host collectives. */
static void check_counts(tm_ctx *ctx) {
    int W = tm_comm_size(ctx, TM_COMM_WORLD);
    int64_t c[3] = {g_rank, 1, 2 * g_rank}, shape = 3, got[3];
    tm_tensor *t, *y;
    OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &shape, tm_cpu(), TM_I64, c, &t));
    OK(ctx, tm_comm_allreduce(ctx, t, TM_COMM_WORLD, &y));
    OK(ctx, tm_tensor_read(ctx, y, TM_I64, got, 3));
    int64_t s = (int64_t)W * (W - 1) / 2;
    CHECK(got[0] == s && got[1] == W && got[2] == 2 * s, "i64 allreduce: %lld %lld %lld", (long long)got[0],
          (long long)got[1], (long long)got[2]);
    tm_ctx_arena_reset(ctx);
}

/* The op on this rank's f32 input on device dev, forward and backward with a fixed upstream
 * gradient; output and input gradient to the host (malloc'd). */
static void run_on(tm_ctx *ctx, const op_case *oc, tm_device dev, double **y, int64_t *ny, double **gx, int64_t *nx) {
    int G = tm_comm_size(ctx, (tm_comm_group)oc->group), me = tm_comm_rank(ctx, (tm_comm_group)oc->group);
    int64_t rows = oc->rows(me, G), shape[2] = {rows, oc->width}, n = rows * oc->width;
    double *xv = malloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) xv[i] = val(oc->kind, g_rank, i);
    tm_tensor *x, *out, *gy;
    OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, shape, dev, TM_F64, xv, &x));
    OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    OK(ctx, run_op(ctx, oc, x, &out));
    *ny = tm_tensor_numel(out);
    double *gv = malloc(sizeof(double) * (size_t)(*ny ? *ny : 1));
    for (int64_t i = 0; i < *ny; i++) gv[i] = val(100 + oc->kind, g_rank, i);
    int64_t yshape[2] = {tm_tensor_dim(out, 0), tm_tensor_dim(out, 1)};
    OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, yshape, dev, TM_F64, gv, &gy));
    *y = malloc(sizeof(double) * (size_t)(*ny ? *ny : 1));
    OK(ctx, tm_tensor_read(ctx, out, TM_F64, *y, *ny));
    OK(ctx, tm_backward_with_grad(ctx, out, gy));
    *nx = n;
    *gx = malloc(sizeof(double) * (size_t)(n ? n : 1));
    if (n) OK(ctx, tm_tensor_read(ctx, tm_tensor_grad(x), TM_F64, *gx, n));
    tm_ctx_arena_reset(ctx);
    free(xv), free(gv);
}

/* The GPU machine's check of the CUDA engines (nccl, or mpi-staged when ranks share a GPU):
 * every collective op on CUDA tensors equals the same op on CPU tensors (mpi engine), forward
 * and backward. Skipped (exit 0) without a CUDA device. nccl: tm_comm_options.nccl (the
 * helper's second argument, auto | off | always; always makes a one-rank NCCL world). */
static tm_status chunked_layer(tm_ep_strategy st, int C, int64_t T, int variant, double **v, int64_t *n, int64_t *a2a,
                               char *msg, size_t msglen);

/* The chunked MoE layer (overlap_chunks) on CUDA tensors, ep_size 2: with overlap on (its
 * all-to-alls on the side stream where the engine is NCCL: every one of them, none waited for
 * early) the same values bit for bit as with overlap off, and within 1e-4 of each block's
 * largest magnitude of the CPU's (the layer chain in f32: three GEMMs and a SwiGLU, as the
 * CUDA parity tests allow); C = 1 (the unchunked code) likewise against the CPU. */
static void check_cuda_chunked(int world, int cuda, int nccl) {
    if (world % 2) return;
    const int64_t T = 12;
    for (int st = 0; st < 3; st += 2) {
        const tm_ep_strategy strategy = (tm_ep_strategy)st;
        for (int variant = 0; variant < 2; variant++)
            for (int C = 1; C <= 4; C += 3) {
                double *ref = NULL, *on = NULL, *off = NULL;
                int64_t nref = 0, non = 0, noff = 0, a2a;
                char msg[1024];
                g_cuda = -1;
                tm_status s = chunked_layer(strategy, C, T, variant, &ref, &nref, &a2a, msg, sizeof msg);
                CHECK(!s, "cuda chunked %s variant %d C %d, CPU: %s", tm_ep_strategy_name(strategy), variant, C, msg);
                g_cuda = cuda, g_nccl = nccl;
                if (!s) s = chunked_layer(strategy, C, T, variant, &on, &non, &a2a, msg, sizeof msg);
                CHECK(!s, "cuda chunked %s variant %d C %d: %s", tm_ep_strategy_name(strategy), variant, C, msg);
                const int64_t beside = g_beside, early = g_early;
                const int nccl_engine = !strcmp(g_engine, "nccl");
                g_overlap = 0;
                if (!s) s = chunked_layer(strategy, C, T, variant, &off, &noff, &a2a, msg, sizeof msg);
                g_overlap = 1;
                g_cuda = -1, g_nccl = TM_NCCL_AUTO;
                CHECK(!s, "cuda chunked %s variant %d C %d, overlap off: %s", tm_ep_strategy_name(strategy), variant, C,
                      msg);
                if (!s && non == nref && noff == non) {
                    int64_t diff = 0;
                    for (int64_t i = 0; i < non && !diff; i++)
                        if (on[i] != off[i]) diff = i + 1;
                    CHECK(!diff, "cuda chunked %s variant %d C %d: overlap on and off differ at %lld: %.17g vs %.17g",
                          tm_ep_strategy_name(strategy), variant, C, (long long)diff - 1, diff ? on[diff - 1] : 0.0,
                          diff ? off[diff - 1] : 0.0);
                    const int64_t want = C > 1 && nccl_engine ? 2 * (strategy == TM_EP_ALLTOALL_DEDUP ? 3 : 2) * C : 0;
                    CHECK(beside == want && early == 0,
                          "cuda chunked %s variant %d C %d (%s): %lld all-to-alls beside the work (want %lld), %lld "
                          "waited for early",
                          tm_ep_strategy_name(strategy), variant, C, g_engine, (long long)beside, (long long)want,
                          (long long)early);
                    int64_t lo = 0, sizes[7] = {T * 8, T * 8, 8 * 4, 4 * 8 * 12 / 2, 4 * 8 * 12 / 2, 4 * 12 * 8 / 2, 4};
                    double worst = 0;
                    for (int b = 0; b < 7; b++) {
                        double scale = 0, md = 0;
                        for (int64_t i = lo; i < lo + sizes[b] && i < nref; i++) {
                            scale = fmax(scale, fabs(ref[i]));
                            md = fmax(md, fabs(on[i] - ref[i]));
                        }
                        lo += sizes[b];
                        worst = fmax(worst, scale > 0 ? md / scale : md);
                    }
                    CHECK(worst <= 1e-4, "cuda chunked %s variant %d C %d: %.3g of a block's largest magnitude from the CPU",
                          tm_ep_strategy_name(strategy), variant, C, worst);
                    if (g_rank == 0)
                        printf("cuda chunked layer: %s variant %d C %d (%s): %lld all-to-alls beside the work, CPU within "
                               "%.3g, overlap off bit for bit\n",
                               tm_ep_strategy_name(strategy), variant, C, g_engine, (long long)beside, worst);
                } else if (!s) {
                    CHECK(0, "cuda chunked %s variant %d C %d: %lld / %lld / %lld values", tm_ep_strategy_name(strategy),
                          variant, C, (long long)nref, (long long)non, (long long)noff);
                }
                free(ref), free(on), free(off);
            }
    }
}

/* The gradient all-reduce of an armed backward on CUDA (gsync_train, below): on 2 or more GPUs
 * with NCCL its pieces run on the side stream (every all-reduce of the backward counted beside
 * the work, tm_comm_sync_grads left with none), without (host-staged MPI) the backward leaves
 * them to tm_comm_sync_grads; either way the losses and this rank's weights are the unarmed
 * run's, bit for bit on 2 ranks, f32 and bf16. */
static void check_cuda_gsync(int world, int cuda, int nccl) {
    for (int bf16 = 0; bf16 < 2; bf16++) {
        g_cuda = cuda, g_nccl = nccl;
        gsync_run a = gsync_train(0, 1, bf16, 0, 0, 0), b = gsync_train(0, 1, bf16, 0, 1, 4096);
        const int pieces = world > 1 && !strcmp(g_engine, "nccl");
        g_cuda = -1, g_nccl = TM_NCCL_AUTO;
        for (int s = 0; s < KS; s++) {
            double tol = world <= 2 ? 0.0 : 1e-6 * fabs(a.loss[s]);
            CHECK(fabs(a.loss[s] - b.loss[s]) <= tol, "cuda gsync %s, step %d: loss %.17g unarmed, %.17g armed",
                  bf16 ? "bf16" : "f32", s + 1, a.loss[s], b.loss[s]);
            CHECK(pieces ? b.bw_calls[s] >= 2 && b.bw_beside[s] == b.bw_calls[s] && b.sync_calls[s] == 0
                         : b.bw_calls[s] == 0 && b.sync_calls[s] == a.sync_calls[s],
                  "cuda gsync %s (%s), step %d: the armed backward made %lld all-reduces (%lld beside), "
                  "tm_comm_sync_grads %lld", bf16 ? "bf16" : "f32", g_engine, s + 1, (long long)b.bw_calls[s],
                  (long long)b.bw_beside[s], (long long)b.sync_calls[s]);
        }
        if (world <= 2)
            CHECK(a.n_blocks == b.n_blocks && !memcmp(a.blocks, b.blocks, (size_t)a.n_blocks * (bf16 ? 2 : 4)),
                  "cuda gsync %s: this rank's weights differ armed and unarmed", bf16 ? "bf16" : "f32");
        free(a.blocks), free(b.blocks);
    }
}

static void check_cuda(int world, int nccl) {
    if (tm_cuda_device_count() == 0) {
        if (g_rank == 0) printf("cuda: no CUDA device, skipped\n");
        return;
    }
    tm_ctx *ctx = NULL;
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    o.cuda_device = g_rank % tm_cuda_device_count();
    OK(ctx, tm_ctx_new(&ctx, &o));
    tm_comm_options co = tm_comm_options_default();
    co.ep_size = world % 2 == 0 ? 2 : 1;
    co.timeout_s = 60;
    co.nccl = nccl;
    OK(ctx, tm_comm_init(ctx, &co));
    if (g_rank == 0) printf("cuda: engine %s for CUDA tensors\n", tm_comm_engine(ctx, tm_cuda(o.cuda_device)));
    const op_case cases[] = {
        {"allreduce world", TM_COMM_WORLD, rows_two, 3, 0},   {"allgather ragged", TM_COMM_WORLD, rows_ragged, 3, 1},
        {"allgather ep", TM_COMM_EP, rows_two, 2, 1},         {"reduce_scatter world", TM_COMM_WORLD, rows_rs, 2, 2},
        {"alltoall world", TM_COMM_WORLD, rows_a2a, 2, 3},    {"alltoall ep", TM_COMM_EP, rows_a2a, 3, 3},
    };
    check_cuda_chunked(world, o.cuda_device, nccl);
    check_cuda_gsync(world, o.cuda_device, nccl);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        double *yc, *gc, *yg, *gg;
        int64_t nyc, nxc, nyg, nxg;
        run_on(ctx, &cases[k], tm_cpu(), &yc, &nyc, &gc, &nxc);
        run_on(ctx, &cases[k], tm_cuda(o.cuda_device), &yg, &nyg, &gg, &nxg);
        CHECK(nyc == nyg && nxc == nxg, "cuda %s: sizes differ", cases[k].name);
        for (int64_t i = 0; nyc == nyg && i < nyc; i++)
            CHECK(fabs(yc[i] - yg[i]) <= 1e-5 + 1e-5 * fabs(yc[i]), "cuda %s: y[%lld] %g (cpu) vs %g (cuda)",
                  cases[k].name, (long long)i, yc[i], yg[i]);
        for (int64_t i = 0; nxc == nxg && i < nxc; i++)
            CHECK(fabs(gc[i] - gg[i]) <= 1e-5 + 1e-5 * fabs(gc[i]), "cuda %s: dx[%lld] %g (cpu) vs %g (cuda)",
                  cases[k].name, (long long)i, gc[i], gg[i]);
        free(yc), free(gc), free(yg), free(gg);
    }
    tm_ctx_free(ctx);
}

/* ZeRO-1: each rank keeps the AdamW moments (and, for bf16, the f32 master weights) of its
 * block of every bucket only; the blocks tile the bucket. */
static void check_zero_memory(tm_ctx *unused, int world) {
    for (int bf16 = 0; bf16 < 2; bf16++) {
        tm_ctx *ctx = NULL;
        tm_ctx_options o = tm_ctx_options_default();
        o.num_threads = 1;
        OK(ctx, tm_ctx_new(&ctx, &o));
        tm_comm_options co = tm_comm_options_default();
        co.zero = 1;
        co.ep_size = world % 2 == 0 ? 2 : 1;
        co.timeout_s = 30;
        OK(ctx, tm_comm_init(ctx, &co));
        tm_model_config mc = tm_model_config_default();
        mc.vocab_size = 32, mc.d_model = 16, mc.n_layers = 1, mc.n_heads = 2, mc.n_kv_heads = 1, mc.max_seq_len = 8;
        mc.moe.ffn_size = 16;
        tm_model *m;
        OK(ctx, tm_model_new(ctx, &mc, bf16 ? TM_BF16 : TM_F32, tm_cpu(), &m));
        tm_memory_report before, after;
        OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &before));
        tm_optimizer *opt;
        OK(ctx, tm_adamw_new(ctx, NULL, &opt));
        OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &after));
        int64_t want = 0, total[2] = {0, 0};
        for (int k = 0; k < tm_ctx_num_buckets(ctx); k++) {
            int64_t lo, hi;
            tm_bucket_info bi;
            OK(ctx, tm_ctx_grad_shard(ctx, k, &lo, &hi));
            OK(ctx, tm_ctx_bucket_info(ctx, k, &bi));
            int64_t per = (hi - lo ? hi - lo : 1) * 4; /* one f32 buffer of the block (>= 1 element) */
            want += 2 * per + (bi.dtype == TM_BF16 ? (hi - lo) * 4 : 0);
            /* the blocks of a bucket's group tile it: sum over the group = the bucket */
            int64_t mine[2] = {hi - lo, bi.numel};
            OK(ctx, tm_comm_allreduce_host(ctx, bi.group == TM_PARAM_EXPERT ? TM_COMM_EXPERT_DP : TM_COMM_DP, TM_I64,
                                           mine, 2));
            int G = tm_comm_size(ctx, bi.group == TM_PARAM_EXPERT ? TM_COMM_EXPERT_DP : TM_COMM_DP);
            CHECK(mine[0] == mine[1] / G, "zero: bucket %d blocks cover %lld of %lld elements", k, (long long)mine[0],
                  (long long)(mine[1] / G));
            total[0] += hi - lo, total[1] += bi.numel;
        }
        int64_t got = (int64_t)(after.current[TM_MEM_OPTIMIZER] - before.current[TM_MEM_OPTIMIZER]);
        /* + the i64 step counter, a host buffer of the optimizer category, on the CPU */
        CHECK(got >= want && got <= want + 64, "zero (%s): optimizer memory %lld bytes, expected %lld", bf16 ? "bf16" : "f32",
              (long long)got, (long long)want);
        CHECK(world == 1 || total[0] < total[1], "zero: this rank holds %lld of %lld elements", (long long)total[0],
              (long long)total[1]);
        tm_optimizer_free(opt);
        tm_model_free(m);
        tm_ctx_free(ctx);
    }
}


/* tm_model_init under a communicator draws 1/G of each replicated weight per rank and
 * all-gathers the rest: every parameter must equal, bit for bit, the same model initialised in a
 * context without a communicator (expert shards: their rows of the logical tensor), for data
 * parallelism (ep_size 1) and expert parallelism (ep_size 2), f32 and bf16. */
static void check_replicated_init(int world) {
    for (int ep = 1; ep <= 2; ep++) {
        if (world % ep) continue;
        for (int k = 0; k < 2; k++) {
            tm_dtype dt = k ? TM_BF16 : TM_F32;
            tm_ctx_options o = tm_ctx_options_default();
            o.num_threads = 1;
            tm_ctx *a = NULL, *b = NULL;
            if (tm_ctx_new(&a, &o) || tm_ctx_new(&b, &o)) exit(2);
            tm_comm_options co = tm_comm_options_default();
            co.ep_size = ep;
            co.timeout_s = 30;
            OK(a, tm_comm_init(a, &co));
            tm_model_config mc = tm_model_config_default();
            tm_model *ma = NULL, *mb = NULL;
            OK(a, tm_model_new(a, &mc, dt, tm_cpu(), &ma));
            OK(b, tm_model_new(b, &mc, dt, tm_cpu(), &mb));
            OK(a, tm_model_init(ma, 99));
            OK(b, tm_model_init(mb, 99));
            int er = tm_comm_rank(a, TM_COMM_EP), checked = 0;
            for (int i = 0; i < tm_ctx_num_params(a); i++) {
                tm_tensor *pa = tm_ctx_param(a, i), *pb = tm_ctx_find(b, tm_tensor_name(pa));
                CHECK(pb, "replicated init: %s missing in the reference", tm_tensor_name(pa));
                if (!pb) continue;
                int64_t n = tm_tensor_numel(pa), nb = tm_tensor_numel(pb), off = 0;
                if (n != nb) off = (int64_t)er * n; /* an expert shard: rows [er E/P, ...) of the logical tensor */
                double *va = malloc(sizeof(double) * (size_t)n), *vb = malloc(sizeof(double) * (size_t)nb);
                OK(a, tm_tensor_read(a, pa, TM_F64, va, n));
                OK(b, tm_tensor_read(b, pb, TM_F64, vb, nb));
                int64_t bad = -1;
                for (int64_t j = 0; j < n && bad < 0; j++)
                    if (memcmp(&va[j], &vb[off + j], sizeof(double))) bad = j;
                CHECK(bad < 0, "replicated init (ep_size %d, %s): %s element %lld is %.9g, one process draws %.9g", ep,
                      tm_dtype_name(dt), tm_tensor_name(pa), (long long)bad, bad < 0 ? 0 : va[bad],
                      bad < 0 ? 0 : vb[off + bad]);
                checked++;
                free(va), free(vb);
            }
            CHECK(checked > 4, "replicated init: only %d parameters", checked);
            tm_model_free(ma), tm_model_free(mb);
            tm_ctx_free(a), tm_ctx_free(b);
        }
    }
}


/* The tiny MoE model of the step checks below: n_layers blocks, the first dense, 4 experts top-2. */
static tm_model_config tiny_config(int n_layers) {
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 31;
    c.d_model = 16;
    c.n_layers = n_layers;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.max_seq_len = 12;
    c.first_k_dense = 1;
    c.dense_ffn_size = 20;
    c.moe.ffn_size = 12;
    c.moe.router.num_experts = 4;
    c.moe.router.topk = 2;
    c.moe.aux_loss_coeff = 1e-2;
    return c;
}

/* The host round trips (tm_ctx_sync_count) of one training step of a tiny model: forward,
 * backward, the loss read. comm: attach a communicator with ep_size 2 and this strategy. */
static uint64_t step_syncs(int comm, tm_ep_strategy strategy, int chunks, int step) {
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) exit(2);
    if (comm) {
        tm_comm_options co = tm_comm_options_default();
        co.ep_size = 2;
        co.ep_strategy = strategy;
        co.timeout_s = 30;
        OK(ctx, tm_comm_init(ctx, &co));
    }
    tm_model_config c = tiny_config(3);
    c.moe.overlap_chunks = chunks;
    tm_model *m = NULL;
    OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    OK(ctx, tm_model_init(m, 3));
    enum { B = 2, T = 12 };
    int32_t tok[B * T + 1];
    for (int i = 0; i < B * T + 1; i++) tok[i] = (i * 7 + 3 + 5 * g_rank) % 31;
    int64_t sh[2] = {B, T};
    uint64_t n = 0;
    for (int s = 0; s <= step; s++) {
        tm_tensor *tokens, *targets;
        OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, sh, tm_cpu(), TM_I32, tok, &tokens));
        OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, sh, tm_cpu(), TM_I32, tok + 1, &targets));
        uint64_t before = tm_ctx_sync_count(ctx);
        tm_model_out out;
        OK(ctx, tm_model_forward(m, tokens, targets, &out));
        OK(ctx, tm_backward(ctx, out.loss));
        float lv;
        OK(ctx, tm_tensor_read(ctx, out.loss, TM_F32, &lv, 1));
        n = tm_ctx_sync_count(ctx) - before;
        tm_ctx_arena_reset(ctx);
    }
    tm_model_free(m);
    tm_ctx_free(ctx);
    return n;
}

/* The host round trips of an expert-parallel step against the same step in one process (which
 * makes one per MoE layer, where the grouped GEMM reads its counts, plus the ids' check and the
 * loss): alltoall and allgather make exactly as many (the one read per layer of the counts that
 * ncclSend / ncclRecv need on the host, exchanged on the device; the all-gather's permute's row
 * count); alltoall_dedup two more per MoE layer (its rank permute's row count and the counts it
 * receives). The backward reads nothing, and the collectives themselves never wait on the
 * host. tiny_config(3) has 2 MoE layers. */
static void check_ep_syncs(int world) {
    if (world % 2) return;
    for (int st = 0; st < 3; st++) {
        const tm_ep_strategy strategy = (tm_ep_strategy)st;
        uint64_t ref = step_syncs(0, strategy, 1, 1), n = step_syncs(1, strategy, 1, 1);
        uint64_t want = ref + (strategy == TM_EP_ALLTOALL_DEDUP ? 2 * 2 : 0);
        CHECK(n == want, "ep_size 2 %s: %llu host round trips per step, want %llu (one process makes %llu)",
              tm_ep_strategy_name(strategy), (unsigned long long)n, (unsigned long long)want, (unsigned long long)ref);
        if (g_rank == 0)
            fprintf(stderr, "ep syncs: %s %llu per step, one process %llu\n", tm_ep_strategy_name(strategy),
                    (unsigned long long)n, (unsigned long long)ref);
        /* overlap_chunks (3 dividing the 24 tokens, 5 not): the chunks' counts are read
         * together, so no more round trips than unchunked; alltoall_dedup one fewer per MoE
         * layer (each chunk's receiver knows its rows per expert from the exchange, where the
         * unchunked receiver permute reads them); allgather ignores the option. */
        for (int chunks = 3; chunks <= 5; chunks += 2) {
            uint64_t nc = step_syncs(1, strategy, chunks, 1);
            uint64_t wc = ref + (strategy == TM_EP_ALLTOALL_DEDUP ? 1 * 2 : 0);
            CHECK(nc == wc, "ep_size 2 %s, overlap_chunks %d: %llu host round trips per step, want %llu (unchunked %llu)",
                  tm_ep_strategy_name(strategy), chunks, (unsigned long long)nc, (unsigned long long)wc,
                  (unsigned long long)n);
            if (g_rank == 0)
                fprintf(stderr, "ep syncs: %s overlap_chunks %d: %llu per step\n", tm_ep_strategy_name(strategy), chunks,
                        (unsigned long long)nc);
        }
    }
}

/* ---- overlap_chunks: the chunked expert-parallel dispatch ----------------------------------- */

/* One MoE layer under ep_size 2 with ep_strategy st and overlap_chunks C: forward of this rank's
 * T tokens (rank-dependent values), backward of <g, y> (g fixed per rank). *v: y, dx and the
 * gradients of the gate and the three expert weights, concatenated; *a2a: the all-to-all calls
 * of the forward. variant 0: dropless, align 1, aux + z losses; 1: align_size 4, capacity 1.25,
 * the expert bias, early top-k weights; 2: capacity 1.0 padded to capacity. Returns the
 * forward's status (its message in msg). */

static tm_status chunked_layer(tm_ep_strategy st, int C, int64_t T, int variant, double **v, int64_t *n, int64_t *a2a,
                               char *msg, size_t msglen) {
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    if (g_cuda >= 0) o.cuda_device = g_cuda;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) exit(2);
    const tm_device dev = g_cuda >= 0 ? tm_cuda(g_cuda) : tm_cpu();
    tm_comm_options co = tm_comm_options_default();
    co.ep_size = 2;
    co.ep_strategy = st;
    co.timeout_s = 30;
    co.overlap = g_overlap;
    co.nccl = g_nccl;
    OK(ctx, tm_comm_init(ctx, &co));
    snprintf(g_engine, sizeof g_engine, "%s", tm_comm_engine(ctx, dev));
    tm_moe_config c = tm_moe_config_default();
    c.hidden_size = 8;
    c.ffn_size = 12;
    c.router.num_experts = 4;
    c.router.topk = 2;
    c.aux_loss_coeff = 1e-2;
    c.z_loss_coeff = 1e-3;
    c.overlap_chunks = C;
    if (variant == 1) {
        c.align_size = 4;
        c.capacity_factor = 1.25;
        c.use_expert_bias = 1;
        c.apply_topk_weights_early = 1;
    } else if (variant == 2) {
        c.capacity_factor = 1.0;
        c.pad_to_capacity = 1;
        c.drop_policy = TM_DROP_POSITION;
    }
    tm_moe *m = NULL;
    OK(ctx, tm_moe_new(ctx, "moe", &c, TM_F32, dev, &m));
    OK(ctx, tm_moe_init(m, 5, 0.3, 0.3));
    const int64_t H = c.hidden_size, nx = T * H;
    float *xv = malloc(sizeof(float) * (size_t)(2 * nx + 1));
    for (int64_t i = 0; i < nx; i++) xv[i] = (float)val(40, g_rank, i), xv[nx + i] = (float)val(41, g_rank, i);
    int64_t sh[2] = {T, H};
    tm_tensor *x, *g, *y;
    OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, sh, dev, TM_F32, xv, &x));
    OK(ctx, tm_tensor_from_host(ctx, TM_F32, 2, sh, dev, TM_F32, xv + nx, &g));
    OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    free(xv);
    tm_comm_stats s0, s1;
    OK(ctx, tm_comm_get_stats(ctx, &s0));
    tm_moe_stats stats;
    tm_status s = tm_moe_forward(m, x, 1, &y, &stats);
    snprintf(msg, msglen, "%s", s ? tm_ctx_errmsg(ctx) : "");
    *v = NULL;
    *n = 0;
    if (!s) {
        OK(ctx, tm_comm_get_stats(ctx, &s1));
        *a2a = s1.calls[TM_COMM_ALLTOALL] - s0.calls[TM_COMM_ALLTOALL];
        OK(ctx, tm_backward_with_grad(ctx, y, g));
        tm_comm_stats s2;
        OK(ctx, tm_comm_get_stats(ctx, &s2));
        g_beside = s2.beside[TM_COMM_ALLTOALL] - s0.beside[TM_COMM_ALLTOALL];
        g_early = s2.beside_early - s0.beside_early;
        const char *names[] = {"gate.weight", "experts.w0", "experts.w1", "experts.wo"};
        tm_tensor *parts[6] = {y, tm_tensor_grad(x)};
        for (int i = 0; i < 4; i++) parts[2 + i] = tm_tensor_grad(tm_moe_tensor(m, names[i]));
        for (int i = 0; i < 6; i++) *n += tm_tensor_numel(parts[i]);
        *v = malloc(sizeof(double) * (size_t)*n);
        int64_t k = 0;
        for (int i = 0; i < 6; i++) {
            OK(ctx, tm_tensor_read(ctx, parts[i], TM_F64, *v + k, tm_tensor_numel(parts[i])));
            k += tm_tensor_numel(parts[i]);
        }
        /* the losses and statistics are the whole layer's: compared too */
        OK(ctx, tm_moe_stats_read(m, &stats));
        double extra[4] = {stats.aux_loss_value, stats.z_loss_value, stats.max_load_ratio, (double)stats.dropped_tokens};
        *v = realloc(*v, sizeof(double) * (size_t)(*n + 4));
        memcpy(*v + *n, extra, sizeof extra);
        *n += 4;
    }
    tm_moe_free(m);
    tm_ctx_free(ctx);
    return s;
}

/* Chunked against unchunked, on the same rank: the same y, dx, gradients, losses and statistics
 * up to the order of float sums (f32: within 2e-6 of each block's largest magnitude), for C
 * dividing T and not (ragged chunks), C = T (one token each), with the all-to-alls the chunking
 * promises (forward: one count exchange, then per chunk 2 (alltoall: rows there and back) or 3
 * (alltoall_dedup: rows and their table there, partial sums back)); C > T refused on every rank
 * by name. */
static void check_chunked_layer(int world) {
    if (world % 2) return;
    const int64_t T = 12;
    for (int st = 0; st < 3; st += 2) {
        const tm_ep_strategy strategy = (tm_ep_strategy)st;
        for (int variant = 0; variant < 3; variant++) {
            double *ref, *got;
            int64_t nref, ngot, a2a_ref, a2a;
            char msg[1024];
            if (chunked_layer(strategy, 1, T, variant, &ref, &nref, &a2a_ref, msg, sizeof msg)) {
                CHECK(0, "%s variant %d unchunked: %s", tm_ep_strategy_name(strategy), variant, msg);
                continue;
            }
            const int Cs[] = {2, 5, 12};
            for (int ci = 0; ci < 3; ci++) {
                const int C = Cs[ci];
                tm_status s = chunked_layer(strategy, C, T, variant, &got, &ngot, &a2a, msg, sizeof msg);
                CHECK(!s, "%s variant %d C %d: %s", tm_ep_strategy_name(strategy), variant, C, msg);
                if (s) continue;
                CHECK(ngot == nref, "%s C %d: %lld values, %lld unchunked", tm_ep_strategy_name(strategy), C,
                      (long long)ngot, (long long)nref);
                /* blocks: y, dx (T H each), the gate and expert gradients, 4 statistics */
                double worst = 0;
                int64_t lo = 0, sizes[7] = {T * 8, T * 8, 8 * 4, 4 * 8 * 12 / 2, 4 * 8 * 12 / 2, 4 * 12 * 8 / 2, 4};
                for (int b = 0; b < 7 && ngot == nref; b++) {
                    double scale = 0, md = 0;
                    for (int64_t i = lo; i < lo + sizes[b] && i < nref; i++) {
                        scale = fmax(scale, fabs(ref[i]));
                        md = fmax(md, fabs(got[i] - ref[i]));
                    }
                    lo += sizes[b];
                    double rel = scale > 0 ? md / scale : md;
                    worst = fmax(worst, rel);
                    CHECK(rel <= 2e-6, "%s variant %d C %d: block %d differs by %g of its largest magnitude %g",
                          tm_ep_strategy_name(strategy), variant, C, b, rel, scale);
                }
                CHECK(lo == nref, "block sizes %lld, values %lld", (long long)lo, (long long)nref);
                const int64_t want = 1 + (strategy == TM_EP_ALLTOALL_DEDUP ? 3 : 2) * (int64_t)C;
                CHECK(a2a == want, "%s C %d: %lld all-to-alls in the forward, want %lld (%lld unchunked)",
                      tm_ep_strategy_name(strategy), C, (long long)a2a, (long long)want, (long long)a2a_ref);
                if (g_rank == 0)
                    fprintf(stderr, "chunked layer: %s variant %d C %d: worst %.3g, %lld all-to-alls (unchunked %lld)\n",
                            tm_ep_strategy_name(strategy), variant, C, worst, (long long)a2a, (long long)a2a_ref);
                /* Beside the work (overlap on, the default): every chunk's all-to-alls, forward
                 * and backward (the count exchange stays in place: its counts are read at once),
                 * none waited for early; and the values of overlap off, bit for bit. */
                const int64_t beside_want = 2 * (want - 1), beside_got = g_beside, early = g_early;
                CHECK(beside_got == beside_want && early == 0,
                      "%s variant %d C %d: %lld all-to-alls beside the work (want %lld), %lld waited for early (want 0)",
                      tm_ep_strategy_name(strategy), variant, C, (long long)beside_got, (long long)beside_want,
                      (long long)early);
                double *off;
                int64_t noff, a2a_off;
                g_overlap = 0;
                s = chunked_layer(strategy, C, T, variant, &off, &noff, &a2a_off, msg, sizeof msg);
                g_overlap = 1;
                CHECK(!s, "%s variant %d C %d, overlap off: %s", tm_ep_strategy_name(strategy), variant, C, msg);
                if (!s) {
                    int64_t diff = noff == ngot ? 0 : -1;
                    for (int64_t i = 0; i < ngot && diff == 0; i++)
                        if (off[i] != got[i]) diff = i + 1;
                    CHECK(diff == 0 && g_beside == 0,
                          "%s variant %d C %d: overlap on and off differ (%lld values, first at %lld: %.17g vs %.17g); "
                          "%lld beside the work with overlap off",
                          tm_ep_strategy_name(strategy), variant, C, (long long)noff, (long long)diff - 1,
                          diff > 0 ? got[diff - 1] : 0.0, diff > 0 ? off[diff - 1] : 0.0, (long long)g_beside);
                    free(off);
                }
                free(got);
            }
            free(ref);
        }
        double *none;
        int64_t nn, a2a;
        char msg[1024];
        tm_status s = chunked_layer(strategy, 13, T, 0, &none, &nn, &a2a, msg, sizeof msg);
        CHECK(s == TM_ERR_INVALID_ARG && strstr(msg, "overlap_chunks = 13") && strstr(msg, "12 tokens"),
              "%s: 13 chunks of 12 tokens: %s: %s", tm_ep_strategy_name(strategy), tm_status_str(s), msg);
    }
}

/* Data parallelism's row map is made once per model forward and shared by its MoE layers: the
 * all-gathers of a forward do not grow with the number of MoE layers (each layer made its own
 * host all-gather of the ranks' row counts before). */
static int64_t forward_allgathers(int n_layers) {
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) exit(2);
    tm_comm_options co = tm_comm_options_default();
    co.timeout_s = 30;
    OK(ctx, tm_comm_init(ctx, &co));
    tm_model_config c = tiny_config(n_layers);
    tm_model *m = NULL;
    OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    OK(ctx, tm_model_init(m, 3));
    enum { B = 2, T = 12 };
    int32_t tok[B * T + 1];
    for (int i = 0; i < B * T + 1; i++) tok[i] = (i * 7 + 3 + 5 * g_rank) % 31;
    int64_t sh[2] = {B, T};
    tm_tensor *tokens, *targets;
    OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, sh, tm_cpu(), TM_I32, tok, &tokens));
    OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, sh, tm_cpu(), TM_I32, tok + 1, &targets));
    tm_comm_stats a, b;
    OK(ctx, tm_comm_get_stats(ctx, &a));
    tm_model_out out;
    OK(ctx, tm_model_forward(m, tokens, targets, &out));
    OK(ctx, tm_comm_get_stats(ctx, &b));
    tm_model_free(m);
    tm_ctx_free(ctx);
    return b.calls[TM_COMM_ALLGATHER] - a.calls[TM_COMM_ALLGATHER];
}

static void check_dp_row_map(void) {
    int64_t two = forward_allgathers(3), four = forward_allgathers(5);
    CHECK(two == 1 && four == 1, "data-parallel forward: %lld all-gathers with 2 MoE layers, %lld with 4 (want 1)",
          (long long)two, (long long)four);
}

/* ---- the library's plan of a rank against what the rank measures ------------------------- */
/* One rank's figures: the bytes held after the optimizer is made (the memory report's
 * parameters, gradients, optimizer state), the step's transient bytes (peak less current of
 * parameters and gradients), and per step the bytes of the gradient synchronisation, of the
 * all-gathers and reduce-scatters, of the all-to-alls. */
typedef struct rank_figures {
    int64_t params, grads, optim, transient, sync, gather, rscatter;
} rank_figures;

typedef struct plan_case {
    const char *name;
    int ep_size, zero, bf16, sgd, tie, n_layers, keep; /* keep: tm_comm_options.zero3_keep_last */
} plan_case;

static tm_model_config plan_config(const plan_case *pc) {
    tm_model_config c = tiny_config(pc->n_layers);
    c.tie_embeddings = pc->tie;
    if (pc->bf16) c.moe.shared_ffn_size = 8;
    return c;
}

static tm_status make_optimizer(tm_ctx *ctx, const plan_case *pc, tm_optimizer **opt) {
    if (pc->sgd) {
        tm_sgd_config sc = tm_sgd_config_default();
        sc.momentum = 0.9;
        return tm_sgd_new(ctx, &sc, opt);
    }
    tm_adamw_config ac = tm_adamw_config_default();
    return tm_adamw_new(ctx, &ac, opt);
}

static int64_t kind_bytes(const tm_comm_stats *a, const tm_comm_stats *b, tm_comm_kind k) {
    return b->bytes[k] - a->bytes[k];
}

/* The micro-batch of a real step on this rank: PB x PT rows. */
enum { PB = 2, PT = 12 };

/* This rank's batch of a step: PB x PT ids below 31 from i * mul + add + 3 * rank + shift * step
 * (a different sequence per rank and step), the targets shifted by one. */
static void step_batch(tm_ctx *ctx, int mul, int add, int shift, int step, tm_tensor **tokens, tm_tensor **targets) {
    int32_t tok[PB * PT + 1];
    for (int i = 0; i < PB * PT + 1; i++) tok[i] = (i * mul + add + 3 * g_rank + shift * step) % 31;
    int64_t sh[2] = {PB, PT};
    const tm_device dev = g_cuda >= 0 ? tm_cuda(g_cuda) : tm_cpu(); /* the model's (gsync on CUDA) */
    OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, sh, dev, TM_I32, tok, tokens));
    OK(ctx, tm_tensor_from_host(ctx, TM_I32, 2, sh, dev, TM_I32, tok + 1, targets));
}

/* This rank's parameter blocks (tm_ctx_bucket_tensor: its ZeRO blocks, or the whole buckets) in
 * bucket order, as bytes of the compute dtype; *n the elements. */
static unsigned char *rank_blocks(tm_ctx *ctx, int bf16, int64_t *n) {
    size_t es = bf16 ? 2 : 4, at = 0;
    *n = 0;
    for (int i = 0; i < tm_ctx_num_buckets(ctx); i++) *n += tm_tensor_numel(tm_ctx_bucket_tensor(ctx, i, TM_BUCKET_PARAMS));
    unsigned char *b = malloc(es * (size_t)(*n ? *n : 1));
    for (int i = 0; i < tm_ctx_num_buckets(ctx); i++) {
        tm_tensor *t = tm_ctx_bucket_tensor(ctx, i, TM_BUCKET_PARAMS);
        int64_t k = tm_tensor_numel(t);
        if (k) OK(ctx, tm_tensor_read(ctx, t, bf16 ? TM_BF16 : TM_F32, b + at, k));
        at += es * (size_t)k;
    }
    return b;
}

/* A real step of the case on this rank. */
static rank_figures measure(const plan_case *pc, int zero) {
    rank_figures f;
    memset(&f, 0, sizeof f);
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) exit(2);
    tm_comm_options co = tm_comm_options_default();
    co.ep_size = pc->ep_size;
    co.zero = zero;
    co.zero3_keep_last = pc->keep;
    co.timeout_s = 30;
    OK(ctx, tm_comm_init(ctx, &co));
    tm_model_config c = plan_config(pc);
    tm_model *m = NULL;
    tm_optimizer *opt = NULL;
    OK(ctx, tm_model_new(ctx, &c, pc->bf16 ? TM_BF16 : TM_F32, tm_cpu(), &m));
    OK(ctx, tm_model_init(m, 5));
    OK(ctx, make_optimizer(ctx, pc, &opt));
    tm_memory_report mr;
    OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &mr));
    f.params = (int64_t)mr.current[TM_MEM_PARAMETERS];
    f.grads = (int64_t)mr.current[TM_MEM_GRADIENTS];
    f.optim = (int64_t)mr.current[TM_MEM_OPTIMIZER];
    tm_tensor *tokens, *targets;
    step_batch(ctx, 5, 1, 0, 0, &tokens, &targets);
    tm_comm_stats s0, s1, s2, s3;
    OK(ctx, tm_comm_get_stats(ctx, &s0));
    tm_model_out out;
    OK(ctx, tm_model_forward(m, tokens, targets, &out));
    OK(ctx, tm_backward(ctx, out.loss));
    tm_ctx_arena_reset(ctx);
    OK(ctx, tm_comm_get_stats(ctx, &s1));
    OK(ctx, tm_comm_sync_grads(ctx));
    OK(ctx, tm_comm_get_stats(ctx, &s2));
    OK(ctx, tm_optimizer_step(opt, 1e-3));
    OK(ctx, tm_comm_get_stats(ctx, &s3));
    OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &mr));
    f.transient = (int64_t)(mr.peak[TM_MEM_GRADIENTS] - mr.current[TM_MEM_GRADIENTS]) +
                  (int64_t)(mr.peak[TM_MEM_PARAMETERS] - mr.current[TM_MEM_PARAMETERS]);
    for (int k = 0; k < TM_COMM_NKINDS; k++) f.sync += kind_bytes(&s1, &s2, (tm_comm_kind)k);
    /* the forward and backward's (ZeRO-3's weights, and the data-parallel row map) and the
     * optimizer step's (ZeRO-1 and 2's parameters) */
    f.gather = kind_bytes(&s0, &s1, TM_COMM_ALLGATHER) + kind_bytes(&s2, &s3, TM_COMM_ALLGATHER);
    f.rscatter = kind_bytes(&s0, &s1, TM_COMM_REDUCE_SCATTER);
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
    return f;
}

/* The library's plan of rank `rank` of `world` (a plan-only context: nothing allocated). */
static tm_step_plan plan_of(const plan_case *pc, int world, int rank, rank_figures *f) {
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    o.plan_only = 1;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) exit(2);
    tm_comm_options co = tm_comm_options_default();
    co.ep_size = pc->ep_size;
    co.zero = pc->zero;
    co.zero3_keep_last = pc->keep;
    co.plan_world_size = world;
    co.plan_rank = rank;
    OK(ctx, tm_comm_init(ctx, &co));
    tm_model_config c = plan_config(pc);
    tm_model *m = NULL;
    tm_optimizer *opt = NULL;
    OK(ctx, tm_model_new(ctx, &c, pc->bf16 ? TM_BF16 : TM_F32, tm_cpu(), &m));
    OK(ctx, make_optimizer(ctx, pc, &opt));
    tm_memory_report mr;
    OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &mr));
    memset(f, 0, sizeof *f);
    f->params = (int64_t)mr.current[TM_MEM_PARAMETERS];
    f->grads = (int64_t)mr.current[TM_MEM_GRADIENTS];
    f->optim = (int64_t)mr.current[TM_MEM_OPTIMIZER];
    tm_step_plan sp;
    OK(ctx, tm_model_plan_step(m, PB * PT, 1, &sp));
    f->transient = sp.transient;
    f->sync = sp.grad_sync;
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
    return sp;
}

/* 1 when every figure agrees (reported under `what` when `report`). base_gather: the
 * all-gather bytes the same step makes without ZeRO (the row map of data parallelism). */
static int plan_matches(const plan_case *pc, const rank_figures *m, const rank_figures *p, const tm_step_plan *sp,
                        int64_t base_gather, int report, const char *what) {
    int64_t want_gather = sp->param_gather + base_gather;
    int64_t want_rs = pc->zero >= 3 ? sp->bwd_reduce : pc->zero ? sp->grad_sync : 0;
    int64_t got_rs = m->rscatter + (pc->zero && pc->zero < 3 ? m->sync : 0);
    struct {
        const char *name;
        int64_t got, want;
    } rows[] = {{"parameters", m->params, p->params},  {"gradients", m->grads, p->grads},
                {"optimizer", m->optim, p->optim},     {"transient", m->transient, p->transient},
                {"grad_sync", m->sync, p->sync},       {"all-gather", m->gather, want_gather},
                {"reduce-scatter", got_rs, want_rs}};
    int ok = 1;
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
        if (rows[i].got == rows[i].want) continue;
        ok = 0;
        if (report)
            CHECK(0, "plan %s (ep_size %d, ZeRO-%d%s%s%s, keep %d), %s: %s measured %lld, planned %lld", pc->name,
                  pc->ep_size, pc->zero, pc->bf16 ? ", bf16" : "", pc->sgd ? ", sgd" : "", pc->tie ? ", tied" : "",
                  pc->keep, what,
                  rows[i].name, (long long)rows[i].got, (long long)rows[i].want);
    }
    return ok;
}

static void check_plan(int world) {
    /* ZeRO-3 with zero3_keep_last 0 (every weight gathered again for the backward), 1 (the
     * default), 2 and more than the layers (every layer kept) */
    const plan_case cases[] = {
        {"dp", 1, 0, 0, 0, 0, 3, 1},       {"dp", 1, 1, 1, 0, 0, 3, 1},       {"dp", 1, 2, 0, 1, 1, 3, 1},
        {"dp", 1, 3, 1, 0, 0, 3, 1},       {"dp", 1, 3, 0, 0, 1, 2, 1},       {"ep", 2, 0, 0, 0, 0, 3, 1},
        {"ep", 2, 1, 0, 1, 0, 3, 1},       {"ep", 2, 2, 1, 0, 0, 3, 1},       {"ep", 2, 3, 0, 0, 0, 3, 1},
        {"ep", 2, 3, 1, 1, 1, 2, 1},       {"ep=world", 0, 2, 0, 0, 0, 3, 1}, {"ep=world", 0, 3, 0, 0, 0, 3, 1},
        {"dp", 1, 3, 0, 0, 0, 3, 0},       {"dp", 1, 3, 1, 0, 1, 3, 2},       {"ep", 2, 3, 0, 0, 0, 3, 0},
        {"ep", 2, 3, 0, 0, 1, 3, 2},       {"ep", 2, 3, 1, 0, 0, 3, 9},
    };
    int n = 0;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        plan_case pc = cases[i];
        if (pc.ep_size == 0) pc.ep_size = world;
        if (world % pc.ep_size) continue;
        rank_figures m = measure(&pc, pc.zero), base = pc.zero ? measure(&pc, 0) : m, p;
        int64_t base_gather = base.gather;
        tm_step_plan sp = plan_of(&pc, world, g_rank, &p);
        plan_matches(&pc, &m, &p, &sp, base_gather, 1, "this rank");
        /* and the comparison can fail: the plan of twice the ranks (ZeRO 1-3) or of ZeRO-1
         * (ZeRO-0, where the rank count changes nothing) differs somewhere */
        rank_figures q;
        plan_case other = pc;
        if (!pc.zero) other.zero = 1;
        tm_step_plan sq = plan_of(&other, pc.zero ? 2 * world : world, g_rank, &q);
        CHECK(!plan_matches(&pc, &m, &q, &sq, base_gather, 0, ""), "plan %s (ep_size %d, ZeRO-%d): the plan of %d ranks "
              "at ZeRO-%d equals what %d measure", pc.name, pc.ep_size, pc.zero, pc.zero ? 2 * world : world, other.zero,
              world);
        /* ZeRO-3: so does the plan with another zero3_keep_last (one that keeps another set) */
        if (pc.zero == 3) {
            plan_case ok = pc;
            ok.keep = pc.keep ? 0 : 1;
            tm_step_plan sk = plan_of(&ok, world, g_rank, &q);
            CHECK(!plan_matches(&pc, &m, &q, &sk, base_gather, 0, ""), "plan %s (ep_size %d, ZeRO-3, keep %d): the plan "
                  "with zero3_keep_last %d equals what was measured", pc.name, pc.ep_size, pc.keep, ok.keep);
        }
        n++;
    }
    CHECK(n >= 13, "only %d plan cases ran on %d ranks", n, world);
}

/* ---- ZeRO-3's kept weights (tm_comm_options.zero3_keep_last) ------------------------------- */
/* A few training steps of the tiny model under ZeRO-3 with the last `keep` layers' weights kept
 * gathered from their forward to their backward: each step's loss, the all-gather calls of
 * its forward and backward, the transient weight bytes, and this rank's parameter blocks at the
 * end (ZeRO-3's tm_ctx_bucket_tensor view: the block). *kept receives the count of unit
 * gathers that the option keeps (each a bucket: fsdp.c), from the parameters' names: the
 * buckets of every "layers.<l>." parameter of the last `keep` layers, and from keep 1 those of
 * "norm.weight" and the head (lm_head.weight, or the tied embedding's second use). */
typedef struct keep_run {
    double loss[KS];
    int64_t gathers[KS], transient, kept, n_blocks;
    unsigned char *blocks;
} keep_run;

static keep_run keep_train(int ep_size, int bf16, int tie, int keep) {
    keep_run r;
    memset(&r, 0, sizeof r);
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) exit(2);
    tm_comm_options co = tm_comm_options_default();
    co.ep_size = ep_size;
    co.zero = 3;
    co.zero3_keep_last = keep;
    co.timeout_s = 30;
    OK(ctx, tm_comm_init(ctx, &co));
    tm_model_config c = tiny_config(3);
    c.tie_embeddings = tie;
    tm_model *m = NULL;
    tm_optimizer *opt = NULL;
    OK(ctx, tm_model_new(ctx, &c, bf16 ? TM_BF16 : TM_F32, tm_cpu(), &m));
    OK(ctx, tm_model_init(m, 11));
    tm_adamw_config ac = tm_adamw_config_default();
    OK(ctx, tm_adamw_new(ctx, &ac, &opt));
    /* one all-gather saved per unit kept (a unit of a dtype and group is one bucket) */
    unsigned char seen[64] = {0};
    for (int i = 0; i < tm_ctx_num_params(ctx); i++) {
        const char *name = tm_tensor_name(tm_ctx_param(ctx, i));
        int l, kept = 0;
        if (sscanf(name, "layers.%d.", &l) == 1) kept = keep > 0 && l >= c.n_layers - keep;
        else if (!strcmp(name, "norm.weight") || !strcmp(name, "lm_head.weight")) kept = keep > 0;
        else if (!strcmp(name, "embed.weight")) kept = keep > 0 && tie;
        tm_param_info pi;
        OK(ctx, tm_param_get_info(tm_ctx_param(ctx, i), &pi));
        CHECK(pi.bucket < 64, "bucket %d", pi.bucket);
        /* (an expert unit with ep_size the world has a group of one: resident, never gathered) */
        int resident = pi.opts.group == TM_PARAM_EXPERT && ep_size == tm_comm_size(ctx, TM_COMM_WORLD);
        if (kept && !resident && !seen[pi.bucket]) r.kept++, seen[pi.bucket] = 1;
    }
    tm_memory_report mr;
    OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &mr));
    size_t base = mr.current[TM_MEM_PARAMETERS];
    for (int step = 0; step < KS; step++) {
        tm_tensor *tokens, *targets;
        step_batch(ctx, 5, 1, 7, step, &tokens, &targets);
        tm_comm_stats a, b;
        OK(ctx, tm_comm_get_stats(ctx, &a));
        tm_model_out out;
        OK(ctx, tm_model_forward(m, tokens, targets, &out));
        OK(ctx, tm_backward(ctx, out.loss));
        OK(ctx, tm_comm_get_stats(ctx, &b));
        r.loss[step] = out.loss_value;
        r.gathers[step] = b.calls[TM_COMM_ALLGATHER] - a.calls[TM_COMM_ALLGATHER];
        tm_ctx_arena_reset(ctx);
        OK(ctx, tm_comm_sync_grads(ctx));
        OK(ctx, tm_optimizer_step(opt, 1e-2));
        tm_ctx_arena_reset(ctx);
    }
    OK(ctx, tm_ctx_memory_report(ctx, tm_cpu(), &mr));
    CHECK(mr.current[TM_MEM_PARAMETERS] == base, "keep %d: %zu parameter bytes after the steps, %zu before (a kept "
          "weight still counted)", keep, mr.current[TM_MEM_PARAMETERS], base);
    r.transient = (int64_t)(mr.peak[TM_MEM_PARAMETERS] - mr.current[TM_MEM_PARAMETERS]);
    r.blocks = rank_blocks(ctx, bf16, &r.n_blocks);
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
    return r;
}

/* Keeping changes no value (the same gathers, not repeated): every loss and every weight of
 * keep 1, 2 and all layers are the bits of keep 0; each step makes as many all-gathers fewer
 * as the option keeps units (one per kept unit: its backward's); and a kept unit is held
 * through the loss, so the most gathered at once grows with what is kept. */
static void check_keep(int world) {
    const struct {
        int ep_size, bf16, tie;
    } cases[] = {{1, 0, 0}, {2, 0, 0}, {1, 1, 1}, {2, 1, 0}};
    const int keeps[] = {1, 2, 9};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        int P = cases[k].ep_size, bf16 = cases[k].bf16, tie = cases[k].tie;
        if (world % P) continue;
        keep_run ref = keep_train(P, bf16, tie, 0);
        CHECK(ref.kept == 0, "keep 0 keeps %lld", (long long)ref.kept);
        int64_t prev_transient = ref.transient;
        for (size_t j = 0; j < sizeof keeps / sizeof *keeps; j++) {
            keep_run r = keep_train(P, bf16, tie, keeps[j]);
            const char *what = bf16 ? (tie ? "bf16, tied" : "bf16") : "f32";
            CHECK(r.kept > 0, "ep_size %d %s keep %d: no parameter kept", P, what, keeps[j]);
            for (int s = 0; s < KS; s++) {
                CHECK(memcmp(&r.loss[s], &ref.loss[s], sizeof(double)) == 0, "ep_size %d %s keep %d, step %d: loss "
                      "%.17g, %.17g with keep 0", P, what, keeps[j], s + 1, r.loss[s], ref.loss[s]);
                CHECK(r.gathers[s] == ref.gathers[s] - r.kept, "ep_size %d %s keep %d, step %d: %lld all-gathers, %lld "
                      "with keep 0, %lld units kept", P, what, keeps[j], s + 1, (long long)r.gathers[s],
                      (long long)ref.gathers[s], (long long)r.kept);
            }
            CHECK(r.n_blocks == ref.n_blocks && !memcmp(r.blocks, ref.blocks, (size_t)r.n_blocks * (bf16 ? 2 : 4)),
                  "ep_size %d %s keep %d: this rank's weights after %d steps differ from keep 0's", P, what, keeps[j],
                  KS);
            /* (with the experts resident, a kept layer's dense unit need not outgrow the
             * largest set held without keeping) */
            CHECK(r.transient > prev_transient || (P == world && r.transient == prev_transient),
                  "ep_size %d %s keep %d: %lld transient weight bytes, %lld with fewer kept", P, what, keeps[j],
                  (long long)r.transient, (long long)prev_transient);
            prev_transient = r.transient;
            free(r.blocks);
        }
        free(ref.blocks);
    }
}

/* ---- the clip's factor handed to AdamW under a communicator --------------------------------- */
/* KS training steps of the tiny model on this rank's tokens, clipped at max_norm[step] (the
 * second step's limit is far above the norm: no clipping), by tm_ctx_clip_grad_norm +
 * tm_optimizer_step (deferred 0) or tm_ctx_clip_grad_norm_deferred + tm_optimizer_step_scaled
 * (deferred 1): each step's loss and norm, whether a factor came back, and this rank's parameter
 * blocks at the end. */
typedef struct clip_run {
    double loss[KS], norm[KS];
    int factor[KS];
    int64_t n_blocks;
    unsigned char *blocks;
} clip_run;

static const double clip_max[KS] = {0.05, 1e9, 0.02};

static clip_run clip_train(int zero, int ep_size, int bf16, int deferred) {
    clip_run r;
    memset(&r, 0, sizeof r);
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) exit(2);
    tm_comm_options co = tm_comm_options_default();
    co.ep_size = ep_size;
    co.zero = zero;
    co.timeout_s = 30;
    OK(ctx, tm_comm_init(ctx, &co));
    tm_model_config c = tiny_config(2);
    tm_model *m = NULL;
    tm_optimizer *opt = NULL;
    OK(ctx, tm_model_new(ctx, &c, bf16 ? TM_BF16 : TM_F32, tm_cpu(), &m));
    OK(ctx, tm_model_init(m, 5));
    tm_adamw_config ac = tm_adamw_config_default();
    OK(ctx, tm_adamw_new(ctx, &ac, &opt));
    for (int step = 0; step < KS; step++) {
        tm_tensor *tokens, *targets;
        step_batch(ctx, 7, 2, 3, step, &tokens, &targets);
        tm_model_out out;
        OK(ctx, tm_model_forward(m, tokens, targets, &out));
        OK(ctx, tm_backward(ctx, out.loss));
        r.loss[step] = out.loss_value;
        tm_ctx_arena_reset(ctx);
        OK(ctx, tm_comm_sync_grads(ctx));
        if (deferred) {
            tm_tensor *gs = NULL;
            OK(ctx, tm_ctx_clip_grad_norm_deferred(ctx, clip_max[step], &r.norm[step], &gs));
            r.factor[step] = gs != NULL;
            OK(ctx, tm_optimizer_step_scaled(opt, 1e-2, gs));
        } else {
            OK(ctx, tm_ctx_clip_grad_norm(ctx, clip_max[step], &r.norm[step]));
            OK(ctx, tm_optimizer_step(opt, 1e-2));
        }
        OK(ctx, tm_ctx_zero_grad(ctx));
        tm_ctx_arena_reset(ctx);
    }
    r.blocks = rank_blocks(ctx, bf16, &r.n_blocks);
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
    return r;
}

/* ---- the gradient all-reduce run by the backward (tm_comm_sync_grads_in_backward) ----------- */
/* One forward and backward of the tiny model; the all-reduce calls the backward made. */
static int64_t gsync_backward(tm_ctx *ctx, tm_model *m, int step) {
    tm_tensor *tokens, *targets;
    step_batch(ctx, 7, 2, 3, step, &tokens, &targets);
    tm_model_out out;
    OK(ctx, tm_model_forward(m, tokens, targets, &out));
    tm_comm_stats a, b;
    OK(ctx, tm_comm_get_stats(ctx, &a));
    OK(ctx, tm_backward(ctx, out.loss));
    OK(ctx, tm_comm_get_stats(ctx, &b));
    tm_ctx_arena_reset(ctx);
    return b.calls[TM_COMM_ALLREDUCE] - a.calls[TM_COMM_ALLREDUCE];
}

/* KS steps of the tiny model (gsync_run, at the top of the file), two micro-batches each (the
 * second backward armed when `arm`), pieces of `chunk` bytes. */
static gsync_run gsync_train(int zero, int ep_size, int bf16, int tied, int arm, int64_t chunk) {
    gsync_run r;
    memset(&r, 0, sizeof r);
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    if (g_cuda >= 0) o.cuda_device = g_cuda; /* check_cuda's: the model on that GPU, engine g_nccl */
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) exit(2);
    tm_comm_options co = tm_comm_options_default();
    co.ep_size = ep_size;
    co.zero = zero;
    co.timeout_s = 30;
    co.grad_sync_chunk_bytes = chunk;
    if (g_cuda >= 0) co.nccl = g_nccl;
    OK(ctx, tm_comm_init(ctx, &co));
    tm_model_config c = tiny_config(2);
    c.tie_embeddings = tied; /* the embedding's gradient: a reader first and last on the tape */
    tm_model *m = NULL;
    tm_optimizer *opt = NULL;
    const tm_device dev = g_cuda >= 0 ? tm_cuda(g_cuda) : tm_cpu();
    if (g_cuda >= 0) snprintf(g_engine, sizeof g_engine, "%s", tm_comm_engine(ctx, dev));
    OK(ctx, tm_model_new(ctx, &c, bf16 ? TM_BF16 : TM_F32, dev, &m));
    OK(ctx, tm_model_init(m, 5));
    tm_adamw_config ac = tm_adamw_config_default();
    OK(ctx, tm_adamw_new(ctx, &ac, &opt));
    for (int step = 0; step < KS; step++) {
        for (int micro = 0; micro < 2; micro++) {
            tm_tensor *tokens, *targets, *l;
            step_batch(ctx, 7 + micro, 2, 3, step, &tokens, &targets);
            tm_model_out out;
            OK(ctx, tm_model_forward(m, tokens, targets, &out));
            OK(ctx, tm_scale(ctx, out.loss, 0.5, &l));
            if (arm && micro == 1) OK(ctx, tm_comm_sync_grads_in_backward(ctx));
            tm_comm_stats a, b;
            OK(ctx, tm_comm_get_stats(ctx, &a));
            OK(ctx, tm_backward(ctx, l));
            OK(ctx, tm_comm_get_stats(ctx, &b));
            if (micro == 1) {
                r.bw_calls[step] = b.calls[TM_COMM_ALLREDUCE] - a.calls[TM_COMM_ALLREDUCE];
                r.bw_beside[step] = b.beside[TM_COMM_ALLREDUCE] - a.beside[TM_COMM_ALLREDUCE];
            }
            r.loss[step] += 0.5 * out.loss_value;
            tm_ctx_arena_reset(ctx);
        }
        tm_comm_stats a, b;
        OK(ctx, tm_comm_get_stats(ctx, &a));
        OK(ctx, tm_comm_sync_grads(ctx));
        OK(ctx, tm_comm_get_stats(ctx, &b));
        r.sync_calls[step] = b.calls[TM_COMM_ALLREDUCE] - a.calls[TM_COMM_ALLREDUCE];
        r.sync_rs[step] = b.calls[TM_COMM_REDUCE_SCATTER] - a.calls[TM_COMM_REDUCE_SCATTER];
        double norm;
        OK(ctx, tm_ctx_clip_grad_norm(ctx, 1.0, &norm));
        OK(ctx, tm_optimizer_step(opt, 1e-2));
        OK(ctx, tm_ctx_zero_grad(ctx));
        tm_ctx_arena_reset(ctx);
    }
    /* an arming that no backward used is cancelled by tm_ctx_zero_grad: the next backward
     * all-reduces nothing and tm_comm_sync_grads does it all */
    if (arm) {
        OK(ctx, tm_comm_sync_grads_in_backward(ctx));
        OK(ctx, tm_ctx_zero_grad(ctx));
        const int64_t n = gsync_backward(ctx, m, KS);
        CHECK(n == 0, "gsync: an arming cancelled by tm_ctx_zero_grad still all-reduced %lld times in the next backward",
              (long long)n);
        OK(ctx, tm_ctx_zero_grad(ctx));
    }
    r.blocks = rank_blocks(ctx, bf16, &r.n_blocks);
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
    return r;
}

/* The armed backward all-reduces the ZeRO-0 buckets in several pieces (CPU ranks: counted as
 * beside the work, whose "side stream" is the host), tm_comm_sync_grads then all-reduces nothing
 * more (ZeRO-0: every bucket of a group of several ranks was covered), and training gives the
 * unarmed run's losses and weights: bit for bit on 2 ranks, where a sum of two has one order; on
 * more, MPI may sum a piece in another order than the whole bucket (1e-6). ZeRO-1 is not
 * covered (its reduce-scatters stay in tm_comm_sync_grads) and trains to the same bits. */
static void check_gsync_misuse(int world);

static void check_gsync(int world) {
    const struct {
        int zero, ep_size, bf16, tied;
    } cases[] = {{0, 1, 0, 0}, {0, 2, 0, 0}, {0, 1, 1, 0}, {0, 1, 0, 1}, {1, 1, 0, 0}, {2, 1, 0, 0}, {3, 1, 0, 0}};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        int Z = cases[k].zero, P = cases[k].ep_size, bf16 = cases[k].bf16, T = cases[k].tied;
        if (world % P) continue;
        gsync_run a = gsync_train(Z, P, bf16, T, 0, 0), b = gsync_train(Z, P, bf16, T, 1, 256);
        for (int s = 0; s < KS; s++) {
            double tol = world == 2 ? 0.0 : 1e-6 * fabs(a.loss[s]);
            CHECK(fabs(a.loss[s] - b.loss[s]) <= tol, "gsync, zero %d ep_size %d %s, step %d: loss %.17g unarmed, "
                  "%.17g armed", Z, P, bf16 ? "bf16" : "f32", s + 1, a.loss[s], b.loss[s]);
            CHECK(a.bw_calls[s] == 0, "gsync: an unarmed backward all-reduced %lld times", (long long)a.bw_calls[s]);
            if (Z == 0) {
                CHECK(b.bw_calls[s] >= 2 && b.bw_beside[s] == b.bw_calls[s] && b.sync_calls[s] == 0,
                      "gsync, zero 0 ep_size %d %s, step %d: the armed backward all-reduced %lld pieces (%lld beside), "
                      "tm_comm_sync_grads %lld more (want >= 2, all beside, and 0)", P, bf16 ? "bf16" : "f32", s + 1,
                      (long long)b.bw_calls[s], (long long)b.bw_beside[s], (long long)b.sync_calls[s]);
                CHECK(a.sync_calls[s] >= 1, "gsync: the unarmed step's tm_comm_sync_grads all-reduced nothing");
            } else { /* ZeRO 1-3: the arming changes nothing */
                CHECK(b.bw_calls[s] == a.bw_calls[s] && b.sync_rs[s] == a.sync_rs[s] && b.sync_calls[s] == a.sync_calls[s],
                      "gsync, zero %d, step %d: armed, the backward all-reduced %lld times and tm_comm_sync_grads made "
                      "%lld all-reduces and %lld reduce-scatters; unarmed %lld, %lld, %lld", Z, s + 1,
                      (long long)b.bw_calls[s], (long long)b.sync_calls[s], (long long)b.sync_rs[s],
                      (long long)a.bw_calls[s], (long long)a.sync_calls[s], (long long)a.sync_rs[s]);
            }
        }
        if (world == 2)
            CHECK(a.n_blocks == b.n_blocks && !memcmp(a.blocks, b.blocks, (size_t)a.n_blocks * (bf16 ? 2 : 4)),
                  "gsync, zero %d ep_size %d %s%s: this rank's weights after %d steps differ armed and unarmed", Z, P,
                  bf16 ? "bf16" : "f32", T ? ", tied" : "", KS);
        free(a.blocks), free(b.blocks);
    }
    check_gsync_misuse(world);
}

/* The misuses the arming refuses: a second backward between the armed one and
 * tm_comm_sync_grads (its local gradients would be added to summed ones) makes the sync fail
 * until tm_ctx_zero_grad; tm_comm_sync_grads cancels an arming no backward used; pieces so small
 * that there would be more than 4096 of them are refused. */
static void check_gsync_misuse(int world) {
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) exit(2);
    tm_comm_options co = tm_comm_options_default();
    co.timeout_s = 30;
    co.grad_sync_chunk_bytes = 256;
    OK(ctx, tm_comm_init(ctx, &co));
    tm_model_config c = tiny_config(2);
    tm_model *m = NULL;
    OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    OK(ctx, tm_model_init(m, 5));
    OK(ctx, tm_comm_sync_grads_in_backward(ctx));
    CHECK(gsync_backward(ctx, m, 0) >= 2, "gsync misuse: the armed backward all-reduced nothing");
    CHECK(gsync_backward(ctx, m, 1) == 0, "gsync misuse: an unarmed backward all-reduced");
    tm_status s = tm_comm_sync_grads(ctx);
    CHECK(s == TM_ERR_STATE && strstr(tm_ctx_errmsg(ctx), "a backward ran after the one armed"),
          "gsync misuse: tm_comm_sync_grads after a second backward: %s: %s", tm_status_str(s), tm_ctx_errmsg(ctx));
    s = tm_comm_sync_grads_in_backward(ctx);
    CHECK(s == TM_ERR_STATE, "gsync misuse: arming again before tm_ctx_zero_grad: %s", tm_status_str(s));
    OK(ctx, tm_ctx_zero_grad(ctx));
    OK(ctx, tm_comm_sync_grads(ctx)); /* recovered: nothing armed, nothing done */
    /* an arming cancelled by tm_comm_sync_grads */
    OK(ctx, tm_comm_sync_grads_in_backward(ctx));
    OK(ctx, tm_comm_sync_grads(ctx));
    CHECK(gsync_backward(ctx, m, 2) == 0, "gsync misuse: an arming taken back by tm_comm_sync_grads still ran");
    OK(ctx, tm_comm_sync_grads(ctx));
    OK(ctx, tm_ctx_zero_grad(ctx));
    tm_model_free(m);
    tm_ctx_free(ctx);
    /* too many pieces: 4 bytes each */
    if (tm_ctx_new(&ctx, &o)) exit(2);
    co.grad_sync_chunk_bytes = 4;
    OK(ctx, tm_comm_init(ctx, &co));
    OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    s = tm_comm_sync_grads_in_backward(ctx);
    CHECK(s == TM_ERR_INVALID_ARG && strstr(tm_ctx_errmsg(ctx), "grad_sync_chunk_bytes = 4"),
          "gsync misuse: 4-byte pieces: %s: %s", tm_status_str(s), tm_ctx_errmsg(ctx));
    tm_model_free(m);
    tm_ctx_free(ctx);
    (void)world;
}

/* Under a communicator with every bucket on one device the deferred clip hands AdamW the host's
 * factor when it clips and nothing when it does not, and the pair trains to the bits of the clip
 * that scales the gradients in place (the norm, every loss and this rank's weights), for ZeRO 0,
 * 1 and 3, f32 and bf16, data and expert parallelism. */
static void check_clip(int world) {
    const struct {
        int zero, ep_size, bf16;
    } cases[] = {{0, 1, 0}, {1, 1, 1}, {3, 1, 0}, {1, 2, 0}, {3, 2, 1}};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        int Z = cases[k].zero, P = cases[k].ep_size, bf16 = cases[k].bf16;
        if (world % P) continue;
        clip_run a = clip_train(Z, P, bf16, 0), b = clip_train(Z, P, bf16, 1);
        for (int s = 0; s < KS; s++) {
            CHECK(memcmp(&a.loss[s], &b.loss[s], sizeof(double)) == 0 && memcmp(&a.norm[s], &b.norm[s], sizeof(double)) == 0,
                  "clip, zero %d ep_size %d %s, step %d: loss %.17g / norm %.17g in place, %.17g / %.17g deferred", Z, P,
                  bf16 ? "bf16" : "f32", s + 1, a.loss[s], a.norm[s], b.loss[s], b.norm[s]);
            int clipped = b.norm[s] > clip_max[s];
            CHECK(b.factor[s] == (world > 1 ? clipped : 1),
                  "clip, zero %d ep_size %d, step %d: norm %g, max_norm %g, %s factor handed back", Z, P, s + 1, b.norm[s],
                  clip_max[s], b.factor[s] ? "a" : "no");
        }
        CHECK(a.n_blocks == b.n_blocks && !memcmp(a.blocks, b.blocks, (size_t)a.n_blocks * (bf16 ? 2 : 4)),
              "clip, zero %d ep_size %d %s: this rank's weights after %d steps differ between the in-place and the "
              "deferred clip", Z, P, bf16 ? "bf16" : "f32", KS);
        free(a.blocks), free(b.blocks);
    }
}

int main(int argc, char **argv) {
    int world = 1;
    if (tm_mpi_init(&argc, &argv, &world)) return 2;
    g_rank = tm_mpi_world_rank();
    const char *what = argc > 1 ? argv[1] : "collectives";
    tm_ctx *ctx = NULL;
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    if (tm_ctx_new(&ctx, &o)) return 2;
    tm_comm_options co = tm_comm_options_default();
    co.ep_size = world % 2 == 0 ? 2 : 1;
    co.timeout_s = 30;
    OK(ctx, tm_comm_init(ctx, &co));
    if (!strcmp(what, "collectives")) {
        const op_case cases[] = {
            {"allreduce world", TM_COMM_WORLD, rows_two, 3, 0},
            {"allreduce ep", TM_COMM_EP, rows_two, 3, 0},
            {"allgather world", TM_COMM_WORLD, rows_two, 2, 1},
            {"allgather ragged", TM_COMM_WORLD, rows_ragged, 3, 1},
            {"allgather expert_dp", TM_COMM_EXPERT_DP, rows_ragged, 2, 1},
            {"allgather ZeRO-3 pieces, one owner", TM_COMM_WORLD, rows_one_owner, 3, 1},
            {"allgather ZeRO-3 pieces, two owners", TM_COMM_WORLD, rows_two_owners, 1, 1},
            {"reduce_scatter world", TM_COMM_WORLD, rows_rs, 2, 2},
            {"reduce_scatter ep", TM_COMM_EP, rows_rs, 2, 2},
            {"alltoall world", TM_COMM_WORLD, rows_a2a, 2, 3},
            {"alltoall ep", TM_COMM_EP, rows_a2a, 3, 3},
        };
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) check_case(ctx, &cases[k]);
        check_partial_requires_grad(ctx);
        check_counts(ctx);
        check_zero_memory(ctx, world);
        check_replicated_init(world);
        check_ep_syncs(world);
        check_chunked_layer(world);
        check_dp_row_map();
    } else if (!strcmp(what, "plan")) {
        check_plan(world);
    } else if (!strcmp(what, "keep")) {
        check_keep(world);
    } else if (!strcmp(what, "clip")) {
        check_clip(world);
    } else if (!strcmp(what, "gsync")) {
        check_gsync(world);
    } else if (!strcmp(what, "cuda")) {
        const char *nccl = argc > 2 ? argv[2] : "auto";
        check_cuda(world, !strcmp(nccl, "always") ? TM_NCCL_ALWAYS : !strcmp(nccl, "off") ? TM_NCCL_OFF : TM_NCCL_AUTO);
    } else if (!strcmp(what, "hang") || !strcmp(what, "die")) {
        /* Failure modes: rank 1 stops answering (sleeps past the timeout) or dies (exits without
         * MPI_Finalize) while rank 0 waits in an all-reduce; rank 0 must not hang. */
        tm_ctx *c2 = NULL;
        OK(c2, tm_ctx_new(&c2, &o));
        tm_comm_options t = tm_comm_options_default();
        t.timeout_s = 2;
        OK(c2, tm_comm_init(c2, &t));
        if (g_rank == 1) {
            if (!strcmp(what, "die")) _exit(7);
            sleep(30);
        }
        double v = 1;
        tm_status s = tm_comm_allreduce_host(c2, TM_COMM_WORLD, TM_F64, &v, 1);
        fprintf(stderr, "rank %d: %s: %s\n", g_rank, tm_status_str(s), tm_ctx_errmsg(c2));
        fflush(stderr);
        tm_mpi_abort(3); /* what the driver does after TM_ERR_COMM */
        return 3;
    } else {
        fprintf(stderr, "unknown check '%s'\n", what);
        g_fail++;
    }
    /* Every rank learns whether any failed. */
    int64_t f = g_fail;
    OK(ctx, tm_comm_allreduce_host(ctx, TM_COMM_WORLD, TM_I64, &f, 1));
    if (g_rank == 0) printf("%s: %d ranks, %s\n", what, world, f ? "FAILED" : "ok");
    tm_ctx_free(ctx);
    tm_mpi_finalize();
    return f ? 1 : 0;
}
