/* One attention layer of a decode-only micro-batch in a single native call (loaded with ctypes
 * by afd/kernels/decode_layer.py), for GQA and for Step-3's MFA:
 *
 *   xn  = rms_norm(h, attn_norm)
 *   q, k, v = split(xn @ w_qkv^T)
 *   MFA only: q = rms_norm(q, inter_norm) @ w_q^T    (the low-rank query)
 *   q, k = rope(rms_norm(q, q_norm)), rope(rms_norm(k, k_norm))  (GQA's norms are optional)
 *   k, v -> the paged cache at each token's slot
 *   a   = paged decode attention of q over the cache
 *   h'  = bf16(h + a @ w_o^T);  x = rms_norm(h', ffn_norm)
 *   with w_router: logits = x @ w_router^T    (the MoE router's matmul, bias-free routers)
 *   with topk too: the router kind on those logits (route_rows): softmax-then-top-k, or
 *   gpt-oss's top-k-then-softmax with its selection bias
 *
 * gpt-oss adds (afd_bf16_decode_layer_ext): biases on the qkv and output projections, each
 * added to the bf16 matmul result and rounded once as torch adds a Linear's bias; a sink
 * logit per query head and a sliding window, both the decode attention kernel's.
 *
 * It is services/attention/model.py's attention_and_route() with the kind's qkv(), composed
 * of the same kernels the per-op path calls one by one (gemm.c, norm_rope.c, attention.c), so
 * its results are the same bits; what it saves is ~15 Python-level calls per layer, whose
 * dispatch is a visible share of a batch-1 step (the router too, where it joins the call). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fp8_gemm.h"

/* A matmul on the instruction set (and weight layout) the caller chose. */
#define GEMM(x, w, y, M, N, K) afd_gemm_isa(x, w, y, M, N, K, threads, isa)
/* The same for a weight that may be block-FP8 (codes qc and scales sc, or NULL: bf16 w),
 * converted for that matmul as it goes (fp8_gemm.c). */
#define GEMM_W(x, w, qc, sc, y, M, N, K) afd_gemm_w(x, w, qc, sc, bk, y, M, N, K, threads, isa)

/* topk.c: torch.topk's pick among equal scores, once checked against this process's torch */
extern int afd_topk_trusted;
int afd_topk_known(int E, int k);
int afd_topk_as_torch(const float *p, int E, int k, int32_t *ids, float *w, void *q);

/* The k largest of p [E], best first, into ids and w (taken [E] and q [E] pairs: scratch).
 * Which they are is decided by comparisons alone, so it is torch.topk's choice wherever that is
 * unique; where the k-th is equal to one left out, topk.c's replay of torch.topk where it has
 * been checked (afd/kernels/topk.py), else 1 is returned (the caller leaves the row to torch);
 * 0 otherwise. */
static int pick_topk(const float *p, char *taken, void *q, int E, int k, int32_t *ids,
                     float *w) {
  for (int e = 0; e < E; e++) taken[e] = 0;
  for (int j = 0; j < k; j++) {
    int best = -1;
    for (int e = 0; e < E; e++)
      if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
    taken[best] = 1;
    ids[j] = best;
    w[j] = p[best];
  }
  for (int e = 0; e < E; e++)
    if (!taken[e] && p[e] == w[k - 1]) /* a tie across the cut */
      return afd_topk_trusted && afd_topk_known(E, k) ? afd_topk_as_torch(p, E, k, ids, w, q) != 0
                                                      : 1;
  return 0;
}

/* One row of moe_router.softmax_topk on bf16 logits l [E]: a float32 softmax over the row, its
 * k largest (best first), renormalised over the k when norm. */
