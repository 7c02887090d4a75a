/* The small per-layer ops of the attention side, one native call each where torch issues 6-12
 * tiny ops (at decode sizes each costs more in dispatch than in arithmetic, in every layer):
 *
 *   afd_bf16_rms_norm   y = w * bf16(x * rsqrt(mean(x^2) + eps)), stats in fp32 (afd/ops.py)
 *   afd_bf16_rope       neox RoPE over heads: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))
 *
 * Every step rounds where the torch code does, so RoPE is bit-identical to it; RMSNorm differs
 * only by the fp32 summation order of the squares (a last-bit difference of the statistic,
 * rarely visible after the bf16 rounding). Loaded with ctypes (afd/kernels/norm_rope.py).
 *
 * isa (bf16.h's ISA_*): ISA_AVX2 runs 8 lanes at a time; the AVX-512 paths (ISA_AVX512,
 * ISA_AMX) 16, with the same roundings and the squares summed in the same lanes in the same
 * order, so the two give the same bits (tests/unit/test_norm_rope.py). */
#include <math.h>
#include <omp.h>

#include "bf16.h"
#include "bf16_512.h"

/* Rows split between threads from this many values: a batch's norms, not one token's (at a
 * batch of 32 the serial norms left the other core idle for a visible part of a step). */
#define PARALLEL_FROM 16384

/* One row of the norm, 8 lanes at a time. The squares go into two accumulators (values 16s..16s
 * + 7 and 16s + 8..16s + 15), a last 8 values into the first; their lanes summed by hsum. */
static void norm_row(const uint16_t *row, const uint16_t *w, uint16_t *out, int D, float eps) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int k = 0;
  for (; k + 16 <= D; k += 16) {
    __m256 v0 = load_bf16(row + k), v1 = load_bf16(row + k + 8);
    s0 = _mm256_fmadd_ps(v0, v0, s0), s1 = _mm256_fmadd_ps(v1, v1, s1);
  }
  for (; k < D; k += 8) {
    __m256 v = load_bf16(row + k);
    s0 = _mm256_fmadd_ps(v, v, s0);
  }
  /* squares of bf16 values are exact in fp32, so the FMA adds no rounding of its own;
   * ATen's mean multiplies by 1/N */
  float r = 1.0f / sqrtf(hsum(_mm256_add_ps(s0, s1)) * (1.0f / (float)D) + eps);
  __m256 vr = _mm256_set1_ps(r);
  for (k = 0; k < D; k += 8) {
    __m256 n = round8(_mm256_mul_ps(load_bf16(row + k), vr));
    store8(out + k, round8(_mm256_mul_ps(load_bf16(w + k), n)));
  }
}

/* The same on 16 lanes: lanes 0-7 of the one accumulator are norm_row's s0, lanes 8-15 its s1
 * (a last 8 values zero-extended into the low half: + 0 * 0 leaves the high half as it is). */
static AVX512 void norm_row512(const uint16_t *row, const uint16_t *w, uint16_t *out, int D,
                               float eps) {
  __m512 s = _mm512_setzero_ps();
  int k = 0;
  for (; k + 16 <= D; k += 16) {
    __m512 v = load16_bf16(row + k);
    s = _mm512_fmadd_ps(v, v, s);
  }
  if (k < D) {
    __m512 v = _mm512_castps256_ps512(load_bf16(row + k));
    v = _mm512_insertf32x8(v, _mm256_setzero_ps(), 1);
    s = _mm512_fmadd_ps(v, v, s);
  }
  __m256 lo = _mm512_castps512_ps256(s), hi = _mm512_extractf32x8_ps(s, 1);
  float r = 1.0f / sqrtf(hsum(_mm256_add_ps(lo, hi)) * (1.0f / (float)D) + eps);
  __m512 vr = _mm512_set1_ps(r);
  for (k = 0; k + 16 <= D; k += 16) {
    __m512 n = round16(_mm512_mul_ps(load16_bf16(row + k), vr));
    store16(out + k, round16(_mm512_mul_ps(load16_bf16(w + k), n)));
  }
  if (k < D) {
    __m256 vr8 = _mm256_set1_ps(r);
    __m256 n = round8(_mm256_mul_ps(load_bf16(row + k), vr8));
    store8(out + k, round8(_mm256_mul_ps(load_bf16(w + k), n)));
  }
}

/* x viewed as [A, B, D] with strides (sa, sb, 1) in elements (a [T, heads, D] slice of a fused
 * projection, or plain rows with B = 1); y is contiguous [A, B, D]. D % 8 == 0. */
int afd_bf16_rms_norm(const uint16_t *x, long sa, long sb, const uint16_t *w, uint16_t *y, int A,
                      int B, int D, float eps, int threads, int isa) {
  if (D % 8 != 0 || D <= 0) return -1;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) \
    if (threads > 1 && (long)A * B * D >= PARALLEL_FROM)
  for (int a = 0; a < A; a++)
    for (int b = 0; b < B; b++) {
      const uint16_t *row = x + a * sa + b * sb;
      uint16_t *out = y + ((size_t)a * B + b) * D;
      if (isa != ISA_AVX2)
        norm_row512(row, w, out, D, eps);
      else
        norm_row(row, w, out, D, eps);
    }
  return 0;
}

