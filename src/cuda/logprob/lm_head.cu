// CUDA fused LM head -> selected logprob, forward and backward, without a [tokens x vocab] buffer.
//
// Why this shape. The LM head is the largest GEMM of the model and its logits the largest tensor;
// the logprob only needs a row's (max, Σe, Σe·(m−z)) and one logit. So the forward is the Hopper
// GEMM kernel itself (sm90_gemm_kernel.cuh, the same mainloop, so every logit is bitwise the fp32
// value linear_forward stores) with a different epilogue: a 256-column tile of a row is exactly one
// vocab unit of vocab_stats.cuh, so the thread quads that hold a row's 8-column blocks build its four
// 64-column groups and the unit by the very tree the standalone kernel uses, and write one unit
// statistic per (row, tile) plus the target's logit (by the one thread that holds it). A small
// kernel then merges each row's units into 2048-column ranges and chains the ranges in ascending
// order. Result: bitwise equal to linear_forward (fp32 y) + logprob_forward, with O(tokens·V/256)
// extra memory (12 bytes a unit) instead of the logits.
//
// The backward walks the vocab in chunks (a width that never changes the bits: the chunk is a
// multiple of 256 columns and both reductions chain exactly across it). For each chunk: the same
// GEMM recomputes the chunk's logits and its epilogue writes dlogits = g·(onehot − p) (+ the entropy
// term) in the weight's dtype; dhidden += dlogits_c · W_c continues an fp32 accumulator across
// chunks (the dX kernel starts its registers from it, so the chunked K loop is the unchunked one);
// dW_c += dlogits_cᵀ · hidden is the micro-batch-invariant weight-gradient kernel on the chunk's
// rows of dW. No atomics anywhere; extra memory is one dlogits chunk (≤ 256 MiB) and, when dhidden
// is 16-bit, an fp32 [tokens x hidden] accumulator.
//
// Other GPUs (no sm_90a), K or V not a multiple of 8, and fp32 inputs: the same ops composed over
// chunks of tokens (linear_forward to fp32 logits, logprob_forward / logprob_backward, the linear
// backward kernels), which is by construction the standalone chain's bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <vector>

#include "cuda/common/convert.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "cuda/common/segments.hpp"
#include "cuda/linear/gemm.cuh"
#include "cuda/linear/sm90_gemm_kernel.cuh"
#include "cuda/linear/sm90_store_epilogue.cuh"
#include "cuda/logprob/targets.cuh"
#include "cuda/logprob/vocab_stats.cuh"
#include "ops/registry.hpp"
#include "ops/tuning.hpp"
#include "samebits/ops.hpp"
#include "samebits/validate.hpp"

namespace samebits::cuda {
namespace {

using namespace vocab;

constexpr unsigned FULL = 0xffffffffu;

// The sums over a thread quad (lanes 4i … 4i+3 of a warp) of G groups' eight 8-column blocks, by
// vocab_stats.cuh's tree: quad lane q holds pair[g][k] = the sum of columns 2q, 2q+1 of block k of
// group g. A block is ((p0+p1)+(p2+p3)) over the lanes' pairs, a group ((b0+b1)+(b2+b3))+((b4+b5)+
// (b6+b7)). Each shuffle level hands half of a lane's blocks to its partner (a reduce-scatter), so
// eight shuffles do what sixteen would; fp32 addition is commutative, so both lanes of a pair get
// the same bits. The G groups go level by level together (independent chains).
template <int G>
__device__ __forceinline__ void quad_group_sums(const float (&pair)[G][8], int q, float (&out)[G]) {
  const bool odd = q & 1, upper = q & 2;
  float half[G][4];  // (p0+p1) or (p2+p3) of blocks 0-3 (even lanes) or 4-7 (odd lanes)
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float send = odd ? pair[g][i] : pair[g][i + 4], keep = odd ? pair[g][i + 4] : pair[g][i];
      half[g][i] = __fadd_rn(keep, __shfl_xor_sync(FULL, send, 1));
    }
  float two[G];  // (b0+b1), (b2+b3), (b4+b5) or (b6+b7): whole blocks 4·odd + 2·upper + {0, 1}
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float block[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float send = upper ? half[g][i] : half[g][i + 2], keep = upper ? half[g][i + 2] : half[g][i];
      block[i] = __fadd_rn(keep, __shfl_xor_sync(FULL, send, 2));
    }
    two[g] = __fadd_rn(block[0], block[1]);
  }
#pragma unroll
  for (int g = 0; g < G; ++g) two[g] = __fadd_rn(two[g], __shfl_xor_sync(FULL, two[g], 2));  // blocks 0-3 / 4-7
#pragma unroll
  for (int g = 0; g < G; ++g) out[g] = __fadd_rn(two[g], __shfl_xor_sync(FULL, two[g], 1));
}

}  // namespace

