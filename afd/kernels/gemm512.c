/* y[M, N] = x[M, K] @ W[N, K]^T for bf16 x, W and y on CPUs with AVX-512 BF16 (AMD Zen 4 and
 * later, Intel Cooper Lake, Sapphire Rapids and later): vdpbf16ps multiplies 32 bf16 pairs and
 * adds them into 16 fp32 lanes in one instruction, so x needs no conversion to fp32 and a weight
 * vector holds 32 values instead of 8.
 *
 * The library is built for AVX2 (setup.py); only the functions here carry the AVX-512 target
 * (the attribute below), and afd/kernels/gemm.py calls them only where afd_cpu_avx512bf16()
 * says the CPU and the OS support them: one build, the instruction set chosen at run time.
 *
 * The weight stays row-major, as the checkpoint has it, so the same tensor also serves oneDNN's
 * matmul where afd/ops.py hands it the larger batches, and no second copy is kept. A few rows of
 * x (decode) read it one or two weight rows at a time, front to back: on AMD Zen 4 a thread
 * reading four rows side by side (four streams) got about 0.6x the bandwidth of one stream or of
 * a re-laid-out copy read in order (measured; on an Intel Xeon the four-row read had matched the
 * re-laid-out copy). More rows of x take four weight rows side by side: a quarter of the loads
 * of x per product.
 *
 * Each output is one dot product in 16 lanes (each lane sums pairs 32s + 2l, 32s + 2l + 1 over
 * s), then the same reduction of the lanes whatever the number of rows of x: a row's result is
 * the same bits alone or in a batch. Products of two bf16 values are exact in fp32, so results
 * differ from other fp32-accumulating matmuls only by summation order; vdpbf16ps treats bf16
 * denormals as zero and flushes denormal sums, irrelevant at the magnitudes a model produces. */
#include <cpuid.h>
#include <omp.h>
#include <stdlib.h>

#include "bf16.h"
#include "bf16_512.h"
#include "runs.h"

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* Whether this CPU and OS run AVX-512 F/BW/VL/DQ with the BF16 dot products. libgcc's check of
 * avx512f includes the OS saving the zmm state (XCR0); the BF16 bit is CPUID leaf 7.1 EAX[5]. */
int afd_cpu_avx512bf16(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
    return 0;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
  return (a >> 5) & 1;
}

static inline AVX512BF16 __m512bh ld32(const uint16_t *p) {
  return (__m512bh)_mm512_loadu_si512((const void *)p);
}

static inline AVX512BF16 __m512bh ld_tail(const uint16_t *p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)p);
}

/* R rows of x from row m (R <= 6, a constant where inlined, so the 4 R accumulators stay in
 * registers: 24 + 4 weights + 1 x of the 32 zmm) against weight rows n..n+3 (at w). */
static inline __attribute__((always_inline)) AVX512BF16 void group_rows(
    const uint16_t *x, const uint16_t *w, uint16_t *y, int R, int m, int N, int K, int n) {
  __m512 a[6][4];
  for (int i = 0; i < R; i++)
    for (int r = 0; r < 4; r++) a[i][r] = _mm512_setzero_ps();
  const int S = K / 32, tail = K % 32;
  const uint16_t *p0 = w, *p1 = w + K, *p2 = w + 2 * (size_t)K, *p3 = w + 3 * (size_t)K;
  const size_t ahead = 4 * (size_t)K;
  for (int s = 0; s < S; s++) {
    __m512bh w0 = ld32(p0 + 32 * s), w1 = ld32(p1 + 32 * s);
    __m512bh w2 = ld32(p2 + 32 * s), w3 = ld32(p3 + 32 * s);
    /* the same line of the next group's rows, into L2: by the time this group is done, the
     * next one is there (the hardware prefetcher does not run ahead across pages, and four
     * streams at once outrun it on weights from DRAM). Into L2 rather than L1: on Zen 4 the
     * experts at 8-16 rows of x took 0.7x the time of the L1 hint (measured). */
    _mm_prefetch((const char *)(p0 + 32 * s + ahead), _MM_HINT_T1);
    _mm_prefetch((const char *)(p1 + 32 * s + ahead), _MM_HINT_T1);
    _mm_prefetch((const char *)(p2 + 32 * s + ahead), _MM_HINT_T1);
    _mm_prefetch((const char *)(p3 + 32 * s + ahead), _MM_HINT_T1);
    for (int i = 0; i < R; i++) {
      __m512bh c = ld32(x + (size_t)(m + i) * K + 32 * s);
      a[i][0] = _mm512_dpbf16_ps(a[i][0], c, w0);
      a[i][1] = _mm512_dpbf16_ps(a[i][1], c, w1);
      a[i][2] = _mm512_dpbf16_ps(a[i][2], c, w2);
      a[i][3] = _mm512_dpbf16_ps(a[i][3], c, w3);
    }
  }
  if (tail) { /* the zeros a masked load puts past the row add nothing */
    const __mmask32 mk = (__mmask32)((1ull << tail) - 1);
    __m512bh w0 = ld_tail(p0 + 32 * S, mk), w1 = ld_tail(p1 + 32 * S, mk);
    __m512bh w2 = ld_tail(p2 + 32 * S, mk), w3 = ld_tail(p3 + 32 * S, mk);
    for (int i = 0; i < R; i++) {
      __m512bh c = ld_tail(x + (size_t)(m + i) * K + 32 * S, mk);
      a[i][0] = _mm512_dpbf16_ps(a[i][0], c, w0);
      a[i][1] = _mm512_dpbf16_ps(a[i][1], c, w1);
      a[i][2] = _mm512_dpbf16_ps(a[i][2], c, w2);
      a[i][3] = _mm512_dpbf16_ps(a[i][3], c, w3);
    }
  }
  for (int i = 0; i < R; i++) /* the row's four outputs rounded and stored at once */
    _mm_storel_epi64((__m128i *)(y + (size_t)(m + i) * N + n),
                     round4_bf16(sum4(a[i][0], a[i][1], a[i][2], a[i][3])));
}

