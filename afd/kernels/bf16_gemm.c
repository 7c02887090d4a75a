/* y[M, N] = x[M, K] @ W[N, K]^T for bf16 x, W and y, accumulated in fp32: the decode matmul of
 * every projection and expert, for x86-64 CPUs with AVX2 and FMA but no bf16 arithmetic (e.g.
 * AMD Zen 2/3, Intel before Cooper Lake), where PyTorch's bf16 matmul falls back to a scalar path
 * that is 3-20x slower than fp32.
 *
 * Decode is weight-streaming bound: each weight row is read once and used against up to
 * M_BLOCK rows of x held in fp32, 4 weight rows at a time, so the inner loop is 4 converts
 * (bf16 -> fp32 is a 16-bit shift) and 4 * M_BLOCK FMAs per 8 columns. Rows of W are split
 * between threads. Products of two bf16 values are exact in fp32, so the result differs from
 * other fp32-accumulating kernels only by summation order (< 1 bf16 ulp, rarely).
 *
 * Loaded with ctypes (afd/kernels/gemm.py): no Python API, no torch headers. K must be a
 * multiple of 8 (every model dimension afd serves is); the caller checks.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define M_BLOCK 2 /* rows of x per pass: 4 x 2 accumulators + 4 weights + 2 x fit in 16 ymm */

