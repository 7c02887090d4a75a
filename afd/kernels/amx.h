/* What amx.c and mxfp4_amx.c share around the tiles: the target attribute, the one tile
 * configuration both use and its loading, zeroing the sums, and reading a tile of sums out
 * transposed. */
#ifndef AFD_AMX_H
#define AFD_AMX_H
#include <immintrin.h>
#include <stdint.h>

#define AMX                                                                                   \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed, aligned(64))) afd_tile_config;

/* Every tile 16 rows of 64 bytes: sums (fp32 16 x 16) in tmm0-3, weights (bf16 16 x 32) in
 * tmm4-5, x (16 pairs of K x 16 rows of x) in tmm6-7. A constant in memory, not built on the
 * stack: GCC 12's _tile_loadconfig tells the compiler it reads only the first 8 bytes, so
 * stores of the rest could be dropped as dead (seen: a SIGILL at the first tile instruction). */
static const afd_tile_config AFD_TILE_CONFIG = {.palette = 1,
                                                .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                                .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

/* The configuration is per thread, and oneDNN loads its own on the same OpenMP threads: each
 * call loads ours (and releases the tiles when done). */
static inline AMX void afd_amx_configure(void) { _tile_loadconfig(&AFD_TILE_CONFIG); }

static inline AMX void afd_amx_zero_sums(void) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

/* Row i of a stored tile of sums c [16][16] read down its column: c[0][i], c[1][i], ... */
static inline AMX __m512 afd_amx_column(const float *c, int i) {
  const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80,
                                          64, 48, 32, 16, 0);
  return _mm512_i32gather_ps(column, c + i, 4);
}
#endif
