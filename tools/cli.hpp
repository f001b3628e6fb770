// The `samebits` command line, parsed into one request per subcommand before any work is done:
// parsing is pure (no file is touched), so it is tested and fuzzed on its own.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "samebits/sampling.hpp"

namespace samebits::tools {

// Where a run's progress lines go: a TTY on stderr gets them unless -q; otherwise only --progress.
enum class ProgressMode { automatic, on, off };

struct VersionRequest {};

struct VerifyRequest {
  std::string backend = "auto", status_dir, model_dir;
  uint64_t seed = 1234;
  std::vector<std::string> ops;
  bool json = false, quiet = false, no_chain = false;
};

// logprobs, grads and activations: the built-in model unless --model names a Hugging Face directory.
struct ModelChoice {
  std::string dir;  // empty: the built-in model
  bool builtin_tied = false;
};

struct LogprobsRequest {
  ModelChoice model;
  std::string input, output, backend = "auto";
  bool entropy = false;
  ProgressMode progress = ProgressMode::automatic;
};

struct GradsRequest {
  ModelChoice model;
  std::string input, output, backend = "auto";
  int micro_batch = 16;
  bool recompute = false;  // keep layer inputs alone; the backward reruns each layer (same bits)
  int lm_head_keep_mb = 0;  // MiB of LM-head logits kept for the backward (three GEMMs; same bits)
  ProgressMode progress = ProgressMode::automatic;
};

struct ActivationsRequest {
  ModelChoice model;
  std::string input, output, backend = "auto";
};

struct ExportRequest {
  std::string dir, shape = "builtin";
  bool tied = false;
  uint64_t seed = 1234;
  std::optional<int64_t> layers;  // only with shape qwen3-8b
};

// generate: rollouts from JSONL prompts; the sampling flags are the defaults a line may override.
struct GenerateRequest {
  ModelChoice model;
  std::string input, output, backend = "auto";
  SamplingParams sampling;  // the defaults a line may override
  int64_t max_slots = 64, max_batch_tokens = 2048, max_context = 0, page_size = 64, kv_pages = 0, kv_memory_mib = 0;
  bool no_cuda_graphs = false;
  bool no_overlap = false;
  bool sampling_logprobs = false;  // also write each token's logprob under its sampling distribution
  ProgressMode progress = ProgressMode::automatic;
};

struct InspectRequest {
  ModelChoice model;
};

using Request = std::variant<VersionRequest, VerifyRequest, LogprobsRequest, GradsRequest, ActivationsRequest,
                             ExportRequest, InspectRequest, GenerateRequest>;

// What the command line asks for: a request to run, or text to print (help, or a usage error
// with "Run samebits --help") and the exit code to end with.
struct ParsedCommandLine {
  std::optional<Request> request;
  std::string text;
  bool text_is_error = false;
  int exit_code = 0;
};

// Never throws for any argv; never prints.
ParsedCommandLine parse_command_line(int argc, const char* const* argv);

// The subcommand names, in --help order.
const std::vector<std::string>& command_names();

}  // namespace samebits::tools
