/* What moe.c and mxfp4_moe.c share around their matmuls: the (token, expert) pairs sorted by
 * expert, a bias added to a bf16 result and the activation between the gate|up and down
 * projections, each step rounded to bf16 as the torch path (services/ffn/experts.py, kinds.py)
 * rounds it. */
#ifndef AFD_EXPERTS_H
#define AFD_EXPERTS_H
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* services/ffn/kinds.py's kinds the fused calls compute (afd/kernels/moe.py: ACTS) */
#define ACT_SWIGLU 0         /* bf16(bf16(silu(gate)) * up) */
#define ACT_SWIGLU_CLAMPED 1 /* gpt-oss: see afd_act */

/* h (a bf16 value) + bias[j] rounded to bf16, as `y + bias` on bf16 tensors; h without one */
static inline float afd_biased(float h, const uint16_t *bias, int j) {
  return bias ? bf16_round(h + bf16_value(bias[j])) : h;
}

/* One activation from a gate and an up value (bf16 values), as a bf16 value. The clamped
 * SwiGLU: gate = min(gate, limit), up = clamp(up, +-limit), then
 * bf16(bf16(up + 1) * bf16(gate * bf16(sigmoid(bf16(gate * alpha))))). expf may differ from
 * torch's in the last bit, which rarely moves a bf16 result by one ulp. */
static inline float afd_act(float g, float u, int act, float limit, float alpha) {
  if (act == ACT_SWIGLU) return bf16_round(bf16_round(g / (1.0f + expf(-g))) * u);
  g = g > limit ? limit : g;
  u = u > limit ? limit : (u < -limit ? -limit : u);
  float ga = bf16_round(g * alpha);
  float glu = bf16_round(g * bf16_round(1.0f / (1.0f + expf(-ga))));
  return bf16_round(bf16_round(u + 1.0f) * glu);
}
/* The (token, expert) pairs this shard holds (experts first .. first + E - 1 of ids [T, topk]),
 * sorted by expert and, within one, in t * topk + j order (the torch path's stable argsort):
 * pair q is token tokens[q] for local expert expert[q] with routing weight weights[q] (gate
 * rounded to bf16, as the torch path rounds it); expert e's pairs are starts[e] ..
 * starts[e + 1] - 1, P in all. */
typedef struct {
  int P;
  int32_t *starts; /* [E + 1] */
  int64_t *tokens; /* [P] */
  int32_t *expert; /* [P] */
  float *weights;  /* [P] */
} afd_pairs;

/* experts.c: a counting sort. Returns 0, or -1 when memory is short (nothing to free then). */
int afd_pairs_sort(const int32_t *ids, const float *gate, int T, int topk, int first, int E,
                   afd_pairs *pairs);
void afd_pairs_free(afd_pairs *pairs);
#endif
