// Hopper (sm_90a) GEMM y = x·wᵀ: TMA loads, wgmma, a warp-specialised producer / consumer pipeline
// on mbarriers.
//
// Why this shape. A 128 x BN output tile (BN = 256; 192, 128, 64, 48 or 32 and 64-row tiles for some
// M, see tile_width and tile_choice) with K in steps of 64 (four 16-deep wgmma steps, ascending): an
// output element is always the same sequence of 16-deep MMA steps over ascending K, accumulated in fp32
// registers, so its bits never depend on M, on its neighbours or on the grid (rules 1-3; no split-K,
// no atomics). The kernel is persistent: one CTA per SM walks a fixed tile order, and its ring runs
// on across tiles, so the next tile's operands load while this tile's epilogue writes (measured on an
// H200, same process: geometric-mean ratio to cuBLAS at M >= 1024 0.981 against 0.961 with one CTA
// per tile; on an H100 0.984 / 0.981 against 0.960 / 0.972 in two alternating repetitions).
// Warpgroup 0 is the producer (registers given away with setmaxnreg): one thread streams A (x) and
// B (w) tiles with the bulk tensor copy engine into a ring of up to 200 KiB (128B-swizzled; 4, 5, 6
// or 8 stages of 48, 40, 32 or 24 KiB for BN = 256, 192, 128, 64; compact 64-row tiles: 5, 12, 14 or
// 16 stages of 40, 16, 14 or 12 KiB for BN = 256, 64, 48, 32) and signals "full" mbarriers with the byte
// count. Warpgroups 1 and 2 each own 64 rows of the tile, wait on "full", issue wgmma straight from
// shared memory with one k-tile of MMAs kept in flight, and release a stage on its "empty" mbarrier
// once the MMAs reading it are done. The epilogue adds the bias in fp32, rounds once, and writes
// 128-byte column slices into 128B-swizzled boxes that TMA stores, so the consumers start the next
// tile while the copy engine writes this one out (rows TMA cannot store, and M <= 128, go through a
// padded staging area and the threads' own 16-byte stores). Tiles are ordered M
// fastest within groups of 2048 rows, so a W tile is read from HBM once per group and reused from L2
// across M, and the rows of x in flight fit in L2. Out-of-range rows, columns and K are zero-filled by
// the copy engine, so edge tiles run the same instructions. Requirements: K a multiple of 8 and
// 16-byte aligned x and w (TMA strides); other K take the generic path, which is a property of the
// weight, never of M.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/common/runtime.cuh"
#include "cuda/gemm/gemm.cuh"
#include "cuda/gemm/sm90_primitives.cuh"
#include "cuda/gemm/sm90_tma.cuh"
#include "ops/tuning.hpp"

