// attention_emu.cpp — host SIMT emulation of the tensor-core attention kernels of
// kernels/cuda/attention.cu (the section between "==== tensor-core path" and "==== end of
// tensor-core path", minus its PTX wrappers), for checking them on a machine without a GPU.
// Not part of the build or the test suite: run tests/emu/run.sh.
//
// Each CUDA thread is a ucontext coroutine; __syncthreads and warp collectives are barriers
// (a divergent collective or a deadlock is reported). ldmatrix (.trans), mma.sync m16n8k16 bf16
// and cp.async (deferred to the issuing thread's wait_group; src-size 0 zero-fills) are emulated
// from their PTX-documented semantics, not from the kernels' assumptions. Shared memory is
// shadowed per byte: uninitialised reads, reads of in-flight cp.async data, reads of data another
// thread's cp.async completed without a __syncthreads since, and cp.async writes over bytes
// another thread read in the same barrier interval are errors; so are accesses outside the
// launch's dynamic shared memory and cp.async reads outside every tensor.
//
// Checks per case: o, lse, dq, dk, dv against an exact reference in double from the same bf16
// inputs (atol = rtol = 1e-2, or the given tolerance in parity mode), and the gradients against a
// reference that applies the kernels' own bf16 roundings (P and dS as mma operands, Delta from the
// bf16 o) to one bf16 ulp; the latter can still differ where an intermediate dS lands on the other
// side of a bf16 rounding boundary (scale * ulp(dS) * |k|, ~0.016 for |dS| ~ 10).
//   run.sh                 the built-in cases (nonzero initial gradients, k as v, NULL gradients)
//   run.sh N               built-in case N only
//   run.sh parity B Tq Tk Hq Hkv D scale kv_shared atol rtol
//                          one case with the data of tests/test_cuda_parity_attention.c
//                          (tt_parity_uniform seeds, zero initial gradients); scale 0: 1/sqrt(D),
//                          kv_shared 1: k passed as v
// AWARE=1 / AWARE=2 (environment) keep only the bf16 rounding of P, dS / only Delta from o in the
// rounding-aware reference, to see which one dominates.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <vector>
#include <ucontext.h>

// ---- bf16 -----------------------------------------------------------------------------------------
struct tm__bf16 {
    uint16_t x;
};
static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    uint32_t r = 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((u + r) >> 16);
}
static inline float tm__ld(const tm__bf16 *p) { return bf2f(p->x); }
static inline float tm__ld(const float *p) { return *p; }
static inline void tm__st(tm__bf16 *p, float v) { p->x = f2bf(v); }

// ---- CUDA keywords ----------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__
struct emu_uint3 {
    unsigned x, y, z;
};
struct EmuThread;
static EmuThread *emu_cur;
static emu_uint3 blockIdx, blockDim, gridDim;
static const emu_uint3 &emu_tid();
#define threadIdx (emu_tid())

alignas(16) unsigned char fa_smem[256 * 1024];
static size_t emu_smem_bytes;

// ---- runtime ------------------------------------------------------------------------------------------
struct Copy {
    size_t soff;
    const void *g;
    int size, bytes;
};
struct EmuThread {
    ucontext_t uc;
    emu_uint3 tid;
    int state; // 0 runnable, 1 at __syncthreads, 2 at a warp collective, 3 exited
    int tag;
    std::vector<Copy> cur;
    std::deque<std::vector<Copy>> groups;
};
enum { MAXT = 128 };
static EmuThread thr[MAXT];
static char *stacks[MAXT];
static const size_t STACK = 256 * 1024;
static ucontext_t sched_uc;
static std::function<void()> emu_body;
static int emu_nthreads, emu_epoch;
static const char *emu_kernel = "";
static long emu_errors;
static const emu_uint3 &emu_tid() { return emu_cur->tid; }

