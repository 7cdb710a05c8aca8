/* footprint.c — the memory a configuration needs; see footprint.h. */
#include "footprint.h"

#include <unistd.h>

#include "util.h"

/* The model and optimizer built in a plan-only context (tinymoe.h, tm_ctx_options.plan_only):
 * the library's own placement, counted, without memory. A configuration the library refuses
 * counts 0 here (its own check, later, names the key). */
void tmd_footprint(const tmd_config *c, double *params, double *bytes) {
    *params = *bytes = 0;
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    o.plan_only = 1;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) return;
    tm_model *m = NULL;
    tm_optimizer *opt = NULL;
    tm_memory_report mr;
    if (!tm_model_new(ctx, &c->model, c->dtype == TMD_DTYPE_BF16 ? TM_BF16 : TM_F32, tm_cpu(), &m)) {
        /* (an optimizer the library refuses is left out: the estimate stays a lower bound) */
        if (c->optimizer == TMD_OPT_ADAMW) (void)tm_adamw_new(ctx, &c->adamw, &opt);
        else (void)tm_sgd_new(ctx, &c->sgd, &opt);
        if (!tm_ctx_memory_report(ctx, tm_cpu(), &mr)) {
            *params = (double)tm_model_num_params(m, NULL);
            /* and the f32 logits of one micro-batch */
            *bytes = (double)mr.total + (double)c->batch_size * c->model.max_seq_len * c->model.vocab_size * 4;
        }
    }
    tm_optimizer_free(opt);
    tm_model_free(m);
    tm_ctx_free(ctx);
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
