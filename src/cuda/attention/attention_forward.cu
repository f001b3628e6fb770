// CUDA causal GQA attention, forward: packed variable-length prefill, chunked prefill and decode
// against a KV cache, one kernel for all three. This file: the entry point (checks, rows no sequence
// covers) and the portable tensor-core path (mma.sync m16n8k16, sm_80 and later; bf16 / fp16,
// head_dim 64 or 128); a Hopper device runs attention_forward_sm90.cu instead (the device decides,
// never the shapes, so one card always gives one set of bits).
//
// Why this shape. A query's result must not depend on which other queries share its launch, so
// every reduction a query sees is fixed by its own position:
//  * its scores q·k over head_dim: one mma chain in ascending 16-wide k-steps, row by row (an mma
//    never mixes rows, so the other rows of the tile change nothing);
//  * its softmax over keys: key blocks of 64 aligned to key position 0 of its sequence, walked in
//    ascending order, an online softmax across blocks (m, l, o rescaled by exp(m − m_new)), the
//    block's row max and row sum by a fixed quad butterfly. A block past the query's position is
//    fully masked for it: p = 0 and the rescale factor is exactly 1, so it changes no bit — which is
//    why a decode step (the query alone, its blocks only) and a prefill tile (blocks up to the
//    tile's last query) give the same bits, and a chunk of any size against the cache too.
//  * P·V: P rounded to the input dtype (as FlashAttention does) and one mma chain a block.
// A CTA is 4 warps × 16 query rows of one sequence and one query head; K and V blocks are staged in
// shared memory for all four warps. No atomics; no split over keys (decode speed at long contexts,
// with splits at fixed absolute positions, is the next step).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <string>
#include <vector>

#include "cuda/attention/attention_common.cuh"
#include "cuda/attention/attention_host.hpp"
#include "cuda/attention/attention_sm90.hpp"
#include "cuda/common/host_upload.cuh"
#include "cuda/common/runtime.cuh"
#include "cuda/common/scratch.cuh"
#include "cuda/linear/gemm.cuh"
#include "ops/registry.hpp"
#include "samebits/error.hpp"
#include "samebits/ops.hpp"

