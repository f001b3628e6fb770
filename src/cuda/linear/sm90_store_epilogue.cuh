// The Hopper GEMM's store epilogue (sm90_gemm_kernel.cuh's Epi policy for a plain C = A·B): the
// fp32 accumulators, optionally started from an fp32 C, rounded once to the output type and
// written out in 128-byte column slices, through TMA store boxes where the output's rows allow,
// else through a padded staging area and the threads' own 16-byte stores. The fused LM head's
// backward reuses it to write dlogits.
#pragma once
#include "cuda/common/activation.cuh"
#include "cuda/linear/sm90_gemm_kernel.cuh"

namespace samebits::cuda::sm90gemm {

template <class O>
__device__ __forceinline__ O convert(float v) {  // one rounding to the output type
  if constexpr (std::is_same<O, __nv_bfloat16>::value) return __float2bfloat16_rn(v);
  else if constexpr (std::is_same<O, __half>::value) return __float2half_rn(v);
  else return v;
}

// The value stored for an accumulator: value(acc, h, col) with col the tile's column (bias added in
// fp32 before the single rounding; a fused epilogue computes its own).
template <class T>
struct AddBias {
  const T* bias;  // null: none
  int64_t n0, N;
  __device__ __forceinline__ float operator()(float v, int, int col) const {
    if (bias && n0 + col < N) v += float(bias[n0 + col]);
    return v;
  }
};

// Rounds one consumer's 64 x BN accumulators (through `value`) and writes them out, one 128-byte
// column slice at a time: the slice is staged in shared memory (rows padded), then copied out as
// whole 16-byte pieces of rows.
template <class O, int BN, class Value>
__device__ __forceinline__ void store_tile_by_threads(const float (&d)[BN / 2], uint8_t* stage, const Value& value,
                                                      O* out, int64_t row_base, int64_t n0, int64_t M, int64_t N,
                                                      int t, int c) {
  constexpr int ROW_BYTES = SLICE_BYTES + STAGE_ROW_PAD, SLICE_COLS = SLICE_BYTES / int(sizeof(O));
  constexpr int PER_CHUNK = 16 / int(sizeof(O));
  constexpr int J_PER_SLICE = SLICE_COLS / 8;  // 8-column groups of the accumulator layout per slice
  const int warp = t / 32, lane = t % 32;
  // One fully unrolled loop over the accumulator's column groups (a slice loop around it would index
  // `d` at run time and move it to local memory); a slice is written out after its last group.
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int slice = j / J_PER_SLICE;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = warp * 16 + lane / 4 + h * 8, col = 8 * j + 2 * (lane % 4) + e;
        const float v = value(d[j * 4 + h * 2 + e], h, col);
        reinterpret_cast<O*>(stage + r * ROW_BYTES)[col - slice * SLICE_COLS] = convert<O>(v);
      }
    if ((j + 1) % J_PER_SLICE != 0 && j + 1 != BN / 8) continue;
    // The tile's last slice may be narrower (32- and 48-wide tiles).
    const int slice_cols = BN - slice * SLICE_COLS < SLICE_COLS ? BN - slice * SLICE_COLS : SLICE_COLS;
    const int CHUNKS = slice_cols / PER_CHUNK;
    named_barrier_sync(2 + c, 128);  // this consumer's 128 threads: the slice is staged
    for (int i = t; i < 64 * CHUNKS; i += 128) {
      const int r = i / CHUNKS, ch = i % CHUNKS;
      const int64_t m = row_base + r, col = n0 + int64_t(slice) * SLICE_COLS + int64_t(ch) * PER_CHUNK;
      if (m >= M || col >= N) continue;
      const O* src = reinterpret_cast<const O*>(stage + r * ROW_BYTES) + ch * PER_CHUNK;
      O* dst = out + m * N + col;
      if (col + PER_CHUNK <= N && (reinterpret_cast<uintptr_t>(dst) % 16) == 0) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int e = 0; e < PER_CHUNK && col + e < N; ++e) dst[e] = src[e];
      }
    }
    named_barrier_sync(2 + c, 128);  // copied out: the staging area may take the next slice
  }
}

