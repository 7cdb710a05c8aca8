/* markov.c — the synthetic order-2 source of the demo; see markov.h. */
#include "markov.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tinymoe.h"

/* Philox4x32-10 as a stream of uniforms: counter = (i lo, i hi, stream lo, stream hi). */
typedef struct {
    uint32_t key[2];
    uint64_t stream, i;
    uint32_t buf[4];
    int pos;
} rng;

static rng rng_new(uint64_t seed, uint64_t stream) {
    rng r = {{(uint32_t)seed, (uint32_t)(seed >> 32)}, stream, 0, {0}, 4};
    return r;
}
static uint32_t rng_u32(rng *r) {
    if (r->pos == 4) {
        uint32_t ctr[4] = {(uint32_t)r->i, (uint32_t)(r->i >> 32), (uint32_t)r->stream, (uint32_t)(r->stream >> 32)};
        tm_philox4x32_10(ctr, r->key, r->buf);
        r->i++;
        r->pos = 0;
    }
    return r->buf[r->pos++];
}
/* Uniform in (0, 1) with 53 random bits; never 0, so log() is safe. */
static double rng_unit(rng *r) {
    uint64_t hi = rng_u32(r) >> 5, lo = rng_u32(r) >> 6;
    return ((double)(hi * 67108864u + lo) + 0.5) / 9007199254740992.0;
}

/* Power iteration stops at this L1 change of pi. */
#define MARKOV_TOL 1e-14

/* Table, pi, data: disjoint Philox streams. */
enum { STREAM_TABLE = 1 };
static const uint64_t STREAM_DATA = 1ull << 62;

