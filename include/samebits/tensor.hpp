// samebits/tensor.hpp — a non-owning tensor view: pointer, dtype, shape, strides (in elements), device.
// A default-constructed view is "none": the way an optional argument is left out.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "samebits/dtype.hpp"

namespace samebits {

enum class Device : uint8_t { cpu, cuda };
const char* device_name(Device d);

constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = -1;  // -1: none (an omitted optional argument)
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};

  // A contiguous (row-major) view.
  static TensorView of(void* data, DType dtype, std::initializer_list<int64_t> shape,
                       Device device = Device::cpu);
  static TensorView of(void* data, DType dtype, const int64_t* shape, int ndim,
                       Device device = Device::cpu);

  bool is_none() const { return ndim < 0; }
  bool present() const { return ndim >= 0; }
  int64_t numel() const;
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  bool is_contiguous() const;
  int64_t bytes() const { return numel() * dtype_size(dtype); }
  std::string shape_string() const;  // "[8, 128]"

  template <class T> T* as() const { return static_cast<T*>(data); }
  // A contiguous view with the same data and a new shape of the same element count.
  TensorView reshaped(std::initializer_list<int64_t> new_shape) const;
  // Rows [begin, end) of the leading dimension.
  TensorView rows(int64_t begin, int64_t end) const;
};

}  // namespace samebits
