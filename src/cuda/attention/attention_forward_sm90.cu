// CUDA causal GQA attention forward on Hopper (sm_90a): TMA loads, wgmma, one kernel for packed
// prefill, chunked prefill and decode, with split-KV at fixed absolute key positions.
//
// Why this shape.
//  * A CTA is three warpgroups: a producer (one warp issues the TMA loads of Q once and of K / V
//    key blocks into a ring: as many stages as fit — 2 at D = 128, 5 at D = 64, or 3–6 in the
//    single-span kernel below; in the persistent
//    decode kernel a second warp zeroes tail blocks' V rows, below) and two consumers of
//    64 query rows each. S = Q·Kᵀ is one
//    wgmma m64n128k16 chain over head_dim in ascending 16-wide steps (A and B from shared memory);
//    O += P·V is one wgmma m64nDk16 chain over the block's 128 keys with P in registers. A wgmma
//    never mixes rows, so which rows share a CTA changes no bit.
//  * Keys are walked in blocks of BN = 128 aligned to key position 0, ascending, with an online
//    softmax. Every SPLIT = 1024 keys (8 blocks) the span's state (m, l, o) is folded into the
//    running state (M, L, O) by attention_common.cuh's fold — the same fold the split-KV combine
//    kernel applies to spans computed by separate CTAs. So a long decode can spread its keys over
//    CTAs (one a span) and still give the bits of the prefill, which folds the same spans in order
//    inside one CTA. A block or a span past a row's position is fully masked for it and changes no
//    bit (p = 0, rescale 1; a span with m = −inf is not folded).
//  * Rows of a work item are (token, head) pairs: prefill tiles are 128 tokens of one query head;
//    decode-sized work (q_len · G ≤ 128 for a GQA group of G heads) packs the group's heads into
//    the rows, so the group's queries read each K / V block once. The running (M, L, O) lives in
//    registers (M, L) and in shared memory (O, one slice per thread, touched once a span).
//  * A small decode is latency-bound inside few CTAs (B = 1, C = 1k: 8 CTAs of 8 key blocks) and
//    each CTA's tensor work is 64 query rows of which G are real: such grids run each item as up to
//    four CTAs, each computing a part of O's columns (same products, same order: same bits).
//  * V rows past the sequence's keys (another sequence's, or an unwritten cache slot that may hold
//    NaN) must not reach P·V, where 0 · NaN = NaN: the block that holds the sequence's last key has
//    its V rows past the end zeroed (after a wait for that V to land) before the consumers are told
//    the stage is full; in the persistent decode kernel by a second producer warp, so the loading
//    warp runs on into the next items (waiting for each tail itself, its loads stalled once an item:
//    measured on the H100, B = 64 / 256 at C = 4000 0.98 / 0.96× the time, a decode step at B = 64,
//    1k 10.96 → 10.75 ms).
//    K rows past the end only reach masked scores, which a select replaces.
//  * Decode steps (every item one span of at most 64 rows) run a single-span variant: one consumer,
//    no running O in shared memory (the span folds into the empty state in registers, the same
//    arithmetic), and that room as a deeper ring, so a CTA walking a span's 8 blocks has several
//    loads ahead instead of one. Over whole O columns it is persistent: at most one CTA an SM, each
//    walking its items (ItemWalk) with its ring and its two Q buffers running on from one item into
//    the next: a CTA an item left each SM's memory stream idle at every item's end
//    (the last blocks' compute, the write, the next CTA's start and first loads). Measured on the
//    H100 (Qwen3-8B shape, whole decode step): B = 64, C = 1k 1.5% faster, C = 4k 0.7% slower; the
//    kernel still reads the KV at ~77% of the copy bandwidth there (docs/attention.md).
//  * Prefill (PAIRED; SAMEBITS_PERSISTENT_PREFILL=0 turns it off, for A/B runs): the same persistence
//    for items of up to 128 rows — two consumers a CTA for every item, each with its own Q buffer,
//    which it frees at the item's last S = Q·Kᵀ so the next item's Q loads during the last block's
//    P·V and the write; over single-span items the single-span kernel's deeper ring and O in
//    registers, else the general kernel's ring and running O. A CTA an item pays the CTA's start, its
//    first loads and its drained ring at every item, which at S = 1k (items of 1–8 blocks) is a
//    large share of its ~5 µs (H200: 0.79× the time at S = 1k, 0.94× at 2k).
//  * OVERLAP (the prefill kernels, general and paired; SAMEBITS_ATTENTION_OVERLAP=0 turns it off;
//    the decode kernel can take it, and measured 1.00–1.05× the time there, so does not): block j's
//    S is issued, then block j − 1's P·V, which runs on the tensor cores during block j's softmax
//    instead of before it (FlashAttention-3's intra-warpgroup overlap); o is rescaled once it is
//    done, so every element sees the same operations in the same order. A stage's K and V are then
//    released apart (V is held about a softmax longer). The loop is peeled (the span's first S
//    alone, its last P·V after the loop): a wgmma issued under a branch, or a wait between two
//    products' wgmma, made ptxas serialise them.
// No atomics: every output element is written by one thread; spans are combined in a fixed order.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "cuda/common/pdl.cuh"
#include "cuda/attention/attention_common.cuh"
#include "cuda/attention/attention_host.hpp"
#include "cuda/attention/attention_sm90.hpp"
#include "cuda/attention/item_walk.hpp"
#include "cuda/common/host_upload.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "cuda/common/sm90/primitives.cuh"
#include "cuda/common/sm90/tma.cuh"
#include "ops/tuning.hpp"
#include "samebits/error.hpp"

