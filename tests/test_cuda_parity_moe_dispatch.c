/*
 * test_cuda_parity_moe_dispatch.c — the MoE dispatch ops on CUDA against the CPU: moe_permute
 * (also tm_moe_permute_topk), moe_unpermute and grouped_matmul, forward and backward with
 * random inputs and random upstream gradients, f32 and bf16, on routings with ragged and EMPTY
 * expert groups over an odd expert count (E = 7), align_size 1, 8 and 16, pad_to (capacity),
 * topk, i32 and i64 row_token, with and without probs, and 0 tokens; rows of 19 or 21
 * elements (one element per access), 36 (16-byte vectors for f32 only) and 64 (16-byte
 * vectors for both), and a row pointer off 16-byte alignment (the fallback); then the chain of
 * the MoE layer (permute -> grouped SwiGLU GEMMs -> unpermute) and the synchronisations each
 * op makes (tm_ctx_sync_count), the same on both devices: permute one (its row count) where R
 * depends on the data, none with pad_to or with topk and align_size 1; grouped_matmul none on
 * a permute's tokens_per_expert that the host has (read back, or pad_to each: their host
 * mirror) and one on other counts (a topk permute's, or any others: read back once, then
 * mirrored), unpermute none. bf16 grouped_matmul has two paths, each tested in a context set
 * to it (tm__set_gmm_device_schedule), whatever tm_ctx_options.grouped_gemm says: cuBLASLt per group (the
 * default), whose synchronisations are f32's; and the tensor-core kernel with its schedule on
 * the device: no synchronisation at all, both code paths (cp.async for K, N multiples of 8;
 * element-wise loads otherwise) on ragged, empty and sub-tile groups, bitwise reproducible;
 * mirrored counts validated, others clamped. TM_GROUPED_GEMM_HOPPER (the sm_90a wgmma + TMA kernel,
 * kernels/cuda/grouped_matmul_sm90.cu): the same cases and an odd group count, shapes off its
 * 128 x 256 x 64 tiles; on an sm_90 device the test asserts that the Hopper kernel ran (tm__gmm_note
 * empty) wherever K and N are multiples of 8, elsewhere that it fell back with the reason.
 *
 * Tolerances (|cuda - cpu| <= atol + rtol |cpu|):
 *   permute's outputs, exact: both sides move bits (bf16 included) and place rows alike.
 *   f32   atol 1e-5, rtol 1e-5: both sum in f32 (the CPU permute backward and unpermute's
 *         d probs in f64), cuBLASLt without TF32: only the summation order differs.
 *   bf16  atol 1e-2, rtol 1e-2: f32 arithmetic from the same bf16 inputs, rounded once; a
 *         result near a rounding boundary may land on the neighbouring bf16 value (2^-8). The
 *         grouped GEMM's f32 sums (up to 423 terms of |.| < 4 here) differ by summation order
 *         only, O(1e-5) absolute, far below that.
 *   the layer chain, f32: atol 1e-4, rtol 1e-4 (three GEMMs and a SwiGLU in sequence, each
 *         contributing f32 summation-order differences of O(1e-6) relative).
 * Every test skips when no CUDA device is visible.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"
#include "parity.h"

TT_PARITY_COVERS("moe_permute")
TT_PARITY_COVERS("moe_unpermute")
TT_PARITY_COVERS("grouped_matmul")

enum { E7 = 7 };

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* map [T*E] 0/1: each token routes to 1..3 distinct experts, never to experts 1 and 4 (empty
 * groups); with cap > 0 an expert keeps only its first cap tokens (as TM_DROP_POSITION). */
static void routing(double *map, int64_t T, int64_t E, int64_t cap, uint64_t seed) {
    uint64_t s = seed;
    int64_t *used = calloc((size_t)E, sizeof *used);
    memset(map, 0, sizeof(double) * (size_t)(T * E));
    for (int64_t t = 0; t < T; t++) {
        int64_t k = 1 + (int64_t)(splitmix(&s) % 3);
        for (int64_t j = 0; j < k; j++) {
            int64_t e = (int64_t)(splitmix(&s) % (uint64_t)E);
            if (e == 1 || e == 4 || map[t * E + e] || (cap > 0 && used[e] >= cap)) continue;
            map[t * E + e] = 1;
            used[e]++;
        }
    }
    free(used);
}

/* map [T*E] 0/1: each token routes to exactly k distinct experts, never to experts 1 and 4
 * (k <= E - 2; a router's map, as tm_moe_permute_topk wants). */
static void routing_k(double *map, int64_t T, int64_t E, int64_t k, uint64_t seed) {
    uint64_t s = seed;
    memset(map, 0, sizeof(double) * (size_t)(T * E));
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < k;) {
            int64_t e = (int64_t)(splitmix(&s) % (uint64_t)E);
            if (e == 1 || e == 4 || map[t * E + e]) continue;
            map[t * E + e] = 1;
            j++;
        }
}

static tm_tensor *from(tm_ctx *ctx, tm_dtype dt, int nd, const int64_t *shape, tm_device dev, const double *v,
                       int grad) {
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, dt, nd, shape, dev, TM_F64, v, &t));
    if (grad) TT_OK(ctx, tm_tensor_set_requires_grad(ctx, t, 1));
    return t;
}

/* As from(), but a contiguous view one element into a larger 1-D tensor *base (which gets
 * the gradient): its data pointer is off 16-byte alignment, so the CUDA row kernels take their
 * one-element-per-access path. */
static tm_tensor *from_offset(tm_ctx *ctx, tm_dtype dt, int nd, const int64_t *shape, tm_device dev, const double *v,
                              int grad, tm_tensor **base) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    int64_t n1 = n + 1;
    double *h = malloc(sizeof(double) * (size_t)n1);
    h[0] = 0.5;
    memcpy(h + 1, v, sizeof(double) * (size_t)n);
    *base = from(ctx, dt, 1, &n1, dev, h, grad);
    free(h);
    tm_tensor *s, *t;
    TT_OK(ctx, tm_slice(ctx, *base, 0, 1, n1, &s));
    TT_OK(ctx, tm_reshape(ctx, s, nd, shape, &t));
    return t;
}

/* Bitwise equal values (as f64: exact for every dtype used here). */
static void assert_same(tm_ctx *ctx, const tm_tensor *got, const tm_tensor *want, const char *what) {
    int64_t n = tm_tensor_numel(want);
    cr_assert_eq(tm_tensor_numel(got), n, "%s: %lld elements on CUDA, %lld on the CPU", what,
                 (long long)tm_tensor_numel(got), (long long)n);
    double *a = tt_read(ctx, got), *b = tt_read(ctx, want);
    for (int64_t i = 0; i < n; i++)
        cr_assert(a[i] == b[i], "%s[%lld]: CUDA %.9g, CPU %.9g", what, (long long)i, a[i], b[i]);
    free(a), free(b);
}

static void assert_on_cuda(const tm_tensor *t, const char *what) {
    cr_assert_eq(tm_tensor_device(t).type, TM_DEVICE_CUDA, "%s is not on the CUDA device", what);
}

/* ---- moe_permute ------------------------------------------------------------------------- */

/* One permute case over E experts (at most 64): rows of H elements; topk > 0 routes every
 * token to exactly topk experts and runs tm_moe_permute_topk; misalign puts x one element off
 * 16-byte alignment. */
