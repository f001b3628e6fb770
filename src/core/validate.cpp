#include "samebits/validate.hpp"

#include <cmath>
#include <cstdint>
#include <string>

namespace samebits {

void Validator::fail(const char* arg, const std::string& problem) const {
  throw Error(op_, arg, problem);
}

void Validator::required(const char* name, const TensorView& t, int ndim) const {
  if (t.is_none()) fail(name, "is required but was not given");
  optional(name, t, ndim);
}

void Validator::optional(const char* name, const TensorView& t, int ndim) const {
  if (t.is_none()) return;
  const Device want = ctx_.backend == Backend::cpu ? Device::cpu : Device::cuda;
  if (t.device != want)
    fail(name, std::string("is on the ") + device_name(t.device) + " but the op runs on the " +
                   backend_name(ctx_.backend) + " backend");
  if (t.ndim != ndim)
    fail(name, "expected a " + std::to_string(ndim) + "-D tensor, got shape " + t.shape_string());
  if (!t.is_contiguous()) fail(name, "must be contiguous (row-major), got strides that are not");
  if (t.numel() > 0 && t.data == nullptr) fail(name, "has elements but a null data pointer");
  const auto addr = reinterpret_cast<std::uintptr_t>(t.data);
  // Element alignment everywhere; kernels that need more (TMA's 16 bytes) check it themselves.
  const int align = dtype_size(t.dtype);
  if (addr % align != 0)
    fail(name, "data pointer is not aligned to " + std::to_string(align) + " bytes");
}

void Validator::floating(const char* name, const TensorView& t) const {
  if (!is_floating(t.dtype))
    fail(name, std::string("expected a floating dtype (bf16, fp16, fp32), got ") +
                   dtype_name(t.dtype));
  if (t.dtype == DType::f64 && ctx_.backend != Backend::cpu)
    fail(name, "fp64 is only supported by the CPU reference backend");
}

void Validator::dtype(const char* name, const TensorView& t, DType expected) const {
  if (t.dtype != expected)
    fail(name, std::string("expected dtype ") + dtype_name(expected) + ", got " +
                   dtype_name(t.dtype));
}

void Validator::same_dtype(const char* name, const TensorView& t, const char* ref,
                           const TensorView& r) const {
  if (t.dtype != r.dtype)
    fail(name, std::string("dtype ") + dtype_name(t.dtype) + " does not match " + ref + "'s " +
                   dtype_name(r.dtype));
}

void Validator::accumulator(const char* name, const TensorView& t) const {
  const DType want = ctx_.precision == Precision::truth_fp64 ? DType::f64 : DType::f32;
  if (t.dtype != want)
    fail(name, std::string("gradient accumulators are ") + dtype_name(want) + ", got " +
                   dtype_name(t.dtype));
}

void Validator::dim(const char* name, const TensorView& t, int d, int64_t expected,
                    const char* what) const {
  if (t.shape[d] != expected)
    fail(name, "shape " + t.shape_string() + ": dimension " + std::to_string(d) + " must be " +
                   std::to_string(expected) + " (" + what + ")");
}

void Validator::same_shape(const char* name, const TensorView& t, const char* ref,
                           const TensorView& r) const {
  bool same = t.ndim == r.ndim;
  for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == r.shape[d];
  if (!same)
    fail(name, "shape " + t.shape_string() + " does not match " + ref + "'s " + r.shape_string());
}

void Validator::nonempty(const char* name, const TensorView& t) const {
  if (t.numel() == 0) fail(name, "is empty (shape " + t.shape_string() + ")");
}

template <class T>
static int64_t first_nonfinite(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(double(p[i]))) return i;
  return -1;
}

int64_t first_nonfinite_index(const TensorView& t) {
  const int64_t n = t.numel();
  switch (t.dtype) {
    case DType::f32: return first_nonfinite(t.as<const float>(), n);
    case DType::f64: return first_nonfinite(t.as<const double>(), n);
    case DType::bf16: {
      const auto* p = t.as<const bf16>();
      for (int64_t i = 0; i < n; ++i)
        if ((p[i].bits & 0x7f80) == 0x7f80) return i;
      return -1;
    }
    case DType::f16: {
      const auto* p = t.as<const f16>();
      for (int64_t i = 0; i < n; ++i)
        if ((p[i].bits & 0x7c00) == 0x7c00) return i;
      return -1;
    }
    default: return -1;
  }
}

void Validator::finite(const char* name, const TensorView& t) const {
  if (!ctx_.check_finite_inputs || t.is_none() || t.device != Device::cpu) return;
  const int64_t bad = first_nonfinite_index(t);
  if (bad >= 0)
    fail(name, "holds a non-finite value (NaN or Inf) at flat index " + std::to_string(bad));
}

void Validator::int_range(const char* name, const TensorView& t, int64_t lo, int64_t hi,
                          const TensorView& row_mask, bool use_allowed, int32_t allowed) const {
  if (t.device != Device::cpu) return;  // device-side checks live in the CUDA backend
  const auto* m = row_mask.present() ? row_mask.as<const uint8_t>() : nullptr;
  const int64_t n = t.numel();
  const int64_t per_row = t.ndim > 0 && t.shape[0] > 0 ? n / t.shape[0] : 1;
  auto scan = [&](const auto* v) {
    for (int64_t i = 0; i < n; ++i) {
      if (m && m[i / per_row] == 0) continue;
      if (use_allowed && v[i] == allowed) continue;
      if (v[i] < lo || v[i] >= hi)
        fail(name, "value " + std::to_string(v[i]) + " at index " + std::to_string(i) +
                       " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + ")");
    }
  };
  if (t.dtype == DType::i64) scan(t.as<const int64_t>());
  else scan(t.as<const int32_t>());
}

void Validator::flags(const char* name, const TensorView& t) const {
  if (t.is_none() || t.device != Device::cpu || t.dtype != DType::u8) return;
  const auto* v = t.as<const uint8_t>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i)
    if (v[i] > 1) fail(name, "value " + std::to_string(int(v[i])) + " at index " + std::to_string(i) + " is not 0 or 1");
}

void Validator::no_alias(const char* out_name, const TensorView& out, const char* in_name,
                         const TensorView& in) const {
  if (out.is_none() || in.is_none()) return;
  const char* a = static_cast<const char*>(out.data);
  const char* b = static_cast<const char*>(in.data);
  if (a < b + in.bytes() && b < a + out.bytes())
    fail(out_name, std::string("must not overlap ") + in_name);
}

}  // namespace samebits
