/* run.c — a run of the driver, below the training loop: its setup (data, model, optimizer,
 * communicator, checkpoint or export to start from), its forward pass, its header, its errors
 * and its end; see run.h. train.c (the loop), eval.c, step.c and rundir.c call it; it calls
 * none of them. Uses only the public header (plus the driver's own headers). */
#include "run.h"

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint.h"
#include "tokenizer.h"
#include "data.h"
#include "finite.h"
#include "generate.h"
#include "hf.h"
#include "lock.h"
#include "layout.h"
#include "log.h"
#include "markov.h"
#include "plot.h"
#include "rundir.h"
#include "status.h"
#include "stop.h"
#include "tinymoe.h"
#include "util.h"

/* Synthetic data has no "whole validation set": eval_batches 0 means this many batches, and
 * its validation set is this many fixed sequences (eval_batches beyond them is clamped, not a
 * practically endless evaluation). */
enum { SYNTH_DEFAULT_EVAL_BATCHES = 8, SYNTH_VAL_SEQUENCES = 8192 };

/* A library call failed: the op's message, prefixed by what the driver was doing. */
int tmd_run_lib_fail(tmd_run *r, char *err, size_t errlen, const char *what, tm_status s) {
    return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "%s failed (%s): %s", what, tm_status_str(s),
                    tm_ctx_errmsg(r->ctx));
}

void tmd_run_log_flush(tmd_run *r) {
    if (!r->log) return;
    if (fflush(r->log) == 0 && !ferror(r->log)) return;
    r->log_errno = errno ? errno : EIO;
    r->log = NULL;
}

void tmd_run_free(tmd_run *r) {
    /* A background write still running (tmd_rundir_finish not called) ends first: it uses the
     * snapshot, and the directory stays locked until its file is complete. */
    if (r->bg.active) pthread_join(r->bg.thread, NULL), r->bg.active = 0;
    tmd_unlock(&r->lock);
    if (r->metrics) fclose(r->metrics);
    tmd_tb_close(&r->tb);
    tmd_bins_free(&r->loss_bins);
    tmd_bins_free(&r->val_bins);
    tmd_bins_free(&r->load_bins);
    free(r->step_load);
    free(r->iv_load);
    free(r->iv_layer_load);
    free(r->moe_layer);
    free(r->inp);
    free(r->seq);
    tmd_markov_free(&r->src);
    tmd_tokens_free(&r->train);
    tmd_tokens_free(&r->val);
    tmd_bpe_free(r->bpe);
    tm_ckpt_snapshot_free(r->snap); /* its writer was joined (tmd_rundir_finish) */
    tm_optimizer_free(r->opt);
    tm_model_free(r->model);
    tm_ctx_free(r->ctx);
}

/* ---------------------------------------------------------------------------------------- */
/* Setup: everything that can reject the configuration or the data, before anything is written */

