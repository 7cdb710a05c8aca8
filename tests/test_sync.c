/* test_sync.c — host round trips (tm_ctx_sync_count) on the CPU, where CI runs: the counting
 * rules (a tm_tensor_read, tm_ctx_sync, a data-dependent output size, an error flag that the
 * CUDA kernel reads back). */
#include <stdlib.h>
#include <string.h>

#include "common.h"

static uint64_t syncs(tm_ctx *ctx) { return tm_ctx_sync_count(ctx); }

/* ---- counting rules -------------------------------------------------------------------- */

Test(sync, tensor_read_of_a_cpu_tensor_counts_one) {
    tm_ctx *ctx = tt_ctx();
    cr_assert_eq(syncs(ctx), 0);
    int64_t s[2] = {3, 4}, none[1] = {0};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, s, 1), *empty, *tr;
    uint64_t before = syncs(ctx);
    float buf[12];
    TT_OK(ctx, tm_tensor_read(ctx, x, TM_F32, buf, 12));
    cr_assert_eq(syncs(ctx) - before, 1);
    /* A strided view is one read too. */
    TT_OK(ctx, tm_transpose(ctx, x, 0, 1, &tr));
    TT_OK(ctx, tm_tensor_read(ctx, tr, TM_F32, buf, 12));
    cr_assert_eq(syncs(ctx) - before, 2);
    /* Nothing to read: nothing to wait for. */
    TT_OK(ctx, tm_tensor_empty(ctx, TM_F32, 1, none, tm_cpu(), &empty));
    TT_OK(ctx, tm_tensor_read(ctx, empty, TM_F32, buf, 0));
    cr_assert_eq(syncs(ctx) - before, 2);
    /* A failed read (wrong count) counts nothing. */
    cr_assert_eq(tm_tensor_read(ctx, x, TM_F32, buf, 11), TM_ERR_INVALID_ARG);
    cr_assert_eq(syncs(ctx) - before, 2);
    /* Ops and writes do not wait for the device. */
    tm_tensor *y;
    TT_OK(ctx, tm_matmul(ctx, x, tr, 0, 0, &y));
    TT_OK(ctx, tm_tensor_write(ctx, x, TM_F32, buf, 12));
    cr_assert_eq(syncs(ctx) - before, 2);
    TT_OK(ctx, tm_ctx_sync(ctx));
    cr_assert_eq(syncs(ctx) - before, 3);
    tm_ctx_free(ctx);
}

Test(sync, data_dependent_sizes_and_error_flags_count_one) {
    tm_ctx *ctx = tt_ctx();
    int64_t xs[2] = {4, 3}, ms[2] = {4, 2};
    const double map[8] = {1, 0, 1, 1, 0, 1, 0, 0}, probs[8] = {.5, 0, .4, .6, 0, 1, 0, 0};
    tm_tensor *x = tt_randn(ctx, TM_F32, 2, xs, 2);
    uint64_t before = syncs(ctx);
    tm_moe_dispatch d;
    TT_OK(ctx, tm_moe_permute(ctx, x, tt_from(ctx, TM_U8, 2, ms, map), tt_from(ctx, TM_F32, 2, ms, probs), 1, 0, &d));
    cr_assert_eq(d.num_rows, 4);
    cr_assert_eq(syncs(ctx) - before, 1, "permute: the row count R");

    /* cross_entropy's CUDA forward reads its bad-target flag back: one, also on the CPU. */
    int64_t ls[2] = {4, 5}, ts[1] = {4}, zero[1] = {0}, zs[2] = {0, 5};
    const double tg[4] = {0, 4, -1, 2};
    tm_tensor *loss;
    before = syncs(ctx);
    TT_OK(ctx, tm_cross_entropy(ctx, tt_randn(ctx, TM_F32, 2, ls, 3), tt_from(ctx, TM_I64, 1, ts, tg), -1, &loss));
    cr_assert_eq(syncs(ctx) - before, 1, "cross_entropy: the bad-target flag");
    tm_tensor *no_rows, *no_targets;
    TT_OK(ctx, tm_tensor_empty(ctx, TM_F32, 2, zs, tm_cpu(), &no_rows));
    TT_OK(ctx, tm_tensor_empty(ctx, TM_I64, 1, zero, tm_cpu(), &no_targets));
    TT_OK(ctx, tm_cross_entropy(ctx, no_rows, no_targets, -1, &loss));
    cr_assert_eq(syncs(ctx) - before, 1, "cross_entropy without rows reads nothing back");
    tm_ctx_free(ctx);
}
