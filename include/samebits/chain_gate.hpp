// samebits/chain_gate.hpp — the chain gate: the whole model, forward and backward, judged bitwise
// across batch compositions, layouts, KV-cache schedules and micro-batch splits, and against the
// fp64 chain with the contract's chain metrics.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "samebits/harness.hpp"
#include "samebits/model.hpp"

namespace samebits::harness {

struct ChainGateOptions {
  uint64_t seed = 1234;
  Backend backend = Backend::cpu;
  int batch = 8;                                   // sequences in the largest batch
  int64_t target_len = 130;                        // the target sequence (chunks of 64 and 100 split it)
  int64_t neighbour_max_len = 40;
  std::vector<int64_t> chunk_sizes = {1, 7, 64, 100};
  int decode_tokens = 8;                           // generate-then-rescore
};

// d = a − b over the active tokens: max |d|, approx KL = mean(exp(d) − 1 − d), and the fraction
// of tokens whose ratio exp(d) falls outside [low, high].
struct ChainMetrics {
  double max_abs = 0, approx_kl = 0, clip_fraction = 0;
  int64_t tokens = 0;
};
ChainMetrics chain_metrics(const std::vector<double>& a, const std::vector<double>& b,
                           const std::vector<uint8_t>& active, double low = 0.8, double high = 1.2);

// Runs the gate on `model` (its weights in the model dtype) and reports it as one status-matrix row.
CaseResult run_chain_gate(const Model& model, const std::string& label, const Contract& contract,
                          const ChainGateOptions& opt, const std::function<void(const std::string&)>& progress = {});

}  // namespace samebits::harness