static inline __m256 load_bf16(const uint16_t *p) {
  __m128i v = _mm_loadu_si128((const __m128i *)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

static inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

/* fp32 -> bf16 bits, round to nearest even (NaN stays NaN), as torch's .to(torch.bfloat16). */
static inline uint16_t to_bf16(float f) {
  union { float f; uint32_t u; } v = {f};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* Rows m0.. of x (fp32) against 4 weight rows already in fp32 (wt [4, K]), 3 rows of x at a
 * time: 12 accumulators + 4 weights in the 16 ymm registers, x read as FMA memory operands.
 * Returns the first row it did not do (fewer than 3 were left). */
static int wide(const float *xf, const float *wt, uint16_t *y, int M, int N, int K, int n) {
  const float *w0 = wt, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
  int m = 0;
  for (; m + 3 <= M; m += 3) {
    const float *x0 = xf + (size_t)m * K, *x1 = x0 + K, *x2 = x1 + K;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int k = 0; k < K; k += 8) {
      __m256 b0 = _mm256_loadu_ps(w0 + k), b1 = _mm256_loadu_ps(w1 + k);
      __m256 b2 = _mm256_loadu_ps(w2 + k), b3 = _mm256_loadu_ps(w3 + k);
      __m256 c = _mm256_loadu_ps(x0 + k);
      a00 = _mm256_fmadd_ps(c, b0, a00), a01 = _mm256_fmadd_ps(c, b1, a01);
      a02 = _mm256_fmadd_ps(c, b2, a02), a03 = _mm256_fmadd_ps(c, b3, a03);
      c = _mm256_loadu_ps(x1 + k);
      a10 = _mm256_fmadd_ps(c, b0, a10), a11 = _mm256_fmadd_ps(c, b1, a11);
      a12 = _mm256_fmadd_ps(c, b2, a12), a13 = _mm256_fmadd_ps(c, b3, a13);
      c = _mm256_loadu_ps(x2 + k);
      a20 = _mm256_fmadd_ps(c, b0, a20), a21 = _mm256_fmadd_ps(c, b1, a21);
      a22 = _mm256_fmadd_ps(c, b2, a22), a23 = _mm256_fmadd_ps(c, b3, a23);
    }
    uint16_t *y0 = y + (size_t)m * N + n, *y1 = y0 + N, *y2 = y1 + N;
    y0[0] = to_bf16(hsum(a00)), y0[1] = to_bf16(hsum(a01));
    y0[2] = to_bf16(hsum(a02)), y0[3] = to_bf16(hsum(a03));
    y1[0] = to_bf16(hsum(a10)), y1[1] = to_bf16(hsum(a11));
    y1[2] = to_bf16(hsum(a12)), y1[3] = to_bf16(hsum(a13));
    y2[0] = to_bf16(hsum(a20)), y2[1] = to_bf16(hsum(a21));
    y2[2] = to_bf16(hsum(a22)), y2[3] = to_bf16(hsum(a23));
  }
  return m;
}

/* Rows n0..n1 of W against all M rows of xf (fp32 [M, K]); y is bf16 [M, N]. wt is scratch
 * for 4 weight rows in fp32 (only used when M >= WIDE_M). */
#define WIDE_M 6 /* from here converting the rows once beats converting them per pair of x rows */
static void rows(const float *xf, const uint16_t *w, uint16_t *y, int M, int N, int K, int n0,
                 int n1, float *wt) {
  int n = n0;
  for (; n + 4 <= n1; n += 4) {
    const uint16_t *w0 = w + (size_t)n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    int m = 0;
    if (M >= WIDE_M) {
      for (int k = 0; k < 4 * K; k += 8) _mm256_storeu_ps(wt + k, load_bf16(w0 + k));
      m = wide(xf, wt, y, M, N, K, n);
    }
    /* 4 rows of x against 2 weight rows at a time: each weight row converted once per 4 rows
     * of x (8 accumulators), where the 2-row loop below converts it once per 2. */
    for (; m + 4 <= M && M < WIDE_M; m += 4) {
      const float *x0 = xf + (size_t)m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
      for (int h = 0; h < 4; h += 2) {
        const uint16_t *wa = w0 + (size_t)h * K, *wb = wa + K;
        __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        for (int k = 0; k < K; k += 8) {
          __m256 va = load_bf16(wa + k), vb = load_bf16(wb + k), c;
          c = _mm256_loadu_ps(x0 + k), a0 = _mm256_fmadd_ps(c, va, a0), b0 = _mm256_fmadd_ps(c, vb, b0);
          c = _mm256_loadu_ps(x1 + k), a1 = _mm256_fmadd_ps(c, va, a1), b1 = _mm256_fmadd_ps(c, vb, b1);
          c = _mm256_loadu_ps(x2 + k), a2 = _mm256_fmadd_ps(c, va, a2), b2 = _mm256_fmadd_ps(c, vb, b2);
          c = _mm256_loadu_ps(x3 + k), a3 = _mm256_fmadd_ps(c, va, a3), b3 = _mm256_fmadd_ps(c, vb, b3);
        }
        uint16_t *y0 = y + (size_t)m * N + n + h;
        y0[0] = to_bf16(hsum(a0)), y0[1] = to_bf16(hsum(b0));
        y0[N] = to_bf16(hsum(a1)), y0[N + 1] = to_bf16(hsum(b1));
        y0[2 * N] = to_bf16(hsum(a2)), y0[2 * N + 1] = to_bf16(hsum(b2));
        y0[3 * N] = to_bf16(hsum(a3)), y0[3 * N + 1] = to_bf16(hsum(b3));
      }
    }
    for (; m + 2 <= M; m += 2) {
      const float *x0 = xf + (size_t)m * K, *x1 = x0 + K;
      __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
      __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
      for (int k = 0; k < K; k += 8) {
        __m256 b0 = load_bf16(w0 + k), b1 = load_bf16(w1 + k);
        __m256 b2 = load_bf16(w2 + k), b3 = load_bf16(w3 + k);
        __m256 c0 = _mm256_loadu_ps(x0 + k), c1 = _mm256_loadu_ps(x1 + k);
        a00 = _mm256_fmadd_ps(c0, b0, a00);
        a01 = _mm256_fmadd_ps(c0, b1, a01);
        a02 = _mm256_fmadd_ps(c0, b2, a02);
        a03 = _mm256_fmadd_ps(c0, b3, a03);
        a10 = _mm256_fmadd_ps(c1, b0, a10);
        a11 = _mm256_fmadd_ps(c1, b1, a11);
        a12 = _mm256_fmadd_ps(c1, b2, a12);
        a13 = _mm256_fmadd_ps(c1, b3, a13);
      }
      uint16_t *y0 = y + (size_t)m * N + n, *y1 = y0 + N;
      y0[0] = to_bf16(hsum(a00)), y0[1] = to_bf16(hsum(a01));
      y0[2] = to_bf16(hsum(a02)), y0[3] = to_bf16(hsum(a03));
      y1[0] = to_bf16(hsum(a10)), y1[1] = to_bf16(hsum(a11));
      y1[2] = to_bf16(hsum(a12)), y1[3] = to_bf16(hsum(a13));
    }
    for (; m < M; m++) {
      const float *x0 = xf + (size_t)m * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int k = 0; k < K; k += 8) {
        __m256 c0 = _mm256_loadu_ps(x0 + k);
        a0 = _mm256_fmadd_ps(c0, load_bf16(w0 + k), a0);
        a1 = _mm256_fmadd_ps(c0, load_bf16(w1 + k), a1);
        a2 = _mm256_fmadd_ps(c0, load_bf16(w2 + k), a2);
        a3 = _mm256_fmadd_ps(c0, load_bf16(w3 + k), a3);
      }
      uint16_t *y0 = y + (size_t)m * N + n;
      y0[0] = to_bf16(hsum(a0)), y0[1] = to_bf16(hsum(a1));
      y0[2] = to_bf16(hsum(a2)), y0[3] = to_bf16(hsum(a3));
    }
  }
  for (; n < n1; n++) {
    const uint16_t *w0 = w + (size_t)n * K;
    for (int m = 0; m < M; m++) {
      const float *x0 = xf + (size_t)m * K;
      __m256 a0 = _mm256_setzero_ps();
      for (int k = 0; k < K; k += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), load_bf16(w0 + k), a0);
      y[(size_t)m * N + n] = to_bf16(hsum(a0));
    }
  }
}