static int row_softmax_topk(const uint16_t *l, int E, int k, int norm, float *p, char *taken,
                            void *q, int32_t *ids, float *w) {
  float m = -INFINITY, s = 0.f;
  for (int e = 0; e < E; e++) m = fmaxf(m, bf16_value(l[e]));
  for (int e = 0; e < E; e++) s += p[e] = expf(bf16_value(l[e]) - m);
  if (!isfinite(s) || !(s > 0.f)) return 1; /* NaN or infinite logits: torch's rules, not ours */
  for (int e = 0; e < E; e++) p[e] /= s;
  int rc = pick_topk(p, taken, q, E, k, ids, w);
  float kept = 0.f;
  for (int j = 0; j < k; j++) kept += w[j];
  if (norm)
    for (int j = 0; j < k; j++) w[j] /= kept;
  return rc;
}

/* One row of moe_router.topk_softmax on bf16 logits l [E] (plus bias [E] float32 where given):
 * the k largest scores best first, then a float32 softmax over those k alone. */
static int row_topk_softmax(const uint16_t *l, const float *bias, int E, int k, float *p,
                            char *taken, void *q, int32_t *ids, float *w) {
  for (int e = 0; e < E; e++) {
    p[e] = bias ? bf16_value(l[e]) + bias[e] : bf16_value(l[e]);
    if (!isfinite(p[e])) return 1; /* NaN or infinite scores: torch's rules, not ours */
  }
  int rc = pick_topk(p, taken, q, E, k, ids, w);
  float m = w[0], s = 0.f;
  for (int j = 0; j < k; j++) s += w[j] = expf(w[j] - m);
  for (int j = 0; j < k; j++) w[j] /= s;
  return rc;
}

/* One row of moe_router.sigmoid_group_topk (DeepSeek-V3) on bf16 logits l [E]: float32
 * sigmoid scores s; the choice s + bias (where given) decides which experts, s their weights;
 * with G > 1 groups of E / G experts only those of the kg groups whose two best choices sum
 * highest compete; the weights renormalised over the k when norm (plus 1e-20), then scaled.
 * p: [2 E] scratch (scores, then choices). */
static int row_sigmoid_group_topk(const uint16_t *l, const float *bias, int E, int k, int norm,
                                  int G, int kg, float scaling, float *p, char *taken, void *q,
                                  int32_t *ids, float *w) {
  float *s = p, *c = p + E;
  for (int e = 0; e < E; e++) {
    const float x = bf16_value(l[e]);
    if (!isfinite(x)) return 1; /* NaN or infinite logits: torch's rules, not ours */
    s[e] = 1.f / (1.f + expf(-x));
    c[e] = bias ? s[e] + bias[e] : s[e];
  }
  if (G > 1) {
    if (E % G || kg <= 0 || kg > G || G > 64) return 1;
    const int per = E / G;
    float best2[64];
    int32_t gids[64];
    float gw[64];
    for (int g = 0; g < G; g++) { /* the sum of the group's two best (its one, if alone) */
      float a = -INFINITY, b = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; e++) {
        if (c[e] > a) b = a, a = c[e];
        else if (c[e] > b) b = c[e];
      }
      best2[g] = per > 1 ? a + b : a;
    }
    if (pick_topk(best2, taken, q, G, kg, gids, gw)) return 1;
    for (int g = 0; g < G; g++) taken[g] = 0;
    for (int j = 0; j < kg; j++) taken[gids[j]] = 1;
    for (int g = 0; g < G; g++)
      if (!taken[g])
        for (int e = g * per; e < (g + 1) * per; e++) c[e] = -INFINITY;
  }
  int rc = pick_topk(c, taken, q, E, k, ids, w);
  if (rc) return rc;
  float sum = 0.f;
  for (int j = 0; j < k; j++) sum += w[j] = s[ids[j]];
  for (int j = 0; j < k; j++) w[j] = (norm ? w[j] / (sum + 1e-20f) : w[j]) * scaling;
  return 0;
}

