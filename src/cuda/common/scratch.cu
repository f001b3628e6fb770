#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "samebits/device.hpp"

namespace samebits::cuda {
namespace {

// The installed external allocator (set_device_allocator) and what it gave that is not back yet:
// each pointer with its size, device and the allocator that gave it (a free goes back there even
// after another was installed).
struct External {
  std::mutex mu;
  ExternalAllocator installed;
  struct Block {
    size_t bytes;
    int device;
    ExternalAllocator from;
  };
  std::unordered_map<void*, Block> blocks;
  uint64_t in_use = 0, peak = 0;
};
External& external() {
  static External* e = new External;  // never destroyed: frees may come from other static destructors
  return *e;
}

// Whether work on `stream` is being captured into a graph; where the driver will not say (the legacy
// stream while another thread captures a blocking stream), as if it were: samebits' pool serves.
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

cudaMemPool_t pool_of_current_device(const char* op) {
  static std::mutex mu;
  static cudaMemPool_t pools[64] = {};
  int dev = 0;
  check(cudaGetDevice(&dev), op, "device");
  if (dev < 0 || dev >= 64) throw Error(op, "device", "device ordinal above 63 is not supported");
  std::lock_guard<std::mutex> lock(mu);
  if (pools[dev] == nullptr) {
    // Made in relaxed capture mode for this thread: the first call may come inside a capture
    // (torch.cuda.graph's global mode refuses cudaMemPoolCreate otherwise; samebits' own captures
    // make the pool before they begin: scratch_pool_ready).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    struct Restore {
      cudaStreamCaptureMode& mode;
      ~Restore() { cudaThreadExchangeStreamCaptureMode(&mode); }
    } restore{mode};
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    cudaMemPool_t pool = nullptr;
    check(cudaMemPoolCreate(&pool, &props), op, "scratch pool");
    uint64_t keep = UINT64_MAX;
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), op, "scratch pool");
    pools[dev] = pool;
  }
  return pools[dev];
}

}  // namespace

void set_external_allocator(const ExternalAllocator& allocator) {
  External& e = external();
  std::lock_guard<std::mutex> lock(e.mu);
  e.installed = allocator;
}

uint64_t external_bytes_in_use() {
  External& e = external();
  std::lock_guard<std::mutex> lock(e.mu);
  return e.in_use;
}

uint64_t external_peak_bytes(bool reset) {
  External& e = external();
  std::lock_guard<std::mutex> lock(e.mu);
  const uint64_t peak = std::max(e.peak, e.in_use);
  if (reset) e.peak = e.in_use;
  return peak;
}

uint64_t external_bytes_cached() {
  External& e = external();
  ExternalAllocator from;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    from = e.installed;
  }
  if (!from.cached) return 0;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  return uint64_t(from.cached(dev, from.user));
}

void* scratch_alloc(size_t bytes, cudaStream_t stream, const char* op) {
  bytes = bytes ? bytes : 1;
  External& e = external();
  ExternalAllocator from;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    from = e.installed;
  }
  if (from.alloc && !capturing(stream)) {  // the framework's cache (outside captures: samebits' pool)
    int dev = 0;
    check(cudaGetDevice(&dev), op, "device");
    void* p = from.alloc(bytes, dev, stream, from.user);
    if (!p)
      throw Error(op, "memory", "the installed device allocator has no " + std::to_string(bytes) + " bytes free on device " +
                                    std::to_string(dev) + " (out of device memory)");
    std::lock_guard<std::mutex> lock(e.mu);
    e.blocks[p] = {bytes, dev, from};
    e.in_use += bytes;
    e.peak = std::max(e.peak, e.in_use);
    return p;
  }
  void* p = nullptr;
  check(cudaMallocFromPoolAsync(&p, bytes, pool_of_current_device(op), stream), op, "scratch memory");
  return p;
}

void scratch_free(void* p, cudaStream_t stream, const char* op) {
  if (!p) return;
  External& e = external();
  External::Block block{};
  bool ours = false;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    const auto it = e.blocks.find(p);
    if (it != e.blocks.end()) {
      block = it->second, ours = true;
      e.in_use -= block.bytes;
      e.blocks.erase(it);
    }
  }
  if (ours) return block.from.free(p, block.device, stream, block.from.user);
  check(cudaFreeAsync(p, stream), op, "scratch memory");
}

void scratch_pool_ready(const char* op) { pool_of_current_device(op); }

void scratch_trim(const char* op) {
  check(cudaDeviceSynchronize(), op, "synchronise before the trim");
  check(cudaMemPoolTrimTo(pool_of_current_device(op), 0), op, "scratch pool");
}

uint64_t scratch_bytes_in_use(const char* op) {
  uint64_t used = 0;
  check(cudaMemPoolGetAttribute(pool_of_current_device(op), cudaMemPoolAttrUsedMemCurrent, &used), op, "scratch pool");
  return used;
}

uint64_t scratch_bytes_held(const char* op) {
  uint64_t held = 0;
  check(cudaMemPoolGetAttribute(pool_of_current_device(op), cudaMemPoolAttrReservedMemCurrent, &held), op, "scratch pool");
  return held;
}

uint64_t scratch_peak_bytes(bool reset, const char* op) {
  cudaMemPool_t pool = pool_of_current_device(op);
  uint64_t high = 0;
  check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high), op, "scratch pool");
  high = std::max(high, scratch_bytes_in_use(op));
  if (reset) {
    uint64_t zero = 0;  // the only value the mark can be reset to; it climbs again from the next allocation
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero), op, "scratch pool");
  }
  return high;
}

}  // namespace samebits::cuda
