/* Paged decode attention's two products on AMX tiles (attention_chunks.c runs the call on the
 * amx path where a K/V head has 8 query heads or more and D and Dv are multiples of 32):
 *   scores: s[j, l] = bf16(q_j . k_l) * scale, 16 positions and 16 heads a tile product;
 *   values: o[j] = sum_l p[j, l] v_l in fp32, 16 heads and 16 columns of V a tile product.
 *
 * Scores: one TDPBF16PS takes 16 positions' K rows (32 values of D each: the A operand,
 * row-major as the cache holds them) against every query head at once (the B operand: q with
 * pairs of D interleaved, a column per head, packed once per call), so a position costs D / 32
 * tile products shared by all the heads, where attention512.c spends D / 32 vdpbf16ps and a
 * share of a 16-way sum tree per head. Values: the heads' bf16 probabilities are the A
 * operand's rows (32 positions each), V the B operand, 256 positions at a time packed with
 * position pairs interleaved, so V is read once for every 16 heads (attention512.c: every 4).
 * MLA (16 to 128 heads of 288 to 576 values a K/V head) is bound by these products; GQA's 4
 * heads of 64 are bound by reading K and V, and there the tiles were no faster in the engine
 * (docs/benchmarks.md), hence the 8-head floor.
 *
 * The sums are the tile's: each pair's products added in fp32, in the tile's order, so a score
 * may differ from attention512.c's in its last fp32 bits and, rarely, after its rounding to
 * bf16 (summation order only, as between the other paths); the values add a pair's products in
 * vdpbf16ps' order. A head's sums do not depend on its column, its row or the other heads. */
#include <string.h>

#include "amx.h"
#include "attention_amx.h"

/* The K rows of the tile K_AHEAD_AMX tiles on are fetched into L1 as a tile is multiplied
 * (without, the tile loads waited on every row; into L2 they still did, Intel Xeon harness) */
#define K_AHEAD_AMX 2

/* The values pass fetches V rows this many position pairs ahead as it packs them, into L1 */
#define V_AHEAD_AMX 16

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
                             int len, int g, int D, float scale, float *s, int ld,
                             void *scratch) {
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
    const int ahead = l0 + 16 * K_AHEAD_AMX, na = len - ahead < 16 ? len - ahead : 16;
    /* up to 4 tiles of 16 heads at a time (tmm0-3), each K tile used by all of them (a set
     * after the first reads its K rows from L1) */
    for (int t0 = 0; t0 < H; t0 += 4) {
      const int k = H - t0 < 4 ? H - t0 : 4;
      const uint32_t *qt = qp + (size_t)t0 * C * 256;
      afd_amx_zero_sums();
      for (int c = 0; c < C; c++) {
        if (t0 == 0) /* the rows ahead, a column of lines at a time between the products */
          for (int i = 0; i < na; i++)
            _mm_prefetch((const char *)(cache + row[ahead + i] + 32 * c), _MM_HINT_T0);
        load_k(cache, row, l0, n, c, D, direct, rows);
        afd_amx_times(qt + (size_t)c * 256, (size_t)C * 256, k);
      }
      afd_amx_store_sums(sums, k);
      const int j1 = g < 16 * (t0 + k) ? g : 16 * (t0 + k);
      for (int j = 16 * t0; j < j1; j++) { /* head j's column: its 16 positions' sums */
        __m512 r = afd_amx_column(sums + (j / 16 - t0) * 256, j % 16);
        __m256 lo = _mm256_mul_ps(round8(_mm512_castps512_ps256(r)), vscale);
        __m256 hi = _mm256_mul_ps(round8(_mm512_extractf32x8_ps(r, 1)), vscale);
        __m512 out = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
        _mm512_mask_storeu_ps(s + (size_t)j * ld + l0, (__mmask16)((1u << n) - 1), out);
      }
    }
  }
  _tile_release();
}

/* Word i of the interleave of two 32-value rows a, b: a[i / 2] where i is even, b[i / 2] where
 * odd, for columns 0..15 (LO) and 16..31 (HI); indices past 31 pick from b. */
