// CUDA QK-norm (optionally fused with RoPE), forward and backward.
//
// QK-norm normalises rows of head_dim (64, 128, …) elements: a row is a slot of D/8 lanes of a warp
// (a power of two: 8 for D = 64, 16 for 128), the butterfly runs over the slot. Its dweight uses the
// same scheme with chunks of ~32 KiB of rows, counted in tokens (a chunk is all heads of C tokens,
// C = 2^15 / (heads · head_dim) rounded to a power of two, 1 … 128): slot s of a CTA sums the chunk's
// rows s, s + slots, … in order, then the slots' sums are added in slot order. Fused with RoPE, it
// rotates each row in registers (the pair partner a shuffle away) and saves the rotated tensor's
// round trip through memory: one read and one write of q and k a layer.
//
// The pair forward (a layer's q and k in one launch) also writes a decode step's paged KV cache when
// asked (cache_rows, k_cache, v_cache, v): a k-part slot stores its rounded y chunk at the token's
// cache row as well as in k.y, and copies the matching 8 elements of v there (their bits, no
// rounding). The chain had a copy kernel a layer for that (copy_rows_indexed of the rotated k and
// of v into the cache rows: ~2-4 µs a layer at decode sizes, most of it the launch); here the rows
// are already in registers, and the cache gets the very values k.y gets (the same floats rounded by
// the same store). Each cache element has one writer (a token's row, one slot lane's 8 elements),
// so no atomics; it reads v and cache_rows after pdl_wait like every other input.
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
#include "cuda/rope/rope_math.cuh"
#include "ops/registry.hpp"
#include "ops/tuning.hpp"
#include "samebits/error.hpp"
#include "samebits/ops.hpp"

namespace samebits::cuda {
namespace {
using namespace norm;

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
  // The pair's cache write (the k part's, when cache_rows is set): token t's rows of y, and of v,
  // to row cache_rows[t] (−1: none) of k_cache and v_cache.
  const int32_t* cache_rows;
  In8 v;
  Out8 k_cache, v_cache;
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

// CTA `block` of `grid` CTAs walking one tensor's steps (a grid-stride loop: which CTA takes a
// step never changes its bits). kCache: compiled with the cache write (done where p.cache_rows is
// set), the pair's k part alone.
template <class Fmt, bool kCache = false>
__device__ __forceinline__ void qk_norm_forward_ctas(const QkParams& p, const QkInvFreq& inv, int64_t block,
                                                     int64_t grid) {
  __shared__ float2 cs[QK_CS_BUFFERS * QK_CS_PAIRS];
  const int slot_lane = (threadIdx.x % 32) % p.lanes, slot = threadIdx.x / p.lanes;
  const int slots = QK_THREADS / p.lanes, tps = p.tokens_per_step;
  const int64_t col = 8 * int64_t(slot_lane), half = p.D / 2, rows = p.T * p.heads;
  const int64_t stride = grid * tps;
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
  QkRowCursor cur{block * tps, 0};
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
    // The cache write's loads, issued before the row's reduction so that they land meanwhile: the
    // token's cache row and this lane's 8 elements of v (fetched whatever the cache row: no wait on it).
    int32_t cache_row = -1;
    Raw8 raw_v{};
    if (kCache && p.cache_rows != nullptr && row < rows) {
      cache_row = p.cache_rows[cur.t0 + r / int(p.heads)];
      raw_v = fetch8<Fmt>(p.v, row * p.D + col, n);
    }
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
      if (kCache && cache_row >= 0 && n > 0) {  // the same y values, the same rounding: k.y's bits
        const int64_t at = (int64_t(cache_row) * p.heads + r % int(p.heads)) * p.D + col;  // its head there
        store8<Fmt>(p.k_cache, at, n, y);
        store_raw8<Fmt>(p.v_cache, at, n, raw_v);
      }
    }
    raw0 = raw1, raw1 = raw2;
    if (cur.j + 1 == rows_per_slot) ++step;
  }
}

