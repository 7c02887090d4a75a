/* runs.h's schedule, claim by claim, for tests (tests/unit/test_native_runs.py): the order in
 * which threads' claims get units is the whole of the schedule, and one thread can replay it. */
#include <stdint.h>
#include <stdlib.h>

#include "runs.h"

/* Units [0, n) in t runs; claim i is made by thread who[i] (of t); got[i] is the unit it gets, or
 * -1. Returns 0, or -1 when memory is short. */
int afd_runs_replay(int t, int n, const int32_t *who, int claims, int32_t *got) {
  uint64_t *runs = (uint64_t *)aligned_alloc(64, AFD_RUNS_WORDS(t) * sizeof(uint64_t));
  if (!runs) return -1;
  afd_runs_init(runs, t, n);
  for (int i = 0; i < claims; i++) got[i] = afd_runs_next(runs, t, who[i]);
  free(runs);
  return 0;
}
