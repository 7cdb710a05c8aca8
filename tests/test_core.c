/* test_core.c — version, status codes, contexts, allocator hook, tensors, errors, autograd
 * plumbing (accumulation, no-grad, tape consumption). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "internal.h"

Test(core, version) {
    cr_assert_str_eq(tm_version(), TM_VERSION_STRING);
    cr_assert_eq(tm_version_number(), TM_VERSION_NUMBER);
    cr_assert_eq(TM_VERSION_NUMBER, TM_VERSION_MAJOR * 10000 + TM_VERSION_MINOR * 100 + TM_VERSION_PATCH);
}

Test(core, status_strings) {
    for (int s = TM_OK; s <= TM_ERR_INTERNAL; s++) {
        const char *m = tm_status_str((tm_status)s);
        cr_assert(m && *m && strcmp(m, "unknown status") != 0, "status %d has no string", s);
    }
    cr_assert_str_eq(tm_status_str((tm_status)999), "unknown status");
    cr_assert_str_eq(tm_dtype_name(TM_BF16), "bf16");
    cr_assert_eq(tm_dtype_size(TM_BF16), 2);
    cr_assert_eq(tm_dtype_size((tm_dtype)77), 0);
}

Test(core, ctx_new_bad_args) {
    cr_assert_eq(tm_ctx_new(NULL, NULL), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_last_create_error(), "out is NULL"));
    tm_ctx_free(NULL); /* no-op */
    tm_allocator half = {0};
    tm_ctx_options o = tm_ctx_options_default();
    o.allocator = &half;
    tm_ctx *ctx = (tm_ctx *)0x1;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_ERR_INVALID_ARG);
    cr_assert_null(ctx);
    cr_assert(strstr(tm_last_create_error(), "allocator"));
    o = tm_ctx_options_default();
    o.cpu_gemm = 2;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_last_create_error(), "cpu_gemm = 2"), "%s", tm_last_create_error());
    o = tm_ctx_options_default();
    o.grouped_gemm = 4;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_last_create_error(), "grouped_gemm = 4"), "%s", tm_last_create_error());
}

/* The grouped GEMM schedule is an option of the context (the library reads no environment). */
Test(core, grouped_gemm_option_sets_the_schedule) {
    tm_ctx_options o = tm_ctx_options_default();
    cr_assert_eq(o.grouped_gemm, TM_GROUPED_GEMM_AUTO);
    {   /* a context without a CUDA device: AUTO is cuBLASLt's schedule (host counts), the CPU's rule */
        tm_ctx *ctx = NULL;
        cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK);
        cr_assert_eq(tm__gmm_mode(ctx), TM_GROUPED_GEMM_CUBLASLT);
        cr_assert_eq(tm__gmm_device_schedule(ctx), 0);
        tm_ctx_free(ctx);
    }
    const int modes[3] = {TM_GROUPED_GEMM_CUBLASLT, TM_GROUPED_GEMM_DEVICE, TM_GROUPED_GEMM_HOPPER};
    for (int i = 0; i < 3; i++) {
        o.grouped_gemm = modes[i];
        tm_ctx *ctx = NULL;
        cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK);
        /* the Hopper kernel schedules on the device too (and falls back to the device kernel) */
        cr_assert_eq(tm__gmm_device_schedule(ctx), modes[i] != TM_GROUPED_GEMM_CUBLASLT);
        cr_assert_eq(tm__gmm_mode(ctx), modes[i]);
        cr_assert_str_empty(tm__gmm_note(ctx));
        tm_ctx_free(ctx);
    }
}

Test(core, cuda_device_unavailable) {
    tm_ctx_options o = tm_ctx_options_default();
    o.cuda_device = tm_cuda_device_count(); /* one past the last device */
    tm_ctx *ctx = NULL;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_ERR_DEVICE);
    cr_assert_null(ctx);
    cr_assert(strstr(tm_last_create_error(), "cuda_device"), "%s", tm_last_create_error());
}

typedef struct {
    int allocs, frees;
} counting;
static void *c_alloc(size_t n, size_t align, void *u) {
    ((counting *)u)->allocs++;
    return aligned_alloc(align, (n + align - 1) / align * align);
}
static void c_free(void *p, void *u) {
    ((counting *)u)->frees++;
    free(p);
}

