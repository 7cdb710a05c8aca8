/*
 * gemm.h — the portable blocked GEMM behind tm__gemm_cpu (declared in internal.h).
 *
 * Exposed on its own so that tests can check it in builds where tm__gemm_cpu goes to CBLAS.
 * Same row-major contract as tm__gemm_cpu:
 *   C[M,N] = alpha * op(A) @ op(B) + beta * C, op(A) [M,K], op(B) [K,N],
 *   lda/ldb/ldc: row strides of the matrices as stored; dt TM_F32 or TM_F64.
 * beta == 0 never reads C (it may hold garbage, e.g. a fresh arena tensor).
 */
#ifndef TM_KERNELS_CPU_GEMM_H
#define TM_KERNELS_CPU_GEMM_H

#include "internal.h"

void tm__gemm_cpu_blocked(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N,
                          int64_t K, double alpha, const void *A, int64_t lda, const void *B,
                          int64_t ldb, double beta, void *C, int64_t ldc);

#endif
