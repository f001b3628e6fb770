// samebits/device.hpp — the little of device memory that callers and the harness need.
// On Backend::cpu these are plain host operations; on Backend::cuda they are stream-ordered
// allocations and copies on the current device (throwing NotBuilt when the CUDA backend was not
// compiled), ordered on this thread's device stream: the legacy default stream unless a
// DeviceStreamScope names another.
#pragma once
#include <cstddef>
#include <cstdint>

#include "samebits/context.hpp"

namespace samebits {

void* device_alloc(Backend backend, size_t bytes);
void device_free(Backend backend, void* ptr);
void copy_to_device(Backend backend, void* dst, const void* src, size_t bytes);
void copy_to_host(Backend backend, void* dst, const void* src, size_t bytes);
void copy_on_device(Backend backend, void* dst, const void* src, size_t bytes);
// `height` blocks of `width` bytes, block i from src + i·src_pitch to dst + i·dst_pitch (one call).
void copy_blocks_on_device(Backend backend, void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                           size_t width, size_t height);
void device_fill(Backend backend, void* ptr, int byte, size_t bytes);
// n rows of `row_bytes` bytes, in one launch: dst + dst_rows[i]·dst_pitch ← src + src_rows[i]·src_pitch
// (the int32 index arrays on the backend's device; the destination rows distinct — or written
// with the very same bytes — and never overlapping the source). Asynchronous on the CUDA backend (on this thread's device stream, below).
void copy_rows_indexed(Backend backend, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                       const int32_t* dst_rows, const int32_t* src_rows, int64_t n);
// The same for two (destination, source) pairs that share the row size and the row maps, in one
// launch on CUDA (a layer's keys and values into the cache).
struct RowCopy {
  void* dst;
  size_t dst_pitch;
  const void* src;
  size_t src_pitch;
};
void copy_rows_indexed(Backend backend, const RowCopy& first, const RowCopy& second, size_t row_bytes,
                       const int32_t* dst_rows, const int32_t* src_rows, int64_t n);
// n token ids, in one launch: dst[dst_rows[i]] ← src[src_rows[i]], a negative id (a draw that met
// NaN or Inf logits) written as 0 — the row fed so is dropped by its caller (the int32 arrays on
// the backend's device; asynchronous on CUDA). A decode step's tokens from the step before it.
void gather_tokens(Backend backend, int32_t* dst, const int32_t* src, const int32_t* dst_rows, const int32_t* src_rows,
                   int64_t n);
void device_synchronize(Backend backend);

// The stream this thread's device memory work (allocations, frees, copies, fills) is ordered on
// while the scope lives (null: the legacy default stream); scopes nest. A DeviceTensor frees its
// memory on the stream it was allocated on, whatever scope its destructor runs in.
class DeviceStreamScope {
 public:
  explicit DeviceStreamScope(void* stream);
  ~DeviceStreamScope();
  DeviceStreamScope(const DeviceStreamScope&) = delete;
  DeviceStreamScope& operator=(const DeviceStreamScope&) = delete;

 private:
  void* previous_;
};
void* current_device_stream();
// Waits for the work on `stream` (null: the legacy default stream). Nothing on the CPU backend.
void device_stream_synchronize(Backend backend, void* stream);

// An owned CUDA stream (null on the CPU backend), blocking: its work is ordered with the legacy
// default stream's (PyTorch's default stream), unlike which it can be captured into a CUDA graph.
// Destroyed after its work is done.
class DeviceStream {
 public:
  explicit DeviceStream(Backend backend);
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;
  void* get() const { return stream_; }
  void synchronize() const;

 private:
  Backend backend_;
  void* stream_ = nullptr;
};

// A point in this thread's device stream (a CUDA event; on the CPU backend, whose work is done when
// its call returns, nothing): record() marks the work given to the stream so far, wait() blocks the
// host until that work has run (at once if nothing was recorded).
class DeviceEvent {
 public:
  explicit DeviceEvent(Backend backend);
  ~DeviceEvent();
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  void record();
  void wait() const;

 private:
  Backend backend_;
  void* event_ = nullptr;
};

// Page-locked host memory (plain memory on the CPU backend): what asynchronous copies stage through.
class PinnedBuffer {
 public:
  PinnedBuffer(Backend backend, size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  Backend backend_;
  size_t bytes_;
  void* data_ = nullptr;
};

// Any direction, ordered on this thread's device stream and not waited for (the caller keeps both
// sides alive and unchanged until the stream has run it); a plain copy on the CPU backend.
void copy_async(Backend backend, void* dst, const void* src, size_t bytes);
// Device memory samebits holds now (tensors and temporaries, from its own pool), and the most it
// held at once since the last reset (`reset` starts a new mark). 0 on the CPU backend.
size_t device_memory_in_use(Backend backend);
size_t device_memory_peak(Backend backend, bool reset);
// Returns the memory samebits keeps for reuse but does not use now to the device (synchronises it
// first), for a process that shares the GPU with another allocator. Nothing on the CPU backend.
void device_memory_release(Backend backend);
// The device's free and total memory now (cudaMemGetInfo), plus what samebits' pool holds unused
// in `free`. 0 and 0 on the CPU backend.
void device_memory_info(Backend backend, size_t* free, size_t* total);

// Device memory from another allocator instead of samebits' own pool: a framework's caching
// allocator, so that a process keeps one cache of free GPU memory, not two blind to each other
// (samebits.torch installs PyTorch's when it loads its C++ ops). alloc(bytes, device, stream, user)
// returns the memory or null when it has none; free(ptr, device, stream, user) takes back what alloc
// gave. Both stream-ordered as samebits' pool is: memory freed on a stream is reused by work later
// on that stream. Memory asked for while its stream is being captured into a CUDA graph still comes
// from samebits' pool (it becomes the graph's own memory). What was allocated goes back to the
// allocator that gave it, whatever is installed by then. device_memory_in_use counts both;
// device_memory_peak adds the two allocators' peaks; device_memory_info adds what `cached` (optional)
// says the allocator holds unused on the device, as it adds samebits' own pool's (an engine sizes
// its KV pool from it). An empty ExternalAllocator (the default) brings back samebits' own pool for
// later allocations. Nothing without the CUDA backend.
struct ExternalAllocator {
  void* (*alloc)(size_t bytes, int device, void* stream, void* user) = nullptr;
  void (*free)(void* ptr, int device, void* stream, void* user) = nullptr;
  size_t (*cached)(int device, void* user) = nullptr;
  void* user = nullptr;
};
void set_device_allocator(const ExternalAllocator& allocator);

}  // namespace samebits
