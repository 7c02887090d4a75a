/* Paged decode attention (loaded with ctypes by afd/kernels/attention.py).
 *
 * One query token per sequence against its K/V blocks in the paged cache, read in place (no
 * gather of the blocks into a contiguous copy, no fp32 copies of K and V): for each sequence b,
 * K/V head h and the g query heads sharing it,
 *   s_l = bf16(q . k_l) * scale           (the bf16 scores of a bf16 bmm, then fp32)
 *   p_l = bf16(softmax(s)_l)              (fp32 softmax over the sequence's len_b positions)
 *   o   = bf16(sum_l p_l v_l)
 * the steps of services/attention/attention.py's torch path; results differ from it only by
 * fp32 summation order and exp's last bits (< 1 bf16 ulp, rarely). (b, h) pairs are spread
 * over threads.
 *
 * Each K row is converted to fp32 once for all g query heads (8 positions at a time, their 8
 * dot products reduced together), the softmax's max and exponentials are vectorised (a scalar
 * max is a chain of dependent compares, latency-bound, and at long contexts a large share of
 * an in-cache task), and each V row is read once per 16 output columns for 4 query heads at a
 * time, instead of one scalar-reduced dot product per (position, head). The max in lanes and
 * the prefetches (below) change no bits. Per-layer figures: docs/benchmarks.md. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attention512.h"
#include "attention_amx.h"
#include "bf16.h"
#include "softmax.h"

/* Rows sit in 16-position blocks scattered over the pool, so the hardware prefetcher sees
 * only short runs: ask for K rows two 8-position groups ahead. V is asked for later, in
 * weighted_sum: fetched here, beside K, a long sequence's V (256 KB at 2048 positions) had left
 * L2 again by the time the softmax was done. Both into L2: fetched into L1 they stalled on its
 * few outstanding misses where the block table is shuffled (Zen 4, AVX2 forced, 32 sequences of
 * 400 positions: 0.87x the time into L2, 0.82x at 2000; in the engine, whose fresh sequences'
 * blocks mostly follow each other, within the noise; measured). */
static inline void prefetch_k(const uint16_t *k_cache, const int64_t *row, int l0, int len,
                              int D) {
  for (int i = 0; i < 8; i++)
    for (int d = 0; d < D; d += 32)
      if (l0 + 16 + i < len) _mm_prefetch((const char *)(k_cache + row[l0 + 16 + i] + d), _MM_HINT_T1);
}

/* How far ahead weighted_sum asks for V rows (not a sensitive choice: nearby distances measured
 * alike). */
#define V_AHEAD 16

/* s[j, l] = bf16(q_j . k_l) * scale for l in 0..len-1; kt is scratch for 8 rows [8, D]. */
static void scores(const float *qf, const uint16_t *cache,
                   const int64_t *row, int len, int g, int D, float scale, float *s, float *kt) {
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int l0 = 0; l0 < len; l0 += 8) {
    int n = len - l0 < 8 ? len - l0 : 8;
    prefetch_k(cache, row, l0, len, D);
    for (int i = 0; i < 8; i++) {
      float *dst = kt + (size_t)i * D;
      if (i < n) {
        const uint16_t *src = cache + row[l0 + i];
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, load_bf16(src + d));
      } else {
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_setzero_ps());
      }
    }
    for (int j = 0; j < g; j++) {
      const float *qj = qf + (size_t)j * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int d = 0; d < D; d += 8) {
        __m256 c = _mm256_loadu_ps(qj + d);
        a0 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + d), a0);
        a1 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + D + d), a1);
        a2 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 3 * D + d), a3);
        a4 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 4 * D + d), a4);
        a5 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 5 * D + d), a5);
        a6 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 6 * D + d), a6);
        a7 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 7 * D + d), a7);
      }
      __m256 v = _mm256_mul_ps(round8(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7)), vscale);
      float *sj = s + (size_t)j * len + l0;
      if (n == 8) {
        _mm256_storeu_ps(sj, v);
      } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        for (int i = 0; i < n; i++) sj[i] = tmp[i];
      }
    }
  }
}

/* s[j, :len] <- bf16(softmax(s[j, :len])), in place; s rows are padded to a multiple of 8.
 * sink (or NULL): a logit per query head that joins each softmax's max and denominator and
 * takes no value (gpt-oss), as the torch path's extra column does. wide: softmax.h's. */
