/* footprint.c — the memory a configuration needs; see footprint.h. */
#include "footprint.h"

#include <unistd.h>

#include "util.h"

void tmd_footprint(const tmd_config *c, double *params, double *bytes) {
    const tm_model_config *m = &c->model;
    double H = m->d_model, V = m->vocab_size, L = m->n_layers, Ld = m->first_k_dense, Lm = L - Ld;
    double D = m->n_heads > 0 ? (double)(m->d_model / m->n_heads) : 0, Hq = m->n_heads * D, Hkv = m->n_kv_heads * D;
    double Fd = m->dense_ffn_size, E = m->moe.router.num_experts, F = m->moe.ffn_size, Fs = m->moe.shared_ffn_size;
    double p = V * H + H + (m->tie_embeddings ? 0 : H * V);          /* embed, norm, lm_head */
    p += L * (2 * H + H * Hq + 2 * H * Hkv + Hq * H);                 /* norms, wq, wk, wv, wo */
    p += Ld * 3 * H * Fd;                                             /* dense SwiGLU */
    p += Lm * (H * E + 3 * E * H * F + (Fs > 0 ? 3 * H * Fs : 0));    /* gate, experts, shared */
    double w = c->dtype == TMD_DTYPE_BF16 ? 2 : 4;
    double opt = c->optimizer == TMD_OPT_ADAMW ? 8 : c->sgd.momentum > 0 ? 4 : 0;
    if (c->dtype == TMD_DTYPE_BF16) opt += 4; /* f32 master weights */
    double logits = (double)c->batch_size * m->max_seq_len * V * 4;
    *params = p;
    *bytes = p * (2 * w + opt) + logits;
}

int tmd_footprint_check(const tmd_config *c, char *err, size_t errlen) {
    if (c->device != TMD_DEVICE_CPU) return 0;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return 0;
    double have = (double)pages * (double)page, params, need;
    tmd_footprint(c, &params, &need);
    if (need <= have) return 0;
    const double gib = 1024.0 * 1024.0 * 1024.0;
    return tmd_fail(err, errlen, -1,
                    "the configuration needs at least %.1f GiB (%.3g parameters with their gradients and optimizer "
                    "state, and the logits of a batch), more than this machine's %.1f GiB of memory: reduce "
                    "d_model, n_layers, num_experts, expert_ffn_size, vocab_size, batch_size or seq_len",
                    need / gib, params, have / gib);
}
