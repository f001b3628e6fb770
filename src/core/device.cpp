#include "samebits/device.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "samebits/error.hpp"

namespace samebits {

#if SAMEBITS_WITH_CUDA
namespace cuda {
void* alloc(size_t bytes, void* stream);
void free(void* ptr, void* stream);
void copy(void* dst, const void* src, size_t bytes, bool to_device, void* stream);
void copy_async(void* dst, const void* src, size_t bytes, void* stream);
void copy_on_device(void* dst, const void* src, size_t bytes, void* stream);
void copy_blocks_on_device(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                           void* stream);
void fill(void* ptr, int byte, size_t bytes, void* stream);
void copy_rows_indexed(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                       const int32_t* dst_rows, const int32_t* src_rows, int64_t n, void* stream);
void copy_rows_indexed_pair(const RowCopy& first, const RowCopy& second, size_t row_bytes, const int32_t* dst_rows,
                            const int32_t* src_rows, int64_t n, void* stream);
void gather_tokens(int32_t* dst, const int32_t* src, const int32_t* dst_rows, const int32_t* src_rows, int64_t n,
                   void* stream);
void synchronize();
void* stream_create();
void stream_destroy(void* stream);
void stream_synchronize(void* stream);
void* event_create();
void event_destroy(void* event);
void event_record(void* event, void* stream);
void event_synchronize(void* event);
void* pinned_alloc(size_t bytes);
void pinned_free(void* p);
size_t memory_peak(bool reset);
size_t memory_in_use();
void set_external_allocator(const ExternalAllocator& allocator);
void memory_release();
void memory_info(size_t* free, size_t* total);
}  // namespace cuda
#define SAMEBITS_CUDA_OR_NOT_BUILT(expr) expr
#else
#define SAMEBITS_CUDA_OR_NOT_BUILT(expr) throw NotBuilt("device memory", "cuda")
#endif

namespace {
thread_local void* current_stream = nullptr;  // this thread's stream for device memory work; null: legacy
}

DeviceStreamScope::DeviceStreamScope(void* stream) : previous_(current_stream) { current_stream = stream; }
DeviceStreamScope::~DeviceStreamScope() { current_stream = previous_; }
void* current_device_stream() { return current_stream; }

DeviceStream::DeviceStream(Backend backend) : backend_(backend) {
  if (backend == Backend::cpu) return;
  SAMEBITS_CUDA_OR_NOT_BUILT(stream_ = cuda::stream_create());
}

DeviceStream::~DeviceStream() {
  if (!stream_) return;
#if SAMEBITS_WITH_CUDA
  try {
    cuda::stream_synchronize(stream_);
  } catch (...) {  // a destructor must not throw
  }
  cuda::stream_destroy(stream_);
#endif
}

void DeviceStream::synchronize() const {
  if (stream_) device_stream_synchronize(backend_, stream_);
}

void device_stream_synchronize(Backend b, void* stream) {
  if (b == Backend::cpu) return;
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::stream_synchronize(stream));
}

DeviceEvent::DeviceEvent(Backend backend) : backend_(backend) {
  if (backend == Backend::cpu) return;
  SAMEBITS_CUDA_OR_NOT_BUILT(event_ = cuda::event_create());
}

DeviceEvent::~DeviceEvent() {
#if SAMEBITS_WITH_CUDA
  if (event_) cuda::event_destroy(event_);
#endif
}

void DeviceEvent::record() {
  if (!event_) return;
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::event_record(event_, current_stream));
}

void DeviceEvent::wait() const {
  if (!event_) return;
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::event_synchronize(event_));
}

PinnedBuffer::PinnedBuffer(Backend backend, size_t bytes) : backend_(backend), bytes_(bytes) {
  if (backend == Backend::cpu) {
    data_ = std::malloc(bytes ? bytes : 1);
    if (!data_) throw Error("PinnedBuffer", "bytes", "out of host memory");
    return;
  }
  SAMEBITS_CUDA_OR_NOT_BUILT(data_ = cuda::pinned_alloc(bytes));
}

PinnedBuffer::~PinnedBuffer() {
  if (!data_) return;
  if (backend_ == Backend::cpu) {
    std::free(data_);
    return;
  }
#if SAMEBITS_WITH_CUDA
  cuda::pinned_free(data_);
#endif
}

