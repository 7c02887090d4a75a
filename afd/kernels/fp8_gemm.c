/* y[M, N] = x[M, K] @ W^T for a block-FP8 W (afd/blockfp8.py: e4m3fn codes q [N, K], a float32
 * scale per row and K-block of bk values, s [N, ceil(K / bk)]), on the matmul of a bf16 path.
 *
 * Each weight is taken as BlockFP8.dequantize takes it, bf16(fp32(q) * s) rounded once, so the
 * result is the dense bf16 weight's on the same path, bit for bit. The torch path dequantizes a
 * run of rows at a time with ~6 ops over float32 temporaries and then multiplies it; here each
 * thread converts CHUNK rows at a time into its own scratch, laid out as the path's matmul
 * reads a dense weight (gemm.c's packed groups, amx.c's tiles, row-major for gemm512.c), and
 * multiplies them while they are in cache (a few hundred KiB at DeepSeek's widths): the
 * weight is read from memory once, one byte a value, in one call. A row's sums do not depend
 * on which rows share its call, so the chunks give the dense call's bits.
 *
 * The conversion is fp8.c's: the code sign-extended, shifted left by 20 and masked reads as an
 * fp32 of its value times 2^-120 (subnormal codes as fp32 subnormals: no FTZ/DAZ anywhere),
 * times fp32(s * 2^120), then rounded to bf16 as torch rounds (round8/round16). */
#include <omp.h>
#include <stdlib.h>

#include "bf16.h"
#include "fp8_512.h"
#include "runs.h"

#define CHUNK AFD_FP8_CHUNK

static int vbmi(void) { /* afd_cpu_vbmi, asked once */
  static int known = -1;
  if (known < 0) known = afd_cpu_vbmi();
  return known;
}

/* Where value k of weight row n lies in the path's layout (a run of 8 from k, k % 8 == 0, is
 * contiguous there): gemm.c's groups of 4 rows (rows past the last whole group row-major),
 * amx.c's 16 x 32 tiles where afd_amx_tiled(N, K), else row-major. */
static inline size_t at(int isa, int N, int K, int n, int k) {
  if (isa == ISA_AVX2 && n < N / 4 * 4)
    return (size_t)(n & ~3) * K + (size_t)(k / 8) * 32 + (size_t)(n & 3) * 8 + k % 8;
  if (isa == ISA_AMX && afd_amx_tiled(N, K))
    return (size_t)(n & ~15) * K + (size_t)(k / 32) * 512 + (size_t)(n & 15) * 32 + k % 32;
  return (size_t)n * K + k;
}

/* Values [k0, k1) of row n (codes q, the row's K-block scale s) into the scratch `out` (its row
 * n0 at out[0]): 8 at a time where a run of 8 starts, one by one at a block's ragged edges.
 * Where no product can be a NaN or an fp32 subnormal (row_512 says when), 16 at a time rounded
 * without round8's NaN lanes: half its instructions, and the conversion is most of the work. */
static void row_avx2(const uint8_t *q, float s, uint16_t *out, int N, int K, int n, int n0,
                     int k0, int k1) {
  const float s120 = s * 0x1p120f; /* fp32, as the torch path's */
  const __m256 vs = _mm256_set1_ps(s120);
  const size_t base = (size_t)n0 * K;
  int k = k0;
  for (; k < k1 && k % 8; k++) out[at(ISA_AVX2, N, K, n, k) - base] = afd_fp8_weight(q[k], s120);
  if (afd_fp8_fast(s))
    for (; k + 16 <= k1; k += 16) {
      /* lanes (a0-3, b0-3 | a4-7, b4-7) -> (a0-7 | b0-7): two runs of 8, each where it lies */
      __m256i a = _mm256_castps_si256(afd_fp8_round8_fast(afd_fp8_products8(q + k, vs)));
      __m256i b = _mm256_castps_si256(afd_fp8_round8_fast(afd_fp8_products8(q + k + 8, vs)));
      __m256i ab = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));
      ab = _mm256_permute4x64_epi64(ab, 0xD8);
      _mm_storeu_si128((__m128i *)(out + at(ISA_AVX2, N, K, n, k) - base),
                       _mm256_castsi256_si128(ab));
      _mm_storeu_si128((__m128i *)(out + at(ISA_AVX2, N, K, n, k + 8) - base),
                       _mm256_extracti128_si256(ab, 1));
    }
  for (; k + 8 <= k1; k += 8)
    store8(out + at(ISA_AVX2, N, K, n, k) - base, round8(afd_fp8_products8(q + k, vs)));
  for (; k < k1; k++) out[at(ISA_AVX2, N, K, n, k) - base] = afd_fp8_weight(q[k], s120);
}