static void permute_case_e(tm_dtype xdt, tm_dtype pdt, int64_t T, int64_t H, int64_t E, int64_t align, int64_t pad_to,
                           int topk, int misalign, double atol, double rtol) {
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t cap = pad_to > 0 ? pad_to : 0;
    cr_assert(E >= 5 && E <= 64, "permute_case_e: E = %lld", (long long)E);
    int64_t xs[2] = {T, H}, ms[2] = {T, E};
    double *hx = tt_parity_uniform(T * H, 100 + (uint64_t)T), *hp = tt_parity_uniform(T * E, 200 + (uint64_t)T);
    double *hm = malloc(sizeof(double) * (size_t)(T * E + 1));
    if (topk > 0) routing_k(hm, T, E, topk, 300 + (uint64_t)T);
    else routing(hm, T, E, cap, 300 + (uint64_t)T);
    /* R known without the data: nothing read back, on either device. */
    const uint64_t want_syncs = pad_to > 0 || (topk > 0 && align == 1) ? 0 : 1;
    tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
    tm_tensor *x[2], *xg[2], *p[2];
    tm_moe_dispatch d[2];
    double *g1 = NULL, *g2 = NULL;
    const char *tag = tm_dtype_name(xdt);
    /* Each side runs forward then backward before the other starts: a backward consumes the
     * whole tape. */
    for (int k = 0; k < 2; k++) {
        if (misalign) x[k] = from_offset(ctx, xdt, 2, xs, devs[k], hx, 1, &xg[k]);
        else x[k] = xg[k] = from(ctx, xdt, 2, xs, devs[k], hx, 1);
        p[k] = from(ctx, pdt, 2, ms, devs[k], hp, 1);
        tm_tensor *m = from(ctx, TM_U8, 2, ms, devs[k], hm, 0);
        uint64_t before = tm_ctx_sync_count(ctx);
        TT_OK(ctx, tm_moe_permute_topk(ctx, x[k], m, p[k], topk, align, pad_to, &d[k]));
        uint64_t n = tm_ctx_sync_count(ctx) - before;
        cr_assert_eq(n, want_syncs, "permute (align %lld, pad_to %lld, topk %d) on %s: %llu synchronisations, want %llu",
                     (long long)align, (long long)pad_to, topk, k ? "CUDA" : "the CPU", (unsigned long long)n,
                     (unsigned long long)want_syncs);
        cr_assert_eq(d[k].num_rows, d[0].num_rows, "%s T=%lld align %lld pad_to %lld: R %lld on CUDA, %lld on the CPU",
                     tag, (long long)T, (long long)align, (long long)pad_to, (long long)d[k].num_rows,
                     (long long)d[0].num_rows);
        if (topk > 0 && align == 1) cr_assert_eq(d[k].num_rows, T * topk);
        const int64_t R = d[0].num_rows;
        if (T == 0 || R == 0) continue;
        /* loss = <permuted, G1> + <permuted_probs, G2>: upstream gradients G1, G2. */
        int64_t gs[2] = {R, H};
        if (!g1) g1 = tt_parity_uniform(R * H, 400), g2 = tt_parity_uniform(R, 500);
        tm_tensor *a, *b, *la, *lb, *l;
        TT_OK(ctx, tm_mul(ctx, d[k].permuted, from(ctx, xdt, 2, gs, devs[k], g1, 0), &a));
        TT_OK(ctx, tm_mul(ctx, d[k].permuted_probs, from(ctx, pdt, 1, &R, devs[k], g2, 0), &b));
        TT_OK(ctx, tm_sum_all(ctx, a, &la));
        TT_OK(ctx, tm_sum_all(ctx, b, &lb));
        if (pdt != xdt) TT_OK(ctx, tm_cast(ctx, lb, xdt, &lb));
        TT_OK(ctx, tm_add(ctx, la, lb, &l));
        before = tm_ctx_sync_count(ctx);
        TT_OK(ctx, tm_backward(ctx, l));
        cr_assert_eq(tm_ctx_sync_count(ctx), before, "permute backward synchronised");
    }
    const int64_t R = d[0].num_rows;
    assert_on_cuda(d[1].permuted, "permuted");
    assert_on_cuda(d[1].tokens_per_expert, "tokens_per_expert");
    assert_same(ctx, d[1].tokens_per_expert, d[0].tokens_per_expert, "tokens_per_expert");
    assert_same(ctx, d[1].row_token, d[0].row_token, "row_token");
    assert_same(ctx, d[1].permuted, d[0].permuted, "permuted");
    assert_same(ctx, d[1].permuted_probs, d[0].permuted_probs, "permuted_probs");
    /* The case is what it claims: padded blocks, empty experts. */
    int64_t tpe[64];
    TT_OK(ctx, tm_tensor_read(ctx, d[1].tokens_per_expert, TM_I64, tpe, E));
    for (int64_t e = 0; e < E; e++) {
        if (pad_to > 0) cr_assert_eq(tpe[e], pad_to, "expert %lld: %lld rows, want pad_to", (long long)e, (long long)tpe[e]);
        else cr_assert_eq(tpe[e] % align, 0, "expert %lld: %lld rows, not a multiple of %lld", (long long)e, (long long)tpe[e],
                          (long long)align);
    }
    if (pad_to == 0) cr_assert(tpe[1] == 0 && tpe[4] == 0, "experts 1 and 4 must be empty groups");
    if (T > 0 && R > 0) {
        cr_assert(tm_tensor_grad(xg[1]) && tm_tensor_grad(p[1]), "no gradient on CUDA");
        tt_assert_close(ctx, tm_tensor_grad(xg[1]), tm_tensor_grad(xg[0]), atol, rtol);
        tt_assert_close(ctx, tm_tensor_grad(p[1]), tm_tensor_grad(p[0]), atol, rtol);
    }
    free(g1), free(g2);
    free(hx), free(hp), free(hm);
    tm_ctx_free(ctx);
}

static void permute_case_ex(tm_dtype xdt, tm_dtype pdt, int64_t T, int64_t H, int64_t align, int64_t pad_to, int topk,
                            int misalign, double atol, double rtol) {
    permute_case_e(xdt, pdt, T, H, E7, align, pad_to, topk, misalign, atol, rtol);
}

static void permute_case(tm_dtype xdt, tm_dtype pdt, int64_t T, int64_t align, int64_t pad_to, double atol, double rtol) {
    permute_case_ex(xdt, pdt, T, 19, align, pad_to, 0, 0, atol, rtol);
}

static void permute_all(tm_dtype dt, double atol, double rtol) {
    const int64_t aligns[3] = {1, 8, 16};
    for (int i = 0; i < 3; i++) {
        permute_case(dt, dt, 37, aligns[i], 0, atol, rtol);
        permute_case(dt, dt, 0, aligns[i], 0, atol, rtol); /* no tokens: R = 0 */
    }
    permute_case(dt, dt, 37, 1, 9, atol, rtol);  /* capacity: every expert exactly 9 rows */
    permute_case(dt, dt, 0, 8, 5, atol, rtol);   /* no tokens, pad_to: R = 7 * 5 padding rows */
    permute_case(dt, dt, 300, 16, 0, atol, rtol); /* several scan chunks per expert column */
    /* Row lengths: 64 (16-byte vectors for f32 and bf16), 36 (vectors of 16 bytes for f32,
     * 8 for bf16), 19 (one element per access), and 64 off alignment. */
    const int64_t hs[3] = {64, 36, 19};
    for (int i = 0; i < 3; i++) {
        permute_case_ex(dt, dt, 300, hs[i], 1, 0, 3, 0, atol, rtol);  /* topk: R = T * 3, nothing read back */
        permute_case_ex(dt, dt, 1100, hs[i], 8, 0, 2, 0, atol, rtol); /* topk with align: read back */
        permute_case_ex(dt, dt, 300, hs[i], 1, 60, 0, 0, atol, rtol); /* pad_to: nothing read back */
    }
    permute_case_ex(dt, dt, 300, 64, 1, 0, 3, 1, atol, rtol);
    permute_case_ex(dt, dt, 300, 64, 16, 0, 0, 1, atol, rtol);
    permute_case_ex(dt, dt, 0, 64, 1, 0, 2, 0, atol, rtol); /* topk, no tokens: R = 0 */
    permute_case_ex(dt, dt, 5000, 64, 1, 0, 4, 0, atol, rtol); /* 157 tiles: a long scan per expert */
}

Test(cuda_parity_moe, permute_f32) {
    TT_SKIP_WITHOUT_CUDA();
    permute_all(TM_F32, 1e-5, 1e-5);
}

Test(cuda_parity_moe, permute_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    permute_all(TM_BF16, 1e-2, 1e-2);
    permute_case(TM_BF16, TM_F32, 37, 8, 0, 1e-2, 1e-2); /* probs keep their own dtype */
    permute_case_ex(TM_BF16, TM_F32, 300, 64, 1, 0, 2, 0, 1e-2, 1e-2);
}

/* The CUDA permute backward lists a token's routed rows (up to 32) and loads 8 of them at a
 * time: a long row (several chunks of a warp's vectors), more than 8 rows a token (two
 * groups), and more than 32 (the rescanning fallback), on both the vector and the
 * one-element paths. */
Test(cuda_parity_moe, permute_many_rows_per_token) {
    TT_SKIP_WITHOUT_CUDA();
    permute_case_e(TM_BF16, TM_BF16, 300, 1024, 16, 1, 0, 4, 0, 1e-2, 1e-2);
    permute_case_e(TM_F32, TM_F32, 300, 1024, 16, 1, 0, 4, 0, 1e-5, 1e-5);
    const tm_dtype dts[2] = {TM_F32, TM_BF16};
    for (int i = 0; i < 2; i++) {
        const double tol = dts[i] == TM_F32 ? 1e-5 : 1e-2;
        permute_case_e(dts[i], dts[i], 100, 64, 16, 1, 0, 12, 0, tol, tol);
        permute_case_e(dts[i], dts[i], 100, 19, 16, 1, 0, 12, 0, tol, tol);
        permute_case_e(dts[i], dts[i], 64, 64, 40, 1, 0, 36, 0, tol, tol);
        permute_case_e(dts[i], dts[i], 64, 36, 40, 8, 0, 36, 1, tol, tol);
    }
}

/* CUDA does not read the counts back under pad_to or topk, so it cannot report an expert
 * above pad_to (the CPU does: tests/test_moe_dispatch.c): such an expert's tokens past the
 * first pad_to get no row and no gradient; every other row is the CPU's, placed alike. */
