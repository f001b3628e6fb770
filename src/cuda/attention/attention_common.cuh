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

// 2^x by the hardware's ex2 (flush-to-zero; ex2(−inf) = 0): the exponentials of the softmax are
// 2^(s·c − m·c) with c = scale·log2(e), one FFMA and one ex2 a score.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The fold of a key span's softmax state (m: its row max of the raw scores, l = Σ 2^((s − m)·c),
// o = Σ 2^((s − m)·c)·v) into the running state (M, L, O) of the spans before it, left to right:
//   M' = max(M, m), a = 2^(M·c − M'·c), b = 2^(m·c − M'·c) (products rounded, then subtracted),
//   L' = L·a + l·b, O' = O·a + o·b.
// A span the row sees no key of (m = −inf) leaves the state as it is. Every path that combines
// spans — the Hopper kernel folding inside a CTA and the split-KV combine kernel — calls these two
// functions, so the same spans give the same bits whichever path ran. The first fold starts from
// M = −inf, L = 0, O = 0 (a = 0).
__device__ __forceinline__ bool fold_stats(float& M, float& L, float m, float l, float c, float& a, float& b) {
  if (m == -INFINITY) return false;
  const float mn = fmaxf(M, m), mc = __fmul_rn(mn, c);
  a = exp2_ftz(__fsub_rn(__fmul_rn(M, c), mc));  // exactly 1 where M = M' (both products round alike)
  b = exp2_ftz(__fsub_rn(__fmul_rn(m, c), mc));
  L = __fadd_rn(__fmul_rn(L, a), __fmul_rn(l, b));
  M = mn;
  return true;
}
__device__ __forceinline__ float fold_value(float O, float o, float a, float b) {
  return __fadd_rn(__fmul_rn(O, a), __fmul_rn(o, b));
}
// lse = M·scale + ln L.
__device__ __forceinline__ float final_lse(float M, float L, float scale) { return __fadd_rn(__fmul_rn(M, scale), logf(L)); }

}  // namespace samebits::cuda::attention