static int load_data(tmd_run *r, int eval_only, char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    if (r->synth) {
        if (tmd_markov_init(&r->src, c->synthetic_vocab, c->synthetic_k, (uint64_t)c->seed))
            return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory building the synthetic source");
        r->optimum = tmd_markov_optimal_loss(&r->src, r->T);
        r->n_eval = (int64_t)(c->eval_batches ? c->eval_batches : SYNTH_DEFAULT_EVAL_BATCHES) * r->B;
        if (r->n_eval > SYNTH_VAL_SEQUENCES) {
            tmd_config_note(&r->c, "eval_batches %d x batch_size %d clamped to the %d synthetic validation sequences",
                            c->eval_batches, r->B, SYNTH_VAL_SEQUENCES);
            r->n_eval = SYNTH_VAL_SEQUENCES;
        }
        return 0;
    }
    r->optimum = NAN;
    char e[1024];
    /* eval reads its whole file as validation data (unless val_data is given, or it evaluates
     * a checkpoint on the data it was trained on: then the same held-out tail as training). */
    const char *val_path = c->val_data[0] ? c->val_data : eval_only && !r->eval_split ? c->data : NULL;
    if (!val_path || !eval_only) {
        if (tmd_tokens_load(c->data, &r->train, e, sizeof e))
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "key 'data' = '%s': %s", c->data, e);
        r->data_id.data_tokens = r->train.n;
        r->data_id.data_hash = tmd_tokens_fingerprint(&r->train);
        if (tmd_tokens_check_vocab(&r->train, c->model.vocab_size, e, sizeof e))
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                            "key 'data' = '%s': %s (vocab_size = %d; set vocab_size for "
                            "tokens other than bytes)",
                            c->data, e, c->model.vocab_size);
    }
    if (val_path) {
        if (tmd_tokens_load(val_path, &r->val, e, sizeof e))
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "key '%s' = '%s': %s", c->val_data[0] ? "val_data" : "data",
                            val_path, e);
        if (c->val_data[0]) {
            r->data_id.val_tokens = r->val.n;
            r->data_id.val_hash = tmd_tokens_fingerprint(&r->val);
        }
    } else if (tmd_tokens_split(&r->train, c->val_fraction, &r->val, e, sizeof e)) {
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "key 'val_fraction' = %g: %s", c->val_fraction, e);
    }
    if (tmd_tokens_check_vocab(&r->val, c->model.vocab_size, e, sizeof e))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "validation data: %s (vocab_size = %d)", e, c->model.vocab_size);
    int64_t windows = r->val.n > r->T ? (r->val.n - 1) / r->T : 0;
    if (windows < 1)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "validation data '%s' has %lld tokens, fewer than seq_len + 1 = %d (a smaller val_fraction or "
                        "seq_len, or a larger file)",
                        r->val.source, (long long)r->val.n, r->T + 1);
    r->n_eval =
        c->eval_batches && (int64_t)c->eval_batches * r->B < windows ? (int64_t)c->eval_batches * r->B : windows;
    if (c->eval_batches && r->n_eval < (int64_t)c->eval_batches * r->B &&
        c->source[tmd_config_key_index("eval_batches")] != TMD_SRC_DEFAULT)
        tmd_config_note(&r->c, "eval_batches %d x batch_size %d clamped to the %lld windows of the validation data",
                        c->eval_batches, r->B, (long long)windows);
    if (eval_only) return 0;
    int64_t per_batch = (int64_t)r->B * r->T;
    if (per_batch > r->train.n - 1)
        return tmd_fail(
            err, errlen, TMD_CONFIG_ERROR,
            "key 'batch_size' = %d: a batch of batch_size x seq_len = %d x %d = %lld tokens is larger than the "
            "%lld training tokens of '%s'",
            r->B, r->B, r->T, (long long)per_batch, (long long)r->train.n, r->train.source);
    if (tmd_batcher_init(&r->bt, &r->train, r->B, r->T, (uint64_t)c->seed, e, sizeof e))
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "key 'data' = '%s': %s", c->data, e);
    return 0;
}

tm_comm_options tmd_comm_options_of(const tmd_config *c) {
    tm_comm_options co = tm_comm_options_default();
    co.ep_size = c->ep_size;
    co.ep_strategy = (tm_ep_strategy)c->ep_strategy;
    co.zero = c->zero;
    co.timeout_s = c->comm_timeout;
    co.nccl = c->nccl;
    co.overlap = c->comm_overlap;
    co.comm_sms = c->comm_sms;
    co.grad_sync_chunk_bytes = (int64_t)(c->grad_sync_chunk_mb * 1048576.0);
    if (co.grad_sync_chunk_bytes < 1) co.grad_sync_chunk_bytes = 1;
    co.zero3_keep_last = c->zero3_keep_last;
    return co;
}

/* Under mpirun: every rank must run the same configuration. One all-gather of a hash per key
 * finds the first key that differs, a second one its values, so that every rank can name the
 * key, the values and the ranks. A throwaway CPU context carries the communicator, so that this
 * runs before anything that could fail on one rank only. */
