/* A decode step's layers in one native call (loaded with ctypes by afd/kernels/decode_stack.py),
 * where the attention side and the one expert shard compute in the same process:
 *
 *   for each layer l:
 *     h', x, routing = afd_bf16_decode_layer_ext(h)  (decode_layer.c: attention, router, top-k;
 *         DeepSeek's MLA: afd_bf16_mla_decode_layer, mla_layer.c)
 *     y = afd_bf16_moe_ext(x, routing) into zeros    (moe.c: what the FFN shard computes;
 *         afd_mxfp4_moe for MXFP4 experts, mxfp4_moe.c)
 *     y = bf16(y + shared(x)) where the layer has a shared expert (mlp.c, as the shard adds it);
 *         a dense layer (no experts, no router) has its MLP there, into zeros
 *     h = bf16(h' + y)                               (the residual add of the pipeline)
 *   and, where the caller asks (the call ends at the model's last layer): the LM head,
 *     logits = fp32(rms_norm(h, final_norm) @ w_head^T)  (services/attention/model.py: logits;
 *     w_head bf16 or block-FP8)
 *
 * It is services/attention/pipeline.py's layer loop with one micro-batch and the shard called
 * inline (dispatch.py: serve_local), composed of the same two calls with the same roundings, so
 * its results are the same bits. What it saves is the ~100 us of Python per layer around the
 * two calls (the arguments, the FFN message, its reply, the add), a tenth of a batch-1 step. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "mla_layer.h"

int afd_bf16_decode_layer_ext(const uint16_t *h, uint16_t *h_out, uint16_t *x_out,
                              const uint16_t *attn_norm, const uint16_t *ffn_norm,
                              const uint16_t *w_qkv, const uint16_t *q_norm,
                              const uint16_t *k_norm, const uint16_t *inter_norm,
                              const uint16_t *w_q, const uint16_t *w_o, const uint16_t *cos,
                              const uint16_t *sin, const int64_t *pos, const int64_t *slots,
                              uint16_t *k_cache, uint16_t *v_cache, const int64_t *blocks,
                              const int64_t *lens, int T, int H, int qin, int nh, int kvh, int D,
                              int NB, int bs, int nb, float eps, float scale, int threads, int isa,
                              const uint16_t *w_router, uint16_t *logits, int E, int topk,
                              int norm, int32_t *ids, float *weights, const uint16_t *b_qkv,
                              const uint16_t *b_o, const float *sinks, int window,
                              const float *router_bias, int route, const uint8_t *q_qkv,
                              const float *s_qkv, const uint8_t *q_q, const float *s_q,
                              const uint8_t *q_o, const float *s_o, int bk);
int afd_bf16_moe_ext(const uint16_t *x, const int32_t *ids, const float *gate, int topk,
                     int first, const uint16_t *const *w13, const uint16_t *const *w2,
                     uint16_t *out, int T, int E, int H, int I, int threads, int reverse, int isa,
                     const uint16_t *const *b13, const uint16_t *const *b2, int act_kind,
                     float limit, float alpha, const uint8_t *const *q13,
                     const float *const *s13, const uint8_t *const *q2, const float *const *s2,
                     int bk);
int afd_mxfp4_moe(const uint16_t *x, const int32_t *ids, const float *gate, int topk, int first,
                  const uint8_t *const *b13, const uint8_t *const *s13,
                  const uint16_t *const *bias13, const uint8_t *const *b2,
                  const uint8_t *const *s2, const uint16_t *const *bias2, uint16_t *out, int T,
                  int E, int H, int I, int act, float limit, float alpha, int threads, int isa);
int afd_bf16_mlp_add_ext(const uint16_t *x, const uint16_t *w13, const uint16_t *w2,
                         uint16_t *out, int T, int H, int I, int act, float limit, float alpha,
                         int threads, int isa, const uint8_t *q13, const float *s13,
                         const uint8_t *q2, const float *s2, int bk);

/* One layer's weights and cache (afd/kernels/decode_stack.py: StackLayer, the same fields in
 * the same order). `reverse` is the experts' visiting order, flipped here after each call (as
 * NativeExperts flips its own). */
