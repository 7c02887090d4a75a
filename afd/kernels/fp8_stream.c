/* A block-FP8 weight's rows against a few rows of x (decode: at most STREAM_MAX_M on the AVX-512
 * BF16 path, 2 on the AVX2 one), codes converted in registers and multiplied there.
 *
 * At a few rows of x a matmul reads each weight once, so decode is a stream of weight bytes:
 * FP8 is half of bf16's. fp8_gemm.c's chunks (convert 32 rows into scratch, then the path's
 * matmul over it) write and read every weight a second time; here the codes go from memory to
 * vdpbf16ps without a store between. (The AMX path keeps the chunks: its tiles' sums are
 * another order than these, and an FP8 weight gives the dense weight's bits on every path.)
 *
 * The arithmetic is gemm512.c's stream_rows on the dense weight, step for step: each weight is
 * BlockFP8.dequantize's bf16(fp32(q) * s) (fp8_gemm.c's conversion), lane l of step t sums the
 * pairs 32 t + 2 l, 32 t + 2 l + 1, the lanes reduce in sum4's tree: the result is the
 * avx512bf16 path's matmul on the dense weight, bit for bit. With AVX-512 VBMI too, a block's
 * weights are looked up in a table of its scale's 128 magnitudes instead of converted one by
 * one (fp8_512.h), and rows that share their scales go more at a time (stream_rows_lut). */
#include <string.h>

#include "bf16.h"
#include "fp8_512.h"

/* How far ahead (codes, 4 KiB) the next rows' codes are fetched into L2: without it the
 * conversion waited on each line (one row of x, Intel Xeon: 3.1 GB/s a core, 7.5 with it). */
#define STREAM_AHEAD 4096
/* Weight rows side by side (stream_rows): 1, 2 and 4 read at the same rate, the conversion
 * being the bound, not the chain of products; 2 kept. */
#define FP8_W 2
#define FP8_WMAX 8 /* the most weight rows side by side (the table path's, at one row of x) */

/* K-block b's scale of weight rows n..n+W-1, times 2^120 in fp32 (as the torch path computes
 * it), into s120; whether every one of them takes afd_fp8_fast's rounding. */
static inline int block_scales(const float *s, int nk, int n, int W, int b, float *s120) {
  int fast = 1;
  for (int r = 0; r < W; r++) {
    const float sb = s[(size_t)(n + r) * nk + b];
    s120[r] = sb * 0x1p120f;
    fast &= afd_fp8_fast(sb);
  }
  return fast;
}

/* Steps k0..k1 (multiples of 32, in one K-block) of W weight rows (codes qr[r], block scales
 * vs[r]) against R rows of x from row m, into the accumulators a. */
static inline __attribute__((always_inline)) AFD_AVX512BF16 void block_steps(
    const uint16_t *x, const uint8_t *const *qr, const __m512 *vs, __m512 a[FP8_WMAX][6], int W,
    int R, int m, int K, int k0, int k1, int fast) {
  for (int k = k0; k < k1; k += 32) {
    __m512bh v[4];
    for (int r = 0; r < W; r++) {
      _mm_prefetch((const char *)(qr[r] + k + STREAM_AHEAD), _MM_HINT_T1);
      v[r] = afd_fp8_weights32(qr[r] + k, vs[r], fast);
    }
    for (int i = 0; i < R; i++) {
      __m512bh c = (__m512bh)_mm512_loadu_si512(x + (size_t)(m + i) * K + k);
      for (int r = 0; r < W; r++) a[r][i] = _mm512_dpbf16_ps(a[r][i], c, v[r]);
    }
  }
}

/* The W R accumulators' sums, reduced in sum4's tree, into y [M, N] at rows m.., columns n.. */
static inline __attribute__((always_inline)) AFD_AVX512BF16 void store_rows(
    __m512 a[FP8_WMAX][6], uint16_t *y, int W, int R, int m, int N, int n) {
  const __m512 z = _mm512_setzero_ps();
  for (int r = 0; r < W; r++)
    for (int i = 0; i < R; i += 4) {
      float t[4];
      _mm_storeu_ps(t, sum4(a[r][i], i + 1 < R ? a[r][i + 1] : z, i + 2 < R ? a[r][i + 2] : z,
                            i + 3 < R ? a[r][i + 3] : z));
      for (int j = 0; j < 4 && i + j < R; j++) y[(size_t)(m + i + j) * N + n + r] = to_bf16(t[j]);
    }
}

