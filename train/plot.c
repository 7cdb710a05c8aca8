/* plot.c — bounded recording and hand-written SVG plots; see plot.h. */
#include "plot.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomic.h"
#include "util.h"

/* ---------------------------------------------------------------------------------------- */
/* Bins                                                                                      */

int tmd_bins_init(tmd_bins *b, int rows, int cap) {
    memset(b, 0, sizeof *b);
    if (rows < 1 || cap < 2) return -1;
    cap += cap & 1; /* pairs merge */
    b->rows = rows;
    b->cap = cap;
    b->width = 1;
    b->sum = calloc((size_t)cap * (size_t)rows, sizeof *b->sum);
    b->step_sum = calloc((size_t)cap, sizeof *b->step_sum);
    b->count = calloc((size_t)cap, sizeof *b->count);
    if (!b->sum || !b->step_sum || !b->count) {
        tmd_bins_free(b);
        return -1;
    }
    return 0;
}

void tmd_bins_free(tmd_bins *b) {
    free(b->sum);
    free(b->step_sum);
    free(b->count);
    memset(b, 0, sizeof *b);
}

static void merge_pairs(tmd_bins *b) {
    int R = b->rows;
    for (int i = 0; i < b->cap / 2; i++) {
        int a = 2 * i, c = 2 * i + 1;
        for (int r = 0; r < R; r++) b->sum[(size_t)i * R + r] = b->sum[(size_t)a * R + r] + b->sum[(size_t)c * R + r];
        b->step_sum[i] = b->step_sum[a] + b->step_sum[c];
        b->count[i] = b->count[a] + b->count[c];
    }
    memset(b->sum + (size_t)(b->cap / 2) * R, 0, sizeof *b->sum * (size_t)(b->cap / 2) * R);
    memset(b->step_sum + b->cap / 2, 0, sizeof *b->step_sum * (size_t)(b->cap / 2));
    memset(b->count + b->cap / 2, 0, sizeof *b->count * (size_t)(b->cap / 2));
    b->n = (b->n + 1) / 2;
    b->width *= 2;
}

void tmd_bins_add(tmd_bins *b, int64_t step, const double *v) {
    if (!b->sum || step < 0) return;
    while (step / b->width >= b->cap) merge_pairs(b);
    int i = (int)(step / b->width);
    if (i >= b->n) b->n = i + 1;
    for (int r = 0; r < b->rows; r++) b->sum[(size_t)i * b->rows + r] += v[r];
    b->step_sum[i] += (double)step;
    b->count[i]++;
}

/* ---------------------------------------------------------------------------------------- */
/* SVG helpers                                                                               */

/* An SVG document being written to an atomic temporary (atomic.h). */
static int svg_open(tmd_atomic *s, const char *path, int w, int h, char *err, size_t errlen) {
    if (tmd_atomic_open(s, path, err, errlen)) return -1;
    fprintf(s->f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
            "font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n"
            "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            w, h, w, h);
    return 0;
}

static int svg_close(tmd_atomic *s, char *err, size_t errlen) {
    fprintf(s->f, "</svg>\n");
    return tmd_atomic_commit(s, err, errlen) ? -1 : 0;
}

/* Text with XML's five special characters escaped. */
static void svg_text(FILE *f, double x, double y, const char *anchor, const char *extra, const char *text) {
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\"%s%s>", x, y, anchor, extra ? " " : "",
            extra ? extra : "");
    for (const char *c = text; *c; c++) {
        switch (*c) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        case '\'': fputs("&apos;", f); break;
        default: fputc(*c, f);
        }
    }
    fputs("</text>\n", f);
}

/* Tick spacing of 1, 2 or 5 times a power of ten giving about `target` intervals. */
static double nice_step(double range, int target) {
    if (!(range > 0)) return 1;
    double raw = range / target, p = pow(10, floor(log10(raw))), m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
}

static void fmt_tick(char *buf, size_t len, double v, double step) {
    if (fabs(v) < step * 1e-9) v = 0;
    if (fabs(v) >= 1e5 || (step < 1e-3 && v != 0)) snprintf(buf, len, "%.3g", v);
    else {
        int dec = step >= 1 ? 0 : (int)ceil(-log10(step) - 1e-9);
        snprintf(buf, len, "%.*f", dec, v);
    }
}

typedef struct frame {
    double x0, x1, y0, y1; /* data range */
    double px, py, pw, ph; /* plot area in pixels */
} frame;

static double fx(const frame *fr, double x) { return fr->px + (x - fr->x0) / (fr->x1 - fr->x0) * fr->pw; }
static double fy(const frame *fr, double y) { return fr->py + fr->ph - (y - fr->y0) / (fr->y1 - fr->y0) * fr->ph; }

