/* y[M, N] = x[M, K] @ W[N, K]^T for bf16 x, W and y, accumulated in fp32: the decode matmul of
 * every projection and expert, for x86-64 CPUs with AVX2 and FMA but no bf16 arithmetic (e.g.
 * AMD Zen 2/3, Intel before Cooper Lake), where PyTorch's bf16 matmul falls back to a scalar path
 * far slower than fp32.
 *
 * Three paths. With 1-2 rows of x (decode at small batch) the matmul is weight-streaming
 * bound: each weight row is read once, 4 rows at a time converted in registers (bf16 -> fp32 is
 * a 16-bit shift, or a mask for the odd value of a pair: split_rows) and used against
 * every row of x. From PAIR_M rows (most experts' token
 * counts) 2 weight rows are converted at a time and used against chunks of up to 6 rows of x.
 * From WIDE_M rows on it is compute-bound: 4 weight rows are converted once into fp32 and used
 * against 3 rows of x at a time. Rows of W are split between threads. Products of two bf16
 * values are exact in fp32, so the result differs from other fp32-accumulating kernels only by
 * summation order (< 1 bf16 ulp, rarely).
 *
 * moe.c and decode_layer.c build on it; all the kernels of afd/kernels are one library, loaded
 * with ctypes (afd/kernels/gemm.py): no Python API, no torch headers. K must be a multiple of 8
 * (every model dimension afd serves is); the caller checks.
 */
#include <omp.h>
#include <stdlib.h>

#include "bf16.h"
#include "runs.h"

/* R rows of x from row m (R <= 3, a constant where inlined) against 4 weight rows already in
 * fp32 (wt [4, K]): 4 R accumulators, the R rows' x and one weight vector at a time (each used
 * by R FMAs), 16 ymm registers at R = 3. Holding all 4 weight vectors as well needed a 17th:
 * the compiler kept one accumulator on the stack, and its store-to-load round trip every
 * iteration held the loop to a third of the FMA rate. With pf (a group's first rows): the
 * next group's lines, one a step, into L2 while the products keep the core busy; without, its
 * conversion waited for DRAM (1.15-1.35x at 13-32 rows, Zen 4's AVX2 path, measured). */
static inline __attribute__((always_inline)) void tile_rows(const float *xf, const float *wt,
                                                            const uint16_t *pf, uint16_t *y,
                                                            int R, int m, int N, int K, int n) {
  __m256 a[3][4], c[3];
  for (int i = 0; i < R; i++)
    for (int r = 0; r < 4; r++) a[i][r] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 8) {
    if (pf) _mm_prefetch((const char *)(pf + 4 * k), _MM_HINT_T1);
    for (int i = 0; i < R; i++) c[i] = _mm256_loadu_ps(xf + (size_t)(m + i) * K + k);
    for (int r = 0; r < 4; r++) {
      __m256 b = _mm256_loadu_ps(wt + (size_t)r * K + k);
      for (int i = 0; i < R; i++) a[i][r] = _mm256_fmadd_ps(c[i], b, a[i][r]);
    }
  }
  for (int i = 0; i < R; i++) /* the row's four outputs rounded and stored at once */
    _mm_storel_epi64((__m128i *)(y + (size_t)(m + i) * N + n),
                     round4_bf16(hsum4(a[i][0], a[i][1], a[i][2], a[i][3])));
}

/* Every row of x against the 4 fp32 weight rows: 3 rows a pass, then the 2 or 1 left; each
 * row's sums are the same whichever pass takes it. The first pass fetches the group at next. */
static void wide(const float *xf, const float *wt, const uint16_t *next, uint16_t *y, int M,
                 int N, int K, int n) {
  int m = 0;
  for (; m + 3 <= M; m += 3) tile_rows(xf, wt, m ? NULL : next, y, 3, m, N, K, n);
  if (M - m == 2) tile_rows(xf, wt, m ? NULL : next, y, 2, m, N, K, n);
  if (M - m == 1) tile_rows(xf, wt, m ? NULL : next, y, 1, m, N, K, n);
}

/* R rows of x from row m (R <= 6, a constant where inlined: the accumulators stay in
 * registers) against 2 rows of a packed group, the first at wa (group + 8 r): each weight
 * vector converted once and used R times; pf: what the pass fetches ahead (afd_rows). 2 x 6
 * accumulators + 2 weights + 1 x: 15 of the 16 ymm registers. */
