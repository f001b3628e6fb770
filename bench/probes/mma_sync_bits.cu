// Whether mma.sync.m16n8k16 gives wgmma.m64nNk16's bits on this card (a probe: target
// bench_mma_sync_bits; usage: build/bench_mma_sync_bits [trials]).
//
// Why this program. A decode step's attention at small batches multiplies 64-row wgmma tiles of
// which only the GQA group's few rows are real (4 of 64 for Qwen3-8B at B = 1): its S product runs
// at a sixteenth of its use. mma.sync works on 16-row tiles; a decode kernel built on it would be
// allowed only if every element comes out with the bits the prefill's wgmma gives, since
// prefill = decode bit for bit is the rule. Both instructions accumulate k16 steps in ascending
// order into fp32 registers; whether the tensor core's k16 dot product plus accumulator rounds
// alike in both is not documented. This program computes D = C + A·B over K/16 steps three ways —
// wgmma with A from shared memory, wgmma with A from registers, and a chain of mma.sync per warp
// (its 16 rows, every n8 tile) — on the same random operands (bf16 and f16; ordinary values and
// values whose exponents spread over ±30 binades, where alignment and truncation inside the dot
// product show), and counts the elements whose bits differ.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda/common/sm90/primitives.cuh"

namespace {

using namespace samebits::cuda::sm90;

constexpr int M = 64, N = 32, K = 128, BOX_K = 64, BOXES = K / BOX_K;

// Element (r, k) of a K-major tile of 64-element (128-byte) rows with the 128-byte swizzle, as TMA
// writes it and smem_desc describes it: 16-byte chunk c of row r lands at chunk c ^ (r % 8).
__device__ __forceinline__ int swizzled(int r, int k) {
  const int chunk = (k * 2) / 16, within = (k * 2) % 16;
  return r * 128 + ((chunk ^ (r % 8)) * 16) + within;  // bytes
}

template <class T>
__device__ __forceinline__ uint32_t pack_pair(const T* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <class T>
__device__ __forceinline__ void mma_sync_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// a: [M, K] row-major, b: [N, K] row-major (the GEMM's w), c: [M, N] fp32; outputs [3][M, N].
template <class T>
__global__ void __launch_bounds__(128, 1) three_ways(const T* a, const T* b, const float* c, float* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ alignas(1024) uint8_t sa[BOXES][M * 128];
  __shared__ alignas(1024) uint8_t sb[BOXES][N * 128];
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  for (int i = t; i < M * K; i += 128) {
    const int r = i / K, k = i % K;
    std::memcpy(&sa[k / BOX_K][swizzled(r, k % BOX_K)], &a[i], sizeof(T));
  }
  for (int i = t; i < N * K; i += 128) {
    const int r = i / K, k = i % K;
    std::memcpy(&sb[k / BOX_K][swizzled(r, k % BOX_K)], &b[i], sizeof(T));
  }
  fence_async_shared();
  __syncthreads();
  const int r0 = warp * 16 + lane / 4, q = lane % 4;
  // The m16n8k16 A fragment of this warp's rows at k-step s (also wgmma RS's A operand).
  auto a_frag = [&](int s, uint32_t (&f)[4]) {
    const int k0 = s * 16 + 2 * q;
    f[0] = pack_pair(&a[r0 * K + k0]);
    f[1] = pack_pair(&a[(r0 + 8) * K + k0]);
    f[2] = pack_pair(&a[r0 * K + k0 + 8]);
    f[3] = pack_pair(&a[(r0 + 8) * K + k0 + 8]);
  };
  auto load_c = [&](float (&d)[N / 2]) {
    for (int j = 0; j < N / 8; ++j)
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 2; ++e) d[j * 4 + h * 2 + e] = c[(r0 + 8 * h) * N + 8 * j + 2 * q + e];
  };
  auto store = [&](int way, const float (&d)[N / 2]) {
    for (int j = 0; j < N / 8; ++j)
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 2; ++e) out[way * M * N + (r0 + 8 * h) * N + 8 * j + 2 * q + e] = d[j * 4 + h * 2 + e];
  };
  {  // wgmma, A and B from shared memory (the prefill's S = Q·Kᵀ)
    float d[N / 2];
    load_c(d);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int s = 0; s < K / 16; ++s) {
      const int box = s / (BOX_K / 16), kk = s % (BOX_K / 16);
      Wgmma<T, false, false, N>::mma(d, smem_desc(sa[box]) + uint64_t(kk * 2), smem_desc(sb[box]) + uint64_t(kk * 2), 1);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    store(0, d);
  }
  {  // wgmma, A from registers
    float d[N / 2];
    load_c(d);
    uint32_t f[K / 16][4];
#pragma unroll
    for (int s = 0; s < K / 16; ++s) a_frag(s, f[s]);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int s = 0; s < K / 16; ++s) {
      const int box = s / (BOX_K / 16), kk = s % (BOX_K / 16);
      WgmmaRS<T, false, N>::mma(d, f[s], smem_desc(sb[box]) + uint64_t(kk * 2));
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    store(1, d);
  }
  {  // mma.sync: this warp's 16 rows, every n8 tile, the k-steps in ascending order
    float d[N / 2];
    load_c(d);
    for (int s = 0; s < K / 16; ++s) {
      uint32_t f[4];
      a_frag(s, f);
      for (int j = 0; j < N / 8; ++j) {
        const int n = 8 * j + lane / 4, k0 = s * 16 + 2 * q;
        const uint32_t bf[2] = {pack_pair(&b[n * K + k0]), pack_pair(&b[n * K + k0 + 8])};
        float dj[4] = {d[j * 4], d[j * 4 + 1], d[j * 4 + 2], d[j * 4 + 3]};
        mma_sync_16816<T>(dj, f, bf);
        for (int e = 0; e < 4; ++e) d[j * 4 + e] = dj[e];
      }
    }
    store(2, d);
  }
#endif
}

