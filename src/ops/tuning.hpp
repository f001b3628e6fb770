// Test hooks for kernel shape choices. Production code never sets them; tests force each choice to
// prove that the choices give identical bits.
#pragma once

namespace samebits::detail {

// 0: the GEMM picks its tile width itself; 64, 128, 192 or 256: forced (tests/test_cuda_gemm.cpp).
int& gemm_tile_width_override();

// 0: the fused LM head's backward picks its vocab chunk itself; else the chunk width in columns (a
// multiple of 256; tests/test_cuda_lm_head.cpp).
int& lm_head_vocab_chunk_override();

// 0: the CUDA RMSNorm kernels take their default rows per step; 1 or 2: forced (a choice that changes
// no bit; tests/test_cuda_norm_rope.cpp, bench/bench_norm.py).
int& norm_rows_per_step_override();

}  // namespace samebits::detail
