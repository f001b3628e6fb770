// The model tools' JSONL side: `samebits logprobs`, `grads` and `activations` read token sequences
// as JSONL; logprobs writes JSONL, grads and activations write safetensors.
#pragma once
#include <cstdint>
#include <functional>
#include <istream>
#include <ostream>
#include <string>
#include <vector>

#include "samebits/chain.hpp"
#include "samebits/model.hpp"

namespace samebits::tools {

// One input line: {"tokens": [ids...], "loss_mask": [0/1...] (optional, one per token)}.
struct InputSequence {
  int64_t line = 0;  // 1-based line number in the input, for messages
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;  // empty: every token scored
};

// Reads every non-blank line of `in` and checks it against the model before any work is done:
// valid JSON (bounded nesting), integer ids inside the vocab, at least one token and at most the
// model's max_position_embeddings, loss_mask entries 0 or 1. Throws samebits::Error naming
// `command`, the line and the problem; a read error or an input with no sequence is an error too.
std::vector<InputSequence> read_sequences(std::istream& in, const ModelConfig& config, const std::string& command);

// How far a long run is, for a progress line.
struct Progress {
  int64_t sequences_done = 0, sequences = 0, tokens_done = 0, tokens = 0;
};
using ProgressFn = std::function<void(const Progress&)>;

// Each output line: {"logprobs": [...], "entropy": [...]}: entry i scores tokens[i] given
// tokens[0..i-1]; entry 0 (no context) is null, as are masked tokens. Sequences are scored in
// batches of `batch_size`; the result of a line never depends on the lines around it. Every write
// to `out` is checked (a failed write throws samebits::Error).
void write_logprobs(const Model& model, Backend backend, const std::vector<InputSequence>& seqs, std::ostream& out,
                    bool entropy, int batch_size = 16, const ProgressFn& progress = {});
// The same, reading the JSONL from `in` first (read_sequences).
void write_logprobs(const Model& model, Backend backend, std::istream& in, std::ostream& out, bool entropy,
                    int batch_size = 16);

// `samebits grads`: the gradient of L = Σ logp over every scored token of the sequences (the same
// input and scoring as write_logprobs) with respect to every weight, accumulated in fp32 over
// micro-batches of `batch_size` sequences, in input order, written as fp32 safetensors (a tied
// embedding's gradient is the sum of its two uses). The bits depend on the order of the sequences
// (a sum in order), never on `batch_size` nor on `keep` (ForwardKeep::layer_inputs: `--recompute`)
// nor on `lm_head_keep_bytes` (Chain::set_lm_head_keep_bytes: `--lm-head-keep-mb`).
// Returns the number of scored tokens.
int64_t write_gradients(const Model& model, Backend backend, const std::vector<InputSequence>& seqs,
                        const std::string& path, int batch_size = 16, const ProgressFn& progress = {},
                        ForwardKeep keep = ForwardKeep::all, int64_t lm_head_keep_bytes = 0);
int64_t write_gradients(const Model& model, Backend backend, std::istream& in, const std::string& path,
                        int batch_size = 16);

// `samebits activations`: every activation of one forward of all the sequences, packed in input
// order (rows = tokens), written in the chain's dtypes as safetensors under the chain's own names
// ("embed", "layer0.q", "layer0.q_rope", … "final.n1", "head.logp"): for locating where two
// implementations, or two precisions, part. Returns the number of rows.
int64_t write_activations(const Model& model, Backend backend, const std::vector<InputSequence>& seqs,
                          const std::string& path);
int64_t write_activations(const Model& model, Backend backend, std::istream& in, const std::string& path);

}  // namespace samebits::tools
