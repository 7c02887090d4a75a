/* Helpers shared by afd's kernels (gemm.c, gemm512.c, moe.c, attention.c, ...): bf16 <-> fp32 and the
 * weight-streaming matmul the other two build on. */
#ifndef AFD_BF16_H
#define AFD_BF16_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* Scratch that vector code reads (copies of x, activations, sums): aligned to a cache line.
 * malloc aligns to 16 bytes only (and a large block mmap'ed to a page plus 16), so a 64-byte
 * load of a row starting at a multiple of 32 bf16 values straddled two lines and cost two
 * reads of L1; on Zen 4 MXFP4's products at 4 rows of x took 1.18x as long from a buffer 16
 * bytes off a line as from an aligned one, 1.34x at 8 rows (C harness, the same code). Free
 * with free(). */
static inline void *afd_alloc64(size_t bytes) {
  return aligned_alloc(64, bytes ? (bytes + 63) / 64 * 64 : 64);
}

static inline __m256 load_bf16(const uint16_t *p) {
  __m128i v = _mm_loadu_si128((const __m128i *)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

static inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

/* fp32 -> bf16 bits, round to nearest even (NaN stays NaN), as torch's .to(torch.bfloat16). */
static inline uint16_t to_bf16(float f) {
  union { float f; uint32_t u; } v = {f};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* [hsum(v0), hsum(v1), hsum(v2), hsum(v3)]: each the same bits as hsum's tree, four at once. */
static inline __m128 hsum4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  __m128 a0 = _mm_add_ps(_mm256_castps256_ps128(v0), _mm256_extractf128_ps(v0, 1));
  __m128 a1 = _mm_add_ps(_mm256_castps256_ps128(v1), _mm256_extractf128_ps(v1, 1));
  __m128 a2 = _mm_add_ps(_mm256_castps256_ps128(v2), _mm256_extractf128_ps(v2, 1));
  __m128 a3 = _mm_add_ps(_mm256_castps256_ps128(v3), _mm256_extractf128_ps(v3, 1));
  _MM_TRANSPOSE4_PS(a0, a1, a2, a3); /* a_j: lane j of each */
  return _mm_add_ps(_mm_add_ps(a0, a2), _mm_add_ps(a1, a3));
}

/* An fp32 rounded to bf16 (and back to fp32), and a bf16 value as fp32. */
static inline float bf16_round(float f) {
  union { uint32_t u; float f; } v = {(uint32_t)to_bf16(f) << 16};
  return v.f;
}

static inline float bf16_value(uint16_t b) {
  union { uint32_t u; float f; } v = {(uint32_t)b << 16};
  return v.f;
}

/* fp32 -> bf16 -> fp32 on 8 lanes, round to nearest even, NaN kept quiet (as to_bf16). */
static inline __m256 round8(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
  __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
  __m256i q = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)),
                               _mm256_set1_epi32((int)0xffff0000u));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, q, nan));
}

/* Four fp32 values as bf16 bits (round8's rounding: to_bf16's), in the low 64 bits. */
static inline __m128i round4_bf16(__m128 v) {
  __m128 r = _mm256_castps256_ps128(round8(_mm256_castps128_ps256(v)));
  __m128i b = _mm_srli_epi32(_mm_castps_si128(r), 16);
  return _mm_packus_epi32(b, b);
}

/* 8 fp32 lanes that already hold bf16 values -> 8 bf16 at p. */
static inline void store8(uint16_t *p, __m256 v) {
  __m256i s = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  __m128i lo = _mm256_castsi256_si128(s), hi = _mm256_extracti128_si256(s, 1);
  _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}

/* e^x = 2^n e^r on 8 lanes (x already clamped to fp32's range): n = round(x / ln2), r = x - n
 * ln2 with |r| <= ln2/2, e^r by its Taylor series to r^7 (truncation < 1e-8 relative). Returns
 * e^r, n in *n. exp8 and experts.h's afd_exp8_any scale it by 2^n. */
