// CUDA RMSNorm (optionally fused with the preceding residual add), forward and backward.
//
// Why this shape. A row's sum (Σx² for rstd, Σ g·x̂ for the backward) is reduced by a topology that
// depends on the row length alone: thread j of a CTA of ceil(H/8) threads (a multiple of 32, at most
// 512; beyond that a thread takes vectors j and j + 512, up to H = 8192) sums its 8-element vectors in ascending
// order with FMAs, a warp butterfly (xor 16 … 1, which leaves the same bits in every lane) sums the
// warp, and every thread adds the warp sums in ascending warp order from shared memory. A forward
// CTA takes a row at a time in a grid-stride loop (which CTA takes a row never matters), a backward
// CTA one or two rows of its chunk at a time (one barrier pair for both), and each fetches the next
// step's data before it reduces and stores this one's, keeping loads in flight across the barrier;
// where every row tensor is bf16 a compile-time-bf16 instance (vec8.cuh's AllBf16) needs half the
// registers for them, so more CTAs fit an SM. The forward and the backward share the reduction, so
// a backward that recomputes rstd gets the forward's bits.
//
// dweight is a sum over tokens without atomics: the chunk tables and partial chaining of
// dweight_chunks.cuh, with chunks of C = 2^18 / H rows.
#include <algorithm>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cuda/common/pdl.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "cuda/common/segments.hpp"
#include "cuda/common/vec8.cuh"
#include "cuda/norm/dweight_chunks.cuh"
#include "cuda/norm/norm_common.cuh"
#include "ops/registry.hpp"
#include "ops/tuning.hpp"
#include "samebits/error.hpp"
#include "samebits/ops.hpp"

namespace samebits::cuda {
namespace {
using namespace norm;

// CTAs of 512 an SM the forward is compiled to fit (registers a thread ≤ 64K /
// (512 · CTAs), spill-free): three in bf16 at one vector a thread (40 registers), two at run-time
// dtypes (56), one at two vectors. The backward takes one (two would need 64 registers: it spills).
template <class Fmt, int VPT>
constexpr int forward_min_ctas() {
  return VPT == 2 ? 1 : std::is_same_v<Fmt, AllBf16> ? 3 : 2;
}

// ------------------------------------------------------------------ RMSNorm: the row reduction
struct Layout {  // a row of H elements over the CTA's threads
  int64_t H;
  int threads;     // blockDim.x
  __device__ int64_t col(int k) const { return 8 * (int64_t(threadIdx.x) + int64_t(k) * threads); }
  __device__ int valid(int k) const { return int(std::max<int64_t>(0, std::min<int64_t>(8, H - col(k)))); }
};

// v[r] := the row sums, the same bits in every thread. `red` holds two rounds (parity) so that one
// __syncthreads per call suffices: a round's slots are rewritten only after the next call's barrier.
template <int N>
__device__ __forceinline__ void block_sums(float (&v)[N], float (*red)[N][32], int& parity) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int r = 0; r < N; ++r) {
#pragma unroll
    for (int m = 16; m >= 1; m /= 2) v[r] = __fadd_rn(v[r], __shfl_xor_sync(FULL, v[r], m));
    if (lane == 0) red[parity][r][warp] = v[r];
  }
  __syncthreads();
  // All warp sums read at once (four 16-byte loads a row), then added in ascending warp order: the
  // adds, not a chain of dependent shared-memory loads, are the critical path.
#pragma unroll
  for (int r = 0; r < N; ++r) {
    float part[MAX_THREADS / 32];
#pragma unroll
    for (int q = 0; q < MAX_THREADS / 128; ++q) {
      const float4 f = reinterpret_cast<const float4*>(red[parity][r])[q];
      part[4 * q] = f.x, part[4 * q + 1] = f.y, part[4 * q + 2] = f.z, part[4 * q + 3] = f.w;
    }
    float s = part[0];
#pragma unroll
    for (int w = 1; w < MAX_THREADS / 32; ++w) s = w < warps ? __fadd_rn(s, part[w]) : s;
    v[r] = s;
  }
  parity ^= 1;
}

__device__ __forceinline__ float block_sum(float v, float (*red)[1][32], int& parity) {
  float one[1] = {v};
  block_sums<1>(one, red, parity);
  return one[0];
}

struct FwdParams {
  In8 x, residual, weight;
  Out8 y, residual_out;
  float* rstd;
  int64_t T, H;
  float eps;
};

// A row's raw bits (x and, fused, the residual), fetched a step ahead of their use.
template <int VPT>
struct FwdRow {
  Raw8 x[VPT], res[VPT];
};

