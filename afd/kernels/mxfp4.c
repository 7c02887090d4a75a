/* MXFP4 weights (loaded with ctypes by afd/kernels/mxfp4.py): W [N, K] as blocks [N, K/32, 16]
 * (two e2m1 codes a byte, the even element in the low nibble) and scales [N, K/32] (e8m0).
 *
 * afd_mxfp4_linear multiplies x [M, K] (bf16 or float32) by W.T reading the 4-bit codes
 * directly: a decode step streams 17 bytes per 32 weights instead of 64. Codes become bf16
 * bit patterns by table lookups, with no per-element conversion:
 *   - AVX2: two lookups (vpshufb: the pattern's low and high byte) and one interleave, 64
 *     weights (two blocks) at a time; a pair of bf16 words is one 32-bit lane, the even word
 *     shifted up and the odd word masked are its two fp32 values, multiplied by x in fp32.
 *     Where a row's scale bytes allow (nearly always), the tables looked up are the block's
 *     scaled ones, so the products are the scaled weights' and need no multiply by the scale;
 *   - AVX-512 BF16: one vpermw per 32 weights, 128 (four blocks) at a time; vdpbf16ps
 *     multiplies the bf16 words by x in bf16 directly.
 * The lookups leave the weights in a fixed scrambled order within each group; x is copied
 * into the same order once per call, so no weight is ever moved back. Every product is exact
 * in fp32 (both factors bf16); each block's sum is scaled by its power of two and
 * accumulated (or, on AVX2's scaled route, each product is), so results differ from a matmul
 * over the dequantized weights only in the fp32 summation order (and, on the AVX-512 path,
 * products below fp32's normal range read as 0, as vdpbf16ps does). On AVX2 an odd last block
 * of a row takes the plain route (decode32).
 * afd_mxfp4_to_bf16 expands rows into bf16 (exact: every MXFP4 value is a bf16 value), the
 * online conversion the FFN server's expert workspace keeps. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "mxfp4.h"

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* scale byte s -> 2^(s - 127); and its half, for decode32's doubled values */
static float scale_of[256], half_scale_of[256];
/* scale byte s (FOLD_MIN..FOLD_MAX) -> the 16 codes' values times 2^(s - 127) as bf16 patterns:
 * 16 low bytes, then 16 high bytes (the AVX2 route's scaled lookups). Every such value is a
 * normal bf16 (e2m1's nonzero exponents are -1..2), so the scale costs nothing per row of x. */
#define FOLD_MIN 2
#define FOLD_MAX 252
static uint8_t scaled_tab[256][32] __attribute__((aligned(32)));
static const float E2M1[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};
void afd_mxfp4_init(void) {
  static int done = 0;
  if (__atomic_load_n(&done, __ATOMIC_ACQUIRE)) return;
  for (int s = 0; s < 256; s++) {
    scale_of[s] = ldexpf(1.0f, s - 127);
    half_scale_of[s] = ldexpf(1.0f, s - 128);
    for (int c = 0; c < 16 && s >= FOLD_MIN && s <= FOLD_MAX; c++) {
      union { float f; uint32_t u; } v = {ldexpf(E2M1[c], s - 127)};
      scaled_tab[s][c] = (uint8_t)(v.u >> 16), scaled_tab[s][16 + c] = (uint8_t)(v.u >> 24);
    }
  }
  __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
}

/* e2m1 code -> its value's bf16 bit pattern, low byte and high byte (0, .5, 1, 1.5, 2, 3, 4,
 * 6, then the negatives) */
#define LUT_LO 0, 0, 0x80, 0xC0, 0, 0x40, 0x80, 0xC0, 0, 0, 0x80, 0xC0, 0, 0x40, 0x80, 0xC0
#define LUT_HI 0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, \
               0xC0, 0xC0

/* One block's 32 codes as 8-lane fp32 vectors of twice their values, in element order. */
static inline void decode32(const uint8_t *b, __m256 v[4]) {
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i low4 = _mm_set1_epi8(0x0f);
  __m128i raw = _mm_loadu_si128((const __m128i *)b);
  __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(raw, low4));
  __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
  __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi); /* 0..15, 16..31 */
  v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e0));
  v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e0, 8)));
  v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e1));
  v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e1, 8)));
}

