// RMSNorm (+ fused residual add) and QK-norm entry points.
#include "ops/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits {
using namespace detail;

static void check_eps(const Validator& v, double eps) {
  if (!(eps > 0.0)) v.fail("eps", "must be positive");
}

static void check_rstd(const Validator& v, const TensorView& rstd, const TensorView& x, int rank) {
  v.optional("rstd", rstd, rank);
  if (rstd.is_none()) return;
  v.accumulator("rstd", rstd);
  for (int d = 0; d < rank; ++d) v.dim("rstd", rstd, d, x.shape[d], "one per normalised row");
}

void rmsnorm_forward(const Context& ctx, const RmsNormForwardArgs& a) {
  auto v = begin_op<OpId::rmsnorm_forward>("rmsnorm_forward", ctx, a);
  check_eps(v, a.eps);
  check_float_input(v, "x", a.x, 2);
  if (a.residual.present()) {
    check_float_input(v, "residual", a.residual, 2);
    v.same_shape("residual", a.residual, "x", a.x);
  }
  check_float_input(v, "weight", a.weight, 1);
  v.dim("weight", a.weight, 0, a.x.shape[1], "hidden size");
  v.required("y", a.y, 2);
  v.floating("y", a.y);
  v.same_shape("y", a.y, "x", a.x);
  v.optional("residual_out", a.residual_out, 2);
  if (a.residual.present() != a.residual_out.present())
    v.fail("residual_out", "must be given exactly when residual is given (the fused add)");
  if (a.residual_out.present()) {
    v.floating("residual_out", a.residual_out);
    v.same_shape("residual_out", a.residual_out, "x", a.x);
    v.no_alias("y", a.y, "residual_out", a.residual_out);
  }
  check_rstd(v, a.rstd, a.x, 1);
  run_kernel<OpId::rmsnorm_forward>("rmsnorm_forward", ctx, a);
}

void rmsnorm_backward(const Context& ctx, const RmsNormBackwardArgs& a) {
  auto v = begin_op<OpId::rmsnorm_backward>("rmsnorm_backward", ctx, a);
  check_eps(v, a.eps);
  check_float_input(v, "dy", a.dy, 2);
  check_float_input(v, "x", a.x, 2);
  v.same_shape("x", a.x, "dy", a.dy);
  if (a.dresidual_out.present()) {
    check_float_input(v, "dresidual_out", a.dresidual_out, 2);
    v.same_shape("dresidual_out", a.dresidual_out, "dy", a.dy);
  }
  check_float_input(v, "weight", a.weight, 1);
  v.dim("weight", a.weight, 0, a.x.shape[1], "hidden size");
  check_rstd(v, a.rstd, a.x, 1);
  check_row_mask(v, a.row_mask, a.x.shape[0]);
  v.required("dx", a.dx, 2);
  v.floating("dx", a.dx);
  v.same_shape("dx", a.dx, "x", a.x);
  v.no_alias("dx", a.dx, "x", a.x);
  v.required("dweight", a.dweight, 1);
  v.accumulator("dweight", a.dweight);
  v.dim("dweight", a.dweight, 0, a.x.shape[1], "hidden size");
  run_kernel<OpId::rmsnorm_backward>("rmsnorm_backward", ctx, a);
}

void qk_norm_forward(const Context& ctx, const QkNormForwardArgs& a) {
  auto v = begin_op<OpId::qk_norm_forward>("qk_norm_forward", ctx, a);
  check_eps(v, a.eps);
  check_float_input(v, "x", a.x, 3);
  check_float_input(v, "weight", a.weight, 1);
  v.dim("weight", a.weight, 0, a.x.shape[2], "head_dim");
  v.required("y", a.y, 3);
  v.floating("y", a.y);
  v.same_shape("y", a.y, "x", a.x);
  check_rstd(v, a.rstd, a.x, 2);
  run_kernel<OpId::qk_norm_forward>("qk_norm_forward", ctx, a);
}

void qk_norm_backward(const Context& ctx, const QkNormBackwardArgs& a) {
  auto v = begin_op<OpId::qk_norm_backward>("qk_norm_backward", ctx, a);
  check_eps(v, a.eps);
  check_float_input(v, "dy", a.dy, 3);
  check_float_input(v, "x", a.x, 3);
  v.same_shape("x", a.x, "dy", a.dy);
  check_float_input(v, "weight", a.weight, 1);
  v.dim("weight", a.weight, 0, a.x.shape[2], "head_dim");
  check_rstd(v, a.rstd, a.x, 2);
  check_row_mask(v, a.row_mask, a.x.shape[0]);
  v.required("dx", a.dx, 3);
  v.floating("dx", a.dx);
  v.same_shape("dx", a.dx, "x", a.x);
  v.no_alias("dx", a.dx, "x", a.x);
  v.required("dweight", a.dweight, 1);
  v.accumulator("dweight", a.dweight);
  v.dim("dweight", a.dweight, 0, a.x.shape[2], "head_dim");
  run_kernel<OpId::qk_norm_backward>("qk_norm_backward", ctx, a);
}

}  // namespace samebits
