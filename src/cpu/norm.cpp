// CPU RMSNorm (+ fused residual add) and QK-norm, forward and backward.
// Per row: ms = dot_fixed(x, x)/H; rstd = 1/sqrt(ms + eps); y = x·rstd·w, rounded once.
// dweight sums over rows strictly in ascending order from its existing value.
#include <cstring>

#include "cpu/common.hpp"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"

namespace samebits::cpu {
namespace {

template <class Acc>
Acc rstd_of(const Acc* x, int64_t h, double eps) {
  const Acc ms = dot_fixed(x, x, h) / Acc(h);
  return Acc(1) / std::sqrt(ms + Acc(eps));
}

// Normalises `rows` rows of length h. in: x (already summed with the residual when fused).
template <class Acc>
void norm_rows(const std::vector<Acc>& x, int64_t rows, int64_t h, const std::vector<Acc>& w,
               double eps, const TensorView& y, const TensorView& rstd_out) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const Acc* xr = &x[r * h];
    const Acc rstd = rstd_of(xr, h, eps);
    std::vector<Acc> out(static_cast<size_t>(h));
    for (int64_t i = 0; i < h; ++i) out[i] = xr[i] * rstd * w[i];
    store(y, r * h, h, out.data());
    if (rstd_out.present()) rstd_out.as<Acc>()[r] = rstd;
  }
}

// dx = rstd·(g − x̂·mean(g·x̂)) with g = dy·w; dweight += dy·x̂ (rows ascending, masked skipped).
// `mask_div`: row r belongs to token r / mask_div (QK-norm has `heads` rows per token).
template <class Acc>
void norm_backward_rows(const std::vector<Acc>& x, const std::vector<Acc>& dy,
                        const std::vector<Acc>* dres, int64_t rows, int64_t h,
                        const std::vector<Acc>& w, double eps, const TensorView& rstd_in,
                        const TensorView& mask, int64_t mask_div, const TensorView& dx,
                        const TensorView& dweight) {
  std::vector<Acc> xhat(x.size());
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const Acc* xr = &x[r * h];
    const Acc rstd = rstd_in.present() ? rstd_in.as<const Acc>()[r] : rstd_of(xr, h, eps);
    std::vector<Acc> g(static_cast<size_t>(h)), out(static_cast<size_t>(h));
    for (int64_t i = 0; i < h; ++i) {
      xhat[r * h + i] = xr[i] * rstd;
      g[i] = dy[r * h + i] * w[i];
    }
    const Acc mean_gx = dot_fixed(g.data(), &xhat[r * h], h) / Acc(h);
    for (int64_t i = 0; i < h; ++i) {
      out[i] = rstd * (g[i] - xhat[r * h + i] * mean_gx);
      if (dres) out[i] += (*dres)[r * h + i];
    }
    store(dx, r * h, h, out.data());
  }
  auto* dw = dweight.as<Acc>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < h; ++i)
    for (int64_t r = 0; r < rows; ++r)
      if (row_active(mask, r / mask_div)) dw[i] += dy[r * h + i] * xhat[r * h + i];
}

void rmsnorm_forward(const Context& ctx, const RmsNormForwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t T = a.x.shape[0], H = a.x.shape[1];
    auto x = load_all<Acc>(a.x);
    if (a.residual.present()) {
      // s = x + residual rounded to residual_out's dtype; the norm reads the rounded s, exactly
      // what an unfused residual_add_forward followed by rmsnorm_forward would read.
      const auto res = load_all<Acc>(a.residual);
      for (size_t i = 0; i < x.size(); ++i) x[i] += res[i];
      store(a.residual_out, 0, T * H, x.data());
      load(a.residual_out, 0, T * H, x.data());
    }
    norm_rows(x, T, H, load_all<Acc>(a.weight), a.eps, a.y, a.rstd);
  });
}

