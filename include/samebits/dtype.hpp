// samebits/dtype.hpp — element types and their exact, round-to-nearest-even conversions.
//
// Storage types are bf16, fp16 and fp32 (fp64 is for the reference backend's truth mode);
// int32 carries token ids / positions / sequence tables and uint8 carries masks; int64 token ids
// (torch's index type) are taken where an op says so (the embedding's ids).
// Every narrowing conversion rounds to nearest, ties to even, directly from the source
// value (never through an intermediate type, so double -> bf16 is not double-rounded).
#pragma once
#include <cstdint>
#include <string>

namespace samebits {

enum class DType : uint8_t { bf16, f16, f32, f64, i32, u8, i64 };

const char* dtype_name(DType d);                  // "bf16", "fp16", "fp32", "fp64", "int32", "uint8", "int64"
DType dtype_from_name(const std::string& name);   // throws samebits::Error on an unknown name
int dtype_size(DType d);                          // bytes per element
bool is_floating(DType d);

struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

float to_float(bf16 v);
float to_float(f16 v);
double to_double(bf16 v);
double to_double(f16 v);

bf16 bf16_from_float(float v);     // RNE; NaN stays NaN (quiet), overflow -> inf
bf16 bf16_from_double(double v);
f16 f16_from_float(float v);       // RNE, subnormals handled, overflow -> inf
f16 f16_from_double(double v);
float float_from_double(double v); // the C++ conversion: RNE under the default rounding mode

// Reads element i (flat, contiguous index) of a buffer of dtype d as double / float.
double load_as_double(const void* data, DType d, int64_t i);
// Writes v, rounded RNE to dtype d, into element i.
void store_from_double(void* data, DType d, int64_t i, double v);

// Distance in units in the last place of dtype d between two finite values of that dtype
// (0 for bit-identical values; counts the representable values between them).
int64_t ulp_distance(double a, double b, DType d);

}  // namespace samebits
