// CUDA causal GQA attention, backward: dQ, dK, dV over packed sequences, without atomics (mma.sync
// m16n8k16, sm_80 and later; bf16 / fp16, head_dim 64 or 128).
//
// Why this shape. FlashAttention's backward adds dQ with atomics from every key tile; the order of
// those additions follows the scheduler. Here every gradient element has one owner that sums its
// terms in an order fixed by positions alone:
//  * dK, dV: a CTA owns 64 keys of one sequence and one KV head; it walks the query heads of the
//    GQA group in ascending order and, for each, the sequence's query blocks of 64 (aligned to the
//    sequence's first query) in ascending order: dV += Pᵀ·dO, dK += dSᵀ·Q, each an mma chain over
//    the block's queries. Query blocks wholly before the keys are skipped (they see none of them).
//  * dQ: a CTA owns 64 queries of one sequence and one query head (128 in the Hopper pass,
//    attention_backward_sm90.cu) and walks the key blocks of 64 from key 0 in ascending order up
//    to its last query: dQ += dS·K.
//  * P = 2^(s·c − lse·log2 e) (c = scale·log2 e) is recomputed from the forward's lse; dS = P ∘ (dP −
//    δ) with δ = Σ dO ∘ O per row, from a small kernel (one warp a row, a fixed butterfly).
// Fragments come by ldmatrix (.trans for the [k, n] operands); the next query block (dK/dV) or key
// block (dQ) loads by cp.async while this one is used. The price of no atomics: S and dP are
// computed in both passes (7 products against FlashAttention's 5).
// P and dS are rounded to the input dtype for their MMAs (as FlashAttention does). Rows past a
// sequence's keys or queries are zero-filled when staged and masked, so cache junk (even NaN) never
// reaches a gradient. Rows no sequence covers get dq = 0 / dk = dv = 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "cuda/attention/attention_backward.cuh"
#include "cuda/attention/attention_common.cuh"
#include "cuda/attention/attention_host.hpp"
#include "cuda/common/host_upload.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "cuda/linear/gemm.cuh"
#include "ops/registry.hpp"
#include "samebits/error.hpp"
#include "samebits/ops.hpp"

namespace samebits::cuda::attention {
namespace {

constexpr int WARPS = 4, THREADS = 32 * WARPS, BLOCK = 64;
constexpr unsigned FULL = 0xffffffffu;
constexpr float LOG2E = 1.4426950408889634f;

using Tile = BwdTile;
using Params = BwdParams;

// Rows [row0, row0 + valid) of head h of a [rows, H, D] tensor into a [BLOCK, D + 8] tile; rows past
// `valid` are zeros.
template <int D>
__device__ __forceinline__ void stage_rows(uint16_t* dst, const uint16_t* src, int64_t row0, int valid, int H, int h) {
  constexpr int CHUNKS = D / 8, STRIDE = D + 8;
  for (int c = threadIdx.x; c < BLOCK * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (r < valid) x = *reinterpret_cast<const uint4*>(src + ((row0 + r) * H + h) * D + col);
    *reinterpret_cast<uint4*>(dst + r * STRIDE + col) = x;
  }
}

// The same with cp.async (16 bytes a copy, bypassing L1); the caller commits and waits.
template <int D>
__device__ __forceinline__ void stage_rows_async(uint16_t* dst, const uint16_t* src, int64_t row0, int valid, int H, int h) {
  constexpr int CHUNKS = D / 8, STRIDE = D + 8;
  for (int c = threadIdx.x; c < BLOCK * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    uint16_t* d = dst + r * STRIDE + col;
    if (r < valid) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(d))),
                   "l"(src + ((row0 + r) * H + h) * D + col)
                   : "memory");
    } else {
      *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
    }
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ uint32_t word(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// acc = A·Bᵀ for one warp: A the warp's 16 rows of an smem tile (ldmatrix row address a_rows, as
// set up by the caller), B the 64 rows of another (b_tile at this lane's b_row / b_col), over D.
template <class T, int D>
__device__ __forceinline__ void rows_times_tile(float (&acc)[BLOCK / 8][4], const uint16_t* a_rows,
                                                const uint16_t* b_tile) {
#pragma unroll 2
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    ldsm_x4(a, a_rows + kk * 16);
#pragma unroll
    for (int nt = 0; nt < BLOCK / 8; nt += 2) {
      uint32_t b[4];
      ldsm_x4(b, b_tile + nt * 8 * (D + 8) + kk * 16);
      mma16816<T>(acc[nt], a, b[0], b[1]);
      mma16816<T>(acc[nt + 1], a, b[2], b[3]);
    }
  }
}