// Named (not anonymous): the epilogue is used only by the device kernel, which the host pass does not
// compile, and an unused function of internal linkage is a warning there.
namespace lm_head {
// The forward's epilogue: one vocab unit statistic per row of the 256-column tile, and the target
// logit. Logits past V count as −inf, as in the standalone kernel.
struct VocabStatsParams {
  const int32_t* targets;
  Stats* units;          // [units][M]: unit u of row r at u·M + r
  float* target_logit;   // [M]
};
// Σe·(m−z) is summed whether or not the entropy is asked for (m and Σe, hence lse and logp, never
// depend on it): a variant without it measured 2% slower on an H100, not faster (its exps and shuffles
// bunch together; bench/power_lm_head.py, two rounds, and bench/bench_lm_head.py, two runs).
struct VocabStatsEpilogue {
  using Params = VocabStatsParams;
  struct State {};
  // The targets of the thread's two rows are asked into L1 now, while the tile's MMAs run (holding
  // them in registers across the K loop would spill it).
  template <int BN>
  __device__ __forceinline__ static void begin_tile(const Params& p, float (&d)[BN / 2], int64_t row_base, int64_t,
                                                    int64_t M, int64_t, int t, State&) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row_base + (t / 32) * 16 + (t % 32) / 4 + h * 8;
      if (row < M) asm volatile("prefetch.global.L1 [%0];" ::"l"(p.targets + row));
    }
  }
  // The epilogue runs while the tensor cores wait, so it is written for few instructions per logit
  // (an exp, a max, two adds, and two more for the entropy): columns past V are set to −inf in the
  // accumulators once, on the vocab's last tile only, and the target's logit is picked out by a
  // tree of 63 selects, instead of a compare and a select per logit for each.
  // Then one row of the tile at a time, two groups side by side at every step (independent chains
  // of shuffles and exps: the epilogue is latency-bound; four side by side spill registers).
  template <int BN, int BOXES>
  __device__ __forceinline__ static void end_tile(const Params& p, float (&d)[BN / 2], uint8_t*, int64_t row_base,
                                                  int64_t n0, int64_t M, int64_t N, int t, int, State&) {
    static_assert(BN == UNIT && UNIT / GROUP == 4, "a tile row is one vocab unit of four groups");
    constexpr int G = 2;
    const int warp = t / 32, lane = t % 32, q = lane % 4;
    // d[j*4 + h*2 + e]: row h, tile column 8j + 2q + e.
    if (N - n0 < UNIT) {  // uniform: the vocab's last tile
      const int valid = int(N - n0);
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (8 * j + 2 * q + e >= valid) d[j * 4 + e] = d[j * 4 + 2 + e] = -INFINITY;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row_base + warp * 16 + lane / 4 + h * 8;
      const int64_t target = row < M ? p.targets[row] : -1;
      // The target's column within the tile, if this thread holds it (the lane of its column pair).
      const int col = target >= n0 && target < n0 + UNIT ? int(target - n0) : -1;
      if constexpr (BN == UNIT) {  // a tree of selects on the bits of the column (reading accumulators
        // in a branch would serialise the wgmmas): the pair's element, then halving the 32 pairs.
        const int c = col < 0 ? 0 : col;
        float z[BN / 8];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) z[j] = c & 1 ? d[j * 4 + h * 2 + 1] : d[j * 4 + h * 2];
#pragma unroll
        for (int j = 0; j < 16; ++j) z[j] = c & 128 ? z[j + 16] : z[j];  // pairs j, j + w: column bit 8w
#pragma unroll
        for (int j = 0; j < 8; ++j) z[j] = c & 64 ? z[j + 8] : z[j];
#pragma unroll
        for (int j = 0; j < 4; ++j) z[j] = c & 32 ? z[j + 4] : z[j];
        z[0] = c & 16 ? z[2] : z[0];
        z[1] = c & 16 ? z[3] : z[1];
        z[0] = c & 8 ? z[1] : z[0];
        if (col >= 0 && (col % 8) / 2 == q) p.target_logit[row] = z[0];
      }
      Stats pair_of_groups[2];  // merge(g0, g1), merge(g2, g3)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        auto z = [&](int k, int b, int e) -> float { return d[(8 * (2 * half + k) + b) * 4 + h * 2 + e]; };
        float m[G];
#pragma unroll
        for (int k = 0; k < G; ++k) {  // max is exact: a tree of depth 4 instead of a chain of 16
          float v[8];
#pragma unroll
          for (int b = 0; b < 8; ++b) v[b] = fmaxf(z(k, b, 0), z(k, b, 1));
#pragma unroll
          for (int w = 4; w >= 1; w /= 2)
#pragma unroll
            for (int b = 0; b < w; ++b) v[b] = fmaxf(v[b], v[b + w]);
          m[k] = v[0];
        }
#pragma unroll
        for (int mask = 1; mask <= 2; mask <<= 1)
#pragma unroll
          for (int k = 0; k < G; ++k) m[k] = fmaxf(m[k], __shfl_xor_sync(FULL, m[k], mask));
        float s_pair[G][8], a_pair[G][8];
#pragma unroll
        for (int k = 0; k < G; ++k)
#pragma unroll
          for (int b = 0; b < 8; ++b) {
            float e2[2], t2[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {  // as block_sums: d = m − z ≥ 0, e = e^(−d), t = e·min(d, FLT_MAX)
              const float dist = __fsub_rn(m[k], z(k, b, e));
              e2[e] = exp_f(-dist);
              t2[e] = __fmul_rn(e2[e], fminf(dist, FLT_MAX));
            }
            s_pair[k][b] = __fadd_rn(e2[0], e2[1]);
            a_pair[k][b] = __fadd_rn(t2[0], t2[1]);
          }
        float s[G], a[G];
        quad_group_sums<G>(s_pair, q, s);
        quad_group_sums<G>(a_pair, q, a);
        Stats g[G];
#pragma unroll
        for (int k = 0; k < G; ++k) g[k] = m[k] == -INFINITY ? empty_stats() : Stats{m[k], s[k], a[k]};
        pair_of_groups[half] = merge(g[0], g[1]);
      }
      const Stats unit = merge(pair_of_groups[0], pair_of_groups[1]);
      if (q == 0 && row < M) p.units[(n0 / UNIT) * M + row] = unit;
    }
  }
  __device__ __forceinline__ static void finish(const Params&, int, State&) {}
};
}  // namespace lm_head

