// The Hopper (sm_90a) attention forward, called by attention_forward.cu where the device has it.
#pragma once
#include <cuda_runtime.h>

#include "cuda/attention/attention_common.cuh"
#include "samebits/ops.hpp"

namespace samebits::cuda::attention {

// Keys are combined in spans of this many, aligned to key position 0 (split-KV boundaries).
constexpr int ATTENTION_SPLIT_KEYS = 1024;

// Runs the rows the sequence table covers (the caller clears the others); arguments already checked,
// `pages` (a device copy of the block table, if any) made by the caller.
void attention_forward_sm90(const AttentionForwardArgs& a, const KeyPages& pages, cudaStream_t stream, const char* op);

}  // namespace samebits::cuda::attention
