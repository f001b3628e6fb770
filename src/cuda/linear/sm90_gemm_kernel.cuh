// The Hopper (sm_90a) GEMM kernel C = A·B, shared by the GEMM family (gemm_sm90.cu: y = x·wᵀ and
// dX = dY·w) and the fused LM head (logprob/lm_head.cu), which differ only in what happens to a
// finished tile. The why of its shape (tiles, ring, raster, warp roles) is in gemm_sm90.cu.
//
// The epilogue is a policy class Epi, called by each consumer warpgroup for each of its tiles:
//   Params                    trivially copyable, passed by value as a __grid_constant__ kernel
//                             parameter (it may hold CUtensorMaps);
//   State                     per-consumer state carried across the CTA's tiles;
//   begin_tile<BN>(...)       sets the fp32 accumulators before the first MMA (zeros, or an fp32
//                             C that the MMAs continue: the same register state as if the K loop
//                             had never stopped), and may start loads the epilogue needs (State);
//   end_tile<BN, BOXES>(...)  consumes the accumulators: d[j*4 + h*2 + e] holds row
//                             row_base + warp*16 + lane/4 + 8h, column n0 + 8j + 2*(lane%4) + e;
//                             `staging` is the CTA's epilogue area (Tile::STAGING_BYTES);
//   finish(...)               once per consumer thread and product after its last tile.
// Every element's K sequence is the mainloop's, whatever the epilogue: the logits a fused
// epilogue sees are bitwise the values the plain GEMM stores in fp32.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/common/pdl.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/sm90/primitives.cuh"
#include "cuda/common/sm90/tma.cuh"

