// RMSNorm (+ fused residual add) and QK-norm entry points.
#include <utility>

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

// The checks both norm backwards share; `rank` 2 for RMSNorm [T, H], 3 for QK-norm [T, heads, D].
static void check_norm_backward(const Validator& v, const TensorView& dy, const TensorView& x,
                                const TensorView& weight, const TensorView& rstd,
                                const TensorView& row_mask, const TensorView& dx,
                                const TensorView& dweight, const TensorView& segments, double eps, int rank) {
  const char* what = rank == 2 ? "hidden size" : "head_dim";
  check_eps(v, eps);
  check_float_input(v, "dy", dy, rank);
  check_float_input(v, "x", x, rank);
  v.same_shape("x", x, "dy", dy);
  check_float_input(v, "weight", weight, 1);
  v.dim("weight", weight, 0, x.shape[rank - 1], what);
  check_rstd(v, rstd, x, rank - 1);
  check_row_mask(v, row_mask, x.shape[0]);
  v.required("dx", dx, rank);
  v.floating("dx", dx);
  v.same_shape("dx", dx, "x", x);
  v.no_alias("dx", dx, "x", x);
  v.required("dweight", dweight, 1);
  v.accumulator("dweight", dweight);
  v.dim("dweight", dweight, 0, x.shape[rank - 1], what);
  check_segments(v, segments, x.shape[0]);
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
  check_norm_backward(v, a.dy, a.x, a.weight, a.rstd, a.row_mask, a.dx, a.dweight, a.segments, a.eps, 2);
  if (a.dresidual_out.present()) {
    check_float_input(v, "dresidual_out", a.dresidual_out, 2);
    v.same_shape("dresidual_out", a.dresidual_out, "dy", a.dy);
  }
  run_kernel<OpId::rmsnorm_backward>("rmsnorm_backward", ctx, a);
}

namespace {
// One QK-norm forward's tensors; `part` prefixes their names in a pair ("q." / "k.").
void check_qk_norm_part(const Validator& v, const TensorView& x, const TensorView& weight, const TensorView& y,
                        const TensorView& rstd, const std::string& part = "") {
  const std::string xn = part + "x", wn = part + "weight", yn = part + "y";
  check_float_input(v, xn.c_str(), x, 3);
  check_float_input(v, wn.c_str(), weight, 1);
  v.dim(wn.c_str(), weight, 0, x.shape[2], "head_dim");
  v.required(yn.c_str(), y, 3);
  v.floating(yn.c_str(), y);
  v.same_shape(yn.c_str(), y, xn.c_str(), x);
  check_rstd(v, rstd, x, 2);
}

// The pair's optional cache write: all of cache_rows, k_cache, v_cache and v, or none; the cache
// rows of k.y's row shape and dtype, v of k.x's shape, and no output over another tensor.
void check_cache_write(const Validator& v, const QkNormPairForwardArgs& a) {
  const std::pair<const char*, const TensorView*> parts[] = {
      {"cache_rows", &a.cache_rows}, {"k_cache", &a.k_cache}, {"v_cache", &a.v_cache}, {"v", &a.v}};
  int given = 0;
  for (const auto& [name, t] : parts) given += t->present() ? 1 : 0;
  if (given == 0) return;
  for (const auto& [name, t] : parts)
    if (!t->present())
      v.fail(name, "the cache write needs cache_rows, k_cache, v_cache and v together (or none of them)");
  const TensorView& ky = a.k.y;
  v.required("cache_rows", a.cache_rows, 1);
  v.dtype("cache_rows", a.cache_rows, DType::i32);
  v.dim("cache_rows", a.cache_rows, 0, ky.shape[0], "one cache row per token, k.x's T");
  check_float_input(v, "v", a.v, 3);
  v.same_shape("v", a.v, "k.y", ky);
  v.same_dtype("v", a.v, "k.y", ky);
  for (const auto& [name, cache] : {std::pair{"k_cache", &a.k_cache}, std::pair{"v_cache", &a.v_cache}}) {
    v.required(name, *cache, 3);
    v.same_dtype(name, *cache, "k.y", ky);
    v.dim(name, *cache, 1, ky.shape[1], "k heads, k.y's");
    v.dim(name, *cache, 2, ky.shape[2], "head_dim, k.y's");
  }
  v.same_shape("v_cache", a.v_cache, "k_cache", a.k_cache);
  // The writes: k_cache and v_cache over nothing the op reads or writes; q.y and k.y not over v.
  v.no_alias("k_cache", a.k_cache, "v_cache", a.v_cache);
  for (const auto& [name, cache] : {std::pair{"k_cache", &a.k_cache}, std::pair{"v_cache", &a.v_cache}})
    for (const auto& [other, t] : {std::pair{"q.x", &a.q.x}, std::pair{"k.x", &a.k.x}, std::pair{"q.y", &a.q.y},
                                   std::pair{"k.y", &a.k.y}, std::pair{"v", &a.v}, std::pair{"cache_rows", &a.cache_rows},
                                   std::pair{"positions", &a.positions}, std::pair{"q.rstd", &a.q.rstd},
                                   std::pair{"k.rstd", &a.k.rstd}})
      v.no_alias(name, *cache, other, *t);
  v.no_alias("q.y", a.q.y, "v", a.v);
  v.no_alias("k.y", a.k.y, "v", a.v);
  v.int_range("cache_rows", a.cache_rows, -1, a.k_cache.shape[0]);
}
}  // namespace

