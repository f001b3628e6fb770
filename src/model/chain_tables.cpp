// The model chain's tables: batches (packed, padded), their row / attention / segment tables, the
// KV cache and the gradient accumulators. The forward and backward that use them: chain.cpp.
#include "model/chain_tables.hpp"

#include "samebits/ops.hpp"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "samebits/error.hpp"

namespace samebits {

namespace chain_tables {

// The batch's row tables, checked on the host and packed as rows_of uploads them.
HostTensor packed_rows(const ChainBatch& b, const ModelConfig& config) {
  const int64_t vocab = config.vocab_size, max_position = config.rope.max_position;
  const int64_t T = b.rows();
  if (T == 0) throw Error("chain", "batch", "empty batch: no rows");
  if (b.seqs.empty()) throw Error("chain", "batch", "empty batch: no sequences");
  if (int64_t(b.positions.size()) != T || int64_t(b.targets.size()) != T ||
      (!b.loss_mask.empty() && int64_t(b.loss_mask.size()) != T))
    throw Error("chain", "batch", "tokens, positions, targets and loss_mask must have one entry per row");
  struct {
    HostTensor ids, pos, targets, loss_mask, row_mask;
  } r{HostTensor(DType::i32, {T}), HostTensor(DType::i32, {T}), HostTensor(DType::i32, {T}),
      HostTensor(DType::u8, {T}), HostTensor(DType::u8, {T})};
  for (auto& s : b.seqs) {
    if (s.len <= 0) throw Error("chain", "batch", "zero-length sequence");
    if (s.row < 0 || s.row + s.len > T) throw Error("chain", "batch", "a sequence's rows fall outside the batch");
    for (int64_t i = s.row; i < s.row + s.len; ++i) {
      if (r.row_mask.get(i) != 0) throw Error("chain", "batch", fmt::format("row {} belongs to two sequences", i));
      r.row_mask.set(i, 1);
    }
  }
  for (int64_t i = 0; i < T; ++i) {
    if (b.tokens[size_t(i)] < 0 || b.tokens[size_t(i)] >= vocab)
      throw Error("chain", "tokens", fmt::format("token id {} at row {} is outside [0, {})", b.tokens[size_t(i)], i, vocab));
    // Checked here, before any work, with the model's limit named (the kernels would refuse it
    // later, and only as "argument 'positions'").
    if (r.row_mask.get(i) != 0 && (b.positions[size_t(i)] < 0 || b.positions[size_t(i)] >= max_position))
      throw Error("chain", "positions",
                  b.positions[size_t(i)] < 0
                      ? fmt::format("position {} at row {} is negative", b.positions[size_t(i)], i)
                      : fmt::format("position {} at row {} is past the model's max_position_embeddings ({}): a sequence "
                                    "may hold at most {} tokens", b.positions[size_t(i)], i, max_position, max_position));
    r.ids.set(i, b.tokens[size_t(i)]);
    r.pos.set(i, b.positions[size_t(i)]);
    r.targets.set(i, b.targets[size_t(i)]);
    const bool scored = r.row_mask.get(i) != 0 && (b.loss_mask.empty() || b.loss_mask[size_t(i)] != 0);
    r.loss_mask.set(i, scored ? 1 : 0);
  }
  HostTensor packed(DType::u8, {ROW_TABLE_BYTES * T});
  auto* bytes = static_cast<uint8_t*>(packed.data());
  size_t at = 0;
  for (const HostTensor* t : {&r.ids, &r.pos, &r.targets, &r.loss_mask, &r.row_mask}) {
    std::memcpy(bytes + at, t->data(), t->bytes());
    at += t->bytes();
  }
  return packed;
}

Rows rows_in(void* base_ptr, int64_t T, Device device) {
  auto* base = static_cast<uint8_t*>(base_ptr);
  Rows out;
  out.ids = TensorView::of(base, DType::i32, {T}, device);
  out.pos = TensorView::of(base + 4 * T, DType::i32, {T}, device);
  out.targets = TensorView::of(base + 8 * T, DType::i32, {T}, device);
  out.loss_mask = TensorView::of(base + 12 * T, DType::u8, {T}, device);
  out.row_mask = TensorView::of(base + 13 * T, DType::u8, {T}, device);
  return out;
}

Rows rows_of(const ChainBatch& b, const ModelConfig& config, Backend backend) {
  DeviceTensor storage = DeviceTensor::from_host(backend, packed_rows(b, config));
  Rows out = rows_in(storage.view().data, b.rows(), storage.view().device);
  out.storage = std::move(storage);
  return out;
}

// The attention sequence table {q_row, q_len, k_row, k_len}: keys are the batch's own rows, or,
// with a cache, the sequence's slot holding its `cached` earlier tokens and this step's.
HostTensor attention_table(const ChainBatch& batch, const KvCache* cache, int64_t capacity,
                           const std::vector<int64_t>* slot_lengths) {
  HostTensor seqs(DType::i32, {int64_t(batch.seqs.size()), 4});
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const ChainSequence& s = batch.seqs[i];
    int64_t row[4] = {s.row, s.len, s.row, s.len};
    if (cache) {
      if (s.slot < 0 || s.slot >= int64_t(slot_lengths->size()))
        throw Error("chain", "batch", fmt::format("sequence {} has no valid cache slot", i));
      if ((*slot_lengths)[size_t(s.slot)] != s.cached)
        throw Error("chain", "batch", fmt::format("sequence {}: cached = {} but its slot holds {} tokens", i, s.cached,
                                                  (*slot_lengths)[size_t(s.slot)]));
      if (s.cached + s.len > capacity)
        throw Error("chain", "batch", fmt::format("sequence {} overflows its cache slot ({} tokens)", i, capacity));
      if (cache->is_paged() && cache->pages_for(s.cached + s.len) > int64_t(cache->block_table(s.slot).size()))
        throw Error("chain", "cache", fmt::format("sequence {}: slot {} has pages for {} tokens, the step needs {} "
                                                  "(KvCache::reserve)", i, s.slot,
                                                  int64_t(cache->block_table(s.slot).size()) * cache->page_size(),
                                                  s.cached + s.len));
      row[2] = cache->is_paged() ? 0 : s.slot * capacity;
      row[3] = s.cached + s.len;
    }
    for (int k = 0; k < 4; ++k) seqs.set(int64_t(i) * 4 + k, double(row[k]));
  }
  return seqs;
}

// The weight-gradient segments {row, len} (int32 [S, 2], host): one per sequence, in row order. The
// GPU's weight gradients group tokens from each segment's first row, so a sequence's rows meet the
// same partners in any batch, micro-batch split or layout.
HostTensor segments_of(const ChainBatch& batch) {
  std::vector<const ChainSequence*> order;
  for (auto& s : batch.seqs) order.push_back(&s);
  std::sort(order.begin(), order.end(), [](const ChainSequence* a, const ChainSequence* b) { return a->row < b->row; });
  HostTensor segs(DType::i32, {int64_t(order.size()), 2});
  for (size_t i = 0; i < order.size(); ++i) {
    segs.set(int64_t(i) * 2, double(order[i]->row));
    segs.set(int64_t(i) * 2 + 1, double(order[i]->len));
  }
  return segs;
}

}  // namespace chain_tables

