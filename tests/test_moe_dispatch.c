/*
 * test_moe_dispatch.c — tm_moe_capacity, tm_moe_drop_tokens, tm_moe_permute (and
 * tm_moe_permute_topk), tm_moe_unpermute:
 * capacity against Megatron's formula, both drop policies on a hand-worked example, permute
 * against a naive reference on random routings (empty experts, align_size 1 and 16, pad_to),
 * the permute -> unpermute round trip, bf16 bit-exactness, gradients by finite differences,
 * bit-identical results for 1, 2 and 3 threads, bad inputs.
 *
 * Permute and the drop selection only move or mask values, so their outputs are compared
 * exactly; unpermute sums in the order the reference does, so f64 is exact as well.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "extend.h"

double tt_gradcase_moe_drop_tokens(tm_ctx *ctx);
double tt_gradcase_moe_permute(tm_ctx *ctx);
double tt_gradcase_moe_unpermute(tm_ctx *ctx);

/* ---- helpers --------------------------------------------------------------------------- */

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A random routing: `nused` of the E experts (a shuffled subset, so E - nused columns stay
 * empty) and k distinct of those per token; probs uniform in [0.05, 1) where routed, 0
 * elsewhere. map and probs are [T*E] host arrays. */
static void random_routing(double *map, double *probs, int64_t T, int64_t E, int64_t k, int64_t nused, uint64_t seed) {
    uint64_t s = seed;
    int64_t *perm = malloc(sizeof(int64_t) * (size_t)E), *pick = malloc(sizeof(int64_t) * (size_t)E);
    for (int64_t e = 0; e < E; e++) perm[e] = e;
    for (int64_t e = E - 1; e > 0; e--) {
        int64_t j = (int64_t)(splitmix(&s) % (uint64_t)(e + 1)), tmp = perm[e];
        perm[e] = perm[j], perm[j] = tmp;
    }
    memset(map, 0, sizeof(double) * (size_t)(T * E));
    memset(probs, 0, sizeof(double) * (size_t)(T * E));
    for (int64_t t = 0; t < T; t++) {
        memcpy(pick, perm, sizeof(int64_t) * (size_t)nused);
        for (int64_t j = 0; j < k; j++) {
            int64_t i = j + (int64_t)(splitmix(&s) % (uint64_t)(nused - j)), tmp = pick[j];
            pick[j] = pick[i], pick[i] = tmp;
            map[t * E + pick[j]] = 1;
            probs[t * E + pick[j]] = 0.05 + 0.95 * (double)(splitmix(&s) >> 11) / 9007199254740992.0;
        }
    }
    free(perm), free(pick);
}

/* Naive permute: expert by expert, token by token, then the padding. Arrays sized for the
 * worst case by the caller; returns R. */
static int64_t ref_permute(const double *map, const double *probs, const double *x, int64_t T, int64_t E, int64_t H,
                           int64_t align, int64_t pad_to, double *perm, double *pp, int64_t *rt, int64_t *tpe) {
    int64_t r = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t r0 = r;
        for (int64_t t = 0; t < T; t++) {
            if (!map[t * E + e]) continue;
            for (int64_t h = 0; h < H; h++) perm[r * H + h] = x[t * H + h];
            pp[r] = probs[t * E + e];
            rt[r++] = t;
        }
        int64_t want = pad_to > 0 ? pad_to : (r - r0 + align - 1) / align * align;
        while (r - r0 < want) {
            for (int64_t h = 0; h < H; h++) perm[r * H + h] = 0;
            pp[r] = 0;
            rt[r++] = -1;
        }
        tpe[e] = r - r0;
    }
    return r;
}

static void assert_err(tm_ctx *ctx, tm_status got, tm_status want, const char *op, const char *a, const char *b) {
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert_eq(got, want, "status %s, want %s (%s)", tm_status_str(got), tm_status_str(want), msg);
    cr_assert(strstr(msg, op), "message lacks the op name %s: %s", op, msg);
    if (a) cr_assert(strstr(msg, a), "message lacks \"%s\": %s", a, msg);
    if (b) cr_assert(strstr(msg, b), "message lacks \"%s\": %s", b, msg);
}

static void assert_exact(tm_ctx *ctx, const tm_tensor *t, const double *want, int64_t n, const char *what) {
    cr_assert_eq(tm_tensor_numel(t), n, "%s: %lld elements, want %lld", what, (long long)tm_tensor_numel(t), (long long)n);
    double *got = tt_read(ctx, t);
    for (int64_t i = 0; i < n; i++)
        cr_assert_eq(got[i], want[i], "%s[%lld] = %.17g, want %.17g", what, (long long)i, got[i], want[i]);
    free(got);
}

static void assert_exact_i64(tm_ctx *ctx, const tm_tensor *t, const int64_t *want, int64_t n, const char *what) {
    cr_assert_eq(tm_tensor_dtype(t), TM_I64, "%s must be i64", what);
    cr_assert_eq(tm_tensor_numel(t), n, "%s: %lld elements, want %lld", what, (long long)tm_tensor_numel(t), (long long)n);
    int64_t *got = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    TT_OK(ctx, tm_tensor_read(ctx, t, TM_I64, got, n));
    for (int64_t i = 0; i < n; i++)
        cr_assert_eq(got[i], want[i], "%s[%lld] = %lld, want %lld", what, (long long)i, (long long)got[i], (long long)want[i]);
    free(got);
}

/* ---- capacity -------------------------------------------------------------------------- */

Test(moe_dispatch, capacity_matches_megatron) {
    cr_assert_eq(tm_moe_capacity(6, 2, 3, 1.0), 4);
    cr_assert_eq(tm_moe_capacity(6, 2, 3, 0.75), 3);
    cr_assert_eq(tm_moe_capacity(10, 2, 8, 1.0), 3);  /* ceil(2.5) */
    cr_assert_eq(tm_moe_capacity(4096, 8, 64, 1.25), 640);
    cr_assert_eq(tm_moe_capacity(0, 2, 8, 1.0), 0);
    /* Megatron: math.ceil((50 / 3) * 0.9) = ceil(15.000000000000002) = 16, where the exact value
     * (and ceil(50 * 0.9 / 3)) is 15: the quotient is rounded before the product. */
    cr_assert_eq(tm_moe_capacity(25, 2, 3, 0.9), 16);
    cr_assert_eq(tm_moe_capacity(-1, 2, 8, 1.0), -1);
    cr_assert_eq(tm_moe_capacity(8, 0, 8, 1.0), -1);
    cr_assert_eq(tm_moe_capacity(8, 2, 0, 1.0), -1);
    cr_assert_eq(tm_moe_capacity(8, 2, 8, 0.0), -1);
    cr_assert_eq(tm_moe_capacity(8, 2, 8, NAN), -1);
    cr_assert_eq(tm_moe_capacity(8, 2, 8, INFINITY), -1);
}

