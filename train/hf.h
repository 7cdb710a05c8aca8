/*
 * hf.h — tinymoe models as Hugging Face Mixtral checkpoints (docs/hf-export.md).
 *
 * An export directory holds two files:
 *   config.json        MixtralConfig (model_type "mixtral", architectures MixtralForCausalLM)
 *   model.safetensors  the weights in the safetensors format
 *                      (https://huggingface.co/docs/safetensors) under Mixtral's names:
 *     model.embed_tokens.weight                                  [V, H]
 *     model.layers.<i>.input_layernorm.weight                    [H]
 *     model.layers.<i>.self_attn.q_proj.weight                   [n_heads * D, H]
 *     model.layers.<i>.self_attn.k_proj.weight, .v_proj.weight   [n_kv_heads * D, H]
 *     model.layers.<i>.self_attn.o_proj.weight                   [H, n_heads * D]
 *     model.layers.<i>.post_attention_layernorm.weight           [H]
 *     model.layers.<i>.block_sparse_moe.gate.weight              [E, H]
 *     model.layers.<i>.block_sparse_moe.experts.<j>.w1.weight    [F, H]  gate projection
 *     model.layers.<i>.block_sparse_moe.experts.<j>.w3.weight    [F, H]  up projection
 *     model.layers.<i>.block_sparse_moe.experts.<j>.w2.weight    [H, F]  down projection
 *     model.norm.weight                                          [H]
 *     lm_head.weight                                             [V, H]  (absent when tied)
 * HF linear weights are [out, in] (y = x W^T); tinymoe stores [in, out] (y = x W), so every
 * matrix but the embedding is transposed on the way out and back. tinymoe's experts.w0 /
 * experts.w1 / experts.wo [E, ...] are Mixtral's w1 (gate, inside the SiLU) / w3 (up) / w2
 * (down), one HF tensor per expert. Both use rotate-half rotary embeddings and query head h
 * reading key/value head h / (n_heads / n_kv_heads), so q and k rows need no permutation.
 *
 * Only models Mixtral can express are exported (tmd_hf_check_config): a softmax router whose
 * top-k weights sum to one, no groups, no expert bias, no shared experts, no dense layers,
 * scaling 1, dropless, f32 or bf16 weights. Tensors are written in the model's dtypes (the
 * router gate is f32 in bf16 models too), so exporting and importing gives back the same bits.
 *
 * Functions return TMD_OK (0), TMD_CONFIG_ERROR (2: a refused config, an invalid or foreign
 * input file, bad arguments) or TMD_RUNTIME_ERROR (1: I/O or memory failure, a device copy),
 * the codes of status.h, with a message in err naming the file, tensor or config key.
 */
#ifndef TMD_HF_H
#define TMD_HF_H

#include <stddef.h>

#include "checkpoint.h"
#include "tinymoe.h"

#define TMD_HF_CONFIG_FILE "config.json"
#define TMD_HF_WEIGHTS_FILE "model.safetensors"
#define TMD_HF_TOKENIZER_FILE "tokenizer.json"

/* The tokenizer of a byte-level model (vocab_size 257: `tinymoe tokenize`'s bytes plus
 * end-of-text 256) as Hugging Face files in dir: tokenizer.json (the `tokenizers` library's
 * form of it; hf_tokenizer.c says how), tokenizer_config.json (PreTrainedTokenizerFast, eos
 * "<|endoftext|>", model_max_length) and generation_config.json (eos and pad 256), each written
 * atomically (dir is created if missing). tmd_hf_export calls it for vocab_size 257. Returns 0 or a TMD_* code with err. */
/* The code point GPT-2's byte-to-unicode alphabet gives byte b (0..255): Radford et al. 2019,
 * encoder.py bytes_to_unicode() (hf_tokenizer.c). */
unsigned tmd_byte_to_unicode(unsigned b);

/* Append to b the JSON string of a token's bytes s[0, n) in that alphabet (UTF-8, '"' and '\\'
 * escaped): its key in a byte-level tokenizer.json's vocabulary and merges. */
struct tmd_sbuf;
void tmd_json_byte_token(struct tmd_sbuf *b, const unsigned char *s, size_t n);

int tmd_hf_write_byte_tokenizer(const char *dir, int model_max_length, char *err, size_t errlen);

/* tokenizer_config.json (PreTrainedTokenizerFast, eos_token, model_max_length) and
 * generation_config.json (eos_token_id, pad_token_id = eos) in dir, for the tokenizer.json
 * beside them, so that transformers' AutoTokenizer and a text-generation pipeline know where a
 * text ends. eos_text NULL (eos_id ignored): the tokenizer has no end-of-text token, and both
 * files say null. tmd_hf_write_byte_tokenizer writes them for the byte tokenizer, `export` for a
 * run's subword tokenizer (eos: tmd_bpe_eot). Returns 0 or a TMD_* code with err. */
