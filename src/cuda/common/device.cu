// CUDA backend runtime: device discovery and memory. The op families (gemm/, attention/, norm/,
// logprob/, embedding/, elementwise/) each register their kernels from their own folder through
// SAMEBITS_REGISTER_KERNEL (src/ops/registry.hpp); until one lands, its ops report NotBuilt.
#include <cuda_runtime.h>

#include "cuda/common/runtime.cuh"

namespace samebits::cuda {

bool device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
}

void* alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes ? bytes : 1), "device_alloc", "bytes");
  return p;
}

void free(void* p) { cudaFree(p); }

void copy(void* dst, const void* src, size_t bytes, bool to_device) {
  check(cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost), "device copy",
        to_device ? "host to device" : "device to host");
}

void copy_on_device(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice), "device copy", "device to device");
}

void fill(void* p, int byte, size_t bytes) { check(cudaMemset(p, byte, bytes), "device fill", "bytes"); }

void synchronize() { check(cudaDeviceSynchronize(), "device_synchronize", "kernel"); }

}  // namespace samebits::cuda
