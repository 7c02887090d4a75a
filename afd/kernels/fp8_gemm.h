/* Block-FP8 weights on the bf16 paths' row functions (fp8_gemm.c), for the fused calls that
 * multiply them (moe.c). */
#ifndef AFD_FP8_GEMM_H
#define AFD_FP8_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "bf16.h"

/* weight rows converted and multiplied at a time: two AMX groups (amx.c's two-tile blocks) */
#define AFD_FP8_CHUNK 32
/* a thread's scratch for afd_fp8_rows at width K: a chunk's rows in bf16, then afd_rows' 4 K
 * floats (the AVX2 path's), each part on whole cache lines. On the AVX-512 paths of a CPU with
 * AVX-512 VBMI those floats hold the thread's tables instead (fp8_512.h: AFD_FP8_ENTRY bytes
 * a K-block, at most K / 32 of them), cleared by the caller (afd_fp8_tables_clear) before its
 * first afd_fp8_rows. */
#define AFD_FP8_ROWS_BYTES(K) (((size_t)AFD_FP8_CHUNK * (K) * 2 + 63) / 64 * 64)
#define AFD_FP8_SCRATCH(K) (AFD_FP8_ROWS_BYTES(K) + ((size_t)4 * (K) * 4 + 63) / 64 * 64)

/* A thread's cache of tables (fp8_512.h; the AVX-512 paths' use of afd_rows' floats): entry b
 * (K-block b of the weight at hand) is a table (AFD_FP8_TABLE bytes: the 128 low bytes, then
 * the 128 high ones) and, after it, the scale it was built for; 0 where none was (no fast
 * scale is 0). A table depends on its scale alone, so an entry left by another weight with
 * that scale is as good as a new one. */
#define AFD_FP8_TABLE 256
#define AFD_FP8_ENTRY 320

/* No tables yet in the cache at wt (4 K floats), for weights of width up to K: the keys of
 * the K / 32 entries such weights can use (tables need K-blocks of a multiple of 32) zeroed;
 * the tables themselves are written before they are read. */
static inline void afd_fp8_tables_clear(float *wt, int K) {
  for (int b = 0; b < K / 32; b++)
    *(float *)((char *)wt + (size_t)b * AFD_FP8_ENTRY + AFD_FP8_TABLE) = 0.0f;
}

/* A code's bits at fp32's exponent and mantissa: the code sign-extended, shifted left by 20 and
 * masked reads as an fp32 of its value times 2^-120 (subnormal codes as fp32 subnormals). */
#define AFD_FP8_MASK ((int)0x87F00000u)

/* One weight as BlockFP8.dequantize gives it: the code's value times its scale s, s120 = s *
 * 2^120 in fp32, rounded once to bf16. */
static inline uint16_t afd_fp8_weight(uint8_t code, float s120) {
  union { int32_t i; float f; } v = {((int32_t)(int8_t)code << 20) & AFD_FP8_MASK};
  return to_bf16(v.f * s120);
}

/* 8 codes as fp32 values times their block's scale (vs: s * 2^120; the products, unrounded). */
static inline __m256 afd_fp8_products8(const uint8_t *q, __m256 vs) {
  __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q));
  __m256i bits = _mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(AFD_FP8_MASK));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), vs);
}

/* to_bf16's rounding of 8 products of a fast block (afd_fp8_fast: each zero or an fp32 normal
 * below 2^17), as fp32 values. C = p's sign and exponent with 16 added to the exponent puts
 * fp32's last place of p + C where bf16's lies for p, so the sum rounds p to nearest-even there
 * (the bit it ties on is p's own: C has no bits down there) and subtracting C leaves the rounded
 * p exactly. Two FP adds where the integer rounding took two shifts among five operations: on
 * an AVX2 core the shifts share two ports with the conversion's shuffles, the adds do not. A
 * -0 product comes out +0, which no sum begun at +0 can tell apart. */
static inline __m256 afd_fp8_round8_fast(__m256 p) {
  const __m256i up16 = _mm256_set1_epi32(16 << 23);
  __m256i c = _mm256_and_si256(_mm256_castps_si256(p), _mm256_set1_epi32((int)0xff800000u));
  __m256 cf = _mm256_castsi256_ps(_mm256_add_epi32(c, up16));
  return _mm256_sub_ps(_mm256_add_ps(p, cf), cf);
}

void afd_fp8_rows(const uint16_t *x, const float *xf, const uint16_t *xp, const uint8_t *q,
                  const float *s, int bk, uint16_t *y, int M, int N, int K, int n0, int n1, int isa,
                  uint16_t *scratch, float *wt);

/* y [M, N] = x [M, K] @ W^T for a block-FP8 W (fp8_gemm.c); 0, or -1 (bad sizes, memory). */
int afd_fp8_gemm(const uint16_t *x, const uint8_t *q, const float *s, uint16_t *y, int M, int N,
                 int K, int bk, int isa, int threads);

/* A block-FP8 weight's codes and scales as the fused calls' structs hold it (q NULL: the weight
 * is bf16, held beside it). */
typedef struct {
  const uint8_t *q;
  const float *s;
} afd_fp8_ref;

/* A fused call's matmul on a weight that is bf16 (w, laid out for isa) or block-FP8 (codes q,
 * scales s, K-blocks of bk; w unused), as the per-op path's Linear multiplies either. */
static inline int afd_gemm_w(const uint16_t *x, const uint16_t *w, const uint8_t *q,
                             const float *s, int bk, uint16_t *y, int M, int N, int K,
                             int threads, int isa) {
  return q ? afd_fp8_gemm(x, q, s, y, M, N, K, bk, isa, threads)
           : afd_gemm_isa(x, w, y, M, N, K, threads, isa);
}

/* At most STREAM_MAX_M rows of x on an AVX-512 BF16 CPU, and at most 2 (x in fp32) on the
 * AVX2 path: fp8_stream.c. */
void afd_fp8_stream_rows(const uint16_t *x, const uint8_t *q, const float *s, int bk, uint16_t *y,
                         int M, int N, int K, int n0, int n1, uint8_t *tables);
/* Whether the CPU has AVX-512 VBMI (fp8_512.h's tables). */
int afd_cpu_vbmi(void);
void afd_fp8_stream_rows_avx2(const float *xf, const uint8_t *q, const float *s, int bk,
                              uint16_t *y, int M, int N, int K, int n0, int n1);

#endif
