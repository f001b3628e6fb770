// CUDA RMSNorm (optionally fused with the preceding residual add) and QK-norm, forward and backward.
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
// dweight is a sum over tokens, done without atomics and without anything depending on the SM count:
// (1) the rows are cut into chunks of C rows (C = 2^18 / H rounded to a power of two, 8 … 128: a
// function of the hidden size) starting at every segment (sequence) of the call, so any split of a
// batch into micro-batches at sequence boundaries, packed or padded, cuts the same chunks; a CTA
// takes a chunk, computes dx for its rows and sums dy·x̂ of its active rows in ascending order per
// column into a partial (fp32, [chunks, H]); (2) ranges of up to 16 consecutive chunks of a segment
// are summed in order, and (3) the ranges are added into the fp32 dweight one after another in row
// order (chain_partials). Rows outside every segment, and masked rows, add nothing. The partials cost
// 4H bytes per C rows (at bf16, H = 4096, C = 64: 1% of the backward's traffic).
//
// QK-norm normalises rows of head_dim (64, 128, …) elements: a row is a slot of D/8 lanes of a warp
// (a power of two: 8 for D = 64, 16 for 128), the butterfly runs over the slot. Its dweight uses the
// same scheme with chunks of ~32 KiB of rows, counted in tokens (a chunk is all heads of C tokens,
// C = 2^15 / (heads · head_dim) rounded to a power of two, 1 … 128): slot s of a CTA sums the chunk's
// rows s, s + slots, … in order, then the slots' sums are added in slot order. Fused with RoPE, it
// rotates each row in registers (the pair partner a shuffle away) and saves the rotated tensor's
// round trip through memory: one read and one write of q and k a layer.
#include <algorithm>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "cuda/common/segments.hpp"
#include "cuda/common/vec8.cuh"
#include "cuda/rope/rope_math.cuh"
#include "ops/registry.hpp"
#include "ops/tuning.hpp"
#include "samebits/error.hpp"
#include "samebits/ops.hpp"

