/* config.c — the key table and its parser, printer and checks; see config.h. */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "footprint.h"
#include "markov.h"
#include "util.h"

/* Enum keys store the index of the value in their `values` list, straight into the library's
 * enum fields: these orders must match the enums. */
_Static_assert(TM_SCORE_SOFTMAX == 0 && TM_SCORE_SIGMOID == 1, "score_function order");
_Static_assert(TM_AUX_COUNTS_ROUTED == 0 && TM_AUX_COUNTS_CLEAN == 1, "aux_counts order");
_Static_assert(TM_DROP_PROBS == 0 && TM_DROP_POSITION == 1, "drop_policy order");
_Static_assert(TM_MOE_GROUPED == 0 && TM_MOE_DENSE == 1, "moe_strategy order");
_Static_assert(TM_LR_CONSTANT == 0 && TM_LR_COSINE == 1 && TM_LR_LINEAR == 2 && TM_LR_WSD == 3, "lr_schedule order");
_Static_assert(TM_EP_ALLTOALL == 0 && TM_EP_ALLGATHER == 1 && TM_EP_ALLTOALL_DEDUP == 2 &&
                   sizeof(tm_ep_strategy) == sizeof(int),
               "ep_strategy order");
_Static_assert(TM_CPU_GEMM_AUTO == 0 && TM_CPU_GEMM_BUILTIN == 1, "cpu_gemm order");
_Static_assert(TM_GROUPED_GEMM_CUBLASLT == 0 && TM_GROUPED_GEMM_DEVICE == 1 && TM_GROUPED_GEMM_HOPPER == 2,
               "grouped_gemm order");
_Static_assert(TM_NCCL_AUTO == 0 && TM_NCCL_OFF == 1 && TM_NCCL_ALWAYS == 2, "nccl order");
_Static_assert(sizeof(tm_score_function) == sizeof(int) && sizeof(tm_aux_counts) == sizeof(int) &&
                   sizeof(tm_drop_policy) == sizeof(int) && sizeof(tm_moe_strategy) == sizeof(int) &&
                   sizeof(tm_lr_kind) == sizeof(int),
               "enum keys are stored through int");

typedef enum { T_INT, T_I64, T_FLOAT, T_BOOL, T_STR, T_ENUM } key_type;
typedef enum { G_MODEL, G_MOE, G_OPTIM, G_SCHED, G_TRAIN, G_DATA, G_RUN, G_DIST, G_COUNT } key_group;

// clang-format off
static const char *const GROUP_TITLE[G_COUNT] = {
    "model (tm_model_config)",        "mixture of experts (tm_moe_config, tm_router_config)",
    "optimizer",                      "learning-rate schedule (tm_lr_schedule)",
    "training",                       "data",
    "run: evaluation, logging, output, sampling",
    "distributed (mpirun -np N tinymoe train ...; the layout may change on resume)",
};
// clang-format on

/* Keys accepting "auto": stored as 0 (ints) or NaN (floats) until tmd_config_resolve. */
enum { AUTO_OK = 1 };

typedef struct key {
    const char *name;
    key_type type;
    key_group group;
    size_t offset, size; /* size: the string buffer (T_STR) */
    const char *values;  /* T_ENUM: "a|b|c", stored as the index */
    const char *def;     /* the default, as text (parsed like user input) */
    int flags;
    const char *field; /* the field name the library's check messages use; NULL: driver-only */
    const char *help;
    /* Numbers: the valid range, inclusive, checked by tmd_config_validate ("auto" aside). Every
     * number is bounded, so that no value can overflow a size computed from it or ask for
     * unbounded work; the bounds are far beyond any sensible run (ranges that depend on other
     * keys, and the memory a model needs, are checked there too). */
    double lo, hi;
} key;

#define OFF(member) offsetof(tmd_config, member), 0
#define STR(member) offsetof(tmd_config, member), sizeof(((tmd_config *)0)->member)