// ---------------------------------------------------------------- batches
ChainBatch ChainBatch::packed(const std::vector<std::vector<int32_t>>& sequences) {
  ChainBatch b;
  for (auto& s : sequences) {
    const int64_t row = b.rows();
    for (size_t i = 0; i < s.size(); ++i) {
      b.tokens.push_back(s[i]);
      b.positions.push_back(int32_t(i));
      b.targets.push_back(i + 1 < s.size() ? s[i + 1] : -100);
      b.loss_mask.push_back(i + 1 < s.size() ? 1 : 0);
    }
    b.seqs.push_back({row, int64_t(s.size())});
  }
  return b;
}

ChainBatch ChainBatch::padded(const std::vector<std::vector<int32_t>>& sequences, int64_t slot_len, bool left,
                              int empty_slots, int32_t pad_token) {
  ChainBatch b;
  const int64_t slots = int64_t(sequences.size()) + empty_slots;
  b.tokens.assign(size_t(slots * slot_len), pad_token);
  b.positions.assign(b.tokens.size(), 0);
  b.targets.assign(b.tokens.size(), -100);
  b.loss_mask.assign(b.tokens.size(), 0);
  for (size_t k = 0; k < sequences.size(); ++k) {
    const auto& s = sequences[k];
    if (int64_t(s.size()) > slot_len) throw Error("ChainBatch::padded", "slot_len", "shorter than a sequence");
    const int64_t slot = int64_t(k) + (k > 0 ? empty_slots : 0);
    const int64_t row = slot * slot_len + (left ? slot_len - int64_t(s.size()) : 0);
    for (size_t i = 0; i < s.size(); ++i) {
      b.tokens[size_t(row) + i] = s[i];
      b.positions[size_t(row) + i] = int32_t(i);
      b.targets[size_t(row) + i] = i + 1 < s.size() ? s[i + 1] : -100;
      b.loss_mask[size_t(row) + i] = i + 1 < s.size() ? 1 : 0;
    }
    b.seqs.push_back({row, int64_t(s.size())});
  }
  return b;
}