namespace samebits::cuda {
namespace {

using namespace sm90;

constexpr int BM = 128, BK = 64, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
constexpr int RING_BUDGET = 200 * 1024;  // bytes of shared memory for the stage ring
constexpr int STAGE_ROW_PAD = 16;  // bytes: staggers staging rows across banks
// The epilogue stages 128-byte column slices of a consumer's 64 rows in its own shared-memory area
// (outside the ring, which already holds the next tile's operands in the persistent loop): as a
// 128B-swizzled 64-row box that the copy engine stores (one or two boxes a consumer, as many as fit
// beside the ring), or, where TMA cannot store the output (a row pitch that is not a multiple of 16
// bytes, or an unaligned output), as padded rows that the threads copy out.
constexpr int SLICE_BYTES = 128, BOX_BYTES = 64 * SLICE_BYTES;
constexpr int PADDED_STAGING_BYTES = CONSUMERS * 64 * (SLICE_BYTES + STAGE_ROW_PAD);
constexpr int SMEM_LIMIT = 227 * 1024;

// The tile width: 256 output columns; on outputs narrower than 16384 columns, 128 when M <= 512 and
// 64 when M <= 256, so decode-sized batches of narrow layers (QKV, O, down, the LM head's dX) get
// two or four times the CTAs to stream the weight with. Above M = 256, 192 where that costs less
// once the last, partial round of tiles over the SMs is counted (rounds x width: QKV 4096 -> 6144 at
// M = 1024 is 1.45 rounds of 256-wide tiles, a second round that leaves 60% of the GPU idle, and
// 1.94 rounds of 192-wide ones), by a margin of 10%: a 192-wide tile has room for one TMA store box
// a consumer beside its five-stage ring, not two, and where the saving is small it lost (H100, same
// run: LM head 4096 -> 128256 at M = 2048 / 4096 0.92 against 1.01 / 1.00, gate+up 4096 -> 28672 at
// M = 8192 0.91 against 0.99). This is the one place where a shape depends on M (and on the SM
// count), which rule 2 allows only with proof that every element keeps its bits: wgmma.m64n64k16,
// m64n128k16, m64n192k16 and m64n256k16 (and m64n32k16, m64n48k16, below) run the same per-element
// K sequence, and tests/test_cuda_gemm.cpp checks it (the M sweep crosses the switches, and
// TileWidthsGiveIdenticalBits forces every width, compact and full, on the same problems).
inline int64_t tile_rounds(int64_t M, int64_t out_cols, int width, int sms) {
  const int64_t tiles = ((M + 127) / 128) * ((out_cols + width - 1) / width);
  return (tiles + sms - 1) / sms;
}
inline int tile_width(int64_t M, int64_t out_cols, int sms) {
  int width = out_cols >= 16384 ? 256 : M <= 256 ? 64 : M <= 512 ? 128 : 256;
  if (M > 256 && 10 * 192 * tile_rounds(M, out_cols, 192, sms) < 9 * width * tile_rounds(M, out_cols, width, sms))
    width = 192;
  return width;
}

// Decode-sized calls of narrow layers (M <= 128, fewer than 16384 output columns) stream the weight
// and want as many CTAs streaming it as there are SMs, each with as deep a ring as possible:
// compact 64-row tiles (below), and for M <= 64 the narrowest width in 32, 48, 64 that still fits one
// round (down and O, 4096 columns: 128 tiles of 32, not 64 of 64; QKV, 6144: 128 tiles of 48, not 96
// of 64). For 64 < M <= 128, two 64-row tiles of 64 columns where they fit one round (down, O: 128
// CTAs instead of 64). dX reads w along its output columns in 128-byte boxes, or 64-byte ones for a
// 32-wide tile, so its tiles are 32 or at least 64 wide (dX of gate+up and the LM heads, 4096 output
// columns: 128 tiles of 32). Measured against 64-wide tiles only, same run: forward M <= 128 on an
// H100, geometric-mean ratio to cuBLAS 1.045 -> 1.122 (down M = 16: 1.07 -> 1.61), dX 1.024 -> 1.063;
// the 32-wide dX tiles on an H200, dX M <= 128 0.922 -> 0.956.
struct TileChoice {
  int width;
  bool compact;
};
inline TileChoice tile_choice(int64_t M, int64_t out_cols, int sms, bool forward) {
  auto tiles = [&](int rows, int width) { return ((M + rows - 1) / rows) * ((out_cols + width - 1) / width); };
  const bool narrow = out_cols < 16384;
  int width = tile_width(M, out_cols, sms);
  if (narrow && M <= 64)
    for (int w : {32, 48})
      if (tiles(64, w) <= sms && (forward || w == 32)) {
        width = w;
        break;
      }
  if (const int forced = detail::gemm_tile_width_override()) width = forced == 48 && !forward ? 64 : forced;
  // Compact: 32- and 48-wide tiles always; 64- and 256-wide ones for M <= 64; 64-wide ones for
  // 64 < M <= 128 too where the 64-row tiles fit one round.
  const bool compact = width < 64 || (width == 64 && (M <= 64 || (M <= 128 && tiles(64, 64) <= sms))) ||
                       (width == 256 && M <= 64);
  return {width, compact};
}

// A CTA's tile is 128 rows, 64 per consumer warpgroup. A COMPACT tile is one consumer's 64 rows:
// for decode-sized M a ring slot then holds 64 rows of x instead of 128, so the same ring holds more
// stages of the weight, which is what such a call streams (12 instead of 8 stages for BN = 64, 5
// instead of 4 for BN = 256), and 64 < M <= 128 gets twice the tiles. The second consumer warpgroup
// has no rows and leaves at once. Every stored row runs the same wgmma sequence as in a full tile.
template <int BN, bool COMPACT>
struct Tile {
  static constexpr int A_ROWS = COMPACT ? 64 : BM, RELEASERS = COMPACT ? 1 : CONSUMERS;
  static constexpr int A_TILE = A_ROWS * BK, B_TILE = BN * BK;  // elements
  static constexpr int STAGES = RING_BUDGET / ((A_TILE + B_TILE) * 2);
  static constexpr int RING_BYTES = STAGES * (A_TILE + B_TILE) * 2;
  static constexpr int BARRIER_BYTES = 2 * STAGES * 8, ALIGN_SLACK = 1024;
  // Store boxes a consumer: two where they fit beside the ring (the second is written while the
  // copy engine still reads the first), else one.
  static constexpr int STORE_BOXES =
      RING_BYTES + CONSUMERS * 2 * BOX_BYTES + BARRIER_BYTES + ALIGN_SLACK <= SMEM_LIMIT ? 2 : 1;
  static constexpr int STAGING_BYTES = CONSUMERS * STORE_BOXES * BOX_BYTES > PADDED_STAGING_BYTES
                                           ? CONSUMERS * STORE_BOXES * BOX_BYTES
                                           : PADDED_STAGING_BYTES;
  static constexpr size_t SMEM_BYTES = size_t(RING_BYTES) + STAGING_BYTES + BARRIER_BYTES + ALIGN_SLACK;
  static_assert(SMEM_BYTES <= SMEM_LIMIT, "shared memory of one Hopper CTA");
};

template <class O>
__device__ __forceinline__ O convert(float v) {  // one rounding to the output type
  if constexpr (std::is_same<O, __nv_bfloat16>::value) return __float2bfloat16_rn(v);
  else if constexpr (std::is_same<O, __half>::value) return __float2half_rn(v);
  else return v;
}

// Rounds one consumer's 64 x BN accumulators and writes them out, one 128-byte column slice at a
// time: the slice is staged in shared memory (rows padded), then copied out as whole 16-byte pieces
// of rows. Bias is added in fp32 before the single rounding.
template <class T, class O, int BN>
__device__ __forceinline__ void epilogue(const float (&d)[BN / 2], uint8_t* stage, const T* bias, O* out, int64_t row_base,
                                         int64_t n0, int64_t M, int64_t N, int t, int c) {
  constexpr int ROW_BYTES = SLICE_BYTES + STAGE_ROW_PAD, SLICE_COLS = SLICE_BYTES / int(sizeof(O));
  constexpr int PER_CHUNK = 16 / int(sizeof(O));
  constexpr int J_PER_SLICE = SLICE_COLS / 8;  // 8-column groups of the accumulator layout per slice
  const int warp = t / 32, lane = t % 32;
  // One fully unrolled loop over the accumulator's column groups (a slice loop around it would index
  // `d` at run time and move it to local memory); a slice is written out after its last group.
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int slice = j / J_PER_SLICE;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = warp * 16 + lane / 4 + h * 8, col = 8 * j + 2 * (lane % 4) + e;
        float v = d[j * 4 + h * 2 + e];
        if (bias && n0 + col < N) v += float(bias[n0 + col]);
        reinterpret_cast<O*>(stage + r * ROW_BYTES)[col - slice * SLICE_COLS] = convert<O>(v);
      }
    if ((j + 1) % J_PER_SLICE != 0 && j + 1 != BN / 8) continue;
    // The tile's last slice may be narrower (32- and 48-wide tiles).
    const int slice_cols = BN - slice * SLICE_COLS < SLICE_COLS ? BN - slice * SLICE_COLS : SLICE_COLS;
    const int CHUNKS = slice_cols / PER_CHUNK;
    named_barrier_sync(2 + c, 128);  // this consumer's 128 threads: the slice is staged
    for (int i = t; i < 64 * CHUNKS; i += 128) {
      const int r = i / CHUNKS, ch = i % CHUNKS;
      const int64_t m = row_base + r, col = n0 + int64_t(slice) * SLICE_COLS + int64_t(ch) * PER_CHUNK;
      if (m >= M || col >= N) continue;
      const O* src = reinterpret_cast<const O*>(stage + r * ROW_BYTES) + ch * PER_CHUNK;
      O* dst = out + m * N + col;
      if (col + PER_CHUNK <= N && (reinterpret_cast<uintptr_t>(dst) % 16) == 0) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int e = 0; e < PER_CHUNK && col + e < N; ++e) dst[e] = src[e];
      }
    }
    named_barrier_sync(2 + c, 128);  // copied out: the staging area may take the next slice
  }
}

