// `samebits generate`: JSONL prompts in, JSONL completions out.
#pragma once
#include <cstdint>
#include <functional>
#include <istream>
#include <ostream>
#include <string>
#include <vector>

#include "samebits/engine.hpp"

namespace samebits::tools {

// One input line: {"tokens": [...], and optionally "n", "temperature", "top_k", "top_p", "min_p",
// "max_new_tokens", "stop" (ids), "seed"} over `defaults`. A line that cannot be read (bad JSON, a
// setting of the wrong type) becomes an error for that prompt alone.
struct PromptLine {
  int64_t line = 0;
  GenerationRequest request;
  std::string error;  // non-empty: the line is not run
};
std::vector<PromptLine> read_prompts(std::istream& in, const SamplingParams& defaults);

// Runs every readable prompt through one engine and writes one JSONL line per completion, in
// (prompt, sample) order: {"prompt": i, "sample": j, "tokens": [...], "logprobs": [...],
// "finish_reason": "stop" | "length"} (with sampling_logprobs, also "sampling_logprobs": [...], each
// token's logprob under the distribution it was drawn from), or {"prompt": i, "error": "..."} for
// a prompt that failed. i counts the non-blank input lines from 0. Returns the number of prompts
// that failed.
int64_t write_generations(const Model& model, const EngineOptions& options, const std::vector<PromptLine>& prompts,
                          std::ostream& out, const std::function<void(int64_t, int64_t)>& progress = {},
                          bool sampling_logprobs = false);

}  // namespace samebits::tools
