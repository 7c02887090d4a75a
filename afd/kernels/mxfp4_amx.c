/* MXFP4 weights (mxfp4.c's layout: blocks [N, G, 16], scales [N, G]) times x on AMX tiles.
 *
 * One MXFP4 block is 32 values of a row, exactly one row of a bf16 A tile (16 rows x 32
 * values): the 16 weight rows' codes of each block column become one bf16 tile in a buffer
 * (L1 or L2), which the tiles multiply by x (packed as amx.c packs it) for every 16 rows of x
 * at once. The block's scale is folded into the values: a code's bf16 pattern comes from a
 * 32-word table (vpermw, the code in each word's low 4 bits) whose non-zero entries have the
 * power of two added to their exponent first. That is exact where the scaled values stay
 * normal bf16 numbers: scale bytes 2..252 (MXFP4.foldable checks a weight's scales once and keeps
 * the other paths for one outside them; real checkpoints sit far inside). The tile then sums
 * exactly what amx.c sums for the dequantized bf16 weight, in the same order: the same bits.
 *
 * Decoding costs a handful of instructions per 32 weights whatever the batch, and the products
 * are the tile's: from a few rows of x this beats decoding for vdpbf16ps, whose products grow
 * with the rows (mxfp4.c). At one row it does not: a tile instruction lowers the core's clock
 * for the decoding around it (MXFP4_AMX_FROM, mxfp4.h). A unit's codes are decoded first,
 * read front to back and asked for ahead of the reads (the decoding otherwise waits on each
 * cold line), then multiplied from L1/L2. */

#include "amx.h"
#include "bf16.h"
#include "mxfp4.h"

/* AFD_E2M1_BF16 with scale byte e folded in, for every byte: entry i's exponent raised by e -
 * 127 (the 16-bit add wraps as the masked add of a shift did), +0 and -0 left as they are.
 * A block's table is then one load instead of a broadcast, a copy and a masked add (the decode
 * loop's vector ports are its bound on the tiles' lowered clock). Bytes outside 2..252 give
 * garbage that no caller reads (MXFP4.foldable). Filled once when the library loads. */
static uint16_t SCALED[256][32] __attribute__((aligned(64)));

__attribute__((constructor)) static void fill_scaled(void) {
  for (int e = 0; e < 256; e++) {
    const uint16_t shift = (uint16_t)((e - 127) * 128);
    for (int i = 0; i < 32; i++) {
      const uint16_t v = AFD_E2M1_BF16[i];
      SCALED[e][i] = (v & 0x7fff) ? (uint16_t)(v + shift) : v;
    }
  }
}

/* 16 weight rows (codes: the first row's blocks; scales [16][G]: their scale bytes) -> out
 * [G][16][32] bf16, scaled: block column s is the A tile at out + s * 512. The codes are read
 * front to back (the 16 rows are one run of memory); two shuffles per 32 weights (the widening
 * and vpermw). */
static AMX void decode_group(const uint8_t *codes, const uint8_t *scales, int G, uint16_t *out) {
  for (int r = 0; r < 16; r++)
    for (int s = 0; s < G; s++) {
      /* byte j's low nibble is element 2j, its high nibble 2j + 1: one dword per byte; times
       * 4097 (the dword plus itself shifted up 12, one vpmaddwd: the two never overlap) its
       * low word still has the low nibble in bits 0-3 (vpermw reads bits 0-4; the table
       * repeats for bit 4) and its high word is the high nibble */
      const uint8_t *b = codes + ((size_t)r * G + s) * 16;
      if (s % 4 == 0) _mm_prefetch((const char *)b + MXFP4_AHEAD, _MM_HINT_T0);
      __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
      __m512i idx = _mm512_madd_epi16(d, _mm512_set1_epi32(4097));
      __m512i scaled = _mm512_load_si512((const void *)SCALED[scales[(size_t)r * G + s]]);
      _mm512_store_si512((void *)(out + ((size_t)s * 16 + r) * 32),
                         _mm512_permutexvar_epi16(idx, scaled));
    }
}

/* A tile of sums c [16 weight rows][16 rows of x] -> acc[m * N + n + i], m from mb * 16. */
static AMX void put_f32(const float *c, float *acc, int M, int N, int mb, int n) {
  const int rows = M - mb * 16 < 16 ? M - mb * 16 : 16;
  for (int i = 0; i < rows; i++)
    _mm512_storeu_ps(acc + (size_t)(mb * 16 + i) * N + n, afd_amx_column(c, i));
}

