// Hopper (sm_90a) building blocks shared by the GEMM and attention kernels: shared-memory addresses, mbarriers,
// TMA tile loads, wgmma matrix descriptors and the m64n256k16 instruction.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace samebits::cuda::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(phase)
      : "memory");
}
// The producer / consumer ring: "full" completes when the producer's TMA bytes land, "empty" when
// every consumer warpgroup has released the stage. Called by the whole CTA.
__device__ __forceinline__ void init_ring_barriers(uint64_t* full, uint64_t* empty, int stages, int consumers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], uint32_t(consumers));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// A 3-D box (dims fastest first), as the attention kernels load a [tokens, heads, head_dim] tensor.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int32_t c0, int32_t c1, int32_t c2,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}

// The same box brought into L2 only (no shared memory, no barrier): a later tma_load_3d of it hits L2.
__device__ __forceinline__ void tma_prefetch_3d(const CUtensorMap* map, int32_t c0, int32_t c1, int32_t c2) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];" ::"l"(map), "r"(c0), "r"(c1),
               "r"(c2)
               : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int32_t c0, int32_t c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}

// An L2 eviction policy (createpolicy) for loads and stores that pass an L2::cache_hint: data read
// once and written once (a dW accumulator tile) goes first, before operands that many CTAs share.
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ void tma_load_2d_hint(void* dst, const CUtensorMap* map, int32_t c0, int32_t c1,
                                                 uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar)),
      "l"(policy)
      : "memory");
}
__device__ __forceinline__ void st_global_v2_hint(float* p, float a, float b, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;" ::"l"(p), "f"(a), "f"(b), "l"(policy) : "memory");
}

// TMA stores (shared -> global) in bulk groups: the copy engine reads the shared-memory box
// asynchronously and clips rows and columns outside the tensor. Before a box's shared memory is
// written again, wait until at most PENDING younger groups still have to read theirs; before the CTA
// exits, until every group is done. Writers fence their shared-memory stores for the async proxy
// (fence.proxy.async) before the issuing thread starts the copy.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(map), "r"(c0),
               "r"(c1), "r"(smem_u32(src))
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void tma_store_2d_hint(const CUtensorMap* map, const void* src, int32_t c0, int32_t c1,
                                                  uint64_t policy) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%1, %2}], [%3], %4;" ::"l"(map),
               "r"(c0), "r"(c1), "r"(smem_u32(src)), "l"(policy)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int PENDING>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(PENDING) : "memory");
}
__device__ __forceinline__ void tma_store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Thread-block clusters: this CTA's rank, a barrier over every thread of the cluster, an arrival
// on the same mbarrier in another CTA of the cluster (default .release.cta semantics, as a stage
// release needs: the MMAs that read the stage have completed; a cluster-scope release would fence
// all of this thread's memory traffic on every stage), and a TMA load written to the same
// shared-memory offset in every CTA of `cta_mask` (each CTA's own `bar` receives the bytes).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// A named barrier over `threads` threads (whole warps).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Arrives on a named barrier without waiting (the other side's bar.sync completes with it).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_remote(uint64_t* bar, uint32_t rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_u32(bar)),
      "r"(rank)
      : "memory");
}
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, int32_t c0, int32_t c1,
                                                      uint64_t* bar, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_u32(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar)), "h"(cta_mask)
      : "memory");
}
// Shared-memory matrix descriptor for a K-major tile with 128-byte swizzle (8-row groups of 1 KiB).
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Descriptor for an M- or N-major tile with 128-byte swizzle, as TMA lays out 64-column boxes: 64
// elements (128 bytes) of the output dimension per reduction row, 8 rows per 1 KiB atom
// (SBO = 1 KiB), and the next 64 elements in the next 8 KiB box (LBO = 8 KiB).
__device__ __forceinline__ uint64_t smem_desc_mn(const void* p) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(8192 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// The same with the next 64 output elements `lbo_bytes` further on (a box of more than 64 reduction
// rows: the attention's V tile, BN keys x 64 columns a box).
__device__ __forceinline__ uint64_t smem_desc_mn_lbo(const void* p, uint32_t lbo_bytes) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// The same for a 32-column (64-byte) tile with 64-byte swizzle: 8 reduction rows per 512-byte atom
// (SBO = 512 bytes), one atom across (LBO unused).
__device__ __forceinline__ uint64_t smem_desc_mn_64b(const void* p) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(4096 >> 4) << 16) | (uint64_t(512 >> 4) << 32) | (uint64_t(2) << 62);
}

// wgmma.m64nNk16 (N = 32, 48, 64, 128, 192 or 256) with A and B from shared memory, fp32 accumulators (N/2 a thread).
// TRANS_A / TRANS_B: the operand is M- / N-major (read along the output rows / columns), not K-major.
// Inline PTX takes one operand per accumulator register: the operand lists come from the SB_D*
// macros and the register-name lists are spelled out once per size.
#define SB_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define SB_D16(i) SB_D4(i), SB_D4(i + 4), SB_D4(i + 8), SB_D4(i + 12)
#define SB_D24(i) SB_D16(i), SB_D4(i + 16), SB_D4(i + 20)
#define SB_D32(i) SB_D16(i), SB_D16(i + 16)
#define SB_D64(i) SB_D32(i), SB_D32(i + 32)
#define SB_D96(i) SB_D64(i), SB_D32(i + 64)
#define SB_D128(i) SB_D64(i), SB_D64(i + 64)
#define SB_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define SB_R24 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}"
#define SB_R32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SB_R64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SB_R96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define SB_R128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
// One wgmma: SHAPE and TYPE name the instruction; A, B, SCALE, TA, TB are the operand numbers of the
// two descriptors, the scale-d flag and the two transpose immediates, which follow the registers.
#define SB_WGMMA(SHAPE, TYPE, REGS, A, B, SCALE, TA, TB)                                                \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                                 \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " REGS ", " A ", " B ", p, 1, 1, " TA \
  ", " TB ";\n}\n"
