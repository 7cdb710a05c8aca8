/*
 * moe.c — the Mixture-of-Experts block, built from the public ops (and, for expert parallelism,
 * a few internal entry points of framework/extend.h: the all-to-all without its count check,
 * host copies of counts):
 *
 *   x [T,H] --gate (tm_moe_gating, f32)--> logits [T,E] --router--> probs, routing_map, tokens_per_expert
 *     (aux losses from logits and counts; optional capacity drop)
 *   --permute--> rows [R,H] --grouped GEMMs: swiglu(rows @ W0[e], rows @ W1[e]) @ Wo[e]-->
 *   --unpermute (prob-weighted sum)--> y [T,H]  (+ shared-expert SwiGLU on every token)
 *
 * With apply_topk_weights_early the weights move to the other end of the experts: the permuted
 * rows are scaled by their permuted_probs (tm_scale_rows) before the grouped GEMMs, and the
 * unpermute sums with weight 1 (no weights passed).
 *
 * The dense strategy computes every expert on every token with plain matmuls and weights the
 * results by probs: no permute, no grouped GEMM, so it is an independent oracle for the grouped
 * path (tests/test_moe_layer.c) and the cheaper choice when E is tiny.
 *
 * Statistics stay on the block's device: the routed (or kept) counts come from the router (or
 * the drop op), the running sum for the expert-bias update grows by an op
 * (tm_moe_accumulate_counts), and counts, dropped and the three loss values are copied into one
 * small tensor (stats->packed) that tm_moe_stats_read brings back in a single read. A forward
 * + backward of the grouped strategy waits at most once: for the permute's row count where it
 * depends on the data (align padding, or a capacity without pad_to_capacity); dropless with
 * align_size 1 the permute knows R = T * topk (the router's map routes every token to exactly
 * topk experts) and keeps the counts on the device, where the grouped GEMMs read them at most
 * once; with pad_to_capacity nothing is read.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "moe_internal.h"

struct tm_moe {
    tm_ctx *ctx;
    tm_moe_config cfg;
    char prefix[96];
    tm_dtype dtype, gate_dtype;
    tm_device dev;
    tm_tensor *gate, *w0, *w1, *wo;
    tm_tensor *sw0, *sw1, *swo;
    tm_tensor *expert_bias, *tpe_sum;
    /* expert parallelism: this rank holds experts [e0, e0 + L) of E, split over P ep ranks */
    int P, ep_rank, L, e0;
    tm_ep_strategy ep_strategy;
};

tm_moe_config tm_moe_config_default(void) {
    tm_moe_config c;
    memset(&c, 0, sizeof c);
    c.hidden_size = 64;
    c.ffn_size = 128;
    c.router = tm_router_config_default();
    c.expert_bias_update_rate = 1e-3;
    c.aux_counts = TM_AUX_COUNTS_ROUTED;
    c.align_size = 1;
    c.drop_policy = TM_DROP_PROBS;
    c.strategy = TM_MOE_GROUPED;
    c.overlap_chunks = 1;
    return c;
}

#define BAD(...) tm__err(ctx, TM_ERR_INVALID_ARG, __VA_ARGS__)

tm_status tm_moe_config_check(tm_ctx *ctx, const tm_moe_config *c) {
    if (!c) return BAD("moe config: cfg is NULL");
    const tm_router_config *r = &c->router;
    if (c->hidden_size < 1) return BAD("moe config: hidden_size = %d must be >= 1", c->hidden_size);
    if (c->ffn_size < 1) return BAD("moe config: ffn_size = %d must be >= 1", c->ffn_size);
    if (r->num_experts < 1) return BAD("moe config: num_experts = %d must be >= 1", r->num_experts);
    if (r->topk < 1 || r->topk > r->num_experts)
        return BAD("moe config: topk = %d must be in [1, num_experts = %d]", r->topk, r->num_experts);
    if (r->score_function != TM_SCORE_SOFTMAX && r->score_function != TM_SCORE_SIGMOID)
        return BAD("moe config: score_function = %d is neither softmax (0) nor sigmoid (1)", (int)r->score_function);
    if (r->num_groups < 0) return BAD("moe config: num_groups = %d must be >= 0", r->num_groups);
    if (r->num_groups > 1) {
        if (r->num_experts % r->num_groups)
            return BAD("moe config: num_experts = %d is not divisible by num_groups = %d", r->num_experts, r->num_groups);
        if (r->group_topk < 1 || r->group_topk > r->num_groups)
            return BAD("moe config: group_topk = %d must be in [1, num_groups = %d]", r->group_topk, r->num_groups);
        if (r->topk % r->group_topk)
            return BAD("moe config: topk = %d is not divisible by group_topk = %d", r->topk, r->group_topk);
        if (r->topk / r->group_topk > r->num_experts / r->num_groups)
            return BAD("moe config: topk / group_topk = %d exceeds the %d experts of a group", r->topk / r->group_topk,
                       r->num_experts / r->num_groups);
    }
    if (!(r->scaling_factor > 0) || !isfinite(r->scaling_factor))
        return BAD("moe config: scaling_factor = %g must be > 0", r->scaling_factor);
    if (r->force_load_balance != 0 && r->force_load_balance != 1)
        return BAD("moe config: force_load_balance = %d must be 0 or 1", r->force_load_balance);
    if (!(c->expert_bias_update_rate >= 0)) return BAD("moe config: expert_bias_update_rate = %g must be >= 0", c->expert_bias_update_rate);
    if (!(c->aux_loss_coeff >= 0)) return BAD("moe config: aux_loss_coeff = %g must be >= 0", c->aux_loss_coeff);
    if (!(c->seq_aux_loss_coeff >= 0)) return BAD("moe config: seq_aux_loss_coeff = %g must be >= 0", c->seq_aux_loss_coeff);
    if (!(c->z_loss_coeff >= 0)) return BAD("moe config: z_loss_coeff = %g must be >= 0", c->z_loss_coeff);
    if (c->aux_counts != TM_AUX_COUNTS_ROUTED && c->aux_counts != TM_AUX_COUNTS_CLEAN)
        return BAD("moe config: aux_counts = %d is neither routed (0) nor clean (1)", (int)c->aux_counts);
    if (c->align_size < 1) return BAD("moe config: align_size = %lld must be >= 1", (long long)c->align_size);
    if (!(c->capacity_factor >= 0) || !isfinite(c->capacity_factor))
        return BAD("moe config: capacity_factor = %g must be > 0 (or 0 for dropless)", c->capacity_factor);
    if (c->pad_to_capacity && c->capacity_factor <= 0)
        return BAD("moe config: pad_to_capacity needs capacity_factor > 0, got capacity_factor = %g", c->capacity_factor);
    if (c->drop_policy != TM_DROP_PROBS && c->drop_policy != TM_DROP_POSITION)
        return BAD("moe config: drop_policy = %d is neither probs (0) nor position (1)", (int)c->drop_policy);
    if (c->shared_ffn_size < 0) return BAD("moe config: shared_ffn_size = %d must be >= 0", c->shared_ffn_size);
    if (c->strategy != TM_MOE_GROUPED && c->strategy != TM_MOE_DENSE)
        return BAD("moe config: strategy = %d is neither grouped (0) nor dense (1)", (int)c->strategy);
    if (c->apply_topk_weights_early != 0 && c->apply_topk_weights_early != 1)
        return BAD("moe config: apply_topk_weights_early = %d must be 0 or 1", c->apply_topk_weights_early);
    if (c->overlap_chunks < 0)
        return BAD("moe config: overlap_chunks = %d must be >= 1 (1: the layer's tokens in one piece; 0 is taken as 1)",
                   c->overlap_chunks);
    return TM_OK;
}

static tm_status mk(tm_moe *m, const char *suffix, int is_param, tm_dtype dt, int nd, int64_t a, int64_t b, int64_t c,
                    tm_tensor **out) {
    char name[160];
    int n = snprintf(name, sizeof name, "%s.%s", m->prefix, suffix);
    if (n < 0 || n >= (int)sizeof name) return tm__err(m->ctx, TM_ERR_INVALID_ARG, "tm_moe_new: name \"%s.%s\" too long", m->prefix, suffix);
    int64_t shape[3] = {a, b, c};
    if (!is_param) return tm_buffer_new(m->ctx, name, dt, nd, shape, m->dev, out);
    /* The routed experts' weights form the expert group; under expert parallelism this rank
     * holds experts [e0, e0 + L) of the logical [E, ...] tensor (a shard along dim 0, which the
     * initialisation and the checkpoints see as such); everything else of the block is dense. */
    tm_param_options o = tm_param_options_default();
    if (!strncmp(suffix, "experts.", 8)) {
        o.group = TM_PARAM_EXPERT;
        o.expert_lo = m->e0;
        o.expert_hi = m->e0 + m->L;
        if (m->P > 1) {
            o.logical_ndim = nd;
            o.logical_shape[0] = a, o.logical_shape[1] = b, o.logical_shape[2] = c;
            o.shard_axis = 0;
            o.shard_offset = m->e0;
            shape[0] = m->L;
        }
    }
    return tm_param_new_ex(m->ctx, name, dt, nd, shape, m->dev, &o, out);
}

