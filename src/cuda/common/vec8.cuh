// Eight consecutive elements of a bf16 / fp16 / fp32 buffer as fp32 registers, and back: the unit of
// work of the memory-bound kernels (norms, RoPE, elementwise). Each tensor keeps its own dtype (a
// norm's weight may be fp32 under bf16 activations; a residual stream fp32), chosen at run time by
// a switch that is uniform across the launch.
//
// One 16-byte access per 8 elements (two for fp32) where the buffer is 16-byte aligned and all 8
// elements exist; otherwise element by element. Both give the same values, so where a vector starts
// (a row's alignment, a tail) never changes a bit of what is computed from it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/convert.cuh"
#include "samebits/tensor.hpp"

namespace samebits::cuda {

struct In8 {  // a read-only tensor
  const void* p = nullptr;
  DType dt = DType::f32;
  bool vec = false;  // 16-byte aligned base (every 8-element vector then is, if rows are too)
};
struct Out8 {
  void* p = nullptr;
  DType dt = DType::f32;
  bool vec = false;
};

inline bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
// A tensor read or written in vectors that start at multiples of 8 elements within rows of
// `row_elems` elements (the whole tensor for a flat elementwise op). An absent (optional) tensor
// gives p == nullptr, which the kernels test.
inline In8 in8(const TensorView& t, int64_t row_elems) {
  return {t.data, t.dtype, aligned_16(t.data) && row_elems % 8 == 0};
}
inline Out8 out8(const TensorView& t, int64_t row_elems) {
  return {t.data, t.dtype, aligned_16(t.data) && row_elems % 8 == 0};
}

__device__ __forceinline__ float load_one(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// v[e] = element i + e for e < n (n ≤ 8), 0 for the rest.
__device__ __forceinline__ void load8(const In8& t, int64_t i, int n, float (&v)[8]) {
  if (t.vec && n == 8) {
    if (t.dt == DType::f32) {
      const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(t.p) + i);
      const float4 a = q[0], b = q[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
      return;
    }
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(t.p) + i);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (t.dt == DType::bf16) {
        const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&w[k]);
        v[2 * k] = __low2float(h), v[2 * k + 1] = __high2float(h);
      } else {
        const __half2 h = *reinterpret_cast<const __half2*>(&w[k]);
        v[2 * k] = __low2float(h), v[2 * k + 1] = __high2float(h);
      }
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = e < n ? load_one(t.p, t.dt, i + e) : 0.0f;
}

// Elements i .. i + n − 1 (n ≤ 8) := v rounded (RNE) to the buffer's dtype.
__device__ __forceinline__ void store8(const Out8& t, int64_t i, int n, const float (&v)[8]) {
  if (t.vec && n == 8) {
    if (t.dt == DType::f32) {
      float4* q = reinterpret_cast<float4*>(static_cast<float*>(t.p) + i);
      q[0] = make_float4(v[0], v[1], v[2], v[3]);
      q[1] = make_float4(v[4], v[5], v[6], v[7]);
      return;
    }
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (t.dt == DType::bf16) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
        w[k] = *reinterpret_cast<const uint32_t*>(&h);
      } else {
        const __half2 h = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
        w[k] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(t.p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < n) store_as(t.p, t.dt, i + e, v[e]);
}

// v rounded to dtype dt and widened back: the value a store of v would hold.
__device__ __forceinline__ float round_to(DType dt, float v) {
  switch (dt) {
    case DType::bf16: return __bfloat162float(__float2bfloat16_rn(v));
    case DType::f16: return __half2float(__float2half_rn(v));
    default: return v;
  }
}

}  // namespace samebits::cuda