// clang-format off
static const key KEYS[] = {
    /* model */
    {"vocab_size", T_INT, G_MODEL, OFF(model.vocab_size), NULL, "auto", AUTO_OK, "vocab_size",
     "vocabulary size; auto: synthetic_vocab for synthetic data, 257 (bytes + end-of-text) for token files", 1, 16777216},
    {"d_model", T_INT, G_MODEL, OFF(model.d_model), NULL, "64", 0, "d_model", "hidden size", 1, 65536},
    {"n_layers", T_INT, G_MODEL, OFF(model.n_layers), NULL, "2", 0, "n_layers", "transformer blocks", 1, 10000},
    {"n_heads", T_INT, G_MODEL, OFF(model.n_heads), NULL, "4", 0, "n_heads", "query heads (d_model % n_heads == 0)", 1, 65536},
    {"n_kv_heads", T_INT, G_MODEL, OFF(model.n_kv_heads), NULL, "2", 0, "n_kv_heads",
     "key/value heads, grouped-query attention (n_heads % n_kv_heads == 0)", 1, 65536},
    {"seq_len", T_INT, G_MODEL, OFF(model.max_seq_len), NULL, "64", 0, "max_seq_len",
     "tokens per training sequence, and the longest context the model accepts", 1, 1048576},
    {"rope_theta", T_FLOAT, G_MODEL, OFF(model.rope_theta), NULL, "10000", 0, "rope_theta", "rotary embedding base", 0, 1e12},
    {"norm_eps", T_FLOAT, G_MODEL, OFF(model.norm_eps), NULL, "1e-5", 0, "norm_eps", "RMSNorm epsilon", 0, 1},
    {"tie_embeddings", T_BOOL, G_MODEL, OFF(model.tie_embeddings), NULL, "false", 0, "tie_embeddings",
     "LM head = token embedding transposed", 0, 0},
    {"first_k_dense", T_INT, G_MODEL, OFF(model.first_k_dense), NULL, "0", 0, "first_k_dense",
     "the first k blocks use a dense SwiGLU instead of the MoE block", 0, 10000},
    {"dense_ffn_size", T_INT, G_MODEL, OFF(model.dense_ffn_size), NULL, "auto", AUTO_OK, "dense_ffn_size",
     "FFN size of those dense blocks; auto: 4 * d_model", 1, 1048576},
    {"init_std", T_FLOAT, G_MODEL, OFF(model.init_std), NULL, "0.02", 0, "init_std",
     "init N(0, init_std^2); residual output projections / sqrt(2 n_layers)", 0, 100},
    /* MoE */
    {"num_experts", T_INT, G_MOE, OFF(model.moe.router.num_experts), NULL, "4", 0, "num_experts", "routed experts per MoE block", 1, 4096},
    {"topk", T_INT, G_MOE, OFF(model.moe.router.topk), NULL, "2", 0, "topk", "experts per token", 1, 4096},
    {"expert_ffn_size", T_INT, G_MOE, OFF(model.moe.ffn_size), NULL, "128", 0, "ffn_size", "FFN size of each expert", 1, 1048576},
    {"score_function", T_ENUM, G_MOE, OFF(model.moe.router.score_function), "softmax|sigmoid", "softmax", 0,
     "score_function", "router scores: softmax over experts, or sigmoid per expert (DeepSeek-V3)", 0, 0},
    {"pre_softmax", T_BOOL, G_MOE, OFF(model.moe.router.use_pre_softmax), NULL, "true", 0, "use_pre_softmax",
     "softmax over all experts before top-k (else softmax over the k selected)", 0, 0},
    {"num_groups", T_INT, G_MOE, OFF(model.moe.router.num_groups), NULL, "0", 0, "num_groups",
     "group-limited routing: expert groups (0 or 1: off)", 0, 4096},
    {"group_topk", T_INT, G_MOE, OFF(model.moe.router.group_topk), NULL, "0", 0, "group_topk",
     "groups kept per token, with num_groups > 1", 0, 4096},
    {"scaling_factor", T_FLOAT, G_MOE, OFF(model.moe.router.scaling_factor), NULL, "1", 0, "scaling_factor",
     "multiplies the routing weights", 0, 1e6},
    {"norm_topk_prob", T_BOOL, G_MOE, OFF(model.moe.router.norm_topk_prob), NULL, "true", 0, "norm_topk_prob",
     "renormalise the top-k weights to sum 1 (Mixtral; softmax-pre only)", 0, 0},
    {"force_load_balance", T_BOOL, G_MOE, OFF(model.moe.router.force_load_balance), NULL, "false", 0,
     "force_load_balance",
     "for benchmarks only: token t routes to experts (t topk + j) % num_experts, j < topk, ignoring the "
     "router's scores (every expert gets the same number of rows), so the model does not learn to route", 0, 0},
    {"expert_bias", T_BOOL, G_MOE, OFF(model.moe.use_expert_bias), NULL, "false", 0, "use_expert_bias",
     "aux-loss-free balancing: a per-expert selection bias updated every step", 0, 0},
    {"expert_bias_rate", T_FLOAT, G_MOE, OFF(model.moe.expert_bias_update_rate), NULL, "1e-3", 0,
     "expert_bias_update_rate", "step size of that bias update", 0, 1e6},
    {"aux_loss_coeff", T_FLOAT, G_MOE, OFF(model.moe.aux_loss_coeff), NULL, "1e-2", 0, "aux_loss_coeff",
     "load-balancing loss weight (0: off)", 0, 1e6},
    {"aux_counts", T_ENUM, G_MOE, OFF(model.moe.aux_counts), "routed|clean", "routed", 0, "aux_counts",
     "token counts of the aux loss: as routed, or a plain top-k of the scores (Megatron)", 0, 0},
    {"seq_aux_loss_coeff", T_FLOAT, G_MOE, OFF(model.moe.seq_aux_loss_coeff), NULL, "0", 0, "seq_aux_loss_coeff",
     "sequence-level balancing loss weight (0: off)", 0, 1e6},
    {"z_loss_coeff", T_FLOAT, G_MOE, OFF(model.moe.z_loss_coeff), NULL, "1e-3", 0, "z_loss_coeff",
     "router z-loss weight (0: off)", 0, 1e6},
    {"align_size", T_I64, G_MOE, OFF(model.moe.align_size), NULL, "1", 0, "align_size",
     "rows per expert rounded up to a multiple of this", 1, 1048576},
    {"capacity_factor", T_FLOAT, G_MOE, OFF(model.moe.capacity_factor), NULL, "0", 0, "capacity_factor",
     "expert capacity (T k / E) * factor; 0: dropless", 0, 4096},
    {"drop_policy", T_ENUM, G_MOE, OFF(model.moe.drop_policy), "probs|position", "probs", 0, "drop_policy",
     "over capacity, keep the highest-probability or the first tokens", 0, 0},
    {"pad_to_capacity", T_BOOL, G_MOE, OFF(model.moe.pad_to_capacity), NULL, "false", 0, "pad_to_capacity",
     "pad every expert to exactly its capacity", 0, 0},
    {"shared_ffn_size", T_INT, G_MOE, OFF(model.moe.shared_ffn_size), NULL, "0", 0, "shared_ffn_size",
     "FFN size of a shared expert on every token (0: none)", 0, 1048576},
    {"moe_strategy", T_ENUM, G_MOE, OFF(model.moe.strategy), "grouped|dense", "grouped", 0, "strategy",
     "grouped GEMMs over routed tokens, or every expert on every token (reference)", 0, 0},
    {"apply_topk_weights_early", T_BOOL, G_MOE, OFF(model.moe.apply_topk_weights_early), NULL, "false", 0,
     "apply_topk_weights_early",
     "multiply each routed row by its router weight before the expert FFN, combine with weight 1 (Megatron "
     "moe_apply_probs_on_input, Llama 4); not exportable to Mixtral", 0, 0},
    /* optimizer */
    {"optimizer", T_ENUM, G_OPTIM, OFF(optimizer), "adamw|sgd", "adamw", 0, NULL, "AdamW, or SGD with momentum", 0, 0},
    {"beta1", T_FLOAT, G_OPTIM, OFF(adamw.beta1), NULL, "0.9", 0, "beta1", "AdamW first-moment decay", 0, 1},
    {"beta2", T_FLOAT, G_OPTIM, OFF(adamw.beta2), NULL, "0.95", 0, "beta2", "AdamW second-moment decay", 0, 1},
    {"eps", T_FLOAT, G_OPTIM, OFF(adamw.eps), NULL, "1e-8", 0, "eps", "AdamW epsilon", 0, 1},
    {"weight_decay", T_FLOAT, G_OPTIM, OFF(adamw.weight_decay), NULL, "0.1", 0, "weight_decay",
     "decoupled (AdamW) or L2 (SGD) weight decay, matrices only", 0, 1e3},
    {"momentum", T_FLOAT, G_OPTIM, OFF(sgd.momentum), NULL, "0.9", 0, "momentum", "SGD momentum", 0, 1},
    {"nesterov", T_BOOL, G_OPTIM, OFF(sgd.nesterov), NULL, "false", 0, "nesterov", "SGD Nesterov momentum", 0, 0},
    {"grad_clip", T_FLOAT, G_OPTIM, OFF(grad_clip), NULL, "1.0", 0, NULL,
     "clip the global gradient norm to this (0: no clipping)", 0, 1e12},
    /* schedule */
    {"lr", T_FLOAT, G_SCHED, OFF(sched.lr), NULL, "1e-2", 0, "lr", "peak learning rate", 0, 1e6},
    {"min_lr", T_FLOAT, G_SCHED, OFF(sched.min_lr), NULL, "auto", AUTO_OK, "min_lr",
     "final learning rate of the decaying schedules; auto: lr / 10", 0, 1e6},
    {"lr_schedule", T_ENUM, G_SCHED, OFF(sched.kind), "constant|cosine|linear|wsd", "cosine", 0, "kind",
     "constant, warmup + cosine, warmup + linear, warmup-stable-decay", 0, 0},
    {"warmup_steps", T_I64, G_SCHED, OFF(sched.warmup_steps), NULL, "30", 0, "warmup_steps",
     "linear warmup steps", 0, 1e12},
    {"decay_fraction", T_FLOAT, G_SCHED, OFF(sched.decay_fraction), NULL, "0.2", 0, "decay_fraction",
     "wsd: fraction of the steps spent decaying", 0, 1},
    /* training */
    {"steps", T_I64, G_TRAIN, OFF(sched.total_steps), NULL, "600", 0, "total_steps", "optimizer steps", 1, 1e12},
    {"batch_size", T_INT, G_TRAIN, OFF(batch_size), NULL, "16", 0, NULL, "sequences per micro-batch", 1, 1048576},
    {"grad_accum", T_INT, G_TRAIN, OFF(grad_accum), NULL, "1", 0, NULL, "micro-batches per optimizer step", 1, 1048576},
    {"skip_nonfinite", T_INT, G_TRAIN, OFF(skip_nonfinite), NULL, "0", 0, NULL,
     "skip (no update) up to this many steps whose loss or gradient norm is NaN or infinite before stopping", 0,
     1000000},
    {"seed", T_I64, G_TRAIN, OFF(seed), NULL, "1", 0, NULL, "seed of the initialisation, the batches and the synthetic source", 0, 9223372036854775807.0},
    {"threads", T_INT, G_TRAIN, OFF(threads), NULL, "0", 0, NULL, "CPU threads (0: all available)", 0, 1024},
    {"cpu_gemm", T_ENUM, G_TRAIN, OFF(cpu_gemm), "auto|builtin", "auto", 0, NULL,
     "CPU matrix products: OpenBLAS when built with it, or always the built-in kernel (the same results on every build)", 0, 0},
    {"grouped_gemm", T_ENUM, G_TRAIN, OFF(grouped_gemm), "cublaslt|device|hopper|auto", "auto", 0, NULL,
     "bf16 expert GEMMs on CUDA: one cuBLASLt GEMM per expert (one wait per MoE layer), one kernel taking "
     "the group sizes on the device (no wait), its Hopper wgmma + TMA version (no wait; sm_90 only, else device), or "
     "auto: hopper on an sm_90 GPU, cublaslt on others",
     0, 0},
    {"device", T_ENUM, G_TRAIN, OFF(device), "cpu|cuda", "cpu", 0, NULL, "where the model runs (cuda: device 0)", 0, 0},
    {"dtype", T_ENUM, G_TRAIN, OFF(dtype), "f32|bf16", "f32", 0, NULL, "parameter dtype", 0, 0},
    /* data */
    {"data", T_STR, G_DATA, STR(data), NULL, "synthetic", 0, NULL,
     "'synthetic' (order-2 Markov source with a known optimum), or an llm.c token file or glob of shards", 0, 0},
    {"val_data", T_STR, G_DATA, STR(val_data), NULL, "", 0, NULL,
     "validation token file or glob (empty: the last val_fraction of data)", 0, 0},
    {"val_fraction", T_FLOAT, G_DATA, OFF(val_fraction), NULL, "0.1", 0, NULL,
     "fraction of data held out for validation when val_data is empty", 0, 1},
    {"tokenizer", T_STR, G_DATA, STR(tokenizer), NULL, "", 0, NULL,
     "a Hugging Face tokenizer.json (byte-level BPE: GPT-2, Llama-3, Qwen2) the token files were made with "
     "('tinymoe tokenize --tokenizer'): vocab_size defaults to its size, it is copied to out/tokenizer.json, and "
     "sample_prompt, 'tinymoe sample' and 'tinymoe export' use it (empty: bytes)", 0, 0},
    {"synthetic_vocab", T_INT, G_DATA, OFF(synthetic_vocab), NULL, "16", 0, NULL, "synthetic source: vocabulary size", 2, 1024},
    {"synthetic_k", T_INT, G_DATA, OFF(synthetic_k), NULL, "3", 0, NULL,
     "synthetic source: allowed next tokens per two-token context", 1, 1024},
    /* run */
    {"eval_every", T_INT, G_RUN, OFF(eval_every), NULL, "100", 0, NULL, "validate every this many steps (0: at the end only)", 0, 2147483647},
    {"eval_batches", T_INT, G_RUN, OFF(eval_batches), NULL, "8", 0, NULL,
     "validation batches of batch_size sequences (0: the whole validation set)", 0, 2147483647},
    {"log_every", T_INT, G_RUN, OFF(log_every), NULL, "10", 0, NULL, "print and record metrics every this many steps", 1, 2147483647},
    {"progress", T_ENUM, G_RUN, OFF(progress), "auto|bar|lines", "auto", 0, NULL,
     "a progress bar under the step table (bar), the step table alone (lines), or the bar only on a real terminal "
     "that no launcher (mpirun, srun) made and whose TERM is not dumb (auto)", 0, 0},
    {"out", T_STR, G_RUN, STR(out), NULL, "out", 0, NULL,
     "directory for checkpoints, metrics.jsonl, loss.svg and experts.svg (empty: write nothing)", 0, 0},
    {"tensorboard", T_STR, G_RUN, STR(tensorboard), NULL, "", 0, NULL,
     "directory for TensorBoard event files of the metrics (loss, lr, gradient norm, aux and z losses, tokens/s, "
     "each MoE layer's max load, validation loss; empty: none)", 0, 0},
    {"exit_interval", T_I64, G_RUN, OFF(exit_interval), NULL, "0", 0, NULL,
     "end the run after a step that is a multiple of this, with a checkpoint, as an interrupt would (exit 0; the schedule still follows steps; 0: never)", 0, 1e12},
    {"save_every", T_INT, G_RUN, OFF(save_every), NULL, "0", 0, NULL,
     "write <out>/ckpt-<step>.tmck every this many steps (0: only at the end and on SIGINT/SIGTERM/SIGHUP)", 0, 2147483647},
    {"allow_data_change", T_BOOL, G_RUN, OFF(allow_data_change), NULL, "false", 0, NULL,
     "resume even though the data files differ from those the checkpoint was trained on", 0, 0},
    {"overwrite", T_BOOL, G_RUN, OFF(overwrite), NULL, "false", 0, NULL,
     "a fresh run may delete the checkpoints of an earlier run in out (otherwise it refuses to start)", 0, 0},
    {"keep_last", T_INT, G_RUN, OFF(keep_last), NULL, "3", 0, NULL,
     "keep the newest this many checkpoints in out, deleting older ones (0: keep all)", 0, 2147483647},
    {"async_save", T_BOOL, G_RUN, OFF(async_save), NULL, "true", 0, NULL,
     "save checkpoints in the background: training stalls only while its state is copied to host memory (one "
     "snapshot, as large as the checkpoint, is kept for it; under mpirun each rank keeps and writes only its own "
     "part); the file is written by another thread, and the run ends only once it is complete (false: every save "
     "stalls until the file is written)", 0, 0},
    {"resume", T_STR, G_RUN, STR(resume), NULL, "", 0, NULL,
     "continue from a checkpoint file, or the newest in a directory; model and training keys come from it", 0, 0},
    {"init_from", T_STR, G_RUN, STR(init_from), NULL, "", 0, NULL,
     "start from the weights of a Hugging Face Mixtral export (config.json + model.safetensors) in this directory", 0, 0},
    {"sample_prompt", T_STR, G_RUN, STR(sample_prompt), NULL, "", 0, NULL,
     "after training, continue this text (byte-level models, or through key 'tokenizer'; empty: no sample)", 0, 0},
    {"sample_tokens", T_INT, G_RUN, OFF(sample_tokens), NULL, "256", 0, NULL, "tokens to generate", 0, 1000000},
    {"temperature", T_FLOAT, G_RUN, OFF(temperature), NULL, "0.8", 0, NULL, "sampling temperature (0: greedy)", 0, 1e6},
    {"top_k", T_INT, G_RUN, OFF(top_k), NULL, "0", 0, NULL, "sample among the k most likely tokens (0: all)", 0, 16777216},
    {"top_p", T_FLOAT, G_RUN, OFF(top_p), NULL, "1", 0, NULL,
     "sample from the smallest set of most likely tokens holding this much probability (1: all)", 0, 1},
    {"preset", T_STR, G_RUN, STR(preset), NULL, "", 0, NULL,
     "tiny | small | shakespeare | coarse | fine: applied before the config file and the flags", 0, 0},
    /* distributed */
    {"ep_size", T_INT, G_DIST, OFF(ep_size), NULL, "1", 0, NULL,
     "ranks the routed experts are split over (divides the ranks and num_experts)", 1, 65536},
    {"ep_strategy", T_ENUM, G_DIST, OFF(ep_strategy), "alltoall|allgather|alltoall_dedup", "alltoall", 0, NULL,
     "expert-parallel dispatch: ragged all-to-all of a row per (token, expert), all-gather of the tokens, or "
     "all-to-all of a row per (token, rank) combined on the expert's rank (fewer bytes for large topk)", 0, 0},
    {"overlap_chunks", T_INT, G_DIST, OFF(model.moe.overlap_chunks), NULL, "1", 0, "overlap_chunks",
     "with ep_size > 1 and ep_strategy alltoall or alltoall_dedup: each MoE layer moves its tokens in this many "
     "chunks, issued so that one chunk's all-to-all can run while another's experts compute (Megatron-LM's EP "
     "all-to-all overlap, MaxText PR #3981): with NCCL and comm_overlap (the default) each chunk's dispatch and "
     "combine all-to-alls, forward and backward, run on a second stream while other chunks' experts compute; routing "
     "and losses stay over the whole layer; 1: off; ignored by allgather and ep_size 1; at most seq_len", 1, 4096},
    {"zero", T_INT, G_DIST, OFF(zero), NULL, "0", 0, NULL,
     "ZeRO stage: 0; 1 to shard optimizer state and f32 master weights over the data-parallel ranks; 2 to "
     "shard the gradients too (reduce-scattered, no full gradient buffer between steps); 3 to shard the weights "
     "too (all-gathered layer by layer for the forward and again for the backward)", 0, 3},
    {"zero3_keep_last", T_INT, G_DIST, OFF(zero3_keep_last), NULL, "1", 0, NULL,
     "with zero 3: the last this many layers (and the final norm and lm_head) keep their all-gathered weights from "
     "their forward to their backward, which starts with them: one all-gather fewer per kept unit (a layer's dense, expert and router weights) and "
     "micro-batch, for their bf16/f32 weights held through the loss and the start of the backward (PyTorch FSDP2's "
     "reshard_after_forward=False for the last block); 0: gather them again; the same values either way",
     0, 1000000},
    {"comm_timeout", T_FLOAT, G_DIST, OFF(comm_timeout), NULL, "60", 0, NULL,
     "seconds a collective may wait before the run fails (a rank died or stopped answering); 0: forever", 0, 1e9},
    {"nccl", T_ENUM, G_DIST, OFF(nccl), "auto|off|always", "auto", 0, NULL,
     "CUDA collectives: NCCL when every rank has its own GPU, host-staged MPI always (off), or NCCL even for one "
     "rank (always: a check of that engine on one GPU)", 0, 0},
    {"comm_overlap", T_BOOL, G_DIST, OFF(comm_overlap), NULL, "true", 0, NULL,
     "with NCCL, run ZeRO-3's all-gathers ahead of their use and its gradient reduce-scatters during the backward, "
     "the chunked MoE layers' all-to-alls (overlap_chunks > 1), and (grad_sync_overlap) the data-parallel gradient "
     "all-reduce, on a second stream beside the compute (false: each in place when needed; the same values)", 0, 0},
    {"grad_sync_overlap", T_ENUM, G_DIST, OFF(grad_sync_overlap), "auto|true|false", "auto", 0, NULL,
     "with comm_overlap and ZeRO-0: all-reduce the gradients during the last backward of a step, each piece as soon "
     "as its gradients are final (PyTorch DDP), instead of after it; auto: where the all-reduce covers the experts' "
     "gradients too (ep_size below the world), the bulk of the bytes; with only the dense weights it is short and "
     "measured slower beside the expert-parallel all-to-alls (docs/layouts.md)", 0, 0},
    {"grad_sync_chunk_mb", T_FLOAT, G_DIST, OFF(grad_sync_chunk_mb), NULL, "32", 0, NULL,
     "with grad_sync_overlap: the size of the pieces in which the backward all-reduces the gradients, MiB (PyTorch "
     "DDP's bucket_cap_mb): smaller starts sooner, larger runs nearer the link's bandwidth", 0.001, 1e6},
    {"comm_sms", T_INT, G_DIST, OFF(comm_sms), NULL, "16", 0, NULL,
     "with comm_overlap on NCCL: GPU SMs left to the collectives beside the compute (their CTAs; the persistent Hopper "
     "grouped GEMM uses the others while one is in flight, so it does not wait for SMs a collective holds); 0: none",
     0, 64},
    {"print_layout", T_BOOL, G_DIST, OFF(print_layout), NULL, "false", 0, NULL,
     "print which rank holds which parameters and experts, and its bytes (and, after the run, its peaks and ZeRO-2's "
     "transient gradient bytes); draw <out>/layout.svg", 0, 0},
};