/* ---- token dropping: a worked example ----------------------------------------------------- */

/* T = 6 tokens, E = 3 experts, k = 2:
 *   t0: e0 .6  e1 .4        column e0: t0 .6, t1 .3, t2 .5, t4 .9, t5 .3   (5 routed)
 *   t1: e0 .3  e2 .7        column e1: t0 .4, t2 .5, t3 .2, t5 .7          (4 routed)
 *   t2: e0 .5  e1 .5        column e2: t1 .7, t3 .8, t4 .1                 (3 routed)
 *   t3: e1 .2  e2 .8
 *   t4: e0 .9  e2 .1
 *   t5: e0 .3  e1 .7
 * capacity_factor 1 -> capacity ceil(12 / 3) = 4: only e0 overflows, by one.
 *   probs:    e0's lowest p is .3 at t1 and t5; the tie goes to the lower token: t5 dropped.
 *   position: e0 keeps t0 t1 t2 t4, t5 dropped.
 * capacity_factor 0.75 -> capacity 3:
 *   probs:    e0 keeps t4 .9, t0 .6, t2 .5 (drops t1, t5); e1 keeps t5 .7, t2 .5, t0 .4 (drops t3)
 *   position: e0 keeps t0 t1 t2 (drops t4, t5);          e1 keeps t0 t2 t3 (drops t5)
 *   3 pairs dropped either way, but not the same pairs. */
static const double EX_MAP[18] = {1, 1, 0, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0};
static const double EX_PROBS[18] = {.6, .4, 0, .3, 0, .7, .5, .5, 0, 0, .2, .8, .9, 0, .1, .3, .7, 0};

static void check_drop(tm_dtype dt, double cf, tm_drop_policy policy, const double *want_map, int64_t want_dropped) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {6, 3};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, s, EX_MAP), *probs = tt_from(ctx, dt, 2, s, EX_PROBS);
    int64_t cap = tm_moe_capacity(6, 2, 3, cf), dropped = -1;
    tm_moe_drop_out d;
    TT_OK(ctx, tm_moe_drop_tokens(ctx, probs, map, cap, policy, &d));
    tm_tensor *pk = d.probs_kept, *mk = d.map_kept;
    cr_assert_eq(tm_tensor_dtype(d.dropped), TM_I64);
    cr_assert_eq(tm_tensor_ndim(d.dropped), 0);
    TT_OK(ctx, tm_tensor_read(ctx, d.dropped, TM_I64, &dropped, 1));
    cr_assert_eq(dropped, want_dropped, "dropped %lld, want %lld", (long long)dropped, (long long)want_dropped);
    /* Kept counts: the column sums of the kept map. */
    int64_t kept[3] = {0, 0, 0};
    for (int i = 0; i < 18; i++) kept[i % 3] += want_map[i] != 0;
    assert_exact_i64(ctx, d.tokens_per_expert, kept, 3, "tokens_per_expert");
    cr_assert_eq(kept[0] + kept[1] + kept[2] + dropped, 12, "kept + dropped = routed");
    cr_assert_eq(tm_tensor_dtype(mk), TM_U8);
    cr_assert_eq(tm_tensor_dtype(pk), dt);
    assert_exact(ctx, mk, want_map, 18, "map_kept");
    double *hp = tt_read(ctx, probs), want_p[18];
    for (int i = 0; i < 18; i++) want_p[i] = want_map[i] ? hp[i] : 0.0;
    assert_exact(ctx, pk, want_p, 18, "probs_kept");
    free(hp);
    tm_ctx_free(ctx);
}

static const double KEEP_CAP4[18] = {1, 1, 0, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 1, 0};
static const double KEEP_CAP3_PROBS[18] = {1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 1, 0};
static const double KEEP_CAP3_POSITION[18] = {1, 1, 0, 1, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0};

Test(moe_dispatch, drop_probs_example) {
    check_drop(TM_F64, 1.0, TM_DROP_PROBS, KEEP_CAP4, 1);
    check_drop(TM_F32, 1.0, TM_DROP_PROBS, KEEP_CAP4, 1);
    check_drop(TM_F64, 0.75, TM_DROP_PROBS, KEEP_CAP3_PROBS, 3);
    check_drop(TM_F32, 0.75, TM_DROP_PROBS, KEEP_CAP3_PROBS, 3);
}

Test(moe_dispatch, drop_position_example) {
    check_drop(TM_F64, 1.0, TM_DROP_POSITION, KEEP_CAP4, 1);
    check_drop(TM_F64, 0.75, TM_DROP_POSITION, KEEP_CAP3_POSITION, 3);
    check_drop(TM_F32, 0.75, TM_DROP_POSITION, KEEP_CAP3_POSITION, 3);
}

/* capacity 8 >= every column: nothing dropped, map_kept = routing_map. */
Test(moe_dispatch, drop_nothing) {
    check_drop(TM_F64, 2.0, TM_DROP_PROBS, EX_MAP, 0);
    check_drop(TM_F64, 2.0, TM_DROP_POSITION, EX_MAP, 0);
}

Test(moe_dispatch, drop_capacity_zero) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {6, 3};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, s, EX_MAP), *probs = tt_from(ctx, TM_F64, 2, s, EX_PROBS);
    int64_t dropped = -1;
    tm_moe_drop_out d;
    TT_OK(ctx, tm_moe_drop_tokens(ctx, probs, map, 0, TM_DROP_PROBS, &d));
    TT_OK(ctx, tm_tensor_read(ctx, d.dropped, TM_I64, &dropped, 1));
    cr_assert_eq(dropped, 12);
    double zeros[18] = {0};
    const int64_t none[3] = {0, 0, 0};
    assert_exact(ctx, d.map_kept, zeros, 18, "map_kept");
    assert_exact(ctx, d.probs_kept, zeros, 18, "probs_kept");
    assert_exact_i64(ctx, d.tokens_per_expert, none, 3, "tokens_per_expert");
    tm_ctx_free(ctx);
}

