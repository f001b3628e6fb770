// CUDA backend runtime: device discovery and memory. The op families (gemm/, attention/, norm/,
// logprob/, embedding/, elementwise/) each register their kernels from their own folder through
// SAMEBITS_REGISTER_KERNEL (src/ops/registry.hpp); until one lands, its ops report NotBuilt.
#include <cuda_runtime.h>

#include "cuda/common/pdl.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "samebits/device.hpp"

namespace samebits::cuda {

bool device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
}

// Device memory from samebits' stream-ordered pool (scratch.cuh), ordered on the caller's stream
// (the legacy default stream unless a DeviceStreamScope names another): the model chain allocates
// every activation of a step, and cudaMalloc / cudaFree would synchronise the device at each one.
// Memory freed here is reused by later work on that stream (and on every blocking stream, which the
// legacy stream waits for). Inside a stream capture the allocation becomes the graph's own.
namespace {
cudaStream_t or_legacy(void* s) { return s ? static_cast<cudaStream_t>(s) : cudaStreamLegacy; }

bool is_pinned(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}
}  // namespace

void* alloc(size_t bytes, void* stream) { return scratch_alloc(bytes ? bytes : 1, or_legacy(stream), "device_alloc"); }

void free(void* p, void* stream) {
  try {
    scratch_free(p, or_legacy(stream), "device_free");
  } catch (...) {  // freeing must not throw (destructors); the pool keeps the memory
  }
}

// On the legacy stream as before (cudaMemcpy). On another stream, ordered on it without draining it:
// to the device from pageable memory the copy is staged before the call returns; from pinned memory,
// which the caller may reuse at once, the call waits for the copy. To the host it waits (the caller
// reads the bytes next).
void copy(void* dst, const void* src, size_t bytes, bool to_device, void* stream) {
  const char* what = to_device ? "host to device" : "device to host";
  if (!stream) {
    check(cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost), "device copy", what);
    return;
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  check(cudaMemcpyAsync(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, s), "device copy", what);
  if (!to_device || is_pinned(src)) check(cudaStreamSynchronize(s), "device copy", what);
}

void copy_async(void* dst, const void* src, size_t bytes, void* stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, or_legacy(stream)), "device copy", "asynchronous");
}

void copy_on_device(void* dst, const void* src, size_t bytes, void* stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, or_legacy(stream)), "device copy", "device to device");
}

void copy_blocks_on_device(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                           void* stream) {
  check(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDeviceToDevice, or_legacy(stream)),
        "device copy", "blocks, device to device");
}

// One CTA a row of a pair (blockIdx.y); 16-byte moves where the row, both pitches and both bases
// allow, else bytes.
struct RowCopies {
  uint8_t* dst[2];
  const uint8_t* src[2];
  size_t dst_pitch[2], src_pitch[2];
  bool wide[2];
};

