// Building blocks of the CPU reference backend.
//
// Every kernel is written once as a template over its arithmetic type Acc:
//   Acc = float  -> the fixed-order fp32 backend (batch-invariant; what users and CI run),
//   Acc = double -> the fp64 truth mode (the accuracy ground truth).
// Operands are converted to Acc once, computed on, then rounded (RNE) to each output's dtype.
//
// Reduction order. A reduction over n terms always uses reduce_fixed's shape: 8 interleaved
// lanes (term i goes to lane i % 8, in ascending i), then the fixed tree
// ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7)). It depends on n only, vectorises, and is the same for
// every row, batch and thread count. Sums over TOKENS (weight gradients) are instead strictly
// sequential in ascending token order, starting from the accumulator's existing value, so that
// micro-batches chain bitwise (design rule 6). OpenMP only splits independent outputs.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "samebits/context.hpp"
#include "samebits/dtype.hpp"
#include "samebits/tensor.hpp"

namespace samebits::cpu {

constexpr int kLanes = 8;

template <class Acc>
inline Acc combine_lanes(const Acc (&l)[kLanes]) {
  return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
}

// Σ a[i]·b[i] in the fixed lane order.
template <class Acc>
inline Acc dot_fixed(const Acc* a, const Acc* b, int64_t n) {
  Acc lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += a[i + l] * b[i + l];
  for (int l = 0; i + l < n; ++l) lane[l] += a[i + l] * b[i + l];
  return combine_lanes(lane);
}

// Σ a[i] in the same fixed lane order.
template <class Acc>
inline Acc sum_fixed(const Acc* a, int64_t n) {
  Acc lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += a[i + l];
  for (int l = 0; i + l < n; ++l) lane[l] += a[i + l];
  return combine_lanes(lane);
}

// Converts n elements starting at flat index `first` of a contiguous view to Acc.
template <class Acc>
void load(const TensorView& t, int64_t first, int64_t n, Acc* out);
// Rounds n Acc values to the view's dtype (RNE) and stores them at flat index `first`.
template <class Acc>
void store(const TensorView& t, int64_t first, int64_t n, const Acc* in);

template <class Acc>
std::vector<Acc> load_all(const TensorView& t) {
  std::vector<Acc> v(size_t(t.numel()));
  load(t, 0, t.numel(), v.data());
  return v;
}

// The transpose of a [rows, cols] matrix held in a vector.
template <class Acc>
std::vector<Acc> transposed(const std::vector<Acc>& m, int64_t rows, int64_t cols) {
  std::vector<Acc> t(m.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = m[size_t(r * cols + c)];
  return t;
}

inline bool row_active(const TensorView& mask, int64_t row) {
  return mask.is_none() || mask.as<const uint8_t>()[row] != 0;
}


// exp / log / sqrt in the backend's precision.
inline float exp_acc(float x) { return std::exp(x); }
inline double exp_acc(double x) { return std::exp(x); }
inline float log_acc(float x) { return std::log(x); }
inline double log_acc(double x) { return std::log(x); }

// Runs fn(Acc{}) with Acc = float in fixed_fp32 mode and double in truth_fp64 mode.
template <class Fn>
void with_precision(const Context& ctx, Fn&& fn) {
  if (ctx.precision == Precision::truth_fp64) fn(double{});
  else fn(float{});
}

}  // namespace samebits::cpu