int tmd_markov_init(tmd_markov *m, int vocab, int k, uint64_t seed) {
    memset(m, 0, sizeof *m);
    size_t nctx = (size_t)vocab * vocab;
    m->vocab = vocab;
    m->k = k;
    m->next = malloc(sizeof *m->next * nctx * k);
    m->prob = malloc(sizeof *m->prob * nctx * k);
    m->pi = malloc(sizeof *m->pi * nctx);
    m->pi_cdf = malloc(sizeof *m->pi_cdf * nctx);
    double *tmp = malloc(sizeof *tmp * nctx);
    int *perm = malloc(sizeof *perm * vocab), *swapped = malloc(sizeof *swapped * k);
    if (!m->next || !m->prob || !m->pi || !m->pi_cdf || !tmp || !perm || !swapped) {
        free(tmp);
        free(perm);
        free(swapped);
        tmd_markov_free(m);
        return -1;
    }

    /* Transition table: k distinct tokens by a partial Fisher-Yates shuffle, weights
     * Exp(1) normalised (= a flat Dirichlet draw). */
    rng r = rng_new(seed, STREAM_TABLE);
    for (int v = 0; v < vocab; v++) perm[v] = v;
    for (size_t c = 0; c < nctx; c++) {
        double wsum = 0;
        for (int j = 0; j < k; j++) {
            int s = j + (int)(rng_unit(&r) * (vocab - j));
            if (s >= vocab) s = vocab - 1;
            swapped[j] = s;
            int t = perm[j];
            perm[j] = perm[s];
            perm[s] = t;
            m->next[c * k + j] = perm[j];
            m->prob[c * k + j] = -log(rng_unit(&r));
            wsum += m->prob[c * k + j];
        }
        for (int j = 0; j < k; j++) m->prob[c * k + j] /= wsum;
        /* Undo the swaps in reverse: perm is the identity again for the next context at O(k)
         * instead of O(vocab) (vocab^3 work in all was a minute before the first step). */
        for (int j = k - 1; j >= 0; j--) {
            int t = perm[j];
            perm[j] = perm[swapped[j]];
            perm[swapped[j]] = t;
        }
    }

    /* Stationary distribution of the chain on contexts, (a, b) -> (b, c), by power iteration
     * of the lazy chain (I + P) / 2: same fixed points, but aperiodic, so it converges from the
     * uniform start whatever the cycle structure of the table. */
    for (size_t c = 0; c < nctx; c++) m->pi[c] = 1.0 / (double)nctx;
    m->residual = 1.0;
    /* The iterations a chain needs grow with its mixing time (a vocab 256, k 1 chain takes
     * 33,000), so the work is capped: a bounded start for every allowed table, at the price of
     * an approximate pi (m->residual says how far from converged) for the slowest chains. An
     * iteration costs k visits per context plus three passes over the contexts. */
    const double budget = (double)(1 << 27);
    for (m->iters = 0;
         m->iters < 100000 && m->residual > MARKOV_TOL && (double)m->iters * (double)nctx * (k + 3) < budget;
         m->iters++) {
        for (size_t c = 0; c < nctx; c++) tmp[c] = 0.5 * m->pi[c];
        for (size_t c = 0; c < nctx; c++) {
            size_t b = c % (size_t)vocab;
            for (int j = 0; j < k; j++)
                tmp[b * vocab + (size_t)m->next[c * k + j]] += 0.5 * m->pi[c] * m->prob[c * k + j];
        }
        double diff = 0, sum = 0;
        for (size_t c = 0; c < nctx; c++) sum += tmp[c];
        for (size_t c = 0; c < nctx; c++) {
            tmp[c] /= sum; /* keep the mass at 1 against rounding drift */
            diff += fabs(tmp[c] - m->pi[c]);
        }
        memcpy(m->pi, tmp, sizeof *tmp * nctx);
        m->residual = diff;
    }
    double acc = 0;
    for (size_t c = 0; c < nctx; c++) m->pi_cdf[c] = (acc += m->pi[c]);

    /* H2 = sum_ab pi(a,b) H(P(.|a,b)); H1 = H(X0, X1) - H(X0) with (X0, X1) ~ pi. */
    m->h2 = 0;
    for (size_t c = 0; c < nctx; c++) {
        double h = 0;
        for (int j = 0; j < k; j++) {
            double p = m->prob[c * k + j];
            if (p > 0) h -= p * log(p);
        }
        m->h2 += m->pi[c] * h;
    }
    double hjoint = 0, hfirst = 0;
    for (int a = 0; a < vocab; a++) {
        double pa = 0;
        for (int b = 0; b < vocab; b++) {
            double p = m->pi[(size_t)a * vocab + b];
            pa += p;
            if (p > 0) hjoint -= p * log(p);
        }
        if (pa > 0) hfirst -= pa * log(pa);
    }
    m->h1 = hjoint - hfirst;
    free(tmp);
    free(perm);
    free(swapped);
    return 0;
}

void tmd_markov_free(tmd_markov *m) {
    free(m->next);
    free(m->prob);
    free(m->pi);
    free(m->pi_cdf);
    memset(m, 0, sizeof *m);
}

int tmd_markov_converged(const tmd_markov *m) { return m->residual <= MARKOV_TOL; }

double tmd_markov_optimal_loss(const tmd_markov *m, int T) { return (m->h1 + (T - 1) * m->h2) / T; }

void tmd_markov_sample(const tmd_markov *m, uint64_t seed, uint64_t stream, int32_t *out, int n) {
    rng r = rng_new(seed, STREAM_DATA | stream);
    size_t nctx = (size_t)m->vocab * m->vocab;
    /* Start context ~ pi: first index whose cumulative probability exceeds u. */
    double u = rng_unit(&r) * m->pi_cdf[nctx - 1];
    size_t lo = 0, hi = nctx - 1;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (m->pi_cdf[mid] > u) hi = mid;
        else lo = mid + 1;
    }
    out[0] = (int32_t)(lo / (size_t)m->vocab);
    out[1] = (int32_t)(lo % (size_t)m->vocab);
    for (int t = 2; t < n; t++) {
        size_t c = (size_t)out[t - 2] * m->vocab + (size_t)out[t - 1];
        double v = rng_unit(&r), cum = 0;
        int j = 0;
        for (; j < m->k - 1; j++) {
            cum += m->prob[c * m->k + j];
            if (v < cum) break;
        }
        out[t] = m->next[c * m->k + j];
    }
}
