// `samebits logprobs`: JSONL token sequences in, per-token logprobs (and entropies) out.
#pragma once
#include <istream>
#include <ostream>
#include <string>

#include "samebits/model.hpp"

namespace samebits::tools {

// Each input line: {"tokens": [ids...], "loss_mask": [0/1...] (optional, one per token)}.
// Each output line: {"logprobs": [...], "entropy": [...]}: entry i scores tokens[i] given
// tokens[0..i-1]; entry 0 (no context) is null, as are masked tokens. Sequences are scored in
// batches; the result of a line never depends on the lines around it. Bad lines throw
// samebits::Error naming the line and the problem.
void write_logprobs(const Model& model, Backend backend, std::istream& in, std::ostream& out, bool entropy,
                    int batch_size = 16);

// `samebits grads`: the gradient of L = Σ logp over every scored token of the JSONL sequences (the
// same input and scoring as write_logprobs) with respect to every weight, accumulated in fp32 over
// micro-batches of `batch_size` lines, written as fp32 safetensors (a tied embedding's gradient is
// the sum of its two uses). Returns the number of scored tokens.
int64_t write_gradients(const Model& model, Backend backend, std::istream& in, const std::string& path,
                        int batch_size = 16);

// `samebits activations`: every activation of one forward of all the JSONL sequences, packed in
// input order (rows = tokens), written in the chain's dtypes as safetensors under the chain's own
// names ("embed", "layer0.q", "layer0.q_rope", … "final.n1", "head.logp"): for locating where two
// implementations, or two precisions, part. Returns the number of rows.
int64_t write_activations(const Model& model, Backend backend, std::istream& in, const std::string& path);

}  // namespace samebits::tools