int afd_mxfp4_to_bf16(const uint8_t *blocks, const uint8_t *scales, uint16_t *out, int N, int K,
                      int threads) {
  if (K % 32) return -1;
  afd_mxfp4_init();
  const int G = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < (int64_t)N * G; i++) {
    __m256 v[4];
    decode32(blocks + i * 16, v);
    __m256 s = _mm256_set1_ps(half_scale_of[scales[i]]);
    for (int j = 0; j < 4; j++) store8(out + i * 32 + j * 8, round8(_mm256_mul_ps(v[j], s)));
  }
  return 0;
}

/* ---- AVX2: a group of 64 weights (two blocks) as 8 fp32 vectors ----------------------------
 * Vector v = 2p + odd (p = 0..3: which interleave, odd: the lane's high word), lane L: the
 * element 2 * ((p % 2) * 8 + 2 * (L % 4) + odd + (L / 4) * 16) + p / 2 of the group; lanes 0..3
 * are the first block's, 4..7 the second's. */
static inline int avx2_element(int v, int L) {
  int p = v / 2, odd = v % 2;
  return 2 * ((p % 2) * 8 + 2 * (L % 4) + odd + (L / 4) * 16) + p / 2;
}

static inline void decode64_f32(const uint8_t *b, __m256 w[8]) {
  const __m256i lut_lo = _mm256_setr_epi8(LUT_LO, LUT_LO);
  const __m256i lut_hi = _mm256_setr_epi8(LUT_HI, LUT_HI);
  const __m256i low4 = _mm256_set1_epi8(0x0f), high = _mm256_set1_epi32((int)0xffff0000u);
  __m256i raw = _mm256_loadu_si256((const __m256i *)b);
  __m256i codes[2] = {_mm256_and_si256(raw, low4),
                      _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4)};
  for (int h = 0; h < 2; h++) { /* low nibbles (even elements), then high (odd) */
    __m256i lo = _mm256_shuffle_epi8(lut_lo, codes[h]), hi = _mm256_shuffle_epi8(lut_hi, codes[h]);
    __m256i words[2] = {_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi)};
    for (int u = 0; u < 2; u++) {
      int p = 2 * h + u;
      w[2 * p] = _mm256_castsi256_ps(_mm256_slli_epi32(words[u], 16));
      w[2 * p + 1] = _mm256_castsi256_ps(_mm256_and_si256(words[u], high));
    }
  }
}

#define MT2 4 /* rows of x per pass over a weight row (AVX2: 8 weight + 4 sum registers) */
#define MT2S 5 /* the same on the scaled route (two sums a row: 10 sum + 4 weight registers) */
#define NU 8  /* weight rows per work unit */
#define INLINE static inline __attribute__((always_inline))

/* acc[m] += scale * (x[m] . a row's odd last block) for R rows of x (xt: the block's x in row 0,
 * rows `row` floats apart; b: the block's codes, decoded plain by decode32) */
INLINE void odd_block(const float *xt, size_t row, const uint8_t *b, uint8_t scale, __m256 *acc,
                      int R) {
  __m256 w[4];
  decode32(b, w);
  __m256 s = _mm256_set1_ps(half_scale_of[scale]);
  for (int m = 0; m < R; m++) {
    const float *x = xt + (size_t)m * row;
    __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
    t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), t);
    t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), t);
    t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), t);
    acc[m] = _mm256_fmadd_ps(t, s, acc[m]);
  }
}

/* R rows of x (a constant where inlined, so the sums stay in registers: through memory they
 * would chain every group on a store-to-load round trip) against weight row n. */
