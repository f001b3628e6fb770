// CUDA sampling: the token of each logits row, drawn on the device (no logits copy to the host).
//
// The rule (src/ops/sampling_rule.hpp) fixes one summation order by the vocab size alone: 1024
// lanes, lane ℓ adding the weights of ids ℓ, ℓ + 1024, … in turn from +0, the lanes' sums meeting in
// the pairwise tree over the lanes in order. Nothing is sorted: a cut (top-k by count, top-p by mass)
// is the largest 32-bit logit key whose candidates' measure reaches the goal, found 3 bits a pass
// (each pass measures the 7 thresholds of the next digit at once, each lane keeping 7 sums in
// ascending id order, so every threshold's mass is the rule's sum). Integer counts and the max
// (ties to the lower id) are exact in any order. Two kernels follow it, bit for bit the same:
//
// The cluster kernel (compute capability 9.0, vocabs up to 226,304 ids). Why: the one-CTA kernel
// below gave a row to one SM, which recomputed every weight (a polynomial exp) from L2 on every pass:
// issue-bound, 80 µs a row at B = 1 and 110 µs at B = 64 in a Qwen3-8B decode step on the H100
// (vocab 151,936, temperature 1, no cuts; 1.2–1.6% of the step, on its critical path), top-k and
// top-p adding 11–12 passes each over the whole row. Here a row is a cluster of 8 CTAs (the
// portable size) of 512 threads; CTA c owns lanes [128c, 128c + 128) and keeps their ids (for every
// stride j, the 128 ids j·1024 + 128c + …) in shared memory as {key, weight}: 149 strides × 128 × 8 B
// = 152 KB for Qwen3, loaded once (cp.async, a warp 32 consecutive ids), the weights computed once
// when the max is known. Every pass then reads shared memory:
//  - a lane's float sums are one thread's walk down its column (thread ℓ of the first 128: lane
//    128c + ℓ), so each is the rule's sequential sum; the CTA's 128 lane sums meet by warp xor
//    butterflies and ((w0 + w1) + (w2 + w3)) — the subtree of its lanes — and the 8 CTAs' values by
//    an exchange: each CTA leaves its value in its shared memory, a cluster barrier, then warp 0 of
//    every CTA reads the 8 (ld.shared::cluster) and combines them by an xor butterfly over 8 lanes:
//    the top 3 levels of the tree, the same bits in every CTA, so every CTA takes the same branches;
//  - counts (top-k, the tie search) run on all 512 threads in any order;
//  - the cuts' searches measure 7 thresholds a pass, as the radix passes do, but bracket the answer
//    (the largest key whose measure reaches the goal: the radix result, whichever keys are
//    measured): the first pass's thresholds sit at fixed logit distances below the max, later ones
//    split the bracket evenly — about 8 passes, not 11, the radix's first ones splitting only the
//    sign and the top exponent bits; and a block (one stride × 32 lanes) is read only if its largest
//    finite key, noted on the first look at the row, reaches the pass's floor (a block below adds +0
//    to sums that start at +0 and only grow: the same bits), so only the first pass reads the whole
//    row. Top-k's "above" and "tied" counts follow the bracket, its tie search tests 7 id bounds a
//    pass, top-p's total rides its first pass;
//  - the draw: each CTA builds the tree over its lanes, every CTA builds the top levels from the 8
//    roots and walks them alike; the chosen CTA walks its subtree, then one thread the chosen lane.
// Greedy takes 2 cluster barriers a row and temperature sampling 3; a top-k or top-p cut adds one a
// pass (about 8, at most 12; the tie search ⌈log8 V⌉ more where ties straddle the cut). No atomics:
// DSMEM loads and cluster barriers only. No CTA leaves while another may still read its shared
// memory: each arrives at a last cluster barrier after its last remote read and waits on it before
// leaving. A row's work depends on its logits and settings alone. Measured on the H100
// (bench_time_sampling, vocab 151,936, µs a call, cluster / one-CTA kernel): 1 row greedy 12.8 /
// 27.9, temperature 1 47.0 / 85.6, top-k 50 54.0 / 389.8, top-p 0.9 179.5 / 707.7, all three cuts
// 70.9 / 647.2; 8 rows alike; 64 rows (512 CTAs of 152 KB: four rounds) temperature 1 198.6 / 97.8,
// top-p 838.1 / 747.6, top-k 247.5 / 437.9. So the cluster kernel serves calls whose clusters fit the
// SMs at once (sample_tokens); the one-CTA kernel the rest.
//
// The one-CTA kernel (other devices, larger vocabs, and the reference on the GPU: tests force it
// with detail::sampling_kernel_override): one CTA of 1024 threads a row, thread ℓ being lane ℓ:
// its loads are coalesced, the xor butterfly of a warp is the tree over its 32 lanes and warp 0's
// butterfly over the 32 warp sums finishes it. Weights are recomputed from the logits each pass;
// the row stays in L2 between passes. Greedy and plain temperature sampling read the row three
// times; top-k adds 12 count passes, top-p 12 mass passes. Each pass issues a lane's loads eight
// at a time before using them (for_lane), the values still taken in the rule's order.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cuda/common/pdl.cuh"
#include "cuda/common/runtime.cuh"
#include "ops/registry.hpp"
#include "ops/sampling_rule.hpp"
#include "ops/tuning.hpp"
#include "samebits/ops.hpp"