namespace {

using lm_head::VocabStatsEpilogue;
using lm_head::VocabStatsParams;

// A row's units into ranges of eight (balanced tree), ranges chained in ascending order: the
// standalone kernel's lane butterfly and chain, one thread per row.
__global__ void combine_units(const Stats* units, const float* target_logit, int64_t M, int64_t V, int n_units,
                              const int32_t* targets, const uint8_t* mask, int32_t ignore, float* logp,
                              float* entropy, float* lse) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= M) return;
  auto unit = [&](int u) { return u < n_units ? units[int64_t(u) * M + row] : empty_stats(); };
  Stats acc = empty_stats();
  for (int u = 0; u < n_units; u += RANGE / UNIT) {
    const Stats lo = merge(merge(unit(u), unit(u + 1)), merge(unit(u + 2), unit(u + 3)));
    const Stats hi = merge(merge(unit(u + 4), unit(u + 5)), merge(unit(u + 6), unit(u + 7)));
    acc = merge(acc, merge(lo, hi));  // merge(empty, r) is r: the chain starts at range 0
  }
  const int32_t target = targets[row];
  const bool active = token_active(targets, mask, ignore, row), in_range = target >= 0 && target < V;
  write_token(acc, active, in_range, active && in_range ? target_logit[row] : 0.0f, row, logp, entropy, lse);
}

// active[t] = 1 for a token whose logprob counts (loss_mask 1 and target != ignore_index), 2 where
// its target is outside [0, V) — a bad id a deferred check reports later (Context::id_check): its
// dlogits row is NaN, so nothing computed from it passes for a gradient meanwhile.
constexpr uint8_t ACTIVE = 1, ACTIVE_BAD_TARGET = 2;
__global__ void active_tokens(const int32_t* targets, const uint8_t* mask, int32_t ignore, int64_t M, int64_t V,
                              uint8_t* active) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < M)
    active[t] = !token_active(targets, mask, ignore, t) ? 0
                : targets[t] >= 0 && targets[t] < V ? ACTIVE
                                                     : ACTIVE_BAD_TARGET;
}

// The rows the weight gradient must zero in shared memory (mask 0): inactive tokens whose hidden row
// holds a NaN or Inf, which a zero dlogit would turn into a NaN product. Every other inactive row
// has exactly zero dlogits and passes unzeroed (its products are zeros), which keeps the weight
// gradient off its slower zeroing path; the choice is a property of the token's own values.
template <class T>
__global__ void rows_to_keep(const T* hidden, int64_t M, int64_t K, const uint8_t* active, uint8_t* keep) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x % 32);
  if (row >= M) return;
  bool finite = true;
  if (!active[row])
    for (int64_t k = lane; k < K; k += 32) finite = finite && isfinite(float(hidden[row * K + k]));
  finite = __all_sync(FULL, finite);
  if (lane == 0) keep[row] = finite ? 1 : 0;
}

// The backward's epilogue: the chunk's dlogits in the weight's dtype, then the plain store path.
// dlogits[t, j] = g·(onehot_j − p_j) + ge·(−p_j·(log p_j + H)), p_j = e^(z_j − lse), as the
// standalone backward computes it; inactive rows are zeros. ENTROPY: an entropy gradient is given.
struct DlogitsParamsBase {
  const int32_t* targets;
  const uint8_t* active;
  const float *lse, *dlogp, *dentropy, *entropy;  // dentropy, entropy: ENTROPY only
  int64_t col0;                                    // the chunk's first vocab column
};
template <class T>
struct DlogitsParams : DlogitsParamsBase {
  typename sm90gemm::StoreEpilogue<T, T, false>::Params store;  // the dlogits chunk [M, chunk width]
};
DlogitsParamsBase dlogits_params(const LmHeadLogprobBackwardArgs& a, const uint8_t* active, const float* lse,
                                 const float* entropy, int64_t col0) {
  DlogitsParamsBase p;
  p.targets = a.targets.as<const int32_t>();
  p.active = active;
  p.lse = lse;
  p.dlogp = a.dlogp.as<const float>();
  p.dentropy = a.dentropy.present() ? a.dentropy.as<const float>() : nullptr;
  p.entropy = entropy;
  p.col0 = col0;
  return p;
}
// One row's terms of dlogits, loaded once per row (a tile's, or the kept-logits kernel's).
struct DlogitsRow {
  bool active;
  int64_t target_col;  // the target's column in the caller's column numbering, −1 if not among them
  float l, g, ge, H;
};
template <bool ENTROPY>
__device__ __forceinline__ DlogitsRow dlogits_row(const DlogitsParamsBase& p, int64_t row, int64_t M, int64_t col0,
                                                  int64_t width) {
  DlogitsRow r;
  r.active = row < M && p.active[row] != 0;
  const int64_t target = r.active ? p.targets[row] : -1;
  r.target_col = target >= col0 && target < col0 + width ? target - col0 : -1;
  r.l = r.active ? p.lse[row] : 0.0f;
  r.g = !r.active ? 0.0f : p.active[row] == ACTIVE_BAD_TARGET ? __int_as_float(0x7fffffff) : p.dlogp[row];
  r.ge = ENTROPY && r.active ? p.dentropy[row] : 0.0f;
  r.H = r.ge != 0.0f ? p.entropy[row] : 0.0f;
  return r;
}
// A logit's dlogit (fp32, before the one rounding to the weight's dtype).
template <bool ENTROPY>
__device__ __forceinline__ float dlogit(const DlogitsRow& r, float z, int64_t col) {
  const float lp = __fsub_rn(z, r.l), pr = exp_f(lp);
  float out = __fmul_rn(-r.g, pr);
  const float with_g = __fadd_rn(out, r.g);
  out = col == r.target_col ? with_g : out;
  if constexpr (ENTROPY) {  // a select, not a branch
    const float with_h = __fadd_rn(out, __fmul_rn(r.ge, __fmul_rn(-pr, __fadd_rn(lp, r.H))));
    out = r.ge != 0.0f ? with_h : out;
  }
  return r.active ? out : 0.0f;
}

