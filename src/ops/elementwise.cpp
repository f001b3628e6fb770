// SwiGLU and residual-add entry points.
#include "ops/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits {
using namespace detail;

static void check_like(const Validator& v, const char* name, const TensorView& t, const char* ref,
                       const TensorView& r, bool input) {
  if (input) {
    check_float_input(v, name, t, 2);
  } else {
    v.required(name, t, 2);
    v.floating(name, t);
  }
  v.same_shape(name, t, ref, r);
}

void swiglu_forward(const Context& ctx, const SwiGluForwardArgs& a) {
  auto v = begin_op<OpId::swiglu_forward>("swiglu_forward", ctx, a);
  check_float_input(v, "gate", a.gate, 2);
  check_like(v, "up", a.up, "gate", a.gate, true);
  check_like(v, "y", a.y, "gate", a.gate, false);
  run_kernel<OpId::swiglu_forward>("swiglu_forward", ctx, a);
}

void swiglu_backward(const Context& ctx, const SwiGluBackwardArgs& a) {
  auto v = begin_op<OpId::swiglu_backward>("swiglu_backward", ctx, a);
  check_float_input(v, "dy", a.dy, 2);
  check_like(v, "gate", a.gate, "dy", a.dy, true);
  check_like(v, "up", a.up, "dy", a.dy, true);
  check_like(v, "dgate", a.dgate, "dy", a.dy, false);
  check_like(v, "dup", a.dup, "dy", a.dy, false);
  v.no_alias("dgate", a.dgate, "dup", a.dup);
  v.no_alias("dgate", a.dgate, "gate", a.gate);
  v.no_alias("dgate", a.dgate, "up", a.up);
  v.no_alias("dup", a.dup, "gate", a.gate);
  v.no_alias("dup", a.dup, "up", a.up);
  run_kernel<OpId::swiglu_backward>("swiglu_backward", ctx, a);
}

void residual_add_forward(const Context& ctx, const ResidualAddArgs& a) {
  auto v = begin_op<OpId::residual_add_forward>("residual_add_forward", ctx, a);
  check_float_input(v, "a", a.a, 2);
  check_like(v, "b", a.b, "a", a.a, true);
  check_like(v, "y", a.y, "a", a.a, false);
  run_kernel<OpId::residual_add_forward>("residual_add_forward", ctx, a);
}

void residual_add_backward(const Context& ctx, const ResidualAddBackwardArgs& a) {
  auto v = begin_op<OpId::residual_add_backward>("residual_add_backward", ctx, a);
  check_float_input(v, "dy", a.dy, 2);
  if (a.da.is_none() && a.db.is_none()) v.fail("da", "at least one of da, db must be given");
  if (a.da.present()) check_like(v, "da", a.da, "dy", a.dy, false);
  if (a.db.present()) check_like(v, "db", a.db, "dy", a.dy, false);
  v.no_alias("da", a.da, "db", a.db);
  run_kernel<OpId::residual_add_backward>("residual_add_backward", ctx, a);
}

}  // namespace samebits