namespace samebits::cuda {
namespace {

using namespace sampling_rule;

constexpr unsigned FULL = 0xffffffffu;
constexpr int WARPS = LANES / 32;
constexpr int DIGIT_BITS = 3, TRIES = (1 << DIGIT_BITS) - 1;  // a radix pass measures 7 thresholds (digits 1 … 7):
                                                            // 11 passes for 32 bits, in 64 registers a thread

// The chosen lane's logits, loaded by the whole CTA before its one thread walks them (ids ℓ, ℓ + 1024,
// …: 149 for a 151,936 vocab; a lane past LANE_CACHE ids reads the rest from memory).
constexpr int LANE_CACHE = 512;

struct Shared {
  float tree[2 * LANES];
  float lane_x[LANE_CACHE];
  float fsum[TRIES][WARPS];
  int isum[TRIES][WARPS];
  uint32_t best_key[WARPS];
  int best_id[WARPS];
  float draw_t;
  int draw_lane;
};

__device__ __forceinline__ float exact_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ int exact_add(int a, int b) { return a + b; }

// Every lane of the warp gets the pairwise-tree sums over the warp's 32 lanes of its N values (the
// xor butterfly: lane i and lane i ^ off add the same two numbers, so every lane holds the same bits).
template <class T, int N>
__device__ __forceinline__ void warp_sums(T (&v)[N]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int off = 1; off < 32; off *= 2) v[n] = exact_add(v[n], __shfl_xor_sync(FULL, v[n], off));
}

// Every thread gets the pairwise-tree sums over the block of its N values (thread order = lane
// order): the xor butterfly of each warp, then warp 0's over the warp sums (`scratch`: shared).
template <class T, int N>
__device__ __forceinline__ void block_sums(T (&v)[N], T (&scratch)[TRIES][WARPS]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_sums(v);
  if (lane == 0)
#pragma unroll
    for (int n = 0; n < N; ++n) scratch[n][warp] = v[n];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
      T x = scratch[n][lane];
#pragma unroll
      for (int off = 1; off < 32; off *= 2) x = exact_add(x, __shfl_xor_sync(FULL, x, off));
      __syncwarp();
      if (lane == 0) scratch[n][0] = x;
    }
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = scratch[n][0];
  __syncthreads();
}

// Calls f(x, i) with x = z[i] for i = l, l + LANES, … below V — lane l's ids in the rule's order —
// its loads issued ROW_BATCH at a time ahead of the calls: one CTA walks a whole row (151,936 logits
// for Qwen3) several times, and a load waited on before the next was issued left it latency-bound.
// The calls, and so every sum and count, come in the same order: the same bits.
constexpr int ROW_BATCH = 8;
template <class F>
__device__ __forceinline__ void for_lane(const float* __restrict__ z, int V, int l, F&& f) {
  int i = l;
  for (; i + (ROW_BATCH - 1) * LANES < V; i += ROW_BATCH * LANES) {
    float x[ROW_BATCH];
#pragma unroll
    for (int u = 0; u < ROW_BATCH; ++u) x[u] = z[i + u * LANES];
#pragma unroll
    for (int u = 0; u < ROW_BATCH; ++u) f(x[u], i + u * LANES);
  }
  for (; i < V; i += LANES) f(z[i], i);
}

// The draw's walk down a heap-ordered tree of sums (node n's children 2n and 2n + 1, `leaves` leaves
// from index `leaves` on): left where t is below the left sum or the right one is empty, else right
// with the left sum taken off t. Returns the leaf reached (0 … leaves − 1); t keeps what is left.
__device__ __forceinline__ int walk_tree(const float* tree, int leaves, float& t) {
  int node = 1;
  while (node < leaves) {
    const float left = tree[2 * node], right = tree[2 * node + 1];
    if (t < left || !(right > 0.0f)) {
      node = 2 * node;
    } else {
      t = __fsub_rn(t, left);
      node = 2 * node + 1;
    }
  }
  return node - leaves;
}

// The larger key, ties to the lower id (id −1: none).
__device__ __forceinline__ void better(uint32_t& key, int& id, uint32_t k2, int id2) {
  if (id2 >= 0 && (id < 0 || k2 > key || (k2 == key && id2 < id))) {
    key = k2;
    id = id2;
  }
}

// What the row's candidates are after each cut: finite, then in the top k (key above tk, or equal
// with an id ≤ tie_id), then at or above the top-p key, then weighing at least min_p.
struct Cuts {
  uint32_t tk = 0, tp = 0;
  int tie_id;
  double min_p = 0;
  __device__ __forceinline__ bool topk(float x, uint32_t key, int i) const {
    return x > -INFINITY && (key > tk || (key == tk && i <= tie_id));
  }
  __device__ __forceinline__ bool all(float x, uint32_t key, int i, float w) const {
    return topk(x, key, i) && key >= tp && (min_p == 0 || double(w) >= min_p);
  }
};

