// Small helpers shared by the op cases.
#pragma once
#include <fmt/format.h>

#include "samebits/harness.hpp"
#include "samebits/ops.hpp"

namespace samebits::harness {

inline TensorView V(const HostTensor& t) { return t.view(); }
inline TensorView grad_view(CaseIO& io, const std::string& name) {
  auto it = io.param_grads.find(name);
  return it == io.param_grads.end() ? TensorView{} : it->second.view();
}

// A per-token upstream gradient tensor: its dtype follows the op's dtype for activations.
inline HostTensor upstream(Rng& r, DType dt, std::vector<int64_t> shape) { return r.tensor(dt, std::move(shape), -1, 1); }

}  // namespace samebits::harness
