/* The k largest of a router's scores as torch.topk picks them on the CPU, ties included
 * (decode_layer.c routes with it; loaded with ctypes by the tests).
 *
 * Where the k-th score equals one left out, which experts a token goes to depends on how the
 * selection moves equal elements, and the torch path (and transformers) use torch.topk. Its CPU
 * kernel (ATen's TopKImpl.h, torch 2.x) puts (score, index) pairs in index order, and where
 * k * 64 > the row's length, calls std::nth_element for the k-th then std::sort on the k - 1
 * before it, else std::partial_sort, comparing scores alone (a NaN above everything). All are
 * libstdc++'s algorithms, done again here step for step: introselect (median-of-three pivot,
 * an unguarded partition, a heap select past its depth limit, insertion sort below four), an
 * insertion sort (std::sort of up to 16 elements), and a heap select then a heap sort
 * (partial_sort). afd/kernels/topk.py checks once per process that this matches the torch it
 * runs with, on rows full of ties; where it does not (or for k > 17) the callers leave a tied
 * row to torch, as before. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
  float v;
  int32_t i;
} elem;

/* torch's comparator for the largest: x goes before y */
static inline int before(const elem *x, const elem *y) {
  return (isnan(x->v) && !isnan(y->v)) || x->v > y->v;
}

static inline void swap_e(elem *a, elem *b) {
  elem t = *a;
  *a = *b;
  *b = t;
}

static void insertion_sort(elem *first, elem *last) {
  if (first == last) return;
  for (elem *i = first + 1; i != last; ++i) {
    elem val = *i;
    if (before(&val, first)) {
      memmove(first + 1, first, (size_t)(i - first) * sizeof(elem));
      *first = val;
    } else {
      elem *hole = i, *next = i - 1;
      while (before(&val, next)) {
        *hole = *next;
        hole = next--;
      }
      *hole = val;
    }
  }
}

/* the heap functions, as libstdc++'s __push_heap, __adjust_heap, __make_heap, __heap_select,
 * __sort_heap */
static void push_heap(elem *first, long hole, long top, elem val) {
  long parent = (hole - 1) / 2;
  while (hole > top && before(first + parent, &val)) {
    first[hole] = first[parent];
    hole = parent;
    parent = (hole - 1) / 2;
  }
  first[hole] = val;
}

static void adjust_heap(elem *first, long hole, long len, elem val) {
  const long top = hole;
  long child = hole;
  while (child < (len - 1) / 2) {
    child = 2 * (child + 1);
    if (before(first + child, first + (child - 1))) child--;
    first[hole] = first[child];
    hole = child;
  }
  if ((len & 1) == 0 && child == (len - 2) / 2) {
    child = 2 * (child + 1);
    first[hole] = first[child - 1];
    hole = child - 1;
  }
  push_heap(first, hole, top, val);
}

static void heap_select(elem *first, elem *middle, elem *last) {
  const long len = middle - first;
  if (len >= 2)
    for (long parent = (len - 2) / 2;; parent--) {
      adjust_heap(first, parent, len, first[parent]);
      if (parent == 0) break;
    }
  for (elem *i = middle; i < last; ++i)
    if (before(i, first)) { /* __pop_heap(first, middle, i) */
      elem val = *i;
      *i = *first;
      adjust_heap(first, 0, len, val);
    }
}

static void sort_heap(elem *first, elem *last) {
  while (last - first > 1) { /* __pop_heap(first, last - 1, last - 1) */
    --last;
    elem val = *last;
    *last = *first;
    adjust_heap(first, 0, last - first, val);
  }
}

static void move_median_to_first(elem *result, elem *a, elem *b, elem *c) {
  if (before(a, b)) {
    if (before(b, c))
      swap_e(result, b);
    else if (before(a, c))
      swap_e(result, c);
    else
      swap_e(result, a);
  } else if (before(a, c))
    swap_e(result, a);
  else if (before(b, c))
    swap_e(result, c);
  else
    swap_e(result, b);
}

static elem *unguarded_partition(elem *first, elem *last, const elem *pivot) {
  for (;;) {
    while (before(first, pivot)) ++first;
    --last;
    while (before(pivot, last)) --last;
    if (!(first < last)) return first;
    swap_e(first, last);
    ++first;
  }
}

static void nth_element(elem *first, elem *nth, elem *last) {
  if (first == last || nth == last) return;
  int depth = 2 * (31 - __builtin_clz((unsigned)(last - first)));
  while (last - first > 3) {
    if (depth == 0) {
      heap_select(first, nth + 1, last);
      swap_e(first, nth);
      return;
    }
    --depth;
    elem *mid = first + (last - first) / 2;
    move_median_to_first(first, first + 1, mid, last - 1);
    elem *cut = unguarded_partition(first + 1, last, first);
    if (cut <= nth)
      first = cut;
    else
      last = cut;
  }
  insertion_sort(first, last);
}

/* Set once afd/kernels/topk.py has checked the replay against this process's torch: until
 * then decode_layer.c hands a tied row back to torch. */
int afd_topk_trusted = 0;
void afd_topk_trust(int on) { afd_topk_trusted = on; }

/* Whether afd_topk_as_torch follows torch's path for this shape (k <= 17: its std::sort of
 * k - 1 elements is an insertion sort). */
int afd_topk_known(int E, int k) { return k >= 1 && k <= E && k <= 17; }

/* The k largest of p [E] in torch.topk's order (largest, sorted), ties as it breaks them: ids
 * and their scores w. q: scratch for E elements (8 bytes each). Returns 0, or -1 where the
 * shape is not one afd_topk_known follows. */
int afd_topk_as_torch(const float *p, int E, int k, int32_t *ids, float *w, void *q) {
  if (!afd_topk_known(E, k)) return -1;
  elem *e = (elem *)q;
  for (int j = 0; j < E; j++) e[j].v = p[j], e[j].i = j;
  if ((long)k * 64 <= E) { /* std::partial_sort */
    heap_select(e, e + k, e + E);
    sort_heap(e, e + k);
  } else {
    nth_element(e, e + k - 1, e + E);
    insertion_sort(e, e + k - 1); /* std::sort of k - 1 <= 16 elements */
  }
  for (int j = 0; j < k; j++) ids[j] = e[j].i, w[j] = e[j].v;
  return 0;
}

/* Rows of x [B, E] -> ids [B, k], for the tests against torch.topk. Returns 0 or -1. */
int afd_topk_rows(const float *x, int B, int E, int k, int32_t *ids) {
  elem q[4096];
  float w[17];
  if (E > 4096) return -1;
  for (int b = 0; b < B; b++)
    if (afd_topk_as_torch(x + (size_t)b * E, E, k, ids + (size_t)b * k, w, q)) return -1;
  return 0;
}
