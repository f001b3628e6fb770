// Test helpers for the CUDA backend: a device copy of a host tensor, a CUDA context, a fixture that
// skips without a GPU, raw-bit equality.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "samebits/context.hpp"
#include "samebits/device.hpp"
#include "samebits/harness.hpp"

namespace samebits::testing_cuda {

using harness::HostTensor;

class DeviceBuffer {
 public:
  explicit DeviceBuffer(const HostTensor& h) : bytes_(h.bytes()), ptr_(device_alloc(Backend::cuda, bytes_)), t_(h) {
    copy_to_device(Backend::cuda, ptr_, h.data(), bytes_);
  }
  DeviceBuffer(DType d, std::vector<int64_t> shape) : DeviceBuffer(HostTensor(d, std::move(shape))) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { device_free(Backend::cuda, ptr_); }
  TensorView view() const {
    TensorView v = t_.view();
    v.data = ptr_;
    v.device = Device::cuda;
    return v;
  }
  TensorView rows(int64_t b, int64_t e) const { return view().rows(b, e); }
  HostTensor host() const {
    HostTensor h(t_.dtype(), t_.shape());
    copy_to_host(Backend::cuda, h.data(), ptr_, bytes_);
    return h;
  }

 private:
  size_t bytes_;
  void* ptr_;
  HostTensor t_;
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

}  // namespace samebits::testing_cuda
