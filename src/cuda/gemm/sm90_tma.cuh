// 2-D TMA tensor maps for the Hopper GEMM kernels.
#pragma once
#include <cuda.h>

#include <cstdint>

namespace samebits::cuda::sm90 {

// A row-major [rows, cols] matrix (rows 16-byte aligned: cols % 8 == 0 for 16-bit types, % 4 for
// fp32) as boxes of box_rows rows x 128 bytes (64 bf16 / fp16, 32 fp32) with 128-byte swizzle;
// out-of-range elements load as zeros.
template <class T>
CUtensorMap tma_map_2d(const T* ptr, int64_t rows, int64_t cols, int box_rows);

}  // namespace samebits::cuda::sm90
