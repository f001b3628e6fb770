// Generic batch-invariant GEMM on tensor cores (mma.sync through WMMA; sm_80 and later).
//
// Why this shape. One kernel and one tile shape (128 x 128 x 32, eight warps of 64 x 32) serve
// every M: an output element is always produced by the same sequence of 16-deep MMA steps over K,
// in ascending K, accumulated in fp32 registers, so its bits never depend on M, on the rows around
// it, or on the SM count (rule 1-2). No split-K, no atomics (rule 3). Operands are addressed by
// strides, so the same kernel computes y = x·wᵀ (both K-contiguous) and dx = dy·w (w read along N);
// out-of-range rows / columns / K are loaded as zeros, so edge tiles need no second kernel.
// This is the portable path (sm_80); the Hopper path (gemm_sm90.cu: TMA + wgmma) takes aligned
// shapes on sm_90a, under the same per-element K order rule per architecture (rule 7).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include "cuda/common/convert.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/linear/gemm.cuh"

namespace samebits::cuda {
namespace {

using namespace nvcuda;

constexpr int BM = 128, BN = 128, BK = 32, PAD = 8, THREADS = 256;

// C[m][n] = Σ_k A(m, k)·B(n, k) (+ bias[n]); A(m, k) = a[m*sam + k*sak], B(n, k) = b[n*sbn + k*sbk].
template <class T>
__global__ void __launch_bounds__(THREADS) gemm_wmma(GemmOperands<T> p) {
  __shared__ __align__(128) T sa[BM][BK + PAD];
  __shared__ __align__(128) T sb[BN][BK + PAD];
  __shared__ __align__(128) float sc[8][16][16 + 4];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / 4, wn = warp % 4;  // warp tile: rows wm*64 .. +64, cols wn*32 .. +32
  const int64_t m0 = int64_t(blockIdx.y) * BM, n0 = int64_t(blockIdx.x) * BN;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const T zero = T(0.0f);
  for (int64_t k0 = 0; k0 < p.K; k0 += BK) {
    // Each thread loads 16 elements of each tile. Fast path: K-contiguous rows.
    for (int e = tid; e < BM * BK; e += THREADS) {
      const int r = p.a_k_contiguous ? e / BK : e % BM, c = p.a_k_contiguous ? e % BK : e / BM;
      const int64_t m = m0 + r, k = k0 + c;
      sa[r][c] = (m < p.M && k < p.K) ? p.a[m * p.sam + k * p.sak] : zero;
    }
    for (int e = tid; e < BN * BK; e += THREADS) {
      const int r = p.b_k_contiguous ? e / BK : e % BN, c = p.b_k_contiguous ? e % BK : e / BN;
      const int64_t n = n0 + r, k = k0 + c;
      sb[r][c] = (n < p.N && k < p.K) ? p.b[n * p.sbn + k * p.sbk] : zero;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb[2];
#pragma unroll
      for (int i = 0; i < 4; ++i) wmma::load_matrix_sync(fa[i], &sa[wm * 64 + i * 16][kk], BK + PAD);
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &sb[wn * 32 + j * 16][kk], BK + PAD);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
  // Epilogue: through shared memory, one 16 x 16 fragment per warp at a time; bias in fp32.
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(&sc[warp][0][0], acc[i][j], 16 + 4, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int r = e / 16, c = e % 16;
        const int64_t m = m0 + wm * 64 + i * 16 + r, n = n0 + wn * 32 + j * 16 + c;
        if (m < p.M && n < p.N) {
          float v = sc[warp][r][c];
          if (p.bias) v += to_f32(p.bias[n]);
          store_as(p.out, p.out_dtype, m * p.ldo + n, v);
        }
      }
      __syncwarp();
    }
}

}  // namespace

template <class T>
void gemm_generic(const GemmOperands<T>& p, cudaStream_t stream) {
  if (p.M == 0 || p.N == 0) return;
  const dim3 grid(unsigned((p.N + BN - 1) / BN), unsigned((p.M + BM - 1) / BM));
  gemm_wmma<T><<<grid, THREADS, 0, stream>>>(p);
  check(cudaGetLastError(), "linear (cuda)", "kernel launch");
}

template void gemm_generic<__nv_bfloat16>(const GemmOperands<__nv_bfloat16>&, cudaStream_t);
template void gemm_generic<__half>(const GemmOperands<__half>&, cudaStream_t);

}  // namespace samebits::cuda
