// Hopper (sm_90a) GEMM y = x·wᵀ: TMA loads, wgmma, a warp-specialised producer / consumer pipeline
// on mbarriers.
//
// Why this shape. A 128 x BN output tile (BN = 256; 192, 128, 64, 48 or 32 and 64-row tiles for some
// M, see tile_width and tile_choice) with K in steps of 64 (four 16-deep wgmma steps, ascending): an
// output element is always the same sequence of 16-deep MMA steps over ascending K, accumulated in fp32
// registers, so its bits never depend on M, on its neighbours or on the grid (rules 1-3; no split-K,
// no atomics). The kernel is persistent: one CTA per SM walks a fixed tile order, and its ring runs
// on across tiles, so the next tile's operands load while this tile's epilogue writes (measured on an
// H200, same process: geometric-mean ratio to cuBLAS at M >= 1024 0.981 against 0.961 with one CTA
// per tile; on an H100 0.984 / 0.981 against 0.960 / 0.972 in two alternating repetitions).
// Warpgroup 0 is the producer (registers given away with setmaxnreg): one thread streams A (x) and B
// (w) tiles with the bulk tensor copy engine into a ring of up to 200 KiB (128B-swizzled; 4, 5, 6 or 8
// stages of 48, 40, 32 or 24 KiB for BN = 256, 192, 128, 64; compact 64-row tiles: 5, 6, 12, 14 or 16
// stages of 40, 32, 16, 14 or 12 KiB for BN = 256, 192, 64, 48, 32) and signals "full" mbarriers with
// the byte count. Warpgroups 1 and 2 each own 64 rows of the tile, wait on "full", issue wgmma straight
// from shared memory with one k-tile of MMAs kept in flight, and release a stage on its "empty"
// mbarrier once the MMAs reading it are done. The epilogue adds the bias in fp32, rounds once, and
// writes 128-byte column slices into 128B-swizzled boxes that TMA stores, so the consumers start the
// next tile while the copy engine writes this one out (rows TMA cannot store, and M <= 128, go through
// a padded staging area and the threads' own 16-byte stores). Tiles are ordered M fastest within groups
// of 2048 rows, so a W tile is read from HBM once per group and reused from L2 across M, and the rows
// of x in flight fit in L2. Out-of-range rows, columns and K are zero-filled by the copy engine, so
// edge tiles run the same instructions. Requirements: K a multiple of 8 and 16-byte aligned x and w
// (TMA strides); other K take the generic path, which is a property of the weight, never of M.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/common/runtime.cuh"
#include "cuda/linear/gemm.cuh"
#include "cuda/linear/sm90_gemm_kernel.cuh"
#include "cuda/linear/sm90_store_epilogue.cuh"
#include "cuda/linear/tile_rule.hpp"
#include "ops/tuning.hpp"

