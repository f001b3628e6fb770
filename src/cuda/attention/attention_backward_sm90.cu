// CUDA attention backward, the dK/dV and dQ passes on Hopper (sm_90a): TMA + wgmma.
//
// Why this shape. The pass is four products per query block, all of which wgmma takes from shared
// memory as they are loaded: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ read Q and dO as K-major B operands, and
// dV += Pᵀ·dO, dK += dSᵀ·Q read the same tiles as N-major B operands, with Pᵀ and dSᵀ in registers
// (the accumulator layout of Sᵀ / dPᵀ is the A fragment). A CTA owns 128 keys of one sequence and
// one KV head: two consumer warpgroups of 64 keys each, and a producer warp that loads K and V once
// and then Q, dO, lse and δ of each query block into a 2-stage ring. The order of the terms is the
// portable pass's: the GQA group's heads ascending, the sequence's query blocks of 64 (aligned to
// its first query) ascending, 16 queries a k-step. The sequence's last query block is loaded with
// plain loads and the rows past its queries zeroed (0 · NaN would reach dV and dK otherwise).
// No atomics: each dK / dV element has one owner thread.
//
// The dQ pass mirrors it: three products per key block, all wgmma: S = Q·Kᵀ and dP = dO·Vᵀ read the
// block's K and V as K-major B operands (Q and dO, loaded once, are the A operands), and dQ += dS·K
// reads the same K tile as an N-major B operand with dS in registers. A CTA owns 128 queries of one
// sequence and one query head (two consumer warpgroups of 64) and a producer warp loads Q and dO
// once, then the key blocks of 64 from key 0 ascending into a 4-stage ring: the portable pass's
// order of terms (16 keys a k-step). The block holding the sequence's last key is loaded with plain
// loads and its rows past the keys zeroed (dS is 0 there, and 0 · NaN would reach dQ). No atomics:
// each dQ element has one owner thread.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>

#include "cuda/attention/attention_backward.cuh"
#include "cuda/attention/attention_common.cuh"
#include "cuda/attention/attention_host.hpp"
#include "cuda/common/runtime.cuh"
#include "cuda/common/sm90/primitives.cuh"
#include "cuda/common/sm90/tma.cuh"
#include "samebits/error.hpp"

