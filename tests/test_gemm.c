/*
 * test_gemm.c — the CPU GEMM entry point (tm__gemm_cpu: CBLAS when built with it) and the
 * portable blocked kernel (tm__gemm_cpu_blocked, tested even when CBLAS is present) against a
 * naive triple loop: all four transpose combinations, sizes that are not multiples of the
 * register tile (6 x 16 / 6 x 8) and that cross the cache blocks (MC = 120 rows,
 * KC = 256, NC = 1024 f64 columns), padded leading dimensions, alpha/beta, and degenerate shapes.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "../kernels/cpu/gemm.h"

typedef void (*gemm_fn)(tm_ctx *, tm_dtype, int, int, int64_t, int64_t, int64_t, double, const void *,
                        int64_t, const void *, int64_t, double, void *, int64_t);

static uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 11;
}
/* Uniform in [-1, 1). */
static double unif(uint64_t *s) { return (double)lcg(s) / (double)(1ull << 53) * 2.0 - 1.0; }

static void store(void *p, tm_dtype dt, int64_t i, double v) {
    if (dt == TM_F32) ((float *)p)[i] = (float)v;
    else ((double *)p)[i] = v;
}
static double load(const void *p, tm_dtype dt, int64_t i) {
    return dt == TM_F32 ? ((const float *)p)[i] : ((const double *)p)[i];
}

/*
 * C = alpha op(A) op(B) + beta C with lda/ldb/ldc padded by `pad` columns; checks every element
 * of C against a naive f64 loop over the very same (rounded) inputs and that the padding
 * columns of C were not touched.
 */
static void check_gemm(gemm_fn fn, tm_dtype dt, int ta, int tb, int64_t M, int64_t N, int64_t K,
                       double alpha, double beta, int64_t pad) {
    tm_ctx *ctx = tt_ctx();
    size_t es = tm_dtype_size(dt);
    int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int64_t lda = ac + pad, ldb = bc + pad, ldc = N + pad;
    void *A = malloc((size_t)(ar * lda + 1) * es), *B = malloc((size_t)(br * ldb + 1) * es);
    void *C = malloc((size_t)(M * ldc + 1) * es);
    double *ref = malloc((size_t)(M * N + 1) * sizeof(double));
    uint64_t s = 12345 + (uint64_t)(M * 7 + N * 13 + K * 17 + ta * 2 + tb);
    for (int64_t i = 0; i < ar * lda; i++) store(A, dt, i, unif(&s));
    for (int64_t i = 0; i < br * ldb; i++) store(B, dt, i, unif(&s));
    /* beta == 0 must not read C: NaN there would poison the result. */
    for (int64_t i = 0; i < M * ldc; i++) store(C, dt, i, beta == 0 ? NAN : unif(&s));
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = 0;
            for (int64_t p = 0; p < K; p++)
                acc += load(A, dt, ta ? p * lda + i : i * lda + p) * load(B, dt, tb ? j * ldb + p : p * ldb + j);
            ref[i * N + j] = alpha * acc + (beta == 0 ? 0 : beta * load(C, dt, i * ldc + j));
        }
    void *C0 = malloc((size_t)(M * ldc + 1) * es);
    memcpy(C0, C, (size_t)(M * ldc) * es);
    fn(ctx, dt, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    /* f32 accumulates K products of magnitude <= 1 in f32: error ~ K * 2^-24. */
    double atol = dt == TM_F32 ? 1e-6 * (double)(K + 1) : 1e-13 * (double)(K + 1);
    for (int64_t i = 0; i < M; i++) {
        for (int64_t j = 0; j < N; j++) {
            double got = load(C, dt, i * ldc + j), want = ref[i * N + j];
            cr_assert(fabs(got - want) <= atol + 1e-6 * fabs(want),
                      "%s ta=%d tb=%d M=%lld N=%lld K=%lld: C[%lld,%lld] = %.17g, want %.17g",
                      tm_dtype_name(dt), ta, tb, (long long)M, (long long)N, (long long)K, (long long)i,
                      (long long)j, got, want);
        }
        cr_assert(memcmp((char *)C + (i * ldc + N) * es, (char *)C0 + (i * ldc + N) * es, (size_t)pad * es) == 0,
                  "padding of C row %lld written", (long long)i);
    }
    free(A), free(B), free(C), free(C0), free(ref);
    tm_ctx_free(ctx);
}

