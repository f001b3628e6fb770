#include "samebits/device.hpp"

#include <cstdlib>
#include <cstring>

#include "samebits/error.hpp"

namespace samebits {

#if SAMEBITS_WITH_CUDA
namespace cuda {
void* alloc(size_t bytes);
void free(void* ptr);
void copy(void* dst, const void* src, size_t bytes, bool to_device);
void copy_on_device(void* dst, const void* src, size_t bytes);
void fill(void* ptr, int byte, size_t bytes);
void synchronize();
size_t memory_peak(bool reset);
size_t memory_in_use();
void memory_release();
}  // namespace cuda
#define SAMEBITS_CUDA_OR_NOT_BUILT(expr) expr
#else
#define SAMEBITS_CUDA_OR_NOT_BUILT(expr) throw NotBuilt("device memory", "cuda")
#endif

void* device_alloc(Backend b, size_t bytes) {
  if (b == Backend::cpu) {
    void* p = std::malloc(bytes ? bytes : 1);
    if (!p) throw Error("device_alloc", "bytes", "out of host memory");
    return p;
  }
  SAMEBITS_CUDA_OR_NOT_BUILT(return cuda::alloc(bytes));
}

void device_free(Backend b, void* p) {
  if (b == Backend::cpu) return std::free(p);
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::free(p));
}

void copy_to_device(Backend b, void* dst, const void* src, size_t bytes) {
  if (b == Backend::cpu) { std::memcpy(dst, src, bytes); return; }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::copy(dst, src, bytes, true));
}

void copy_to_host(Backend b, void* dst, const void* src, size_t bytes) {
  if (b == Backend::cpu) { std::memcpy(dst, src, bytes); return; }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::copy(dst, src, bytes, false));
}

void copy_on_device(Backend b, void* dst, const void* src, size_t bytes) {
  if (b == Backend::cpu) { std::memmove(dst, src, bytes); return; }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::copy_on_device(dst, src, bytes));
}

void device_fill(Backend b, void* p, int byte, size_t bytes) {
  if (b == Backend::cpu) { std::memset(p, byte, bytes); return; }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::fill(p, byte, bytes));
}

void device_memory_release(Backend b) {
  if (b == Backend::cpu) return;
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::memory_release());
}

size_t device_memory_in_use(Backend b) {
  if (b == Backend::cpu) return 0;
  SAMEBITS_CUDA_OR_NOT_BUILT(return cuda::memory_in_use());
}

size_t device_memory_peak(Backend b, bool reset) {
  if (b == Backend::cpu) return 0;
  SAMEBITS_CUDA_OR_NOT_BUILT(return cuda::memory_peak(reset));
}

void device_synchronize(Backend b) {
  if (b == Backend::cpu) return;
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::synchronize());
}

}  // namespace samebits
