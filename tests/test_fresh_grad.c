/*
 * test_fresh_grad.c — fresh gradients (call->gin_fresh, TM__OP_GRAD_WRITES, framework/autograd.c):
 * an op that is the first contributor to a temporary's gradient writes it instead of adding
 * into a zero-filled buffer. For every converted op (swiglu, matmul, grouped_matmul,
 * moe_unpermute, add, sub, mul, scale, silu, scale_rows, rmsnorm, add_rmsnorm, rope,
 * cross_entropy, moe_permute, attention, softmax, log_softmax, contiguous, cast, concat,
 * moe_sort_chunks; add, sub and mul with a broadcast operand, whose gradient is a sum over rows):
 *   - the gradient written fresh equals, bit for bit, the one accumulated into zeros (the
 *     input's gradient made to exist first by an earlier backward of 0 * x), in f32, f64 and
 *     bf16 (the CPU's f32 staging of bf16 calls);
 *   - every element is written: fresh buffers are filled with NaN first (test hook);
 *   - one tensor feeding two consumers (the first to run writes, the second adds) and an op
 *     whose two inputs are one tensor (x x^T, swiglu(x, x), x + x, x * x, add_rmsnorm(x, x, w),
 *     attention(q, k, k): not fresh) match finite differences;
 *   - the fresh path ran (tm__test_fresh_count), and it does not run for parameters;
 *   - a deliberately wrong autograd (every gradient of such an op marked fresh, even one with
 *     earlier contributions: tm__test_fresh_hooks force) fails the two-consumer check.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"

enum {
    OP_SWIGLU, OP_MATMUL, OP_GMM, OP_UNPERMUTE, OP_ADD, OP_SUB, OP_MUL, OP_SCALE, OP_SILU, OP_SCALE_ROWS,
    OP_RMSNORM, OP_ADD_RMSNORM, OP_ROPE, OP_CE, OP_PERMUTE, OP_ATTENTION, OP_SOFTMAX, OP_LOG_SOFTMAX,
    OP_CONTIGUOUS, OP_CAST, OP_CONCAT, OP_SORT_CHUNKS
};

/* moe_sort_chunks: 7 rows in a [2, 3] grid of chunks, one of them empty */
static const double sort_sizes[6] = {2, 0, 1, 1, 2, 1};

/* moe_permute's routing map, 4 tokens x 3 experts: token 2 routed nowhere (its dx row is
 * written as zeros when fresh), unrouted (t, e) get d probs 0; align_size 2 pads expert 1 */
static const double perm_map[12] = {1, 0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 0};

/* cross_entropy's targets: row 1 ignored (its dlogits row is written as zeros when fresh) */
static const double ce_targets[4] = {1, -100, 4, 0};

static const int64_t gmm_counts[3] = {2, 0, 3}; /* an empty group in the middle */
/* moe_unpermute: 6 rows of 3 tokens, two padding rows (-1) */
static const double unp_rows[6] = {2, -1, 0, 1, -1, 2};

/* Inputs of op `op` in dtype dt: swiglu (g [3,5], u [3,5]); matmul (a [4,3], b [3,5]);
 * grouped_matmul (x [5,3], w [3,3,4], counts); moe_unpermute (expert_out [6,4], probs [6],
 * row_token [6], 3 tokens); add (a [3,5], b [3,5]); sub (a [5] broadcast, b [3,5]); mul
 * (a [3,5], b [5] broadcast); scale, silu (x [3,5]); scale_rows (x [4,3], w [4]); rmsnorm
 * (x [3,8], w [8]); add_rmsnorm (x [3,8], y [3,8], w [8]); rope (x [1,3,2,4]); cross_entropy
 * (logits [4,5], targets); moe_permute (x [4,6], probs [4,3], routing map [4,3]); attention
 * (q [2,3,4,4], k, v [2,5,2,4]); softmax, log_softmax (x [3,5]); contiguous of a transposed view
 * [4,3,2] and a cast there and back (x [2,3,4]); concat along columns (a [3,2], b [3,4]); moe_sort_chunks (x [7,3] in
 * 2 x 3 chunks). Returns how many (the first ones) take a gradient. */
