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

/* e^x on 8 lanes for any x (bf16.h's exp8 serves a softmax's x <= 0): above ln(FLT_MAX) +inf,
 * below -87.3 flushed to 0 (1 + e^x is then 1 either way), NaN kept; 2^n in two factors so n =
 * 128 (x just under the overflow) stays finite. The same series as exp8: within an ulp of expf. */
static inline __m256 afd_exp8_any(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.7228394f);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  __m256 n, p = exp8_series(_mm256_min_ps(hi, _mm256_max_ps(lo, x)), &n); /* keeps a NaN */
  __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256i rest = _mm256_sub_epi32(ni, half);
  __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, a), b);
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
  return _mm256_andnot_ps(under, y);
}

/* One activation from a gate and an up value (bf16 values) on each of 8 lanes, as bf16 values:
 * SwiGLU bf16(bf16(silu(gate)) * up) (F.silu then *, each rounded to bf16); the clamped SwiGLU
 * (gpt-oss): gate = min(gate, limit), up = clamp(up, +-limit), then
 * bf16(bf16(up + 1) * bf16(gate * bf16(sigmoid(bf16(gate * alpha))))). exp may differ from
 * torch's in the last bit, which rarely moves a bf16 result by one ulp (measured in
 * tests/unit/test_native_activation.py). */
static inline __m256 afd_act8(__m256 g, __m256 u, int act, float limit, float alpha) {
  const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
  if (act == ACT_SWIGLU) {
    __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, afd_exp8_any(_mm256_xor_ps(g, neg))));
    return round8(_mm256_mul_ps(round8(silu), u));
  }
  const __m256 lim = _mm256_set1_ps(limit);
  g = _mm256_min_ps(lim, g); /* operands in this order keep a NaN, as the scalar compares do */
  u = _mm256_max_ps(_mm256_xor_ps(lim, neg), _mm256_min_ps(lim, u));
  __m256 ga = round8(_mm256_mul_ps(g, _mm256_set1_ps(alpha)));
  __m256 sig = round8(_mm256_div_ps(one, _mm256_add_ps(one, afd_exp8_any(_mm256_xor_ps(ga, neg)))));
  __m256 glu = round8(_mm256_mul_ps(g, sig));
  return round8(_mm256_mul_ps(round8(_mm256_add_ps(u, one)), glu));
}

/* The (token, expert) pairs this shard holds (experts first .. first + E - 1 of ids [T, topk]),
 * sorted by expert and, within one, in t * topk + j order (the torch path's stable argsort):
 * pair q is token tokens[q] for local expert expert[q] with routing weight weights[q] (gate
 * rounded to bf16, as the torch path rounds it); expert e's pairs are starts[e] ..
 * starts[e + 1] - 1, P in all. Token t's pairs, in that order: mine[t_starts[t]] ..
 * mine[t_starts[t + 1] - 1]. */
typedef struct {
  int P;
  int32_t *starts;   /* [E + 1] */
  int64_t *tokens;   /* [P] */
  int32_t *expert;   /* [P] */
  float *weights;    /* [P] */
  int32_t *t_starts; /* [T + 1] */
  int32_t *mine;     /* [P] */
} afd_pairs;

/* experts.c: a counting sort. Returns 0, or -1 when memory is short (nothing to free then). */
int afd_pairs_sort(const int32_t *ids, const float *gate, int T, int topk, int first, int E,
                   afd_pairs *pairs);
void afd_pairs_free(afd_pairs *pairs);

/* The pairs' results summed into rows r0 .. r1 of out [T, H] bf16 (experts.c; H a multiple of
 * 8), as the torch path's index_add_ on bf16 sums them: in fp32, pair by pair in order, rounded
 * once (a row no pair adds to is left alone). Pair p adds bf16(bf16(y_p [+ bias]) * weight_p),
 * y [P, H] given as bf16 (yb) or as fp32 sums rounded to bf16 first (yf, yb NULL);
 * bias[expert] [H], or NULL for none. acc: H floats of the caller's thread's scratch. */
void afd_pairs_sum(const afd_pairs *pairs, const uint16_t *const *bias, const uint16_t *yb,
                   const float *yf, int H, float *acc, uint16_t *out, int r0, int r1);

/* One pair's activations (experts.c), afd_act8 eight at a time: a[j] = act(gate_j [+ bias_j],
 * up_j [+ bias_{I+j}]) for j < I (I % 8 == 0), gate|up [2I] given as bf16 (gb) or as fp32 sums
 * rounded to bf16 first (gf, gb NULL), a written as bf16 (ab) or fp32 (af, ab NULL). */
void afd_act_row(const uint16_t *gb, const float *gf, const uint16_t *bias, int I, int act,
                 float limit, float alpha, uint16_t *ab, float *af);
#endif