namespace samebits::cuda {
namespace {

constexpr unsigned FULL = 0xffffffffu;
constexpr int MAX_THREADS = 512;  // so that a thread may hold 128 registers
// CTAs of 512 an SM the forward is compiled to fit (registers a thread ≤ 64K /
// (512 · CTAs), spill-free): three in bf16 at one vector a thread (40 registers), two at run-time
// dtypes (56), one at two vectors. The backward takes one (two would need 64 registers: it spills).
template <class Fmt, int VPT>
constexpr int forward_min_ctas() {
  return VPT == 2 ? 1 : std::is_same_v<Fmt, AllBf16> ? 3 : 2;
}

constexpr int RANGE_CHUNKS = 16;      // chunks summed in order before the chain
constexpr int MAX_CHUNKS = 512, MAX_RANGES = 256;  // per launch (kernel-parameter tables)
constexpr int QK_MAX_CHUNKS = 2048;  // QK-norm's chunks are small: more of them a launch

// ------------------------------------------------------------------ the chunk tables
template <int Capacity>
struct ChunkTableOf {
  static constexpr int capacity = Capacity;
  int32_t row[Capacity];   // first row (token) of the chunk
  uint8_t len[Capacity];   // rows (tokens) in it, 1 … 128
  uint8_t sums[Capacity];  // 0: outside every segment (dx only, no partial)
  int count;
};
using ChunkTable = ChunkTableOf<MAX_CHUNKS>;
using QkChunkTable = ChunkTableOf<QK_MAX_CHUNKS>;
struct RangeTable {
  int16_t first[MAX_RANGES];  // first chunk of the range (an index into the launch's chunks)
  uint8_t count[MAX_RANGES];
  int n;
};

// Rows per chunk: a function of the row length only.
int chunk_rows(int64_t row_elems) {
  int64_t c = (int64_t(1) << 18) / std::max<int64_t>(row_elems, 1);
  int p = 8;
  while (p * 2 <= c && p < 128) p *= 2;
  return p;
}

// Calls launch(chunks, ranges) for consecutive batches of the call's chunks, in row order: the
// caller's segments (or all rows as one) and the gaps between them (dx only), each cut into chunks
// of `rows` rows and ranges of RANGE_CHUNKS chunks from its start; a batch ends at a range boundary.
template <class Table = ChunkTable, class Launch>
void for_chunk_batches(const TensorView& segments, int64_t T, int rows, Launch&& launch) {
  Table chunks{};
  RangeTable ranges{};
  auto flush = [&] {
    if (chunks.count > 0) launch(chunks, ranges);
    chunks.count = 0;
    ranges.n = 0;
  };
  auto add_segment = [&](int64_t row, int64_t len, bool sums) {
    for (int64_t r = 0; r < len; r += int64_t(rows) * RANGE_CHUNKS) {
      const int64_t range_rows = std::min<int64_t>(int64_t(rows) * RANGE_CHUNKS, len - r);
      const int n_chunks = int((range_rows + rows - 1) / rows);
      if (chunks.count + n_chunks > Table::capacity || ranges.n == MAX_RANGES) flush();
      if (sums) {
        ranges.first[ranges.n] = int16_t(chunks.count);
        ranges.count[ranges.n] = uint8_t(n_chunks);
        ++ranges.n;
      }
      for (int c = 0; c < n_chunks; ++c) {
        chunks.row[chunks.count] = int32_t(row + r + int64_t(c) * rows);
        chunks.len[chunks.count] = uint8_t(std::min<int64_t>(rows, range_rows - int64_t(c) * rows));
        chunks.sums[chunks.count] = sums ? 1 : 0;
        ++chunks.count;
      }
    }
  };
  for_each_piece(segments, T, add_segment);
  flush();
}

// (2) + (3): dweight[col] += range sums in order; a range is its chunks' partials summed in order.
// A CTA takes 32 columns; warp w sums ranges w, w + CHAIN_WARPS, …; warp 0 then chains them.
constexpr int CHAIN_WARPS = 16;
__global__ void __launch_bounds__(CHAIN_WARPS * 32) chain_partials(const float* __restrict__ partials, const __grid_constant__ RangeTable
                                                      ranges, int64_t width, float* __restrict__ dweight) {
  __shared__ float range_sum[MAX_RANGES][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col = int64_t(blockIdx.x) * 32 + lane;
  if (col < width)
    for (int r = warp; r < ranges.n; r += CHAIN_WARPS) {
      const int64_t first = ranges.first[r];
      const int count = ranges.count[r];
      float v[RANGE_CHUNKS];  // all loads in flight at once, then the sum in order
#pragma unroll
      for (int c = 0; c < RANGE_CHUNKS; ++c) v[c] = c < count ? partials[(first + c) * width + col] : 0.0f;
      float s = v[0];
#pragma unroll
      for (int c = 1; c < RANGE_CHUNKS; ++c) s = c < count ? __fadd_rn(s, v[c]) : s;
      range_sum[r][lane] = s;
    }
  __syncthreads();
  if (warp == 0 && col < width) {
    float acc = dweight[col];
    for (int r = 0; r < ranges.n; ++r) acc = __fadd_rn(acc, range_sum[r][lane]);
    dweight[col] = acc;
  }
}

void launch_chain(const float* partials, const RangeTable& ranges, int64_t width, float* dweight, cudaStream_t stream,
                  const char* op) {
  if (ranges.n == 0) return;
  chain_partials<<<unsigned((width + 31) / 32), CHAIN_WARPS * 32, 0, stream>>>(partials, ranges, width, dweight);
  check(cudaGetLastError(), op, "chain kernel launch");
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

__device__ __forceinline__ float rstd_of(float sum_sq, int64_t H, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, float(H)), eps)));
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

bool is_bf16(const TensorView& t) { return !t.present() || t.dtype == DType::bf16; }

// f(Fmt, VPT) as a type and a compile-time constant: AllBf16 where every row tensor of the call is
// bf16 (unless the test hook forces the run-time-dtype path), else AnyDtype.
template <class F>
void with_shape(int vpt, bool all_bf16, F&& f) {
  auto with_vpt = [&](auto fmt) {
    if (vpt == 1) f(fmt, std::integral_constant<int, 1>{});
    else f(fmt, std::integral_constant<int, 2>{});
  };
  if (all_bf16 && !detail::norm_any_dtype_path_override()) with_vpt(AllBf16{});
  else with_vpt(AnyDtype{});
}

// CTAs of `threads` threads of `kernel` that fit an SM at once (for grid-stride kernels sized to
// the device), cached per device in `cache`.
template <class Kernel>
int resident_ctas(std::atomic<int> (&cache)[64], Kernel kernel, int threads, const char* op) {
  return once_per_device(cache, op, [&] {
    int n = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0), op, "occupancy");
    return std::max(n, 1);
  });
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
    kernel<<<grid, threads, 0, stream_of(ctx.stream)>>>(p);
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
    check(cudaGetLastError(), op, "kernel launch");
    launch_chain(p.partials, ranges, H, a.dweight.as<float>(), stream, op);
  });
}