static void softmax_rows(float *s, int len, int g, const float *sink, int wide) {
  for (int j = 0; j < g; j++) {
    float *sj = s + (size_t)j * len, m = softmax_max(sj, len);
    if (sink) m = sink[j] > m ? sink[j] : m;
    float sum = softmax_exp_sum(sj, len, m, wide);
    if (sink) sum += softmax_exp1(sink[j] - m);
    softmax_normalize(sj, len, sum, wide);
  }
}

/* out[j] = bf16(sum_l p[j, l] v_l) for 4 query heads j0..j0+3 (rows of p past g read zeros),
 * 16 output columns at a time, then 8 when D % 16 == 8. */
static void weighted_sum(const float *p, const float *zeros, const uint16_t *cache,
                         const int64_t *row, int len, int g, int j0, int D, uint16_t *out) {
  const float *p0 = p + (size_t)j0 * len;
  const float *p1 = j0 + 1 < g ? p0 + len : zeros, *p2 = j0 + 2 < g ? p0 + 2 * (size_t)len : zeros;
  const float *p3 = j0 + 3 < g ? p0 + 3 * (size_t)len : zeros;
  int d = 0;
  for (; d + 16 <= D; d += 16) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    for (int l = 0; l < len; l++) {
      const uint16_t *vp = cache + row[l] + d;
      if (d == 0 && l + V_AHEAD < len) /* the first pass brings whole rows in; the rest hit L2 */
        for (int e = 0; e < D; e += 32) _mm_prefetch((const char *)(cache + row[l + V_AHEAD] + e), _MM_HINT_T1);
      __m256 v0 = load_bf16(vp), v1 = load_bf16(vp + 8), w;
      w = _mm256_broadcast_ss(p0 + l), a0 = _mm256_fmadd_ps(w, v0, a0), b0 = _mm256_fmadd_ps(w, v1, b0);
      w = _mm256_broadcast_ss(p1 + l), a1 = _mm256_fmadd_ps(w, v0, a1), b1 = _mm256_fmadd_ps(w, v1, b1);
      w = _mm256_broadcast_ss(p2 + l), a2 = _mm256_fmadd_ps(w, v0, a2), b2 = _mm256_fmadd_ps(w, v1, b2);
      w = _mm256_broadcast_ss(p3 + l), a3 = _mm256_fmadd_ps(w, v0, a3), b3 = _mm256_fmadd_ps(w, v1, b3);
    }
    __m256 acc[8] = {a0, b0, a1, b1, a2, b2, a3, b3};
    for (int j = 0; j < 4 && j0 + j < g; j++) {
      store8(out + (size_t)j * D + d, round8(acc[2 * j]));
      store8(out + (size_t)j * D + d + 8, round8(acc[2 * j + 1]));
    }
  }
  if (d < D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int l = 0; l < len; l++) {
      __m256 v0 = load_bf16(cache + row[l] + d);
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + l), v0, a0);
      a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(p1 + l), v0, a1);
      a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(p2 + l), v0, a2);
      a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(p3 + l), v0, a3);
    }
    __m256 acc[4] = {a0, a1, a2, a3};
    for (int j = 0; j < 4 && j0 + j < g; j++) store8(out + (size_t)j * D + d, round8(acc[j]));
  }
}

/* Rows of K (and twice as many of V) each decode task fetches before it computes */
#define PREFETCH_ROWS 16

/* q [B, kvh * g, D], k cache [kvh, NB, bs, D], blocks [B, nb] int64, lens [B] int64,
 * out [B, kvh * g, Dv]; all bf16 but the indices. v cache: rows of D values at K's offsets,
 * of which the first Dv <= D are V (Dv == D: a cache of its own; Dv < D: MLA, whose V is the
 * latent, K's leading columns, v_cache == k_cache). sinks: NULL or [kvh * g] float, a sink
 * logit per query head; window > 0: each row attends to its last `window` positions only.
 * isa: ISA_AVX2, or ISA_AVX512 / ISA_AMX for the AVX-512 BF16 products (attention512.c) where
 * D (scores) and Dv (values) are multiples of 32 (the AVX2 ones otherwise). Returns 0, or -1
 * when D or Dv is not a multiple of 8 or Dv > D, a length exceeds the block table, or memory
 * is short.
 *
 * A task is a sequence's K/V head and a group of its query heads: all g of them, unless the
 * batch has fewer (sequence, K/V head) pairs than threads (one sequence of an MLA or MFA model,
 * whose one K/V head would leave every thread but one idle), then groups of a multiple of 4
 * heads (the last may hold fewer), each task reading the head's K and V for its own group. A head's arithmetic is the same in
 * any group, so the bits do not depend on the batch or the threads. */