template <class Fmt, int VPT>
__device__ __forceinline__ void fetch_row(const FwdParams& p, const Layout& L, int64_t row, FwdRow<VPT>& f) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    f.x[k] = fetch8<Fmt>(p.x, row * p.H + L.col(k), L.valid(k));
    if (p.residual.p) f.res[k] = fetch8<Fmt>(p.residual, row * p.H + L.col(k), L.valid(k));
  }
}

// A CTA takes rows blockIdx.x, + gridDim.x, … and fetches each row's data one step before it uses
// it, so the next row's loads are in flight across this row's barrier and stores (different rows
// never overlap, so in-place calls are safe).
template <class Fmt, int VPT>
__global__ void __launch_bounds__(MAX_THREADS, forward_min_ctas<Fmt, VPT>()) rmsnorm_forward_kernel(const __grid_constant__ FwdParams p) {
  pdl_wait();  // launched after the previous kernel (cuda/common/pdl.cuh): its output is ready from here
  pdl_launch_dependents();
  __shared__ __align__(16) float red[2][1][32];
  const Layout L{p.H, int(blockDim.x)};
  const int64_t stride = gridDim.x;
  int parity = 0;
  FwdRow<VPT> cur;
  int64_t row = blockIdx.x;
  if (row < p.T) fetch_row<Fmt>(p, L, row, cur);
  float w[VPT][8];  // after the first row's fetch, so that its latency hides behind that one's
#pragma unroll
  for (int k = 0; k < VPT; ++k) load8(p.weight, L.col(k), L.valid(k), w[k]);
  for (; row < p.T; row += stride) {
    FwdRow<VPT> next;
    if (row + stride < p.T) fetch_row<Fmt>(p, L, row + stride, next);
    float x[VPT][8], ss = 0.0f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      unpack8(Fmt::of(p.x.dt), cur.x[k], x[k]);
      if (p.residual.p) {  // s = x + residual, rounded to residual_out's dtype, which the norm reads
        float res[8];
        unpack8(Fmt::of(p.residual.dt), cur.res[k], res);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[k][e] = round_to(Fmt::of(p.residual_out.dt), __fadd_rn(x[k][e], res[e]));
        if (L.valid(k) > 0) store8<Fmt>(p.residual_out, row * p.H + L.col(k), L.valid(k), x[k]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) ss = __fmaf_rn(x[k][e], x[k][e], ss);
    }
    const float rstd = rstd_of(block_sum(ss, red, parity), p.H, p.eps);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      float y[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) y[e] = __fmul_rn(__fmul_rn(x[k][e], rstd), w[k][e]);
      if (L.valid(k) > 0) store8<Fmt>(p.y, row * p.H + L.col(k), L.valid(k), y);
    }
    if (p.rstd && threadIdx.x == 0) p.rstd[row] = rstd;
    cur = next;
  }
}

struct BwdParams {
  In8 dy, dres, x, weight;
  Out8 dx;
  const float* rstd;    // saved by the forward, or null: recomputed by the forward's reduction
  const uint8_t* mask;  // row_mask or null
  float* partials;      // [chunks of the launch, H]
  int64_t H;
  float eps;
};

// A backward row's raw bits (x, dy, the fused add's dresidual), its saved rstd and whether it adds
// to dweight, fetched a step ahead of their use.
template <int VPT>
struct BwdRow {
  Raw8 x[VPT], dy[VPT], dres[VPT];
  float rstd;
  bool active;
};

template <class Fmt, bool WITH_DRES, int VPT>  // WITH_DRES: fetch the fused add's dresidual too
__device__ __forceinline__ void fetch_row(const BwdParams& p, const Layout& L, int64_t row, bool live, bool sums,
                                          BwdRow<VPT>& f) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int n = live ? L.valid(k) : 0;
    f.x[k] = fetch8<Fmt>(p.x, row * p.H + L.col(k), n);
    f.dy[k] = fetch8<Fmt>(p.dy, row * p.H + L.col(k), n);
    if (WITH_DRES && p.dres.p) f.dres[k] = fetch8<Fmt>(p.dres, row * p.H + L.col(k), n);
  }
  f.rstd = live && p.rstd ? p.rstd[row] : 0.0f;
  f.active = live && sums && (p.mask == nullptr || p.mask[row] != 0);
}

