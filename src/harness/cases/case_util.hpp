// Small helpers shared by the op cases.
#pragma once
#include <fmt/format.h>

#include "samebits/harness.hpp"
#include "samebits/ops.hpp"

namespace samebits::harness {

// Host-only views (tables that stay on the host whatever the backend, e.g. attention's seqs).
inline TensorView V(const HostTensor& t) { return t.view(); }

// The batch's sequence pieces as a host segment table int32 [S, 2] {row, len}: tensor-core backends
// start a weight gradient's token groups at each piece's first row.
inline HostTensor segment_table(const Batch& b) {
  HostTensor segments(DType::i32, {int64_t(b.pieces.size()), 2});
  for (size_t i = 0; i < b.pieces.size(); ++i) {
    segments.set(int64_t(2 * i), double(b.pieces[i].row));
    segments.set(int64_t(2 * i + 1), double(b.pieces[i].len));
  }
  return segments;
}

// A per-token upstream gradient tensor: its dtype follows the op's dtype for activations.
inline HostTensor upstream(Rng& r, DType dt, std::vector<int64_t> shape) { return r.tensor(dt, std::move(shape), -1, 1); }

// One sequence's RoPE positions, int32 [len]: a packed sequence restarting at 0, or one continuing
// from a cache offset (decode / chunked prefill), sometimes far out (up to 100k) where fp32 angles
// are coarse.
inline HostTensor rope_positions(Rng& r, int64_t len) {
  const int64_t kind = r.integer(0, 2);
  const int64_t start = kind == 0 ? 0 : kind == 1 ? r.integer(1, 4096) : r.integer(90000, 100000);
  HostTensor pos(DType::i32, {len});
  for (int64_t t = 0; t < len; ++t) pos.set(t, double(start + t));
  return pos;
}

}  // namespace samebits::harness
