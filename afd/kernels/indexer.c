/* DeepSeek Sparse Attention's lightning indexer (loaded with ctypes by afd/kernels/indexer.py):
 * its scores over the paged indexer-key pool, the top-k selection, and a decode batch's whole
 * selection for the fused MLA layer (mla_layer.c).
 *
 * For query row i and each position l of its block table,
 *   index[i, l] = sum_h w[i, h] * relu(scale * (q[i, h] . k_l))
 * with the keys bf16 in the pool, read in place: the torch path gathers the row's blocks into
 * a copy and widens it to fp32 before one matmul. Products are exact (bf16 by bf16); the sums'
 * order is each kernel's (fp32 FMAs on AVX2, vdpbf16ps pairs on AVX-512, tile products on
 * AMX), so scores differ from the torch path's, and between paths, in the last fp32 bits.
 * Work is split over (row, block) pairs, block-major where the rows share one table (a
 * prefill's), so a block's keys are prepared once for every row. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "indexer.h"

/* Scores of up to 8 positions whose keys (fp32, zero-padded) are kt[8][D]. */
static inline __m256 score8(const float *q, const float *w, const float *kt, int H, int D,
                            float scale) {
  const __m256 vscale = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
  __m256 acc = zero;
  for (int h = 0; h < H; h++) {
    const float *qh = q + (size_t)h * D;
    __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero, a6 = zero, a7 = zero;
    for (int d = 0; d < D; d += 8) {
      __m256 c = _mm256_loadu_ps(qh + d);
      a0 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + d), a0);
      a1 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + D + d), a1);
      a2 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 2 * D + d), a2);
      a3 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 3 * D + d), a3);
      a4 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 4 * D + d), a4);
      a5 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 5 * D + d), a5);
      a6 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 6 * D + d), a6);
      a7 = _mm256_fmadd_ps(c, _mm256_loadu_ps(kt + 7 * D + d), a7);
    }
    __m256 s = _mm256_max_ps(_mm256_mul_ps(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7), vscale), zero);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(w[h]), s, acc);
  }
  return acc;
}

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* Task t's row i and table entry j: block-major where the rows share one table (a prefill's),
 * so a thread's consecutive tasks read one block; else row-major. */
static inline void task_of(int64_t t, int shared, int n, int nb, int *i, int *j) {
  *i = shared ? (int)(t % n) : (int)(t / nb);
  *j = shared ? (int)(t / n) : (int)(t % nb);
}

/* Task (row i, table entry j)'s block, or -1 where the table names none of the pool's NB (its
 * bs outputs at o then zeros: nothing is read from it). */
static inline int64_t task_block(const int64_t *blocks, int shared, int i, int j, int nb, int NB,
                                 float *o, int bs) {
  int64_t b = blocks[(shared ? 0 : (int64_t)i * nb) + j];
  if (b >= 0 && b < NB) return b;
  for (int p = 0; p < bs; p++) o[p] = 0.0f;
  return -1;
}

/* The keys of up to 16 positions (rows of D bf16, D2 = D / 2 pairs) as kt [D2][16]: pair d of
 * each position, 16 positions a vector, so one vdpbf16ps takes a pair of every position;
 * positions past m are zeros. 16 pairs at a time: 16 loads and a 16 x 16 transpose of 32-bit
 * values in registers (pairs within 128-bit lanes, then the lanes). */
static AVX512BF16 void transpose16(const uint16_t *keys, int m, int D2, uint32_t *kt) {
  const uint32_t *k32 = (const uint32_t *)keys; /* position p's pairs at k32 + p * D2 */
  for (int d0 = 0; d0 < D2; d0 += 16) {
    const int w = D2 - d0 < 16 ? D2 - d0 : 16;
    const __mmask16 mc = w >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << w) - 1);
    __m512i r[16], t[16], u[16], v[16];
    for (int p = 0; p < 16; p++)
      r[p] = p < m ? _mm512_maskz_loadu_epi32(mc, k32 + (size_t)p * D2 + d0)
                   : _mm512_setzero_si512();
    for (int p = 0; p < 16; p += 2) { /* lane k: pairs 4k..4k+3 of positions p, p + 1 */
      t[p] = _mm512_unpacklo_epi32(r[p], r[p + 1]);
      t[p + 1] = _mm512_unpackhi_epi32(r[p], r[p + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* u[g + j], lane k: pair 4k + j of positions g..g+3 */
      u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
      u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
      u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
      u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int j = 0; j < 4; j++) { /* v[j]: pairs j, 8 + j; v[4 + j]: 4 + j, 12 + j */
      v[j] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
      v[4 + j] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
      v[8 + j] = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
      v[12 + j] = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    }
    for (int c = 0; c < 8; c++) { /* pair c from v[c]'s even lanes, pair c + 8 its odd ones */
      if (c < w)
        _mm512_storeu_si512(kt + (size_t)(d0 + c) * 16,
                            _mm512_shuffle_i32x4(v[c], v[c + 8], 0x88));
      if (c + 8 < w)
        _mm512_storeu_si512(kt + (size_t)(d0 + c + 8) * 16,
                            _mm512_shuffle_i32x4(v[c], v[c + 8], 0xdd));
    }
  }
}

