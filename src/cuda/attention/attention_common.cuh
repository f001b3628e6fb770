// Pieces the CUDA attention kernels share: 16-bit packing of fp32 pairs and the fixed fold that
// combines the softmax state of one key span into a running one.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace samebits::cuda::attention {

template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The fold of a key span's softmax state (m, l, o: its row max, Σ exp(s − m), Σ exp(s − m)·v) into
// the running state (M, L, O) of the spans before it, left to right:
//   M' = max(M, m), a = exp(M − M'), b = exp(m − M'), L' = L·a + l·b, O' = O·a + o·b.
// A span the row sees no key of (m = −inf) leaves the state as it is. Every path that combines
// spans — the Hopper kernel folding inside a CTA and the split-KV combine kernel — calls these two
// functions, so the same spans give the same bits whichever path ran. The first fold starts from
// M = −inf, L = 0, O = 0.
__device__ __forceinline__ bool fold_stats(float& M, float& L, float m, float l, float& a, float& b) {
  if (m == -INFINITY) return false;
  const float mn = fmaxf(M, m);
  a = expf(__fsub_rn(M, mn));
  b = expf(__fsub_rn(m, mn));
  L = __fadd_rn(__fmul_rn(L, a), __fmul_rn(l, b));
  M = mn;
  return true;
}
__device__ __forceinline__ float fold_value(float O, float o, float a, float b) {
  return __fadd_rn(__fmul_rn(O, a), __fmul_rn(o, b));
}

}  // namespace samebits::cuda::attention
