// samebits/host_tensor.hpp — an owned tensor in host memory, the type the model chain, the tools
// and the harness hand host data around in (gradients copied back, activations, test inputs).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "samebits/dtype.hpp"
#include "samebits/tensor.hpp"

namespace samebits {

// An owning host tensor. Its bytes sit between two guard regions whose pattern is checked after
// every run, so a kernel writing past either end of an output is caught.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);  // zero-filled
  static HostTensor poisoned(DType dtype, std::vector<int64_t> shape);  // 0xFF bytes (NaN)

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  int64_t rows() const { return shape_.empty() ? 0 : shape_[0]; }
  int64_t row_numel() const;  // elements per leading-dim row
  size_t bytes() const { return size_t(numel()) * size_t(dtype_size(dtype_)); }
  bool empty() const { return storage_.empty(); }
  void* data();
  const void* data() const;
  TensorView view() const;  // a contiguous CPU view
  bool guards_intact() const;
  // The whole guarded allocation (guard, data, guard), for mirroring to a device.
  void* storage() { return storage_.data(); }
  size_t storage_bytes() const { return storage_.size(); }
  static constexpr size_t kGuardBytes = 64;

  double get(int64_t i) const { return load_as_double(data(), dtype_, i); }
  void set(int64_t i, double v) { store_from_double(data(), dtype_, i, v); }
  HostTensor converted(DType to) const;  // element-wise conversion (RNE when narrowing)
  HostTensor slice_rows(int64_t begin, int64_t end) const;
  void copy_rows_from(const HostTensor& src, int64_t src_row, int64_t dst_row, int64_t n);

 private:
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  std::vector<uint8_t> storage_;  // [guard][data][guard]
};

}  // namespace samebits
