// Stream-ordered scratch memory for the kernels' temporaries (sort keys, row masks, check results).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace samebits::cuda {

// From samebits' own memory pool on the current device, which keeps freed memory for reuse: the
// default pool hands its memory back at every synchronisation, and mapping it again costs ~0.1 ms
// a call. The pool is created once per device; the caller's pools and settings are not touched.
void* scratch_alloc(size_t bytes, cudaStream_t stream, const char* op);
void scratch_free(void* p, cudaStream_t stream, const char* op);

}  // namespace samebits::cuda