// ---------------------------------------------------------------- cache and gradients
KvCache::KvCache(const ModelConfig& c, int64_t slots, int64_t capacity, int64_t rows, DType dtype, Backend backend)
    : capacity_(capacity), lengths_(size_t(slots), 0) {
  if (slots < 1 || capacity < 1) throw Error("KvCache", "slots", fmt::format("{} slots of {} tokens", slots, capacity));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    k_.emplace_back(backend, dtype, std::vector<int64_t>{rows, c.num_kv_heads, c.head_dim});
    v_.emplace_back(backend, dtype, std::vector<int64_t>{rows, c.num_kv_heads, c.head_dim});
  }
}

KvCache::KvCache(const ModelConfig& c, int64_t slots, int64_t capacity, DType dtype, Backend backend)
    : KvCache(c, slots, capacity, slots * capacity, dtype, backend) {}

KvCache KvCache::paged(const ModelConfig& c, int64_t slots, int64_t capacity, int64_t pages, int64_t page_size,
                       DType dtype, Backend backend) {
  if (pages < 1 || page_size < 1 || pages * page_size > (int64_t(1) << 31))
    throw Error("KvCache::paged", "pages", fmt::format("{} pages of {} tokens", pages, page_size));
  if (!paged_attention_takes(backend, page_size))
    throw Error("KvCache::paged", "page_size", fmt::format("the {} attention takes no pages of {} tokens: on CUDA a page is a "
                                                           "multiple of 8 tokens that divides 128 or is a multiple of it",
                                                           backend_name(backend), page_size));
  KvCache cache(c, slots, capacity, pages * page_size, dtype, backend);
  cache.page_size_ = page_size;
  cache.tables_.resize(size_t(slots));
  cache.users_.assign(size_t(pages), 0);
  for (int64_t p = pages - 1; p >= 0; --p) cache.free_.push_back(int32_t(p));
  return cache;
}

int64_t KvCache::row_of(int64_t slot, int64_t pos) const {
  if (!is_paged()) return slot * capacity_ + pos;
  return int64_t(tables_[size_t(slot)][size_t(pos / page_size_)]) * page_size_ + pos % page_size_;
}

HostTensor KvCache::block_table_of(const std::vector<ChainSequence>& seqs, int64_t min_cols) const {
  size_t cols = size_t(std::max<int64_t>(min_cols, 1));
  for (auto& s : seqs) cols = std::max(cols, block_table(s.slot).size());
  HostTensor t(DType::i32, {int64_t(seqs.size()), int64_t(cols)});  // zero-filled: page 0
  for (size_t i = 0; i < seqs.size(); ++i) {
    const auto& pages = block_table(seqs[i].slot);
    std::copy(pages.begin(), pages.end(), static_cast<int32_t*>(t.data()) + i * cols);
  }
  return t;
}

HostTensor KvCache::write_rows_of(const std::vector<ChainSequence>& seqs) const {
  int64_t rows = 0;
  for (const ChainSequence& s : seqs) rows += s.len;
  HostTensor m(DType::i32, {2, std::max<int64_t>(rows, 1)});
  auto* at = static_cast<int32_t*>(m.data());
  for (const ChainSequence& s : seqs)
    for (int64_t pos = s.cached; pos < s.cached + s.len; ++pos, ++at) {
      at[0] = int32_t(row_of(s.slot, pos));
      at[rows] = int32_t(s.row + pos - s.cached);
    }
  return m;
}

HostTensor KvCache::cache_rows_of(const std::vector<ChainSequence>& seqs, int64_t rows) const {
  HostTensor m(DType::i32, {rows});
  auto* at = static_cast<int32_t*>(m.data());
  std::fill(at, at + rows, -1);
  for (const ChainSequence& s : seqs)
    for (int64_t pos = s.cached; pos < s.cached + s.len; ++pos) at[s.row + pos - s.cached] = int32_t(row_of(s.slot, pos));
  return m;
}

