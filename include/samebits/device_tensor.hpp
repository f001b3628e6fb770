// samebits/device_tensor.hpp — an owned tensor on a backend's memory (host memory on Backend::cpu,
// device memory on Backend::cuda): what the model chain keeps its activations, KV cache and
// gradient accumulators in. Copies to and from the host are explicit.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "samebits/context.hpp"
#include "samebits/host_tensor.hpp"
#include "samebits/tensor.hpp"

namespace samebits {

class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(Backend backend, DType dtype, std::vector<int64_t> shape);  // zero-filled
  static DeviceTensor poisoned(Backend backend, DType dtype, std::vector<int64_t> shape);  // 0xFF bytes (NaN)
  // Contents undefined: for outputs whose every element an op writes before anything reads it.
  static DeviceTensor uninitialized(Backend backend, DType dtype, std::vector<int64_t> shape);
  static DeviceTensor from_host(Backend backend, const HostTensor& host);
  static DeviceTensor from_host(Backend backend, const TensorView& host);  // a contiguous CPU view
  DeviceTensor(const DeviceTensor& other);  // a deep copy on the same backend
  DeviceTensor& operator=(const DeviceTensor& other);
  DeviceTensor(DeviceTensor&&) noexcept = default;
  DeviceTensor& operator=(DeviceTensor&&) noexcept = default;

  Backend backend() const { return backend_; }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  int64_t rows() const { return shape_.empty() ? 0 : shape_[0]; }
  size_t bytes() const { return size_t(numel()) * size_t(dtype_size(dtype_)); }
  TensorView view() const;  // contiguous, on the backend's device

  HostTensor to_host() const;
  HostTensor rows_to_host(int64_t begin, int64_t end) const;
  void upload(const HostTensor& host);  // same dtype and element count
  // Rows [src_row, src_row + n) of `src` into rows [dst_row, …) of this tensor (same row size).
  void copy_rows_from(const DeviceTensor& src, int64_t src_row, int64_t dst_row, int64_t n);
  // `blocks` runs of n rows in one copy: run i from rows src_row + i·src_stride … of `src` to rows
  // dst_row + i·dst_stride … of this tensor (a decode step's new keys into their cache slots).
  void copy_row_blocks_from(const DeviceTensor& src, int64_t src_row, int64_t src_stride, int64_t dst_row,
                            int64_t dst_stride, int64_t n, int64_t blocks);

 private:
  DeviceTensor(Backend backend, DType dtype, std::vector<int64_t> shape, int fill_byte);  // < 0: not filled
  struct Free {
    Backend backend;
    void* stream;  // the device stream it was allocated on (samebits/device.hpp)
    void operator()(void* p) const;
  };
  Backend backend_ = Backend::cpu;
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  std::unique_ptr<void, Free> data_{nullptr, Free{Backend::cpu, nullptr}};
};

}  // namespace samebits
