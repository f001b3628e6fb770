// Hopper (sm_90a) weight gradient dW[N,K] += dYᵀ·X on tensor cores, invariant under micro-batching.
//
// Why this shape. The reduction runs over tokens, and wgmma adds them in groups of 16. For one
// batch and any split of it into micro-batches (at sequence boundaries, packed or padded) to give
// the same bits, every token must land in the same group with the same partners. So groups are
// anchored to sequences: each segment (sequence) is cut into chunks of 64 rows from its first row,
// a chunk runs ceil(valid/16) k16 steps, and rows past the segment's end or masked out are zeroed in
// shared memory before the MMAs read them (finite inputs, so zero products are exact). The fp32
// accumulator tile is loaded from dW, the chunks are applied in segment order, and the tile is stored
// back: a micro-batch continues exactly where the previous one stopped. Rows outside every segment
// are never read. Same producer / consumer pipeline as the forward kernel; both operands are read
// along their output dimension (dYᵀ and X are M- and N-major), 128 x 256 tiles of dW.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <mutex>
#include <type_traits>
#include <vector>

#include "cuda/common/runtime.cuh"
#include "cuda/gemm/gemm.cuh"
#include "cuda/gemm/sm90_primitives.cuh"
#include "cuda/gemm/sm90_tma.cuh"

