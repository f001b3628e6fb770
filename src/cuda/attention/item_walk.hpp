// Which item a persistent attention CTA takes k-th (ItemWalk below; cuda/attention/attention_forward_sm90.cu):
// round k's items k·G … k·G + G − 1 over the G CTAs, CTA c taking the c-th from the round's start in
// even rounds and from its end in odd ones (a snake; plainly from the start with snake off); −1 past
// its last. The items are longest first, so the CTA given a round's longest item gets the next
// round's shortest. Host and device: tests/cpu/test_item_walk.cpp checks that the CTAs together take
// every item once, whatever the counts.
#pragma once

#include "core/host_device.hpp"

namespace samebits::cuda::attention {

SAMEBITS_HD int walk_item(int k, int cta, int ctas, int n_items, bool snake) {
  const int idx = k * ctas + (snake && (k & 1) ? ctas - 1 - cta : cta);
  return idx < n_items ? idx : -1;
}

#if defined(__CUDACC__)
// Which item the calling CTA takes k-th (k = 0, 1, …; −1 past its last): its own alone where the grid
// is a CTA an item; in a persistent kernel walk_item's snake: a static walk (no counter, no atomics)
// whose CTAs end close together, where a plain walk's first CTAs took the longest item of every
// round (causal prefill: up to one long item more than the last CTAs). Which CTA takes an item
// never changes its arithmetic.
struct ItemWalk {
  int n_items;
  bool persistent, snake;
  __device__ int operator()(int k) const {
    if (!persistent) return k == 0 ? int(blockIdx.x) : -1;
    return walk_item(k, int(blockIdx.x), int(gridDim.x), n_items, snake);
  }
};
#endif

}  // namespace samebits::cuda::attention