__global__ void __launch_bounds__(LANES, 1)
    sample_rows(const float* __restrict__ logits, const double* __restrict__ params, int V, int32_t* tokens,
                uint8_t* kept, float* weights) {
  pdl_wait();  // launched after the previous kernel (cuda/common/pdl.cuh): its output is ready from here
  pdl_launch_dependents();
  __shared__ Shared s;
  const int l = threadIdx.x, warp = l >> 5, lane = l & 31;
  const float* z = logits + int64_t(blockIdx.x) * V;
  uint8_t* kept_row = kept ? kept + int64_t(blockIdx.x) * V : nullptr;
  const RowParams p = params_of(params + int64_t(blockIdx.x) * PARAMS);
  float* weight = weights ? weights + 2 * int64_t(blockIdx.x) : nullptr;  // {drawn token's, kept total}
  auto finish_bad = [&](int32_t code) {
    if (kept_row)
      for (int i = l; i < V; i += LANES) kept_row[i] = 0;
    if (l == 0) tokens[blockIdx.x] = code;
    if (l == 0 && weight) weight[0] = weight[1] = 0.0f;
  };
  if (!params_ok(p)) return finish_bad(BAD_PARAMS);

  // Pass 1: finiteness, the count of finite logits, the max (first id on ties).
  int bad = 0, finite[1] = {0}, best_id = -1;
  uint32_t best_key = 0;
  for_lane(z, V, l, [&](float x, int i) {
    if (isnan(x) || x == INFINITY) bad = 1;
    else if (x > -INFINITY) {
      ++finite[0];
      better(best_key, best_id, key_of(x), i);
    }
  });
  bad = __syncthreads_or(bad);
  if (bad) return finish_bad(BAD_LOGITS);
  block_sums(finite, s.isum);
  if (finite[0] == 0) return finish_bad(BAD_LOGITS);
#pragma unroll
  for (int off = 1; off < 32; off *= 2)
    better(best_key, best_id, __shfl_xor_sync(FULL, best_key, off), __shfl_xor_sync(FULL, best_id, off));
  if (lane == 0) s.best_key[warp] = best_key, s.best_id[warp] = best_id;
  __syncthreads();
  if (warp == 0) {
    best_key = s.best_key[lane];
    best_id = s.best_id[lane];
#pragma unroll
    for (int off = 1; off < 32; off *= 2)
      better(best_key, best_id, __shfl_xor_sync(FULL, best_key, off), __shfl_xor_sync(FULL, best_id, off));
    if (lane == 0) s.best_key[0] = best_key, s.best_id[0] = best_id;
  }
  __syncthreads();
  const int arg = s.best_id[0];
  const uint32_t max_key = s.best_key[0];
  if (p.temperature == 0) {
    if (kept_row)
      for (int i = l; i < V; i += LANES) kept_row[i] = i == arg;
    if (l == 0) tokens[blockIdx.x] = arg;
    if (l == 0 && weight) weight[0] = weight[1] = 1.0f;
    return;
  }
  const float max_logit = z[arg], inv_t = inverse_temperature(p.temperature);
  Cuts cut;
  cut.tie_id = V - 1;

  // Top-k: the largest key t with count(key ≥ t) ≥ k, then the lowest ids among those tied at t.
  const int k = int(p.top_k);
  if (k > 0 && k < finite[0]) {
    uint32_t t = 0;
    for (int high = 32; high > 0; high -= DIGIT_BITS) {
      const int shift = high > DIGIT_BITS ? high - DIGIT_BITS : 0, tries = (1 << (high - shift)) - 1;
      int cnt[TRIES] = {};
      for_lane(z, V, l, [&](float x, int) {
        if (!(x > -INFINITY)) return;
        const uint32_t key = key_of(x);
#pragma unroll
        for (int d = 0; d < TRIES; ++d) cnt[d] += key >= (t | (uint32_t(d + 1) << shift));
      });
      block_sums(cnt, s.isum);
      int digit = 0;
#pragma unroll
      for (int d = 0; d < TRIES; ++d)
        if (d < tries && cnt[d] >= k) digit = d + 1;
      t |= uint32_t(digit) << shift;
    }
    int above_and_tied[2] = {0, 0};
    for_lane(z, V, l, [&](float x, int) {
      if (!(x > -INFINITY)) return;
      const uint32_t key = key_of(x);
      above_and_tied[0] += key > t;
      above_and_tied[1] += key == t;
    });
    block_sums(above_and_tied, s.isum);
    cut.tk = t;
    const int need = k - above_and_tied[0];
    if (above_and_tied[1] > need) {  // the smallest id bound keeping `need` of the tied ids
      int lo = 0, hi = V - 1;
      while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        int c[1] = {0};
        for (int i = l; i <= mid; i += LANES) {
          const float x = z[i];
          c[0] += x > -INFINITY && key_of(x) == t;
        }
        block_sums(c, s.isum);
        if (c[0] >= need) hi = mid;
        else lo = mid + 1;
      }
      cut.tie_id = lo;
    }
  }

  // Top-p: the largest key t whose candidates' mass (the rule's sum) reaches the goal.
  if (p.top_p < 1) {
    float total[1] = {0.0f};
    for_lane(z, V, l, [&](float x, int i) {
      const uint32_t key = key_of(x);
      if (cut.topk(x, key, i)) total[0] = __fadd_rn(total[0], weight_of(x, max_logit, inv_t));
    });
    block_sums(total, s.fsum);
    const float goal = top_p_goal(p.top_p, total[0]);
    uint32_t t = 0;
    for (int high = 32; high > 0; high -= DIGIT_BITS) {
      const int shift = high > DIGIT_BITS ? high - DIGIT_BITS : 0, tries = (1 << (high - shift)) - 1;
      float m[TRIES] = {};
      for_lane(z, V, l, [&](float x, int i) {
        const uint32_t key = key_of(x);
        if (!cut.topk(x, key, i)) return;
        const float w = weight_of(x, max_logit, inv_t);
#pragma unroll
        for (int d = 0; d < TRIES; ++d) m[d] = __fadd_rn(m[d], key >= (t | (uint32_t(d + 1) << shift)) ? w : 0.0f);
      });
      block_sums(m, s.fsum);
      int digit = 0;
#pragma unroll
      for (int d = 0; d < TRIES; ++d)
        if (d < tries && m[d] >= goal) digit = d + 1;
      t |= uint32_t(digit) << shift;
    }
    cut.tp = t < max_key ? t : max_key;
  }
  cut.min_p = p.min_p;

  // The draw: the lanes' sums into the tree, t walked down it, then along the chosen lane.
  float acc = 0.0f;
  for_lane(z, V, l, [&](float x, int i) {
    const float w = weight_of(x, max_logit, inv_t);
    const bool in = cut.all(x, key_of(x), i, w);
    if (in) acc = __fadd_rn(acc, w);
    if (kept_row) kept_row[i] = in;
  });
  s.tree[LANES + l] = acc;
  __syncthreads();
  for (int n = LANES / 2; n >= 1; n /= 2) {
    if (l < n) s.tree[n + l] = __fadd_rn(s.tree[2 * (n + l)], s.tree[2 * (n + l) + 1]);
    __syncthreads();
  }
  if (l == 0) {
    float t = draw_target(p.u, s.tree[1]);
    s.draw_lane = walk_tree(s.tree, LANES, t);
    s.draw_t = t;
  }
  __syncthreads();
  // The walk along the chosen lane is one thread's: its logits come from shared memory, loaded by
  // every thread at once (walking memory, the thread waited on each load in turn: ~90 µs of a
  // 151,936 vocab's row on the H100). The same values, the same arithmetic.
  const int dl = s.draw_lane;
  for (int j = l; j < LANE_CACHE && dl + int64_t(j) * LANES < V; j += LANES) s.lane_x[j] = z[dl + j * LANES];
  __syncthreads();
  if (l != dl) return;
  const float t = s.draw_t;
  int token = -1;
  float token_w = 0.0f;
  acc = 0.0f;
  for (int i = l, j = 0; i < V; i += LANES, ++j) {
    const float x = j < LANE_CACHE ? s.lane_x[j] : z[i];
    const float w = weight_of(x, max_logit, inv_t);
    if (!cut.all(x, key_of(x), i, w)) continue;
    acc = __fadd_rn(acc, w);
    if (w > 0.0f) token = i, token_w = w;
    if (acc > t) break;
  }
  tokens[blockIdx.x] = token;
  if (weight) {
    weight[0] = token >= 0 ? token_w : 0.0f;
    weight[1] = token >= 0 ? s.tree[1] : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// The cluster kernel (compute capability 9.0): a row on a cluster of CTAS CTAs, CTA c holding lanes
// [c·CL, (c + 1)·CL) — for every stride j the ids j·LANES + c·CL + [0, CL) — in its shared memory.

constexpr int CTAS = 8;                   // CTAs a row (the portable cluster size)
constexpr int CL = LANES / CTAS;          // lanes a CTA: 128
constexpr int CTHREADS = 512;             // threads a CTA
constexpr int GROUPS = CTHREADS / CL;     // thread (g, l): lane l, strides g, g + GROUPS, …
constexpr int LANE_WARPS = CL / 32;       // a warp: 32 consecutive lanes of one group
constexpr int CWARPS = CTHREADS / 32;
constexpr int MAX_STRIDES = 221;          // 226,304 ids: the most a CTA's shared memory holds
constexpr int SLOTS = 4;                  // exchange slots, reused round-robin (a slot is rewritten
                                          // two cluster barriers after it was read: safe from 2 up)
static_assert(LANES % CTAS == 0 && CL % 32 == 0 && CTHREADS % CL == 0, "the lanes split into whole warps");
static_assert((CTAS & (CTAS - 1)) == 0 && CTAS <= 32, "the CTAs' butterfly needs a power of two within a warp");
static_assert((CL & (CL - 1)) == 0, "a CTA's lanes form a subtree of the pairwise tree");
static_assert(GROUPS * LANE_WARPS == CWARPS, "warp = g · LANE_WARPS + lane warp");

struct ClusterShared {
  float tree[2 * CL];                   // the draw's tree over this CTA's lanes (tree[1]: its root)
  float top[2 * CTAS];                  // the tree's top levels over the CTAs' roots
  uint32_t slot[SLOTS][8];              // what this CTA offers the cluster in an exchange
  uint32_t part[8][CWARPS];             // warps' partial results
  uint32_t result[8];                   // an exchange's result, the same in every CTA
  uint32_t top_key[LANE_WARPS][MAX_STRIDES];  // the largest finite key of stride j in lane warp w's
                                              // 32 lanes (a block); 0: none finite
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // the cluster kernel's device code (sm_90a only)
constexpr uint32_t KEY_NEG_INF = 0x007fffffu;  // key_of(−inf); a finite logit's key is above it
constexpr uint32_t KEY_FINITE = KEY_NEG_INF + 1;  // the least key of a finite logit
constexpr uint32_t NEG_INF_BITS = 0xff800000u;

// What the row's candidates are after each cut, on keys (a finite logit: key above KEY_NEG_INF):
// the one-CTA kernel's Cuts, the same tests.
struct KeyCuts {
  uint32_t tk = 0, tp = 0;
  int tie_id;
  double min_p = 0;
  __device__ __forceinline__ bool topk(uint32_t key, int i) const {
    return key > KEY_NEG_INF && (key > tk || (key == tk && i <= tie_id));
  }
  __device__ __forceinline__ bool all(uint32_t key, int i, float w) const {
    return topk(key, i) && key >= tp && (min_p == 0 || double(w) >= min_p);
  }
};

__device__ __forceinline__ uint32_t f2u(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float u2f(uint32_t x) { return __uint_as_float(x); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint32_t cta_rank_in_cluster() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_index() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
// The cluster barrier, in two halves: arrive (release: this thread's earlier shared-memory writes
// and reads are ordered before it) and wait (acquire: returns once every non-exited thread of the
// cluster has arrived). Not .aligned: no warp-convergence assumption.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }
// A word of CTA `rank`'s shared memory, at the place of `local` in this CTA's.
__device__ __forceinline__ uint32_t load_remote(const uint32_t* local, uint32_t rank) {
  uint32_t remote, v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ void copy_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void copy_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// An exchange: every CTA has put N words in s.slot[r % SLOTS]; afterwards s.result holds their
// combination over the cluster, the same bits in every CTA. Lane i of warp 0 reads CTA i's words
// and an xor butterfly over the CTAS lanes combines them: for floats (v = v + other) lane 0 holds
// the pairwise tree over the CTAs in rank order, the top levels of the rule's tree over the lanes.
template <int N, class Combine>
__device__ __forceinline__ void cluster_combine(ClusterShared& s, int r, Combine combine) {
  cluster_arrive();  // the slot (and everything before) is written …
  cluster_wait();    // … in every CTA of the cluster
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    uint32_t v[N];
#pragma unroll
    for (int n = 0; n < N; ++n) v[n] = lane < CTAS ? load_remote(&s.slot[r % SLOTS][n], uint32_t(lane)) : 0u;
#pragma unroll
    for (int off = 1; off < CTAS; off *= 2) {
      uint32_t o[N];
#pragma unroll
      for (int n = 0; n < N; ++n) o[n] = __shfl_xor_sync(FULL, v[n], off);
      combine(v, o);
    }
    if (lane == 0)
#pragma unroll
      for (int n = 0; n < N; ++n) s.result[n] = v[n];
  }
  __syncthreads();
}

template <int N>
__device__ __forceinline__ void add_counts(uint32_t (&v)[N], const uint32_t (&o)[N]) {
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] += o[n];
}
template <int N>
__device__ __forceinline__ void add_floats(uint32_t (&v)[N], const uint32_t (&o)[N]) {
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = f2u(__fadd_rn(u2f(v[n]), u2f(o[n])));
}

// The cluster's totals of N integer counts (any order: exact), into `v`.
template <int N>
__device__ __forceinline__ void cluster_counts(ClusterShared& s, int& round, int (&v)[N]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_sums(v);
  if (lane == 0)
#pragma unroll
    for (int n = 0; n < N; ++n) s.part[n][warp] = uint32_t(v[n]);
  __syncthreads();
  if (threadIdx.x < N) {
    uint32_t total = 0;
    for (int w = 0; w < CWARPS; ++w) total += s.part[threadIdx.x][w];
    s.slot[round % SLOTS][threadIdx.x] = total;
  }
  cluster_combine<N>(s, round++, [](uint32_t(&a)[N], const uint32_t(&b)[N]) { add_counts(a, b); });
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = int(s.result[n]);
}

// The rule's sums of N per-lane sums `v` (group 0's threads: lane l's sum in thread l; the other
// groups' values are not read): the pairwise tree over the CL lanes (each warp's xor butterfly,
// then ((w0 + w1) + (w2 + w3))), then over the CTAs — the rule's tree over the 1024 lanes, into `v`.
template <int N>
__device__ __forceinline__ void cluster_sums(ClusterShared& s, int& round, float (&v)[N]) {
  static_assert(LANE_WARPS == 4, "the CTA's subtree below is written for four lane warps");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp < LANE_WARPS) {
    warp_sums(v);
    if (lane == 0)
#pragma unroll
      for (int n = 0; n < N; ++n) s.part[n][warp] = f2u(v[n]);
  }
  __syncthreads();
  if (threadIdx.x < N) {
    const uint32_t* q = s.part[threadIdx.x];
    s.slot[round % SLOTS][threadIdx.x] =
        f2u(__fadd_rn(__fadd_rn(u2f(q[0]), u2f(q[1])), __fadd_rn(u2f(q[2]), u2f(q[3]))));
  }
  cluster_combine<N>(s, round++, [](uint32_t(&a)[N], const uint32_t(&b)[N]) { add_floats(a, b); });
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = u2f(s.result[n]);
}

// Lane warp `lw`'s blocks whose largest finite key reaches `floor`, in ascending stride order (a
// warp of group 0 calls it: its 32 lanes are the warp's lanes): f(j, {key, weight bits}) for this
// thread's lane l. A block left out holds no key at or above the floor, so no candidate of the pass
// (every caller's candidates have keys at or above its floor) and adds +0 to every lane sum: the sums
// start at +0 and add weights ≥ +0, so leaving it out keeps the bits. Four strides' loads go out
// before their calls.
template <class F>
__device__ __forceinline__ void walk_blocks(const ClusterShared& s, const uint2* kw, int lw, int l, int S,
                                            uint32_t floor, F&& f) {
  const int lane = threadIdx.x & 31;
  for (int j0 = 0; j0 < S; j0 += 32) {
    uint32_t bits = __ballot_sync(FULL, j0 + lane < S && s.top_key[lw][j0 + lane] >= floor);
    while (bits) {
      int js[4];
      uint2 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        js[u] = bits ? j0 + __ffs(bits) - 1 : -1;
        bits &= bits - 1;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (js[u] >= 0) v[u] = kw[js[u] * CL + l];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (js[u] >= 0) f(js[u], v[u]);
    }
  }
}

// The threshold searches (top-k by count, top-p by mass) look for the largest key t in [0, max key]
// whose measure reaches the goal, the measure never growing with t: a bracket lo < hi, lo's
// measure known to reach the goal, hi's not (or hi past the max key), 7 thresholds measured a pass.
// The answer is the one-CTA kernel's radix result (the largest such t; its top-p cut is capped at
// the max key), whatever thresholds are measured: the first pass's sit at fixed logit distances
// below the max (`scale` · 1.5 … 24: where cuts fall, so that few blocks still reach the bracket
// after it; the radix digits' first passes split only the sign and top exponent bits), later ones
// spread evenly over the bracket. Every CTA computes the same thresholds. Needs hi − lo ≥ 2.
__device__ __forceinline__ constexpr double first_gap(int d) {
  return d == 0 ? 24.0 : d == 1 ? 16.0 : d == 2 ? 11.0 : d == 3 ? 8.0 : d == 4 ? 5.5 : d == 5 ? 3.5 : 1.5;
}
__device__ __forceinline__ void thresholds(uint32_t (&T)[TRIES], int pass, uint32_t lo, uint32_t hi, float max_logit,
                                           double scale) {
#pragma unroll
  for (int d = 0; d < TRIES; ++d) {
    const uint32_t t = pass == 0 ? key_of(float(double(max_logit) - first_gap(d) * scale))
                                 : lo + uint32_t(uint64_t(hi - lo) * uint64_t(d + 1) / (TRIES + 1));
    T[d] = t < lo + 1 ? lo + 1 : t > hi - 1 ? hi - 1 : t;  // in (lo, hi): each measured one moves lo or hi
  }
}
#endif  // __CUDA_ARCH__ >= 900

// S = ceil(V / LANES) strides; dynamic shared memory: S · CL {key, weight} pairs.
__global__ void __launch_bounds__(CTHREADS, 1)
    sample_rows_cluster(const float* __restrict__ logits, const double* __restrict__ params, int V, int S,
                        int32_t* tokens, uint8_t* kept, float* weights) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  pdl_wait();  // launched after the previous kernel (cuda/common/pdl.cuh): its output is ready from here
  pdl_launch_dependents();
  extern __shared__ uint2 kw[];  // kw[j · CL + l]: {key, weight bits} of id j · LANES + c · CL + l
  __shared__ ClusterShared s;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = tid / CL, l = tid % CL, lw = l / 32;  // lw = warp % LANE_WARPS
  const uint32_t c = cta_rank_in_cluster();
  const int64_t row = cluster_index();
  const int base = int(c) * CL + l;  // this thread's ids: base + j · LANES, j = g, g + GROUPS, …
  const float* z = logits + row * V;
  uint8_t* kept_row = kept ? kept + row * V : nullptr;
  const RowParams p = params_of(params + row * PARAMS);
  float* weight = weights ? weights + 2 * row : nullptr;  // {drawn token's, kept total}
  int round = 0;                                          // exchanges so far (the same in every CTA)
  auto write_kept = [&](auto&& in) {
    if (kept_row)
      for (int j = g; j < S; j += GROUPS) {
        const int i = base + j * LANES;
        if (i < V) kept_row[i] = in(j, i);
      }
  };
  if (!params_ok(p)) {  // before any exchange: every CTA may leave at once
    write_kept([](int, int) { return 0; });
    if (c == 0 && tid == 0) {
      tokens[row] = BAD_PARAMS;
      if (weight) weight[0] = weight[1] = 0.0f;
    }
    return;
  }

  // The row's slice, once from global memory (coalesced: a warp reads 32 consecutive ids); the
  // logits in .y until the weights replace them, ids past V as −inf.
  for (int j = g; j < S; j += GROUPS) {
    const int i = base + j * LANES;
    if (i < V) copy_async4(&kw[j * CL + l].y, z + i);
    else kw[j * CL + l].y = NEG_INF_BITS;
  }
  copy_async_wait_all();
  __syncthreads();

  // Finiteness, the count of finite logits, the max (first id on ties); keys into .x; each block's
  // largest finite key.
  int bad = 0, finite = 0, best_id = -1;
  uint32_t best_key = 0;
  for (int j = g; j < S; j += GROUPS) {
    uint2& e = kw[j * CL + l];
    const float x = u2f(e.y);
    const uint32_t key = key_of(x);
    if (isnan(x) || x == INFINITY) bad = 1;
    else if (x > -INFINITY) {
      ++finite;
      better(best_key, best_id, key, base + j * LANES);
    }
    e.x = key;
    const uint32_t top = __reduce_max_sync(FULL, x > -INFINITY && x < INFINITY ? key : 0u);
    if (lane == 0) s.top_key[lw][j] = top;
  }
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    finite += __shfl_xor_sync(FULL, finite, off);
    better(best_key, best_id, __shfl_xor_sync(FULL, best_key, off), __shfl_xor_sync(FULL, best_id, off));
  }
  if (lane == 0) s.part[0][warp] = uint32_t(finite), s.part[1][warp] = best_key, s.part[2][warp] = uint32_t(best_id);
  bad = __syncthreads_or(bad);
  if (tid == 0) {
    int f = 0, id = -1;
    uint32_t key = 0;
    for (int w = 0; w < CWARPS; ++w) {
      f += int(s.part[0][w]);
      better(key, id, s.part[1][w], int(s.part[2][w]));
    }
    uint32_t* out = s.slot[round % SLOTS];
    out[0] = uint32_t(bad), out[1] = uint32_t(f), out[2] = key, out[3] = uint32_t(id);
  }
  cluster_combine<4>(s, round++, [](uint32_t(&a)[4], const uint32_t(&b)[4]) {
    a[0] |= b[0];
    a[1] += b[1];
    uint32_t key = a[2];
    int id = int(a[3]);
    better(key, id, b[2], int(b[3]));
    a[2] = key, a[3] = uint32_t(id);
  });
  bad = int(s.result[0]);
  finite = int(s.result[1]);
  const uint32_t max_key = s.result[2];
  const int arg = int(s.result[3]);
  // From here every CTA has read other CTAs' shared memory: none leaves before all have passed
  // cluster_arrive (after their last such read) — cluster_wait just before each return.
  if (bad || finite == 0) {
    cluster_arrive();
    write_kept([](int, int) { return 0; });
    if (c == 0 && tid == 0) {
      tokens[row] = BAD_LOGITS;
      if (weight) weight[0] = weight[1] = 0.0f;
    }
    cluster_wait();
    return;
  }
  if (p.temperature == 0) {
    cluster_arrive();
    write_kept([&](int, int i) { return i == arg; });
    if (c == 0 && tid == 0) {
      tokens[row] = arg;
      if (weight) weight[0] = weight[1] = 1.0f;
    }
    cluster_wait();
    return;
  }
  const float max_logit = z[arg], inv_t = inverse_temperature(p.temperature);
  KeyCuts cut;
  cut.tie_id = V - 1;

  // Top-k: the largest key t with count(key ≥ t) ≥ k (the bracket search above: counts over the
  // blocks reaching lo). ge = count(key ≥ lo) and gt = count(key ≥ hi) follow the bracket, so at its
  // end (hi = t + 1) the one-CTA kernel's "above" and "tied" counts are gt and ge − gt.
  const int k = int(p.top_k);
  if (k > 0 && k < finite) {
    uint32_t lo = 0, hi = max_key + 1;
    int ge = finite, gt = 0;
    for (int pass = 0; hi - lo > 1; ++pass) {
      uint32_t T[TRIES];
      thresholds(T, pass, lo, hi, max_logit, 1.0);
      const uint32_t floor = lo > KEY_FINITE ? lo : KEY_FINITE;
      int cnt[TRIES] = {};
      for (int j = g; j < S; j += GROUPS) {
        if (s.top_key[lw][j] < floor) continue;  // the same for the warp's 32 lanes
        const uint32_t key = kw[j * CL + l].x;
        const bool fin = key > KEY_NEG_INF;
#pragma unroll
        for (int d = 0; d < TRIES; ++d) cnt[d] += fin && key >= T[d];
      }
      cluster_counts(s, round, cnt);
      uint32_t nlo = lo, nhi = hi;
#pragma unroll
      for (int d = 0; d < TRIES; ++d)
        if (cnt[d] >= k && T[d] > nlo) nlo = T[d], ge = cnt[d];
#pragma unroll
      for (int d = TRIES - 1; d >= 0; --d)
        if (cnt[d] < k && T[d] < nhi) nhi = T[d], gt = cnt[d];
      lo = nlo;
      hi = nhi;
    }
    const uint32_t t = lo;
    cut.tk = t;
    const int need = k - gt;
    if (ge - gt > need) {  // the smallest id bound keeping `need` of the tied ids, 7 bounds a pass
      int first = 0, last = V - 1;  // the bound is in [first, last]
      while (first < last) {
        int b[TRIES];
#pragma unroll
        for (int d = 0; d < TRIES; ++d) b[d] = first + int(int64_t(last - first) * (d + 1) / (TRIES + 1));  // < last
        int cnt[TRIES] = {};
        for (int j = g; j < S; j += GROUPS) {
          if (s.top_key[lw][j] < t) continue;  // no tied key in the block
          const uint32_t key = kw[j * CL + l].x;
          const int i = base + j * LANES;
#pragma unroll
          for (int d = 0; d < TRIES; ++d) cnt[d] += key == t && i <= b[d];
        }
        cluster_counts(s, round, cnt);
        int nfirst = first, nlast = last;  // counts grow with the bound: after the last short one, up to the first full
#pragma unroll
        for (int d = TRIES - 1; d >= 0; --d)
          if (cnt[d] >= need) nlast = b[d];
#pragma unroll
        for (int d = 0; d < TRIES; ++d)
          if (cnt[d] < need) nfirst = b[d] + 1;
        first = nfirst;
        last = nlast;
      }
      cut.tie_id = first;
    }
  }

  // The weights, once (the rule's weight_of of the logit still in .y), where a candidate can be: the
  // blocks reaching the top-k cut; elsewhere 0 (never a candidate, so never read for its value).
  const uint32_t candidate_floor = cut.tk > KEY_FINITE ? cut.tk : KEY_FINITE;  // a candidate's key is at or above it
  for (int j = g; j < S; j += GROUPS) {
    uint2& e = kw[j * CL + l];
    e.y = s.top_key[lw][j] >= candidate_floor ? f2u(weight_of(u2f(e.y), max_logit, inv_t)) : 0u;
  }
  __syncthreads();

  // Top-p: the largest key t in [0, max key] whose candidates' mass (the rule's sum) reaches the goal
  // (the bracket search above; the one-CTA kernel's min(radix t, max key)). Lane sums run in group 0
  // (thread l walks lane l's blocks in stride order), 7 thresholds at once; the first pass also sums
  // the candidates' total (the goal's base). A pass walks the blocks reaching max(lo, the top-k cut):
  // every key it measures is at or above both.
  if (p.top_p < 1) {
    uint32_t lo = 0, hi = max_key + 1;
    float goal = 0.0f;
    for (int pass = 0; hi - lo > 1; ++pass) {
      uint32_t T[TRIES];
      thresholds(T, pass, lo, hi, max_logit, p.temperature);
      float m[TRIES + 1] = {};  // m[TRIES]: the total (first pass)
      if (g == 0)
        walk_blocks(s, kw, lw, l, S, lo > candidate_floor ? lo : candidate_floor, [&](int j, uint2 v) {
          const uint32_t key = v.x;
          const float w = u2f(v.y);
          const bool cand = cut.topk(key, base + j * LANES);
#pragma unroll
          for (int d = 0; d < TRIES; ++d) m[d] = __fadd_rn(m[d], cand && key >= T[d] ? w : 0.0f);
          if (pass == 0) m[TRIES] = __fadd_rn(m[TRIES], cand ? w : 0.0f);
        });
      cluster_sums(s, round, m);
      if (pass == 0) goal = top_p_goal(p.top_p, m[TRIES]);
      uint32_t nlo = lo, nhi = hi;
#pragma unroll
      for (int d = 0; d < TRIES; ++d)
        if (m[d] >= goal && T[d] > nlo) nlo = T[d];
#pragma unroll
      for (int d = TRIES - 1; d >= 0; --d)
        if (!(m[d] >= goal) && T[d] < nhi) nhi = T[d];
      lo = nlo;
      hi = nhi;
    }
    cut.tp = lo;
  }
  cut.min_p = p.min_p;

  // The draw: the lanes' sums of the kept weights (group 0, each lane in order) into this CTA's
  // subtree; the CTAs' roots to every CTA, whose top levels they all build and walk alike: the
  // chosen CTA walks its subtree, then the chosen lane.
  if (g == 0) {
    float acc = 0.0f;
    walk_blocks(s, kw, lw, l, S, cut.tp > candidate_floor ? cut.tp : candidate_floor, [&](int j, uint2 v) {
      const float w = u2f(v.y);
      acc = __fadd_rn(acc, cut.all(v.x, base + j * LANES, w) ? w : 0.0f);
    });
    s.tree[CL + l] = acc;
  }
  __syncthreads();
  for (int n = CL / 2; n >= 1; n /= 2) {
    if (tid < n) s.tree[n + tid] = __fadd_rn(s.tree[2 * (n + tid)], s.tree[2 * (n + tid) + 1]);
    __syncthreads();
  }
  if (tid == 0) s.slot[round % SLOTS][0] = f2u(s.tree[1]);
  cluster_arrive();
  cluster_wait();
  if (warp == 0) {
    if (lane < CTAS) s.top[CTAS + lane] = u2f(load_remote(&s.slot[round % SLOTS][0], uint32_t(lane)));
    __syncwarp();
    if (lane == 0) {
      for (int n = CTAS - 1; n >= 1; --n) s.top[n] = __fadd_rn(s.top[2 * n], s.top[2 * n + 1]);
      float t = draw_target(p.u, s.top[1]);
      s.result[1] = uint32_t(walk_tree(s.top, CTAS, t));
      s.result[0] = f2u(t);
    }
  }
  ++round;
  __syncthreads();
  cluster_arrive();  // this CTA's last read of another's shared memory is behind it
  const float total = s.top[1];
  write_kept([&](int j, int i) {
    const uint2 v = kw[j * CL + l];
    return cut.all(v.x, i, u2f(v.y));
  });
  if (tid == 0 && s.result[1] == c) {
    float t = u2f(s.result[0]);
    const int dl = walk_tree(s.tree, CL, t), first_id = int(c) * CL + dl;
    // Along the chosen lane: its kept weights in order until the sum passes t (eight strides'
    // loads ahead of the adds; the adds and tests in the one-CTA kernel's order).
    int token = -1;
    float token_w = 0.0f, acc = 0.0f;
    bool done = false;
    for (int j0 = 0; j0 < S && !done; j0 += 8) {
      uint2 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = j0 + u < S ? kw[(j0 + u) * CL + dl] : make_uint2(KEY_NEG_INF, 0u);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = first_id + (j0 + u) * LANES;
        const float w = u2f(v[u].y);
        if (done || !cut.all(v[u].x, i, w)) continue;
        acc = __fadd_rn(acc, w);
        if (w > 0.0f) token = i, token_w = w;
        if (acc > t) done = true;
      }
    }
    tokens[row] = token;
    if (weight) {
      weight[0] = token >= 0 ? token_w : 0.0f;
      weight[1] = token >= 0 ? total : 0.0f;
    }
  }
  cluster_wait();
