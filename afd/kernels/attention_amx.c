/* Paged decode attention on AMX tiles (attention.c hands it the whole call on the amx path
 * where a K/V head has 8 query heads or more and D and Dv are multiples of 32):
 *   scores: s[j, l] = bf16(q_j . k_l) * scale, 16 positions and 16 heads a tile product;
 *   softmax: softmax.h's steps, the other paths' roundings;
 *   values: o[j] = bf16(sum_l p[j, l] v_l), 16 heads and 16 columns of V a tile product.
 *
 * Scores: one TDPBF16PS takes 16 positions' K rows (32 values of D each: the A operand,
 * row-major as the cache holds them) against every query head at once (the B operand: q with
 * pairs of D interleaved, a column per head, packed once per call), so a position costs D / 32
 * tile products shared by all the heads, where attention512.c spends D / 32 vdpbf16ps and a
 * share of a 16-way sum tree per head. Values: the heads' bf16 probabilities are the A
 * operand's rows (32 positions each), V the B operand, 256 positions at a time packed with
 * position pairs interleaved, so V is read once for every 16 heads (attention512.c: every 4).
 * MLA (16 to 128 heads of 288 to 576 values a K/V head) is bound by these products; GQA's 4
 * heads of 64 are bound by reading K and V, and there the tiles were no faster in the engine
 * (docs/benchmarks.md), hence the 8-head floor.
 *
 * The sums are the tile's: each pair's products added in fp32, in the tile's order, so a score
 * may differ from attention512.c's in its last fp32 bits and, rarely, after its rounding to
 * bf16 (summation order only, as between the other paths); the values add a pair's products in
 * vdpbf16ps' order. A head's sums do not depend on its column, its row or the other heads.
 *
 * The work: a row's softmax sum and its values are summed per chunk of SPLIT positions and the
 * chunks then added in order, so it splits by chunk as well as by sequence and K/V head (one
 * sequence's latent shared between threads instead of read whole by each), and the bits depend
 * on the chunks only, never on the threads or the batch. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "attention_amx.h"
#include "bf16_512.h"
#include "softmax.h"

/* Bytes of scratch the scores need for g heads (64-byte aligned). */
#define SCORES_SCRATCH(g, D) ((((size_t)(g) + 15) / 16 * ((size_t)(D) / 32) + 5) * 1024)

/* Positions a values pass packs at a time (a multiple of 32): their V rows, pairs interleaved,
 * stay in L2 while every head's tiles read them. */
#define VCHUNK 256

/* Bytes of scratch the values need for g heads, len positions and Dv columns. */
#define VALUES_SCRATCH(g, len, Dv)                                                             \
  ((((size_t)(g) + 15) / 16 * 16 * (((size_t)(len) + 31) / 32 * 32) * 2 +                     \
    (size_t)VCHUNK * (Dv) * 2 + ((size_t)(g) + 15) / 16 * 16 * (Dv) * 4 + 3 * 64))

/* The K rows of the tile K_AHEAD_AMX tiles on are fetched into L1 as a tile is multiplied
 * (without, the tile loads waited on every row; into L2 they still did, Intel Xeon harness) */
#define K_AHEAD_AMX 2

/* The values pass fetches V rows this many position pairs ahead as it packs them, into L1 */
#define V_AHEAD_AMX 16

/* q [g, D] as B operands, one 1 KiB tile per 16 heads and 32 values of D: tile (t, c), row
 * p, column n holds q[16t + n][32c + 2p], q[16t + n][32c + 2p + 1] (zeros past head g). */
static AMX void pack_q(const uint16_t *q, int g, int D, uint32_t *qp) {
  const int C = D / 32, H = (g + 15) / 16;
  memset(qp, 0, (size_t)H * C * 1024);
  for (int j = 0; j < g; j++) {
    const uint32_t *pairs = (const uint32_t *)(q + (size_t)j * D);
    uint32_t *tile = qp + (size_t)(j / 16) * C * 256;
    for (int c = 0; c < C; c++)
      for (int p = 0; p < 16; p++) tile[(size_t)c * 256 + p * 16 + j % 16] = pairs[c * 16 + p];
  }
}