namespace samebits::cuda::attention {
namespace {

using namespace sm90;

constexpr int BM = 128, BN = 128, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
constexpr int SPLIT_BLOCKS = ATTENTION_SPLIT_KEYS / BN;
static_assert(ATTENTION_SPLIT_KEYS % BN == 0, "a span is whole key blocks");

// One CTA's work: `rows` rows, row i = token q_row + i / group at position first_pos + i / group,
// query head head0 + i % group (head0 = head · group: `head` is the query head when group == 1 and
// the key/value head otherwise), against key blocks [block_begin, block_end) of keys
// [k_row, k_row + k_len) of sequence `seq` (or its pages). part < 0: the item covers all of its rows' spans and writes out / lse;
// else it is one span, written unfolded to the partial rows part … part + rows − 1.
// d_split (kernels with PARTS > 1 only): 1 … PARTS = the item computes that part of O's columns
// (and reads the V columns of that part).
struct Item {
  int32_t q_row, rows, k_row, k_len, first_pos, head, group, block_begin, block_end, part, seq, d_split;
};
// The spans of one decode-sized row set, for the combine kernel: span s of row i is partial row
// part + s · rows + i.
struct Combine {
  int32_t q_row, rows, group, head0, part, spans;
};

// Small work tables travel in the kernel parameters (no host-to-device copy before a decode step);
// larger ones in device memory. Where the table is read from changes no arithmetic.
constexpr int INLINE_ITEMS = 64, INLINE_COMBINES = 8;

struct Params {
  CUtensorMap q_heads, q_groups, k, v;  // q boxes {64, 1, 64} and {64, G, 64 / G}; k, v {64, 1, BN}
  const Item* items;  // null: inline_items
  const Combine* combines;  // null: inline_combines
  Item inline_items[INLINE_ITEMS];
  Combine inline_combines[INLINE_COMBINES];
  KeyPages pages;
  int kv_box;  // key rows a K / V load brings: BN, or the page size where pages are smaller
  void* out;
  float* lse;
  float* part_o;   // [partial rows, D]
  float* part_ml;  // [partial rows, 2]: m, l
  int Hq, Hkv, G;
  int n_items;  // the persistent kernels' CTAs walk the items below it (ItemWalk)
  int snake;    // 1: the persistent walk turns at every round's end (ItemWalk); 0: it does not (A/B runs)
  int turns_across;  // 1: the paired kernel's ping-pong turns run on across items; 0: they restart at each (A/B runs)
  int prefetch_q;    // 1: the paired kernel's producer brings the next item's Q into L2 as it loads this one's
  int vector_out;    // 1: the wgmma consumers store out in 16-byte pieces (a quad transpose); 0: 4-byte ones (A/B runs)
  int n_combines;  // combine CTAs at or past it have nothing to do (a graph's combine node of a step without split spans)
  float scale, scale_log2;  // scale·log2(e): the exponentials are base 2
};

static_assert(sizeof(Params) <= 4096, "the classic kernel-parameter limit");

// A CTA's shared memory. The general kernel: Q of two consumers, a ring of K / V blocks (as many
// stages as fit: 2 at D = 128, 5 at D = 64, where it had 2 until session 28) and the running O of
// the spans folded so far. The single-span kernel (SINGLE: every item one span of
// at most 64 rows — decode steps, whose items are one span each): Q of this item and the next, no running O
// (its one span is folded into the empty state in registers, the same arithmetic), and the room
// that frees as a deeper ring (3 stages of K / V at D = 128, 4 where a CTA reads one V box), so a CTA
// walking a span's blocks has more of them in flight. V stages hold only the 64-column boxes of the
// CTA's O columns.
// The narrow consumer's exchange area (NARROW, below): the block's P (T, rows padded so that
// ldmatrix's eight rows fall in distinct banks), each (row, quad lane)'s pair sums of the block's 16
// column tiles, and each warp's row maxima.
constexpr int NARROW_ROWS = 16;
struct NarrowSmem {
  static constexpr int P_STRIDE = BN * 2 + 16;  // bytes a P row
  static constexpr int P_BYTES = NARROW_ROWS * P_STRIDE;
  static constexpr int X_FLOATS = (BN / 8) * NARROW_ROWS * 4;  // [column tile][row][quad lane]: lanes apart
  static constexpr int MAX_FLOATS = 4 * NARROW_ROWS;            // [warp][row]
  static constexpr int BYTES = P_BYTES + (X_FLOATS + MAX_FLOATS) * 4;
};

template <int D, int PARTS, bool SINGLE, bool NARROW = false>
struct Smem {
  static constexpr int BOXES = D / 64;  // 64-column boxes of a row
  static constexpr int ON = D / PARTS, V_BOXES = (ON + 63) / 64;
  // Q buffers of 64 rows: one a consumer (the general kernel; the paired kernel, item after item), or
  // (the persistent single-span kernel) one an item, two in turn — the next item's Q loads while the
  // current item's blocks are consumed. The narrow consumer takes its
  // item's Q into registers first thing and frees the buffer: one is enough, and the 16 KiB it leaves
  // (at D = 128) hold its exchange area without costing a K / V stage.
  static constexpr int Q_BUFFERS = NARROW ? 1 : 2;
  static constexpr int Q_BYTES = Q_BUFFERS * 64 * D * 2, K_BYTES = BOXES * BN * 128, V_BYTES = V_BOXES * BN * 128;
  static constexpr int O_BYTES = SINGLE ? 0 : BM * D * 4;
  static constexpr int X_BYTES = NARROW ? NarrowSmem::BYTES : 0;  // the narrow consumer's exchange area
  static constexpr int LIMIT = 227 * 1024, SLACK = 1024 + 64 * 8;  // alignment, barriers
  static constexpr int FIT = (LIMIT - Q_BYTES - O_BYTES - X_BYTES - SLACK) / (K_BYTES + V_BYTES);
  static constexpr int STAGES = FIT < SPLIT_BLOCKS ? FIT : SPLIT_BLOCKS;
  static constexpr int BARRIERS = 2 * Q_BUFFERS + 5 * STAGES;
  static constexpr size_t BYTES =
      size_t(Q_BYTES) + size_t(STAGES) * (K_BYTES + V_BYTES) + O_BYTES + X_BYTES + BARRIERS * 8 + 1024;
  static_assert(STAGES >= 2 && BYTES <= size_t(LIMIT), "shared memory of one Hopper CTA");
  static_assert(!NARROW || SINGLE, "the narrow consumer runs single-span items");
  static_assert(!NARROW || STAGES >= Smem<D, PARTS, SINGLE, false>::STAGES,
                "the narrow consumer's ring as deep as the wgmma consumer's (a fair A/B)");
};

// Whether a kernel walks many items a CTA: the single-span kernel over whole O columns (a grid of
// O-column parts is at most half the SMs, the general kernel's grid is its items). The kernel's loop
// and the launch's grid (grid_of) both follow it.
constexpr bool persistent_kernel(bool single, int parts, bool paired) { return paired || (single && parts == 1); }
// Which forward kernel runs a call — ForwardKernels' first index: the general kernel (0), the
// single-span kernel (1), the single-span kernel with the narrow consumer (2), the paired persistent
// kernel over the general (3) or the single-span layout (4); and with a block's P·V during the next
// block's softmax (overlap): the single-span kernel (5), the paired one over its layout (6), the
// general kernel (7) and the paired one over its layout (8).
constexpr int kernel_kind(bool single, bool narrow, bool paired = false, bool overlap = false) {
  if (narrow) return 2;
  if (paired) return single ? (overlap ? 6 : 4) : (overlap ? 8 : 3);
  return single ? (overlap ? 5 : 1) : (overlap ? 7 : 0);
}

// The Q buffer consumer c reads for its CTA's k-th item, and which use of it that is (round: its
// barriers' phase): a buffer a consumer (the general kernel, one item; the paired kernel, item after
// item), or the persistent single-span kernel's `buffers` in turn (one, the narrow consumer's).
// (maybe_unused: the sm_80 pass compiles the kernel bodies out.)
[[maybe_unused]] __host__ __device__ constexpr int q_slot(bool paired, bool persistent, int buffers, int k, int c,
                                                          int& round) {
  round = paired ? k : persistent ? k / buffers : 0;
  return persistent && !paired ? k % buffers : c;
}

// The narrow consumer (NARROW: every item of the call one span of at most 16 rows — a decode step's
// items are one token's GQA group, 4 rows for Qwen3-8B or Llama-3-8B).
// Why: the wgmma kernel gives such an item 64-row tiles of which 60 rows are idle, and its
// S = Q·Kᵀ (64 × 128 × D a block) holds the tensor cores on the chain a CTA walks block after
// block (~1.3 µs a block on the H100: a B = 1 decode's attention is latency, not bytes). mma.sync
// works on 16-row tiles and gives wgmma's bits (bench/probes/mma_sync_bits.cu: D = C + A·B over k16
// steps, no element of 819,200 differs, bf16 and f16, exponents spread over ±30 binades; H200), so
// the consumer's four warps split a block's 128 keys for S (32 each), exchange the rows' maxima in
// shared memory, and split O's columns for P·V, each with the whole block's P from shared memory.
// Every value the wgmma kernel rounds is rounded here by the same expression, in the same order:
//  * S: each element's D/16 k16 steps in ascending order (the probe's equality);
//  * the row max: exact in any order (the warps' maxima meet in shared memory);
//  * p = 2^(s·c − m·c), the rescale 2^(m_old·c − m·c), o·alpha, P rounded to T: elementwise;
//  * the row sum: the wgmma kernel's quad lane q adds the pairs of its columns 8·nt + 2q, + 1 over
//    the block's 16 column tiles nt in ascending order, then l = l·alpha + sum, and the four lanes'
//    l meet at the span's end ((l0 + l1) + (l2 + l3)); here the warps leave their tiles' pair sums
//    in shared memory and every thread adds its quad lane's 16 in that order (each warp holds every
//    row, so each has the state of all 16 rows, as every thread of the wgmma kernel has its own);
//  * O += P·V: the block's 8 k16 steps of keys in ascending order into each output element.
// Rows past the item's (the Q box's other rows) are computed and never written; a row never mixes
// with another in an MMA, and the maxima and sums are a row's own. A block's S is issued before the
// previous block's two barriers, so its MMAs run while the warps meet (the chain a CTA walks is the
// time of a small decode); which instruction waits where changes no value.
template <class T, int D, int PARTS, int STAGES, bool PERSISTENT>
__device__ __forceinline__ void narrow_consumer(const Params& p, ItemWalk walk, const uint8_t* sq,
                                                const uint8_t* sk, uint8_t* sv, uint8_t* exchange,
                                                uint64_t* full_q, uint64_t* q_empty, uint64_t* full_k,
                                                uint64_t* full_v, uint64_t* empty) {
  using S = Smem<D, PARTS, true, true>;
  using X = NarrowSmem;
  constexpr int ON = D / PARTS, WN = ON / 4, NT = WN / 8;  // a warp's O columns: NT tiles of 8
  static_assert(WN % 8 == 0, "a warp's O columns are whole 8-column tiles");
  constexpr int KT = BN / 16, TILES = BN / 8, WARP_KEYS = BN / 4, WARP_TILES = WARP_KEYS / 8;
  uint8_t* sp = exchange;                                               // P [16][P_STRIDE bytes]
  float* xs = reinterpret_cast<float*>(exchange + X::P_BYTES);          // pair sums [tile][row][q]
  float* maxes = xs + X::X_FLOATS;                                      // [warp][row]
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32, q = lane % 4, r = lane / 4;
  const float c2 = p.scale_log2;
  // The byte offset of a row's 16-byte chunk in a 128B-swizzled box of 128-byte rows, and ldmatrix's
  // row address there (of matrix lane / 8, row lane % 8).
  auto swizzled = [](int row, int chunk) { return row * 128 + ((chunk ^ (row % 8)) * 16); };
  auto swz = [&](const uint8_t* box, int row, int chunk) {
    return reinterpret_cast<const uint16_t*>(box + swizzled(row, chunk));
  };
  const int mi = lane / 8, mr = lane % 8;
  int n = 0;  // blocks consumed (the ring's count runs on across items)
  for (int k = 0, idx; (idx = walk(k)) >= 0; ++k) {
    const Item it = p.items ? p.items[idx] : p.inline_items[idx];
    const int d0 = PARTS > 1 ? (it.d_split - 1) * ON : 0;  // the first of the CTA's O columns
    const bool writes_stats = (PARTS == 1 || it.d_split == 1) && warp == 0;
    const int pos0 = it.first_pos + r / it.group, pos1 = it.first_pos + (r + 8) / it.group;
    int q_round;
    const int qb = q_slot(false, PERSISTENT, S::Q_BUFFERS, k, 0, q_round);
    mbar_wait(&full_q[qb], q_round & 1);
    // Q's A fragments (rows 0–15) of every k16 step, in registers for the item; its buffer is free then.
    uint32_t qa[D / 16][4];
    const uint8_t* qbase = sq + qb * S::BOXES * 64 * 128;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      ldsm_x4(qa[kk], swz(qbase + (kk / 4) * 64 * 128, (mi & 1) * 8 + mr, (kk % 4) * 2 + (mi >> 1)));
    __syncwarp();
    if (PERSISTENT && lane == 0) mbar_arrive(&q_empty[qb]);

    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // the span's state of rows r, r + 8
    float o[NT][4];  // rows r (0, 1) and r + 8 (2, 3), columns 2q, 2q + 1 of each tile
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    // S of this warp's keys 32·warp … + 31 of the block in ring slot `count` (the block's column tiles
    // 4·warp + nt). Block j + 1's is issued before block j's barriers (below), so its MMAs run while
    // the warps meet: the ring has at least 2 stages, so waiting for the next block's K there never
    // waits on a stage this consumer still holds.
    auto scores = [&](int count, float (&s)[WARP_TILES][4]) {
#pragma unroll
      for (int nt = 0; nt < WARP_TILES; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      mbar_wait(&full_k[count % STAGES], (count / STAGES) & 1);
      const uint8_t* kbase = sk + (count % STAGES) * S::K_BYTES;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int pair = 0; pair < WARP_TILES / 2; ++pair) {  // two column tiles: {lo, hi} k-halves of each
          uint32_t b[4];
          const int key = warp * WARP_KEYS + (pair * 2 + (mi >> 1)) * 8 + mr;
          ldsm_x4(b, swz(kbase + (kk / 4) * BN * 128, key, (kk % 4) * 2 + (mi & 1)));
          mma16816<T>(s[pair * 2], qa[kk], b[0], b[1]);
          mma16816<T>(s[pair * 2 + 1], qa[kk], b[2], b[3]);
        }
    };
    float s[WARP_TILES][4];
    if (it.block_begin < it.block_end) scores(n, s);
    for (int j = it.block_begin; j < it.block_end; ++j, ++n) {
      const int st = n % STAGES;
      const uint32_t phase = (n / STAGES) & 1;
      // Causal mask (keys past a row's position), then this warp's row maxima of the raw scores.
      if (j * BN + BN - 1 > it.first_pos) {
        const int key_base = j * BN + warp * WARP_KEYS + 2 * q;
#pragma unroll
        for (int nt = 0; nt < WARP_TILES; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (key_base + nt * 8 + (e & 1) > (e < 2 ? pos0 : pos1)) s[nt][e] = -INFINITY;
      }
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < WARP_TILES; ++nt) {
        mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
        mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
      }
      quad_max(mx0, mx1);
      if (q == 0) maxes[warp * NARROW_ROWS + r] = mx0, maxes[warp * NARROW_ROWS + r + 8] = mx1;
      float s_next[WARP_TILES][4];  // the next block's scores, in flight through the barriers
      if (j + 1 < it.block_end) scores(n + 1, s_next);
      named_barrier_sync(3, 128);  // the maxima are in (and every warp is done with the last block's P and sums)
      mx0 = fmaxf(fmaxf(maxes[r], maxes[NARROW_ROWS + r]), fmaxf(maxes[2 * NARROW_ROWS + r], maxes[3 * NARROW_ROWS + r]));
      mx1 = fmaxf(fmaxf(maxes[r + 8], maxes[NARROW_ROWS + r + 8]),
                  fmaxf(maxes[2 * NARROW_ROWS + r + 8], maxes[3 * NARROW_ROWS + r + 8]));
      float mn0, mn1, mc0, mc1;
      const float alpha0 = online_step(m0, mx0, c2, mn0, mc0), alpha1 = online_step(m1, mx1, c2, mn1, mc1);
      // p, its pair sums and P (rounded to T) into the exchange area.
#pragma unroll
      for (int nt = 0; nt < WARP_TILES; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = exp2_ftz(__fmaf_rn(s[nt][e], c2, e < 2 ? -mc0 : -mc1));
        const int tile = warp * WARP_TILES + nt, key = tile * 8 + 2 * q;
        xs[tile * 4 * NARROW_ROWS + r * 4 + q] = __fadd_rn(s[nt][0], s[nt][1]);  // a lane a word: no bank conflict
        xs[tile * 4 * NARROW_ROWS + (r + 8) * 4 + q] = __fadd_rn(s[nt][2], s[nt][3]);
        *reinterpret_cast<uint32_t*>(sp + r * X::P_STRIDE + key * 2) = pack2<T>(s[nt][0], s[nt][1]);
        *reinterpret_cast<uint32_t*>(sp + (r + 8) * X::P_STRIDE + key * 2) = pack2<T>(s[nt][2], s[nt][3]);
      }
      m0 = mn0, m1 = mn1;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        o[nt][0] = __fmul_rn(o[nt][0], alpha0), o[nt][1] = __fmul_rn(o[nt][1], alpha0);
        o[nt][2] = __fmul_rn(o[nt][2], alpha1), o[nt][3] = __fmul_rn(o[nt][3], alpha1);
      }
      named_barrier_sync(4, 128);  // the block's P and pair sums are in
      float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
      for (int tile = 0; tile < TILES; ++tile) {
        sum0 = __fadd_rn(sum0, xs[tile * 4 * NARROW_ROWS + r * 4 + q]);
        sum1 = __fadd_rn(sum1, xs[tile * 4 * NARROW_ROWS + (r + 8) * 4 + q]);
      }
      l0 = __fadd_rn(__fmul_rn(l0, alpha0), sum0);
      l1 = __fadd_rn(__fmul_rn(l1, alpha1), sum1);
      // O += P·V over this warp's columns: local column lc of the CTA's V boxes.
      mbar_wait(&full_v[st], phase);
      uint8_t* vbase = sv + st * S::V_BYTES;
      const int lc0 = d0 % 64 + warp * WN;
      // A tail block (the item's last, partly past its keys): this warp zeroes the rows past the end
      // of the columns it reads (0 · NaN must not reach P·V), then reads them. The wgmma consumer has
      // the producer do it (zero_tail); here each warp's columns are its own, so no other warp waits
      // on the zeros and the hand-over is this warp's own __syncwarp.
      const bool tail = j * BN + BN > it.k_len;
      if (tail) {
        const int valid = it.k_len - j * BN;
        for (int piece = lane; piece < (BN - valid) * (WN / 8); piece += 32) {
          const int row = valid + piece / (WN / 8), lc = lc0 + (piece % (WN / 8)) * 8;
          *reinterpret_cast<uint4*>(vbase + (lc / 64) * BN * 128 + swizzled(row, (lc % 64) / 8)) = make_uint4(0, 0, 0, 0);
        }
        __syncwarp();
      }
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
        uint32_t pa[4];
        ldsm_x4(pa, reinterpret_cast<const uint16_t*>(sp + ((mi & 1) * 8 + mr) * X::P_STRIDE + (kt * 16 + (mi >> 1) * 8) * 2));
        if constexpr (NT == 1) {
          uint32_t b[2];
          const int key = kt * 16 + (mi & 1) * 8 + mr;
          ldsm_x2_trans(b, swz(vbase + (lc0 / 64) * BN * 128, key, (lc0 % 64) / 8));
          mma16816<T>(o[0], pa, b[0], b[1]);
        } else {
#pragma unroll
          for (int nt = 0; nt < NT; nt += 2) {  // two column tiles: {lo, hi} keys of each
            uint32_t b[4];
            const int key = kt * 16 + (mi & 1) * 8 + mr, lc = lc0 + (nt + (mi >> 1)) * 8;
            ldsm_x4_trans(b, swz(vbase + (lc / 64) * BN * 128, key, (lc % 64) / 8));
            mma16816<T>(o[nt], pa, b[0], b[1]);
            mma16816<T>(o[nt + 1], pa, b[2], b[3]);
          }
        }
      }
      if (tail) fence_async_shared();  // the zeros (generic writes) before the copy engine refills the stage
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[st]);  // this warp is done with the stage's K and V
      if (j + 1 < it.block_end)
#pragma unroll
        for (int nt = 0; nt < WARP_TILES; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = s_next[nt][e];
    }
    // The span's end: the quad lanes' sums meet; fold into the empty state, or keep it (split-KV).
    quad_sum(l0, l1);
    float M0 = -INFINITY, M1 = -INFINITY, L0 = 0.0f, L1 = 0.0f;
    if (it.part < 0) {
      float a0 = 0, b0 = 0, a1 = 0, b1 = 0;
      const bool f0 = fold_stats(M0, L0, m0, l0, c2, a0, b0), f1 = fold_stats(M1, L1, m1, l1, c2, a1, b1);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool second = e >= 2;
          o[nt][e] = (second ? f1 : f0) ? fold_value(0.0f, o[nt][e], second ? a1 : a0, second ? b1 : b0) : 0.0f;
        }
    }
    auto write_row = [&](int row, bool second) {
      if (row >= it.rows) return;
      const int col0 = d0 + warp * WN + 2 * q;  // this thread's first O column
      if (it.part >= 0) {
        const int64_t pr = int64_t(it.part) + row;
        float2* dst = reinterpret_cast<float2*>(p.part_o + pr * D);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int e = second ? 2 : 0;
          dst[(col0 + nt * 8) / 2] = make_float2(o[nt][e], o[nt][e + 1]);
        }
        if (writes_stats && q == 0)
          reinterpret_cast<float2*>(p.part_ml)[pr] = make_float2(second ? m1 : m0, second ? l1 : l0);
        return;
      }
      const float L = second ? L1 : L0, M = second ? M1 : M0;
      const int64_t token = int64_t(it.q_row) + row / it.group;
      const int head = it.head * it.group + row % it.group;
      uint32_t* dst = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.out) + (token * p.Hq + head) * D);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int e = second ? 2 : 0;
        dst[(col0 + nt * 8) / 2] = pack2<T>(__fdiv_rn(o[nt][e], L), __fdiv_rn(o[nt][e + 1], L));
      }
      if (p.lse && writes_stats && q == 0) p.lse[token * p.Hq + head] = final_lse(M, L, p.scale);
    };
    write_row(r, false);
    write_row(r + 8, true);
  }
}