#define EMU_ERR(...)                                                                                      \
    do {                                                                                                  \
        if (emu_errors++ < 20) {                                                                          \
            fprintf(stderr, "[%s block %u thread %u] ", emu_kernel, blockIdx.x, emu_cur ? emu_cur->tid.x : 0); \
            fprintf(stderr, __VA_ARGS__);                                                                 \
            fprintf(stderr, "\n");                                                                        \
        }                                                                                                 \
    } while (0)

// shadow of shared memory, per byte
struct Shadow {
    int8_t written, pending;
    int16_t writer;
    int complete_epoch, r_epoch;
    int16_t r_tid;
};
static std::vector<Shadow> shadow(sizeof fa_smem);

static void yield_to_sched() { swapcontext(&emu_cur->uc, &sched_uc); }

void __syncthreads() {
    emu_cur->state = 1;
    yield_to_sched();
}
static void warp_bar(int tag) {
    emu_cur->state = 2;
    emu_cur->tag = tag;
    yield_to_sched();
}

static size_t smem_off(const void *s, int size, const char *what) {
    const unsigned char *p = (const unsigned char *)s;
    if (p < fa_smem || p + size > fa_smem + emu_smem_bytes) {
        EMU_ERR("%s: shared address %p outside [0, %zu) (offset %ld)", what, s, emu_smem_bytes, (long)(p - fa_smem));
        return (size_t)-1;
    }
    size_t o = (size_t)(p - fa_smem);
    if (o % (size_t)size != 0 && size <= 16) EMU_ERR("%s: shared offset %zu not %d-aligned", what, o, size);
    return o;
}
static void shadow_read(size_t o, int n, const char *what) {
    const int me = (int)emu_cur->tid.x;
    for (int i = 0; i < n; i++) {
        Shadow &s = shadow[o + i];
        if (s.pending) {
            EMU_ERR("%s: reads shared byte %zu while a cp.async to it is in flight (writer %d)", what, o + i, s.writer);
            return;
        }
        if (!s.written) {
            EMU_ERR("%s: reads uninitialised shared byte %zu", what, o + i);
            return;
        }
        if (s.writer != me && s.complete_epoch >= emu_epoch) {
            EMU_ERR("%s: reads shared byte %zu completed by thread %d without a barrier since", what, o + i, s.writer);
            return;
        }
        if (s.r_epoch == emu_epoch && s.r_tid != me)
            s.r_tid = -2;
        else if (s.r_epoch != emu_epoch)
            s.r_epoch = emu_epoch, s.r_tid = (int16_t)me;
    }
}
static void shadow_async_write(size_t o, int n, const char *what) {
    const int me = (int)emu_cur->tid.x;
    for (int i = 0; i < n; i++) {
        Shadow &s = shadow[o + i];
        if (s.pending) {
            EMU_ERR("%s: cp.async to shared byte %zu already in flight (writer %d)", what, o + i, s.writer);
            return;
        }
        if (s.r_epoch == emu_epoch && s.r_tid != me) {
            EMU_ERR("%s: cp.async overwrites shared byte %zu read by thread %d in the same barrier interval", what, o + i, s.r_tid);
            return;
        }
        s.pending = 1;
        s.writer = (int16_t)me;
    }
}

// global allocations that cp.async may read
struct Alloc {
    const void *p;
    size_t n;
};
static std::vector<Alloc> allocs;
static void check_global(const void *g, int n) {
    for (auto &a : allocs)
        if ((const char *)g >= (const char *)a.p && (const char *)g + n <= (const char *)a.p + a.n) return;
    EMU_ERR("cp.async reads global %p (+%d) outside every tensor", g, n);
}