// Rows a backward CTA works on at a time (one barrier pair for all of them) and whether it fetches
// the next step's rows ahead: two rows, fetched ahead, in bf16 at one vector a thread; one row,
// fetched ahead, at two vectors or run-time dtypes; at run-time dtypes and two vectors a thread
// (121 registers at one CTA of 512 an SM: more would spill) each row is fetched as it starts, and
// dresidual only when it is used.
template <class Fmt, int VPT>
constexpr int backward_rows_a_step() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return 1;  // sm_80's code for two rows spills (16 bytes); the rows a step change no bit
#else
  return std::is_same_v<Fmt, AllBf16> && VPT == 1 ? 2 : 1;
#endif
}
template <class Fmt, int VPT>
constexpr bool backward_fetches_ahead() {
  return !(std::is_same_v<Fmt, AnyDtype> && VPT == 2);
}

// A CTA per chunk: dx for its rows, and the chunk's dweight partial (dy·x̂ of its active rows, in
// ascending row order per column). Rows are fetched a step ahead, as in the forward.
template <class Fmt, int VPT>
__global__ void __launch_bounds__(MAX_THREADS) rmsnorm_backward_kernel(const __grid_constant__ BwdParams p,
                                                                       const __grid_constant__ ChunkTable chunks) {
  constexpr int ROWS = backward_rows_a_step<Fmt, VPT>();
  constexpr bool AHEAD = backward_fetches_ahead<Fmt, VPT>();
  __shared__ __align__(16) float red[2][ROWS][32];
  const Layout L{p.H, int(blockDim.x)};
  const int64_t first = chunks.row[blockIdx.x];
  const int len = chunks.len[blockIdx.x];
  const bool sums = chunks.sums[blockIdx.x] != 0;
  int parity = 0;
  float w[VPT][8], dw[VPT][8];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    load8(p.weight, L.col(k), L.valid(k), w[k]);
#pragma unroll
    for (int e = 0; e < 8; ++e) dw[k][e] = 0.0f;
  }
  auto fetch_step = [&](int i0, BwdRow<VPT>(&rows)[ROWS]) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) fetch_row<Fmt, AHEAD>(p, L, first + i0 + r, i0 + r < len, sums, rows[r]);
  };
  BwdRow<VPT> ahead[ROWS];  // with AHEAD: the next step's rows, fetched while this step is reduced and stored
  if (AHEAD) fetch_step(0, ahead);
  for (int i0 = 0; i0 < len; i0 += ROWS) {
    BwdRow<VPT> cur[ROWS];
    if constexpr (AHEAD) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) cur[r] = ahead[r];
      if (i0 + ROWS < len) fetch_step(i0 + ROWS, ahead);
    } else {
      fetch_step(i0, cur);
    }
    float x[ROWS][VPT][8], dy[ROWS][VPT][8], rstd[ROWS], dot[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      rstd[r] = 0.0f;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        unpack8(Fmt::of(p.x.dt), cur[r].x[k], x[r][k]);
        unpack8(Fmt::of(p.dy.dt), cur[r].dy[k], dy[r][k]);
        if (!p.rstd)  // uniform: Σx² only where rstd is recomputed
#pragma unroll
          for (int e = 0; e < 8; ++e) rstd[r] = __fmaf_rn(x[r][k][e], x[r][k][e], rstd[r]);
      }
    }
    if (p.rstd) {  // uniform: the saved rstd, or the forward's reduction and formula
#pragma unroll
      for (int r = 0; r < ROWS; ++r) rstd[r] = cur[r].rstd;
    } else {
      block_sums<ROWS>(rstd, red, parity);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) rstd[r] = rstd_of(rstd[r], p.H, p.eps);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      dot[r] = 0.0f;
#pragma unroll
      for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          x[r][k][e] = __fmul_rn(x[r][k][e], rstd[r]);                                  // x̂
          dot[r] = __fmaf_rn(__fmul_rn(dy[r][k][e], w[k][e]), x[r][k][e], dot[r]);  // g = dy·w
        }
    }
    block_sums<ROWS>(dot, red, parity);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (i0 + r >= len) continue;
      const int64_t row = first + i0 + r;
      const float mean = __fdiv_rn(dot[r], float(p.H));
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        float d[8], res[8];
        if (p.dres.p && AHEAD) unpack8(Fmt::of(p.dres.dt), cur[r].dres[k], res);
        else if (p.dres.p) load8(p.dres, row * p.H + L.col(k), L.valid(k), res);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float g = __fmul_rn(dy[r][k][e], w[k][e]);
          d[e] = __fmul_rn(rstd[r], __fsub_rn(g, __fmul_rn(x[r][k][e], mean)));
          if (p.dres.p) d[e] = __fadd_rn(d[e], res[e]);
          if (cur[r].active) dw[k][e] = __fmaf_rn(dy[r][k][e], x[r][k][e], dw[k][e]);
        }
        if (L.valid(k) > 0) store8<Fmt>(p.dx, row * p.H + L.col(k), L.valid(k), d);
      }
    }
  }
  if (sums)
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const Out8 out{p.partials, DType::f32, (p.H % 8) == 0};
      if (L.valid(k) > 0) store8(out, int64_t(blockIdx.x) * p.H + L.col(k), L.valid(k), dw[k]);
    }
}

