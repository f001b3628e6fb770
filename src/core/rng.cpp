// The deterministic generator (splitmix64; Box–Muller normals).
#include "samebits/rng.hpp"

#include <cmath>

namespace samebits {

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Rng::uniform(double lo, double hi) {
  return lo + (hi - lo) * (double(next() >> 11) * 0x1.0p-53);
}

double Rng::normal() {  // Box–Muller
  const double u1 = (double(next() >> 11) + 1.0) * 0x1.0p-53, u2 = double(next() >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

int64_t Rng::integer(int64_t lo, int64_t hi) {
  return lo + int64_t(next() % uint64_t(hi - lo + 1));
}

HostTensor Rng::tensor(DType dtype, std::vector<int64_t> shape, double lo, double hi) {
  HostTensor t(dtype, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, uniform(lo, hi));
  return t;
}

HostTensor Rng::integers(std::vector<int64_t> shape, int64_t lo, int64_t hi) {
  HostTensor t(DType::i32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, double(integer(lo, hi)));
  return t;
}

}  // namespace samebits