static void cp_async(void *s, const void *g, int size, int bytes) {
    size_t o = smem_off(s, size, "cp.async");
    if (o == (size_t)-1) return;
    if (bytes != 0 && bytes != size) EMU_ERR("cp.async src-size %d", bytes);
    if (bytes) {
        check_global(g, bytes);
        if ((uintptr_t)g % (uintptr_t)size) EMU_ERR("cp.async global %p not %d-aligned", g, size);
    }
    shadow_async_write(o, size, "cp.async");
    emu_cur->cur.push_back(Copy{o, g, size, bytes});
}
void fa_cp16(void *s, const void *g, int bytes) { cp_async(s, g, 16, bytes); }
void fa_cp4(void *s, const void *g, int bytes) { cp_async(s, g, 4, bytes); }
void fa_commit(void) {
    emu_cur->groups.push_back(emu_cur->cur);
    emu_cur->cur.clear();
}
static void emu_wait(int n) {
    while ((int)emu_cur->groups.size() > n) {
        for (const Copy &c : emu_cur->groups.front()) {
            if (c.bytes)
                memcpy(fa_smem + c.soff, c.g, (size_t)c.size);
            else
                memset(fa_smem + c.soff, 0, (size_t)c.size);
            for (int i = 0; i < c.size; i++) {
                Shadow &s = shadow[c.soff + i];
                s.pending = 0, s.written = 1, s.writer = (int16_t)emu_cur->tid.x, s.complete_epoch = emu_epoch;
            }
        }
        emu_cur->groups.pop_front();
    }
}
template <int N> void fa_wait(void) { emu_wait(N); }

struct WX {
    uint32_t u[32][10];
    const void *ptr[32];
    float f[32];
};
static WX wx[MAXT / 32];

float __shfl_xor_sync(unsigned mask, float v, int o) {
    if (mask != 0xffffffffu) EMU_ERR("shfl mask %x", mask);
    const int lane = emu_cur->tid.x & 31, w = emu_cur->tid.x >> 5;
    wx[w].f[lane] = v;
    warp_bar(1);
    float r = wx[w].f[lane ^ o];
    warp_bar(2);
    return r;
}

static uint16_t smem_h(const void *row, int col) {
    uint16_t h;
    memcpy(&h, (const unsigned char *)row + 2 * col, 2);
    return h;
}
static void ldsm(uint32_t (&r)[4], const void *s, bool trans) {
    const int lane = emu_cur->tid.x & 31, w = emu_cur->tid.x >> 5;
    size_t o = smem_off(s, 16, "ldmatrix");
    if (o != (size_t)-1) shadow_read(o, 16, "ldmatrix");
    wx[w].ptr[lane] = s;
    warp_bar(3);
    const int g = lane >> 2, t = lane & 3;
    for (int m = 0; m < 4; m++) {
        uint16_t lo, hi;
        if (!trans) {
            const void *row = wx[w].ptr[8 * m + g];
            lo = smem_h(row, 2 * t), hi = smem_h(row, 2 * t + 1);
        } else {
            lo = smem_h(wx[w].ptr[8 * m + 2 * t], g), hi = smem_h(wx[w].ptr[8 * m + 2 * t + 1], g);
        }
        r[m] = (uint32_t)lo | (uint32_t)hi << 16;
    }
    warp_bar(4);
}
void fa_ldsm4(uint32_t (&r)[4], const void *s) { ldsm(r, s, false); }
void fa_ldsm4t(uint32_t (&r)[4], const void *s) { ldsm(r, s, true); }