namespace samebits::cuda {
namespace {

using attention::join2;
using attention::mma16816;
using attention::pack2;
using attention::quad_max;
using attention::quad_sum;

constexpr int WARPS = 4, THREADS = 32 * WARPS, BLOCK_Q = 16 * WARPS, BLOCK_K = 64;

// One tile of a sequence's queries: rows [q_row, q_row + rows), the first at absolute position
// first_pos, against the k_len keys of sequence `seq` (rows k_row … or its pages).
struct Tile {
  int32_t q_row, rows, k_row, k_len, first_pos, seq;
};

struct FwdParams {
  const void *q, *k, *v;
  void* out;
  float* lse;
  const Tile* tiles;
  attention::KeyPages pages;
  int Hq, Hkv;
  float scale;
};

template <class T, int D>
__global__ void __launch_bounds__(THREADS) attention_forward_kernel(const __grid_constant__ FwdParams p) {
  constexpr int PAD = 8, STRIDE = D + PAD;  // row stride of the staged blocks, in elements
  __shared__ __align__(16) uint16_t ks[BLOCK_K * STRIDE], vs[BLOCK_K * STRIDE];
  const Tile tile = p.tiles[blockIdx.x];
  const int h = blockIdx.y, hk = h / (p.Hq / p.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad_row = lane / 4, quad_col = (lane % 4) * 2;
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  const uint16_t* kg = static_cast<const uint16_t*>(p.k);
  const uint16_t* vg = static_cast<const uint16_t*>(p.v);

  // This thread's query rows (a: quad_row, b: quad_row + 8 of the warp's 16) and their A fragments.
  const int ra = warp * 16 + quad_row, rb = ra + 8;
  const bool live_a = ra < tile.rows, live_b = rb < tile.rows;
  const int pos_a = tile.first_pos + ra, pos_b = tile.first_pos + rb;
  uint32_t qa[D / 16][4];
  auto q_word = [&](int r, bool live, int col) -> uint32_t {
    if (!live) return 0u;
    return *reinterpret_cast<const uint32_t*>(q + ((int64_t(tile.q_row) + r) * p.Hq + h) * D + col);
  };
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk * 16 + quad_col;
    qa[kk][0] = q_word(ra, live_a, c);
    qa[kk][1] = q_word(rb, live_b, c);
    qa[kk][2] = q_word(ra, live_a, c + 8);
    qa[kk][3] = q_word(rb, live_b, c + 8);
  }
  float o[D / 8][4] = {};
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

  const int last_pos = tile.first_pos + tile.rows - 1;  // the tile's last query sees keys 0 … last_pos
  const int blocks = last_pos / BLOCK_K + 1;
  for (int kb = 0; kb < blocks; ++kb) {
    __syncthreads();  // the previous block's readers are done
    constexpr int CHUNKS = D / 8;  // 16-byte pieces of a row
    for (int c = threadIdx.x; c < BLOCK_K * CHUNKS; c += THREADS) {
      const int r = c / CHUNKS, col = (c % CHUNKS) * 8, key = kb * BLOCK_K + r;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
      if (key < tile.k_len) {
        const int64_t at = (p.pages.row(tile.seq, tile.k_row, key) * p.Hkv + hk) * D + col;
        kv = *reinterpret_cast<const uint4*>(kg + at);
        vv = *reinterpret_cast<const uint4*>(vg + at);
      }
      *reinterpret_cast<uint4*>(&ks[r * STRIDE + col]) = kv;
      *reinterpret_cast<uint4*>(&vs[r * STRIDE + col]) = vv;
    }
    __syncthreads();

    // S = Q·Kᵀ for the warp's 16 rows and the block's 64 keys (8 n-tiles of 8 keys).
    float s[BLOCK_K / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nt = 0; nt < BLOCK_K / 8; ++nt) {
        const uint16_t* krow = &ks[(nt * 8 + quad_row) * STRIDE + kk * 16 + quad_col];
        mma16816<T>(s[nt], qa[kk], *reinterpret_cast<const uint32_t*>(krow), *reinterpret_cast<const uint32_t*>(krow + 8));
      }
    }
    // Scale, causal mask, and the block's row maxima.
    float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < BLOCK_K / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kb * BLOCK_K + nt * 8 + quad_col + (e & 1), pos = e < 2 ? pos_a : pos_b;
        s[nt][e] = key <= pos ? __fmul_rn(s[nt][e], p.scale) : -INFINITY;
      }
      mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
      mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
    }
    quad_max(mx_a, mx_b);
    const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
    // A row with no visible key yet (only rows past the tile: block 0 always shows key 0) keeps
    // m = −inf; its factors are then 0, not NaN.
    const float alpha_a = mn_a == -INFINITY ? 1.0f : expf(__fsub_rn(m_a, mn_a));
    const float alpha_b = mn_b == -INFINITY ? 1.0f : expf(__fsub_rn(m_b, mn_b));
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
    for (int nt = 0; nt < BLOCK_K / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float mn = e < 2 ? mn_a : mn_b;
        s[nt][e] = s[nt][e] == -INFINITY ? 0.0f : expf(__fsub_rn(s[nt][e], mn));
      }
      sum_a = __fadd_rn(sum_a, __fadd_rn(s[nt][0], s[nt][1]));
      sum_b = __fadd_rn(sum_b, __fadd_rn(s[nt][2], s[nt][3]));
    }
    quad_sum(sum_a, sum_b);  // a butterfly: every lane of the quad ends with the same bits
    l_a = __fadd_rn(__fmul_rn(l_a, alpha_a), sum_a);
    l_b = __fadd_rn(__fmul_rn(l_b, alpha_b), sum_b);
    m_a = mn_a, m_b = mn_b;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      o[dn][0] = __fmul_rn(o[dn][0], alpha_a), o[dn][1] = __fmul_rn(o[dn][1], alpha_a);
      o[dn][2] = __fmul_rn(o[dn][2], alpha_b), o[dn][3] = __fmul_rn(o[dn][3], alpha_b);
    }
    // O += P·V: P's accumulator layout is the A fragment of the next mma (16 keys a k-step).
#pragma unroll
    for (int t = 0; t < BLOCK_K / 16; ++t) {
      const uint32_t pa[4] = {pack2<T>(s[2 * t][0], s[2 * t][1]), pack2<T>(s[2 * t][2], s[2 * t][3]),
                              pack2<T>(s[2 * t + 1][0], s[2 * t + 1][1]), pack2<T>(s[2 * t + 1][2], s[2 * t + 1][3])};
      const int key0 = t * 16 + quad_col;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        const int col = dn * 8 + quad_row;
        const uint32_t b0 = join2(vs[key0 * STRIDE + col], vs[(key0 + 1) * STRIDE + col]);
        const uint32_t b1 = join2(vs[(key0 + 8) * STRIDE + col], vs[(key0 + 9) * STRIDE + col]);
        mma16816<T>(o[dn], pa, b0, b1);
      }
    }
  }

  // out = o / l, lse = m + log(l).
  auto store_row = [&](int r, bool live, bool half, float l, float m) {
    if (!live) return;
    const int64_t row = int64_t(tile.q_row) + r;
    uint32_t* dst = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.out) + (row * p.Hq + h) * D);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      dst[(dn * 8 + quad_col) / 2] =
          pack2<T>(__fdiv_rn(half ? o[dn][2] : o[dn][0], l), __fdiv_rn(half ? o[dn][3] : o[dn][1], l));
    if (p.lse && lane % 4 == 0) p.lse[row * p.Hq + h] = __fadd_rn(m, logf(l));
  };
  store_row(ra, live_a, false, l_a, m_a);
  store_row(rb, live_b, true, l_b, m_b);
}