/* Scores of 16 positions from kt (transpose16) for one row: qp [H][D2] its heads' bf16 pairs,
 * w [H]. Products exact (bf16 by bf16), each head's summed in one vdpbf16ps chain over its
 * pairs in order; 8 heads at a time, so 8 chains run side by side on each loaded pair. */
static AVX512BF16 __m512 score16(const uint32_t *qp, const float *w, const uint32_t *kt, int H,
                                 int D2, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale), zero = _mm512_setzero_ps();
  __m512 acc = zero;
  for (int h0 = 0; h0 < H; h0 += 8) {
    const int u = H - h0 < 8 ? H - h0 : 8;
    const uint32_t *q = qp + (size_t)h0 * D2;
    __m512 s[8] = {zero, zero, zero, zero, zero, zero, zero, zero};
    if (u == 8) {
      for (int d = 0; d < D2; d++) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + (size_t)d * 16);
        for (int v = 0; v < 8; v++)
          s[v] = _mm512_dpbf16_ps(s[v], (__m512bh)_mm512_set1_epi32((int)q[v * D2 + d]), k);
      }
    } else {
      for (int d = 0; d < D2; d++) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kt + (size_t)d * 16);
        for (int v = 0; v < u; v++)
          s[v] = _mm512_dpbf16_ps(s[v], (__m512bh)_mm512_set1_epi32((int)q[v * D2 + d]), k);
      }
    }
    for (int v = 0; v < u; v++) {
      __m512 sc = _mm512_max_ps(_mm512_mul_ps(s[v], vscale), zero);
      acc = _mm512_fmadd_ps(_mm512_set1_ps(w[h0 + v]), sc, acc);
    }
  }
  return acc;
}

/* afd_bf16_index_scores on AVX-512 BF16: qb [n, H, D] the queries as bf16 (exact: they are
 * bf16 values). Shared tables (a prefill's rows) go block by block, each block's keys
 * transposed once for every row; otherwise per (row, block). */
static AVX512BF16 int index_scores512(const uint16_t *qb, const float *w, const uint16_t *pool,
                                      const int64_t *blocks, int shared, float *out, int n,
                                      int H, int D, int NB, int nb, int bs, float scale,
                                      int threads) {
  int bad = 0;
  const int64_t L = (int64_t)nb * bs;
  const int D2 = D / 2, groups = (bs + 15) / 16;
#pragma omp parallel num_threads(threads) reduction(| : bad)
  {
    uint32_t *kt = (uint32_t *)malloc((size_t)groups * D2 * 16 * sizeof(uint32_t));
    int64_t have = -1; /* the block kt holds */
    if (!kt) bad = 1;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (int64_t)n * nb; t++) {
      if (!kt) continue;
      int i, j;
      task_of(t, shared, n, nb, &i, &j);
      float *o = out + (size_t)i * L + (size_t)j * bs;
      int64_t b = task_block(blocks, shared, i, j, nb, NB, o, bs);
      if (b < 0) {
        bad = 1;
        continue;
      }
      if (b != have) {
        const uint16_t *keys = pool + (size_t)b * bs * D;
        for (int g = 0; g < groups; g++) {
          int m = bs - 16 * g < 16 ? bs - 16 * g : 16;
          transpose16(keys + (size_t)16 * g * D, m, D2, kt + (size_t)g * D2 * 16);
        }
        have = b;
      }
      const uint32_t *qp = (const uint32_t *)(qb + (size_t)i * H * D);
      for (int g = 0; g < groups; g++) {
        int m = bs - 16 * g < 16 ? bs - 16 * g : 16;
        const __mmask16 mk = m >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << m) - 1);
        __m512 sc = score16(qp, w + (size_t)i * H, kt + (size_t)g * D2 * 16, H, D2, scale);
        _mm512_mask_storeu_ps(o + 16 * g, mk, sc);
      }
    }
    free(kt);
  }
  return bad ? -1 : 0;
}