__global__ void copy_rows_kernel(const __grid_constant__ RowCopies c, size_t row_bytes, const int32_t* dst_rows,
                                 const int32_t* src_rows) {
  pdl_wait();  // launched after the previous kernel (cuda/common/pdl.cuh): its output is ready from here
  pdl_launch_dependents();
  const int k = blockIdx.y;
  uint8_t* d = c.dst[k] + size_t(dst_rows[blockIdx.x]) * c.dst_pitch[k];
  const uint8_t* s = c.src[k] + size_t(src_rows[blockIdx.x]) * c.src_pitch[k];
  if (c.wide[k]) {
    for (size_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
  } else {
    for (size_t i = threadIdx.x; i < row_bytes; i += blockDim.x) d[i] = s[i];
  }
}

static void copy_row_pairs(const RowCopy* copies, int count, size_t row_bytes, const int32_t* dst_rows,
                    const int32_t* src_rows, int64_t n, void* stream) {
  if (n <= 0 || row_bytes == 0) return;
  RowCopies c{};
  for (int k = 0; k < count; ++k) {
    c.dst[k] = static_cast<uint8_t*>(copies[k].dst);
    c.src[k] = static_cast<const uint8_t*>(copies[k].src);
    c.dst_pitch[k] = copies[k].dst_pitch;
    c.src_pitch[k] = copies[k].src_pitch;
    c.wide[k] = (row_bytes | copies[k].dst_pitch | copies[k].src_pitch | reinterpret_cast<uintptr_t>(copies[k].dst) |
                 reinterpret_cast<uintptr_t>(copies[k].src)) % 16 == 0;
  }
  launch_after_previous(copy_rows_kernel, dim3(unsigned(n), unsigned(count)), dim3(128), 0, or_legacy(stream),
                        "device copy", c, row_bytes, dst_rows, src_rows);
}

void copy_rows_indexed(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                       const int32_t* dst_rows, const int32_t* src_rows, int64_t n, void* stream) {
  const RowCopy one{dst, dst_pitch, src, src_pitch};
  copy_row_pairs(&one, 1, row_bytes, dst_rows, src_rows, n, stream);
}

void copy_rows_indexed_pair(const RowCopy& first, const RowCopy& second, size_t row_bytes, const int32_t* dst_rows,
                            const int32_t* src_rows, int64_t n, void* stream) {
  const RowCopy both[2] = {first, second};
  copy_row_pairs(both, 2, row_bytes, dst_rows, src_rows, n, stream);
}

__global__ void gather_tokens_kernel(int32_t* dst, const int32_t* src, const int32_t* dst_rows, const int32_t* src_rows,
                                     int64_t n) {
  pdl_wait();  // its dependents (the graph replay) start after it ends: it lets none start early
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[dst_rows[i]] = max(src[src_rows[i]], 0);
}

void gather_tokens(int32_t* dst, const int32_t* src, const int32_t* dst_rows, const int32_t* src_rows, int64_t n,
                   void* stream) {
  if (n <= 0) return;
  launch_after_previous(gather_tokens_kernel, dim3(unsigned((n + 127) / 128)), dim3(128), 0, or_legacy(stream),
                        "gather tokens", dst, src, dst_rows, src_rows, n);
}

void fill(void* p, int byte, size_t bytes, void* stream) {
  check(cudaMemsetAsync(p, byte, bytes, or_legacy(stream)), "device fill", "bytes");
}

size_t memory_peak(bool reset) {
  return size_t(scratch_peak_bytes(reset, "device_memory_peak") + external_peak_bytes(reset));
}
size_t memory_in_use() { return size_t(scratch_bytes_in_use("device_memory_in_use") + external_bytes_in_use()); }
void memory_release() { scratch_trim("device_memory_release"); }
void memory_info(size_t* free, size_t* total) {
  check(cudaMemGetInfo(free, total), "device_memory_info", "cudaMemGetInfo");
  const uint64_t held = scratch_bytes_held("device_memory_info"), used = scratch_bytes_in_use("device_memory_info");
  if (held > used) *free += size_t(held - used);
  *free += size_t(external_bytes_cached());  // what an installed allocator (PyTorch's) keeps unused
}

void synchronize() { check(cudaDeviceSynchronize(), "device_synchronize", "kernel"); }

// A blocking stream: its work is ordered with the legacy default stream's (PyTorch's default), so
// a caller's tensors written there are ready for it, and it for them; unlike the legacy stream it
// can be captured into a graph.
void* stream_create() {
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamDefault), "device_stream", "create");
  return s;
}

void stream_destroy(void* s) {
  if (s) cudaStreamDestroy(static_cast<cudaStream_t>(s));
}

void stream_synchronize(void* s) { check(cudaStreamSynchronize(or_legacy(s)), "device_stream", "synchronise"); }

void* event_create() {
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "device_event", "create");
  return e;
}

void event_destroy(void* e) {
  if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

void event_record(void* e, void* s) { check(cudaEventRecord(static_cast<cudaEvent_t>(e), or_legacy(s)), "device_event", "record"); }

void event_synchronize(void* e) { check(cudaEventSynchronize(static_cast<cudaEvent_t>(e)), "device_event", "wait"); }

void* pinned_alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMallocHost(&p, bytes ? bytes : 1), "pinned_host_alloc", "page-locked host memory");
  return p;
}

void pinned_free(void* p) {
  if (p) cudaFreeHost(p);
}

}  // namespace samebits::cuda