tm_status tm_moe_new(tm_ctx *ctx, const char *prefix, const tm_moe_config *cfg, tm_dtype dtype, tm_device dev,
                     tm_moe **out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out || !prefix) return BAD("tm_moe_new: %s is NULL", out ? "prefix" : "out");
    TM__TRY(tm_moe_config_check(ctx, cfg));
    if (!tm__is_float(dtype)) return tm__err(ctx, TM_ERR_DTYPE, "tm_moe_new: dtype %s is not a float dtype", tm_dtype_name(dtype));
    if (strlen(prefix) >= sizeof(((tm_moe *)0)->prefix)) return BAD("tm_moe_new: prefix \"%.40s...\" is too long", prefix);
    tm_moe *m = tm__host_alloc(ctx, sizeof *m);
    if (!m) return tm__err(ctx, TM_ERR_NOMEM, "tm_moe_new: out of host memory");
    memset(m, 0, sizeof *m);
    m->ctx = ctx;
    m->cfg = *cfg;
    m->dtype = dtype;
    m->gate_dtype = dtype == TM_F64 ? TM_F64 : TM_F32;
    m->dev = dev;
    snprintf(m->prefix, sizeof m->prefix, "%s", prefix);
    int64_t H = cfg->hidden_size, F = cfg->ffn_size, E = cfg->router.num_experts, Fs = cfg->shared_ffn_size;
    /* The layout of the context's communicator (tinymoe.h, "Distributed"). */
    m->P = tm_comm_size(ctx, TM_COMM_EP);
    m->ep_rank = tm_comm_rank(ctx, TM_COMM_EP);
    m->ep_strategy = tm_comm_get_options(ctx).ep_strategy;
    m->L = (int)E / m->P;
    m->e0 = m->ep_rank * m->L;
    if (E % m->P || (m->P > 1 && cfg->strategy != TM_MOE_GROUPED)) {
        tm_status bad = E % m->P ? BAD("tm_moe_new: num_experts = %lld is not divisible by ep_size = %d (each ep rank "
                                       "holds num_experts / ep_size experts)", (long long)E, m->P)
                                 : BAD("tm_moe_new: expert parallelism (ep_size = %d) needs the grouped strategy, not "
                                       "the dense oracle", m->P);
        tm__host_free(ctx, m);
        return bad;
    }
    /* The chunked dispatch's all-to-alls run beside the work (chunk pipeline below): the ep
     * group's side communicator is made here, where every rank of the group makes its layers
     * in the same order (its making is collective over the group). */
    tm_status s = TM_OK;
    if (cfg->overlap_chunks > 1 && m->P > 1 && m->ep_strategy != TM_EP_ALLGATHER)
        s = tm__comm_side_prepare(ctx, TM_COMM_EP, dev);
    if (!s) s = mk(m, "gate.weight", 1, m->gate_dtype, 2, H, E, 0, &m->gate);
    if (!s) s = mk(m, "experts.w0", 1, dtype, 3, E, H, F, &m->w0);
    if (!s) s = mk(m, "experts.w1", 1, dtype, 3, E, H, F, &m->w1);
    if (!s) s = mk(m, "experts.wo", 1, dtype, 3, E, F, H, &m->wo);
    if (!s && Fs) s = mk(m, "shared.w0", 1, dtype, 2, H, Fs, 0, &m->sw0);
    if (!s && Fs) s = mk(m, "shared.w1", 1, dtype, 2, H, Fs, 0, &m->sw1);
    if (!s && Fs) s = mk(m, "shared.wo", 1, dtype, 2, Fs, H, 0, &m->swo);
    if (!s && cfg->use_expert_bias) s = mk(m, "expert_bias", 0, m->gate_dtype, 1, E, 0, 0, &m->expert_bias);
    if (!s) s = mk(m, "tokens_per_expert_sum", 0, TM_I64, 1, E, 0, 0, &m->tpe_sum);
    if (s) {
        tm__host_free(ctx, m);
        return s;
    }
    *out = m;
    return TM_OK;
}

void tm_moe_free(tm_moe *moe) {
    if (moe) tm__host_free(moe->ctx, moe);
}

const tm_moe_config *tm_moe_get_config(const tm_moe *moe) { return moe ? &moe->cfg : NULL; }

tm_tensor *tm_moe_tensor(const tm_moe *moe, const char *suffix) {
    if (!moe || !suffix) return NULL;
    char name[160];
    snprintf(name, sizeof name, "%s.%s", moe->prefix, suffix);
    return tm_ctx_find(moe->ctx, name);
}

tm_status tm_moe_init(tm_moe *m, uint64_t seed, double std, double out_std) {
    if (!m) return TM_ERR_INVALID_ARG;
    tm_tensor *normal[] = {m->gate, m->w0, m->w1, m->sw0, m->sw1};
    for (size_t i = 0; i < sizeof normal / sizeof *normal; i++)
        if (normal[i]) TM__TRY(tm__param_init_normal_replicated(m->ctx, normal[i], seed, 0, std));
    TM__TRY(tm__param_init_normal_replicated(m->ctx, m->wo, seed, 0, out_std));
    if (m->swo) TM__TRY(tm__param_init_normal_replicated(m->ctx, m->swo, seed, 0, out_std));
    return TM_OK;
}

/* ---- forward ----------------------------------------------------------------------------- */

/* Expert e's slice of a stacked weight [E, A, B] as an [A, B] view. */
static tm_status expert_weight(tm_ctx *ctx, tm_tensor *w, int64_t e, tm_tensor **out) {
    tm_tensor *s;
    TM__TRY(tm_slice(ctx, w, 0, e, e + 1, &s));
    int64_t shape[2] = {tm_tensor_dim(w, 1), tm_tensor_dim(w, 2)};
    return tm_reshape(ctx, s, 2, shape, out);
}

static tm_status swiglu_ffn(tm_ctx *ctx, tm_tensor *x, tm_tensor *w0, tm_tensor *w1, tm_tensor *wo, tm_tensor **out) {
    tm_tensor *a, *b, *h;
    TM__TRY(tm_matmul(ctx, x, w0, 0, 0, &a));
    TM__TRY(tm_matmul(ctx, x, w1, 0, 0, &b));
    TM__TRY(tm_swiglu(ctx, a, b, &h));
    return tm_matmul(ctx, h, wo, 0, 0, out);
}

/* Dense oracle: y = sum_e probs[:, e] * SwiGLU_e(x). The column probs[:, e] is spread over H
 * with a K=1 matmul against ones (an outer product) since broadcasting is over leading dims.
 * With apply_topk_weights_early, y = sum_e SwiGLU_e(probs[:, e] * x) (tm_scale_rows by the
 * column, in the probs' dtype as the grouped path's permuted_probs): an expert that a token
 * does not route to gets p = 0, a zero input row and SwiGLU_e(0) = 0 (no biases), so the sum
 * over all E experts is the routed one. */
static tm_status dense_experts(tm_moe *m, tm_tensor *x, tm_tensor *probs, tm_tensor **y) {
    tm_ctx *ctx = m->ctx;
    int64_t T = tm_tensor_dim(x, 0), H = tm_tensor_dim(x, 1), E = m->cfg.router.num_experts;
    int64_t one_h[2] = {1, H};
    int early = m->cfg.apply_topk_weights_early;
    tm_tensor *ones = NULL, *p = probs;
    tm_dtype dt = tm_tensor_dtype(x);
    if (!early) {
        TM__TRY(tm_tensor_empty(ctx, dt, 2, one_h, tm_tensor_device(x), &ones));
        TM__TRY(tm_tensor_fill(ctx, ones, 1.0));
        if (tm_tensor_dtype(p) != dt) TM__TRY(tm_cast(ctx, p, dt, &p));
    }
    tm_tensor *acc = NULL;
    for (int64_t e = 0; e < E; e++) {
        tm_tensor *w0, *w1, *wo, *h, *col, *term;
        TM__TRY(expert_weight(ctx, m->w0, e, &w0));
        TM__TRY(expert_weight(ctx, m->w1, e, &w1));
        TM__TRY(expert_weight(ctx, m->wo, e, &wo));
        TM__TRY(tm_slice(ctx, p, 1, e, e + 1, &col)); /* [T,1] */
        if (early) {
            tm_tensor *xe;
            TM__TRY(tm_reshape(ctx, col, 1, &T, &col)); /* [T] (a copy of the strided column) */
            TM__TRY(tm_scale_rows(ctx, x, col, &xe));
            TM__TRY(swiglu_ffn(ctx, xe, w0, w1, wo, &term));
        } else {
            tm_tensor *spread;
            TM__TRY(swiglu_ffn(ctx, x, w0, w1, wo, &h));
            TM__TRY(tm_matmul(ctx, col, ones, 0, 0, &spread)); /* [T,H] */
            TM__TRY(tm_mul(ctx, h, spread, &term));
        }
        if (acc) TM__TRY(tm_add(ctx, acc, term, &acc));
        else acc = term;
    }
    *y = acc;
    return TM_OK;
}

/* The expert input rows and the combine weights of a dispatch: late weighting (the default)
 * passes the rows as they are and weights the combine by permuted_probs; early weighting
 * scales each row by its weight now (padding rows: weight 0, and zero rows already) and
 * combines with weight 1 (NULL weights for tm_moe_unpermute). */
static tm_status weighted_rows(tm_moe *m, const tm_moe_dispatch *d, tm_tensor **rows, tm_tensor **combine_w) {
    if (!m->cfg.apply_topk_weights_early) {
        *rows = d->permuted;
        *combine_w = d->permuted_probs;
        return TM_OK;
    }
    *combine_w = NULL;
    return tm_scale_rows(m->ctx, d->permuted, d->permuted_probs, rows);
}

/* ---- expert parallelism (TransformerEngine's MoE dispatch, Megatron-LM's token dispatchers,
 * MaxText's ring of experts, DeepEP's dispatch / combine; docs/layouts.md) ---------------------- */

/* An i64 [n] tensor on dev from host values, mirrored (the grouped GEMMs read their group
 * sizes from the mirror instead of the device). */
static tm_status i64_tensor(tm_ctx *ctx, const int64_t *v, int64_t n, tm_device dev, int mirror, tm_tensor **out) {
    TM__TRY(tm_tensor_from_host(ctx, TM_I64, 1, &n, dev, TM_I64, v, out));
    return mirror ? tm__mirror_set(ctx, *out, v) : TM_OK;
}

/* The local experts on rows grouped expert-major by `counts` (L groups). */
static tm_status local_experts(tm_moe *m, tm_tensor *rows, tm_tensor *counts, tm_tensor **out) {
    return tm_grouped_mlp(m->ctx, rows, m->w0, m->w1, m->wo, counts, out);
}

/* Out of memory inside an expert-parallel dispatch: the rows a rank receives follow the routing
 * (early in training one rank may get ~10x its share), so say how many came and what bounds
 * them, before the allocator's own message. */
static tm_status ep_nomem(tm_moe *m, int64_t received, int64_t sent, int64_t tokens) {
    tm_ctx *ctx = m->ctx;
    char prev[600];
    snprintf(prev, sizeof prev, "%s", tm_ctx_errmsg(ctx));
    const double mib = 1024.0 * 1024.0;
    size_t row = (size_t)m->cfg.hidden_size * tm_dtype_size(m->dtype);
    return tm__err(ctx, TM_ERR_NOMEM,
                   "%s: expert-parallel dispatch on ep rank %d of %d: received %lld rows for its %d experts (%.1fx the "
                   "%lld it sent for its %lld tokens; %.1f MiB of rows, each also needing the experts' %d-wide "
                   "activations and their gradients); bound the rows an expert takes with capacity_factor (e.g. "
                   "1.25), spread the experts over more ranks (ep_size), or lower batch_size. %s",
                   m->prefix, m->ep_rank, m->P, (long long)received, m->L, sent ? (double)received / (double)sent : 0.0,
                   (long long)sent, (long long)tokens, (double)received * (double)row / mib, m->cfg.ffn_size, prev);
}

