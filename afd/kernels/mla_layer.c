/* One DeepSeek MLA attention layer of a decode-only micro-batch in a single native call (loaded
 * with ctypes by afd/kernels/mla_layer.py), in the absorbed form that services/attention/kinds/
 * mla.py computes op by op:
 *
 *   xn = rms_norm(h, attn_norm)
 *   a  = xn @ w_a^T = [q_in | latent | k_pe]      q_in: the query rank qr (or nh (dn + dr))
 *   q  = rms_norm(q_in, q_a_norm) @ w_qb^T        (q_in itself where there is no query rank)
 *   the cache row at each token's slot = [rms_norm(latent, kv_a_norm), rope(k_pe)]
 *   each head's absorbed query = [q_nope @ W_UK_h, rope(q_pe)]      width r + dr
 *   o_h = paged decode attention over the latent rows (V = their first r values); with DSA's
 *         indexer (ix), over the rows it selects only (indexer.c: afd_dsa_decode_select)
 *   v_h = o_h @ W_UV_h;  h' = bf16(h + v @ w_o^T);  x = rms_norm(h', ffn_norm)
 *   with w_router: logits = x @ w_router^T, and with topk > 0 the routing (decode_layer.c's
 *   afd_route_rows: DeepSeek's sigmoid, selection bias and groups)
 *
 * The same kernels as the per-op path (gemm, norm_rope.c, heads.c, attention.c), so the same
 * bits; what it saves is the ~30 Python-level calls and tensors of a layer of that path. */
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "mla_layer.h"

int afd_route_rows(const uint16_t *logits, const float *bias, int T, int E, int k, int route,
                   int norm, int G, int kg, float scaling, int32_t *ids, float *w);

#define GEMM(x, w, y, M, N, K) afd_gemm_isa(x, w, y, M, N, K, threads, isa)
/* a projection that may be block-FP8 (L->f8_<name>) */
#define GEMM_W(x, name, y, M, N, K)                                                           \
  afd_gemm_w(x, L->w_##name, L->f8_##name.q, L->f8_##name.s, (int)L->bk, y, M, N, K, threads, \
             isa)

/* h [T, H] in; h_out, x_out [T, H] out. cos, sin [P, dr]; pos, slots [T]; cache [NB, bs, r + dr]
 * (the layer's one latent head); index_cache [NB, bs, ix->dim] where ix (else unused); blocks
 * [T, nb]; lens [T]; logits [T, E] out where w_router,
 * and ids [T, topk] int32, weights [T, topk] float32 where topk > 0 too. Returns 0; 1 where
 * the routing is left to the caller (a tie across a top-k cut; every other output written);
 * -1 (bad sizes, memory short, a length past the block table). */
