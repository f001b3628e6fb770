// Raw-bit and tolerance comparisons that produce drift reports.
#pragma once
#include "samebits/harness.hpp"

namespace samebits::harness {

// memcmp of two tensors; on a difference, a Drift with the first differing index and statistics.
bool same_bits(const HostTensor& a, const HostTensor& b, Drift& d);
// Accuracy of `a` against the truth `t` (fp64): fills max_abs / max_rel / max_ulp / worst_ratio
// and the first element over the tolerance; returns whether every element is within it.
bool within_tolerance(const HostTensor& a, const HostTensor& t, Tolerance tol, Drift& d);
std::string index_text(const std::vector<int64_t>& shape, int64_t flat);

}  // namespace samebits::harness
