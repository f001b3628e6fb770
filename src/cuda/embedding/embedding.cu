// CUDA embedding: gather forward, and a gradient scatter with no atomics.
//
// Why this shape. The gather is a copy, one CTA per token, 16-byte accesses. Ids are int32 or int64
// (torch's index type, read as it is: no narrowing copy before the op, and a value past int32 is
// named as it is). The scatter is where
// embedding kernels usually use atomicAdd, whose order is whatever the hardware schedules. Here
// dtable[v, :] += Σ dy[t, :] over the unmasked tokens with id v, in ascending t, starting from the
// value already in dtable (so micro-batches chain bit for bit, and the bits equal the CPU backend's):
//   1. every token becomes a key (id << 32 | t); masked tokens get the id 0xFFFFFFFF and sort last;
//   2. the keys are sorted (all distinct, so the order is unique whatever the algorithm): tiles of
//      2048 by a bitonic network in shared memory, then merge passes in which every key finds its
//      place by counting, with a binary search, the smaller keys of the run it merges with;
//   3. one warp per (sorted position, 256 columns): the warp at the first position of an id loads
//      the fp32 row slice, adds its tokens' rows in sorted (ascending t) order, and stores it. Each
//      element of dtable is written by exactly one thread.
// A frequent id (padding, a common token) is a long sequential sum in one warp per 256 columns;
// its loads are independent, only the adds are chained.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/convert.cuh"
#include "cuda/common/index_check.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "ops/registry.hpp"
#include "samebits/ops.hpp"
#include "samebits/validate.hpp"

namespace samebits::cuda {
namespace {

constexpr int VEC = 8;  // elements a thread moves at once (16 bytes of bf16)
constexpr uint32_t MASKED_ID = 0xFFFFFFFFu;

template <class T>
__device__ __forceinline__ void load_vec(const T* p, bool aligned, int64_t n, float (&v)[VEC]) {
  if (aligned && n >= VEC) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = to_f32(h[i]);
    } else {
      const float4 lo = reinterpret_cast<const float4*>(p)[0], hi = reinterpret_cast<const float4*>(p)[1];
      v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = i < n ? to_f32(p[i]) : 0.0f;
  }
}

template <class O>
__device__ __forceinline__ void store_vec(O* p, bool aligned, int64_t n, const float (&v)[VEC]) {
  if (aligned && n >= VEC) {
    if constexpr (sizeof(O) == 2) {
      uint4 raw;
      O* h = reinterpret_cast<O*>(&raw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) h[i] = O(v[i]);
      *reinterpret_cast<uint4*>(p) = raw;
    } else {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      if (i < n) p[i] = O(v[i]);
  }
}

// ---------------------------------------------------------------- forward
constexpr int GATHER_THREADS = 128;

// A block copies a row; with a deferred check's slot, block 0 first searches the ids for a bad one
// (index_check.cuh; the lowest block index is scheduled first, so the search's pass over all ids
// overlaps the copies instead of trailing them) and the rows are blocks 1 … T — the check in the
// gather's own launch, not a second one.
template <class T, class O, class Id>
__global__ void __launch_bounds__(GATHER_THREADS) gather_rows(const Id* ids, int64_t n, const T* table, int64_t V,
                                                              int64_t H, bool in_aligned, O* y, bool out_aligned,
                                                              DeferredSlot check) {
  if (check.answer && blockIdx.x == 0)
    return first_bad_id_block<GATHER_THREADS>(ids, n, V, nullptr, false, 0, nullptr, check);
  const int64_t t = int64_t(blockIdx.x) - (check.answer ? 1 : 0);
  const int64_t id = ids[t];
  // An invalid id was reported before the launch or is reported by a deferred check: never read
  // through it, and give its row NaN so nothing computed from it passes for a value meanwhile.
  const bool valid = id >= 0 && id < V;
  for (int64_t c = int64_t(threadIdx.x) * VEC; c < H; c += GATHER_THREADS * VEC) {
    float v[VEC];
    if (valid) {
      load_vec(table + int64_t(id) * H + c, in_aligned, H - c, v);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = __int_as_float(0x7fffffff);
    }
    store_vec(y + t * H + c, out_aligned, H - c, v);
  }
}

// ---------------------------------------------------------------- backward: keys and sort
constexpr int SORT_TILE = 2048, SORT_THREADS = SORT_TILE / 2;

template <class Id>
__global__ void make_keys(const Id* ids, const uint8_t* mask, int64_t T, int64_t V, uint64_t* keys) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int64_t id = ids[t];
  const bool active = (mask == nullptr || mask[t] != 0) && id >= 0 && id < V;
  keys[t] = (uint64_t(active ? uint32_t(id) : MASKED_ID) << 32) | uint64_t(t);
}

// Sorts each tile of SORT_TILE keys ascending (the tail tile padded with all-ones keys).
__global__ void __launch_bounds__(SORT_THREADS) sort_tiles(uint64_t* keys, int64_t T) {
  __shared__ uint64_t s[SORT_TILE];
  const int64_t base = int64_t(blockIdx.x) * SORT_TILE;
  for (int i = threadIdx.x; i < SORT_TILE; i += SORT_THREADS) s[i] = base + i < T ? keys[base + i] : ~uint64_t(0);
  __syncthreads();
  for (int k = 2; k <= SORT_TILE; k *= 2)
    for (int j = k / 2; j > 0; j /= 2) {
      const int i = 2 * j * (int(threadIdx.x) / j) + int(threadIdx.x) % j, l = i + j;
      const bool ascending = (i & k) == 0;
      const uint64_t a = s[i], b = s[l];
      if ((a > b) == ascending) {
        s[i] = b;
        s[l] = a;
      }
      __syncthreads();
    }
  for (int i = threadIdx.x; i < SORT_TILE; i += SORT_THREADS)
    if (base + i < T) keys[base + i] = s[i];
}

// Merges sorted runs of `width` pairwise: a key's place is its index in its run plus the number of
// keys of the partner run below it (all keys are distinct).
__global__ void merge_runs(const uint64_t* in, uint64_t* out, int64_t T, int64_t width) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T) return;
  const uint64_t key = in[i];
  const int64_t run = i / width, pair0 = (run & ~int64_t(1)) * width;
  const int64_t other0 = (run ^ 1) * width, other1 = other0 + width < T ? other0 + width : T;
  int64_t lo = other0, hi = other0 < T ? other1 : other0;  // first index in [lo, hi) with in[idx] > key
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (in[mid] < key) lo = mid + 1; else hi = mid;
  }
  out[pair0 + (i - run * width) + (lo - other0)] = key;
}

