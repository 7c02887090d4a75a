/* y[M, N] = x[M, K] @ W[N, K]^T for bf16 x, W and y on CPUs with AMX (Intel Sapphire Rapids and
 * later): one TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums,
 * 16 times the products of a vdpbf16ps, so a batch of rows of x costs little more than one.
 *
 * The weight is laid out once in tiles (afd_amx_tiled, bf16.h): a tile of 16 weight rows x 32
 * values (the A operand) is one run of 1 KiB, so the tiles stream W front to back; read
 * row-major instead (stride K), 64 rows of a unit were 64 separate streams and DRAM delivered
 * ~15% less (measured: docs/benchmarks.md). A weight whose shape has no whole tiles (K not a
 * multiple of 32, N not of 16) stays row-major: its tiles are loaded with stride K, and what
 * they do not cover goes through gemm512.c on the same tensor. x is the B operand, which
 * TDPBF16PS wants with pairs of K interleaved ("VNNI"): afd_amx_pack lays 16 rows of x out
 * that way once per call, zero past the last row. A tile's sums are W rows x rows of x, so
 * they land transposed; each element is its own dot product, accumulated over K in the same
 * order wherever its row of x sits in the tile, so a row's result is the same bits alone or in
 * a batch. Every batch size takes the tiles: one row included (in the engine the tiles beat
 * gemm512.c's one-row loop, docs/benchmarks.md).
 *
 * Linux grants the tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM),
 * which afd_cpu_amx makes (the entry points ask it before any tile instruction: an
 * instruction without the grant is SIGILL). The tile configuration is per thread and other
 * libraries (oneDNN) load their own on the same OpenMP threads, so each call loads ours and
 * releases it. */
#include <cpuid.h>
#include <omp.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "bf16.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this CPU has AMX tiles with BF16 and the OS lets this process use them (asking once). */
int afd_cpu_amx(void) {
  static int state = -1; /* races only to the same answer */
  if (state >= 0) return state;
  unsigned a, b, c, d;
  int ok = afd_cpu_avx512bf16() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) &&
           (d >> 24 & 1) && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return state = ok;
}

/* The 16 x 16 matrix of 32-bit values in r[0..15] (a row a register) transposed in place:
 * pairs of rows interleaved by 32, then 64 bits, then 128-bit lanes twice. */
static inline AMX void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

/* x [M, K] -> xp: for each block of 16 rows, for each step s of 32 values of K, 16 pairs
 * (values 32s + 2p, 32s + 2p + 1) of each of the 16 rows; rows past M are zero. xp holds
 * ceil(M / 16) * 16 * K values. K % 32 == 0. A step's 16 pairs of 16 rows are a 16 x 16
 * matrix of 32-bit values, transposed in registers (element by element, the stores 64 bytes
 * apart made the pack a visible part of a batch-32 decode step). */
AMX void afd_amx_pack(const uint16_t *x, int M, int K, uint16_t *xp) {
  const int MB = (M + 15) / 16, S = K / 32;
  for (int mb = 0; mb < MB; mb++) {
    __m512i *out = (__m512i *)(xp + (size_t)mb * afd_amx_elems(1, K));
    const int rows = M - mb * 16 < 16 ? M - mb * 16 : 16;
    const uint16_t *base = x + (size_t)mb * 16 * K;
    for (int s = 0; s < S; s++) {
      __m512i r[16];
      for (int i = 0; i < 16; i++)
        r[i] = i < rows ? _mm512_loadu_si512(base + (size_t)i * K + 32 * s)
                        : _mm512_setzero_si512();
      transpose16(r);
      for (int p = 0; p < 16; p++) _mm512_storeu_si512(out + (size_t)s * 16 + p, r[p]);
    }
  }
}

/* to_bf16 on 16 fp32 lanes (round to nearest even, NaN kept quiet): the bf16 bits, one a lane */
static inline AMX __m512i bf16_bits16(__m512i u) {
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                          _mm512_set1_epi32(0x7f800000));
  __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
  return _mm512_srli_epi32(_mm512_mask_mov_epi32(r, nan, quiet), 16);
}

/* The tile of sums for weight rows n..n+15 and rows of x mb*16.. (c: [16 weight rows][16 rows
 * of x] fp32) -> y, transposed (a column of c gathered) and rounded to bf16. */
static AMX void put(const float *c, uint16_t *y, int M, int N, int mb, int n) {
  const int rows = M - mb * 16 < 16 ? M - mb * 16 : 16;
  for (int i = 0; i < rows; i++) {
    __m512i u = _mm512_castps_si512(afd_amx_column(c, i));
    _mm256_storeu_si256((__m256i *)(y + (size_t)(mb * 16 + i) * N + n),
                        _mm512_cvtepi32_epi16(bf16_bits16(u)));
  }
}

