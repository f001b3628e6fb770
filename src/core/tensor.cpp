#include "samebits/tensor.hpp"

#include <string>

#include "samebits/error.hpp"

namespace samebits {

const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

TensorView TensorView::of(void* data, DType dtype, const int64_t* shape, int ndim, Device device) {
  if (ndim < 0 || ndim > kMaxDims)
    throw Error("TensorView::of", "shape", "rank " + std::to_string(ndim) + " is outside 0..4");
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = ndim;
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] < 0) throw Error("TensorView::of", "shape", "negative extent");
    t.shape[d] = shape[d];
    t.strides[d] = stride;
    stride *= shape[d];
  }
  return t;
}

TensorView TensorView::of(void* data, DType dtype, std::initializer_list<int64_t> shape,
                          Device device) {
  return of(data, dtype, shape.begin(), int(shape.size()), device);
}

int64_t TensorView::numel() const {
  if (ndim < 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string TensorView::shape_string() const {
  if (ndim < 0) return "none";
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

TensorView TensorView::reshaped(std::initializer_list<int64_t> new_shape) const {
  TensorView t = of(data, dtype, new_shape, device);
  if (t.numel() != numel() || !is_contiguous())
    throw Error("TensorView::reshaped", "shape",
                "cannot view " + shape_string() + " as " + t.shape_string());
  return t;
}

TensorView TensorView::rows(int64_t begin, int64_t end) const {
  if (ndim < 1 || begin < 0 || end < begin || end > shape[0])
    throw Error("TensorView::rows", "range", "rows [" + std::to_string(begin) + ", " +
                std::to_string(end) + ") outside " + shape_string());
  TensorView t = *this;
  t.shape[0] = end - begin;
  t.data = static_cast<char*>(data) + begin * strides[0] * dtype_size(dtype);
  return t;
}

}  // namespace samebits
