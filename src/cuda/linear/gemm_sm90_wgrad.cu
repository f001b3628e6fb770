// Hopper (sm_90a) weight gradient dW[N,K] += dYᵀ·X on tensor cores, invariant under micro-batching.
//
// Why this shape. The reduction runs over tokens, and wgmma adds them in groups of 16. For one
// batch and any split of it into micro-batches (at sequence boundaries, packed or padded) to give
// the same bits, every token must land in the same group with the same partners. So groups are
// anchored to sequences: each segment (sequence) is cut into chunks of 64 rows from its first row,
// every chunk runs four k16 steps, and the rows past the segment's end, and masked rows, are zeroed
// in shared memory (both operands) before the MMAs read them (their products are exact zeros). The fp32
// accumulator tile is loaded from dW, the chunks are applied in segment order, and the tile is
// stored back: a micro-batch continues exactly where the previous one stopped. Rows outside every
// segment are never read. Same producer / consumer pipeline as the forward kernel; both operands are
// read along their output dimension (dYᵀ and X are M- and N-major), 128 x 256 tiles of dW.
//
// Speed. The accumulator round trip (128 KiB in and out per tile, 4/M bytes per flop) is what a dW
// kernel pays beyond a forward GEMM, and unlike a beta = 1 epilogue it cannot wait for the end of
// the tile: the old value must be in the registers before the first MMA, or micro-batches would
// not chain bit for bit. So the accumulator comes in by TMA as eight 128-row x 32-column boxes
// (128-byte swizzled so the register-layout accesses are conflict-free): the first two into a
// 32 KiB buffer of their own, loaded a whole tile ahead, the other six through the first two ring
// slots of the tile, loaded while the previous tile's last chunks compute. At the tile boundary the
// consumers swap their registers with those boxes in place: they take the new tile's starting
// values and leave the finished tile behind, which an accumulator warp writes back by TMA stores
// before it hands the buffer and the slots back (only a CTA's last tile is stored by its threads).
// The consumers never wait on global stores, and every accumulator byte passes L2 marked
// evict-first, so the 2.5 GB an LM-head dW streams does not push out the operands many tiles share
// (H100, LM head (Qwen3), M = 1024: DRAM reads 4.9 -> 3.3 GB). The kernel is persistent (one CTA
// per SM walking a fixed tile order) and its ring runs on across tiles. (Measured and dropped: an
// L2 prefetch of the next tile's accumulator, which queued in the copy engine ahead of operand
// loads; a whole tile's accumulator a tile ahead in a 128 KiB buffer, which left the ring four
// 32-token stages, too shallow for M >= 512.) The chunk list travels as a kernel parameter.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "cuda/linear/gemm.cuh"
#include "cuda/common/sm90/primitives.cuh"
#include "cuda/common/sm90/tma.cuh"