/* Each row's queries qb [n][H][D] bf16 as AMX B tiles, per row T C tiles of 1 KiB (T: 16
 * heads, C: 32 values of D): tile (t, c), row r, column j = pair 16c + r of head 16t + j (zero
 * past H); w [n][H] -> wp [n][16 T], zero past H. */
static void pack_rows_amx(const uint16_t *qb, const float *w, int n, int H, int D, uint32_t *qp,
                          float *wp) {
  const int C = D / 32, T = (H + 15) / 16, D2 = D / 2;
  const size_t per = (size_t)T * C * 256;
  const uint32_t *pairs = (const uint32_t *)qb;
  memset(qp, 0, (size_t)n * per * sizeof(uint32_t));
  memset(wp, 0, (size_t)n * T * 16 * sizeof(float));
  for (int i = 0; i < n; i++)
    for (int h = 0; h < H; h++) {
      uint32_t *dst = qp + i * per + (size_t)(h / 16) * C * 256 + h % 16;
      const uint32_t *src = pairs + ((size_t)i * H + h) * D2;
      for (int d = 0; d < D2; d++) dst[(size_t)(d / 16) * 256 + (d % 16) * 16] = src[d];
      wp[(size_t)i * T * 16 + h] = w[(size_t)i * H + h];
    }
}

/* afd_bf16_index_scores on AMX tiles (D % 32 == 0): per 16 positions, the keys as A tiles
 * read in place (rows D apart; a block's last few copied, zero-padded), each row's heads as
 * B tiles, up to 4 tiles of 16 heads' sums at a time; then each position's weighted relu of
 * its heads' sums, 16 heads a vector, added across the head tiles and summed last. */
static AMX int index_scores_amx(const uint16_t *qb, const float *w, const uint16_t *pool,
                                const int64_t *blocks, int shared, float *out, int n, int H,
                                int D, int NB, int nb, int bs, float scale, int threads) {
  const int64_t L = (int64_t)nb * bs;
  const int C = D / 32, T = (H + 15) / 16, groups = (bs + 15) / 16;
  const size_t per = (size_t)T * C * 256;
  uint32_t *qp = (uint32_t *)afd_alloc64((size_t)n * per * sizeof(uint32_t));
  float *wp = (float *)afd_alloc64((size_t)n * T * 16 * sizeof(float));
  int bad = !qp || !wp;
  if (!bad) pack_rows_amx(qb, w, n, H, D, qp, wp);
#pragma omp parallel num_threads(threads) reduction(| : bad) if (!bad)
  {
    uint16_t *rows = (uint16_t *)afd_alloc64((size_t)16 * D * sizeof(uint16_t));
    float *sums = (float *)afd_alloc64(4 * 256 * sizeof(float));
    const __m512 vscale = _mm512_set1_ps(scale), zero = _mm512_setzero_ps();
    if (!rows || !sums) bad = 1;
    afd_amx_configure();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (int64_t)n * nb; t++) {
      if (!rows || !sums || !qp || !wp) continue;
      int i, j;
      task_of(t, shared, n, nb, &i, &j);
      float *o = out + (size_t)i * L + (size_t)j * bs;
      int64_t b = task_block(blocks, shared, i, j, nb, NB, o, bs);
      if (b < 0) {
        bad = 1;
        continue;
      }
      const uint32_t *q = qp + i * per;
      const float *wi = wp + (size_t)i * T * 16;
      for (int g = 0; g < groups; g++) {
        const int m = bs - 16 * g < 16 ? bs - 16 * g : 16;
        const uint16_t *a = pool + ((size_t)b * bs + 16 * g) * D;
        if (m < 16) {
          memset(rows, 0, (size_t)16 * D * sizeof(uint16_t));
          memcpy(rows, a, (size_t)m * D * sizeof(uint16_t));
          a = rows;
        }
        __m512 part[16];
        for (int p = 0; p < 16; p++) part[p] = zero;
        for (int t0 = 0; t0 < T; t0 += 4) {
          const int k = T - t0 < 4 ? T - t0 : 4;
          const uint32_t *qt = q + (size_t)t0 * C * 256;
          afd_amx_zero_sums();
          for (int c = 0; c < C; c++) {
            _tile_loadd(4, a + 32 * c, D * 2);
            afd_amx_times(qt + (size_t)c * 256, (size_t)C * 256, k);
          }
          afd_amx_store_sums(sums, k);
          for (int u = 0; u < k; u++) { /* row p of a tile: position p's 16 heads */
            const __m512 wv = _mm512_loadu_ps(wi + (size_t)(t0 + u) * 16);
            for (int p = 0; p < 16; p++) {
              __m512 r = _mm512_loadu_ps(sums + u * 256 + p * 16);
              part[p] = _mm512_fmadd_ps(wv, _mm512_max_ps(_mm512_mul_ps(r, vscale), zero),
                                        part[p]);
            }
          }
        }
        for (int p = 0; p < m; p++) o[16 * g + p] = _mm512_reduce_add_ps(part[p]);
      }
    }
    _tile_release();
    free(rows), free(sums);
  }
  free(qp), free(wp);
  return bad ? -1 : 0;
}

