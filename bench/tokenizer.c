/*
 * tokenizer.c — the driver's byte-level BPE alone, for bench/tokenizer.sh (which runs the
 * `tokenizers` package on the same files through bench/tokenizer_ref.py and prints the ratios).
 *
 *   build/bench/tokenizer encode TOKENIZER.json TEXT REPS [IDS.u32]
 *       tmd_bpe_encode of the whole text, one thread, REPS times; prints the best seconds and
 *       the id count; IDS.u32 gets the ids (uint32, little-endian) for the reference to compare.
 *       The tokenizer is loaded once, so its piece cache is warm after the first repetition, as
 *       tokenizers' is (both are reported at their best).
 *   build/bench/tokenizer train TEXT N OUT.json REPS
 *       tmd_bpe_train_file (`tokenize --bpe N`: read, split, count, merge, write the JSON), REPS
 *       times; prints the best seconds and the merges.
 * Output: one line "seconds S ids|merges K".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bpe.h"
#include "bpe_train.h"
#include "util.h"

static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *p = malloc((size_t)len + 1);
    if (p && fread(p, 1, (size_t)len, f) != (size_t)len) free(p), p = NULL;
    fclose(f);
    *n = (size_t)len;
    return p;
}

int main(int argc, char **argv) {
    char err[1024];
    if (argc >= 5 && !strcmp(argv[1], "encode")) {
        tmd_bpe *t = NULL;
        if (tmd_bpe_load(argv[2], &t, err, sizeof err)) return fprintf(stderr, "tokenizer: %s\n", err), 1;
        size_t n;
        unsigned char *text = slurp(argv[3], &n);
        if (!text) return fprintf(stderr, "tokenizer: cannot read %s\n", argv[3]), 1;
        int reps = atoi(argv[4]);
        double best = 1e30;
        uint32_t *ids = NULL;
        int64_t k = 0, cap = 0;
        for (int r = 0; r < reps; r++) {
            k = 0;
            double t0 = tmd_now_s();
            if (tmd_bpe_encode(t, (const char *)text, n, &ids, &k, &cap, err, sizeof err))
                return fprintf(stderr, "tokenizer: %s\n", err), 1;
            double dt = tmd_now_s() - t0;
            if (dt < best) best = dt;
        }
        if (argc >= 6) {
            FILE *f = fopen(argv[5], "wb");
            if (!f || fwrite(ids, sizeof *ids, (size_t)k, f) != (size_t)k || fclose(f))
                return fprintf(stderr, "tokenizer: cannot write %s\n", argv[5]), 1;
        }
        printf("seconds %.6f ids %lld\n", best, (long long)k);
        free(ids), free(text);
        tmd_bpe_free(t);
        return 0;
    }
    if (argc == 6 && !strcmp(argv[1], "train")) {
        int reps = atoi(argv[5]), merges = 0;
        double best = 1e30;
        for (int r = 0; r < reps; r++) {
            double t0 = tmd_now_s();
            if (tmd_bpe_train_file(argv[2], atoi(argv[3]), argv[4], &merges, err, sizeof err))
                return fprintf(stderr, "tokenizer: %s\n", err), 1;
            double dt = tmd_now_s() - t0;
            if (dt < best) best = dt;
        }
        printf("seconds %.6f merges %d\n", best, merges);
        return 0;
    }
    fprintf(stderr, "usage: tokenizer encode TOKENIZER.json TEXT REPS [IDS.u32] | train TEXT N OUT.json REPS\n");
    return 2;
}
