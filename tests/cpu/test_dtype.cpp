// Conversions: exhaustive round trips, round-to-nearest-even at ties, subnormals, overflow, NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "samebits/dtype.hpp"
#include "samebits/error.hpp"
#include "samebits/harness.hpp"

using namespace samebits;

TEST(DType, Bf16RoundTripsEveryFiniteValueExactly) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const bf16 v{uint16_t(b)};
    const float f = to_float(v);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(to_float(bf16_from_float(f))));
      continue;
    }
    EXPECT_EQ(bf16_from_float(f).bits, v.bits) << b;
    EXPECT_EQ(bf16_from_double(double(f)).bits, v.bits) << b;
  }
}

TEST(DType, Fp16RoundTripsEveryFiniteValueExactly) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const f16 v{uint16_t(b)};
    const float f = to_float(v);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(to_float(f16_from_float(f))));
      continue;
    }
    EXPECT_EQ(f16_from_float(f).bits, v.bits) << b;
  }
}

TEST(DType, Bf16TiesRoundToEven) {
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: even mantissa (1.0) wins.
  EXPECT_EQ(bf16_from_float(1.0f + 0x1p-8f).bits, bf16_from_float(1.0f).bits);
  // 1 + 3·2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(to_float(bf16_from_float(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
  // Just above the tie rounds up.
  EXPECT_EQ(to_float(bf16_from_float(std::nextafter(1.0f + 0x1p-8f, 2.0f))), 1.0f + 0x1p-7f);
  // double -> bf16 is not double-rounded through float: a value just above a bf16 tie that rounds
  // to the tie in float must still round up.
  const double just_above_tie = 1.0 + 0x1p-8 + 0x1p-40;
  EXPECT_EQ(to_float(bf16_from_double(just_above_tie)), 1.0f + 0x1p-7f);
  EXPECT_EQ(to_float(bf16_from_float(float(just_above_tie))), 1.0f);  // what double rounding gives
}

TEST(DType, Fp16SubnormalsOverflowAndTies) {
  EXPECT_EQ(f16_from_double(0x1p-24).bits, 0x0001);       // smallest subnormal
  EXPECT_EQ(f16_from_double(0x1p-25).bits, 0x0000);       // tie between 0 and 2^-24 -> even (0)
  EXPECT_EQ(f16_from_double(3 * 0x1p-25).bits, 0x0002);   // tie between 1 and 2 ulps -> even (2)
  EXPECT_EQ(f16_from_double(65504.0).bits, 0x7bff);       // max finite
  EXPECT_EQ(f16_from_double(65520.0).bits, 0x7c00);       // halfway to 2^16 -> inf
  EXPECT_EQ(f16_from_double(65519.99).bits, 0x7bff);
  EXPECT_EQ(f16_from_double(-1e9).bits, 0xfc00);
  EXPECT_EQ(to_float(f16{0x3c00}), 1.0f);
  EXPECT_EQ(to_float(f16{0x0001}), 0x1p-24f);
}

TEST(DType, Bf16OverflowAndNaN) {
  EXPECT_EQ(bf16_from_float(std::numeric_limits<float>::max()).bits, 0x7f80);
  EXPECT_EQ(bf16_from_float(-std::numeric_limits<float>::infinity()).bits, 0xff80);
  EXPECT_TRUE(std::isnan(to_float(bf16_from_float(std::nanf("")))));
  EXPECT_TRUE(std::isnan(to_float(bf16_from_double(std::nan("")))));
}

TEST(DType, DoubleToBf16MatchesFloatPathOnRandomFloats) {
  harness::Rng rng(5);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = uint32_t(rng.next());
    float f;
    std::memcpy(&f, &u, 4);
    if (!std::isfinite(f)) continue;
    ASSERT_EQ(bf16_from_float(f).bits, bf16_from_double(double(f)).bits) << f;
  }
}

TEST(DType, UlpDistanceCountsRepresentableSteps) {
  EXPECT_EQ(ulp_distance(1.0, 1.0, DType::bf16), 0);
  EXPECT_EQ(ulp_distance(1.0, 1.0 + 0x1p-7, DType::bf16), 1);
  EXPECT_EQ(ulp_distance(-0x1p-133, 0x1p-133, DType::bf16), 2);  // across zero
  EXPECT_EQ(ulp_distance(1.0, std::nextafter(1.0f, 2.0f), DType::f32), 1);
}

TEST(DType, NamesRoundTripAndUnknownNamesAreErrors) {
  for (DType d : {DType::bf16, DType::f16, DType::f32, DType::f64, DType::i32, DType::u8})
    EXPECT_EQ(dtype_from_name(dtype_name(d)), d);
  EXPECT_THROW(dtype_from_name("fp8"), Error);
}