INLINE void rows_avx2(const float *xp, const uint8_t *wb, const uint8_t *ws, float *out, int R,
                      int N, int G) {
  const int groups = G / 2, row = G * 32;
  __m256 acc[MT2];
  for (int m = 0; m < R; m++) acc[m] = _mm256_setzero_ps();
  _mm_prefetch((const char *)ws + MXFP4_AHEAD / 16, _MM_HINT_T0);
  for (int g = 0; g < groups; g++) {
    _mm_prefetch((const char *)wb + (size_t)g * 32 + MXFP4_AHEAD, _MM_HINT_T0);
    __m256 w[8];
    decode64_f32(wb + (size_t)g * 32, w);
    __m256 s = _mm256_blend_ps(_mm256_set1_ps(scale_of[ws[2 * g]]),
                               _mm256_set1_ps(scale_of[ws[2 * g + 1]]), 0xF0);
    for (int m = 0; m < R; m++) {
      const float *xg = xp + (size_t)m * row + (size_t)g * 64;
      __m256 t0 = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
      __m256 t1 = _mm256_mul_ps(w[1], _mm256_loadu_ps(xg + 8));
      t0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), t0);
      t1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), t1);
      t0 = _mm256_fmadd_ps(w[4], _mm256_loadu_ps(xg + 32), t0);
      t1 = _mm256_fmadd_ps(w[5], _mm256_loadu_ps(xg + 40), t1);
      t0 = _mm256_fmadd_ps(w[6], _mm256_loadu_ps(xg + 48), t0);
      t1 = _mm256_fmadd_ps(w[7], _mm256_loadu_ps(xg + 56), t1);
      acc[m] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), s, acc[m]);
    }
  }
  if (G % 2) odd_block(xp + (size_t)groups * 64, row, wb + (size_t)(G - 1) * 16, ws[G - 1], acc, R);
  for (int m = 0; m < R; m++) out[(size_t)m * N] = hsum(acc[m]);
}

/* Half h of a group's 64 weights (h = 0: decode64_f32's vectors 0..3, the low nibbles; 1: 4..7),
 * times their blocks' scales: looked up in the group's two scaled tables (lo_tab: the patterns'
 * low bytes, hi_tab: their high bytes; lane 0 the first block's, from scaled_tab). */
INLINE void decode_half_scaled(__m256i raw, __m256i lo_tab, __m256i hi_tab, int h, __m256 w[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), high = _mm256_set1_epi32((int)0xffff0000u);
  __m256i codes = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, low4);
  __m256i lo = _mm256_shuffle_epi8(lo_tab, codes), hi = _mm256_shuffle_epi8(hi_tab, codes);
  __m256i w0 = _mm256_unpacklo_epi8(lo, hi), w1 = _mm256_unpackhi_epi8(lo, hi);
  w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
  w[1] = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
  w[2] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
  w[3] = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
}

/* rows_avx2 for weight rows whose scale bytes are all FOLD_MIN..FOLD_MAX: the lookups give the
 * scaled values, so each product goes straight into one of the row's two sums (even and odd
 * vectors), 8 fmas per 64 weights and row of x where rows_avx2 takes 10 operations. R rows of x
 * against NW consecutive weight rows (wb, ws: the first; out: its outputs, the others' follow),
 * NW <= 2: the sums of one row of x alone are two chains of fmas, each waiting on the last,
 * which leave the FMA ports idle half the time; one or two rows of x take two weight rows at
 * once. A row's sums are the same bits whatever R and NW. */
INLINE void rows_avx2_scaled(const float *xp, const uint8_t *wb, const uint8_t *ws, float *out,
                             int R, int NW, int N, int G) {
  const int groups = G / 2, row = G * 32;
  __m256 a0[2][MT2S], a1[2][MT2S]; /* NW <= 2 */
  for (int j = 0; j < NW; j++)
    for (int m = 0; m < R; m++) a0[j][m] = a1[j][m] = _mm256_setzero_ps();
  for (int j = 0; j < NW; j++)
    _mm_prefetch((const char *)ws + (size_t)j * G + MXFP4_AHEAD / 16, _MM_HINT_T0);
  for (int g = 0; g < groups; g++) {
    for (int j = 0; j < NW; j++) {
      const uint8_t *b = wb + (size_t)j * G * 16 + (size_t)g * 32;
      const uint8_t *s = ws + (size_t)j * G + 2 * g;
      _mm_prefetch((const char *)b + MXFP4_AHEAD, _MM_HINT_T0);
      const uint8_t *t0 = scaled_tab[s[0]], *t1 = scaled_tab[s[1]];
      __m256i lo_tab = _mm256_loadu2_m128i((const __m128i *)t1, (const __m128i *)t0);
      __m256i hi_tab =
          _mm256_loadu2_m128i((const __m128i *)(t1 + 16), (const __m128i *)(t0 + 16));
      __m256i raw = _mm256_loadu_si256((const __m256i *)b);
      for (int h = 0; h < 2; h++) {
        __m256 w[4];
        decode_half_scaled(raw, lo_tab, hi_tab, h, w);
        for (int m = 0; m < R; m++) {
          const float *xg = xp + (size_t)m * row + (size_t)g * 64 + 32 * h;
          a0[j][m] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), a0[j][m]);
          a1[j][m] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), a1[j][m]);
          a0[j][m] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), a0[j][m]);
          a1[j][m] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), a1[j][m]);
        }
      }
    }
  }
  for (int j = 0; j < NW && G % 2; j++) /* the odd last block as rows_avx2 takes it */
    odd_block(xp + (size_t)groups * 64, row, wb + (size_t)j * G * 16 + (size_t)(G - 1) * 16,
              ws[(size_t)j * G + G - 1], a0[j], R);
  for (int j = 0; j < NW; j++)
    for (int m = 0; m < R; m++) out[(size_t)m * N + j] = hsum(_mm256_add_ps(a0[j][m], a1[j][m]));
}