// ------------------------------------------------------------------ QK-norm (+ RoPE)
// A row of D elements is a slot of `lanes` = D/8 lanes (rounded up to a power of two, ≤ 32). A CTA
// walks its tokens in steps of tokens_per_step tokens whose rows (heads of each) are a multiple of
// the CTA's slots, so every slot takes as many rows a step (warp-uniform shuffles) and, in the
// backward, slot s of a chunk takes rows s, s + slots, … in order whatever the step.
//
// Fused RoPE (positions set): a step first makes its tokens' cos / sin into shared memory
// (rope_math.cuh, as the RoPE kernel); a row's pair partner (dim i + D/2 of dim i) lies in slot
// lane ± D/16, fetched by a shuffle. The forward rounds the normed row to y's dtype, then rotates
// (qk_norm_forward into y, then rope_forward in place, in one pass); the backward rotates dy back
// and keeps it in fp32 for the norm's backward (rope_backward into fp32, then qk_norm_backward).
constexpr int QK_THREADS = 256, QK_MAX_D = 256;
using QkInvFreq = InvFreqTable<QK_MAX_D / 2>;

struct QkParams {
  In8 x, dy, weight;
  Out8 y, dx;
  float* rstd_out;
  const float* rstd_in;
  const uint8_t* mask;
  float* partials;            // backward: [chunks, D]
  const int32_t* positions;   // fused RoPE when set
  int64_t T, heads, D;
  int lanes, tokens_per_step;
  float eps;
};

// The sum over a slot of `lanes` lanes (a power of two), the same bits in each of them.
__device__ __forceinline__ float slot_sum(float v, int lanes) {
  for (int m = lanes / 2; m >= 1; m /= 2) v = __fadd_rn(v, __shfl_xor_sync(FULL, v, m));
  return v;
}

// v := this slot lane's 8 elements of a row rotated by RoPE with the step's cos / sin (cs: the
// row's token's D/2 pairs, interleaved by 8: pair i at (i % 8) · D/16 + i / 8, so the lanes of a
// slot read consecutive words). Every lane of the warp calls it (shuffles); lanes past D compute junk
// that nobody stores.
__device__ __forceinline__ void rotate_slot(float (&v)[8], const float2* cs, int slot_lane, const QkParams& p) {
  const int half = int(p.D / 2), half_lanes = half / 8;
  const bool first = slot_lane < half_lanes;
  const int partner = first ? slot_lane + half_lanes : slot_lane - half_lanes;
  const int vector = first ? slot_lane : slot_lane - half_lanes;  // pairs 8·vector … 8·vector + 7
  const bool in_row = 8 * slot_lane < p.D;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float other = __shfl_sync(FULL, v[e], partner, p.lanes);
    const float2 c = in_row ? cs[e * half_lanes + vector] : make_float2(0.0f, 0.0f);  // interleaved: no bank conflicts
    v[e] = first ? rope_first(v[e], other, c) : rope_second(other, v[e], c);
  }
}

__device__ __forceinline__ int qk_vector_len(int slot_lane, int64_t D) {
  return int(std::max<int64_t>(0, std::min<int64_t>(8, D - 8 * int64_t(slot_lane))));
}

