/*
 * test_tensorboard.c — `tinymoe train --tensorboard DIR` (issue 23): the CRC-32C of TFRecord
 * against the published check values (RFC 3720 B.4 and the "123456789" check), the records
 * decoded by a reader written here from the format's description, and a training run's event
 * files (one fresh run, then a resume from an earlier checkpoint) read by the `tensorboard`
 * package itself (tests/tensorboard_check.py) against metrics.jsonl. That last test needs a
 * Python with tensorboard (scripts/install-pydeps.sh); without one it is skipped, unless
 * TM_REQUIRE_PYDEPS=1 (CI) makes that a failure.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <unistd.h>

#include "../train/tensorboard.h"
#include "child.h"
#include "common.h"

Test(tensorboard, crc32c_check_values) {
    cr_assert_eq(tmd_crc32c(0, "123456789", 9), 0xE3069283u);
    unsigned char b[32];
    memset(b, 0, sizeof b);
    cr_assert_eq(tmd_crc32c(0, b, 32), 0x8A9136AAu); /* RFC 3720 B.4: 32 bytes of zeros */
    memset(b, 0xff, sizeof b);
    cr_assert_eq(tmd_crc32c(0, b, 32), 0x62A8AB43u); /* 32 bytes of 0xff */
    for (int i = 0; i < 32; i++) b[i] = (unsigned char)i;
    cr_assert_eq(tmd_crc32c(0, b, 32), 0x46DD794Eu); /* 0, 1, ..., 31 */
    /* continuing from a partial CRC gives the CRC of the whole */
    cr_assert_eq(tmd_crc32c(tmd_crc32c(0, b, 13), b + 13, 19), 0x46DD794Eu);
}

/* ---- an independent reader of the few protobuf fields written ---------------------------- */

static uint64_t rd_varint(const unsigned char **p, const unsigned char *end) {
    uint64_t v = 0;
    for (int sh = 0; *p < end; sh += 7) {
        unsigned c = *(*p)++;
        v |= (uint64_t)(c & 0x7f) << sh;
        if (!(c & 0x80)) return v;
    }
    cr_assert_fail("a varint runs past its message");
    return 0;
}

typedef struct ev {
    double wall;
    int64_t step;
    char version[32], tag[64];
    float value;
    int has_value, session_status;
} ev;

/* Decode an Event; unknown fields fail the test (only these are ever written). */
static void decode_event(const unsigned char *p, const unsigned char *end, ev *e) {
    memset(e, 0, sizeof *e);
    while (p < end) {
        uint64_t key = rd_varint(&p, end);
        int field = (int)(key >> 3), wire = (int)(key & 7);
        if (wire == 1) {
            cr_assert_eq(field, 1, "fixed64 field %d", field);
            memcpy(&e->wall, p, 8), p += 8;
        } else if (wire == 0) {
            cr_assert_eq(field, 2, "varint field %d", field);
            e->step = (int64_t)rd_varint(&p, end);
        } else {
            cr_assert_eq(wire, 2, "wire type %d", wire);
            uint64_t n = rd_varint(&p, end);
            const unsigned char *q = p, *qe = p + n;
            cr_assert(qe <= end);
            if (field == 3) {
                cr_assert_lt(n, sizeof e->version);
                memcpy(e->version, q, n);
            } else if (field == 5) { /* Summary { Value value = 1 } */
                cr_assert_eq(rd_varint(&q, qe), (1u << 3) | 2);
                uint64_t vn = rd_varint(&q, qe);
                cr_assert_eq(q + vn, qe, "one value per summary");
                while (q < qe) {
                    uint64_t k = rd_varint(&q, qe);
                    if (k == ((1u << 3) | 2)) {
                        uint64_t tn = rd_varint(&q, qe);
                        cr_assert_lt(tn, sizeof e->tag);
                        memcpy(e->tag, q, tn), q += tn;
                    } else {
                        cr_assert_eq(k, (2u << 3) | 5, "Value field key %llu", (unsigned long long)k);
                        memcpy(&e->value, q, 4), q += 4, e->has_value = 1;
                    }
                }
            } else {
                cr_assert_eq(field, 7, "length-delimited field %d", field);
                cr_assert_eq(rd_varint(&q, qe), 1u << 3);
                e->session_status = (int)rd_varint(&q, qe);
            }
            p = qe;
        }
    }
}

