// CapturedGraph where the CUDA backend was not built: nothing to capture (src/cuda/graph/ has it).
#include "core/captured_graph.hpp"

#include "samebits/error.hpp"

#if !SAMEBITS_WITH_CUDA
namespace samebits {

struct CapturedGraph::Impl {};

CapturedGraph::CapturedGraph(void*, const std::function<void()>&, const GraphAttentionShape&) {
  throw NotBuilt("CapturedGraph", "cuda");
}
CapturedGraph::~CapturedGraph() = default;
void CapturedGraph::replay(const int32_t*, int64_t) { throw NotBuilt("CapturedGraph", "cuda"); }
size_t CapturedGraph::attention_calls() const { return 0; }
bool captured_graphs_available(Backend) { return false; }

}  // namespace samebits
#endif