static float half_of(uint32_t u, int h) { return bf2f((uint16_t)(h ? u >> 16 : u & 0xffff)); }
void fa_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    const int lane = emu_cur->tid.x & 31, w = emu_cur->tid.x >> 5;
    uint32_t *u = wx[w].u[lane];
    for (int i = 0; i < 4; i++) u[i] = a[i];
    u[4] = b0, u[5] = b1;
    warp_bar(5);
    const int g = lane >> 2, t = lane & 3;
    float out[4];
    for (int q = 0; q < 4; q++) {
        const int r = g + (q >= 2 ? 8 : 0), n = 2 * t + (q & 1);
        float acc = 0.0f;
        for (int k = 0; k < 16; k++) {
            const int ar = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), al = (r % 8) * 4 + (k % 8) / 2;
            const int br = 4 + (k >= 8 ? 1 : 0), bl = n * 4 + (k % 8) / 2;
            acc += half_of(wx[w].u[al][ar], k & 1) * half_of(wx[w].u[bl][br], k & 1);
        }
        out[q] = d[q] + acc;
    }
    warp_bar(6);
    for (int q = 0; q < 4; q++) d[q] = out[q];
}
uint32_t fa_pack(float lo, float hi) { return (uint32_t)f2bf(lo) | (uint32_t)f2bf(hi) << 16; }
float fa_lds(const float *s) {
    size_t o = smem_off(s, 4, "lds");
    if (o == (size_t)-1) return NAN;
    shadow_read(o, 4, "lds");
    return *s;
}

static void trampoline() {
    emu_body();
    if (!emu_cur->cur.empty() || !emu_cur->groups.empty()) EMU_ERR("exits with cp.async in flight");
    emu_cur->state = 3;
}

static void run_block(unsigned bx, int nthreads) {
    blockIdx = {bx, 0, 0};
    emu_nthreads = nthreads;
    emu_epoch = 0;
    memset(fa_smem, 0xff, sizeof fa_smem); // bf16 NaN everywhere: stale data shows
    std::fill(shadow.begin(), shadow.end(), Shadow{0, 0, -1, -1, -1, -1});
    for (int t = 0; t < nthreads; t++) {
        EmuThread &T = thr[t];
        getcontext(&T.uc);
        T.uc.uc_stack.ss_sp = stacks[t];
        T.uc.uc_stack.ss_size = STACK;
        T.uc.uc_link = &sched_uc;
        makecontext(&T.uc, trampoline, 0);
        T.tid = {(unsigned)t, 0, 0};
        T.state = 0;
        T.cur.clear();
        T.groups.clear();
    }
    for (;;) {
        bool any = false;
        for (int t = 0; t < nthreads; t++)
            if (thr[t].state == 0) {
                emu_cur = &thr[t];
                swapcontext(&sched_uc, &thr[t].uc);
                any = true;
            }
        emu_cur = nullptr;
        for (int w = 0; w < nthreads / 32; w++) {
            int at = 0, other = 0, tag = -1;
            bool tagok = true;
            for (int l = 0; l < 32; l++) {
                EmuThread &T = thr[w * 32 + l];
                if (T.state == 2) {
                    if (tag < 0) tag = T.tag;
                    tagok &= T.tag == tag;
                    at++;
                } else if (T.state != 0)
                    other++;
            }
            if (at == 32) {
                if (!tagok) EMU_ERR("warp %d: lanes at different collectives", w);
                for (int l = 0; l < 32; l++) thr[w * 32 + l].state = 0;
                any = true;
            } else if (at > 0 && other > 0) {
                EMU_ERR("warp %d: divergent collective (%d lanes at it, %d elsewhere)", w, at, other);
                return;
            }
        }
        int nb = 0, nd = 0;
        for (int t = 0; t < nthreads; t++) nb += thr[t].state == 1, nd += thr[t].state == 3;
        if (nb > 0 && nb + nd == nthreads) {
            if (nd > 0) EMU_ERR("__syncthreads with %d exited threads", nd);
            for (int t = 0; t < nthreads; t++)
                if (thr[t].state == 1) thr[t].state = 0;
            emu_epoch++;
            any = true;
        }
        if (nd == nthreads) break;
        if (!any) {
            EMU_ERR("deadlock (%d at __syncthreads, %d exited)", nb, nd);
            return;
        }
    }
}