/* The router kind `route` (0: softmax-then-top-k, 1: top-k-then-softmax with bias, 2:
 * DeepSeek's sigmoid with its selection bias and groups, G groups of which kg compete, weights
 * scaled by `scaling`) on bf16 logits [T, E] -> ids [T, k], weights [T, k]. Where a row's pick
 * is not torch.topk's to make here (a tie across the cut topk.c may not break, non-finite
 * scores) 1 is returned for the caller to route the batch with torch. The weights are torch's
 * to within an ulp (expf, not torch's vectorised exp). Returns 0, 1, or -1. */
int afd_route_rows(const uint16_t *logits, const float *bias, int T, int E, int k, int route,
                   int norm, int G, int kg, float scaling, int32_t *ids, float *w) {
  if (k <= 0 || k > E) return -1;
  float *p = (float *)malloc((size_t)E * 2 * sizeof(float));
  char *taken = (char *)malloc((size_t)E);
  void *q = malloc((size_t)E * 8); /* topk.c's (score, index) pairs */
  int rc = p && taken && q ? 0 : -1;
  for (int t = 0; t < T && !rc; t++) {
    const uint16_t *l = logits + (size_t)t * E;
    int32_t *it = ids + (size_t)t * k;
    float *wt = w + (size_t)t * k;
    if (route == 2)
      rc = row_sigmoid_group_topk(l, bias, E, k, norm, G, kg, scaling, p, taken, q, it, wt);
    else if (route == 1)
      rc = row_topk_softmax(l, bias, E, k, p, taken, q, it, wt);
    else
      rc = row_softmax_topk(l, E, k, norm, p, taken, q, it, wt);
  }
  free(p), free(taken), free(q);
  return rc;
}

static int route_rows(const uint16_t *logits, const float *bias, int T, int E, int k, int route,
                      int norm, int32_t *ids, float *w) {
  return afd_route_rows(logits, bias, T, E, k, route, norm, 1, 1, 1.f, ids, w);
}

/* y[t, :] = bf16(y[t, :] + b) for T rows of n (n % 8 == 0): a Linear's bias, as torch adds it */
static void add_bias(uint16_t *y, const uint16_t *b, int T, int n) {
  for (int t = 0; t < T; t++)
    for (int j = 0; j < n; j += 8) {
      uint16_t *r = y + (size_t)t * n + j;
      store8(r, round8(_mm256_add_ps(load_bf16(r), load_bf16(b + j))));
    }
}

/* h [T, H] in; h_out [T, H] and x_out [T, H] out. Weights: attn_norm, ffn_norm [H];
 * w_qkv [(qin + 2 kvh D), H] with qin = nh D, or for MFA the query rank with inter_norm [qin]
 * and w_q [nh D, qin]; q_norm, k_norm [D] or NULL (no q/k norm); w_o [H, nh D].
 * cos, sin [P, D]; pos, slots [T]; k/v cache [kvh, NB, bs, D]; blocks [T, nb]; lens [T].
 * isa: the matmuls' instruction set and weight layout, as afd_bf16_moe's.
 * w_router [E, H] (that layout too) or NULL; logits [T, E] out where it is given; with topk
 * > 0 too, ids [T, topk] and weights [T, topk] out (route_rows, norm its flag).
 * _ext only: b_qkv [qin + 2 kvh D] and b_o [H] bf16 or NULL; sinks [nh] float32 or NULL;
 * window > 0: the last `window` positions only; route 0: softmax-then-top-k, 1: top-k-then-
 * softmax with router_bias [E] float32 (or NULL) added to the logits first.
 * q_qkv, s_qkv, q_q, s_q, q_o, s_o (_ext only): block-FP8 codes and scales (afd/blockfp8.py,
 * K-blocks of bk) standing for w_qkv, w_q and w_o, each pair or NULL (that weight bf16).
 * Returns 0; 1 where the routing is left to the caller (a tie across the top-k cut, see
 * pick_topk; every other output is written); -1 (bad sizes, memory short, a length past the
 * block table). */
