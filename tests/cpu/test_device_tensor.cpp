// DeviceTensor: row copies (single runs and strided blocks) and their errors, on the CPU backend and
// (where a GPU is visible) on CUDA, which must agree byte for byte.
#include <gtest/gtest.h>

#include <cstring>

#include "samebits/device_tensor.hpp"
#include "samebits/error.hpp"
#include "tests/cuda/cuda_test_util.hpp"


namespace {

HostTensor numbered(int64_t rows, int64_t cols) {
  HostTensor h(DType::f32, {rows, cols});
  for (int64_t i = 0; i < h.numel(); ++i) h.set(i, double(i));
  return h;
}

void check_block_copies(Backend backend) {
  const DeviceTensor src = DeviceTensor::from_host(backend, numbered(12, 3));
  DeviceTensor dst(backend, DType::f32, {20, 3});
  // 3 runs of 2 rows: src rows 1-2, 3-4, 5-6 to dst rows 4-5, 10-11, 16-17.
  dst.copy_row_blocks_from(src, 1, 2, 4, 6, 2, 3);
  dst.copy_rows_from(src, 11, 0, 1);  // a single row
  const HostTensor h = dst.to_host();
  for (int64_t r = 0; r < 20; ++r) {
    int64_t from = -1;
    if (r == 0) from = 11;
    for (int64_t b = 0; b < 3; ++b)
      if (r >= 4 + 6 * b && r < 6 + 6 * b) from = 1 + 2 * b + (r - 4 - 6 * b);
    for (int64_t c = 0; c < 3; ++c)
      EXPECT_EQ(h.get(r * 3 + c), from < 0 ? 0.0 : double(from * 3 + c)) << "row " << r << " col " << c;
  }
  const HostTensor part = dst.rows_to_host(10, 12);
  EXPECT_EQ(part.get(0), double(3 * 3));
  for (auto bad : {std::vector<int64_t>{8, 2, 0, 2, 2, 3},    // the last source run past the end
                   std::vector<int64_t>{1, 1, 4, 6, 2, 3},    // source runs overlap
                   std::vector<int64_t>{1, 2, 15, 6, 2, 2}})  // the last destination run past the end
    EXPECT_THROW(dst.copy_row_blocks_from(src, bad[0], bad[1], bad[2], bad[3], bad[4], bad[5]), Error);
  const DeviceTensor other = DeviceTensor::from_host(backend, numbered(4, 5));
  EXPECT_THROW(dst.copy_rows_from(other, 0, 0, 1), Error);  // rows of another size
}

}  // namespace

TEST(DeviceTensor, RowBlockCopiesLandWhereAskedAndBadRangesAreErrors) { check_block_copies(Backend::cpu); }

class CudaDeviceTensor : public testing_cuda::CudaTest {};

TEST_F(CudaDeviceTensor, RowBlockCopiesLandWhereAskedAndBadRangesAreErrors) { check_block_copies(Backend::cuda); }
