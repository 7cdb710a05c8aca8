/* test_schedule.c — learning-rate schedules (tm_lr_at) at chosen steps against hand-computed
 * values, and tm_lr_schedule_check's errors.
 *
 * Most cases use lr 1, min_lr 0.1, warmup 10, so values are easy to derive by hand:
 * warmup step s gives (s + 1) / 10; a decay at progress p gives 1 - 0.9 p (linear) or
 * 0.1 + 0.9 (1 + cos(pi p)) / 2 (cosine). */
#include <math.h>
#include <string.h>

#include "common.h"

static void expect_lr(const tm_lr_schedule *s, int64_t step, double want) {
    double got = tm_lr_at(s, step);
    cr_assert(fabs(got - want) <= 1e-15 * (1.0 + fabs(want)), "kind %d step %lld: lr %.17g, want %.17g",
              (int)s->kind, (long long)step, got, want);
}

Test(schedule, constant_ignores_warmup_and_total) {
    tm_lr_schedule s = {.kind = TM_LR_CONSTANT, .lr = 3e-4, .warmup_steps = 100};
    expect_lr(&s, 0, 3e-4);
    expect_lr(&s, 99, 3e-4);
    expect_lr(&s, 1000000000, 3e-4);
    cr_assert_eq(tm_lr_schedule_check(NULL, &s), TM_OK);
}

/* The warmup of every decaying kind: step 0 already trains at lr / W, step W - 1 reaches lr. */
Test(schedule, warmup_is_linear_from_lr_over_w) {
    const tm_lr_kind kinds[3] = {TM_LR_COSINE, TM_LR_LINEAR, TM_LR_WSD};
    for (int i = 0; i < 3; i++) {
        tm_lr_schedule s = {.kind = kinds[i], .lr = 1.0, .min_lr = 0.1, .warmup_steps = 10, .total_steps = 110,
                            .decay_fraction = 0.2};
        expect_lr(&s, 0, 0.1);
        expect_lr(&s, 4, 0.5);
        expect_lr(&s, 9, 1.0);
        expect_lr(&s, 10, 1.0); /* first step after warmup: p = 0 */
    }
    /* W = 1: the one warmup step is at full lr; W = 0: no warmup at all. */
    tm_lr_schedule s = {.kind = TM_LR_LINEAR, .lr = 2.0, .min_lr = 0.0, .warmup_steps = 1, .total_steps = 5};
    expect_lr(&s, 0, 2.0);
    s.warmup_steps = 0;
    expect_lr(&s, 0, 2.0);
    expect_lr(&s, 1, 1.6); /* p = 1/5 */
}

Test(schedule, cosine) {
    tm_lr_schedule s = {.kind = TM_LR_COSINE, .lr = 1.0, .min_lr = 0.1, .warmup_steps = 10, .total_steps = 110};
    expect_lr(&s, 35, 0.1 + 0.9 * (1.0 + sqrt(0.5)) / 2); /* p = 1/4: cos(pi/4) = sqrt(1/2) */
    expect_lr(&s, 60, (1.0 + 0.1) / 2);                    /* midpoint: the mean of lr and min_lr */
    expect_lr(&s, 85, 0.1 + 0.9 * (1.0 - sqrt(0.5)) / 2); /* p = 3/4 */
    expect_lr(&s, 110, 0.1);                               /* p = 1 */
    expect_lr(&s, 111, 0.1);                               /* past total_steps */
    expect_lr(&s, 1000000, 0.1);
    /* Decreasing all along the decay. */
    for (int64_t k = 10; k < 110; k++) cr_assert(tm_lr_at(&s, k + 1) < tm_lr_at(&s, k), "step %lld", (long long)k);
}

Test(schedule, linear) {
    tm_lr_schedule s = {.kind = TM_LR_LINEAR, .lr = 1.0, .min_lr = 0.1, .warmup_steps = 10, .total_steps = 110};
    expect_lr(&s, 35, 1.0 - 0.9 * 0.25);
    expect_lr(&s, 60, 0.55);
    expect_lr(&s, 109, 1.0 - 0.9 * 0.99);
    expect_lr(&s, 110, 0.1);
    expect_lr(&s, 5000, 0.1);
    /* min_lr 0 decays to exactly 0. */
    s.min_lr = 0.0;
    expect_lr(&s, 60, 0.5);
    expect_lr(&s, 110, 0.0);
}