/* Weight rows n..n+W-1 (codes q, scales s, nk a row) against R rows of x from row m (W <= 4,
 * R <= 6, constants where inlined, so the W R accumulators stay in registers); K and the
 * K-block bk multiples of 32, so that no step of 32 crosses a block's edge. Each output is one
 * chain of vdpbf16ps (stream_rows' order), so the rows side by side are independent chains. */
static inline __attribute__((always_inline)) AFD_AVX512BF16 void stream_rows(
    const uint16_t *x, const uint8_t *q, const float *s, int nk, int bk, uint16_t *y, int W,
    int R, int m, int N, int K, int n) {
  __m512 a[FP8_WMAX][6];
  for (int r = 0; r < W; r++)
    for (int i = 0; i < R; i++) a[r][i] = _mm512_setzero_ps();
  const uint8_t *qr[4];
  for (int r = 0; r < W; r++) qr[r] = q + (size_t)(n + r) * K;
  for (int b = 0; b < nk; b++) {
    const int k0 = b * bk, k1 = k0 + bk < K ? k0 + bk : K;
    float s120[4];
    const int fast = block_scales(s, nk, n, W, b, s120);
    __m512 vs[4];
    for (int r = 0; r < W; r++) vs[r] = _mm512_set1_ps(s120[r]);
    if (fast)
      block_steps(x, qr, vs, a, W, R, m, K, k0, k1, 1);
    else
      block_steps(x, qr, vs, a, W, R, m, K, k0, k1, 0);
  }
  store_rows(a, y, W, R, m, N, n);
}

/* Steps k0..k1 of one K-block (multiples of 32) of W weight rows that share its scale (s120:
 * times 2^120) against R rows of x, into the accumulators a: with lut, the weights looked up in
 * the block's table tab (fp8_512.h, AVX-512 VBMI: a fast scale), 64 codes at a time; else
 * converted (afd_fp8_weights32, rounded as a slow scale needs). Each accumulator takes its
 * 32-wide steps in order, as block_steps gives them. */
static inline __attribute__((always_inline)) AFD_AVX512VBMI void shared_steps(
    const uint16_t *x, const uint8_t *const *qr, const uint8_t *tab, float s120,
    __m512 a[FP8_WMAX][6], int W, int R, int m, int K, int k0, int k1, int lut) {
  const __m512i order = afd_fp8_lut_order();
  __m512i t[4] = {order, order, order, order}; /* the table's four registers (lut only) */
  if (lut)
    for (int j = 0; j < 4; j++) t[j] = _mm512_loadu_si512(tab + 64 * j);
  const __m512 vs = _mm512_set1_ps(s120);
  const size_t ahead = (size_t)W * K; /* the next group of rows, at the same column */
  int k = k0;
  for (; k + 64 <= k1; k += 64)
    for (int r = 0; r < W; r++) {
      _mm_prefetch((const char *)(qr[r] + k + ahead), _MM_HINT_T1);
      __m512bh v[2];
      if (lut) {
        afd_fp8_lut64(_mm512_loadu_si512(qr[r] + k), order, t, v);
      } else {
        v[0] = afd_fp8_weights32(qr[r] + k, vs, 0);
        v[1] = afd_fp8_weights32(qr[r] + k + 32, vs, 0);
      }
      for (int i = 0; i < R; i++) {
        const uint16_t *xi = x + (size_t)(m + i) * K + k;
        a[r][i] = _mm512_dpbf16_ps(a[r][i], (__m512bh)_mm512_loadu_si512(xi), v[0]);
        a[r][i] = _mm512_dpbf16_ps(a[r][i], (__m512bh)_mm512_loadu_si512(xi + 32), v[1]);
      }
    }
  if (k < k1) /* a last 32 (bk % 64 == 32) */
    for (int r = 0; r < W; r++) {
      __m512bh v[2];
      if (lut)
        afd_fp8_lut64(_mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(qr[r] + k))),
                      order, t, v);
      else
        v[0] = afd_fp8_weights32(qr[r] + k, vs, 0);
      for (int i = 0; i < R; i++)
        a[r][i] = _mm512_dpbf16_ps(
            a[r][i], (__m512bh)_mm512_loadu_si512(x + (size_t)(m + i) * K + k), v[0]);
    }
}

/* Weight rows n..n+W-1 whose scales are the same (rows of one block of rows) against R rows of
 * x from row m, as stream_rows computes them: each fast K-block's table from the thread's cache
 * (fp8_512.h: afd_fp8_entry), so built once per block of rows. */