int afd_bf16_decode_layer_ext(const uint16_t *h, uint16_t *h_out, uint16_t *x_out,
                          const uint16_t *attn_norm, const uint16_t *ffn_norm,
                          const uint16_t *w_qkv, const uint16_t *q_norm, const uint16_t *k_norm,
                          const uint16_t *inter_norm, const uint16_t *w_q, const uint16_t *w_o,
                          const uint16_t *cos, const uint16_t *sin, const int64_t *pos,
                          const int64_t *slots, uint16_t *k_cache, uint16_t *v_cache,
                          const int64_t *blocks, const int64_t *lens, int T, int H, int qin,
                          int nh, int kvh, int D, int NB, int bs, int nb, float eps, float scale,
                          int threads, int isa, const uint16_t *w_router, uint16_t *logits,
                          int E, int topk, int norm, int32_t *ids, float *weights,
                          const uint16_t *b_qkv, const uint16_t *b_o, const float *sinks,
                          int window, const float *router_bias, int route, const uint8_t *q_qkv,
                          const float *s_qkv, const uint8_t *q_q, const float *s_q,
                          const uint8_t *q_o, const float *s_o, int bk) {
  if (T <= 0 || H % 8 != 0 || D % 16 != 0 || kvh <= 0 || nh % kvh != 0 || qin % 8 != 0) return -1;
  if ((!w_q && !q_q) && qin != nh * D) return -1;
  if ((q_qkv || q_q || q_o) && bk <= 0) return -1;
  const int Q = nh * D, KV = kvh * D, W = qin + 2 * KV;
  uint16_t *xn = (uint16_t *)afd_alloc64((size_t)T * H * 2);
  uint16_t *qkv = (uint16_t *)afd_alloc64((size_t)T * W * 2);
  size_t wide = (size_t)(Q > qin ? Q : qin);
  uint16_t *tmp = (uint16_t *)afd_alloc64((size_t)T * wide * 2); /* q (or k) after its norm */
  uint16_t *q = (uint16_t *)afd_alloc64((size_t)T * Q * 2);    /* q after RoPE, then k */
  uint16_t *att = (uint16_t *)afd_alloc64((size_t)T * Q * 2);
  int rc = -1;
  if (!xn || !qkv || !tmp || !q || !att) goto done;
  if (afd_bf16_rms_norm(h, H, 0, attn_norm, xn, T, 1, H, eps, threads, isa)) goto done;
  if (GEMM_W(xn, w_qkv, q_qkv, s_qkv, qkv, T, W, H)) goto done;
  if (b_qkv) add_bias(qkv, b_qkv, T, W);
  /* k first (rope'd into q's buffer, then scattered to the cache), then q */
  const uint16_t *k_src = qkv + qin;
  if (k_norm) {
    if (afd_bf16_rms_norm(k_src, W, D, k_norm, tmp, T, kvh, D, eps, threads, isa)) goto done;
    if (afd_bf16_rope(tmp, KV, q, T, kvh, D, cos, sin, pos, threads, isa)) goto done;
  } else if (afd_bf16_rope(k_src, W, q, T, kvh, D, cos, sin, pos, threads, isa)) {
    goto done;
  }
  const size_t slots_per_head = (size_t)NB * bs;
  for (int t = 0; t < T; t++)
    for (int j = 0; j < kvh; j++) {
      size_t dst = ((size_t)j * slots_per_head + (size_t)slots[t]) * D;
      memcpy(k_cache + dst, q + ((size_t)t * kvh + j) * D, (size_t)D * 2);
      memcpy(v_cache + dst, qkv + (size_t)t * W + qin + KV + (size_t)j * D, (size_t)D * 2);
    }
  if (w_q || q_q) { /* MFA: the low-rank query, normed, up-projected (into att, free until
                     * attention) */
    if (afd_bf16_rms_norm(qkv, W, 0, inter_norm, tmp, T, 1, qin, eps, threads, isa)) goto done;
    if (GEMM_W(tmp, w_q, q_q, s_q, att, T, Q, qin)) goto done;
    if (afd_bf16_rope(att, Q, q, T, nh, D, cos, sin, pos, threads, isa)) goto done;
  } else if (q_norm) {
    if (afd_bf16_rms_norm(qkv, W, D, q_norm, tmp, T, nh, D, eps, threads, isa)) goto done;
    if (afd_bf16_rope(tmp, Q, q, T, nh, D, cos, sin, pos, threads, isa)) goto done;
  } else if (afd_bf16_rope(qkv, W, q, T, nh, D, cos, sin, pos, threads, isa)) {
    goto done;
  }
  /* The router's weights into L2 while the attention computes: DRAM idles then, and the
   * router's matmul, too small for a second thread, otherwise waits on each of its lines.
   * Only where it is that small (bf16.h): a larger router would push its own first lines out
   * of L2 before the matmul reads them. */
  if (w_router && (size_t)E * H < ONE_THREAD_WEIGHTS)
    for (size_t o = 0; o < (size_t)E * H * sizeof(uint16_t); o += 64)
      _mm_prefetch((const char *)w_router + o, _MM_HINT_T1);
  if (afd_bf16_decode_attention_ext(q, k_cache, v_cache, blocks, lens, att, T, kvh, nh / kvh, D,
                                    D, NB, bs, nb, scale, sinks, window, threads, isa))
    goto done;
  if (GEMM_W(att, w_o, q_o, s_o, xn, T, H, Q)) goto done; /* xn reused: o_proj out */
  if (b_o) add_bias(xn, b_o, T, H);
  for (size_t i = 0; i < (size_t)T * H; i += 8) /* bf16 + bf16, rounded once, as torch adds */
    store8(h_out + i, round8(_mm256_add_ps(load_bf16(h + i), load_bf16(xn + i))));
  rc = afd_bf16_rms_norm(h_out, H, 0, ffn_norm, x_out, T, 1, H, eps, threads, isa);
  if (!rc && w_router) rc = GEMM(x_out, w_router, logits, T, E, H);
  if (!rc && w_router && topk > 0)
    rc = route_rows(logits, router_bias, T, E, topk, route, norm, ids, weights);
done:
  free(xn), free(qkv), free(tmp), free(q), free(att);
  return rc;
}

