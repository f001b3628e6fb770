#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>

#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"

namespace samebits::cuda {
namespace {

cudaMemPool_t pool_of_current_device(const char* op) {
  static std::mutex mu;
  static cudaMemPool_t pools[64] = {};
  int dev = 0;
  check(cudaGetDevice(&dev), op, "device");
  if (dev < 0 || dev >= 64) throw Error(op, "device", "device ordinal above 63 is not supported");
  std::lock_guard<std::mutex> lock(mu);
  if (pools[dev] == nullptr) {
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

void* scratch_alloc(size_t bytes, cudaStream_t stream, const char* op) {
  void* p = nullptr;
  check(cudaMallocFromPoolAsync(&p, bytes ? bytes : 1, pool_of_current_device(op), stream), op, "scratch memory");
  return p;
}

void scratch_free(void* p, cudaStream_t stream, const char* op) {
  if (p) check(cudaFreeAsync(p, stream), op, "scratch memory");
}

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
