/*
 * cudatrace.c — where a CUDA program's host time goes, without Nsight Systems: an LD_PRELOAD
 * library that counts and times the CUDA runtime and cuBLASLt calls the program makes.
 *
 *   make build/libcudatrace.so          (needs the CUDA headers; no GPU to build)
 *   LD_PRELOAD=build/libcudatrace.so build/tinymoe train --device cuda ...
 *
 * At exit it prints to stderr (or appends to the file CUDATRACE_OUT names) one line per function that
 * was called: calls, total host seconds inside it, microseconds per call, and the share of the
 * process's wall time since the library was loaded. A wait (cudaStreamSynchronize,
 * cudaMemcpy from the device) holds the host until the GPU is done: its time is the GPU running
 * ahead of the host. Everything else is the host's own cost of asking. Two runs of different
 * lengths (say 5 and 25 steps) give the per-step figures by difference, without the start-up.
 *
 * How: each wrapper looks up the real function once (dlsym(RTLD_NEXT)), reads a monotonic
 * clock around the call and adds to its row. Calls made from inside libcudart or libcublasLt
 * themselves are not seen (they do not go through the dynamic linker); kernel launches written
 * as f<<<...>>> are, because nvcc lowers them to a runtime call (__cudaLaunchKernel since CUDA
 * 13, cudaLaunchKernel before). Not thread-safe beyond what
 * tinymoe needs (one thread issues the CUDA calls); the counters are plain doubles.
 *
 * Only a measuring tool for bench/: the library never loads it.
 */
#define _GNU_SOURCE
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum {
    F_LAUNCH_INTERNAL, F_LAUNCH, F_MEMCPY_ASYNC, F_MEMCPY, F_MEMSET_ASYNC, F_MEMSET, F_MALLOC, F_FREE, F_MALLOC_HOST, F_FREE_HOST,
    F_STREAM_SYNC, F_DEVICE_SYNC, F_STREAM_QUERY, F_EVENT_RECORD, F_EVENT_SYNC, F_STREAM_WAIT_EVENT,
    F_GET_LAST_ERROR, F_GET_DEVICE, F_SET_DEVICE, F_FUNC_SET_ATTR, F_DEVICE_GET_ATTR, F_LT_MATMUL,
    F_LT_HEURISTIC, F_LT_CHECK, F_N
};
static const char *const NAMES[F_N] = {
    "__cudaLaunchKernel", "cudaLaunchKernel", "cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync", "cudaMemset", "cudaMalloc", "cudaFree",
    "cudaMallocHost", "cudaFreeHost", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaStreamQuery",
    "cudaEventRecord", "cudaEventSynchronize", "cudaStreamWaitEvent", "cudaGetLastError", "cudaGetDevice",
    "cudaSetDevice", "cudaFuncSetAttribute", "cudaDeviceGetAttribute", "cublasLtMatmul",
    "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmulAlgoCheck",
};
static double g_sec[F_N], g_t0;
static unsigned long long g_calls[F_N];
static unsigned long long g_memcpy_kind[4]; /* cudaMemcpyAsync calls by kind: H2H, H2D, D2H, D2D */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *real(const char *name) {
    void *p = dlsym(RTLD_NEXT, name);
    if (!p) {
        fprintf(stderr, "cudatrace: %s not found (dlsym: %s)\n", name, dlerror());
        abort(); /* a measuring tool: no way to forward the call */
    }
    return p;
}

/* The body of the wrapper f (NAMES[id] is its name): R its return type, call_args its
 * arguments. */
#define WRAP(id, f, R, call_args)                   \
    static __typeof__(&f) fn = NULL;                \
    if (!fn) *(void **)&fn = real(NAMES[id]);       \
    double t = now();                               \
    R r = fn call_args;                             \
    g_sec[id] += now() - t;                         \
    g_calls[id]++;                                  \
    return r;

__attribute__((constructor)) static void start(void) { g_t0 = now(); }

__attribute__((destructor)) static void report(void) {
    unsigned long long any = 0;
    for (int i = 0; i < F_N; i++) any += g_calls[i];
    if (!any) return; /* e.g. the parent of a program that does its CUDA work in a child */
    const char *path = getenv("CUDATRACE_OUT");
    FILE *f = path && *path ? fopen(path, "a") : NULL;
    FILE *o = f ? f : stderr;
    double wall = now() - g_t0, total = 0;
    fprintf(o, "cudatrace (pid %ld): %.3f s of wall time since load\n%-32s %10s %10s %9s %7s\n", (long)getpid(), wall,
            "function", "calls",
            "seconds", "us/call", "% wall");
    for (int i = 0; i < F_N; i++) {
        if (!g_calls[i]) continue;
        total += g_sec[i];
        fprintf(o, "%-32s %10llu %10.4f %9.2f %6.1f%%\n", NAMES[i], g_calls[i], g_sec[i], 1e6 * g_sec[i] / (double)g_calls[i],
                100 * g_sec[i] / wall);
    }
    fprintf(o, "%-32s %10s %10.4f %9s %6.1f%%\n", "all of the above", "", total, "", 100 * total / wall);
    fprintf(o, "cudaMemcpyAsync by kind: H2H %llu, H2D %llu, D2H %llu, D2D %llu\n", g_memcpy_kind[0], g_memcpy_kind[1],
            g_memcpy_kind[2], g_memcpy_kind[3]);
    if (f) fclose(f);
}

