/* bf16 <-> fp32 on 16 lanes for the small kernels' AVX-512 rows (norm_rope.c, fp8.c): the
 * same roundings as bf16.h's 8-lane helpers, so a row's bits do not depend on the instruction
 * set. Only functions that carry AVX512 themselves may call these (afd_cpu_avx512bf16() true). */
#ifndef AFD_BF16_512_H
#define AFD_BF16_512_H

#include <immintrin.h>
#include <stdint.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

static inline AVX512 __m512 load16_bf16(const uint16_t *p) {
  __m256i v = _mm256_loadu_si256((const __m256i *)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* fp32 -> bf16 -> fp32 on 16 lanes: round to nearest even, a NaN kept quiet (round8's bits). */
static inline AVX512 __m512 round16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

/* 16 fp32 lanes that already hold bf16 values -> 16 bf16 at p. */
static inline AVX512 void store16(uint16_t *p, __m512 v) {
  __m512i s = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(s));
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)]: halves added, then two rounds of pairwise sums; each
 * argument reduced in the same tree whatever its place (the streaming matmuls rely on it). */
static inline AVX512 __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
  __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
  __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
  __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
  __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

/* bf16.h's exp8 on 16 lanes, step for step (the same series, the same FMAs, the same
 * flush below -87.3): the same bits in every lane. */
static inline AVX512 __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654f);
  __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ); /* exp8's under, inverted */
  x = _mm512_max_ps(x, lo);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}

#endif
