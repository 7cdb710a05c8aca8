/*
 * parity.h — the CUDA-against-CPU parity harness shared by tests/test_cuda_parity*.c.
 *
 * A case runs one op on CPU tensors and on CUDA tensors made from identical host data, then
 * backward on both with the same random upstream gradient; outputs and the gradients of every
 * float input must agree within |cuda - cpu| <= atol + rtol * |cpu| (tolerances: the top of
 * tests/test_cuda_parity.c). Ops whose inputs or outputs the generic case cannot describe
 * (several outputs, u8 maps, data-dependent shapes) write their own comparison with the same
 * helpers (tt_parity_ctx, tt_close_ratio) in their family's parity file.
 *
 * Coverage: every op that framework/ops.def gives a CUDA kernel needs a parity test.
 * tt_parity_run records the op of each case it runs; other parity tests declare theirs at file
 * scope with TT_PARITY_COVERS("op"). cuda_parity::every_cuda_op_has_a_parity_case (which runs
 * without a GPU) fails for any op with a CUDA kernel that no file declares.
 */
#ifndef TT_PARITY_H
#define TT_PARITY_H

#include "common.h"

#define TT_SKIP_WITHOUT_CUDA() \
    do { if (tm_cuda_device_count() == 0) cr_skip_test("no CUDA device"); } while (0)

/* A context on CUDA device 0 (2 CPU threads, 8 MiB arena chunks); asserts on failure. It sends
 * bf16 attention to the sm_80 kernels while tt_parity_attn_sm80 is set (tm__attn_set_sm80), and
 * tt_parity_run adds the attention launches that took the Hopper kernels to tt_parity_attn_sm90:
 * the attention tests' two paths on one GPU, and their proof of which one ran. */
tm_ctx *tt_parity_ctx(void);
extern int tt_parity_attn_sm80;
extern uint64_t tt_parity_attn_sm90;
/* Likewise tm_moe_gating's split path (tm__gating_set_split) and its forwards that ran. */
extern int tt_parity_gating_split;
extern uint64_t tt_parity_gating_split_n;

#define TT_PARITY_MAX_IN 4

typedef tm_status (*tt_parity_fn)(tm_ctx *ctx, tm_tensor **in, const int64_t *iattr, tm_tensor **out);

typedef struct tt_pcase {
    const char *op;   /* the op under test (its name in framework/ops.def) */
    const char *name;
    tt_parity_fn fn;
    int n_in;
    int nd[TT_PARITY_MAX_IN];
    int64_t shape[TT_PARITY_MAX_IN][TM_MAX_DIMS];
    tm_dtype index_dt[TT_PARITY_MAX_IN]; /* TM_I32 / TM_I64 for an index input, else 0 */
    int is_index[TT_PARITY_MAX_IN];
    int64_t iattr[4];
    /* atol multiplier for long f32 reductions: their results are sums of thousands of terms
     * (|sum| ~ 100), whose f32 rounding depends on the summation order. */
    double atol_scale;
    /* Index inputs are drawn uniformly from [0, index_hi). 0 means the classes of a
     * cross-entropy: [0, last dim of input 0), with iattr[0] (the ignore_index) planted in the
     * middle element. */
    int64_t index_hi;
} tt_pcase;

/* Run one case in dtype dt (float inputs and the upstream gradient in dt; index inputs in
 * their index_dt) and assert parity of the output and of every float input's gradient. */
void tt_parity_run(const tt_pcase *pc, tm_dtype dt, double atol, double rtol);

/* Deterministic uniform host data in [-2, 2) (malloc'd, n >= 0; free()). */
double *tt_parity_uniform(int64_t n, uint64_t seed);

/* Coverage registry (see the top of this file). */
void tt_parity_cover(const char *op);
int tt_parity_covered(const char *op);
#define TT_PARITY_CAT2_(a, b) a##b
#define TT_PARITY_CAT_(a, b) TT_PARITY_CAT2_(a, b)
#define TT_PARITY_COVERS(op_name)                                                                 \
    __attribute__((constructor)) static void TT_PARITY_CAT_(tt_parity_covers_, __LINE__)(void) { \
        tt_parity_cover(op_name);                                                                 \
    }

#endif
