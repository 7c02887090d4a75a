/* The two products of paged decode attention (attention.c) on CPUs with AVX-512 BF16, for a
 * head dimension D that is a multiple of 32: vdpbf16ps multiplies bf16 pairs exactly and adds
 * them in fp32, so neither K, V nor the probabilities are converted to fp32 first, and one
 * instruction does 32 of the products the AVX2 code does 8 at a time.
 *
 *   scores: s[j, l] = bf16(q_j . k_l) * scale, 16 positions at a time: each position's dot
 *           product in 16 lanes (pairs of D), then the 16 positions' lanes summed in one tree
 *           (sum16) whose order is fixed, whatever the batch or the length.
 *   values: o[j] = bf16(sum_l p[j, l] v_l), 32 columns at a time: positions l and l + 1 are
 *           one vdpbf16ps operand (their V rows interleaved column by column, their two bf16
 *           probabilities broadcast as one 32-bit pair), for up to 8 query heads at once.
 *
 * The results are the AVX2 code's steps with the same roundings (scores and probabilities
 * rounded to bf16, the output rounded once); only fp32 summation order differs, and, as in
 * gemm512.c, vdpbf16ps reads bf16 denormals as zero and flushes denormal sums. */
#include <stdint.h>

#include "attention512.h"
#include "bf16_512.h"

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

static inline AVX512BF16 __m512bh ld32(const uint16_t *p) {
  return (__m512bh)_mm512_loadu_si512((const void *)p);
}

/* Lanes [sum(a[0]), ..., sum(a[15])]: pairs of 32-bit lanes, then of 64-bit lanes, then of
 * 128-bit blocks, added in a fixed order. */
static inline AVX512BF16 __m512 sum16(const __m512 a[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; i++) /* per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3] */
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++) { /* per block: one partial sum of each of 4 vectors */
    __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  /* blocks (0 + 1) and (2 + 3) of two vectors side by side, then the same again */
  __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                           _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                           _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v, w, 0x88), _mm512_shuffle_f32x4(v, w, 0xdd));
}

/* How many 16-position groups ahead the K rows are fetched (rows sit in 16-position blocks
 * scattered over the pool, so the hardware prefetcher sees only short runs). */
/* K rows are fetched K_AHEAD 16-position groups ahead, V rows V_AHEAD positions ahead, into
 * L2: rows sit in 16-position blocks scattered over the pool, so the hardware prefetcher sees
 * only short runs, and fetching into L1 stalled on its few outstanding misses (Zen 4, 32
 * sequences of 400 positions: 0.74x the time with L2 and these distances; measured). */
#define K_AHEAD 2
#define V_AHEAD 32

AVX512BF16 void afd_attn512_scores(const uint16_t *q, const uint16_t *cache, const int64_t *row,
                                   int len, int g, int D, float scale, const uint16_t *zero,
                                   float *s) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const int C = D / 32;
  for (int l0 = 0; l0 < len; l0 += 16) {
    const int n = len - l0 < 16 ? len - l0 : 16;
    const uint16_t *kp[16];
    for (int i = 0; i < 16; i++) kp[i] = i < n ? cache + row[l0 + i] : zero;
    for (int i = 0; i < 16; i++) {
      int ahead = l0 + 16 * K_AHEAD + i;
      if (ahead < len)
        for (int d = 0; d < D; d += 32)
          _mm_prefetch((const char *)(cache + row[ahead] + d), _MM_HINT_T1);
    }
    for (int j = 0; j < g; j++) {
      const uint16_t *qj = q + (size_t)j * D;
      __m512 a[16];
      for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
      for (int c = 0; c < C; c++) {
        __m512bh qc = ld32(qj + 32 * c);
        for (int i = 0; i < 16; i++) a[i] = _mm512_dpbf16_ps(a[i], qc, ld32(kp[i] + 32 * c));
      }
      __m512 r = sum16(a);
      __m256 lo = _mm256_mul_ps(round8(_mm512_castps512_ps256(r)), vscale);
      __m256 hi = _mm256_mul_ps(round8(_mm512_extractf32x8_ps(r, 1)), vscale);
      float *sj = s + (size_t)j * len + l0;
      __m512 out = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
      _mm512_mask_storeu_ps(sj, (__mmask16)((1u << n) - 1), out);
    }
  }
}

/* Output columns 32c + 0..15 and 16..31 from the interleaved sums: lo holds, in 128-bit block
 * k, columns 8k..8k+3 and hi columns 8k+4..8k+7. */
static inline AVX512BF16 void store32(uint16_t *out, __m512 lo, __m512 hi) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512 a = _mm512_permutex2var_ps(lo, first, hi), b = _mm512_permutex2var_ps(lo, second, hi);
  store8(out, round8(_mm512_castps512_ps256(a)));
  store8(out + 8, round8(_mm512_extractf32x8_ps(a, 1)));
  store8(out + 16, round8(_mm512_castps512_ps256(b)));
  store8(out + 24, round8(_mm512_extractf32x8_ps(b, 1)));
}

/* H (1..8) query heads' outputs, columns 32c..32(c + CC) - 1 (CC: 1 or 2, H * CC <= 8), from
 * their bf16 probabilities pb (rows of L2 values, pairs of positions as 32-bit words); H and CC
 * constants where inlined. Two 32-column chunks in one pass read a D = 64 row whole, once, in
 * order: a pass per chunk read every other line of the rows, and its loads of V waited on L2
 * (perf, Zen 4, one sequence of 4096 positions). 8 heads in one pass read V once for all of
 * them where 4 read it twice (a K/V head with 8 query heads or more: MLA, Qwen3-30B-A3B,
 * gpt-oss). Each output sums the same products in the same order either way. */