// The same values through the copy engine: each 128-byte column slice of the consumer's 64 rows is
// written (bias added in fp32, one rounding) into a 128B-swizzled box in shared memory, which one
// thread hands to a TMA store; the consumer goes on to its next tile while the copy engine writes the
// rows out (rows and columns outside y are clipped by the copy engine). `boxes_used` counts this
// consumer's boxes across tiles, so box i % BOXES is reused only once its store has read it.
template <class T, class O, int BN, int BOXES>
__device__ __forceinline__ void epilogue_tma(const float (&d)[BN / 2], uint8_t* boxes, const T* bias,
                                             const CUtensorMap* map_out, int64_t row_base, int64_t n0, int64_t N,
                                             int t, int c, uint32_t& boxes_used) {
  constexpr int SLICE_COLS = SLICE_BYTES / int(sizeof(O)), J_PER_SLICE = SLICE_COLS / 8;
  const int warp = t / 32, lane = t % 32;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int slice = j / J_PER_SLICE;
    uint8_t* box = boxes + (boxes_used % BOXES) * BOX_BYTES;
    if (j % J_PER_SLICE == 0) {  // a new slice: its box must have been read by the copy engine
      if (t == 0) tma_store_wait_read<BOXES - 1>();
      named_barrier_sync(2 + c, 128);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + lane / 4 + h * 8, col = 8 * j + 2 * (lane % 4);  // two adjacent columns
      float v0 = d[j * 4 + h * 2], v1 = d[j * 4 + h * 2 + 1];
      if (bias) {
        if (n0 + col < N) v0 += float(bias[n0 + col]);
        if (n0 + col + 1 < N) v1 += float(bias[n0 + col + 1]);
      }
      const int byte = (col - slice * SLICE_COLS) * int(sizeof(O));
      uint8_t* p = box + r * SLICE_BYTES + (((byte / 16) ^ (r % 8)) * 16) + byte % 16;
      if constexpr (sizeof(O) == 4) {
        *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
      } else {
        O pair[2] = {convert<O>(v0), convert<O>(v1)};
        *reinterpret_cast<uint32_t*>(p) = *reinterpret_cast<const uint32_t*>(pair);
      }
    }
    if ((j + 1) % J_PER_SLICE != 0) continue;
    fence_async_shared();
    named_barrier_sync(2 + c, 128);  // the box is written
    if (t == 0) tma_store_2d(map_out, box, int32_t(n0 + int64_t(slice) * SLICE_COLS), int32_t(row_base));
    ++boxes_used;
  }
}

