// Sampling on the host (samebits/sampling.hpp says why it is shaped so).
#include "samebits/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/format.h>

#include "samebits/error.hpp"

namespace samebits {

namespace {

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// p_i = exp((z_i − max z) / 1) over `ids`, z = logits / temperature.
std::vector<double> weights_of(const std::vector<double>& logits, const std::vector<int32_t>& ids, double temperature) {
  double top = -INFINITY;
  for (int32_t i : ids) top = std::max(top, logits[size_t(i)] / temperature);
  std::vector<double> w;
  w.reserve(ids.size());
  for (int32_t i : ids) w.push_back(std::exp(logits[size_t(i)] / temperature - top));
  return w;
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

std::vector<int32_t> sampling_candidates(const std::vector<double>& logits, const SamplingParams& p) {
  const int64_t V = int64_t(logits.size());
  if (V == 0) throw Error("sample", "logits", "an empty row");
  for (int64_t i = 0; i < V; ++i)
    if (std::isnan(logits[size_t(i)]) || logits[size_t(i)] == INFINITY)
      throw Error("sample", "logits", fmt::format("value {} at id {} is not a finite logit", logits[size_t(i)], i));
  std::vector<int32_t> ids;
  if (p.temperature == 0) {  // greedy: the first maximum
    int32_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (logits[size_t(i)] > logits[size_t(best)]) best = int32_t(i);
    return {best};
  }
  for (int64_t i = 0; i < V; ++i)
    if (logits[size_t(i)] > -INFINITY) ids.push_back(int32_t(i));
  if (ids.empty()) throw Error("sample", "logits", "every logit is −inf");
  // Larger logit first, ties to the lower id: the one order every cut below uses.
  auto before = [&](int32_t a, int32_t b) {
    return logits[size_t(a)] != logits[size_t(b)] ? logits[size_t(a)] > logits[size_t(b)] : a < b;
  };
  if (p.top_k > 0 && p.top_k < int64_t(ids.size())) {
    std::nth_element(ids.begin(), ids.begin() + p.top_k, ids.end(), before);
    ids.resize(size_t(p.top_k));
    std::sort(ids.begin(), ids.end());
  }
  if (p.top_p < 1) {
    const std::vector<double> w = weights_of(logits, ids, p.temperature);
    double total = 0;
    for (double x : w) total += x;  // ascending id order
    std::vector<size_t> order(ids.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return before(ids[a], ids[b]); });
    std::vector<int32_t> kept;
    double sum = 0;
    for (size_t k : order) {
      kept.push_back(ids[k]);
      sum += w[k];
      if (sum >= p.top_p * total) break;
    }
    std::sort(kept.begin(), kept.end());
    ids = std::move(kept);
  }
  if (p.min_p > 0) {
    const std::vector<double> w = weights_of(logits, ids, p.temperature);  // the max has weight 1
    std::vector<int32_t> kept;
    for (size_t k = 0; k < ids.size(); ++k)
      if (w[k] >= p.min_p) kept.push_back(ids[k]);
    ids = std::move(kept);
  }
  return ids;
}

int32_t sample_token(const std::vector<double>& logits, const SamplingParams& p, int64_t sample, int64_t position) {
  const std::vector<int32_t> ids = sampling_candidates(logits, p);
  if (ids.size() == 1) return ids[0];
  const std::vector<double> w = weights_of(logits, ids, p.temperature);
  double total = 0;
  for (double x : w) total += x;
  const double target = sampling_uniform(p.seed, sample, position) * total;
  double sum = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    sum += w[k];
    if (sum > target) return ids[k];
  }
  return ids.back();
}

}  // namespace samebits