static inline __attribute__((always_inline)) AFD_AVX512VBMI void stream_rows_lut(
    const uint16_t *x, const uint8_t *q, const float *s, int nk, int bk, uint16_t *y, int W,
    int R, int m, int N, int K, int n, uint8_t *tables) {
  __m512 a[FP8_WMAX][6];
  for (int r = 0; r < W; r++)
    for (int i = 0; i < R; i++) a[r][i] = _mm512_setzero_ps();
  const uint8_t *qr[FP8_WMAX];
  for (int r = 0; r < W; r++) qr[r] = q + (size_t)(n + r) * K;
  for (int b = 0; b < nk; b++) {
    const int k0 = b * bk, k1 = k0 + bk < K ? k0 + bk : K;
    const float sb = s[(size_t)n * nk + b];
    if (afd_fp8_fast(sb))
      shared_steps(x, qr, afd_fp8_entry(tables, b, sb), sb * 0x1p120f, a, W, R, m, K, k0, k1, 1);
    else
      shared_steps(x, qr, NULL, sb * 0x1p120f, a, W, R, m, K, k0, k1, 0);
  }
  store_rows(a, y, W, R, m, N, n);
}

/* Whether weight rows n..n+W-1 have the same scales (nk a row). */
static inline int same_scales(const float *s, int nk, int n, int W) {
  for (int r = 1; r < W; r++)
    if (memcmp(s + (size_t)n * nk, s + (size_t)(n + r) * nk, (size_t)nk * sizeof(float)))
      return 0;
  return 1;
}

#define ROWS_OF_X(W)                                                                   \
  switch (M) {                                                                         \
    case 1: stream_rows(x, q, s, nk, bk, y, W, 1, 0, N, K, n); break;                  \
    case 2: stream_rows(x, q, s, nk, bk, y, W, 2, 0, N, K, n); break;                  \
    case 3: stream_rows(x, q, s, nk, bk, y, W, 3, 0, N, K, n); break;                  \
    case 4: stream_rows(x, q, s, nk, bk, y, W, 4, 0, N, K, n); break;                  \
    case 5: stream_rows(x, q, s, nk, bk, y, W, 5, 0, N, K, n); break;                  \
    default: stream_rows(x, q, s, nk, bk, y, W, 6, 0, N, K, n); break;                 \
  }

/* Row groups of W(R) rows sharing their scales (else one row at a time) against R rows of x:
 * at one row of x 8 rows side by side, 4 at two, 2 from three (the chains of products in
 * flight, since with the lookups the conversion no longer bounds them), at most 12
 * accumulators. */
#define LUT_W(R) ((R) == 1 ? 8 : (R) == 2 ? 4 : 2)
#define LUT_ROWS(R)                                                                  \
  for (; n < n1;) {                                                                  \
    const int W = n + LUT_W(R) <= n1 && same_scales(s, nk, n, LUT_W(R)) ? LUT_W(R) : 1; \
    if (W > 1)                                                                       \
      stream_rows_lut(x, q, s, nk, bk, y, LUT_W(R), R, 0, N, K, n, tables);          \
    else                                                                             \
      stream_rows_lut(x, q, s, nk, bk, y, 1, R, 0, N, K, n, tables);                 \
    n += W;                                                                          \
  }

/* afd_fp8_stream_rows on a CPU with AVX-512 VBMI, the thread's tables in `tables`. */
static AFD_AVX512VBMI void stream_rows_vbmi(const uint16_t *x, const uint8_t *q, const float *s,
                                            int bk, uint16_t *y, int M, int N, int K, int n0,
                                            int n1, uint8_t *tables) {
  const int nk = (K + bk - 1) / bk;
  int n = n0;
  switch (M) {
    case 1: LUT_ROWS(1) break;
    case 2: LUT_ROWS(2) break;
    case 3: LUT_ROWS(3) break;
    case 4: LUT_ROWS(4) break;
    case 5: LUT_ROWS(5) break;
    default: LUT_ROWS(6) break;
  }
}

int afd_cpu_vbmi(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi") ? 1 : 0;
}

/* Rows n0..n1 of the FP8 W (codes q [N, K], scales s [N, ceil(K / bk)]) against the M rows of
 * x (M <= STREAM_MAX_M), into y [M, N]. The caller checks the CPU has AVX-512 BF16; with
 * `tables` (a thread's cache, fp8_gemm.h; NULL: none, or no VBMI) fast blocks' weights are
 * looked up. */
AFD_AVX512BF16 void afd_fp8_stream_rows(const uint16_t *x, const uint8_t *q, const float *s,
                                        int bk, uint16_t *y, int M, int N, int K, int n0,
                                        int n1, uint8_t *tables) {
  if (tables) {
    stream_rows_vbmi(x, q, s, bk, y, M, N, K, n0, n1, tables);
    return;
  }
  const int nk = (K + bk - 1) / bk;
  int n = n0;
  for (; n + FP8_W <= n1; n += FP8_W) ROWS_OF_X(FP8_W)
  for (; n < n1; n++) ROWS_OF_X(1)
}