template <class T, bool ENTROPY>
struct DlogitsEpilogue {
  using Store = sm90gemm::StoreEpilogue<T, T, false>;
  using Params = DlogitsParams<T>;
  using State = typename Store::State;
  template <int BN>
  __device__ __forceinline__ static void begin_tile(const Params&, float (&d)[BN / 2], int64_t, int64_t, int64_t,
                                                    int64_t, int, State&) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.0f;
  }
  // The value of an accumulator is computed as it is stored, so the accumulators are consumed in
  // place (no second array of 128 values).
  struct Value {
    DlogitsRow row[2];
    __device__ __forceinline__ float operator()(float z, int h, int col) const {
      return dlogit<ENTROPY>(row[h], z, col);
    }
  };
  template <int BN, int BOXES>
  __device__ __forceinline__ static void end_tile(const Params& p, float (&d)[BN / 2], uint8_t* staging,
                                                  int64_t row_base, int64_t n0, int64_t M, int64_t N, int t, int c,
                                                  State& s) {
    const int warp = t / 32, lane = t % 32;
    Value value;
#pragma unroll
    for (int h = 0; h < 2; ++h)  // the tile's columns: the target's column within the tile
      value.row[h] = dlogits_row<ENTROPY>(p, row_base + warp * 16 + lane / 4 + h * 8, M, p.col0 + n0, BN);
    Store::template store<BN, BOXES>(p.store, d, value, staging, row_base, n0, M, N, t, c, s);
  }
  __device__ __forceinline__ static void finish(const Params& p, int t, State& s) { Store::finish(p.store, t, s); }
};

// dlogits of rows whose fp32 logits the forward kept (logits_kept): the epilogue's arithmetic on
// the same fp32 logit, rounded once to the weight's dtype, so the bits are the recomputing
// backward's. One block walks one row's columns eight at a time (two 16-byte loads, one 16-byte
// store: V is a multiple of 8 and both buffers 16-byte aligned on the fused path); rows stride
// over the grid. Memory-bound: 6 bytes a logit.
template <class T, bool ENTROPY>
__global__ void dlogits_from_kept(const float* logits, const DlogitsParamsBase p, int64_t M, int64_t V, T* dlogits) {
  static_assert(sizeof(T) == 2, "16-bit dlogits: eight make one 16-byte store");
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const DlogitsRow r = dlogits_row<ENTROPY>(p, row, M, 0, V);
    const float4* z = reinterpret_cast<const float4*>(logits + row * V);
    uint4* out = reinterpret_cast<uint4*>(dlogits + row * V);
    for (int64_t c8 = threadIdx.x; c8 < V / 8; c8 += blockDim.x) {
      const float4 lo = z[2 * c8], hi = z[2 * c8 + 1];
      const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      union {
        T t[8];
        uint4 u;
      } o;
#pragma unroll
      for (int j = 0; j < 8; ++j) o.t[j] = sm90gemm::convert<T>(dlogit<ENTROPY>(r, v[j], c8 * 8 + j));
      out[c8] = o.u;
    }
  }
}

// ---------------------------------------------------------------- host side

// The GEMM over the whole (or a chunk of the) vocab with epilogue Epi: 256-column tiles always (one
// vocab unit), 64-row compact tiles for M <= 64 (the plain GEMM's choice; rows get the same bits).
template <class T, class Epi>
void launch_vocab_gemm(const T* hidden, const T* weight, const typename Epi::Params& p, int64_t M, int64_t N, int64_t K,
                       cudaStream_t stream, const char* op) {
  if (M <= 64) sm90gemm::launch<T, false, UNIT, true, Epi>(hidden, weight, p, M, N, K, stream, op);
  else sm90gemm::launch<T, false, UNIT, false, Epi>(hidden, weight, p, M, N, K, stream, op);
}