__global__ void fill_kernel(float* p, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) p[i] = value;
}

void attention_forward(const Context& ctx, const AttentionForwardArgs& a) {
  const char* op = "attention_forward";
  const int64_t Tq = a.q.shape[0], Hq = a.q.shape[1], D = a.q.shape[2], Hkv = a.k.shape[1];
  attention::require_kernel_shapes(op, a.q, {{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"out", &a.out}});
  if (a.out.dtype != a.q.dtype) throw Unsupported(op, "out", "the CUDA attention writes out in q's dtype");
  if (a.block_table.present() && !paged_attention_takes(Backend::cuda, a.page_size))
    throw Unsupported(op, "page_size", "the CUDA attention takes page sizes that are multiples of 8 and divide 128 "
                                       "or are multiples of it (got " + std::to_string(a.page_size) + ")");
  const cudaStream_t stream = stream_of(ctx.stream);
  // The query rows no sequence covers: out = 0, lse = −inf.
  const auto* s = a.seqs.as<const int32_t>();
  std::vector<std::pair<int64_t, int64_t>> covered;
  for (int64_t b = 0; b < a.seqs.shape[0]; ++b) covered.emplace_back(s[4 * b], int64_t(s[4 * b]) + s[4 * b + 1]);
  attention::for_each_uncovered(covered, Tq, [&](int64_t begin, int64_t end) {
    const size_t row_bytes = size_t(Hq * D) * dtype_size(a.out.dtype);
    check(cudaMemsetAsync(static_cast<char*>(a.out.data) + size_t(begin) * row_bytes, 0, size_t(end - begin) * row_bytes, stream), op, "clear rows");
    if (a.lse.present()) {
      fill_kernel<<<unsigned(std::min<int64_t>((end - begin) * Hq / 256 + 1, 1024)), 256, 0, stream>>>(
          a.lse.as<float>() + begin * Hq, (end - begin) * Hq, -INFINITY);
      check(cudaGetLastError(), op, "kernel launch");
    }
  });
  // A paged cache: the kernels read a device copy of the block table.
  attention::KeyPages pages;
  const bool paged = a.block_table.present();
  const bool uploaded = paged && a.block_table_device.present();
  ScratchBuffer table_buf(paged && !uploaded ? size_t(a.block_table.numel()) * sizeof(int32_t) : 0, stream, op);
  if (uploaded) {
    pages = {a.block_table_device.as<const int32_t>(), int(a.block_table.shape[1]), int(a.page_size)};
  } else if (paged) {
    upload_to_device(table_buf.as<int32_t>(), a.block_table.data, size_t(a.block_table.numel()) * sizeof(int32_t),
                     stream, op, "block table");
    pages = {table_buf.as<const int32_t>(), int(a.block_table.shape[1]), int(a.page_size)};
  }
  if (sm90_path_available()) {  // chosen by the device alone, never by the shapes
    attention::attention_forward_sm90(a, pages, stream, op);
    return;
  }
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < a.seqs.shape[0]; ++b) {
    const int32_t q_row = s[4 * b], q_len = s[4 * b + 1], k_row = s[4 * b + 2], k_len = s[4 * b + 3];
    for (int32_t t0 = 0; t0 < q_len; t0 += BLOCK_Q)
      tiles.push_back({q_row + t0, std::min(BLOCK_Q, q_len - t0), k_row, k_len, k_len - q_len + t0, int32_t(b)});
  }
  if (tiles.empty()) return;
  ScratchBuffer tile_buf(tiles.size() * sizeof(Tile), stream, op);
  upload_to_device(tile_buf.as<Tile>(), tiles.data(), tiles.size() * sizeof(Tile), stream, op, "tile table");
  const FwdParams p{a.q.data, a.k.data, a.v.data, a.out.data, a.lse.present() ? a.lse.as<float>() : nullptr,
                    tile_buf.as<const Tile>(), pages, int(Hq), int(Hkv),
                    float(a.scale > 0 ? a.scale : 1.0 / std::sqrt(double(D)))};
  const dim3 grid(unsigned(tiles.size()), unsigned(Hq));
  attention::dispatch_type_and_head_dim(a.q.dtype, D, [&](auto t, auto d) {
    attention_forward_kernel<decltype(t), decltype(d)::value><<<grid, THREADS, 0, stream>>>(p);
  });
  check(cudaGetLastError(), op, "kernel launch");
  // The tile table must outlive the kernel: ScratchBuffer frees it in stream order.
}

}  // namespace

SAMEBITS_REGISTER_KERNEL(attention_forward, Backend::cuda, AttentionForwardArgs, attention_forward);

}  // namespace samebits::cuda
