// CapturedGraph on CUDA (src/core/captured_graph.hpp says why it exists). A capture is thread-local
// (another thread's CUDA calls are not refused meanwhile); a failure inside it ends the capture and
// discards the graph before the error goes on, so the stream is usable again.
#include <cuda_runtime.h>

#include "core/captured_graph.hpp"
#include "cuda/attention/attention_sm90.hpp"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "samebits/device.hpp"

namespace samebits {

namespace cuda {
bool sm90_path_available();
}

struct CapturedGraph::Impl {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::unique_ptr<cuda::attention::GraphRecording, cuda::attention::RecordingDeleter> attention;
  ~Impl() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
};

CapturedGraph::CapturedGraph(void* stream, const std::function<void()>& body, const GraphAttentionShape& a)
    : impl_(std::make_unique<Impl>()) {
  const char* op = "CapturedGraph";
  if (!stream) throw Error(op, "stream", "the legacy default stream cannot be captured: give a stream of its own");
  impl_->stream = static_cast<cudaStream_t>(stream);
  impl_->attention = cuda::attention::make_graph_recording(a.seqs, a.max_k_len, a.q_heads, a.kv_heads, a.head_dim, a.dtype);
  cuda::scratch_pool_ready(op);  // the capture's temporaries come from it
  cuda::check(cudaStreamBeginCapture(impl_->stream, cudaStreamCaptureModeThreadLocal), op, "begin the capture");
  try {
    const cuda::attention::RecordingScope recording(impl_->attention.get());
    const DeviceStreamScope on(stream);
    body();
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(impl_->stream, &broken);
    if (broken) cudaGraphDestroy(broken);
    cudaGetLastError();  // the capture's error, if it broke it, is not the one to report
    throw;
  }
  cuda::check(cudaStreamEndCapture(impl_->stream, &impl_->graph), op, "end the capture");
  cuda::check(cudaGraphInstantiateWithFlags(&impl_->exec, impl_->graph, 0), op, "instantiate the graph");
}

CapturedGraph::~CapturedGraph() = default;

void CapturedGraph::replay(const int32_t* seqs, int64_t n) {
  cuda::attention::replan_graph(*impl_->attention, impl_->exec, seqs, n, impl_->stream);
  cuda::check(cudaGraphLaunch(impl_->exec, impl_->stream), "CapturedGraph", "launch");
}

size_t CapturedGraph::attention_calls() const { return cuda::attention::recorded_calls(*impl_->attention); }

bool captured_graphs_available(Backend backend) { return backend == Backend::cuda && cuda::sm90_path_available(); }

}  // namespace samebits