/* Drop to capacity 3, then permute with pad_to = capacity: every expert gets exactly 3 rows. */
Test(moe_dispatch, pad_to_capacity) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {6, 3}, xs[2] = {6, 5};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, s, EX_MAP), *probs = tt_from(ctx, TM_F64, 2, s, EX_PROBS);
    tm_tensor *x = tt_randn(ctx, TM_F64, 2, xs, 5);
    int64_t cap = tm_moe_capacity(6, 2, 3, 0.75);
    tm_moe_drop_out dr;
    TT_OK(ctx, tm_moe_drop_tokens(ctx, probs, map, cap, TM_DROP_PROBS, &dr));
    tm_moe_dispatch d;
    TT_OK(ctx, tm_moe_permute(ctx, x, dr.map_kept, dr.probs_kept, 1, cap, &d));
    cr_assert_eq(d.num_rows, 9);
    const int64_t tpe[3] = {3, 3, 3}, rt[9] = {0, 2, 4, 0, 2, 5, 1, 3, 4};
    assert_exact_i64(ctx, d.tokens_per_expert, tpe, 3, "tokens_per_expert");
    assert_exact_i64(ctx, d.row_token, rt, 9, "row_token");
    const double pp[9] = {.6, .5, .9, .4, .5, .7, .7, .8, .1};
    assert_exact(ctx, d.permuted_probs, pp, 9, "permuted_probs");

    /* Capacity 4 (factor 1): expert 2 has 3 tokens and one zero row at the end of its block. */
    cap = tm_moe_capacity(6, 2, 3, 1.0);
    TT_OK(ctx, tm_moe_drop_tokens(ctx, probs, map, cap, TM_DROP_POSITION, &dr));
    TT_OK(ctx, tm_moe_permute(ctx, x, dr.map_kept, dr.probs_kept, 16, cap, &d)); /* pad_to wins over align_size */
    cr_assert_eq(d.num_rows, 12);
    const int64_t tpe4[3] = {4, 4, 4}, rt4[12] = {0, 1, 2, 4, 0, 2, 3, 5, 1, 3, 4, -1};
    assert_exact_i64(ctx, d.tokens_per_expert, tpe4, 3, "tokens_per_expert");
    assert_exact_i64(ctx, d.row_token, rt4, 12, "row_token");
    double *perm = tt_read(ctx, d.permuted);
    for (int h = 0; h < 5; h++) cr_assert_eq(perm[11 * 5 + h], 0.0);
    free(perm);

    /* Without dropping, expert 0's five tokens do not fit in pad_to = 4. */
    tm_status st = tm_moe_permute(ctx, x, map, probs, 1, 4, &d);
    assert_err(ctx, st, TM_ERR_INVALID_ARG, "moe_permute", "expert 0", "5 routed tokens");
    tm_ctx_free(ctx);
}

/* ---- permute against the naive reference ------------------------------------------------ */

typedef struct perm_case {
    int64_t T, E, H, k, nused, align, pad_to;
} perm_case;

static void check_permute(tm_dtype dt, perm_case pc, uint64_t seed) {
    tm_ctx *ctx = tt_ctx();
    const int64_t T = pc.T, E = pc.E, H = pc.H;
    double *hmap = malloc(sizeof(double) * (size_t)(T * E)), *hprobs = malloc(sizeof(double) * (size_t)(T * E));
    random_routing(hmap, hprobs, T, E, pc.k, pc.nused, seed);
    int64_t ms[2] = {T, E}, xs[2] = {T, H};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, ms, hmap), *probs = tt_from(ctx, dt, 2, ms, hprobs);
    tm_tensor *x = tt_randn(ctx, dt, 2, xs, seed + 1);
    double *hx = tt_read(ctx, x), *hp = tt_read(ctx, probs); /* as stored (rounded to dt) */

    int64_t maxR = E * (T + pc.align + pc.pad_to);
    double *perm = malloc(sizeof(double) * (size_t)(maxR * H)), *pp = malloc(sizeof(double) * (size_t)maxR);
    int64_t *rt = malloc(sizeof(int64_t) * (size_t)maxR), *tpe = malloc(sizeof(int64_t) * (size_t)E);
    int64_t R = ref_permute(hmap, hp, hx, T, E, H, pc.align, pc.pad_to, perm, pp, rt, tpe);

    tm_moe_dispatch d;
    TT_OK(ctx, tm_moe_permute(ctx, x, map, probs, pc.align, pc.pad_to, &d));
    cr_assert_eq(d.num_rows, R, "R = %lld, want %lld", (long long)d.num_rows, (long long)R);
    cr_assert_eq(tm_tensor_dtype(d.permuted), dt);
    cr_assert_eq(tm_tensor_dtype(d.permuted_probs), dt);
    cr_assert_eq(tm_tensor_ndim(d.permuted), 2);
    cr_assert_eq(tm_tensor_dim(d.permuted, 1), H);
    assert_exact(ctx, d.permuted, perm, R * H, "permuted");
    assert_exact(ctx, d.permuted_probs, pp, R, "permuted_probs");
    assert_exact_i64(ctx, d.row_token, rt, R, "row_token");
    assert_exact_i64(ctx, d.tokens_per_expert, tpe, E, "tokens_per_expert");

    /* The layout, stated directly: blocks of tokens_per_expert rows; within a block routed tokens
     * in strictly ascending order, then only padding; padding rows exactly zero. */
    int64_t r = 0, routed = 0, empty = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t prev = -1, in_pad = 0, n = 0;
        for (int64_t j = 0; j < tpe[e]; j++, r++) {
            if (rt[r] < 0) {
                in_pad = 1;
                for (int64_t h = 0; h < H; h++) cr_assert_eq(perm[r * H + h], 0.0);
                cr_assert_eq(pp[r], 0.0);
                continue;
            }
            cr_assert(!in_pad, "expert %lld: token row after padding", (long long)e);
            cr_assert_gt(rt[r], prev);
            cr_assert_eq(hmap[rt[r] * E + e], 1.0);
            prev = rt[r];
            n++;
        }
        if (pc.pad_to > 0) cr_assert_eq(tpe[e], pc.pad_to);
        else cr_assert_eq(tpe[e] % pc.align, 0);
        routed += n;
        empty += n == 0;
    }
    cr_assert_eq(routed, T * pc.k);
    if (pc.nused < E) cr_assert_geq(empty, E - pc.nused, "the case must leave experts empty");
    if (pc.align == 1 && pc.pad_to == 0) cr_assert_eq(R, T * pc.k, "dropless, unaligned: R = T * k");

    free(hmap), free(hprobs), free(hx), free(hp), free(perm), free(pp), free(rt), free(tpe);
    tm_ctx_free(ctx);
}

static const perm_case PERM_CASES[] = {
    {37, 7, 13, 2, 5, 1, 0},   /* two empty experts, unaligned */
    {37, 7, 13, 2, 5, 16, 0},  /* align 16 */
    {23, 9, 5, 3, 9, 1, 0},    /* every expert used */
    {23, 9, 5, 3, 6, 16, 0},
    {19, 6, 11, 1, 4, 1, 19},  /* pad_to = T: always enough room */
    {1, 4, 3, 4, 4, 16, 0},    /* one token to every expert */
    {0, 5, 7, 0, 5, 16, 0},    /* no tokens: R = 0 */
};

