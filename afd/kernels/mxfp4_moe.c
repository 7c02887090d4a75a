/* Routed MXFP4 experts, fused (loaded with ctypes by afd/kernels/mxfp4.py): one call per layer
 * for every expert a shard holds, where the torch path (services/ffn/experts.py) issues about
 * fifteen ops per expert around the MXFP4 matmuls (gpt-oss: biases, the clamped SwiGLU).
 *
 * The (token, expert) pairs held here are sorted by expert (moe.c's counting sort); then, for
 * each expert e with n tokens, with every step rounded to bf16 as the torch path rounds it:
 *   h      = bf16(x[tokens] @ w13[e]^T), then bf16(h + b13[e]) with a bias
 *   gate, up = h[:, :I], h[:, I:]
 *   a      = act(gate, up) (experts.h: the SwiGLU, or gpt-oss's clamped SwiGLU)
 *   y      = bf16(a @ w2[e]^T), then bf16(y + b2[e]) with a bias
 *   ys     = bf16(y * bf16(weight))
 * and out[token] += ys in pair order, summed in fp32 and rounded once (index_add_). The matmuls
 * are mxfp4.c's (the same sums as the torch path's per-expert calls, so the same bits), in
 * units of NU weight rows over every held expert, handed to threads in guided runs (mxfp4.c
 * says why). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "experts.h"
#include "mxfp4.h"

#define NU 8 /* weight rows per work unit */

/* x [T, H] bf16; ids [T, topk] int32 (global expert ids) and gate [T, topk] fp32 as routed;
 * this shard holds experts first .. first + E - 1: b13[e], s13[e] the blocks and scales of
 * w13 [2I, H] (gate rows, then up rows), b2[e], s2[e] those of w2 [H, I]; bias13[e] [2I] and
 * bias2[e] [H] bf16, or NULL arrays for none. act and its limit and alpha as above; isa
 * ISA_AVX512: AVX-512 BF16; ISA_AMX: AMX tiles (mxfp4_amx.c; the caller checked every scale
 * byte is 2..252). out [T, H] bf16, accumulated into. Returns 0, -1 for H or I not a multiple of
 * 32 or bad sizes, -2 when memory is short. */
