/* mxfp4.c's matmul pieces, for mxfp4_moe.c. Shapes: W [N, K] as blocks [N, K/32, 16] and scales
 * [N, K/32]; G = K / 32. `wide`: the AVX-512 BF16 route (bf16 x), else AVX2 (fp32 x). */
#ifndef AFD_MXFP4_H
#define AFD_MXFP4_H
#include <stddef.h>
#include <stdint.h>

/* e2m1 code -> its value's bf16 pattern (0, .5, 1, 1.5, 2, 3, 4, 6, then the negatives), twice:
 * vpermw reads 5 bits of an index, and the unpacked codes carry junk in the fifth */
static const uint16_t AFD_E2M1_BF16[32] __attribute__((aligned(64))) = {
    0, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

/* How far ahead of its reads a decoding loop asks for the codes (bytes). Decoding takes as long
 * as reading, and the hardware's prefetcher alone did not overlap the two: a cold stream of codes
 * at one row of x took about twice as long as the same codes in cache (measured on an Intel
 * Xeon, one thread, C harness; 1-8 KiB ahead all helped, from 4 KiB by little more). The AVX2
 * route, which decodes with more instructions, lost more: 2.4x its in-cache time on the same
 * Xeon (both threads), 1.1x with the fetch ahead. */
#define MXFP4_AHEAD 4096

/* Builds the routes' tables (once; every entry point calls it, and callers that use the pieces
 * below from several threads call it first) */
void afd_mxfp4_init(void);

/* Per row of x: the length of its prepared copy (floats for AVX2, bf16 words for AVX-512) */
size_t afd_mxfp4_row_len(int wide, int K);

/* Row m of x [M, K] (bf16, or float32 with f32 set) into the weights' scrambled order: xp
 * [M, K] fp32 (AVX2), or xb [M, afd_mxfp4_row_len(1, K)] bf16 (wide; zero past K). */
void afd_mxfp4_prepare_row(const void *x, int f32, int wide, int m, int K, float *xp,
                           uint16_t *xb);

/* acc[m * N + n] = x[m] . W[n] in fp32 for the M prepared rows and n in n0..n1 */
void afd_mxfp4_rows(const float *xp, const uint16_t *xb, int wide, const uint8_t *blocks,
                    const uint8_t *scales, float *acc, int M, int N, int G, int n0, int n1);
#define AMX_NU 64 /* weight rows per work unit on the AMX route */

/* From how many rows of x (per expert, on average, in mxfp4_moe.c) ISA_AMX takes the AMX
 * route. A tile instruction lowers the core's clock for the vector code around it, decoding
 * included (measured on an Intel Xeon: the decode loop 1.8x slower after one TDPBF16PS), so at
 * one row the AVX-512 route, which uses no tiles, is faster (a layer of 16 MXFP4 experts
 * [2048 x 1024] + [1024 x 1024]: 0.40 vs 0.61 ms at 1 token, 2.15 vs 2.05 at 4 tokens, 8.24 vs
 * 3.97 at 32). */
#define MXFP4_AMX_FROM 2

/* The same on AMX tiles (mxfp4_amx.c): xp is x packed by afd_amx_pack; n0, n1 multiples of 16,
 * n1 - n0 <= AMX_NU; a: a thread's scratch for the decoded codes (64-byte aligned,
 * afd_mxfp4_amx_scratch bytes: AMX_NU G 32 bf16); only where afd_cpu_amx() and every scale
 * byte of rows n0..n1 is 2..252. */
void afd_mxfp4_rows_amx(const uint16_t *xp, const uint8_t *blocks, const uint8_t *scales,
                        float *acc, int M, int N, int G, int n0, int n1, uint16_t *a);
static inline size_t afd_mxfp4_amx_scratch(int G) { return (size_t)AMX_NU * G * 64; }
#endif