bool fused_path(const TensorView& hidden, const TensorView& weight, bool backward) {
  const int64_t K = hidden.shape[1], V = weight.shape[0];
  return sm90_path_available() && hidden.dtype != DType::f32 && K % 8 == 0 && (!backward || V % 8 == 0) &&
         reinterpret_cast<uintptr_t>(hidden.data) % 16 == 0 && reinterpret_cast<uintptr_t>(weight.data) % 16 == 0;
}

TensorView rows_or_none(const TensorView& t, int64_t begin, int64_t end) {
  return t.present() ? t.rows(begin, end) : TensorView{};
}

// Tokens a composed (fallback) step takes: its fp32 logits stay within 256 MiB.
int64_t composed_rows(int64_t T, int64_t V) { return std::max<int64_t>(1, std::min<int64_t>(T, (int64_t(1) << 28) / (V * 4))); }

// Rows [r0, r0 + n) of the forward by the composed route: linear_forward into the fp32 logits z
// [n, V], then logprob_forward over them (the fused path's bits). Outputs: logp / entropy / lse of
// all rows (entropy, lse may be null).
void logits_then_logprob(const Context& ctx, const LmHeadLogprobForwardArgs& a, int64_t r0, int64_t n,
                         const TensorView& z, float* logp, float* entropy, float* lse) {
  auto out = [&](float* p) { return p ? TensorView::of(p + r0, DType::f32, {n}, Device::cuda) : TensorView{}; };
  linear_forward(ctx, {a.hidden.rows(r0, r0 + n), a.weight, {}, z});
  LogprobForwardArgs f;
  f.logits = z;
  f.targets = a.targets.rows(r0, r0 + n);
  f.loss_mask = rows_or_none(a.loss_mask, r0, r0 + n);
  f.logp = out(logp);
  f.entropy = out(entropy);
  f.lse = out(lse);
  f.ignore_index = a.ignore_index;
  f.targets_checked = true;  // the LM head's own call checked them (or the caller vouched)
  logprob_forward(ctx, f);
}

// Statistics and outputs of the forward (lse, entropy may be null).
void forward_into(const Context& ctx, const LmHeadLogprobForwardArgs& a, float* logp, float* entropy, float* lse) {
  const char* op = "lm_head_logprob_forward";
  const int64_t T = a.hidden.shape[0], K = a.hidden.shape[1], V = a.weight.shape[0];
  const cudaStream_t stream = stream_of(ctx.stream);
  const uint8_t* mask = a.loss_mask.present() ? a.loss_mask.as<const uint8_t>() : nullptr;
  if (fused_path(a.hidden, a.weight, false)) {
    with_16bit_storage(a.hidden.dtype, [&](auto tag) {
      using T_ = decltype(tag);
      const int n_units = int((V + UNIT - 1) / UNIT);
      ScratchBuffer units(size_t(n_units) * size_t(T) * sizeof(Stats), stream, op);
      ScratchBuffer target_logit(size_t(T) * sizeof(float), stream, op);
      const VocabStatsParams p{a.targets.as<const int32_t>(), units.as<Stats>(), target_logit.as<float>()};
      launch_vocab_gemm<T_, VocabStatsEpilogue>(a.hidden.as<const T_>(), a.weight.as<const T_>(), p, T, V, K, stream, op);
      combine_units<<<unsigned((T + 127) / 128), 128, 0, stream>>>(units.as<const Stats>(), target_logit.as<const float>(),
                                                                   T, V, n_units, a.targets.as<const int32_t>(), mask,
                                                                   a.ignore_index, logp, entropy, lse);
      check(cudaGetLastError(), op, "combine launch");
    });
    return;
  }
  // Composed: linear_forward to fp32 logits, then logprob_forward, a few tokens at a time.
  const int64_t rows = composed_rows(T, V);
  ScratchBuffer logits(size_t(rows) * size_t(V) * sizeof(float), stream, op);
  for (int64_t r0 = 0; r0 < T; r0 += rows) {
    const int64_t n = std::min(rows, T - r0);
    logits_then_logprob(ctx, a, r0, n, TensorView::of(logits.as<float>(), DType::f32, {n, V}, Device::cuda), logp,
                        entropy, lse);
  }
}

void require_16bit(const char* op, const TensorView& hidden) {
  if (hidden.dtype == DType::f32)
    throw Unsupported(op, "hidden", "the CUDA LM head takes bf16 or fp16 hidden states and weight");
}

// Whether the fused path takes logits_kept for these (validated) tensors.
bool takes_kept_logits(const TensorView& hidden, const TensorView& weight) {
  return weight.shape[0] > 0 && fused_path(hidden, weight, true);
}

// The rows whose logits the fused path keeps (LmHeadLogprobForwardArgs::logits_kept): the same
// answer in the forward and the backward, which look at the same tensors.
int64_t kept_rows(const TensorView& hidden, const TensorView& weight, const TensorView& kept) {
  return kept.present() && reinterpret_cast<uintptr_t>(kept.data) % 16 == 0 && takes_kept_logits(hidden, weight)
             ? kept.shape[0]
             : 0;
}

