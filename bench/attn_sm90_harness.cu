/*
 * attn_sm90_harness.cu — standalone check and timing of the Hopper attention kernels
 * (kernels/cuda/attention_sm90.cu) without building the library: one nvcc command,
 *
 *   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Ikernels/cuda \
 *        bench/attn_sm90_harness.cu -o attn_sm90_harness     (it includes attention_sm90.cu)
 *   (or make CUDA=1 attn-sm90-harness: build/bench/attn_sm90_harness)
 *   ./attn_sm90_harness [--check] [--time] [--variants] [--B 16 --S 1024 --Hq 12 --Hkv 4] [--iters 30]
 *
 * --check: o, lse, dq, dk, dv against a float64 CPU evaluation of the same bf16 inputs (causal,
 *   grouped-query heads), on shapes that are not multiples of the tiles, Tk > Tq (queries the last
 *   Tq of Tk positions), G 1 and 3, D 64 and 128; the backward adds into gradients that hold
 *   values (fresh 0) and, in a second run, writes fresh ones; dk and dv as one buffer. Errors are
 *   max |ours - ref| over max |ref| per tensor; the limit 2e-2 is what bf16 P and dS allow. After
 *   each case (but those with k as v) every kernel shape that --variants times runs on the same inputs into fresh outputs and is checked the same
 *   way, so a shape is known correct before fa90_cfg picks it.
 * --time: forward, dQ and dK/dV at the benchmark shapes of bench/attention.c (B 16, S 1024, Hq 12,
 *   Hkv 4, D 64 and 128), ms and TFLOP/s each (FLOPs of the causal half: a product's 2 B Hq S^2 D
 *   halved, B Hq S^2 D; forward 2 products, dQ 3, dK/dV 4).
 * --variants: the same for each kernel shape of variants_of (fa90_cfg's candidates: tile, consumer
 *   warpgroups, stages, CTAs per SM), launched as the library launches them.
 */
/* the kernels' file itself, so that --variants can launch tile shapes the library does not */
#include "attention_sm90.cu"

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

typedef __nv_bfloat16 bf16;