static inline __attribute__((always_inline)) AVX512BF16 void values_chunks(
    const uint32_t *const pb[8], int len, int D, const uint16_t *cache, const int64_t *row,
    const uint16_t *zero, uint16_t *const out[8], int H, int c, int CC) {
  __m512 lo[8][2], hi[8][2];
  for (int j = 0; j < H; j++)
    for (int k = 0; k < CC; k++) lo[j][k] = hi[j][k] = _mm512_setzero_ps();
  for (int l = 0; l < len; l += 2) {
    const uint16_t *r0 = cache + row[l] + 32 * c;
    const uint16_t *r1 = l + 1 < len ? cache + row[l + 1] + 32 * c : zero;
    if (c == 0 && l + V_AHEAD < len) /* the first pass brings whole rows in; the rest hit L2 */
      for (int e = 0; e < D; e += 32) {
        _mm_prefetch((const char *)(cache + row[l + V_AHEAD] + e), _MM_HINT_T1);
        if (l + V_AHEAD + 1 < len)
          _mm_prefetch((const char *)(cache + row[l + V_AHEAD + 1] + e), _MM_HINT_T1);
      }
    __m512bh a[2], b[2];
    for (int k = 0; k < CC; k++) {
      __m512i v0 = _mm512_loadu_si512((const void *)(r0 + 32 * k));
      __m512i v1 = _mm512_loadu_si512((const void *)(r1 + 32 * k));
      a[k] = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
      b[k] = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
    }
    for (int j = 0; j < H; j++) {
      __m512bh w = (__m512bh)_mm512_set1_epi32((int)pb[j][l / 2]);
      for (int k = 0; k < CC; k++) {
        lo[j][k] = _mm512_dpbf16_ps(lo[j][k], a[k], w);
        hi[j][k] = _mm512_dpbf16_ps(hi[j][k], b[k], w);
      }
    }
  }
  for (int j = 0; j < H; j++)
    for (int k = 0; k < CC; k++) store32(out[j] + 32 * (c + k), lo[j][k], hi[j][k]);
}

static inline __attribute__((always_inline)) AVX512BF16 void values_heads(
    const uint32_t *const pb[8], int len, int D, const uint16_t *cache, const int64_t *row,
    const uint16_t *zero, uint16_t *const out[8], int H) {
  int c = 0;
  if (H <= 4)
    for (; c + 2 <= D / 32; c += 2) values_chunks(pb, len, D, cache, row, zero, out, H, c, 2);
  for (; c < D / 32; c++) values_chunks(pb, len, D, cache, row, zero, out, H, c, 1);
}

AVX512BF16 void afd_attn512_values(const float *p, int len, int g, int D, const uint16_t *cache,
                                   const int64_t *row, const uint16_t *zero, uint16_t *pb,
                                   uint16_t *out) {
  const int L2 = (len + 1) & ~1;
  for (int j = 0; j < g; j++) { /* p holds bf16 values already: their top halves, exactly */
    const uint32_t *pj = (const uint32_t *)(p + (size_t)j * len);
    uint16_t *bj = pb + (size_t)j * L2;
    for (int l = 0; l < len; l++) bj[l] = (uint16_t)(pj[l] >> 16);
    if (L2 > len) bj[len] = 0;
  }
  /* 8 heads a pass while 8 are left, then the rest (up to 4 a pass where fewer than 8) */
  for (int j0 = 0; j0 < g;) {
    const int H = g - j0 >= 8 ? 8 : g - j0 < 4 ? g - j0 : 4;
    const uint32_t *rows[8];
    uint16_t *outs[8];
    for (int j = 0; j < 8; j++) {
      rows[j] = (const uint32_t *)(pb + (size_t)(j0 + (j < H ? j : 0)) * L2);
      outs[j] = out + (size_t)(j0 + (j < H ? j : 0)) * D;
    }
    switch (H) {
      case 1: values_heads(rows, len, D, cache, row, zero, outs, 1); break;
      case 2: values_heads(rows, len, D, cache, row, zero, outs, 2); break;
      case 3: values_heads(rows, len, D, cache, row, zero, outs, 3); break;
      case 4: values_heads(rows, len, D, cache, row, zero, outs, 4); break;
      default: values_heads(rows, len, D, cache, row, zero, outs, 8); break;
    }
    j0 += H;
  }
}

AVX512 int afd_softmax512_exp_sum(float *s, int len, float m, float acc[8]) {
  const __m512 vm = _mm512_set1_ps(m);
  __m256 a = _mm256_loadu_ps(acc);
  int l = 0;
  for (; l + 16 <= len; l += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), vm));
    _mm512_storeu_ps(s + l, e);
    a = _mm256_add_ps(a, _mm512_castps512_ps256(e));
    a = _mm256_add_ps(a, _mm512_extractf32x8_ps(e, 1));
  }
  _mm256_storeu_ps(acc, a);
  return l;
}

AVX512 int afd_softmax512_normalize(float *s, int len, float sum) {
  const __m512 vs = _mm512_set1_ps(sum);
  int l = 0;
  for (; l + 16 <= len; l += 16)
    _mm512_storeu_ps(s + l, round16(_mm512_div_ps(_mm512_loadu_ps(s + l), vs)));
  return l;
}