// PARTS > 1: a small grid (fewer CTAs than SMs) of one-span items runs each item as PARTS CTAs,
// each computing D / PARTS of O's columns: a decode CTA is bound by its tensor work (64 query rows
// of which a few are real), P·V is half of it, and every element of O is formed by the same
// products in the same order whichever N the wgmma has (tested: decode in parts == prefill).
template <class T, int D, int PARTS, bool SINGLE, bool NARROW, bool PAIRED, bool OVERLAP>
__global__ void __launch_bounds__(THREADS, 1) attention_forward_sm90_kernel(const __grid_constant__ Params p) {
  static_assert(!PAIRED || (PARTS == 1 && !NARROW), "the paired kernel: whole O columns, wgmma consumers");
  static_assert(!(NARROW && OVERLAP), "the narrow consumer releases K and V together (it never arrives on empty_v)");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Launched after the previous kernel (cuda/common/pdl.cuh): the next one (the combine, or the O
  // GEMM, which loads its first weight stages before its own wait) may start at once, on the SMs a
  // small decode leaves idle; this one waits for the previous kernel's output (Q, the cache's K / V).
  pdl_launch_dependents();
  pdl_wait();
  using S = Smem<D, PARTS, SINGLE, NARROW>;
  constexpr int STAGES = S::STAGES;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sq = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* sk = sq + S::Q_BYTES;
  uint8_t* sv = sk + STAGES * S::K_BYTES;
  float* so = reinterpret_cast<float*>(sv + STAGES * S::V_BYTES);  // the running O (not in SINGLE)
  uint8_t* exchange = reinterpret_cast<uint8_t*>(so) + S::O_BYTES;  // the narrow consumer's (NarrowSmem)
  uint64_t* full_q = reinterpret_cast<uint64_t*>(exchange + S::X_BYTES);
  uint64_t* q_empty = full_q + S::Q_BUFFERS;  // persistent kernel: the buffer's item has done its last S = Q·Kᵀ
  uint64_t* full_k = q_empty + S::Q_BUFFERS;
  uint64_t* full_v = full_k + STAGES;
  uint64_t* empty = full_v + STAGES;
  uint64_t* tail_v = empty + STAGES;  // a tail block's V landed (zero_tail waits on it)
  // OVERLAP: `empty` frees a stage's K (its S is done), empty_v its V (its P·V is done); elsewhere
  // `empty` frees both and empty_v is unused.
  uint64_t* empty_v = tail_v + STAGES;
  auto item_at = [&](int i) { return p.items ? p.items[i] : p.inline_items[i]; };
  // The general kernel's grid is its items (one a CTA), so its consumers are its one item's; the
  // single-span kernel's items have at most 64 rows: one consumer; the paired kernel: two for every
  // item (an item of at most 64 rows leaves the second's rows unwritten).
  const int consumers = PAIRED || (!SINGLE && item_at(blockIdx.x).rows > 64) ? 2 : 1;
  constexpr int ON = D / PARTS;  // O's columns this CTA computes
  // Which items this CTA walks: ItemWalk's in the persistent kernel; its own alone elsewhere — a loop
  // the compiler sees run once.
  constexpr bool PERSISTENT = persistent_kernel(SINGLE, PARTS, PAIRED);
  const ItemWalk walk{p.n_items, PERSISTENT, p.snake != 0};
  // Who releases a Q buffer and a stage: a consumer's thread 0, or each of the narrow consumer's warps.
  const uint32_t releasers = NARROW ? 4u : uint32_t(consumers);
  if (threadIdx.x == 0) {
    for (int b = 0; b < S::Q_BUFFERS; ++b) {
      mbar_init(&full_q[b], 1);
      mbar_init(&q_empty[b], NARROW ? 4u : 1u);
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full_k[s], 1);
      mbar_init(&full_v[s], 1);
      mbar_init(&empty[s], releasers);
      mbar_init(&tail_v[s], 1);
      mbar_init(&empty_v[s], releasers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;

  if (wg == 0) {  // producer: warp 0 loads; in the persistent wgmma kernel warp 1 zeroes tail blocks' V rows
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    constexpr bool TAIL_WARP = PERSISTENT && !NARROW;
    if (threadIdx.x >= (TAIL_WARP ? 64 : 32)) return;
    const int lane = threadIdx.x % 32;
    // The V boxes (64 columns each) holding this CTA's O columns.
    auto v_boxes = [&](const Item& it, int& lo, int& hi) {
      const int d0 = PARTS > 1 ? (it.d_split - 1) * ON : 0;  // the first of the CTA's O columns
      lo = d0 / 64, hi = (d0 + ON + 63) / 64;
    };
    // Block j of the item in stage st is the sequence's last, partly past its keys (one an item, its
    // last block): once its V has landed on tail_v[st], the rows past the end are zeroed and only
    // then is the stage's V full (0 · NaN must not reach P·V). parity: bit st, tail_v[st]'s phase.
    auto zero_tail = [&](const Item& it, int j, int st, uint32_t& parity) {
      int vb_lo, vb_hi;
      v_boxes(it, vb_lo, vb_hi);
      mbar_wait(&tail_v[st], (parity >> st) & 1u);
      parity ^= 1u << st;
      uint8_t* vdst = sv + st * S::V_BYTES;
      const int valid = it.k_len - j * BN, chunks = (BN - valid) * 8;  // 16-byte pieces of a box past the end
      for (int b = vb_lo; b < vb_hi; ++b)
        for (int piece = lane; piece < chunks; piece += 32)
          *reinterpret_cast<uint4*>(vdst + (b - vb_lo) * BN * 128 + (valid + piece / 8) * 128 + (piece % 8) * 16) =
              make_uint4(0, 0, 0, 0);
      fence_async_shared();
      __syncwarp();
      if (lane == 0) mbar_arrive(&full_v[st]);
    };
    auto is_tail = [](const Item& it, int j) { return j * BN + BN > it.k_len; };
    uint32_t parity = 0;
    if constexpr (TAIL_WARP) {
      if (threadIdx.x >= 32) {
        // Warp 1 zeroes the tails, walking the loader's blocks in its order: the loading warp runs
        // on into the next items (it used to wait for each tail itself, its loads stalled once an
        // item). Only an item's last block can be a tail; the blocks before it just count.
        int n = 0;
        for (int k = 0, idx; (idx = walk(k)) >= 0; ++k) {
          const Item it = item_at(idx);
          if (it.block_end <= it.block_begin) continue;
          n += it.block_end - it.block_begin;
          if (is_tail(it, it.block_end - 1)) zero_tail(it, it.block_end - 1, (n - 1) % STAGES, parity);
        }
        return;
      }
    }
    int n = 0;  // blocks loaded: the ring runs on across items
    for (int k = 0, idx; (idx = walk(k)) >= 0; ++k) {
      const Item it = item_at(idx);
      const int group = it.group, hk = group == 1 ? it.head / p.G : it.head;
      int vb_lo, vb_hi;
      v_boxes(it, vb_lo, vb_hi);
      // Q: a buffer a consumer, or (the persistent single-span kernel) the item's of two in turn, once
      // the item that last used it has done its last S. The paired kernel's buffer is the previous
      // item's, free only at its last S: its Q goes after the item's first K / V block, which then
      // loads as soon as a stage frees instead of waiting behind that S.
      // Consumer c's Q boxes of item x: fn(box, tensor map, column, head, row) for each.
      auto for_q_boxes = [&](const Item& x, int c, auto&& fn) {
        for (int b = 0; b < S::BOXES; ++b) {
          if (x.group == 1) fn(b, &p.q_heads, b * 64, x.head, x.q_row + c * 64);
          else fn(b, &p.q_groups, b * 64, x.head * x.group, x.q_row + c * (64 / x.group));
        }
      };
      auto load_q = [&] {
        if (lane != 0) return;
        for (int c = 0; c < consumers; ++c) {
          int round;
          const int qb = q_slot(PAIRED, PERSISTENT, S::Q_BUFFERS, k, c, round);
          if (round > 0) mbar_wait(&q_empty[qb], (round - 1) & 1);
          mbar_expect_tx(&full_q[qb], uint32_t(64 * D * 2));
          for_q_boxes(it, c, [&](int b, const CUtensorMap* map, int x, int y, int z) {
            tma_load_3d(sq + (qb * S::BOXES + b) * 64 * 128, map, x, y, z, &full_q[qb]);
          });
        }
        // The paired kernel's next Q loads only once this item's last S is done, from memory, with
        // the item's last P·V and write left to cover it: with p.prefetch_q it is brought into L2 now
        // (an experiment, off unless SAMEBITS_PREFETCH_Q=1).
        const int next = PAIRED && p.prefetch_q ? walk(k + 1) : -1;
        if (next >= 0)
          for (int c = 0; c < consumers; ++c)
            for_q_boxes(item_at(next), c, [&](int, const CUtensorMap* map, int x, int y, int z) {
              tma_prefetch_3d(map, x, y, z);
            });
      };
      if (!PAIRED) load_q();
      for (int j = it.block_begin; j < it.block_end; ++j, ++n) {
        const int st = n % STAGES;
        const uint32_t reuse = ((n / STAGES) - 1) & 1;  // the phase of the release of the stage's last block
        uint8_t* kdst = sk + st * S::K_BYTES;
        uint8_t* vdst = sv + st * S::V_BYTES;  // its first box is the CTA's first V box (vb_lo)
        const int key0 = j * BN;
        // The first row of each kv_box-row piece of the block (one piece unless pages are smaller);
        // a piece wholly past the keys loads row 0 (its scores are masked, its V zeroed: zero_tail).
        auto piece_row = [&](int r0) {
          return key0 + r0 < it.k_len ? int32_t(p.pages.row(it.seq, it.k_row, key0 + r0)) : 0;
        };
        // Small pages: the lanes issue the pieces in parallel (lane i piece i), after lane 0 has set
        // the bytes the stage expects. K before V: the consumers need K first (S = Q·Kᵀ), and a
        // small decode waits on it. (K and V of a stage released apart, K once its S is done, made
        // no difference to the kernel without the overlap on the H100: a decode step 6.77 / 7.10 /
        // 10.76 ms against 6.75 / 7.10 / 10.75; the overlap releases them apart, empty_v.)
        if (n >= STAGES) mbar_wait(&empty[st], reuse);
        if (lane == 0) mbar_expect_tx(&full_k[st], uint32_t(S::K_BYTES));
        __syncwarp();
        for (int r0 = lane * p.kv_box; r0 < BN; r0 += 32 * p.kv_box)
          for (int b = 0; b < S::BOXES; ++b)
            tma_load_3d(kdst + b * BN * 128 + r0 * 128, &p.k, b * 64, hk, piece_row(r0), &full_k[st]);
        // A tail block's V lands on tail_v[st]: zero_tail fills full_v[st] once its rows past the end are
        // zeroed (the narrow consumer's warps zero their own columns: straight to full_v).
        uint64_t* v_bar = is_tail(it, j) && !NARROW ? &tail_v[st] : &full_v[st];
        if (OVERLAP && n >= STAGES) mbar_wait(&empty_v[st], reuse);
        if (lane == 0) mbar_expect_tx(v_bar, uint32_t(vb_hi - vb_lo) * BN * 128);
        __syncwarp();
        for (int r0 = lane * p.kv_box; r0 < BN; r0 += 32 * p.kv_box)
          for (int b = vb_lo; b < vb_hi; ++b)
            tma_load_3d(vdst + (b - vb_lo) * BN * 128 + r0 * 128, &p.v, b * 64, hk, piece_row(r0), v_bar);
        if (PAIRED && j == it.block_begin) load_q();  // (every paired item has a block)
        // One item a CTA: its tail is its last block, nothing is loaded after it, this warp zeroes it.
        if (!PERSISTENT && !NARROW && is_tail(it, j)) zero_tail(it, j, st, parity);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1;
  if (c >= consumers) return;
  if constexpr (NARROW) {
    narrow_consumer<T, D, PARTS, STAGES, PERSISTENT>(p, walk, sq, sk, sv, exchange, full_q, q_empty,
                                                     full_k, full_v, empty);
    return;
  }
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32, quad_col = (lane % 4) * 2;
  const int row0 = c * 64 + warp * 16 + lane / 4, row1 = row0 + 8;  // this thread's two rows of the item
  const float c2 = p.scale_log2;
  float* my_o = so + c * 128 + t;  // this thread's running O: element i at my_o[i * 256] (not in SINGLE)
  // OVERLAP (a block's P·V during the next block's softmax; the prefill kernels): a block's V is held until
  // its P·V is done, about a softmax longer than without, so K and V are released apart (empty,
  // empty_v): a stage's next K loads once this block's S is done (a block earlier than without).
  int n = 0;  // blocks consumed (the ring's count runs on across items)
  for (int k = 0, idx; (idx = walk(k)) >= 0; ++k) {
    const Item it = item_at(idx);
    const int d0 = PARTS > 1 ? (it.d_split - 1) * ON : 0;  // the first of the CTA's O columns
    const bool writes_stats = PARTS == 1 || it.d_split == 1;
    const int group = it.group;
    const int pos0 = it.first_pos + row0 / group, pos1 = it.first_pos + row1 / group;
    const int warp_first_pos = it.first_pos + (c * 64 + warp * 16) / group;
    if constexpr (!SINGLE) {
  #pragma unroll
      for (int i = 0; i < ON / 2; ++i) my_o[i * 256] = 0.0f;
    }
    float M0 = -INFINITY, M1 = -INFINITY, L0 = 0.0f, L1 = 0.0f;  // running state
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // the span's (l: this thread's columns)
    float o[ON / 2];
    int q_round;
    const int qb = q_slot(PAIRED, PERSISTENT, S::Q_BUFFERS, k, c, q_round);
    mbar_wait(&full_q[qb], q_round & 1);
    const uint8_t* qbase = sq + qb * S::BOXES * 64 * 128;

    // Ping-pong: the two consumers take turns issuing their S = Q·Kᵀ (named barriers 1 and 2), so one
    // runs its softmax while the other's MMAs hold the tensor cores. Consumer 0 goes first. In the
    // paired kernel the turns run on from one item into the next: consumer 1 hands the first turn over
    // once (its first item) and hands it back after every block but its last item's last, so consumer
    // 0 issues the next item's first S while consumer 1 ends the item. Restarted at every item (consumer
    // 1 handing the first turn over again once its epilogue was done, and no turn after an item's last
    // block), consumer 0's next S waited for consumer 1's epilogue. Every arrive meets one wait: consumer
    // 1 arrives on 1 as often as consumer 0 issues an S, consumer 0 on 2 as often as consumer 1 does.
    const bool pingpong = consumers == 2;
    const bool turns_across = PAIRED && p.turns_across != 0;
    const bool first_turn = !turns_across || k == 0, last_turns = !turns_across || walk(k + 1) < 0;
    if (pingpong && c == 1 && first_turn) named_barrier_arrive(1, 256);
    for (int span = it.block_begin; span < it.block_end;) {
      const int span_end = std::min(it.block_end, (span / SPLIT_BLOCKS + 1) * SPLIT_BLOCKS);
      m0 = m1 = -INFINITY;
      l0 = l1 = 0.0f;
  #pragma unroll
      for (int i = 0; i < ON / 2; ++i) o[i] = 0.0f;
      // A block's steps. S = Q·Kᵀ of the block in ring slot st:
      float s[BN / 2];
      auto issue_s = [&](int st) {
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint64_t dq = smem_desc(qbase + (kk / 4) * 64 * 128) + uint64_t((kk % 4) * 2);
          const uint64_t dk = smem_desc(sk + st * S::K_BYTES + (kk / 4) * BN * 128) + uint64_t((kk % 4) * 2);
          Wgmma<T, false, false, BN>::mma(s, dq, dk, kk > 0);
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      };
      // The softmax of block j's scores: the causal mask where the block reaches past the warp's first
      // row (whole blocks below the diagonal skip it: the warp's rows all see every key), the block's
      // row maxima of the raw scores (a quad holds a row), the new maxima in exp2 units and the rescale
      // of the span so far (exactly 1 where a block fully masked for the row moved no max: it changes no
      // bit), p = 2^(s·c − m·c) in place, and the row sums.
      float alpha0, alpha1;
      auto softmax = [&](int j) {
        if (j * BN + BN - 1 > warp_first_pos) {
          const int key_base = j * BN + quad_col;
  #pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt)
  #pragma unroll
            for (int e = 0; e < 4; ++e)
              if (key_base + nt * 8 + (e & 1) > (e < 2 ? pos0 : pos1)) s[nt * 4 + e] = -INFINITY;
        }
        float mx0 = -INFINITY, mx1 = -INFINITY;
  #pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
          mx0 = fmaxf(mx0, fmaxf(s[nt * 4], s[nt * 4 + 1]));
          mx1 = fmaxf(mx1, fmaxf(s[nt * 4 + 2], s[nt * 4 + 3]));
        }
        quad_max(mx0, mx1);
        float mn0, mn1, mc0, mc1;
        alpha0 = online_step(m0, mx0, c2, mn0, mc0), alpha1 = online_step(m1, mx1, c2, mn1, mc1);
        float sum0 = 0.0f, sum1 = 0.0f;
  #pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
  #pragma unroll
          for (int e = 0; e < 4; ++e) s[nt * 4 + e] = exp2_ftz(__fmaf_rn(s[nt * 4 + e], c2, e < 2 ? -mc0 : -mc1));
          sum0 = __fadd_rn(sum0, __fadd_rn(s[nt * 4], s[nt * 4 + 1]));
          sum1 = __fadd_rn(sum1, __fadd_rn(s[nt * 4 + 2], s[nt * 4 + 3]));
        }
        l0 = __fadd_rn(__fmul_rn(l0, alpha0), sum0);
        l1 = __fadd_rn(__fmul_rn(l1, alpha1), sum1);
        m0 = mn0, m1 = mn1;
      };
      // o rescaled, then P (pa: p rounded to the input dtype; the accumulator layout of S is P's A
      // fragment).
      uint32_t pa[BN / 16][4];
      auto rescale_and_pack = [&] {
  #pragma unroll
        for (int i = 0; i < ON / 2; i += 4) {
          o[i] = __fmul_rn(o[i], alpha0), o[i + 1] = __fmul_rn(o[i + 1], alpha0);
          o[i + 2] = __fmul_rn(o[i + 2], alpha1), o[i + 3] = __fmul_rn(o[i + 3], alpha1);
        }
  #pragma unroll
        for (int kt = 0; kt < BN / 16; ++kt) {
          pa[kt][0] = pack2<T>(s[kt * 8 + 0], s[kt * 8 + 1]);
          pa[kt][1] = pack2<T>(s[kt * 8 + 2], s[kt * 8 + 3]);
          pa[kt][2] = pack2<T>(s[kt * 8 + 4], s[kt * 8 + 5]);
          pa[kt][3] = pack2<T>(s[kt * 8 + 6], s[kt * 8 + 7]);
        }
        if constexpr (OVERLAP) {  // o and P defined here, before the next S's wgmma fence (their P·V comes after
                                  // that S): an empty asm the compiler may not move them past
  #pragma unroll
          for (int i = 0; i < ON / 2; ++i) asm volatile("" : "+f"(o[i])::"memory");
  #pragma unroll
          for (int kt = 0; kt < BN / 16; ++kt)
            asm volatile("" : "+r"(pa[kt][0]), "+r"(pa[kt][1]), "+r"(pa[kt][2]), "+r"(pa[kt][3])::"memory");
        }
      };
      // O += P·V of the block in ring slot st.
      auto issue_pv = [&](int st) {
  #pragma unroll
        for (int kt = 0; kt < BN / 16; ++kt)
          WgmmaRS<T, true, ON>::mma(o, pa[kt], smem_desc_mn_lbo(sv + st * S::V_BYTES + (d0 % 64) * 2 + kt * 16 * 128, BN * 128));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      };
      // The ping-pong's turns around a block's S issue (the other consumer's turn after it; consumer 1
      // gives none after the last block of its last item — of its item, where the turns restart).
      auto my_turn = [&] { if (pingpong) named_barrier_sync(1 + c, 256); };
      auto their_turn = [&](int j) {
        if (pingpong && (c == 0 || !last_turns || j + 1 < it.block_end)) named_barrier_arrive(2 - c, 256);
      };
      // PAIRED: the item's last S is done, its Q buffer may take the next item's Q.
      auto q_done = [&](int j) {
        if (PAIRED && j + 1 == it.block_end && t == 0) mbar_arrive(&q_empty[qb]);
      };
      if constexpr (!OVERLAP) {
        for (int j = span; j < span_end; ++j, ++n) {
          const int st = n % STAGES;
          const uint32_t phase = (n / STAGES) & 1;
          mbar_wait(&full_k[st], phase);
          my_turn();
          issue_s(st);
          their_turn(j);
          asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
          // The previous block's P·V is done too: its stage can be refilled.
          if (n > 0 && t == 0) mbar_arrive(&empty[(n - 1) % STAGES]);
          q_done(j);
          softmax(j);
          rescale_and_pack();
          mbar_wait(&full_v[st], phase);
          asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
          issue_pv(st);
        }
      } else {
        // OVERLAP: block j's S is issued, then block j − 1's P·V, which runs during block j's softmax; o
        // is rescaled once it is done. Every element of o sees the same operations in the same order
        // (· alpha_j after + P_{j−1}·V_{j−1}, then + P_j·V_j): the same bits. A block's K is released once
        // its S is done, its V once its P·V is done (the span's last at the span's end).
        int st = n % STAGES;
        uint32_t phase = (n / STAGES) & 1;
        mbar_wait(&full_k[st], phase);
        my_turn();
        issue_s(st);
        their_turn(span);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        if (t == 0) mbar_arrive(&empty[st]);
        q_done(span);
        softmax(span);
        rescale_and_pack();
        ++n;
        for (int j = span + 1; j < span_end; ++j, ++n) {
          const int pst = st;
          const uint32_t pphase = phase;
          st = n % STAGES, phase = (n / STAGES) & 1;
          mbar_wait(&full_k[st], phase);
          mbar_wait(&full_v[pst], pphase);  // (before the S: no branch between the two products' wgmma)
          my_turn();
          issue_s(st);
          issue_pv(pst);
          their_turn(j);
          asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // S done; the P·V runs on
          if (t == 0) mbar_arrive(&empty[st]);
          q_done(j);
          softmax(j);
          asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
          if (t == 0) mbar_arrive(&empty_v[pst]);
          rescale_and_pack();
        }
        mbar_wait(&full_v[st], phase);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        issue_pv(st);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        if (t == 0) mbar_arrive(&empty_v[st]);
      }
      // The span ends: fold it into the running state (or keep it, for a split-KV item).
      span = span_end;
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      quad_sum(l0, l1);
      if (it.part < 0) {
        float a0 = 0, b0 = 0, a1 = 0, b1 = 0;
        const bool f0 = fold_stats(M0, L0, m0, l0, c2, a0, b0), f1 = fold_stats(M1, L1, m1, l1, c2, a1, b1);
  #pragma unroll
        for (int i = 0; i < ON / 2; ++i) {
          const bool second = (i & 2) != 0;
          if constexpr (SINGLE)  // the one span into the empty state (O = 0): what the general kernel stores
            o[i] = (second ? f1 : f0) ? fold_value(0.0f, o[i], second ? a1 : a0, second ? b1 : b0) : 0.0f;
          else if (second ? f1 : f0)
            my_o[i * 256] = fold_value(my_o[i * 256], o[i], second ? a1 : a0, second ? b1 : b0);
        }
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    if (PERSISTENT && !PAIRED && t == 0) mbar_arrive(&q_empty[qb]);  // its products are done: the buffer may take item k + 2's Q

    // Write this thread's two rows: the final out / lse, or the span's unfolded state.
    auto write_row = [&](int row, bool second) {
      if (row >= it.rows) return;
      if (it.part >= 0) {
        const int64_t pr = int64_t(it.part) + row;
        float2* dst = reinterpret_cast<float2*>(p.part_o + pr * D);
  #pragma unroll
        for (int nt = 0; nt < ON / 8; ++nt) {
          const int i = nt * 4 + (second ? 2 : 0);
          dst[(d0 + nt * 8 + quad_col) / 2] = make_float2(o[i], o[i + 1]);
        }
        if (writes_stats && lane % 4 == 0) reinterpret_cast<float2*>(p.part_ml)[pr] = make_float2(second ? m1 : m0, second ? l1 : l0);
        return;
      }
      const float L = second ? L1 : L0, M = second ? M1 : M0;
      const int64_t token = int64_t(it.q_row) + row / group;
      const int head = it.head * (group == 1 ? 1 : group) + row % group;
      uint16_t* out_row = static_cast<uint16_t*>(p.out) + (token * p.Hq + head) * D;  // 16-byte aligned
      // Column tile nt's two columns of this lane, divided by the row's sum and packed.
      auto packed = [&](int nt) {
        const int i = nt * 4 + (second ? 2 : 0);
        const float o0 = SINGLE ? o[i] : my_o[i * 256], o1 = SINGLE ? o[i + 1] : my_o[(i + 1) * 256];
        return pack2<T>(__fdiv_rn(o0, L), __fdiv_rn(o1, L));
      };
      if (p.vector_out) {  // four tiles' words transposed over the quad: lane q stores tile 4g + q's 16 bytes
        const unsigned quad_mask = 0xfu << (lane & ~3);  // the quad shares the row: all four are here
  #pragma unroll
        for (int g = 0; g < ON / 32; ++g) {
          uint32_t w[4] = {packed(4 * g), packed(4 * g + 1), packed(4 * g + 2), packed(4 * g + 3)};
          quad_transpose(w, quad_mask);
          *reinterpret_cast<uint4*>(out_row + d0 + (4 * g + lane % 4) * 8) = make_uint4(w[0], w[1], w[2], w[3]);
        }
      } else {
  #pragma unroll
        for (int nt = 0; nt < ON / 8; ++nt)
          reinterpret_cast<uint32_t*>(out_row)[(d0 + nt * 8 + quad_col) / 2] = packed(nt);
      }
      if (p.lse && writes_stats && lane % 4 == 0) p.lse[token * p.Hq + head] = final_lse(M, L, p.scale);
    };
    write_row(row0, false);
    write_row(row1, true);
  }
#endif
}

// out / lse of decode-sized rows whose spans ran as separate items: the spans folded in ascending
// order with the fold the Hopper kernel applies inside a CTA. One CTA a row, two columns a thread.
// The partials of SPANS_AHEAD spans are loaded before they are folded (every span item writes all
// of its rows, so the loads need no condition): the fold waits on arithmetic, not on memory.
template <class T, int D>
__global__ void __launch_bounds__(D / 2) attention_combine_kernel(const __grid_constant__ Params p) {
  pdl_launch_dependents();  // the next kernel (the O GEMM) may start its prologue (cuda/common/pdl.cuh)
  pdl_wait();               // the attention kernel's partials are ready from here
  if (int(blockIdx.x) >= p.n_combines) return;
  constexpr int SPANS_AHEAD = 8;
  const Combine g = p.combines ? p.combines[blockIdx.x] : p.inline_combines[blockIdx.x];
  const int row = blockIdx.y;
  if (row >= g.rows) return;
  float M = -INFINITY, L = 0.0f, O0 = 0.0f, O1 = 0.0f;
  for (int s0 = 0; s0 < g.spans; s0 += SPANS_AHEAD) {
    float2 ml[SPANS_AHEAD], o[SPANS_AHEAD];
#pragma unroll
    for (int i = 0; i < SPANS_AHEAD; ++i) {
      if (s0 + i >= g.spans) break;
      const int64_t pr = int64_t(g.part) + int64_t(s0 + i) * g.rows + row;
      ml[i] = reinterpret_cast<const float2*>(p.part_ml)[pr];
      o[i] = reinterpret_cast<const float2*>(p.part_o + pr * D)[threadIdx.x];
    }
#pragma unroll
    for (int i = 0; i < SPANS_AHEAD; ++i) {
      if (s0 + i >= g.spans) break;
      float a, b;
      if (!fold_stats(M, L, ml[i].x, ml[i].y, p.scale_log2, a, b)) continue;
      O0 = fold_value(O0, o[i].x, a, b);
      O1 = fold_value(O1, o[i].y, a, b);
    }
  }
  const int64_t token = int64_t(g.q_row) + row / g.group;
  const int head = g.head0 + row % g.group;
  reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.out) + (token * p.Hq + head) * D)[threadIdx.x] =
      pack2<T>(__fdiv_rn(O0, L), __fdiv_rn(O1, L));
  if (p.lse && threadIdx.x == 0) p.lse[token * p.Hq + head] = final_lse(M, L, p.scale);
}

// The work of one call: items (longest first), the split-KV combines and their partial rows, and
// how many CTAs share an item's O columns. Planned from the sequence table alone, the same for an
// eager call and a graph replay (so the same bits). A plan is made on every call and every graph
// replay, so its vectors are the thread's own and reused (measured on this project's CPU, a
// 4,096-item prefill plan: fresh vectors and std::stable_sort's buffer ~140 µs of host time a call,
// reused vectors and the counting sort below ~20 µs).
struct Plan {
  std::vector<Item> items;
  std::vector<Combine> combines;
  int64_t part_rows = 0;
  int parts = 1;
  bool single = false;    // every item one span of at most 64 rows: the single-span kernel (a deeper ring)
  bool narrow = false;    // single, and every item at most 16 rows: its narrow consumer (mma.sync)
  bool paired = false;    // prefill (not `single`'s ≤ 64-row items), whole O columns: the paired persistent
                          // kernel, over the single-span layout where `single` (then: every item one span)
  bool overlap = false;   // a block's P·V during the next block's softmax (prefill; the tests' hook: decode too)
  int32_t most_rows = 0;  // the most rows of a combine
};

// The thread's plan, valid until its next plan_work.
const Plan& plan_work(const int32_t* s, int64_t n_seqs, int64_t Hq, int64_t Hkv, int D, int sms) {
  const int G = int(Hq / Hkv);
  const bool packable = G <= 64 && 64 % G == 0;
  thread_local Plan w;
  thread_local std::vector<Item> spare;  // the split and the sort write here, then swap
  w = Plan{std::move(w.items), std::move(w.combines)};  // every field reset, the vectors' memory kept
  w.items.clear(), w.combines.clear();
  auto& items = w.items;
  for (int64_t b = 0; b < n_seqs; ++b) {
    const int32_t q_row = s[4 * b], q_len = s[4 * b + 1], k_row = s[4 * b + 2], k_len = s[4 * b + 3];
    const int32_t first = k_len - q_len, blocks = (k_len - 1) / BN + 1;
    if (packable && int64_t(q_len) * G <= BM) {  // decode-sized: a GQA group's heads share the rows
      const int32_t rows = q_len * G, spans = (blocks + SPLIT_BLOCKS - 1) / SPLIT_BLOCKS;
      for (int32_t h = 0; h < Hkv; ++h) {
        if (spans == 1) {
          items.push_back({q_row, rows, k_row, k_len, first, h, G, 0, blocks, -1, int32_t(b)});
          continue;
        }
        w.combines.push_back({q_row, rows, G, h * G, int32_t(w.part_rows), spans});
        w.most_rows = std::max(w.most_rows, rows);
        for (int32_t sp = 0; sp < spans; ++sp)
          items.push_back({q_row, rows, k_row, k_len, first, h, G, sp * SPLIT_BLOCKS,
                           std::min(blocks, (sp + 1) * SPLIT_BLOCKS), int32_t(w.part_rows + int64_t(sp) * rows), int32_t(b)});
        w.part_rows += int64_t(spans) * rows;
      }
      continue;
    }
    for (int32_t t0 = 0; t0 < q_len; t0 += BM) {
      const int32_t rows = std::min(BM, q_len - t0), pos = first + t0;
      for (int32_t h = 0; h < Hq; ++h)
        items.push_back({q_row + t0, rows, k_row, k_len, pos, h, 1, 0, (pos + rows - 1) / BN + 1, -1, int32_t(b)});
    }
  }
  // A grid of one-span items that leaves most SMs idle (a small decode): each item as `parts` CTAs,
  // one a part of O's columns (at least 32), while the grid stays within half the SMs (measured on
  // the H100: B = 1, C = 1k 19.7 → 17.4 µs with four parts; C = 4k, 128 CTAs of four parts, 22.5 →
  // 24.0 µs, so not there). Which CTA computes an element never changes its arithmetic.
  if (std::all_of(items.begin(), items.end(), [](const Item& x) { return x.part >= 0 || x.block_end <= SPLIT_BLOCKS; }))
    for (int k : {4, 2})
      if (D / k >= 32 && items.size() * k * 2 <= size_t(sms)) {
        w.parts = k;
        break;
      }
  if (w.parts > 1) {
    spare.clear();
    for (Item x : items)
      for (int k = 1; k <= w.parts; ++k) {
        x.d_split = k;
        spare.push_back(x);
      }
    items.swap(spare);
  }
  // Which kernel runs an item never changes its arithmetic: the single-span kernel folds its one
  // span into the empty state as the general kernel does (tested: decode == prefill bits).
  static const bool single_span = env_switch("SAMEBITS_SINGLE_SPAN");  // "0": the general kernel (A/B runs)
  auto one_span = [](const Item& x) { return x.block_begin / SPLIT_BLOCKS == (x.block_end - 1) / SPLIT_BLOCKS; };
  w.single = single_span && std::all_of(items.begin(), items.end(), [&](const Item& x) { return x.rows <= 64 && one_span(x); });
  // The 16-row consumer (narrow_consumer): off unless SAMEBITS_NARROW_DECODE=1 or the test hook says
  // so, until a GPU run has timed it.
  static const bool narrow_env = env_opt_in("SAMEBITS_NARROW_DECODE");
  w.narrow = w.single && hook_or_env(detail::narrow_decode_override(), narrow_env) &&
             std::all_of(items.begin(), items.end(), [](const Item& x) { return x.rows <= NARROW_ROWS; });
  // The paired persistent kernel (two consumers a CTA, the CTAs walking the items) for every prefill
  // of whole O columns (SAMEBITS_PERSISTENT_PREFILL=0 or the test hook turns it off: A/B runs). Over
  // the single-span layout where every item is one span (w.single then only says: not at most 64
  // rows). Measured on the H200 (docs/attention.md): 0.79× the time at S = 1k, 0.94× at 2k,
  // 0.97–1.00× at 4k, 1.00–1.04× at 8k–32k; with the overlap below 0.74–0.78× at 1k and 0.92–0.99×
  // at 8k–32k.
  static const bool paired_env = env_switch("SAMEBITS_PERSISTENT_PREFILL");
  // (Every item has a key block — its consumers' Q release and ping-pong count on one; q_len ≥ 1.)
  if (!w.single && w.parts == 1 && hook_or_env(detail::persistent_prefill_override(), paired_env) &&
      std::all_of(items.begin(), items.end(), [](const Item& x) { return x.block_end > x.block_begin; })) {
    w.paired = true;
    w.single = single_span && std::all_of(items.begin(), items.end(), one_span);
  }
  // A block's P·V during the next block's softmax, in the prefill kernels (the general and the
  // paired; SAMEBITS_ATTENTION_OVERLAP=0 or the test hook turns it off): measured on the H200
  // 0.93–0.98× the time over the prefill table. Not in the decode (single-span, not paired) kernel,
  // where it measured 1.00–1.05× (the hook can force it there, for the tests), nor in the narrow
  // consumer. The same bits either way (tests/cuda/test_attention.cpp).
  static const bool overlap_env = env_switch("SAMEBITS_ATTENTION_OVERLAP");
  w.overlap = !w.narrow && hook_or_env(detail::attention_overlap_override(), overlap_env && (w.paired || !w.single));
  // The longest items first, so the tail of the grid is short ones; equals in planned order (a
  // stable counting sort on the block count; which CTA runs an item never changes its arithmetic).
  int32_t most = 0;
  for (const Item& x : items) most = std::max(most, x.block_end - x.block_begin);
  thread_local std::vector<size_t> first_of;  // first_of[most − blocks]: where items of that length start
  first_of.assign(size_t(most) + 2, 0);
  for (const Item& x : items) ++first_of[size_t(most - (x.block_end - x.block_begin)) + 1];
  for (size_t i = 1; i < first_of.size(); ++i) first_of[i] += first_of[i - 1];
  spare.resize(items.size());
  for (const Item& x : items) spare[first_of[size_t(most - (x.block_end - x.block_begin))]++] = x;
  items.swap(spare);
  return w;
}

int kernel_index(int parts) { return parts == 4 ? 2 : parts == 2 ? 1 : 0; }

// The grid: a CTA an item, but for the single-span kernel of whole O columns (persistent) at most
// one an SM — or the test hook's count (items shared by few CTAs), or a CTA an item where
// SAMEBITS_PERSISTENT_DECODE=0 (A/B runs). Which CTA walks an item never changes its arithmetic.
unsigned grid_of(const Plan& w, int sms) {
  static const bool persistent = env_switch("SAMEBITS_PERSISTENT_DECODE");
  const int forced = detail::attention_persistent_ctas_override();
  size_t g = w.items.size();
  if (persistent_kernel(w.single, w.parts, w.paired) && (persistent || forced > 0))
    g = std::min(g, size_t(forced > 0 ? forced : sms));
  return unsigned(g);
}

// The combine's grid: a CTA a (combine, row); in a graph one CTA with nothing to do where no span
// splits (its node stays, see launch).
dim3 combine_grid(const Plan& w) {
  return dim3(unsigned(std::max<size_t>(w.combines.size(), 1)), unsigned(std::max(w.most_rows, 1)));
}

// A forward kernel and the shared memory it launches with.
struct ForwardKernel {
  void* fn = nullptr;
  unsigned smem = 0;
};
// [kernel][parts index]: the kernels of kernel_kind (index 0 … 8) of each O-column split (index 0, 1, 2:
// parts 1, 2, 4; null where D / 4 is too narrow, and for the paired kernels' parts), each opted into
// its shared memory once per device.
constexpr int FORWARD_KINDS = 9;
using ForwardKernels = std::array<std::array<ForwardKernel, 3>, FORWARD_KINDS>;

template <class T, int D, int PARTS, bool SINGLE, bool NARROW = false, bool PAIRED = false, bool OVERLAP = false>
void add_forward_kernel(ForwardKernels& k, std::atomic<int> (&allowed)[FORWARD_KINDS][3][64], const char* op) {
  const auto fn = attention_forward_sm90_kernel<T, D, PARTS, SINGLE, NARROW, PAIRED, OVERLAP>;
  using S = Smem<D, PARTS, SINGLE, NARROW>;
  const int kind = kernel_kind(SINGLE, NARROW, PAIRED, OVERLAP), part = kernel_index(PARTS);
  allow_dynamic_smem(fn, S::BYTES, allowed[kind][part], op);
  k[size_t(kind)][size_t(part)] = {reinterpret_cast<void*>(fn), unsigned(S::BYTES)};
}

template <class T, int D>
ForwardKernels forward_kernels(const char* op) {
  static std::atomic<int> allowed[FORWARD_KINDS][3][64] = {};
  ForwardKernels k{};
  add_forward_kernel<T, D, 1, false>(k, allowed, op);
  add_forward_kernel<T, D, 2, false>(k, allowed, op);
  add_forward_kernel<T, D, 1, true>(k, allowed, op);
  add_forward_kernel<T, D, 2, true>(k, allowed, op);
  add_forward_kernel<T, D, 1, true, true>(k, allowed, op);
  add_forward_kernel<T, D, 2, true, true>(k, allowed, op);
  add_forward_kernel<T, D, 1, false, false, true>(k, allowed, op);
  add_forward_kernel<T, D, 1, true, false, true>(k, allowed, op);
  add_forward_kernel<T, D, 1, true, false, false, true>(k, allowed, op);
  add_forward_kernel<T, D, 2, true, false, false, true>(k, allowed, op);
  add_forward_kernel<T, D, 1, true, false, true, true>(k, allowed, op);
  add_forward_kernel<T, D, 1, false, false, false, true>(k, allowed, op);
  add_forward_kernel<T, D, 2, false, false, false, true>(k, allowed, op);
  add_forward_kernel<T, D, 1, false, false, true, true>(k, allowed, op);
  if constexpr (D / 4 >= 32) {
    add_forward_kernel<T, D, 4, false>(k, allowed, op);
    add_forward_kernel<T, D, 4, true>(k, allowed, op);
    add_forward_kernel<T, D, 4, true, true>(k, allowed, op);
    add_forward_kernel<T, D, 4, true, false, false, true>(k, allowed, op);
    add_forward_kernel<T, D, 4, false, false, false, true>(k, allowed, op);
  }
  return k;
}

const ForwardKernel& kernel_of(const ForwardKernels& k, const Plan& w) {
  return k[kernel_kind(w.single, w.narrow, w.paired, w.overlap)][size_t(kernel_index(w.parts))];
}

}  // namespace

// ---------------------------------------------------------------- graphs
// One recorded call: its two graph nodes and the parameters they were captured with (the tensor maps
// and pointers of its layer; the work table and partials are the recording's, the same every step).
struct RecordedCall {
  cudaGraphNode_t forward = nullptr, combine = nullptr;
  std::unique_ptr<Params> params;
  ForwardKernels kernels{};
  void* combine_kernel = nullptr;
  int D = 0;
};

struct GraphRecording {
  int64_t Hq = 0, Hkv = 0, D = 0, max_items = 0, max_combines = 0, max_part_rows = 0;
  void* table = nullptr;     // device: items [max_items], then combines [max_combines]
  void* staging = nullptr;   // page-locked host copy of it, written by replan
  float* partials = nullptr; // device: part_o [max_part_rows, D], then part_ml [max_part_rows, 2]
  cudaEvent_t uploaded = nullptr;  // the last upload of `staging` (written again only after it)
  std::vector<RecordedCall> calls;
  // The launch shape the nodes were last set to {items, parts, combines, most rows}: a step whose
  // plan has the same shape (most decode steps: only the keys' lengths in the table change) sets
  // no node.
  std::array<int64_t, 5> applied{-1, -1, -1, -1, -1};
  size_t items_bytes() const { return size_t(max_items) * sizeof(Item); }
  size_t table_bytes() const { return items_bytes() + size_t(max_combines) * sizeof(Combine); }
  ~GraphRecording() {
    if (uploaded) cudaEventSynchronize(uploaded), cudaEventDestroy(uploaded);
    cudaFree(table);
    cudaFree(partials);
    cudaFreeHost(staging);
  }
};

void RecordingDeleter::operator()(GraphRecording* r) const { delete r; }

namespace {
thread_local GraphRecording* active_recording = nullptr;

// The recording this launch belongs to: the active one while `stream` is being captured.
GraphRecording* recording_for(cudaStream_t stream, const char* op) {
  if (!active_recording) return nullptr;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &status), op, "stream capture status");
  return status == cudaStreamCaptureStatusActive ? active_recording : nullptr;
}

// The node the capture of `stream` added last (the launch just made).
cudaGraphNode_t last_captured_node(cudaStream_t stream, const char* op) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* deps = nullptr;
  size_t n = 0;
#if CUDART_VERSION >= 13000
  check(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, nullptr, &n), op, "capture info");
#else  // CUDA 12: the six-argument form (edge data came with 12.3's _v3, the plain name's in 13)
  check(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &deps, &n), op, "capture info");
