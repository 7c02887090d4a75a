/* Paged decode attention on AMX tiles: the call (attention_chunks.c), which attention.c hands
 * it on the amx path where a K/V head has 8 query heads or more, and its two products
 * (attention_amx.c). Call only where afd_cpu_amx() is true. */
#ifndef AFD_ATTENTION_AMX_H
#define AFD_ATTENTION_AMX_H
#include <stdint.h>

#include "bf16.h"

/* Positions a values call packs at a time (a multiple of 32): their V rows, pairs
 * interleaved, stay in L2 while every head's tiles read them. */
#define AFD_ATTN_AMX_VCHUNK 256

/* Bytes of scratch the scores need for g heads. */
#define AFD_ATTN_AMX_SCORES_SCRATCH(g, D)                                                      \
  ((((size_t)(g) + 15) / 16 * ((size_t)(D) / 32) + 5) * 1024)

/* Bytes of scratch the values need for g heads, len positions and Dv columns. */
#define AFD_ATTN_AMX_VALUES_SCRATCH(g, len, Dv)                                                \
  ((((size_t)(g) + 15) / 16 * 16 * (((size_t)(len) + 31) / 32 * 32) * 2 +                     \
    (size_t)AFD_ATTN_AMX_VCHUNK * (Dv) * 2 + ((size_t)(g) + 15) / 16 * 16 * (Dv) * 4 + 3 * 64))

/* s[j * ld + l] <- bf16(q_j . k_l) * scale for the g query heads q [g, D] (bf16) and the len
 * positions l at element offsets row[l] of cache. */
void afd_attn_amx_scores(const uint16_t *q, const uint16_t *cache, const int64_t *row, int len,
                         int g, int D, float scale, float *s, int ld, void *scratch);

/* out [g, Dv] (fp32) <- sum_l p[j, l] v_l for the probabilities p (fp32 holding bf16 values,
 * row j at p + j * ld) and the V rows at element offsets row[l] of cache. */
void afd_attn_amx_values(const float *p, int ld, int len, int g, int Dv, const uint16_t *cache,
                         const int64_t *row, float *out, void *scratch);

/* The decode on tiles: afd_bf16_decode_attention_ext's arguments and result (attention.c),
 * for the amx path where g >= 8 and D and Dv are multiples of 32. The scores and the values
 * are the tiles', the softmax the other paths' steps, but a row's softmax sum and its values
 * are summed a chunk of positions at a time and the chunks then added in order, so work
 * splits by position as well as by sequence and head, and a long sequence's latent (MLA: one
 * K/V head) is read once however many threads share it. */
int afd_attn_amx_decode(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int64_t *blocks, const int64_t *lens, uint16_t *out, int B,
                        int kvh, int g, int D, int Dv, int NB, int bs, int nb, float scale,
                        const float *sinks, int window, int threads);

#endif