static int make_inputs(tm_ctx *ctx, int op, tm_dtype dt, tm_tensor **in) {
    int64_t s35[2] = {3, 5}, s5 = 5, s38[2] = {3, 8}, s8 = 8;
    switch (op) {
    case OP_ADD: in[0] = tt_randn(ctx, dt, 2, s35, 61), in[1] = tt_randn(ctx, dt, 2, s35, 62); return 2;
    case OP_SUB: in[0] = tt_randn(ctx, dt, 1, &s5, 63), in[1] = tt_randn(ctx, dt, 2, s35, 64); return 2;
    case OP_MUL: in[0] = tt_randn(ctx, dt, 2, s35, 65), in[1] = tt_randn(ctx, dt, 1, &s5, 66); return 2;
    case OP_SCALE: in[0] = tt_randn(ctx, dt, 2, s35, 67); return 1;
    case OP_SILU: in[0] = tt_randu(ctx, dt, 2, s35, 68, -4.0, 4.0); return 1;
    case OP_SCALE_ROWS: {
        int64_t sx[2] = {4, 3}, R = 4;
        in[0] = tt_randn(ctx, dt, 2, sx, 69), in[1] = tt_randn(ctx, dt, 1, &R, 70);
        return 2;
    }
    case OP_RMSNORM: in[0] = tt_randn(ctx, dt, 2, s38, 71), in[1] = tt_randn(ctx, dt, 1, &s8, 72); return 2;
    case OP_ADD_RMSNORM:
        in[0] = tt_randn(ctx, dt, 2, s38, 73), in[1] = tt_randn(ctx, dt, 2, s38, 74), in[2] = tt_randn(ctx, dt, 1, &s8, 75);
        return 3;
    case OP_ROPE: {
        int64_t sx[4] = {1, 3, 2, 4};
        in[0] = tt_randn(ctx, dt, 4, sx, 76);
        return 1;
    }
    case OP_PERMUTE: {
        int64_t sx[2] = {4, 6}, sm[2] = {4, 3};
        in[0] = tt_randn(ctx, dt, 2, sx, 78), in[1] = tt_randn(ctx, dt, 2, sm, 79), in[2] = tt_from(ctx, TM_U8, 2, sm, perm_map);
        return 2;
    }
    case OP_ATTENTION: {
        /* grouped-query heads (4 query heads on 2 kv heads), Tk > Tq (the causal offset) */
        int64_t sq[4] = {2, 3, 4, 4}, skv[4] = {2, 5, 2, 4};
        in[0] = tt_randn(ctx, dt, 4, sq, 96), in[1] = tt_randn(ctx, dt, 4, skv, 97), in[2] = tt_randn(ctx, dt, 4, skv, 98);
        return 3;
    }
    case OP_SOFTMAX: case OP_LOG_SOFTMAX: in[0] = tt_randn(ctx, dt, 2, s35, 104); return 1;
    case OP_CONTIGUOUS: { /* a transposed view as the leaf: contiguous copies strided data */
        int64_t sx[3] = {2, 3, 4};
        TT_OK(ctx, tm_transpose(ctx, tt_randn(ctx, dt, 3, sx, 105), 0, 2, &in[0]));
        return 1;
    }
    case OP_CAST: {
        int64_t sx[3] = {2, 3, 4};
        in[0] = tt_randn(ctx, dt, 3, sx, 105);
        return 1;
    }
    case OP_CONCAT: {
        int64_t sa[2] = {3, 2}, sb[2] = {3, 4};
        in[0] = tt_randn(ctx, dt, 2, sa, 106), in[1] = tt_randn(ctx, dt, 2, sb, 107);
        return 2;
    }
    case OP_SORT_CHUNKS: {
        int64_t sx[2] = {7, 3}, n = 6;
        in[0] = tt_randn(ctx, dt, 2, sx, 109), in[1] = tt_from(ctx, TM_I64, 1, &n, sort_sizes);
        return 1;
    }
    case OP_CE: {
        int64_t sl[2] = {4, 5}, N = 4;
        in[0] = tt_randn(ctx, dt, 2, sl, 77), in[1] = tt_from(ctx, TM_I64, 1, &N, ce_targets);
        return 1;
    }
    default: break;
    }
    if (op == OP_SWIGLU) {
        int64_t s[2] = {3, 5};
        in[0] = tt_randu(ctx, dt, 2, s, 11, -4.0, 4.0), in[1] = tt_randn(ctx, dt, 2, s, 12);
        return 2;
    }
    if (op == OP_MATMUL) {
        int64_t sa[2] = {4, 3}, sb[2] = {3, 5};
        in[0] = tt_randn(ctx, dt, 2, sa, 13), in[1] = tt_randn(ctx, dt, 2, sb, 14);
        return 2;
    }
    if (op == OP_UNPERMUTE) {
        int64_t se[2] = {6, 4}, R = 6;
        in[0] = tt_randn(ctx, dt, 2, se, 17), in[1] = tt_randn(ctx, dt, 1, &R, 18), in[2] = tt_from(ctx, TM_I64, 1, &R, unp_rows);
        return 2;
    }
    int64_t sx[2] = {5, 3}, sw[3] = {3, 3, 4}, G = 3;
    double cv[3] = {(double)gmm_counts[0], (double)gmm_counts[1], (double)gmm_counts[2]};
    in[0] = tt_randn(ctx, dt, 2, sx, 15), in[1] = tt_randn(ctx, dt, 3, sw, 16), in[2] = tt_from(ctx, TM_I64, 1, &G, cv);
    return 2;
}