// clang-format on
enum { NKEYS = (int)(sizeof KEYS / sizeof KEYS[0]) };
_Static_assert(NKEYS <= TMD_MAX_KEYS, "raise TMD_MAX_KEYS");

/* Presets: sizes and training settings for common runs, as `key=value` items. */
typedef struct preset {
    const char *name, *about;
    const char *items[24];
} preset;

// clang-format off
static const preset PRESETS[] = {
    {"tiny", "a seconds-long smoke test",
     {"d_model=32", "n_layers=1", "n_heads=2", "n_kv_heads=1", "num_experts=4", "topk=2", "expert_ffn_size=32",
      "seq_len=16", "batch_size=8", "steps=50", "warmup_steps=5", "eval_every=25", "eval_batches=2", "log_every=5",
      NULL}},
    {"small", "the benchmark model: d_model 128, 4 layers, 4 experts top-2, F 256, seq 128, batch 16 (1.8M parameters)",
     {"d_model=128", "n_layers=4", "n_heads=4", "n_kv_heads=4", "num_experts=4", "topk=2", "expert_ffn_size=256",
      "seq_len=128", "batch_size=16", "lr=3e-3", "warmup_steps=100", "steps=2000", "eval_every=200", NULL}},
    {"shakespeare", "byte-level text (give data=FILE from 'tinymoe tokenize'): the small model, 10-minute budget",
     {"d_model=128", "n_layers=4", "n_heads=4", "n_kv_heads=4", "num_experts=4", "topk=2", "expert_ffn_size=256",
      "seq_len=128", "batch_size=16", "lr=8e-3", "min_lr=8e-4", "warmup_steps=50", "steps=1000", "weight_decay=0.1",
      "eval_every=250", "eval_batches=16", "log_every=50", "sample_prompt=ROMEO:", "sample_tokens=300", NULL}},
    /* The GPU benchmark models of issue 12 (bench/train_gpu.sh, docs/PERFORMANCE.md): the same
     * active expert parameters per token (3 k H F = 9.4M a layer), as a few large experts or
     * many small ones. */
    {"coarse", "GPU benchmark, coarse experts (with --device cuda --dtype bf16): d_model 768, 12 layers, 12 heads "
               "(4 kv), 8 experts top-2, F 2048, vocab 32768, seq 1024, batch 16 (522M parameters, 183M active)",
     {"d_model=768", "n_layers=12", "n_heads=12", "n_kv_heads=4", "num_experts=8", "topk=2", "expert_ffn_size=2048",
      "vocab_size=32768", "seq_len=1024", "batch_size=16", "lr=3e-4", "warmup_steps=100", NULL}},
    {"fine", "GPU benchmark, fine-grained experts (with --device cuda --dtype bf16): d_model 1024, 8 layers, 16 "
             "heads (4 kv), 64 experts top-6, F 512, vocab 32768, seq 1024, batch 16 (894M parameters, 164M active)",
     {"d_model=1024", "n_layers=8", "n_heads=16", "n_kv_heads=4", "num_experts=64", "topk=6", "expert_ffn_size=512",
      "vocab_size=32768", "seq_len=1024", "batch_size=16", "lr=3e-4", "warmup_steps=100", NULL}},
};
// clang-format on
enum { NPRESETS = (int)(sizeof PRESETS / sizeof PRESETS[0]) };

