/* Paged decode attention's scores on AMX tiles (attention.c calls it per sequence, K/V head
 * and group of query heads on the amx path, where a K/V head has 8 query heads or more):
 * s[j, l] = bf16(q_j . k_l) * scale, 16 positions and 16 heads a tile product.
 *
 * One TDPBF16PS takes 16 positions' K rows (32 values of D each: the A operand, row-major as
 * the cache holds them) against every query head at once (the B operand: q with pairs of D
 * interleaved, a column per head, packed once per call), so a position costs D / 32 tile
 * products shared by all the heads, where attention512.c spends D / 32 vdpbf16ps and a share
 * of a 16-way sum tree per head. MLA (16 to 128 heads of 288 to 576 values a K/V head) is
 * bound by those products; GQA's 4 heads of 64 are bound by reading K and V, and there the
 * tiles were no faster in the engine (docs/benchmarks.md), hence the 8-head floor.
 *
 * The sums are the tile's: each pair's products added in fp32, in the tile's order, so a score
 * may differ from attention512.c's in its last fp32 bits and, rarely, after its rounding to
 * bf16 (summation order only, as between the other paths). A head's sums do not depend on
 * its column or on the other heads. The rounding and the scale are the other paths' steps. */
#include <string.h>

#include "amx.h"
#include "attention_amx.h"

/* The K rows of the tile K_AHEAD_AMX tiles on are fetched into L1 as a tile is multiplied
 * (without, the tile loads waited on every row; into L2 they still did, Intel Xeon harness) */
#define K_AHEAD_AMX 2

/* q [g, D] as B operands, one 1 KiB tile per 16 heads and 32 values of D: tile (t, c), row
 * p, column n holds q[16t + n][32c + 2p], q[16t + n][32c + 2p + 1] (zeros past head g). */
static AMX void pack_q(const uint16_t *q, int g, int D, uint32_t *qp) {
  const int C = D / 32, H = (g + 15) / 16;
  memset(qp, 0, (size_t)H * C * 1024);
  for (int j = 0; j < g; j++) {
    const uint32_t *pairs = (const uint32_t *)(q + (size_t)j * D);
    uint32_t *tile = qp + (size_t)(j / 16) * C * 256;
    for (int c = 0; c < C; c++)
      for (int p = 0; p < 16; p++) tile[(size_t)c * 256 + p * 16 + j % 16] = pairs[c * 16 + p];
  }
}

/* The 16 positions' rows from l0 (n of them), columns 32c.. as an A tile in tmm4: in place
 * where direct, else through rows (zeros past n). */
static inline AMX void load_k(const uint16_t *cache, const int64_t *row, int l0, int n, int c,
                              int D, int direct, uint16_t *rows) {
  if (direct) {
    _tile_loadd(4, cache + row[l0] + 32 * c, D * 2);
    return;
  }
  for (int i = 0; i < 16; i++)
    if (i < n)
      memcpy(rows + 32 * i, cache + row[l0 + i] + 32 * c, 64);
    else
      memset(rows + 32 * i, 0, 64);
  _tile_loadd(4, rows, 64);
}

AMX void afd_attn_amx_scores(const uint16_t *q, const uint16_t *cache, const int64_t *row,
                             int len, int g, int D, float scale, float *s, void *scratch) {
  const int C = D / 32, H = (g + 15) / 16;
  uint32_t *qp = (uint32_t *)scratch;                             /* H C KiB: q packed */
  uint16_t *rows = (uint16_t *)((char *)scratch + H * C * 1024); /* 1 KiB: K rows copied */
  float *sums = (float *)((char *)scratch + (H * C + 1) * 1024);  /* 4 KiB: 4 tiles of sums */
  const __m256 vscale = _mm256_set1_ps(scale);
  pack_q(q, g, D, qp);
  afd_amx_configure();
  for (int l0 = 0; l0 < len; l0 += 16) {
    const int n = len - l0 < 16 ? len - l0 : 16;
    /* 16 rows each D values after the last (one block, or blocks that follow each other):
     * loaded in place; otherwise (the last few positions, or blocks apart) copied first */
    int direct = n == 16;
    for (int i = 1; i < 16 && direct; i++) direct = row[l0 + i] == row[l0] + (int64_t)i * D;
    for (int i = 0; i < 16; i++) { /* every line of those rows */
      const int ahead = l0 + 16 * K_AHEAD_AMX + i;
      if (ahead < len)
        for (int d = 0; d < D; d += 32)
          _mm_prefetch((const char *)(cache + row[ahead] + d), _MM_HINT_T0);
    }
    /* up to 4 tiles of 16 heads at a time (tmm0-3), each K tile used by all of them (a set
     * after the first reads its K rows from L1) */
    for (int t0 = 0; t0 < H; t0 += 4) {
      const int k = H - t0 < 4 ? H - t0 : 4;
      const uint32_t *qt = qp + (size_t)t0 * C * 256;
      afd_amx_zero_sums();
      for (int c = 0; c < C; c++) {
        load_k(cache, row, l0, n, c, D, direct, rows);
        _tile_loadd(6, qt + (size_t)c * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (k > 1) {
          _tile_loadd(7, qt + (size_t)(C + c) * 256, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (k > 2) {
          _tile_loadd(6, qt + (size_t)(2 * C + c) * 256, 64);
          _tile_dpbf16ps(2, 4, 6);
        }
        if (k > 3) {
          _tile_loadd(7, qt + (size_t)(3 * C + c) * 256, 64);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
      _tile_stored(0, sums, 64);
      if (k > 1) _tile_stored(1, sums + 256, 64);
      if (k > 2) _tile_stored(2, sums + 512, 64);
      if (k > 3) _tile_stored(3, sums + 768, 64);
      const int j1 = g < 16 * (t0 + k) ? g : 16 * (t0 + k);
      for (int j = 16 * t0; j < j1; j++) { /* head j's column: its 16 positions' sums */
        __m512 r = afd_amx_column(sums + (j / 16 - t0) * 256, j % 16);
        __m256 lo = _mm256_mul_ps(round8(_mm512_castps512_ps256(r)), vscale);
        __m256 hi = _mm256_mul_ps(round8(_mm512_extractf32x8_ps(r, 1)), vscale);
        __m512 out = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
        _mm512_mask_storeu_ps(s + (size_t)j * len + l0, (__mmask16)((1u << n) - 1), out);
      }
    }
  }
  _tile_release();
}
