// Hopper (sm_90a) GEMM y = x·wᵀ: TMA loads, wgmma, a warp-specialised producer / consumer pipeline
// on mbarriers.
//
// Why this shape. A 128 x 128 output tile per CTA with K in steps of 64 (four 16-deep wgmma steps,
// ascending), for every M: an output element is always the same sequence of
// wgmma.m64n128k16 instructions over ascending K, accumulated in fp32 registers, so its bits never
// depend on M, on its neighbours or on the grid (rules 1-3; no split-K, no atomics). Warpgroup 0 is
// the producer: one thread streams A (x) and B (w) tiles with the bulk tensor copy engine into a
// 4-stage ring (128B-swizzled, 32 KiB a stage) and signals "full" mbarriers with the byte count;
// warpgroups 1 and 2 each own 64 rows of the tile, wait on "full", issue wgmma straight from shared
// memory, and release the stage on its "empty" mbarrier. Out-of-range rows, columns and K are
// zero-filled by the copy engine, so edge tiles run the same instructions. Requirements: K a
// multiple of 8 and 16-byte aligned rows (TMA strides); other shapes take the generic path, which is
// a property of the weight, never of M.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include "cuda/common/runtime.cuh"
#include "cuda/gemm/gemm.cuh"

namespace samebits::cuda {
namespace {

constexpr int BM = 128, BN = 128, BK = 64, STAGES = 4, CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
constexpr int A_TILE = BM * BK, B_TILE = BN * BK;  // elements
constexpr size_t SMEM_BYTES = size_t(STAGES) * (A_TILE + B_TILE) * 2 + 2 * STAGES * 8 + 1024;

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
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int32_t c0, int32_t c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}

// Shared-memory matrix descriptor for a K-major tile with 128-byte swizzle (8-row groups of 1 KiB).
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

template <class T>
struct Wgmma;

template <>
struct Wgmma<__nv_bfloat16> {
  __device__ __forceinline__ static void mma(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};
template <>
struct Wgmma<__half> {
  __device__ __forceinline__ static void mma(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

__device__ __forceinline__ void store_one(void* out, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::bf16: static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v); break;
    case DType::f16: static_cast<__half*>(out)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(out)[i] = v; break;
  }
}

template <class T>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_sm90(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b, const T* bias,
              void* out, DType out_dtype, int64_t M, int64_t N, int64_t K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* sa = reinterpret_cast<T*>(base);
  T* sb = sa + STAGES * A_TILE;
  uint64_t* full = reinterpret_cast<uint64_t*>(sb + STAGES * B_TILE);
  uint64_t* empty = full + STAGES;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int64_t m0 = int64_t(blockIdx.y) * BM, n0 = int64_t(blockIdx.x) * BN;
  const int kt_count = int((K + BK - 1) / BK);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer
    if (t == 0) {
      for (int kt = 0; kt < kt_count; ++kt) {
        const int s = kt % STAGES;
        if (kt >= STAGES) mbar_wait(&empty[s], ((kt / STAGES) - 1) & 1);
        mbar_expect_tx(&full[s], uint32_t((A_TILE + B_TILE) * sizeof(T)));
        tma_load_2d(sa + s * A_TILE, &map_a, kt * BK, int32_t(m0), &full[s]);
        tma_load_2d(sb + s * B_TILE, &map_b, kt * BK, int32_t(n0), &full[s]);
      }
    }
    return;
  }
  // consumers: warpgroup c owns rows c*64 .. c*64 + 63 of the tile
  const int c = wg - 1;
  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.0f;
  for (int kt = 0; kt < kt_count; ++kt) {
    const int s = kt % STAGES;
    mbar_wait(&full[s], (kt / STAGES) & 1);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const uint64_t da = smem_desc(sa + s * A_TILE + c * 64 * BK) + uint64_t(kk * 2);  // +32 bytes per k16
      const uint64_t db = smem_desc(sb + s * B_TILE) + uint64_t(kk * 2);
      Wgmma<T>::mma(d, da, db, 1);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    if (t == 0) mbar_arrive(&empty[s]);
  }
  // Epilogue: accumulator layout of m64nNk16 — for n8 chunk j, thread t holds rows
  // 16*(t/32) + (t%32)/4 (+8) and columns 8j + 2*(t%4) (+1).
  const int warp = t / 32, lane = t % 32;
  const int64_t row0 = m0 + c * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + h * 8;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t col = n0 + 8 * j + 2 * (lane % 4) + e;
        if (row < M && col < N) {
          float v = d[j * 4 + h * 2 + e];
          if (bias) v += float(bias[col]);
          store_one(out, out_dtype, row * N + col, v);
        }
      }
    }
  }
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q),
          "linear (cuda)", "cuTensorMapEncodeTiled");
    if (q != cudaDriverEntryPointSuccess || !p) throw Error("linear (cuda)", "driver", "cuTensorMapEncodeTiled is unavailable");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A row-major [rows, K] operand as a 2-D tensor map with a box of `box_rows` x 64, 128B swizzle.
template <class T>
CUtensorMap make_map(const T* ptr, int64_t rows, int64_t K, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(K) * sizeof(T)};
  const cuuint32_t box[2] = {cuuint32_t(BK), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode_fn()(&map, sizeof(T) == 2 && std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                                          : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                 2, const_cast<T*>(ptr), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw Error("linear (cuda)", "tensor map", "cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ")");
  return map;
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
                       int64_t K, cudaStream_t stream) {
  static bool configured = false;
  if (!configured) {
    check(cudaFuncSetAttribute(gemm_sm90<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(SMEM_BYTES)),
          "linear (cuda)", "shared memory");
    configured = true;
  }
  const CUtensorMap ma = make_map(x, M, K, BM), mb = make_map(w, N, K, BN);
  const dim3 grid(unsigned((N + BN - 1) / BN), unsigned((M + BM - 1) / BM));
  gemm_sm90<T><<<grid, THREADS, SMEM_BYTES, stream>>>(ma, mb, bias, out, out_dtype, M, N, K);
  check(cudaGetLastError(), "linear (cuda)", "sm90 kernel launch");
}

template void gemm_sm90_forward<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, void*,
                                               DType, int64_t, int64_t, int64_t, cudaStream_t);
template void gemm_sm90_forward<__half>(const __half*, const __half*, const __half*, void*, DType, int64_t, int64_t,
                                        int64_t, cudaStream_t);

}  // namespace samebits::cuda