/* Rows n0..n1 of W (n0 a multiple of 16) against every row of x [M, K] (xp: x as afd_amx_pack
 * lays it out; K % 32 == 0); the (n1 - n0) % 16 rows past the last whole tile go through
 * gemm512.c. */
AMX void afd_rows_amx(const uint16_t *x, const uint16_t *xp, const uint16_t *w, uint16_t *y,
                      int M, int N, int K, int n0, int n1) {
  const int S = K / 32, MB = (M + 15) / 16, whole = n0 + (n1 - n0) / 16 * 16;
  if (whole < n1) afd_rows512(x, w, y, M, N, K, whole, n1);
  n1 = whole;
  if (n1 <= n0) return;
  /* a tile of W: 32 values on from a group's start (row-major: stride K) or a run of 512 */
  const int tiled = afd_amx_tiled(N, K);
  const size_t ldw = tiled ? 64 : (size_t)K * sizeof(uint16_t), step = tiled ? 512 : 32;
  float c[4][16 * 16] __attribute__((aligned(64)));
  afd_amx_configure();
  int mb = 0;
  for (; mb + 2 <= MB; mb += 2) { /* two blocks of x, two of W: 4 products per 4 tile loads */
    const uint16_t *b0 = xp + (size_t)mb * afd_amx_elems(1, K), *b1 = b0 + afd_amx_elems(1, K);
    for (int n = n0; n < n1; n += 32) {
      const int two = n + 32 <= n1;
      const uint16_t *a0 = w + (size_t)n * K, *a1 = a0 + 16 * (size_t)K;
      afd_amx_zero_sums();
      for (int s = 0; s < S; s++) {
        _tile_loadd(6, b0 + (size_t)s * 512, 64);
        _tile_loadd(7, b1 + (size_t)s * 512, 64);
        _tile_loadd(4, a0 + step * s, ldw);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, a1 + step * s, ldw);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      put(c[0], y, M, N, mb, n), put(c[1], y, M, N, mb + 1, n);
      if (two) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        put(c[2], y, M, N, mb, n + 16), put(c[3], y, M, N, mb + 1, n + 16);
      }
    }
  }
  if (mb < MB) { /* one block of x, up to four of W */
    const uint16_t *b0 = xp + (size_t)mb * afd_amx_elems(1, K);
    for (int n = n0; n < n1; n += 64) {
      const int nb = (n1 - n) / 16 < 4 ? (n1 - n) / 16 : 4;
      const uint16_t *a = w + (size_t)n * K;
      const size_t group = 16 * (size_t)K;
      afd_amx_zero_sums();
      for (int s = 0; s < S; s++) {
        _tile_loadd(6, b0 + (size_t)s * 512, 64);
        _tile_loadd(4, a + step * s, ldw);
        _tile_dpbf16ps(0, 4, 6);
        if (nb > 1) {
          _tile_loadd(5, a + group + step * s, ldw);
          _tile_dpbf16ps(1, 5, 6);
        }
        if (nb > 2) {
          _tile_loadd(4, a + 2 * group + step * s, ldw);
          _tile_dpbf16ps(2, 4, 6);
        }
        if (nb > 3) {
          _tile_loadd(5, a + 3 * group + step * s, ldw);
          _tile_dpbf16ps(3, 5, 6);
        }
      }
      _tile_stored(0, c[0], 64);
      if (nb > 1) _tile_stored(1, c[1], 64);
      if (nb > 2) _tile_stored(2, c[2], 64);
      if (nb > 3) _tile_stored(3, c[3], 64);
      for (int j = 0; j < nb; j++) put(c[j], y, M, N, mb, n + 16 * j);
    }
  }
  _tile_release();
}

/* y = x @ W^T on the tiles where K % 32 == 0 and AMX runs (else gemm512.c); returns 0, or -1
 * for bad sizes or no memory. */
int afd_bf16_gemm_amx(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K,
                      int threads) {
  if (K % 32 != 0 || !afd_cpu_amx()) /* no whole tile of K, or no tiles */
    return afd_bf16_gemm512(x, w, y, M, N, K, threads);
  if (M <= 0 || N <= 0) return -1;
  uint16_t *xp = (uint16_t *)aligned_alloc(64, afd_amx_elems(M, K) * sizeof(uint16_t));
  if (!xp) return -1;
  afd_amx_pack(x, M, K, xp);
  int t = (size_t)N * K < ONE_THREAD_WEIGHTS ? 1 : threads; /* bf16.h */
  int units = (N + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT;
#pragma omp parallel for num_threads(t) schedule(dynamic, 1) if (t > 1)
  for (int u = 0; u < units; u++) {
    int n0 = u * ROWS_PER_UNIT, n1 = n0 + ROWS_PER_UNIT < N ? n0 + ROWS_PER_UNIT : N;
    afd_rows_amx(x, xp, w, y, M, N, K, n0, n1);
  }
  free(xp);
  return 0;
}