void copy_async(Backend b, void* dst, const void* src, size_t bytes) {
  if (b == Backend::cpu) { std::memcpy(dst, src, bytes); return; }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::copy_async(dst, src, bytes, current_stream));
}

void* device_alloc(Backend b, size_t bytes) {
  if (b == Backend::cpu) {
    void* p = std::malloc(bytes ? bytes : 1);
    if (!p) throw Error("device_alloc", "bytes", "out of host memory");
    return p;
  }
  SAMEBITS_CUDA_OR_NOT_BUILT(return cuda::alloc(bytes, current_stream));
}

void device_free(Backend b, void* p) {
  if (b == Backend::cpu) return std::free(p);
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::free(p, current_stream));
}

void copy_to_device(Backend b, void* dst, const void* src, size_t bytes) {
  if (b == Backend::cpu) { std::memcpy(dst, src, bytes); return; }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::copy(dst, src, bytes, true, current_stream));
}

void copy_to_host(Backend b, void* dst, const void* src, size_t bytes) {
  if (b == Backend::cpu) { std::memcpy(dst, src, bytes); return; }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::copy(dst, src, bytes, false, current_stream));
}

void copy_on_device(Backend b, void* dst, const void* src, size_t bytes) {
  if (b == Backend::cpu) { std::memmove(dst, src, bytes); return; }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::copy_on_device(dst, src, bytes, current_stream));
}

void copy_blocks_on_device(Backend b, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                           size_t height) {
  if (b == Backend::cpu) {
    for (size_t i = 0; i < height; ++i)
      std::memmove(static_cast<uint8_t*>(dst) + i * dst_pitch, static_cast<const uint8_t*>(src) + i * src_pitch, width);
    return;
  }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::copy_blocks_on_device(dst, dst_pitch, src, src_pitch, width, height, current_stream));
}

void device_fill(Backend b, void* p, int byte, size_t bytes) {
  if (b == Backend::cpu) { std::memset(p, byte, bytes); return; }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::fill(p, byte, bytes, current_stream));
}

void copy_rows_indexed(Backend b, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                       const int32_t* dst_rows, const int32_t* src_rows, int64_t n) {
  if (b == Backend::cpu) {
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(static_cast<uint8_t*>(dst) + size_t(dst_rows[i]) * dst_pitch,
                  static_cast<const uint8_t*>(src) + size_t(src_rows[i]) * src_pitch, row_bytes);
    return;
  }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::copy_rows_indexed(dst, dst_pitch, src, src_pitch, row_bytes, dst_rows, src_rows, n, current_stream));
}

void copy_rows_indexed(Backend b, const RowCopy& first, const RowCopy& second, size_t row_bytes,
                       const int32_t* dst_rows, const int32_t* src_rows, int64_t n) {
  if (b == Backend::cpu) {
    for (const RowCopy* c : {&first, &second})
      copy_rows_indexed(b, c->dst, c->dst_pitch, c->src, c->src_pitch, row_bytes, dst_rows, src_rows, n);
    return;
  }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::copy_rows_indexed_pair(first, second, row_bytes, dst_rows, src_rows, n, current_stream));
}

void gather_tokens(Backend b, int32_t* dst, const int32_t* src, const int32_t* dst_rows, const int32_t* src_rows,
                   int64_t n) {
  if (b == Backend::cpu) {
    for (int64_t i = 0; i < n; ++i) dst[dst_rows[i]] = std::max(src[src_rows[i]], 0);
    return;
  }
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::gather_tokens(dst, src, dst_rows, src_rows, n, current_stream));
}

void device_memory_release(Backend b) {
  if (b == Backend::cpu) return;
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::memory_release());
}

void device_memory_info(Backend b, size_t* free, size_t* total) {
  *free = *total = 0;
  if (b == Backend::cpu) return;
  SAMEBITS_CUDA_OR_NOT_BUILT(cuda::memory_info(free, total));
}

void set_device_allocator(const ExternalAllocator& allocator) {
  if ((allocator.alloc == nullptr) != (allocator.free == nullptr))
    throw Error("set_device_allocator", "allocator", "give both alloc and free, or neither (samebits' own pool)");
#if SAMEBITS_WITH_CUDA
  cuda::set_external_allocator(allocator);
#else
  (void)allocator;  // only the CUDA backend allocates device memory
#endif
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
