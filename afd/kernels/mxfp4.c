/* MXFP4 weights (loaded with ctypes by afd/kernels/mxfp4.py): W [N, K] as blocks [N, K/32, 16]
 * (two e2m1 codes a byte, the even element in the low nibble) and scales [N, K/32] (e8m0).
 *
 * afd_mxfp4_linear multiplies x [M, K] (bf16 or float32) by W.T reading the 4-bit codes directly: a decode
 * step streams 17 bytes per 32 weights instead of 64. A block's 32 codes become int8 values
 * of twice the e2m1 value with one table lookup (vpshufb), then fp32; x times them is exact in
 * fp32, each block's sum is scaled by its power of two and accumulated, so results differ from
 * a bf16 matmul over the dequantized weights only in the fp32 summation order.
 * afd_mxfp4_to_bf16 expands rows into bf16 (exact: every MXFP4 value is a bf16 value), the
 * online conversion the FFN server's expert workspace keeps. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "bf16.h"

/* 2 x the e2m1 value of each code, as int8 */
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

/* scale byte s -> 2^(s - 127) / 2 (the codes above are twice their values) */
static float scale_of[256];
static void init_scales(void) {
  static int done = 0;
  if (done) return;
  for (int s = 0; s < 256; s++) scale_of[s] = ldexpf(1.0f, s - 128);
  done = 1;
}

int afd_mxfp4_to_bf16(const uint8_t *blocks, const uint8_t *scales, uint16_t *out, int N, int K,
                      int threads) {
  if (K % 32) return -1;
  init_scales();
  const int G = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < (int64_t)N * G; i++) {
    __m256 v[4];
    decode32(blocks + i * 16, v);
    __m256 s = _mm256_set1_ps(scale_of[scales[i]]);
    for (int j = 0; j < 4; j++) store8(out + i * 32 + j * 8, round8(_mm256_mul_ps(v[j], s)));
  }
  return 0;
}

#define MT 8 /* rows of x per pass over a weight row */
#define NU 8 /* weight rows per work unit */

/* x [M, K] and y [M, N] are bf16, or float32 with f32 set. */
int afd_mxfp4_linear(const void *x, const uint8_t *blocks, const uint8_t *scales, void *y, int M,
                     int N, int K, int f32, int threads) {
  if (K % 32) return -1;
  init_scales();
  const int G = K / 32;
  float *xf = (float *)aligned_alloc(64, ((size_t)M * K * sizeof(float) + 63) / 64 * 64);
  if (!xf) return -2;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < (int64_t)M * K; i += 8)
      _mm256_storeu_ps(xf + i, f32 ? _mm256_loadu_ps((const float *)x + i)
                                   : load_bf16((const uint16_t *)x + i));
#pragma omp for schedule(dynamic)
    for (int n0 = 0; n0 < N; n0 += NU) {
      int n1 = n0 + NU < N ? n0 + NU : N;
      for (int n = n0; n < n1; n++) {
        const uint8_t *wb = blocks + (size_t)n * G * 16, *ws = scales + (size_t)n * G;
        for (int m0 = 0; m0 < M; m0 += MT) {
          int mt = M - m0 < MT ? M - m0 : MT;
          __m256 acc[MT];
          for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
          for (int g = 0; g < G; g++) {
            __m256 w[4];
            decode32(wb + (size_t)g * 16, w);
            __m256 s = _mm256_set1_ps(scale_of[ws[g]]);
            const float *xg = xf + (size_t)m0 * K + (size_t)g * 32;
            for (int m = 0; m < mt; m++) {
              const float *xm = xg + (size_t)m * K;
              __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xm));
              t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), t);
              t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), t);
              t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), t);
              acc[m] = _mm256_fmadd_ps(t, s, acc[m]);
            }
          }
          for (int m = 0; m < mt; m++) {
            size_t at = (size_t)(m0 + m) * N + n;
            if (f32)
              ((float *)y)[at] = hsum(acc[m]);
            else
              ((uint16_t *)y)[at] = to_bf16(hsum(acc[m]));
          }
        }
      }
    }
  }
  free(xf);
  return 0;
}
