// samebits/engine.hpp — rollouts on samebits: a generation engine whose reported logprobs are the
// trainer's, bit for bit.
//
// Requests queue; each step the scheduler packs one batch under a token budget: every running
// sample's next token (a decode row) first, then prompt chunks in arrival order (chunked prefill),
// and runs it through the chain against a paged KV cache (a pool of pages; a request waits for
// them, and when a decode row finds none the latest request is preempted and recomputed later). A prompt is prefilled once; its
// n samples then take its keys and values (KvCache::copy_prefix) and draw their tokens apart. Every
// part of that keeps a sample's bits whatever else runs: the chain's forward is batch-, chunk- and
// layout-invariant, sampling depends only on the row's logits and (seed, sample, position)
// (samebits/sampling.hpp), and the reported logprob of a drawn token is the fused LM-head logprob
// the trainer's rescoring computes (Chain::row_logprobs) — equal to `samebits logprobs` of prompt +
// completion, bit for bit.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "samebits/chain.hpp"
#include "samebits/device.hpp"
#include "samebits/sampling.hpp"

namespace samebits {

class DecodeGraphs;

struct EngineOptions {
  Backend backend = Backend::cpu;
  int64_t max_slots = 64;           // samples decoding at once (KV-cache slots)
  int64_t max_batch_tokens = 2048;  // rows of one step: decode rows + prefill chunks
  int64_t max_context = 0;          // tokens a slot holds (prompt + new); 0: min(max_position, 4096)
  bool share_prefix = true;         // false: every sample prefills its prompt itself (same bits)
  int64_t page_size = 64;           // KV-cache page, in tokens
  int64_t kv_pages = 0;             // pages in the pool; 0: every slot's max_context (on a GPU, no more
                                    // than its free memory holds beside a step's activations). Fewer: requests
                                    // wait for pages, and a running one is preempted (recomputed
                                    // later, the same bits) when a decode row finds none
  int64_t kv_memory_bytes = 0;      // or: the pool's size in bytes (keys and values of every layer)
  bool cuda_graphs = true;          // decode steps (every row a sample's next token) replay a CUDA graph
                                    // per batch-size bucket: the same bits, ~500 fewer launches a
                                    // step (the CUDA backend on a Hopper GPU; ignored elsewhere). A
                                    // bucket is captured once, on the engine's stream, the first time
                                    // a step needs it: meanwhile no other thread of the process may
                                    // use the legacy default stream (such work fails there, and the
                                    // step runs eagerly from then on)
  bool overlap_steps = true;        // a step is launched before the previous one's draws are read
                                    // back (its decode rows take those tokens on the device), so
                                    // the host prepares step N + 1 while the GPU runs step N; a
                                    // sample that stops at step N has drawn one more token in step
                                    // N + 1, which is dropped. The same bits; false: every step
                                    // waits for its draws
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
};

// One sample of one request.
struct Completion {
  int64_t request = 0, sample = 0;
  std::vector<int32_t> tokens;     // the generated tokens (a stop token included)
  std::vector<double> logprobs;    // log p(token | prompt, earlier tokens) under the model (before
                                   // temperature or truncation): the trainer's logprob
  std::vector<double> sampling_logprobs;  // the same token's logprob under the distribution it was
                                          // drawn from (temperature, top-k / top-p / min-p applied;
                                          // 0 for greedy): the behaviour policy's, for importance
                                          // weights; the same bits on every backend and batch
  std::string finish_reason;       // "stop", "length", or "error"
  std::string error;               // with "error": the message naming the request and the problem
};

class Engine {
 public:
  Engine(const Model& model, EngineOptions options);
  ~Engine();

  // Queues a request and returns its id (0, 1, … in submission order). A bad request (empty prompt,
  // ids outside the vocab, prompt + max_new_tokens past the model's positions or a slot, n more
  // than the slots, bad sampling settings) is not queued: its completions carry the error and the
  // other requests run on.
  int64_t submit(GenerationRequest request);
  // One scheduler step; false when nothing is left to run. With overlap_steps a decode step returns
  // once it is launched and the step before it applied: its own draws are applied (and counted in
  // generated(), and its finished samples returned) by the next call, and its device work may still
  // run — on the engine's stream, which is ordered with the legacy default stream (PyTorch's
  // default): weights updated there wait for it; from another stream, synchronise first.
  bool step();
  // Steps until every request is done; returns every completion not returned before, ordered by
  // (request, sample).
  std::vector<Completion> run();
  // Called after each step with (tokens generated so far, steps so far).
  void on_progress(std::function<void(int64_t, int64_t)> f) { progress_ = std::move(f); }

  const EngineOptions& options() const { return options_; }
  int64_t preemptions() const { return preemptions_; }
  int64_t steps() const { return steps_; }          // steps run so far
  int64_t generated() const { return generated_; }  // tokens drawn so far
  // Preemptions of a request some of whose samples had ended (they need no slot on readmission).
  int64_t preemptions_with_finished_samples() const { return preempted_with_done_; }
  int64_t kv_pages() const { return cache_.pages(); }
  int64_t graph_steps() const { return graph_steps_; }  // steps run as a CUDA graph replay
  // Steps launched while the step before them was still in flight (overlap_steps).
  int64_t overlapped_steps() const { return overlapped_steps_; }
  int64_t captured_graphs() const;                      // batch-size buckets captured so far
  // Empty while decode steps may replay graphs; else why they run eagerly from now on (a step that
  // could not be captured: it ran eagerly, as every later one does).
  const std::string& graphs_off_reason() const { return graphs_off_reason_; }
  int64_t max_context() const { return context_; }

 private:
  struct Sample;
  struct Request;
  struct InFlight;  // a step launched whose draws are not applied yet
  void admit();
  bool decode_only_ahead() const;  // whether the next step may run before the draws in flight are applied
  void settle(InFlight& f);         // waits for a launched step's draws (a graph replay's) without applying them
  void settle_in_flight();
  void apply(std::unique_ptr<InFlight> f);  // appends its draws to their samples, finishing those that stop
  void apply_in_flight();
  void release(Sample& s);  // its pages and slot back (free slots kept descending: the lowest is taken first)
  void finish(Sample& s, const char* reason);
  bool preempt_latest_after(size_t index);  // the last running request, if after `index`; false: none
  int64_t next_row_pages(const Sample& s) const;  // pages the sample's slot must take for its next row
  int64_t preemptions_ = 0, preempted_with_done_ = 0;
  const Model& model_;
  EngineOptions options_;
  int64_t context_;
  DeviceStream stream_;  // the engine's device work: its chain, cache copies and graphs
  Chain chain_;
  KvCache cache_;
  std::vector<int64_t> free_slots_;
  std::deque<std::shared_ptr<Request>> waiting_;
  std::vector<std::shared_ptr<Request>> running_;
  std::vector<Completion> done_;
  int64_t next_id_ = 0, generated_ = 0, steps_ = 0, graph_steps_ = 0, overlapped_steps_ = 0;
  std::function<void(int64_t, int64_t)> progress_;
  std::unique_ptr<DecodeGraphs> graphs_;  // null: every step eager
  std::unique_ptr<InFlight> in_flight_;
  std::string graphs_off_reason_;
};

// Generates completions for `requests` in one engine (the convenience door): n per request,
// ordered by (request, sample).
std::vector<Completion> generate(const Model& model, const std::vector<GenerationRequest>& requests,
                                 const EngineOptions& options = {});

}  // namespace samebits