#endif
  if (status != cudaStreamCaptureStatusActive || n != 1 || !deps)
    throw Error(op, "graph", "the captured attention launch is not the capture's last node (cannot happen)");
  return deps[0];
}

template <class T, int D>
void launch(const AttentionForwardArgs& a, const KeyPages& pages, cudaStream_t stream, const char* op) {
  const int64_t Hq = a.q.shape[1], Hkv = a.k.shape[1];
  const int G = int(Hq / Hkv);
  const bool packable = G <= 64 && 64 % G == 0;
  GraphRecording* rec = recording_for(stream, op);
  const int sms = current_sm_count(op);
  const Plan& w = plan_work(a.seqs.as<const int32_t>(), a.seqs.shape[0], Hq, Hkv, D, sms);
  if (w.items.empty()) return;
  Params p{};
  const size_t item_bytes = w.items.size() * sizeof(Item), combine_bytes = w.combines.size() * sizeof(Combine);
  // Work tables: in the parameters when small, else uploaded; in a graph, the recording's (replan
  // writes them before every replay).
  const bool inline_tables = !rec && w.items.size() <= size_t(INLINE_ITEMS) && w.combines.size() <= size_t(INLINE_COMBINES);
  ScratchBuffer tables(inline_tables || rec ? 0 : item_bytes + combine_bytes, stream, op);
  if (rec) {
    if (rec->Hq != Hq || rec->Hkv != Hkv || rec->D != D)
      throw Error(op, "graph", "a captured attention of other heads than the graph was sized for");
    p.items = static_cast<const Item*>(rec->table);
    p.combines = reinterpret_cast<const Combine*>(static_cast<uint8_t*>(rec->table) + rec->items_bytes());
  } else if (inline_tables) {
    std::copy(w.items.begin(), w.items.end(), p.inline_items);
    std::copy(w.combines.begin(), w.combines.end(), p.inline_combines);
  } else {
    upload_to_device(tables.as<uint8_t>(), {{w.items.data(), item_bytes}, {w.combines.data(), combine_bytes}}, stream, op,
                     "work table");
    p.items = tables.as<const Item>();
    p.combines = reinterpret_cast<const Combine*>(tables.as<uint8_t>() + item_bytes);
  }
  const int64_t part_rows = rec ? rec->max_part_rows : w.part_rows;
  ScratchBuffer partials(rec ? 0 : size_t(part_rows) * (D + 2) * sizeof(float), stream, op);
  float* part = rec ? rec->partials : partials.as<float>();

  const T* q = a.q.as<const T>();
  const T* k = a.k.as<const T>();
  p.q_heads = sm90::tma_map_3d(q, a.q.shape[0], Hq, D, 1, 64);
  p.q_groups = packable ? sm90::tma_map_3d(q, a.q.shape[0], Hq, D, G, 64 / G) : p.q_heads;
  p.pages = pages;
  p.kv_box = pages.table && pages.page_size < BN ? pages.page_size : BN;
  p.k = sm90::tma_map_3d(k, a.k.shape[0], Hkv, D, 1, p.kv_box);
  p.v = sm90::tma_map_3d(a.v.as<const T>(), a.v.shape[0], Hkv, D, 1, p.kv_box);
  p.out = a.out.data;
  p.lse = a.lse.present() ? a.lse.as<float>() : nullptr;
  p.part_o = part;
  p.part_ml = part + part_rows * D;
  p.Hq = int(Hq), p.Hkv = int(Hkv), p.G = G;
  p.n_items = int(w.items.size());
  // The kernels' A/B switches, read once a process: "0" turns off the snake walk, the turns across
  // items and the 16-byte stores; "1" turns on the Q prefetch (an experiment).
  static const int snake = env_switch("SAMEBITS_SNAKE_WALK"), turns_across = env_switch("SAMEBITS_TURNS_ACROSS_ITEMS"),
                   prefetch_q = env_opt_in("SAMEBITS_PREFETCH_Q"),
                   vector_out = env_switch("SAMEBITS_VECTOR_OUT");
  p.snake = snake, p.turns_across = turns_across, p.prefetch_q = prefetch_q, p.vector_out = vector_out;
  p.n_combines = int(w.combines.size());
  const double scale = a.scale > 0 ? a.scale : 1.0 / std::sqrt(double(D));
  p.scale = float(scale);
  p.scale_log2 = float(scale * 1.4426950408889634);
  const auto kernels = forward_kernels<T, D>(op);
  void* args[] = {&p};
  const ForwardKernel& fk = kernel_of(kernels, w);
  // Both kernels start before the previous one ends (cuda/common/pdl.cuh); SAMEBITS_ATTENTION_PDL=0
  // launches them plainly (A/B runs).
  static const bool after_previous = env_switch("SAMEBITS_ATTENTION_PDL");
  launch_after_previous(fk.fn, dim3(grid_of(w, sms)), dim3(THREADS), fk.smem, stream, op, args, after_previous);
  if (w.narrow) ++detail::narrow_decode_launches();
  if (w.paired) ++detail::persistent_prefill_launches();
  if (w.overlap) ++detail::attention_overlap_launches();
  RecordedCall call;
  if (rec) call.forward = last_captured_node(stream, op);
  // A graph always holds the combine: a step without split spans runs it as one CTA with nothing to
  // do (whether a disabled node passes the programmatic launch on to the O GEMM is not documented).
  if (!w.combines.empty() || rec)
    launch_after_previous(reinterpret_cast<const void*>(attention_combine_kernel<T, D>), combine_grid(w), dim3(D / 2), 0,
                          stream, op, args, after_previous);
  if (rec) {
    call.combine = last_captured_node(stream, op);
    call.params = std::make_unique<Params>(p);
    call.kernels = kernels;
    call.combine_kernel = reinterpret_cast<void*>(attention_combine_kernel<T, D>);
    call.D = D;
    rec->calls.push_back(std::move(call));
  }
  // The tables and partials must outlive the kernels: ScratchBuffer frees them in stream order.
}

}  // namespace