static unsigned long long rng_state = 88172645463325252ull;
static float frand(void) { /* xorshift64, uniform in [-1, 1) */
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (float)((rng_state >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}
static std::vector<bf16> rand_bf16(size_t n, float amp) {
    std::vector<bf16> v(n);
    for (size_t i = 0; i < n; i++) v[i] = __float2bfloat16(amp * frand());
    return v;
}
static std::vector<double> to_f64(const std::vector<bf16> &v) {
    std::vector<double> d(v.size());
    for (size_t i = 0; i < v.size(); i++) d[i] = __bfloat162float(v[i]);
    return d;
}
template <typename T> static T *dev_copy(const std::vector<T> &v) {
    T *d;
    CK(cudaMalloc(&d, v.size() * sizeof(T) + 16));
    CK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
template <typename T> static std::vector<T> host_copy(const T *d, size_t n) {
    std::vector<T> v(n);
    CK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}
static void die(int r, const char *why) {
    if (r) {
        fprintf(stderr, "launch refused: %s\n", why);
        exit(1);
    }
}

/* Every kernel shape worth timing (the library's, fa90_cfg, among them): kind 0 forward, 1 dQ,
 * 2 dK/dV; launch as the library's host code launches it; fn for its registers. */
struct variant {
    const char *name;
    int kind;
    int (*launch)(const tm__fa90_args *, cudaStream_t, char *, size_t);
    const void *fn;
};
#define FWD_TMA(BN, C, S, M)                                                                                                         \
    {"forward tma BN " #BN " nc " #C " st " #S " minb " #M, 0, fa90_forward_tma<D, BN, C, S, M>, (const void *)fa90_forward_tma_kernel<D, BN, C, S, M>}
#define DQ_TMA(C, S, M) {"dq tma nc " #C " st " #S " minb " #M, 1, fa90_dq_tma<D, C, S, M>, (const void *)fa90_dq_tma_kernel<D, C, S, M>}
#define DKV_TMA(C, S, M) {"dkv tma nc " #C " st " #S " minb " #M, 2, fa90_dkv_tma<D, C, S, M>, (const void *)fa90_dkv_tma_kernel<D, C, S, M>}
template <int D> static std::vector<variant> variants_of() {
    if constexpr (D == 64)
        return {FWD_TMA(64, 1, 2, 3),  FWD_TMA(64, 1, 3, 3), FWD_TMA(128, 1, 2, 2), FWD_TMA(128, 2, 2, 1),
                DQ_TMA(1, 3, 2),       DQ_TMA(1, 2, 3),      DQ_TMA(1, 2, 2),       DQ_TMA(2, 2, 1),       DKV_TMA(1, 3, 2),
                DKV_TMA(1, 2, 2),      DKV_TMA(2, 2, 1)};
    else
        return {FWD_TMA(64, 1, 2, 2), FWD_TMA(64, 1, 3, 2), FWD_TMA(64, 2, 2, 1), FWD_TMA(128, 2, 2, 1), DQ_TMA(1, 2, 2),
                DQ_TMA(2, 2, 1),      DKV_TMA(1, 2, 2),     DKV_TMA(2, 2, 1)};
}
#undef FWD_TMA
#undef DQ_TMA
#undef DKV_TMA
/* a's tensors set up for one variant's kind: its outputs only, all fresh */
static tm__fa90_args variant_args(const tm__fa90_args *a, int kind) {
    tm__fa90_args t = *a;
    t.fq = t.fk = t.fv = 1;
    if (kind == 0) t.dq = t.dk = t.dv = NULL;
    if (kind == 1) t.dk = t.dv = NULL;
    if (kind == 2) t.dq = NULL;
    return t;
}

/* max |a - ref| / max |ref| */
static double rel_err(const std::vector<double> &a, const std::vector<double> &ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); i++) {
        num = fmax(num, fabs(a[i] - ref[i]));
        den = fmax(den, fabs(ref[i]));
    }
    return den > 0 ? num / den : num;
}

/* Every shape of variants_of<D>, each into fresh outputs, against the float64 reference (a's
 * inputs, lse and Delta are the library's); prints one line a shape, returns 1 when all are within
 * the limits of check_case. */
template <int D>
static int check_variants(const tm__fa90_args *a, size_t nq, size_t nk, size_t nl, const std::vector<double> &O,
                          const std::vector<double> &L, const std::vector<double> &DQ, const std::vector<double> &DK,
                          const std::vector<double> &DV) {
    bf16 *o, *g1, *g2;
    float *l;
    CK(cudaMalloc(&o, nq * 2));
    CK(cudaMalloc(&g1, (nq > nk ? nq : nk) * 2));
    CK(cudaMalloc(&g2, nk * 2));
    CK(cudaMalloc(&l, nl * 4));
    int ok = 1;
    char why[256];
    for (const variant &v : variants_of<D>()) {
        tm__fa90_args t = variant_args(a, v.kind);
        if (v.kind == 0) t.out = o, t.lse = l;
        if (v.kind == 1) t.dq = g1;
        if (v.kind == 2) t.dk = g1, t.dv = g2;
        die(v.launch(&t, 0, why, sizeof why), why);
        CK(cudaDeviceSynchronize());
        double e1, e2 = 0.0;
        if (v.kind == 0) {
            std::vector<float> lf = host_copy(l, nl);
            e1 = rel_err(to_f64(host_copy(o, nq)), O), e2 = rel_err(std::vector<double>(lf.begin(), lf.end()), L);
        } else if (v.kind == 1) {
            e1 = rel_err(to_f64(host_copy(g1, nq)), DQ);
        } else {
            e1 = rel_err(to_f64(host_copy(g1, nk)), DK), e2 = rel_err(to_f64(host_copy(g2, nk)), DV);
        }
        const int good = e1 < 2e-2 && e2 < (v.kind == 0 ? 1e-3 : 2e-2);
        printf("  %-36s %.2e %.2e %s\n", v.name, e1, e2, good ? "ok" : "FAIL");
        ok = ok && good;
    }
    cudaFree(o), cudaFree(g1), cudaFree(g2), cudaFree(l);
    return ok;
}

static int check_case(int B, int Tq, int Tk, int Hq, int Hkv, int D, int fresh, int shared_kv) {
    const int G = Hq / Hkv, off = Tk - Tq;
    const double scale = 1.0 / sqrt((double)D);
    const size_t nq = (size_t)B * Tq * Hq * D, nk = (size_t)B * Tk * Hkv * D, nl = (size_t)B * Hq * Tq;
    std::vector<bf16> q = rand_bf16(nq, 2.0f), k = rand_bf16(nk, 2.0f), v = rand_bf16(nk, 1.0f), dout = rand_bf16(nq, 1.0f);
    std::vector<bf16> dq0 = rand_bf16(nq, 0.5f), dk0 = rand_bf16(nk, 0.5f), dv0 = rand_bf16(nk, 0.5f);
    std::vector<double> Q = to_f64(q), K = to_f64(k), V = to_f64(v), DO = to_f64(dout);
    /* reference, float64 */
    std::vector<double> O(nq, 0), L(nl), DQ(nq, 0), DK(nk, 0), DV(nk, 0), P(Tk), DP(Tk);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++) {
            const int hk = h / G;
            for (int i = 0; i < Tq; i++) {
                const int n = i + off + 1;
                const double *qi = &Q[(((size_t)b * Tq + i) * Hq + h) * D], *gi = &DO[(((size_t)b * Tq + i) * Hq + h) * D];
                double mx = -INFINITY;
                for (int j = 0; j < n; j++) {
                    const double *kj = &K[(((size_t)b * Tk + j) * Hkv + hk) * D];
                    double s = 0;
                    for (int x = 0; x < D; x++) s += qi[x] * kj[x];
                    P[j] = s * scale;
                    mx = fmax(mx, P[j]);
                }
                double sum = 0;
                for (int j = 0; j < n; j++) sum += (P[j] = exp(P[j] - mx));
                double *oi = &O[(((size_t)b * Tq + i) * Hq + h) * D];
                double delta = 0;
                for (int j = 0; j < n; j++) {
                    P[j] /= sum;
                    const double *vj = &V[(((size_t)b * Tk + j) * Hkv + hk) * D];
                    double t = 0;
                    for (int x = 0; x < D; x++) oi[x] += P[j] * vj[x], t += gi[x] * vj[x];
                    DP[j] = t;
                    delta += P[j] * t;
                }
                L[((size_t)b * Hq + h) * Tq + i] = mx + log(sum);
                double *dqi = &DQ[(((size_t)b * Tq + i) * Hq + h) * D];
                for (int j = 0; j < n; j++) {
                    const double ds = P[j] * (DP[j] - delta);
                    const size_t ko = (((size_t)b * Tk + j) * Hkv + hk) * D;
                    for (int x = 0; x < D; x++) {
                        dqi[x] += scale * ds * K[ko + x];
                        DK[ko + x] += scale * ds * qi[x];
                        DV[ko + x] += P[j] * gi[x];
                    }
                }
            }
        }
    /* ours */
    bf16 *dQ = dev_copy(q), *dK = dev_copy(k), *dV = dev_copy(v), *dDO = dev_copy(dout);
    bf16 *dO, *ddq = dev_copy(dq0), *ddk = dev_copy(dk0), *ddv = shared_kv ? ddk : dev_copy(dv0);
    float *dL, *dDel;
    CK(cudaMalloc(&dO, nq * sizeof(bf16)));
    CK(cudaMalloc(&dL, nl * sizeof(float)));
    CK(cudaMalloc(&dDel, nl * sizeof(float)));
    tm__fa90_args a;
    memset(&a, 0, sizeof a);
    a.q = dQ, a.k = dK, a.v = dV, a.dout = dDO, a.out = dO, a.lse = dL;
    a.B = B, a.Tq = Tq, a.Tk = Tk, a.Hq = Hq, a.Hkv = Hkv, a.D = D, a.scale = (float)scale;
    char why[256];
    die(tm__fa90_forward(&a, 0, why, sizeof why), why);
    CK(cudaDeviceSynchronize());
    std::vector<bf16> o = host_copy(dO, nq);
    std::vector<float> lse = host_copy(dL, nl);
    /* Delta from the bf16 o, as the library's fa_delta_kernel takes it */
    std::vector<float> del(nl);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < Tq; i++)
            for (int h = 0; h < Hq; h++) {
                const size_t r = ((size_t)b * Tq + i) * Hq + h;
                double s = 0;
                for (int x = 0; x < D; x++) s += (double)__bfloat162float(o[r * D + x]) * DO[r * D + x];
                del[((size_t)b * Hq + h) * Tq + i] = (float)s;
            }
    CK(cudaMemcpy(dDel, del.data(), nl * sizeof(float), cudaMemcpyHostToDevice));
    a.delta = dDel, a.dq = ddq, a.dk = ddk, a.dv = ddv;
    a.fq = a.fk = a.fv = fresh;
    die(tm__fa90_backward(&a, 0, why, sizeof why), why);
    CK(cudaDeviceSynchronize());
    std::vector<double> o64 = to_f64(o), l64(lse.begin(), lse.end());
    std::vector<double> gq = to_f64(host_copy(ddq, nq)), gk = to_f64(host_copy(ddk, nk)), gv = to_f64(host_copy(ddv, nk));
    if (!fresh) { /* the kernels add into what the gradients held */
        std::vector<double> q0 = to_f64(dq0), k0 = to_f64(dk0), v0 = to_f64(dv0);
        for (size_t i = 0; i < nq; i++) gq[i] -= q0[i];
        for (size_t i = 0; i < nk; i++) gk[i] -= k0[i];
        if (!shared_kv)
            for (size_t i = 0; i < nk; i++) gv[i] -= v0[i];
    }
    if (shared_kv)
        for (size_t i = 0; i < nk; i++) DK[i] += DV[i];
    const double eo = rel_err(o64, O), el = rel_err(l64, L), eq = rel_err(gq, DQ), ek = rel_err(gk, DK),
                 ev = shared_kv ? 0.0 : rel_err(gv, DV);
    const double lim = 2e-2;
    int ok = eo < lim && el < 1e-3 && eq < lim && ek < lim && ev < lim;
    printf("check B %d Tq %d Tk %d Hq %d Hkv %d D %3d fresh %d dk=dv %d: o %.2e lse %.2e dq %.2e dk %.2e dv %.2e %s\n", B, Tq,
           Tk, Hq, Hkv, D, fresh, shared_kv, eo, el, eq, ek, ev, ok ? "ok" : "FAIL");
    /* every shape --variants times, fresh outputs, same inputs */
    if (!shared_kv) {
        tm__fa90_args t = a;
        const int vok = D == 64 ? check_variants<64>(&t, nq, nk, nl, O, L, DQ, DK, DV)
                                : check_variants<128>(&t, nq, nk, nl, O, L, DQ, DK, DV);
        ok = ok && vok;
    }
    cudaFree(dQ), cudaFree(dK), cudaFree(dV), cudaFree(dDO), cudaFree(dO), cudaFree(ddq), cudaFree(ddk);
    if (!shared_kv) cudaFree(ddv);
    cudaFree(dL), cudaFree(dDel);
    return ok;
}