template <typename F> static void launch(const char *name, int64_t grid, size_t smem, F body) {
    emu_kernel = name;
    emu_smem_bytes = smem;
    if (smem > sizeof fa_smem) {
        fprintf(stderr, "%s: smem %zu too big\n", name, smem);
        exit(1);
    }
    gridDim = {(unsigned)grid, 1, 1};
    blockDim = {128, 1, 1};
    emu_body = body;
    for (int64_t b = 0; b < grid; b++) run_block((unsigned)b, 128);
}

// ---- the kernels ---------------------------------------------------------------------------------------
#include "fa_kernels.inc"

// ---- test driver ------------------------------------------------------------------------------------------
static uint64_t rng_state;
static double urand() {
    rng_state += 0x9e3779b97f4a7c15ull;
    uint64_t z = rng_state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}
static bool parity_mode;
static uint64_t parity_seed;
static tm__bf16 *bf_alloc(int64_t n, double lo, double hi, std::vector<double> &host) {
    if (parity_mode && hi > lo) rng_state = parity_seed; // tt_parity_uniform(n, seed)
    if (parity_mode && hi == 0.5) lo = hi = 0;           // gradients start at zero
    tm__bf16 *p = (tm__bf16 *)malloc(sizeof(tm__bf16) * (size_t)(n ? n : 1));
    host.resize((size_t)n);
    for (int64_t i = 0; i < n; i++) {
        p[i].x = f2bf((float)(lo + (hi - lo) * urand()));
        host[(size_t)i] = bf2f(p[i].x);
    }
    allocs.push_back({p, sizeof(tm__bf16) * (size_t)n});
    return p;
}

struct Case {
    int B, Tq, Tk, Hq, Hkv, D;
    float scale; // <= 0: 1/sqrt(D)
    bool kv_shared, need_dq, need_dk, need_dv;
    double atol = 1e-2, rtol = 1e-2; // parity mode
};

static double worst(const char *what, const std::vector<double> &got, const std::vector<double> &ref, double atol, double rtol) {
    double r = 0, maxabs = 0;
    size_t at = 0;
    for (size_t i = 0; i < got.size(); i++) {
        double e = fabs(got[i] - ref[i]);
        if (!(e == e)) e = INFINITY;
        double q = e / (atol + rtol * fabs(ref[i]));
        if (q > r || q != q) r = q, at = i;
        if (e > maxabs) maxabs = e;
    }
    double se = 0, sr = 0;
    for (size_t i = 0; i < got.size(); i++) se += (got[i] - ref[i]) * (got[i] - ref[i]), sr += ref[i] * ref[i];
    printf("    %-4s rms err/rms ref %.2e (rms ref %.3g)", what, sqrt(se / (sr + 1e-300)), sqrt(sr / (got.size() + 1e-300)));
    printf("    %-4s max|err| %.3g  worst ratio %.3f (at %zu: got %.6g ref %.6g)%s\n", what, maxabs, r, at,
           got.empty() ? 0 : got[at], ref.empty() ? 0 : ref[at], r <= 1.0 ? "" : "   <-- FAIL");
    return r;
}