/* The tile of sums t (a constant) -> acc rows of x mb*16.., weight rows n.. */
#define PUT(t, mb, n)                \
  do {                               \
    _tile_stored(t, c, 64);          \
    put_f32(c, acc, M, N, mb, n);    \
  } while (0)

/* acc[m * N + n] = x[m] . W[n] in fp32 for the M rows of x (xp: afd_amx_pack's layout of x
 * [M, 32 G]) and n in n0..n1, both multiples of 16, n1 - n0 <= AMX_NU; a: scratch of
 * AMX_NU G 32 bf16, this thread's, 64-byte aligned. Call only where
 * afd_cpu_amx() is true and every scale byte of these rows is 2..252.
 *
 * The rows' codes are decoded first (decode_group, into a, read by the tiles from L1 or L2),
 * then multiplied: four tiles of sums side by side (each depends on the one before it over the
 * block columns), four groups of 16 weight rows against one block of x, or two groups against
 * two blocks. */
AMX void afd_mxfp4_rows_amx(const uint16_t *xp, const uint8_t *blocks, const uint8_t *scales,
                            float *acc, int M, int N, int G, int n0, int n1, uint16_t *a) {
  const int MB = (M + 15) / 16, groups = (n1 - n0) / 16;
  const size_t xblock = afd_amx_elems(1, 32 * G), ablock = (size_t)G * 512;
  float c[16 * 16] __attribute__((aligned(64)));
  const char *codes = (const char *)(blocks + (size_t)n0 * G * 16);
  const size_t bytes = (size_t)groups * 16 * G * 16; /* the unit's codes */
  for (size_t i = 0; i < bytes && i < MXFP4_AHEAD; i += 64) _mm_prefetch(codes + i, _MM_HINT_T0);
  for (int g = 0; g < groups; g++)
    decode_group(blocks + (size_t)(n0 + 16 * g) * G * 16, scales + (size_t)(n0 + 16 * g) * G, G,
                 a + g * ablock);
  afd_amx_configure();
  int mb = 0;
  for (; mb + 2 <= MB; mb += 2) { /* two blocks of x, two groups of W at a time */
    const uint16_t *x0 = xp + (size_t)mb * xblock, *x1 = x0 + xblock;
    for (int g = 0; g < groups; g += 2) {
      const int two = g + 1 < groups;
      const uint16_t *a0 = a + g * ablock, *a1 = a0 + ablock;
      afd_amx_zero_sums();
      for (int s = 0; s < G; s++) {
        _tile_loadd(6, x0 + (size_t)s * 512, 64);
        _tile_loadd(7, x1 + (size_t)s * 512, 64);
        _tile_loadd(4, a0 + (size_t)s * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, a1 + (size_t)s * 512, 64);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      const int n = n0 + 16 * g;
      PUT(0, mb, n);
      PUT(1, mb + 1, n);
      if (two) {
        PUT(2, mb, n + 16);
        PUT(3, mb + 1, n + 16);
      }
    }
  }
  if (mb < MB) { /* one block of x, up to four groups of W */
    const uint16_t *x0 = xp + (size_t)mb * xblock;
    afd_amx_zero_sums();
    for (int s = 0; s < G; s++) {
      const uint16_t *as = a + (size_t)s * 512;
      _tile_loadd(6, x0 + (size_t)s * 512, 64);
      _tile_loadd(4, as, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (groups > 1) {
        _tile_loadd(5, as + ablock, 64);
        _tile_dpbf16ps(1, 5, 6);
      }
      if (groups > 2) {
        _tile_loadd(4, as + 2 * ablock, 64);
        _tile_dpbf16ps(2, 4, 6);
      }
      if (groups > 3) {
        _tile_loadd(5, as + 3 * ablock, 64);
        _tile_dpbf16ps(3, 5, 6);
      }
    }
    PUT(0, mb, n0);
    if (groups > 1) PUT(1, mb, n0 + 16);
    if (groups > 2) PUT(2, mb, n0 + 32);
    if (groups > 3) PUT(3, mb, n0 + 48);
  }
  _tile_release();
}
