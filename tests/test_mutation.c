/* test_mutation.c — every gradient test can fail: with the op's backward deliberately broken
 * (its upstream gradient scaled by 1.25 through tm__test_perturb_backward), the op's
 * canonical gradient case must report a ratio > 1. */
#include <string.h>

#include "common.h"
#include "internal.h"

static int op_id(const char *name) {
    for (int i = 0; i < TM__NOPS; i++)
        if (tm__op_table[i].name && strcmp(tm__op_table[i].name, name) == 0) return i;
    return -1;
}

#define TT_MUTATION_TEST(op)                                                          \
    Test(mutation, op) {                                                              \
        tm_ctx *ctx = tt_ctx();                                                       \
        int id = op_id(#op);                                                          \
        cr_assert_geq(id, 0, "op %s not in the op table", #op);                       \
        tm__test_perturb_backward(ctx, id);                                           \
        double r = tt_gradcase_##op(ctx);                                             \
        cr_assert_gt(r, 1.0, "broken backward of %s went unnoticed (ratio %g)", #op, r); \
        tm_ctx_free(ctx);                                                             \
    }
TT_GRADCASES(TT_MUTATION_TEST)

/* The router's forced selection (force_load_balance) has its own canonical case: its
 * gradient check must catch the same broken backward. */
double tt_gradcase_moe_router_forced(tm_ctx *ctx);
Test(mutation, moe_router_forced) {
    tm_ctx *ctx = tt_ctx();
    int id = op_id("moe_router");
    cr_assert_geq(id, 0, "op moe_router not in the op table");
    tm__test_perturb_backward(ctx, id);
    double r = tt_gradcase_moe_router_forced(ctx);
    cr_assert_gt(r, 1.0, "broken backward of moe_router (forced routing) went unnoticed (ratio %g)", r);
    tm_ctx_free(ctx);
}

/* Every differentiable op in the table has a gradient case. */
Test(mutation, every_differentiable_op_has_a_gradcase) {
#define TT_NAME(op) #op,
    const char *cases[] = {TT_GRADCASES(TT_NAME)};
    for (int i = 0; i < TM__NOPS; i++) {
        const tm__op_def *d = &tm__op_table[i];
        cr_assert_not_null(d->name, "op id %d has no row in the op table", i);
        if (!(d->kernels & (TM__K_CPU_BWD | TM__K_CUDA_BWD)) || (d->flags & TM__OP_NONDIFF)) continue;
        if (strcmp(d->name, "to_device") == 0) continue; /* needs two devices: tests/test_cuda_parity.c */
        int found = 0;
        for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) found |= strcmp(cases[k], d->name) == 0;
        cr_assert(found, "op %s has no tt_gradcase", d->name);
    }
}
