// Device-side range checks of integer ids (token ids, targets) before a kernel indexes with them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace samebits::cuda {

// Throws samebits::Error(op, name, "value V at index I is outside [0, hi)") for the first id of an
// active row (mask null or mask[i] != 0; ids equal to `allowed` skipped when has_allowed) outside
// [0, hi): the same words as the CPU validator. Synchronises the stream to read the answer, so it
// runs before the op writes anything. Under CUDA graph capture it cannot synchronise and is skipped;
// the kernels themselves never read through an id outside the range (they write NaN or zeros).
void require_ids_in_range(const char* op, const char* name, const int32_t* ids, int64_t n, int64_t hi,
                          const uint8_t* mask, bool has_allowed, int32_t allowed, cudaStream_t stream);

}  // namespace samebits::cuda