/* S = 100, decay_fraction 0.2: stable at lr through step 80, then linear over steps 80-100. */
Test(schedule, wsd) {
    tm_lr_schedule s = {.kind = TM_LR_WSD, .lr = 1.0, .min_lr = 0.1, .warmup_steps = 10, .total_steps = 100,
                        .decay_fraction = 0.2};
    expect_lr(&s, 10, 1.0);
    expect_lr(&s, 50, 1.0);
    expect_lr(&s, 79, 1.0);
    expect_lr(&s, 80, 1.0);             /* p = 0 */
    expect_lr(&s, 85, 1.0 - 0.9 * 0.25);
    expect_lr(&s, 90, 0.55);            /* halfway down */
    expect_lr(&s, 99, 1.0 - 0.9 * 0.95);
    expect_lr(&s, 100, 0.1);
    expect_lr(&s, 12345, 0.1);
    /* The decay length need not be a whole number of steps: S 10, fraction 0.25 -> D = 2.5,
     * starting at 7.5. */
    tm_lr_schedule f = {.kind = TM_LR_WSD, .lr = 1.0, .min_lr = 0.0, .total_steps = 10, .decay_fraction = 0.25};
    expect_lr(&f, 7, 1.0);
    expect_lr(&f, 8, 0.8);
    expect_lr(&f, 9, 0.4);
    expect_lr(&f, 10, 0.0);
    /* decay_fraction 1 with no warmup is the linear schedule. */
    tm_lr_schedule w = {.kind = TM_LR_WSD, .lr = 1.0, .min_lr = 0.1, .total_steps = 100, .decay_fraction = 1.0};
    tm_lr_schedule l = {.kind = TM_LR_LINEAR, .lr = 1.0, .min_lr = 0.1, .total_steps = 100};
    for (int64_t k = 0; k <= 101; k++) expect_lr(&w, k, tm_lr_at(&l, k));
}

/* No decay steps at all (total_steps = warmup_steps): warmup, then min_lr. */
Test(schedule, zero_length_decay) {
    const tm_lr_kind kinds[2] = {TM_LR_COSINE, TM_LR_LINEAR};
    for (int i = 0; i < 2; i++) {
        tm_lr_schedule s = {.kind = kinds[i], .lr = 1.0, .min_lr = 0.25, .warmup_steps = 4, .total_steps = 4};
        expect_lr(&s, 3, 1.0);
        expect_lr(&s, 4, 0.25);
    }
}

static void expect_bad(tm_lr_schedule s, const char *field, const char *value) {
    tm_ctx *ctx = tt_ctx();
    cr_assert_eq(tm_lr_schedule_check(ctx, &s), TM_ERR_INVALID_ARG, "%s accepted", field);
    const char *msg = tm_ctx_errmsg(ctx);
    cr_assert(strstr(msg, "tm_lr_schedule") && strstr(msg, field) && strstr(msg, value), "%s", msg);
    cr_assert_eq(tm_lr_schedule_check(NULL, &s), TM_ERR_INVALID_ARG); /* ctx may be NULL */
    cr_assert(isnan(tm_lr_at(&s, 0)), "%s: lr_at must be NaN", field);
    tm_ctx_free(ctx);
}

Test(schedule, bad_fields) {
    const tm_lr_schedule d = {.kind = TM_LR_WSD, .lr = 1e-3, .min_lr = 1e-4, .warmup_steps = 10, .total_steps = 100,
                              .decay_fraction = 0.2};
    cr_assert_eq(tm_lr_schedule_check(NULL, &d), TM_OK);
    tm_lr_schedule s;
    s = d; s.lr = -1e-3;            expect_bad(s, "lr", "-0.001");
    s = d; s.lr = NAN;              expect_bad(s, "lr", "nan");
    s = d; s.lr = INFINITY;         expect_bad(s, "lr", "inf");
    s = d; s.min_lr = 2e-3;         expect_bad(s, "min_lr", "0.002");
    s = d; s.min_lr = -1e-5;        expect_bad(s, "min_lr", "-1e-05");
    s = d; s.min_lr = NAN;          expect_bad(s, "min_lr", "nan");
    s = d; s.warmup_steps = -1;     expect_bad(s, "warmup_steps", "-1");
    s = d; s.total_steps = 9;       expect_bad(s, "total_steps", "9");
    s = d; s.decay_fraction = 0.0;  expect_bad(s, "decay_fraction", "0");
    s = d; s.decay_fraction = 1.5;  expect_bad(s, "decay_fraction", "1.5");
    s = d; s.decay_fraction = NAN;  expect_bad(s, "decay_fraction", "nan");
    s = d; s.kind = (tm_lr_kind)7;  expect_bad(s, "kind", "7");
    s = d; s.kind = TM_LR_COSINE; s.total_steps = 0; expect_bad(s, "total_steps", "0");
    s = d; s.kind = TM_LR_CONSTANT; s.warmup_steps = -5; expect_bad(s, "warmup_steps", "-5");
}

/* A field a kind does not read is not checked: a constant schedule may leave the decay fields
 * zero or inconsistent, and decay_fraction matters to wsd only. */
Test(schedule, unused_fields_not_checked) {
    tm_lr_schedule c = {.kind = TM_LR_CONSTANT, .lr = 1.0, .min_lr = 5.0, .warmup_steps = 10, .total_steps = 0};
    cr_assert_eq(tm_lr_schedule_check(NULL, &c), TM_OK);
    tm_lr_schedule k = {.kind = TM_LR_COSINE, .lr = 1.0, .total_steps = 10, .decay_fraction = 0.0};
    cr_assert_eq(tm_lr_schedule_check(NULL, &k), TM_OK);
}

Test(schedule, bad_calls) {
    cr_assert(isnan(tm_lr_at(NULL, 0)));
    tm_lr_schedule s = {.kind = TM_LR_COSINE, .lr = 1.0, .total_steps = 10};
    cr_assert(isnan(tm_lr_at(&s, -1)), "a negative step must not train quietly");
    tm_ctx *ctx = tt_ctx();
    cr_assert_eq(tm_lr_schedule_check(ctx, NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "tm_lr_schedule"), "%s", tm_ctx_errmsg(ctx));
    tm_ctx_free(ctx);
}
