/* The (token, expert) pairs a shard holds, sorted as the torch path sorts them (experts.h). */
#include <stdlib.h>
#include <string.h>

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
  /* each token's pairs in pair order (a stable counting sort by token) */
  s.t_starts = (int32_t *)calloc((size_t)T + 1, sizeof(int32_t));
  s.mine = (int32_t *)malloc(n * sizeof(int32_t));
  int32_t *at = (int32_t *)malloc(((size_t)T + 1) * sizeof(int32_t));
  if (!s.t_starts || !s.mine || !at) {
    free(at);
    afd_pairs_free(&s);
    return -1;
  }
  for (int q = 0; q < s.P; q++) s.t_starts[s.tokens[q] + 1]++;
  for (int t = 0; t < T; t++) s.t_starts[t + 1] += s.t_starts[t];
  memcpy(at, s.t_starts, ((size_t)T + 1) * sizeof(int32_t));
  for (int q = 0; q < s.P; q++) s.mine[at[s.tokens[q]]++] = q;
  free(at);
  *pairs = s;
  return 0;
}

void afd_pairs_free(afd_pairs *pairs) {
  free(pairs->starts), free(pairs->tokens), free(pairs->expert), free(pairs->weights);
  free(pairs->t_starts), free(pairs->mine);
  pairs->starts = NULL, pairs->tokens = NULL, pairs->expert = NULL, pairs->weights = NULL;
  pairs->t_starts = NULL, pairs->mine = NULL;
}

void afd_pairs_sum(const afd_pairs *pairs, const uint16_t *const *bias, const uint16_t *yb,
                   const float *yf, int H, float *acc, uint16_t *out, int r0, int r1) {
  /* a token at a time, its pairs' rows read front to back (by columns, each pair's few columns
   * were a strided read that missed the cache: 14% of a prefill); eight columns at a time */
  for (int r = r0; r < r1; r++) {
    const int32_t *q = pairs->mine + pairs->t_starts[r];
    const int n = pairs->t_starts[r + 1] - pairs->t_starts[r];
    if (n == 0) continue;
    uint16_t *o = out + (size_t)r * H;
    for (int k = 0; k < H; k += 8) _mm256_storeu_ps(acc + k, load_bf16(o + k));
    for (int i = 0; i < n; i++) {
      const int p = q[i];
      const uint16_t *b = bias ? bias[pairs->expert[p]] : NULL;
      const __m256 w = _mm256_set1_ps(pairs->weights[p]);
      const size_t row = (size_t)p * H;
      for (int k = 0; k < H; k += 8) {
        __m256 y = yb ? load_bf16(yb + row + k) : round8(_mm256_loadu_ps(yf + row + k));
        if (b) y = round8(_mm256_add_ps(y, load_bf16(b + k)));
        _mm256_storeu_ps(acc + k,
                         _mm256_add_ps(_mm256_loadu_ps(acc + k), round8(_mm256_mul_ps(y, w))));
      }
    }
    for (int k = 0; k < H; k += 8) store8(o + k, round8(_mm256_loadu_ps(acc + k)));
  }
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
