/*
 * gemm.c — CPU GEMM: CBLAS when the build has it, a portable blocked kernel otherwise.
 *
 * Row-major C[M,N] = alpha * op(A) @ op(B) + beta * C (contract in internal.h / gemm.h).
 *
 * The blocked kernel follows Goto & van de Geijn, "Anatomy of high-performance matrix
 * multiplication" (TOMS 2008), the BLIS layering:
 *   for jc (NC columns of C):      a KC x NC panel of op(B) is packed once, shared by all
 *     for pc (KC slice of K):      threads (it is meant to sit in L3);
 *       for ic (MC rows, one per   each thread packs its own MC x KC block of op(A) (L2)
 *               OpenMP task):      and sweeps it against the B panel in MR x NR register
 *         for jr, ir:              tiles held in accumulators across the whole KC loop.
 * Packing makes both operands unit-stride in the micro-kernel whatever the transposes, so
 * transposes cost only a strided read at pack time. Panels are zero-padded to whole tiles so
 * the micro-kernel has no edge cases; only the store is clipped.
 *
 * MR x NR = 6 x 16 (f32) and 6 x 8 (f64) use 12 AVX2 accumulators + 2 B vectors + 1 broadcast
 * = 15 of the 16 ymm registers. The micro-kernel is portable C (GNU vector extensions where
 * available); on x86-64 GCC the macro-kernel is also compiled for x86-64-v3 (AVX2 + FMA) and
 * picked at load time, since the library itself is built for the baseline ISA, and it opts back
 * into FMA contraction, which -std=c11 turns off. Single-core f32 throughput is about half of
 * OpenBLAS's AVX-512 kernels, and close to it on large products with all cores busy
 * (4096 x 768 x 768 f32 on 2 cores: 112 vs 120 GFLOP/s).
 *
 * Scratch (the packed panels, sized to the problem, at most NC x KC + threads x MC x KC
 * elements) comes from the context's per-step arena: no system allocation in steady state.
 */
#include "gemm.h"

#include <limits.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef TM_HAVE_CBLAS
#include <cblas.h>
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TM__GEMM_CLONES \
    __attribute__((target_clones("arch=x86-64-v3", "default"), optimize("fp-contract=fast")))
#else
#define TM__GEMM_CLONES
#endif

#if defined(__GNUC__)
#define TM__PRAGMA(x) _Pragma(#x)
#define TM__UNROLL(n) TM__PRAGMA(GCC unroll n)
#else
#define TM__UNROLL(n)
#endif

/*
 * The micro-kernel: acc[MR][NR] = sum_p a[p][:] (x) b[p][:] over one KC slice, MR broadcasts
 * times one NR-wide vector per step of k. GCC/clang vector extensions pin the MR accumulators
 * in registers (plain loops leave them in memory at -O2); elsewhere the plain loop.
 */
#if defined(__GNUC__)
#define TM__GEMM_VBYTES 32
#define TM__GEMM_UKR(T, MR, NR, kc, a, b, acc)                                                \
    do {                                                                                      \
        typedef T tm__vec __attribute__((vector_size(TM__GEMM_VBYTES)));                      \
        enum { NV = (NR) * sizeof(T) / TM__GEMM_VBYTES, VW = TM__GEMM_VBYTES / sizeof(T) };   \
        tm__vec va[MR][NV];                                                                   \
        TM__UNROLL(MR) for (int i = 0; i < (MR); ++i)                                         \
            TM__UNROLL(NV) for (int v = 0; v < NV; ++v) va[i][v] = (tm__vec){0};              \
        for (int64_t p = 0; p < (kc); ++p) {                                                  \
            tm__vec vb[NV];                                                                   \
            TM__UNROLL(NV) for (int v = 0; v < NV; ++v)                                       \
                memcpy(&vb[v], (b) + p * (NR) + v * VW, sizeof(tm__vec));                    \
            TM__UNROLL(MR) for (int i = 0; i < (MR); ++i) {                                   \
                T ai = (a)[p * (MR) + i];                                                     \
                TM__UNROLL(NV) for (int v = 0; v < NV; ++v) va[i][v] += ai * vb[v];           \
            }                                                                                 \
        }                                                                                     \
        TM__UNROLL(MR) for (int i = 0; i < (MR); ++i)                                         \
            TM__UNROLL(NV) for (int v = 0; v < NV; ++v)                                       \
                memcpy(&(acc)[i][v * VW], &va[i][v], sizeof(tm__vec));                       \
    } while (0)
