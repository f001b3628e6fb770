// CUDA selected logprob from logits, forward and backward.
//
// Why this shape. The op is a read of the logits (and, backward, a write of dlogits of the same
// size), so it is shaped for HBM: one CTA of eight warps per token row; warp w reads unit w (256
// columns, 16 bytes a lane) of every 2048-column range, four ranges' loads in flight before any math,
// reduces its unit by warp shuffles and parks it in shared memory; then one warp builds the ranges
// and one thread chains them. That is exactly the topology of vocab_stats.cuh, fixed by the vocab
// size: no row's bits depend on how many rows the call has, where it sits, or on the SM count.
// Forward writes logp, entropy and lse per token; masked tokens (loss_mask 0 or ignore_index) get
// logp = entropy = 0 but their lse like every row. Backward takes the forward's lse when given and
// no entropy gradient is asked for (one read of the row), otherwise rebuilds the statistics first
// (two reads); masked rows are written as zeros without reading the logits. NaN or Inf logits make
// that row's results NaN and touch no other row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <type_traits>

#include "cuda/common/convert.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/logprob/targets.cuh"
#include "cuda/logprob/vocab_stats.cuh"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"
#include "samebits/validate.hpp"

namespace samebits::cuda {
namespace {

using namespace vocab;

constexpr int THREADS = 256, WARPS = THREADS / 32;
// Shared memory holds a row's unit statistics; past this the vocab does not fit one CTA.
constexpr size_t MAX_SMEM = 200 * 1024;

// Eight consecutive logits as fp32, −inf past V. `aligned`: every row starts 16-byte aligned (a
// property of the base pointer and V, never of the row), so whole leaves load as vectors.
template <class T>
__device__ __forceinline__ void load_block(const T* row, int64_t col0, int64_t V, bool aligned, float (&z)[BLOCK]) {
  if (aligned && col0 + BLOCK <= V) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(row + col0));
      const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < BLOCK; ++i) z[i] = to_f32(h[i]);
    } else {
      const float4 lo = __ldcs(reinterpret_cast<const float4*>(row + col0));
      const float4 hi = __ldcs(reinterpret_cast<const float4*>(row + col0 + 4));
      z[0] = lo.x, z[1] = lo.y, z[2] = lo.z, z[3] = lo.w, z[4] = hi.x, z[5] = hi.y, z[6] = hi.z, z[7] = hi.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < BLOCK; ++i) z[i] = col0 + i < V ? to_f32(row[col0 + i]) : -INFINITY;
  }
}

template <class O>
__device__ __forceinline__ void store_block(O* row, int64_t col0, int64_t V, bool aligned, const float (&d)[BLOCK]) {
  if (aligned && col0 + BLOCK <= V) {
    if constexpr (sizeof(O) == 2) {
      uint4 raw;
      O* h = reinterpret_cast<O*>(&raw);
#pragma unroll
      for (int i = 0; i < BLOCK; ++i) h[i] = O(d[i]);
      __stcs(reinterpret_cast<uint4*>(row + col0), raw);
    } else {
      __stcs(reinterpret_cast<float4*>(row + col0), make_float4(d[0], d[1], d[2], d[3]));
      __stcs(reinterpret_cast<float4*>(row + col0 + 4), make_float4(d[4], d[5], d[6], d[7]));
    }
  } else {
#pragma unroll
    for (int i = 0; i < BLOCK; ++i)
      if (col0 + i < V) row[col0 + i] = O(d[i]);
  }
}

