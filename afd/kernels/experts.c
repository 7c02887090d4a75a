/* The (token, expert) pairs a shard holds, sorted as the torch path sorts them (experts.h). */
#include <stdlib.h>

#include "experts.h"

int afd_pairs_sort(const int32_t *ids, const float *gate, int T, int topk, int first, int E,
                   afd_pairs *pairs) {
  afd_pairs s = {0};
  s.starts = (int32_t *)calloc((size_t)E + 1, sizeof(int32_t));
  if (!s.starts) return -1;
  for (int p = 0; p < T * topk; p++) {
    int e = ids[p] - first;
    if (e >= 0 && e < E) s.starts[e + 1]++, s.P++;
  }
  for (int e = 0; e < E; e++) s.starts[e + 1] += s.starts[e];
  size_t n = s.P ? (size_t)s.P : 1;
  s.tokens = (int64_t *)malloc(n * sizeof(int64_t));
  s.expert = (int32_t *)malloc(n * sizeof(int32_t));
  s.weights = (float *)malloc(n * sizeof(float));
  int32_t *fill = (int32_t *)malloc((size_t)E * sizeof(int32_t));
  if (!s.tokens || !s.expert || !s.weights || !fill) {
    free(fill);
    afd_pairs_free(&s);
    return -1;
  }
  for (int e = 0; e < E; e++) fill[e] = s.starts[e];
  for (int p = 0; p < T * topk; p++) { /* stable: in t * topk + j order within an expert */
    int e = ids[p] - first;
    if (e >= 0 && e < E) {
      int q = fill[e]++;
      s.tokens[q] = p / topk;
      s.expert[q] = e;
      s.weights[q] = bf16_round(gate[p]);
    }
  }
  free(fill);
  *pairs = s;
  return 0;
}

void afd_pairs_free(afd_pairs *pairs) {
  free(pairs->starts), free(pairs->tokens), free(pairs->expert), free(pairs->weights);
  pairs->starts = NULL, pairs->tokens = NULL, pairs->expert = NULL, pairs->weights = NULL;
}

void afd_pairs_sum(const afd_pairs *pairs, const uint16_t *const *bias, const uint16_t *yb,
                   const float *yf, int T, int H, float *acc, uint16_t *out, int c0, int c1) {
  /* eight columns at a time: each element still takes the same steps, pair by pair in order */
  for (int r = 0; r < T; r++)
    for (int k = c0; k < c1; k += 8)
      _mm256_storeu_ps(acc + (size_t)r * H + k, load_bf16(out + (size_t)r * H + k));
  for (int p = 0; p < pairs->P; p++) {
    float *o = acc + (size_t)pairs->tokens[p] * H;
    const uint16_t *b = bias ? bias[pairs->expert[p]] : NULL;
    const __m256 w = _mm256_set1_ps(pairs->weights[p]);
    const size_t row = (size_t)p * H;
    for (int k = c0; k < c1; k += 8) {
      __m256 y = yb ? load_bf16(yb + row + k) : round8(_mm256_loadu_ps(yf + row + k));
      if (b) y = round8(_mm256_add_ps(y, load_bf16(b + k)));
      _mm256_storeu_ps(o + k, _mm256_add_ps(_mm256_loadu_ps(o + k), round8(_mm256_mul_ps(y, w))));
    }
  }
  for (int r = 0; r < T; r++)
    for (int k = c0; k < c1; k += 8)
      store8(out + (size_t)r * H + k, round8(_mm256_loadu_ps(acc + (size_t)r * H + k)));
}

/* Eight lanes of gate|up from one of the two sources, rounded to bf16 values, bias added. */
static inline __m256 gate_up8(const uint16_t *gb, const float *gf, const uint16_t *bias, int j) {
  __m256 h = gb ? load_bf16(gb + j) : round8(_mm256_loadu_ps(gf + j));
  return bias ? round8(_mm256_add_ps(h, load_bf16(bias + j))) : h;
}

void afd_act_row(const uint16_t *gb, const float *gf, const uint16_t *bias, int I, int act,
                 float limit, float alpha, uint16_t *ab, float *af) {
  for (int j = 0; j < I; j += 8) {
    __m256 a = afd_act8(gate_up8(gb, gf, bias, j), gate_up8(gb, gf, bias, I + j), act, limit,
                        alpha);
    if (ab)
      store8(ab + j, a);
    else
      _mm256_storeu_ps(af + j, a);
  }
}

/* afd_act_row over P rows of gate|up [P, 2I] bf16 into a [P, I] bf16, for the tests (against
 * torch's activation). Returns 0, or -1 for I not a multiple of 8. */
int afd_act_rows(const uint16_t *gu, int P, int I, int act, float limit, float alpha,
                 uint16_t *a) {
  if (I % 8 != 0 || I <= 0) return -1;
  for (int p = 0; p < P; p++)
    afd_act_row(gu + (size_t)p * 2 * I, NULL, NULL, I, act, limit, alpha, a + (size_t)p * I, NULL);
  return 0;
}