Test(core, allocator_hook_sees_every_allocation) {
    counting cnt = {0, 0};
    tm_allocator a = {c_alloc, c_free, &cnt};
    tm_ctx_options o = tm_ctx_options_default();
    o.allocator = &a;
    o.arena_chunk_bytes = 1 << 16;
    tm_ctx *ctx = NULL;
    cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK);
    int64_t shape[2] = {3, 5};
    tm_tensor *p, *t;
    TT_OK(ctx, tm_param_new(ctx, "w", TM_F32, 2, shape, tm_cpu(), &p));
    TT_OK(ctx, tm_tensor_zeros(ctx, TM_F32, 2, shape, tm_cpu(), &t));
    cr_assert_eq((uint64_t)cnt.allocs, tm_ctx_alloc_count(ctx));
    tm_ctx_free(ctx);
    cr_assert_eq(cnt.allocs, cnt.frees, "allocs %d frees %d", cnt.allocs, cnt.frees);
}

Test(core, two_contexts_do_not_interfere) {
    tm_ctx *a = tt_ctx(), *b = tt_ctx();
    int64_t bad = -1;
    tm_tensor *t;
    cr_assert_eq(tm_tensor_empty(a, TM_F32, 1, &bad, tm_cpu(), &t), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(a), "negative"));
    cr_assert_str_eq(tm_ctx_errmsg(b), "");
    int64_t s = 4;
    tm_tensor *pa, *pb;
    TT_OK(a, tm_param_new(a, "w", TM_F32, 1, &s, tm_cpu(), &pa));
    TT_OK(b, tm_param_new(b, "w", TM_F32, 1, &s, tm_cpu(), &pb)); /* same name, other context */
    tm_ctx_set_grad_enabled(a, 0);
    cr_assert_eq(tm_ctx_set_grad_enabled(b, 1), 1);
    cr_assert_eq(tm_ctx_set_grad_enabled(a, 0), 0);
    tm_tensor *x;
    cr_assert_eq(tm_transpose(a, pb, 0, 0, &x), TM_ERR_INVALID_ARG, "tensor of another context");
    cr_assert(strstr(tm_ctx_errmsg(a), "another context"), "%s", tm_ctx_errmsg(a));
    tm_ctx_free(a);
    tm_ctx_free(b);
}

Test(core, tensor_creation_errors_name_the_problem) {
    tm_ctx *ctx = tt_ctx();
    int64_t shape[5] = {1, 2, 3, 4, 5};
    tm_tensor *t = NULL;
    cr_assert_eq(tm_tensor_empty(ctx, TM_F32, 5, shape, tm_cpu(), &t), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "ndim 5"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_tensor_empty(ctx, (tm_dtype)42, 1, shape, tm_cpu(), &t), TM_ERR_DTYPE);
    cr_assert_eq(tm_tensor_empty(ctx, TM_F32, 1, shape, tm_cuda(0), &t), TM_ERR_DEVICE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "cuda:0"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_tensor_empty(ctx, TM_F32, 1, shape, tm_cpu(), NULL), TM_ERR_INVALID_ARG);
    cr_assert_null(t, "out untouched on failure");
    TT_OK(ctx, tm_param_new(ctx, "layer.w", TM_F32, 2, shape, tm_cpu(), &t));
    tm_tensor *u = NULL;
    cr_assert_eq(tm_param_new(ctx, "layer.w", TM_F32, 2, shape, tm_cpu(), &u), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "\"layer.w\" already exists"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_param_new(ctx, "ids", TM_I32, 1, shape, tm_cpu(), &u), TM_ERR_DTYPE);
    cr_assert_eq(tm_ctx_find(ctx, "layer.w"), t);
    cr_assert_null(tm_ctx_find(ctx, "nope"));
    double v[3]; /* layer.w is [1,2]: 2 elements */
    cr_assert_eq(tm_tensor_read(ctx, t, TM_F64, v, 3), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "count 3") && strstr(tm_ctx_errmsg(ctx), "f32[1,2]@cpu"), "%s", tm_ctx_errmsg(ctx));
    tm_ctx_free(ctx);
}

