// samebits/sampling.hpp — choosing the next token from a row of logits, batch-invariantly.
//
// A token's choice depends only on its own logits row, the request's settings and the counter
// (seed, sample index, position): the random number comes from a counter-based generator keyed by
// those three (never a stream shared by the batch), and every order the choice depends on (ties,
// the top-k / top-p cut, the walk of the cumulative sum) is a fixed per-row order that depends only
// on the vocab size. So a request draws the same tokens alone or in any batch, at any step.
//
// The arithmetic, in double on the host (the logits are the chain's fp32 logits, exact in double):
//   greedy (temperature 0): the largest logit, ties to the lowest id;
//   otherwise z = logits / temperature; top-k keeps the k largest z (ties to the lower id);
//   p = exp(z − max z), summed in ascending id order; top-p keeps the most probable tokens, in
//   (p descending, id ascending) order, until their sum reaches top_p of the total; min-p keeps
//   p ≥ min_p · max p; the token is the first kept id, in ascending order, at which the running
//   sum of kept p exceeds u · (their total), u = uniform(seed, sample, position) in [0, 1).
#pragma once
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

// u in [0, 1) with 53 random bits, a pure function of (seed, sample, position).
double sampling_uniform(uint64_t seed, int64_t sample, int64_t position);

// The ids that may be drawn from `logits` under `p` (all of them unless top-k / top-p / min-p cut),
// ascending; greedy: the one argmax.
std::vector<int32_t> sampling_candidates(const std::vector<double>& logits, const SamplingParams& p);

// The token drawn from `logits` for sample `sample` of a request at position `position` (the
// position the drawn token will take).
int32_t sample_token(const std::vector<double>& logits, const SamplingParams& p, int64_t sample, int64_t position);

}  // namespace samebits