static const uint16_t INTERLEAVE[64] = {
    0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
    11, 43, 12, 44, 13, 45, 14, 46, 15, 47, 16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
    22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

/* The V rows of positions l0 .. l0 + n - 1 as B operands: tile (s, t) (1 KiB at vp + (s T + t)
 * KiB, T = Dv / 16) holds positions l0 + 32s .. + 31 and columns 16t .. 16t + 15, its row r
 * the pair l0 + 32s + 2r, + 1: column k holds v[2r][16t + k] and v[2r + 1][16t + k], the pair a
 * TDPBF16PS multiplies with a head's two probabilities. Pairs past n are zeros (a zero
 * probability times whatever V held could be NaN). */
static AMX void pack_v(const uint16_t *cache, const int64_t *row, int l0, int n, int len, int Dv,
                       uint32_t *vp) {
  const int T = Dv / 16, S = (n + 31) / 32;
  const __m512i lo = _mm512_loadu_si512((const void *)INTERLEAVE);
  const __m512i hi = _mm512_loadu_si512((const void *)(INTERLEAVE + 32));
  const __m512i zero = _mm512_setzero_si512();
  for (int q = 0; q < 16 * S; q++) {
    const int l = l0 + 2 * q;
    const uint16_t *r0 = 2 * q < n ? cache + row[l] : NULL;
    const uint16_t *r1 = 2 * q + 1 < n ? cache + row[l + 1] : NULL;
    const int a = l + 2 * V_AHEAD_AMX; /* the pair ahead */
    const uint16_t *f0 = a < len ? cache + row[a] : NULL;
    const uint16_t *f1 = a + 1 < len ? cache + row[a + 1] : NULL;
    uint32_t *dst = vp + (size_t)(q / 16) * T * 256 + (q % 16) * 16;
    for (int c = 0; c < Dv / 32; c++) {
      if (f0) _mm_prefetch((const char *)(f0 + 32 * c), _MM_HINT_T0); /* the pair ahead, */
      if (f1) _mm_prefetch((const char *)(f1 + 32 * c), _MM_HINT_T0); /* a line at a time */
      const __m512i v0 = r0 ? _mm512_loadu_si512((const void *)(r0 + 32 * c)) : zero;
      const __m512i v1 = r1 ? _mm512_loadu_si512((const void *)(r1 + 32 * c)) : zero;
      _mm512_store_si512((void *)(dst + (size_t)(2 * c) * 256),
                         _mm512_permutex2var_epi16(v0, lo, v1));
      _mm512_store_si512((void *)(dst + (size_t)(2 * c + 1) * 256),
                         _mm512_permutex2var_epi16(v0, hi, v1));
    }
  }
}

AMX void afd_attn_amx_values(const float *p, int ld, int len, int g, int Dv,
                             const uint16_t *cache, const int64_t *row, float *out,
                             void *scratch) {
  const int H = (g + 15) / 16, P = (len + 31) / 32 * 32, T = Dv / 16;
  /* the probabilities as bf16 A operands [16 H, P]: zeros past len and past head g */
  uint16_t *pb = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  uint32_t *vp = (uint32_t *)(pb + (size_t)16 * H * P); /* a chunk of V, packed */
  float *acc = (float *)(vp + (size_t)AFD_ATTN_AMX_VCHUNK * Dv / 2); /* [16 H, Dv] sums */
  for (int j = 0; j < 16 * H; j++) { /* p holds bf16 values already: their top halves, exactly */
    const uint32_t *pj = (const uint32_t *)(p + (size_t)j * ld);
    uint16_t *bj = pb + (size_t)j * P;
    int l = 0;
    if (j < g)
      for (; l < len; l++) bj[l] = (uint16_t)(pj[l] >> 16);
    memset(bj + l, 0, (size_t)(P - l) * sizeof(uint16_t));
  }
  afd_amx_configure();
  for (int l0 = 0; l0 < len; l0 += AFD_ATTN_AMX_VCHUNK) {
    const int n = len - l0 < AFD_ATTN_AMX_VCHUNK ? len - l0 : AFD_ATTN_AMX_VCHUNK;
    const int S = (n + 31) / 32;
    pack_v(cache, row, l0, n, len, Dv, vp);
    /* 2 x 2 tiles of sums (tmm0-3: heads 16t.., 16(t + 1).., columns 16c.., 16(c + 1)..),
     * carried from chunk to chunk in acc (stored and loaded exactly, in fp32) */
    for (int t = 0; t < H; t += 2) {
      const int two = t + 1 < H;
      const uint16_t *a0 = pb + (size_t)16 * t * P + l0, *a1 = a0 + (size_t)16 * P;
      for (int c = 0; c < T; c += 2) {
        float *s0 = acc + (size_t)16 * t * Dv + 16 * c, *s1 = s0 + (size_t)16 * Dv;
        if (l0 == 0) {
          afd_amx_zero_sums();
        } else {
          _tile_loadd(0, s0, Dv * 4);
          _tile_loadd(1, s0 + 16, Dv * 4);
          if (two) {
            _tile_loadd(2, s1, Dv * 4);
            _tile_loadd(3, s1 + 16, Dv * 4);
          }
        }
        for (int s = 0; s < S; s++) {
          const uint32_t *b = vp + ((size_t)s * T + c) * 256;
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 256, 64);
          _tile_loadd(4, a0 + 32 * s, P * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, a1 + 32 * s, P * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, s0, Dv * 4);
        _tile_stored(1, s0 + 16, Dv * 4);
        if (two) {
          _tile_stored(2, s1, Dv * 4);
          _tile_stored(3, s1 + 16, Dv * 4);
        }
      }
    }
  }
  _tile_release();
  memcpy(out, acc, (size_t)g * Dv * sizeof(float));
}