int afd_bf16_mla_decode_layer(const afd_mla_layer *L, const uint16_t *h, uint16_t *h_out,
                              uint16_t *x_out, const uint16_t *cos, const uint16_t *sin,
                              const int64_t *pos, const int64_t *slots, uint16_t *cache,
                              uint16_t *index_cache, const int64_t *blocks,
                              const int64_t *lens, int T, int NB, int bs, int nb, float scale,
                              int threads, int isa, uint16_t *logits, int32_t *ids,
                              float *weights) {
  const int H = (int)L->H, qr = (int)L->qr, nh = (int)L->nh, dn = (int)L->dn, dr = (int)L->dr;
  const int r = (int)L->r, dv = (int)L->dv, hd = dn + dr, D = r + dr;
  const int q_in = qr ? qr : nh * hd, A = q_in + r + dr;
  const float eps = (float)L->eps, leps = (float)L->latent_eps;
  if (T <= 0 || H % 8 || r % 8 || dn % 8 || dv % 8 || dr % 16 || q_in % 8) return -1;
  if (qr && !(L->q_a_norm && (L->w_qb || L->f8_qb.q))) return -1;
  uint16_t *xn = (uint16_t *)afd_alloc64((size_t)T * H * 2);
  uint16_t *a = (uint16_t *)afd_alloc64((size_t)T * A * 2);
  uint16_t *ql = qr ? (uint16_t *)afd_alloc64((size_t)T * qr * 2) : NULL;
  uint16_t *qb = qr ? (uint16_t *)afd_alloc64((size_t)T * nh * hd * 2) : NULL;
  uint16_t *qa = (uint16_t *)afd_alloc64((size_t)T * nh * D * 2); /* the absorbed queries */
  uint16_t *att = (uint16_t *)afd_alloc64((size_t)T * nh * r * 2);
  uint16_t *o = (uint16_t *)afd_alloc64((size_t)T * nh * dv * 2);
  /* the attention's rows: the block table, or DSA's selection as one-row blocks */
  const int64_t L_ix = (int64_t)nb * bs, K_ix = L->ix && L->ix->topk < L_ix ? L->ix->topk : L_ix;
  int64_t *table = L->ix ? (int64_t *)afd_alloc64((size_t)T * K_ix * 8) : NULL;
  int64_t *counts = L->ix ? (int64_t *)afd_alloc64((size_t)T * 8) : NULL;
  int rc = -1;
  if (!xn || !a || (qr && (!ql || !qb)) || !qa || !att || !o) goto done;
  if (L->ix && (!table || !counts || !qr || !index_cache)) goto done;
  if (afd_bf16_rms_norm(h, H, 0, L->attn_norm, xn, T, 1, H, eps, threads, isa)) goto done;
  if (GEMM_W(xn, a, a, T, A, H)) goto done;
  /* this step's cache rows: the normed latent, then the rotary key */
  for (int t = 0; t < T; t++) {
    uint16_t *row = cache + (size_t)slots[t] * D;
    const uint16_t *src = a + (size_t)t * A + q_in;
    if (afd_bf16_rms_norm(src, A, 0, L->kv_a_norm, row, 1, 1, r, leps, 1, isa)) goto done;
    if (afd_bf16_rope_heads(src + r, A, dr, row + r, D, dr, 1, 1, dr, cos, sin, pos + t, 1, isa))
      goto done;
  }
  const uint16_t *q = a; /* [T, nh, dn + dr] with rows A apart, or qb's rows */
  long qs = A;
  if (qr) {
    if (afd_bf16_rms_norm(a, A, 0, L->q_a_norm, ql, T, 1, qr, leps, threads, isa)) goto done;
    if (GEMM_W(ql, qb, qb, T, nh * hd, qr)) goto done;
    q = qb, qs = (long)nh * hd;
  }
  if (afd_bf16_rope_heads(q + dn, qs, hd, qa + r, (long)nh * D, D, T, nh, dr, cos, sin, pos,
                          threads, isa))
    goto done;
  if (afd_bf16_head_matmul(q, qs, hd, L->w_uk, qa, (long)nh * D, D, T, nh, r, dn, threads, isa))
    goto done;
  if (L->ix) { /* before xn is reused below */
    if (afd_dsa_decode_select(L->ix, xn, ql, H, qr, dr, cos, sin, pos, slots, index_cache, blocks,
                              lens, T, NB, bs, nb, threads, isa, table, counts))
      goto done;
    if (afd_bf16_decode_attention_ext(qa, cache, cache, table, counts, att, T, 1, nh, D, r,
                                      NB * bs, 1, (int)K_ix, scale, NULL, 0, threads, isa))
      goto done;
  } else if (afd_bf16_decode_attention_ext(qa, cache, cache, blocks, lens, att, T, 1, nh, D, r,
                                           NB, bs, nb, scale, NULL, 0, threads, isa))
    goto done;
  if (afd_bf16_head_matmul(att, (long)nh * r, r, L->w_uv, o, (long)nh * dv, dv, T, nh, dv, r,
                           threads, isa))
    goto done;
  if (GEMM_W(o, o, xn, T, H, nh * dv)) goto done; /* xn reused: o_proj out */
  for (size_t i = 0; i < (size_t)T * H; i += 8) /* bf16 + bf16, rounded once, as torch adds */
    store8(h_out + i, round8(_mm256_add_ps(load_bf16(h + i), load_bf16(xn + i))));
  rc = afd_bf16_rms_norm(h_out, H, 0, L->ffn_norm, x_out, T, 1, H, eps, threads, isa);
  if (!rc && L->w_router) rc = GEMM(x_out, L->w_router, logits, T, (int)L->E, H);
  if (!rc && L->w_router && L->topk > 0)
    rc = afd_route_rows(logits, L->router_bias, T, (int)L->E, (int)L->topk, (int)L->route,
                        (int)L->norm, (int)L->groups, (int)L->topk_groups, (float)L->scaling,
                        ids, weights);
done:
  free(xn), free(a), free(ql), free(qb), free(qa), free(att), free(o), free(table), free(counts);
  return rc;
}