/* The layer without gpt-oss's additions and with bf16 weights. */
int afd_bf16_decode_layer(const uint16_t *h, uint16_t *h_out, uint16_t *x_out,
                          const uint16_t *attn_norm, const uint16_t *ffn_norm,
                          const uint16_t *w_qkv, const uint16_t *q_norm, const uint16_t *k_norm,
                          const uint16_t *inter_norm, const uint16_t *w_q, const uint16_t *w_o,
                          const uint16_t *cos, const uint16_t *sin, const int64_t *pos,
                          const int64_t *slots, uint16_t *k_cache, uint16_t *v_cache,
                          const int64_t *blocks, const int64_t *lens, int T, int H, int qin,
                          int nh, int kvh, int D, int NB, int bs, int nb, float eps, float scale,
                          int threads, int isa, const uint16_t *w_router, uint16_t *logits,
                          int E, int topk, int norm, int32_t *ids, float *weights) {
  return afd_bf16_decode_layer_ext(h, h_out, x_out, attn_norm, ffn_norm, w_qkv, q_norm, k_norm,
                                   inter_norm, w_q, w_o, cos, sin, pos, slots, k_cache, v_cache,
                                   blocks, lens, T, H, qin, nh, kvh, D, NB, bs, nb, eps, scale,
                                   threads, isa, w_router, logits, E, topk, norm, ids, weights,
                                   NULL, NULL, NULL, 0, NULL, 0, NULL, NULL, NULL, NULL, NULL,
                                   NULL, 0);
}
