// Sampling's host side: settings, the counter-based uniform, and one-row draws through the sampling
// op's CPU kernel (samebits/sampling.hpp says why it is shaped so).
#include "samebits/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <cfloat>
#include <cstdint>

#include <fmt/format.h>

#include "ops/sampling_rule.hpp"
#include "samebits/error.hpp"
#include "samebits/ops.hpp"

namespace samebits {

namespace {

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

void SamplingParams::validate(const std::string& op, int64_t vocab) const {
  if (n < 1) throw Error(op, "n", fmt::format("must be at least 1, got {}", n));
  if (!std::isfinite(temperature) || temperature < 0)
    throw Error(op, "temperature", fmt::format("must be finite and ≥ 0 (0: greedy), got {}", temperature));
  if (top_k < 0) throw Error(op, "top_k", fmt::format("must be ≥ 0 (0: off), got {}", top_k));
  if (!(top_p > 0 && top_p <= 1)) throw Error(op, "top_p", fmt::format("must be in (0, 1], got {}", top_p));
  if (!(min_p >= 0 && min_p < 1)) throw Error(op, "min_p", fmt::format("must be in [0, 1), got {}", min_p));
  if (max_new_tokens < 1) throw Error(op, "max_new_tokens", fmt::format("must be at least 1, got {}", max_new_tokens));
  for (int32_t s : stop_token_ids)
    if (s < 0 || s >= vocab) throw Error(op, "stop_token_ids", fmt::format("id {} is outside the vocab [0, {})", s, vocab));
}

double sampling_uniform(uint64_t seed, int64_t sample, int64_t position) {
  uint64_t x = splitmix(seed);
  x = splitmix(x ^ (uint64_t(sample) * 0xD1B54A32D192ED03ull));
  x = splitmix(x ^ (uint64_t(position) * 0x8CB92BA72F3D8DD7ull));
  return double(x >> 11) * 0x1.0p-53;
}

std::array<double, 5> sampling_row(const SamplingParams& p, double u) {
  return {p.temperature, double(std::min<int64_t>(p.top_k, INT32_MAX)), p.top_p, p.min_p, u};
}

namespace {

// One row through the sampling op on the CPU backend (the rule's reference kernel).
int32_t draw(const std::vector<double>& logits, const SamplingParams& p, double u, std::vector<uint8_t>* kept) {
  const int64_t V = int64_t(logits.size());
  if (V == 0) throw Error("sample", "logits", "an empty row");
  for (int64_t i = 0; i < V; ++i)
    if (std::isnan(logits[size_t(i)]) || logits[size_t(i)] == INFINITY)
      throw Error("sample", "logits", fmt::format("value {} at id {} is not a finite logit", logits[size_t(i)], i));
    else if (std::isfinite(logits[size_t(i)]) && std::fabs(logits[size_t(i)]) > double(FLT_MAX))
      throw Error("sample", "logits", fmt::format("value {} at id {} is outside fp32's range (logits are fp32)",
                                                  logits[size_t(i)], i));
  p.validate("sample", V);
  std::vector<float> z(logits.begin(), logits.end());
  std::array<double, sampling_rule::PARAMS> params = sampling_row(p, u);
  int32_t token = 0;
  if (kept) kept->assign(size_t(V), 0);
  SampleTokensArgs a;
  a.logits = TensorView::of(z.data(), DType::f32, {1, V});
  a.params = TensorView::of(params.data(), DType::f64, {1, sampling_rule::PARAMS});
  a.tokens = TensorView::of(&token, DType::i32, {1});
  if (kept) a.kept = TensorView::of(kept->data(), DType::u8, {1, V});
  Context ctx;
  ctx.check_finite_inputs = false;
  sample_tokens(ctx, a);
  if (token == sampling_rule::BAD_LOGITS) throw Error("sample", "logits", "every logit is −inf");
  if (token < 0) throw Error("sample", "params", "a setting is out of range (cannot happen: validated)");
  return token;
}

}  // namespace

std::vector<int32_t> sampling_candidates(const std::vector<double>& logits, const SamplingParams& p) {
  std::vector<uint8_t> kept;
  draw(logits, p, 0.0, &kept);
  std::vector<int32_t> ids;
  for (size_t i = 0; i < kept.size(); ++i)
    if (kept[i]) ids.push_back(int32_t(i));
  return ids;
}

int32_t sample_token(const std::vector<double>& logits, const SamplingParams& p, int64_t sample, int64_t position) {
  return draw(logits, p, sampling_uniform(p.seed, sample, position), nullptr);
}

}  // namespace samebits