/* ms per call of launch() (iters calls after 5 untimed), CUDA events around the stream's work. */
template <typename F> static double time_ms(F launch, int iters) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int it = 0; it < iters + 5; it++) {
        if (it == 5) CK(cudaEventRecord(e0));
        launch();
    }
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return ms / iters;
}

/* The timing runs' tensors at (B, S, Hq, Hkv, D): random q, k, v, dO; o, dq, dk, dv, lse allocated;
 * Delta 0 (its values do not change the kernels' work); every gradient fresh. */
static tm__fa90_args bench_args(int B, int S, int Hq, int Hkv, int D) {
    const size_t nq = (size_t)B * S * Hq * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * Hq * S;
    tm__fa90_args a;
    memset(&a, 0, sizeof a);
    a.q = dev_copy(rand_bf16(nq, 2.0f)), a.k = dev_copy(rand_bf16(nk, 2.0f)), a.v = dev_copy(rand_bf16(nk, 1.0f));
    a.dout = dev_copy(rand_bf16(nq, 1.0f));
    float *delta;
    CK(cudaMalloc(&a.out, nq * 2));
    CK(cudaMalloc(&a.dq, nq * 2));
    CK(cudaMalloc(&a.dk, nk * 2));
    CK(cudaMalloc(&a.dv, nk * 2));
    CK(cudaMalloc(&a.lse, nl * 4));
    CK(cudaMalloc(&delta, nl * 4));
    CK(cudaMemset(delta, 0, nl * 4));
    CK(cudaMemset(a.lse, 0, nl * 4));
    a.delta = delta;
    a.B = B, a.Tq = S, a.Tk = S, a.Hq = Hq, a.Hkv = Hkv, a.D = D, a.scale = 1.0f / sqrtf((float)D);
    a.fq = a.fk = a.fv = 1;
    return a;
}
static void bench_free(tm__fa90_args *a) {
    cudaFree((void *)a->q), cudaFree((void *)a->k), cudaFree((void *)a->v), cudaFree((void *)a->dout);
    cudaFree(a->out), cudaFree(a->dq), cudaFree(a->dk), cudaFree(a->dv), cudaFree(a->lse), cudaFree((void *)a->delta);
}

