// How long a chain of dependent wgmma steps takes on this card: the floor under a batch-invariant
// GEMM call with a long reduction and few rows (the down projection at decode sizes).
//
// Why this program. Without split-K an output element's K reduction is one chain of K / 16
// wgmma.m64nNk16 steps into the same fp32 registers, each waiting for the one before, so no call
// can finish faster than (K / 16) x the latency of one dependent step, however many CTAs stream
// the weight. This kernel runs exactly that chain, as the GEMM kernels issue it (four steps a
// commit group, one group kept in flight), with both operands already in shared memory (no loads)
// on one warpgroup per SM, and reports the time per step. Usage: build/bench_wgmma_chain [steps]
// (a probe: bench/probes/wgmma_chain.cu, target bench_wgmma_chain)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "cuda/common/sm90/primitives.cuh"

namespace {

using namespace samebits::cuda::sm90;

template <int N>
__global__ void __launch_bounds__(128, 1) dependent_chain(int groups, float* sink) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ alignas(1024) __nv_bfloat16 a[64 * 64], b[N * 64];  // K-major 64-wide rows, 128B swizzle
  for (int i = threadIdx.x; i < 64 * 64; i += 128) a[i] = __float2bfloat16(0.001f * (i % 7));
  for (int i = threadIdx.x; i < N * 64; i += 128) b[i] = __float2bfloat16(0.001f * (i % 5));
  fence_async_shared();
  __syncthreads();
  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
  const uint64_t da = smem_desc(a), db = smem_desc(b);
  for (int g = 0; g < groups; ++g) {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) Wgmma<__nv_bfloat16, false, false, N>::mma(d, da + uint64_t(kk * 2), db + uint64_t(kk * 2), 1);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += d[i];
  if (s == 12345.0f) sink[threadIdx.x] = s;  // keeps the chain alive; never true for these inputs
#endif
}

template <int N>
void measure(int steps, int sms, float* sink) {
  const int groups = steps / 4;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int rep = 0; rep < 7; ++rep) {
    cudaEventRecord(e0);
    dependent_chain<N><<<sms, 128>>>(groups, sink);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, e0, e1);
    if (rep > 0 && ms < best) best = ms;  // the first call warms up
  }
  if (cudaGetLastError() != cudaSuccess) {
    std::fprintf(stderr, "launch failed\n");
    std::exit(1);
  }
  std::printf("m64n%dk16: %d dependent steps on %d SMs: %.3f ms, %.1f ns a step\n", N, groups * 4, sms, best,
              1e6 * best / (groups * 4));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 896 * 16;  // 16 x the down projection's K / 16
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (prop.major != 9) {
    std::printf("needs an sm_90 GPU (found %s)\n", prop.name);
    return 0;
  }
  float* sink = nullptr;
  cudaMalloc(&sink, 128 * sizeof(float));
  std::printf("card: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  measure<64>(steps, prop.multiProcessorCount, sink);
  measure<128>(steps, prop.multiProcessorCount, sink);
  measure<256>(steps, prop.multiProcessorCount, sink);
  cudaFree(sink);
  return 0;
}