namespace samebits::cuda::attention {
namespace {

using namespace sm90;

constexpr int KEYS = DKDV_SM90_KEYS, BQ = 64, STAGES = 2, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
static_assert(KEYS == 64 * CONSUMERS, "a consumer warpgroup owns 64 keys");

struct Maps {
  CUtensorMap q, dout, k, v;  // boxes {64, 1, 64} of [tokens, heads, D]
};

template <int D>
struct Smem {
  static constexpr int BOXES = D / 64, BOX = 64 * 128;  // 64 rows of 128 bytes
  static constexpr int KV_BYTES = KEYS * D * 2, STAGE_BYTES = 2 * BQ * D * 2;  // K (or V); Q + dO
  static constexpr size_t BYTES = size_t(2) * KV_BYTES + STAGES * STAGE_BYTES + STAGES * 2 * BQ * sizeof(float) +
                                  (1 + 2 * STAGES) * 8 + 1024;
  static_assert(BYTES <= 227 * 1024, "shared memory of one Hopper CTA");
};

template <class T, int D>
__global__ void __launch_bounds__(THREADS, 1)
    attention_dkdv_sm90_kernel(const __grid_constant__ Maps maps, const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Smem<D>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sk = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* sv = sk + S::KV_BYTES;
  uint8_t* stages = sv + S::KV_BYTES;  // stage s: Q (BOXES boxes), then dO
  float* stats = reinterpret_cast<float*>(stages + STAGES * S::STAGE_BYTES);  // stage s: lse2[64], δ[64]
  uint64_t* full_kv = reinterpret_cast<uint64_t*>(stats + STAGES * 2 * BQ);
  uint64_t* full = full_kv + 1;
  uint64_t* empty = full + STAGES;
  const BwdTile t = p.tiles[blockIdx.x];
  const int hk = blockIdx.y, G = p.Hq / p.Hkv;
  const int valid_k = min(KEYS, t.k_len - t.first), consumers = valid_k > 64 ? 2 : 1;
  const int qoff = t.k_len - t.q_len;
  const int qb_begin = max(0, t.first - qoff) / BQ * BQ;
  const int blocks = (t.q_len - qb_begin + BQ - 1) / BQ, steps = G * blocks;
  if (threadIdx.x == 0) {
    mbar_init(full_kv, 1);
    for (int s = 0; s < STAGES; ++s) {
      // full: the Q / dO bytes (or the producer's own stores), then each producer lane's lse / δ;
      // empty: every consumer thread, after its last read of the stage (plain loads of lse / δ too).
      mbar_init(&full[s], 1 + 32);
      mbar_init(&empty[s], uint32_t(consumers * 128));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;

  if (wg == 0) {  // producer: warp 0 loads, warps 1-3 leave
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    if (lane == 0) {
      mbar_expect_tx(full_kv, uint32_t(2 * consumers * 64 * D * 2));
      for (int c = 0; c < consumers; ++c)
        for (int b = 0; b < S::BOXES; ++b) {
          tma_load_3d(sk + (c * S::BOXES + b) * S::BOX, &maps.k, b * 64, hk, t.k_row + t.first + c * 64, full_kv);
          tma_load_3d(sv + (c * S::BOXES + b) * S::BOX, &maps.v, b * 64, hk, t.k_row + t.first + c * 64, full_kv);
        }
    }
    for (int n = 0; n < steps; ++n) {
      const int st = n % STAGES, h = hk * G + n / blocks, qb = qb_begin + (n % blocks) * BQ;
      if (n >= STAGES) mbar_wait(&empty[st], ((n / STAGES) - 1) & 1);
      uint8_t* sq = stages + st * S::STAGE_BYTES;
      uint8_t* sdo = sq + S::BOXES * S::BOX;
      const int valid_q = min(BQ, t.q_len - qb);
      if (valid_q == BQ) {
        if (lane == 0) {
          mbar_expect_tx(&full[st], uint32_t(S::STAGE_BYTES));
          for (int b = 0; b < S::BOXES; ++b) {
            tma_load_3d(sq + b * S::BOX, &maps.q, b * 64, h, t.q_row + qb, &full[st]);
            tma_load_3d(sdo + b * S::BOX, &maps.dout, b * 64, h, t.q_row + qb, &full[st]);
          }
        }
      } else {  // the sequence's last block: plain loads into the swizzled layout, rows past the end zeroed
        constexpr int CHUNKS = S::BOXES * 8;
        for (int idx = lane; idx < BQ * CHUNKS; idx += 32) {
          const int r = idx / CHUNKS, b = (idx % CHUNKS) / 8, ch = idx % 8;
          uint4 qv = make_uint4(0, 0, 0, 0), gv = qv;
          if (r < valid_q) {
            const int64_t at = ((int64_t(t.q_row) + qb + r) * p.Hq + h) * D + b * 64 + ch * 8;
            qv = *reinterpret_cast<const uint4*>(p.q + at);
            gv = *reinterpret_cast<const uint4*>(p.dout + at);
          }
          const int off = b * S::BOX + r * 128 + ((ch ^ (r & 7)) * 16);
          *reinterpret_cast<uint4*>(sq + off) = qv;
          *reinterpret_cast<uint4*>(sdo + off) = gv;
        }
        fence_async_shared();
        __syncwarp();
        if (lane == 0) mbar_arrive(&full[st]);
      }
      float* ls = stats + st * 2 * BQ;
      for (int r = lane; r < BQ; r += 32) {
        const bool live = r < valid_q;
        const int64_t at = (int64_t(t.q_row) + qb + r) * p.Hq + h;
        ls[r] = live ? p.lse2[at] : 0.0f;
        ls[BQ + r] = live ? p.delta[at] : 0.0f;
      }
      mbar_arrive(&full[st]);
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1;
  if (c >= consumers) return;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, quad_col = (lane % 4) * 2;
  const int key0 = t.first + c * 64 + warp * 16 + lane / 4, key1 = key0 + 8;  // this thread's keys (= positions)
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;
  const uint8_t* ka = sk + c * S::BOXES * S::BOX;
  const uint8_t* va = sv + c * S::BOXES * S::BOX;
  mbar_wait(full_kv, 0);
  for (int n = 0; n < steps; ++n) {
    const int st = n % STAGES, qb = qb_begin + (n % blocks) * BQ;
    const uint8_t* sq = stages + st * S::STAGE_BYTES;
    const uint8_t* sdo = sq + S::BOXES * S::BOX;
    const float* ls = stats + st * 2 * BQ;
    mbar_wait(&full[st], (n / STAGES) & 1);
    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: 64 keys × 64 queries each.
    float s[BQ / 2], dp[BQ / 2];
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int box = (kk / 4) * S::BOX, step = (kk % 4) * 2;
      Wgmma<T, false, false, BQ>::mma(s, smem_desc(ka + box) + step, smem_desc(sq + box) + step, kk > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int box = (kk / 4) * S::BOX, step = (kk % 4) * 2;
      Wgmma<T, false, false, BQ>::mma(dp, smem_desc(va + box) + step, smem_desc(sdo + box) + step, kk > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    // Pᵀ = 2^(s·c − lse·log2 e) where the query sees the key, else 0.
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = j * 8 + quad_col + (e & 1), qi = qb + col;
        const bool seen = qi < t.q_len && (e < 2 ? key0 : key1) <= qoff + qi;
        s[j * 4 + e] = seen ? exp2_ftz(__fmaf_rn(s[j * 4 + e], p.c2, -ls[col])) : 0.0f;
      }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    // dSᵀ = Pᵀ ∘ (dPᵀ − δ)
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dp[j * 4 + e] = __fmul_rn(s[j * 4 + e], __fsub_rn(dp[j * 4 + e], ls[BQ + j * 8 + quad_col + (e & 1)]));
    // dV += Pᵀ·dO, dK += dSᵀ·Q over the block's queries, 16 a k-step.
    uint32_t pa[BQ / 16][4], da[BQ / 16][4];
#pragma unroll
    for (int kt = 0; kt < BQ / 16; ++kt) {
      pa[kt][0] = pack2<T>(s[kt * 8 + 0], s[kt * 8 + 1]), pa[kt][1] = pack2<T>(s[kt * 8 + 2], s[kt * 8 + 3]);
      pa[kt][2] = pack2<T>(s[kt * 8 + 4], s[kt * 8 + 5]), pa[kt][3] = pack2<T>(s[kt * 8 + 6], s[kt * 8 + 7]);
      da[kt][0] = pack2<T>(dp[kt * 8 + 0], dp[kt * 8 + 1]), da[kt][1] = pack2<T>(dp[kt * 8 + 2], dp[kt * 8 + 3]);
      da[kt][2] = pack2<T>(dp[kt * 8 + 4], dp[kt * 8 + 5]), da[kt][3] = pack2<T>(dp[kt * 8 + 6], dp[kt * 8 + 7]);
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kt = 0; kt < BQ / 16; ++kt) WgmmaRS<T, true, D>::mma(dv, pa[kt], smem_desc_mn(sdo + kt * 16 * 128));
#pragma unroll
    for (int kt = 0; kt < BQ / 16; ++kt) WgmmaRS<T, true, D>::mma(dk, da[kt], smem_desc_mn(sq + kt * 16 * 128));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    mbar_arrive(&empty[st]);
  }

  auto store_key = [&](int key, int half) {
    if (key >= t.k_len) return;
    const int64_t row = (int64_t(t.k_row) + key) * p.Hkv + hk;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int i = j * 4 + half * 2;
      const int64_t at = row * D + j * 8 + quad_col;
      if (p.dk_f32) {
        *reinterpret_cast<float2*>(static_cast<float*>(p.dk) + at) =
            make_float2(__fmul_rn(dk[i], p.scale), __fmul_rn(dk[i + 1], p.scale));
      } else {
        *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.dk) + at) =
            pack2<T>(__fmul_rn(dk[i], p.scale), __fmul_rn(dk[i + 1], p.scale));
      }
      if (p.dv_f32) *reinterpret_cast<float2*>(static_cast<float*>(p.dv) + at) = make_float2(dv[i], dv[i + 1]);
      else *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.dv) + at) = pack2<T>(dv[i], dv[i + 1]);
    }
  };
  store_key(key0, 0);
  store_key(key1, 1);
#endif
}

// ---------------------------------------------------------------- the dQ pass
constexpr int DQ_KEYS = 64, DQ_STAGES = 4;
static_assert(DQ_SM90_QUERIES == 64 * CONSUMERS, "a consumer warpgroup owns 64 queries");

template <int D>
struct DqSmem {
  static constexpr int BOXES = D / 64, BOX = 64 * 128;  // 64 rows of 128 bytes
  static constexpr int QD_BYTES = 2 * DQ_SM90_QUERIES * D * 2, STAGE_BYTES = 2 * DQ_KEYS * D * 2;  // Q + dO; K + V
  static constexpr size_t BYTES = size_t(QD_BYTES) + DQ_STAGES * STAGE_BYTES + (1 + 2 * DQ_STAGES) * 8 + 1024;
  static_assert(BYTES <= 227 * 1024, "shared memory of one Hopper CTA");
};

template <class T, int D>
__global__ void __launch_bounds__(THREADS, 1)
    attention_dq_sm90_kernel(const __grid_constant__ Maps maps, const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = DqSmem<D>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sq = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* sdo = sq + CONSUMERS * S::BOXES * S::BOX;
  uint8_t* stages = sdo + CONSUMERS * S::BOXES * S::BOX;  // stage s: K (BOXES boxes), then V
  uint64_t* full_qd = reinterpret_cast<uint64_t*>(stages + DQ_STAGES * S::STAGE_BYTES);
  uint64_t* full = full_qd + 1;
  uint64_t* empty = full + DQ_STAGES;
  const BwdTile t = p.tiles[blockIdx.x];
  const int h = blockIdx.y, hk = h / (p.Hq / p.Hkv);
  const int valid_q = min(DQ_SM90_QUERIES, t.q_len - t.first), consumers = valid_q > 64 ? 2 : 1;
  const int qoff = t.k_len - t.q_len;
  const int steps = (qoff + t.first + valid_q - 1) / DQ_KEYS + 1;  // key blocks 0 … up to the tile's last query
  if (threadIdx.x == 0) {
    mbar_init(full_qd, 1);
    for (int s = 0; s < DQ_STAGES; ++s) {
      mbar_init(&full[s], 1);                          // the K / V bytes, or the producer's own stores
      mbar_init(&empty[s], uint32_t(consumers * 128));  // every consumer thread, after its last read
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;

  // Registers: 56 for the producer (its plain loads of the last block want more than 40), 224 for
  // the consumers — 56 + 2 · 224 = 504 a thread slot, the CTA's 168 · 3.
  if (wg == 0) {  // producer: warp 0 loads, warps 1-3 leave
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    if (lane == 0) {  // Q and dO of the tile (rows past the sequence's queries only reach rows never stored)
      mbar_expect_tx(full_qd, uint32_t(2 * consumers * 64 * D * 2));
      for (int c = 0; c < consumers; ++c)
        for (int b = 0; b < S::BOXES; ++b) {
          tma_load_3d(sq + (c * S::BOXES + b) * S::BOX, &maps.q, b * 64, h, t.q_row + t.first + c * 64, full_qd);
          tma_load_3d(sdo + (c * S::BOXES + b) * S::BOX, &maps.dout, b * 64, h, t.q_row + t.first + c * 64, full_qd);
        }
    }
    for (int kb = 0; kb < steps; ++kb) {
      const int st = kb % DQ_STAGES;
      if (kb >= DQ_STAGES) mbar_wait(&empty[st], ((kb / DQ_STAGES) - 1) & 1);
      uint8_t* sk = stages + st * S::STAGE_BYTES;
      uint8_t* sv = sk + S::BOXES * S::BOX;
      const int valid_k = min(DQ_KEYS, t.k_len - kb * DQ_KEYS);
      if (valid_k == DQ_KEYS) {
        if (lane == 0) {
          mbar_expect_tx(&full[st], uint32_t(S::STAGE_BYTES));
          for (int b = 0; b < S::BOXES; ++b) {
            tma_load_3d(sk + b * S::BOX, &maps.k, b * 64, hk, t.k_row + kb * DQ_KEYS, &full[st]);
            tma_load_3d(sv + b * S::BOX, &maps.v, b * 64, hk, t.k_row + kb * DQ_KEYS, &full[st]);
          }
        }
      } else {  // the sequence's last block: plain loads into the swizzled layout, rows past the keys zeroed
        constexpr int CHUNKS = S::BOXES * 8;
        for (int idx = lane; idx < DQ_KEYS * CHUNKS; idx += 32) {
          const int r = idx / CHUNKS, b = (idx % CHUNKS) / 8, ch = idx % 8;
          uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
          if (r < valid_k) {
            const int64_t at = ((int64_t(t.k_row) + kb * DQ_KEYS + r) * p.Hkv + hk) * D + b * 64 + ch * 8;
            kv = *reinterpret_cast<const uint4*>(p.k + at);
            vv = *reinterpret_cast<const uint4*>(p.v + at);
          }
          const int off = b * S::BOX + r * 128 + ((ch ^ (r & 7)) * 16);
          *reinterpret_cast<uint4*>(sk + off) = kv;
          *reinterpret_cast<uint4*>(sv + off) = vv;
        }
        fence_async_shared();
        __syncwarp();
        if (lane == 0) mbar_arrive(&full[st]);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
  const int c = wg - 1;
  if (c >= consumers) return;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32, quad_col = (lane % 4) * 2;
  const int i0 = t.first + c * 64 + warp * 16 + lane / 4, i1 = i0 + 8;  // this thread's queries (index in the sequence)
  const bool live0 = i0 < t.q_len, live1 = i1 < t.q_len;
  const int pos0 = qoff + i0, pos1 = qoff + i1;
  auto at_row = [&](int i) { return (int64_t(t.q_row) + i) * p.Hq + h; };
  const float lse0 = live0 ? p.lse2[at_row(i0)] : 0.0f, lse1 = live1 ? p.lse2[at_row(i1)] : 0.0f;
  const float del0 = live0 ? p.delta[at_row(i0)] : 0.0f, del1 = live1 ? p.delta[at_row(i1)] : 0.0f;
  float dq[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dq[i] = 0.0f;
  const uint8_t* qa = sq + c * S::BOXES * S::BOX;
  const uint8_t* ga = sdo + c * S::BOXES * S::BOX;
  mbar_wait(full_qd, 0);
  for (int kb = 0; kb < steps; ++kb) {
    const int st = kb % DQ_STAGES;
    const uint8_t* sk = stages + st * S::STAGE_BYTES;
    const uint8_t* sv = sk + S::BOXES * S::BOX;
    mbar_wait(&full[st], (kb / DQ_STAGES) & 1);
    // S = Q·Kᵀ and dP = dO·Vᵀ: 64 queries × 64 keys each.
    float s[DQ_KEYS / 2], dp[DQ_KEYS / 2];
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int box = (kk / 4) * S::BOX, step = (kk % 4) * 2;
      Wgmma<T, false, false, DQ_KEYS>::mma(s, smem_desc(qa + box) + step, smem_desc(sk + box) + step, kk > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int box = (kk / 4) * S::BOX, step = (kk % 4) * 2;
      Wgmma<T, false, false, DQ_KEYS>::mma(dp, smem_desc(ga + box) + step, smem_desc(sv + box) + step, kk > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    // P = 2^(s·c − lse·log2 e) where the query sees the key, else 0.
#pragma unroll
    for (int j = 0; j < DQ_KEYS / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool second = e >= 2;
        const int key = kb * DQ_KEYS + j * 8 + quad_col + (e & 1);
        const bool seen = (second ? live1 : live0) && key <= (second ? pos1 : pos0);
        s[j * 4 + e] = seen ? exp2_ftz(__fmaf_rn(s[j * 4 + e], p.c2, -(second ? lse1 : lse0))) : 0.0f;
      }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    // dS = P ∘ (dP − δ), rounded to the input dtype for dQ += dS·K over the block's keys, 16 a k-step.
    uint32_t da[DQ_KEYS / 16][4];
#pragma unroll
    for (int j = 0; j < DQ_KEYS / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[j * 4 + e] = __fmul_rn(s[j * 4 + e], __fsub_rn(dp[j * 4 + e], e >= 2 ? del1 : del0));
#pragma unroll
    for (int kt = 0; kt < DQ_KEYS / 16; ++kt) {
      da[kt][0] = pack2<T>(dp[kt * 8 + 0], dp[kt * 8 + 1]), da[kt][1] = pack2<T>(dp[kt * 8 + 2], dp[kt * 8 + 3]);
      da[kt][2] = pack2<T>(dp[kt * 8 + 4], dp[kt * 8 + 5]), da[kt][3] = pack2<T>(dp[kt * 8 + 6], dp[kt * 8 + 7]);
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kt = 0; kt < DQ_KEYS / 16; ++kt) WgmmaRS<T, true, D>::mma(dq, da[kt], smem_desc_mn(sk + kt * 16 * 128));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    mbar_arrive(&empty[st]);
  }

  auto store_query = [&](int i, bool live, int half) {
    if (!live) return;
    const int64_t row = at_row(i);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int e = j * 4 + half * 2;
      const int64_t at = row * D + j * 8 + quad_col;
      if (p.dq_f32) {
        *reinterpret_cast<float2*>(static_cast<float*>(p.dq) + at) =
            make_float2(__fmul_rn(dq[e], p.scale), __fmul_rn(dq[e + 1], p.scale));
      } else {
        *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.dq) + at) =
            pack2<T>(__fmul_rn(dq[e], p.scale), __fmul_rn(dq[e + 1], p.scale));
      }
    }
  };
  store_query(i0, live0, 0);
  store_query(i1, live1, 1);
#endif
}

template <class T, int D>
Maps maps_of(const AttentionBackwardArgs& a) {
  const int64_t Tq = a.q.shape[0], Tk = a.k.shape[0], Hq = a.q.shape[1], Hkv = a.k.shape[1];
  Maps maps;
  maps.q = sm90::tma_map_3d(a.q.as<const T>(), Tq, Hq, D, 1, 64);
  maps.dout = sm90::tma_map_3d(a.dout.as<const T>(), Tq, Hq, D, 1, 64);
  maps.k = sm90::tma_map_3d(a.k.as<const T>(), Tk, Hkv, D, 1, 64);
  maps.v = sm90::tma_map_3d(a.v.as<const T>(), Tk, Hkv, D, 1, 64);
  return maps;
}

template <class T, int D>
void launch_dq(const AttentionBackwardArgs& a, const BwdParams& p, int tiles, cudaStream_t stream, const char* op) {
  const Maps maps = maps_of<T, D>(a);
  static std::atomic<int> smem_allowed[64] = {};
  allow_dynamic_smem(attention_dq_sm90_kernel<T, D>, DqSmem<D>::BYTES, smem_allowed, op);
  attention_dq_sm90_kernel<T, D><<<dim3(unsigned(tiles), unsigned(a.q.shape[1])), THREADS, DqSmem<D>::BYTES, stream>>>(
      maps, p);
  check(cudaGetLastError(), op, "dQ (sm90) kernel launch");
}

template <class T, int D>
void launch(const AttentionBackwardArgs& a, const BwdParams& p, int tiles, cudaStream_t stream, const char* op) {
  const int64_t Hkv = a.k.shape[1];
  const Maps maps = maps_of<T, D>(a);
  static std::atomic<int> smem_allowed[64] = {};
  allow_dynamic_smem(attention_dkdv_sm90_kernel<T, D>, Smem<D>::BYTES, smem_allowed, op);
  attention_dkdv_sm90_kernel<T, D><<<dim3(unsigned(tiles), unsigned(Hkv)), THREADS, Smem<D>::BYTES, stream>>>(maps, p);
  check(cudaGetLastError(), op, "dK/dV (sm90) kernel launch");
}

}  // namespace

void attention_dkdv_sm90(const AttentionBackwardArgs& a, const BwdParams& p, int tiles, cudaStream_t stream,
                         const char* op) {
  dispatch_type_and_head_dim(a.q.dtype, a.q.shape[2], [&](auto t, auto d) {
    launch<decltype(t), decltype(d)::value>(a, p, tiles, stream, op);
  });
}

void attention_dq_sm90(const AttentionBackwardArgs& a, const BwdParams& p, int tiles, cudaStream_t stream,
                       const char* op) {
  dispatch_type_and_head_dim(a.q.dtype, a.q.shape[2], [&](auto t, auto d) {
    launch_dq<decltype(t), decltype(d)::value>(a, p, tiles, stream, op);
  });
}

}  // namespace samebits::cuda::attention