/* qb [n, H, D] bf16, w [n, H] fp32, pool [NB, bs, D] bf16, blocks [n or 1, nb] (shared: every
 * row reads row 0), out [n, nb * bs] fp32. D % 8 == 0. isa: ISA_AVX2 sums fp32 products 8
 * lanes a head (score8); the AVX-512 paths take vdpbf16ps pairs, another order, and ISA_AMX
 * tiles where D % 32 == 0, a third. Returns 0, or -1 for a block id outside the pool (nothing
 * is read from it) or memory short. */
int afd_bf16_index_scores(const uint16_t *qb, const float *w, const uint16_t *pool,
                          const int64_t *blocks, int shared, float *out, int n, int H, int D,
                          int NB, int nb, int bs, float scale, int threads, int isa) {
  if (isa == ISA_AMX && D % 32 == 0)
    return index_scores_amx(qb, w, pool, blocks, shared, out, n, H, D, NB, nb, bs, scale,
                            threads);
  if (isa != ISA_AVX2)
    return index_scores512(qb, w, pool, blocks, shared, out, n, H, D, NB, nb, bs, scale,
                           threads);
  float *q = (float *)afd_alloc64((size_t)n * H * D * sizeof(float)); /* widened once */
  if (!q) return -1;
  for (size_t x = 0; x < (size_t)n * H * D; x++) q[x] = bf16_value(qb[x]);
  int bad = 0;
  const int64_t L = (int64_t)nb * bs;
#pragma omp parallel num_threads(threads) reduction(| : bad)
  {
    float kt[8 * 256];  /* D <= 256 */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (int64_t)n * nb; t++) {
      int i = (int)(t / nb), j = (int)(t % nb);
      float *o = out + (size_t)i * L + (size_t)j * bs;
      int64_t b = task_block(blocks, shared, i, j, nb, NB, o, bs);
      if (b < 0) {
        bad = 1;
        continue;
      }
      const uint16_t *keys = pool + (size_t)b * bs * D;
      const float *qi = q + (size_t)i * H * D, *wi = w + (size_t)i * H;
      for (int p0 = 0; p0 < bs; p0 += 8) {
        int m = bs - p0 < 8 ? bs - p0 : 8;
        for (int r = 0; r < 8; r++)
          for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(kt + r * D + d, r < m ? load_bf16(keys + (size_t)(p0 + r) * D + d)
                                                   : _mm256_setzero_ps());
        float s[8];
        _mm256_storeu_ps(s, score8(qi, wi, kt, H, D, scale));
        for (int r = 0; r < m; r++) o[p0 + r] = s[r];
      }
    }
  }
  free(q);
  return bad ? -1 : 0;
}

/* A float's order as an unsigned key (larger value, larger key); both zeros the same key, so
 * their tie goes by position like any other; NaN the lowest key of all. */