template <class T, class O, bool TRANS_B, int BN, bool COMPACT>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_sm90(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
              const __grid_constant__ CUtensorMap map_out, bool store_by_tma, const T* bias, O* out, int64_t M,
              int64_t N, int64_t K, int a_rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* sa = reinterpret_cast<T*>(base);
  using Ring = Tile<BN, COMPACT>;
  constexpr int A_TILE = Ring::A_TILE, B_TILE = Ring::B_TILE, NREG = BN / 2, STAGES = Ring::STAGES;
  T* sb = sa + STAGES * A_TILE;
  uint8_t* staging = base + Ring::RING_BYTES;
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + Ring::STAGING_BYTES);
  uint64_t* empty = full + STAGES;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  // Persistent: CTA b takes tiles b, b + gridDim.x, ... of a fixed tile order; the ring runs on
  // across tiles, so the next tile's operands load while this tile's epilogue writes. Which CTA
  // computes a tile never changes its arithmetic.
  // Grouped raster: M tiles fastest within groups of GROUP_M (2048 rows), groups in order. The CTAs
  // in flight share W tiles, which L2 serves across M, and a wave's rows of x stay within one group:
  // M tiles fastest over all of M re-streams the whole of x from HBM for every couple of W columns
  // once x outgrows L2 (measured: 56% of HBM bandwidth and a 62% L2 hit rate at M = 8192).
  constexpr int64_t GROUP_M = 16;
  constexpr int TM = Ring::A_ROWS;  // rows of C a tile covers
  const int64_t m_tiles = (M + TM - 1) / TM, n_tiles = (N + BN - 1) / BN, tiles = m_tiles * n_tiles;
  auto origin = [&](int64_t tile, int64_t& m0, int64_t& n0) {
    const int64_t group = tile / (GROUP_M * n_tiles), first_m = group * GROUP_M;
    const int64_t group_rows = m_tiles - first_m < GROUP_M ? m_tiles - first_m : GROUP_M;
    const int64_t in_group = tile % (GROUP_M * n_tiles);
    m0 = (first_m + in_group % group_rows) * TM;
    n0 = (in_group / group_rows) * BN;
  };
  const int kt_count = int((K + BK - 1) / BK);
  init_ring_barriers(full, empty, STAGES, Ring::RELEASERS);

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (t == 0) {
      uint32_t g = 0;  // k-tiles issued by this CTA, across its tiles
      for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int64_t m0, n0;
        origin(tile, m0, n0);
        for (int kt = 0; kt < kt_count; ++kt, ++g) {
          const int s = int(g % STAGES);
          if (g >= STAGES) mbar_wait(&empty[s], ((g / STAGES) - 1) & 1);
          mbar_expect_tx(&full[s], uint32_t((a_rows * BK + B_TILE) * sizeof(T)));
          tma_load_2d(sa + s * A_TILE, &map_a, kt * BK, int32_t(m0), &full[s]);
          if (TRANS_B) {  // BN / 64 boxes of 64 columns of w rows [kt*BK, +BK) (one of 32 for BN = 32)
            for (int i = 0; i < (BN + 63) / 64; ++i)
              tma_load_2d(sb + s * B_TILE + i * 64 * BK, &map_b, int32_t(n0 + 64 * i), kt * BK, &full[s]);
          } else {
            tma_load_2d(sb + s * B_TILE, &map_b, kt * BK, int32_t(n0), &full[s]);
          }
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  // consumers: warpgroup c owns rows c*64 .. c*64 + 63 of each tile
  const int c = wg - 1;
  if (COMPACT && c == 1) return;
  uint8_t* stage = staging + size_t(c) * 64 * (SLICE_BYTES + STAGE_ROW_PAD);
  constexpr int BOXES = Ring::STORE_BOXES;
  uint8_t* boxes = staging + size_t(c) * BOXES * BOX_BYTES;
  uint32_t g = 0, boxes_used = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int64_t m0, n0;
    origin(tile, m0, n0);
    float d[NREG];
#pragma unroll
    for (int i = 0; i < NREG; ++i) d[i] = 0.0f;
    for (int kt = 0; kt < kt_count; ++kt, ++g) {
      const int s = int(g % STAGES);
      mbar_wait(&full[s], (g / STAGES) & 1);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const uint64_t da = smem_desc(sa + s * A_TILE + c * 64 * BK) + uint64_t(kk * 2);  // +32 bytes per k16
        const uint64_t db = !TRANS_B  ? smem_desc(sb + s * B_TILE) + uint64_t(kk * 2)
                            : BN == 32 ? smem_desc_mn_64b(sb + s * B_TILE) + uint64_t(kk * (1024 >> 4))  // +16 rows
                                       : smem_desc_mn(sb + s * B_TILE) + uint64_t(kk * (2048 >> 4));
        Wgmma<T, false, TRANS_B, BN>::mma(d, da, db, 1);
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      // Keep this k-tile's MMAs in flight; the previous tile's are done, so its stage can be refilled.
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
      if (kt > 0 && t == 0) mbar_arrive(&empty[(g - 1) % STAGES]);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    if (t == 0) mbar_arrive(&empty[(g - 1) % STAGES]);
    if constexpr (BN >= 64) {  // a TMA store box is 128 bytes wide: wider than a 32-wide tile of 16-bit outputs
      if (store_by_tma) {
        epilogue_tma<T, O, BN, BOXES>(d, boxes, bias, &map_out, m0 + c * 64, n0, N, t, c, boxes_used);
        continue;
      }
    }
    epilogue<T, O, BN>(d, stage, bias, out, m0 + c * 64, n0, M, N, t, c);
  }
  if (store_by_tma && t == 0) tma_store_wait_all();  // the copy engine is done with this CTA's boxes
#endif
}


// C[M,N] = A[M,K]·B (+ bias) with BN-wide tiles of Tile<BN, COMPACT>::A_ROWS rows: B is w[N,K]
// (forward) or, with TRANS_B, w[K,N] read along N (dX). The tensor maps are made here because the
// boxes depend on the tile.
template <class T, class O, bool TRANS_B, int BN, bool COMPACT>
void launch_tile(const T* a, const T* b, const T* bias, void* out, int64_t M, int64_t N, int64_t K,
                 cudaStream_t stream) {
  using Ring = Tile<BN, COMPACT>;
  // Fewer rows than a tile: the A box covers the rows that exist (rounded up to 8) instead of letting
  // the copy engine zero-fill the rest, which measured slower than the weight stream itself at M = 1.
  // Only smem rows >= M change (stale instead of zero); their results are never stored, and each
  // stored row's MMAs read the same data either way (the M sweep checks every M in 1..512).
  const int a_rows = M >= Ring::A_ROWS ? Ring::A_ROWS : int((M + 7) / 8 * 8);
  // Decode-sized calls stream the weight once: 256-byte L2 lines help there and nowhere else (a
  // cache hint; see sm90_tma.cuh).
  const bool streaming = M <= 128;
  const CUtensorMap ma = tma_map_2d(a, M, K, a_rows, streaming);
  const CUtensorMap mb = TRANS_B ? tma_map_2d(b, K, N, BK, streaming, BN == 32 ? 64 : 128)
                                 : tma_map_2d(b, N, K, BN, streaming);
  static std::atomic<int> smem_allowed[64] = {};
  allow_dynamic_smem(gemm_sm90<T, O, TRANS_B, BN, COMPACT>, Ring::SMEM_BYTES, smem_allowed, "linear (cuda)");
  // Persistent: one CTA per SM (at most one per tile); the grid decides who computes a tile, never how.
  const int64_t tiles = ((M + Ring::A_ROWS - 1) / Ring::A_ROWS) * ((N + BN - 1) / BN);
  const unsigned grid = unsigned(std::min<int64_t>(tiles, current_sm_count("linear (cuda)")));
  // The output goes out by TMA stores where its rows allow (16-byte pitch and base) and M > 128; the
  // values are the same either way (the M sweep crosses the switch). Measured on an H100 against the
  // threads' own stores: geometric mean over M >= 1024 0.996 against 0.981 (the consumers no longer
  // wait for their global stores before the next tile), but 5-9% slower at M <= 64 on the narrow
  // layers (O), whose calls are a few tiles long and end waiting for the copy engine.
  const bool store_by_tma =
      BN >= 64 && M > 128 && (N * int64_t(sizeof(O))) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  CUtensorMap mo{};
  if (store_by_tma) mo = tma_map_2d(static_cast<const O*>(out), M, N, 64);
  gemm_sm90<T, O, TRANS_B, BN, COMPACT><<<grid, THREADS, Ring::SMEM_BYTES, stream>>>(
      ma, mb, mo, store_by_tma, bias, static_cast<O*>(out), M, N, K, a_rows);
  check(cudaGetLastError(), "linear (cuda)", "sm90 kernel launch");
}

template <class T, class O, bool TRANS_B>
void launch(const T* a, const T* b, const T* bias, void* out, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  const TileChoice choice = tile_choice(M, N, current_sm_count("linear (cuda)"), !TRANS_B);
  auto run = [&](auto width) {
    constexpr int BN = decltype(width)::value;
    if constexpr (BN <= 64 || BN == 256) {
      if (choice.compact) return launch_tile<T, O, TRANS_B, BN, true>(a, b, bias, out, M, N, K, stream);
    }
    if constexpr (BN >= 64) launch_tile<T, O, TRANS_B, BN, false>(a, b, bias, out, M, N, K, stream);
  };
  switch (choice.width) {
    case 32: return run(std::integral_constant<int, 32>{});
    case 48:
      if constexpr (!TRANS_B) return run(std::integral_constant<int, 48>{});
      [[fallthrough]];
    case 64: return run(std::integral_constant<int, 64>{});
    case 128: return run(std::integral_constant<int, 128>{});
    case 192: return run(std::integral_constant<int, 192>{});
    default: return run(std::integral_constant<int, 256>{});
  }
}

}  // namespace