/* Returns 0, or -1 when K is not a multiple of 8 or scratch memory is short. */
int afd_bf16_gemm(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K,
                  int threads) {
  if (K % 8 != 0 || M <= 0 || N <= 0) return -1;
  float *xf = (float *)aligned_alloc(64, ((size_t)M * K * sizeof(float) + 63) / 64 * 64);
  if (!xf) return -1;
  for (size_t i = 0; i < (size_t)M * K; i += 8) /* x to fp32 once: it is reused N times */
    _mm256_storeu_ps(xf + i, load_bf16(x + i));
  /* Below ~256 KiB of weight a second thread costs more to wake than it saves. */
  int t = (size_t)N * K < (1u << 17) ? 1 : threads;
  int chunk = (N + 4 * t - 1) / (4 * t) * 4; /* whole 4-row groups per thread */
  size_t tile = M >= WIDE_M ? (size_t)4 * K * sizeof(float) : 64;
  float *wt = (float *)aligned_alloc(64, (tile + 63) / 64 * 64 * t);
  if (!wt) {
    free(xf);
    return -1;
  }
#pragma omp parallel for num_threads(t) schedule(static) if (t > 1)
  for (int i = 0; i < t; i++) {
    int n0 = i * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    if (n0 < n1) rows(xf, w, y, M, N, K, n0, n1, wt + (tile + 63) / 64 * 16 * i);
  }
  free(wt);
  free(xf);
  return 0;
}

/* ---------------------------------------------------------------- routed experts, fused
 *
 * One call per layer for every routed expert a shard holds, instead of ~6 torch ops per expert:
 * for each expert e with n tokens (pairs sorted by expert),
 *   gate|up = x[tokens] @ w13[e]^T      (bf16, as F.linear)
 *   a       = bf16(bf16(silu(gate)) * up) (as F.silu then *, each rounded to bf16)
 *   y       = a @ w2[e]^T                 (bf16)
 *   ys      = bf16(y * weight)            (the pair's routing weight, a bf16 value)
 * then out[token] += ys in pair order, summed in fp32 and rounded once, as index_add_ does: every
 * rounding step
 * of the torch path in services/ffn/experts.py, so the two agree (bar a rare last-bit
 * difference of expf inside silu). Experts are spread over threads; the sum is serial. */