static void check_permute_cases(tm_dtype dt) {
    for (size_t i = 0; i < sizeof PERM_CASES / sizeof *PERM_CASES; i++) check_permute(dt, PERM_CASES[i], 100 + i);
}

Test(moe_dispatch, permute_f64) { check_permute_cases(TM_F64); }
Test(moe_dispatch, permute_f32) { check_permute_cases(TM_F32); }
/* bf16 values convert to f64 exactly, so the exact comparison is a bit-exact one. */
Test(moe_dispatch, permute_bf16) { check_permute_cases(TM_BF16); }

Test(moe_dispatch, permute_bf16_bits) {
    tm_ctx *ctx = tt_ctx();
    const int64_t T = 29, E = 6, H = 17;
    double hmap[29 * 6], hprobs[29 * 6];
    random_routing(hmap, hprobs, T, E, 2, 5, 7);
    int64_t ms[2] = {T, E}, xs[2] = {T, H};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, ms, hmap), *probs = tt_from(ctx, TM_F32, 2, ms, hprobs);
    tm_tensor *x = tt_randn(ctx, TM_BF16, 2, xs, 8);
    tm_moe_dispatch d;
    TT_OK(ctx, tm_moe_permute(ctx, x, map, probs, 16, 0, &d));
    cr_assert_eq(tm_tensor_dtype(d.permuted), TM_BF16);
    cr_assert_eq(tm_tensor_dtype(d.permuted_probs), TM_F32);
    uint16_t xb[29 * 17], *pb = malloc(sizeof(uint16_t) * (size_t)(d.num_rows * H));
    int64_t *rt = malloc(sizeof(int64_t) * (size_t)d.num_rows);
    TT_OK(ctx, tm_tensor_read(ctx, x, TM_BF16, xb, T * H));
    TT_OK(ctx, tm_tensor_read(ctx, d.permuted, TM_BF16, pb, d.num_rows * H));
    TT_OK(ctx, tm_tensor_read(ctx, d.row_token, TM_I64, rt, d.num_rows));
    for (int64_t r = 0; r < d.num_rows; r++)
        for (int64_t h = 0; h < H; h++)
            cr_assert_eq(pb[r * H + h], rt[r] < 0 ? 0 : xb[rt[r] * H + h], "row %lld col %lld", (long long)r, (long long)h);
    free(pb), free(rt);
    tm_ctx_free(ctx);
}

/* ---- permute -> unpermute round trip ------------------------------------------------------ */

/* y[t] = sum_e p[t,e] x[t] (ascending e, as the rows are ordered) and, without weights,
 * sum over t's rows of x[t]. */
static void check_round_trip(tm_dtype dt, int64_t align, double atol, double rtol) {
    tm_ctx *ctx = tt_ctx();
    const int64_t T = 31, E = 8, H = 9, k = 3;
    double hmap[31 * 8], hprobs[31 * 8];
    random_routing(hmap, hprobs, T, E, k, 6, 11);
    int64_t ms[2] = {T, E}, xs[2] = {T, H};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, ms, hmap), *probs = tt_from(ctx, dt == TM_F64 ? TM_F64 : TM_F32, 2, ms, hprobs);
    tm_tensor *x = tt_randn(ctx, dt, 2, xs, 12), *y, *y1;
    tm_moe_dispatch d;
    TT_OK(ctx, tm_moe_permute(ctx, x, map, probs, align, 0, &d));
    TT_OK(ctx, tm_moe_unpermute(ctx, d.permuted, d.permuted_probs, d.row_token, T, &y));
    TT_OK(ctx, tm_moe_unpermute(ctx, d.permuted, NULL, d.row_token, T, &y1));
    cr_assert_eq(tm_tensor_dtype(y), dt);
    cr_assert_eq(tm_tensor_dim(y, 0), T);
    cr_assert_eq(tm_tensor_dim(y, 1), H);

    double *hx = tt_read(ctx, x), *hp = tt_read(ctx, probs), want[31 * 9], want1[31 * 9];
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            double acc = 0, acc1 = 0;
            for (int64_t e = 0; e < E; e++)
                if (hmap[t * E + e]) acc += hx[t * H + h] * hp[t * E + e], acc1 += hx[t * H + h];
            want[t * H + h] = acc, want1[t * H + h] = acc1;
        }
    tt_assert_close_host(ctx, y, want, atol, rtol);
    tt_assert_close_host(ctx, y1, want1, atol, rtol);
    free(hx), free(hp);
    tm_ctx_free(ctx);
}

/* f64: the kernel adds the same products in the same order: exact. */
Test(moe_dispatch, round_trip_f64) {
    check_round_trip(TM_F64, 1, 0, 0);
    check_round_trip(TM_F64, 16, 0, 0);
}
/* f32: three f32 products and sums, each within 2^-24 relative. */
Test(moe_dispatch, round_trip_f32) { check_round_trip(TM_F32, 16, 1e-6, 1e-6); }
/* bf16 expert_out, f32 probs: summed in f32, rounded to bf16 once (2^-9 relative). */
Test(moe_dispatch, round_trip_bf16) { check_round_trip(TM_BF16, 16, 1e-2, 4e-3); }

/* Tokens routed nowhere get exact zeros; rows in arbitrary order (not a permute output) are
 * gathered all the same. */
Test(moe_dispatch, unpermute_any_row_order) {
    tm_ctx *ctx = tt_ctx();
    int64_t es[2] = {6, 2}, rs[1] = {6};
    const double eo[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, p[6] = {.5, 2, 4, 8, 1, .25};
    const double rt[6] = {3, 0, -1, 3, 0, 2};
    tm_tensor *te = tt_from(ctx, TM_F64, 2, es, eo), *tp = tt_from(ctx, TM_F64, 1, rs, p), *tr = tt_from(ctx, TM_I64, 1, rs, rt);
    tm_tensor *y;
    TT_OK(ctx, tm_moe_unpermute(ctx, te, tp, tr, 5, &y));
    const double want[10] = {3 * 2 + 9 * 1, 4 * 2 + 10 * 1, 0, 0, 11 * .25, 12 * .25, 1 * .5 + 7 * 8, 2 * .5 + 8 * 8, 0, 0};
    assert_exact(ctx, y, want, 10, "y");
    tm_ctx_free(ctx);
}

/* ---- gradients --------------------------------------------------------------------------- */

typedef struct perm_args {
    int64_t align, pad_to;
} perm_args;

/* [permuted | permuted_probs] as one (R, H + 1) output, so one random cotangent covers both. */
static tm_status permute_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    const perm_args *a = user;
    tm_moe_dispatch d;
    tm_status s = tm_moe_permute(ctx, in[0], in[1], in[2], a->align, a->pad_to, &d);
    if (s != TM_OK) return s;
    int64_t ps[2] = {d.num_rows, 1};
    tm_tensor *pp, *parts[2];
    if ((s = tm_reshape(ctx, d.permuted_probs, 2, ps, &pp)) != TM_OK) return s;
    parts[0] = d.permuted, parts[1] = pp;
    return tm_concat(ctx, 2, parts, 1, out);
}

