/*
 * moe_dispatch.c — token dispatch of the MoE layer: expert capacity, token dropping, permute
 * (tokens -> expert-major rows) and unpermute (rows -> tokens, weighted): public entry points
 * and checks. Kernels and the exact input/attribute/output layouts: kernels/cpu/moe_dispatch.c.
 */
#include <math.h>
#include <stdint.h>

#include "internal.h"

/* Megatron apply_router_token_dropping calls get_capacity(num_tokens = T * k, E, factor), which
 * evaluates math.ceil((T * k / E) * factor) in doubles: the quotient is rounded first, then
 * multiplied, then ceiled. The same expression here gives the same integer also where the
 * rounding lands a hair above an integer (T*k = 50, E = 3, factor 0.9: 15.000000000000002 -> 16,
 * where the exact value is 15), so both sides agree on every capacity. Invalid arguments
 * (T < 0, k < 1, E < 1, factor not finite and > 0) or a capacity beyond int64 give -1. */
int64_t tm_moe_capacity(int64_t num_tokens, int topk, int num_experts, double capacity_factor) {
    if (num_tokens < 0 || topk < 1 || num_experts < 1 || !(capacity_factor > 0) || isinf(capacity_factor))
        return -1;
    if (num_tokens > INT64_MAX / topk) return -1;
    double cap = ceil((double)(num_tokens * topk) / (double)num_experts * capacity_factor);
    if (!(cap < 9.2e18)) return -1;
    return (int64_t)cap;
}

/* probs [T,E] float and routing_map u8 [T,E] of one shape (drop_tokens and permute). */
static tm_status check_probs_and_map(tm__call *c, int pi, int mi) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *p = c->in[pi], *m = c->in[mi];
    if (!tm__is_float(p->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "%s: probs must be f32, bf16 or f64, got %s", tm__opname(c), tm__tdesc(ctx, p));
    if (p->ndim != 2)
        return tm__err(ctx, TM_ERR_SHAPE, "%s: probs must be [T, E], got %s", tm__opname(c), tm__tdesc(ctx, p));
    if (m->dtype != TM_U8)
        return tm__err(ctx, TM_ERR_DTYPE, "%s: routing_map must be u8 (0/1), got %s", tm__opname(c), tm__tdesc(ctx, m));
    if (m->ndim != 2 || m->shape[0] != p->shape[0] || m->shape[1] != p->shape[1])
        return tm__err(ctx, TM_ERR_SHAPE, "%s: routing_map must be [T, E] like probs, got routing_map %s, probs %s",
                       tm__opname(c), tm__tdesc(ctx, m), tm__tdesc(ctx, p));
    return TM_OK;
}

/* ---- moe_drop_tokens ------------------------------------------------------------------- */

tm_status tm__moe_drop_tokens_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const int64_t capacity = c->iattr[0], policy = c->iattr[1];
    TM__TRY(check_probs_and_map(c, 0, 1));
    if (capacity < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_drop_tokens: capacity = %lld must be >= 0", (long long)capacity);
    if (policy != TM_DROP_PROBS && policy != TM_DROP_POSITION)
        return tm__err(ctx, TM_ERR_INVALID_ARG,
                       "moe_drop_tokens: policy = %lld is not TM_DROP_PROBS (0) or TM_DROP_POSITION (1)",
                       (long long)policy);
    const tm_tensor *p = c->in[0];
    TM__TRY(tm__out_new(c, 0, p->dtype, 2, p->shape));
    TM__TRY(tm__out_new(c, 1, TM_U8, 2, p->shape));
    TM__TRY(tm__out_new(c, 2, TM_I64, 0, NULL));
    return tm__out_new(c, 3, TM_I64, 1, &p->shape[1]);
}