// Shared memory of a CTA: each warp has two stages of one range of logits (2048 columns) — one
// being loaded while the other is reduced — then come the range statistics of the row.
constexpr int STAGES = 2;
template <class T>
constexpr size_t stage_bytes() { return size_t(RANGE) * sizeof(T); }

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst))),
               "l"(gmem_src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Starts loading one range of a row into a stage, laid out by groups: group g's 16-byte chunk c sits
// at g * GROUP_BYTES + (c ^ (g % 8)) * 16. The copies are coalesced (lane l takes chunk 32i + l) and
// asynchronous (cp.async, L2 only); the stores they make and a lane's later reads of its own group
// hit 8 distinct chunk slots per quarter warp: no bank conflicts. Columns past V are −inf. Rows that
// are not 16-byte aligned (V not a multiple of 8 bf16 / 4 fp32) go element by element, synchronously.
template <class T>
__device__ __forceinline__ void stage_range(const T* row, int64_t col0, int64_t V, bool aligned, uint8_t* stage,
                                            int lane) {
  constexpr int CHUNK_ELEMS = 16 / sizeof(T), GROUP_CHUNKS = GROUP / CHUNK_ELEMS, RANGE_CHUNKS = RANGE / CHUNK_ELEMS;
  constexpr int GROUP_BYTES = GROUP * sizeof(T);
  if (aligned) {  // V is a multiple of CHUNK_ELEMS: a chunk is wholly inside the row or wholly past it
    const uint4* src = reinterpret_cast<const uint4*>(row + col0);
    const int64_t valid_chunks = (V - col0) / CHUNK_ELEMS;
    uint4 past_end;
    T* fill = reinterpret_cast<T*>(&past_end);
#pragma unroll
    for (int i = 0; i < CHUNK_ELEMS; ++i) fill[i] = T(-INFINITY);
#pragma unroll
    for (int i = 0; i < RANGE_CHUNKS / 32; ++i) {
      const int chunk = 32 * i + lane, g = chunk / GROUP_CHUNKS, c = chunk % GROUP_CHUNKS;
      uint8_t* dst = stage + g * GROUP_BYTES + (c ^ (g % 8)) * 16;
      if (chunk < valid_chunks) cp_async_16(dst, src + chunk);
      else *reinterpret_cast<uint4*>(dst) = past_end;
    }
  } else {
    for (int e = lane; e < RANGE; e += 32) {
      const int g = e / GROUP, w = e % GROUP, c = w / CHUNK_ELEMS;
      const T val = col0 + e < V ? row[col0 + e] : T(-INFINITY);
      *reinterpret_cast<T*>(stage + g * GROUP_BYTES + (c ^ (g % 8)) * 16 + (w % CHUNK_ELEMS) * sizeof(T)) = val;
    }
  }
}

// A 16-byte shared-memory read that the compiler may not merge with another: the group is read twice
// (max, then sums) rather than held in 64 registers, which would halve the CTAs an SM holds.
__device__ __forceinline__ uint4 lds_128(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
  return v;
}

// Pairs of 16-bit values (the packed max of group_stats).
template <class T2>
__device__ __forceinline__ T2 __halves2bfloat162_or_half2(typename std::conditional<std::is_same<T2, __half2>::value, __half, __nv_bfloat16>::type v) {
  return T2(v, v);
}
__device__ __forceinline__ __half __low2half_or_bf16(__half2 v) { return __low2half(v); }
__device__ __forceinline__ __half __high2half_or_bf16(__half2 v) { return __high2half(v); }
__device__ __forceinline__ __nv_bfloat16 __low2half_or_bf16(__nv_bfloat162 v) { return __low2bfloat16(v); }
__device__ __forceinline__ __nv_bfloat16 __high2half_or_bf16(__nv_bfloat162 v) { return __high2bfloat16(v); }

// The statistics of group g of the staged range, in registers: its max over one read of the chunks,
// then, over a second read, the eight blocks' sums and their tree.
template <class T>
__device__ __forceinline__ Stats group_stats(const uint8_t* stage, int g) {
  constexpr int CHUNK_ELEMS = 16 / sizeof(T), BLOCK_CHUNKS = BLOCK / CHUNK_ELEMS, GROUP_BYTES = GROUP * sizeof(T);
  constexpr int BLOCKS = GROUP / BLOCK;
  const uint8_t* base = stage + g * GROUP_BYTES;
  auto block = [&](int k, float (&z)[BLOCK]) {
#pragma unroll
    for (int q = 0; q < BLOCK_CHUNKS; ++q) {
      const int c = k * BLOCK_CHUNKS + q;
      const uint4 raw = lds_128(base + (c ^ (g % 8)) * 16);
      const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < CHUNK_ELEMS; ++i) z[q * CHUNK_ELEMS + i] = to_f32(h[i]);
    }
  };
  // The max skips NaNs (fmaxf, __hmax2) and starts from NaN, so it is NaN only for a group that is
  // all NaN, which then poisons its row (started from −inf, such a group looked empty and was dropped);
  // −inf only for a group with no finite logit and no NaN (columns past V).
  float m = NAN;
  if constexpr (sizeof(T) == 2) {  // the max of 16-bit values, two at a time, then widened (exact)
    using T2 = typename std::conditional<std::is_same<T, __half>::value, __half2, __nv_bfloat162>::type;
    T2 m2 = __halves2bfloat162_or_half2<T2>(T(NAN));
#pragma unroll
    for (int c = 0; c < GROUP / CHUNK_ELEMS; ++c) {
      const uint4 raw = lds_128(base + (c ^ (g % 8)) * 16);
      const T2* h = reinterpret_cast<const T2*>(&raw);
#pragma unroll
      for (int i = 0; i < 4; ++i) m2 = __hmax2(m2, h[i]);
    }
    m = fmaxf(to_f32(__low2half_or_bf16(m2)), to_f32(__high2half_or_bf16(m2)));
  } else {
#pragma unroll
    for (int k = 0; k < BLOCKS; ++k) {
      float z[BLOCK];
      block(k, z);
#pragma unroll
      for (int i = 0; i < BLOCK; ++i) m = fmaxf(m, z[i]);
    }
  }
  if (m == -INFINITY) return empty_stats();
  float s[BLOCKS], a[BLOCKS];
#pragma unroll
  for (int k = 0; k < BLOCKS; ++k) {
    float z[BLOCK];
    block(k, z);
    block_sums(z, m, s[k], a[k]);
  }
  return {m, sum_tree8(s), sum_tree8(a)};
}