void lm_head_logprob_forward(const Context& ctx, const LmHeadLogprobForwardArgs& a) {
  const cudaStream_t stream = stream_of(ctx.stream);
  const int64_t T = a.hidden.shape[0], C = kept_rows(a.hidden, a.weight, a.logits_kept);
  require_16bit("lm_head_logprob_forward", a.hidden);
  check_targets_of(ctx, "lm_head_logprob_forward", "hidden", T, a.weight.shape[0], a, stream);
  float* logp = a.logp.as<float>();
  float* entropy = a.entropy.present() ? a.entropy.as<float>() : nullptr;
  float* lse = a.lse.present() ? a.lse.as<float>() : nullptr;
  if (C > 0) logits_then_logprob(ctx, a, 0, C, a.logits_kept, logp, entropy, lse);  // kept rows: the logits stored
  if (C == T) return;
  LmHeadLogprobForwardArgs rest = a;
  rest.hidden = a.hidden.rows(C, T);
  rest.targets = a.targets.rows(C, T);
  rest.loss_mask = rows_or_none(a.loss_mask, C, T);
  forward_into(ctx, rest, logp + C, entropy ? entropy + C : nullptr, lse ? lse + C : nullptr);
}

// The vocab chunk of the fused backward: as wide as keeps its dlogits within 256 MiB, a multiple of
// 256 columns, at least 2048. Any width gives the same bits (tests force several).
int64_t vocab_chunk(int64_t T, int64_t V, size_t elem) {
  if (const int forced = detail::lm_head_vocab_chunk_override()) return forced;
  const int64_t fit = (int64_t(1) << 28) / (T * int64_t(elem)) / UNIT * UNIT;
  return std::min((V + UNIT - 1) / UNIT * UNIT, std::max<int64_t>(2048, fit));
}

// The rows as consecutive segments covering [0, T): the caller's segments, and each gap between
// them (or before, or after) as a segment of its own, so the weight gradient's token groups start
// at every sequence and no row is left out (every active token counts, as on the CPU).
std::vector<int32_t> covering_segments(const TensorView& segments, int64_t T) {
  std::vector<int32_t> out;
  for_each_piece(segments, T, [&](int64_t row, int64_t len, bool) {
    out.push_back(int32_t(row));
    out.push_back(int32_t(len));
  });
  return out;
}

void mark_active(const LmHeadLogprobBackwardArgs& a, uint8_t* active, cudaStream_t stream) {
  const int64_t T = a.hidden.shape[0];
  active_tokens<<<unsigned((T + 255) / 256), 256, 0, stream>>>(
      a.targets.as<const int32_t>(), a.loss_mask.present() ? a.loss_mask.as<const uint8_t>() : nullptr,
      a.ignore_index, T, a.weight.shape[0], active);
  check(cudaGetLastError(), "lm_head_logprob_backward", "mask launch");
}

// The backward's per-row masks: active (the token is scored) and keep (what the weight gradient
// zeroes: rows_to_keep).
template <class T>
void row_masks(const LmHeadLogprobBackwardArgs& a, uint8_t* active, uint8_t* keep, cudaStream_t stream) {
  const int64_t M = a.hidden.shape[0], K = a.hidden.shape[1];
  mark_active(a, active, stream);
  rows_to_keep<T><<<unsigned((M + 7) / 8), 256, 0, stream>>>(a.hidden.as<const T>(), M, K, active, keep);
  check(cudaGetLastError(), "lm_head_logprob_backward", "keep launch");
}

// The row-wise inputs of one part of the backward (rows [C, T) or [0, C)): its statistics and its
// rows' masks (row_masks, made once for all rows: each row's bytes are its own).
struct BackwardRows {
  const float *lse, *entropy;  // entropy may be null
  const uint8_t *active, *keep;
  BackwardRows from(int64_t row) const { return {lse + row, entropy ? entropy + row : nullptr, active + row, keep + row}; }
};

template <class T>
void fused_backward(const LmHeadLogprobBackwardArgs& a, const BackwardRows& r, const std::vector<int32_t>& segs,
                    cudaStream_t stream) {
  const char* op = "lm_head_logprob_backward";
  const int64_t M = a.hidden.shape[0], K = a.hidden.shape[1], V = a.weight.shape[0];
  const T* hidden = a.hidden.as<const T>();
  const T* weight = a.weight.as<const T>();
  const int64_t chunk = vocab_chunk(M, V, sizeof(T)), chunks = (V + chunk - 1) / chunk;
  ScratchBuffer dlogits(size_t(M) * size_t(std::min(chunk, V)) * sizeof(T), stream, op);
  // dhidden's fp32 accumulator across chunks: dhidden itself when it is fp32.
  const bool direct = chunks == 1 || a.dhidden.dtype == DType::f32;
  ScratchBuffer acc_buf(direct ? 0 : size_t(M) * size_t(K) * sizeof(float), stream, op);
  float* acc = a.dhidden.dtype == DType::f32 ? a.dhidden.as<float>() : acc_buf.as<float>();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t col0 = c * chunk, width = std::min(chunk, V - col0);
    const T* w_chunk = weight + col0 * K;
    DlogitsParams<T> p{};
    p.store.out = dlogits.as<T>();
    p.store.store_by_tma = M > 128 && (width * int64_t(sizeof(T))) % 16 == 0;
    if (p.store.store_by_tma) p.store.map_out = sm90::tma_map_2d(dlogits.as<const T>(), M, width, 64);
    static_cast<DlogitsParamsBase&>(p) = dlogits_params(a, r.active, r.lse, r.entropy, col0);
    if (p.dentropy) launch_vocab_gemm<T, DlogitsEpilogue<T, true>>(hidden, w_chunk, p, M, width, K, stream, op);
    else launch_vocab_gemm<T, DlogitsEpilogue<T, false>>(hidden, w_chunk, p, M, width, K, stream, op);
    const bool last = c + 1 == chunks;
    if (chunks == 1) {
      gemm_sm90_input_grad<T>(dlogits.as<const T>(), w_chunk, a.dhidden.data, a.dhidden.dtype, M, width, K, stream);
    } else if (c == 0) {
      gemm_sm90_input_grad<T>(dlogits.as<const T>(), w_chunk, acc, DType::f32, M, width, K, stream);
    } else {
      gemm_sm90_input_grad_continue<T>(dlogits.as<const T>(), w_chunk, acc, last ? a.dhidden.data : acc,
                                       last ? a.dhidden.dtype : DType::f32, M, width, K, stream);
    }
    if (a.dweight.present())  // absent: a frozen head
      gemm_sm90_weight_grad<T>(dlogits.as<const T>(), hidden, r.keep, segs.data(), int64_t(segs.size() / 2),
                               a.dweight.as<float>() + col0 * K, M, width, K, stream);
  }
}