/* The same on the AVX-512 paths, 16 at a time where a run of 16 starts (contiguous in row-major
 * and tiled layouts alike) and one by one at the edges. Where every product of the block is an
 * fp32 normal or zero (scale in [2^-117, 2^7]: e4m3's smallest code is 2^-9, its largest 448),
 * 32 at a time rounded by vcvtne2ps2bf16, which rounds those as to_bf16 does (it would flush a
 * subnormal product, which round16 keeps): a third of round16's instructions, and the
 * conversion is most of an FP8 matmul's work at a few rows of x. */
static AFD_AVX512BF16 void row_512(const uint8_t *q, float s, uint16_t *out, int isa, int N,
                                   int K, int n, int n0, int k0, int k1) {
  const float s120 = s * 0x1p120f;
  const __m512 vs = _mm512_set1_ps(s120);
  const size_t base = (size_t)n0 * K;
  int k = k0;
  for (; k < k1 && k % 16; k++) out[at(isa, N, K, n, k) - base] = afd_fp8_weight(q[k], s120);
  if (afd_fp8_fast(s)) {
    if (k % 32 && k + 16 <= k1) {
      store16(out + at(isa, N, K, n, k) - base, round16(afd_fp8_products16(q + k, vs)));
      k += 16;
    }
    for (; k + 32 <= k1; k += 32)
      _mm512_storeu_si512((void *)(out + at(isa, N, K, n, k) - base),
                          (__m512i)afd_fp8_weights32(q + k, vs, 1));
  }
  for (; k + 16 <= k1; k += 16)
    store16(out + at(isa, N, K, n, k) - base, round16(afd_fp8_products16(q + k, vs)));
  for (; k < k1; k++) out[at(isa, N, K, n, k) - base] = afd_fp8_weight(q[k], s120);
}

/* Row n's codes q (K and bk multiples of 32: no run of 32 crosses a block) into the scratch from
 * dst, its runs of 32 values `step` apart (32 row-major, 512 in tiles): row_512's bits, with
 * addresses counted up instead of computed per run (at one row of x, at() and the calls per
 * block were most of the conversion's time). */
static AFD_AVX512BF16 void row_512_runs(const uint8_t *q, const float *s, uint16_t *dst, int nk,
                                        int bk, int K, size_t step) {
  for (int b = 0; b < nk; b++) {
    const int k1 = (b + 1) * bk < K ? (b + 1) * bk : K;
    const __m512 vs = _mm512_set1_ps(s[b] * 0x1p120f); /* fp32, as the torch path's */
    if (afd_fp8_fast(s[b]))
      for (int k = b * bk; k < k1; k += 32, dst += step)
        _mm512_storeu_si512((void *)dst, (__m512i)afd_fp8_weights32(q + k, vs, 1));
    else
      for (int k = b * bk; k < k1; k += 32, dst += step)
        _mm512_storeu_si512((void *)dst, (__m512i)afd_fp8_weights32(q + k, vs, 0));
  }
}

/* row_512_runs on a CPU with AVX-512 VBMI: a fast block's weights looked up in its table from
 * the thread's cache (fp8_512.h), 64 at a time; the same bits. */
