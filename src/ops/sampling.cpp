// Sampling entry point: shapes and dtypes here; the values (logits, settings) are checked per row
// by the kernels, which report a bad row in its token (they may live on the device).
#include <cstdint>

#include "ops/common.hpp"
#include "ops/registry.hpp"
#include "ops/sampling_rule.hpp"
#include "samebits/ops.hpp"

namespace samebits {
using namespace detail;

void sample_tokens(const Context& ctx, const SampleTokensArgs& a) {
  auto v = begin_op<OpId::sample_tokens>("sample_tokens", ctx, a);
  v.required("logits", a.logits, 2);
  v.dtype("logits", a.logits, DType::f32);
  v.nonempty("logits", a.logits);
  if (a.logits.shape[1] > INT32_MAX - sampling_rule::LANES)  // the kernels index ids in 32 bits
    v.fail("logits", "a vocab of more than 2^31 - 1025 ids");
  if (a.logits.shape[0] > INT32_MAX) v.fail("logits", "more than 2^31 - 1 rows in one call");
  const int64_t R = a.logits.shape[0], V = a.logits.shape[1];
  v.required("params", a.params, 2);
  v.dtype("params", a.params, DType::f64);
  v.dim("params", a.params, 0, R, "one row of settings per logits row");
  v.dim("params", a.params, 1, sampling_rule::PARAMS, "{temperature, top_k, top_p, min_p, u}");
  v.required("tokens", a.tokens, 1);
  v.dtype("tokens", a.tokens, DType::i32);
  v.dim("tokens", a.tokens, 0, R, "one token per logits row");
  v.optional("kept", a.kept, 2);
  if (a.kept.present()) {
    v.dtype("kept", a.kept, DType::u8);
    v.dim("kept", a.kept, 0, R, "one row per logits row");
    v.dim("kept", a.kept, 1, V, "one entry per id");
  }
  v.optional("weights", a.weights, 2);
  if (a.weights.present()) {
    v.dtype("weights", a.weights, DType::f32);
    v.dim("weights", a.weights, 0, R, "one row per logits row");
    v.dim("weights", a.weights, 1, 2, "{the drawn token's weight, the kept total}");
  }
  run_kernel<OpId::sample_tokens>("sample_tokens", ctx, a);
}

}  // namespace samebits