#else
  __trap();  // launched only on compute capability 9.0 (sample_tokens)
#endif
}

// The calling thread's stream-capture mode relaxed for the scope's life: the set-up below (device
// and kernel attributes, the cluster occupancy query) may run first inside an engine's decode-graph
// capture, which must neither refuse nor record it.
struct RelaxedCapture {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;
};

// What the cluster kernel may take on the current device: the most strides a row may have (0 where
// it may not run: compute capability 9.0 and its sm_90a code in the binary, clusters of CTAS CTAs of
// that shared memory schedulable, SAMEBITS_SAMPLING_CLUSTER not "0" and the test hook not 1), and
// how many of its clusters the device holds at once (the occupancy query: an 8-CTA cluster sits in
// one GPC, so not simply SMs / 8 where GPCs differ in size).
struct ClusterRoom {
  int strides = 0, clusters = 0;
};
ClusterRoom cluster_room(const char* op) {
  if (detail::sampling_kernel_override() == 1) return {};
  static const bool env_on = env_switch("SAMEBITS_SAMPLING_CLUSTER");  // "0": the one-CTA kernel (A/B runs)
  if (!env_on) return {};
  static std::atomic<int> strides[64] = {}, active[64] = {};  // 1 + the value; 1: no cluster kernel
  int dev = 0;
  check(cudaGetDevice(&dev), op, "device");
  const int most = once_per_device(strides, op, [&] {
    const RelaxedCapture relaxed;
    int major = 0, minor = 0, optin = 0;
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), op, "compute capability");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), op, "compute capability");
    if (major != 9 || minor != 0) return 1;
    check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), op, "shared memory");
    cudaFuncAttributes fa{};
    check(cudaFuncGetAttributes(&fa, sample_rows_cluster), op, "kernel attributes");
    if (fa.binaryVersion < 90) return 1;  // its code from the sm_80 PTX: a trap, not the kernel
    const int most = std::min<int>(MAX_STRIDES, (optin - int(fa.sharedSizeBytes)) / int(CL * sizeof(uint2)));
    if (most < 1) return 1;
    const size_t smem = size_t(most) * CL * sizeof(uint2);
    check(cudaFuncSetAttribute(sample_rows_cluster, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), op,
          "shared memory");
    // One cluster's launch, as sample_tokens makes it (the cluster attribute alone: no stream).
    const AfterPrevious one(dim3(CTAS), dim3(CTHREADS), smem, nullptr, op, false, CTAS);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, sample_rows_cluster, &one.config) != cudaSuccess) {
      (void)cudaGetLastError();  // not an error of the caller's: the one-CTA kernel serves
      return 1;
    }
    if (dev >= 0 && dev < 64) active[dev].store(clusters, std::memory_order_release);
    return clusters >= 1 ? 1 + most : 1;
  }) - 1;
  return {most, most > 0 && dev >= 0 && dev < 64 ? active[dev].load(std::memory_order_acquire) : 0};
}