/* Rows m0..m1 of x against the group at g, in chunks of at most 6 rows of about equal size. */
static AVX512BF16 void group_chunks(const uint16_t *x, const uint16_t *g, uint16_t *y, int m0,
                                    int m1, int N, int K, int n) {
  for (int m = m0; m < m1;) {
    int r = chunk_rows(m1 - m);
    switch (r) {
      case 1: group_rows(x, g, y, 1, m, N, K, n); break;
      case 2: group_rows(x, g, y, 2, m, N, K, n); break;
      case 3: group_rows(x, g, y, 3, m, N, K, n); break;
      case 4: group_rows(x, g, y, 4, m, N, K, n); break;
      case 5: group_rows(x, g, y, 5, m, N, K, n); break;
      default: group_rows(x, g, y, 6, m, N, K, n); break;
    }
    m += r;
  }
}

/* One row-major weight row n against rows m0..m1 of x. */
static AVX512BF16 void one_row(const uint16_t *x, const uint16_t *w, uint16_t *y, int m0, int m1,
                               int N, int K, int n) {
  const int S = K / 32, tail = K % 32;
  const __mmask32 mk = (__mmask32)((1ull << tail) - 1);
  for (int m = m0; m < m1; m++) {
    const uint16_t *xm = x + (size_t)m * K;
    __m512 a = _mm512_setzero_ps(), z = a;
    for (int s = 0; s < S; s++) a = _mm512_dpbf16_ps(a, ld32(xm + 32 * s), ld32(w + 32 * s));
    if (tail) a = _mm512_dpbf16_ps(a, ld_tail(xm + 32 * S, mk), ld_tail(w + 32 * S, mk));
    float s[4];
    _mm_storeu_ps(s, sum4(a, z, z, z));
    y[(size_t)m * N + n] = to_bf16(s[0]);
  }
}

/* How far ahead (bf16 weights, 8 KiB) stream_rows fetches: the rows after this one. */
#define STREAM_AHEAD 4096

/* R rows of x from row m (R <= 6, a constant where inlined) against one weight row n (at w),
 * read front to back: one stream of weights per thread (one row of x; from two, stream_pair
 * below reads two weight rows). Each output accumulates exactly as in group_rows (one
 * accumulator, the same steps, the same reduction), so the two give the same bits. */