#else
#define TM__GEMM_UKR(T, MR, NR, kc, a, b, acc)                                              \
    do {                                                                                    \
        for (int i = 0; i < (MR); ++i)                                                      \
            for (int j = 0; j < (NR); ++j) (acc)[i][j] = 0;                                 \
        for (int64_t p = 0; p < (kc); ++p)                                                  \
            for (int i = 0; i < (MR); ++i)                                                  \
                for (int j = 0; j < (NR); ++j) (acc)[i][j] += (a)[p * (MR) + i] * (b)[p * (NR) + j]; \
    } while (0)
#endif

/* Below this many multiply-adds the fork/join of a parallel region costs more than it saves. */
#define TM__GEMM_PAR_FLOPS (1 << 18)

static inline int64_t tm__round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static inline int64_t tm__min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* C = beta * C, for the K == 0 / alpha == 0 cases where no product is formed. beta == 0
 * stores zeros without reading C (BLAS semantics: C may be uninitialised). */
#define TM__GEMM_SCALE_C(T)                                                       \
    static void tm__gemm_scale_c_##T(int64_t M, int64_t N, T beta, T *C, int64_t ldc) { \
        for (int64_t i = 0; i < M; ++i) {                                         \
            T *c = C + i * ldc;                                                   \
            if (beta == 0)                                                        \
                for (int64_t j = 0; j < N; ++j) c[j] = 0;                         \
            else if (beta != 1)                                                   \
                for (int64_t j = 0; j < N; ++j) c[j] *= beta;                     \
        }                                                                         \
    }
TM__GEMM_SCALE_C(float)
TM__GEMM_SCALE_C(double)

/*
 * One instantiation per element type. T: element type, MR x NR: register tile,
 * KC/MC/NC: cache blocks (MC a multiple of MR, NC of NR).
 */
