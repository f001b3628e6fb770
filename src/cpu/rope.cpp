// CPU RoPE (rotate-half convention), forward and backward (the inverse rotation).
// The angle table follows ops.hpp: inv_freq in fp32 (computed in fp64, rounded once), angle =
// fp32(position · inv_freq), cos/sin of that fp32 angle in fp64 (rounded to fp32 in the fp32
// mode). A position's cos/sin depend on nothing but the position and the config.
#include <cmath>

#include "cpu/common.hpp"
#include "ops/registry.hpp"
#include "ops/rope_freq.hpp"
#include "samebits/ops.hpp"

namespace samebits::cpu {
namespace {

template <class Acc>
void rope(const Context& ctx, const RopeArgs& a, bool inverse) {
  (void)ctx;
  const int64_t T = a.x.shape[0], heads = a.x.shape[1], D = a.x.shape[2], half = D / 2;
  const auto inv_freq = detail::rope_inv_freq(a.config, D);
  const auto* pos = a.positions.as<const int32_t>();
  const Acc sign = inverse ? Acc(-1) : Acc(1);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    std::vector<Acc> c(static_cast<size_t>(half)), s(static_cast<size_t>(half)), in(static_cast<size_t>(heads * D)), out(static_cast<size_t>(heads * D));
    for (int64_t i = 0; i < half; ++i) {
      const float angle = float(pos[t]) * inv_freq[i];
      c[i] = Acc(std::cos(double(angle)));
      s[i] = sign * Acc(std::sin(double(angle)));
    }
    load(a.x, t * heads * D, heads * D, in.data());
    for (int64_t h = 0; h < heads; ++h) {
      const Acc* x = &in[h * D];
      Acc* y = &out[h * D];
      for (int64_t i = 0; i < half; ++i) {
        y[i] = x[i] * c[i] - x[i + half] * s[i];
        y[i + half] = x[i + half] * c[i] + x[i] * s[i];
      }
    }
    store(a.y, t * heads * D, heads * D, out.data());
  }
}

void rope_forward(const Context& ctx, const RopeArgs& a) {
  with_precision(ctx, [&](auto acc) { rope<decltype(acc)>(ctx, a, false); });
}
void rope_backward(const Context& ctx, const RopeArgs& a) {
  with_precision(ctx, [&](auto acc) { rope<decltype(acc)>(ctx, a, true); });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(rope_forward, Backend::cpu, RopeArgs, rope_forward);
SAMEBITS_REGISTER_KERNEL(rope_backward, Backend::cpu, RopeArgs, rope_backward);

}  // namespace samebits::cpu