bool sm90_path_available() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return major == 9 && minor == 0;
  }();
  return ok;
}

template <class T>
void gemm_sm90_forward(const T* x, const T* w, const T* bias, void* out, DType out_dtype, int64_t M, int64_t N,
                       int64_t K, cudaStream_t stream) {
  switch (out_dtype) {
    case DType::bf16: return launch<T, __nv_bfloat16, false>(x, w, bias, out, M, N, K, stream);
    case DType::f16: return launch<T, __half, false>(x, w, bias, out, M, N, K, stream);
    default: return launch<T, float, false>(x, w, bias, out, M, N, K, stream);
  }
}

template <class T>
void gemm_sm90_input_grad(const T* dy, const T* w, void* dx, DType out_dtype, int64_t M, int64_t N, int64_t K,
                          cudaStream_t stream) {
  // dx[M,K] = dy[M,N]·w[N,K]: the kernel's K is N (the reduction), its N is K (dx's columns).
  switch (out_dtype) {
    case DType::bf16: return launch<T, __nv_bfloat16, true>(dy, w, nullptr, dx, M, K, N, stream);
    case DType::f16: return launch<T, __half, true>(dy, w, nullptr, dx, M, K, N, stream);
    default: return launch<T, float, true>(dy, w, nullptr, dx, M, K, N, stream);
  }
}

template void gemm_sm90_forward<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, void*,
                                               DType, int64_t, int64_t, int64_t, cudaStream_t);
template void gemm_sm90_forward<__half>(const __half*, const __half*, const __half*, void*, DType, int64_t, int64_t,
                                        int64_t, cudaStream_t);
template void gemm_sm90_input_grad<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, void*, DType, int64_t,
                                                  int64_t, int64_t, cudaStream_t);
template void gemm_sm90_input_grad<__half>(const __half*, const __half*, void*, DType, int64_t, int64_t, int64_t,
                                           cudaStream_t);

}  // namespace samebits::cuda
