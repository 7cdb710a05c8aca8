/*
 * plot.h — what the driver records during training, and the SVG plots it draws from it.
 *
 * No dependency: the SVG is written by hand (axes with "nice" ticks, labels, legend, a colour
 * bar). Each file is written atomically (a temporary file in the same directory, then rename),
 * so a reader never sees half a plot. Functions return 0, or -1 with a message in err naming
 * the file.
 */
#ifndef TMD_PLOT_H
#define TMD_PLOT_H

#include <stddef.h>
#include <stdint.h>

/* A bounded record of a per-step quantity with `rows` values per step: at most `cap` bins of
 * `width` steps; when a step falls beyond the last bin, adjacent bins merge pairwise and the
 * width doubles. Memory stays fixed however long the run; the first bins keep their detail
 * until the run is cap steps long. Steps must be added in increasing order (a step may be added
 * several times: its values add up, e.g. per micro-batch). */
typedef struct tmd_bins {
    int rows, cap, n; /* values per step; bins allocated; bins in use */
    int64_t width;    /* steps per bin */
    double *sum;      /* [cap][rows] summed values */
    double *step_sum; /* [cap] sum of the recorded steps (for the bin's mean step) */
    int64_t *count;   /* [cap] records in each bin */
} tmd_bins;

int tmd_bins_init(tmd_bins *b, int rows, int cap);
void tmd_bins_add(tmd_bins *b, int64_t step, const double *values);
void tmd_bins_free(tmd_bins *b);

/* A curve of a line plot. */
typedef struct tmd_curve {
    const char *label, *color;
    const double *x, *y;
    int n;
    int dashed, markers;
} tmd_curve;

/* Line plot: curves over a shared x axis. */
int tmd_svg_lines(const char *path, const char *title, const char *xlabel, const char *ylabel, const tmd_curve *curves,
                  int ncurves, char *err, size_t errlen);

/* Loss plot from the recorded bins: train (1 row) and val (1 row; may be empty) loss vs step,
 * and the optimum as a dashed line when finite. */
int tmd_plot_loss(const char *path, const tmd_bins *train, const tmd_bins *val, double optimum, char *err,
                  size_t errlen);

/* Heatmap of expert load over time from bins of n_layers * n_experts rows (tokens per expert,
 * row-major by MoE layer): x = step (one column per bin), y = (layer, expert) grouped by layer,
 * colour = tokens / the layer's mean tokens per expert in that bin (1 = balanced).
 * layer_ids[i] is the model layer of the i-th MoE layer (for labels). */
int tmd_plot_experts(const char *path, const tmd_bins *loads, int n_layers, int n_experts, const int *layer_ids,
                     char *err, size_t errlen);

#endif