/* Each of variants_of<D> timed as the library launches it (tensor maps encoded on each call). */
template <int D> static void variants(int B, int S, int Hq, int Hkv, int iters) {
    tm__fa90_args a = bench_args(B, S, Hq, Hkv, D);
    const double unit = (double)B * Hq * S * S * D, prods[3] = {2, 3, 4};
    char why[256];
    for (const variant &v : variants_of<D>()) {
        const tm__fa90_args t = variant_args(&a, v.kind);
        const double ms = time_ms([&] { die(v.launch(&t, 0, why, sizeof why), why); }, iters);
        cudaFuncAttributes fa;
        CK(cudaFuncGetAttributes(&fa, v.fn));
        printf("variant D %3d %-36s %3d registers %.3f ms %6.1f TFLOP/s\n", D, v.name, fa.numRegs, ms,
               prods[v.kind] * unit / (ms * 1e-3) / 1e12);
    }
    bench_free(&a);
}

/* The library's shapes (fa90_cfg) through tm__fa90_forward / tm__fa90_backward, one kernel at a time. */
static void time_case(int B, int S, int Hq, int Hkv, int D, int iters) {
    tm__fa90_args a = bench_args(B, S, Hq, Hkv, D);
    char why[256];
    const double unit = (double)B * Hq * S * S * D; /* one product over the causal half: 2 B Hq S^2 D / 2 */
    const char *names[3] = {"forward", "dQ", "dK/dV"};
    const double prods[3] = {2, 3, 4};
    double total = 0;
    for (int which = 0; which < 3; which++) {
        tm__fa90_args c = a;
        if (which == 1) c.dk = c.dv = NULL;
        if (which == 2) c.dq = NULL;
        const double ms = time_ms(
            [&] { die(which == 0 ? tm__fa90_forward(&c, 0, why, sizeof why) : tm__fa90_backward(&c, 0, why, sizeof why), why); },
            iters);
        total += ms;
        printf("time B %d S %d Hq %d Hkv %d D %3d %-8s %.3f ms %6.1f TFLOP/s\n", B, S, Hq, Hkv, D, names[which], ms,
               prods[which] * unit / (ms * 1e-3) / 1e12);
    }
    printf("time B %d S %d Hq %d Hkv %d D %3d fwd+dq+dkv %.3f ms (Delta not included) %6.1f TFLOP/s\n", B, S, Hq, Hkv, D, total,
           9 * unit / (total * 1e-3) / 1e12);
    bench_free(&a);
}