namespace samebits::cuda {
namespace {

using namespace sm90;

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1), CLUSTER = 2;
constexpr int A_TILE = BM * BK, B_TILE = BN * BK;  // elements
constexpr int STAGE_BYTES = (A_TILE + B_TILE) * 2;  // one ring slot: dYᵀ then X, 48 KiB
// The fp32 accumulator tile as TMA boxes of BM rows x 32 columns (128 bytes): the first
// ACC_HELD_BOXES in a buffer of their own, loaded a whole tile ahead; the rest, three to a slot, in
// ACC_SLOTS slots of the operand ring, loaded while this tile's last chunks compute.
constexpr int ACC_BOX_COLS = 32, ACC_BOX_BYTES = BM * ACC_BOX_COLS * 4, ACC_BOXES = BN / ACC_BOX_COLS;
constexpr int ACC_HELD_BOXES = 2, ACC_HELD_BYTES = ACC_HELD_BOXES * ACC_BOX_BYTES;
constexpr int ACC_BOXES_PER_SLOT = STAGE_BYTES / ACC_BOX_BYTES;
constexpr int ACC_SLOTS = (ACC_BOXES - ACC_HELD_BOXES + ACC_BOXES_PER_SLOT - 1) / ACC_BOXES_PER_SLOT;
static_assert(ACC_SLOTS < STAGES, "the accumulator must leave a ring slot for operands");
constexpr size_t SMEM_BYTES = size_t(STAGES) * STAGE_BYTES + ACC_HELD_BYTES + (2 * STAGES + 3) * 8 + 1024;
static_assert(SMEM_BYTES <= 227 * 1024, "shared memory of one Hopper CTA");
// Registers a thread: the launch gives every warpgroup 168 (65536 / 384, in steps of 8); the
// producer warpgroup hands some to the consumers (the 128 fp32 accumulators). More than the launch
// gave would leave setmaxnreg.inc waiting forever.
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
static_assert(PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= (65536 / THREADS) / 8 * 8 * (CONSUMERS + 1),
              "the registers the launch gives the CTA");

// The chunks of one launch, passed by value (no host-to-device copy): chunk i covers rows
// [row[i], row[i] + valid[i]) of one segment, valid <= 64. Longer lists take several launches,
// which chain through the fp32 accumulator exactly like micro-batches, so the bits are the same.
constexpr int MAX_CHUNKS = 640;  // 40960 tokens a launch; keeps the parameters under 4 KiB
struct ChunkList {
  int32_t count;
  int32_t row[MAX_CHUNKS];
  int8_t valid[MAX_CHUNKS];
};

// Where box b (0 .. ACC_BOXES - 1) of a tile's accumulator lies: the first ACC_HELD_BOXES in `held`,
// the others three to a slot in the ring slots starting at `slot0`.
// ([[maybe_unused]]: the device helpers here go unused in the sm_80 pass, where the kernel compiles out.)
[[maybe_unused]] __device__ __forceinline__ uint8_t* accumulator_box(uint8_t* held, uint8_t* ring, uint32_t slot0,
                                                                     int b) {
  const int rb = b - ACC_HELD_BOXES;
  return b < ACC_HELD_BOXES ? held + b * ACC_BOX_BYTES
                            : ring + ((slot0 + rb / ACC_BOXES_PER_SLOT) % STAGES) * STAGE_BYTES +
                                  (rb % ACC_BOXES_PER_SLOT) * ACC_BOX_BYTES;
}

// Swaps this thread's part of the fp32 accumulator tile in the m64n256 register layout (rows n,
// columns k; pairs of adjacent columns, 8-byte accesses) with its boxes in shared memory.
// The registers take the next tile's starting values and leave the finished tile in their place.
// 128-byte swizzle: the 16-byte chunk index XOR the row mod 8, so a warp's eight rows hit eight
// different chunks; rows and columns outside dW arrive as zeros and are clipped by the stores. The
// accesses are volatile asm so that each pair loads then stores: left free, the compiler hoists all
// 64 loads above the stores, and 128 more live registers spill.
[[maybe_unused]] __device__ __forceinline__ void accumulator_swap(float (&d)[128], uint8_t* held, uint8_t* ring,
                                                                  uint32_t slot0, int tile_row, int lane) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const uint8_t* p = accumulator_box(held, ring, slot0, j / 4);
    uint32_t addr[2];
    float2 v[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = tile_row + 8 * h, chunk = (2 * (j % 4) + (lane % 4) / 2) ^ (r % 8);
      addr[h] = smem_u32(p + r * 128 + chunk * 16 + 8 * (lane % 2));
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v[h].x), "=f"(v[h].y) : "r"(addr[h]) : "memory");
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr[h]), "f"(d[j * 4 + h * 2]), "f"(d[j * 4 + h * 2 + 1])
                   : "memory");
      d[j * 4 + h * 2] = v[h].x;
      d[j * 4 + h * 2 + 1] = v[h].y;
    }
  }
}
// The last tile of a CTA has no next tile to swap with: its threads store it themselves.
[[maybe_unused]] __device__ __forceinline__ void accumulator_store(const float (&d)[128], float* dw, int n0, int k0,
                                                                   int tile_row, int N, int K, int lane,
                                                                   uint64_t policy) {
  // 32-bit coordinates and one 64-bit row pointer keep the registers beside the 128 accumulators few.
  const int n = n0 + tile_row, k = k0 + 2 * (lane % 4);
  float* p = dw + int64_t(n) * K + k;
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)  // K % 8 == 0: a pair stays inside its row
      if (n + 8 * h < N && k + 8 * j < K)
        st_global_v2_hint(p + int64_t(8 * h) * K + 8 * j, d[j * 4 + h * 2], d[j * 4 + h * 2 + 1], policy);
}

