/*
 * common.h — helpers shared by the Criterion tests.
 *
 * Gradient checks: tt_gradcheck() runs fn(ctx, inputs) -> out, draws a random upstream
 * gradient g (shape of out), computes analytic gradients with tm_backward_with_grad(out, g),
 * then for every element of every input with check[i] != 0 the central difference
 * (L(x+h) - L(x-h)) / 2h of L = sum(out * g), evaluated in f64 with grad mode off.
 * It returns the worst ratio |analytic - numeric| / (atol + rtol * |numeric|) over all checked
 * elements: <= 1 passes. Inputs to check must be f64 CPU tensors (index inputs: check 0).
 *
 * Every differentiable op owns one canonical case `double tt_gradcase_<op>(tm_ctx *ctx)`
 * (op = the op table name) returning that ratio; tests/test_<group>.c asserts it is <= 1 and
 * tests/test_mutation.c asserts it is > 1 when the op's backward is deliberately broken.
 */
#ifndef TT_COMMON_H
#define TT_COMMON_H

#include <criterion/criterion.h>
#include <stdint.h>
#include <unistd.h>

#include "tinymoe.h"

/* Bounds a test that could hang: SIGALRM ends the worker after `seconds`, which Criterion reports
 * as a crash. Used instead of Criterion's .timeout, whose BoxFort watchdog (Criterion 2.4)
 * intermittently loses the bookkeeping of a finished test under the sanitizers; LeakSanitizer
 * then reports 48 bytes per lost test in the runner and fails the whole run (CI, stop 16). */
#define TT_WATCHDOG(seconds) alarm(seconds)