/* ---- the AVX2 path (x in fp32): gemm.c's arithmetic on the dense weight, one_row's order:
 * lane l of an output's 8 accumulates x[8 t + l] w[8 t + l] over t by FMA, the lanes summed in
 * hsum's tree (gemm.c's streaming loops give the same bits). Each weight is rounded to bf16 and
 * back in its lane: afd_fp8_round8_fast's two adds where the block's scale rules out NaN and
 * subnormal products (afd_fp8_fast), round8 otherwise. */

/* Steps k0..k1 (multiples of 8, in one K-block) of weight rows qr[0..W-1] (block scales vs)
 * against R rows of x into the accumulators a. fast (afd_fp8_fast for every row), W and R are
 * constants where inlined: with the rounding chosen per weight inside the loop, gcc kept the
 * scales on the stack and tested two flags per 8 weights. */
static inline __attribute__((always_inline)) void block_steps8(const float *xf,
                                                               const uint8_t *const *qr,
                                                               const __m256 *vs, __m256 a[4][2],
                                                               int W, int R, int K, int k0,
                                                               int k1, int fast) {
  for (int k = k0; k < k1; k += 8) {
    if (k % 64 == 0)
      for (int r = 0; r < W; r++)
        _mm_prefetch((const char *)(qr[r] + k + STREAM_AHEAD), _MM_HINT_T1);
    __m256 xk[2];
    for (int i = 0; i < R; i++) xk[i] = _mm256_loadu_ps(xf + (size_t)i * K + k);
    for (int r = 0; r < W; r++) {
      __m256 p = afd_fp8_products8(qr[r] + k, vs[r]);
      __m256 w = fast ? afd_fp8_round8_fast(p) : round8(p);
      for (int i = 0; i < R; i++) a[r][i] = _mm256_fmadd_ps(xk[i], w, a[r][i]);
    }
  }
}

/* Weight rows n..n+W-1 (W <= 4) against R rows of x (R <= 2; constants where inlined); K and
 * bk multiples of 8. */
static inline __attribute__((always_inline)) void stream_rows8(const float *xf, const uint8_t *q,
                                                               const float *s, int nk, int bk,
                                                               uint16_t *y, int W, int R, int N,
                                                               int K, int n) {
  __m256 a[4][2];
  for (int r = 0; r < W; r++)
    for (int i = 0; i < R; i++) a[r][i] = _mm256_setzero_ps();
  const uint8_t *qr[4];
  for (int r = 0; r < W; r++) qr[r] = q + (size_t)(n + r) * K;
  for (int b = 0; b < nk; b++) {
    const int k0 = b * bk, k1 = k0 + bk < K ? k0 + bk : K;
    float s120[4];
    __m256 vs[4];
    const int fast = block_scales(s, nk, n, W, b, s120);
    for (int r = 0; r < W; r++) vs[r] = _mm256_set1_ps(s120[r]);
    if (fast)
      block_steps8(xf, qr, vs, a, W, R, K, k0, k1, 1);
    else
      block_steps8(xf, qr, vs, a, W, R, K, k0, k1, 0);
  }
  for (int r = 0; r < W; r++)
    for (int i = 0; i < R; i++) y[(size_t)i * N + n + r] = to_bf16(hsum(a[r][i]));
}

/* Rows n0..n1 of the FP8 W against the M <= 2 rows of xf (fp32 [M, K]), into y [M, N]: 4
 * weight rows side by side at one row of x (0.85x the time of 2 on an Intel Xeon's AVX2 path,
 * its conversion the bound: more chains to overlap it with), 2 at two (4 would not fit the 16
 * registers). */
void afd_fp8_stream_rows_avx2(const float *xf, const uint8_t *q, const float *s, int bk,
                              uint16_t *y, int M, int N, int K, int n0, int n1) {
  const int nk = (K + bk - 1) / bk;
  int n = n0;
  if (M == 1) {
    for (; n + 4 <= n1; n += 4) stream_rows8(xf, q, s, nk, bk, y, 4, 1, N, K, n);
    for (; n < n1; n++) stream_rows8(xf, q, s, nk, bk, y, 1, 1, N, K, n);
    return;
  }
  for (; n + 2 <= n1; n += 2) stream_rows8(xf, q, s, nk, bk, y, 2, 2, N, K, n);
  for (; n < n1; n++) stream_rows8(xf, q, s, nk, bk, y, 1, 2, N, K, n);
}
