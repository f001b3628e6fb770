// Stream-ordered scratch memory for the kernels' temporaries (sort keys, row masks, check results).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace samebits::cuda {

// From samebits' own memory pool on the current device, which keeps freed memory for reuse: the
// default pool hands its memory back at every synchronisation, and mapping it again costs ~0.1 ms
// a call. The pool is created once per device; the caller's pools and settings are not touched.
void* scratch_alloc(size_t bytes, cudaStream_t stream, const char* op);
void scratch_free(void* p, cudaStream_t stream, const char* op);
// Bytes of the pool in use now (samebits' tensors and temporaries), and the most in use since the
// last reset (at least the current use); `reset` starts a new mark.
uint64_t scratch_bytes_in_use(const char* op);
// Bytes the pool holds from the device (in use or kept for reuse).
uint64_t scratch_bytes_held(const char* op);
// Hands the pool's unused memory back to the device (after the device is idle): for a process that
// shares the GPU with another allocator (PyTorch's), between phases.
void scratch_trim(const char* op);
// Creates the current device's pool if it does not exist yet. A graph capture calls it first: under
// a capture scratch_alloc takes the pool, which cannot be created then (cudaMemPoolCreate is refused
// while the thread captures), and where an external allocator served every earlier call, nothing
// else has made it (session 25: an Engine inside PyTorch fell back to eager decode steps for that).
void scratch_pool_ready(const char* op);
uint64_t scratch_peak_bytes(bool reset, const char* op);
// Memory from an installed external allocator (samebits/device.hpp, set_device_allocator) in use
// now, and its peak since the last reset: scratch_alloc takes it from there outside stream captures.
uint64_t external_bytes_in_use();
uint64_t external_peak_bytes(bool reset);
// What the installed external allocator holds unused on the current device (its `cached`; 0 without).
uint64_t external_bytes_cached();

// A stream-ordered scratch buffer that is released (on its stream) when it goes out of scope.
class ScratchBuffer {
 public:
  ScratchBuffer(size_t bytes, cudaStream_t stream, const char* op)
      : p_(bytes ? scratch_alloc(bytes, stream, op) : nullptr), stream_(stream), op_(op) {}
  ~ScratchBuffer() {
    try {
      scratch_free(p_, stream_, op_);
    } catch (...) {  // a destructor must not throw; the pool keeps the memory
    }
  }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p_); }

 private:
  void* p_;
  cudaStream_t stream_;
  const char* op_;
};

}  // namespace samebits::cuda
