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

#endif