static AFD_AVX512VBMI void row_512_runs_lut(const uint8_t *q, const float *s, uint16_t *dst,
                                            int nk, int bk, int K, size_t step,
                                            uint8_t *tables) {
  const __m512i order = afd_fp8_lut_order();
  for (int b = 0; b < nk; b++) {
    const int k1 = (b + 1) * bk < K ? (b + 1) * bk : K;
    int k = b * bk;
    if (!afd_fp8_fast(s[b])) {
      const __m512 vs = _mm512_set1_ps(s[b] * 0x1p120f);
      for (; k < k1; k += 32, dst += step)
        _mm512_storeu_si512((void *)dst, (__m512i)afd_fp8_weights32(q + k, vs, 0));
      continue;
    }
    const uint8_t *tab = afd_fp8_entry(tables, b, s[b]);
    __m512i t[4];
    for (int j = 0; j < 4; j++) t[j] = _mm512_loadu_si512(tab + 64 * j);
    __m512bh w[2];
    for (; k + 64 <= k1; k += 64, dst += 2 * step) {
      afd_fp8_lut64(_mm512_loadu_si512(q + k), order, t, w);
      _mm512_storeu_si512((void *)dst, (__m512i)w[0]);
      _mm512_storeu_si512((void *)(dst + step), (__m512i)w[1]);
    }
    if (k < k1) { /* a last 32 */
      afd_fp8_lut64(_mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(q + k))), order,
                    t, w);
      _mm512_storeu_si512((void *)dst, (__m512i)w[0]);
      dst += step;
    }
  }
}

/* Rows n0..n1 of W into the scratch, each K-block with its own scale; the codes of the rows a
 * chunk later (below pf_end) fetched into L2 meanwhile, so that the next conversion does not
 * wait on DRAM: the codes are read in bursts between matmuls, which the hardware prefetcher
 * alone let start cold (the first load of each burst's lines took half the conversion's time
 * at 32 rows of x, Intel Xeon). */
static void convert(const uint8_t *q, const float *s, uint16_t *out, int isa, int N, int K,
                    int bk, int n0, int n1, int pf_end, uint8_t *tables) {
  const int nk = (K + bk - 1) / bk;
  for (int n = n0; n < n1; n++) {
    const uint8_t *qn = q + (size_t)n * K;
    if (n + CHUNK < pf_end)
      for (int o = 0; o < K; o += 64)
        _mm_prefetch((const char *)(qn + (size_t)CHUNK * K + o), _MM_HINT_T1);
    if (isa != ISA_AVX2 && K % 32 == 0 && bk % 32 == 0) {
      const size_t step = isa == ISA_AMX && afd_amx_tiled(N, K) ? 512 : 32;
      uint16_t *dst = out + at(isa, N, K, n, 0) - (size_t)n0 * K;
      if (tables)
        row_512_runs_lut(qn, s + (size_t)n * nk, dst, nk, bk, K, step, tables);
      else
        row_512_runs(qn, s + (size_t)n * nk, dst, nk, bk, K, step);
      continue;
    }
    for (int b = 0; b < nk; b++) {
      const float sb = s[(size_t)n * nk + b];
      const int k0 = b * bk, k1 = k0 + bk < K ? k0 + bk : K;
      if (isa == ISA_AVX2)
        row_avx2(qn, sb, out, N, K, n, n0, k0, k1);
      else
        row_512(qn, sb, out, isa, N, K, n, n0, k0, k1);
    }
  }
}

/* Rows n0..n1 of the FP8 W (codes q, scales s, K-blocks of bk) against the M rows of x, into y
 * [M, N], CHUNK rows at a time through `scratch` (CHUNK K bf16) on the rows function of isa:
 * ISA_AVX2 (xf: x in fp32; wt: afd_rows' 4 K floats), ISA_AMX (xp: x packed by afd_amx_pack;
 * the caller checks K % 32 == 0 and the CPU), ISA_AVX512. n0 a multiple of 16. */