tm_status tm_moe_drop_tokens(tm_ctx *ctx, tm_tensor *probs, tm_tensor *routing_map, int64_t capacity,
                             tm_drop_policy policy, tm_moe_drop_out *out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_drop_tokens: out is NULL");
    memset(out, 0, sizeof *out);
    tm__call c = tm__call_init(ctx, TM__OP_MOE_DROP_TOKENS);
    c.n_in = 2;
    c.in[0] = probs;
    c.in[1] = routing_map;
    c.iattr[0] = capacity;
    c.iattr[1] = (int64_t)policy;
    TM__TRY(tm__op_run(&c));
    out->probs_kept = c.out[0];
    out->map_kept = c.out[1];
    out->dropped = c.out[2];
    out->tokens_per_expert = c.out[3];
    return TM_OK;
}

/* ---- moe_permute ----------------------------------------------------------------------- */

/* The row count R may depend on routing_map's values, so permuted, permuted_probs and row_token
 * are allocated by the forward kernel; only tokens_per_expert [E] is known here. */
tm_status tm__moe_permute_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0], *m = c->in[1];
    const int64_t align = c->iattr[0], pad_to = c->iattr[1], topk = c->iattr[2];
    if (!tm__is_float(x->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "moe_permute: x must be f32, bf16 or f64, got %s", tm__tdesc(ctx, x));
    if (x->ndim != 2)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_permute: x must be [T, H], got %s", tm__tdesc(ctx, x));
    TM__TRY(check_probs_and_map(c, 2, 1));
    if (m->shape[0] != x->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "moe_permute: routing_map must have one row per token of x, got x %s, routing_map %s",
                       tm__tdesc(ctx, x), tm__tdesc(ctx, m));
    if (align < 1)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_permute: align_size = %lld must be >= 1", (long long)align);
    if (pad_to < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_permute: pad_to = %lld must be >= 0 (0: no padding to a fixed size)",
                       (long long)pad_to);
    if (topk < 0 || topk > m->shape[1])
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_permute: topk = %lld must be in [0, E = %lld] (0: not known), routing_map %s",
                       (long long)topk, (long long)m->shape[1], tm__tdesc(ctx, m));
    return tm__out_new(c, 3, TM_I64, 1, &m->shape[1]);
}

tm_status tm__moe_permute_rows(tm__call *c, const int64_t *count, int64_t *rows, int64_t *R_out) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0];
    const int64_t H = x->shape[1], E = c->in[1]->shape[1], align = c->iattr[0], pad_to = c->iattr[1];
    /* R * H elements must stay addressable (a huge align_size or pad_to is the only way out). */
    const int64_t max_rows = INT64_MAX / (int64_t)tm_dtype_size(x->dtype) / (H > 0 ? H : 1);
    int64_t R = 0;
    for (int64_t e = 0; e < E; e++) {
        if (pad_to > 0 && count[e] > pad_to)
            return tm__err(ctx, TM_ERR_INVALID_ARG,
                           "moe_permute: expert %lld has %lld routed tokens, more than pad_to = %lld "
                           "(drop tokens to a capacity <= pad_to first)",
                           (long long)e, (long long)count[e], (long long)pad_to);
        int64_t rem = count[e] % align, pad = pad_to > 0 ? pad_to - count[e] : rem ? align - rem : 0;
        if (pad > max_rows - count[e] || count[e] + pad > max_rows - R)
            return tm__err(ctx, TM_ERR_INVALID_ARG,
                           "moe_permute: padding expert %lld to align_size = %lld / pad_to = %lld makes more than "
                           "%lld rows of %lld elements",
                           (long long)e, (long long)align, (long long)pad_to, (long long)max_rows, (long long)H);
        rows[e] = count[e] + pad;
        R += rows[e];
    }
    *R_out = R;
    return TM_OK;
}

