/*
 * checkpoint.h — the driver's checkpoints: what goes in the meta blob, where files go, and
 * loading a checkpoint back as a model (for eval, sample, export and resume).
 *
 * A driver checkpoint is a tm_ckpt_save file (docs/checkpoint-format.md) named
 * <out>/ckpt-<step, 8 digits>.tmck whose meta blob is text:
 *
 *     tinymoe-checkpoint 1
 *     [config]
 *     key = value            one line per key of the config table, exact (%.17g floats)
 *     ...
 *     [state]
 *     step = 200             optimizer steps completed
 *     data_position = 400    batches the token-file batcher has produced (<= step x grad_accum)
 *     data_tokens = 1000000  token files only: tokens of the data source, and a fingerprint of
 *     data_fingerprint = 9f3c2a...   them (16 hex digits); val_tokens / val_fingerprint the same
 *                            for val_data. A resume compares them with the files it loads.
 *
 * The tensors are every parameter and buffer of the training context: the weights, the
 * optimizer state (AdamW m and v or SGD momentum, and the optimizer's step counter) and the
 * MoE expert biases. The seed is in the config, and every random draw of training is keyed by
 * (seed, step or data position), so config + state + tensors determine the rest of the run.
 */
#ifndef TMD_CHECKPOINT_H
#define TMD_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "tinymoe.h"

#define TMD_CKPT_EXT ".tmck"

/* What a run trains on: the token counts and fingerprints (tmd_tokens_fingerprint) of its
 * data source (before the validation split) and of val_data, so that resuming notices a file
 * replaced since the checkpoint. Zero where there is none: synthetic data, no val_data, and
 * checkpoints written before they were recorded. */
typedef struct tmd_data_id {
    int64_t data_tokens, val_tokens;
    uint64_t data_hash, val_hash;
} tmd_data_id;

typedef struct tmd_ckpt_state {
    int64_t step;          /* optimizer steps completed */
    int64_t data_position; /* tmd_batcher.position (0 for synthetic data) */
    tmd_data_id data;
} tmd_ckpt_state;

/* A checkpoint loaded as a model, for inference. */
typedef struct tmd_loaded_model {
    tmd_config cfg; /* the checkpoint's configuration (device possibly overridden) */
    tmd_ckpt_state state;
    char path[TMD_PATH_MAX]; /* the file actually read */
    tm_ctx *ctx;
    tm_model *model;
} tmd_loaded_model;

/* <dir>/ckpt-<step, 8 digits>.tmck into path. */
void tmd_ckpt_path(const char *dir, int64_t step, char *path, size_t pathlen);
/* Steps of the ckpt-*.tmck files in dir, ascending (malloc'ed; *n may be 0). */
int tmd_ckpt_list(const char *dir, int64_t **steps, int *n, char *err, size_t errlen);
/* Validate a checkpoint's header, meta and tensor index (tm_ckpt_inspect_flags with
 * TM_CKPT_INDEX_ONLY: the tensors' bytes are validated by the load that reads them), decode its meta, and check the meta
 * against the file's tensors before anything is built from it: the layer count, vocab_size,
 * d_model and the expert shapes it claims must be those of the tensors (a meta edited to
 * claim 10^6 layers would otherwise have a model of 10^6 layers built first), and the state
 * must be sane (data_position <= step x grad_accum, 0 for synthetic data). */
int tmd_ckpt_read_meta(const char *path, tmd_config *cfg, tmd_ckpt_state *state, char *err, size_t errlen);

/* Whether the data a resumed run loaded (`now`) is what the checkpoint `path` was trained on
 * (`was`, from its meta): 0, or TMD_CONFIG_ERROR naming the key ('data' or 'val_data'), both
 * token counts and fingerprints, and --allow_data_change (which the caller honours). Nothing
 * is compared for sources the checkpoint recorded nothing of. */
int tmd_ckpt_check_data(const tmd_data_id *was, const tmd_data_id *now, const tmd_config *cfg, const char *path,
                        char *err, size_t errlen);

/* CKPT is a checkpoint file, or a directory: its newest ckpt-*.tmck (highest step). Fills
 * path; errors name CKPT (no such file, a directory without checkpoints). */
int tmd_ckpt_resolve(const char *ckpt, char *path, size_t pathlen, char *err, size_t errlen);

/* Resolve CKPT, read its config, build the model on `device` (tmd_device_kind; -1: the
 * checkpoint's own) with `threads` CPU threads (0: all) and load its weights (the optimizer
 * state in the file is checked and skipped). The config is validated before the model is
 * built, and the loaded weights must be finite (finite.h). Returns 0, or TMD_CONFIG_ERROR /
 * TMD_RUNTIME_ERROR (status.h) with a message naming the file. On success free with
 * tmd_loaded_model_free. */
int tmd_ckpt_load_model(const char *ckpt, int device, int threads, tmd_loaded_model *out, char *err, size_t errlen);
/* The model's context has no gradient buffers (tm_ctx_options.no_grad_buffers: eval, sample and
 * export only run forwards, and the model is built and loaded in about half the memory and
 * time); tmd_ckpt_load_model_ex with with_grads = 1 makes an ordinary one, on which an
 * optimizer can be made (and its state loaded from the same file, tm_ckpt_load). */
int tmd_ckpt_load_model_ex(const char *ckpt, int device, int threads, int with_grads, tmd_loaded_model *out, char *err,
                           size_t errlen);
/* NULL or zeroed: no-op. */
void tmd_loaded_model_free(tmd_loaded_model *m);

/* The configuration of a run continuing from (or evaluating) a checkpoint: the checkpoint's
 * config `ck`, with the keys the user set explicitly in `cli` (preset, file or flag) that
 * tmd_config_key_resumable(i, for_eval) allows; any other explicitly set key must equal the
 * checkpoint's value, else TMD_CONFIG_ERROR naming the key, both values and `path`. */
int tmd_ckpt_merge_config(const tmd_config *cli, const tmd_config *ck, const char *path, int for_eval,
                          tmd_config *out, char *err, size_t errlen);

/* The meta blob of (cfg, state) as text (see above): malloc'ed, NUL-terminated, length in *len. */
char *tmd_ckpt_meta_encode(const tmd_config *cfg, const tmd_ckpt_state *state, size_t *len);
/* Parse a meta blob: cfg starts from the defaults and takes every key of [config]; state from
 * [state]. Errors name `path` and the offending line. */
int tmd_ckpt_meta_decode(const char *meta, size_t len, const char *path, tmd_config *cfg, tmd_ckpt_state *state,
                         char *err, size_t errlen);

#endif