static tm_status run_op(tm_ctx *ctx, int op, tm_tensor **in, tm_tensor **out) {
    switch (op) {
    case OP_ADD: return tm_add(ctx, in[0], in[1], out);
    case OP_SUB: return tm_sub(ctx, in[0], in[1], out);
    case OP_MUL: return tm_mul(ctx, in[0], in[1], out);
    case OP_SCALE: return tm_scale(ctx, in[0], -1.75, out);
    case OP_SILU: return tm_silu(ctx, in[0], out);
    case OP_SCALE_ROWS: return tm_scale_rows(ctx, in[0], in[1], out);
    case OP_RMSNORM: return tm_rmsnorm(ctx, in[0], in[1], 1e-5, out);
    case OP_ADD_RMSNORM: {
        /* both outputs carry gradient: the sum's and the norm's (their add writes them fresh) */
        tm_tensor *sum, *h;
        TM__TRY(tm_add_rmsnorm(ctx, in[0], in[1], in[2], 1e-5, &sum, &h));
        return tm_add(ctx, sum, h, out);
    }
    case OP_ROPE: return tm_rope(ctx, in[0], 2, 10000.0, out);
    case OP_CE: return tm_cross_entropy(ctx, in[0], in[1], -100, out);
    case OP_ATTENTION: return tm_attention(ctx, in[0], in[1], in[2], 0.0, out);
    case OP_SOFTMAX: return tm_softmax(ctx, in[0], out);
    case OP_LOG_SOFTMAX: return tm_log_softmax(ctx, in[0], out);
    case OP_CONTIGUOUS: return tm_contiguous(ctx, in[0], out);
    case OP_CAST: { /* to the other float dtype and back: the backward converts twice */
        tm_dtype dt = tm_tensor_dtype(in[0]), other = dt == TM_F32 ? TM_BF16 : TM_F32;
        tm_tensor *t;
        TM__TRY(tm_cast(ctx, in[0], other, &t));
        return tm_cast(ctx, t, dt, out);
    }
    case OP_CONCAT: return tm_concat(ctx, 2, in, 1, out); /* columns: each part a strided view */
    case OP_SORT_CHUNKS: return tm_moe_sort_chunks(ctx, in[0], in[1], 2, out);
    case OP_PERMUTE: {
        /* rows times their probabilities: both outputs carry gradient (scale_rows writes them
         * fresh either way) */
        tm_moe_dispatch d;
        TM__TRY(tm_moe_permute(ctx, in[0], in[2], in[1], 2, 0, &d));
        return tm_scale_rows(ctx, d.permuted, d.permuted_probs, out);
    }
    default: break;
    }
    if (op == OP_SWIGLU) return tm_swiglu(ctx, in[0], in[1], out);
    if (op == OP_MATMUL) return tm_matmul(ctx, in[0], in[1], 0, 0, out);
    if (op == OP_UNPERMUTE) return tm_moe_unpermute(ctx, in[0], in[1], in[2], 3, out);
    return tm_grouped_matmul(ctx, in[0], in[1], in[2], out);
}

/* The gradients of the op's inputs for upstream dy (seed 21), host f64 (bit-exact images of
 * f32 / bf16 values). pre: make every input's gradient exist first (zeros from a backward of
 * 0 * x), so that the op accumulates; otherwise the op gets fresh gradients. */
static int grads(int op, tm_dtype dt, int pre, double **g, int64_t *n, int64_t *fresh) {
    tm_ctx *ctx = tt_ctx();
    tm__test_fresh_hooks(ctx, 1, 0); /* an element left unwritten reads NaN */
    tm_tensor *in[3];
    int k = make_inputs(ctx, op, dt, in);
    for (int i = 0; i < k; i++) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, in[i], 1));
    if (pre) {
        for (int i = 0; i < k; i++) {
            tm_tensor *z, *one;
            TT_OK(ctx, tm_scale(ctx, in[i], 0.0, &z));
            TT_OK(ctx, tm_tensor_empty(ctx, dt, z->ndim, z->shape, tm_cpu(), &one));
            TT_OK(ctx, tm_tensor_fill(ctx, one, 1.0));
            TT_OK(ctx, tm_backward_with_grad(ctx, z, one));
            cr_assert_not_null(tm_tensor_grad(in[i]));
        }
    }
    int64_t before = tm__test_fresh_count(ctx);
    tm_tensor *y;
    TT_OK(ctx, run_op(ctx, op, in, &y));
    tm_tensor *dy = tt_randn(ctx, dt, y->ndim, y->shape, 21);
    TT_OK(ctx, tm_backward_with_grad(ctx, y, dy));
    *fresh = tm__test_fresh_count(ctx) - before;
    for (int i = 0; i < k; i++) {
        g[i] = tt_read(ctx, tm_tensor_grad(in[i]));
        n[i] = tm_tensor_numel(in[i]);
    }
    tm_ctx_free(ctx);
    return k;
}

