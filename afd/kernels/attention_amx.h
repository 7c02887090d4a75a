/* Paged decode attention on AMX tiles (attention_amx.c), called by attention.c on the amx
 * path where a K/V head has 8 query heads or more. Call only where afd_cpu_amx() is true. */
#ifndef AFD_ATTENTION_AMX_H
#define AFD_ATTENTION_AMX_H
#include <stdint.h>

#include "bf16.h"

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
