// The sampling rule's arithmetic, shared word for word by the CPU kernel (the reference) and the
// CUDA kernel, so that both draw the same token from the same fp32 logits row.
//
// Every quantity is fp32 and every operation one the two compilers cannot reorder or contract:
// the weight is exp((z − max z) · (1/T)) by the polynomial below written with explicit fmaf (not
// expf, whose last bit differs between libm and CUDA); sums go in one fixed order that depends only
// on the vocab size (the "lanes": lane ℓ < SAMPLING_LANES owns ids ℓ, ℓ + LANES, ℓ + 2·LANES, … and
// adds their weights in that order; the lanes' sums meet in a pairwise tree, node = left + right);
// thresholds are found on a 32-bit key that orders logits (−0 and +0 as one).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/host_device.hpp"

namespace samebits::sampling_rule {

constexpr int LANES = 1024;  // the sum order's width (and the CUDA kernel's threads per row)
constexpr int PARAMS = 5;    // a row's params: temperature, top_k, top_p, min_p, u

// Row status written instead of a token.
constexpr int32_t BAD_LOGITS = -1;  // a NaN or +Inf logit, or every logit −Inf
constexpr int32_t BAD_PARAMS = -2;  // a setting outside its range

// fp32 product and sum, never contracted into an FMA by either compiler (the host build has
// -ffp-contract=off; nvcc contracts unless told, hence the intrinsics).
SAMEBITS_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SAMEBITS_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// An order-preserving map of a float to 32 bits (larger float, larger key; −0 is +0).
SAMEBITS_HD uint32_t key_of(float x) {
  x = add(x, 0.0f);  // −0 → +0
  uint32_t b;
#if defined(__CUDA_ARCH__)
  b = __float_as_uint(x);
#else
  std::memcpy(&b, &x, 4);
#endif
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// exp(x) for x ≤ 0 (Cody–Waite reduction, Cephes' polynomial, ~1 ulp); exactly 1 at 0, 0 below −87.
SAMEBITS_HD float exp_nonpositive(float x) {
  if (!(x >= -87.0f)) return 0.0f;
  const float n = rintf(mul(x, 1.44269504088896341f));
  float r = fmaf(-n, 0.693359375f, x);
  r = fmaf(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  const float y = add(fmaf(p, mul(r, r), r), 1.0f);
  return ldexpf(y, int(n));
}

// The unnormalised probability of a logit: exp((z − max) · inv_t), inv_t = float(1 / T).
// (The max itself weighs 1 even where inv_t overflowed to +Inf: a tiny T tends to greedy.)
SAMEBITS_HD float weight_of(float z, float max_logit, float inv_t) {
  const float d = add(z, -max_logit);
  return d == 0.0f ? 1.0f : exp_nonpositive(mul(d, inv_t));
}

struct RowParams {
  double temperature, top_k, top_p, min_p, u;
};

SAMEBITS_HD RowParams params_of(const double* p) { return {p[0], p[1], p[2], p[3], p[4]}; }

// A row's settings are in range: T finite ≥ 0, top_k a whole number ≥ 0, top_p in (0, 1], min_p in
// [0, 1), u in [0, 1).
SAMEBITS_HD bool params_ok(const RowParams& p) {
  return p.temperature >= 0 && p.temperature <= 1.7976931348623157e308 /* finite */ && p.top_k >= 0 && p.top_k <= 2147483647.0 &&
         p.top_k == double(int64_t(p.top_k)) && p.top_p > 0 && p.top_p <= 1 && p.min_p >= 0 && p.min_p < 1 &&
         p.u >= 0 && p.u < 1;
}

SAMEBITS_HD float inverse_temperature(double t) { return float(1.0 / t); }

// The top-p goal: float(top_p · mass of the candidates).
SAMEBITS_HD float top_p_goal(double top_p, float total) { return float(top_p * double(total)); }

// The draw's target in [0, total]: float(u · total).
SAMEBITS_HD float draw_target(double u, float total) { return float(u * double(total)); }

#if !defined(__CUDA_ARCH__)
// The drawn token's logprob under the sampling distribution (temperature and cuts applied), from
// the two fp32 numbers the draw used (sample_tokens' weights): log(weight / total) in fp64, on the
// host, so that every backend reports the same bits; greedy's {1, 1} gives 0.
inline double sampling_logprob(float weight, float total) {
  return weight > 0.0f && total > 0.0f ? std::log(double(weight)) - std::log(double(total))
                                       : -std::numeric_limits<double>::infinity();
}
#endif

}  // namespace samebits::sampling_rule