/* The 16 positions' rows from l0 (n of them), columns 32c.. as an A tile in tmm4: in place
 * where direct, else through rows (zeros past n). */
static inline AMX void load_k(const uint16_t *cache, const int64_t *row, int l0, int n, int c,
                              int D, int direct, uint16_t *rows) {
  if (direct) {
    _tile_loadd(4, cache + row[l0] + 32 * c, D * 2);
    return;
  }
  for (int i = 0; i < 16; i++)
    if (i < n)
      memcpy(rows + 32 * i, cache + row[l0 + i] + 32 * c, 64);
    else
      memset(rows + 32 * i, 0, 64);
  _tile_loadd(4, rows, 64);
}

static AMX void scores(const uint16_t *q, const uint16_t *cache, const int64_t *row, int len,
                       int g, int D, float scale, float *s, int ld, void *scratch) {
  const int C = D / 32, H = (g + 15) / 16;
  uint32_t *qp = (uint32_t *)scratch;                             /* H C KiB: q packed */
  uint16_t *rows = (uint16_t *)((char *)scratch + H * C * 1024); /* 1 KiB: K rows copied */
  float *sums = (float *)((char *)scratch + (H * C + 1) * 1024);  /* 4 KiB: 4 tiles of sums */
  const __m256 vscale = _mm256_set1_ps(scale);
  pack_q(q, g, D, qp);
  afd_amx_configure();
  for (int l0 = 0; l0 < len; l0 += 16) {
    const int n = len - l0 < 16 ? len - l0 : 16;
    /* 16 rows each D values after the last (one block, or blocks that follow each other):
     * loaded in place; otherwise (the last few positions, or blocks apart) copied first */
    int direct = n == 16;
    for (int i = 1; i < 16 && direct; i++) direct = row[l0 + i] == row[l0] + (int64_t)i * D;
    const int ahead = l0 + 16 * K_AHEAD_AMX, na = len - ahead < 16 ? len - ahead : 16;
    /* up to 4 tiles of 16 heads at a time (tmm0-3), each K tile used by all of them (a set
     * after the first reads its K rows from L1) */
    for (int t0 = 0; t0 < H; t0 += 4) {
      const int k = H - t0 < 4 ? H - t0 : 4;
      const uint32_t *qt = qp + (size_t)t0 * C * 256;
      afd_amx_zero_sums();
      for (int c = 0; c < C; c++) {
        if (t0 == 0) /* the rows ahead, a column of lines at a time between the products */
          for (int i = 0; i < na; i++)
            _mm_prefetch((const char *)(cache + row[ahead + i] + 32 * c), _MM_HINT_T0);
        load_k(cache, row, l0, n, c, D, direct, rows);
        _tile_loadd(6, qt + (size_t)c * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (k > 1) {
          _tile_loadd(7, qt + (size_t)(C + c) * 256, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (k > 2) {
          _tile_loadd(6, qt + (size_t)(2 * C + c) * 256, 64);
          _tile_dpbf16ps(2, 4, 6);
        }
        if (k > 3) {
          _tile_loadd(7, qt + (size_t)(3 * C + c) * 256, 64);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
      _tile_stored(0, sums, 64);
      if (k > 1) _tile_stored(1, sums + 256, 64);
      if (k > 2) _tile_stored(2, sums + 512, 64);
      if (k > 3) _tile_stored(3, sums + 768, 64);
      const int j1 = g < 16 * (t0 + k) ? g : 16 * (t0 + k);
      for (int j = 16 * t0; j < j1; j++) { /* head j's column: its 16 positions' sums */
        __m512 r = afd_amx_column(sums + (j / 16 - t0) * 256, j % 16);
        __m256 lo = _mm256_mul_ps(round8(_mm512_castps512_ps256(r)), vscale);
        __m256 hi = _mm256_mul_ps(round8(_mm512_extractf32x8_ps(r, 1)), vscale);
        __m512 out = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
        _mm512_mask_storeu_ps(s + (size_t)j * ld + l0, (__mmask16)((1u << n) - 1), out);
      }
    }
  }
  _tile_release();
}

/* Word i of the interleave of two 32-value rows a, b: a[i / 2] where i is even, b[i / 2] where
 * odd, for columns 0..15 (LO) and 16..31 (HI); indices past 31 pick from b. */
static const uint16_t INTERLEAVE[64] = {
    0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
    11, 43, 12, 44, 13, 45, 14, 46, 15, 47, 16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
    22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

/* The V rows of positions l0 .. l0 + n - 1 as B operands: tile (s, t) (1 KiB at vp + (s T + t)
 * KiB, T = Dv / 16) holds positions l0 + 32s .. + 31 and columns 16t .. 16t + 15, its row r
 * the pair l0 + 32s + 2r, + 1: column k holds v[2r][16t + k] and v[2r + 1][16t + k], the pair a
 * TDPBF16PS multiplies with a head's two probabilities. Pairs past n are zeros (a zero
 * probability times whatever V held could be NaN). */
static AMX void pack_v(const uint16_t *cache, const int64_t *row, int l0, int n, int len, int Dv,
                       uint32_t *vp) {
  const int T = Dv / 16, S = (n + 31) / 32;
  const __m512i lo = _mm512_loadu_si512((const void *)INTERLEAVE);
  const __m512i hi = _mm512_loadu_si512((const void *)(INTERLEAVE + 32));
  const __m512i zero = _mm512_setzero_si512();
  for (int q = 0; q < 16 * S; q++) {
    const int l = l0 + 2 * q;
    const uint16_t *r0 = 2 * q < n ? cache + row[l] : NULL;
    const uint16_t *r1 = 2 * q + 1 < n ? cache + row[l + 1] : NULL;
    const uint16_t *f0 = l + 2 * V_AHEAD_AMX < len ? cache + row[l + 2 * V_AHEAD_AMX] : NULL;
    const uint16_t *f1 = l + 2 * V_AHEAD_AMX + 1 < len ? cache + row[l + 2 * V_AHEAD_AMX + 1] : NULL;
    uint32_t *dst = vp + (size_t)(q / 16) * T * 256 + (q % 16) * 16;
    for (int c = 0; c < Dv / 32; c++) {
      if (f0) _mm_prefetch((const char *)(f0 + 32 * c), _MM_HINT_T0); /* the pair ahead, */
      if (f1) _mm_prefetch((const char *)(f1 + 32 * c), _MM_HINT_T0); /* a line at a time */
      __m512i a = r0 ? _mm512_loadu_si512((const void *)(r0 + 32 * c)) : zero;
      __m512i b = r1 ? _mm512_loadu_si512((const void *)(r1 + 32 * c)) : zero;
      _mm512_store_si512((void *)(dst + (size_t)(2 * c) * 256), _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512((void *)(dst + (size_t)(2 * c + 1) * 256),
                         _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

static AMX void values(const float *p, int ld, int len, int g, int Dv, const uint16_t *cache,
                       const int64_t *row, float *out, void *scratch) {
  const int H = (g + 15) / 16, P = (len + 31) / 32 * 32, T = Dv / 16;
  /* the probabilities as bf16 A operands [16 H, P]: zeros past len and past head g */
  uint16_t *pb = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  uint32_t *vp = (uint32_t *)(pb + (size_t)16 * H * P); /* a chunk of V, packed */
  float *acc = (float *)(vp + (size_t)VCHUNK * Dv / 2); /* [16 H, Dv] sums */
  for (int j = 0; j < 16 * H; j++) { /* p holds bf16 values already: their top halves, exactly */
    const uint32_t *pj = (const uint32_t *)(p + (size_t)j * ld);
    uint16_t *bj = pb + (size_t)j * P;
    int l = 0;
    if (j < g)
      for (; l < len; l++) bj[l] = (uint16_t)(pj[l] >> 16);
    memset(bj + l, 0, (size_t)(P - l) * sizeof(uint16_t));
  }
  afd_amx_configure();
  for (int l0 = 0; l0 < len; l0 += VCHUNK) {
    const int n = len - l0 < VCHUNK ? len - l0 : VCHUNK;
    const int S = (n + 31) / 32;
    pack_v(cache, row, l0, n, len, Dv, vp);
    /* 2 x 2 tiles of sums (tmm0-3: heads 16t.., 16(t + 1).., columns 16c.., 16(c + 1)..),
     * carried from chunk to chunk in acc (stored and loaded exactly, in fp32) */
    for (int t = 0; t < H; t += 2) {
      const int two = t + 1 < H;
      const uint16_t *a0 = pb + (size_t)16 * t * P + l0, *a1 = a0 + (size_t)16 * P;
      for (int c = 0; c < T; c += 2) {
        float *s0 = acc + (size_t)16 * t * Dv + 16 * c, *s1 = s0 + (size_t)16 * Dv;
        if (l0 == 0) {
          afd_amx_zero_sums();
        } else {
          _tile_loadd(0, s0, Dv * 4);
          _tile_loadd(1, s0 + 16, Dv * 4);
          if (two) {
            _tile_loadd(2, s1, Dv * 4);
            _tile_loadd(3, s1 + 16, Dv * 4);
          }
        }
        for (int s = 0; s < S; s++) {
          const uint32_t *b = vp + ((size_t)s * T + c) * 256;
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 256, 64);
          _tile_loadd(4, a0 + 32 * s, P * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, a1 + 32 * s, P * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, s0, Dv * 4);
        _tile_stored(1, s0 + 16, Dv * 4);
        if (two) {
          _tile_stored(2, s1, Dv * 4);
          _tile_stored(3, s1 + 16, Dv * 4);
        }
      }
    }
  }
  _tile_release();
  memcpy(out, acc, (size_t)g * Dv * sizeof(float));
}

/* Positions a work item covers: a row's softmax sum and its values are summed a chunk at a
 * time, and the chunks' sums then added in order, so the bits depend on this, never on the
 * threads (a multiple of VCHUNK). */
#define SPLIT 1024

/* out [n] <- bf16(p[0] + p[1] + ... + p[C - 1]) for C chunks' values p [C, n], n % 16 == 0 */
static AVX512 void sum_chunks(const float *p, int C, int n, uint16_t *out) {
  for (int i = 0; i < n; i += 16) {
    __m512 acc = _mm512_loadu_ps(p + i);
    for (int k = 1; k < C; k++) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + (size_t)k * n + i));
    store16(out + i, round16(acc));
  }
}

/* The largest of a row's chunk maxima (and its sink), as one pass over the row finds it. */
static inline float row_max(const float *mx, int C, const float *sink) {
  float m = mx[0];
  for (int c = 1; c < C; c++) m = mx[c] > m ? mx[c] : m;
  if (sink) m = *sink > m ? *sink : m;
  return m;
}

/* One decode call's shape. Per sequence b: its first visible position, visible length and
 * chunks, and where its row offsets lie in rows (offsets in a K/V head's share, the same for
 * every head) and, where the work splits by chunk, its buffers in the call's (soff, moff, poff:
 * bufs_t's for each K/V head in turn). */
typedef struct {
  const uint16_t *q, *k_cache, *v_cache;
  const float *sinks;
  int kvh, g, D, Dv;
  size_t head; /* a K/V head's share of a cache, in elements */
  float scale;
  int *first, *len, *chunks;
  size_t *roff, *soff, *moff, *poff;
  int64_t *rows;
  float *s, *mx, *sm, *part; /* the call's buffers, where the work splits by chunk */
} decode_t;

/* One (sequence, K/V head)'s working memory: s [g, L] the scores, then the probabilities; mx
 * and sm [g, C] each row's chunk maxima and sums; part [C, g, Dv] each chunk's values. */
typedef struct {
  float *s, *mx, *sm, *part;
} bufs_t;

static bufs_t call_bufs(const decode_t *d, int b, int h) {
  const size_t L = d->len[b], C = d->chunks[b], g = d->g;
  return (bufs_t){d->s + d->soff[b] + h * g * L, d->mx + d->moff[b] + h * g * C,
                  d->sm + d->moff[b] + h * g * C, d->part + d->poff[b] + h * C * g * d->Dv};
}

/* Chunk c of sequence b, K/V head h, from query head j0: what each step below reads. */
typedef struct {
  int C, L, l0, n;
  float *s;            /* head j0's row of scores or probabilities */
  float *mx, *sm;      /* head j0's chunk maxima and sums [C] */
  const float *sink;   /* head j0's sink, or NULL */
  const int64_t *rows; /* the chunk's row offsets */
} chunk_t;

static chunk_t chunk(const decode_t *d, bufs_t w, int b, int h, int c, int j0) {
  chunk_t k;
  k.C = d->chunks[b], k.L = d->len[b], k.l0 = c * SPLIT;
  k.n = k.L - k.l0 < SPLIT ? k.L - k.l0 : SPLIT;
  k.s = w.s + (size_t)j0 * k.L;
  k.mx = w.mx + (size_t)j0 * k.C, k.sm = w.sm + (size_t)j0 * k.C;
  k.sink = d->sinks ? d->sinks + (size_t)h * d->g + j0 : NULL;
  k.rows = d->rows + d->roff[b] + k.l0;
  return k;
}

/* the chunk's scores and each row's max over them, for query heads j0 .. j0 + gj - 1 */
static void step_scores(const decode_t *d, bufs_t w, int b, int h, int c, int j0, int gj,
                        void *ts) {
  const chunk_t k = chunk(d, w, b, h, c, j0);
  scores(d->q + (((size_t)b * d->kvh + h) * d->g + j0) * d->D, d->k_cache + h * d->head, k.rows,
         k.n, gj, d->D, d->scale, k.s + k.l0, k.L, ts);
  for (int j = 0; j < gj; j++)
    k.mx[(size_t)j * k.C + c] = softmax_max(k.s + (size_t)j * k.L + k.l0, k.n);
}

/* exp(s - the row's max over every chunk) and the chunk's sum */
static void step_exp(const decode_t *d, bufs_t w, int b, int h, int c, int j0, int gj) {
  const chunk_t k = chunk(d, w, b, h, c, j0);
  for (int j = 0; j < gj; j++) {
    const float m = row_max(k.mx + (size_t)j * k.C, k.C, k.sink ? k.sink + j : NULL);
    k.sm[(size_t)j * k.C + c] = softmax_exp_sum(k.s + (size_t)j * k.L + k.l0, k.n, m, 1);
  }
}

/* the chunk's probabilities (the chunks' sums added in order, then the sink's share) and its
 * values, in fp32 */
static void step_values(const decode_t *d, bufs_t w, int b, int h, int c, int j0, int gj,
                        void *vs) {
  const chunk_t k = chunk(d, w, b, h, c, j0);
  for (int j = 0; j < gj; j++) {
    const float *smj = k.sm + (size_t)j * k.C;
    float sum = smj[0];
    for (int i = 1; i < k.C; i++) sum += smj[i];
    if (k.sink) sum += softmax_exp1(k.sink[j] - row_max(k.mx + (size_t)j * k.C, k.C, k.sink + j));
    softmax_normalize(k.s + (size_t)j * k.L + k.l0, k.n, sum, 1);
  }
  values(k.s + k.l0, k.L, k.n, gj, d->Dv, d->v_cache + h * d->head, k.rows,
         w.part + ((size_t)c * d->g + j0) * d->Dv, vs);
}

/* out for sequence b, K/V head h: bf16(the chunks' values added in order) */
static void step_out(const decode_t *d, bufs_t w, int b, int h, uint16_t *out) {
  const int n = d->g * d->Dv;
  sum_chunks(w.part, d->chunks[b], n, out + ((size_t)b * d->kvh + h) * n);
}

int afd_attn_amx_decode(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int64_t *blocks, const int64_t *lens, uint16_t *out, int B,
                        int kvh, int g, int D, int Dv, int NB, int bs, int nb, float scale,
                        const float *sinks, int window, int threads) {
  const int t = threads > 1 ? threads : 1;
  decode_t d = {.q = q, .k_cache = k_cache, .v_cache = v_cache, .sinks = sinks, .kvh = kvh,
                .g = g, .D = D, .Dv = Dv, .head = (size_t)NB * bs * D, .scale = scale};
  d.first = malloc(B * sizeof(int)), d.len = malloc(B * sizeof(int));
  d.chunks = malloc(B * sizeof(int));
  d.roff = malloc(B * sizeof(size_t)), d.soff = malloc(B * sizeof(size_t));
  d.moff = malloc(B * sizeof(size_t)), d.poff = malloc(B * sizeof(size_t));
  int failed = !d.first || !d.len || !d.chunks || !d.roff || !d.soff || !d.moff || !d.poff;
  int N = 0, Lmax = 1, Cmax = 1; /* units: (sequence, K/V head, chunk) */
  size_t S = 0, R = 0, M = 0, P = 0;
  for (int b = 0; b < B && !failed; b++) {
    d.first[b] = window > 0 && lens[b] > window ? (int)lens[b] - window : 0;
    d.len[b] = (int)lens[b] - d.first[b];
    d.chunks[b] = (d.len[b] + SPLIT - 1) / SPLIT;
    d.roff[b] = R, d.soff[b] = S, d.moff[b] = M, d.poff[b] = P;
    R += d.len[b], S += (size_t)kvh * g * d.len[b], M += (size_t)kvh * g * d.chunks[b];
    P += (size_t)kvh * d.chunks[b] * g * Dv, N += kvh * d.chunks[b];
    Lmax = d.len[b] > Lmax ? d.len[b] : Lmax, Cmax = d.chunks[b] > Cmax ? d.chunks[b] : Cmax;
  }
  /* With a (sequence, K/V head) pair for every thread, a task is a pair and runs its chunks in
   * turn in its thread's buffers (its scores still in L2 for the softmax and the values). With
   * fewer, the work splits by chunk, each step for every chunk before the next step (it needs
   * every chunk's max, then every chunk's sum) in buffers for the whole call, and where there
   * are fewer chunks than threads by query heads as well (groups of a multiple of 4; a head's
   * arithmetic is the same in any group). The bits are the same either way. */
  const int split = B * kvh < t;
  int gs = g;
  if (split && N < t && g > 4) {
    const int want = (t + N - 1) / N;
    gs = ((g + want - 1) / want + 3) / 4 * 4;
    if (gs > g) gs = g;
  }
  const int G = (g + gs - 1) / gs;
  int *unit = malloc((size_t)3 * (N > 0 ? N : 1) * sizeof(int)); /* (b, h, c) of each unit */
  d.rows = malloc((R + 1) * sizeof(int64_t));
  if (split) {
    d.s = afd_alloc64((S + 8) * sizeof(float));
    d.mx = malloc((M + 1) * sizeof(float)), d.sm = malloc((M + 1) * sizeof(float));
    d.part = afd_alloc64((P + 16) * sizeof(float));
  }
  failed = failed || !unit || !d.rows || (split && (!d.s || !d.mx || !d.sm || !d.part));
  for (int b = 0, u = 0; b < B && !failed; b++)
    for (int h = 0; h < kvh; h++)
      for (int c = 0; c < d.chunks[b]; c++, u++) unit[3 * u] = b, unit[3 * u + 1] = h, unit[3 * u + 2] = c;
  if (!failed) {
#pragma omp parallel num_threads(t) if (t > 1)
    {
      void *ts = afd_alloc64(SCORES_SCRATCH(gs, D));
      void *vs = afd_alloc64(VALUES_SCRATCH(gs, SPLIT, Dv));
      bufs_t own = {0}; /* a task's buffers, where a task is a pair */
      if (!split) {
        own.s = afd_alloc64(((size_t)g * Lmax + 8) * sizeof(float));
        own.mx = malloc((size_t)g * Cmax * sizeof(float));
        own.sm = malloc((size_t)g * Cmax * sizeof(float));
        own.part = afd_alloc64(((size_t)Cmax * g * Dv + 16) * sizeof(float));
      }
      const int ok = ts && vs && (split || (own.s && own.mx && own.sm && own.part));
      if (!ok) {
#pragma omp atomic write
        failed = 1;
      }
#pragma omp for schedule(static)
      for (int b = 0; b < B; b++)
        for (int l = 0; l < d.len[b]; l++) {
          const int pos = d.first[b] + l;
          d.rows[d.roff[b] + l] = (blocks[(size_t)b * nb + pos / bs] * bs + pos % bs) * D;
        }
      if (!split) {
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < B * kvh; it++) {
          const int b = it / kvh, h = it % kvh, C = d.chunks[b];
          if (!ok) continue;
          /* the first rows of K (every line) before the scores start, and of a sequence longer
           * than 512 positions V's too, so they arrive during the scores instead of stalling
           * the values (harness, Intel Xeon, 8 heads of 128 a K/V head: 1.10x at 4,096
           * positions, 1.02-1.06x at 8 x 1,024; with V's rows for 32 x 256 as well 0.97-0.99x) */
          const int64_t *r = d.rows + d.roff[b];
          for (int l = 0; l < 32 && l < d.len[b]; l++)
            for (int o = 0; o < D * 2; o += 64) {
              const size_t at = h * d.head + r[l];
              if (l < 16) _mm_prefetch((const char *)(k_cache + at) + o, _MM_HINT_T0);
              if (o < Dv * 2 && d.len[b] > 512)
                _mm_prefetch((const char *)(v_cache + at) + o, _MM_HINT_T1);
            }
          for (int c = 0; c < C; c++) step_scores(&d, own, b, h, c, 0, g, ts);
          for (int c = 0; c < C; c++) step_exp(&d, own, b, h, c, 0, g);
          for (int c = 0; c < C; c++) step_values(&d, own, b, h, c, 0, g, vs);
          step_out(&d, own, b, h, out);
        }
      } else {
        /* an item: unit it / G, its query heads from j0 = it % G * gs */
#define ITEM_ARGS(it) &d, call_bufs(&d, unit[3 * ((it) / G)], unit[3 * ((it) / G) + 1]),       \
                      unit[3 * ((it) / G)], unit[3 * ((it) / G) + 1], unit[3 * ((it) / G) + 2], \
                      (it) % G * gs, g - (it) % G * gs < gs ? g - (it) % G * gs : gs
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < N * G; it++)
          if (ok) step_scores(ITEM_ARGS(it), ts);
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < N * G; it++)
          if (ok) step_exp(ITEM_ARGS(it));
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < N * G; it++)
          if (ok) step_values(ITEM_ARGS(it), vs);
#undef ITEM_ARGS
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < B * kvh; it++)
          step_out(&d, call_bufs(&d, it / kvh, it % kvh), it / kvh, it % kvh, out);
      }
      free(ts), free(vs), free(own.s), free(own.mx), free(own.sm), free(own.part);
    }
  }
  free(d.first), free(d.len), free(d.chunks), free(d.roff), free(d.soff), free(d.moff);
  free(d.poff), free(unit), free(d.rows), free(d.s), free(d.mx), free(d.sm), free(d.part);
  return failed ? -1 : 0;
}
