// CUDA runtime helpers shared by the op families: error checks that raise samebits::Error.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "samebits/error.hpp"

namespace samebits::cuda {

inline void check(cudaError_t e, const char* op, const char* what) {
  if (e != cudaSuccess) throw Error(op, what, std::string("CUDA error: ") + cudaGetErrorString(e));
}

inline cudaStream_t stream_of(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace samebits::cuda