namespace samebits::cuda {
namespace {

using namespace sm90;
using sm90gemm::StoreEpilogue;

// The tile width: 256 output columns; on outputs narrower than 16384 columns, 128 when M <= 512 and
// 64 when M <= 256, so small batches of narrow layers (QKV, O, down, the LM head's dX) get two or
// four times the CTAs to stream the weight with (M <= 64: see tile_choice). Above M = 256, 192 where that costs less
// once the last, partial round of tiles over the SMs is counted (rounds x width: QKV 4096 -> 6144 at
// M = 1024 is 1.45 rounds of 256-wide tiles, a second round that leaves 60% of the GPU idle, and
// 1.94 rounds of 192-wide ones), by a margin of 10%: a 192-wide tile has room for one TMA store box
// a consumer beside its five-stage ring, not two, and where the saving is small it lost (H100, same
// run: LM head 4096 -> 128256 at M = 2048 / 4096 0.92 against 1.01 / 1.00, gate+up 4096 -> 28672 at
// M = 8192 0.91 against 0.99). This is the one place where a shape depends on M (and on the SM
// count), which rule 2 allows only with proof that every element keeps its bits: wgmma.m64n64k16,
// m64n128k16, m64n192k16 and m64n256k16 (and m64n32k16, m64n48k16, below) run the same per-element
// K sequence, and tests/test_cuda_gemm.cpp checks it (the M sweep crosses the switches, and
// TileWidthsGiveIdenticalBits forces every width, compact and full, on the same problems).
using namespace gemm_tiles;  // Columns, tile_rounds, tile_width, decode_width (tile_rule.hpp)

struct TileChoice {
  int width;
  bool compact;
};
inline TileChoice tile_choice(int64_t M, const Columns& cols, int sms, bool forward) {
  auto tiles = [&](int rows, int width) { return ((M + rows - 1) / rows) * cols.tiles(width); };
  int width = M <= 64 ? decode_width(cols, sms, forward) : tile_width(M, cols, sms);
  if (const int forced = detail::gemm_tile_width_override()) width = forced == 48 && !forward ? 64 : forced;
  // Compact: 32- and 48-wide tiles always; 64-, 192- and 256-wide ones for M <= 64; 64-wide ones for
  // 64 < M <= 128 too where the 64-row tiles fit one round.
  const bool compact = width < 64 || (width == 64 && (M <= 64 || (M <= 128 && tiles(64, 64) <= sms))) ||
                       (width >= 192 && M <= 64);
  return {width, compact};
}

// y_g = A·B_g (+ bias_g) into out_g for the `count` products (at most G) with the plain store
// epilogue; an output goes out by TMA stores where its rows allow (16-byte pitch and base) and
// M > 128; the values are the same either way (the M sweep crosses the switch). Measured on an H100
// against the threads' own stores: geometric mean over M >= 1024 0.996 against 0.981 (the
// consumers no longer wait for their global stores before the next tile), but 5-9% slower at
// M <= 64 on the narrow layers (O), whose calls are a few tiles long and end waiting for the copy
// engine.
template <class T, class O, int G>
struct ProductArgs {
  const T* b[G];
  const T* bias[G];
  void* out[G];
  int64_t N[G];
  int count;
  bool b_settled = false;  // the b may load before the previous kernel ends (weights_settled)
};

template <class T, class O, bool TRANS_B, int BN, bool COMPACT, bool ACCUMULATE, int G>
void launch_tile(const T* a, const ProductArgs<T, O, G>& pa, const float* acc_in, int64_t M, int64_t K,
                 cudaStream_t stream) {
  using Epi = StoreEpilogue<T, O, ACCUMULATE>;
  // One store path for the whole launch: TMA stores where every product's rows allow them, else
  // the threads' stores for all. The two paths stage in overlapping parts of the epilogue area and
  // only the TMA path waits for its boxes to be read, so a launch must never mix them.
  bool by_tma = BN >= 64 && M > 128;
  for (int g = 0; g < pa.count; ++g)
    by_tma = by_tma && (pa.N[g] * int64_t(sizeof(O))) % 16 == 0 && reinterpret_cast<uintptr_t>(pa.out[g]) % 16 == 0;
  typename Epi::Params ep[G] = {};
  for (int g = 0; g < pa.count; ++g) {
    typename Epi::Params& p = ep[g];
    p.bias = pa.bias[g];
    p.out = static_cast<O*>(pa.out[g]);
    p.acc_in = acc_in;
    p.store_by_tma = by_tma;
    if (p.store_by_tma) p.map_out = tma_map_2d(static_cast<const O*>(pa.out[g]), M, pa.N[g], 64);
  }
  sm90gemm::launch_products<T, TRANS_B, BN, COMPACT, Epi, G>(a, pa.b, ep, pa.N, pa.count, M, K, stream,
                                                             "linear (cuda)", pa.b_settled);
}

template <class T, class O, bool TRANS_B, bool ACCUMULATE = false, int G>
void launch_products(const T* a, const ProductArgs<T, O, G>& pa, int64_t M, int64_t K, cudaStream_t stream,
                     const float* acc_in = nullptr) {
  const TileChoice choice = tile_choice(M, Columns{pa.N, pa.count}, current_sm_count("linear (cuda)"), !TRANS_B);
  auto run = [&](auto width) {
    constexpr int BN = decltype(width)::value;
    if constexpr (BN <= 64 || BN >= 192) {
      if (choice.compact) return launch_tile<T, O, TRANS_B, BN, true, ACCUMULATE, G>(a, pa, acc_in, M, K, stream);
    }
    if constexpr (BN >= 64) launch_tile<T, O, TRANS_B, BN, false, ACCUMULATE, G>(a, pa, acc_in, M, K, stream);
  };
  switch (choice.width) {
    case 32: return run(std::integral_constant<int, 32>{});
    case 48:
      if constexpr (!TRANS_B) return run(std::integral_constant<int, 48>{});
      [[fallthrough]];
    case 64: return run(std::integral_constant<int, 64>{});
    case 128: return run(std::integral_constant<int, 128>{});
    case 192: return run(std::integral_constant<int, 192>{});
    default: return run(std::integral_constant<int, 256>{});
  }
}

// One product: y[M,N] = A·B (+ bias).
template <class T, class O, bool TRANS_B, bool ACCUMULATE = false>
void launch(const T* a, const T* b, const T* bias, void* out, int64_t M, int64_t N, int64_t K, cudaStream_t stream,
            const float* acc_in = nullptr, bool b_settled = false) {
  const ProductArgs<T, O, 1> pa{{b}, {bias}, {out}, {N}, 1, b_settled};
  launch_products<T, O, TRANS_B, ACCUMULATE, 1>(a, pa, M, K, stream, acc_in);
}

}  // namespace

bool sm90_path_available() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return major == 9 && minor == 0;
  }();
  return ok;
}