/* whether every scale byte of a row lets the lookups carry it (FOLD_MIN..FOLD_MAX) */
static inline int row_foldable(const uint8_t *ws, int G) {
  int g = 0;
  for (; g + 32 <= G; g += 32) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(ws + g));
    __m256i in = _mm256_max_epu8(_mm256_min_epu8(v, _mm256_set1_epi8((char)FOLD_MAX)),
                                 _mm256_set1_epi8(FOLD_MIN));
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(in, v)) != -1) return 0;
  }
  for (; g < G; g++)
    if (ws[g] < FOLD_MIN || ws[g] > FOLD_MAX) return 0;
  return 1;
}

/* R rows of x against weight row n on the route its scales allow */
INLINE void rows_any(const float *xp, const uint8_t *wb, const uint8_t *ws, float *out, int R,
                     int N, int G, int fold) {
  if (fold)
    rows_avx2_scaled(xp, wb, ws, out, R, 1, N, G);
  else
    rows_avx2(xp, wb, ws, out, R, N, G);
}

/* xp: per row, groups * 64 floats in decode64_f32's order, then the odd block's 32 in order */
static void linear_avx2(const float *xp, const uint8_t *blocks, const uint8_t *scales,
                        float *acc_out, int M, int N, int G, int n0, int n1) {
  const size_t row = (size_t)G * 32;
  /* one or two rows of x: two weight rows a pass, so that a pass runs four or eight chains of
   * sums (four weight rows at one row of x were no faster in cache and 1.0-1.06x the time from
   * DRAM, moe calls at one token on Zen 4's AVX2 path) */
  const int nw = M <= 2 ? 2 : 1;
  for (int n = n0; n < n1;) {
    const uint8_t *wb = blocks + (size_t)n * G * 16, *ws = scales + (size_t)n * G;
    if (nw > 1 && n + nw <= n1 && row_foldable(ws, nw * G)) {
      if (M == 1)
        rows_avx2_scaled(xp, wb, ws, acc_out + n, 1, 2, N, G);
      else
        rows_avx2_scaled(xp, wb, ws, acc_out + n, 2, 2, N, G);
      n += nw;
      continue;
    }
    const int fold = row_foldable(ws, G), most = fold ? MT2S : MT2;
    for (int m0 = 0, r; m0 < M; m0 += r) {
      /* passes of about equal size (9 -> 5 + 4; without the tables 5 -> 3 + 2): a pass of one
       * row runs only two chains of sums (rows_avx2_scaled) */
      const int passes = (M - m0 + most - 1) / most;
      r = (M - m0 + passes - 1) / passes;
      const float *x = xp + m0 * row;
      float *o = acc_out + (size_t)m0 * N + n;
      switch (r) {
        case 1: rows_any(x, wb, ws, o, 1, N, G, fold); break;
        case 2: rows_any(x, wb, ws, o, 2, N, G, fold); break;
        case 3: rows_any(x, wb, ws, o, 3, N, G, fold); break;
        case 4: rows_any(x, wb, ws, o, 4, N, G, fold); break;
        default: rows_avx2_scaled(x, wb, ws, o, 5, 1, N, G); break; /* fold: most is 5 */
      }
    }
    n++;
  }
}

