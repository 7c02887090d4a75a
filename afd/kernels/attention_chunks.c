/* Paged decode attention on the amx path (attention.c hands it the call where a K/V head has
 * 8 query heads or more and D and Dv are multiples of 32): the scores and the values on tiles
 * (attention_amx.c), the softmax softmax.h's steps, the other paths' roundings.
 *
 * A row's softmax sum and its values are summed per chunk of SPLIT positions and the chunks
 * then added in order, so the work splits by chunk as well as by sequence and K/V head (one
 * sequence's latent shared between threads instead of read whole by each), and the bits
 * depend on the chunks only, never on the threads or the batch. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attention_amx.h"
#include "bf16_512.h"
#include "softmax.h"

/* Positions a work item covers: a row's softmax sum and its values are summed a chunk at a
 * time, and the chunks' sums then added in order, so the bits depend on this, never on the
 * threads (a multiple of AFD_ATTN_AMX_VCHUNK). */
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
  const uint16_t *q = d->q + (((size_t)b * d->kvh + h) * d->g + j0) * d->D;
  afd_attn_amx_scores(q, d->k_cache + h * d->head, k.rows, k.n, gj, d->D, d->scale, k.s + k.l0,
                      k.L, ts);
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
  afd_attn_amx_values(k.s + k.l0, k.L, k.n, gj, d->Dv, d->v_cache + h * d->head, k.rows,
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
  const int gs = split ? afd_attn_head_group(g, N, t) : g, G = (g + gs - 1) / gs;
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
      for (int c = 0; c < d.chunks[b]; c++, u++)
        unit[3 * u] = b, unit[3 * u + 1] = h, unit[3 * u + 2] = c;
  if (!failed) {
#pragma omp parallel num_threads(t) if (t > 1)
    {
      void *ts = afd_alloc64(AFD_ATTN_AMX_SCORES_SCRATCH(gs, D));
      void *vs = afd_alloc64(AFD_ATTN_AMX_VALUES_SCRATCH(gs, SPLIT, Dv));
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
