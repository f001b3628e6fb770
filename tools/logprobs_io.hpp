// `samebits logprobs`: JSONL token sequences in, per-token logprobs (and entropies) out.
#pragma once
#include <istream>
#include <ostream>

#include "samebits/model.hpp"

namespace samebits::tools {

// Each input line: {"tokens": [ids...], "loss_mask": [0/1...] (optional, one per token)}.
// Each output line: {"logprobs": [...], "entropy": [...]}: entry i scores tokens[i] given
// tokens[0..i-1]; entry 0 (no context) is null, as are masked tokens. Sequences are scored in
// batches; the result of a line never depends on the lines around it. Bad lines throw
// samebits::Error naming the line and the problem.
void write_logprobs(const Model& model, Backend backend, std::istream& in, std::ostream& out, bool entropy,
                    int batch_size = 16);

}  // namespace samebits::tools
