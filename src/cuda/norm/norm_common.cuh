// Shared by the CUDA RMSNorm and QK-norm kernels (rmsnorm.cu, qk_norm.cu): launch helpers.
#pragma once
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/common/runtime.cuh"
#include "cuda/common/vec8.cuh"
#include "ops/tuning.hpp"
#include "samebits/tensor.hpp"

namespace samebits::cuda::norm {

constexpr unsigned FULL = 0xffffffffu;
constexpr int MAX_THREADS = 512;  // so that a thread may hold 128 registers

// 1 / sqrt(mean of the squares + eps), each step correctly rounded: RMSNorm's and QK-norm's rstd.
__device__ __forceinline__ float rstd_of(float sum_sq, int64_t H, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, float(H)), eps)));
}

inline bool is_bf16(const TensorView& t) { return !t.present() || t.dtype == DType::bf16; }

// f(Fmt, VPT) as a type and a compile-time constant: AllBf16 where every row tensor of the call is
// bf16 (unless the test hook forces the run-time-dtype path), else AnyDtype.
template <class F>
void with_shape(int vpt, bool all_bf16, F&& f) {
  auto with_vpt = [&](auto fmt) {
    if (vpt == 1) f(fmt, std::integral_constant<int, 1>{});
    else f(fmt, std::integral_constant<int, 2>{});
  };
  if (all_bf16 && !detail::norm_any_dtype_path_override()) with_vpt(AllBf16{});
  else with_vpt(AnyDtype{});
}

// CTAs of `threads` threads of `kernel` that fit an SM at once (for grid-stride kernels sized to
// the device), cached per device in `cache`.
template <class Kernel>
int resident_ctas(std::atomic<int> (&cache)[64], Kernel kernel, int threads, const char* op) {
  return once_per_device(cache, op, [&] {
    int n = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0), op, "occupancy");
    return std::max(n, 1);
  });
}

}  // namespace samebits::cuda::norm