// A thread's rows, in order: steps of tokens_per_step tokens (grid-stride in the forward, the
// chunk's in the backward), rows_per_slot rows of each. Rows are fetched ahead of their use (two in
// the forward, one in the backward, which fetches x and dy), across step boundaries, so that loads
// stay in flight while a row is reduced: one row in flight a thread is far from enough for HBM.
struct QkRowCursor {
  int64_t t0;  // the step's first token
  int j;       // the row of this slot within the step
  __device__ QkRowCursor next(int rows_per_slot, int64_t stride) const {
    return j + 1 < rows_per_slot ? QkRowCursor{t0, j + 1} : QkRowCursor{t0 + stride, 0};
  }
  // The row index (token · heads + head) relative to the first token of the walk.
  __device__ int64_t row(int64_t heads, int slots, int slot) const { return t0 * heads + int64_t(j) * slots + slot; }
};

// cos / sin of a step's tokens: [tokens_per_step][D/2] pairs, ≤ QK_THREADS · 4. Three buffers: step i
// reads buffer i % 3 while it makes step i + 1's into the next, and one barrier a step suffices (the
// buffer it overwrites was last read two steps ago, before the previous step's barrier).
constexpr int QK_CS_PAIRS = QK_THREADS * 4, QK_CS_BUFFERS = 3;
constexpr int QK_STEP_ROWS_PER_SLOT = 16;  // a step's rows per slot the host aims for

