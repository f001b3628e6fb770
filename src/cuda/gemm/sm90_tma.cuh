// 2-D TMA tensor maps for the Hopper GEMM kernels.
#pragma once
#include <cuda.h>

#include <cstdint>

namespace samebits::cuda::sm90 {

// A row-major [rows, cols] matrix (rows 16-byte aligned: cols % 8 == 0 for 16-bit types, % 4 for
// fp32) as boxes of box_rows rows x 128 bytes (64 bf16 / fp16, 32 fp32) with 128-byte swizzle;
// out-of-range elements load as zeros. No L2 promotion: fetching 256-byte lines for 128-byte box
// rows measured slower on an H100 (same-card A/B over M >= 1024: mean ratio to cuBLAS 0.998 / 1.010
// / 0.998 for forward / dX / dW without, 0.972 / 0.987 / 0.959 with 256-byte promotion).
template <class T>
CUtensorMap tma_map_2d(const T* ptr, int64_t rows, int64_t cols, int box_rows);

}  // namespace samebits::cuda::sm90
