// Decode steps as CUDA graph replays (src/model/decode_graphs.hpp says why they are shaped so).
#include "model/decode_graphs.hpp"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "model/chain_tables.hpp"
#include "ops/sampling_rule.hpp"
#include "samebits/error.hpp"

namespace samebits {

namespace {
constexpr const char* OP = "DecodeGraphs";
int64_t aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }
}  // namespace

bool DecodeGraphs::available(const Chain& chain) {
  const DType act = chain.act_dtype();
  const int64_t D = chain.model().config().head_dim;
  return captured_graphs_available(chain.backend()) && (act == DType::bf16 || act == DType::f16) && (D == 64 || D == 128);
}

DecodeGraphs::DecodeGraphs(const Chain& chain, KvCache& cache, int64_t max_seqs)
    : chain_(chain), cache_(cache), max_seqs_(max_seqs), cols_(cache.pages_for(cache.capacity())) {
  if (!available(chain))
    throw Error(OP, "backend", "decode graphs need the CUDA backend on a Hopper GPU and a bf16 / fp16 model of head_dim 64 or 128");
  if (!chain.ctx_.stream) throw Error(OP, "context.stream", "graphs are captured on a stream of the chain's own");
  if (!cache.is_paged()) throw Error(OP, "cache", "decode graphs run against a paged cache");
  if (max_seqs < 1) throw Error(OP, "max_seqs", fmt::format("must be at least 1, got {}", max_seqs));
}

DecodeGraphs::~DecodeGraphs() {
  const DeviceStreamScope on(chain_.ctx_.stream);  // the buffers go back in the stream's order,
  try {                                            // after any copy from the staging memory
    device_stream_synchronize(chain_.backend(), chain_.ctx_.stream);
  } catch (...) {  // a destructor must not throw
  }
  buckets_.clear();
}

int64_t DecodeGraphs::bucket_of(int64_t n, int64_t max_seqs) {
  int64_t b = 1;
  while (b < n && b < 8) b *= 2;
  if (n > 8) {
    const int64_t step = n <= 64 ? 8 : n <= 256 ? 32 : 64;
    b = (n + step - 1) / step * step;
  }
  return std::min(b, max_seqs);
}

bool DecodeGraphs::takes(const ChainBatch& batch) const {
  const int64_t n = int64_t(batch.seqs.size());
  if (n < 1 || n > max_seqs_ || batch.rows() != n) return false;
  if (int64_t(batch.positions.size()) != n || int64_t(batch.targets.size()) != n ||
      (!batch.loss_mask.empty() && int64_t(batch.loss_mask.size()) != n))
    return false;
  for (int64_t i = 0; i < n; ++i)
    if (batch.seqs[size_t(i)].row != i || batch.seqs[size_t(i)].len != 1) return false;
  return true;
}

DecodeGraphs::Bucket DecodeGraphs::make_bucket(int64_t seqs) const {
  Bucket b;
  b.seqs = seqs;
  b.at.rows = 0;
  b.at.kv_map = aligned(seqs * chain_tables::ROW_TABLE_BYTES);
  b.at.block_table = b.at.kv_map + aligned(2 * seqs * 4);
  b.at.params = b.at.block_table + aligned(seqs * cols_ * 4);
  b.at.feed = b.at.params + aligned(seqs * sampling_rule::PARAMS * 8);
  b.at.bytes = b.at.feed + 2 * seqs * 4;
  b.at.logp = aligned(seqs * 4);
  b.at.weights = b.at.logp + aligned(seqs * 4);
  b.at.out_bytes = b.at.weights + seqs * 8;
  const Backend be = chain_.backend();
  b.inputs = DeviceTensor::uninitialized(be, DType::u8, {b.at.bytes});
  b.outputs = DeviceTensor::uninitialized(be, DType::u8, {b.at.out_bytes});
  for (int i = 0; i < 2; ++i) {
    b.staging[size_t(i)] = std::make_unique<PinnedBuffer>(be, size_t(b.at.bytes));
    b.results[size_t(i)] = std::make_unique<PinnedBuffer>(be, size_t(b.outputs.bytes()));
    b.uploaded[size_t(i)] = std::make_unique<DeviceEvent>(be);
    b.done[size_t(i)] = std::make_unique<DeviceEvent>(be);
  }
  return b;
}