// Rows [0, C) of a backward whose forward kept their fp32 logits: dlogits from them (no GEMM), then
// the same dX and dW kernels as the fused backward, over the whole vocab at once (the fused one's
// vocab chunks change no bit). segs: the covering segments of these rows.
template <class T>
void kept_backward(const LmHeadLogprobBackwardArgs& a, const BackwardRows& r, const std::vector<int32_t>& segs,
                   cudaStream_t stream) {
  const char* op = "lm_head_logprob_backward";
  const int64_t M = a.hidden.shape[0], K = a.hidden.shape[1], V = a.weight.shape[0];
  const T* hidden = a.hidden.as<const T>();
  ScratchBuffer dlogits(size_t(M) * size_t(V) * sizeof(T), stream, op);
  const DlogitsParamsBase p = dlogits_params(a, r.active, r.lse, r.entropy, 0);
  const unsigned blocks = unsigned(std::min<int64_t>(M, 65535));
  if (p.dentropy) dlogits_from_kept<T, true><<<blocks, 256, 0, stream>>>(a.logits_kept.as<const float>(), p, M, V, dlogits.as<T>());
  else dlogits_from_kept<T, false><<<blocks, 256, 0, stream>>>(a.logits_kept.as<const float>(), p, M, V, dlogits.as<T>());
  check(cudaGetLastError(), op, "kept dlogits launch");
  gemm_sm90_input_grad<T>(dlogits.as<const T>(), a.weight.as<const T>(), a.dhidden.data, a.dhidden.dtype, M, V, K, stream);
  if (a.dweight.present())  // absent: a frozen head
    gemm_sm90_weight_grad<T>(dlogits.as<const T>(), hidden, r.keep, segs.data(), int64_t(segs.size() / 2),
                             a.dweight.as<float>(), M, V, K, stream);
}

// The backward's rows [begin, end) as arguments of their own (dweight, weight and flags shared).
LmHeadLogprobBackwardArgs backward_rows(const LmHeadLogprobBackwardArgs& a, int64_t begin, int64_t end) {
  LmHeadLogprobBackwardArgs r = a;
  r.hidden = a.hidden.rows(begin, end);
  r.targets = a.targets.rows(begin, end);
  r.loss_mask = rows_or_none(a.loss_mask, begin, end);
  r.lse = rows_or_none(a.lse, begin, end);
  r.dlogp = a.dlogp.rows(begin, end);
  r.dentropy = rows_or_none(a.dentropy, begin, end);
  r.dhidden = a.dhidden.rows(begin, end);
  r.segments = {};  // the callers pass covering segments of their own rows
  return r;
}

// The covering segments (covering_segments) of rows [0, T) split at row C, an edge of one of them
// (the op's validation checks it): those before C, and those after it counted from C.
std::pair<std::vector<int32_t>, std::vector<int32_t>> split_covering(const TensorView& segments, int64_t T, int64_t C) {
  std::pair<std::vector<int32_t>, std::vector<int32_t>> out;
  const std::vector<int32_t> all = covering_segments(segments, T);
  for (size_t i = 0; i < all.size(); i += 2) {
    const int64_t row = all[i], len = all[i + 1];
    if (row < C && row + len > C) throw Error("lm_head_logprob_backward", "logits_kept", "its rows end inside a segment");
    auto& side = row < C ? out.first : out.second;
    side.push_back(int32_t(row < C ? row : row - C));
    side.push_back(int32_t(len));
  }
  return out;
}