// The statistics of one row, returned to every thread of the CTA: warp w takes ranges w, w + 8, …
// (lane l its group l), the ranges' statistics meet in shared memory, thread 0 chains them.
template <class T>
__device__ Stats row_stats(const T* row, int64_t V, int R, bool aligned, uint8_t* smem) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  uint8_t* stages = smem + warp * STAGES * stage_bytes<T>();
  Stats* ranges = reinterpret_cast<Stats*>(smem + WARPS * STAGES * stage_bytes<T>());
  if (warp < R) stage_range(row, int64_t(warp) * RANGE, V, aligned, stages, lane);
  cp_async_commit();
  for (int k = 0, r = warp; r < R; ++k, r += WARPS) {
    // The next range of this warp loads while this one is reduced (an empty group past the end).
    if (r + WARPS < R)
      stage_range(row, int64_t(r + WARPS) * RANGE, V, aligned, stages + ((k + 1) % STAGES) * stage_bytes<T>(), lane);
    cp_async_commit();
    cp_async_wait<1>();
    __syncwarp();  // every lane's copies (and element stores) of range r are visible to the warp
    const Stats x = merge_lanes(group_stats<T>(stages + (k % STAGES) * stage_bytes<T>(), lane), 1, 16);
    if (lane == 0) ranges[r] = x;
    __syncwarp();  // every lane has read the stage before range r + 2 * WARPS overwrites it
  }
  cp_async_wait<0>();
  __syncthreads();
  if (threadIdx.x == 0) {
    Stats acc = ranges[0];
    for (int r = 1; r < R; ++r) acc = merge(acc, ranges[r]);
    ranges[0] = acc;
  }
  __syncthreads();
  return ranges[0];
}

template <class T>
__global__ void __launch_bounds__(THREADS) logprob_forward_kernel(const T* logits, int64_t V, int R, bool aligned,
                                                                  const int32_t* targets, const uint8_t* mask,
                                                                  int32_t ignore, float* logp, float* entropy,
                                                                  float* lse) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t t = blockIdx.x;
  const T* row = logits + t * V;
  const Stats st = row_stats(row, V, R, aligned, smem);
  if (threadIdx.x != 0) return;
  const int32_t target = targets[t];
  const bool active = token_active(targets, mask, ignore, t), in_range = target >= 0 && target < V;
  write_token(st, active, in_range, active && in_range ? to_f32(row[target]) : 0.0f, t, logp, entropy, lse);
}

// dlogits[t, j] = g·(onehot_j − p_j) + ge·(−p_j·(log p_j + H)), p_j = e^(z_j − lse).
template <class T, class O>
__global__ void __launch_bounds__(THREADS) logprob_backward_kernel(const T* logits, int64_t V, int R, bool aligned,
                                                                   const int32_t* targets, const uint8_t* mask,
                                                                   int32_t ignore, const float* lse_in,
                                                                   const float* dlogp, const float* dentropy,
                                                                   O* dlogits, bool out_aligned) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t t = blockIdx.x;
  const T* row = logits + t * V;
  O* out = dlogits + t * V;
  const int64_t stride = int64_t(THREADS) * BLOCK;
  if (!token_active(targets, mask, ignore, t)) {
    const float zero[BLOCK] = {};
    for (int64_t col0 = int64_t(threadIdx.x) * BLOCK; col0 < V; col0 += stride)
      store_block(out, col0, V, out_aligned, zero);
    return;
  }
  const int32_t target = targets[t];
  // A target outside [0, V) (a bad id a deferred check reports later, Context::id_check): a NaN row,
  // so nothing computed from it passes for a gradient meanwhile.
  const float g = target >= 0 && target < V ? dlogp[t] : __int_as_float(0x7fffffff);
  const float ge = dentropy ? dentropy[t] : 0.0f;
  float l, H = 0.0f;
  if (lse_in != nullptr && ge == 0.0f) {
    l = lse_in[t];
  } else {  // uniform across the CTA
    const Stats st = row_stats(row, V, R, aligned, smem);
    l = lse_of(st);
    H = entropy_of(st);
  }
  for (int64_t col0 = int64_t(threadIdx.x) * BLOCK; col0 < V; col0 += stride) {
    float z[BLOCK], d[BLOCK];
    load_block(row, col0, V, aligned, z);
#pragma unroll
    for (int i = 0; i < BLOCK; ++i) {
      const float lp = __fsub_rn(z[i], l), p = exp_f(lp);
      float v = __fmul_rn(-g, p);
      if (col0 + i == target) v = __fadd_rn(v, g);
      if (ge != 0.0f) v = __fadd_rn(v, __fmul_rn(ge, __fmul_rn(-p, __fadd_rn(lp, H))));
      d[i] = v;
    }
    store_block(out, col0, V, out_aligned, d);
  }
}