template <class T>
void gemm_sm90_forward(const T* x, const T* w, const T* bias, void* out, DType out_dtype, int64_t M, int64_t N,
                       int64_t K, cudaStream_t stream, bool weights_settled) {
  switch (out_dtype) {
    case DType::bf16: return launch<T, __nv_bfloat16, false>(x, w, bias, out, M, N, K, stream, nullptr, weights_settled);
    case DType::f16: return launch<T, __half, false>(x, w, bias, out, M, N, K, stream, nullptr, weights_settled);
    default: return launch<T, float, false>(x, w, bias, out, M, N, K, stream, nullptr, weights_settled);
  }
}

template <class T>
void gemm_sm90_forward_products(const T* x, const T* const* w, const T* const* bias, void* const* out,
                                const int64_t* N, int count, int64_t M, int64_t K, cudaStream_t stream,
                                bool weights_settled) {
  ProductArgs<T, T, kMaxLinearProducts> pa{};
  pa.count = count;
  pa.b_settled = weights_settled;
  for (int g = 0; g < count; ++g) {
    pa.b[g] = w[g];
    pa.bias[g] = bias[g];
    pa.out[g] = out[g];
    pa.N[g] = N[g];
  }
  launch_products<T, T, false, false, kMaxLinearProducts>(x, pa, M, K, stream);
}

