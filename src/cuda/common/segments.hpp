// The rows of a call as consecutive pieces: the caller's segments (sequences; int32 [S, 2] {row,
// len} on the host, validated ordered and non-overlapping by ops/common.hpp) and the gaps before,
// between and after them. Kernels that sum tokens in groups start a group at every piece, so a
// split into micro-batches at sequence boundaries, packed or padded, groups every token alike.
#pragma once
#include <cstdint>

#include "samebits/tensor.hpp"

namespace samebits::cuda {

// fn(row, len, in_segment) for each non-empty piece of [0, T), in row order; without segments,
// [0, T) is one segment.
template <class Fn>
void for_each_piece(const TensorView& segments, int64_t T, Fn&& fn) {
  if (!segments.present()) {
    if (T > 0) fn(int64_t(0), T, true);
    return;
  }
  const auto* s = segments.as<const int32_t>();
  int64_t end = 0;
  for (int64_t i = 0; i < segments.shape[0]; ++i) {
    if (s[2 * i] > end) fn(end, int64_t(s[2 * i]) - end, false);
    fn(int64_t(s[2 * i]), int64_t(s[2 * i + 1]), true);
    end = int64_t(s[2 * i]) + s[2 * i + 1];
  }
  if (T > end) fn(end, T - end, false);
}

}  // namespace samebits::cuda