/* All-to-all dispatch (TE's MoE block; Megatron's MoEAlltoAllTokenDispatcher):
 *   permute (all E experts, expert-major) -> exchange the counts on the device (an all-to-all
 *   of L counts per rank pair: rank j learns how many rows of each of its local experts every
 *   rank sends) -> one read of this rank's own E counts and the P x L it receives -> ragged
 *   all-to-all of the rows to the ranks owning their experts (they arrive source-rank major:
 *   from rank j, its rows of local expert 0, 1, ...) -> regroup expert-major on the device
 *   (tm_moe_sort_chunks of the [P, L] grid) -> the L local experts -> the inverse regrouping ->
 *   the reverse all-to-all -> the source's own unpermute with its own combine weights
 *   (permuted_probs never travel: the expert outputs come back to the rows they left, so the
 *   weighted sum is the one-rank one). With apply_topk_weights_early the source scales its
 *   permuted rows by their weights before the first all-to-all (so the weights still stay
 *   home) and combines with weight 1.
 * The one read is what NCCL's ragged send/recv forces: ncclSend / ncclRecv take their counts
 * on the host, and so do the grouped GEMMs' per-expert cuBLASLt calls. Everything else (the
 * count exchange, the offsets of the regrouping) stays on the device, and the backward reads
 * nothing (the counts' host copies serve it). Every step is an op, so the backward mirrors it
 * (the all-to-alls reverse, the regroupings invert). Counts include the permute's alignment
 * padding rows, which travel as zero rows. */
static tm_status ep_alltoall_experts(tm_moe *m, tm_tensor *x, tm_tensor *probs, tm_tensor *map, int64_t pad_to,
                                     tm_tensor **y) {
    tm_ctx *ctx = m->ctx;
    int P = m->P, L = m->L, E = P * L;
    tm_moe_dispatch d;
    /* without dropping or padding every token has topk rows: R is known, nothing is read */
    int topk = m->cfg.capacity_factor > 0 ? 0 : m->cfg.router.topk;
    TM__TRY(tm_moe_permute_topk(ctx, x, map, probs, topk, m->cfg.align_size, pad_to, &d));
    /* [P, L]: row j = this rank's rows for rank j's experts; after the exchange, row j = rank
     * j's rows for this rank's experts */
    int64_t grid[2] = {P, L}, both = 2 * (int64_t)E;
    int64_t *all = tm__meta_alloc(ctx, sizeof(int64_t) * (size_t)(2 * E + 3 * P + E + L + 1));
    if (!all) return TM_ERR_NOMEM;
    int64_t *ones = all + 2 * E, *sendc = ones + P, *recvc = sendc + P, *sizes_t = recvc + P, *lcount = sizes_t + E;
    for (int j = 0; j < P; j++) ones[j] = 1;
    tm_tensor *tpe, *cnt_ones, *rgrid, *rflat, *both_t;
    TM__TRY(tm_reshape(ctx, d.tokens_per_expert, 2, grid, &tpe));
    TM__TRY(i64_tensor(ctx, ones, P, tm_cpu(), 0, &cnt_ones));
    TM__TRY(tm__comm_alltoall_consistent(ctx, tpe, cnt_ones, cnt_ones, TM_COMM_EP, &rgrid));
    int64_t nE = E;
    TM__TRY(tm_reshape(ctx, rgrid, 1, &nE, &rflat));
    /* the one read: own counts and received counts together (own ones alone are on the host
     * already where the permute read them back: align_size > 1 or capacity) */
    const int64_t *own = tm__mirror_find(ctx, d.tokens_per_expert), *rcv;
    if (own) {
        TM__TRY(tm_tensor_read(ctx, rflat, TM_I64, all + E, E));
        memcpy(all, own, sizeof(int64_t) * (size_t)E);
    } else {
        tm_tensor *pair[2] = {d.tokens_per_expert, rflat};
        TM__TRY(tm_concat(ctx, 2, pair, 0, &both_t));
        TM__TRY(tm_tensor_read(ctx, both_t, TM_I64, all, both));
    }
    own = all, rcv = all + E;
    TM__TRY(tm__mirror_set(ctx, rflat, rcv));
    int64_t Rr = 0;
    for (int j = 0; j < P; j++) {
        sendc[j] = recvc[j] = 0;
        for (int l = 0; l < L; l++) sendc[j] += own[j * L + l], recvc[j] += rcv[j * L + l];
        Rr += recvc[j];
    }
    for (int l = 0; l < L; l++) {
        lcount[l] = 0;
        for (int j = 0; j < P; j++) sizes_t[l * P + j] = rcv[j * L + l], lcount[l] += rcv[j * L + l];
    }
    tm_tensor *sc, *rc, *st, *tl, *rows, *cw, *recv, *xe, *eo, *back, *ret;
    TM__TRY(weighted_rows(m, &d, &rows, &cw));
    TM__TRY(i64_tensor(ctx, sendc, P, tm_cpu(), 0, &sc));
    TM__TRY(i64_tensor(ctx, recvc, P, tm_cpu(), 0, &rc));
    TM__TRY(i64_tensor(ctx, sizes_t, E, m->dev, 1, &st));
    TM__TRY(i64_tensor(ctx, lcount, L, m->dev, 1, &tl));
    tm_status s = tm__comm_alltoall_consistent(ctx, rows, sc, rc, TM_COMM_EP, &recv); // (Rr, H) source-major
    if (!s) s = tm_moe_sort_chunks(ctx, recv, rflat, P, &xe);                         // (Rr, H) expert-major
    if (!s) s = local_experts(m, xe, tl, &eo);
    if (!s) s = tm_moe_sort_chunks(ctx, eo, st, L, &back);                            // (Rr, H) source-major
    if (!s) s = tm__comm_alltoall_consistent(ctx, back, rc, sc, TM_COMM_EP, &ret);    // (R, H) as permuted
    if (s == TM_ERR_NOMEM) return ep_nomem(m, Rr, tm_tensor_dim(d.permuted, 0), tm_tensor_dim(x, 0));
    if (s) return s;
    return tm_moe_unpermute(ctx, ret, cw, d.row_token, tm_tensor_dim(x, 0), y);
}

/* Deduplicated all-to-all dispatch (DeepEP's dispatch / combine): each token goes once to
 * every rank that holds any of its experts, with its router weights and routing over that
 * rank's L experts; the rank permutes the rows it received over its local experts, runs them,
 * combines them with those weights into one partial output per received token, and sends that
 * row back; the source sums a token's partial outputs over the ranks in rank order. A token
 * travels to the ranks it touches (at most min(topk, P)) instead of once per expert: with top-6
 * of 64 experts on 2 ranks about 2 rows per token instead of 6.
 *   source: per_rank [T, P] (a token's experts on each rank) -> permute rank-major (rows
 *   sent, counts read: one synchronisation) -> counts exchanged on the device, read (one) ->
 *   all-to-all of the rows and, beside them, of [weights | map] over the destination's L
 *   experts (the [T * P, 2L] table's row t P + j: each sent row names a distinct one, so the
 *   gather's backward needs no sort) -> receiver: permute over its L experts (counts read: one)
 *   -> experts -> unpermute with the weights -> all-to-all back -> source: unpermute with
 *   weight 1 (the sum over ranks).
 * The row ids t P + j travel through the rank permute as its "probs" (exact in f32 below 2^24).
 * With apply_topk_weights_early the receiver scales its rows before the experts and combines
 * with weight 1. The weighted sum is split by rank (partial sums rounded to the rows' dtype):
 * equal to one process to rounding. */