static inline __attribute__((always_inline)) AVX512BF16 void stream_rows(
    const uint16_t *x, const uint16_t *w, uint16_t *y, int R, int m, int N, int K, int n) {
  __m512 a[6];
  for (int i = 0; i < R; i++) a[i] = _mm512_setzero_ps();
  const int S = K / 32, tail = K % 32;
  for (int s = 0; s < S; s++) {
    __m512bh v = ld32(w + 32 * s);
    /* From 2 rows of x the products slow the reads enough that the hardware prefetcher, which
     * stops at each 4 KiB page, leaves DRAM idle: fetch STREAM_AHEAD weights ahead into L2
     * (Zen 4, experts at 4 rows of x: 0.75x the time; at 2 rows 0.92x; at 1 row it cost a
     * little). */
    if (R >= 2) _mm_prefetch((const char *)(w + 32 * s + STREAM_AHEAD), _MM_HINT_T1);
    for (int i = 0; i < R; i++)
      a[i] = _mm512_dpbf16_ps(a[i], ld32(x + (size_t)(m + i) * K + 32 * s), v);
  }
  if (tail) {
    const __mmask32 mk = (__mmask32)((1ull << tail) - 1);
    __m512bh v = ld_tail(w + 32 * S, mk);
    for (int i = 0; i < R; i++)
      a[i] = _mm512_dpbf16_ps(a[i], ld_tail(x + (size_t)(m + i) * K + 32 * S, mk), v);
  }
  const __m512 z = _mm512_setzero_ps();
  for (int i = 0; i < R; i += 4) {
    float s[4];
    _mm_storeu_ps(s, sum4(a[i], i + 1 < R ? a[i + 1] : z, i + 2 < R ? a[i + 2] : z,
                          i + 3 < R ? a[i + 3] : z));
    for (int j = 0; j < 4 && i + j < R; j++) y[(size_t)(m + i + j) * N + n] = to_bf16(s[j]);
  }
}

/* R rows of x from row m (R <= 6, a constant where inlined) against weight rows n and n + 1
 * (at w, row-major: the second row starts where the first ends), both read front to back. A
 * weight row against R rows of x keeps R dot products in flight, and vdpbf16ps takes several
 * cycles to finish one, so a single row at 2-6 rows of x leaves the core waiting on its own
 * products while the next weights wait in L2; two rows keep 2 R in flight for the price of a
 * second stream. That pays where DRAM outruns the products (Zen 4 reading fast: batch 32's
 * experts a few percent faster) and costs a little where it does not (docs/benchmarks.md); at 1
 * row of x the second stream costs more than it gains, and the caller keeps stream_rows' single
 * stream there. Each output accumulates and is rounded exactly as in stream_rows: the same
 * bits. */
static inline __attribute__((always_inline)) AVX512BF16 void stream_pair(
    const uint16_t *x, const uint16_t *w, uint16_t *y, int R, int m, int N, int K, int n) {
  __m512 a[6], b[6];
  for (int i = 0; i < R; i++) a[i] = b[i] = _mm512_setzero_ps();
  const int S = K / 32, tail = K % 32;
  const uint16_t *u = w + K;
  for (int s = 0; s < S; s++) {
    __m512bh v0 = ld32(w + 32 * s), v1 = ld32(u + 32 * s);
    _mm_prefetch((const char *)(w + 32 * s + STREAM_AHEAD), _MM_HINT_T1); /* as stream_rows */
    _mm_prefetch((const char *)(u + 32 * s + STREAM_AHEAD), _MM_HINT_T1);
    for (int i = 0; i < R; i++) {
      __m512bh c = ld32(x + (size_t)(m + i) * K + 32 * s);
      a[i] = _mm512_dpbf16_ps(a[i], c, v0);
      b[i] = _mm512_dpbf16_ps(b[i], c, v1);
    }
  }
  if (tail) {
    const __mmask32 mk = (__mmask32)((1ull << tail) - 1);
    __m512bh v0 = ld_tail(w + 32 * S, mk), v1 = ld_tail(u + 32 * S, mk);
    for (int i = 0; i < R; i++) {
      __m512bh c = ld_tail(x + (size_t)(m + i) * K + 32 * S, mk);
      a[i] = _mm512_dpbf16_ps(a[i], c, v0);
      b[i] = _mm512_dpbf16_ps(b[i], c, v1);
    }
  }
  const __m512 z = _mm512_setzero_ps();
  for (int i = 0; i < R; i += 2) { /* two rows of x, two outputs each, reduced at once */
    float s[4];
    _mm_storeu_ps(s, sum4(a[i], b[i], i + 1 < R ? a[i + 1] : z, i + 1 < R ? b[i + 1] : z));
    for (int j = 0; j < 2 && i + j < R; j++) {
      y[(size_t)(m + i + j) * N + n] = to_bf16(s[2 * j]);
      y[(size_t)(m + i + j) * N + n + 1] = to_bf16(s[2 * j + 1]);
    }
  }
}

/* Rows m0..m1 of x (at most STREAM_MAX_M) against weight rows n0..n1, one weight row at a
 * time. */