template <class Fmt>
__global__ void __launch_bounds__(QK_THREADS) qk_norm_forward_kernel(const __grid_constant__ QkParams p,
                                                                     const __grid_constant__ QkInvFreq inv) {
  __shared__ float2 cs[QK_CS_BUFFERS * QK_CS_PAIRS];
  const int slot_lane = (threadIdx.x % 32) % p.lanes, slot = threadIdx.x / p.lanes;
  const int slots = QK_THREADS / p.lanes, tps = p.tokens_per_step;
  const int64_t col = 8 * int64_t(slot_lane), half = p.D / 2, rows = p.T * p.heads;
  const int64_t stride = int64_t(gridDim.x) * tps;
  const int rows_per_slot = int(tps * p.heads / slots);
  const int n = qk_vector_len(slot_lane, p.D);
  auto fetch = [&](QkRowCursor c) {
    const int64_t row = c.row(p.heads, slots, slot);
    return fetch8<Fmt>(p.x, row * p.D + col, c.t0 < p.T && row < rows ? n : 0);
  };
  auto fill = [&](int64_t t0, int step) {
    if (t0 < p.T)
      rope_fill_cos_sin(cs + (step % QK_CS_BUFFERS) * QK_CS_PAIRS, p.positions, t0, std::min<int64_t>(tps, p.T - t0),
                        half, inv.f, false, true);
  };
  QkRowCursor cur{int64_t(blockIdx.x) * tps, 0};
  const QkRowCursor second = cur.next(rows_per_slot, stride);
  Raw8 raw0 = fetch(cur), raw1 = fetch(second);
  float w[8];
  load8(p.weight, col, n, w);
  if (p.positions) fill(cur.t0, 0);
  for (int step = 0; cur.t0 < p.T; cur = cur.next(rows_per_slot, stride)) {
    if (cur.j == 0 && p.positions) {  // the next step's cos / sin, made while rows load
      fill(cur.t0 + stride, step + 1);
      __syncthreads();
    }
    const Raw8 raw2 = fetch(cur.next(rows_per_slot, stride).next(rows_per_slot, stride));
    const int r = cur.j * slots + slot;  // the row within the step
    const int64_t row = cur.t0 * p.heads + r;
    float x[8], ss = 0.0f;
    unpack8(Fmt::of(p.x.dt), raw0, x);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = __fmaf_rn(x[e], x[e], ss);
    const float rstd = rstd_of(slot_sum(ss, p.lanes), p.D, p.eps);
    float y[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = __fmul_rn(__fmul_rn(x[e], rstd), w[e]);
    if (p.positions) {
#pragma unroll
      for (int e = 0; e < 8; ++e) y[e] = round_to(Fmt::of(p.y.dt), y[e]);  // the unfused path's stored y
      rotate_slot(y, cs + (step % QK_CS_BUFFERS) * QK_CS_PAIRS + (int(r) / int(p.heads)) * half, slot_lane, p);
    }
    if (row < rows) {
      if (n > 0) store8<Fmt>(p.y, row * p.D + col, n, y);
      if (p.rstd_out && slot_lane == 0) p.rstd_out[row] = rstd;
    }
    raw0 = raw1, raw1 = raw2;
    if (cur.j + 1 == rows_per_slot) ++step;
  }
}

// Chunks b, b + grid, … of the launch, a CTA each at a time (which CTA takes a chunk changes no
// bit: each has its own partial): dx, and the chunk's partial: slot s sums rows s, s + slots, … of
// the chunk in order, then the slots' sums are added in slot order.
template <class Fmt>
__global__ void __launch_bounds__(QK_THREADS) qk_norm_backward_kernel(const __grid_constant__ QkParams p,
                                                                      const __grid_constant__ QkChunkTable chunks,
                                                                      const __grid_constant__ QkInvFreq inv) {
  __shared__ float slot_dw[QK_THREADS * 8];  // [slot][lanes · 8 columns]: thread t's 8 at 8t
  __shared__ float2 cs[QK_CS_BUFFERS * QK_CS_PAIRS];
  const int slot_lane = (threadIdx.x % 32) % p.lanes, slot = threadIdx.x / p.lanes;
  const int slots = QK_THREADS / p.lanes, tps = p.tokens_per_step;
  const int rows_per_slot = int(tps * p.heads / slots);
  const int64_t col = 8 * int64_t(slot_lane), half = p.D / 2;
  const int n = qk_vector_len(slot_lane, p.D);
  float w[8];
  load8(p.weight, col, n, w);
  for (int chunk = blockIdx.x; chunk < chunks.count; chunk += gridDim.x) {
    const int64_t first_token = chunks.row[chunk], n_tokens = chunks.len[chunk], n_rows = n_tokens * p.heads;
    const bool sums = chunks.sums[chunk] != 0;
    auto fetch = [&](QkRowCursor c, Raw8& x, Raw8& dy) {
      const int64_t i = c.row(p.heads, slots, slot), row = first_token * p.heads + i;
      const int m = c.t0 < n_tokens && i < n_rows ? n : 0;
      x = fetch8<Fmt>(p.x, row * p.D + col, m);
      dy = fetch8<Fmt>(p.dy, row * p.D + col, m);
    };
    auto fill = [&](int64_t s0, int step) {
      if (s0 < n_tokens)
        rope_fill_cos_sin(cs + (step % QK_CS_BUFFERS) * QK_CS_PAIRS, p.positions, first_token + s0,
                          std::min<int64_t>(tps, n_tokens - s0), half, inv.f, true, true);
    };
    QkRowCursor cur{0, 0};
    Raw8 raw_x, raw_dy;
    fetch(cur, raw_x, raw_dy);
    if (p.positions) fill(0, 0);
    float dw[8] = {};
    for (int step = 0; cur.t0 < n_tokens; cur = cur.next(rows_per_slot, tps)) {
      if (cur.j == 0 && p.positions) {  // the next step's cos / sin, made while rows load
        fill(cur.t0 + tps, step + 1);
        __syncthreads();
      }
      Raw8 next_x, next_dy;
      fetch(cur.next(rows_per_slot, tps), next_x, next_dy);
      const int r = cur.j * slots + slot, token = int(cur.t0) + r / int(p.heads);  // in the chunk
      const int64_t i = cur.t0 * p.heads + r, row = first_token * p.heads + i;
      const bool live = i < n_rows;
      float x[8], dy[8], g[8], ss = 0.0f, dot = 0.0f;
      unpack8(Fmt::of(p.x.dt), raw_x, x);
      unpack8(Fmt::of(p.dy.dt), raw_dy, dy);
      if (p.positions)  // kept in fp32
        rotate_slot(dy, cs + (step % QK_CS_BUFFERS) * QK_CS_PAIRS + (token - cur.t0) * half, slot_lane, p);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss = __fmaf_rn(x[e], x[e], ss);
      float rstd;
      if (p.rstd_in) {
        rstd = live ? p.rstd_in[row] : 0.0f;
      } else {
        rstd = rstd_of(slot_sum(ss, p.lanes), p.D, p.eps);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        g[e] = __fmul_rn(dy[e], w[e]);
        x[e] = __fmul_rn(x[e], rstd);
        dot = __fmaf_rn(g[e], x[e], dot);
      }
      dot = slot_sum(dot, p.lanes);
      if (live) {
        const float mean = __fdiv_rn(dot, float(p.D));
        float d[8];
        const bool active = sums && (p.mask == nullptr || p.mask[first_token + token] != 0);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          d[e] = __fmul_rn(rstd, __fsub_rn(g[e], __fmul_rn(x[e], mean)));
          if (active) dw[e] = __fmaf_rn(dy[e], x[e], dw[e]);
        }
        if (n > 0) store8<Fmt>(p.dx, row * p.D + col, n, d);
      }
      raw_x = next_x, raw_dy = next_dy;
      if (cur.j + 1 == rows_per_slot) ++step;
    }
    if (sums) {  // uniform across the CTA
#pragma unroll
      for (int e = 0; e < 8; ++e) slot_dw[threadIdx.x * 8 + e] = dw[e];
      __syncthreads();
      for (int c = threadIdx.x; c < p.D; c += QK_THREADS) {
        float s = slot_dw[c];
        for (int k = 1; k < slots; ++k) s = __fadd_rn(s, slot_dw[k * p.lanes * 8 + c]);
        p.partials[int64_t(chunk) * p.D + c] = s;
      }
    }
    __syncthreads();  // the next chunk rewrites cs and slot_dw
  }
}