#include <math.h>

static inline float bf16_round(float f) {
  union { uint32_t u; float f; } v = {(uint32_t)to_bf16(f) << 16};
  return v.f;
}

static inline float bf16_value(uint16_t b) {
  union { uint32_t u; float f; } v = {(uint32_t)b << 16};
  return v.f;
}

/* x [T, H], tokens [P] (int64), weights [P] (fp32 holding bf16 values), starts [E + 1] (pair
 * offsets per local expert), w13 [E] -> [2I, H], w2 [E] -> [H, I], ys scratch [P, H],
 * out [T, H] accumulated into. All bf16 except as noted. Returns 0, or -1 when H or I is not a
 * multiple of 8 or memory is short. */
int afd_bf16_moe(const uint16_t *x, const int64_t *tokens, const float *weights,
                 const int32_t *starts, const uint16_t *const *w13, const uint16_t *const *w2,
                 uint16_t *ys, uint16_t *out, int T, int E, int H, int I, int threads) {
  if (H % 8 != 0 || I % 8 != 0 || E <= 0) return -1;
  int failed = 0;
  int t = threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(t) schedule(dynamic, 1) if (t > 1)
  for (int e = 0; e < E; e++) {
    int p0 = starts[e], n = starts[e + 1] - p0;
    if (n <= 0) continue;
    float *xs = (float *)malloc((size_t)n * H * sizeof(float));
    uint16_t *gu = (uint16_t *)malloc((size_t)n * 2 * I * sizeof(uint16_t));
    float *act = (float *)malloc((size_t)n * I * sizeof(float));
    float *wt = (float *)malloc((size_t)4 * (H > I ? H : I) * sizeof(float));
    if (!xs || !gu || !act || !wt) {
      failed = 1;
    } else {
      for (int i = 0; i < n; i++) {
        const uint16_t *src = x + (size_t)tokens[p0 + i] * H;
        for (int k = 0; k < H; k += 8) _mm256_storeu_ps(xs + (size_t)i * H + k, load_bf16(src + k));
      }
      rows(xs, w13[e], gu, n, 2 * I, H, 0, 2 * I, wt);
      for (int i = 0; i < n; i++)
        for (int j = 0; j < I; j++) {
          float g = bf16_value(gu[(size_t)i * 2 * I + j]);
          float u = bf16_value(gu[(size_t)i * 2 * I + I + j]);
          float s = bf16_round(g / (1.0f + expf(-g)));
          act[(size_t)i * I + j] = bf16_round(s * u);
        }
      uint16_t *y = ys + (size_t)p0 * H;
      rows(act, w2[e], y, n, H, I, 0, H, wt);
      for (int i = 0; i < n; i++) {
        float wgt = weights[p0 + i];
        for (int k = 0; k < H; k++) y[(size_t)i * H + k] = to_bf16(bf16_value(y[(size_t)i * H + k]) * wgt);
      }
    }
    free(xs);
    free(gu);
    free(act);
    free(wt);
  }
  if (failed) return -1;
  /* index_add_ on bf16 sums in fp32 and rounds once: the same, pair by pair in order. */
  int P = starts[E];
  float *acc = (float *)malloc((size_t)T * H * sizeof(float));
  if (!acc) return -1;
  for (size_t i = 0; i < (size_t)T * H; i++) acc[i] = bf16_value(out[i]);
  for (int p = 0; p < P; p++) {
    float *o = acc + (size_t)tokens[p] * H;
    const uint16_t *src = ys + (size_t)p * H;
    for (int k = 0; k < H; k++) o[k] += bf16_value(src[k]);
  }
  for (size_t i = 0; i < (size_t)T * H; i++) out[i] = to_bf16(acc[i]);
  free(acc);
  return 0;
}