static inline __attribute__((always_inline)) void pair_rows(const float *xf, const uint16_t *wa,
                                                            const uint16_t *pf, uint16_t *y,
                                                            int R, int m, int N, int K, int n) {
  __m256 a[6], b[6];
  for (int i = 0; i < R; i++) a[i] = b[i] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 8) {
    __m256 va = load_bf16(wa + 4 * k), vb = load_bf16(wa + 4 * k + 8);
    /* The next group's half that this pass fetches (pf: afd_rows), a line every other step:
     * the group's two passes each take half of it, so the reads of DRAM go on through the
     * second pass too, which reads its own weights from L1 (a line 4 KiB ahead in the pass,
     * the hardware prefetcher's reach, left DRAM idle then: 1.1-1.5x at 3-12 rows of x from
     * DRAM on Zen 4's AVX2 path, measured; the L1 hint gained 1.0-1.05x). */
    _mm_prefetch((const char *)(pf + 2 * k), _MM_HINT_T1);
    for (int i = 0; i < R; i++) {
      __m256 c = _mm256_loadu_ps(xf + (size_t)(m + i) * K + k);
      a[i] = _mm256_fmadd_ps(c, va, a[i]);
      b[i] = _mm256_fmadd_ps(c, vb, b[i]);
    }
  }
  int i = 0;
  for (; i + 2 <= R; i += 2) { /* two rows' two outputs rounded at once */
    __m128i v = round4_bf16(hsum4(a[i], b[i], a[i + 1], b[i + 1]));
    _mm_storeu_si32(y + (size_t)(m + i) * N + n, v);
    _mm_storeu_si32(y + (size_t)(m + i + 1) * N + n, _mm_srli_si128(v, 4));
  }
  if (i < R) {
    uint16_t *yi = y + (size_t)(m + i) * N + n;
    yi[0] = to_bf16(hsum(a[i])), yi[1] = to_bf16(hsum(b[i]));
  }
}

/* All M rows of x against weight rows n, n+1, in chunks of at most 6 rows of about equal size
 * (7 -> 4 + 3): the small-M path of expert matmuls, whose token counts vary from 1 to ~10. */
static void pair_chunks(const float *xf, const uint16_t *wa, const uint16_t *pf, uint16_t *y,
                        int M, int N, int K, int n) {
  for (int m = 0; m < M;) {
    int r = chunk_rows(M - m);
    switch (r) {
      case 1: pair_rows(xf, wa, pf, y, 1, m, N, K, n); break;
      case 2: pair_rows(xf, wa, pf, y, 2, m, N, K, n); break;
      case 3: pair_rows(xf, wa, pf, y, 3, m, N, K, n); break;
      case 4: pair_rows(xf, wa, pf, y, 4, m, N, K, n); break;
      case 5: pair_rows(xf, wa, pf, y, 5, m, N, K, n); break;
      default: pair_rows(xf, wa, pf, y, 6, m, N, K, n); break;
    }
    m += r;
  }
}

/* Weight row n (its 8-value runs `step` apart: 32 inside a packed group, 8 row-major) against
 * every row of x. */
static void one_row(const float *xf, const uint16_t *w, int step, uint16_t *y, int M, int N,
                    int K, int n) {
  for (int m = 0; m < M; m++) {
    const float *x0 = xf + (size_t)m * K;
    const uint16_t *p = w;
    __m256 a0 = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8, p += step)
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), load_bf16(p), a0);
    y[(size_t)m * N + n] = to_bf16(hsum(a0));
  }
}

/* ---- 1 and 2 rows of x: the weight-streaming loops ------------------------------------------
 * Here the loop is nearly all conversion: bf16 -> fp32 by widening each 8 values (a shuffle and
 * a shift per 8) kept one core short of what a plain read of the weights gets. Instead 16 values
 * (8 of each of two rows of the group) are loaded as they lie and read as 8 fp32 lanes twice: the
 * even value of each pair shifted up (one shift), the odd one masked in place (an AND, which any
 * vector port takes). x meets them in a matching order, prepared once per call (split_x). Each
 * fp32 lane accumulates exactly the products that lane k % 8 of the widening loop accumulated,
 * in the same order, and the lanes are summed in hsum's tree (sum_split), so the results are
 * the same bits as before and as one_row's. */

