/*
 * op_table.c — every op of tinymoe, one row each: name, arity, flags, the check that validates
 * inputs and infers output shapes, and the forward / backward kernels per backend.
 *
 * Where to find op "foo":
 *   public function + check : framework/ops/<group>.c      (tm_foo, tm__foo_check)
 *   CPU kernels             : kernels/cpu/<group>.c        (tm__foo_forward_cpu / _backward_cpu)
 *   CUDA kernels            : kernels/cuda/<group>.cu      (tm__foo_forward_cuda / _backward_cuda)
 *   tests                   : tests/test_<group>.c
 * A NULL CUDA column means "not on CUDA yet": tm__op_run reports TM_ERR_UNSUPPORTED by name.
 */
#include "internal.h"

#ifdef TM_HAVE_CUDA
#define CU(fn) fn
#else
#define CU(fn) NULL
#endif

#define ROW(id, nm, nin, nout, fl, chk, fc, fg, bc, bg) \
    [id] = {nm, nin, nout, fl, chk, {fc, fg}, {bc, bg}}
/* An op with CPU kernels and CUDA kernels. */
#define OP_CPU_CUDA(id, nm, nin, nout, fl, op)                                                \
    ROW(id, nm, nin, nout, fl, tm__##op##_check, tm__##op##_forward_cpu, CU(tm__##op##_forward_cuda), \
        tm__##op##_backward_cpu, CU(tm__##op##_backward_cuda))
/* An op with CPU kernels only (CUDA follows in the full CUDA issue). */
#define OP_CPU(id, nm, nin, nout, fl, op) \
    ROW(id, nm, nin, nout, fl, tm__##op##_check, tm__##op##_forward_cpu, NULL, tm__##op##_backward_cpu, NULL)
/* A device-generic op: the same functions serve both backends. */
#define OP_GENERIC(id, nm, nin, nout, fl, op) \
    ROW(id, nm, nin, nout, fl, tm__##op##_check, tm__##op##_forward, tm__##op##_forward, \
        tm__##op##_backward, tm__##op##_backward)

const tm__op_def tm__op_table[TM__NOPS] = {
    /*          id                    name             in  out flags */
    OP_CPU_CUDA(TM__OP_MATMUL,        "matmul",        2,  1,  0, matmul),
    OP_CPU_CUDA(TM__OP_ADD,           "add",           2,  1,  0, add),
    OP_CPU_CUDA(TM__OP_SUB,           "sub",           2,  1,  0, sub),
    OP_CPU_CUDA(TM__OP_MUL,           "mul",           2,  1,  0, mul),
    OP_CPU_CUDA(TM__OP_SCALE,         "scale",         1,  1,  0, scale),
    OP_CPU_CUDA(TM__OP_SUM,           "sum",           1,  1,  0, sum),
    OP_CPU_CUDA(TM__OP_MEAN,          "mean",          1,  1,  0, mean),
    OP_CPU_CUDA(TM__OP_SUM_ALL,       "sum_all",       1,  1,  0, sum_all),
    OP_CPU_CUDA(TM__OP_MEAN_ALL,      "mean_all",      1,  1,  0, mean_all),
    /* views: check builds the view; forward is a no-op on either backend */
    OP_GENERIC (TM__OP_VIEW,          "view",          1,  1,  TM__OP_STRIDED | TM__OP_NATIVE_BF16, view),
    OP_GENERIC (TM__OP_CONCAT,        "concat",       -1,  1,  TM__OP_STRIDED | TM__OP_NATIVE_BF16, concat),
    OP_GENERIC (TM__OP_CONTIGUOUS,    "contiguous",    1,  1,  TM__OP_STRIDED | TM__OP_NATIVE_BF16, contiguous),
    OP_GENERIC (TM__OP_CAST,          "cast",          1,  1,  TM__OP_STRIDED | TM__OP_NATIVE_BF16, cast),
    OP_GENERIC (TM__OP_TO_DEVICE,     "to_device",     1,  1,  TM__OP_STRIDED | TM__OP_NATIVE_BF16 | TM__OP_ANY_DEVICE, to_device),
    OP_CPU     (TM__OP_EMBEDDING,     "embedding",     2,  1,  0, embedding),
    OP_CPU     (TM__OP_INDEX_SELECT,  "index_select",  2,  1,  0, index_select),
    OP_CPU     (TM__OP_GATHER,        "gather",        2,  1,  0, gather),
    OP_CPU     (TM__OP_SCATTER_ADD,   "scatter_add",   2,  1,  0, scatter_add),
    OP_CPU_CUDA(TM__OP_RMSNORM,       "rmsnorm",       2,  1,  0, rmsnorm),
    OP_CPU_CUDA(TM__OP_SILU,          "silu",          1,  1,  0, silu),
    OP_CPU_CUDA(TM__OP_SWIGLU,        "swiglu",        2,  1,  0, swiglu),
    OP_CPU_CUDA(TM__OP_SOFTMAX,       "softmax",       1,  1,  0, softmax),
    OP_CPU_CUDA(TM__OP_LOG_SOFTMAX,   "log_softmax",   1,  1,  0, log_softmax),
    OP_CPU_CUDA(TM__OP_CROSS_ENTROPY, "cross_entropy", 2,  1,  0, cross_entropy),
    OP_CPU     (TM__OP_ROPE,          "rope",          1,  1,  0, rope),
    OP_CPU     (TM__OP_ATTENTION,     "attention",     3,  1,  0, attention),
    OP_CPU     (TM__OP_MOE_DROP_TOKENS, "moe_drop_tokens", 2, 3, 0, moe_drop_tokens),
    OP_CPU     (TM__OP_MOE_PERMUTE,   "moe_permute",   3,  4,  TM__OP_NATIVE_BF16, moe_permute),
    OP_CPU     (TM__OP_MOE_UNPERMUTE, "moe_unpermute", -1, 1,  0, moe_unpermute),
    OP_CPU     (TM__OP_MOE_AUX_LOSS,  "moe_aux_loss",  2,  1,  0, moe_aux_loss),
    OP_CPU     (TM__OP_MOE_SEQ_AUX_LOSS, "moe_seq_aux_loss", 2, 1, 0, moe_seq_aux_loss),
    OP_CPU     (TM__OP_MOE_Z_LOSS,    "moe_z_loss",    1,  1,  0, moe_z_loss),
    OP_CPU     (TM__OP_GROUPED_MATMUL, "grouped_matmul", 3, 1, 0, grouped_matmul),
    OP_CPU     (TM__OP_MOE_ROUTER,    "moe_router",   -1,  5,  0, moe_router),
    OP_CPU     (TM__OP_MOE_AUX_SCORES, "moe_aux_scores", 1, 1, 0, moe_aux_scores),
};