/* ---------------------------------------------------------------------------------------- */

static void *field_ptr(tmd_config *cfg, const key *k) { return (char *)cfg + k->offset; }
static const void *field_cptr(const tmd_config *cfg, const key *k) { return (const char *)cfg + k->offset; }

static int find_key(const char *name) {
    for (int i = 0; i < NKEYS; i++)
        if (!strcmp(KEYS[i].name, name)) return i;
    return -1;
}

/* Levenshtein distance, for "did you mean". Names are short (< 64 bytes). */
static int edit_distance(const char *a, const char *b) {
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 63 || lb > 63) return 99;
    int row[64];
    for (int j = 0; j <= lb; j++) row[j] = j;
    for (int i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= lb; j++) {
            int up = row[j];
            int sub = diag + (a[i - 1] != b[j - 1]);
            int best = up + 1 < row[j - 1] + 1 ? up + 1 : row[j - 1] + 1;
            row[j] = sub < best ? sub : best;
            diag = up;
        }
    }
    return row[lb];
}

/* Other trainers' names for tinymoe's keys (flags with '-' read as '_'), so that a user's habit
 * gets the key instead of a near-miss spelling: nanoGPT (train.py's config), llm.c, Megatron-LM
 * (--moe-*, --num-*), torchtitan (section.key, the dot read as '_') and Hugging Face configs. */
static const struct {
    const char *theirs, *tool, *ours;
} ALIASES[] = {
    {"block_size", "nanoGPT", "seq_len"},
    {"learning_rate", "nanoGPT", "lr"},
    {"max_iters", "nanoGPT", "steps"},
    {"n_embd", "nanoGPT", "d_model"},
    {"n_layer", "nanoGPT", "n_layers"},
    {"n_head", "nanoGPT", "n_heads"},
    {"gradient_accumulation_steps", "nanoGPT", "grad_accum"},
    {"warmup_iters", "nanoGPT", "warmup_steps"},
    {"eval_interval", "nanoGPT", "eval_every"},
    {"eval_iters", "nanoGPT", "eval_batches"},
    {"log_interval", "nanoGPT", "log_every"},
    {"out_dir", "nanoGPT", "out"},
    {"dataset", "nanoGPT", "data"},
    {"always_save_checkpoint", "nanoGPT", "save_every"},
    {"num_iterations", "llm.c", "steps"},
    {"sequence_length", "llm.c", "seq_len"},
    {"learning_rate_decay_frac", "llm.c", "min_lr"},
    {"hidden_size", "Megatron-LM / Hugging Face", "d_model"},
    {"num_layers", "Megatron-LM", "n_layers"},
    {"num_hidden_layers", "Hugging Face", "n_layers"},
    {"num_attention_heads", "Megatron-LM / Hugging Face", "n_heads"},
    {"num_query_groups", "Megatron-LM", "n_kv_heads"},
    {"num_key_value_heads", "Hugging Face", "n_kv_heads"},
    {"seq_length", "Megatron-LM", "seq_len"},
    {"max_position_embeddings", "Megatron-LM / Hugging Face", "seq_len"},
    {"ffn_hidden_size", "Megatron-LM", "dense_ffn_size"},
    {"intermediate_size", "Hugging Face", "dense_ffn_size"},
    {"global_batch_size", "Megatron-LM", "batch_size"},
    {"micro_batch_size", "Megatron-LM", "batch_size (per micro-batch; grad_accum micro-batches a step)"},
    {"train_iters", "Megatron-LM", "steps"},
    {"lr_warmup_iters", "Megatron-LM", "warmup_steps"},
    {"lr_decay_style", "Megatron-LM", "lr_schedule"},
    {"clip_grad", "Megatron-LM", "grad_clip"},
    {"adam_beta1", "Megatron-LM", "beta1"},
    {"adam_beta2", "Megatron-LM", "beta2"},
    {"adam_eps", "Megatron-LM", "eps"},
    {"rotary_base", "Megatron-LM", "rope_theta"},
    {"norm_epsilon", "Megatron-LM", "norm_eps"},
    {"rms_norm_eps", "Hugging Face", "norm_eps"},
    {"untie_embeddings_and_output_weights", "Megatron-LM", "tie_embeddings (false)"},
    {"num_local_experts", "Hugging Face (Mixtral)", "num_experts"},
    {"moe_router_topk", "Megatron-LM", "topk"},
    {"num_experts_per_tok", "Hugging Face", "topk"},
    {"moe_ffn_hidden_size", "Megatron-LM", "expert_ffn_size"},
    {"moe_intermediate_size", "Hugging Face", "expert_ffn_size"},
    {"moe_aux_loss_coeff", "Megatron-LM", "aux_loss_coeff"},
    {"router_aux_loss_coef", "Hugging Face", "aux_loss_coeff"},
    {"moe_z_loss_coeff", "Megatron-LM", "z_loss_coeff"},
    {"moe_router_score_function", "Megatron-LM", "score_function"},
    {"moe_router_pre_softmax", "Megatron-LM", "pre_softmax"},
    {"moe_router_num_groups", "Megatron-LM", "num_groups"},
    {"moe_router_group_topk", "Megatron-LM", "group_topk"},
    {"moe_router_topk_scaling_factor", "Megatron-LM", "scaling_factor"},
    {"moe_router_enable_expert_bias", "Megatron-LM", "expert_bias"},
    {"moe_router_bias_update_rate", "Megatron-LM", "expert_bias_rate"},
    {"moe_router_load_balancing_type", "Megatron-LM", "aux_loss_coeff / seq_aux_loss_coeff / expert_bias"},
    {"moe_router_force_load_balancing", "Megatron-LM", "force_load_balance"},
    {"moe_expert_capacity_factor", "Megatron-LM", "capacity_factor"},
    {"moe_token_drop_policy", "Megatron-LM", "drop_policy"},
    {"moe_pad_expert_input_to_capacity", "Megatron-LM", "pad_to_capacity"},
    {"moe_shared_expert_intermediate_size", "Megatron-LM", "shared_ffn_size"},
    {"moe_token_dispatcher_type", "Megatron-LM", "ep_strategy"},
    {"expert_model_parallel_size", "Megatron-LM", "ep_size"},
    {"use_distributed_optimizer", "Megatron-LM", "zero (1)"},
    {"training_steps", "torchtitan", "steps"},
    {"training_seq_len", "torchtitan", "seq_len"},
    {"training_local_batch_size", "torchtitan", "batch_size (the global one)"},
    {"optimizer_lr", "torchtitan", "lr"},
    {"lr_scheduler_warmup_steps", "torchtitan", "warmup_steps"},
    {"parallelism_expert_parallel_degree", "torchtitan", "ep_size"},
    {"debug_moe_force_load_balance", "torchtitan", "force_load_balance"},
    {"moe_force_load_balance", "torchtitan (debug.moe_force_load_balance)", "force_load_balance"},
    {"checkpoint_interval", "torchtitan", "save_every"},
    {"metrics_log_freq", "torchtitan", "log_every"},
};

static const char *closest_key(const char *name) {
    int best = -1, bd = 1 << 30;
    for (int i = 0; i < NKEYS; i++) {
        int d = edit_distance(name, KEYS[i].name);
        if (d < bd) bd = d, best = i;
    }
    /* Suggest only what is plausibly a typo: at most a third of the name changed. */
    int len = (int)strlen(name);
    return best >= 0 && bd <= (len < 6 ? 2 : len / 3 + 1) ? KEYS[best].name : NULL;
}

static const char *type_name(const key *k) {
    switch (k->type) {
    case T_INT:
    case T_I64: return "int";
    case T_FLOAT: return "float";
    case T_BOOL: return "bool";
    case T_STR: return "string";
    case T_ENUM: return "enum";
    }
    return "?";
}

