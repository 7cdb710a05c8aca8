/*
 * backend.h — the device backend interface: everything the framework asks of a device is one
 * table of functions, registered at context creation (framework/backend.c). Framework code
 * (arenas, tensors, parameters, the dispatcher) calls only these; it contains no CUDA code and
 * no #ifdef of a backend, except where backend.c registers the CUDA backend.
 *
 *   backend  table                     implementation
 *   CPU      tm__cpu_backend           kernels/cpu/backend.c (+ copy.c, gemm.c, the op kernels)
 *   CUDA     tm__cuda_backend          kernels/cuda/device.cu (+ copy.cu, fixed_order_reduce.cu, gemm.cu, ...)
 *
 * Contracts (every function reports failures through tm__err and returns its status):
 *  - device_count: devices of this kind visible (0 when the driver or device is missing).
 *  - init / shutdown: per-context state (stream, handles) for one device ordinal; shutdown must
 *    go on whatever fails and accept a half-initialised state.
 *  - alloc / free: raw device memory (the framework counts allocations; alloc of 0 bytes
 *    returns a valid pointer). free must not return before queued work using p is done.
 *  - memcpy: kind TM__H2D / TM__D2H / TM__D2D between this device and the host (TM__D2D for
 *    host-to-host on the CPU). Stream-ordered; a D2H copy returns only when the data is on the
 *    host, and counts as one device-to-host synchronisation (tm_ctx_sync_count).
 *  - memset0: zero nbytes at p, stream-ordered. sync: wait for all queued work (counted).
 *  - copy_into / accumulate / assign / fill: the untaped primitives of internal.h
 *    (tm__copy_into, ...), called after the framework validated shapes and devices; assign is
 *    only called for a non-contiguous destination.
 *  - gemm: row-major C[M,N] = alpha op(A) op(B) + beta C as tm__gemm_cpu, batched: `batch`
 *    matrices at element strides sa, sb, sc. dtypes: f32, f64 (CPU), bf16 (CUDA, f32 accum).
 *  - fwd / bwd: the op kernels, [TM__NOPS] arrays in op-id order generated from ops.def; NULL
 *    where the op has no kernel on this backend (the dispatcher reports it by name).
 *  - host_alloc_pinned / host_free_pinned (NULL where the backend has none: the CPU): page-locked
 *    host memory that memcpy moves at the link's full speed, without the driver's staging
 *    through its own pinned buffers (cudaHostAlloc / cudaFreeHost). alloc returns NULL, with
 *    no error set, when the memory cannot be locked; the caller falls back to ordinary memory.
 *    Not counted in tm_ctx_alloc_count and not through the allocator hook (the driver owns it).
 *  - side_begin / side_end / event_wait / event_query / event_free (NULL where the backend has
 *    no streams: the CPU, whose collectives block): a second stream for collectives that run
 *    beside the work (framework/comm.c, tm__coll_side_*). side_begin makes the side stream wait
 *    for the work queued so far and sends the device engine's next calls to it; side_end sends
 *    them back to the work stream and records an event after the side work; event_wait makes
 *    the work stream wait for an event (the host does not wait); event_query is 1 once the
 *    event has happened (a host poll: no synchronisation is counted); event_free releases one
 *    (queued waits for it stay valid).
 */
#ifndef TM_BACKEND_H
#define TM_BACKEND_H

enum { TM__H2D = 1, TM__D2H = 2, TM__D2D = 3 };

typedef struct tm__backend_ops {
    const char *name; /* "cpu", "cuda" */
    int (*device_count)(void);
    tm_status (*init)(tm_ctx *ctx, int device, void **state);
    void (*shutdown)(tm_ctx *ctx, void *state);
    tm_status (*alloc)(tm_ctx *ctx, size_t nbytes, void **p);
    void (*free)(tm_ctx *ctx, void *p);
    tm_status (*memcpy)(tm_ctx *ctx, void *dst, const void *src, size_t nbytes, int kind);
    tm_status (*memset0)(tm_ctx *ctx, void *p, size_t nbytes);
    tm_status (*sync)(tm_ctx *ctx);
    tm_status (*copy_into)(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src);
    tm_status (*accumulate)(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, double alpha);
    tm_status (*assign)(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, int accumulate, double alpha);
    tm_status (*fill)(tm_ctx *ctx, tm_tensor *t, double value);
    tm_status (*gemm)(tm_ctx *ctx, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                      double alpha, const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb,
                      int64_t sb, double beta, void *C, int64_t ldc, int64_t sc, int64_t batch);
    const tm__fn *fwd, *bwd;
    /* Host memory, the CPU backend's only (NULL elsewhere): n contiguous elements converted
     * between dtypes (float -> bf16 rounds to nearest even), and a strided CPU tensor gathered
     * into dense memory of its dtype. Framework code (tensor reads and writes, the MPI engine's
     * bf16 staging, initialisation) reaches the CPU kernels through these, as through the rest
     * of the table: tm__host_ops()->convert(...). */
    void (*convert)(void *dst, tm_dtype ddt, const void *src, tm_dtype sdt, int64_t n, int nthreads);
    void (*gather_strided)(const tm_tensor *t, void *dst);
    void *(*host_alloc_pinned)(tm_ctx *ctx, size_t nbytes);
    void (*host_free_pinned)(tm_ctx *ctx, void *p);
    tm_status (*side_begin)(tm_ctx *ctx);
    tm_status (*side_end)(tm_ctx *ctx, void **event);
    tm_status (*event_wait)(tm_ctx *ctx, void *event);
    int (*event_query)(tm_ctx *ctx, void *event);
    void (*event_free)(tm_ctx *ctx, void *event);
} tm__backend_ops;