// The same values through the copy engine: each 128-byte column slice of the consumer's 64 rows is
// written (through `value`, one rounding) into a 128B-swizzled box in shared memory, which one
// thread hands to a TMA store; the consumer goes on to its next tile while the copy engine writes the
// rows out (rows and columns outside y are clipped by the copy engine). `boxes_used` counts this
// consumer's boxes across tiles, so box i % BOXES is reused only once its store has read it.
template <class O, int BN, int BOXES, class Value>
__device__ __forceinline__ void store_tile_by_tma(const float (&d)[BN / 2], uint8_t* boxes, const Value& value,
                                                  const CUtensorMap* map_out, int64_t row_base, int64_t n0, int t,
                                                  int c, uint32_t& boxes_used) {
  constexpr int SLICE_COLS = SLICE_BYTES / int(sizeof(O)), J_PER_SLICE = SLICE_COLS / 8;
  const int warp = t / 32, lane = t % 32;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int slice = j / J_PER_SLICE;
    uint8_t* box = boxes + (boxes_used % BOXES) * BOX_BYTES;
    if (j % J_PER_SLICE == 0) {  // a new slice: its box must have been read by the copy engine
      if (t == 0) tma_store_wait_read<BOXES - 1>();
      named_barrier_sync(2 + c, 128);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + lane / 4 + h * 8, col = 8 * j + 2 * (lane % 4);  // two adjacent columns
      const float v0 = value(d[j * 4 + h * 2], h, col), v1 = value(d[j * 4 + h * 2 + 1], h, col + 1);
      const int byte = (col - slice * SLICE_COLS) * int(sizeof(O));
      uint8_t* p = box + r * SLICE_BYTES + (((byte / 16) ^ (r % 8)) * 16) + byte % 16;
      if constexpr (sizeof(O) == 4) {
        *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
      } else {
        O pair[2] = {convert<O>(v0), convert<O>(v1)};
        *reinterpret_cast<uint32_t*>(p) = *reinterpret_cast<const uint32_t*>(pair);
      }
    }
    if ((j + 1) % J_PER_SLICE != 0) continue;
    fence_async_shared();
    named_barrier_sync(2 + c, 128);  // the box is written
    if (t == 0) tma_store_2d(map_out, box, int32_t(n0 + int64_t(slice) * SLICE_COLS), int32_t(row_base));
    ++boxes_used;
  }
}

// The fp32 C a tile continues from, in the accumulator layout (rows and columns past C read as 0;
// their results are never stored). N is even, so two adjacent columns are one 8-byte load.
template <int BN>
__device__ __forceinline__ void load_accumulators(const float* c_in, float (&d)[BN / 2], int64_t row_base, int64_t n0,
                                                  int64_t M, int64_t N, int t) {
  const int warp = t / 32, lane = t % 32;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = row_base + warp * 16 + lane / 4 + h * 8, col = n0 + 8 * j + 2 * (lane % 4);
      float2 v = make_float2(0.0f, 0.0f);
      if (m < M && col < N) v = *reinterpret_cast<const float2*>(c_in + m * N + col);
      d[j * 4 + h * 2] = v.x;
      d[j * 4 + h * 2 + 1] = v.y;
    }
}