double tt_gradcase_moe_permute(tm_ctx *ctx) {
    const int64_t T = 9, E = 5, H = 6;
    double hmap[9 * 5], hprobs[9 * 5];
    random_routing(hmap, hprobs, T, E, 2, 4, 21);
    int64_t ms[2] = {T, E}, xs[2] = {T, H};
    tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 2, xs, 22), tt_from(ctx, TM_U8, 2, ms, hmap), tt_randn(ctx, TM_F64, 2, ms, 23)};
    int check[3] = {1, 0, 1};
    perm_args a = {3, 0}; /* padding rows and an empty expert in the output */
    return tt_gradcheck(ctx, permute_fn, &a, 3, in, check, 1e-6, 1e-8, 1e-6);
}

static tm_status unpermute_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    return tm_moe_unpermute(ctx, in[0], in[1], in[2], *(const int64_t *)user, out);
}

double tt_gradcase_moe_unpermute(tm_ctx *ctx) {
    /* 11 rows onto 5 tokens: token 1 has three rows, token 4 none, two rows are padding. */
    int64_t es[2] = {11, 6}, rs[1] = {11};
    const double rt[11] = {0, 1, 1, -1, 2, 3, 0, 1, 3, -1, 2};
    tm_tensor *in[3] = {tt_randn(ctx, TM_F64, 2, es, 31), tt_randu(ctx, TM_F64, 1, rs, 32, 0.1, 1.0),
                        tt_from(ctx, TM_I64, 1, rs, rt)};
    int check[3] = {1, 1, 0};
    int64_t T = 5;
    return tt_gradcheck(ctx, unpermute_fn, &T, 3, in, check, 1e-6, 1e-8, 1e-6);
}

typedef struct drop_args {
    int64_t capacity;
    tm_drop_policy policy;
} drop_args;

static tm_status drop_fn(tm_ctx *ctx, tm_tensor **in, void *user, tm_tensor **out) {
    const drop_args *a = user;
    tm_moe_drop_out d;
    tm_status s = tm_moe_drop_tokens(ctx, in[0], in[1], a->capacity, a->policy, &d);
    if (s == TM_OK) *out = d.probs_kept;
    return s;
}

static double drop_gradcase(tm_ctx *ctx, tm_drop_policy policy) {
    const int64_t T = 11, E = 5;
    double hmap[11 * 5], hprobs[11 * 5];
    random_routing(hmap, hprobs, T, E, 2, 5, 41);
    int64_t ms[2] = {T, E};
    /* probs also off-route (nonzero there, so the mask is what zeroes their gradient) */
    tm_tensor *in[2] = {tt_randu(ctx, TM_F64, 2, ms, 42, 0.05, 1.0), tt_from(ctx, TM_U8, 2, ms, hmap)};
    int check[2] = {1, 0};
    drop_args a = {tm_moe_capacity(T, 2, (int)E, 0.6), policy}; /* 3 of ~4.4 per expert */
    return tt_gradcheck(ctx, drop_fn, &a, 2, in, check, 1e-6, 1e-8, 1e-6);
}

double tt_gradcase_moe_drop_tokens(tm_ctx *ctx) { return drop_gradcase(ctx, TM_DROP_PROBS); }

Test(moe_dispatch, gradcheck_permute) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_permute(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(moe_dispatch, gradcheck_unpermute) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_unpermute(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    tm_ctx_free(ctx);
}

Test(moe_dispatch, gradcheck_drop_tokens) {
    tm_ctx *ctx = tt_ctx();
    double r = tt_gradcase_moe_drop_tokens(ctx);
    cr_assert_leq(r, 1.0, "gradcheck ratio %g", r);
    r = drop_gradcase(ctx, TM_DROP_POSITION);
    cr_assert_leq(r, 1.0, "gradcheck ratio (position) %g", r);
    tm_ctx_free(ctx);
}

/* bf16 x: dx[t] = sum of its rows' gradients, summed in f64 and rounded to bf16 once. */
Test(moe_dispatch, permute_backward_bf16) {
    tm_ctx *ctx = tt_ctx();
    const int64_t T = 13, E = 4, H = 7;
    double hmap[13 * 4], hprobs[13 * 4];
    random_routing(hmap, hprobs, T, E, 2, 4, 51);
    int64_t ms[2] = {T, E}, xs[2] = {T, H};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, ms, hmap), *probs = tt_from(ctx, TM_F32, 2, ms, hprobs);
    tm_tensor *x = tt_randn(ctx, TM_BF16, 2, xs, 52);
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    tm_moe_dispatch d;
    TT_OK(ctx, tm_moe_permute(ctx, x, map, probs, 16, 0, &d));
    int64_t gs[2] = {d.num_rows, H};
    tm_tensor *g = tt_randn(ctx, TM_BF16, 2, gs, 53);
    TT_OK(ctx, tm_backward_with_grad(ctx, d.permuted, g));
    cr_assert_eq(tm_tensor_dtype(tm_tensor_grad(x)), TM_BF16);
    double *hg = tt_read(ctx, g), want[13 * 7] = {0};
    int64_t *rt = malloc(sizeof(int64_t) * (size_t)d.num_rows);
    TT_OK(ctx, tm_tensor_read(ctx, d.row_token, TM_I64, rt, d.num_rows));
    for (int64_t r = 0; r < d.num_rows; r++)
        if (rt[r] >= 0)
            for (int64_t h = 0; h < H; h++) want[rt[r] * H + h] += hg[r * H + h];
    tt_assert_close_host(ctx, tm_tensor_grad(x), want, 1e-2, 4e-3);
    free(hg), free(rt);
    tm_ctx_free(ctx);
}

/* ---- determinism over thread counts ------------------------------------------------------ */

/* Forward outputs and gradients of permute -> unpermute on a size that takes the OpenMP paths,
 * concatenated into one host array. */