template <int D> static bool run_case(const Case &cs) {
    const int B = cs.B, Tq = cs.Tq, Tk = cs.Tk, Hq = cs.Hq, Hkv = cs.Hkv, G = Hq / Hkv, off = Tk - Tq;
    const float scale = cs.scale > 0 ? cs.scale : (float)(1.0 / sqrt((double)D));
    printf("case B %d Tq %d Tk %d Hq %d Hkv %d D %d scale %g%s%s%s%s\n", B, Tq, Tk, Hq, Hkv, D, scale,
           cs.kv_shared ? " k-as-v" : "", cs.need_dq ? "" : " no-dq", cs.need_dk ? "" : " no-dk", cs.need_dv ? "" : " no-dv");
    allocs.clear();
    const int64_t nq = (int64_t)B * Tq * Hq * D, nk = (int64_t)B * Tk * Hkv * D, nl = (int64_t)B * Hq * Tq;
    std::vector<double> hq, hk, hv, hdo, hdq0, hdk0, hdv0, dummy;
    parity_seed = 1000 + (uint64_t)nq;
    tm__bf16 *q = bf_alloc(nq, -2, 2, hq);
    parity_seed = 1000 + 17 + (uint64_t)nk;
    tm__bf16 *k = bf_alloc(nk, -2, 2, hk);
    parity_seed = 1000 + 34 + (uint64_t)nk;
    tm__bf16 *v = cs.kv_shared ? k : bf_alloc(nk, -2, 2, hv);
    if (cs.kv_shared) hv = hk;
    parity_seed = 77;
    tm__bf16 *dout = bf_alloc(nq, -2, 2, hdo);
    tm__bf16 *out = bf_alloc(nq, 0, 0, dummy);
    for (int64_t i = 0; i < nq; i++) out[i].x = 0x7fc0; // NaN: unwritten shows
    tm__bf16 *dq = bf_alloc(nq, -0.5, 0.5, hdq0), *dk = bf_alloc(nk, -0.5, 0.5, hdk0);
    tm__bf16 *dv = cs.kv_shared ? dk : bf_alloc(nk, -0.5, 0.5, hdv0);
    float *lse = (float *)malloc(sizeof(float) * (size_t)nl), *delta = (float *)malloc(sizeof(float) * (size_t)nl);
    for (int64_t i = 0; i < nl; i++) lse[i] = NAN, delta[i] = NAN;
    allocs.push_back({lse, sizeof(float) * (size_t)nl});
    allocs.push_back({delta, sizeof(float) * (size_t)nl});

    fa_params p = fa_params_make(B, Tq, Tk, Hq, Hkv, D, scale);
    p.q = q, p.k = k, p.v = v, p.out = out, p.lse = lse;
    emu_errors = 0;
    launch("fwd", fa_grid_q(&p), fa_smem_fwd(D), [&] { fa_forward_kernel<D>(p); });
    p.o = out, p.dout = dout, p.delta = delta;
    p.dq = cs.need_dq ? dq : nullptr;
    p.dk = cs.need_dk ? dk : nullptr;
    p.dv = cs.need_dv ? dv : nullptr;
    launch("delta", fa_grid_delta(&p), 0, [&] { fa_delta_kernel(p); });
    if (p.dq) launch("dq", fa_grid_q(&p), fa_smem_dq(D), [&] { fa_backward_dq_kernel<D>(p); });
    constexpr int BQ = fa_cfg<D>::BQ;
    if (p.dk || p.dv) launch("dkv", fa_grid_kv(&p), fa_smem_dkv(D, BQ), [&] { fa_backward_dkv_kernel<D, BQ>(p); });

    // reference in double
    std::vector<double> ro((size_t)nq), rl((size_t)nl), rdq = hdq0, rdk = hdk0, rdv = cs.kv_shared ? hdk0 : hdv0;
    std::vector<double> P(Tk), dP(Tk);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++) {
            const int hk_ = h / G;
            for (int i = 0; i < Tq; i++) {
                const int n = i + off + 1;
                const double *qi = &hq[(((size_t)b * Tq + i) * Hq + h) * D], *gi = &hdo[(((size_t)b * Tq + i) * Hq + h) * D];
                double m = -INFINITY;
                for (int j = 0; j < n; j++) {
                    const double *kj = &hk[(((size_t)b * Tk + j) * Hkv + hk_) * D];
                    double s = 0;
                    for (int x = 0; x < D; x++) s += qi[x] * kj[x];
                    P[j] = s * scale;
                    m = fmax(m, P[j]);
                }
                double l = 0;
                for (int j = 0; j < n; j++) l += (P[j] = exp(P[j] - m));
                for (int j = 0; j < n; j++) P[j] /= l;
                rl[((size_t)b * Hq + h) * Tq + i] = m + log(l);
                double *oi = &ro[(((size_t)b * Tq + i) * Hq + h) * D];
                for (int x = 0; x < D; x++) oi[x] = 0;
                double Dl = 0;
                for (int j = 0; j < n; j++) {
                    const double *vj = &hv[(((size_t)b * Tk + j) * Hkv + hk_) * D];
                    double t = 0;
                    for (int x = 0; x < D; x++) oi[x] += P[j] * vj[x], t += gi[x] * vj[x];
                    dP[j] = t;
                    Dl += P[j] * t;
                }
                for (int j = 0; j < n; j++) {
                    const double ds = P[j] * (dP[j] - Dl);
                    const size_t ko = (((size_t)b * Tk + j) * Hkv + hk_) * D;
                    for (int x = 0; x < D; x++) {
                        if (cs.need_dq) rdq[(((size_t)b * Tq + i) * Hq + h) * D + x] += scale * ds * hk[ko + x];
                        if (cs.need_dk) rdk[ko + x] += scale * ds * qi[x];
                        if (cs.need_dv) (cs.kv_shared ? rdk : rdv)[ko + x] += P[j] * gi[x];
                    }
                }
            }
        }
    // rounding-aware reference of the gradients: P from the kernel's lse, Delta from its bf16 O,
    // bf16 P (dv) and bf16 dS (dq, dk), as the tensor-core path computes them
    std::vector<double> adq = hdq0, adk = hdk0, adv = cs.kv_shared ? hdk0 : hdv0;
    const int mode = getenv("AWARE") ? atoi(getenv("AWARE")) : 3; // bit 0: bf16 P, dS; bit 1: Delta from bf16 O
    auto rb0 = [](double x) { return (double)bf2f(f2bf((float)x)); };
    auto rb = [&](double x) { return (mode & 1) ? rb0(x) : x; };
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++) {
            const int hk_ = h / G;
            for (int i = 0; i < Tq; i++) {
                const int n = i + off + 1;
                const size_t qo = (((size_t)b * Tq + i) * Hq + h) * D;
                const double *qi = &hq[qo], *gi = &hdo[qo];
                const double L = lse[((size_t)b * Hq + h) * Tq + i];
                double Dl = 0;
                if (mode & 2)
                    for (int x = 0; x < D; x++) Dl += bf2f(out[qo + x].x) * gi[x];
                else
                    for (int j = 0; j < n; j++) {
                        const size_t ko = (((size_t)b * Tk + j) * Hkv + hk_) * D;
                        double s = 0, t = 0;
                        for (int x = 0; x < D; x++) s += qi[x] * hk[ko + x], t += gi[x] * hv[ko + x];
                        Dl += exp(s * scale - L) * t;
                    }
                for (int j = 0; j < n; j++) {
                    const size_t ko = (((size_t)b * Tk + j) * Hkv + hk_) * D;
                    double s = 0, t = 0;
                    for (int x = 0; x < D; x++) s += qi[x] * hk[ko + x], t += gi[x] * hv[ko + x];
                    const double pr = exp(s * scale - L), ds = rb(pr * (t - Dl)), pb = rb(pr);
                    for (int x = 0; x < D; x++) {
                        if (cs.need_dq) adq[qo + x] += scale * ds * hk[ko + x];
                        if (cs.need_dk) adk[ko + x] += scale * ds * qi[x];
                        if (cs.need_dv) (cs.kv_shared ? adk : adv)[ko + x] += pb * gi[x];
                    }
                }
            }
        }
    for (auto *vv : {&adq, &adk, &adv})
        for (auto &x : *vv) x = rb0(x);
    auto tovec = [](const tm__bf16 *p, int64_t n) {
        std::vector<double> r((size_t)n);
        for (int64_t i = 0; i < n; i++) r[(size_t)i] = bf2f(p[i].x);
        return r;
    };
    std::vector<double> gl((size_t)nl);
    for (int64_t i = 0; i < nl; i++) gl[(size_t)i] = lse[i];
    double r = 0;
    const double at = parity_mode ? cs.atol : 1e-2, rt = parity_mode ? cs.rtol : 1e-2;
    printf("  against the exact reference (atol %g, rtol %g):\n", at, rt);
    r = fmax(r, worst("o", tovec(out, nq), ro, at, rt));
    r = fmax(r, worst("lse", gl, rl, 1e-3, 1e-3));
    r = fmax(r, worst("dq", tovec(dq, nq), rdq, at, rt));
    r = fmax(r, worst("dk", tovec(dk, nk), rdk, at, rt));
    if (!cs.kv_shared) r = fmax(r, worst("dv", tovec(dv, nk), rdv, at, rt));
    printf("  against the rounding-aware reference (atol 1e-3, rtol 8e-3: one bf16 ulp):\n");
    double ra = 0;
    ra = fmax(ra, worst("dq", tovec(dq, nq), adq, 1e-3, 8e-3));
    ra = fmax(ra, worst("dk", tovec(dk, nk), adk, 1e-3, 8e-3));
    if (!cs.kv_shared) ra = fmax(ra, worst("dv", tovec(dv, nk), adv, 1e-3, 8e-3));
    bool ok = r <= 1.0 && ra <= 1.0 && emu_errors == 0;
    if (emu_errors) printf("    %ld emulator errors\n", emu_errors);
    printf("  %s\n", ok ? "ok" : "FAILED");
    for (auto &a : allocs)
        if (a.p != (const void *)lse && a.p != (const void *)delta) free((void *)a.p);
    free(lse), free(delta);
    return ok;
}

