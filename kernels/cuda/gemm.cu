/*
 * gemm.cu — every CUDA matmul goes through tm__gemm_cuda: cuBLASLt with f32 compute (bf16 or f32
 * inputs, outputs in the inputs' dtype; tm__gemm_cuda_out: bf16 inputs into f32 outputs),
 * row-major operands mapped onto cuBLASLt's column-major view, and a small cache of plans
 * (descriptors + the heuristic's algorithm) keyed by shape, dtypes, transposes, leading dims and
 * pointer alignment, so a steady-state step never queries the heuristic. The groups of a ragged
 * GEMM (tm__gemm_cuda_ragged) share a plan per power-of-two bucket of their ragged size.
 */
#include "common.cuh"

static void tm__gemm_plan_destroy(tm__gemm_plan *p) {
    if (!p->valid) return;
    cublasLtMatrixLayoutDestroy(p->la);
    cublasLtMatrixLayoutDestroy(p->lb);
    cublasLtMatrixLayoutDestroy(p->lc);
    cublasLtMatmulDescDestroy(p->op);
    p->valid = 0;
}

extern "C" void tm__gemm_plans_destroy(tm__cuda *st) {
    for (int i = 0; i < TM__GEMM_CACHE; i++) tm__gemm_plan_destroy(&st->plans[i]);
}

/* ---- GEMM through cuBLASLt ---------------------------------------------------------------------- */
/*
 * Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a row-major matrix with
 * row stride ld is, read column-major, its transpose with leading dimension ld. So cuBLASLt
 * computes with its "A" = our B and its "B" = our A, transposes as given, m = N, n = M.
 */

/* The largest power of two (<= 256) dividing the address: cuBLASLt's heuristic must not pick
 * an algorithm that assumes more alignment than a view into the middle of a tensor has. */
static uint32_t tm__align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && (a & (al - 1))) al >>= 1;
    return al;
}