Test(cuda_parity_moe, permute_pad_to_overflow_drops_on_cuda) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t T = 40, E = E7, H = 16, pad_to = 6;
    int64_t xs[2] = {T, H}, ms[2] = {T, E};
    double *hx = tt_parity_uniform(T * H, 7), *hp = tt_parity_uniform(T * E, 8), hm[40 * E7], hk[40 * E7];
    routing(hm, T, E, 0, 9);   /* overflows pad_to */
    routing(hk, T, E, pad_to, 9); /* the same with each expert's tokens past pad_to dropped */
    tm_moe_dispatch d[2];
    tm_tensor *x[2];
    for (int k = 0; k < 2; k++) {
        tm_device dev = k ? tm_cuda(0) : tm_cpu();
        x[k] = from(ctx, TM_F32, 2, xs, dev, hx, 1);
        uint64_t before = tm_ctx_sync_count(ctx);
        TT_OK(ctx, tm_moe_permute(ctx, x[k], from(ctx, TM_U8, 2, ms, dev, k ? hm : hk, 0),
                                  from(ctx, TM_F32, 2, ms, dev, hp, 0), 1, pad_to, &d[k]));
        cr_assert_eq(tm_ctx_sync_count(ctx), before);
        tm_tensor *l;
        TT_OK(ctx, tm_sum_all(ctx, d[k].permuted, &l));
        TT_OK(ctx, tm_backward(ctx, l));
    }
    cr_assert_eq(d[1].num_rows, E * pad_to);
    assert_same(ctx, d[1].row_token, d[0].row_token, "row_token");
    assert_same(ctx, d[1].permuted, d[0].permuted, "permuted");
    assert_same(ctx, d[1].permuted_probs, d[0].permuted_probs, "permuted_probs");
    assert_same(ctx, d[1].tokens_per_expert, d[0].tokens_per_expert, "tokens_per_expert");
    tt_assert_close(ctx, tm_tensor_grad(x[1]), tm_tensor_grad(x[0]), 1e-5, 1e-5);
    free(hx), free(hp);
    tm_ctx_free(ctx);
}

/* ---- moe_unpermute ----------------------------------------------------------------------- */

/* row_token of R rows over T tokens, unsorted, several rows per token, tokens 2 and 5 without
 * rows, some padding (-1). bad > 0: also values outside [-1, T) (CUDA treats them as padding);
 * *clean gets the same with those replaced by -1 (what the CPU is given). */
static void row_tokens(double *rt, double *clean, int64_t R, int64_t T, int bad, uint64_t seed) {
    uint64_t s = seed;
    for (int64_t r = 0; r < R; r++) {
        int64_t t = T > 0 ? (int64_t)(splitmix(&s) % (uint64_t)(T + 2)) - 1 : -1; /* [-1, T] */
        if (t >= T || t == 2 || t == 5) t = -1;
        rt[r] = clean[r] = (double)t;
    }
    if (bad)
        for (int64_t r = 3; r < R; r += 11) {
            rt[r] = (r / 11) % 2 ? (double)T + (double)(r % 4) : -2.0 - (double)(r % 3);
            clean[r] = -1;
        }
}

/* One unpermute case: rows of H elements; misalign puts expert_out one element off 16-byte
 * alignment. */
static void unpermute_case_ex(tm_dtype dt, tm_dtype pdt, int with_probs, tm_dtype idt, int64_t R, int64_t T, int64_t H,
                              int bad, int misalign, double atol, double rtol) {
    tm_ctx *ctx = tt_parity_ctx();
    tm__test_fresh_hooks(ctx, 1, 0); /* fresh gradients start as NaN: padding rows left unwritten would show */
    int64_t es[2] = {R, H}, ys[2] = {T, H};
    double *he = tt_parity_uniform(R * H, 600 + (uint64_t)R), *hp = tt_parity_uniform(R, 700 + (uint64_t)R);
    double *hdy = tt_parity_uniform(T * H, 800 + (uint64_t)T);
    double *hrt = malloc(sizeof(double) * (size_t)(R ? R : 1)), *hclean = malloc(sizeof(double) * (size_t)(R ? R : 1));
    row_tokens(hrt, hclean, R, T, bad, 900 + (uint64_t)R);
    tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
    tm_tensor *eo[2], *eog[2], *p[2] = {NULL, NULL}, *y[2];
    for (int k = 0; k < 2; k++) {
        if (misalign) eo[k] = from_offset(ctx, dt, 2, es, devs[k], he, 1, &eog[k]);
        else eo[k] = eog[k] = from(ctx, dt, 2, es, devs[k], he, 1);
        if (with_probs) p[k] = from(ctx, pdt, 1, &R, devs[k], hp, 1);
        tm_tensor *rt = from(ctx, idt, 1, &R, devs[k], k ? hrt : hclean, 0);
        uint64_t before = tm_ctx_sync_count(ctx);
        TT_OK(ctx, tm_moe_unpermute(ctx, eo[k], p[k], rt, T, &y[k]));
        if (T > 0 && R > 0) TT_OK(ctx, tm_backward_with_grad(ctx, y[k], from(ctx, dt, 2, ys, devs[k], hdy, 0)));
        cr_assert_eq(tm_ctx_sync_count(ctx), before, "unpermute on %s synchronised", k ? "CUDA" : "the CPU");
    }
    assert_on_cuda(y[1], "y");
    cr_assert_eq(tm_tensor_dim(y[1], 0), T);
    tt_assert_close(ctx, y[1], y[0], atol, rtol);
    if (T > 0 && R > 0) {
        cr_assert(tm_tensor_grad(eog[1]), "no gradient of expert_out on CUDA");
        tt_assert_close(ctx, tm_tensor_grad(eog[1]), tm_tensor_grad(eog[0]), atol, rtol);
        if (with_probs) {
            cr_assert(tm_tensor_grad(p[1]), "no gradient of permuted_probs on CUDA");
            tt_assert_close(ctx, tm_tensor_grad(p[1]), tm_tensor_grad(p[0]), atol, rtol);
        }
    }
    free(he), free(hp), free(hdy), free(hrt), free(hclean);
    tm_ctx_free(ctx);
}

static void unpermute_case(tm_dtype dt, tm_dtype pdt, int with_probs, tm_dtype idt, int64_t R, int64_t T, int bad,
                           double atol, double rtol) {
    unpermute_case_ex(dt, pdt, with_probs, idt, R, T, 21, bad, 0, atol, rtol);
}

static void unpermute_all(tm_dtype dt, double atol, double rtol) {
    const tm_dtype idts[2] = {TM_I64, TM_I32};
    for (int i = 0; i < 2; i++) {
        unpermute_case(dt, dt, 1, idts[i], 53, 17, 0, atol, rtol);
        unpermute_case(dt, dt, 0, idts[i], 53, 17, 0, atol, rtol); /* no probs: weights 1 */
        unpermute_case(dt, dt, 1, idts[i], 1500, 40, 0, atol, rtol); /* ~40 rows per token, sort passes */
    }
    unpermute_case(dt, dt, 1, TM_I64, 0, 17, 0, atol, rtol);  /* no rows: y = 0 */
    unpermute_case(dt, dt, 1, TM_I64, 53, 0, 0, atol, rtol);  /* no tokens: every row padding */
    /* Row lengths: 64 (16-byte vectors for f32 and bf16), 36 (for f32 only), 320 (several
     * vector groups per lane), and 64 off alignment (one element per access). */
    const int64_t hs[3] = {64, 36, 320};
    for (int i = 0; i < 3; i++) {
        unpermute_case_ex(dt, dt, 1, TM_I64, 300, 90, hs[i], 0, 0, atol, rtol);
        unpermute_case_ex(dt, dt, 0, TM_I32, 300, 90, hs[i], 0, 0, atol, rtol);
    }
    unpermute_case_ex(dt, dt, 1, TM_I64, 1500, 40, 64, 0, 0, atol, rtol); /* > 32 rows per token: several fetches */
    unpermute_case_ex(dt, dt, 1, TM_I64, 300, 90, 64, 0, 1, atol, rtol);
    unpermute_case_ex(dt, dt, 1, TM_I32, 300, 90, 64, 1, 0, atol, rtol);  /* rows outside the tokens */
}

Test(cuda_parity_moe, unpermute_f32) {
    TT_SKIP_WITHOUT_CUDA();
    unpermute_all(TM_F32, 1e-5, 1e-5);
}

Test(cuda_parity_moe, unpermute_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    unpermute_all(TM_BF16, 1e-2, 1e-2);
    unpermute_case(TM_BF16, TM_F32, 1, TM_I32, 53, 17, 0, 1e-2, 1e-2); /* f32 probs with bf16 rows */
    unpermute_case(TM_F32, TM_BF16, 1, TM_I64, 53, 17, 0, 1e-2, 1e-2);
}

/* The CUDA kernels do not read row_token back to validate it: rows outside [-1, num_tokens)
 * are skipped like padding (the CPU reports TM_ERR_INDEX, tests/test_moe_dispatch.c), and get
 * no gradient. */
Test(cuda_parity_moe, unpermute_skips_rows_outside_the_tokens) {
    TT_SKIP_WITHOUT_CUDA();
    unpermute_case(TM_F32, TM_F32, 1, TM_I64, 53, 17, 1, 1e-5, 1e-5);
    unpermute_case(TM_F32, TM_F32, 1, TM_I32, 53, 17, 1, 1e-5, 1e-5);
}

/* ---- grouped_matmul ---------------------------------------------------------------------- */