static uint32_t masked(const void *d, size_t n) {
    uint32_t c = tmd_crc32c(0, d, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

/* Every record of the file: its length and both masked CRCs checked. */
static int read_events(const char *path, ev *out, int cap) {
    long len;
    unsigned char *buf = tt_slurp(path, &len);
    cr_assert(buf, "cannot read %s", path);
    int n = 0;
    for (long off = 0; off < len; n++) {
        cr_assert_leq(off + 12, len, "a truncated record header at byte %ld", off);
        uint64_t rl = 0;
        for (int i = 0; i < 8; i++) rl |= (uint64_t)buf[off + i] << (8 * i);
        uint32_t hc = 0, dc = 0;
        for (int i = 0; i < 4; i++) hc |= (uint32_t)buf[off + 8 + i] << (8 * i);
        cr_assert_eq(hc, masked(buf + off, 8), "record %d: header CRC", n);
        cr_assert_leq(off + 12 + (long)rl + 4, len, "record %d runs past the file", n);
        for (int i = 0; i < 4; i++) dc |= (uint32_t)buf[off + 12 + (long)rl + i] << (8 * i);
        cr_assert_eq(dc, masked(buf + off + 12, rl), "record %d: data CRC", n);
        cr_assert_lt(n, cap);
        decode_event(buf + off + 12, buf + off + 12 + rl, &out[n]);
        off += 12 + (long)rl + 4;
    }
    free(buf);
    return n;
}

/* The one event file in dir whose name differs from `not` (NULL: any). */
static void event_file(const char *dir, const char *not, char *path, size_t len) {
    DIR *d = opendir(dir);
    cr_assert(d, "no directory %s", dir);
    struct dirent *e;
    path[0] = 0;
    while ((e = readdir(d)))
        if (strstr(e->d_name, "events.out.tfevents.") == e->d_name) {
            char p[1024];
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            if (not && !strcmp(p, not)) continue;
            cr_assert_eq(path[0], 0, "two event files in %s", dir);
            snprintf(path, len, "%s", p);
        }
    closedir(d);
    cr_assert(path[0], "no event file in %s", dir);
}

Test(tensorboard, records_decode_to_what_was_written) {
    tt_tmpdir_make("tm_tb_");
    char err[1024], path[1024];
    tmd_tb tb;
    cr_assert_eq(tmd_tb_open(&tb, tt_path("a/b"), 0, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tmd_tb_scalar(&tb, "loss/train", 10, 2.5), 0);
    cr_assert_eq(tmd_tb_scalar(&tb, "optim/lr", 300, 3e-4), 0);
    cr_assert_eq(tmd_tb_scalar(&tb, "moe/max_load/layer_07", 1LL << 40, 1.25), 0);
    tmd_tb_close(&tb);
    tmd_tb_close(&tb); /* closing twice is a no-op */
    event_file(tt_path("a/b"), NULL, path, sizeof path);
    ev e[8];
    int n = read_events(path, e, 8);
    cr_assert_eq(n, 4);
    cr_assert_str_eq(e[0].version, "brain.Event:2");
    cr_assert(e[0].wall > 1.6e9 && e[0].wall < 4e9, "wall time %f", e[0].wall);
    cr_assert_str_eq(e[1].tag, "loss/train");
    cr_assert_eq(e[1].step, 10);
    cr_assert_eq(e[1].value, 2.5f);
    cr_assert_str_eq(e[2].tag, "optim/lr");
    cr_assert_eq(e[2].step, 300);
    cr_assert_eq(e[2].value, 3e-4f);
    cr_assert_str_eq(e[3].tag, "moe/max_load/layer_07");
    cr_assert_eq(e[3].step, 1LL << 40);
    cr_assert_eq(e[3].value, 1.25f);
    for (int i = 1; i < n; i++) cr_assert(e[i].has_value && e[i].wall >= e[0].wall);

    /* a resumed run: its file opens with SessionLog START at the first step it redoes */
    cr_assert_eq(tmd_tb_open(&tb, tt_path("a/b2"), 200, err, sizeof err), 0, "%s", err);
    tmd_tb_close(&tb);
    event_file(tt_path("a/b2"), NULL, path, sizeof path);
    n = read_events(path, e, 8);
    cr_assert_eq(n, 2);
    cr_assert_eq(e[1].session_status, 1);
    cr_assert_eq(e[1].step, 201);

    /* a directory under a file: an error naming the key */
    FILE *f = fopen(tt_path("plain"), "w");
    fclose(f);
    cr_assert_neq(tmd_tb_open(&tb, tt_path("plain/tb"), 0, err, sizeof err), 0);
    cr_assert(strstr(err, "tensorboard") && strstr(err, "plain"), "message: %s", err);
    cr_assert_null(tb.f);
    tt_tmpdir_remove();
}

static void check_with_tensorboard(const char *py, const char *tbdir, const char *metrics) {
    char *argv[] = {(char *)py, "tests/tensorboard_check.py", (char *)tbdir, (char *)metrics, "2", NULL};
    int rc = tt_run(argv, tt_path("check.log"), 120, NULL);
    long len;
    char *log = (char *)tt_slurp(tt_path("check.log"), &len);
    cr_assert_eq(rc, 0, "tensorboard's reader disagrees with metrics.jsonl (exit %d):\n%s", rc, log ? log : "");
    cr_log_info("%s", log ? log : "");
    free(log);
}

Test(tensorboard, the_tensorboard_package_reads_a_run_and_its_resume, .timeout = 240) {
    const char *py = tt_python_with("tensorboard");
    if (!py) cr_skip_test("no Python with the tensorboard package (scripts/install-pydeps.sh installs one)");
    tt_tmpdir_make("tm_tbrun_");
    char tb[1024], out[1024];
    snprintf(tb, sizeof tb, "%s", tt_path("tb"));
    snprintf(out, sizeof out, "%s", tt_path("run"));
    /* the default model: 2 MoE layers; a checkpoint every 10 steps */
    char *train[] = {(char *)tt_tinymoe(), "train", "--steps", "30", "--log_every", "5",
                     "--eval_every", "10", "--save_every", "10", "--keep_last", "0", "--sample_tokens", "0",
                     "--async_save", "false", "--out", out, "--tensorboard", tb, NULL};
    int rc = tt_run(train, tt_path("train.log"), 120, NULL);
    cr_assert_eq(rc, 0, "train exit %d", rc);
    char metrics[1100], first[1100], ck[1100];
    snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", out);
    check_with_tensorboard(py, tb, metrics);
    event_file(tb, NULL, first, sizeof first);

    /* Resume from step 10's checkpoint and train to 40: TensorBoard must show steps 15-30 of
     * the resumed run, not both runs' (the older file's events after step 10 are orphaned). */
    snprintf(ck, sizeof ck, "%s/ckpt-00000010.tmck", out);
    /* event files are named by the second they were opened in: the resumed run's sorts after */
    sleep(1);
    char *resume[] = {(char *)tt_tinymoe(), "train", "--resume", ck, "--steps", "40", "--out", out,
                      "--tensorboard", tb, "--async_save", "false", NULL};
    rc = tt_run(resume, tt_path("resume.log"), 120, NULL);
    long len;
    char *log = (char *)tt_slurp(tt_path("resume.log"), &len);
    cr_assert_eq(rc, 0, "resume exit %d:\n%s", rc, log ? log : "");
    free(log);
    char second[1100];
    event_file(tb, first, second, sizeof second);
    ev *e = malloc(512 * sizeof *e);
    int n = read_events(second, e, 512);
    cr_assert_geq(n, 2);
    cr_assert_eq(e[1].session_status, 1, "the resumed run's file does not open with SessionLog START");
    cr_assert_eq(e[1].step, 11);
    free(e);
    check_with_tensorboard(py, tb, metrics);
    tt_tmpdir_remove();
}