/* The backend registered for TM__CPU / TM__CUDA; NULL when this build has none. */
const tm__backend_ops *tm__backend_get(int b);
/* The CPU backend's table, for host-memory work (convert, gather_strided). */
static inline const tm__backend_ops *tm__host_ops(void) { return tm__backend_get(TM__CPU); }
/* The backend of a context for a device (NULL if the context does not have that device). */
const tm__backend_ops *tm__ctx_backend(const tm_ctx *ctx, tm_device dev);
/* The GEMM of the device's backend (batched contract above). */
tm_status tm__gemm(tm_ctx *ctx, tm_device dev, tm_dtype dt, int trans_a, int trans_b, int64_t M, int64_t N,
                   int64_t K, double alpha, const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb,
                   int64_t sb, double beta, void *C, int64_t ldc, int64_t sc, int64_t batch);
/* Backends count their device-to-host synchronisations here (tm_ctx_sync_count). The CUDA
 * backend counts its D2H copies and syncs; on the CPU, where nothing waits, the same logical
 * points count instead (the rules are in tinymoe.h at tm_ctx_sync_count): tm_tensor_read of a
 * CPU tensor, tm_ctx_sync of a context without CUDA, and the CPU kernels whose CUDA version
 * must read back (a data-dependent output size, an error flag). */
void tm__count_sync(tm_ctx *ctx);
/* A monotonic clock in seconds, and the host time a backend spent blocked on a device (its
 * stream synchronisations, a collective's wait), added up for tm_ctx_sync_seconds:
 *   double t0 = tm__now(); cudaStreamSynchronize(...); tm__add_wait(ctx, t0); */
double tm__now(void);
void tm__add_wait(tm_ctx *ctx, double t0);

/* Building a backend's kernel tables from ops.def: TM__FWD_<BACKEND>_<kernels>(name) is the
 * forward of op `name` on that backend, or NULL. */
#define TM__FWD_CPU_CPU_CUDA(n) tm__##n##_forward_cpu
#define TM__FWD_CPU_CPU(n) tm__##n##_forward_cpu
#define TM__FWD_CPU_GENERIC(n) tm__##n##_forward
#define TM__FWD_CPU_NONDIFF_CPU(n) tm__##n##_forward_cpu
#define TM__FWD_CPU_NONDIFF_CPU_CUDA(n) tm__##n##_forward_cpu
#define TM__BWD_CPU_CPU_CUDA(n) tm__##n##_backward_cpu
#define TM__BWD_CPU_CPU(n) tm__##n##_backward_cpu
#define TM__BWD_CPU_GENERIC(n) tm__##n##_backward
#define TM__BWD_CPU_NONDIFF_CPU(n) NULL
#define TM__BWD_CPU_NONDIFF_CPU_CUDA(n) NULL
#define TM__FWD_CUDA_CPU_CUDA(n) tm__##n##_forward_cuda
#define TM__FWD_CUDA_CPU(n) NULL
#define TM__FWD_CUDA_GENERIC(n) tm__##n##_forward
#define TM__FWD_CUDA_NONDIFF_CPU(n) NULL
#define TM__FWD_CUDA_NONDIFF_CPU_CUDA(n) tm__##n##_forward_cuda
#define TM__BWD_CUDA_CPU_CUDA(n) tm__##n##_backward_cuda
#define TM__BWD_CUDA_CPU(n) NULL
#define TM__BWD_CUDA_GENERIC(n) tm__##n##_backward
#define TM__BWD_CUDA_NONDIFF_CPU(n) NULL
#define TM__BWD_CUDA_NONDIFF_CPU_CUDA(n) NULL
#define TM__FWD_CPU_COMM(n) tm__##n##_forward
#define TM__BWD_CPU_COMM(n) tm__##n##_backward
#define TM__FWD_CUDA_COMM(n) tm__##n##_forward
#define TM__BWD_CUDA_COMM(n) tm__##n##_backward

/* The CPU backend's primitives (kernels/cpu/copy.c), for kernels; framework code calls them
 * through the CPU table (tm__host_ops). */
double tm__load_f64(const void *p, tm_dtype dt, int64_t i);
void tm__store_f64(void *p, tm_dtype dt, int64_t i, double v);
/* Convert n contiguous host elements between dtypes (float -> bf16 rounds to nearest even). */
void tm__convert_host(void *dst, tm_dtype ddt, const void *src, tm_dtype sdt, int64_t n, int nthreads);
/* Gather a strided host tensor into dense memory of its dtype. */
void tm__gather_strided_host(const tm_tensor *t, void *dst);
tm_status tm__cpu_copy_into(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src);
tm_status tm__cpu_accumulate(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, double alpha);
tm_status tm__cpu_assign(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, int accumulate, double alpha);
tm_status tm__cpu_fill(tm_ctx *ctx, tm_tensor *t, double value);
/* Host memory through the context's allocator hook, not counted (backend alloc for the CPU). */
void *tm__host_alloc_raw(tm_ctx *ctx, size_t nbytes);

#endif