/* A context whose bf16 grouped GEMMs take the device-scheduled kernel (1), its Hopper version
 * (TM_GROUPED_GEMM_HOPPER) or cuBLASLt per group (0). */
static tm_ctx *gmm_ctx(int device_schedule) {
    tm_ctx *ctx = tt_parity_ctx();
    tm__set_gmm_device_schedule(ctx, device_schedule);
    return ctx;
}

/* Synchronisations of one grouped_matmul forward and of forward + backward on counts without a
 * host mirror: f32, and bf16 on the cuBLASLt path, read them back once (then mirrored, for the
 * backward too); the device-scheduled bf16 kernel reads nothing; the CPU counts alike (by the
 * same rule, tm__gmm_device_schedule). */
static uint64_t grouped_syncs(tm_ctx *ctx, tm_dtype dt) { return dt == TM_BF16 && tm__gmm_device_schedule(ctx) ? 0 : 1; }

/* temp_w: the product takes a view of w (w reshaped twice: a temporary), so that w's gradient
 * there is fresh (call->gin_fresh[1]: the Hopper kernel writes it, beta = 0, empty groups zeroed
 * apart), with fresh buffers NaN-poisoned: an element left unwritten reaches w's gradient. */
static void grouped_case_in(tm_ctx *ctx, tm_dtype dt, int64_t G, int64_t K, int64_t N, const int64_t *counts,
                            double atol, double rtol, int temp_w) {
    int64_t R = 0;
    for (int64_t g = 0; g < G; g++) R += counts[g];
    int64_t xs[2] = {R, K}, ws[3] = {G, K, N}, ys[2] = {R, N};
    double *hx = tt_parity_uniform(R * K, 1000 + (uint64_t)R), *hw = tt_parity_uniform(G * K * N, 1100);
    double *hdy = tt_parity_uniform(R * N, 1200 + (uint64_t)R), *hc = malloc(sizeof(double) * (size_t)(G ? G : 1));
    for (int64_t g = 0; g < G; g++) hc[g] = (double)counts[g];
    tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
    tm_tensor *x[2], *w[2], *y[2];
    for (int k = 0; k < 2; k++) {
        x[k] = from(ctx, dt, 2, xs, devs[k], hx, 1);
        w[k] = from(ctx, dt, 3, ws, devs[k], hw, 1);
        tm_tensor *cnt = from(ctx, TM_I64, 1, &G, devs[k], hc, 0), *wu = w[k];
        if (temp_w) {
            int64_t flat[2] = {G * K, N};
            tm_tensor *w2;
            TT_OK(ctx, tm_reshape(ctx, w[k], 2, flat, &w2));
            TT_OK(ctx, tm_reshape(ctx, w2, 3, ws, &wu));
        }
        uint64_t before = tm_ctx_sync_count(ctx);
        TT_OK(ctx, tm_grouped_matmul(ctx, x[k], wu, cnt, &y[k]));
        uint64_t fwd = tm_ctx_sync_count(ctx) - before;
        TT_OK(ctx, tm_backward_with_grad(ctx, y[k], from(ctx, dt, 2, ys, devs[k], hdy, 0)));
        uint64_t all = tm_ctx_sync_count(ctx) - before, want = grouped_syncs(ctx, dt);
        cr_assert(fwd == want && all == want, "grouped_matmul %s on %s: %llu synchronisations in the forward, %llu "
                  "with the backward; want %llu and %llu", tm_dtype_name(dt), k ? "CUDA" : "the CPU",
                  (unsigned long long)fwd, (unsigned long long)all, (unsigned long long)want, (unsigned long long)want);
    }
    assert_on_cuda(y[1], "y");
    tt_assert_close(ctx, y[1], y[0], atol, rtol);
    tt_assert_close(ctx, tm_tensor_grad(x[1]), tm_tensor_grad(x[0]), atol, rtol);
    tt_assert_close(ctx, tm_tensor_grad(w[1]), tm_tensor_grad(w[0]), atol, rtol);
    /* Empty groups leave their weight gradient exactly zero. */
    double *gw = tt_read(ctx, tm_tensor_grad(w[1]));
    for (int64_t g = 0; g < G; g++)
        if (counts[g] == 0)
            for (int64_t i = 0; i < K * N; i++)
                cr_assert(gw[g * K * N + i] == 0, "dw of empty group %lld is not zero", (long long)g);
    free(gw), free(hx), free(hw), free(hdy), free(hc);
}

/* One case in a fresh context; bf16 on the device-scheduled kernel (device_schedule 1) or on
 * cuBLASLt per group (0). */
static void grouped_case(tm_dtype dt, int device_schedule, int64_t G, int64_t K, int64_t N, const int64_t *counts,
                         double atol, double rtol) {
    tm_ctx *ctx = gmm_ctx(device_schedule);
    grouped_case_in(ctx, dt, G, K, N, counts, atol, rtol, 0);
    tm_ctx_free(ctx);
}

static void grouped_all(tm_dtype dt, int device_schedule, double atol, double rtol) {
    const int64_t ragged[E7] = {5, 0, 9, 1, 0, 12, 3}, first_last_empty[E7] = {0, 4, 4, 17, 2, 8, 0},
                  one[E7] = {0, 0, 0, 33, 0, 0, 0}, none[E7] = {0, 0, 0, 0, 0, 0, 0};
    grouped_case(dt, device_schedule, E7, 13, 11, ragged, atol, rtol);
    grouped_case(dt, device_schedule, E7, 13, 11, first_last_empty, atol, rtol);
    grouped_case(dt, device_schedule, E7, 13, 11, one, atol, rtol);
    grouped_case(dt, device_schedule, E7, 13, 11, none, atol, rtol); /* R = 0 */
}

Test(cuda_parity_moe, grouped_matmul_f32) {
    TT_SKIP_WITHOUT_CUDA();
    grouped_all(TM_F32, 0, 1e-5, 1e-5);
}

/* The cuBLASLt path shares one plan among the groups whose ragged size falls in the same
 * power-of-two bucket (kernels/cuda/gemm.cu, tm__gemm_cuda_ragged) and resizes its layouts per
 * call: groups of 65 to 128 rows (bucket 128), 129 and 300 rows, then a second routing in the
 * same context, whose sizes hit the plans the first one made. */
Test(cuda_parity_moe, grouped_matmul_f32_bucketed_plans) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t first[E7] = {70, 100, 128, 0, 65, 129, 300}, second[E7] = {128, 65, 0, 99, 300, 250, 1};
    grouped_case_in(ctx, TM_F32, E7, 24, 16, first, 1e-5, 1e-5, 0);
    grouped_case_in(ctx, TM_F32, E7, 24, 16, second, 1e-5, 1e-5, 0);
    grouped_case_in(ctx, TM_F32, E7, 24, 16, first, 1e-5, 1e-5, 0);
    tm_ctx_free(ctx);
}

/* Both bf16 paths; K = 13, N = 11 are not multiples of 8: the tensor-core kernel's
 * element-wise load path. */
Test(cuda_parity_moe, grouped_matmul_bf16) {
    TT_SKIP_WITHOUT_CUDA();
    grouped_all(TM_BF16, 0, 1e-2, 1e-2);
    grouped_all(TM_BF16, 1, 1e-2, 1e-2);
}

/* The tensor-core kernel's cp.async path (K, N multiples of 8) on shapes that are not multiples
 * of its 128 x 128 x 32 tiles: groups smaller than a tile, spanning two tiles with a ragged end,
 * empty (first, middle, last), a single row; then several m, n and k tiles per group, the dw
 * reduction over 423 rows, and a larger element-wise case. */
Test(cuda_parity_moe, grouped_matmul_bf16_tiles) {
    TT_SKIP_WITHOUT_CUDA();
    const int64_t ragged[E7] = {5, 0, 130, 1, 0, 200, 3}, first_last_empty[E7] = {0, 4, 129, 17, 2, 8, 0},
                  big[E7] = {140, 0, 301, 7, 129, 0, 423}, odd[5] = {0, 150, 1, 149, 0};
    grouped_case(TM_BF16, 1, E7, 72, 40, ragged, 1e-2, 1e-2);
    grouped_case(TM_BF16, 1, E7, 72, 40, first_last_empty, 1e-2, 1e-2);
    grouped_case(TM_BF16, 1, E7, 40, 72, ragged, 1e-2, 1e-2);
    grouped_case(TM_BF16, 1, E7, 256, 192, big, 1e-2, 1e-2); /* R = 1000 */
    grouped_case(TM_BF16, 1, 5, 100, 50, odd, 1e-2, 1e-2);   /* element-wise loads, several tiles */
    const int64_t single[1] = {37};
    grouped_case(TM_BF16, 1, 1, 8, 8, single, 1e-2, 1e-2);
}

/* bf16 on CUDA reads nothing back, forward or backward, whatever the counts carry: no host
 * mirror here (the f32 path would wait once). */
