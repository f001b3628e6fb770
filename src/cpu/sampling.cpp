// CPU sampling: the reference for the CUDA kernel. It follows src/ops/sampling_rule.hpp literally
// (the lanes' sums, the pairwise tree, the key thresholds) with plain loops and sorts where the
// GPU searches, so the two give the same token from the same row; rows run in parallel.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/registry.hpp"
#include "ops/sampling_rule.hpp"
#include "samebits/ops.hpp"

namespace samebits::cpu {
namespace {

using namespace sampling_rule;

// The tree over the lanes' sums of w[i] for the ids `in` admits: tree[LANES + ℓ] is lane ℓ's sum,
// tree[k] = tree[2k] + tree[2k + 1], tree[1] the total.
void lane_tree(const std::vector<float>& w, const std::vector<uint8_t>& in, std::vector<float>& tree) {
  const int64_t V = int64_t(w.size());
  tree.assign(2 * LANES, 0.0f);
  for (int64_t l = 0; l < LANES; ++l) {
    float acc = 0.0f;
    for (int64_t i = l; i < V; i += LANES)
      if (in[size_t(i)]) acc += w[size_t(i)];
    tree[size_t(LANES + l)] = acc;
  }
  for (int64_t k = LANES - 1; k >= 1; --k) tree[size_t(k)] = tree[size_t(2 * k)] + tree[size_t(2 * k + 1)];
}

float mass(const std::vector<float>& w, const std::vector<uint8_t>& in) {
  std::vector<float> tree;
  lane_tree(w, in, tree);
  return tree[1];
}

// weight (optional): {the drawn token's weight, the kept total} (greedy {1, 1}, a bad row {0, 0}).
int32_t draw_row(const float* z, int64_t V, const double* raw, uint8_t* kept, float* weight) {
  const RowParams p = params_of(raw);
  if (kept) std::fill(kept, kept + V, uint8_t(0));
  if (weight) weight[0] = weight[1] = 0.0f;
  if (!params_ok(p)) return BAD_PARAMS;
  int64_t arg = -1, finite = 0;
  for (int64_t i = 0; i < V; ++i) {
    const float x = z[i];
    if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) return BAD_LOGITS;
    if (x == -std::numeric_limits<float>::infinity()) continue;
    ++finite;
    if (arg < 0 || key_of(x) > key_of(z[arg])) arg = i;
  }
  if (finite == 0) return BAD_LOGITS;
  if (p.temperature == 0) {
    if (kept) kept[arg] = 1;
    if (weight) weight[0] = weight[1] = 1.0f;
    return int32_t(arg);
  }
  std::vector<uint8_t> in(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) in[size_t(i)] = z[i] > -std::numeric_limits<float>::infinity();
  const int64_t k = int64_t(p.top_k);
  if (k > 0 && k < finite) {  // the k first by (key descending, id ascending)
    std::vector<int32_t> ids;
    for (int64_t i = 0; i < V; ++i)
      if (in[size_t(i)]) ids.push_back(int32_t(i));
    std::nth_element(ids.begin(), ids.begin() + (k - 1), ids.end(), [&](int32_t a, int32_t b) {
      return key_of(z[a]) != key_of(z[b]) ? key_of(z[a]) > key_of(z[b]) : a < b;
    });
    std::fill(in.begin(), in.end(), uint8_t(0));
    for (int64_t j = 0; j < k; ++j) in[size_t(ids[size_t(j)])] = 1;
  }
  const float max_logit = z[arg], inv_t = inverse_temperature(p.temperature);
  std::vector<float> w(static_cast<size_t>(V), 0.0f);
  for (int64_t i = 0; i < V; ++i)
    if (in[size_t(i)]) w[size_t(i)] = weight_of(z[i], max_logit, inv_t);
  if (p.top_p < 1) {  // the largest key t with mass(key ≥ t) ≥ goal; mass only grows as t falls
    const float goal = top_p_goal(p.top_p, mass(w, in));
    std::vector<uint32_t> keys;
    for (int64_t i = 0; i < V; ++i)
      if (in[size_t(i)]) keys.push_back(key_of(z[i]));
    std::sort(keys.begin(), keys.end(), std::greater<uint32_t>());
    keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
    auto above = [&](uint32_t t) {
      std::vector<uint8_t> s(in);
      for (int64_t i = 0; i < V; ++i) s[size_t(i)] = s[size_t(i)] && key_of(z[i]) >= t;
      return s;
    };
    size_t lo = 0, hi = keys.size() - 1;  // mass(above(keys[hi])) is the whole mass ≥ goal
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (mass(w, above(keys[mid])) >= goal) hi = mid;
      else lo = mid + 1;
    }
    in = above(keys[lo]);
  }
  if (p.min_p > 0)
    for (int64_t i = 0; i < V; ++i) in[size_t(i)] = in[size_t(i)] && double(w[size_t(i)]) >= p.min_p;
  std::vector<float> tree;
  lane_tree(w, in, tree);
  float t = draw_target(p.u, tree[1]);
  int64_t node = 1;
  while (node < LANES) {
    const float left = tree[size_t(2 * node)], right = tree[size_t(2 * node + 1)];
    if (t < left || !(right > 0.0f)) {
      node = 2 * node;
    } else {
      t = t - left;
      node = 2 * node + 1;
    }
  }
  int64_t token = -1;
  float acc = 0.0f;
  for (int64_t i = node - LANES; i < V; i += LANES) {
    if (!in[size_t(i)]) continue;
    acc += w[size_t(i)];
    if (w[size_t(i)] > 0.0f) token = i;
    if (acc > t) break;
  }
  if (kept)
    for (int64_t i = 0; i < V; ++i) kept[i] = in[size_t(i)];
  if (weight && token >= 0) {
    weight[0] = w[size_t(token)];
    weight[1] = tree[1];
  }
  return int32_t(token);
}

void sample_tokens(const Context&, const SampleTokensArgs& a) {
  const int64_t R = a.logits.shape[0], V = a.logits.shape[1];
  const float* logits = a.logits.as<const float>();
  const double* params = a.params.as<const double>();
  int32_t* tokens = a.tokens.as<int32_t>();
  uint8_t* kept = a.kept.present() ? a.kept.as<uint8_t>() : nullptr;
  float* weights = a.weights.present() ? a.weights.as<float>() : nullptr;
#pragma omp parallel for schedule(dynamic) if (R * V >= (int64_t(1) << 20))  // threads only where they pay
  for (int64_t r = 0; r < R; ++r)
    tokens[r] = draw_row(logits + r * V, V, params + r * PARAMS, kept ? kept + r * V : nullptr,
                         weights ? weights + 2 * r : nullptr);
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(sample_tokens, Backend::cpu, SampleTokensArgs, sample_tokens);

}  // namespace samebits::cpu
