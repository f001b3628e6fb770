// Device-side range checks of integer ids (token ids, targets) before a kernel indexes with them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "samebits/context.hpp"

namespace samebits::cuda {

// Finds the first id of an active row (mask null or mask[i] != 0; ids equal to `allowed` skipped
// when has_allowed) outside [0, hi) and reports it as samebits::Error(op, name, "value V at index I
// is outside [0, hi)"): the same words as the CPU validator.
//  ctx.id_check == wait: synchronises the stream to read the answer, so it throws before the op
//    writes anything.
//  ctx.id_check == deferred: the answer lands in mapped host memory and is raised by the next op
//    (raise_deferred_errors), with ctx.id_note after it; this call returns at once.
// Under CUDA graph capture it cannot read an answer and is skipped. Either way the kernels
// themselves never read through an id outside the range (they write NaN or leave the row out).
void require_ids_in_range(const Context& ctx, const char* op, const char* name, const int32_t* ids, int64_t n,
                          int64_t hi, const uint8_t* mask, bool has_allowed, int32_t allowed, cudaStream_t stream);

}  // namespace samebits::cuda
