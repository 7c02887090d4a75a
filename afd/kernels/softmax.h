/* A decode softmax row's steps (attention.c's softmax_rows, and attention_amx.c's, which runs
 * them on a row's chunks of positions): the max, the exponentials and their sum, the division.
 * wide: the exp and the division 16 lanes at a time (attention512.c; the same bits), on the
 * AVX-512 paths. Each step's bits are those of the one pass over a whole row that they were
 * split from. */
#ifndef AFD_SOFTMAX_H
#define AFD_SOFTMAX_H

#include "attention512.h"
#include "bf16.h"

/* max(s[0..n-1]), n >= 1: 4 x 8 lanes, then the rest (max_ps(x, m) is x > m ? x : m, the
 * scalar loop's step, so the order does not matter). */
static inline float softmax_max(const float *s, int n) {
  float m = s[0];
  int l = 1;
  if (n >= 33) {
    __m256 m0 = _mm256_set1_ps(m), m1 = m0, m2 = m0, m3 = m0;
    for (; l + 32 <= n; l += 32) {
      m0 = _mm256_max_ps(_mm256_loadu_ps(s + l), m0);
      m1 = _mm256_max_ps(_mm256_loadu_ps(s + l + 8), m1);
      m2 = _mm256_max_ps(_mm256_loadu_ps(s + l + 16), m2);
      m3 = _mm256_max_ps(_mm256_loadu_ps(s + l + 24), m3);
    }
    float t[32];
    _mm256_storeu_ps(t, m0), _mm256_storeu_ps(t + 8, m1);
    _mm256_storeu_ps(t + 16, m2), _mm256_storeu_ps(t + 24, m3);
    for (int i = 0; i < 32; i++) m = t[i] > m ? t[i] : m;
  }
  for (; l < n; l++) m = s[l] > m ? s[l] : m;
  return m;
}

/* s[l] <- exp(s[l] - m) for l < n; returns their sum (8 lanes, then the lanes' sum, then the
 * tail in order). */
static inline float softmax_exp_sum(float *s, int n, float m, int wide) {
  const __m256 vm = _mm256_set1_ps(m);
  float acc8[8] = {0};
  int l = wide ? afd_softmax512_exp_sum(s, n, m, acc8) : 0;
  __m256 acc = _mm256_loadu_ps(acc8);
  for (; l + 8 <= n; l += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), vm));
    _mm256_storeu_ps(s + l, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (l < n) { /* the tail through a padded copy: the same exp as the full vectors */
    float tmp[8] = {0};
    for (int i = l; i < n; i++) tmp[i - l] = s[i] - m;
    _mm256_storeu_ps(tmp, exp8(_mm256_loadu_ps(tmp)));
    for (int i = l; i < n; i++) s[i] = tmp[i - l];
  }
  float sum = hsum(acc);
  for (int i = l; i < n; i++) sum += s[i];
  return sum;
}

/* exp(x) as softmax_exp_sum computes it (a sink's share of the denominator) */
static inline float softmax_exp1(float x) {
  float tmp[8] = {x};
  _mm256_storeu_ps(tmp, exp8(_mm256_loadu_ps(tmp)));
  return tmp[0];
}

/* s[l] <- bf16(s[l] / sum) for l < n */
static inline void softmax_normalize(float *s, int n, float sum, int wide) {
  const __m256 vs = _mm256_set1_ps(sum);
  int l = wide ? afd_softmax512_normalize(s, n, sum) : 0;
  for (; l + 8 <= n; l += 8)
    _mm256_storeu_ps(s + l, round8(_mm256_div_ps(_mm256_loadu_ps(s + l), vs)));
  for (; l < n; l++) s[l] = bf16_round(s[l] / sum);
}

#endif
