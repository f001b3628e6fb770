// CUDA sampling: the token of each logits row, drawn on the device (no logits copy to the host).
//
// Why this shape. The rule (src/ops/sampling_rule.hpp) fixes one summation order by the vocab size
// alone: 1024 lanes, lane ℓ adding the weights of ids ℓ, ℓ + 1024, … in turn, the lanes' sums meeting
// in a pairwise tree. So a row is one CTA of 1024 threads, thread ℓ being lane ℓ: its loads are
// coalesced (consecutive lanes read consecutive ids), the xor butterfly of a warp is the tree over
// its 32 lanes and warp 0's butterfly over the 32 warp sums finishes it. Nothing is sorted: a cut
// (top-k by count, top-p by mass) is the largest 32-bit logit key whose candidates' measure reaches
// the goal, found 3 bits a pass (each pass measures the 7 thresholds of the next digit at once,
// each lane keeping 7 sums in ascending id order, so every threshold's mass is the rule's sum).
// Weights are recomputed from the logits each pass (a polynomial exp, cheaper than storing them);
// the row stays in L2 between passes. A row's work never depends on its neighbours or the row count,
// and the kernel has no atomics. Cost: greedy and plain temperature sampling read the row three
// times; top-k adds 12 count passes, top-p 12 mass passes. Each pass issues a lane's loads eight at
// a time before using them (for_lane), the values still taken in the rule's order.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/pdl.cuh"
#include "cuda/common/runtime.cuh"
#include "ops/registry.hpp"
#include "ops/sampling_rule.hpp"
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

// Every thread gets the pairwise-tree sums over the block of its N values (thread order = lane
// order): the xor butterfly of each warp, then warp 0's over the warp sums (`scratch`: shared).
template <class T, int N>
__device__ __forceinline__ void block_sums(T (&v)[N], T (&scratch)[TRIES][WARPS]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int off = 1; off < 32; off *= 2) v[n] = exact_add(v[n], __shfl_xor_sync(FULL, v[n], off));
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
    int node = 1;
    while (node < LANES) {
      const float left = s.tree[2 * node], right = s.tree[2 * node + 1];
      if (t < left || !(right > 0.0f)) {
        node = 2 * node;
      } else {
        t = __fsub_rn(t, left);
        node = 2 * node + 1;
      }
    }
    s.draw_t = t;
    s.draw_lane = node - LANES;
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

void sample_tokens(const Context& ctx, const SampleTokensArgs& a) {
  const int64_t R = a.logits.shape[0], V = a.logits.shape[1];
  if (R == 0) return;
  launch_after_previous(sample_rows, dim3(unsigned(R)), dim3(LANES), 0, stream_of(ctx.stream), "sample_tokens",
                        a.logits.as<const float>(), a.params.as<const double>(), int(V), a.tokens.as<int32_t>(),
                        a.kept.present() ? a.kept.as<uint8_t>() : nullptr,
                        a.weights.present() ? a.weights.as<float>() : nullptr);
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(sample_tokens, Backend::cuda, SampleTokensArgs, sample_tokens);

}  // namespace samebits::cuda
