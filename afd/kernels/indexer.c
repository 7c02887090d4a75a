/* DeepSeek Sparse Attention's lightning-indexer scores over the paged indexer-key pool
 * (loaded with ctypes by afd/kernels/indexer.py).
 *
 * For query row i and each position l of its block table,
 *   index[i, l] = sum_h w[i, h] * relu(scale * (q[i, h] . k_l))
 * with q and w in fp32 and the keys bf16 in the pool, read in place: the torch path gathers
 * the row's blocks into a copy and widens it to fp32 before one matmul, four passes over
 * bytes that this reads once. Products are exact (bf16 widened to fp32); the sums' order is
 * this kernel's, so scores differ from the torch path's in the last fp32 bits.
 *
 * Work is split over (row, block) pairs; a block's bs positions are scored 8 at a time, each
 * query head's 8 dot products reduced together. */
#include <omp.h>

#include "bf16.h"

/* Scores of up to 8 positions whose keys (fp32, zero-padded) are kt[8][D]. */
static inline __m256 score8(const float *q, const float *w, const float *kt, int H, int D,
                            float scale) {
  const __m256 vscale = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
  __m256 acc = zero;
  for (int h = 0; h < H; h++) {
    const float *qh = q + (size_t)h * D;
    __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero, a6 = zero, a7 = zero;
    for (int d = 0; d < D; d += 8) {
      __m256 c = _mm256_loadu_ps(qh + d);
      a0 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + d), a0);
      a1 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + D + d), a1);
      a2 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 2 * D + d), a2);
      a3 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 3 * D + d), a3);
      a4 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 4 * D + d), a4);
      a5 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 5 * D + d), a5);
      a6 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 6 * D + d), a6);
      a7 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 7 * D + d), a7);
    }
    __m256 s = _mm256_max_ps(_mm256_mul_ps(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7), vscale), zero);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(w[h]), s, acc);
  }
  return acc;
}

/* q [n, H, D] fp32, w [n, H] fp32, pool [NB, bs, D] bf16, blocks [n or 1, nb] (shared: every
 * row reads row 0), out [n, nb * bs] fp32. D % 8 == 0. Returns 0, or -1 for a block id outside
 * the pool (nothing is read from it). */
int afd_bf16_index_scores(const float *q, const float *w, const uint16_t *pool,
                          const int64_t *blocks, int shared, float *out, int n, int H, int D,
                          int NB, int nb, int bs, float scale, int threads) {
  int bad = 0;
  const int64_t L = (int64_t)nb * bs;
#pragma omp parallel num_threads(threads) reduction(| : bad)
  {
    float kt[8 * 256];  /* D <= 256 */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (int64_t)n * nb; t++) {
      int i = (int)(t / nb), j = (int)(t % nb);
      int64_t b = blocks[(shared ? 0 : (int64_t)i * nb) + j];
      float *o = out + (size_t)i * L + (size_t)j * bs;
      if (b < 0 || b >= NB) {
        bad = 1;
        for (int p = 0; p < bs; p++) o[p] = 0.0f;
        continue;
      }
      const uint16_t *keys = pool + (size_t)b * bs * D;
      const float *qi = q + (size_t)i * H * D, *wi = w + (size_t)i * H;
      for (int p0 = 0; p0 < bs; p0 += 8) {
        int m = bs - p0 < 8 ? bs - p0 : 8;
        for (int r = 0; r < 8; r++)
          for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(kt + r * D + d, r < m ? load_bf16(keys + (size_t)(p0 + r) * D + d)
                                                   : _mm256_setzero_ps());
        float s[8];
        _mm256_storeu_ps(s, score8(qi, wi, kt, H, D, scale));
        for (int r = 0; r < m; r++) o[p0 + r] = s[r];
      }
    }
  }
  return bad ? -1 : 0;
}