int main(int argc, char **argv) {
    for (int t = 0; t < MAXT; t++) stacks[t] = (char *)malloc(STACK);
    const int which = argc > 1 ? atoi(argv[1]) : -1;
    //                B   Tq   Tk  Hq Hkv  D   scale kv    dq    dk    dv
    const Case cases[] = {
        {2, 100, 100, 6, 2, 64, 0, false, true, true, true},
        {2, 100, 100, 6, 2, 128, 0, false, true, true, true},
        {2, 1, 130, 6, 2, 64, 0, false, true, true, true},
        {2, 37, 130, 6, 2, 128, 0, false, true, true, true},
        {1, 64, 64, 2, 2, 64, 0, false, true, true, true},
        {1, 200, 200, 2, 1, 64, 0.3f, false, true, true, true},
        {1, 33, 70, 4, 2, 64, 0, true, true, true, true},
        {1, 70, 135, 3, 3, 128, 0, false, true, true, true},
        {1, 37, 130, 4, 2, 128, 0, false, false, true, false},
        {1, 37, 130, 4, 2, 64, 0, false, true, false, true},
        {2, 1, 130, 6, 2, 128, 0, false, true, true, true},
        {1, 129, 129, 1, 1, 128, 0.2f, true, true, true, true},
    };
    // parity mode: the data of tests/test_cuda_parity_attention.c (argv[2] = atol, argv[3] = rtol)
    if (argc > 4 && strcmp(argv[1], "parity") == 0) {
        parity_mode = true;
        Case c = {atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6]), atoi(argv[7]),
                  (float)atof(argv[8]), atoi(argv[9]) != 0, true, true, true, atof(argv[10]), atof(argv[11])};
        bool ok = c.D == 64 ? run_case<64>(c) : run_case<128>(c);
        return !ok;
    }
    const int n = (int)(sizeof cases / sizeof cases[0]);
    int fails = 0;
    for (int c = 0; c < n; c++) {
        if (which >= 0 && c != which) continue;
        rng_state = 1234 + (uint64_t)c;
        bool ok = cases[c].D == 64 ? run_case<64>(cases[c]) : run_case<128>(cases[c]);
        fails += !ok;
    }
    printf("%s (%d failed)\n", fails ? "FAILED" : "all ok", fails);
    return fails != 0;
}
