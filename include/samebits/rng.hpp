// samebits/rng.hpp — the deterministic generator behind the built-in model's weights and the
// harness's inputs: the same seed gives the same bits on every platform.
#pragma once
#include <cstdint>
#include <vector>

#include "samebits/host_tensor.hpp"

namespace samebits {

// A deterministic generator (splitmix64): the same seed gives the same data on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull) {}
  uint64_t next();
  double uniform(double lo, double hi);
  double normal();
  int64_t integer(int64_t lo, int64_t hi);  // [lo, hi]
  HostTensor tensor(DType dtype, std::vector<int64_t> shape, double lo, double hi);
  HostTensor integers(std::vector<int64_t> shape, int64_t lo, int64_t hi);  // int32, [lo, hi]

 private:
  uint64_t state_;
};

}  // namespace samebits
