/* A dense MLP added into a bf16 result in one native call (loaded with ctypes by
 * afd/kernels/mlp.py): DeepSeek's shared expert and a dense layer's MLP on the FFN side, and the
 * same in the decode stack (decode_stack.c), so both compute it with the same calls:
 *
 *   out = bf16(out + act(x @ w13^T) @ w2^T)     w13 [2I, H]: gate rows, then up rows
 *
 * the matmuls on the path's kernels (afd_gemm_isa), the activation experts.c's (each step
 * rounded to bf16 as the torch path rounds it; its exp may differ from torch's in the last bit,
 * experts.h), the add rounded once as torch's `out += y`. */
#include <stdlib.h>

#include "bf16.h"
#include "experts.h"
#include "fp8_gemm.h"

/* x [T, H], out [T, H] bf16 (H % 8 == 0, I % 8 == 0); w13, w2 laid out for isa, or block-FP8
 * (codes q13, q2 and scales s13, s2 with K-blocks of bk; NULL: bf16). act, limit, alpha:
 * experts.h's activation. Returns 0, or -1 (bad sizes, memory short). */
int afd_bf16_mlp_add_ext(const uint16_t *x, const uint16_t *w13, const uint16_t *w2,
                         uint16_t *out, int T, int H, int I, int act, float limit, float alpha,
                         int threads, int isa, const uint8_t *q13, const float *s13,
                         const uint8_t *q2, const float *s2, int bk) {
  if (T <= 0 || H % 8 || I % 8 || I <= 0) return -1;
  uint16_t *gu = (uint16_t *)afd_alloc64((size_t)T * 2 * I * 2);
  uint16_t *a = (uint16_t *)afd_alloc64((size_t)T * I * 2);
  uint16_t *y = (uint16_t *)afd_alloc64((size_t)T * H * 2);
  int rc = gu && a && y ? 0 : -1;
  if (!rc) rc = afd_gemm_w(x, w13, q13, s13, bk, gu, T, 2 * I, H, threads, isa);
  if (!rc) {
    for (int t = 0; t < T; t++)
      afd_act_row(gu + (size_t)t * 2 * I, NULL, NULL, I, act, limit, alpha, a + (size_t)t * I,
                  NULL);
    rc = afd_gemm_w(a, w2, q2, s2, bk, y, T, H, I, threads, isa);
  }
  if (!rc)
    for (size_t i = 0; i < (size_t)T * H; i += 8) /* bf16 + bf16, rounded once */
      store8(out + i, round8(_mm256_add_ps(load_bf16(out + i), load_bf16(y + i))));
  free(gu), free(a), free(y);
  return rc;
}

/* The same on bf16 weights. */
int afd_bf16_mlp_add(const uint16_t *x, const uint16_t *w13, const uint16_t *w2, uint16_t *out,
                     int T, int H, int I, int act, float limit, float alpha, int threads,
                     int isa) {
  return afd_bf16_mlp_add_ext(x, w13, w2, out, T, H, I, act, limit, alpha, threads, isa, NULL,
                              NULL, NULL, NULL, 0);
}