int tmd_hf_write_token_configs(const char *dir, const char *eos_text, int eos_id, int model_max_length, char *err,
                               size_t errlen);

/* Whether Mixtral expresses the model config: 0, or TMD_CONFIG_ERROR with a message naming the
 * first blocking option by its driver key (score_function, pre_softmax / norm_topk_prob,
 * num_groups, expert_bias, shared_ffn_size, first_k_dense, scaling_factor, capacity_factor). */
int tmd_hf_check_config(const tm_model_config *mc, char *err, size_t errlen);

/* Write DIR/config.json and DIR/model.safetensors for `model` (its parameters live in ctx, on
 * any device). DIR is created if missing (parents too). Each file is written to a temporary
 * file in DIR, fsynced and renamed into place (weights first, config.json last), and DIR is
 * fsynced. Refusals (tmd_hf_check_config, a model dtype other than f32 / bf16: "dtype") write
 * nothing. */
int tmd_hf_export(tm_ctx *ctx, tm_model *model, const char *dir, char *err, size_t errlen);
/* `tinymoe export`: the same files from a checkpoint (a file, or a run directory's newest),
 * streamed: the model is built as metadata only (its parameters never get memory), and each
 * parameter is read from the file (tm_ckpt_reader: its CRC checked), checked finite, cut into
 * its HF pieces and written while the next one is read, so that memory holds two parameters
 * and the time is about that of writing the file. out (freed with tmd_loaded_model_free, also
 * after a failure) gets the path, config and state, and a context and model without data;
 * *params and *active the parameter counts (tm_model_num_params). Errors: those of
 * tmd_ckpt_load_model (a missing, corrupt or non-finite tensor: TMD_CONFIG_ERROR naming it) and
 * of tmd_hf_export. */
int tmd_hf_export_ckpt(const char *ckpt, const char *dir, tmd_loaded_model *out, int64_t *params, int64_t *active,
                       char *err, size_t errlen);

/* Read DIR/config.json into *mc: the fields Mixtral defines (vocab_size, hidden_size,
 * intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
 * max_position_embeddings, rms_norm_eps, rope_theta or rope_parameters.rope_theta,
 * tie_word_embeddings, num_local_experts, num_experts_per_tok, initializer_range,
 * router_aux_loss_coef; a field left out takes MixtralConfig's default, as transformers does),
 * everything else at tm_model_config_default() with the router set to Mixtral's (softmax over
 * all experts, top-k renormalised: norm_topk_prob), no groups, bias or shared experts, no
 * dense layers, dropless. *dtype_bf16 (may be NULL) = 1 for torch_dtype (or dtype) "bfloat16",
 * 0 for "float32", "float16" (tinymoe has no f16: its values widen exactly to f32) or none.
 * Errors name the file and the field: not Mixtral (model_type), values tinymoe cannot
 * represent (hidden_act other than silu, head_dim != hidden_size / num_attention_heads, rope
 * scaling, a sliding window shorter than max_position_embeddings), wrong JSON types or ranges.
 * Training-only fields (attention_dropout, router_jitter_noise) are ignored. */
int tmd_hf_read_config(const char *dir, tm_model_config *mc, int *dtype_bf16, char *err, size_t errlen);

/* Load DIR/model.safetensors into `model`, whose config must match the file's shapes (build it
 * from tmd_hf_read_config). The whole file is validated first (header length against the file
 * size, JSON, UTF-8, dtypes, shape products against offsets, offsets inside the data, no
 * overlaps or gaps), then every tensor the model needs must be present with its HF shape and a
 * float dtype (F32, BF16 or F16, converted to the parameter's dtype: exact when widening,
 * round-to-nearest-even into bf16), and no other tensor may be in the file; only then is any
 * parameter written, so a failed import leaves the model unchanged (except for a failing device
 * copy, TMD_RUNTIME_ERROR). Sharded checkpoints (model.safetensors.index.json) are refused. */
int tmd_hf_import(tm_ctx *ctx, tm_model *model, const char *dir, char *err, size_t errlen);

/* `tinymoe export --ckpt PATH [--format hf] --out DIR`: argv holds the arguments after
 * "export". Loads the checkpoint (a file, or a directory: its newest) on the CPU, refuses
 * configs Mixtral cannot express, exports. Prints a summary on stdout and errors on stderr
 * ("tinymoe: export: ..."); returns the exit status (0, 1 runtime, 2 usage or refusal). */
int tmd_export_main(int argc, char **argv);

#endif
