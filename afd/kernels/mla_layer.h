/* The fused MLA decode layer's weights (mla_layer.c), shared with the decode stack
 * (decode_stack.c), which runs it for MLA layers. */
#ifndef AFD_MLA_LAYER_H
#define AFD_MLA_LAYER_H
#include <stdint.h>

#include "fp8_gemm.h"
#include "indexer.h"

/* mla_layer.py's MLALayer: the same fields in the same order. Matmul weights laid out for the
 * call's isa, or block-FP8 (w_a, w_qb, w_o); w_uk [nh, r, dn] and w_uv [nh, dv, r] head by head
 * (heads.c). */
typedef struct {
  const uint16_t *attn_norm, *ffn_norm; /* [H] */
  const uint16_t *w_a;                  /* [q_in + r + dr, H] */
  const uint16_t *q_a_norm;             /* [qr], or NULL: no query rank */
  const uint16_t *w_qb;                 /* [nh (dn + dr), qr], or NULL */
  const uint16_t *kv_a_norm;            /* [r] */
  const uint16_t *w_uk, *w_uv, *w_o;    /* w_o [H, nh dv] */
  const uint16_t *w_router;             /* [E, H] or NULL */
  const float *router_bias;             /* [E] or NULL: the routing's selection bias */
  const afd_indexer *ix;                /* DSA's indexer (its layer attends to the rows it
                                           selects), or NULL */
  int64_t H, qr, nh, dn, dr, r, dv, E;
  int64_t topk, norm, route, groups, topk_groups; /* topk 0: the caller routes */
  double eps, latent_eps; /* the model's, and the latent norms' own */
  double scaling;         /* on the routing weights */
  afd_fp8_ref f8_a, f8_qb, f8_o; /* block-FP8 w_a, w_qb, w_o (q NULL: bf16, above) */
  int64_t bk;                     /* their K-block */
} afd_mla_layer;

int afd_bf16_mla_decode_layer(const afd_mla_layer *L, const uint16_t *h, uint16_t *h_out,
                              uint16_t *x_out, const uint16_t *cos, const uint16_t *sin,
                              const int64_t *pos, const int64_t *slots, uint16_t *cache,
                              uint16_t *index_cache, const int64_t *blocks,
                              const int64_t *lens, int T, int NB, int bs, int nb, float scale,
                              int threads, int isa, uint16_t *logits, int32_t *ids,
                              float *weights);
#endif