typedef struct {
  const uint16_t *attn_norm, *ffn_norm, *w_qkv, *q_norm, *k_norm, *inter_norm, *w_q, *w_o;
  const uint16_t *w_router, *cos, *sin;
  uint16_t *k_cache, *v_cache;
  const uint16_t *const *w13;
  const uint16_t *const *w2;
  int64_t experts, first, reverse; /* experts held (all of the layer's), the first one's id */
  double scale;                     /* the attention's softmax scale */
  /* gpt-oss's additions to the attention layer (NULL / 0 elsewhere: afd_bf16_decode_layer_ext) */
  const uint16_t *b_qkv, *b_o;
  const float *sinks, *router_bias;
  int64_t window, route;
  /* the experts' biases (NULL: none) and activation (moe.c's act kinds, limit, alpha); MXFP4
   * experts where mx_b13 is set (blocks and scales per expert: w13 and w2 are then unused) */
  const uint16_t *const *b13;
  const uint16_t *const *b2;
  const uint8_t *const *mx_b13;
  const uint8_t *const *mx_s13;
  const uint8_t *const *mx_b2;
  const uint8_t *const *mx_s2;
  int64_t act;
  double limit, alpha;
  /* an MLA layer (its own weights and sizes; the GQA fields above unused but the caches, cos,
   * sin and scale), or NULL */
  const afd_mla_layer *mla;
  /* the shared expert (w13 [2I_s, H], w2 [H, I_s], the experts' activation), or NULL; a
   * dense layer (experts 0): its MLP, with the activation in act, limit, alpha */
  const uint16_t *s13, *s2;
  int64_t shared_inter;
  uint16_t *index_cache; /* a DSA layer's indexer keys [NB, bs, dim], or NULL */
  /* block-FP8 weights, each with its K-block: the projections (w_qkv, w_q, w_o; q NULL: bf16,
   * above), the routed experts' codes and scales (per-expert arrays; NULL: w13, w2) */
  afd_fp8_ref f8_qkv, f8_q, f8_o;
  int64_t attn_bk;
  const uint8_t *const *f8_q13;
  const float *const *f8_s13;
  const uint8_t *const *f8_q2;
  const float *const *f8_s2;
  int64_t experts_bk;
  afd_fp8_ref f8_sh13, f8_sh2; /* the shared expert's (or dense MLP's) w13, w2 (bf16: s13, s2) */
  int64_t shared_bk;
} afd_stack_layer;

/* The model's LM head (afd/kernels/decode_stack.py: StackHead's struct, the same fields in the
 * same order): the final norm [H] and its epsilon, the weight [V, H] bf16 laid out for the
 * stack's isa, or block-FP8 (f8.q set: codes and scales in K-blocks of bk; w unused). */
typedef struct {
  const uint16_t *final_norm;
  double eps;
  const uint16_t *w;
  afd_fp8_ref f8;
  int64_t bk, V;
} afd_stack_head;