/* ---- AVX-512 BF16: a quad of 128 weights (four blocks) as four vectors of 32 bf16 words -----
 * The quad's 64 bytes read as 32 words; word i holds elements 4i..4i+3, element 4i + k in its
 * nibble k. Vector k is nibble k of every word looked up by vpermw, which reads only an index's
 * low 5 bits: from a table holding the 16 patterns twice, the word shifted right by 4k is its
 * own index (no mask, no interleave: four lookups and three shifts per 128 weights). After
 * vdpbf16ps, fp32 lane j holds words 2j and 2j + 1 of each vector, elements of block j / 4
 * only, so the four products of a lane sum within one block and one vector of scales serves
 * the quad. x is laid out in the same order (position 32k + i: element 4i + k), zero past K;
 * a row's last quad may hold fewer than four blocks (the missing codes read as 0). */
static inline int avx512_element(int k, int i) { return 4 * i + k; }

#define MT5 8 /* rows of x per pass over a weight row (AVX-512) */

/* Four scale bytes (a quad's, little-endian) -> lanes 4b..4b+3 = 2^(byte b - 127): the byte as
 * an fp32 exponent, and byte 0 as 2^-127 (subnormal), as scale_of holds it. */
INLINE AVX512BF16 __m512 quad_scales(uint32_t four) {
  const __m512i pick = _mm512_set_epi32(
      (int)0x80808003, (int)0x80808003, (int)0x80808003, (int)0x80808003,
      (int)0x80808002, (int)0x80808002, (int)0x80808002, (int)0x80808002,
      (int)0x80808001, (int)0x80808001, (int)0x80808001, (int)0x80808001,
      (int)0x80808000, (int)0x80808000, (int)0x80808000, (int)0x80808000);
  __m512i b = _mm512_shuffle_epi8(_mm512_set1_epi32((int)four), pick);
  __m512i bits = _mm512_max_epu32(_mm512_slli_epi32(b, 23), _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(bits);
}

/* acc[m] += scale * (x[m]'s quad . the quad's weights) for R rows of x (the quad's x at xq,
 * rows `stride` words apart) */
INLINE AVX512BF16 void quad_rows(__m512i raw, __m512 s, const uint16_t *xq, size_t stride,
                                 __m512 *acc, int R) {
  const __m512i lut = _mm512_load_si512((const void *)AFD_E2M1_BF16);
  __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(raw, lut);
  __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), lut);
  __m512bh w2 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 8), lut);
  __m512bh w3 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 12), lut);
  for (int m = 0; m < R; m++) {
    const uint16_t *x = xq + (size_t)m * stride;
    __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, (__m512bh)_mm512_loadu_si512(x));
    t = _mm512_dpbf16_ps(t, w1, (__m512bh)_mm512_loadu_si512((const void *)(x + 32)));
    t = _mm512_dpbf16_ps(t, w2, (__m512bh)_mm512_loadu_si512((const void *)(x + 64)));
    t = _mm512_dpbf16_ps(t, w3, (__m512bh)_mm512_loadu_si512((const void *)(x + 96)));
    acc[m] = _mm512_fmadd_ps(t, s, acc[m]);
  }
}

INLINE AVX512BF16 void rows_avx512(const uint16_t *xb, const uint8_t *wb, const uint8_t *ws,
                                   float *out, int R, int N, int G) {
  const int quads = (G + 3) / 4, full = G / 4;
  const size_t stride = (size_t)quads * 128;
  __m512 acc[MT5];
  for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps();
  /* the scales, 1/16 of the codes' bytes, and the codes: MXFP4_AHEAD (mxfp4.h) says why */
  _mm_prefetch((const char *)ws + MXFP4_AHEAD / 16, _MM_HINT_T0);
  for (int q = 0; q < full; q++) {
    _mm_prefetch((const char *)wb + (size_t)q * 64 + MXFP4_AHEAD, _MM_HINT_T0);
    uint32_t four;
    memcpy(&four, ws + (size_t)q * 4, 4);
    __m512i raw = _mm512_loadu_si512((const void *)(wb + (size_t)q * 64));
    quad_rows(raw, quad_scales(four), xb + (size_t)q * 128, stride, acc, R);
  }
  if (full < quads) { /* 1..3 blocks left: read only theirs */
    const int left = G - full * 4;
    uint32_t four = 0;
    memcpy(&four, ws + (size_t)full * 4, (size_t)left);
    __m512i raw = _mm512_maskz_loadu_epi8((__mmask64)((1ULL << (16 * left)) - 1),
                                          (const void *)(wb + (size_t)full * 64));
    quad_rows(raw, quad_scales(four), xb + (size_t)full * 128, stride, acc, R);
  }
  for (int m = 0; m < R; m++) out[(size_t)m * N] = _mm512_reduce_add_ps(acc[m]);
}