static void check_fresh_equals_accumulate(int op, tm_dtype dt) {
    double *gf[3], *ga[3];
    int64_t nf[3], na[3], cf, ca;
    int k = grads(op, dt, 0, gf, nf, &cf);
    grads(op, dt, 1, ga, na, &ca);
    /* add_rmsnorm's and moe_permute's cases combine their two outputs: that op writes their
     * gradients fresh either way; cast's case casts twice, the second writes the first's */
    int64_t inner = op == OP_ADD_RMSNORM || op == OP_PERMUTE ? 2 : op == OP_CAST ? 1 : 0;
    cr_assert_eq(cf, k + inner, "op %d: %lld fresh gradients handed out, want %lld", op, (long long)cf,
                 (long long)(k + inner));
    cr_assert_eq(ca, inner, "op %d: an input with a gradient got a fresh one (%lld)", op, (long long)(ca - inner));
    for (int i = 0; i < k; i++) {
        cr_assert_eq(nf[i], na[i]);
        for (int64_t e = 0; e < nf[i]; e++) {
            cr_assert(!isnan(gf[i][e]), "op %d input %d element %lld left unwritten (NaN poison)", op, i, (long long)e);
            cr_assert(memcmp(&gf[i][e], &ga[i][e], sizeof(double)) == 0,
                      "op %d dtype %s input %d element %lld: fresh %a, accumulated %a", op, tm_dtype_name(dt), i,
                      (long long)e, gf[i][e], ga[i][e]);
        }
        free(gf[i]), free(ga[i]);
    }
}

Test(fresh_grad, swiglu_bits) {
    check_fresh_equals_accumulate(OP_SWIGLU, TM_F32);
    check_fresh_equals_accumulate(OP_SWIGLU, TM_F64);
    check_fresh_equals_accumulate(OP_SWIGLU, TM_BF16);
}
Test(fresh_grad, matmul_bits) {
    check_fresh_equals_accumulate(OP_MATMUL, TM_F32);
    check_fresh_equals_accumulate(OP_MATMUL, TM_F64);
    check_fresh_equals_accumulate(OP_MATMUL, TM_BF16);
}
Test(fresh_grad, moe_unpermute_bits) {
    check_fresh_equals_accumulate(OP_UNPERMUTE, TM_F32);
    check_fresh_equals_accumulate(OP_UNPERMUTE, TM_F64);
    check_fresh_equals_accumulate(OP_UNPERMUTE, TM_BF16);
}
Test(fresh_grad, grouped_matmul_bits) {
    check_fresh_equals_accumulate(OP_GMM, TM_F32);
    check_fresh_equals_accumulate(OP_GMM, TM_F64);
    check_fresh_equals_accumulate(OP_GMM, TM_BF16);
}
static void check_all_dtypes(int op) {
    check_fresh_equals_accumulate(op, TM_F32);
    check_fresh_equals_accumulate(op, TM_F64);
    check_fresh_equals_accumulate(op, TM_BF16);
}
Test(fresh_grad, add_bits) { check_all_dtypes(OP_ADD); }
Test(fresh_grad, sub_broadcast_bits) { check_all_dtypes(OP_SUB); }
Test(fresh_grad, mul_broadcast_bits) { check_all_dtypes(OP_MUL); }
Test(fresh_grad, scale_bits) { check_all_dtypes(OP_SCALE); }
Test(fresh_grad, silu_bits) { check_all_dtypes(OP_SILU); }
Test(fresh_grad, scale_rows_bits) { check_all_dtypes(OP_SCALE_ROWS); }
Test(fresh_grad, rmsnorm_bits) { check_all_dtypes(OP_RMSNORM); }
Test(fresh_grad, add_rmsnorm_bits) { check_all_dtypes(OP_ADD_RMSNORM); }
Test(fresh_grad, rope_bits) { check_all_dtypes(OP_ROPE); }
Test(fresh_grad, cross_entropy_bits) { check_all_dtypes(OP_CE); }
Test(fresh_grad, moe_permute_bits) { check_all_dtypes(OP_PERMUTE); }
Test(fresh_grad, attention_bits) { check_all_dtypes(OP_ATTENTION); }
Test(fresh_grad, softmax_bits) { check_all_dtypes(OP_SOFTMAX); }
Test(fresh_grad, log_softmax_bits) { check_all_dtypes(OP_LOG_SOFTMAX); }
Test(fresh_grad, contiguous_bits) { check_all_dtypes(OP_CONTIGUOUS); }
Test(fresh_grad, cast_bits) { check_all_dtypes(OP_CAST); }
Test(fresh_grad, concat_bits) { check_all_dtypes(OP_CONCAT); }
Test(fresh_grad, moe_sort_chunks_bits) { check_all_dtypes(OP_SORT_CHUNKS); }

/* ---- two consumers, and one tensor as both inputs: finite differences (f64) ---- */

/* swiglu(g, u) + swiglu(u, g): the later node (run first) writes g's and u's gradients, the
 * earlier adds. */
static tm_status swiglu_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *a, *b;
    TM__TRY(tm_swiglu(ctx, in[0], in[1], &a));
    TM__TRY(tm_swiglu(ctx, in[1], in[0], &b));
    return tm_add(ctx, a, b, out);
}
static tm_status swiglu_same(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_swiglu(ctx, in[0], in[0], out);
}
/* a @ b + a @ c (a [4,3], b, c [3,5]) */
static tm_status matmul_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *p, *q;
    TM__TRY(tm_matmul(ctx, in[0], in[1], 0, 0, &p));
    TM__TRY(tm_matmul(ctx, in[0], in[2], 0, 0, &q));
    return tm_add(ctx, p, q, out);
}
/* a a^T: both inputs one tensor */
static tm_status matmul_same(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_matmul(ctx, in[0], in[0], 0, 1, out);
}
/* gmm(x, w1) + gmm(x, w2), and the batched matmul with a shared b (its dB sums over the
 * batch: only the first GEMM may write) */