void DecodeGraphs::capture(Bucket& b, const ChainBatch& padded) {
  const ModelConfig& c = chain_.model().config();
  auto* in = static_cast<uint8_t*>(b.inputs.view().data);
  auto* out = static_cast<uint8_t*>(b.outputs.view().data);
  const int64_t n = b.seqs;
  Chain::StepTables t;
  t.rows = in + b.at.rows;
  t.kv_map = TensorView::of(in + b.at.kv_map, DType::i32, {2, n}, Device::cuda);
  // Each row's cache row is the map's first row: a bucket's row i is sequence i, one row each (takes()).
  t.cache_rows = TensorView::of(in + b.at.kv_map, DType::i32, {n}, Device::cuda);
  t.block_table = TensorView::of(in + b.at.block_table, DType::i32, {n, cols_}, Device::cuda);
  const TensorView params = TensorView::of(in + b.at.params, DType::f64, {n, sampling_rule::PARAMS}, Device::cuda);
  const TensorView tokens = TensorView::of(out, DType::i32, {n}, Device::cuda);
  const TensorView logp = TensorView::of(out + b.at.logp, DType::f32, {n}, Device::cuda);
  const TensorView weights = TensorView::of(out + b.at.weights, DType::f32, {n, 2}, Device::cuda);
  const GraphAttentionShape shape{n, cache_.capacity(), c.num_heads, c.num_kv_heads, c.head_dim, chain_.act_dtype()};
  auto graph = std::make_unique<CapturedGraph>(chain_.ctx_.stream, [&] {
    const ChainForward f = chain_.run(padded, &cache_, nullptr, /*score_rows=*/false, &t);
    chain_.draw(f.at("final.n1").view(), params, tokens, logp, weights);
  }, shape);
  // An attention call outside the recording would replay its capture-time plan (stale key counts):
  // refuse the graph rather than give wrong bits.
  if (graph->attention_calls() != size_t(c.num_layers))
    throw Error(OP, "graph", fmt::format("{} of the {} layers' attention calls were recorded for re-planning",
                                         graph->attention_calls(), c.num_layers));
  b.graph = std::move(graph);
}

