// The chaining kernel of the norms' dweight (dweight_chunks.cuh says why it is shaped so).
#include "cuda/norm/dweight_chunks.cuh"

#include "cuda/common/runtime.cuh"

namespace samebits::cuda::norm {

namespace {
// A CTA takes 32 columns; warp w sums ranges w, w + CHAIN_WARPS, …; warp 0 then chains them.
constexpr int CHAIN_WARPS = 16;
__global__ void __launch_bounds__(CHAIN_WARPS * 32) chain_partials(const float* __restrict__ partials, const __grid_constant__ RangeTable
                                                      ranges, int64_t width, float* __restrict__ dweight) {
  __shared__ float range_sum[MAX_RANGES][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col = int64_t(blockIdx.x) * 32 + lane;
  if (col < width)
    for (int r = warp; r < ranges.n; r += CHAIN_WARPS) {
      const int64_t first = ranges.first[r];
      const int count = ranges.count[r];
      float v[RANGE_CHUNKS];  // all loads in flight at once, then the sum in order
#pragma unroll
      for (int c = 0; c < RANGE_CHUNKS; ++c) v[c] = c < count ? partials[(first + c) * width + col] : 0.0f;
      float s = v[0];
#pragma unroll
      for (int c = 1; c < RANGE_CHUNKS; ++c) s = c < count ? __fadd_rn(s, v[c]) : s;
      range_sum[r][lane] = s;
    }
  __syncthreads();
  if (warp == 0 && col < width) {
    float acc = dweight[col];
    for (int r = 0; r < ranges.n; ++r) acc = __fadd_rn(acc, range_sum[r][lane]);
    dweight[col] = acc;
  }
}

}  // namespace

void chain_after_chunks(const float* partials, const RangeTable& ranges, int64_t width, float* dweight,
                        cudaStream_t stream, const char* op) {
  check(cudaGetLastError(), op, "kernel launch");
  if (ranges.n == 0) return;
  chain_partials<<<unsigned((width + 31) / 32), CHAIN_WARPS * 32, 0, stream>>>(partials, ranges, width, dweight);
  check(cudaGetLastError(), op, "chain kernel launch");
}

}  // namespace samebits::cuda::norm