static tm_status gmm_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *p, *q;
    TM__TRY(tm_grouped_matmul(ctx, in[0], in[1], in[3], &p));
    TM__TRY(tm_grouped_matmul(ctx, in[0], in[2], in[3], &q));
    return tm_add(ctx, p, q, out);
}
/* unpermute(eo, p1) + unpermute(eo, p2) over rows with padding */
static tm_status unpermute_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *p, *q;
    TM__TRY(tm_moe_unpermute(ctx, in[0], in[1], in[3], 3, &p));
    TM__TRY(tm_moe_unpermute(ctx, in[0], in[2], in[3], 3, &q));
    return tm_add(ctx, p, q, out);
}
static tm_status matmul_batched_ta(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_matmul(ctx, in[0], in[1], 1, 0, out);
}

static double case_swiglu_two(tm_ctx *ctx) {
    int64_t s[2] = {3, 5};
    tm_tensor *in[2] = {tt_randu(ctx, TM_F64, 2, s, 31, -4.0, 4.0), tt_randu(ctx, TM_F64, 2, s, 32, -4.0, 4.0)};
    int check[2] = {1, 1};
    return tt_gradcheck(ctx, swiglu_two, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}
static double case_matmul_two(tm_ctx *ctx) {
    int64_t sa[2] = {4, 3}, sb[2] = {3, 5};
    tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 2, sa, 33), tt_randn(ctx, TM_F64, 2, sb, 34), tt_randn(ctx, TM_F64, 2, sb, 35)};
    int check[3] = {1, 1, 1};
    return tt_gradcheck(ctx, matmul_two, NULL, 3, in, check, 1e-6, 1e-8, 1e-6);
}
static double case_gmm_two(tm_ctx *ctx) {
    int64_t sx[2] = {5, 3}, sw[3] = {3, 3, 4}, G = 3;
    double cv[3] = {(double)gmm_counts[0], (double)gmm_counts[1], (double)gmm_counts[2]};
    tm_tensor *in[4] = {tt_randn(ctx, TM_F64, 2, sx, 36), tt_randn(ctx, TM_F64, 3, sw, 37),
                        tt_randn(ctx, TM_F64, 3, sw, 38), tt_from(ctx, TM_I64, 1, &G, cv)};
    int check[4] = {1, 1, 1, 0};
    return tt_gradcheck(ctx, gmm_two, NULL, 4, in, check, 1e-6, 1e-8, 1e-6);
}

static double case_unpermute_two(tm_ctx *ctx) {
    int64_t se[2] = {6, 4}, R = 6;
    tm_tensor *in[4] = {tt_randn(ctx, TM_F64, 2, se, 39), tt_randn(ctx, TM_F64, 1, &R, 40), tt_randn(ctx, TM_F64, 1, &R, 45),
                        tt_from(ctx, TM_I64, 1, &R, unp_rows)};
    int check[4] = {1, 1, 1, 0};
    return tt_gradcheck(ctx, unpermute_two, NULL, 4, in, check, 1e-6, 1e-8, 1e-6);
}

/* a [3,5] and b [5] (broadcast): mul(a, b) + (scale(a, 0.5) - b) + silu(a): a's and b's gradients
 * have two or three contributors each, the first to run writes (silu's and the sub's), the others
 * add, b's as sums over rows. */
static tm_status ew_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *p, *h, *q, *r, *t, *u;
    TM__TRY(tm_mul(ctx, in[0], in[1], &p));
    TM__TRY(tm_scale(ctx, in[0], 0.5, &h));
    TM__TRY(tm_sub(ctx, h, in[1], &q));
    TM__TRY(tm_add(ctx, p, q, &r));
    TM__TRY(tm_silu(ctx, in[0], &t));
    TM__TRY(tm_add(ctx, r, t, &u));
    return tm_mul(ctx, u, u, out); /* mul(u, u): one tensor twice, not fresh */
}
/* x [3,8], w [8], p [3]: h1 = rmsnorm(x, w); (s, h2) = add_rmsnorm(x, h1, w);
 * out = scale_rows(s, p) + h2: add_rmsnorm writes x's, h1's and w's gradients, rmsnorm adds to
 * x's and w's. */
static tm_status norm_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *h1, *s, *h2, *r;
    TM__TRY(tm_rmsnorm(ctx, in[0], in[1], 1e-5, &h1));
    TM__TRY(tm_add_rmsnorm(ctx, in[0], h1, in[1], 1e-5, &s, &h2));
    TM__TRY(tm_scale_rows(ctx, s, in[2], &r));
    return tm_add(ctx, r, h2, out);
}
/* x [1,3,2,4]: logits (6, 4) = rope(x, 0) + rope(x, 3) (the second rope writes x's gradient, the
 * first adds), then cross-entropy over targets with an ignored row. */
