// linear (GEMM) entry points: validation, then the backend's kernel.
#include "ops/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits {
using namespace detail;

namespace {
// The checks of a weight w [N, K] against x [M, K].
void check_weight(const Validator& v, const TensorView& x, const TensorView& weight, const std::string& w_name) {
  check_float_input(v, w_name.c_str(), weight, 2);
  v.same_dtype(w_name.c_str(), weight, "x", x);
  v.dim(w_name.c_str(), weight, 1, x.shape[1], "K, x's columns");
}

// The checks of one y = x·wᵀ (+ bias); `part` prefixes the argument names of a group's part.
void check_linear_forward(const Validator& v, const TensorView& x, const TensorView& weight, const TensorView& bias,
                          const TensorView& y, const std::string& part = "") {
  const std::string w_name = part + "weight", b_name = part + "bias", y_name = part + "y";
  check_weight(v, x, weight, w_name);
  v.optional(b_name.c_str(), bias, 1);
  if (bias.present()) {
    v.floating(b_name.c_str(), bias);
    v.dim(b_name.c_str(), bias, 0, weight.shape[0], "N, weight's rows");
    v.finite(b_name.c_str(), bias);
  }
  v.required(y_name.c_str(), y, 2);
  v.floating(y_name.c_str(), y);
  v.dim(y_name.c_str(), y, 0, x.shape[0], "M, x's rows");
  v.dim(y_name.c_str(), y, 1, weight.shape[0], "N, weight's rows");
  v.no_alias(y_name.c_str(), y, "x", x);
  v.no_alias(y_name.c_str(), y, w_name.c_str(), weight);
  if (bias.present()) v.no_alias(y_name.c_str(), y, b_name.c_str(), bias);
}
}  // namespace

void linear_forward(const Context& ctx, const LinearForwardArgs& a) {
  auto v = begin_op<OpId::linear_forward>("linear_forward", ctx, a);
  check_float_input(v, "x", a.x, 2);
  check_linear_forward(v, a.x, a.weight, a.bias, a.y);
  run_kernel<OpId::linear_forward>("linear_forward", ctx, a);
}

void linear_group_forward(const Context& ctx, const LinearGroupForwardArgs& a) {
  auto v = begin_op<OpId::linear_group_forward>("linear_group_forward", ctx, a);
  if (a.count < 1 || a.count > 3) v.fail("count", "a group has 1 to 3 parts, got " + std::to_string(a.count));
  check_float_input(v, "x", a.x, 2);
  if (a.swiglu.present()) {  // gate and up in, silu(gate)·up out: the parts have no y of their own
    if (a.count != 2) v.fail("count", "a group with a swiglu output has two parts (gate, up), got " + std::to_string(a.count));
    for (int i = 0; i < 2; ++i) {
      const LinearPart& p = a.parts[i];
      const std::string name = "parts[" + std::to_string(i) + "].";
      if (p.y.present()) v.fail((name + "y").c_str(), "must be absent: with a swiglu output only silu(gate)·up goes out");
      if (p.bias.present()) v.fail((name + "bias").c_str(), "must be absent with a swiglu output");
      check_weight(v, a.x, p.weight, name + "weight");
      v.no_alias("swiglu", a.swiglu, (name + "weight").c_str(), p.weight);
    }
    v.dim("parts[1].weight", a.parts[1].weight, 0, a.parts[0].weight.shape[0], "N, gate's rows");
    v.required("swiglu", a.swiglu, 2);
    v.same_dtype("swiglu", a.swiglu, "x", a.x);
    v.dim("swiglu", a.swiglu, 0, a.x.shape[0], "M, x's rows");
    v.dim("swiglu", a.swiglu, 1, a.parts[0].weight.shape[0], "N, gate's rows");
    v.no_alias("swiglu", a.swiglu, "x", a.x);
    run_kernel<OpId::linear_group_forward>("linear_group_forward", ctx, a);
    return;
  }
  for (int i = 0; i < a.count; ++i) {
    const LinearPart& p = a.parts[i];
    const std::string name = "parts[" + std::to_string(i) + "].";
    check_linear_forward(v, a.x, p.weight, p.bias, p.y, name);
    for (int j = 0; j < a.count; ++j) {
      const std::string other = "parts[" + std::to_string(j) + "].";
      if (j != i) v.no_alias((name + "y").c_str(), p.y, (other + "weight").c_str(), a.parts[j].weight);
      if (j != i && a.parts[j].bias.present())
        v.no_alias((name + "y").c_str(), p.y, (other + "bias").c_str(), a.parts[j].bias);
      if (j < i) v.no_alias((name + "y").c_str(), p.y, (other + "y").c_str(), a.parts[j].y);
    }
  }
  run_kernel<OpId::linear_group_forward>("linear_group_forward", ctx, a);
}

void linear_backward_input(const Context& ctx, const LinearBackwardInputArgs& a) {
  auto v = begin_op<OpId::linear_backward_input>("linear_backward_input", ctx, a);
  check_float_input(v, "dy", a.dy, 2);
  check_float_input(v, "weight", a.weight, 2);
  v.dim("weight", a.weight, 0, a.dy.shape[1], "N, dy's columns");
  v.required("dx", a.dx, 2);
  v.floating("dx", a.dx);
  v.dim("dx", a.dx, 0, a.dy.shape[0], "M, dy's rows");
  v.dim("dx", a.dx, 1, a.weight.shape[1], "K, weight's columns");
  v.no_alias("dx", a.dx, "dy", a.dy);
  v.no_alias("dx", a.dx, "weight", a.weight);
  run_kernel<OpId::linear_backward_input>("linear_backward_input", ctx, a);
}

void linear_backward_weight(const Context& ctx, const LinearBackwardWeightArgs& a) {
  auto v = begin_op<OpId::linear_backward_weight>("linear_backward_weight", ctx, a);
  check_float_input(v, "dy", a.dy, 2);
  check_float_input(v, "x", a.x, 2);
  v.dim("x", a.x, 0, a.dy.shape[0], "M, dy's rows");
  check_row_mask(v, a.row_mask, a.dy.shape[0]);
  v.required("dweight", a.dweight, 2);
  v.accumulator("dweight", a.dweight);
  v.dim("dweight", a.dweight, 0, a.dy.shape[1], "N, dy's columns");
  v.dim("dweight", a.dweight, 1, a.x.shape[1], "K, x's columns");
  v.optional("dbias", a.dbias, 1);
  if (a.dbias.present()) {
    v.accumulator("dbias", a.dbias);
    v.dim("dbias", a.dbias, 0, a.dy.shape[1], "N, dy's columns");
  }
  check_segments(v, a.segments, a.dy.shape[0]);
  run_kernel<OpId::linear_backward_weight>("linear_backward_weight", ctx, a);
}

}  // namespace samebits
