// RoPE's inverse frequencies, shared by every backend so that a position's angles are the same
// fp32 values everywhere: inv_freq[i] = 1 / theta^(2i/D) in fp64 (Llama-3's frequency-dependent
// scaling applied there when enabled), rounded once to fp32.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "samebits/ops.hpp"

namespace samebits::detail {

inline std::vector<float> rope_inv_freq(const RopeConfig& c, int64_t head_dim) {
  constexpr double kPi = 3.14159265358979323846;
  const int64_t half = head_dim / 2;
  std::vector<float> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    double inv = 1.0 / std::pow(c.theta, double(2 * i) / double(head_dim));
    if (c.llama3_scaling) {
      const double low_wavelen = double(c.original_max_position) / c.low_freq_factor;
      const double high_wavelen = double(c.original_max_position) / c.high_freq_factor;
      const double wavelen = 2.0 * kPi / inv;
      if (wavelen > low_wavelen) {
        inv = inv / c.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (double(c.original_max_position) / wavelen - c.low_freq_factor) /
                              (c.high_freq_factor - c.low_freq_factor);
        inv = (1.0 - smooth) * inv / c.factor + smooth * inv;
      }
    }
    f[i] = float(inv);
  }
  return f;
}

}  // namespace samebits::detail
