/*
 * gmm_sm90_harness.cu — standalone check and timing of the Hopper grouped GEMM
 * (kernels/cuda/grouped_matmul_sm90.cu) without building the library: one nvcc command,
 *
 *   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Ikernels/cuda \
 *        bench/gmm_sm90_harness.cu kernels/cuda/grouped_matmul_sm90.cu -lcublas -o gmm_sm90_harness
 *   (or make CUDA=1 gmm-sm90-harness: build/bench/gmm_sm90_harness)
 *   ./gmm_sm90_harness [--check] [--small] [--time] [--T 16384 --k 6 --E 64 --H 2048 --F 1408] [--iters 20]
 *   GMM90_SCHED=1 (cooperative) or 2 (ping-pong) picks the consumers' schedule; GMM90_BN=128|256
 *
 * --check: FWD, DX and DW against cuBLAS per group (cublasGemmEx, bf16 in and out, f32 compute:
 *   the per-group path tm_grouped_matmul takes today) on ragged groups with empty ones, one-row
 *   groups, K and N not multiples of 64 or 128, counts that stop short of R (FWD rows past the last
 *   group must be 0), and the benchmark shapes on each routing. Errors are max |ours - ref| over
 *   max |ref|; dw of an empty group and rows past the groups must match bit for bit.
 * --time: each direction at the benchmark shapes (R = T k rows, E groups; gate/up K = H, N = 2 F;
 *   down K = F, N = H) on balanced, random and skewed routings (bench/kernels.c's three), against
 *   cuBLAS per group and one dense GEMM of the same FLOPs; prints TFLOP/s and % of dense.
 * DX_SWIGLU (--check): dgate and dup bit for bit against DX (fresh dh) and the elementwise SwiGLU
 *   backward; (--time) the same two at the down projection's shapes.
 * FWD_SWIGLU (--check): gate and up against FWD of each weight (bit for bit: the same sums) and
 *   cuBLAS (tolerance), h against the elementwise swiglu of FWD's gate and up (bit for bit), rows
 *   past the groups 0 in all three. (--time): the fused launch against FWD + FWD + the
 *   elementwise swiglu at the gate/up shapes (N = F per weight).
 */
#include "grouped_matmul_sm90.h"
#include "swiglu.cuh"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#define CK(x)                                                                                                          \
    do {                                                                                                               \
        cudaError_t e_ = (x);                                                                                          \
        if (e_ != cudaSuccess) {                                                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));                         \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)
#define CB(x)                                                                                                          \
    do {                                                                                                               \
        cublasStatus_t s_ = (x);                                                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                             \
            fprintf(stderr, "%s:%d %s: cublas %d\n", __FILE__, __LINE__, #x, (int)s_);                                 \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

typedef __nv_bfloat16 bf16;
static cublasHandle_t H;
static const char *MODES[3] = {"fwd", "dx", "dw"};

static uint64_t rng = 88172645463325252ull;
static double urand() {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (rng >> 11) * (1.0 / 9007199254740992.0);
}
static double nrand() { return sqrt(-2 * log(urand() + 1e-300)) * cos(6.283185307179586 * urand()); }

__global__ void fill_kernel(bf16 *p, size_t n, uint64_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        z ^= z >> 31, z *= 0xBF58476D1CE4E5B9ull, z ^= z >> 29;
        p[i] = __float2bfloat16(((float)(z >> 40) / 16777216.0f * 2.0f - 1.0f) * scale);
    }
}
static void fill(bf16 *p, size_t n, uint64_t seed, float scale) {
    fill_kernel<<<1024, 256>>>(p, n, seed, scale);
    CK(cudaGetLastError());
}

/* max |a - b| and max |b| over n; exact: count of differing bit patterns */
__global__ void diff_kernel(const bf16 *a, const bf16 *b, size_t n, float *out, unsigned long long *ndiff) {
    float md = 0, mr = 0;
    unsigned long long nd = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
        float d = fabsf(x - y);
        if (!(d <= 1e30f)) d = 1e30f; /* NaN / inf count as huge */
        md = fmaxf(md, d), mr = fmaxf(mr, fabsf(y));
        nd += __bfloat16_as_ushort(a[i]) != __bfloat16_as_ushort(b[i]);
    }
    atomicMax((int *)&out[0], __float_as_int(md));
    atomicMax((int *)&out[1], __float_as_int(mr));
    atomicAdd(ndiff, nd);
}
struct diff_t {
    float maxdiff, maxref;
    unsigned long long ndiff;
};
static diff_t diff(const bf16 *a, const bf16 *b, size_t n) {
    static float *o = NULL;
    static unsigned long long *nd = NULL;
    if (!o) {
        CK(cudaMalloc(&o, 8));
        CK(cudaMalloc(&nd, 8));
    }
    CK(cudaMemset(o, 0, 8));
    CK(cudaMemset(nd, 0, 8));
    diff_t r = {0, 0, 0};
    if (n) diff_kernel<<<1024, 256>>>(a, b, n, o, nd);
    float h[2];
    CK(cudaMemcpy(h, o, 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&r.ndiff, nd, 8, cudaMemcpyDeviceToHost));
    r.maxdiff = h[0], r.maxref = h[1];
    return r;
}

