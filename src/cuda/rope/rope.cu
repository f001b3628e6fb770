// CUDA RoPE (rotate-half: dims i and i + D/2 form a pair), forward and backward (the inverse
// rotation), one position per token (packed sequences restarting at 0, decode, chunked-prefill
// offsets: the caller's positions, whatever they are).
//
// Why this shape. The angles are computed on the fly, never read from a table (rope_math.cuh: the
// arithmetic, shared with the fused QK-norm + RoPE kernel): a position's cos / sin bits are a
// function of the position and the config alone, on every path and in every batch (a table would
// cost max_position · D/2 · 8 bytes, 512 MiB at 2^20 positions, for values that take ~100 fp64
// instructions a token to make). A CTA takes a few tokens at a time: its threads first make those
// tokens' cos / sin into shared memory (one pair a thread), then rotate 8-pair vectors of every
// head with them. The backward is the same with −sin.
#include <algorithm>

#include "cuda/common/runtime.cuh"
#include "cuda/common/vec8.cuh"
#include "cuda/rope/rope_math.cuh"
#include "ops/registry.hpp"
#include "samebits/error.hpp"
#include "samebits/ops.hpp"

namespace samebits::cuda {
namespace {

constexpr int THREADS = 256, MAX_HALF = 256, MAX_TOKENS_PER_STEP = 16;
using InvFreq = InvFreqTable<MAX_HALF>;

struct RopeParams {
  In8 x;
  Out8 y;
  const int32_t* positions;
  int64_t T, heads, D;
  int tokens_per_step;
  bool inverse;
};

__global__ void __launch_bounds__(THREADS) rope_kernel(const __grid_constant__ RopeParams p,
                                                       const __grid_constant__ InvFreq inv) {
  extern __shared__ float2 cs[];  // [tokens_per_step][half]: cos, ±sin
  const int64_t half = p.D / 2, vectors = (half + 7) / 8, items = p.heads * vectors;
  const int tps = p.tokens_per_step;
  for (int64_t t0 = int64_t(blockIdx.x) * tps; t0 < p.T; t0 += int64_t(gridDim.x) * tps) {
    rope_fill_cos_sin(cs, p.positions, t0, std::min<int64_t>(tps, p.T - t0), half, inv.f, p.inverse);
    __syncthreads();
    for (int64_t k = threadIdx.x; k < tps * items; k += THREADS) {
      const int64_t j = k / items, t = t0 + j, h = (k % items) / vectors, i0 = (k % vectors) * 8;
      if (t >= p.T) continue;
      const int n = int(std::min<int64_t>(8, half - i0));
      const int64_t base = (t * p.heads + h) * p.D + i0;
      const Raw8 raw1 = fetch8(p.x, base, n), raw2 = fetch8(p.x, base + half, n);  // both loads in flight
      float x1[8], x2[8], y1[8], y2[8];
      unpack8(p.x.dt, raw1, x1);
      unpack8(p.x.dt, raw2, x2);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float2 c = e < n ? cs[j * half + i0 + e] : make_float2(0.0f, 0.0f);
        y1[e] = rope_first(x1[e], x2[e], c);
        y2[e] = rope_second(x1[e], x2[e], c);
      }
      store8(p.y, base, n, y1);
      store8(p.y, base + half, n, y2);
    }
    __syncthreads();  // the next step rewrites cs
  }
}

void rope(const Context& ctx, const RopeArgs& a, bool inverse) {
  const char* op = inverse ? "rope_backward" : "rope_forward";
  const int64_t T = a.x.shape[0], heads = a.x.shape[1], D = a.x.shape[2], half = D / 2;
  if (half > MAX_HALF) throw Unsupported(op, "x", "the CUDA RoPE supports head_dim up to " + std::to_string(2 * MAX_HALF));
  if (T == 0 || heads == 0) return;
  const InvFreq inv = make_inv_freq<MAX_HALF>(a.config, D);
  const int64_t items = heads * ((half + 7) / 8);
  const int tps = int(std::clamp<int64_t>(THREADS / std::max<int64_t>(items, 1), 1, MAX_TOKENS_PER_STEP));
  // Vectors start at multiples of 8 pairs within a head's halves: 16-byte aligned where D/2 % 8 == 0.
  const RopeParams p{in8(a.x, half), out8(a.y, half), a.positions.as<const int32_t>(), T, heads, D, tps, inverse};
  const int64_t steps = (T + tps - 1) / tps;
  const unsigned grid = unsigned(std::min<int64_t>(steps, int64_t(current_sm_count(op)) * 8));
  rope_kernel<<<grid, THREADS, size_t(tps) * size_t(half) * sizeof(float2), stream_of(ctx.stream)>>>(p, inv);
  check(cudaGetLastError(), op, "kernel launch");
}

void rope_forward(const Context& ctx, const RopeArgs& a) { rope(ctx, a, false); }
void rope_backward(const Context& ctx, const RopeArgs& a) { rope(ctx, a, true); }

}  // namespace

SAMEBITS_REGISTER_KERNEL(rope_forward, Backend::cuda, RopeArgs, rope_forward);
SAMEBITS_REGISTER_KERNEL(rope_backward, Backend::cuda, RopeArgs, rope_backward);

}  // namespace samebits::cuda