// Grouped raster: pairs of N tiles fastest within groups of GROUP_PAIRS (2048 rows of dW), K tiles
// next, groups in order. The ~66 pairs in flight then cover about 8 x 8 tiles, so every chunk of
// tokens they read (64 rows of X over 8 K tiles, of dY over 16 N tiles) serves eight tiles from
// L2; walking all K tiles of one N row instead re-read X from HBM once per N row pair (16 times
// for the down projection, 0.8 GB at 2048 tokens), which bound the kernel by HBM.
constexpr int GROUP_PAIRS = 8;
[[maybe_unused]] __device__ __forceinline__ void pair_origin(int pair, int n_pairs, int k_tiles, uint32_t rank,
                                                             int& n0, int& k0) {
  const int group = pair / (GROUP_PAIRS * k_tiles), first = group * GROUP_PAIRS;
  const int width = n_pairs - first < GROUP_PAIRS ? n_pairs - first : GROUP_PAIRS;
  const int in_group = pair % (GROUP_PAIRS * k_tiles);
  n0 = ((first + in_group % width) * CLUSTER + int(rank)) * BM;
  k0 = (in_group / width) * BN;
}

// Persistent clusters of two CTAs: cluster c takes tile pairs c, c + clusters, ... in a fixed order
// (grouped raster, above); a pair is two tiles with the same K columns and neighbouring N rows, one per
// CTA. Both need the same X block, so each CTA loads half of it and the copy engine multicasts it to
// both (a third less L2 traffic than each loading all of it). Which CTA computes a tile never
// changes its arithmetic. The ring runs on across tiles, so the next tile's first chunks load while
// the previous tile's accumulator is written back by the copy engine.
template <class T>
__global__ void __launch_bounds__(THREADS, 1)
    wgrad_sm90(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x,
               const __grid_constant__ CUtensorMap map_dw, const __grid_constant__ ChunkList chunks,
               const uint64_t* __restrict__ masked, float* dw, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* held = base + STAGES * STAGE_BYTES;  // the accumulator's first boxes
  uint64_t* full = reinterpret_cast<uint64_t*>(held + ACC_HELD_BYTES);
  uint64_t* empty = full + STAGES;
  uint64_t* held_full = empty + STAGES;      // the next tile's first boxes have landed
  uint64_t* held_empty = held_full + 1;      // the consumers hold them in registers and the stores have read the buffer
  uint64_t* acc_swapped = held_empty + 1;    // both consumers have swapped a tile's accumulator in
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const uint32_t rank = cluster_rank(), partner = rank ^ 1;
  const int k_tiles = (K + BN - 1) / BN, n_pairs = (N + 2 * BM - 1) / (2 * BM), pairs = k_tiles * n_pairs;
  const int first_pair = int(blockIdx.x) / CLUSTER, pair_step = int(gridDim.x) / CLUSTER;
  const int n_chunks = chunks.count;
  // A stage is free again once the consumers of both CTAs are done with it (the partner's producer
  // writes half of it).
  init_ring_barriers(full, empty, STAGES, CONSUMERS * CLUSTER);
  if (threadIdx.x == 0) {
    mbar_init(held_full, 1);
    mbar_init(held_empty, 1);
    mbar_init(acc_swapped, CONSUMERS);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();  // the partner's barriers are initialised before anyone signals them

  if (wg == 0) {  // producer warpgroup. Thread 0 loads: per tile, the accumulator (ACC_SLOTS slots),
                  // then per chunk dYᵀ as two 64 x 64 boxes (its n columns) and X as four, two from
                  // each CTA. Thread 32 is the accumulator writer (below).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
    if (t == 0) {
      const uint64_t policy = l2_policy_evict_first();  // the accumulator: read once, written once
      auto load_held = [&](int pair) {  // boxes 0 .. ACC_HELD_BOXES - 1 of a tile's accumulator
        int n0, k0;
        pair_origin(pair, n_pairs, k_tiles, rank, n0, k0);
        mbar_expect_tx(held_full, uint32_t(ACC_HELD_BYTES));
        for (int b = 0; b < ACC_HELD_BOXES; ++b)
          tma_load_2d_hint(held + b * ACC_BOX_BYTES, &map_dw, int32_t(k0 + ACC_BOX_COLS * b), int32_t(n0), held_full,
                           policy);
      };
      uint32_t g = 0, tile = 0;  // ring slots filled and tiles begun by this CTA
      if (first_pair < pairs) load_held(first_pair);
      for (int pair = first_pair; pair < pairs; pair += pair_step, ++tile) {
        int n0, k0;
        pair_origin(pair, n_pairs, k_tiles, rank, n0, k0);
        for (int q = 0; q < ACC_SLOTS; ++q) {
          const int first_box = ACC_HELD_BOXES + q * ACC_BOXES_PER_SLOT, left = ACC_BOXES - first_box;
          const int boxes = left < ACC_BOXES_PER_SLOT ? left : ACC_BOXES_PER_SLOT;
          const int s = int(g % STAGES);
          if (g >= STAGES) mbar_wait(&empty[s], ((g / STAGES) - 1) & 1);
          ++g;
          uint8_t* slot = base + s * STAGE_BYTES;
          uint64_t* bar = &full[s];
          mbar_expect_tx(bar, uint32_t(boxes * ACC_BOX_BYTES));
          for (int b = 0; b < boxes; ++b)
            tma_load_2d_hint(slot + b * ACC_BOX_BYTES, &map_dw, int32_t(k0 + ACC_BOX_COLS * (first_box + b)), int32_t(n0),
                             bar, policy);
        }
        // The next tile's held boxes load while this one computes, once the accumulator writer's
        // stores have read the previous tile out of the buffer (checked after STAGES chunks of this
        // tile have been issued, when they usually have).
        const int prefetch_at = n_chunks - 1 < STAGES ? n_chunks - 1 : STAGES;
        for (int i = 0; i < n_chunks; ++i) {
          const int s = int(g % STAGES);
          if (g >= STAGES) mbar_wait(&empty[s], ((g / STAGES) - 1) & 1);
          ++g;
          uint64_t* bar = &full[s];
          T* a = reinterpret_cast<T*>(base + s * STAGE_BYTES);
          T* b = a + A_TILE;
          mbar_expect_tx(bar, uint32_t(STAGE_BYTES));
          const int32_t row = chunks.row[i];
          for (int j = 0; j < BM / 64; ++j) tma_load_2d(a + j * 64 * BK, &map_dy, int32_t(n0 + 64 * j), row, bar);
          for (int j = int(rank) * (BN / 128); j < int(rank + 1) * (BN / 128); ++j)
            tma_load_2d_multicast(b + j * 64 * BK, &map_x, int32_t(k0 + 64 * j), row, bar, 0x3);
          if (i == prefetch_at && pair + pair_step < pairs) {
            mbar_wait(held_empty, tile & 1);
            load_held(pair + pair_step);
          }
        }
      }
    }
    if (t == 32) {  // the accumulator writer: once both consumers have swapped tile j's starting values
                    // in, tile j - 1's results are in their place; store them, and once the copy engine
                    // has read them, give the held buffer and the slots back
      const uint64_t policy = l2_policy_evict_first();
      uint32_t g = 0, tile = 0;
      for (int pair = first_pair; pair < pairs; pair += pair_step, ++tile) {
        mbar_wait(acc_swapped, tile & 1);
        if (tile > 0) {
          int n0, k0;
          pair_origin(pair - pair_step, n_pairs, k_tiles, rank, n0, k0);
          for (int b = 0; b < ACC_BOXES; ++b)
            tma_store_2d_hint(&map_dw, accumulator_box(held, base, g, b), int32_t(k0 + ACC_BOX_COLS * b), int32_t(n0),
                              policy);
          tma_store_wait_read<0>();
        }
        mbar_arrive(held_empty);
        for (int q = 0; q < ACC_SLOTS; ++q)  // a stage's four arrivals: both consumers of both CTAs
          for (int k = 0; k < CONSUMERS; ++k) {
            mbar_arrive(&empty[(g + q) % STAGES]);
            mbar_arrive_remote(&empty[(g + q) % STAGES], partner);
          }
        g += ACC_SLOTS + n_chunks;
      }
      tma_store_wait_all();  // written before the CTA (and its shared memory) goes
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
    const int c = wg - 1, warp = t / 32, lane = t % 32, ct = threadIdx.x - 128;  // ct: 0..255 over both consumers
    const int tile_row = c * 64 + warp * 16 + lane / 4;
    // The accumulator starts from dW (m64n256 layout, rows n, columns k; outside dW: 0): once its
    // boxes land, the registers swap with them, leaving the previous tile's results (zeros before
    // the first tile) for the accumulator writer.
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;
    uint32_t g = 0, tile = 0;
    for (int pair = first_pair; first_pair < pairs; pair += pair_step, ++tile) {
      if (pair >= pairs) {  // one pass more than tiles: the last tile's results
        int n0, k0;
        pair_origin(pair - pair_step, n_pairs, k_tiles, rank, n0, k0);
        accumulator_store(d, dw, n0, k0, tile_row, N, K, lane, l2_policy_evict_first());
        break;
      }
      mbar_wait(held_full, tile & 1);
      for (int q = 0; q < ACC_SLOTS; ++q) mbar_wait(&full[(g + q) % STAGES], ((g + q) / STAGES) & 1);
      accumulator_swap(d, held, base, g % STAGES, tile_row, lane);
      fence_async_shared();  // the finished rows, for the copy engine's stores
      if (c == 0) named_barrier_sync(2, 128); else named_barrier_sync(3, 128);  // constant ids
      if (t == 0) mbar_arrive(acc_swapped);
      g += ACC_SLOTS;
      for (int i = 0; i < n_chunks; ++i, ++g) {
        const int s = int(g % STAGES);
        const int valid = chunks.valid[i];
        // Dead rows: masked ones, and those past the segment's end (the chunk's last 64 - valid).
        uint64_t dead = masked ? masked[i] : 0;
        if (valid < BK) dead |= ~uint64_t(0) << valid;
        mbar_wait(&full[s], (g / STAGES) & 1);
        T* a = reinterpret_cast<T*>(base + s * STAGE_BYTES);
        T* b = a + A_TILE;
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
        // Always four k16 steps: rows past `valid` are zero in both operands, so their products are
        // exact zeros. (Issuing only ceil(valid / 16) steps put wgmma under a branch, and ptxas then
        // serialised every wgmma of the kernel: warning C7520, a wait after each instruction.)
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          Wgmma<T, true, true, 256>::mma(d, da + uint64_t(kk * (2048 >> 4)), db + uint64_t(kk * (2048 >> 4)), 1);
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
  // The kernel indexes tiles and rows in 32 bits (TMA coordinates are 32-bit too).
  if (M > INT32_MAX || N > INT32_MAX / 2 || K > INT32_MAX / 2)
    throw Error("linear_backward_weight (cuda)", "shape", "M above 2^31 - 1, or N or K above 2^30, is not supported");
  static std::atomic<int> smem_allowed[64] = {}, cluster_capacity[64] = {};
  allow_dynamic_smem(wgrad_sm90<T>, SMEM_BYTES, smem_allowed, "linear_backward_weight (cuda)");
  const CUtensorMap mdy = tma_map_2d(dy, M, N, BK), mx = tma_map_2d(x, M, K, BK), mdw = tma_map_2d(dw, N, K, BM);
  // Persistent: as many clusters as fit at once on this device (at most one per tile pair).
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
  const int max_clusters = once_per_device(cluster_capacity, "linear_backward_weight (cuda)", [&] {
    int n = 0;
    cfg.gridDim = dim3(unsigned(CLUSTER * std::max(current_sm_count("linear_backward_weight (cuda)") / CLUSTER, 1)));
    check(cudaOccupancyMaxActiveClusters(&n, wgrad_sm90<T>, &cfg), "linear_backward_weight (cuda)", "cluster occupancy");
    return std::max(n, 1);
  });
  const int64_t pairs = ((N + 2 * BM - 1) / (2 * BM)) * ((K + BN - 1) / BN);
  cfg.gridDim = dim3(unsigned(CLUSTER * std::min<int64_t>(pairs, max_clusters)));
  ChunkList list{};
  auto launch = [&] {
    if (list.count == 0) return;
    uint64_t* masked = nullptr;
    if (mask) {  // stream-ordered scratch: calls on different streams never share it
      masked = static_cast<uint64_t*>(scratch_alloc(size_t(list.count) * sizeof(uint64_t), stream,
                                                    "linear_backward_weight (cuda)"));
      mark_masked_rows<<<unsigned((list.count + 127) / 128), 128, 0, stream>>>(list, mask, masked);
      check(cudaGetLastError(), "linear_backward_weight (cuda)", "mask kernel launch");
    }
    check(cudaLaunchKernelEx(&cfg, wgrad_sm90<T>, mdy, mx, mdw, list, static_cast<const uint64_t*>(masked), dw, int(N), int(K)),
          "linear_backward_weight (cuda)", "sm90 kernel launch");
    scratch_free(masked, stream, "linear_backward_weight (cuda)");
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
