// Weight gradient dW += dYᵀ·X, batch-invariant under any micro-batching (design rule 6).
//
// Why this shape. The reduction runs over tokens, and micro-batches may split the tokens anywhere.
// The only grouping every split agrees on is none: each element adds its tokens one at a time, in
// ascending row order, starting from the value already in the fp32 accumulator, and masked
// (padding) rows are skipped rather than added as zeros (so they cannot even flip a -0 to +0).
// A 64 x 64 output tile per block stages 32-row slabs of dY and X in shared memory; each thread
// owns a 4 x 4 block of outputs. This runs on CUDA cores, not tensor cores: it is the correct
// baseline. The tensor-core version needs the K (token) chunks aligned to sequence starts so that
// splits at sequence boundaries keep every chunk; see docs/linear.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/common/convert.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/linear/gemm.cuh"

namespace samebits::cuda {
namespace {

constexpr int TILE = 64, ROWS = 32, THREADS = 256;

template <class T>
__global__ void __launch_bounds__(THREADS) weight_grad(const T* __restrict__ dy, const T* __restrict__ x,
                                                      const uint8_t* __restrict__ mask, float* __restrict__ dw,
                                                      int64_t M, int64_t N, int64_t K) {
  __shared__ float sdy[ROWS][TILE];
  __shared__ float sx[ROWS][TILE + 4];
  __shared__ uint8_t live[ROWS];
  const int tid = threadIdx.x, tn = tid / 16, tk = tid % 16;
  const int64_t n0 = int64_t(blockIdx.y) * TILE, k0 = int64_t(blockIdx.x) * TILE;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tn * 4 + i, k = k0 + tk * 4 + j;
      acc[i][j] = (n < N && k < K) ? dw[n * K + k] : 0.0f;
    }
  for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
    for (int e = tid; e < ROWS * TILE; e += THREADS) {
      const int r = e / TILE, c = e % TILE;
      const int64_t m = m0 + r;
      sdy[r][c] = (m < M && n0 + c < N) ? to_f32(dy[m * N + n0 + c]) : 0.0f;
      sx[r][c] = (m < M && k0 + c < K) ? to_f32(x[m * K + k0 + c]) : 0.0f;
    }
    if (tid < ROWS) live[tid] = (m0 + tid < M) && (mask == nullptr || mask[m0 + tid] != 0);
    __syncthreads();
    for (int r = 0; r < ROWS; ++r) {
      if (!live[r]) continue;  // uniform across the block
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = sdy[r][tn * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = sx[r][tk * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = __fmaf_rn(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tn * 4 + i, k = k0 + tk * 4 + j;
      if (n < N && k < K) dw[n * K + k] = acc[i][j];
    }
}

template <class T>
__global__ void bias_grad(const T* __restrict__ dy, const uint8_t* __restrict__ mask, float* __restrict__ db,
                          int64_t M, int64_t N) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  float acc = db[n];
  for (int64_t m = 0; m < M; ++m)
    if (mask == nullptr || mask[m] != 0) acc = __fadd_rn(acc, to_f32(dy[m * N + n]));
  db[n] = acc;
}

}  // namespace

template <class T>
void gemm_weight_grad_sequential(const T* dy, const T* x, const uint8_t* row_mask, float* dweight, float* dbias,
                                 int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  if (M > 0 && N > 0 && K > 0) {
    const dim3 grid(unsigned((K + TILE - 1) / TILE), unsigned((N + TILE - 1) / TILE));
    weight_grad<T><<<grid, THREADS, 0, stream>>>(dy, x, row_mask, dweight, M, N, K);
    check(cudaGetLastError(), "linear_backward_weight (cuda)", "kernel launch");
  }
  if (dbias && M > 0 && N > 0) {
    bias_grad<T><<<unsigned((N + 255) / 256), 256, 0, stream>>>(dy, row_mask, dbias, M, N);
    check(cudaGetLastError(), "linear_backward_weight (cuda)", "bias kernel launch");
  }
}

template void gemm_weight_grad_sequential<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, const uint8_t*,
                                                         float*, float*, int64_t, int64_t, int64_t, cudaStream_t);
template void gemm_weight_grad_sequential<__half>(const __half*, const __half*, const uint8_t*, float*, float*, int64_t,
                                                  int64_t, int64_t, cudaStream_t);

}  // namespace samebits::cuda