static tm_status ep_dedup_experts(tm_moe *m, tm_tensor *x, tm_tensor *probs, tm_tensor *map, int64_t pad_to,
                                  tm_tensor **y) {
    tm_ctx *ctx = m->ctx;
    const int P = m->P, L = m->L;
    const int64_t T = tm_tensor_dim(x, 0);
    if ((double)T * P >= 16777216.0)
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "%s: the deduplicated all-to-all numbers the (token, rank) pairs in f32: %lld tokens x ep_size %d "
                       "is past 2^24; use fewer tokens per micro-batch or ep_strategy alltoall",
                       m->prefix, (long long)T, P);
    tm_dtype pdt = tm_tensor_dtype(probs);
    /* per_rank [T, P] (how many of a token's experts each rank holds; nonzero sends it there)
     * and the table of what travels with a row, [T * P, 2L]: weights, then the map as 0 / 1 */
    tm_tensor *mf, *m3, *per_rank, *rank_map, *p3, *tbl;
    int64_t s3[3] = {T, P, L}, s2[2] = {T * P, 2 * (int64_t)L};
    TM__TRY(tm_cast(ctx, map, pdt, &mf));
    TM__TRY(tm_reshape(ctx, mf, 3, s3, &m3));
    TM__TRY(tm_sum(ctx, m3, 2, 0, &per_rank));
    TM__TRY(tm_cast(ctx, per_rank, TM_U8, &rank_map));
    TM__TRY(tm_reshape(ctx, probs, 3, s3, &p3));
    tm_tensor *cat[2] = {p3, m3};
    TM__TRY(tm_concat(ctx, 2, cat, 2, &tbl));
    TM__TRY(tm_reshape(ctx, tbl, 2, s2, &tbl));
    /* the ids t P + j, carried by the rank permute as its weights */
    float *idv = tm__meta_alloc(ctx, sizeof(float) * (size_t)(T * P + 1));
    if (!idv) return TM_ERR_NOMEM;
    for (int64_t i = 0; i < T * P; i++) idv[i] = (float)i;
    int64_t sp[2] = {T, P};
    tm_tensor *ids_tp, *ids, *sent_tbl;
    TM__TRY(tm_tensor_from_host(ctx, TM_F32, 2, sp, m->dev, TM_F32, idv, &ids_tp));
    tm_moe_dispatch d;
    TM__TRY(tm_moe_permute(ctx, x, rank_map, ids_tp, 1, 0, &d)); /* rows rank-major; its counts read */
    TM__TRY(tm_cast(ctx, d.permuted_probs, TM_I64, &ids));
    TM__TRY(tm__embedding_unique(ctx, tbl, ids, &sent_tbl)); /* (Rs, 2L) */
    /* counts: sent per rank (the permute's, on the host), received per rank (exchanged on the
     * device, read once) */
    const int64_t *sendc = tm__mirror_find(ctx, d.tokens_per_expert);
    int64_t *cv = tm__meta_alloc(ctx, sizeof(int64_t) * (size_t)(4 * P));
    if (!cv) return TM_ERR_NOMEM;
    int64_t *ones = cv, *sendv = cv + P, *recvc = cv + 2 * P;
    if (!sendc) {
        TM__TRY(tm_tensor_read(ctx, d.tokens_per_expert, TM_I64, sendv, P));
        sendc = sendv;
    }
    for (int j = 0; j < P; j++) ones[j] = 1;
    int64_t g2[2] = {P, 1};
    tm_tensor *c2, *rc2, *t_ones, *sc, *rc;
    TM__TRY(tm_reshape(ctx, d.tokens_per_expert, 2, g2, &c2));
    TM__TRY(i64_tensor(ctx, ones, P, tm_cpu(), 0, &t_ones));
    TM__TRY(tm__comm_alltoall_consistent(ctx, c2, t_ones, t_ones, TM_COMM_EP, &rc2));
    TM__TRY(tm_tensor_read(ctx, rc2, TM_I64, recvc, P));
    int64_t Rr = 0;
    for (int j = 0; j < P; j++) Rr += recvc[j];
    TM__TRY(i64_tensor(ctx, sendc, P, tm_cpu(), 0, &sc));
    TM__TRY(i64_tensor(ctx, recvc, P, tm_cpu(), 0, &rc));
    tm_tensor *xr, *tr, *pl, *mlf, *ml, *rows, *cw, *eo, *part, *back;
    tm_status s = tm__comm_alltoall_consistent(ctx, d.permuted, sc, rc, TM_COMM_EP, &xr); /* (Rr, H) */
    if (!s) s = tm__comm_alltoall_consistent(ctx, sent_tbl, sc, rc, TM_COMM_EP, &tr);    /* (Rr, 2L) */
    if (s == TM_ERR_NOMEM) return ep_nomem(m, Rr, d.num_rows, T);
    TM__TRY(s);
    TM__TRY(tm_slice(ctx, tr, 1, 0, L, &pl));
    TM__TRY(tm_contiguous(ctx, pl, &pl));
    TM__TRY(tm_slice(ctx, tr, 1, L, 2 * (int64_t)L, &mlf));
    TM__TRY(tm_cast(ctx, mlf, TM_U8, &ml));
    TM__TRY(tm_contiguous(ctx, ml, &ml));
    tm_moe_dispatch dl;
    s = tm_moe_permute(ctx, xr, ml, pl, m->cfg.align_size, pad_to, &dl);
    if (!s) s = weighted_rows(m, &dl, &rows, &cw);
    if (!s) s = local_experts(m, rows, dl.tokens_per_expert, &eo);
    if (!s) s = tm_moe_unpermute(ctx, eo, cw, dl.row_token, Rr, &part);              /* (Rr, H) partial */
    if (!s) s = tm__comm_alltoall_consistent(ctx, part, rc, sc, TM_COMM_EP, &back);  /* (Rs, H) */
    if (s == TM_ERR_NOMEM) return ep_nomem(m, Rr, d.num_rows, T);
    TM__TRY(s);
    return tm_moe_unpermute(ctx, back, NULL, d.row_token, T, y);
}

/* ---- overlap: the expert-parallel dispatch in token chunks (tm_moe_config.overlap_chunks) ----
 *
 * Megatron-LM's EP all-to-all overlap / MaxText PR #3981: the layer's T tokens are cut into C
 * chunks (rows [c T / C, (c + 1) T / C)); the routing was decided for all of them before (router,
 * losses, statistics, capacity: tm__moe_forward), only the rows move per chunk.
 * One permute serves every chunk: the routing map and probs are laid out block-diagonally,
 * [T, C K] with chunk c's rows in columns [c K, (c + 1) K) (chunk_diag), so the permuted rows come
 * chunk-major, then as one chunk's own permute would order them, and tokens_per_expert [C K]
 * holds each chunk's counts. Every chunk's counts are exchanged by one device all-to-all and read
 * in the one host read of the layer, before any row moves; after it nothing reads the host
 * until the layer's end (the chunks' tables are uploaded once, with host mirrors).
 *
 * Program order (what a communication stream that waits for the compute issued before each
 * collective sees): D(c) = chunk c's dispatch all-to-all(s), X(c) = its experts (the regrouping,
 * the grouped GEMMs), K(c) = its combine all-to-all; U = the unpermute of all chunks at the end
 * (reading K(c) earlier would make the compute wait for it). With one chunk of lag on the
 * combine (COMBINE_LAG):
 *     forward:  D0 D1 X0 D2 X1 K0 D3 X2 K1 ... X(C-1) K(C-2) K(C-1) U
 * so D(c + 1) runs while X(c) computes and K(c) while X(c + 2) does. The backward replays the
 * tape in reverse:
 *     backward: U' K(C-1)' K(C-2)' X(C-1)' K(C-3)' X(C-2)' D(C-1)' ... K0' X1' D2' X0' D1' D0'
 * i.e. the combine-backward all-to-all of chunk c - 1 is issued before the experts-backward of
 * chunk c (it runs while that computes), and the dispatch-backward of chunk c + 1 right after
 * the experts-backward of chunk c (it runs during that of chunk c - 1); K(C-1)', D1' and D0' are
 * the exposed ones. (Seen with a tracing build, C = 3, alltoall: forward D0 D1 X0 D2 X1 K0 X2 K1
 * K2, backward K2' K1' X2' K0' X1' D2' X0' D1' D0'; alltoall_dedup the same, each D with its
 * table's all-to-all.) Without the lag (K(c) right after X(c): COMBINE_LAG 0) the forward would
 * overlap one more combine, but its reverse issues each K(c - 1)' after X(c)', so with a
 * communication stream that waits for the compute issued before it, the backward (twice the
 * forward's compute) would overlap nothing.
 * The stream (tm_comm_options.overlap, NCCL: tm__comm_alltoall_beside, framework/side.c): each
 * D(c) and K(c) is enqueued on the side stream after the compute issued so far; X(c) waits for
 * D(c) alone, U for every K(c). In the backward each all-to-all's reverse is enqueued there when
 * its tape node runs and waited for by the first reader of the gradient it writes: K(c)'s by
 * X(c)'s backward; D(c)'s by the backward of chunk c's cut of the rows, which chunked_finish
 * makes for every chunk before D0, so those waits come after X0' (the cut made next to D(c)
 * would wait right after D(c)'). The memory each transfer moves (the rows sent, the upstream
 * gradient taken off the tape) is held until its wait. On CPU ranks the same calls run in place
 * and the same waits happen at once. */
enum { COMBINE_LAG = 1 };
enum { STAGE_DISPATCH, STAGE_EXPERTS, STAGE_COMBINE };
typedef tm_status (*chunk_stage_fn)(void *state, int stage, int c);

static tm_status run_chunk_pipeline(int C, chunk_stage_fn f, void *st) {
    TM__TRY(f(st, STAGE_DISPATCH, 0));
    for (int k = 0; k < C; k++) {
        if (k + 1 < C) TM__TRY(f(st, STAGE_DISPATCH, k + 1));
        TM__TRY(f(st, STAGE_EXPERTS, k));
        if (k >= COMBINE_LAG) TM__TRY(f(st, STAGE_COMBINE, k - COMBINE_LAG));
    }
    for (int k = C - COMBINE_LAG; k < C; k++)
        if (k >= 0) TM__TRY(f(st, STAGE_COMBINE, k));
    return TM_OK;
}

/* Chunk c of T tokens starts at row c T / C: sizes differ by at most one. */
static int64_t chunk_lo(int64_t T, int C, int c) { return (int64_t)c * T / C; }

/* tm_concat of n >= 1 tensors along axis, 8 at a time (its limit); xs is overwritten. */
static tm_status concat_many(tm_ctx *ctx, int n, tm_tensor **xs, int axis, tm_tensor **out) {
    while (n > 1) {
        int k = 0;
        for (int i = 0; i < n; i += 8) {
            int g = n - i < 8 ? n - i : 8;
            if (g == 1) xs[k++] = xs[i];
            else TM__TRY(tm_concat(ctx, g, xs + i, axis, &xs[k++]));
        }
        n = k;
    }
    *out = xs[0];
    return TM_OK;
}

/* x [T, K] (any dtype) laid out for the chunked permute: [T, C K], chunk c's rows of x in
 * columns [c K, (c + 1) K), zeros elsewhere. Differentiable in x (slices and concats). */
static tm_status chunk_diag(tm_ctx *ctx, tm_tensor *x, int C, tm_tensor **out) {
    const int64_t T = tm_tensor_dim(x, 0), K = tm_tensor_dim(x, 1);
    tm_tensor **blk = tm__meta_alloc(ctx, sizeof *blk * (size_t)C);
    if (!blk) return TM_ERR_NOMEM;
    for (int c = 0; c < C; c++) {
        const int64_t lo = chunk_lo(T, C, c), hi = chunk_lo(T, C, c + 1);
        int64_t zl[2] = {hi - lo, (int64_t)c * K}, zr[2] = {hi - lo, (int64_t)(C - 1 - c) * K};
        tm_tensor *parts[3];
        int n = 0;
        if (c > 0) TM__TRY(tm_tensor_zeros(ctx, tm_tensor_dtype(x), 2, zl, tm_tensor_device(x), &parts[n++]));
        TM__TRY(tm_slice(ctx, x, 0, lo, hi, &parts[n++]));
        if (c < C - 1) TM__TRY(tm_tensor_zeros(ctx, tm_tensor_dtype(x), 2, zr, tm_tensor_device(x), &parts[n++]));
        TM__TRY(tm_concat(ctx, n, parts, 1, &blk[c]));
    }
    return concat_many(ctx, C, blk, 0, out);
}

