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

// Where a tensor's dtype comes from: read at run time (AnyDtype), or known to be bf16 at compile
// time (AllBf16: a kernel instance for the common all-bf16 call, whose branches and unused
// registers then fold away; the host launches it only where every tensor it covers is bf16). Both
// compute the same values.
struct AnyDtype {
  __device__ static DType of(DType dt) { return dt; }
};
struct AllBf16 {
  __device__ static DType of(DType) { return DType::bf16; }
};

// The bits of up to 8 consecutive elements as they lie in memory: 16 bytes for a 2-byte dtype (in
// lo), 32 for fp32 (lo, hi), zero bits past n. Fetching (issuing loads) is kept apart from widening
// to fp32 (unpack8) so that a kernel can issue all its loads before it waits for any (widening right
// after each load makes the thread wait for that load before it issues the next), and so that rows
// can be fetched a step ahead of their use.
struct Raw8 {
  uint4 lo, hi;
};

template <class Fmt = AnyDtype>
__device__ __forceinline__ Raw8 fetch8(const In8& t, int64_t i, int n) {
  const DType dt = Fmt::of(t.dt);
  Raw8 r{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  if (t.vec && n == 8) {
    if (dt == DType::f32) {
      const uint4* q = reinterpret_cast<const uint4*>(static_cast<const float*>(t.p) + i);
      r.lo = q[0], r.hi = q[1];
    } else {
      r.lo = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(t.p) + i);
    }
    return r;
  }
  uint32_t w[8] = {};
  if (dt == DType::f32) {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (e < n) w[e] = static_cast<const uint32_t*>(t.p)[i + e];
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (e < n) w[e / 2] |= uint32_t(static_cast<const uint16_t*>(t.p)[i + e]) << (16 * (e % 2));
  }
  r.lo = make_uint4(w[0], w[1], w[2], w[3]);
  r.hi = make_uint4(w[4], w[5], w[6], w[7]);
  return r;
}

// v[e] := the 8 elements of r (of dtype dt) widened to fp32 (exactly; zero bits give 0).
__device__ __forceinline__ void unpack8(DType dt, const Raw8& r, float (&v)[8]) {
  const uint32_t w[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
  if (dt == DType::f32) {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = __uint_as_float(w[e]);
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (dt == DType::bf16) {
      v[2 * k] = __uint_as_float(w[k] << 16), v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    } else {
      const __half2 h = *reinterpret_cast<const __half2*>(&w[k]);
      v[2 * k] = __low2float(h), v[2 * k + 1] = __high2float(h);
    }
  }
}

// v[e] = element i + e for e < n (n ≤ 8), 0 for the rest (a fetch and its unpack: use the two
// apart where several loads should be in flight).
__device__ __forceinline__ void load8(const In8& t, int64_t i, int n, float (&v)[8]) { unpack8(t.dt, fetch8(t, i, n), v); }

// Elements i .. i + n − 1 (n ≤ 8) := v rounded (RNE) to the buffer's dtype.
template <class Fmt = AnyDtype>
__device__ __forceinline__ void store8(const Out8& t, int64_t i, int n, const float (&v)[8]) {
  const DType dt = Fmt::of(t.dt);
  if (t.vec && n == 8) {
    if (dt == DType::f32) {
      float4* q = reinterpret_cast<float4*>(static_cast<float*>(t.p) + i);
      q[0] = make_float4(v[0], v[1], v[2], v[3]);
      q[1] = make_float4(v[4], v[5], v[6], v[7]);
      return;
    }
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (dt == DType::bf16) {
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
    if (e < n) store_as(t.p, dt, i + e, v[e]);
}

// Elements i .. i + n − 1 (n ≤ 8) := the bits of r as fetch8 holds them (a verbatim copy: no
// widening, no rounding, NaN payloads kept).
template <class Fmt = AnyDtype>
__device__ __forceinline__ void store_raw8(const Out8& t, int64_t i, int n, const Raw8& r) {
  const DType dt = Fmt::of(t.dt);
  if (t.vec && n == 8) {
    if (dt == DType::f32) {
      uint4* q = reinterpret_cast<uint4*>(static_cast<float*>(t.p) + i);
      q[0] = r.lo, q[1] = r.hi;
    } else {
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(t.p) + i) = r.lo;
    }
    return;
  }
  const uint32_t w[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
  if (dt == DType::f32) {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (e < n) static_cast<uint32_t*>(t.p)[i + e] = w[e];
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (e < n) static_cast<uint16_t*>(t.p)[i + e] = uint16_t(w[e / 2] >> (16 * (e % 2)));
  }
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