template <class T>
bool gemm_sm90_forward_swiglu(const T* x, const T* w_gate, const T* w_up, T* y, int64_t M, int64_t N, int64_t K,
                              cudaStream_t stream, bool weights_settled) {
  // Decode-sized calls only (compact tiles, the threads' stores: what the plain launch takes there);
  // the width is the one the two products side by side would get, so the weights stream alike.
  if (M > 64) return false;
  const int64_t Ns[2] = {N, N};
  const TileChoice choice = tile_choice(M, Columns{Ns, 2}, current_sm_count("linear (cuda)"), true);
  if (!choice.compact) return false;
  using Epi = sm90gemm::SwiGluEpilogue<T, T>;
  typename Epi::Params ep{};
  ep.out = y;
  ep.store_by_tma = false;
  const T* const bs[2] = {w_gate, w_up};
  const typename Epi::Params eps[2] = {ep, ep};
  auto run = [&](auto width) {
    constexpr int BN = decltype(width)::value;
    sm90gemm::launch_products<T, false, BN, true, Epi, 2>(x, bs, eps, Ns, 2, M, K, stream, "linear (cuda)",
                                                          weights_settled);
    return true;
  };
  switch (choice.width) {
    case 32: return run(std::integral_constant<int, 32>{});
    case 48: return run(std::integral_constant<int, 48>{});
    case 64: return run(std::integral_constant<int, 64>{});
    case 192: return run(std::integral_constant<int, 192>{});
    case 256: return run(std::integral_constant<int, 256>{});
    default: return false;
  }
}

template <class T>
void gemm_sm90_input_grad(const T* dy, const T* w, void* dx, DType out_dtype, int64_t M, int64_t N, int64_t K,
                          cudaStream_t stream) {
  // dx[M,K] = dy[M,N]·w[N,K]: the kernel's K is N (the reduction), its N is K (dx's columns).
  switch (out_dtype) {
    case DType::bf16: return launch<T, __nv_bfloat16, true>(dy, w, nullptr, dx, M, K, N, stream);
    case DType::f16: return launch<T, __half, true>(dy, w, nullptr, dx, M, K, N, stream);
    default: return launch<T, float, true>(dy, w, nullptr, dx, M, K, N, stream);
  }
}

template <class T>
void gemm_sm90_input_grad_continue(const T* dy, const T* w, const float* acc_in, void* dx, DType out_dtype, int64_t M,
                                   int64_t N, int64_t K, cudaStream_t stream) {
  switch (out_dtype) {
    case DType::bf16: return launch<T, __nv_bfloat16, true, true>(dy, w, nullptr, dx, M, K, N, stream, acc_in);
    case DType::f16: return launch<T, __half, true, true>(dy, w, nullptr, dx, M, K, N, stream, acc_in);
    default: return launch<T, float, true, true>(dy, w, nullptr, dx, M, K, N, stream, acc_in);
  }
}

template void gemm_sm90_forward<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, void*,
                                               DType, int64_t, int64_t, int64_t, cudaStream_t, bool);
template void gemm_sm90_forward<__half>(const __half*, const __half*, const __half*, void*, DType, int64_t, int64_t,
                                        int64_t, cudaStream_t, bool);
template void gemm_sm90_forward_products<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16* const*,
                                                        const __nv_bfloat16* const*, void* const*, const int64_t*, int,
                                                        int64_t, int64_t, cudaStream_t, bool);
template void gemm_sm90_forward_products<__half>(const __half*, const __half* const*, const __half* const*,
                                                 void* const*, const int64_t*, int, int64_t, int64_t, cudaStream_t, bool);
template bool gemm_sm90_forward_swiglu<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*,
                                                       const __nv_bfloat16*, __nv_bfloat16*, int64_t, int64_t, int64_t,
                                                       cudaStream_t, bool);
template bool gemm_sm90_forward_swiglu<__half>(const __half*, const __half*, const __half*, __half*, int64_t, int64_t,
                                               int64_t, cudaStream_t, bool);
template void gemm_sm90_input_grad<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, void*, DType, int64_t,
                                                  int64_t, int64_t, cudaStream_t);
template void gemm_sm90_input_grad<__half>(const __half*, const __half*, void*, DType, int64_t, int64_t, int64_t,
                                           cudaStream_t);

template void gemm_sm90_input_grad_continue<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, const float*,
                                                           void*, DType, int64_t, int64_t, int64_t, cudaStream_t);
template void gemm_sm90_input_grad_continue<__half>(const __half*, const __half*, const float*, void*, DType, int64_t,
                                                    int64_t, int64_t, cudaStream_t);

}  // namespace samebits::cuda
