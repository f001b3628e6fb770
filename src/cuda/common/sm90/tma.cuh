// 2-D TMA tensor maps for the Hopper kernels (GEMM and attention).
#pragma once
#include <cuda.h>

#include <cstdint>

namespace samebits::cuda::sm90 {

// A row-major [rows, cols] matrix (rows 16-byte aligned: cols % 8 == 0 for 16-bit types, % 4 for
// fp32) as boxes of box_rows rows x 128 bytes (64 bf16 / fp16, 32 fp32) with 128-byte swizzle;
// out-of-range elements load as zeros. `promote_256` asks the copy engine to fetch 256-byte L2
// lines for the 128-byte box rows: that helps a call that only streams a weight (M <= 128: forward
// weight streaming 2.5-2.9 against 2.3-2.8 TB/s on an H100) and hurts one that reuses tiles from
// L2 (same-card A/B over M >= 1024: mean ratio to cuBLAS 0.998 / 1.010 / 0.998 for forward / dX /
// dW without, 0.972 / 0.987 / 0.959 with). A cache hint only: the loaded values are the same.
// box_bytes = 64: box rows of 64 bytes with 64-byte swizzle (32-wide tiles of a weight read N-major).
template <class T>
CUtensorMap tma_map_2d(const T* ptr, int64_t rows, int64_t cols, int box_rows, bool promote_256 = false,
                       int box_bytes = 128);

// A [d2, d1, d0] tensor with d0 contiguous (d0 % 8 == 0, 16-bit elements), e.g. q [tokens, heads,
// head_dim], as boxes of {64, box1, box2} elements (box rows of 128 bytes, 128-byte swizzle): the box's
// rows are (i2, i1) with i1 fastest. Out-of-range elements load as zeros.
template <class T>
CUtensorMap tma_map_3d(const T* ptr, int64_t d2, int64_t d1, int64_t d0, int box1, int box2);

}  // namespace samebits::cuda::sm90
