// samebits/sampling.hpp — choosing the next token from a row of logits, batch-invariantly.
//
// A token's choice depends only on its own logits row, the request's settings and the counter
// (seed, sample index, position): the random number comes from a counter-based generator keyed by
// those three (never a stream shared by the batch), and every order the choice depends on (ties,
// the top-k / top-p cut, the walk of the cumulative sum) is a fixed per-row order that depends only
// on the vocab size. So a request draws the same tokens alone or in any batch, at any step.
//
// The rule (src/ops/sampling_rule.hpp; the CPU and CUDA kernels of the op sample_tokens follow it
// word for word and draw the same token from the same fp32 row):
//   greedy (temperature 0): the largest logit, ties to the lowest id;
//   otherwise every finite logit is a candidate, with weight w = exp((z − max z) / T) in fp32;
//   top-k keeps the k largest logits (ties to the lower id); top-p keeps the logits ≥ the largest
//   threshold whose candidates' mass reaches top_p · (their total) — ties at the threshold kept
//   together; min-p keeps w ≥ min_p (the max weighs 1). A mass is a sum in one fixed order: lane
//   ℓ < 1024 adds the weights of ids ℓ, ℓ + 1024, … in turn, the lanes' sums meet in a pairwise tree.
//   The token: t = u · total, walked down that tree (left when t < left sum, else t −= left sum)
//   to a lane, whose ids are then walked in order until their running sum exceeds t; u =
//   uniform(seed, sample, position) in [0, 1).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace samebits {

struct SamplingParams {
  int64_t n = 1;                       // samples of the prompt (they share its prefill)
  double temperature = 1.0;            // 0: greedy
  int64_t top_k = 0;                   // 0: off
  double top_p = 1.0;                  // in (0, 1]; 1: off
  double min_p = 0.0;                  // in [0, 1); 0: off
  int64_t max_new_tokens = 16;         // ≥ 1
  std::vector<int32_t> stop_token_ids; // a sampled stop token ends the sample (and is kept)
  uint64_t seed = 0;

  // Throws samebits::Error(op, "<field>", …) for a value outside its range (n < 1, negative or
  // non-finite temperature, top_p outside (0, 1], min_p outside [0, 1), top_k < 0,
  // max_new_tokens < 1, a stop id outside the vocab).
  void validate(const std::string& op, int64_t vocab) const;
};

// The op sample_tokens' settings row of a draw under `p` with uniform u: {temperature, top_k (at
// most 2^31 − 1: any more is off), top_p, min_p, u}.
std::array<double, 5> sampling_row(const SamplingParams& p, double u);

// u in [0, 1) with 53 random bits, a pure function of (seed, sample, position).
double sampling_uniform(uint64_t seed, int64_t sample, int64_t position);

// The ids that may be drawn from `logits` under `p` (all of them unless top-k / top-p / min-p cut),
// ascending; greedy: the one argmax.
std::vector<int32_t> sampling_candidates(const std::vector<double>& logits, const SamplingParams& p);

// The token drawn from `logits` for sample `sample` of a request at position `position` (the
// position the drawn token will take).
int32_t sample_token(const std::vector<double>& logits, const SamplingParams& p, int64_t sample, int64_t position);

}  // namespace samebits