int afd_bf16_decode_attention_ext(const uint16_t *q, const uint16_t *k_cache,
                                  const uint16_t *v_cache, const int64_t *blocks,
                                  const int64_t *lens, uint16_t *out, int B, int kvh, int g, int D,
                                  int Dv, int NB, int bs, int nb, float scale, const float *sinks,
                                  int window, int threads, int isa) {
  if (D % 8 != 0 || Dv % 8 != 0 || Dv > D || Dv <= 0 || B <= 0 || g <= 0) return -1;
  const int wide_k = isa != ISA_AVX2 && D % 32 == 0, wide_v = isa != ISA_AVX2 && Dv % 32 == 0;
  for (int b = 0; b < B; b++)
    if (lens[b] < 1 || lens[b] > (int64_t)nb * bs) return -1;
  /* on AMX tiles from 8 query heads a K/V head: the query heads are the scores' tile columns
   * and the values' tile rows, so a position's products cost a fraction of vdpbf16ps' (MLA:
   * 16 to 128 heads), and the work splits by position too (attention_amx.h). Chosen by g, so
   * a head's arithmetic does not depend on the batch. */
  if (isa == ISA_AMX && g >= 8 && D % 32 == 0 && Dv % 32 == 0 && afd_cpu_amx())
    return afd_attn_amx_decode(q, k_cache, v_cache, blocks, lens, out, B, kvh, g, D, Dv, NB, bs,
                               nb, scale, sinks, window, threads);
  int failed = 0, t = threads > 1 ? threads : 1;
  const int gs = afd_attn_head_group(g, B * kvh, t), G = (g + gs - 1) / gs; /* heads a task */
#pragma omp parallel for num_threads(t) schedule(dynamic, 1) if (t > 1)
  for (int task = 0; task < B * kvh * G; task++) {
    int b = task / (kvh * G), h = task / G % kvh, j0 = task % G * gs, len = (int)lens[b];
    const int gj = g - j0 < gs ? g - j0 : gs; /* this task's query heads: j0 .. j0 + gj - 1 */
    int start = window > 0 && len > window ? len - window : 0; /* first visible position */
    len -= start;
    float *qf = (float *)afd_alloc64((size_t)gj * D * sizeof(float));
    float *s = (float *)afd_alloc64(((size_t)gj * len + 8) * sizeof(float));
    float *zeros = (float *)calloc((size_t)len, sizeof(float));
    float *kt = (float *)afd_alloc64((size_t)8 * D * sizeof(float));
    int64_t *row = (int64_t *)malloc((size_t)len * sizeof(int64_t));
    /* AVX-512: D zeros for the rows past len, and the probabilities as bf16 pairs */
    uint16_t *zrow = wide_k || wide_v ? (uint16_t *)calloc((size_t)D, sizeof(uint16_t)) : NULL;
    uint16_t *pb = wide_v ? (uint16_t *)afd_alloc64(((size_t)gj * (len + 1) + 2) * sizeof(uint16_t))
                          : NULL;
    if (!qf || !s || !zeros || !kt || !row || ((wide_k || wide_v) && !zrow) || (wide_v && !pb)) {
      failed = 1;
    } else {
      const uint16_t *qb = q + ((size_t)b * kvh * g + (size_t)h * g + j0) * D;
      for (int i = 0; i < gj * D; i += 8) _mm256_storeu_ps(qf + i, load_bf16(qb + i));
      /* element offset of position l's row for this head, the same in the K and V caches */
      for (int l = 0; l < len; l++) {
        int pos = start + l;
        row[l] = (((int64_t)h * NB + blocks[(size_t)b * nb + pos / bs]) * bs + pos % bs) * D;
      }
      /* The first rows of K (every line of a row) and of V, before the scores start: the
       * kernels fetch the rest ahead as they go, and V's first rows then arrive during the
       * scores instead of stalling the values (with the router's prefetch in decode_layer.c:
       * a batch-1 step 1.01x faster on Zen 4 at ~60 GB/s, measured). */
      for (int l = 0; l < 2 * PREFETCH_ROWS && l < len; l++)
        for (int o = 0; o < D * 2; o += 64) {
          if (l < PREFETCH_ROWS) _mm_prefetch((const char *)(k_cache + row[l]) + o, _MM_HINT_T0);
          if (o < Dv * 2) _mm_prefetch((const char *)(v_cache + row[l]) + o, _MM_HINT_T1);
        }
      if (wide_k)
        afd_attn512_scores(qb, k_cache, row, len, gj, D, scale, zrow, s);
      else
        scores(qf, k_cache, row, len, gj, D, scale, s, kt);
      softmax_rows(s, len, gj, sinks ? sinks + (size_t)h * g + j0 : NULL, isa != ISA_AVX2);
      /* the values read each row's first Dv values (row offsets are in units of D) */
      uint16_t *ob = out + ((size_t)b * kvh * g + (size_t)h * g + j0) * Dv;
      if (wide_v)
        afd_attn512_values(s, len, gj, Dv, v_cache, row, zrow, pb, ob);
      else
        for (int j = 0; j < gj; j += 4)
          weighted_sum(s, zeros, v_cache, row, len, gj, j, Dv, ob + (size_t)j * Dv);
    }
    free(qf), free(s), free(zeros), free(kt), free(row), free(zrow), free(pb);
  }
  return failed ? -1 : 0;
}

