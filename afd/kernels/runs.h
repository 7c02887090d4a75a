/* How the streaming matmuls (gemm512.c at up to STREAM_MAX_M rows of x, gemm.c below PAIR_M,
 * moe.c's experts at every batch on AVX-512 and at 1-2 tokens on AVX2) share their units of
 * weight rows among threads.
 *
 * Each thread takes one run of consecutive units, front to back: the reads bound these calls, and
 * on AMD Zen 4 two threads taking 128 KiB units in turn read DRAM at ~0.85x the rate of two long
 * runs (docs/benchmarks.md). A thread whose run is done takes units one at a time from the back
 * of the run with the most left, so a thread the OS preempts for a neighbour (the gateway, a
 * client, on a small box) holds up the call by one unit, not by the rest of its run: with a
 * plain static split the other thread waited at the barrier instead.
 *
 * With a single run that every thread claims from (t = 1, me = 0 for all), the units go out in
 * order as threads come free: OpenMP's schedule(dynamic, 1), which the compute-bound calls keep.
 *
 * A run is one 64-bit word (next unit from the front << 32 | end), changed only by
 * compare-and-swap, each on its own cache line. */
#ifndef AFD_RUNS_H
#define AFD_RUNS_H

#include <stddef.h>
#include <stdint.h>

/* uint64_t words a table of t runs takes (one 64-byte line per run) */
#define AFD_RUNS_WORDS(t) ((size_t)(t) * 8)

/* runs[AFD_RUNS_WORDS(t)]: units [0, n) split into t runs of about equal length, in order */
static inline void afd_runs_init(uint64_t *runs, int t, int n) {
  for (int i = 0; i < t; i++) {
    uint64_t lo = (uint64_t)n * i / t, hi = (uint64_t)n * (i + 1) / t;
    __atomic_store_n(&runs[8 * i], lo << 32 | hi, __ATOMIC_RELEASE);
  }
}

/* The next unit for thread `me` (of t runs): the front of its own run, else the back of the run
 * with the most left; -1 when every unit is taken. */
static inline int afd_runs_next(uint64_t *runs, int t, int me) {
  uint64_t *own = &runs[8 * (me < t ? me : 0)];
  uint64_t v = __atomic_load_n(own, __ATOMIC_ACQUIRE);
  while ((uint32_t)(v >> 32) < (uint32_t)v)
    if (__atomic_compare_exchange_n(own, &v, v + (1ull << 32), 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
      return (int)(v >> 32);
  for (;;) {
    int best = -1;
    uint32_t most = 0;
    for (int i = 0; i < t; i++) {
      uint64_t w = __atomic_load_n(&runs[8 * i], __ATOMIC_ACQUIRE);
      uint32_t lo = (uint32_t)(w >> 32), hi = (uint32_t)w;
      if (lo < hi && hi - lo > most) best = i, most = hi - lo;
    }
    if (best < 0) return -1;
    uint64_t *run = &runs[8 * best];
    uint64_t w = __atomic_load_n(run, __ATOMIC_ACQUIRE);
    if ((uint32_t)(w >> 32) < (uint32_t)w &&
        __atomic_compare_exchange_n(run, &w, w - 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
      return (int)((uint32_t)w - 1);
  }
}

#endif
