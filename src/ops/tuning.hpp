// Test hooks for kernel shape choices. Production code never sets them; tests force each choice to
// prove that the choices give identical bits.
#pragma once

namespace samebits::detail {

// 0: the GEMM picks its tile width itself; 64, 128, 192 or 256: forced (tests/test_cuda_gemm.cpp).
int& gemm_tile_width_override();

}  // namespace samebits::detail
