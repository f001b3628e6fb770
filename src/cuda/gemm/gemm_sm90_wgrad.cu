// Hopper (sm_90a) weight gradient dW[N,K] += dYᵀ·X on tensor cores, invariant under micro-batching.
//
// Why this shape. The reduction runs over tokens, and wgmma adds them in groups of 16. For one
// batch and any split of it into micro-batches (at sequence boundaries, packed or padded) to give
// the same bits, every token must land in the same group with the same partners. So groups are
// anchored to sequences: each segment (sequence) is cut into chunks of 64 rows from its first row,
// a chunk runs ceil(valid/16) k16 steps, and the rows its last step reads past the segment's end,
// and masked rows, are zeroed in shared memory (both operands) before the MMAs read them. The fp32
// accumulator tile is loaded from dW, the chunks are applied in segment order, and the tile is
// stored back: a micro-batch continues exactly where the previous one stopped. Rows outside every
// segment are never read. Same producer / consumer pipeline as the forward kernel; both operands are
// read along their output dimension (dYᵀ and X are M- and N-major), 128 x 256 tiles of dW.
//
// Speed. The accumulator round trip (128 KiB in and out per tile) is what a dW kernel pays beyond
// a forward GEMM. The kernel is persistent (one CTA per SM walking a fixed tile order), its ring
// runs on across tiles so the next tile's operands load during the write-back, and the accumulator
// moves in 8-byte pairs. (Prefetching the next tile's accumulator into L2 was measured slower on an
// H200 at every lead tried: the prefetches queue in the copy engine ahead of operand loads.) The chunk list travels as a kernel parameter.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <type_traits>

#include "cuda/common/runtime.cuh"
#include "cuda/gemm/gemm.cuh"
#include "cuda/gemm/sm90_primitives.cuh"
#include "cuda/gemm/sm90_tma.cuh"

namespace samebits::cuda {
namespace {

using namespace sm90;

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1), CLUSTER = 2;
constexpr int A_TILE = BM * BK, B_TILE = BN * BK;  // elements
constexpr size_t SMEM_BYTES = size_t(STAGES) * (A_TILE + B_TILE) * 2 + 2 * STAGES * 8 + 1024;

// The chunks of one launch, passed by value (no host-to-device copy): chunk i covers rows
// [row[i], row[i] + valid[i]) of one segment, valid <= 64. Longer lists take several launches,
// which chain through the fp32 accumulator exactly like micro-batches, so the bits are the same.
constexpr int MAX_CHUNKS = 640;  // 40960 tokens a launch; keeps the parameters under 4 KiB
struct ChunkList {
  int32_t count;
  int32_t row[MAX_CHUNKS];
  int8_t valid[MAX_CHUNKS];
};

// Loads (STORE == false) or stores this thread's part of the fp32 accumulator tile in the
// m64n256 register layout: pairs of adjacent columns, 8-byte accesses (K % 8 == 0 keeps a pair
// inside the row and aligned).
template <bool STORE>
__device__ __forceinline__ void accumulator_io(float (&d)[128], float* dw, int64_t row0, int64_t k0, int64_t N,
                                               int64_t K, int lane) {
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = row0 + 8 * h, k = k0 + 8 * j + 2 * (lane % 4);
      float2* p = reinterpret_cast<float2*>(dw + n * K + k);
      if (n < N && k < K) {
        if (STORE) {
          *p = make_float2(d[j * 4 + h * 2], d[j * 4 + h * 2 + 1]);
        } else {
          const float2 v = *p;
          d[j * 4 + h * 2] = v.x;
          d[j * 4 + h * 2 + 1] = v.y;
        }
      } else if (!STORE) {
        d[j * 4 + h * 2] = d[j * 4 + h * 2 + 1] = 0.0f;
      }
    }
}