#define TM__GEMM_DEFINE(T, MR, NR, KC, MC, NC)                                                   \
                                                                                                 \
    /* Ap[(ir/MR)][p][i] = op(A)[ic+ir+i, pc+p], rows past mc zero. */                           \
    static void tm__gemm_pack_a_##T(int trans_a, const T *A, int64_t lda, int64_t ic, int64_t pc, \
                                    int64_t mc, int64_t kc, T *restrict Ap) {                    \
        for (int64_t ir = 0; ir < mc; ir += MR) {                                                \
            int64_t mr = tm__min64(MR, mc - ir);                                                 \
            T *dst = Ap + ir * kc;                                                               \
            if (!trans_a) { /* A[M,K]: row i of op(A) is contiguous */                           \
                for (int64_t i = 0; i < mr; ++i) {                                               \
                    const T *src = A + (ic + ir + i) * lda + pc;                                 \
                    for (int64_t p = 0; p < kc; ++p) dst[p * MR + i] = src[p];                   \
                }                                                                                \
            } else { /* A[K,M]: the MR values of one p are contiguous */                         \
                for (int64_t p = 0; p < kc; ++p) {                                               \
                    const T *src = A + (pc + p) * lda + ic + ir;                                 \
                    for (int64_t i = 0; i < mr; ++i) dst[p * MR + i] = src[i];                   \
                }                                                                                \
            }                                                                                    \
            for (int64_t i = mr; i < MR; ++i)                                                    \
                for (int64_t p = 0; p < kc; ++p) dst[p * MR + i] = 0;                            \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* Bp[(jr/NR)][p][j] = op(B)[pc+p, jc+jr+j], columns past nc zero. One NR panel per call   \
     * so that threads can share the packing. */                                                \
    static void tm__gemm_pack_b_##T(int trans_b, const T *B, int64_t ldb, int64_t pc, int64_t jc, \
                                    int64_t nr, int64_t kc, T *restrict dst) {                   \
        if (!trans_b) { /* B[K,N]: the NR values of one p are contiguous */                      \
            for (int64_t p = 0; p < kc; ++p) {                                                   \
                const T *src = B + (pc + p) * ldb + jc;                                          \
                int64_t j = 0;                                                                   \
                for (; j < nr; ++j) dst[p * NR + j] = src[j];                                    \
                for (; j < NR; ++j) dst[p * NR + j] = 0;                                         \
            }                                                                                    \
        } else { /* B[N,K]: column j of op(B) is contiguous */                                   \
            for (int64_t j = 0; j < nr; ++j) {                                                   \
                const T *src = B + (jc + j) * ldb + pc;                                          \
                for (int64_t p = 0; p < kc; ++p) dst[p * NR + j] = src[p];                       \
            }                                                                                    \
            for (int64_t j = nr; j < NR; ++j)                                                    \
                for (int64_t p = 0; p < kc; ++p) dst[p * NR + j] = 0;                            \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* C[mc,nc] = alpha * Ap @ Bp + beta * C for one KC slice (beta == 0: C not read). */        \
    TM__GEMM_CLONES static void tm__gemm_macro_##T(int64_t mc, int64_t nc, int64_t kc,           \
                                                   const T *restrict Ap, const T *restrict Bp,   \
                                                   T alpha, T beta, T *restrict C, int64_t ldc) { \
        for (int64_t jr = 0; jr < nc; jr += NR) {                                                \
            int64_t nr = tm__min64(NR, nc - jr);                                                 \
            for (int64_t ir = 0; ir < mc; ir += MR) {                                            \
                int64_t mr = tm__min64(MR, mc - ir);                                             \
                const T *restrict a = Ap + ir * kc;                                              \
                const T *restrict b = Bp + jr * kc;                                              \
                T acc[MR][NR];                                                                   \
                TM__GEMM_UKR(T, MR, NR, kc, a, b, acc);                                          \
                T *c = C + ir * ldc + jr;                                                        \
                if (beta == 0) {                                                                 \
                    for (int64_t i = 0; i < mr; ++i)                                             \
                        for (int64_t j = 0; j < nr; ++j) c[i * ldc + j] = alpha * acc[i][j];     \
                } else {                                                                         \
                    for (int64_t i = 0; i < mr; ++i)                                             \
                        for (int64_t j = 0; j < nr; ++j)                                         \
                            c[i * ldc + j] = alpha * acc[i][j] + beta * c[i * ldc + j];          \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* Used only when the scratch panels cannot be had: correct, unblocked, no extra memory. */  \
    static void tm__gemm_simple_##T(int nt, int trans_a, int trans_b, int64_t M, int64_t N,      \
                                    int64_t K, T alpha, const T *A, int64_t lda, const T *B,     \
                                    int64_t ldb, T beta, T *C, int64_t ldc) {                    \
        _Pragma("omp parallel for schedule(static) num_threads(nt) if(nt > 1)")                  \
        for (int64_t i = 0; i < M; ++i) {                                                        \
            for (int64_t j = 0; j < N; ++j) {                                                    \
                T s = 0;                                                                         \
                for (int64_t p = 0; p < K; ++p)                                                  \
                    s += (trans_a ? A[p * lda + i] : A[i * lda + p]) *                           \
                         (trans_b ? B[j * ldb + p] : B[p * ldb + j]);                            \
                C[i * ldc + j] = beta == 0 ? alpha * s : alpha * s + beta * C[i * ldc + j];      \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    static void tm__gemm_blocked_##T(tm_ctx *ctx, int trans_a, int trans_b, int64_t M, int64_t N, \
                                     int64_t K, T alpha, const T *A, int64_t lda, const T *B,    \
                                     int64_t ldb, T beta, T *C, int64_t ldc) {                   \
        int nt = ctx ? tm__nthreads(ctx) : 1;                                                    \
        if ((double)M * (double)N * (double)K < TM__GEMM_PAR_FLOPS || nt < 1) nt = 1;            \
        /* Row blocks: at most MC rows, but small enough that every thread gets one. */          \
        int64_t mc = tm__min64(MC, tm__round_up((M + nt - 1) / nt, MR));                         \
        int64_t n_mblk = (M + mc - 1) / mc;                                                      \
        if (nt > n_mblk) nt = (int)n_mblk;                                                       \
        int64_t kc_max = tm__min64(KC, K);                                                       \
        int64_t nc_max = tm__min64(NC, tm__round_up(N, NR));                                     \
        T *Ap = NULL, *Bp = NULL;                                                                \
        if (ctx) {                                                                               \
            Ap = tm__arena_alloc(ctx, tm_cpu(), (size_t)nt * (size_t)(mc * kc_max) * sizeof(T)); \
            Bp = tm__arena_alloc(ctx, tm_cpu(), (size_t)(nc_max * kc_max) * sizeof(T));          \
        }                                                                                        \
        if (!Ap || !Bp) {                                                                        \
            tm__gemm_simple_##T(nt, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); \
            return;                                                                              \
        }                                                                                        \
        _Pragma("omp parallel num_threads(nt) if(nt > 1)") {                                     \
            int tid = 0;                                                                         \
            TM__GEMM_TID(tid);                                                                   \
            T *myAp = Ap + (int64_t)tid * mc * kc_max;                                           \
            for (int64_t jc = 0; jc < N; jc += NC) {                                             \
                int64_t nc = tm__min64(NC, N - jc);                                              \
                for (int64_t pc = 0; pc < K; pc += KC) {                                         \
                    int64_t kc = tm__min64(KC, K - pc);                                          \
                    /* later K slices accumulate onto the first */                               \
                    T beta_eff = pc == 0 ? beta : (T)1;                                          \
                    _Pragma("omp for schedule(static)")                                          \
                    for (int64_t jr = 0; jr < nc; jr += NR)                                      \
                        tm__gemm_pack_b_##T(trans_b, B, ldb, pc, jc + jr, tm__min64(NR, nc - jr), \
                                            kc, Bp + jr * kc);                                   \
                    /* implicit barrier: the B panel is complete */                              \
                    _Pragma("omp for schedule(static)")                                          \
                    for (int64_t ib = 0; ib < n_mblk; ++ib) {                                    \
                        int64_t ic = ib * mc, mcur = tm__min64(mc, M - ic);                      \
                        tm__gemm_pack_a_##T(trans_a, A, lda, ic, pc, mcur, kc, myAp);            \
                        tm__gemm_macro_##T(mcur, nc, kc, myAp, Bp, alpha, beta_eff,              \
                                           C + ic * ldc + jc, ldc);                              \
                    }                                                                            \
                    /* implicit barrier: nobody still reads Bp when it is repacked */            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }

#ifdef _OPENMP
#define TM__GEMM_TID(tid) ((tid) = omp_get_thread_num())
#else
#define TM__GEMM_TID(tid) ((void)(tid))
#endif

TM__GEMM_DEFINE(float, 6, 16, 256, 120, 2048)
TM__GEMM_DEFINE(double, 6, 8, 256, 120, 1024)

void tm__gemm_cpu_blocked(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N,
                          int64_t K, double alpha, const void *A, int64_t lda, const void *B,
                          int64_t ldb, double beta, void *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    if (dt == TM_F32) {
        if (K <= 0 || alpha == 0)
            tm__gemm_scale_c_float(M, N, (float)beta, C, ldc);
        else
            tm__gemm_blocked_float(ctx, trans_a, trans_b, M, N, K, (float)alpha, A, lda, B, ldb,
                                   (float)beta, C, ldc);
    } else if (dt == TM_F64) {
        if (K <= 0 || alpha == 0)
            tm__gemm_scale_c_double(M, N, beta, C, ldc);
        else
            tm__gemm_blocked_double(ctx, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C,
                                    ldc);
    }
}

void tm__gemm_cpu(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                  double alpha, const void *A, int64_t lda, const void *B, int64_t ldb, double beta,
                  void *C, int64_t ldc) {
#ifdef TM_HAVE_CBLAS
    /* CBLAS takes int sizes; it also rejects (through xerbla, which prints) lda < 1 for empty
     * operands, so degenerate shapes go to the blocked path, which handles them directly. */
    int fits = !tm__cpu_gemm_builtin(ctx) && M > 0 && N > 0 && K > 0 && M <= INT_MAX && N <= INT_MAX && K <= INT_MAX &&
               lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX;
    if (fits) {
        enum CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
        enum CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
        if (dt == TM_F32)
            cblas_sgemm(CblasRowMajor, ta, tb, (int)M, (int)N, (int)K, (float)alpha, A, (int)lda,
                        B, (int)ldb, (float)beta, C, (int)ldc);
        else if (dt == TM_F64)
            cblas_dgemm(CblasRowMajor, ta, tb, (int)M, (int)N, (int)K, alpha, A, (int)lda, B,
                        (int)ldb, beta, C, (int)ldc);
        return;
    }
#endif
    tm__gemm_cpu_blocked(ctx, dt, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
