// RoPE entry points.
#include "ops/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits {
using namespace detail;

void detail::check_rope_positions(const Validator& v, const TensorView& positions,
                                  const RopeConfig& config, int64_t tokens, int64_t head_dim, const char* in) {
  if (head_dim % 2 != 0) v.fail(in, "head_dim must be even for rotate-half RoPE");
  v.required("positions", positions, 1);
  v.dtype("positions", positions, DType::i32);
  v.dim("positions", positions, 0, tokens, "one position per token");
  if (!(config.theta > 1.0)) v.fail("config.theta", "must be > 1");
  if (config.max_position < 1) v.fail("config.max_position", "must be >= 1");
  if (config.llama3_scaling &&
      !(config.factor > 0 && config.high_freq_factor > config.low_freq_factor &&
        config.low_freq_factor > 0 && config.original_max_position > 0))
    v.fail("config", "Llama-3 rope scaling needs factor > 0, 0 < low_freq_factor < "
                     "high_freq_factor and original_max_position > 0");
  v.int_range("positions", positions, 0, config.max_position);
}

static void check_rope(const Validator& v, const RopeArgs& a, const char* in, const char* out) {
  check_float_input(v, in, a.x, 3);
  v.required(out, a.y, 3);
  v.floating(out, a.y);
  v.same_shape(out, a.y, in, a.x);
  if (a.y.data != a.x.data) v.no_alias(out, a.y, in, a.x);  // exact aliasing (in place) is fine
  check_rope_positions(v, a.positions, a.config, a.x.shape[0], a.x.shape[2], in);
}

void rope_forward(const Context& ctx, const RopeArgs& a) {
  auto v = begin_op<OpId::rope_forward>("rope_forward", ctx, a);
  check_rope(v, a, "x", "y");
  run_kernel<OpId::rope_forward>("rope_forward", ctx, a);
}

void rope_backward(const Context& ctx, const RopeArgs& a) {
  auto v = begin_op<OpId::rope_backward>("rope_backward", ctx, a);
  check_rope(v, a, "dy (x)", "dx (y)");
  run_kernel<OpId::rope_backward>("rope_backward", ctx, a);
}

}  // namespace samebits