bool KvCache::reserve(int64_t slot, int64_t tokens) {
  if (slot < 0 || slot >= slots()) throw Error("KvCache::reserve", "slot", fmt::format("{} (of {} slots)", slot, slots()));
  if (tokens > capacity_) return false;
  if (!is_paged()) return true;
  auto& table = tables_[size_t(slot)];
  const int64_t lacking = pages_for(tokens) - int64_t(table.size());
  if (lacking > free_pages()) return false;
  for (int64_t i = 0; i < lacking; ++i) {
    table.push_back(free_.back());
    free_.pop_back();
    users_[size_t(table.back())] = 1;
  }
  return true;
}

void KvCache::reset(int64_t slot) {
  lengths_.at(size_t(slot)) = 0;
  if (!is_paged()) return;
  for (int32_t page : tables_[size_t(slot)])  // kept descending: the lowest page is taken first
    if (--users_[size_t(page)] == 0)
      free_.insert(std::upper_bound(free_.begin(), free_.end(), page, std::greater<int32_t>()), page);
  tables_[size_t(slot)].clear();
}

bool KvCache::copy_prefix(int64_t from, int64_t to, int64_t len) {
  if (from < 0 || from >= slots() || to < 0 || to >= slots() || from == to)
    throw Error("KvCache::copy_prefix", "slots", fmt::format("{} -> {} (of {} slots)", from, to, slots()));
  if (len < 0 || len > lengths_[size_t(from)])
    throw Error("KvCache::copy_prefix", "len", fmt::format("{} tokens, slot {} holds {}", len, from, lengths_[size_t(from)]));
  if (lengths_[size_t(to)] != 0 || (is_paged() && !tables_[size_t(to)].empty()))
    throw Error("KvCache::copy_prefix", "to", fmt::format("slot {} is not empty", to));
  if (!is_paged()) {
    for (size_t l = 0; l < k_.size(); ++l) {
      k_[l].copy_rows_from(k_[l], from * capacity_, to * capacity_, len);
      v_[l].copy_rows_from(v_[l], from * capacity_, to * capacity_, len);
    }
  } else {
    const int64_t full = len / page_size_, rest = len % page_size_;
    if (rest > 0 && free_.empty()) return false;
    auto& table = tables_[size_t(to)];
    for (int64_t i = 0; i < full; ++i) {
      table.push_back(tables_[size_t(from)][size_t(i)]);
      ++users_[size_t(table.back())];
    }
    if (rest > 0) {
      const int32_t own = free_.back();
      free_.pop_back();
      users_[size_t(own)] = 1;
      table.push_back(own);
      const int64_t src = int64_t(tables_[size_t(from)][size_t(full)]) * page_size_;
      for (size_t l = 0; l < k_.size(); ++l) {
        k_[l].copy_rows_from(k_[l], src, int64_t(own) * page_size_, rest);
        v_[l].copy_rows_from(v_[l], src, int64_t(own) * page_size_, rest);
      }
    }
  }
  lengths_[size_t(to)] = len;
  return true;
}

ModelGrads::ModelGrads(const Model& model, DType acc, Backend backend) : tied_(model.config().tie_word_embeddings) {
  for (auto& [name, w] : model.weights())
    acc_[name] = DeviceTensor(backend, acc, std::vector<int64_t>(w.shape.begin(), w.shape.begin() + w.ndim));
  if (tied_) acc_["lm_head.weight"] = DeviceTensor(backend, acc, acc_.at("model.embed_tokens.weight").shape());
}

std::vector<std::string> ModelGrads::names() const {
  std::vector<std::string> n;
  for (auto& [name, t] : acc_)
    if (!(tied_ && name == "lm_head.weight")) n.push_back(name);
  return n;
}

HostTensor ModelGrads::gradient(const std::string& name) const {
  if (!acc_.count(name))
    throw Error("ModelGrads::gradient", name, "no such weight gradient (names() lists them)");
  HostTensor g = acc_.at(name).to_host();
  if (tied_ && name == "model.embed_tokens.weight") {
    const HostTensor head = acc_.at("lm_head.weight").to_host();
    for (int64_t i = 0; i < g.numel(); ++i) g.set(i, g.get(i) + head.get(i));  // one add: order-free
  }
  return g;
}

const DeviceTensor* chain_tables::find_activation(const ActivationTrace& trace, const std::string& name) {
  for (auto& [n, t] : trace)
    if (n == name) return &t;
  return nullptr;
}

const DeviceTensor& ChainForward::at(const std::string& name) const {
  if (const DeviceTensor* t = chain_tables::find_activation(trace, name)) return *t;
  throw Error("ChainForward::at", name, "no such activation");
}

}  // namespace samebits