static tm_status rope_ce_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    int64_t s2[2] = {6, 4};
    tm_tensor *a, *b, *ra, *rb, *l;
    TM__TRY(tm_rope(ctx, in[0], 0, 10000.0, &a));
    TM__TRY(tm_rope(ctx, in[0], 3, 10000.0, &b));
    TM__TRY(tm_reshape(ctx, a, 2, s2, &ra));
    TM__TRY(tm_reshape(ctx, b, 2, s2, &rb));
    TM__TRY(tm_add(ctx, ra, rb, &l));
    return tm_cross_entropy(ctx, l, in[1], -100, out);
}
/* x [4,6]: x * x (recorded first, so its backward runs last and adds) + unpermute(permute(x)):
 * permute's backward writes x's gradient (and probs') fresh. */
static tm_status permute_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *m, *r;
    tm_moe_dispatch d;
    TM__TRY(tm_mul(ctx, in[0], in[0], &m));
    TM__TRY(tm_moe_permute(ctx, in[0], in[2], in[1], 2, 0, &d));
    TM__TRY(tm_moe_unpermute(ctx, d.permuted, d.permuted_probs, d.row_token, 4, &r));
    return tm_add(ctx, r, m, out);
}
static double case_permute_two(tm_ctx *ctx) {
    int64_t sx[2] = {4, 6}, sm[2] = {4, 3};
    tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 2, sx, 87), tt_randn(ctx, TM_F64, 2, sm, 88),
                        tt_from(ctx, TM_U8, 2, sm, perm_map)};
    int check[3] = {1, 1, 0};
    return tt_gradcheck(ctx, permute_two, NULL, 3, in, check, 1e-6, 1e-8, 1e-6);
}
/* attention(q, k, v) + attention(q, v, k): the second call's backward writes dq, dk and dv
 * fresh, the first's adds (its dk lands in v's gradient and its dv in k's) */
static tm_status attention_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *a, *b;
    TM__TRY(tm_attention(ctx, in[0], in[1], in[2], 0.0, &a));
    TM__TRY(tm_attention(ctx, in[0], in[2], in[1], 0.0, &b));
    return tm_add(ctx, a, b, out);
}
static double case_attention_two(tm_ctx *ctx) {
    int64_t sq[4] = {1, 3, 4, 4}, skv[4] = {1, 5, 2, 4};
    tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 4, sq, 99), tt_randn(ctx, TM_F64, 4, skv, 100), tt_randn(ctx, TM_F64, 4, skv, 101)};
    int check[3] = {1, 1, 1};
    return tt_gradcheck(ctx, attention_two, NULL, 3, in, check, 1e-6, 1e-8, 1e-6);
}
/* x [3,4]: concat(softmax(x), log_softmax(x), reshape(contiguous(x^T))) along columns, recorded
 * so that softmax's backward runs first among x's consumers (it writes x's gradient), then
 * log_softmax's and the transpose's add; concat writes the three parts' gradients, contiguous
 * its transposed input's. */
static tm_status softmax_concat_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    int64_t s34[2] = {3, 4};
    tm_tensor *t, *c, *r, *ls, *sm;
    TM__TRY(tm_transpose(ctx, in[0], 0, 1, &t));
    TM__TRY(tm_contiguous(ctx, t, &c));
    TM__TRY(tm_reshape(ctx, c, 2, s34, &r));
    TM__TRY(tm_log_softmax(ctx, in[0], &ls));
    TM__TRY(tm_softmax(ctx, in[0], &sm));
    tm_tensor *parts[3] = {sm, ls, r};
    return tm_concat(ctx, 3, parts, 1, out);
}
static double case_softmax_concat_two(tm_ctx *ctx) {
    int64_t s[2] = {3, 4};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 2, s, 108)};
    int check[1] = {1};
    return tt_gradcheck(ctx, softmax_concat_two, NULL, 1, in, check, 1e-6, 1e-8, 1e-6);
}
/* sort_chunks(x, [2, 3] grid) + 0.5 x: the sort writes x's gradient, the scale adds */
static tm_status sort_two(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *h, *y;
    TM__TRY(tm_scale(ctx, in[0], 0.5, &h));
    TM__TRY(tm_moe_sort_chunks(ctx, in[0], in[1], 2, &y));
    return tm_add(ctx, y, h, out);
}
static double case_sort_two(tm_ctx *ctx) {
    int64_t sx[2] = {7, 3}, n = 6;
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 2, sx, 110), tt_from(ctx, TM_I64, 1, &n, sort_sizes)};
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, sort_two, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}
static double case_ew_two(tm_ctx *ctx) {
    int64_t s[2] = {3, 5}, m = 5;
    tm_tensor *in[2] = {tt_randu(ctx, TM_F64, 2, s, 81, -2.0, 2.0), tt_randn(ctx, TM_F64, 1, &m, 82)};
    int check[2] = {1, 1};
    return tt_gradcheck(ctx, ew_two, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}
static double case_norm_two(tm_ctx *ctx) {
    int64_t s[2] = {3, 8}, c = 8, r = 3;
    tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 2, s, 83), tt_randn(ctx, TM_F64, 1, &c, 84), tt_randn(ctx, TM_F64, 1, &r, 85)};
    int check[3] = {1, 1, 1};
    return tt_gradcheck(ctx, norm_two, NULL, 3, in, check, 1e-6, 1e-8, 1e-6);
}
static double case_rope_ce_two(tm_ctx *ctx) {
    int64_t s[4] = {1, 3, 2, 4}, N = 6;
    double tg[6] = {1, -100, 3, 0, 2, 1};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 4, s, 86), tt_from(ctx, TM_I64, 1, &N, tg)};
    int check[2] = {1, 0};
    return tt_gradcheck(ctx, rope_ce_two, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}

