/*
 * backend.c — the registry of device backends (see backend.h). The only place in framework/
 * that knows whether the build has CUDA.
 */
#include "ctx_internal.h"

#include <time.h>

#ifdef TM_HAVE_CUDA
extern const tm__backend_ops tm__cuda_backend; /* kernels/cuda/device.cu */
#define TM__CUDA_BACKEND (&tm__cuda_backend)
#else
#define TM__CUDA_BACKEND NULL
#endif

extern const tm__backend_ops tm__cpu_backend; /* kernels/cpu/backend.c */

const tm__backend_ops *tm__backend_get(int b) {
    switch (b) {
    case TM__CPU: return &tm__cpu_backend;
    case TM__CUDA: return TM__CUDA_BACKEND;
    default: return NULL;
    }
}

const tm__backend_ops *tm__ctx_backend(const tm_ctx *ctx, tm_device dev) { return ctx->be[tm__backend(dev)]; }

tm_status tm__gemm(tm_ctx *ctx, tm_device dev, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N,
                   int64_t K, double alpha, const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb,
                   int64_t sb, double beta, void *C, int64_t ldc, int64_t sc, int64_t batch) {
    const tm__backend_ops *be = ctx->be[tm__backend(dev)];
    if (!be) return tm__err(ctx, TM_ERR_DEVICE, "gemm: the context has no %s backend", dev.type == TM_DEVICE_CUDA ? "CUDA" : "CPU");
    return be->gemm(ctx, dt, trans_a, trans_b, M, N, K, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch);
}

void tm__count_sync(tm_ctx *ctx) {
    if (ctx) ctx->sync_count++;
}

double tm__now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void tm__add_wait(tm_ctx *ctx, double t0) {
    if (ctx) ctx->sync_seconds += tm__now() - t0;
}

/* Page-locked staging where a device backend of the context offers it (backend.h), else the
 * allocator hook's memory. */
void *tm__host_alloc_pinned(tm_ctx *ctx, size_t nbytes, int *pinned) {
    *pinned = 0;
    for (int b = 0; b < TM__NBACKENDS; b++) {
        const tm__backend_ops *be = ctx->be[b];
        if (!be || !be->host_alloc_pinned) continue;
        void *p = be->host_alloc_pinned(ctx, nbytes);
        if (p) {
            *pinned = b + 1;
            return p;
        }
    }
    return tm__host_alloc(ctx, nbytes);
}

void tm__host_free_pinned(tm_ctx *ctx, void *p, int pinned) {
    if (!p) return;
    if (pinned) ctx->be[pinned - 1]->host_free_pinned(ctx, p);
    else tm__host_free(ctx, p);
}