// Tokens a dweight chunk of QK-norm: ~32 KiB of rows (8 tokens of Qwen3-8B's q, 32 of its k), a
// function of heads · head_dim only. Smaller than RMSNorm's chunks: a partial is head_dim floats,
// while enough CTAs to fill the GPU need many chunks.
int qk_chunk_tokens(int64_t heads, int64_t D) {
  const int64_t c = (int64_t(1) << 15) / std::max<int64_t>(heads * D, 1);
  int p = 1;
  while (p * 2 <= c && p < 128) p *= 2;
  return p;
}

// The geometry shared by both directions; the fused RoPE needs each half of a row to be whole
// vectors (D % 16 == 0) and at least two of them.
QkParams qk_params(const TensorView& x, const TensorView& positions, const char* op) {
  const int64_t D = x.shape[2];
  if (D > QK_MAX_D) throw Unsupported(op, "x", "the CUDA QK-norm supports head_dim up to " + std::to_string(QK_MAX_D));
  if (positions.present() && (D % 16 != 0))
    throw Unsupported(op, "x", "the CUDA QK-norm fused with RoPE needs head_dim a multiple of 16 (got " +
                                   std::to_string(D) + "); call qk_norm then rope");
  QkParams p{};
  p.T = x.shape[0], p.heads = x.shape[1], p.D = D;
  p.lanes = 1;
  while (p.lanes * 8 < D) p.lanes *= 2;
  // Tokens a step: the fewest whose rows are a multiple of the slots, times as many as give each
  // slot QK_STEP_ROWS_PER_SLOT rows (their cos / sin within a shared-memory buffer's pairs).
  const int64_t slots = QK_THREADS / p.lanes, half = D / 2;
  const int64_t base = slots / std::gcd(p.heads, slots), base_rows_per_slot = base * p.heads / slots;
  const int64_t times = std::max<int64_t>(1, std::min(QK_STEP_ROWS_PER_SLOT / base_rows_per_slot,
                                                      QK_CS_PAIRS / (base * std::max<int64_t>(half, 1))));
  p.tokens_per_step = int(base * times);
  p.positions = positions.present() ? positions.as<const int32_t>() : nullptr;
  return p;
}

