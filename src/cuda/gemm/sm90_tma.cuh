// 2-D TMA tensor maps for the Hopper GEMM kernels.
#pragma once
#include <cuda.h>

#include <cstdint>

namespace samebits::cuda::sm90 {

// A row-major [rows, cols] operand (cols % 8 == 0, 16-byte aligned) as boxes of box_rows x 64
// elements with 128-byte swizzle; out-of-range elements load as zeros.
template <class T>
CUtensorMap tma_map_2d(const T* ptr, int64_t rows, int64_t cols, int box_rows);

}  // namespace samebits::cuda::sm90