static const char *expected(const key *k, char *buf, size_t len) {
    switch (k->type) {
    case T_INT:
    case T_I64: snprintf(buf, len, "an integer%s", k->flags & AUTO_OK ? " or 'auto'" : ""); break;
    case T_FLOAT: snprintf(buf, len, "a finite number%s", k->flags & AUTO_OK ? " or 'auto'" : ""); break;
    case T_BOOL: snprintf(buf, len, "true or false (also 1/0, yes/no, on/off)"); break;
    case T_ENUM: snprintf(buf, len, "one of %s", k->values); break;
    case T_STR: snprintf(buf, len, "a string of at most %zu bytes", k->size - 1); break;
    }
    return buf;
}

/* Index of `v` in the '|'-separated list, or -1. */
static int enum_index(const char *values, const char *v) {
    size_t n = strlen(v);
    int i = 0;
    for (const char *p = values;; i++) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, v, n)) return i;
        if (!bar) return -1;
        p = bar + 1;
    }
}

static void enum_name(const char *values, int idx, char *buf, size_t len) {
    const char *p = values;
    for (int i = 0; i < idx && p; i++) {
        p = strchr(p, '|');
        if (p) p++;
    }
    if (!p) {
        snprintf(buf, len, "%d", idx);
        return;
    }
    const char *bar = strchr(p, '|');
    int n = bar ? (int)(bar - p) : (int)strlen(p);
    snprintf(buf, len, "%.*s", n, p);
}

static int bad_value(const key *k, const char *v, const char *where, char *err, size_t errlen) {
    char exp[128];
    return tmd_fail(err, errlen, -1, "key '%s' (%s): expected %s, got '%s'", k->name, where,
                    expected(k, exp, sizeof exp), v);
}

static int parse_value(tmd_config *cfg, const key *k, const char *v, const char *where, char *err, size_t errlen) {
    void *p = field_ptr(cfg, k);
    int is_auto = (k->flags & AUTO_OK) && !strcmp(v, "auto");
    switch (k->type) {
    case T_INT:
    case T_I64: {
        if (is_auto) {
            if (k->type == T_INT) *(int *)p = 0;
            else *(int64_t *)p = 0;
            return 0;
        }
        char *end;
        errno = 0;
        long long x = strtoll(v, &end, 10);
        int bad = !*v || *end || errno;
        if (!bad && k->type == T_INT && (x < -2147483647LL - 1 || x > 2147483647LL)) bad = 1;
        if (bad) return bad_value(k, v, where, err, errlen);
        if (k->type == T_INT) *(int *)p = (int)x;
        else *(int64_t *)p = (int64_t)x;
        return 0;
    }
    case T_FLOAT: {
        if (is_auto) {
            *(double *)p = NAN;
            return 0;
        }
        char *end;
        errno = 0;
        double x = strtod(v, &end);
        if (!*v || *end || errno == ERANGE || !isfinite(x)) return bad_value(k, v, where, err, errlen);
        *(double *)p = x;
        return 0;
    }
    case T_BOOL: {
        static const char *const yes[] = {"true", "1", "yes", "on"}, *const no[] = {"false", "0", "no", "off"};
        for (int i = 0; i < 4; i++) {
            if (!strcmp(v, yes[i])) return *(int *)p = 1, 0;
            if (!strcmp(v, no[i])) return *(int *)p = 0, 0;
        }
        return bad_value(k, v, where, err, errlen);
    }
    case T_ENUM: {
        int idx = enum_index(k->values, v);
        if (idx < 0) return bad_value(k, v, where, err, errlen);
        *(int *)p = idx;
        return 0;
    }
    case T_STR:
        if (strlen(v) >= k->size) {
            char exp[128];
            return tmd_fail(err, errlen, -1, "key '%s' (%s): expected %s, got %zu bytes", k->name, where,
                            expected(k, exp, sizeof exp), strlen(v));
        }
        memcpy(p, v, strlen(v) + 1);
        return 0;
    }
    return tmd_fail(err, errlen, -1, "key '%s': unknown type", k->name);
}

/* Record where key i came from; a long one keeps its end ("...dir/run.conf:3"). */
static void set_origin(tmd_config *cfg, int i, const char *where) {
    size_t n = strlen(where), cap = sizeof cfg->origin[i];
    if (n < cap) {
        memcpy(cfg->origin[i], where, n + 1);
        return;
    }
    memcpy(cfg->origin[i], "...", 3);
    memcpy(cfg->origin[i] + 3, where + n - (cap - 4), cap - 4);
    cfg->origin[i][cap - 1] = 0;
}

int tmd_config_set(tmd_config *cfg, const char *name, const char *value, tmd_source src, const char *where, char *err,
                   size_t errlen) {
    int i = find_key(name);
    if (i < 0) {
        for (size_t a = 0; a < sizeof ALIASES / sizeof ALIASES[0]; a++)
            if (!strcmp(name, ALIASES[a].theirs))
                return tmd_fail(err, errlen, -1, "unknown key '%s' (%s): %s's name; tinymoe's key is %s", name, where,
                                ALIASES[a].tool, ALIASES[a].ours);
        const char *sugg = closest_key(name);
        if (sugg) return tmd_fail(err, errlen, -1, "unknown key '%s' (%s); did you mean '%s'?", name, where, sugg);
        return tmd_fail(err, errlen, -1, "unknown key '%s' (%s); 'tinymoe train --help' lists the keys", name, where);
    }
    if (parse_value(cfg, &KEYS[i], value, where, err, errlen)) return -1;
    cfg->source[i] = (unsigned char)src;
    set_origin(cfg, i, where ? where : "");
    return 0;
}

void tmd_config_defaults(tmd_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    /* The library's defaults first, so fields without a key (there should be none) are sane. */
    cfg->model = tm_model_config_default();
    cfg->adamw = tm_adamw_config_default();
    cfg->sgd = tm_sgd_config_default();
    for (int i = 0; i < NKEYS; i++) {
        char err[256];
        /* The table's defaults parse by construction (tests/test_config.c checks). */
        (void)parse_value(cfg, &KEYS[i], KEYS[i].def, "default", err, sizeof err);
        cfg->source[i] = TMD_SRC_DEFAULT;
    }
}

int tmd_config_apply_preset(tmd_config *cfg, const char *name, char *err, size_t errlen) {
    for (int p = 0; p < NPRESETS; p++) {
        if (strcmp(PRESETS[p].name, name)) continue;
        for (const char *const *it = PRESETS[p].items; *it; it++) {
            char k[64], where[96];
            const char *eq = strchr(*it, '=');
            snprintf(k, sizeof k, "%.*s", (int)(eq - *it), *it);
            snprintf(where, sizeof where, "preset %s", name);
            if (tmd_config_set(cfg, k, eq + 1, TMD_SRC_PRESET, where, err, errlen)) return -1;
        }
        snprintf(cfg->preset, sizeof cfg->preset, "%s", name);
        cfg->source[find_key("preset")] = TMD_SRC_PRESET;
        return 0;
    }
    char names[128] = "";
    for (int p = 0; p < NPRESETS; p++)
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", p ? "|" : "", PRESETS[p].name);
    return tmd_fail(err, errlen, -1, "key 'preset': expected one of %s, got '%s'", names, name);
}

/* ---------------------------------------------------------------------------------------- */
/* Config files                                                                              */

typedef struct entry {
    char *key, *value;
    int line;
} entry;

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = 0;
    return s;
}

/* Parse one `key = value` line in place. Returns 1 for an entry, 0 for a blank or comment
 * line, -1 for a syntax error. */
static int parse_line(char *line, char **key, char **value, const char **why) {
    char *s = trim(line);
    if (!*s || *s == '#') return 0;
    char *eq = strchr(s, '=');
    if (!eq) return *why = "expected 'key = value'", -1;
    *eq = 0;
    *key = trim(s);
    char *v = trim(eq + 1);
    if (!**key) return *why = "missing key before '='", -1;
    if (*v == '"') {
        /* Quoted: escapes \n \t \" \\, then only a comment may follow. */
        char *r = v + 1, *w = v;
        for (;; r++) {
            if (!*r) return *why = "unterminated quoted value", -1;
            if (*r == '"') break;
            if (*r == '\\') {
                r++;
                switch (*r) {
                case 'n': *w++ = '\n'; break;
                case 't': *w++ = '\t'; break;
                case '"': *w++ = '"'; break;
                case '\\': *w++ = '\\'; break;
                default: return *why = "unknown escape in quoted value (use \\n \\t \\\" \\\\)", -1;
                }
            } else {
                *w++ = *r;
            }
        }
        char *rest = trim(r + 1);
        *w = 0;
        if (*rest && *rest != '#') return *why = "text after the closing quote", -1;
    } else {
        /* Unquoted: a '#' after whitespace starts a comment. */
        for (char *c = v; *c; c++)
            if (*c == '#' && (c == v || isspace((unsigned char)c[-1]))) {
                *c = 0;
                break;
            }
        v = trim(v);
    }
    *value = v;
    return 1;
}

enum { CONFIG_FILE_MAX = 16 << 20 };

