/* y[M, N] = x[M, K] @ W[N, K]^T for bf16 x, W and y, accumulated in fp32: the decode matmul of
 * every projection and expert, for x86-64 CPUs with AVX2 and FMA but no bf16 arithmetic (e.g.
 * AMD Zen 2/3, Intel before Cooper Lake), where PyTorch's bf16 matmul falls back to a scalar path
 * that is 3-20x slower than fp32.
 *
 * Two paths. With few rows of x (decode at small batch, most experts' tokens) the matmul is
 * weight-streaming bound: each weight row is read once, 4 rows at a time converted in registers
 * (bf16 -> fp32 is a 16-bit shift) and used against 2 or 4 rows of x. From WIDE_M rows on it is
 * compute-bound: 4 weight rows are converted once into fp32 and used against 3 rows of x at a
 * time. Rows of W are split between threads. Products of two bf16 values are exact in fp32, so
 * the result differs from other fp32-accumulating kernels only by summation order (< 1 bf16
 * ulp, rarely).
 *
 * moe.c and attention.c build on it; all three are one library, loaded with ctypes
 * (afd/kernels/gemm.py): no Python API, no torch headers. K must be a
 * multiple of 8 (every model dimension afd serves is); the caller checks.
 */
#include <omp.h>
#include <stdlib.h>

#include "bf16.h"

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
 * for 4 weight rows in fp32 (only used from WIDE_M rows of x on, where converting the rows once
 * beats converting them per pair of x rows). */
void afd_rows(const float *xf, const uint16_t *w, uint16_t *y, int M, int N, int K, int n0,
              int n1, float *wt) {
  int n = n0;
  for (; n + 4 <= n1; n += 4) {
    const uint16_t *w0 = w + (size_t)n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    int m = 0;
    if (M >= WIDE_M) {
      for (int k = 0; k < 4 * K; k += 8) {
        ahead(w0, k);
        _mm256_storeu_ps(wt + k, load_bf16(w0 + k));
      }
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
          ahead(wa, k);
          ahead(wb, k);
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
        ahead(w0, k);
        ahead(w1, k);
        ahead(w2, k);
        ahead(w3, k);
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
        ahead(w0, k);
        ahead(w1, k);
        ahead(w2, k);
        ahead(w3, k);
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
    if (n0 < n1) afd_rows(xf, w, y, M, N, K, n0, n1, wt + (tile + 63) / 64 * 16 * i);
  }
  free(wt);
  free(xf);
  return 0;
}
