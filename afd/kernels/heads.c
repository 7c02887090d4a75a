/* Each head's own matmul (loaded with ctypes by afd/kernels/heads.py): MLA's absorbed form
 * multiplies every head's query by that head's W_UK and every head's attention-weighted latent
 * by its W_UV, matrices too small for a thread each to be worth waking per matmul, so a call
 * gives each thread whole heads and runs each head's matmul on that thread alone, on the
 * kernels (and weight layout) of the path's Linear (afd_gemm_isa: the same code as a Linear of
 * the same shape, so a head's results are that matmul's bits).
 *
 *   y[t, h, :] = x[t, h, :] @ W_h^T    for t < T, h < nh;  W_h [N, K]
 *
 * torch's batched matmul for these shapes (oneDNN, fresh outputs) took several times the
 * matrices' read time at decode sizes; where x's or y's rows are strided (a head's slice of a
 * wider row) each thread copies its head's rows through a buffer of its own. */
#include <omp.h>
#include <string.h>

#include "bf16.h"

/* x viewed as [T, nh, K] with strides (sxt, sxh, 1), y as [T, nh, N] with strides (syt, syh, 1);
 * w [nh, N, K], each head's matrix laid out for isa (gemm.py: lay_out) and N * K values apart.
 * Returns 0, or -1 (bad sizes, memory short). */
int afd_bf16_head_matmul(const uint16_t *x, long sxt, long sxh, const uint16_t *w, uint16_t *y,
                         long syt, long syh, int T, int nh, int N, int K, int threads, int isa) {
  if (T <= 0 || nh <= 0 || N <= 0 || K <= 0 || K % 8 != 0) return -1;
  const int t = threads < nh ? threads : nh;
  const size_t xs = (size_t)T * K, per = ((size_t)T * (K + N) + 31) / 32 * 32; /* values */
  uint16_t *buf = (uint16_t *)afd_alloc64(per * 2 * (t > 0 ? t : 1));
  if (!buf) return -1;
  int rc = 0;
#pragma omp parallel for num_threads(t) schedule(static) if (t > 1) reduction(| : rc)
  for (int h = 0; h < nh; h++) {
    uint16_t *xb = buf + per * (t > 1 ? omp_get_thread_num() : 0), *yb = xb + xs;
    for (int i = 0; i < T; i++) memcpy(xb + (size_t)i * K, x + i * sxt + h * sxh, (size_t)K * 2);
    rc |= afd_gemm_isa(xb, w + (size_t)h * N * K, yb, T, N, K, 1, isa);
    for (int i = 0; i < T; i++) memcpy(y + i * syt + h * syh, yb + (size_t)i * N, (size_t)N * 2);
  }
  free(buf);
  return rc ? -1 : 0;
}
