// Row conversion between storage dtypes and the CPU backend's arithmetic types.
#include <cstring>

#include "cpu/common.hpp"

namespace samebits::cpu {

template <class Acc>
void load(const TensorView& t, int64_t first, int64_t n, Acc* out) {
  switch (t.dtype) {
    case DType::bf16: {
      const auto* p = t.as<const bf16>() + first;
      for (int64_t i = 0; i < n; ++i) out[i] = Acc(to_float(p[i]));
      return;
    }
    case DType::f16: {
      const auto* p = t.as<const f16>() + first;
      for (int64_t i = 0; i < n; ++i) out[i] = Acc(to_float(p[i]));
      return;
    }
    case DType::f32: {
      const auto* p = t.as<const float>() + first;
      for (int64_t i = 0; i < n; ++i) out[i] = Acc(p[i]);
      return;
    }
    case DType::f64: {
      // fp64 storage is the truth mode's; the fp32 backend rounds it once (RNE) on load.
      const auto* p = t.as<const double>() + first;
      for (int64_t i = 0; i < n; ++i) out[i] = Acc(p[i]);
      return;
    }
    case DType::i32: {
      const auto* p = t.as<const int32_t>() + first;
      for (int64_t i = 0; i < n; ++i) out[i] = Acc(p[i]);
      return;
    }
    case DType::u8: {
      const auto* p = t.as<const uint8_t>() + first;
      for (int64_t i = 0; i < n; ++i) out[i] = Acc(p[i]);
      return;
    }
    case DType::i64: {
      const auto* p = t.as<const int64_t>() + first;
      for (int64_t i = 0; i < n; ++i) out[i] = Acc(p[i]);
      return;
    }
  }
}

template <class Acc>
void store(const TensorView& t, int64_t first, int64_t n, const Acc* in) {
  switch (t.dtype) {
    case DType::bf16: {
      auto* p = t.as<bf16>() + first;
      for (int64_t i = 0; i < n; ++i)
        p[i] = sizeof(Acc) == 4 ? bf16_from_float(float(in[i])) : bf16_from_double(double(in[i]));
      return;
    }
    case DType::f16: {
      auto* p = t.as<f16>() + first;
      for (int64_t i = 0; i < n; ++i)
        p[i] = sizeof(Acc) == 4 ? f16_from_float(float(in[i])) : f16_from_double(double(in[i]));
      return;
    }
    case DType::f32: {
      auto* p = t.as<float>() + first;
      for (int64_t i = 0; i < n; ++i) p[i] = float(in[i]);
      return;
    }
    case DType::f64: {
      auto* p = t.as<double>() + first;
      for (int64_t i = 0; i < n; ++i) p[i] = double(in[i]);
      return;
    }
    default:
      return;  // integer outputs are written directly by the kernels that have them
  }
}

template void load<float>(const TensorView&, int64_t, int64_t, float*);
template void load<double>(const TensorView&, int64_t, int64_t, double*);
template void store<float>(const TensorView&, int64_t, int64_t, const float*);
template void store<double>(const TensorView&, int64_t, int64_t, const double*);

}  // namespace samebits::cpu
