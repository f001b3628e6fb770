// The vocab reduction of the CUDA logprob family: one fixed topology, a function of the vocab size V
// only, shared by the standalone kernels (logprob.cu) and, later, the fused LM head's epilogue.
//
// A row's statistics are (m, s, a): the max logit, s = Σ e^(z−m), a = Σ e^(z−m)·(m−z), from which
// lse = m + log s and the entropy H = log s + a/s (a sum of non-negative terms). The topology:
//   group  64 consecutive columns [64g, 64g+64): m = their max (exact, order-free); e = e^(z−m) and
//          t = e·(m−z) per column; each block of 8 columns summed as the pairwise tree
//          ((0+1)+(2+3))+((4+5)+(6+7)), the 8 block sums by the same tree;
//   unit   4 groups (256 columns), range 8 units (2048 columns): balanced binary trees of merges;
//   row    ranges merged one after another in ascending order.
// Columns past V are −inf (they add exact zeros); a group with no finite logit and no NaN is empty and
// a merge with an empty side returns the other side unchanged. A group's max skips NaNs but starts
// from NaN, so a group of NaNs has a NaN max and makes its row NaN instead of looking empty. merge(x, y) is computed without fused
// multiply-adds, so merge(x, y) == merge(y, x) bit for bit: a butterfly of warp shuffles gives every
// lane the same bits as the tree.
// Why this shape: rescaling (an exp per merge) happens only between groups, so a thread that holds a
// whole group pays one exp per logit plus a few merges per 64; and a Hopper GEMM thread holding an
// m64nN accumulator owns two adjacent columns of every 8-column block (its quad the block, its
// registers all eight blocks of a group), so the same tree can run where the logits are made.
#pragma once
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

namespace samebits::cuda::vocab {

constexpr int BLOCK = 8, GROUP = 64, UNIT = 256, RANGE = 2048;

struct Stats {
  float m, s, a;
};

__device__ __forceinline__ Stats empty_stats() { return {-INFINITY, 0.0f, 0.0f}; }
__device__ __forceinline__ bool is_empty(const Stats& x) { return x.m == -INFINITY; }

// e^x in fp32: the special-function unit's exp2 of x·log2 e (relative error ~1e-6; deterministic),
// flushing results below 2^-126 (and subnormal inputs) to zero. The flush is one MUFU.EX2 after one
// multiply; __expf's subnormal handling costs a compare, two multiplies and a select more per
// element, which the fused LM head's epilogue (one exp per logit, run while the tensor cores wait)
// cannot afford. A flushed e^(z − m) is below 1e-38 of the row's largest term.
__device__ __forceinline__ float exp_f(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(__fmul_rn(x, 1.4426950408889634f)));
  return y;
}

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

// The terms of one 8-column block against the group max m: Σ e and Σ t by the pairwise tree.
__device__ __forceinline__ float sum_tree8(const float (&v)[8]) {
  return __fadd_rn(__fadd_rn(__fadd_rn(v[0], v[1]), __fadd_rn(v[2], v[3])),
                   __fadd_rn(__fadd_rn(v[4], v[5]), __fadd_rn(v[6], v[7])));
}
__device__ __forceinline__ void block_sums(const float (&z)[BLOCK], float m, float& s, float& a) {
  float e[BLOCK], t[BLOCK];
#pragma unroll
  for (int i = 0; i < BLOCK; ++i) {
    const float d = __fsub_rn(m, z[i]);  // ≥ 0; +inf for a −inf logit, whose e is 0 and t must be 0
    e[i] = exp_f(-d);                    // e^(z − m): z − m is −(m − z) exactly
    t[i] = __fmul_rn(e[i], fminf(d, FLT_MAX));
  }
  s = sum_tree8(e);
  a = sum_tree8(t);
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

__device__ __forceinline__ float lse_of(const Stats& x) { return x.m + logf(x.s); }
__device__ __forceinline__ float entropy_of(const Stats& x) { return logf(x.s) + x.a / x.s; }

// A token's outputs from its row statistics and its target's logit: lse for every row; masked
// tokens get logp = entropy = 0; an unmasked target outside [0, V) (reported before the launch,
// outside graph capture) is never read and gives NaN.
__device__ __forceinline__ void write_token(const Stats& st, bool active, bool target_in_range, float target_logit,
                                            int64_t t, float* logp, float* entropy, float* lse) {
  const float l = lse_of(st);
  float lp = 0.0f, h = 0.0f;
  if (active) {
    lp = target_in_range ? __fsub_rn(target_logit, l) : NAN;
    h = entropy_of(st);
  }
  logp[t] = lp;
  if (entropy) entropy[t] = h;
  if (lse) lse[t] = l;
}

__device__ __forceinline__ bool token_active(const int32_t* targets, const uint8_t* mask, int32_t ignore, int64_t t) {
  return (mask == nullptr || mask[t] != 0) && targets[t] != ignore;
}

}  // namespace samebits::cuda::vocab
