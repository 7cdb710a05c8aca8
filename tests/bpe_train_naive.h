/* bpe_train_naive.h — the recount-everything BPE learner (tests/bpe_train_naive.c), the
 * reference of tmd_bpe_learn: same arguments, same result. Returns 0 or -1 (memory). */
#ifndef TT_BPE_TRAIN_NAIVE_H
#define TT_BPE_TRAIN_NAIVE_H

#include "../train/bpe_train.h"

int tt_bpe_learn_naive(const tmd_bpe_word *words, size_t nw, int n_tokens, tmd_bpe_merges *out);

#endif