// The A fragment of k-step ks16 (16 columns) of a warp's accumulator tile, rounded to T.
template <class T>
__device__ __forceinline__ void a_fragment(uint32_t (&a)[4], const float (&x)[BLOCK / 8][4], int ks16) {
  a[0] = pack2<T>(x[2 * ks16][0], x[2 * ks16][1]);
  a[1] = pack2<T>(x[2 * ks16][2], x[2 * ks16][3]);
  a[2] = pack2<T>(x[2 * ks16 + 1][0], x[2 * ks16 + 1][1]);
  a[3] = pack2<T>(x[2 * ks16 + 1][2], x[2 * ks16 + 1][3]);
}

// acc += a·B for one 16-row k-step of a [k, D] smem tile: a the warp's A fragment, b_rows the step's
// first row at this lane's ldmatrix row / column (t_row, t_col).
template <class T, int D>
__device__ __forceinline__ void fragment_times_rows(float (&acc)[D / 8][4], const uint32_t (&a)[4], const uint16_t* b_rows) {
#pragma unroll
  for (int dn = 0; dn < D / 8; dn += 2) {
    uint32_t b[4];
    ldsm_x4_trans(b, b_rows + dn * 8);
    mma16816<T>(acc[dn], a, b[0], b[1]);
    mma16816<T>(acc[dn + 1], a, b[2], b[3]);
  }
}

// An [n, D] gradient row pair (columns col, col + 1) in its dtype (16-bit T or fp32).
template <class T>
__device__ __forceinline__ void store_pair(void* base, bool f32, int64_t at, float a, float b) {
  if (f32) *reinterpret_cast<float2*>(static_cast<float*>(base) + at) = make_float2(a, b);
  else *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(base) + at) = pack2<T>(a, b);
}

// δ = Σ_d dO ∘ O (fp32) and lse·log2(e), one warp a (row, head).
template <class T, int D>
__global__ void attention_delta_kernel(const uint16_t* out, const uint16_t* dout, const float* lse, float* lse2,
                                       float* delta, int64_t rows) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < D / 64; ++i) {
    const int col = (i * 32 + lane) * 2;
    const uint32_t o = word(out + row * D + col), g = word(dout + row * D + col);
    float2 of, gf;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      of = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o));
      gf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&g));
    } else {
      of = __half22float2(*reinterpret_cast<const __half2*>(&o));
      gf = __half22float2(*reinterpret_cast<const __half2*>(&g));
    }
    acc = __fadd_rn(acc, __fadd_rn(__fmul_rn(of.x, gf.x), __fmul_rn(of.y, gf.y)));
  }
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(FULL, acc, m));
  if (lane == 0) {
    delta[row] = acc;
    lse2[row] = __fmul_rn(lse[row], LOG2E);
  }
}

// Shared memory of the dK/dV kernel: K, V, and two buffers of Q, dO, lse, δ (the next query block
// loads while this one is used); of the dQ kernel: two buffers of K and V.
template <int D>
struct DkdvSmem {
  static constexpr int STRIDE = D + 8, TILE = BLOCK * STRIDE;
  static constexpr size_t BYTES = size_t(6) * TILE * 2 + 4 * BLOCK * sizeof(float);
};
template <int D>
struct DqSmem {
  static constexpr int STRIDE = D + 8, TILE = BLOCK * STRIDE;
  static constexpr size_t BYTES = size_t(4) * TILE * 2;
};