std::optional<DecodeGraphs::Launched> DecodeGraphs::launch(const ChainBatch& batch, const std::vector<double>& params,
                                                           const std::vector<int32_t>& fed) {
  constexpr int64_t P = sampling_rule::PARAMS;
  if (!takes(batch)) throw Error(OP, "batch", "is not a decode step of at most max_seqs sequences (cannot happen)");
  const int64_t B = int64_t(batch.seqs.size());
  Chain::check_draw_params(OP, params, B);
  if (!fed.empty() && int64_t(fed.size()) != B) throw Error(OP, "fed", "needs one entry a row (cannot happen)");
  for (int32_t j : fed)
    if (j >= 0 && (!last_tokens_ || j >= last_rows_))
      throw Error(OP, "fed", fmt::format("row {} of the previous launch, which had {} (cannot happen)", j, last_rows_));
  const DeviceStreamScope on(chain_.ctx_.stream);
  const int64_t n = bucket_of(B, max_seqs_);
  auto found = buckets_.find(n);
  std::optional<Bucket> fresh;  // a bucket not captured yet: kept only once its capture succeeds
  if (found == buckets_.end()) fresh.emplace(make_bucket(n));
  Bucket& b = fresh ? *fresh : found->second;
  // The bucket's batch: rows past B repeat sequence 0 (and take its token from where it does).
  ChainBatch padded = batch;
  std::vector<int32_t> feed_dst, feed_src;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t from = fed.empty() ? -1 : fed[size_t(i < B ? i : 0)];
    if (from >= 0) feed_dst.push_back(int32_t(i)), feed_src.push_back(from);
    if (from >= 0 && i < B) padded.tokens[size_t(i)] = 0;  // a placeholder the checks pass: the device writes the token
    if (i < B) continue;
    ChainSequence s = batch.seqs[0];
    s.row = i;
    padded.seqs.push_back(s);
    padded.tokens.push_back(padded.tokens[0]);
    padded.positions.push_back(batch.positions[0]);
    padded.targets.push_back(batch.targets[0]);
    padded.loss_mask.push_back(batch.loss_mask.empty() ? 0 : batch.loss_mask[0]);
  }
  // The host's checks (ids, positions, slots, pages) and the step's tables, staged.
  const HostTensor rows = chain_tables::packed_rows(padded, chain_.model().config());
  const HostTensor seqs = chain_tables::attention_table(padded, &cache_, cache_.capacity(), &cache_.lengths_);
  const HostTensor table = cache_.block_table_of(padded.seqs, cols_), kv_map = cache_.write_rows_of(padded.seqs);
  if (table.shape()[1] != cols_) throw Error(OP, "cache", "a slot holds more pages than its capacity (cannot happen)");
  if (fresh) {  // nothing of an earlier launch may still run while a graph is captured on the stream
    device_stream_synchronize(chain_.backend(), chain_.ctx_.stream);
  }
  const int k = b.next;
  b.uploaded[size_t(k)]->wait();  // the launch before last that used this staging has uploaded it
  auto* st = static_cast<uint8_t*>(b.staging[size_t(k)]->data());
  std::memcpy(st + b.at.rows, rows.data(), rows.bytes());
  std::memcpy(st + b.at.kv_map, kv_map.data(), kv_map.bytes());
  std::memcpy(st + b.at.block_table, table.data(), table.bytes());
  auto* settings = reinterpret_cast<double*>(st + b.at.params);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(settings + i * P, params.data() + (i < B ? i : 0) * P, P * sizeof(double));
  auto* feed = reinterpret_cast<int32_t*>(st + b.at.feed);
  std::copy(feed_dst.begin(), feed_dst.end(), feed);
  std::copy(feed_src.begin(), feed_src.end(), feed + n);
  if (fresh) {
    try {
      capture(b, padded);
    } catch (const Error& e) {  // nothing ran: the caller runs this step (and the later ones) eagerly
      capture_error_ = e.what();
      return std::nullopt;
    }
  }
  auto* in = static_cast<uint8_t*>(b.inputs.view().data);
  copy_async(chain_.backend(), in, st, size_t(b.at.bytes));
  b.uploaded[size_t(k)]->record();
  if (!feed_dst.empty()) {  // the previous launch's tokens into this step's rows (before the replay reads them)
    const auto* map = reinterpret_cast<const int32_t*>(in + b.at.feed);
    gather_tokens(chain_.backend(), reinterpret_cast<int32_t*>(in + b.at.rows), static_cast<const int32_t*>(last_tokens_),
                  map, map + n, int64_t(feed_dst.size()));
  }
  b.graph->replay(static_cast<const int32_t*>(seqs.data()), n);
  copy_async(chain_.backend(), b.results[size_t(k)]->data(), b.outputs.view().data, b.outputs.bytes());
  b.done[size_t(k)]->record();
  b.next = 1 - k;
  for (const ChainSequence& s : batch.seqs) cache_.lengths_[size_t(s.slot)] = s.cached + s.len;
  last_tokens_ = b.outputs.view().data;
  last_rows_ = n;
  if (fresh) buckets_.emplace(n, std::move(*fresh));
  return Launched{n, B, k};
}

Chain::RowDraws DecodeGraphs::collect(const Launched& l) {
  auto found = buckets_.find(l.bucket);
  if (found == buckets_.end()) throw Error(OP, "launched", "names no captured bucket (cannot happen)");
  const Bucket& b = found->second;
  b.done[size_t(l.buffer)]->wait();
  const auto* res = static_cast<const uint8_t*>(b.results[size_t(l.buffer)]->data());
  return Chain::draws_of(l.seqs, reinterpret_cast<const int32_t*>(res), reinterpret_cast<const float*>(res + b.at.logp),
                         reinterpret_cast<const float*>(res + b.at.weights));
}

}  // namespace samebits