Test(cuda_parity_moe, grouped_matmul_bf16_never_synchronises) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = gmm_ctx(1);
    const int64_t G = 4, K = 64, N = 48, R = 300;
    int64_t xs[2] = {R, K}, ws[3] = {G, K, N}, ys[2] = {R, N};
    double *hx = tt_parity_uniform(R * K, 41), *hw = tt_parity_uniform(G * K * N, 42), *hdy = tt_parity_uniform(R * N, 43);
    const double hc[4] = {100, 0, 150, 50};
    tm_tensor *x = from(ctx, TM_BF16, 2, xs, tm_cuda(0), hx, 1), *w = from(ctx, TM_BF16, 3, ws, tm_cuda(0), hw, 1);
    tm_tensor *cnt = from(ctx, TM_I64, 1, &G, tm_cuda(0), hc, 0), *y, *y2;
    const uint64_t before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, cnt, &y));
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, cnt, &y2));
    TT_OK(ctx, tm_backward_with_grad(ctx, y, from(ctx, TM_BF16, 2, ys, tm_cuda(0), hdy, 0)));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "bf16 grouped_matmul on CUDA synchronised %llu times",
                 (unsigned long long)(tm_ctx_sync_count(ctx) - before));
    free(hx), free(hw), free(hdy);
    tm_ctx_free(ctx);
}

/* Two runs of the bf16 kernel, forward and backward, give the same bits: every output element
 * comes from one CTA in a fixed order (dw[g] loops over the group's rows itself). The inputs
 * are made afresh for each run, the arena reset in between. */
Test(cuda_parity_moe, grouped_matmul_bf16_bitwise_reproducible) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = gmm_ctx(1);
    const int64_t G = E7, K = 256, N = 192, R = 1000, cnt[E7] = {140, 0, 301, 7, 129, 0, 423};
    int64_t xs[2] = {R, K}, ws[3] = {G, K, N}, ys[2] = {R, N};
    double *hx = tt_parity_uniform(R * K, 51), *hw = tt_parity_uniform(G * K * N, 52), *hdy = tt_parity_uniform(R * N, 53);
    double hc[E7], *got[2][3];
    for (int64_t g = 0; g < G; g++) hc[g] = (double)cnt[g];
    for (int k = 0; k < 2; k++) {
        tm_tensor *x = from(ctx, TM_BF16, 2, xs, tm_cuda(0), hx, 1), *w = from(ctx, TM_BF16, 3, ws, tm_cuda(0), hw, 1), *y;
        TT_OK(ctx, tm_grouped_matmul(ctx, x, w, from(ctx, TM_I64, 1, &G, tm_cuda(0), hc, 0), &y));
        TT_OK(ctx, tm_backward_with_grad(ctx, y, from(ctx, TM_BF16, 2, ys, tm_cuda(0), hdy, 0)));
        got[k][0] = tt_read(ctx, y);
        got[k][1] = tt_read(ctx, tm_tensor_grad(x));
        got[k][2] = tt_read(ctx, tm_tensor_grad(w));
        tm_ctx_arena_reset(ctx);
    }
    const char *what[3] = {"y", "dx", "dw"};
    const int64_t n[3] = {R * N, R * K, G * K * N};
    for (int i = 0; i < 3; i++) {
        cr_assert(memcmp(got[0][i], got[1][i], sizeof(double) * (size_t)n[i]) == 0, "%s differs between two runs", what[i]);
        free(got[0][i]), free(got[1][i]);
    }
    free(hx), free(hw), free(hdy);
    tm_ctx_free(ctx);
}

/* Counts are validated on the host as on the CPU: the same errors, the same messages. */
Test(cuda_parity_moe, grouped_matmul_bad_counts) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t G = 3, xs[2] = {6, 4}, ws[3] = {3, 4, 5};
    double hx[24] = {0}, hw[60] = {0}, neg[3] = {2, -1, 5}, over[3] = {4, 4, 0}, under[3] = {1, 2, 0};
    tm_tensor *x = from(ctx, TM_F32, 2, xs, tm_cuda(0), hx, 0), *w = from(ctx, TM_F32, 3, ws, tm_cuda(0), hw, 0), *y = NULL;
    cr_assert_eq(tm_grouped_matmul(ctx, x, w, from(ctx, TM_I64, 1, &G, tm_cuda(0), neg, 0), &y), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "counts[1] = -1"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_grouped_matmul(ctx, x, w, from(ctx, TM_I64, 1, &G, tm_cuda(0), over, 0), &y), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "exceed the rows of x at group 1"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_grouped_matmul(ctx, x, w, from(ctx, TM_I64, 1, &G, tm_cuda(0), under, 0), &y), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "sum to 3 but x has 6 rows"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_null(y);
    tm_ctx_free(ctx);
}

/* bf16 counts with a host mirror are validated from it (the f32 messages, no read back). */
Test(cuda_parity_moe, grouped_matmul_bf16_bad_mirrored_counts) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    int64_t G = 3, xs[2] = {6, 8}, ws[3] = {3, 8, 8};
    double hx[48] = {0}, hw[192] = {0}, neg[3] = {2, -1, 5}, over[3] = {4, 4, 0}, under[3] = {1, 2, 0};
    const double *bad[3] = {neg, over, under};
    const tm_status want[3] = {TM_ERR_INVALID_ARG, TM_ERR_SHAPE, TM_ERR_SHAPE};
    const char *msg[3] = {"counts[1] = -1", "exceed the rows of x at group 1", "sum to 3 but x has 6 rows"};
    tm_tensor *x = from(ctx, TM_BF16, 2, xs, tm_cuda(0), hx, 0), *w = from(ctx, TM_BF16, 3, ws, tm_cuda(0), hw, 0), *y = NULL;
    for (int i = 0; i < 3; i++) {
        int64_t v[3] = {(int64_t)bad[i][0], (int64_t)bad[i][1], (int64_t)bad[i][2]};
        tm_tensor *cnt = from(ctx, TM_I64, 1, &G, tm_cuda(0), bad[i], 0);
        TT_OK(ctx, tm__mirror_set(ctx, cnt, v));
        const uint64_t before = tm_ctx_sync_count(ctx);
        cr_assert_eq(tm_grouped_matmul(ctx, x, w, cnt, &y), want[i]);
        cr_assert(strstr(tm_ctx_errmsg(ctx), msg[i]), "%s", tm_ctx_errmsg(ctx));
        cr_assert_eq(tm_ctx_sync_count(ctx), before, "validating a mirror synchronised");
    }
    cr_assert_null(y);
    tm_ctx_free(ctx);
}

/* bf16 counts without a mirror are not validated (that would need a read back): the kernel
 * clamps them so that nothing outside x, w, y is touched. A negative count is 0, a count is cut
 * at the rows left, and rows past the last group get y = 0 and no dx. Compared with the CPU on
 * the clamped counts; for rows past the groups, with a last group whose weights are zero. */
Test(cuda_parity_moe, grouped_matmul_bf16_unvalidated_counts_are_clamped) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = gmm_ctx(1);
    const int64_t G = 3, K = 24, N = 16, R = 200;
    int64_t xs[2] = {R, K}, ws[3] = {G, K, N}, ys[2] = {R, N};
    double *hx = tt_parity_uniform(R * K, 61), *hw = tt_parity_uniform(G * K * N, 62), *hdy = tt_parity_uniform(R * N, 63);
    for (int64_t i = 2 * K * N; i < G * K * N; i++) hw[i] = 0; /* w[2] = 0 */
    /* CUDA counts -> what they clamp to (the CPU's counts) */
    const double cuda_c[3][3] = {{50, 170, -7}, {-3, 170, 40}, {20, 30, 0}};
    const double cpu_c[3][3] = {{50, 150, 0}, {0, 170, 30}, {20, 30, 150}};
    for (int i = 0; i < 3; i++) {
        tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
        tm_tensor *x[2], *y[2];
        for (int k = 0; k < 2; k++) {
            x[k] = from(ctx, TM_BF16, 2, xs, devs[k], hx, 1);
            tm_tensor *w = from(ctx, TM_BF16, 3, ws, devs[k], hw, 0);
            tm_tensor *cnt = from(ctx, TM_I64, 1, &G, devs[k], k ? cuda_c[i] : cpu_c[i], 0);
            const uint64_t before = tm_ctx_sync_count(ctx);
            TT_OK(ctx, tm_grouped_matmul(ctx, x[k], w, cnt, &y[k]));
            TT_OK(ctx, tm_backward_with_grad(ctx, y[k], from(ctx, TM_BF16, 2, ys, devs[k], hdy, 0)));
            if (k) cr_assert_eq(tm_ctx_sync_count(ctx), before, "case %d synchronised", i);
        }
        tt_assert_close(ctx, y[1], y[0], 1e-2, 1e-2);
        tt_assert_close(ctx, tm_tensor_grad(x[1]), tm_tensor_grad(x[0]), 1e-2, 1e-2);
        tm_ctx_arena_reset(ctx);
    }
    free(hx), free(hw), free(hdy);
    tm_ctx_free(ctx);
}

/* The same clamping on the Hopper kernel with a fresh dw and a fresh dx (the weight a temporary
 * view, fresh buffers NaN-poisoned): a group that the clamped counts leave without rows (a negative
 * count; a count past the rows left) gets dw = 0, and the rows past the last group get dx = 0, as
 * on the CPU with the clamped counts (until session 17 the Hopper kernel gave those rows no tile
 * in DX, leaving a fresh dx's poison there). */
