/* Paged decode attention's two products on AVX-512 BF16 (attention512.c), called by
 * attention.c per (sequence, K/V head) where the isa argument asks for them and D % 32 == 0.
 * Call only where afd_cpu_avx512bf16() is true. */
#ifndef AFD_ATTENTION512_H
#define AFD_ATTENTION512_H
#include <stdint.h>

#include "bf16.h"

/* s [g, len] <- bf16(q_j . k_l) * scale for the g query heads q [g, D] (bf16) and positions
 * l at element offsets row[l] of cache; zero: D zeros (stand-ins for rows past len). */
void afd_attn512_scores(const uint16_t *q, const uint16_t *cache, const int64_t *row, int len,
                        int g, int D, float scale, const uint16_t *zero, float *s);

/* out [g, D] (bf16) <- bf16(sum_l p[j, l] v_l) for p [g, len] (fp32 holding bf16 values);
 * pb: scratch for g * (len rounded up to even) bf16. */
void afd_attn512_values(const float *p, int len, int g, int D, const uint16_t *cache,
                        const int64_t *row, const uint16_t *zero, uint16_t *pb, uint16_t *out);

/* A softmax row's middle passes on 16 lanes (attention.c: softmax_rows; needs AVX-512 F only),
 * the same bits as its 8-lane loops: each returns how many of the len values it did (a multiple
 * of 16), the 8-lane loop does the rest.
 * exp_sum: s[l] <- exp(s[l] - m), acc [8] (in and out) the 8-lane running sum, each 16 values
 *          added as two 8-lane halves in order, as the 8-lane loop adds them.
 * normalize: s[l] <- bf16(s[l] / sum). */
int afd_softmax512_exp_sum(float *s, int len, float m, float acc[8]);
int afd_softmax512_normalize(float *s, int len, float sum);

#endif
