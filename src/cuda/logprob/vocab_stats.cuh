// The vocab reduction of the CUDA logprob family: one fixed topology, a function of the vocab size V
// only, shared by the standalone kernels (logprob.cu) and, later, the fused LM head's epilogue.
//
// A row's statistics are (m, s, a): the max logit, s = Σ e^(z−m), a = Σ e^(z−m)·(m−z), from which
// lse = m + log s and the entropy H = log s + a/s (a sum of non-negative terms). The topology:
//   leaf   8 consecutive columns [8c, 8c+8): m = their max, then e_i and a_i summed as the pairwise
//          tree ((0+1)+(2+3))+((4+5)+(6+7));
//   group  8 leaves (64 columns), unit 4 groups (256 columns), range 8 units (2048 columns): each a
//          balanced binary tree of merges (leaves 2k and 2k+1 first);
//   row    ranges merged one after another in ascending order.
// Columns past V are −inf (they add exact zeros); a leaf with no finite logit is empty and a merge
// with an empty side returns the other side unchanged. merge(x, y) is computed without fused
// multiply-adds, so merge(x, y) == merge(y, x) bit for bit: a butterfly of warp shuffles (xor 1,
// 2, 4 for a group, then 8, 16 for a unit) gives every lane the same bits as the tree.
// Why this shape: a thread that holds a whole group reduces it in registers (8 leaves, 7 merges) and
// only groups meet across lanes; a Hopper GEMM thread holding an m64nN accumulator owns two columns
// of every 8-column leaf (its quad the leaf, its registers whole groups), so the same tree can run
// where the logits are made.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace samebits::cuda::vocab {

constexpr int LEAF = 8, GROUP = 64, UNIT = 256, RANGE = 2048, UNITS_PER_RANGE = RANGE / UNIT;

struct Stats {
  float m, s, a;
};

__device__ __forceinline__ Stats empty_stats() { return {-INFINITY, 0.0f, 0.0f}; }
__device__ __forceinline__ bool is_empty(const Stats& x) { return x.m == -INFINITY; }

// e^x in fp32 (the special-function unit's exp2 of x·log2 e: relative error ~1e-6 over the range
// that matters; deterministic).
__device__ __forceinline__ float exp_f(float x) { return __expf(x); }

// Symmetric merge: the side with the larger max keeps its terms unscaled (e^0 = 1 is exact), the
// other is scaled by e^(m_small − m_big), one exp per merge. Separate roundings throughout
// (__fmul_rn / __fadd_rn are never contracted into FMAs), so merge(x, y) == merge(y, x) bit for bit.
__device__ __forceinline__ Stats merge(const Stats& x, const Stats& y) {
  if (is_empty(y)) return x;
  if (is_empty(x)) return y;
  const bool x_big = x.m >= y.m;  // selects on values: references would put x and y in local memory
  const float big_m = x_big ? x.m : y.m, big_s = x_big ? x.s : y.s, big_a = x_big ? x.a : y.a;
  const float small_m = x_big ? y.m : x.m, small_s = x_big ? y.s : x.s, small_a = x_big ? y.a : x.a;
  const float e = exp_f(__fsub_rn(small_m, big_m));
  const float s = __fadd_rn(big_s, __fmul_rn(small_s, e));
  // small's a measured from the new max: a + (m_big − m_small)·s, then scaled.
  const float a = __fadd_rn(big_a, __fmul_rn(e, __fadd_rn(small_a, __fmul_rn(__fsub_rn(big_m, small_m), small_s))));
  return {big_m, s, a};
}

// One leaf: z[0..8) (columns past V already −inf).
__device__ __forceinline__ Stats leaf(const float (&z)[LEAF]) {
  float m = z[0];
#pragma unroll
  for (int i = 1; i < LEAF; ++i) m = fmaxf(m, z[i]);
  if (m == -INFINITY) return empty_stats();
  float e[LEAF], t[LEAF];
#pragma unroll
  for (int i = 0; i < LEAF; ++i) {
    e[i] = exp_f(__fsub_rn(z[i], m));
    t[i] = z[i] == -INFINITY ? 0.0f : __fmul_rn(e[i], __fsub_rn(m, z[i]));
  }
  const float s = __fadd_rn(__fadd_rn(__fadd_rn(e[0], e[1]), __fadd_rn(e[2], e[3])),
                            __fadd_rn(__fadd_rn(e[4], e[5]), __fadd_rn(e[6], e[7])));
  const float a = __fadd_rn(__fadd_rn(__fadd_rn(t[0], t[1]), __fadd_rn(t[2], t[3])),
                            __fadd_rn(__fadd_rn(t[4], t[5]), __fadd_rn(t[6], t[7])));
  return {m, s, a};
}

// Butterfly merge across lanes, one tree level per xor mask: with a group in each lane, masks 1 and 2
// give every lane its unit and 4, 8, 16 its range (merge is symmetric, so both lanes of a pair get
// the same bits).
__device__ __forceinline__ Stats merge_lanes(Stats x, int first_mask, int last_mask) {
#pragma unroll
  for (int mask = first_mask; mask <= last_mask; mask <<= 1) {
    const Stats y{__shfl_xor_sync(0xffffffffu, x.m, mask), __shfl_xor_sync(0xffffffffu, x.s, mask),
                  __shfl_xor_sync(0xffffffffu, x.a, mask)};
    x = merge(x, y);
  }
  return x;
}

// Eight siblings (leaves of a group, units of a range) by the balanced tree.
__device__ __forceinline__ Stats merge_tree8(const Stats (&u)[8]) {
  return merge(merge(merge(u[0], u[1]), merge(u[2], u[3])), merge(merge(u[4], u[5]), merge(u[6], u[7])));
}

__device__ __forceinline__ float lse_of(const Stats& x) { return x.m + logf(x.s); }
__device__ __forceinline__ float entropy_of(const Stats& x) { return logf(x.s) + x.a / x.s; }

}  // namespace samebits::cuda::vocab
