/* Paged decode attention (loaded with ctypes by afd/kernels/attention.py).
 *
 * One query token per sequence against its K/V blocks in the paged cache, read in place (no
 * gather of the blocks into a contiguous copy, no fp32 copies of K and V): for each sequence b,
 * K/V head h and the g query heads sharing it,
 *   s_l = bf16(q . k_l) * scale           (the bf16 scores of a bf16 bmm, then fp32)
 *   p_l = bf16(softmax(s)_l)              (fp32 softmax over the sequence's len_b positions)
 *   o   = bf16(sum_l p_l v_l)
 * the steps of services/attention/attention.py's torch path; results differ from it only by
 * fp32 summation order and expf's last bit (< 1 bf16 ulp, rarely). (b, h) pairs are spread
 * over threads. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "bf16.h"

/* q [B, kvh * g, D], k/v cache [kvh, NB, bs, D], blocks [B, nb] int64, lens [B] int64,
 * out [B, kvh * g, D]; all bf16 but the indices. Returns 0, or -1 when D is not a multiple of
 * 8, a length exceeds the block table, or memory is short. */
int afd_bf16_decode_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *blocks, const int64_t *lens, uint16_t *out, int B,
                              int kvh, int g, int D, int NB, int bs, int nb, float scale,
                              int threads) {
  if (D % 8 != 0 || B <= 0) return -1;
  for (int b = 0; b < B; b++)
    if (lens[b] < 1 || lens[b] > (int64_t)nb * bs) return -1;
  int failed = 0, t = threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(t) schedule(dynamic, 1) if (t > 1)
  for (int task = 0; task < B * kvh; task++) {
    int b = task / kvh, h = task % kvh, len = (int)lens[b];
    float *qf = (float *)malloc((size_t)g * D * sizeof(float));
    float *s = (float *)malloc((size_t)g * len * sizeof(float));
    float *acc = (float *)malloc((size_t)D * sizeof(float));
    if (!qf || !s || !acc) {
      failed = 1;
    } else {
      const uint16_t *qb = q + ((size_t)b * kvh * g + (size_t)h * g) * D;
      for (int i = 0; i < g * D; i += 8) _mm256_storeu_ps(qf + i, load_bf16(qb + i));
      for (int l = 0; l < len; l++) {
        int64_t blk = blocks[(size_t)b * nb + l / bs];
        const uint16_t *kp = k_cache + (((size_t)h * NB + blk) * bs + l % bs) * D;
        for (int j = 0; j < g; j++) {
          __m256 a = _mm256_setzero_ps();
          for (int d = 0; d < D; d += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (size_t)j * D + d), load_bf16(kp + d), a);
          s[(size_t)j * len + l] = bf16_round(hsum(a)) * scale;
        }
      }
      for (int j = 0; j < g; j++) {
        float *sj = s + (size_t)j * len, m = sj[0], sum = 0.0f;
        for (int l = 1; l < len; l++) m = sj[l] > m ? sj[l] : m;
        for (int l = 0; l < len; l++) sum += (sj[l] = expf(sj[l] - m));
        for (int l = 0; l < len; l++) sj[l] = bf16_round(sj[l] / sum);
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        for (int l = 0; l < len; l++) {
          int64_t blk = blocks[(size_t)b * nb + l / bs];
          const uint16_t *vp = v_cache + (((size_t)h * NB + blk) * bs + l % bs) * D;
          __m256 p = _mm256_set1_ps(sj[l]);
          for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(p, load_bf16(vp + d), _mm256_loadu_ps(acc + d)));
        }
        uint16_t *ob = out + ((size_t)b * kvh * g + (size_t)h * g + j) * D;
        for (int d = 0; d < D; d++) ob[d] = to_bf16(acc[d]);
      }
    }
    free(qf);
    free(s);
    free(acc);
  }
  return failed ? -1 : 0;
}