static double *dispatch_run(int nthreads, int64_t *n_out) {
    tm_ctx *ctx = tt_ctx_threads(nthreads);
    const int64_t T = 300, E = 8, H = 129, k = 2;
    double *hmap = malloc(sizeof(double) * T * E), *hprobs = malloc(sizeof(double) * T * E);
    random_routing(hmap, hprobs, T, E, k, 7, 61);
    int64_t ms[2] = {T, E}, xs[2] = {T, H};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, ms, hmap), *probs = tt_from(ctx, TM_F32, 2, ms, hprobs);
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 62), *y;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, probs, 1));
    tm_moe_dispatch d;
    TT_OK(ctx, tm_moe_permute(ctx, x, map, probs, 16, 0, &d));
    TT_OK(ctx, tm_moe_unpermute(ctx, d.permuted, d.permuted_probs, d.row_token, T, &y));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, tt_randn(ctx, TM_F32, 2, xs, 63)));
    double *a = tt_read(ctx, y), *b = tt_read(ctx, tm_tensor_grad(x)), *c = tt_read(ctx, tm_tensor_grad(probs));
    int64_t n = 2 * T * H + T * E;
    double *all = malloc(sizeof(double) * (size_t)n);
    memcpy(all, a, sizeof(double) * (size_t)(T * H));
    memcpy(all + T * H, b, sizeof(double) * (size_t)(T * H));
    memcpy(all + 2 * T * H, c, sizeof(double) * (size_t)(T * E));
    free(a), free(b), free(c), free(hmap), free(hprobs);
    tm_ctx_free(ctx);
    *n_out = n;
    return all;
}

Test(moe_dispatch, same_bits_for_any_thread_count) {
    int64_t n;
    double *ref = dispatch_run(2, &n);
    for (int th = 1; th <= 3; th += 2) {
        double *got = dispatch_run(th, &n);
        cr_assert(memcmp(got, ref, sizeof(double) * (size_t)n) == 0, "results differ with %d threads", th);
        free(got);
    }
    free(ref);
}

/* ---- tm_moe_permute_topk ----------------------------------------------------------------- */

/* Every token on exactly k experts: tm_moe_permute_topk gives tm_moe_permute's outputs and
 * gradients bit for bit, with align_size 1 (R = T * k, known without the data), with align
 * padding and with pad_to. */
Test(moe_dispatch, permute_topk_matches_permute) {
    tm_ctx *ctx = tt_ctx();
    const int64_t T = 50, E = 9, H = 6, k = 3;
    double *hm = malloc(sizeof(double) * (size_t)(T * E)), *hp = malloc(sizeof(double) * (size_t)(T * E));
    random_routing(hm, hp, T, E, k, 7, 11);
    int64_t ms[2] = {T, E}, xs[2] = {T, H};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, ms, hm);
    const int64_t cfg[3][2] = {{1, 0}, {8, 0}, {1, 40}};
    for (int i = 0; i < 3; i++) {
        tm_tensor *x[2], *p[2];
        tm_moe_dispatch d[2];
        for (int j = 0; j < 2; j++) {
            x[j] = tt_randn(ctx, TM_F64, 2, xs, 3);
            p[j] = tt_from(ctx, TM_F64, 2, ms, hp);
            TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x[j], 1));
            TT_OK(ctx, tm_tensor_set_requires_grad(ctx, p[j], 1));
            if (j) TT_OK(ctx, tm_moe_permute_topk(ctx, x[j], map, p[j], (int)k, cfg[i][0], cfg[i][1], &d[j]));
            else TT_OK(ctx, tm_moe_permute(ctx, x[j], map, p[j], cfg[i][0], cfg[i][1], &d[j]));
            tm_tensor *a, *b, *l;
            TT_OK(ctx, tm_mul(ctx, d[j].permuted, d[j].permuted, &a));
            TT_OK(ctx, tm_sum_all(ctx, a, &a));
            TT_OK(ctx, tm_mul(ctx, d[j].permuted_probs, d[j].permuted_probs, &b));
            TT_OK(ctx, tm_sum_all(ctx, b, &b));
            TT_OK(ctx, tm_add(ctx, a, b, &l));
            TT_OK(ctx, tm_backward(ctx, l));
        }
        if (cfg[i][0] == 1 && cfg[i][1] == 0) cr_assert_eq(d[1].num_rows, T * k);
        cr_assert_eq(d[1].num_rows, d[0].num_rows);
        const tm_tensor *pairs[6][2] = {{d[1].permuted, d[0].permuted}, {d[1].permuted_probs, d[0].permuted_probs},
                                        {d[1].row_token, d[0].row_token}, {d[1].tokens_per_expert, d[0].tokens_per_expert},
                                        {tm_tensor_grad(x[1]), tm_tensor_grad(x[0])}, {tm_tensor_grad(p[1]), tm_tensor_grad(p[0])}};
        for (int q = 0; q < 6; q++) {
            int64_t n = tm_tensor_numel(pairs[q][1]);
            cr_assert_eq(tm_tensor_numel(pairs[q][0]), n);
            double *a = tt_read(ctx, pairs[q][0]), *b = tt_read(ctx, pairs[q][1]);
            for (int64_t e = 0; e < n; e++) cr_assert(a[e] == b[e], "config %d, output %d [%lld]: %g vs %g", i, q, (long long)e, a[e], b[e]);
            free(a), free(b);
        }
    }
    free(hm), free(hp);
    tm_ctx_free(ctx);
}

/* The CPU checks topk's promise (T * topk routed pairs) and its range. */
Test(moe_dispatch, bad_permute_topk) {
    tm_ctx *ctx = tt_ctx();
    int64_t ms[2] = {6, 3}, xs[2] = {6, 4};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, ms, EX_MAP), *probs = tt_from(ctx, TM_F32, 2, ms, EX_PROBS);
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1);
    tm_moe_dispatch d;
    /* EX_MAP routes 12 pairs (two per token), not 6 * 1 */
    assert_err(ctx, tm_moe_permute_topk(ctx, x, map, probs, 1, 1, 0, &d), TM_ERR_INVALID_ARG, "moe_permute",
               "routes 12", "6 * 1");
    TT_OK(ctx, tm_moe_permute_topk(ctx, x, map, probs, 2, 1, 0, &d));
    cr_assert_eq(d.num_rows, 12);
    assert_err(ctx, tm_moe_permute_topk(ctx, x, map, probs, -1, 1, 0, &d), TM_ERR_INVALID_ARG, "moe_permute",
               "topk = -1", NULL);
    assert_err(ctx, tm_moe_permute_topk(ctx, x, map, probs, 4, 1, 0, &d), TM_ERR_INVALID_ARG, "moe_permute",
               "topk = 4", "E = 3");
    /* Where R depends on the data anyway (align padding), the count is not compared. */
    TT_OK(ctx, tm_moe_permute_topk(ctx, x, map, probs, 1, 4, 0, &d));
    tm_ctx_free(ctx);
}

