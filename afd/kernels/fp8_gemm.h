/* Block-FP8 weights on the bf16 paths' row functions (fp8_gemm.c), for the fused calls that
 * multiply them (moe.c). */
#ifndef AFD_FP8_GEMM_H
#define AFD_FP8_GEMM_H

#include <stddef.h>
#include <stdint.h>

/* weight rows converted and multiplied at a time: two AMX groups (amx.c's two-tile blocks) */
#define AFD_FP8_CHUNK 32
/* a thread's scratch for afd_fp8_rows at width K: a chunk's rows in bf16, then afd_rows' 4 K
 * floats (the AVX2 path's), each part on whole cache lines */
#define AFD_FP8_ROWS_BYTES(K) (((size_t)AFD_FP8_CHUNK * (K) * 2 + 63) / 64 * 64)
#define AFD_FP8_SCRATCH(K) (AFD_FP8_ROWS_BYTES(K) + ((size_t)4 * (K) * 4 + 63) / 64 * 64)

void afd_fp8_rows(const uint16_t *x, const float *xf, const uint16_t *xp, const uint8_t *q,
                  const float *s, int bk, uint16_t *y, int M, int N, int K, int n0, int n1, int isa,
                  uint16_t *scratch, float *wt);

#endif