/* Rows [lo, hi) of x as a dense tensor (a view: row slices of a dense tensor are dense). */
static tm_status rows_of(tm_ctx *ctx, tm_tensor *x, int64_t lo, int64_t hi, tm_tensor **out) {
    TM__TRY(tm_slice(ctx, x, 0, lo, hi, out));
    return tm_contiguous(ctx, *out, out);
}

/* An all-to-all of the counts grid g [C, P, K] (i64 on the device; this rank's K numbers per
 * chunk for each rank j) so that rank j gets every chunk's row j: one exchange for all chunks,
 * its result [P, C, K] (source-major) flattened. */
static tm_status exchange_chunk_counts(tm_moe *m, tm_tensor *g, int C, int64_t K, tm_tensor **out) {
    tm_ctx *ctx = m->ctx;
    const int P = m->P;
    int64_t s2[2] = {P, (int64_t)C * K}, n = (int64_t)P * C * K;
    int64_t *ones = tm__meta_alloc(ctx, sizeof(int64_t) * (size_t)P);
    if (!ones) return TM_ERR_NOMEM;
    for (int j = 0; j < P; j++) ones[j] = 1;
    tm_tensor *t, *one, *r;
    TM__TRY(tm_transpose(ctx, g, 0, 1, &t)); /* [P, C, K] */
    TM__TRY(tm_contiguous(ctx, t, &t));
    TM__TRY(tm_reshape(ctx, t, 2, s2, &t));
    TM__TRY(i64_tensor(ctx, ones, P, tm_cpu(), 0, &one));
    TM__TRY(tm__comm_alltoall_consistent(ctx, t, one, one, TM_COMM_EP, &r));
    return tm_reshape(ctx, r, 1, &n, out);
}

/* What a chunk's stages share: the per-chunk counts and tensors, filled as the stages run. */
typedef struct chunked {
    tm_moe *m;
    int C, dedup;
    int64_t *off;         /* [C + 1]: chunk c's sent rows are rows [off[c], off[c + 1]) */
    int64_t *rrows;       /* [C]: rows received per chunk */
    int64_t *lrows;       /* dedup [C L]: the receiver's padded rows per local expert */
    tm_tensor *rows, *tbl; /* sent rows [R, H] (and, dedup, their table [R, 2L]) */
    tm_tensor **sc, **rc;  /* [C] send / receive counts per rank (CPU) */
    tm_tensor **rgrid, **rgrid_t, **lcount; /* alltoall [C]: the regroupings' sizes, the GEMMs' counts */
    tm_tensor **recv, **recv_tbl, **out, **ret; /* [C] */
    tm_tensor **part, **part_tbl; /* [C]: each chunk's sent rows (and table), views of rows (tbl) */
    int64_t pad_to;
} chunked;

static tm_status chunk_stage(void *state, int stage, int c) {
    chunked *k = state;
    tm_moe *m = k->m;
    tm_ctx *ctx = m->ctx;
    const int64_t L = m->L;
    switch (stage) {
    case STAGE_DISPATCH:
        TM__TRY(tm__comm_alltoall_beside(ctx, k->part[c], k->sc[c], k->rc[c], TM_COMM_EP, &k->recv[c]));
        if (!k->dedup) return TM_OK;
        return tm__comm_alltoall_beside(ctx, k->part_tbl[c], k->sc[c], k->rc[c], TM_COMM_EP, &k->recv_tbl[c]);
    case STAGE_EXPERTS:
        /* the experts of chunk c start once its rows are here (D(c) ran beside the work) */
        TM__TRY(tm__side_wait(ctx, k->recv[c]));
        if (k->dedup) TM__TRY(tm__side_wait(ctx, k->recv_tbl[c]));
        if (!k->dedup) {
            tm_tensor *xe, *eo;
            TM__TRY(tm_moe_sort_chunks(ctx, k->recv[c], k->rgrid[c], m->P, &xe)); /* expert-major */
            TM__TRY(local_experts(m, xe, k->lcount[c], &eo));
            return tm_moe_sort_chunks(ctx, eo, k->rgrid_t[c], L, &k->out[c]);   /* source-major */
        } else {
            tm_tensor *pl, *mlf, *ml, *rows, *cw, *eo;
            tm_moe_dispatch dl;
            TM__TRY(tm_slice(ctx, k->recv_tbl[c], 1, 0, L, &pl));
            TM__TRY(tm_contiguous(ctx, pl, &pl));
            TM__TRY(tm_slice(ctx, k->recv_tbl[c], 1, L, 2 * L, &mlf));
            TM__TRY(tm_cast(ctx, mlf, TM_U8, &ml));
            TM__TRY(tm_contiguous(ctx, ml, &ml));
            /* its rows per expert came with the counts: no read back here */
            TM__TRY(tm__moe_permute_counted(ctx, k->recv[c], ml, pl, m->cfg.align_size, k->pad_to, k->lrows + c * L,
                                            &dl));
            TM__TRY(weighted_rows(m, &dl, &rows, &cw));
            TM__TRY(local_experts(m, rows, dl.tokens_per_expert, &eo));
            return tm_moe_unpermute(ctx, eo, cw, dl.row_token, k->rrows[c], &k->out[c]); /* partial sums */
        }
    default:
        return tm__comm_alltoall_beside(ctx, k->out[c], k->rc[c], k->sc[c], TM_COMM_EP, &k->ret[c]);
    }
}

/* The pipeline and the end of the layer: every chunk's returned rows, in the order they left
 * (chunk-major), combined by the one unpermute of the source. */
static tm_status chunked_finish(chunked *k, tm_tensor *combine_w, tm_tensor *row_token, int64_t T, tm_tensor **y) {
    tm_moe *m = k->m;
    /* Every chunk's rows are cut before the first moves: the backward replays the tape in
     * reverse, so each cut's backward (the first reader of its chunk's gradient, which the
     * dispatch-backward all-to-all writes beside the work) comes after every chunk's experts
     * backward, not right after its own all-to-all (which would wait for it there). Views of
     * rows: nothing is copied. */
    for (int c = 0; c < k->C; c++) {
        TM__TRY(rows_of(m->ctx, k->rows, k->off[c], k->off[c + 1], &k->part[c]));
        if (k->dedup) TM__TRY(rows_of(m->ctx, k->tbl, k->off[c], k->off[c + 1], &k->part_tbl[c]));
    }
    tm_status s = run_chunk_pipeline(k->C, chunk_stage, k);
    if (s == TM_ERR_NOMEM) {
        int64_t rr = 0;
        for (int c = 0; c < k->C; c++) rr += k->rrows[c];
        return ep_nomem(m, rr, k->off[k->C], T);
    }
    TM__TRY(s);
    /* U: every chunk's combine (run beside the work) is waited for */
    for (int c = 0; c < k->C; c++) TM__TRY(tm__side_wait(m->ctx, k->ret[c]));
    tm_tensor *back;
    TM__TRY(concat_many(m->ctx, k->C, k->ret, 0, &back));
    return tm_moe_unpermute(m->ctx, back, combine_w, row_token, T, y);
}

static tm_status chunked_alloc(tm_moe *m, int C, int dedup, chunked *k) {
    tm_ctx *ctx = m->ctx;
    memset(k, 0, sizeof *k);
    k->m = m;
    k->C = C;
    k->dedup = dedup;
    const size_t nt = (size_t)C * 11, ni = (size_t)C * (3 + (size_t)m->L) + 1;
    tm_tensor **t = tm__meta_alloc(ctx, sizeof *t * nt);
    int64_t *v = tm__meta_alloc(ctx, sizeof *v * ni);
    if (!t || !v) return TM_ERR_NOMEM;
    memset(t, 0, sizeof *t * nt);
    k->sc = t, k->rc = t + C, k->rgrid = t + 2 * C, k->rgrid_t = t + 3 * C, k->lcount = t + 4 * C;
    k->recv = t + 5 * C, k->recv_tbl = t + 6 * C, k->out = t + 7 * C, k->ret = t + 8 * C;
    k->part = t + 9 * C, k->part_tbl = t + 10 * C;
    k->off = v, k->rrows = v + C + 1, k->lrows = v + 2 * C + 1;
    return TM_OK;
}

/* The per-(token, expert) all-to-all (ep_alltoall_experts) in C chunks. Host reads: the
 * permute's (only where R depends on the data: align_size > 1, capacity without
 * pad_to_capacity; as with C = 1) and the one read of every chunk's own and received counts,
 * which ncclSend / ncclRecv need on the host to size each chunk's transfers; both before the
 * first row moves. The backward reads nothing. */