static int read_file(const char *path, char **out, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) return tmd_fail(err, errlen, -1, "cannot open config file '%s': %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (!buf) {
            fclose(f);
            return tmd_fail(err, errlen, -1, "config file '%s': out of memory", path);
        }
        n += fread(buf + n, 1, cap - 1 - n, f);
        if (n < cap - 1) break;
        /* A config file is a few hundred lines: a huge one is a mistake (a token file given
         * to --config?), not worth reading to the end. */
        if (cap >= CONFIG_FILE_MAX) {
            free(buf);
            fclose(f);
            return tmd_fail(err, errlen, -1, "config file '%s' is larger than %d MiB: not a config file", path,
                            CONFIG_FILE_MAX >> 20);
        }
        char *nb = realloc(buf, cap *= 2);
        if (!nb) free(buf);
        buf = nb;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return tmd_fail(err, errlen, -1, "cannot read config file '%s'", path);
    }
    buf[n] = 0;
    if (strlen(buf) != n) {
        free(buf);
        return tmd_fail(err, errlen, -1, "config file '%s' contains a NUL byte: not a text file", path);
    }
    *out = buf;
    return 0;
}

/* Split a file into entries (pointers into *text). */
static int parse_file(const char *path, char **text, entry **entries, int *n, char *err, size_t errlen) {
    *entries = NULL;
    *n = 0;
    if (read_file(path, text, err, errlen)) return -1;
    int cap = 0;
    char *s = *text;
    for (int line = 1; s; line++) {
        char *nl = strchr(s, '\n');
        if (nl) *nl = 0;
        char *k, *v;
        const char *why = NULL;
        int r = parse_line(s, &k, &v, &why);
        if (r < 0) {
            free(*entries);
            *entries = NULL;
            return tmd_fail(err, errlen, -1, "%s (line %d of %s)", why, line, path);
        }
        if (r > 0) {
            if (*n == cap) {
                cap = cap ? 2 * cap : 32;
                entry *ne = realloc(*entries, sizeof *ne * (size_t)cap);
                if (!ne) {
                    free(*entries);
                    *entries = NULL;
                    return tmd_fail(err, errlen, -1, "config file '%s': out of memory", path);
                }
                *entries = ne;
            }
            (*entries)[(*n)++] = (entry){k, v, line};
        }
        s = nl ? nl + 1 : NULL;
    }
    /* A key given twice: the file means one of them, and which one the reader meant is not ours
     * to guess (config.json refuses repeated keys too). */
    int first[TMD_MAX_KEYS] = {0};
    for (int i = 0; i < *n; i++) {
        int k = find_key((*entries)[i].key);
        if (k < 0) continue; /* unknown: tmd_config_set names it, with a suggestion */
        if (first[k]) {
            int a = first[k], b = (*entries)[i].line;
            free(*entries);
            *entries = NULL;
            return tmd_fail(err, errlen, -1, "key '%s' is given twice in config file '%s' (lines %d and %d): keep one",
                            KEYS[k].name, path, a, b);
        }
        first[k] = (*entries)[i].line;
    }
    return 0;
}

