/*
 * config.h — the configuration of `tinymoe train / eval`: one table of keys.
 *
 * Every setting is a key of TMD_KEYS (config.c): its name, type, default, one-line meaning and
 * where it goes (a field of tm_model_config, tm_moe_config, tm_router_config, tm_adamw_config,
 * tm_sgd_config, tm_lr_schedule, or the driver's own settings). The parser, the --help text, the
 * printed resolved config and the error messages all come from that table, so a new key is one
 * row.
 *
 * Sources, later ones win: the defaults; a preset (--preset NAME, or `preset = NAME` in the
 * file); the config file (--config FILE: `key = value` lines, `#` comments, blank lines, values
 * optionally in double quotes with \n \t \" \\ escapes); the flags (--key value or --key=value;
 * dashes in a flag name read as underscores; a bool flag alone means true).
 *
 * Functions return 0, or -1 with a message in err naming the key, the value and where it came
 * from (file and line, or flag): the caller prints it and exits with status 2.
 */
#ifndef TMD_CONFIG_H
#define TMD_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tinymoe.h"

#define TMD_PATH_MAX 512

typedef enum tmd_optimizer_kind { TMD_OPT_ADAMW = 0, TMD_OPT_SGD = 1 } tmd_optimizer_kind;
typedef enum tmd_dtype_kind { TMD_DTYPE_F32 = 0, TMD_DTYPE_BF16 = 1 } tmd_dtype_kind;
typedef enum tmd_device_kind { TMD_DEVICE_CPU = 0, TMD_DEVICE_CUDA = 1 } tmd_device_kind;

/* Where a key's current value came from (printed next to non-defaults). */
typedef enum tmd_source {
    TMD_SRC_DEFAULT = 0, TMD_SRC_PRESET, TMD_SRC_FILE, TMD_SRC_FLAG, TMD_SRC_AUTO, TMD_SRC_CKPT,
    TMD_SRC_INIT_FROM /* an --init-from export's config.json */
} tmd_source;

#define TMD_MAX_KEYS 96

typedef struct tmd_config {
    /* Model and MoE keys land directly in the library's structs. vocab_size 0 and
     * dense_ffn_size 0 mean "auto" until tmd_config_resolve. moe.hidden_size follows d_model. */
    tm_model_config model;
    tm_adamw_config adamw; /* beta1, beta2, eps, weight_decay (lr comes from sched) */
    tm_sgd_config sgd;     /* momentum, nesterov (lr and weight_decay copied at build) */
    tm_lr_schedule sched;  /* lr_schedule, lr, min_lr, warmup_steps, steps (total_steps), decay_fraction */
    int optimizer;         /* tmd_optimizer_kind */
    double grad_clip;      /* 0: no clipping (the norm is still measured) */
    int batch_size, grad_accum;
    int skip_nonfinite; /* steps with a non-finite loss or gradient norm skipped before stopping */
    int64_t seed;
    int threads;
    int cpu_gemm; /* TM_CPU_GEMM_AUTO / TM_CPU_GEMM_BUILTIN */
    int grouped_gemm; /* TM_GROUPED_GEMM_CUBLASLT / _DEVICE / _HOPPER */
    int device; /* tmd_device_kind */
    int dtype;  /* tmd_dtype_kind */
    char data[TMD_PATH_MAX], val_data[TMD_PATH_MAX];
    double val_fraction;
    int synthetic_vocab, synthetic_k;
    int eval_every, eval_batches, log_every;
    int progress; /* TMD_PROGRESS_*: how rank 0 shows training (log.h) */
    char out[TMD_PATH_MAX];
    char tensorboard[TMD_PATH_MAX]; /* TensorBoard event files go here (empty: none) */
    int save_every, keep_last, overwrite, allow_data_change;
    int async_save; /* checkpoints written by a background thread (rundir.h) */
    int64_t exit_interval;
    char resume[TMD_PATH_MAX], init_from[TMD_PATH_MAX];
    char sample_prompt[TMD_PATH_MAX];
    char tokenizer[TMD_PATH_MAX]; /* a Hugging Face tokenizer.json ("": bytes) */
    int sample_tokens;
    double temperature;
    int top_k;
    double top_p;
    char preset[32];
    int ep_size, ep_strategy, zero; /* the parallel layout (tm_comm_options) */
    int nccl; /* TM_NCCL_AUTO / _OFF / _ALWAYS (tm_comm_options.nccl) */
    int comm_overlap; /* tm_comm_options.overlap */
    int comm_sms;     /* tm_comm_options.comm_sms */
    int grad_sync_overlap;     /* 0 auto, 1 true, 2 false: step.c arms tm_comm_sync_grads_in_backward */
    double grad_sync_chunk_mb; /* tm_comm_options.grad_sync_chunk_bytes, in MiB */
    int zero3_keep_last; /* tm_comm_options.zero3_keep_last */
    double comm_timeout;
    int print_layout;
    unsigned char source[TMD_MAX_KEYS]; /* tmd_source of each key, by table index */
    /* where each key set since its default came from, for messages: "run.conf:3", "flag
     * --steps", "preset shakespeare", "the command line"; "" for defaults */
    char origin[TMD_MAX_KEYS][96];
    /* One line per value tmd_config_resolve (or the run's setup) changed from what was asked:
     * a clamp the user should hear about, printed with the resolved config. Not a key. */
    char notes[512];
} tmd_config;

