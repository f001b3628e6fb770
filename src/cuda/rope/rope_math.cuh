// RoPE's arithmetic on the GPU, shared by the RoPE kernel (rope.cu) and the QK-norm kernel fused
// with RoPE (norm/rmsnorm.cu), so that the two paths give the same bits by construction.
//
// inv_freq[i] comes from the host (ops/rope_freq.hpp, the CPU backend's very values) in a kernel
// parameter; angle = fp32(position · inv_freq[i]), rounded once; cos / sin of that fp32 angle in
// fp64, each rounded once to fp32. A pair (x1, x2) = (dim i, dim i + D/2) rotates to
// y1 = x1·c − x2·s, y2 = x2·c + x1·s, every product and sum rounded separately (no FMA
// contraction); the inverse rotation is the same with −s.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/rope_freq.hpp"

namespace samebits::cuda {

template <int MaxHalf>
struct InvFreqTable {
  float f[MaxHalf];
};

template <int MaxHalf>
InvFreqTable<MaxHalf> make_inv_freq(const RopeConfig& config, int64_t head_dim) {
  InvFreqTable<MaxHalf> t{};
  const std::vector<float> f = detail::rope_inv_freq(config, head_dim);
  std::copy(f.begin(), f.begin() + std::min<size_t>(f.size(), MaxHalf), t.f);
  return t;
}

// {cos, ±sin} of a position's angle for one pair (−sin for the inverse rotation).
__device__ __forceinline__ float2 rope_cos_sin(int32_t position, float inv_freq, bool inverse) {
  const float angle = __fmul_rn(float(position), inv_freq);
  double s, c;
  sincos(double(angle), &s, &c);
  return make_float2(float(c), inverse ? -float(s) : float(s));
}

// cs[j · half + i] := rope_cos_sin of token t0 + j, pair i, for the `tokens` tokens from t0; the
// CTA's threads share the work. The caller synchronises before reading cs. interleave8 (half a
// multiple of 8): pair i of a token at (i % 8) · half/8 + i / 8 instead, so that threads reading
// pairs 8v … 8v + 7 for consecutive v read consecutive words.
__device__ __forceinline__ void rope_fill_cos_sin(float2* cs, const int32_t* positions, int64_t t0,
                                                  int64_t tokens, int64_t half, const float* inv_freq,
                                                  bool inverse, bool interleave8 = false) {
  const int h = int(half), n = int(tokens) * h;  // a step's pairs: 32-bit index arithmetic
  for (int k = threadIdx.x; k < n; k += blockDim.x) {
    const int j = k / h, i = k - j * h;
    cs[interleave8 ? j * h + (i % 8) * (h / 8) + i / 8 : k] = rope_cos_sin(positions[t0 + j], inv_freq[i], inverse);
  }
}

// The rotated first (dim i) and second (dim i + D/2) element of a pair.
__device__ __forceinline__ float rope_first(float x1, float x2, float2 cs) {
  return __fsub_rn(__fmul_rn(x1, cs.x), __fmul_rn(x2, cs.y));
}
__device__ __forceinline__ float rope_second(float x1, float x2, float2 cs) {
  return __fadd_rn(__fmul_rn(x2, cs.x), __fmul_rn(x1, cs.y));
}

}  // namespace samebits::cuda
