/*
 * test_cuda_parity_cross_entropy.c — the model's cross-entropy on CUDA: tm__cross_entropy_unchecked
 * on bf16 logits gives an f32 loss and a bf16 gradient without any f32 copy of the (N, V)
 * logits (kernels/cuda/cross_entropy.cu, iattr[2]). Against the CPU (the generic bf16 cases of
 * tests/test_cuda_parity.c keep a bf16 loss), and bit for bit against the path it replaced in
 * tm_model_forward on CUDA: a cast of the logits to f32, then the cross-entropy.
 *
 * Tolerances (|cuda - cpu| <= atol + rtol * |cpu|): the loss atol 1e-5, rtol 1e-5 (f32 from the
 * same bf16 logits; the CPU adds the rows in f64, CUDA in f32); the bf16 gradient atol 1e-2,
 * rtol 1e-2 (a value near a rounding boundary may round to the neighbouring bf16). Skipped
 * without a GPU.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "extend.h"
#include "parity.h"

enum { CE_N = 33, CE_V = 5003 };

/* loss (f32) and the logits' gradient (bf16, as f64 and as raw bits) of one path on dev:
 * cast 1: cast the bf16 logits to f32 first. */
typedef struct ce_out {
    float loss;
    double *grad;
    uint16_t *bits;
} ce_out;

static void ce_run(tm_ctx *ctx, tm_device dev, tm_dtype tdt, int cast, ce_out *o) {
    int64_t xs[2] = {CE_N, CE_V}, n = CE_N;
    double *hx = tt_parity_uniform(CE_N * CE_V, 81), t[CE_N];
    for (int64_t i = 0; i < CE_N * CE_V; i++) hx[i] *= 4.0; /* logits in [-8, 8) */
    for (int64_t r = 0; r < CE_N; r++) t[r] = r % 5 == 3 ? -1 : (double)((r * 977) % CE_V);
    t[1] = CE_V - 1; /* the last class */
    tm_tensor *x, *tg, *loss, *l, *lg;
    TT_OK(ctx, tm_tensor_from_host(ctx, TM_BF16, 2, xs, dev, TM_F64, hx, &x));
    TT_OK(ctx, tm_tensor_from_host(ctx, tdt, 1, &n, dev, TM_F64, t, &tg));
    TT_OK(ctx, tm_tensor_set_requires_grad(ctx, x, 1));
    lg = x;
    if (cast) TT_OK(ctx, tm_cast(ctx, x, TM_F32, &lg));
    TT_OK(ctx, tm__cross_entropy_unchecked(ctx, lg, tg, -1, &loss));
    cr_assert_eq(tm_tensor_dtype(loss), TM_F32, "the loss of bf16 logits is f32");
    TT_OK(ctx, tm_scale(ctx, loss, 0.37, &l)); /* an upstream gradient other than 1 */
    TT_OK(ctx, tm_backward(ctx, l));
    TT_OK(ctx, tm_tensor_read(ctx, loss, TM_F32, &o->loss, 1));
    tm_tensor *g = tm_tensor_grad(x);
    cr_assert(g && tm_tensor_dtype(g) == TM_BF16, "the logits' gradient is bf16");
    o->grad = tt_read(ctx, g);
    o->bits = malloc(sizeof(uint16_t) * CE_N * CE_V);
    TT_OK(ctx, tm_tensor_read(ctx, g, TM_BF16, o->bits, CE_N * CE_V));
    free(hx);
}

static void ce_free(ce_out *o) { free(o->grad), free(o->bits); }

static void check(tm_dtype tdt) {
    tm_ctx *ctx = tt_parity_ctx();
    ce_out cpu, gpu, gpu_cast;
    ce_run(ctx, tm_cpu(), tdt, 0, &cpu);
    ce_run(ctx, tm_cuda(0), tdt, 0, &gpu);
    ce_run(ctx, tm_cuda(0), tdt, 1, &gpu_cast);
    cr_assert(fabs((double)gpu.loss - cpu.loss) <= 1e-5 + 1e-5 * fabs(cpu.loss), "loss %.9g on CUDA, %.9g on the CPU",
              gpu.loss, cpu.loss);
    double r = tt_close_ratio(gpu.grad, cpu.grad, CE_N * CE_V, 1e-2, 1e-2);
    cr_assert(r <= 1.0, "dlogits: CUDA differs from the CPU, ratio %g", r);
    cr_assert(memcmp(&gpu.loss, &gpu_cast.loss, sizeof gpu.loss) == 0, "loss %.9g, through an f32 cast %.9g", gpu.loss,
              gpu_cast.loss);
    int64_t bad = -1;
    for (int64_t i = 0; i < CE_N * CE_V && bad < 0; i++)
        if (gpu.bits[i] != gpu_cast.bits[i]) bad = i;
    cr_assert(bad < 0, "dlogits[%lld] = 0x%04x, through an f32 cast 0x%04x", (long long)bad,
              bad < 0 ? 0 : gpu.bits[bad], bad < 0 ? 0 : gpu_cast.bits[bad]);
    ce_free(&cpu), ce_free(&gpu), ce_free(&gpu_cast);
    tm_ctx_free(ctx);
}

Test(cuda_parity_cross_entropy, bf16_logits_f32_loss_i64_targets) {
    TT_SKIP_WITHOUT_CUDA();
    check(TM_I64);
}

Test(cuda_parity_cross_entropy, bf16_logits_f32_loss_i32_targets) {
    TT_SKIP_WITHOUT_CUDA();
    check(TM_I32);
}