static tm_status tm__gemm_plan_make(tm_ctx *ctx, tm__cuda *st, tm__gemm_plan *p) {
    const char *what = "gemm";
    cudaDataType_t ty = p->dt == TM_BF16 ? CUDA_R_16BF : CUDA_R_32F, cty = p->cdt == TM_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    /* f32 inputs accumulate in true f32 (not TF32): CPU/CUDA parity stays at f32 precision. */
    TM__LT_CHECK(ctx, what, cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = p->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt A = our B */
    cublasOperation_t tb = p->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLASLt B = our A */
    TM__LT_CHECK(ctx, what, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    TM__LT_CHECK(ctx, what, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    /* Stored shapes, column-major (rows, cols): our B is [K,N] row-major -> (N, K), or (K, N)
     * when transposed; our A [M,K] -> (K, M), or (M, K); C -> (N, M). */
    uint64_t la_r = p->trans_b ? p->K : p->N, la_c = p->trans_b ? p->N : p->K;
    uint64_t lb_r = p->trans_a ? p->M : p->K, lb_c = p->trans_a ? p->K : p->M;
    TM__LT_CHECK(ctx, what, cublasLtMatrixLayoutCreate(&p->la, ty, la_r, la_c, p->ldb));
    TM__LT_CHECK(ctx, what, cublasLtMatrixLayoutCreate(&p->lb, ty, lb_r, lb_c, p->lda));
    TM__LT_CHECK(ctx, what, cublasLtMatrixLayoutCreate(&p->lc, cty, p->N, p->M, p->ldc));
    p->cur_M = p->M, p->cur_K = p->K;
    if (p->batch > 1) {
        int32_t bc = (int32_t)p->batch;
        struct { cublasLtMatrixLayout_t l; int64_t s; } ls[3] = {{p->la, p->sb}, {p->lb, p->sa}, {p->lc, p->sc}};
        for (int i = 0; i < 3; i++) {
            TM__LT_CHECK(ctx, what, cublasLtMatrixLayoutSetAttribute(ls[i].l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
            TM__LT_CHECK(ctx, what, cublasLtMatrixLayoutSetAttribute(ls[i].l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                                     &ls[i].s, sizeof ls[i].s));
        }
    }
    cublasLtMatmulPreference_t pref;
    TM__LT_CHECK(ctx, what, cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = st->workspace_bytes;
    cublasStatus_t bs = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    uint32_t al[4] = {p->align_b, p->align_a, p->align_c, p->align_c};
    cublasLtMatmulPreferenceAttributes_t at[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4 && bs == CUBLAS_STATUS_SUCCESS; i++)
        bs = cublasLtMatmulPreferenceSetAttribute(pref, at[i], &al[i], sizeof al[i]);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    if (bs == CUBLAS_STATUS_SUCCESS)
        bs = cublasLtMatmulAlgoGetHeuristic(st->lt, p->op, p->la, p->lb, p->lc, p->lc, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (bs != CUBLAS_STATUS_SUCCESS)
        return tm__err(ctx, TM_ERR_CUDA, "%s: cublasLtMatmulAlgoGetHeuristic failed at %s:%d: %s (%d)", what,
                       __FILE__, __LINE__, cublasLtGetStatusString(bs), (int)bs);
    if (found < 1)
        return tm__err(ctx, TM_ERR_UNSUPPORTED,
                       "%s: cuBLASLt has no algorithm for %s (C %s) M=%lld N=%lld K=%lld batch=%lld trans=(%d,%d)", what,
                       tm_dtype_name(p->dt), tm_dtype_name(p->cdt), (long long)p->M, (long long)p->N, (long long)p->K,
                       (long long)p->batch, p->trans_a, p->trans_b);
    p->algo = res.algo;
    return TM_OK;
}

static tm_status tm__gemm_plan_get(tm_ctx *ctx, tm__cuda *st, const tm__gemm_plan *key, tm__gemm_plan **out) {
    for (int i = 0; i < TM__GEMM_CACHE; i++) {
        tm__gemm_plan *p = &st->plans[i];
        if (p->valid && p->dt == key->dt && p->cdt == key->cdt && p->trans_a == key->trans_a && p->trans_b == key->trans_b &&
            p->M == key->M && p->N == key->N && p->K == key->K && p->lda == key->lda && p->ldb == key->ldb &&
            p->ldc == key->ldc && p->batch == key->batch && p->sa == key->sa && p->sb == key->sb &&
            p->sc == key->sc && p->align_a == key->align_a && p->align_b == key->align_b &&
            p->align_c == key->align_c && p->ragged == key->ragged) {
            *out = p;
            return TM_OK;
        }
    }
    int slot = -1;
    for (int i = 0; i < TM__GEMM_CACHE && slot < 0; i++)
        if (!st->plans[i].valid) slot = i;
    if (slot < 0) {
        slot = st->next_victim;
        st->next_victim = (st->next_victim + 1) % TM__GEMM_CACHE;
        tm__gemm_plan_destroy(&st->plans[slot]);
    }
    tm__gemm_plan *p = &st->plans[slot];
    *p = *key;
    p->valid = 0;
    p->op = NULL;
    p->la = p->lb = p->lc = NULL;
    tm_status s = tm__gemm_plan_make(ctx, st, p);
    if (s != TM_OK) {
        /* Release whatever was created before the failure. */
        if (p->la) cublasLtMatrixLayoutDestroy(p->la);
        if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
        if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
        if (p->op) cublasLtMatmulDescDestroy(p->op);
        return s;
    }
    p->valid = 1;
    *out = p;
    return TM_OK;
}

/* The key of a GEMM's plan (M and K as given: a ragged caller buckets them first). */
static tm__gemm_plan tm__gemm_key(tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                                  const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                                  void *C, int64_t ldc, int64_t sc, int64_t batch) {
    tm__gemm_plan key;
    memset(&key, 0, sizeof key);
    key.dt = dt;
    key.cdt = dt;
    key.trans_a = trans_a != 0;
    key.trans_b = trans_b != 0;
    key.M = M; key.N = N; key.K = K;
    key.lda = lda; key.ldb = ldb; key.ldc = ldc;
    key.batch = batch;
    key.sa = batch > 1 ? sa : 0;
    key.sb = batch > 1 ? sb : 0;
    key.sc = batch > 1 ? sc : 0;
    key.align_a = tm__align_of(A);
    key.align_b = tm__align_of(B);
    key.align_c = tm__align_of(C);
    return key;
}

static tm_status tm__gemm_launch(tm_ctx *ctx, tm__cuda *st, const tm__gemm_plan *p, double alpha, const void *A,
                                 const void *B, double beta, void *C) {
    float fa = (float)alpha, fb = (float)beta;
    TM__LT_CHECK(ctx, "gemm", cublasLtMatmul(st->lt, p->op, &fa, B, p->la, A, p->lb, &fb, C, p->lc, C, p->lc, &p->algo,
                                             st->workspace, st->workspace_bytes, st->stream));
    return TM_OK;
}

extern "C" tm_status tm__gemm_cuda_out(tm_ctx *ctx, tm_dtype dt, tm_dtype cdt, int trans_a, int trans_b, int64_t M,
                                       int64_t N, int64_t K, double alpha, const void *A, int64_t lda, int64_t sa,
                                       const void *B, int64_t ldb, int64_t sb, double beta, void *C, int64_t ldc,
                                       int64_t sc, int64_t batch) {
    tm__cuda *st;
    const char *what = "gemm";
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if ((dt != TM_F32 && dt != TM_BF16) || (cdt != TM_F32 && cdt != TM_BF16))
        return tm__err(ctx, TM_ERR_DTYPE, "%s: CUDA GEMM takes f32 or bf16, got %s (C %s)", what, tm_dtype_name(dt),
                       tm_dtype_name(cdt));
    if (batch < 1) batch = 1;
    if (M == 0 || N == 0) return TM_OK;
    if (batch > INT32_MAX)
        return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: batch %lld exceeds cuBLASLt's limit", what, (long long)batch);
    if (K == 0) {
        /* An empty inner dimension: C = beta * C, which cuBLASLt does not take as a GEMM. */
        if (beta == 1.0) return TM_OK;
        if (beta == 0.0 && ldc == N && (batch == 1 || sc == M * N))
            TM__CU_CHECK(ctx, what, cudaMemsetAsync(C, 0, (size_t)(batch * M * N) * tm_dtype_size(cdt), st->stream));
        else
            return tm__err(ctx, TM_ERR_UNSUPPORTED, "%s: K == 0 with beta %g on a strided C", what, beta);
        return TM_OK;
    }
    tm__gemm_plan key = tm__gemm_key(dt, trans_a, trans_b, M, N, K, A, lda, sa, B, ldb, sb, C, ldc, sc, batch), *p;
    key.cdt = cdt;
    TM__TRY(tm__gemm_plan_get(ctx, st, &key, &p));
    return tm__gemm_launch(ctx, st, p, alpha, A, B, beta, C);
}

extern "C" tm_status tm__gemm_cuda(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N,
                                   int64_t K, double alpha, const void *A, int64_t lda, int64_t sa, const void *B,
                                   int64_t ldb, int64_t sb, double beta, void *C, int64_t ldc, int64_t sc,
                                   int64_t batch) {
    return tm__gemm_cuda_out(ctx, dt, dt, trans_a, trans_b, M, N, K, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch);
}

/* The bucket of a ragged size: the next power of two, at least 64. */
static int64_t tm__gemm_bucket(int64_t n) {
    int64_t b = 64;
    while (b < n) b <<= 1;
    return b;
}

static tm_status tm__gemm_layout_dims(tm_ctx *ctx, cublasLtMatrixLayout_t l, uint64_t rows, uint64_t cols) {
    TM__LT_CHECK(ctx, "gemm", cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof rows));
    TM__LT_CHECK(ctx, "gemm", cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof cols));
    return TM_OK;
}

extern "C" tm_status tm__gemm_cuda_ragged(tm_ctx *ctx, tm_dtype dt, int ragged, int trans_a, int trans_b, int64_t M,
                                          int64_t N, int64_t K, double alpha, const void *A, int64_t lda,
                                          const void *B, int64_t ldb, double beta, void *C, int64_t ldc) {
    tm__cuda *st;
    const char *what = "gemm";
    TM__TRY(tm__cu_enter(ctx, what, &st));
    if ((dt != TM_F32 && dt != TM_BF16) || M == 0 || N == 0 || K == 0)
        return tm__gemm_cuda(ctx, dt, trans_a, trans_b, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
    const int64_t bM = ragged & TM__GEMM_RAGGED_M ? tm__gemm_bucket(M) : M;
    const int64_t bK = ragged & TM__GEMM_RAGGED_K ? tm__gemm_bucket(K) : K;
    tm__gemm_plan key = tm__gemm_key(dt, trans_a, trans_b, bM, N, bK, A, lda, 0, B, ldb, 0, C, ldc, 0, 1), *p;
    key.ragged = ragged;
    TM__TRY(tm__gemm_plan_get(ctx, st, &key, &p));
    if (p->cur_M != M || p->cur_K != K) {
        /* Stored shapes as in tm__gemm_plan_make, at the exact sizes. */
        TM__TRY(tm__gemm_layout_dims(ctx, p->la, p->trans_b ? K : N, p->trans_b ? N : K));
        TM__TRY(tm__gemm_layout_dims(ctx, p->lb, p->trans_a ? M : K, p->trans_a ? K : M));
        TM__TRY(tm__gemm_layout_dims(ctx, p->lc, N, M));
        p->cur_M = M, p->cur_K = K;
    }
    /* The bucket's algorithm must also take this size (and fit the workspace); where it does
     * not, this call gets a plan of its own. */
    cublasLtMatmulHeuristicResult_t chk;
    cublasStatus_t cs = cublasLtMatmulAlgoCheck(st->lt, p->op, p->la, p->lb, p->lc, p->lc, &p->algo, &chk);
    if (cs != CUBLAS_STATUS_SUCCESS || chk.workspaceSize > st->workspace_bytes)
        return tm__gemm_cuda(ctx, dt, trans_a, trans_b, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
    return tm__gemm_launch(ctx, st, p, alpha, A, B, beta, C);
}