// Threads a row of H elements takes, and vectors a thread: ceil(H / 8) threads rounded up to a warp,
// at most 512; VPT 1 or 2 (H ≤ 8192, the registers of two rows of x and dy).
void row_layout(int64_t H, int& threads, int& vpt, const char* op) {
  const int64_t vectors = (H + 7) / 8;
  vpt = vectors <= MAX_THREADS ? 1 : 2;
  if (vectors > 2 * MAX_THREADS) throw Unsupported(op, "x", "the CUDA RMSNorm supports rows of up to 8192 elements");
  threads = int(std::min<int64_t>(MAX_THREADS, ((vectors + vpt - 1) / vpt + 31) / 32 * 32));
}

void rmsnorm_forward(const Context& ctx, const RmsNormForwardArgs& a) {
  const char* op = "rmsnorm_forward";
  const int64_t T = a.x.shape[0], H = a.x.shape[1];
  if (T == 0) return;
  int threads = 0, vpt = 0;
  row_layout(H, threads, vpt, op);
  const FwdParams p{in8(a.x, H), in8(a.residual, H), in8(a.weight, H), out8(a.y, H), out8(a.residual_out, H),
                    a.rstd.present() ? a.rstd.as<float>() : nullptr, T, H, float(a.eps)};
  const bool all_bf16 = is_bf16(a.x) && is_bf16(a.y) && is_bf16(a.residual) && is_bf16(a.residual_out);
  with_shape(vpt, all_bf16, [&](auto fmt, auto v) {
    const auto kernel = rmsnorm_forward_kernel<decltype(fmt), decltype(v)::value>;
    // As many CTAs as fit on the device at once (a grid-stride loop: which CTA takes a row changes
    // no bit), cached per instance (this lambda's instantiation), CTA size and device.
    static std::atomic<int> resident[MAX_THREADS / 32 + 1][64] = {};
    const int per_sm = resident_ctas(resident[threads / 32], kernel, threads, op);
    const unsigned grid = unsigned(std::min<int64_t>(T, int64_t(current_sm_count(op)) * per_sm));
    launch_after_previous(kernel, dim3(grid), dim3(threads), 0, stream_of(ctx.stream), op, p);
  });
  check(cudaGetLastError(), op, "kernel launch");
}

void rmsnorm_backward(const Context& ctx, const RmsNormBackwardArgs& a) {
  const char* op = "rmsnorm_backward";
  const int64_t T = a.x.shape[0], H = a.x.shape[1];
  if (T == 0) return;
  const cudaStream_t stream = stream_of(ctx.stream);
  int threads = 0, vpt = 0;
  row_layout(H, threads, vpt, op);
  ScratchBuffer partials(size_t(MAX_CHUNKS) * size_t(H) * sizeof(float), stream, op);
  BwdParams p{in8(a.dy, H), in8(a.dresidual_out, H), in8(a.x, H), in8(a.weight, H), out8(a.dx, H),
              a.rstd.present() ? a.rstd.as<const float>() : nullptr,
              a.row_mask.present() ? a.row_mask.as<const uint8_t>() : nullptr, partials.as<float>(), H, float(a.eps)};
  const bool all_bf16 = is_bf16(a.dy) && is_bf16(a.x) && is_bf16(a.dx) && is_bf16(a.dresidual_out);
  for_chunk_batches(a.segments, T, chunk_rows(H), [&](const ChunkTable& chunks, const RangeTable& ranges) {
    with_shape(vpt, all_bf16, [&](auto fmt, auto v) {
      rmsnorm_backward_kernel<decltype(fmt), decltype(v)::value><<<unsigned(chunks.count), threads, 0, stream>>>(p, chunks);
    });
    chain_after_chunks(p.partials, ranges, H, a.dweight.as<float>(), stream, op);
  });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(rmsnorm_forward, Backend::cuda, RmsNormForwardArgs, rmsnorm_forward);
SAMEBITS_REGISTER_KERNEL(rmsnorm_backward, Backend::cuda, RmsNormBackwardArgs, rmsnorm_backward);

}  // namespace samebits::cuda
