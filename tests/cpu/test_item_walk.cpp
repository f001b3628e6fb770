// The persistent attention kernels' walk over their items (cuda/attention/item_walk.hpp): whatever the
// item and CTA counts, the CTAs together take every item exactly once, each CTA's walk ends at its
// first −1, and the snake evens the CTAs' work where a plain walk gives the first CTAs every round's
// longest item.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/attention/item_walk.hpp"

namespace samebits::cuda::attention {
namespace {

// Each CTA's items, walked as the kernel does: k = 0, 1, … until the first −1.
std::vector<std::vector<int>> walks(int n_items, int ctas, bool snake) {
  std::vector<std::vector<int>> taken(static_cast<size_t>(ctas));
  for (int c = 0; c < ctas; ++c)
    for (int k = 0, idx; (idx = walk_item(k, c, ctas, n_items, snake)) >= 0; ++k) taken[size_t(c)].push_back(idx);
  return taken;
}

TEST(ItemWalk, TheCtasTakeEveryItemOnceAndNothingAfterTheirFirstEnd) {
  for (bool snake : {true, false})
    for (int n : {1, 2, 5, 131, 132, 133, 263, 264, 265, 1000, 4096, 4097})
      for (int ctas : {1, 2, 5, 131, 132, 133}) {
        const std::string at =
            "items " + std::to_string(n) + ", CTAs " + std::to_string(ctas) + (snake ? ", snake" : "");
        std::vector<int> times(size_t(n), 0);
        const auto taken = walks(n, ctas, snake);
        for (int c = 0; c < ctas; ++c) {
          for (int idx : taken[size_t(c)]) {
            ASSERT_GE(idx, 0) << at;
            ASSERT_LT(idx, n) << at;
            ++times[size_t(idx)];
          }
          // Past its first −1 the walk never yields an item again (the kernel's loops stop there).
          const int k_end = int(taken[size_t(c)].size());
          for (int k = k_end; k < k_end + 3; ++k) EXPECT_EQ(walk_item(k, c, ctas, n, snake), -1) << at << ", CTA " << c;
        }
        for (int i = 0; i < n; ++i) ASSERT_EQ(times[size_t(i)], 1) << at << ": item " << i;
      }
}

// Causal prefill's items sorted longest first (lengths n, n − 1, …, 1 blocks as a stand-in): the
// busiest CTA's blocks over the average, snake against plain, 4096 items over 132 CTAs.
TEST(ItemWalk, TheSnakeEvensTheCtasWork) {
  const int n = 4096, ctas = 132;
  auto busiest_over_mean = [&](bool snake) {
    long long most = 0, total = 0;
    for (const auto& items : walks(n, ctas, snake)) {
      long long blocks = 0;
      for (int idx : items) blocks += n - idx;
      most = std::max(most, blocks);
      total += blocks;
    }
    return double(most) * ctas / double(total);
  };
  const double snake = busiest_over_mean(true), plain = busiest_over_mean(false);
  EXPECT_LT(snake, 1.005);
  EXPECT_GT(plain, 1.02);  // what the snake removes: the plain walk's first CTA takes every round's longest item
}

}  // namespace
}  // namespace samebits::cuda::attention