/* CUDA 13's lowering of f<<<...>>> (crt/device_functions.h; C++-only there). */
cudaError_t __cudaLaunchKernel(cudaKernel_t k, dim3 grid, dim3 block, void **args, size_t shmem, cudaStream_t s);
cudaError_t __cudaLaunchKernel(cudaKernel_t k, dim3 grid, dim3 block, void **args, size_t shmem, cudaStream_t s) {
    WRAP(F_LAUNCH_INTERNAL, __cudaLaunchKernel, cudaError_t, (k, grid, block, args, shmem, s))
}
cudaError_t cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t shmem, cudaStream_t s) {
    WRAP(F_LAUNCH, cudaLaunchKernel, cudaError_t, (func, grid, block, args, shmem, s))
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind k, cudaStream_t s) {
    if ((unsigned)k < 4) g_memcpy_kind[k]++;
    WRAP(F_MEMCPY_ASYNC, cudaMemcpyAsync, cudaError_t, (dst, src, n, k, s))
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind k) {
    WRAP(F_MEMCPY, cudaMemcpy, cudaError_t, (dst, src, n, k))
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) { WRAP(F_MEMSET_ASYNC, cudaMemsetAsync, cudaError_t, (p, v, n, s)) }
cudaError_t cudaMemset(void *p, int v, size_t n) { WRAP(F_MEMSET, cudaMemset, cudaError_t, (p, v, n)) }
cudaError_t cudaMalloc(void **p, size_t n) { WRAP(F_MALLOC, cudaMalloc, cudaError_t, (p, n)) }
cudaError_t cudaFree(void *p) { WRAP(F_FREE, cudaFree, cudaError_t, (p)) }
cudaError_t cudaMallocHost(void **p, size_t n) { WRAP(F_MALLOC_HOST, cudaMallocHost, cudaError_t, (p, n)) }
cudaError_t cudaFreeHost(void *p) { WRAP(F_FREE_HOST, cudaFreeHost, cudaError_t, (p)) }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { WRAP(F_STREAM_SYNC, cudaStreamSynchronize, cudaError_t, (s)) }
cudaError_t cudaDeviceSynchronize(void) { WRAP(F_DEVICE_SYNC, cudaDeviceSynchronize, cudaError_t, ()) }
cudaError_t cudaStreamQuery(cudaStream_t s) { WRAP(F_STREAM_QUERY, cudaStreamQuery, cudaError_t, (s)) }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { WRAP(F_EVENT_RECORD, cudaEventRecord, cudaError_t, (e, s)) }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { WRAP(F_EVENT_SYNC, cudaEventSynchronize, cudaError_t, (e)) }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
    WRAP(F_STREAM_WAIT_EVENT, cudaStreamWaitEvent, cudaError_t, (s, e, flags))
}
cudaError_t cudaGetLastError(void) { WRAP(F_GET_LAST_ERROR, cudaGetLastError, cudaError_t, ()) }
cudaError_t cudaGetDevice(int *d) { WRAP(F_GET_DEVICE, cudaGetDevice, cudaError_t, (d)) }
cudaError_t cudaSetDevice(int d) { WRAP(F_SET_DEVICE, cudaSetDevice, cudaError_t, (d)) }
cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute a, int v) {
    WRAP(F_FUNC_SET_ATTR, cudaFuncSetAttribute, cudaError_t, (func, a, v))
}
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int d) { WRAP(F_DEVICE_GET_ATTR, cudaDeviceGetAttribute, cudaError_t, (v, a, d)) }
cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t la, const void *B, cublasLtMatrixLayout_t lb, const void *beta,
                              const void *C, cublasLtMatrixLayout_t lc, void *D, cublasLtMatrixLayout_t ld,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t wsb, cudaStream_t s) {
    WRAP(F_LT_MATMUL, cublasLtMatmul, cublasStatus_t, (h, d, alpha, A, la, B, lb, beta, C, lc, D, ld, algo, ws, wsb, s))
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t la,
                                              cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc,
                                              cublasLtMatrixLayout_t ld, cublasLtMatmulPreference_t p, int n,
                                              cublasLtMatmulHeuristicResult_t *res, int *found) {
    WRAP(F_LT_HEURISTIC, cublasLtMatmulAlgoGetHeuristic, cublasStatus_t, (h, d, la, lb, lc, ld, p, n, res, found))
}

cublasStatus_t cublasLtMatmulAlgoCheck(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t la,
                                       cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, cublasLtMatrixLayout_t ld,
                                       const cublasLtMatmulAlgo_t *algo, cublasLtMatmulHeuristicResult_t *res) {
    WRAP(F_LT_CHECK, cublasLtMatmulAlgoCheck, cublasStatus_t, (h, d, la, lb, lc, ld, algo, res))
}
