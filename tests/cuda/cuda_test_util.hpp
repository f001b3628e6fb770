// Test helpers for the CUDA backend: a device copy of a host tensor (on DeviceTensor), a CUDA
// context, a fixture that skips without a GPU, raw-bit equality.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "samebits/context.hpp"
#include "samebits/device.hpp"
#include "samebits/device_tensor.hpp"
#include "samebits/host_tensor.hpp"
#include "samebits/rng.hpp"

namespace samebits::testing_cuda {


// A device copy of a host tensor (or zeros of a shape), for the tests' kernel arguments.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const HostTensor& h) : t_(DeviceTensor::from_host(Backend::cuda, h)) {}
  DeviceBuffer(DType d, std::vector<int64_t> shape) : t_(Backend::cuda, d, std::move(shape)) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  TensorView view() const { return t_.view(); }
  TensorView rows(int64_t b, int64_t e) const { return view().rows(b, e); }
  HostTensor host() const { return t_.to_host(); }

 private:
  DeviceTensor t_;
};

// A test fixture that skips its tests where no CUDA device is visible.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_present()) GTEST_SKIP() << "no CUDA device";
  }
};

inline Context cuda_ctx() {
  Context c;
  c.backend = Backend::cuda;
  return c;
}

// Raw-bit equality of two host tensors (sizes first), failing the calling test with `what`.
inline void expect_same_bits(const HostTensor& got, const HostTensor& want, const std::string& what) {
  ASSERT_EQ(got.bytes(), want.bytes()) << what;
  ASSERT_EQ(std::memcmp(got.data(), want.data(), got.bytes()), 0) << what;
}

// A device copy of `h` that starts `shift` elements into its allocation (shift 1: not 16-byte
// aligned, so every access goes element by element).
class ShiftedBuffer {
 public:
  ShiftedBuffer(const HostTensor& h, int64_t shift) : shift_(shift), shape_(h.shape()), dt_(h.dtype()) {
    HostTensor padded(h.dtype(), {h.numel() + 16});
    std::memcpy(static_cast<char*>(padded.data()) + shift * dtype_size(dt_), h.data(), h.bytes());
    buf_ = std::make_unique<DeviceBuffer>(padded);
  }
  TensorView view() const {
    TensorView v = TensorView::of(static_cast<char*>(buf_->view().data) + shift_ * dtype_size(dt_), dt_, shape_.data(),
                                  int(shape_.size()), Device::cuda);
    return v;
  }
  HostTensor host() const {
    const HostTensor all = buf_->host();
    HostTensor h(dt_, shape_);
    std::memcpy(h.data(), static_cast<const char*>(all.data()) + shift_ * dtype_size(dt_), h.bytes());
    return h;
  }

 private:
  int64_t shift_;
  std::vector<int64_t> shape_;
  DType dt_;
  std::unique_ptr<DeviceBuffer> buf_;
};

}  // namespace samebits::testing_cuda

// The names every CUDA test file uses (this header is included by test sources only).
using namespace samebits;  // NOLINT(google-build-using-namespace)
using samebits::HostTensor;
using samebits::Rng;
using samebits::testing_cuda::cuda_ctx;
using samebits::testing_cuda::CudaTest;
using samebits::testing_cuda::DeviceBuffer;
using samebits::testing_cuda::expect_same_bits;
using samebits::testing_cuda::ShiftedBuffer;
