// The SwiGLU activation's arithmetic, one definition for every kernel that computes it (the
// elementwise op and the gate + up GEMM's fused epilogue): the same expression, every rounding
// explicit (never contracted into an FMA), so the fused path gives the elementwise op's bits.
#pragma once
#include <cuda_runtime.h>

namespace samebits::cuda {

// sigmoid(g) = 1 / (1 + e^(−g)), e^x by the accurate expf (deterministic).
__device__ __forceinline__ float sigmoid(float g) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g))); }

// silu(g)·u in fp32, from the gate and up values as stored (already rounded to their dtype).
__device__ __forceinline__ float swiglu_value(float g, float u) { return __fmul_rn(__fmul_rn(g, sigmoid(g)), u); }

}  // namespace samebits::cuda
