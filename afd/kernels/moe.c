/* Routed experts, fused (loaded with ctypes by afd/kernels/moe.py).
 *
 * One call per layer for every routed expert a shard holds, instead of ~6 torch ops per expert:
 * the (token, expert) pairs this shard holds are sorted by expert, then for each expert e with
 * n tokens,
 *   gate|up = x[tokens] @ w13[e]^T      (bf16, as F.linear), + its bias (bf16) where it has one
 *   a       = bf16(bf16(silu(gate)) * up) (as F.silu then *, each rounded to bf16), or gpt-oss's
 *             clamped SwiGLU (experts.h)
 *   y       = a @ w2[e]^T                 (bf16), + its bias (bf16) where it has one
 *   ys      = bf16(y * weight)            (the pair's routing weight, a bf16 value)
 * then out[token] += ys in pair order, summed in fp32 and rounded once, as index_add_ does: every
 * rounding step of the torch path in services/ffn/experts.py, so the two agree (bar a rare last-bit
 * difference of expf inside the activation). Each matmul is cut into units of ROWS_PER_UNIT weight rows,
 * every expert's units taken by whichever thread comes free (bf16.h); the sum is split by
 * columns, each summed in pair order. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "experts.h"
#include "fp8_gemm.h"
#include "runs.h"

/* x [T, H]; ids [T, topk] (int32, global expert ids) and gate weights [T, topk] (fp32) as routed;
 * this shard holds experts first .. first + E - 1: w13 [E] -> [2I, H], w2 [E] -> [H, I];
 * out [T, H] accumulated into. All bf16 except as noted. reverse: visit the experts last to
 * first (the results do not change). isa: ISA_AVX2 for the AVX2 matmul on gemm.py's packed
 * weights, ISA_AVX512 for the AVX-512 BF16 one on row-major weights (gemm512.c), ISA_AMX for
 * AMX tiles on weights laid out for them (amx.c, afd_amx_tiled; a matrix whose K, H for w13 or I
 * for w2, is not a multiple of 32 is row-major and takes AVX-512). b13 [E] -> [2I]
 * and b2 [E] -> [H]: the experts' biases (gpt-oss), or NULL for none; act, limit, alpha: the activation
 * (experts.h), SwiGLU above. q13, s13, q2, s2 (all or none): block-FP8 experts (afd/blockfp8.py:
 * e4m3 codes [2I, H] and [H, I], float32 scales per row and K-block of bk), multiplied through
 * fp8_gemm.c's conversion on the same path with the dense weights' bits; w13 and w2 are then
 * unused. Returns 0, or -1 when H or I is not a multiple of 8 or memory is short. */