void rmsnorm_backward(const Context& ctx, const RmsNormBackwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t T = a.x.shape[0], H = a.x.shape[1];
    std::vector<Acc> dres;
    if (a.dresidual_out.present()) dres = load_all<Acc>(a.dresidual_out);
    norm_backward_rows(load_all<Acc>(a.x), load_all<Acc>(a.dy), dres.empty() ? nullptr : &dres, T,
                       H, load_all<Acc>(a.weight), a.eps, a.rstd, a.row_mask, 1, a.dx, a.dweight);
  });
}

void qk_norm_forward(const Context& ctx, const QkNormForwardArgs& a) {
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t rows = a.x.shape[0] * a.x.shape[1], D = a.x.shape[2];
    norm_rows(load_all<Acc>(a.x), rows, D, load_all<Acc>(a.weight), a.eps, a.y, a.rstd);
  });
  // Fused RoPE: the definition itself (the normed rows stored in y's dtype, rotated in place).
  if (a.positions.present()) samebits::rope_forward(ctx, {a.y, a.positions, a.y, a.rope});
}

void qk_norm_backward(const Context& ctx, const QkNormBackwardArgs& a) {
  // Fused RoPE: dy rotated back at the arithmetic's precision (kept, not rounded to a storage
  // dtype), then the norm's backward on it.
  std::vector<unsigned char> rotated_bytes;
  TensorView dy = a.dy;
  if (a.positions.present()) {
    const DType acc = ctx.precision == Precision::truth_fp64 ? DType::f64 : DType::f32;
    rotated_bytes.resize(size_t(a.dy.numel() * dtype_size(acc)));
    dy = TensorView::of(rotated_bytes.data(), acc, a.dy.shape.data(), 3);
    samebits::rope_backward(ctx, {a.dy, a.positions, dy, a.rope});
  }
  with_precision(ctx, [&](auto acc) {
    using Acc = decltype(acc);
    const int64_t heads = a.x.shape[1], rows = a.x.shape[0] * heads, D = a.x.shape[2];
    norm_backward_rows<Acc>(load_all<Acc>(a.x), load_all<Acc>(dy), nullptr, rows, D,
                       load_all<Acc>(a.weight), a.eps, a.rstd, a.row_mask, heads, a.dx, a.dweight);
  });
}

// The CPU runs q, then k, each through this file's kernel (the parentheses keep ADL from the public op),
// then the cache write: each token's k.y row (the bits just stored) and v row to its cache row.
void qk_norm_pair_forward(const Context& ctx, const QkNormPairForwardArgs& a) {
  for (const QkNormPart* part : {&a.q, &a.k})
    (qk_norm_forward)(ctx, QkNormForwardArgs{part->x, part->weight, part->y, part->rstd, a.eps, a.positions, a.rope});
  if (!a.cache_rows.present()) return;
  const int64_t T = a.k.y.shape[0];
  const size_t row_bytes = size_t(a.k.y.shape[1] * a.k.y.shape[2] * dtype_size(a.k.y.dtype));
  const auto* rows = a.cache_rows.as<const int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    if (rows[t] < 0) continue;  // a padding row: no cache row
    std::memcpy(static_cast<char*>(a.k_cache.data) + size_t(rows[t]) * row_bytes,
                static_cast<const char*>(a.k.y.data) + size_t(t) * row_bytes, row_bytes);
    std::memcpy(static_cast<char*>(a.v_cache.data) + size_t(rows[t]) * row_bytes,
                static_cast<const char*>(a.v.data) + size_t(t) * row_bytes, row_bytes);
  }
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(rmsnorm_forward, Backend::cpu, RmsNormForwardArgs, rmsnorm_forward);
SAMEBITS_REGISTER_KERNEL(rmsnorm_backward, Backend::cpu, RmsNormBackwardArgs, rmsnorm_backward);
SAMEBITS_REGISTER_KERNEL(qk_norm_forward, Backend::cpu, QkNormForwardArgs, qk_norm_forward);
SAMEBITS_REGISTER_KERNEL(qk_norm_pair_forward, Backend::cpu, QkNormPairForwardArgs, qk_norm_pair_forward);
SAMEBITS_REGISTER_KERNEL(qk_norm_backward, Backend::cpu, QkNormBackwardArgs, qk_norm_backward);

}  // namespace samebits::cpu
