// The host-side check the logprob family runs before writing anything: one row per token fits
// the kernels' 32-bit grids, and every unmasked target (other than ignore_index) is a vocab column
// (a device check that raises samebits::Error naming the value and its index).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/index_check.cuh"
#include "samebits/error.hpp"
#include "samebits/tensor.hpp"

namespace samebits::cuda {

inline void check_rows_and_targets(const Context& ctx, const char* op, const char* rows_name, int64_t rows, int64_t vocab,
                                   const TensorView& targets, const TensorView& mask, int32_t ignore,
                                   cudaStream_t stream) {
  if (rows > INT32_MAX)
    throw Unsupported(op, rows_name, "more than 2^31 - 1 rows in one call is not supported");
  require_ids_in_range(ctx, op, "targets", targets.as<const int32_t>(), rows, vocab,
                       mask.present() ? mask.as<const uint8_t>() : nullptr, true, ignore, stream);
}

// The rows, and the targets' range unless the caller vouches for it (Args::targets_checked: no
// range check, no read-back).
template <class Args>
void check_targets_of(const Context& ctx, const char* op, const char* rows_name, int64_t rows, int64_t vocab, const Args& a,
                      cudaStream_t stream) {
  if (!a.targets_checked) return check_rows_and_targets(ctx, op, rows_name, rows, vocab, a.targets, a.loss_mask,
                                                        a.ignore_index, stream);
  if (rows > INT32_MAX) throw Unsupported(op, rows_name, "more than 2^31 - 1 rows in one call is not supported");
}

}  // namespace samebits::cuda