/* Frame, grid, ticks and labels of both axes. */
static void draw_axes(FILE *f, const frame *fr, const char *xlabel, const char *ylabel) {
    char buf[64];
    fprintf(f, "<g stroke=\"#e4e4e4\" stroke-width=\"1\">\n");
    double xs = nice_step(fr->x1 - fr->x0, 8), ys = nice_step(fr->y1 - fr->y0, 6);
    for (double v = ceil(fr->x0 / xs) * xs; v <= fr->x1 + xs * 1e-9; v += xs)
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", fx(fr, v), fr->py, fx(fr, v),
                fr->py + fr->ph);
    for (double v = ceil(fr->y0 / ys) * ys; v <= fr->y1 + ys * 1e-9; v += ys)
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n", fr->px, fy(fr, v), fr->px + fr->pw,
                fy(fr, v));
    fprintf(f, "</g>\n<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#444\"/>\n",
            fr->px, fr->py, fr->pw, fr->ph);
    for (double v = ceil(fr->x0 / xs) * xs; v <= fr->x1 + xs * 1e-9; v += xs) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#444\"/>\n", fx(fr, v),
                fr->py + fr->ph, fx(fr, v), fr->py + fr->ph + 5);
        fmt_tick(buf, sizeof buf, v, xs);
        svg_text(f, fx(fr, v), fr->py + fr->ph + 18, "middle", NULL, buf);
    }
    for (double v = ceil(fr->y0 / ys) * ys; v <= fr->y1 + ys * 1e-9; v += ys) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#444\"/>\n", fr->px - 5, fy(fr, v),
                fr->px, fy(fr, v));
        fmt_tick(buf, sizeof buf, v, ys);
        svg_text(f, fr->px - 8, fy(fr, v) + 4, "end", NULL, buf);
    }
    svg_text(f, fr->px + fr->pw / 2, fr->py + fr->ph + 38, "middle", NULL, xlabel);
    char rot[96];
    snprintf(rot, sizeof rot, "transform=\"rotate(-90 %.1f %.1f)\"", fr->px - 48, fr->py + fr->ph / 2);
    svg_text(f, fr->px - 48, fr->py + fr->ph / 2, "middle", rot, ylabel);
}

/* ---------------------------------------------------------------------------------------- */
/* Line plots                                                                                */

int tmd_svg_lines(const char *path, const char *title, const char *xlabel, const char *ylabel, const tmd_curve *c,
                  int nc, char *err, size_t errlen) {
    enum { W = 800, H = 480 };
    frame fr = {INFINITY, -INFINITY, INFINITY, -INFINITY, 70, 40, W - 70 - 20, H - 40 - 55};
    for (int i = 0; i < nc; i++)
        for (int j = 0; j < c[i].n; j++) {
            if (!isfinite(c[i].x[j]) || !isfinite(c[i].y[j])) continue;
            fr.x0 = fmin(fr.x0, c[i].x[j]), fr.x1 = fmax(fr.x1, c[i].x[j]);
            fr.y0 = fmin(fr.y0, c[i].y[j]), fr.y1 = fmax(fr.y1, c[i].y[j]);
        }
    if (!(fr.x0 <= fr.x1)) fr.x0 = 0, fr.x1 = 1, fr.y0 = 0, fr.y1 = 1; /* nothing finite to draw */
    if (fr.x1 - fr.x0 < 1e-12) fr.x0 -= 0.5, fr.x1 += 0.5;
    if (fr.y1 - fr.y0 < 1e-12) fr.y0 -= 0.5, fr.y1 += 0.5;
    double pad = 0.04 * (fr.y1 - fr.y0);
    fr.y0 -= pad, fr.y1 += pad;

    tmd_atomic s;
    if (svg_open(&s, path, W, H, err, errlen)) return -1;
    FILE *f = s.f;
    svg_text(f, W / 2.0, 24, "middle", "font-size=\"15\" font-weight=\"bold\"", title);
    draw_axes(f, &fr, xlabel, ylabel);
    fprintf(
        f,
        "<defs><clipPath id=\"plot\"><rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/></clipPath></defs>\n",
        fr.px, fr.py, fr.pw, fr.ph);
    for (int i = 0; i < nc; i++) {
        if (c[i].n == 0) continue;
        fprintf(f, "<polyline clip-path=\"url(#plot)\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\"%s points=\"",
                c[i].color, c[i].dashed ? " stroke-dasharray=\"7 5\"" : "");
        for (int j = 0; j < c[i].n; j++)
            if (isfinite(c[i].x[j]) && isfinite(c[i].y[j]))
                fprintf(f, "%s%.1f,%.1f", j ? " " : "", fx(&fr, c[i].x[j]), fy(&fr, c[i].y[j]));
        fprintf(f, "\"/>\n");
        if (c[i].markers)
            for (int j = 0; j < c[i].n; j++)
                if (isfinite(c[i].x[j]) && isfinite(c[i].y[j]))
                    fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", fx(&fr, c[i].x[j]),
                            fy(&fr, c[i].y[j]), c[i].color);
    }
    /* Legend, top right. */
    int shown = 0;
    for (int i = 0; i < nc; i++) shown += c[i].label && *c[i].label;
    if (shown) {
        double lw = 210, lh = 8 + 18.0 * shown, lx = fr.px + fr.pw - lw - 10, ly = fr.py + 10;
        fprintf(f,
                "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"white\" fill-opacity=\"0.9\" "
                "stroke=\"#aaa\"/>\n",
                lx, ly, lw, lh);
        int k = 0;
        for (int i = 0; i < nc; i++) {
            if (!c[i].label || !*c[i].label) continue;
            double y = ly + 15 + 18.0 * k++;
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s/>\n",
                    lx + 8, y - 4, lx + 36, y - 4, c[i].color, c[i].dashed ? " stroke-dasharray=\"7 5\"" : "");
            svg_text(f, lx + 44, y, "start", NULL, c[i].label);
        }
    }
    return svg_close(&s, err, errlen);
}

