/*
 * markov.h — a synthetic order-2 Markov source whose optimal cross-entropy is known exactly.
 *
 * Every context (a, b) of two tokens allows K next tokens (drawn without replacement) with
 * probabilities drawn from a flat Dirichlet(1, ..., 1). Sequences start from a context drawn
 * from the chain's stationary distribution pi over contexts, so every window of every
 * sequence is stationary and the best achievable loss of a causal model is, exactly,
 *   position 0 (sees one token):     H1 = H(X1 | X0)             under pi
 *   positions 1..T-1 (see >= 2):     H2 = H(X2 | X0, X1) = sum_ab pi(a,b) H(P(. | a,b))
 *   optimum = (H1 + (T - 1) H2) / T            (nats per token; longer history adds nothing)
 * pi is computed from the transition table by power iteration (no sampling is involved), with
 * a cap on its work so that building any table the driver allows takes seconds at most.
 *
 * Randomness comes from tinymoe's public Philox4x32-10, so the table and every batch depend
 * only on (seed, step, row).
 */
#ifndef TMD_MARKOV_H
#define TMD_MARKOV_H

#include <stdint.h>

/* The largest table the driver builds (synthetic_vocab^2 x synthetic_k transitions): about 50
 * MB and a few seconds to build. */
#define TMD_SYNTH_MAX_TRANSITIONS (1 << 22)

typedef struct tmd_markov {
    int vocab, k;
    int32_t *next;   /* [vocab^2, k] allowed next tokens of context a * vocab + b */
    double *prob;    /* [vocab^2, k] their probabilities */
    double *pi;      /* [vocab^2] stationary distribution over contexts */
    double *pi_cdf;  /* [vocab^2] its cumulative sums, for drawing start contexts */
    double h1, h2;   /* entropies above, in nats */
    int iters;       /* power iterations used */
    double residual; /* L1 change of pi in the last iteration */
} tmd_markov;

/* Build the chain (vocab >= 2, 1 <= k <= vocab). Returns 0, or -1 when out of memory. */
int tmd_markov_init(tmd_markov *m, int vocab, int k, uint64_t seed);
void tmd_markov_free(tmd_markov *m);
/* 1 when the power iteration converged (L1 change <= 1e-14); 0 when it hit its work limit
 * (slowly mixing chains of large tables) and pi, hence the optimum, is approximate. */
int tmd_markov_converged(const tmd_markov *m);
/* Best achievable mean loss over T predicted positions (see the top of this file). */
double tmd_markov_optimal_loss(const tmd_markov *m, int T);
/* Draw a sequence of n >= 2 tokens; `stream` selects an independent substream. */
void tmd_markov_sample(const tmd_markov *m, uint64_t seed, uint64_t stream, int32_t *out, int n);

#endif