/* ---------------------------------------------------------------- paged decode attention
 *
 * One query token per sequence against its K/V blocks in the paged cache, read in place (no
 * gather of the blocks into a contiguous copy, no fp32 copies of K and V): for each sequence b,
 * K/V head h and the g query heads sharing it,
 *   s_l = bf16(q . k_l) * scale           (the bf16 scores of a bf16 bmm, then fp32)
 *   p_l = bf16(softmax(s)_l)              (fp32 softmax over the sequence's len_b positions)
 *   o   = bf16(sum_l p_l v_l)
 * the steps of services/attention/attention.py's torch path; results differ from it only by
 * fp32 summation order and expf's last bit (< 1 bf16 ulp, rarely). (b, h) pairs are spread
 * over threads. */

/* q [B, kvh * g, D], k/v cache [kvh, NB, bs, D], blocks [B, nb] int64, lens [B] int64,
 * out [B, kvh * g, D]; all bf16 but the indices. Returns 0, or -1 when D is not a multiple of
 * 8, a length exceeds the block table, or memory is short. */
int afd_bf16_decode_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *blocks, const int64_t *lens, uint16_t *out, int B,
                              int kvh, int g, int D, int NB, int bs, int nb, float scale,
                              int threads) {
  if (D % 8 != 0 || B <= 0) return -1;
  for (int b = 0; b < B; b++)
    if (lens[b] < 1 || lens[b] > (int64_t)nb * bs) return -1;
  int failed = 0, t = threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(t) schedule(dynamic, 1) if (t > 1)
  for (int task = 0; task < B * kvh; task++) {
    int b = task / kvh, h = task % kvh, len = (int)lens[b];
    float *qf = (float *)malloc((size_t)g * D * sizeof(float));
    float *s = (float *)malloc((size_t)g * len * sizeof(float));
    float *acc = (float *)malloc((size_t)D * sizeof(float));
    if (!qf || !s || !acc) {
      failed = 1;
    } else {
      const uint16_t *qb = q + ((size_t)b * kvh * g + (size_t)h * g) * D;
      for (int i = 0; i < g * D; i += 8) _mm256_storeu_ps(qf + i, load_bf16(qb + i));
      for (int l = 0; l < len; l++) {
        int64_t blk = blocks[(size_t)b * nb + l / bs];
        const uint16_t *kp = k_cache + (((size_t)h * NB + blk) * bs + l % bs) * D;
        for (int j = 0; j < g; j++) {
          __m256 a = _mm256_setzero_ps();
          for (int d = 0; d < D; d += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (size_t)j * D + d), load_bf16(kp + d), a);
          s[(size_t)j * len + l] = bf16_round(hsum(a)) * scale;
        }
      }
      for (int j = 0; j < g; j++) {
        float *sj = s + (size_t)j * len, m = sj[0], sum = 0.0f;
        for (int l = 1; l < len; l++) m = sj[l] > m ? sj[l] : m;
        for (int l = 0; l < len; l++) sum += (sj[l] = expf(sj[l] - m));
        for (int l = 0; l < len; l++) sj[l] = bf16_round(sj[l] / sum);
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        for (int l = 0; l < len; l++) {
          int64_t blk = blocks[(size_t)b * nb + l / bs];
          const uint16_t *vp = v_cache + (((size_t)h * NB + blk) * bs + l % bs) * D;
          __m256 p = _mm256_set1_ps(sj[l]);
          for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(p, load_bf16(vp + d), _mm256_loadu_ps(acc + d)));
        }
        uint16_t *ob = out + ((size_t)b * kvh * g + (size_t)h * g + j) * D;
        for (int d = 0; d < D; d++) ob[d] = to_bf16(acc[d]);
      }
    }
    free(qf);
    free(s);
    free(acc);
  }
  return failed ? -1 : 0;
}