int afd_bf16_decode_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *blocks, const int64_t *lens, uint16_t *out, int B,
                              int kvh, int g, int D, int NB, int bs, int nb, float scale,
                              int threads) {
  return afd_bf16_decode_attention_ext(q, k_cache, v_cache, blocks, lens, out, B, kvh, g, D, D,
                                       NB, bs, nb, scale, NULL, 0, threads, ISA_AVX2);
}

/* The softmax of a prefill's scores, between the torch path's two bmms (services/attention/
 * paged_attention.py: _attend): s [kvh * g * n, L] bf16, the bf16 bmm's q . k of one sequence's
 * n new tokens (row (h * g + j) * n + i: K/V head h, its query head j, token i); token i sees
 * keys lo[i] .. hi[i] - 1. p (the same shape, bf16) <- bf16(softmax(scale * s)) over those keys
 * (softmax_rows: the decode kernel's steps), 0 elsewhere. Each row reads only its visible keys,
 * so its bits do not depend on how many masked ones the call holds (a prompt prefilled at once,
 * in chunks or after a cached prefix: the same rows). sinks: NULL or [kvh * g]. Replaces the
 * torch ops' scale, mask, softmax and bf16 copy, several passes over fp32 scores, with one.
 * isa: as the decode kernel's (the softmax's 16-lane passes on the AVX-512 paths, the same
 * bits). Returns 0, or -1 for a bad range or no memory. */
int afd_bf16_prefill_softmax(const uint16_t *s, int kvh, int g, int n, int L, const int32_t *lo,
                             const int32_t *hi, float scale, const float *sinks, uint16_t *p,
                             int threads, int isa) {
  for (int i = 0; i < n; i++)
    if (lo[i] < 0 || hi[i] <= lo[i] || hi[i] > L) return -1;
  int failed = 0, t = threads > 1 ? threads : 1;
  const int R = kvh * g * n;
#pragma omp parallel num_threads(t) if (t > 1)
  {
    float *x = (float *)afd_alloc64(((size_t)L + 8) * sizeof(float));
    if (!x) failed = 1;
#pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
      if (!x) continue;
      const int i = r % n, head = r / n, a = lo[i], len = hi[i] - lo[i];
      const uint16_t *sr = s + (size_t)r * L + a;
      uint16_t *pr = p + (size_t)r * L;
      const __m256 vscale = _mm256_set1_ps(scale);
      int l = 0;
      for (; l + 8 <= len; l += 8) _mm256_storeu_ps(x + l, _mm256_mul_ps(load_bf16(sr + l), vscale));
      for (; l < len; l++) x[l] = bf16_value(sr[l]) * scale;
      softmax_rows(x, len, 1, sinks ? sinks + head : NULL, isa != ISA_AVX2);
      memset(pr, 0, (size_t)a * sizeof(uint16_t));
      for (l = 0; l + 8 <= len; l += 8) store8(pr + a + l, _mm256_loadu_ps(x + l));
      for (; l < len; l++) pr[a + l] = to_bf16(x[l]);
      memset(pr + a + len, 0, (size_t)(L - a - len) * sizeof(uint16_t));
    }
    free(x);
  }
  return failed ? -1 : 0;
}