void qk_norm_forward(const Context& ctx, const QkNormForwardArgs& a) {
  const char* op = "qk_norm_forward";
  const int64_t T = a.x.shape[0], heads = a.x.shape[1], D = a.x.shape[2];
  QkParams p = qk_params(a.x, a.positions, op);
  if (T == 0 || heads == 0) return;
  p.x = in8(a.x, D);
  p.weight = in8(a.weight, D);
  p.y = out8(a.y, D);
  p.rstd_out = a.rstd.present() ? a.rstd.as<float>() : nullptr;
  p.eps = float(a.eps);
  const QkInvFreq inv = p.positions ? make_inv_freq<QK_MAX_D / 2>(a.rope, D) : QkInvFreq{};
  const int64_t steps = (T + p.tokens_per_step - 1) / p.tokens_per_step;
  const bool all_bf16 = is_bf16(a.x) && is_bf16(a.y);
  with_shape(1, all_bf16, [&](auto fmt, auto) {
    // As many CTAs as fit at once (a grid-stride loop over the steps).
    const auto kernel = qk_norm_forward_kernel<decltype(fmt)>;
    static std::atomic<int> resident[64] = {};
    const unsigned grid = unsigned(std::min<int64_t>(steps, int64_t(current_sm_count(op)) * resident_ctas(resident, kernel, QK_THREADS, op)));
    kernel<<<grid, QK_THREADS, 0, stream_of(ctx.stream)>>>(p, inv);
  });
  check(cudaGetLastError(), op, "kernel launch");
}

void qk_norm_backward(const Context& ctx, const QkNormBackwardArgs& a) {
  const char* op = "qk_norm_backward";
  const int64_t T = a.x.shape[0], heads = a.x.shape[1], D = a.x.shape[2];
  QkParams p = qk_params(a.x, a.positions, op);
  if (T == 0 || heads == 0) return;
  const cudaStream_t stream = stream_of(ctx.stream);
  ScratchBuffer partials(size_t(QK_MAX_CHUNKS) * size_t(D) * sizeof(float), stream, op);
  p.x = in8(a.x, D);
  p.dy = in8(a.dy, D);
  p.weight = in8(a.weight, D);
  p.dx = out8(a.dx, D);
  p.rstd_in = a.rstd.present() ? a.rstd.as<const float>() : nullptr;
  p.mask = a.row_mask.present() ? a.row_mask.as<const uint8_t>() : nullptr;
  p.partials = partials.as<float>();
  p.eps = float(a.eps);
  const QkInvFreq inv = p.positions ? make_inv_freq<QK_MAX_D / 2>(a.rope, D) : QkInvFreq{};
  const bool all_bf16 = is_bf16(a.dy) && is_bf16(a.x) && is_bf16(a.dx);
  for_chunk_batches<QkChunkTable>(a.segments, T, qk_chunk_tokens(heads, D), [&](const QkChunkTable& chunks, const RangeTable& ranges) {
    with_shape(1, all_bf16, [&](auto fmt, auto) {
      const auto kernel = qk_norm_backward_kernel<decltype(fmt)>;
      static std::atomic<int> resident[64] = {};
      const int grid = std::min(chunks.count, current_sm_count(op) * resident_ctas(resident, kernel, QK_THREADS, op));
      kernel<<<unsigned(grid), QK_THREADS, 0, stream>>>(p, chunks, inv);
    });
    check(cudaGetLastError(), op, "kernel launch");
    launch_chain(p.partials, ranges, D, a.dweight.as<float>(), stream, op);
  });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(rmsnorm_forward, Backend::cuda, RmsNormForwardArgs, rmsnorm_forward);
SAMEBITS_REGISTER_KERNEL(rmsnorm_backward, Backend::cuda, RmsNormBackwardArgs, rmsnorm_backward);
SAMEBITS_REGISTER_KERNEL(qk_norm_forward, Backend::cuda, QkNormForwardArgs, qk_norm_forward);
SAMEBITS_REGISTER_KERNEL(qk_norm_backward, Backend::cuda, QkNormBackwardArgs, qk_norm_backward);

}  // namespace samebits::cuda