static inline uint32_t order_key(float f) {
  uint32_t u;
  if (f != f) return 0;
  if (f == 0.0f) f = 0.0f;
  memcpy(&u, &f, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Of the digits (key >> shift) & mask of n keys, the highest bin whose count from the top
 * reaches *want; *want becomes the rank left within that bin. */
static uint32_t pick_bin(const uint32_t *keys, int64_t n, int shift, uint32_t mask,
                         int64_t *want) {
  int64_t hist[2048];
  memset(hist, 0, (mask + 1) * sizeof(int64_t));
  for (int64_t i = 0; i < n; i++) hist[(keys[i] >> shift) & mask]++;
  uint32_t b = mask;
  for (; b > 0 && hist[b] < *want; b--) *want -= hist[b];
  return b;
}

/* One row's selection among its first m positions (the ones it sees): all of them where m <= k
 * (their scores unread), else the k highest scores (NaN below every number), ties at the cut to
 * the lower positions; ascending. The k-th highest key is found 11, 11, then 10 bits at a time
 * (a radix select), each round over the keys left in the bin before: three passes over the
 * row in all, whatever its values. keys, cand: scratch of m keys each. */
static int64_t topk_row(const float *s, int64_t m, int k, int64_t *pos, uint32_t *keys,
                        uint32_t *cand) {
  if (m <= k) {
    for (int64_t l = 0; l < m; l++) pos[l] = l;
    return m;
  }
  for (int64_t l = 0; l < m; l++) keys[l] = order_key(s[l]);
  int64_t want = k; /* the rank of the k-th highest among the keys under the prefix */
  const uint32_t b1 = pick_bin(keys, m, 21, 2047, &want);
  int64_t n = 0;
  for (int64_t l = 0; l < m; l++)
    if (keys[l] >> 21 == b1) cand[n++] = keys[l];
  const uint32_t b2 = pick_bin(cand, n, 10, 2047, &want);
  int64_t n2 = 0;
  for (int64_t i = 0; i < n; i++)
    if (((cand[i] >> 10) & 2047) == b2) cand[n2++] = cand[i];
  const uint32_t cut = b1 << 21 | b2 << 10 | pick_bin(cand, n2, 0, 1023, &want);
  /* every key above the cut, and `want` of those equal to it, the first ones */
  int64_t c = 0;
  for (int64_t l = 0; l < m; l++)
    if (keys[l] > cut || (keys[l] == cut && want-- > 0)) pos[c++] = l;
  return c;
}

/* scores [n, L] fp32 (NULL where no row sees more than k), lens [n] (row i sees its first
 * lens[i] positions) -> pos [n, k] int64 (each row's first count[i] entries: its selection,
 * ascending; the rest 0) and count [n] int64. The rule both DSA paths on afd's kernels select
 * by (sparse_attention.py, the fused layer below), so they read the same rows; torch's topk
 * breaks ties its own way. Returns 0, or -1 for k < 1, a length outside [0, L] (above k
 * without scores) or memory short. */
int afd_topk_positions(const float *scores, int n, int64_t L, int k, const int64_t *lens,
                       int64_t *pos, int64_t *count, int threads) {
  if (k < 1) return -1;
  for (int i = 0; i < n; i++)
    if (lens[i] < 0 || lens[i] > L || (!scores && lens[i] > k)) return -1;
  int bad = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 1) reduction(| : bad)
  {
    uint32_t *keys = (uint32_t *)malloc((size_t)L * 2 * sizeof(uint32_t));
    bad = !keys;
#pragma omp for schedule(static)
    for (int i = 0; i < n; i++) {
      if (!keys) continue;
      int64_t *p = pos + (size_t)i * k;
      int64_t c = topk_row(scores + (size_t)i * L, lens[i], k, p, keys, keys + L);
      for (int64_t j = c; j < k; j++) p[j] = 0;
      count[i] = c;
    }
    free(keys);
  }
  return bad ? -1 : 0;
}

static int by_value(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* the indexer's w_q or w_k, bf16 or block-FP8 (ix->f8_<name>) */
#define GEMM_W(x, name, y, M, N, K)                                                           \
  afd_gemm_w(x, ix->w_##name, ix->f8_##name.q, ix->f8_##name.s, (int)ix->bk, y, M, N, K,      \
             threads, isa)

int afd_bf16_layer_norm(const uint16_t *x, long sa, const uint16_t *w, const uint16_t *b,
                        uint16_t *y, int A, int D, float eps);

/* A decode micro-batch's selection, as sparse_attention.py's DSA.index_query and select
 * compute it op by op (the same kernels, so the same rows): from the attention's normed input
 * xn [T, H] and the normalised query latent ql [T, qr],
 *   q = rope(ql @ w_q^T) per head [T, heads, dim]; [k | weights] = xn @ w_k^T
 *   k = rope(layer_norm(k)), written at each token's slot of index_cache [NB, bs, dim]
 *   score[l] = weight_scale * sum_h weights_h relu(score_scale q_h . k_l), for l < lens[t]
 * RoPE (half-split) turns each head's first dr values. A row with no more than K positions
 * keeps them all; where every row does, the query and the scores are not computed. Out:
 * table [T, K] int64 (K = min(topk, nb * bs)), each row's selected slots ascending in its
 * first counts[t] entries (the rest NB * bs, never read), counts [T]. Returns 0, or -1 (bad
 * sizes, memory short, a slot or block outside the pools, a row with nothing to attend). */
int afd_dsa_decode_select(const afd_indexer *ix, const uint16_t *xn, const uint16_t *ql, int H,
                          int qr, int dr, const uint16_t *cos, const uint16_t *sin,
                          const int64_t *pos, const int64_t *slots, uint16_t *index_cache,
                          const int64_t *blocks, const int64_t *lens, int T, int NB, int bs,
                          int nb, int threads, int isa, int64_t *table, int64_t *counts) {
  const int hI = (int)ix->heads, Di = (int)ix->dim, W = Di + hI, Q = hI * Di;
  const int64_t L = (int64_t)nb * bs, rows = (int64_t)NB * bs;
  const int K = ix->topk < L ? (int)ix->topk : (int)L;
  if (Di % 8 || Di > 256 || dr % 16 || dr > Di || qr <= 0 || K < 1) return -1;
  uint16_t *q = (uint16_t *)afd_alloc64((size_t)T * Q * 2);
  uint16_t *kw = (uint16_t *)afd_alloc64((size_t)T * W * 2);
  uint16_t *kn = (uint16_t *)afd_alloc64((size_t)T * Di * 2);
  float *wf = (float *)afd_alloc64((size_t)T * hI * 4);
  float *scores = (float *)afd_alloc64((size_t)T * L * 4);
  int64_t *sel = (int64_t *)afd_alloc64((size_t)T * K * 8);
  int rc = -1;
  if (!q || !kw || !kn || !wf || !scores || !sel) goto done;
  int scored = 0; /* a row with more positions than it keeps: the scores choose */
  for (int t = 0; t < T; t++) {
    if (slots[t] < 0 || slots[t] >= rows || lens[t] < 1 || lens[t] > L) goto done;
    scored |= lens[t] > K;
  }
  if (GEMM_W(xn, k, kw, T, W, H)) goto done;
  if (afd_bf16_layer_norm(kw, W, ix->k_norm, ix->k_bias, kn, T, Di, (float)ix->norm_eps))
    goto done;
  if (afd_bf16_rope_heads(kn, Di, Di, kn, Di, Di, T, 1, dr, cos, sin, pos, threads, isa))
    goto done;
  for (int t = 0; t < T; t++)
    memcpy(index_cache + (size_t)slots[t] * Di, kn + (size_t)t * Di, (size_t)Di * 2);
  if (scored) {
    if (GEMM_W(ql, q, q, T, Q, qr)) goto done;
    if (afd_bf16_rope_heads(q, Q, Di, q, Q, Di, T, hI, dr, cos, sin, pos, threads, isa))
      goto done;
    const float wscale = (float)ix->weight_scale;
    for (int t = 0; t < T; t++)
      for (int h = 0; h < hI; h++)
        wf[t * hI + h] = bf16_value(kw[(size_t)t * W + Di + h]) * wscale;
    if (afd_bf16_index_scores(q, wf, index_cache, blocks, 0, scores, T, hI, Di, NB, nb, bs,
                              (float)ix->score_scale, threads, isa))
      goto done;
  } /* else every row keeps all its positions: topk_row does not read their scores */
  if (afd_topk_positions(scores, T, L, K, lens, sel, counts, threads)) goto done;
  for (int t = 0; t < T; t++) {
    int64_t *row = table + (size_t)t * K;
    const int64_t *p = sel + (size_t)t * K, *bt = blocks + (size_t)t * nb;
    for (int64_t j = 0; j < counts[t]; j++) row[j] = bt[p[j] / bs] * bs + p[j] % bs;
    qsort(row, (size_t)counts[t], sizeof(int64_t), by_value);
    for (int64_t j = counts[t]; j < K; j++) row[j] = rows;
    if (counts[t] < 1) goto done;
  }
  rc = 0;
done:
  free(q), free(kw), free(kn), free(wf), free(scores), free(sel);
  return rc;
}
