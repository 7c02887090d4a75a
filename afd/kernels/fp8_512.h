/* Block-FP8 codes to bf16 weights on AVX-512 BF16 CPUs, 32 at a time (fp8_gemm.c's chunks,
 * fp8_stream.c's registers): BlockFP8.dequantize's bf16(fp32(q) * s), rounded once. Only
 * functions that carry AFD_AVX512BF16 themselves may call these (afd_cpu_avx512bf16() true). */
#ifndef AFD_FP8_512_H
#define AFD_FP8_512_H

#include <immintrin.h>
#include <stdint.h>

#include "bf16_512.h"
#include "fp8_gemm.h"

#define AFD_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* 16 codes as fp32 values times the block's scale (vs: s * 2^120; the products, unrounded). */
static inline AFD_AVX512BF16 __m512 afd_fp8_products16(const uint8_t *q, __m512 vs) {
  __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
  __m512i bits = _mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(AFD_FP8_MASK));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), vs);
}

/* Whether vcvtne2ps2bf16 rounds a block of scale s as to_bf16 does: every product an fp32
 * normal or zero (s in [2^-117, 2^7]: e4m3's smallest code is 2^-9, its largest 448), where
 * it would flush a subnormal product that round16 keeps. False for NaN. */
static inline int afd_fp8_fast(float s) { return s >= 0x1p-117f && s <= 0x1p7f; }

/* Codes q[0..31] of one K-block as 32 bf16 weights: one vcvtne2ps2bf16 where fast
 * (afd_fp8_fast), else round16 (subnormals kept, NaNs quiet). */
static inline __attribute__((always_inline)) AFD_AVX512BF16 __m512bh
afd_fp8_weights32(const uint8_t *q, __m512 vs, int fast) {
  if (fast) return _mm512_cvtne2ps_pbh(afd_fp8_products16(q + 16, vs), afd_fp8_products16(q, vs));
  __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(round16(afd_fp8_products16(q, vs))), 16);
  __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(round16(afd_fp8_products16(q + 16, vs))), 16);
  return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                                      _mm512_cvtepi32_epi16(hi), 1);
}

/* ---- the same weights by table lookup, on CPUs with AVX-512 VBMI too (byte permutes).
 * bf16(fp32(q) * s) depends on q's magnitude (7 bits) and s only, its sign being q's where s
 * is a fast one (afd_fp8_fast: positive, finite, and no NaN among the products): a block's 128
 * magnitudes are converted once, as afd_fp8_weights32 converts them, into a table of their bf16
 * bits' low and high bytes (two registers each: vpermi2b's 128 entries, indexed by q's low 7
 * bits), and 64 codes become 64 weights in a permute, two lookups, a sign and two unpacks
 * instead of eight conversions: the same bits for a fraction of the instructions. */
#define AFD_AVX512VBMI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi")))

/* A fast block's table (s120: its scale times 2^120, afd_fp8_products16's) into t. */
static inline AFD_AVX512BF16 void afd_fp8_table(float s120, uint8_t *t) {
  static const uint8_t magnitudes[128] = {
      0,   1,   2,   3,   4,   5,   6,   7,   8,   9,   10,  11,  12,  13,  14,  15,
      16,  17,  18,  19,  20,  21,  22,  23,  24,  25,  26,  27,  28,  29,  30,  31,
      32,  33,  34,  35,  36,  37,  38,  39,  40,  41,  42,  43,  44,  45,  46,  47,
      48,  49,  50,  51,  52,  53,  54,  55,  56,  57,  58,  59,  60,  61,  62,  63,
      64,  65,  66,  67,  68,  69,  70,  71,  72,  73,  74,  75,  76,  77,  78,  79,
      80,  81,  82,  83,  84,  85,  86,  87,  88,  89,  90,  91,  92,  93,  94,  95,
      96,  97,  98,  99,  100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111,
      112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127};
  const __m512 vs = _mm512_set1_ps(s120);
  for (int g = 0; g < 4; g++) {
    __m512i w = (__m512i)afd_fp8_weights32(magnitudes + 32 * g, vs, 1);
    _mm256_storeu_si256((__m256i *)(t + 32 * g), _mm512_cvtepi16_epi8(w));
    _mm256_storeu_si256((__m256i *)(t + 128 + 32 * g),
                        _mm512_cvtepi16_epi8(_mm512_srli_epi16(w, 8)));
  }
}

/* The table of K-block b, whose scale s is fast, built into its entry unless it is there. */
static inline AFD_AVX512BF16 const uint8_t *afd_fp8_entry(uint8_t *tables, int b, float s) {
  uint8_t *e = tables + (size_t)b * AFD_FP8_ENTRY;
  float *key = (float *)(e + AFD_FP8_TABLE);
  if (*key != s) {
    afd_fp8_table(s * 0x1p120f, e);
    *key = s;
  }
  return e;
}

/* The byte order that makes the unpacks below give the codes' own order: unpacklo takes bytes
 * 0..7 of each 16-byte lane, unpackhi bytes 8..15, so lane L gets codes 8L..8L+7 for the
 * first 32 weights and 32+8L.. for the next 32. */
static inline AFD_AVX512VBMI __m512i afd_fp8_lut_order(void) {
  uint8_t o[64];
  for (int L = 0; L < 4; L++)
    for (int j = 0; j < 8; j++) {
      o[16 * L + j] = (uint8_t)(8 * L + j);
      o[16 * L + 8 + j] = (uint8_t)(32 + 8 * L + j);
    }
  return _mm512_loadu_si512(o);
}

/* 64 codes of a fast block (c, in their order; order: afd_fp8_lut_order()) and its table (t:
 * four registers) -> the weights of the first 32 codes in w[0], of the next 32 in w[1]. */
static inline __attribute__((always_inline)) AFD_AVX512VBMI void afd_fp8_lut64(
    __m512i c, __m512i order, const __m512i t[4], __m512bh w[2]) {
  c = _mm512_permutexvar_epi8(order, c);
  const __m512i lo = _mm512_permutex2var_epi8(t[0], c, t[1]);
  const __m512i hi = _mm512_permutex2var_epi8(t[2], c, t[3]);
  /* hi ^ (c & 0x80): the code's sign on its weight's */
  const __m512i sh = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8((char)0x80), 0x78);
  w[0] = (__m512bh)_mm512_unpacklo_epi8(lo, sh);
  w[1] = (__m512bh)_mm512_unpackhi_epi8(lo, sh);
}

#endif