namespace samebits::cuda::sm90gemm {

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


// A CTA's tile is 128 rows, 64 per consumer warpgroup. A COMPACT tile is one consumer's 64 rows:
// for decode-sized M a ring slot then holds 64 rows of x instead of 128, so the same ring holds more
// stages of the weight, which is what such a call streams (12 instead of 8 stages for BN = 64, 5
// instead of 4 for BN = 256), and 64 < M <= 128 gets twice the tiles. The second consumer warpgroup
// has no rows and leaves at once. Every stored row runs the same wgmma sequence as in a full tile.
//
// A stage holds KB k-boxes of BK: narrow compact forward tiles (32 / 48 columns, decode-sized M) take
// 4 / 2 where K is a multiple of KB boxes (wide_boxes), so a stage carries 16 / 12 KiB of the
// weight instead of 4 / 6 and the ring hands over a quarter / half as many stages for the same bytes
// in flight (each hand-over is a barrier wait, a fence, a commit and a release). The wgmma sequence
// is the same: k16 steps in ascending order into the same accumulators.
constexpr int wide_boxes(int bn, bool compact, bool trans_b) {
  return !trans_b && compact ? (bn == 32 ? 4 : bn == 48 ? 2 : 1) : 1;
}
//
// A thin ring (AR = THIN_ROWS, compact forward tiles of calls with M <= THIN_ROWS: decode steps of a
// few sequences) keeps THIN_ROWS rows of x a k-box instead of 64. The wgmma still reads 64 rows from
// each box's start: rows THIN_ROWS … 63 run on into the next boxes and stages (or the B tiles after
// the last), whatever they hold at the time. Those rows' results are never stored (a wgmma never
// mixes rows: a row of C is its row of A against B), so every stored row runs the same MMAs on the
// same data; the ring then holds two to three times the stages of the weight, which a decode-sized
// call streams — more of it loaded before the wait for the previous kernel (early weights).
constexpr int THIN_ROWS = 16;
template <int BN, bool COMPACT, int KB = 1, int AR = COMPACT ? 64 : BM>
struct Tile {
  static constexpr int A_ROWS = COMPACT ? 64 : BM, RELEASERS = COMPACT ? 1 : CONSUMERS;
  static_assert(AR == A_ROWS || (COMPACT && AR == THIN_ROWS), "a thin ring only for compact tiles");
  static constexpr int A_BOX = AR * BK, B_BOX = BN * BK;   // elements of one k-box (A: the rows the ring keeps)
  static constexpr int A_TILE = A_BOX * KB, B_TILE = B_BOX * KB;  // elements of a stage
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

// An epilogue that declares `static constexpr bool kPairedHalves = true` takes tiles that pair two
// products (count 2, the same N): a tile's first BN/2 columns are product 0's columns n0 … n0 + BN/2 − 1
// and its other BN/2 the same columns of product 1 (gate and up: the SwiGLU epilogue then writes
// silu(gate)·up, BN/2 columns). Each element's K sequence is the plain tile's: a wgmma column never
// sees another column, so a column's bits do not depend on which tile or half holds it.
template <class Epi, class = void>
struct PairedHalves : std::false_type {};
template <class Epi>
struct PairedHalves<Epi, std::void_t<decltype(Epi::kPairedHalves)>> : std::bool_constant<Epi::kPairedHalves> {};

// The products one launch computes: C_g = A·B_g for g < count (at most G), every one with A's rows
// and K, its own B, N and epilogue parameters (a layer's Q, K and V, or gate and up, all reading
// the same x). Their column tiles lie side by side, group 0's first, so one grid covers them all;
// a tile never straddles two products, and each element's K sequence is the one a launch of its
// product alone runs.
template <class Epi, int G>
struct Products {
  CUtensorMap map_b[G];
  typename Epi::Params ep[G];
  int64_t N[G];
  int64_t first_tile[G + 1];  // column tiles before product g; first_tile[count]: all of them
  int count;
  int b_settled;  // the B_g were written before the previous kernel: the ring's first loads of B go before the wait
};

template <class T, bool TRANS_B, int BN, bool COMPACT, class Epi, int G, int KB, int AR>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_sm90(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ Products<Epi, G> prod, int64_t M,
              int64_t K, int a_rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* sa = reinterpret_cast<T*>(base);
  using Ring = Tile<BN, COMPACT, KB, AR>;
  constexpr int A_TILE = Ring::A_TILE, B_TILE = Ring::B_TILE, NREG = BN / 2, STAGES = Ring::STAGES;
  constexpr int A_BOX = Ring::A_BOX, B_BOX = Ring::B_BOX;
  static_assert(!TRANS_B || KB == 1, "the dX path loads and multiplies one k-box a stage");
  constexpr bool PAIRED = PairedHalves<Epi>::value;
  constexpr int TILE_COLS = PAIRED ? BN / 2 : BN;  // a product's columns a tile covers
  static_assert(!PAIRED || (!TRANS_B && G == 2 && TILE_COLS % 8 == 0), "paired halves: forward, two products");
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
  const int64_t m_tiles = (M + TM - 1) / TM, n_tiles = prod.first_tile[prod.count], tiles = m_tiles * n_tiles;
  // A tile's product p and origin (m0, n0) in that product's C.
  auto origin = [&](int64_t tile, int& p, int64_t& m0, int64_t& n0) {
    const int64_t group = tile / (GROUP_M * n_tiles), first_m = group * GROUP_M;
    const int64_t group_rows = m_tiles - first_m < GROUP_M ? m_tiles - first_m : GROUP_M;
    const int64_t in_group = tile % (GROUP_M * n_tiles);
    m0 = (first_m + in_group % group_rows) * TM;
    const int64_t column_tile = in_group / group_rows;
    p = 0;
#pragma unroll
    for (int i = 1; i < G; ++i)
      if (i < prod.count && column_tile >= prod.first_tile[i]) p = i;
    n0 = (column_tile - prod.first_tile[p]) * TILE_COLS;
  };
  // Stages a tile: K's boxes of BK, KB a stage (the launch takes KB > 1 only where KB divides them).
  const int kt_count = int((K + BK - 1) / BK) / KB;
  const uint32_t stage_bytes = uint32_t(KB * (a_rows * BK + B_BOX) * int(sizeof(T)));
  init_ring_barriers(full, empty, STAGES, Ring::RELEASERS);
  // Stage s's A and B tiles: stage kt's k-boxes of x rows m0 … and of the product's w, columns n0 ….
  auto load_a = [&](int s, int kt, int64_t m0) {
    for (int b = 0; b < KB; ++b)
      tma_load_2d(sa + s * A_TILE + b * A_BOX, &map_a, (kt * KB + b) * BK, int32_t(m0), &full[s]);
  };
  auto load_b = [&](int s, const CUtensorMap* map_b, int kt, int64_t n0) {
    if (TRANS_B) {  // BN / 64 boxes of 64 columns of w rows [kt*BK, +BK) (one of 32 for BN = 32)
      for (int i = 0; i < (BN + 63) / 64; ++i)
        tma_load_2d(sb + s * B_TILE + i * 64 * BK, map_b, int32_t(n0 + 64 * i), kt * BK, &full[s]);
    } else if constexpr (PAIRED) {  // each k-box: product 0's BN/2 rows of w, then product 1's same rows
      for (int b = 0; b < KB; ++b) {
        tma_load_2d(sb + s * B_TILE + b * B_BOX, &prod.map_b[0], (kt * KB + b) * BK, int32_t(n0), &full[s]);
        tma_load_2d(sb + s * B_TILE + b * B_BOX + TILE_COLS * BK, &prod.map_b[1], (kt * KB + b) * BK, int32_t(n0),
                    &full[s]);
      }
    } else {
      for (int b = 0; b < KB; ++b)
        tma_load_2d(sb + s * B_TILE + b * B_BOX, map_b, (kt * KB + b) * BK, int32_t(n0), &full[s]);
    }
  };
  // Settled weights: the producer fills the ring's first stages with the first tile's B before the
  // wait below, while the previous kernel may still run (a decode step's GEMMs stream weights the
  // previous kernel never writes); their A comes after it. Each stage's barrier expects both.
  // (Measured and dropped, session 21, H100, Qwen3-8B decode at 1k: also prefetching the tile's
  // next k-tiles into L2 here (cp.async.bulk.prefetch.tensor) — 192 KiB a CTA made B = 1 / 8 / 64
  // steps 7% / 6% / 4% slower, 512 KiB 21% / 20% / 14%: the prefetches queue in the copy engine
  // ahead of the mainloop's own loads.)
  int early = 0;  // k-tiles of the CTA's first tile whose B is issued here
  if (prod.b_settled && wg == 0 && t == 0 && int64_t(blockIdx.x) < tiles) {
    int p;
    int64_t m0, n0;
    origin(blockIdx.x, p, m0, n0);
    early = kt_count < STAGES ? kt_count : STAGES;
    for (int kt = 0; kt < early; ++kt) {
      mbar_expect_tx(&full[kt], stage_bytes);
      load_b(kt, &prod.map_b[p], kt, n0);
    }
  }
  // Launched after the previous kernel (cuda/common/pdl.cuh): the CTA got here while that kernel
  // may still run; every thread waits for it before touching global memory (x, C, the output, and w
  // but for the settled loads above), then lets the next kernel's CTAs be scheduled as this one's end.
  pdl_wait();
  pdl_launch_dependents();

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (t == 0) {
      uint32_t g = 0;  // k-tiles issued by this CTA, across its tiles
      for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int p;
        int64_t m0, n0;
        origin(tile, p, m0, n0);
        const CUtensorMap* map_b = &prod.map_b[p];
        for (int kt = 0; kt < kt_count; ++kt, ++g) {
          const int s = int(g % STAGES);
          if (g < uint32_t(early)) {  // its B is on the way: A alone
            load_a(s, kt, m0);
            continue;
          }
          if (g >= STAGES) mbar_wait(&empty[s], ((g / STAGES) - 1) & 1);
          mbar_expect_tx(&full[s], stage_bytes);
          load_a(s, kt, m0);
          load_b(s, map_b, kt, n0);
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  // consumers: warpgroup c owns rows c*64 .. c*64 + 63 of each tile
  const int c = wg - 1;
  if (COMPACT && c == 1) return;
  typename Epi::State state{};
  uint32_t g = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int p;
    int64_t m0, n0;
    origin(tile, p, m0, n0);
    const typename Epi::Params& ep = prod.ep[p];
    const int64_t N = prod.N[p];
    float d[NREG];
    Epi::template begin_tile<BN>(ep, d, m0 + c * 64, n0, M, N, t, state);
    for (int kt = 0; kt < kt_count; ++kt, ++g) {
      const int s = int(g % STAGES);
      mbar_wait(&full[s], (g / STAGES) & 1);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int b = 0; b < KB; ++b) {
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          const uint64_t da = smem_desc(sa + s * A_TILE + b * A_BOX + c * 64 * BK) + uint64_t(kk * 2);  // +32 bytes per k16
          const uint64_t db = !TRANS_B  ? smem_desc(sb + s * B_TILE + b * B_BOX) + uint64_t(kk * 2)
                              : BN == 32 ? smem_desc_mn_64b(sb + s * B_TILE) + uint64_t(kk * (1024 >> 4))  // +16 rows
                                         : smem_desc_mn(sb + s * B_TILE) + uint64_t(kk * (2048 >> 4));
          Wgmma<T, false, TRANS_B, BN>::mma(d, da, db, 1);
        }
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      // Keep this k-tile's MMAs in flight; the previous tile's are done, so its stage can be refilled.
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
      if (kt > 0 && t == 0) mbar_arrive(&empty[(g - 1) % STAGES]);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    if (t == 0) mbar_arrive(&empty[(g - 1) % STAGES]);
    Epi::template end_tile<BN, Ring::STORE_BOXES>(ep, d, staging, m0 + c * 64, n0, M, N, t, c, state);
  }
#pragma unroll
  for (int i = 0; i < G; ++i)
    if (i < prod.count) Epi::finish(prod.ep[i], t, state);
#endif
}


// Launches C_g[M,N_g] = A[M,K]·B_g for the `count` products g (at most G) with BN-wide tiles of
// Tile<BN, COMPACT>::A_ROWS rows: B_g is w_g[N_g,K] (forward) or, with TRANS_B, w_g[K,N_g] read
// along N (dX). The tensor maps of A and the B_g are made here because their boxes depend on the
// tile; the epilogues' parameters come ready-made.
template <class T, bool TRANS_B, int BN, bool COMPACT, class Epi, int G, int KB, int AR>
void launch_products_kb(const T* a, const T* const (&b)[G], const typename Epi::Params (&ep)[G], const int64_t (&N)[G],
                        int count, int64_t M, int64_t K, cudaStream_t stream, const char* op, bool b_settled) {
  using Ring = Tile<BN, COMPACT, KB, AR>;
  // Fewer rows than a tile: the A box covers the rows that exist (rounded up to 8) instead of letting
  // the copy engine zero-fill the rest, which measured slower than the weight stream itself at M = 1.
  // Only smem rows >= M change (stale instead of zero); their results are never stored, and each
  // stored row's MMAs read the same data either way (the M sweep checks every M in 1..512).
  const int a_rows = M >= Ring::A_ROWS ? Ring::A_ROWS : int((M + 7) / 8 * 8);
  if (a_rows > AR) throw Error(op, "M", "more rows than the thin ring keeps (cannot happen)");
  // Decode-sized calls stream the weight once: 256-byte L2 lines help there and nowhere else (a
  // cache hint; see cuda/common/sm90/tma.cuh).
  const bool streaming = M <= 128;
  const CUtensorMap ma = tma_map_2d(a, M, K, a_rows, streaming);
  Products<Epi, G> prod{};
  prod.count = count;
  // Paired halves (PairedHalves): the two products' maps box BN/2 rows, and the tiles are product
  // 0's columns in steps of BN/2 (every tile index below first_tile[1]: the kernel's product 0).
  constexpr bool paired = PairedHalves<Epi>::value;
  if (paired && (count != 2 || N[0] != N[count - 1]))
    throw Error(op, "products", "paired halves take two products of one width (cannot happen)");
  static const bool early_weights = env_switch("SAMEBITS_EARLY_WEIGHTS");
  prod.b_settled = b_settled && early_weights ? 1 : 0;
  prod.first_tile[0] = 0;
  for (int g = 0; g < count; ++g) {
    prod.map_b[g] = TRANS_B ? tma_map_2d(b[g], K, N[g], BK, streaming, BN == 32 ? 64 : 128)
                            : tma_map_2d(b[g], N[g], K, paired ? BN / 2 : BN, streaming);
    prod.ep[g] = ep[g];
    prod.N[g] = N[g];
    prod.first_tile[g + 1] = paired ? (N[0] + BN / 2 - 1) / (BN / 2) : prod.first_tile[g] + (N[g] + BN - 1) / BN;
  }
  static std::atomic<int> smem_allowed[64] = {};
  allow_dynamic_smem(gemm_sm90<T, TRANS_B, BN, COMPACT, Epi, G, KB, AR>, Ring::SMEM_BYTES, smem_allowed, op);
  // Persistent: one CTA per SM (at most one per tile); the grid decides who computes a tile, never how.
  const int64_t tiles = ((M + Ring::A_ROWS - 1) / Ring::A_ROWS) * prod.first_tile[count];
  const unsigned grid = unsigned(std::min<int64_t>(tiles, current_sm_count(op)));
  launch_after_previous(gemm_sm90<T, TRANS_B, BN, COMPACT, Epi, G, KB, AR>, dim3(grid), dim3(THREADS), Ring::SMEM_BYTES,
                        stream, op, ma, prod, M, K, a_rows);
}

// The ring's k-boxes a stage (KB) and rows of x a box (AR) for this call; neither changes an MMA.
template <class T, bool TRANS_B, int BN, bool COMPACT, class Epi, int G, int AR>
void launch_products_ar(const T* a, const T* const (&b)[G], const typename Epi::Params (&ep)[G], const int64_t (&N)[G],
                        int count, int64_t M, int64_t K, cudaStream_t stream, const char* op, bool b_settled) {
  constexpr int kb = wide_boxes(BN, COMPACT, TRANS_B);
  static const bool wide = env_switch("SAMEBITS_WIDE_STAGES");  // "0": one k-box a stage (A/B runs)
  if constexpr (kb > 1) {
    if (wide && ((K + BK - 1) / BK) % kb == 0)
      return launch_products_kb<T, TRANS_B, BN, COMPACT, Epi, G, kb, AR>(a, b, ep, N, count, M, K, stream, op, b_settled);
  }
  launch_products_kb<T, TRANS_B, BN, COMPACT, Epi, G, 1, AR>(a, b, ep, N, count, M, K, stream, op, b_settled);
}

template <class T, bool TRANS_B, int BN, bool COMPACT, class Epi, int G>
void launch_products(const T* a, const T* const (&b)[G], const typename Epi::Params (&ep)[G], const int64_t (&N)[G],
                     int count, int64_t M, int64_t K, cudaStream_t stream, const char* op, bool b_settled = false) {
  constexpr int full_rows = Tile<BN, COMPACT>::A_ROWS;
  if constexpr (COMPACT && !TRANS_B) {  // the forward's decode-sized calls: a thin ring (Tile)
    static const bool thin = env_switch("SAMEBITS_THIN_RING");  // "0": 64 rows of x a box (A/B runs)
    if (thin && M <= THIN_ROWS)
      return launch_products_ar<T, TRANS_B, BN, COMPACT, Epi, G, THIN_ROWS>(a, b, ep, N, count, M, K, stream, op,
                                                                             b_settled);
  }
  launch_products_ar<T, TRANS_B, BN, COMPACT, Epi, G, full_rows>(a, b, ep, N, count, M, K, stream, op, b_settled);
}

// One product: C[M,N] = A[M,K]·B.
template <class T, bool TRANS_B, int BN, bool COMPACT, class Epi>
void launch(const T* a, const T* b, const typename Epi::Params& ep, int64_t M, int64_t N, int64_t K,
            cudaStream_t stream, const char* op) {
  const T* const bs[1] = {b};
  const typename Epi::Params eps[1] = {ep};
  const int64_t ns[1] = {N};
  launch_products<T, TRANS_B, BN, COMPACT, Epi, 1>(a, bs, eps, ns, 1, M, K, stream, op);
}

}  // namespace samebits::cuda::sm90gemm
