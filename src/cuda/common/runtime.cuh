// CUDA runtime helpers shared by the op families: error checks that raise samebits::Error.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "samebits/error.hpp"

namespace samebits::cuda {

inline void check(cudaError_t e, const char* op, const char* what) {
  if (e != cudaSuccess) throw Error(op, what, std::string("CUDA error: ") + cudaGetErrorString(e));
}

inline cudaStream_t stream_of(void* s) { return static_cast<cudaStream_t>(s); }

// The current device's SM count (persistent kernels size their grids by it; it decides which CTA
// computes a tile, never how), cached per device.
inline int current_sm_count(const char* op) {
  static std::atomic<int> cached[64] = {};
  int dev = 0;
  check(cudaGetDevice(&dev), op, "device");
  const bool cacheable = dev >= 0 && dev < 64;
  int sms = cacheable ? cached[dev].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), op, "SM count");
    if (cacheable) cached[dev].store(sms, std::memory_order_relaxed);
  }
  return sms > 0 ? sms : 1;
}

}  // namespace samebits::cuda