static inline __m256 exp8_series(__m256 x, __m256 *n) {
  *n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  /* r = x - n ln2 in two steps (ln2 = 0.693359375 - 2.12194440e-4, the first exact in fp32) */
  __m256 r = _mm256_fnmadd_ps(*n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(*n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  return _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
}

/* e^x on 8 lanes, for the x <= 0 of a softmax after its max is subtracted (below -87.3 the
 * result is flushed to 0, where expf would give a denormal): exp8_series times 2^n through the
 * exponent bits. Within 1 ulp of glibc's expf over [-87, 0] (measured on every 64th float). */
static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), n;
  __m256 p = exp8_series(_mm256_max_ps(x, lo), &n);
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* The weight layout of every matmul here ("packed"): rows in groups of 4, a group [4, K]
 * stored as K/8 runs of 4 x 8 values (row r's values 8s..8s+7 at 32 s + 8 r from the group's
 * start, which is row 4i's row-major offset); the N % 4 rows after the last group stay
 * row-major. A decode matmul reads each group as one sequential run instead of 4 interleaved
 * rows: one stream for the hardware prefetcher instead of four, which brings a weight-streaming
 * loop closer to what a plain read loop gets from DRAM. Each row's values still meet x in the
 * same order, so results are the same bits as row-major. gemm.py's pack() lays a weight out. */

/* y[M, N] (bf16) = xf[M, K] (fp32) @ W[n0..n1, K]^T (bf16, packed; n0 a multiple of 4); wt is
 * scratch for 4 K floats (gemm.c says for what). The thresholds were
 * measured with the weights in cache (docs/benchmarks.md): from PAIR_M rows of x the pair path,
 * each weight vector converted once per chunk of rows, beats 2- and 4-row loops, and by WIDE_M
 * converting 4 weight rows once into fp32 has caught up with it. */
#define PAIR_M 3  /* from 3 rows of x: pair_rows, weights converted once per chunk of rows */
#define WIDE_M 13 /* from 13: 4 weight rows converted once into wt, 2 rows of x at a time */
void afd_rows(const float *xf, const uint16_t *w, uint16_t *y, int M, int N, int K, int n0,
              int n1, float *wt);

/* A matmul of fewer weights than this (256 KiB of bf16) runs on one thread: a second costs
 * more to wake than it saves (gemm.c, gemm512.c, amx.c; decode_layer.c fetches a router that
 * small ahead, since one thread would otherwise wait on each of its lines). */
#define ONE_THREAD_WEIGHTS ((size_t)1 << 17)

/* Rows of W per unit of work in the multi-threaded matmuls (gemm.c, gemm512.c, moe.c): threads
 * take units as they come free (a dynamic schedule), so a thread the OS preempts for another
 * process (the gateway, a client, on a small box) holds up one unit, not the share a static
 * split gave it. On AVX2 and AVX-512 each thread first takes its run of consecutive units
 * (runs.h), where its reads of the weights stream on. A multiple of 4. */
#define ROWS_PER_UNIT 64

/* Up to this many rows of x (measured crossover on Zen 4: 4 rows 0.88x, 8 rows 1.04x of the
 * side-by-side time), gemm512.c reads the weights one row at a time (stream_chunks), above it
 * four rows side by side (group_chunks: a quarter of the loads of x per product, for the batches
 * where the multiplies, not the reads, take the time). On AMD Zen 4 four streams at once read
 * DRAM at about 0.6x the rate of one (measured: docs/benchmarks.md). */
#define STREAM_MAX_M 6

/* The rows of x one register-blocked pass takes, of `left` still to do: chunks of at most 6 of
 * about equal size (7 -> 4 + 3), so no pass runs with a single row that a neighbour could
 * have taken. */
static inline int chunk_rows(int left) {
  int chunks = (left + 5) / 6;
  return (left + chunks - 1) / chunks;
}

/* The same for the AVX-512 BF16 matmul (gemm512.c): x bf16, W row-major; rows n0..n1 of W,
 * n0 a multiple of 4. Call only where afd_cpu_avx512bf16() is true. */
void afd_rows512(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K, int n0,
                 int n1);

/* The AMX path's weight layout (gemm.py's pack_tiles): where N % 16 == 0 and K % 32 == 0, W
 * [N, K] is stored tile by tile, each 16 rows x 32 values (the A operand of one TDPBF16PS, 1
 * KiB) in one run, the tiles of a group of 16 rows in order of K, then the next group's: value
 * (n, k) at ((n / 16 * K / 32 + k / 32) * 16 + n % 16) * 32 + k % 32. A group starts where its
 * first row does in the row-major layout. Other shapes stay row-major. */
static inline int afd_amx_tiled(int N, int K) { return N % 16 == 0 && K % 32 == 0; }

/* The same on AMX tiles (amx.c): x packed by afd_amx_pack (xp, afd_amx_elems(M, K) values) and
 * as it is (x, for the rows of W past the last whole tile); W as afd_amx_tiled lays it out; K %
 * 32 == 0, n0 a multiple of 16. Call only where afd_cpu_amx() is true. */
void afd_rows_amx(const uint16_t *x, const uint16_t *xp, const uint16_t *w, uint16_t *y, int M,
                  int N, int K, int n0, int n1);
void afd_amx_pack(const uint16_t *x, int M, int K, uint16_t *xp);
static inline size_t afd_amx_elems(int M, int K) { return (size_t)((M + 15) / 16) * 16 * K; }
int afd_cpu_avx512bf16(void);
int afd_cpu_amx(void);

/* The kernels' instruction sets (the isa argument): the AVX2 matmul on gemm.py's packed weights,
 * the AVX-512 BF16 one on row-major weights, and the AMX one on tiles (afd_amx_tiled). */
#define ISA_AVX2 0
#define ISA_AVX512 1
#define ISA_AMX 2

/* The library's entry points that decode_layer.c composes (gemm.c, norm_rope.c, attention.c). */
int afd_bf16_gemm(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K,
                  int threads);
int afd_bf16_gemm512(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K,
                     int threads);
int afd_bf16_gemm_amx(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K,
                      int threads);
int afd_bf16_rms_norm(const uint16_t *x, long sa, long sb, const uint16_t *w, uint16_t *y, int A,
                      int B, int D, float eps, int threads, int isa);

/* A matmul on the instruction set (and weight layout) isa names: what the fused calls
 * (decode_layer.c, decode_stack.c) run for the Linear of their path. */
static inline int afd_gemm_isa(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N,
                               int K, int threads, int isa) {
  return (isa == ISA_AMX ? afd_bf16_gemm_amx : isa ? afd_bf16_gemm512 : afd_bf16_gemm)(
      x, w, y, M, N, K, threads);
}
int afd_bf16_rope(const uint16_t *x, long st, uint16_t *y, int T, int H, int D, const uint16_t *cos,
                  const uint16_t *sin, const int64_t *pos, int threads, int isa);
int afd_bf16_rope_heads(const uint16_t *x, long st, long sh, uint16_t *y, long yt, long yh, int T,
                        int H, int D, const uint16_t *cos, const uint16_t *sin, const int64_t *pos,
                        int threads, int isa);
int afd_bf16_head_matmul(const uint16_t *x, long sxt, long sxh, const uint16_t *w, uint16_t *y,
                         long syt, long syh, int T, int nh, int N, int K, int threads, int isa);
int afd_bf16_decode_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *blocks, const int64_t *lens, uint16_t *out, int B,
                              int kvh, int g, int D, int NB, int bs, int nb, float scale,
                              int threads);
int afd_bf16_decode_attention_ext(const uint16_t *q, const uint16_t *k_cache,
                                  const uint16_t *v_cache, const int64_t *blocks,
                                  const int64_t *lens, uint16_t *out, int B, int kvh, int g, int D,
                                  int Dv, int NB, int bs, int nb, float scale, const float *sinks,
                                  int window, int threads, int isa);

/* Query heads a decode attention task takes when `units` pieces of work (sequence, K/V head
 * pairs, or their chunks) are fewer than `threads`: the fewest multiple of 4 that gives every
 * thread a task (the last group may hold fewer), else all g. A head's arithmetic is the same
 * in any group (attention.c, attention_chunks.c). */
static inline int afd_attn_head_group(int g, int units, int threads) {
  if (units >= threads || g <= 4) return g;
  const int want = (threads + units - 1) / units, gs = ((g + want - 1) / want + 3) / 4 * 4;
  return gs < g ? gs : g;
}

/* The sums of 8 vectors, one lane each: [sum(a0), ..., sum(a7)]. */
static inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                            __m256 a6, __m256 a7) {
  __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#endif