static tm_status ep_alltoall_chunked(tm_moe *m, tm_tensor *x, tm_tensor *probs, tm_tensor *map, int64_t pad_to, int C,
                                     tm_tensor **y) {
    tm_ctx *ctx = m->ctx;
    const int P = m->P, L = m->L, E = P * L;
    const int64_t T = tm_tensor_dim(x, 0), CE = (int64_t)C * E;
    chunked k;
    TM__TRY(chunked_alloc(m, C, 0, &k));
    k.pad_to = pad_to;
    tm_tensor *mapc, *probc, *g3, *rflat, *both_t, *cw;
    TM__TRY(chunk_diag(ctx, map, C, &mapc));
    TM__TRY(chunk_diag(ctx, probs, C, &probc));
    tm_moe_dispatch d;
    int topk = m->cfg.capacity_factor > 0 ? 0 : m->cfg.router.topk;
    TM__TRY(tm_moe_permute_topk(ctx, x, mapc, probc, topk, m->cfg.align_size, pad_to, &d)); /* chunk-major */
    int64_t s3[3] = {C, P, L};
    TM__TRY(tm_reshape(ctx, d.tokens_per_expert, 3, s3, &g3));
    TM__TRY(exchange_chunk_counts(m, g3, C, L, &rflat)); /* [P, C, L]: from rank j, chunk c, expert l */
    /* the one read: own [C, P, L] and received [P, C, L] counts together */
    int64_t *all = tm__meta_alloc(ctx, sizeof(int64_t) * (size_t)(2 * CE));
    if (!all) return TM_ERR_NOMEM;
    const int64_t *own = tm__mirror_find(ctx, d.tokens_per_expert);
    if (own) {
        TM__TRY(tm_tensor_read(ctx, rflat, TM_I64, all + CE, CE));
        memcpy(all, own, sizeof(int64_t) * (size_t)CE);
    } else {
        tm_tensor *pair[2] = {d.tokens_per_expert, rflat};
        TM__TRY(tm_concat(ctx, 2, pair, 0, &both_t));
        TM__TRY(tm_tensor_read(ctx, both_t, TM_I64, all, 2 * CE));
    }
    own = all;
    const int64_t *rcv = all + CE;
    /* per chunk, uploaded in one piece (with host mirrors, so the regroupings and the grouped
     * GEMMs read nothing back): the received grid [P, L] (source-major), its transpose [L, P],
     * and the rows of each local expert [L] */
    const int64_t W = 2 * (int64_t)E + L, CW = C * W;
    int64_t *tab = tm__meta_alloc(ctx, sizeof(int64_t) * (size_t)(CW + 2 * P));
    if (!tab) return TM_ERR_NOMEM;
    int64_t *sendc = tab + CW, *recvc = sendc + P;
    k.off[0] = 0;
    for (int c = 0; c < C; c++) {
        int64_t *tc = tab + c * W, sent = 0;
        k.rrows[c] = 0;
        for (int l = 0; l < L; l++) tc[2 * E + l] = 0;
        for (int j = 0; j < P; j++) {
            sendc[j] = recvc[j] = 0;
            for (int l = 0; l < L; l++) {
                const int64_t o = own[((int64_t)c * P + j) * L + l], r = rcv[((int64_t)j * C + c) * L + l];
                sendc[j] += o;
                recvc[j] += r;
                tc[j * L + l] = r;
                tc[E + l * P + j] = r;
                tc[2 * E + l] += r;
            }
            sent += sendc[j];
            k.rrows[c] += recvc[j];
        }
        k.off[c + 1] = k.off[c] + sent;
        TM__TRY(i64_tensor(ctx, sendc, P, tm_cpu(), 0, &k.sc[c]));
        TM__TRY(i64_tensor(ctx, recvc, P, tm_cpu(), 0, &k.rc[c]));
    }
    tm_tensor *tabt;
    TM__TRY(i64_tensor(ctx, tab, CW, m->dev, 0, &tabt));
    for (int c = 0; c < C; c++) {
        const int64_t b = c * W;
        TM__TRY(tm_slice(ctx, tabt, 0, b, b + E, &k.rgrid[c]));
        TM__TRY(tm_slice(ctx, tabt, 0, b + E, b + 2 * E, &k.rgrid_t[c]));
        TM__TRY(tm_slice(ctx, tabt, 0, b + 2 * E, b + W, &k.lcount[c]));
        TM__TRY(tm__mirror_set(ctx, k.rgrid[c], tab + b));
        TM__TRY(tm__mirror_set(ctx, k.rgrid_t[c], tab + b + E));
        TM__TRY(tm__mirror_set(ctx, k.lcount[c], tab + b + 2 * E));
    }
    TM__TRY(weighted_rows(m, &d, &k.rows, &cw));
    return chunked_finish(&k, cw, d.row_token, T, y);
}

/* The deduplicated all-to-all (ep_dedup_experts) in C chunks. The rank permute covers every
 * chunk (rows (chunk, rank)-major); beside the rows sent per (chunk, rank), each rank sends
 * the routed count of every chunk for each of the receiver's experts (the column sums of the
 * chunked routing map), in the same one exchange; so each chunk's receiver permute knows its
 * rows per expert (tm__moe_permute_counted) and reads nothing. Host reads: the rank permute's
 * row count (R depends on the data) and the one read of every chunk's exchanged counts, both
 * before the first row moves: one per layer fewer than with C = 1, whose receiver permute
 * reads its counts after the rows arrived. The backward reads nothing. */
static tm_status ep_dedup_chunked(tm_moe *m, tm_tensor *x, tm_tensor *probs, tm_tensor *map, int64_t pad_to, int C,
                                  tm_tensor **y) {
    tm_ctx *ctx = m->ctx;
    const int P = m->P, L = m->L;
    const int64_t T = tm_tensor_dim(x, 0), CP = (int64_t)C * P;
    if ((double)T * P >= 16777216.0)
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "%s: the deduplicated all-to-all numbers the (token, rank) pairs in f32: %lld tokens x ep_size %d "
                       "is past 2^24; use fewer tokens per micro-batch or ep_strategy alltoall",
                       m->prefix, (long long)T, P);
    chunked k;
    TM__TRY(chunked_alloc(m, C, 1, &k));
    k.pad_to = pad_to;
    tm_dtype pdt = tm_tensor_dtype(probs);
    tm_tensor *mf, *m3, *per_rank, *rank_map, *p3, *tbl, *mfc, *ecnt;
    int64_t s3[3] = {T, P, L}, s2[2] = {T * P, 2 * (int64_t)L};
    TM__TRY(tm_cast(ctx, map, pdt, &mf));
    TM__TRY(tm_reshape(ctx, mf, 3, s3, &m3));
    TM__TRY(tm_sum(ctx, m3, 2, 0, &per_rank));
    TM__TRY(tm_cast(ctx, per_rank, TM_U8, &rank_map));
    TM__TRY(chunk_diag(ctx, rank_map, C, &rank_map)); /* [T, C P] */
    TM__TRY(tm_reshape(ctx, probs, 3, s3, &p3));
    tm_tensor *cat[2] = {p3, m3};
    TM__TRY(tm_concat(ctx, 2, cat, 2, &tbl));
    TM__TRY(tm_reshape(ctx, tbl, 2, s2, &tbl));
    /* the ids t P + j in the chunked layout, carried by the rank permute as its weights */
    float *idv = tm__meta_alloc(ctx, sizeof(float) * (size_t)(T * CP + 1));
    if (!idv) return TM_ERR_NOMEM;
    memset(idv, 0, sizeof(float) * (size_t)(T * CP));
    for (int c = 0; c < C; c++)
        for (int64_t t = chunk_lo(T, C, c); t < chunk_lo(T, C, c + 1); t++)
            for (int j = 0; j < P; j++) idv[t * CP + (int64_t)c * P + j] = (float)(t * P + j);
    int64_t sp[2] = {T, CP};
    tm_tensor *ids_tp, *ids;
    TM__TRY(tm_tensor_from_host(ctx, TM_F32, 2, sp, m->dev, TM_F32, idv, &ids_tp));
    tm_moe_dispatch d;
    TM__TRY(tm_moe_permute(ctx, x, rank_map, ids_tp, 1, 0, &d)); /* (chunk, rank)-major; its counts read */
    TM__TRY(tm_cast(ctx, d.permuted_probs, TM_I64, &ids));
    TM__TRY(tm__embedding_unique(ctx, tbl, ids, &k.tbl)); /* (Rs, 2L) */
    /* counts per (chunk, rank): [rows sent, routed count of each of the rank's L experts] */
    tm_tensor *g, *rflat, *parts[2];
    int64_t c1[3] = {C, P, 1}, cl[3] = {C, P, L};
    TM__TRY(chunk_diag(ctx, mf, C, &mfc));
    TM__TRY(tm_sum(ctx, mfc, 0, 0, &ecnt));          /* [C E], exact below 2^24 */
    TM__TRY(tm_cast(ctx, ecnt, TM_I64, &ecnt));
    TM__TRY(tm_reshape(ctx, d.tokens_per_expert, 3, c1, &parts[0]));
    TM__TRY(tm_reshape(ctx, ecnt, 3, cl, &parts[1]));
    TM__TRY(tm_concat(ctx, 2, parts, 2, &g)); /* [C, P, 1 + L] */
    TM__TRY(exchange_chunk_counts(m, g, C, 1 + L, &rflat));
    const int64_t K = 1 + L, nr = (int64_t)P * C * K;
    int64_t *rv = tm__meta_alloc(ctx, sizeof(int64_t) * (size_t)(nr + CP + 2 * P));
    if (!rv) return TM_ERR_NOMEM;
    int64_t *sendv = rv + nr, *sendc = sendv + CP, *recvc = sendc + P;
    const int64_t *own = tm__mirror_find(ctx, d.tokens_per_expert);
    if (!own) { /* not where the permute read them (it does); one read more, never wrong */
        TM__TRY(tm_tensor_read(ctx, d.tokens_per_expert, TM_I64, sendv, CP));
        own = sendv;
    }
    TM__TRY(tm_tensor_read(ctx, rflat, TM_I64, rv, nr)); /* the one read of every chunk's counts */
    const int64_t a = m->cfg.align_size;
    k.off[0] = 0;
    for (int c = 0; c < C; c++) {
        int64_t sent = 0, *lr = k.lrows + (int64_t)c * L;
        k.rrows[c] = 0;
        for (int l = 0; l < L; l++) lr[l] = 0;
        for (int j = 0; j < P; j++) {
            const int64_t *r = rv + ((int64_t)j * C + c) * K;
            sendc[j] = own[(int64_t)c * P + j];
            recvc[j] = r[0];
            sent += sendc[j];
            k.rrows[c] += r[0];
            for (int l = 0; l < L; l++) lr[l] += r[1 + l];
        }
        for (int l = 0; l < L; l++) /* tm__moe_permute_rows' padding */
            lr[l] = pad_to > 0 ? pad_to : lr[l] % a ? lr[l] + a - lr[l] % a : lr[l];
        k.off[c + 1] = k.off[c] + sent;
        TM__TRY(i64_tensor(ctx, sendc, P, tm_cpu(), 0, &k.sc[c]));
        TM__TRY(i64_tensor(ctx, recvc, P, tm_cpu(), 0, &k.rc[c]));
    }
    k.rows = d.permuted;
    return chunked_finish(&k, NULL, d.row_token, T, y); /* the partial sums add with weight 1 */
}

/* All-gather dispatch (MaxText's "ring of experts"): the ep group's tokens and router outputs
 * are all-gathered, each rank runs its L experts on all of them (its columns of probs and the
 * map), and the partial outputs are reduce-scattered back to the ranks the tokens came from.
 * With apply_topk_weights_early the rows of the local experts are scaled by their (gathered)
 * weights before the experts, and the partial combine sums with weight 1. */
