// linear (GEMM) entry points: validation, then the backend's kernel.
#include "ops/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits {
using namespace detail;

void linear_forward(const Context& ctx, const LinearForwardArgs& a) {
  auto v = begin_op<OpId::linear_forward>("linear_forward", ctx, a);
  check_float_input(v, "x", a.x, 2);
  check_float_input(v, "weight", a.weight, 2);
  v.same_dtype("weight", a.weight, "x", a.x);
  v.dim("weight", a.weight, 1, a.x.shape[1], "K, x's columns");
  v.optional("bias", a.bias, 1);
  if (a.bias.present()) {
    v.floating("bias", a.bias);
    v.dim("bias", a.bias, 0, a.weight.shape[0], "N, weight's rows");
    v.finite("bias", a.bias);
  }
  v.required("y", a.y, 2);
  v.floating("y", a.y);
  v.dim("y", a.y, 0, a.x.shape[0], "M, x's rows");
  v.dim("y", a.y, 1, a.weight.shape[0], "N, weight's rows");
  v.no_alias("y", a.y, "x", a.x);
  v.no_alias("y", a.y, "weight", a.weight);
  run_kernel<OpId::linear_forward>("linear_forward", ctx, a);
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
