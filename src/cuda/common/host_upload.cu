// Why a ring of page-locked memory: a cudaMemcpyAsync from pageable memory goes through the
// driver's own staging and may wait for the stream to reach the copy. Measured (H100, session 23):
// samebits.torch.attention's host time equalled its kernel time (576 µs against torch SDPA's 34 µs
// while the GPU was busy ahead), so a Python loop could never run ahead of the GPU. Here the bytes
// are copied into a per-device ring of page-locked memory, sent with an asynchronous copy, and an
// event recorded after it; a slot is written again only once its event has completed. Records are
// taken in ring order, so the oldest record in flight is always the next one in the way.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "cuda/common/host_upload.cuh"
#include "cuda/common/runtime.cuh"

namespace samebits::cuda {
namespace {

constexpr size_t ALIGN = 256, FIRST_CAPACITY = size_t(4) << 20;

struct Sent {
  size_t begin, end;  // bytes [begin, end) of the ring
  cudaEvent_t done;   // recorded after the copy that reads them
};

struct Ring {
  std::mutex mutex;
  uint8_t* base = nullptr;  // page-locked, never freed while a copy may read it
  size_t capacity = 0;
  std::deque<Sent> in_flight;  // oldest first
  std::vector<cudaEvent_t> spare;

  void retire_finished(const char* op) {
    while (!in_flight.empty()) {
      const cudaError_t e = cudaEventQuery(in_flight.front().done);
      if (e == cudaErrorNotReady) return;
      check(e, op, "a table upload's event");
      spare.push_back(in_flight.front().done);
      in_flight.pop_front();
    }
  }
  void wait_oldest(const char* op) {
    check(cudaEventSynchronize(in_flight.front().done), op, "a table upload's event");
    spare.push_back(in_flight.front().done);
    in_flight.pop_front();
  }
  // Room for `n` bytes (a multiple of ALIGN): its offset in the ring.
  size_t reserve(size_t n, const char* op) {
    if (n > capacity / 2) grow(n, op);
    for (;;) {
      retire_finished(op);
      if (in_flight.empty()) return 0;
      const Sent &oldest = in_flight.front(), &newest = in_flight.back();
      if (newest.begin >= oldest.begin) {  // in use: [oldest.begin, newest.end)
        if (capacity - newest.end >= n) return newest.end;
        if (oldest.begin >= n) return 0;
      } else if (oldest.begin - newest.end >= n) {  // wrapped: free is [newest.end, oldest.begin)
        return newest.end;
      }
      wait_oldest(op);
    }
  }
  void grow(size_t n, const char* op) {
    while (!in_flight.empty()) wait_oldest(op);
    size_t bigger = capacity ? capacity : FIRST_CAPACITY;
    while (bigger / 2 < n) bigger *= 2;
    void* p = nullptr;
    check(cudaHostAlloc(&p, bigger, cudaHostAllocDefault), op, "page-locked memory for table uploads");
    if (base) cudaFreeHost(base);  // no copy reads it: every one in flight has completed
    base = static_cast<uint8_t*>(p), capacity = bigger;
  }
  cudaEvent_t event(const char* op) {
    if (spare.empty()) {
      cudaEvent_t e = nullptr;
      check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), op, "event");
      return e;
    }
    cudaEvent_t e = spare.back();
    spare.pop_back();
    return e;
  }
};

// One ring a device (its events belong to that device); never destroyed (process exit may come
// after the CUDA context is gone).
constexpr int MAX_DEVICES = 64;
Ring* ring_of(int device) {
  static Ring* rings = new Ring[MAX_DEVICES];
  return device >= 0 && device < MAX_DEVICES ? &rings[device] : nullptr;
}

}  // namespace

void upload_to_device(void* dst, const void* src, size_t bytes, cudaStream_t stream, const char* op, const char* what) {
  upload_to_device(dst, {HostPiece{src, bytes}}, stream, op, what);
}

void upload_to_device(void* dst, std::initializer_list<HostPiece> pieces, cudaStream_t stream, const char* op,
                      const char* what) {
  size_t bytes = 0;
  for (const HostPiece& p : pieces) bytes += p.bytes;
  if (bytes == 0) return;
  int device = 0;
  check(cudaGetDevice(&device), op, "current device");
  Ring* ring = ring_of(device);
  if (stream_capturing(stream, op))
    throw Error(op, what,
                "a table in host memory cannot be captured into a CUDA graph (the graph would copy it again at "
                "every replay, after this call has freed it): run the call outside the capture");
  if (ring == nullptr) {  // a device index past the rings': the driver's own staging
    auto* to = static_cast<uint8_t*>(dst);
    for (const HostPiece& p : pieces) {
      check(cudaMemcpyAsync(to, p.data, p.bytes, cudaMemcpyHostToDevice, stream), op, what);
      to += p.bytes;
    }
    return;
  }
  const size_t n = (bytes + ALIGN - 1) / ALIGN * ALIGN;
  std::lock_guard<std::mutex> lock(ring->mutex);
  const size_t at = ring->reserve(n, op);
  size_t filled = 0;
  for (const HostPiece& p : pieces) {
    if (p.bytes) std::memcpy(ring->base + at + filled, p.data, p.bytes);
    filled += p.bytes;
  }
  check(cudaMemcpyAsync(dst, ring->base + at, bytes, cudaMemcpyHostToDevice, stream), op, what);
  const cudaEvent_t done = ring->event(op);
  if (const cudaError_t e = cudaEventRecord(done, stream); e != cudaSuccess) {
    cudaStreamSynchronize(stream);  // the slot is free once the copy is done
    ring->spare.push_back(done);
    check(e, op, "a table upload's event");
  }
  ring->in_flight.push_back({at, at + n, done});
}

}  // namespace samebits::cuda