Test(core, params_share_one_buffer_and_survive_growth) {
    tm_ctx *ctx = tt_ctx();
    int64_t s1 = 1000, s2[2] = {300, 700};
    tm_tensor *a, *b;
    TT_OK(ctx, tm_param_new(ctx, "a", TM_F32, 1, &s1, tm_cpu(), &a));
    TT_OK(ctx, tm_tensor_init_normal(ctx, a, 1, NULL, 0, 1));
    double *before = tt_read(ctx, a);
    TT_OK(ctx, tm_param_new(ctx, "b", TM_F32, 2, s2, tm_cpu(), &b)); /* grows past 1 MiB? no: 2 params, 1 buffer */
    for (int i = 0; i < 300; i++) { /* force several buffer growths */
        char nm[32];
        snprintf(nm, sizeof nm, "p%d", i);
        tm_tensor *t;
        TT_OK(ctx, tm_param_new(ctx, nm, TM_F32, 2, s2, tm_cpu(), &t));
    }
    double *after = tt_read(ctx, a);
    cr_assert_eq(memcmp(before, after, sizeof(double) * 1000), 0, "values kept when the buffer moved");
    cr_assert_eq(tm_ctx_num_params(ctx), 302);
    cr_assert_eq(tm_ctx_param(ctx, 1), b);
    cr_assert_eq(a->storage, b->storage, "one contiguous parameter buffer");
    cr_assert_eq(a->grad->storage, b->grad->storage, "one contiguous gradient buffer");
    cr_assert(b->offset * 4 >= 4000 && (b->offset * 4) % 64 == 0);
    free(before);
    free(after);
    tm_ctx_free(ctx);
}

Test(core, bf16_round_to_nearest_even) {
    tm_ctx *ctx = tt_ctx();
    /* 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (mantissa even: 1) -> 1;
     * 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6 (even) -> 1 + 2^-6;
     * 1 + 2^-8 + 2^-20 is above halfway -> 1 + 2^-7. */
    float in[5] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -2.5f, 65504.0f};
    double want[5] = {1.0, 1.0 + 0x1p-6, 1.0 + 0x1p-7, -2.5, 65536.0};
    int64_t n = 5;
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_BF16, 1, &n, tm_cpu(), TM_F32, in, &t));
    tt_assert_close_host(ctx, t, want, 0, 0);
    tm_ctx_free(ctx);
}

static tm_tensor *make_param(tm_ctx *ctx, const char *name, int64_t r, int64_t c) {
    int64_t s[2] = {r, c};
    tm_tensor *p;
    TT_OK(ctx, tm_param_new(ctx, name, TM_F64, 2, s, tm_cpu(), &p));
    TT_OK(ctx, tm_tensor_init_normal(ctx, p, 7, NULL, 0, 1));
    return p;
}

Test(core, backward_accumulates_across_micro_batches) {
    tm_ctx *ctx = tt_ctx();
    tm_tensor *p = make_param(ctx, "w", 3, 4);
    int64_t gs[2] = {4, 3};
    tm_tensor *g = tt_randn(ctx, TM_F64, 2, gs, 3);
    double *gh = tt_read(ctx, g);
    for (int step = 0; step < 2; step++) {
        tm_tensor *y;
        TT_OK(ctx, tm_transpose(ctx, p, 0, 1, &y));
        TT_OK(ctx, tm_backward_with_grad(ctx, y, g));
    }
    double want[12];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++) want[i * 4 + j] = 2 * gh[j * 3 + i];
    tt_assert_close_host(ctx, tm_tensor_grad(p), want, 0, 0);
    TT_OK(ctx, tm_ctx_zero_grad(ctx));
    double zero[12] = {0};
    tt_assert_close_host(ctx, tm_tensor_grad(p), zero, 0, 0);
    free(gh);
    tm_ctx_free(ctx);
}

Test(core, no_grad_mode_records_nothing) {
    tm_ctx *ctx = tt_ctx();
    tm_tensor *p = make_param(ctx, "w", 2, 2), *y;
    tm_ctx_set_grad_enabled(ctx, 0);
    TT_OK(ctx, tm_transpose(ctx, p, 0, 1, &y));
    cr_assert_eq(tm_tensor_requires_grad(y), 0);
    cr_assert_eq(tm_backward_with_grad(ctx, y, y), TM_ERR_STATE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "does not require grad"), "%s", tm_ctx_errmsg(ctx));
    tm_ctx_free(ctx);
}

