/* What amx.c, mxfp4_amx.c, attention_amx.c and indexer.c share around the tiles: the target
 * attribute, the one tile configuration they use and its loading, zeroing the sums, one A tile
 * against up to four B tiles, storing the sums, and reading a tile of sums out transposed. */
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

/* The A tile in tmm4 (loaded by the caller) times k <= 4 B tiles of 1 KiB at b, b + step,
 * b + 2 step, ... (in 32-bit units), each product added to sums tile 0 .. k - 1; the B tiles
 * alternate between tmm6 and tmm7, so one loads while the other multiplies. */
static inline AMX void afd_amx_times(const uint32_t *b, size_t step, int k) {
  _tile_loadd(6, b, 64);
  _tile_dpbf16ps(0, 4, 6);
  if (k > 1) {
    _tile_loadd(7, b + step, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  if (k > 2) {
    _tile_loadd(6, b + 2 * step, 64);
    _tile_dpbf16ps(2, 4, 6);
  }
  if (k > 3) {
    _tile_loadd(7, b + 3 * step, 64);
    _tile_dpbf16ps(3, 4, 7);
  }
}

/* Sums tiles 0 .. k - 1 (k <= 4) stored at s, s + 256, ...: [16][16] fp32 each. */
static inline AMX void afd_amx_store_sums(float *s, int k) {
  _tile_stored(0, s, 64);
  if (k > 1) _tile_stored(1, s + 256, 64);
  if (k > 2) _tile_stored(2, s + 512, 64);
  if (k > 3) _tile_stored(3, s + 768, 64);
}

/* Row i of a stored tile of sums c [16][16] read down its column: c[0][i], c[1][i], ... */
static inline AMX __m512 afd_amx_column(const float *c, int i) {
  const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80,
                                          64, 48, 32, 16, 0);
  return _mm512_i32gather_ps(column, c + i, 4);
}
#endif
