/*
 * copy.c — the CPU backend's untaped data movement: element conversion between dtypes, gather
 * of strided tensors, and the copy / accumulate / assign / fill entry points of the backend
 * table (framework/backend.h; contracts in internal.h under tm__copy_into and friends).
 *
 * Layout: tensors of up to 4 dims are walked as [a][b][c][d] with the trailing dimension
 * innermost (memcpy runs when it is unit-stride). Everything here is plain C on host memory;
 * the CUDA backend has the same entry points in kernels/cuda/copy.cu.
 */
#include "internal.h"


double tm__load_f64(const void *p, tm_dtype dt, int64_t i) {
    switch (dt) {
    case TM_F32: return ((const float *)p)[i];
    case TM_BF16: return tm__bf16_to_f32(((const uint16_t *)p)[i]);
    case TM_F64: return ((const double *)p)[i];
    case TM_I32: return ((const int32_t *)p)[i];
    case TM_I64: return (double)((const int64_t *)p)[i];
    case TM_U8: return ((const uint8_t *)p)[i];
    default: return 0;
    }
}

void tm__store_f64(void *p, tm_dtype dt, int64_t i, double v) {
    switch (dt) {
    case TM_F32: ((float *)p)[i] = (float)v; break;
    case TM_BF16: ((uint16_t *)p)[i] = tm__f32_to_bf16((float)v); break;
    case TM_F64: ((double *)p)[i] = v; break;
    case TM_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case TM_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    case TM_U8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    default: break;
    }
}

/* Convert n contiguous host elements. Integer->integer copies go through int64 so that
 * values beyond 2^53 are exact. */
void tm__convert_host(void *dst, tm_dtype ddt, const void *src, tm_dtype sdt, int64_t n, int nthreads) {
    if (ddt == sdt) {
        memcpy(dst, src, (size_t)n * tm_dtype_size(ddt));
        return;
    }
    /* bf16 <-> f32, the common pair (reading bf16 weights as f32, writing f32 into bf16), without
     * the per-element switch through f64 below, which ran at ~0.1 G elements/s: the same
     * functions, so the same bits (f32 -> bf16 rounds to nearest even). */
    if (sdt == TM_BF16 && ddt == TM_F32) {
        const uint16_t *s = src;
        float *d = dst;
#pragma omp parallel for num_threads(nthreads) if (n > 65536)
        for (int64_t i = 0; i < n; i++) d[i] = tm__bf16_to_f32(s[i]);
        return;
    }
    if (sdt == TM_F32 && ddt == TM_BF16) {
        const float *s = src;
        uint16_t *d = dst;
#pragma omp parallel for num_threads(nthreads) if (n > 65536)
        for (int64_t i = 0; i < n; i++) d[i] = tm__f32_to_bf16(s[i]);
        return;
    }
    int ints = !tm__is_float(ddt) && !tm__is_float(sdt);
#pragma omp parallel for num_threads(nthreads) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        if (ints) {
            int64_t v = sdt == TM_I32 ? ((const int32_t *)src)[i]
                      : sdt == TM_I64 ? ((const int64_t *)src)[i]
                                      : ((const uint8_t *)src)[i];
            if (ddt == TM_I32) ((int32_t *)dst)[i] = (int32_t)v;
            else if (ddt == TM_I64) ((int64_t *)dst)[i] = v;
            else ((uint8_t *)dst)[i] = (uint8_t)v;
        } else {
            tm__store_f64(dst, ddt, i, tm__load_f64(src, sdt, i));
        }
    }
}

/* Gather a strided CPU tensor into dense memory of the same dtype. */
void tm__round_bf16_host(tm_tensor *t) {
    float *p = tm__data(t);
    for (int64_t i = 0, n = tm__numel(t); i < n; i++) p[i] = tm__bf16_to_f32(tm__f32_to_bf16(p[i]));
}

void tm__gather_strided_host(const tm_tensor *t, void *dst) {
    size_t esz = tm_dtype_size(t->dtype);
    int64_t n = tm__numel(t);
    const char *base = (const char *)t->storage->data;
    int64_t shape[4] = {1, 1, 1, 1}, stride[4] = {0, 0, 0, 0};
    int off = 4 - t->ndim;
    for (int i = 0; i < t->ndim; i++) {
        shape[off + i] = t->shape[i];
        stride[off + i] = t->stride[i];
    }
    int64_t k = 0;
    for (int64_t a = 0; a < shape[0]; a++)
        for (int64_t b = 0; b < shape[1]; b++)
            for (int64_t c = 0; c < shape[2]; c++) {
                int64_t o = t->offset + a * stride[0] + b * stride[1] + c * stride[2];
                if (stride[3] == 1) {
                    memcpy((char *)dst + k * esz, base + o * esz, (size_t)shape[3] * esz);
                    k += shape[3];
                } else {
                    for (int64_t d = 0; d < shape[3]; d++, k++)
                        memcpy((char *)dst + k * esz, base + (o + d * stride[3]) * esz, esz);
                }
            }
    (void)n;
}