static AVX512BF16 void linear_avx512(const uint16_t *xb, const uint8_t *blocks,
                                     const uint8_t *scales, float *acc_out, int M, int N, int G,
                                     int n0, int n1) {
  const size_t row = (size_t)(G + 3) / 4 * 128;
  for (int n = n0; n < n1; n++) {
    const uint8_t *wb = blocks + (size_t)n * G * 16, *ws = scales + (size_t)n * G;
    for (int m0 = 0; m0 < M; m0 += MT5) {
      const uint16_t *x = xb + m0 * row;
      float *o = acc_out + (size_t)m0 * N + n;
      switch (M - m0 < MT5 ? M - m0 : MT5) {
        case 1: rows_avx512(x, wb, ws, o, 1, N, G); break;
        case 2: rows_avx512(x, wb, ws, o, 2, N, G); break;
        case 3: rows_avx512(x, wb, ws, o, 3, N, G); break;
        case 4: rows_avx512(x, wb, ws, o, 4, N, G); break;
        case 5: rows_avx512(x, wb, ws, o, 5, N, G); break;
        case 6: rows_avx512(x, wb, ws, o, 6, N, G); break;
        case 7: rows_avx512(x, wb, ws, o, 7, N, G); break;
        default: rows_avx512(x, wb, ws, o, 8, N, G); break;
      }
    }
  }
}

/* One row of bf16 x [K] into the AVX-512 route's order (dst: afd_mxfp4_row_len(1, K) words):
 * each quad's 128 values as four vectors of 32, vector k holding elements k, 4 + k, 8 + k, ...
 * (avx512_element), zero past K. Two word permutes over the quad's halves and a blend a vector. */
static AVX512BF16 void prepare_wide(const uint16_t *src, int K, uint16_t *dst) {
  __m512i idx[4]; /* lane i: (4i + k) mod 64, a word of the pair of vectors it permutes */
  for (int k = 0; k < 4; k++) {
    uint16_t at[32];
    for (int i = 0; i < 32; i++) at[i] = (uint16_t)(avx512_element(k, i) % 64);
    idx[k] = _mm512_loadu_si512((const void *)at);
  }
  for (int q = 0; q < K; q += 128) {
    __m512i v[4];
    for (int j = 0; j < 4; j++) { /* zeros past K: the masked lanes of the last quad */
      const int left = K - q - 32 * j;
      const __mmask32 mk = left >= 32 ? ~(__mmask32)0 : left > 0 ? ((__mmask32)1 << left) - 1 : 0;
      v[j] = _mm512_maskz_loadu_epi16(mk, (const void *)(src + q + 32 * j));
    }
    for (int k = 0; k < 4; k++) {
      __m512i lo = _mm512_permutex2var_epi16(v[0], idx[k], v[1]); /* lanes 0-15: 4i + k < 64 */
      __m512i hi = _mm512_permutex2var_epi16(v[2], idx[k], v[3]); /* lanes 16-31 */
      _mm512_storeu_si512((void *)(dst + q + 32 * k),
                          _mm512_mask_blend_epi16((__mmask32)0xFFFF0000u, lo, hi));
    }
  }
}

static inline float x_at(const void *x, int f32, size_t i) {
  return f32 ? ((const float *)x)[i] : bf16_value(((const uint16_t *)x)[i]);
}

size_t afd_mxfp4_row_len(int wide, int K) {
  return wide ? (size_t)(K + 127) / 128 * 128 : (size_t)K;
}

/* mxfp4.h: x in the weights' scrambled order, row m of M (see there) */
void afd_mxfp4_prepare_row(const void *x, int f32, int wide, int m, int K, float *xp,
                           uint16_t *xb) {
  if (wide) { /* bf16 x: position 32k + i of a quad holds element 4i + k, zero past K */
    prepare_wide((const uint16_t *)x + (size_t)m * K, K, xb + (size_t)m * afd_mxfp4_row_len(1, K));
    return;
  }
  int vmap[64]; /* the element of a 64-weight group at each scrambled position */
  for (int i = 0; i < 64; i++) vmap[i] = avx2_element(i / 8, i % 8);
  const int G = K / 32, groups = G / 2;
  for (int g = 0; g < groups; g++) {
    const size_t at = (size_t)m * K + (size_t)g * 64;
    for (int i = 0; i < 64; i++) xp[at + i] = x_at(x, f32, at + vmap[i]);
  }
  for (int i = 0; i < 32 * (G % 2); i++) {
    size_t at = (size_t)m * K + (size_t)groups * 64 + i;
    xp[at] = x_at(x, f32, at);
  }
}