static double wall_seconds(void) { /* time.time()'s clock: the telemetry's stamps are its */
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int afd_argmax_rows(const float *x, int B, int V, int64_t *out, int threads);
int afd_sample_rows(const float *logits, int T, int V, const float *temperature,
                    const int32_t *top_k, const float *top_p, const float *min_p,
                    const float *uniform, int64_t *out);

/* logits [T, V] fp32 <- fp32(bf16(rms_norm(h) @ w^T)): the model's head, the same calls
 * (norm_rope.c, the matmul of isa or fp8_gemm.c) and roundings as its per-op path. Returns 0
 * or -1. */
static int run_head(const uint16_t *h, const afd_stack_head *hd, int T, int H, int threads,
                    int isa, float *logits, int64_t *argmax) {
  const int V = (int)hd->V;
  uint16_t *xn = (uint16_t *)afd_alloc64((size_t)T * H * sizeof(uint16_t));
  uint16_t *y = (uint16_t *)afd_alloc64((size_t)T * V * sizeof(uint16_t));
  int rc = xn && y ? 0 : -1;
  if (!rc) rc = afd_bf16_rms_norm(h, H, 0, hd->final_norm, xn, T, 1, H, (float)hd->eps, threads,
                                  isa);
  if (!rc) rc = afd_gemm_w(xn, hd->w, hd->f8.q, hd->f8.s, (int)hd->bk, y, T, V, H, threads, isa);
  if (!rc)
    for (size_t i = 0; i < (size_t)T * V; i++) logits[i] = bf16_value(y[i]);
  /* greedy decoding's pick while the logits are still in this core's caches (argmax.c) */
  if (!rc && argmax) rc = afd_argmax_rows(logits, T, V, argmax, threads);
  free(xn), free(y);
  return rc ? -1 : 0;
}

/* h [T, H] in: the layers' input; out: the last layer's output (before the final norm).
 * h_attn, x [T, H] and logits [T, E] are work buffers; where a layer's routing is left to the
 * caller they hold that layer's h', x and router logits. ids [L, T, topk] int32 and weights
 * [L, T, topk] float32 out: each layer's routing; stamps [L, 3] out: each layer's start, the
 * end of its attention, the end of its experts (wall clock, seconds). The rest as
 * afd_bf16_decode_layer_ext's and the experts calls' arguments (I: the experts' intermediate
 * size).
 * head (afd_stack_head) and logits [T, V] fp32, or head NULL: where every layer ran, the LM
 * head's logits of h, and
 * with argmax [T] int64 given, each row's argmax as argmax.c picks it.
 * tokens [T] int64 and embed [vocab, H] bf16, or tokens NULL: h [T, H] is first filled with
 * the tokens' rows of embed (the model's embedding, as F.embedding gathers it).
 * Returns L when every layer ran; l < L where layer l's routing is left to the caller (a tie
 * across its top-k cut that topk.c may not break: h is then layer l's input; no logits); -1
 * where a layer's attention failed and -2 where its experts did (bad sizes, memory short), *at
 * set to that layer; -3 where the head failed (memory short); -4 where a token is not one of
 * the vocab rows (*at set to its row; nothing ran). */
int afd_bf16_decode_stack(afd_stack_layer *layers, int L, uint16_t *h, uint16_t *h_attn,
                          uint16_t *x, uint16_t *logits, const int64_t *pos,
                          const int64_t *slots, const int64_t *blocks, const int64_t *lens, int T,
                          int H, int qin, int nh, int kvh, int D, int NB, int bs, int nb, int E,
                          int topk, int norm, int I, float eps, int threads, int isa,
                          int32_t *ids, float *weights, double *stamps, int *at,
                          const afd_stack_head *head, float *logits_out, int64_t *argmax,
                          const int64_t *tokens, const uint16_t *embed, int64_t vocab) {
  *at = 0;
  if (T <= 0 || H % 8 != 0 || topk <= 0 || E <= 0) return -1;
  if (tokens) {
    for (int t = 0; t < T; t++)
      if (tokens[t] < 0 || tokens[t] >= vocab) {
        *at = t;
        return -4;
      }
    for (int t = 0; t < T; t++)
      memcpy(h + (size_t)t * H, embed + (size_t)tokens[t] * H, (size_t)H * sizeof(uint16_t));
  }
  uint16_t *y = (uint16_t *)afd_alloc64((size_t)T * H * sizeof(uint16_t));
  if (!y) return -1;
  int rc = L;
  for (int l = 0; l < L; l++) {
    afd_stack_layer *w = layers + l;
    int32_t *ids_l = ids + (size_t)l * T * topk;
    float *weights_l = weights + (size_t)l * T * topk;
    *at = l;
    stamps[3 * l] = wall_seconds();
    int r = w->mla ? afd_bf16_mla_decode_layer(w->mla, h, h_attn, x, w->cos, w->sin, pos, slots,
                                               w->k_cache, w->index_cache, blocks, lens, T, NB,
                                               bs, nb, (float)w->scale, threads, isa, logits,
                                               ids_l, weights_l)
                   : afd_bf16_decode_layer_ext(
                         h, h_attn, x, w->attn_norm, w->ffn_norm, w->w_qkv, w->q_norm, w->k_norm,
                         w->inter_norm, w->w_q, w->w_o, w->cos, w->sin, pos, slots, w->k_cache,
                         w->v_cache, blocks, lens, T, H, qin, nh, kvh, D, NB, bs, nb, eps,
                         (float)w->scale, threads, isa, w->w_router, logits, E, topk, norm,
                         ids_l, weights_l, w->b_qkv, w->b_o, w->sinks, (int)w->window,
                         w->router_bias, (int)w->route, w->f8_qkv.q, w->f8_qkv.s, w->f8_q.q,
                         w->f8_q.s, w->f8_o.q, w->f8_o.s, (int)w->attn_bk);
    stamps[3 * l + 1] = wall_seconds();
    if (r != 0) {
      rc = r < 0 ? -1 : l;
      break;
    }
    memset(y, 0, (size_t)T * H * sizeof(uint16_t)); /* the shard's output starts at zero */
    int e = 0;
    if (!w->experts) { /* a dense layer: no routing (ids -1, counted as none) */
      memset(ids_l, 0xff, (size_t)T * topk * sizeof(int32_t));
      memset(weights_l, 0, (size_t)T * topk * sizeof(float));
    } else if (w->mx_b13) {
      e = afd_mxfp4_moe(x, ids_l, weights_l, topk, (int)w->first, w->mx_b13, w->mx_s13, w->b13,
                        w->mx_b2, w->mx_s2, w->b2, y, T, (int)w->experts, H, I, (int)w->act,
                        (float)w->limit, (float)w->alpha, threads, isa);
    } else {
      e = afd_bf16_moe_ext(x, ids_l, weights_l, topk, (int)w->first, w->w13, w->w2, y, T,
                           (int)w->experts, H, I, threads, (int)w->reverse, isa, w->b13, w->b2,
                           (int)w->act, (float)w->limit, (float)w->alpha, w->f8_q13, w->f8_s13,
                           w->f8_q2, w->f8_s2, (int)w->experts_bk);
      w->reverse = !w->reverse;
    }
    if (!e && (w->s13 || w->f8_sh13.q))
      e = afd_bf16_mlp_add_ext(x, w->s13, w->s2, y, T, H, (int)w->shared_inter, (int)w->act,
                               (float)w->limit, (float)w->alpha, threads, isa, w->f8_sh13.q,
                               w->f8_sh13.s, w->f8_sh2.q, w->f8_sh2.s, (int)w->shared_bk);
    if (e) {
      rc = -2;
      break;
    }
    for (size_t i = 0; i < (size_t)T * H; i += 8) /* bf16 + bf16, rounded once, as torch adds */
      store8(h + i, round8(_mm256_add_ps(load_bf16(h_attn + i), load_bf16(y + i))));
    stamps[3 * l + 2] = wall_seconds();
  }
  free(y);
  if (rc == L && head && run_head(h, head, T, H, threads, isa, logits_out, argmax))
    rc = -3;
  return rc;
}

/* `steps` decode steps of the stack above, each one's input the token chosen at the step
 * before: the next `steps` tokens in one call (the engine's burst,
 * services/attention/burst.py), without Python between the steps. The first step is
 * afd_bf16_decode_stack's call as given (tokens [T] embedded, the head and its argmax run);
 * step s > 0 embeds the token chosen at step s - 1 at positions pos + s, attending to lens + s
 * keys, its K/V at the slots that blocks [T, nb] give those positions (the caller allocated
 * them). A row's token is its argmax, or with temperature given and the row's above 0, a draw
 * from its logits (sample.c: temperature, top_k, top_p, min_p [T], uniform [steps, T]).
 * ids, weights [steps, L, T, topk] and stamps [steps, L, 3] out, each step's as the stack's;
 * argmax [steps, T] (each step's chosen tokens) and logits_out [steps, T, V] out. *done: the
 * steps that ran to their head with their tokens chosen. A step after the first that ends
 * early (a routing tie, a failure, a position past the block table, a row sample.c could not
 * draw from) ends the burst there, its partial K/V at positions no request has yet (the next
 * step writes them); the first step's return is the stack's own (where its draw failed, the
 * caller draws from its logits). Returns L where at least the first step ran. */
int afd_bf16_decode_burst(int steps, int *done, afd_stack_layer *layers, int L, uint16_t *h,
                          uint16_t *h_attn, uint16_t *x, uint16_t *logits, const int64_t *pos,
                          const int64_t *slots, const int64_t *blocks, const int64_t *lens,
                          int T, int H, int qin, int nh, int kvh, int D, int NB, int bs, int nb,
                          int E, int topk, int norm, int I, float eps, int threads, int isa,
                          int32_t *ids, float *weights, double *stamps, int *at,
                          const afd_stack_head *head, float *logits_out, int64_t *argmax,
                          const int64_t *tokens, const uint16_t *embed, int64_t vocab,
                          const float *temperature, const int32_t *top_k, const float *top_p,
                          const float *min_p, const float *uniform) {
  *done = 0;
  if (steps < 1 || !head || !argmax || !tokens) return -1;
  int64_t *p = (int64_t *)malloc((size_t)T * 3 * sizeof(int64_t));
  if (!p) return -3;
  int64_t *n = p + T, *sl = p + 2 * T; /* this step's positions, key counts, slots */
  memcpy(p, pos, (size_t)T * sizeof(int64_t));
  memcpy(n, lens, (size_t)T * sizeof(int64_t));
  memcpy(sl, slots, (size_t)T * sizeof(int64_t));
  int rc = L;
  const size_t per_step = (size_t)L * T * topk;
  const int V = (int)head->V;
  for (int s = 0; s < steps; s++) {
    if (s > 0) { /* the next positions, each inside the row's block table */
      int past = 0;
      for (int t = 0; t < T; t++) {
        p[t] += 1, n[t] += 1;
        int64_t b = p[t] / bs;
        if (b >= nb) past = 1;
        else sl[t] = blocks[(size_t)t * nb + b] * bs + p[t] % bs;
      }
      if (past) break;
    }
    const int64_t *in = s == 0 ? tokens : argmax + (size_t)(s - 1) * T; /* chosen at s - 1 */
    int r = afd_bf16_decode_stack(layers, L, h, h_attn, x, logits, p, sl, blocks, n, T, H, qin,
                                  nh, kvh, D, NB, bs, nb, E, topk, norm, I, eps, threads, isa,
                                  ids + s * per_step, weights + s * per_step, stamps + 3 * s * L,
                                  at, head, logits_out + (size_t)s * T * V,
                                  argmax + (size_t)s * T, in, embed, vocab);
    if (r != L) {
      if (s == 0) rc = r;
      break;
    }
    if (temperature && afd_sample_rows(logits_out + (size_t)s * T * V, T, V, temperature, top_k,
                                       top_p, min_p, uniform + (size_t)s * T,
                                       argmax + (size_t)s * T)) {
      if (s == 0) *done = 1;
      break;
    }
    *done = s + 1;
  }
  free(p);
  return rc;
}