void sample_tokens(const Context& ctx, const SampleTokensArgs& a) {
  const int64_t R = a.logits.shape[0], V = a.logits.shape[1];
  if (R == 0) return;
  const cudaStream_t stream = stream_of(ctx.stream);
  const float* logits = a.logits.as<const float>();
  const double* params = a.params.as<const double>();
  int32_t* tokens = a.tokens.as<int32_t>();
  uint8_t* kept = a.kept.present() ? a.kept.as<uint8_t>() : nullptr;
  float* weights = a.weights.present() ? a.weights.as<float>() : nullptr;
  // Which kernel draws a row changes no bit (the two give the same bits, row by row:
  // tests/cuda/test_sampling.cpp), so, like the attention's O-column parts and the GEMM's tile widths,
  // the choice is a schedule: the cluster kernel where its clusters fit the GPU in one round (the
  // occupancy query's count, about SMs / 8), else the one-CTA kernel, which overlaps many rows
  // better. Measured on the H100
  // (bench_time_sampling, vocab 151,936, temperature 1): 1 / 8 rows 47.0 / 48.5 µs against 85.6 /
  // 89.0 µs; 64 rows (4 rounds of clusters) 198.6 against 97.8 µs.
  const int64_t S = (V + LANES - 1) / LANES;
  const ClusterRoom room = cluster_room("sample_tokens");
  const bool fits = R <= room.clusters || detail::sampling_kernel_override() == 2;
  if (S <= room.strides && fits && R <= INT32_MAX / CTAS) {
    launch_cluster_after_previous(sample_rows_cluster, CTAS, dim3(unsigned(R * CTAS)), dim3(CTHREADS),
                                  size_t(S) * CL * sizeof(uint2), stream, "sample_tokens", logits, params, int(V),
                                  int(S), tokens, kept, weights);
    return;
  }
  launch_after_previous(sample_rows, dim3(unsigned(R)), dim3(LANES), 0, stream, "sample_tokens", logits, params,
                        int(V), tokens, kept, weights);
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(sample_tokens, Backend::cuda, SampleTokensArgs, sample_tokens);

}  // namespace samebits::cuda
