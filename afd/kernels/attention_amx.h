/* Paged decode attention's two products on AMX tiles (attention_amx.c), called by attention.c
 * per (sequence, K/V head, group of query heads) on the amx path where a K/V head has 8 query
 * heads or more and the width (D for the scores, Dv for the values) is a multiple of 32. Call
 * only where afd_cpu_amx() is true. */
#ifndef AFD_ATTENTION_AMX_H
#define AFD_ATTENTION_AMX_H
#include <stdint.h>

#include "bf16.h"

/* Bytes of scratch afd_attn_amx_scores needs for g heads (64-byte aligned). */
#define AFD_ATTN_AMX_SCRATCH(g, D) ((((size_t)(g) + 15) / 16 * ((size_t)(D) / 32) + 5) * 1024)

/* s [g, len] <- bf16(q_j . k_l) * scale for the g query heads q [g, D] (bf16) and positions l
 * at element offsets row[l] of cache (attention512.h's afd_attn512_scores, on tiles). */
void afd_attn_amx_scores(const uint16_t *q, const uint16_t *cache, const int64_t *row, int len,
                         int g, int D, float scale, float *s, void *scratch);

/* Positions a values pass packs at a time (a multiple of 32): their V rows, pairs interleaved,
 * stay in L2 while every head's tiles read them. */
#define AFD_ATTN_AMX_CHUNK 256

/* Bytes of scratch afd_attn_amx_values needs for g heads, len positions and Dv columns. */
#define AFD_ATTN_AMX_VALUES_SCRATCH(g, len, Dv)                                               \
  ((((size_t)(g) + 15) / 16 * 16 * (((size_t)(len) + 31) / 32 * 32) * 2 +                     \
    (size_t)AFD_ATTN_AMX_CHUNK * (Dv) * 2 + ((size_t)(g) + 15) / 16 * 16 * (Dv) * 4 + 3 * 64))

/* out [g, Dv] (bf16) <- bf16(sum_l p[j, l] v_l) for p [g, len] (fp32 holding bf16 values) and
 * the V rows at element offsets row[l] of cache (attention512.h's afd_attn512_values, on
 * tiles). */
void afd_attn_amx_values(const float *p, int len, int g, int Dv, const uint16_t *cache,
                         const int64_t *row, uint16_t *out, void *scratch);

#endif
