/* DeepSeek Sparse Attention's lightning indexer in native calls (indexer.c): its scores, the
 * top-k selection both decode paths share, and a decode micro-batch's whole selection for the
 * fused MLA layer (mla_layer.c), which then attends over the selected latent rows only. */
#ifndef AFD_INDEXER_H
#define AFD_INDEXER_H
#include <stdint.h>

#include "fp8_gemm.h"

/* indexer.py's Indexer: the same fields in the same order. w_q and w_k laid out for the call's
 * isa, as ops.Linear lays them out for that path. */
typedef struct {
  const uint16_t *w_q;            /* [heads * dim, qr]: from the normalised query latent */
  const uint16_t *w_k;            /* [dim + heads, H]: the key, then the heads' weights */
  const uint16_t *k_norm, *k_bias; /* [dim]: the key's LayerNorm */
  int64_t heads, dim, topk;
  double weight_scale; /* on the heads' weights (heads^-0.5) */
  double score_scale;  /* on each head's q . k (dim^-0.5) */
  double norm_eps;     /* the LayerNorm's */
  afd_fp8_ref f8_q, f8_k; /* block-FP8 w_q, w_k (q NULL: bf16, above) */
  int64_t bk;             /* their K-block */
} afd_indexer;

int afd_topk_positions(const float *scores, int n, int64_t L, int k, const int64_t *lens,
                       int64_t *pos, int64_t *count, int threads);
int afd_bf16_index_scores(const uint16_t *qb, const float *w, const uint16_t *pool,
                          const int64_t *blocks, int shared, float *out, int n, int H, int D,
                          int NB, int nb, int bs, float scale, int threads, int isa);
int afd_dsa_decode_select(const afd_indexer *ix, const uint16_t *xn, const uint16_t *ql, int H,
                          int qr, int dr, const uint16_t *cos, const uint16_t *sin,
                          const int64_t *pos, const int64_t *slots, uint16_t *index_cache,
                          const int64_t *blocks, const int64_t *lens, int T, int NB, int bs,
                          int nb, int threads, int isa, int64_t *table, int64_t *counts);
#endif
