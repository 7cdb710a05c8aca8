/*
 * unicode_tab.h — \p{L} and \p{N} as sorted, disjoint, inclusive code point ranges (the
 * generated unicode_tab.c; scripts/gen-unicode-table.py writes it from Python's unicodedata and
 * names the Unicode version). Read by bpe_split.c's class lookup.
 */
#ifndef TMD_UNICODE_TAB_H
#define TMD_UNICODE_TAB_H

#include <stdint.h>

extern const char tmd_unicode_version[];
extern const uint32_t tmd_unicode_L[][2]; /* general categories Lu Ll Lt Lm Lo */
extern const int tmd_unicode_L_n;
extern const uint32_t tmd_unicode_N[][2]; /* general categories Nd Nl No */
extern const int tmd_unicode_N_n;

#endif