tm_status tm__moe_permute_fixed_rows(tm__call *c, int *known, int64_t *R_out) {
    tm_ctx *ctx = c->ctx;
    const tm_tensor *x = c->in[0];
    const int64_t T = x->shape[0], H = x->shape[1], E = c->in[1]->shape[1];
    const int64_t align = c->iattr[0], pad_to = c->iattr[1], topk = c->iattr[2];
    *known = 0;
    *R_out = 0;
    if (pad_to > 0) {
        /* Every expert is exactly pad_to rows whatever it holds: tm__moe_permute_rows on empty
         * experts gives that R with the same overflow errors. */
        int64_t *zero = tm__arena_alloc(ctx, tm_cpu(), (size_t)(2 * E + 1) * sizeof *zero);
        if (!zero) return TM_ERR_NOMEM;
        memset(zero, 0, (size_t)E * sizeof *zero);
        TM__TRY(tm__moe_permute_rows(c, zero, zero + E, R_out));
        *known = 1;
    } else if (topk > 0 && align == 1) {
        const int64_t max_rows = INT64_MAX / (int64_t)tm_dtype_size(x->dtype) / (H > 0 ? H : 1);
        if (T > max_rows / topk)
            return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_permute: T * topk = %lld * %lld rows of %lld elements overflow",
                           (long long)T, (long long)topk, (long long)H);
        *R_out = T * topk;
        *known = 1;
    } else if (c->iattr[3] > 0) {
        /* tm__moe_permute_counted: the caller knows the counts (R + 1 here). */
        *R_out = c->iattr[3] - 1;
        *known = 1;
    }
    return TM_OK;
}

/* counted: 0, or R + 1 where the caller knows the R rows (iattr[3]: tm__moe_permute_counted) */
static tm_status permute_run(tm_ctx *ctx, tm_tensor *x, tm_tensor *routing_map, tm_tensor *probs, int64_t topk,
                             int64_t align_size, int64_t pad_to, int64_t counted, tm_moe_dispatch *out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out) return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_permute: out is NULL");
    tm__call c = tm__call_init(ctx, TM__OP_MOE_PERMUTE);
    c.n_in = 3;
    c.in[0] = x;
    c.in[1] = routing_map;
    c.in[2] = probs;
    c.iattr[0] = align_size;
    c.iattr[1] = pad_to;
    c.iattr[2] = topk;
    c.iattr[3] = counted;
    TM__TRY(tm__op_run(&c));
    out->permuted = c.out[0];
    out->permuted_probs = c.out[1];
    out->row_token = c.out[2];
    out->tokens_per_expert = c.out[3];
    out->num_rows = c.out[0]->shape[0];
    return TM_OK;
}

tm_status tm_moe_permute(tm_ctx *ctx, tm_tensor *x, tm_tensor *routing_map, tm_tensor *probs, int64_t align_size,
                         int64_t pad_to, tm_moe_dispatch *out) {
    return permute_run(ctx, x, routing_map, probs, 0, align_size, pad_to, 0, out);
}

tm_status tm_moe_permute_topk(tm_ctx *ctx, tm_tensor *x, tm_tensor *routing_map, tm_tensor *probs, int topk,
                              int64_t align_size, int64_t pad_to, tm_moe_dispatch *out) {
    return permute_run(ctx, x, routing_map, probs, topk, align_size, pad_to, 0, out);
}

tm_status tm__moe_permute_counted(tm_ctx *ctx, tm_tensor *x, tm_tensor *routing_map, tm_tensor *probs,
                                  int64_t align_size, int64_t pad_to, const int64_t *rows, tm_moe_dispatch *out) {
    if (!ctx) return TM_ERR_INVALID_ARG;
    if (!out || !rows || !routing_map || routing_map->ndim != 2)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_permute (counted): %s", !out ? "out is NULL" : !rows ? "rows is NULL"
                                                                           : "routing_map must be [T, E]");
    const int64_t E = routing_map->shape[1];
    int64_t R = 0;
    for (int64_t e = 0; e < E; e++) {
        if (rows[e] < 0 || rows[e] > INT64_MAX - 1 - R)
            return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_permute (counted): rows[%lld] = %lld is negative or overflows R",
                           (long long)e, (long long)rows[e]);
        R += rows[e];
    }
    TM__TRY(permute_run(ctx, x, routing_map, probs, 0, align_size, pad_to, R + 1, out));
    const tm_tensor *tpe = out->tokens_per_expert;
    /* The CPU holds the counts it computed: they must be the caller's (the mirror's invariant). */
    if (tpe->device.type == TM_DEVICE_CPU)
        for (int64_t e = 0; e < E; e++)
            if (tm__idx(tpe, e) != rows[e])
                return tm__err(ctx, TM_ERR_INVALID_ARG,
                               "moe_permute (counted): expert %lld has %lld rows (padded to align_size = %lld / pad_to = "
                               "%lld), the caller's counts say %lld (routing_map %s)",
                               (long long)e, (long long)tm__idx(tpe, e), (long long)align_size, (long long)pad_to,
                               (long long)rows[e], tm__tdesc(ctx, routing_map));
    TM__TRY(tm__mirror_set(ctx, tpe, rows));
    return TM_OK;
}

