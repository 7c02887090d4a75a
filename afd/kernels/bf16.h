/* Helpers shared by afd's AVX2 kernels (gemm.c, moe.c, attention.c): bf16 <-> fp32 and the
 * weight-streaming matmul the other two build on. */
#ifndef AFD_BF16_H
#define AFD_BF16_H

#include <immintrin.h>
#include <stdint.h>

static inline __m256 load_bf16(const uint16_t *p) {
  __m128i v = _mm_loadu_si128((const __m128i *)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

static inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

/* fp32 -> bf16 bits, round to nearest even (NaN stays NaN), as torch's .to(torch.bfloat16). */
static inline uint16_t to_bf16(float f) {
  union { float f; uint32_t u; } v = {f};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* An fp32 rounded to bf16 (and back to fp32), and a bf16 value as fp32. */
static inline float bf16_round(float f) {
  union { uint32_t u; float f; } v = {(uint32_t)to_bf16(f) << 16};
  return v.f;
}

static inline float bf16_value(uint16_t b) {
  union { uint32_t u; float f; } v = {(uint32_t)b << 16};
  return v.f;
}

/* Weight rows stream from DRAM once per step. On 2-4 interleaved rows the hardware prefetcher
 * alone keeps only about half of the read bandwidth busy (measured on AMD Zen 3: 4 rows of x
 * against 1024x1024 weights, 14 GB/s -> 24 GB/s), so the streaming loops ask for the cache
 * line AHEAD elements (8 KiB) further on, once per 32 elements. Past the end it is a no-op:
 * a prefetch never faults. */
#define AHEAD 4096
/* A macro: as an inline function, GCC 12 left every prefetch out of gemm.c (seen in the asm). */
#define ahead(p, k)                                                        \
  do {                                                                     \
    if (((k) & 31) == 0)                                                   \
      _mm_prefetch((const char *)((p) + (k) + AHEAD), _MM_HINT_T0);        \
  } while (0)

/* y[M, N] (bf16) = xf[M, K] (fp32) @ W[n0..n1, K]^T (bf16), 4 weight rows at a time; wt is
 * scratch for 4 rows of W in fp32, used when M >= WIDE_M (gemm.c). */
#define WIDE_M 6
void afd_rows(const float *xf, const uint16_t *w, uint16_t *y, int M, int N, int K, int n0,
              int n1, float *wt);

#endif