template <class T, int D>
__global__ void __launch_bounds__(THREADS) attention_dkdv_kernel(const __grid_constant__ Params p) {
  constexpr int STRIDE = D + 8, TILE = BLOCK * STRIDE;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t *ks = smem, *vs = ks + TILE, *qs2 = vs + TILE, *dos2 = qs2 + 2 * TILE;
  float* lse_s2 = reinterpret_cast<float*>(dos2 + 2 * TILE);
  float* delta_s2 = lse_s2 + 2 * BLOCK;
  const Tile t = p.tiles[blockIdx.x];
  const int hk = blockIdx.y, G = p.Hq / p.Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, qd = (lane % 4) * 2;
  const int valid_k = min(BLOCK, t.k_len - t.first);
  stage_rows<D>(ks, p.k, int64_t(t.k_row) + t.first, valid_k, p.Hkv, hk);
  stage_rows<D>(vs, p.v, int64_t(t.k_row) + t.first, valid_k, p.Hkv, hk);
  const int key_a = t.first + warp * 16 + r, key_b = key_a + 8;  // this thread's two keys (= positions)
  const int qoff = t.k_len - t.q_len;
  const int qb_begin = max(0, t.first - qoff) / BLOCK * BLOCK;  // the first block with a query that sees the keys
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  // ldmatrix row addresses of this lane: A fragments of the warp's 16 rows (a_row, a_col), B
  // fragments of two n-tiles of an [n, k] tile (b_row, b_col) and of a [k, n] tile (t_row, t_col).
  const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;
  const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;
  const int t_row = a_row, t_col = a_col;
  const uint16_t* krow = ks + (warp * 16 + a_row) * STRIDE + a_col;
  const uint16_t* vrow = vs + (warp * 16 + a_row) * STRIDE + a_col;

  // Steps n = 0 … steps − 1: query head hk·G + n / blocks, query block qb_begin + 64 · (n % blocks).
  const int blocks = (t.q_len - qb_begin + BLOCK - 1) / BLOCK, steps = G * blocks;
  auto load = [&](int n) {  // step n's Q, dO, lse, δ into buffer n % 2
    const int buf = n % 2, h = hk * G + n / blocks, qb = qb_begin + (n % blocks) * BLOCK;
    const int valid_q = min(BLOCK, t.q_len - qb);
    stage_rows_async<D>(qs2 + buf * TILE, p.q, int64_t(t.q_row) + qb, valid_q, p.Hq, h);
    stage_rows_async<D>(dos2 + buf * TILE, p.dout, int64_t(t.q_row) + qb, valid_q, p.Hq, h);
    if (threadIdx.x < BLOCK) {
      const bool live = int(threadIdx.x) < valid_q;
      const int64_t at = (int64_t(t.q_row) + qb + threadIdx.x) * p.Hq + h;
      lse_s2[buf * BLOCK + threadIdx.x] = live ? p.lse2[at] : 0.0f;
      delta_s2[buf * BLOCK + threadIdx.x] = live ? p.delta[at] : 0.0f;
    }
    cp_async_commit();
  };
  load(0);
  for (int n = 0; n < steps; ++n) {
    {
      if (n + 1 < steps) {
        load(n + 1);  // the buffer step n − 1 used: free since the barrier that ended it
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const int buf = n % 2, qb = qb_begin + (n % blocks) * BLOCK;
      const uint16_t* qs = qs2 + buf * TILE;
      const uint16_t* dos = dos2 + buf * TILE;
      const float* lse_s = lse_s2 + buf * BLOCK;
      const float* delta_s = delta_s2 + buf * BLOCK;
      // Sᵀ = K·Qᵀ: the warp's 16 keys × the block's 64 queries.
      float s[BLOCK / 8][4] = {};
      rows_times_tile<T, D>(s, krow, qs + b_row * STRIDE + b_col);
      // Pᵀ = 2^(s·c − lse·log2 e) where the query sees the key, else 0.
#pragma unroll
      for (int nt = 0; nt < BLOCK / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nt * 8 + qd + (e & 1), qi = qb + col;
          const bool seen = qi < t.q_len && (e < 2 ? key_a : key_b) <= qoff + qi;
          s[nt][e] = seen ? exp2_ftz(__fmaf_rn(s[nt][e], p.c2, -lse_s[col])) : 0.0f;
        }
      // dPᵀ = V·dOᵀ
      float dp[BLOCK / 8][4] = {};
      rows_times_tile<T, D>(dp, vrow, dos + b_row * STRIDE + b_col);
      // dSᵀ = Pᵀ ∘ (dPᵀ − δ), then dV += Pᵀ·dO and dK += dSᵀ·Q over the block's queries.
#pragma unroll
      for (int nt = 0; nt < BLOCK / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dp[nt][e] = __fmul_rn(s[nt][e], __fsub_rn(dp[nt][e], delta_s[nt * 8 + qd + (e & 1)]));
#pragma unroll
      for (int ks16 = 0; ks16 < BLOCK / 16; ++ks16) {
        uint32_t pa[4], da[4];
        a_fragment<T>(pa, s, ks16);
        a_fragment<T>(da, dp, ks16);
        fragment_times_rows<T, D>(dv, pa, dos + (ks16 * 16 + t_row) * STRIDE + t_col);
        fragment_times_rows<T, D>(dk, da, qs + (ks16 * 16 + t_row) * STRIDE + t_col);
      }
    }
    __syncthreads();  // step n's buffer is read by all before step n + 2 reloads it
  }
  auto store_key = [&](int key, bool second) {
    if (key >= t.k_len) return;
    const int64_t row = (int64_t(t.k_row) + key) * p.Hkv + hk;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      const int64_t at = row * D + dn * 8 + qd;
      const int e = second ? 2 : 0;
      store_pair<T>(p.dk, p.dk_f32, at, __fmul_rn(dk[dn][e], p.scale), __fmul_rn(dk[dn][e + 1], p.scale));
      store_pair<T>(p.dv, p.dv_f32, at, dv[dn][e], dv[dn][e + 1]);
    }
  };
  store_key(key_a, false);
  store_key(key_b, true);
}

template <class T, int D>
__global__ void __launch_bounds__(THREADS) attention_dq_kernel(const __grid_constant__ Params p) {
  constexpr int STRIDE = D + 8, TILE = BLOCK * STRIDE;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t *ks2 = smem, *vs2 = ks2 + 2 * TILE;
  const Tile t = p.tiles[blockIdx.x];
  const int h = blockIdx.y, hk = h / (p.Hq / p.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, qd = (lane % 4) * 2;
  const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;  // ldmatrix rows (as dK/dV)
  const int t_row = (lane % 8) + ((lane / 8) % 2) * 8, t_col = (lane / 16) * 8;
  const int qoff = t.k_len - t.q_len;
  const int ia = t.first + warp * 16 + r, ib = ia + 8;  // this thread's two queries (index in the sequence)
  const bool live_a = ia < t.q_len, live_b = ib < t.q_len;
  const int pos_a = qoff + ia, pos_b = qoff + ib;
  auto at_row = [&](int i) { return (int64_t(t.q_row) + i) * p.Hq + h; };
  uint32_t qa[D / 16][4], ga[D / 16][4];  // A fragments of Q and dO
  auto frag = [&](const uint16_t* src, int i, bool live, int col) -> uint32_t {
    return live ? word(src + at_row(i) * D + col) : 0u;
  };
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk * 16 + qd;
    qa[kk][0] = frag(p.q, ia, live_a, c), qa[kk][1] = frag(p.q, ib, live_b, c);
    qa[kk][2] = frag(p.q, ia, live_a, c + 8), qa[kk][3] = frag(p.q, ib, live_b, c + 8);
    ga[kk][0] = frag(p.dout, ia, live_a, c), ga[kk][1] = frag(p.dout, ib, live_b, c);
    ga[kk][2] = frag(p.dout, ia, live_a, c + 8), ga[kk][3] = frag(p.dout, ib, live_b, c + 8);
  }
  const float lse_a = live_a ? p.lse2[at_row(ia)] : 0.0f, lse_b = live_b ? p.lse2[at_row(ib)] : 0.0f;
  const float del_a = live_a ? p.delta[at_row(ia)] : 0.0f, del_b = live_b ? p.delta[at_row(ib)] : 0.0f;
  float dq[D / 8][4] = {};
  const int last_pos = qoff + min(t.first + BLOCK, t.q_len) - 1;
  const int steps = last_pos / BLOCK + 1;  // key blocks 0 … steps − 1
  auto load = [&](int kb) {  // key block kb into buffer kb % 2
    const int valid = min(BLOCK, t.k_len - kb * BLOCK);
    stage_rows_async<D>(ks2 + (kb % 2) * TILE, p.k, int64_t(t.k_row) + kb * BLOCK, valid, p.Hkv, hk);
    stage_rows_async<D>(vs2 + (kb % 2) * TILE, p.v, int64_t(t.k_row) + kb * BLOCK, valid, p.Hkv, hk);
    cp_async_commit();
  };
  load(0);
  for (int kb = 0; kb < steps; ++kb) {
    if (kb + 1 < steps) {
      load(kb + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint16_t* ks = ks2 + (kb % 2) * TILE;
    const uint16_t* vs = vs2 + (kb % 2) * TILE;
    float s[BLOCK / 8][4] = {}, dp[BLOCK / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int nt = 0; nt < BLOCK / 8; nt += 2) {
        uint32_t b[4];
        ldsm_x4(b, ks + (nt * 8 + b_row) * STRIDE + kk * 16 + b_col);
        mma16816<T>(s[nt], qa[kk], b[0], b[1]);
        mma16816<T>(s[nt + 1], qa[kk], b[2], b[3]);
        ldsm_x4(b, vs + (nt * 8 + b_row) * STRIDE + kk * 16 + b_col);
        mma16816<T>(dp[nt], ga[kk], b[0], b[1]);
        mma16816<T>(dp[nt + 1], ga[kk], b[2], b[3]);
      }
    // dS = P ∘ (dP − δ), P = 2^(s·c − lse·log2 e) where the query sees the key.
#pragma unroll
    for (int nt = 0; nt < BLOCK / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool second = e >= 2;
        const int key = kb * BLOCK + nt * 8 + qd + (e & 1);
        const bool seen = (second ? live_b : live_a) && key <= (second ? pos_b : pos_a);
        const float pr = seen ? exp2_ftz(__fmaf_rn(s[nt][e], p.c2, -(second ? lse_b : lse_a))) : 0.0f;
        dp[nt][e] = __fmul_rn(pr, __fsub_rn(dp[nt][e], second ? del_b : del_a));
      }
    // dQ += dS·K over the block's keys.
#pragma unroll
    for (int ks16 = 0; ks16 < BLOCK / 16; ++ks16) {
      uint32_t da[4];
      a_fragment<T>(da, dp, ks16);
      fragment_times_rows<T, D>(dq, da, ks + (ks16 * 16 + t_row) * STRIDE + t_col);
    }
    __syncthreads();  // block kb's buffer is read by all before block kb + 2 reloads it
  }
  auto store_query = [&](int i, bool live, bool second) {
    if (!live) return;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      const int e = second ? 2 : 0;
      store_pair<T>(p.dq, p.dq_f32, at_row(i) * D + dn * 8 + qd, __fmul_rn(dq[dn][e], p.scale),
                    __fmul_rn(dq[dn][e + 1], p.scale));
    }
  };
  store_query(ia, live_a, false);
  store_query(ib, live_b, true);
}

// Zeroes the rows of t ([rows, H, D]) outside the ranges.
void clear_uncovered(const TensorView& t, const std::vector<std::pair<int64_t, int64_t>>& ranges, cudaStream_t stream,
                     const char* op) {
  const size_t row_bytes = size_t(t.shape[1] * t.shape[2]) * dtype_size(t.dtype);
  for_each_uncovered(ranges, t.shape[0], [&](int64_t begin, int64_t end) {
    check(cudaMemsetAsync(static_cast<char*>(t.data) + size_t(begin) * row_bytes, 0, size_t(end - begin) * row_bytes,
                          stream),
          op, "clear rows");
  });
}

template <class T, int D>
void run_backward(const Context& ctx, const AttentionBackwardArgs& a, cudaStream_t stream, const char* op) {
  const int64_t Tq = a.q.shape[0], Hq = a.q.shape[1], Hkv = a.k.shape[1];
  ScratchBuffer stats(size_t(Tq * Hq) * 2 * sizeof(float), stream, op);
  float* lse2 = stats.as<float>();
  float* delta = lse2 + Tq * Hq;
  // lse: the forward's, or recomputed by the forward (into scratch lse and out).
  const bool recompute = !a.lse.present();
  ScratchBuffer lse_buf(recompute ? size_t(Tq * Hq) * sizeof(float) : 0, stream, op);
  ScratchBuffer out_buf(recompute ? size_t(a.out.numel()) * dtype_size(a.out.dtype) : 0, stream, op);
  if (recompute) {
    AttentionForwardArgs f;
    f.q = a.q, f.k = a.k, f.v = a.v, f.seqs = a.seqs, f.scale = a.scale;
    f.out = a.out;
    f.out.data = out_buf.as<void>();
    f.lse = TensorView::of(lse_buf.as<float>(), DType::f32, {Tq, Hq});
    f.lse.device = Device::cuda;
    samebits::attention_forward(ctx, f);
  }
  const float* lse = recompute ? lse_buf.as<const float>() : a.lse.as<const float>();
  const int64_t rows = Tq * Hq;
  attention_delta_kernel<T, D><<<unsigned((rows + 7) / 8), 256, 0, stream>>>(a.out.as<const uint16_t>(), a.dout.as<const uint16_t>(),
                                                                              lse, lse2, delta, rows);
  check(cudaGetLastError(), op, "delta kernel launch");

  const auto* s = a.seqs.as<const int32_t>();
  // The dK/dV and dQ passes: the Hopper kernels (128-key / 128-query tiles) where the device has
  // them, else the portable ones (64-row tiles); the device decides, never the shapes.
  const bool hopper = sm90_path_available();
  const int kv_keys = hopper ? DKDV_SM90_KEYS : BLOCK, q_queries = hopper ? DQ_SM90_QUERIES : BLOCK;
  std::vector<Tile> kv_tiles, q_tiles;
  std::vector<std::pair<int64_t, int64_t>> q_cover, k_cover;
  for (int64_t b = 0; b < a.seqs.shape[0]; ++b) {
    const int32_t q_row = s[4 * b], q_len = s[4 * b + 1], k_row = s[4 * b + 2], k_len = s[4 * b + 3];
    for (int32_t f = 0; f < k_len; f += kv_keys) kv_tiles.push_back({q_row, q_len, k_row, k_len, f});
    for (int32_t f = 0; f < q_len; f += q_queries) q_tiles.push_back({q_row, q_len, k_row, k_len, f});
    q_cover.emplace_back(q_row, int64_t(q_row) + q_len);
    k_cover.emplace_back(k_row, int64_t(k_row) + k_len);
  }
  clear_uncovered(a.dq, q_cover, stream, op);
  clear_uncovered(a.dk, k_cover, stream, op);
  clear_uncovered(a.dv, k_cover, stream, op);
  // The longest tiles first (which CTA runs a tile never changes its arithmetic): dK/dV tiles of
  // early keys see the most queries, dQ tiles of late queries the most keys.
  std::stable_sort(kv_tiles.begin(), kv_tiles.end(), [](const Tile& x, const Tile& y) {
    return x.q_len - (x.first - (x.k_len - x.q_len)) > y.q_len - (y.first - (y.k_len - y.q_len));
  });
  std::stable_sort(q_tiles.begin(), q_tiles.end(), [](const Tile& x, const Tile& y) {
    return x.k_len - x.q_len + x.first > y.k_len - y.q_len + y.first;
  });
  std::vector<Tile> all(kv_tiles);
  all.insert(all.end(), q_tiles.begin(), q_tiles.end());
  ScratchBuffer table(all.size() * sizeof(Tile), stream, op);
  upload_to_device(table.as<Tile>(), all.data(), all.size() * sizeof(Tile), stream, op, "tile table");
  Params p{};
  p.q = a.q.as<const uint16_t>(), p.k = a.k.as<const uint16_t>(), p.v = a.v.as<const uint16_t>();
  p.dout = a.dout.as<const uint16_t>();
  p.lse2 = lse2, p.delta = delta;
  p.dq = a.dq.data, p.dk = a.dk.data, p.dv = a.dv.data;
  p.dq_f32 = a.dq.dtype == DType::f32, p.dk_f32 = a.dk.dtype == DType::f32, p.dv_f32 = a.dv.dtype == DType::f32;
  p.Hq = int(Hq), p.Hkv = int(Hkv);
  const double scale = a.scale > 0 ? a.scale : 1.0 / std::sqrt(double(D));
  p.scale = float(scale), p.c2 = float(scale * 1.4426950408889634);
  p.tiles = table.as<const Tile>();
  if (hopper) {
    attention_dkdv_sm90(a, p, int(kv_tiles.size()), stream, op);
  } else {
    static std::atomic<int> smem_allowed[64] = {};
    allow_dynamic_smem(attention_dkdv_kernel<T, D>, DkdvSmem<D>::BYTES, smem_allowed, op);
    attention_dkdv_kernel<T, D><<<dim3(unsigned(kv_tiles.size()), unsigned(Hkv)), THREADS, DkdvSmem<D>::BYTES, stream>>>(p);
    check(cudaGetLastError(), op, "dK/dV kernel launch");
  }
  p.tiles = table.as<const Tile>() + kv_tiles.size();
  if (hopper) {
    attention_dq_sm90(a, p, int(q_tiles.size()), stream, op);
  } else {
    static std::atomic<int> dq_smem_allowed[64] = {};
    allow_dynamic_smem(attention_dq_kernel<T, D>, DqSmem<D>::BYTES, dq_smem_allowed, op);
    attention_dq_kernel<T, D><<<dim3(unsigned(q_tiles.size()), unsigned(Hq)), THREADS, DqSmem<D>::BYTES, stream>>>(p);
    check(cudaGetLastError(), op, "dQ kernel launch");
  }
  // The scratch buffers are freed in stream order, after the kernels.
}

void attention_backward(const Context& ctx, const AttentionBackwardArgs& a) {
  const char* op = "attention_backward";
  require_kernel_shapes(op, a.q, {{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"out", &a.out}, {"dout", &a.dout},
                                  {"dq", &a.dq}, {"dk", &a.dk}, {"dv", &a.dv}});
  if (a.out.dtype != a.q.dtype || a.dout.dtype != a.q.dtype)
    throw Unsupported(op, "dout", "the CUDA attention backward takes out and dout in q's dtype");
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"dq", &a.dq}, {"dk", &a.dk}, {"dv", &a.dv}})
    if (t->dtype != a.q.dtype && t->dtype != DType::f32)
      throw Unsupported(op, name, "the CUDA attention backward writes gradients in q's dtype or fp32");
  const cudaStream_t stream = stream_of(ctx.stream);
  dispatch_type_and_head_dim(a.q.dtype, a.q.shape[2], [&](auto t, auto d) {
    run_backward<decltype(t), decltype(d)::value>(ctx, a, stream, op);
  });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(attention_backward, Backend::cuda, AttentionBackwardArgs, attention_backward);

}  // namespace samebits::cuda::attention
