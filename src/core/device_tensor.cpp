// DeviceTensor: an owned, contiguous tensor in a backend's memory (see samebits/device_tensor.hpp).
#include "samebits/device_tensor.hpp"

#include <cstring>

#include "samebits/device.hpp"
#include "samebits/error.hpp"

namespace samebits {


void DeviceTensor::Free::operator()(void* p) const {
  if (!p) return;
  DeviceStreamScope on(stream);  // freed in the order of the stream that allocated it
  device_free(backend, p);
}

DeviceTensor::DeviceTensor(Backend backend, DType dtype, std::vector<int64_t> shape)
    : DeviceTensor(backend, dtype, std::move(shape), 0) {}

DeviceTensor::DeviceTensor(Backend backend, DType dtype, std::vector<int64_t> shape, int fill_byte)
    : backend_(backend), dtype_(dtype), shape_(std::move(shape)),
      data_(device_alloc(backend, bytes()), Free{backend, current_device_stream()}) {
  if (fill_byte >= 0) device_fill(backend_, data_.get(), fill_byte, bytes());
}

DeviceTensor DeviceTensor::poisoned(Backend backend, DType dtype, std::vector<int64_t> shape) {
  return DeviceTensor(backend, dtype, std::move(shape), 0xFF);
}

DeviceTensor DeviceTensor::uninitialized(Backend backend, DType dtype, std::vector<int64_t> shape) {
  return DeviceTensor(backend, dtype, std::move(shape), -1);
}

DeviceTensor DeviceTensor::from_host(Backend backend, const HostTensor& host) { return from_host(backend, host.view()); }

DeviceTensor DeviceTensor::from_host(Backend backend, const TensorView& host) {
  if (host.device != Device::cpu || !host.is_contiguous())
    throw Error("DeviceTensor::from_host", "host", "needs a contiguous CPU view");
  DeviceTensor t(backend, host.dtype, std::vector<int64_t>(host.shape.begin(), host.shape.begin() + host.ndim), -1);
  copy_to_device(backend, t.data_.get(), host.data, t.bytes());  // every byte: no fill before
  return t;
}

DeviceTensor::DeviceTensor(const DeviceTensor& o) : DeviceTensor(o.backend_, o.dtype_, o.shape_, -1) {
  copy_on_device(backend_, data_.get(), o.data_.get(), bytes());
}

DeviceTensor& DeviceTensor::operator=(const DeviceTensor& o) {
  if (this != &o) *this = DeviceTensor(o);
  return *this;
}

int64_t DeviceTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

TensorView DeviceTensor::view() const {
  return TensorView::of(data_.get(), dtype_, shape_.data(), int(shape_.size()),
                        backend_ == Backend::cuda ? Device::cuda : Device::cpu);
}

HostTensor DeviceTensor::to_host() const {
  HostTensor h(dtype_, shape_);
  copy_to_host(backend_, h.data(), data_.get(), bytes());
  return h;
}

HostTensor DeviceTensor::rows_to_host(int64_t begin, int64_t end) const {
  if (begin < 0 || end < begin || end > rows()) throw Error("DeviceTensor::rows_to_host", "rows", "out of range");
  std::vector<int64_t> shape = shape_;
  shape[0] = end - begin;
  HostTensor h(dtype_, shape);
  const size_t row_bytes = rows() ? bytes() / size_t(rows()) : 0;
  copy_to_host(backend_, h.data(), static_cast<const uint8_t*>(data_.get()) + size_t(begin) * row_bytes,
               size_t(end - begin) * row_bytes);
  return h;
}

void DeviceTensor::upload(const HostTensor& h) {
  if (h.dtype() != dtype_ || h.numel() != numel())
    throw Error("DeviceTensor::upload", "host", "dtype or element count differs from the device tensor's");
  copy_to_device(backend_, data_.get(), h.data(), bytes());
}

void DeviceTensor::copy_rows_from(const DeviceTensor& src, int64_t src_row, int64_t dst_row, int64_t n) {
  copy_row_blocks_from(src, src_row, n, dst_row, n, n, 1);
}

void DeviceTensor::copy_row_blocks_from(const DeviceTensor& src, int64_t src_row, int64_t src_stride, int64_t dst_row,
                                        int64_t dst_stride, int64_t n, int64_t blocks) {
  const size_t row_bytes = rows() ? bytes() / size_t(rows()) : 0;
  const size_t src_row_bytes = src.rows() ? src.bytes() / size_t(src.rows()) : 0;
  if (src.dtype_ != dtype_ || src_row_bytes != row_bytes || src.backend_ != backend_)
    throw Error("DeviceTensor::copy_rows_from", "src", "rows of another size, dtype or backend");
  if (blocks <= 0 || n <= 0) return;
  const int64_t src_last = src_row + (blocks - 1) * src_stride + n, dst_last = dst_row + (blocks - 1) * dst_stride + n;
  if (src_row < 0 || dst_row < 0 || src_stride < n || dst_stride < n || src_last > src.rows() || dst_last > rows())
    throw Error("DeviceTensor::copy_rows_from", "rows", "out of range or overlapping blocks");
  copy_blocks_on_device(backend_, static_cast<uint8_t*>(data_.get()) + size_t(dst_row) * row_bytes,
                        size_t(dst_stride) * row_bytes,
                        static_cast<const uint8_t*>(src.data_.get()) + size_t(src_row) * row_bytes,
                        size_t(src_stride) * row_bytes, size_t(n) * row_bytes, size_t(blocks));
}

}  // namespace samebits