static int check_same_config(tmd_run *r, char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    tm_ctx *ctx = NULL;
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    if (tm_ctx_new(&ctx, &o))
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot create a context: %s", tm_last_create_error());
    tm_comm_options co = tm_comm_options_default();
    co.timeout_s = c->comm_timeout;
    int n = tmd_config_num_keys(), W = tm_comm_size(ctx, TM_COMM_WORLD), rc = 0;
    tm_status s = tm_comm_init(ctx, &co);
    W = tm_comm_size(ctx, TM_COMM_WORLD);
    uint64_t *mine = calloc((size_t)n, sizeof *mine), *all = calloc((size_t)n * (size_t)W, sizeof *all);
    char *vals = calloc((size_t)W, 256), v[256];
    if (!mine || !all || !vals) rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
    for (int i = 0; !rc && i < n; i++) {
        tmd_config_format_exact(c, i, v, sizeof v);
        mine[i] = tm_hash_name(v);
    }
    if (!rc && !s) s = tm_comm_allgather_host(ctx, TM_COMM_WORLD, mine, all, sizeof *mine * (size_t)n);
    if (!rc && s) rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "comparing the configuration across ranks: %s",
                                tm_ctx_errmsg(ctx));
    for (int i = 0; !rc && i < n; i++) {
        int differs = 0;
        for (int j = 1; j < W; j++) differs |= all[(size_t)j * n + i] != all[i];
        if (!differs) continue;
        tmd_config_format(c, i, v, sizeof v);
        if ((s = tm_comm_allgather_host(ctx, TM_COMM_WORLD, v, vals, sizeof v))) {
            rc = tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "comparing the configuration across ranks: %s",
                          tm_ctx_errmsg(ctx));
            break;
        }
        /* "key 'lr' differs across the 4 ranks: 0.01 on ranks 0, 2, 3; 0.02 on rank 1" */
        char msg[1024];
        int k = snprintf(msg, sizeof msg, "key '%s' differs across the %d ranks (every rank must run one configuration):",
                         tmd_config_key_name(i), W);
        for (int j = 0; j < W && k < (int)sizeof msg; j++) {
            int first = 1;
            for (int q = 0; q < j; q++) first &= all[(size_t)q * n + i] != all[(size_t)j * n + i];
            if (!first) continue;
            int cnt = 0;
            for (int q = j; q < W; q++) cnt += all[(size_t)q * n + i] == all[(size_t)j * n + i];
            k += snprintf(msg + k, sizeof msg - (size_t)k, "%s %s on rank%s", j ? ";" : "", vals + (size_t)j * 256,
                          cnt > 1 ? "s" : "");
            for (int q = j, c2 = 0; q < W && k < (int)sizeof msg; q++)
                if (all[(size_t)q * n + i] == all[(size_t)j * n + i])
                    k += snprintf(msg + k, sizeof msg - (size_t)k, "%s %d", c2++ ? "," : "", q);
        }
        rc = tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s", msg);
        r->uniform_error = 1;
    }
    free(mine);
    free(all);
    free(vals);
    tm_ctx_free(ctx);
    return rc;
}

/* Under mpirun each rank of a machine takes its own GPU when there are enough (NCCL needs one
 * per rank), by its local rank; several ranks on one GPU share it (host-staged collectives). */
static int local_gpu(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
    int n = tm_cuda_device_count(), lr = 0;
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++)
        if (getenv(vars[i])) {
            lr = atoi(getenv(vars[i]));
            break;
        }
    return n > 0 ? lr % n : 0;
}

