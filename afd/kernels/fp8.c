/* The per-token FP8 wire codec (loaded with ctypes by afd/kernels/fp8.py), one pass per row
 * where afd/quant.py's torch path spends ~7 ops (mostly dispatch at a decode micro-batch's
 * size, on every layer of both sides):
 *
 *   quantize:   scale = max(amax(|x|) / 448, 2^-126);  q = e4m3fn(x / scale)
 *   dequantize: y = bf16(fp32(q) * scale)
 *
 * Same bits as the torch path: IEEE division and product in fp32, the float -> e4m3fn
 * rounding of PyTorch's c10 conversion (round to nearest even; from 480 up, NaN), fp8 -> fp32
 * exact. No FTZ/DAZ: subnormals stay subnormals, as in torch. tests/unit/test_quant.py checks
 * both against the torch path bit for bit. isa (bf16.h's ISA_*): ISA_AVX2 runs 8 values at a
 * time, the AVX-512 paths 16 with the same steps (an amax is exact in any order): the same bits. */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"
#include "bf16_512.h"

/* fp32 -> e4m3fn on 8 lanes, as c10's fp8e4m3fn_from_fp32_value; the low byte of each lane. */
static inline __m256i e4m3_8(__m256 f) {
  const __m256i sign_bit = _mm256_set1_epi32((int)0x80000000u);
  __m256i bits = _mm256_castps_si256(f);
  __m256i sign = _mm256_and_si256(bits, sign_bit);
  bits = _mm256_xor_si256(bits, sign); /* |f| */
  /* below 2^-6 (e4m3's smallest normal): adding 2^14 (141 << 23 as a float), whose fp32 ulp
   * is 2^-9, e4m3's subnormal step, rounds |f| to a whole number of steps (to nearest even);
   * the bits past 2^14's are that number, the subnormal's code */
  const __m256i denorm = _mm256_set1_epi32(141 << 23);
  __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(bits), _mm256_castsi256_ps(denorm))),
      denorm);
  /* normal: rebias the exponent, round the mantissa to 3 bits (to nearest even) */
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
  const __m256i rebias = _mm256_set1_epi32((int)((uint32_t)(7 - 127) << 23) + 0x7FFFF);
  __m256i norm = _mm256_add_epi32(bits, rebias);
  norm = _mm256_srli_epi32(_mm256_add_epi32(norm, odd), 20);
  /* signed compares are fine: bits is non-negative */
  __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), bits);
  __m256i big = _mm256_cmpgt_epi32(bits, _mm256_set1_epi32((1087 << 20) - 1)); /* >= 480 or NaN */
  __m256i r = _mm256_blendv_epi8(norm, sub, small);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), big);
  r = _mm256_and_si256(r, _mm256_set1_epi32(0xff));
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

/* 8 int32 lanes holding bytes -> 8 bytes at p. */
static inline void store_bytes8(uint8_t *p, __m256i v) {
  __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  __m128i w = _mm_packus_epi32(lo, hi); /* 8 x u16 */
  w = _mm_packus_epi16(w, w);           /* 8 x u8 (twice) */
  _mm_storel_epi64((__m128i *)p, w);
}

/* e4m3_8 on 16 lanes, the 16 codes as bytes. */
static inline AVX512 __m128i e4m3_16(__m512 f) {
  __m512i bits = _mm512_castps_si512(f);
  __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32((int)0x80000000u));
  bits = _mm512_xor_si512(bits, sign);
  const __m512i denorm = _mm512_set1_epi32(141 << 23);
  __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(bits), _mm512_castsi512_ps(denorm))),
      denorm);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
  const __m512i rebias = _mm512_set1_epi32((int)((uint32_t)(7 - 127) << 23) + 0x7FFFF);
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, rebias), odd), 20);
  __mmask16 small = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(121 << 23), bits);
  __mmask16 big = _mm512_cmpgt_epi32_mask(bits, _mm512_set1_epi32((1087 << 20) - 1));
  r = _mm512_mask_mov_epi32(r, small, sub);
  r = _mm512_mask_mov_epi32(r, big, _mm512_set1_epi32(0x7f));
  r = _mm512_and_si512(r, _mm512_set1_epi32(0xff));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, _mm512_srli_epi32(sign, 24)));
}

/* A row's amax 16 values at a time: the largest |x| (exact in any order), NaN if any is. */
static AVX512 float amax512(const uint16_t *row, int H) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  int k = 0;
  for (; k + 16 <= H; k += 16) {
    __m512 v = load16_bf16(row + k);
    m = _mm512_max_ps(m, _mm512_and_ps(v, absmask));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  float amax = _mm512_reduce_max_ps(m);
  for (; k < H; k++) {
    float v = bf16_value(row[k]);
    if (v != v) nan = 1;
    amax = fmaxf(amax, fabsf(v));
  }
  return nan ? __builtin_nanf("") : amax;
}