void afd_fp8_rows(const uint16_t *x, const float *xf, const uint16_t *xp, const uint8_t *q,
                  const float *s, int bk, uint16_t *y, int M, int N, int K, int n0, int n1, int isa,
                  uint16_t *scratch, float *wt) {
  /* decode on the AVX-512 BF16 and AVX2 paths: converted in registers (fp8_stream.c), the
   * dense weight's bits on that path */
  /* the thread's tables where it may use them (fp8_gemm.h) */
  uint8_t *tables = isa != ISA_AVX2 && K % 32 == 0 && bk % 32 == 0 && vbmi() ? (uint8_t *)wt
                                                                              : NULL;
  if (isa == ISA_AVX512 && M <= STREAM_MAX_M && K % 32 == 0 && bk % 32 == 0) {
    afd_fp8_stream_rows(x, q, s, bk, y, M, N, K, n0, n1, tables);
    return;
  }
  if (isa == ISA_AVX2 && M <= 2 && bk % 8 == 0) {
    afd_fp8_stream_rows_avx2(xf, q, s, bk, y, M, N, K, n0, n1);
    return;
  }
  /* fetching ahead into the next unit too: a thread's units come in runs (runs.h) */
  const int pf_end = n1 + CHUNK < N ? n1 + CHUNK : N;
  for (int c0 = n0; c0 < n1; c0 += CHUNK) {
    const int c1 = c0 + CHUNK < n1 ? c0 + CHUNK : n1;
    convert(q, s, scratch, isa, N, K, bk, c0, c1, pf_end, tables);
    /* the rows functions find row n at w + n K: the scratch stands for rows c0.. */
    const uint16_t *w = scratch - (ptrdiff_t)c0 * K;
    if (isa == ISA_AVX2)
      afd_rows(xf, w, y, M, N, K, c0, c1, wt);
    else if (isa == ISA_AMX)
      afd_rows_amx(x, xp, w, y, M, N, K, c0, c1);
    else
      afd_rows512(x, w, y, M, N, K, c0, c1);
  }
}

/* isa: bf16.h's ISA_* (the caller checks the CPU runs it); K % 8 == 0 on ISA_AVX2, even on the
 * others (the dense kernels' needs). Returns 0, or -1 for bad sizes or no memory. */
int afd_fp8_gemm(const uint16_t *x, const uint8_t *q, const float *s, uint16_t *y, int M, int N,
                 int K, int bk, int isa, int threads) {
  if (M <= 0 || N <= 0 || bk <= 0 || K % (isa == ISA_AVX2 ? 8 : 2)) return -1;
  /* AMX where K is whole tiles, else amx.c's fallback, gemm512.c, on row-major rows */
  if (isa == ISA_AMX && !(K % 32 == 0 && afd_cpu_amx())) isa = ISA_AVX512;
  int t = (size_t)N * K < ONE_THREAD_WEIGHTS ? 1 : threads; /* bf16.h */
  const int units = (N + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT;
  const size_t per = AFD_FP8_SCRATCH(K);
  char *scratch = (char *)afd_alloc64(per * t);
  float *xf = isa == ISA_AVX2 ? (float *)afd_alloc64((size_t)M * K * sizeof(float)) : NULL;
  uint16_t *xp =
      isa == ISA_AMX ? (uint16_t *)afd_alloc64(afd_amx_elems(M, K) * sizeof(uint16_t)) : NULL;
  uint64_t *runs = (uint64_t *)afd_alloc64(AFD_RUNS_WORDS(t) * sizeof(uint64_t));
  if (!scratch || !runs || (isa == ISA_AVX2 && !xf) || (isa == ISA_AMX && !xp)) {
    free(scratch), free(xf), free(xp), free(runs);
    return -1;
  }
  if (xf)
    for (size_t i = 0; i < (size_t)M * K; i += 8) _mm256_storeu_ps(xf + i, load_bf16(x + i));
  if (xp) afd_amx_pack(x, M, K, xp);
  afd_runs_init(runs, t, units);
#pragma omp parallel num_threads(t) if (t > 1)
  {
    const int me = t > 1 ? omp_get_thread_num() : 0;
    uint16_t *rows = (uint16_t *)(scratch + per * me);
    float *wt = (float *)(scratch + per * me + AFD_FP8_ROWS_BYTES(K));
    afd_fp8_tables_clear(wt, K);
    for (int u; (u = afd_runs_next(runs, t, me)) >= 0;) {
      const int n0 = u * ROWS_PER_UNIT, n1 = n0 + ROWS_PER_UNIT < N ? n0 + ROWS_PER_UNIT : N;
      afd_fp8_rows(x, xf, xp, q, s, bk, y, M, N, K, n0, n1, isa, rows, wt);
    }
  }
  free(scratch), free(xf), free(xp), free(runs);
  return 0;
}