int afd_mxfp4_moe(const uint16_t *x, const int32_t *ids, const float *gate, int topk, int first,
                  const uint8_t *const *b13, const uint8_t *const *s13,
                  const uint16_t *const *bias13, const uint8_t *const *b2,
                  const uint8_t *const *s2, const uint16_t *const *bias2, uint16_t *out, int T,
                  int E, int H, int I, int act, float limit, float alpha, int threads, int isa) {
  if (H % 32 || I % 32 || E <= 0 || topk < 0 || T < 0) return -1;
  afd_mxfp4_init();
  afd_pairs pairs; /* sorted by expert as the torch path's argsort (experts.h) */
  if (afd_pairs_sort(ids, gate, T, topk, first, E, &pairs)) return -2;
  const int P = pairs.P;
  const int32_t *starts = pairs.starts, *expert = pairs.expert;
  const int64_t *tokens = pairs.tokens;
  if (P == 0) {
    afd_pairs_free(&pairs);
    return 0;
  }
  const int wide = isa >= ISA_AVX512, G13 = H / 32, G2 = I / 32;
  const size_t nx = afd_mxfp4_row_len(wide, H); /* per row: prepared x for w13 */
  const size_t na = afd_mxfp4_row_len(wide, I); /* per row: prepared a for w2 */
  int *held = malloc((size_t)E * sizeof(int));
  uint16_t *xs = afd_alloc64((size_t)P * H * sizeof(uint16_t));   /* x[tokens], by expert */
  uint16_t *as = afd_alloc64((size_t)P * I * sizeof(uint16_t));   /* activations */
  float *gu = afd_alloc64((size_t)P * 2 * I * sizeof(float));     /* w13 sums */
  float *ya = afd_alloc64((size_t)P * H * sizeof(float));         /* w2 sums */
  float *acc = afd_alloc64((size_t)(threads > 1 ? threads : 1) * H * sizeof(float)); /* a row */
  int nheld = 0;
  for (int e = 0; held && e < E; e++) /* (held is checked with the rest below) */
    if (starts[e + 1] > starts[e]) held[nheld++] = e;
  /* AMX (from MXFP4_AMX_FROM rows an expert): each expert's rows of x and of its activations
   * packed for the tiles (amx.c), from block bk[e] of 16 rows; else in the weights' scrambled
   * order (mxfp4.c) */
  const int amx = isa == ISA_AMX && P >= MXFP4_AMX_FROM * nheld && afd_cpu_amx();
  float *xp = wide || amx ? NULL : afd_alloc64((size_t)P * nx * sizeof(float));
  float *ap = wide || amx ? NULL : afd_alloc64((size_t)P * na * sizeof(float));
  uint16_t *xb = wide && !amx ? afd_alloc64((size_t)P * nx * sizeof(uint16_t)) : NULL;
  uint16_t *ab = wide && !amx ? afd_alloc64((size_t)P * na * sizeof(uint16_t)) : NULL;
  size_t *bk = amx ? malloc((size_t)(E + 1) * sizeof(size_t)) : NULL;
  uint16_t *xpk = NULL, *apk = NULL;
  const int G = G13 > G2 ? G13 : G2, nt = threads > 1 ? threads : 1;
  const size_t per = afd_mxfp4_amx_scratch(G); /* a thread's decoded codes */
  char *sh = amx ? aligned_alloc(64, (size_t)nt * per) : NULL;
  if (bk) {
    bk[0] = 0;
    for (int e = 0; e < E; e++) bk[e + 1] = bk[e] + (size_t)(starts[e + 1] - starts[e] + 15) / 16;
    xpk = aligned_alloc(64, afd_amx_elems(16 * (int)bk[E], H) * sizeof(uint16_t));
    apk = aligned_alloc(64, afd_amx_elems(16 * (int)bk[E], I) * sizeof(uint16_t));
  }
  int ok = held && xs && as && gu && ya && acc &&
           (amx ? bk && xpk && apk && sh : wide ? xb && ab : xp && ap);
  if (!ok) {
    free(held), free(xs), free(as), free(gu), free(ya), free(xp), free(ap), free(xb), free(ab);
    free(acc), free(bk), free(xpk), free(apk), free(sh);
    afd_pairs_free(&pairs);
    return -2;
  }
  const int nu = amx ? AMX_NU : NU; /* AMX: whole tiles of 16 weight rows (2I, H: multiples) */
  const int u13 = (2 * I + nu - 1) / nu, u2 = (H + nu - 1) / nu;
  const int t = threads > 1 ? threads : 1;
#pragma omp parallel num_threads(t) if (t > 1)
  {
    char *mine = sh ? sh + (size_t)(t > 1 ? omp_get_thread_num() : 0) * per : NULL;
    uint16_t *mine_a = (uint16_t *)mine;
    /* the copies, packs and the sum on every thread too: serial, they idled the other core */
#pragma omp for schedule(static)
    for (int p = 0; p < P; p++) memcpy(xs + (size_t)p * H, x + tokens[p] * H, (size_t)H * 2);
    if (amx) {
#pragma omp for schedule(dynamic, 1)
      for (int i = 0; i < nheld; i++) {
        int e = held[i];
        afd_amx_pack(xs + (size_t)starts[e] * H, starts[e + 1] - starts[e], H,
                     xpk + bk[e] * 16 * H);
      }
    }
    if (!amx) {
#pragma omp for schedule(static)
      for (int p = 0; p < P; p++) afd_mxfp4_prepare_row(xs, 0, wide, p, H, xp, xb);
    }
#pragma omp for schedule(guided)
    for (int u = 0; u < nheld * u13; u++) { /* gate|up sums of each expert's pairs */
      int e = held[u / u13], p0 = starts[e], n = starts[e + 1] - p0;
      int n0 = u % u13 * nu, n1 = n0 + nu < 2 * I ? n0 + nu : 2 * I;
      if (amx)
        afd_mxfp4_rows_amx(xpk + bk[e] * 16 * H, b13[e], s13[e], gu + (size_t)p0 * 2 * I, n,
                           2 * I, G13, n0, n1, mine_a);
      else
        afd_mxfp4_rows(xp ? xp + p0 * nx : NULL, xb ? xb + p0 * nx : NULL, wide, b13[e],
                       s13[e], gu + (size_t)p0 * 2 * I, n, 2 * I, G13, n0, n1);
    }
#pragma omp for schedule(static)
    for (int p = 0; p < P; p++) {
      afd_act_row(NULL, gu + (size_t)p * 2 * I, bias13 ? bias13[expert[p]] : NULL, I, act, limit,
                  alpha, as + (size_t)p * I, NULL);
      if (!amx) afd_mxfp4_prepare_row(as, 0, wide, p, I, ap, ab);
    }
    if (amx) {
#pragma omp for schedule(static)
      for (int i = 0; i < nheld; i++) {
        int e = held[i];
        afd_amx_pack(as + (size_t)starts[e] * I, starts[e + 1] - starts[e], I,
                     apk + bk[e] * 16 * I);
      }
    }
#pragma omp for schedule(guided)
    for (int u = 0; u < nheld * u2; u++) { /* down sums */
      int e = held[u / u2], p0 = starts[e], n = starts[e + 1] - p0;
      int n0 = u % u2 * nu, n1 = n0 + nu < H ? n0 + nu : H;
      if (amx)
        afd_mxfp4_rows_amx(apk + bk[e] * 16 * I, b2[e], s2[e], ya + (size_t)p0 * H, n, H, G2,
                           n0, n1, mine_a);
      else
        afd_mxfp4_rows(ap ? ap + p0 * na : NULL, ab ? ab + p0 * na : NULL, wide, b2[e], s2[e],
                       ya + (size_t)p0 * H, n, H, G2, n0, n1);
    }
    /* out += bf16(bf16(y [+ bias]) * weight) pair by pair (index_add_), threads by tokens */
    float *row = acc + (size_t)(t > 1 ? omp_get_thread_num() : 0) * H;
#pragma omp for schedule(static)
    for (int r = 0; r < T; r++) afd_pairs_sum(&pairs, bias2, NULL, ya, H, row, out, r, r + 1);
  }
  free(held), free(xs), free(as), free(gu), free(ya), free(xp), free(ap), free(xb), free(ab);
  free(acc), free(bk), free(xpk), free(apk), free(sh);
  afd_pairs_free(&pairs);
  return 0;
}