static tm_status ep_allgather_experts(tm_moe *m, tm_tensor *x, tm_tensor *probs, tm_tensor *map, int64_t pad_to,
                                      tm_tensor **y) {
    tm_ctx *ctx = m->ctx;
    int P = m->P;
    tm_tensor *xg, *pg, *mg, *pl, *ml, *eo, *yl;
    TM__TRY(tm_comm_allgather(ctx, x, TM_COMM_EP, &xg));      // (Tep, H)
    TM__TRY(tm_comm_allgather(ctx, probs, TM_COMM_EP, &pg));  // (Tep, E)
    TM__TRY(tm_comm_allgather(ctx, map, TM_COMM_EP, &mg));    // (Tep, E) u8
    TM__TRY(tm_slice(ctx, pg, 1, m->e0, m->e0 + m->L, &pl));  // (Tep, L)
    TM__TRY(tm_slice(ctx, mg, 1, m->e0, m->e0 + m->L, &ml));
    TM__TRY(tm_contiguous(ctx, ml, &ml));
    tm_moe_dispatch d;
    tm_tensor *xe, *cw;
    TM__TRY(tm_moe_permute(ctx, xg, ml, pl, m->cfg.align_size, pad_to, &d));
    TM__TRY(weighted_rows(m, &d, &xe, &cw));
    TM__TRY(local_experts(m, xe, d.tokens_per_expert, &eo));
    int64_t Tep = tm_tensor_dim(xg, 0), T = tm_tensor_dim(x, 0);
    TM__TRY(tm_moe_unpermute(ctx, eo, cw, d.row_token, Tep, &yl)); // (Tep, H) partial
    if (Tep == T * P) return tm_comm_reduce_scatter(ctx, yl, TM_COMM_EP, y);
    /* ranks with different token counts: sum everything, keep this rank's rows */
    int64_t *rows = tm__meta_alloc(ctx, sizeof(int64_t) * (size_t)P), off = 0;
    if (!rows) return TM_ERR_NOMEM;
    TM__TRY(tm_comm_allgather_host(ctx, TM_COMM_EP, &T, rows, sizeof T));
    for (int j = 0; j < m->ep_rank; j++) off += rows[j];
    tm_tensor *sum;
    TM__TRY(tm_comm_allreduce(ctx, yl, TM_COMM_EP, &sum));
    return tm_slice(ctx, sum, 0, off, off + T, y);
}

static tm_status grouped_experts(tm_moe *m, tm_tensor *x, tm_tensor *probs, tm_tensor *map, int64_t capacity,
                                 tm_tensor **y) {
    tm_ctx *ctx = m->ctx;
    if (m->P > 1) {
        int64_t pad_to = m->cfg.pad_to_capacity ? capacity : 0;
        if (m->ep_strategy == TM_EP_ALLGATHER) return ep_allgather_experts(m, x, probs, map, pad_to, y);
        const int C = m->cfg.overlap_chunks;
        if (C > 1) {
            const int64_t T = tm_tensor_dim(x, 0);
            if (C > T)
                return BAD("%s: overlap_chunks = %d is more than the %lld tokens this rank's MoE layer gets (ep rank "
                           "%d of %d): lower overlap_chunks to at most the tokens per rank and micro-batch",
                           m->prefix, C, (long long)T, m->ep_rank, m->P);
            if (m->ep_strategy == TM_EP_ALLTOALL_DEDUP) return ep_dedup_chunked(m, x, probs, map, pad_to, C, y);
            return ep_alltoall_chunked(m, x, probs, map, pad_to, C, y);
        }
        if (m->ep_strategy == TM_EP_ALLTOALL_DEDUP) return ep_dedup_experts(m, x, probs, map, pad_to, y);
        return ep_alltoall_experts(m, x, probs, map, pad_to, y);
    }
    tm_moe_dispatch d;
    int64_t pad_to = m->cfg.pad_to_capacity ? capacity : 0;
    /* Without dropping, map is the router's: exactly topk experts per token, so with
     * align_size 1 the permute knows R = T * topk and reads nothing back. */
    int topk = m->cfg.capacity_factor > 0 ? 0 : m->cfg.router.topk;
    TM__TRY(tm_moe_permute_topk(ctx, x, map, probs, topk, m->cfg.align_size, pad_to, &d));
    /* The permute's tokens_per_expert, as they are: where the permute has them on the host
     * (it read them back, or pad_to each) their host mirror spares the grouped GEMMs, forward
     * and backward, a read back of the group sizes (framework/internal.h); otherwise they stay
     * on the device and a GEMM that needs them on the host reads them once. */
    tm_tensor *rows, *cw, *eo;
    TM__TRY(weighted_rows(m, &d, &rows, &cw));
    TM__TRY(tm_grouped_mlp(ctx, rows, m->w0, m->w1, m->wo, d.tokens_per_expert, &eo));
    return tm_moe_unpermute(ctx, eo, cw, d.row_token, tm_tensor_dim(x, 0), y);
}

/* stats->packed, i64 [E + TM__MOE_STAT_SLOTS]: counts [0, E), then dropped, aux, seq aux, z.
 * An absent loss stays 0. Filled by device-to-device copies: no kernel, no read. */
tm_status tm__stat_put(tm_ctx *ctx, tm_tensor *packed, int64_t slot, const tm_tensor *t) {
    if (!t) return TM_OK;
    if (!tm_tensor_is_contiguous(t) || tm_dtype_size(tm_tensor_dtype(t)) > sizeof(int64_t) || slot < 0 ||
        slot + tm_tensor_numel(t) > tm_tensor_numel(packed))
        return tm__err(ctx, TM_ERR_INTERNAL, "cannot pack statistic %s into slot %lld of %s", tm__tdesc(ctx, t),
                       (long long)slot, tm__tdesc(ctx, packed));
    return tm__copy_bytes(ctx, packed, (size_t)slot * sizeof(int64_t), t);
}

static tm_status pack_stats(tm_moe *m, tm_moe_stats *st) {
    tm_ctx *ctx = m->ctx;
    int64_t E = m->cfg.router.num_experts, n = E + TM__MOE_STAT_SLOTS;
    TM__TRY(tm_tensor_zeros(ctx, TM_I64, 1, &n, m->dev, &st->packed));
    TM__TRY(tm__stat_put(ctx, st->packed, 0, st->tokens_per_expert));
    TM__TRY(tm__stat_put(ctx, st->packed, E + TM__MOE_STAT_DROPPED, st->dropped));
    TM__TRY(tm__stat_put(ctx, st->packed, E + TM__MOE_STAT_AUX, st->aux_loss));
    TM__TRY(tm__stat_put(ctx, st->packed, E + TM__MOE_STAT_SEQ_AUX, st->seq_aux_loss));
    return tm__stat_put(ctx, st->packed, E + TM__MOE_STAT_Z, st->z_loss);
}

double tm__stat_value(const int64_t *slot, tm_dtype dt) {
    if (dt == TM_F64) {
        double v;
        memcpy(&v, slot, sizeof v);
        return v;
    }
    float f;
    memcpy(&f, slot, sizeof f);
    return f;
}

void tm__moe_stats_decode(const tm_moe *m, const int64_t *slots, tm_moe_stats *st) {
    int64_t E = m->cfg.router.num_experts;
    double mean = 0, mx = 0, mn = INFINITY;
    for (int64_t e = 0; e < E; e++) {
        mean += (double)slots[e] / (double)E;
        mx = fmax(mx, (double)slots[e]);
        mn = fmin(mn, (double)slots[e]);
    }
    st->max_load_ratio = mean > 0 ? mx / mean : 0;
    st->min_load_ratio = mean > 0 ? mn / mean : 0;
    st->dropped_tokens = slots[E + TM__MOE_STAT_DROPPED];
    st->aux_loss_value = tm__stat_value(slots + E + TM__MOE_STAT_AUX, m->gate_dtype);
    st->seq_aux_loss_value = tm__stat_value(slots + E + TM__MOE_STAT_SEQ_AUX, m->gate_dtype);
    st->z_loss_value = tm__stat_value(slots + E + TM__MOE_STAT_Z, m->gate_dtype);
}

tm_status tm_moe_stats_read(tm_moe *m, tm_moe_stats *stats) {
    if (!m) return TM_ERR_INVALID_ARG;
    tm_ctx *ctx = m->ctx;
    if (!stats) return BAD("tm_moe_stats_read: stats is NULL");
    int64_t E = m->cfg.router.num_experts, n = E + TM__MOE_STAT_SLOTS;
    const tm_tensor *p = stats->packed;
    if (!p) return BAD("tm_moe_stats_read: stats->packed is NULL (not filled by tm_moe_forward)");
    if (tm__tensor_ctx(p) != ctx || tm_tensor_dtype(p) != TM_I64 || tm_tensor_ndim(p) != 1 || tm_tensor_dim(p, 0) != n)
        return BAD("tm_moe_stats_read: stats->packed %s is not the i64 [%lld] of a forward of this block (E = %lld)",
                   tm__tdesc(ctx, p), (long long)n, (long long)E);
    int64_t *slots = tm__arena_alloc(ctx, tm_cpu(), sizeof(int64_t) * (size_t)n);
    if (!slots) return TM_ERR_NOMEM;
    TM__TRY(tm_tensor_read(ctx, p, TM_I64, slots, n));
    tm__moe_stats_decode(m, slots, stats);
    return TM_OK;
}

tm_status tm__moe_accumulate(tm_moe *m, tm_tensor *counts) { return tm_moe_accumulate_counts(m->ctx, m->tpe_sum, counts); }

tm_status tm__dp_rows_of(tm_ctx *ctx, int64_t T, tm__dp_rows *out) {
    out->G = tm_comm_size(ctx, TM_COMM_DP);
    out->T = T;
    out->off = 0;
    out->Tg = T;
    if (out->G == 1) return TM_OK;
    int64_t *all = tm__meta_alloc(ctx, sizeof(int64_t) * (size_t)out->G);
    if (!all) return TM_ERR_NOMEM;
    TM__TRY(tm_comm_allgather_host(ctx, TM_COMM_DP, &T, all, sizeof T));
    int me = tm_comm_rank(ctx, TM_COMM_DP);
    out->Tg = 0;
    for (int j = 0; j < out->G; j++) {
        if (j < me) out->off += all[j];
        out->Tg += all[j];
    }
    return TM_OK;
}