// The plain GEMM's epilogue: the accumulators (optionally continuing an fp32 C that they start
// from, ACCUMULATE) rounded once to O and written out, by TMA stores where the rows allow.
template <class T, class O, bool ACCUMULATE>
struct StoreEpilogue {
  struct Params {
    CUtensorMap map_out;
    const T* bias;       // null: none
    O* out;
    const float* acc_in;  // ACCUMULATE: the fp32 C [M, N] the accumulators start from (may be `out`)
    bool store_by_tma;
  };
  struct State {
    uint32_t boxes_used = 0;  // this consumer's TMA store boxes across tiles
  };
  template <int BN>
  __device__ __forceinline__ static void begin_tile(const Params& p, float (&d)[BN / 2], int64_t row_base, int64_t n0,
                                                    int64_t M, int64_t N, int t, State&) {
    if constexpr (ACCUMULATE) {
      load_accumulators<BN>(p.acc_in, d, row_base, n0, M, N, t);
    } else {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) d[i] = 0.0f;
    }
  }
  template <int BN, int BOXES>
  __device__ __forceinline__ static void end_tile(const Params& p, float (&d)[BN / 2], uint8_t* staging,
                                                  int64_t row_base, int64_t n0, int64_t M, int64_t N, int t, int c,
                                                  State& s) {
    store<BN, BOXES>(p, d, AddBias<T>{p.bias, n0, N}, staging, row_base, n0, M, N, t, c, s);
  }
  // Writes value(d[i], h, col) for the tile's accumulators (a fused epilogue's own values).
  template <int BN, int BOXES, class Value>
  __device__ __forceinline__ static void store(const Params& p, float (&d)[BN / 2], const Value& value,
                                               uint8_t* staging, int64_t row_base, int64_t n0, int64_t M, int64_t N,
                                               int t, int c, State& s) {
    if constexpr (BN >= 64) {  // a TMA store box is 128 bytes wide: wider than a 32-wide tile of 16-bit outputs
      if (p.store_by_tma) {
        store_tile_by_tma<O, BN, BOXES>(d, staging + size_t(c) * BOXES * BOX_BYTES, value, &p.map_out, row_base, n0,
                                        t, c, s.boxes_used);
        return;
      }
    }
    store_tile_by_threads<O, BN>(d, staging + size_t(c) * 64 * (SLICE_BYTES + STAGE_ROW_PAD), value, p.out, row_base,
                                 n0, M, N, t, c);
  }
  __device__ __forceinline__ static void finish(const Params& p, int t, State&) {
    if (p.store_by_tma && t == 0) tma_store_wait_all();  // the copy engine is done with this CTA's boxes
  }
};

// The gate + up GEMM's SwiGLU epilogue (paired halves, sm90_gemm_kernel.cuh: a tile's first BN/2
// columns are gate's, its other BN/2 the same columns of up). Each gate and up value is rounded to
// O as the plain epilogue stores it, then silu(gate)·up is computed by the elementwise op's own
// expression (cuda/common/activation.cuh) and stored as BN/2 columns: swiglu_forward's bits of the
// two stored outputs, which never leave the chip. The threads' stores only (a BN/2-wide tile may be
// narrower than a TMA store box); the launch uses it for decode-sized M, where the plain GEMM does
// too.
template <class T, class O>
struct SwiGluEpilogue {
  static constexpr bool kPairedHalves = true;
  using Store = StoreEpilogue<T, O, false>;
  using Params = typename Store::Params;
  using State = typename Store::State;
  struct AsComputed {
    __device__ __forceinline__ float operator()(float v, int, int) const { return v; }
  };
  template <int BN>  // zeros, as the plain GEMM's
  __device__ __forceinline__ static void begin_tile(const Params& p, float (&d)[BN / 2], int64_t row_base, int64_t n0,
                                                    int64_t M, int64_t N, int t, State& s) {
    Store::template begin_tile<BN>(p, d, row_base, n0, M, N, t, s);
  }
  template <int BN, int BOXES>
  __device__ __forceinline__ static void end_tile(const Params& p, float (&d)[BN / 2], uint8_t* staging,
                                                  int64_t row_base, int64_t n0, int64_t M, int64_t N, int t, int c,
                                                  State& s) {
    constexpr int HALF = BN / 2, GROUPS = HALF / 8;  // 8-column groups of a half: up's group j is d's j + GROUPS
    float m[HALF / 2];
#pragma unroll
    for (int j = 0; j < GROUPS; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float g = float(convert<O>(d[j * 4 + i])), u = float(convert<O>(d[(j + GROUPS) * 4 + i]));
        m[j * 4 + i] = swiglu_value(g, u);
      }
    Store::template store<HALF, BOXES>(p, m, AsComputed{}, staging, row_base, n0, M, N, t, c, s);
  }
  __device__ __forceinline__ static void finish(const Params& p, int t, State& s) { Store::finish(p, t, s); }
};

}  // namespace samebits::cuda::sm90gemm
