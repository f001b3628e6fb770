// A piece of device work captured once into a CUDA graph and replayed (the CUDA backend only): what
// a decode step runs as, so that its ~500 launches cost the host one graph launch.
//
// The graph's shapes and pointers are fixed at capture, but a decode step's attention work is not
// (each sequence's keys grow a token a step, and a span of 1024 keys splits off as they pass it):
// the attention forwards captured in it are recorded (cuda/attention/attention_sm90.hpp) and re-planned
// before every replay from the step's sequence table, exactly as an eager call plans them.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

#include "samebits/context.hpp"
#include "samebits/dtype.hpp"

namespace samebits {

// What the recorded attention calls may meet: up to `seqs` sequences of one query row, keys up to
// `max_k_len`, of these heads and activation dtype.
struct GraphAttentionShape {
  int64_t seqs = 0, max_k_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::bf16;
};

class CapturedGraph {
 public:
  // Captures the device work `body` enqueues on `stream` (this thread's device stream inside it)
  // and instantiates it; `body` must free whatever it allocates. Nothing runs until replay().
  CapturedGraph(void* stream, const std::function<void()>& body, const GraphAttentionShape& attention);
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  // Re-plans the recorded attention calls for `seqs` (int32 [n, 4] on the host, the attention op's
  // table) and launches the graph on its stream (not waited for).
  void replay(const int32_t* seqs, int64_t n);
  size_t attention_calls() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Whether this build and device capture decode steps: the CUDA backend with the Hopper attention
// (the one whose captured calls can be re-planned).
bool captured_graphs_available(Backend backend);

}  // namespace samebits
