// Small helpers shared by the op cases.
#pragma once
#include <fmt/format.h>

#include "samebits/harness.hpp"
#include "samebits/ops.hpp"

namespace samebits::harness {

// Host-only views (tables that stay on the host whatever the backend, e.g. attention's seqs).
inline TensorView V(const HostTensor& t) { return t.view(); }

// A per-token upstream gradient tensor: its dtype follows the op's dtype for activations.
inline HostTensor upstream(Rng& r, DType dt, std::vector<int64_t> shape) { return r.tensor(dt, std::move(shape), -1, 1); }

}  // namespace samebits::harness