int main(int argc, char **argv) {
    int check = 0, tm = 0, var = 0, B = 16, S = 1024, Hq = 12, Hkv = 4, iters = 30;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--check")) check = 1;
        else if (!strcmp(argv[i], "--time")) tm = 1;
        else if (!strcmp(argv[i], "--variants")) var = 1;
        else if (!strcmp(argv[i], "--B") && i + 1 < argc) B = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--S") && i + 1 < argc) S = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--Hq") && i + 1 < argc) Hq = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--Hkv") && i + 1 < argc) Hkv = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--check] [--time] [--variants] [--B n --S n --Hq n --Hkv n --iters n]\n", argv[0]);
            return 2;
        }
    }
    if (!check && !tm && !var) check = tm = 1;
    char why[256];
    if (!tm__fa90_supported(why, sizeof why)) {
        fprintf(stderr, "%s\n", why);
        return 1;
    }
    int bad = 0;
    if (check) {
        const int cases[][8] = {
            /* B, Tq, Tk, Hq, Hkv, D, fresh, dk=dv */
            {2, 200, 200, 4, 2, 64, 0, 0},  {2, 200, 200, 4, 2, 128, 1, 0}, {1, 130, 333, 3, 1, 64, 1, 0},
            {1, 130, 333, 3, 1, 128, 0, 0}, {2, 64, 64, 2, 2, 64, 1, 0},    {1, 257, 257, 6, 2, 128, 1, 1},
            {1, 1, 70, 2, 1, 64, 0, 0},     {1, 129, 129, 1, 1, 64, 0, 1},  {2, 128, 256, 4, 4, 128, 1, 0},
        };
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            const int *x = cases[c];
            bad += !check_case(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]);
        }
        printf("check: %s\n", bad ? "FAILED" : "all ok");
    }
    if (tm) {
        time_case(B, S, Hq, Hkv, 64, iters);
        time_case(B, S, Hq, Hkv, 128, iters);
    }
    if (var) {
        variants<64>(B, S, Hq, Hkv, iters);
        variants<128>(B, S, Hq, Hkv, iters);
    }
    return bad ? 1 : 0;
}