template <class Fmt>
__global__ void __launch_bounds__(QK_THREADS) qk_norm_forward_kernel(const __grid_constant__ QkParams p,
                                                                     const __grid_constant__ QkInvFreq inv) {
  pdl_wait();  // launched after the previous kernel (cuda/common/pdl.cuh): its output is ready from here
  pdl_launch_dependents();
  qk_norm_forward_ctas<Fmt>(p, inv, blockIdx.x, gridDim.x);
}

// A layer's q and k in one launch: CTAs [0, q_grid) walk q's steps, the rest k's, each exactly as
// their own launch would (the same rows to a slot, the same arithmetic); the k part's CTAs make the
// cache write (kCache: an instance of its own, so that the pair without it keeps its registers).
template <class Fmt, bool kCache>
__global__ void __launch_bounds__(QK_THREADS) qk_norm_pair_forward_kernel(const __grid_constant__ QkParams q,
                                                                          const __grid_constant__ QkParams k,
                                                                          const __grid_constant__ QkInvFreq inv,
                                                                          int q_grid) {
  pdl_wait();
  pdl_launch_dependents();
  if (int(blockIdx.x) < q_grid) qk_norm_forward_ctas<Fmt>(q, inv, blockIdx.x, q_grid);
  else qk_norm_forward_ctas<Fmt, kCache>(k, inv, int64_t(blockIdx.x) - q_grid, int64_t(gridDim.x) - q_grid);
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
// `base` (optional) receives the fewest tokens whose rows fill the slots (tokens_per_step is a multiple).
QkParams qk_params(const TensorView& x, const TensorView& positions, const char* op, int64_t* base_out = nullptr) {
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
  if (base_out) *base_out = base;
  p.positions = positions.present() ? positions.as<const int32_t>() : nullptr;
  return p;
}

// A forward's parameters, and its steps (0: nothing to do).
QkParams forward_params(const TensorView& x, const TensorView& weight, const TensorView& y, const TensorView& rstd,
                        const TensorView& positions, double eps, const char* op, int64_t& steps) {
  const int64_t T = x.shape[0], heads = x.shape[1], D = x.shape[2];
  int64_t base = 1;
  QkParams p = qk_params(x, positions, op, &base);
  steps = 0;
  if (T == 0 || heads == 0) return p;
  p.x = in8(x, D);
  p.weight = in8(weight, D);
  p.y = out8(y, D);
  p.rstd_out = rstd.present() ? rstd.as<float>() : nullptr;
  p.eps = float(eps);
  // A step of no more tokens than there are (rounded up to the fewest that fill the slots): a
  // decode step's one token walks 2 rows a slot, not the 32 of a full step. Which thread takes a
  // row never changes its bits (a row's sum runs over its own slot's lanes, fixed by D).
  p.tokens_per_step = int(std::min<int64_t>(p.tokens_per_step, (T + base - 1) / base * base));
  // And, where the steps would leave SMs idle (a decode batch: 64 tokens were 8 CTAs of q and 4 of k,
  // 16 rows a slot walked one after another, 16 µs on the H100), steps of fewer tokens, down to
  // `base`: about a step a SM.
  const int64_t sms = current_sm_count(op), per_sm = (T + sms - 1) / sms;
  p.tokens_per_step = int(std::min<int64_t>(p.tokens_per_step, std::max<int64_t>(base, (per_sm + base - 1) / base * base)));
  steps = (T + p.tokens_per_step - 1) / p.tokens_per_step;
  return p;
}

// As many CTAs as fit at once, at most one a step (a grid-stride loop over the steps); `resident`
// caches the kernel's CTAs a SM.
template <class Kernel>
int64_t forward_grid(Kernel kernel, std::atomic<int> (&resident)[64], int64_t steps, const char* op) {
  return std::min<int64_t>(steps, int64_t(current_sm_count(op)) * resident_ctas(resident, kernel, QK_THREADS, op));
}

void qk_norm_forward(const Context& ctx, const QkNormForwardArgs& a) {
  const char* op = "qk_norm_forward";
  int64_t steps = 0;
  const QkParams p = forward_params(a.x, a.weight, a.y, a.rstd, a.positions, a.eps, op, steps);
  if (steps == 0) return;
  const QkInvFreq inv = p.positions ? make_inv_freq<QK_MAX_D / 2>(a.rope, a.x.shape[2]) : QkInvFreq{};
  with_shape(1, is_bf16(a.x) && is_bf16(a.y), [&](auto fmt, auto) {
    const auto kernel = qk_norm_forward_kernel<decltype(fmt)>;
    static std::atomic<int> resident[64] = {};
    const unsigned grid = unsigned(forward_grid(kernel, resident, steps, op));
    launch_after_previous(kernel, dim3(grid), dim3(QK_THREADS), 0, stream_of(ctx.stream), op, p, inv);
  });
}

void qk_norm_pair_forward(const Context& ctx, const QkNormPairForwardArgs& a) {
  const char* op = "qk_norm_pair_forward";
  int64_t q_steps = 0, k_steps = 0;
  const QkParams q = forward_params(a.q.x, a.q.weight, a.q.y, a.q.rstd, a.positions, a.eps, op, q_steps);
  QkParams k = forward_params(a.k.x, a.k.weight, a.k.y, a.k.rstd, a.positions, a.eps, op, k_steps);
  if (q_steps == 0 && k_steps == 0) return;  // a part with no rows gets no CTAs: the other takes them all
  const bool cache_write = a.cache_rows.present();
  if (cache_write) {
    const int64_t D = a.k.x.shape[2];
    k.cache_rows = a.cache_rows.as<const int32_t>();
    k.v = in8(a.v, D);
    k.k_cache = out8(a.k_cache, D);
    k.v_cache = out8(a.v_cache, D);
  }
  const QkInvFreq inv = q.positions ? make_inv_freq<QK_MAX_D / 2>(a.rope, a.q.x.shape[2]) : QkInvFreq{};
  const bool all_bf16 = is_bf16(a.q.x) && is_bf16(a.q.y) && is_bf16(a.k.x) && is_bf16(a.k.y) &&
                        (!cache_write || (is_bf16(a.v) && is_bf16(a.k_cache) && is_bf16(a.v_cache)));
  with_shape(1, all_bf16, [&](auto fmt, auto) {
    const auto launch = [&](auto cache) {  // its own resident count (a static) a kernel instance
      const auto kernel = qk_norm_pair_forward_kernel<decltype(fmt), decltype(cache)::value>;
      static std::atomic<int> resident[64] = {};
      const int64_t q_grid = q_steps == 0 ? 0 : forward_grid(kernel, resident, q_steps, op),
                    k_grid = k_steps == 0 ? 0 : forward_grid(kernel, resident, k_steps, op);
      launch_after_previous(kernel, dim3(unsigned(q_grid + k_grid)), dim3(QK_THREADS), 0, stream_of(ctx.stream), op,
                            q, k, inv, int(q_grid));
    };
    if (cache_write) launch(std::true_type{});
    else launch(std::false_type{});
  });
}

void qk_norm_backward(const Context& ctx, const QkNormBackwardArgs& a) {
  const char* op = "qk_norm_backward";
  const int64_t T = a.x.shape[0], heads = a.x.shape[1], D = a.x.shape[2];
  int64_t base = 1;
  QkParams p = qk_params(a.x, a.positions, op, &base);
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
    chain_after_chunks(p.partials, ranges, D, a.dweight.as<float>(), stream, op);
  });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(qk_norm_forward, Backend::cuda, QkNormForwardArgs, qk_norm_forward);
SAMEBITS_REGISTER_KERNEL(qk_norm_pair_forward, Backend::cuda, QkNormPairForwardArgs, qk_norm_pair_forward);
SAMEBITS_REGISTER_KERNEL(qk_norm_backward, Backend::cuda, QkNormBackwardArgs, qk_norm_backward);

}  // namespace samebits::cuda