template <class T, bool TRANS_A, bool TRANS_B, int N>
struct Wgmma {
  static_assert(N == 32 || N == 48 || N == 64 || N == 128 || N == 192 || N == 256, "wgmma widths used by the GEMM kernels");
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value, "16-bit inputs");
  __device__ __forceinline__ static void mma(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    constexpr bool BF16 = std::is_same<T, __nv_bfloat16>::value;
// One width: the same statement with the bf16 or the f16 instruction.
#define SB_WGMMA_BOTH(SHAPE, REGS, D, A, B, SCALE, TA, TB)                                                 \
  if constexpr (BF16) {                                                                                  \
    asm volatile(SB_WGMMA(SHAPE, "bf16", REGS, A, B, SCALE, TA, TB)                                      \
                 : D                                                                                     \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(int(TRANS_A)), "n"(int(TRANS_B)));        \
  } else {                                                                                               \
    asm volatile(SB_WGMMA(SHAPE, "f16", REGS, A, B, SCALE, TA, TB)                                       \
                 : D                                                                                     \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(int(TRANS_A)), "n"(int(TRANS_B)));        \
  }
    if constexpr (N == 256) {
      SB_WGMMA_BOTH("m64n256k16", SB_R128, SB_D128(0), "%128", "%129", "%130", "%131", "%132")
    } else if constexpr (N == 192) {
      SB_WGMMA_BOTH("m64n192k16", SB_R96, SB_D96(0), "%96", "%97", "%98", "%99", "%100")
    } else if constexpr (N == 128) {
      SB_WGMMA_BOTH("m64n128k16", SB_R64, SB_D64(0), "%64", "%65", "%66", "%67", "%68")
    } else if constexpr (N == 64) {
      SB_WGMMA_BOTH("m64n64k16", SB_R32, SB_D32(0), "%32", "%33", "%34", "%35", "%36")
    } else if constexpr (N == 48) {
      SB_WGMMA_BOTH("m64n48k16", SB_R24, SB_D24(0), "%24", "%25", "%26", "%27", "%28")
    } else {
      SB_WGMMA_BOTH("m64n32k16", SB_R16, SB_D16(0), "%16", "%17", "%18", "%19", "%20")
    }
#undef SB_WGMMA_BOTH
  }
};
// wgmma.m64nNk16 (N = 32, 64 or 128) with A from registers (the m16n8k16 A fragment of each warp's 16
// rows: a[0] row r cols 2q..2q+1, a[1] row r + 8, a[2] / a[3] the same 8 columns on) and B from shared
// memory, N-major when TRANS_B (the attention's P·V: P in registers, V read along head_dim).
#define SB_WGMMA_RS(SHAPE, TYPE, REGS, A, B, TB) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"   \
  "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " REGS ", " A ", " B ", p, 1, 1, " TB ";\n}\n"
template <class T, bool TRANS_B, int N>
struct WgmmaRS {
  static_assert(N == 32 || N == 64 || N == 128, "register-A wgmma widths used by the attention kernels");
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value, "16-bit inputs");
  __device__ __forceinline__ static void mma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
    constexpr bool BF16 = std::is_same<T, __nv_bfloat16>::value;
#define SB_WGMMA_RS_BOTH(SHAPE, REGS, D, A, B, TB)                                                               \
  if constexpr (BF16) {                                                                                        \
    asm volatile(SB_WGMMA_RS(SHAPE, "bf16", REGS, A, B, TB)                                                    \
                 : D                                                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(int(TRANS_B)));                \
  } else {                                                                                                     \
    asm volatile(SB_WGMMA_RS(SHAPE, "f16", REGS, A, B, TB)                                                     \
                 : D                                                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(int(TRANS_B)));                \
  }
    if constexpr (N == 128) {
      SB_WGMMA_RS_BOTH("m64n128k16", SB_R64, SB_D64(0), "{%64, %65, %66, %67}", "%68", "%69")
    } else if constexpr (N == 64) {
      SB_WGMMA_RS_BOTH("m64n64k16", SB_R32, SB_D32(0), "{%32, %33, %34, %35}", "%36", "%37")
    } else {
      SB_WGMMA_RS_BOTH("m64n32k16", SB_R16, SB_D16(0), "{%16, %17, %18, %19}", "%20", "%21")
    }
#undef SB_WGMMA_RS_BOTH
  }
};
#undef SB_WGMMA_RS
#undef SB_WGMMA
#undef SB_R128
#undef SB_R96
#undef SB_R64
#undef SB_R32
#undef SB_R16
#undef SB_R24
#undef SB_D128
#undef SB_D96
#undef SB_D64
#undef SB_D32
#undef SB_D16
#undef SB_D24
#undef SB_D4

}  // namespace samebits::cuda::sm90
