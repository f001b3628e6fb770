// RoPE entry points.
#include "ops/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits {
using namespace detail;

static void check_rope(const Validator& v, const RopeArgs& a, const char* in, const char* out) {
  check_float_input(v, in, a.x, 3);
  if (a.x.shape[2] % 2 != 0) v.fail(in, "head_dim must be even for rotate-half RoPE");
  v.required(out, a.y, 3);
  v.floating(out, a.y);
  v.same_shape(out, a.y, in, a.x);
  if (a.y.data != a.x.data) v.no_alias(out, a.y, in, a.x);  // exact aliasing (in place) is fine
  v.required("positions", a.positions, 1);
  v.dtype("positions", a.positions, DType::i32);
  v.dim("positions", a.positions, 0, a.x.shape[0], "one position per token");
  if (!(a.config.theta > 1.0)) v.fail("config.theta", "must be > 1");
  if (a.config.max_position < 1) v.fail("config.max_position", "must be >= 1");
  if (a.config.llama3_scaling &&
      !(a.config.factor > 0 && a.config.high_freq_factor > a.config.low_freq_factor &&
        a.config.low_freq_factor > 0 && a.config.original_max_position > 0))
    v.fail("config", "Llama-3 rope scaling needs factor > 0, 0 < low_freq_factor < "
                     "high_freq_factor and original_max_position > 0");
  v.int_range("positions", a.positions, 0, a.config.max_position);
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
