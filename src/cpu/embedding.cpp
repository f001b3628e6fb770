// CPU embedding gather and gradient scatter. The scatter adds each token's gradient row into its
// vocab row in ascending token order (no atomics: columns are split across threads, never tokens).
#include "cpu/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits::cpu {
namespace {

// Id t of int32 or int64 ids (checked in range by the validator).
int64_t id_at(const TensorView& ids, int64_t t) {
  return ids.dtype == DType::i64 ? ids.as<const int64_t>()[t] : int64_t(ids.as<const int32_t>()[t]);
}

void embedding_forward(const Context& ctx, const EmbeddingForwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t T = a.ids.shape[0], H = a.table.shape[1];
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<Acc> row(static_cast<size_t>(H));
      load(a.table, id_at(a.ids, t) * H, H, row.data());
      store(a.y, t * H, H, row.data());
    }
  });
}

void embedding_backward(const Context& ctx, const EmbeddingBackwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t T = a.ids.shape[0], H = a.dy.shape[1];
    const auto dy = load_all<Acc>(a.dy);
    auto* dtable = a.dtable.as<Acc>();
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        if (row_active(a.row_mask, t)) dtable[id_at(a.ids, t) * H + h] += dy[t * H + h];
  });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(embedding_forward, Backend::cpu, EmbeddingForwardArgs, embedding_forward);
SAMEBITS_REGISTER_KERNEL(embedding_backward, Backend::cpu, EmbeddingBackwardArgs, embedding_backward);

}  // namespace samebits::cpu
