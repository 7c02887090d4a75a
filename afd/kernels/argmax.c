/* Greedy decoding's choice (loaded with ctypes by afd/kernels/argmax.py): the index of each
 * row's largest logit, as torch.argmax picks it (the first of equal maxima; a NaN counts as
 * the largest, the first NaN wins). torch's reduction walks a row element by element; here
 * lanes keep their own running maximum and its index, merged at the row's end. */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"

/* Four sets of eight lanes, each keeping its running maximum and that value's index (a
 * lane's first, compared strictly): the sets break the compare-and-blend chain, which one set
 * alone waits on at every step. */
static int64_t row_argmax(const float *x, int V) {
  const int full = V / 32 * 32;
  int64_t best = 0;
  float top = x[0];
  if (full) {
    __m256 vmax[4], nan = _mm256_setzero_ps();
    __m256i vidx[4], at[4];
    for (int j = 0; j < 4; j++) {
      vmax[j] = _mm256_set1_ps(-INFINITY);
      vidx[j] = _mm256_setzero_si256();
      at[j] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * j));
    }
    const __m256i step = _mm256_set1_epi32(32);
    for (int i = 0; i < full; i += 32)
      for (int j = 0; j < 4; j++) {
        __m256 v = _mm256_loadu_ps(x + i + 8 * j);
        __m256 gt = _mm256_cmp_ps(v, vmax[j], _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax[j] = _mm256_blendv_ps(vmax[j], v, gt);
        vidx[j] = _mm256_blendv_epi8(vidx[j], at[j], _mm256_castps_si256(gt));
        at[j] = _mm256_add_epi32(at[j], step);
      }
    if (_mm256_movemask_ps(nan)) /* rare: the first NaN, found one by one */
      for (int i = 0; i < V; i++)
        if (isnan(x[i])) return i;
    float m[32] __attribute__((aligned(32)));
    int32_t id[32] __attribute__((aligned(32)));
    for (int j = 0; j < 4; j++) {
      _mm256_store_ps(m + 8 * j, vmax[j]);
      _mm256_store_si256((__m256i *)(id + 8 * j), vidx[j]);
    }
    /* the largest value; among lanes holding it the smallest index. A lane that never beat
     * -inf holds index 0, right only when the whole row is -inf, and then 0 is the answer. */
    best = id[0], top = m[0];
    for (int l = 1; l < 32; l++)
      if (m[l] > top || (m[l] == top && id[l] < best)) top = m[l], best = id[l];
  }
  for (int i = full; i < V; i++) {
    if (isnan(x[i])) return i;
    if (x[i] > top) top = x[i], best = i;
  }
  return best;
}

/* x [B, V] fp32 -> out [B]; rows split between threads. Returns 0, or -1 for V < 1. */
int afd_argmax_rows(const float *x, int B, int V, int64_t *out, int threads) {
  if (V < 1 || B < 0) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (B > 1 && threads > 1)
  for (int b = 0; b < B; b++) out[b] = row_argmax(x + (size_t)b * V, V);
  return 0;
}