int afd_bf16_moe_ext(const uint16_t *x, const int32_t *ids, const float *gate, int topk,
                     int first, const uint16_t *const *w13, const uint16_t *const *w2,
                     uint16_t *out, int T, int E, int H, int I, int threads, int reverse, int isa,
                     const uint16_t *const *b13, const uint16_t *const *b2, int act_kind,
                     float limit, float alpha, const uint8_t *const *q13,
                     const float *const *s13, const uint8_t *const *q2, const float *const *s2,
                     int bk) {
  if (H % 8 != 0 || I % 8 != 0 || E <= 0 || topk < 0 || (q13 && bk <= 0)) return -1;
  afd_pairs pairs; /* sorted by expert as the torch path's argsort (experts.h) */
  if (afd_pairs_sort(ids, gate, T, topk, first, E, &pairs)) return -1;
  const int P = pairs.P;
  const int32_t *starts = pairs.starts, *expert = pairs.expert;
  const int64_t *tokens = pairs.tokens;
  if (P == 0) {
    afd_pairs_free(&pairs);
    return 0;
  }
  uint16_t *ys = (uint16_t *)afd_alloc64((size_t)P * H * sizeof(uint16_t));
  if (!ys) {
    afd_pairs_free(&pairs);
    return -1;
  }
  /* Every held pair's row of x, its gate|up and its activation, all experts at once (P rows
   * each, by expert): fp32 for the AVX2 matmul, bf16 for AVX-512. */
  const size_t xsz = isa ? sizeof(uint16_t) : sizeof(float);
  const int t = threads > 1 ? threads : 1, K = H > I ? H : I;
  const int n13 = (2 * I + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT;
  const int n2 = (H + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT;
  char *xs = (char *)afd_alloc64((size_t)P * H * xsz);
  uint16_t *gu = (uint16_t *)afd_alloc64((size_t)P * 2 * I * sizeof(uint16_t));
  char *act = (char *)afd_alloc64((size_t)P * I * xsz);
  float *wt = (float *)afd_alloc64((size_t)t * 4 * K * sizeof(float)); /* afd_rows' scratch */
  /* FP8 experts: a thread's chunk of converted rows (fp8_gemm.h) */
  uint16_t *fs = q13 ? (uint16_t *)afd_alloc64((size_t)t * AFD_FP8_ROWS_BYTES(K)) : NULL;
  int *units = (int *)malloc((size_t)E * sizeof(int)); /* the held experts */
  /* AMX, per matrix (its K a multiple of 32): each expert's rows of x (w13) or of its
   * activations (w2) also packed for the tiles (afd_amx_pack), from block at[e] of 16 rows */
  const int amx = isa == ISA_AMX && (H % 32 == 0 || I % 32 == 0) && afd_cpu_amx();
  const int amx13 = amx && H % 32 == 0, amx2 = amx && I % 32 == 0;
  size_t *at = amx ? (size_t *)malloc((size_t)(E + 1) * sizeof(size_t)) : NULL;
  uint16_t *xsp = NULL, *actp = NULL;
  if (at) {
    at[0] = 0;
    for (int e = 0; e < E; e++) at[e + 1] = at[e] + (size_t)(starts[e + 1] - starts[e] + 15) / 16;
    if (amx13)
      xsp = (uint16_t *)aligned_alloc(64, afd_amx_elems(16 * (int)at[E], H) * sizeof(uint16_t));
    if (amx2)
      actp = (uint16_t *)aligned_alloc(64, afd_amx_elems(16 * (int)at[E], I) * sizeof(uint16_t));
  }
  if (!xs || !gu || !act || !wt || !units || (q13 && !fs) ||
      (amx && (!at || (amx13 && !xsp) || (amx2 && !actp)))) {
    free(ys), free(xs), free(gu), free(act), free(wt), free(units), free(at), free(xsp), free(actp);
    free(fs);
    afd_pairs_free(&pairs);
    return -1;
  }
  /* each matrix's path for the FP8 conversion: AMX where its K is whole tiles, else AVX-512
   * on row-major rows (as above), or AVX2 */
  const int isa13 = amx13 ? ISA_AMX : isa ? ISA_AVX512 : ISA_AVX2;
  const int isa2 = amx2 ? ISA_AMX : isa ? ISA_AVX512 : ISA_AVX2;
  /* The held experts in visiting order; each matmul cut into units of ROWS_PER_UNIT weight rows
   * that threads take as they come free: a layer's few experts at a small batch still spread
   * over every thread, and a thread preempted by another process holds up one unit. */
  int held = 0;
  for (int i = 0; i < E; i++) {
    int e = reverse ? E - 1 - i : i;
    if (starts[e + 1] > starts[e]) units[held++] = e;
  }
  /* Each thread takes its run of consecutive units in the two matmul loops (runs.h), where the
   * weights' reads bound them (a batch of 32 gives an expert ~4 rows of x, still streamed; the
   * units' products differ in number from expert to expert, which the stealing evens out):
   * on AVX-512 1.07x the units in turn at a batch of 32, on AVX2 (its pair path fetching the
   * next group as it multiplies, gemm.c) 1.07x at 8, 1.1-1.18x at 32, 1.08x at 64 (Zen 4). */
  const int streams = isa == ISA_AVX512 || isa == ISA_AVX2;
  const int nr = streams ? t : 1;
  float *acc = (float *)afd_alloc64((size_t)t * H * sizeof(float)); /* the sum's: a row a thread */
  uint64_t *runs13 = (uint64_t *)aligned_alloc(64, 2 * AFD_RUNS_WORDS(nr) * sizeof(uint64_t));
  if (!acc || !runs13) {
    free(ys), free(xs), free(gu), free(act), free(wt), free(units), free(at), free(xsp), free(actp);
    free(acc), free(runs13), free(fs);
    afd_pairs_free(&pairs);
    return -1;
  }
  uint64_t *runs2 = runs13 + AFD_RUNS_WORDS(nr);
  afd_runs_init(runs13, nr, held * n13);
  afd_runs_init(runs2, nr, held * n2);
  /* Everything but the sort runs on every thread: at a batch of 32 the serial copies and
   * packs left the other core idle for a tenth of a decode step. */
#pragma omp parallel num_threads(t) if (t > 1)
  {
    const int me = nr > 1 ? omp_get_thread_num() : 0; /* the runs' thread (runs.h) */
    float *mine = wt + (size_t)(t > 1 ? omp_get_thread_num() : 0) * 4 * K;
    if (q13) afd_fp8_tables_clear(mine, K); /* K: the wider of H and I */
    uint16_t *fmine = fs ? (uint16_t *)((char *)fs + (size_t)(t > 1 ? omp_get_thread_num() : 0) *
                                                         AFD_FP8_ROWS_BYTES(K))
                         : NULL;
#pragma omp for schedule(static)
    for (int p = 0; p < P; p++) { /* each held pair's row of x */
      const uint16_t *src = x + (size_t)tokens[p] * H;
      if (isa)
        memcpy(xs + (size_t)p * H * xsz, src, (size_t)H * sizeof(uint16_t));
      else
        for (int k = 0; k < H; k += 8)
          _mm256_storeu_ps((float *)xs + (size_t)p * H + k, load_bf16(src + k));
    }
    if (amx13) {
#pragma omp for schedule(dynamic, 1)
      for (int i = 0; i < held; i++) {
        int e = units[i];
        afd_amx_pack((const uint16_t *)xs + (size_t)starts[e] * H, starts[e + 1] - starts[e], H,
                     xsp + at[e] * 16 * H);
      }
    }
    /* gate|up = x[tokens] @ w13[e]^T */
    for (int u; (u = afd_runs_next(runs13, nr, me)) >= 0;) {
      int e = units[u / n13], p0 = starts[e], n = starts[e + 1] - p0;
      int n0 = u % n13 * ROWS_PER_UNIT, n1 = n0 + ROWS_PER_UNIT < 2 * I ? n0 + ROWS_PER_UNIT : 2 * I;
      if (q13) /* xs: bf16 rows on the AVX-512 paths, fp32 on AVX2 */
        afd_fp8_rows((const uint16_t *)xs + (size_t)p0 * H, (const float *)xs + (size_t)p0 * H,
                     amx13 ? xsp + at[e] * 16 * H : NULL, q13[e], s13[e], bk,
                     gu + (size_t)p0 * 2 * I, n, 2 * I, H, n0, n1, isa13, fmine, mine);
      else if (amx13)
        afd_rows_amx((const uint16_t *)xs + (size_t)p0 * H, xsp + at[e] * 16 * H, w13[e],
                     gu + (size_t)p0 * 2 * I, n, 2 * I, H, n0, n1);
      else if (isa)
        afd_rows512((const uint16_t *)xs + (size_t)p0 * H, w13[e], gu + (size_t)p0 * 2 * I, n,
                    2 * I, H, n0, n1);
      else
        afd_rows((const float *)xs + (size_t)p0 * H, w13[e], gu + (size_t)p0 * 2 * I, n, 2 * I,
                 H, n0, n1, mine);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int p = 0; p < P; p++) /* a = act(gate [+ bias], up [+ bias]) */
      afd_act_row(gu + (size_t)p * 2 * I, NULL, b13 ? b13[expert[p]] : NULL, I, act_kind, limit,
                  alpha, isa ? (uint16_t *)act + (size_t)p * I : NULL,
                  isa ? NULL : (float *)act + (size_t)p * I);
    if (amx2) {
#pragma omp for schedule(static)
      for (int i = 0; i < held; i++) {
        int e = units[i];
        afd_amx_pack((const uint16_t *)act + (size_t)starts[e] * I, starts[e + 1] - starts[e], I,
                     actp + at[e] * 16 * I);
      }
    }
    for (int u; (u = afd_runs_next(runs2, nr, me)) >= 0;) { /* y = a @ w2[e]^T */
      int e = units[u / n2], p0 = starts[e], n = starts[e + 1] - p0;
      int n0 = u % n2 * ROWS_PER_UNIT, n1 = n0 + ROWS_PER_UNIT < H ? n0 + ROWS_PER_UNIT : H;
      if (q2)
        afd_fp8_rows((const uint16_t *)act + (size_t)p0 * I, (const float *)act + (size_t)p0 * I,
                     amx2 ? actp + at[e] * 16 * I : NULL, q2[e], s2[e], bk, ys + (size_t)p0 * H,
                     n, H, I, n0, n1, isa2, fmine, mine);
      else if (amx2)
        afd_rows_amx((const uint16_t *)act + (size_t)p0 * I, actp + at[e] * 16 * I, w2[e],
                     ys + (size_t)p0 * H, n, H, I, n0, n1);
      else if (isa)
        afd_rows512((const uint16_t *)act + (size_t)p0 * I, w2[e], ys + (size_t)p0 * H, n, H, I,
                    n0, n1);
      else
        afd_rows((const float *)act + (size_t)p0 * I, w2[e], ys + (size_t)p0 * H, n, H, I, n0,
                 n1, mine);
    }
#pragma omp barrier
    /* out += bf16((y [+ bias]) * weight) pair by pair (index_add_), threads by tokens */
    float *row = acc + (size_t)(t > 1 ? omp_get_thread_num() : 0) * H;
#pragma omp for schedule(static)
    for (int r = 0; r < T; r++) afd_pairs_sum(&pairs, b2, ys, NULL, H, row, out, r, r + 1);
  }
  free(xs), free(gu), free(act), free(wt), free(units), free(at), free(xsp), free(actp);
  free(acc), free(ys), free(runs13), free(fs);
  afd_pairs_free(&pairs);
  return 0;
}

/* The SwiGLU experts without biases (Qwen3-MoE, Mixtral, DeepSeek, Step-3): decode_stack.c's. */
int afd_bf16_moe(const uint16_t *x, const int32_t *ids, const float *gate, int topk, int first,
                 const uint16_t *const *w13, const uint16_t *const *w2, uint16_t *out, int T,
                 int E, int H, int I, int threads, int reverse, int isa) {
  return afd_bf16_moe_ext(x, ids, gate, topk, first, w13, w2, out, T, E, H, I, threads, reverse,
                          isa, NULL, NULL, ACT_SWIGLU, 0.0f, 0.0f, NULL, NULL, NULL, NULL, 0);
}