tm_status tm__cpu_fill(tm_ctx *ctx, tm_tensor *t, double value) {
    int64_t n = tm__numel(t);
    void *p = tm__data(t);
    for (int64_t i = 0; i < n; i++) tm__store_f64(p, t->dtype, i, value);
    return TM_OK;
}

tm_status tm__cpu_copy_into(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src) {
    int64_t n = tm__numel(dst);
    if (tm__is_contiguous(src)) {
        tm__convert_host(tm__data(dst), dst->dtype, tm__data(src), src->dtype, n, tm__nthreads(ctx));
        return TM_OK;
    }
    if (src->dtype == dst->dtype) {
        tm__gather_strided_host(src, tm__data(dst));
        return TM_OK;
    }
    void *tmp = tm__arena_alloc(ctx, tm_cpu(), (size_t)n * tm_dtype_size(src->dtype));
    if (!tmp) return TM_ERR_NOMEM;
    tm__gather_strided_host(src, tmp);
    tm__convert_host(tm__data(dst), dst->dtype, tmp, src->dtype, n, tm__nthreads(ctx));
    return TM_OK;
}

tm_status tm__cpu_accumulate(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, double alpha) {
    int64_t n = tm__numel(dst);
    const void *s = tm__data(src);
    tm_dtype sdt = src->dtype;
    if (!tm__is_contiguous(src)) {
        void *tmp = tm__arena_alloc(ctx, tm_cpu(), (size_t)n * tm_dtype_size(sdt));
        if (!tmp) return TM_ERR_NOMEM;
        tm__gather_strided_host(src, tmp);
        s = tmp;
    }
    void *d = tm__data(dst);
    if (dst->dtype == TM_F32 && sdt == TM_F32) {
        float *df = d;
        const float *sf = s;
        float a = (float)alpha;
#pragma omp parallel for num_threads(tm__nthreads(ctx)) if (n > 65536)
        for (int64_t i = 0; i < n; i++) df[i] += a * sf[i];
    } else {
#pragma omp parallel for num_threads(tm__nthreads(ctx)) if (n > 65536)
        for (int64_t i = 0; i < n; i++) tm__store_f64(d, dst->dtype, i, tm__load_f64(d, dst->dtype, i) + alpha * tm__load_f64(s, sdt, i));
    }
    return TM_OK;
}


tm_status tm__cpu_assign(tm_ctx *ctx, tm_tensor *dst, const tm_tensor *src, int accumulate, double alpha) {
    if (tm__is_contiguous(dst))
        return accumulate ? tm__cpu_accumulate(ctx, dst, src, alpha) : tm__cpu_copy_into(ctx, dst, src);
    int64_t shape[4] = {1, 1, 1, 1}, ds[4] = {0, 0, 0, 0}, ss[4] = {0, 0, 0, 0};
    int off = 4 - dst->ndim;
    for (int i = 0; i < dst->ndim; i++) {
        shape[off + i] = dst->shape[i];
        ds[off + i] = dst->stride[i];
        ss[off + i] = src->stride[i];
    }
    char *dp = dst->storage->data;
    const char *sp = src->storage->data;
    size_t dsz = tm_dtype_size(dst->dtype), ssz = tm_dtype_size(src->dtype);
    for (int64_t a = 0; a < shape[0]; a++)
        for (int64_t b = 0; b < shape[1]; b++)
            for (int64_t c = 0; c < shape[2]; c++) {
                int64_t od = dst->offset + a * ds[0] + b * ds[1] + c * ds[2];
                int64_t os = src->offset + a * ss[0] + b * ss[1] + c * ss[2];
                if (dst->dtype == src->dtype && !accumulate && ds[3] == 1 && ss[3] == 1) {
                    memcpy(dp + od * dsz, sp + os * ssz, (size_t)shape[3] * dsz);
                    continue;
                }
                for (int64_t d = 0; d < shape[3]; d++) {
                    double v = tm__load_f64(sp + (os + d * ss[3]) * ssz, src->dtype, 0);
                    void *q = dp + (od + d * ds[3]) * dsz;
                    if (accumulate) v = tm__load_f64(q, dst->dtype, 0) + alpha * v;
                    tm__store_f64(q, dst->dtype, 0, v);
                }
            }
    return TM_OK;
}