/* A per-token mean of this rank's rows becomes its share of the global batch's mean. */
static tm_status dp_share(tm_ctx *ctx, const tm__dp_rows *dp, tm_tensor **loss) {
    if (dp->G == 1 || !*loss) return TM_OK;
    return tm_scale(ctx, *loss, (double)dp->T / (double)dp->Tg, loss);
}

tm_status tm_moe_forward(tm_moe *m, tm_tensor *x, int64_t num_seqs, tm_tensor **y, tm_moe_stats *stats) {
    if (!m) return TM_ERR_INVALID_ARG;
    /* Only training forwards (grad mode on) feed the expert-bias update: evaluation and
     * sampling must not move the routing. */
    return tm__moe_forward(m, x, num_seqs, y, stats, tm__grad_enabled(m->ctx), NULL);
}

int tm__moe_weights(const tm_moe *m, tm_tensor **out) {
    tm_tensor *const w[] = {m->gate, m->w0, m->w1, m->wo, m->sw0, m->sw1, m->swo};
    int n = 0;
    for (size_t i = 0; i < sizeof w / sizeof *w; i++)
        if (w[i]) out[n++] = w[i];
    return n;
}

/* The dispatch's bytes per forward + backward of `tokens` rows under balanced routing (the
 * contract is at tm_model_plan_step). The router's weights and map values travel in f32. */
double tm__moe_plan_dispatch(const tm_moe *m, int64_t tokens) {
    if (m->P <= 1) return 0;
    const double T = (double)tokens, H = m->cfg.hidden_size, es = (double)tm_dtype_size(m->dtype), gs = 4, P = m->P,
                 E = m->cfg.router.num_experts, L = m->L;
    const int64_t k = m->cfg.router.topk;
    if (m->ep_strategy == TM_EP_ALLTOALL) return 2.0 * 2.0 * T * (double)k * (P - 1) / P * H * es;
    if (m->ep_strategy == TM_EP_ALLTOALL_DEDUP) {
        /* a token goes to each other rank holding one of its k experts (k of E drawn without
         * replacement: it misses a rank's L experts with probability C(E-L, k) / C(E, k)), with
         * its L weights and L map values for that rank; the partial rows come back */
        double miss = 1;
        for (int64_t i = 0; i < k; i++) miss *= (E - L - (double)i) / (E - (double)i);
        double rows = T * (P - 1) * (1 - (miss > 0 ? miss : 0));
        return 2.0 * rows * (2.0 * H * es + 2.0 * L * gs);
    }
    /* allgather: the tokens, router weights and map out, the P x tokens outputs reduce-scattered */
    return 2.0 * (T * H * es + T * E * (gs + 1) + P * T * H * es);
}

tm_status tm__moe_forward(tm_moe *m, tm_tensor *x, int64_t num_seqs, tm_tensor **y, tm_moe_stats *stats,
                          int accumulate, const tm__dp_rows *dp_given) {
    tm_ctx *ctx = m->ctx;
    if (!x || !y) return BAD("tm_moe_forward: %s is NULL", x ? "y" : "x");
    const tm_moe_config *cfg = &m->cfg;
    int64_t H = cfg->hidden_size, E = cfg->router.num_experts;
    int nd = tm_tensor_ndim(x);
    if (nd < 1 || tm_tensor_dim(x, -1) != H)
        return tm__err(ctx, TM_ERR_SHAPE, "tm_moe_forward: x %s must end in hidden_size = %lld", tm__tdesc(ctx, x), (long long)H);
    if (tm_tensor_dtype(x) != m->dtype)
        return tm__err(ctx, TM_ERR_DTYPE, "tm_moe_forward: x %s does not match the block's dtype %s", tm__tdesc(ctx, x),
                       tm_dtype_name(m->dtype));
    if (num_seqs < 1) return BAD("tm_moe_forward: num_seqs = %lld must be >= 1", (long long)num_seqs);
    int64_t T = tm_tensor_numel(x) / H, shape2[2] = {T, H};
    if (cfg->seq_aux_loss_coeff > 0 && T % num_seqs)
        return BAD("tm_moe_forward: %lld tokens do not split into num_seqs = %lld sequences", (long long)T, (long long)num_seqs);
    tm_tensor *x2, *logits;
    TM__TRY(tm_reshape(ctx, x, 2, shape2, &x2));
    /* ZeRO-3: the block's weights all-gathered for this forward (fsdp.c; the block itself
     * otherwise), given back at its end; the backward gathers them again. */
    tm_moe gathered = *m;
    tm_tensor **wts[] = {&gathered.gate, &gathered.w0, &gathered.w1, &gathered.wo,
                         &gathered.sw0, &gathered.sw1, &gathered.swo};
    for (size_t i = 0; i < sizeof wts / sizeof *wts; i++)
        if (*wts[i]) TM__TRY(tm__param_use(ctx, *wts[i], wts[i]));
    tm_moe *const W = &gathered;

    /* Gate in f32 whatever the activation dtype (router precision matters for selection);
     * tm_moe_gating widens bf16 x itself (on CUDA an f32 copy, kept for dw). */
    TM__TRY(tm_moe_gating(ctx, x2, W->gate, &logits));

    tm_router_out ro;
    TM__TRY(tm_moe_router(ctx, logits, m->expert_bias, &cfg->router, &ro));

    /* Data parallelism: this rank's T rows are rows [off, off + T) of the global batch of Tg. */
    tm__dp_rows dp;
    if (dp_given && dp_given->T == T)
        dp = *dp_given;
    else
        TM__TRY(tm__dp_rows_of(ctx, T, &dp));
    tm_tensor *routed = ro.tokens_per_expert; /* global counts under data parallelism */
    if (dp.G > 1) TM__TRY(tm_comm_allreduce(ctx, routed, TM_COMM_DP, &routed));

    tm_moe_stats st;
    memset(&st, 0, sizeof st);
    if (cfg->aux_loss_coeff > 0 || cfg->seq_aux_loss_coeff > 0) {
        tm_tensor *scores, *counts = routed, *map = ro.routing_map;
        TM__TRY(tm_moe_aux_scores(ctx, logits, cfg->router.score_function, &scores));
        if (cfg->aux_counts == TM_AUX_COUNTS_CLEAN) {
            /* Megatron: counts of a plain top-k of the aux scores (no groups, no bias). */
            TM__TRY(tm_moe_aux_counts(ctx, logits, cfg->router.topk, &map, &counts));
            if (dp.G > 1) TM__TRY(tm_comm_allreduce(ctx, counts, TM_COMM_DP, &counts));
        }
        /* With global counts and the global T, this rank's term is its share of the global
         * batch's loss (the sum over t splits over the ranks). */
        if (cfg->aux_loss_coeff > 0)
            TM__TRY(tm_moe_aux_loss(ctx, scores, counts, cfg->router.topk, cfg->aux_loss_coeff, dp.G > 1 ? dp.Tg : 0,
                                    &st.aux_loss));
        if (cfg->seq_aux_loss_coeff > 0) {
            TM__TRY(tm_moe_seq_aux_loss(ctx, scores, map, cfg->router.topk, cfg->seq_aux_loss_coeff, num_seqs, &st.seq_aux_loss));
            TM__TRY(dp_share(ctx, &dp, &st.seq_aux_loss));
        }
    }
    if (cfg->z_loss_coeff > 0) {
        TM__TRY(tm_moe_z_loss(ctx, logits, cfg->z_loss_coeff, &st.z_loss));
        TM__TRY(dp_share(ctx, &dp, &st.z_loss));
    }

    tm_tensor *probs = ro.probs, *map = ro.routing_map;
    st.tokens_per_expert = routed;
    int64_t capacity = 0;
    if (cfg->capacity_factor > 0) {
        /* The capacity of the global batch, decided over its tokens: every rank sees the
         * router outputs of all of them, drops as the single-process run would, and keeps its
         * own rows of the result. */
        capacity = tm_moe_capacity(dp.Tg, cfg->router.topk, (int)E, cfg->capacity_factor);
        tm_tensor *all_probs = ro.probs, *all_map = ro.routing_map;
        if (dp.G > 1) {
            TM__TRY(tm_comm_allgather(ctx, ro.probs, TM_COMM_DP, &all_probs));
            TM__TRY(tm_comm_allgather(ctx, ro.routing_map, TM_COMM_DP, &all_map));
        }
        tm_moe_drop_out d;
        TM__TRY(tm_moe_drop_tokens(ctx, all_probs, all_map, capacity, cfg->drop_policy, &d));
        probs = d.probs_kept;
        map = d.map_kept;
        if (dp.G > 1) {
            TM__TRY(tm_slice(ctx, probs, 0, dp.off, dp.off + T, &probs));
            TM__TRY(tm_slice(ctx, map, 0, dp.off, dp.off + T, &map));
        }
        st.tokens_per_expert = d.tokens_per_expert;
        st.dropped = d.dropped;
    }

    tm_tensor *out;
    if (cfg->strategy == TM_MOE_DENSE) TM__TRY(dense_experts(W, x2, probs, &out));
    else TM__TRY(grouped_experts(W, x2, probs, map, capacity, &out));
    if (cfg->shared_ffn_size) {
        tm_tensor *sh;
        TM__TRY(swiglu_ffn(ctx, x2, W->sw0, W->sw1, W->swo, &sh));
        TM__TRY(tm_add(ctx, out, sh, &out));
    }
    for (size_t i = 0; i < sizeof wts / sizeof *wts; i++) tm__param_done(ctx, *wts[i]);
    int64_t xshape[TM_MAX_DIMS];
    for (int i = 0; i < nd; i++) xshape[i] = tm_tensor_dim(x, i);
    TM__TRY(tm_reshape(ctx, out, nd, xshape, y));

    /* The running count for the expert-bias update, and the statistics, stay on the device. */
    if (accumulate) TM__TRY(tm__moe_accumulate(m, st.tokens_per_expert));
    if (stats) {
        TM__TRY(pack_stats(m, &st));
        *stats = st;
    }
    return TM_OK;
}

tm_status tm_moe_update_expert_bias(tm_moe *m) {
    if (!m) return TM_ERR_INVALID_ARG;
    if (m->cfg.use_expert_bias && m->cfg.expert_bias_update_rate > 0)
        TM__TRY(tm_moe_expert_bias_update(m->ctx, m->expert_bias, m->tpe_sum, m->cfg.expert_bias_update_rate));
    return tm_tensor_fill(m->ctx, m->tpe_sum, 0);
}