namespace samebits::cuda {
namespace {

using namespace sm90;

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
constexpr int A_TILE = BM * BK, B_TILE = BN * BK;  // elements
constexpr size_t SMEM_BYTES = size_t(STAGES) * (A_TILE + B_TILE) * 2 + 2 * STAGES * 8 + 1024;

struct Chunk {
  int32_t row, valid;  // rows [row, row + valid) of one segment, valid <= 64
};

template <class T>
__global__ void __launch_bounds__(THREADS, 1)
    wgrad_sm90(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x,
               const Chunk* __restrict__ chunks, int n_chunks, const uint8_t* __restrict__ mask, float* dw, int64_t N,
               int64_t K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* sa = reinterpret_cast<T*>(base);
  T* sb = sa + STAGES * A_TILE;
  uint64_t* full = reinterpret_cast<uint64_t*>(sb + STAGES * B_TILE);
  uint64_t* empty = full + STAGES;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  // K tiles fastest: the CTAs in flight share one column block of dY (the large operand when N is
  // a vocabulary), which is then read from HBM once and served from L2 to all of them.
  const int64_t k_tiles = (K + BN - 1) / BN;
  const int64_t k0 = (int64_t(blockIdx.x) % k_tiles) * BN, n0 = (int64_t(blockIdx.x) / k_tiles) * BM;
  init_ring_barriers(full, empty, STAGES, CONSUMERS);

  if (wg == 0) {  // producer: dYᵀ as two 64 x 64 boxes (its n columns), X as four (its k columns)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (t == 0) {
      for (int i = 0; i < n_chunks; ++i) {
        const int s = i % STAGES;
        if (i >= STAGES) mbar_wait(&empty[s], ((i / STAGES) - 1) & 1);
        mbar_expect_tx(&full[s], uint32_t((A_TILE + B_TILE) * sizeof(T)));
        const int32_t row = chunks[i].row;
        for (int j = 0; j < BM / 64; ++j) tma_load_2d(sa + s * A_TILE + j * 64 * BK, &map_dy, int32_t(n0 + 64 * j), row, &full[s]);
        for (int j = 0; j < BN / 64; ++j) tma_load_2d(sb + s * B_TILE + j * 64 * BK, &map_x, int32_t(k0 + 64 * j), row, &full[s]);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1, warp = t / 32, lane = t % 32;
  // The accumulator starts from dW: m64n256 layout, rows n, columns k.
  float d[128];
  const int64_t row0 = n0 + c * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t n = row0 + 8 * h, k = k0 + 8 * j + 2 * (lane % 4) + e;
        d[j * 4 + h * 2 + e] = (n < N && k < K) ? dw[n * K + k] : 0.0f;
      }
  for (int i = 0; i < n_chunks; ++i) {
    const int s = i % STAGES;
    mbar_wait(&full[s], (i / STAGES) & 1);
    const Chunk ch = chunks[i];
    // Zero this consumer's dYᵀ rows that lie past the segment or are masked (whole 128-byte rows:
    // the 128B swizzle only permutes within a row).
    T* a = sa + s * A_TILE + c * 64 * BK;
    bool touched = false;
    for (int e = t; e < 64 * 8; e += 128) {
      const int r = e / 8, part = e % 8;
      const bool dead = r >= ch.valid || (mask != nullptr && mask[ch.row + r] == 0);
      if (dead) {
        reinterpret_cast<uint4*>(a + r * 64)[part] = make_uint4(0, 0, 0, 0);
        touched = true;
      }
    }
    if (ch.valid < 64 || mask != nullptr) {
      if (touched) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("bar.sync %0, 128;" ::"r"(2 + c) : "memory");
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    const uint64_t da = smem_desc_mn(a), db = smem_desc_mn(sb + s * B_TILE);
    if (ch.valid == BK) {  // a full chunk: four k16 steps, no per-step branch
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        Wgmma<T, true, true, 256>::mma(d, da + uint64_t(kk * (2048 >> 4)), db + uint64_t(kk * (2048 >> 4)), 1);
    } else {  // a segment's last chunk: only the k16 steps that hold its rows (uniform branch)
      for (int kk = 0; kk * 16 < ch.valid; ++kk)
        Wgmma<T, true, true, 256>::mma(d, da + uint64_t(kk * (2048 >> 4)), db + uint64_t(kk * (2048 >> 4)), 1);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    // Keep this chunk's MMAs in flight; the previous chunk's are done, so its stage can be refilled.
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    if (i > 0 && t == 0) mbar_arrive(&empty[(i - 1) % STAGES]);
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t n = row0 + 8 * h, k = k0 + 8 * j + 2 * (lane % 4) + e;
        if (n < N && k < K) dw[n * K + k] = d[j * 4 + h * 2 + e];
      }
#endif
}


// A device copy of the chunk list, kept and grown across calls (one per process, guarded).
const Chunk* upload(const std::vector<Chunk>& chunks, cudaStream_t stream) {
  static std::mutex mu;
  static Chunk* buf = nullptr;
  static size_t cap = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (chunks.size() > cap) {
    if (buf) check(cudaFree(buf), "linear_backward_weight (cuda)", "scratch");
    cap = std::max<size_t>(chunks.size(), 1024);
    check(cudaMalloc(&buf, cap * sizeof(Chunk)), "linear_backward_weight (cuda)", "scratch");
  }
  // Pageable source: the copy is staged before this call returns, so `chunks` may then go.
  check(cudaMemcpyAsync(buf, chunks.data(), chunks.size() * sizeof(Chunk), cudaMemcpyHostToDevice, stream),
        "linear_backward_weight (cuda)", "chunk table");
  return buf;
}

}  // namespace

template <class T>
void gemm_sm90_weight_grad(const T* dy, const T* x, const uint8_t* mask, const int32_t* segments, int64_t n_segments,
                           float* dw, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  std::vector<Chunk> chunks;
  auto add_segment = [&](int64_t row, int64_t len) {
    for (int64_t r = 0; r < len; r += BK) chunks.push_back({int32_t(row + r), int32_t(std::min<int64_t>(BK, len - r))});
  };
  if (segments) {
    for (int64_t i = 0; i < n_segments; ++i) add_segment(segments[2 * i], segments[2 * i + 1]);
  } else {
    add_segment(0, M);
  }
  if (chunks.empty() || N == 0 || K == 0) return;
  static bool configured = false;
  if (!configured) {
    check(cudaFuncSetAttribute(wgrad_sm90<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(SMEM_BYTES)),
          "linear_backward_weight (cuda)", "shared memory");
    configured = true;
  }
  const CUtensorMap mdy = tma_map_2d(dy, M, N, 64), mx = tma_map_2d(x, M, K, 64);
  const Chunk* dev = upload(chunks, stream);
  const int64_t tiles = ((N + BM - 1) / BM) * ((K + BN - 1) / BN);
  wgrad_sm90<T><<<unsigned(tiles), THREADS, SMEM_BYTES, stream>>>(mdy, mx, dev, int(chunks.size()), mask, dw, N, K);
  check(cudaGetLastError(), "linear_backward_weight (cuda)", "sm90 kernel launch");
}

template void gemm_sm90_weight_grad<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, const uint8_t*,
                                                   const int32_t*, int64_t, float*, int64_t, int64_t, int64_t,
                                                   cudaStream_t);
template void gemm_sm90_weight_grad<__half>(const __half*, const __half*, const uint8_t*, const int32_t*, int64_t,
                                            float*, int64_t, int64_t, int64_t, cudaStream_t);

}  // namespace samebits::cuda