int tmd_plot_loss(const char *path, const tmd_bins *train, const tmd_bins *val, double optimum, char *err,
                  size_t errlen) {
    int nt = train ? train->n : 0, nv = val ? val->n : 0;
    double *buf = malloc(sizeof *buf * (size_t)(2 * (nt + nv) + 4));
    if (!buf) return tmd_fail(err, errlen, -1, "cannot plot '%s': out of memory", path);
    double *tx = buf, *ty = tx + nt, *vx = ty + nt, *vy = vx + nv, *ox = vy + nv, *oy = ox + 2;
    int mt = 0, mv = 0;
    for (int i = 0; i < nt; i++)
        if (train->count[i]) {
            tx[mt] = train->step_sum[i] / train->count[i] + 1; /* steps count from 1 in the logs */
            ty[mt++] = train->sum[i] / train->count[i];
        }
    for (int i = 0; i < nv; i++)
        if (val->count[i]) {
            vx[mv] = val->step_sum[i] / val->count[i] + 1;
            vy[mv++] = val->sum[i] / val->count[i];
        }
    double xmin = INFINITY, xmax = -INFINITY;
    for (int i = 0; i < mt; i++) xmin = fmin(xmin, tx[i]), xmax = fmax(xmax, tx[i]);
    for (int i = 0; i < mv; i++) xmin = fmin(xmin, vx[i]), xmax = fmax(xmax, vx[i]);
    ox[0] = isfinite(xmin) ? xmin : 0, ox[1] = isfinite(xmax) ? xmax : 1;
    oy[0] = oy[1] = optimum;
    char olabel[64];
    snprintf(olabel, sizeof olabel, "optimum %.4f", optimum);
    tmd_curve c[3] = {
        {"train loss", "#1f77b4", tx, ty, mt, 0, 0},
        {"validation loss", "#ff7f0e", vx, vy, mv, 0, 1},
        {olabel, "#555555", ox, oy, isfinite(optimum) ? 2 : 0, 1, 0},
    };
    int rc =
        tmd_svg_lines(path, "tinymoe: loss", "step", "loss (nats/token)", c, isfinite(optimum) ? 3 : 2, err, errlen);
    free(buf);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Expert-load heatmap                                                                       */

/* Diverging colours: blue (no tokens), near white (balanced, ratio 1), red (ratio >= vmax). */
static void ratio_colour(double r, double vmax, char *buf, size_t len) {
    static const double lo[3] = {59, 76, 192}, mid[3] = {242, 242, 242}, hi[3] = {180, 4, 38};
    double t, c[3];
    if (!(r >= 0)) r = 0;
    if (r <= 1) {
        t = r;
        for (int i = 0; i < 3; i++) c[i] = lo[i] + (mid[i] - lo[i]) * t;
    } else {
        t = fmin(1, (r - 1) / (vmax - 1));
        for (int i = 0; i < 3; i++) c[i] = mid[i] + (hi[i] - mid[i]) * t;
    }
    snprintf(buf, len, "#%02x%02x%02x", (int)lround(c[0]), (int)lround(c[1]), (int)lround(c[2]));
}

int tmd_plot_experts(const char *path, const tmd_bins *loads, int L, int E, const int *layer_ids, char *err,
                     size_t errlen) {
    int rows = L * E;
    if (!loads || loads->rows != rows || L < 1 || E < 1)
        return tmd_fail(err, errlen, -1, "cannot plot '%s': %d x %d expert rows expected", path, L, E);
    int ncol = loads->n;
    double *ratio = malloc(sizeof *ratio * (size_t)(ncol > 0 ? ncol : 1) * (size_t)rows);
    if (!ratio) return tmd_fail(err, errlen, -1, "cannot plot '%s': out of memory", path);
    double vmax = 2;
    for (int j = 0; j < ncol; j++)
        for (int l = 0; l < L; l++) {
            const double *v = loads->sum + (size_t)j * rows + (size_t)l * E;
            double mean = 0;
            for (int e = 0; e < E; e++) mean += v[e] / E;
            for (int e = 0; e < E; e++) {
                double r = loads->count[j] && mean > 0 ? v[e] / mean : NAN;
                ratio[(size_t)j * rows + (size_t)l * E + e] = r;
                if (r > vmax) vmax = r;
            }
        }
    vmax = ceil(vmax);

    double rh = fmax(3, fmin(16, 420.0 / rows));
    double gap = L > 1 ? 6 : 0;
    enum { W = 860 };
    double px = 110, py = 44, pw = W - px - 135, ph = rows * rh + (L - 1) * gap;
    int H = (int)(py + ph + 60);
    tmd_atomic s;
    if (svg_open(&s, path, W, H, err, errlen)) {
        free(ratio);
        return -1;
    }
    FILE *f = s.f;
    svg_text(f, W / 2.0, 24, "middle", "font-size=\"15\" font-weight=\"bold\"",
             "tinymoe: expert load (tokens / mean tokens per expert of the layer)");
    /* Columns: bin j covers steps [j w, (j + 1) w), clipped to the last recorded step. */
    int64_t last_step = 0;
    for (int j = 0; j < ncol; j++)
        if (loads->count[j]) last_step = (j + 1) * loads->width;
    double x0 = 0, x1 = last_step > 0 ? (double)last_step : 1;
    char col[16];
    for (int l = 0; l < L; l++) {
        double gy = py + l * (E * rh + gap);
        for (int e = 0; e < E; e++) {
            double y = gy + e * rh;
            for (int j = 0; j < ncol; j++) {
                double r = ratio[(size_t)j * rows + (size_t)l * E + e];
                if (isnan(r)) continue;
                double xa = px + (j * (double)loads->width - x0) / (x1 - x0) * pw;
                double xb = px + (fmin((j + 1) * (double)loads->width, x1) - x0) / (x1 - x0) * pw;
                ratio_colour(r, vmax, col, sizeof col);
                /* Overlap by half a pixel so no hairline gaps show between cells. */
                fprintf(f, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"/>\n", xa, y,
                        xb - xa + 0.5, rh + 0.3, col);
            }
            if (rh >= 9) {
                char lab[32];
                snprintf(lab, sizeof lab, "e%d", e);
                svg_text(f, px - 6, y + rh / 2 + 4, "end", "font-size=\"10\"", lab);
            }
        }
        char lab[32];
        snprintf(lab, sizeof lab, "layer %d", layer_ids ? layer_ids[l] : l);
        svg_text(f, rh >= 9 ? px - 32 : px - 8, gy + E * rh / 2 + 4, "end", NULL, lab);
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#444\"/>\n", px,
                gy, pw, E * rh);
    }
    /* x axis: steps. */
    char buf[64];
    double xs = nice_step(x1 - x0, 8);
    for (double v = 0; v <= x1 + xs * 1e-9; v += xs) {
        double x = px + (v - x0) / (x1 - x0) * pw;
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#444\"/>\n", x, py + ph, x,
                py + ph + 5);
        fmt_tick(buf, sizeof buf, v, xs);
        svg_text(f, x, py + ph + 18, "middle", NULL, buf);
    }
    snprintf(buf, sizeof buf, "step (%lld per column)", (long long)loads->width);
    svg_text(f, px + pw / 2, py + ph + 40, "middle", NULL, buf);
    /* Colour bar. */
    double bx = px + pw + 30, bw = 16, bh = fmin(ph, 300);
    int nb = 60;
    for (int i = 0; i < nb; i++) {
        double r = vmax * (nb - 1 - i + 0.5) / nb;
        ratio_colour(r, vmax, col, sizeof col);
        fprintf(f, "<rect x=\"%.1f\" y=\"%.2f\" width=\"%.1f\" height=\"%.2f\" fill=\"%s\"/>\n", bx, py + bh * i / nb,
                bw, bh / nb + 0.3, col);
    }
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#444\"/>\n", bx, py,
            bw, bh);
    double ticks[3] = {0, 1, vmax};
    for (int i = 0; i < 3; i++) {
        double y = py + bh * (1 - ticks[i] / vmax);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#444\"/>\n", bx + bw, y, bx + bw + 4,
                y);
        snprintf(buf, sizeof buf, i == 1 ? "1 (balanced)" : "%g", ticks[i]);
        svg_text(f, bx + bw + 7, y + 4, "start", "font-size=\"10\"", buf);
    }
    free(ratio);
    return svg_close(&s, err, errlen);
}
