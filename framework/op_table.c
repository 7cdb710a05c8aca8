/*
 * op_table.c — every op of tinymoe, one row each: name, arity, flags, which kernels exist, and
 * the check that validates inputs and infers output shapes.
 *
 * Where to find op "foo":
 *   public function + check : framework/ops/<group>.c      (tm_foo, tm__foo_check)
 *   CPU kernels             : kernels/cpu/<group>.c        (tm__foo_forward_cpu / _backward_cpu)
 *   CUDA kernels            : kernels/cuda/<group>.cu      (tm__foo_forward_cuda / _backward_cuda)
 *   tests                   : tests/test_<group>.c
 * The rows are generated from the registry, framework/ops.def; each backend's kernel table
 * (tm__backend_ops.fwd / .bwd) is generated from the same list. An op without a kernel on a
 * backend makes tm__op_run report TM_ERR_UNSUPPORTED by name.
 */
#include "internal.h"

const tm__op_def tm__op_table[TM__NOPS] = {
#define TM__OP(ID, nm, n_in, n_out, flags, kernels) {#nm, n_in, n_out, flags, TM__KMASK_##kernels, tm__##nm##_check},
#include "ops.def"
#undef TM__OP
};