/* Every key at its default. */
void tmd_config_defaults(tmd_config *cfg);

/* Parse `tinymoe train` style arguments (everything after the subcommand): --config FILE,
 * --preset NAME, --key value / --key=value. Starts from the defaults. *help is set when --help
 * or -h was seen (nothing else is then checked). */
int tmd_config_from_args(tmd_config *cfg, int argc, char **argv, int *help, char *err, size_t errlen);

/* Set one key from text; `where` names the source for messages ("line 3 of run.cfg",
 * "flag --lr"). */
int tmd_config_set(tmd_config *cfg, const char *key, const char *value, tmd_source src, const char *where, char *err,
                   size_t errlen);
/* Apply a named preset (tiny, small, shakespeare, coarse, fine). */
int tmd_config_apply_preset(tmd_config *cfg, const char *name, char *err, size_t errlen);

/* 1 when data is the embedded synthetic source. */
int tmd_config_synthetic(const tmd_config *cfg);
/* Fill the "auto" values that do not need the data: vocab_size (synthetic_vocab for synthetic
 * data, 257 for token files), dense_ffn_size (4 * d_model), moe.hidden_size (d_model). A
 * warmup_steps that the user did not set (the default, or a preset's) and that exceeds steps is
 * clamped to steps, with a note; one set in a config file or a flag is left for validate to
 * refuse. */
void tmd_config_resolve(tmd_config *cfg);
/* Append one line to cfg->notes (printf-style; dropped when full). */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void tmd_config_note(tmd_config *cfg, const char *fmt, ...);
/* Semantic checks after resolve: the driver's own (every number within its key's range,
 * combinations, the memory the model needs against the machine's) and the library's
 * (tm_model_config_check, tm_lr_schedule_check, the optimizer's field checks), every message
 * naming the key, its value and the valid range. */
int tmd_config_validate(const tmd_config *cfg, char *err, size_t errlen);
/* Rewrite a library check message (which names a struct field, e.g. "moe.router.topk") so that
 * it names the config key instead; used for errors raised when the model or optimizer is built. */
void tmd_config_explain(const tmd_config *cfg, const char *libmsg, char *err, size_t errlen);

/* `key = value` for every key, grouped, marking where non-defaults came from. */
void tmd_config_print(const tmd_config *cfg, FILE *f);
/* The key table as help text: every key with its type, default and meaning, grouped. */
void tmd_config_help(FILE *f);

/* Introspection for tests and tools. */
int tmd_config_num_keys(void);
const char *tmd_config_key_name(int i);
/* The value of key i as text (what tmd_config_print shows). */
void tmd_config_format(const tmd_config *cfg, int i, char *buf, size_t len);
/* The same, with floats to 17 significant digits so that tmd_config_set reads back the
 * identical double (checkpoint meta). */
void tmd_config_format_exact(const tmd_config *cfg, int i, char *buf, size_t len);
/* Index of a key by name (dashes not translated), -1 if none. */
int tmd_config_key_index(const char *name);
/* 1 when key i may differ between a checkpoint and the run resuming it (run settings:
 * out, logging, evaluation, sampling; threads; device; steps; skip_nonfinite); for_eval:
 * evaluating it (the same plus the data keys and batch_size). */
int tmd_config_key_resumable(int i, int for_eval);
/* 1 when key i describes the parallel layout (ep_size, zero, ...): a resumed run takes it from
 * its own command line, never from the checkpoint (checkpoints hold logical tensors). */
int tmd_config_key_layout(int i);
/* Parse one `key = value` config line in place (the config file syntax: quotes, escapes, '#'
 * comments). Returns 1 for an entry, 0 for a blank or comment line, -1 with *why set. */
int tmd_config_parse_line(char *line, char **key, char **value, const char **why);

#endif