/* CPUs this process may run on (its affinity mask), or the online CPUs. */
static int usable_cpus(void) {
    cpu_set_t have;
    if (sched_getaffinity(0, sizeof have, &have) == 0 && CPU_COUNT(&have) > 0) return CPU_COUNT(&have);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* threads = 0 (the default): every usable CPU, except for one of several ranks of a node left
 * unbound (mpirun --bind-to none, --oversubscribe), whose mask is the whole node: it takes its
 * share, usable CPUs / local ranks (at least 1), instead of every rank running one thread per
 * CPU (4 ranks x 2 threads on the README's 2-core machine). A rank bound to a subset keeps it. */
static int default_threads(void) {
    const char *ls = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (!ls) ls = getenv("MPI_LOCALNRANKS"); /* MPICH / Hydra */
    long local = ls ? strtol(ls, NULL, 10) : 1, online = sysconf(_SC_NPROCESSORS_ONLN);
    int usable = usable_cpus();
    if (local <= 1 || usable < online) return usable;
    return usable / local > 1 ? (int)(usable / local) : 1;
}

static int build(tmd_run *r, int eval_only, char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    tm_ctx_options o = tm_ctx_options_default();
    o.no_grad_buffers = eval_only; /* nothing calls backward: no gradient buffers */
    o.num_threads = c->threads > 0 ? c->threads : default_threads();
    r->threads = o.num_threads;
    o.cpu_gemm = c->cpu_gemm;
    o.grouped_gemm = c->grouped_gemm;
    o.cuda_device = c->device == TMD_DEVICE_CUDA ? local_gpu() : -1;
    tm_status s = tm_ctx_new(&r->ctx, &o);
    if (s)
        return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "cannot create a context (%s): %s", tm_status_str(s),
                        tm_last_create_error());
    tm_comm_options co = tmd_comm_options_of(c);
    if ((s = tm_comm_init(r->ctx, &co))) return tmd_run_lib_fail(r, err, errlen, "setting up the communicator", s);
    r->dev = c->device == TMD_DEVICE_CUDA ? tm_cuda(o.cuda_device) : tm_cpu();
    tm_dtype dt = c->dtype == TMD_DTYPE_BF16 ? TM_BF16 : TM_F32;
    char e[1024];
    if ((s = tm_model_new(r->ctx, &c->model, dt, r->dev, &r->model))) {
        /* The configuration asked for more than the machine has: bad input, like a size the
         * estimate (footprint.h) already refused. */
        if (s == TM_ERR_NOMEM)
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                            "the model does not fit in memory (%s): reduce d_model, n_layers, num_experts, "
                            "expert_ffn_size or vocab_size",
                            tm_ctx_errmsg(r->ctx));
        if (s != TM_ERR_INVALID_ARG) return tmd_run_lib_fail(r, err, errlen, "building the model", s);
        tmd_config_explain(c, tm_ctx_errmsg(r->ctx), e, sizeof e);
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s", e);
    }
    /* A run that loads a checkpoint (resume, eval --ckpt) overwrites every parameter, or fails:
     * tm_ckpt_load requires each of the context's tensors in the file. Drawing the initial
     * values first was most of `tinymoe eval`'s time (75% of its samples on the CPU; coarse:
     * 522M normal draws). */
    if (!r->resume_path[0] && (s = tm_model_init(r->model, (uint64_t)c->seed)))
        return tmd_run_lib_fail(r, err, errlen, "initialising the model", s);
    r->params = tm_model_num_params(r->model, &r->active);
    r->n_moe = c->model.n_layers - c->model.first_k_dense;
    r->E = c->model.moe.router.num_experts;
    if (r->n_moe > 0) {
        r->moe_layer = malloc(sizeof *r->moe_layer * (size_t)r->n_moe);
        r->step_load = calloc((size_t)r->n_moe * (size_t)r->E, sizeof *r->step_load);
        r->iv_load = calloc((size_t)r->n_moe * (size_t)r->E, sizeof *r->iv_load);
        r->iv_layer_load = calloc((size_t)r->n_moe, sizeof *r->iv_layer_load);
        if (!r->moe_layer || !r->step_load || !r->iv_load || !r->iv_layer_load) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory");
        for (int i = 0; i < r->n_moe; i++) r->moe_layer[i] = c->model.first_k_dense + i;
    }
    /* inputs and targets: the two halves of one block, uploaded in one copy (tmd_run_forward) */
    r->inp = calloc(2 * (size_t)r->B * (size_t)r->T, sizeof *r->inp);
    r->tgt = r->inp ? r->inp + (size_t)r->B * (size_t)r->T : NULL;
    r->seq = malloc(sizeof *r->seq * ((size_t)r->T + 1));
    if (!r->inp || !r->tgt || !r->seq) return tmd_fail(err, errlen, TMD_RUNTIME_ERROR, "out of memory for the batches");
    return 0;
}

static int build_optimizer(tmd_run *r, char *err, size_t errlen) {
    const tmd_config *c = &r->c;
    tm_status s =
        c->optimizer == TMD_OPT_ADAMW ? tm_adamw_new(r->ctx, &c->adamw, &r->opt) : tm_sgd_new(r->ctx, &c->sgd, &r->opt);
    if (s == TM_ERR_INVALID_ARG) {
        char e[1024];
        tmd_config_explain(c, tm_ctx_errmsg(r->ctx), e, sizeof e);
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s", e);
    }
    return s ? tmd_run_lib_fail(r, err, errlen, "creating the optimizer", s) : 0;
}

