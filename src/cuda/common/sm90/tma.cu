// Host side of the Hopper GEMM kernels: 2-D TMA tensor maps (the driver's encoder is looked up once).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <string>
#include <type_traits>

#include "cuda/common/runtime.cuh"
#include "cuda/common/sm90/tma.cuh"

namespace samebits::cuda::sm90 {

namespace {
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q), "linear (cuda)",
          "cuTensorMapEncodeTiled");
    if (q != cudaDriverEntryPointSuccess || !p) throw Error("linear (cuda)", "driver", "cuTensorMapEncodeTiled is unavailable");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}
}  // namespace

template <class T>
CUtensorMap tma_map_2d(const T* ptr, int64_t rows, int64_t cols, int box_rows, bool promote_256, int box_bytes) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * sizeof(T)};
  if (box_bytes != 128 && box_bytes != 64) throw Error("linear (cuda)", "tensor map", "box rows of 64 or 128 bytes");
  const cuuint32_t box[2] = {cuuint32_t(box_bytes / int(sizeof(T))), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUtensorMapDataType type = std::is_same<T, float>::value    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                    : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encoder()(&map, type, 2, const_cast<T*>(ptr), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                               box_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                               promote_256 ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_NONE,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("linear (cuda)", "tensor map", "cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ")");
  return map;
}

template <class T>
CUtensorMap tma_map_3d(const T* ptr, int64_t d2, int64_t d1, int64_t d0, int box1, int box2) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  CUtensorMap map;
  const cuuint64_t dims[3] = {cuuint64_t(d0), cuuint64_t(d1), cuuint64_t(d2)};
  const cuuint64_t strides[2] = {cuuint64_t(d0) * sizeof(T), cuuint64_t(d0 * d1) * sizeof(T)};
  const cuuint32_t box[3] = {64, cuuint32_t(box1), cuuint32_t(box2)};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUtensorMapDataType type = std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                  : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encoder()(&map, type, 3, const_cast<T*>(ptr), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("attention (cuda)", "tensor map", "cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ")");
  return map;
}
template CUtensorMap tma_map_3d<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int64_t, int64_t, int, int);
template CUtensorMap tma_map_3d<__half>(const __half*, int64_t, int64_t, int64_t, int, int);

template CUtensorMap tma_map_2d<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int64_t, int, bool, int);
template CUtensorMap tma_map_2d<__half>(const __half*, int64_t, int64_t, int, bool, int);
template CUtensorMap tma_map_2d<float>(const float*, int64_t, int64_t, int, bool, int);

}  // namespace samebits::cuda::sm90
