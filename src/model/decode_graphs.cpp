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
  b.at.bytes = b.at.params + seqs * sampling_rule::PARAMS * 8;
  const Backend be = chain_.backend();
  b.inputs = DeviceTensor::uninitialized(be, DType::u8, {b.at.bytes});
  b.outputs = DeviceTensor::uninitialized(be, DType::u8, {2 * aligned(seqs * 4) + seqs * 8});  // tokens, logp, weights
  b.staging = std::make_unique<PinnedBuffer>(be, size_t(b.at.bytes));
  b.results = std::make_unique<PinnedBuffer>(be, size_t(b.outputs.bytes()));
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
  t.block_table = TensorView::of(in + b.at.block_table, DType::i32, {n, cols_}, Device::cuda);
  const TensorView params = TensorView::of(in + b.at.params, DType::f64, {n, sampling_rule::PARAMS}, Device::cuda);
  const TensorView tokens = TensorView::of(out, DType::i32, {n}, Device::cuda);
  const TensorView logp = TensorView::of(out + aligned(n * 4), DType::f32, {n}, Device::cuda);
  const TensorView weights = TensorView::of(out + 2 * aligned(n * 4), DType::f32, {n, 2}, Device::cuda);
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

std::optional<Chain::RowDraws> DecodeGraphs::run(const ChainBatch& batch, const std::vector<double>& params) {
  constexpr int64_t P = sampling_rule::PARAMS;
  if (!takes(batch)) throw Error(OP, "batch", "is not a decode step of at most max_seqs sequences (cannot happen)");
  const int64_t B = int64_t(batch.seqs.size());
  Chain::check_draw_params(OP, params, B);
  const DeviceStreamScope on(chain_.ctx_.stream);
  const int64_t n = bucket_of(B, max_seqs_);
  auto found = buckets_.find(n);
  std::optional<Bucket> fresh;  // a bucket not captured yet: kept only once its capture succeeds
  if (found == buckets_.end()) fresh.emplace(make_bucket(n));
  Bucket& b = fresh ? *fresh : found->second;
  // The bucket's batch: rows past B repeat sequence 0.
  ChainBatch padded = batch;
  for (int64_t i = B; i < n; ++i) {
    ChainSequence s = batch.seqs[0];
    s.row = i;
    padded.seqs.push_back(s);
    padded.tokens.push_back(batch.tokens[0]);
    padded.positions.push_back(batch.positions[0]);
    padded.targets.push_back(batch.targets[0]);
    padded.loss_mask.push_back(batch.loss_mask.empty() ? 0 : batch.loss_mask[0]);
  }
  // The host's checks (ids, positions, slots, pages) and the step's tables, staged.
  const HostTensor rows = chain_tables::packed_rows(padded, chain_.model().config());
  const HostTensor seqs = chain_tables::attention_table(padded, &cache_, cache_.capacity(), &cache_.lengths_);
  const HostTensor table = cache_.block_table_of(padded.seqs, cols_), kv_map = cache_.write_rows_of(padded.seqs);
  if (table.shape()[1] != cols_) throw Error(OP, "cache", "a slot holds more pages than its capacity (cannot happen)");
  auto* st = static_cast<uint8_t*>(b.staging->data());
  std::memcpy(st + b.at.rows, rows.data(), rows.bytes());
  std::memcpy(st + b.at.kv_map, kv_map.data(), kv_map.bytes());
  std::memcpy(st + b.at.block_table, table.data(), table.bytes());
  auto* settings = reinterpret_cast<double*>(st + b.at.params);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(settings + i * P, params.data() + (i < B ? i : 0) * P, P * sizeof(double));
  if (fresh) {
    try {
      capture(b, padded);
    } catch (const Error& e) {  // nothing ran: the caller runs this step (and the later ones) eagerly
      capture_error_ = e.what();
      return std::nullopt;
    }
  }
  copy_async(chain_.backend(), b.inputs.view().data, st, size_t(b.at.bytes));
  b.graph->replay(static_cast<const int32_t*>(seqs.data()), n);
  copy_async(chain_.backend(), b.results->data(), b.outputs.view().data, b.outputs.bytes());
  device_stream_synchronize(chain_.backend(), chain_.ctx_.stream);
  for (const ChainSequence& s : batch.seqs) cache_.lengths_[size_t(s.slot)] = s.cached + s.len;
  const auto* res = static_cast<const uint8_t*>(b.results->data());
  Chain::RowDraws drawn =
      Chain::draws_of(B, reinterpret_cast<const int32_t*>(res), reinterpret_cast<const float*>(res + aligned(n * 4)),
                      reinterpret_cast<const float*>(res + 2 * aligned(n * 4)));
  if (fresh) buckets_.emplace(n, std::move(*fresh));
  return drawn;
}

}  // namespace samebits
