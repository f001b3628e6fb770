// Embedding entry points.
#include "ops/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits {
using namespace detail;

static void check_ids(const Validator& v, const TensorView& ids, int64_t vocab,
                      const TensorView& mask) {
  v.required("ids", ids, 1);
  if (ids.dtype != DType::i32 && ids.dtype != DType::i64)  // int64: torch's index type, read as it is
    v.fail("ids", std::string("expected dtype int32 or int64, got ") + dtype_name(ids.dtype));
  v.nonempty("ids", ids);
  v.int_range("ids", ids, 0, vocab, mask);
}

void embedding_forward(const Context& ctx, const EmbeddingForwardArgs& a) {
  auto v = begin_op<OpId::embedding_forward>("embedding_forward", ctx, a);
  check_float_input(v, "table", a.table, 2);
  check_ids(v, a.ids, a.table.shape[0], {});
  v.required("y", a.y, 2);
  v.floating("y", a.y);
  v.dim("y", a.y, 0, a.ids.shape[0], "one row per id");
  v.dim("y", a.y, 1, a.table.shape[1], "the table's hidden size");
  run_kernel<OpId::embedding_forward>("embedding_forward", ctx, a);
}

void embedding_backward(const Context& ctx, const EmbeddingBackwardArgs& a) {
  auto v = begin_op<OpId::embedding_backward>("embedding_backward", ctx, a);
  v.required("dtable", a.dtable, 2);
  v.accumulator("dtable", a.dtable);
  check_row_mask(v, a.row_mask, a.ids.present() ? a.ids.shape[0] : 0);
  check_ids(v, a.ids, a.dtable.shape[0], a.row_mask);
  check_float_input(v, "dy", a.dy, 2);
  v.dim("dy", a.dy, 0, a.ids.shape[0], "one row per id");
  v.dim("dy", a.dy, 1, a.dtable.shape[1], "the table's hidden size");
  run_kernel<OpId::embedding_backward>("embedding_backward", ctx, a);
}

}  // namespace samebits
