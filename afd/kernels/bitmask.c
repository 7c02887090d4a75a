/* Structured outputs' token mask (loaded with ctypes by afd/kernels/bitmask.py): a grammar's
 * bitmask [rows, W] (int32 words, bit t % 32 of word t / 32 set when token t is allowed, as
 * xgrammar fills it) applied to the logits [B, V] fp32: -inf for every disallowed token of the
 * listed rows. One word covers 32 logits: broadcast it, test each lane's bit, blend in -inf;
 * rows split between threads. xgrammar's own CPU routine takes an element at a time. */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"

/* rows[r] is the logits row that mask row rows[r] applies to (xgrammar's `indices`). */
int afd_apply_bitmask(float *logits, const int32_t *mask, int V, int W, const int32_t *rows,
                      int R, int threads) {
  if (V <= 0 || W < (V + 31) / 32) return -1;
  const __m256i lane_bit[4] = {
      _mm256_setr_epi32(1 << 0, 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 5, 1 << 6, 1 << 7),
      _mm256_setr_epi32(1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15),
      _mm256_setr_epi32(1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 23),
      _mm256_setr_epi32(1 << 24, 1 << 25, 1 << 26, 1 << 27, 1 << 28, 1 << 29, 1 << 30,
                        (int)(1u << 31)),
  };
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
#pragma omp parallel for num_threads(threads) schedule(static) if (R > 1 && threads > 1)
  for (int r = 0; r < R; r++) {
    float *x = logits + (size_t)rows[r] * V;
    const int32_t *m = mask + (size_t)rows[r] * W;
    const int full = V / 32;
    for (int w = 0; w < full; w++) {
      if (m[w] == -1) continue; /* all 32 allowed */
      __m256i word = _mm256_set1_epi32(m[w]);
      for (int q = 0; q < 4; q++) {
        __m256i off = _mm256_cmpeq_epi32(_mm256_and_si256(word, lane_bit[q]), _mm256_setzero_si256());
        float *p = x + (size_t)w * 32 + q * 8;
        _mm256_storeu_ps(p, _mm256_blendv_ps(_mm256_loadu_ps(p), ninf, _mm256_castsi256_ps(off)));
      }
    }
    for (int t = full * 32; t < V; t++)
      if (!((uint32_t)m[t / 32] >> (t % 32) & 1u)) x[t] = -INFINITY;
  }
  return 0;
}