Test(cuda_parity_moe, grouped_matmul_bf16_hopper_fresh_dw_of_clamped_counts) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = gmm_ctx(TM_GROUPED_GEMM_HOPPER);
    tm__test_fresh_hooks(ctx, 1, 0);
    const int64_t G = 3, K = 64, N = 128, R = 200;
    int64_t xs[2] = {R, K}, ws[3] = {G, K, N}, ys[2] = {R, N}, flat[2] = {G * K, N};
    double *hx = tt_parity_uniform(R * K, 71), *hw = tt_parity_uniform(G * K * N, 72), *hdy = tt_parity_uniform(R * N, 73);
    /* case 2 leaves rows past the last group on CUDA (counts 50, 100, clamped 0: rows 150-199); the
     * CPU, whose counts must cover R, gives them to group 2 with dy = 0 there, so that their dx and
     * dw[2] are 0 as on CUDA */
    const double cuda_c[3][3] = {{50, 170, -7}, {-3, 170, 40}, {50, 100, -7}};
    const double cpu_c[3][3] = {{50, 150, 0}, {0, 170, 30}, {50, 100, 50}};
    double *hdy_tail = malloc(sizeof(double) * R * N);
    for (int64_t i = 0; i < R * N; i++) hdy_tail[i] = i < 150 * N ? hdy[i] : 0.0;
    for (int i = 0; i < 3; i++) {
        tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
        tm_tensor *w[2], *x[2];
        for (int k = 0; k < 2; k++) {
            tm_tensor *w2, *wt, *y;
            x[k] = from(ctx, TM_BF16, 2, xs, devs[k], hx, 1);
            w[k] = from(ctx, TM_BF16, 3, ws, devs[k], hw, 1);
            TT_OK(ctx, tm_reshape(ctx, w[k], 2, flat, &w2));
            TT_OK(ctx, tm_reshape(ctx, w2, 3, ws, &wt));
            tm_tensor *cnt = from(ctx, TM_I64, 1, &G, devs[k], k ? cuda_c[i] : cpu_c[i], 0);
            TT_OK(ctx, tm_grouped_matmul(ctx, x[k], wt, cnt, &y));
            TT_OK(ctx, tm_backward_with_grad(ctx, y, from(ctx, TM_BF16, 2, ys, devs[k], i == 2 ? hdy_tail : hdy, 0)));
        }
        tt_assert_close(ctx, tm_tensor_grad(w[1]), tm_tensor_grad(w[0]), 1e-2, 1e-2);
        tt_assert_close(ctx, tm_tensor_grad(x[1]), tm_tensor_grad(x[0]), 1e-2, 1e-2);
        tm_ctx_arena_reset(ctx);
    }
    free(hx), free(hw), free(hdy), free(hdy_tail);
    tm_ctx_free(ctx);
}

/* A permute's tokens_per_expert carry a host mirror: grouped_matmul on them does not wait.
 * Writing the counts drops the mirror (the next call reads back once and mirrors again). */
Test(cuda_parity_moe, grouped_matmul_uses_the_permute_mirror) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t T = 29, E = E7, H = 8, F = 6;
    int64_t xs[2] = {T, H}, ms[2] = {T, E}, ws[3] = {E, H, F};
    double *hx = tt_parity_uniform(T * H, 1), *hp = tt_parity_uniform(T * E, 2), *hw = tt_parity_uniform(E * H * F, 3);
    double hm[29 * E7];
    routing(hm, T, E, 0, 4);
    tm_tensor *x = from(ctx, TM_F32, 2, xs, tm_cuda(0), hx, 1), *w = from(ctx, TM_F32, 3, ws, tm_cuda(0), hw, 1);
    tm_moe_dispatch d;
    TT_OK(ctx, tm_moe_permute(ctx, x, from(ctx, TM_U8, 2, ms, tm_cuda(0), hm, 0),
                              from(ctx, TM_F32, 2, ms, tm_cuda(0), hp, 1), 8, 0, &d));
    uint64_t before = tm_ctx_sync_count(ctx);
    tm_tensor *y, *y2, *view, *l;
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, d.tokens_per_expert, &y));
    int64_t e1[1] = {E};
    TT_OK(ctx, tm_reshape(ctx, d.tokens_per_expert, 1, e1, &view)); /* a view of the same elements */
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, view, &y2));
    TT_OK(ctx, tm_sum_all(ctx, y, &l));
    TT_OK(ctx, tm_backward(ctx, l));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "grouped_matmul on a permute's counts synchronised");
    int64_t tpe[E7];
    TT_OK(ctx, tm_tensor_read(ctx, d.tokens_per_expert, TM_I64, tpe, E));
    TT_OK(ctx, tm_tensor_write(ctx, d.tokens_per_expert, TM_I64, tpe, E));
    before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, view, &y2));
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, d.tokens_per_expert, &y2));
    cr_assert_eq(tm_ctx_sync_count(ctx) - before, 1, "after a write: one read back, then mirrored");

    /* pad_to: the host knows the counts (pad_to each) without reading: mirrored, no wait. */
    double hk[29 * E7], hm2[29 * E7];
    routing(hk, T, E, 5, 4);
    before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_moe_permute(ctx, x, from(ctx, TM_U8, 2, ms, tm_cuda(0), hk, 0),
                              from(ctx, TM_F32, 2, ms, tm_cuda(0), hp, 1), 1, 5, &d));
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, d.tokens_per_expert, &y));
    TT_OK(ctx, tm_sum_all(ctx, y, &l));
    TT_OK(ctx, tm_backward(ctx, l));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "pad_to permute + grouped_matmul synchronised");

    /* topk with align_size 1: the counts stay on the device (no mirror); the first
     * grouped_matmul reads them once and mirrors them for the next calls and the backward. */
    routing_k(hm2, T, E, 2, 5);
    before = tm_ctx_sync_count(ctx);
    TT_OK(ctx, tm_moe_permute_topk(ctx, x, from(ctx, TM_U8, 2, ms, tm_cuda(0), hm2, 0),
                                   from(ctx, TM_F32, 2, ms, tm_cuda(0), hp, 1), 2, 1, 0, &d));
    cr_assert_eq(tm_ctx_sync_count(ctx), before, "topk permute synchronised");
    cr_assert_eq(d.num_rows, 2 * T);
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, d.tokens_per_expert, &y));
    cr_assert_eq(tm_ctx_sync_count(ctx) - before, 1, "the first grouped_matmul on a topk permute's counts: one read");
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w, d.tokens_per_expert, &y2));
    TT_OK(ctx, tm_add(ctx, y, y2, &y));
    TT_OK(ctx, tm_sum_all(ctx, y, &l));
    TT_OK(ctx, tm_backward(ctx, l));
    cr_assert_eq(tm_ctx_sync_count(ctx) - before, 1, "then mirrored, for the backward too");
    free(hx), free(hp), free(hw);
    tm_ctx_free(ctx);
}

/* bf16 on a permute's tokens_per_expert (host mirror: validated from it, nothing read back),
 * with align 8 padding rows and empty experts, against the CPU, forward and backward. */
Test(cuda_parity_moe, grouped_matmul_bf16_on_permute) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t T = 45, E = E7, H = 16, F = 24;
    int64_t xs[2] = {T, H}, ms[2] = {T, E}, ws[3] = {E, H, F};
    double *hx = tt_parity_uniform(T * H, 71), *hp = tt_parity_uniform(T * E, 72), *hw = tt_parity_uniform(E * H * F, 73);
    double hm[45 * E7];
    routing(hm, T, E, 0, 74);
    tm_device devs[2] = {tm_cpu(), tm_cuda(0)};
    tm_tensor *x[2], *w[2], *y[2];
    double *hdy = NULL;
    for (int k = 0; k < 2; k++) {
        x[k] = from(ctx, TM_BF16, 2, xs, devs[k], hx, 1);
        w[k] = from(ctx, TM_BF16, 3, ws, devs[k], hw, 1);
        tm_moe_dispatch d;
        TT_OK(ctx, tm_moe_permute(ctx, x[k], from(ctx, TM_U8, 2, ms, devs[k], hm, 0),
                                  from(ctx, TM_BF16, 2, ms, devs[k], hp, 0), 8, 0, &d));
        int64_t ys[2] = {d.num_rows, F};
        if (!hdy) hdy = tt_parity_uniform(d.num_rows * F, 75);
        const uint64_t before = tm_ctx_sync_count(ctx);
        TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, w[k], d.tokens_per_expert, &y[k]));
        TT_OK(ctx, tm_backward_with_grad(ctx, y[k], from(ctx, TM_BF16, 2, ys, devs[k], hdy, 0)));
        cr_assert_eq(tm_ctx_sync_count(ctx), before, "bf16 grouped_matmul on a permute's counts synchronised (%s)",
                     k ? "CUDA" : "the CPU");
    }
    assert_on_cuda(y[1], "y");
    tt_assert_close(ctx, y[1], y[0], 1e-2, 1e-2);
    tt_assert_close(ctx, tm_tensor_grad(x[1]), tm_tensor_grad(x[0]), 1e-2, 1e-2);
    tt_assert_close(ctx, tm_tensor_grad(w[1]), tm_tensor_grad(w[0]), 1e-2, 1e-2);
    free(hx), free(hp), free(hw), free(hdy);
    tm_ctx_free(ctx);
}

