// The atomic-free dweight of the CUDA RMSNorm and QK-norm backwards: chunk tables and the
// chaining of their partials (dweight_chunks.cu).
//
// dweight is a sum over tokens, done without atomics and without anything depending on the SM count:
// (1) the rows are cut into chunks of C rows (C = 2^18 / H rounded to a power of two, 8 … 128: a
// function of the hidden size) starting at every segment (sequence) of the call, so any split of a
// batch into micro-batches at sequence boundaries, packed or padded, cuts the same chunks; a CTA
// takes a chunk, computes dx for its rows and sums dy·x̂ of its active rows in ascending order per
// column into a partial (fp32, [chunks, H]); (2) ranges of up to 16 consecutive chunks of a segment
// are summed in order, and (3) the ranges are added into the fp32 dweight one after another in row
// order (chain_partials). Rows outside every segment, and masked rows, add nothing. The partials cost
// 4H bytes per C rows (at bf16, H = 4096, C = 64: 1% of the backward's traffic).
//
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/segments.hpp"
#include "samebits/tensor.hpp"

namespace samebits::cuda::norm {

constexpr int RANGE_CHUNKS = 16;      // chunks summed in order before the chain
constexpr int MAX_CHUNKS = 512, MAX_RANGES = 256;  // per launch (kernel-parameter tables)
constexpr int QK_MAX_CHUNKS = 2048;  // QK-norm's chunks are small: more of them a launch

// ------------------------------------------------------------------ the chunk tables
template <int Capacity>
struct ChunkTableOf {
  static constexpr int capacity = Capacity;
  int32_t row[Capacity];   // first row (token) of the chunk
  uint8_t len[Capacity];   // rows (tokens) in it, 1 … 128
  uint8_t sums[Capacity];  // 0: outside every segment (dx only, no partial)
  int count;
};
using ChunkTable = ChunkTableOf<MAX_CHUNKS>;
using QkChunkTable = ChunkTableOf<QK_MAX_CHUNKS>;
struct RangeTable {
  int16_t first[MAX_RANGES];  // first chunk of the range (an index into the launch's chunks)
  uint8_t count[MAX_RANGES];
  int n;
};

// Rows per chunk: a function of the row length only.
inline int chunk_rows(int64_t row_elems) {
  int64_t c = (int64_t(1) << 18) / std::max<int64_t>(row_elems, 1);
  int p = 8;
  while (p * 2 <= c && p < 128) p *= 2;
  return p;
}

// Calls launch(chunks, ranges) for consecutive batches of the call's chunks, in row order: the
// caller's segments (or all rows as one) and the gaps between them (dx only), each cut into chunks
// of `rows` rows and ranges of RANGE_CHUNKS chunks from its start; a batch ends at a range boundary.
template <class Table = ChunkTable, class Launch>
void for_chunk_batches(const TensorView& segments, int64_t T, int rows, Launch&& launch) {
  Table chunks{};
  RangeTable ranges{};
  auto flush = [&] {
    if (chunks.count > 0) launch(chunks, ranges);
    chunks.count = 0;
    ranges.n = 0;
  };
  auto add_segment = [&](int64_t row, int64_t len, bool sums) {
    for (int64_t r = 0; r < len; r += int64_t(rows) * RANGE_CHUNKS) {
      const int64_t range_rows = std::min<int64_t>(int64_t(rows) * RANGE_CHUNKS, len - r);
      const int n_chunks = int((range_rows + rows - 1) / rows);
      if (chunks.count + n_chunks > Table::capacity || ranges.n == MAX_RANGES) flush();
      if (sums) {
        ranges.first[ranges.n] = int16_t(chunks.count);
        ranges.count[ranges.n] = uint8_t(n_chunks);
        ++ranges.n;
      }
      for (int c = 0; c < n_chunks; ++c) {
        chunks.row[chunks.count] = int32_t(row + r + int64_t(c) * rows);
        chunks.len[chunks.count] = uint8_t(std::min<int64_t>(rows, range_rows - int64_t(c) * rows));
        chunks.sums[chunks.count] = sums ? 1 : 0;
        ++chunks.count;
      }
    }
  };
  for_each_piece(segments, T, add_segment);
  flush();
}

// After a batch's chunk kernel: checks its launch, then (2) + (3): dweight[col] += range sums in
// order, for each range of `ranges` (its chunks' partials [chunks, width] summed in order), ranges
// in row order.
void chain_after_chunks(const float* partials, const RangeTable& ranges, int64_t width, float* dweight,
                        cudaStream_t stream, const char* op);

}  // namespace samebits::cuda::norm
