// Host-to-device uploads of the small tables a kernel reads (attention's work tables, a paged
// cache's block table) without the host waiting for the GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <initializer_list>

namespace samebits::cuda {

// Copies `bytes` from host memory at `src` to device memory at `dst`, ordered on `stream`; `src` may
// be reused as soon as this returns. The host waits only when it runs a whole staging ring (4 MiB a
// device, grown for larger tables) ahead of the GPU. While `stream` is being captured into a CUDA
// graph it throws samebits::Error: the graph's copy would read the host memory again at every
// replay, after the caller has freed or rewritten it (samebits' own decode graphs re-plan their
// attention tables before each replay instead: cuda/attention/attention_sm90.hpp).
void upload_to_device(void* dst, const void* src, size_t bytes, cudaStream_t stream, const char* op, const char* what);
// The same for several host pieces laid back to back at `dst` (one ring slot, one copy).
struct HostPiece {
  const void* data;
  size_t bytes;
};
void upload_to_device(void* dst, std::initializer_list<HostPiece> pieces, cudaStream_t stream, const char* op,
                      const char* what);

}  // namespace samebits::cuda
