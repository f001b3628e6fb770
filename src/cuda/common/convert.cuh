// Device-side conversions shared by the CUDA kernels: storage types to fp32 and fp32 to a DType.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "samebits/dtype.hpp"

namespace samebits::cuda {

template <class T>
__device__ __forceinline__ float to_f32(T v) { return float(v); }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

// Rounds v (RNE) into element i of a buffer of dtype dt (bf16, fp16 or fp32).
__device__ __forceinline__ void store_as(void* out, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::bf16: static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v); break;
    case DType::f16: static_cast<__half*>(out)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(out)[i] = v; break;
  }
}

// Calls fn with a value of the storage type of a floating dtype (bf16, fp16, else fp32).
template <class Fn>
void with_float_storage(DType d, Fn&& fn) {
  if (d == DType::bf16) fn(__nv_bfloat16{});
  else if (d == DType::f16) fn(__half{});
  else fn(float{});
}

// The same for a 16-bit floating dtype (bf16, else fp16): the tensor-core paths' operand types.
template <class Fn>
void with_16bit_storage(DType d, Fn&& fn) {
  if (d == DType::bf16) fn(__nv_bfloat16{});
  else fn(__half{});
}

// Every row of a row-major buffer starts 16-byte aligned (so rows load as 16-byte vectors): a
// property of the base pointer and the row length, never of which row.
inline bool rows_aligned_16(const void* base, int64_t row_elems, size_t elem) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (row_elems * int64_t(elem)) % 16 == 0;
}

}  // namespace samebits::cuda