void attention_forward_sm90(const AttentionForwardArgs& a, const KeyPages& pages, cudaStream_t stream, const char* op) {
  dispatch_type_and_head_dim(a.q.dtype, a.q.shape[2], [&](auto t, auto d) {
    launch<decltype(t), decltype(d)::value>(a, pages, stream, op);
  });
}

std::unique_ptr<GraphRecording, RecordingDeleter> make_graph_recording(int64_t max_seqs, int64_t max_k_len, int64_t Hq,
                                                                       int64_t Hkv, int64_t D, DType dtype) {
  const char* op = "attention graph";
  dispatch_type_and_head_dim(dtype, D, [&](auto t, auto d) { forward_kernels<decltype(t), decltype(d)::value>(op); });
  std::unique_ptr<GraphRecording, RecordingDeleter> r(new GraphRecording);
  const int64_t spans = ((std::max<int64_t>(max_k_len, 1) - 1) / BN + SPLIT_BLOCKS) / SPLIT_BLOCKS;
  r->Hq = Hq, r->Hkv = Hkv, r->D = D;
  r->max_items = std::max<int64_t>(max_seqs * std::max(Hkv * spans, Hq), current_sm_count(op));
  r->max_combines = max_seqs * Hkv;
  r->max_part_rows = max_seqs * Hq * spans;
  check(cudaMalloc(&r->table, r->table_bytes()), op, "work table");
  check(cudaMallocHost(&r->staging, r->table_bytes()), op, "work table staging");
  check(cudaMalloc(reinterpret_cast<void**>(&r->partials), size_t(r->max_part_rows) * size_t(D + 2) * sizeof(float)), op,
        "split-KV partials");
  check(cudaEventCreateWithFlags(&r->uploaded, cudaEventDisableTiming), op, "event");
  return r;
}