// ---------------------------------------------------------------- backward: ordered sums
constexpr int SUM_WARPS = 4, SUM_COLS = 32 * VEC;

template <class D>
__global__ void __launch_bounds__(SUM_WARPS * 32) sum_rows(const uint64_t* sorted, int64_t T, const D* dy, int64_t H,
                                                           bool dy_aligned, float* dtable, bool table_aligned) {
  const int64_t p = int64_t(blockIdx.x) * SUM_WARPS + threadIdx.x / 32;
  if (p >= T) return;
  const uint32_t id = uint32_t(sorted[p] >> 32);
  if (id == MASKED_ID || (p > 0 && uint32_t(sorted[p - 1] >> 32) == id)) return;
  const int64_t c = int64_t(blockIdx.y) * SUM_COLS + (threadIdx.x % 32) * VEC;
  if (c >= H) return;
  float* row = dtable + int64_t(id) * H + c;
  float acc[VEC];
  load_vec(row, table_aligned, H - c, acc);
  for (int64_t q = p; q < T; ++q) {
    const uint64_t key = sorted[q];
    if (uint32_t(key >> 32) != id) break;
    float v[VEC];
    load_vec(dy + int64_t(uint32_t(key)) * H + c, dy_aligned, H - c, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = __fadd_rn(acc[i], v[i]);
  }
  store_vec(row, table_aligned, H - c, acc);
}

unsigned blocks_for(int64_t n, int per_block) { return unsigned((n + per_block - 1) / per_block); }

// f(id_tag) with the ids' element type: int32, or int64 read as it is (torch's index type).
template <class F>
void with_id_type(DType d, F&& f) {
  if (d == DType::i64) f(int64_t{});
  else f(int32_t{});
}

void embedding_forward(const Context& ctx, const EmbeddingForwardArgs& a) {
  const char* op = "embedding_forward";
  const int64_t T = a.ids.shape[0], V = a.table.shape[0], H = a.table.shape[1];
  const cudaStream_t stream = stream_of(ctx.stream);
  if (T > INT32_MAX) throw Unsupported(op, "ids", "more than 2^31 - 1 tokens in one call is not supported");
  with_id_type(a.ids.dtype, [&](auto id_tag) {
    using Id = decltype(id_tag);
    const Id* ids = a.ids.as<const Id>();
    DeferredSlot deferred;  // a deferred check runs in the gather's launch (T + 1 blocks); any other before it
    if (!a.ids_checked) {
      if (T < INT32_MAX) deferred = queue_deferred_search(ctx, op, "ids", T, V, stream);
      if (!deferred.answer) require_ids_in_range(ctx, op, "ids", ids, T, V, nullptr, false, 0, stream);
    }
    with_float_storage(a.table.dtype, [&](auto tag) {
      using T_ = decltype(tag);
      with_float_storage(a.y.dtype, [&](auto out_tag) {
        using O = decltype(out_tag);
        gather_rows<T_, O, Id><<<unsigned(T) + (deferred.answer ? 1 : 0), GATHER_THREADS, 0, stream>>>(
            ids, T, a.table.as<const T_>(), V, H, rows_aligned_16(a.table.data, H, sizeof(T_)), a.y.as<O>(),
            rows_aligned_16(a.y.data, H, sizeof(O)), deferred);
        if (const cudaError_t launched = cudaGetLastError(); launched != cudaSuccess) {
          abandon_deferred_search(deferred);
          check(launched, op, "kernel launch");
        }
      });
    });
  });
}

void embedding_backward(const Context& ctx, const EmbeddingBackwardArgs& a) {
  const char* op = "embedding_backward";
  const int64_t T = a.ids.shape[0], V = a.dtable.shape[0], H = a.dtable.shape[1];
  const cudaStream_t stream = stream_of(ctx.stream);
  if (T > INT32_MAX) throw Unsupported(op, "ids", "more than 2^31 - 1 tokens in one call is not supported");
  // A sort key holds an id in 32 bits and 0xFFFFFFFF means masked: a table of more rows could not
  // be keyed (int64 ids can reach them).
  if (V > int64_t(MASKED_ID)) throw Unsupported(op, "dtable", "more than 2^32 - 1 rows is not supported");
  const uint8_t* mask = a.row_mask.present() ? a.row_mask.as<const uint8_t>() : nullptr;
  const ScratchBuffer keys(size_t(2 * T) * sizeof(uint64_t), stream, op);  // freed in stream order, after the kernels
  uint64_t *cur = keys.as<uint64_t>(), *other = cur + T;
  with_id_type(a.ids.dtype, [&](auto id_tag) {
    using Id = decltype(id_tag);
    const Id* ids = a.ids.as<const Id>();
    if (!a.ids_checked) require_ids_in_range(ctx, op, "ids", ids, T, V, mask, false, 0, stream);
    make_keys<<<blocks_for(T, 256), 256, 0, stream>>>(ids, mask, T, V, cur);
  });
  sort_tiles<<<blocks_for(T, SORT_TILE), SORT_THREADS, 0, stream>>>(cur, T);
  for (int64_t width = SORT_TILE; width < T; width *= 2) {
    merge_runs<<<blocks_for(T, 256), 256, 0, stream>>>(cur, other, T, width);
    std::swap(cur, other);
  }
  with_float_storage(a.dy.dtype, [&](auto tag) {
    using T_ = decltype(tag);
    const dim3 grid(blocks_for(T, SUM_WARPS), blocks_for(H, SUM_COLS));
    sum_rows<T_><<<grid, SUM_WARPS * 32, 0, stream>>>(cur, T, a.dy.as<const T_>(), H, rows_aligned_16(a.dy.data, H, sizeof(T_)),
                                                     a.dtable.as<float>(), rows_aligned_16(a.dtable.data, H, sizeof(float)));
  });
  check(cudaGetLastError(), op, "kernel launch");
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(embedding_forward, Backend::cuda, EmbeddingForwardArgs, embedding_forward);
SAMEBITS_REGISTER_KERNEL(embedding_backward, Backend::cuda, EmbeddingBackwardArgs, embedding_backward);

}  // namespace samebits::cuda
