/* mxfp4.c's matmul pieces, for mxfp4_moe.c. Shapes: W [N, K] as blocks [N, K/32, 16] and scales
 * [N, K/32]; G = K / 32. `wide`: the AVX-512 BF16 route (bf16 x), else AVX2 (fp32 x). */
#ifndef AFD_MXFP4_H
#define AFD_MXFP4_H
#include <stdint.h>

/* vmap[i]: the element of a 64-weight group that scrambled position i holds */
void afd_mxfp4_vmap(int wide, int vmap[64]);

/* Row m of x [M, K] (bf16, or float32 with f32 set) into the scrambled buffers: xp [M, K] fp32
 * (AVX2), or xb [M, (G/2) * 64] bf16 and xtail [M, 32] fp32 (wide). */
void afd_mxfp4_prepare_row(const void *x, int f32, int wide, const int vmap[64], int m, int K,
                           float *xp, uint16_t *xb, float *xtail);

/* acc[m * N + n] = x[m] . W[n] in fp32 for the M prepared rows and n in n0..n1 */
void afd_mxfp4_rows(const float *xp, const uint16_t *xb, const float *xtail, int wide,
                    const uint8_t *blocks, const uint8_t *scales, float *acc, int M, int N, int G,
                    int n0, int n1);
#endif