RecordingScope::RecordingScope(GraphRecording* r) : previous_(active_recording) { active_recording = r; }
RecordingScope::~RecordingScope() { active_recording = previous_; }

size_t recorded_calls(const GraphRecording& r) { return r.calls.size(); }

void replan_graph(GraphRecording& r, cudaGraphExec_t exec, const int32_t* seqs, int64_t n_seqs, cudaStream_t stream) {
  const char* op = "attention graph";
  if (r.calls.empty()) return;
  const int sms = current_sm_count(op);
  const Plan& w = plan_work(seqs, n_seqs, r.Hq, r.Hkv, int(r.D), sms);
  if (w.items.empty() || int64_t(w.items.size()) > r.max_items || int64_t(w.combines.size()) > r.max_combines ||
      w.part_rows > r.max_part_rows)
    throw Error(op, "seqs", "the step's attention work does not fit the tables its graph was made with (cannot happen)");
  check(cudaEventSynchronize(r.uploaded), op, "the last table upload");
  auto* staging = static_cast<uint8_t*>(r.staging);
  std::copy_n(reinterpret_cast<const uint8_t*>(w.items.data()), w.items.size() * sizeof(Item), staging);
  std::copy_n(reinterpret_cast<const uint8_t*>(w.combines.data()), w.combines.size() * sizeof(Combine),
              staging + r.items_bytes());
  check(cudaMemcpyAsync(r.table, staging, w.items.size() * sizeof(Item), cudaMemcpyHostToDevice, stream), op,
        "work table");
  if (!w.combines.empty())
    check(cudaMemcpyAsync(static_cast<uint8_t*>(r.table) + r.items_bytes(), staging + r.items_bytes(),
                          w.combines.size() * sizeof(Combine), cudaMemcpyHostToDevice, stream),
          op, "combine table");
  check(cudaEventRecord(r.uploaded, stream), op, "event");
  const std::array<int64_t, 5> shape{int64_t(w.items.size()), w.parts, int64_t(w.combines.size()), w.most_rows,
                                     int64_t(kernel_kind(w.single, w.narrow, w.paired, w.overlap))};
  if (shape == r.applied) return;
  r.applied = {-1, -1, -1, -1, -1};  // until every node is set
  for (RecordedCall& c : r.calls) {
    c.params->n_items = int(w.items.size());
    c.params->n_combines = int(w.combines.size());
    void* args[] = {c.params.get()};
    cudaKernelNodeParams k{};
    const ForwardKernel& fk = kernel_of(c.kernels, w);
    k.func = fk.fn;
    k.gridDim = dim3(grid_of(w, sms));
    k.blockDim = dim3(THREADS);
    k.sharedMemBytes = fk.smem;
    k.kernelParams = args;
    check(cudaGraphExecKernelNodeSetParams(exec, c.forward, &k), op, "update the forward node");
    cudaKernelNodeParams m{};
    m.func = c.combine_kernel;
    m.gridDim = combine_grid(w);
    m.blockDim = dim3(unsigned(c.D / 2));
    m.kernelParams = args;
    check(cudaGraphExecKernelNodeSetParams(exec, c.combine, &m), op, "update the combine node");
  }
  r.applied = shape;
}

}  // namespace samebits::cuda::attention
