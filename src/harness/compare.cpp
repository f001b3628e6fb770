#include "harness/compare.hpp"

#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

namespace samebits::harness {

std::string index_text(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  return fmt::format("[{}]", fmt::join(idx, ", "));
}

static void note_difference(const HostTensor& a, const HostTensor& b, int64_t i, Drift& d) {
  const double x = a.get(i), y = b.get(i);
  if (d.count++ == 0) {
    d.first_index = i;
    d.first_index_text = index_text(a.shape(), i);
    d.first_a = x;
    d.first_b = y;
  }
  const double diff = std::fabs(x - y);
  if (std::isnan(diff)) {
    d.max_abs = std::numeric_limits<double>::infinity();
  } else {
    d.max_abs = std::max(d.max_abs, diff);
    if (y != 0) d.max_rel = std::max(d.max_rel, diff / std::fabs(y));
  }
  d.max_ulp = std::max(d.max_ulp, ulp_distance(x, y, a.dtype()));
}

bool same_bits(const HostTensor& a, const HostTensor& b, Drift& d) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    d.count = 1;
    d.first_index_text = fmt::format("shape/dtype differ: {} [{}] vs {} [{}]", dtype_name(a.dtype()),
                                     fmt::join(a.shape(), ","), dtype_name(b.dtype()),
                                     fmt::join(b.shape(), ","));
    return false;
  }
  if (std::memcmp(a.data(), b.data(), a.bytes()) == 0) return true;
  const int esz = dtype_size(a.dtype());
  const auto* pa = static_cast<const uint8_t*>(a.data());
  const auto* pb = static_cast<const uint8_t*>(b.data());
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(pa + i * esz, pb + i * esz, size_t(esz)) != 0) note_difference(a, b, i, d);
  return false;
}

bool within_tolerance(const HostTensor& a, const HostTensor& t, Tolerance tol, Drift& d) {
  if (a.shape() != t.shape()) {
    d.count = 1;
    d.first_index_text = "shapes differ";
    d.worst_ratio = std::numeric_limits<double>::infinity();
    return false;
  }
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i), y = t.get(i);
    const double diff = std::fabs(x - y);
    const double allowed = tol.atol + tol.rtol * std::fabs(y);
    const double ratio = std::isnan(diff) ? std::numeric_limits<double>::infinity()
                         : allowed > 0   ? diff / allowed
                         : (diff > 0 ? std::numeric_limits<double>::infinity() : 0.0);
    d.worst_ratio = std::max(d.worst_ratio, ratio);
    if (!std::isnan(diff)) {
      d.max_abs = std::max(d.max_abs, diff);
      if (y != 0) d.max_rel = std::max(d.max_rel, diff / std::fabs(y));
    } else {
      d.max_abs = std::numeric_limits<double>::infinity();
    }
    if (a.dtype() != DType::f64) d.max_ulp = std::max(d.max_ulp, ulp_distance(x, y, a.dtype()));
    if (ratio > 1.0 && d.count++ == 0) {
      d.first_index = i;
      d.first_index_text = index_text(a.shape(), i);
      d.first_a = x;
      d.first_b = y;
    }
  }
  return d.count == 0;
}

std::string Drift::message() const {
  if (check == "guard" || check == "error") return fmt::format("{} {}: {}", op, tensor, first_index_text);
  return fmt::format(
      "{} [{}] tensor '{}': {} element(s) differ, first at {} ({} vs {}); max abs {:.3g}, max rel "
      "{:.3g}, max ulp {}{}",
      op, check, tensor, count, first_index_text, first_a, first_b, max_abs, max_rel, max_ulp,
      worst_ratio > 0 ? fmt::format(", worst err/tol {:.3g}", worst_ratio) : "");
}

}  // namespace samebits::harness
