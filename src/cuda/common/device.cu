// CUDA backend runtime: device discovery. The op families (gemm/, attention/, norm/, logprob/,
// embedding/, elementwise/) each register their kernels from their own folder through
// SAMEBITS_REGISTER_KERNEL (src/ops/registry.hpp); until one lands, its ops report NotBuilt.
#include <cuda_runtime.h>

namespace samebits::cuda {

bool device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
}

}  // namespace samebits::cuda