/* xs [M, 2K]: per 8 values of a row of x, [x0 x2 x4 x6 x0 x2 x4 x6] then [x1 x3 x5 x7 ...]. */
static void split_x(const float *xf, float *xs, int M, int K) {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  const __m256i odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
  for (size_t i = 0; i < (size_t)M * K; i += 8) {
    __m256 v = _mm256_loadu_ps(xf + i);
    _mm256_storeu_ps(xs + 2 * i, _mm256_permutevar8x32_ps(v, even));
    _mm256_storeu_ps(xs + 2 * i + 8, _mm256_permutevar8x32_ps(v, odd));
  }
}

/* Two rows' sums from the even and odd accumulators (lanes 0..3: the first row's k % 8 =
 * 0, 2, 4, 6 resp. 1, 3, 5, 7; lanes 4..7 the second row's): hsum's tree over the 8 lanes in k
 * order, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), i.e. ((e0 + e2) + (e1 + e3)) +
 * ((o0 + o2) + (o1 + o3)). */
static inline void sum_split(__m256 e, __m256 o, uint16_t *y0, uint16_t *y1) {
  e = _mm256_add_ps(e, _mm256_permute_ps(e, 0x4E)); /* lanes (2, 3, 0, 1) */
  o = _mm256_add_ps(o, _mm256_permute_ps(o, 0x4E));
  e = _mm256_add_ps(e, _mm256_permute_ps(e, 0xB1)); /* lanes (1, 0, 3, 2) */
  o = _mm256_add_ps(o, _mm256_permute_ps(o, 0xB1));
  __m256 t = _mm256_add_ps(e, o);
  *y0 = to_bf16(_mm256_cvtss_f32(t));
  *y1 = to_bf16(_mm_cvtss_f32(_mm256_extractf128_ps(t, 1)));
}

/* How far ahead (bytes) the split loops ask for weights: the hardware prefetcher alone let a
 * core's stream fall short of a plain read loop's (docs/benchmarks.md). */
#define SPLIT_AHEAD 1024

/* R rows of x (R <= 2, a constant where inlined; xs: split_x's layout, 2K floats a row)
 * against the group at g: each weight vector used R times. */
static inline __attribute__((always_inline)) void split_rows(const float *xs, const uint16_t *g,
                                                             uint16_t *y, int R, int N, int K) {
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  __m256 e01[2], e23[2], o01[2], o23[2]; /* per row of x: even and odd lanes, rows 0-1 and 2-3 */
  for (int i = 0; i < R; i++) e01[i] = e23[i] = o01[i] = o23[i] = _mm256_setzero_ps();
  const uint16_t *p = g;
  for (int k = 0; k < K; k += 8, p += 32) {
    _mm_prefetch((const char *)p + SPLIT_AHEAD, _MM_HINT_T0);
    __m256i r01 = _mm256_loadu_si256((const __m256i *)p);
    __m256i r23 = _mm256_loadu_si256((const __m256i *)(p + 16));
    __m256 w01 = _mm256_castsi256_ps(_mm256_slli_epi32(r01, 16));
    __m256 w23 = _mm256_castsi256_ps(_mm256_slli_epi32(r23, 16));
    for (int i = 0; i < R; i++) {
      __m256 xe = _mm256_loadu_ps(xs + (size_t)i * 2 * K + 2 * k);
      e01[i] = _mm256_fmadd_ps(xe, w01, e01[i]), e23[i] = _mm256_fmadd_ps(xe, w23, e23[i]);
    }
    w01 = _mm256_castsi256_ps(_mm256_and_si256(r01, high));
    w23 = _mm256_castsi256_ps(_mm256_and_si256(r23, high));
    for (int i = 0; i < R; i++) {
      __m256 xo = _mm256_loadu_ps(xs + (size_t)i * 2 * K + 2 * k + 8);
      o01[i] = _mm256_fmadd_ps(xo, w01, o01[i]), o23[i] = _mm256_fmadd_ps(xo, w23, o23[i]);
    }
  }
  for (int i = 0; i < R; i++) {
    sum_split(e01[i], o01[i], y + (size_t)i * N, y + (size_t)i * N + 1);
    sum_split(e23[i], o23[i], y + (size_t)i * N + 2, y + (size_t)i * N + 3);
  }
}