// Persistent clusters of two CTAs: cluster c takes tile pairs c, c + clusters, ... in a fixed order
// (K tiles fastest); a pair is two tiles with the same K columns and neighbouring N rows, one per
// CTA. Both need the same X block, so each CTA loads half of it and the copy engine multicasts it to
// both (a third less L2 traffic than each loading all of it). Which CTA computes a tile never
// changes its arithmetic. The ring runs on across tiles, so the next tile's first chunks load while
// this tile's accumulator is written back.
template <class T>
__global__ void __launch_bounds__(THREADS, 1)
    wgrad_sm90(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x,
               const __grid_constant__ ChunkList chunks, const uint64_t* __restrict__ masked, float* dw, int64_t N,
               int64_t K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* sa = reinterpret_cast<T*>(base);
  T* sb = sa + STAGES * A_TILE;
  uint64_t* full = reinterpret_cast<uint64_t*>(sb + STAGES * B_TILE);
  uint64_t* empty = full + STAGES;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const uint32_t rank = cluster_rank(), partner = rank ^ 1;
  // K tiles fastest: the clusters in flight share one column block of dY (the large operand when
  // N is a vocabulary), which is then read from HBM once and served from L2 to all of them.
  const int64_t k_tiles = (K + BN - 1) / BN, pairs = k_tiles * ((N + 2 * BM - 1) / (2 * BM));
  const int64_t first_pair = blockIdx.x / CLUSTER, pair_step = gridDim.x / CLUSTER;
  const int n_chunks = chunks.count;
  // A stage is free again once the consumers of both CTAs are done with it (the partner's producer
  // writes half of it).
  init_ring_barriers(full, empty, STAGES, CONSUMERS * CLUSTER);
  cluster_sync();  // the partner's barriers are initialised before anyone signals them

  if (wg == 0) {  // producer: dYᵀ as two 64 x 64 boxes (its n columns); X as four, two from each CTA
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (t == 0) {
      uint32_t g = 0;  // chunks issued by this CTA, across its tiles
      for (int64_t pair = first_pair; pair < pairs; pair += pair_step) {
        const int64_t k0 = (pair % k_tiles) * BN, n0 = ((pair / k_tiles) * CLUSTER + rank) * BM;
        for (int i = 0; i < n_chunks; ++i, ++g) {
          const int s = int(g % STAGES);
          if (g >= STAGES) mbar_wait(&empty[s], ((g / STAGES) - 1) & 1);
          mbar_expect_tx(&full[s], uint32_t((A_TILE + B_TILE) * sizeof(T)));
          const int32_t row = chunks.row[i];
          for (int j = 0; j < BM / 64; ++j)
            tma_load_2d(sa + s * A_TILE + j * 64 * BK, &map_dy, int32_t(n0 + 64 * j), row, &full[s]);
          for (int j = int(rank) * (BN / 128); j < int(rank + 1) * (BN / 128); ++j)
            tma_load_2d_multicast(sb + s * B_TILE + j * 64 * BK, &map_x, int32_t(k0 + 64 * j), row, &full[s], 0x3);
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int c = wg - 1, warp = t / 32, lane = t % 32, ct = threadIdx.x - 128;  // ct: 0..255 over both consumers
    uint32_t g = 0;
    for (int64_t pair = first_pair; pair < pairs; pair += pair_step) {
      const int64_t k0 = (pair % k_tiles) * BN, n0 = ((pair / k_tiles) * CLUSTER + rank) * BM;
      const int64_t row0 = n0 + c * 64 + warp * 16 + lane / 4;
      float d[128];  // the accumulator starts from dW: m64n256 layout, rows n, columns k (rows >= N: 0)
      accumulator_io<false>(d, dw, row0, k0, N, K, lane);
      for (int i = 0; i < n_chunks; ++i, ++g) {
        const int s = int(g % STAGES);
        const int valid = chunks.valid[i];
        // Dead rows: masked ones, and those the last k16 step reads past the segment's end.
        uint64_t dead = masked ? masked[i] : 0;
        for (int r = valid; r < (valid + 15) / 16 * 16; ++r) dead |= uint64_t(1) << r;
        mbar_wait(&full[s], (g / STAGES) & 1);
        T* a = sa + s * A_TILE;
        T* b = sb + s * B_TILE;
        if (dead != 0) {
          // Zero the dead rows of both operands in this CTA (whole 128-byte rows of every 64-column
          // box: the 128B swizzle only permutes within a row), split over both consumers, so padding
          // holding NaN or Inf cannot reach a product. Uniform across the CTA: both consumers see the
          // same chunk.
          for (int e = ct; e < 64 * (BM / 64 + BN / 64) * 8; e += 256) {
            const int box = e / 512, r = (e / 8) % 64, part = e % 8;
            if ((dead >> r) & 1) {
              T* rowp = box < BM / 64 ? a + box * 64 * BK + r * 64 : b + (box - BM / 64) * 64 * BK + r * 64;
              reinterpret_cast<uint4*>(rowp)[part] = make_uint4(0, 0, 0, 0);
            }
          }
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          asm volatile("bar.sync 1, 256;" ::: "memory");
        }
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        const uint64_t da = smem_desc_mn(a + c * 64 * BK), db = smem_desc_mn(b);
        if (valid == BK) {  // a full chunk: four k16 steps, no per-step branch
#pragma unroll
          for (int kk = 0; kk < BK / 16; ++kk)
            Wgmma<T, true, true, 256>::mma(d, da + uint64_t(kk * (2048 >> 4)), db + uint64_t(kk * (2048 >> 4)), 1);
        } else {  // a segment's last chunk: only the k16 steps that hold its rows (uniform branch)
          for (int kk = 0; kk * 16 < valid; ++kk)
            Wgmma<T, true, true, 256>::mma(d, da + uint64_t(kk * (2048 >> 4)), db + uint64_t(kk * (2048 >> 4)), 1);
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        // Keep this chunk's MMAs in flight; the previous chunk's are done, so its stage can be refilled.
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        if (i > 0 && t == 0) {
          mbar_arrive(&empty[(g - 1) % STAGES]);
          mbar_arrive_remote(&empty[(g - 1) % STAGES], partner);
        }
      }
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      if (t == 0) {
        mbar_arrive(&empty[(g - 1) % STAGES]);
        mbar_arrive_remote(&empty[(g - 1) % STAGES], partner);
      }
      accumulator_io<true>(d, dw, row0, k0, N, K, lane);
    }
  }
  // Neither CTA leaves while the other may still multicast into it or signal its barriers.
  cluster_sync();
#endif
}

// Bit r of masked[i]: row r of chunk i is masked out.
__global__ void mark_masked_rows(const __grid_constant__ ChunkList chunks, const uint8_t* __restrict__ mask,
                                 uint64_t* masked) {
  const int i = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks.count) return;
  uint64_t bits = 0;
  for (int r = 0; r < chunks.valid[i]; ++r)
    if (mask[chunks.row[i] + r] == 0) bits |= uint64_t(1) << r;
  masked[i] = bits;
}

}  // namespace

template <class T>
void gemm_sm90_weight_grad(const T* dy, const T* x, const uint8_t* mask, const int32_t* segments, int64_t n_segments,
                           float* dw, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  if (N == 0 || K == 0) return;
  static bool configured = false;
  if (!configured) {
    check(cudaFuncSetAttribute(wgrad_sm90<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(SMEM_BYTES)),
          "linear_backward_weight (cuda)", "shared memory");
    configured = true;
  }
  const CUtensorMap mdy = tma_map_2d(dy, M, N, 64), mx = tma_map_2d(x, M, K, 64);
  // Persistent: as many clusters as fit at once (at most one per tile pair).
  static int max_clusters = 0;
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CLUSTER;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = SMEM_BYTES;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (max_clusters == 0) {
    cfg.gridDim = dim3(unsigned(CLUSTER * std::max(current_sm_count("linear_backward_weight (cuda)") / CLUSTER, 1)));
    check(cudaOccupancyMaxActiveClusters(&max_clusters, wgrad_sm90<T>, &cfg), "linear_backward_weight (cuda)",
          "cluster occupancy");
    max_clusters = std::max(max_clusters, 1);
  }
  const int64_t pairs = ((N + 2 * BM - 1) / (2 * BM)) * ((K + BN - 1) / BN);
  cfg.gridDim = dim3(unsigned(CLUSTER * std::min<int64_t>(pairs, max_clusters)));
  ChunkList list{};
  auto launch = [&] {
    if (list.count == 0) return;
    uint64_t* masked = nullptr;
    if (mask) {  // stream-ordered scratch: calls on different streams never share it
      check(cudaMallocAsync(reinterpret_cast<void**>(&masked), size_t(list.count) * sizeof(uint64_t), stream),
            "linear_backward_weight (cuda)", "mask scratch");
      mark_masked_rows<<<unsigned((list.count + 127) / 128), 128, 0, stream>>>(list, mask, masked);
      check(cudaGetLastError(), "linear_backward_weight (cuda)", "mask kernel launch");
    }
    check(cudaLaunchKernelEx(&cfg, wgrad_sm90<T>, mdy, mx, list, static_cast<const uint64_t*>(masked), dw, N, K),
          "linear_backward_weight (cuda)", "sm90 kernel launch");
    if (masked) check(cudaFreeAsync(masked, stream), "linear_backward_weight (cuda)", "mask scratch");
    list.count = 0;
  };
  auto add_segment = [&](int64_t row, int64_t len) {
    for (int64_t r = 0; r < len; r += BK) {
      if (list.count == MAX_CHUNKS) launch();
      list.row[list.count] = int32_t(row + r);
      list.valid[list.count] = int8_t(std::min<int64_t>(BK, len - r));
      ++list.count;
    }
  };
  if (segments) {
    for (int64_t i = 0; i < n_segments; ++i) add_segment(segments[2 * i], segments[2 * i + 1]);
  } else {
    add_segment(0, M);
  }
  launch();
}

template void gemm_sm90_weight_grad<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, const uint8_t*,
                                                   const int32_t*, int64_t, float*, int64_t, int64_t, int64_t,
                                                   cudaStream_t);
template void gemm_sm90_weight_grad<__half>(const __half*, const __half*, const uint8_t*, const int32_t*, int64_t,
                                            float*, int64_t, int64_t, int64_t, cudaStream_t);

}  // namespace samebits::cuda
