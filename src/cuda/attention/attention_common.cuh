// Pieces the CUDA attention kernels share: 16-bit packing of fp32 pairs, the m16n8k16 MMA, base-2
// exponentials and the fixed fold that combines the softmax state of one key span into a running one.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace samebits::cuda::attention {

template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two 16-bit elements as one 32-bit word (lo: a).
__device__ __forceinline__ uint32_t join2(uint16_t a, uint16_t b) { return uint32_t(a) | (uint32_t(b) << 16); }

// c += a · b for one m16n8k16 tile, fp32 accumulators.
template <class T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Where a sequence's keys live: rows k_row + j of k / v, or (table set: a paged cache) row
// table[seq · cols + j / page_size] · page_size + j % page_size. The table is a device copy of
// the caller's host block table.
struct KeyPages {
  const int32_t* table = nullptr;
  int cols = 0, page_size = 0;
  __device__ __forceinline__ int64_t row(int seq, int k_row, int key) const {
    return table ? int64_t(table[int64_t(seq) * cols + key / page_size]) * page_size + key % page_size
                 : int64_t(k_row) + key;
  }
};

// ldmatrix: four 8×8 16-bit matrices from shared memory, lane l giving the address of row l % 8 of
// matrix l / 8. Without .trans lane l receives row l / 4, columns 2(l % 4) and +1 of each matrix
// (an A fragment, or a B fragment of an [n, k] tile); with .trans, column l / 4, rows 2(l % 4) and
// +1 (a B fragment of a [k, n] tile).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
}

// The same for two 8×8 matrices (lanes 0–15 give the addresses; 16–31's are not read but must be valid).
__device__ __forceinline__ void ldsm_x2_trans(uint32_t (&r)[2], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
}

// A row of an MMA accumulator lies across the four lanes of a quad: its max, and its sum
// ((l0 + l1) + (l2 + l3): the xor-1 partner first), the same bits in each lane; two rows at once.
__device__ __forceinline__ void quad_max(float& a, float& b) {
#pragma unroll
  for (int m = 1; m <= 2; m *= 2) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, m));
    b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, m));
  }
}
__device__ __forceinline__ void quad_sum(float& a, float& b) {
#pragma unroll
  for (int m = 1; m <= 2; m *= 2) {
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, m));
    b = __fadd_rn(b, __shfl_xor_sync(0xffffffffu, b, m));
  }
}

// A 4 × 4 transpose across a quad's lanes: lane q's w[m] ends in lane m's w[q] (q, m = 0 … 3), in two
// exchanges (with lane q ^ 1, then q ^ 2), each lane sending the two words whose index differs from
// its own lane in that bit. `mask`: the lanes taking part (whole quads). An accumulator row's
// packed outputs, two columns a lane in each 8-column tile, become four consecutive tiles' 16 bytes
// a lane: one 16-byte store instead of four 4-byte ones.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], unsigned mask) {
  const int q = int(threadIdx.x % 4);
#pragma unroll
  for (int bit = 1; bit <= 2; bit *= 2) {
    const bool upper = (q & bit) != 0;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      if (m & bit) continue;  // the pair of words m and m | bit: the lower lane keeps m, the upper m | bit
      const uint32_t got = __shfl_xor_sync(mask, upper ? w[m] : w[m | bit], bit);
      if (upper) w[m] = got;
      else w[m | bit] = got;
    }
  }
}

// 2^x by the hardware's ex2 (flush-to-zero; ex2(−inf) = 0): the exponentials of the softmax are
// 2^(s·c − m·c) with c = scale·log2(e), one FFMA and one ex2 a score.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One block's step of a row's online softmax: the new max mn = max(m, mx) of the raw scores, its
// value in exp2 units mc (0 for a row that has seen no key of the span yet: its scores are all −inf,
// p = 0, and the rescale multiplies zeros), and the returned rescale 2^(m·c − mc) of what the span
// summed so far — exactly 1 where the max did not move (both products round alike). Every consumer
// (wgmma and narrow) takes these from here, so they round alike by construction.
__device__ __forceinline__ float online_step(float m, float mx, float c, float& mn, float& mc) {
  mn = fmaxf(m, mx);
  mc = mn == -INFINITY ? 0.0f : __fmul_rn(mn, c);
  return exp2_ftz(__fsub_rn(__fmul_rn(m, c), mc));
}

// The fold of a key span's softmax state (m: its row max of the raw scores, l = Σ 2^((s − m)·c),
// o = Σ 2^((s − m)·c)·v) into the running state (M, L, O) of the spans before it, left to right:
//   M' = max(M, m), a = 2^(M·c − M'·c), b = 2^(m·c − M'·c) (products rounded, then subtracted),
//   L' = L·a + l·b, O' = O·a + o·b.
// A span the row sees no key of (m = −inf) leaves the state as it is. Every path that combines
// spans — the Hopper kernel folding inside a CTA and the split-KV combine kernel — calls these two
// functions, so the same spans give the same bits whichever path ran. The first fold starts from
// M = −inf, L = 0, O = 0 (a = 0).
__device__ __forceinline__ bool fold_stats(float& M, float& L, float m, float l, float c, float& a, float& b) {
  if (m == -INFINITY) return false;
  const float mn = fmaxf(M, m), mc = __fmul_rn(mn, c);
  a = exp2_ftz(__fsub_rn(__fmul_rn(M, c), mc));  // exactly 1 where M = M' (both products round alike)
  b = exp2_ftz(__fsub_rn(__fmul_rn(m, c), mc));
  L = __fadd_rn(__fmul_rn(L, a), __fmul_rn(l, b));
  M = mn;
  return true;
}
__device__ __forceinline__ float fold_value(float O, float o, float a, float b) {
  return __fadd_rn(__fmul_rn(O, a), __fmul_rn(o, b));
}
// lse = M·scale + ln L.
__device__ __forceinline__ float final_lse(float M, float L, float scale) { return __fadd_rn(__fmul_rn(M, scale), logf(L)); }

}  // namespace samebits::cuda::attention