void qk_norm_forward(const Context& ctx, const QkNormForwardArgs& a) {
  auto v = begin_op<OpId::qk_norm_forward>("qk_norm_forward", ctx, a);
  check_eps(v, a.eps);
  check_qk_norm_part(v, a.x, a.weight, a.y, a.rstd);
  if (a.positions.present()) check_rope_positions(v, a.positions, a.rope, a.x.shape[0], a.x.shape[2], "x");
  run_kernel<OpId::qk_norm_forward>("qk_norm_forward", ctx, a);
}

void qk_norm_pair_forward(const Context& ctx, const QkNormPairForwardArgs& a) {
  auto v = begin_op<OpId::qk_norm_pair_forward>("qk_norm_pair_forward", ctx, a);
  check_eps(v, a.eps);
  check_qk_norm_part(v, a.q.x, a.q.weight, a.q.y, a.q.rstd, "q.");
  check_qk_norm_part(v, a.k.x, a.k.weight, a.k.y, a.k.rstd, "k.");
  v.dim("k.x", a.k.x, 0, a.q.x.shape[0], "T, q.x's tokens");
  v.dim("k.x", a.k.x, 2, a.q.x.shape[2], "head_dim, q.x's");
  v.no_alias("q.y", a.q.y, "k.x", a.k.x);
  v.no_alias("q.y", a.q.y, "k.y", a.k.y);
  v.no_alias("k.y", a.k.y, "q.x", a.q.x);
  if (a.q.rstd.present() && a.k.rstd.present()) v.no_alias("q.rstd", a.q.rstd, "k.rstd", a.k.rstd);
  if (a.positions.present()) check_rope_positions(v, a.positions, a.rope, a.q.x.shape[0], a.q.x.shape[2], "q.x");
  check_cache_write(v, a);
  run_kernel<OpId::qk_norm_pair_forward>("qk_norm_pair_forward", ctx, a);
}

void qk_norm_backward(const Context& ctx, const QkNormBackwardArgs& a) {
  auto v = begin_op<OpId::qk_norm_backward>("qk_norm_backward", ctx, a);
  check_norm_backward(v, a.dy, a.x, a.weight, a.rstd, a.row_mask, a.dx, a.dweight, a.segments, a.eps, 3);
  if (a.positions.present()) check_rope_positions(v, a.positions, a.rope, a.x.shape[0], a.x.shape[2], "x");
  run_kernel<OpId::qk_norm_backward>("qk_norm_backward", ctx, a);
}

}  // namespace samebits
