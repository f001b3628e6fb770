// The model chain's host-side tables (src/model/chain_tables.cpp): a batch's row tables checked
// and placed in the backend's memory, the attention sequence table, the weight-gradient segments.
#pragma once
#include <cstdint>
#include <vector>

#include "samebits/chain.hpp"

namespace samebits::chain_tables {

// The batch's row tables in one buffer (one upload): ids, positions, targets (i32), then the loss
// and row masks (u8), each [rows].
struct Rows {
  DeviceTensor storage;
  TensorView ids, pos, targets, loss_mask, row_mask;
};

// The batch's row tables, checked on the host (ids in the vocab, positions below the model's
// max_position_embeddings, no row in two sequences) and placed in the backend's memory.
Rows rows_of(const ChainBatch& b, const ModelConfig& config, Backend backend);
// The same checks and the same bytes (ROW_TABLE_BYTES a row), on the host; and the five views over
// such bytes at `base` (rows_of's layout, `storage` left empty).
constexpr int64_t ROW_TABLE_BYTES = 14;
HostTensor packed_rows(const ChainBatch& b, const ModelConfig& config);
Rows rows_in(void* base, int64_t rows, Device device);
// The activation named `name` in `trace` (the first of that name), or null.
const DeviceTensor* find_activation(const ActivationTrace& trace, const std::string& name);

// The attention sequence table {q_row, q_len, k_row, k_len}: keys are the batch's own rows, or,
// with a cache, the sequence's slot holding its `cached` earlier tokens and this step's.
HostTensor attention_table(const ChainBatch& batch, const KvCache* cache, int64_t capacity,
                           const std::vector<int64_t>* slot_lengths);

// The weight-gradient segments {row, len} (int32 [S, 2], host): one per sequence, in row order. The
// GPU's weight gradients group tokens from each segment's first row, so a sequence's rows meet the
// same partners in any batch, micro-batch split or layout.
HostTensor segments_of(const ChainBatch& batch);

}  // namespace samebits::chain_tables