static const int64_t sizes[][3] = {
    {1, 1, 1},      {7, 5, 3},    {13, 17, 19},   {6, 16, 8},    {5, 9, 300}, /* K over KC */
    {121, 33, 7},   /* M over MC */ {37, 1030, 5}, /* N over NC (f64) */ {130, 70, 513},
};

static void sweep(gemm_fn fn, tm_dtype dt) {
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                check_gemm(fn, dt, ta, tb, sizes[k][0], sizes[k][1], sizes[k][2], 1.0, 0.0, 0);
                check_gemm(fn, dt, ta, tb, sizes[k][0], sizes[k][1], sizes[k][2], -0.75, 1.5, 3);
            }
}

Test(gemm, blocked_f64) { sweep(tm__gemm_cpu_blocked, TM_F64); }
Test(gemm, blocked_f32) { sweep(tm__gemm_cpu_blocked, TM_F32); }
Test(gemm, entry_f64) { sweep(tm__gemm_cpu, TM_F64); }
Test(gemm, entry_f32) { sweep(tm__gemm_cpu, TM_F32); }

/* f32 N over NC = 2048 takes a second B panel. */
Test(gemm, blocked_f32_wide) {
    check_gemm(tm__gemm_cpu_blocked, TM_F32, 0, 1, 9, 2100, 11, 1.0, 0.0, 0);
    check_gemm(tm__gemm_cpu_blocked, TM_F32, 1, 0, 9, 2100, 11, 2.0, -1.0, 1);
}

/* K == 0 leaves beta * C (zeros for beta == 0, even over NaN); M == 0 or N == 0 touch nothing. */
static void check_degenerate(gemm_fn fn) {
    tm_ctx *ctx = tt_ctx();
    double C[6] = {1, 2, 3, 4, 5, 6}, A[1] = {0}, B[1] = {0};
    fn(ctx, TM_F64, 0, 0, 2, 3, 0, 1.0, A, 1, B, 3, 2.0, C, 3);
    for (int i = 0; i < 6; i++) cr_assert_eq(C[i], 2.0 * (i + 1));
    for (int i = 0; i < 6; i++) C[i] = NAN;
    fn(ctx, TM_F64, 1, 1, 2, 3, 0, 1.0, A, 1, B, 1, 0.0, C, 3);
    for (int i = 0; i < 6; i++) cr_assert_eq(C[i], 0.0);
    C[0] = 7;
    fn(ctx, TM_F64, 0, 0, 0, 3, 4, 1.0, A, 4, B, 3, 0.0, C, 3);
    fn(ctx, TM_F64, 0, 0, 2, 0, 4, 1.0, A, 4, B, 1, 0.0, C, 1);
    cr_assert_eq(C[0], 7.0);
    tm_ctx_free(ctx);
}

Test(gemm, degenerate_blocked) { check_degenerate(tm__gemm_cpu_blocked); }
Test(gemm, degenerate_entry) { check_degenerate(tm__gemm_cpu); }

/* The blocked kernel gives the same bits for 1, 2 and 3 threads: every element of C is summed
 * in the same order whatever the row-block split. */
Test(gemm, blocked_thread_count_invariant) {
    const int64_t M = 250, N = 70, K = 300;
    double *A = malloc(sizeof(double) * M * K), *B = malloc(sizeof(double) * K * N);
    double *C[3];
    uint64_t s = 99;
    for (int64_t i = 0; i < M * K; i++) A[i] = unif(&s);
    for (int64_t i = 0; i < K * N; i++) B[i] = unif(&s);
    for (int t = 0; t < 3; t++) {
        tm_ctx_options o = tm_ctx_options_default();
        o.num_threads = t + 1;
        tm_ctx *ctx;
        cr_assert_eq(tm_ctx_new(&ctx, &o), TM_OK);
        C[t] = malloc(sizeof(double) * M * N);
        tm__gemm_cpu_blocked(ctx, TM_F64, 0, 0, M, N, K, 1.0, A, K, B, N, 0.0, C[t], N);
        tm_ctx_free(ctx);
    }
    cr_assert(memcmp(C[0], C[1], sizeof(double) * M * N) == 0);
    cr_assert(memcmp(C[0], C[2], sizeof(double) * M * N) == 0);
    for (int t = 0; t < 3; t++) free(C[t]);
    free(A), free(B);
}