/* Runs case with NaN-poisoned fresh buffers (force: the broken autograd); returns its ratio and
 * the fresh gradients it handed out. */
static double run_case(double (*fn)(tm_ctx *), int force, int64_t *fresh) {
    tm_ctx *ctx = tt_ctx();
    tm__test_fresh_hooks(ctx, 1, force);
    double r = fn(ctx);
    *fresh = tm__test_fresh_count(ctx);
    tm_ctx_free(ctx);
    return r;
}

#define N_TWO 11
static double (*const two_cases[N_TWO])(tm_ctx *) = {case_swiglu_two, case_matmul_two, case_gmm_two, case_unpermute_two,
                                                     case_ew_two, case_norm_two, case_rope_ce_two, case_permute_two,
                                                     case_attention_two, case_softmax_concat_two,
                                                     case_sort_two};

Test(fresh_grad, two_consumers) {
    double (*const *cases)(tm_ctx *) = two_cases;
    for (int i = 0; i < N_TWO; i++) {
        int64_t fresh;
        double r = run_case(cases[i], 0, &fresh);
        cr_assert_leq(r, 1.0, "case %d: gradcheck ratio %g", i, r);
        cr_assert_gt(fresh, 0, "case %d: no fresh gradient was handed out", i);
    }
}

/* The mutation: gradients marked fresh although an earlier contributor wrote them (an op
 * overwriting instead of adding) must fail the same checks. */
Test(fresh_grad, overwrite_when_not_fresh_is_caught) {
    double (*const *cases)(tm_ctx *) = two_cases;
    for (int i = 0; i < N_TWO; i++) {
        int64_t fresh;
        double r = run_case(cases[i], 1, &fresh);
        cr_assert_gt(r, 1.0, "case %d: an autograd that overwrites gradients passed (ratio %g)", i, r);
    }
}

static double case_swiglu_same(tm_ctx *ctx) {
    int64_t s[2] = {3, 5};
    tm_tensor *in[1] = {tt_randu(ctx, TM_F64, 2, s, 41, -4.0, 4.0)};
    int check[1] = {1};
    return tt_gradcheck(ctx, swiglu_same, NULL, 1, in, check, 1e-6, 1e-8, 1e-6);
}
static double case_matmul_same(tm_ctx *ctx) {
    int64_t s[2] = {4, 3};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 2, s, 42)};
    int check[1] = {1};
    return tt_gradcheck(ctx, matmul_same, NULL, 1, in, check, 1e-6, 1e-8, 1e-6);
}
static double case_matmul_batched_ta(tm_ctx *ctx) {
    int64_t sa[3] = {3, 4, 2}, sb[2] = {4, 5}; /* a (batch 3, K 4, M 2) read transposed, b shared */
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 3, sa, 43), tt_randn(ctx, TM_F64, 2, sb, 44)};
    int check[2] = {1, 1};
    return tt_gradcheck(ctx, matmul_batched_ta, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}

static tm_status add_same(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_add(ctx, in[0], in[0], out);
}
static tm_status mul_same(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_mul(ctx, in[0], in[0], out);
}
/* add_rmsnorm(x, x, w): dx and dy are one buffer (w's gradient may be fresh) */
static tm_status add_rmsnorm_same(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    tm_tensor *s, *h;
    TM__TRY(tm_add_rmsnorm(ctx, in[0], in[0], in[1], 1e-5, &s, &h));
    return tm_scale_rows(ctx, h, in[2], out); /* h only: s's gradient is the autograd's zeros */
}
/* attention(q, k, k): k as v, dk and dv one buffer */
static tm_status attention_same(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_attention(ctx, in[0], in[1], in[1], 0.0, out);
}
static double case_attention_same(tm_ctx *ctx) {
    int64_t sq[4] = {1, 3, 4, 4}, skv[4] = {1, 5, 2, 4};
    tm_tensor *in[2] = {tt_randn(ctx, TM_F64, 4, sq, 102), tt_randn(ctx, TM_F64, 4, skv, 103)};
    int check[2] = {1, 1};
    return tt_gradcheck(ctx, attention_same, NULL, 2, in, check, 1e-6, 1e-8, 1e-6);
}
static double case_add_same(tm_ctx *ctx) {
    int64_t s[2] = {3, 5};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 2, s, 91)};
    int check[1] = {1};
    return tt_gradcheck(ctx, add_same, NULL, 1, in, check, 1e-6, 1e-8, 1e-6);
}
static double case_mul_same(tm_ctx *ctx) {
    int64_t s[2] = {3, 5};
    tm_tensor *in[1] = {tt_randn(ctx, TM_F64, 2, s, 92)};
    int check[1] = {1};
    return tt_gradcheck(ctx, mul_same, NULL, 1, in, check, 1e-6, 1e-8, 1e-6);
}
static double case_add_rmsnorm_same(tm_ctx *ctx) {
    int64_t s[2] = {3, 8}, c = 8, r = 3;
    tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 2, s, 93), tt_randn(ctx, TM_F64, 1, &c, 94), tt_randn(ctx, TM_F64, 1, &r, 95)};
    int check[3] = {1, 1, 1};
    return tt_gradcheck(ctx, add_rmsnorm_same, NULL, 3, in, check, 1e-6, 1e-8, 1e-6);
}

