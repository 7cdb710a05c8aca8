/*
 * footprint.h — the memory a training configuration needs, estimated from its keys before
 * anything is allocated.
 *
 * Every size key is bounded (config.c), but their products are not: d_model 65536 with 10000
 * layers is within every range and would ask for petabytes. The estimate counts what is
 * certain to be allocated: the parameters (as layers/model.c and layers/moe.c make them), their
 * gradients, the optimizer state (AdamW m and v, SGD momentum, f32 master weights
 * of bf16 models) and the logits of one micro-batch; activations come on top, so it is a lower
 * bound. The counts are the library's own: the model and optimizer are built in a plan-only
 * context (tinymoe.h, tm_ctx_options.plan_only), which places everything and allocates nothing.
 * On the CPU a configuration whose estimate exceeds the machine's physical memory is
 * refused, naming the keys that size it, instead of failing (or being killed by the kernel's
 * OOM killer) after the data is loaded.
 */
#ifndef TMD_FOOTPRINT_H
#define TMD_FOOTPRINT_H

#include <stddef.h>

#include "config.h"

/* Parameters of the model cfg describes (after tmd_config_resolve), and the bytes above. In
 * doubles: no product of key values can overflow. */
void tmd_footprint(const tmd_config *cfg, double *params, double *bytes);

/* 0, or -1 with a message naming the keys when the estimate exceeds the physical memory of
 * this machine (device cpu only). */
int tmd_footprint_check(const tmd_config *cfg, char *err, size_t errlen);

#endif
