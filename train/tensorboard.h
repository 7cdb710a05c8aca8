/*
 * tensorboard.h — TensorBoard event files for `tinymoe train --tensorboard DIR`: scalar
 * summaries that the `tensorboard` package (and anything reading TensorFlow's event files)
 * shows, written without TensorFlow or a protobuf library (see tensorboard.c for the format).
 */
#ifndef TMD_TENSORBOARD_H
#define TMD_TENSORBOARD_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "config.h"

typedef struct tmd_tb {
    FILE *f;
    char path[TMD_PATH_MAX + 384];
} tmd_tb;

/* Create dir (mkdir -p) and a new event file in it, events.out.tfevents.<unix s>.<host>.<pid>.0,
 * whose first record is the file version "brain.Event:2". start_step > 0 (a resumed run)
 * writes a SessionLog START at step start_step + 1 next: TensorBoard then drops the events of
 * earlier files at steps >= start_step + 1, the ones the resumed run redoes. Returns 0, or -1
 * with a message in err naming the path. */
int tmd_tb_open(tmd_tb *tb, const char *dir, int64_t start_step, char *err, size_t errlen);

/* One scalar (Summary.Value.simple_value, a float) under tag at step, stamped with the wall
 * clock. Buffered: tmd_tb_flush makes it visible. Returns 0, or -1 when the write failed. */
int tmd_tb_scalar(tmd_tb *tb, const char *tag, int64_t step, double value);
int tmd_tb_flush(tmd_tb *tb);

/* Flush and close; a no-op on a closed or never opened writer. */
void tmd_tb_close(tmd_tb *tb);

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of n bytes, continuing from crc (0 to
 * start): TFRecord's checksum. crc32c("123456789") = 0xE3069283. */
uint32_t tmd_crc32c(uint32_t crc, const void *data, size_t n);

#endif
