/* Sampling a row's next token from its logits inside a native call (loaded with ctypes by
 * afd/kernels/sample.py; called by decode_stack.c's burst between its steps). The same
 * distribution as services/attention/sampler.py's `_filtered` then a multinomial draw:
 * logits / temperature; min-p (a token stays while it is within log(min_p) of the row's
 * largest); top-k (a token stays while it is at least the k-th largest, ties kept); top-p (in
 * descending order, a token stays while the probability before it is below top_p); then one
 * draw from what stays, in proportion to exp(x), by inverse CDF over the token ids with the
 * caller's uniform number. No sort: the k-th largest and the top-p cut are found by
 * partitioning around pivots, linear time on average. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Three-way partition of a[0, n) by key[a[.]] around piv: [0, *gt) larger, [*gt, *lt) equal,
 * [*lt, n) smaller. */
static void partition3(const float *key, int32_t *a, int n, float piv, int *gt, int *lt) {
  int lo = 0, mid = 0, hi = n;
  while (mid < hi) {
    float v = key[a[mid]];
    int32_t tmp;
    if (v > piv) {
      tmp = a[lo], a[lo] = a[mid], a[mid] = tmp;
      lo++, mid++;
    } else if (v < piv) {
      hi--;
      tmp = a[mid], a[mid] = a[hi], a[hi] = tmp;
    } else {
      mid++;
    }
  }
  *gt = lo, *lt = hi;
}

static float pivot(const float *key, const int32_t *a, int n) {
  float x = key[a[0]], y = key[a[n / 2]], z = key[a[n - 1]];
  if (x > y) { float t = x; x = y; y = t; }
  if (y > z) y = z;
  return x > y ? x : y; /* the median of the three */
}

/* The k-th largest of key over a[0, n), 1 <= k <= n (a is reordered). */
static float kth_largest(const float *key, int32_t *a, int n, int k) {
  for (;;) {
    float piv = pivot(key, a, n);
    int gt, lt;
    partition3(key, a, n, piv, &gt, &lt);
    if (k <= gt) {
      n = gt;
    } else if (k <= lt) {
      return piv;
    } else {
      a += lt, k -= lt, n -= lt;
    }
  }
}

/* keep[a[j]] = 1 for each token whose probability before it, in descending order, is below
 * target (ties between equal probabilities in the order they come): the top-p set. */
static void keep_mass(const float *p, int32_t *a, int n, double target, uint8_t *keep) {
  while (n > 0 && target > 0.0) {
    float piv = pivot(p, a, n);
    int gt, lt;
    partition3(p, a, n, piv, &gt, &lt);
    double above = 0.0;
    for (int j = 0; j < gt; j++) above += p[a[j]];
    if (above >= target) { /* every token from the pivot down comes after the cut */
      n = gt;
      continue;
    }
    for (int j = 0; j < gt; j++) keep[a[j]] = 1;
    target -= above;
    for (int j = gt; j < lt && target > 0.0; j++) {
      keep[a[j]] = 1;
      target -= p[a[j]];
    }
    a += lt, n -= lt;
  }
}

/* One row: logits l [V] -> the sampled id, or -1 where no token has a finite logit. work:
 * 3V floats-worth of scratch (x, p, and two index lists), keep: V bytes. */
static int64_t sample_row(const float *l, int V, float temperature, int top_k, float top_p,
                          float min_p, float u, float *x, float *p, int32_t *idx, int32_t *a,
                          uint8_t *keep) {
  float m = -INFINITY;
  for (int i = 0; i < V; i++) {
    x[i] = l[i] / temperature;
    if (x[i] > m) m = x[i];
  }
  if (!(m > -INFINITY) || isnan(m)) return -1;
  const float floor = min_p > 0.0f ? m + logf(min_p) : -INFINITY;
  int n = 0;
  for (int i = 0; i < V; i++)
    if (x[i] >= floor && x[i] > -INFINITY) idx[n++] = i;
  if (top_k > 0 && top_k < n) {
    memcpy(a, idx, (size_t)n * sizeof(int32_t));
    const float cut = kth_largest(x, a, n, top_k);
    int kept = 0;
    for (int j = 0; j < n; j++)
      if (x[idx[j]] >= cut) idx[kept++] = idx[j];
    n = kept;
  }
  double total = 0.0;
  for (int j = 0; j < n; j++) {
    p[idx[j]] = expf(x[idx[j]] - m);
    total += p[idx[j]];
  }
  if (top_p < 1.0f) { /* probabilities normalised over what min-p and top-k left */
    for (int j = 0; j < n; j++) p[idx[j]] = (float)(p[idx[j]] / total);
    for (int j = 0; j < n; j++) keep[idx[j]] = 0;
    memcpy(a, idx, (size_t)n * sizeof(int32_t));
    keep_mass(p, a, n, (double)top_p, keep);
    int kept = 0;
    total = 0.0;
    for (int j = 0; j < n; j++)
      if (keep[idx[j]]) idx[kept++] = idx[j], total += p[idx[j]];
    n = kept;
  }
  if (n == 0) return -1; /* top_p 0: nothing left (the caller's checks refuse it) */
  const double r = (double)u * total;
  double cum = 0.0;
  for (int j = 0; j < n; j++) {
    cum += p[idx[j]];
    if (cum > r) return idx[j];
  }
  return idx[n - 1]; /* u * total rounded up to the sum itself */
}

/* logits [T, V] fp32; per row temperature, top_k (<= 0: off), top_p (1: off), min_p (0: off)
 * and a uniform number in [0, 1); out [T] int64: each sampled row's token. A row with
 * temperature <= 0 is greedy: out keeps what it holds (its argmax, written by the caller).
 * Returns 0, -1 where memory is short, -2 where a sampled row has no finite logit. */
int afd_sample_rows(const float *logits, int T, int V, const float *temperature,
                    const int32_t *top_k, const float *top_p, const float *min_p,
                    const float *uniform, int64_t *out) {
  int rc = 0;
#pragma omp parallel for schedule(dynamic, 1) if (T > 1)
  for (int t = 0; t < T; t++) {
    if (!(temperature[t] > 0.0f)) continue;
    float *x = (float *)malloc((size_t)V * 2 * sizeof(float));
    int32_t *idx = (int32_t *)malloc((size_t)V * 2 * sizeof(int32_t));
    uint8_t *keep = (uint8_t *)malloc((size_t)V);
    if (!x || !idx || !keep) {
#pragma omp atomic write
      rc = -1;
    } else {
      int64_t got = sample_row(logits + (size_t)t * V, V, temperature[t], top_k[t], top_p[t],
                               min_p[t], uniform[t], x, x + V, idx, idx + V, keep);
      if (got < 0) {
#pragma omp atomic write
        rc = -2;
      } else {
        out[t] = got;
      }
    }
    free(x), free(idx), free(keep);
  }
  return rc;
}
