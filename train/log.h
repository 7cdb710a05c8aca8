/*
 * log.h — the driver's output: JSON lines for metrics files, and the one-line progress bar
 * drawn on a terminal.
 */
#ifndef TMD_LOG_H
#define TMD_LOG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* One JSON object built in a fixed buffer: {"k": v, ...}. Non-finite numbers become null
 * (JSON has no NaN). Keys are plain identifiers; strings are escaped. */
typedef struct tmd_json {
    char buf[2048];
    size_t n;
    int fields;
} tmd_json;

void tmd_json_begin(tmd_json *j);
void tmd_json_num(tmd_json *j, const char *key, double v);
void tmd_json_int(tmd_json *j, const char *key, int64_t v);
void tmd_json_str(tmd_json *j, const char *key, const char *v);
/* Close the object; returns the text (no newline). */
const char *tmd_json_end(tmd_json *j);

/* Append one object as a line and flush, so a reader (or a crash) sees whole lines. */
int tmd_jsonl_write(FILE *f, tmd_json *j);

/* "1:02:03" or "2:03" for a duration in seconds. */
void tmd_fmt_duration(char *buf, size_t len, double seconds);

/* How training shows progress (key `progress`). */
enum { TMD_PROGRESS_AUTO = 0, TMD_PROGRESS_BAR = 1, TMD_PROGRESS_LINES = 2 };

/* 1 when rank 0's log gets a progress bar: mode BAR, or AUTO on a terminal (isatty(fd)) that is
 * a user's: not under a launcher that hands its ranks a pseudo-terminal of its own (Open MPI:
 * OMPI_COMM_WORLD_SIZE; MPICH / Hydra and PMIx: PMI_RANK, PMIX_RANK; Slurm's srun:
 * SLURM_STEP_ID), and TERM not "dumb". */
int tmd_progress_wanted(int mode, int fd);

/* The width of the terminal on fd in columns (TIOCGWINSZ); 80 when it does not say. */
int tmd_term_cols(int fd);

/* What the progress line shows. */
typedef struct tmd_progress_fields {
    int64_t step, total;
    double elapsed_s, loss, lr, tokens_per_s, load;
} tmd_progress_fields;

/* Redraw the progress line, "\r120/600 [#####.....]  20% loss 2.3456 | lr 3.00e-04 | 51234 tok/s |
 * load 1.20 | ETA 0:42" followed by erase-to-end-of-line, in at most cols - 1 columns: as the
 * width shrinks, the fields go in the order load, lr, tokens/s, the bar (which narrows from 20
 * to 10 cells first), loss, ETA, the percentage; the step count always stays. Returns the
 * columns written (tests). */
int tmd_progress(FILE *f, const tmd_progress_fields *p, int cols);
/* Erase the progress line (before printing a normal line). */
void tmd_progress_clear(FILE *f);

#endif