/* tm__moe_permute_counted (the chunked expert-parallel dispatch's receiver permute): given the
 * padded rows per expert, the same outputs and gradients as tm_moe_permute without its
 * synchronisation, tokens_per_expert mirrored with those rows; counts that differ from the
 * map's are refused on the CPU, naming the expert. */
Test(moe_dispatch, permute_counted_matches_permute_without_a_read) {
    tm_ctx *ctx = tt_ctx();
    const int64_t T = 40, E = 6, H = 5, k = 2;
    double *hm = malloc(sizeof(double) * (size_t)(T * E)), *hp = malloc(sizeof(double) * (size_t)(T * E));
    random_routing(hm, hp, T, E, k, 5, 23); /* one expert empty */
    int64_t ms[2] = {T, E}, xs[2] = {T, H};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, ms, hm);
    const int64_t cfg[3][2] = {{1, 0}, {4, 0}, {1, 30}};
    for (int i = 0; i < 3; i++) {
        int64_t rows[8];
        for (int64_t e = 0; e < E; e++) {
            int64_t n = 0;
            for (int64_t t = 0; t < T; t++) n += hm[t * E + e] != 0;
            rows[e] = cfg[i][1] > 0 ? cfg[i][1] : (n + cfg[i][0] - 1) / cfg[i][0] * cfg[i][0];
        }
        tm_tensor *x[2], *p[2];
        tm_moe_dispatch d[2];
        uint64_t syncs[2];
        for (int j = 0; j < 2; j++) {
            x[j] = tt_randn(ctx, TM_F64, 2, xs, 3);
            p[j] = tt_from(ctx, TM_F64, 2, ms, hp);
            TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x[j], 1));
            TT_OK(ctx, tm_tensor_set_requires_grad(ctx, p[j], 1));
            uint64_t before = tm_ctx_sync_count(ctx);
            if (j) TT_OK(ctx, tm__moe_permute_counted(ctx, x[j], map, p[j], cfg[i][0], cfg[i][1], rows, &d[j]));
            else TT_OK(ctx, tm_moe_permute(ctx, x[j], map, p[j], cfg[i][0], cfg[i][1], &d[j]));
            syncs[j] = tm_ctx_sync_count(ctx) - before;
            tm_tensor *a, *b, *l;
            TT_OK(ctx, tm_mul(ctx, d[j].permuted, d[j].permuted, &a));
            TT_OK(ctx, tm_sum_all(ctx, a, &a));
            TT_OK(ctx, tm_mul(ctx, d[j].permuted_probs, d[j].permuted_probs, &b));
            TT_OK(ctx, tm_sum_all(ctx, b, &b));
            TT_OK(ctx, tm_add(ctx, a, b, &l));
            TT_OK(ctx, tm_backward(ctx, l));
        }
        cr_assert_eq(syncs[1], 0, "config %d: the counted permute synchronised %llu times", i, (unsigned long long)syncs[1]);
        cr_assert_eq(syncs[0], cfg[i][1] > 0 ? 0 : 1, "config %d: tm_moe_permute %llu", i, (unsigned long long)syncs[0]);
        const int64_t *mir = tm__mirror_find(ctx, d[1].tokens_per_expert);
        cr_assert(mir, "config %d: tokens_per_expert not mirrored", i);
        for (int64_t e = 0; e < E; e++) cr_assert_eq(mir[e], rows[e]);
        cr_assert_eq(d[1].num_rows, d[0].num_rows);
        const tm_tensor *pairs[6][2] = {{d[1].permuted, d[0].permuted}, {d[1].permuted_probs, d[0].permuted_probs},
                                        {d[1].row_token, d[0].row_token}, {d[1].tokens_per_expert, d[0].tokens_per_expert},
                                        {tm_tensor_grad(x[1]), tm_tensor_grad(x[0])}, {tm_tensor_grad(p[1]), tm_tensor_grad(p[0])}};
        for (int q = 0; q < 6; q++) {
            int64_t n = tm_tensor_numel(pairs[q][1]);
            cr_assert_eq(tm_tensor_numel(pairs[q][0]), n);
            double *a = tt_read(ctx, pairs[q][0]), *b = tt_read(ctx, pairs[q][1]);
            for (int64_t e = 0; e < n; e++) cr_assert(a[e] == b[e], "config %d, output %d [%lld]: %g vs %g", i, q, (long long)e, a[e], b[e]);
            free(a), free(b);
        }
        /* a wrong count: one row moved from the last expert to the first (the same R) */
        if (cfg[i][1] == 0) {
            int64_t bad[8];
            memcpy(bad, rows, sizeof bad);
            bad[0] += cfg[i][0], bad[E - 1] -= cfg[i][0];
            tm_moe_dispatch dd;
            if (bad[E - 1] >= 0)
                assert_err(ctx, tm__moe_permute_counted(ctx, x[0], map, p[0], cfg[i][0], 0, bad, &dd), TM_ERR_INVALID_ARG,
                           "moe_permute (counted)", "expert 0", NULL);
            bad[E - 1] += 2 * cfg[i][0]; /* R off by align */
            assert_err(ctx, tm__moe_permute_counted(ctx, x[0], map, p[0], cfg[i][0], 0, bad, &dd), TM_ERR_INVALID_ARG,
                       "moe_permute", "caller's counts", NULL);
        }
    }
    free(hm), free(hp);
    tm_ctx_free(ctx);
}

/* ---- bad inputs -------------------------------------------------------------------------- */

Test(moe_dispatch, bad_permute) {
    tm_ctx *ctx = tt_ctx();
    int64_t ms[2] = {6, 3}, xs[2] = {6, 4}, x5[2] = {5, 4}, p4[2] = {6, 4};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, ms, EX_MAP), *probs = tt_from(ctx, TM_F32, 2, ms, EX_PROBS);
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 1);
    tm_moe_dispatch d;
    assert_err(ctx, tm_moe_permute(ctx, x, map, probs, 0, 0, &d), TM_ERR_INVALID_ARG, "moe_permute", "align_size = 0", NULL);
    assert_err(ctx, tm_moe_permute(ctx, x, map, probs, 1, -2, &d), TM_ERR_INVALID_ARG, "moe_permute", "pad_to = -2", NULL);
    assert_err(ctx, tm_moe_permute(ctx, x, probs, probs, 1, 0, &d), TM_ERR_DTYPE, "moe_permute", "routing_map", "f32[6,3]");
    assert_err(ctx, tm_moe_permute(ctx, tt_randn(ctx, TM_F32, 2, x5, 2), tt_from(ctx, TM_U8, 2, ms, EX_MAP), probs, 1, 0, &d),
               TM_ERR_SHAPE, "moe_permute", "[5,4]", "[6,3]");
    assert_err(ctx, tm_moe_permute(ctx, x, map, tt_randn(ctx, TM_F32, 2, p4, 3), 1, 0, &d), TM_ERR_SHAPE, "moe_permute",
               "routing_map", "[6,4]");
    assert_err(ctx, tm_moe_permute(ctx, x, map, probs, 1, 0, NULL), TM_ERR_INVALID_ARG, "moe_permute", "out", NULL);
    tm_ctx_free(ctx);
}

