// Decode steps replayed from CUDA graphs (the engine's steady state: every running sample feeds its
// last token and draws the next). A step of B sequences runs the graph of its bucket — the least
// of 1, 2, 4, 8, then multiples of 8 to 64, of 32 to 256, of 64 beyond, that holds B (and never more
// than the most sequences asked for) — captured the first time a step needs it. Rows past B repeat
// sequence 0 (its token, position, slot and settings): a row's bits never depend on its neighbours,
// so they write into the cache exactly the bytes sequence 0 writes there and draw what it draws,
// and are dropped. Before a replay the step's tables (rows, cache rows, block table, sampling
// settings) go to the graph's device buffer in one copy from page-locked memory, the recorded
// attention calls are re-planned, and after it one copy brings the tokens and logprobs back.
// A step can be launched before the previous one is collected (the engine's overlapped steps):
// its rows' tokens may be the ones the previous launch drew, gathered on the device from that
// launch's outputs, so the host prepares step N + 1 while the GPU runs step N. Each bucket keeps two
// staging and two result buffers (a launch's, and the one before it, still being read).
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/captured_graph.hpp"
#include "samebits/chain.hpp"
#include "samebits/device.hpp"

namespace samebits {

class DecodeGraphs {
 public:
  // The chain's context names the stream the graphs are captured on and replayed in; the cache is paged.
  DecodeGraphs(const Chain& chain, KvCache& cache, int64_t max_seqs);
  ~DecodeGraphs();
  // Whether the chain's steps can be captured: CUDA on a Hopper GPU, a bf16 / fp16 model, head_dim 64 or 128.
  static bool available(const Chain& chain);
  // Whether launch() takes the batch: 1 … max_seqs sequences, sequence i one row at row i.
  bool takes(const ChainBatch& batch) const;
  // forward_cached(batch, cache) and sample_rows at every row under params (five a row), as one
  // graph replay: the same tokens and logprobs, bit for bit, and the cache as they leave it.
  // launch() enqueues the step (the tables' upload, the replay, the results' copy) and returns
  // without waiting; empty when the step's bucket cannot be captured (capture_error() says why),
  // having changed nothing: the caller runs the step eagerly. collect() waits for a launched step
  // and returns its draws. `fed` (empty,
  // or one entry a row of `batch`): −1, the row's token is batch.tokens'; j ≥ 0, it is the token the
  // previous launch drew at its row j, taken on the device (batch.tokens' entry is not read). At most
  // two launches may be uncollected at once.
  struct Launched {
    int64_t bucket = 0, seqs = 0;
    int buffer = 0;
  };
  std::optional<Launched> launch(const ChainBatch& batch, const std::vector<double>& params,
                                 const std::vector<int32_t>& fed = {});
  Chain::RowDraws collect(const Launched& launched);
  size_t captured() const { return buckets_.size(); }
  const std::string& capture_error() const { return capture_error_; }
  static int64_t bucket_of(int64_t seqs, int64_t max_seqs);

 private:
  struct Layout {  // byte offsets in a bucket's input buffer, and in its output buffer
    int64_t rows = 0, kv_map = 0, block_table = 0, params = 0, feed = 0, bytes = 0;
    int64_t logp = 0, weights = 0, out_bytes = 0;  // the tokens first (i32), then logprobs, weights
  };
  struct Bucket {
    int64_t seqs = 0;
    Layout at;
    DeviceTensor inputs, outputs;  // u8: the layout above; tokens (i32), logprobs (f32), weights (f32 × 2)
    // Two of each, used in turn: a launch's staging is not rewritten until its upload has run
    // (uploaded), nor its results before collect() has read them (after `done`).
    std::array<std::unique_ptr<PinnedBuffer>, 2> staging, results;
    std::array<std::unique_ptr<DeviceEvent>, 2> uploaded, done;
    int next = 0;  // the buffer the next launch takes
    std::unique_ptr<CapturedGraph> graph;
  };
  Bucket make_bucket(int64_t seqs) const;
  void capture(Bucket& b, const ChainBatch& padded);
  const Chain& chain_;
  KvCache& cache_;
  int64_t max_seqs_, cols_;
  std::map<int64_t, Bucket> buckets_;  // the captured ones
  const void* last_tokens_ = nullptr;  // the last launch's drawn tokens (device), and its rows
  int64_t last_rows_ = 0;
  std::string capture_error_;
};

}  // namespace samebits