/* Rows n0..n1 of packed W (n0 a multiple of 4) against all M rows of xf (fp32 [M, K]); y is
 * bf16 [M, N]. wt is scratch for 4 K floats: 4 weight rows in fp32 from WIDE_M rows of x on
 * (where converting the rows once beats converting them per pair of x rows), split_x's copy of
 * x below PAIR_M. */
void afd_rows(const float *xf, const uint16_t *w, uint16_t *y, int M, int N, int K, int n0,
              int n1, float *wt) {
  int n = n0;
  if (M < PAIR_M && n + 4 <= n1) split_x(xf, wt, M, K);
  for (; n + 4 <= n1; n += 4) {
    const uint16_t *g = w + (size_t)n * K; /* the group: row r's values 8s.. at 32 s + 8 r */
    if (M >= WIDE_M) {
      for (int k = 0; k < K; k += 8)
        for (int r = 0; r < 4; r++)
          _mm256_storeu_ps(wt + (size_t)r * K + k, load_bf16(g + 4 * k + 8 * r));
      wide(xf, wt, g + 4 * (size_t)K, y, M, N, K, n);
    } else if (M >= PAIR_M) { /* converted once per chunk of up to 6 rows of x */
      /* the next group, its first half fetched by the first pass and its second half by the
       * second (past a matrix's last group: lines of other memory, or none; a prefetch never
       * faults) */
      const uint16_t *next = g + 4 * (size_t)K;
      pair_chunks(xf, g, next, y, M, N, K, n);
      pair_chunks(xf, g + 16, next + 2 * (size_t)K, y, M, N, K, n + 2);
    } else { /* 1 or 2 rows: weight streaming (split_x's layout in wt) */
      if (M == 2)
        split_rows(wt, g, y + n, 2, N, K);
      else
        split_rows(wt, g, y + n, 1, N, K);
    }
  }
  const int packed_end = N / 4 * 4; /* rows from here on are row-major */
  for (; n < n1; n++) {
    if (n < packed_end)
      one_row(xf, w + (size_t)(n & ~3) * K + 8 * (n & 3), 32, y, M, N, K, n);
    else
      one_row(xf, w + (size_t)n * K, 8, y, M, N, K, n);
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
  int t = (size_t)N * K < ONE_THREAD_WEIGHTS ? 1 : threads; /* bf16.h */
  /* units of ROWS_PER_UNIT rows (whole 4-row groups), taken as threads come free (bf16.h) */
  int units = (N + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT;
  /* afd_rows' scratch: 4 weight rows in fp32, or split_x's 2 M rows */
  size_t tile = M >= WIDE_M || M < PAIR_M ? (size_t)4 * K * sizeof(float) : 64;
  float *wt = (float *)aligned_alloc(64, (tile + 63) / 64 * 64 * t);
  if (!wt) {
    free(xf);
    return -1;
  }
  /* each thread its run of units (runs.h): 1-2 rows of x stream the weights, and more rows
   * read them as they multiply (afd_rows' prefetches), where a thread's run of consecutive
   * groups keeps its stream going (at 32 rows 1.03x the units in turn, Zen 4's AVX2 path) */
  const int nr = t;
  uint64_t *runs = (uint64_t *)aligned_alloc(64, AFD_RUNS_WORDS(nr) * sizeof(uint64_t));
  if (!runs) {
    free(wt), free(xf);
    return -1;
  }
  afd_runs_init(runs, nr, units);
#pragma omp parallel num_threads(t) if (t > 1)
  {
    const int me = t > 1 ? omp_get_thread_num() : 0;
    float *mine = wt + (tile + 63) / 64 * 16 * me;
    for (int u; (u = afd_runs_next(runs, nr, nr > 1 ? me : 0)) >= 0;) {
      int n0 = u * ROWS_PER_UNIT, n1 = n0 + ROWS_PER_UNIT < N ? n0 + ROWS_PER_UNIT : N;
      afd_rows(xf, w, y, M, N, K, n0, n1, mine);
    }
  }
  free(runs);
  free(wt);
  free(xf);
  return 0;
}
