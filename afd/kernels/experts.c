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
