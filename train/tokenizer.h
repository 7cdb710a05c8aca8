/*
 * tokenizer.h — which tokenizer a run, a checkpoint or a sample uses, and text <-> ids through
 * it: the driver's glue between the config key 'tokenizer', the run directory and bpe.h.
 *
 * A run trained with key 'tokenizer' (a Hugging Face tokenizer.json) copies it to
 * <out>/tokenizer.json; the path is also in every checkpoint's config. A checkpoint's tokenizer
 * is, in this order: one named explicitly (sample --tokenizer), tokenizer.json beside the
 * checkpoint file (its run directory), the path its config recorded; none means bytes (ids
 * 0..255, 256 end-of-text), which only a model of vocab_size 257 can use.
 *
 * Functions return 0 or the codes of status.h with a message in err.
 */
#ifndef TMD_TOKENIZER_H
#define TMD_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "bpe.h"
#include "config.h"

#define TMD_TOKENIZER_FILE "tokenizer.json"

/* Load key 'tokenizer' of c (nothing when empty: *out NULL). A resumed run (resume_ckpt: the
 * checkpoint file, or NULL) whose file is gone takes the copy beside the checkpoint. The path
 * read goes to used (used_len bytes). vocab_size set automatically (source TMD_SRC_AUTO) becomes
 * the tokenizer's size; one set explicitly must hold every id of the tokenizer (a larger one,
 * such as llm.c's 50304 for GPT-2's 50257, is fine). */
int tmd_tokenizer_for_run(tmd_config *c, const char *resume_ckpt, tmd_bpe **out, char *used, size_t used_len,
                          char *err, size_t errlen);

/* Copy the file src to <dir>/tokenizer.json atomically (nothing when it is that file already). */
int tmd_tokenizer_copy(const char *src, const char *dir, char *err, size_t errlen);

/* The tokenizer of the model in checkpoint ckpt_path with config cfg (see above); explicit may
 * be NULL. *out is NULL for bytes. found (may be NULL) gets the path used ("" for bytes). A
 * tokenizer with more ids than the model's vocab_size, or a model of vocab_size other than 257
 * with none, is TMD_CONFIG_ERROR with what to give. */
int tmd_tokenizer_for_ckpt(const char *ckpt_path, const tmd_config *cfg, const char *explicit_path, tmd_bpe **out,
                           char *found, size_t foundlen, char *err, size_t errlen);

/* The path of the tokenizer.json to ship with the model of ckpt_path (beside it, else the one
 * its config names, when it exists), or "" for none. */
void tmd_tokenizer_file_of_ckpt(const char *ckpt_path, const tmd_config *cfg, char *path, size_t len);

/* Text as prompt ids (malloc'ed *ids, *n >= 1): through bpe, or its bytes when bpe is NULL;
 * an empty text is the end-of-text token alone. `what` names the text in messages ("--prompt",
 * "key 'sample_prompt'"). TMD_CONFIG_ERROR for an id >= vocab_size or an empty text without an
 * end-of-text token. */
int tmd_prompt_tokens(tmd_bpe *bpe, const char *text, int vocab_size, const char *what, int32_t **ids, int *n,
                      char *err, size_t errlen);

#endif
