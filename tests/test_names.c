/* test_names.c — the context's index of named tensors (framework/names.c): every name is found
 * after many insertions and table growths, parameters keep their creation order, a repeated
 * name is refused; and the work is linear: a 10,000-layer model builds, gets an optimizer,
 * saves and loads back in seconds (with a linear name search it never finished). */
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#include "common.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void setup(void) { tt_tmpdir_make("tm_test_names_"); }
static void teardown(void) { tt_tmpdir_remove(); }
TestSuite(names, .init = setup, .fini = teardown);

Test(names, every_name_is_found_and_params_keep_their_order) {
    tm_ctx *ctx = tt_ctx();
    enum { N = 5000 };
    int64_t one = 1;
    char name[64];
    for (int i = 0; i < N; i++) {
        tm_tensor *t;
        snprintf(name, sizeof name, "t.%d", i);
        /* Every third a buffer: the parameters' positions skip them. */
        if (i % 3 == 2) TT_OK(ctx, tm_buffer_new(ctx, name, TM_F32, 1, &one, tm_cpu(), &t));
        else TT_OK(ctx, tm_param_new(ctx, name, TM_F32, 1, &one, tm_cpu(), &t));
    }
    int p = 0;
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "t.%d", i);
        tm_tensor *t = tm_ctx_find(ctx, name);
        cr_assert_not_null(t, "%s not found", name);
        cr_assert_str_eq(tm_tensor_name(t), name);
        if (i % 3 != 2) cr_assert_eq(tm_ctx_param(ctx, p++), t, "parameter %d is %s", p - 1, name);
    }
    cr_assert_eq(tm_ctx_num_params(ctx), p);
    cr_assert_null(tm_ctx_param(ctx, p));
    cr_assert_null(tm_ctx_param(ctx, -1));
    cr_assert_null(tm_ctx_find(ctx, "t.5000"));
    cr_assert_null(tm_ctx_find(ctx, "t."));
    cr_assert_null(tm_ctx_find(ctx, ""));
    tm_tensor *dup;
    cr_assert_eq(tm_param_new(ctx, "t.4999", TM_F32, 1, &one, tm_cpu(), &dup), TM_ERR_INVALID_ARG);
    cr_assert(strstr(tm_ctx_errmsg(ctx), "already exists"), "%s", tm_ctx_errmsg(ctx));
    cr_assert_eq(tm_buffer_new(ctx, "t.0", TM_F32, 1, &one, tm_cpu(), &dup), TM_ERR_INVALID_ARG);
    cr_assert_eq(tm_ctx_num_params(ctx), p, "a refused name adds nothing");
    tm_ctx_free(ctx);
}

/* The bound is generous (the linear search took minutes for this model; the index takes well
 * under a second on 2 cores). */
Test(names, a_model_of_10000_layers_builds_saves_and_loads_in_seconds) {
    TT_WATCHDOG(120);
    tm_ctx *ctx = tt_ctx();
    tm_model_config c = tm_model_config_default();
    c.vocab_size = 16;
    c.d_model = 8;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.n_layers = 10000;
    c.max_seq_len = 8;
    c.moe.ffn_size = 8;
    double t0 = now_s();
    tm_model *m = NULL;
    TT_OK(ctx, tm_model_new(ctx, &c, TM_F32, tm_cpu(), &m));
    tm_optimizer *opt = NULL;
    tm_adamw_config ac = tm_adamw_config_default();
    TT_OK(ctx, tm_adamw_new(ctx, &ac, &opt));
    double built = now_s() - t0;
    cr_assert_gt(tm_ctx_num_params(ctx), 100000);
    cr_assert_not_null(tm_ctx_find(ctx, "layers.9999.moe.experts.wo"));
    cr_assert_not_null(tm_ctx_find(ctx, "layers.9999.attn.wq.adamw_m"));
    const char *path = tt_path("deep.tmck");
    TT_OK(ctx, tm_ckpt_save(ctx, path, NULL, 0));
    t0 = now_s();
    TT_OK(ctx, tm_ckpt_load(ctx, path, NULL, 0, NULL));
    double loaded = now_s() - t0;
    cr_log_info("10000 layers: model + optimizer %.2f s, load %.2f s", built, loaded);
    cr_assert_lt(built, 20.0, "building took %.1f s", built);
    cr_assert_lt(loaded, 20.0, "loading took %.1f s", loaded);
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
}