Test(moe_dispatch, bad_drop_tokens) {
    tm_ctx *ctx = tt_ctx();
    int64_t ms[2] = {6, 3}, m2[2] = {6, 2};
    tm_tensor *map = tt_from(ctx, TM_U8, 2, ms, EX_MAP), *probs = tt_from(ctx, TM_F32, 2, ms, EX_PROBS);
    tm_moe_drop_out d;
    assert_err(ctx, tm_moe_drop_tokens(ctx, probs, map, -1, TM_DROP_PROBS, &d), TM_ERR_INVALID_ARG,
               "moe_drop_tokens", "capacity = -1", NULL);
    cr_assert(!d.probs_kept && !d.map_kept && !d.tokens_per_expert && !d.dropped, "outputs left set on failure");
    assert_err(ctx, tm_moe_drop_tokens(ctx, probs, map, 2, (tm_drop_policy)7, &d), TM_ERR_INVALID_ARG,
               "moe_drop_tokens", "policy = 7", NULL);
    assert_err(ctx, tm_moe_drop_tokens(ctx, probs, tt_from(ctx, TM_U8, 2, m2, EX_MAP), 2, TM_DROP_PROBS, &d),
               TM_ERR_SHAPE, "moe_drop_tokens", "u8[6,2]", "f32[6,3]");
    assert_err(ctx, tm_moe_drop_tokens(ctx, map, map, 2, TM_DROP_PROBS, &d), TM_ERR_DTYPE,
               "moe_drop_tokens", "probs", "u8[6,3]");
    assert_err(ctx, tm_moe_drop_tokens(ctx, probs, map, 2, TM_DROP_PROBS, NULL), TM_ERR_INVALID_ARG,
               "moe_drop_tokens", "out", NULL);
    tm_ctx_free(ctx);
}

Test(moe_dispatch, bad_unpermute) {
    tm_ctx *ctx = tt_ctx();
    int64_t es[2] = {4, 3}, rs[1] = {4}, r3[1] = {3};
    const double rt_hi[4] = {0, 1, 5, 2}, rt_neg[4] = {0, -2, 1, 2}, rt_ok[4] = {0, 1, -1, 2};
    tm_tensor *eo = tt_randn(ctx, TM_F32, 2, es, 1), *p = tt_randu(ctx, TM_F32, 1, rs, 2, 0, 1), *y;
    assert_err(ctx, tm_moe_unpermute(ctx, eo, p, tt_from(ctx, TM_I64, 1, rs, rt_hi), 5, &y), TM_ERR_INDEX, "moe_unpermute",
               "row_token[2] = 5", "num_tokens = 5");
    assert_err(ctx, tm_moe_unpermute(ctx, eo, p, tt_from(ctx, TM_I64, 1, rs, rt_neg), 5, &y), TM_ERR_INDEX, "moe_unpermute",
               "row_token[1] = -2", NULL);
    tm_tensor *ok = tt_from(ctx, TM_I64, 1, rs, rt_ok);
    assert_err(ctx, tm_moe_unpermute(ctx, eo, p, tt_from(ctx, TM_I64, 1, r3, rt_ok), 5, &y), TM_ERR_SHAPE, "moe_unpermute",
               "row_token", "i64[3]");
    assert_err(ctx, tm_moe_unpermute(ctx, eo, tt_randu(ctx, TM_F32, 1, r3, 3, 0, 1), ok, 5, &y), TM_ERR_SHAPE,
               "moe_unpermute", "permuted_probs", "f32[3]");
    assert_err(ctx, tm_moe_unpermute(ctx, eo, tt_randu(ctx, TM_F64, 1, rs, 3, 0, 1), ok, 5, &y), TM_ERR_DTYPE,
               "moe_unpermute", "permuted_probs", "f64[4]");
    assert_err(ctx, tm_moe_unpermute(ctx, eo, p, eo, 5, &y), TM_ERR_DTYPE, "moe_unpermute", "row_token", "f32[4,3]");
    assert_err(ctx, tm_moe_unpermute(ctx, eo, p, ok, -1, &y), TM_ERR_INVALID_ARG, "moe_unpermute", "num_tokens = -1", NULL);
    TT_OK(ctx, tm_moe_unpermute(ctx, eo, p, ok, 3, &y));
    tm_ctx_free(ctx);
}

/* ---- tm_moe_accumulate_counts ------------------------------------------------------------ */

Test(moe_accumulate_counts, adds_in_place_and_reads_nothing_back) {
    tm_ctx *ctx = tt_ctx();
    int64_t E = 4, two = 2;
    tm_tensor *sum;
    TT_OK(ctx, tm_buffer_new(ctx, "sum", TM_I64, 1, &E, tm_cpu(), &sum));
    const int64_t a[4] = {3, 0, 5, 1}, b[4] = {1, 2, 0, 7}, ab[4] = {4, 2, 5, 8};
    tm_tensor *ta, *tb;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &E, tm_cpu(), TM_I64, a, &ta));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &E, tm_cpu(), TM_I64, b, &tb));
    uint64_t before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_moe_accumulate_counts(ctx, sum, ta));
    TT_OK(ctx, tm_moe_accumulate_counts(ctx, sum, tb));
    cr_assert_eq(tm_ctx_sync_count(ctx), before);
    assert_exact_i64(ctx, sum, ab, 4, "sum");
    /* Wrong dtype, shape, a NULL. */
    tm_tensor *i32, *e3;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I32, 1, &E, tm_cpu(), TM_I64, a, &i32));
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 1, &two, tm_cpu(), TM_I64, a, &e3));
    assert_err(ctx, tm_moe_accumulate_counts(ctx, sum, i32), TM_ERR_DTYPE, "moe_accumulate_counts", "i32[4]", NULL);
    assert_err(ctx, tm_moe_accumulate_counts(ctx, sum, e3), TM_ERR_SHAPE, "moe_accumulate_counts", "i64[2]", "i64[4]");
    assert_err(ctx, tm_moe_accumulate_counts(ctx, sum, NULL), TM_ERR_INVALID_ARG, "moe_accumulate_counts", NULL, NULL);
    assert_exact_i64(ctx, sum, ab, 4, "sum after refused calls");
    tm_ctx_free(ctx);
}
