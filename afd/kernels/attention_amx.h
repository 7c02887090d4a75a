/* Paged decode attention's scores on AMX tiles (attention_amx.c), called by attention.c per
 * (sequence, K/V head, group of query heads) on the amx path where D % 32 == 0 and a K/V
 * head has 8 query heads or more. Call only where afd_cpu_amx() is true. */
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

#endif
