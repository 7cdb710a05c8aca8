/* demo.h — `tinymoe demo`: train a small transformer LM on a synthetic Markov source. */
#ifndef TMD_DEMO_H
#define TMD_DEMO_H

#include <stdint.h>

typedef struct tmd_demo_opts {
    int steps;     /* optimizer steps (>= 1) */
    uint64_t seed; /* data source, initialisation and batches */
    int threads;   /* CPU kernel threads; 0: all available */
    int cuda;      /* 1: run on CUDA device 0 */
    double lr;     /* peak learning rate */
    int log_every; /* print a row every this many steps (and after step 1) */
} tmd_demo_opts;

/* Runs the demo, printing to stdout (errors to stderr); returns a process exit status. */
int tmd_demo(const tmd_demo_opts *o);

#endif