/* ---- moe_unpermute --------------------------------------------------------------------- */

/* The dtype a CPU kernel computes a float tensor in (bf16 is staged through f32). */
static tm_dtype compute_dtype(tm_dtype dt) { return dt == TM_BF16 ? TM_F32 : dt; }

tm_status tm__moe_unpermute_check(tm__call *c) {
    tm_ctx *ctx = c->ctx;
    if (c->n_in != 2 && c->n_in != 3)
        return tm__err(ctx, TM_ERR_INTERNAL, "moe_unpermute: %d inputs, expected expert_out, row_token and optional permuted_probs",
                       c->n_in);
    const tm_tensor *eo = c->in[0], *rt = c->in[1];
    const int64_t num_tokens = c->iattr[0];
    if (!tm__is_float(eo->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "moe_unpermute: expert_out must be f32, bf16 or f64, got %s", tm__tdesc(ctx, eo));
    if (eo->ndim != 2)
        return tm__err(ctx, TM_ERR_SHAPE, "moe_unpermute: expert_out must be [R, H], got %s", tm__tdesc(ctx, eo));
    if (!tm__is_index(rt->dtype))
        return tm__err(ctx, TM_ERR_DTYPE, "moe_unpermute: row_token must be i64 (or i32), got %s", tm__tdesc(ctx, rt));
    if (rt->ndim != 1 || rt->shape[0] != eo->shape[0])
        return tm__err(ctx, TM_ERR_SHAPE, "moe_unpermute: row_token must be [R] with R = rows of expert_out, got row_token %s, expert_out %s",
                       tm__tdesc(ctx, rt), tm__tdesc(ctx, eo));
    if (c->n_in == 3) {
        const tm_tensor *p = c->in[2];
        if (!tm__is_float(p->dtype) || compute_dtype(p->dtype) != compute_dtype(eo->dtype))
            return tm__err(ctx, TM_ERR_DTYPE, "moe_unpermute: permuted_probs must be %s (like expert_out %s), got %s",
                           eo->dtype == TM_F64 ? "f64" : "f32 or bf16", tm__tdesc(ctx, eo), tm__tdesc(ctx, p));
        if (p->ndim != 1 || p->shape[0] != eo->shape[0])
            return tm__err(ctx, TM_ERR_SHAPE, "moe_unpermute: permuted_probs must be [R] with R = rows of expert_out, got permuted_probs %s, expert_out %s",
                           tm__tdesc(ctx, p), tm__tdesc(ctx, eo));
    }
    if (num_tokens < 0)
        return tm__err(ctx, TM_ERR_INVALID_ARG, "moe_unpermute: num_tokens = %lld must be >= 0", (long long)num_tokens);
    int64_t shape[2] = {num_tokens, eo->shape[1]};
    return tm__out_new(c, 0, eo->dtype, 2, shape);
}

tm_status tm_moe_unpermute(tm_ctx *ctx, tm_tensor *expert_out, tm_tensor *permuted_probs, tm_tensor *row_token,
                           int64_t num_tokens, tm_tensor **out) {
    tm__call c = tm__call_init(ctx, TM__OP_MOE_UNPERMUTE);
    c.n_in = permuted_probs ? 3 : 2;
    c.in[0] = expert_out;
    c.in[1] = row_token;
    c.in[2] = permuted_probs;
    c.iattr[0] = num_tokens;
    return tm__op_run1(&c, out);
}
