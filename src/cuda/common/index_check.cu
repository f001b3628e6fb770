// The first out-of-range id, found by one block: each thread keeps the lowest bad index of its
// stride, then a shared-memory tree takes the minimum (exact, so no order question). No atomics.
#include <string>

#include "cuda/common/index_check.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"

namespace samebits::cuda {
namespace {

constexpr int THREADS = 1024;

__global__ void first_bad_id(const int32_t* ids, int64_t n, int64_t hi, const uint8_t* mask, bool has_allowed,
                             int32_t allowed, int64_t* out) {
  __shared__ int64_t best[THREADS];
  int64_t first = n;
  for (int64_t i = threadIdx.x; i < n && first == n; i += THREADS) {
    if (mask && mask[i] == 0) continue;
    const int32_t v = ids[i];
    if (has_allowed && v == allowed) continue;
    if (v < 0 || v >= hi) first = i;
  }
  best[threadIdx.x] = first;
  __syncthreads();
  for (int half = THREADS / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) best[threadIdx.x] = min(best[threadIdx.x], best[threadIdx.x + half]);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out[0] = best[0];
    out[1] = best[0] < n ? ids[best[0]] : 0;
  }
}

}  // namespace

void require_ids_in_range(const char* op, const char* name, const int32_t* ids, int64_t n, int64_t hi,
                          const uint8_t* mask, bool has_allowed, int32_t allowed, cudaStream_t stream) {
  if (n <= 0) return;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &capturing), op, "stream capture status");
  if (capturing != cudaStreamCaptureStatusNone) return;
  auto* scratch = static_cast<int64_t*>(scratch_alloc(2 * sizeof(int64_t), stream, op));
  first_bad_id<<<1, THREADS, 0, stream>>>(ids, n, hi, mask, has_allowed, allowed, scratch);
  int64_t found[2] = {n, 0};
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t copied = cudaMemcpyAsync(found, scratch, sizeof(found), cudaMemcpyDeviceToHost, stream);
  scratch_free(scratch, stream, op);
  check(launched, op, "id check launch");
  check(copied, op, "id check copy");
  check(cudaStreamSynchronize(stream), op, "id check");
  if (found[0] < n)
    throw Error(op, name, "value " + std::to_string(found[1]) + " at index " + std::to_string(found[0]) +
                              " is outside [0, " + std::to_string(hi) + ")");
}

}  // namespace samebits::cuda
