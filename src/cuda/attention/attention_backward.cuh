// What the two files of the CUDA attention backward share: the tile and parameter records and the
// Hopper dK/dV pass that attention_backward.cu calls where the device has it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "samebits/ops.hpp"

namespace samebits::cuda::attention {

// Keys (dK/dV) or queries (dQ) of a sequence from index `first` of its keys / queries; the
// sequence's query i sits at position k_len − q_len + i.
struct BwdTile {
  int32_t q_row, q_len, k_row, k_len, first;
};

struct BwdParams {
  const uint16_t *q, *k, *v, *dout;
  const float* lse2;   // [Tq, Hq]: lse·log2(e)
  const float* delta;  // [Tq, Hq]: Σ dO ∘ O
  void *dq, *dk, *dv;
  bool dq_f32, dk_f32, dv_f32;
  const BwdTile* tiles;
  int Hq, Hkv;
  float scale, c2;  // c2 = scale·log2(e)
};

// Keys a tile of the Hopper dK/dV pass owns; queries a tile of the Hopper dQ pass owns.
constexpr int DKDV_SM90_KEYS = 128, DQ_SM90_QUERIES = 128;

// The Hopper (sm_90a) dK/dV pass over `tiles` (p.tiles, device memory, DKDV_SM90_KEYS keys each):
// TMA + wgmma, the same order of terms as the portable pass (GQA heads ascending, query blocks of
// 64 ascending), its own bits.
void attention_dkdv_sm90(const AttentionBackwardArgs& a, const BwdParams& p, int tiles, cudaStream_t stream,
                         const char* op);
// The Hopper dQ pass over `tiles` (DQ_SM90_QUERIES queries each): TMA + wgmma, key blocks of 64
// from key 0 ascending (the portable pass's order of terms), its own bits.
void attention_dq_sm90(const AttentionBackwardArgs& a, const BwdParams& p, int tiles, cudaStream_t stream,
                       const char* op);

}  // namespace samebits::cuda::attention