// Ranges of a row and the shared memory of a CTA (stages, then range statistics); opts the kernel in
// when needed.
template <class T, class Kernel>
int ranges_and_smem(const char* op, Kernel kernel, int64_t V, size_t& smem) {
  const int64_t R = (V + RANGE - 1) / RANGE;
  smem = WARPS * STAGES * stage_bytes<T>() + size_t(R) * sizeof(Stats);
  if (smem > MAX_SMEM)
    throw Unsupported(op, "logits", "a vocab above " +
                                        std::to_string((MAX_SMEM - WARPS * STAGES * stage_bytes<T>()) / sizeof(Stats) * RANGE) +
                                        " columns is not supported by the CUDA logprob");
  if (smem > 48 * 1024)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), op, "shared memory");
  return int(R);
}

const float* opt_f32(const TensorView& t) { return t.present() ? t.as<const float>() : nullptr; }
float* opt_f32_out(const TensorView& t) { return t.present() ? t.as<float>() : nullptr; }
const uint8_t* opt_mask(const TensorView& t) { return t.present() ? t.as<const uint8_t>() : nullptr; }

void logprob_forward(const Context& ctx, const LogprobForwardArgs& a) {
  const char* op = "logprob_forward";
  const int64_t T = a.logits.shape[0], V = a.logits.shape[1];
  const cudaStream_t stream = stream_of(ctx.stream);
  check_targets_of(ctx, op, "logits", T, V, a, stream);
  with_float_storage(a.logits.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    size_t smem = 0;
    const int R = ranges_and_smem<T_>(op, logprob_forward_kernel<T_>, V, smem);
    logprob_forward_kernel<T_><<<unsigned(T), THREADS, smem, stream>>>(
        a.logits.as<const T_>(), V, R, rows_aligned_16(a.logits.data, V, sizeof(T_)), a.targets.as<const int32_t>(),
        opt_mask(a.loss_mask), a.ignore_index, a.logp.as<float>(), opt_f32_out(a.entropy), opt_f32_out(a.lse));
    check(cudaGetLastError(), op, "kernel launch");
  });
}

void logprob_backward(const Context& ctx, const LogprobBackwardArgs& a) {
  const char* op = "logprob_backward";
  const int64_t T = a.logits.shape[0], V = a.logits.shape[1];
  const cudaStream_t stream = stream_of(ctx.stream);
  check_targets_of(ctx, op, "logits", T, V, a, stream);
  with_float_storage(a.logits.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    with_float_storage(a.dlogits.dtype, [&](auto out_tag) {
      using O = decltype(out_tag);
      size_t smem = 0;
      const int R = ranges_and_smem<T_>(op, logprob_backward_kernel<T_, O>, V, smem);
      logprob_backward_kernel<T_, O><<<unsigned(T), THREADS, smem, stream>>>(
          a.logits.as<const T_>(), V, R, rows_aligned_16(a.logits.data, V, sizeof(T_)), a.targets.as<const int32_t>(),
          opt_mask(a.loss_mask), a.ignore_index, opt_f32(a.lse), a.dlogp.as<const float>(), opt_f32(a.dentropy),
          a.dlogits.as<O>(), rows_aligned_16(a.dlogits.data, V, sizeof(O)));
      check(cudaGetLastError(), op, "kernel launch");
    });
  });
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(logprob_forward, Backend::cuda, LogprobForwardArgs, logprob_forward);
SAMEBITS_REGISTER_KERNEL(logprob_backward, Backend::cuda, LogprobBackwardArgs, logprob_backward);

}  // namespace samebits::cuda