/* cuBLAS per group (row-major operands, column-major cuBLAS: C^T = B^T A^T). */
static void ref_gemm(int mode, const bf16 *A, const bf16 *B, bf16 *C, const std::vector<int64_t> &cnt, int64_t K,
                     int64_t N) {
    const float one = 1.0f, zero = 0.0f;
    int64_t off = 0;
    for (size_t g = 0; g < cnt.size(); off += cnt[g], g++) {
        const int n = (int)cnt[g];
        if (n == 0) continue;
        if (mode == 0) /* y_g = x_g W_g: (N x n) = Wc (N x K) xc (K x n) */
            CB(cublasGemmEx(H, CUBLAS_OP_N, CUBLAS_OP_N, (int)N, n, (int)K, &one, B + g * K * N, CUDA_R_16BF, (int)N,
                            A + off * K, CUDA_R_16BF, (int)K, &zero, C + off * N, CUDA_R_16BF, (int)N, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
        else if (mode == 1) /* dx_g += dy_g W_g^T: (K x n) = Wc^T (K x N) dyc (N x n) */
            CB(cublasGemmEx(H, CUBLAS_OP_T, CUBLAS_OP_N, (int)K, n, (int)N, &one, B + g * K * N, CUDA_R_16BF, (int)N,
                            A + off * N, CUDA_R_16BF, (int)N, &one, C + off * K, CUDA_R_16BF, (int)K, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
        else /* dw_g += x_g^T dy_g: (N x K) = dyc (N x n) xc^T (n x K) */
            CB(cublasGemmEx(H, CUBLAS_OP_N, CUBLAS_OP_T, (int)N, (int)K, n, &one, B + off * N, CUDA_R_16BF, (int)N,
                            A + off * K, CUDA_R_16BF, (int)K, &one, C + g * K * N, CUDA_R_16BF, (int)N,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
}

/* GMM90_SCHED: 1 cooperative, 2 ping-pong for FWD, DX and FWD_SWIGLU (DW is always cooperative);
 * unset or 0: the kernel's choice (tm__gmm90_args.schedule) */
static int sched_env(void) {
    static const int v = getenv("GMM90_SCHED") ? atoi(getenv("GMM90_SCHED")) : 0;
    return v;
}

static void ours(int mode, const bf16 *A, const bf16 *B, bf16 *C, const int64_t *dcnt, int64_t G, int64_t R, int64_t K,
                 int64_t N, int write = 0) {
    static const int bn = getenv("GMM90_BN") ? atoi(getenv("GMM90_BN")) : 0;
    static int *sched = NULL; /* DW's tile counter (GMM90_STATIC=1: the static schedule) */
    if (!sched && !getenv("GMM90_STATIC")) CK(cudaMalloc(&sched, sizeof(int)));
    if (mode == TM__GMM90_DW && sched) CK(cudaMemsetAsync(sched, 0, sizeof(int), 0));
    tm__gmm90_args a = {mode, A, B, C, dcnt, G, R, K, N, bn, 0, 0, mode == TM__GMM90_DW ? sched : NULL, NULL, NULL, NULL};
    a.schedule = mode == TM__GMM90_DW ? 0 : sched_env();
    a.write = write;
    char why[512];
    int rc = tm__gmm90_run(&a, 0, why, sizeof why);
    if (rc) {
        fprintf(stderr, "tm__gmm90_run(%s, G %lld R %lld K %lld N %lld) = %d: %s\n", MODES[mode], (long long)G,
                (long long)R, (long long)K, (long long)N, rc, why);
        exit(1);
    }
}

/* The fused gate/up/SwiGLU launch: gate = x w_gate, up = x w_up, h = swiglu(gate, up). */
static void ours_swiglu(const bf16 *x, const bf16 *wg, const bf16 *wu, bf16 *h, bf16 *gate, bf16 *up,
                        const int64_t *dcnt, int64_t G, int64_t R, int64_t K, int64_t N) {
    static const int bn = getenv("GMM90_BN") ? atoi(getenv("GMM90_BN")) : 0;
    tm__gmm90_args a = {TM__GMM90_FWD_SWIGLU, x, wg, h, dcnt, G, R, K, N, bn, 0, 0, NULL, wu, gate, up};
    a.schedule = sched_env();
    char why[512];
    int rc = tm__gmm90_run(&a, 0, why, sizeof why);
    if (rc) {
        fprintf(stderr, "tm__gmm90_run(fwd_swiglu, G %lld R %lld K %lld N %lld) = %d: %s\n", (long long)G,
                (long long)R, (long long)K, (long long)N, rc, why);
        exit(1);
    }
}
/* DX_SWIGLU: dgate, dup = SwiGLU's backward of dh = dy_g @ w[g]^T (bf16) on the forward's gate and up */
static void ours_dxs(const bf16 *dy, const bf16 *w, bf16 *dgate, bf16 *dup, const bf16 *gate, const bf16 *up,
                     const int64_t *dcnt, int64_t G, int64_t R, int64_t K, int64_t N) {
    tm__gmm90_args a;
    memset(&a, 0, sizeof a);
    a.mode = TM__GMM90_DX_SWIGLU, a.a = dy, a.b = w, a.c = dgate, a.counts = dcnt, a.G = G, a.R = R, a.K = K, a.N = N;
    a.gate_in = gate, a.up_in = up, a.c_dup = dup;
    char why[512];
    int rc = tm__gmm90_run(&a, 0, why, sizeof why);
    if (rc) {
        fprintf(stderr, "tm__gmm90_run(dx_swiglu, G %lld R %lld K %lld N %lld) = %d: %s\n", (long long)G, (long long)R,
                (long long)K, (long long)N, rc, why);
        exit(1);
    }
}
/* dgate, dup from dh as activation.cu's swiglu_backward_kernel computes fresh gradients (swiglu.cuh),
 * and as fast: 8 elements a thread in 16-byte loads and stores (16-byte aligned operands), so that the timing's "dx + swiglu backward" is what the library runs (a scalar
 * grid-stride loop here made the fused launch look 16-20% faster than it was in training) */
__global__ void swiglu_bwd_kernel(bf16 *dg, bf16 *du, const bf16 *g, const bf16 *u, const bf16 *dh, size_t n) {
    const size_t n8 = n & ~(size_t)7, id = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (id < n - n8) { /* the tail past a multiple of 8 */
        const size_t i = n8 + id;
        const float v = __bfloat162float(g[i]), d = __bfloat162float(dh[i]), s = tm__sigmoidf(v);
        dg[i] = __float2bfloat16_rn(tm__swiglu_bwd_gate(0.0f, v, s, d, __bfloat162float(u[i])));
        du[i] = __float2bfloat16_rn(tm__swiglu_bwd_up(0.0f, v, s, d));
    }
    for (size_t i = 8 * id; i < n8; i += 8 * (size_t)gridDim.x * blockDim.x) {
        uint4 gv = *(const uint4 *)(g + i), uv = *(const uint4 *)(u + i), dv = *(const uint4 *)(dh + i), go, uo;
        const bf16 *ge = (const bf16 *)&gv, *ue = (const bf16 *)&uv, *de = (const bf16 *)&dv;
        bf16 *gq = (bf16 *)&go, *uq = (bf16 *)&uo;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float v = __bfloat162float(ge[j]), d = __bfloat162float(de[j]), s = tm__sigmoidf(v);
            gq[j] = __float2bfloat16_rn(tm__swiglu_bwd_gate(0.0f, v, s, d, __bfloat162float(ue[j])));
            uq[j] = __float2bfloat16_rn(tm__swiglu_bwd_up(0.0f, v, s, d));
        }
        *(uint4 *)(dg + i) = go, *(uint4 *)(du + i) = uo;
    }
}
/* h = swiglu(gate, up) elementwise (activation.cu's arithmetic, swiglu.cuh) */
__global__ void swiglu_kernel(bf16 *h, const bf16 *g, const bf16 *u, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        h[i] = __float2bfloat16_rn(tm__swiglu_fwd(__bfloat162float(g[i]), __bfloat162float(u[i])));
}

struct bufs {
    bf16 *x, *w, *dy, *c, *cref;
    int64_t *dcnt;
};

static int failures = 0;

/* One case, all three modes. cnt may sum to less than R (rows past the groups). */
static void check_case(const char *name, std::vector<int64_t> cnt, int64_t R, int64_t K, int64_t N) {
    const int64_t G = (int64_t)cnt.size();
    bufs b;
    CK(cudaMalloc(&b.x, R * K * 2 + 16));
    CK(cudaMalloc(&b.dy, R * N * 2 + 16));
    CK(cudaMalloc(&b.w, G * K * N * 2 + 16));
    const size_t cmax = (size_t)(R * (K > N ? K : N) > G * K * N ? R * (K > N ? K : N) : G * K * N);
    CK(cudaMalloc(&b.c, cmax * 2 + 16));
    CK(cudaMalloc(&b.cref, cmax * 2 + 16));
    CK(cudaMalloc(&b.dcnt, G * 8));
    CK(cudaMemcpy(b.dcnt, cnt.data(), G * 8, cudaMemcpyHostToDevice));
    fill(b.x, R * K, 1, 1.0f), fill(b.dy, R * N, 2, 1.0f), fill(b.w, G * K * N, 3, 0.05f);
    int64_t sum = 0;
    for (auto c : cnt) sum += c;
    for (int mode = 0; mode < 3; mode++) {
        const size_t nc = mode == 0 ? R * N : mode == 1 ? R * K : G * K * N;
        /* initial C: random for the accumulating modes, garbage for FWD (every row must be written) */
        fill(b.c, nc, 7 + mode, mode == 0 ? 100.0f : 1.0f);
        if (mode == 0) CK(cudaMemset(b.cref, 0, nc * 2)); /* rows past the groups: y = 0 */
        else CK(cudaMemcpy(b.cref, b.c, nc * 2, cudaMemcpyDeviceToDevice));
        const bf16 *A = mode == 1 ? b.dy : b.x, *B = mode == 2 ? b.dy : b.w;
        ref_gemm(mode, A, B, b.cref, cnt, K, N);
        ours(mode, A, B, b.c, b.dcnt, G, R, K, N);
        CK(cudaDeviceSynchronize());
        diff_t d = diff(b.c, b.cref, nc);
        double rel = d.maxref > 0 ? d.maxdiff / d.maxref : d.maxdiff;
        bool ok = rel < 1e-2;
        /* exact parts: dw of empty groups, rows past the groups */
        unsigned long long exact_bad = 0;
        if (mode == 2) {
            for (int64_t g = 0; g < G; g++)
                if (cnt[g] == 0) exact_bad += diff(b.c + g * K * N, b.cref + g * K * N, K * N).ndiff;
        } else if (sum < R) {
            const int64_t w = mode == 0 ? N : K;
            exact_bad += diff(b.c + sum * w, b.cref + sum * w, (R - sum) * w).ndiff;
        }
        ok = ok && exact_bad == 0;
        failures += !ok;
        printf("CHECK %-28s %s G %lld R %lld K %lld N %lld: max|d| %.3g max|ref| %.3g rel %.2e differing %llu, "
               "exact-part mismatches %llu %s\n",
               name, MODES[mode], (long long)G, (long long)R, (long long)K, (long long)N, d.maxdiff, d.maxref, rel,
               d.ndiff, exact_bad, ok ? "ok" : "FAIL");
    }
    { /* FWD_SWIGLU: w_gate = w, w_up another fill; outputs start as garbage */
        bf16 *wu, *gate, *up, *h, *fg, *fu, *href;
        const size_t nc = R * N;
        CK(cudaMalloc(&wu, G * K * N * 2 + 16));
        bf16 **bs[6] = {&gate, &up, &h, &fg, &fu, &href};
        for (int i = 0; i < 6; i++) CK(cudaMalloc(bs[i], nc * 2 + 16));
        fill(wu, G * K * N, 4, 0.05f);
        fill(gate, nc, 21, 100.0f), fill(up, nc, 22, 100.0f), fill(h, nc, 23, 100.0f);
        ours(TM__GMM90_FWD, b.x, b.w, fg, b.dcnt, G, R, K, N);
        ours(TM__GMM90_FWD, b.x, wu, fu, b.dcnt, G, R, K, N);
        if (nc) swiglu_kernel<<<1024, 256>>>(href, fg, fu, nc);
        CK(cudaMemset(b.cref, 0, nc * 2));
        ref_gemm(0, b.x, b.w, b.cref, cnt, K, N);
        ours_swiglu(b.x, b.w, wu, h, gate, up, b.dcnt, G, R, K, N);
        CK(cudaDeviceSynchronize());
        const diff_t dg = diff(gate, fg, nc), du = diff(up, fu, nc), dh = diff(h, href, nc), dr = diff(gate, b.cref, nc);
        const double rel = dr.maxref > 0 ? dr.maxdiff / dr.maxref : dr.maxdiff;
        unsigned long long tail = 0; /* rows past the groups: 0 in all three (fg, fu, href are 0 there) */
        if (sum < R) tail = diff(gate + sum * N, b.cref + sum * N, (R - sum) * N).ndiff +
                            diff(up + sum * N, b.cref + sum * N, (R - sum) * N).ndiff +
                            diff(h + sum * N, b.cref + sum * N, (R - sum) * N).ndiff;
        const bool ok = dg.ndiff == 0 && du.ndiff == 0 && dh.ndiff == 0 && rel < 1e-2 && tail == 0;
        failures += !ok;
        printf("CHECK %-28s swiglu G %lld R %lld K %lld N %lld: gate / up / h differing from fwd + swiglu %llu / %llu / "
               "%llu, gate vs cuBLAS rel %.2e, tail mismatches %llu %s\n",
               name, (long long)G, (long long)R, (long long)K, (long long)N, dg.ndiff, du.ndiff, dh.ndiff, rel, tail,
               ok ? "ok" : "FAIL");
        cudaFree(wu), cudaFree(gate), cudaFree(up), cudaFree(h), cudaFree(fg), cudaFree(fu), cudaFree(href);
    }
    { /* DX_SWIGLU: against DX (fresh dh) then the elementwise backward, bit for bit; outputs start as
       * garbage, rows past the groups must get 0 */
        bf16 *gi, *ui, *dg, *du, *dh, *rg, *ru;
        const size_t nc = R * K;
        bf16 **bs[7] = {&gi, &ui, &dg, &du, &dh, &rg, &ru};
        for (int i = 0; i < 7; i++) CK(cudaMalloc(bs[i], nc * 2 + 16));
        fill(gi, nc, 31, 3.0f), fill(ui, nc, 32, 2.0f), fill(dg, nc, 33, 100.0f), fill(du, nc, 34, 100.0f);
        fill(dh, nc, 35, 100.0f); /* a fresh dx is written whole: rows past the groups 0 */
        ours(TM__GMM90_DX, b.dy, b.w, dh, b.dcnt, G, R, K, N, 1);
        if (nc) swiglu_bwd_kernel<<<1024, 256>>>(rg, ru, gi, ui, dh, nc);
        ours_dxs(b.dy, b.w, dg, du, gi, ui, b.dcnt, G, R, K, N);
        CK(cudaDeviceSynchronize());
        const diff_t d1 = diff(dg, rg, nc), d2 = diff(du, ru, nc);
        unsigned long long tail = 0; /* rows past the groups: fresh dh 0 there, so dgate = dup = +0 */
        if (sum < R) {
            CK(cudaMemset(rg, 0, (R - sum) * K * 2));
            tail = diff(dh + sum * K, rg, (R - sum) * K).ndiff + diff(dg + sum * K, rg, (R - sum) * K).ndiff +
                   diff(du + sum * K, rg, (R - sum) * K).ndiff;
        }
        const bool ok = d1.ndiff == 0 && d2.ndiff == 0 && tail == 0 && d1.maxref > 0;
        failures += !ok;
        printf("CHECK %-28s dxswiglu G %lld R %lld K %lld N %lld: dgate / dup differing from dx + swiglu backward "
               "%llu / %llu (max|ref| %.3g), tail mismatches (fresh dx, dgate, dup) %llu %s\n",
               name, (long long)G, (long long)R, (long long)K, (long long)N, d1.ndiff, d2.ndiff, d1.maxref, tail,
               ok ? "ok" : "FAIL");
        for (int i = 0; i < 7; i++) cudaFree(*bs[i]);
    }
    cudaFree(b.x), cudaFree(b.dy), cudaFree(b.w), cudaFree(b.c), cudaFree(b.cref), cudaFree(b.dcnt);
}

/* The bench's routings: T tokens to k distinct experts of E. */
static std::vector<int64_t> routing(const char *kind, int64_t T, int k, int64_t E) {
    std::vector<int64_t> cnt(E, 0);
    if (!strcmp(kind, "balanced")) {
        for (int64_t e = 0; e < E; e++) cnt[e] = T * k / E + (e < (T * k) % E);
        return cnt;
    }
    std::vector<double> p(E, 1.0);
    if (!strcmp(kind, "skewed"))
        for (auto &v : p) v = exp(nrand());
    std::vector<char> used(E);
    for (int64_t t = 0; t < T; t++) {
        std::fill(used.begin(), used.end(), 0);
        for (int j = 0; j < k; j++) {
            double tot = 0;
            for (int64_t e = 0; e < E; e++) tot += used[e] ? 0 : p[e];
            double u = urand() * tot;
            int64_t pick = -1;
            for (int64_t e = 0; e < E; e++) {
                if (used[e]) continue;
                pick = e;
                if ((u -= p[e]) < 0) break;
            }
            used[pick] = 1, cnt[pick]++;
        }
    }
    return cnt;
}

static float time_it(int iters, void (*f)(void *), void *ctx) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) f(ctx);
    CK(cudaDeviceSynchronize());
    CK(cudaEventRecord(a));
    for (int i = 0; i < iters; i++) f(ctx);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    cudaEventDestroy(a), cudaEventDestroy(b);
    return ms / iters;
}

struct run_ctx {
    int mode, impl; /* impl 0 ours, 1 cuBLAS per group, 2 dense */
    const bf16 *A, *B;
    bf16 *C;
    const int64_t *dcnt;
    std::vector<int64_t> cnt;
    int64_t G, R, K, N;
};
static void run_one(void *p) {
    run_ctx *r = (run_ctx *)p;
    if (r->impl == 0) ours(r->mode, r->A, r->B, r->C, r->dcnt, r->G, r->R, r->K, r->N);
    else if (r->impl == 1) ref_gemm(r->mode, r->A, r->B, r->C, r->cnt, r->K, r->N);
    else {
        const float one = 1.0f, zero = 0.0f;
        const int R = (int)r->R, K = (int)r->K, N = (int)r->N;
        if (r->mode == 0)
            CB(cublasGemmEx(H, CUBLAS_OP_N, CUBLAS_OP_N, N, R, K, &one, r->B, CUDA_R_16BF, N, r->A, CUDA_R_16BF, K,
                            &zero, r->C, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        else if (r->mode == 1)
            CB(cublasGemmEx(H, CUBLAS_OP_T, CUBLAS_OP_N, K, R, N, &one, r->B, CUDA_R_16BF, N, r->A, CUDA_R_16BF, N, &one,
                            r->C, CUDA_R_16BF, K, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        else
            CB(cublasGemmEx(H, CUBLAS_OP_N, CUBLAS_OP_T, N, K, R, &one, r->B, CUDA_R_16BF, N, r->A, CUDA_R_16BF, K, &one,
                            r->C, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
}

int main(int argc, char **argv) {
    int check = 0, timing = 0, iters = 20, k = 6, small = 0;
    int64_t T = 16384, E = 64, Hd = 2048, F = 1408;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--check")) check = 1;
        else if (!strcmp(argv[i], "--small")) check = small = 1; /* the small cases only (compute-sanitizer) */
        else if (!strcmp(argv[i], "--time")) timing = 1;
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--T") && i + 1 < argc) T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--k") && i + 1 < argc) k = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--E") && i + 1 < argc) E = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--H") && i + 1 < argc) Hd = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--F") && i + 1 < argc) F = atoll(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--check] [--small] [--time] [--iters N] [--T --k --E --H --F]\n", argv[0]);
            return 2;
        }
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!check && !timing) check = timing = 1;
    char why[512];
    if (!tm__gmm90_supported(why, sizeof why)) {
        printf("not supported here: %s\n", why);
        return 3;
    }
    CB(cublasCreate(&H));
    const char *rts[3] = {"balanced", "random", "skewed"};
    if (check) {
        /* ragged with empty groups (first, middle, last), a one-row group, K and N off the tile grid */
        check_case("ragged7-empty", {0, 300, 1, 0, 129, 517, 0}, 947, 136, 264);
        check_case("ragged-bn256", {255, 0, 257, 64, 1, 700}, 1277, 200, 512);
        check_case("odd-groups-tail", {33, 0, 150, 77, 5}, 400, 64, 72); /* counts end at 265 < R */
        check_case("one-group", {1000}, 1000, 1408, 256);
        check_case("many-small", std::vector<int64_t>(97, 13), 97 * 13, 128, 128);
        { /* 700 DW tiles, more than 4 a CTA on 132 SMs: CTAs draw tiles from the counter and the
           * tile-id queue wraps; groups of 1 to 9 rows, ties, every 7th empty */
            std::vector<int64_t> c(700);
            int64_t rows = 0;
            for (int g = 0; g < 700; g++) rows += c[g] = g % 7 == 3 ? 0 : 1 + g % 9;
            check_case("drawn-tiles", c, rows, 128, 128);
        }
        for (int r = 0; r < 3 && !small; r++) {
            std::vector<int64_t> c = routing(rts[r], T, k, E);
            char nm[64];
            snprintf(nm, sizeof nm, "bench-gateup-%s", rts[r]);
            check_case(nm, c, T * k, Hd, 2 * F);
            snprintf(nm, sizeof nm, "bench-gate-%s", rts[r]); /* N = F: FWD_SWIGLU at its own shapes */
            check_case(nm, c, T * k, Hd, F);
            snprintf(nm, sizeof nm, "bench-down-%s", rts[r]);
            check_case(nm, c, T * k, F, Hd);
        }
        printf("CHECK %s (%d failures)\n", failures ? "FAILED" : "all ok", failures);
    }
    if (timing) {
        const int64_t R = T * k;
        bf16 *x, *dy, *w, *c;
        int64_t *dcnt;
        const int64_t maxKN = Hd > 2 * F ? Hd : 2 * F;
        CK(cudaMalloc(&x, R * maxKN * 2));
        CK(cudaMalloc(&dy, R * maxKN * 2));
        CK(cudaMalloc(&w, E * Hd * 2 * F * 2));
        CK(cudaMalloc(&c, (R * maxKN > E * Hd * 2 * F ? R * maxKN : E * Hd * 2 * F) * 2));
        CK(cudaMalloc(&dcnt, E * 8));
        fill(x, R * maxKN, 11, 1.0f), fill(dy, R * maxKN, 12, 1.0f), fill(w, E * Hd * 2 * F, 13, 0.02f);
        fill(c, R * maxKN, 14, 1.0f);
        /* FWD_SWIGLU: one launch against FWD of each weight (N = F) and the elementwise swiglu */
        for (int rt = 0; rt < 3; rt++) {
            rng = 88172645463325252ull + rt;
            std::vector<int64_t> cnt = routing(rts[rt], T, k, E);
            CK(cudaMemcpy(dcnt, cnt.data(), E * 8, cudaMemcpyHostToDevice));
            bf16 *wu = w + E * Hd * F, *g = c, *u = c + R * F, *h = dy; /* dy's buffer holds R x max(H, 2F) */
            struct sw_ctx { const bf16 *x, *wg, *wu; bf16 *g, *u, *h; int64_t *dcnt, E, R, K, N; } sc = {x, w, wu, g, u, h, dcnt, E, R, Hd, F};
            auto fused = [](void *p) { sw_ctx *q = (sw_ctx *)p; ours_swiglu(q->x, q->wg, q->wu, q->h, q->g, q->u, q->dcnt, q->E, q->R, q->K, q->N); };
            auto apart = [](void *p) {
                sw_ctx *q = (sw_ctx *)p;
                ours(TM__GMM90_FWD, q->x, q->wg, q->g, q->dcnt, q->E, q->R, q->K, q->N);
                ours(TM__GMM90_FWD, q->x, q->wu, q->u, q->dcnt, q->E, q->R, q->K, q->N);
                swiglu_kernel<<<1024, 256>>>(q->h, q->g, q->u, (size_t)(q->R * q->N));
            };
            const float tf = time_it(iters, fused, &sc), ta = time_it(iters, apart, &sc);
            const double fl = 2.0 * R * Hd * 2 * F;
            printf("TIME swiglu  %-8s fused %.3f ms %.1f TF/s | fwd + fwd + swiglu %.3f ms %.1f TF/s | fused saves %.1f%%\n",
                   rts[rt], tf, fl / tf / 1e9, ta, fl / ta / 1e9, 100.0 * (ta - tf) / ta);
        }
        /* DX_SWIGLU at the down projection's shapes (K = F, N = H): one launch against DX (fresh dh)
         * and the elementwise backward */
        for (int rt = 0; rt < 3; rt++) {
            rng = 88172645463325252ull + rt;
            std::vector<int64_t> cnt = routing(rts[rt], T, k, E);
            CK(cudaMemcpy(dcnt, cnt.data(), E * 8, cudaMemcpyHostToDevice));
            /* dy (R, H) in x's buffer; gate, up, dh, dgate, dup (each R x F) in one more buffer */
            bf16 *gi;
            CK(cudaMalloc(&gi, 5 * R * F * 2));
            bf16 *ui = gi + R * F, *dh = gi + 2 * R * F, *dg = gi + 3 * R * F, *du = gi + 4 * R * F;
            fill(gi, R * F, 41, 3.0f), fill(ui, R * F, 42, 2.0f);
            struct dxs_ctx { const bf16 *dy, *w, *gi, *ui; bf16 *dg, *du, *dh; int64_t *dcnt, E, R, K, N; } sc = {
                x, w, gi, ui, dg, du, dh, dcnt, E, R, F, Hd};
            auto fused = [](void *p) { dxs_ctx *q = (dxs_ctx *)p; ours_dxs(q->dy, q->w, q->dg, q->du, q->gi, q->ui, q->dcnt, q->E, q->R, q->K, q->N); };
            auto apart = [](void *p) {
                dxs_ctx *q = (dxs_ctx *)p;
                ours(TM__GMM90_DX, q->dy, q->w, q->dh, q->dcnt, q->E, q->R, q->K, q->N, 1);
                swiglu_bwd_kernel<<<1024, 256>>>(q->dg, q->du, q->gi, q->ui, q->dh, (size_t)(q->R * q->K));
            };
            const float tf = time_it(iters, fused, &sc), ta = time_it(iters, apart, &sc);
            const double fl = 2.0 * R * Hd * F;
            printf("TIME dxswiglu %-8s fused %.3f ms %.1f TF/s | dx + swiglu backward %.3f ms | fused saves %.1f%%\n",
                   rts[rt], tf, fl / tf / 1e9, ta, 100.0 * (ta - tf) / ta);
            CK(cudaFree(gi));
        }
        const char *gn[2] = {"gate_up", "down"};
        const int64_t Ks[2] = {Hd, F}, Ns[2] = {2 * F, Hd};
        for (int s = 0; s < 2; s++) {
            const int64_t K = Ks[s], N = Ns[s];
            const double fl = 2.0 * R * K * N;
            float dense[3];
            for (int m = 0; m < 3; m++) {
                run_ctx r;
                r.mode = m, r.impl = 2, r.A = m == 1 ? dy : x, r.B = m == 2 ? dy : w, r.C = c, r.dcnt = dcnt;
                r.G = E, r.R = R, r.K = K, r.N = N;
                dense[m] = time_it(iters, run_one, &r);
            }
            const float dsum = dense[0] + dense[1] + dense[2];
            printf("TIME %-7s dense    fwd %.3f ms %.1f TF/s | dx %.1f | dw %.1f | fwd+bwd %.1f TF/s\n", gn[s], dense[0],
                   fl / dense[0] / 1e9, fl / dense[1] / 1e9, fl / dense[2] / 1e9, 3 * fl / dsum / 1e9);
            for (int rt = 0; rt < 3; rt++) {
                rng = 88172645463325252ull + rt;
                std::vector<int64_t> cnt = routing(rts[rt], T, k, E);
                int64_t mx = 0;
                for (auto v : cnt) mx = v > mx ? v : mx;
                CK(cudaMemcpy(dcnt, cnt.data(), E * 8, cudaMemcpyHostToDevice));
                for (int impl = 0; impl < 2; impl++) {
                    float t[3];
                    for (int m = 0; m < 3; m++) {
                        run_ctx r;
                        r.mode = m, r.impl = impl, r.A = m == 1 ? dy : x, r.B = m == 2 ? dy : w, r.C = c;
                        r.dcnt = dcnt, r.cnt = cnt, r.G = E, r.R = R, r.K = K, r.N = N;
                        t[m] = time_it(iters, run_one, &r);
                    }
                    const float sum = t[0] + t[1] + t[2];
                    printf("TIME %-7s %-8s max %5lld %-9s fwd %.3f ms %.1f TF/s (%.1f%%) | dx %.1f (%.1f%%) | dw %.1f "
                           "(%.1f%%) | fwd+bwd %.1f TF/s (%.1f%% of dense)\n",
                           gn[s], rts[rt], (long long)mx, impl ? "cublas/g" : "sm90", t[0], fl / t[0] / 1e9,
                           100 * dense[0] / t[0], fl / t[1] / 1e9, 100 * dense[1] / t[1], fl / t[2] / 1e9,
                           100 * dense[2] / t[2], 3 * fl / sum / 1e9, 100 * dsum / sum);
                }
            }
        }
    }
    cublasDestroy(H);
    return failures ? 1 : 0;
}