static AVX512BF16 void stream_chunks(const uint16_t *x, const uint16_t *w, uint16_t *y, int m0,
                                     int m1, int N, int K, int n0, int n1) {
  for (int n = n0; n < n1; n++) {
    const uint16_t *wn = w + (size_t)n * K;
    for (int m = m0; m < m1;) {
      int r = m1 - m < 6 ? m1 - m : 6;
      switch (r) {
        case 1: stream_rows(x, wn, y, 1, m, N, K, n); break;
        case 2: stream_rows(x, wn, y, 2, m, N, K, n); break;
        case 3: stream_rows(x, wn, y, 3, m, N, K, n); break;
        case 4: stream_rows(x, wn, y, 4, m, N, K, n); break;
        case 5: stream_rows(x, wn, y, 5, m, N, K, n); break;
        default: stream_rows(x, wn, y, 6, m, N, K, n); break;
      }
      m += r;
    }
  }
}

/* stream_chunks two weight rows at a time (stream_pair), for 2 or more rows of x; an odd last
 * weight row alone. A function of its own so that the one-row path's code stays as it was
 * (with both in one loop GCC's code for one row of x read slower). */
static AVX512BF16 void pair_chunks(const uint16_t *x, const uint16_t *w, uint16_t *y, int m0,
                                   int m1, int N, int K, int n0, int n1) {
  int n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint16_t *wn = w + (size_t)n * K;
    for (int m = m0; m < m1;) {
      int r = m1 - m < 6 ? m1 - m : 6;
      switch (r) {
        case 1: stream_pair(x, wn, y, 1, m, N, K, n); break;
        case 2: stream_pair(x, wn, y, 2, m, N, K, n); break;
        case 3: stream_pair(x, wn, y, 3, m, N, K, n); break;
        case 4: stream_pair(x, wn, y, 4, m, N, K, n); break;
        case 5: stream_pair(x, wn, y, 5, m, N, K, n); break;
        default: stream_pair(x, wn, y, 6, m, N, K, n); break;
      }
      m += r;
    }
  }
  if (n < n1) stream_chunks(x, w, y, m0, m1, N, K, n, n1);
}

/* How many rows of x one pass over a thread's weight rows takes: a block of x (~128 KiB at
 * K = 1024) stays in L2 while the weights stream past it once per block. */
#define M_BLOCK 64

/* Rows n0..n1 of packed512 W (n0 a multiple of 4) against all M rows of x (bf16 [M, K]). */
AVX512BF16 void afd_rows512(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N,
                            int K, int n0, int n1) {
  if (M <= STREAM_MAX_M) { /* one row of x a weight row at a time, more two (stream_pair) */
    (M >= 2 ? pair_chunks : stream_chunks)(x, w, y, 0, M, N, K, n0, n1);
    return;
  }
  for (int mb = 0; mb < M; mb += M_BLOCK) {
    int me = mb + M_BLOCK < M ? mb + M_BLOCK : M;
    int n = n0;
    for (; n + 4 <= n1; n += 4) group_chunks(x, w + (size_t)n * K, y, mb, me, N, K, n);
    for (; n < n1; n++) one_row(x, w + (size_t)n * K, y, mb, me, N, K, n);
  }
}

/* Returns 0, or -1 for bad sizes. */
int afd_bf16_gemm512(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K,
                     int threads) {
  if (K % 2 != 0 || M <= 0 || N <= 0) return -1;
  int t = (size_t)N * K < ONE_THREAD_WEIGHTS ? 1 : threads; /* bf16.h */
  int units = (N + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT;
  /* each thread its run of units (runs.h): at most STREAM_MAX_M rows of x stream the weights,
   * and more rows fetch the next group as they multiply (group_rows), where a thread's run of
   * consecutive groups keeps that stream going (at 16-64 rows: the LM head 1.03-1.15x, the
   * attention's matmuls 1.02-1.05x the units in turn, Zen 4) */
  const int nr = t;
  uint64_t *runs = (uint64_t *)aligned_alloc(64, AFD_RUNS_WORDS(nr) * sizeof(uint64_t));
  if (!runs) return -1;
  afd_runs_init(runs, nr, units);
#pragma omp parallel num_threads(t) if (t > 1)
  {
    const int me = nr > 1 ? omp_get_thread_num() : 0;
    for (int u; (u = afd_runs_next(runs, nr, me)) >= 0;) {
      int n0 = u * ROWS_PER_UNIT, n1 = n0 + ROWS_PER_UNIT < N ? n0 + ROWS_PER_UNIT : N;
      afd_rows512(x, w, y, M, N, K, n0, n1);
    }
  }
  free(runs);
  return 0;
}