/* ---- the MoE layer's chain --------------------------------------------------------------- */

typedef struct chain_io {
    tm_tensor *x, *probs, *w0, *w1, *wo, *y;
    uint64_t syncs, permute_syncs;
} chain_io;

/* layers/moe.c's grouped strategy: permute (tm_moe_permute_topk; topk 0: tm_moe_permute) ->
 * swiglu(rows @ w0[e], rows @ w1[e]) @ wo[e] -> unpermute, weighted by probs; forward and
 * backward with upstream gradient g. */
static void chain(tm_ctx *ctx, tm_device dev, int64_t T, int64_t H, int64_t F, int64_t align, int64_t pad_to, int topk,
                  const double *hx, const double *hm, const double *hp, const double *hw, const double *hg, chain_io *io) {
    const int64_t E = E7;
    int64_t xs[2] = {T, H}, ms[2] = {T, E}, w01[3] = {E, H, F}, wos[3] = {E, F, H};
    io->x = from(ctx, TM_F32, 2, xs, dev, hx, 1);
    io->probs = from(ctx, TM_F32, 2, ms, dev, hp, 1);
    io->w0 = from(ctx, TM_F32, 3, w01, dev, hw, 1);
    io->w1 = from(ctx, TM_F32, 3, w01, dev, hw + E * H * F, 1);
    io->wo = from(ctx, TM_F32, 3, wos, dev, hw + 2 * E * H * F, 1);
    tm_tensor *map = from(ctx, TM_U8, 2, ms, dev, hm, 0), *g = from(ctx, TM_F32, 2, xs, dev, hg, 0);
    uint64_t before = tm_ctx_sync_count(ctx);
    tm_moe_dispatch d;
    tm_tensor *a, *b, *h, *eo;
    TT_OK(ctx, tm_moe_permute_topk(ctx, io->x, map, io->probs, topk, align, pad_to, &d));
    io->permute_syncs = tm_ctx_sync_count(ctx) - before;
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, io->w0, d.tokens_per_expert, &a));
    TT_OK(ctx, tm_grouped_matmul(ctx, d.permuted, io->w1, d.tokens_per_expert, &b));
    TT_OK(ctx, tm_swiglu(ctx, a, b, &h));
    TT_OK(ctx, tm_grouped_matmul(ctx, h, io->wo, d.tokens_per_expert, &eo));
    TT_OK(ctx, tm_moe_unpermute(ctx, eo, d.permuted_probs, d.row_token, T, &io->y));
    TT_OK(ctx, tm_backward_with_grad(ctx, io->y, g));
    io->syncs = tm_ctx_sync_count(ctx) - before;
}

/* The chain's synchronisations, on both devices (f32): the permute reads its counts back
 * where R depends on the data (then the GEMMs use the mirror); with pad_to nothing is read;
 * with topk and align_size 1 the permute reads nothing and the first grouped_matmul reads
 * the counts once (the GEMMs that follow and the backward use its mirror). */
static void chain_case(int64_t align, int64_t pad_to, int topk) {
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t T = 45, H = 16, F = 12, E = E7;
    double *hx = tt_parity_uniform(T * H, 21), *hp = tt_parity_uniform(T * E, 22);
    double *hw = tt_parity_uniform(3 * E * H * F, 23), *hg = tt_parity_uniform(T * H, 24);
    double *hm = malloc(sizeof(double) * (size_t)(T * E));
    for (int64_t i = 0; i < 3 * E * H * F; i++) hw[i] *= 0.3;
    if (topk > 0) routing_k(hm, T, E, topk, 25);
    else routing(hm, T, E, pad_to, 25);
    const int known = pad_to > 0 || (topk > 0 && align == 1);
    const uint64_t want_permute = known ? 0 : 1, want = pad_to > 0 ? 0 : 1;
    chain_io io[2];
    chain(ctx, tm_cpu(), T, H, F, align, pad_to, topk, hx, hm, hp, hw, hg, &io[0]);
    chain(ctx, tm_cuda(0), T, H, F, align, pad_to, topk, hx, hm, hp, hw, hg, &io[1]);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(io[k].permute_syncs, want_permute, "permute on %s (align %lld, pad_to %lld, topk %d): %llu "
                     "synchronisations, want %llu", k ? "CUDA" : "the CPU", (long long)align, (long long)pad_to, topk,
                     (unsigned long long)io[k].permute_syncs, (unsigned long long)want_permute);
        cr_assert_eq(io[k].syncs, want, "MoE chain forward + backward on %s (align %lld, pad_to %lld, topk %d): %llu "
                     "synchronisations, want %llu", k ? "CUDA" : "the CPU", (long long)align, (long long)pad_to, topk,
                     (unsigned long long)io[k].syncs, (unsigned long long)want);
    }
    const double tol = 1e-4;
    tt_assert_close(ctx, io[1].y, io[0].y, tol, tol);
    tt_assert_close(ctx, tm_tensor_grad(io[1].x), tm_tensor_grad(io[0].x), tol, tol);
    tt_assert_close(ctx, tm_tensor_grad(io[1].probs), tm_tensor_grad(io[0].probs), tol, tol);
    tt_assert_close(ctx, tm_tensor_grad(io[1].w0), tm_tensor_grad(io[0].w0), tol, tol);
    tt_assert_close(ctx, tm_tensor_grad(io[1].w1), tm_tensor_grad(io[0].w1), tol, tol);
    tt_assert_close(ctx, tm_tensor_grad(io[1].wo), tm_tensor_grad(io[0].wo), tol, tol);
    free(hx), free(hp), free(hw), free(hg), free(hm);
    tm_ctx_free(ctx);
}

Test(cuda_parity_moe, layer_chain_dropless) {
    TT_SKIP_WITHOUT_CUDA();
    chain_case(1, 0, 0);
    chain_case(16, 0, 0);
    chain_case(1, 0, 2);  /* the MoE layer's dropless call: R = T * 2 */
    chain_case(16, 0, 2); /* align padding: R depends on the data again */
}

Test(cuda_parity_moe, layer_chain_capacity) {
    TT_SKIP_WITHOUT_CUDA();
    chain_case(1, 8, 0); /* pad_to_capacity: every expert 8 rows, empty experts all padding */
}

/* Bit-identical results from run to run (no float atomics, a stable sort). The arena is reset
 * between the runs, so both see the same addresses and cuBLASLt the same plans. */
Test(cuda_parity_moe, bitwise_reproducible) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = tt_parity_ctx();
    const int64_t T = 45, H = 16, F = 12, E = E7;
    double *hx = tt_parity_uniform(T * H, 31), *hp = tt_parity_uniform(T * E, 32);
    double *hw = tt_parity_uniform(3 * E * H * F, 33), *hg = tt_parity_uniform(T * H, 34);
    double *hm = malloc(sizeof(double) * (size_t)(T * E));
    for (int topk = 0; topk <= 2; topk += 2) { /* the permute with align padding, then with topk */
        if (topk) routing_k(hm, T, E, topk, 35);
        else routing(hm, T, E, 0, 35);
        double *got[2][4];
        for (int k = 0; k < 2; k++) {
            chain_io io;
            chain(ctx, tm_cuda(0), T, H, F, topk ? 1 : 8, 0, topk, hx, hm, hp, hw, hg, &io);
            got[k][0] = tt_read(ctx, io.y);
            got[k][1] = tt_read(ctx, tm_tensor_grad(io.x));
            got[k][2] = tt_read(ctx, tm_tensor_grad(io.probs));
            got[k][3] = tt_read(ctx, tm_tensor_grad(io.wo));
            tm_ctx_arena_reset(ctx);
        }
        const char *what[4] = {"y", "dx", "dprobs", "dwo"};
        const int64_t n[4] = {T * H, T * H, T * E, E * F * H};
        for (int i = 0; i < 4; i++) {
            cr_assert(memcmp(got[0][i], got[1][i], sizeof(double) * (size_t)n[i]) == 0, "%s differs between two runs "
                      "(topk %d)", what[i], topk);
            free(got[0][i]), free(got[1][i]);
        }
    }
    free(hx), free(hp), free(hw), free(hg), free(hm);
    tm_ctx_free(ctx);
}

/* The Hopper kernel: the device-scheduled contract (no synchronisation, clamped counts, empty
 * groups' dw untouched) on shapes off its tiles: K 72 / N 40 (one partial slab, BN 128), K 136 /
 * N 264 (K past a 64 multiple: TMA zero fill), 128-row groups ending mid-tile, the dw reduction of
 * 423 rows ending mid-slab (the next group's rows zeroed in shared memory), 9 groups (odd), one
 * group; then K 13 (not a multiple of 8), which must fall back with its reason. Where the device
 * is an sm_90, tm__gmm_note must be empty after each call that K and N allow: the Hopper kernel ran. */