Test(core, backward_errors) {
    tm_ctx *ctx = tt_ctx();
    tm_tensor *p = make_param(ctx, "w", 2, 3), *y;
    TT_OK(ctx, tm_transpose(ctx, p, 0, 1, &y));
    cr_assert_eq(tm_backward(ctx, y), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "one element"), "%s", tm_ctx_errmsg(ctx));
    int64_t s[2] = {2, 3};
    tm_tensor *g = tt_randn(ctx, TM_F64, 2, s, 1);
    cr_assert_eq(tm_backward_with_grad(ctx, y, g), TM_ERR_SHAPE);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "[2,3]") && strstr(tm_ctx_errmsg(ctx), "[3,2]"), "%s", tm_ctx_errmsg(ctx));
    tm_tensor *leaf = tt_randn(ctx, TM_F64, 2, s, 2);
    cr_assert_eq(tm_tensor_set_requires_grad(ctx, y, 1), TM_ERR_STATE);
    tm_tensor *ids = tt_randint(ctx, TM_I32, 2, s, 1, 5);
    cr_assert_eq(tm_tensor_set_requires_grad(ctx, ids, 1), TM_ERR_DTYPE);
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, leaf, 1));
    tm_ctx_free(ctx);
}

Test(core, tensor_read_write_convert) {
    tm_ctx *ctx = tt_ctx();
    int64_t s[2] = {2, 3};
    int32_t ids[6] = {0, -1, 7, 2147483647, -2147483647 - 1, 5};
    tm_tensor *t;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_I64, 2, s, tm_cpu(), TM_I32, ids, &t));
    int32_t back[6];
    TT_OK(ctx, tm_tensor_read(ctx, t, TM_I32, back, 6));
    cr_assert_eq(memcmp(ids, back, sizeof ids), 0);
    TT_OK(ctx, tm_tensor_fill(ctx, t, 3));
    int64_t b64[6];
    TT_OK(ctx, tm_tensor_read(ctx, t, TM_I64, b64, 6));
    for (int i = 0; i < 6; i++) cr_assert_eq(b64[i], 3);
    cr_assert_eq(tm_tensor_write(ctx, t, TM_I32, NULL, 6), TM_ERR_INVALID_ARG);
    tm_ctx_free(ctx);
}

/* A bf16 op taking one tensor twice runs on one f32 staging copy of its gradient, so both
 * contributions land: d/dx sum(x * x) = 2x, and attention with k as v gets dk + dv (found by
 * the CUDA parity suite: the CPU's staged bf16 backward kept only the second). */
Test(core, bf16_staging_of_an_input_used_twice) {
    tm_ctx *ctx = tt_ctx();
    int64_t n = 5;
    const double v[5] = {1, 2, 3, -1, 0.5};
    tm_tensor *x = tt_from(ctx, TM_BF16, 1, &n, v), *y, *s;
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    TT_OK(ctx, tm_mul(ctx, x, x, &y));
    TT_OK(ctx, tm_sum_all(ctx, y, &s));
    TT_OK(ctx, tm_backward(ctx, s));
    double want[5];
    for (int i = 0; i < 5; i++) want[i] = 2 * v[i];
    tt_assert_close_host(ctx, tm_tensor_grad(x), want, 0, 0);

    /* attention(q, k, k) in bf16 against the f32 run of the same values */
    int64_t qs[4] = {1, 6, 2, 8}, ks[4] = {1, 9, 1, 8};
    tm_tensor *q32 = tt_randn(ctx, TM_F32, 4, qs, 3), *k32 = tt_randn(ctx, TM_F32, 4, ks, 4), *q16, *k16;
    TT_OK(ctx, tm_cast(ctx, q32, TM_BF16, &q16));
    TT_OK(ctx, tm_cast(ctx, k32, TM_BF16, &k16));
    TT_OK(ctx, tm_cast(ctx, k16, TM_F32, &k32)); /* the f32 run sees the bf16 values */
    TT_OK(ctx, tm_cast(ctx, q16, TM_F32, &q32));
    tm_tensor *leaves[2] = {k16, k32};
    for (int i = 0; i < 2; i++) {
        tm_tensor *o, *os;
        TT_OK(ctx, tm_tensor_set_requires_grad(ctx, leaves[i], 1));
        TT_OK(ctx, tm_attention(ctx, i ? q32 : q16, leaves[i], leaves[i], 0.0, &o));
        TT_OK(ctx, tm_sum_all(ctx, o, &os));
        TT_OK(ctx, tm_backward(ctx, os));
    }
    tt_assert_close(ctx, tm_tensor_grad(k16), tm_tensor_grad(k32), 2e-2, 2e-2);
    tm_ctx_free(ctx);
}
