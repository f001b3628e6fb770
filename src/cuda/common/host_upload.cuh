// Host-to-device uploads of the small tables a kernel reads (attention's work tables, a paged
// cache's block table) without the host waiting for the GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace samebits::cuda {

// Copies `bytes` from host memory at `src` to device memory at `dst`, ordered on `stream`; `src` may
// be reused as soon as this returns. The host waits only when it runs a whole staging ring (4 MiB a
// device, grown for larger tables) ahead of the GPU. Inside a stream capture: a plain asynchronous
// copy (a graph's copy node must not read a ring slot later calls rewrite).
void upload_to_device(void* dst, const void* src, size_t bytes, cudaStream_t stream, const char* op, const char* what);

}  // namespace samebits::cuda
