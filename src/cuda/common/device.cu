// CUDA backend runtime: device discovery and memory. The op families (gemm/, attention/, norm/,
// logprob/, embedding/, elementwise/) each register their kernels from their own folder through
// SAMEBITS_REGISTER_KERNEL (src/ops/registry.hpp); until one lands, its ops report NotBuilt.
#include <cuda_runtime.h>

#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"

namespace samebits::cuda {

bool device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
}

// Device memory from samebits' stream-ordered pool (scratch.cuh), ordered on the legacy default
// stream: the model chain allocates every activation of a step, and cudaMalloc / cudaFree would
// synchronise the device at each one. Memory freed here is reused by later work on that stream
// (and on every blocking stream, which the legacy stream waits for).
void* alloc(size_t bytes) { return scratch_alloc(bytes ? bytes : 1, cudaStreamLegacy, "device_alloc"); }

void free(void* p) {
  try {
    scratch_free(p, cudaStreamLegacy, "device_free");
  } catch (...) {  // freeing must not throw (destructors); the pool keeps the memory
  }
}

void copy(void* dst, const void* src, size_t bytes, bool to_device) {
  check(cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost), "device copy",
        to_device ? "host to device" : "device to host");
}

void copy_on_device(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice), "device copy", "device to device");
}

void copy_blocks_on_device(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height) {
  check(cudaMemcpy2D(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDeviceToDevice), "device copy",
        "blocks, device to device");
}

// One CTA a row; 16-byte moves where the row, both pitches and both bases allow, else bytes.
__global__ void copy_rows_kernel(uint8_t* dst, size_t dst_pitch, const uint8_t* src, size_t src_pitch, size_t row_bytes,
                                 const int32_t* dst_rows, const int32_t* src_rows, bool wide) {
  uint8_t* d = dst + size_t(dst_rows[blockIdx.x]) * dst_pitch;
  const uint8_t* s = src + size_t(src_rows[blockIdx.x]) * src_pitch;
  if (wide) {
    for (size_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
  } else {
    for (size_t i = threadIdx.x; i < row_bytes; i += blockDim.x) d[i] = s[i];
  }
}

void copy_rows_indexed(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                       const int32_t* dst_rows, const int32_t* src_rows, int64_t n) {
  if (n <= 0 || row_bytes == 0) return;
  const bool wide = (row_bytes | dst_pitch | src_pitch | reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % 16 == 0;
  copy_rows_kernel<<<unsigned(n), 128, 0, cudaStreamLegacy>>>(static_cast<uint8_t*>(dst), dst_pitch,
                                                              static_cast<const uint8_t*>(src), src_pitch, row_bytes,
                                                              dst_rows, src_rows, wide);
  check(cudaGetLastError(), "device copy", "indexed rows");
}

void fill(void* p, int byte, size_t bytes) { check(cudaMemset(p, byte, bytes), "device fill", "bytes"); }

size_t memory_peak(bool reset) { return size_t(scratch_peak_bytes(reset, "device_memory_peak")); }
size_t memory_in_use() { return size_t(scratch_bytes_in_use("device_memory_in_use")); }
void memory_release() { scratch_trim("device_memory_release"); }
void memory_info(size_t* free, size_t* total) {
  check(cudaMemGetInfo(free, total), "device_memory_info", "cudaMemGetInfo");
  const uint64_t held = scratch_bytes_held("device_memory_info"), used = scratch_bytes_in_use("device_memory_info");
  if (held > used) *free += size_t(held - used);
}

void synchronize() { check(cudaDeviceSynchronize(), "device_synchronize", "kernel"); }

}  // namespace samebits::cuda