static void grouped_case_hopper(int64_t G, int64_t K, int64_t N, const int64_t *counts, int must_run, int temp_w) {
    tm_ctx *ctx = gmm_ctx(TM_GROUPED_GEMM_HOPPER);
    if (temp_w) tm__test_fresh_hooks(ctx, 1, 0);
    grouped_case_in(ctx, TM_BF16, G, K, N, counts, 1e-2, 1e-2, temp_w);
    const char *note = tm__gmm_note(ctx);
    int64_t R = 0;
    for (int64_t g = 0; g < G; g++) R += counts[g];
    if (must_run && R > 0 && !strstr(note, "needs sm_90"))
        cr_assert(note[0] == 0, "grouped_matmul bf16 G %lld K %lld N %lld: the Hopper kernel did not run: %s",
                  (long long)G, (long long)K, (long long)N, note);
    if (!must_run && R > 0) cr_assert(note[0] != 0, "K %lld, N %lld: expected a fallback and its reason", (long long)K, (long long)N);
    tm_ctx_free(ctx);
}

Test(cuda_parity_moe, grouped_matmul_bf16_hopper) {
    TT_SKIP_WITHOUT_CUDA();
    const int64_t ragged[E7] = {5, 0, 130, 1, 0, 200, 3}, first_last_empty[E7] = {0, 4, 129, 17, 2, 8, 0},
                  big[E7] = {140, 0, 301, 7, 129, 0, 423}, none[E7] = {0, 0, 0, 0, 0, 0, 0},
                  nine[9] = {128, 0, 1, 255, 64, 0, 77, 300, 2};
    grouped_case_hopper(E7, 72, 40, ragged, 1, 0);
    grouped_case_hopper(E7, 72, 40, first_last_empty, 1, 0);
    grouped_case_hopper(E7, 40, 72, ragged, 1, 0);
    grouped_case_hopper(E7, 256, 192, big, 1, 0);
    grouped_case_hopper(E7, 136, 264, big, 1, 0);
    grouped_case_hopper(9, 64, 320, nine, 1, 0);
    grouped_case_hopper(E7, 72, 40, none, 1, 0); /* R = 0 */
    const int64_t single[1] = {37};
    grouped_case_hopper(1, 8, 8, single, 1, 0);
    grouped_case_hopper(E7, 13, 11, ragged, 0, 0);
}

/* DW's tile schedule (grouped_matmul_sm90.cu): 40 groups of K 512 x N 1024 own 16 tiles each, so
 * the 34 non-empty ones make 544 tiles, past 4 a CTA on a 132-SM GPU: CTAs draw tiles from the
 * device-wide counter and the producer's tile-id queue (4 deep) wraps. One group 8 times the
 * others (the largest first), ties between groups of equal rows, empty groups. Against the CPU,
 * and bit for bit between two runs (which CTA computes a tile must not change its sums). */
Test(cuda_parity_moe, grouped_matmul_bf16_hopper_dw_dynamic_schedule) {
    TT_SKIP_WITHOUT_CUDA();
    enum { G = 40 };
    const int64_t K = 512, N = 1024;
    int64_t counts[G], R = 0;
    for (int g = 0; g < G; g++) {
        counts[g] = g == 5 ? 600 : g % 7 == 3 ? 0 : g % 3 == 0 ? 64 : 17 + g;
        R += counts[g];
    }
    grouped_case_hopper(G, K, N, counts, 1, 0);
    tm_ctx *ctx = gmm_ctx(TM_GROUPED_GEMM_HOPPER);
    int64_t xs[2] = {R, K}, ws[3] = {G, K, N}, ys[2] = {R, N}, g1 = G;
    double *hx = tt_parity_uniform(R * K, 51), *hw = tt_parity_uniform(G * K * N, 52), *hdy = tt_parity_uniform(R * N, 53);
    double hc[G];
    for (int g = 0; g < G; g++) hc[g] = (double)counts[g];
    double *dw[2];
    for (int k = 0; k < 2; k++) {
        tm_tensor *x = from(ctx, TM_BF16, 2, xs, tm_cuda(0), hx, 0), *w = from(ctx, TM_BF16, 3, ws, tm_cuda(0), hw, 1), *y;
        TT_OK(ctx, tm_grouped_matmul(ctx, x, w, from(ctx, TM_I64, 1, &g1, tm_cuda(0), hc, 0), &y));
        TT_OK(ctx, tm_backward_with_grad(ctx, y, from(ctx, TM_BF16, 2, ys, tm_cuda(0), hdy, 0)));
        cr_assert(tm__gmm_note(ctx)[0] == 0 || strstr(tm__gmm_note(ctx), "needs sm_90"), "the Hopper kernel did not run: %s",
                  tm__gmm_note(ctx));
        dw[k] = tt_read(ctx, tm_tensor_grad(w));
        tm_ctx_arena_reset(ctx);
    }
    cr_assert(memcmp(dw[0], dw[1], sizeof(double) * (size_t)(G * K * N)) == 0, "dw differs between two runs");
    free(dw[0]), free(dw[1]), free(hx), free(hw), free(hdy);
    tm_ctx_free(ctx);
}

/* The same kernel writing a fresh dw (the weight a temporary view, as ZeRO-3's gathered expert
 * weights are): empty groups (first, last, several, all) zeroed, the rest written with beta = 0,
 * both against the CPU, under NaN-poisoned fresh buffers. */
Test(cuda_parity_moe, grouped_matmul_bf16_hopper_fresh_dw) {
    TT_SKIP_WITHOUT_CUDA();
    const int64_t ragged[E7] = {5, 0, 130, 1, 0, 200, 3}, first_last_empty[E7] = {0, 4, 129, 17, 2, 8, 0},
                  big[E7] = {140, 0, 301, 7, 129, 0, 423}, none[E7] = {0, 0, 0, 0, 0, 0, 0},
                  nine[9] = {128, 0, 1, 255, 64, 0, 77, 300, 2};
    grouped_case_hopper(E7, 72, 40, ragged, 1, 1);
    grouped_case_hopper(E7, 72, 40, first_last_empty, 1, 1);
    grouped_case_hopper(E7, 136, 264, big, 1, 1);
    grouped_case_hopper(9, 64, 320, nine, 1, 1);
    grouped_case_hopper(E7, 72, 40, none, 1, 1); /* R = 0: every dw zeroed */
    grouped_case_hopper(E7, 13, 11, ragged, 0, 1); /* the fallback kernel: zero-filled, then added */
}

/* TM_GROUPED_GEMM_AUTO (tm_ctx_options_default, so tt_parity_ctx's): the Hopper kernel exactly
 * where it runs (learnt here by running it: its note stays empty), cuBLASLt per group elsewhere;
 * either way the parity of grouped_case_in holds. */
Test(cuda_parity_moe, grouped_gemm_auto_is_hopper_where_it_runs) {
    TT_SKIP_WITHOUT_CUDA();
    const int64_t ragged[E7] = {5, 0, 130, 1, 0, 200, 3};
    tm_ctx *h = gmm_ctx(TM_GROUPED_GEMM_HOPPER);
    grouped_case_in(h, TM_BF16, E7, 72, 40, ragged, 1e-2, 1e-2, 0);
    int hopper_runs = tm__gmm_note(h)[0] == 0;
    tm_ctx_free(h);
    tm_ctx *a = tt_parity_ctx();
    cr_assert_eq(tm__gmm_mode(a), hopper_runs ? TM_GROUPED_GEMM_HOPPER : TM_GROUPED_GEMM_CUBLASLT,
                 "auto chose mode %d where the Hopper kernel %s", tm__gmm_mode(a), hopper_runs ? "runs" : "does not run");
    grouped_case_in(a, TM_BF16, E7, 72, 40, ragged, 1e-2, 1e-2, 0);
    tm_ctx_free(a);
}

/* Bit for bit the same result on a second call (each element one thread's sum in a fixed order). */
Test(cuda_parity_moe, grouped_matmul_bf16_hopper_reproducible) {
    TT_SKIP_WITHOUT_CUDA();
    tm_ctx *ctx = gmm_ctx(TM_GROUPED_GEMM_HOPPER);
    const int64_t counts[E7] = {140, 0, 301, 7, 129, 0, 423};
    int64_t R = 1000, G = E7, K = 256, N = 192, xs[2] = {R, K}, ws[3] = {G, K, N};
    double *hx = tt_parity_uniform(R * K, 77), *hw = tt_parity_uniform(G * K * N, 78), hc[E7];
    for (int g = 0; g < E7; g++) hc[g] = (double)counts[g];
    tm_tensor *x = from(ctx, TM_BF16, 2, xs, tm_cuda(0), hx, 0), *w = from(ctx, TM_BF16, 3, ws, tm_cuda(0), hw, 0);
    tm_tensor *cnt = from(ctx, TM_I64, 1, &G, tm_cuda(0), hc, 0), *y0, *y1;
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, cnt, &y0));
    TT_OK(ctx, tm_grouped_matmul(ctx, x, w, cnt, &y1));
    tt_assert_close(ctx, y1, y0, 0, 0);
    free(hx), free(hw);
    tm_ctx_free(ctx);
}