/* x + x, x * x, add_rmsnorm(x, x, w), attention(q, k, k): the two slots of x are one gradient; none is fresh (the
 * second contribution adds to the first), and an autograd that marks them fresh anyway (the
 * second overwriting the first) is caught. */
Test(fresh_grad, elementwise_same_tensor_twice) {
    double (*cases[4])(tm_ctx *) = {case_add_same, case_mul_same, case_add_rmsnorm_same, case_attention_same};
    /* fresh gradients each case may hand out: scale_rows' dh and dp, add_rmsnorm's dw; attention's dq */
    const int64_t want[4] = {0, 0, 3, 1};
    /* the CPU attention zeroes a fresh dk and dv (one buffer here) before it adds into either,
     * so marking both fresh leaves its result right: no overwrite to catch there */
    const int overwrites[4] = {1, 1, 1, 0};
    for (int i = 0; i < 4; i++) {
        int64_t fresh;
        double r = run_case(cases[i], 0, &fresh);
        cr_assert_leq(r, 1.0, "same-tensor case %d: ratio %g", i, r);
        cr_assert_eq(fresh, want[i], "same-tensor case %d: %lld fresh gradients, want %lld", i, (long long)fresh,
                     (long long)want[i]);
        r = run_case(cases[i], 1, &fresh);
        if (overwrites[i])
            cr_assert_gt(r, 1.0, "same-tensor case %d: an autograd that overwrites x's gradient passed (ratio %g)", i, r);
        else
            cr_assert_leq(r, 1.0, "same-tensor case %d, every slot fresh: ratio %g", i, r);
    }
}

Test(fresh_grad, same_tensor_twice_and_batch_sum) {
    int64_t fresh;
    double r = run_case(case_swiglu_same, 0, &fresh);
    cr_assert_leq(r, 1.0, "swiglu(x, x): ratio %g", r);
    cr_assert_eq(fresh, 0, "swiglu(x, x) got %lld fresh gradients: its two slots are one tensor", (long long)fresh);
    r = run_case(case_matmul_same, 0, &fresh);
    cr_assert_leq(r, 1.0, "x x^T: ratio %g", r);
    cr_assert_eq(fresh, 0, "x x^T got %lld fresh gradients", (long long)fresh);
    r = run_case(case_matmul_batched_ta, 0, &fresh);
    cr_assert_leq(r, 1.0, "batched a^T b with shared b: ratio %g", r);
    cr_assert_gt(fresh, 0);
}

/* Parameters' gradients accumulate over micro-batches: never fresh. */
Test(fresh_grad, parameters_accumulate) {
    tm_ctx *ctx = tt_ctx();
    tm__test_fresh_hooks(ctx, 1, 0);
    int64_t sx[2] = {4, 3}, sw[2] = {3, 5};
    tm_tensor *w, *x = tt_randn(ctx, TM_F32, 2, sx, 51), *wv = tt_randn(ctx, TM_F32, 2, sw, 52);
    TT_OK(ctx, tm_param_new(ctx, "w", TM_F32, 2, sw, tm_cpu(), &w));
    double *hw = tt_read(ctx, wv);
    TT_OK(ctx, tm_tensor_write(ctx, w, TM_F64, hw, 15));
    double *once = NULL;
    for (int step = 0; step < 2; step++) {
        tm_tensor *y;
        TT_OK(ctx, tm_matmul(ctx, x, w, 0, 0, &y));
        tm_tensor *dy = tt_randn(ctx, TM_F32, 2, y->shape, 53);
        TT_OK(ctx, tm_backward_with_grad(ctx, y, dy));
        if (step == 0) once = tt_read(ctx, tm_tensor_grad(w));
    }
    cr_assert_eq(tm__test_fresh_count(ctx), 0, "a parameter's gradient was handed out fresh");
    double *twice = tt_read(ctx, tm_tensor_grad(w));
    for (int e = 0; e < 15; e++) cr_assert_eq(twice[e], 2.0 * once[e], "element %d: %g, want 2 x %g", e, twice[e], once[e]);
    free(hw), free(once), free(twice);
    tm_ctx_free(ctx);
}
