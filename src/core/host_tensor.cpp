// Guarded host tensors: the bytes sit between two guard regions whose pattern the harness checks
// after every run, so a kernel writing past either end of an output is caught.
#include "samebits/host_tensor.hpp"

#include <cstring>

#include <fmt/format.h>

#include "samebits/device.hpp"
#include "samebits/error.hpp"

namespace samebits {

namespace {
constexpr size_t kGuard = HostTensor::kGuardBytes;  // bytes on each side; keeps the data 64-byte offset
constexpr uint8_t kGuardByte = 0xA5;
}  // namespace

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  storage_.assign(bytes() + 2 * kGuard, 0);
  std::memset(storage_.data(), kGuardByte, kGuard);
  std::memset(storage_.data() + kGuard + bytes(), kGuardByte, kGuard);
}

HostTensor HostTensor::poisoned(DType dtype, std::vector<int64_t> shape) {
  HostTensor t(dtype, std::move(shape));
  std::memset(t.data(), 0xFF, t.bytes());
  return t;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (auto d : shape_) n *= d;
  return shape_.empty() && storage_.empty() ? 0 : n;
}

int64_t HostTensor::row_numel() const {
  int64_t n = 1;
  for (size_t d = 1; d < shape_.size(); ++d) n *= shape_[d];
  return n;
}

void* HostTensor::data() { return storage_.data() + kGuard; }
const void* HostTensor::data() const { return storage_.data() + kGuard; }

TensorView HostTensor::view() const {
  return TensorView::of(const_cast<void*>(data()), dtype_, shape_.data(), int(shape_.size()));
}

bool HostTensor::guards_intact() const {
  for (size_t i = 0; i < kGuard; ++i)
    if (storage_[i] != kGuardByte || storage_[kGuard + bytes() + i] != kGuardByte) return false;
  return true;
}

HostTensor HostTensor::converted(DType to) const {
  HostTensor out(to, shape_);
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) out.set(i, get(i));
  return out;
}

HostTensor HostTensor::slice_rows(int64_t begin, int64_t end) const {
  auto shape = shape_;
  shape[0] = end - begin;
  HostTensor out(dtype_, shape);
  out.copy_rows_from(*this, begin, 0, end - begin);
  return out;
}

void HostTensor::copy_rows_from(const HostTensor& src, int64_t src_row, int64_t dst_row, int64_t n) {
  if (src.dtype_ != dtype_ || src.row_numel() != row_numel() || src_row + n > src.rows() ||
      dst_row + n > rows())
    throw Error("HostTensor::copy_rows_from", "src",
                fmt::format("rows do not fit: {} [{}] rows {}+{} into {} [{}] at row {}",
                            dtype_name(src.dtype_), fmt::join(src.shape_, ","), src_row, n,
                            dtype_name(dtype_), fmt::join(shape_, ","), dst_row));
  const size_t row_bytes = size_t(row_numel()) * size_t(dtype_size(dtype_));
  std::memcpy(static_cast<char*>(data()) + size_t(dst_row) * row_bytes,
              static_cast<const char*>(src.data()) + size_t(src_row) * row_bytes, size_t(n) * row_bytes);
}

}  // namespace samebits