static int apply_entries(tmd_config *cfg, const char *path, const entry *e, int n, int skip_preset, char *err,
                         size_t errlen) {
    for (int i = 0; i < n; i++) {
        if (skip_preset && !strcmp(e[i].key, "preset")) continue;
        char where[TMD_PATH_MAX + 32];
        snprintf(where, sizeof where, "line %d of %s", e[i].line, path);
        if (tmd_config_set(cfg, e[i].key, e[i].value, TMD_SRC_FILE, where, err, errlen)) return -1;
        int k = find_key(e[i].key);
        char at[TMD_PATH_MAX + 32];
        snprintf(at, sizeof at, "%s:%d", path, e[i].line); /* as compilers name a line */
        if (k >= 0) set_origin(cfg, k, at);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Command-line arguments                                                                    */

typedef struct flag {
    char name[64];
    const char *value;
    char where[96];
} flag;

int tmd_config_from_args(tmd_config *cfg, int argc, char **argv, int *help, char *err, size_t errlen) {
    tmd_config_defaults(cfg);
    *help = 0;
    flag *flags = calloc((size_t)(argc > 0 ? argc : 1), sizeof *flags);
    if (!flags) return tmd_fail(err, errlen, -1, "out of memory");
    int nf = 0, rc = -1;
    const char *config_path = NULL, *preset_name = NULL;
    char *text = NULL;
    entry *entries = NULL;
    int ne = 0;

    /* 1. Collect the flags (nothing applied yet: the preset and the file come first). */
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            *help = 1;
            rc = 0;
            goto done;
        }
        if (strncmp(a, "--", 2) || !a[2]) {
            tmd_fail(err, errlen, -1, "unexpected argument '%s' (flags are --key value or --key=value)", a);
            goto done;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
        if (nlen >= sizeof flags[nf].name) {
            tmd_fail(err, errlen, -1, "unknown key '%.40s...' (flag %.40s...)", name, a);
            goto done;
        }
        flag *f = &flags[nf];
        memcpy(f->name, name, nlen);
        f->name[nlen] = 0;
        for (char *c = f->name; *c; c++)
            if (*c == '-') *c = '_';
        snprintf(f->where, sizeof f->where, "flag --%s", f->name);
        int ki = find_key(f->name);
        /* An unknown flag right before another flag (or last): name it, rather than taking the
         * next flag as its value and failing on what follows ("--compile --steps 1"). */
        if (ki < 0 && !eq && strcmp(f->name, "config") && strcmp(f->name, "preset") &&
            (i + 1 == argc || !strncmp(argv[i + 1], "--", 2))) {
            tmd_config_set(cfg, f->name, "", TMD_SRC_FLAG, f->where, err, errlen);
            goto done;
        }
        if (eq) {
            f->value = eq + 1;
        } else if (ki >= 0 && KEYS[ki].type == T_BOOL && (i + 1 == argc || !strncmp(argv[i + 1], "--", 2))) {
            f->value = "true";
        } else if (i + 1 < argc) {
            f->value = argv[++i];
        } else {
            tmd_fail(err, errlen, -1, "flag --%s needs a value", f->name);
            goto done;
        }
        /* The file and the preset are sources, not keys: a second one would silently replace
         * the first, so two are an error (a key flag given twice: the last wins, as usual). */
        const char **src = !strcmp(f->name, "config") ? &config_path : !strcmp(f->name, "preset") ? &preset_name : NULL;
        if (src && *src) {
            tmd_fail(err, errlen, -1, "flag --%s is given twice ('%s' and '%s'): give one", f->name, *src, f->value);
            goto done;
        }
        if (src) *src = f->value;
        else nf++;
    }

    /* 2. The file's entries (the file may name a preset; a --preset flag wins). */
    if (config_path) {
        if (parse_file(config_path, &text, &entries, &ne, err, errlen)) goto done;
        for (int i = 0; i < ne; i++)
            if (!strcmp(entries[i].key, "preset") && !preset_name) preset_name = entries[i].value;
    }
    /* 3. Apply: preset, file, flags. */
    if (preset_name && *preset_name && tmd_config_apply_preset(cfg, preset_name, err, errlen)) goto done;
    if (config_path && apply_entries(cfg, config_path, entries, ne, 1, err, errlen)) goto done;
    for (int i = 0; i < nf; i++)
        if (tmd_config_set(cfg, flags[i].name, flags[i].value, TMD_SRC_FLAG, flags[i].where, err, errlen)) goto done;
    rc = 0;
done:
    free(entries);
    free(text);
    free(flags);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Resolution and checks                                                                     */

int tmd_config_synthetic(const tmd_config *cfg) { return !strcmp(cfg->data, "synthetic"); }

void tmd_config_note(tmd_config *cfg, const char *fmt, ...) {
    size_t n = strlen(cfg->notes);
    if (n + 2 >= sizeof cfg->notes) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(cfg->notes + n, sizeof cfg->notes - n - 1, fmt, ap);
    va_end(ap);
    if (w < 0 || (size_t)w >= sizeof cfg->notes - n - 1) {
        cfg->notes[n] = 0; /* a cut note would mislead: drop it */
        return;
    }
    strcat(cfg->notes, "\n");
}

void tmd_config_resolve(tmd_config *cfg) {
    int synth = tmd_config_synthetic(cfg);
    if (cfg->model.vocab_size == 0) {
        cfg->model.vocab_size = synth ? cfg->synthetic_vocab : 257;
        cfg->source[find_key("vocab_size")] = TMD_SRC_AUTO;
    }
    if (cfg->model.dense_ffn_size == 0) {
        /* In 64 bits: validate refuses an absurd d_model, but only after this. */
        int64_t f = 4 * (int64_t)cfg->model.d_model;
        cfg->model.dense_ffn_size = f > INT_MAX ? INT_MAX : f < 1 ? 1 : (int)f;
        cfg->source[find_key("dense_ffn_size")] = TMD_SRC_AUTO;
    }
    /* A warmup nobody asked for (the default 30, or a preset's) must not refuse a short run:
     * other trainers clamp it too. One the user wrote stays, and validate refuses it. */
    int wi = find_key("warmup_steps");
    if (cfg->sched.warmup_steps > cfg->sched.total_steps && cfg->sched.total_steps >= 1 &&
        (cfg->source[wi] == TMD_SRC_DEFAULT || cfg->source[wi] == TMD_SRC_PRESET)) {
        tmd_config_note(cfg, "warmup_steps %lld (%s) clamped to steps = %lld: the run is shorter than the warmup",
                        (long long)cfg->sched.warmup_steps, cfg->source[wi] == TMD_SRC_PRESET ? "the preset's" : "default",
                        (long long)cfg->sched.total_steps);
        cfg->sched.warmup_steps = cfg->sched.total_steps;
        cfg->source[wi] = TMD_SRC_AUTO;
    }
    if (isnan(cfg->sched.min_lr)) {
        cfg->sched.min_lr = cfg->sched.lr / 10;
        cfg->source[find_key("min_lr")] = TMD_SRC_AUTO;
    }
    cfg->model.moe.hidden_size = cfg->model.d_model;
    cfg->sgd.weight_decay = cfg->adamw.weight_decay;
    cfg->adamw.lr = cfg->sgd.lr = cfg->sched.lr;
}

/* Name the key a library check message is about. The messages lead with the offending field
 * ("topk = 9 must be in [1, num_experts = 4]") but may mention others; among the mentioned keys,
 * one the user set (preset, file, flag) is the likelier culprit, then the earliest mentioned. */
void tmd_config_explain(const tmd_config *cfg, const char *msg, char *err, size_t errlen) {
    const char *best_at = NULL;
    int best = -1, best_set = 0;
    for (int i = 0; i < NKEYS; i++) {
        const char *field = KEYS[i].field;
        if (!field) continue;
        size_t n = strlen(field);
        int set = cfg->source[i] != TMD_SRC_DEFAULT && cfg->source[i] != TMD_SRC_AUTO;
        for (const char *p = strstr(msg, field); p; p = strstr(p + 1, field)) {
            /* A whole word: not inside a longer identifier ("moe.topk" is fine, "group_topk" is
             * not topk). */
            int left = p == msg || !(isalnum((unsigned char)p[-1]) || p[-1] == '_');
            int right = !(isalnum((unsigned char)p[n]) || p[n] == '_');
            if (!left || !right) continue;
            if (best < 0 || set > best_set || (set == best_set && p < best_at)) best_at = p, best = i, best_set = set;
            break;
        }
    }
    if (best < 0) {
        snprintf(err, errlen, "invalid configuration: %s", msg);
        return;
    }
    char val[128];
    tmd_config_format(cfg, best, val, sizeof val);
    snprintf(err, errlen, "key '%s' = %s: %s", KEYS[best].name, val, msg);
}

#define CHECK(cond, ...)                                                                                               \
    do {                                                                                                               \
        if (!(cond)) return tmd_fail(err, errlen, -1, __VA_ARGS__);                                                    \
    } while (0)

static int validate_keys(const tmd_config *c, char *err, size_t errlen);

/* A range error names the key; this says where its value came from: "run.conf:1: key 'steps' =
 * -1: must be >= 1" (a config file's line, a flag, a preset, the command line of a resume). */
int tmd_config_validate(const tmd_config *c, char *err, size_t errlen) {
    int rc = validate_keys(c, err, errlen);
    if (!rc || !err || strncmp(err, "key '", 5)) return rc;
    const char *q = strchr(err + 5, '\'');
    if (!q || q - (err + 5) >= 64) return rc;
    char name[64];
    memcpy(name, err + 5, (size_t)(q - (err + 5)));
    name[q - (err + 5)] = 0;
    int k = find_key(name);
    if (k < 0 || c->source[k] == TMD_SRC_DEFAULT || !c->origin[k][0]) return rc;
    size_t n = strlen(err), o = strlen(c->origin[k]) + 2;
    if (n + o + 1 > errlen) return rc;
    memmove(err + o, err, n + 1);
    memcpy(err, c->origin[k], o - 2);
    memcpy(err + o - 2, ": ", 2);
    return rc;
}

static int validate_keys(const tmd_config *c, char *err, size_t errlen) {
    /* The driver's own keys. */
    CHECK(c->sched.total_steps >= 1, "key 'steps' = %lld: must be >= 1", (long long)c->sched.total_steps);
    CHECK(c->batch_size >= 1, "key 'batch_size' = %d: must be >= 1", c->batch_size);
    CHECK(c->grad_accum >= 1, "key 'grad_accum' = %d: must be >= 1", c->grad_accum);
    CHECK(c->model.max_seq_len >= 1, "key 'seq_len' = %d: must be >= 1", c->model.max_seq_len);
    CHECK(c->seed >= 0, "key 'seed' = %lld: must be >= 0", (long long)c->seed);
    CHECK(c->threads >= 0, "key 'threads' = %d: must be >= 0 (0: all available)", c->threads);
    CHECK(c->grad_clip >= 0, "key 'grad_clip' = %g: must be >= 0 (0: no clipping)", c->grad_clip);
    CHECK(c->eval_every >= 0, "key 'eval_every' = %d: must be >= 0 (0: at the end only)", c->eval_every);
    CHECK(c->eval_batches >= 0, "key 'eval_batches' = %d: must be >= 0 (0: the whole validation set)", c->eval_batches);
    CHECK(c->log_every >= 1, "key 'log_every' = %d: must be >= 1", c->log_every);
    CHECK(c->sample_tokens >= 0, "key 'sample_tokens' = %d: must be >= 0", c->sample_tokens);
    CHECK(c->temperature >= 0, "key 'temperature' = %g: must be >= 0 (0: greedy)", c->temperature);
    CHECK(c->top_k >= 0, "key 'top_k' = %d: must be >= 0 (0: all tokens)", c->top_k);
    CHECK(c->top_p > 0 && c->top_p <= 1, "key 'top_p' = %g: must be in (0, 1] (1: all tokens)", c->top_p);
    CHECK(c->exit_interval >= 0, "key 'exit_interval' = %lld: must be >= 0 (0: never)", (long long)c->exit_interval);
    CHECK(c->save_every >= 0, "key 'save_every' = %d: must be >= 0 (0: only at the end)", c->save_every);
    CHECK(c->keep_last >= 0, "key 'keep_last' = %d: must be >= 0 (0: keep all)", c->keep_last);
    CHECK(!(c->resume[0] && c->init_from[0]), "keys 'resume' and 'init_from' exclude each other (resume restores "
          "the weights from the checkpoint)");
    CHECK(c->data[0], "key 'data' is empty: give 'synthetic' or a token file");
    CHECK(c->ep_size >= 1, "key 'ep_size' = %d: must be >= 1", c->ep_size);
    CHECK(c->model.moe.router.num_experts % c->ep_size == 0,
          "key 'ep_size' = %d: does not divide num_experts = %d (each rank holds num_experts / ep_size experts)",
          c->ep_size, c->model.moe.router.num_experts);
    CHECK(c->zero >= 0 && c->zero <= 3, "key 'zero' = %d: must be 0, 1, 2 or 3", c->zero);
    CHECK(c->comm_timeout >= 0, "key 'comm_timeout' = %g: must be >= 0 (0: wait forever)", c->comm_timeout);
    /* A rank's MoE layer gets at least one sequence per forward (a last, short evaluation batch may
     * give it only that), and every chunk needs a token of it (tm_moe_forward refuses C > T). */
    CHECK(c->model.moe.overlap_chunks <= c->model.max_seq_len,
          "key 'overlap_chunks' = %d: more than seq_len = %d tokens; each chunk needs a token, and a rank's MoE layer "
          "may get a single sequence (the last evaluation batch)", c->model.moe.overlap_chunks, c->model.max_seq_len);
    if (tmd_config_synthetic(c)) {
        CHECK(c->synthetic_vocab >= 2 && c->synthetic_vocab <= 1024, "key 'synthetic_vocab' = %d: must be in [2, 1024]",
              c->synthetic_vocab);
        CHECK(c->synthetic_k >= 1 && c->synthetic_k <= c->synthetic_vocab,
              "key 'synthetic_k' = %d: must be in [1, synthetic_vocab = %d]", c->synthetic_k, c->synthetic_vocab);
        CHECK(c->model.vocab_size >= c->synthetic_vocab,
              "key 'vocab_size' = %d: smaller than the synthetic source's synthetic_vocab = %d", c->model.vocab_size,
              c->synthetic_vocab);
        CHECK(!c->val_data[0], "key 'val_data' = '%s': synthetic data has its own validation stream; leave it empty",
              c->val_data);
        CHECK(c->model.max_seq_len >= 2, "key 'seq_len' = %d: synthetic sequences need >= 2 tokens",
              c->model.max_seq_len);
    } else if (!c->val_data[0]) {
        CHECK(c->val_fraction > 0 && c->val_fraction < 1,
              "key 'val_fraction' = %g: must be in (0, 1) (or give val_data)", c->val_fraction);
    }
    /* A text preset without its text: say what to give, not what the sample prompt needs. */
    if (c->sample_prompt[0] && tmd_config_synthetic(c) && c->source[find_key("sample_prompt")] == TMD_SRC_PRESET)
        CHECK(0,
              "preset %s trains on text: give --data TOKENS, a token file made from any text by 'tinymoe tokenize "
              "input.txt tokens.bin --val-fraction 0.1' (then also --val_data tokens_val.bin)",
              c->preset);
    if (c->sample_prompt[0])
        CHECK((c->model.vocab_size == 257 || c->tokenizer[0]) && !tmd_config_synthetic(c),
              "key 'sample_prompt' = '%s': sampling text needs a byte-level model (token data from 'tinymoe tokenize', "
              "vocab_size 257) or key 'tokenizer'",
              c->sample_prompt);
    CHECK(!c->tokenizer[0] || !tmd_config_synthetic(c),
          "key 'tokenizer' = '%s': synthetic data has no text; give --data, token files made with it", c->tokenizer);
    CHECK(c->top_k <= c->model.vocab_size, "key 'top_k' = %d: larger than vocab_size = %d", c->top_k,
          c->model.vocab_size);
    /* Every number within its key's range (after the checks above, whose messages say more). */
    for (int i = 0; i < NKEYS; i++) {
        const key *k = &KEYS[i];
        if (k->type != T_INT && k->type != T_I64 && k->type != T_FLOAT) continue;
        const void *p = field_cptr(c, k);
        double v = k->type == T_INT ? *(const int *)p : k->type == T_I64 ? (double)*(const int64_t *)p : *(const double *)p;
        if ((k->flags & AUTO_OK) && (k->type == T_FLOAT ? isnan(v) : v == 0)) continue;
        if (!(v >= k->lo && v <= k->hi)) {
            char val[64];
            tmd_config_format(c, i, val, sizeof val);
            return tmd_fail(err, errlen, -1, "key '%s' = %s: outside its valid range [%.15g, %.15g]", k->name, val, k->lo,
                            k->hi);
        }
    }
    const tm_router_config *rt = &c->model.moe.router;
    CHECK(c->model.moe.capacity_factor <= (double)rt->num_experts / rt->topk,
          "key 'capacity_factor' = %g: must be 0 (dropless) or at most num_experts / topk = %d / %d = %g, where every "
          "expert can already take every token",
          c->model.moe.capacity_factor, rt->num_experts, rt->topk, (double)rt->num_experts / rt->topk);
    if (tmd_config_synthetic(c)) {
        double table = (double)c->synthetic_vocab * c->synthetic_vocab * c->synthetic_k;
        CHECK(table <= TMD_SYNTH_MAX_TRANSITIONS,
              "keys 'synthetic_vocab' = %d and 'synthetic_k' = %d: the synthetic source would have synthetic_vocab^2 x "
              "synthetic_k = %.0f transitions, more than %d (a smaller synthetic_vocab or synthetic_k)",
              c->synthetic_vocab, c->synthetic_k, table, TMD_SYNTH_MAX_TRANSITIONS);
    }
    {
        char e[1024];
        if (tmd_footprint_check(c, e, sizeof e)) return tmd_fail(err, errlen, -1, "%s", e);
    }
    CHECK(!(c->device == TMD_DEVICE_CUDA && tm_cuda_device_count() == 0),
          "key 'device' = cuda: this build has no CUDA backend or no CUDA device is visible (--device cpu runs on "
          "the CPU; checkpoints of either device load on the other)");

    /* The library is the one authority on its own fields: run its checks now, so that nothing
     * is written for a configuration the model or the optimizer would reject later. */
    tm_ctx_options o = tm_ctx_options_default();
    o.num_threads = 1;
    tm_ctx *ctx = NULL;
    if (tm_ctx_new(&ctx, &o)) return tmd_fail(err, errlen, -1, "cannot create a context: %s", tm_last_create_error());
    int rc = 0;
    tm_tensor *p = NULL;
    tm_optimizer *opt = NULL;
    int64_t one = 1;
    if (tm_model_config_check(ctx, &c->model) || tm_lr_schedule_check(ctx, &c->sched)) {
        tmd_config_explain(c, tm_ctx_errmsg(ctx), err, errlen);
        rc = -1;
    } else if (tm_param_new(ctx, "check", TM_F32, 1, &one, tm_cpu(), &p) ||
               (c->optimizer == TMD_OPT_ADAMW ? tm_adamw_new(ctx, &c->adamw, &opt) : tm_sgd_new(ctx, &c->sgd, &opt))) {
        /* A throwaway optimizer over one parameter runs exactly the checks of the real one. */
        tmd_config_explain(c, tm_ctx_errmsg(ctx), err, errlen);
        rc = -1;
    }
    tm_optimizer_free(opt);
    tm_ctx_free(ctx);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Printing                                                                                  */

static void format_value(const tmd_config *cfg, int i, char *buf, size_t len, int exact);

void tmd_config_format(const tmd_config *cfg, int i, char *buf, size_t len) { format_value(cfg, i, buf, len, 0); }
void tmd_config_format_exact(const tmd_config *cfg, int i, char *buf, size_t len) { format_value(cfg, i, buf, len, 1); }

int tmd_config_parse_line(char *line, char **key, char **value, const char **why) {
    return parse_line(line, key, value, why);
}

int tmd_config_key_index(const char *name) { return find_key(name); }

int tmd_config_key_layout(int i) { return i >= 0 && i < NKEYS && KEYS[i].group == G_DIST; }

int tmd_config_key_resumable(int i, int for_eval) {
    if (i < 0 || i >= NKEYS) return 0;
    if (for_eval && (KEYS[i].group == G_DATA || !strcmp(KEYS[i].name, "batch_size"))) return 1;
    /* Run settings, the thread count, the CPU and grouped GEMMs and the device change nothing of the trained state;
     * steps may grow (train longer: a decaying schedule then decays over the new total). */
    /* The parallel layout too: checkpoints hold logical tensors. */
    return KEYS[i].group == G_RUN || KEYS[i].group == G_DIST || !strcmp(KEYS[i].name, "threads") ||
           !strcmp(KEYS[i].name, "cpu_gemm") || !strcmp(KEYS[i].name, "grouped_gemm") || !strcmp(KEYS[i].name, "device") || !strcmp(KEYS[i].name, "steps") ||
           !strcmp(KEYS[i].name, "skip_nonfinite");
}

static void format_value(const tmd_config *cfg, int i, char *buf, size_t len, int exact) {
    if (i < 0 || i >= NKEYS) {
        snprintf(buf, len, "?");
        return;
    }
    const key *k = &KEYS[i];
    const void *p = field_cptr(cfg, k);
    switch (k->type) {
    case T_INT:
        if ((k->flags & AUTO_OK) && *(const int *)p == 0) snprintf(buf, len, "auto");
        else snprintf(buf, len, "%d", *(const int *)p);
        break;
    case T_I64: snprintf(buf, len, "%lld", (long long)*(const int64_t *)p); break;
    case T_FLOAT:
        if (isnan(*(const double *)p)) snprintf(buf, len, "auto");
        else snprintf(buf, len, exact ? "%.17g" : "%.10g", *(const double *)p);
        break;
    case T_BOOL: snprintf(buf, len, "%s", *(const int *)p ? "true" : "false"); break;
    case T_ENUM: enum_name(k->values, *(const int *)p, buf, len); break;
    case T_STR: {
        /* Quote strings that a config file would otherwise misread. */
        const char *s = (const char *)p;
        int plain = *s && !strpbrk(s, "#\"\n\t\\") && !isspace((unsigned char)s[0]) &&
                    !isspace((unsigned char)s[strlen(s) - 1]);
        if (plain) {
            snprintf(buf, len, "%s", s);
            break;
        }
        size_t w = 0;
        if (len < 3) {
            snprintf(buf, len, "\"");
            break;
        }
        buf[w++] = '"';
        for (; *s && w + 4 < len; s++) {
            const char *esc = *s == '\n' ? "\\n" : *s == '\t' ? "\\t" : *s == '"' ? "\\\"" : *s == '\\' ? "\\\\" : NULL;
            if (esc) buf[w++] = esc[0], buf[w++] = esc[1];
            else buf[w++] = *s;
        }
        buf[w++] = '"';
        buf[w] = 0;
        break;
    }
    }
}

static const char *const SOURCE_NAME[] = {"", "preset", "config file", "flag", "auto", "checkpoint", "init_from"};

void tmd_config_print(const tmd_config *cfg, FILE *f) {
    for (int g = 0; g < G_COUNT; g++) {
        fprintf(f, "# %s\n", GROUP_TITLE[g]);
        for (int i = 0; i < NKEYS; i++) {
            if (KEYS[i].group != (key_group)g) continue;
            char v[TMD_PATH_MAX + 16];
            tmd_config_format(cfg, i, v, sizeof v);
            if (cfg->source[i] != TMD_SRC_DEFAULT)
                fprintf(f, "%-20s = %-24s # %s\n", KEYS[i].name, v, SOURCE_NAME[cfg->source[i]]);
            else fprintf(f, "%-20s = %s\n", KEYS[i].name, v);
        }
    }
}

void tmd_config_help(FILE *f) {
    fprintf(f,
            "keys (--key value, --key=value, or 'key = value' in a --config file; flags win):\n"
            "  %-19s %-10s %s\n",
            "name", "default", "meaning (type and valid range, or values)");
    for (int g = 0; g < G_COUNT; g++) {
        fprintf(f, "\n%s\n", GROUP_TITLE[g]);
        for (int i = 0; i < NKEYS; i++) {
            const key *k = &KEYS[i];
            if (k->group != (key_group)g) continue;
            char what[96];
            if (k->type == T_INT || k->type == T_I64 || k->type == T_FLOAT)
                snprintf(what, sizeof what, "%s in [%.15g, %.15g]", type_name(k), k->lo, k->hi);
            else
                snprintf(what, sizeof what, "%s", k->type == T_ENUM ? k->values : type_name(k));
            fprintf(f, "  %-19s %-10s %s (%s)\n", k->name, *k->def ? k->def : "''", k->help, what);
        }
    }
    fprintf(f, "\npresets (--preset NAME, applied before the config file and the flags):\n");
    for (int p = 0; p < NPRESETS; p++) {
        fprintf(f, "  %-12s %s\n              ", PRESETS[p].name, PRESETS[p].about);
        for (const char *const *it = PRESETS[p].items; *it; it++) fprintf(f, " %s", *it);
        fprintf(f, "\n");
    }
}

int tmd_config_num_keys(void) { return NKEYS; }
const char *tmd_config_key_name(int i) { return i >= 0 && i < NKEYS ? KEYS[i].name : NULL; }
