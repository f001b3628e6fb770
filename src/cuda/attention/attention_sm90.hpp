// The Hopper (sm_90a) attention forward, called by attention_forward.cu where the device has it.
#pragma once
#include <cuda_runtime.h>

#include <memory>

#include "cuda/attention/attention_common.cuh"
#include "samebits/ops.hpp"

namespace samebits::cuda::attention {

// Keys are combined in spans of this many, aligned to key position 0 (split-KV boundaries).
constexpr int ATTENTION_SPLIT_KEYS = 1024;

// Runs the rows the sequence table covers (the caller clears the others); arguments already checked,
// `pages` (a device copy of the block table, if any) made by the caller.
void attention_forward_sm90(const AttentionForwardArgs& a, const KeyPages& pages, cudaStream_t stream, const char* op);

// Attention forwards inside a captured CUDA graph (a decode step replayed token after token). A
// call's work depends on its sequence table (how many spans each key range splits into), which
// changes every step while the graph stays. So while a recording is in scope, a forward launched on
// a capturing stream reads its work table and split-KV partials from the recording's buffers,
// always captures its combine kernel, and is remembered; before each replay replan_graph plans the
// step's work exactly as an eager call would (the same items: the same bits), uploads the table on
// the stream and sets every remembered node's grid and kernel, enabling the combine only when a
// span is split. Sized for `max_seqs` sequences of one query row and keys up to `max_k_len`.
struct GraphRecording;
struct RecordingDeleter {
  void operator()(GraphRecording* r) const;
};
// (Also opts every forward kernel of the dtype and D into its shared memory: nothing of that in a capture.)
std::unique_ptr<GraphRecording, RecordingDeleter> make_graph_recording(int64_t max_seqs, int64_t max_k_len, int64_t Hq,
                                                                       int64_t Hkv, int64_t D, DType dtype);
class RecordingScope {  // this thread's active recording while it lives
 public:
  explicit RecordingScope(GraphRecording* r);
  ~RecordingScope();
  RecordingScope(const RecordingScope&) = delete;
  RecordingScope& operator=(const RecordingScope&) = delete;

 private:
  GraphRecording* previous_;
};
size_t recorded_calls(const GraphRecording& r);
// `seqs` int32 [n_seqs, 4] on the host, as the attention op takes it. The caller keeps the stream's
// order: the upload and the replay after it on `stream`.
void replan_graph(GraphRecording& r, cudaGraphExec_t exec, const int32_t* seqs, int64_t n_seqs, cudaStream_t stream);

}  // namespace samebits::cuda::attention