/* One head's RoPE, values k0.. of each half 8 at a time: first half x*cos - x[half:]*sin,
 * second x*cos + x[:half]*sin, each product and the sum rounded to bf16 as torch's ops do. */
static void rope_head(const uint16_t *row, const uint16_t *c, const uint16_t *s, uint16_t *out,
                      int half, int k0) {
  const __m256 neg = _mm256_set1_ps(-0.0f);
  for (int k = k0; k < half; k += 8) {
    __m256 lo = load_bf16(row + k), hi = load_bf16(row + half + k);
    __m256 a = round8(_mm256_mul_ps(lo, load_bf16(c + k)));
    __m256 b = round8(_mm256_mul_ps(_mm256_xor_ps(hi, neg), load_bf16(s + k)));
    __m256 a2 = round8(_mm256_mul_ps(hi, load_bf16(c + half + k)));
    __m256 b2 = round8(_mm256_mul_ps(lo, load_bf16(s + half + k)));
    store8(out + k, round8(_mm256_add_ps(a, b)));
    store8(out + half + k, round8(_mm256_add_ps(a2, b2)));
  }
}

/* The same 16 at a time (each value's steps are rope_head's); a last 8 of a half by it. */
static AVX512 void rope_head512(const uint16_t *row, const uint16_t *c, const uint16_t *s,
                                uint16_t *out, int half) {
  const __m512 neg = _mm512_set1_ps(-0.0f);
  int k = 0;
  for (; k + 16 <= half; k += 16) {
    __m512 lo = load16_bf16(row + k), hi = load16_bf16(row + half + k);
    __m512 a = round16(_mm512_mul_ps(lo, load16_bf16(c + k)));
    __m512 b = round16(_mm512_mul_ps(_mm512_xor_ps(hi, neg), load16_bf16(s + k)));
    __m512 a2 = round16(_mm512_mul_ps(hi, load16_bf16(c + half + k)));
    __m512 b2 = round16(_mm512_mul_ps(lo, load16_bf16(s + half + k)));
    store16(out + k, round16(_mm512_add_ps(a, b)));
    store16(out + half + k, round16(_mm512_add_ps(a2, b2)));
  }
  if (k < half) rope_head(row, c, s, out, half, k);
}

/* x viewed as [T, H, D] with strides (st, sh, 1); y as [T, H, D] with strides (yt, yh, 1) (y may
 * be x itself where the strides agree). cos, sin: bf16 tables [P, D] (the two halves of a row
 * equal); pos [T]. MLA rotates only the last dr values of each head (sh = the head's width) and
 * writes them into its absorbed query (yh = that query's head width). */
int afd_bf16_rope_heads(const uint16_t *x, long st, long sh, uint16_t *y, long yt, long yh, int T,
                        int H, int D, const uint16_t *cos, const uint16_t *sin, const int64_t *pos,
                        int threads, int isa) {
  if (D % 16 != 0 || D <= 0) return -1;
  const int half = D / 2;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) \
    if (threads > 1 && (long)T * H * D >= PARALLEL_FROM)
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++) {
      const uint16_t *c = cos + pos[t] * D, *s = sin + pos[t] * D;
      const uint16_t *row = x + t * st + h * sh;
      uint16_t *out = y + t * yt + h * yh;
      if (isa != ISA_AVX2)
        rope_head512(row, c, s, out, half);
      else
        rope_head(row, c, s, out, half, 0);
    }
  return 0;
}

/* x viewed as [T, H, D] with strides (st, D, 1); y contiguous [T, H, D] (may be x itself when
 * st == H * D). */
int afd_bf16_rope(const uint16_t *x, long st, uint16_t *y, int T, int H, int D, const uint16_t *cos,
                  const uint16_t *sin, const int64_t *pos, int threads, int isa) {
  return afd_bf16_rope_heads(x, st, D, y, (long)H * D, D, T, H, D, cos, sin, pos, threads, isa);
}

/* x rows [A, D] with row stride sa (elements); w, b [D]; y contiguous [A, D]:
 * y = bf16((x - mean) * rstd * w + b), rstd = 1 / sqrt(mean((x - mean)^2) + eps), all in fp32
 * over the bf16 values, as F.layer_norm computes a bf16 tensor (its sums in another order, so
 * a last-bit difference of the statistics). DSA's indexer key (indexer.py); a serial loop,
 * the same bits on every isa. Returns 0, or -1 for D < 1. */
int afd_bf16_layer_norm(const uint16_t *x, long sa, const uint16_t *w, const uint16_t *b,
                        uint16_t *y, int A, int D, float eps) {
  if (D < 1) return -1;
  for (int a = 0; a < A; a++) {
    const uint16_t *row = x + a * sa;
    uint16_t *out = y + (size_t)a * D;
    float sum = 0.0f, sq = 0.0f;
    for (int d = 0; d < D; d++) sum += bf16_value(row[d]);
    const float mean = sum / (float)D;
    for (int d = 0; d < D; d++) {
      float c = bf16_value(row[d]) - mean;
      sq += c * c;
    }
    const float rstd = 1.0f / sqrtf(sq / (float)D + eps);
    for (int d = 0; d < D; d++) {
      float v = (bf16_value(row[d]) - mean) * rstd;
      out[d] = to_bf16(v * bf16_value(w[d]) + bf16_value(b[d]));
    }
  }
  return 0;
}