/* A fresh CPU context (2 threads); asserts on failure. Free with tm_ctx_free. */
tm_ctx *tt_ctx(void);
/* The same with n threads (thread-count independence tests). */
tm_ctx *tt_ctx_threads(int n);
/* Assert status OK, printing the context message otherwise. */
#define TT_OK(ctx, expr)                                                                       \
    do {                                                                                       \
        tm_status tt_s_ = (expr);                                                              \
        cr_assert_eq(tt_s_, TM_OK, "%s -> %s: %s", #expr, tm_status_str(tt_s_), tm_ctx_errmsg(ctx)); \
    } while (0)

/* The allocator under ragged shapes (tests/test_arena.c): `steps` MoE-like steps whose sizes
 * (multiples of `unit` bytes) change every step on device dev; returns the arena's in-use peak
 * and the largest bytes it reserved from the device. */
void tt_ragged_workload(tm_ctx *ctx, tm_device dev, size_t unit, int steps, size_t *max_peak, size_t *max_reserved);

/* Temporary tensor of N(0,1) values (deterministic in seed) on the CPU. */
tm_tensor *tt_randn(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, uint64_t seed);
/* Temporary tensor of uniform values in [lo, hi). */
tm_tensor *tt_randu(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, uint64_t seed,
                    double lo, double hi);
/* Temporary i32/i64 tensor of uniform integers in [0, hi). */
tm_tensor *tt_randint(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, uint64_t seed,
                      int64_t hi);
/* Temporary tensor from explicit f64 values (converted to dt). */
tm_tensor *tt_from(tm_ctx *ctx, tm_dtype dt, int ndim, const int64_t *shape, const double *vals);
/* numel values of t as f64 (malloc'd; free()). */
double *tt_read(tm_ctx *ctx, const tm_tensor *t);
/* max_i |a_i - b_i| / (atol + rtol |b_i|): <= 1 means close. */
double tt_close_ratio(const double *a, const double *b, int64_t n, double atol, double rtol);
/* Assert two tensors (any device/dtype) are elementwise close (ratio above <= 1). */
void tt_assert_close(tm_ctx *ctx, const tm_tensor *got, const tm_tensor *want, double atol, double rtol);
/* Assert a host array equals a tensor's values within tolerance. */
void tt_assert_close_host(tm_ctx *ctx, const tm_tensor *got, const double *want, double atol, double rtol);

/* File-system fixtures for the I/O suites (each Criterion test runs in its own process, so
 * one directory per process is enough). tt_tmpdir_make creates /tmp/<prefix>XXXXXX and returns
 * it; tt_tmpdir_remove deletes it recursively; tt_path joins dir/name (8 rotating buffers). */
const char *tt_tmpdir_make(const char *prefix);
void tt_tmpdir_remove(void);
const char *tt_path(const char *name);
/* Whole file into malloc'd memory (*len bytes); entries of a directory without . and ..*/
unsigned char *tt_slurp(const char *path, long *len);

/* A Python interpreter that imports `module` (a test oracle): $TM_PYTHON, then the project's
 * .pyenv/bin/python (scripts/install-pydeps.sh), then python3; NULL when none does, which the
 * caller turns into a skip. With TM_REQUIRE_PYDEPS=1 (CI) a missing module fails the test here. */
const char *tt_python_with(const char *module);
/* The same for modules that CI does not install (torch): `modules` is what follows `import`
 * ("torch, transformers"); a missing one fails the test only when the environment variable
 * `require_var` is 1, with `how` (how to get them) in the message. */
const char *tt_python_with_req(const char *modules, const char *require_var, const char *how);
int tt_dir_entries(const char *dir);

typedef tm_status (*tt_fn)(tm_ctx *ctx, tm_tensor **inputs, void *user, tm_tensor **out);
/* See the top of this file. inputs may include parameters that fn uses (their gradient
 * buffer is zeroed first). eps: finite-difference step (1e-6 is a good default in f64). */
double tt_gradcheck(tm_ctx *ctx, tt_fn fn, void *user, int n_in, tm_tensor **inputs,
                    const int *check, double eps, double atol, double rtol);

/* Canonical gradient cases, one per differentiable op (defined in the op's test file). */
#define TT_GRADCASES(X) \
    X(matmul) X(add) X(sub) X(mul) X(scale) X(sum) X(mean) X(sum_all) X(mean_all)     \
    X(view) X(concat) X(contiguous) X(cast) X(embedding) X(index_select) X(gather)     \
    X(scatter_add) X(rmsnorm) X(silu) X(swiglu) X(softmax) X(log_softmax)              \
    X(cross_entropy) X(rope) X(attention) X(moe_router) X(moe_aux_scores) X(moe_aux_loss) \
    X(moe_seq_aux_loss) X(moe_z_loss) X(moe_drop_tokens) X(moe_permute) X(moe_unpermute)  \
    X(grouped_matmul) X(comm_allreduce) X(comm_allgather) X(comm_reduce_scatter) X(comm_alltoall) \
    X(add_rmsnorm) X(scale_rows) X(moe_sort_chunks) X(moe_gating) X(grouped_swiglu)      \
    X(grouped_mlp)
#define TT_DECL_GRADCASE(op) double tt_gradcase_##op(tm_ctx *ctx);
TT_GRADCASES(TT_DECL_GRADCASE)

/* Shared optimizer checks. make: an optimizer over every parameter of ctx with learning rate
 * lr and weight decay wd (the test file's algorithm). */
typedef tm_optimizer *(*tt_make_optimizer)(tm_ctx *ctx, double lr, double weight_decay);
/* With zero gradients one step multiplies parameters of 2+ dims by 1 - lr wd and leaves 1-D
 * and 0-D parameters alone (AdamW: the Adam term is exactly 0; SGD: b = wd p). */
void tt_check_decay_only_on_matrices(tt_make_optimizer make);
/* tm_ctx_clip_grad_norm_deferred + tm_optimizer_step_scaled against tm_ctx_clip_grad_norm +
 * tm_optimizer_step, in two contexts fed the same gradients over four steps (clipping, and one
 * step that does not clip): the same norm, the factor of the documented formula, and the same
 * bits in every parameter, moment and master weight; AdamW leaves the gradients as they were.
 * Parameters of dtype dt on dev; AdamW, or SGD with momentum when sgd. */
void tt_check_clip_deferred(tm_device dev, tm_dtype dt, int sgd);

#endif