template <class T>
T to_t(float v) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) return __float2bfloat16(v);
  else return __float2half(v);
}

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "mma_sync_bits: %s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

// Returns the elements (of trials × M × N) whose bits differ: {wgmma SS vs RS, wgmma SS vs mma.sync}.
template <class T>
std::pair<long, long> run(int trials, bool spread, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), ex(spread ? -30.0f : 0.0f, spread ? 30.0f : 0.0f);
  const float cap = std::is_same<T, __half>::value ? 15.0f : 30.0f;  // f16's range
  auto value = [&] {
    const float e = std::fmin(std::fmax(ex(g), -cap), cap);
    return u(g) * std::exp2(std::round(e));
  };
  std::vector<T> a(M * K), b(N * K);
  std::vector<float> c(M * N), out(3 * M * N);
  T *da, *db;
  float *dc, *dout;
  CHECK(cudaMalloc(&da, a.size() * sizeof(T)));
  CHECK(cudaMalloc(&db, b.size() * sizeof(T)));
  CHECK(cudaMalloc(&dc, c.size() * sizeof(float)));
  CHECK(cudaMalloc(&dout, out.size() * sizeof(float)));
  long rs = 0, sync = 0;
  for (int trial = 0; trial < trials; ++trial) {
    for (auto& v : a) v = to_t<T>(value());
    for (auto& v : b) v = to_t<T>(value());
    for (auto& v : c) v = trial % 2 ? 0.0f : value();
    CHECK(cudaMemcpy(da, a.data(), a.size() * sizeof(T), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, b.data(), b.size() * sizeof(T), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dc, c.data(), c.size() * sizeof(float), cudaMemcpyHostToDevice));
    three_ways<T><<<1, 128>>>(da, db, dc, dout);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(out.data(), dout, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    for (int i = 0; i < M * N; ++i) {
      rs += std::memcmp(&out[i], &out[M * N + i], 4) != 0;
      sync += std::memcmp(&out[i], &out[2 * M * N + i], 4) != 0;
    }
    if (trial == 0) {  // the arithmetic ran: an fp64 check of one element
      double ref = c[0];
      for (int k = 0; k < K; ++k) {
        float av, bv;
        if constexpr (std::is_same<T, __nv_bfloat16>::value) av = __bfloat162float(a[k]), bv = __bfloat162float(b[k]);
        else av = __half2float(a[k]), bv = __half2float(b[k]);
        ref += double(av) * double(bv);
      }
      if (!spread && std::fabs(ref - out[0]) > 1e-3 * (1.0 + std::fabs(ref))) {
        std::fprintf(stderr, "mma_sync_bits: D[0,0] = %g, fp64 %g: the kernel did not compute\n", out[0], ref);
        std::exit(1);
      }
    }
  }
  cudaFree(da), cudaFree(db), cudaFree(dc), cudaFree(dout);
  return {rs, sync};
}

}  // namespace

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::atoi(argv[1]) : 200;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("mma_sync_bits on %s: D = C + A·B, M %d N %d K %d (%d k16 steps), %d trials a case\n", prop.name, M, N, K,
              K / 16, trials);
  long total = 0;
  for (int spread = 0; spread < 2; ++spread) {
    const auto bf = run<__nv_bfloat16>(trials, spread, 1234 + spread);
    const auto hf = run<__half>(trials, spread, 5678 + spread);
    const long n = long(trials) * M * N;
    std::printf("  %-22s bf16: wgmma SS vs RS %ld, vs mma.sync %ld of %ld | f16: %ld, %ld of %ld\n",
                spread ? "exponents over ±30:" : "values in (-1, 1):", bf.first, bf.second, n, hf.first, hf.second, n);
    total += bf.first + bf.second + hf.first + hf.second;
  }
  std::printf("%s\n", total == 0 ? "mma_sync_bits: mma.sync gives wgmma's bits" : "mma_sync_bits: the bits differ");
  return total == 0 ? 0 : 3;
}