void afd_mxfp4_rows(const float *xp, const uint16_t *xb, int wide, const uint8_t *blocks,
                    const uint8_t *scales, float *acc, int M, int N, int G, int n0, int n1) {
  afd_mxfp4_init();
  if (wide)
    linear_avx512(xb, blocks, scales, acc, M, N, G, n0, n1);
  else
    linear_avx2(xp, blocks, scales, acc, M, N, G, n0, n1);
}

int afd_mxfp4_linear(const void *x, const uint8_t *blocks, const uint8_t *scales, void *y, int M,
                     int N, int K, int f32, int isa, int threads) {
  if (K % 32) return -1;
  afd_mxfp4_init();
  const int G = K / 32;
  const int wide = isa >= ISA_AVX512 && !f32;
  float *acc = (float *)afd_alloc64((size_t)M * N * sizeof(float));
  if (!acc) return -2;
  if (isa == ISA_AMX && !f32 && N % 16 == 0 && M >= MXFP4_AMX_FROM && afd_cpu_amx()) {
    /* tiles (mxfp4_amx.c; the caller has checked the scales) */
    uint16_t *xa = (uint16_t *)aligned_alloc(64, afd_amx_elems(M, K) * sizeof(uint16_t));
    const size_t per = afd_mxfp4_amx_scratch(G); /* a thread's decoded codes */
    char *sh = (char *)aligned_alloc(64, (size_t)(threads > 1 ? threads : 1) * per);
    if (!xa || !sh) {
      free(xa), free(sh), free(acc);
      return -2;
    }
    afd_amx_pack((const uint16_t *)x, M, K, xa);
#pragma omp parallel num_threads(threads)
    {
      char *mine = sh + (size_t)omp_get_thread_num() * per;
#pragma omp for schedule(dynamic, 1)
      for (int n0 = 0; n0 < N; n0 += AMX_NU)
        afd_mxfp4_rows_amx(xa, blocks, scales, acc, M, N, G, n0,
                           n0 + AMX_NU < N ? n0 + AMX_NU : N, (uint16_t *)mine);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < (int64_t)M * N; i++) ((uint16_t *)y)[i] = to_bf16(acc[i]);
    }
    free(xa), free(sh), free(acc);
    return 0;
  }
  /* x in the weights' scrambled order: fp32 (AVX2) or bf16 words (AVX-512) */
  const size_t len = afd_mxfp4_row_len(wide, K);
  float *xp = wide ? NULL : (float *)afd_alloc64((size_t)M * len * sizeof(float));
  uint16_t *xb = wide ? (uint16_t *)afd_alloc64((size_t)M * len * sizeof(uint16_t)) : NULL;
  if (!xp && !xb) {
    free(acc);
    return -2;
  }
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) afd_mxfp4_prepare_row(x, f32, wide, m, K, xp, xb);
    /* Guided: each thread first takes a long contiguous run of rows, then shorter ones. With
     * units of NU rows handed out one by one (dynamic), a thread's stream jumped every few
     * KiB and the hardware prefetcher restarted at each jump; a cold [2048 x 1024] weight at
     * one row of x took 1.25-1.5x as long on Zen 3. The short runs at the end still let a
     * thread that the OS preempts hold up little. */
#pragma omp for schedule(guided)
    for (int n0 = 0; n0 < N; n0 += NU) {
      int n1 = n0 + NU < N ? n0 + NU : N;
      afd_mxfp4_rows(xp, xb, wide, blocks, scales, acc, M, N, G, n0, n1);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < (int64_t)M * N; i++) {
      if (f32)
        ((float *)y)[i] = acc[i];
      else
        ((uint16_t *)y)[i] = to_bf16(acc[i]);
    }
  }
  free(xp), free(xb), free(acc);
  return 0;
}