static AVX512 void quantize_row512(const uint16_t *row, uint8_t *out, float s, int H) {
  const __m512 vs = _mm512_set1_ps(s);
  int k = 0;
  for (; k + 16 <= H; k += 16)
    _mm_storeu_si128((__m128i *)(out + k), e4m3_16(_mm512_div_ps(load16_bf16(row + k), vs)));
  if (k < H) store_bytes8(out + k, e4m3_8(_mm256_div_ps(load_bf16(row + k), _mm256_set1_ps(s))));
}

/* x [T, H] bf16 -> q [T, H] e4m3fn bytes, scales [T] fp32. H % 8 == 0. */
int afd_fp8_quantize(const uint16_t *x, uint8_t *q, float *scales, int T, int H, int threads,
                     int isa) {
  if (H % 8 != 0 || T < 0) return -1;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int t_max = (size_t)T * H >= (1u << 16) && threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(t_max) schedule(static) if (t_max > 1)
  for (int t = 0; t < T; t++) {
    const uint16_t *row = x + (size_t)t * H;
    uint8_t *out = q + (size_t)t * H;
    float amax;
    if (isa != ISA_AVX2) {
      amax = amax512(row, H);
    } else {
      __m256 m = _mm256_setzero_ps(), nan = m;
      for (int k = 0; k < H; k += 8) {
        __m256 v = load_bf16(row + k);
        m = _mm256_max_ps(m, _mm256_and_ps(v, absmask));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      /* A NaN in the row makes torch's amax NaN (and the row garbage): the same here. */
      amax = _mm256_movemask_ps(nan) ? __builtin_nanf("") : _mm_cvtss_f32(m4);
    }
    float s = amax / 448.0f;
    if (s < 0x1p-126f) s = 0x1p-126f; /* clamp_min (a NaN stays NaN) */
    scales[t] = s;
    if (isa != ISA_AVX2) {
      quantize_row512(row, out, s, H);
    } else {
      const __m256 vs = _mm256_set1_ps(s);
      for (int k = 0; k < H; k += 8)
        store_bytes8(out + k, e4m3_8(_mm256_div_ps(load_bf16(row + k), vs)));
    }
  }
  return 0;
}

/* afd_fp8_dequantize's steps on 16 values at a time; returns how many values it did (a last 8
 * are left to the 8-lane loop). */
static AVX512 int dequantize_row512(const uint8_t *row, uint16_t *out, int small, float scale,
                                    int H) {
  const __m512i mask = _mm512_set1_epi32((int)0x87F00000u);
  const __m512 rebias = _mm512_set1_ps(0x1p120f), vs = _mm512_set1_ps(scale);
  int k = 0;
  for (; k + 16 <= H; k += 16) {
    __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k)));
    __m512 v = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 20), mask));
    if (!small) v = _mm512_mul_ps(v, rebias);
    store16(out + k, round16(_mm512_mul_ps(v, vs)));
  }
  return k;
}

/* q [T, H] e4m3fn bytes, scales [T] -> y [T, H] bf16 = bf16(fp32(q) * scale). The byte,
 * sign-extended, shifted left by 20 and masked, reads as an fp32 of the code's value times
 * 2^-120 (normals and subnormals alike; the NaN codes read as +-480, as in the torch path);
 * times scale * 2^120, which is exact for every scale below 2^7, that is the product rounded
 * once. Larger scales undo the 2^-120 first (exact) and then multiply. */
int afd_fp8_dequantize(const uint8_t *q, const float *scales, uint16_t *y, int T, int H,
                       int threads, int isa) {
  if (H % 8 != 0 || T < 0) return -1;
  const __m256i mask = _mm256_set1_epi32((int)0x87F00000u);
  const __m256 rebias = _mm256_set1_ps(0x1p120f);
  int t_max = (size_t)T * H >= (1u << 16) && threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(t_max) schedule(static) if (t_max > 1)
  for (int t = 0; t < T; t++) {
    const float s = scales[t];
    const int small = s < 0x1p7f; /* false for NaN too, as the torch path's test */
    const __m256 vs = _mm256_set1_ps(small ? s * 0x1p120f : s);
    const uint8_t *row = q + (size_t)t * H;
    uint16_t *out = y + (size_t)t * H;
    int k0 = isa != ISA_AVX2 ? dequantize_row512(row, out, small, small ? s * 0x1p120f : s, H) : 0;
    for (int k = k0; k < H; k += 8) {
      __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k)));
      __m256 v = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), mask));
      if (!small) v = _mm256_mul_ps(v, rebias);
      store8(out + k, round8(_mm256_mul_ps(v, vs)));
    }
  }
  return 0;
}
