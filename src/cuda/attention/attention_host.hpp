// Host-side pieces every CUDA attention entry point shares: the shapes and alignment the kernels
// take, the dtype × head_dim dispatch, and the walk over rows no sequence covers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "samebits/error.hpp"
#include "samebits/tensor.hpp"

namespace samebits::cuda::attention {

// bf16 / fp16 q with head_dim 64 or 128, and every named tensor 16-byte aligned; else Unsupported
// naming the argument.
inline void require_kernel_shapes(const char* op, const TensorView& q,
                                  std::initializer_list<std::pair<const char*, const TensorView*>> tensors) {
  if (q.dtype != DType::bf16 && q.dtype != DType::f16)
    throw Unsupported(op, "q", "the CUDA attention takes bf16 or fp16 (fp32 runs on the CPU backend)");
  if (q.shape[2] != 64 && q.shape[2] != 128)
    throw Unsupported(op, "q", "the CUDA attention supports head_dim 64 and 128");
  for (const auto& [name, t] : tensors)
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0)
      throw Unsupported(op, name, "the CUDA attention needs its tensors 16-byte aligned");
}

// fn(T{}, std::integral_constant<int, D>{}) for q's 16-bit type and head_dim (checked above).
template <class Fn>
void dispatch_type_and_head_dim(DType dtype, int64_t head_dim, Fn&& fn) {
  auto with_d = [&](auto t) {
    if (head_dim == 64) fn(t, std::integral_constant<int, 64>{});
    else fn(t, std::integral_constant<int, 128>{});
  };
  if (dtype == DType::bf16) with_d(__nv_bfloat16{});
  else with_d(__half{});
}

// fn(begin, end) for each run of rows in [0, rows) that none of `ranges` covers, in order.
template <class Fn>
void for_each_uncovered(std::vector<std::pair<int64_t, int64_t>> ranges, int64_t rows, Fn&& fn) {
  std::sort(ranges.begin(), ranges.end());
  int64_t next = 0;
  for (auto [b, e] : ranges) {
    if (b > next) fn(next, b);
    next = std::max(next, e);
  }
  if (rows > next) fn(next, rows);
}

}  // namespace samebits::cuda::attention