int tmd_run_setup(tmd_run *r, const tmd_config *cfg, FILE *log, int eval_only, char *err, size_t errlen) {
    r->c = *cfg;
    tmd_config_resolve(&r->c);
    r->rank = tm_mpi_world_rank();
    r->world = tm_mpi_world_size();
    int rc;
    if (r->world > 1 && (rc = check_same_config(r, err, errlen))) return rc;
    /* From here on every rank holds one configuration: its checks fail alike everywhere. */
    r->uniform_error = 1;
    /* Before the checks: vocab_size may follow the tokenizer. eval reads token files alone. */
    if (!eval_only && (rc = tmd_tokenizer_for_run(&r->c, r->resume_path[0] ? r->resume_path : NULL, &r->bpe,
                                                  r->tokenizer_path, sizeof r->tokenizer_path, err, errlen)))
        return rc;
    if (tmd_config_validate(&r->c, err, errlen)) return TMD_CONFIG_ERROR;
    if (r->world % r->c.ep_size)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "key 'ep_size' = %d: does not divide the %d ranks", r->c.ep_size,
                        r->world);
    if (r->c.batch_size % r->world)
        return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                        "key 'batch_size' = %d: not divisible by the %d ranks (each rank takes batch_size / ranks "
                        "sequences of every micro-batch)", r->c.batch_size, r->world);
    r->uniform_error = 0;
    /* Only rank 0 prints, writes metrics and plots (checkpoints: every rank takes part, rank 0
     * writes). */
    r->log = r->rank == 0 ? log : NULL;
    r->tty = r->log && tmd_progress_wanted(r->c.progress, fileno(r->log));
    r->T = r->c.model.max_seq_len;
    r->B = r->c.batch_size;
    r->Bl = r->B / r->world;
    r->b0 = r->rank * r->Bl;
    r->synth = tmd_config_synthetic(&r->c);
    if ((rc = load_data(r, eval_only, err, errlen))) return rc;
    if ((rc = build(r, eval_only, err, errlen))) return rc;
    if (r->c.init_from[0]) {
        char e[2048], what[TMD_PATH_MAX + 32];
        if ((rc = tmd_hf_import(r->ctx, r->model, r->c.init_from, e, sizeof e)))
            return tmd_fail(err, errlen, rc, "key 'init_from' = '%s': %s", r->c.init_from, e);
        snprintf(what, sizeof what, "key 'init_from' = '%s': the export", r->c.init_from);
        if ((rc = tmd_require_finite_weights(r->ctx, what, err, errlen))) return rc;
    }
    if (!eval_only && (rc = build_optimizer(r, err, errlen))) return rc;
    if (r->resume_path[0]) {
        /* Every tensor of the run (weights, optimizer state, expert biases), all or nothing;
         * for eval only the model's (the optimizer state in the file is checked and skipped). */
        tm_status s = tm_ckpt_load_flags(r->ctx, r->resume_path, eval_only ? TM_CKPT_SKIP_UNKNOWN : 0, NULL, 0, NULL);
        if (s)
            return tmd_fail(err, errlen, s == TM_ERR_NOMEM || s == TM_ERR_CUDA ? TMD_RUNTIME_ERROR : TMD_CONFIG_ERROR,
                            "cannot %s '%s': %s", eval_only ? "evaluate" : "resume from", r->resume_path,
                            tm_ctx_errmsg(r->ctx));
        char what[TMD_PATH_MAX + 16];
        snprintf(what, sizeof what, "checkpoint '%s'", r->resume_path);
        if ((rc = tmd_require_finite_weights(r->ctx, what, err, errlen))) return rc;
        if (!eval_only) {
            char e[2048];
            if (tmd_ckpt_check_data(&r->resume_state.data, &r->data_id, &r->c, r->resume_path, e, sizeof e)) {
                if (!r->c.allow_data_change) return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "%s", e);
                tmd_config_note(&r->c, "allow_data_change: resuming on data that differs from the checkpoint's");
            }
            if (!r->synth) r->bt.position = r->resume_state.data_position;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Batches                                                                                   */

/* Rows [0, rows) of half `half` of the uploaded [2, B, T] batch, as an i32 [rows, T] view. */
static tm_status batch_half(tmd_run *r, tm_tensor *both, int half, int rows, tm_tensor **out) {
    int64_t shape[2] = {rows, r->T};
    tm_tensor *h, *hr;
    tm_status s = tm_slice(r->ctx, both, 0, half, half + 1, &h);
    if (!s) s = tm_slice(r->ctx, h, 1, 0, rows, &hr);
    if (!s) s = tm_reshape(r->ctx, hr, 2, shape, out);
    return s;
}

/* One host-to-device copy per batch: r->inp and r->tgt are the two halves of one block, sent
 * whole (the rows past `rows` of a short last batch ride along unused) and viewed on the
 * device. Nothing is read back here; the model's forward reads its statistics once. */
tm_status tmd_run_forward(tmd_run *r, int rows, int with_targets, tm_model_out *out) {
    tm_tensor *tok, *tgt = NULL;
    tm_status s;
    if (with_targets) {
        int64_t shape[3] = {2, r->B, r->T};
        tm_tensor *both;
        s = tm_tensor_from_host(r->ctx, TM_I32, 3, shape, r->dev, TM_I32, r->inp, &both);
        if (!s) s = batch_half(r, both, 0, rows, &tok);
        if (!s) s = batch_half(r, both, 1, rows, &tgt);
    } else {
        int64_t shape[2] = {rows, r->T};
        s = tm_tensor_from_host(r->ctx, TM_I32, 2, shape, r->dev, TM_I32, r->inp, &tok);
    }
    if (!s) s = tm_model_forward(r->model, tok, tgt, out);
    return s;
}

/* ---------------------------------------------------------------------------------------- */
/* Printing                                                                                  */

void tmd_run_print_header(tmd_run *r, int eval_only) {
    FILE *f = r->log;
    const tmd_config *c = &r->c;
    if (!f) return;
    fprintf(f, "tinymoe %s %s\n\n", tm_version(), eval_only ? "eval" : "train");
    if (r->world > 1)
        fprintf(f, "distributed: %d ranks (mpirun); each takes %d of the %d sequences of a micro-batch; ep_size %d (%s), "
                   "ZeRO-%d; collectives on %s\n\n", r->world, r->Bl, r->B, c->ep_size,
                tm_ep_strategy_name((tm_ep_strategy)c->ep_strategy), c->zero, tm_comm_engine(r->ctx, r->dev));
    fprintf(f, "config (defaults unmarked; '#' says where a value came from):\n");
    tmd_config_print(c, f);
    for (const char *n = c->notes; *n;) {
        const char *nl = strchr(n, '\n');
        int len = nl ? (int)(nl - n) : (int)strlen(n);
        fprintf(f, "note: %.*s\n", len, n);
        n += len + (nl != NULL);
    }
    fprintf(f,
            "\nmodel : %lld parameters, %lld active per token; %d layers (%d MoE: %d experts, top-%d), d_model %d, %s "
            "on %s, %d CPU thread%s%s\n",
            (long long)r->params, (long long)r->active, c->model.n_layers, r->n_moe, r->E, c->model.moe.router.topk,
            c->model.d_model, c->dtype == TMD_DTYPE_BF16 ? "bf16" : "f32",
            c->device == TMD_DEVICE_CUDA ? "cuda:0" : "cpu", r->threads, r->threads > 1 ? "s" : "",
            r->world > 1 ? " per rank" : "");
    if (c->model.moe.router.force_load_balance && r->n_moe > 0)
        fprintf(f, "routing: FORCED (force_load_balance, for benchmarks): row t of a rank's tokens takes experts "
                   "(t x %d + j) %% %d, j < %d, whatever the router's scores\n",
                c->model.moe.router.topk, r->E, c->model.moe.router.topk);
    if (r->synth) {
        fprintf(
            f,
            "data  : synthetic order-2 Markov source: vocab %d, %d allowed next tokens per context, fresh sequences\n"
            "        every step; optimal loss %.4f nats/token (%s: (H1 %.4f + %d x H2 %.4f) / %d; log(vocab) %.4f)\n"
            "        validation: %lld fixed sequences of %d tokens\n",
            c->synthetic_vocab, c->synthetic_k, r->optimum,
            tmd_markov_converged(&r->src) ? "exact" : "approximate: the table mixes too slowly for its size",
            r->src.h1, r->T - 1, r->src.h2, r->T, log((double)c->synthetic_vocab), (long long)r->n_eval, r->T);
    } else {
        if (!eval_only)
            fprintf(f, "data  : %lld training tokens from '%s' (largest token %u)\n", (long long)r->train.n,
                    r->train.source, r->train.max_token);
        fprintf(f, "%s%lld validation tokens from '%s'%s; evaluating %lld windows of %d tokens\n",
                eval_only ? "data  : " : "        ", (long long)r->val.n, r->val.source,
                c->val_data[0] || eval_only ? "" : " (the held-out tail)", (long long)r->n_eval, r->T);
    }
    if (!eval_only) {
        /* Checked: steps, grad_accum, batch and length are each bounded, not their product. */
        int64_t tokens = 0;
        char total[32];
        if (__builtin_mul_overflow(c->sched.total_steps, (int64_t)c->grad_accum, &tokens) ||
            __builtin_mul_overflow(tokens, (int64_t)r->B * r->T, &tokens))
            snprintf(total, sizeof total, "%.3g", (double)c->sched.total_steps * c->grad_accum * r->B * r->T);
        else
            snprintf(total, sizeof total, "%lld", (long long)tokens);
        static const char *const sched[] = {"constant", "warmup + cosine", "warmup + linear", "warmup-stable-decay"};
        fprintf(
            f,
            "train : %lld steps x %d micro-batch%s x %d x %d tokens = %s tokens; %s, %s lr %g -> %g, warmup %lld\n\n",
            (long long)c->sched.total_steps, c->grad_accum, c->grad_accum > 1 ? "es" : "", r->B, r->T, total,
            c->optimizer == TMD_OPT_ADAMW ? "AdamW" : "SGD", sched[c->sched.kind], c->sched.lr, c->sched.min_lr,
            (long long)c->sched.warmup_steps);
    }
    tmd_run_log_flush(r);
}
/* A resumed run's configuration: the checkpoint's, plus what the command line may change. */
int tmd_run_resume_config(tmd_run *r, const tmd_config *cli, tmd_config *out, int for_eval, const char *ckpt,
                          char *err, size_t errlen) {
    tmd_config ck;
    int rc = tmd_ckpt_resolve(ckpt, r->resume_path, sizeof r->resume_path, err, errlen);
    if (!rc) rc = tmd_ckpt_read_meta(r->resume_path, &ck, &r->resume_state, err, errlen);
    if (!rc) rc = tmd_ckpt_merge_config(cli, &ck, r->resume_path, for_eval, out, err, errlen);
    if (rc) return rc;
    r->resume_ck_steps = ck.sched.total_steps;
    if (for_eval) {
        /* Evaluating on a file the user names: all of it, whatever the training run used. */
        int given_val = cli->source[tmd_config_key_index("val_data")] != TMD_SRC_DEFAULT;
        if (cli->source[tmd_config_key_index("data")] != TMD_SRC_DEFAULT) {
            if (!given_val) out->val_data[0] = 0;
        } else {
            r->eval_split = 1;
        }
        if (cli->source[tmd_config_key_index("eval_batches")] == TMD_SRC_DEFAULT) out->eval_batches = 0;
    } else {
        snprintf(out->resume, sizeof out->resume, "%s", cli->resume);
        out->init_from[0] = 0;
        /* The checkpoint's warmup is part of its trajectory, even where it equals the default:
         * a resume with fewer steps than it must not clamp it silently (resolve would). */
        out->source[tmd_config_key_index("warmup_steps")] = TMD_SRC_CKPT;
    }
    return 0;
}

/* The config.json field (Hugging Face MixtralConfig) a tinymoe architecture key comes from on
 * --init-from, or NULL for the keys a Mixtral fixes (its router, no shared experts, ...). */
static const char *hf_key_of(const char *key) {
    static const char *const map[][2] = {
        {"vocab_size", "vocab_size"},          {"d_model", "hidden_size"},
        {"n_layers", "num_hidden_layers"},     {"n_heads", "num_attention_heads"},
        {"n_kv_heads", "num_key_value_heads"}, {"rope_theta", "rope_theta"},
        {"norm_eps", "rms_norm_eps"},          {"tie_embeddings", "tie_word_embeddings"},
        {"num_experts", "num_local_experts"},  {"topk", "num_experts_per_tok"},
        {"expert_ffn_size", "intermediate_size"},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(map[i][0], key)) return map[i][1];
    return NULL;
}

/* --init_from DIR: the architecture keys come from DIR/config.json; one the user set
 * explicitly to another value is an error naming it. Training keys (aux losses, capacity,
 * optimizer, seq_len, ...) stay the user's. */
int tmd_run_init_from_config(const tmd_config *cli, tmd_config *out, char *err, size_t errlen) {
    static const char *const ARCH[] = {"vocab_size",     "d_model",       "n_layers",       "n_heads",
                                       "n_kv_heads",     "rope_theta",    "norm_eps",       "tie_embeddings",
                                       "num_experts",    "topk",          "expert_ffn_size", "score_function",
                                       "pre_softmax",    "norm_topk_prob", "num_groups",     "group_topk",
                                       "scaling_factor", "expert_bias",   "shared_ffn_size", "first_k_dense",
                                       "apply_topk_weights_early"};
    tm_model_config mc;
    int bf16 = 0;
    char e[2048];
    int rc = tmd_hf_read_config(cli->init_from, &mc, &bf16, e, sizeof e);
    if (rc) return tmd_fail(err, errlen, rc, "key 'init_from' = '%s': %s", cli->init_from, e);
    tmd_config hf = *cli;
    hf.model = mc;
    hf.model.max_seq_len = cli->model.max_seq_len;
    /* The export's context (max_position_embeddings) is the run's sequence length unless the
     * command sets one: a fine-tune trains and re-exports at the length the model had. */
    int si = tmd_config_key_index("seq_len");
    int take_seq = cli->source[si] == TMD_SRC_DEFAULT;
    hf.dtype = bf16 ? TMD_DTYPE_BF16 : TMD_DTYPE_F32;
    *out = *cli;
    char a[256], b[256];
    for (size_t k = 0; k < sizeof ARCH / sizeof ARCH[0]; k++) {
        int i = tmd_config_key_index(ARCH[k]);
        tmd_config_format_exact(&hf, i, a, sizeof a);
        tmd_config_format_exact(cli, i, b, sizeof b);
        if (cli->source[i] != TMD_SRC_DEFAULT && cli->source[i] != TMD_SRC_AUTO && strcmp(a, b)) {
            char x[256], y[256];
            tmd_config_format(&hf, i, x, sizeof x);
            tmd_config_format(cli, i, y, sizeof y);
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR,
                            "key '%s' = %s differs from %s/config.json (%s), which init_from takes the model from",
                            ARCH[k], y, cli->init_from, x);
        }
        /* messages about the value name the file and its own key (tmd_config_validate prefixes
         * a range error with it) */
        char where[TMD_PATH_MAX + 64];
        const char *hk = hf_key_of(ARCH[k]);
        if (hk)
            snprintf(where, sizeof where, "%s/config.json key \"%s\"", cli->init_from, hk);
        else
            snprintf(where, sizeof where, "%s/config.json (a Mixtral's fixed %s)", cli->init_from, ARCH[k]);
        if (tmd_config_set(out, ARCH[k], a, TMD_SRC_INIT_FROM, where, e, sizeof e))
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "init_from '%s': %s", cli->init_from, e);
    }
    if (take_seq) {
        char v[32], where[TMD_PATH_MAX + 64];
        snprintf(v, sizeof v, "%d", mc.max_seq_len);
        snprintf(where, sizeof where, "%s/config.json key \"max_position_embeddings\"", cli->init_from);
        if (tmd_config_set(out, "seq_len", v, TMD_SRC_INIT_FROM, where, e, sizeof e))
            return tmd_fail(err, errlen, TMD_CONFIG_ERROR, "init_from '%s': %s", cli->init_from, e);
    }
    int di = tmd_config_key_index("dtype");
    if (cli->source[di] == TMD_SRC_DEFAULT) out->dtype = hf.dtype;
    return 0;
}