// Composed: per chunk of tokens, fp32 logits, logprob_backward to dlogits in the input's dtype, and
// the linear backward kernels (whose weight gradient is then the token-by-token one: no grouping).
void composed_backward(const Context& ctx, const LmHeadLogprobBackwardArgs& a, const float* lse) {
  const char* op = "lm_head_logprob_backward";
  const int64_t T = a.hidden.shape[0], V = a.weight.shape[0];
  const cudaStream_t stream = stream_of(ctx.stream);
  const int64_t rows = composed_rows(T, V);
  ScratchBuffer logits(size_t(rows) * size_t(V) * sizeof(float), stream, op);
  ScratchBuffer dlogits(size_t(rows) * size_t(V) * dtype_size(a.hidden.dtype), stream, op);
  ScratchBuffer active(size_t(T), stream, op);  // masked rows leave dweight alone (their x may be anything)
  if (a.dweight.present()) mark_active(a, active.as<uint8_t>(), stream);  // read by the weight gradient alone
  for (int64_t r0 = 0; r0 < T; r0 += rows) {
    const int64_t n = std::min(rows, T - r0);
    const TensorView z = TensorView::of(logits.as<float>(), DType::f32, {n, V}, Device::cuda);
    const TensorView dz = TensorView::of(dlogits.as<void>(), a.hidden.dtype, {n, V}, Device::cuda);
    linear_forward(ctx, {a.hidden.rows(r0, r0 + n), a.weight, {}, z});
    LogprobBackwardArgs b;
    b.logits = z;
    b.targets = a.targets.rows(r0, r0 + n);
    b.loss_mask = rows_or_none(a.loss_mask, r0, r0 + n);
    b.lse = TensorView::of(const_cast<float*>(lse) + r0, DType::f32, {n}, Device::cuda);
    b.dlogp = a.dlogp.rows(r0, r0 + n);
    b.dentropy = rows_or_none(a.dentropy, r0, r0 + n);
    b.dlogits = dz;
    b.ignore_index = a.ignore_index;
    b.targets_checked = true;  // the LM head's own call checked them (or the caller vouched)
    logprob_backward(ctx, b);
    linear_backward_input(ctx, {dz, a.weight, a.dhidden.rows(r0, r0 + n)});
    if (!a.dweight.present()) continue;  // a frozen head
    LinearBackwardWeightArgs w;
    w.dy = dz;
    w.x = a.hidden.rows(r0, r0 + n);
    w.row_mask = TensorView::of(active.as<uint8_t>() + r0, DType::u8, {n}, Device::cuda);
    w.dweight = a.dweight;
    linear_backward_weight(ctx, w);
  }
}

void lm_head_logprob_backward(const Context& ctx, const LmHeadLogprobBackwardArgs& a) {
  const char* op = "lm_head_logprob_backward";
  const int64_t T = a.hidden.shape[0], V = a.weight.shape[0];
  const cudaStream_t stream = stream_of(ctx.stream);
  require_16bit(op, a.hidden);
  if (a.dhidden.dtype != DType::f32 && a.dhidden.dtype != a.hidden.dtype)
    throw Unsupported(op, "dhidden", "the CUDA LM head writes dhidden in hidden's dtype or fp32");
  check_targets_of(ctx, op, "hidden", T, V, a, stream);
  // The statistics: the forward's lse, or (no lse, or an entropy gradient, which needs H) a forward
  // pass into scratch first.
  const float* lse = a.lse.present() ? a.lse.as<const float>() : nullptr;
  const float* entropy = nullptr;
  ScratchBuffer stats(lse && !a.dentropy.present() ? 0 : size_t(3 * T) * sizeof(float), stream, op);
  if (!lse || a.dentropy.present()) {
    LmHeadLogprobForwardArgs f;
    f.hidden = a.hidden;
    f.weight = a.weight;
    f.targets = a.targets;
    f.loss_mask = a.loss_mask;
    f.ignore_index = a.ignore_index;
    forward_into(ctx, f, stats.as<float>(), stats.as<float>() + T, stats.as<float>() + 2 * T);
    entropy = stats.as<float>() + T;
    lse = stats.as<float>() + 2 * T;
  }
  if (fused_path(a.hidden, a.weight, true)) {
    const int64_t C = kept_rows(a.hidden, a.weight, a.logits_kept);
    const auto segs = split_covering(a.segments, T, C);
    with_16bit_storage(a.hidden.dtype, [&](auto tag) {
      using T_ = decltype(tag);
      ScratchBuffer active(size_t(T), stream, op), keep(size_t(T), stream, op);
      row_masks<T_>(a, active.as<uint8_t>(), keep.as<uint8_t>(), stream);
      const BackwardRows rows{lse, entropy, active.as<const uint8_t>(), keep.as<const uint8_t>()};
      if (C > 0) kept_backward<T_>(backward_rows(a, 0, C), rows, segs.first, stream);
      if (C < T) fused_backward<T_>(backward_rows(a, C, T), rows.from(C), segs.second, stream);
    });
    return;
  }
  composed_backward(ctx, a, lse);
}

}  // namespace

bool lm_head_keeps_logits(const TensorView& hidden, const TensorView& weight) {
  return hidden.ndim == 2 && weight.ndim == 2 && takes_kept_logits(hidden, weight);  // before validation: shapes first
}

SAMEBITS_REGISTER_KERNEL(lm_head_logprob_forward, Backend::cuda, LmHeadLogprobForwardArgs, lm_head_logprob_forward);
SAMEBITS_REGISTER_KERNEL(lm_head_logprob_backward, Backend::cuda, LmHeadLogprobBackwardArgs, lm_head_logprob_backward);

}  // namespace samebits::cuda
