// Element types and round-to-nearest-even conversions.
#include "samebits/dtype.hpp"

#include <cmath>
#include <cstring>
#include <limits>

#include "samebits/error.hpp"

namespace samebits {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::bf16: return "bf16";
    case DType::f16: return "fp16";
    case DType::f32: return "fp32";
    case DType::f64: return "fp64";
    case DType::i32: return "int32";
    case DType::u8: return "uint8";
    case DType::i64: return "int64";
  }
  return "?";
}

DType dtype_from_name(const std::string& n) {
  if (n == "bf16" || n == "bfloat16") return DType::bf16;
  if (n == "fp16" || n == "f16" || n == "float16") return DType::f16;
  if (n == "fp32" || n == "f32" || n == "float32") return DType::f32;
  if (n == "fp64" || n == "f64" || n == "float64") return DType::f64;
  if (n == "int32" || n == "i32") return DType::i32;
  if (n == "uint8" || n == "u8") return DType::u8;
  if (n == "int64" || n == "i64") return DType::i64;
  throw Error("dtype_from_name", "name", "unknown dtype '" + n + "'");
}

int dtype_size(DType d) {
  switch (d) {
    case DType::bf16: case DType::f16: return 2;
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::u8: return 1;
  }
  return 0;
}

bool is_floating(DType d) {
  return d == DType::bf16 || d == DType::f16 || d == DType::f32 || d == DType::f64;
}

static uint32_t bits_of(float v) { uint32_t u; std::memcpy(&u, &v, 4); return u; }
static float float_of(uint32_t u) { float v; std::memcpy(&v, &u, 4); return v; }

float to_float(bf16 v) { return float_of(uint32_t(v.bits) << 16); }
double to_double(bf16 v) { return to_float(v); }

float to_float(f16 v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1f;
  const uint32_t man = v.bits & 0x3ff;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {                                                      // zero / subnormal
    const float mag = std::ldexp(float(man), -24);                     // exact
    return sign ? -mag : mag;
  }
  return float_of(sign | ((exp + 112) << 23) | (man << 13));
}
double to_double(f16 v) { return to_float(v); }

bf16 bf16_from_float(float v) {
  uint32_t u = bits_of(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // ties to even; overflow carries into the exponent and gives inf
  return bf16{uint16_t(u >> 16)};
}

// Rounds a finite double to the nearest value with `mant_bits` fraction bits, minimum normal
// exponent `emin` (subnormals below it) and largest finite value `max_finite`, ties to even.
// Scaling by a power of two is exact, and nearbyint rounds half to even in the default mode.
static double round_to_format(double x, int mant_bits, int emin, double max_finite) {
  if (!std::isfinite(x) || x == 0.0) return x;
  int e = 0;
  std::frexp(x, &e);            // |x| in [2^(e-1), 2^e)
  int lead = e - 1;
  if (lead < emin) lead = emin;  // subnormal range: fixed quantum
  const double quantum = std::ldexp(1.0, lead - mant_bits);
  const double r = std::nearbyint(x / quantum) * quantum;
  if (std::fabs(r) > max_finite) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

bf16 bf16_from_double(double v) {
  if (std::isnan(v)) return bf16{0x7fc0};
  const double r = round_to_format(v, 7, -126, 3.3895313892515355e38);
  return bf16_from_float(static_cast<float>(r));  // r is exactly representable: no second rounding
}

f16 f16_from_double(double v) {
  if (std::isnan(v)) return f16{0x7e00};
  const double r = round_to_format(v, 10, -14, 65504.0);
  const uint16_t sign = std::signbit(r) ? 0x8000 : 0;
  const double a = std::fabs(r);
  if (std::isinf(a)) return f16{uint16_t(sign | 0x7c00)};
  if (a == 0.0) return f16{sign};
  int e = 0;
  std::frexp(a, &e);
  const int lead = e - 1;
  if (lead < -14) return f16{uint16_t(sign | uint16_t(std::ldexp(a, 24)))};  // subnormal
  const uint16_t man = uint16_t(std::ldexp(a, 10 - lead) - 1024.0);
  return f16{uint16_t(sign | uint16_t((lead + 15) << 10) | man)};
}

// float -> fp16 through double is exact-then-round: a float converts to double exactly.
f16 f16_from_float(float v) { return f16_from_double(double(v)); }

float float_from_double(double v) { return static_cast<float>(v); }

double load_as_double(const void* data, DType d, int64_t i) {
  switch (d) {
    case DType::bf16: return to_double(static_cast<const bf16*>(data)[i]);
    case DType::f16: return to_double(static_cast<const f16*>(data)[i]);
    case DType::f32: return static_cast<const float*>(data)[i];
    case DType::f64: return static_cast<const double*>(data)[i];
    case DType::i32: return static_cast<const int32_t*>(data)[i];
    case DType::u8: return static_cast<const uint8_t*>(data)[i];
    case DType::i64: return double(static_cast<const int64_t*>(data)[i]);
  }
  return 0;
}

void store_from_double(void* data, DType d, int64_t i, double v) {
  switch (d) {
    case DType::bf16: static_cast<bf16*>(data)[i] = bf16_from_double(v); return;
    case DType::f16: static_cast<f16*>(data)[i] = f16_from_double(v); return;
    case DType::f32: static_cast<float*>(data)[i] = static_cast<float>(v); return;
    case DType::f64: static_cast<double*>(data)[i] = v; return;
    case DType::i32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v); return;
    case DType::u8: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(v); return;
    case DType::i64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v); return;
  }
}

// Maps a value of a binary float format to a monotonic integer line (sign-magnitude -> two's
// complement order), so the difference of two keys counts the representable values between.
static int64_t ordered_key(double v, DType d) {
  int64_t mag = 0;
  bool neg = std::signbit(v);
  switch (d) {
    case DType::bf16: mag = bf16_from_double(v).bits & 0x7fff; break;
    case DType::f16: mag = f16_from_double(v).bits & 0x7fff; break;
    case DType::f32: mag = bits_of(float(v)) & 0x7fffffffu; break;
    default: {
      uint64_t u; std::memcpy(&u, &v, 8);
      mag = int64_t(u & 0x7fffffffffffffffull) >> 1;  // halve to stay in range for fp64
      break;
    }
  }
  return neg ? -mag : mag;
}

int64_t ulp_distance(double a, double b, DType d) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<int64_t>::max();
  const int64_t ka = ordered_key(a, d), kb = ordered_key(b, d);
  return ka > kb ? ka - kb : kb - ka;
}

}  // namespace samebits
