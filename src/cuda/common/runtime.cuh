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

// Whether `stream` is being captured into a graph (work queued now runs at the graph's replays).
inline bool stream_capturing(cudaStream_t stream, const char* op) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &status), op, "stream capture status");
  return status != cudaStreamCaptureStatusNone;
}

// A positive value computed once per device and cached for the process: `cache` is the caller's
// own (one entry per device, 0 until computed). Settings such as a kernel's shared-memory opt-in
// belong to the device they were made on, so a process that drives several GPUs must make them
// once on each. Two threads may compute an entry at once; the computations must agree.
template <class F>
int once_per_device(std::atomic<int> (&cache)[64], const char* op, F&& compute) {
  int dev = 0;
  check(cudaGetDevice(&dev), op, "device");
  if (dev < 0 || dev >= 64) return compute();
  int v = cache[dev].load(std::memory_order_acquire);
  if (v == 0) {
    v = compute();
    cache[dev].store(v, std::memory_order_release);
  }
  return v;
}

// The current device's SM count (persistent kernels size their grids by it; it decides which CTA
// computes a tile, never how), cached per device.
inline int current_sm_count(const char* op) {
  static std::atomic<int> cached[64] = {};
  return once_per_device(cached, op, [&] {
    int dev = 0, sms = 0;
    check(cudaGetDevice(&dev), op, "device");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), op, "SM count");
    return sms > 0 ? sms : 1;
  });
}

// Opts `kernel` into `bytes` of dynamic shared memory on the current device, once per device.
template <class Kernel>
void allow_dynamic_smem(Kernel kernel, size_t bytes, std::atomic<int> (&done)[64], const char* op) {
  once_per_device(done, op, [&] {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), op, "shared memory");
    return 1;
  });
}

}  // namespace samebits::cuda
